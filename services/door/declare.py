"""The door's ``--declare-lost`` (spec §7.10 M16, §12 operator-only, §20 M-C18; :mod:`services.move.lost`).

``POST /v1/hosts/{host}/move/resolve`` ``{"declare_lost": BOX, "compute": {"status", "evidence"}, "confirmed":
bool}``. The CLI asks the platform first (the compute port, with the operator's credentials) and sends what it
showed; the door refuses unless it is ``stopped`` or ``terminated``. Unconfirmed, the door answers the M-C18
sentence (409, ``M-R77``) and writes nothing; confirmed, it writes the declaration (create-only), then the record
CAS, then the claim half, then the alert naming the timers declared lost. A refusal changes nothing in S3: every
check runs before the declaration is written. A retry after a crash anywhere finds its declaration and finishes.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from typing import Protocol

from bus.facts import Fact, publish_alert
from events.base import canonical, decode
from events.claim import Claim
from events.copy import say
from events.record import Record
from kernel.logctx import ctx
from kernel.ports import Clock
from kernel.timetext import utc_text
from services.box.roster import Roster
from services.door.answers import Answer, reading, refusal_answer, refused_transition
from services.door.auth import Identity
from services.door.decide import DoorRefusal, _object, echo, refuse, status_view
from services.ledger.ledger import Committed, Ledger, NoChange, Refusal
from services.move.lost import (
    LossDeclaration,
    NotLegal,
    decide_declared_claim,
    decide_declared_record,
    declaration_kind,
    live_region_box,
    loss_key,
    lost_op,
)
from services.objstore.port import Got
from services.target.phases import ROLLBACK_RELEASE_MS

log = logging.getLogger("hostmove.door")
FIELDS = ("declare_lost", "compute", "confirmed")


class Door(Protocol):
    """What this route reads of the door (:class:`services.door.api.Door`, which passes itself)."""

    ledger: Ledger
    clock: Clock

    def require_bus(self) -> None: ...
    async def roster(self) -> Roster: ...
    async def claim(self, host: str) -> Claim | None: ...
    async def record(self, host: str) -> Record | None: ...


@dataclass(frozen=True)
class DeclareLost:
    box: str
    status: str
    evidence: str
    confirmed: bool


def parse_declare_lost(body: bytes) -> DeclareLost | DoorRefusal:
    value = _object(body, FIELDS, empty_ok=False)
    if isinstance(value, DoorRefusal):
        return value
    box, compute, confirmed = value.get("declare_lost"), value.get("compute"), value.get("confirmed", False)
    if not isinstance(box, str) or not box:
        return refuse(400, "M-R4", reason=f"declare_lost must name a box, not {echo(box)}")
    if not isinstance(compute, dict) or not isinstance(compute.get("status"), str):
        return refuse(400, "M-R6", field="compute (what the platform showed: status and evidence)")
    if not isinstance(confirmed, bool):
        return refuse(400, "M-R4", reason=f"confirmed must be true or false, not {echo(confirmed)}")
    return DeclareLost(box, str(compute["status"]), str(compute.get("evidence", ""))[:1000], confirmed)


def _refused(exc: NotLegal) -> Answer:
    return refusal_answer(refuse(exc.http, exc.copy, **exc.values))


def _sentence(host: str, box: str, record: Record, kind: str) -> str:
    move = record.move
    assert move is not None
    text = say("M-C18", box=box, host=host, flipped_at=utc_text(move.flipped_at),
               from_region=move.from_ or "the source region")
    return text + (" " + say("M-S12", box=box, host=host) if kind == "dirty-unreturned" else "")


async def _existing(door: Door, key: str) -> tuple[LossDeclaration, str] | None:
    with reading(f"The declaration {key}"):
        got = await door.ledger.store.get(door.ledger.bucket, key)
    if not isinstance(got, Got):
        return None
    return decode(got.body, LossDeclaration), hashlib.sha256(got.body).hexdigest()


async def declare_lost(door: Door, host: str, req: DeclareLost, who: Identity) -> Answer:
    """The route's effects (module docstring)."""
    door.require_bus()
    claim, record = await door.claim(host), await door.record(host)
    if claim is None:
        return refusal_answer(refuse(404, "M-R2", host=host))
    move = record.move if record is not None else None
    if record is None or move is None:
        return refusal_answer(refuse(409, "M-R19", host=host))
    key = loss_key(host, move.id, req.box)
    found = await _existing(door, key)
    resumed = found is not None and move.rollback is not None and move.rollback.evidence == key
    if not resumed:
        try:
            kind = declaration_kind(record, claim, req.box, req.status)
        except NotLegal as exc:
            return _refused(exc)
        roster = await door.roster()
        entry = roster.box(req.box)
        if entry is None:
            return refusal_answer(refuse(409, "M-R23", box=req.box))
        sentence = _sentence(host, req.box, record, kind)
        if not req.confirmed:
            return Answer(409, {"error": "confirm", "copy": "M-R77", "confirm": sentence,
                                "reason": say("M-R77", box=req.box, sentence=sentence)})
        if found is None:
            region_box = live_region_box(roster, entry.region, claim, req.box) or "the region's next live box"
            decl = LossDeclaration(
                host=host, move=move.id, box=req.box, role="target", kind=kind,
                enrollment=f"{entry.secrets_key_fp}@{entry.registered_at}", region=entry.region,
                compute_status="terminated" if req.status == "terminated" else "stopped",
                compute_evidence=req.evidence, operator=who.label, declared_at=door.clock.now_ms(),
                flipped_at=move.flipped_at, timers_lost=move.source.timers_sha256,
                left_in_region=tuple(sorted({f"{entry.region}: {o.kind} {o.scope.location}" for o in claim.obligations
                                             if o.owner == req.box and o.op == move.id and o.scope is not None}
                                            | ({f"{entry.region}: instances of {host} (park {lost_op(move.id)}, "
                                                 f"owed by {region_box}) and "
                                                 f"moves/{host}/{move.id}/ (its at-rest sweep)"}
                                               if kind != "local-only" else set()))))
            with reading(f"The declaration {key}"):
                await door.ledger.store.put(door.ledger.bucket, key, canonical(decl), if_none_match=True)
            found = await _existing(door, key)
            if found is None:
                return refusal_answer(refuse(503, "M-R18", what=f"The declaration {key}"))
    assert found is not None
    decl, digest = found
    ref = {"enrollment": decl.enrollment, "key": key, "sha256": digest}
    owner = live_region_box(await door.roster(), decl.region, claim, decl.box)

    def decide_record(cur: Record | None) -> Record | NoChange | Refusal:
        if cur is not None and cur.move is not None and cur.move.rollback is not None and (
                cur.move.rollback.evidence == key):
            return NoChange("the declaration is already on the record")
        try:
            return decide_declared_record(cur, claim, decl, key, ROLLBACK_RELEASE_MS)
        except NotLegal as exc:
            return refuse(exc.http, exc.copy, **exc.values)

    if decl.kind != "local-only":
        with reading(f"The record of {host}"):
            out = await door.ledger.transition("record", host, "move-declared-lost", decide_record,
                                               causation=f"door: operator {who.label}")
        if (refused := refused_transition(out, host)) is not None:
            return refused
    record = await door.record(host)

    def decide_claim(cur: Claim | None) -> Claim | NoChange | Refusal:
        if cur is not None and cur.op.journal.get(f"loss.{decl.box}") == ref and any(
                b.box == decl.box for b in cur.lost):
            return NoChange("the declaration is already on the claim")
        try:
            return decide_declared_claim(cur, record, decl, ref, source_region=move.from_, region_box=owner)
        except NotLegal as exc:
            return refuse(exc.http, exc.copy, **exc.values)

    with reading(f"The claim of {host}"):
        half = await door.ledger.transition("claim", host, "box-declared-lost", decide_claim,
                                            causation=f"door: operator {who.label}")
    if (refused := refused_transition(half, host)) is not None:
        return refused
    await publish_alert(door.ledger.events, Fact(
        kind="box-declared-lost", subject=host, id=f"{move.id}:{decl.box}", actor=door.ledger.actor,
        at=door.clock.now_ms(), payload={"box": decl.box, "move": move.id, "kind": decl.kind, "declaration": key,
                                         "timers_lost": decl.timers_lost, "left_in_region": list(decl.left_in_region),
                                         "operator": decl.operator, "compute": decl.compute_evidence}))
    log.warning("%s declared lost for %s (move %s, %s) by operator %s", decl.box, host, move.id, decl.kind,
                who.label, extra=ctx(host=host, op_id=move.id, phase="declare-lost", operator=who.label))
    claim = await door.claim(host)
    view = status_view(host, claim, record, detail=False)
    message = say("M-S11", box=decl.box, host=host, from_region=move.from_ or "the source region")
    if decl.kind == "dirty-unreturned":
        message += " " + say("M-S12", box=decl.box, host=host)
    view.update(changed=isinstance(half, Committed), copy="M-S11", message=message, declaration=key, kind=decl.kind)
    return Answer(200, view)


__all__ = ["DeclareLost", "declare_lost", "parse_declare_lost"]
