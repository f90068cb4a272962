"""JetStream binding of the event log port (stack facts §3).

- ``Nats-Msg-Id`` dedup is stream-wide with a 120 s window by default;
- ``Nats-Expected-Last-Subject-Sequence`` is checked before dedup, so a retried conditional publish
  gets 10071, which the ledger resolves by reading the subject's last message.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping

import nats
from nats.aio.client import Client
from nats.errors import ConnectionClosedError, NoRespondersError
from nats.errors import TimeoutError as NatsTimeout
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, StorageType, StreamConfig
from nats.js.errors import APIError, BadRequestError, NotFoundError

from bus.log import LogError, PubAck, StoredMessage, StreamState, WrongLastSequence
from bus.subjects import FACTS_STREAM, FACTS_SUBJECTS, LEDGER_STREAM, LEDGER_SUBJECTS

WRONG_LAST_SEQUENCE = 10071


async def ensure_streams(js: JetStreamContext) -> None:
    """Declare the streams this system uses (idempotent)."""
    for name, subjects in ((LEDGER_STREAM, LEDGER_SUBJECTS), (FACTS_STREAM, FACTS_SUBJECTS)):
        config = StreamConfig(name=name, subjects=subjects, storage=StorageType.FILE)
        try:
            await js.stream_info(name)
        except NotFoundError:
            try:
                await js.add_stream(config)
            except BadRequestError:
                await js.stream_info(name)  # created concurrently


def _headers(raw: Mapping[str, str] | None) -> dict[str, str]:
    return dict(raw or {})


class NatsEventLog:
    """The event log over a live JetStream connection. ``connect()`` also declares the streams."""

    def __init__(self, nc: Client, js: JetStreamContext, timeout: float = 5.0) -> None:
        self.nc = nc
        self.js = js
        self.timeout = timeout

    @classmethod
    async def connect(cls, url: str, *, name: str = "hostmove", timeout: float = 5.0) -> NatsEventLog:
        try:
            nc = await nats.connect(url, name=name, connect_timeout=timeout, max_reconnect_attempts=3)
        except (OSError, NatsTimeout, NoRespondersError) as exc:
            raise LogError(f"cannot reach NATS at {url}: {type(exc).__name__}") from None
        js = nc.jetstream(timeout=timeout)
        await ensure_streams(js)
        return cls(nc, js, timeout)

    async def close(self) -> None:
        if not self.nc.is_closed:
            await self.nc.drain()

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
        try:
            ack = await self.js.publish(subject, data, stream=stream, headers=hdrs or None)
        except APIError as exc:
            if exc.err_code == WRONG_LAST_SEQUENCE:
                raise WrongLastSequence(str(exc.description)) from None
            raise LogError(f"publish refused: {exc.description} ({exc.err_code})") from None
        except (TimeoutError, NatsTimeout, ConnectionClosedError, NoRespondersError, OSError) as exc:
            raise LogError(f"publish outcome unknown: {type(exc).__name__}") from None
        return PubAck(seq=ack.seq, duplicate=bool(ack.duplicate))

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
        try:
            raw = await self.js.get_last_msg(stream, subject)
        except NotFoundError:
            return None
        except APIError as exc:
            if exc.err_code == 10037:  # no message found
                return None
            raise LogError(f"read of the last message failed: {exc.description}") from None
        except (TimeoutError, NatsTimeout, ConnectionClosedError, NoRespondersError) as exc:
            raise LogError(f"read of the last message failed: {type(exc).__name__}") from None
        return self._stored(raw)

    async def get(self, stream: str, seq: int) -> StoredMessage | None:
        try:
            raw = await self.js.get_msg(stream, seq)
        except NotFoundError:
            return None
        except APIError as exc:
            if exc.err_code == 10037:
                return None
            raise LogError(f"read of message {seq} failed: {exc.description}") from None
        except (TimeoutError, NatsTimeout, ConnectionClosedError) as exc:
            raise LogError(f"read of message {seq} failed: {type(exc).__name__}") from None
        return self._stored(raw)

    async def state(self, stream: str) -> StreamState:
        try:
            info = await self.js.stream_info(stream)
        except (TimeoutError, APIError, NatsTimeout) as exc:
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
        sub = await self.js.pull_subscribe(subject or ">", durable=None, stream=stream, config=config)
        try:
            while True:
                try:
                    msgs = await sub.fetch(batch, timeout=1.0)
                except (NatsTimeout, TimeoutError):
                    return
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
