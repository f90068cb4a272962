"""The vocabulary: claim, record, transition envelope, ids and the durable-value boundary. Pure."""

from events.base import Durable, DurableValueError, FrozenMap, Ident, Millis, canonical, decode
from events.claim import Admission, Claim, Holder, Obligation, Op, Touched
from events.envelope import Actor, EventMeta, ObjectKind, Transition
from events.ids import is_op_id, new_incarnation, new_op_id
from events.record import LastMove, Move, Record

__all__ = [
    "Actor", "Admission", "Claim", "Durable", "DurableValueError", "EventMeta", "FrozenMap", "Holder",
    "Ident", "LastMove", "Millis", "Move", "ObjectKind", "Obligation", "Op", "Record", "Touched",
    "Transition", "canonical", "decode", "is_op_id", "new_incarnation", "new_op_id",
]
