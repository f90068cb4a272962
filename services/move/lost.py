"""``--declare-lost``: a move's target that is gone (spec §7.10 M16, joint D6; §7.8 the clean return of a lost
target; §20 M-C18; model rules ``declare-lost-compute``, ``lost-return-park``), pure.

``hostmove move resolve --host H --declare-lost BOX`` is operator-only and needs the platform (the compute port,
:mod:`services.box.compute`) to show the box ``stopped`` or ``terminated``: a claim CAS is bookkeeping, and an
expired lease is not enough (model 5). It is legal in exactly these states (:func:`declaration_kind`):

| kind                 | the record                                          | the declaration                    |
|----------------------|-----------------------------------------------------|------------------------------------|
| ``owes-evidence``    | ``landing``, or ``rolling_back`` before the release | a clean rollback citing it         |
| ``dirty-unreturned`` | ``rolling_back``, released dirty, not ``returned``  | the same, and the return lane's    |
|                      |                                                     | ``park-staging`` owed by the source |
| ``local-only``       | any, the box owing only ``park-local`` of the move  | those chores removed, nothing else |

and refused with its sentence otherwise: before the flip (abort instead), after the record's commit for the first
two, for the source, for a box that is not that exact participant, for a box the platform shows running.

The declaration is an object, ``control/losses/<host>/<move>/<box>.json`` (create-only), naming the box, its
enrollment, what the platform showed, the flip time, the operator, the timers registered on the box (declared lost,
since no return lane carries them) and what the box's region keeps that the lost box would have parked. Its key and
SHA-256 are the rollback's ``evidence`` and the claim's ``op.journal["loss.<box>"]``. Then one record CAS (the
decision: the target ``cleaned`` for want of a box, the rollback clean) and its claim half (``exec`` none citing it,
the box on ``lost``, its chores of the move dropped, the return lane's park owed). The source's recovery is then the
clean return it always was, except that its admission is cold: the lost box's session is declared ``writes_lost``
(:func:`declared_lost`).

**The lost target's release** (§7.14 item 5, rule ``lost-region-park``): the same claim CAS queues the park of the
host's whole location in the lost box's region (``park-superseded``, op ``lost:<move>``, scoped to
``holder.location`` with ``evidence_at`` the declaration, after the platform showed the box stopped: nothing it
signed lands after ``evidence_at + H``), owed by a live box of that region when the roster has one, else by
:data:`REGION_OWNER`, which that region's next live box adopts (:mod:`services.sweeper.lostparks`), and covers the
region's predecessors in that CAS (``CoverRegionPredecessors``). Its op is not the move's, so the move closes and
releases without it; it blocks a move into its region only (M-R27, :func:`region_park_blocks`).
"""

from __future__ import annotations

from typing import ClassVar, Literal
from urllib.parse import quote

import msgspec

from events.base import Durable, Ident, Millis
from events.claim import Claim, LostBox, Obligation, Scope
from events.ids import rollback_id
from events.record import Record
from kernel import rules
from services.box.fence import FENCES_PREFIX
from services.box.instance.coverage import cover_region_predecessors
from services.box.roster import Roster
from services.move.follow import claim_half, host_segment, staging_scope_location

rules.register(
    "declare-lost-compute",
    section="§7.10 --declare-lost (joint D6: compute fencing only; model 5)",
    meaning="a box is declared lost only when the platform shows its compute stopped or terminated",
    site="services/move/lost.py declaration_kind",
)
rules.register(
    "lost-return-park",
    section="§7.10 (model 27: a target that released dirty and had not returned); §7.8",
    meaning="declaring such a target lost owes the return lane's park-staging, owned by the source, in the same CAS",
    site="services/move/lost.py decide_declared_claim",
)

rules.register(
    "lost-region-park",
    section="§7.14 item 5 (CoverRegionPredecessors in a lost target's release); §7.10; §6.4",
    meaning="declaring a target lost queues its region's whole-location park, owed by a live box of that region "
            "or adopted by its next one, and covers that region's predecessors in the same CAS",
    site="services/move/lost.py decide_declared_claim",
)

LOSSES_PREFIX = "control/losses/"
REGION_OWNER = "@region"
"""The owner of a lost region's park while that region has no live box: its next live box adopts it."""
LOST_OP_PREFIX = "lost:"
Kind = Literal["owes-evidence", "dirty-unreturned", "local-only"]
EVIDENCE: frozenset[str] = frozenset({"stopped", "terminated"})
BEFORE_RELEASE = ("", "releasing")
DIRTY_UNRETURNED = ("released", "returning")
COMMITTED_STATES = frozenset({"committed", "done"})
BEFORE_FLIP = frozenset({"preparing", "ready", "cutting", "aborted", "reverting"})


class LossDeclaration(Durable, frozen=True):
    """``control/losses/<host>/<move>/<box>.json``: the operator declared ``box`` lost (module docstring)."""

    __durable_root__: ClassVar[bool] = True

    host: Ident
    move: Ident
    box: Ident
    role: Literal["target"]
    kind: Kind
    enrollment: str
    region: Ident
    compute_status: Literal["stopped", "terminated"]
    compute_evidence: str
    operator: str
    declared_at: Millis
    flipped_at: Millis | None = None
    timers_lost: str = ""
    """The digest of the timers registered on the box (the installed set): declared lost, never carried back."""
    left_in_region: tuple[str, ...] = ()
    """What the lost box would have parked in its region's bucket (its chores of the move, dropped): its location is
    parked by the region's park this declaration queues (``lost:<move>``), its staging lane by that region's
    at-rest sweep (§6.4), each once a live box serves there. Named here for the operator, never exempted silently."""


def loss_key(host: str, move_id: str, box: str) -> str:
    return f"{LOSSES_PREFIX}{host_segment(host)}/{move_id}/{quote(box, safe='')}.json"


class NotLegal(Exception):
    """The declaration is refused: ``copy`` is the sentence's id and ``values`` its fields (§20)."""

    def __init__(self, http: int, copy: str, **values: object) -> None:
        super().__init__(copy)
        self.http, self.copy, self.values = http, copy, values


def _owes_only_local(claim: Claim, move_id: str, box: str) -> bool:
    mine = [o for o in claim.obligations if o.owner == box and o.op == move_id]
    return bool(mine) and all(o.kind == "park-local" for o in mine)


def declaration_kind(record: Record | None, claim: Claim | None, box: str, compute_status: str) -> Kind:
    """Which legal declaration this is (module table), or :class:`NotLegal` with its sentence. Pure."""
    move = record.move if record is not None else None
    host = record.host if record is not None else (claim.host if claim is not None else "")
    if record is None or move is None or claim is None or claim.op.id != move.id:
        raise NotLegal(409, "M-R19", host=host)
    parts = claim.op.participants
    if len(parts) != 2:
        raise NotLegal(409, "M-R28", host=host, move_id=move.id)
    source, target = parts
    if box == source:
        raise NotLegal(409, "M-R71", host=host, box=box, move_id=move.id)
    if box != target:
        raise NotLegal(409, "M-R70", host=host, box=box, move_id=move.id, source=source, target=target)
    if rules.on("declare-lost-compute") and compute_status not in EVIDENCE:
        raise NotLegal(409, "M-R75", box=box, status=compute_status or "unknown")
    if any(b.box == box for b in claim.lost):
        raise NotLegal(409, "M-R76", host=host, box=box)
    if _owes_only_local(claim, move.id, box):
        return "local-only"
    rb = move.rollback
    if move.state == "landing":
        return "owes-evidence"
    if move.state == "rolling_back" and rb is not None:
        if rb.target_phase in BEFORE_RELEASE:
            return "owes-evidence"
        if rb.dirty and rb.target_phase in DIRTY_UNRETURNED:
            return "dirty-unreturned"
        raise NotLegal(409, "M-R74", host=host, box=box, phase=rb.target_phase)
    if move.state in COMMITTED_STATES:
        raise NotLegal(409, "M-R72", host=host, box=box, move_id=move.id)
    if move.state in BEFORE_FLIP:
        raise NotLegal(409, "M-R73", host=host, box=box, move_id=move.id, state=move.state)
    raise NotLegal(409, "M-R74", host=host, box=box, phase=rb.target_phase if rb is not None else move.state)


def decide_declared_record(record: Record | None, claim: Claim | None, decl: LossDeclaration, evidence: str,
                           release_ms: int) -> Record:
    """The record CAS (the decision): a landing becomes a clean rollback, a rollback's target ``cleaned`` for want
    of a box and the rollback clean, citing ``evidence`` (the declaration's key). ``local-only`` changes nothing
    here (the claim half drops the chores). Raises :class:`NotLegal` when the state moved on."""
    kind = declaration_kind(record, claim, decl.box, decl.compute_status)
    assert record is not None and record.move is not None
    move = record.move
    if kind == "local-only":
        return record
    now = decl.declared_at
    reason = f"{decl.box} was declared lost by {decl.operator} ({decl.compute_evidence})"
    rb = move.rollback
    if rb is None:
        from services.move.rollback import new_rollback

        move = new_rollback(move, reason, now, release_ms)
        rb = move.rollback
        assert rb is not None
    rb = msgspec.structs.replace(rb, target_phase="cleaned", dirty=False, evidence=evidence, target_parked_at=now,
                                 reason=rb.reason or reason)
    move = msgspec.structs.replace(move, rollback=rb, reason=reason[:1000], updated_at=now)
    return msgspec.structs.replace(record, move=move)


def lost_op(move_id: str) -> str:
    """The op of a lost target's region park: not the move's, so the move closes and releases without it (K8)."""
    return f"{LOST_OP_PREFIX}{move_id}"


def region_park(claim: Claim, decl: LossDeclaration, region_box: str) -> Obligation | None:
    """The lost region's whole-location park (module docstring), or None: no holder, or nothing remote to park
    (``local-only``: the box owed only its local park)."""
    holder = claim.holder
    if holder is None or decl.kind == "local-only" or not decl.region:
        return None
    return Obligation(kind="park-superseded", op=lost_op(decl.move), region=decl.region,
                      owner=region_box or REGION_OWNER,
                      scope=Scope(location=holder.location.rstrip("/"), incarnation=holder.incarnation,
                                  evidence_at=decl.declared_at))


def live_region_box(roster: Roster, region: str, claim: Claim | None, lost_box: str) -> str:
    """A live box of the lost box's region (not fenced, not lost) to owe its region's park, ``""`` for none: that
    region's next live box adopts it then (:mod:`services.sweeper.lostparks`)."""
    lost = frozenset(b.box for b in claim.lost) if claim is not None else frozenset()
    live = [b.label for b in roster.live_in_region(region) if b.label != lost_box and b.label not in lost]
    return sorted(live)[0] if live else ""


def region_park_blocks(ob: Obligation, to_region: str) -> bool:
    """M-R27 for a lost region's park nobody has adopted yet: it blocks a move into its region (whose install would
    write into the location it parks), no other; adopted, it blocks every move like any chore."""
    return not (ob.owner == REGION_OWNER and ob.op.startswith(LOST_OP_PREFIX) and ob.region != to_region)


def decide_declared_claim(claim: Claim | None, record: Record | None, decl: LossDeclaration, ref: dict[str, str],
                          *, source_region: str, region_box: str = "") -> Claim:
    """The claim half: follow the record (a landing to ``restoring``), ``exec`` none citing the declaration (K3),
    ``op.journal["loss.<box>"]`` its reference, the box on ``lost``, its chores of the move dropped, for a dirty
    target that had not returned the return lane's ``park-staging`` owned by the source (rule ``lost-return-park``),
    and the lost region's whole-location park, owed by ``region_box`` (a live box of that region, ``""`` for none),
    with ``CoverRegionPredecessors`` (rule ``lost-region-park``). Idempotent."""
    if claim is None or claim.holder is None or record is None or record.move is None:
        raise NotLegal(409, "M-R19", host=decl.host)
    followed = claim_half(claim, record) if decl.kind != "local-only" else None  # local-only: nothing else changes
    current = followed if isinstance(followed, Claim) else claim
    op = current.op
    if op.id != decl.move:
        raise NotLegal(409, "M-R28", host=decl.host, move_id=decl.move)
    journal = {**op.journal, f"loss.{decl.box}": ref}
    exec_ = op.exec
    if decl.kind != "local-only":
        if op.kind != "restoring":
            raise NotLegal(409, "M-R28", host=decl.host, move_id=decl.move)
        journal["evidence.target"] = ref["key"]
        exec_ = "none" if op.exec == decl.box else op.exec
    kept = tuple(o for o in current.obligations if not (o.owner == decl.box and o.op == decl.move))
    source = op.participants[0] if op.participants else ""
    if decl.kind == "dirty-unreturned" and rules.on("lost-return-park"):
        lane = Obligation(kind="park-staging", op=decl.move, region=source_region, owner=source,
                          scope=Scope(location=staging_scope_location(decl.host, rollback_id(decl.move)),
                                      incarnation=current.holder.incarnation if current.holder else "",
                                      evidence_at=decl.declared_at))
        if not any(o.kind == lane.kind and o.op == lane.op and o.owner == source for o in kept):
            kept = (*kept, lane)
    park = region_park(current, decl, region_box) if rules.on("lost-region-park") else None
    if park is not None and not any(o.kind == park.kind and o.op == park.op and o.region == park.region
                                    for o in kept):
        kept = (*kept, park)
    lost = current.lost if any(b.box == decl.box for b in current.lost) else (
        *current.lost, LostBox(box=decl.box, fence=ref["key"], at=decl.declared_at))
    out = msgspec.structs.replace(current, op=msgspec.structs.replace(op, exec=exec_, journal=journal),
                                  obligations=kept, lost=lost)
    # CoverRegionPredecessors (§7.14 item 5): the region's whole-location park covers the records whose
    # predecessors are there, in the CAS that queues it
    return cover_region_predecessors(out, decl.region) if park is not None else out


def loss_half_pending(evidence: str, claim: Claim | None, box: str) -> bool:
    """The record's rollback cites a declaration or a fence of ``box`` (``evidence``, a key under
    ``control/losses/`` or ``control/box-fences/``) whose claim half is not on the claim yet. The record's CAS comes
    first (§7.10) and already reads as a clean rollback; until the claim names the box lost, a re-admission would
    be covered and the lost box's writes since the flip would go undeclared, so the source's recovery waits."""
    cites = evidence.startswith(LOSSES_PREFIX) or evidence.startswith(FENCES_PREFIX)
    return cites and not declared_lost(claim, box)


def declared_lost(claim: Claim | None, box: str) -> bool:
    """The claim names ``box`` lost for its current operation: its admissions after it are cold (§7.10: the lost
    box's writes since the flip are declared, never covered)."""
    return claim is not None and any(b.box == box for b in claim.lost) and f"loss.{box}" in claim.op.journal


__all__ = ["LOSSES_PREFIX", "LOST_OP_PREFIX", "REGION_OWNER", "Kind", "LossDeclaration", "NotLegal",
           "declaration_kind", "decide_declared_claim", "decide_declared_record", "declared_lost", "live_region_box",
           "loss_half_pending", "loss_key", "lost_op", "region_park", "region_park_blocks"]
