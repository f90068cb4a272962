"""Retention of what parks keep (issue 16 item 7; spec §6.4 "Destinations", §8.3 "Snapshots are kept until F3", §16 F3).

Every park copies what it retires into ``superseded/<host>/<op>/<event>/`` before deleting it, and every cut keeps
its sealed archive under ``move-snapshots/<host>/<op>/``: without retention a host's bucket grows by its database at
every retirement, forever. Each region's box therefore deletes, in its own bucket, the entries older than the
deployment's retention (seven days by default, :data:`DEFAULT_RETENTION_MS`; ``HOSTMOVE_RETENTION_S``):

- an **entry** is one retirement event's destination (``superseded/<host>/<op>/<event>/``) or one operation's
  snapshots (``move-snapshots/<host>/<op>/``); its age is its newest version's ``LastModified``;
- **never while an operation or an obligation names it**: the claim's ``op.id``, any obligation's ``op`` (a park
  still writing events there), the record's move or its rollback;
- **never a current object**: only keys under those two archive prefixes of the host are ever listed or deleted;
  nothing of a live namespace (``instances/``, ``moves/``) is touched;
- **by exact versions, with a manifest and an event**: the deletion set (every version under the entry, delete
  markers included) is written create-only to ``retired/<host>/<area>/<op>[/<event>].json`` before the first delete,
  a replay finishes it from there, and one ``retention-deleted`` fact reports each retirement.

The planner is pure (:func:`plan_retention`); :class:`RetentionSweep` is the thin runner the box agent calls.

The serving box also bounds the noncurrent history of its location's ``generation.json`` (issue 16 item 2: every
cold admission's publication rewrites it, §5.1 step 9, so a host that never moves kept one version a wake for ever):
at rest, what :func:`services.sweeper.history.noncurrent_to_retire` names (older than ``H``, beyond the newest
four, never the current version) is deleted by exact version id. Nothing reads a noncurrent marker: the start check,
the publication's If-Match and the restore read the current one.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Final

import msgspec

from bus.facts import Fact, publish_fact
from bus.log import EventLog, LogError
from events.claim import Claim
from events.envelope import Actor
from events.record import Record
from kernel import rules
from kernel.logctx import ctx
from kernel.ports import Clock
from services.box.artifacts.markers import marker_key
from services.move.follow import host_segment
from services.move.park import PRODUCTION
from services.objstore.port import Got, Lost, ObjectStore, VersionEntry, Won
from services.sweeper.history import noncurrent_to_retire

log = logging.getLogger("hostmove.sweeper")

DAY_MS: Final = 86_400_000
DEFAULT_RETENTION_MS: Final = 7 * DAY_MS
RETENTION_SETTING: Final = "HOSTMOVE_RETENTION_S"
AREAS: Final = ("superseded", "move-snapshots")

rules.register(
    "retention-named",
    section="issue 16 item 7; §6.4 Destinations, §16 F3; CC11 (obligations block what they name)",
    meaning="an archived entry is never deleted while an operation, an obligation or the record names its op",
    site="services/sweeper/retention.py plan_retention",
)


def retention_ms(env: Mapping[str, str], default_ms: int = DEFAULT_RETENTION_MS) -> int:
    """``HOSTMOVE_RETENTION_S`` (seconds, positive), else ``default_ms``; anything else is refused."""
    text = (env.get(RETENTION_SETTING) or "").strip()
    if not text:
        return default_ms
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not 0 < seconds < float("inf"):
        raise ValueError(f"{RETENTION_SETTING} must be a positive number of seconds, not {text!r}")
    return int(seconds * 1000)


class RetiredEntry(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The manifest of one retention deletion: every version it deletes."""

    host: str
    area: str
    op: str
    event: str
    prefix: str
    newest_ms: int
    deleted_at: int
    versions: tuple[tuple[str, str, bool, int], ...]  # (key, version id, delete marker, size)


@dataclass(frozen=True)
class Entry:
    """One archived entry: its area, op and event (``""`` for a move's snapshots), prefix and versions."""

    area: str
    op: str
    event: str
    prefix: str
    versions: tuple[VersionEntry, ...]

    @property
    def newest_ms(self) -> int:
        return max((v.last_modified_ms for v in self.versions), default=0)

    @property
    def bytes(self) -> int:
        return sum(v.size for v in self.versions)


def named_ops(claim: Claim | None, record: Record | None) -> frozenset[str]:
    """The operations an entry must not be deleted under: the claim's, its obligations', the record's move."""
    ops: set[str] = set()
    if claim is not None:
        if claim.op.id:
            ops.add(claim.op.id)
        ops.update(o.op for o in claim.obligations)
    if record is not None and record.move is not None:
        ops.add(record.move.id)
        if record.move.rollback is not None:
            ops.add(record.move.rollback.id)
    return frozenset(ops)


def group_entries(host: str, area: str, versions: Iterable[VersionEntry]) -> list[Entry]:
    """The listing of ``<area>/<host>/`` as entries (module doc): ``superseded`` by ``<op>/<event>/``,
    ``move-snapshots`` by ``<op>/``. A key that fits neither shape is left alone."""
    base = f"{area}/{host_segment(host)}/"
    groups: dict[tuple[str, str], list[VersionEntry]] = {}
    for v in versions:
        if not v.key.startswith(base):
            continue
        parts = v.key[len(base):].split("/")
        if area == "superseded":
            if len(parts) < 3 or not parts[0] or not parts[1]:
                continue
            groups.setdefault((parts[0], parts[1]), []).append(v)
        else:
            if len(parts) < 2 or not parts[0]:
                continue
            groups.setdefault((parts[0], ""), []).append(v)
    out = []
    for (op, event), vs in sorted(groups.items()):
        prefix = f"{base}{op}/" + (f"{event}/" if event else "")
        out.append(Entry(area, op, event, prefix, tuple(vs)))
    return out


def plan_retention(entries: Iterable[Entry], *, now_ms: int, retention_ms: int, busy: frozenset[str]
                   ) -> list[Entry]:
    """The entries due for deletion: older than the retention and named by nothing that runs. Pure."""
    due = []
    for e in entries:
        if now_ms - e.newest_ms < retention_ms:
            continue
        if e.op in busy and rules.on("retention-named"):
            continue
        due.append(e)
    return due


def manifest_key(host: str, entry: Entry) -> str:
    tail = f"{entry.op}/{entry.event}.json" if entry.event else f"{entry.op}.json"
    return f"retired/{host_segment(host)}/{entry.area}/{tail}"


@dataclass
class RetentionSweep:
    """One box's retention of its region's bucket. ``retention_ms``: the deployment's (module doc)."""

    box: str
    region: str
    store: ObjectStore
    bucket: str
    clock: Clock
    retention_ms: int = field(default_factory=lambda: retention_ms(os.environ))
    events: EventLog | None = None
    actor: Actor | None = None
    every_ms: int = 60_000
    horizon_ms: int = PRODUCTION.signature_age_ms + 120_000
    """``H`` of the park timing (§5.3): a noncurrent marker version younger than this is kept."""
    _next: dict[str, int] = field(default_factory=dict)

    def due(self, host: str, now_ms: int) -> bool:
        """Is the look at ``host`` due (:meth:`look` would not skip it): what the agent's backstop passes a sleeping
        host for (issue 19 item 2)."""
        return self._next.get(host, 0) <= now_ms

    async def look(self, host: str, claim: Claim | None, record: Record | None, *, force: bool = False) -> list[str]:
        """Delete what is due for ``host`` (at most once per ``every_ms`` unless ``force``); what it did."""
        now = self.clock.now_ms()
        if not force and self._next.get(host, 0) > now:
            return []
        self._next[host] = now + self.every_ms
        busy = named_ops(claim, record)
        did = []
        for area in AREAS:
            versions = await self.store.list_versions(self.bucket, f"{area}/{host_segment(host)}/")
            for entry in plan_retention(group_entries(host, area, versions), now_ms=self.clock.now_ms(),
                                        retention_ms=self.retention_ms, busy=busy):
                did.append(await self._delete(host, entry))
        return did + await self._marker_history(host, claim)

    async def _marker_history(self, host: str, claim: Claim | None) -> list[str]:
        """The serving box, at rest: the noncurrent versions of its location's ``generation.json`` (module doc)."""
        if claim is None or claim.holder is None or claim.op.kind != "serving" or claim.op.exec != self.box:
            return []
        key = marker_key(claim.holder.location)
        entries = await self.store.list_versions(self.bucket, key)
        deleted = 0
        for e in noncurrent_to_retire(entries, key, now_ms=self.clock.now_ms(), horizon_ms=self.horizon_ms):
            deleted += isinstance(await self.store.delete(self.bucket, key, version_id=e.version_id), Won)
        if not deleted:
            return []
        log.info("%d noncurrent version(s) of %s deleted by version id", deleted, key,
                 extra=ctx(host=host, box=self.box, phase="marker-history", objects=deleted))
        return [f"{deleted} noncurrent version(s) of generation.json deleted"]

    async def _delete(self, host: str, entry: Entry) -> str:
        key = manifest_key(host, entry)
        manifest = RetiredEntry(host=host, area=entry.area, op=entry.op, event=entry.event, prefix=entry.prefix,
                                newest_ms=entry.newest_ms, deleted_at=self.clock.now_ms(),
                                versions=tuple((v.key, v.version_id, v.is_delete_marker, v.size)
                                               for v in entry.versions))
        put = await self.store.put(self.bucket, key, msgspec.json.encode(manifest), if_none_match=True)
        if isinstance(put, Lost):  # a replay: the written manifest is the retirement, plus what landed since
            got = await self.store.get(self.bucket, key)
            if isinstance(got, Got):
                written = msgspec.json.decode(got.body, type=RetiredEntry)
                for k, vid, _marker, _size in written.versions:
                    if k.startswith(entry.prefix):
                        await self.store.delete(self.bucket, k, version_id=vid)
        for v in entry.versions:
            if not v.key.startswith(entry.prefix):  # never outside the entry (never a current object elsewhere)
                continue
            await self.store.delete(self.bucket, v.key, version_id=v.version_id)
        line = (f"retention deleted {entry.prefix} ({len(entry.versions)} versions, {entry.bytes} bytes, newest "
                f"{(self.clock.now_ms() - entry.newest_ms) // 1000} s old)")
        log.info("%s", line, extra=ctx(host=host, box=self.box, phase="retention", prefix=entry.prefix,
                                       versions=len(entry.versions), bytes=entry.bytes))
        if self.events is not None and self.actor is not None:
            fact = Fact(kind="retention-deleted", subject=host, id=f"{self.region}:{key}", actor=self.actor,
                        at=self.clock.now_ms(), payload={"region": self.region, "prefix": entry.prefix,
                                                         "manifest": key, "versions": len(entry.versions),
                                                         "bytes": entry.bytes})
            try:
                await publish_fact(self.events, fact)
            except LogError as exc:
                log.warning("fact retention-deleted for %s not published: %s", host, exc)
        return line


__all__ = ["DEFAULT_RETENTION_MS", "Entry", "RetentionSweep", "RetiredEntry", "group_entries", "named_ops",
           "plan_retention", "retention_ms"]
