"""The noncurrent history of a host's claim and record, bounded (issue 16 "Bounded storage";
:mod:`services.sweeper.history`): the pure decider, and the sweep on SeaweedFS deleting by exact version id."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from hostmove.stackinfo import StackInfo
from kernel import rules
from kernel.ports import WallClock
from services.ledger.ledger import object_key
from services.objstore.port import VersionEntry
from services.objstore.s3 import S3Store
from services.sweeper.history import LedgerHistory, noncurrent_to_retire

KEY = object_key("claim", "h.example.com")


def entry(vid: str, at: int, latest: bool = False, marker: bool = False, key: str = KEY) -> VersionEntry:
    return VersionEntry(key=key, version_id=vid, is_latest=latest, is_delete_marker=marker, etag=None, size=10,
                        last_modified_ms=at)


def test_only_old_noncurrent_versions_beyond_the_newest_few_are_retired() -> None:
    now, h = 100_000, 10_000
    old = [entry(f"v{i}", 1000 * i) for i in range(1, 9)]  # 1 s .. 8 s: all older than now - H
    current = entry("cur", 99_000, latest=True)
    recent = entry("recent", now - 500)
    listing = [*old, current, recent, entry("other", 1, key=KEY + ".x")]
    out = noncurrent_to_retire(listing, KEY, now_ms=now, horizon_ms=h, keep=4)
    # the newest four noncurrent are kept (recent, v8, v7, v6); of the rest, only what is older than H
    assert [e.version_id for e in out] == ["v1", "v2", "v3", "v4", "v5"]
    assert noncurrent_to_retire([*old, current], KEY, now_ms=now, horizon_ms=h, keep=8) == [], "fewer than keep"
    assert noncurrent_to_retire(old, KEY, now_ms=now, horizon_ms=h, keep=0) == [], "no current version: nothing"
    assert all(not e.is_latest for e in noncurrent_to_retire(listing, KEY, now_ms=now, horizon_ms=h, keep=0))
    marked = [*old, entry("m", 500, marker=True), current]
    assert "m" not in {e.version_id for e in noncurrent_to_retire(marked, KEY, now_ms=now, horizon_ms=h, keep=0)}
    with rules.mutated(["ledger-history-bounded"]):
        assert noncurrent_to_retire(listing, KEY, now_ms=now, horizon_ms=h, keep=0) == []


@pytest.mark.asyncio(loop_scope="session")
async def test_the_sweep_deletes_old_noncurrent_versions_by_id_on_seaweedfs(
        stack: StackInfo, unique: Callable[[str], str]) -> None:
    store = await S3Store.open(stack.s3_endpoint, stack.s3_access_key, stack.s3_secret_key, stack.s3_region)
    bucket = unique("history")
    await store.create_bucket(bucket, versioned=True)
    try:
        for i in range(8):
            await store.put(bucket, KEY, f'{{"gen": {i}}}'.encode())
        await asyncio.sleep(2.5)  # older than H (0 here) and the one-second slack of LastModified
        for i in range(8, 10):
            await store.put(bucket, KEY, f'{{"gen": {i}}}'.encode())
        before = [e for e in await store.list_versions(bucket, KEY) if e.key == KEY]
        assert len(before) == 10
        current = next(e for e in before if e.is_latest)
        did = await LedgerHistory(store, bucket, WallClock(), horizon_ms=0, keep=1).look("h.example.com")
        after = [e for e in await store.list_versions(bucket, KEY) if e.key == KEY]
        # the current one and the newest noncurrent (ties in LastModified, within a second, are kept together)
        assert did and len(after) == 2, (did, after)
        assert next(e for e in after if e.is_latest).version_id == current.version_id
        got = await store.get(bucket, KEY)
        assert getattr(got, "body", None) == b'{"gen": 9}', "the current version untouched"
        again = await LedgerHistory(store, bucket, WallClock(), horizon_ms=0, keep=1).look("h.example.com")
        assert again == [], "nothing left to retire"
    finally:
        for e in await store.list_versions(bucket, ""):
            await store.delete(bucket, e.key, version_id=e.version_id)
        await store.delete_bucket(bucket)
        await store.close()
