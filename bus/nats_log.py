"""JetStream binding of the event log port (stack facts §3).

- ``Nats-Msg-Id`` dedup is stream-wide with a 120 s window by default;
- ``Nats-Expected-Last-Subject-Sequence`` is checked before dedup, so a retried conditional publish
  gets 10071, which the ledger resolves by reading the subject's last message.

**Outages** (issue 11 item 3). The connection reconnects forever (``max_reconnect_attempts=-1``), each attempt
after a capped exponential backoff (:func:`reconnect_delay`, 0.1 s doubling to ``reconnect_wait_max_s``, 2 s by
default, with jitter); nats-py replays every core subscription on the new connection by itself. With
``wait=True`` the first connect also retries forever on the same backoff (a service started before NATS waits,
not ready, instead of dying). While the connection is down every call raises :class:`~bus.log.LogUnavailable`
at once (nothing is buffered to be sent later), and :meth:`NatsEventLog.down_reason` says why; after a reconnect
the streams are declared again (a server that came back without its storage gets them back; the ledger's rebase
restates what its stream lost).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import random
import time
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any
from urllib.parse import urlsplit

from nats.aio.client import Client
from nats.errors import (
    ConnectionClosedError,
    ConnectionReconnectingError,
    NoRespondersError,
    OutboundBufferLimitError,
    StaleConnectionError,
)
from nats.errors import Error as NatsError
from nats.errors import TimeoutError as NatsTimeout
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, StorageType, StreamConfig
from nats.js.errors import APIError, BadRequestError, NotFoundError, ServiceUnavailableError

from bus.consumers import Delivery, NatsConsumers
from bus.log import LogError, LogUnavailable, PubAck, StoredMessage, StreamState, WrongLastSequence
from bus.subjects import FACTS_STREAM, FACTS_SUBJECTS, LEDGER_STREAM, LEDGER_SUBJECTS, WORK_STREAM, WORK_SUBJECTS
from kernel import metrics
from kernel.credentials import Credentials, credentials_from_env

log = logging.getLogger("hostmove.bus")

WRONG_LAST_SEQUENCE = 10071
RECONNECT_WAIT_MIN_S = 0.1
RECONNECT_WAIT_MAX_S = 2.0
"""The cap of the reconnect backoff (and of the first connect's, with ``wait=True``)."""
PING_INTERVAL_S = 10
"""A server gone without a reset (a partition) is noticed after about three unanswered pings."""

_UNAVAILABLE: tuple[type[BaseException], ...] = (
    OSError, TimeoutError, NatsTimeout, ConnectionClosedError, ConnectionReconnectingError, NoRespondersError,
    OutboundBufferLimitError, StaleConnectionError, ServiceUnavailableError,
)
"""What a call meets when NATS (or its JetStream) does not answer: the dependency is down, not the request."""
_CONNECT_ERRORS: tuple[type[BaseException], ...] = (*_UNAVAILABLE, NatsError, APIError)


def reconnect_delay(attempt: int, *, low: float = RECONNECT_WAIT_MIN_S, cap: float = RECONNECT_WAIT_MAX_S,
                    rng: Callable[[], float] = random.random) -> float:
    """Seconds before connect attempt ``attempt`` (0 for the first after a loss): ``low`` doubling per attempt up to
    ``cap``, with +-20 % jitter so a fleet of services does not knock in step. Pure but for ``rng``."""
    base = min(cap, low * (2 ** min(max(attempt, 0), 30)))
    return min(cap, base * (0.8 + 0.4 * rng()))


def next_server(servers: list[Any], *, cap: float = RECONNECT_WAIT_MAX_S,
                rng: Callable[[], float] = random.random) -> tuple[Any, float]:
    """Which of a cluster's servers to reconnect to, and after how long: the one with the fewest failed attempts
    since it last connected (the first of those, in the order given), after the capped backoff of its own failures.
    Never ``None``: nats-py then takes the first server of its pool every time, and a client whose first URL was
    the node that died knocked on it forever while two live nodes served (tests/test_nats_cluster.py)."""
    chosen = min(servers, key=lambda s: getattr(s, "reconnects", 0))
    return chosen, reconnect_delay(getattr(chosen, "reconnects", 0), cap=cap, rng=rng)


REPLICAS_ENV = "HOSTMOVE_STREAM_REPLICAS"
"""The deployment's stream replica count (issue 19 item 4): 1 on the embedded single server, 3 on a three-node
cluster (``hostmove stack up --nats-cluster 3`` sets it for the services it starts; the compose file sets it)."""


def stream_replicas(env: Mapping[str, str]) -> int:
    """The replica count :data:`REPLICAS_ENV` names (default 1); a bad value raises ``ValueError``."""
    raw = env.get(REPLICAS_ENV, "").strip() or "1"
    if not raw.isdigit() or not 1 <= int(raw) <= 5:
        raise ValueError(f"{REPLICAS_ENV} must be a replica count from 1 to 5 (JetStream's limit), not {raw!r}")
    return int(raw)


def server_urls(url: str) -> list[str]:
    """Each server of a NATS URL list (``nats://a:4222,nats://b:4222``): nats-py takes a list, never that string."""
    return [part.strip() for part in url.split(",") if part.strip()]


async def ensure_streams(js: JetStreamContext, *, replicas: int = 1) -> None:
    """Declare the streams this system uses with ``replicas`` replicas (idempotent). A stream found with fewer
    replicas is raised to ``replicas`` (JetStream moves a stream's replica count in place); never lowered."""
    for name, subjects, per_subject in ((LEDGER_STREAM, LEDGER_SUBJECTS, -1), (FACTS_STREAM, FACTS_SUBJECTS, -1),
                                        (WORK_STREAM, WORK_SUBJECTS, 1)):
        # HM_WORK keeps the newest notice per box and host: an index of the hosts with news, bounded by them
        config = StreamConfig(name=name, subjects=subjects, storage=StorageType.FILE, num_replicas=replicas,
                              max_msgs_per_subject=per_subject)
        try:
            info = await js.stream_info(name)
        except NotFoundError:
            try:
                await js.add_stream(config)
            except BadRequestError:
                await js.stream_info(name)  # created concurrently
            continue
        if (info.config.num_replicas or 1) < replicas:
            log.warning("stream %s has %d replicas; raising it to %d", name, info.config.num_replicas or 1, replicas)
            await js.update_stream(dataclasses.replace(info.config, num_replicas=replicas))


def _headers(raw: Mapping[str, str] | None) -> dict[str, str]:
    return dict(raw or {})


def _addresses(url: str) -> list[tuple[str, int]]:
    """The ``(host, port)`` of each server of a NATS URL list (``nats://a:4222,nats://b:4222``)."""
    out = []
    for part in url.split(","):
        part = part.strip()
        if not part:
            continue
        parsed = urlsplit(part if "://" in part else f"nats://{part}")
        out.append((parsed.hostname or "127.0.0.1", parsed.port or 4222))
    return out


async def _accepts(addresses: list[tuple[str, int]], timeout: float) -> bool:
    """True if one server accepts a TCP connection within ``timeout`` (the first connect's cheap look)."""
    for host, port in addresses:
        try:
            _reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
        except (OSError, TimeoutError):
            continue
        writer.close()
        try:
            await writer.wait_closed()
        except OSError:
            pass
        return True
    return False


def _refusal(text: str) -> bool:
    """The server refused the connection's credentials (its error text)."""
    return "authorization violation" in text.lower()


class NatsEventLog:
    """The event log over a live JetStream connection. ``connect()`` also declares the streams."""

    def __init__(self, nc: Client, js: JetStreamContext, timeout: float = 5.0, *, url: str = "",
                 reconnect_wait_max_s: float = RECONNECT_WAIT_MAX_S, replicas: int = 1) -> None:
        self.nc = nc
        self.replicas = replicas
        self.js = js
        self.timeout = timeout
        self.url = url
        self.reconnect_wait_max_s = reconnect_wait_max_s
        self.disconnected_at: float | None = None  # monotonic, while the connection is down
        self.reconnects = 0
        self.last_error = ""  # the server's or the client's last error text (an authorization violation, say)
        self.refused = False  # the server refused the first connect's credentials (authorization violation)
        self._connecting: asyncio.Future[None] | None = None  # the first connect, while it runs
        self._on_reconnect: list[Callable[[], None]] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._consumers = NatsConsumers(js)

    @classmethod
    async def connect(cls, url: str, *, name: str = "hostmove", timeout: float = 5.0, wait: bool = False,
                      reconnect_wait_max_s: float = RECONNECT_WAIT_MAX_S,
                      on_retry: Callable[[int, str], None] | None = None,
                      credentials: Credentials | None = None, replicas: int = 1) -> NatsEventLog:
        """Connect and declare the streams. Without ``wait`` an unreachable server raises
        :class:`~bus.log.LogUnavailable` at once (a command line tool); with it the connect retries forever on the
        capped backoff, calling ``on_retry(attempt, reason)`` before each wait (a service: cancel it to give up).

        ``credentials`` (default: the file ``HOSTMOVE_CREDENTIALS`` names, if any) authenticate the connection with
        the role's nkey and give it the role's inbox prefix (:mod:`kernel.credentials`, :mod:`hostmove.access`).
        ``url`` may list a cluster's servers (comma-separated); the streams are declared with ``replicas``."""
        addresses = _addresses(url)
        creds = credentials if credentials is not None else credentials_from_env()
        attempt = 0
        while True:
            reason = await cls._try_once(addresses, url, name, timeout, reconnect_wait_max_s, creds, replicas)
            if isinstance(reason, NatsEventLog):
                return reason
            if not wait:
                raise LogUnavailable(reason)
            if on_retry is not None:
                on_retry(attempt, reason)
            await asyncio.sleep(reconnect_delay(attempt, cap=reconnect_wait_max_s))
            attempt += 1

    @classmethod
    async def _try_once(cls, addresses: list[tuple[str, int]], url: str, name: str, timeout: float,
                        cap: float, creds: Credentials | None = None, replicas: int = 1) -> NatsEventLog | str:
        """One first-connect attempt: the connected log, or why it failed. A server that accepts TCP is handed to
        nats-py (whose own first-connect loop would otherwise retry forever on a fixed wait, out of our hands)."""
        if not await _accepts(addresses, timeout):
            return f"cannot reach NATS at {url}: nothing accepts connections"
        nc = Client()
        events = cls(nc, nc.jetstream(timeout=timeout), timeout, url=url, reconnect_wait_max_s=cap, replicas=replicas)
        auth: dict[str, Any] = {}
        if creds is not None and creds.nats_seed:
            auth = {"nkeys_seed_str": creds.nats_seed, "inbox_prefix": creds.inbox_prefix}
        who = f"the {creds.role} credentials" if creds is not None else "a connection without credentials"
        refused = f"NATS at {url} refused {who} (authorization violation)"
        connecting = asyncio.ensure_future(nc.connect(
            server_urls(url), name=name, connect_timeout=max(1, int(timeout)), allow_reconnect=True, **auth,
            max_reconnect_attempts=-1, reconnect_time_wait=max(1, int(cap)),
            ping_interval=PING_INTERVAL_S, max_outstanding_pings=3,
            reconnect_to_server_handler=events._next_server, disconnected_cb=events._disconnected,
            reconnected_cb=events._reconnected, error_cb=events._error, closed_cb=events._closed,
        ))
        events._connecting = connecting
        try:
            await asyncio.wait_for(asyncio.shield(connecting), timeout * 2)
            events._connecting = None
            await ensure_streams(events.js, replicas=replicas)
        except asyncio.CancelledError:  # ours (:meth:`_error` ended a refused connect) or the caller's
            await events._abandon(connecting)
            if not events.refused:
                raise
            return refused
        except _CONNECT_ERRORS as exc:
            await events._abandon(connecting)
            if events.refused or _refusal(str(exc)):
                return refused
            return f"cannot reach NATS at {url}: {type(exc).__name__}"
        except BaseException:
            await events._abandon(connecting)
            raise
        return events

    async def _abandon(self, connecting: asyncio.Future[None] | None = None) -> None:
        self._connecting = None
        if connecting is not None and not connecting.done():
            connecting.cancel()
            await asyncio.gather(connecting, return_exceptions=True)
        try:
            await self.nc.close()
        except Exception:  # noqa: BLE001 - a client that never connected has nothing to flush
            pass

    # -- the connection's state ---------------------------------------------------------------------------------

    def _next_server(self, servers: list[Any], _info: dict[str, Any]) -> tuple[Any, float]:
        """nats-py's reconnect hook: :func:`next_server`, on this log's cap."""
        return next_server(servers, cap=self.reconnect_wait_max_s)

    async def _disconnected(self) -> None:
        if self.disconnected_at is None and not self.nc.is_closed:
            self.disconnected_at = time.monotonic()
            log.warning("NATS connection to %s lost; reconnecting (capped backoff, forever)", self.url)

    async def _reconnected(self) -> None:
        down = time.monotonic() - self.disconnected_at if self.disconnected_at is not None else 0.0
        self.disconnected_at = None
        self.reconnects += 1
        log.warning("NATS connection to %s back after %.1f s (reconnect %d)", self.url, down, self.reconnects)
        task = asyncio.ensure_future(self._redeclare())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        for listener in list(self._on_reconnect):
            try:
                listener()
            except Exception:  # noqa: BLE001 - a listener's defect never breaks the connection
                log.exception("a reconnect listener failed")

    async def _redeclare(self) -> None:
        for attempt in range(10):
            try:
                await ensure_streams(self.js, replicas=self.replicas)
                return
            except _CONNECT_ERRORS as exc:
                log.info("streams not declared after the reconnect (%s); again", type(exc).__name__)
                await asyncio.sleep(reconnect_delay(attempt))

    async def _error(self, exc: Exception) -> None:
        self.last_error = str(exc)
        if self._connecting is not None and _refusal(self.last_error):
            # The first connect's refusal is final: nats-py would retry it for ever, and a later attempt's timeout
            # would hide why (stop 28's CI: a refused stranger reported as "cannot reach NATS: TimeoutError").
            self.refused = True
            self._connecting.cancel()
        log.debug("NATS client error on %s: %s: %s", self.url, type(exc).__name__, exc)

    async def _closed(self) -> None:
        log.info("NATS connection to %s closed", self.url)

    def on_reconnect(self, listener: Callable[[], None]) -> None:
        """Call ``listener()`` after every reconnect (e.g. to wake a loop backing off)."""
        self._on_reconnect.append(listener)

    def down_reason(self) -> str | None:
        """Why the log cannot be used now (None: connected). Cheap, no request."""
        if self.nc.is_closed:
            return f"the NATS connection to {self.url or 'the server'} is closed"
        if not self.nc.is_connected:
            since = ""
            if self.disconnected_at is not None:
                since = f" for {time.monotonic() - self.disconnected_at:.0f} s"
            return f"NATS at {self.url or 'the server'} is not connected (reconnecting{since})"
        return None

    @property
    def connected(self) -> bool:
        return self.down_reason() is None

    def _require(self) -> None:
        reason = self.down_reason()
        if reason is not None:
            raise LogUnavailable(reason)

    def _unavailable(self, what: str, exc: BaseException) -> LogUnavailable:
        return LogUnavailable(f"{what}: NATS did not answer ({type(exc).__name__})"
                              + (f"; {self.down_reason()}" if self.down_reason() else ""))

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self.nc.is_closed:
            return
        # A durable consumer's pull subscription may hold fetched messages nobody will take: dropped first (the
        # server redelivers what was not acknowledged), or the drain below waits its whole timeout for them.
        with contextlib.suppress(Exception):
            await self._consumers.unsubscribe()
        if self.nc.is_connected:
            try:
                await self.nc.drain()
                return
            except Exception:  # noqa: BLE001 - lost while draining: close without it
                pass
        await self.nc.close()

    async def publish(
        self,
        stream: str,
        subject: str,
        data: bytes,
        *,
        msg_id: str | None = None,
        expected_last_subject_seq: int | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> PubAck:
        hdrs = _headers(headers)
        if msg_id is not None:
            hdrs["Nats-Msg-Id"] = msg_id
        if expected_last_subject_seq is not None:
            hdrs["Nats-Expected-Last-Subject-Sequence"] = str(expected_last_subject_seq)
        self._require()
        started, outcome = time.monotonic(), "unavailable"
        try:
            ack = await self.js.publish(subject, data, stream=stream, headers=hdrs or None)
            outcome = "duplicate" if ack.duplicate else "ok"
        except _UNAVAILABLE as exc:
            raise self._unavailable("publish outcome unknown", exc) from None
        except APIError as exc:
            if exc.err_code == WRONG_LAST_SEQUENCE:
                outcome = "wrong_last_sequence"
                raise WrongLastSequence(str(exc.description)) from None
            outcome = "refused"
            raise LogError(f"publish refused: {exc.description} ({exc.err_code})") from None
        finally:  # to its ack, by answer (issue 19 item 5)
            metrics.PUBLISH_SECONDS.labels(stream=stream, outcome=outcome).observe(time.monotonic() - started)
        return PubAck(seq=ack.seq, duplicate=bool(ack.duplicate))

    async def notice(self, stream: str, subject: str, data: bytes = b"") -> None:
        """A core publish on a subject ``stream`` captures: stored with no acknowledgement awaited."""
        self._require()
        try:
            await self.nc.publish(subject, data)
        except _CONNECT_ERRORS as exc:
            raise self._unavailable("notice not sent", exc) from None

    async def add_consumer(
        self, stream: str, durable: str, *, filter_subject: str, ack_wait_s: float, max_deliver: int = -1
    ) -> None:
        """Declare a durable pull consumer (idempotent: the same configuration again changes nothing)."""
        self._require()
        try:
            await self._consumers.add_consumer(stream, durable, filter_subject=filter_subject,
                                               ack_wait_s=ack_wait_s, max_deliver=max_deliver)
        except _UNAVAILABLE as exc:
            raise self._unavailable("consumer not declared", exc) from None
        except APIError as exc:
            raise LogError(f"consumer {durable} refused: {exc.description} ({exc.err_code})") from None

    async def fetch(self, stream: str, durable: str, *, batch: int = 1, timeout: float = 1.0) -> list[Delivery]:
        """Up to ``batch`` deliveries of ``durable``, waiting at most ``timeout`` s for the first."""
        self._require()
        try:
            return await self._consumers.fetch(stream, durable, batch=batch, timeout=timeout)
        except _UNAVAILABLE as exc:
            raise self._unavailable("fetch failed", exc) from None
        except APIError as exc:
            raise LogError(f"fetch from {durable} refused: {exc.description} ({exc.err_code})") from None

    @staticmethod
    def _stored(raw: object) -> StoredMessage:
        seq = getattr(raw, "seq")  # noqa: B009
        return StoredMessage(
            seq=int(seq),
            subject=getattr(raw, "subject"),  # noqa: B009
            data=getattr(raw, "data", None) or b"",
            headers=_headers(getattr(raw, "headers", None)),
        )

    async def last(self, stream: str, subject: str) -> StoredMessage | None:
        self._require()
        try:
            raw = await self.js.get_last_msg(stream, subject)
        except NotFoundError:
            return None
        except _UNAVAILABLE as exc:
            raise self._unavailable("read of the last message failed", exc) from None
        except APIError as exc:
            if exc.err_code == 10037:  # no message found
                return None
            raise LogError(f"read of the last message failed: {exc.description}") from None
        return self._stored(raw)

    async def get(self, stream: str, seq: int) -> StoredMessage | None:
        self._require()
        try:
            raw = await self.js.get_msg(stream, seq)
        except NotFoundError:
            return None
        except _UNAVAILABLE as exc:
            raise self._unavailable(f"read of message {seq} failed", exc) from None
        except APIError as exc:
            if exc.err_code == 10037:
                return None
            raise LogError(f"read of message {seq} failed: {exc.description}") from None
        return self._stored(raw)

    async def state(self, stream: str) -> StreamState:
        self._require()
        try:
            info = await self.js.stream_info(stream)
        except _UNAVAILABLE as exc:
            raise self._unavailable("stream info failed", exc) from None
        except APIError as exc:
            raise LogError(f"stream info failed: {type(exc).__name__}") from None
        st = info.state
        return StreamState(first_seq=st.first_seq, last_seq=st.last_seq, messages=st.messages)

    async def replay(
        self, stream: str, *, start_seq: int = 1, subject: str | None = None, batch: int = 512
    ) -> AsyncIterator[StoredMessage]:
        """Ordered replay through an ephemeral pull consumer with no acks (stack facts §3)."""
        st = await self.state(stream)
        if st.messages == 0 or start_seq > st.last_seq:
            return
        config = ConsumerConfig(
            ack_policy=AckPolicy.NONE,
            deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
            opt_start_seq=max(start_seq, 1),
            filter_subject=subject,
            inactive_threshold=30.0,
        )
        try:
            sub = await self.js.pull_subscribe(subject or ">", durable=None, stream=stream, config=config)
        except _UNAVAILABLE as exc:
            raise self._unavailable("replay failed", exc) from None
        try:
            while True:
                try:
                    msgs = await sub.fetch(batch, timeout=1.0)
                except (NatsTimeout, TimeoutError):
                    self._require()  # a timeout because the connection went: not the end of the stream
                    return
                except _UNAVAILABLE as exc:
                    raise self._unavailable("replay failed", exc) from None
                done = False
                for m in msgs:
                    md = m.metadata
                    if md.sequence.stream > st.last_seq:
                        done = True
                        break
                    yield StoredMessage(
                        seq=md.sequence.stream, subject=m.subject, data=m.data, headers=_headers(m.headers)
                    )
                    if md.num_pending == 0 or md.sequence.stream >= st.last_seq:
                        done = True
                        break
                if done:
                    return
        finally:
            try:
                await sub.unsubscribe()
            except Exception:  # noqa: BLE001 - best effort cleanup of an ephemeral consumer
                pass
