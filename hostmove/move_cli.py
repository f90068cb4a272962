"""``hostmove move``: the operator's command line for moves, a client of the door's HTTP API (spec §12).

    hostmove move --host H --to R [--manual-cut] [--no-wait] [--until serving|closed] [--timeout S]
    hostmove move watch --host H [--until serving|closed]      (or: move status --host H --watch)
    hostmove move status --host H [--json]
    hostmove move cut --host H
    hostmove move abort --host H

``--wait`` (the default) returns once the host serves on the target, or is back on the source, and says
that the move goes on closing (its parks) in the background; ``--until closed`` waits for the close.
``watch`` follows a move another command started, the same way.

Configuration from the environment: ``HOSTMOVE_DOOR_URL`` (default ``http://127.0.0.1:8081``) and
``HOSTMOVE_TOKEN`` (the operator token; never printed, never in an error message).

Exit codes: the one table of :mod:`hostmove.exitcodes` (§12's: 0 done, 3 rolled back or aborted, 4 stuck or
still waiting at the deadline, 5 refused with the door's sentence; and 2 bad usage or configuration, 6 the
door unreachable or answering 503 because a dependency of its own is down, 1 a failure that is neither).

The shape (ARCHITECTURE §3): the pure core (:func:`milestones`, :func:`outcome`, :func:`timings`,
:func:`status_lines`) turns the door's status JSON into sentences and exit codes; :class:`DoorClient`
and :func:`run` are the thin shell (HTTP, the clock port, printing).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TextIO
from urllib.parse import quote, urlsplit, urlunsplit

import aiohttp

from events.copy import say
from hostmove import exitcodes
from kernel.ports import Clock, WallClock
from kernel.timetext import utc_text

ENV_URL = "HOSTMOVE_DOOR_URL"
ENV_TOKEN = "HOSTMOVE_TOKEN"
DEFAULT_URL = "http://127.0.0.1:8081"

EXIT_DONE = exitcodes.OK
EXIT_FAILED = exitcodes.FAILED
EXIT_CONFIG = exitcodes.USAGE
EXIT_ROLLED_BACK = exitcodes.ROLLED_BACK
EXIT_WAITING = exitcodes.WAITING
EXIT_REFUSED = exitcodes.REFUSED
EXIT_UNAVAILABLE = exitcodes.UNAVAILABLE

UNTIL = ("serving", "closed")
"""``--until``: ``serving`` returns once the host serves on the target (or is back on the source) and the move
goes on closing in the background; ``closed`` waits for the close (the move's parks, then ``last_move``)."""

DEFAULT_TIMEOUT_S = 3600.0
"""``--wait``'s default deadline: preparing alone may take many minutes, and ``--until closed`` waits for the
late-completion horizon (§5.3, 15 min + the longest request) before the parks and the close."""
DEFAULT_INTERVAL_S = 1.0
REQUEST_TIMEOUT_S = 30.0
PREPARE_BUDGET_S = 3600.0
"""§13 paging: ``preparing`` with no promotable round for 60 minutes is a warning; the CLI shows that
hour as the prepare budget."""


class ConfigProblem(Exception):
    """The CLI's configuration is missing or wrong; the message says what to set (never a token)."""


class DoorUnreachable(Exception):
    """The door could not be reached (refused, reset, no answer in time): a dependency is unavailable."""


class NotTheDoor(Exception):
    """The server at the door's address answered with something that is not the door's JSON (configuration)."""


@dataclass(frozen=True)
class DoorConfig:
    url: str
    token: str = field(repr=False)

    def __repr__(self) -> str:  # the token never reaches a log or a traceback
        return f"DoorConfig(url={redact_url(self.url)!r})"


def redact_url(url: str) -> str:
    """``url`` without any user or password it carries (they would be secrets)."""
    parts = urlsplit(url)
    if parts.username is None and parts.password is None:
        return url
    netloc = parts.hostname or ""
    if parts.port is not None:
        netloc = f"{netloc}:{parts.port}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def load_config(environ: Mapping[str, str]) -> DoorConfig:
    """``HOSTMOVE_DOOR_URL`` and ``HOSTMOVE_TOKEN`` (§12: every move mutation needs an operator token), each over
    the context ``hostmove login`` stored (:mod:`hostmove.context`, issue 20 item 4)."""
    from hostmove.context import ContextError, read_context

    try:
        stored = read_context(environ)
    except ContextError as exc:
        raise ConfigProblem(str(exc)) from None
    url = environ.get(ENV_URL, "").strip() or (stored.door_url if stored else "") or DEFAULT_URL
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigProblem(f"{ENV_URL} must be an http:// or https:// URL of the door, not {redact_url(url)!r}")
    if parts.username is not None or parts.password is not None:
        raise ConfigProblem(f"{ENV_URL} must not carry a user or password ({redact_url(url)!r}); "
                            f"the operator token goes in {ENV_TOKEN}")
    # a stored token goes only to the door it was stored for: never to another URL the environment names
    same_door = stored is not None and stored.door_url.rstrip("/") == url.rstrip("/")
    token = environ.get(ENV_TOKEN, "") or (stored.token if stored is not None and same_door else "")
    if stored is not None and token == stored.token:
        from hostmove.logs import add_secret

        add_secret(token)  # the environment does not name it: the log redaction is told (hostmove.logs)
    if not token:
        raise ConfigProblem(f"set {ENV_TOKEN} to your operator token, or run `hostmove login --door URL`: the door "
                            "answers nothing without one (§12)")
    if any(ch.isspace() or not ch.isprintable() for ch in token):
        raise ConfigProblem(f"{ENV_TOKEN} holds a space, a newline or a control character, which a bearer token "
                            "cannot carry; set it to the token alone")
    return DoorConfig(url=url.rstrip("/"), token=token)


# -- the door's client (the shell) ---------------------------------------------------------------


@dataclass(frozen=True)
class Reply:
    status: int
    body: dict[str, Any]

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300

    @property
    def reason(self) -> str:
        return str(self.body.get("reason") or self.body.get("message") or f"the door answered {self.status}")

    @property
    def outage(self) -> bool:
        """The door answered 503 for a read it could not make (NATS or the object store down), not for a corrupt
        object (M-R30: that is a failure to fix, not an outage to wait out)."""
        return self.status == 503 and self.body.get("copy") != "M-R30"

    @property
    def dependency(self) -> str:
        """What the door says is down, in words (its ``dependency``: ``nats``, ``s3``), else ``""``."""
        named = self.body.get("dependency") or ""
        return DEPENDENCIES.get(str(named), str(named))


DEPENDENCIES = {"nats": "NATS (the event stream)", "s3": "the object store (S3)"}
"""The door's names for what its 503 says is down (services/door/api.py ``unavailable_answer``), in words."""


class DoorClient:
    """The door's four move routes over HTTP with the bearer token (services/door/api.py)."""

    def __init__(self, config: DoorConfig, session: aiohttp.ClientSession) -> None:
        self.config = config
        self.session = session

    def _path(self, host: str, tail: str = "") -> str:
        return f"{self.config.url}/v1/hosts/{quote(host, safe='')}/move{tail}"

    async def _call(self, method: str, url: str, body: dict[str, Any] | None = None,
                    timeout_s: float = REQUEST_TIMEOUT_S) -> Reply:
        headers = {"Authorization": f"Bearer {self.config.token}", "Accept": "application/json"}
        where = redact_url(self.config.url)
        try:
            async with self.session.request(method, url, json=body, headers=headers,
                                            timeout=aiohttp.ClientTimeout(total=max(timeout_s, 0.1))) as resp:
                raw = await resp.read()
                status = resp.status
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            raise DoorUnreachable(f"could not reach the door at {where} ({_why(exc)}); "
                                  f"is it running, and is {ENV_URL} right?") from None
        try:
            parsed = json.loads(raw)
        except ValueError:
            parsed = None
        if not isinstance(parsed, dict):
            raise NotTheDoor(f"the server at {where} answered {status} with something that is not the door's "
                             f"JSON; is {ENV_URL} the door's address?")
        return Reply(status, parsed)

    async def create(self, host: str, box: str, app: str | None = None, release: int | None = None) -> Reply:
        """``POST /v1/hosts/{host}/create``: set up a host on ``box`` running ``app`` (the demo's first step)."""
        body: dict[str, object] = {"box": box}
        if app is not None:
            body["app"] = app
        if release is not None:
            body["release"] = release
        return await self._call("POST", f"{self.config.url}/v1/hosts/{quote(host, safe='')}/create", body)

    async def request_move(self, host: str, to: str, cut: str) -> Reply:
        return await self._call("POST", self._path(host), {"to": to, "cut": cut})

    async def status(self, host: str, timeout_s: float = REQUEST_TIMEOUT_S) -> Reply:
        return await self._call("GET", self._path(host) + "?detail=1", timeout_s=timeout_s)

    async def cut(self, host: str) -> Reply:
        return await self._call("POST", self._path(host, "/cut"))

    async def abort(self, host: str) -> Reply:
        return await self._call("POST", self._path(host, "/abort"))

    async def resolve(self, host: str) -> Reply:
        """``POST .../move/resolve {"retry": true}``: a stuck move's recovery probes again (§7.10)."""
        return await self._call("POST", self._path(host, "/resolve"), {"retry": True})

    async def declare_lost(self, host: str, box: str, compute: dict[str, str], *, confirmed: bool) -> Reply:
        """``POST .../move/resolve {"declare_lost": BOX, "compute": {...}, "confirmed": ...}`` (§7.10)."""
        return await self._call("POST", self._path(host, "/resolve"),
                                {"declare_lost": box, "compute": compute, "confirmed": confirmed})

    async def clear_failed(self, host: str) -> Reply:
        """``POST /v1/hosts/{host}/resolve {"clear_failed": true}``: the serving box clears a failed route."""
        return await self._call("POST", f"{self.config.url}/v1/hosts/{quote(host, safe='')}/resolve",
                                {"clear_failed": True})


def _why(exc: BaseException) -> str:
    """A connection failure in plain words, without headers (the token rides in one)."""
    if isinstance(exc, TimeoutError | aiohttp.ServerTimeoutError):
        return "no answer in time"
    if isinstance(exc, aiohttp.ClientConnectorError):
        return exc.os_error.strerror or type(exc.os_error).__name__
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return type(exc).__name__


# -- the pure core: sentences, outcomes, timings (§12, §13, §20) ----------------------------------


def _move(view: Mapping[str, Any]) -> dict[str, Any] | None:
    """The live move with every field (``detail.move``) if the door gave it, else the summary."""
    detail = view.get("detail")
    if isinstance(detail, dict) and isinstance(detail.get("move"), dict):
        return detail["move"]
    move = view.get("move")
    return move if isinstance(move, dict) else None


def _sentence(text: str) -> str:
    text = text.strip()
    return text if text.endswith((".", "!", "?")) else text + "."


def _clause(text: str) -> str:
    return text.strip().rstrip(".")


def _secs(ms: int | float) -> str:
    return f"{ms / 1000:.1f}".rstrip("0").rstrip(".")


def offline_ms(move: Mapping[str, Any]) -> int | None:
    """§13 offline: ``cut_at`` to the open, or to the source's reopen after a rollback."""
    cut_at = move.get("cut_at")
    rollback = move.get("rollback") or {}
    end = move.get("opened_at") or rollback.get("opened_at")
    if cut_at is None or end is None:
        return None
    return int(end) - int(cut_at)


@dataclass
class Watch:
    """What ``--wait`` has printed and the last full move it saw (the close clears ``move``)."""

    host: str
    move_id: str
    seen: set[str] = field(default_factory=set)
    last: dict[str, Any] = field(default_factory=dict)


def milestones(view: Mapping[str, Any], watch: Watch, now_ms: int) -> list[tuple[str, str]]:
    """``(key, sentence)`` for every step ``view`` shows of the watched move, in order (§20 M-C2..M-C13;
    the door's own line where §20 has none). The caller prints the keys it has not printed yet."""
    host = watch.host
    out: list[tuple[str, str]] = []
    move = _move(view)
    claim = view.get("claim") or {}
    if claim.get("kind") == "relocating":
        out.append((f"door:{view.get('copy')}", str(view.get("message", ""))))
    if move is not None and move.get("id") == watch.move_id:
        watch.last = dict(move)
        src, dst = str(move.get("from", "")), str(move.get("to", ""))
        state, cut_phase = move.get("state"), move.get("cut_phase", "")
        reason = str(move.get("reason") or "")
        rollback = move.get("rollback") or {}
        if state == "preparing":
            out += [("preparing", say("M-C2", host=host)), ("checking", say("M-C3", to_region=dst, host=host))]
        elif state == "ready":
            out.append(("ready", say("M-C12", host=host) if move.get("cut") == "manual" else say("M-S4", host=host)))
        elif state == "cutting" and cut_phase == "requested":  # the operator's cut, or the auto cut (§7.4)
            manual = move.get("cut") == "manual"
            out.append(("cut-requested", say("M-S1", host=host)) if manual else ("ready", say("M-S4", host=host)))
        elif state == "cutting":
            budget = move.get("cut_budget_s") or 0
            estimate = f"{_secs(budget * 1000)} seconds at most (its cut window)" if budget else "its cut window"
            out.append(("cutting", say("M-C5", host=host, estimate=estimate)))
        elif state in ("landing", "committed", "done"):
            out.append(("landing", say("M-C6", from_region=src, to_region=dst)))
            off = offline_ms(move)
            if move.get("opened_at") is not None and off is not None:
                out.append(("moved", say("M-C7", host=host, to_region=dst, seconds=_secs(off))))
            if move.get("target_fenced"):  # §7.10: committed, its target gone; the close goes on without it
                box = _target_box(claim)
                out.append(("target-fenced", say("M-S13", box=box, move_id=watch.move_id, host=host, region=dst)))
        elif state in ("rolling_back", "restoring", "rolled_back"):
            why = _clause(str(rollback.get("reason") or reason or "no reason was recorded"))
            out.append(("rollback", say("M-C8", to_region=dst, host=host, reason=why, from_region=src)))
            deadline = rollback.get("release_deadline")
            if state == "rolling_back" and deadline is not None and now_ms > int(deadline):
                box = _target_box(claim)
                out.append(("waiting-release", say("M-C10", box=box, region=dst, host=host)))
            if rollback.get("opened_at") is not None:
                out.append(("back", say("M-C9", host=host, from_region=src)))
        elif state == "stuck" and reason:  # what it is stuck on, in the recovery's words (§7.10: an operator's case)
            out.append(("stuck", _sentence(f"{host} is stuck and waits for an operator: {reason}")))
        elif state == "stuck":
            out.append(("stuck", say("M-C11", host=host, to_region=dst, from_region=src)))
        else:  # reverting, aborted: the door's line (M-S2, M-S8)
            out.append((f"state:{state}", str(view.get("message", ""))))
            if state == "reverting" and rev_phase(view) == "opened":
                out.append(("back", say("M-C9", host=host, from_region=src)))
        if reason and state not in ("stuck", "rolling_back", "restoring", "rolled_back"):  # M-C8 carries it
            out.append((f"reason:{reason}", _sentence(reason)))
    last = view.get("last_move") or {}
    if move is None and last.get("id") == watch.move_id:
        outcome_ = last.get("outcome")
        dst, src = str(watch.last.get("to", "")), str(watch.last.get("from", ""))
        off = offline_ms(watch.last) if watch.last else None
        if outcome_ == "done" and off is not None and dst:
            out.append(("moved", say("M-C7", host=host, to_region=dst, seconds=_secs(off))))
        elif outcome_ == "rolled_back" and src:
            out.append(("back", say("M-C9", host=host, from_region=src)))
        out.append(("closed", say("M-S5", host=host, move_id=watch.move_id, outcome=str(outcome_).replace("_", " "))))
    return out


def _target_box(claim: Mapping[str, Any]) -> str:
    parts = claim.get("participants") or []
    return str(parts[1]) if len(parts) > 1 else "the target box"


def rev_phase(view: Mapping[str, Any]) -> str:
    """The source's recovery phase of a ``reverting`` move (``op.journal.rev_phase`` in the detail), or ``""``."""
    detail = view.get("detail")
    op = detail.get("op") if isinstance(detail, dict) else None
    journal = op.get("journal") if isinstance(op, dict) else None
    return str(journal.get("rev_phase") or "") if isinstance(journal, dict) else ""


def serving_end(view: Mapping[str, Any], move_id: str) -> int | None:
    """Where the live move ``move_id`` has left the host serving, before its close: :data:`EXIT_DONE` once the
    target opened (committed, ``opened_at``), :data:`EXIT_ROLLED_BACK` once the source serves again (a
    rollback's reopen, a reverted cut's open, or an abort, which never stopped it); ``None`` while it is offline
    or still preparing."""
    move = _move(view)
    if move is None or move.get("id") != move_id:
        return None
    state = move.get("state")
    rollback = move.get("rollback") or {}
    if state in ("committed", "done") and move.get("opened_at") is not None:
        return EXIT_DONE
    if rollback.get("opened_at") is not None or state == "aborted":
        return EXIT_ROLLED_BACK
    if state == "reverting" and rev_phase(view) == "opened":
        return EXIT_ROLLED_BACK
    return None


def outcome(view: Mapping[str, Any], move_id: str, until: str = "closed") -> int | None:
    """The exit code once the move has an outcome (§12), else ``None``: still going. With ``until="serving"``
    the outcome is where the host serves (:func:`serving_end`), before the close."""
    move = _move(view)
    if move is not None and move.get("id") == move_id and move.get("state") == "stuck":
        return EXIT_WAITING
    if until == "serving" and (code := serving_end(view, move_id)) is not None:
        return code
    last = view.get("last_move") or {}
    if move is None and last.get("id") == move_id:
        return {"done": EXIT_DONE, "rolled_back": EXIT_ROLLED_BACK, "aborted": EXIT_ROLLED_BACK}.get(
            str(last.get("outcome")), EXIT_WAITING)
    return None


def closing_line(view: Mapping[str, Any], watch: Watch) -> str:
    """What ``--until serving`` prints as it returns before the close: the move goes on closing, where, and how
    to follow it to its end."""
    move = _move(view) or watch.last
    src, dst = str(move.get("from") or "the source region"), str(move.get("to") or "the target region")
    moved = move.get("state") in ("committed", "done")
    if moved:
        what = f"{src} parks what {watch.host} left there once the late-completion horizon has passed"
    elif move.get("state") == "aborted":
        what = f"{dst} retires what the move staged there"
    else:
        what = f"{dst} parks what the move left there once the late-completion horizon has passed"
    return (f"The move {watch.move_id} goes on closing in the background: {what}, then it closes. "
            f"Follow it with: hostmove move watch --host {watch.host} --until closed")


@dataclass(frozen=True)
class Timing:
    """One §13 timing: ``elapsed_ms`` (None: not started), whether it still runs, and its budget."""

    name: str
    elapsed_ms: int | None
    running: bool
    budget_s: float | None

    @property
    def over(self) -> bool:
        return self.elapsed_ms is not None and self.budget_s is not None and self.elapsed_ms > self.budget_s * 1000

    def line(self) -> str:
        budget = f"budget {_secs(self.budget_s * 1000)} s" if self.budget_s is not None else "no budget yet"
        if self.elapsed_ms is None:
            took = "not started"
        elif self.running:
            took = f"{_secs(self.elapsed_ms)} s so far"
        else:
            took = f"{_secs(self.elapsed_ms)} s"
        flag = ", OVER BUDGET" if self.over else ""
        return f"  {self.name:<8} {took} ({budget}{flag})"


def _span(start: Any, end: Any, now_ms: int, running: bool) -> tuple[int | None, bool]:
    if start is None:
        return None, False
    if end is not None:
        return int(end) - int(start), False
    if running:
        return max(0, now_ms - int(start)), True
    return None, False


def timings(move: Mapping[str, Any], now_ms: int) -> list[Timing]:
    """§13: prepare (``requested_at`` to ``ready_at``, budget 60 min), cut (``cut_at`` to ``flipped_at``,
    budget ``cut_deadline - cut_at``), land (``flipped_at`` to the target's open or the rollback, budget
    ``landing_deadline - flipped_at``), offline (``cut_at`` to the open or the source's reopen, budget the
    cut window ``cut_budget_s``, the M2 promise)."""
    state = move.get("state")
    rollback = move.get("rollback") or {}
    cut_at, flipped_at = move.get("cut_at"), move.get("flipped_at")
    prep = _span(move.get("requested_at"), move.get("ready_at"), now_ms, state == "preparing")
    cut = _span(cut_at, flipped_at, now_ms, state == "cutting")
    land_end = move.get("opened_at") or rollback.get("requested_at")
    land = _span(flipped_at, land_end, now_ms, state in ("landing", "committed"))
    off_end = move.get("opened_at") or rollback.get("opened_at")
    off = _span(cut_at, off_end, now_ms, state not in ("stuck", "aborted", "done", "rolled_back"))
    cut_budget = (int(move["cut_deadline"]) - int(cut_at)) / 1000 if cut_at and move.get("cut_deadline") else None
    deadline = move.get("landing_deadline")
    land_budget = (int(deadline) - int(flipped_at)) / 1000 if flipped_at and deadline else None
    window = float(move.get("cut_budget_s") or 0) or None
    return [
        Timing("prepare", *prep, PREPARE_BUDGET_S),
        Timing("cut", *cut, cut_budget),
        Timing("land", *land, land_budget),
        Timing("offline", *off, window),
    ]


def status_lines(view: Mapping[str, Any], now_ms: int) -> list[str]:
    """``hostmove move status``: the door's sentence, the phase, the reasons, and the §13 timings."""
    lines = [str(view.get("message", ""))]
    claim = view.get("claim")
    if isinstance(claim, dict):
        parts = ", ".join(claim.get("participants") or []) or "none"
        lines.append(f"claim: {claim.get('kind')} (phase {claim.get('phase') or '-'}), exec {claim.get('exec')}, "
                     f"participants {parts}")
    move = _move(view)
    if move is not None:
        lines.append(f"move {move.get('id')}: {move.get('from')} to {move.get('to')}, cut {move.get('cut')}, "
                     f"requested by {move.get('requested_by') or '-'} at {utc_text(move.get('requested_at'))}")
        lines.append(f"phase: {move.get('state')}, cut phase {move.get('cut_phase') or '-'}, "
                     f"landing phase {move.get('landing_phase') or '-'}")
        rollback = move.get("rollback") or {}
        if rollback:
            lines.append(f"rollback {rollback.get('id')}: target phase {rollback.get('target_phase') or '-'}, "
                         f"source phase {rollback.get('source_phase') or '-'}")
        reasons = [str(r) for r in (move.get("reason"), rollback.get("reason")) if r]
        for reason in dict.fromkeys(reasons):
            lines.append(f"reason: {reason}")
        lines.append("timings (§13):")
        lines += [t.line() for t in timings(move, now_ms)]
    last = view.get("last_move")
    if isinstance(last, dict):
        lines.append(f"last move: {last.get('id')} ended {last.get('outcome')} at {utc_text(last.get('at'))}")
    if move is None:
        lines.append("timings: shown while a move is live; the move log (§13) keeps a closed move's")
    return lines


def readiness_lines(view: Mapping[str, Any]) -> list[str]:
    """``move status --detail``: the target's readiness report (§7.3) as the door read it: when it was written, its
    failing checks, and T11's measured rates and estimate (issue 18 item 4)."""
    detail = view.get("detail")
    report = detail.get("readiness") if isinstance(detail, dict) else None
    if not isinstance(report, dict):
        return ["readiness: the target has not written its readiness report for this move"]
    lines = [f"readiness report of {report.get('box')} at {utc_text(report.get('at'))}: "
             f"{'ready' if report.get('ready') else 'not ready'}"]
    for check in report.get("failing") or []:
        lines.append(f"  {check.get('check')} fails: {check.get('detail')}")
    t = report.get("t11") or {}
    if t:
        lines.append(f"  T11 rates used (MiB/s): cross-region {t.get('cross_region_mib_s')}, regional S3 "
                     f"{t.get('regional_s3_mib_s')}, disk write {t.get('disk_write_mib_s')}, disk read "
                     f"{t.get('disk_read_mib_s')}")
        lines.append(f"  T11 budget for {t.get('db_mib')} MiB: {t.get('total_s')} s ({t.get('fixed_s')} s fixed, "
                     f"first attempt {t.get('first_attempt_s')} s) against the {t.get('window_s')} s window; "
                     f"{int(t.get('attempts') or 0)} attempt(s) admitted")
    return lines


# -- the command line ------------------------------------------------------------------------------


def _follow_options(p: argparse.ArgumentParser, *, inherit: bool) -> None:
    """``--until``, ``--timeout`` and ``--interval``. An action's copies (``inherit``) default to what ``move``
    itself parsed, so ``move --timeout 5 watch`` and ``move watch --timeout 5`` mean the same."""

    def default(value: Any) -> Any:
        return argparse.SUPPRESS if inherit else value

    p.add_argument("--until", choices=UNTIL, default=default("serving"),
                   help="serving (the default): return once the host serves on the target, or is back on the "
                        "source, while the move goes on closing; closed: wait for the close (its parks)")
    p.add_argument("--timeout", type=float, default=default(DEFAULT_TIMEOUT_S),
                   help=f"seconds to follow the move before exiting {EXIT_WAITING} (default {DEFAULT_TIMEOUT_S:g})")
    p.add_argument("--interval", type=float, default=default(DEFAULT_INTERVAL_S),
                   help=f"seconds between status reads while following (default {DEFAULT_INTERVAL_S:g})")


def add_parser(subparsers: Any) -> None:
    """Add ``move`` and its actions (``watch``, ``status``, ``cut``, ``abort``) to ``subparsers`` (spec §12 CLI)."""
    mv = subparsers.add_parser(
        "move", help="move a host to another region; watch, show, cut or abort its move",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Request a move and follow it (the default) until the host serves on the target or is back\n"
                    "on the source; the move then goes on closing in the background (--until closed waits for\n"
                    f"that). Environment: {ENV_URL} (default {DEFAULT_URL}),\n{ENV_TOKEN} (the operator token).",
        epilog=exitcodes.table_text())
    mv.add_argument("--host", help="the host to move")
    mv.add_argument("--to", help="the region to move it to")
    mv.add_argument("--manual-cut", action="store_true",
                    help="stop at ready and cut on `hostmove move cut` (default: cut on its own)")
    wait = mv.add_mutually_exclusive_group()
    wait.add_argument("--wait", dest="wait", action="store_true", default=True,
                      help="follow the move (the default); see --until")
    wait.add_argument("--no-wait", dest="wait", action="store_false", help="return once the move is accepted")
    _follow_options(mv, inherit=False)
    actions = mv.add_subparsers(dest="move_action", required=False, metavar="{watch,status,cut,abort,resolve}")
    wt = actions.add_parser("watch", help="follow a move another command started, printing its progress",
                            epilog=exitcodes.table_text(), formatter_class=argparse.RawDescriptionHelpFormatter)
    wt.add_argument("--host", required=True)
    _follow_options(wt, inherit=True)
    st = actions.add_parser("status", help="the move's phase, reasons and timings (--watch: follow it)",
                            epilog=exitcodes.table_text(), formatter_class=argparse.RawDescriptionHelpFormatter)
    st.add_argument("--host", required=True)
    st.add_argument("--json", action="store_true", help="print the door's JSON as it answered")
    st.add_argument("--watch", action="store_true", help="then follow the move as `hostmove move watch` does")
    st.add_argument("--detail", action="store_true",
                    help="also the target's readiness report: its failing checks and T11's measured rates and budget")
    _follow_options(st, inherit=True)
    for name, text in (("cut", "cut a manual move that is ready"),
                       ("abort", "abort a move in preparing, ready, or with its cut only requested")):
        p = actions.add_parser(name, help=text)
        p.add_argument("--host", required=True)
    rs = actions.add_parser("resolve", help="a stuck move: --retry runs its recovery's probe again (§7.10)",
                            epilog=exitcodes.table_text(), formatter_class=argparse.RawDescriptionHelpFormatter)
    rs.add_argument("--host", required=True)
    rs.add_argument("--retry", action="store_true", help="rerun the recovery's probing phase (a new admission)")
    from hostmove import lost_cli

    lost_cli.add_declare_lost(rs)


def add_host_resolve(host_actions: Any) -> None:
    """``hostmove host resolve --host H --clear-failed`` (its runner: :func:`run_host_resolve`)."""
    rs = host_actions.add_parser("resolve", help="clear a host's failed start (five failed starts of a wake)",
                                 epilog=exitcodes.table_text(), formatter_class=argparse.RawDescriptionHelpFormatter)
    rs.add_argument("--host", required=True)
    rs.add_argument("--clear-failed", action="store_true",
                    help="the serving box clears the failed route and starts the host again")


async def run_host_resolve(args: argparse.Namespace, *, environ: Mapping[str, str] | None = None) -> int:
    """``hostmove host resolve --host H --clear-failed`` through the door (operator-only)."""
    out, err = sys.stdout, sys.stderr
    if not getattr(args, "clear_failed", False):
        _print("hostmove host resolve: --clear-failed is the one resolution a host takes", err)
        return EXIT_CONFIG
    try:
        config = load_config(os.environ if environ is None else environ)
    except ConfigProblem as exc:
        _print(f"hostmove host resolve: {exc}", err)
        return EXIT_CONFIG
    async with aiohttp.ClientSession() as session:
        try:
            reply = await DoorClient(config, session).clear_failed(args.host)
        except DoorUnreachable as exc:
            _print(f"hostmove host resolve: {exc} (exit {EXIT_UNAVAILABLE}: nothing was sent)", err)
            return EXIT_UNAVAILABLE
        except NotTheDoor as exc:
            _print(f"hostmove host resolve: {exc}", err)
            return EXIT_CONFIG
    if not reply.ok:
        return not_ok(reply, err)
    note = "" if reply.body.get("changed", True) else " (it already was requested)"
    _print(str(reply.body.get("message", "")) + note, out)
    return EXIT_DONE


def _print(text: str, stream: TextIO) -> None:
    print(text, file=stream, flush=True)


def not_ok(reply: Reply, err: TextIO) -> int:
    """Print why the door did not carry a request out and answer its exit code: a refusal (its sentence), an
    outage (a 503: the door could not read what it depends on; nothing was decided), or a failure."""
    if reply.outage:
        down = reply.dependency
        where = f"{down} is unavailable" if down else "a dependency of the door is unavailable"
        _print(f"hostmove move: {where}, so the door decided nothing: {reply.reason} (exit {EXIT_UNAVAILABLE}: "
               "repeat the command once it is back)", err)
        return EXIT_UNAVAILABLE
    if reply.status >= 500:  # a corrupt object (M-R30), an internal error (M-R31): nothing to wait out
        _print(reply.reason, err)
        return EXIT_FAILED
    if reply.body.get("copy") == "M-R1":
        _print(f"The door answered Not found: it gives that answer to any request without a valid operator token. "
               f"Check {ENV_TOKEN} (a status-only token cannot request, cut or abort).", err)
    else:
        _print(reply.reason, err)
    return EXIT_REFUSED


async def run(args: argparse.Namespace, *, clock: Clock | None = None,
              environ: Mapping[str, str] | None = None) -> int:
    """Run ``hostmove move ...`` from parsed ``args``; returns the exit code (:mod:`hostmove.exitcodes`)."""
    out, err = sys.stdout, sys.stderr
    clock = clock or WallClock()
    action = getattr(args, "move_action", None)
    if not getattr(args, "host", None):
        _print("hostmove move: --host is required", err)
        return EXIT_CONFIG
    if action is None and not getattr(args, "to", None):
        _print("hostmove move: --to is required to request a move (or use watch, status, cut or abort)", err)
        return EXIT_CONFIG
    following = action in (None, "watch") or (action == "status" and getattr(args, "watch", False))
    if following and (getattr(args, "timeout", DEFAULT_TIMEOUT_S) < 0
                      or getattr(args, "interval", DEFAULT_INTERVAL_S) <= 0):
        _print("hostmove move: --timeout must be 0 or more and --interval more than 0 seconds", err)
        return EXIT_CONFIG
    try:
        config = load_config(os.environ if environ is None else environ)
    except ConfigProblem as exc:
        _print(f"hostmove move: {exc}", err)
        return EXIT_CONFIG
    async with aiohttp.ClientSession() as session:
        door = DoorClient(config, session)
        try:
            if action == "status":
                return await _status(door, args, clock, out, err)
            if action == "watch":
                return await _watch(door, args, clock, out, err)
            if action == "resolve" and getattr(args, "declare_lost", None):  # §7.10 (hostmove/lost_cli.py)
                from hostmove import lost_cli

                return await lost_cli.run_declare_lost(args, door, out, err, not_ok)
            if action == "resolve":
                if not getattr(args, "retry", False):
                    _print("hostmove move resolve: --retry is the resolution built (rerun a stuck move's probe)", err)
                    return EXIT_CONFIG
                reply = await door.resolve(args.host)
                if not reply.ok:
                    return not_ok(reply, err)
                _print(str(reply.body.get("message", "")), out)
                return EXIT_DONE
            if action in ("cut", "abort"):
                reply = await (door.cut(args.host) if action == "cut" else door.abort(args.host))
                if not reply.ok:
                    return not_ok(reply, err)
                note = "" if reply.body.get("changed", True) else " (it already was)"
                _print(str(reply.body.get("message", "")) + note, out)
                return EXIT_DONE
            return await _request(door, args, clock, out, err)
        except DoorUnreachable as exc:
            _print(f"hostmove move: {exc} (exit {EXIT_UNAVAILABLE}: nothing was sent; repeat the command once the "
                   "door answers)", err)
            return EXIT_UNAVAILABLE
        except NotTheDoor as exc:
            _print(f"hostmove move: {exc}", err)
            return EXIT_CONFIG


def _following(args: argparse.Namespace) -> dict[str, Any]:
    return {"until": getattr(args, "until", "serving"), "timeout_s": getattr(args, "timeout", DEFAULT_TIMEOUT_S),
            "interval_s": getattr(args, "interval", DEFAULT_INTERVAL_S)}


async def _status(door: DoorClient, args: argparse.Namespace, clock: Clock, out: TextIO, err: TextIO) -> int:
    reply = await door.status(args.host)
    if not reply.ok:
        return not_ok(reply, err)
    as_json = getattr(args, "json", False) or getattr(args, "output", "table") == "json"
    if as_json:  # -o json: the door's answer and the commands an operator would run next (issue 20 item 3)
        from hostmove.read_cli import next_steps

        body = {**reply.body, "next_steps": next_steps(reply.body, args.host, clock.now_ms())}
    lines = [json.dumps(body, indent=2, sort_keys=True)] if as_json else status_lines(reply.body, clock.now_ms())
    if not as_json:
        from hostmove.read_cli import next_steps

        lines += [f"next: {s['command']} ({s['why']})" for s in next_steps(reply.body, args.host, clock.now_ms())]
    if getattr(args, "detail", False) and not as_json:
        lines += readiness_lines(reply.body)
    for line in lines:
        _print(line, out)
    if getattr(args, "watch", False):
        return await _watch_from(door, args.host, reply.body, clock, out=out, err=err, said=set(lines),
                                 **_following(args))
    return EXIT_DONE


async def _watch(door: DoorClient, args: argparse.Namespace, clock: Clock, out: TextIO, err: TextIO) -> int:
    """``hostmove move watch --host H``: follow the move someone else started, as ``--wait`` does."""
    reply = await door.status(args.host)
    if not reply.ok:
        return not_ok(reply, err)
    return await _watch_from(door, args.host, reply.body, clock, out=out, err=err, **_following(args))


async def _watch_from(door: DoorClient, host: str, view: Mapping[str, Any], clock: Clock, *, until: str,
                      timeout_s: float, interval_s: float, out: TextIO, err: TextIO, said: set[str] | None = None
                      ) -> int:
    move = _move(view)
    last = view.get("last_move") or {}
    if move is None:  # nothing live: the last move's outcome, or nothing to follow
        if last.get("id"):
            _print(say("M-S5", host=host, move_id=str(last["id"]), outcome=str(last.get("outcome")).replace("_", " ")),
                   out)
            return outcome(view, str(last["id"])) or EXIT_DONE
        _print(f"{say('M-R19', host=host)} There is nothing to watch; start one with hostmove move --host {host} "
               "--to <region>.", err)
        return EXIT_FAILED
    move_id = str(move.get("id", ""))
    _print(f"Following move {move_id} of {host} from {move.get('from') or '?'} to {move.get('to') or '?'} "
           f"(requested by {move.get('requested_by') or '-'} at {utc_text(move.get('requested_at'))}).", out)
    return await follow(door, host, move_id, view, clock, until=until, timeout_s=timeout_s, interval_s=interval_s,
                        out=out, err=err, said=said)


async def _request(door: DoorClient, args: argparse.Namespace, clock: Clock, out: TextIO, err: TextIO) -> int:
    host = args.host
    reply = await door.request_move(host, args.to, "manual" if args.manual_cut else "auto")
    if not reply.ok:
        return not_ok(reply, err)
    move = reply.body.get("move") or {}
    move_id = str(move.get("id", ""))
    _print(say("M-C1", host=host, from_region=move.get("from", "?"), to_region=move.get("to", args.to)), out)
    if not reply.body.get("started", True):
        _print(f"(This move, {move_id}, was already requested; following it.)", out)
    if not args.wait:
        return EXIT_DONE
    return await follow(door, host, move_id, reply.body, clock, out=out, err=err, **_following(args))


async def follow(door: DoorClient, host: str, move_id: str, first: Mapping[str, Any], clock: Clock, *,
                 timeout_s: float, interval_s: float, out: TextIO, err: TextIO, until: str = "serving",
                 said: set[str] | None = None) -> int:
    """``--wait`` and ``watch`` (§12): read the status until the move has an outcome (``until="serving"``: the
    host serves on the target or is back on the source; ``"closed"``: the close) or ``timeout_s`` passes; print
    each new step once. A failed read is retried until the deadline (the move goes on without us); a deadline
    reached while the door could not answer is an outage, not a wait. ``said``: sentences already on the screen
    (``status --watch``'s lines), not printed again."""
    watch = Watch(host, move_id)
    deadline = clock.monotonic() + timeout_s
    view: Mapping[str, Any] = first
    trouble = ""
    outage = False
    while True:
        for key, sentence in milestones(view, watch, clock.now_ms()):
            if key not in watch.seen and sentence:
                watch.seen.add(key)
                if sentence not in (said or ()):
                    _print(sentence, out)
        code = outcome(view, move_id, until)
        if code is not None:
            if until == "serving" and code != EXIT_WAITING and serving_end(view, move_id) is not None:
                _print(closing_line(view, watch), out)
            return code
        left = deadline - clock.monotonic()
        if left <= 0:
            break
        await clock.sleep(min(interval_s, left))
        try:
            reply = await door.status(host, timeout_s=min(REQUEST_TIMEOUT_S, max(deadline - clock.monotonic(), 1.0)))
        except (DoorUnreachable, NotTheDoor) as exc:
            outage = isinstance(exc, DoorUnreachable)
            if str(exc) != trouble:
                trouble = str(exc)
                _print(f"hostmove move: {trouble}; retrying until the deadline", err)
            continue
        if not reply.ok:
            outage = reply.outage
            if reply.reason != trouble:
                trouble = reply.reason
                _print(f"hostmove move: the status read failed: {trouble}", err)
            continue
        trouble, outage = "", False
        view = reply.body
    state = (watch.last or {}).get("state", "unknown")
    if outage:
        _print(f"The door could not tell where the move {move_id} of {host} is for the last reads ({trouble}); "
               f"it was {state}. It goes on without this command; follow it with hostmove move watch --host {host} "
               "once the door answers.", err)
        return EXIT_UNAVAILABLE
    _print(f"Still waiting after {_secs(timeout_s * 1000)} s: the move {move_id} of {host} is {state}. It goes on "
           f"without this command; follow it with hostmove move watch --host {host}.", err)
    return EXIT_WAITING


__all__ = [
    "DEFAULT_TIMEOUT_S", "DEFAULT_URL", "ENV_TOKEN", "ENV_URL", "UNTIL", "ConfigProblem", "DoorClient",
    "DoorConfig", "DoorUnreachable", "NotTheDoor", "Reply", "Timing", "Watch", "add_host_resolve", "add_parser",
    "readiness_lines",
    "closing_line", "follow", "load_config", "milestones", "not_ok", "offline_ms", "outcome", "redact_url",
    "rev_phase", "run", "run_host_resolve", "serving_end", "status_lines", "timings",
]
