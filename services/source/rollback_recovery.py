"""The source's recovery in a rollback (spec §7.8 "Source recovery"; D§3.6): re-read, act, journal
``rollback.source_phase`` (:mod:`services.move.rollback`; rule ``rollback-journal``). Nothing survives in memory
(§7.13): the claim CAS is conditional, the hold and the open are conditional updates, ``verified`` only reads, the
dirty install's phases are §7.6's (:mod:`services.source.return_install`), and the probe is an ``AdmitWriter``
restarted (a new admission) only when its process is gone. Once ``probing`` is journaled no earlier phase runs
again: the probe's writes are authoritative (INV-2, INV-7). Nine failed probe attempts record ``stuck``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import msgspec

from events.claim import Claim, Obligation, Scope, WriterRef
from events.record import Move, Rollback
from kernel import rules
from services.box.instance.activator import Activator, Started, StartFailed, StartPolicy
from services.box.instance.registry import Registry
from services.box.instance.timers import Timers
from services.ledger.ledger import Committed, Ledger, NoChange, Refusal
from services.move import rollback
from services.move.finalize import PARK_STAGING, Finalizer, pending
from services.move.follow import staging_scope_location
from services.move.guards import step_allowed
from services.move.lost import declared_lost, loss_half_pending
from services.move.stepping import RunnerResult, until_still
from services.source.return_install import InstallRefused, ReturnInstall
from services.source.reverting import unchanged_since_stop

log = logging.getLogger("hostmove.source.rollback")

CLEAN_RETURN = "clean-return"
"""The source's re-admission after a clean release is covered (§5.1 step 9): nothing is declared lost."""

rules.register(
    "rollback-journal",
    section="§7.8 Source recovery (journaled, codex R2-3); §7.13; INV-2, INV-7; model rule rollback-journal",
    meaning="once the source's recovery journaled probing it never reruns verified: the probe's writes are its own",
    site="services/source/rollback_recovery.py RollbackRecovery.step (probing)",
)


def cut_session_lost(claim: Claim, target: str) -> tuple[WriterRef, ...]:
    """§7.10: when the seal was the one holder of the source's writes beyond its own replica (``src_covered``
    false), a lost target's clean return declares the source's **cut session** as well: the seal is in the lost
    target's region and no lane brings it. The session is the one the target's admission superseded."""
    seal = claim.op.journal.get("seal")
    if claim.holder is None or (isinstance(seal, dict) and seal.get("src_covered")):
        return ()
    landed = next((a for a in reversed(claim.holder.admissions) if a.box == target), None)
    cut = landed.predecessor if landed is not None else None
    if cut is None or not cut.box:
        return ()
    n = seal.get("n") if isinstance(seal, dict) else None
    return (WriterRef(box=cut.box, session=cut.session, generation=cut.generation,
                      remote_max_txid=n if isinstance(n, int) and not isinstance(n, bool) else 0),)


def decide_return_lane_owed(claim: Claim | None, move_id: str, source: str, region: str, rb_id: str, now_ms: int
                            ) -> Claim | NoChange | Refusal:
    """§7.8 ``probed`` (dirty): the return lane's ``park-staging`` on the claim, owned by the source box in its own
    region, scoped to ``moves/<host>/<rb>`` (every version the target wrote there, after the horizon)."""
    why = step_allowed(claim, op_id=move_id, kinds=("restoring",), exec_box=source)
    if why is not None or claim is None or claim.holder is None:
        return Refusal(why or "the claim names no holder")
    owed = Obligation(kind="park-staging", op=move_id, region=region, owner=source,
                      scope=Scope(location=staging_scope_location(claim.host, rb_id),
                                  incarnation=claim.holder.incarnation, evidence_at=now_ms))
    if any(o.kind == owed.kind and o.op == move_id and o.owner == source for o in claim.obligations):
        return NoChange("the return lane's park is already owed")
    return msgspec.structs.replace(claim, obligations=(*claim.obligations, owed))


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
    region: str = ""
    install: ReturnInstall | None = None
    """The dirty return's install phases (§7.8); without it a dirty recovery waits."""
    policy: StartPolicy | None = None
    """The starts of one recovery probe attempt (None: the activator's, §7.7)."""

    async def run(self, host: str, move_id: str, *, max_steps: int = 10) -> RunnerResult:
        return await until_still(lambda: self.step(host, move_id), RunnerResult(False, "no step taken"), max_steps)

    async def _wake(self, host: str, rb: Rollback, claim: Claim, *, count: bool) -> RunnerResult | None:
        """Start the instance when its process is gone (§7.8 ``probing``: an ``AdmitWriter``); None once it runs.
        A clean return's first admission after the target's is covered ``clean-return``; a dirty one is cold into
        ``g-<rb>`` from its seal the first time, and a restarted probe is a new admission restored from it. A failed
        attempt is counted (``count``): the ninth records ``stuck`` (§7.8, §7.10)."""
        if host in self.activator.running:
            return None
        holder = claim.holder
        last = holder.admissions[-1] if holder is not None and holder.admissions else None
        if rb.dirty and (holder is None or not any(a.generation == rb.id for a in holder.admissions)):
            started = await self.activator.wake(host, prepared=rb.id, policy=self.policy)
        else:
            target = claim.op.participants[1] if len(claim.op.participants) == 2 else ""
            if loss_half_pending(rb.evidence, claim, target):  # §7.10: the record's half came first; never covered
                return RunnerResult(False, f"the rollback cites {rb.evidence}, but the claim does not name {target} "
                                           f"lost yet: the recovery waits for the declaration's claim half (if the door"
                                           f" stopped between them, `hostmove move resolve --host {host} "
                                           f"--declare-lost {target} --yes` completes it)")
            lost = declared_lost(claim, target)  # §7.10: a lost box's writes since the flip are declared, never covered
            covered = not rb.dirty and not lost and (last is None or last.box != self.label)
            started = await self.activator.wake(host, coverage=CLEAN_RETURN if covered else "", policy=self.policy,
                                                declare=cut_session_lost(claim, target) if lost else ())
        if isinstance(started, Started):
            return None
        why = f"the recovery probe did not start: {started.reason}"
        if not count or not isinstance(started, StartFailed):
            return RunnerResult(False, why)
        now = self.ledger.clock.now_ms()
        out = await self.ledger.transition("record", host, "rollback-probe-failed", lambda r: (
            rollback.decide_probe_failed(r, claim.op.id, started.reason, now)))
        stuck = isinstance(out, Committed) and out.state.move is not None and out.state.move.state == "stuck"
        if stuck:
            log.error("%s is stuck: %s", host, why)
        return RunnerResult(False, why, stuck=stuck)

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
        phase = rb.source_phase
        now = self.ledger.clock.now_ms()
        if phase == "":
            return await self._phase(host, move_id, "", "waiting")
        if phase == "waiting":  # until released (clean) or returned (dirty), and exec none (§7.8)
            ready = ("returned", "cleaning", "cleaned") if rb.dirty else ("released", "cleaning", "cleaned")
            if rb.target_phase not in ready or claim.op.exec not in ("none", self.label):
                target = claim.op.participants[1] if len(claim.op.participants) == 2 else "the target"
                return RunnerResult(False, f"waiting for {target} to release ({rb.target_phase or 'not started'})")
            return await self._phase(host, move_id, "waiting", "claimed")
        if phase == "claimed":  # exec back to the source citing the target's evidence (K4), S's stamp
            seal = claim.op.journal.get("seal")
            covered = bool(seal.get("src_covered")) if isinstance(seal, dict) else False
            target = claim.op.participants[1] if len(claim.op.participants) == 2 else ""
            covered = covered or declared_lost(claim, target)  # a lost target: back to the source's own generation
            out = await self.ledger.transition("claim", host, "rollback-source-claimed", lambda c: (
                rollback.decide_source_claimed(c, move_id, self.label, clean=not rb.dirty, src_covered=covered)))
            if isinstance(out, Refusal):
                return RunnerResult(False, out.reason)
            return await self._phase(host, move_id, "claimed", "restoring")
        if phase == "restoring":
            if not self.registry.hold(host, "restoring", rb.id, replaces=move_id):
                return RunnerResult(False, f"the route of {host} is held by another operation")
            return await self._phase(host, move_id, "restoring", rollback.DIRTY_INSTALL[0] if rb.dirty else "verified")
        if phase == "verified":  # clean: the source's own files and timers, as the cut recorded them
            why = await unchanged_since_stop(record, self.files_dir(host), self.timers, host)
            if why is not None:
                return await self._stuck(host, move_id, f"the rollback's source recovery is stuck: {why}", now)
            return await self._phase(host, move_id, "verified", "probing")
        if phase in rollback.DIRTY_INSTALL:  # dirty: §7.6's install from the return lane (§7.8)
            return await self._install(host, move_id, phase, claim, move, rb)
        if phase == "probing":
            if not rules.on("rollback-journal") and not rb.dirty:  # the mutation: the recovery is not journaled
                why = await unchanged_since_stop(record, self.files_dir(host), self.timers, host)
                if why is not None:
                    return await self._stuck(host, move_id, f"the rollback's source recovery is stuck: {why}", now)
            failed = await self._wake(host, rb, claim, count=True)
            if failed is not None:
                return failed
            return await self._phase(host, move_id, "probing", "probed")
        if phase == "probed":  # dirty: the return lane's park-staging is queued now (§7.8)
            if rb.dirty:
                out = await self.ledger.transition("claim", host, "rollback-return-lane", lambda c: (
                    decide_return_lane_owed(c, move_id, self.label, self.region, rb.id, now)))
                if isinstance(out, Refusal):
                    return RunnerResult(False, out.reason)
            return await self._phase(host, move_id, "probed", "recovered", recovered_at=now)
        if phase == "recovered":
            failed = await self._wake(host, rb, claim, count=False)
            if failed is not None:
                return failed
            if not self.registry.leave_hold(host, rb.id):
                row = self.registry.get(host)
                if row is not None and row.hold_op == rb.id:
                    return RunnerResult(False, "the open did not match the route's hold")
            return await self._phase(host, move_id, "recovered", "opened", opened_at=now)
        failed = await self._wake(host, rb, claim, count=False)  # opened: it serves while the close waits
        if failed is not None:
            log.warning("%s not restarted while its rollback closes: %s", host, failed.reason)
        if pending(claim, move_id=move_id, kind=PARK_STAGING, owner=self.label) is not None:
            report = await self.final.staging_park(host, move_id)  # the return lane (§7.8 probed)
            if not report.done:
                return RunnerResult(False, report.reason, report)
        report = await self.final.source_park_unmoved(host, move_id)
        return RunnerResult(False, "" if report.done else report.reason, report)

    async def _install(self, host: str, move_id: str, phase: str, claim: Claim, move: Move, rb: Rollback
                       ) -> RunnerResult:
        """One install phase's effects on the source, then the next phase's journal (§7.6, §7.8)."""
        if self.install is None:
            return RunnerResult(False, "this box cannot install a dirty return (no install configured)")
        try:
            fields = await self.install.phase(phase, host, claim, move, rb)
        except InstallRefused as exc:
            return await self._stuck(host, move_id, f"the rollback's dirty install is stuck at {phase}: {exc}",
                                     self.ledger.clock.now_ms())
        i = rollback.DIRTY_INSTALL.index(phase)
        after = rollback.DIRTY_INSTALL[i + 1] if i + 1 < len(rollback.DIRTY_INSTALL) else "probing"
        return await self._phase(host, move_id, phase, after, **fields)

    async def _stuck(self, host: str, move_id: str, reason: str, now: int) -> RunnerResult:
        await self.ledger.transition("record", host, "rollback-stuck",
                                     lambda r: rollback.decide_stuck(r, move_id, reason, now))
        log.error("%s: %s", host, reason)
        return RunnerResult(False, reason, stuck=True)

    async def _phase(self, host: str, move_id: str, before: str, after: str, **fields: object) -> RunnerResult:
        out = await self.ledger.transition("record", host, f"rollback-source-{after}", lambda r: (
            rollback.decide_source_phase(r, move_id, before, after, **fields)))
        if isinstance(out, Committed | NoChange):
            return RunnerResult(True)
        if isinstance(out, Refusal):
            return RunnerResult(False, out.reason)
        return RunnerResult(False, "another writer kept changing the record; the next wake retries")


__all__ = ["CLEAN_RETURN", "RollbackRecovery", "RunnerResult", "decide_return_lane_owed"]
