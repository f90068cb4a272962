"""The object store conformance probe every service runs at start (ARCHITECTURE §4; C3, C6).

The design rests on a few S3 behaviours: exactly one winner among concurrent conditional writers,
exact versions (C3), delete markers and conditional deletes. The probe checks each of them against
the live store in a scratch prefix ``_probe/<random>/`` and deletes every version it wrote. A service
that finds one missing refuses to start (:func:`run_probe_or_exit`, exit code 3).
"""

from __future__ import annotations

import asyncio
import secrets
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from services.objstore.port import Got, Lost, Missing, ObjectStore, StoreError, Won

__all__ = ["CHECKS", "CheckResult", "ProbeFailed", "ProbeReport", "conformance_probe", "run_probe_or_exit"]

PROBE_EXIT_CODE = 3

#: check name -> what must hold, in plain words (used in failure messages).
CHECKS: dict[str, str] = {
    "concurrent_if_match": "concurrent If-Match writers from one ETag must give exactly one winner",
    "concurrent_if_none_match": "concurrent If-None-Match creators of one key must give exactly one winner",
    "if_match_missing_refused": "an If-Match write to a missing key must be refused",
    "versioning_on": "the bucket must have versioning enabled and writes must return a version id",
    "copy_by_version": "a copy by version id must copy that exact (older) version",
    "delete_by_version": "a delete by version id must remove exactly that version and keep the current one",
    "delete_markers_listed": "a plain delete must leave a delete marker that the version listing shows",
    "delete_if_match": "a delete with a stale If-Match ETag must be refused",
}


class _CheckFailed(Exception):
    pass


class ProbeFailed(Exception):
    """A conformance check failed: the store cannot give the guarantees the services rely on."""

    def __init__(self, check: str, detail: str) -> None:
        self.check = check
        self.detail = detail
        meaning = CHECKS.get(check, check)
        super().__init__(f"object store conformance check {check!r} failed ({meaning}): {detail}")


@dataclass(frozen=True)
class CheckResult:
    name: str
    ok: bool
    detail: str
    elapsed_s: float = 0.0

    @property
    def description(self) -> str:
        return CHECKS.get(self.name, self.name)


@dataclass
class ProbeReport:
    bucket: str
    prefix: str
    checks: list[CheckResult] = field(default_factory=list)
    cleanup_errors: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    @property
    def failed(self) -> list[CheckResult]:
        return [c for c in self.checks if not c.ok]

    def raise_for_failure(self) -> None:
        """Raise :class:`ProbeFailed` for the first failed check (checks run in :data:`CHECKS` order)."""
        for check in self.checks:
            if not check.ok:
                raise ProbeFailed(check.name, check.detail)

    def summary(self) -> str:
        lines = [f"{'ok  ' if c.ok else 'FAIL'} {c.name} ({c.elapsed_s:.2f} s): {c.detail}" for c in self.checks]
        lines += [f"cleanup: {e}" for e in self.cleanup_errors]
        return "\n".join(lines)


def _expect(cond: bool, detail: str) -> None:
    if not cond:
        raise _CheckFailed(detail)


def _got(result: Got | Missing, what: str) -> Got:
    _expect(isinstance(result, Got), f"{what} is missing")
    assert isinstance(result, Got)
    return result


def _won(result: Won | Lost, what: str) -> Won:
    _expect(isinstance(result, Won), f"{what} was refused ({result})")
    assert isinstance(result, Won)
    return result


async def conformance_probe(store: ObjectStore, bucket: str, n: int = 8, *, prefix: str | None = None) -> ProbeReport:
    """Run every check of :data:`CHECKS` in ``_probe/<random>/`` of ``bucket`` and clean up.

    Each check uses its own keys, so one failure does not mask another, and they run concurrently.
    A store error during a check fails that check (with the error as detail); never a pass (C6).
    """
    if n < 2:
        raise ValueError("n must be at least 2")
    scratch = prefix if prefix is not None else f"_probe/{secrets.token_hex(8)}/"
    report = ProbeReport(bucket=bucket, prefix=scratch)

    async def concurrent_if_match() -> str:
        key = scratch + "cas"
        base = _won(await store.put(bucket, key, b"base"), "the initial write")
        _expect(base.etag is not None, "the initial write returned no ETag")
        assert base.etag is not None
        results = await asyncio.gather(
            *(store.put(bucket, key, f"writer-{i}".encode(), if_match=base.etag) for i in range(n))
        )
        winners = [i for i, r in enumerate(results) if isinstance(r, Won)]
        _expect(len(winners) == 1, f"{len(winners)} of {n} writers won, expected exactly 1")
        final = _got(await store.get(bucket, key), "the object after the race")
        _expect(final.body == f"writer-{winners[0]}".encode(), "the final body is not the winner's")
        return f"1 of {n} won, {n - 1} lost"

    async def concurrent_if_none_match() -> str:
        key = scratch + "create"
        results = await asyncio.gather(
            *(store.put(bucket, key, f"creator-{i}".encode(), if_none_match=True) for i in range(n))
        )
        winners = sum(isinstance(r, Won) for r in results)
        _expect(winners == 1, f"{winners} of {n} creators won, expected exactly 1")
        return f"1 of {n} won"

    async def if_match_missing_refused() -> str:
        key = scratch + "never-written"
        result = await store.put(bucket, key, b"x", if_match='"00000000000000000000000000000000"')
        _expect(isinstance(result, Lost), f"the write was accepted ({result})")
        assert isinstance(result, Lost)
        _expect(result.current_etag is None, f"Lost reports an ETag {result.current_etag!r} for a missing key")
        _expect(isinstance(await store.get(bucket, key), Missing), "the refused write left an object")
        return "refused"

    async def versioning_on() -> str:
        _expect(await store.bucket_versioning(bucket), f"versioning is not enabled on bucket {bucket!r}")
        won = _won(await store.put(bucket, scratch + "versioned", b"v"), "the write")
        _expect(bool(won.version_id), "a write returned no version id")
        return "enabled"

    async def two_versions(key: str) -> tuple[Won, Won]:
        older = _won(await store.put(bucket, key, b"older"), "the first write")
        newer = _won(await store.put(bucket, key, b"newer"), "the second write")
        _expect(bool(older.version_id) and bool(newer.version_id), "writes returned no version id")
        _expect(older.version_id != newer.version_id, "two writes returned the same version id")
        return older, newer

    async def copy_by_version() -> str:
        key = scratch + "copy-src"
        older, _ = await two_versions(key)
        await store.copy(bucket, scratch + "copy-dst", src_bucket=bucket, src_key=key, src_version_id=older.version_id)
        copied = _got(await store.get(bucket, scratch + "copy-dst"), "the copy")
        _expect(copied.body == b"older", f"the copy holds {copied.body!r}, expected the older version b'older'")
        return "copied the older version"

    async def delete_by_version() -> str:
        key = scratch + "del-version"
        older, newer = await two_versions(key)
        _won(await store.delete(bucket, key, version_id=older.version_id), "the delete by version id")
        _expect(
            isinstance(await store.get(bucket, key, version_id=older.version_id), Missing),
            "the deleted version can still be read by its id",
        )
        current = _got(await store.get(bucket, key), "the current version")
        _expect(current.body == b"newer", f"the current version holds {current.body!r}, expected b'newer'")
        _expect(current.version_id == newer.version_id, "the current version id changed")
        return "removed exactly the older version"

    async def delete_markers_listed() -> str:
        key = scratch + "marker"
        _won(await store.put(bucket, key, b"x"), "the write")
        _won(await store.delete(bucket, key), "the delete")
        _expect(isinstance(await store.get(bucket, key), Missing), "the object is still readable after delete")
        entries = [e for e in await store.list_versions(bucket, key) if e.key == key]
        markers = [e for e in entries if e.is_delete_marker]
        _expect(bool(markers), f"no delete marker listed ({len(entries)} entries for the key)")
        _expect(any(m.is_latest for m in markers), "the delete marker is not the latest version")
        return "marker listed as latest"

    async def delete_if_match() -> str:
        key = scratch + "del-if-match"
        stale = _won(await store.put(bucket, key, b"one"), "the first write")
        fresh = _won(await store.put(bucket, key, b"two"), "the second write")
        result = await store.delete(bucket, key, if_match=stale.etag)
        _expect(isinstance(result, Lost), f"a delete with a stale ETag was accepted ({result})")
        assert isinstance(result, Lost)
        _expect(
            result.current_etag == fresh.etag,
            f"Lost reports {result.current_etag!r}, expected {fresh.etag!r}",
        )
        _got(await store.get(bucket, key), "the object after a refused delete")
        return "refused"

    steps: dict[str, Callable[[], Awaitable[str]]] = {
        "concurrent_if_match": concurrent_if_match,
        "concurrent_if_none_match": concurrent_if_none_match,
        "if_match_missing_refused": if_match_missing_refused,
        "versioning_on": versioning_on,
        "copy_by_version": copy_by_version,
        "delete_by_version": delete_by_version,
        "delete_markers_listed": delete_markers_listed,
        "delete_if_match": delete_if_match,
    }
    loop = asyncio.get_running_loop()  # its clock, so a simulated loop keeps virtual time

    async def run_one(name: str, step: Callable[[], Awaitable[str]]) -> CheckResult:
        started = loop.time()
        try:
            detail = await step()
        except _CheckFailed as exc:
            return CheckResult(name, False, str(exc), loop.time() - started)
        except Exception as exc:  # a store error (or a store bug) is a failed check, never a pass (C6)
            kind = "store error" if isinstance(exc, StoreError) else "unexpected error"
            return CheckResult(name, False, f"{kind}: {type(exc).__name__}: {exc}", loop.time() - started)
        return CheckResult(name, True, detail, loop.time() - started)

    try:
        # Checks touch disjoint keys, so they run concurrently: on SeaweedFS each contended
        # conditional write race costs seconds (losers come back in ~1 s steps).
        report.checks.extend(await asyncio.gather(*(run_one(name, step) for name, step in steps.items())))
    finally:
        await _cleanup(store, bucket, scratch, report)
    return report


async def _cleanup(store: ObjectStore, bucket: str, scratch: str, report: ProbeReport) -> None:
    """Delete every scratch version and marker by version id (never a whole bucket)."""
    try:
        entries = await store.list_versions(bucket, scratch)
    except StoreError as exc:
        report.cleanup_errors.append(f"listing {scratch}: {type(exc).__name__}: {exc}")
        return
    for entry in entries:
        if not entry.key.startswith(scratch):
            continue
        try:
            await store.delete(bucket, entry.key, version_id=entry.version_id)
        except StoreError as exc:
            report.cleanup_errors.append(f"{entry.key}@{entry.version_id}: {type(exc).__name__}: {exc}")


async def run_probe_or_exit(store: ObjectStore, bucket: str, n: int = 8) -> None:
    """Run the probe; on failure print ``object store conformance check failed: <check>: <detail>``
    to stderr and exit with status 3."""
    report = await conformance_probe(store, bucket, n)
    if report.ok:
        return
    first = report.failed[0]
    print(f"object store conformance check failed: {first.name}: {first.detail}", file=sys.stderr)
    for other in report.failed[1:]:
        print(f"  also failed: {other.name}: {other.detail}", file=sys.stderr)
    raise SystemExit(PROBE_EXIT_CODE)
