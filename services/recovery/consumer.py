"""The recovery's ledger consumer (issue 19 item 1; ARCHITECTURE §5): every transition wakes the recovery for its
host at once, from a JetStream durable pull consumer (``recovery`` on ``HM_LEDGER``, FastStream with the ack policy
of :mod:`bus.app`), so a restarted recovery resumes at its consumer's ack floor and an event published while it was
down still wakes it.

An event is only a wake-up: :meth:`~services.recovery.recovery.RecoveryPass.host` reads the claim and the record
again and decides from them, as the pass does. The periodic pass stays as the backstop (a missed event is always
possible, and deadlines pass without any event); the consumer starts at the stream's end the first time it is
created, since what happened before is the backstop's, and looks only once a transition is :data:`SETTLE_S` old.
An outage makes the message wait for the dependency
(:class:`~bus.app.DependencyDown`), never a poison alert; a body that names no host is logged and acknowledged, the
backstop standing in for it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import msgspec
from faststream.nats import NatsBroker

from bus.app import DependencyDown, Handler, make_broker, subscribe
from bus.log import LogUnavailable
from bus.subjects import LEDGER_STREAM, RECOVERY_DURABLE, RECOVERY_FILTER
from kernel.credentials import Credentials
from kernel.logctx import ctx
from services.objstore.port import StoreUnavailable
from services.recovery.recovery import RecoveryPass, log_report

log = logging.getLogger("hostmove.recovery")

SETTLE_S = 2.0
"""How old a transition is before the recovery looks at its host: the agent that wrote a record's half writes the
claim's within milliseconds, so the recovery follows only what a crash left owed and never races a live writer
(an auditor reads ``causation: recovery`` as a recovery, not as routine work)."""


class _Named(msgspec.Struct):
    """The one field a wake-up needs of a transition's envelope (:class:`events.envelope.Transition`)."""

    host: str


def ledger_handler(recovery: RecoveryPass) -> Handler:
    """The handler of one ledger transition: its host, looked at now."""

    async def handle(body: bytes, _headers: Mapping[str, str]) -> None:
        try:
            host = msgspec.json.decode(body, type=_Named).host
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.warning("recovery: a ledger message names no host (%s); the pass stands in for it", exc,
                        extra=ctx(phase="recovery", reason=exc))
            return
        try:
            report = await recovery.host(host)
        except (LogUnavailable, StoreUnavailable) as exc:
            raise DependencyDown(str(exc)) from exc
        log_report(report)

    return handle


def ledger_consumer(nats_url: str, recovery: RecoveryPass, *, workers: int, credentials: Credentials | None,
                    durable: str = RECOVERY_DURABLE) -> NatsBroker:
    """A broker (not started) whose durable subscriber wakes ``recovery`` for each transition, ``workers`` at once
    (the recovery's lock keeps one look per host at a time). One deployment has one ``durable``: recoveries that
    share it share its messages. ``credentials``: the process's role (the console's), as its runtime resolved them
    (:func:`hostmove.runtime.load_settings`), never the environment read again."""
    broker = make_broker(nats_url, name="hostmove-recovery-consumer", credentials=credentials)
    subscribe(broker, service="recovery", subject=RECOVERY_FILTER, stream=LEDGER_STREAM, credentials=credentials,
              durable=durable, handler=ledger_handler(recovery), max_workers=workers, deliver_new=True,
              settle_s=SETTLE_S)
    return broker
