"""App releases in the deployment bucket, and a box's staged copies of them (issue 18).

- :func:`publish`: ``apps/<name>/releases/<n>.json``, create-only (If-None-Match), ``n`` one past the newest; its
  secrets sealed to the deployment's published key (``control/secrets-key.json``, §10), its files read beside the
  manifest. Answers the release and the :class:`~events.claim.AppRef` a host's claim names (name, number, digest).
- :func:`read_release` / :func:`list_releases`: the stored releases; a read with a ref verifies the digest.
- :class:`ReleaseBook`: a box's staged releases, ``<box>/releases/<name>/<n>/`` (``release.json``, the verified bytes,
  and the release's files): :meth:`ReleaseBook.stage` fetches, verifies by digest and writes them (T7, §7.3: "the
  pinned release materializes" on this box); :meth:`ReleaseBook.staged` reads a staged one back, verified again.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import shutil
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote

from events.base import canonical, decode
from events.claim import AppRef
from kernel.fsutil import atomic_write, fsync_dir
from kernel.ports import Clock, Random, SystemRandom, blocking
from services.apps.manifest import (
    Manifest,
    ManifestError,
    Release,
    ReleaseFile,
    build_release,
    check_release,
    digest,
    parse_manifest,
    release_bytes,
    release_file,
    secret_aad,
)
from services.box.artifacts.sealing import SealError, load_public_key, seal_key, secrets_key_fp
from services.box.roster import read_deployment_key
from services.objstore.port import Got, Lost, ObjectStore

APPS_PREFIX = "apps/"


class ReleaseError(Exception):
    """A release that cannot be published, read or staged; the message says why in the operator's words."""


def release_key(name: str, number: int) -> str:
    return f"{APPS_PREFIX}{quote(name, safe='')}/releases/{number}.json"


async def list_releases(store: ObjectStore, bucket: str, name: str | None = None) -> dict[str, list[int]]:
    """Every app (or ``name`` only) and its release numbers, ascending."""
    prefix = APPS_PREFIX if name is None else f"{APPS_PREFIX}{quote(name, safe='')}/releases/"
    out: dict[str, list[int]] = {}
    for key in await store.list_keys(bucket, prefix):
        parts = key[len(APPS_PREFIX):].split("/")
        if len(parts) != 3 or parts[1] != "releases" or not parts[2].endswith(".json"):
            continue
        number = parts[2][: -len(".json")]
        if number.isdigit():
            out.setdefault(parts[0], []).append(int(number))
    return {app: sorted(numbers) for app, numbers in sorted(out.items())}


async def read_release(store: ObjectStore, bucket: str, name: str, number: int | None = None, *,
                       ref: AppRef | None = None) -> tuple[Release, AppRef, bytes]:
    """Release ``number`` of ``name`` (the newest when None), checked; with ``ref``, its bytes must hash to
    ``ref.digest`` (a release is never trusted on its name alone)."""
    if ref is not None:
        name, number = ref.name, ref.release
    if number is None:
        numbers = (await list_releases(store, bucket, name)).get(name, [])
        if not numbers:
            raise ReleaseError(f"the app {name} has no published release; publish one with hostmove app publish")
        number = numbers[-1]
    got = await store.get(bucket, release_key(name, number))
    if not isinstance(got, Got):
        raise ReleaseError(f"release {name}@{number} is not published")
    found = digest(got.body)
    if ref is not None and found != ref.digest:
        raise ReleaseError(f"release {name}@{number} does not match its digest: the host pins {ref.digest}, the "
                           f"stored object hashes to {found}")
    try:
        release = decode(got.body, Release)
        check_release(release, name=name, number=number)
    except (ValueError, ManifestError) as exc:
        raise ReleaseError(f"release {name}@{number} cannot be read: {exc}") from None
    return release, AppRef(name=name, release=number, digest=found), got.body


def read_files(manifest: Manifest, base: Path) -> list[ReleaseFile]:
    """The manifest's files, read beside it (regular files only)."""
    out = []
    for rel in manifest.files:
        path = base / rel
        if path.is_symlink() or not path.is_file():
            raise ReleaseError(f"{path} is not a regular file beside the manifest")
        out.append(release_file(rel, path.read_bytes(), path.stat().st_mode))
    return out


def load_manifest(path: Path, *, name: str, env: Mapping[str, str] | None = None,
                  secrets: Mapping[str, str] | None = None) -> tuple[Manifest, list[ReleaseFile]]:
    """Read the manifest at ``path`` (TOML) for app ``name``, with ``env`` and ``secrets`` added to its tables (what
    a publisher sets beside the file: the sample app's tunables), and the files it ships."""
    try:
        doc = tomllib.loads(path.read_text())
    except OSError as exc:
        raise ReleaseError(f"the manifest {path} cannot be read: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ReleaseError(f"the manifest {path} is not TOML: {exc}") from None
    for table, extra in (("env", env), ("secrets", secrets)):
        if extra:
            doc[table] = {**doc.get(table, {}), **extra}
    try:
        manifest = parse_manifest(doc, name=name)
    except ManifestError as exc:
        raise ReleaseError(f"{path}: {exc}") from None
    return manifest, read_files(manifest, path.parent)


async def publish(store: ObjectStore, bucket: str, manifest: Manifest, files: Sequence[ReleaseFile], *, clock: Clock,
                  rng: Random | None = None, attempts: int = 5) -> tuple[Release, AppRef]:
    """Publish ``manifest`` as the app's next release (module doc). Two publishers racing for one number: one write
    wins, the other takes the next number."""
    rng = rng or SystemRandom()
    key = await read_deployment_key(store, bucket)
    if key is None:
        raise ReleaseError("the deployment has no published secrets key, so no secret can be sealed: run "
                           "hostmove deployment init first")
    try:
        public = load_public_key(key.public_key)
    except SealError as exc:
        raise ReleaseError(f"the deployment's published key cannot be used: {exc}") from None
    if secrets_key_fp(public) != key.fp:
        raise ReleaseError("the deployment's published key does not match its own fingerprint")
    for _ in range(attempts):
        numbers = (await list_releases(store, bucket, manifest.name)).get(manifest.name, [])
        number = (numbers[-1] if numbers else 0) + 1
        sealed = {name: seal_key(value.encode(), public, rng, aad=secret_aad(manifest.name, number, name))
                  for name, value in manifest.secrets.items()}
        try:
            release = build_release(manifest, release=number, published_at=clock.now_ms(), key_fp=key.fp,
                                    sealed=sealed, files=files)
        except (ValueError, ManifestError) as exc:
            raise ReleaseError(str(exc)) from None
        body = release_bytes(release)
        if isinstance(await store.put(bucket, release_key(manifest.name, number), body, if_none_match=True), Lost):
            continue
        return release, AppRef(name=manifest.name, release=number, digest=digest(body))
    raise ReleaseError(f"other publishers of {manifest.name} kept taking the next release number; try again")


DEFAULT_APP_KEY = "control/default-app.json"


async def set_default_app(store: ObjectStore, bucket: str, ref: AppRef) -> None:
    """Name the release a host whose claim names none runs (a host created before app releases, or by a composition
    that creates hosts without one): ``control/default-app.json``, rewritten whole."""
    await store.put(bucket, DEFAULT_APP_KEY, canonical(ref))


async def read_default_app(store: ObjectStore, bucket: str) -> AppRef | None:
    got = await store.get(bucket, DEFAULT_APP_KEY)
    return decode(got.body, AppRef) if isinstance(got, Got) else None


# -- a box's staged releases ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Staged:
    """A release staged on this box: verified by its digest, its files under ``dir``."""

    release: Release
    ref: AppRef
    dir: Path


@dataclass
class ReleaseBook:
    """``<box>/releases/<name>/<n>/`` (module doc). ``store``/``bucket`` are the deployment bucket's."""

    root: Path
    store: ObjectStore
    bucket: str
    _locks: dict[str, asyncio.Lock] = field(default_factory=dict)

    def dir(self, ref: AppRef) -> Path:
        return self.root / ref.name / str(ref.release)

    def staged(self, ref: AppRef) -> Staged | None:
        """The staged copy of ``ref``, verified again (bytes by digest, every file by its sha256); None when it is
        not staged or does not verify."""
        where = self.dir(ref)
        try:
            body = (where / "release.json").read_bytes()
        except OSError:
            return None
        if digest(body) != ref.digest:
            return None
        try:
            release = decode(body, Release)
            check_release(release, name=ref.name, number=ref.release)
        except (ValueError, ManifestError):
            return None
        for f in release.files:
            try:
                if hashlib.sha256((where / "files" / f.path).read_bytes()).hexdigest() != f.sha256:
                    return None
            except OSError:
                return None
        return Staged(release, ref, where / "files")

    async def stage(self, ref: AppRef) -> Staged:
        """Stage ``ref`` on this box when it is not staged (idempotent); :class:`ReleaseError` says why it cannot
        be (a read error of the store propagates: it never acts)."""
        lock = self._locks.setdefault(f"{ref.name}/{ref.release}", asyncio.Lock())
        async with lock:
            have = await blocking(self.staged, ref)
            if have is not None:
                return have
            _release, _ref, body = await read_release(self.store, self.bucket, ref.name, ref=ref)
            await blocking(self._write, ref, body)
            have = await blocking(self.staged, ref)
            if have is None:
                raise ReleaseError(f"release {ref.name}@{ref.release} was staged on this box but does not verify")
            return have

    def _write(self, ref: AppRef, body: bytes) -> None:
        release = decode(body, Release)
        where = self.dir(ref)
        tmp = where.with_name(f".{where.name}.{os.getpid()}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / "files").mkdir(parents=True, mode=0o755)
        for f in release.files:
            path = tmp / "files" / f.path
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(path, f.body, mode=f.mode or 0o644)
        atomic_write(tmp / "release.json", body, mode=0o644)
        shutil.rmtree(where, ignore_errors=True)  # a copy that did not verify
        where.parent.mkdir(parents=True, exist_ok=True)
        os.rename(tmp, where)
        fsync_dir(where.parent)

    def forget(self, ref: AppRef) -> None:
        """Remove a staged copy (tests; an operator's cleanup)."""
        with contextlib.suppress(FileNotFoundError):
            shutil.rmtree(self.dir(ref))


def describe(release: Release, ref: AppRef) -> Mapping[str, object]:
    """What ``hostmove app show`` prints: everything but the sealed values and the files' bytes."""
    return {
        "app": release.name, "release": release.release, "digest": ref.digest, "published_at": release.published_at,
        "sealed_to": release.key_fp, "command": list(release.command),
        "env": {v.name: v.value for v in release.env}, "secrets": [s.name for s in release.secrets],
        "files": [{"path": f.path, "sha256": f.sha256, "bytes": len(f.body)} for f in release.files],
        "ready_path": release.ready_path, "ready_within_s": release.ready_within_s, "timers": release.timers,
        "files_dir": release.files_dir, "sidecar_env": release.sidecar_env,
        "stores": [{"name": s.name, "private": s.private} for s in release.stores],
        "registry": {c.name: c.value for c in release.registry},
    }


__all__ = [
    "APPS_PREFIX", "DEFAULT_APP_KEY", "ReleaseBook", "ReleaseError", "Staged", "describe", "list_releases",
    "load_manifest", "publish", "read_default_app", "read_files", "read_release", "release_key", "set_default_app",
]
