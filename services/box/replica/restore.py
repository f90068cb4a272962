"""The restore: plan, fetch, verify, assemble, check (spec §5.1 steps 2, 4, 5, 6, 8; D§7).

A restore reads one generation of one location in the box's own bucket and nothing else
(§5.1 "The restore contract"). It never produces a database when a refusal holds (step 5): no root
(the pinned version missing or not ``[1, snapshot_txid]``), a file failing its CRC-64 check, a gap,
``PRAGMA integrity_check`` not ``ok``, a required final TXID not reached exactly, or the first file
over nothing not being a full database. The result is assembled in a temporary file beside the
destination and renamed into place only once every check passed.

Two sources:

- :func:`restore_generation`: the generation's **current** files (a wake, a cold restore). A chain
  file that vanished between the listing and the GET (a compaction or retention replaced it) makes
  the restore list and plan again, a bounded number of times; a successor snapshot that fails its
  CRC-64 is not a *verified* successor (step 8) and the plan is made again without it.
- :func:`restore_files`: an exact set of versions (a seal's, §5.1 step 1): read by version id,
  never re-listed; anything missing or corrupt refuses.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import sqlite3
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kernel.logctx import ctx
from kernel.ports import blocking
from services.box.replica import ltx
from services.box.replica.layout import FileRef, GenerationScope, list_generation
from services.box.replica.planner import NO_ROOT, PinnedRoot, Plan, Refusal, plan_restore
from services.objstore.port import Got, ObjectStore

log = logging.getLogger("hostmove.replica")

CHECKSUM = "checksum"
FORMAT = "format"
INTEGRITY = "integrity"
NOT_FULL = "not_full"
MISSING = "missing"


class RestoreRefused(Exception):
    """The restore failed closed (§5.1 step 5). ``reason`` is a stable code, the message says why in
    plain words; no database was produced."""

    def __init__(self, refusal: Refusal) -> None:
        super().__init__(refusal.message)
        self.refusal = refusal
        self.reason = refusal.reason


@dataclass(frozen=True)
class RestoreResult:
    txid: int
    page_size: int
    pages: int
    db_bytes: int
    sha256: str
    integrity_check: str
    root_key: str | None
    root_is_pinned: bool
    files: tuple[str, ...]
    fetched_bytes: int
    skipped_roots: tuple[str, ...] = ()

    @property
    def empty(self) -> bool:
        return self.txid == 0


class _Vanished(Exception):
    def __init__(self, ref: FileRef) -> None:
        self.ref = ref


class _BadRoot(Exception):
    def __init__(self, ref: FileRef, error: ltx.LtxError) -> None:
        self.ref = ref
        self.error = error


async def restore_generation(
    store: ObjectStore,
    bucket: str,
    location: str,
    generation: str,
    dest: str | os.PathLike[str],
    *,
    pinned: PinnedRoot | None = None,
    required_txid: int | None = None,
    replans: int = 3,
    concurrency: int = 8,
    durable: bool = True,
) -> RestoreResult:
    """Restore ``generation`` of ``location`` into ``dest`` (which must not exist).

    An empty generation restores to nothing (``result.empty``, no file): whether that is healthy is
    the caller's question (§5.1 step 9: an unexplained empty ``holder.generation`` refuses the start).

    ``durable=False`` skips the fsyncs: for a wake's restore, whose database is never reused across a
    crash (§5.1 step 9, R9-1: every admitted writer purges it and restores again)."""
    scope = GenerationScope(location, generation)
    skipped: set[str] = set()
    last: Refusal | None = None
    for _ in range(replans + 1):
        files = await list_generation(store, bucket, scope)
        plan = plan_restore(files, pinned=pinned, required_txid=required_txid, exclude_roots=frozenset(skipped))
        if isinstance(plan, Refusal):
            raise RestoreRefused(_with_skipped(plan, skipped))
        try:
            return await _execute(store, bucket, plan, dest, pinned, concurrency, tuple(sorted(skipped)),
                                  durable=durable)
        except _BadRoot as bad:
            log.warning("successor snapshot %s failed verification (%s); planning without it", bad.ref.key, bad.error,
                        extra=ctx(phase="restore", reason=bad.error, key=bad.ref.key, location=location,
                                  generation=generation))
            skipped.add(bad.ref.key)
        except _Vanished as gone:
            last = Refusal(
                MISSING, f"{gone.ref.key} was listed but is gone; the generation kept changing while being restored"
            )
    assert last is not None or skipped
    raise RestoreRefused(last or Refusal(NO_ROOT, "no verified root could be found"))


async def restore_files(
    store: ObjectStore,
    bucket: str,
    files: Sequence[FileRef],
    dest: str | os.PathLike[str],
    *,
    pinned: PinnedRoot | None = None,
    required_txid: int | None = None,
    concurrency: int = 8,
    durable: bool = True,
) -> RestoreResult:
    """Restore an exact set of versions (a seal's), never re-listing (§5.1 steps 1, 2)."""
    plan = plan_restore(files, pinned=pinned, required_txid=required_txid)
    if isinstance(plan, Refusal):
        raise RestoreRefused(plan)
    try:
        return await _execute(store, bucket, plan, dest, pinned, concurrency, (), strict_root=True, durable=durable)
    except _Vanished as gone:
        raise RestoreRefused(Refusal(MISSING, f"{gone.ref.key} (version {gone.ref.version_id}) is missing")) from None
    except _BadRoot as bad:
        raise RestoreRefused(Refusal(CHECKSUM, f"{bad.ref.key}: {bad.error}")) from None


def _with_skipped(refusal: Refusal, skipped: set[str]) -> Refusal:
    if not skipped:
        return refusal
    note = "; successor snapshots that failed their CRC-64 check and were not used: " + ", ".join(sorted(skipped))
    return Refusal(refusal.reason, refusal.message + note, refusal.details)


async def _fetch(store: ObjectStore, bucket: str, ref: FileRef) -> bytes:
    got = await store.get(bucket, ref.key, version_id=ref.version_id)
    if not isinstance(got, Got):
        raise _Vanished(ref)
    return got.body


async def _execute(
    store: ObjectStore,
    bucket: str,
    plan: Plan,
    dest: str | os.PathLike[str],
    pinned: PinnedRoot | None,
    concurrency: int,
    skipped: tuple[str, ...],
    *,
    strict_root: bool = False,
    durable: bool = True,
) -> RestoreResult:
    dest_path = Path(dest)
    if dest_path.exists():
        raise FileExistsError(f"refusing to restore over existing {dest_path}")
    refs = plan.files
    sem = asyncio.Semaphore(max(1, concurrency))

    async def fetch(ref: FileRef) -> bytes:
        async with sem:
            return await _fetch(store, bucket, ref)

    tasks = [asyncio.ensure_future(fetch(ref)) for ref in refs]
    tmp = dest_path.with_name(dest_path.name + ".restoring")
    _remove_db_files(tmp)
    fetched = 0
    try:
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            page_size = 0
            commit = 0
            for i, (ref, task) in enumerate(zip(refs, tasks, strict=True)):
                try:
                    data = await task
                except _Vanished:
                    if ref is plan.root and plan.root_is_pinned:
                        raise RestoreRefused(Refusal(
                            NO_ROOT,
                            f"no current snapshot at or past TXID {ref.max_txid} and the pinned snapshot {ref.key} "
                            f"(version {ref.version_id}) is missing",
                        )) from None
                    raise
                fetched += len(data)
                header = await blocking(_verify, ref, data, plan, pinned, strict_root)
                if i == 0 and not header.full:
                    raise RestoreRefused(Refusal(
                        NOT_FULL, f"{ref.key} starts the restore but does not hold the whole database"
                    ))
                if page_size and header.page_size != page_size:
                    raise RestoreRefused(Refusal(
                        FORMAT, f"{ref.key} has page size {header.page_size}, earlier files {page_size}"
                    ))
                page_size = header.page_size
                commit = header.commit
                await blocking(_apply, fd, header, data)
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        if not refs:
            tmp.unlink()
            return RestoreResult(0, 0, 0, 0, "", "", None, False, (), 0, skipped)
        integrity, sha = await _check_database(tmp)
        if integrity != "ok":
            raise RestoreRefused(Refusal(
                INTEGRITY, f"the assembled database fails PRAGMA integrity_check: {integrity[:500]}"
            ))
        os.replace(tmp, dest_path)
        if durable:
            _fsync_dir(dest_path.parent)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        _remove_db_files(tmp)
        raise
    return RestoreResult(
        txid=plan.final_txid, page_size=page_size, pages=commit, db_bytes=commit * page_size, sha256=sha,
        integrity_check=integrity, root_key=plan.root.key if plan.root else None, root_is_pinned=plan.root_is_pinned,
        files=tuple(r.key for r in refs), fetched_bytes=fetched, skipped_roots=skipped,
    )


def _verify(ref: FileRef, data: bytes, plan: Plan, pinned: PinnedRoot | None, strict_root: bool) -> ltx.Header:
    try:
        header = ltx.verify(data)
    except ltx.LtxError as exc:
        if ref is plan.root and not plan.root_is_pinned and not strict_root:
            raise _BadRoot(ref, exc) from None
        raise RestoreRefused(Refusal(CHECKSUM if exc.reason == "checksum" else FORMAT, f"{ref.key}: {exc}")) from None
    if (header.level, header.min_txid, header.max_txid) != (ref.level, ref.min_txid, ref.max_txid):
        raise RestoreRefused(Refusal(
            NO_ROOT if ref is plan.root and plan.root_is_pinned else FORMAT,
            f"{ref.key} holds level {header.level} [{header.min_txid}, {header.max_txid}], not what its key names",
        ))
    if ref is plan.root and plan.root_is_pinned and pinned is not None and pinned.crc64 is not None \
            and ltx.stored_crc(data) != pinned.crc64:
        raise RestoreRefused(Refusal(
            CHECKSUM, f"the pinned snapshot {ref.key} does not carry the CRC-64 the install recorded"
        ))
    return header


def _apply(fd: int, header: ltx.Header, data: bytes) -> None:
    ps = header.page_size
    try:
        if header.full:
            # a full file is the whole database: its image block, streamed to offset 0
            os.ftruncate(fd, 0)
            offset = 0
            for chunk in ltx.stream_full_image(header, data):
                _write_all(fd, chunk, offset)
                offset += len(chunk)
        else:
            numbers, images = ltx.page_block(header, data)
            for i, pgno in enumerate(numbers):
                _write_all(fd, images[i * ps : (i + 1) * ps], (pgno - 1) * ps)
    except ltx.LtxError as exc:
        raise RestoreRefused(Refusal(FORMAT, str(exc))) from None
    os.ftruncate(fd, header.commit * ps)


def _write_all(fd: int, data: memoryview, offset: int) -> None:
    while data:
        n = os.pwrite(fd, data, offset)
        data = data[n:]
        offset += n


def _integrity(path: Path) -> str:
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        rows = conn.execute("PRAGMA integrity_check").fetchall()
    except sqlite3.DatabaseError as exc:
        rows = [(f"not a database: {exc}",)]
    finally:
        conn.close()
    _remove_sidecars(path)
    return "ok" if rows == [("ok",)] else "; ".join(str(r[0]) for r in rows)


def _sha256(fd: int) -> str:
    digest = hashlib.sha256()
    offset = 0
    while chunk := os.pread(fd, 4 << 20, offset):
        digest.update(chunk)
        offset += len(chunk)
    return digest.hexdigest()


async def _check_database(path: Path) -> tuple[str, str]:
    """``PRAGMA integrity_check`` and the file's sha256, side by side (both release the GIL). The
    hashing descriptor is closed only after SQLite's connection: closing a descriptor drops every
    POSIX lock the process holds on the file."""
    fd = os.open(path, os.O_RDONLY)
    try:
        integrity, sha = await asyncio.gather(blocking(_integrity, path), blocking(_sha256, fd))
    finally:
        os.close(fd)
    return integrity, sha


def _remove_sidecars(path: Path) -> None:
    for suffix in ("-wal", "-shm", "-journal"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(str(path) + suffix)


def _remove_db_files(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    _remove_sidecars(path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
