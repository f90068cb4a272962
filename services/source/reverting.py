"""The source's ``reverting`` runner (spec §7.4 "reverting"): re-read, plan (:mod:`services.source.revert`), act,
journal. Nothing survives in memory: a restarted runner continues from the record, the claim and the box's
actual process state (§7.13).

Each step's effects are idempotent: the hold is a conditional update, the stop and its evidence are
``ReconstructStopEvidence`` (create-only, reused), ``verify`` only reads, the probe is an ``AdmitWriter`` that is
restarted (a new admission) only when its process is gone, and the open is the conditional update on
``hold_op``. The journal write of the next ``rev_phase`` follows the effects it vouches for.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from events.claim import Claim
from events.record import Record
from kernel.ports import blocking
from services.box.artifacts.archive import plain_digest
from services.box.instance.activator import Activator, Started, StartFailed
from services.box.instance.registry import Registry
from services.box.instance.timers import Timers
from services.ledger.ledger import Committed, Ledger, NoChange, Refusal
from services.move.finalize import Finalizer, StepReport
from services.move.follow import claim_half
from services.move.resolve import retry_skips_verify
from services.move.stepping import until_still
from services.source import revert
from services.source.revert import RevertStep, RevPhase
from services.source.worker import SourceWorker

log = logging.getLogger("hostmove.source.reverting")


async def unchanged_since_stop(record: Record, files_dir: Path, timers: Timers, host: str) -> str | None:
    """The ``verify`` of a recovery on the source (§7.4 reverting, §7.8 ``verified``): its files and timers on this
    box are what the cut recorded at ``stopped``; answers why not, or None."""
    files = (await blocking(plain_digest, files_dir, None, host=host)).plain
    return revert.verify_refused(record, files, timers.digest(host))


@dataclass(frozen=True)
class RevertResult:
    """What one step did: ``progressed`` (step again now), or why it stopped (``reason``) and ``report`` when the
    finalizer answered (the close waits for the target's staging park)."""

    step: RevertStep
    progressed: bool
    reason: str = ""
    report: StepReport | None = None


@dataclass
class RevertRunner:
    """One source box's recovery of its reverting moves."""

    label: str
    ledger: Ledger
    registry: Registry
    timers: Timers
    activator: Activator
    cut: SourceWorker  # its stop_with_evidence is the evidence phase's stop
    final: Finalizer
    files_dir: Callable[[str], Path]
    probe_budget_ms: int = 15 * 60 * 1000
    """§7.4: fifteen minutes of failed probes are ``stuck``."""

    async def run(self, host: str, move_id: str, incarnation: str, *, max_steps: int = 12) -> RevertResult:
        return await until_still(lambda: self.step(host, move_id, incarnation),
                                 RevertResult(RevertStep("idle"), False, "no step taken"), max_steps)

    async def step(self, host: str, move_id: str, incarnation: str) -> RevertResult:
        record = (await self.ledger.read_record(host)).state
        claim = (await self.ledger.read_claim(host)).state
        st = revert.plan_revert(record, claim, source=self.label, move_id=move_id)
        log.info("revert step", extra={"host": host, "op": move_id, "box": self.label, "step": st.kind,
                                       "phase": st.phase})
        if st.kind in ("idle", "blocked"):
            return RevertResult(st, False, st.reason)
        assert record is not None and claim is not None
        if st.kind == "follow":
            out = await self.ledger.transition("claim", host, "move-follow", lambda c: claim_half(c, record))
            return self._outcome(st, out)
        if st.kind == "evidence":
            got = await self.cut.stop_with_evidence(host, claim, move_id, incarnation, hold="restoring")
            if isinstance(got, str):
                return RevertResult(st, False, got)
            return await self._phase(st, host, move_id, "evidence", "probing")
        if st.kind == "verify":
            return await self._verify(st, host, record, move_id)
        if st.kind in ("probe", "open"):
            if host not in self.activator.running:  # a probe whose process is gone is restarted (§7.4, §7.7)
                started = await self.activator.wake(host)
                if isinstance(started, StartFailed):  # fifteen minutes of failed probes: stuck (§7.4)
                    now, budget, why = self.ledger.clock.now_ms(), self.probe_budget_ms, started.reason
                    await self.ledger.transition("record", host, "revert-probe-failed", lambda r: (
                        revert.decide_revert_probe_failed(r, move_id, why, now, budget)))
                if not isinstance(started, Started):
                    return RevertResult(st, False, f"the recovery probe did not start: {started.reason}")
            if st.kind == "probe":
                return await self._phase(st, host, move_id, "probing", "probed")
            if not self.registry.leave_hold(host, move_id) and self._held_by(host, move_id):
                return RevertResult(st, False, "the open did not match the route's hold")
            return await self._phase(st, host, move_id, "probed", "opened")
        if host not in self.activator.running:  # opened: it serves while the close waits for the staging park
            started = await self.activator.wake(host)
            if not isinstance(started, Started):
                log.warning("%s not restarted while its revert closes: %s", host, started.reason)
        report = await self.final.source_park_unmoved(host, move_id)  # close
        return RevertResult(st, False, "" if report.done else report.reason, report)

    def _held_by(self, host: str, move_id: str) -> bool:
        row = self.registry.get(host)
        return row is not None and row.hold_op == move_id

    async def _verify(self, st: RevertStep, host: str, record: Record, move_id: str) -> RevertResult:
        """§7.4 ``verify``: the instance is stopped (the cut's evidence says so); its files and timers must be what
        ``stopped`` recorded, else the move is ``stuck`` with the reason."""
        if not self.registry.hold(host, "restoring", move_id):
            return RevertResult(st, False, f"the route of {host} is held by another operation")
        why = await unchanged_since_stop(record, self.files_dir(host), self.timers, host)
        if why is not None and not retry_skips_verify(record):  # an operator's --retry accepts them (§7.10)
            now = self.ledger.clock.now_ms()
            await self.ledger.transition("record", host, "revert-stuck",
                                         lambda r: revert.decide_stuck(r, move_id, f"the revert is stuck: {why}", now))
            return RevertResult(st, False, why)
        return await self._phase(st, host, move_id, "verify", "probing")

    async def _phase(self, st: RevertStep, host: str, move_id: str, before: RevPhase, after: RevPhase
                     ) -> RevertResult:
        def decide(c: Claim | None) -> Claim | NoChange | Refusal:
            return revert.decide_rev_phase(c, move_id, self.label, before, after)

        out = await self.ledger.transition("claim", host, f"revert-{after}", decide)
        return self._outcome(st, out)

    @staticmethod
    def _outcome(st: RevertStep, out: object) -> RevertResult:
        if isinstance(out, Committed | NoChange):
            return RevertResult(st, True)
        if isinstance(out, Refusal):
            return RevertResult(st, False, out.reason)
        return RevertResult(st, False, "another writer kept changing the claim; the next wake retries")


__all__ = ["RevertResult", "RevertRunner"]
