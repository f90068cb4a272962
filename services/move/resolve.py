"""The operator's ways out of a held state (spec §7.10, §12; issue 13 item 5), pure.

- ``hostmove move resolve --host H --retry`` (``POST /v1/hosts/{host}/move/resolve {"retry": true}``): a ``stuck``
  move's recovery runs its ``probing`` phase again, a new admission (:func:`decide_retry`). One record CAS: ``stuck ->
  rolling_back`` (a rollback's source recovery, §7.8) or ``stuck -> reverting`` (§7.4), ``retried_at`` stamped, the
  failure count and clock started again. A recovery stuck before its probe (a clean ``verified`` mismatch, INV-4, or
  a revert's ``verify``) goes on to ``probing``: the operator accepts the box's files and timers as they are; one
  stuck in a dirty install phase reruns that phase (each is replayable, §7.6). Refused, with its sentence, in every
  other state.
- ``hostmove host resolve --host H --clear-failed``: a route the retry policy marked ``failed`` (a serving wake's
  fifth failed start, §5.1 step 9) is box-local state, so the door journals the request on the claim
  (:func:`decide_clear_failed`: ``op.journal.clear_failed``) and the serving box clears its row and the request
  (:func:`decide_clear_failed_done`). Refused while a move (or any operation) holds the host.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from events.claim import Claim
from events.record import Record
from services.ledger.ledger import NoChange, Refusal
from services.move.rollback import DIRTY_INSTALL

CLEAR_FAILED = "clear_failed"
"""The op journal key of a pending ``--clear-failed`` request: ``{"at": ms, "by": operator}``."""
RETRY_PROBING_FROM = frozenset({"verified", "probing", "probed", "recovered"})
"""A stuck rollback's source phases from which ``--retry`` reruns ``probing``."""


@dataclass(frozen=True)
class NotStuck(Refusal):
    """The move is not ``stuck``: ``state`` names what it is (``""``: there is no move)."""

    state: str = ""


def decide_retry(record: Record | None, claim: Claim | None, now_ms: int) -> Record | NotStuck:
    """§7.10 ``--retry``: the record CAS out of ``stuck`` (module docstring)."""
    move = record.move if record is not None else None
    if record is None or move is None:
        return NotStuck("the host has no move", "")
    if move.state != "stuck":
        return NotStuck(f"the move is {move.state}, not stuck", move.state)
    if claim is None or claim.op.id != move.id or claim.op.kind not in ("restoring", "reverting"):
        return NotStuck("the claim does not hold this move's recovery", move.state)
    rb = move.rollback
    if rb is not None:
        phase = "probing" if rb.source_phase in RETRY_PROBING_FROM or not rb.source_phase else rb.source_phase
        if phase not in (*DIRTY_INSTALL, "probing"):
            phase = "probing"
        new_rb = msgspec.structs.replace(rb, source_phase=phase, probe_failures=0, retried_at=now_ms)
        return msgspec.structs.replace(record, move=msgspec.structs.replace(
            move, state="rolling_back", rollback=new_rb, retried_at=now_ms, recovery_failed_at=None,
            reason=f"retried by the operator after: {move.reason}"[:1000], updated_at=now_ms))
    return msgspec.structs.replace(record, move=msgspec.structs.replace(
        move, state="reverting", retried_at=now_ms, recovery_failed_at=None,
        reason=f"retried by the operator after: {move.reason}"[:1000], updated_at=now_ms))


def retry_skips_verify(record: Record) -> bool:
    """A revert the operator retried goes on to its probe without comparing the files again (§7.10 ``--retry``)."""
    return record.move is not None and record.move.retried_at is not None


def decide_clear_failed(claim: Claim | None, operator: str, now_ms: int) -> Claim | NoChange | Refusal:
    """The door's half of ``--clear-failed``: the request journaled on a ``serving`` claim, for its box."""
    if claim is None or claim.holder is None:
        return Refusal("the host has no holder")
    op = claim.op
    if op.kind != "serving":
        return Refusal(f"the host is {op.kind}, not serving")
    pending: Any = op.journal.get(CLEAR_FAILED)
    if isinstance(pending, dict):
        return NoChange("a request to clear the failed start is already pending")
    journal = {**op.journal, CLEAR_FAILED: {"at": now_ms, "by": operator}}
    return msgspec.structs.replace(claim, op=msgspec.structs.replace(op, journal=journal))


def decide_clear_failed_done(claim: Claim | None, box: str, at: int) -> Claim | NoChange | Refusal:
    """The serving box's half: it cleared its row, and removes the request it acted on (``at``)."""
    if claim is None or claim.op.kind != "serving" or claim.op.exec != box:
        return Refusal("the host is not served by this box")
    pending = claim.op.journal.get(CLEAR_FAILED)
    if not isinstance(pending, dict) or pending.get("at") != at:
        return NoChange("no such request is pending")
    journal = {k: v for k, v in claim.op.journal.items() if k != CLEAR_FAILED}
    return msgspec.structs.replace(claim, op=msgspec.structs.replace(claim.op, journal=journal))


__all__ = ["CLEAR_FAILED", "NotStuck", "decide_clear_failed", "decide_clear_failed_done", "decide_retry",
           "retry_skips_verify"]
