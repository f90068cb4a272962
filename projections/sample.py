"""Synthetic ledger events for the projection's tests and benchmark.

:class:`Feeder` publishes gapless transitions per object, as the ledger would (ARCHITECTURE §4):
one subject per object, ``gen`` +1 per write, the full new state in every event. It is not the
ledger: it never reads S3 and makes no protocol decision.
"""

from __future__ import annotations

from typing import Literal

from bus.log import EventLog, PubAck
from bus.subjects import LEDGER_STREAM, ledger_msg_id, ledger_subject
from events import Actor, Admission, Claim, EventMeta, Holder, Op, Record, Transition, canonical
from events.record import Move

Kind = Literal["transition", "rebase"]
ACTOR = Actor(service="projection-sample", pid=1, nonce="sample")
INCARNATION = "a" * 64
MOVE_ID = "mv_" + "a" * 26


def claim_state(
    host: str,
    gen: int,
    *,
    live: bool = True,
    op_kind: str = "serving",
    op_phase: str = "",
    op_id: str = "",
    exec_: str = "box-a",
    region: str = "eu-1",
) -> Claim:
    """A claim: held (``live``) by one incarnation admitted in ``region``, or free with no holder."""
    if not live:
        return Claim(host=host, gen=gen)
    box = exec_ if exec_ != "none" else "box-a"
    admission = Admission(session=gen, box=box, generation="g1", region=region)
    holder = Holder(incarnation=INCARNATION, location=f"instances/{host}", admissions=(admission,))
    op = Op(kind=op_kind, id=op_id, phase=op_phase, exec=exec_)  # type: ignore[arg-type]
    return Claim(host=host, gen=gen, holder=holder, op=op)


def record_state(
    host: str, gen: int, *, move_state: str | None = None, at: int = 0, to: str = "box-b"
) -> Record:
    """A record, with a move in ``move_state`` (timings filled from ``at``) or none."""
    if move_state is None:
        return Record(host=host, gen=gen)
    move = Move(
        id=MOVE_ID, incarnation=INCARNATION, to=to, state=move_state, from_="box-a",  # type: ignore[arg-type]
        requested_at=at, cut_at=at + 1, cut_phase="stopping", landing_phase="probing", flipped_at=at + 2,
        committed_at=None, opened_at=None,
    )
    return Record(host=host, gen=gen, move=move)


def transition(
    state: Claim | Record, at: int, *, kind: Kind = "transition", name: str = "sample"
) -> Transition:
    meta = EventMeta(name=name, actor=ACTOR, at=at)
    if isinstance(state, Claim):
        return Transition(kind=kind, object="claim", host=state.host, gen=state.gen, meta=meta, claim=state)
    return Transition(kind=kind, object="record", host=state.host, gen=state.gen, meta=meta,
                      record=state)


class Feeder:
    """Publishes transitions to ``HM_LEDGER`` with the next gen of each object."""

    def __init__(self, event_log: EventLog, *, start_ms: int = 1_700_000_000_000) -> None:
        self.log = event_log
        self.gens: dict[tuple[str, str], int] = {}
        self.at = start_ms

    def next_gen(self, obj: str, host: str) -> int:
        return self.gens.get((obj, host), 0) + 1

    async def publish(self, t: Transition) -> PubAck:
        self.gens[(t.object, t.host)] = max(self.gens.get((t.object, t.host), 0), t.gen)
        return await self.log.publish(
            LEDGER_STREAM, ledger_subject(t.object, t.host), canonical(t),
            msg_id=f"{ledger_msg_id(t.object, t.host, t.gen)}:{t.kind}:{t.meta.at}",
        )

    def _tick(self) -> int:
        self.at += 1
        return self.at

    async def claim(
        self, host: str, *, gen: int | None = None, kind: Kind = "transition", **fields: object
    ) -> PubAck:
        """The host's next claim (``fields`` as :func:`claim_state`)."""
        g = gen if gen is not None else self.next_gen("claim", host)
        state = claim_state(host, g, **fields)  # type: ignore[arg-type]
        return await self.publish(transition(state, self._tick(), kind=kind))

    async def record(
        self, host: str, *, gen: int | None = None, kind: Kind = "transition", move_state: str | None = None
    ) -> PubAck:
        """The host's next record, with a move in ``move_state`` or none."""
        g = gen if gen is not None else self.next_gen("record", host)
        at = self._tick()
        state = record_state(host, g, move_state=move_state, at=at)
        return await self.publish(transition(state, at, kind=kind))
