"""The CLI that reads everything (issue 20 items 2 and 3), a client of the projections service's read API.

    hostmove host list | host show --host H
    hostmove box list | box show --box L
    hostmove move list [--live] | move history --host H | move show MOVE_ID [--host H]
    hostmove alerts [--follow]
    hostmove completion bash|zsh

Each takes ``-o table|json`` (before or after the verb): ``json`` prints the API's answer as it is, so a script reads
exactly what the dashboard reads. ``move status -o json`` (the door's answer) gains ``next_steps``
(:func:`next_steps`). Configuration: ``HOSTMOVE_PROJECTIONS_URL`` (default ``http://127.0.0.1:8080``) and
``HOSTMOVE_TOKEN`` (a status or operator token, sent as a bearer token; never printed).

The shape: pure renderers (:func:`table`, :func:`rows_of`) and :func:`next_steps`; :func:`run` is the thin shell.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import sys
from collections.abc import Mapping, Sequence
from typing import Any, TextIO
from urllib.parse import quote, urlencode

import aiohttp

from hostmove import exitcodes
from kernel.timetext import utc_text

ENV_URL = "HOSTMOVE_PROJECTIONS_URL"
ENV_TOKEN = "HOSTMOVE_TOKEN"
DEFAULT_URL = "http://127.0.0.1:8080"
OUTPUTS = ("table", "json")
FOLLOW_EVERY_S = 2.0


# -- the pure core -----------------------------------------------------------------------------------


def _move_of(view: Mapping[str, Any]) -> dict[str, Any] | None:
    detail = view.get("detail")
    if isinstance(detail, dict) and isinstance(detail.get("move"), dict):
        return detail["move"]
    move = view.get("move")
    return move if isinstance(move, dict) else None


def next_steps(view: Mapping[str, Any], host: str, now_ms: int) -> list[dict[str, str]]:
    """The commands an operator would run next on the door's status ``view`` of ``host`` (§12, §7.10): cut a ready
    manual move, abort one that has not cut, resolve a stuck one; ``[]`` when the move needs nobody (it runs, or it
    closed)."""
    move = _move_of(view)
    if move is None:
        return []
    state, cut_phase = move.get("state"), move.get("cut_phase") or ""
    h = shlex.quote(host)
    abort = {"command": f"hostmove move abort --host {h}",
             "why": "the move has not cut: aborting leaves the host serving where it is"}
    if state == "ready" and move.get("cut") == "manual":
        return [{"command": f"hostmove move cut --host {h}", "why": "the move is ready and waits for your cut"}, abort]
    if state in ("preparing", "ready") or (state == "cutting" and cut_phase == "requested"):
        return [abort]
    if state == "stuck":
        return [{"command": f"hostmove move resolve --host {h} --retry",
                 "why": "the move is stuck: its recovery probes again on the source"}]
    rollback = move.get("rollback") or {}
    deadline = rollback.get("release_deadline")
    if state == "rolling_back" and deadline is not None and now_ms > int(deadline) and not rollback.get("evidence"):
        return [{"command": f"hostmove move resolve --host {h} --declare-lost",
                 "why": "the target has not released past its deadline; declare it lost only if it is gone"}]
    return []


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> list[str]:
    """A plain text table: one header line and one line per row, columns padded to their widest cell."""
    cells = [[("-" if c is None or c == "" else str(c)) for c in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return [fmt.format(*headers).rstrip()] + [fmt.format(*r).rstrip() for r in cells]


def _last_move(host: Mapping[str, Any]) -> str:
    record = host.get("record") or {}
    last = record.get("last_move") if isinstance(record, dict) else None
    return f"{last.get('outcome')} ({last.get('id')})" if isinstance(last, dict) else ""


def _secs(ms: object) -> str:
    return "" if ms is None else f"{int(ms) / 1000:.1f} s"  # type: ignore[call-overload]


def _timings(timings: Sequence[Mapping[str, Any]]) -> str:
    parts = []
    for t in timings:
        if t.get("elapsed_ms") is None:
            continue
        over = " OVER" if t.get("over") else ""
        parts.append(f"{t.get('name')} {_secs(t.get('elapsed_ms'))}{over}")
    return ", ".join(parts)


def rows_of(verb: str, body: Mapping[str, Any]) -> list[str]:
    """The table lines of ``verb``'s answer ``body`` (the API's JSON)."""
    if verb == "host list":
        return table(("HOST", "STATE", "PHASE", "REGION", "BOX", "CLAIM GEN", "LAST MOVE"),
                     [(h["host"], h["op_kind"], h["move_state"] or h["op_phase"], h["region"], h["exec"],
                       h["claim_gen"], _last_move(h)) for h in body.get("hosts", [])])
    if verb == "host show":
        h = body
        lines = table(("FIELD", "VALUE"), [
            ("host", h["host"]), ("state", h["op_kind"]), ("phase", h["op_phase"]), ("region", h["region"]),
            ("box", h["exec"]), ("claim gen", h["claim_gen"]), ("record gen", h["record_gen"]),
            ("move", h["move_id"]), ("move state", h["move_state"]), ("last move", _last_move(h)),
            ("deleted", "yes" if h["deleted"] else "no")])
        return lines
    if verb in ("box list", "box show"):
        boxes = body.get("boxes", []) if verb == "box list" else [body]
        return table(("BOX", "REGION", "STATE", "ELIGIBLE", "RUNNING"),
                     [(b["label"], b["region"], "fenced (lost)" if b["fenced"] else "live",
                       "yes" if b["eligible"] else f"no: {b['why']}", ", ".join(b["running"]) or "none")
                      for b in boxes])
    if verb == "move list":
        return table(("HOST", "MOVE", "LIVE", "STATE / OUTCOME", "FROM", "TO", "AT", "TIMINGS"),
                     [(m["host"], m["move_id"], "yes" if m["live"] else "no", m["state"] or m["outcome"], m["from"],
                       m["to"], utc_text(m["at"] or m["requested_at"]), _timings(m["timings"]))
                      for m in body.get("moves", [])])
    if verb == "move history":
        return table(("MOVE", "FROM", "TO", "OUTCOME", "REQUESTED", "CLOSED", "TIMINGS"),
                     [(m["move_id"], m.get("from"), m.get("to"), m.get("outcome") or f"live ({m.get('state')})",
                       utc_text(m.get("requested_at")), utc_text(m.get("closed_at")), _timings(m.get("timings", [])))
                      for m in body.get("moves", [])])
    if verb == "move show":
        lines = [f"move {body['move_id']} of {body['host']}"]
        summary = body.get("summary")
        if isinstance(summary, dict):
            lines.append(f"closed {summary.get('outcome')} at {utc_text(summary.get('closed_at'))}, from "
                         f"{summary.get('from')} to {summary.get('to')}: {_timings(summary.get('timings', []))}")
        lines += table(("GEN", "AT", "TRANSITION", "STATE", "PHASES", "BY", "REASON"),
                       [(e["gen"], utc_text(e["at"]), e["name"], e["state"],
                         ", ".join(p for p in (e["cut_phase"], e["landing_phase"], e["rollback_target_phase"],
                                               e["rollback_source_phase"]) if p),
                         e["actor"]["service"] + (f"@{e['actor']['box']}" if e["actor"]["box"] else ""), e["reason"])
                        for e in body.get("entries", [])])
        if body.get("claim_entries"):
            lines.append("the claim through the move:")
            lines += table(("GEN", "AT", "TRANSITION", "OP", "PHASE", "EXECUTES", "BY"),
                           [(c["gen"], utc_text(c["at"]), c["name"], c["kind"], c["phase"], c["exec"],
                             c["actor"]["service"] + (f"@{c['actor']['box']}" if c["actor"]["box"] else ""))
                            for c in body["claim_entries"]])
        return lines
    if verb == "alerts":
        return [f"{utc_text(a['at'])}  {'incident' if a['incident'] else 'alert'} {a['kind']} on {a['subject']}"
                + (f": {a['sentence']}" if a["sentence"] else "") for a in body.get("alerts", [])]
    raise ValueError(f"no table for {verb}")


# -- the shell ---------------------------------------------------------------------------------------


class ReadFailed(Exception):
    """The read did not answer: ``code`` is the exit code and the message says why (never the token)."""

    def __init__(self, code: int, message: str) -> None:
        self.code = code
        super().__init__(message)


async def get(session: aiohttp.ClientSession, environ: Mapping[str, str], path: str,
              params: Mapping[str, str] | None = None) -> dict[str, Any]:
    """``GET path`` on the projections service; the JSON answer, or :class:`ReadFailed`."""
    base = (environ.get(ENV_URL, "").strip() or DEFAULT_URL).rstrip("/")
    headers = {"Accept": "application/json"}
    if environ.get(ENV_TOKEN):
        headers["Authorization"] = f"Bearer {environ[ENV_TOKEN]}"
    url = base + path + (f"?{urlencode(params)}" if params else "")
    try:
        async with session.get(url, headers=headers, timeout=aiohttp.ClientTimeout(total=30)) as resp:
            status, raw = resp.status, await resp.read()
    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
        raise ReadFailed(exitcodes.UNAVAILABLE, f"could not reach the projections service at {base} "
                                                f"({type(exc).__name__}); is it running, and is {ENV_URL} right?"
                         ) from None
    try:
        body = json.loads(raw)
    except ValueError:
        body = None
    if not isinstance(body, dict):
        raise ReadFailed(exitcodes.USAGE, f"the server at {base} answered {status} with something that is not the "
                                          f"projections' JSON; is {ENV_URL} its address?")
    if status == 401:
        raise ReadFailed(exitcodes.USAGE, f"{body.get('reason', 'a token is required')} (set {ENV_TOKEN})")
    if status == 503:
        what = {"s3": "the object store (S3)", "nats": "NATS (the event stream)"}.get(str(body.get("dependency")))
        raise ReadFailed(exitcodes.UNAVAILABLE, f"{what or 'a dependency'} is unavailable: {body.get('reason')}")
    if status == 404:
        raise ReadFailed(exitcodes.FAILED, str(body.get("reason", "not found")))
    if status >= 400:
        raise ReadFailed(exitcodes.USAGE if status < 500 else exitcodes.FAILED, str(body.get("reason", status)))
    return body


def _request(args: argparse.Namespace) -> tuple[str, str, dict[str, str]]:
    """(verb, path, query) of a read command."""
    cmd = args.command
    if cmd == "host":
        if args.host_action == "list":
            return "host list", "/v1/hosts", {}
        return "host show", "/v1/hosts/" + quote(args.host, safe=""), {}
    if cmd == "box":
        if args.box_action == "list":
            return "box list", "/v1/boxes", {}
        return "box show", "/v1/boxes/" + quote(args.box, safe=""), {}
    if cmd == "move":
        action = args.move_action
        if action == "list":
            return "move list", "/v1/moves", {"live": "true"} if args.live else {}
        if action == "history":
            return "move history", "/v1/history", {"host": args.host}
        return "move show", "/v1/moves/" + quote(args.move_id, safe=""), {"host": args.host} if args.host else {}
    return "alerts", "/v1/alerts", {}


def _emit(verb: str, body: Mapping[str, Any], output: str, out: TextIO) -> None:
    if output == "json":
        print(json.dumps(body, indent=2, sort_keys=True), file=out, flush=True)
    else:
        for line in rows_of(verb, body):
            print(line, file=out, flush=True)


async def run(args: argparse.Namespace, *, environ: Mapping[str, str] | None = None) -> int:
    """Run a read command from parsed ``args`` (:func:`add_parsers`); the exit code."""
    env = os.environ if environ is None else environ
    out, err = sys.stdout, sys.stderr
    if args.command == "completion":
        return completion(args, out)
    verb, path, params = _request(args)
    output = getattr(args, "output", "table")
    try:
        async with aiohttp.ClientSession() as session:
            body = await get(session, env, path, params)
            if verb != "alerts" or not getattr(args, "follow", False):
                _emit(verb, body, output, out)
                return exitcodes.OK
            while True:  # --follow: what is new since the last answer, until interrupted
                if body.get("alerts"):
                    _emit(verb, body, output, out)
                await asyncio.sleep(FOLLOW_EVERY_S)
                body = await get(session, env, path, {"after": str(body.get("last_seq", 0))})
    except ReadFailed as exc:
        print(f"hostmove {verb}: {exc}", file=err, flush=True)
        return exc.code


def completion(args: argparse.Namespace, out: TextIO) -> int:
    """``hostmove completion bash|zsh``: the shell's completion script for every command (shtab)."""
    import shtab

    print(shtab.complete(args.root_parser, shell=args.shell), file=out)
    return exitcodes.OK


# -- registration ------------------------------------------------------------------------------------


def _output(p: argparse.ArgumentParser) -> None:
    p.add_argument("-o", "--output", choices=OUTPUTS, default=argparse.SUPPRESS,
                   help="table (the default) or json: the API's answer as it is")


def _subparsers(p: argparse.ArgumentParser) -> Any:
    return next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))  # noqa: SLF001


def add_parsers(root: argparse.ArgumentParser, sub: Any) -> None:
    """Register the read verbs on the parsers ``hostmove/cli.py`` built: ``-o`` and ``--version`` on the root,
    ``host list|show``, ``box list|show``, ``move list|history|show``, ``alerts``, ``completion``, and ``-o`` on
    ``move status`` (which then carries ``next_steps``)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        release = version("hostmove")
    except PackageNotFoundError:
        release = "unknown"
    root.add_argument("--version", action="version", version=f"hostmove {release}")
    root.add_argument("-o", "--output", choices=OUTPUTS, default="table",
                      help="table (the default) or json for the read commands: the API's answer as it is")
    hosts = _subparsers(sub.choices["host"])
    hl = hosts.add_parser("list", help="every host: state, region, box, claim gen, last move")
    hs = hosts.add_parser("show", help="one host as the projection holds it")
    hs.add_argument("--host", required=True)
    boxes = _subparsers(sub.choices["box"])
    bl = boxes.add_parser("list", help="every box: region, eligibility, fenced or lost, running instances")
    bs = boxes.add_parser("show", help="one box")
    bs.add_argument("--box", required=True)
    moves = _subparsers(sub.choices["move"])
    ml = moves.add_parser("list", help="each host's live move and last move (--live: live only)")
    ml.add_argument("--live", action="store_true", help="only the moves still running")
    mh = moves.add_parser("history", help="a host's moves from the move log (§13)")
    mh.add_argument("--host", required=True)
    ms = moves.add_parser("show", help="one move's log, transition by transition (§13)")
    ms.add_argument("move_id", metavar="MOVE_ID")
    ms.add_argument("--host", help="the host it moved (default: found by its id)")
    moves.metavar = "{" + ",".join(moves.choices) + "}"
    _output(moves.choices["status"])
    al = sub.add_parser("alerts", help="the alerts and incidents raised (--follow: then every new one)")
    al.add_argument("--follow", action="store_true", help="keep printing new alerts until interrupted")
    co = sub.add_parser("completion", help="print the shell completion script (bash or zsh)")
    co.add_argument("shell", choices=("bash", "zsh"))
    co.set_defaults(root_parser=root)  # the whole command line, complete once the shell has built it
    for p in (hl, hs, bl, bs, ml, mh, ms, al):
        _output(p)
    for p in (hl, hs, bl, bs, ml, mh, ms, al, co):
        p.set_defaults(read=run)


__all__ = ["DEFAULT_URL", "ENV_TOKEN", "ENV_URL", "ReadFailed", "add_parsers", "next_steps", "rows_of", "run",
           "table"]
