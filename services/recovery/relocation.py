"""Relocating a host whose box was fenced (spec §7.10 "A source terminated", "The fence reference"; rev 7.20;
§14.2.6: one box per region plus replacements, the relocation's install collapsed into the cold admission's restore
of the pinned generation, as the model does). Three claim CASes, pure here:

1. **fence** (the console's recovery pass): a ``serving`` claim whose ``exec`` is a fenced box becomes ``relocating``
   at ``pinning``: ``exec = "none"``, stamp and generation kept (the data stays pinned in the region's bucket),
   obligations untouched, the box on ``lost`` citing its fence, ``op.journal["fence.<box>"]`` the fence reference.
   No writer exists from here on; with no live box in the region the claim holds there (``waiting for a box in
   <region>``, M-C22) and the operator is alerted once.
2. **choose** (the recovery pass): Phase 1's ``choose()`` (the region's one eligible box, never a fenced one)
   takes the relocation to ``installing`` with ``exec`` the replacement box. The fence reference is re-verified
   first (same key, same bytes).
3. **release** (the replacement box's agent, once its cold admission started the instance: the restore of the
   holder's chain from the region's bucket, the files from their manifest, ``writes_lost`` declared for the fenced
   box's session): back to ``serving`` on the replacement box.

A ``serving`` claim is pinned by CAS 1; a ``moving`` one whose **source** was fenced before the flip is converted to the
same ``pinning`` (:func:`decide_fence_converts_moving`, rule ``fence-converts-moving``) and its record closes
``aborted`` (:func:`decide_converted_record`); the move's staging lane is left to the target region's straggler sweep
(rule ``sweep-staging``), not queued as an obligation.
"""

from __future__ import annotations

import msgspec

from events.claim import Claim, LostBox, Op
from events.record import LastMove, Record
from kernel import rules
from services.box.fence import FenceRef
from services.ledger.ledger import NoChange, Refusal

rules.register(
    "fence-converts-moving",
    section="§7.10 'A source terminated before the flip' (rev 7.20; claim rev 6.28 §4); witness wFenceConvertsMoving",
    meaning="a fence of the source before the flip converts the moving op to relocating at pinning in one CAS",
    site="services/recovery/relocation.py decide_fence_converts_moving",
)

PINNING = "pinning"
INSTALLING = "installing"

def relocation_id(ref: FenceRef) -> str:
    """One relocation per fenced box and host: its id is the fence's digest (a replay decides the same op)."""
    return f"rl-{ref.sha256[:16]}"


def decide_fence_host(current: Claim | None, ref: FenceRef, region: str, at: int) -> Claim | NoChange | Refusal:
    """CAS 1 (module docstring)."""
    if current is None or current.holder is None:
        return NoChange("this host has no holder")
    op = current.op
    if op.kind == "relocating" and op.journal.get(f"fence.{ref.label}") == ref.journal():
        return NoChange(f"already relocating away from the fenced box {ref.label}")
    if op.exec != ref.label:
        return NoChange(f"the host is not served by the fenced box {ref.label}")
    if op.kind != "serving":
        return Refusal(f"the host is {op.kind} with the fenced box {ref.label} in it; only a serving host is "
                       "relocated automatically, an operator resolves this one")
    lost = current.lost if any(b.box == ref.label for b in current.lost) else (
        *current.lost, LostBox(box=ref.label, fence=ref.key, at=at))
    new_op = Op(kind="relocating", id=relocation_id(ref), phase=PINNING, intent={"from": region},
                journal={f"fence.{ref.label}": ref.journal()}, exec="none")
    return msgspec.structs.replace(current, op=new_op, lost=lost)


BEFORE_FLIP = frozenset({"preparing", "ready", "cutting", "aborted"})
"""Record states before the flip CAS puts the record in ``landing`` (§7.10 "Before its flip")."""


def decide_fence_converts_moving(current: Claim | None, record: Record | None, ref: FenceRef, region: str, at: int
                                 ) -> Claim | NoChange | Refusal:
    """§7.10 (rev 7.20, rule ``fence-converts-moving``): a source terminated before its flip. One CAS converts the
    ``moving`` op to ``relocating`` at ``pinning`` in the source's region: ``exec`` none, ``holder.stamp`` and
    ``holder.generation`` kept, the fence reference in ``op.journal``, obligations untouched, the box on ``lost``.
    Refused after the flip (the record's ``landing`` and later): the lost-target rules apply there."""
    if current is None or current.holder is None:
        return NoChange("this host has no holder")
    op = current.op
    if op.kind == "relocating" and op.journal.get(f"fence.{ref.label}") == ref.journal():
        return NoChange(f"already relocating away from the fenced box {ref.label}")
    if op.kind != "moving" or not op.participants or op.participants[0] != ref.label:
        return NoChange(f"the host is not moving away from the fenced box {ref.label}")
    move = record.move if record is not None else None
    if move is None or move.id != op.id:
        return Refusal("the record does not hold this move; the conversion waits for it")
    if move.state not in BEFORE_FLIP or not rules.on("fence-converts-moving"):
        return Refusal(f"move {op.id} is {move.state}: past its flip a fenced source is not converted (§7.10)")
    lost = current.lost if any(b.box == ref.label for b in current.lost) else (
        *current.lost, LostBox(box=ref.label, fence=ref.key, at=at))
    new_op = Op(kind="relocating", id=op.id, phase=PINNING, intent={"from": region, "converted": "moving"},
                journal={**op.journal, f"fence.{ref.label}": ref.journal()}, exec="none")
    return msgspec.structs.replace(current, op=new_op, lost=lost)


def decide_converted_record(record: Record | None, op_id: str, reason: str, at: int) -> Record | NoChange | Refusal:
    """The record after the conversion: the move ends ``aborted`` (its staging is the region's sweep's: rule
    ``sweep-staging``), so no worker of the move acts again and a later move may start."""
    if record is None or record.move is None:
        return NoChange("the record holds no move")
    if record.move.id != op_id:
        return Refusal("the record holds another move")
    return msgspec.structs.replace(record, move=None, last_move=LastMove(id=op_id, outcome="aborted", at=at),
                                   extra={**record.extra, "converted": reason[:500]})


def decide_relocation_target(current: Claim | None, op_id: str, box: str, region: str) -> Claim | NoChange | Refusal:
    """CAS 2: ``pinning`` to ``installing`` on ``box`` (the caller chose it and re-verified the fence)."""
    if current is None or current.op.kind != "relocating" or current.op.id != op_id:
        return NoChange("the relocation is over or was replaced")
    if current.op.phase != PINNING:
        return NoChange(f"the relocation is {current.op.phase}")
    if any(b.box == box for b in current.lost):
        return Refusal(f"box {box} is on this host's lost list and is never chosen")
    touched = current.touched
    touched = msgspec.structs.replace(touched, regions=tuple(sorted({*touched.regions, region})),
                                      boxes=tuple(sorted({*touched.boxes, box})))
    new_op = msgspec.structs.replace(current.op, phase=INSTALLING, exec=box, participants=(box,))
    return msgspec.structs.replace(current, op=new_op, touched=touched)


def decide_relocation_release(current: Claim | None, op_id: str, box: str) -> Claim | NoChange | Refusal:
    """CAS 3: the replacement box serves; only after its own admission (the holder's writer is this box)."""
    if current is None or current.holder is None:
        return NoChange("this host has no holder")
    op = current.op
    if op.kind != "relocating" or op.id != op_id:
        return NoChange("the relocation is over")
    if op.phase != INSTALLING or op.exec != box:
        return Refusal(f"the relocation is {op.phase} on {op.exec}, not installing on {box}")
    if current.holder.writer_box != box:
        return Refusal(f"box {box} has not been admitted as the host's writer yet")
    return msgspec.structs.replace(current, op=Op(kind="serving", exec=box))


__all__ = ["BEFORE_FLIP", "INSTALLING", "PINNING", "decide_converted_record", "decide_fence_converts_moving",
           "decide_fence_host", "decide_relocation_release", "decide_relocation_target",
           "relocation_id"]
