"""``hostmove serve <service>``: run one service until SIGTERM or Ctrl-C (ARCHITECTURE §2).

Every service starts by running the object-store conformance probe (exit 3 on a failing store).

- ``relay``: republishes any claim or record whose latest gen is not on the stream (ARCHITECTURE §4),
  on a timer from the Clock port. Objects it cannot settle are logged as errors every pass.
- ``projections``: the projector (snapshot and change feed in SQLite) and its HTTP read API.
- ``recovery``: the console's recovery pass (claim halves the record decided, releases from
  ``last_move``, deadline alerts), on a timer.
- ``box``: one box's agent (``--label L``): its instances and both sides of its moves, woken by ledger events
  and a scan (:mod:`services.agent.service`). Refuses to run where it cannot spawn strictly (§5.3).
  ``HOSTMOVE_PROFILE`` picks the timing profile (``fast`` for the embedded default, ``production``);
  ``HOSTMOVE_IDLE_S`` overrides how long a serving instance may be idle before it sleeps (``never``: it does not).
- ``door``: the operator HTTP API (move requests, cut, abort, status, create); needs operator tokens
  (``HOSTMOVE_OPERATOR_TOKENS``: sha256 digests, see :mod:`services.door.auth`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal

from hostmove.logs import add_secret, configure_service
from hostmove.runtime import Runtime, Settings, open_runtime
from kernel.logctx import ctx

log = logging.getLogger("hostmove.serve")

RELAY_INTERVAL_S = 5.0


def _stop_event() -> asyncio.Event:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    return stop


async def _relay(rt: Runtime, stop: asyncio.Event) -> None:
    log.info("relay: settling every claim and record on the stream every %g s", RELAY_INTERVAL_S,
             extra=ctx(phase="relay"))
    while not stop.is_set():
        failed = await rt.ledger.relay_all()
        for line in failed:
            log.error("relay could not settle %s", line, extra=ctx(phase="relay", reason=line))
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), RELAY_INTERVAL_S)


async def _projections(rt: Runtime, stop: asyncio.Event, port: int) -> None:
    from projections.api import make_app, serve
    from projections.runner import Projector
    from projections.store import ProjectionStore

    store = ProjectionStore.open(rt.settings.root / "projections", rng=rt.rng, clock=rt.clock)
    projector = Projector(store, rt.events, clock=rt.clock)
    runner = await serve(make_app(store, clock=rt.clock, projector=projector), port=port or 8080)
    log.info("projections: read API on http://127.0.0.1:%d/ (OpenAPI at /openapi.json)", port or 8080,
             extra=ctx(port=port or 8080))
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
        store.close()


RECOVERY_INTERVAL_S = 5.0


async def _recovery(rt: Runtime, stop: asyncio.Event) -> None:
    from services.recovery.recovery import RecoveryPass

    recovery = RecoveryPass(rt.ledger, rt.events)
    log.info("recovery: a recovery pass every %g s", RECOVERY_INTERVAL_S, extra=ctx(phase="recovery"))
    while not stop.is_set():
        report = await recovery.run_once()
        for line in report.claim_halves + report.records_finished:
            log.info("recovery wrote %s", line, extra=ctx(phase="recovery"))
        for line in report.errors:
            log.error("recovery could not settle %s", line, extra=ctx(phase="recovery", reason=line))
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), RECOVERY_INTERVAL_S)


async def _door(rt: Runtime, stop: asyncio.Event, port: int) -> None:
    from services.door.api import Door, serve_door
    from services.door.auth import load_tokens

    runner = await serve_door(Door(rt.ledger, clock=rt.clock, rng=rt.rng), port or 8081, tokens=load_tokens())
    log.info("door: operator API on http://127.0.0.1:%d/ (OpenAPI at /openapi.json)", port or 8081,
             extra=ctx(port=port or 8081))
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


async def _box_agent(rt: Runtime, stop: asyncio.Event, label: str) -> int:
    import os

    from hostmove.probe_apps import ProbeApps
    from kernel.failpoints import Failpoints
    from kernel.timetext import utc_text
    from services.agent.config import BoxConfigError, load_box, moveprobe_spec
    from services.agent.service import PROFILES, BoxAgent, idle_override
    from services.box.instance.agentcg import box_session
    from services.box.instance.proctree import CgroupTree
    from services.box.roster import ensure_deployment
    from services.ledger.ledger import Ledger

    try:
        cfg = load_box(rt.settings.root, label)
    except BoxConfigError as exc:
        log.error("hostmove serve box: %s", exc, extra=ctx(box=label, reason=exc))
        return 2
    profile = os.environ.get("HOSTMOVE_PROFILE", "fast" if rt.settings.local else "production")
    if profile not in PROFILES:
        log.error("hostmove serve box: HOSTMOVE_PROFILE must be one of %s, not %r", ", ".join(PROFILES), profile,
                  extra=ctx(box=label, reason="profile"))
        return 2
    try:
        timing = idle_override(PROFILES[profile], os.environ.get("HOSTMOVE_IDLE_S"))
    except ValueError as exc:
        log.error("hostmove serve box: %s", exc, extra=ctx(box=label, reason=exc))
        return 2
    from services.box.fence import read_fence

    fenced = await read_fence(rt.store, rt.settings.bucket, label)
    if fenced is not None:
        log.error("hostmove serve box: box %s was fenced at %s (%s); a fenced box never acts again: enroll a "
                  "replacement under a new label", label, utc_text(fenced[0].fenced_at), fenced[0].evidence,
                  extra=ctx(box=label, reason="fenced"))
        return 2
    tree = CgroupTree.discover(label, deployment=await ensure_deployment(rt.store, rt.settings.bucket, rng=rt.rng,
                               clock=rt.clock), clock=rt.clock, journal=cfg.box_dir / "spawns")
    ok, why = tree.strict_available()
    if not ok:
        log.error("hostmove serve box: box %s cannot spawn strictly (%s); it refuses to take part in moves", label,
                  why, extra=ctx(box=label, reason=why))
        return 2
    from services.box.instance.sandbox import SandboxError, ensure_instance_user, hand_over_dirs

    try:  # every instance runs as the unprivileged instance user, never as the agent (issue 14 item 4)
        tree.instance_user = ensure_instance_user()
        hand_over_dirs(tree.instance_user, [cfg.acks_dir])
    except SandboxError as exc:
        log.error("hostmove serve box: %s", exc, extra=ctx(box=label, reason=exc))
        return 2
    if rt.settings.local:
        await rt.store.create_bucket(cfg.data_bucket, versioned=True)
    faults = Failpoints.from_env()
    ledger = Ledger(rt.store, rt.events, rt.clock, rt.actor, rt.settings.bucket, faults=faults)
    with box_session(tree) as home:
        apps = ProbeApps(home, cfg.acks_dir, region=cfg.region, tree=tree)
        agent = BoxAgent(cfg, store=rt.store, bucket=rt.settings.bucket, events=rt.events, ledger=ledger,
                         clock=rt.clock, rng=rt.rng, tree=tree, probe_factory=apps.factory, timing=timing,
                         faults=faults, app=moveprobe_spec(cfg.acks_dir, tunables=os.environ))
        subs = await agent.wake_on(rt.events.nc)
        sleeps = "never" if timing.idle_s is None else f"after {timing.idle_s:g} s idle"
        log.info("box %s (%s): agent running, profile %s, hosts sleep %s", label, cfg.region, profile, sleeps,
                 extra=ctx(box=label, region=cfg.region, profile=profile))
        try:
            await agent.run(stop)
        finally:
            for sub in subs:
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()
            await agent.close()
            await apps.stop_all()
    return 0


async def run(service: str, settings: Settings, *, port: int = 0, label: str = "") -> int:
    configure_service(service, box=label)  # every line this process writes is JSON from here (hostmove.logs)
    add_secret(settings.s3_secret_key)
    if service == "door":
        from services.door.auth import TokenConfigError, load_tokens

        try:
            load_tokens()
        except TokenConfigError as exc:
            log.error("hostmove serve door: %s", exc, extra=ctx(reason=exc))
            return 2
    if service == "box" and not label:
        log.error("hostmove serve box: name the box with --label")
        return 2
    rt = await open_runtime(settings, service, box=label)
    stop = _stop_event()
    try:
        if service == "box":
            return await _box_agent(rt, stop, label)
        if service == "relay":
            await _relay(rt, stop)
        elif service == "projections":
            await _projections(rt, stop, port)
        elif service == "door":
            await _door(rt, stop, port)
        elif service == "recovery":
            await _recovery(rt, stop)
        else:
            raise ValueError(f"unknown service {service!r}")
    finally:
        await rt.close()
    return 0
