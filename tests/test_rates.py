"""T11's rates, measured by the box (issue 18 item 4; spec §7.3 T11): against the session's SeaweedFS and this
machine's disk, cached with the time they were taken, measured again once older than the bound, per peer region
for the cross-region path; and the budget priced on a disk whose read and write rates differ."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from hostmove.stackinfo import StackInfo
from kernel.ports import WallClock
from services.objstore.s3 import S3Store
from services.target.budget import FAST_BUDGET, Rates, t11
from services.target.rates import RateProbe
from services.target.readiness import storage_probe


@pytest.mark.asyncio(loop_scope="session")
async def test_the_box_measures_its_rates_and_caches_them(stack: StackInfo, unique: Callable[[str], str],
                                                          tmp_path: Path) -> None:
    store = await S3Store.open(stack.s3_endpoint, stack.s3_access_key, stack.s3_secret_key, stack.s3_region)
    own, peer = unique("rates-uk"), unique("rates-ie")
    try:
        for bucket in (own, peer):
            await store.create_bucket(bucket)
        probe = RateProbe("uk-1", tmp_path, store, own, {"ie": peer}.__getitem__, WallClock(), max_age_s=600)
        first = await probe.rates("ie")
        assert first is not None and min(first.cross_region, first.regional_s3, first.disk, first.read) > 0
        cached = json.loads((tmp_path / "rates.json").read_text())
        assert set(cached["local"]) == {"at", "disk_write", "disk_read", "regional_s3"} and set(cached["cross"]) == {
            "ie"}
        assert await probe.rates("ie") == first, "fresh: the cache answers"
        assert await store.list_keys(own, ".carlos-move-probe/") == [] and await store.list_keys(peer, "moves/") == []
        # issue 16 item 2: in its own bucket the box deletes the versions its PUTs made, leaving no noncurrent version
        # or delete marker; in the peer's it may only delete bare (M17), which leaves both
        assert await store.list_versions(own, ".carlos-move-probe/") == []
        assert any(v.is_delete_marker for v in await store.list_versions(peer, "moves/"))
        assert await storage_probe(store, own, "h-mv") == (True, "")
        assert await store.list_versions(own, ".carlos-move-probe/") == [], "T4's probe leaves no version either"
        probe.max_age_s = 0
        again = await probe.rates("ie")
        assert again is not None and again != first, "stale: measured again"
    finally:
        for bucket in (own, peer):
            await store.delete_bucket(bucket)
        await store.close()


def test_a_slow_disk_read_is_priced_where_the_database_is_read() -> None:
    same = t11(64, Rates(100, 100, 500))
    slow_read = t11(64, Rates(100, 100, 500, disk_read=50))
    assert slow_read.snapshot_s > slow_read.restore_s and slow_read.verify_s == pytest.approx(64 / 50)
    assert slow_read.fixed_s > same.fixed_s and slow_read.attempt_costs[1] > same.attempt_costs[1]
    assert t11(64, Rates(100, 100, 500, disk_read=500)).total_s == pytest.approx(same.total_s)
    fast = t11(16, Rates(100, 200, 500), timing=FAST_BUDGET)
    assert fast.window_s == 12.0 and fast.attempts == 1 and fast.total_s < 12
