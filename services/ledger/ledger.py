"""The ledger: the only code that writes claims and records (ARCHITECTURE §4).

``transition`` reads the object fresh, calls a pure ``decide``, CASes the result with the ETag it
read and publishes the event. Each object's history on the stream is complete, in order and
without gaps, also across a crash between the CAS and the publish:

- **publish before supersede**: before a writer supersedes gen N, gen N's event must be on the
  stream; if it is not, the writer publishes it first (the relay step);
- every event has a deterministic ``Nats-Msg-Id`` and is published with
  ``Nats-Expected-Last-Subject-Sequence`` = the sequence of the previous gen;
- a 10071 after a retry is resolved by reading the subject's last message (stack facts §3);
- when the stream has lost history (it ends before gen N - 1), a ``rebase`` event restates the full
  state.

The event a relay republishes is exactly the one the writer would have published: the writer stores
the envelope's metadata (name, actor, time, causation) beside the object as S3 user metadata, with
the sha256 of the body. An object whose body does not match that digest was edited outside the
ledger and fails as ``decode_failed``: it is never handed back as state (run-store "Durable values").
"""

from __future__ import annotations

import base64
import hashlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Generic, Literal, TypeAlias, TypeVar
from urllib.parse import quote

import msgspec

from bus.log import EventLog, LogError, LogUnavailable, StoredMessage, WrongLastSequence
from bus.subjects import LEDGER_STREAM, WORK_STREAM, SubjectError, ledger_msg_id, ledger_subject, work_subject
from events.base import canonical, decode, validate_ident
from events.claim import Claim
from events.durable import DurableValueError
from events.envelope import MAX_CAUSATION_CHARS, MAX_NAME_CHARS, Actor, EventMeta, ObjectKind, Transition
from events.record import Record
from kernel import metrics, rules
from kernel.logctx import ctx
from kernel.ports import Clock
from services.ledger.movelog import MoveLog
from services.ledger.notices import boxes_concerned
from services.objstore.port import Got, Lost, ObjectStore

log = logging.getLogger("hostmove.ledger")


def _op_id(state: Claim | Record) -> str | None:
    """The move (or op) a state is in, for a log line's ``op_id``."""
    if isinstance(state, Claim):
        return state.op.id or None
    return state.move.id if state.move is not None else None

S = TypeVar("S", Claim, Record)

STALE_READS = 5
"""How many times a read found stale by the stream is retried before it counts as a defect."""

META_EVENT = "hm-event"
META_SHA = "hm-body-sha256"
GEN_HEADER = "Hm-Gen"
KIND_HEADER = "Hm-Kind"

_CLASSES: dict[str, type[Claim] | type[Record]] = {"claim": Claim, "record": Record}
_PREFIXES = {"claim": "control/hosts/", "record": "control/records/"}


MAX_OBJECT_BYTES = 1024 * 1024
"""The largest claim or record the ledger writes or takes as state (issue 14 item 6): checked on the bytes, before
anything decodes them, on read and on write. A 30 MB claim written straight into the bucket was decoded as state
by every agent's scan (both pinned at 100% CPU) and failed the door's move request with a 500."""


class BadObject(DurableValueError):
    """A claim or record that is never state: too large, changed outside the ledger, or failing its decoding. A
    :class:`~events.durable.DurableValueError` (``decode_failed``) naming the object's ``key`` and the ``etag`` it
    was read at, so the reader skips that host only and raises one alert per version
    (:mod:`services.ledger.badobjects`)."""

    def __init__(self, cause: DurableValueError, *, obj: ObjectKind, host: str, key: str, etag: str,
                 size: int) -> None:
        super().__init__("decode_failed", cause.limit, cause.reason, cause.path)
        self.obj, self.host, self.key, self.etag, self.size = obj, host, key, etag, size


class LedgerDefect(Exception):
    """The authority and the log disagree in a way no writer may paper over. Never act on it (C6)."""


class _StreamAhead(Exception):
    """The stream holds a newer gen than the object this caller read: the read is stale (another
    writer committed and published in between). Read again; only a persistent gap is a defect."""


class Crash(Exception):
    """Raised by a fault hook to simulate the process dying at that point."""


# -- outcomes: races are values -------------------------------------------------------------------


@dataclass(frozen=True)
class NoChange:
    """The decider found nothing to do."""

    reason: str = ""


@dataclass(frozen=True)
class Refusal:
    """The decider refused, in the operator's words (spec §20)."""

    reason: str


@dataclass(frozen=True)
class Committed(Generic[S]):
    state: S
    etag: str | None
    version_id: str | None
    seq: int | None  # None: the CAS won but the event is not yet on the stream (the relay will do it)


@dataclass(frozen=True)
class Conflict:
    """The CAS lost to another writer after every attempt."""

    current_etag: str | None


@dataclass(frozen=True)
class Current(Generic[S]):
    """A fresh, validated read of one object."""

    state: S | None
    etag: str | None
    version_id: str | None
    meta: EventMeta | None
    body: bytes | None = None  # the exact bytes read (canonical encoding)


Decision: TypeAlias = S | NoChange | Refusal  # noqa: UP040 - generic alias, py3.11
Outcome: TypeAlias = Committed[S] | NoChange | Refusal | Conflict  # noqa: UP040


@lru_cache(maxsize=4096)
def object_key(obj: ObjectKind, host: str) -> str:
    """``control/hosts/<host>.json`` or ``control/records/<host>.json``; odd characters are
    percent-encoded so the key is one path segment and the mapping is reversible. Remembered: every read and
    CAS of a host's objects names its key (an invalid host raises each time, nothing is kept for it)."""
    validate_host(host)
    return f"{_PREFIXES[obj]}{quote(host, safe='.-_~@+')}.json"


def validate_host(host: str) -> str:
    """A host name: an identifier (durable text, at most 1,024 UTF-16 units)."""
    return validate_ident(host, "host")


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text.encode("ascii"))


def event_gen(msg: StoredMessage) -> int:
    """The gen an event on a ledger subject carries (header first, body as a fallback)."""
    raw = msg.headers.get(GEN_HEADER)
    if raw is not None and raw.isdigit():
        return int(raw)
    return decode(msg.data, Transition).gen


class Ledger:
    """Read, decide, CAS and publish claims and records. One instance per process."""

    def __init__(
        self,
        store: ObjectStore,
        events: EventLog,
        clock: Clock,
        actor: Actor,
        bucket: str,
        faults: Callable[[str], None] | None = None,
        movelog: MoveLog | None = None,
    ) -> None:
        self.store = store
        self.movelog = movelog
        """The §13 move log this writer keeps for the record transitions it makes (None: none, e.g. the simulation)."""
        self.events = events
        self.clock = clock
        self.actor = actor
        self.bucket = bucket
        self.faults = faults
        # subject -> (gen, seq) of the newest event this process saw on the stream. A hint only:
        # every publish is conditional on it, so a stale hint costs a retry, never a gap.
        self._published: dict[str, tuple[int, int]] = {}
        self._claims_seen: dict[str, Claim] = {}  # the newest claim of each host this process read or wrote: the
        # boxes a record's transition concerns (a record writer revalidates against the claim first, K5)
        # (obj, host) -> the bytes and metadata last read and what they validated to. Reads stay fresh (every read
        # is a GET); only the decoding of bytes already decoded is skipped: the same bytes and metadata give the same
        # frozen value, and anything else is validated from scratch.
        self._decoded: dict[tuple[str, str], tuple[bytes, str | None, str | None, Any, EventMeta | None]] = {}

    def _fault(self, point: str) -> None:
        if self.faults is not None:
            self.faults(point)

    # -- reads ------------------------------------------------------------------------------------

    async def read(self, obj: ObjectKind, host: str) -> Current[Claim] | Current[Record]:
        """A fresh read. Raises ``DurableValueError(decode_failed)`` for a corrupt or out-of-band
        object and ``StoreError`` for a failed read: neither is ever a reason to act (C6)."""
        key = object_key(obj, host)
        got = await self.store.get(self.bucket, key)
        if not isinstance(got, Got):
            return Current(None, None, None, None)
        try:
            if len(got.body) > MAX_OBJECT_BYTES:  # before anything decodes it
                raise DurableValueError("decode_failed", "max_bytes",
                                        f"the {obj} of {host} is {len(got.body)} bytes; at most {MAX_OBJECT_BYTES}")
            sha, raw_meta = got.metadata.get(META_SHA), got.metadata.get(META_EVENT)
            seen = self._decoded.get((obj, host))
            if seen is not None and seen[0] == got.body and seen[1] == sha and seen[2] == raw_meta:
                if obj == "claim":
                    self._claims_seen[host] = seen[3]
                return Current(seen[3], got.etag, got.version_id, seen[4], got.body)
            state, meta = self._validate(obj, host, got), self._meta(got)
            self._decoded[(obj, host)] = (got.body, sha, raw_meta, state, meta)
            if obj == "claim":
                self._claims_seen[host] = state
            return Current(state, got.etag, got.version_id, meta, got.body)
        except DurableValueError as exc:
            raise BadObject(exc, obj=obj, host=host, key=key, etag=got.etag, size=len(got.body)) from None

    async def read_claim(self, host: str) -> Current[Claim]:
        return await self.read("claim", host)  # type: ignore[return-value]

    async def read_record(self, host: str) -> Current[Record]:
        return await self.read("record", host)  # type: ignore[return-value]

    def _validate(self, obj: ObjectKind, host: str, got: Got) -> Any:
        digest = got.metadata.get(META_SHA)
        if digest != hashlib.sha256(got.body).hexdigest():
            raise DurableValueError(
                "decode_failed", "ledger_written", f"the {obj} of {host} was changed outside the ledger"
            )
        state = decode(got.body, _CLASSES[obj])
        if state.host != host:
            raise DurableValueError("decode_failed", "host_matches_key", f"the {obj} names another host")
        return state

    @staticmethod
    def _meta(got: Got) -> EventMeta | None:
        raw = got.metadata.get(META_EVENT)
        if raw is None:
            return None
        try:
            return decode(_unb64(raw), EventMeta)
        except (ValueError, DurableValueError):
            raise DurableValueError(
                "decode_failed", "event_metadata", "the object's event metadata is corrupt"
            ) from None

    # -- the write path ---------------------------------------------------------------------------

    async def transition(
        self,
        obj: ObjectKind,
        host: str,
        name: str,
        decide: Callable[[S | None], Decision[S]],
        *,
        causation: str = "",
        attempts: int = 3,
    ) -> Outcome[S]:
        """Fresh read, pure decide, CAS, publish. A lost CAS re-reads and re-decides up to
        ``attempts`` times, then answers :class:`Conflict`."""
        validate_host(host)
        meta_name = validate_ident(name, "transition name")
        if len(meta_name) > MAX_NAME_CHARS or len(causation) > MAX_CAUSATION_CHARS:
            raise DurableValueError("invalid_value", "envelope_size", "transition name or causation too long")
        cls = _CLASSES[obj]
        lost: Conflict = Conflict(None)
        stale = 0
        tries = max(attempts, 1)
        for attempt in range(tries):
            cur = await self.read(obj, host)
            try:
                if rules.on("publish-before-supersede"):
                    prev_seq = await self.ensure_published(obj, host, cur)
                else:
                    prev_seq = self._published.get(ledger_subject(obj, host), (0, 0))[1]
            except _StreamAhead as exc:
                stale += 1
                if stale > STALE_READS:
                    raise LedgerDefect(str(exc)) from None
                metrics.LEDGER_RETRIES.labels(object=obj, reason="stale_read").inc()
                continue  # a writer committed between our two reads: read again
            decision = decide(cur.state)  # type: ignore[arg-type]
            if isinstance(decision, NoChange | Refusal):
                outcome = "refused" if isinstance(decision, Refusal) else "no_change"
                metrics.LEDGER_TRANSITIONS.labels(object=obj, outcome=outcome).inc()
                return decision
            if not isinstance(decision, cls):
                raise TypeError(f"decide returned {type(decision).__name__}, not {cls.__name__}")
            gen = (cur.state.gen if cur.state is not None else 0) + 1
            new = msgspec.structs.replace(decision, gen=gen, host=host)
            body = canonical(new)
            if len(body) > MAX_OBJECT_BYTES:
                raise DurableValueError("invalid_value", "max_bytes", f"the {obj} of {host} would be {len(body)} "
                                        f"bytes; at most {MAX_OBJECT_BYTES}")
            decode(body, cls)  # what is written passes exactly the check it will meet on read
            meta = EventMeta(name=meta_name, actor=self.actor, at=self.clock.now_ms(), causation=causation)
            metadata = {META_EVENT: _b64(canonical(meta)), META_SHA: hashlib.sha256(body).hexdigest()}
            self._fault(f"before_cas:{obj}:{meta_name}")
            put = await self.store.put(
                self.bucket,
                object_key(obj, host),
                body,
                if_match=cur.etag if rules.on("ledger-cas") else None,
                if_none_match=cur.etag is None and rules.on("ledger-cas"),
                metadata=metadata,
            )
            if isinstance(put, Lost):
                lost = Conflict(put.current_etag)
                metrics.LEDGER_CAS_CONFLICTS.labels(object=obj).inc()
                if attempt + 1 < tries:
                    metrics.LEDGER_RETRIES.labels(object=obj, reason="conflict").inc()
                continue
            metrics.LEDGER_TRANSITIONS.labels(object=obj, outcome="committed").inc()
            if obj == "record":
                metrics.observe_record(cur.state, new)  # type: ignore[arg-type]
            self._fault("after_cas")
            self._fault(f"after_cas:{obj}:{meta_name}")
            seq = await self._publish_after_cas(obj, host, new, meta, prev_seq)
            if isinstance(new, Claim):
                self._claims_seen[host] = new
            await self._notify_boxes(host, cur.state, new)  # type: ignore[arg-type]
            if self.movelog is not None:  # §13: the transition's writer logs it
                await self.movelog.note(cur.state, new, meta)
            self._fault("after_publish")
            self._fault(f"after_publish:{obj}:{meta_name}")
            return Committed(new, put.etag, put.version_id, seq)  # type: ignore[arg-type]
        metrics.LEDGER_TRANSITIONS.labels(object=obj, outcome="conflict").inc()
        return lost

    async def _publish_after_cas(
        self, obj: ObjectKind, host: str, state: Claim | Record, meta: EventMeta, prev_seq: int
    ) -> int | None:
        try:
            return await self._publish(obj, host, state, meta, "transition", prev_seq)
        except (LogError, LedgerDefect) as exc:
            # The CAS stands. The next writer or the relay publishes this gen (publish before supersede).
            log.warning("event for %s %s gen %d not published yet: %s", obj, host, state.gen, exc,
                        extra=ctx(host=host, op_id=_op_id(state), phase="publish", reason=exc, obj=obj, gen=state.gen))
            return None

    async def _notify_boxes(self, host: str, prev: Claim | Record | None, new: Claim | Record) -> None:
        """A work notice to each box the transition concerns (:mod:`services.ledger.notices`): fire and forget, a
        lost one is the reconciliation scan's (issue 19 items 1, 2)."""
        claim = self._claims_seen.get(host) if isinstance(new, Record) else None
        for box in boxes_concerned(prev, new, claim):
            try:
                await self.events.notice(WORK_STREAM, work_subject(box, host))
            except (LogError, SubjectError) as exc:
                log.info("work notice of %s to %s not sent: %s", host, box, exc,
                         extra=ctx(host=host, box=box, phase="notice", reason=exc))

    # -- publishing -------------------------------------------------------------------------------

    async def ensure_published(
        self, obj: ObjectKind, host: str, cur: Current[Claim] | Current[Record]
    ) -> int:
        """Make sure the event of the object's current gen is on the stream; answer its sequence
        (0 for an object that does not exist yet). This is the relay step and the rebase."""
        subject = ledger_subject(obj, host)
        state = cur.state
        hint = self._published.get(subject)
        if state is not None and hint is not None and hint[0] == state.gen:
            return hint[1]
        last = await self.events.last(LEDGER_STREAM, subject)
        last_gen = event_gen(last) if last is not None else 0
        if state is None:
            if last is not None:
                raise LedgerDefect(
                    f"the stream holds {obj} history for {host} (gen {last_gen}) but the store has no object"
                )
            return 0
        if last is not None and last_gen == state.gen:
            self._published[subject] = (last_gen, last.seq)
            return last.seq
        if last_gen > state.gen:
            raise _StreamAhead(f"the stream is ahead of the read of the {obj} of {host}: {last_gen} > {state.gen}")
        if cur.meta is not None and last_gen == state.gen - 1:
            seq = await self._publish(obj, host, state, cur.meta, "transition", last.seq if last else 0)
            if self.movelog is not None:  # §13: a writer that died after its CAS logged nothing
                await self.movelog.note(None, state, cur.meta)
            log.info("relayed %s %s gen %d", obj, host, state.gen,
                     extra=ctx(host=host, op_id=_op_id(state), phase="relay", obj=obj, gen=state.gen))
            return seq
        # The stream lost history (or the writer's metadata is gone): restate the full state.
        meta = EventMeta(
            name="rebase",
            actor=self.actor,
            at=self.clock.now_ms(),
            causation=f"stream ends at gen {last_gen}, store at gen {state.gen}",
        )
        seq = await self._publish(obj, host, state, meta, "rebase", last.seq if last else 0)
        log.warning("rebased %s %s at gen %d (stream ended at gen %d)", obj, host, state.gen, last_gen,
                    extra=ctx(host=host, op_id=_op_id(state), phase="rebase", obj=obj, gen=state.gen,
                              stream_gen=last_gen))
        return seq

    async def _publish(
        self,
        obj: ObjectKind,
        host: str,
        state: Claim | Record,
        meta: EventMeta,
        kind: Literal["transition", "rebase"],
        expected_seq: int,
    ) -> int:
        subject = ledger_subject(obj, host)
        event = Transition(
            kind=kind,
            object=obj,
            host=host,
            gen=state.gen,
            meta=meta,
            claim=state if obj == "claim" else None,  # type: ignore[arg-type]
            record=state if obj == "record" else None,  # type: ignore[arg-type]
        )
        data = canonical(event)
        msg_id = ledger_msg_id(obj, host, state.gen) + (":rebase" if kind == "rebase" else "")
        headers = {GEN_HEADER: str(state.gen), KIND_HEADER: kind}
        self._published.pop(subject, None)  # restored only once the stream confirms
        for attempt in range(3):
            try:
                ack = await self.events.publish(
                    LEDGER_STREAM, subject, data, msg_id=msg_id, expected_last_subject_seq=expected_seq,
                    headers=headers,
                )
                self._published[subject] = (state.gen, ack.seq)
                return ack.seq
            except WrongLastSequence:
                last = await self.events.last(LEDGER_STREAM, subject)
                if last is None:
                    raise LedgerDefect(
                        f"the {obj} subject of {host} is empty after a sequence conflict"
                    ) from None
                last_gen = event_gen(last)
                if last.msg_id == msg_id or last_gen >= state.gen:
                    # Ours landed (a retry after a lost ack), or a relay already published it and
                    # more: contiguity means gen state.gen is on the stream.
                    self._published[subject] = (last_gen, last.seq)
                    return last.seq
                if last_gen == state.gen - 1:
                    expected_seq = last.seq  # our hint was stale; retry on the real predecessor
                    continue
                raise LedgerDefect(
                    f"the {obj} stream of {host} ends at gen {last_gen}; cannot append gen {state.gen}"
                ) from None
            except LogError:
                if attempt == 2:
                    raise
                metrics.LEDGER_RETRIES.labels(object=obj, reason="publish").inc()
                continue  # unknown outcome: the conditional retry tells us (10071 if it landed)
        raise LogError("publish did not settle")

    # -- the relay --------------------------------------------------------------------------------

    async def relay(self, obj: ObjectKind, host: str) -> int:
        """Publish the object's current gen if the stream lacks it (ARCHITECTURE §4)."""
        for _ in range(STALE_READS):
            try:
                return await self.ensure_published(obj, host, await self.read(obj, host))
            except _StreamAhead:
                continue  # a writer committed between our two reads: read again
        try:
            return await self.ensure_published(obj, host, await self.read(obj, host))
        except _StreamAhead as exc:
            raise LedgerDefect(str(exc)) from None

    async def relay_all(self) -> list[str]:
        """Relay every claim and record in the bucket. Answers the objects it could not settle. An outage stops the
        pass: :class:`~bus.log.LogUnavailable` (NATS) and the store's errors (a listing or a read) propagate."""
        from urllib.parse import unquote

        failed: list[str] = []
        obj: ObjectKind
        for obj in ("claim", "record"):
            prefix = _PREFIXES[obj]
            for key in await self.store.list_keys(self.bucket, prefix):
                if not key.endswith(".json") or "/" in key[len(prefix) :]:
                    continue
                host = unquote(key[len(prefix) : -len(".json")])
                try:
                    self._published.pop(ledger_subject(obj, host), None)
                    await self.relay(obj, host)
                except LogUnavailable:
                    raise  # NATS is down: no object can be settled this pass (the caller backs off)
                except (LedgerDefect, DurableValueError, LogError) as exc:
                    log.error("relay of %s %s failed: %s", obj, host, exc,
                              extra=ctx(host=host, phase="relay", reason=exc, obj=obj))
                    failed.append(f"{obj}:{host}: {exc}")
        return failed
