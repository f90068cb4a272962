"""A move's work split by box: what the source box does and what the target box does (spec §7.1-§7.9).

A move has two acting boxes (``op.participants``, §7.1 L15). Each box runs only its own side, woken by events
and timers (ARCHITECTURE §2, §5): :class:`SourceRunners` steps the preparing rounds (§7.3), the cut (§7.4) and the
source's park (§7.9 step 3); :class:`TargetRunners` writes the readiness report (§7.3), lands, probes, commits and
opens (§7.6-§7.9 steps 1-2) and parks the staging lane (§7.9 step 4). Either side's finalizer closes once both
obligations are acknowledged (§7.9 step 5).

Neither keeps state between steps: :func:`stage_of` reads where the move stands from the fresh record and claim,
and every runner re-reads again before it writes. ``tests/helpers/e2e.py`` composes the two sides in one loop (the
tests and the demo); ``services/agent`` runs one side per box process, on events.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Literal

from cryptography.hazmat.primitives.asymmetric.ec import EllipticCurvePublicKey

from bus.log import EventLog
from events.claim import Claim
from events.record import Record
from services.box.artifacts.sealing import PrivateKey
from services.box.instance.activator import Activator, BoxContext, StartPolicy
from services.box.instance.evidence import LeaseObservation, lease_file_check
from services.box.instance.timers import Timers
from services.door.api import Door
from services.ledger.ledger import Committed, NoChange
from services.move import park as parking
from services.move import rollback
from services.move.finalize import Finalizer, LocalRetirement, StepReport
from services.objstore.port import ObjectStore
from services.source import phases as source_phases
from services.source.cutslots import DEFAULT_PREPARE_SLOTS, DEFAULT_SLOTS, PREPARE_BUSY, PREPARE_SLOTS_ENV, Slots
from services.source.phases import TimingProfile, lease_timing
from services.source.preparing import LaunchInputs, PreparingBox, PreparingRunner
from services.source.return_install import ReturnInstall
from services.source.reverting import RevertRunner
from services.source.rollback_recovery import RollbackRecovery
from services.source.worker import SourceBox, SourceWorker
from services.target.readiness import BoxFacts, report_again_in, report_readiness
from services.target.release import TargetRelease
from services.target.returning import ReturnLane
from services.target.worker import LandingWorker

log = logging.getLogger("hostmove.move.sides")

Stage = Literal["request", "preparing", "cutting", "landing", "opening", "aborting", "reverting", "rolling_back",
                "finalizing", "done"]
STAGES: tuple[Stage, ...] = ("request", "preparing", "cutting", "landing", "opening", "aborting", "reverting",
                             "rolling_back", "finalizing", "done")
UNMOVED: frozenset[Stage] = frozenset({"aborting", "reverting"})
"""Stages of a move that ends where it started: the target parks its staging lane, the source closes (§7.11, §7.4)."""


@dataclass(frozen=True)
class Timings:
    """The timing profiles of one run (ARCHITECTURE §7): FAST for tests and the demo. ``source`` is the cut's
    and the preparing rounds' profile; ``park`` sets the late-completion horizon the parks wait out before
    acknowledging (§6.4); the probe's timing is the target box's own (``TargetBox.probe_timing``). ``within_s``
    and ``max_passes`` bound one driven run; ``poll_s`` paces preparing passes that found the target not ready."""

    source: TimingProfile = source_phases.FAST
    park: parking.ParkTiming = parking.FAST
    within_s: float = 120.0
    poll_s: float = 0.2
    report_every_s: float = 2.0
    """The target's readiness report repeats at most this often once it passes, and backs off to it while it fails
    (:func:`services.target.readiness.report_again_in`); never more often than ``poll_s``."""
    max_passes: int = 60
    cut_slots: int = DEFAULT_SLOTS
    """How many cuts the source box carries at once (:mod:`services.source.cutslots`, ``HOSTMOVE_CUT_SLOTS``)."""
    prepare_slots: int = DEFAULT_PREPARE_SLOTS
    """How many moves the source box stages at once before they are ready (``HOSTMOVE_PREPARE_SLOTS``)."""


FAST = Timings()


@dataclass(frozen=True)
class SourceSide:
    """The source box as its agent holds it: the activator's context (registry, tree, stores, clock), the
    activator that runs the instance (its ``stop`` is the cut's stop and final sync), the box's timers, its
    copy of the deployment's secrets key (launch-report MACs, §7.3) and what its next spawn would get."""

    ctx: BoxContext
    activator: Activator
    timers: Timers
    secrets_key: PrivateKey
    launch: Callable[[str], Awaitable[LaunchInputs]]
    ready_url: Callable[[str], str | None]
    recovery_armed: Callable[[str], bool] = lambda host: True
    ready_peer: Callable[[str], Awaitable[tuple[bool, str]]] | None = None
    """S1 "from its own process": whether the readiness answer came from the host's cgroup leaf (§7.3)."""
    recovery_policy: StartPolicy | None = None
    """The starts of one attempt of a rollback's recovery probe (None: the activator's, §7.7)."""


@dataclass(frozen=True)
class TargetSide:
    """The target box: its landing worker (the ``TargetBox`` inside holds the stores, registry, stamps, timers,
    key and the probe factory) and what it knows of itself for the readiness report (T1-T3, T7, T8, T11, T13)."""

    worker: LandingWorker
    facts: BoxFacts | Callable[[str], Awaitable[BoxFacts]]
    """Fixed facts, or the box's observer of them for a host (:class:`services.target.observe.TargetObserver`)."""


@dataclass(frozen=True)
class Deployment:
    """What both sides share: the door, the ledger's stores, a region's data store and bucket, and each region's
    public secrets key (the archive is sealed to the target's, §8)."""

    door: Door
    regions: Callable[[str], tuple[ObjectStore, str]]
    region_key: Callable[[str], EllipticCurvePublicKey]
    events: EventLog | None = None


@dataclass(frozen=True)
class SideStep:
    """What one side's step did: ``progressed`` (step again now), ``stop`` (the move cannot go on from this
    side without a change elsewhere: blocked, rolled back, waiting for the operator; plain words), ``wait``
    (nothing to do until another event, or until ``wake_at`` in ms)."""

    progressed: bool = False
    stop: str = ""
    wait: str = ""
    wake_at: int | None = None
    closed: bool = False


def stage_of(record: Record | None, claim: Claim | None, move_id: str) -> tuple[Stage, str]:
    """Where the move stands, from the fresh record and claim alone. Pure."""
    if record is None:
        return "request", "the host has no record"
    if record.move is None:
        last = record.last_move
        if last is not None and last.id == move_id:
            if claim is not None and claim.op.id == move_id and claim.op.kind != "serving":
                return "finalizing", "the record is closed; the claim's release is next"
            return "done", "" if last.outcome == "done" else f"the move ended {last.outcome}, not done"
        return "request", "the record holds no move"
    move = record.move
    if move.id != move_id:
        return "request", f"the record holds another move {move.id}"
    if move.state in ("preparing", "ready"):
        return "preparing", ""
    if move.state == "cutting":
        return "cutting", ""
    if move.state == "landing":
        return "landing", ""
    if move.state == "committed":
        # a target fenced after the commit never opens: the source parks and the move closes without it (§7.10)
        return ("finalizing", "") if move.opened_at is not None or move.target_fenced else ("opening", "")
    if move.state == "aborted":  # §7.11: the parks, then the close and the release to the source
        return "aborting", move.reason
    if move.state == "reverting":  # §7.4: the source recovers the host, the target parks its lane
        return "reverting", move.reason
    if move.state == "rolling_back":  # §7.8: the target releases and cleans, the source recovers
        return "rolling_back", move.reason
    return "done", f"the move is {move.state}: {move.reason or 'no reason recorded'}"


def _park_step(rep: StepReport) -> SideStep:
    """A finalizer's report as a side's step: its part done (and the move closed, when it closed it), or why it
    waits and until when (§7.9 steps 3-5)."""
    return SideStep(closed=rep.done and rep.reason.startswith("closed"), wait="" if rep.done else rep.reason,
                    wake_at=rep.wake_at)


def _finalizing_id(record: Record) -> str:
    if record.move is not None:
        return record.move.id
    return record.last_move.id if record.last_move is not None else ""


SLOT_RECHECK_MS = 2_000
"""A cut waiting for a slot is woken when one frees; this is its pass's backstop (a slot given up as stale)."""


class SourceRunners:
    """The source box's side of its moves: preparing rounds, the cut and the claim's follow of the flip, and
    the source's park."""

    def __init__(self, deployment: Deployment, source: SourceSide, timings: Timings = FAST,
                 faults: Callable[[str], None] | None = None, wake: Callable[[str], None] | None = None) -> None:
        self.d, self.side, self.t = deployment, source, timings
        self.wake = wake
        """The agent's :meth:`~services.agent.service.BoxAgent.notify`: a host's pass, now (a freed cut slot wakes
        the cuts waiting for one)."""
        ctx = source.ctx
        ledger = deployment.door.ledger
        self.ledger = ledger
        self.slots = Slots(timings.cut_slots, int((timings.source.cut_budget_s + timings.source.landing_budget_s)
                                                  * 1000))
        self.prepare_slots = Slots(timings.prepare_slots, int(timings.source.prepare_bound_s * 1000), PREPARE_BUSY,
                                   PREPARE_SLOTS_ENV)
        self.prep = PreparingRunner(PreparingBox(
            label=ctx.label, region=ctx.region, ledger=ledger, deploy_store=ledger.store, deploy_bucket=ledger.bucket,
            data_store=ctx.data_store, data_bucket=ctx.data_bucket, staging=deployment.regions,
            secrets_key=source.secrets_key, tree=ctx.tree, clock=ctx.clock, files_dir=ctx.files_dir,
            db_path=ctx.db_path, launch=source.launch, ready_url=source.ready_url, ready_peer=source.ready_peer,
            recovery_armed=source.recovery_armed, target_key=deployment.region_key,
        ), timings.source)
        self.cut = SourceWorker(SourceBox(
            label=ctx.label, region=ctx.region, ledger=ledger, deploy_store=ledger.store, deploy_bucket=ledger.bucket,
            data_store=ctx.data_store, data_bucket=ctx.data_bucket, staging=deployment.regions,
            target_key=deployment.region_key, registry=ctx.registry, timers=source.timers, tree=ctx.tree,
            clock=ctx.clock, files_dir=ctx.files_dir, db_path=ctx.db_path, stop=source.activator.stop,
            lease=self._lease,
        ), timings.source, self.prep.readiness)
        self.final = Finalizer(
            ctx.label, ledger, parking.Parker(ctx.data_store, ctx.data_bucket, ctx.clock, timing=timings.park),
            events=deployment.events, local_retire=self._local_retire, faults=faults)
        self.revert = RevertRunner(ctx.label, ledger, ctx.registry, source.timers, source.activator, self.cut,
                                   self.final, ctx.files_dir,
                                   probe_budget_ms=int(timings.source.revert_probe_budget_s * 1000))
        self.recovery = RollbackRecovery(
            ctx.label, ledger, ctx.registry, source.timers, source.activator, self.final, ctx.files_dir,
            region=ctx.region, policy=source.recovery_policy, install=ReturnInstall(
                label=ctx.label, region=ctx.region, box_dir=ctx.box_dir, data_store=ctx.data_store,
                data_bucket=ctx.data_bucket, registry=ctx.registry, timers=source.timers, clock=ctx.clock,
                private_key=source.secrets_key, launch=source.launch, faults=faults))

    @property
    def label(self) -> str:
        return self.side.ctx.label

    async def _local_retire(self, host: str, move_id: str) -> object:
        """The source's local park (§6.4 "Local retirement"), bound to the host's fresh claim read."""
        ctx, ledger = self.side.ctx, self.ledger

        async def read_claim() -> Claim | None:
            return (await ledger.read_claim(host)).state

        return await LocalRetirement(ctx.box_dir, ctx.stamps, ctx.registry, self.side.timers, read_claim,
                                     ctx.clock)(host, move_id)

    def _lease(self, host: str) -> Callable[[], LeaseObservation]:
        """§5.3 step 4: the instance's lease file beside its files; the sample app holds none, so it reads as
        released (absent), and a lease an app did leave is honoured."""
        return lease_file_check(self.side.ctx.data_dir / f"{host}.lease.json", self.side.ctx.clock, 1_000)

    async def step(self, host: str, stage: Stage, record: Record, claim: Claim | None) -> SideStep:
        move = record.move
        now = self.side.ctx.clock.now_ms()
        if move is None or move.state != "preparing":
            self._release(self.prepare_slots, host)
        elif (busy := self.prepare_slots.take(host, now)) is not None:  # the first stagings are paced too
            waited = await self.prep.wait(host, move.id, move.incarnation, busy)
            if waited.step.kind == "blocked":
                return SideStep(stop=waited.reason)
            return SideStep(wait=waited.reason, wake_at=now + SLOT_RECHECK_MS)
        if stage not in ("cutting", "landing", "opening") or move is None:
            self._release(self.slots, host)
        elif stage == "cutting" and move.cut_phase == "requested":  # the cut's clock starts at its admission
            busy = self.slots.take(host, now)
            if busy is not None:  # woken when a slot frees; looked at again after SLOT_RECHECK_MS regardless
                return SideStep(wait=busy, wake_at=now + SLOT_RECHECK_MS)
        else:
            self.slots.hold(host, now)
        if stage == "preparing" and move is not None:
            result = await self.prep.run(host, move.id, move.incarnation)
            if result.step.kind == "blocked":
                return SideStep(stop=result.reason)
            if result.state == "ready" and move.cut != "auto":
                return SideStep(stop=result.reason or "the move is ready and waits for the operator's cut")
            return SideStep(wait=result.reason)
        if stage == "cutting" and move is not None:
            out = await self.cut.run(host, move.id, move.incarnation)
            if out.step.kind in ("blocked", "deadline") or (out.step.kind == "idle" and out.reason):
                fresh = (await self.ledger.read_record(host)).state
                if fresh is None or fresh.move is None or fresh.move.state == "cutting":
                    return SideStep(stop=out.reason)
            return SideStep(progressed=True)
        if stage in ("landing", "opening") and move is not None:
            if claim is not None and claim.op.kind == "moving":  # the claim follows the flip (§7.5)
                out = await self.cut.run(host, move.id, move.incarnation)
                return SideStep(progressed=out.progressed, wait="the target lands")
            if stage == "landing" and move.landing_deadline is not None:  # §7.8: the source's deadline trigger
                if self.side.ctx.clock.now_ms() > move.landing_deadline:
                    return await self._deadline_rollback(host, move.id, move.incarnation)
                return SideStep(wait="the target lands", wake_at=move.landing_deadline + 1)
            return SideStep(wait="the target lands")
        if stage == "aborting" and move is not None:
            return _park_step(await self.final.source_park_unmoved(host, move.id))
        if stage == "reverting" and move is not None:
            rev = await self.revert.run(host, move.id, move.incarnation)
            if rev.report is not None:
                return _park_step(rev.report)
            return SideStep(wait=rev.reason)
        if stage == "rolling_back" and move is not None:
            rec = await self.recovery.run(host, move.id)
            if rec.stuck:
                return SideStep(stop=rec.reason)
            return _park_step(rec.report) if rec.report is not None else SideStep(wait=rec.reason)
        if stage == "finalizing":
            return _park_step(await self.final.source_park(host, _finalizing_id(record)))
        return SideStep()

    def _release(self, slots: Slots, host: str) -> None:
        """``host`` gives up its slot; a freed slot wakes the passes of the hosts waiting for one, now."""
        for waiting in slots.release(host):
            if self.wake is not None:
                self.wake(waiting)

    async def _deadline_rollback(self, host: str, move_id: str, incarnation: str) -> SideStep:
        """§7.8: ``landing_deadline`` passed with no commit: the record CAS ``landing -> rolling_back`` (one of the
        commit and the rollbacks wins), then the claim half it decided (§7.5)."""
        now = self.side.ctx.clock.now_ms()
        release_ms = int(self.t.source.release_budget_s * 1000)
        out = await self.ledger.transition("record", host, "landing-deadline-rollback", lambda cur: (
            rollback.decide_deadline_rollback(cur, move_id, incarnation, now, release_ms)))
        if isinstance(out, Committed):
            log.warning("%s: the landing deadline of %s passed with no commit; rolling back", host, move_id)
            await self.final.follow(host)
        return SideStep(progressed=isinstance(out, Committed | NoChange),
                        wait="" if isinstance(out, Committed | NoChange) else getattr(out, "reason", ""))


class TargetRunners:
    """The target box's side of the moves landing on it: the readiness report, the landing to the open, and
    the staging lane's park."""

    def __init__(self, deployment: Deployment, target: TargetSide, timings: Timings = FAST,
                 faults: Callable[[str], None] | None = None) -> None:
        self.d, self.side, self.t = deployment, target, timings
        tbox = target.worker.box
        self.final = Finalizer(
            tbox.label, deployment.door.ledger,
            parking.Parker(tbox.data_store, tbox.data_bucket, tbox.clock, timing=timings.park),
            events=deployment.events, faults=faults, staging_lease=lease_timing(timings.source),
            staging_region=tbox.region)
        self.release = TargetRelease(target.worker, self.final, self._local_retire, lanes=self._lane)
        self._report_in: dict[str, float] = {}  # per host preparing here: the pace of its last report

    @property
    def label(self) -> str:
        return self.side.worker.box.label

    def _lane(self, region: str) -> ReturnLane:
        """The return lane's bucket in ``region`` and that region's public key (§7.8 returning)."""
        store, bucket = self.d.regions(region)
        return ReturnLane(store, bucket, self.d.region_key(region))

    async def _local_retire(self, host: str, move_id: str, hold_op: str) -> object:
        """The target's local park of a released landing (§7.8 ``cleaning``, §6.4): its stamps, row and timers."""
        tbox, ledger = self.side.worker.box, self.d.door.ledger

        async def read_claim() -> Claim | None:
            return (await ledger.read_claim(host)).state

        return await LocalRetirement(tbox.box_dir, tbox.stamps, tbox.registry, tbox.timers, read_claim,
                                     tbox.clock)(host, move_id, hold_op)

    async def report(self, host: str, source_region: str) -> str:
        """The target's readiness report for this move (§7.3), written to ``target.json``. Answers why the
        target is not ready, or ``""``."""
        tbox = self.side.worker.box
        source_store, source_bucket = self.d.regions(source_region)
        facts = self.side.facts if isinstance(self.side.facts, BoxFacts) else await self.side.facts(host)
        report = await report_readiness(
            ledger=tbox.ledger, data_store=tbox.data_store, data_bucket=tbox.data_bucket, source_store=source_store,
            source_bucket=source_bucket, box=tbox.label, region=tbox.region, box_dir=tbox.box_dir,
            private_key=tbox.private_key, facts=facts, host=host, clock=tbox.clock)
        if report is None:
            return "the record carries no move to the target's region"
        if not report.ready:
            return "the target is not ready: " + "; ".join(f"{c.check} {c.detail}".strip() for c in report.failing())
        return ""

    async def step(self, host: str, stage: Stage, record: Record, claim: Claim | None,
                   source_region: str) -> SideStep:
        if stage != "preparing":
            self._report_in.pop(host, None)
        else:  # "" : reported ready
            why = await self.report(host, source_region)
            again = report_again_in(not why, self._report_in.get(host), poll_s=self.t.poll_s,
                                    every_s=self.t.report_every_s)
            self._report_in[host] = again
            return SideStep(wait=why, wake_at=self.side.worker.box.clock.now_ms() + int(again * 1000))
        if stage in ("landing", "opening"):
            step = await self.side.worker.run(host)
            if step.outcome in ("blocked", "rolled_back", "stopped"):
                return SideStep(stop=step.detail)
            return SideStep(progressed=True)
        if stage == "rolling_back" and record.move is not None:
            rel = await self.release.run(host, record.move.id)
            if rel.stuck:
                return SideStep(stop=rel.reason)
            return _park_step(rel.report) if rel.report is not None else SideStep(wait=rel.reason)
        if stage in UNMOVED:
            await self.final.follow(host)  # the claim half owes this box the staging park (§7.11, §7.4)
        if stage in UNMOVED or stage == "finalizing":
            return _park_step(await self.final.staging_park(host, _finalizing_id(record)))
        return SideStep()


__all__ = ["FAST", "STAGES", "Deployment", "SideStep", "SourceRunners", "SourceSide", "Stage", "TargetRunners",
           "TargetSide", "Timings", "stage_of"]
