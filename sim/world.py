"""The simulated world: the real service code on the twins, one seed (ARCHITECTURE §7; model digest §8).

Two regions (``ie`` and ``uk``), one box each, and a console. Buckets: the deployment bucket and one
data bucket per region, behind the M17 policy. Every actor runs the real code paths that exist today:

- the **console** creates hosts through the ledger (:func:`services.hosts.create.create_host`), finishes
  a ``creating`` claim it finds after a restart with the incarnation its intent names, and runs the
  relay (:meth:`services.ledger.ledger.Ledger.relay_all`);
- each **box** registers in the roster (:func:`services.box.roster.update_roster`), consumes claim
  events on a durable consumer (bounded redelivery with :func:`bus.app.on_failure`), reconciles
  periodically, and wakes hosts: a fresh claim read (K6), the cold admission through the ledger
  (:func:`services.box.instance.admission.decide_admit_writer`), the start check
  (:func:`services.box.artifacts.markers.start_check`), the start, and the conditional generation marker
  (:func:`services.box.artifacts.markers.publish_generation_marker`). :class:`BoxAgent` stands in for the
  production activator (which runs in the world with moves, :mod:`sim.moves`), following the start order of
  digest D§6; its steps consult the production activator's named rules (``exec-admission``, ``hostguard``,
  ``admit-before-start``, registered at their production sites), so the sweep switches them off in both worlds;
- the **edge** delivers the workload's wake requests to boxes; the **chaos** actor crashes boxes and
  the console (memory lost, durable state kept) and restarts them.

Faults inside requests (late completions, lost responses, signature-age refusals, lost publish acks)
come from the twins; crashes at the ledger's fault points and pauses between a read and the write it
guards come from the world. All draws are named and seeded (:class:`sim.faults.FaultPlan`).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import random
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgspec

from bus.app import Alert, RedeliveryPolicy, on_failure
from bus.facts import Fact, publish_alert, publish_fact
from bus.log import LogError
from bus.subjects import LEDGER_STREAM, SubjectError, parse_ledger_subject
from events.claim import Claim
from events.durable import DurableValueError
from events.envelope import Actor
from events.ids import new_incarnation
from kernel import rules
from services.box.artifacts.markers import (
    GenerationMarker,
    MarkerRead,
    Refused,
    admission_chain,
    normalize,
    publish_generation_marker,
    read_generation_marker,
    start_check,
)
from services.box.instance import activator as _activator  # noqa: F401 - registers exec-admission, admit-before-start
from services.box.instance import guard as _guard  # noqa: F401 - registers hostguard
from services.box.instance.admission import AdmitRequest, decide_admit_writer
from services.box.roster import MOVES_PROTOCOL, RosterBox, RosterRefusal, decide_register, update_roster
from services.hosts.create import create_host
from services.ledger.ledger import Committed, Crash, Ledger, LedgerDefect
from services.objstore.port import Got, StoreError, Won
from sim.faults import FaultPlan, Timing
from sim.invariants import Checker, Proc, object_of_key
from sim.loop import OWNER, VirtualClock
from sim.trace import Trace
from sim.twins.jetstream import Delivery, SimEventLog, SimJetStream
from sim.twins.s3 import NOMINAL, Access, M17Policy, Principal, SimS3, SimS3Client
from sim.workload import HostPlan, Workload

__all__ = ["DEPLOY", "REGIONS", "BoxAgent", "ConsoleActor", "World", "data_bucket"]

REGIONS = ("ie", "uk")
DEPLOY = "deploy"
CLAIM_EVENTS = "hm.ledger.claim.*"
EXPECTED = (StoreError, LogError, LedgerDefect, DurableValueError, RosterRefusal)
"""What a service may meet and must survive: it never acts on one, it backs off and tries again (C6)."""


def data_bucket(region: str) -> str:
    return f"data-{region}"


class PlanRandom:
    """The Random port drawn from the run's plan (named draws)."""

    def __init__(self, plan: FaultPlan, name: str) -> None:
        self.plan = plan
        self.name = name

    def token_bytes(self, n: int) -> bytes:
        return self.plan.token(self.name, n)

    def random(self) -> float:
        return self.plan.uniform(self.name, 0.0, 1.0)


class Gate:
    """A scripted pause (witnesses): the first ``count`` actors to reach the point wait for :meth:`open`."""

    def __init__(self, count: int = 1) -> None:
        self.count = count
        self.waiting = 0
        self._event = asyncio.Event()

    def open(self) -> None:
        self._event.set()

    async def pass_(self) -> bool:
        if self.count <= 0:
            return False
        self.count -= 1
        self.waiting += 1
        try:
            await self._event.wait()
        finally:
            self.waiting -= 1
        return True


class MilestoneMissed(Exception):
    """A witness could not reach a step of its script (INV-3 when no violation explains it)."""


@dataclass
class Slot:
    name: str
    factory: Callable[[int], Any]
    incarnation: int = 0
    actor: Any = None
    up: bool = False
    restart_handle: asyncio.TimerHandle | None = None


class ActorBase:
    """What every actor has: a name, a world, a main task and child tasks a crash takes with it."""

    def __init__(self, world: World, name: str, incarnation: int) -> None:
        self.world = world
        self.name = name
        self.incarnation = incarnation
        self.main: asyncio.Task[None] | None = None
        self.children: dict[int, asyncio.Task[None]] = {}
        self._next_child = 0
        self.busy = 0
        self.idle = False  # waiting for work, with nothing half done

    def emit(self, what: str) -> None:
        self.world.trace.emit(f"{self.name}#{self.incarnation}", what)

    async def run(self) -> None:
        return None

    def spawn(self, coro: Coroutine[Any, Any, None], what: str) -> asyncio.Task[None]:
        """Run ``coro`` as part of this actor: a crash of the actor cancels it."""
        self._next_child += 1
        n = self._next_child
        task = asyncio.ensure_future(self._child(coro, what))
        self.children[n] = task

        def ended(_t: asyncio.Task[None]) -> None:
            self.children.pop(n, None)
            coro.close()  # a child cancelled before it ran never awaited ``coro``: closed, not warned about

        task.add_done_callback(ended)
        return task

    async def _child(self, coro: Coroutine[Any, Any, None], what: str) -> None:
        try:
            await coro
        except Crash as exc:
            self.world.crash(self.name, f"fault point {exc} in {what}")
        except EXPECTED as exc:
            self.emit(f"{what} failed: {type(exc).__name__}: {exc}")
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - a defect: reported, then the actor restarts
            self.world.checker.flag("actor-error", f"{self.name}: {what}: {type(exc).__name__}: {exc}")
            self.world.crash(self.name, "unexpected exception")

    def kill(self) -> None:
        current = asyncio.current_task()
        for n in sorted(self.children):
            task = self.children[n]
            if task is not current:
                task.cancel()
        if self.main is not None and self.main is not current:
            self.main.cancel()


class ConsoleActor(ActorBase):
    """The console: creates hosts through the ledger and runs the relay."""

    def __init__(self, world: World, incarnation: int) -> None:
        super().__init__(world, "console", incarnation)
        self.clock = world.actor_clock("console")
        self.store = world.s3.client(Principal("console", "console"), self.clock)
        self.events = SimEventLog(world.js, "console", fates=world.plan)
        self.actor = Actor(service="console", pid=2000 + incarnation,
                           nonce=world.plan.token("nonce.console", 8).hex())
        self.ledger = Ledger(self.store, self.events, self.clock, self.actor, DEPLOY,
                             faults=world.ledger_faults("console"))
        self.done: set[str] = set()  # memory: lost in a crash

    async def run(self) -> None:
        next_relay = 0.0
        while True:
            now = self.world.loop.time()
            for plan in self.world.workload.hosts:
                if plan.at <= now:
                    try:
                        await self.create(plan)
                    except EXPECTED as exc:
                        self.emit(f"create {plan.host} failed: {type(exc).__name__}: {exc}")
            if now >= next_relay:
                await self.relay()
                next_relay = now + self.world.timing.relay_s
            self.idle = True
            await asyncio.sleep(self.world.timing.relay_s)
            self.idle = False

    async def relay(self) -> None:
        try:
            failed = await self.ledger.relay_all()
        except EXPECTED as exc:
            self.emit(f"relay failed: {type(exc).__name__}: {exc}")
            return
        if failed:
            self.emit(f"relay left {len(failed)} objects: {failed[0]}")

    async def create(self, plan: HostPlan) -> None:
        """Create ``plan.host``, or finish the create a crash left ``creating`` (intent first, C2)."""
        if plan.host in self.done:
            return
        cur = await self.ledger.read_claim(plan.host)
        claim = cur.state
        if claim is not None and claim.holder is not None:
            self.done.add(plan.host)
            return
        if claim is not None and claim.op.kind == "creating":
            incarnation = str(claim.op.intent["create"]["incarnation"])
        else:
            incarnation = new_incarnation(PlanRandom(self.world.plan, "incarnation"))
        box = plan.box
        if box in self.world.terminated:  # the platform places a host on a live box of its region
            live = sorted(b for b, r in self.world.boxes.items() if r == plan.region and b not in self.world.terminated)
            if not live:
                self.emit(f"create {plan.host} waits: {plan.region} has no live box")
                return
            box = live[0]
        await self.world.pause_point("console.before_create", self.name)
        out = await create_host(self.ledger, plan.host, box=box, region=plan.region, incarnation=incarnation)
        self.emit(f"create {plan.host} on {box}: {type(out).__name__}")
        if isinstance(out, Committed):
            self.done.add(plan.host)


class _NoGuard:
    async def __aenter__(self) -> None:
        return None

    async def __aexit__(self, *exc: object) -> None:
        return None



async def retry_expected(emit: Callable[[str], None], what: str, step: Callable[[], Awaitable[object]]) -> None:
    """Run ``step`` until it succeeds; an expected fault (a store or bus failure, a lost CAS) is logged to the trace
    and retried after a doubling wait, up to two minutes."""
    delay = 1.0
    while True:
        try:
            await step()
            return
        except EXPECTED as exc:
            emit(f"{what} failed: {type(exc).__name__}: {exc}")
        await asyncio.sleep(delay)
        delay = min(delay * 2, 120.0)

class BoxAgent(ActorBase):
    """A box's agent: the stand-in for the activator (see the module docstring)."""

    def __init__(self, world: World, label: str, region: str, incarnation: int) -> None:
        super().__init__(world, label, incarnation)
        self.label = label
        self.region = region
        self.bucket = data_bucket(region)
        self.clock = world.actor_clock(label)
        self.store: SimS3Client = world.s3.client(Principal("box", label, region), self.clock)
        self.events = SimEventLog(world.js, label, fates=world.plan)
        self.actor = Actor(service="box", pid=3000 + incarnation, nonce=world.plan.token(f"nonce.{label}", 8).hex(),
                           box=label)
        self.ledger = Ledger(self.store, self.events, self.clock, self.actor, DEPLOY,
                             faults=world.ledger_faults(label))
        self.guards: dict[str, asyncio.Lock] = {}
        self.durable = f"box-{label}"
        self.policy = RedeliveryPolicy(max_deliver=world.timing.max_deliver, first_backoff_s=1.0,
                                       max_backoff_s=60.0, ack_wait_s=world.timing.ack_wait_s)

    # -- the main loop ------------------------------------------------------------------------------

    async def run(self) -> None:
        timing = self.world.timing
        await self.retrying("register", self.register)
        await self.retrying("consumer", lambda: self.events.add_consumer(
            LEDGER_STREAM, self.durable, filter_subject=CLAIM_EVENTS, ack_wait_s=timing.ack_wait_s,
            max_deliver=timing.max_deliver))
        next_reconcile = self.world.loop.time()
        batch = 2 if self.world.workload.concurrent_batches else 1
        while True:
            wait = max(next_reconcile - self.world.loop.time(), 0.001)
            self.idle = True
            deliveries = await self.events.fetch(LEDGER_STREAM, self.durable, batch=batch, timeout=wait)
            self.idle = False
            if len(deliveries) > 1:  # handled concurrently, as FastStream's PullSub(batch_size=N) does
                tasks = [self.spawn(self.handle(d), f"event seq {d.msg.seq}") for d in deliveries]
                await asyncio.gather(*tasks, return_exceptions=True)
            elif deliveries:
                await self.handle(deliveries[0])
            if self.world.loop.time() >= next_reconcile:
                await self.reconcile()
                next_reconcile = self.world.loop.time() + timing.reconcile_s

    async def retrying(self, what: str, step: Callable[[], Awaitable[object]]) -> None:
        await retry_expected(self.emit, what, step)

    async def register(self) -> None:
        entry = RosterBox(label=self.label, region=self.region, moves_protocol=MOVES_PROTOCOL,
                          secrets_key_fp=self.world.key_fp, registered_at=self.clock.now_ms())
        roster = await update_roster(self.store, DEPLOY, lambda cur: decide_register(cur, entry))
        await publish_fact(self.events, Fact(kind="roster", subject=self.label, id=f"{self.label}:{roster.gen}",
                                             actor=self.actor, at=self.clock.now_ms(),
                                             payload=msgspec.to_builtins(entry)))
        self.emit(f"registered (roster gen {roster.gen})")

    async def handle(self, d: Delivery) -> None:
        """An event is only a wake-up (ARCHITECTURE §5); never term a message, bound redelivery."""
        try:
            _obj, host = parse_ledger_subject(d.msg.subject)
        except SubjectError:
            await d.term()
            return
        try:
            await self.wake(host, f"event seq {d.msg.seq} delivery {d.num_delivered}")
        except EXPECTED as exc:
            action = on_failure(d.num_delivered, self.policy)
            self.emit(f"wake {host} failed ({type(exc).__name__}); {type(action).__name__}")
            if isinstance(action, Alert):
                with contextlib.suppress(*EXPECTED):
                    await publish_alert(self.events, Fact(kind="poison", subject=self.label,
                                                          id=f"{self.durable}:{d.msg.seq}", actor=self.actor,
                                                          at=self.clock.now_ms(), payload={"reason": action.reason}))
                await d.ack()
                return
            await d.nak(action.delay_s)
            return
        await d.ack()

    async def reconcile(self) -> None:
        try:
            keys = await self.store.list_keys(DEPLOY, "control/hosts/")
        except EXPECTED as exc:
            self.emit(f"reconcile listing failed: {type(exc).__name__}")
            return
        for key in keys:
            found = object_of_key(key)
            if found is None:
                continue
            try:
                await self.wake(found[1], "reconcile")
            except EXPECTED as exc:
                self.emit(f"reconcile {found[1]} failed: {type(exc).__name__}: {exc}")

    # -- waking a host ------------------------------------------------------------------------------

    async def wake(self, host: str, why: str) -> None:
        """doWake (§19.2 K6, digest D§6 start order): fresh claim read, admission, start check, start,
        marker. One step per host at a time (the host guard, §6.4)."""
        guard: Any = self.guards.setdefault(host, asyncio.Lock()) if rules.on("hostguard") else _NoGuard()
        self.busy += 1
        try:
            async with guard:
                await self._wake(host, why)
        finally:
            self.busy -= 1

    async def _wake(self, host: str, why: str) -> None:
        world = self.world
        cur = await self.ledger.read_claim(host)
        claim = cur.state
        mine = world.procs(self.label, host)
        if claim is None:
            return
        if rules.on("exec-admission") and claim.op.exec != self.label:
            for p in mine:
                world.os_stop(p, "K6: the claim names another box")
            return
        holder = claim.holder
        if holder is None:
            return
        if holder.writer_box == self.label and any(p.session == holder.session for p in mine):
            await self.ensure_marker(claim)
            return
        for p in mine:
            world.os_stop(p, "a new owner process is a new session")
        await world.pause_point("box.before_admit", self.label)
        new_gen = "fresh-" + world.plan.token("generation", 6).hex()
        req = AdmitRequest(
            box=self.label, region=self.region, observed_op_id=claim.op.id, observed_phase=claim.op.phase,
            observed_kind=claim.op.kind, observed_session=holder.session, observed_generation=holder.generation,
            new_generation=new_gen,
        )
        early = None if rules.on("admit-before-start") else world.os_start(self.label, host, None, new_gen)
        out = await self.ledger.transition("claim", host, "admit-writer",
                                           functools.partial(decide_admit_writer, req=req), causation=why)
        if not isinstance(out, Committed):
            self.emit(f"admission of {host} not made ({why}): {type(out).__name__} {getattr(out, 'reason', '')}")
            return
        admitted = out.state
        assert admitted.holder is not None
        self.emit(f"admitted {host} session {admitted.holder.session} generation {new_gen} ({why})")
        read = await read_generation_marker(self.store, self.bucket, admitted.holder.location)
        verdict = start_check(admitted, read.marker, None, False, None)
        if isinstance(verdict, Refused):
            if early is not None:
                world.os_stop(early, "the start check refused")
            self.emit(f"start of {host} refused: {verdict.reason}")
            return
        if early is not None:
            early.session = admitted.holder.session
            world.checker.check_writers(host)
        else:
            world.os_start(self.label, host, admitted.holder.session, new_gen)
        await self.ensure_marker(admitted, read)

    async def ensure_marker(self, claim: Claim, read: MarkerRead | None = None) -> None:
        """``generation.json`` names ``holder.generation`` (digest D§6 step 7; a current generation
        republishes its marker first). Written conditionally by the real publisher."""
        holder = claim.holder
        assert holder is not None
        want = normalize(holder.generation)
        if read is None:
            read = await read_generation_marker(self.store, self.bucket, holder.location)
        marker, etag = read.marker, read.etag
        for _ in range(3):
            named = normalize(marker.op) if marker is not None else ""
            if named == want and (marker is None or marker.incarnation == holder.incarnation):
                return
            if named not in admission_chain(claim):
                self.emit(f"marker of {claim.host} names {named or 'origin'}, not in the chain of {want}; left")
                return
            await self.world.pause_point("box.before_marker", self.label)
            new = GenerationMarker(op=want, incarnation=holder.incarnation, host=claim.host, box=self.label,
                                   installed_at=self.clock.now_ms())
            result = await publish_generation_marker(self.store, self.bucket, holder.location, new, etag)
            if isinstance(result, Won):
                self.emit(f"marker of {claim.host} -> {want}")
                return
            read = await read_generation_marker(self.store, self.bucket, holder.location)
            marker, etag = read.marker, read.etag


class EdgeActor(ActorBase):
    """Delivers the workload's wake requests to the boxes they reach (an app's traffic)."""

    def __init__(self, world: World, incarnation: int) -> None:
        super().__init__(world, "edge", incarnation)

    async def run(self) -> None:
        for req in self.world.workload.requests:
            delay = req.at - self.world.loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            self.world.request(req.box, req.host)


class ChaosActor(ActorBase):
    """Crashes boxes and the console during the chaos phase (memory lost, durable state kept)."""

    def __init__(self, world: World, incarnation: int) -> None:
        super().__init__(world, "chaos", incarnation)

    async def run(self) -> None:
        plan = self.world.plan
        while True:
            await asyncio.sleep(plan.uniform("chaos.gap", 30, 400))
            if plan.calm:
                return
            if plan.fault("chaos.crash", 0.6):
                targets = sorted(b for b in self.world.boxes if b not in self.world.terminated) + ["console"]
                target = plan.choice("chaos.target", targets)
                self.world.crash(target, "chaos")
                if target == "console" and plan.fault("chaos.console_lost", 0.3):
                    self.world.restart_later("console", plan.uniform("chaos.console_lost.s", 900, 7200))


@dataclass
class World:
    """One simulated deployment (see the module docstring)."""

    seed: int | str
    plan: FaultPlan
    timing: Timing
    loop: asyncio.AbstractEventLoop
    workload: Workload
    witness: bool = False
    boxes: dict[str, str] = field(default_factory=lambda: {f"{r}-1": r for r in REGIONS})

    def __post_init__(self) -> None:
        self.clock = VirtualClock(self.loop)
        self.trace = Trace(self.loop.time)
        self.checker = Checker(self.seed, self.loop.time, self.trace.emit, DEPLOY)
        policy = M17Policy(DEPLOY, {r: data_bucket(r) for r in REGIONS})
        self.s3 = SimS3(now_ms=self.clock.now_ms, rng=random.Random(f"s3:{self.seed}"), timing=self.timing,
                        trace=self.trace, policy=policy, fates=self.plan, long_tail_p=self._long_tail)
        self.js = SimJetStream(now_ms=self.clock.now_ms, trace=self.trace,
                               dedup_window_ms=int(self.timing.dedup_window_s * 1000))
        self.s3.observers.append(self.checker.on_landed)
        self.s3.on_denied = lambda text: self.checker.flag("M17", text)
        self.js.observers.append(self.checker.on_message)
        self.admin = self.s3.client(Principal("admin", "admin"), self.clock, fates=NOMINAL)
        self.key_fp = "sha256:" + self.plan.token("secrets_key_fp", 16).hex()
        self.slots: dict[str, Slot] = {}
        self.terminated: set[str] = set()  # boxes gone for good (the world with moves replaces them)
        self.skews: dict[str, int] = {}
        self.gates: dict[tuple[str, str], Gate] = {}
        self.crash_points: dict[tuple[str, str], int] = {}
        self.running = False
        self.prepare()
        for label, region in sorted(self.boxes.items()):
            self.slots[label] = Slot(label, self.box_factory(label, region))
        self.slots["console"] = Slot("console", self.console_factory())
        self.harness_error: str | None = None
        if not self.witness:
            self.slots["edge"] = Slot("edge", self.edge_factory())
            self.slots["chaos"] = Slot("chaos", functools.partial(ChaosActor, self))
        elif self.early_actors:  # every actor exists from the start; its loop runs once the script hands over
            for name in sorted(self.slots):
                self.start(name)

    # -- the actors' factories (a world with moves, sim/moves.py, runs other actors on the same harness) --

    early_actors: ClassVar[bool] = True
    """A witness world builds its actors before set-up (the world with moves builds them once its boxes exist)."""

    def prepare(self) -> None:
        """Set-up a subclass needs before its actors are built."""

    def box_factory(self, label: str, region: str) -> Callable[[int], Any]:
        return functools.partial(BoxAgent, self, label, region)

    def console_factory(self) -> Callable[[int], Any]:
        return functools.partial(ConsoleActor, self)

    def edge_factory(self) -> Callable[[int], Any]:
        return functools.partial(EdgeActor, self)

    def ports(self) -> contextlib.AbstractContextManager[None]:
        """The ports the run's tasks use (:mod:`kernel.ports`); the stand-in needs none."""
        return contextlib.nullcontext()

    def cleanup(self) -> None:
        """After the run, outside the sandbox: remove what the world put on disk."""

    def extra_counters(self) -> dict[str, int]:
        return {}

    def _long_tail(self, access: Access) -> float:
        if self.workload.marker_tail and access.key.endswith("/generation.json"):
            return 1 / 3
        return 0.08

    # -- set-up, clocks and fault points ------------------------------------------------------------

    async def setup(self) -> None:
        for bucket in (DEPLOY, *(data_bucket(r) for r in REGIONS)):
            await self.s3.create_bucket(bucket)

    def actor_clock(self, name: str) -> VirtualClock:
        """An actor's own clock: skewed within the allowance, the same across its restarts."""
        if name not in self.skews:
            allowance = self.timing.skew_allowance_s
            self.skews[name] = 0 if self.plan.quiet else round(
                self.plan.uniform(f"skew.{name}", -allowance, allowance) * 1000)
        return self.clock.skewed(self.skews[name])

    def ledger_faults(self, actor: str) -> Callable[[str], None]:
        def hook(point: str) -> None:
            if ":" in point:  # the ledger's named points (``after_cas:<obj>:<name>``) repeat a generic one
                return
            scripted = self.crash_points.get((actor, point), 0)
            if scripted:
                self.crash_points[(actor, point)] = scripted - 1
            p = {"after_cas": 0.03, "after_publish": 0.01}.get(point, 0.0)
            if scripted or self.plan.fault(f"ledger.crash.{point}", p):
                self.trace.emit(actor, f"crash at ledger fault point {point}")
                raise Crash(point)

        return hook

    async def pause_point(self, name: str, actor: str) -> None:
        """A pause between a check and the write it guards: drawn in a random run, scripted in a witness."""
        gate = self.gates.get((name, actor))
        if gate is not None and gate.count > 0:
            self.trace.emit(actor, f"paused at {name} (scripted)")
            await gate.pass_()
            self.trace.emit(actor, f"resumed at {name}")
            return
        pause = self.plan.pause(f"pause.{name}")
        if pause:
            self.trace.emit(actor, f"paused {pause:.1f} s at {name}")
            await asyncio.sleep(pause)

    def gate(self, name: str, actor: str, count: int = 1) -> Gate:
        """Pause the next ``count`` arrivals of ``actor`` at pause point ``name`` (witnesses)."""
        gate = self.gates[(name, actor)] = Gate(count)
        return gate

    async def until(self, what: str, pred: Callable[[], bool], timeout: float = 3600.0) -> None:
        """Poll ``pred`` every virtual second; a witness milestone not reached in ``timeout`` fails."""
        deadline = self.loop.time() + timeout
        while not pred():
            if self.loop.time() >= deadline:
                raise MilestoneMissed(f"the witness never reached: {what}")
            await asyncio.sleep(1.0)

    # -- actors -------------------------------------------------------------------------------------

    def start(self, name: str) -> Any:
        """A fresh incarnation of the actor (its memory starts empty); its loop runs once the world runs."""
        slot = self.slots[name]
        if slot.restart_handle is not None:
            slot.restart_handle.cancel()
            slot.restart_handle = None
        if slot.up:
            return slot.actor
        slot.incarnation += 1
        slot.actor = slot.factory(slot.incarnation)
        slot.up = True
        self.trace.emit(name, f"start #{slot.incarnation}")
        if self.running:
            self._run_main(slot)
        return slot.actor

    def _run_main(self, slot: Slot) -> None:
        actor = slot.actor
        if actor.main is None:  # its tasks carry its name (sim.loop.OWNER): a whole box can be frozen
            context = contextvars.copy_context()
            context.run(OWNER.set, slot.name)
            actor.main = self.loop.create_task(self._supervise(slot, actor), context=context)

    async def _supervise(self, slot: Slot, actor: ActorBase) -> None:
        try:
            await actor.run()
        except asyncio.CancelledError:
            raise
        except Crash as exc:
            self.crash(slot.name, f"fault point {exc}")
        except Exception as exc:  # noqa: BLE001 - a defect: reported, then the actor restarts
            self.checker.flag("actor-error", f"{slot.name}: {type(exc).__name__}: {exc}")
            self.crash(slot.name, "unexpected exception")

    def crash(self, name: str, why: str) -> None:
        """The actor dies: its tasks stop at whatever await they are in; on a box, the instance
        processes die with it (flat children). Durable state in the twins stays."""
        slot = self.slots[name]
        if not slot.up:
            return
        slot.up = False
        self.trace.emit(name, f"crash #{slot.incarnation} ({why})")
        if name in self.boxes:
            self.box_agent_died(name)
        slot.actor.kill()
        if self.running and name not in ("edge", "chaos"):
            self.restart_later(name, self.plan.uniform("restart.after_crash", 1, 300))

    def box_agent_died(self, label: str) -> None:
        """The stand-in runs its instances as flat children: they die with it."""
        for p in [p for p in self.checker.procs if p.box == label]:
            self.os_stop(p, "its box agent died")

    def restart_later(self, name: str, delay: float) -> None:
        slot = self.slots[name]
        if slot.up:
            return
        if slot.restart_handle is not None:
            slot.restart_handle.cancel()
        slot.restart_handle = self.loop.call_later(delay, self.start, name)

    def box(self, label: str) -> BoxAgent:
        slot = self.slots[label]
        actor = slot.actor if slot.up else self.start(label)
        assert isinstance(actor, BoxAgent)
        return actor

    def console(self) -> ConsoleActor:
        slot = self.slots["console"]
        actor = slot.actor if slot.up else self.start("console")
        assert isinstance(actor, ConsoleActor)
        return actor

    def request(self, label: str, host: str) -> asyncio.Task[None] | None:
        """A wake request reaches a box (an app's traffic); a box that is down drops it."""
        slot = self.slots[label]
        if not slot.up:
            self.trace.emit("edge", f"request for {host} dropped: {label} is down")
            return None
        agent: BoxAgent = slot.actor
        self.trace.emit("edge", f"request for {host} -> {label}")
        return agent.spawn(agent.wake(host, "request"), f"request {host}")

    # -- the instance processes (the process supervisor port) ---------------------------------------

    def procs(self, box: str, host: str) -> list[Proc]:
        return [p for p in self.checker.procs if p.box == box and p.host == host]

    def os_start(self, box: str, host: str, session: int | None, generation: str) -> Proc:
        proc = Proc(box, host, session, generation)
        self.checker.procs.append(proc)
        self.trace.emit(box, f"start {host} session {session} generation {generation}")
        self.checker.check_writers(host)
        return proc

    def os_stop(self, proc: Proc, why: str) -> None:
        if proc in self.checker.procs:
            self.checker.procs.remove(proc)
            self.trace.emit(proc.box, f"stop {proc.host} session {proc.session} ({why})")

    # -- phases -------------------------------------------------------------------------------------

    def run_actors(self) -> None:
        self.running = True
        for name in sorted(self.slots):
            slot = self.slots[name]
            if not slot.up:
                self.start(name)
            else:
                self._run_main(slot)

    async def calm(self) -> None:
        """Faults heal: no new fault fires, every stopped actor comes back."""
        self.plan.calm = True
        self.trace.emit("world", "calm phase")
        for name in sorted(self.slots):
            if name not in ("edge", "chaos") and not self.slots[name].up:
                self.start(name)

    async def settle(self) -> list[str]:
        """Run the calm phase until quiescence; answer what is still unmet (empty: quiescent)."""
        await self.calm()
        if not self.running:
            self.run_actors()
        deadline = self.loop.time() + self.timing.calm_s
        while True:
            unmet = self.unmet()
            if not unmet or self.loop.time() >= deadline or self.checker.violations:
                return unmet
            await asyncio.sleep(30.0)

    def unmet(self) -> list[str]:
        """INV-3: what quiescence still lacks (every actor idle, every host serving and awake on its
        box with its marker current, every request settled, every latest gen on the stream)."""
        out: list[str] = []
        for name in sorted(self.slots):
            slot = self.slots[name]
            if name in ("edge", "chaos"):
                continue
            if not slot.up:
                out.append(f"{name} is down")
            elif not slot.actor.idle or slot.actor.busy or slot.actor.children:
                out.append(f"{name} is busy")
        for plan in self.workload.hosts:
            claim = self.checker.claims.get(plan.host)
            if claim is None or claim.holder is None or claim.op.kind != "serving":
                out.append(f"{plan.host} is not serving ({claim.op.kind if claim else 'no claim'})")
                continue
            holder = claim.holder
            procs = [p for p in self.checker.procs if p.host == plan.host]
            if not any(p.box == claim.op.exec and p.session == holder.session for p in procs):
                out.append(f"{plan.host} is not running on {claim.op.exec} as session {holder.session}")
            key = (data_bucket(self.boxes.get(claim.op.exec, "?")), f"{holder.location.rstrip('/')}/generation.json")
            marker = self.checker.markers.get(key)
            if normalize(holder.generation) != (marker[1] if marker else ""):
                out.append(f"the marker of {plan.host} does not name {holder.generation or 'origin'}")
        if not self.s3.idle():
            out.append(f"{len(self.s3.inflight)} object-store requests in flight, {self.s3.paused} callers paused")
        for label in sorted(self.boxes):
            if not self.js.consumer_idle(LEDGER_STREAM, f"box-{label}"):
                out.append(f"box-{label} has undelivered or unacknowledged events")
        for (obj, host), (gen, _body) in sorted(self.checker.current.items()):
            if self.checker.stream_last.get((obj, host), 0) != gen:
                out.append(f"gen {gen} of the {obj} of {host} is not on the stream")
        return out

    async def final_oracle(self) -> None:
        """The fold of the whole stream against the store, read through the admin connection."""
        store: dict[tuple[str, str], bytes | None] = {}
        for prefix in ("control/hosts/", "control/records/"):
            for key in await self.admin.list_keys(DEPLOY, prefix):
                found = object_of_key(key)
                if found is None:
                    continue
                got = await self.admin.get(DEPLOY, key)
                store[found] = got.body if isinstance(got, Got) else None
        for obj, host in self.checker.current:
            store.setdefault((obj, host), None)
        self.checker.final(self.js.messages(LEDGER_STREAM), store)
        for host in sorted({p.host for p in self.checker.procs}):
            self.checker.check_writers(host)

    def stop(self) -> None:
        """End of the run: stop recording, then stop every actor in a fixed order."""
        self.trace.close()
        self.running = False
        for name in sorted(self.slots):
            slot = self.slots[name]
            if slot.restart_handle is not None:
                slot.restart_handle.cancel()
            if slot.actor is not None:
                slot.actor.kill()

