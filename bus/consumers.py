"""Durable pull consumers (ARCHITECTURE §5; issue 19 item 1): the port and its NATS JetStream adapter.

A delivery stays pending on the server until it is acknowledged; after the ack wait it is redelivered with
``num_delivered`` + 1 (stack facts §3). :class:`NatsConsumers` is the production adapter; the simulation's twin
(:class:`sim.twins.jetstream.SimEventLog`) answers the same calls, and the contract tests hold the two to the same
semantics (``tests/test_sim.py``).
"""

from __future__ import annotations

from typing import Protocol

from nats.errors import Error as NatsError
from nats.errors import TimeoutError as NatsTimeout
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from bus.log import EventLog, LogError, StoredMessage

__all__ = ["ConfirmedDelivery", "ConsumingLog", "Consumers", "Delivery", "NatsConsumers", "NatsDelivery"]


class Delivery(Protocol):
    """One delivery of a message to a durable consumer (the same on the twin and on NATS)."""

    @property
    def msg(self) -> StoredMessage: ...

    @property
    def num_delivered(self) -> int: ...

    async def ack(self) -> None: ...

    async def nak(self, delay: float = 0.0) -> None: ...

    async def term(self) -> None: ...


class Consumers(Protocol):
    """Durable pull consumers: declared idempotently, fetched in batches."""

    async def add_consumer(
        self, stream: str, durable: str, *, filter_subject: str, ack_wait_s: float, max_deliver: int = -1
    ) -> None: ...

    async def fetch(self, stream: str, durable: str, *, batch: int = 1, timeout: float = 1.0) -> list[Delivery]: ...


class ConsumingLog(EventLog, Consumers, Protocol):
    """An event log that also serves durable consumers (:class:`bus.nats_log.NatsEventLog`, the simulation's)."""


class NatsDelivery:
    def __init__(self, raw: object) -> None:
        self._raw = raw
        md = raw.metadata  # type: ignore[attr-defined]
        self.msg = StoredMessage(
            seq=int(md.sequence.stream),
            subject=raw.subject,  # type: ignore[attr-defined]
            data=raw.data or b"",  # type: ignore[attr-defined]
            headers=dict(raw.headers or {}),  # type: ignore[attr-defined]
        )
        self.num_delivered = int(md.num_delivered)

    async def ack(self) -> None:
        """Acknowledge with no confirmation awaited: a lost acknowledgement is one redelivery (stack facts §3)."""
        try:
            await self._raw.ack()  # type: ignore[attr-defined]
        except (NatsError, TimeoutError) as exc:
            raise LogError(f"ack of seq {self.msg.seq} not sent: {type(exc).__name__}") from None

    async def nak(self, delay: float = 0.0) -> None:
        try:
            await self._raw.nak(delay=delay or None)  # type: ignore[attr-defined]
        except (NatsError, TimeoutError) as exc:
            raise LogError(f"nak of seq {self.msg.seq} not sent: {type(exc).__name__}") from None

    async def term(self) -> None:
        try:
            await self._raw.term()  # type: ignore[attr-defined]
        except (NatsError, TimeoutError) as exc:
            raise LogError(f"term of seq {self.msg.seq} not sent: {type(exc).__name__}") from None


class ConfirmedDelivery(NatsDelivery):
    """A delivery whose acknowledgement waits for the server's confirmation (``AckSync``)."""

    async def ack(self) -> None:
        try:
            await self._raw.ack_sync()  # type: ignore[attr-defined]
        except (NatsError, TimeoutError) as exc:
            raise LogError(f"ack of seq {self.msg.seq} not confirmed: {type(exc).__name__}") from None


class NatsConsumers:
    """Durable consumers on a live JetStream (explicit acks, every message from the first: deliver policy ``all``,
    so a consumer created after a publish still gets it)."""

    def __init__(self, js: JetStreamContext) -> None:
        self.js = js
        self._subs: dict[tuple[str, str], JetStreamContext.PullSubscription] = {}

    async def add_consumer(
        self, stream: str, durable: str, *, filter_subject: str, ack_wait_s: float, max_deliver: int = -1
    ) -> None:
        config = ConsumerConfig(
            durable_name=durable, ack_policy=AckPolicy.EXPLICIT, deliver_policy=DeliverPolicy.ALL,
            filter_subject=filter_subject, ack_wait=ack_wait_s, max_deliver=max_deliver,
        )
        await self.js.add_consumer(stream, config=config)

    async def fetch(self, stream: str, durable: str, *, batch: int = 1, timeout: float = 1.0) -> list[Delivery]:
        sub = self._subs.get((stream, durable))
        if sub is None:
            sub = await self.js.pull_subscribe_bind(durable=durable, stream=stream)
            self._subs[(stream, durable)] = sub
        try:
            msgs = await sub.fetch(batch, timeout=timeout)
        except (NatsTimeout, TimeoutError):
            return []
        return [self.delivery(m) for m in msgs]

    def delivery(self, raw: object) -> Delivery:
        return NatsDelivery(raw)

    async def unsubscribe(self) -> None:
        """Drop the subscriptions (the consumers stay on the server, with what they have not acknowledged)."""
        subs, self._subs = self._subs, {}
        for sub in subs.values():
            await sub.unsubscribe()
