"""The target's release in a rollback (spec §7.8 "Target release"; D§3.5): re-read, act, journal
``rollback.target_phase`` (:mod:`services.move.rollback`). Nothing survives in memory: a restarted agent continues
from the record, the claim and the box's actual process state (§7.13); the stop evidence is
``ReconstructStopEvidence`` (create-only, reused), the return lane is rewritten by version and sealed only by the
``returned`` CAS (:mod:`services.target.returning`), the parks are the finalizer's (by exact versions, acknowledged
after the horizon).

| phase     | effects (run when the journal names the phase)                                               |
|-----------|----------------------------------------------------------------------------------------------|
| releasing | row ``releasing`` (``hold_op`` = rollback id), the probe stopped, stop evidence; the verdict |
| released  | the claim: exec -> none citing ``stopped-target.json`` with the target's parks (K3)          |
| returning | dirty: the return lane in the source region's bucket                                         |
| returned  | dirty: waits for the source's ``recovered_at``                                               |
| cleaning  | parks its location and the forward lane, the local park, ``target_parked_at``                |
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from dataclasses import dataclass

from events.claim import Claim
from kernel.ports import blocking
from services.box.artifacts.archive import ArchiveError, plain_digest
from services.box.instance.evidence import (
    Checkpoint,
    EvidenceFor,
    EvidenceRefused,
    StopHooks,
    file_sha256,
    lease_file_check,
    reconstruct_stop_evidence,
)
from services.box.replica.install import InstallError
from services.box.replica.layout import GenerationScope, list_generation
from services.box.replica.planner import replication_position
from services.ledger.ledger import Committed, NoChange, Refusal
from services.move import rollback
from services.move.finalize import Finalizer, LocalRetire
from services.move.stepping import RunnerResult, until_still
from services.target.returning import ReturnFailed, ReturnLane, publish_return
from services.target.worker import LandingFailure, LandingWorker, read_seal

log = logging.getLogger("hostmove.target.release")

NO_FILES = hashlib.sha256(b"").hexdigest()
"""The files digest of a box that holds no files directory for the host (a landing stopped before ``local``)."""


@dataclass
class TargetRelease:
    """One target box's releases (the landing worker's box, its finalizer for the target region's bucket)."""

    worker: LandingWorker
    final: Finalizer
    local: LocalRetire
    lanes: Callable[[str], ReturnLane] | None = None
    """A region's return lane (its store, bucket and public key), for a dirty release's ``returning``."""

    async def run(self, host: str, move_id: str, *, max_steps: int = 8) -> RunnerResult:
        return await until_still(lambda: self.step(host, move_id), RunnerResult(False, "no step taken"), max_steps)

    async def step(self, host: str, move_id: str) -> RunnerResult:
        box = self.worker.box
        ledger = box.ledger
        record = (await ledger.read_record(host)).state
        claim = (await ledger.read_claim(host)).state
        if record is not None and record.last_move is not None and record.last_move.id == move_id:
            report = await self.final.close(host, move_id)
            return RunnerResult(False, "" if report.done else report.reason, report)
        got = rollback.live_rollback(record, move_id)
        if isinstance(got, Refusal) or claim is None:
            return RunnerResult(False, got.reason if isinstance(got, Refusal) else "the host has no claim")
        move, rb = got
        phase = rb.target_phase
        if phase == "":
            return self._outcome(await ledger.transition("record", host, "rollback-target-releasing",
                                                         lambda r: rollback.decide_target_phase(
                                                             r, move_id, "", "releasing")))
        if phase == "releasing":
            return await self._release(host, move_id, claim)
        if phase == "released":
            now = box.clock.now_ms()
            out = await ledger.transition("claim", host, "rollback-target-released", lambda c: (
                rollback.decide_target_released(c, move_id, box.label, rb.evidence, region=box.region,
                                                evidence_at=now)))
            if isinstance(out, Refusal):
                return RunnerResult(False, out.reason)
            if rb.dirty:  # §7.8 returning: the handoff back
                return self._outcome(await ledger.transition("record", host, "rollback-target-returning",
                                                             lambda r: rollback.decide_target_phase(
                                                                 r, move_id, "released", "returning")))
            return await self._clean_after(host, move_id, rb.recovered_at, "released")
        if phase == "returning":
            return await self._return(host, move_id, claim)
        if phase == "returned":
            return await self._clean_after(host, move_id, rb.recovered_at, "returned")
        if phase == "cleaning":
            report = await self.final.target_release_park(host, move_id, self.local)
            return RunnerResult(False, "" if report.done else report.reason, report)
        report = await self.final.close(host, move_id)  # cleaned: the close waits for the source's part
        return RunnerResult(False, "" if report.done else report.reason, report)

    async def _release(self, host: str, move_id: str, claim: Claim) -> RunnerResult:
        """``releasing``'s effects: hold the row, stop the probe, the stop evidence; then ``released`` with the
        verdict (§7.8)."""
        box = self.worker.box
        record = (await box.ledger.read_record(host)).state
        got = rollback.live_rollback(record, move_id)
        if isinstance(got, Refusal):
            return RunnerResult(False, got.reason)
        move, rb = got
        if box.registry.get(host) is not None and not box.registry.hold(host, "releasing", rb.id, replaces=move_id):
            return RunnerResult(False, f"the route of {host} is held by another operation; the release waits")
        await self.worker.stop_probe(host)
        assert claim.holder is not None
        holder = claim.holder
        db = box.db_path(host)

        async def final() -> Checkpoint:
            if not db.exists():
                return Checkpoint(None, "")
            if box.flush_orphan is not None and self.worker.running.get(host) is None:
                # §5.3 step 5: a probe killed with its box (a reboot) left its writes in the WAL; hashed without
                # this checkpoint the database read as installed, the release clean and the probe's row was lost
                await box.flush_orphan(host)
            scope = GenerationScope(holder.location, holder.generation)
            n = replication_position(await list_generation(box.data_store, box.data_bucket, scope))
            return Checkpoint(n, file_sha256(db))

        async def files() -> str:  # a landing stopped before local installed none: the empty state's digest
            path = box.files_dir(host)
            return (await blocking(plain_digest, path, None, host=host)).plain if path.exists() else NO_FILES

        async def timers() -> str:
            return box.timers.digest(host)

        if box.tree is None:
            return RunnerResult(False, "this box has no process tree; it cannot prove its probe stopped")
        hooks = StopHooks(lease_file_check(box.data_dir / f"{host}.lease.json", box.clock, 1_000), final, files,
                          timers)
        subject = EvidenceFor(host, move_id, "target", box.label, move.incarnation, claim.gen)
        ev = await reconstruct_stop_evidence(tree=box.tree, store=box.ledger.store, bucket=box.ledger.bucket,
                                             clock=box.clock, subject=subject, db_path=db, hooks=hooks)
        if isinstance(ev, EvidenceRefused):
            return RunnerResult(False, ev.message)
        seal = claim.op.journal.get("seal")
        covered = bool(seal.get("src_covered")) if isinstance(seal, dict) else False
        dirty, why = rollback.release_verdict(move, src_covered=covered, db_sha256=ev.evidence.db_sha256,
                                              files_plain=ev.evidence.files_sha256,
                                              timers_sha256=ev.evidence.timers_sha256)
        log.info("release of %s for %s: %s (%s)", host, rb.id, "dirty" if dirty else "clean", why)
        out = await box.ledger.transition("record", host, "rollback-target-released", lambda r: (
            rollback.decide_target_phase(r, move_id, "releasing", "released", dirty=dirty, evidence=ev.key)))
        return self._outcome(out)

    async def _clean_after(self, host: str, move_id: str, recovered_at: int | None, before: str) -> RunnerResult:
        """``cleaning`` only after the source recorded ``recovered_at`` (§7.8): until then a source failure might
        need the target's state again."""
        if recovered_at is None:
            return RunnerResult(False, "waiting for the source to recover")
        return self._outcome(await self.worker.box.ledger.transition(
            "record", host, "rollback-target-cleaning",
            lambda r: rollback.decide_target_phase(r, move_id, before, "cleaning")))

    async def _return(self, host: str, move_id: str, claim: Claim) -> RunnerResult:
        """``returning``'s effects (§7.8, dirty only): the return lane in the source region's bucket, then
        ``returned`` with its seal."""
        box = self.worker.box
        record = (await box.ledger.read_record(host)).state
        got = rollback.live_rollback(record, move_id)
        if isinstance(got, Refusal):
            return RunnerResult(False, got.reason)
        move, rb = got
        if self.lanes is None or claim.holder is None:
            return RunnerResult(False, "this box cannot reach the source region's bucket to return the host")
        try:
            seal = read_seal(claim)
            returned = await publish_return(box, self.lanes(move.from_), host, move, rb, seal,
                                            claim.holder.location, claim.holder.generation)
        except (LandingFailure, ReturnFailed, ArchiveError, InstallError, ValueError) as exc:
            log.warning("the return of %s for %s waits: %s", host, rb.id, exc)
            return RunnerResult(False, f"the return to {move.from_} could not be published: {exc}")
        self._fault("returning:published")
        return self._outcome(await box.ledger.transition("record", host, "rollback-target-returned", lambda r: (
            rollback.decide_target_phase(r, move_id, "returning", "returned", seal=returned))))

    def _fault(self, point: str) -> None:
        if self.worker.faults is not None:
            self.worker.faults(point)

    @staticmethod
    def _outcome(out: object) -> RunnerResult:
        if isinstance(out, Committed | NoChange):
            return RunnerResult(True)
        if isinstance(out, Refusal):
            return RunnerResult(False, out.reason)
        return RunnerResult(False, "another writer kept changing the object; the next wake retries")


__all__ = ["RunnerResult", "TargetRelease"]
