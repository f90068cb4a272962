"""One move from request to close, by stepping the real runners in order (spec §7.1-§7.9; issue 4).

:func:`run_move` is the glue the end-to-end test and the demo share: the door's request (§7.1), the source's
preparing rounds (§7.3) with the target's readiness report beside them, the cut from ``requested`` to the flip
(§7.4, §7.5), the landing from ``checking`` to commit and open (§7.6-§7.9 steps 1-2), and the finalization: both
parks and the close (§7.9 steps 3-5). It holds no state of its own: every pass re-reads the record and the claim
and hands them to the runner the record's ``move.state`` names, and each runner re-reads again before it writes
(ARCHITECTURE §5). A run that stops answers a :class:`MoveOutcome` saying where and why, never an exception for a
race or a refusal (store and bus failures still raise: a read error never acts, C6).

Seams adapted here rather than in the runners (each is a change proposed to the module's owner):

- **T5 before the cut.** The target's readiness check T5 needs a staged files archive, but preparing rounds do
  not build one (``services/source/preparing.py``: "the files archive of each round (built at the cut)"). So
  each preparing pass here stages the round's archive in the lane's ``files/`` (§7.3 "each round ... files"),
  sealed to the target region's key. The cut builds and stages its own archive afterwards, and the seal names
  the cut's versions only, so the landing never reads this one. The cut's ``stage_files`` writes
  ``files/manifest.json`` create-only, so the round's objects are withdrawn (by exact version) before the cut
  reaches ``archived``: :meth:`MoveRun.withdraw_round_archive`.
"""

from __future__ import annotations

import asyncio
import io
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Literal

from cryptography.hazmat.primitives.asymmetric.ec import EllipticCurvePublicKey

from bus.log import EventLog
from events.claim import Claim
from events.record import Record
from services.box.activator import Activator, BoxContext
from services.box.archive import ArchiveError, build_archive, manifest_bytes
from services.box.evidence import LeaseObservation, lease_file_check
from services.box.sealing import PrivateKey
from services.box.timers import Timers
from services.door.api import Door
from services.door.auth import Identity
from services.door.decide import CutMode, MoveRequest
from services.move import park as parking
from services.move.finalize import Finalizer, LocalRetirement
from services.objstore.port import ObjectStore
from services.source import phases as source_phases
from services.source.phases import TimingProfile
from services.source.preparing import LaunchInputs, PreparingBox, PreparingRunner
from services.source.staging import lane
from services.source.worker import SourceBox, SourceWorker
from services.target.readiness import BoxFacts, report_readiness
from services.target.worker import LandingWorker

log = logging.getLogger("hostmove.move.e2e")

Stage = Literal["request", "preparing", "cutting", "landing", "opening", "finalizing", "done"]
STAGES: tuple[Stage, ...] = ("request", "preparing", "cutting", "landing", "opening", "finalizing", "done")


@dataclass(frozen=True)
class Timings:
    """The timing profiles of one run (ARCHITECTURE §7): FAST for tests and the demo. ``source`` is the cut's
    and the preparing rounds' profile; ``park`` sets the late-completion horizon the parks wait out before
    acknowledging (§6.4); the probe's timing is the target box's own (``TargetBox.probe_timing``). ``within_s``
    and ``max_passes`` bound the whole run; ``poll_s`` paces preparing passes that found the target not ready."""

    source: TimingProfile = source_phases.FAST
    park: parking.ParkTiming = parking.FAST
    within_s: float = 120.0
    poll_s: float = 0.2
    max_passes: int = 60


FAST = Timings()
ROUND_ARCHIVE_PHASES = frozenset({"", "requested", "admitted", "stopping", "stopped", "staged"})


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


@dataclass(frozen=True)
class TargetSide:
    """The target box: its landing worker (the ``TargetBox`` inside holds the stores, registry, stamps, timers,
    key and the probe factory) and what it knows of itself for the readiness report (T1-T3, T7, T8, T11, T13)."""

    worker: LandingWorker
    facts: BoxFacts


@dataclass(frozen=True)
class Deployment:
    """What both sides share: the door, the ledger's stores, a region's data store and bucket, and each region's
    public secrets key (the archive is sealed to the target's, §8)."""

    door: Door
    regions: Callable[[str], tuple[ObjectStore, str]]
    region_key: Callable[[str], EllipticCurvePublicKey]
    events: EventLog | None = None


@dataclass(frozen=True)
class MoveOutcome:
    """How a run ended. ``ok`` only when the move closed as done with the claim serving on the target.
    ``stage`` is the last stage reached; ``reason`` says in plain words why the run stopped there. ``timings``
    holds seconds per stage (monotonic, this process) and ``total``; ``passes`` counts the loop's re-reads."""

    host: str
    move_id: str
    ok: bool
    stage: Stage
    reason: str
    exec_box: str = ""
    committed: bool = False
    opened: bool = False
    closed: bool = False
    timings: dict[str, float] = field(default_factory=dict)
    passes: int = 0


def _stage_of(record: Record | None, claim: Claim | None, move_id: str) -> tuple[Stage, str]:
    """Where the move stands, from the fresh record and claim alone."""
    if record is None:
        return "request", "the host has no record"
    if record.move is None:
        last = record.last_move
        if last is not None and last.id == move_id:
            if last.outcome != "done":
                return "done", f"the move ended {last.outcome}, not done"
            if claim is not None and claim.op.kind == "serving":
                return "done", ""
            return "finalizing", "the record is closed; the claim's release is next"
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
        return ("finalizing", "") if move.opened_at is not None else ("opening", "")
    return "done", f"the move is {move.state}: {move.reason or 'no reason recorded'}"


class MoveRun:
    """The runners of one move, built once from the two sides; :meth:`run` steps them (see the module doc)."""

    def __init__(self, deployment: Deployment, source: SourceSide, target: TargetSide,
                 timings: Timings = FAST) -> None:
        self.d, self.source, self.target, self.t = deployment, source, target, timings
        ctx = source.ctx
        self.clock = ctx.clock  # time only through the Clock port (ARCHITECTURE §7)
        ledger = deployment.door.ledger
        self.ledger = ledger
        self.prep = PreparingRunner(PreparingBox(
            label=ctx.label, region=ctx.region, ledger=ledger, deploy_store=ledger.store, deploy_bucket=ledger.bucket,
            data_store=ctx.data_store, data_bucket=ctx.data_bucket, staging=deployment.regions,
            secrets_key=source.secrets_key, tree=ctx.tree, clock=ctx.clock, files_dir=ctx.files_dir,
            db_path=ctx.db_path, launch=source.launch, ready_url=source.ready_url,
            recovery_armed=source.recovery_armed,
        ), timings.source)
        self.cut = SourceWorker(SourceBox(
            label=ctx.label, region=ctx.region, ledger=ledger, deploy_store=ledger.store, deploy_bucket=ledger.bucket,
            data_store=ctx.data_store, data_bucket=ctx.data_bucket, staging=deployment.regions,
            target_key=deployment.region_key, registry=ctx.registry, timers=source.timers, tree=ctx.tree,
            clock=ctx.clock, files_dir=ctx.files_dir, db_path=ctx.db_path, stop=source.activator.stop,
            lease=self._lease,
        ), timings.source, self.prep.readiness)
        tbox = target.worker.box

        self.source_final = Finalizer(
            ctx.label, ledger, parking.Parker(ctx.data_store, ctx.data_bucket, ctx.clock, timing=timings.park),
            events=deployment.events,
            local_retire=self._local_retire)
        self.target_final = Finalizer(
            tbox.label, ledger, parking.Parker(tbox.data_store, tbox.data_bucket, tbox.clock, timing=timings.park),
            events=deployment.events)

    async def _local_retire(self, host: str, move_id: str) -> object:
        """The source's local park (§6.4 "Local retirement"), bound to the host's fresh claim read."""
        ctx, ledger = self.source.ctx, self.ledger

        async def read_claim() -> Claim | None:
            return (await ledger.read_claim(host)).state

        return await LocalRetirement(ctx.box_dir, ctx.stamps, ctx.registry, self.source.timers, read_claim,
                                     ctx.clock)(host, move_id)

    def _lease(self, host: str) -> Callable[[], LeaseObservation]:
        """§5.3 step 4: the instance's lease file beside its files; the sample app holds none, so it reads as
        released (absent), and a lease an app did leave is honoured."""
        return lease_file_check(self.source.ctx.data_dir / f"{host}.lease.json", self.source.ctx.clock, 1_000)

    async def stage_round_archive(self, host: str, record: Record) -> str:
        """The preparing round's files archive in the lane's ``files/`` (the T5 seam in the module doc): sealed
        to the target region's key, rewritten each round. Answers why not when the files cannot be archived."""
        assert record.move is not None
        move = record.move
        ctx = self.source.ctx
        out = io.BytesIO()
        try:
            manifest = await asyncio.to_thread(
                build_archive, ctx.files_dir(host), None, out, self.d.region_key(move.to), host=host, op_id=move.id,
                incarnation=move.incarnation)
        except ArchiveError as exc:
            return f"the files beside the database cannot move: {exc}"
        store, bucket = self.d.regions(move.to)
        prefix = lane(host, move.id) + "files/"
        await store.put(bucket, prefix + "archive.sealed", out.getvalue())
        await store.put(bucket, prefix + "manifest.json", manifest_bytes(manifest))
        return ""

    async def withdraw_round_archive(self, host: str, record: Record) -> int:
        """Delete, by exact version, what the rounds staged under the lane's ``files/`` while the cut has not
        reached ``archived`` (before it, ``files/`` holds only rounds' archives): the cut's ``stage_files`` writes
        ``files/manifest.json`` create-only and would refuse a round's manifest (the seam in the module doc).
        Answers how many versions were deleted."""
        assert record.move is not None
        move = record.move
        store, bucket = self.d.regions(move.to)
        prefix = lane(host, move.id) + "files/"
        versions = await store.list_versions(bucket, prefix)
        for v in versions:
            await store.delete(bucket, v.key, version_id=v.version_id)
        return len(versions)

    async def report_target(self, host: str) -> str:
        """The target's readiness report for this move (§7.3), written to ``target.json``."""
        tbox = self.target.worker.box
        ctx = self.source.ctx
        report = await report_readiness(
            ledger=tbox.ledger, data_store=tbox.data_store, data_bucket=tbox.data_bucket, source_store=ctx.data_store,
            source_bucket=ctx.data_bucket, box=tbox.label, region=tbox.region, box_dir=tbox.box_dir,
            private_key=tbox.private_key, facts=self.target.facts, host=host, clock=tbox.clock)
        if report is None:
            return "the record carries no move to the target's region"
        if not report.ready:
            return "the target is not ready: " + "; ".join(f"{c.check} {c.detail}".strip() for c in report.failing())
        return ""

    async def _finalize(self, host: str, move_id: str) -> tuple[bool, str, int | None]:
        """§7.9 steps 3-5: the source's park, the target's staging park, then the close (either finalizer closes
        once both obligations are acknowledged). Answers (closed, why not, wake_at)."""
        src = await self.source_final.source_park(host, move_id)
        tgt = await self.target_final.staging_park(host, move_id)
        if tgt.done and tgt.reason.startswith("closed"):
            return True, "", None
        if src.done and src.reason.startswith("closed"):
            return True, "", None
        waits = [w for w in (src.wake_at, tgt.wake_at) if w is not None]
        why = "; ".join(r for r in (src.reason, tgt.reason) if r)
        return False, why, min(waits) if waits else None

    async def run(self, host: str, *, to: str, cut: CutMode = "auto", who: Identity | None = None) -> MoveOutcome:
        """Request the move at the door, then step it to its close (or until it stops; see :class:`MoveOutcome`)."""
        who = who or Identity("op", "operator")
        started = self.clock.monotonic()
        marks: dict[str, float] = {"request": started}
        answer = await self.d.door.request_move(host, MoveRequest(to, cut), who)
        if answer.status not in (200, 201):
            return MoveOutcome(host, "", False, "request", answer.body.get("reason", f"the door answered "
                                                                                  f"{answer.status}"),
                               timings={"request": self.clock.monotonic() - started})
        move_id = str(answer.body["move"]["id"])
        return await self.drive(host, move_id, started=started, marks=marks)

    async def drive(self, host: str, move_id: str, *, started: float | None = None,
                    marks: dict[str, float] | None = None) -> MoveOutcome:
        """Step an already requested move to its close. Safe to call again after a crash: it reads everything."""
        started = self.clock.monotonic() if started is None else started
        marks = {} if marks is None else marks
        deadline = started + self.t.within_s
        stage: Stage = "request"
        reason = ""
        passes = 0
        while passes < self.t.max_passes:
            passes += 1
            record = (await self.ledger.read_record(host)).state
            claim = (await self.ledger.read_claim(host)).state
            stage, stop = _stage_of(record, claim, move_id)
            marks.setdefault(stage, self.clock.monotonic())
            log.info("move pass", extra={"host": host, "op": move_id, "stage": stage, "pass": passes})
            if stage == "done" or (stage == "request" and stop):
                reason = stop
                break
            if self.clock.monotonic() > deadline:
                reason = f"the move did not finish within {self.t.within_s:g} s; it stopped at {stage}"
                break
            assert record is not None
            move = record.move
            if stage == "finalizing" or move is None:
                closed, why, wake_at = await self._finalize(host, move_id)
                if not closed and wake_at is not None:  # a park waits out its horizon (§6.4): wake then
                    wait_s = max(0.0, (wake_at - self.clock.now_ms()) / 1000)
                    await self.clock.sleep(min(wait_s, max(0.0, deadline - self.clock.monotonic())))
                elif not closed and why and "waiting" not in why:
                    reason = why
                    break
            elif stage == "preparing":
                result = await self.prep.run(host, move_id, move.incarnation)
                if result.step.kind == "blocked":
                    reason = result.reason
                    break
                if result.state == "ready" and move.cut != "auto":
                    reason = result.reason or "the move is ready and waits for the operator's cut"
                    break
                if result.state == "preparing":  # the target's side of the round: its archive and report
                    reason = (await self.stage_round_archive(host, record) or await self.report_target(host)
                              or result.reason)
                    if reason:  # not ready yet: poll again shortly rather than spin
                        await self.clock.sleep(self.t.poll_s)
            elif stage == "cutting":
                if move.cut_phase in ROUND_ARCHIVE_PHASES:
                    await self.withdraw_round_archive(host, record)
                out = await self.cut.run(host, move_id, move.incarnation)
                if out.step.kind in ("blocked", "deadline") or (out.step.kind == "idle" and out.reason):
                    fresh = (await self.ledger.read_record(host)).state
                    if fresh is None or fresh.move is None or fresh.move.state == "cutting":
                        reason = out.reason
                        break
            elif stage in ("landing", "opening"):
                if claim is not None and claim.op.kind == "moving":
                    await self.cut.run(host, move_id, move.incarnation)  # the claim follows the flip
                step = await self.target.worker.run(host)
                if step.outcome in ("blocked", "rolled_back", "stopped"):
                    reason = step.detail
                    break
        else:
            reason = f"the move took more than {self.t.max_passes} passes; it stopped at {stage}"
        return await self._outcome(host, move_id, stage, reason, started, marks, passes)

    async def _outcome(self, host: str, move_id: str, stage: Stage, reason: str, started: float,
                       marks: dict[str, float], passes: int) -> MoveOutcome:
        record = (await self.ledger.read_record(host)).state
        claim = (await self.ledger.read_claim(host)).state
        end = self.clock.monotonic()
        order = [s for s in STAGES if s in marks]
        timings: dict[str, float] = {s: round((marks[order[i + 1]] if i + 1 < len(order) else end) - marks[s], 3)
                   for i, s in enumerate(order)}
        timings["total"] = round(end - started, 3)
        move = record.move if record is not None else None
        last = record.last_move if record is not None else None
        closed = move is None and last is not None and last.id == move_id and last.outcome == "done"
        committed = closed or (move is not None and move.id == move_id and move.committed_at is not None)
        opened = closed or (move is not None and move.id == move_id and move.opened_at is not None)
        exec_box = claim.op.exec if claim is not None else ""
        ok = closed and claim is not None and claim.op.kind == "serving" and exec_box == \
            self.target.worker.box.label
        if ok:
            reason = ""
        elif not reason:
            reason = f"the move stopped at {stage}"
        return MoveOutcome(host, move_id, ok, stage, reason, exec_box, committed, opened, closed, timings, passes)


async def run_move(host: str, *, to: str, deployment: Deployment, source: SourceSide, target: TargetSide,
                   cut: CutMode = "auto", who: Identity | None = None, timings: Timings = FAST) -> MoveOutcome:
    """Move ``host`` from the source box to the target box (in region ``to``) and close it (§7.1-§7.9)."""
    return await MoveRun(deployment, source, target, timings).run(host, to=to, cut=cut, who=who)


__all__ = ["FAST", "STAGES", "Deployment", "MoveOutcome", "MoveRun", "SourceSide", "Stage", "TargetSide",
           "Timings", "run_move"]
