"""The JetStream twin of the simulation (ARCHITECTURE §7; stack facts §3).

:class:`SimJetStream` is the server. Its streams are :class:`~bus.memory_log.MemoryEventLog`'s
(stream-wide ``Nats-Msg-Id`` dedup within a window, the per-subject expected-last-sequence check made
**before** dedup, so a retried conditional publish gets 10071), with a dedup window per stream, and
it adds **durable pull consumers** with JetStream's delivery semantics:

- a fetched message stays pending until acknowledged; after the ack wait it is redelivered with
  ``num_delivered`` + 1, and redeliveries are served before new messages. A consumer that crashed
  with messages unacknowledged therefore gets newer messages first and the old ones later: out of
  order (stack facts §3, "Crash");
- ``nak(delay)`` redelivers after ``delay``; ``term()`` stops redelivery;
- ``max_deliver``: a message delivered that many times is not delivered again.

:class:`SimEventLog` is one actor's connection: the :class:`~bus.log.EventLog` port plus the consumer
calls, through a network whose faults come from the run's plan (a publish that never arrives, a lost
acknowledgement, a lost ack of a consumed message).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from bus.consumers import Consumers, Delivery
from bus.log import LogError, PubAck, StoredMessage, StreamState
from bus.memory_log import MemoryEventLog
from sim.faults import PublishFate
from sim.trace import Trace

__all__ = ["Consumers", "Delivery", "PublishFates", "SimDelivery", "SimEventLog", "SimJetStream", "subject_matches"]


def subject_matches(pattern: str, subject: str) -> bool:
    """NATS subject matching: ``*`` is one token, ``>`` one or more trailing tokens."""
    pat, sub = pattern.split("."), subject.split(".")
    for i, token in enumerate(pat):
        if token == ">":
            return len(sub) > i
        if i >= len(sub) or (token != "*" and token != sub[i]):
            return False
    return len(pat) == len(sub)


@dataclass
class _Pending:
    seq: int
    delivered: int
    due_ms: int


@dataclass
class _Consumer:
    stream: str
    durable: str
    filter_subject: str
    ack_wait_ms: int
    max_deliver: int
    next_seq: int = 1
    pending: dict[int, _Pending] = field(default_factory=dict)


class SimJetStream(MemoryEventLog):
    """The server: streams, dedup, subject sequences and durable consumers (see the module docstring)."""

    def __init__(
        self,
        *,
        now_ms: Callable[[], int],
        trace: Trace | None = None,
        dedup_window_ms: int = 120_000,
        windows: Mapping[str, int] | None = None,
    ) -> None:
        super().__init__(now_ms=now_ms, dedup_window_ms=dedup_window_ms)
        self.now_ms = now_ms
        self.trace = trace
        self.windows = dict(windows or {})
        self.consumers: dict[tuple[str, str], _Consumer] = {}
        self.observers: list[Callable[[str, StoredMessage], None]] = []
        self._waiters: list[asyncio.Future[None]] = []

    def _emit(self, what: str) -> None:
        if self.trace is not None:
            self.trace.emit("js", what)

    def _wake(self) -> None:
        waiters, self._waiters = self._waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

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
        """Atomic (never suspends): the window of ``stream``, then MemoryEventLog's checks."""
        default, self.dedup_window_ms = self.dedup_window_ms, self.windows.get(stream, self.dedup_window_ms)
        try:
            ack = await super().publish(stream, subject, data, msg_id=msg_id,
                                        expected_last_subject_seq=expected_last_subject_seq, headers=headers)
        finally:
            self.dedup_window_ms = default
        if ack.duplicate:
            self._emit(f"{stream} {subject} duplicate of seq {ack.seq} ({msg_id})")
        else:
            stored = self._msgs(stream)[-1]
            self._emit(f"{stream} seq {stored.seq} {subject} {msg_id or ''}")
            for observe in self.observers:
                observe(stream, stored)
            self._wake()
        return ack

    def notice_now(self, stream: str, subject: str, data: bytes = b"") -> None:
        """A work notice stored (atomic; no dedup, no sequence check, no acknowledgement)."""
        msgs = self._msgs(stream)
        seq = (msgs[-1].seq if msgs else self._first.get(stream, 1) - 1) + 1
        msgs.append(StoredMessage(seq=seq, subject=subject, data=data))
        self._emit(f"{stream} seq {seq} {subject}")
        self._wake()

    async def notice(self, stream: str, subject: str, data: bytes = b"") -> None:
        self.notice_now(stream, subject, data)

    # -- durable consumers --------------------------------------------------------------------------

    def add_consumer_now(
        self, stream: str, durable: str, *, filter_subject: str, ack_wait_s: float, max_deliver: int = -1
    ) -> None:
        """Create the consumer if it does not exist (idempotent, like a durable's re-declaration)."""
        key = (stream, durable)
        if key not in self.consumers:
            self.consumers[key] = _Consumer(stream, durable, filter_subject, int(ack_wait_s * 1000), max_deliver)

    def _take(self, c: _Consumer, batch: int) -> list[tuple[StoredMessage, int]]:
        now = self.now_ms()
        out: list[tuple[StoredMessage, int]] = []
        due = sorted((p for p in c.pending.values() if p.due_ms <= now), key=lambda p: (p.due_ms, p.seq))
        msgs = self._msgs(c.stream)
        first = msgs[0].seq if msgs else 1
        for p in due:
            if len(out) >= batch:
                break
            if c.max_deliver > 0 and p.delivered >= c.max_deliver:
                del c.pending[p.seq]  # exhausted: never delivered again
                self._emit(f"{c.durable} seq {p.seq} exhausted after {p.delivered} deliveries")
                continue
            idx = p.seq - first
            if not 0 <= idx < len(msgs):
                del c.pending[p.seq]
                continue
            p.delivered += 1
            p.due_ms = now + c.ack_wait_ms
            out.append((msgs[idx], p.delivered))
        idx = max(c.next_seq - first, 0)
        while len(out) < batch and idx < len(msgs):
            m = msgs[idx]
            idx += 1
            c.next_seq = m.seq + 1
            if subject_matches(c.filter_subject, m.subject):
                c.pending[m.seq] = _Pending(m.seq, 1, now + c.ack_wait_ms)
                out.append((m, 1))
        return out

    async def fetch_now(
        self, stream: str, durable: str, *, batch: int, timeout: float
    ) -> list[tuple[StoredMessage, int]]:
        c = self.consumers.get((stream, durable))
        if c is None:
            raise LogError(f"consumer {durable} not found on stream {stream}")
        loop = asyncio.get_running_loop()
        end = self.now_ms() + int(timeout * 1000)
        while True:
            out = self._take(c, batch)
            now = self.now_ms()
            if out or now >= end:
                if out:
                    self._emit(f"{durable} got " + ",".join(f"{m.seq}#{n}" for m, n in out))
                return out
            wake = min([end] + [p.due_ms for p in c.pending.values() if p.due_ms > now])
            fut: asyncio.Future[None] = loop.create_future()
            self._waiters.append(fut)
            try:
                await asyncio.wait_for(fut, max(wake - now, 1) / 1000)
            except TimeoutError:
                pass

    def settle(self, stream: str, durable: str, seq: int, how: str, delay: float = 0.0) -> None:
        c = self.consumers.get((stream, durable))
        if c is None:
            return
        if how in ("ack", "term"):
            c.pending.pop(seq, None)
        elif how == "nak" and seq in c.pending:
            c.pending[seq].due_ms = self.now_ms() + int(delay * 1000)
            self._wake()

    def consumer_idle(self, stream: str, durable: str) -> bool:
        """Nothing pending and every message on the stream seen."""
        c = self.consumers.get((stream, durable))
        if c is None:
            return True
        msgs = self._msgs(stream)
        return not c.pending and (not msgs or c.next_seq > msgs[-1].seq)

    def messages(self, stream: str) -> list[StoredMessage]:
        return list(self._msgs(stream))


class PublishFates(Protocol):
    def publish(self) -> PublishFate: ...

    def fault(self, name: str, p: float) -> bool: ...


class _NominalPublish:
    def publish(self) -> PublishFate:
        return PublishFate()

    def fault(self, name: str, p: float) -> bool:
        return False


class SimDelivery:
    def __init__(self, client: SimEventLog, stream: str, durable: str, msg: StoredMessage, n: int) -> None:
        self._client = client
        self._stream = stream
        self._durable = durable
        self.msg = msg
        self.num_delivered = n

    async def _settle(self, how: str, delay: float = 0.0) -> None:
        await asyncio.sleep(self._client.latency)
        if self._client.fates.fault("js.ack_lost", 0.02):
            self._client.server._emit(f"{self._durable} {how} of seq {self.msg.seq} lost")
            return  # fire-and-forget: the consumer never knows
        self._client.server.settle(self._stream, self._durable, self.msg.seq, how, delay)

    async def ack(self) -> None:
        await self._settle("ack")

    async def nak(self, delay: float = 0.0) -> None:
        await self._settle("nak", delay)

    async def term(self) -> None:
        await self._settle("term")


class SimEventLog:
    """One actor's connection to :class:`SimJetStream`: the EventLog port plus durable consumers."""

    def __init__(self, server: SimJetStream, name: str, fates: PublishFates | None = None,
                 latency: float = 0.002) -> None:
        self.server = server
        self.name = name
        self.fates: PublishFates = fates or _NominalPublish()
        self.latency = latency

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
        fate = self.fates.publish()
        await asyncio.sleep(fate.latency)
        if fate.fail:
            self.server._emit(f"publish {subject} by {self.name} lost on the way")
            raise LogError("publish outcome unknown: no answer from the server")
        ack = await self.server.publish(stream, subject, data, msg_id=msg_id,
                                        expected_last_subject_seq=expected_last_subject_seq, headers=headers)
        await asyncio.sleep(fate.latency)
        if fate.lose_ack:
            self.server._emit(f"ack of seq {ack.seq} to {self.name} lost")
            raise LogError("publish outcome unknown: the acknowledgement was lost")
        return ack

    async def notice(self, stream: str, subject: str, data: bytes = b"") -> None:
        """Fire and forget: stored after the network's latency, or lost on the way (the scan finds its work)."""
        if self.fates.fault("js.notice_lost", 0.02):
            self.server._emit(f"notice {subject} by {self.name} lost on the way")
            return
        asyncio.get_running_loop().call_later(self.latency, self.server.notice_now, stream, subject, data)

    async def last(self, stream: str, subject: str) -> StoredMessage | None:
        await asyncio.sleep(self.latency)
        return await self.server.last(stream, subject)

    async def get(self, stream: str, seq: int) -> StoredMessage | None:
        await asyncio.sleep(self.latency)
        return await self.server.get(stream, seq)

    async def state(self, stream: str) -> StreamState:
        await asyncio.sleep(self.latency)
        return await self.server.state(stream)

    async def replay(
        self, stream: str, *, start_seq: int = 1, subject: str | None = None
    ) -> AsyncIterator[StoredMessage]:
        await asyncio.sleep(self.latency)
        async for m in self.server.replay(stream, start_seq=start_seq, subject=subject):
            yield m

    async def add_consumer(
        self, stream: str, durable: str, *, filter_subject: str, ack_wait_s: float, max_deliver: int = -1
    ) -> None:
        await asyncio.sleep(self.latency)
        self.server.add_consumer_now(stream, durable, filter_subject=filter_subject, ack_wait_s=ack_wait_s,
                                     max_deliver=max_deliver)

    async def fetch(self, stream: str, durable: str, *, batch: int = 1, timeout: float = 1.0) -> list[Delivery]:
        got = await self.server.fetch_now(stream, durable, batch=batch, timeout=timeout)
        await asyncio.sleep(self.latency)
        return [SimDelivery(self, stream, durable, m, n) for m, n in got]

    async def close(self) -> None:
        return None
