"""Building a generation: build intent, snapshot, anchor, ``install.json`` (spec §5.1 steps 2, 7; §7.6).

**A build is two durable states, never one object** (R7-4):

1. the **build intent** ``g-<op>/build-intent.json``, written (create-only) before any PUT, with the
   encoding inputs: the header timestamp, the page size, the database size (``commit``) and ``N``.
   A replay (a restarted ``building``) reads it and encodes **identical bytes** (R6-5);
2. the snapshot ``[1, N]`` (level 9, every page) and the **anchor** ``[N, N]`` (level 0, every
   page, ``wal_offset`` = the WAL header size, fact R5-1c) are PUT and acknowledged; a replay reuses
   an object it finds current under its key with the same bytes (same ETag) rather than writing;
3. only then the **completed install manifest** ``g-<op>/install.json`` (create-only), whose keys are
   the shared ``InstallManifest``'s: ``v, op, host, snapshot_txid, snapshot_key, snapshot_version,
   snapshot_crc64, anchor_key, anchor_version, anchor_crc64, integrity_check, db_sha256, built_at``.

The completion predicate is the manifest's existence, never the intent's (§7.6 ``building``).

**The anchor at a wake** (§5.1 step 7): :func:`ensure_anchor` writes ``[T, T]`` when the restored
TXID ``T`` is above the newest current level-0 file, and returns only once the PUT is
acknowledged (retrying the same bytes); the writer's position is then read from the listing.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import sqlite3
from dataclasses import dataclass
from pathlib import Path

from events.base import Durable, Ident, Millis, canonical, decode
from kernel.logctx import ctx
from kernel.ports import Clock, blocking
from services.box.replica import ltx
from services.box.replica.layout import GenerationScope, list_generation
from services.box.replica.planner import PinnedRoot, newest_level0
from services.objstore.port import Got, Lost, ObjectStore, StoreUnavailable, Won

log = logging.getLogger("hostmove.replica")

INSTALL_VERSION = 1


class InstallError(Exception):
    """A build that must not complete, with the reason in plain words."""


class BuildIntent(Durable, frozen=True):
    """``g-<op>/build-intent.json``: the encoding inputs, before any PUT (§5.1 step 2)."""

    __durable_root__ = True

    v: int
    op: Ident
    host: Ident
    txid: int
    page_size: int
    commit: int
    timestamp_ms: Millis
    db_sha256: str


class InstallManifest(Durable, frozen=True):
    """``g-<op>/install.json``: the completed build (§5.1 step 2, rev 7.22 key names)."""

    __durable_root__ = True

    v: int
    op: Ident
    host: Ident
    snapshot_txid: int
    snapshot_key: str
    snapshot_version: str
    snapshot_crc64: str
    anchor_key: str
    anchor_version: str
    anchor_crc64: str
    integrity_check: str
    db_sha256: str
    built_at: Millis

    def pinned_root(self) -> PinnedRoot:
        """The install's snapshot identity, as ``generation.json`` will name it (§5.1 step 3)."""
        return PinnedRoot(self.snapshot_key, self.snapshot_version or None, self.snapshot_txid,
                          int(self.snapshot_crc64, 16))


@dataclass(frozen=True)
class _Database:
    page_size: int
    commit: int
    sha256: str
    integrity: str
    data: bytes


def _read_database(path: Path) -> _Database:
    """The built database's pages, the sha256 of its bytes and its integrity check."""
    if not path.is_file():
        raise InstallError(f"there is no database to install at {path}")
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        integrity_rows = conn.execute("PRAGMA integrity_check").fetchall()
        page_size = int(conn.execute("PRAGMA page_size").fetchone()[0])
        conn.execute("BEGIN")
        data = conn.serialize()
        conn.execute("COMMIT")
    finally:
        conn.close()
    integrity = "ok" if integrity_rows == [("ok",)] else "; ".join(str(r[0]) for r in integrity_rows)
    # hash the image SQLite read (the file's bytes once checkpointed), never the file through a
    # descriptor of our own: closing it would drop this process's SQLite locks on the database
    sha = hashlib.sha256(data).hexdigest()
    return _Database(page_size, len(data) // page_size, sha, integrity, data)


def encode_full(db: bytes, page_size: int, *, level: int, min_txid: int, max_txid: int, timestamp_ms: int,
                wal_offset: int = 0) -> bytes:
    """Every page of a database image as one full file (snapshot or anchor)."""
    return ltx.encode_image(db, level=level, min_txid=min_txid, max_txid=max_txid, page_size=page_size,
                            timestamp_ms=timestamp_ms, wal_offset=wal_offset)


def _md5_etag(body: bytes) -> str:
    return '"' + hashlib.md5(body).hexdigest() + '"'


async def put_acknowledged(store: ObjectStore, bucket: str, key: str, body: bytes, *, attempts: int = 5,
                           clock: Clock | None = None, backoff_s: float = 0.2) -> str:
    """PUT and wait for the acknowledgement, retrying **the same bytes** after an unknown outcome
    (§5.1 step 7: an anchor still in flight is no anchor). Returns the version id."""
    last: Exception | None = None
    for attempt in range(attempts):
        try:
            outcome = await store.put(bucket, key, body)
        except StoreUnavailable as exc:
            last = exc
            log.warning("PUT of %s not acknowledged (attempt %d): %s", key, attempt + 1, exc,
                        extra=ctx(phase="replica-install", reason=exc, key=key, attempt=attempt + 1))
            if clock is not None:
                await clock.sleep(backoff_s * (2**attempt))
            continue
        if isinstance(outcome, Won):
            return outcome.version_id or ""
        raise InstallError(f"unconditional PUT of {key} reported a lost precondition")
    raise InstallError(f"PUT of {key} was never acknowledged after {attempts} attempts: {last}")


async def _reuse_or_put(store: ObjectStore, bucket: str, scope: GenerationScope, key: str, body: bytes,
                        clock: Clock) -> str:
    scope.check_owned(key)
    current = await store.head(bucket, key)
    if isinstance(current, Got) and current.etag.strip('"') == _md5_etag(body).strip('"'):
        return current.version_id or ""
    return await put_acknowledged(store, bucket, key, body, clock=clock)


async def read_install(store: ObjectStore, bucket: str, location: str, op: str) -> InstallManifest | None:
    """The completed manifest, or ``None`` while the build is not complete."""
    got = await store.get(bucket, GenerationScope(location, op).install_key)
    return decode(got.body, InstallManifest) if isinstance(got, Got) else None


async def build_generation(
    store: ObjectStore,
    bucket: str,
    location: str,
    op: str,
    host: str,
    db_path: str | os.PathLike[str],
    txid: int,
    clock: Clock,
) -> InstallManifest:
    """Build ``g-<op>/`` from the database at ``db_path``, which the caller restored at exactly
    ``txid`` (= N) and which passed ``integrity_check`` (§7.6 ``building``). Replayable at every step."""
    scope = GenerationScope(location, op)
    if scope.is_origin:
        raise InstallError("only an operation's generation is built; the origin is written by replication")
    if txid < 1:
        raise InstallError("a build needs a replica position of at least 1; an empty database installs nothing")
    done = await store.get(bucket, scope.install_key)
    if isinstance(done, Got):
        return decode(done.body, InstallManifest)
    db = await blocking(_read_database, Path(db_path))
    if db.integrity != "ok":
        raise InstallError(f"the database to install fails PRAGMA integrity_check: {db.integrity[:300]}")
    if db.commit == 0:
        raise InstallError("the database to install is empty")
    intent = await _intent(store, bucket, scope, op, host, txid, db, clock)
    timestamp = intent.timestamp_ms
    snapshot_key = scope.ltx_key(ltx.SNAPSHOT_LEVEL, 1, txid)
    anchor_key = scope.ltx_key(0, txid, txid)
    # The two encodes and the two PUTs are independent: run each pair side by side (the offline window, §7.6).
    snapshot, anchor = await asyncio.gather(
        blocking(encode_full, db.data, db.page_size, level=ltx.SNAPSHOT_LEVEL, min_txid=1, max_txid=txid,
                 timestamp_ms=timestamp),
        blocking(encode_full, db.data, db.page_size, level=0, min_txid=txid, max_txid=txid, timestamp_ms=timestamp,
                 wal_offset=ltx.WAL_HEADER_SIZE),
    )
    snapshot_version, anchor_version = await asyncio.gather(
        _reuse_or_put(store, bucket, scope, snapshot_key, snapshot, clock),
        _reuse_or_put(store, bucket, scope, anchor_key, anchor, clock),
    )
    manifest = InstallManifest(
        v=INSTALL_VERSION, op=op, host=host, snapshot_txid=txid, snapshot_key=snapshot_key,
        snapshot_version=snapshot_version, snapshot_crc64=ltx.format_crc(ltx.stored_crc(snapshot)),
        anchor_key=anchor_key, anchor_version=anchor_version, anchor_crc64=ltx.format_crc(ltx.stored_crc(anchor)),
        integrity_check=db.integrity, db_sha256=db.sha256, built_at=clock.now_ms(),
    )
    scope.check_owned(scope.install_key)
    outcome = await store.put(bucket, scope.install_key, canonical(manifest), if_none_match=True)
    if isinstance(outcome, Lost):
        existing = await read_install(store, bucket, location, op)
        if existing is None or (existing.snapshot_key, existing.snapshot_crc64, existing.anchor_crc64) != (
            manifest.snapshot_key, manifest.snapshot_crc64, manifest.anchor_crc64
        ):
            raise InstallError(f"{scope.install_key} already exists and names other artifacts")
        return existing
    return manifest


async def _intent(store: ObjectStore, bucket: str, scope: GenerationScope, op: str, host: str, txid: int,
                  db: _Database, clock: Clock) -> BuildIntent:
    key = scope.build_intent_key
    scope.check_owned(key)
    got = await store.get(bucket, key)
    if not isinstance(got, Got):
        intent = BuildIntent(v=INSTALL_VERSION, op=op, host=host, txid=txid, page_size=db.page_size,
                             commit=db.commit, timestamp_ms=clock.now_ms(), db_sha256=db.sha256)
        outcome = await store.put(bucket, key, canonical(intent), if_none_match=True)
        if isinstance(outcome, Won):
            return intent
        got = await store.get(bucket, key)
        if not isinstance(got, Got):
            raise InstallError(f"{key} was created by another builder and then vanished")
    intent = decode(got.body, BuildIntent)
    if (intent.op, intent.host, intent.txid, intent.page_size, intent.commit, intent.db_sha256) != (
        op, host, txid, db.page_size, db.commit, db.sha256
    ):
        raise InstallError(
            f"{key} records a build of TXID {intent.txid} ({intent.commit} pages of {intent.page_size} bytes), "
            f"but the database offered is TXID {txid} ({db.commit} pages of {db.page_size} bytes) or differs in "
            "content; "
            "a replay must build exactly what the intent recorded"
        )
    return intent


async def ensure_anchor(
    store: ObjectStore,
    bucket: str,
    location: str,
    generation: str,
    db_path: str | os.PathLike[str],
    restored_txid: int,
    clock: Clock,
) -> str | None:
    """The wake's anchor check (§5.1 step 7): when ``restored_txid`` is above the newest current
    level-0 file, write ``[T, T]`` with every page and return its key once acknowledged; else
    ``None`` (nothing to do). The caller opens replication only after this returns."""
    if restored_txid < 1:
        return None
    scope = GenerationScope(location, generation)
    files = await list_generation(store, bucket, scope)
    newest = newest_level0(files)
    if newest is not None and newest.max_txid >= restored_txid:
        return None
    db = await blocking(_read_database, Path(db_path))
    body = await blocking(encode_full, db.data, db.page_size, level=0, min_txid=restored_txid,
                                   max_txid=restored_txid, timestamp_ms=clock.now_ms(),
                                   wal_offset=ltx.WAL_HEADER_SIZE)
    key = scope.ltx_key(0, restored_txid, restored_txid)
    scope.check_owned(key)
    await put_acknowledged(store, bucket, key, body, clock=clock)
    return key
