"""Witness scenarios (model digest §1 "Witnesses", §5): a scripted run per rule that the random sweep
may reach only rarely.

A witness runs in a clean world on a :class:`~sim.faults.QuietPlan` (no fault fires unless the script
makes it happen; it never draws from a seed), scripts each step (hold an object-store request, pause
an actor between its read and its write, crash an actor at a ledger fault point, restart it), then
drives the world to quiescence and runs the final oracle. It names the invariant its rules' absence
must break. The gate runs every witness three ways: unmutated it must hold; under every proper subset
of its rules it must hold; under the whole set it must violate with the named invariant.

A rule whose guard is not in the code yet is never consulted: the run under it is reported as
``unwired`` (see ``sim/expected-outcomes.txt``, reason ``unexercised``).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

import msgspec

from events.claim import Claim, Op
from events.ids import rollback_id
from services.agent.config import region_bucket
from services.box.compute import BoxCompute
from services.box.instance.sandbox import instance_dir
from services.door.auth import Identity
from services.door.decide import MoveRequest
from services.ledger.ledger import Committed
from services.target.worker import staging_prefix
from sim.faults import QuietPlan, Timing
from sim.moves import MoveConsole, MovePlan, MoveWorld
from sim.run import DEFAULT_TIMING, Result, execute
from sim.twins.s3 import Hold, Request
from sim.workload import HostPlan, Workload
from sim.world import DEPLOY, MilestoneMissed, World

__all__ = ["WITNESSES", "Witness", "WitnessVerdict", "judge", "run_witness"]

Script = Callable[[World], Awaitable[None]]


@dataclass(frozen=True)
class Witness:
    name: str
    rules: tuple[str, ...]
    failure: str  # the invariant the whole mutation set must violate
    hosts: tuple[tuple[str, str], ...]  # (host, box) the world creates and must bring to quiescence
    script: Script
    doc: str
    moves: bool = False  # the world with moves (sim/moves.py): the production agents, door and recovery
    regions: tuple[str, ...] = ("ie", "uk")  # a box each


def _world(w: Witness, timing: Timing) -> Callable[[asyncio.AbstractEventLoop], World]:
    def make(loop: asyncio.AbstractEventLoop) -> World:
        boxes = {f"{r}-1": r for r in w.regions}
        hosts = tuple(HostPlan(h, b, boxes[b], 0.0) for h, b in w.hosts)
        workload = Workload(hosts, (), concurrent_batches=False, wrong_box=False, marker_tail=False)
        kind = MoveWorld if w.moves else World
        return kind(f"witness:{w.name}", QuietPlan(f"witness:{w.name}"), timing, loop, workload, witness=True,
                    boxes=boxes)

    return make


def run_witness(w: Witness, mutate: Iterable[str] = (), *, trace: bool = False,
                timing: Timing = DEFAULT_TIMING) -> Result:
    return execute(f"witness:{w.name}", _world(w, timing), w.script, trace=trace, mutate=tuple(mutate))


# -- verdicts -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WitnessVerdict:
    witness: str
    mutate: tuple[str, ...]
    outcome: str  # "held", "violated", "wrong-failure", "unwired", "error"
    detail: str
    result: Result

    @property
    def ok(self) -> bool:
        """What the gate requires: hold unmutated and under proper subsets; violate (or be unwired)
        under the whole set."""
        full = set(self.mutate) == set(WITNESS_BY_NAME[self.witness].rules)
        if full:
            return self.outcome in ("violated", "unwired")
        return self.outcome == "held"


def judge(w: Witness, mutate: tuple[str, ...], result: Result) -> WitnessVerdict:
    if result.error:
        return WitnessVerdict(w.name, mutate, "error", result.error, result)
    full = set(mutate) == set(w.rules)
    unwired = sorted(r for r in mutate if not result.consulted.get(r))
    if result.violations:
        named = [v for v in result.violations if v.invariant == w.failure]
        if full and named:
            return WitnessVerdict(w.name, mutate, "violated", named[0].line(), result)
        if full:
            return WitnessVerdict(w.name, mutate, "wrong-failure", result.violations[0].line(), result)
        return WitnessVerdict(w.name, mutate, "violated", result.violations[0].line(), result)
    if full and unwired:
        return WitnessVerdict(w.name, mutate, "unwired", "never consulted: " + ", ".join(unwired), result)
    return WitnessVerdict(w.name, mutate, "held", "", result)


def subsets(rules: tuple[str, ...]) -> list[tuple[str, ...]]:
    """Every subset, the empty one first and the whole set last."""
    out: list[tuple[str, ...]] = []
    for k in range(len(rules) + 1):
        out.extend(itertools.combinations(sorted(rules), k))
    return out


# -- scripts --------------------------------------------------------------------------------------

H = "h1.example"


async def _create(world: World, host: str = H) -> None:
    plan = next(p for p in world.workload.hosts if p.host == host)
    await world.console().create(plan)
    await world.until(f"{host} created", lambda: (c := world.checker.claims.get(host)) is not None
                      and c.op.kind == "serving")


async def _awake(world: World, label: str, host: str = H) -> None:
    await world.box(label).wake(host, "witness")
    await world.until(f"{host} awake on {label}", lambda: bool(world.procs(label, host)))


async def _done(world: World, task: asyncio.Task[None] | None, what: str) -> None:
    await world.until(what, lambda: task is None or task.done())


def _claim_put(box: str, host: str = H) -> Callable[[Request], bool]:
    def pred(r: Request) -> bool:
        return r.access.op == "put" and r.access.key == f"control/hosts/{host}.json" and r.principal.name == box

    return pred


async def w_admit_before_start(world: World) -> None:
    """A wake on the execution holder. Mutated, the instance starts before its admission: a process
    tree runs that the claim does not name (INV-1)."""
    await _create(world)
    await _awake(world, "ie-1")


async def w_exec_admission(world: World) -> None:
    """The host serves on ie-1; a request for it reaches uk-1. uk-1 refuses in its wake (K6) and the
    admission decider refuses too (K1). Only with both gone is uk-1 admitted beside ie-1 (INV-1)."""
    await _create(world)
    await _awake(world, "ie-1")
    await _done(world, world.request("uk-1", H), "the request on uk-1 settled")


async def w_host_guard(world: World) -> None:
    """Two wake passes for one host on one box. The first reads the claim, then pauses before its
    admission; the second runs. The host guard serializes them; without it the admission's observed
    values refuse the stale pass. With both gone the stale pass admits a second session and starts a
    second process tree (INV-1)."""
    await _create(world)
    gate = world.gate("box.before_admit", "ie-1")
    first = world.request("ie-1", H)
    await world.until("the first pass paused before its admission", lambda: gate.waiting == 1)
    second = world.request("ie-1", H)
    await asyncio.sleep(120.0)  # the second pass runs as far as the guard lets it
    gate.open()
    await _done(world, first, "the first pass settled")
    await _done(world, second, "the second pass settled")


async def w_admission_kinds(world: World) -> None:
    """The claim is taken to ``deleting`` (a stand-in for the delete op, which does not exist yet) while
    its box restarts; the box's wake must not be admitted into a deleting claim (INV-13). The script
    then cancels the delete and the host converges."""
    await _create(world)
    await _awake(world, "ie-1")
    console = world.console()

    def deleting(c: Claim | None) -> Claim:
        assert c is not None
        return msgspec.structs.replace(c, op=Op(kind="deleting", id="del_witness", exec=c.op.exec,
                                                participants=c.op.participants))

    out = await console.ledger.transition("claim", H, "delete-begin", deleting)
    assert isinstance(out, Committed), out
    world.crash("ie-1", "witness")
    world.start("ie-1")
    await world.box("ie-1").wake(H, "witness after restart")

    def cancelled(c: Claim | None) -> Claim:
        assert c is not None
        return msgspec.structs.replace(c, op=Op(kind="serving", exec=c.op.exec, participants=c.op.participants))

    out = await console.ledger.transition("claim", H, "delete-cancelled", cancelled)
    assert isinstance(out, Committed), out


async def w_generation_conditional(world: World) -> None:
    """wGenerationConditional (model 29): the first session's marker PUT is accepted but completes only
    after the caller gave up; the box restarts, admits a second session and publishes its marker; then
    the first PUT lands. Written conditionally it gets a 412; unconditionally it puts the older
    generation back (marker-order)."""
    await _create(world)
    hold = world.s3.hold(lambda r: r.access.op == "put" and r.access.key.endswith("/generation.json"))
    first = world.request("ie-1", H)
    await world.until("the first marker PUT is held", lambda: bool(hold.matched))
    await _done(world, first, "the first pass gave up on its marker")
    world.crash("ie-1", "witness")
    world.start("ie-1")
    await world.box("ie-1").wake(H, "witness after restart")
    hold.release()
    await world.until("the late marker PUT landed", world.s3.idle)


async def w_publish_before_supersede(world: World) -> None:
    """A writer's admission CAS lands and it dies before publishing; after its restart the next
    admission must publish the missing gen before superseding it. Without that, the stream skips a
    gen and the relay can only rebase (ledger-history)."""
    await _create(world)
    world.crash_points[("ie-1", "after_cas")] = 1
    await _done(world, world.request("ie-1", H), "the admission crashed after its CAS")
    world.start("ie-1")
    await world.box("ie-1").wake(H, "witness after restart")


async def w_ledger_cas(world: World) -> None:
    """A wake pass's admission PUT is held in transit; the box dies and its next incarnation admits.
    Then the stale PUT arrives: If-Match the ETag it read, it gets a 412; unconditional, it overwrites
    the newer claim with another gen of the same number (ledger-history)."""
    await _create(world)
    hold = world.s3.hold(_claim_put("ie-1"), stage="transit")
    world.request("ie-1", H)
    await world.until("the admission PUT is in flight", lambda: bool(hold.matched))
    world.crash("ie-1", "witness")
    world.start("ie-1")
    await world.box("ie-1").wake(H, "witness after restart")
    hold.release()
    await world.until("the stale PUT settled", world.s3.idle)


# -- moves (sim/moves.py) --------------------------------------------------------------------------


def _mw(world: World) -> MoveWorld:
    assert isinstance(world, MoveWorld)
    return world


async def _serving_on(world: MoveWorld, box: str, host: str = H) -> None:
    def up() -> bool:
        claim = world.checker.claims.get(host)
        return claim is not None and claim.holder is not None and claim.op.kind == "serving" \
            and claim.op.exec == box and any(p.box == box and p.session == claim.holder.session
                                              for p in world.checker.procs if p.host == host)

    await world.until(f"{host} serving on {box}", up)


async def _writes(world: MoveWorld, n: int, tag: str, host: str = H) -> None:
    for i in range(n):
        world.write(host, f"{tag}{i}")
        await asyncio.sleep(5.0)


async def _closed(world: MoveWorld, host: str = H) -> None:
    def closed() -> bool:
        record = world.records.get(host)
        return record is not None and record.move is None and record.last_move is not None

    await world.until(f"the move of {host} closed", closed, timeout=4 * 3600.0)


async def _request_move(world: MoveWorld, to: str, cut: str = "auto", host: str = H, nth: int = 0) -> None:
    """The operator's ``nth`` move of ``host`` through the door; move-liveness judges it (sim/moves.py)."""
    console = world.console()
    assert isinstance(console, MoveConsole)
    answer = await console.door.request_move(host, MoveRequest(to, cut), Identity("op", "operator"))  # type: ignore[arg-type]
    if answer.status not in (200, 201):
        raise MilestoneMissed(f"the door refused the move: {answer.status} {answer.body}")
    console.asked[(host, nth)] = world.loop.time()
    record = world.records.get(host)
    if record is not None and record.move is not None:
        world.move_of[(host, nth)] = record.move.id


async def _serving_with_writes(world: World, writes: int) -> MoveWorld:
    """Every move witness's start: the actors run, the host is created and serves on ie-1, and takes ``writes``."""
    mw = _mw(world)
    world.run_actors()
    await _create(world)
    await _serving_on(mw, "ie-1")
    await _writes(mw, writes, "before")
    return mw


async def w_move(world: World) -> None:
    """A host serving on ie-1 takes writes, moves to uk (automatic cut) through the door, the source's preparing
    rounds and cut, the landing and both parks, and takes writes on uk-1. Every acknowledged write is in the
    database uk-1 serves (INV-2), no version is left under the staging lanes (INV-10), and the history audits
    clean. Mutated (``record-first-close`` off), the record closes before the parks are acknowledged and the
    source's finalizer passes the host again and again without time passing: INV-3 (a livelock)."""
    mw = await _serving_with_writes(world, 5)
    await _request_move(mw, "uk")
    await _closes_and_serves(mw, "uk-1", 3)


async def _closes_and_serves(world: MoveWorld, box: str, writes: int, tag: str = "after") -> None:
    """The end of most scripts: the move closes, the host serves on ``box`` and takes ``writes`` more writes."""
    await _closed(world)
    await _serving_on(world, box)
    await _writes(world, writes, tag)


def _in_state(world: MoveWorld, *states: str, host: str = H) -> Callable[[], bool]:
    """A predicate for :meth:`World.until`: the host's record has a move in one of ``states``."""
    def now() -> bool:
        record = world.records.get(host)
        return record is not None and record.move is not None and record.move.state in states
    return now


def _cutting(world: MoveWorld, host: str = H) -> bool:
    """The cut was admitted (its ``cut_deadline`` runs) and nothing is committed yet."""
    record = world.records.get(host)
    move = record.move if record is not None else None
    return move is not None and move.cut_deadline is not None and move.committed_at is None


async def w_cut_deadline(world: World) -> None:
    """The source's data-bucket requests stall for 300 s once the cut is admitted (a frozen box), longer than the
    cut window (§7.4). The cut must give up at its ``cut_deadline``: the source reverts (§7.4 ``reverting``), the
    move closes ``rolled_back`` without committing and the host serves on ie-1 again with its writes. With only
    ``cut-deadline`` off the cut flips late, the target's own bound refuses its probe, and the rollback (§7.8)
    returns the host: still held. With ``commit-deadline`` off too the late landing commits: INV-9."""
    mw = await _serving_with_writes(world, 3)
    hold = world.s3.hold(lambda r: r.principal.name == "ie-1" and r.access.bucket != DEPLOY and _cutting(mw),
                         stage="transit", once=False)
    await _request_move(mw, "uk")
    await world.until("the cut stalls", lambda: bool(hold.matched), timeout=4 * 3600.0)
    await asyncio.sleep(300.0)
    hold.release()
    await _closed(mw)
    await _writes(mw, 2, "after")


def _held_upload(mw: MoveWorld) -> Hold:
    """Hold on the server (accepted, not yet applied) the first upload of the source into its location in ie once
    the move is requested: the client gives up after its timeout and retries the same bytes."""
    return mw.s3.hold(lambda r: r.principal.name == "ie-1" and r.access.op == "put" and r.access.bucket != DEPLOY
                      and r.access.key.startswith(f"instances/{H}/") and mw.records.get(H) is not None
                      and mw.records[H].move is not None, stage="accepted", once=True)


async def w_late_completion(world: World) -> None:
    """wStraggler's held upload lands right after the source's park listed and archived its location, before its
    acknowledgement: the park verifies only on a listing later than ``evidence_at + H`` (§6.4), finds it, and parks
    it as a further event. With ``quiet-before-ack`` off the park acknowledges at once and the late
    completion lands after it; the at-rest sweep retires it (held). With ``straggler-sweep`` off too: INV-10."""
    mw = await _serving_with_writes(world, 3)
    hold = _held_upload(mw)
    await _request_move(mw, "uk")
    await world.until("an upload of the source held", lambda: bool(hold.matched), timeout=4 * 3600.0)
    await world.until("the source's park archived its location",
                      lambda: bool(mw.s3.current_keys(region_bucket("ie"), f"superseded/{H}/")), timeout=4 * 3600.0)
    hold.release()
    await _closed(mw)
    await _writes(mw, 2, "after")


async def w_straggler(world: World) -> None:
    """A level-0 upload of the source's replicator into its location in ie is accepted once the move is requested
    and held on the server (a completion long after the client gave up and retried the same bytes); it lands only
    after the move closed, when the source's park has verified the location empty and been acknowledged. The
    straggler is residue in a location the host left (§6.4): ie-1's at-rest sweep queues a ``park-sweep``,
    parks it by exact versions after the horizon and acknowledges. Mutated (``straggler-sweep`` off), the residue
    stays: INV-10 once the calm phase has seen it for an hour."""
    mw = await _serving_with_writes(world, 3)
    hold = _held_upload(mw)
    await _request_move(mw, "uk")
    await world.until("an upload of the source held", lambda: bool(hold.matched), timeout=4 * 3600.0)
    await _closed(mw)
    hold.release()
    await world.until("the straggler landed", lambda: not world.s3.inflight, timeout=3600.0)
    await _writes(mw, 2, "after")


async def w_disk_lost(world: World) -> None:
    """A host serving on ie-1 takes writes, its replicator syncs, and it takes more writes; then ie-1's agent dies
    and the box reboots without its disk. The box is provisioned again (``hostmove box init``), its agent starts
    and wakes the host by a cold admission from the bucket: every uploaded write is back, the writes after the last
    upload are declared lost (``writes_lost``), and the files directory comes back from the files manifest byte for
    byte (INV-4, §8.3 L17). Mutated (``files-manifest-restore`` off), the missing files are never restored and the
    app starts with an empty files directory beside its restored database (moveprobe writes a new key): INV-4."""
    mw = await _serving_with_writes(world, 3)
    files = instance_dir(mw.root / "boxes" / "ie-1" / "data", H) / H
    before = {p.name: p.read_bytes() for p in sorted(files.iterdir()) if p.is_file() and p.name != ".files-gen"}
    await asyncio.sleep(2 * 30.0)  # two sync intervals: the writes so far are in the bucket
    await _writes(mw, 2, "unsynced")
    world.crash("ie-1", "witness: the box dies with its disk")
    mw.reboot("ie-1", lose_disk=True)
    world.start("ie-1")
    await _serving_on(mw, "ie-1")
    after = {p.name: p.read_bytes() for p in sorted(files.iterdir()) if p.is_file() and p.name != ".files-gen"}
    differ = [n for n in sorted(set(before) | set(after)) if before.get(n) != after.get(n)]
    if differ:
        world.checker.flag("INV-4", f"the files of {H} after the lost disk differ from those its files manifest "
                                    f"published ({', '.join(differ)})")
    await _writes(mw, 2, "after")


async def w_ack_before_admission(world: World) -> None:
    """wAckBeforeAdmission (admit-before-start; claim 6.10, R10-1), on the production activator: a host is created and
    its box wakes it. The admitting CAS comes first, so the app that acknowledges writes always runs in the session the
    claim names. Mutated (rev 7.10's order: the app starts, then the admission), a process runs that no admitted
    session names: INV-1."""
    await _serving_with_writes(world, 2)


async def w_two_wakes(world: World) -> None:
    """Two wakes of one host at once on its box (the production activator, a stopped host): the host guard lets one
    through; the other waits, finds it running under the guard and does nothing. Mutated (``hostguard`` off), both
    read the claim and admit, the second over the first's running session: a process runs in a session the claim no
    longer names (INV-1)."""
    mw = _mw(world)
    world.run_actors()
    await _create(world)
    await _serving_on(mw, "ie-1")
    activator = mw.slots["ie-1"].actor.agent.activator
    await activator.stop(H)
    wakes = [asyncio.ensure_future(activator.wake(H)) for _ in range(2)]
    await world.until("both wakes settled", lambda: all(w.done() for w in wakes))
    for w in wakes:
        mw.trace.emit("witness", f"a wake of {H} on ie-1: {w.exception() or w.result()}")
    await _writes(mw, 2, "after")


async def w_dirty_rollback(world: World) -> None:
    """The app writes on the target during its probe and then fails its readiness there (moveprobe's after-write
    switch, §14.4): the landing rolls back after the flip and the target's release is dirty (§7.8). It returns its
    stopped state through the return lane, the source installs it into ``g-<rb>`` and is admitted cold into it: the
    move closes ``rolled_back``, the host serves on ie-1 again and the row the target acknowledged is in its database
    (INV-2), the target's location and lanes are parked (INV-10). Mutated (``dirty-return`` off), the written target
    is taken as clean and the source recovers its own state without the target's row: INV-2. Mutated
    (``target-park`` off), nothing parks what the target released: its location keeps the probe's generations,
    INV-10."""
    mw = await _serving_with_writes(world, 3)
    mw.moves = (MovePlan(H, 0, float("inf"), "auto", 0.0, None, "after-write"),)  # the operator's one move
    await _request_move(mw, "uk")
    record = mw.records.get(H)
    if record is not None and record.move is not None:  # the plan's switch is this move's from its request on
        mw.move_of[(H, 0)] = record.move.id
    await _closes_and_serves(mw, "ie-1", 2)


async def w_target_park(world: World) -> None:
    """wDirtyRollback's script, then two calm hours. Mutated (``target-park`` off), the target's release adds no
    park of what it released; the at-rest sweep retires that location later (defence in depth, §6.4), so only with
    ``straggler-sweep`` off too does the target's location keep the probe's generations in a region the host left:
    INV-10."""
    await w_dirty_rollback(world)
    await asyncio.sleep(2 * 3600.0)


async def w_public_during_probe(world: World) -> None:
    """commit-before-open (INV-5, R3-5): a host moves ie -> uk and, while the landing's probe runs on uk-1 before the
    commit, the app's users write to it. The edge table names no held route and no probe, so the write waits for the
    open (asked again until the host serves on uk-1). Mutated, uk-1's edge table names the probe: a public write
    reaches the move's target before the commit (INV-5)."""
    mw = await _serving_with_writes(world, 2)
    await _request_move(mw, "uk")
    agent = mw.slots["uk-1"].actor.agent

    def probing() -> bool:
        running = agent.instances.get(H)
        record = mw.records.get(H)
        move = record.move if record is not None else None
        return running is not None and running.origin == "probe" and move is not None and move.committed_at is None

    await world.until("the landing's probe runs on uk-1", probing, timeout=4 * 3600.0)
    mw.write(H, "during-probe")  # answered "asleep": nothing serves it on uk-1 until the open
    await _closes_and_serves(mw, "uk-1", 2)


async def w_move_asleep(world: World) -> None:
    """source-serves-before-stopping (§19.1): a host that fell asleep on ie-1 is moved to uk. S1 probes the source's
    instance as it runs (§7.3), so the source wakes it while the cut is before ``stopping``, and the move is done.
    Mutated (the activator refuses every wake of a moving host), the source is never ready; the move aborts itself
    after the preparing bound on a healthy world (move-liveness)."""
    mw = await _serving_with_writes(world, 2)
    await world.until(f"{H} asleep on ie-1", lambda: mw._asleep(H, mw.checker.claims[H]), timeout=3600.0)
    await _request_move(mw, "uk")
    await _closes_and_serves(mw, "uk-1", 2)


def _probing(mw: MoveWorld, box: str) -> Callable[[], bool]:
    """The landing's probe runs on ``box`` and nothing is committed (after the flip, before the commit)."""
    def probing() -> bool:
        slot = mw.slots[box]
        running = slot.actor.agent.instances.get(H) if slot.up else None
        record = mw.records.get(H)
        move = record.move if record is not None else None
        return running is not None and running.origin == "probe" and move is not None and move.committed_at is None

    return probing


async def w_declare_lost(world: World) -> None:
    """A host moves ie -> uk; while the landing's probe runs on uk-1 (after the flip, before the commit) the whole VM
    of uk-1 freezes: its agent, its replicator and the probe app stop, time moves on. Ten minutes later the operator,
    taking the unanswering box for gone (its lease expired), declares it lost without the platform (model 5): the
    door refuses (M-R75, the compute is not shown stopped). The operator has the platform stop uk-1 (the compute
    port's twin: every process of it dies) and declares it lost again through the door: a clean rollback citing the
    declaration, the source recovers cold (the lost session's writes declared) and the host serves on ie-1 with its
    writes. Then the platform starts uk-1 again with its old disk: its agent quarantines first, retiring every local
    artifact of the host (``lost-quarantine``), and the host stays on ie-1. Mutated (``declare-lost-compute`` off),
    the first declaration is taken: the source recovers while the frozen VM still runs the probe app, two process
    trees of the host (INV-1), and the VM resumes beside it. Mutated (``lost-quarantine`` off), uk-1 starts again
    with its stale local state of the host: INV-10 (its local form, :meth:`MoveWorld._quarantined`)."""
    mw = await _serving_with_writes(world, 3)
    await _request_move(mw, "uk")
    await world.until("the landing's probe runs on uk-1", _probing(mw, "uk-1"), timeout=4 * 3600.0)
    mw.freeze("uk-1")
    await asyncio.sleep(600.0)
    console = mw.console()
    assert isinstance(console, MoveConsole)
    if await console.declare_lost(H, "uk-1", ask_platform=False) != 200:
        entry = (await console.door.roster()).box("uk-1")
        assert entry is not None
        await mw.compute.stop(BoxCompute.of(entry))
        status = await console.declare_lost(H, "uk-1")
        if status != 200:
            raise MilestoneMissed(f"the door refused to declare the stopped uk-1 lost: {status}")
    await _closes_and_serves(mw, "ie-1", 2)
    if "uk-1" in mw.stopped:
        mw.start_machine("uk-1")
    else:
        mw.resume("uk-1")
    await asyncio.sleep(600.0)
    await _serving_on(mw, "ie-1")
    await _writes(mw, 2, "later")


async def w_fence_converts_moving(world: World) -> None:
    """wFenceConvertsMoving (§7.10, claim 6.28): a host moves ie -> uk; while the move prepares (before the flip) the
    source's machine is terminated: its box is gone for good, the platform fences it (``control/box-fences/``, the
    roster's ``fenced_at``) and enrolls a replacement, ie-2, in the one-box region later. The recovery pass converts
    the ``moving`` op in one CAS to ``relocating`` at ``pinning`` (exec none, the fence cited) and, once ie-2 is
    enrolled, hands the host to it: ie-2 restores it from the region's bucket and serves it, the move closed.
    Mutated (``fence-converts-moving`` off), the move with a fenced source only raises ``fenced-box-in-operation``
    and is never resolved without an operator: the host never serves again (INV-3)."""
    mw = await _serving_with_writes(world, 3)
    await _request_move(mw, "uk")

    await world.until("the move prepares", _in_state(mw, "preparing", "ready"), timeout=3600.0)
    world.crash("ie-1", "witness: the source's machine is terminated")
    mw.terminate("ie-1")
    await world.until("the replacement ie-2 enrolled", lambda: "ie-2" in mw.slots, timeout=4 * 3600.0)
    await _serving_on(mw, "ie-2")
    await _writes(mw, 2, "after")


async def w_lost_return_park(world: World) -> None:
    """Model 27: the app writes on the target during its probe and fails its readiness there, so the rollback is
    dirty and uk-1 returns its state through the return lane in ie's bucket. The moment uk-1 has issued the first PUT
    of its lane (accepted by the store, not applied yet) its VM freezes and the operator has the platform stop it and
    declares it lost: the target released dirty and had not returned (``dirty-unreturned``), so the same claim CAS
    owes the lane's ``park-staging`` to the source (§7.8). The source recovers its own state cold (the target's
    session declared lost), the held PUT lands afterwards, and the source's park retires the lane after its horizon:
    the move closes ``rolled_back`` with nothing left under the lane. The platform then starts uk-1 again: it
    quarantines, and its at-rest sweep retires the host's location and forward lane in uk, which no live box parked.
    Mutated (``lost-return-park`` off), nobody owes a park of the return lane: the move closes with the lane's object
    still in ie's bucket (INV-10 at the close, :meth:`MoveWorld._lane_at_close`; the serving region's at-rest sweep
    retires it later, defence in depth, ``sweep-staging``)."""
    mw = await _serving_with_writes(world, 3)
    mw.moves = (MovePlan(H, 0, float("inf"), "auto", 0.0, None, "after-write"),)  # the operator's one move
    await _request_move(mw, "uk")
    record = mw.records.get(H)
    if record is None or record.move is None:
        raise MilestoneMissed("the move is not on the record after the door took it")
    mw.move_of[(H, 0)] = record.move.id
    lane = staging_prefix(H, rollback_id(record.move.id))
    hold = world.s3.hold(lambda r: r.principal.name == "uk-1" and r.access.op == "put"
                         and r.access.bucket == region_bucket("ie") and r.access.key.startswith(lane),
                         stage="accepted", once=True)
    await world.until("uk-1 issued the first PUT of its return lane", lambda: bool(hold.matched),
                      timeout=4 * 3600.0)
    mw.freeze("uk-1")
    console = mw.console()
    assert isinstance(console, MoveConsole)
    entry = (await console.door.roster()).box("uk-1")
    assert entry is not None
    await mw.compute.stop(BoxCompute.of(entry))
    status = await console.declare_lost(H, "uk-1")
    if status != 200:
        raise MilestoneMissed(f"the door refused to declare the stopped uk-1 lost: {status}")
    hold.release()
    await _closes_and_serves(mw, "ie-1", 2)
    # What the lost box would have parked in its own region (its location in uk: the declaration's left_in_region)
    # waits for a box of that region: the platform starts uk-1 again, it quarantines, and its at-rest sweep retires
    # that location (§6.4). The lane in ie's bucket is the source's to park, and only the declaration owes it.
    mw.start_machine("uk-1")
    await asyncio.sleep(600.0)
    await _writes(mw, 2, "later")


WITNESSES: tuple[Witness, ...] = (
    Witness("wMove", ("record-first-close",), "INV-3", ((H, "ie-1"),), w_move, w_move.__doc__ or "", moves=True),
    Witness("wDirtyRollback", ("dirty-return",), "INV-2", ((H, "ie-1"),), w_dirty_rollback,
            w_dirty_rollback.__doc__ or "", moves=True),
    Witness("wTargetPark", ("straggler-sweep", "target-park"), "INV-10", ((H, "ie-1"),), w_target_park,
            w_target_park.__doc__ or "", moves=True),
    Witness("wParkExact", ("park-by-version",), "actor-error", ((H, "ie-1"),), w_move,
            "wMove's script. Mutated (bare-key deletes), the source's park finds its scope refilled by the delete "
            "markers it leaves and stops with ParkError (the park's own check, reported as actor-error).", moves=True),
    Witness("wCutDeadline", ("cut-deadline", "commit-deadline"), "INV-9", ((H, "ie-1"),), w_cut_deadline,
            w_cut_deadline.__doc__ or "", moves=True),
    Witness("wStraggler", ("straggler-sweep",), "INV-10", ((H, "ie-1"),), w_straggler, w_straggler.__doc__ or "",
            moves=True),
    Witness("wLateCompletion", ("quiet-before-ack", "straggler-sweep"), "INV-10", ((H, "ie-1"),),
            w_late_completion, w_late_completion.__doc__ or "", moves=True),
    Witness("wDiskLost", ("files-manifest-restore",), "INV-4", ((H, "ie-1"),), w_disk_lost,
            w_disk_lost.__doc__ or "", moves=True),
    # issue 16: the same lost disk declares the session whose tail was never uploaded (writes-lost); the same move
    # covers the source's generation in the commit's CAS, without which its record stays uncovered at rest
    Witness("wWritesLost", ("writes-lost",), "INV-2", ((H, "ie-1"),), w_disk_lost, "wDiskLost's run: mutated "
            "(writes-lost off), the admission after the lost disk declares nothing and the writes after the last "
            "upload are missing from the cold restore with no session declared lost (INV-2).", moves=True),
    Witness("wCoverAtPark", ("cover-at-park",), "INV-3", ((H, "ie-1"),), w_move, "wMove's run: mutated "
            "(cover-at-park off), the commit's park of the source region covers no record, so the landing's "
            "record (its predecessor in the other region) stays uncovered at rest and the calm phase never settles "
            "(INV-3).", moves=True),
    Witness("wFinalSyncFails", ("final-checkpoint-after-restart",), "INV-2", ((H, "ie-1"),), w_straggler,
            "wStraggler's script: the held upload is the cut's final sync, which fails; the replicator's close lets "
            "SQLite checkpoint the unshipped frames into the database file. Mutated (no flush of the local database "
            "by the retried stop), the stop evidence and the seal stop at the bucket's position and the move loses "
            "the acknowledged writes of the final sync: INV-2.", moves=True),
    Witness("wAdmitBeforeStart", ("admit-before-start",), "INV-1", ((H, "ie-1"),), w_admit_before_start,
            w_admit_before_start.__doc__ or ""),
    Witness("wAckBeforeAdmission", ("admit-before-start",), "INV-1", ((H, "ie-1"),), w_ack_before_admission,
            w_ack_before_admission.__doc__ or "", moves=True),
    Witness("wTwoWakes", ("hostguard",), "INV-1", ((H, "ie-1"),), w_two_wakes, w_two_wakes.__doc__ or "",
            moves=True),
    Witness("wMoveAsleep", ("source-serves-before-stopping",), "move-liveness", ((H, "ie-1"),), w_move_asleep,
            w_move_asleep.__doc__ or "", moves=True),
    Witness("wPublicDuringProbe", ("commit-before-open",), "INV-5", ((H, "ie-1"),), w_public_during_probe,
            w_public_during_probe.__doc__ or "", moves=True),
    Witness("wExecAdmission", ("exec-admission", "exec-writer"), "INV-1", ((H, "ie-1"),), w_exec_admission,
            w_exec_admission.__doc__ or ""),
    Witness("wHostGuard", ("admit-bind-op", "hostguard"), "INV-1", ((H, "ie-1"),), w_host_guard,
            w_host_guard.__doc__ or ""),
    Witness("wAdmissionKinds", ("admission-kinds",), "INV-13", ((H, "ie-1"),), w_admission_kinds,
            w_admission_kinds.__doc__ or ""),
    Witness("wGenerationConditional", ("generation-conditional",), "marker-order", ((H, "ie-1"),),
            w_generation_conditional, w_generation_conditional.__doc__ or ""),
    Witness("wPublishBeforeSupersede", ("publish-before-supersede",), "ledger-history", ((H, "ie-1"),),
            w_publish_before_supersede, w_publish_before_supersede.__doc__ or ""),
    Witness("wDeclareLostCompute", ("declare-lost-compute",), "INV-1", ((H, "ie-1"),), w_declare_lost,
            w_declare_lost.__doc__ or "", moves=True),
    Witness("wLostQuarantine", ("lost-quarantine",), "INV-10", ((H, "ie-1"),), w_declare_lost,
            "wDeclareLostCompute's script (its unmutated run): " + (w_declare_lost.__doc__ or ""), moves=True),
    Witness("wLostReturnPark", ("lost-return-park",), "INV-10", ((H, "ie-1"),), w_lost_return_park,
            w_lost_return_park.__doc__ or "", moves=True),
    Witness("wFenceConvertsMoving", ("fence-converts-moving",), "INV-3", ((H, "ie-1"),), w_fence_converts_moving,
            w_fence_converts_moving.__doc__ or "", moves=True),
    Witness("wLedgerCas", ("ledger-cas",), "ledger-history", ((H, "ie-1"),), w_ledger_cas,
            w_ledger_cas.__doc__ or ""),
)
async def w_move_crashes(world: World) -> None:
    """wMove with both agents crashing mid-move (memory lost, disk and instances kept) and restarting: the source
    in its cut, the target in its landing. The move still closes, the host serves on uk-1 with every acknowledged
    write (INV-2, INV-3). Not a rule's witness: the tests run it unmutated."""
    mw = await _serving_with_writes(world, 4)
    await _request_move(mw, "uk")
    await world.until("the cut admitted", lambda: _cutting(mw), timeout=4 * 3600.0)
    world.crash("ie-1", "witness: the source agent dies in its cut")
    await asyncio.sleep(30.0)
    world.start("ie-1")

    await world.until("the landing started", _in_state(mw, "landing", "committed"), timeout=4 * 3600.0)
    world.crash("uk-1", "witness: the target agent dies in its landing")
    await asyncio.sleep(30.0)
    world.start("uk-1")
    await _closes_and_serves(mw, "uk-1", 3)


MOVE_CRASHES = Witness("wMoveCrashes", (), "INV-3", ((H, "ie-1"),), w_move_crashes, w_move_crashes.__doc__ or "",
                       moves=True)


async def w_repeat_moves(world: World) -> None:
    """wRepeatMoves (issue 17 item 5): one host moves ie -> uk -> us -> ie with no fault, each move requested once the
    one before it closed, and takes writes between them. Every move must end ``done`` (move-liveness) and the host
    serve on its target with every acknowledged write (INV-2). The defect it pins: a second move off a box the host
    had landed on stalled in preparing (the agent looked for the landed instance among its woken ones only, so S1
    never saw it ready) and aborted itself after the preparing bound; a world where each host moved once never
    found it. Not a rule's witness: the gate runs it unmutated, and tests/test_sim.py plants the defect again."""
    mw = await _serving_with_writes(world, 3)
    for nth, (to, box) in enumerate((("uk", "uk-1"), ("us", "us-1"), ("ie", "ie-1"))):
        await _request_move(mw, to, nth=nth)
        await _closes_and_serves(mw, box, 2, f"after{nth}-")


async def w_probe_reboot(world: World) -> None:
    """wDirtyRollback's move with the target's box frozen the moment its probe has written (the row acknowledged,
    in the probe's WAL), the landing's deadline passing, and the platform then rebooting uk-1 with its disk: the
    release runs on a new boot where no probe process is left (§7.8 ``released``, digests after a final checkpoint,
    §5.3 step 5). The release must find the row and be dirty, and the host serve on ie-1 with it (INV-2). The defect
    it pins: the release hashed the database file without the dead probe's WAL, read it as installed, released clean
    and the source recovered without the row (move seed 250 with issue 19 item 9). Not a rule's witness: the gate
    runs it unmutated."""
    mw = await _serving_with_writes(world, 3)
    mw.moves = (MovePlan(H, 0, float("inf"), "auto", 0.0, None, "after-write"),)  # the operator's one move
    await _request_move(mw, "uk")
    record = mw.records.get(H)
    if record is not None and record.move is not None:
        mw.move_of[(H, 0)] = record.move.id
    await world.until("the probe on uk-1 acknowledged its write", lambda: any(
        a.box == "uk-1" and a.value.startswith("probe-") for a in mw.acks), timeout=4 * 3600.0)
    mw.freeze("uk-1")

    await world.until("the landing's deadline rolled the move back", _in_state(mw, "rolling_back"),
                      timeout=4 * 3600.0)
    console = mw.console()
    assert isinstance(console, MoveConsole)
    entry = (await console.door.roster()).box("uk-1")
    assert entry is not None
    await mw.compute.stop(BoxCompute.of(entry))
    mw.start_machine("uk-1")
    await _closes_and_serves(mw, "ie-1", 2)


PROBE_REBOOT = Witness("wProbeReboot", (), "INV-2", ((H, "ie-1"),), w_probe_reboot, w_probe_reboot.__doc__ or "",
                       moves=True)


REPEAT_MOVES = Witness("wRepeatMoves", (), "move-liveness", ((H, "ie-1"),), w_repeat_moves,
                       w_repeat_moves.__doc__ or "", moves=True, regions=("ie", "uk", "us"))
SCENARIOS: tuple[Witness, ...] = (MOVE_CRASHES, REPEAT_MOVES, PROBE_REBOOT)
"""Scripted worlds of no rule: each must hold unmutated (the gate runs them; ``failure`` names what a regression of
the behaviour they pin would violate)."""

FINDINGS: tuple[Witness, ...] = ()
"""Open findings: scripts that do not hold unmutated today, kept out of the gate until the code they exercise is
built (``hostmove sim witness NAME`` replays them). None now: wCutDeadline (the host never served again after a
cut's deadline) became a witness once §7.4 ``reverting`` was built."""
WITNESS_BY_NAME = {w.name: w for w in (*WITNESSES, *SCENARIOS, *FINDINGS)}


def check_witness(w: Witness, *, trace: bool = False) -> list[WitnessVerdict]:
    """Run ``w`` unmutated, under every proper subset, and under its whole set."""
    return [judge(w, m, run_witness(w, m, trace=trace)) for m in subsets(w.rules)]
