"""Facts and alerts: everything that is not a claim or record transition (ARCHITECTURE §4).

Evidence written, seals recorded, park acknowledgements, roster changes and alerts go on
``hm.fact.<kind>.<host>`` and ``hm.alert.<kind>`` in the ``HM_FACTS`` stream. A fact carries an id
that makes its publication idempotent (``Nats-Msg-Id``), its time from the Clock port and the actor.
"""

from __future__ import annotations

from typing import Any, ClassVar

import msgspec

from bus.log import EventLog, PubAck, WrongLastSequence
from bus.subjects import FACTS_STREAM, alert_subject, fact_subject, incident_subject
from events.base import Durable, Ident, Millis, canonical
from events.envelope import Actor
from kernel import metrics


class Fact(Durable, frozen=True):
    """One fact: ``kind`` (``evidence``, ``roster``, ``alert``...), the subject's host (or box), the
    actor, the time and a payload (a durable value, never a secret)."""

    __durable_root__: ClassVar[bool] = True

    kind: Ident
    subject: Ident
    id: Ident
    actor: Actor
    at: Millis
    payload: dict[str, Any] = msgspec.field(default_factory=dict)


async def publish_fact(log: EventLog, fact: Fact) -> PubAck:
    return await log.publish(FACTS_STREAM, fact_subject(fact.kind, fact.subject), canonical(fact),
                             msg_id=f"fact:{fact.kind}:{fact.id}")


async def publish_alert(log: EventLog, fact: Fact) -> PubAck:
    """An alert: the operator must look. ``fact.kind`` names the alert."""
    ack = await log.publish(FACTS_STREAM, alert_subject(fact.kind), canonical(fact),
                            msg_id=f"alert:{fact.kind}:{fact.id}")
    if not ack.duplicate:
        metrics.alert_raised(fact.kind)
    return ack


async def raise_incident(log: EventLog, fact: Fact) -> bool:
    """An incident (spec §13 "Paging"), raised exactly once ever for ``(fact.kind, fact.subject, fact.id)``: published
    on its own subject only while that subject is empty (``Nats-Expected-Last-Subject-Sequence: 0``), so the stream
    itself remembers it and no raiser keeps memory (a restarted recovery pass, or two of them, raise it once).
    Answers whether this call raised it; a publish whose outcome is unknown raises :class:`~bus.log.LogError` and is
    simply tried again (it then lands once, or finds the subject taken)."""
    try:
        await log.publish(FACTS_STREAM, incident_subject(fact.kind, fact.subject, fact.id), canonical(fact),
                          msg_id=f"incident:{fact.kind}:{fact.subject}:{fact.id}", expected_last_subject_seq=0)
    except WrongLastSequence:
        return False
    metrics.alert_raised(fact.kind)
    return True
