"""The files manifest per installation (spec §0.5 L17, §7.6 ``local``, §8.3, §6.1 F4 to F6).

**Every installation writes a files manifest in its new generation** (L17): the installed files
directory (F4, without ``.files-gen``) and ``.env`` (F6) become create-only, content-addressed objects

- ``<location>/files/g-<P>/objects/<sha256>-<size>`` (one per distinct content), and one create-only
- ``<location>/files/g-<P>/manifest.json``, the **prepared manifest** at sequence 0, never replaced,

where ``P`` is the installation's generation: the prepared destination generation of a landing
(``g-<move id>``, never ``holder.generation``, rev 7.22 R19-1) or the generation a cold admission
opened. The manifest is bound to ``{location, P, op id, installation stamp}``, names the host and the
incarnation, and lists every folder (path, mode) and every file (path, mode, size, sha256, and the
object's origin-qualified reference: its region and full key, claim P6-D3). It is written **before**
``.files-gen`` (§7.6): ``.files-gen`` vouches for it. A replay reuses the objects it finds by digest
and the manifest by key (If-None-Match, so a late second write of other content fails).

**Restore** (§7.6 "Files reachability is independent of the database baseline"): a cold admission takes
the newest manifest on the admitted predecessor chain, verifies every object's size and sha256 as it
reads it, builds the directory in a scratch directory beside the destination and renames it into place
only when all of it verified. A missing object, a mismatch or a malformed manifest refuses with the
reason, and nothing is installed; missing or malformed manifest data is never an empty-files bootstrap.

The regular-file and folder rules are the archive's (§8.1, M-C14): a symlink, device, FIFO or socket
refuses with its name (:class:`services.box.artifacts.archive.UnsupportedEntry`). Building and validating the
manifest is pure; the store I/O goes through the :class:`~services.objstore.port.ObjectStore` port.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import msgspec

from events.claim import Claim
from kernel import rules
from kernel.fsutil import fsync_dir
from kernel.ports import blocking
from services.box.artifacts.archive import (
    ENV_NAME,
    FILES_ROOT,
    MARKER,
    ArchiveMissing,
    UnsupportedEntry,
    _Entry,
    _kind,
    _make_writable,
    _scan,
)
from services.box.artifacts.markers import FilesGen, files_generations, normalize, write_files_gen
from services.box.replica.layout import GenerationScope
from services.objstore.port import Got, Lost, ObjectStore

FORMAT: Literal["hostmove-files-manifest-v1"] = "hostmove-files-manifest-v1"
MANIFEST_NAME = "manifest.json"

rules.register(
    "files-manifest-verify",
    section="§7.6 'Files reachability', §8.3 (L17)",
    meaning="a files restore installs nothing unless every object has the manifest's size and sha256",
    site="services/box/artifacts/filesmanifest.py restore_files",
)
rules.register(
    "files-manifest-restore",
    section="§7.6 'a cold admission establishes its files manifest', §5.1 start check rule 2, §8.3 (L17)",
    meaning="a cold admission restores a missing or stale files directory from the newest manifest on the "
            "admitted chain before the app starts; missing manifest data is never an empty-files bootstrap",
    site="services/box/artifacts/filesmanifest.py decide_files; "
         "services/box/instance/activator.py Activator._files_step",
)


# -- errors ---------------------------------------------------------------------------------------


class FilesManifestError(Exception):
    """Base of the files manifest's refusals; the message is in the operator's words."""


class FilesManifestInvalid(FilesManifestError):
    """A stored manifest is malformed or bound to another installation."""


class FilesManifestConflict(FilesManifestError):
    """The generation already has a manifest naming other content (a prepared manifest is never replaced)."""


class FilesRestoreRefused(FilesManifestError):
    """A restore found a missing object, a size or sha256 mismatch, or an occupied destination;
    nothing was installed."""


# -- keys -----------------------------------------------------------------------------------------


def files_prefix(location: str, generation: str) -> str:
    """``<location>/files/g-<generation>/`` (§8.3): the generation's files namespace."""
    scope = GenerationScope(location, generation)
    if scope.is_origin:
        raise ValueError("the origin generation has no files namespace; only an installation's generation has one")
    return f"{scope.location}/files/g-{scope.generation}/"


def manifest_key(location: str, generation: str) -> str:
    return files_prefix(location, generation) + MANIFEST_NAME


def object_key(location: str, generation: str, sha256: str, size: int) -> str:
    """Content-addressed: equal content is one object, so a replay finds it by digest."""
    return f"{files_prefix(location, generation)}objects/{sha256}-{size}"


# -- the manifest (pure) --------------------------------------------------------------------------


class FilesEntry(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A regular file: its path relative to the files directory (``.env`` for F6), mode, size, sha256 and
    the object holding its bytes, origin-qualified by region and full key (claim P6-D3)."""

    path: str
    mode: int
    size: int
    sha256: str
    region: str
    key: str


class FilesFolder(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    path: str
    mode: int


class FilesManifest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``files/g-<P>/manifest.json``. ``files_dir`` false: the installation had no files directory."""

    format: Literal["hostmove-files-manifest-v1"]
    host: str
    incarnation: str
    location: str
    generation: str
    op: str
    stamp: int
    sequence: int
    region: str
    files_dir: bool
    root_mode: int
    folders: tuple[FilesFolder, ...]
    files: tuple[FilesEntry, ...]
    env: FilesEntry | None


@dataclass(frozen=True)
class Binding:
    """What a manifest is bound to (§7.6: ``{location, P, op id, installation stamp}``), and who wrote it."""

    host: str
    incarnation: str
    location: str
    generation: str
    op: str
    stamp: int
    region: str


_ENCODER = msgspec.json.Encoder(order="sorted")
_HEX = frozenset("0123456789abcdef")


def manifest_bytes(manifest: FilesManifest) -> bytes:
    """Canonical JSON (keys sorted, no whitespace): equal manifests are equal bytes, so a replay is a no-op."""
    return _ENCODER.encode(manifest)


def _check_rel(path: str, what: str) -> None:
    parts = path.split("/")
    if not path or path.startswith("/") or any(p in ("", ".", "..") for p in parts) or "\0" in path:
        raise FilesManifestInvalid(f"the files manifest names {what} {path!r}, which is not a clean relative path")
    if path == MARKER:
        raise FilesManifestInvalid(f"the files manifest names the protocol marker {MARKER} as a file")


def _check_mode(mode: int, what: str) -> None:
    if not 0 <= mode <= 0o7777:
        raise FilesManifestInvalid(f"the files manifest gives {what} the mode {mode}, which is not a permission mode")


def _check_entry(entry: FilesEntry, what: str) -> None:
    _check_mode(entry.mode, what)
    if entry.size < 0:
        raise FilesManifestInvalid(f"the files manifest gives {what} a negative size")
    if len(entry.sha256) != 64 or not set(entry.sha256) <= _HEX:
        raise FilesManifestInvalid(f"the files manifest gives {what} a sha256 that is not 64 lowercase hex digits")
    if not entry.region:
        raise FilesManifestInvalid(f"the files manifest names no region for {what}'s object")
    if "/files/g-" not in entry.key or not entry.key.endswith(f"/objects/{entry.sha256}-{entry.size}"):
        raise FilesManifestInvalid(f"the object of {what} ({entry.key}) is not the content-addressed object of its "
                                   "sha256 and size")


def validate(manifest: FilesManifest, *, location: str | None = None, generation: str | None = None) -> None:
    """Refuse a manifest that cannot be installed as it stands, or that is bound elsewhere (pure)."""
    if manifest.format != FORMAT:
        raise FilesManifestInvalid(f"the files manifest has format {manifest.format!r}, not {FORMAT}")
    if location is not None and manifest.location.strip("/") != location.strip("/"):
        raise FilesManifestInvalid(f"the files manifest belongs to location {manifest.location}, not {location}")
    if generation is not None and normalize(manifest.generation) != normalize(generation):
        raise FilesManifestInvalid(f"the files manifest belongs to generation {manifest.generation}, "
                                   f"not {generation}")
    if manifest.sequence < 0 or manifest.stamp < 0:
        raise FilesManifestInvalid("the files manifest has a negative sequence or stamp")
    _check_mode(manifest.root_mode, "the files directory")
    if not manifest.files_dir and (manifest.folders or manifest.files):
        raise FilesManifestInvalid("the files manifest lists files for an installation without a files directory")
    folders: set[str] = set()
    previous = ""
    for folder in manifest.folders:
        _check_rel(folder.path, "the folder")
        _check_mode(folder.mode, f"the folder {folder.path}")
        if folder.path <= previous:
            raise FilesManifestInvalid(f"the folder {folder.path!r} is a duplicate or out of sorted order")
        parent = folder.path.rpartition("/")[0]
        if parent and parent not in folders:
            raise FilesManifestInvalid(f"the folder {folder.path!r} comes without its parent folder")
        folders.add(folder.path)
        previous = folder.path
    previous = ""
    for entry in manifest.files:
        _check_rel(entry.path, "the file")
        _check_entry(entry, f"the file {entry.path}")
        if entry.path <= previous:
            raise FilesManifestInvalid(f"the file {entry.path!r} is a duplicate or out of sorted order")
        if entry.path in folders:
            raise FilesManifestInvalid(f"{entry.path!r} is named both as a file and as a folder")
        parent = entry.path.rpartition("/")[0]
        if parent and parent not in folders:
            raise FilesManifestInvalid(f"the file {entry.path!r} comes without its parent folder")
        previous = entry.path
    if manifest.env is not None:
        if manifest.env.path != ENV_NAME:
            raise FilesManifestInvalid(f"the files manifest's .env entry is named {manifest.env.path!r}")
        _check_entry(manifest.env, ENV_NAME)


def decode_manifest(data: bytes, *, location: str | None = None, generation: str | None = None) -> FilesManifest:
    try:
        manifest = msgspec.json.decode(data, type=FilesManifest)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise FilesManifestInvalid(f"the files manifest is malformed ({exc})") from None
    validate(manifest, location=location, generation=generation)
    return manifest


def build_manifest(binding: Binding, *, files_dir: bool, root_mode: int, folders: Iterable[FilesFolder],
                   files: Iterable[FilesEntry], env: FilesEntry | None) -> FilesManifest:
    """The prepared manifest of an installation (sequence 0), sorted and validated."""
    manifest = FilesManifest(
        format=FORMAT, host=binding.host, incarnation=binding.incarnation, location=binding.location.strip("/"),
        generation=normalize(binding.generation), op=binding.op, stamp=binding.stamp, sequence=0,
        region=binding.region, files_dir=files_dir, root_mode=root_mode,
        folders=tuple(sorted(folders, key=lambda f: f.path)), files=tuple(sorted(files, key=lambda f: f.path)),
        env=env,
    )
    validate(manifest, location=binding.location, generation=binding.generation)
    return manifest


# -- the cold admission's files decision (pure) ---------------------------------------------------


@dataclass(frozen=True)
class KeepFiles:
    """The files on the box stay as they are (the start check judges them)."""

    reason: str


@dataclass(frozen=True)
class RestoreFiles:
    """Restore from the newest manifest on the chain; ``park`` the stale directory first (§6.3, INV-8)."""

    reason: str
    park: bool


def decide_files(claim: Claim, files_dir_exists: bool, files_gen: FilesGen | None, *,
                 box: str | None = None) -> KeepFiles | RestoreFiles:
    """§5.1 start check rule 2 and §7.6: files tagged with ``holder.generation``, its cold predecessor or a
    generation of this box's current stay (:func:`files_generations`) are this installation's; missing ones, or
    stale ones of this incarnation, come back from the manifest. Another incarnation's files are never touched:
    the start check refuses them."""
    holder = claim.holder
    assert holder is not None
    if not rules.on("files-manifest-restore"):
        return KeepFiles("files are not restored (rule files-manifest-restore is off)")
    if not files_dir_exists:
        return RestoreFiles("the files directory is missing on this box", park=False)
    op = normalize(files_gen.op) if files_gen is not None else ""
    incarnation = files_gen.incarnation if files_gen is not None else holder.incarnation
    if incarnation != holder.incarnation:
        return KeepFiles("the files belong to another incarnation; the start check refuses them")
    if op in files_generations(claim, box):
        return KeepFiles("the files are tagged for this installation")
    return RestoreFiles(f"the files on this box are from generation {op or 'origin'}, an earlier stay", park=True)


def manifest_chain(claim: Claim) -> list[str]:
    """The admitted chain newest first (``holder.generation``, then every admission and its predecessor), the
    origin left out: it has no files namespace."""
    assert claim.holder is not None
    chain = [normalize(claim.holder.generation)]
    for adm in reversed(claim.holder.admissions):
        for gen in (adm.generation, adm.predecessor.generation if adm.predecessor else None):
            if gen is not None and normalize(gen) not in chain:
                chain.append(normalize(gen))
    return [g for g in chain if g]


# -- publishing -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Published:
    manifest: FilesManifest
    key: str
    version_id: str | None
    reused: bool  # the manifest was already there with this content (a replay)


def _read_regular(path: str, shown: str, host: str) -> tuple[bytes, int]:
    """The bytes and mode of a regular file, never through a link (the archive's rule, M-C14)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsupportedEntry(host, shown, _kind(st.st_mode))
        chunks = []
        while piece := os.read(fd, 1 << 20):
            chunks.append(piece)
        return b"".join(chunks), stat.S_IMODE(st.st_mode)
    finally:
        os.close(fd)


def _md5_etag(body: bytes) -> str:
    return hashlib.md5(body).hexdigest()


async def _put_object(store: ObjectStore, bucket: str, key: str, body: bytes) -> None:
    """Create-only; an object already at the key must hold these bytes (a replay reuses it by digest)."""
    if not isinstance(await store.put(bucket, key, body, if_none_match=True), Lost):
        return
    current = await store.head(bucket, key)
    if isinstance(current, Got) and current.etag.strip('"') == _md5_etag(body):
        return
    raise FilesManifestConflict(f"the files object {key} already exists with other bytes; it is content-addressed, "
                                "so the store holds a damaged copy")


async def publish_manifest(store: ObjectStore, bucket: str, binding: Binding, files_dir: Path,
                           env_file: Path | None) -> Published:
    """Publish the installed files directory and ``.env`` as ``binding.generation``'s prepared manifest (§7.6,
    §8.3): the objects first, then the manifest, all create-only. Refuses a path that is not a regular file or
    a folder with its name (M-C14) before anything is written. A manifest already there with the same bytes
    is a replay; with other bytes, :class:`FilesManifestConflict`."""
    host = binding.host
    env = env_file if env_file is not None and os.path.lexists(env_file) else None
    has_dir = os.path.lexists(files_dir)
    try:
        entries = await blocking(_scan, files_dir, env, host) if has_dir else []
    except ArchiveMissing as exc:
        raise FilesManifestError(str(exc)) from None
    if not has_dir and env is not None:
        st = os.lstat(env)
        if not stat.S_ISREG(st.st_mode):
            raise UnsupportedEntry(host, ENV_NAME, _kind(st.st_mode))
        entries = [_Entry(ENV_NAME, str(env), False)]
    root_mode = stat.S_IMODE(os.lstat(files_dir).st_mode) if has_dir else 0
    folders: list[FilesFolder] = []
    files: list[FilesEntry] = []
    env_entry: FilesEntry | None = None
    for entry in entries:
        if entry.name == FILES_ROOT:
            continue
        rel = ENV_NAME if entry.name == ENV_NAME else entry.name[len(FILES_ROOT) + 1:]
        if entry.is_dir:
            folders.append(FilesFolder(path=rel, mode=stat.S_IMODE(os.lstat(entry.src).st_mode)))
            continue
        body, mode = await blocking(_read_regular, entry.src, rel, host)
        sha = hashlib.sha256(body).hexdigest()
        key = object_key(binding.location, binding.generation, sha, len(body))
        await _put_object(store, bucket, key, body)
        item = FilesEntry(path=rel, mode=mode, size=len(body), sha256=sha, region=binding.region, key=key)
        if entry.name == ENV_NAME:
            env_entry = item
        else:
            files.append(item)
    manifest = build_manifest(binding, files_dir=has_dir, root_mode=root_mode, folders=folders, files=files,
                              env=env_entry)
    body = manifest_bytes(manifest)
    key = manifest_key(binding.location, binding.generation)
    out = await store.put(bucket, key, body, if_none_match=True)
    if not isinstance(out, Lost):
        return Published(manifest, key, out.version_id, reused=False)
    existing = await store.get(bucket, key)
    if isinstance(existing, Got) and existing.body == body:
        return Published(manifest, key, existing.version_id, reused=True)
    raise FilesManifestConflict(f"generation {binding.generation} already has a files manifest naming other files; "
                                "a prepared manifest is never replaced")


# -- reading and restoring ------------------------------------------------------------------------


@dataclass(frozen=True)
class ManifestRead:
    manifest: FilesManifest
    key: str
    version_id: str | None


async def read_manifest(store: ObjectStore, bucket: str, location: str, generation: str) -> ManifestRead | None:
    """The generation's manifest, ``None`` when it has none; a malformed one raises :class:`FilesManifestInvalid`."""
    key = manifest_key(location, generation)
    got = await store.get(bucket, key)
    if not isinstance(got, Got):
        return None
    return ManifestRead(decode_manifest(got.body, location=location, generation=generation), key, got.version_id)


async def newest_manifest(store: ObjectStore, bucket: str, location: str,
                          chain: Sequence[str]) -> ManifestRead | None:
    """The newest manifest on the chain (newest first, §7.6). It is create-only and never replaced, so the one
    read is one exact version, which :class:`ManifestRead` names."""
    for generation in chain:
        if not normalize(generation):
            continue
        found = await read_manifest(store, bucket, location, generation)
        if found is not None:
            return found
    return None


@dataclass(frozen=True)
class Restored:
    generation: str
    files: int
    bytes: int
    env: bool


async def _fetch(store: ObjectStore, bucket: str, manifest: FilesManifest, entry: FilesEntry, region: str) -> bytes:
    where = f"{entry.path} (object {entry.key})"
    if entry.region != region:
        raise FilesRestoreRefused(f"the files manifest of generation {manifest.generation} names {where} in region "
                                  f"{entry.region}; this box restores only from its own region {region}")
    got = await store.get(bucket, entry.key)
    if not isinstance(got, Got):
        raise FilesRestoreRefused(f"the files manifest of generation {manifest.generation} names {where}, which "
                                  "is missing from the store; nothing was installed")
    if rules.on("files-manifest-verify") and (
        len(got.body) != entry.size or hashlib.sha256(got.body).hexdigest() != entry.sha256
    ):
        raise FilesRestoreRefused(f"the stored bytes of {where} differ from the files manifest of generation "
                                  f"{manifest.generation}; nothing was installed")
    return got.body


def _write_new(path: str, body: bytes, mode: int, fsync: bool) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        view = memoryview(body)
        while view:
            view = view[os.write(fd, view):]
        os.fchmod(fd, mode)
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)


async def restore_files(store: ObjectStore, bucket: str, manifest: FilesManifest, *, region: str, files_dir: Path,
                        env_file: Path | None, tag: FilesGen | None, fsync: bool = True) -> Restored:
    """Install the manifest's files directory (and ``.env``) at ``files_dir``, which must not exist.

    Every object is fetched and verified (size, sha256) into a scratch directory beside ``files_dir``;
    ``tag`` is written as ``.files-gen`` inside it; only then is it renamed into place (``.env`` first, the
    directory last, so a present directory vouches for both). On any refusal nothing is installed."""
    validate(manifest)
    if os.path.lexists(files_dir):
        raise FilesRestoreRefused(f"{files_dir} already exists; a files restore writes only a fresh directory")
    parent = files_dir.parent
    parent.mkdir(parents=True, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix=f".{files_dir.name}.files-restore-", dir=parent)
    root = os.path.join(scratch, FILES_ROOT)
    total = 0
    try:
        if manifest.files_dir:
            os.mkdir(root, 0o700)
            for folder in manifest.folders:
                os.mkdir(os.path.join(root, folder.path), 0o700)
            for entry in manifest.files:
                body = await _fetch(store, bucket, manifest, entry, region)
                await blocking(_write_new, os.path.join(root, entry.path), body, entry.mode, fsync)
                total += len(body)
            if tag is not None:
                write_files_gen(Path(root), tag.op, tag.incarnation)
        env_body = await _fetch(store, bucket, manifest, manifest.env, region) if manifest.env is not None else None
        if env_body is not None and manifest.env is not None:
            _write_new(os.path.join(scratch, ENV_NAME), env_body, manifest.env.mode, fsync)
            total += len(env_body)
        if manifest.files_dir:
            for folder in sorted(manifest.folders, key=lambda f: len(f.path), reverse=True):
                path = os.path.join(root, folder.path)
                if fsync:
                    fsync_dir(path)
                os.chmod(path, folder.mode)
            if fsync:
                fsync_dir(root)
        if env_body is not None:
            if env_file is None:
                raise FilesRestoreRefused("the files manifest carries a .env but no place for it was given")
            os.replace(os.path.join(scratch, ENV_NAME), env_file)
        if manifest.files_dir:
            os.rename(root, files_dir)
            os.chmod(files_dir, manifest.root_mode)  # after the rename: moving a folder needs it writable
        if fsync:
            fsync_dir(parent)
    finally:
        _make_writable(scratch)
        shutil.rmtree(scratch, ignore_errors=True)
    return Restored(manifest.generation, len(manifest.files), total, env_body is not None)


__all__ = [
    "FORMAT", "Binding", "FilesEntry", "FilesFolder", "FilesManifest", "FilesManifestConflict", "FilesManifestError",
    "FilesManifestInvalid", "FilesRestoreRefused", "KeepFiles", "ManifestRead", "Published", "RestoreFiles",
    "Restored", "build_manifest", "decide_files", "decode_manifest", "files_prefix", "manifest_bytes",
    "manifest_chain", "manifest_key", "newest_manifest", "object_key", "publish_manifest", "read_manifest",
    "restore_files", "validate",
]
