"""The target's ``returning`` (spec §7.8, dirty only; digest D§3.5 step 3): the handoff back to the source.

The target's probe wrote (or the seal held writes the source's replica never reached, ``src_covered`` false), so the
source cannot return to its own state: the target carries its stopped state into the **return lane**
``moves/<host>/<rb>/`` of the source region's bucket, every object at an exact version, and the seal
(:class:`events.record.ReturnSeal`) names them:

- ``replica/0009/<1>-<N'>.ltx``: one level-9 snapshot of the stopped database, every page (§5.1 step 2), ``N'``
  its replica position (the newest TXID the target's writer uploaded, every frame of it final after the
  release's checkpoint);
- ``files/archive.sealed`` and ``files/manifest.json``: its files and ``.env``, sealed to the source region's key and
  bound to the rollback id (§8);
- ``timers/timers.json``: its timers rows with their bookkeeping (§9.4);
- ``move.json``: the lane's identity (the rollback id, the incarnation, the host, back from ``to`` to ``from``).

**A target that never restored a database** (dirty only for want of ``src_covered``, rule ``seal-return``) returns
the staged seal as it was given: the replica versions the cut journalled, copied by version into the lane with
their ``N``, and the staged files and timers with them (the archive re-sealed to the source, its content
unchanged). The return is bounded by the release deadline, not the cut window (§7.8).

Each object is written again on a replay (a new version of the same content); only the versions the ``returned``
CAS seals are ever read, and the lane's ``park-staging`` retires every version (§7.8 ``probed``).
"""

from __future__ import annotations

import contextlib
import io
import shutil
import sqlite3
from dataclasses import dataclass
from pathlib import Path

import msgspec

from events.record import Move, ReturnSeal, Rollback
from kernel import rules
from kernel.ports import blocking
from services.box.artifacts.archive import ENV_NAME, FILES_ROOT, build_archive, extract, manifest_bytes
from services.box.artifacts.markers import read_files_gen, read_local_gen
from services.box.artifacts.sealing import PublicKey
from services.box.replica import ltx
from services.box.replica.install import encode_full, put_acknowledged
from services.box.replica.layout import GenerationScope, list_generation, ltx_name
from services.box.replica.planner import replication_position
from services.objstore.port import Got, ObjectStore
from services.target.worker import MoveJson, Seal, TargetBox, staging_prefix

ARCHIVE = "archive.sealed"
MANIFEST = "manifest.json"
TIMERS = "timers.json"


class ReturnFailed(Exception):
    """The return cannot be published now (a store error propagates instead); the message says why."""


@dataclass(frozen=True)
class ReturnLane:
    """Where the return goes: the source region's store and bucket and its public key (the archive is sealed to
    it, §8)."""

    store: ObjectStore
    bucket: str
    key: PublicKey


def _image(path: Path) -> tuple[bytes, int]:
    """The stopped database's image (every page) and its page size."""
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        page_size = int(conn.execute("PRAGMA page_size").fetchone()[0])
        conn.execute("BEGIN")
        data = conn.serialize()
        conn.execute("COMMIT")
    finally:
        conn.close()
    return data, page_size


def restored_here(box: TargetBox, host: str, move: Move) -> bool:
    """Did this landing put a database in place (§7.6 ``restored``, or a probe's restore after it)? Its ``.gen``
    names the move's prepared generation or a restarted probe's (``<move>.p<n>``)."""
    gen = read_local_gen(box.db_path(host))
    return gen is not None and gen.startswith(move.id)


async def publish_return(box: TargetBox, lane: ReturnLane, host: str, move: Move, rb: Rollback, seal: Seal,
                         location: str, generation: str) -> ReturnSeal:
    """The return lane's objects (module docstring); answers the seal ``returned`` records. ``seal`` is the cut's
    (``op.journal.seal``); ``location`` and ``generation`` are the target writer's (``holder``)."""
    prefix = staging_prefix(host, rb.id)
    body = msgspec.json.encode(MoveJson(move_id=rb.id, incarnation=move.incarnation, host=host,
                                        to=move.from_, from_=move.to))
    await put_acknowledged(lane.store, lane.bucket, prefix + "move.json", body, clock=box.clock)
    if restored_here(box, host, move):
        n = max(1, replication_position(await list_generation(box.data_store, box.data_bucket,
                                                               GenerationScope(location, generation))))
        data, page_size = await blocking(_image, box.db_path(host))
        snapshot = await blocking(encode_full, data, page_size, level=ltx.SNAPSHOT_LEVEL, min_txid=1, max_txid=n,
                                  timestamp_ms=box.clock.now_ms())
        name = ltx_name(ltx.SNAPSHOT_LEVEL, 1, n)
        version = await put_acknowledged(lane.store, lane.bucket, prefix + "replica/" + name, snapshot,
                                         clock=box.clock)
        replica, from_db = {name: version}, True
    else:  # never restored: the staged seal as it was given (rule seal-return)
        if not rules.on("seal-return"):
            raise ReturnFailed("the landing never restored a database and the staged seal is not returned")
        replica, n, from_db = {}, seal.n, False
        for name, version in sorted(seal.replica.items()):
            got = await box.data_store.get(box.data_bucket, staging_prefix(host, move.id) + "replica/" + name,
                                           version_id=version)
            if not isinstance(got, Got):
                raise ReturnFailed(f"the staged replica/{name} at its sealed version is missing")
            replica[name] = await put_acknowledged(lane.store, lane.bucket, prefix + "replica/" + name, got.body,
                                                   clock=box.clock)
    files = await _files(box, lane, host, move, rb, seal)
    timers = await _timers(box, lane, host, move, rb, seal)
    return ReturnSeal(n=n, replica=replica, files=files, timers=timers, from_db=from_db)


async def _files(box: TargetBox, lane: ReturnLane, host: str, move: Move, rb: Rollback, seal: Seal
                 ) -> dict[str, str]:
    """The files and ``.env`` sealed to the source, bound to the rollback id: the installed ones when ``local``
    installed them here (``.files-gen`` names the move), else the staged archive's content, re-sealed."""
    files_dir, env = box.files_dir(host), box.env_path(host)
    tag = read_files_gen(files_dir) if files_dir.exists() else None
    scratch: Path | None = None
    if tag is None or not tag.op.startswith(move.id):
        archive_ref = seal.ref(host, move.id, "files/", ARCHIVE)
        manifest_ref = seal.ref(host, move.id, "files/", MANIFEST)
        if archive_ref is None or manifest_ref is None:
            raise ReturnFailed("the seal names no files archive to return")
        sealed = await box.data_store.get(box.data_bucket, archive_ref.key, version_id=archive_ref.version_id)
        manifest = await box.data_store.get(box.data_bucket, manifest_ref.key, version_id=manifest_ref.version_id)
        if not isinstance(sealed, Got) or not isinstance(manifest, Got):
            raise ReturnFailed("the staged files archive at its sealed version is missing")
        scratch = box.journal_dir(host, move.id) / "return-extract"
        if scratch.exists():
            shutil.rmtree(scratch)
        await blocking(extract, sealed.body, manifest.body, box.private_key, scratch, expect_op=move.id,
                       expect_incarnation=move.incarnation)
        files_dir, env = scratch / FILES_ROOT, scratch / ENV_NAME
    try:
        out = io.BytesIO()
        built = await blocking(build_archive, files_dir, env if env.exists() else None, out, lane.key, host=host,
                               op_id=rb.id, incarnation=move.incarnation)
    finally:
        if scratch is not None:
            with contextlib.suppress(OSError):
                shutil.rmtree(scratch)
    prefix = staging_prefix(host, rb.id) + "files/"
    archive_version = await put_acknowledged(lane.store, lane.bucket, prefix + ARCHIVE, out.getvalue(),
                                             clock=box.clock)
    manifest_version = await put_acknowledged(lane.store, lane.bucket, prefix + MANIFEST, manifest_bytes(built),
                                              clock=box.clock)
    return {ARCHIVE: archive_version, MANIFEST: manifest_version}


async def _timers(box: TargetBox, lane: ReturnLane, host: str, move: Move, rb: Rollback, seal: Seal
                  ) -> dict[str, str]:
    """The target's timers rows (their bookkeeping included) once ``local`` installed them here, else the staged
    snapshot as it was given."""
    if restored_here(box, host, move) or box.timers.list(host):
        body = msgspec.json.encode(box.timers.list(host))
    else:
        ref = seal.ref(host, move.id, "timers/", TIMERS)
        got = await box.data_store.get(box.data_bucket, ref.key, version_id=ref.version_id) if ref else None
        if not isinstance(got, Got):
            raise ReturnFailed("the staged timers snapshot at its sealed version is missing")
        body = got.body
    version = await put_acknowledged(lane.store, lane.bucket, staging_prefix(host, rb.id) + "timers/" + TIMERS, body,
                                     clock=box.clock)
    return {TIMERS: version}


__all__ = ["ReturnFailed", "ReturnLane", "publish_return", "restored_here"]
