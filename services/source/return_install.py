"""The source's install of a dirty return (spec §7.8 "Source recovery", dirty; D§3.6 step 4): the landing's install
phases of §7.6, run on the source from the return lane ``moves/<host>/<rb>/`` of its own region's bucket into the
rollback's own generation ``g-<rb>/``.

| phase      | effects (each replayable, as §7.6 states them)                                           |
|------------|------------------------------------------------------------------------------------------|
| parking    | bucket-park what is at ``holder.location`` (the pre-move generations the return          |
|            | supersedes) into ``superseded/<host>/<rb>/``: manifest first, then its deletion set      |
| building   | restore the sealed return versions with the planner (CRC-64 trailers, exactly ``N'``,    |
|            | ``integrity_check``); the install routine writes ``g-<rb>``'s intent, snapshot ``[1, N']``, |
|            | anchor ``[N', N']`` and ``install.json``                                                 |
| published  | journal only: ``generation.json`` is the probe admission's (R10-3)                        |
| local      | ``retire-artifacts(S)``: the pre-move database, ``.gen``, files and ``.env`` into          |
|            | ``.parked/superseded-<rb>/``; the returned files and ``.env`` extracted; ``ReplaceTimers`` |
|            | from the returned snapshot; the prepared files manifest of ``g-<rb>`` (L17); ``.files-gen`` last |
| configured | the inputs the source renders **now**, recorded as ``recovery.inputs``; never gated on    |
|            | ``move.inputs`` (rule ``recovery-current-inputs``, J2-R2-5)                              |
| restored   | the built database verified (sha256 = the manifest's, ``CheckDB``), put in place, ``.gen`` |

The install runs under the source's pre-move stamp ``S`` (the ``claimed`` CAS wrote it back); the probe's cold
admission into ``g-<rb>`` (:meth:`services.box.instance.activator.Activator.wake` with ``prepared``) issues ``R``.
A failure raises :class:`InstallRefused` with the reason: the move records ``stuck`` (an operator's case, §7.10), and
nothing is lost: the return lane and the target's released state stay where they are.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import msgspec

from events.claim import Claim
from events.record import Move, MoveInputs, ReturnSeal, Rollback
from kernel import rules
from kernel.fsutil import fsync_dir
from kernel.ports import Clock, blocking
from services.box.artifacts.archive import ENV_NAME, FILES_ROOT, ArchiveError, extract
from services.box.artifacts.filesmanifest import Binding, FilesManifestError, publish_manifest
from services.box.artifacts.markers import read_files_gen, write_files_gen, write_local_gen
from services.box.artifacts.sealing import PrivateKey
from services.box.instance.registry import Registry
from services.box.instance.sandbox import instance_dir
from services.box.instance.timers import TimerError, TimerRow, Timers
from services.box.replica.install import InstallError, build_generation, read_install
from services.box.replica.restore import RestoreRefused, restore_files
from services.objstore.port import Got, ObjectStore
from services.source.preparing import LaunchInputs, pinned_inputs_differ
from services.target.worker import Seal, check_db, park_location, seal_files, staging_prefix

log = logging.getLogger("hostmove.source.return")

rules.register(
    "recovery-current-inputs",
    section="§7.8 dirty configured; §7.7 (a recovery probe requires the inputs it rendered itself, now); J2-R2-5; "
            "model rule recovery-current-inputs",
    meaning="a recovery install renders the inputs current now and records them; it is never gated on move.inputs",
    site="services/source/return_install.py ReturnInstall._configured",
)


class InstallRefused(Exception):
    """The dirty install cannot go on; the move is ``stuck`` with this reason."""


@dataclass
class ReturnInstall:
    """One source box's install of its dirty returns (the ports of :class:`services.box.instance.activator.BoxContext`
    it needs, its key for the returned archive, and what its next spawn would get now)."""

    label: str
    region: str
    box_dir: Path
    data_store: ObjectStore
    data_bucket: str
    registry: Registry
    timers: Timers
    clock: Clock
    private_key: PrivateKey
    launch: Callable[[str], Awaitable[LaunchInputs]]
    faults: Callable[[str], None] | None = None

    def _fault(self, point: str) -> None:
        if self.faults is not None:
            self.faults(point)

    def db_path(self, host: str) -> Path:
        return instance_dir(self.box_dir / "data", host) / f"{host}.db"

    def files_dir(self, host: str) -> Path:
        return instance_dir(self.box_dir / "data", host) / host

    def env_path(self, host: str) -> Path:
        return instance_dir(self.box_dir / "data", host) / f"{host}.env"

    def journal_dir(self, host: str, rb_id: str) -> Path:
        """F12: ``<box>/.moves/<host>/<rb>/``."""
        return self.box_dir / ".moves" / host / rb_id

    def _build_db(self, host: str, rb_id: str) -> Path:
        return self.journal_dir(host, rb_id) / "build.db"

    async def phase(self, phase: str, host: str, claim: Claim, move: Move, rb: Rollback) -> dict[str, object]:
        """Run ``phase``'s effects; answers the fields the next phase's journal CAS records with it."""
        if rb.seal is None:
            raise InstallRefused("the rollback records no return seal; nothing returned can be installed")
        if claim.holder is None:
            raise InstallRefused("the claim names no holder")
        self._fault(f"return:before_effects:{phase}")
        out: dict[str, object] = {}
        if phase == "parking":
            park = f"superseded/{staging_prefix(host, rb.id)[len('moves/'):]}"
            await park_location(self.data_store, self.data_bucket, claim.holder.location, park)
        elif phase == "building":
            await self._building(host, claim, rb, rb.seal)
        elif phase == "local":
            await self._local(host, claim, move, rb, rb.seal)
        elif phase == "configured":
            out["recovery_inputs"] = await self._configured(host, move)
        elif phase == "restored":
            await self._restored(host, claim, rb)
        elif phase != "published":
            raise InstallRefused(f"{phase!r} is not an install phase")
        self._fault(f"return:after_effects:{phase}")
        return out

    @staticmethod
    def _seal(seal: ReturnSeal) -> Seal:
        return Seal(n=seal.n, replica=dict(seal.replica), timers=dict(seal.timers), files=dict(seal.files))

    async def _building(self, host: str, claim: Claim, rb: Rollback, seal: ReturnSeal) -> None:
        assert claim.holder is not None
        location = claim.holder.location
        db = self._build_db(host, rb.id)
        if await read_install(self.data_store, self.data_bucket, location, rb.id) is not None and db.exists():
            return
        db.parent.mkdir(parents=True, exist_ok=True)
        for path in (db, Path(f"{db}-wal"), Path(f"{db}-shm")):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        try:
            await restore_files(self.data_store, self.data_bucket, seal_files(self._seal(seal), host, rb.id), db,
                                required_txid=seal.n)
        except RestoreRefused as exc:
            raise InstallRefused(f"the returned replica does not restore: {exc}") from None
        self._fault("return:building:restored")
        try:
            await build_generation(self.data_store, self.data_bucket, location, rb.id, host, db, seal.n, self.clock)
        except InstallError as exc:
            raise InstallRefused(f"the return generation could not be built: {exc}") from None

    async def _get(self, key: str, version: str) -> bytes:
        got = await self.data_store.get(self.data_bucket, key, version_id=version)
        if not isinstance(got, Got):
            raise InstallRefused(f"the sealed version of {key} is missing from the return lane")
        return got.body

    async def _local(self, host: str, claim: Claim, move: Move, rb: Rollback, seal: ReturnSeal) -> None:
        """``retire-artifacts(S)``, the returned files, ``.env`` and timers, the prepared manifest, ``.files-gen``
        last (§7.6 ``local`` on the source)."""
        assert claim.holder is not None
        files_dir, env = self.files_dir(host), self.env_path(host)
        done = read_files_gen(files_dir) if files_dir.exists() else None
        if done is not None and (done.op, done.incarnation) == (rb.id, move.incarnation):
            return
        data = self.box_dir / "data"
        instance_dir(data, host).mkdir(parents=True, exist_ok=True)
        parked = data / ".parked" / f"superseded-{rb.id}"
        db = self.db_path(host)
        for path in (db, Path(f"{db}-wal"), Path(f"{db}-shm"), db.with_suffix(".gen"), files_dir, env):
            if os.path.lexists(path):
                parked.mkdir(parents=True, exist_ok=True)
                target = parked / path.name
                if os.path.lexists(target):  # a replay after a crash mid-rename: the first copy is the old one
                    shutil.rmtree(path) if path.is_dir() else path.unlink()
                else:
                    os.rename(path, target)
        fsync_dir(data)
        prefix = staging_prefix(host, rb.id)
        if "archive.sealed" not in seal.files or "manifest.json" not in seal.files:
            raise InstallRefused("the return seal names no files archive")
        sealed = await self._get(prefix + "files/archive.sealed", seal.files["archive.sealed"])
        manifest = await self._get(prefix + "files/manifest.json", seal.files["manifest.json"])
        scratch = self.journal_dir(host, rb.id) / "extract"
        if scratch.exists():
            shutil.rmtree(scratch)
        try:
            await blocking(extract, sealed, manifest, self.private_key, scratch, expect_op=rb.id,
                           expect_incarnation=move.incarnation)
        except (ArchiveError, ValueError) as exc:
            raise InstallRefused(f"the returned files archive does not open on this box: {exc}") from None
        os.rename(scratch / FILES_ROOT, files_dir)
        if (scratch / ENV_NAME).exists():
            os.rename(scratch / ENV_NAME, env)
        fsync_dir(data)
        if "timers.json" not in seal.timers:
            raise InstallRefused("the return seal names no timers snapshot")
        try:
            rows = msgspec.json.decode(await self._get(prefix + "timers/timers.json", seal.timers["timers.json"]),
                                       type=list[TimerRow])
            self.timers.replace_timers(host, rows)  # §9.4: the target's bookkeeping: nothing delivered runs again
        except (msgspec.DecodeError, msgspec.ValidationError, TimerError) as exc:
            raise InstallRefused(f"the returned timers cannot be installed: {exc}") from None
        binding = Binding(host=host, incarnation=move.incarnation, location=claim.holder.location,
                          generation=rb.id, op=rb.id, stamp=claim.holder.stamp, region=self.region)
        try:
            await publish_manifest(self.data_store, self.data_bucket, binding, files_dir, env)
        except (FilesManifestError, ArchiveError, ValueError) as exc:
            raise InstallRefused(f"the returned files could not be published as the files manifest of "
                                 f"generation {rb.id}: {exc}") from None
        write_files_gen(files_dir, rb.id, move.incarnation)
        fsync_dir(files_dir)

    async def _configured(self, host: str, move: Move) -> MoveInputs:
        """The inputs the source renders now (``recovery.inputs``): a recovery is what the source would run had
        there been no move (§7.7), so a bundle published during the move is the one it runs."""
        launch = await self.launch(host)
        current = MoveInputs(bundle_etags=dict(launch.bundle_etags), overlay_etag=launch.overlay_etag,
                             release=launch.release)
        if not rules.on("recovery-current-inputs"):  # the mutation: gated on the inputs the move pinned
            pinned = msgspec.structs.replace(move.inputs, files_plain="", env_report="")
            changed = pinned_inputs_differ(pinned, current)
            if changed is not None:
                raise InstallRefused(f"configuration changed during the move ({changed})")
        return current

    async def _restored(self, host: str, claim: Claim, rb: Rollback) -> None:
        assert claim.holder is not None
        manifest = await read_install(self.data_store, self.data_bucket, claim.holder.location, rb.id)
        if manifest is None:
            raise InstallRefused("building left no completed install manifest")
        db, build = self.db_path(host), self._build_db(host, rb.id)
        if not build.exists():
            if db.exists() and await blocking(check_db, db) == (manifest.db_sha256, "ok"):
                return  # a replay after the rename
            raise InstallRefused("the built database is gone before it was verified")
        sha, integrity = await blocking(check_db, build)
        if integrity != "ok":
            raise InstallRefused(f"the built database fails its integrity check: {integrity[:200]}")
        if sha != manifest.db_sha256:
            raise InstallRefused("the built database's sha256 differs from the install manifest's")
        for path in (db, Path(f"{db}-wal"), Path(f"{db}-shm")):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        os.rename(build, db)
        fsync_dir(db.parent)
        write_local_gen(db, rb.id)


__all__ = ["InstallRefused", "ReturnInstall"]
