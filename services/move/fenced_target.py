"""A move's target fenced after the record's commit (spec §7.10 L14, "after the record's commit"; §7.9; issue 15
item 3), pure.

§7.10: after the record's commit CAS the target is authoritative and the move is not what recovers the host: "the
move finishes its own close (its remaining steps are parks run by regional workers), and the instance's recovery is
region HA's relocation". Here, with no operator, once the recovery pass has verified the target's fence reference
(the fence is written only after the platform showed the box ``terminated``, :mod:`services.box.fence`):

1. **record** (the decision, §7.5): ``move.target_fenced`` = the fence's key (:func:`decide_fenced_target_record`).
   The target's open (§7.9 step 2) is waived: a dead box never opens, and nothing else may open for it.
2. **claim** (follows the record): the fence reference in ``op.journal["fence.<target>"]``, the target on ``lost``,
   and the target's chores of the move removed (:func:`decide_fenced_target_claim`): its ``park-staging`` of
   ``moves/<host>/<op>/`` in the target region is left to that region's at-rest sweep (rule ``sweep-staging``, a
   regional worker, run by the box the relocation chooses), as the fence-converts-moving lane is. ``exec`` stays
   the target: nothing runs the host until the relocation pins it (``exec`` none) and hands it to a live box.
3. **close** (§7.9 step 5, :func:`services.move.finalize.decide_close`): once the source parked, ``last_move =
   done`` with no ``opened_at`` (:func:`open_waived`), then the release to ``serving`` on the target (K8).
4. **relocation** (:mod:`services.recovery.relocation`): the serving host of a fenced box is pinned (``relocating``
   at ``pinning``, exec none) and handed to a live box of the target region; its cold admission restores from the
   region's bucket and declares the fenced session's writes since its last upload ``writes_lost``.
"""

from __future__ import annotations

import msgspec

from events.claim import Claim, LostBox
from events.record import Record
from services.box.fence import FenceRef
from services.ledger.ledger import NoChange, Refusal


def committed_target(record: Record | None, claim: Claim | None) -> str:
    """The target of the committed move the claim and the record both hold, or ``""``. Pure."""
    move = record.move if record is not None else None
    if move is None or claim is None or claim.op.id != move.id or len(claim.op.participants) != 2:
        return ""
    return claim.op.participants[1] if move.state == "committed" else ""


def decide_fenced_target_record(record: Record | None, claim: Claim | None, ref: FenceRef, at: int
                                ) -> Record | NoChange | Refusal:
    """Step 1: the committed move records its target's fence (the open waived). Refused before the commit (the
    clean rollback of :func:`services.move.lost.decide_declared_record` applies there) and for another box."""
    if record is None or record.move is None:
        return NoChange("the record holds no move")
    move = record.move
    if move.target_fenced == ref.key:
        return NoChange("the committed move already records its target's fence")
    target = committed_target(record, claim)
    if not target:
        return Refusal(f"move {move.id} is {move.state}, not committed; a fenced target after the commit only")
    if target != ref.label:
        return Refusal(f"the fence of {ref.label} is not the fence of move {move.id}'s target {target}")
    reason = f"its target {target} was fenced after the commit ({ref.key}); the move closes without it"
    return msgspec.structs.replace(record, move=msgspec.structs.replace(
        move, target_fenced=ref.key, reason=move.reason or reason, updated_at=at))


def decide_fenced_target_claim(claim: Claim | None, record: Record | None, ref: FenceRef, at: int
                               ) -> Claim | NoChange | Refusal:
    """Step 2, after step 1 (record first): the fence reference, the target on ``lost``, its chores of the move
    removed. ``exec``, holder and every other obligation untouched. Idempotent."""
    target = committed_target(record, claim)
    if claim is None or claim.holder is None or record is None or record.move is None or not target:
        return NoChange("no committed move holds this host")
    if record.move.target_fenced != ref.key or target != ref.label:
        return Refusal("the record does not record this fence of the move's target; the claim waits for it")
    op = claim.op
    if op.kind != "landing" or op.phase != "committed":
        return Refusal(f"the claim is {op.kind}/{op.phase or '-'}; it follows the commit first (§7.5)")
    kept = tuple(o for o in claim.obligations if not (o.owner == target and o.op == op.id))
    cited = ref.journal()
    if op.journal.get(f"fence.{target}") == cited and kept == claim.obligations:
        return NoChange("the claim already cites the fence of its target")
    lost = claim.lost if any(b.box == target for b in claim.lost) else (
        *claim.lost, LostBox(box=target, fence=ref.key, at=at))
    return msgspec.structs.replace(claim, obligations=kept, lost=lost, op=msgspec.structs.replace(
        op, journal={**op.journal, f"fence.{target}": cited}))


def open_waived(record: Record | None, claim: Claim | None) -> bool:
    """The close of a committed move does not wait for its target's open: the record names the target's fence and
    the claim cites it (steps 1 and 2). Pure."""
    target = committed_target(record, claim)
    move = record.move if record is not None else None
    if not target or move is None or not move.target_fenced or claim is None:
        return False
    cited = claim.op.journal.get(f"fence.{target}")
    return isinstance(cited, dict) and cited.get("key") == move.target_fenced


__all__ = ["committed_target", "decide_fenced_target_claim", "decide_fenced_target_record", "open_waived"]
