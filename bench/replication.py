"""Replication and restore throughput against raw PUT and GET of the same store, in the same run
(spec §5.1; issue "replication" bench).

A private stack (SeaweedFS) is started. A SQLite database in WAL mode takes rounds of writes (rows
of half random, half text-like bytes, about 1.6x compressible, with updates of earlier rows), and
after each round the replicator's ``sync`` ships the changed pages as one level-0 file. Then a
compaction and a snapshot, and a cold restore of the generation into a fresh directory (planner,
GETs, CRC-64 checks, page writes, fsync, ``PRAGMA integrity_check``, sha256).

- replicated bytes/s = changed-page bytes captured by the syncs / the syncs' wall time;
- raw PUT bytes/s = the same page bytes, PUT as objects of the same sizes / their wall time;
- restored bytes/s = the restored database's bytes / the restore's wall time (a wake's restore,
  without fsync: its database is never reused across a crash, spec §5.1 step 9, R9-1);
- raw GET bytes/s = as many bytes, GET as many objects as the restore reads / their wall time.

Both ratios (replicated/raw PUT, restored/raw GET) print; the last line is
``RESULT replication ratio=<min of the two> target=0.5`` and the exit status is 1 below the target.
Best of interleaved rounds on each side, so drift in machine load hits both.
"""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import sqlite3
import sys
import tempfile
import time
from pathlib import Path

from bench.common import private_stack, result
from kernel.ports import WallClock
from services.box.replica.layout import GenerationScope, list_generation
from services.box.replica.planner import Plan, plan_restore
from services.box.replica.replicator import Replicator
from services.box.replica.restore import restore_generation
from services.objstore.port import Got
from services.objstore.s3 import S3Store

TARGET = 0.5
MIB = 1 << 20
ROUNDS = 12
ROUND_BYTES = 6 * MIB
ROW = 2000
ROUNDS_RESTORE = 5
DURABLE = False
"""A wake's restore: its database is never reused across a crash (spec §5.1 step 9, R9-1)."""
WORDS = (
    b"move host region cut seal park claim record holder stamp scope horizon obligation lease session "
    b"generation snapshot anchor marker replica archive manifest digest landing probe rollback commit"
).split()


def _row(rng: random.Random) -> bytes:
    text = b" ".join(rng.choice(WORDS) for _ in range(ROW // 12))[: ROW // 2]
    return rng.randbytes(ROW - len(text)) + text


def _write_round(conn: sqlite3.Connection, rng: random.Random, start: int) -> int:
    rows = ROUND_BYTES // ROW
    conn.execute("BEGIN")
    for i in range(start, start + rows):
        conn.execute("INSERT INTO t VALUES (?, ?)", (i, _row(rng)))
        if i % 10 == 0 and i > 100:
            conn.execute("UPDATE t SET v = ? WHERE id = ?", (_row(rng), rng.randrange(1, i)))
    conn.execute("COMMIT")
    return start + rows


async def _raw_put(store: S3Store, bucket: str, sizes: list[int], blob: bytes, tag: str) -> float:
    total = 0
    t0 = time.perf_counter()
    for i, size in enumerate(sizes):
        await store.put(bucket, f"raw/{tag}/{i}", blob[:size])
        total += size
    return total / (time.perf_counter() - t0)


async def _raw_get(store: S3Store, bucket: str, keys: list[str]) -> float:
    total = 0
    t0 = time.perf_counter()
    for key in keys:
        got = await store.get(bucket, key)
        assert isinstance(got, Got)
        total += len(got.body)
    return total / (time.perf_counter() - t0)


async def measure() -> tuple[float, float]:
    with private_stack() as info, tempfile.TemporaryDirectory(prefix="hostmove-bench-repl-") as tmp:
        store = await S3Store.open(info.s3_endpoint, info.s3_access_key, info.s3_secret_key, info.s3_region)
        try:
            bucket = "bench-replication"
            await store.create_bucket(bucket)
            rng = random.Random(1)
            db = Path(tmp) / "app.db"
            app = sqlite3.connect(db, isolation_level=None)
            app.execute("PRAGMA journal_mode=WAL")
            app.execute("PRAGMA synchronous=NORMAL")
            app.execute("CREATE TABLE t(id INTEGER PRIMARY KEY, v BLOB NOT NULL)")
            location = "instances/bench/" + "b" * 64
            rep = await Replicator.open(store, bucket, location, "", db, WallClock())
            nxt = _write_round(app, rng, 1)
            await rep.sync()  # the full first file, not timed: the steady state is incremental
            blob = os.urandom(64 * MIB)
            await _raw_put(store, bucket, [MIB] * 4, blob, "warm")
            repl_rates: list[float] = []
            put_rates: list[float] = []
            for r in range(ROUNDS):
                nxt = _write_round(app, rng, nxt)
                t0 = time.perf_counter()
                up = await rep.sync()
                dt = time.perf_counter() - t0
                assert up is not None and not up.full
                repl_rates.append(up.page_bytes / dt)
                put_rates.append(await _raw_put(store, bucket, [up.page_bytes], blob, f"r{r}"))
                if r % 4 == 3:
                    await rep.checkpoint()
            await rep.compact(1)
            await rep.snapshot()
            await rep.close()
            app.close()
            print(f"replica: {rep.position} files, stats {rep.stats}")
            # raw GET objects: as many as the restore plan reads, the same logical bytes in total
            files = await list_generation(store, bucket, GenerationScope(location, ""))
            plan = plan_restore(files)
            assert isinstance(plan, Plan)
            pages = [(f.max_txid - f.min_txid + 1) for f in plan.files]
            db_bytes = os.path.getsize(db)
            raw_keys = []
            for i, share in enumerate(pages):
                size = max(1, db_bytes * share // sum(pages))
                await store.put(bucket, f"rawget/{i}", os.urandom(size))
                raw_keys.append(f"rawget/{i}")
            restore_rates: list[float] = []
            get_rates: list[float] = []
            for r in range(ROUNDS_RESTORE):
                get_rates.append(await _raw_get(store, bucket, raw_keys))
                out = Path(tmp) / f"restored-{r}" / "app.db"
                out.parent.mkdir()
                t0 = time.perf_counter()
                res = await restore_generation(store, bucket, location, "", out, durable=DURABLE)
                restore_rates.append(res.db_bytes / (time.perf_counter() - t0))
                shutil.rmtree(out.parent)  # each round starts from the same free page cache
            assert res.integrity_check == "ok"
            mb = 1e6
            repl, put = max(repl_rates), max(put_rates)
            rest, get = max(restore_rates), max(get_rates)
            print(f"replicated {repl / mb:.1f} MB/s vs raw PUT {put / mb:.1f} MB/s: ratio {repl / put:.3f}")
            print(f"restored {rest / mb:.1f} MB/s vs raw GET {get / mb:.1f} MB/s: ratio {rest / get:.3f} "
                  f"(database {res.db_bytes / mb:.1f} MB from {len(res.files)} files)")
            return repl / put, rest / get
        finally:
            await store.close()


def main() -> int:
    put_ratio, get_ratio = asyncio.run(measure())
    ratio = min(put_ratio, get_ratio)
    print(result("replication", ratio, TARGET))
    return 0 if ratio >= TARGET else 1


if __name__ == "__main__":
    sys.exit(main())
