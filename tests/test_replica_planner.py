"""The restore planner (pure) and the writer's confinement and retry rules, on the store twin
(spec §5.1 steps 4 to 9; D§7). The same contract on SeaweedFS is in ``test_replica_real.py``."""

from __future__ import annotations

import asyncio
import os
import sqlite3
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kernel.ports import ManualClock
from services.box.replica.layout import FileRef, GenerationScope, GenerationViolation, list_generation
from services.box.replica.planner import (
    GAP,
    ROOT_MISMATCH,
    WRONG_TXID,
    PinnedRoot,
    Plan,
    Refusal,
    extend_chain,
    plan_restore,
    replication_position,
)
from services.box.replica.replicator import ReplicaError, Replicator
from services.box.replica.restore import restore_generation
from services.objstore.memory import Faults, MemoryStore
from services.objstore.port import Got, StoreUnavailable

G = GenerationScope("instances/h/" + "c" * 64, "mv_test")


def f(level: int, lo: int, hi: int) -> FileRef:
    return FileRef(level, lo, hi, G.ltx_key(level, lo, hi))


def plan(files: list[FileRef], **kw: object) -> Plan:
    out = plan_restore(files, **kw)  # type: ignore[arg-type]
    assert isinstance(out, Plan), out
    return out


def refusal(files: list[FileRef], **kw: object) -> Refusal:
    out = plan_restore(files, **kw)  # type: ignore[arg-type]
    assert isinstance(out, Refusal), out
    return out


def spans(p: Plan) -> list[tuple[int, int, int]]:
    return [(x.level, x.min_txid, x.max_txid) for x in p.files]


# ------------------------------------------------------------------------------------ root rule


def test_root_is_the_newest_successor_at_or_past_the_pinned_snapshot() -> None:
    pinned = PinnedRoot(G.ltx_key(9, 1, 10), "v-pinned", 10)
    files = [f(9, 1, 10), f(9, 1, 20), f(9, 1, 30), f(1, 18, 29), f(0, 30, 30), f(0, 31, 31)]
    p = plan(files, pinned=pinned)
    assert spans(p) == [(9, 1, 30), (0, 31, 31)] and p.final_txid == 31 and not p.root_is_pinned
    # a snapshot below the pinned one is never a root, even when it is the only one current
    low = plan([f(9, 1, 5), f(0, 11, 11)], pinned=pinned)
    assert low.root_is_pinned and low.root is not None and low.root.version_id == "v-pinned"
    assert spans(low) == [(9, 1, 10), (0, 11, 11)]
    # a successor that failed verification is excluded; the next newest is taken
    p2 = plan(files, pinned=pinned, exclude_roots=frozenset({G.ltx_key(9, 1, 30)}))
    assert spans(p2) == [(9, 1, 20), (1, 18, 29), (0, 30, 30), (0, 31, 31)]


def test_without_a_pinned_root_the_origin_roots_at_its_newest_snapshot_or_at_zero() -> None:
    assert spans(plan([f(9, 1, 4), f(9, 1, 8), f(0, 8, 8), f(0, 9, 9)])) == [(9, 1, 8), (0, 9, 9)]
    p = plan([f(0, 1, 1), f(0, 2, 2)])
    assert p.root is None and spans(p) == [(0, 1, 1), (0, 2, 2)]
    empty = plan([])
    assert empty.files == () and empty.final_txid == 0


def test_a_pinned_key_that_does_not_name_its_txid_is_refused() -> None:
    r = refusal([], pinned=PinnedRoot(G.ltx_key(9, 1, 11), "v", 10))
    assert r.reason == ROOT_MISMATCH
    r = refusal([], pinned=PinnedRoot(G.ltx_key(0, 10, 10), "v", 10))
    assert r.reason == ROOT_MISMATCH


# ------------------------------------------------------------------------------------ overlap and preference


def test_compacted_continuation_over_a_snapshot_is_taken() -> None:
    """Spec §5.1 (R4-1): a snapshot at 100 with one continuation [91, 110] is healthy: restore to 110.
    Rev 7.4's rule (min == current + 1) would have refused it or stopped at 100."""
    p = plan([f(9, 1, 100), f(1, 91, 110)], pinned=PinnedRoot(G.ltx_key(9, 1, 100), "v", 100))
    assert spans(p) == [(9, 1, 100), (1, 91, 110)] and p.final_txid == 110


def test_preference_highest_max_then_lowest_min_then_higher_level() -> None:
    files = [f(0, 5, 5), f(1, 3, 8), f(2, 1, 8), f(3, 2, 8), f(1, 4, 7), f(0, 9, 9)]
    p = plan(files)
    assert spans(p)[0] == (2, 1, 8), "lowest min wins among equal max"
    tie = plan([f(1, 1, 8), f(3, 1, 8), f(0, 9, 9)])
    assert spans(tie)[0] == (3, 1, 8), "higher level wins on full ties"
    chain, end = extend_chain(4, [f(0, 5, 5), f(0, 6, 6), f(1, 5, 6), f(2, 3, 9), f(0, 10, 10)])
    assert [(x.level, x.min_txid, x.max_txid) for x in chain] == [(2, 3, 9), (0, 10, 10)] and end == 10


def test_files_below_the_root_are_skipped_not_refused() -> None:
    p = plan([f(9, 1, 50), f(0, 3, 3), f(1, 1, 40), f(0, 51, 51)])
    assert spans(p) == [(9, 1, 50), (0, 51, 51)]


# ------------------------------------------------------------------------------------ refusals


def test_a_gap_is_refused_with_litestreams_words() -> None:
    r = refusal([f(9, 1, 10), f(0, 11, 11), f(0, 13, 13)])
    assert r.reason == GAP
    assert "non-contiguous ltx files: have up to 11 but next file starts at 13" in r.message
    assert r.details == {"have": 11, "next": 13}
    # four rotations after the pinned snapshot (fact R5-3d): rooting at the pinned one alone is a gap
    pinned = PinnedRoot(G.ltx_key(9, 1, 1), "v", 1)
    rotated = [f(9, 1, 20), f(1, 17, 20), f(0, 20, 20), f(0, 21, 21)]
    r = refusal([x for x in rotated if x.level != 9], pinned=pinned)
    assert r.reason == GAP and "have up to 1 but next file starts at 17" in r.message
    assert plan(rotated, pinned=pinned).final_txid == 21


def test_the_required_final_txid_must_be_reached_exactly() -> None:
    files = [f(0, 1, 1), f(0, 2, 2), f(0, 3, 3)]
    assert plan(files, required_txid=3).final_txid == 3
    r = refusal(files, required_txid=2)
    assert r.reason == WRONG_TXID and "restores to TXID 3, but exactly 2 is required" in r.message
    assert refusal(files, required_txid=4).reason == WRONG_TXID


def test_position_is_the_newest_level0_max() -> None:
    assert replication_position([f(9, 1, 40), f(1, 1, 39), f(0, 40, 40), f(0, 12, 12)]) == 40
    assert replication_position([f(9, 1, 40)]) == 0


# ------------------------------------------------------------------------------------ property


@st.composite
def histories(draw: st.DrawFn) -> tuple[list[FileRef], int]:
    """A generation's current files after syncs, ladder compactions (inputs deleted bar the newest
    level-0 file), snapshots and retention, as the replicator produces them."""
    files: list[FileRef] = []
    pos = 0
    for action in draw(st.lists(st.sampled_from(["sync", "sync", "sync", "c1", "c2", "snap", "ret"]),
                                min_size=1, max_size=40)):
        if action == "sync":
            pos += 1
            files.append(f(0, pos, pos))
        elif action in ("c1", "c2"):
            level = int(action[1])
            floor = max((x.max_txid for x in files if level <= x.level <= 8), default=0)
            inputs = sorted((x for x in files if x.level == level - 1 and x.max_txid > floor),
                            key=lambda x: x.min_txid)
            if len(inputs) < 2:
                continue
            chain, end = extend_chain(inputs[0].min_txid - 1, inputs)
            newest0 = max((x for x in files if x.level == 0), key=lambda x: x.max_txid)
            files = [x for x in files if x not in chain or x == newest0]
            files.append(f(level, chain[0].min_txid, end))
        elif action == "snap" and pos:
            files.append(f(9, 1, pos))
        elif action == "ret":
            snaps = sorted((x for x in files if x.level == 9), key=lambda x: x.max_txid)
            if len(snaps) > 1:
                floor = snaps[-2].max_txid
                files = [x for x in files if not (x.level == 9 and x.max_txid < snaps[-1].max_txid)
                         and not (1 <= x.level <= 8 and x.max_txid < floor)]
    return files, pos


@settings(max_examples=300, deadline=None)
@given(histories())
def test_any_history_restores_to_its_position_and_a_lost_file_never_passes_silently(
    history: tuple[list[FileRef], int],
) -> None:
    files, pos = history
    p = plan(files)
    assert p.final_txid == pos
    assert replication_position(files) == pos
    cur = p.root.max_txid if p.root else 0
    for x in p.chain:
        assert x.min_txid <= cur + 1 < x.max_txid + 1
        cur = x.max_txid
    for needed in p.files:
        without = [x for x in files if x != needed]
        out = plan_restore(without, required_txid=pos)
        assert isinstance(out, Refusal) or out.final_txid == pos, "with N required, a lost file never shortens"
        if isinstance(out, Refusal) and needed is not p.files[-1]:
            # a lost file inside the chain is a gap whenever a later file still extends beyond it
            assert out.reason in (GAP, WRONG_TXID)


# ------------------------------------------------------------------------------------ writer rules on the twin


def _app(path: Path) -> sqlite3.Connection:
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("CREATE TABLE IF NOT EXISTS t(id INTEGER PRIMARY KEY, v BLOB)")
    return conn


def _rows(path: Path) -> list[tuple[int, bytes]]:
    conn = sqlite3.connect(path)
    try:
        return conn.execute("SELECT id, v FROM t ORDER BY id").fetchall()
    finally:
        conn.close()


async def test_a_failed_upload_is_retried_with_the_same_bytes_before_anything_new(tmp_path: Path) -> None:
    """Spec §5.1 step 6: the writer does not advance past a failed upload; the retry carries the
    same bytes for the same TXID, and only then is the next range captured."""
    store = MemoryStore()
    await store.create_bucket("replica-twin")
    db = tmp_path / "app.db"
    app = _app(db)
    app.execute("INSERT INTO t VALUES (1, x'01')")
    rep = await Replicator.open(store, "replica-twin", "instances/h1", "mv_a", db, ManualClock())
    assert (await rep.sync()) is not None and rep.position == 1
    app.execute("INSERT INTO t VALUES (2, x'02')")
    key2 = GenerationScope("instances/h1", "mv_a").ltx_key(0, 2, 2)
    store.faults.fail_next("put", "lost_response", key=key2)
    with pytest.raises(StoreUnavailable):
        await rep.sync()
    assert rep.position == 1 and rep.pending
    landed = await store.get("replica-twin", key2)
    assert isinstance(landed, Got)
    app.execute("INSERT INTO t VALUES (3, x'03')")
    result = await rep.sync()
    assert result is not None and result.txid == 3 and rep.position == 3
    versions = [v for v in await store.list_versions("replica-twin", key2) if v.key == key2]
    assert len(versions) == 2, "the retry is a second PUT of the same key"
    bodies = {(await store.get("replica-twin", key2, version_id=v.version_id)).body  # type: ignore[union-attr]
              for v in versions}
    assert len(bodies) == 1, "the retry carries exactly the bytes of the first attempt"
    await rep.close()
    out = tmp_path / "restored.db"
    res = await restore_generation(store, "replica-twin", "instances/h1", "mv_a", out)
    assert res.txid == 3 and _rows(out) == [(1, b"\x01"), (2, b"\x02"), (3, b"\x03")]


async def test_a_late_upload_lands_only_in_its_own_generation(tmp_path: Path) -> None:
    """Spec §5.1 step 9: writer A dies with its [N + 1] upload in flight; writer B, admitted into a
    fresh generation, restores through N and uploads its own [N + 1]. A's upload lands late, in A's
    generation; B's generation restores B's writes exactly."""
    faults = Faults()
    store = MemoryStore(faults=faults)
    await store.create_bucket("replica-twin")
    loc = "instances/h2"
    db_a = tmp_path / "a.db"
    app_a = _app(db_a)
    app_a.execute("INSERT INTO t VALUES (1, x'aa')")
    rep_a = await Replicator.open(store, "replica-twin", loc, "gen_a", db_a, ManualClock())
    await rep_a.sync()
    app_a.execute("INSERT INTO t VALUES (2, x'a2')")
    faults.fail_next("put", "late")
    with pytest.raises(StoreUnavailable):
        await rep_a.sync()  # in flight when A "dies"
    await rep_a.close()
    # B restores A's generation (through TXID 1) into its own disk and opens a fresh generation
    db_b = tmp_path / "b.db"
    await restore_generation(store, "replica-twin", loc, "gen_a", db_b)
    app_b = _app(db_b)
    rep_b = await Replicator.open(store, "replica-twin", loc, "gen_b", db_b, ManualClock())
    assert rep_b.position == 0
    await rep_b.sync()  # the baseline [1, 1]
    app_b.execute("INSERT INTO t VALUES (2, x'b2')")
    await rep_b.sync()
    assert faults.pending_late == 1
    faults.complete_late()  # A's upload for [2, 2] finally lands
    a_keys = await store.list_keys("replica-twin", GenerationScope(loc, "gen_a").prefix)
    b_files = await list_generation(store, "replica-twin", GenerationScope(loc, "gen_b"))
    assert GenerationScope(loc, "gen_a").ltx_key(0, 2, 2) in a_keys
    assert [(x.level, x.min_txid, x.max_txid) for x in b_files] == [(0, 1, 1), (0, 2, 2)]
    out = tmp_path / "b-restored.db"
    await restore_generation(store, "replica-twin", loc, "gen_b", out)
    assert _rows(out) == [(1, b"\xaa"), (2, b"\xb2")]
    # and the writer itself refuses any key outside its generation
    with pytest.raises(GenerationViolation):
        await rep_b._put(GenerationScope(loc, "gen_a").ltx_key(0, 3, 3), b"x")
    await rep_b.close()


async def test_open_refuses_a_generation_whose_newest_level0_is_below_its_snapshot(tmp_path: Path) -> None:
    """Spec §5.1 step 7: without the anchor a writer would restart at TXID 1 below the snapshot."""
    store = MemoryStore()
    await store.create_bucket("replica-twin")
    scope = GenerationScope("instances/h3", "mv_b")
    await store.put("replica-twin", scope.ltx_key(9, 1, 7), b"snapshot bytes")
    with pytest.raises(ReplicaError, match=r"write the anchor \[7, 7\] first"):
        await Replicator.open(store, "replica-twin", "instances/h3", "mv_b", tmp_path / "x.db", ManualClock())


async def test_an_empty_database_uploads_nothing_and_a_non_wal_database_is_refused(tmp_path: Path) -> None:
    store = MemoryStore()
    await store.create_bucket("replica-twin")
    rep = await Replicator.open(store, "replica-twin", "instances/h4", "", tmp_path / "none.db", ManualClock())
    assert await rep.sync() is None, "no database yet: nothing to upload"
    await rep.close()
    plain = tmp_path / "plain.db"
    conn = sqlite3.connect(plain)
    conn.execute("CREATE TABLE t(x)")
    conn.commit()
    conn.close()
    rep = await Replicator.open(store, "replica-twin", "instances/h5", "", plain, ManualClock())
    with pytest.raises(ReplicaError, match="journal_mode=WAL"):
        await rep.sync()
    await rep.close()
    assert await store.list_keys("replica-twin", "instances/") == []
    empty = await restore_generation(store, "replica-twin", "instances/h5", "", tmp_path / "e.db")
    assert empty.empty and not (tmp_path / "e.db").exists()
    assert not os.path.exists(str(plain) + "-wal")


async def test_wal_restarts_it_cannot_prove_clean_are_shipped_full(tmp_path: Path) -> None:
    """A restart the writer did not see through (its read mark lost, then the application truncates
    the WAL or restarts it twice) may have taken unshipped frames with it: the next file is a full
    one and the restore is exact. A restart after its own checkpoint is followed incrementally."""
    store = MemoryStore()
    await store.create_bucket("replica-twin")
    db = tmp_path / "r.db"
    app = _app(db)
    app.execute("PRAGMA wal_autocheckpoint=0")
    rep = await Replicator.open(store, "replica-twin", "instances/h6", "", db, ManualClock())
    n = 0

    def write(count: int) -> None:
        nonlocal n
        for _ in range(count):
            n += 1
            app.execute("INSERT INTO t VALUES (?, ?)", (n, os.urandom(300)))

    write(20)
    first = await rep.sync()
    assert first is not None and first.full
    write(20)
    await rep.checkpoint()  # ships the 20 rows, then lets the WAL restart
    write(5)  # the first write after the checkpoint restarts the WAL
    nxt = await rep.sync()
    assert nxt is not None and not nxt.full and rep.stats.restarts_followed == 1 and rep.stats.resyncs == {}

    # the read mark is lost (as if another process had closed a descriptor of the -shm)
    await asyncio.to_thread(rep._end_reads)
    write(5)
    assert app.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()[0] == 0
    write(5)
    truncated = await rep.sync()
    assert truncated is not None and truncated.full and rep.stats.resyncs == {"wal-truncated": 1}

    await asyncio.to_thread(rep._end_reads)
    for _ in range(2):
        write(5)
        app.execute("PRAGMA wal_checkpoint(PASSIVE)")
    write(5)
    twice = await rep.sync()
    assert twice is not None and twice.full and rep.stats.resyncs.get("several-restarts") == 1
    write(3)
    assert not (await rep.sync()).full  # type: ignore[union-attr]
    await rep.close()
    out = tmp_path / "out.db"
    await restore_generation(store, "replica-twin", "instances/h6", "", out)
    assert _rows(out) == _rows(db) and len(_rows(out)) == n


async def test_truncate_checkpoint_then_the_next_change_ships_full(tmp_path: Path) -> None:
    """The final checkpoint of a stop empties the WAL; what follows cannot be proved to continue it,
    so the next file is full, and nothing is lost either way."""
    store = MemoryStore()
    await store.create_bucket("replica-twin")
    db = tmp_path / "t.db"
    app = _app(db)
    app.execute("INSERT INTO t VALUES (1, x'01')")
    rep = await Replicator.open(store, "replica-twin", "instances/h7", "", db, ManualClock())
    await rep.sync()
    app.execute("INSERT INTO t VALUES (2, x'02')")
    await rep.checkpoint("TRUNCATE")
    assert rep.position == 2 and os.path.getsize(str(db) + "-wal") == 0
    assert await rep.sync() is None, "nothing changed since the checkpoint"
    app.execute("INSERT INTO t VALUES (3, x'03')")
    after = await rep.sync()
    assert after is not None and after.full and after.txid == 3
    await rep.close()
    out = tmp_path / "o.db"
    await restore_generation(store, "replica-twin", "instances/h7", "", out)
    assert _rows(out) == [(1, b"\x01"), (2, b"\x02"), (3, b"\x03")]


async def test_the_sync_loop_compacts_snapshots_and_keeps_everything(tmp_path: Path) -> None:
    store = MemoryStore()
    await store.create_bucket("replica-twin")
    db = tmp_path / "l.db"
    app = _app(db)
    rep = await Replicator.open(store, "replica-twin", "instances/h8", "", db, ManualClock())
    stop = asyncio.Event()
    loop_task = asyncio.create_task(
        rep.run(stop, interval_s=0.005, compact_after=3, max_level=2, snapshot_ratio=0.5, checkpoint_every=4)
    )
    deadline = asyncio.get_running_loop().time() + 20
    i = 0
    while rep.stats.snapshots < 2 or rep.stats.compactions < 3:
        assert asyncio.get_running_loop().time() < deadline, rep.stats
        i += 1
        app.execute("INSERT INTO t VALUES (?, ?)", (i, os.urandom(200)))
        await asyncio.sleep(0.002)
    stop.set()
    await loop_task
    await rep.sync()
    assert rep.stats.retries == 0 and rep.stats.resyncs == {}
    files = await list_generation(store, "replica-twin", GenerationScope("instances/h8", ""))
    levels = {f.level for f in files}
    assert 0 in levels and levels & {1, 2} and len([f for f in files if f.level == 9]) == 1, levels
    await rep.close()
    out = tmp_path / "o.db"
    await restore_generation(store, "replica-twin", "instances/h8", "", out)
    assert _rows(out) == _rows(db) and len(_rows(out)) == i


async def test_the_ladder_keeps_climbing_after_a_level2_compaction(tmp_path: Path) -> None:
    """A level-2 compaction deletes the level-1 files; the next level-1 compaction starts above the level-2 file,
    not at the covered level-0 files the earlier ones left (a chain from there has a gap and merged nothing again)."""
    store = MemoryStore()
    await store.create_bucket("replica-twin")
    db = tmp_path / "ladder.db"
    app = _app(db)
    rep = await Replicator.open(store, "replica-twin", "instances/h9", "", db, ManualClock())
    for i in range(1, 82):
        app.execute("INSERT INTO t VALUES (?, ?)", (i, os.urandom(100)))
        await rep.sync()
        for level in (1, 2, 3):
            await rep.compact(level, min_inputs=3)
    files = await list_generation(store, "replica-twin", GenerationScope("instances/h9", ""))
    assert rep.stats.compactions == 27 + 9 + 3, rep.stats
    assert [(f.min_txid, f.max_txid) for f in files if f.level == 3] == [(1, 27), (28, 54), (55, 81)]
    await rep.close()
    out = tmp_path / "o.db"
    await restore_generation(store, "replica-twin", "instances/h9", "", out)
    assert _rows(out) == _rows(db) and len(_rows(out)) == 81
