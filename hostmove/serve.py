"""``hostmove serve <service>``: run one service until SIGTERM or Ctrl-C (ARCHITECTURE §2).

Every service starts by running the object-store conformance probe (exit 3 on a failing store).

**Outages** (issue 11 item 3). Every service first starts its health server (:mod:`hostmove.health`: ``/livez``,
``/readyz`` on ``--health-port`` / ``HOSTMOVE_HEALTH_PORT``, default a free port, logged; bound to
``HOSTMOVE_HEALTH_BIND``, default 127.0.0.1), then waits for S3 and NATS as long as it takes (not ready meanwhile).
Afterwards NATS reconnects forever on a capped backoff (:mod:`bus.nats_log`); a pass of the relay or the recovery
that meets an unreachable NATS or S3 stops, is logged once per outage naming the dependency, and is tried again on a
capped backoff (woken early when NATS comes back). Every position a service resumes from is durable (the store's
objects, the projection's stored position), never memory.

- ``relay``: republishes any claim or record whose latest gen is not on the stream (ARCHITECTURE §4),
  on a timer from the Clock port. Objects it cannot settle are logged as errors every pass.
- ``projections``: the projector (snapshot and change feed in SQLite) and its HTTP read API.
- ``recovery``: the console's recovery pass (claim halves the record decided, releases from
  ``last_move``, deadline alerts), on a timer.
- ``box``: one box's agent (``--label L``): its instances and both sides of its moves, woken by ledger events
  and a scan (:mod:`services.agent.service`). Refuses to run where it cannot spawn strictly (§5.3).
  ``HOSTMOVE_PROFILE`` picks the timing profile (``fast`` for the embedded default, ``production``);
  ``HOSTMOVE_IDLE_S`` overrides how long a serving instance may be idle before it sleeps (``never``: it does not);
  ``HOSTMOVE_SCAN_S`` the period of its backstop look at the claims; ``HOSTMOVE_PASS_WORKERS`` how many hosts'
  passes it runs at once (one per host at a time; the recovery pass likewise, :mod:`kernel.passes`);
  ``HOSTMOVE_PROBE_WINDOW_S`` the landing probe's window (§7.3).
- ``door``: the operator HTTP API (move requests, cut, abort, status, create); needs operator tokens
  (``HOSTMOVE_OPERATOR_TOKENS``: sha256 digests, see :mod:`services.door.auth`).

The door's and the projections' APIs bind ``HOSTMOVE_BIND`` (default 127.0.0.1; :func:`api_bind`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, TypeVar

from bus.log import LogError, LogUnavailable
from hostmove.health import Health, health_address
from hostmove.logs import add_secret, configure_service
from hostmove.runtime import Runtime, Settings, nats_check, open_runtime, s3_check
from kernel.logctx import ctx
from services.objstore.port import StoreError, StoreUnavailable

if TYPE_CHECKING:
    from services.recovery.recovery import RecoveryPass

log = logging.getLogger("hostmove.serve")

RELAY_INTERVAL_S = 5.0
T = TypeVar("T")
OUTAGE_BACKOFF_MIN_S = 0.5
"""A pass stopped by an outage is tried again after this, doubling up to the service's interval."""
PROJECTION_MAX_LAG = 1000
"""The projections are ready while they are at most this many messages behind the ledger stream
(``HOSTMOVE_PROJECTION_MAX_LAG``)."""


def _stop_event() -> asyncio.Event:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    return stop


class _Pace:
    """A loop's sleep between passes: ``interval_s`` after a pass, a capped backoff after a pass an outage stopped
    (logged once per outage, naming the dependency), cut short by ``stop`` or a NATS reconnect."""

    def __init__(self, service: str, interval_s: float, stop: asyncio.Event, rt: Runtime) -> None:
        self.service, self.interval_s, self.stop = service, interval_s, stop
        self.failures = 0
        self.down_since: float | None = None
        self._wake = asyncio.Event()
        rt.events.on_reconnect(self._wake.set)

    def outage(self, dependency: str, reason: object) -> None:
        self.failures += 1
        if self.down_since is None:
            self.down_since = asyncio.get_running_loop().time()
            log.warning("%s: pass stopped, %s unreachable (%s); trying again on a capped backoff", self.service,
                        dependency, reason, extra={"phase": self.service, "dependency": dependency,
                                                   "reason": str(reason)})

    def passed(self) -> None:
        if self.down_since is not None:
            log.warning("%s: passes run again after %.1f s", self.service,
                        asyncio.get_running_loop().time() - self.down_since, extra={"phase": self.service})
        self.failures, self.down_since = 0, None

    async def sleep(self) -> None:
        delay = self.interval_s if not self.failures else min(
            self.interval_s, OUTAGE_BACKOFF_MIN_S * 2 ** min(self.failures - 1, 10))
        self._wake.clear()
        stopper = asyncio.ensure_future(self.stop.wait())
        woken = asyncio.ensure_future(self._wake.wait())
        try:
            await asyncio.wait({stopper, woken}, timeout=delay, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopper.cancel()
            woken.cancel()


def _dependency(exc: BaseException) -> str:
    return "nats" if isinstance(exc, LogError) else "s3"


async def _answered(what: str, read: Callable[[], Awaitable[T]], stop: asyncio.Event, *, service: str) -> T:
    """A start-up read the service cannot go on without, retried through an outage of the store or the bus on a
    capped backoff (named once), never a reason to exit: a service never dies of a dependency's outage."""
    failures = 0
    while True:
        try:
            return await read()
        except (StoreUnavailable, LogUnavailable) as exc:
            failures += 1
            if failures == 1:
                log.warning("%s: %s is unreachable while reading %s (%s); trying again on a capped backoff",
                            service, _dependency(exc), what, exc,
                            extra={"phase": service, "dependency": _dependency(exc), "reason": str(exc)})
            if stop.is_set():
                raise
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), min(5.0, OUTAGE_BACKOFF_MIN_S * 2 ** min(failures - 1, 10)))


async def _relay(rt: Runtime, stop: asyncio.Event) -> None:
    log.info("relay: settling every claim and record on the stream every %g s", RELAY_INTERVAL_S,
             extra=ctx(phase="relay"))
    pace = _Pace("relay", RELAY_INTERVAL_S, stop, rt)
    while not stop.is_set():
        try:
            failed = await rt.ledger.relay_all()
        except (LogUnavailable, StoreError) as exc:  # the pass stops; the next one starts from the store again
            pace.outage(_dependency(exc), exc)
        else:
            pace.passed()
            for line in failed:
                log.error("relay could not settle %s", line, extra=ctx(phase="relay", reason=line))
        await pace.sleep()


async def _projections(rt: Runtime, stop: asyncio.Event, port: int, health: Health) -> None:
    import os

    from projections.api import PROJECTOR_STATE, make_app, readiness, serve
    from projections.runner import Projector
    from projections.store import ProjectionStore

    max_lag = int(os.environ.get("HOSTMOVE_PROJECTION_MAX_LAG", "") or PROJECTION_MAX_LAG)
    store = ProjectionStore.open(rt.settings.root / "projections", rng=rt.rng, clock=rt.clock)
    projector = Projector(store, rt.events, clock=rt.clock)
    rt.events.on_reconnect(projector.notify)  # a catch-up backing off after an outage goes at once
    from projections.console import Access, Console

    console = Console(rt.store, rt.settings.bucket, rt.events, Access.from_env())  # the dashboard (issue 20)
    app = make_app(store, clock=rt.clock, projector=projector, console=console)
    health.check("projection", lambda: readiness(store, rt.events, app[PROJECTOR_STATE], max_lag=max_lag))
    wake = await projector.wake_on(rt.events.nc)  # core NATS; nats-py subscribes it again after a reconnect
    runner = await serve(app, host=api_bind(), port=port or 8080)
    log.info("projections: read API on http://%s:%d/ (OpenAPI at /openapi.json)", api_bind(), port or 8080,
             extra=ctx(port=port or 8080))
    try:
        await stop.wait()
    finally:
        with contextlib.suppress(Exception):
            await wake.unsubscribe()
        await runner.cleanup()
        store.close()


BIND_ENV = "HOSTMOVE_BIND"
DEFAULT_BIND = "127.0.0.1"


def api_bind() -> str:
    """The address the door's and the projections' HTTP APIs bind: ``HOSTMOVE_BIND`` (default 127.0.0.1, this
    machine only; ``0.0.0.0`` in a container, issue 20 item 6)."""
    import os

    return os.environ.get(BIND_ENV, "").strip() or DEFAULT_BIND


RECOVERY_INTERVAL_S = 5.0


async def _recovery(rt: Runtime, stop: asyncio.Event) -> int:
    import os

    from bus.subjects import RECOVERY_DURABLE
    from kernel.passes import WORKERS_ENV, workers_override
    from services.move.park import FAST, PRODUCTION
    from services.recovery.recovery import FAST_HISTORY_EVERY_MS, HISTORY_EVERY_MS, RecoveryPass, log_report

    try:
        workers = workers_override(os.environ.get(WORKERS_ENV))
    except ValueError as exc:  # nothing starts
        log.error("hostmove serve recovery: %s", exc, extra=ctx(phase="recovery", reason=exc))
        return 2
    fast = os.environ.get("HOSTMOVE_PROFILE", "fast" if rt.settings.local else "production") == "fast"
    recovery = RecoveryPass(rt.ledger, rt.events, park_timing=FAST if fast else PRODUCTION,  # H of the history
                            history_every_ms=FAST_HISTORY_EVERY_MS if fast else HISTORY_EVERY_MS, workers=workers)
    log.info("recovery: every transition from the durable consumer %s, and a backstop pass every %g s",
             RECOVERY_DURABLE, RECOVERY_INTERVAL_S, extra=ctx(phase="recovery", durable=RECOVERY_DURABLE))
    consumer = asyncio.ensure_future(_recovery_consumer(rt, recovery, workers, stop))
    pace = _Pace("recovery", RECOVERY_INTERVAL_S, stop, rt)
    try:
        while not stop.is_set():
            try:
                report = await recovery.run_once()
            except (LogUnavailable, StoreError) as exc:  # run_once reports outages itself; this is the belt
                pace.outage(_dependency(exc), exc)
                await pace.sleep()
                continue
            log_report(report)
            if report.unavailable is not None:
                pace.outage(*report.unavailable)
            else:
                pace.passed()
            await pace.sleep()
    finally:
        consumer.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await consumer
    return 0


async def _recovery_consumer(rt: Runtime, recovery: RecoveryPass, workers: int, stop: asyncio.Event) -> None:
    """The recovery's ledger consumer (:mod:`services.recovery.consumer`), started again on the capped backoff
    while it cannot start (the pass stands in meanwhile), stopped with the service."""
    from bus.nats_log import reconnect_delay
    from bus.subjects import RECOVERY_DURABLE
    from services.recovery.consumer import ledger_consumer

    attempt = 0
    while not stop.is_set():
        broker = ledger_consumer(rt.settings.nats_url, recovery, workers=workers,
                                 credentials=rt.settings.credentials)
        try:
            await broker.start()
        except Exception as exc:  # noqa: BLE001 - a consumer that cannot start leaves the backstop pass working
            log.warning("recovery: the ledger consumer did not start (%s: %s); the pass stands in, again soon",
                        type(exc).__name__, exc, extra=ctx(phase="recovery", reason=exc, durable=RECOVERY_DURABLE))
            with contextlib.suppress(Exception):
                await broker.stop()
            await asyncio.sleep(reconnect_delay(attempt))
            attempt += 1
            continue
        log.info("recovery: the ledger consumer %s started", RECOVERY_DURABLE,
                 extra=ctx(phase="recovery", durable=RECOVERY_DURABLE))
        try:
            await stop.wait()
        finally:
            with contextlib.suppress(Exception):
                await broker.stop()
        return


async def _door(rt: Runtime, stop: asyncio.Event, port: int) -> None:
    from services.door.api import Door, serve_door
    from services.door.auth import load_tokens

    runner = await serve_door(Door(rt.ledger, clock=rt.clock, rng=rt.rng), port or 8081, tokens=load_tokens(),
                              host=api_bind())
    log.info("door: operator API on http://%s:%d/ (OpenAPI at /openapi.json)", api_bind(), port or 8081,
             extra=ctx(port=port or 8081))
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


async def _box_agent(rt: Runtime, stop: asyncio.Event, label: str) -> int:
    import os

    from kernel.failpoints import Failpoints
    from kernel.timetext import utc_text
    from services.agent.config import BoxConfigError, load_box
    from services.agent.service import (
        PROFILES,
        BoxAgent,
        cut_slots_override,
        cut_window_override,
        idle_override,
        pass_workers_override,
        prepare_override,
        prepare_slots_override,
        probe_window_override,
        scan_override,
    )
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
        timing = prepare_override(timing, os.environ.get("HOSTMOVE_PREPARE_BOUND_S"))
        timing = cut_window_override(timing, os.environ.get("HOSTMOVE_CUT_WINDOW_S"))
        timing = scan_override(timing, os.environ.get("HOSTMOVE_SCAN_S"))
        timing = pass_workers_override(timing, os.environ.get("HOSTMOVE_PASS_WORKERS"))
        timing = cut_slots_override(timing, os.environ.get("HOSTMOVE_CUT_SLOTS"))
        timing = prepare_slots_override(timing, os.environ.get("HOSTMOVE_PREPARE_SLOTS"))
        timing = probe_window_override(timing, os.environ.get("HOSTMOVE_PROBE_WINDOW_S"))
    except ValueError as exc:
        log.error("hostmove serve box: %s", exc, extra=ctx(box=label, reason=exc))
        return 2
    from services.box.fence import read_fence

    fenced = await _answered("the box's fence record", lambda: read_fence(rt.store, rt.settings.bucket, label), stop,
                             service="box")
    if fenced is not None:
        log.error("hostmove serve box: box %s was fenced at %s (%s); a fenced box never acts again: enroll a "
                  "replacement under a new label", label, utc_text(fenced[0].fenced_at), fenced[0].evidence,
                  extra=ctx(box=label, reason="fenced"))
        return 2
    from services.box.artifacts.sealing import SealError
    from services.box.deployment import below_floor, read_floor

    floor = await _answered("the protocol floor", lambda: read_floor(rt.store, rt.settings.bucket), stop, service="box")
    below = below_floor(floor)  # §11, rule floor-boot-recovery
    if below is not None:
        log.error("hostmove serve box: box %s refuses at boot to take part in moves: %s; install a release at or "
                  "above the floor (control/moves-protocol.json)", label, below, extra=ctx(box=label, reason=below))
        return 2
    try:
        cfg.secrets_key()
    except SealError as exc:  # §10: a box without the deployment's key cannot open an instance's secrets
        log.error("hostmove serve box: box %s holds no usable secrets key (%s); install the deployment's key with "
                  "hostmove box init --secrets-key", label, exc, extra=ctx(box=label, reason=exc))
        return 2
    deployment = await _answered("the deployment's identity", lambda: ensure_deployment(
        rt.store, rt.settings.bucket, rng=rt.rng, clock=rt.clock), stop, service="box")
    tree = CgroupTree.discover(label, deployment=deployment, clock=rt.clock, journal=cfg.box_dir / "spawns")
    ok, why = tree.strict_available()
    if not ok:
        log.error("hostmove serve box: box %s cannot spawn strictly (%s); it refuses to take part in moves", label,
                  why, extra=ctx(box=label, reason=why))
        return 2
    from services.box.instance.sandbox import InstanceUsers, SandboxError, shared_dirs

    try:  # as root, each instance runs as a user of its own, never as the agent (issue 14 item 4)
        if os.geteuid() == 0:
            tree.instance_users = InstanceUsers(cfg.box_dir)
            shared_dirs([cfg.acks_dir])
    except (SandboxError, OSError) as exc:
        log.error("hostmove serve box: %s", exc, extra=ctx(box=label, reason=exc))
        return 2
    if rt.settings.may_create_buckets:
        await _answered("the box's data bucket", lambda: rt.store.create_bucket(cfg.data_bucket, versioned=True),
                        stop, service="box")
    faults = Failpoints.from_env()
    ledger = Ledger(rt.store, rt.events, rt.clock, rt.actor, rt.settings.bucket, faults=faults,
                    movelog=rt.ledger.movelog)  # §13: the box's agent logs the transitions it makes
    with box_session(tree):  # every start on this box renders its host's app release (issue 18)
        agent = BoxAgent(cfg, store=rt.store, bucket=rt.settings.bucket, events=rt.events, ledger=ledger,
                         clock=rt.clock, rng=rt.rng, tree=tree, timing=timing, faults=faults)
        subs = await agent.wake_on(rt.events.nc)
        sleeps = "never" if timing.idle_s is None else f"after {timing.idle_s:g} s idle"
        log.info("box %s (%s): agent running, profile %s, hosts sleep %s, cut window %g s, landing probe window %g s",
                 label, cfg.region, profile, sleeps, timing.move.source.cut_window_s, timing.probe.window_s,
                 extra=ctx(box=label, region=cfg.region, profile=profile,
                           cut_window_s=timing.move.source.cut_window_s, probe_window_s=timing.probe.window_s))
        try:
            await agent.run(stop)
        finally:
            for sub in subs:
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()
            await agent.close()
    return 0


async def _open(settings: Settings, service: str, label: str, health: Health, stop: asyncio.Event) -> Runtime | None:
    """The runtime, waiting for S3 and NATS as long as it takes; None when stopped meanwhile."""
    opening = asyncio.ensure_future(open_runtime(settings, service, box=label, wait=True, health=health,
                                                 probe=service != "projections"))  # they only read the store
    stopper = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({opening, stopper}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopper.cancel()
    if not opening.done():
        opening.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await opening
        return None
    return opening.result()


async def run(service: str, settings: Settings, *, port: int = 0, label: str = "",
              health_port: int | None = None) -> int:
    configure_service(service, box=label)  # every line this process writes is JSON from here (hostmove.logs)
    add_secret(settings.s3_secret_key)
    if settings.credentials is not None:
        add_secret(*settings.credentials.secrets())  # the role's nkey seed and S3 secret (issue 14)
    if service == "door":
        from services.door.auth import TokenConfigError, load_tokens

        try:
            load_tokens()
        except TokenConfigError as exc:
            log.error("hostmove serve door: %s", exc, extra=ctx(reason=exc))
            return 2
    if service == "projections":  # who may read the console and the dashboard (issue 20)
        from projections.console import Access
        from services.door.auth import TokenConfigError

        try:
            Access.from_env()
        except TokenConfigError as exc:
            log.error("hostmove serve projections: %s", exc, extra=ctx(reason=exc))
            return 2
    if service == "box" and not label:
        log.error("hostmove serve box: name the box with --box")
        return 2
    try:
        bind, hport = health_address(health_port)
    except ValueError as exc:
        log.error("hostmove serve %s: %s", service, exc)
        return 2
    health = Health(f"{service} {label}" if label else service)
    health.expect("s3", "nats", reason="connecting")
    stop = _stop_event()
    hport = await health.start(bind, hport)
    log.info("%s: health on http://%s:%d/livez and /readyz", health.service, bind, hport,
             extra={"health_port": hport, "health_bind": bind})
    try:
        rt = await _open(settings, service, label, health, stop)
        if rt is None:
            return 0
        health.check("nats", lambda: nats_check(rt.events))
        if service == "projections":
            health.deps.pop("s3", None)  # read from the stream only, once started
        else:
            health.check("s3", lambda: s3_check(rt.store, rt.settings.bucket))
        try:
            if service == "box":
                return await _box_agent(rt, stop, label)
            if service == "relay":
                await _relay(rt, stop)
            elif service == "projections":
                await _projections(rt, stop, port, health)
            elif service == "door":
                await _door(rt, stop, port)
            elif service == "recovery":
                return await _recovery(rt, stop)
            else:
                raise ValueError(f"unknown service {service!r}")
        finally:
            await rt.close()
    finally:
        await health.stop()
    return 0
