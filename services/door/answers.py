"""The door's answers and its reading of what it depends on (§7.1 refusals, §20 copy; C6: a read error never acts).

Shared by the door's routes (:mod:`services.door.api`) and the declare-lost route (:mod:`services.door.declare`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from bus.log import LogError, LogUnavailable
from events.base import DurableValueError
from events.copy import say
from services.door.decide import DoorRefusal, refuse
from services.ledger.ledger import Conflict, LedgerDefect, Refusal
from services.objstore.port import StoreError, StoreUnavailable


class Unreadable(Exception):
    """A read the door depends on failed or found a corrupt object: never act on it (C6)."""

    def __init__(self, what: str, *, corrupt: bool, dependency: str | None = None) -> None:
        super().__init__(what)
        self.what = what
        self.corrupt = corrupt
        self.dependency = dependency  # "nats" or "s3": the dependency did not answer (an outage, not this object)


@contextmanager
def reading(what: str) -> Iterator[None]:
    """Turn a failed or corrupt read into :class:`Unreadable` naming ``what`` (never the cause's text)."""
    try:
        yield
    except DurableValueError as exc:
        raise Unreadable(what, corrupt=exc.code == "decode_failed") from exc
    except LedgerDefect as exc:
        raise Unreadable(what, corrupt=True) from exc
    except LogUnavailable as exc:
        raise Unreadable(what, corrupt=False, dependency="nats") from exc
    except StoreUnavailable as exc:
        raise Unreadable(what, corrupt=False, dependency="s3") from exc
    except (StoreError, LogError, OSError) as exc:
        raise Unreadable(what, corrupt=False) from exc


RETRY_AFTER_S = 5
"""The ``Retry-After`` of a dependency's 503."""


def unavailable_answer(dependency: str, what: str) -> Answer:
    """The 503 of a dependency that does not answer (``nats``: M-R36, ``s3``: M-R37)."""
    reason = say("M-R36") if dependency == "nats" else say("M-R37", what=_lower_first(what))
    return Answer(503, {"error": "unavailable", "dependency": dependency, "reason": reason,
                        "copy": "M-R36" if dependency == "nats" else "M-R37"})


def _lower_first(what: str) -> str:
    return what[:1].lower() + what[1:]


@dataclass(frozen=True)
class Answer:
    status: int
    body: dict[str, Any]


def refusal_answer(r: DoorRefusal | Refusal) -> Answer:
    status = r.status if isinstance(r, DoorRefusal) else 409
    copy = r.copy if isinstance(r, DoorRefusal) else ""
    code = {400: "bad_request", 404: "not_found"}.get(status, "refused")
    return Answer(status, {"error": code, "reason": r.reason, "copy": copy})


def refused_transition(out: object, host: str) -> Answer | None:
    """The answer to a ledger transition that did not change the object: its refusal, or M-R17 when it lost every
    CAS (:class:`~services.ledger.ledger.Conflict`); None when it committed or found nothing to change."""
    if isinstance(out, Refusal):
        return refusal_answer(out)
    if isinstance(out, Conflict):
        return refusal_answer(refuse(409, "M-R17", host=host))
    return None


__all__ = ["RETRY_AFTER_S", "Answer", "Unreadable", "reading", "refusal_answer", "refused_transition",
           "unavailable_answer"]
