"""The source's cut runner (spec §7.4, §7.5, §7.13): re-read, decide (:mod:`services.source.phases`), CAS, act.

Each :meth:`SourceWorker.step` reads the record and the claim fresh, asks :func:`~services.source.phases.plan`
for the next journaled step (K5 revalidation and the ``cut_deadline`` check are part of it), writes the phase
through the ledger **before** its effects, then runs the effects. Every effect is idempotent on replay:
evidence is recomputable and create-only (K13), snapshots and the archive are create-only and reused, copies name
exact versions, the claim deciders answer ``NoChange`` when the claim already holds the result. Nothing the
worker learns survives in memory: a restarted worker (a new object) continues from the durable state.

Every staging effect (the timers at ``stopped``, the final mirror at ``staged``, the archive at ``archived``) takes
the staging-work lease first, revalidates the journaled step from a fresh read, and writes push-only under
``SafeUntil`` (§7.3, M17; :mod:`services.move.lease`, :class:`services.source.staging.Stager`).
"""

from __future__ import annotations

import contextlib
import io
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import msgspec
from cryptography.hazmat.primitives.asymmetric.ec import EllipticCurvePublicKey

from events.base import decode
from events.claim import Claim
from events.record import FilesDigest, Record
from kernel.logctx import ctx
from kernel.ports import Clock, Random, SystemRandom, blocking, process_nonce
from services.box.artifacts.archive import ArchiveError, build_archive, decode_manifest, manifest_bytes, plain_digest
from services.box.instance.activator import Certificate, certificate_key
from services.box.instance.evidence import (
    Checkpoint,
    EvidenceFor,
    EvidenceRefused,
    LeaseObservation,
    StopEvidence,
    StopHooks,
    file_sha256,
    reconstruct_stop_evidence,
)
from services.box.instance.proctree import ProcessTree
from services.box.instance.registry import Registry
from services.box.instance.timers import Timers, TimersBusy
from services.box.instance.timers import drain as drain_timers
from services.box.replica.layout import GenerationScope, list_generation
from services.box.replica.planner import replication_position
from services.ledger.ledger import Committed, Conflict, Ledger, NoChange, Refusal
from services.move.follow import claim_half, snapshot_prefix
from services.move.lease import StagingStopped, StagingWork
from services.objstore.port import Got, ObjectStore, StoreError
from services.source import phases, revert
from services.source.phases import Readiness, Step, TimingProfile, lease_timing
from services.source.staging import MoveMarker, Stager, StagingConflict, create_once

log = logging.getLogger("hostmove.source")


@dataclass(frozen=True)
class SourceBox:
    """The source box's ports. ``stop`` stops the instance and runs its final sync (``Activator.stop``), and is
    harmless when nothing runs; ``final_checkpoint`` is §5.3 step 5 (default :func:`replica_checkpoint`)."""

    label: str
    region: str
    ledger: Ledger
    deploy_store: ObjectStore
    deploy_bucket: str
    data_store: ObjectStore
    data_bucket: str
    staging: Callable[[str], tuple[ObjectStore, str]]  # target region -> its store and bucket
    target_key: Callable[[str], EllipticCurvePublicKey]  # target region -> the public secrets key (§8, §10)
    registry: Registry
    timers: Timers
    tree: ProcessTree
    clock: Clock
    files_dir: Callable[[str], Path]
    db_path: Callable[[str], Path]
    stop: Callable[[str], Awaitable[object]]
    lease: Callable[[str], Callable[[], LeaseObservation]]
    final_checkpoint: Callable[[str, Claim], Awaitable[Checkpoint]] | None = None
    rng: Random = field(default_factory=SystemRandom)  # the staging lease holder's nonce


@dataclass(frozen=True)
class StepResult:
    """What one step did. ``progressed`` is False when the worker stopped: ``step.kind`` and ``reason`` say why."""

    step: Step
    progressed: bool
    reason: str = ""


class SourceWorker:
    def __init__(self, box: SourceBox, profile: TimingProfile, readiness: Callable[[str], Awaitable[Readiness]]):
        self.box = box
        self.profile = profile
        self.readiness = readiness
        self.holder = f"{box.label}/{process_nonce(box.rng)}"  # this worker's staging lease token (§7.3)

    # -- the loop ---------------------------------------------------------------------------------------------

    async def run(self, host: str, move_id: str, incarnation: str, *, max_steps: int = 20) -> StepResult:
        """Take steps until the cut stops progressing (done, idle, blocked, or past its deadline)."""
        result = StepResult(Step("idle"), False, "no step taken")
        for _ in range(max_steps):
            result = await self.step(host, move_id, incarnation)
            if not result.progressed:
                return result
        return result

    async def step(self, host: str, move_id: str, incarnation: str) -> StepResult:
        box = self.box
        record = (await box.ledger.read_record(host)).state
        claim = (await box.ledger.read_claim(host)).state
        now = box.clock.now_ms()
        step = phases.plan(record, claim, source=box.label, move_id=move_id, incarnation=incarnation, now_ms=now)
        log.info("source step %s of %s (move %s) at %s", step.kind, host, move_id, step.phase or "-",
                 extra=ctx(host=host, op_id=move_id, box=box.label, phase=step.phase or None, step=step.kind))
        if step.kind == "deadline":  # §7.4: exceeding the deadline before the commit starts recovery
            reason = f"the cut deadline passed at {step.phase}; the source recovers the host (reverting)"
            out = await self._record(step, host, "cut-revert", lambda r: revert.decide_revert(
                r, move_id, incarnation, box.clock.now_ms(), reason))
            return StepResult(step, False, reason if out.progressed else out.reason)
        if step.kind in ("idle", "blocked", "done"):
            return StepResult(step, False, step.reason)
        assert record is not None and claim is not None
        if step.kind == "admit":
            ready = await self.readiness(host)
            return await self._record(step, host, "cut-admit", lambda r: phases.decide_admit(
                r, move_id, incarnation, ready, box.clock.now_ms(), self.profile))
        if step.kind == "enter" and step.phase == "stopping":
            armed = await self.readiness(host)
            back = await box.ledger.transition("record", host, "cut-unarmed", lambda r: phases.decide_unarmed(
                r, move_id, incarnation, armed, box.clock.now_ms()))  # type: ignore[arg-type,misc]
            if isinstance(back, Committed):
                return StepResult(Step("idle", "admitted"), False, "source recovery is not armed; back to ready")
            return await self._record(step, host, "cut-stopping", lambda r: phases.decide_enter(
                r, move_id, incarnation, "stopping", box.clock.now_ms()))
        if step.kind == "enter" and step.phase == "stopped":
            return await self._stopping_then_stopped(step, host, claim, move_id, incarnation)
        if step.kind == "effects" and step.phase == "stopped":
            return await self._stopped_effects(step, host, record, move_id)
        if step.kind == "enter" and step.phase in ("staged", "archived"):
            target = step.phase
            return await self._record(step, host, f"cut-{target}", lambda r: phases.decide_enter(
                r, move_id, incarnation, target, box.clock.now_ms()))  # type: ignore[arg-type]
        if step.kind == "effects" and step.phase == "staged":
            return await self._staged_effects(step, host, record, claim, move_id)
        if step.kind == "effects" and step.phase == "archived":
            return await self._archived_effects(step, host, record, move_id, incarnation)
        if step.kind == "flip":
            out = await self._record(step, host, "cut-flip", lambda r: phases.decide_flip(
                r, move_id, incarnation, box.clock.now_ms(), self.profile))
            if not out.progressed:
                return out
            return await self._follow(step, host)
        if step.kind == "follow":
            return await self._follow(step, host)
        return StepResult(step, False, f"no runner for {step.kind}/{step.phase}")

    # -- writes -----------------------------------------------------------------------------------------------

    async def _record(self, step: Step, host: str, name: str,
                      decide: Callable[[Record | None], Record | NoChange | Refusal]) -> StepResult:
        out = await self.box.ledger.transition("record", host, name, decide)  # type: ignore[arg-type,misc]
        return self._outcome(step, out)

    async def _claim(self, step: Step, host: str, name: str,
                     decide: Callable[[Claim | None], Claim | NoChange | Refusal]) -> StepResult:
        out = await self.box.ledger.transition("claim", host, name, decide)  # type: ignore[arg-type,misc]
        return self._outcome(step, out)

    @staticmethod
    def _outcome(step: Step, out: object) -> StepResult:
        if isinstance(out, Committed | NoChange):
            return StepResult(step, True)
        if isinstance(out, Refusal):
            return StepResult(step, False, out.reason)
        assert isinstance(out, Conflict)
        return StepResult(step, False, "another writer kept changing the object; the next wake retries")

    def _deadline(self, step: Step, record: Record) -> StepResult | None:
        move = record.move
        if move is not None and phases.deadline_passed(move, self.box.clock.now_ms()):
            return StepResult(Step("deadline", step.phase), False,
                              f"the cut deadline passed during {step.phase}; nothing more is done")
        return None

    async def _fresh_record(self, host: str) -> Record | None:
        return (await self.box.ledger.read_record(host)).state

    async def _staging(self, step: Step, host: str, record: Record, move_id: str, incarnation: str,
                       work: Callable[[Stager], Awaitable[StepResult]]) -> StepResult:
        """Run ``work`` under the staging-work lease (§7.3, claim C3): take the lease, revalidate from a fresh read
        that the journal still names ``step`` (K5), stage push-only, give the lease back. A stopped round (the
        lease held elsewhere or lost, ``SafeUntil`` passed) does not progress; the next wake retries."""
        box = self.box
        assert record.move is not None
        move = record.move
        store, bucket = box.staging(move.to)
        lease = StagingWork(box.deploy_store, box.deploy_bucket, box.clock, lease_timing(self.profile),
                            region=move.to, host=host, op_id=move_id, holder=self.holder)
        try:
            await lease.acquire()
            try:
                again = phases.plan(await self._fresh_record(host), (await box.ledger.read_claim(host)).state,
                                    source=box.label, move_id=move_id, incarnation=incarnation,
                                    now_ms=box.clock.now_ms())
                if (again.kind, again.phase) != (step.kind, step.phase):
                    return StepResult(again, False, again.reason or f"the journal moved on to {again.kind}/"
                                                                    f"{again.phase} under the staging lease")
                stager = await Stager.open(lease, store, bucket, box.deploy_store, box.deploy_bucket, host,
                                           move_id, move.to)
                return await work(stager)
            finally:
                with contextlib.suppress(StoreError):
                    await lease.release()
        except StagingStopped as exc:
            return StepResult(step, False, str(exc))

    # -- stopping: hold, drain, stop, evidence; then the stopped CAS records it ---------------------------------

    async def _stopping_then_stopped(self, step: Step, host: str, claim: Claim, move_id: str,
                                     incarnation: str) -> StepResult:
        """§7.4 ``stopping`` (replay: ``ReconstructStopEvidence``, §7.13), then the journal write of ``stopped``
        carrying the evidence key and the digests recorded before any phase that can fail."""
        box = self.box
        got = await self.stop_with_evidence(host, claim, move_id, incarnation, hold="moving")
        if isinstance(got, str):
            return StepResult(step, False, got)
        key, ev = got
        row = box.registry.get(host)
        source = {"evidence": key, "db_sha256": ev.db_sha256, "timers_sha256": ev.timers_sha256,
                  "files": FilesDigest(plain=ev.files_sha256),
                  "replication": (row.replication if row is not None and row.replication else "stream"),
                  "next_due": row.next_due if row is not None else 0}
        return await self._record(step, host, "cut-stopped", lambda r: phases.decide_enter(
            r, move_id, incarnation, "stopped", box.clock.now_ms(), **source))

    async def stop_with_evidence(self, host: str, claim: Claim, move_id: str, incarnation: str, *,
                                 hold: Literal["moving", "restoring"]) -> tuple[str, StopEvidence] | str:
        """Hold the row (``hold``, ``hold_op`` = the move), drain its timers, stop the instance (its final sync),
        then the stop evidence of §5.3, create-only and reused on replay (K13). Answers ``(key, evidence)``, or
        why not in plain words. The cut's ``stopping`` and the revert's ``evidence`` phase (§7.4) both use it."""
        box = self.box
        if not box.registry.hold(host, hold, move_id):
            return f"the route of {host} is held by another operation; the stop waits"
        try:
            await drain_timers(box.timers.conn, box.clock, host, timeout_s=self.profile.drain_timeout_s)
        except TimersBusy as exc:
            return str(exc)
        await box.stop(host)
        checkpoint = box.final_checkpoint or replica_checkpoint_for(box)
        files_dir = box.files_dir(host)

        async def files() -> str:
            return (await blocking(plain_digest, files_dir, None, host=host)).plain

        async def timers() -> str:
            return box.timers.digest(host)

        async def final() -> Checkpoint:
            return await checkpoint(host, claim)

        hooks = StopHooks(box.lease(host), final, files, timers)
        subject = EvidenceFor(host, move_id, "source", box.label, incarnation, claim.gen)
        got = await reconstruct_stop_evidence(tree=box.tree, store=box.deploy_store, bucket=box.deploy_bucket,
                                              clock=box.clock, subject=subject, db_path=box.db_path(host),
                                              hooks=hooks, drain_within_s=self.profile.drain_timeout_s)
        if isinstance(got, EvidenceRefused):
            return got.message
        return got.key, got.evidence

    # -- stopped: timers snapshot, exec -> none (K3) ------------------------------------------------------------

    async def _stopped_effects(self, step: Step, host: str, record: Record, move_id: str) -> StepResult:
        box = self.box
        assert record.move is not None
        move = record.move
        body = msgspec.json.encode(box.timers.list(host))
        if box.timers.digest(host) != move.source.timers_sha256:
            return StepResult(step, False, "the timers changed after the stop evidence was taken; not snapshotting")
        snap = await create_once(box.data_store, box.data_bucket, snapshot_prefix(host, move_id) + "timers.json",
                                 body)

        async def stage(stager: Stager) -> StepResult:
            staged = await stager.stage_timers(body)
            if (late := self._deadline(step, record)) is not None:
                return late
            versions = {"snapshot": snap or "", "staged": staged}
            return await self._claim(step, host, "cut-exec-none", lambda c: phases.decide_exec_none(
                c, move_id, box.label, move.source.evidence, versions))

        return await self._staging(step, host, record, move_id, move.incarnation, stage)

    # -- staged: the byte-final mirror and the seal ---------------------------------------------------------------

    async def _evidence(self, key: str) -> StopEvidence:
        got = await self.box.deploy_store.get(self.box.deploy_bucket, key)
        if not isinstance(got, Got):
            raise LookupError(f"the stop evidence {key} named by the record is missing")
        return decode(got.body, StopEvidence)

    async def _staged_effects(self, step: Step, host: str, record: Record, claim: Claim, move_id: str) -> StepResult:
        box = self.box
        assert record.move is not None and claim.holder is not None
        move = record.move
        holder = claim.holder
        evidence = await self._evidence(move.source.evidence)
        scope = GenerationScope(holder.location, holder.generation)
        n = evidence.n or 0
        src_position = replication_position(await list_generation(box.data_store, box.data_bucket, scope))

        async def stage(stager: Stager) -> StepResult:
            await stager.write_marker(MoveMarker(move_id=move.id, incarnation=move.incarnation, host=host,
                                                 from_=move.from_ or box.region, to=move.to))
            mirrored = await stager.mirror(box.data_store, box.data_bucket, scope)
            if mirrored.max_l0 != n:
                return StepResult(step, False, f"the mirror reached TXID {mirrored.max_l0}, not the stopped "
                                               f"position N={n}; the round is deferred")
            if (late := self._deadline(step, record)) is not None:
                return late
            timers = claim.op.journal.get("timers", {})
            covered = src_position == n and await self._certified(claim, n)
            seal = {"n": n, "generation": holder.generation, "replica": mirrored.versions,
                    "timers": {"timers.json": timers.get("staged", "")}, "src_covered": covered, "from_db": covered,
                    "bytes": mirrored.bytes}
            return await self._claim(step, host, "cut-seal", lambda c: phases.decide_seal(c, move_id, box.label,
                                                                                           seal))

        return await self._staging(step, host, record, move_id, move.incarnation, stage)

    async def _certified(self, claim: Claim, n: int) -> bool:
        """Whether the holder's session closed clean at ``n``: its certificate (written by ``Activator.stop`` only
        when every committed frame was uploaded) names this box and this position (§7.4 ``src_covered``)."""
        holder = claim.holder
        assert holder is not None
        key = certificate_key(holder.location, holder.generation, holder.session)
        got = await self.box.data_store.get(self.box.data_bucket, key)
        if not isinstance(got, Got):
            return False
        cert = decode(got.body, Certificate)
        return cert.box == self.box.label and cert.generation == holder.generation and cert.max_txid == n

    # -- archived: the sealed archive, create-only and reused -------------------------------------------------------

    async def _archived_effects(self, step: Step, host: str, record: Record, move_id: str,
                                incarnation: str) -> StepResult:
        box = self.box
        assert record.move is not None
        move = record.move
        prefix = snapshot_prefix(host, move_id)
        got = await box.data_store.get(box.data_bucket, prefix + "manifest.json")
        if isinstance(got, Got):
            manifest = decode_manifest(got.body)  # §7.13: reuse the create-only archive
        else:
            out = io.BytesIO()
            try:
                manifest = await blocking(build_archive, box.files_dir(host), None, out,
                                                   box.target_key(move.to), host=host, op_id=move_id,
                                                   incarnation=incarnation)
            except ArchiveError as exc:
                return StepResult(step, False, f"the files archive was refused: {exc}")
            await create_once(box.data_store, box.data_bucket, prefix + f"archive-{manifest.sealed}.sealed",
                              out.getvalue())
            await create_once(box.data_store, box.data_bucket, prefix + "manifest.json", manifest_bytes(manifest))
        archive_key = prefix + f"archive-{manifest.sealed}.sealed"
        head = await box.data_store.head(box.data_bucket, archive_key)
        if not isinstance(head, Got) or head.version_id is None:
            return StepResult(step, False, f"the archive {archive_key} named by its manifest is missing")
        archive_version = head.version_id

        async def stage(stager: Stager) -> StepResult:
            files = await stager.stage_files(src_bucket=box.data_bucket, archive_key=archive_key,
                                             archive_version=archive_version, manifest=manifest_bytes(manifest))
            if (late := self._deadline(step, record)) is not None:
                return late
            digest = manifest.files_digest()
            out1 = await self._record(step, host, "cut-archive-digests", lambda r: phases.decide_files_digest(
                r, move_id, incarnation, digest, box.clock.now_ms()))
            if not out1.progressed:
                return out1
            # The lane's seal bound (§6.4 evidence_at): no staging writer can sign after seal time + lease TTL.
            return await self._claim(step, host, "cut-sealed", lambda c: phases.decide_sealed(
                c, move_id, box.label, files, staging_bound=box.clock.now_ms() + self.profile.staging_lease_ttl_ms))

        return await self._staging(step, host, record, move_id, incarnation, stage)

    # -- the claim follows the flip ---------------------------------------------------------------------------------

    async def _follow(self, step: Step, host: str) -> StepResult:
        record = await self._fresh_record(host)
        return await self._claim(step, host, "move-follow", lambda c: claim_half(c, record))


def replica_checkpoint_for(box: SourceBox) -> Callable[[str, Claim], Awaitable[Checkpoint]]:
    """§5.3 step 5 after ``box.stop`` ran the final sync: ``N`` is the newest level-0 file's max TXID of the
    holder's generation (§5.1 step 1), with the database's sha256."""

    async def checkpoint(host: str, claim: Claim) -> Checkpoint:
        db = box.db_path(host)
        if not db.exists():
            return Checkpoint(None, "")
        assert claim.holder is not None
        scope = GenerationScope(claim.holder.location, claim.holder.generation)
        n = replication_position(await list_generation(box.data_store, box.data_bucket, scope))
        return Checkpoint(n, file_sha256(db))

    return checkpoint


__all__ = ["SourceBox", "SourceWorker", "StagingConflict", "StepResult", "replica_checkpoint_for"]
