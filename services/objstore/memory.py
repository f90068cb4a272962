"""``MemoryStore``: an in-memory twin of :class:`~services.objstore.s3.S3Store` with fault hooks.

Same semantics as S3 on SeaweedFS, as pinned down by ``tests/test_objstore_contract.py``:

- per-bucket versioning; a version list per key. A plain delete on a versioned bucket adds a delete
  marker; a delete by version id removes exactly that version (C3) and succeeds when it is absent;
  when the latest version is a marker, get is :class:`Missing`;
- ``if_match`` against a missing key or a marker answers ``Lost(None)``; ``if_none_match`` over a
  marker is accepted (as on AWS); ``if_match="*"`` matches any current object; ETags are compared
  quoted or unquoted;
- ETags are the quoted MD5 of the body, so identical bytes give identical ETags (stack facts §5.6);
  version ids are opaque random hex from the injected :class:`random.Random`;
- metadata as :func:`normalize_metadata` leaves it (names lower-cased, blank values dropped).

Differences from SeaweedFS on purpose: a put into a missing bucket raises :class:`NoSuchBucket` (AWS
behaviour) where SeaweedFS silently creates the bucket, and a copy into a missing bucket raises
:class:`NoSuchBucket` where SeaweedFS answers 500 (:class:`StoreUnavailable`).

Faults (for unit tests and the deterministic simulation): every call first awaits
``faults.sleep(latency)`` and then consults :meth:`Faults.fail_next` entries. No threads, no wall
clock: ``last_modified_ms`` comes from an injectable clock (default: a counter).
"""

from __future__ import annotations

import asyncio
import bisect
import hashlib
import itertools
import random
import re
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal, TypeVar

from services.objstore.port import (
    Got,
    InvalidRequest,
    Lost,
    Missing,
    NoSuchBucket,
    ObjectEntry,
    StoreUnavailable,
    VersionEntry,
    Won,
)

__all__ = ["OPS", "FaultKind", "Faults", "MemoryStore", "normalize_metadata"]

T = TypeVar("T")
FaultKind = Literal["5xx", "lost_response", "late"]
OPS = frozenset(
    {
        "create_bucket",
        "bucket_versioning",
        "get",
        "head",
        "put",
        "delete",
        "copy",
        "list_versions",
        "list_keys",
    }
)
_KINDS = frozenset({"5xx", "lost_response", "late"})
_NULL = "null"  # S3's version id for objects written while versioning was off
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_BUCKET_NAME = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")


@dataclass
class _Planned:
    op: str
    kind: FaultKind
    key: str | None
    delay: float | None


@dataclass
class _Late:
    effect: Callable[[], object]
    done: bool = False
    outcome: object = None

    def apply(self) -> object:
        if not self.done:
            self.done = True
            try:
                self.outcome = self.effect()
            except Exception as exc:  # nobody awaits a late request; keep what the server would say
                self.outcome = exc
        return self.outcome


class Faults:
    """Fault plan consulted on every :class:`MemoryStore` call.

    - ``latency``: seconds awaited (through ``sleep``) before each call, either one number or a
      per-op mapping; the call is applied after the wait.
    - :meth:`fail_next`: the next matching call fails with ``kind``:
      ``"5xx"`` raises :class:`StoreUnavailable` and applies nothing; ``"lost_response"`` applies the
      effect then raises; ``"late"`` raises now and applies the effect when :meth:`complete_late` is
      called, or after ``delay`` seconds of ``sleep`` when a delay is given. A late effect is
      evaluated when it lands (its preconditions are checked then), like a delayed request.
    """

    def __init__(
        self,
        *,
        latency: float | Mapping[str, float] = 0.0,
        sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
    ) -> None:
        self.latency = latency
        self.sleep = sleep
        self.calls: Counter[str] = Counter()
        self._planned: list[_Planned] = []
        self._late: list[_Late] = []
        self._tasks: set[asyncio.Task[None]] = set()

    def fail_next(
        self,
        op: str,
        kind: FaultKind,
        *,
        key: str | None = None,
        times: int = 1,
        delay: float | None = None,
    ) -> None:
        """Fail the next ``times`` calls of ``op`` (optionally only on ``key``) with ``kind``."""
        if op not in OPS:
            raise ValueError(f"unknown op {op!r}; expected one of {sorted(OPS)}")
        if kind not in _KINDS:
            raise ValueError(f"unknown fault kind {kind!r}; expected one of {sorted(_KINDS)}")
        if delay is not None and kind != "late":
            raise ValueError("delay only applies to 'late' faults")
        self._planned.extend(_Planned(op, kind, key, delay) for _ in range(times))

    def clear(self) -> None:
        """Drop planned faults (pending late effects stay pending)."""
        self._planned.clear()

    @property
    def planned(self) -> int:
        return len(self._planned)

    @property
    def pending_late(self) -> int:
        return sum(1 for late in self._late if not late.done)

    def complete_late(self) -> list[object]:
        """Apply every pending late effect, oldest first; return what each would have answered
        (a result or the exception)."""
        pending, self._late = [late for late in self._late if not late.done], []
        return [late.apply() for late in pending]

    def latency_for(self, op: str) -> float:
        if isinstance(self.latency, Mapping):
            return float(self.latency.get(op, 0.0))
        return float(self.latency)

    def _take(self, op: str, key: str | None) -> _Planned | None:
        for i, planned in enumerate(self._planned):
            if planned.op == op and (planned.key is None or planned.key == key):
                return self._planned.pop(i)
        return None

    def _defer(self, effect: Callable[[], object], delay: float | None) -> None:
        late = _Late(effect)
        self._late.append(late)
        if delay is not None:

            async def land() -> None:
                await self.sleep(delay)
                late.apply()

            task = asyncio.get_running_loop().create_task(land())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)


@dataclass
class _Version:
    version_id: str
    body: bytes | None  # None: a delete marker
    etag: str | None
    metadata: dict[str, str]
    last_modified_ms: int

    @property
    def is_marker(self) -> bool:
        return self.body is None


@dataclass
class _Bucket:
    versioned: bool
    keys: dict[str, list[_Version]] = field(default_factory=dict)  # oldest first
    names: list[str] = field(default_factory=list)
    """Every key of ``keys``, sorted: a listing finds its prefix by bisection instead of reading every key."""

    def under(self, prefix: str) -> list[str]:
        """The keys under ``prefix``, sorted."""
        names = self.names
        i = j = bisect.bisect_left(names, prefix)
        while j < len(names) and names[j].startswith(prefix):
            j += 1
        return names[i:j]

    def drop(self, key: str) -> None:
        if self.keys.pop(key, None) is not None:
            i = bisect.bisect_left(self.names, key)
            if i < len(self.names) and self.names[i] == key:
                del self.names[i]


def _md5_etag(body: bytes) -> str:
    return '"' + hashlib.md5(body).hexdigest() + '"'


def _etag_matches(wanted: str, etag: str | None) -> bool:
    if etag is None:
        return False
    return wanted == "*" or wanted.strip('"') == etag.strip('"')


def _public_vid(version_id: str) -> str | None:
    return None if version_id == _NULL else version_id


class MemoryStore:
    """The in-memory twin of ``S3Store`` (see module docstring). Deterministic given ``rng``."""

    def __init__(
        self,
        *,
        rng: random.Random | None = None,
        faults: Faults | None = None,
        clock: Callable[[], int] | None = None,
    ) -> None:
        self.rng = rng if rng is not None else random.Random(0)
        self.faults = faults if faults is not None else Faults()
        counter = itertools.count(1)
        self._clock: Callable[[], int] = clock if clock is not None else (lambda: next(counter))
        self._buckets: dict[str, _Bucket] = {}
        self.closed = False

    def __repr__(self) -> str:
        return f"MemoryStore(buckets={sorted(self._buckets)})"

    # ------------------------------------------------------------------ plumbing

    async def _run(self, op: str, key: str | None, effect: Callable[[], T]) -> T:
        faults = self.faults
        faults.calls[op] += 1
        await faults.sleep(faults.latency_for(op))
        planned = faults._take(op, key)
        if planned is None:
            return effect()
        where = f"{op} {key}" if key is not None else op
        if planned.kind == "5xx":
            raise StoreUnavailable(f"{where}: injected 5xx (not applied)")
        if planned.kind == "lost_response":
            try:
                effect()
            except Exception:
                pass  # the answer is lost either way
            raise StoreUnavailable(f"{where}: injected lost response (applied)")
        faults._defer(effect, planned.delay)
        raise StoreUnavailable(f"{where}: injected late request (applied later)")

    def _bucket(self, bucket: str) -> _Bucket:
        try:
            return self._buckets[bucket]
        except KeyError:
            raise NoSuchBucket(f"{bucket}: NoSuchBucket") from None

    def _new_vid(self, b: _Bucket) -> str:
        return f"{self.rng.getrandbits(128):032x}" if b.versioned else _NULL

    def _add(self, b: _Bucket, key: str, version: _Version) -> None:
        versions = b.keys.get(key)
        if versions is None:
            versions = b.keys[key] = []
            bisect.insort(b.names, key)
        if version.version_id == _NULL:
            versions[:] = [v for v in versions if v.version_id != _NULL]
        versions.append(version)

    @staticmethod
    def _latest(b: _Bucket, key: str) -> _Version | None:
        versions = b.keys.get(key)
        return versions[-1] if versions else None

    @classmethod
    def _current(cls, b: _Bucket, key: str) -> _Version | None:
        latest = cls._latest(b, key)
        return None if latest is None or latest.is_marker else latest

    @staticmethod
    def _find(b: _Bucket, key: str, version_id: str) -> _Version | None:
        for v in b.keys.get(key, []):
            if v.version_id == version_id:
                return v
        return None

    @staticmethod
    def _check_key(op: str, key: str) -> None:
        if not key or len(key.encode()) > 1024:
            raise InvalidRequest(f"{op}: invalid key {key!r}")

    # ------------------------------------------------------------------ buckets

    async def create_bucket(self, bucket: str, *, versioned: bool = True) -> None:
        def effect() -> None:
            if not _BUCKET_NAME.match(bucket):
                raise InvalidRequest(f"create_bucket {bucket}: InvalidBucketName")
            b = self._buckets.setdefault(bucket, _Bucket(versioned=versioned))
            if versioned:
                b.versioned = True

        await self._run("create_bucket", None, effect)

    async def bucket_versioning(self, bucket: str) -> bool:
        return await self._run("bucket_versioning", None, lambda: self._bucket(bucket).versioned)

    async def delete_bucket(self, bucket: str) -> None:
        """Not part of the port (mirrors ``S3Store.delete_bucket``): drop the bucket and its versions."""
        self._buckets.pop(bucket, None)

    # ------------------------------------------------------------------ objects

    def _read(self, bucket: str, key: str, version_id: str | None, with_body: bool) -> Got | Missing:
        b = self._bucket(bucket)
        v = self._current(b, key) if version_id is None else self._find(b, key, version_id)
        if v is None or v.is_marker:
            return Missing()
        assert v.body is not None and v.etag is not None
        return Got(
            body=v.body if with_body else b"",
            etag=v.etag,
            version_id=_public_vid(v.version_id),
            metadata=dict(v.metadata),
        )

    async def get(self, bucket: str, key: str, *, version_id: str | None = None) -> Got | Missing:
        return await self._run("get", key, lambda: self._read(bucket, key, version_id, True))

    async def head(self, bucket: str, key: str, *, version_id: str | None = None) -> Got | Missing:
        """Like :meth:`get` with an empty body. A missing bucket reads as :class:`Missing`, as on S3:
        a HEAD error response has no body to name NoSuchBucket."""

        def effect() -> Got | Missing:
            if bucket not in self._buckets:
                return Missing()
            return self._read(bucket, key, version_id, False)

        return await self._run("head", key, effect)

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
        what = f"put {bucket}/{key}"
        self._check_key(what, key)
        if if_match is not None and if_none_match:
            raise InvalidRequest(f"{what}: if_match and if_none_match are exclusive")
        meta = normalize_metadata(what, metadata)
        data = bytes(body)

        def effect() -> Won | Lost:
            b = self._bucket(bucket)
            cur = self._current(b, key)
            if if_match is not None and (cur is None or not _etag_matches(if_match, cur.etag)):
                return Lost(cur.etag if cur else None)
            if if_none_match and cur is not None:
                return Lost(cur.etag)
            v = _Version(self._new_vid(b), data, _md5_etag(data), dict(meta), self._clock())
            self._add(b, key, v)
            return Won(v.etag, _public_vid(v.version_id))

        return await self._run("put", key, effect)

    async def delete(
        self, bucket: str, key: str, *, if_match: str | None = None, version_id: str | None = None
    ) -> Won | Lost:
        """See ``S3Store.delete``: with ``version_id`` removes exactly that version (C3)."""

        def effect() -> Won | Lost:
            b = self._bucket(bucket)
            if version_id is not None:
                target = self._find(b, key, version_id)
                if if_match is not None and (target is None or not _etag_matches(if_match, target.etag)):
                    return Lost(target.etag if target is not None else None)
                if target is not None:
                    b.keys[key].remove(target)
                    if not b.keys[key]:
                        b.drop(key)
                return Won(None, version_id)
            cur = self._current(b, key)
            if if_match is not None and (cur is None or not _etag_matches(if_match, cur.etag)):
                return Lost(cur.etag if cur else None)
            if b.versioned:
                marker = _Version(self._new_vid(b), None, None, {}, self._clock())
                self._add(b, key, marker)
                return Won(None, marker.version_id)
            b.drop(key)
            return Won(None, None)

        return await self._run("delete", key, effect)

    async def copy(
        self, bucket: str, key: str, *, src_bucket: str, src_key: str, src_version_id: str | None = None
    ) -> Won:
        what = f"copy {src_bucket}/{src_key} -> {bucket}/{key}"
        self._check_key(what, key)

        def effect() -> Won:
            sb = self._bucket(src_bucket)
            src = self._current(sb, src_key) if src_version_id is None else self._find(sb, src_key, src_version_id)
            if src is None or src.is_marker:
                raise InvalidRequest(f"{what}: copy source is missing (NoSuchKey)")
            b = self._bucket(bucket)
            v = _Version(self._new_vid(b), src.body, src.etag, dict(src.metadata), self._clock())
            self._add(b, key, v)
            return Won(v.etag, _public_vid(v.version_id))

        return await self._run("copy", key, effect)

    # ------------------------------------------------------------------ listings

    async def list_versions(self, bucket: str, prefix: str = "", *, after: str = "") -> list[VersionEntry]:
        def effect() -> list[VersionEntry]:
            b = self._bucket(bucket)
            out: list[VersionEntry] = []
            keys = b.under(prefix)
            for key in keys[bisect.bisect_right(keys, after):] if after else keys:
                versions = b.keys[key]
                for i, v in enumerate(reversed(versions)):
                    out.append(
                        VersionEntry(
                            key=key,
                            version_id=v.version_id,
                            is_latest=i == 0,
                            is_delete_marker=v.is_marker,
                            etag=v.etag,
                            size=0 if v.body is None else len(v.body),
                            last_modified_ms=v.last_modified_ms,
                        )
                    )
            return out

        return await self._run("list_versions", None, effect)

    async def list_keys(self, bucket: str, prefix: str = "") -> list[str]:
        def effect() -> list[str]:
            b = self._bucket(bucket)
            return [k for k in b.under(prefix) if self._current(b, k) is not None]

        return await self._run("list_keys", None, effect)

    async def list_entries(self, bucket: str, prefix: str = "") -> list[ObjectEntry]:
        def effect() -> list[ObjectEntry]:
            b = self._bucket(bucket)
            out = []
            for k in b.under(prefix):
                v = self._current(b, k)
                if v is not None:
                    out.append(ObjectEntry(k, v.etag, 0 if v.body is None else len(v.body)))
            return out

        return await self._run("list_keys", None, effect)  # the same request as list_keys (ListObjectsV2)

    async def close(self) -> None:
        self.closed = True


def normalize_metadata(what: str, metadata: Mapping[str, str] | None) -> dict[str, str]:
    """User metadata as S3 on SeaweedFS stores it: names lower-cased, values stripped of surrounding
    blanks, empty values dropped. Non-ASCII or control characters are an :class:`InvalidRequest`
    (botocore refuses them before sending)."""
    out: dict[str, str] = {}
    for k, v in (metadata or {}).items():
        if not (k.isascii() and v.isascii()) or not k or _CONTROL.search(k + v.replace("\t", " ")):
            raise InvalidRequest(f"{what}: S3 metadata must be printable ASCII (name {k!r})")
        value = v.strip(" \t")
        if value:
            out[k.lower()] = value
    return out
