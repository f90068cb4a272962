"""The cross-region probes' leftovers are retired by the bucket's own region (issue 16 item 6;
services/sweeper/lanes.py): T10's lane probe and T11's rate probe may only delete bare in another region's bucket
(M17), so each leaves a version and a delete marker, which the owning region's box deletes by version id."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from hostmove.stackinfo import StackInfo
from kernel.ports import ManualClock, WallClock
from services.objstore.port import VersionEntry
from services.sweeper.lanes import LANE_PROBES, LaneProbeSweep, probes_to_retire
from services.target import rates, readiness
from tests.helpers.stores import seaweed_versioned


def entry(key: str, at: int, vid: str = "v", marker: bool = False) -> VersionEntry:
    return VersionEntry(key=key, version_id=vid, is_latest=False, is_delete_marker=marker, etag=None, size=4,
                        last_modified_ms=at)


def test_the_probes_prefix_is_the_one_the_probes_write() -> None:
    assert readiness.LANE_PREFIX == rates.LANE_PREFIX == LANE_PROBES


def test_only_probes_older_than_the_grace_are_retired() -> None:
    listing = [entry(LANE_PROBES + "h-mv1", 1_000), entry(LANE_PROBES + "h-mv1", 1_001, "m", marker=True),
               entry(LANE_PROBES + "h-mv2", 9_500), entry("moves/h/mv1/target.json", 1_000)]
    out = probes_to_retire(listing, now_ms=10_000, grace_ms=5_000)
    assert [(e.key, e.version_id) for e in out] == [(LANE_PROBES + "h-mv1", "v"), (LANE_PROBES + "h-mv1", "m")]


@pytest.mark.asyncio(loop_scope="session")
async def test_the_owning_region_retires_the_probes_by_version_on_seaweedfs(
        stack: StackInfo, unique: Callable[[str], str]) -> None:
    async with seaweed_versioned(stack, unique("lanes")) as (store, bucket):
        lane = "moves/h.example.com/mv_x/target.json"
        ok, why = await readiness.lane_probe(store, bucket, "h.example.com-mv_x")  # what a peer's target does
        assert ok, why
        await store.put(bucket, lane, b"{}")
        left = await store.list_versions(bucket, LANE_PROBES)
        assert len(left) == 2 and any(e.is_delete_marker for e in left), left  # the bare delete's leftovers
        clock = ManualClock(WallClock().now_ms())
        sweep = LaneProbeSweep("ie-1", store, bucket, clock, every_ms=5_000)
        assert await sweep.run() == 0, "a probe younger than the grace is left alone"
        clock.advance(10_000)
        assert await sweep.run() == 2
        assert await store.list_versions(bucket, LANE_PROBES) == []
        assert [e.key for e in await store.list_versions(bucket, "moves/")] == [lane], "nothing else is touched"
        ok, why = await readiness.lane_probe(store, bucket, "h.example.com-mv_y")
        assert ok, why
        assert await sweep.run() == 0, "once a period"
        clock.advance(60_000)
        assert await sweep.run() == 2
