"""The source's staging writes into the target region's bucket (spec §7.3 "Staging layout", "Seal by version").

``moves/<host>/<op>/`` holds ``move.json`` (create-only, before the first round), ``replica/`` (the mirrored
replica of the host's current generation; the only subtree :func:`mirror_prefix` ever deletes in), ``files/``
(the sealed archive and its manifest) and ``timers/`` (the timers snapshot). Every write answers the exact
``VersionId`` it created, so the seal can name versions and nothing else (§7.3).

Not done here: the staging-work lease and the ``SafeUntil`` check before each signature (§7.3, claim C3), and the
M17 push-only grant (this code reads the target's listing to mirror; a push-only principal would keep the
round's manifest itself).
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from events.base import Durable, Ident, canonical, decode
from services.box.replica.layout import GenerationScope, parse_ltx_name
from services.move.follow import staging_lane
from services.objstore.port import Got, Lost, ObjectStore, StoreError, VersionEntry

REPLICA = "replica/"
FILES = "files/"
TIMERS = "timers/"


class StagingConflict(Exception):
    """A create-only staging object already exists with other content: another move or a defect wrote it."""


class MoveMarker(Durable, frozen=True):
    """``moves/<host>/<op>/move.json`` (§7.3), create-only, written before the first round."""

    move_id: Ident
    incarnation: Ident
    host: Ident
    to: Ident
    from_: str = msgspec.field(default="", name="from")


def lane(host: str, op_id: str) -> str:
    """``moves/<host>/<op>/`` (§7.3)."""
    return staging_lane(host, op_id)


def snapshot_prefix(host: str, op_id: str) -> str:
    """``move-snapshots/<host>/<op>/`` in the source region's bucket (§7.4 ``stopped``, ``archived``)."""
    return f"move-snapshots/{host}/{op_id}/"


async def create_once(store: ObjectStore, bucket: str, key: str, body: bytes) -> str | None:
    """Create-only PUT; a replay finds its own bytes and answers that object's version. Other bytes raise
    :class:`StagingConflict` (never overwritten)."""
    put = await store.put(bucket, key, body, if_none_match=True)
    if not isinstance(put, Lost):
        return put.version_id
    got = await store.get(bucket, key)
    if not isinstance(got, Got):
        raise StoreError(f"the create of {key} in {bucket} lost, but reading it back found nothing; not acting")
    if got.body != body:
        raise StagingConflict(f"{bucket}/{key} already exists with other content; it is never overwritten")
    return got.version_id


async def write_move_marker(store: ObjectStore, bucket: str, marker: MoveMarker) -> str | None:
    """``move.json`` create-only (§7.3): a second write for the same move is a no-op; for another move, refused."""
    key = lane(marker.host, marker.move_id) + "move.json"
    try:
        return await create_once(store, bucket, key, canonical(marker))
    except StagingConflict:
        got = await store.get(bucket, key)
        other = decode(got.body, MoveMarker) if isinstance(got, Got) else None
        raise StagingConflict(
            f"{bucket}/{key} names move {other.move_id if other else '?'} of incarnation "
            f"{other.incarnation if other else '?'}, not this one; staging stops"
        ) from None


@dataclass(frozen=True)
class Mirrored:
    """One mirror round: ``versions`` maps every current ``replica/`` file (relative name) to its exact version;
    ``max_l0`` is the newest level-0 file's max TXID mirrored (the staged position)."""

    versions: dict[str, str]
    copied: int
    deleted: int
    bytes: int
    max_l0: int


def _latest(entries: list[VersionEntry]) -> dict[str, VersionEntry]:
    return {e.key: e for e in entries if e.is_latest and not e.is_delete_marker}


async def mirror_round(
    src: ObjectStore, src_bucket: str, scope: GenerationScope, dst: ObjectStore, dst_bucket: str, host: str,
    op_id: str,
) -> Mirrored:
    """Mirror the current replica files of ``scope`` into ``replica/`` by server-side copy of exact versions, then
    ``MirrorPrefix``: delete what the source no longer has, under ``replica/`` only (§7.3)."""
    prefix = lane(host, op_id) + REPLICA
    source = {k: e for k, e in _latest(await src.list_versions(src_bucket, scope.prefix)).items()
              if scope.parse(k) is not None}
    staged = _latest(await dst.list_versions(dst_bucket, prefix))
    versions: dict[str, str] = {}
    copied = moved = 0
    for key, entry in sorted(source.items()):
        rel = key[len(scope.prefix):]
        have = staged.get(prefix + rel)
        if have is not None and have.size == entry.size and have.etag == entry.etag:
            versions[rel] = have.version_id
            continue
        won = await dst.copy(dst_bucket, prefix + rel, src_bucket=src_bucket, src_key=key,
                             src_version_id=entry.version_id)
        if won.version_id is None:
            raise StoreError(f"the copy into {dst_bucket}/{prefix + rel} answered no version; a seal needs one")
        versions[rel] = won.version_id
        copied += 1
        moved += entry.size
    deleted = 0
    for key in sorted(staged):
        if key.startswith(prefix) and key[len(prefix):] not in versions:
            await dst.delete(dst_bucket, key)
            deleted += 1
    max_l0 = max((p[2] for rel in versions if (p := parse_ltx_name(rel)) is not None and p[0] == 0), default=0)
    return Mirrored(versions, copied, deleted, moved, max_l0)


async def stage_timers(store: ObjectStore, bucket: str, host: str, op_id: str, body: bytes) -> str:
    """``timers/timers.json`` create-only; answers its exact version (§7.4 ``stopped``)."""
    version = await create_once(store, bucket, lane(host, op_id) + TIMERS + "timers.json", body)
    if version is None:
        raise StoreError("the timers snapshot was stored without a version; the staging bucket must be versioned")
    return version


async def stage_files(store: ObjectStore, bucket: str, host: str, op_id: str, *, src_bucket: str,
                      archive_key: str, archive_version: str, manifest: bytes) -> dict[str, str]:
    """Copy the sealed archive (exact version) into ``files/`` and put its manifest; answer both versions."""
    base = lane(host, op_id) + FILES
    won = await store.copy(bucket, base + "archive.sealed", src_bucket=src_bucket, src_key=archive_key,
                           src_version_id=archive_version)
    manifest_version = await create_once(store, bucket, base + "manifest.json", manifest)
    if won.version_id is None or manifest_version is None:
        raise StoreError("the archive was staged without a version; the staging bucket must be versioned")
    return {"archive.sealed": won.version_id, "manifest.json": manifest_version}


__all__ = [
    "FILES", "REPLICA", "TIMERS", "MoveMarker", "Mirrored", "StagingConflict", "create_once", "lane",
    "mirror_round", "snapshot_prefix", "stage_files", "stage_timers", "write_move_marker",
]
