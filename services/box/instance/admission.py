"""``AdmitWriter``: the claim CAS before every start that opens replication (spec §5.1 step 9,
§7.14; digest D§6). Pure: the activator runs it through the ledger.

Every admission is **cold** while ruling P7 stands (§0.5): a new generation, a new stamp unless
``keep_stamp``, an admissions record whose predecessor is the **last record** (never the holder
fields), and ``writes_lost`` declared for the predecessor when the admission's coverage is ``""``,
no clean-close certificate covers the predecessor session and the predecessor had a writer box
(D§6 "writes_lost only for coverage "" ∧ no certificate ∧ a predecessor with a box").
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from events.claim import Admission, Claim, Predecessor, WriterRef
from kernel import rules
from services.ledger.ledger import Refusal

REFUSED_KINDS = frozenset({"creating", "deleting", "parking", "purging", "placing", "free"})
"""Kinds under which no writer is admitted (D§3.7, INV-13)."""

MAX_ADMISSIONS = 8
"""Covered records are trimmed from the front while more than this many remain (D§2.1)."""


@dataclass(frozen=True)
class AdmitRequest:
    """What the caller observed and asks for (the Go ``Admission`` struct, D§6)."""

    box: str
    region: str
    observed_op_id: str
    observed_phase: str
    observed_kind: str
    observed_session: int
    observed_generation: str
    new_generation: str
    keep_stamp: bool = False
    coverage: str = ""  # "sealed", "clean-return" or ""
    remote_max_txid: int = 0  # the predecessor's newest uploaded TXID in this region
    predecessor_certified: bool = False  # a clean-close certificate covers the predecessor session
    additional_writes_lost: tuple[WriterRef, ...] = field(default_factory=tuple)


def _trim(admissions: list[Admission]) -> list[Admission]:
    """Trim covered records from the front only, while more than eight, stopping at the first uncovered."""
    while len(admissions) > MAX_ADMISSIONS and admissions[0].covered:
        admissions.pop(0)
    return admissions


def decide_admit_writer(current: Claim | None, req: AdmitRequest) -> Claim | Refusal:
    """The cold admission. Any observed value that moved refuses: the caller re-establishes its
    evidence and decides again (D§6 "On conflict")."""
    if current is None or current.holder is None:
        return Refusal("this host has no holder; nothing can be admitted")
    op, holder = current.op, current.holder
    if rules.on("admission-kinds") and op.kind in REFUSED_KINDS:
        return Refusal(f"no writer is admitted while the host is {op.kind}")
    observed = (req.observed_op_id, req.observed_phase, req.observed_kind, req.observed_session,
                req.observed_generation)
    actual = (op.id, op.phase, op.kind, holder.session, holder.generation)
    if rules.on("admit-observed") and observed != actual:
        return Refusal("the claim changed since it was read; read it again before starting")
    if rules.on("exec-writer") and op.exec != req.box:
        return Refusal(f"box {req.box} does not hold execution of this host (it is {op.exec})")
    if req.new_generation == holder.generation:
        return Refusal("a cold admission needs a new generation")
    if any(a.generation == req.new_generation for a in holder.admissions):
        return Refusal("that generation was already opened once and is never re-entered")
    new_gen = current.gen + 1  # the gen this CAS will write (the ledger sets it)
    last = holder.admissions[-1] if holder.admissions else None
    predecessor = (
        Predecessor(session=last.session, box=last.box, generation=last.generation, stamp=holder.stamp)
        if last is not None
        else Predecessor(session=0, box=holder.writer_box, generation=holder.generation, stamp=holder.stamp)
    )
    predecessor_region = last.region if last is not None else (req.region if holder.writer_box else "")
    writes_lost = None
    if req.coverage == "" and not req.predecessor_certified and predecessor.box:
        writes_lost = WriterRef(box=predecessor.box, session=predecessor.session,
                                generation=predecessor.generation, remote_max_txid=req.remote_max_txid)
    declared = {(w.box, w.session) for w in req.additional_writes_lost}
    if writes_lost is not None and (writes_lost.box, writes_lost.session) in declared:
        return Refusal("a loss is declared twice for one writer session")
    record = Admission(
        session=new_gen,
        box=req.box,
        generation=req.new_generation,
        region=req.region,
        predecessor=predecessor,
        predecessor_region=predecessor_region,
        mode="cold",
        coverage=req.coverage,
        covered=False,
        writes_lost=writes_lost,
        additional_writes_lost=req.additional_writes_lost,
    )
    keep = req.keep_stamp and holder.stamp > holder.session
    new_holder = msgspec.structs.replace(
        holder,
        session=new_gen,
        writer_box=req.box,
        generation=req.new_generation,
        stamp=holder.stamp if keep else new_gen,
        admissions=tuple(_trim([*holder.admissions, record])),
    )
    return msgspec.structs.replace(current, holder=new_holder)
