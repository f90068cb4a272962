"""``hostmove``: the operator's command line.

    hostmove stack up|down|status      the embedded stack (NATS JetStream + SeaweedFS) under .hostmove/
    hostmove serve <service>           run a service (relay, projections, door, recovery, box --box L)
    hostmove audit [--host H]          replay the ledger stream and check it against S3
    hostmove probe                     run the object-store conformance probe
    hostmove demo                      the main job on the embedded default
    hostmove move --host H --to R      ask the door to move a host (also: move watch|status|cut|abort --host H)
    hostmove sim --seed N [--trace]    replay one seed of the deterministic simulation (also: gate, sweep)
    hostmove host|box list|show, move list|history|show, alerts [-o json]   read everything (hostmove.read_cli)
    hostmove login --door URL          store the door's URL and a token (also: logout; token create --role R)
    hostmove asyncapi                  print the AsyncAPI 3 document of the event stream

Exit codes: one table for every subcommand (:mod:`hostmove.exitcodes`, printed by ``hostmove --help``). An
outage of NATS or the object store is :data:`~hostmove.exitcodes.UNAVAILABLE` with a sentence naming it
(:func:`main`), never a refusal.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from hostmove import exitcodes
from hostmove.runtime import DEFAULT_ROOT, ConfigError, load_settings, open_runtime

SERVICES = ("relay", "projections", "door", "recovery", "box")


def _setup_logging(args: argparse.Namespace) -> None:
    """A service (``serve``) writes JSON lines only, whatever writes them (:mod:`hostmove.logs`); an interactive
    command keeps human lines on the terminal."""
    from hostmove.logs import configure_service, configure_terminal

    if args.command == "serve":
        configure_service(args.service, box=args.label)
    else:
        configure_terminal(args.verbose)


def cmd_stack(args: argparse.Namespace) -> int:
    from hostmove.stack import StackError, stack_down, stack_problems, stack_status, stack_up

    root = Path(args.root)
    try:
        if args.action == "up":
            info = stack_up(root, nats_cluster=args.nats_cluster)
            print(
                f"stack up: NATS {info.nats_url}, S3 {info.s3_endpoint} (endpoints in {root / 'stack.json'})"
            )
        elif args.action == "down":
            stopped = stack_down(root)
            print("stack stopped" if stopped else "no stack was running")
        else:
            status = stack_status(root)
            print(json.dumps(status, indent=2, default=str))
            problems = stack_problems(status)
            for line in problems:
                print(f"stack status: {line}", file=sys.stderr)
            return exitcodes.UNAVAILABLE if problems else exitcodes.OK
    except StackError as exc:
        print(f"stack {args.action} failed: {exc}", file=sys.stderr)
        return exitcodes.FAILED
    return exitcodes.OK


async def _audit(args: argparse.Namespace) -> int:
    from services.ledger.audit import run_audit, verdict

    rt = await open_runtime(load_settings(Path(args.root)), "audit", probe=False)
    try:
        check = await run_audit(rt.events, rt.ledger, host=args.host, protocol=not args.no_protocol)
    finally:
        await rt.close()
    said, line = verdict(check, host=args.host, strict=args.strict)
    if said == "unavailable":
        print(f"hostmove: {line}", file=sys.stderr)
        return exitcodes.UNAVAILABLE
    for finding in check.findings:
        print(finding.line())
    print(line, file=sys.stderr if said == "no-history" else sys.stdout)
    return exitcodes.OK if said == "clean" else exitcodes.FAILED


async def _probe(args: argparse.Namespace) -> int:
    rt = await open_runtime(load_settings(Path(args.root)), "probe", probe=True)
    await rt.close()
    print("object store conformance probe passed")
    return 0


async def _box(args: argparse.Namespace) -> int:
    if args.box_action == "wake":
        return await _box_wake(args)
    from hostmove import lost_cli

    if args.box_action in lost_cli.BOX_ACTIONS:
        return await lost_cli.run_box(args)
    from services.box.roster import RosterRefusal, init_box, read_deployment_key

    settings = load_settings(Path(args.root))
    rt = await open_runtime(settings, "box-init", box=args.label)
    try:
        published = await read_deployment_key(rt.store, settings.bucket)
        if published is None:
            print("box init refused: the deployment has no secrets key yet; run `hostmove deployment init` first "
                  "(a box takes the deployment's key, it never makes one of its own)", file=sys.stderr)
            return exitcodes.REFUSED
        init = await init_box(
            root=settings.root, label=args.label, region=args.region, store=rt.store, bucket=settings.bucket,
            events=rt.events, clock=rt.clock, actor=rt.actor,
            secrets_key=Path(args.secrets_key) if args.secrets_key else None, expect_fp=published.fp,
        )
    except RosterRefusal as exc:
        print(f"box init refused: {exc}", file=sys.stderr)
        return exitcodes.REFUSED
    finally:
        await rt.close()
    print(f"box {init.label} in region {init.region}: {init.box_dir} (secrets key {init.secrets_key_fp}, "
          f"roster gen {init.roster_gen})")
    from hostmove.access import provision_local

    made = provision_local(settings.root, settings.bucket)  # the box's own NATS user and S3 identity (issue 14)
    if made:
        print(f"box {init.label}: {made}")
    return 0


async def _box_wake(args: argparse.Namespace) -> int:
    """``hostmove box wake HOST --box L``: what the box's router does for a request to a sleeping host (ask the
    box's agent, then wait for the instance in the box's edge table); for an operator, the same by hand."""
    import time

    from bus.subjects import box_wake_subject
    from hostmove.access import ROUTER
    from services.agent.config import BoxConfigError, load_box
    from services.agent.service import read_endpoint

    settings = load_settings(Path(args.root), role=ROUTER)  # a wake is the router role's to send (issue 14)
    rt = await open_runtime(settings, "cli", probe=False)
    try:
        try:
            reply = await rt.events.nc.request(box_wake_subject(args.label), args.host.encode(), timeout=5.0)
        except Exception as exc:  # noqa: BLE001 - the operator's words: which box did not answer, and why
            print(f"{args.host} was not woken: box {args.label}'s agent did not answer ({type(exc).__name__}); "
                  "is `hostmove serve box --box` running?", file=sys.stderr)
            return exitcodes.UNAVAILABLE
    finally:
        await rt.close()
    body = json.loads(reply.data)
    if "error" in body:
        print(f"{args.host} was not woken: {body['error']}", file=sys.stderr)
        return exitcodes.REFUSED
    try:
        box_dir = load_box(settings.root, args.label).box_dir
    except BoxConfigError:
        print(f"box {args.label} asked to wake {args.host} (its edge table is not on this machine to watch)")
        return 0
    deadline = time.monotonic() + args.wait
    while (port := read_endpoint(box_dir, args.host)) is None:
        if time.monotonic() > deadline:
            print(f"{args.host} is not served on box {args.label} after {args.wait:g} s: the box serves only a host "
                  "whose claim names it; see its agent's log for why not", file=sys.stderr)
            return exitcodes.WAITING
        await asyncio.sleep(0.1)
    print(f"{args.host} is served on box {args.label} at 127.0.0.1:{port}")
    return 0


async def _host(args: argparse.Namespace) -> int:
    if args.host_action == "resolve":  # through the door, operator-only (§7.10, §12)
        from hostmove import move_cli

        return await move_cli.run_host_resolve(args)
    from events.ids import new_incarnation
    from services.apps.releases import ReleaseError, read_release
    from services.box.roster import read_roster
    from services.hosts.create import create_host
    from services.ledger import Refusal

    settings = load_settings(Path(args.root))
    rt = await open_runtime(settings, "cli", probe=False)
    try:
        roster, _ = await read_roster(rt.store, settings.bucket)
        entry = roster.box(args.box) if roster else None
        if entry is None:
            print(f"{args.host} was not created: box {args.box} is not in the roster "
                  "(run `hostmove box init` on it first).", file=sys.stderr)
            return exitcodes.REFUSED
        if entry.fenced_at is not None:
            print(f"{args.host} was not created: box {args.box} was fenced (gone for good); create it on a live box "
                  f"of {entry.region}.", file=sys.stderr)
            return exitcodes.REFUSED
        if not args.app:
            print(f"{args.host} was not created: name the app it runs with --app (hostmove app list)",
                  file=sys.stderr)
            return exitcodes.REFUSED
        try:
            _release, ref, _body = await read_release(rt.store, settings.bucket, args.app, args.release)
        except ReleaseError as exc:
            print(f"{args.host} was not created: {exc}", file=sys.stderr)
            return exitcodes.REFUSED
        out = await create_host(rt.ledger, args.host, box=entry.label, region=entry.region,
                                incarnation=new_incarnation(rt.rng), app=ref, causation="cli:host-create")
    finally:
        await rt.close()
    if isinstance(out, Refusal):
        print(f"{args.host} was not created: {out.reason}", file=sys.stderr)
        return exitcodes.REFUSED
    print(f"{args.host} is serving on {entry.label} ({entry.region}), running {ref.name}@{ref.release}, claim gen "
          f"{out.state.gen}")
    return 0


async def _deployment(args: argparse.Namespace) -> int:
    """``hostmove deployment init``: the deployment's key and floor, then (on the embedded stack) each role's
    identity: the console's, the projections', the router's and every box's (:mod:`hostmove.access`)."""
    from hostmove import app_cli
    from hostmove.access import provision_local
    from services.box.roster import ensure_deployment

    code = await app_cli.run_deployment(args)
    if code != exitcodes.OK:
        return code
    settings = load_settings(Path(args.root))
    rt = await open_runtime(settings, "cli", probe=False)
    try:  # the deployment's identity exists before any box starts: a box only reads it
        await ensure_deployment(rt.store, settings.bucket, rng=rt.rng, clock=rt.clock)
    finally:
        await rt.close()
    made = provision_local(settings.root, settings.bucket)
    print(f"deployment: {made}" if made else "deployment: give each role its own identity (examples/iam/ for S3, "
          "compose.yaml for NATS); the stack is not this machine's")
    return exitcodes.OK


async def _serve(args: argparse.Namespace) -> int:
    from hostmove import serve
    from hostmove.access import AccessError, role_of

    try:  # each service acts as its role, with the role's own credentials (issue 14 items 1 and 3)
        role: str | None = role_of(args.service, args.label)
    except AccessError:
        role = None  # an unknown service: serve.run names it
    return await serve.run(args.service, load_settings(Path(args.root), role=role), port=args.port,
                           label=args.label, health_port=args.health_port)


async def _demo(args: argparse.Namespace) -> int:
    from hostmove import demo

    return await demo.run(Path(args.root))


async def _rehearse(args: argparse.Namespace) -> int:
    from hostmove import rehearse

    return await rehearse.run(Path(args.root), args.scenario)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hostmove", description="Move a running app instance between regions.",
                                epilog=exitcodes.table_text(), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--root", default=str(DEFAULT_ROOT), help="the embedded stack's directory (default .hostmove)"
    )
    p.add_argument("-v", "--verbose", action="store_true")
    sub = p.add_subparsers(dest="command", required=True)
    st = sub.add_parser("stack", help="start, stop or inspect the embedded stack")
    st.add_argument("action", choices=("up", "down", "status"))
    st.add_argument("--nats-cluster", type=int, default=1, metavar="N",
                    help="up: N JetStream nodes of one cluster on loopback, the streams with N replicas (default 1)")
    au = sub.add_parser("audit", help="replay the ledger stream and check it against S3")
    au.add_argument("--host")
    au.add_argument("--strict", action="store_true", help="fail on rebase notices too")
    au.add_argument("--no-protocol", action="store_true",
                    help="skip the protocol checks (transition tables, K3, K4, K8): history and drift only")
    sv = sub.add_parser("serve", help="run a service")
    sv.add_argument("service", choices=SERVICES)
    sv.add_argument("--port", type=int, default=0, help="HTTP port for services that serve one")
    sv.add_argument("--box", "--label", dest="label", default="", help="the box an agent acts for (serve box)")
    sv.add_argument("--health-port", type=int, default=None,
                    help="the /livez and /readyz port (default HOSTMOVE_HEALTH_PORT, else a free port, logged)")
    sub.add_parser("probe", help="run the object-store conformance probe")
    bx = sub.add_parser("box", help="set up a box")
    bx_sub = bx.add_subparsers(dest="box_action", required=True)
    bi = bx_sub.add_parser("init", help="create the box directory, hold the secrets key, join the roster")
    bi.add_argument("--box", "--label", dest="label", required=True, help="the box's label")
    bi.add_argument("--region", required=True)
    bi.add_argument("--secrets-key", help="the deployment's P-256 key (PEM, mode 0600); default: the one "
                    "`hostmove deployment init` holds here; any other key is refused")
    bf = bx_sub.add_parser("fence", help="a box is gone for good: kill it, fence it, relocate its hosts")
    bf.add_argument("--box", "--label", dest="label", required=True, help="the box's label")
    bf.add_argument("--terminated", action="store_true", help="confirm: the box never comes back")
    from hostmove import lost_cli

    lost_cli.add_box_parsers(bx_sub)
    bw = bx_sub.add_parser("wake", help="wake a sleeping host on its box (what the box's router does on a request)")
    bw.add_argument("host")
    bw.add_argument("--box", "--label", dest="label", required=True, help="the box that serves the host")
    bw.add_argument("--wait", type=float, default=60.0, help="seconds to wait for it to serve (default 60)")
    from hostmove import move_cli

    move_cli.add_parser(sub)
    hs = sub.add_parser("host", help="manage hosts")
    hs_sub = hs.add_subparsers(dest="host_action", required=True)
    hc = hs_sub.add_parser("create", help="create a host on a box through its claim")
    hc.add_argument("host")
    hc.add_argument("--box", required=True)
    hc.add_argument("--app", help="the app the host runs (hostmove app list); required")
    hc.add_argument("--release", type=int, default=None, help="the app's release number (default: its newest)")
    move_cli.add_host_resolve(hs_sub)
    from hostmove import app_cli

    app_cli.add_parsers(sub)
    from hostmove import ops_cli

    ops_cli.add_parsers(sub)
    sub.add_parser("demo", help="bring the stack up and show the system working")
    sub.add_parser("asyncapi", help="print the AsyncAPI 3 document of the event stream (JSON)")
    from hostmove import rehearse

    rehearse.add_parser(sub)
    from hostmove import read_cli

    read_cli.add_parsers(p, sub)  # host list|show, box list|show, move list|history|show, alerts, -o, --version
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["sim"]:
        from sim.cli import main as sim_main

        return sim_main(argv[1:])
    args = build_parser().parse_args(argv)
    _setup_logging(args)
    try:
        if args.command == "stack":
            return cmd_stack(args)
        if args.command == "asyncapi":  # issue 19 item 6: bus/asyncapi.py
            from bus.asyncapi import specification

            print(json.dumps(specification(), indent=2))
            return exitcodes.OK
        from hostmove import app_cli, move_cli, ops_cli

        if getattr(args, "read", None) is not None:  # the read commands (hostmove.read_cli)
            return asyncio.run(args.read(args))
        runner = {"audit": _audit, "probe": _probe, "serve": _serve, "demo": _demo, "rehearse": _rehearse, "box": _box,
                  "host": _host, "move": move_cli.run, "app": app_cli.run_app,
                  "deployment": _deployment, "login": ops_cli.run, "logout": ops_cli.run,
                  "token": ops_cli.run}[args.command]
        try:
            return asyncio.run(runner(args))
        except BaseException as exc:  # noqa: BLE001 - an outage is answered in the operator's words, never a trace
            code = _outage(exc, args)
            if code is None:
                raise
            return code
    except ConfigError as exc:
        print(f"hostmove: {exc}", file=sys.stderr)
        return exitcodes.USAGE
    except KeyboardInterrupt:
        return exitcodes.INTERRUPTED


def _outage(exc: BaseException, args: argparse.Namespace) -> int | None:
    """The exit code and the sentence for a dependency that failed under a command: NATS unreachable or not
    answering (:class:`bus.log.LogError`, the client's own errors), the object store unreachable or answering 5xx
    (:class:`StoreError`), credentials it rejects (configuration), or a store that failed the conformance probe
    (told apart from a store that is simply down). ``None``: not a dependency's failure."""
    from nats.errors import Error as NatsError
    from nats.js.errors import APIError

    from bus.log import LogError
    from services.objstore.port import AccessDenied, StoreError
    from services.objstore.probe import PROBE_EXIT_CODE

    def say(text: str) -> None:  # a service's lines are JSON (hostmove.logs); a command's are the operator's
        if args.command == "serve":
            logging.getLogger("hostmove").error(text)
        else:
            print(f"hostmove: {text}", file=sys.stderr)

    again = "Try again once it answers (the embedded stack: `hostmove stack status`)"
    try:
        settings = load_settings(Path(args.root))
        nats, s3 = f"NATS at {settings.nats_url}", f"the object store at {settings.s3_endpoint}"
    except ConfigError:
        nats, s3 = "NATS", "the object store"
    if isinstance(exc, SystemExit) and exc.code == PROBE_EXIT_CODE:
        down = _store_down(args)
        if down:
            say(f"{s3} is unavailable ({down}). {again}")
            return exitcodes.UNAVAILABLE
        say("the object store answered but failed the conformance probe (above): it cannot give the guarantees "
            "moves rely on")
        return exitcodes.NONCONFORMING
    if isinstance(exc, AccessDenied):
        say(f"the object store refused these credentials ({exc}); check HOSTMOVE_S3_ACCESS_KEY and "
            "HOSTMOVE_S3_SECRET_KEY")
        return exitcodes.USAGE
    if isinstance(exc, StoreError):
        say(f"{s3} is unavailable ({exc}); nothing more was done. {again}")
        return exitcodes.UNAVAILABLE
    if isinstance(exc, APIError) and exc.code != 503:
        return None  # JetStream answered: a defect to see in full, not an outage
    if isinstance(exc, LogError | NatsError):
        say(f"{nats} is unavailable ({str(exc) or type(exc).__name__}); nothing more was done. {again}")
        return exitcodes.UNAVAILABLE
    return None


def _store_down(args: argparse.Namespace) -> str:
    """After a failed conformance probe: why the store does not answer at all (an outage), or ``""`` (it answers,
    so the probe's failure is the store's behaviour)."""
    from services.objstore.port import StoreUnavailable
    from services.objstore.s3 import S3Store

    async def ask() -> str:
        settings = load_settings(Path(args.root))
        store = await S3Store.open(endpoint=settings.s3_endpoint, access_key=settings.s3_access_key,
                                   secret_key=settings.s3_secret_key, region=settings.s3_region)
        try:
            await store.get(settings.bucket, "control/roster.json")
        except StoreUnavailable as exc:
            return str(exc)
        except Exception:  # noqa: BLE001 - it answered, if only to refuse: not an outage
            return ""
        finally:
            await store.close()
        return ""

    try:
        return asyncio.run(ask())
    except (ConfigError, OSError) as exc:
        return str(exc)


if __name__ == "__main__":
    sys.exit(main())
