"""Durable pull consumers on a real NATS JetStream, in the shape of the twin's (contract tests only).

The contract tests run the same functions against :class:`~sim.twins.jetstream.SimJetStream` and
against nats-server through this adapter, so the twin's redelivery semantics are held to the
server's (stack facts §3).
"""

from __future__ import annotations

from nats.errors import TimeoutError as NatsTimeout
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from bus.log import StoredMessage
from sim.twins.jetstream import Delivery

__all__ = ["NatsConsumers", "NatsDelivery"]


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
        await self._raw.ack_sync()  # type: ignore[attr-defined]

    async def nak(self, delay: float = 0.0) -> None:
        await self._raw.nak(delay=delay or None)  # type: ignore[attr-defined]

    async def term(self) -> None:
        await self._raw.term()  # type: ignore[attr-defined]


class NatsConsumers:
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
        return [NatsDelivery(m) for m in msgs]

    async def crash(self) -> None:
        """Drop every subscription without acknowledging anything (a consumer process dying)."""
        subs, self._subs = self._subs, {}
        for sub in subs.values():
            await sub.unsubscribe()
