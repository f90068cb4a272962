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
from services.move.lease import lease_key
from services.objstore.port import VersionEntry
from services.sweeper.history import LedgerHistory, journals_to_retire, noncurrent_to_retire
from tests.helpers.stores import seaweed_versioned

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
    async with seaweed_versioned(stack, unique("history")) as (store, bucket):
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


def test_journals_are_retired_per_key_outside_the_lanes_of_live_operations() -> None:
    now, h, prefix = 100_000, 10_000, "moves/h.example.com/"
    done, live = prefix + "mv_done/target.json", prefix + "mv_live/source.json"
    listing = [entry(f"{k[-11:]}{i}", 1000 * i, key=k) for k in (done, live) for i in range(1, 5)]
    listing += [entry("done-cur", 5000, latest=True, key=done), entry("live-cur", 5000, latest=True, key=live)]
    listing += [entry("evidence", 1000, latest=True, key=prefix + "mv_done/stopped-source.json")]
    out = journals_to_retire(listing, prefix, live_ops=frozenset({"mv_live"}), now_ms=now, horizon_ms=h, keep=1)
    assert {e.key for e in out} == {done}, "the live operation's lane and a create-only object are untouched"
    assert [e.last_modified_ms for e in out] == [1000, 2000, 3000], "the newest noncurrent one is kept"
    both = journals_to_retire(listing, prefix, live_ops=frozenset(), now_ms=now, horizon_ms=h, keep=1)
    assert {e.key for e in both} == {done, live} and not any(e.is_latest for e in both)


@pytest.mark.asyncio(loop_scope="session")
async def test_the_sweep_bounds_staging_leases_and_move_journals_on_seaweedfs(
        stack: StackInfo, unique: Callable[[str], str]) -> None:
    """Issue 16 item 2: a lease renewed and journals rewritten in place keep one current version and the newest
    noncurrent one; a live operation's journal, another region's lease (not in the roster) and create-only evidence
    keep every version."""
    async with seaweed_versioned(stack, unique("history")) as (store, bucket):
        host = "h.example.com"
        lease, other = lease_key("uk", host), lease_key("us", host)
        done, live = f"moves/{host}/mv_done/target.json", f"moves/{host}/mv_live/source.json"
        evidence = f"moves/{host}/mv_done/stopped-source.json"
        await store.put(bucket, evidence, b"{}")
        for i in range(6):
            if i == 4:
                await asyncio.sleep(2.5)  # the first four older than H (0 here) and the one-second slack
            for key in (lease, other, done, live):
                await store.put(bucket, key, f'{{"round": {i}}}'.encode())
        sweep = LedgerHistory(store, bucket, WallClock(), horizon_ms=0, keep=1)
        did = await sweep.look(host, regions=("ie", "uk"), live_ops=frozenset({"mv_live"}))
        assert any("staging lease in uk" in d for d in did) and any("move journals" in d for d in did), did

        async def versions(key: str) -> list[VersionEntry]:
            return [e for e in await store.list_versions(bucket, key) if e.key == key]

        assert len(await versions(lease)) == 2 and len(await versions(done)) == 2
        assert len(await versions(other)) == 6 and len(await versions(live)) == 6 and len(await versions(evidence)) == 1
        for key in (lease, done):
            got = await store.get(bucket, key)
            assert getattr(got, "body", None) == b'{"round": 5}', f"the current {key} untouched"
        again = await sweep.look(host, regions=("ie", "uk"), live_ops=frozenset({"mv_live"}))
        assert again == [], "nothing left to retire"
