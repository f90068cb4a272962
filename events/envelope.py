"""The transition envelope (ARCHITECTURE §4): one event per successful CAS of a claim or record.

An event carries the full new state, the transition's name, the actor, the time (from the Clock
port) and the causation, so a projection never needs S3 and an audit can check
``(previous state, name, new state)``. ``kind == "rebase"`` marks an event published because the
stream lost history: it restates the full current state and makes no claim about what came before.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from events.base import Durable, Ident, Millis
from events.claim import Claim
from events.record import Record

ObjectKind = Literal["claim", "record"]

MAX_NAME_CHARS = 64
MAX_CAUSATION_CHARS = 256


class Actor(Durable, frozen=True):
    """Who wrote: the service, the box (empty on the console), the OS pid and a per-process nonce."""

    service: Ident
    pid: int
    nonce: Ident
    box: str = ""


class EventMeta(Durable, frozen=True):
    """The envelope minus the state. Stored beside the object (S3 user metadata) at CAS time, so
    a relay republishes exactly the event the writer would have published (ARCHITECTURE §4)."""

    name: Ident
    actor: Actor
    at: Millis
    causation: str = ""


class Transition(Durable, frozen=True):
    """One event on ``hm.ledger.<object>.<host token>``."""

    __durable_root__: ClassVar[bool] = True

    kind: Literal["transition", "rebase"]
    object: ObjectKind
    host: Ident
    gen: int
    meta: EventMeta
    claim: Claim | None = None
    record: Record | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        state = self.claim if self.object == "claim" else self.record
        other = self.record if self.object == "claim" else self.claim
        if state is None or other is not None:
            from events.durable import DurableValueError

            raise DurableValueError(
                "invalid_value", "envelope_state", f"a {self.object} event carries exactly its {self.object}"
            )
        if state.gen != self.gen or state.host != self.host:
            from events.durable import DurableValueError

            raise DurableValueError("invalid_value", "envelope_state", "event gen/host differ from its state")

    @property
    def state(self) -> Claim | Record:
        state = self.claim if self.object == "claim" else self.record
        assert state is not None
        return state
