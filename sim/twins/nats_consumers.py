"""Durable pull consumers on a real NATS JetStream, in the shape of the twin's (contract tests only): the production
adapter :class:`bus.consumers.NatsConsumers`, with a crash (a consumer process dying) for the tests."""

from __future__ import annotations

from bus.consumers import NatsConsumers as _Production
from bus.consumers import NatsDelivery

__all__ = ["NatsConsumers", "NatsDelivery"]


class NatsConsumers(_Production):
    async def crash(self) -> None:
        """Drop every subscription without acknowledging anything (a consumer process dying)."""
        await self.unsubscribe()
