"""The source's staging writes into the target region's bucket (spec §7.3 "Staging layout", "Seal by version";
§0.1 M17).

``moves/<host>/<op>/`` holds ``move.json`` (create-only, before the first round), ``replica/`` (the mirrored
replica of the host's current generation; the only subtree the mirror ever deletes in), ``files/`` (the sealed
archive and its manifest: each preparing round's, then the cut's) and ``timers/`` (the timers snapshot).

**Push-only (M17).** The source may put, copy into and delete in the target's ``moves/*`` but never read or list
it. So it decides from its own knowledge: the **staging journal** ``moves/<host>/<op>/staged-source.json`` in the
deployment bucket records every object it staged with the exact ``VersionId`` the PUT or COPY answered, journal
first (a write is recorded as pending before it is signed, and its version after). The mirror compares the
source's own replica with that journal, never with a listing of the target; the seal names the versions it
records (§7.3 "Seal by version"), so a stale round's later version, a pending write that landed unrecorded, or an
object someone else wrote is never named and the landing never reads it.

**What a round costs (issue 19 item 9).** A preparing round's requests follow what changed since the last round,
never the files the host has stored: a level's keys are ordered by TXID and a writer only adds files above the
newest of a level, so a round lists each level after the newest file the journal records there
(:func:`round_tails`, S3's ``KeyMarker``) and looks again (one HEAD each) only at the files a new compacted file
covers, which are all a compaction deletes (:func:`covered`, :func:`plan_round`). What that cannot see (a key
rewritten in place, a delete by retention, a late upload below a tail) is left for the final mirror at ``staged``,
which lists the whole generation as every mirror did: the seal is decided from that listing and the journal alone,
so a round's shortcut never reaches a landing. A crash between the journal's pending record and its versions leaves
the pending names above the tails, listed again; a journal that records no replica file yet lists everything.

**Under the staging-work lease.** Every request is preceded by :meth:`StagingWork.before_sign
<services.move.lease.StagingWork.before_sign>` (§7.3 "Sign only before SafeUntil"); the journal is written by
CAS, so two writers never interleave silently (a lost CAS stops the round).

**Files.** ``files/archive.sealed`` and ``files/manifest.json`` are rewritten (new versions) by each preparing
round whose files changed (T5 reads the newest, §7.3 "Snapshot rounds") and by the cut's ``archived``; the seal
names the cut's versions only, so the rounds' never reach a landing.
"""

from __future__ import annotations

import contextlib
import hashlib
from dataclasses import dataclass
from typing import Final

import msgspec

from events.base import Durable, Ident, canonical, decode
from services.box.replica.layout import GenerationScope, parse_ltx_name
from services.box.replica.ltx import SNAPSHOT_LEVEL
from services.move.follow import host_segment, staging_lane
from services.move.lease import StagingStopped, StagingWork
from services.objstore.port import Got, InvalidRequest, Lost, ObjectStore, StoreError, VersionEntry, Won

REPLICA: Final = "replica/"
FILES: Final = "files/"
TIMERS: Final = "timers/"
ARCHIVE: Final = FILES + "archive.sealed"
MANIFEST: Final = FILES + "manifest.json"
TIMERS_JSON: Final = TIMERS + "timers.json"
PENDING: Final = "pending"  # a write recorded before it was signed; its version is unknown
LANDED: Final = "landed"  # move.json's create answered 412 after an earlier attempt of ours: ours, version unknown
JOURNAL_VERSION: Final = 1


class StagingConflict(Exception):
    """A create-only staging object already exists and this source never wrote it: another move or a defect."""


class MoveMarker(Durable, frozen=True):
    """``moves/<host>/<op>/move.json`` (§7.3), create-only, written before the first round."""

    move_id: Ident
    incarnation: Ident
    host: Ident
    to: Ident
    from_: str = msgspec.field(default="", name="from")


class StagedObject(Durable, frozen=True):
    """One staged object: ``version`` the exact ``VersionId`` its PUT or COPY answered (``""`` while pending);
    ``src`` what it holds: the source object's version for ``replica/``, a content tag otherwise."""

    version: str
    src: str


class StagedSet(Durable, frozen=True):
    """The staging journal ``moves/<host>/<op>/staged-source.json`` (deployment bucket): what the source staged
    into ``region``'s lane. ``objects`` is keyed by the name under the lane (``replica/…``, ``files/…``,
    ``timers/…``); ``marker`` is ``move.json``'s version, :data:`PENDING` or :data:`LANDED`; ``files_plain`` the
    plaintext digest the newest round archive was built from."""

    v: int
    host: Ident
    move_id: Ident
    region: Ident
    marker: str = ""
    objects: dict[str, StagedObject] = msgspec.field(default_factory=dict)
    files_plain: str = ""


def lane(host: str, op_id: str) -> str:
    """``moves/<host>/<op>/`` (§7.3), the host percent-encoded."""
    return staging_lane(host, op_id)


def journal_key(host: str, op_id: str) -> str:
    """``moves/<host>/<op>/staged-source.json`` in the deployment bucket, beside ``source.json``."""
    return f"moves/{host_segment(host)}/{op_id}/staged-source.json"


async def create_once(store: ObjectStore, bucket: str, key: str, body: bytes) -> str | None:
    """Create-only PUT into a bucket this box may read (its own): a replay finds its own bytes and answers that
    object's version. Other bytes raise :class:`StagingConflict` (never overwritten). Never for the target's
    bucket (M17: the source cannot read it)."""
    put = await store.put(bucket, key, body, if_none_match=True)
    if not isinstance(put, Lost):
        return put.version_id
    got = await store.get(bucket, key)
    if not isinstance(got, Got):
        raise StoreError(f"the create of {key} in {bucket} lost, but reading it back found nothing; not acting")
    if got.body != body:
        raise StagingConflict(f"{bucket}/{key} already exists with other content; it is never overwritten")
    return got.version_id


def tag(kind: str, body: bytes) -> str:
    """A content tag for :attr:`StagedObject.src`: ``<kind>:sha256:<hex>``."""
    return f"{kind}:sha256:{hashlib.sha256(body).hexdigest()}"


# -- the pure part ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MirrorPlan:
    """What one mirror round writes (§7.3): ``copy`` maps a name under ``replica/`` to the source version to copy,
    ``delete`` the names the source staged and no longer has; ``keep`` the staged versions already current."""

    copy: dict[str, str]
    delete: tuple[str, ...]
    keep: dict[str, str]


def plan_mirror(staged: StagedSet, source: dict[str, str]) -> MirrorPlan:
    """Decide the mirror from the journal and the source's own replica (``name -> source version``), never from a
    listing of the target (M17). A pending or differently sourced entry is copied again (a new version)."""
    copy: dict[str, str] = {}
    keep: dict[str, str] = {}
    for rel, src_version in sorted(source.items()):
        have = staged.objects.get(REPLICA + rel)
        if have is not None and have.version and have.src == src_version:
            keep[rel] = have.version
        else:
            copy[rel] = src_version
    delete = tuple(sorted(k[len(REPLICA):] for k in staged.objects
                          if k.startswith(REPLICA) and k[len(REPLICA):] not in source))
    return MirrorPlan(copy, delete, keep)


def round_tails(staged: StagedSet) -> dict[int, str] | None:
    """Where a preparing round's listing starts, per level (§7.3 "Snapshot rounds"; issue 19 item 9): the newest
    name under ``replica/`` the journal records with its version at each level it holds, ``""`` for the level above
    the highest of them and for the snapshot level. A level's keys are ordered by TXID and a writer adds files above
    the newest of a level (an upload, a compaction's output), so what a round has not mirrored yet sorts after its
    tail. Every level below the highest recorded one is listed, from its start where the journal records none (a
    compaction into the level above deletes all of it), and level 0 and 1 above a snapshot alone. None while the
    journal records no replica file: a first round lists the whole generation."""
    tails: dict[int, str] = {}
    for name, obj in staged.objects.items():
        parsed = parse_ltx_name(name[len(REPLICA):]) if name.startswith(REPLICA) and obj.version else None
        if parsed is not None:
            rel = name[len(REPLICA):]
            tails[parsed[0]] = max(tails.get(parsed[0], ""), rel)
    if not tails:
        return None
    top = max((level for level in tails if level < SNAPSHOT_LEVEL), default=0) + 1
    for level in range(min(top, SNAPSHOT_LEVEL - 1) + 1):  # a level compacted away is listed from its start
        tails.setdefault(level, "")
    tails.setdefault(SNAPSHOT_LEVEL, "")
    return dict(sorted(tails.items()))


def covered(staged: StagedSet, new: dict[str, str]) -> tuple[str, ...]:
    """The staged files a round must look at again (:func:`plan_round`): those of level ``L - 1`` inside the TXID
    range of a new level-``L`` file (``new``: name -> source version of the files listed after the tails). A
    compaction merged them and deletes them, bar the newest level-0 file (§5.1 step 8), so they are what the source
    can have deleted since the last round; one look each, as many as the compaction merged."""
    ranges = [p for rel in new if (p := parse_ltx_name(rel)) is not None and 1 <= p[0] < SNAPSHOT_LEVEL]
    out: list[str] = []
    for name, obj in staged.objects.items():
        rel = name[len(REPLICA):]
        p = parse_ltx_name(rel) if name.startswith(REPLICA) and obj.version and rel not in new else None
        if p is not None and any(p[0] == level - 1 and lo <= p[1] and p[2] <= hi for level, lo, hi in ranges):
            out.append(rel)
    return tuple(sorted(out))


def plan_round(staged: StagedSet, new: dict[str, str], gone: frozenset[str] = frozenset()) -> MirrorPlan:
    """A preparing round's mirror from the journal, the source files listed after the tails and the covered files
    looked at again (``new``: name -> current source version; ``gone``: covered files the source no longer has):
    copy what is new or changed, delete what is gone, keep everything else the journal records. Exact for what it
    looked at; a file the source rewrote or deleted elsewhere is left to the final mirror at ``staged``, which lists
    the whole generation, and the seal names only what that finds (§7.3 "Seal by version")."""
    keep = {k[len(REPLICA):]: o.version for k, o in staged.objects.items() if k.startswith(REPLICA) and o.version}
    copy = {rel: v for rel, v in sorted(new.items())
            if rel not in keep or staged.objects[REPLICA + rel].src != v}
    delete = tuple(sorted(rel for rel in gone if rel in keep and rel not in new))
    for rel in (*copy, *delete):
        keep.pop(rel, None)
    return MirrorPlan(copy, delete, keep)


def with_objects(staged: StagedSet, changes: dict[str, StagedObject | None], **fields: str) -> StagedSet:
    """The journal with ``changes`` applied (``None`` drops a name) and ``fields`` replaced."""
    objects = dict(staged.objects)
    for name, obj in changes.items():
        if obj is None:
            objects.pop(name, None)
        else:
            objects[name] = obj
    return msgspec.structs.replace(staged, objects=objects, **fields)


# -- the runner ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Mirrored:
    """One mirror round: ``versions`` maps every current ``replica/`` file (relative name) to its exact version;
    ``max_l0`` is the newest level-0 file's max TXID mirrored (the staged position)."""

    versions: dict[str, str]
    copied: int
    deleted: int
    bytes: int
    max_l0: int


_MIRROR_PASSES: Final = 3
"""Listings one mirror round takes at most while the writer's deletes race its copies."""


@dataclass(frozen=True)
class _Pass:
    versions: dict[str, str] | None  # None: a listed version was deleted before its COPY; list again
    copied: int
    deleted: int
    bytes: int


async def _still_listed(store: ObjectStore, bucket: str, key: str, version_id: str) -> bool:
    return any(e.key == key and e.version_id == version_id for e in await store.list_versions(bucket, key))


def _latest(entries: list[VersionEntry]) -> dict[str, VersionEntry]:
    return {e.key: e for e in entries if e.is_latest and not e.is_delete_marker}


def _version(out: Won | Lost, where: str) -> str:
    if isinstance(out, Lost) or not out.version_id:
        raise StoreError(f"the write of {where} answered no version; the staging bucket must be versioned (§7.3)")
    return out.version_id


class Stager:
    """One round's staging writes into one lane, push-only (M17), under the staging-work lease (§7.3). Build it
    with :meth:`open` after :meth:`StagingWork.acquire` and the claim's revalidation."""

    def __init__(self, work: StagingWork, store: ObjectStore, bucket: str, journal_store: ObjectStore,
                 journal_bucket: str, host: str, op_id: str, region: str) -> None:
        self.work, self.store, self.bucket = work, store, bucket
        self.journal_store, self.journal_bucket = journal_store, journal_bucket
        self.host, self.op_id, self.region = host, op_id, region
        self.prefix = lane(host, op_id)
        self.key = journal_key(host, op_id)
        self.state = StagedSet(v=JOURNAL_VERSION, host=host, move_id=op_id, region=region)
        self._etag: str | None = None

    @classmethod
    async def open(cls, work: StagingWork, store: ObjectStore, bucket: str, journal_store: ObjectStore,
                   journal_bucket: str, host: str, op_id: str, region: str) -> Stager:
        self = cls(work, store, bucket, journal_store, journal_bucket, host, op_id, region)
        got = await journal_store.get(journal_bucket, self.key)
        if isinstance(got, Got):
            state = decode(got.body, StagedSet)
            if (state.host, state.move_id, state.region) != (host, op_id, region):
                raise StagingConflict(f"the staging journal {self.key} names {state.host} {state.move_id} into "
                                      f"{state.region}, not this move; staging stops")
            self.state, self._etag = state, got.etag
        return self

    async def _journal(self, new: StagedSet) -> None:
        """Write the journal by CAS; a lost CAS means another writer staged meanwhile: the round stops."""
        if new == self.state and self._etag is not None:
            return
        body = canonical(new)
        if self._etag is None:
            out = await self.journal_store.put(self.journal_bucket, self.key, body, if_none_match=True)
        else:
            out = await self.journal_store.put(self.journal_bucket, self.key, body, if_match=self._etag)
        if isinstance(out, Lost):
            raise StagingStopped(f"the staging journal of {self.host} changed under this round (another staging "
                                 "writer); the round stops")
        self.state, self._etag = new, out.etag

    async def _put(self, name: str, body: bytes, *, create: bool = False) -> Won | Lost:
        await self.work.before_sign(f"the PUT of {self.prefix + name}")
        return await self.store.put(self.bucket, self.prefix + name, body, if_none_match=create)

    # -- move.json --------------------------------------------------------------------------------------------

    async def write_marker(self, marker: MoveMarker) -> str:
        """``move.json`` create-only (§7.3), journal first. A 412 after an earlier attempt of ours is ours (its
        response was lost); a 412 on the first attempt is someone else's object: :class:`StagingConflict`."""
        if self.state.marker not in ("", PENDING):
            return self.state.marker
        earlier = self.state.marker == PENDING
        if not earlier:
            await self._journal(msgspec.structs.replace(self.state, marker=PENDING))
        out = await self._put("move.json", canonical(marker), create=True)
        if isinstance(out, Lost):
            if not earlier:
                raise StagingConflict(f"{self.bucket}/{self.prefix}move.json already exists and this source never "
                                      "wrote it; staging stops")
            done = LANDED
        else:
            done = out.version_id or LANDED
        await self._journal(msgspec.structs.replace(self.state, marker=done))
        return done

    # -- replica/ ---------------------------------------------------------------------------------------------

    async def mirror(self, src: ObjectStore, src_bucket: str, scope: GenerationScope, *,
                     final: bool = True) -> Mirrored:
        """Mirror the current replica files of ``scope`` into ``replica/`` by server-side copy of exact versions,
        then delete what this source staged and no longer has, under ``replica/`` only (§7.3 ``MirrorPrefix``).

        The writer deletes its own uploads by exact version (its compaction and retention): a listed version gone
        by the time of its COPY ends the pass, and the next pass mirrors a fresh listing (which holds the file that
        replaced it), so a round's set is the source's current set at one listing, never one with a hole.

        The final mirror (``staged``, the seal) lists the whole generation and is exact. A preparing round
        (``final=False``) lists each level only after what the journal records there (:func:`round_tails`,
        :func:`plan_round`), so its requests follow what changed since the last round, not the files stored."""
        copied = deleted = moved = 0
        for _ in range(_MIRROR_PASSES):
            out = await self._mirror_pass(src, src_bucket, scope, final=final)
            copied, deleted, moved = copied + out.copied, deleted + out.deleted, moved + out.bytes
            if out.versions is not None:
                max_l0 = max((p[2] for rel in out.versions if (p := parse_ltx_name(rel)) is not None and p[0] == 0),
                             default=0)
                return Mirrored(out.versions, copied, deleted, moved, max_l0)
        raise StoreError(f"the source replica {scope.prefix!r} changed under {_MIRROR_PASSES} passes of one round")

    async def _mirror_pass(self, src: ObjectStore, src_bucket: str, scope: GenerationScope, *, final: bool) -> _Pass:
        tails = None if final else round_tails(self.state)
        if tails is None:
            listed = _latest(await src.list_versions(src_bucket, scope.prefix))
            source = {k[len(scope.prefix):]: e for k, e in listed.items() if scope.parse(k) is not None}
            plan = plan_mirror(self.state, {rel: e.version_id for rel, e in source.items()})
        else:
            source = {}
            for level, tail in tails.items():
                prefix = f"{scope.prefix}{level:04d}/"
                listed = _latest(await src.list_versions(src_bucket, prefix, after=scope.prefix + tail if tail
                                                         else ""))
                source.update({k[len(scope.prefix):]: e for k, e in listed.items() if scope.parse(k) is not None})
            gone: set[str] = set()
            for rel in covered(self.state, {rel: e.version_id for rel, e in source.items()}):
                head = await src.head(src_bucket, scope.prefix + rel)
                if isinstance(head, Got) and head.version_id:  # still there (a HEAD tells no size: rare, 0)
                    source[rel] = VersionEntry(scope.prefix + rel, head.version_id, True, False, head.etag, 0, 0)
                elif not isinstance(head, Got):
                    gone.add(rel)
            plan = plan_round(self.state, {rel: e.version_id for rel, e in source.items()}, frozenset(gone))
        if plan.copy:  # journal first: the copies are pending until their versions are recorded
            await self._journal(with_objects(self.state, {REPLICA + rel: StagedObject(version="", src=v)
                                                          for rel, v in plan.copy.items()}))
        done: dict[str, StagedObject | None] = {}
        moved = 0
        try:
            for rel, src_version in plan.copy.items():
                await self.work.before_sign(f"the COPY into {self.prefix + REPLICA + rel}")
                try:
                    won = await self.store.copy(self.bucket, self.prefix + REPLICA + rel, src_bucket=src_bucket,
                                                src_key=scope.prefix + rel, src_version_id=src_version)
                except InvalidRequest:
                    if await _still_listed(src, src_bucket, scope.prefix + rel, src_version):
                        raise
                    # deleted since the listing: record what landed (the rest stays pending) and list again
                    if done:
                        await self._journal(with_objects(self.state, done))
                    return _Pass(None, len(done), 0, moved)
                done[REPLICA + rel] = StagedObject(version=_version(won, self.prefix + REPLICA + rel),
                                                   src=src_version)
                moved += source[rel].size
            for rel in plan.delete:
                await self.work.before_sign(f"the DELETE of {self.prefix + REPLICA + rel}")
                await self.store.delete(self.bucket, self.prefix + REPLICA + rel)  # a bare delete (M17)
                done[REPLICA + rel] = None
        except (StagingStopped, StoreError):
            if done:  # record what landed before the round stopped; the next round redoes only the rest
                with contextlib.suppress(StagingStopped, StoreError):
                    await self._journal(with_objects(self.state, done))
            raise
        if done:
            await self._journal(with_objects(self.state, done))
        versions = {**plan.keep, **{k[len(REPLICA):]: o.version for k, o in done.items() if o is not None}}
        return _Pass(versions, len(plan.copy), len(plan.delete), moved)

    # -- timers/ and files/ -------------------------------------------------------------------------------------

    async def _stage(self, bodies: dict[str, tuple[bytes, str]], **fields: str) -> dict[str, str]:
        """Put each ``name -> (body, src tag)`` unless the journal already records that content staged; journal
        first; answers every name's exact version."""
        have = {n: o.version for n in bodies if (o := self.state.objects.get(n)) is not None and o.version
                and o.src == bodies[n][1]}
        todo = {n: b for n, b in bodies.items() if n not in have}
        if not todo:
            if fields:
                await self._journal(msgspec.structs.replace(self.state, **fields))
            return have
        pending: dict[str, StagedObject | None] = {n: StagedObject(version="", src=s) for n, (_, s) in todo.items()}
        await self._journal(with_objects(self.state, pending))
        done: dict[str, StagedObject | None] = {}
        for name, (body, src) in todo.items():
            done[name] = StagedObject(version=_version(await self._put(name, body), self.prefix + name), src=src)
        await self._journal(with_objects(self.state, done, **fields))
        return {**have, **{n: o.version for n, o in done.items() if o is not None}}

    async def stage_timers(self, body: bytes) -> str:
        """``timers/timers.json`` (§7.4 ``stopped``); a replay of the same snapshot reuses the recorded version."""
        return (await self._stage({TIMERS_JSON: (body, tag("timers", body))}))[TIMERS_JSON]

    async def stage_round_archive(self, plain: str, archive: bytes, manifest: bytes) -> dict[str, str]:
        """A preparing round's files archive (§7.3 "Snapshot rounds": built when the plaintext digest changes),
        at ``files/`` where T5 reads the newest. The seal never names it."""
        return await self._stage({ARCHIVE: (archive, tag("round", archive)),
                                  MANIFEST: (manifest, tag("round", manifest))}, files_plain=plain)

    def round_archive_current(self, plain: str) -> bool:
        """Whether the newest staged archive was built from ``plain`` (§7.3: rebuilt only when it changes)."""
        objects = self.state.objects
        return bool(plain) and self.state.files_plain == plain and all(
            (o := objects.get(n)) is not None and o.version and o.src.startswith("round:") for n in (ARCHIVE, MANIFEST))

    async def stage_files(self, *, src_bucket: str, archive_key: str, archive_version: str,
                          manifest: bytes) -> dict[str, str]:
        """The cut's sealed archive (§7.4 ``archived``): copy its exact version into ``files/`` and put its
        manifest; answer both versions (relative to ``files/``) for the seal. A replay reuses what it recorded."""
        src = f"cut:{archive_key}@{archive_version}"
        have = self.state.objects.get(ARCHIVE)
        manifest_tag = tag("cut", manifest)
        if have is None or not have.version or have.src != src:
            await self._journal(with_objects(self.state, {ARCHIVE: StagedObject(version="", src=src)}))
            await self.work.before_sign(f"the COPY into {self.prefix + ARCHIVE}")
            won = await self.store.copy(self.bucket, self.prefix + ARCHIVE, src_bucket=src_bucket, src_key=archive_key,
                                        src_version_id=archive_version)
            await self._journal(with_objects(self.state, {ARCHIVE: StagedObject(
                version=_version(won, self.prefix + ARCHIVE), src=src)}, files_plain=""))
        versions = await self._stage({MANIFEST: (manifest, manifest_tag)})
        return {"archive.sealed": self.state.objects[ARCHIVE].version,
                "manifest.json": versions[MANIFEST]}


__all__ = [
    "ARCHIVE", "FILES", "LANDED", "MANIFEST", "PENDING", "REPLICA", "TIMERS", "TIMERS_JSON", "MirrorPlan", "Mirrored",
    "MoveMarker", "StagedObject", "StagedSet", "Stager", "StagingConflict", "create_once", "journal_key", "lane",
    "covered", "plan_mirror", "plan_round", "round_tails", "tag", "with_objects",
]
