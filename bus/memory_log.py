"""The in-memory twin of the event log: JetStream's semantics this system relies on.

Stream-wide ``Nats-Msg-Id`` dedup within a window (on the injected clock), the per-subject
expected-last-sequence check (before dedup, as the real server does), ``get``/``last`` by subject.
Fault hooks: ``lose_ack_next`` stores the message then raises (a lost acknowledgement).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping

from bus.log import LogError, PubAck, StoredMessage, StreamState, WrongLastSequence


class MemoryEventLog:
    def __init__(self, now_ms: Callable[[], int] | None = None, dedup_window_ms: int = 120_000) -> None:
        self._streams: dict[str, list[StoredMessage]] = {}
        self._first: dict[str, int] = {}
        self._dedup: dict[str, dict[str, tuple[int, int]]] = {}
        self._now = now_ms or (lambda: 0)
        self.dedup_window_ms = dedup_window_ms
        self.lose_ack_next = 0
        self.fail_next = 0

    def _msgs(self, stream: str) -> list[StoredMessage]:
        return self._streams.setdefault(stream, [])

    def purge(self, stream: str) -> None:
        """Lose history, as a deleted and recreated stream would (the rebase case)."""
        msgs = self._msgs(stream)
        self._first[stream] = (msgs[-1].seq + 1) if msgs else 1
        msgs.clear()
        self._dedup.pop(stream, None)

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
        if self.fail_next:
            self.fail_next -= 1
            raise LogError("publish outcome unknown: injected failure")
        msgs = self._msgs(stream)
        if expected_last_subject_seq is not None:
            last = await self.last(stream, subject)
            last_seq = last.seq if last else 0
            if last_seq != expected_last_subject_seq:
                raise WrongLastSequence(f"wrong last sequence: {last_seq}")
        now = self._now()
        seen = self._dedup.setdefault(stream, {})
        if msg_id is not None and msg_id in seen and now - seen[msg_id][1] < self.dedup_window_ms:
            return PubAck(seq=seen[msg_id][0], duplicate=True)
        hdrs = dict(headers or {})
        if msg_id is not None:
            hdrs["Nats-Msg-Id"] = msg_id
        seq = (msgs[-1].seq if msgs else self._first.get(stream, 1) - 1) + 1
        msgs.append(StoredMessage(seq=seq, subject=subject, data=data, headers=hdrs))
        if msg_id is not None:
            seen[msg_id] = (seq, now)
        if self.lose_ack_next:
            self.lose_ack_next -= 1
            raise LogError("publish outcome unknown: injected lost ack")
        return PubAck(seq=seq)

    async def notice(self, stream: str, subject: str, data: bytes = b"") -> None:
        msgs = self._msgs(stream)
        seq = (msgs[-1].seq if msgs else self._first.get(stream, 1) - 1) + 1
        msgs.append(StoredMessage(seq=seq, subject=subject, data=data))

    async def last(self, stream: str, subject: str) -> StoredMessage | None:
        for m in reversed(self._msgs(stream)):
            if m.subject == subject:
                return m
        return None

    async def get(self, stream: str, seq: int) -> StoredMessage | None:
        for m in self._msgs(stream):
            if m.seq == seq:
                return m
        return None

    async def state(self, stream: str) -> StreamState:
        msgs = self._msgs(stream)
        if not msgs:
            first = self._first.get(stream, 1)
            return StreamState(first_seq=first, last_seq=first - 1, messages=0)
        return StreamState(first_seq=msgs[0].seq, last_seq=msgs[-1].seq, messages=len(msgs))

    async def replay(
        self, stream: str, *, start_seq: int = 1, subject: str | None = None
    ) -> AsyncIterator[StoredMessage]:
        for m in list(self._msgs(stream)):
            if m.seq >= start_seq and (subject is None or m.subject == subject):
                yield m
