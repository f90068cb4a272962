"""How the claim follows the record (spec §7.5, §7.9 step 1, §7.8, §19 K4 and K8). Pure.

Every move decision is one record CAS; the claim half is a second CAS that the record fully
determines. Any actor that reads both objects and sees the record ahead writes the claim half: the
actor that wrote the record, the other participant, or the console's recovery pass. The CAS is
conditional on the op id and the prior claim state (the ledger's ETag), so racing writers cannot both
succeed and neither can write anything the record did not decide.

| record                      | claim before        | claim after                                        |
|-----------------------------|---------------------|----------------------------------------------------|
| flipped (``state=landing``) | moving              | landing/checking, exec none -> target, citing evidence |
| committed                   | landing (not yet)   | phase committed + park-superseded, park-staging    |
| rolling_back                | landing             | restoring (same op id), exec unchanged             |
| aborted (§7.11)             | moving              | phase aborted + park-staging owned by the target   |
| reverting (§7.4)            | moving              | reverting, exec source (cites evidence), park-staging |
| cleared, ``last_move``      | the op's kind       | serving, exec = the executor the outcome names (K8) |
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any
from urllib.parse import quote

import msgspec

from events.claim import Claim, Obligation, Op, Scope
from events.record import Record
from kernel import rules
from services.box.instance.coverage import cover_region_predecessors
from services.ledger.ledger import NoChange, Refusal

rules.register(
    "exec-needs-evidence",
    section="§19.2 K4; §7.5; claim C5",
    meaning="the execution holder moves to the target only citing the source's stop evidence",
    site="services/move/follow.py claim_half (flip)",
)
rules.register(
    "release-waits-for-obligations",
    section="§19.2 K8; §7.9 step 5; CC11",
    meaning="the claim releases to serving only when no obligation of the op remains",
    site="services/move/follow.py _release",
)

MOVE_KINDS = frozenset({"moving", "landing", "reverting", "restoring"})


@lru_cache(maxsize=4096)
def host_segment(host: str) -> str:
    """The host as one percent-encoded key segment, as the ledger's, the evidence's and the reports' keys write it
    (``services/ledger/ledger.py``, ``services/box/instance/evidence.py evidence_key``). Remembered: the passes
    name it for every host they look at."""
    return quote(host, safe=".-_~@+")


def staging_lane(host: str, op_id: str) -> str:
    """The move's staging lane ``moves/<host>/<op>/`` in the target region's bucket (§7.3), host percent-encoded."""
    return f"moves/{host_segment(host)}/{op_id}/"


def staging_scope_location(host: str, op_id: str) -> str:
    """The lane as a park scope's ``location``: ``moves/<host>/<op>``, no trailing ``/`` (§6.4 scope grammar)."""
    return staging_lane(host, op_id).rstrip("/")


def staging_evidence_at(op: Op, committed_at: int | None) -> int | None:
    """A staging lane's ``evidence_at``: its own seal bound, the seal time plus the staging lease's TTL, after
    which no staging writer can still sign (§6.4 "evidence_at", §7.3 "Retire staging after its writers' horizon").
    The source persists it in the seal as ``staging_bound`` (``services/source/phases.py decide_sealed``). A seal
    written without one (an older source) falls back to the commit time, the latest durable time known here."""
    seal = op.journal.get("seal")
    bound = seal.get("staging_bound") if isinstance(seal, dict) else None
    if isinstance(bound, int) and not isinstance(bound, bool) and bound >= 0:
        return bound
    return committed_at


def _journal(op: Op, **entries: Any) -> dict[str, Any]:
    journal = dict(op.journal)
    journal.update(entries)
    return journal


def claim_half(claim: Claim | None, record: Record | None) -> Claim | NoChange | Refusal:
    """The claim CAS the record has decided, or NoChange when the claim already follows it."""
    if claim is None or record is None:
        return NoChange("nothing to follow")
    op = claim.op
    move = record.move
    if move is None:
        return _release(claim, record)
    if op.id != move.id:
        return NoChange("the claim holds another operation")
    if len(op.participants) != 2:
        return Refusal("the move's claim does not name its source and target")
    source, target = op.participants
    if op.kind == "moving" and move.cut_phase == "flipped" and move.state == "landing":
        if rules.on("exec-needs-evidence") and not move.source.evidence:
            return Refusal("the flip names no stop evidence; execution does not move without it (K4)")
        # The flip journals the source installation's stamp and generation (D§3.1 "stamp F; journal S, src_gen"):
        # a rollback's return CAS writes them back (§7.8 claimed, rule return-stamp).
        stamp = claim.holder.stamp if claim.holder is not None else 0
        src = {"src_gen": claim.holder.generation} if claim.holder is not None else {}
        return msgspec.structs.replace(
            claim,
            op=msgspec.structs.replace(
                op, kind="landing", phase="checking", exec=target, source_stamp=op.source_stamp or stamp,
                journal=_journal(op, **{"evidence.source": move.source.evidence, **src}),
            ),
        )
    if op.kind == "landing" and move.state == "committed" and op.phase != "committed":
        if claim.holder is None:
            return Refusal("a committed move needs the claim's holder")
        at = move.committed_at
        obligations = (
            Obligation(kind="park-superseded", op=move.id, region=move.from_ or "source", owner=source,
                       generation=claim.holder.generation,
                       scope=Scope(location=claim.holder.location, incarnation=claim.holder.incarnation,
                                   evidence_at=at)),
            Obligation(kind="park-staging", op=move.id, region=move.to, owner=target,
                       scope=Scope(location=staging_scope_location(claim.host, move.id),
                                   incarnation=claim.holder.incarnation, evidence_at=staging_evidence_at(op, at))),
        )
        new_obligations = claim.obligations + tuple(o for o in obligations if o not in claim.obligations)
        # CoverRegionPredecessors (§7.14 item 6): the park of the source region's whole location covers every record
        # whose predecessor is there (the landing's probe left the source's generation uncovered, another region)
        return cover_region_predecessors(msgspec.structs.replace(
            claim, op=msgspec.structs.replace(op, phase="committed"), obligations=new_obligations),
            move.from_ or "source")
    if op.kind == "moving" and move.state in ("aborted", "reverting") and op.phase != "aborted":
        if claim.holder is None:
            return Refusal(f"a move {move.state} needs the claim's holder")
        # §7.11 "Who retires what": the source cannot park the target's staging, so the lane is owed a park-staging
        # owned by the target region's box. Its evidence_at is the seal's bound when the cut sealed the lane, else
        # the abort or the revert: a staging writer still signing then holds the staging-work lease, which the
        # park takes first, so nothing it signed lands after the park.
        staging = Obligation(kind="park-staging", op=move.id, region=move.to, owner=target,
                             scope=Scope(location=staging_scope_location(claim.host, move.id),
                                         incarnation=claim.holder.incarnation,
                                         evidence_at=staging_evidence_at(op, move.updated_at)))
        owed = claim.obligations + ((staging,) if staging not in claim.obligations else ())
        if move.state == "aborted":
            return msgspec.structs.replace(claim, op=msgspec.structs.replace(op, phase="aborted"), obligations=owed)
        # §7.4 reverting: execution back to the source; from none only citing its stop evidence (K4)
        if op.exec == "none" and rules.on("exec-needs-evidence") and not move.source.evidence:
            return Refusal("the revert names no stop evidence; execution does not return without it (K4)")
        cite = {"evidence.source": move.source.evidence} if op.exec == "none" else {}
        first = "evidence" if move.cut_phase in ("admitted", "stopping") else "verify"
        return msgspec.structs.replace(claim, obligations=owed, op=msgspec.structs.replace(
            op, kind="reverting", phase="", exec=source, journal=_journal(op, rev_phase=first, **cite)))
    if op.kind == "landing" and move.state == "rolling_back" and move.rollback is not None:
        return msgspec.structs.replace(
            claim,
            op=msgspec.structs.replace(op, kind="restoring", phase="",
                                       journal=_journal(op, **{"rollback.id": move.rollback.id})),
        )
    return NoChange("the claim already follows the record")


def _release(claim: Claim, record: Record) -> Claim | NoChange | Refusal:
    """After the record's close: release the claim to ``serving`` (K8, record first, ruling M4)."""
    last = record.last_move
    op = claim.op
    if last is None or op.id != last.id or op.kind not in MOVE_KINDS:
        return NoChange("no closed move to release")
    if rules.on("release-waits-for-obligations") and any(o.op == op.id for o in claim.obligations):
        return NoChange("obligations of this move remain")
    if len(op.participants) != 2:
        return Refusal("the move's claim does not name its source and target")
    source, target = op.participants
    executor = target if last.outcome == "done" else source
    return msgspec.structs.replace(claim, op=Op(kind="serving", exec=executor, participants=(executor,)))
def snapshot_prefix(host: str, op_id: str) -> str:
    """``move-snapshots/<host>/<op>/`` in the source region's bucket (§7.4 ``stopped``, ``archived``)."""
    return f"move-snapshots/{host_segment(host)}/{op_id}/"
