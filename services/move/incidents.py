"""The incidents a move owes the operator (spec §13 "Paging"; §7.8, §7.10), pure, and their raising.

| incident          | when                                                                    | sentence (§20) |
|-------------------|-------------------------------------------------------------------------|----------------|
| ``move-stuck``    | the record is ``stuck``: nine failed recovery probes (§7.8), fifteen    | M-C11          |
|                   | minutes of a revert's failed probes (§7.4), a clean verify's mismatch   |                |
| ``release-waiting`` | ``rolling_back`` past ``release_deadline`` with no target evidence: safe, | M-C10        |
|                   | nothing runs anywhere, and it converges when the target returns (§7.8)  |                |

Each is raised exactly once (:func:`bus.facts.raise_incident`: the stream is its memory, so a restarted raiser, or
two, raise it once). Its identity is the move and the moment the state began (``stuck_at``, ``release_deadline``),
so a move stuck again after an operator's ``resolve --retry`` pages again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from bus.facts import Fact, raise_incident
from bus.log import EventLog
from events.claim import Claim
from events.copy import say
from events.envelope import Actor
from events.record import Record

MOVE_STUCK = "move-stuck"
RELEASE_WAITING = "release-waiting"
INCIDENT_KINDS = (MOVE_STUCK, RELEASE_WAITING)


@dataclass(frozen=True)
class Incident:
    """One incident owed: its kind, the host, its identity (``id``), the operator's sentence and the facts."""

    kind: str
    host: str
    id: str
    sentence: str
    payload: dict[str, Any]


def incidents_owed(record: Record | None, claim: Claim | None, now_ms: int) -> list[Incident]:
    """The incidents the record's move owes now (the module table). Pure."""
    move = record.move if record is not None else None
    if record is None or move is None:
        return []
    host = record.host
    out: list[Incident] = []
    if move.state == "stuck":
        at = move.stuck_at or move.updated_at or 0
        sentence = say("M-C11", host=host, to_region=move.to, from_region=move.from_ or "the source region")
        out.append(Incident(MOVE_STUCK, host, f"{move.id}:{at}", sentence, {
            "move": move.id, "reason": move.reason, "stuck_at": at,
            "rollback": move.rollback.id if move.rollback is not None else "",
            "probe_failures": move.rollback.probe_failures if move.rollback is not None else 0}))
    rb = move.rollback
    if (move.state == "rolling_back" and rb is not None and rb.release_deadline is not None
            and now_ms > rb.release_deadline and not rb.evidence):
        target = claim.op.participants[1] if claim is not None and len(claim.op.participants) == 2 else "the target"
        sentence = say("M-C10", box=target, region=move.to, host=host)
        out.append(Incident(RELEASE_WAITING, host, f"{move.id}:{rb.release_deadline}", sentence, {
            "move": move.id, "rollback": rb.id, "release_deadline": rb.release_deadline,
            "target_phase": rb.target_phase, "target": target}))
    return out


async def raise_owed(events: EventLog, actor: Actor, incident: Incident, now_ms: int) -> bool:
    """Raise ``incident`` on its alert subject unless it was raised before (by anyone); answers whether this call
    raised it."""
    fact = Fact(kind=incident.kind, subject=incident.host, id=incident.id, actor=actor, at=now_ms,
                payload={**incident.payload, "sentence": incident.sentence})
    return await raise_incident(events, fact)


__all__ = ["INCIDENT_KINDS", "MOVE_STUCK", "RELEASE_WAITING", "Incident", "incidents_owed", "raise_owed"]
