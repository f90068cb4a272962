"""Replication and the restore contract on the real stack: SeaweedFS, real SQLite files, a real
writer process killed with SIGKILL (spec §5.1 steps 1 to 9; D§7).

One bucket for the module (SeaweedFS holds few buckets per stack); every test has its own location.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
import signal
import sqlite3
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import msgspec
import pytest
import pytest_asyncio

from hostmove.stackinfo import StackInfo
from kernel.ports import ManualClock
from services.box.replica import ltx
from services.box.replica.install import InstallError, build_generation, ensure_anchor, read_install
from services.box.replica.layout import FileRef, GenerationScope, list_generation
from services.box.replica.planner import PinnedRoot, Plan, Refusal, plan_restore
from services.box.replica.replicator import ReplicaError, Replicator
from services.box.replica.restore import RestoreRefused, restore_files, restore_generation
from services.objstore.port import Got
from services.objstore.s3 import S3Store

# ------------------------------------------------------------------------------------ the writer process

WRITER = r'''
import hashlib, sqlite3, sys, time

def payload(i):
    return hashlib.sha256(str(i).encode()).digest() * (1 + i % 40)

def step(conn, i):
    conn.execute("INSERT INTO t VALUES (?, ?)", (i, payload(i)))
    if i % 7 == 0:
        conn.execute("UPDATE t SET v = ? WHERE id = ?", (payload(i) + b"u", i // 2))
    if i % 13 == 0:
        conn.execute("DELETE FROM t WHERE id = ?", (i - 5,))

if __name__ == "__main__":
    conn = sqlite3.connect(sys.argv[1], isolation_level=None, timeout=30)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=NORMAL")
    conn.execute("CREATE TABLE IF NOT EXISTS t(id INTEGER PRIMARY KEY, v BLOB NOT NULL)")
    print("ready", flush=True)
    i = 0
    while True:
        i += 1
        conn.execute("BEGIN IMMEDIATE")
        step(conn, i)
        conn.execute("COMMIT")
        print(i, flush=True)
        time.sleep(0.0002)  # an application that pauses between transactions now and then
'''


def _payload(i: int) -> bytes:
    return hashlib.sha256(str(i).encode()).digest() * (1 + i % 40)


def expected_state(k: int) -> dict[int, bytes]:
    """The table after the writer's first ``k`` transactions (mirrors ``step``)."""
    state: dict[int, bytes] = {}
    for i in range(1, k + 1):
        state[i] = _payload(i)
        if i % 7 == 0 and i // 2 in state:
            state[i // 2] = _payload(i) + b"u"
        if i % 13 == 0:
            state.pop(i - 5, None)
    return state


def table(path: Path) -> dict[int, bytes]:
    conn = sqlite3.connect(path)
    try:
        return dict(conn.execute("SELECT id, v FROM t").fetchall())
    finally:
        conn.close()


def app_db(path: Path) -> sqlite3.Connection:
    conn = sqlite3.connect(path, isolation_level=None, timeout=30)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("CREATE TABLE IF NOT EXISTS t(id INTEGER PRIMARY KEY, v BLOB NOT NULL)")
    return conn


def write_rows(conn: sqlite3.Connection, start: int, count: int) -> None:
    for i in range(start, start + count):
        conn.execute("INSERT OR REPLACE INTO t VALUES (?, ?)", (i, _payload(i)))


# ------------------------------------------------------------------------------------ fixtures


@pytest_asyncio.fixture(loop_scope="session", scope="module")
async def s3(stack: StackInfo) -> AsyncIterator[S3Store]:
    store = await S3Store.open(stack.s3_endpoint, stack.s3_access_key, stack.s3_secret_key, stack.s3_region)
    yield store
    await store.close()


@pytest_asyncio.fixture(loop_scope="session", scope="module")
async def bucket(s3: S3Store, unique: Callable[..., str]) -> str:
    name = unique("replica")
    await s3.create_bucket(name)
    return name


@pytest.fixture
def location(unique: Callable[..., str]) -> str:
    return f"instances/{unique('host')}/{os.urandom(32).hex()}"


def spans(files: list[FileRef]) -> list[tuple[int, int, int]]:
    return [(f.level, f.min_txid, f.max_txid) for f in files]


# ------------------------------------------------------------------------------------ SIGKILL and disk loss


async def test_sigkill_disk_loss_cold_restore(s3: S3Store, bucket: str, location: str, tmp_path: Path) -> None:
    """Write, sync, SIGKILL the app, lose the disk, cold-restore elsewhere: every uploaded row is there.

    A real writer process commits row after row (inserts, updates, deletes; SQLite's own automatic
    checkpoints on) while the replicator syncs, compacts, snapshots and checkpoints. Transactions the
    writer acknowledged before a sync began are in that sync's upload, so the restore must hold at
    least those, exactly as the writer left them (the state after a prefix of its transactions).
    """
    disk = tmp_path / "disk"
    disk.mkdir()
    db = disk / "app.db"
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    proc = await asyncio.create_subprocess_exec(sys.executable, str(script), str(db), stdout=asyncio.subprocess.PIPE)
    assert proc.stdout is not None
    assert (await asyncio.wait_for(proc.stdout.readline(), 20)).strip() == b"ready"
    acked = 0

    async def follow() -> None:
        nonlocal acked
        assert proc.stdout is not None
        async for line in proc.stdout:
            acked = int(line)

    reader = asyncio.create_task(follow())
    rep = await Replicator.open(s3, bucket, location, "", db, ManualClock())
    guaranteed = 0
    try:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 4.0
        rounds = 0
        while loop.time() < deadline or rep.stats.restarts_followed < 1:
            assert loop.time() < deadline + 20, f"no WAL restart was followed: {rep.stats}"
            before = acked
            await rep.sync()
            guaranteed = before
            rounds += 1
            if rounds % 4 == 0:
                await rep.checkpoint()
            if rounds % 6 == 0:
                await rep.compact(1)
            if rounds == 10:
                await rep.snapshot()
            await asyncio.sleep(0.02)  # let the writer run between syncs
        os.kill(proc.pid, signal.SIGKILL)
        await proc.wait()
        await reader
        assert proc.returncode == -signal.SIGKILL
        assert guaranteed > 200, f"the writer barely wrote ({guaranteed} rows acknowledged)"
        assert rep.stats.incremental_syncs >= 8 and rep.stats.incremental_syncs > 3 * rep.stats.full_syncs, rep.stats

        # 1. cold restore of what the last sync before the kill uploaded
        first = tmp_path / "elsewhere-1" / "app.db"
        first.parent.mkdir()
        res = await restore_generation(s3, bucket, location, "", first)
        assert res.integrity_check == "ok" and res.txid == rep.position
        rows = table(first)
        k = max(rows)
        assert k >= guaranteed, f"acknowledged row {guaranteed} was uploaded but is missing (restored up to {k})"
        assert rows == expected_state(k), "the restore is not the state after a prefix of the writer's transactions"

        # 2. the replicator outlives the app: one more sync ships everything committed, then the disk goes
        await rep.sync()
        local = table(db)
        assert max(local) >= acked
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        await rep.close()
    shutil.rmtree(disk)
    second = tmp_path / "elsewhere-2" / "app.db"
    second.parent.mkdir()
    res = await restore_generation(s3, bucket, location, "", second)
    assert table(second) == local == expected_state(max(local))
    assert not list(second.parent.glob("*.restoring*")), "no temporary file is left behind"


# ------------------------------------------------------------------------------------ the restore contract


async def test_compacted_continuation_over_a_snapshot(s3: S3Store, bucket: str, location: str, tmp_path: Path) -> None:
    """Compaction leaves a level-1 file overlapping the snapshot ([3, 8] over [1, 5]); the planner
    takes it and the restore is exact. The newest level-0 file survives the compaction."""
    db = tmp_path / "a.db"
    app = app_db(db)
    rep = await Replicator.open(s3, bucket, location, "", db, ManualClock())
    n = 0
    for _ in range(2):
        write_rows(app, n + 1, 30)
        n += 30
        await rep.sync()
    assert (await rep.compact(1)) is not None  # [1, 2]
    for _ in range(3):
        write_rows(app, n + 1, 30)
        n += 30
        await rep.sync()
    snap = await rep.snapshot()
    assert snap is not None and snap.key.endswith("0009/0000000000000001-0000000000000005.ltx")
    for _ in range(3):
        app.execute("UPDATE t SET v = ? WHERE id % 5 = 0", (os.urandom(64),))
        write_rows(app, n + 1, 30)
        n += 30
        await rep.sync()
    newest_before = GenerationScope(location, "").ltx_key(0, 8, 8)
    versions_before = [v.version_id for v in await s3.list_versions(bucket, newest_before) if v.key == newest_before]
    result = await rep.compact(1)
    assert result is not None and (result.min_txid, result.max_txid) == (3, 8)
    await rep.close()
    files = await list_generation(s3, bucket, GenerationScope(location, ""))
    # [2, 2] was the newest level-0 file when [1, 2] was compacted; retention removes it later
    assert spans(files) == [(0, 2, 2), (0, 8, 8), (1, 1, 2), (1, 3, 8), (9, 1, 5)]
    versions_after = [v.version_id for v in await s3.list_versions(bucket, newest_before) if v.key == newest_before]
    assert versions_after == versions_before, "the newest level-0 file is kept by identity"
    p = plan_restore(files)
    assert isinstance(p, Plan) and spans(list(p.files)) == [(9, 1, 5), (1, 3, 8)]
    out = tmp_path / "r.db"
    res = await restore_generation(s3, bucket, location, "", out)
    assert res.txid == 8 and table(out) == table(db)


async def test_four_snapshot_rotations_and_retention(s3: S3Store, bucket: str, location: str, tmp_path: Path) -> None:
    """An installed generation rotates its snapshot four times under retention: the pinned snapshot
    and its continuation are gone, the root advances to the newest successor and every row is there;
    rooted at the pinned version alone the restore would be a gap (fact R5-3d). Retention keeps the
    newest level-0 file, expires level 1 below minSnapshotTXID, and a fresh writer continues at N + 1."""
    clock = ManualClock()
    src = tmp_path / "src.db"
    app = app_db(src)
    write_rows(app, 1, 50)
    origin = await Replicator.open(s3, bucket, location, "", src, clock)
    await origin.sync()
    await origin.close()
    built = tmp_path / "built.db"
    await restore_generation(s3, bucket, location, "", built, required_txid=1)
    manifest = await build_generation(s3, bucket, location, "mv_rot", "host-r", built, 1, clock)
    pinned = manifest.pinned_root()
    app = app_db(built)
    rep = await Replicator.open(s3, bucket, location, "mv_rot", built, clock)
    assert rep.position == 1
    scope = GenerationScope(location, "mv_rot")
    n = 50
    deleted_all: list[str] = []
    for rotation in range(4):
        for _ in range(3):
            write_rows(app, n + 1, 20)
            n += 20
            app.execute("DELETE FROM t WHERE id = ?", (n - 25,))
            await rep.sync()
            clock.advance(1000)
        await rep.compact(1, min_inputs=2)
        await rep.snapshot()
        retention = await rep.enforce_retention(keep_snapshots=1, l0_retention_ms=500)
        deleted_all += retention.deleted
        assert len(retention.kept_snapshots) == 1
        if rotation >= 1:
            assert retention.min_snapshot_txid > 0
    files = await list_generation(s3, bucket, scope)
    assert [f for f in files if f.level == 9] == [FileRef(9, 1, rep.position, scope.ltx_key(9, 1, rep.position))]
    assert pinned.key in deleted_all, "the pinned snapshot rotated away (it stays as a noncurrent version)"
    newest0 = max((f for f in files if f.level == 0), key=lambda f: f.max_txid)
    assert newest0.max_txid == rep.position, "the newest level-0 file survives retention"
    assert all(f.max_txid >= retention.min_snapshot_txid for f in files if 1 <= f.level <= 8)
    pinned_only = plan_restore([f for f in files if f.level != 9], pinned=pinned)
    assert isinstance(pinned_only, Refusal) and pinned_only.reason == "gap"
    await rep.close()
    shutil.rmtree(tmp_path / "src.db", ignore_errors=True)
    expected = table(built)
    out = tmp_path / "after-rotations.db"
    res = await restore_generation(s3, bucket, location, "mv_rot", out, pinned=pinned)
    assert not res.root_is_pinned and res.root_key == scope.ltx_key(9, 1, rep.position)
    assert table(out) == expected
    # a fresh writer on the restored disk reads its position from the newest level-0 file
    app2 = app_db(out)
    rep2 = await Replicator.open(s3, bucket, location, "mv_rot", out, clock)
    assert rep2.position == newest0.max_txid
    write_rows(app2, n + 1, 5)
    nxt = await rep2.sync()
    assert nxt is not None and nxt.txid == newest0.max_txid + 1 and nxt.full
    await rep2.close()


async def test_a_gap_is_refused_until_the_missing_file_lands(
    s3: S3Store, bucket: str, location: str, tmp_path: Path
) -> None:
    db = tmp_path / "g.db"
    app = app_db(db)
    rep = await Replicator.open(s3, bucket, location, "", db, ManualClock())
    for i in range(5):
        write_rows(app, 1 + i * 10, 10)
        await rep.sync()
    await rep.close()
    key3 = GenerationScope(location, "").ltx_key(0, 3, 3)
    held = await s3.get(bucket, key3)
    assert isinstance(held, Got)
    await s3.delete(bucket, key3)  # not landed (or lost): the listing has a hole
    out = tmp_path / "gap.db"
    with pytest.raises(RestoreRefused) as err:
        await restore_generation(s3, bucket, location, "", out)
    assert err.value.reason == "gap"
    assert "have up to 2 but next file starts at 4" in str(err.value)
    assert not out.exists() and not list(tmp_path.glob("gap.db*")), "a refused restore produces no database"
    await s3.put(bucket, key3, held.body)  # the object lands
    res = await restore_generation(s3, bucket, location, "", out)
    assert res.txid == 5 and table(out) == table(db)


async def test_a_corrupted_trailer_is_refused(s3: S3Store, bucket: str, location: str, tmp_path: Path) -> None:
    db = tmp_path / "c.db"
    app = app_db(db)
    rep = await Replicator.open(s3, bucket, location, "", db, ManualClock())
    for i in range(3):
        write_rows(app, 1 + i * 10, 10)
        await rep.sync()
    snap = await rep.snapshot()
    assert snap is not None
    write_rows(app, 100, 10)
    await rep.sync()
    await rep.close()
    scope = GenerationScope(location, "")
    key = scope.ltx_key(0, 4, 4)
    good = await s3.get(bucket, key)
    assert isinstance(good, Got)
    bad = bytearray(good.body)
    bad[-1] ^= 0x01  # the trailer itself
    await s3.put(bucket, key, bytes(bad))
    out = tmp_path / "corrupt.db"
    with pytest.raises(RestoreRefused) as err:
        await restore_generation(s3, bucket, location, "", out)
    assert err.value.reason == "checksum" and key in str(err.value) and "CRC-64 mismatch" in str(err.value)
    assert not out.exists()
    # a corrupted snapshot is not a verified root (§5.1 step 8): the plan is made again without it,
    # here through the level-0 files still below it; once those are gone, the restore refuses
    await s3.put(bucket, key, good.body)
    snap_body = await s3.get(bucket, snap.key)
    assert isinstance(snap_body, Got)
    broken = bytearray(snap_body.body)
    broken[len(broken) // 2] ^= 0xFF
    await s3.put(bucket, snap.key, bytes(broken))
    res = await restore_generation(s3, bucket, location, "", out)
    assert res.skipped_roots == (snap.key,) and res.root_key is None and res.txid == 4
    assert table(out) == table(db)
    for txid in (1, 2, 3):
        await s3.delete(bucket, scope.ltx_key(0, txid, txid))
    out2 = tmp_path / "corrupt-2.db"
    with pytest.raises(RestoreRefused) as err:
        await restore_generation(s3, bucket, location, "", out2)
    assert err.value.reason == "gap"
    assert snap.key in str(err.value) and "failed their CRC-64 check" in str(err.value)
    assert not out2.exists()


async def test_integrity_check_and_the_required_txid_fail_closed(
    s3: S3Store, bucket: str, location: str, tmp_path: Path
) -> None:
    """Files with valid trailers can still assemble a broken database: PRAGMA integrity_check refuses
    it; and a build requires exactly N (§5.1 step 5)."""
    scope = GenerationScope(location, "")
    junk = [(i, os.urandom(4096)) for i in range(1, 4)]
    header_page = bytearray(junk[0][1])
    header_page[:16] = b"SQLite format 3\x00"
    header_page[16:18] = (4096).to_bytes(2, "big")
    junk[0] = (1, bytes(header_page))
    body = ltx.encode(level=0, min_txid=1, max_txid=1, page_size=4096, commit=3, pages=junk, timestamp_ms=1,
                      full=True)
    await s3.put(bucket, scope.ltx_key(0, 1, 1), body)
    out = tmp_path / "junk.db"
    with pytest.raises(RestoreRefused) as err:
        await restore_generation(s3, bucket, location, "", out)
    assert err.value.reason == "integrity" and "integrity_check" in str(err.value)
    assert not out.exists()

    loc2 = location + "-b"
    db = tmp_path / "n.db"
    app = app_db(db)
    rep = await Replicator.open(s3, bucket, loc2, "", db, ManualClock())
    for i in range(3):
        write_rows(app, 1 + i * 5, 5)
        await rep.sync()
    await rep.close()
    with pytest.raises(RestoreRefused) as err:
        await restore_generation(s3, bucket, loc2, "", tmp_path / "n2.db", required_txid=2)
    assert err.value.reason == "wrong_txid" and "exactly 2 is required" in str(err.value)
    assert not (tmp_path / "n2.db").exists()


async def test_install_anchor_keeps_writes_after_the_install(
    s3: S3Store, bucket: str, location: str, tmp_path: Path
) -> None:
    """Transfer, build, serve, lose the disk: the writes made after the install are restored (§5.1
    steps 1, 2, 7). The build is two durable states and a replay writes identical bytes. Without the
    anchor the writer would restart at TXID 1 and a restore rooted at N would lose those writes
    (fact R5-1b): shown by bypassing the open's refusal."""
    clock = ManualClock()
    src = tmp_path / "src.db"
    app = app_db(src)
    staging = location + "/staging"
    rep = await Replicator.open(s3, bucket, staging, "", src, clock)
    for i in range(4):
        write_rows(app, 1 + i * 25, 25)
        await rep.sync()
    await rep.compact(1)
    await rep.close()
    n = rep.position
    # the seal: exact versions of every current file under the staged replica
    sealed = [
        FileRef(f.level, f.min_txid, f.max_txid, f.key, v.version_id)
        for f in await list_generation(s3, bucket, GenerationScope(staging, ""))
        for v in await s3.list_versions(bucket, f.key)
        if v.key == f.key and v.is_latest
    ]
    target = tmp_path / "target"
    target.mkdir()
    built = target / "app.db"
    res = await restore_files(s3, bucket, sealed, built, required_txid=n)
    assert res.txid == n and res.integrity_check == "ok"
    with pytest.raises(RestoreRefused):
        await restore_files(s3, bucket, sealed, tmp_path / "never.db", required_txid=n + 1)

    op = "mv_install01"
    scope = GenerationScope(location, op)
    # a crash after the intent: the replay must reuse the intent's inputs and write identical bytes
    clock.advance(5)
    first = await build_generation(s3, bucket, location, op, "host-i", built, n, clock)
    assert first.snapshot_txid == n and first.integrity_check == "ok" and first.db_sha256 == res.sha256
    assert first.snapshot_key == scope.ltx_key(9, 1, n) and first.anchor_key == scope.ltx_key(0, n, n)
    await s3.delete(bucket, scope.install_key)  # as if the crash came before install.json
    clock.advance(60_000)
    replay = await build_generation(s3, bucket, location, op, "host-i", built, n, clock)
    assert (replay.snapshot_version, replay.anchor_version, replay.snapshot_crc64, replay.anchor_crc64) == (
        first.snapshot_version, first.anchor_version, first.snapshot_crc64, first.anchor_crc64
    ), "the replay reused the acknowledged artifacts"
    for key in (first.snapshot_key, first.anchor_key):
        assert len([v for v in await s3.list_versions(bucket, key) if v.key == key]) == 1
    assert await read_install(s3, bucket, location, op) == replay
    # a replay offered another database than the intent recorded must not build
    other = tmp_path / "other.db"
    write_rows(app_db(other), 1, 3)
    await s3.delete(bucket, scope.install_key)
    with pytest.raises(InstallError, match="records a build of TXID"):
        await build_generation(s3, bucket, location, op, "host-i", other, n, clock)
    assert await read_install(s3, bucket, location, op) is None, "a refused replay completes nothing"
    again = await build_generation(s3, bucket, location, op, "host-i", built, n, clock)
    assert msgspec.structs.replace(again, built_at=replay.built_at) == replay

    # serve the installed database: replication continues at N + 1
    served = app_db(built)
    writer = await Replicator.open(s3, bucket, location, op, built, clock)
    assert writer.position == n
    write_rows(served, 1000, 40)
    up = await writer.sync()
    assert up is not None and up.txid == n + 1 and up.full
    write_rows(served, 2000, 10)
    await writer.sync()
    await writer.close()
    expected = table(built)
    served.close()
    shutil.rmtree(target)  # disk loss
    out = tmp_path / "after-loss.db"
    restored = await restore_generation(s3, bucket, location, op, out, pinned=replay.pinned_root())
    assert restored.txid == n + 2 and table(out) == expected and 1000 in table(out)

    # without the anchor: open refuses; a writer forced to start at 0 loses the post-install writes
    op2 = "mv_install02"
    target2 = tmp_path / "target2"
    target2.mkdir()
    built2 = target2 / "app.db"
    await restore_files(s3, bucket, sealed, built2, required_txid=n)
    m2 = await build_generation(s3, bucket, location, op2, "host-i", built2, n, clock)
    await s3.delete(bucket, m2.anchor_key)
    with pytest.raises(ReplicaError, match="write the anchor"):
        await Replicator.open(s3, bucket, location, op2, built2, clock)
    served2 = app_db(built2)
    naive = Replicator(s3, bucket, GenerationScope(location, op2), built2, clock, position=0)
    write_rows(served2, 1000, 40)
    assert (await naive.sync()).txid == 1  # type: ignore[union-attr]
    await naive.close()
    lost = tmp_path / "lost.db"
    await restore_generation(s3, bucket, location, op2, lost, pinned=m2.pinned_root())
    assert 1000 not in table(lost), "the anchor is what keeps post-install writes (fact R5-1b)"
    # the wake's anchor check repairs it: written once the restored TXID is above the newest level-0 file
    await s3.delete(bucket, GenerationScope(location, op2).ltx_key(0, 1, 1))
    anchor = await ensure_anchor(s3, bucket, location, op2, lost, n, clock)
    assert anchor == GenerationScope(location, op2).ltx_key(0, n, n)
    assert await ensure_anchor(s3, bucket, location, op2, lost, n, clock) is None
    assert (await Replicator.open(s3, bucket, location, op2, lost, clock)).position == n


def test_pinned_root_from_install_names_the_snapshot() -> None:
    from services.box.replica.install import InstallManifest

    m = InstallManifest(v=1, op="mv_x", host="h", snapshot_txid=7, snapshot_key="l/g-mv_x/0009/a.ltx",
                        snapshot_version="v9", snapshot_crc64="00000000000000ff", anchor_key="k", anchor_version="v0",
                        anchor_crc64="0000000000000001", integrity_check="ok", db_sha256="00", built_at=1)
    assert m.pinned_root() == PinnedRoot("l/g-mv_x/0009/a.ltx", "v9", 7, 255)


async def test_pinned_version_is_the_root_only_when_no_successor_is_current(
    s3: S3Store, bucket: str, location: str, tmp_path: Path
) -> None:
    """§5.1 step 4: with no current level-9 file the root is the pinned snapshot, opened by its
    version id; when that version is gone too, the restore refuses (no root)."""
    clock = ManualClock()
    src = tmp_path / "p.db"
    app = app_db(src)
    write_rows(app, 1, 40)
    rep = await Replicator.open(s3, bucket, location, "", src, clock)
    await rep.sync()
    await rep.close()
    built = tmp_path / "built.db"
    await restore_generation(s3, bucket, location, "", built, required_txid=1)
    manifest = await build_generation(s3, bucket, location, "mv_pin", "host-p", built, 1, clock)
    await s3.delete(bucket, manifest.snapshot_key)  # a delete marker: the version stays, noncurrent
    out = tmp_path / "pinned.db"
    res = await restore_generation(s3, bucket, location, "mv_pin", out, pinned=manifest.pinned_root())
    assert res.root_is_pinned and res.txid == 1 and table(out) == table(src)
    await s3.delete(bucket, manifest.snapshot_key, version_id=manifest.snapshot_version)
    with pytest.raises(RestoreRefused) as err:
        await restore_generation(s3, bucket, location, "mv_pin", tmp_path / "none.db", pinned=manifest.pinned_root())
    assert err.value.reason == "no_root" and manifest.snapshot_version in str(err.value)


async def test_an_idle_sync_loop_lists_nothing_and_compacts_after_an_upload(tmp_path: Path) -> None:
    """Only the writer adds files to its generation: a round that uploaded nothing has nothing to merge, so the loop
    lists the generation for its compactions only after an upload (and in its first round)."""
    from services.objstore.memory import MemoryStore

    store, bucket = MemoryStore(), "replica-memory"
    await store.create_bucket(bucket)
    db = tmp_path / "a.db"
    app = app_db(db)
    write_rows(app, 1, 10)
    location = f"instances/idle.example/{'ab' * 32}"
    rep = await Replicator.open(store, bucket, location, "", db, ManualClock())
    stop = asyncio.Event()
    loop = asyncio.ensure_future(rep.run(stop, interval_s=0.01, compact_after=2))
    await asyncio.sleep(0.2)
    listed = store.faults.calls["list_keys"]
    await asyncio.sleep(0.2)  # idle rounds
    assert store.faults.calls["list_keys"] == listed, "an idle round lists nothing"
    write_rows(app, 11, 10)
    await asyncio.sleep(0.2)
    assert store.faults.calls["list_keys"] > listed
    assert any(f.level == 1 for f in await list_generation(store, bucket, GenerationScope(location, ""))), (
        "the upload's round compacted the two level-0 files")
    stop.set()
    await loop
    await rep.close()


# ------------------------------------------------------------------------------------ storage bounded by the data


async def _stored(store: S3Store, bucket: str, scope: GenerationScope) -> tuple[int, int, int]:
    """Every version under the generation's prefix: (versions and delete markers, their bytes, not current)."""
    versions = await store.list_versions(bucket, scope.prefix)
    stale = sum(1 for v in versions if not v.is_latest or v.is_delete_marker)
    return len(versions), sum(v.size for v in versions), stale


async def test_a_long_session_stores_a_bounded_replica(s3: S3Store, bucket: str, location: str, tmp_path: Path) -> None:
    """Issue 16 (§5.1 step 8): one writer session syncing for a long time with the loop's defaults keeps a number of
    versions and bytes bounded by the database, not by its history: the loop snapshots and applies retention, and
    its deletes remove its own uploads by exact version, so nothing noncurrent is left. Every row restores after the
    many snapshots and retentions."""
    db = tmp_path / "long.db"
    app = app_db(db)
    rows = 48
    for i in range(rows):
        app.execute("INSERT INTO t VALUES (?, ?)", (i, os.urandom(700)))
    rep = await Replicator.open(s3, bucket, location, "", db, ManualClock())
    scope = GenerationScope(location, "")
    stop = asyncio.Event()
    task = asyncio.create_task(rep.run(stop, interval_s=0.0))
    loop = asyncio.get_running_loop()
    seen: dict[int, tuple[int, int, int]] = {}
    try:
        for n in range(1, 301):
            app.execute("UPDATE t SET v = ? WHERE id = ?", (os.urandom(700), n % rows))
            target = rep.position + 1
            deadline = loop.time() + 20
            while rep.position < target:  # one sync per write
                assert loop.time() < deadline and not task.done(), rep.stats
                await asyncio.sleep(0.002)
            if n in (100, 200, 300):
                seen[n] = await _stored(s3, bucket, scope)
    finally:
        stop.set()
        await task
    db_bytes = app.execute("PRAGMA page_count").fetchone()[0] * app.execute("PRAGMA page_size").fetchone()[0]
    figures = f"(versions, bytes, not current) after N syncs: {seen}; database {db_bytes} bytes; {rep.stats}"
    assert rep.stats.retries == 0 and rep.stats.snapshots >= 3, figures
    for count, size, stale in seen.values():
        assert stale == 0, f"a deleted upload left a noncurrent version or a delete marker: {figures}"
        assert count <= 24, f"the replica's files grow with the session's history: {figures}"
        assert size <= 5 * db_bytes, f"the replica's bytes grow with the session's history: {figures}"
    files = await list_generation(s3, bucket, scope)
    assert max((f for f in files if f.level == 0), key=lambda f: f.max_txid).max_txid == rep.position, (
        "the newest level-0 file survives every retention")
    expected = table(db)
    await rep.close()
    out = tmp_path / "restored.db"
    res = await restore_generation(s3, bucket, location, "", out)
    assert res.txid == rep.position and res.integrity_check == "ok"
    assert table(out) == expected and len(expected) == rows


async def test_held_snapshots_wait_for_the_release(s3: S3Store, bucket: str, location: str, tmp_path: Path) -> None:
    """§7.3 rounds, issue 16: while a move stages the generation (``snapshots_held``), the loop writes no snapshot
    however much history its uploads carried, so the cut's final mirror copies only what the last round had not;
    released, the next round snapshots the history held back and retention bounds it again."""
    db = tmp_path / "held.db"
    app = app_db(db)
    for i in range(8):
        app.execute("INSERT INTO t VALUES (?, ?)", (i, os.urandom(700)))
    rep = await Replicator.open(s3, bucket, location, "", db, ManualClock())
    rep.snapshots_held = True
    stop = asyncio.Event()
    task = asyncio.create_task(rep.run(stop, interval_s=0.0, snapshot_ratio=0.5))
    loop = asyncio.get_running_loop()
    try:
        for n in range(1, 41):
            app.execute("UPDATE t SET v = ? WHERE id = ?", (os.urandom(700), n % 8))
            target, deadline = rep.position + 1, loop.time() + 20
            while rep.position < target:  # one sync per write
                assert loop.time() < deadline and not task.done(), rep.stats
                await asyncio.sleep(0.002)
        assert rep.stats.snapshots == 0, f"a snapshot while held: {rep.stats}"
        rep.snapshots_held = False
        deadline = loop.time() + 20
        while rep.stats.snapshots == 0:
            assert loop.time() < deadline and not task.done(), f"no snapshot after the release: {rep.stats}"
            await asyncio.sleep(0.01)
    finally:
        stop.set()
        await task
    files = await list_generation(s3, bucket, GenerationScope(location, ""))
    assert sum(1 for f in files if f.level == ltx.SNAPSHOT_LEVEL) == 1, files
    await rep.close()
