"""The source's recovery in a rollback (spec §7.8 "Source recovery", the clean return): re-read, act, journal
``rollback.source_phase`` (:mod:`services.move.rollback`). Nothing survives in memory (§7.13): the claim CAS is
conditional, the hold and the open are conditional updates, ``verify`` only reads, and the probe is an
``AdmitWriter`` restarted (a new admission) only when its process is gone. Once ``probing`` is journaled ``verify``
never runs again: the probe's writes are authoritative (INV-2, INV-7).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from services.box.instance.activator import Activator, Started
from services.box.instance.registry import Registry
from services.box.instance.timers import Timers
from services.ledger.ledger import Committed, Ledger, NoChange, Refusal
from services.move import rollback
from services.move.finalize import Finalizer
from services.move.stepping import RunnerResult, until_still
from services.source.reverting import unchanged_since_stop

log = logging.getLogger("hostmove.source.rollback")

CLEAN_RETURN = "clean-return"
"""The source's re-admission after a clean release is covered (§5.1 step 9): nothing is declared lost."""


@dataclass
class RollbackRecovery:
    """One source box's recoveries of its rolled-back moves."""

    label: str
    ledger: Ledger
    registry: Registry
    timers: Timers
    activator: Activator
    final: Finalizer
    files_dir: Callable[[str], Path]

    async def run(self, host: str, move_id: str, *, max_steps: int = 10) -> RunnerResult:
        return await until_still(lambda: self.step(host, move_id), RunnerResult(False, "no step taken"), max_steps)

    async def _wake(self, host: str) -> str:
        """Start the instance when its process is gone; answers why it did not start, or ``""``."""
        if host in self.activator.running:
            return ""
        started = await self.activator.wake(host, coverage=CLEAN_RETURN)
        return "" if isinstance(started, Started) else f"the recovery probe did not start: {started.reason}"

    async def step(self, host: str, move_id: str) -> RunnerResult:
        record = (await self.ledger.read_record(host)).state
        claim = (await self.ledger.read_claim(host)).state
        if record is not None and record.last_move is not None and record.last_move.id == move_id:
            report = await self.final.close(host, move_id)
            return RunnerResult(False, "" if report.done else report.reason, report)
        got = rollback.live_rollback(record, move_id)
        if isinstance(got, Refusal) or claim is None or record is None:
            return RunnerResult(False, got.reason if isinstance(got, Refusal) else "the host has no claim")
        move, rb = got
        if rb.target_phase not in ("released", "cleaning", "cleaned") or rb.dirty:
            return RunnerResult(False, f"waiting for the target to release ({rb.target_phase or 'not started'})")
        phase = rb.source_phase
        now = self.ledger.clock.now_ms()
        if phase == "":
            out = await self.ledger.transition("claim", host, "rollback-source-claimed",
                                               lambda c: rollback.decide_source_claimed(c, move_id, self.label))
            if isinstance(out, Refusal):
                return RunnerResult(False, out.reason)
            return await self._phase(host, move_id, "", "claimed")
        if phase == "claimed":  # verified: the source's own files and timers, as the cut recorded them
            if not self.registry.hold(host, "restoring", rb.id, replaces=move_id):
                return RunnerResult(False, f"the route of {host} is held by another operation")
            why = await unchanged_since_stop(record, self.files_dir(host), self.timers, host)
            if why is not None:
                reason = f"the rollback's source recovery is stuck: {why}"
                await self.ledger.transition("record", host, "rollback-stuck",
                                             lambda r: rollback.decide_stuck(r, move_id, reason, now))
                return RunnerResult(False, reason)
            return await self._phase(host, move_id, "claimed", "verified")
        if phase == "verified":
            return await self._phase(host, move_id, "verified", "probing")
        if phase == "probing":
            why_not = await self._wake(host)
            if why_not:
                return RunnerResult(False, why_not)
            return await self._phase(host, move_id, "probing", "probed")
        if phase == "probed":
            return await self._phase(host, move_id, "probed", "recovered", recovered_at=now)
        if phase == "recovered":
            why_not = await self._wake(host)
            if why_not:
                return RunnerResult(False, why_not)
            if not self.registry.leave_hold(host, rb.id):
                row = self.registry.get(host)
                if row is not None and row.hold_op == rb.id:
                    return RunnerResult(False, "the open did not match the route's hold")
            return await self._phase(host, move_id, "recovered", "opened", opened_at=now)
        why_not = await self._wake(host)  # opened: it serves while the close waits for the target's parks
        if why_not:
            log.warning("%s not restarted while its rollback closes: %s", host, why_not)
        report = await self.final.source_park_unmoved(host, move_id)
        return RunnerResult(False, "" if report.done else report.reason, report)

    async def _phase(self, host: str, move_id: str, before: str, after: str, **fields: int) -> RunnerResult:
        out = await self.ledger.transition("record", host, f"rollback-source-{after}", lambda r: (
            rollback.decide_source_phase(r, move_id, before, after, **fields)))
        if isinstance(out, Committed | NoChange):
            return RunnerResult(True)
        if isinstance(out, Refusal):
            return RunnerResult(False, out.reason)
        return RunnerResult(False, "another writer kept changing the record; the next wake retries")


__all__ = ["CLEAN_RETURN", "RunnerResult", "RollbackRecovery"]
