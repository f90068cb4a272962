"""The rollback after the flip (spec §7.8), pure: the record's ``rollback`` journal, the claim's halves and the
clean-or-dirty decision.

The trigger (a landing failure, or ``landing_deadline``) is the target's record CAS ``landing -> rolling_back``
(:func:`services.target.phases.decide_rollback`); the claim follows to ``restoring`` with ``exec`` still the
target. Then two journals in ``move.rollback``, each phase written before its effects:

| target (``target_phase``) | effects                                                                    |
|---------------------------|----------------------------------------------------------------------------|
| releasing                 | row ``releasing`` (``hold_op`` = rollback id), stop the probe, stop evidence |
| released                  | clean or dirty (:func:`release_verdict`), ``stopped-target.json``; the claim: |
|                           | exec -> none citing it, the target's ``park-superseded`` and ``park-staging``  |
| cleaning                  | after the source's ``recovered_at``: park its location and its staging lane, local park |
| cleaned                   | ``target_parked_at``; the obligations dropped                               |

| source (``source_phase``) | effects                                                                    |
|---------------------------|----------------------------------------------------------------------------|
| claimed                   | the claim: exec none -> source, citing the target's evidence (K4)           |
| verified                  | row ``restoring`` (``hold_op`` = rollback id); files and timers as at ``stopped`` |
| probing, probed           | the probe: an ``AdmitWriter`` with coverage ``clean-return`` (§5.1 step 9)   |
| recovered                 | ``recovered_at``                                                           |
| opened                    | the conditional open on the rollback id; ``opened_at``                      |

The close (record first, ``last_move = rolled_back``, then the release to ``serving`` on the source) waits for
``recovered_at``, ``opened_at``, ``target_parked_at``, the source's own snapshot retirement and every obligation.

**Built here: the clean return.** A dirty release (the target's probe wrote, or the source's replica did not cover
its stopped database, ``src_covered`` false) needs the return lane (``returning``, ``returned`` and the source's
install phases); that is not built, so a dirty release records ``stuck`` with its reason and pages: an operator
decides (§7.10). Nothing is lost by it: the target's database and the seal stay where they are.
"""

from __future__ import annotations

from typing import Any, Final

import msgspec

from events.claim import Claim, Obligation, Scope
from events.record import Move, Record, Rollback
from kernel import rules
from services.box.instance.coverage import cover_region_predecessors
from services.ledger.ledger import NoChange, Refusal
from services.move.follow import staging_scope_location
from services.move.guards import step_allowed

TARGET_PHASES: Final = ("releasing", "released", "cleaning", "cleaned")
SOURCE_PHASES: Final = ("claimed", "verified", "probing", "probed", "recovered", "opened")
PROBED_LANDING: Final = frozenset({"probing", "probed"})
"""Landing phases from which the target's probe may have written: before them a release is clean by itself."""


def live_rollback(record: Record | None, move_id: str) -> tuple[Move, Rollback] | Refusal:
    if record is None or record.move is None or record.move.id != move_id:
        return Refusal("the record holds no such move")
    move = record.move
    if move.state != "rolling_back" or move.rollback is None:
        return Refusal(f"the move is {move.state}, not rolling back")
    return move, move.rollback


def _phase(record: Record | None, move_id: str, field: str, order: tuple[str, ...], before: str, after: str,
           fields: dict[str, Any]) -> Record | NoChange | Refusal:
    got = live_rollback(record, move_id)
    if isinstance(got, Refusal):
        return got
    assert record is not None
    move, rb = got
    current = getattr(rb, field)
    if current == after or (current in order and order.index(current) > order.index(after)):
        return NoChange(f"{field} is already {current}")
    if current != before:
        return Refusal(f"{field} is {current or 'not started'}, not {before or 'not started'}; {after} waits")
    new_rb = msgspec.structs.replace(rb, **{field: after}, **fields)
    return msgspec.structs.replace(record, move=msgspec.structs.replace(move, rollback=new_rb))


def decide_target_phase(record: Record | None, move_id: str, before: str, after: str, **fields: Any
                        ) -> Record | NoChange | Refusal:
    """The journal write of the target's next release phase, from ``before`` only (``""`` = not started)."""
    return _phase(record, move_id, "target_phase", TARGET_PHASES, before, after, fields)


def decide_source_phase(record: Record | None, move_id: str, before: str, after: str, **fields: Any
                        ) -> Record | NoChange | Refusal:
    """The journal write of the source's next recovery phase, from ``before`` only."""
    return _phase(record, move_id, "source_phase", SOURCE_PHASES, before, after, fields)


def release_verdict(move: Move, *, src_covered: bool, db_sha256: str, files_plain: str, timers_sha256: str
                    ) -> tuple[bool, str]:
    """§7.8 ``released``: ``(dirty, why)``. Clean when the landing never reached its probe, or when the database,
    the files and the timers are what was installed; **and** the seal recorded ``src_covered`` (rev 7.11)."""
    if not src_covered:
        return True, "the source's own replica did not reach its stopped database (src_covered is false)"
    if move.landing_phase not in PROBED_LANDING:
        return False, f"the landing stopped at {move.landing_phase or 'its start'}, before its probe"
    if move.landing.installed_db_sha256 and db_sha256 != move.landing.installed_db_sha256:
        return True, "the target's database changed after it was installed (its probe wrote)"
    if move.source.files.plain and files_plain and files_plain != move.source.files.plain:
        return True, "the target's files changed after they were installed"
    if move.source.timers_sha256 and timers_sha256 != move.source.timers_sha256:
        return True, "the target's timers changed after they were installed"
    return False, "the target's database, files and timers are what was installed"


def decide_target_released(claim: Claim | None, move_id: str, target: str, evidence: str, *, region: str,
                           evidence_at: int) -> Claim | NoChange | Refusal:
    """The claim half of ``released`` (§7.8, K3): exec target -> none citing the target's stop evidence, and in the
    same write the target's obligations: ``park-superseded`` for its location in its region and ``park-staging``
    for the lane, both owned by the target and discharged by its ``cleaning``."""
    why = step_allowed(claim, op_id=move_id, kinds=("restoring",))
    if why is not None or claim is None or claim.holder is None:
        return Refusal(why or "the claim names no holder")
    op = claim.op
    if evidence and op.journal.get("evidence.target") == evidence:
        return NoChange("the target's release is already on the claim")
    if op.exec != target:
        return Refusal(f"the execution holder is {op.exec}, not the target {target}")
    if rules.on("exec-needs-evidence") and not evidence:
        return Refusal("the target names no stop evidence; execution does not leave it without it (K3)")
    inc = claim.holder.incarnation
    owed = (
        Obligation(kind="park-superseded", op=move_id, region=region, owner=target,
                   scope=Scope(location=claim.holder.location.rstrip("/"), incarnation=inc, evidence_at=evidence_at)),
        Obligation(kind="park-staging", op=move_id, region=region, owner=target,
                   scope=Scope(location=staging_scope_location(claim.host, move_id), incarnation=inc,
                               evidence_at=evidence_at)),
    )
    journal = {**op.journal, "evidence.target": evidence}
    released = msgspec.structs.replace(
        claim, op=msgspec.structs.replace(op, exec="none", journal=journal),
        obligations=claim.obligations + tuple(o for o in owed if o not in claim.obligations))
    # CoverRegionPredecessors (§7.14 item 6): the target region's whole-location park covers the records whose
    # predecessors are there (a restarted probe's dead generations); the source's recovery is born covered after it
    return cover_region_predecessors(released, region) if owed else released


def decide_source_claimed(claim: Claim | None, move_id: str, source: str) -> Claim | NoChange | Refusal:
    """§7.8 ``claimed``: exec none -> the source, citing the target's evidence (K4)."""
    why = step_allowed(claim, op_id=move_id, kinds=("restoring",))
    if why is not None or claim is None:
        return Refusal(why or "the host has no claim")
    op = claim.op
    if op.exec == source:
        return NoChange("the source already holds execution")
    if op.exec != "none":
        return Refusal(f"the execution holder is {op.exec}; the source waits for the target's release")
    if rules.on("exec-needs-evidence") and not op.journal.get("evidence.target"):
        return Refusal("the claim cites no target evidence; execution does not return without it (K4)")
    return msgspec.structs.replace(claim, op=msgspec.structs.replace(op, exec=source))


def decide_stuck(record: Record | None, move_id: str, reason: str, now_ms: int) -> Record | NoChange | Refusal:
    """``rolling_back -> stuck`` with the reason (§7.8, §7.10): the recovery waits for an operator."""
    got = live_rollback(record, move_id)
    if isinstance(got, Refusal):
        if record is not None and record.move is not None and record.move.state == "stuck":
            return NoChange("the move is already stuck")
        return got
    assert record is not None
    move, _rb = got
    return msgspec.structs.replace(record, move=msgspec.structs.replace(
        move, state="stuck", reason=reason, updated_at=now_ms))


__all__ = ["PROBED_LANDING", "SOURCE_PHASES", "TARGET_PHASES", "decide_source_claimed", "decide_source_phase",
           "decide_stuck", "decide_target_phase", "decide_target_released", "live_rollback", "release_verdict"]
