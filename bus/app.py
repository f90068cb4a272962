"""The FastStream app factory (ARCHITECTURE §5).

FastStream's default JetStream ack policy terms a message on any exception (stack facts §3, pitfall
14): it is never redelivered. Here every subscriber acknowledges manually:

- success: ``ack``;
- an exception before the last delivery: ``nak`` with a doubling backoff (:func:`on_failure`);
- an exception on the last delivery: an alert on ``hm.alert.poison`` (durable, on the facts stream)
  and only then ``ack``. If the alert cannot be published the message is nacked again: a message
  never ends in a silent drop.

An event is only a wake-up; handlers re-read the authority (ARCHITECTURE §5).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import msgspec
from faststream import AckPolicy
from faststream.nats import JStream, NatsBroker, NatsMessage, PullSub
from faststream.nats.security import NatsNKey
from nats.js.api import ConsumerConfig, DeliverPolicy

from bus.subjects import FACTS_STREAM, alert_subject
from kernel import metrics
from kernel.credentials import Credentials, credentials_from_env
from kernel.logctx import ctx

log = logging.getLogger("hostmove.bus")

Handler = Callable[[bytes, Mapping[str, str]], Awaitable[None]]


@dataclass(frozen=True)
class RedeliveryPolicy:
    """Bounded redelivery: ``max_deliver`` attempts, waits doubling from ``first_backoff_s``."""

    max_deliver: int = 5
    first_backoff_s: float = 0.5
    max_backoff_s: float = 30.0
    ack_wait_s: float = 30.0


@dataclass(frozen=True)
class Nack:
    delay_s: float


class DependencyDown(Exception):
    """A handler's dependency (S3, NATS) is unavailable: the message waits for it, redelivered after the longest
    backoff and never made a poison alert (an outage is its own error, not the message's fault)."""


@dataclass(frozen=True)
class Alert:
    reason: str


def on_failure(delivered: int, policy: RedeliveryPolicy) -> Nack | Alert:
    """What to do with a message whose handler raised on its ``delivered``-th delivery. Pure."""
    if delivered >= policy.max_deliver:
        return Alert(f"handler failed on all {policy.max_deliver} deliveries")
    delay = min(policy.first_backoff_s * (2 ** max(delivered - 1, 0)), policy.max_backoff_s)
    return Nack(delay)


class PoisonAlert(msgspec.Struct, frozen=True):
    """The alert a message becomes when its redelivery is exhausted."""

    kind: str
    service: str
    durable: str
    subject: str
    stream_seq: int
    deliveries: int
    error: str
    reason: str


def _describe(exc: BaseException) -> str:
    """The error's type and first line, bounded; never a payload or a secret."""
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text[:200]}"


def make_broker(nats_url: str, *, name: str = "hostmove", credentials: Credentials | None = None) -> NatsBroker:
    """A broker authenticated as ``credentials``' role (default: the file ``HOSTMOVE_CREDENTIALS`` names)."""
    creds = credentials if credentials is not None else credentials_from_env()
    auth: dict[str, Any] = {}
    if creds is not None and creds.nats_seed:
        auth = {"security": NatsNKey.from_seed(creds.nats_seed), "inbox_prefix": creds.inbox_prefix}
    servers = [u.strip() for u in nats_url.split(",") if u.strip()]  # a cluster's URLs (issue 19 item 4)
    # Reconnect for ever on the capped wait (a good daemon; FastStream's default gives up after 60 attempts).
    # Its lines go through this process's JSON handler (FastStream's own logger prints coloured text).
    return NatsBroker(servers, name=name, connect_timeout=5, max_reconnect_attempts=-1, reconnect_time_wait=2,
                      logger=logging.getLogger("hostmove.bus.faststream"), **auth)


def subscribe(
    broker: NatsBroker,
    *,
    service: str,
    subject: str,
    stream: str,
    durable: str,
    handler: Handler,
    policy: RedeliveryPolicy | None = None,
    max_workers: int = 1,
    deliver_new: bool = False,
    settle_s: float = 0.0,
    credentials: Credentials | None = None,
) -> Any:
    """Register ``handler`` on a durable pull consumer with manual acks and bounded redelivery. ``max_workers``
    handles that many messages at once (the handler serializes what must be); ``deliver_new`` makes a consumer
    created for the first time start at the stream's end, not replay its history (a wake-up consumer beside a
    backstop: what happened before the service first ran is the backstop's). ``settle_s``: a message younger than
    this (by the stream's timestamp) is redelivered once it is that old, so the writer that published it has
    finished the step it was in (a recovery looks at what a live actor left owed, never races it); that delivery
    counts towards ``max_deliver``. ``credentials``: the role the broker connects as (:func:`make_broker`'s), whose
    inbox prefix the pull subscription's reply inbox takes (FastStream's own default, ``_INBOX``, is a subject no
    role but the admin may subscribe to, :func:`hostmove.access.inbox_prefix`)."""
    pol = policy or RedeliveryPolicy()
    inbox = credentials.inbox_prefix if credentials is not None and credentials.inbox_prefix else "_INBOX"

    async def _deliver(body: bytes, msg: NatsMessage) -> None:
        raw = msg.raw_message
        md = raw.metadata
        metrics.CONSUMER_DELIVERIES.labels(durable=durable).inc()
        if md.num_delivered > 1:
            metrics.CONSUMER_REDELIVERIES.labels(durable=durable).inc()
        metrics.CONSUMER_PENDING.labels(durable=durable).set(md.num_pending)
        young = settle_s - (time.time() - md.timestamp.timestamp()) if settle_s > 0 else 0.0
        if young > 0:
            await msg.nack(delay=young)
            return
        try:
            await handler(body, dict(msg.headers or {}))
        except DependencyDown as exc:
            log.warning("%s: %s waits for a dependency: %s", service, raw.subject, _describe(exc),
                        extra=ctx(phase="deliver", reason=_describe(exc), subscriber=service, subject=raw.subject))
            await msg.nack(delay=pol.max_backoff_s)
            return
        except Exception as exc:  # noqa: BLE001 - every failure is handled below, never terms
            action = on_failure(md.num_delivered, pol)
            log.warning("%s: handler failed on %s (delivery %d): %s", service, raw.subject, md.num_delivered,
                        _describe(exc), extra=ctx(phase="deliver", reason=_describe(exc), subscriber=service,
                                                  subject=raw.subject, delivery=md.num_delivered,
                                                  stream_seq=md.sequence.stream))
            if isinstance(action, Nack):
                await msg.nack(delay=action.delay_s)
                return
            alert = PoisonAlert(
                kind="poison", service=service, durable=durable, subject=raw.subject,
                stream_seq=md.sequence.stream, deliveries=md.num_delivered, error=_describe(exc),
                reason=action.reason,
            )
            try:
                await broker.publish(msgspec.json.encode(alert), alert_subject("poison"), stream=FACTS_STREAM)
            except Exception as pub_exc:  # noqa: BLE001 - keep the message rather than drop it
                log.error("%s: alert for %s not published (%s); keeping the message", service, raw.subject,
                          _describe(pub_exc), extra=ctx(phase="deliver", reason=_describe(pub_exc),
                                                        subscriber=service, subject=raw.subject))
                await msg.nack(delay=pol.max_backoff_s)
                return
            metrics.alert_raised("poison")
            await msg.ack()
            return
        await msg.ack()

    return broker.subscriber(
        subject,
        stream=JStream(name=stream, declare=False),
        durable=durable,
        pull_sub=PullSub(batch_size=1, timeout=1.0),
        config=ConsumerConfig(ack_wait=pol.ack_wait_s, max_deliver=-1,
                              deliver_policy=DeliverPolicy.NEW if deliver_new else DeliverPolicy.ALL),
        ack_policy=AckPolicy.MANUAL,
        max_workers=max_workers,
        decoder=_raw_body,
        inbox_prefix=f"{inbox}.".encode(),  # FastStream appends the NUID to it as it is
    )(_deliver)


async def _raw_body(msg: Any) -> bytes:
    """The message's bytes as published: FastStream's own decoder parses a JSON body, which ``bytes`` then refuses
    (the ledger's events are JSON); the handler decodes its own type."""
    return bytes(msg.body)
