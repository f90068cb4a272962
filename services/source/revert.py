"""``reverting``: the source's pre-flip recovery (spec §7.4 "reverting", codex 4, joint N11; D§3.3). Pure.

A cut that cannot finish before the flip (its ``cut_deadline`` passed at any phase after ``admitted``) is recovered
by the source, which the record still names:

1. **The decision**, one record CAS ``cutting -> reverting`` with the reason (:func:`decide_revert`); ``cut_phase``
   stays, so the recovery knows where the cut stopped.
2. **The claim half** (:func:`services.move.follow.claim_half`): ``moving -> reverting`` with the source as
   ``exec`` (citing its stop evidence when the cut had moved ``exec`` to ``none``, K4), ``rev_phase`` in the op
   journal, and the ``park-staging`` the target region owes for whatever the rounds staged (§7.11).
3. **The journaled recovery**, ``op.journal.rev_phase`` (:func:`plan_revert`, :func:`decide_rev_phase`):

| rev_phase | effects                                                                   | replay                   |
|-----------|---------------------------------------------------------------------------|--------------------------|
| evidence  | from ``admitted``/``stopping``: hold ``restoring``, stop, evidence (§5.3)  | replayable               |
| verify    | from ``stopped``/``staged``/``archived``: files and timers digests as at stop | until probing           |
| probing   | start the instance under the ``restoring`` hold (an ``AdmitWriter``)        | restarts only the probe  |
| probed    | the conditional open on ``hold_op = move id``                               | replayable               |
| opened    | waits for ``park-staging``; the close (``rolled_back``, record first)       |                          |

Once ``probing`` is journaled ``verify`` never runs again: the probe's app may have written (joint N11).

A digest mismatch at ``verify`` is ``stuck`` (the record's state, with the reason; an operator's case, §7.10).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal

import msgspec

from events.claim import Claim
from events.record import Record
from services.ledger.ledger import NoChange, Refusal
from services.move.guards import step_allowed

RevPhase = Literal["evidence", "verify", "probing", "probed", "opened"]
REV_PHASES: Final[tuple[RevPhase, ...]] = ("evidence", "verify", "probing", "probed", "opened")
REVERTIBLE_CUT_PHASES: Final = ("admitted", "stopping", "stopped", "staged", "archived")
"""Where a cut may be reverted from: after its admission, before the flip (§7.4)."""


def first_rev_phase(cut_phase: str) -> RevPhase:
    """``evidence`` when the cut had not taken stop evidence (``admitted``, ``stopping``), else ``verify``."""
    return "evidence" if cut_phase in ("admitted", "stopping") else "verify"


def decide_revert(record: Record | None, move_id: str, incarnation: str, now_ms: int, reason: str
                  ) -> Record | NoChange | Refusal:
    """The record CAS ``cutting -> reverting`` (§7.4): only before the flip, from a cut past its admission."""
    if record is None or record.move is None:
        return Refusal("the host has no move to revert")
    move = record.move
    if move.id != move_id or move.incarnation != incarnation:
        return Refusal("the record holds another move")
    if move.state == "reverting":
        return NoChange("the move is already reverting")
    if move.state != "cutting" or move.cut_phase not in REVERTIBLE_CUT_PHASES:
        return Refusal(f"the move is {move.state}/{move.cut_phase or '-'}; only a cut between its admission and "
                       "its flip is reverted")
    return msgspec.structs.replace(record, move=msgspec.structs.replace(
        move, state="reverting", reason=reason, updated_at=now_ms))


def rev_phase(claim: Claim) -> str:
    value = claim.op.journal.get("rev_phase")
    return value if isinstance(value, str) else ""


def decide_rev_phase(claim: Claim | None, move_id: str, source: str, before: RevPhase, after: RevPhase
                     ) -> Claim | NoChange | Refusal:
    """The journal write of the next ``rev_phase`` (written before its effects), from ``before`` only."""
    why = step_allowed(claim, op_id=move_id, kinds=("reverting",), exec_box=source)
    if why is not None or claim is None:
        return Refusal(why or "the host has no claim")
    current = rev_phase(claim)
    if current == after:
        return NoChange(f"the recovery is already {after}")
    if current != before:
        return Refusal(f"the recovery is {current or 'not journaled'}, not {before}; it does not enter {after}")
    journal = {**claim.op.journal, "rev_phase": after}
    return msgspec.structs.replace(claim, op=msgspec.structs.replace(claim.op, journal=journal))


RevertKind = Literal["idle", "blocked", "follow", "evidence", "verify", "probe", "open", "close"]


@dataclass(frozen=True)
class RevertStep:
    """The recovery's next step: ``follow`` writes the claim half; ``evidence``, ``verify``, ``probe`` and
    ``open`` run the effects of the phase the journal names and then journal the next; ``close`` is the
    finalizer's (it waits for the staging park)."""

    kind: RevertKind
    phase: str = ""
    reason: str = ""


def plan_revert(record: Record | None, claim: Claim | None, *, source: str, move_id: str) -> RevertStep:
    """The source's next recovery step, from the record and the claim alone (§7.13)."""
    if record is None or record.move is None or record.move.id != move_id:
        return RevertStep("idle", reason="the record holds no such move")
    move = record.move
    if move.state != "reverting":
        return RevertStep("idle", reason=f"the move is {move.state}, not reverting")
    if claim is not None and claim.op.id == move_id and claim.op.kind == "moving":
        return RevertStep("follow")
    why = step_allowed(claim, op_id=move_id, kinds=("reverting",), exec_box=source)
    if why is not None or claim is None:
        return RevertStep("blocked", reason=why or "the host has no claim")
    phase = rev_phase(claim)
    if phase == "evidence":
        return RevertStep("evidence", phase)
    if phase == "verify":
        return RevertStep("verify", phase)
    if phase == "probing":
        return RevertStep("probe", phase)
    if phase == "probed":
        return RevertStep("open", phase)
    if phase == "opened":
        return RevertStep("close", phase)
    return RevertStep("blocked", phase, f"the claim names an unknown recovery phase {phase!r}")


def verify_refused(record: Record, files_plain: str, timers_sha256: str) -> str | None:
    """§7.4 ``verify``: the files and timers on the box are what the cut recorded at ``stopped``, or why not."""
    assert record.move is not None
    src = record.move.source
    if src.files.plain and files_plain != src.files.plain:
        return f"the files changed after the stop ({files_plain} is not the recorded {src.files.plain})"
    if src.timers_sha256 and timers_sha256 != src.timers_sha256:
        return "the timers changed after the stop (their digest is not the one recorded at stopped)"
    return None


def decide_stuck(record: Record | None, move_id: str, reason: str, now_ms: int) -> Record | NoChange | Refusal:
    """``reverting -> stuck`` with the reason: the recovery cannot go on without an operator (§7.4, §7.10)."""
    if record is None or record.move is None or record.move.id != move_id:
        return Refusal("the record holds no such move")
    move = record.move
    if move.state == "stuck":
        return NoChange("the move is already stuck")
    if move.state != "reverting":
        return Refusal(f"the move is {move.state}, not reverting")
    return msgspec.structs.replace(record, move=msgspec.structs.replace(
        move, state="stuck", reason=reason, stuck_at=now_ms, updated_at=now_ms))


def decide_revert_probe_failed(record: Record | None, move_id: str, why: str, now_ms: int, budget_ms: int
                               ) -> Record | NoChange | Refusal:
    """A failed ``reverting`` probe (§7.4): the first failure's time is recorded (``recovery_failed_at``, or the
    operator's ``retried_at`` when later); once failures have lasted ``budget_ms`` (fifteen minutes) the move records
    ``stuck`` with the reason, held for an operator (§7.10)."""
    if record is None or record.move is None or record.move.id != move_id:
        return Refusal("the record holds no such move")
    move = record.move
    if move.state != "reverting":
        return Refusal(f"the move is {move.state}, not reverting")
    first = move.recovery_failed_at
    if first is None or (move.retried_at is not None and move.retried_at > first):
        return msgspec.structs.replace(record, move=msgspec.structs.replace(
            move, recovery_failed_at=now_ms, updated_at=now_ms))
    if now_ms - first < budget_ms:
        return NoChange("the revert's probe keeps failing; within its fifteen minutes")
    reason = f"the revert's probe has failed for {(now_ms - first) // 60_000} minutes: {why}"
    return msgspec.structs.replace(record, move=msgspec.structs.replace(
        move, state="stuck", reason=reason, stuck_at=now_ms, updated_at=now_ms))


__all__ = ["REVERTIBLE_CUT_PHASES", "REV_PHASES", "RevPhase", "RevertStep", "decide_rev_phase", "decide_revert",
           "decide_revert_probe_failed", "decide_stuck", "first_rev_phase", "plan_revert", "rev_phase",
           "verify_refused"]
