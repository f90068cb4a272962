"""``AdmitWriter``: the claim CAS before every start that opens replication (spec §5.1 step 9,
§7.14; digest D§6). Pure: the activator runs it through the ledger.

Every admission is **cold** while ruling P7 stands (§0.5): a new generation, a new stamp unless
``keep_stamp``, an admissions record whose predecessor is the **last record** (never the holder
fields), and ``writes_lost`` declared for the predecessor when the admission's coverage is ``""``,
no clean-close certificate covers the predecessor session and the predecessor had a writer box
(D§6 "writes_lost only for coverage "" ∧ no certificate ∧ a predecessor with a box"; rule ``writes-lost``).

The record (§7.14 item 1): ``region`` is the admitted box's; ``predecessor_region`` the last record's ``region`` (before
any record, the writer box's), ``""`` when the predecessor generation holds nothing anywhere (the caller observed it
empty in its own region, where its writer wrote); born covered (item 5) when the claim already holds a
whole-location park of the predecessor's region (:func:`services.box.instance.coverage.born_covered`). The caller's
``additional_writes_lost`` and ``writes_lost`` are unique by ``(box, session)`` across both (R14-2, INV-21; rule
``unique-declarations``): a session supplied twice is declared once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from events.claim import Admission, Claim, Predecessor, WriterRef
from kernel import rules
from services.box.instance.coverage import born_covered, trim_admissions
from services.ledger.ledger import Refusal

rules.register(
    "writes-lost",
    section="§5.1 step 9 (writes_lost), §7.14 items 1, 2; R9-2",
    meaning="a cold admission over an uncertified predecessor session with a writer box records writes_lost",
    site="services/box/instance/admission.py decide_admit_writer",
)
rules.register(
    "unique-declarations",
    section="§7.14 item 2 (unique by (box, session) across writes_lost and additional_writes_lost); R14-2, INV-21",
    meaning="a writer session is declared lost once per admission record, however often the caller names it",
    site="services/box/instance/admission.py decide_admit_writer",
)

REFUSED_KINDS = frozenset({"creating", "deleting", "parking", "purging", "placing", "free"})
"""Kinds under which no writer is admitted (D§3.7, INV-13)."""

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
    predecessor_holds_nothing: bool = False
    local_txid: int = 0
    """The predecessor session's local position last observed (what this box's own copy of it reached, when it could
    read that copy): a declaration names it beside ``remote_max_txid``."""
    """The predecessor generation holds no object anywhere (the caller listed its region, where its writer wrote):
    ``predecessor_region`` is ``""`` and the publication covers the record with no chore (§7.14 item 1)."""


def unique_declarations(first: WriterRef | None, more: tuple[WriterRef, ...]) -> tuple[WriterRef, ...]:
    """``more`` without the sessions ``first`` or an earlier entry already declares (R14-2)."""
    seen = {(first.box, first.session)} if first is not None else set()
    out = []
    for ref in more:
        if (ref.box, ref.session) in seen and rules.on("unique-declarations"):
            continue
        seen.add((ref.box, ref.session))
        out.append(ref)
    return tuple(out)


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
    if rules.on("admit-bind-op") and observed != actual:
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
    if req.predecessor_holds_nothing:
        predecessor_region = ""
    writes_lost = None
    uncertified = req.coverage == "" and not req.predecessor_certified and bool(predecessor.box)
    if uncertified and rules.on("writes-lost"):  # the mutation: nothing is ever declared
        writes_lost = WriterRef(box=predecessor.box, session=predecessor.session,
                                generation=predecessor.generation, remote_max_txid=req.remote_max_txid,
                                local_txid=req.local_txid)
    record = Admission(
        session=new_gen,
        box=req.box,
        generation=req.new_generation,
        region=req.region,
        predecessor=predecessor,
        predecessor_region=predecessor_region,
        mode="cold",
        coverage=req.coverage,
        covered=born_covered(current, predecessor_region),
        writes_lost=writes_lost,
        additional_writes_lost=unique_declarations(writes_lost, req.additional_writes_lost),
    )
    keep = req.keep_stamp and holder.stamp > holder.session
    new_holder = msgspec.structs.replace(
        holder,
        session=new_gen,
        writer_box=req.box,
        generation=req.new_generation,
        stamp=holder.stamp if keep else new_gen,
        admissions=trim_admissions([*holder.admissions, record]),
    )
    return msgspec.structs.replace(current, holder=new_holder)
