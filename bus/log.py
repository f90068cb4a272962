"""The event log port: an ordered, conditional append per subject (ARCHITECTURE §4).

Implemented by :class:`bus.nats_log.NatsEventLog` (JetStream) and :class:`bus.memory_log.MemoryEventLog`
(the twin: stream-wide dedup window, per-subject sequence checks). A publish whose expected last
subject sequence is stale raises :class:`WrongLastSequence` (JetStream error 10071) **before**
dedup is considered (stack facts §3: OCC is checked before dedup).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class StoredMessage:
    seq: int
    subject: str
    data: bytes
    headers: Mapping[str, str] = field(default_factory=dict)

    @property
    def msg_id(self) -> str | None:
        return self.headers.get("Nats-Msg-Id")


@dataclass(frozen=True)
class PubAck:
    seq: int
    duplicate: bool = False


class LogError(Exception):
    """A defect talking to the log (connection, timeout): the outcome is unknown."""


class LogUnavailable(LogError):
    """The log cannot be reached (not connected, reconnecting, no JetStream answer in time): a dependency
    outage, not a defect of one request. Callers refuse new work naming NATS and try again later; a
    publish's outcome is still unknown (the ledger's conditional retry or the relay settles it)."""


class WrongLastSequence(LogError):
    """The subject's last sequence is not the one expected (JetStream 10071)."""


@dataclass(frozen=True)
class StreamState:
    first_seq: int
    last_seq: int
    messages: int


def unavailable_reason(log: object) -> str | None:
    """Why ``log`` cannot be used now, when it reports itself down (an adapter with ``down_reason()``, such as
    :class:`bus.nats_log.NatsEventLog`); None for a log that is up or cannot tell (the twin)."""
    down_reason = getattr(log, "down_reason", None)
    reason = down_reason() if callable(down_reason) else None
    return reason if isinstance(reason, str) and reason else None


def require_available(log: object) -> None:
    """Raise :class:`LogUnavailable` when ``log`` reports itself down (an adapter with ``down_reason()``, such as
    :class:`bus.nats_log.NatsEventLog`); a log without it (the twin) is always available."""
    down_reason = getattr(log, "down_reason", None)
    reason = down_reason() if callable(down_reason) else None
    if reason:
        raise LogUnavailable(reason)


class EventLog(Protocol):
    async def publish(
        self,
        stream: str,
        subject: str,
        data: bytes,
        *,
        msg_id: str | None = None,
        expected_last_subject_seq: int | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> PubAck: ...

    async def notice(self, stream: str, subject: str, data: bytes = b"") -> None:
        """Store ``data`` on ``subject`` with no acknowledgement awaited (a work notice, issue 19 item 1): fire and
        forget, a :class:`LogError` only when it cannot even be sent."""
        ...

    async def last(self, stream: str, subject: str) -> StoredMessage | None:
        """The last message on ``subject``, or None when the subject is empty."""
        ...

    async def get(self, stream: str, seq: int) -> StoredMessage | None: ...

    async def state(self, stream: str) -> StreamState: ...

    def replay(
        self, stream: str, *, start_seq: int = 1, subject: str | None = None
    ) -> AsyncIterator[StoredMessage]:
        """Every stored message from ``start_seq`` in stream order, up to the last at call time."""
        ...
