"""The object-store twin of the simulation (ARCHITECTURE §7; model digest §8.5).

:class:`SimS3` is the server: :class:`~services.objstore.memory.MemoryStore`'s semantics (versions,
delete markers, 412 on a stale ETag, If-None-Match, conditional deletes), applied atomically, plus
what a real request goes through on its way there. :class:`SimS3Client` is one principal's
connection and implements the :class:`~services.objstore.port.ObjectStore` port:

- **signing time**: a request is signed with the caller's clock (skew included) when it is issued;
  on arrival the server refuses it (403, :class:`RequestExpired`) when the signature is more than
  the signature-age limit (15 minutes) away from the server's time (spec §5.3, §7.3 CC19);
- **per-principal permissions** (ruling M17, spec §0.1): a policy function is consulted for every
  request on arrival; a denied request is refused (403) and recorded as an IAM violation;
- **a request outlives its caller**: the server side runs as its own task, so a caller that gives up
  (timeout) or crashes does not stop the request: it can still land long after (late completion),
  and a 412 is judged when it lands, against the state then;
- **lost responses**: the effect applies, the caller hears an unknown outcome;
- **holds** for witnesses: a request matching a predicate waits, in transit or after acceptance,
  until released.

How each request travels (pauses, transit, processing tail, 5xx, lost response) comes from a
``fates`` source, normally the run's :class:`~sim.faults.FaultPlan`.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, TypeVar

from services.objstore.memory import Faults, MemoryStore
from services.objstore.port import (
    AccessDenied,
    Got,
    Lost,
    Missing,
    ObjectEntry,
    StoreError,
    StoreUnavailable,
    VersionEntry,
    Won,
)
from sim.faults import RequestFate, Timing
from sim.trace import Trace

__all__ = [
    "Access", "Hold", "Landed", "M17Policy", "Principal", "Request", "RequestExpired", "SimS3", "SimS3Client",
]

T = TypeVar("T")

READS = frozenset({"get", "head"})
LISTS = frozenset({"list_keys", "list_versions"})
_CONSOLE_DATA = READS | {"copy_source", "bucket_versioning"}
_BOX_DEPLOYMENT = READS | {"put", "copy_source", "bucket_versioning"}


class RequestExpired(AccessDenied):
    """403 RequestTimeTooSkewed: the request's signing time is more than the signature-age limit from
    the server's time when it arrives. Nothing was applied."""


@dataclass(frozen=True)
class Principal:
    """Who signs: the deployment's ``admin`` (set-up and oracles only), the ``console``, or a ``box``."""

    kind: Literal["admin", "console", "box"]
    name: str
    region: str = ""

    def __str__(self) -> str:
        return self.name if self.kind != "box" else f"box:{self.name}"


@dataclass(frozen=True)
class Access:
    """What one request asks: ``op`` on ``bucket`` at ``key`` (the prefix, for a listing).

    ``op`` is a port method, except ``delete_version`` (a delete naming a version id) and
    ``copy_source`` (the read side of a copy)."""

    op: str
    bucket: str
    key: str


class Fates(Protocol):
    def s3_request(self, op: str, key: str, timing: Timing, *, long_tail_p: float = ...) -> RequestFate: ...


class _Nominal:
    """Every request completes at once (set-up, oracles)."""

    def s3_request(self, op: str, key: str, timing: Timing, *, long_tail_p: float = 0.0) -> RequestFate:
        return RequestFate()


NOMINAL: Fates = _Nominal()

Policy = Callable[[Principal, Access], "str | None"]
"""``None`` when the request is allowed, else why it is denied."""


@dataclass(frozen=True)
class M17Policy:
    """The permissions of ruling M17 (spec §0.1) and rollout step 5 (spec §15), as a policy function.

    - the console: everything in the deployment bucket; ``GetObjectVersion`` (get, head) on the data
      buckets;
    - a box: in the deployment bucket, reads and writes under ``control/`` and ``moves/`` (claims,
      records, the roster, evidence) and prefix-scoped listings there, never a delete (C5a); in its own
      region's data bucket, everything but bucket administration; in another region's data bucket only
      Put, bare Delete and Copy into ``moves/*`` and a listing whose prefix is inside ``moves/``; no
      Get, no version listing, no version delete;
    - the admin: everything (set-up and the oracles, never a service).
    """

    deployment: str
    data_buckets: Mapping[str, str]

    def __call__(self, p: Principal, a: Access) -> str | None:
        if p.kind == "admin":
            return None
        if a.op in ("create_bucket",):
            return "only the deployment's administrator creates buckets"
        if p.kind == "console":
            if a.bucket == self.deployment:
                return None
            if a.bucket in self.data_buckets.values() and a.op in _CONSOLE_DATA:
                return None
            return f"the console may only read versions in {a.bucket}"
        own = self.data_buckets.get(p.region)
        if a.bucket == own:
            return None
        if a.bucket == self.deployment:
            if not (a.key.startswith("control/") or a.key.startswith("moves/")):
                return "a box reaches only control/ and moves/ in the deployment bucket"
            if a.op in _BOX_DEPLOYMENT:
                return None
            if a.op == "list_keys" and "/" in a.key:
                return None
            return f"a box may not {a.op} in the deployment bucket (claims are never deleted, C5a)"
        if a.bucket in self.data_buckets.values():
            in_moves = a.key.startswith("moves/")
            if a.op in ("put", "delete", "copy") and in_moves:
                return None
            if a.op == "list_keys" and in_moves:
                return None
            return f"M17 grants another region's box only Put, bare Delete, Copy and prefix List on moves/* ({a.op})"
        return f"no policy grants access to bucket {a.bucket}"


@dataclass
class Request:
    id: int
    principal: Principal
    access: Access
    signed_at_ms: int
    fate: RequestFate
    outcome: str = "in flight"


@dataclass(frozen=True)
class Landed:
    """A write that took effect on the server (for the invariants)."""

    request: Request
    op: Literal["put", "delete", "copy"]
    bucket: str
    key: str
    version_id: str | None
    body: bytes | None  # None for a delete (a marker, or one version removed)
    metadata: Mapping[str, str] = field(default_factory=dict)
    removed_version: bool = False  # a delete by version id


class Hold:
    """Requests matching ``pred`` wait at ``stage`` until :meth:`release` (witnesses, model digest §1)."""

    def __init__(self, pred: Callable[[Request], bool], stage: Literal["transit", "accepted"], once: bool) -> None:
        self.pred = pred
        self.stage = stage
        self.once = once
        self.matched: list[Request] = []
        self._event = asyncio.Event()
        self.active = True

    def release(self) -> None:
        self.active = False
        self._event.set()

    async def wait_matched(self, n: int = 1) -> None:
        while len(self.matched) < n:
            await asyncio.sleep(0.01)


async def _instant(_seconds: float) -> None:
    return None


def _give_up(fut: asyncio.Future[Any], access: Access, timeout_s: float) -> None:
    if not fut.done():
        fut.set_exception(StoreUnavailable(
            f"{access.op} {access.bucket}/{access.key}: no answer within {timeout_s:g} s; the outcome is unknown"))


class _Inner(MemoryStore):
    """The server's versions: a :class:`MemoryStore` whose calls apply at once. Its own fault plan stays empty (the
    twin's faults are its requests' fates) and its latency is none, so ``MemoryStore._run``'s instant sleep and empty
    plan are skipped; a fault planned on it all the same takes that path."""

    async def _run(self, op: str, key: str | None, effect: Callable[[], T]) -> T:
        faults = self.faults
        if faults._planned or faults.latency:
            return await super()._run(op, key, effect)
        faults.calls[op] += 1
        return effect()


class SimS3:
    """The server (see the module docstring). Deterministic given its ``rng``, fates and loop."""

    def __init__(
        self,
        *,
        now_ms: Callable[[], int],
        rng: Any,
        timing: Timing,
        trace: Trace,
        policy: Policy,
        fates: Fates = NOMINAL,
        long_tail_p: Callable[[Access], float] | None = None,
    ) -> None:
        self.inner = _Inner(rng=rng, faults=Faults(sleep=_instant), clock=now_ms)
        self.now_ms = now_ms
        self.timing = timing
        self.trace = trace
        self.policy = policy
        self.fates = fates
        self.long_tail_p = long_tail_p or (lambda a: 0.08)
        self.denied: list[str] = []
        self.on_denied: Callable[[str], None] | None = None
        self.inflight: dict[int, Request] = {}
        self.paused = 0  # callers paused before sending their request (a process freeze between check and request)
        self.holds: list[Hold] = []
        self.observers: list[Callable[[Landed], None]] = []
        self._ids = itertools.count(1)
        self._tasks: set[asyncio.Task[None]] = set()

    # -- set-up and introspection (not requests) ----------------------------------------------------

    async def create_bucket(self, bucket: str, *, versioned: bool = True) -> None:
        await self.inner.create_bucket(bucket, versioned=versioned)

    def client(self, principal: Principal, clock: Any, *, fates: Fates | None = None) -> SimS3Client:
        """A connection signing as ``principal`` with ``clock`` (its own, skew included)."""
        return SimS3Client(self, principal, clock, fates or self.fates)

    def hold(self, pred: Callable[[Request], bool], *, stage: Literal["transit", "accepted"] = "accepted",
             once: bool = True) -> Hold:
        hold = Hold(pred, stage, once)
        self.holds.append(hold)
        return hold

    def current_keys(self, bucket: str, prefix: str) -> list[str]:
        """The keys with a current version under ``prefix`` now (an oracle's read: no request, no fault)."""
        b = self.inner._bucket(bucket)
        return [k for k in b.under(prefix) if self.inner._current(b, k) is not None]

    def idle(self) -> bool:
        """No request in flight and no caller paused before sending one (a frozen replicator that has not
        uploaded yet is not quiescence: INV-2's cold form reads the bucket after it, found at move seed 65)."""
        return not self.inflight and not self.paused

    # -- the server side of one request -------------------------------------------------------------

    async def _wait_holds(self, req: Request, stage: str) -> None:
        for hold in list(self.holds):
            if hold.active and hold.stage == stage and hold.pred(req):
                hold.matched.append(req)
                if hold.once:
                    self.holds.remove(hold)
                self.trace.emit("s3", f"#{req.id} held ({stage})")
                await hold._event.wait()

    def _refusal(self, req: Request, extra: tuple[Access, ...]) -> StoreError | None:
        age_ms = self.now_ms() - req.signed_at_ms
        a = req.access
        if abs(age_ms) > self.timing.sig_age_s * 1000:
            req.outcome = f"refused: signature {age_ms / 1000:.0f} s old"
            return RequestExpired(
                f"{a.op} {a.bucket}/{a.key}: RequestTimeTooSkewed (signed {age_ms / 1000:.0f} s before it arrived; "
                f"the limit is {self.timing.sig_age_s:.0f} s)"
            )
        for access in (a, *extra):
            reason = self.policy(req.principal, access)
            if reason is not None:
                text = f"{req.principal} {access.op} {access.bucket}/{access.key}: {reason}"
                self.denied.append(text)
                if self.on_denied is not None:
                    self.on_denied(text)
                req.outcome = "denied"
                return AccessDenied(f"{access.op} {access.bucket}/{access.key}: AccessDenied ({reason})")
        if req.fate.fail_5xx:
            req.outcome = "5xx"
            return StoreUnavailable(f"{a.op} {a.bucket}/{a.key}: 503 SlowDown (nothing applied)")
        return None

    def _issue(
        self,
        req: Request,
        effect: Callable[[], Awaitable[T]],
        landed: Callable[[Request, T], Landed | None],
        fut: asyncio.Future[T],
        extra: tuple[Access, ...],
    ) -> None:
        """Send ``req``: it arrives after its transit. The common request (no hold matches it, no processing
        tail) is served by two timer callbacks, its arrival and its answer, with the same virtual times and the
        same effects as :meth:`_serve`, the coroutine every other request takes (a request costs three loop steps
        instead of a dozen; the seeded ready order still interleaves each of them). Its caller gives up after
        ``client_timeout_s``: armed now when the answer may come later than that, else only if the request is
        held on arrival (an answer at once always comes before the timeout)."""
        loop = asyncio.get_running_loop()
        timeout = self.timing.client_timeout_s
        timed = bool(req.fate.processing) or req.fate.transit + req.fate.answer >= timeout
        if timed:
            loop.call_later(timeout, _give_up, fut, req.access, timeout)
        loop.call_later(req.fate.transit, self._arrive, req, effect, landed, fut, extra,
                        None if timed else loop.time() + timeout)

    def _arrive(
        self,
        req: Request,
        effect: Callable[[], Awaitable[T]],
        landed: Callable[[Request, T], Landed | None],
        fut: asyncio.Future[T],
        extra: tuple[Access, ...],
        gives_up_at: float | None,
    ) -> None:
        if req.fate.processing or (self.holds and any(h.active and h.pred(req) for h in self.holds)):
            if gives_up_at is not None:
                asyncio.get_running_loop().call_at(gives_up_at, _give_up, fut, req.access, self.timing.client_timeout_s)
            self._spawn(self._serve(req, effect, landed, fut, extra, arrived=True))
            return
        answer: T | BaseException
        refusal = self._refusal(req, extra)
        if refusal is not None:
            answer = refusal
        else:
            try:
                result = _at_once(effect())
            except StoreError as exc:
                answer = exc
                req.outcome = type(exc).__name__
            else:
                answer = result
                req.outcome = _summary(result)
                done = landed(req, result)
                if done is not None:
                    for observe in self.observers:
                        observe(done)
        self._emit_outcome(req, fut)
        asyncio.get_running_loop().call_later(req.fate.answer, self._answer, req, fut, answer)

    def _emit_outcome(self, req: Request, fut: asyncio.Future[Any]) -> None:
        late = " (the caller gave up)" if fut.done() else ""
        self.trace.emit("s3", f"#{req.id} {req.access.op} {req.access.bucket}/{req.access.key} "
                              f"{req.principal}: {req.outcome}{late}")

    def _answer(self, req: Request, fut: asyncio.Future[T], answer: T | BaseException) -> None:
        try:
            if req.fate.lost_response and not isinstance(answer, BaseException):
                answer = StoreUnavailable(
                    f"{req.access.op} {req.access.bucket}/{req.access.key}: connection reset; the outcome is unknown")
                self.trace.emit("s3", f"#{req.id} response lost")
            if not fut.done():
                if isinstance(answer, BaseException):
                    fut.set_exception(answer)
                else:
                    fut.set_result(answer)
        finally:
            self.inflight.pop(req.id, None)

    async def _serve(
        self,
        req: Request,
        effect: Callable[[], Awaitable[T]],
        landed: Callable[[Request, T], Landed | None],
        fut: asyncio.Future[T],
        extra: tuple[Access, ...],
        *,
        arrived: bool = False,
    ) -> None:
        answer: T | BaseException
        try:
            if not arrived:
                await asyncio.sleep(req.fate.transit)
            await self._wait_holds(req, "transit")
            refusal = self._refusal(req, extra)
            if refusal is not None:
                answer = refusal
            else:
                await self._wait_holds(req, "accepted")
                if req.fate.processing:
                    await asyncio.sleep(req.fate.processing)
                try:
                    result = await effect()  # atomic: the inner store never suspends
                except StoreError as exc:
                    answer = exc
                    req.outcome = type(exc).__name__
                else:
                    answer = result
                    req.outcome = _summary(result)
                    done = landed(req, result)
                    if done is not None:
                        for observe in self.observers:
                            observe(done)
            self._emit_outcome(req, fut)
            await asyncio.sleep(req.fate.answer)
        except BaseException:
            self.inflight.pop(req.id, None)
            raise
        self._answer(req, fut, answer)

    def _spawn(self, coro: Awaitable[None]) -> None:
        task: asyncio.Task[None] = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


def _at_once(coro: Awaitable[T]) -> T:
    """The result of a coroutine that never suspends (the inner store's calls: its sleep is instant)."""
    it = coro.__await__()
    try:
        it.send(None)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
    it.close()
    raise RuntimeError("the inner store suspended a request it must apply atomically")


def _summary(result: object) -> str:
    kind = type(result)
    if kind is Won:
        return f"won {(result.version_id or '-')[:8]}"  # type: ignore[attr-defined]
    if kind is Got:
        return f"got {result.etag[1:9]}"  # type: ignore[attr-defined]
    if kind is list:
        return f"{len(result)} entries"  # type: ignore[arg-type]
    if isinstance(result, Won):
        return f"won {(result.version_id or '-')[:8]}"
    if isinstance(result, Lost):
        return "412"
    if isinstance(result, Got):
        return f"got {result.etag[1:9]}"
    if isinstance(result, Missing):
        return "missing"
    if isinstance(result, list):
        return f"{len(result)} entries"
    return "ok"


class SimS3Client:
    """One principal's connection to :class:`SimS3`: the ``ObjectStore`` port."""

    def __init__(self, server: SimS3, principal: Principal, clock: Any, fates: Fates) -> None:
        self.server = server
        self.principal = principal
        self.clock = clock
        self.fates = fates

    def __repr__(self) -> str:
        return f"SimS3Client({self.principal})"

    async def _call(
        self,
        access: Access,
        effect: Callable[[], Awaitable[T]],
        landed: Callable[[Request, T], Landed | None] = lambda _q, _r: None,
        extra: tuple[Access, ...] = (),
    ) -> T:
        s = self.server
        fate = self.fates.s3_request(access.op, access.key, s.timing, long_tail_p=s.long_tail_p(access))
        s.paused += 1  # a caller frozen before its request is work in progress: the world is not idle meanwhile
        try:
            if fate.pause_before_sign:
                await asyncio.sleep(fate.pause_before_sign)  # paused between the check and the request
            signed_at = self.clock.now_ms()
            if fate.pause_after_sign:
                await asyncio.sleep(fate.pause_after_sign)  # signed, not yet sent: the signature ages
        finally:
            s.paused -= 1
        req = Request(next(s._ids), self.principal, access, signed_at, fate)
        s.inflight[req.id] = req
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[T] = loop.create_future()
        # The caller waits for the answer at most its timeout (:meth:`SimS3._issue`); a caller that gives up or
        # dies (its task cancelled: the future with it) does not stop the request, which lands whenever it lands.
        s._issue(req, effect, landed, fut, extra)
        return await fut

    # -- the port -----------------------------------------------------------------------------------

    async def create_bucket(self, bucket: str, *, versioned: bool = True) -> None:
        inner = self.server.inner
        await self._call(Access("create_bucket", bucket, ""), lambda: inner.create_bucket(bucket, versioned=versioned))

    async def bucket_versioning(self, bucket: str) -> bool:
        return await self._call(Access("bucket_versioning", bucket, ""),
                                lambda: self.server.inner.bucket_versioning(bucket))

    async def get(self, bucket: str, key: str, *, version_id: str | None = None) -> Got | Missing:
        return await self._call(Access("get", bucket, key),
                                lambda: self.server.inner.get(bucket, key, version_id=version_id))

    async def head(self, bucket: str, key: str, *, version_id: str | None = None) -> Got | Missing:
        return await self._call(Access("head", bucket, key),
                                lambda: self.server.inner.head(bucket, key, version_id=version_id))

    async def put(
        self,
        bucket: str,
        key: str,
        body: bytes,
        *,
        if_match: str | None = None,
        if_none_match: bool = False,
        metadata: Mapping[str, str] | None = None,
    ) -> Won | Lost:
        data = bytes(body)
        meta = dict(metadata or {})

        def landed(req: Request, result: Won | Lost) -> Landed | None:
            if not isinstance(result, Won):
                return None
            return Landed(req, "put", bucket, key, result.version_id, data, meta)

        return await self._call(
            Access("put", bucket, key),
            lambda: self.server.inner.put(bucket, key, data, if_match=if_match, if_none_match=if_none_match,
                                          metadata=meta),
            landed,
        )

    async def delete(
        self, bucket: str, key: str, *, if_match: str | None = None, version_id: str | None = None
    ) -> Won | Lost:
        def landed(req: Request, result: Won | Lost) -> Landed | None:
            if not isinstance(result, Won):
                return None
            return Landed(req, "delete", bucket, key, result.version_id, None, {},
                          removed_version=version_id is not None)

        op = "delete_version" if version_id is not None else "delete"
        return await self._call(
            Access(op, bucket, key),
            lambda: self.server.inner.delete(bucket, key, if_match=if_match, version_id=version_id),
            landed,
        )

    async def copy(
        self, bucket: str, key: str, *, src_bucket: str, src_key: str, src_version_id: str | None = None
    ) -> Won:
        inner = self.server.inner

        def landed(req: Request, result: Won) -> Landed | None:
            return Landed(req, "copy", bucket, key, result.version_id, None, {})

        return await self._call(
            Access("copy", bucket, key),
            lambda: inner.copy(bucket, key, src_bucket=src_bucket, src_key=src_key, src_version_id=src_version_id),
            landed,
            (Access("copy_source", src_bucket, src_key),),
        )

    async def list_versions(self, bucket: str, prefix: str = "", *, after: str = "") -> list[VersionEntry]:
        return await self._call(Access("list_versions", bucket, prefix),
                                lambda: self.server.inner.list_versions(bucket, prefix, after=after))

    async def list_keys(self, bucket: str, prefix: str = "") -> list[str]:
        return await self._call(Access("list_keys", bucket, prefix),
                                lambda: self.server.inner.list_keys(bucket, prefix))

    async def list_entries(self, bucket: str, prefix: str = "") -> list[ObjectEntry]:
        return await self._call(Access("list_keys", bucket, prefix),  # the same request (ListObjectsV2)
                                lambda: self.server.inner.list_entries(bucket, prefix))

    async def close(self) -> None:
        return None

