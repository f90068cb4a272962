"""The simulated world with moves (issue 5 items 1, 4, 5; spec §7.1-§7.14; model digest §1, §8).

The same harness as :mod:`sim.world` (twins, virtual clock, seeded faults, crashes and restarts), with the
production actors of a move instead of the box stand-in:

- each **box** runs the production agent :class:`services.agent.service.BoxAgent` (the activator, the box's
  stores, both sides' runners of :mod:`services.agent.sides`) on its own object-store principal; the sim's loop
  around it does what ``BoxAgent.run`` does (adopt what runs, then passes on ledger events, a scan and the
  passes' own wakes), on a durable consumer instead of core NATS. Its instances run in a :class:`SimTree`
  (the cgroup twin: an agent crash leaves them running, the next agent stops them) and behave like moveprobe
  (:class:`sim.twins.box.SimInstance`: real SQLite files under the run's box directories);
- the **console** creates hosts, relays, runs the recovery pass (:class:`services.recovery.recovery.RecoveryPass`)
  and asks the door (:class:`services.door.api.Door`, in-process) for the seed's moves and manual cuts;
- the **edge** sends each host's writes to the box its claim names (an instance acknowledges after its commit); a
  write to a sleeping host asks its box to wake it and is held and tried again (the router's wake); hosts sleep
  after ``IDLE_S`` idle (:mod:`services.box.instance.sleep`), and a due timer or a move wakes them too;
- the **chaos** actor crashes agents and the console (memory lost, disk kept); one agent crash in four is its box's
  reboot, and half of those lose the box's disk (it is provisioned again before its agent starts), some of those a
  machine gone for good (fenced, and replaced under a new label; :meth:`MoveWorld.terminate`); named failpoints of
  the landing and the finalizers crash an agent mid-move.

Invariants beyond :class:`sim.invariants.Checker`'s (spec §4; model digest §1): INV-2 (every acknowledged write
is in the serving database, or its writer session is declared lost by a later admission), INV-5 (no public
delivery to a move's target before the commit), INV-9 (no commit after ``cut_deadline``), INV-10 (no version
left under a closed move's staging lanes once its parks acknowledged, nothing current in a location a host at rest
has left), the protocol audit (:class:`services.ledger.protocol.ProtocolCheck`) over the simulated stream, and the
timers (§9.4): every instance declares a schedule in its files (``timers.json``), the agents' timer runners deliver
it through the box-local network port, a due time never runs twice unless the agent that ran it died in between
(INV-1 for timers), and after quiescence every serving host's schedule runs on its box within a period (INV-3).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import os
import random
import shutil
import sqlite3
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from bus.subjects import LEDGER_STREAM, SubjectError, parse_ledger_subject
from events.base import decode
from events.claim import Claim
from events.durable import DurableValueError
from events.envelope import Actor, Transition
from events.ids import rollback_id
from events.record import Record
from kernel import ports
from kernel.passes import PassPool
from services.agent.config import BoxConfig, region_bucket
from services.agent.service import AgentTiming
from services.agent.service import BoxAgent as ProductionAgent
from services.agent.sides import Timings
from services.box.artifacts.markers import normalize
from services.box.compute import BoxCompute, ComputeObservation
from services.box.fence import fence_box
from services.box.instance.activator import AppSpec, StartPolicy
from services.box.instance.sandbox import instance_dir
from services.box.instance.sleep import SleepMarks
from services.box.replica.restore import RestoreRefused, restore_generation
from services.box.roster import init_box
from services.door.api import Door, Unreadable
from services.door.auth import Identity
from services.door.decide import MoveRequest
from services.door.declare import DeclareLost, declare_lost
from services.ledger.ledger import Crash, Ledger
from services.ledger.protocol import ProtocolCheck
from services.move import park as parking
from services.move.follow import snapshot_prefix
from services.objstore.port import StoreError
from services.recovery.recovery import RecoveryPass
from services.source import phases as source_phases
from services.sweeper.straggler import serving_region
from services.target.probe import PRODUCTION as PROBE_PRODUCTION
from services.target.probe import ProbeApp, ProcessApp
from services.target.worker import staging_prefix
from sim.faults import FaultPlan, Timing
from sim.invariants import Proc
from sim.loop import OWNER
from sim.run import Result
from sim.twins.box import Ack, SimInstance, SimNet, SimTree
from sim.twins.compute import SimCompute
from sim.twins.jetstream import SimEventLog
from sim.twins.rates import PlanRates, slow_region
from sim.twins.s3 import NOMINAL, Landed, M17Policy, Principal
from sim.workload import Workload
from sim.world import DEPLOY, EXPECTED, ActorBase, ConsoleActor, PlanRandom, Slot, World, retry_expected

__all__ = ["MoveBox", "MovePlan", "MoveWorld", "draw_moves"]

IDLE_S = 240.0
"""An instance idle this long sleeps (issue 5 item 4): shorter than the timers' period, so every host sleeps between
its writes and between its timer runs, and each due time wakes it again (its run is a commit: activity)."""
EDGE_RETRY_S = 30.0
EDGE_RETRIES = 6
"""A write to a sleeping host asks its box to wake it and is tried again (the router holds the request)."""
SIM_APP = AppSpec(argv=["sim-instance"], env=lambda host, data_dir, port, region: {
    "SIM_DB": str(data_dir / f"{host}.db"), "SIM_PORT": str(port), "SIM_FILES": str(data_dir / host)},
    ready_within_s=20)
AGENT_TIMING = AgentTiming(scan_s=60.0, retry_s=5.0, move=Timings(
    source=source_phases.PRODUCTION, park=parking.PRODUCTION, poll_s=30.0, within_s=3600.0, max_passes=400),
    probe=PROBE_PRODUCTION, sync_interval_s=30.0, timer_tick_s=60.0, max_steps=40, sweep_s=300.0, idle_s=IDLE_S,
    retention_ms=3_600_000)
CHORE_DUE_MS = parking.PRODUCTION.signature_age_ms + 120_000 + 2 * 60_000 + 600_000
"""A park-generation chore is acknowledged within this of its publication: the horizon ``H`` (15 min + 120 s), two
scans, and ten minutes for the agent's backoff after a fault (the calm phase waits for it)."""
FAILPOINT_P = 0.01
DISK_LOST_P = 0.5
TERMINATED_P = 0.3
"""Of the lost disks, the share whose machine is gone for good (issue 5 item 1): the platform fences the box and a
replacement under a new label is enrolled in its region (:meth:`MoveWorld.terminate`)."""
TICK_EVERY_S = 600.0
"""The schedule every simulated instance declares in ``timers.json`` (moveprobe's declared schedule, §14.4)."""
RESIDUE_BOUND_S = 3600.0
"""Residue in a left location is retired within the sweep's cadence, a scan and the horizon ``H`` (about 1,400 s in
the production timing); an hour of the calm phase is the bound INV-10 allows it."""
"""Of a box's reboots, the share that lose its disk (issue 5 item 3): every local file of the box is gone."""
_SRC = source_phases.PRODUCTION
MOVE_BOUND_S = (_SRC.prepare_bound_s + 900.0 + _SRC.cut_window_s + _SRC.landing_budget_s + _SRC.release_budget_s
                + 2 * (parking.PRODUCTION.signature_age_ms + 120_000) / 1000 + _SRC.staging_lease_ttl_s)
"""A requested move ends within this (move-liveness, issue 17 item 5): its preparing bound (a move never ready aborts
itself, §7.11), the operator's longest wait before a manual cut, the cut window, the landing budget, a rollback's
release budget, both parks' horizons and the staging lease's TTL: about 2.9 h, inside the calm phase's 6 h."""
LIVELOCK_PASSES = 5
"""Consecutive passes of one host that each use every step and ask to run again at once: a livelock (INV-3, the
calm phase cannot converge). A pass that waits schedules its wake later; a pass that progresses ends its steps."""
OPERATOR = Identity("op", "operator")
FREEZE_P = float(os.environ.get("HOSTMOVE_SIM_FREEZE_P", "0.1"))
"""Of the landings whose probe runs, the share whose target freezes whole (its VM paused) and is declared lost
(§7.10; issue 15), drawn from a stream of its own (:meth:`MoveWorld._maybe_freeze`). 0.1 in the gate;
``HOSTMOVE_SIM_FREEZE_P=0`` switches it off (sim/README.md "Frozen targets")."""


MOVE_REGIONS = ("ie", "uk", "us")
"""The world with moves has three regions, a box each: a move chooses among every region but the one that serves the
host when it is requested, so a host moves on, and back, as often as its plan says (issue 11 item 2)."""
MOVES_PER_HOST = (1, 3)


class TerminatedMachine:
    """The simulated platform after it terminated a box's machine: the compute port shows it ``terminated``."""

    async def observe(self, box: BoxCompute) -> ComputeObservation:
        return ComputeObservation("terminated", box.label, f"the machine of box {box.label} was terminated")

    async def stop(self, box: BoxCompute) -> ComputeObservation:
        return await self.observe(box)


@dataclass(frozen=True)
class MovePlan:
    host: str
    nth: int  # the host's nth move (0, 1, ...): requested once the one before it ended
    at: float  # not before then
    cut: str  # "auto" or "manual"
    cut_at: float  # a manual cut's time
    abort_at: float | None = None  # the operator aborts then (§7.11: legal until the cut is admitted)
    fail_target: str = ""  # the app fails its readiness on the target, "before-write" or "after-write" (§14.4)


@dataclass(frozen=True)
class WritePlan:
    host: str
    at: float


def draw_moves(plan: FaultPlan, workload: Workload, timing: Timing) -> tuple[tuple[MovePlan, ...], tuple[WritePlan,
                                                                                                          ...]]:
    """Each host moves one to three times, each move requested once the one before it ended, to a region other than
    the one serving it then (automatic or manual cut; the operator tries to abort one in five), and takes writes
    throughout, and up to two late ones in the calm phase, when it has likely fallen asleep (the router's wake, issue 5
    item 4)."""
    moves = []
    writes = []
    for h in workload.hosts:
        if plan.chance("moves.host_moves", 0.85):
            at = h.at
            for nth in range(plan.randint("moves.per_host", *MOVES_PER_HOST)):
                at += plan.uniform("moves.request_after", 120, timing.chaos_s / 2)
                cut = "manual" if plan.chance("moves.manual_cut", 0.3) else "auto"
                abort_at = plan.uniform("moves.abort_after", 1, 900) if plan.chance("moves.abort", 0.2) else None
                fail = "" if not plan.chance("moves.fail_target", 0.2) else (  # a rollback after the flip (§7.8)
                    "after-write" if plan.chance("moves.fail_after_write", 0.7) else "before-write")
                moves.append(MovePlan(h.host, nth, at, cut, plan.uniform("moves.cut_after", 30, 900), abort_at, fail))
        for _ in range(plan.randint("moves.writes", 3, 12)):
            writes.append(WritePlan(h.host, plan.uniform("moves.write_at", h.at, timing.chaos_s + 600)))
        for _ in range(plan.randint("moves.late_writes", 0, 2)):
            writes.append(WritePlan(h.host, plan.uniform("moves.late_write_at", timing.chaos_s + 600,
                                                         timing.chaos_s + 3600)))
    writes.sort(key=lambda w: (w.at, w.host))
    return tuple(moves), tuple(writes)


def abandon(replicator: Any) -> None:
    """What the death of the process does to a replicator (the simulation's agent crash, which kills no process):
    its read transactions end, so no read mark of the dead writer pins the WAL against the next stop's
    ``TRUNCATE``, and it is closed for every later call. The connections are left open: closing the last one
    would checkpoint the WAL into the database, which a killed process never does. It lives here, not on
    :class:`~services.box.replica.replicator.Replicator`, because only the simulation models a death in-process."""
    replicator._closed = True
    replicator._end_reads()


class MoveBox(ActorBase):
    """One box's agent process: the production agent, driven as ``BoxAgent.run`` drives it (module docstring)."""

    def __init__(self, world: MoveWorld, label: str, region: str, incarnation: int) -> None:
        super().__init__(world, label, incarnation)
        self.mworld = world
        self.label = label
        self.region = region
        self.clock = world.actor_clock(label)
        self.store = world.s3.client(Principal("box", label, region), self.clock)
        self.events = SimEventLog(world.js, label, fates=world.plan)
        actor = Actor(service="box", pid=3000 + incarnation, nonce=world.plan.token(f"nonce.{label}", 8).hex(),
                      box=label)
        self.ledger = Ledger(self.store, self.events, self.clock, actor, DEPLOY, faults=world.ledger_faults(label))
        self.tree = world.trees[label]
        cfg = BoxConfig(root=world.root, label=label, region=region, box_dir=world.root / "boxes" / label)
        self.agent = ProductionAgent(cfg, store=self.store, bucket=DEPLOY, events=self.events, ledger=self.ledger,
                                     clock=self.clock, rng=PlanRandom(world.plan, f"rng.{label}"), tree=self.tree,
                                     probe_factory=self.probe_factory, timing=AGENT_TIMING,
                                     faults=world.failpoints(label), app=SIM_APP,
                                     rates=PlanRates.of(world.plan, MOVE_REGIONS).rates)
        self.agent.activator.policy = StartPolicy(sync_interval_s=AGENT_TIMING.sync_interval_s)
        self.due: dict[str, float] = {}
        self.spins: dict[str, int] = {}  # host -> consecutive passes that spun
        self.pool: PassPool | None = None
        self.kick = self.agent.wakeup
        """The loop's wake, the agent's own (``BoxAgent.wakeup``): a notice, a demand, or a pass ended."""

    @property  # type: ignore[override]
    def idle(self) -> bool:
        """Waiting for work with nothing half done: the loop waits and no pass runs or is owed (the world's rest)."""
        return self._waiting and (self.pool is None or self.pool.idle)

    @idle.setter
    def idle(self, waiting: bool) -> None:
        self._waiting = waiting

    async def probe_factory(self, host: str, attempt: int, db_path: Path) -> ProbeApp:
        """The target's probe app: the production :class:`ProcessApp` spawning a sim instance in the tree."""
        port = self.mworld.net.free_port()
        return ProcessApp(argv=["sim-instance"], port=port, host=host, tree=self.tree, ready_path="/ready",
                          env={"SIM_DB": str(db_path), "SIM_PORT": str(port), "SIM_FILES": str(db_path.parent / host),
                               "SIM_FAIL_READY": self.mworld.fail_target(host)},
                          cwd=self.agent.cfg.box_dir)

    async def run(self) -> None:
        async def adopt() -> None:
            for host in await self.agent.activator.adopt_running():
                self.emit(f"stopped {host} found running: a new agent is a new session")

        if self.mworld.declarations:  # BoxAgent.run's first act (§7.10): a box declared lost retires first; with
            # no declaration in the world it finds nothing, and its listing would only shift every seed's schedule
            async def quarantine() -> None:
                from services.box.quarantine import quarantine_on_start

                done = await quarantine_on_start(
                    label=self.label, box_dir=self.agent.cfg.box_dir, stamps=self.agent.stamps,
                    registry=self.agent.registry, timers=self.agent.timers, ledger=self.ledger, clock=self.clock)
                for q in done:
                    self.emit(f"quarantined {q.host}: {q.parked} artifacts parked, row deleted {q.row_deleted}, "
                              f"{q.timers_deleted} timers deleted")

            await self.retrying("quarantine", quarantine)
        await self.retrying("adopt", adopt)
        self.spawn(self.timers(), "timers")
        self.spawn(self.agent.consume(asyncio.Event()), "consumer")  # BoxAgent.run's: the box's work notices
        agent, loop = self.agent, self.world.loop
        pool = self.pool = PassPool(AGENT_TIMING.pass_workers, self.pass_host,
                                    spawn=lambda coro, host: self.spawn(coro, f"pass of {host}"))
        for host in sorted(set(agent.instances) | {r.host for r in agent.registry.rows()}):  # BoxAgent._loop's start
            agent.notify(host)
        next_scan = loop.time() + AGENT_TIMING.scan_s
        while True:
            now = loop.time()
            if now >= next_scan:
                try:
                    for host in sorted(await agent.scan()):
                        agent.notify(host)
                except EXPECTED as exc:
                    self.emit(f"scan failed: {type(exc).__name__}")
                next_scan = loop.time() + AGENT_TIMING.scan_s
            due = {h for h, at in self.due.items() if at <= loop.time()}
            for h in due:
                del self.due[h]
            self.kick.clear()
            pool.submit(due | agent.take_notified())  # concurrent, one pass per host (BoxAgent._pass_loop)
            until = min([next_scan, *self.due.values()])
            self.idle = True
            with contextlib.suppress(TimeoutError):  # a demand alone (a due timer, a wake request) waits for these
                await asyncio.wait_for(self.kick.wait(), max(until - loop.time(), 0.001))
            self.idle = False

    async def timers(self) -> None:
        """``BoxAgent.run``'s timer loop: deliver what is due every tick (§9.4)."""
        while True:
            try:
                await self.agent.run_timers()
            except EXPECTED as exc:
                self.emit(f"timer run failed: {type(exc).__name__}")
            await asyncio.sleep(AGENT_TIMING.timer_tick_s)

    async def retrying(self, what: str, step: Callable[[], Any]) -> None:
        await retry_expected(self.emit, what, step)

    async def pass_host(self, host: str) -> None:
        self.busy += 1
        taken, ok = self.agent.take_notices(host), False  # BoxAgent.pass_one's: acknowledged when it ends well
        try:
            result = await self.agent.pass_host(host)
            ok = True
        except Crash:
            raise
        except Exception as exc:  # noqa: BLE001 - as BoxAgent.run: logged, retried (a pass is idempotent)
            text = str(exc).splitlines()[0][:200] if str(exc) else ""
            if not isinstance(exc, EXPECTED) and not isinstance(exc, OSError | LookupError):
                self.world.checker.flag("actor-error", f"{self.label}: pass of {host}: {type(exc).__name__}: {text}")
            self.emit(f"pass of {host} failed: {type(exc).__name__}: {text}")
            self.due[host] = self.world.loop.time() + AGENT_TIMING.retry_s
            await self.agent.settle_notices(host, taken, ok)
            return
        finally:
            self.busy -= 1
            self.kick.set()  # the loop starts what waited for this pass
        await self.agent.settle_notices(host, taken, ok)
        for line in result.did:
            self.emit(f"{host} {line}")
        self.mworld.idle_stops += sum("asleep until" in line for line in result.did)
        spun = len(result.did) >= AGENT_TIMING.max_steps and result.again_in_s == 0.0
        self.spins[host] = self.spins.get(host, 0) + 1 if spun else 0
        if self.spins[host] >= LIVELOCK_PASSES:
            self.world.checker.flag("INV-3", f"livelock: {LIVELOCK_PASSES} passes of {host} on {self.label} in a row "
                                             f"used all {AGENT_TIMING.max_steps} steps and asked to run again at once "
                                             f"({'; '.join(result.did[-1:])})")
        if result.again_in_s is not None:
            at = self.world.loop.time() + result.again_in_s
            self.due[host] = min(self.due.get(host, at), at)

    def kill(self) -> None:
        """Memory lost: the agent's tasks (its passes and its replicators) stop; its instances keep running."""
        if self.pool is not None:  # a pass that crashed the agent starts no other as it ends
            self.pool.close()
        for running in list(self.agent.instances.values()):  # the box's one registry: woken and landed alike
            if running.task is not None:
                running.task.cancel()
            abandon(running.replicator)
            self.mworld.abandoned.append(running.replicator)
        super().kill()
        for closable in (self.agent.registry, self.agent.stamps, self.agent.timers):
            with contextlib.suppress(Exception):
                closable.close()


class MoveConsole(ConsoleActor):
    """The console: hosts, the relay, the recovery pass and the door's requests (module docstring)."""

    def __init__(self, world: MoveWorld, incarnation: int) -> None:
        super().__init__(world, incarnation)
        self.mworld = world
        self.door = Door(self.ledger, clock=self.clock, rng=PlanRandom(world.plan, "rng.door"))
        self.recovery = RecoveryPass(self.ledger, self.events)
        # The operator's memory, not the console's: a console crash loses nothing the operator did.
        self.asked, self.cut, self.aborted = world.asked, world.cut, world.aborted

    async def relay(self) -> None:
        await super().relay()
        try:
            report = await self.recovery.run_once()
        except EXPECTED as exc:
            self.emit(f"recovery pass failed: {type(exc).__name__}: {exc}")
            return
        for line in report.claim_halves + report.records_finished + report.alerts:
            self.emit(f"recovery: {line}")
        await self.moves()

    async def declare_lost(self, host: str, box: str, *, ask_platform: bool = True) -> int:
        """The operator's ``hostmove move resolve --host H --declare-lost BOX --yes``: the platform is asked (the
        compute port's twin), and what it showed goes to the door's own route (services/door/declare.py), which
        refuses unless it is ``stopped`` or ``terminated`` (rule ``declare-lost-compute``). ``ask_platform`` False
        is an operator who takes an unanswering box for a gone one (an expired lease, model 5): the door hears
        ``running``, what the platform would have shown. Answers the door's status."""
        mw = self.mworld
        entry = (await self.door.roster()).box(box)
        if entry is None:
            return 409
        seen = await mw.compute.observe(BoxCompute.of(entry)) if ask_platform else ComputeObservation(
            "running", box, f"box {box} does not answer (its lease expired)")
        mw.declarations += 1
        answer = await declare_lost(self.door, host, DeclareLost(box, seen.status, seen.evidence, True), OPERATOR)
        self.emit(f"door: declare {box} lost for {host} ({seen.status}): {answer.status} "
                  f"{answer.body.get('reason', answer.body.get('message', ''))}")
        return answer.status

    def _startable(self, m: MovePlan) -> str | None:
        """The region ``m`` goes to, once the host's move before it ended and it serves (chosen among every region
        but the serving one); None while it may not be requested yet."""
        if m.nth > 0 and (m.host, m.nth - 1) not in self.asked:
            return None
        record, claim = self.mworld.records.get(m.host), self.mworld.checker.claims.get(m.host)
        if claim is None or claim.op.kind != "serving" or (record is not None and record.move is not None):
            return None
        served = serving_region(claim)
        others = [r for r in MOVE_REGIONS if r != served]
        return self.mworld.plan.choice("moves.to", others) if served is not None else None

    async def moves(self) -> None:
        now = self.world.loop.time()
        for m in self.mworld.moves:
            key = (m.host, m.nth)
            record = self.mworld.records.get(m.host)
            live = record.move.id if record is not None and record.move is not None else None
            bound = self.mworld.move_of
            before = bound.get((m.host, m.nth - 1))
            if live is not None and live not in bound.values() and key not in bound and (
                    key in self.asked or (m.at <= now and (m.nth == 0 or (
                        before is not None and before in self.mworld.ended)))):
                # A live move nobody is bound to is the one requested (its answer lost, or it landed in this very
                # pass: the request of move n + 1 is not made before move n ended, so it is never move n's).
                if key not in self.asked:  # the door took a request whose answer was lost: the status shows it
                    self.asked[key] = now
                    self.mworld.asked_to.setdefault(key, record.move.to if record is not None and record.move
                                                    else "")
                    self.emit(f"operator: move {m.nth + 1} of {m.host} was requested after all ({live})")
                bound[key] = live
            try:
                if m.at <= now and key not in self.asked:
                    to = self._startable(m)
                    if to is None:
                        continue
                    answer = await self.door.request_move(m.host, MoveRequest(to, m.cut), OPERATOR)  # type: ignore[arg-type]
                    self.emit(f"door: move {m.host} to {to} ({m.cut}, move {m.nth + 1}): {answer.status} "
                              f"{answer.body.get('reason', '')}")
                    if answer.status in (200, 201):  # a refusal (409: no box can take it now, ...) is asked again
                        self.asked[key] = now
                        self.mworld.asked_to[key] = to
                if key not in self.asked:
                    continue
                asked_at = self.asked[key]
                shown = self.mworld.records.get(m.host)
                ready_again = shown is not None and shown.move is not None and shown.move.state == "ready"
                # The operator cuts when the status says "Ready to cut", again if a cut went back to ready (§7.4: the
                # admission's checks were stale, T13: the source was down for longer than their freshness window).
                if m.cut == "manual" and asked_at + m.cut_at <= now and (key not in self.cut or ready_again):
                    answer = await self.door.cut(m.host, OPERATOR)
                    self.emit(f"door: cut {m.host}: {answer.status} {answer.body.get('reason', '')}")
                    record = self.mworld.records.get(m.host)
                    if answer.status == 200 or (record is not None and record.move is not None
                                                and record.move.state not in ("preparing", "ready")):
                        self.cut.add(key)
                if m.abort_at is not None and asked_at + m.abort_at <= now and key not in self.aborted:
                    answer = await self.door.abort(m.host, OPERATOR)
                    self.emit(f"door: abort {m.host}: {answer.status} {answer.body.get('reason', '')}")
                    if answer.status in (200, 409):  # 409: past the cut's admission, or already over
                        self.aborted.add(key)
            except (*EXPECTED, Unreadable) as exc:
                self.emit(f"door request for {m.host} failed: {type(exc).__name__}: {exc}")


class MoveEdge(ActorBase):
    """The apps' traffic: each write goes to the box the host's claim names, to the instance that box serves."""

    def __init__(self, world: MoveWorld, incarnation: int) -> None:
        super().__init__(world, "edge", incarnation)
        self.mworld = world

    async def run(self) -> None:
        for n, w in enumerate(self.mworld.writes):
            delay = w.at - self.world.loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            if self.mworld.write(w.host, f"w{n}") == "asleep":
                self.spawn(self.held(w.host, f"w{n}"), f"held w{n}")

    async def held(self, host: str, value: str) -> None:
        """The router holds a request to a sleeping host while its box wakes it, then delivers it."""
        for _ in range(EDGE_RETRIES):
            await asyncio.sleep(EDGE_RETRY_S)
            if self.mworld.write(host, value, retry=True) != "asleep":
                return


@dataclass
class MoveWorld(World):
    """One deployment with moves (see the module docstring)."""

    moves: tuple[MovePlan, ...] = ()
    writes: tuple[WritePlan, ...] = ()
    root: Path = Path("hostmove-sim")
    """The boxes' directories, relative to the run's own temporary working directory (see :meth:`ports`): every
    path a service writes into a durable object (the stop evidence names the lease file) is the same in every run
    of a seed."""

    early_actors: ClassVar[bool] = False

    def prepare(self) -> None:
        self.workdir: Path | None = None
        self.previous_cwd = ""
        self.previous_tempdir: str | None = None
        self.net = SimNet()
        self.acks: list[Ack] = []
        self.lost: set[tuple[str, str, int]] = set()  # (host, box, session) declared lost by an admission
        self.records: dict[str, Record] = {}
        self._pids = iter(range(40000, 10**9))
        self.trees = {label: self._tree(label) for label in sorted(self.boxes)}
        self.instances: dict[int, Proc] = {}
        self.s3.observers.append(self._landed)
        self.protocol = ProtocolCheck()
        self._reported = 0
        self.js.observers.append(self._audit)
        self.s3.policy = M17Policy(DEPLOY, {r: region_bucket(r) for r in MOVE_REGIONS})
        self.unprovisioned: set[str] = set()  # boxes whose disk was lost, not provisioned again yet
        self.stopped: set[str] = set()  # boxes the platform stopped (sim/twins/compute.py), not started again yet
        self.compute = SimCompute(self)
        self.declarations = 0  # the operator's declare-lost requests
        self.freezes = 0  # targets frozen whole mid-move (:meth:`_maybe_freeze`)
        self.freeze_seen: set[str] = set()
        self.freeze_rng = random.Random(f"freeze:{self.plan.seed}")
        self.readmissions = 0  # the operator's readmissions of a quarantined box (:meth:`_readmit`), one per host
        self.reboots = 0
        self.net.on_timer = self._timer_delivered
        self.timer_runs: dict[tuple[str, str, int], list[tuple[str, float]]] = {}  # due -> (box, at) deliveries
        self.timer_last: dict[str, tuple[float, str]] = {}  # host -> (at, box) of its latest delivery
        self.timer_repeats = 0
        self.agent_deaths: dict[str, list[float]] = {}
        self.residue_seen: dict[tuple[str, str, str], float] = {}  # (host, region, prefix) -> first seen at rest
        self.disks_lost = 0
        self.provisioning: set[str] = set()
        self.idle_stops = 0
        self.wake_requests = 0
        self.terminations = 0
        self.abandoned: list[Any] = []
        self.asked: dict[tuple[str, int], float] = {}
        """The operator's requests, (host, nth move) -> when the door took it; with the cuts and aborts they made."""
        self.cut: set[tuple[str, int]] = set()
        self.aborted: set[tuple[str, int]] = set()
        self.ended: dict[str, str] = {}  # move id -> outcome, every move that ended
        self.verdicts: dict[str, str] = {}  # rollback id -> its release's verdict, clean or dirty (§7.8)
        self.chores_seen: dict[str, set[tuple[str, str, str]]] = {}  # the park-generation chores each claim holds
        self.generations_retired = 0  # park-generation chores acknowledged (issue 16)
        self.move_of: dict[tuple[str, int], str] = {}  # (host, nth) -> the move id the status showed for it
        self.asked_to: dict[tuple[str, int], str] = {}  # (host, nth) -> the region the operator asked it to move to
        self.slow_region = slow_region(self.plan.seed, MOVE_REGIONS)
        """The region whose cross-region path the seed makes slow (:mod:`sim.twins.rates`): T11 refuses every move
        into it, so such a move aborts itself at its prepare bound, by design (move-liveness excuses it)."""
        self.closed_at: dict[str, float] = {}  # move id -> when its record closed it (last_move)
        self.calm_at: float | None = 0.0 if self.witness else None  # a witness's world is healthy throughout
        self.crashes_at: list[float] = []  # every actor death (an agent, a box, the console), scripted or drawn
        self.late: set[tuple[str, int]] = set()  # the moves move-liveness has reported
        """The replicators of dead agents, kept referenced until the run ends: a garbage-collected SQLite connection
        closes, and the last one to close checkpoints the WAL into the database, at a moment the collector picks (it
        depends on what the process ran before). That made a seed's trace depend on the seeds run before it in the
        same process (a restarted agent found the WAL empty, or not); a killed process never checkpoints."""

    def _tree(self, label: str) -> SimTree:
        return SimTree(label, self.net, lambda: next(self._pids), self._writer_session, self._instance_started,
                       self._instance_stopped)

    def box_factory(self, label: str, region: str) -> Callable[[int], Any]:
        return functools.partial(MoveBox, self, label, region)

    def console_factory(self) -> Callable[[int], Any]:
        return functools.partial(MoveConsole, self)

    def edge_factory(self) -> Callable[[int], Any]:
        return functools.partial(MoveEdge, self)

    def failpoints(self, label: str) -> Callable[[str], None]:
        def hook(point: str) -> None:
            if self.plan.fault(f"failpoint.{point}", FAILPOINT_P):
                self.trace.emit(label, f"crash at failpoint {point}")
                raise Crash(point)

        return hook

    async def setup(self) -> None:
        asyncio.ensure_future(self._watch_moves())
        for bucket in (DEPLOY, *(region_bucket(r) for r in MOVE_REGIONS)):
            await self.s3.create_bucket(bucket)
        clock = self.clock
        events = SimEventLog(self.js, "init")  # set-up happens before the run: nothing fails
        for label, region in sorted(self.boxes.items()):
            store = self.s3.client(Principal("box", label, region), clock, fates=NOMINAL)
            await init_box(root=self.root, label=label, region=region, store=store, bucket=DEPLOY, events=events,
                           clock=clock, actor=Actor(service="box-init", pid=1, nonce="init", box=label))

    # -- the instances ------------------------------------------------------------------------------

    def _writer_session(self, host: str) -> int | None:
        claim = self.checker.claims.get(host)
        return claim.holder.session if claim is not None and claim.holder is not None else None

    def fail_target(self, host: str) -> str:
        """The fail switch the plan set for the host's live move on its target (:attr:`MovePlan.fail_target`)."""
        record = self.records.get(host)
        live = record.move.id if record is not None and record.move is not None else None
        key = next((k for k, v in self.move_of.items() if v == live), None)
        return next((m.fail_target for m in self.moves if (m.host, m.nth) == key), "")

    def _instance_started(self, inst: SimInstance) -> None:
        claim = self.checker.claims.get(inst.host)
        gen = claim.holder.generation if claim is not None and claim.holder is not None else ""
        proc = Proc(inst.box, inst.host, inst.writer_session, gen)
        self.instances[inst.pid] = proc
        self.checker.procs.append(proc)
        self.trace.emit(inst.box, f"start {inst.host} pid {inst.pid} session {inst.writer_session}"
                                  + (" (probe)" if inst.probe else ""))
        self.checker.check_writers(inst.host)
        if inst.probe:
            self._maybe_freeze(inst)
        files = inst.db_path.parent / inst.host
        if not files.exists():  # moveprobe's first boot writes its key beside the database (spec §14.4)
            files.mkdir(parents=True, exist_ok=True)
            (files / "instance.key").write_bytes(self.plan.token(f"key.{inst.host}", 16))
        if not (files / "timers.json").exists():  # and declares its schedule (the agent converges it, §9.4)
            (files / "timers.json").write_text(f'{{"schedules": [{{"name": "tick", "every_s": {TICK_EVERY_S}}}]}}')
        if inst.fail_ready == "after-write":  # moveprobe's after-write boot commits a row, acknowledged (§14.4)
            seq = inst.write(f"probe-{inst.pid}", self.clock.now_ms())
            self.acks.append(Ack(inst.host, inst.box, inst.writer_session, inst.app_session, seq, f"probe-{inst.pid}",
                                 self.loop.time()))
            self.trace.emit(inst.box, f"{inst.host} pid {inst.pid} wrote before failing its readiness (seq {seq})")

    def _instance_stopped(self, inst: SimInstance, why: str) -> None:
        proc = self.instances.pop(inst.pid, None)
        if proc is not None:
            self.os_stop(proc, why)

    def box_agent_died(self, label: str) -> None:
        """An agent crash leaves its instances running in their leaves (cgroups outlive the agent); one crash in four
        is the box's reboot: every process of the box dies and a new boot begins (the cgroups are gone; the spawn
        journal says what ran in the boot before, §5.3 joint D3). Half of the reboots lose the disk too: every
        local file of the box (issue 5 item 3), and the box is provisioned again before its agent starts."""
        self.agent_deaths.setdefault(label, []).append(self.loop.time())
        if self.plan.fault("chaos.reboot", 0.25):
            lose_disk = self.plan.fault("chaos.disk_lost", DISK_LOST_P)
            if lose_disk and self._terminable(label) and self.plan.fault("chaos.terminated", TERMINATED_P):
                self.terminate(label)
                return
            self.reboot(label, lose_disk=lose_disk)

    def _terminable(self, label: str) -> bool:
        """A box may be terminated while no operation names it. The conversion of a move whose source is fenced before
        the flip (rule ``fence-converts-moving``, §7.10) is built and witnessed (``wFenceConvertsMoving``), but the
        random world does not terminate a box an operation names yet (a fenced target, item 3, is not driven here);
        a participant that is gone mid-move is the frozen target the operator declares lost (:meth:`_maybe_freeze`)."""
        return not any(c.op.kind != "serving" and label in (c.op.exec, *c.op.participants)
                       for c in self.checker.claims.values())

    def terminate(self, label: str) -> None:
        """The box's machine is gone for good: every process and file of it (a reboot that loses the disk and never
        boots), then the platform fences it and enrolls a replacement in its region under a new label."""
        self.reboot(label, lose_disk=True)
        self.unprovisioned.discard(label)
        self.terminated.add(label)
        self.terminations += 1
        self.trace.emit(label, "terminated: the machine is gone for good")
        asyncio.ensure_future(self._replace(label))

    async def _replace(self, label: str) -> None:
        region = self.boxes[label]
        clock = self.actor_clock("platform")
        # The platform records the fence as it terminates the machine (no faults on its path): a fence the store's
        # chaos delayed by minutes let the door choose the dead box as a move's target meanwhile.
        store = self.s3.client(Principal("console", "platform"), clock, fates=NOMINAL)
        events = SimEventLog(self.js, "platform")
        actor = Actor(service="platform", pid=1, nonce="platform")

        async def fence() -> None:
            await fence_box(store=store, bucket=DEPLOY, events=events, clock=clock, actor=actor, label=label,
                            compute=TerminatedMachine())

        await retry_expected(lambda what: self.trace.emit("platform", what), "fence", fence)
        self.trace.emit("platform", f"fenced {label}")
        await asyncio.sleep(self.plan.uniform("chaos.replacement_after", 60, 1800))
        n = 1 + max(int(b.rsplit("-", 1)[1]) for b in self.boxes if self.boxes[b] == region)
        new = f"{region}-{n}"
        self.boxes[new] = region
        self.trees[new] = self._tree(new)
        self.slots[new] = Slot(new, self.box_factory(new, region))
        self.unprovisioned.add(new)
        self.trace.emit("platform", f"enrolls {new} in {region}, the replacement of {label}")
        self.start(new)

    def reboot(self, label: str, *, lose_disk: bool) -> None:
        """The box's reboot, its agent already dead (see :meth:`box_agent_died`)."""
        tree = self.trees[label]
        for host in sorted(tree.leaves):
            tree.kill(host, "the box rebooted")
        tree.leaves.clear()
        tree.boot += 1
        self.reboots += 1
        if not lose_disk:
            self.trace.emit(label, f"reboot: boot {tree.boot}, every process of the box died, its disk kept")
            return
        shutil.rmtree(self.root / "boxes" / label, ignore_errors=True)
        tree.journal.clear()  # the spawn journal is on the box's disk
        self.disks_lost += 1
        self.unprovisioned.add(label)
        self.trace.emit(label, f"reboot: boot {tree.boot}, every process of the box died, its disk lost")

    def freeze(self, label: str) -> None:
        """The box's VM is frozen whole: its agent, its replicators, its requests and its apps make no progress
        while time moves on (:meth:`sim.loop.SimLoop.freeze`); the edge's writes to it go unanswered."""
        self.loop.freeze(label)  # type: ignore[attr-defined]
        self.trace.emit(label, "frozen: the whole VM stops (agent and apps), time moves on")

    def resume(self, label: str) -> None:
        """The frozen VM resumes: its agent continues where it was frozen, with the clock jumped ahead."""
        self.loop.thaw(label)  # type: ignore[attr-defined]
        self.trace.emit(label, "resumed: the VM runs on from where it was frozen")

    def stop_machine(self, label: str) -> None:
        """The platform stops the box (:class:`sim.twins.compute.SimCompute`): its agent and every process of its
        tree die, frozen or not (a stopped VM never resumes; it boots again), its disk is kept, and nothing starts
        it until :meth:`start_machine`."""
        self.loop.thaw(label)  # type: ignore[attr-defined]  # its tasks take their cancellation at once
        self.stopped.add(label)
        self.agent_deaths.setdefault(label, []).append(self.loop.time())
        slot = self.slots[label]
        if slot.restart_handle is not None:
            slot.restart_handle.cancel()
            slot.restart_handle = None
        if slot.up:
            slot.up = False
            self.crashes_at.append(self.loop.time())
            slot.actor.kill()
        self.trace.emit(label, "stopped by the platform")
        self.reboot(label, lose_disk=False)

    def start_machine(self, label: str) -> Any:
        """The platform starts a stopped box again, with its old disk: a new boot and a new agent."""
        self.stopped.discard(label)
        self.trace.emit(label, "started by the platform")
        return self.start(label)

    def start(self, name: str) -> Any:
        """A box whose disk was lost is provisioned again (``hostmove box init``: its directory, its copy of the
        secrets key, its roster entry refreshed) before its agent starts (the agent refuses a box directory without
        ``box.json``, services/agent/config.py). A terminated box never starts again."""
        if name in self.terminated or name in self.stopped:
            return None
        if name not in self.unprovisioned:
            return super().start(name)
        if name not in self.provisioning:
            self.provisioning.add(name)
            asyncio.ensure_future(self._provision(name))
        return None

    async def _provision(self, label: str) -> None:
        region = self.boxes[label]
        clock = self.actor_clock(label)
        store = self.s3.client(Principal("box", label, region), clock)
        events = SimEventLog(self.js, f"{label}-init", fates=self.plan)

        async def init() -> None:
            await init_box(root=self.root, label=label, region=region, store=store, bucket=DEPLOY, events=events,
                           clock=clock, actor=Actor(service="box-init", pid=1, nonce="init", box=label))

        await retry_expected(lambda what: self.trace.emit(label, what), "box init", init)
        self.trace.emit(label, "box init: provisioned again on its new disk")
        self.unprovisioned.discard(label)
        self.provisioning.discard(label)
        super().start(label)

    def write(self, host: str, value: str, *, retry: bool = False) -> str:
        """One write from the app's users: to the box the claim names, to the instance it serves. Answers
        ``acknowledged``, ``asleep`` (nothing serves it on its box: the box was asked to wake it, a router's wake)
        or ``dropped``."""
        claim = self.checker.claims.get(host)
        again = " (held)" if retry else ""
        if claim is None or claim.op.exec in ("", "none") or claim.op.exec not in self.slots:
            self.trace.emit("edge", f"write {value} to {host}{again}: no box serves it")
            return "dropped"
        box = claim.op.exec
        slot = self.slots[box]
        if box in self.loop.frozen:  # type: ignore[attr-defined]
            self.trace.emit("edge", f"write {value} to {host}{again}: {box} does not answer (frozen)")
            return "dropped"
        if not slot.up:
            self.trace.emit("edge", f"write {value} to {host}{again}: {box} is down")
            return "dropped"
        endpoint = slot.actor.agent._endpoint(host)
        inst = self.net.listening.get(endpoint[0]) if endpoint is not None else None
        if inst is None or not inst.alive:
            slept = slot.actor.agent.sleep.asleep(host)
            slot.actor.agent.demand(host)
            self.wake_requests += 1
            self.trace.emit("edge", f"write {value} to {host}{again}: nothing serves it on {box}; asked it to wake"
                                    + (" (asleep)" if slept else ""))
            return "asleep"
        record = self.records.get(host)
        move = record.move if record is not None else None
        if move is not None and move.committed_at is None and claim.op.participants[-1:] == (box,) \
                and len(claim.op.participants) == 2:
            self.checker.flag("INV-5", f"a write to {host} reached its move's target {box} before the commit")
        seq = inst.write(value, self.clock.now_ms())
        self.acks.append(Ack(host, box, inst.writer_session, inst.app_session, seq, value, self.loop.time()))
        self.trace.emit("edge", f"write {value} to {host}{again} on {box}: acknowledged seq {seq}")
        return "acknowledged"

    # -- what the checker adds for moves ------------------------------------------------------------

    def _landed(self, w: Landed) -> None:
        if w.bucket != DEPLOY or w.body is None or not w.key.endswith(".json"):
            return
        try:
            if w.key.startswith("control/hosts/"):
                claim = decode(w.body, Claim)
                chores = {(o.op, o.region, o.generation) for o in claim.obligations if o.kind == "park-generation"}
                self.generations_retired += len(self.chores_seen.get(claim.host, set()) - chores)
                self.chores_seen[claim.host] = chores
                if claim.holder is not None:
                    for a in claim.holder.admissions:
                        named = [(r.box, r.session) for r in (a.writes_lost, *a.additional_writes_lost) if r]
                        if len(named) != len(set(named)):  # unique by (box, session): one alert each (INV-21)
                            self.checker.flag("INV-21", f"the admission of session {a.session} of {claim.host} "
                                                        f"declares a writer session twice: {named}")
                        for ref in (a.writes_lost, *a.additional_writes_lost):
                            if ref is not None:
                                self.lost.add((claim.host, ref.box, ref.session))
            elif w.key.startswith("control/records/"):
                record = decode(w.body, Record)
                self.records[record.host] = record
                if record.last_move is not None:
                    self.ended[record.last_move.id] = record.last_move.outcome
                    if record.last_move.id not in self.closed_at and record.last_move.outcome == "rolled_back":
                        context = contextvars.copy_context()  # the world's own check: no box's freeze holds it
                        context.run(OWNER.set, "")
                        self.loop.create_task(self._lane_at_close(record.host, record.last_move.id), context=context)
                    self.closed_at.setdefault(record.last_move.id, self.loop.time())
                rb = record.move.rollback if record.move is not None else None
                if rb is not None and rb.target_phase == "released":  # the target's verdict (§7.8)
                    self.verdicts[rb.id] = "dirty" if rb.dirty else "clean"
                move = record.move
                if move is not None and move.committed_at is not None and move.cut_deadline is not None \
                        and move.committed_at > move.cut_deadline:
                    self.checker.flag("INV-9", f"move {move.id} of {record.host} committed at {move.committed_at}, "
                                               f"after its cut_deadline {move.cut_deadline}")
        except DurableValueError:
            return  # the base checker reports it

    def _audit(self, stream: str, msg: Any) -> None:
        """The protocol audit over the stream as it grows (issue 4 item 9): an immediate finding is a violation."""
        if stream != LEDGER_STREAM:
            return
        try:
            parse_ledger_subject(msg.subject)
            event = decode(msg.data, Transition)
        except (SubjectError, DurableValueError):
            return  # the base checker reports it
        with contextlib.suppress(ValueError):  # out of order: the base checker reports the history
            self.protocol.feed(event, msg.seq)
        found = self.protocol._findings  # the immediate findings; held checks are judged at the end
        for f in found[self._reported:]:
            if f.severity == "error":
                self.checker.flag("protocol", f"{f.host}: {f.what}")
        self._reported = len(found)

    def unmet(self) -> list[str]:
        out: list[str] = []
        for name in sorted(self.slots):
            slot = self.slots[name]
            if name in ("edge", "chaos") or name in self.terminated or name in self.stopped:
                continue
            if not slot.up:
                out.append(f"{name} is down")
            elif not slot.actor.idle or slot.actor.busy:
                out.append(f"{name} is busy")
        waiting = [m for m in self.moves if (m.host, m.nth) not in self.asked]
        if waiting:  # the operator still has moves to request: the world is not at rest (the oracle would race them)
            out.append(f"{len(waiting)} planned moves are not requested yet (first: move {waiting[0].nth + 1} of "
                       f"{waiting[0].host})")
        for plan in self.workload.hosts:
            claim = self.checker.claims.get(plan.host)
            if claim is None or claim.holder is None or claim.op.kind != "serving":
                out.append(f"{plan.host} is not serving ({claim.op.kind if claim else 'no claim'})")
                continue
            record = self.records.get(plan.host)
            if record is not None and record.move is not None:
                out.append(f"the move {record.move.id} of {plan.host} is still {record.move.state}")
            # issue 16: a dead generation's chore is acknowledged once its horizon passed; one queued by a later wake
            # may pend (a host that wakes more often than H always has one), an overdue one may not
            now = self.clock.now_ms()
            overdue = [o for o in claim.obligations if o.kind == "park-generation" and o.scope is not None
                       and (o.scope.evidence_at or 0) + CHORE_DUE_MS < now]
            if overdue:
                out.append(f"{len(overdue)} park-generation chores of {plan.host} are overdue")
            current = normalize(claim.holder.generation)
            owed = [a for a in claim.holder.admissions if not a.covered and a.predecessor is not None
                    and a.predecessor_region and normalize(a.predecessor.generation) != current]
            if owed:  # every predecessor that is not live any more is covered at rest (publication, parks)
                out.append(f"{len(owed)} admission records of {plan.host} are not covered")
            holder = claim.holder
            if not any(p.box == claim.op.exec and p.session == holder.session
                       for p in self.checker.procs if p.host == plan.host) and not self._asleep(plan.host, claim):
                out.append(f"{plan.host} is not running on {claim.op.exec} as session {holder.session}")
        out += self._residue()
        if not self.s3.idle():
            out.append(f"{len(self.s3.inflight)} object-store requests in flight, {self.s3.paused} callers paused")
        for (obj, host), (gen, _body) in sorted(self.checker.current.items()):
            if self.checker.stream_last.get((obj, host), 0) != gen:
                out.append(f"gen {gen} of the {obj} of {host} is not on the stream")
        return out

    # -- the liveness of a sequence of moves (issue 17 item 5) ---------------------------------------

    async def calm(self) -> None:
        await super().calm()
        self.calm_at = self.loop.time()

    def crash(self, name: str, why: str) -> None:
        if name in self.loop.frozen:  # type: ignore[attr-defined]  # a frozen VM runs nothing, not even its crash
            self.trace.emit(name, f"no crash ({why}): its VM is frozen")
            return
        if self.slots[name].up:
            self.crashes_at.append(self.loop.time())
        super().crash(name, why)

    # -- a target frozen whole mid-move, declared lost (§7.10; issue 15) ------------------------------

    def _maybe_freeze(self, inst: SimInstance) -> None:
        """One landing probe in :data:`FREEZE_P` freezes its target whole a few seconds after it starts (after the
        flip, before the commit: model 5's targeted freeze), drawn from a stream of its own so that no other draw
        or interleaving of a seed without a freeze moves. The operator then declares it lost (:meth:`_lost_target`)."""
        record = self.records.get(inst.host)
        move = record.move if record is not None else None
        if self.witness or move is None or move.committed_at is not None or move.id in self.freeze_seen:
            return
        self.freeze_seen.add(move.id)
        if self.freeze_rng.random() < FREEZE_P:
            self.spawn_world(self._lost_target(inst.host, inst.box, move.id, self.freeze_rng), f"lost {inst.box}")

    def spawn_world(self, coro: Any, what: str) -> None:
        """A task of the world's own (the platform, the operator's script): no box's freeze holds it."""
        context = contextvars.copy_context()
        context.run(OWNER.set, "")
        self.loop.create_task(self._world_task(coro, what), context=context)

    async def _world_task(self, coro: Any, what: str) -> None:
        try:
            await coro
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - a defect of the world's script, reported
            self.checker.flag("actor-error", f"{what}: {type(exc).__name__}: {exc}")

    async def _lost_target(self, host: str, box: str, move_id: str, rng: random.Random) -> None:
        """The frozen target's story: the operator notices it after a while; half the time it first declares it
        lost on its unanswering alone (the door refuses: the platform does not show it stopped, rule
        ``declare-lost-compute``), then has the platform stop it and declares it lost through the door (retried on
        an outage; a refusal that the move moved on ends it); later the platform starts it again with its old disk
        (it quarantines), or, when nobody stopped it, the VM resumes where it was frozen."""
        await asyncio.sleep(rng.uniform(0.5, 20.0))
        record = self.records.get(host)
        move = record.move if record is not None else None
        if move is None or move.id != move_id or move.committed_at is not None or not self.slots[box].up \
                or box in self.stopped:
            return
        self.freezes += 1
        self.freeze(box)
        self.crashes_at.append(self.loop.time())
        await asyncio.sleep(rng.uniform(300.0, 1800.0))
        naive = rng.random() < 0.5
        for _attempt in range(20):
            console = self.slots["console"].actor if self.slots["console"].up else None
            if not isinstance(console, MoveConsole):
                await asyncio.sleep(60.0)
                continue
            try:
                if naive:
                    naive = False
                    if await console.declare_lost(host, box, ask_platform=False) == 200:
                        break
                entry = (await console.door.roster()).box(box)
                if entry is None:
                    break
                await self.compute.stop(BoxCompute.of(entry))
                status = await console.declare_lost(host, box)
            except (*EXPECTED, Unreadable) as exc:
                self.trace.emit("operator", f"declare {box} lost failed: {type(exc).__name__}: {exc}")
                await asyncio.sleep(60.0)
                continue
            if status in (200, 409):  # taken, or refused for good (the move committed or rolled back meanwhile)
                break
            await asyncio.sleep(60.0)
        await asyncio.sleep(rng.uniform(600.0, 3600.0))
        if box in self.stopped:
            self.start_machine(box)
            await self._readmit(box, rng)
        else:
            self.resume(box)

    async def _readmit(self, box: str, rng: random.Random) -> None:
        """The operator, told by the quarantine's warning, readmits the box it started again (§7.10 "A returning box
        is quarantined", claim §7.2: only then can an operator readmit it): ``hostmove box readmit --label``'s own
        claim CASes (:func:`services.box.quarantine.readmit`), refused while the box has not retired its state of a
        host or an operation of the host names it, and asked again until no host lists it lost. Without it the one
        box of its region stays ineligible for that host for good (a planned move there never requested: INV-3)."""
        from services.box.quarantine import readmit

        clock = self.actor_clock("operator")
        store = self.s3.client(Principal("console", "operator"), clock, fates=NOMINAL)  # the operator's CLI
        ledger = Ledger(store, SimEventLog(self.js, "operator"), clock,
                        Actor(service="cli", pid=1, nonce="operator"), DEPLOY)
        await asyncio.sleep(rng.uniform(300.0, 1800.0))
        for _attempt in range(40):
            if box in self.stopped:  # stopped again meanwhile (a later move froze it): that story readmits it
                return
            try:
                done = await readmit(ledger, box)
            except (*EXPECTED, Unreadable) as exc:
                self.trace.emit("operator", f"readmit {box} failed: {type(exc).__name__}: {exc}")
            else:
                self.trace.emit("operator", f"readmit {box}: readmitted for {list(done.readmitted)}, refused "
                                            f"{list(done.refused)}")
                self.readmissions += len(done.readmitted)
                if not done.refused:
                    return
            await asyncio.sleep(300.0)

    async def _watch_moves(self) -> None:
        while True:
            await asyncio.sleep(60.0)
            self._move_liveness()

    def _move_liveness(self) -> None:
        """move-liveness: every move the operator requested ends within :data:`MOVE_BOUND_S` of its request, or of
        the calm phase's start when it was requested before; and a move requested on a healthy world (in the calm
        phase, where no fault fires, or in a witness's world), with no actor crash between its request and its end
        and neither an abort nor a failing target in its plan, ends ``done``. The defect it exists for: a second move
        off a box the host had landed on stalled in preparing, and each host moved once."""
        now = self.loop.time()
        for key, asked_at in sorted(self.asked.items()):
            if key in self.late:
                continue
            host, nth = key
            mid = self.move_of.get(key)
            plan = next((m for m in self.moves if (m.host, m.nth) == key), None)
            outcome = self.ended.get(mid) if mid is not None else None
            name = f"move {nth + 1} of {host}" + (f" ({mid})" if mid is not None else "")
            if outcome is not None:
                end = self.closed_at.get(mid, now) if mid is not None else now
                healthy = self.calm_at is not None and asked_at >= self.calm_at
                crashed = any(asked_at <= t <= end for t in self.crashes_at)
                excused = key in self.aborted or (plan is not None and (plan.abort_at is not None
                                                                        or bool(plan.fail_target))) or (
                    outcome == "aborted" and self.slow_region is not None
                    and self.asked_to.get(key) == self.slow_region)  # T11 refused it: the seed's slow path
                if outcome != "done" and healthy and not crashed and not excused:
                    self.late.add(key)
                    self.checker.flag("move-liveness", f"{name}, requested at {asked_at:.0f} s on a healthy world "
                                                       f"(no fault, no crash, no abort), ended {outcome}")
                continue
            if self.calm_at is None:
                continue  # the chaos phase: no bound yet
            since = max(asked_at, self.calm_at)
            if now - since > MOVE_BOUND_S:
                record = self.records.get(host)
                state = record.move.state if record is not None and record.move is not None else "not started"
                self.late.add(key)
                self.checker.flag("move-liveness", f"{name}, requested at {asked_at:.0f} s, has not ended "
                                                   f"{now - since:.0f} s later (bound {MOVE_BOUND_S:.0f} s): it is "
                                                   f"{state}")

    async def final_oracle(self) -> None:
        self._move_liveness()
        if self.checker.violations:
            return
        await super().final_oracle()
        self._protocol()
        self._quarantined()
        await self._inv10()
        self._bounded()
        # Replication is asynchronous (§5.1): a write is acknowledged after its local commit and uploaded by the
        # next sync. Two sync intervals after quiescence every serving replicator has synced what it acknowledged
        # before it; the edge keeps writing, and its last writes are the serving form's alone.
        # A host woken meanwhile (a write or a timer) is admitted into a fresh generation whose first upload may still
        # be on its way: its cold form waits for the next run; its serving form is checked below.
        before = {h: c.holder.generation for h, c in self.checker.claims.items() if c.holder is not None}
        await asyncio.sleep(2 * AGENT_TIMING.sync_interval_s)
        await self._inv2_cold(uploaded_by=self.loop.time() - 2 * AGENT_TIMING.sync_interval_s,  # the stronger form
                              generations=before)
        self._inv2()  # first: the first violation ends the run
        if not self.checker.violations:
            await self._timers_run()

    def _quarantined(self) -> None:
        """§7.10 (rule ``lost-quarantine``): a box declared lost for a host that runs again keeps no local state of
        that host (no unparked artifact, no route row, no timer): it retired it before anything else. Local residue
        of a host the box no longer serves (INV-10's local form)."""
        for host, claim in sorted(self.checker.claims.items()):
            for lost in claim.lost:
                slot = self.slots.get(lost.box)
                if slot is None or not slot.up or lost.box in self.terminated:
                    continue
                agent = slot.actor.agent
                kept = [f"artifacts of {inc}" for inc in agent.stamps.incarnations(host)
                        if agent.stamps.artifacts(host, inc)]
                kept += ["its route row"] if agent.registry.get(host) is not None else []
                kept += [f"{n} timers"] if (n := len(agent.timers.list(host))) else []
                if kept:
                    self.checker.flag("INV-10", f"{lost.box}, declared lost for {host}, runs again and keeps its "
                                                f"local state of it: {', '.join(kept)}")

    def _bounded(self) -> None:
        """Bounded storage at quiescence (issue 16): every dead generation's chore has run (the calm phase waits for
        it), and ``holder.admissions`` holds at most eight records unless an uncovered one stops the trimming."""
        for plan in self.workload.hosts:
            claim = self.checker.claims.get(plan.host)
            if claim is None or claim.holder is None:
                continue
            admissions = claim.holder.admissions
            if len(admissions) > 8 and admissions[0].covered:
                self.checker.flag("bounded", f"{plan.host} keeps {len(admissions)} admission records, the first "
                                             "covered")

    def _protocol(self) -> None:
        for f in self.protocol.findings:  # now the held checks too
            if f.severity == "error":
                self.checker.flag("protocol", f"{f.host}: {f.what}")

    def _timer_delivered(self, inst: SimInstance, body: Mapping[str, Any]) -> None:
        """A timer's due time runs once (§9.4): a second delivery of one due, on any box, is allowed only after the
        agent of the box that delivered it died (delivery is at least once: the runner may die between the app's
        answer and its own bookkeeping); otherwise two runners delivered it, which is INV-1 for timers."""
        now = self.loop.time()
        key = (inst.host, str(body.get("name", "")), int(body.get("due_at_ms", 0)))
        earlier = self.timer_runs.setdefault(key, [])
        for box, at in earlier:
            if not any(died >= at for died in self.agent_deaths.get(box, [])):
                self.checker.flag("INV-1", f"the timer {key[1]} of {inst.host} due at {key[2]} ran on {inst.box} "
                                           f"after {box} ran it at {at:.0f} s, and {box}'s agent never died between")
        self.timer_repeats += bool(earlier)
        earlier.append((inst.box, now))
        self.timer_last[inst.host] = (now, inst.box)
        self.trace.emit(inst.box, f"timer {key[1]} of {inst.host} due {key[2]} delivered to pid {inst.pid}")

    async def _timers_run(self) -> None:
        """Liveness of the timers: within one period, two runner ticks and two scans, every serving host's schedule
        runs on the box that serves it (its timers moved with it, §9.4), a sleeping host woken by its due time."""
        since = self.loop.time()
        within = TICK_EVERY_S + 2 * AGENT_TIMING.timer_tick_s + 2 * AGENT_TIMING.scan_s  # a sleeper is woken first
        await asyncio.sleep(within)
        for plan in self.workload.hosts:
            claim = self.checker.claims.get(plan.host)
            if claim is None or claim.holder is None or claim.op.kind != "serving":
                continue
            at, box = self.timer_last.get(plan.host, (-1.0, ""))
            if at < since or box != claim.op.exec:
                self.checker.flag("INV-3", f"the timer of {plan.host} did not run on {claim.op.exec} within "
                                           f"{within:.0f} s of quiescence "
                                           f"(last: {'never' if at < 0 else f'{box} at {at:.0f} s'})")

    def _runs(self, host: str, box: str, session: int | None = None) -> bool:
        """A live instance of ``host`` on ``box`` (of writer ``session``, if given)."""
        return any(p.box == box and p.host == host and (session is None or p.session == session)
                   for p in self.instances.values())

    def _asleep(self, host: str, claim: Claim) -> bool:
        """The host sleeps on the box that serves it: marked asleep there, and nothing of it runs there."""
        return SleepMarks(self.root / "boxes" / claim.op.exec).asleep(host) and not self._runs(host, claim.op.exec)

    def _residue(self) -> list[str]:
        """INV-10 for what lands late or what a lost box left (§6.4 the straggler sweep): a host at rest has nothing
        current in its location of a region it is not served in, and no staging lane ``moves/<host>/<op>/`` in any
        region (rule ``sweep-staging``: a lost target's forward lane is its region's at-rest sweep's, §7.10
        ``left_in_region``, not its move's close). The calm phase waits for the sweep to retire it; residue the
        calm phase has seen for longer than :data:`RESIDUE_BOUND_S` of the host's rest (an operation suppresses the
        sweep) while its region has a live box (the sweep's runner) is a violation (the sweep's bounded liveness)."""
        out = []
        for plan in self.workload.hosts:
            claim = self.checker.claims.get(plan.host)
            served = serving_region(claim) if claim is not None else None
            if claim is None or claim.holder is None or claim.op.kind != "serving" or served is None:
                # an operation suppresses the sweep (§6.4): the bound counts the host's time at rest only
                self.residue_seen = {k: t for k, t in self.residue_seen.items() if k[0] != plan.host}
                continue
            for region in MOVE_REGIONS:
                location = claim.holder.location.rstrip("/") + "/"
                lanes = staging_prefix(plan.host, "").rstrip("/") + "/"
                found = [(location, "a location", self.s3.current_keys(region_bucket(region), location)
                          if region != served else []),
                         (lanes, "staging lanes", self.s3.current_keys(region_bucket(region), lanes))]
                for prefix, what, left in found:
                    if not left:
                        self.residue_seen.pop((plan.host, region, prefix), None)
                        continue
                    line = (f"{len(left)} objects left in {region_bucket(region)}/{prefix}, {what} {plan.host} left "
                            f"(first {left[0]})")
                    out.append(line)
                    if not self._live_in(region):  # nothing runs the sweep there yet: the bound has not started
                        self.residue_seen.pop((plan.host, region, prefix), None)
                        continue
                    seen = self.residue_seen.setdefault((plan.host, region, prefix), self.loop.time())
                    if self.loop.time() - seen > RESIDUE_BOUND_S:
                        self.checker.flag("INV-10", f"{line}, for {self.loop.time() - seen:.0f} s of the calm phase")
        return out

    def _live_in(self, region: str) -> bool:
        """A box of ``region`` runs (up, not stopped, not frozen): the region's at-rest sweep can run."""
        return any(r == region and self.slots[b].up and b not in self.stopped and b not in self.terminated
                   and b not in self.loop.frozen for b, r in self.boxes.items())  # type: ignore[attr-defined]

    async def _lane_at_close(self, host: str, move_id: str) -> None:
        """INV-10 at a rollback's close (§7.8, model 27): the record closes only once its parks are acknowledged
        (``record-first-close``), so the return lane ``moves/<host>/<rb>/`` holds no version then, but for a request
        still in flight (a straggler, the at-rest sweep's). A lane nobody owed a park for (a target declared lost
        after it released dirty, rule ``lost-return-park``) is still full at the close."""
        prefix = staging_prefix(host, rollback_id(move_id))
        for region in MOVE_REGIONS:
            left = await self.admin.list_versions(region_bucket(region), prefix)
            flying = {r.access.key for r in self.s3.inflight.values()}
            left = [v for v in left if v.key not in flying]
            if left:
                self.checker.flag("INV-10", f"{len(left)} versions under {region_bucket(region)}/{prefix} when move "
                                            f"{move_id} of {host} closed rolled_back: its return lane was never "
                                            f"parked (first {left[0].key})")

    async def _inv10(self) -> None:
        for host, record in sorted(self.records.items()):
            last = record.last_move
            if record.move is not None or last is None:
                continue
            claim = self.checker.claims.get(host)
            serving = claim.op.exec if claim is not None and claim.op.kind == "serving" else None
            for label in sorted(self.boxes):  # a box the host left keeps no live copy of it (§6.4, §7.9 step 3)
                db = instance_dir(self.root / "boxes" / label / "data", host) / f"{host}.db"
                if serving is not None and label != serving and db.exists():
                    self.checker.flag("INV-10", f"{label} keeps a live database of {host} after move {last.id} "
                                                f"closed {last.outcome}; it serves on {serving}")
            prefixes = [staging_prefix(host, last.id)]
            if last.outcome == "rolled_back":  # §7.8: the return lane of a dirty release, in the source's region
                prefixes.append(staging_prefix(host, rollback_id(last.id)))
            if last.outcome == "aborted":  # §7.11: the source retires its own snapshots
                prefixes.append(snapshot_prefix(host, last.id))
            for region in MOVE_REGIONS:
                for prefix in prefixes:
                    left = await self.admin.list_versions(region_bucket(region), prefix)
                    if left:
                        self.checker.flag("INV-10", f"{len(left)} versions left under {region_bucket(region)}/"
                                                    f"{prefix} after move {last.id} of {host} closed {last.outcome} "
                                                    f"(first {left[0].key})")

    def _inv2(self) -> None:
        """INV-2 on the serving box: every acknowledged write is in the database it serves from (or slept with),
        unless an admission declared its session lost. A host between its admission and its start (a timer woke
        it) has no database on the box yet: the cold form checked its generation."""
        for plan in self.workload.hosts:
            claim = self.checker.claims.get(plan.host)
            if claim is None or claim.holder is None:
                continue
            if not self._asleep(plan.host, claim) and not self._runs(plan.host, claim.op.exec, claim.holder.session):
                continue
            db = instance_dir(self.root / "boxes" / claim.op.exec / "data", plan.host) / f"{plan.host}.db"
            self._inv2_rows(plan.host, db, f"the serving database on {claim.op.exec}")

    async def _inv2_cold(self, *, uploaded_by: float, generations: dict[str, str]) -> None:
        """INV-2 on a cold restore from the bucket (issue 5 item 5): at quiescence the serving generation, restored
        with the production restore into a scratch file, holds every acknowledged write not declared lost; what a
        box served but never uploaded is lost with its disk, which is what this form catches. Replication is
        asynchronous (§5.1): writes acknowledged after ``uploaded_by`` (the last two sync intervals; the edge may
        still be writing) are the serving form's to check, not this one's."""
        for plan in self.workload.hosts:
            claim = self.checker.claims.get(plan.host)
            if claim is None or claim.holder is None or claim.op.exec not in self.slots:
                continue
            if generations.get(plan.host) != claim.holder.generation:
                self.trace.emit("checker", f"inv2-cold: {plan.host} admitted into {claim.holder.generation} meanwhile")
                continue
            region = claim.op.exec.rsplit("-", 1)[0]
            scratch = self.root / "inv2-cold" / f"{plan.host}.db"
            scratch.parent.mkdir(parents=True, exist_ok=True)
            try:
                await restore_generation(self.admin, region_bucket(region), claim.holder.location,
                                         claim.holder.generation, scratch)
            except (RestoreRefused, StoreError) as exc:
                self.checker.flag("INV-2", f"the serving generation {claim.holder.generation} of {plan.host} does "
                                           f"not restore from {region_bucket(region)}: {exc}")
                continue
            self._inv2_rows(plan.host, scratch, f"a cold restore of generation {claim.holder.generation}",
                            acked_by=uploaded_by)

    def _inv2_rows(self, host: str, db: Path, where: str, acked_by: float | None = None) -> None:
        rows: dict[int, tuple[str, str]] = {}
        if db.exists():
            conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
            try:
                rows = {seq: (session, value) for seq, session, value in
                        conn.execute("SELECT seq, session, value FROM rows WHERE kind = 'write'")}
            except sqlite3.Error:
                rows = {}
            finally:
                conn.close()
        for ack in self.acks:
            if ack.host != host or rows.get(ack.seq) == (ack.app_session, ack.value):
                continue
            if acked_by is not None and ack.at > acked_by:
                continue
            if ack.writer_session is not None and (ack.host, ack.box, ack.writer_session) in self.lost:
                continue
            self.checker.flag("INV-2", f"the acknowledged write {ack.value} (seq {ack.seq}) of {ack.host} by "
                                       f"{ack.box} session {ack.writer_session} is not in {where}, and no "
                                       "admission declared that session lost")
            break

    def stop(self) -> None:
        super().stop()
        for tree in self.trees.values():
            for host in list(tree.leaves):
                for p in tree.live(host):
                    p.kill()

    @contextlib.contextmanager
    def ports(self) -> Iterator[None]:
        """The simulation's ports for the run's tasks: blocking work inline, ``SystemRandom`` seeded, the
        box-local network answered by :class:`SimNet` (:func:`kernel.ports.simulation`); and the run's own
        temporary working directory (one run at a time per process)."""
        self.workdir = Path(tempfile.mkdtemp(prefix="hostmove-sim-", dir=scratch_dir()))
        self.previous_cwd = os.getcwd()
        os.chdir(self.workdir)  # back in cleanup(): tasks cancelled after the run still write relative to it
        # The production code's own scratch directories (the readiness check's archive round trip) live in the run's
        # directory too: on the machine's disk each one's removal cost milliseconds of a seed (a third of a second).
        (self.workdir / "tmp").mkdir()
        self.previous_tempdir, tempfile.tempdir = tempfile.tempdir, str(self.workdir / "tmp")
        with ports.simulation(PlanRandom(self.plan, "rng.system"), self.net):
            yield

    def extra_counters(self) -> dict[str, int]:
        ended = list(self.ended.values())
        return {"moves_asked": len(self.asked), "moves_done": ended.count("done"),
                "moves_aborted": ended.count("aborted"),
                "moves_rolled_back": ended.count("rolled_back"), "writes_acknowledged": len(self.acks),
                "rollbacks_dirty": list(self.verdicts.values()).count("dirty"),
                "rollbacks_clean": list(self.verdicts.values()).count("clean"),
                "reboots": self.reboots, "disks_lost": self.disks_lost,
                "timer_deliveries": sum(len(v) for v in self.timer_runs.values()), "timer_repeats": self.timer_repeats,
                "idle_stops": self.idle_stops, "wake_requests": self.wake_requests,
                "terminations": self.terminations, "generations_retired": self.generations_retired,
                "targets_frozen": self.freezes, "declared_lost": self.declarations,
                "platform_stops": self.compute.stops, "readmitted": self.readmissions}

    def cleanup(self) -> None:
        self.abandoned.clear()
        if self.workdir is not None:
            os.chdir(self.previous_cwd)
            tempfile.tempdir = self.previous_tempdir
            shutil.rmtree(self.workdir, ignore_errors=True)


def scratch_dir() -> str | None:
    """Where a run's boxes keep their files: memory (``/dev/shm``) where the machine has it. A run's disks are the
    simulation's, lost with their box or kept, never with the machine's power: the real fsyncs of SQLite's commits and
    of every atomic write are a wall-clock cost with nothing to protect (they were a tenth of a seed's time)."""
    shm = Path("/dev/shm")
    return str(shm) if shm.is_dir() and os.access(shm, os.W_OK) else None


def move_world(seed: int, timing: Timing) -> Callable[[asyncio.AbstractEventLoop], World]:
    from sim.workload import draw_workload

    def make(loop: asyncio.AbstractEventLoop) -> World:
        plan = FaultPlan(f"moves:{seed}")
        boxes = {f"{r}-1": r for r in MOVE_REGIONS}
        workload = draw_workload(plan, boxes, timing)
        workload = Workload(workload.hosts, (), False, False, False)
        moves, writes = draw_moves(plan, workload, timing)
        return MoveWorld(seed, plan, timing, loop, workload, boxes=boxes, moves=moves, writes=writes)

    return make




MOVE_MAX_STEPS = 1_500_000


def run_move_seed(seed: int, *, trace: bool = False, mutate: Iterable[str] = (), timing: Timing | None = None,
                  max_steps: int = MOVE_MAX_STEPS) -> Result:
    """One random seed of the world with moves: chaos (crashes, store and bus faults, failpoints), calm, the final
    oracle. Not in the gate yet: most seeds do not converge (see sim/README.md)."""
    from sim.run import DEFAULT_TIMING, execute

    return execute(f"moves:{seed}", move_world(seed, timing or DEFAULT_TIMING), None, trace=trace,
                   mutate=tuple(mutate), max_steps=max_steps)
