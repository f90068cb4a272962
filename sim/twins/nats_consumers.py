"""Durable pull consumers on a real NATS JetStream, in the shape of the twin's (contract tests only): the production
adapter :class:`bus.consumers.NatsConsumers`, with a crash (a consumer process dying) for the tests."""

from __future__ import annotations

from bus.consumers import ConfirmedDelivery, Delivery, NatsDelivery
from bus.consumers import NatsConsumers as _Production

__all__ = ["NatsConsumers", "NatsDelivery"]


class NatsConsumers(_Production):
    def delivery(self, raw: object) -> Delivery:
        return ConfirmedDelivery(raw)  # the contract tests compare the server's state right after an ack

    async def crash(self) -> None:
        """Drop every subscription without acknowledging anything (a consumer process dying)."""
        await self.unsubscribe()
