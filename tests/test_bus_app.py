"""The FastStream app factory against real JetStream (ARCHITECTURE §5; issue 2 item 6).

An exception never terms a message: it is nacked with backoff, and after the last delivery it ends
in an alert on ``hm.alert.poison``, never in a silent drop.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping

import msgspec
import pytest

from bus.app import Alert, Nack, PoisonAlert, RedeliveryPolicy, make_broker, on_failure, subscribe
from bus.log import StoredMessage
from bus.nats_log import NatsEventLog
from bus.subjects import FACTS_STREAM, alert_subject, fact_subject
from hostmove.stackinfo import StackInfo
from kernel import metrics


def test_failure_policy_doubles_then_alerts() -> None:
    pol = RedeliveryPolicy(max_deliver=4, first_backoff_s=0.5, max_backoff_s=1.5)
    assert [on_failure(d, pol) for d in (1, 2, 3)] == [Nack(0.5), Nack(1.0), Nack(1.5)]
    assert isinstance(on_failure(4, pol), Alert) and isinstance(on_failure(9, pol), Alert)


async def wait_for(predicate: Callable[[], object], deadline_s: float = 20.0) -> None:
    end = time.monotonic() + deadline_s
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError("condition not met before the deadline")
        await asyncio.sleep(0.05)


async def poison_alerts_for(log: NatsEventLog, subject: str) -> list[PoisonAlert]:
    out = []
    msgs: list[StoredMessage] = [m async for m in log.replay(FACTS_STREAM, subject=alert_subject("poison"))]
    for m in msgs:
        alert = msgspec.json.decode(m.data, type=PoisonAlert)
        if alert.subject == subject:
            out.append(alert)
    return out


@pytest.mark.parametrize("fail_times", [2, 99])
async def test_exceptions_are_nacked_with_backoff_then_alerted(
    stack: StackInfo, unique: Callable[[str], str], fail_times: int
) -> None:
    log = await NatsEventLog.connect(stack.nats_url)  # declares the streams
    subject = fact_subject("test", unique("poison"))
    durable = unique("durable")
    calls: list[float] = []
    handled: list[bytes] = []

    async def handler(body: bytes, headers: Mapping[str, str]) -> None:
        calls.append(time.monotonic())
        if len(calls) <= fail_times:
            raise RuntimeError("boom with secret-free text")
        handled.append(body)

    broker = make_broker(stack.nats_url)
    policy = RedeliveryPolicy(max_deliver=3, first_backoff_s=0.2, max_backoff_s=1.0, ack_wait_s=5)
    subscribe(broker, service="test", subject=subject, stream=FACTS_STREAM, durable=durable,
              handler=handler, policy=policy)
    await broker.start()
    try:
        await log.publish(FACTS_STREAM, subject, b"payload")
        if fail_times < policy.max_deliver:
            await wait_for(lambda: handled)
            assert len(calls) == fail_times + 1 and handled == [b"payload"]
            assert calls[1] - calls[0] >= 0.15 and calls[2] - calls[1] >= 0.35, "backoff doubles"
            assert await poison_alerts_for(log, subject) == []
        else:
            alerts: list[PoisonAlert] = []

            async def poll() -> None:
                while not alerts:
                    alerts.extend(await poison_alerts_for(log, subject))
                    await asyncio.sleep(0.1)

            await asyncio.wait_for(poll(), 20)
            assert len(calls) == policy.max_deliver
            alert = alerts[0]
            assert alert.deliveries == policy.max_deliver and alert.durable == durable
            assert "RuntimeError" in alert.error
            # acknowledged after the alert: no further redelivery within the ack wait
            await asyncio.sleep(1.5)
            assert len(calls) == policy.max_deliver
        sample = metrics.REGISTRY.get_sample_value  # the consumer's metrics (issue 19 item 5)
        assert sample("hostmove_consumer_deliveries_total", {"durable": durable}) == len(calls)
        assert sample("hostmove_consumer_redeliveries_total", {"durable": durable}) == len(calls) - 1
        assert sample("hostmove_consumer_pending", {"durable": durable}) == 0
    finally:
        await broker.stop()
        await log.close()


async def test_replay_of_an_empty_subject_in_a_busy_stream_ends_cleanly(
    stack: StackInfo, unique: Callable[[str], str]
) -> None:
    """A filtered replay whose subject has no message must end, not raise (the fetch times out)."""
    log = await NatsEventLog.connect(stack.nats_url)
    try:
        await log.publish(FACTS_STREAM, fact_subject("test", unique("other")), b"x")
        assert [m async for m in log.replay(FACTS_STREAM, subject=fact_subject("test", unique("none")))] == []
    finally:
        await log.close()
