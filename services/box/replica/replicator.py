"""The replicator: one writer session's uploads into one generation (spec §5.1 steps 1, 7, 8, 9).

**Binding.** A :class:`Replicator` is constructed for ``(location, generation)`` and never re-reads
it; every key it PUTs or deletes passes :meth:`GenerationScope.check_owned`, so a late upload can
only land in its own generation (§5.1 step 9, "Writers are bound to their generation").

**Position.** :meth:`Replicator.open` reads the position from the newest current level-0 file
(§5.1 step 7, R6-1), never from a snapshot or the local database. Each sync uploads one level-0
file ``[position + 1, position + 1]``: a TXID is one sync. A failed upload is retried with the
same bytes before anything new is captured (step 6: Litestream does not advance past a failed
upload). The first upload of a replicator instance is a **full** file (every page): the local WAL
cannot be proved to continue the remote (fact R5-1c), and a fresh generation's first file is the
baseline's full ``[1, 1]`` (§5.1 step 9).

**Change capture, proportional to the pages that changed.** A sync reads only the WAL frames
committed since the last sync: ``(shipped, mxFrame]`` of the current WAL epoch, where ``mxFrame``
comes from the wal-index header (``-shm``), which is what SQLite itself treats as committed
(frames beyond it may be an open transaction or a dead writer's leftovers). The frames' salts must
be the epoch's and the WAL header must be unchanged after the read (an overwrite of frames always
starts with a new header), else the read is repeated. The latest image of each page goes into the
file; pages beyond the final database size are dropped, and pages a truncation inside the range
left unwritten are written as zeros (what SQLite reads there).

**Not losing frames to checkpoints.** Frames are lost to the replicator only when the WAL
*restarts* (a writer begins again at frame 1 once everything was checkpointed). A reader holding
a WAL read-mark slot makes a restart impossible (``walRestartLog``), so the replicator keeps a read
transaction open between syncs, on one of two connections: it opens the new one before closing
the old, so the old mark keeps the checkpointers behind and the new one gets a slot too (Litestream
holds a read transaction the same way). Checkpoints by the application still copy pages into the
database file, which loses nothing. :meth:`Replicator.checkpoint` lets the WAL restart: under the
write lock (``BEGIN IMMEDIATE``, bounded wait, skipped when the application never lets go) it
captures every committed frame, drops its read marks and runs ``PRAGMA wal_checkpoint(PASSIVE)``.

A sync that finds a new epoch accepts it only when it can **prove** nothing was lost: salt-1 grew
by exactly one (one restart; SQLite adds one per restart), the WAL file is not smaller than it has
been (no truncation), the new epoch has not reached the slot after the shipped position, and that
slot does not hold a valid continuation of the old epoch (checked with SQLite's cumulative frame
checksum from the last shipped frame). Anything else (several restarts, truncation, an ambiguous
slot) makes the next file a **full** one, read from a consistent snapshot. A full file is always
correct; it costs the size of the database, so it is the fallback, not the path.

**Descriptors.** POSIX record locks belong to the process: closing *any* descriptor of a file drops
every lock the process holds on it, SQLite's included. The replicator opens the ``-shm`` and
``-wal`` files once, after its own connections, reads them with ``pread`` and closes them only after
those connections; it never opens the database file itself. It must not share its process with a
SQLite connection to the same database that outlives it.

**Consistent images** (the first file, a resync, a snapshot) come from ``serialize()`` inside a read
transaction whose snapshot is a known WAL position: the wal-index read just before and just after
the ``BEGIN`` agree on the epoch and ``mxFrame`` (lock-free, retried); under a writer that never
pauses, the write lock pins it instead.

**Compaction, snapshots, retention** (§5.1 step 8): :meth:`compact` merges a contiguous run of
level ``L-1`` files into one level-``L`` file ``[min, max]`` holding the latest image of each page
and deletes the inputs, bar the newest level-0 file; :meth:`snapshot` writes ``[1, position]`` at
level 9; :meth:`enforce_retention` keeps the newest snapshots, expires level 1..8 below
``minSnapshotTXID`` and covered level-0 files by age, never the newest level-0 file, and refuses to
delete anything whose removal would stop the generation restoring to the same TXID.

**Storage bounded by the data, not its history** (issue 16). :meth:`run` writes a snapshot once the
pages its incremental uploads carried since the last one weigh ``snapshot_ratio`` times the database,
and runs retention after each snapshot and each level-1 compaction, so a session that never ends keeps
about one snapshot, the ladder since the one before it and the newest level-0 file. A delete of a file
this session uploaded, whose PUT was answered on its only attempt, removes that **exact version**
(no noncurrent version, no delete marker); any other key (an uncertain one, :mod:`.uploads`, whose
delete marker is the evidence a listing settles it by; a file of an earlier session or of the install,
whose versions the park retires and whose pinned version the sweep protects, §6.4) gets a bare delete.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sqlite3
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kernel.logctx import ctx
from kernel.ports import Clock, blocking
from services.box.replica import ltx, wal
from services.box.replica.layout import FileRef, GenerationScope, list_generation
from services.box.replica.planner import Plan, extend_chain, newest_level0, plan_restore, replication_position
from services.box.replica.uploads import Uploads, body_etag
from services.objstore.port import Got, Lost, ObjectStore

log = logging.getLogger("hostmove.replica")

_U32 = 0x100000000


class ReplicaError(Exception):
    """The replicator cannot do what was asked, for a reason an operator can act on."""


class _NeedResync(Exception):
    """The WAL cannot be followed exactly from the shipped position: the next file must be full."""


@dataclass(frozen=True)
class ReplicaOptions:
    compress: bool = True
    busy_timeout_ms: int = 5000
    cache_bytes: int = 64 << 20
    """Uploaded files kept in memory for compaction (saves the GETs)."""
    capture_attempts: int = 5
    pin_attempts: int = 200
    checkpoint_wait_ms: int = 1000
    """How long a checkpoint waits for the write lock before it is skipped (retried later)."""
    flush_first: bool = False
    cover: tuple[int, int] | None = None
    """The first full file covers this TXID range as well as the next one, ``[min(cover), max(position, max(cover)) +
    1]`` at level 0: a dead writer's uploads of that range whose outcome is unknown can then land at their own keys
    without replacing anything the restore takes (it prefers the file reaching the higher TXID; §5.1 step 4)."""
    """Upload the first full image even when nothing changed since this replicator opened: a final checkpoint
    on behalf of a writer process that is gone (§5.3 step 5), whose commits came before the open."""


@dataclass(frozen=True)
class SyncResult:
    txid: int
    key: str
    version_id: str | None
    pages: int
    page_bytes: int
    file_bytes: int
    full: bool


@dataclass(frozen=True)
class CompactResult:
    level: int
    key: str
    min_txid: int
    max_txid: int
    inputs: tuple[str, ...]
    deleted: tuple[str, ...]
    pages: int


@dataclass(frozen=True)
class RetentionResult:
    deleted: tuple[str, ...]
    min_snapshot_txid: int
    kept_snapshots: tuple[str, ...]


@dataclass
class ReplicaStats:
    syncs: int = 0
    full_syncs: int = 0
    incremental_syncs: int = 0
    restarts_followed: int = 0
    resyncs: dict[str, int] = field(default_factory=dict)
    checkpoints: int = 0
    checkpoints_skipped: int = 0
    compactions: int = 0
    snapshots: int = 0
    retries: int = 0

    def resync(self, reason: str) -> None:
        self.resyncs[reason] = self.resyncs.get(reason, 0) + 1


@dataclass(frozen=True)
class _Epoch:
    salts: bytes
    offset: int  # frames of this epoch already shipped
    checksum: tuple[int, int] | None  # cumulative WAL checksum at ``offset`` (None: unknown)
    big_endian: bool

    @property
    def salt1(self) -> int:
        return int.from_bytes(self.salts[:4], "big")


@dataclass(frozen=True)
class _Pending:
    txid: int
    key: str
    body: bytes
    epoch: _Epoch | None
    commit: int
    page_size: int
    pages: int
    full: bool


@dataclass(frozen=True)
class _Image:
    """A consistent database image and the WAL position it corresponds to."""

    data: bytes
    page_size: int
    epoch: _Epoch | None


class Replicator:
    """Replicates one SQLite database (WAL mode) into one generation of one location."""

    def __init__(
        self,
        store: ObjectStore,
        bucket: str,
        scope: GenerationScope,
        db_path: str | os.PathLike[str],
        clock: Clock,
        *,
        position: int,
        options: ReplicaOptions | None = None,
        host: str | None = None,
    ) -> None:
        self.store = store
        self.bucket = bucket
        self.scope = scope
        # the context of its log lines (kernel.logctx): the host when the caller names it, and where it writes
        self.log_fields = ctx(host=host, phase="replica", location=scope.location, generation=scope.generation,
                              db=Path(db_path).name)
        self.db_path = Path(db_path)
        self.clock = clock
        self.options = options or ReplicaOptions()
        self.stats = ReplicaStats()
        self._pos = position
        self._commit = 0
        self._page_size = 0
        self._epoch: _Epoch | None = None
        self._need_full = True
        self._max_wal_size = 0  # the largest WAL file seen: a smaller one was truncated
        self._protected = False  # our read mark provably holds a WAL slot (restarts impossible)
        self._pending: _Pending | None = None
        self._baseline: tuple[bytes, int] | None = None
        self._readers: list[sqlite3.Connection] = []
        self._writer: sqlite3.Connection | None = None
        self._shm_fd: int | None = None
        self._wal_fd: int | None = None
        self._active: int | None = None
        self._mark: tuple[bytes, int] | None = None
        self._lock = asyncio.Lock()
        self._cache: OrderedDict[str, bytes] = OrderedDict()
        self._cache_size = 0
        self._uploaded_at: dict[str, int] = {}
        self._versions: dict[str, str] = {}
        """Keys this session PUT, settled on their only attempt -> the version id: deleted by that exact version."""
        self._history_bytes = 0
        """Page bytes the incremental level-0 uploads carried since this session's last snapshot (:meth:`run`)."""
        self.snapshots_held = False
        """While a move stages this generation (§7.3 rounds), :meth:`run` writes no snapshot: the rounds mirror the
        history as it grows, and a database-sized snapshot after the last round would be the cut's to copy. The box
        agent sets it from the claim on every pass (:meth:`Instances.hold_snapshots`); it lasts at most a move."""
        self._closed = False
        self.uploads = Uploads.open(self.db_path, scope.generation)
        self._covered = False
        """The session's uncertain uploads (:mod:`.uploads`): durable, sticky until a listing observes them settled."""

    # ------------------------------------------------------------------------------------ open

    @classmethod
    async def open(
        cls,
        store: ObjectStore,
        bucket: str,
        location: str,
        generation: str,
        db_path: str | os.PathLike[str],
        clock: Clock,
        *,
        options: ReplicaOptions | None = None,
    ) -> Replicator:
        """Bind a writer to ``(location, generation)``; its position is the newest current level-0
        file's max TXID (§5.1 step 7), refused when another level already holds more."""
        scope = GenerationScope(location, generation)
        files = await list_generation(store, bucket, scope)
        position = replication_position(files)
        top = max((f.max_txid for f in files), default=0)
        if top > position:
            raise ReplicaError(
                f"generation {scope.prefix!r} holds files up to TXID {top} but its newest level-0 file ends at "
                f"{position}: replication would restart below the replica's state; write the anchor [{top}, {top}] "
                "first (spec §5.1 step 7)"
            )
        rep = cls(store, bucket, scope, db_path, clock, position=position, options=options)
        with contextlib.suppress(ReplicaError):  # not in WAL mode yet: sync says so until it is
            await blocking(rep._ensure_connections)
        return rep

    @property
    def position(self) -> int:
        """The TXID of the last acknowledged upload."""
        return self._pos

    @property
    def pending(self) -> bool:
        return self._pending is not None

    async def close(self) -> None:
        async with self._lock:
            self._closed = True
            await blocking(self._close_connections)

    # ------------------------------------------------------------------------------------ sync

    async def sync(self) -> SyncResult | None:
        """Upload every transaction committed before the call (SyncAndWait): first a pending file
        from an earlier failed attempt (same bytes), then the frames committed since.

        Returns the last upload, or ``None`` when nothing changed. A store failure propagates and
        leaves the file pending; the position only moves on an acknowledged PUT.
        """
        async with self._lock:
            self._check_open()
            result: SyncResult | None = None
            if self._pending is not None:
                result = await self._upload_pending()
            pending = await blocking(self._capture_changes)
            if pending is not None:
                self._pending = pending
                result = await self._upload_pending()
            return result

    async def checkpoint(self, mode: str = "PASSIVE") -> None:
        """Let SQLite checkpoint and the WAL restart without losing a frame (module docstring).

        ``PASSIVE`` is for a running application. ``TRUNCATE`` is for a stopped one (the final
        checkpoint of a stop, spec §7.4): the WAL file is emptied, and since frames an application
        might commit meanwhile cannot be told apart afterwards, the next change is shipped full.
        """
        mode = mode.upper()
        if mode not in ("PASSIVE", "TRUNCATE"):
            raise ValueError("checkpoint mode must be PASSIVE or TRUNCATE")
        async with self._lock:
            self._check_open()
            if self._pending is not None:
                await self._upload_pending()
            pending = await blocking(self._checkpoint_locked, mode)
            if pending is not None:
                self._pending = pending
                await self._upload_pending()
            self.stats.checkpoints += 1

    # ------------------------------------------------------------------------------------ compaction

    async def compact(self, level: int, *, min_inputs: int = 2) -> CompactResult | None:
        """Merge the current level ``level - 1`` files above the newest level-``level`` file into one
        level-``level`` file (§5.1 step 8). Inputs must chain without a gap; a gap stops the run
        (a merged file across a missing one would claim a state it does not hold)."""
        if not 1 <= level <= 8:
            raise ValueError("compaction writes levels 1 to 8; level 9 is the snapshot")
        async with self._lock:
            self._check_open()
            files = await list_generation(self.store, self.bucket, self.scope)
            # above every file of this level or higher: a level-(L+1) compaction deletes its level-L inputs, and
            # a floor of this level alone would fall back under the covered level-0 files they left (a gap)
            floor = max((f.max_txid for f in files if level <= f.level <= 8), default=0)
            inputs = sorted(
                (f for f in files if f.level == level - 1 and f.max_txid > floor),
                key=lambda f: (f.min_txid, f.max_txid),
            )
            if not inputs:
                return None
            chain, end = extend_chain(inputs[0].min_txid - 1, inputs)
            if len(chain) < min_inputs:
                return None
            bodies = [await self._read_file(f) for f in chain]
            body, pages = await blocking(self._merge, level, chain[0].min_txid, end, bodies)
            key = self.scope.ltx_key(level, chain[0].min_txid, end)
            await self._put(key, body)
            newest = newest_level0(files)
            deleted = []
            for f in chain:
                if f.level == 0 and newest is not None and f.key == newest.key:
                    continue  # the newest level-0 file survives every path (§5.1 step 8, R7-3)
                await self._delete(f.key)
                deleted.append(f.key)
            self.stats.compactions += 1
            log.info("replica compaction into %s: %d inputs, %d deleted", key, len(chain), len(deleted),
                     extra={**self.log_fields, "key": key, "inputs": len(chain), "deleted": len(deleted)})
            return CompactResult(level, key, chain[0].min_txid, end, tuple(f.key for f in chain), tuple(deleted), pages)

    def _merge(self, level: int, min_txid: int, max_txid: int, bodies: Sequence[bytes]) -> tuple[bytes, int]:
        merged: dict[int, bytes | memoryview] = {}
        page_size = 0
        commit = 0
        min_commit: int | None = None
        full = False
        for data in bodies:
            header = ltx.verify(data)
            if page_size and header.page_size != page_size:
                raise ReplicaError(f"cannot compact files with page sizes {page_size} and {header.page_size}")
            page_size = header.page_size
            numbers, images = ltx.page_block(header, data)
            for i, pgno in enumerate(numbers):
                merged[pgno] = images[i * page_size : (i + 1) * page_size]
            commit = header.commit
            min_commit = commit if min_commit is None else min(min_commit, commit)
            for pgno in [p for p in merged if p > commit]:
                del merged[pgno]
            full = full or header.full
        if not full and min_commit is not None and min_commit < commit:
            zero = bytes(page_size)
            for pgno in range(min_commit + 1, commit + 1):
                merged.setdefault(pgno, zero)
        body = ltx.encode(
            level=level, min_txid=min_txid, max_txid=max_txid, page_size=page_size, commit=commit,
            pages=merged.items(), timestamp_ms=self.clock.now_ms(), full=full, compress=self.options.compress,
        )
        return body, len(merged)

    # ------------------------------------------------------------------------------------ snapshots

    async def snapshot(self) -> SyncResult | None:
        """Ship what is committed, then write the snapshot ``[1, position]`` (level 9) from a
        consistent image at exactly that position (§5.1 step 8)."""
        async with self._lock:
            self._check_open()
            if self._pending is not None:
                await self._upload_pending()
            delta, image = await blocking(self._capture_with_image)
            if delta is not None:
                self._pending = delta
                await self._upload_pending()
            if self._pos == 0 or image is None or not image.data:
                return None
            body, pages = await blocking(self._encode_image, ltx.SNAPSHOT_LEVEL, 1, self._pos, image)
            key = self.scope.ltx_key(ltx.SNAPSHOT_LEVEL, 1, self._pos)
            won = await self._put(key, body)
            self.stats.snapshots += 1
            self._history_bytes = 0
            return SyncResult(self._pos, key, won, pages, pages * image.page_size, len(body), True)

    async def enforce_retention(self, *, keep_snapshots: int = 1, l0_retention_ms: int = 0) -> RetentionResult:
        """Snapshot rotation and retention (§5.1 step 8).

        Keeps the newest ``keep_snapshots`` level-9 files; ``minSnapshotTXID`` is the max TXID of the
        newest snapshot it deletes; level 1..8 files below it expire; level-0 files expire once a
        higher level covers them and they are older than ``l0_retention_ms`` (by this writer's own
        upload time; files of earlier sessions count as old). The newest level-0 file always stays.
        Nothing is deleted if the generation would no longer restore to the TXID it restores to now.
        """
        if keep_snapshots < 1:
            raise ValueError("retention keeps at least the newest snapshot")
        async with self._lock:
            self._check_open()
            files = await list_generation(self.store, self.bucket, self.scope)
            snaps = sorted((f for f in files if f.level == ltx.SNAPSHOT_LEVEL), key=lambda f: f.max_txid)
            kept, dropped = snaps[-keep_snapshots:], snaps[:-keep_snapshots]
            min_snapshot_txid = dropped[-1].max_txid if dropped else 0
            drop = {f.key: f for f in dropped}
            for f in files:
                if 1 <= f.level <= 8 and f.max_txid < min_snapshot_txid:
                    drop[f.key] = f
            newest = newest_level0(files)
            remaining = [f for f in files if f.key not in drop]
            covered = max((f.max_txid for f in remaining if f.level >= 1), default=0)
            now = self.clock.now_ms()
            for f in files:
                if f.level != 0 or (newest is not None and f.key == newest.key) or f.max_txid > covered:
                    continue
                uploaded = self._uploaded_at.get(f.key)
                if uploaded is None or now - uploaded >= l0_retention_ms:
                    drop[f.key] = f
            if drop:
                before = plan_restore(files)
                after = plan_restore([f for f in files if f.key not in drop])
                if not isinstance(before, Plan) or not isinstance(after, Plan) or after.final_txid != before.final_txid:
                    raise ReplicaError(
                        f"retention refused: deleting {len(drop)} files of {self.scope.prefix!r} would change what the "
                        f"generation restores to ({_describe(before)} before, {_describe(after)} after)"
                    )
            for key in sorted(drop):
                await self._delete(key)
            return RetentionResult(tuple(sorted(drop)), min_snapshot_txid, tuple(f.key for f in kept))

    # ------------------------------------------------------------------------------------ loop

    async def run(
        self,
        stop: asyncio.Event,
        *,
        interval_s: float = 1.0,
        compact_after: int = 3,
        max_level: int = 3,
        snapshot_ratio: float = 1.0,
        keep_snapshots: int = 1,
        l0_retention_ms: int = 0,
        checkpoint_every: int = 0,
    ) -> None:
        """The sync loop: sync every ``interval_s``; compact the ladder 1..``max_level`` whenever
        ``compact_after`` files wait at the level below; a snapshot once the incremental uploads since
        the last one carried ``snapshot_ratio`` times the database's bytes (0: never; none while
        :attr:`snapshots_held`); retention
        (``keep_snapshots``, ``l0_retention_ms``) after each snapshot and each level-1 compaction
        (§5.1 step 8: rotation, then expiry below ``minSnapshotTXID`` and of covered level-0 files);
        every ``checkpoint_every`` syncs, a checkpoint. Store failures are logged and retried on the
        next tick (the pending file keeps its bytes); nothing acts on a failed read.

        The snapshot cadence is by volume rather than Litestream's fixed interval: what a generation
        stores is the snapshot plus the history since the one before it (the rotation keeps the newest),
        so a snapshot per database-size of history bounds the stored bytes by a few times the database
        whatever the write rate, and costs one database-sized upload per database-size uploaded."""
        tick = 0
        settled = False  # the ladder is compacted as far as its files allow, and nothing was uploaded since
        retain = False  # a snapshot or a level-1 compaction left files for retention to expire
        while not stop.is_set():
            tick += 1
            try:
                if await self.sync() is not None:
                    settled = False
                if not settled:  # only this writer adds files to its generation: no upload, nothing to merge
                    for level in range(1, max_level + 1):
                        if await self.compact(level, min_inputs=compact_after) is not None and level == 1:
                            retain = True
                    settled = True
                if (snapshot_ratio and not self.snapshots_held
                        and self._history_bytes >= snapshot_ratio * self._commit * self._page_size > 0):
                    retain = await self.snapshot() is not None or retain
                if retain:  # once per snapshot or compaction: a refused retention waits for the next one
                    retain = False
                    await self.enforce_retention(keep_snapshots=keep_snapshots, l0_retention_ms=l0_retention_ms)
                if checkpoint_every and tick % checkpoint_every == 0:
                    await self.checkpoint()
            except Exception as exc:  # a failed round is retried; the reason is logged, never swallowed silently
                self.stats.retries += 1
                log.warning("replica round of %s failed, will retry: %s", self.scope.prefix, exc,
                            extra={**self.log_fields, "reason": str(exc), "prefix": self.scope.prefix})
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=interval_s)

    # ------------------------------------------------------------------------------------ store

    async def _put(self, key: str, body: bytes) -> str | None:
        self.scope.check_owned(key)
        etag = body_etag(body)
        await blocking(self.uploads.begin, key, etag)  # durable before the request: it may land whatever happens next
        outcome = await self.store.put(self.bucket, key, body)
        if isinstance(outcome, Lost):  # an unconditional PUT cannot lose; a twin that says so is a defect
            raise ReplicaError(f"unconditional PUT of {key!r} reported a lost precondition")
        self._versions.pop(key, None)
        if await blocking(self.uploads.answered, key, etag, outcome.version_id, outcome.attempts):
            log.warning("an upload of %s was retried; its session stays uncertain until a listing settles it", key,
                        extra={**self.log_fields, "key": key, "attempts": outcome.attempts})
        elif outcome.version_id is not None and key not in self.uploads.keys:
            self._versions[key] = outcome.version_id
        self._remember(key, body)
        return outcome.version_id

    @property
    def uncertain(self) -> list[str]:
        """Keys with an attempt whose outcome no listing has settled yet (the session is not certified)."""
        return self.uploads.uncertain

    async def observe_uploads(self) -> list[str]:
        """Settle what a version listing shows settled (:meth:`.uploads.Uploads.observe`); the keys left uncertain."""
        if not self.uploads.keys:
            return []
        return await self.uploads.observe(self.store, self.bucket)

    async def _delete(self, key: str) -> None:
        """Delete by the exact version this session's settled PUT answered, else bare (module doc)."""
        self.scope.check_owned(key)
        version = None if key in self.uploads.keys else self._versions.get(key)
        await self.store.delete(self.bucket, key, version_id=version)
        self._versions.pop(key, None)
        self._forget(key)

    async def _read_file(self, f: FileRef) -> bytes:
        cached = self._cache.get(f.key)
        if cached is not None:
            return cached
        got = await self.store.get(self.bucket, f.key)
        if not isinstance(got, Got):
            raise ReplicaError(f"{f.key!r} disappeared while compacting; compaction will retry")
        return got.body

    def _remember(self, key: str, body: bytes) -> None:
        self._uploaded_at[key] = self.clock.now_ms()
        if len(body) > self.options.cache_bytes:
            return
        self._forget(key)
        self._cache[key] = body
        self._cache_size += len(body)
        while self._cache_size > self.options.cache_bytes:
            _, old = self._cache.popitem(last=False)
            self._cache_size -= len(old)

    def _forget(self, key: str) -> None:
        old = self._cache.pop(key, None)
        if old is not None:
            self._cache_size -= len(old)

    async def _upload_pending(self) -> SyncResult:
        p = self._pending
        assert p is not None
        version = await self._put(p.key, p.body)
        self._pos = p.txid
        self._commit = p.commit
        self._page_size = p.page_size
        if p.epoch is not None:
            self._epoch = p.epoch
        if not p.full:
            self._history_bytes += p.pages * p.page_size
        if p.full:
            self._need_full = False
            self._covered = True
            self.stats.full_syncs += 1
        else:
            self.stats.incremental_syncs += 1
        self.stats.syncs += 1
        self._pending = None
        return SyncResult(p.txid, p.key, version, p.pages, p.pages * p.page_size, len(p.body), p.full)

    def _check_open(self) -> None:
        if self._closed:
            raise ReplicaError("the replicator is closed")

    # ------------------------------------------------------------------------------------ sqlite (threads)

    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(
            self.db_path, isolation_level=None, check_same_thread=False,
            timeout=self.options.busy_timeout_ms / 1000,
        )
        conn.execute("PRAGMA wal_autocheckpoint=0")
        return conn

    def _ensure_connections(self) -> bool:
        """Open the replicator's connections once the database exists; ``False`` while it does not."""
        if self._readers:
            return True
        if not self.db_path.exists():
            return False
        probe = self._connect()
        mode = probe.execute("PRAGMA journal_mode").fetchone()[0]
        if str(mode).lower() != "wal":
            probe.close()
            raise ReplicaError(
                f"{self.db_path.name} is in journal_mode={mode}; replication reads the WAL, so the application "
                "must open the database with PRAGMA journal_mode=WAL"
            )
        self._readers = [probe, self._connect()]
        self._writer = self._connect()
        self._begin_read(0)  # SQLite opens the -wal and -shm files for the first read
        self._active = 0
        self._shm_fd = os.open(wal.shm_path(self.db_path), os.O_RDONLY)
        self._wal_fd = os.open(wal.wal_path(self.db_path), os.O_RDONLY)
        self._record_baseline()
        return True

    def _close_connections(self) -> None:
        for conn in [*self._readers, *([self._writer] if self._writer else [])]:
            with contextlib.suppress(sqlite3.Error):
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
            conn.close()
        self._readers = []
        self._writer = None
        self._active = None
        # only now: closing a descriptor of the -shm drops every POSIX lock this process holds on it
        for fd in (self._shm_fd, self._wal_fd):
            if fd is not None:
                os.close(fd)
        self._shm_fd = self._wal_fd = None

    def _shm(self) -> wal.ShmHeader | None:
        assert self._shm_fd is not None
        return wal.read_shm_header(self._shm_fd)

    def _wal(self) -> int:
        assert self._wal_fd is not None
        return self._wal_fd

    def _record_baseline(self) -> None:
        shm = self._shm()
        self._baseline = (shm.salts, shm.mx_frame) if shm is not None else None

    def _changed_since_open(self, shm: wal.ShmHeader | None) -> bool:
        now = (shm.salts, shm.mx_frame) if shm is not None else None
        return now != self._baseline

    def _begin_read(self, index: int) -> None:
        conn = self._readers[index]
        conn.execute("BEGIN")
        conn.execute("SELECT 1 FROM sqlite_master LIMIT 1").fetchall()

    def _end_reads(self) -> None:
        for conn in self._readers:
            if conn.in_transaction:
                conn.execute("COMMIT")
        self._active = None
        self._mark = None
        self._protected = False

    def _refresh_protection(self) -> None:
        """Keep a read mark on the WAL: open the new read transaction before closing the old one.

        A reader gets a WAL read-mark slot (which blocks restarts) unless everything was checkpointed
        when it began. Reading the wal-index before and after the BEGIN proves it: same epoch, same
        ``mxFrame``, and fewer frames checkpointed than committed means the reader took a real slot."""
        shm = self._shm()
        now = (shm.salts, shm.mx_frame) if shm is not None else None
        if self._active is not None and self._protected and now == self._mark:
            return
        other = 0 if self._active is None else 1 - self._active
        self._begin_read(other)
        if self._active is not None:
            self._readers[self._active].execute("COMMIT")
        self._active = other
        self._mark = now
        after = self._shm()
        self._protected = bool(
            shm is not None and after is not None and after.salts == shm.salts
            and after.mx_frame == shm.mx_frame and after.n_backfill < after.mx_frame
        )

    def _capture_changes(self) -> _Pending | None:
        if not self._ensure_connections():
            return None
        pending: _Pending | None = None
        for _ in range(self.options.capture_attempts):
            try:
                pending = self._capture_once()
                break
            except wal.WalChanged as exc:
                log.debug("WAL moved during capture, reading again: %s", exc,
                          extra={**self.log_fields, "reason": str(exc)})
            except _NeedResync as exc:
                pending = self._resync(str(exc))
                break
        else:
            pending = self._resync("wal-unstable")
        self._refresh_protection()
        return pending

    def _capture_once(self, pinned: wal.ShmHeader | None = None) -> _Pending | None:
        """The next level-0 file: frames committed since the shipped position, up to the current
        ``mxFrame`` (or ``pinned``'s, the position a pinned read stands at)."""
        shm = pinned if pinned is not None else self._shm()
        if self._need_full:
            first_flush = self.options.flush_first and self.stats.full_syncs == 0  # only this replicator's first
            if self._pos > 0 and not first_flush and not self._changed_since_open(shm):
                return None  # an anchored or continued generation with nothing new: no upload yet
            image = self._consistent_image(with_delta=False)[1]
            return self._full_pending(image)
        epoch = self._epoch
        if epoch is None:
            raise _NeedResync("unknown-position")
        if shm is None:
            raise _NeedResync("no-wal-index")
        if shm.salts != epoch.salts:
            reason = self._restart_unclean(epoch, shm)
            if reason:
                raise _NeedResync(reason)
            self.stats.restarts_followed += 1
            epoch = self._epoch = _Epoch(shm.salts, 0, self._new_epoch_checksum(shm), epoch.big_endian)
        if shm.mx_frame < epoch.offset:
            raise wal.WalChanged("the WAL holds fewer committed frames than were shipped")
        if shm.mx_frame == epoch.offset:
            return None
        fd = self._wal()
        header = wal.read_wal_header(fd)
        if header is None or header.salts != epoch.salts:
            raise wal.WalChanged("the WAL header does not name the current epoch yet")
        capture = wal.read_frames(fd, header, epoch.offset, shm.mx_frame, self._commit)
        again = wal.read_wal_header(fd)
        if again is None or again.salts != header.salts:
            raise wal.WalChanged("the WAL restarted during the read")
        self._max_wal_size = max(self._max_wal_size, os.fstat(fd).st_size)
        if header.page_size != self._page_size and self._page_size:
            raise _NeedResync("page-size-changed")
        pages = capture.pages
        if capture.min_commit < capture.commit:
            zero = bytes(header.page_size)
            for pgno in range(capture.min_commit + 1, capture.commit + 1):
                pages.setdefault(pgno, zero)
        txid = self._pos + 1
        body = ltx.encode(
            level=0, min_txid=txid, max_txid=txid, page_size=header.page_size, commit=capture.commit,
            pages=pages.items(), timestamp_ms=self.clock.now_ms(), compress=self.options.compress,
        )
        new_epoch = _Epoch(epoch.salts, capture.end, capture.last_checksum, header.big_endian_checksum)
        return _Pending(txid, self.scope.ltx_key(0, txid, txid), body, new_epoch, capture.commit,
                        header.page_size, len(pages), False)

    def _new_epoch_checksum(self, shm: wal.ShmHeader) -> tuple[int, int] | None:
        header = wal.read_wal_header(self._wal())
        return header.checksum if header is not None and header.salts == shm.salts else None

    def _restart_unclean(self, epoch: _Epoch, shm: wal.ShmHeader) -> str | None:
        """``None`` when the WAL restarted exactly once and the old epoch provably ended where it was
        shipped; else why the next file must be full.

        Salt-1 grows by one per restart, so a difference of one is a single restart. The old epoch's
        frame after the shipped position would still be in the file (a restart rewrites from frame 1
        and only the new epoch's committed frames, all before that slot, have been written; a
        truncation shows as a file smaller than any seen): if that slot is absent or holds another
        epoch's leftovers, the old epoch ended at the shipped position and nothing was lost."""
        if (shm.salt1 - epoch.salt1) % _U32 != 1:
            return "several-restarts"
        if epoch.checksum is None:
            return "unknown-checksum"
        fd = self._wal()
        if os.fstat(fd).st_size < self._max_wal_size:
            return "wal-truncated"
        if shm.mx_frame >= epoch.offset + 1:
            return "wal-overwritten"
        grew = wal.frame_extends_epoch(
            fd, epoch.salts, shm.salts, self._page_size or shm.page_size, epoch.offset + 1, epoch.checksum,
            epoch.big_endian,
        )
        if grew is None:
            return "wal-ambiguous"
        if grew:
            return "epoch-grew-unshipped"
        return None

    def _resync(self, reason: str) -> _Pending | None:
        self.stats.resync(reason)
        log.info("replica cannot follow the WAL (%s); shipping a full file", reason,
                 extra={**self.log_fields, "reason": reason})
        self._need_full = True
        return self._full_pending(self._consistent_image(with_delta=False)[1])

    def _full_pending(self, image: _Image) -> _Pending | None:
        if not image.data:
            return None  # an empty database: nothing to ship until it has pages
        txid = lo = self._pos + 1
        if self.options.cover is not None and not self._covered:
            lo = min(lo, self.options.cover[0])
            txid = max(txid, self.options.cover[1] + 1)
        body, pages = self._encode_image(0, lo, txid, image)
        return _Pending(txid, self.scope.ltx_key(0, lo, txid), body, image.epoch,
                        len(image.data) // image.page_size, image.page_size, pages, True)

    def _encode_image(self, level: int, min_txid: int, max_txid: int, image: _Image) -> tuple[bytes, int]:
        body = ltx.encode_image(
            image.data, level=level, min_txid=min_txid, max_txid=max_txid, page_size=image.page_size,
            timestamp_ms=self.clock.now_ms(), compress=self.options.compress,
        )
        return body, len(image.data) // image.page_size

    def _pinned_read(self) -> wal.ShmHeader | None:
        """Begin a read transaction whose snapshot is a known WAL position, and make it the
        protecting one. Lock-free first: the wal-index read before and after the BEGIN agreeing on
        the epoch and ``mxFrame`` pins the snapshot there. Under a writer that never pauses, the
        write lock (bounded by the busy timeout) freezes the position instead."""
        for _ in range(self.options.pin_attempts):
            before = self._shm()
            other = 0 if self._active is None else 1 - self._active
            self._begin_read(other)
            after = self._shm()
            if before is None or after is None or (before.salts, before.mx_frame) == (after.salts, after.mx_frame):
                self._adopt_reader(other, before, after)
                return before
            self._readers[other].execute("COMMIT")
        assert self._writer is not None
        try:
            self._writer.execute("BEGIN IMMEDIATE")
        except sqlite3.OperationalError as exc:
            raise ReplicaError(
                f"could not read a consistent image of {self.db_path.name}: the database stayed locked by a "
                f"writer for {self.options.busy_timeout_ms} ms ({exc})"
            ) from None
        try:
            before = self._shm()
            other = 0 if self._active is None else 1 - self._active
            self._begin_read(other)
            self._adopt_reader(other, before, self._shm())
            return before
        finally:
            self._writer.execute("ROLLBACK")

    def _adopt_reader(self, index: int, before: wal.ShmHeader | None, after: wal.ShmHeader | None) -> None:
        if self._active is not None and self._active != index:
            self._readers[self._active].execute("COMMIT")
        self._active = index
        self._mark = (before.salts, before.mx_frame) if before is not None else None
        self._protected = bool(before is not None and after is not None and after.salts == before.salts
                               and after.mx_frame == before.mx_frame and after.n_backfill < after.mx_frame)

    def _consistent_image(self, *, with_delta: bool) -> tuple[_Pending | None, _Image]:
        """A database image at a known WAL position and, optionally, the frames between the shipped
        position and it (the image's own read mark keeps them from being overwritten)."""
        delta: _Pending | None = None
        shm = self._pinned_read()
        if with_delta and not self._need_full and self._epoch is not None and shm is not None \
                and shm.salts == self._epoch.salts:
            try:
                delta = self._capture_once(shm)
            except (wal.WalChanged, _NeedResync) as exc:
                self.stats.resync(f"pinned:{exc}")
                self._need_full = True
        epoch = self._epoch_at(shm)
        assert self._active is not None
        reader = self._readers[self._active]
        data = reader.serialize()
        page_size = int(reader.execute("PRAGMA page_size").fetchone()[0])
        if data and len(data) % page_size:
            raise ReplicaError(f"database image of {len(data)} bytes is not a whole number of {page_size}-byte pages")
        return delta, _Image(data, page_size, epoch)

    def _epoch_at(self, shm: wal.ShmHeader | None) -> _Epoch | None:
        """The epoch and position a pinned read stands at, with the cumulative checksum there."""
        if shm is None:
            return None
        fd = self._wal()
        self._max_wal_size = max(self._max_wal_size, os.fstat(fd).st_size)
        header = wal.read_wal_header(fd)
        if header is None or header.salts != shm.salts:
            return _Epoch(shm.salts, shm.mx_frame, None, header.big_endian_checksum if header else False)
        checksum: tuple[int, int] | None = header.checksum
        if shm.mx_frame:
            raw = os.pread(fd, wal.FRAME_HEADER_SIZE, wal.frame_offset(shm.mx_frame, header.page_size))
            checksum = (int.from_bytes(raw[16:20], "big"), int.from_bytes(raw[20:24], "big"))
            again = wal.read_wal_header(fd)
            if again is None or again.salts != header.salts or raw[8:16] != header.salts:
                checksum = None  # the epoch moved on meanwhile; a later restart will not be followed
        return _Epoch(shm.salts, shm.mx_frame, checksum, header.big_endian_checksum)

    def _capture_with_image(self) -> tuple[_Pending | None, _Image | None]:
        if not self._ensure_connections():
            return None, None
        delta, image = self._consistent_image(with_delta=not self._need_full)
        if not self._need_full:
            shipped = delta.epoch if delta is not None else self._epoch
            if shipped is not None and image.epoch is not None and shipped.salts == image.epoch.salts \
                    and shipped.offset == image.epoch.offset:
                return delta, image
            self.stats.resync("snapshot-position")
        # not following the WAL exactly: the image itself goes out as a full level-0 file first
        return self._full_pending(image), image

    def _checkpoint_locked(self, mode: str) -> _Pending | None:
        """Capture every committed frame under the write lock, then checkpoint with no read mark of
        ours left, recording where the epoch ended (``PASSIVE``), or truncate (``TRUNCATE``)."""
        if not self._ensure_connections():
            return None
        assert self._writer is not None
        writer = self._writer
        pending: _Pending | None = None
        following = False
        writer.execute(f"PRAGMA busy_timeout={self.options.checkpoint_wait_ms}")
        try:
            writer.execute("BEGIN IMMEDIATE")
        except sqlite3.OperationalError as exc:
            self.stats.checkpoints_skipped += 1
            log.info("checkpoint skipped, the database stayed locked: %s", exc,
                     extra={**self.log_fields, "reason": str(exc)})
            return None
        finally:
            writer.execute(f"PRAGMA busy_timeout={self.options.busy_timeout_ms}")
        try:
            shm = self._shm()
            following = not self._need_full and self._epoch is not None and shm is not None \
                and shm.salts == self._epoch.salts
            if following:
                try:
                    pending = self._capture_once()
                except (wal.WalChanged, _NeedResync) as exc:
                    self.stats.resync(f"locked:{exc}")
                    self._need_full = True
                    following = False
            if mode == "PASSIVE" and following:
                self._end_reads()
                self._readers[0].execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
        finally:
            writer.execute("ROLLBACK")
        if mode == "TRUNCATE":
            self._end_reads()
            self._readers[0].execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
            self._need_full = True
            self._record_baseline()
        self._refresh_protection()
        return pending


def _describe(outcome: Plan | object) -> str:
    if isinstance(outcome, Plan):
        return f"TXID {outcome.final_txid}"
    return f"a refusal ({getattr(outcome, 'reason', outcome)})"
