"""``hostmove serve box --label L``: one box's agent, driven by events and timers (ARCHITECTURE §2, §5).

The agent is the box runtime (the activator that owns the box's instance processes) plus the box's move
workers, both sides (:mod:`services.agent.sides`): the source side for moves leaving this box, the target side for
moves landing on it. It keeps nothing that matters in memory:

- **Wake-ups** (issue 19 item 1). The box's durable consumer ``box-<label>`` on ``HM_WORK`` delivers the work
  notices the ledger sends this box (:mod:`services.ledger.notices`: one per transition naming it), each marking
  its host dirty and acknowledged once a pass of that host has ended well, so a notice sent while the agent was
  down, or taken by an agent that died before its pass, wakes the next agent (:meth:`BoxAgent.consume`). The
  backstop every ``scan_s`` (``HOSTMOVE_SCAN_S``; the first one ``scan_s`` after the start, the hosts the box
  holds locally passed at once) LISTs the claims with their ETags and GETs only the changed ones
  (:mod:`services.agent.backstop`, issue 19 item 2): it marks a host whose changed claim names this box, every
  instance running here and what time alone makes due, so a lost notice is picked up without one. A step that must
  wait (a park's horizon, a preparing round's pace) schedules its own wake.
- **A pass** reads the claim and the record fresh and runs what they say this box does next (§7.1-§7.9);
  the workers re-read again before every write (K5) and every phase is journaled before its effects, so a
  pass after a crash replays to the same outcome.
- **The runtime.** A ``serving`` claim whose ``exec`` is this box and whose instance does not run here is
  woken through the activator (a cold admission, §5.1 step 9); the route row is minted ``ready`` for it
  (§5.2: reconcile mints ``ready`` only while the claim is serving). A new agent process is a new session: it
  stops any app it finds running first (:meth:`Activator.adopt_running`).
- **Sleep** (:mod:`services.box.instance.sleep`). With ``idle_s`` set, a serving instance idle that long is stopped
  (the ordinary stop: drained, final sync, certificate) and marked asleep; a sleeping host is woken only on
  demand: a router's request on ``hm.box.<label>.wake`` (:meth:`BoxAgent.demand`), a due timer, or a move
  (S1 probes the source as it runs, §7.3).

- **Passes run concurrently** (issue 19 item 3, §7.4: the cut window is per host): up to ``pass_workers``
  (``HOSTMOVE_PASS_WORKERS``) hosts at once, one pass at a time per host (:mod:`services.agent.passes`), so a long
  landing never delays another host's cut.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote

import aiohttp

from bus.consumers import ConsumingLog, Delivery
from bus.facts import Fact, publish_alert
from bus.log import LogError, LogUnavailable, unavailable_reason
from bus.subjects import WORK_STREAM, SubjectError, box_durable, box_wake_subject, parse_work_subject, work_filter
from events.claim import Claim
from events.record import Record
from kernel import metrics, ports, rules
from kernel.fsutil import atomic_write
from kernel.logctx import ctx
from kernel.passes import DEFAULT_WORKERS, PassPool, workers_override
from kernel.ports import Clock, Random, blocking
from services.agent.backstop import CLAIMS_PREFIX, Here, Seen, look, to_read
from services.agent.config import (
    TIMER_PATH,
    BoxConfig,
    declared_timers,
    declared_timers_at,
    embedded_facts,
    region_bucket,
    sample_launch,
)
from services.agent.sides import (
    FAST,
    Deployment,
    SideStep,
    SourceRunners,
    SourceSide,
    TargetRunners,
    TargetSide,
    Timings,
    stage_of,
)
from services.apps.box import BoxApps
from services.apps.releases import ReleaseBook
from services.box.instance.activator import (
    SOURCE_SPAWNS_IN,
    Activator,
    AppSpec,
    BaselineRefused,
    BoxContext,
    Started,
    StartFailed,
    StartPolicy,
    StartRefused,
)
from services.box.instance.instances import Instances
from services.box.instance.peer import answered_by_leaf
from services.box.instance.proctree import ProcessTree
from services.box.instance.registry import Registry, RouteRow
from services.box.instance.sleep import Activity, SleepMarks, idle_left
from services.box.instance.stamps import StampBook
from services.box.instance.timers import TimerError, TimerRunner, Timers, TimersBusy
from services.box.instance.timers import drain as drain_timers
from services.door.api import Door
from services.ledger.badobjects import BadObjects
from services.ledger.ledger import BadObject, Committed, Ledger, Refusal
from services.move import park as parking
from services.move.resolve import CLEAR_FAILED, decide_clear_failed_done
from services.objstore.port import ObjectStore, StoreUnavailable
from services.recovery.relocation import decide_relocation_release
from services.source import phases as source_phases
from services.source.cutslots import prepare_slots_override as whole_prepare_slots
from services.source.cutslots import slots_override
from services.sweeper.generations import ChoresReport
from services.sweeper.lanes import LaneProbeSweep
from services.sweeper.straggler import StragglerSweep, SweepReport
from services.target.budget import FAST_BUDGET, PRODUCTION_BUDGET, BudgetTiming, Rates
from services.target.observe import TargetObserver
from services.target.probe import FAST as PROBE_FAST
from services.target.probe import PRODUCTION as PROBE_PRODUCTION
from services.target.probe import ProbeTiming
from services.target.rates import RateProbe
from services.target.readiness import BoxFacts
from services.target.worker import LandingWorker, ProbeFactory, TargetBox

log = logging.getLogger("hostmove.agent")

rules.register(
    "commit-before-open",
    section="INV-5, R3-5; §5.2 (a held row is never served); §7.9",
    meaning="public delivery only after the commit: the edge table names no held route and no landing's probe",
    site="services/agent/service.py BoxAgent._endpoint",
)


def dependency_of(exc: Exception) -> str:
    """The dependency an outage's exception names, in the operator's words."""
    return "NATS (the event stream)" if isinstance(exc, LogUnavailable) else "the object store (S3)"

SECOND_WRITER = "second-writer"
"""The alert of an instance this box stopped because its claim names another writer (issue 14 item 5)."""


FAST_RECOVERY = StartPolicy(attempts=2, first_backoff_s=0.2, ready_within_s=4.0)
"""The fast profile's recovery probe attempt (two starts in 4 s windows): nine failed attempts take about a minute."""


@dataclass(frozen=True)
class AgentTiming:
    """How often the agent looks without being told (``scan_s``), how soon it retries a pass that raised
    (``retry_s``), and the move's timings (the ``fast`` profile for tests and the demo, ARCHITECTURE §7)."""

    scan_s: float = 1.0
    retry_s: float = 1.0
    move: Timings = FAST
    probe: ProbeTiming = PROBE_FAST
    sync_interval_s: float = 0.2
    timer_tick_s: float = 0.1
    wake_backoff_max_s: float = 60.0
    max_steps: int = 40
    sweep_s: float = 10.0
    """How often the box looks for stragglers in a host's left location in its region (§6.4, at rest)."""
    idle_s: float | None = None
    """A serving instance idle this long is stopped and sleeps until a demand wakes it; None: hosts never sleep
    (the ``fast`` profile: the tests and the demo watch instances that must keep running)."""
    drain_s: float = 10.0
    """How long an idle stop waits for an in-flight timer delivery (§9.4 "Drained") before it tries again later."""
    retention_ms: int | None = 5_000
    """How long the parks' archives (``superseded/``, ``move-snapshots/``) are kept (:mod:`services.sweeper.retention`);
    None: the deployment's ``HOSTMOVE_RETENTION_S``, seven days by default (the production profile)."""
    recovery: StartPolicy | None = FAST_RECOVERY
    """The starts of one recovery probe attempt of a rollback's source (§7.8: nine attempts before ``stuck``); None:
    the box's policy, §7.7's five starts in a 30 s window (the production profile)."""
    budget: BudgetTiming = FAST_BUDGET
    """What T11 prices beside the measured rates (the probe's window and settle, the open, the cut window, §7.3)."""
    rates_max_age_s: float = 60.0
    """The box's measured rates are measured again once older than this (:mod:`services.target.rates`)."""
    pass_workers: int = DEFAULT_WORKERS
    """How many hosts' passes run at once, one per host at a time (:mod:`services.agent.passes`, issue 19 item 3)."""


PRODUCTION_AGENT = AgentTiming(scan_s=15.0, retry_s=5.0, move=Timings(
    source=source_phases.PRODUCTION, park=parking.PRODUCTION, poll_s=5.0), probe=PROBE_PRODUCTION, sync_interval_s=1.0,
    timer_tick_s=1.0, sweep_s=600.0, idle_s=900.0, retention_ms=None, recovery=None, budget=PRODUCTION_BUDGET,
    rates_max_age_s=600.0)
FAST_AGENT = AgentTiming()


def seconds_setting(name: str, text: str | None, *, above: float = 0.0, above_what: str = "",
                    extra: str = "") -> float | None:
    """A setting of seconds (``name``): None when unset or blank; a finite number above ``above``, or a
    ``ValueError`` naming the setting, what it must be and what was given (nothing starts)."""
    if text is None or not text.strip():
        return None
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not above < value < float("inf"):
        what = f"a number of seconds above {above_what}" if above_what else "a positive number of seconds"
        raise ValueError(f"{name} must be {what}{extra}, not {text!r}")
    return value


def idle_override(timing: AgentTiming, text: str | None) -> AgentTiming:
    """``HOSTMOVE_IDLE_S``: seconds a serving instance may be idle before it sleeps, or ``never``; unset keeps the
    profile's. Anything else is refused with the reason (nothing starts)."""
    if text is not None and text.strip() == "never":
        return replace(timing, idle_s=None)
    idle_s = seconds_setting("HOSTMOVE_IDLE_S", text, extra=" or 'never'")
    return timing if idle_s is None else replace(timing, idle_s=idle_s)


def prepare_override(timing: AgentTiming, text: str | None) -> AgentTiming:
    """``HOSTMOVE_PREPARE_BOUND_S``: seconds a move may stay preparing before the source aborts it (§7.11, the §13
    prepare budget); unset keeps the profile's. Anything else is refused with the reason."""
    bound = seconds_setting("HOSTMOVE_PREPARE_BOUND_S", text)
    if bound is None:
        return timing
    move = replace(timing.move, source=replace(timing.move.source, prepare_bound_s=bound))
    return replace(timing, move=move)


def cut_window_override(timing: AgentTiming, text: str | None) -> AgentTiming:
    """``HOSTMOVE_CUT_WINDOW_S``: the operator's cut window (§7.3 T11 "fits the operator's cut window (default
    120 s)", the M2 promise): the source's cut deadline and T11's window both take it, so T11 never admits a cut the
    deadline then rolls back. Unset keeps the profile's; anything else is refused with the reason."""
    budget = timing.move.source.open_budget_s
    window = seconds_setting("HOSTMOVE_CUT_WINDOW_S", text, above=budget, above_what=f"the open budget ({budget:g} s)")
    if window is None:
        return timing
    move = replace(timing.move, source=replace(timing.move.source, cut_window_s=window))
    return replace(timing, move=move, budget=replace(timing.budget, window_s=window))


def scan_override(timing: AgentTiming, text: str | None) -> AgentTiming:
    """``HOSTMOVE_SCAN_S``: the period of the backstop's look at the claims (issue 19
    item 2); unset keeps the profile's. Anything else is refused with the reason."""
    scan_s = seconds_setting("HOSTMOVE_SCAN_S", text)
    return timing if scan_s is None else replace(timing, scan_s=scan_s)


def probe_window_override(timing: AgentTiming, text: str | None) -> AgentTiming:
    """``HOSTMOVE_PROBE_WINDOW_S``: the landing probe's window (§7.3 "the app must answer within the probe window"):
    the probe's deadline and what T11 prices both take it. Unset keeps the profile's; anything else is refused with
    the reason (a window T11 then finds too long for the cut window refuses the cut, as any budget does)."""
    window = seconds_setting("HOSTMOVE_PROBE_WINDOW_S", text)
    if window is None:
        return timing
    return replace(timing, probe=replace(timing.probe, window_s=window),
                   budget=replace(timing.budget, probe_window_s=window))


def pass_workers_override(timing: AgentTiming, text: str | None) -> AgentTiming:
    """``HOSTMOVE_PASS_WORKERS``: how many hosts' passes a box runs at once (issue 19 item 3); unset keeps the
    profile's. Anything but a positive whole number is refused with the reason."""
    return replace(timing, pass_workers=workers_override(text, timing.pass_workers))


def cut_slots_override(timing: AgentTiming, text: str | None) -> AgentTiming:
    """``HOSTMOVE_CUT_SLOTS``: how many cuts a source box carries at once (:mod:`services.source.cutslots`); unset
    keeps the profile's. Anything but a positive whole number is refused with the reason."""
    return replace(timing, move=replace(timing.move, cut_slots=slots_override(text, timing.move.cut_slots)))


def prepare_slots_override(timing: AgentTiming, text: str | None) -> AgentTiming:
    """``HOSTMOVE_PREPARE_SLOTS``: how many moves a source box stages at once before they are ready
    (:mod:`services.source.cutslots`); unset keeps the profile's. Anything but a positive whole number is refused."""
    slots = whole_prepare_slots(text, timing.move.prepare_slots)
    return replace(timing, move=replace(timing.move, prepare_slots=slots))


PROFILES = {"fast": FAST_AGENT, "production": PRODUCTION_AGENT}


@dataclass(frozen=True)
class _HeldOff:
    """A host whose last wake here failed or was refused: not woken again before ``until`` (monotonic). A failed
    start may have admitted a session first, and that CAS is itself an event: without the backoff the agent would
    admit again on its own event, forever (found by the simulation)."""

    until: float
    delay_s: float


@dataclass
class PassResult:
    """One host's pass: what it did, and when it wants to be woken (seconds; None: on the next event)."""

    host: str
    did: list[str] = field(default_factory=list)
    again_in_s: float | None = None


NOTICE_ACK_WAIT_S = 30.0
"""How long a work notice delivered to an agent waits for its acknowledgement before the server delivers it again:
an agent that died with it unacknowledged is replaced within this (issue 19 item 1)."""


class BoxAgent:
    """One box's runtime and move workers (see the module doc)."""

    def __init__(self, cfg: BoxConfig, *, store: ObjectStore, bucket: str, events: ConsumingLog, ledger: Ledger,
                 clock: Clock, rng: Random, tree: ProcessTree, probe_factory: ProbeFactory | None = None,
                 timing: AgentTiming | None = None, faults: Callable[[str], None] | None = None,
                 app: AppSpec | None = None, rates: Callable[[str], Awaitable[Rates | None]] | None = None) -> None:
        self.cfg, self.events, self.ledger, self.clock = cfg, events, ledger, clock
        self.store, self.bucket = store, bucket
        self.timing = timing or AgentTiming()
        self.registry = Registry.open(cfg.box_dir, clock)
        self.stamps = StampBook.open(cfg.box_dir, clock)
        self.timers = Timers.open(cfg.box_dir, clock)
        key = cfg.secrets_key()
        self.ctx = BoxContext(label=cfg.label, region=cfg.region, box_dir=cfg.box_dir, data_bucket=cfg.data_bucket,
                              data_store=store, ledger=ledger, tree=tree, registry=self.registry,
                              stamps=self.stamps, clock=clock, rng=rng)
        # Every start renders the host's app release (issue 18), unless the composition runs one fixed app.
        self.apps: BoxApps | None = None if app is not None else BoxApps(
            label=cfg.label, region=cfg.region, box_dir=cfg.box_dir, side_dir=cfg.acks_dir,
            book=ReleaseBook(cfg.box_dir / "releases", store, bucket), read_claim=self._read_claim, secrets_key=key,
            tree=tree)
        self.activator = Activator(self.ctx, app if app is not None else self.apps)  # type: ignore[arg-type]
        if probe_factory is None:
            assert self.apps is not None, "a fixed app brings its own probe factory"
            probe_factory = self.apps.probe_factory
        self.landing = LandingWorker(TargetBox(
            label=cfg.label, region=cfg.region, box_dir=cfg.box_dir, data_store=store, data_bucket=cfg.data_bucket,
            ledger=ledger, registry=self.registry, stamps=self.stamps, timers=self.timers, clock=clock, rng=rng,
            private_key=key, probe_factory=probe_factory, probe_timing=self.timing.probe,
            sync_interval_s=self.timing.sync_interval_s, tree=tree, instances=self.ctx.instances,
            release_budget_ms=int(self.timing.move.source.release_budget_s * 1000),
            flush_orphan=functools.partial(self.activator.flush_orphan, certify=False)), faults=faults)
        deployment = Deployment(door=Door(ledger, clock=clock, rng=rng),
                                regions=lambda region: (store, region_bucket(region)),
                                region_key=lambda region: key.public_key(), events=events)
        self.source = SourceRunners(deployment, SourceSide(
            ctx=self.ctx, activator=self.activator, timers=self.timers, secrets_key=key,
            launch=self.apps.launch if self.apps is not None else sample_launch,
            ready_url=self._ready_url, recovery_policy=self.timing.recovery,
            ready_peer=self._ready_peer), self.timing.move, faults=faults, wake=self.notify)
        facts: BoxFacts | Callable[[str], Awaitable[BoxFacts]] = embedded_facts(cfg.label, key)
        if self.apps is None and rates is not None:  # a fixed app's composition with rates of its own (the sim)
            fixed, measured = embedded_facts(cfg.label, key), rates

            async def fixed_facts(host: str) -> BoxFacts:
                return replace(fixed, rates=await measured(cfg.region))

            facts = fixed_facts
        if self.apps is not None:  # the readiness report observes this box (T1-T3, T7, T8, T11, T13; issue 18)
            self.observer = TargetObserver(
                label=cfg.label, region=cfg.region, store=store, bucket=bucket, apps=self.apps, secrets_key=key,
                read_claim=self._read_claim, read_record=self._read_record, strict=tree.strict_available,
                rates=RateProbe(cfg.label, cfg.box_dir, store, cfg.data_bucket, region_bucket, clock,
                                max_age_s=self.timing.rates_max_age_s).rates,
                journal_dir=cfg.box_dir / ".moves", budget=self.timing.budget)
            facts = self.observer.facts
        self.target = TargetRunners(deployment, TargetSide(self.landing, facts), self.timing.move, faults=faults)
        self.sweeper = StragglerSweep(cfg.label, cfg.region, ledger, parking.Parker(
            store, cfg.data_bucket, clock, timing=self.timing.move.park), clock, events=events,
            retention_ms=self.timing.retention_ms, every_ms=int(self.timing.sweep_s * 1000))
        self.lane_probes = LaneProbeSweep(cfg.label, store, cfg.data_bucket, clock,
                                          every_ms=int(self.timing.sweep_s * 1000))
        """Other regions' T10 and T11 probes left in this region's bucket (:mod:`services.sweeper.lanes`)."""
        self._sweep_next: dict[str, float] = {}
        self._seen: dict[str, Seen] = {}  # the backstop's claims, each by the ETag of the GET that read it
        self.bad_objects = BadObjects(store, bucket, events, ledger.actor, clock, by=cfg.label)
        """A claim or record that is never state skips its host only, alerted once per version (issue 14 item 6)."""
        self.sleep = SleepMarks(cfg.box_dir)
        self._activity: dict[str, Activity] = {}
        self._stopping: set[str] = set()
        self._dirty: set[str] = set()
        self._due: dict[str, float] = {}
        self._wake = asyncio.Event()
        self._notices: dict[str, list[Delivery]] = {}  # per host, delivered and not acknowledged: its pass's
        self._held_off: dict[str, _HeldOff] = {}
        self._timer_runner: TimerRunner | None = None
        self._faults = faults
        self._http: aiohttp.ClientSession | None = None
        self._down: str | None = None  # the dependency outage the passes wait out, named once (:meth:`_outage`)
        metrics.set_budget("prepare", self.timing.move.source.prepare_bound_s)  # §7.11
        metrics.BOX_INSTANCES.labels(box=cfg.label).set_function(lambda: len(self.instances))
        metrics.BOX_ROUTES_HELD.labels(box=cfg.label).set_function(self._held_routes)

    @property
    def label(self) -> str:
        return self.cfg.label

    def _held_routes(self) -> float:
        """The route rows a move holds on this box (``hostmove_box_routes_held``), read when metrics are scraped."""
        try:
            return float(sum(1 for row in self.registry.rows() if row.held))
        except Exception:  # noqa: BLE001 - a closed registry (the agent stopping) has no figure
            return float("nan")

    async def _read_claim(self, host: str) -> Claim | None:
        return (await self.ledger.read_claim(host)).state

    async def _read_record(self, host: str) -> Record | None:
        return (await self.ledger.read_record(host)).state


    @property
    def instances(self) -> Instances:
        """The box's one registry of running instances (the activator's and the landing's alike)."""
        return self.ctx.instances

    def _ready_url(self, host: str) -> str | None:
        """The readiness URL of the instance running here: its release's ``ready_path`` (S1, §7.3)."""
        running = self.instances.serving(host)
        if running is None:
            return None
        if self.apps is not None:
            path = self.apps.ready_path(host)
        else:
            path = self.activator.app.ready_path if isinstance(self.activator.app, AppSpec) else "/ready"
        return f"{running.url}{path}"

    async def _ready_peer(self, host: str) -> tuple[bool, str]:
        """S1 "from its own process" (§7.3): the processes holding the instance's port are its cgroup leaf's."""
        running = self.instances.serving(host)
        if running is None:
            return False, f"no instance of {host} runs on {self.label}"
        if ports.simulated():  # the simulation's instances hold no socket: its network twin answers for them
            return True, ""
        members = await blocking(self.ctx.tree.members, host)
        return await blocking(answered_by_leaf, host, running.port, members)

    def running(self, host: str) -> bool:
        return host in self.instances

    def _endpoint(self, host: str) -> tuple[int, int] | None:
        """``(port, session)`` of the instance running here (the landing's probe session opened by the
        commit's admission: the claim's session). None while its route is held: the edge never serves a held row
        (§5.2), so a landing's probe app is not named before the open (INV-5; the simulation's edge found the probe
        named in the edge table before the commit)."""
        row = self.registry.get(host)
        gated = rules.on("commit-before-open")
        if gated and row is not None and row.held:
            return None
        running = self.instances.serving(host) if gated else self.instances.get(host)  # off: the probe is named
        return (running.port, running.session) if running is not None else None

    def publish_endpoint(self, host: str) -> None:
        """The box's edge table: ``endpoints/<host>.json`` names the local port of a running instance, and is
        removed when it stops (what the box's router reads; the tests and the demo write through it)."""
        path = endpoint_path(self.cfg.box_dir, host)
        endpoint = self._endpoint(host)
        if endpoint is None:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            return
        body = json.dumps({"host": host, "port": endpoint[0], "session": endpoint[1]}).encode()
        if not path.exists() or path.read_bytes() != body:
            path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            atomic_write(path, body, mode=0o600)

    # -- one host ------------------------------------------------------------------------------------------

    async def _serve(self, host: str, claim: Claim, *, eager: bool = False) -> str:
        """The runtime's part: wake a serving host of this box that does not run here, unless it sleeps (then
        only a demand wakes it); ``eager`` wakes a sleeping one too (a move's source, §7.3 S1)."""
        if self.running(host) or claim.holder is None:
            return ""
        if self.sleep.asleep(host):
            if not eager:
                return ""
            self.sleep.clear(host)
        held = self._held_off.get(host)
        if held is not None and self.clock.monotonic() < held.until:
            return ""  # an earlier wake failed: wait out its backoff, whatever the claim did meanwhile
        if self.registry.get(host) is None:
            self.registry.insert(RouteRow(host=host, status="ready", incarnation=claim.holder.incarnation))
        try:
            started: Started | StartRefused | StartFailed = await self.activator.wake(host)
        except BaselineRefused as exc:  # alerted; nothing was admitted: held off like any refused start
            started = StartRefused(host, str(exc))
        if isinstance(started, Started):
            self._held_off.pop(host, None)
            self._activity[host] = Activity(self.clock.monotonic(), None)
            if claim.op.kind == "serving":  # never while the claim is moving (§9.4 "Frozen")
                self.converge_timers(host)
            return f"woke {host} (session {started.session}, generation {started.generation})"
        delay = min(held.delay_s * 2, self.timing.wake_backoff_max_s) if held else self.timing.retry_s
        self._held_off[host] = _HeldOff(self.clock.monotonic() + delay, delay)
        log.warning("%s not started on %s (next try in %.0f s): %s", host, self.label, delay, started.reason,
                    extra=ctx(host=host, box=self.label, phase="wake", reason=started.reason, retry_in_s=delay))
        return f"{host} not started: {started.reason}"

    async def _clear_failed(self, host: str, claim: Claim) -> str:
        """An operator's ``host resolve --clear-failed`` (:mod:`services.move.resolve`): the route the retry policy
        marked ``failed`` becomes ``ready`` and the wake's backoff is forgotten, so the next pass starts it again;
        then the request leaves the claim (journaled: both halves are claim events)."""
        pending = claim.op.journal.get(CLEAR_FAILED)
        at = pending.get("at") if isinstance(pending, dict) else None
        row = self.registry.get(host)
        failed = row is not None and row.status == "failed"
        if failed:
            self.registry.set_status(host, "ready")
        self._held_off.pop(host, None)
        label, acted = self.label, at if isinstance(at, int) else -1
        await self.ledger.transition("claim", host, "clear-failed-done",
                                     lambda cur: decide_clear_failed_done(cur, label, acted), causation=f"box:{label}")
        who = pending.get("by", "an operator") if isinstance(pending, dict) else "an operator"
        log.warning("%s: the failed start was %s (operator %s)", host, "cleared" if failed else "not failed here", who,
                    extra=ctx(host=host, box=label, phase="clear-failed", operator=who))
        return f"failed start {'cleared' if failed else 'not found'} (operator {who})"

    def not_the_writer(self, claim: Claim | None) -> str | None:
        """Why an instance running here may not run on (issue 14 item 5; §19.2 K1, K6), or None. Its claim must name
        this box as ``op.exec``: every phase in which a box runs an instance of a host (§19.1: serving, a source
        before ``stopping``, a landing's probe, a recovery probe, a relocation's replacement) has ``exec`` naming
        it, and ``exec`` leaves a box only once its stop evidence says nothing runs (K3)."""
        if claim is None:
            return "it has no claim"
        if claim.op.exec != self.label:
            return f"its claim ({claim.op.kind}, gen {claim.gen}) names {claim.op.exec} as the writer, not this box"
        return None

    async def _stop_second_writer(self, host: str, claim: Claim | None, etag: str | None, why: str) -> str:
        """Stop the instance of ``host`` this box runs while its claim names another writer: kill and drain its tree,
        its final sync; then record why (``stops/<host>.json``) and alert (``hm.alert.second-writer``)."""
        running = self.instances[host]
        session, origin = running.session, running.origin
        self._stopping.add(host)  # no timer delivery begins from here on
        try:
            await self.activator.stop(host)
        finally:
            self._stopping.discard(host)
        self._activity.pop(host, None)
        self.publish_endpoint(host)
        now = self.clock.now_ms()
        note = {"host": host, "box": self.label, "session": session, "origin": origin, "stopped_at": now,
                "reason": why, "claim_gen": claim.gen if claim is not None else None, "claim_etag": etag,
                "claim_exec": claim.op.exec if claim is not None else None}
        path = self.cfg.box_dir / "stops" / f"{quote(host, safe='')}.json"
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        atomic_write(path, json.dumps(note, sort_keys=True).encode(), mode=0o600)
        log.error("stopped %s on %s (session %d, %s): %s; this box never keeps a second writer running", host,
                  self.label, session, origin, why, extra=ctx(host=host, box=self.label, phase="second-writer",
                                                               reason=why, session=session))
        try:
            await publish_alert(self.events, Fact(kind=SECOND_WRITER, subject=host, id=f"{self.label}:{session}",
                                                  actor=self.ledger.actor, at=now, payload=note))
        except LogError as exc:  # the stop stands and is recorded; the alert is logged above
            log.warning("the second-writer alert for %s is not published: %s", host, exc)
        return f"stopped here: {why}"

    async def _relocate(self, host: str, claim: Claim) -> list[str]:
        """This box is the replacement a relocation chose (:mod:`services.recovery.relocation`): the cold admission
        restores the host from the region's bucket and starts it, then the release makes it serve here."""
        did = []
        started = await self._serve(host, claim, eager=True)
        if started:
            did.append(started)
        if not self.running(host):
            return did
        op_id, label = claim.op.id, self.label
        out = await self.ledger.transition("claim", host, "relocation-release",
                                           lambda cur: decide_relocation_release(cur, op_id, label),
                                           causation=f"relocation:{label}")
        if isinstance(out, Committed):
            did.append(f"relocated here from a fenced box ({op_id}): serving")
            self.converge_timers(host)
        elif isinstance(out, Refusal):
            did.append(f"relocation not released: {out.reason}")
        return did

    def converge_timers(self, host: str) -> bool:
        """The converger (§9.4): the timers the running instance declares replace the host's rows
        (``ReplaceTimers`` keeps the bookkeeping of an unchanged timer). Only for a serving host of this box:
        the caller checks the claim; a held row is never converged (§9.4 "freezing")."""
        row = self.registry.get(host)
        if row is None or row.held:
            return False
        try:
            if self.apps is None:
                specs = declared_timers(self.ctx.files_dir(host))
            else:  # where the host's release says it declares them (none: nothing to converge)
                path = self.apps.timers_path(host)
                specs = declared_timers_at(path) if path is not None else None
        except TimerError as exc:
            log.warning("timers of %s not converged: %s", host, exc, extra=ctx(host=host, box=self.label, reason=exc))
            return False
        if specs is None or sorted(specs, key=lambda t: t.name) == [r.spec for r in self.timers.list(host)]:
            return False
        self.timers.replace_timers(host, specs)
        return True

    def _position(self, host: str) -> int | None:
        """The replica position of the instance running here (what its commits move)."""
        running = self.instances.get(host)
        return running.position if running is not None else None

    async def _idle(self, host: str, claim: Claim) -> tuple[str, float | None]:
        """The idle stop of a serving instance of this box (:mod:`services.box.instance.sleep`): ``(what it did, seconds
        until it looks again)``."""
        idle_s = self.timing.idle_s
        if idle_s is None:
            return "", None
        now = self.clock.monotonic()
        seen = self._activity.setdefault(host, Activity(now, self._position(host)))
        seen.observe(now, self._position(host))
        left = idle_left(now, seen.at_s, idle_s)
        if left > 0:
            return "", left
        session = claim.holder.session if claim.holder is not None else 0
        self._stopping.add(host)  # no delivery begins from here on (:meth:`_instance_url`)
        try:
            try:  # one that began before is waited for (§9.4 "Drained"): a stop never cuts a delivery in two
                await drain_timers(self.timers.conn, self.clock, host, timeout_s=self.timing.drain_s)
            except TimersBusy as exc:
                return f"idle, not stopped yet: {exc}", self.timing.retry_s
            await self.activator.stop(host)
            self.sleep.mark(host, session=session, at_ms=self.clock.now_ms())
        finally:
            self._stopping.discard(host)
        self._activity.pop(host, None)
        return f"idle for {idle_s:g} s: stopped; asleep until a request or a timer wakes it", None

    def demand(self, host: str) -> bool:
        """A router's wake request (or a due timer's): a sleeping host is woken by the next pass, a running one
        counts as active. Answers whether it runs here now."""
        self.sleep.clear(host)
        running = self.running(host)
        if running and host in self._activity:
            self._activity[host].at_s = self.clock.monotonic()
        self.notify(host)
        return running

    def _instance_url(self, host: str) -> str | None:
        if host in self._stopping:
            return None
        endpoint = self._endpoint(host)
        return f"http://127.0.0.1:{endpoint[0]}" if endpoint is not None else None

    async def run_timers(self) -> None:
        """Deliver the due timers of the instances running here (held rows are skipped untouched, §9.4)."""
        if self._timer_runner is None:
            self._http = None if ports.simulated() else aiohttp.ClientSession()
            self._timer_runner = TimerRunner(self.timers, self.clock, self._http, self._instance_url,
                                             path=TIMER_PATH, timeout_s=5.0, faults=self._faults)
        report = await self._timer_runner.run_due()
        for host, _name in report.delivered:  # a timer run is the host at work
            if host in self._activity:
                self._activity[host].at_s = self.clock.monotonic()
        for host in sorted({h for h, _name in report.failed}):
            if self.sleep.asleep(host) and not self.running(host):
                self.demand(host)  # a due timer wakes a sleeping host; the next tick delivers it

    async def pass_host(self, host: str) -> PassResult:
        """Read the claim and the record and do this box's next steps for ``host`` until none progresses. A claim
        or record that is never state (:class:`~services.ledger.ledger.BadObject`) ends the pass of this host
        only: reported once per version, nothing started, stopped or written for it (C6); the scan looks again."""
        try:
            return await self._pass_host(host)
        except BadObject as bad:
            await self.bad_objects.report(bad)
            return PassResult(host)

    async def _pass_host(self, host: str) -> PassResult:
        out = PassResult(host)
        chores: ChoresReport | None = None
        for _ in range(self.timing.max_steps):
            current = await self.ledger.read_claim(host)
            claim = current.state
            if host in self.instances:
                why = self.not_the_writer(claim)
                if why is not None:  # K6, before anything else: whatever a store write says, never two writers
                    out.did.append(await self._stop_second_writer(host, claim, current.etag, why))
                    return out
                self.instances.hold_snapshots(host, claim is not None and claim.op.kind == "moving"
                                              and claim.op.exec == self.label)
            record = (await self.ledger.read_record(host)).state
            if claim is None:
                return out
            if chores is None:  # once a pass: the park-generation chores this box owes (§7.14 item 5), the alerts
                chores = await self.sweeper.generations.run(host, claim)
                out.did += list(chores.did)
                out.did += await self.sweeper.retention.look(host, claim, record)
                if await self.activator.republish(claim):  # a publication an outage stopped, retried
                    out.did.append("generation published again")
                swept = await self.sweeper.serving(host, claim)  # its own region at rest (§6.4), on its cadence
                if swept.did:
                    out.did.append(swept.did)
                await self.activator.flush_alerts()
            if claim.op.kind == "serving":
                if claim.op.exec == self.label and CLEAR_FAILED in claim.op.journal:
                    out.did.append(await self._clear_failed(host, claim))
                    continue
                if claim.op.exec == self.label:
                    did = await self._serve(host, claim)
                    if did:
                        out.did.append(did)
                    elif self.running(host):
                        if self.converge_timers(host):
                            out.did.append("timers converged")
                        did, out.again_in_s = await self._idle(host, claim)
                        if did:
                            out.did.append(did)
                return out
            if claim.op.kind == "relocating":
                if claim.op.exec == self.label:
                    out.did += await self._relocate(host, claim)
                return out
            if record is None:
                return out
            move = record.move
            if (claim.op.kind == "moving" and claim.op.exec == self.label and move is not None
                    and move.cut_phase in SOURCE_SPAWNS_IN and not self.running(host)):
                # §19.1: the source serves as usual until `stopping`; awake, since S1 probes it as it runs (§7.3)
                did = await self._serve(host, claim, eager=True)
                if did:
                    out.did.append(did)
            move_id = record.move.id if record.move is not None else (
                record.last_move.id if record.last_move is not None else "")
            if not move_id or claim.op.id != move_id or len(claim.op.participants) != 2:
                return out
            stage, _why = stage_of(record, claim, move_id)
            if stage in ("request", "done"):
                return out
            source, target = claim.op.participants
            steps: list[SideStep] = []
            if source == self.label:
                steps.append(await self.source.step(host, stage, record, claim))
            if target == self.label:
                from_region = record.move.from_ if record.move is not None else ""
                steps.append(await self.target.step(host, stage, record, claim, from_region or self.cfg.region))
            for s in steps:
                out.did.append(f"{stage}: " + (s.stop or s.wait or ("progressed" if s.progressed else "idle")))
            if any(s.progressed or s.closed for s in steps):
                continue
            wakes = [s.wake_at for s in steps if s.wake_at is not None]
            if wakes:
                out.again_in_s = max(0.0, (min(wakes) - self.clock.now_ms()) / 1000)
            elif stage == "preparing" and not any(s.stop for s in steps):
                out.again_in_s = self.timing.move.poll_s
            return out
        out.again_in_s = 0.0
        return out

    # -- the loop ------------------------------------------------------------------------------------------

    async def scan(self) -> set[str]:
        """The backstop (issue 19 item 2; :mod:`services.agent.backstop`): LIST the claims with their ETags, GET only
        those whose ETag differs from the one this agent's last GET of it answered, and answer the hosts to pass: a
        claim changed that names this box, every instance running here (K6) and the work time alone makes due here
        (:func:`~services.agent.backstop.look`); the others get the region's straggler sweep on its own cadence
        (``sweep_s``), from the claim last read. A listing's ETag can be older than the object (a store's listing
        lags its writes, as the simulation's does; move seed 44): each claim is kept by the ETag of the GET that read
        it, never by the listing's, so a lagging listing costs at most a GET that finds it unchanged or a period's
        delay until a later listing shows the write, never a miss; and the prompt path is the work notice (issue 19
        item 1), the backstop only what a lost one needs. A pass reads its host fresh before it acts (K5, spec §7),
        so a kept claim only ever chooses whom to look at. The outbox's alerts are flushed here too (§7.14 item 2)."""
        listing = await self.store.list_entries(self.bucket, CLAIMS_PREFIX)
        reads, listed = to_read(listing, self._seen)
        for host in set(self._seen) - set(listed):  # gone (claims are never deleted, C5a: a store's doing)
            del self._seen[host]
        changed: set[str] = set()
        for host in reads:
            last = self._seen.get(host)
            try:
                current = await self.ledger.read_claim(host)
                seen = Seen(current.etag, current.state)
            except BadObject as bad:  # this host only, reported once per version (issue 14 item 6)
                await self.bad_objects.report(bad)
                seen = Seen(bad.etag, None)
            if last is None or last.etag != seen.etag:
                changed.add(host)
            self._seen[host] = seen
        hosts = set()
        now, now_ms = self.clock.monotonic(), self.clock.now_ms()
        for host in listed:
            claim = self._seen[host].claim
            if claim is None:
                continue
            held = self._held_off.get(host)
            here = Here(running=host in self.instances, asleep=self.sleep.asleep(host),
                        held_off=held is not None and now < held.until,
                        looks_due=self.sweeper.retention.due(host, now_ms) or self.sweeper.serving_due(host, now_ms))
            decided = look(claim, label=self.label, region=self.cfg.region, changed=host in changed, here=here)
            if decided.passes:
                hosts.add(host)
            if decided.sweeps:
                await self._sweep(host, claim)
        await self.activator.flush_alerts()
        await self.lane_probes.run()
        metrics.scanned(self.label, len(reads))
        return hosts | set(self.instances)  # every instance running here is looked at (K6), whatever names it

    async def _sweep(self, host: str, claim: Claim) -> None:
        """One look of the straggler sweep at ``host`` when due (:mod:`services.sweeper.straggler`); a failure is
        logged and looked at again after ``retry_s`` (a read error never acts)."""
        now = self.clock.monotonic()
        if self._sweep_next.get(host, 0.0) > now:
            return
        next_at = now + self.timing.sweep_s
        try:
            report = await self.sweeper.look(host, claim)
        except BadObject as bad:
            await self.bad_objects.report(bad)
            report, next_at = SweepReport(), now + self.timing.sweep_s
        except Exception as exc:  # noqa: BLE001 - logged, retried: every step of the sweep is idempotent
            log.warning("straggler sweep of %s on %s failed: %s: %s", host, self.label, type(exc).__name__,
                        str(exc).splitlines()[0][:200] if str(exc) else "",
                        extra=ctx(host=host, box=self.label, phase="sweep", reason=exc))
            report, next_at = SweepReport(), now + self.timing.retry_s
        if report.did:
            log.info("straggler sweep of %s: %s", host, report.did, extra=ctx(host=host, box=self.label, phase="sweep"))
        if report.wake_at is not None:
            next_at = min(next_at, now + max(0.0, (report.wake_at - self.clock.now_ms()) / 1000))
        self._sweep_next[host] = next_at

    def notify(self, host: str) -> None:
        self._dirty.add(host)
        self._wake.set()

    def take_notified(self) -> set[str]:
        """The hosts marked dirty since the last call (events, demands), cleared."""
        taken, self._dirty = self._dirty, set()
        return taken

    @property
    def durable(self) -> str:
        return box_durable(self.label)

    async def consume(self, stop: asyncio.Event) -> None:
        """Until ``stop``: this box's work notices, each marking its host dirty (issue 19 item 1). The consumer is
        declared first (idempotent), again after a failed fetch; an outage waits ``retry_s``. A delivery stays
        unacknowledged until a pass of its host ends well (:meth:`take_notices`, :meth:`settle_notices`): one
        redelivered after the ack wait only marks its host dirty again."""
        declared, failing = False, ""
        while not stop.is_set():
            try:
                if not declared:
                    await self.events.add_consumer(WORK_STREAM, self.durable, filter_subject=work_filter(self.label),
                                                   ack_wait_s=NOTICE_ACK_WAIT_S)
                    declared = True
                deliveries = await self.events.fetch(WORK_STREAM, self.durable, batch=64,
                                                     timeout=max(self.timing.scan_s, 1.0))
            except LogError as exc:  # LogUnavailable included: declared again after; named once, not per retry
                declared = False
                if not failing:
                    log.warning("work notices of %s not fetched (the scan stands in): %s", self.label, exc,
                                extra=ctx(box=self.label, phase="consume", reason=exc, durable=self.durable))
                failing = str(exc)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), self.timing.retry_s)
                continue
            if failing:
                log.info("work notices of %s are fetched again", self.label,
                         extra=ctx(box=self.label, phase="consume", durable=self.durable))
                failing = ""
            for d in deliveries:
                metrics.delivered(self.durable, d.num_delivered)
                try:
                    box, host = parse_work_subject(d.msg.subject)
                except SubjectError:
                    box, host = "", ""
                if box != self.label or not host:  # not this box's: nothing to do, never redelivered
                    with contextlib.suppress(LogError):
                        await d.ack()
                    continue
                self._notices.setdefault(host, []).append(d)
                self.notify(host)

    def take_notices(self, host: str) -> list[Delivery]:
        """The notices of ``host`` delivered so far: a pass starting now answers them."""
        return self._notices.pop(host, [])

    async def settle_notices(self, host: str, taken: list[Delivery], ok: bool) -> None:
        """After a pass of ``host``: acknowledge what it answered, or keep it for the next pass (best effort: an
        acknowledgement lost is one redelivery, a dirty host)."""
        if not ok:
            self._notices[host] = taken + self._notices.get(host, [])
            return
        for d in taken:
            with contextlib.suppress(LogError):
                await d.ack()

    async def wake_on(self, nc: Any) -> list[Any]:
        """Subscribe (core NATS) to this box's wake requests (``hm.box.<label>.wake``, the body a host name):
        answered ``{"host", "running"}`` at once; the router then polls the box's edge table (:func:`read_endpoint`)
        for the woken instance. (The ledger's news comes through :meth:`consume`.)"""

        async def wake(msg: Any) -> None:
            if msg.subject != box_wake_subject(self.label):  # a stream's message redelivered here is no wake (8274)
                return
            try:
                host = msg.data.decode("utf-8")
            except UnicodeDecodeError:
                host = ""
            body: dict[str, object]
            if not host or "/" in host or len(host) > 253:
                body = {"error": "a wake request names one host (its name as the message body)"}
            else:
                body = {"host": host, "running": self.demand(host)}
            if msg.reply:
                await msg.respond(json.dumps(body).encode())

        return [await nc.subscribe(box_wake_subject(self.label), cb=wake)]

    async def run(self, stop: asyncio.Event) -> None:
        """Until ``stop``: scan, pass the dirty and the due hosts, sleep until the next wake."""
        from services.box.quarantine import quarantine_on_start  # §7.10: a box declared lost retires first

        await quarantine_on_start(label=self.label, box_dir=self.cfg.box_dir, stamps=self.stamps,
                                  registry=self.registry, timers=self.timers, ledger=self.ledger, clock=self.clock,
                                  stop=stop)
        adopted = await self.activator.adopt_running()
        for host in adopted:
            log.info("stopped %s found running: a new agent is a new session", host,
                     extra=ctx(host=host, box=self.label, phase="adopt"))
        asleep = self.sleep.hosts()
        if asleep:  # what the operator sees not running here, and why
            log.info("%d hosts asleep on %s until a request or a timer wakes them: %s", len(asleep), self.label,
                     ", ".join(asleep[:20]) + (" ..." if len(asleep) > 20 else ""))
        for path in sorted((self.cfg.box_dir / "endpoints").glob("*.json")):  # a dead agent's edge table is stale
            self.publish_endpoint(unquote(path.name[: -len(".json")]))
        timers = asyncio.ensure_future(self._timer_loop(stop))
        notices = asyncio.ensure_future(self.consume(stop))
        try:
            await self._pass_loop(stop)
        finally:
            notices.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await notices
            if stop.is_set():  # a clean stop: the timer loop ends by itself after the round it is in (§9.4)
                with contextlib.suppress(asyncio.CancelledError, TimeoutError):
                    await asyncio.wait_for(timers, TIMER_STOP_S)
            timers.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await timers

    async def _timer_loop(self, stop: asyncio.Event) -> None:
        """The timer runner, beside the passes (a long landing must not starve a due timer); the cut drains its
        in-flight deliveries before it takes evidence (§9.4 "Drained")."""
        while not stop.is_set():
            try:
                await self.run_timers()
            except Exception as exc:  # noqa: BLE001 - a timer stays due; the next tick delivers it
                log.warning("timer run failed on %s: %s", self.label, type(exc).__name__,
                            extra=ctx(box=self.label, phase="timers", reason=exc))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.timing.timer_tick_s)

    def _outage(self, reason: str | None) -> None:
        """A dependency outage the passes wait out (issue 11 item 3): named once when it begins and once when it
        ends, not on every failed pass (a pass during an outage acts on nothing: a read error never acts)."""
        if reason is not None and self._down is None:
            self._down = reason
            log.warning("passes on %s wait for a dependency: %s", self.label, reason,
                        extra=ctx(box=self.label, phase="outage", reason=reason))
        elif reason is None and self._down is not None:
            log.info("passes on %s resumed: the outage is over (%s)", self.label, self._down,
                     extra=ctx(box=self.label, phase="outage", reason=self._down))
            self._down = None

    @property
    def wakeup(self) -> asyncio.Event:
        """Set when there is work for the loop: a host marked dirty (:meth:`notify`) or a pass ended."""
        return self._wake

    async def pass_one(self, host: str) -> None:
        """One host's pass as the loop runs it: an outage or an error is this host's only (logged, due again after
        ``retry_s``); its edge entry is published and its next wake scheduled; the loop is woken. The work notices
        delivered before it started are acknowledged when it ends well."""
        taken, ok = self.take_notices(host), False
        try:
            result = await self.pass_host(host)
            self._outage(None)
            ok = True
        except (LogUnavailable, StoreUnavailable) as exc:  # the outage is named once, not per pass
            self._outage(f"{dependency_of(exc)}: {exc}")
            result = PassResult(host, again_in_s=self.timing.retry_s)
        except Exception as exc:  # noqa: BLE001 - logged, retried: a pass is idempotent
            log.warning("pass of %s on %s failed: %s: %s", host, self.label, type(exc).__name__,
                        str(exc).splitlines()[0][:200] if str(exc) else "",
                        extra=ctx(host=host, box=self.label, reason=exc, error=type(exc).__name__))
            result = PassResult(host, again_in_s=self.timing.retry_s)
        finally:
            self._wake.set()  # the loop starts what waited for this pass
        await self.settle_notices(host, taken, ok)
        for line in result.did:
            log.info("%s: %s", host, line, extra=ctx(host=host, box=self.label, step=line))
        self.publish_endpoint(host)
        if result.again_in_s is not None:
            at = self.clock.monotonic() + result.again_in_s
            self._due[host] = min(self._due.get(host, at), at)

    def _hold(self, hosts: set[str], now: float) -> None:
        """An outage keeps ``hosts``' work for later: due again after ``retry_s``."""
        at = now + self.timing.retry_s
        for host in hosts:
            self._due[host] = min(self._due.get(host, at), at)

    async def _pass_loop(self, stop: asyncio.Event) -> None:
        pool = PassPool(self.timing.pass_workers, self.pass_one)
        try:
            await self._loop(stop, pool)
            await pool.drain()  # stop: no pass starts, the running ones end (as a pass in progress always did)
        finally:
            await pool.cancel()

    async def _loop(self, stop: asyncio.Event, pool: PassPool) -> None:
        # What the box holds locally at once (its instances and its route rows: a host it served before a restart);
        # everything else its notices bring, the scan only after scan_s (a restart needs no scan: its consumer
        # resumes from its acknowledgement floor, issue 19 item 1).
        self._dirty |= set(self.instances) | {row.host for row in self.registry.rows()}
        next_scan = self.clock.monotonic() + self.timing.scan_s
        while not stop.is_set():
            now = self.clock.monotonic()
            bus_down = unavailable_reason(self.events)
            self._outage(bus_down)
            if now >= next_scan:
                try:
                    self._dirty |= await self.scan()
                except (LogUnavailable, StoreUnavailable) as exc:
                    self._outage(f"{dependency_of(exc)}: {exc}")
                except Exception as exc:  # noqa: BLE001 - a read error never acts; scan again later
                    log.warning("scan failed on %s: %s", self.label, type(exc).__name__,
                                extra=ctx(box=self.label, phase="scan", reason=exc))
                next_scan = now + self.timing.scan_s
                if stop.is_set():
                    break
            due = {h for h, at in self._due.items() if at <= now}
            for h in due:
                del self._due[h]
            work = self.take_notified() | due
            self._wake.clear()
            if bus_down is not None:  # nothing a pass decides can be journaled: keep the work for later
                self._hold(work | pool.withdraw(), now)
            else:
                pool.submit(work)  # the hosts running already are passed again once their pass ends
            if self._dirty:
                continue
            until = min([next_scan, *self._due.values()])
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wait(stop), max(0.0, until - self.clock.monotonic()))

    async def _wait(self, stop: asyncio.Event) -> None:
        stopper = asyncio.ensure_future(stop.wait())
        woken = asyncio.ensure_future(self._wake.wait())
        try:
            await asyncio.wait({stopper, woken}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopper.cancel()
            woken.cancel()

    async def close(self) -> None:
        """Stop what this agent runs (final syncs first) and close the box's stores."""
        if self._http is not None:
            await self._http.close()
        await self.activator.close()  # every instance of the box, a landing's probe included
        for gauge in (metrics.BOX_INSTANCES, metrics.BOX_ROUTES_HELD):
            with contextlib.suppress(KeyError):
                gauge.remove(self.label)
        for closable in (self.registry, self.stamps, self.timers):
            closable.close()


TIMER_STOP_S = 10.0
"""How long a clean stop waits for the timer round in flight: a delivery the app answered is recorded before the
agent exits (cancelled in its POST, the row stayed due and the next agent delivered it again, a repeat the app had
applied); past this (two runner timeouts) the round is cancelled and at-least-once covers it."""


def endpoint_path(box_dir: Path, host: str) -> Path:
    return box_dir / "endpoints" / f"{quote(host, safe='')}.json"


def read_endpoint(box_dir: Path, host: str, *, newer_than: int | None = None) -> int | None:
    """The local port ``host`` is served on by the box at ``box_dir``, or None; with ``newer_than``, only an
    instance of a later writer session than that."""
    try:
        body = json.loads(endpoint_path(box_dir, host).read_text())
        port, session = int(body["port"]), int(body["session"])
    except (FileNotFoundError, ValueError, KeyError):
        return None
    return port if newer_than is None or session > newer_than else None


__all__ = ["FAST_AGENT", "PRODUCTION_AGENT", "PROFILES", "AgentTiming", "BoxAgent", "PassResult", "cut_slots_override",
           "cut_window_override", "endpoint_path", "idle_override", "pass_workers_override", "prepare_override",
           "prepare_slots_override",
           "probe_window_override", "read_endpoint", "scan_override"]
