"""The bucket park of one retirement scope, by exact versions (spec §6.4; claim §6.2, §6.2a; digest D§8).

A park moves every version under a scope's location (noncurrent ones and delete markers included) out of
the live namespace:

1. **Snapshot**: list every version under the location (the live lock ``lock.json`` excluded, N6).
2. **Copy** every non-marker version by ``versionId`` to ``superseded/<host>/<op>/<event>/<key>@<versionId>``
   (the archive set). A copy whose destination exists is skipped, so progress accumulates (model 2).
3. **Manifest**: once every copy exists, write ``superseded/<host>/<op>/<event>/manifest.json`` create-only,
   naming the archive set and the deletion set (every version, markers included).
4. **Delete** each version of the deletion set by ``VersionId`` (N1: never a bare-key delete).

Each pass that finds anything is its own retirement event with its own immutable manifest (D5, N7):
``<kind>-1``, ``<kind>-2``, ... A replay re-reads every manifest already written and replays its
deletion set (deleting a version that is gone succeeds), then lists again.

**Verify after the horizon** (§5.3 last paragraph, §6.4): the park acknowledges only on a listing that
shows nothing left under the scope and was taken later than ``evidence_at + H``, ``H`` = the signature-age
limit plus ``request_limit`` (15 min + 120 s in production). A late completion found by that listing is
parked as a further event of the same obligation and the verification repeats. Before the horizon the park
answers :class:`Waiting`; a timer wakes it again. The park never reads the time except through the Clock
port, and never sleeps.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final

import msgspec

from events.base import canonical
from events.claim import Scope
from kernel import rules
from kernel.logctx import ctx
from kernel.ports import Clock
from kernel.timetext import utc_text
from services.box.replica.layout import generation_prefixes
from services.objstore.port import Got, Lost, ObjectStore, VersionEntry

log = logging.getLogger("hostmove.park")

rules.register(
    "park-by-version",
    section="§6.4 Exact versions, CC2, model 2; joint N1",
    meaning="a park deletes every version (markers included) by VersionId, never by bare key",
    site="services/move/park.py _delete_set",
)
rules.register(
    "quiet-before-ack",
    section="CC1, model 1; §5.3; §6.4 Verify after the horizon; claim §6.2a",
    meaning="a park acknowledges only on an empty listing taken later than evidence_at + H",
    site="services/move/park.py park_scope",
)
rules.register(
    "scope-membership",
    section="claim 6.24, R16-2; §6.4 A park executes strictly within its scope; INV-23",
    meaning="every key a park archives or deletes, listed or replayed from a manifest, is a member of its scope",
    site="services/move/park.py _check_members",
)

LOCK_NAME: Final = "lock.json"
MAX_EVENTS_PER_CALL: Final = 16
_INCARNATION = re.compile(r"[0-9a-f]{64}")


class ParkError(Exception):
    """The park cannot go on safely; the message says why in plain words. Never acted around (C6)."""


@dataclass(frozen=True)
class ParkTiming:
    """The late-completion horizon's parts (ARCHITECTURE §7 timing profile; §5.3, claim §6.2a).

    ``request_limit_ms`` None: use the scope's persisted ``request_limit`` (production). A test profile
    scales both parts down."""

    name: str
    signature_age_ms: int
    request_limit_ms: int | None = None

    def horizon_ms(self, scope: Scope) -> int:
        """``H`` = signature-age limit + ``request_limit``."""
        limit = scope.request_limit_ms if self.request_limit_ms is None else self.request_limit_ms
        return self.signature_age_ms + limit


PRODUCTION: Final = ParkTiming("production", signature_age_ms=15 * 60_000)
FAST: Final = ParkTiming("fast", signature_age_ms=300, request_limit_ms=200)


class ArchivedVersion(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One member of the archive set: ``key@version_id`` copied to ``dest``."""

    key: str
    version_id: str
    dest: str
    etag: str | None = None
    size: int = 0


class DeletedVersion(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One member of the deletion set: an exact version (a delete marker included)."""

    key: str
    version_id: str
    delete_marker: bool = False


class ParkManifest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The immutable manifest of one retirement event (claim §6.2; §6.4)."""

    host: str
    op: str
    event: str
    location: str
    incarnation: str
    evidence_at: int | None
    listed_at: int
    archive: tuple[ArchivedVersion, ...]
    deletion: tuple[DeletedVersion, ...]
    generation: str | None = None
    """A ``park-generation``'s generation (``""`` the origin): the event holds only its prefixes."""


@dataclass(frozen=True)
class Acknowledged:
    """Nothing is left under the scope on a listing taken at ``listed_at`` > ``evidence_at + H``."""

    events: tuple[str, ...]
    listed_at: int


@dataclass(frozen=True)
class Waiting:
    """Parked so far, but the horizon has not passed: wake again at ``until`` (ms)."""

    events: tuple[str, ...]
    until: int
    reason: str


ParkOutcome = Acknowledged | Waiting


def location_prefix(location: str, host: str) -> str:
    """The scope's location as a listing prefix (``/``-terminated), checked against the grammar of §6.4:
    ``instances/<host>``, ``instances/<host>/<inc>``, ``moves/<host>``, ``moves/<host>/<op>``."""
    loc = location.rstrip("/")
    parts = loc.split("/")
    ok = (
        len(parts) in (2, 3)
        and parts[0] in ("instances", "moves")
        and parts[1] == host
        and all(parts)
        and (len(parts) == 2 or parts[0] == "moves" or _INCARNATION.fullmatch(parts[2]) is not None)
    )
    if not ok:
        raise ParkError(f"the park scope {location!r} is not a location of host {host!r} (§6.4); nothing was touched")
    return loc + "/"


def destination(host: str, op: str, event: str) -> str:
    """``superseded/<host>/<op>/<event>/`` (digest D§0; one destination per retirement event)."""
    return f"superseded/{host}/{op}/{event}/"


def in_scope(key: str, prefix: str) -> bool:
    """Is ``key`` a member of the scope at ``prefix``? The live lock is not (N6); the legacy
    ``instances/<host>/`` scope excludes child incarnations (§6.4)."""
    if not key.startswith(prefix) or key == prefix + LOCK_NAME:
        return False
    rest = key[len(prefix):]
    legacy = prefix.startswith("instances/") and prefix.count("/") == 2
    if legacy and "/" in rest and _INCARNATION.fullmatch(rest.split("/", 1)[0]):
        return False
    return True


def member_prefixes(prefix: str, generation: str | None) -> tuple[str, ...]:
    """What a park lists: its location, or only a generation's prefixes inside it (``park-generation``)."""
    if generation is None:
        return (prefix,)
    return generation_prefixes(prefix.rstrip("/"), generation)


def is_member(key: str, prefix: str, generation: str | None) -> bool:
    """A member of the scope (:func:`in_scope`) and, for a generation's park, of that generation."""
    return in_scope(key, prefix) and any(key.startswith(p) for p in member_prefixes(prefix, generation))


def plan_event(
    entries: list[VersionEntry], *, host: str, op: str, event: str, prefix: str, scope: Scope, listed_at: int,
    generation: str | None = None,
) -> ParkManifest:
    """The manifest of one event from a snapshot listing. Pure."""
    members = sorted((e for e in entries if is_member(e.key, prefix, generation)),
                     key=lambda e: (e.key, e.version_id))
    dest = destination(host, op, event)
    archive = tuple(
        ArchivedVersion(key=e.key, version_id=e.version_id, dest=f"{dest}{e.key}@{e.version_id}", etag=e.etag,
                        size=e.size)
        for e in members if not e.is_delete_marker
    )
    deletion = tuple(DeletedVersion(key=e.key, version_id=e.version_id, delete_marker=e.is_delete_marker)
                     for e in members)
    return ParkManifest(host=host, op=op, event=event, location=prefix, incarnation=scope.incarnation,
                        evidence_at=scope.evidence_at, listed_at=listed_at, archive=archive, deletion=deletion,
                        generation=generation)


def _check_members(manifest: ParkManifest, prefix: str, host: str, op: str, event: str,
                   generation: str | None = None) -> None:
    """INV-23: a persisted manifest is acted on only if it is this event's and every reference is in scope."""
    if not rules.on("scope-membership"):
        return
    if (manifest.host, manifest.op, manifest.event, manifest.location, manifest.generation) != (
            host, op, event, prefix, generation):
        raise ParkError(f"the manifest of {destination(host, op, event)} belongs to another park; nothing was deleted")
    dest = destination(host, op, event)
    for a in manifest.archive:
        if not is_member(a.key, prefix, generation) or a.dest != f"{dest}{a.key}@{a.version_id}":
            raise ParkError(f"the manifest of {dest} names {a.key!r} outside its scope; nothing was deleted")
    for d in manifest.deletion:
        if not is_member(d.key, prefix, generation):
            raise ParkError(f"the manifest of {dest} names {d.key!r} outside its scope; nothing was deleted")


@dataclass
class Parker:
    """Parks one scope in one bucket. ``faults`` is a test hook called at named points (``after_copies``,
    ``after_manifest``, ``after_delete``) that may raise to simulate a crash."""

    store: ObjectStore
    bucket: str
    clock: Clock
    timing: ParkTiming = PRODUCTION
    faults: Callable[[str], None] | None = None
    _waiting: dict[tuple[str, str, str, str | None, Scope], Waiting] = field(default_factory=dict, repr=False)
    """What this process's last call of a scope answered while its horizon has not passed (see :meth:`park_scope`)."""

    def _fault(self, point: str) -> None:
        if self.faults is not None:
            self.faults(point)

    async def read_manifest(self, host: str, op: str, event: str) -> ParkManifest | None:
        key = destination(host, op, event) + "manifest.json"
        got = await self.store.get(self.bucket, key)
        if not isinstance(got, Got):
            return None
        try:
            return msgspec.json.decode(got.body, type=ParkManifest)
        except msgspec.DecodeError as exc:
            raise ParkError(f"the park manifest {key} is unreadable ({exc}); nothing was deleted") from None

    def waiting(self, *, host: str, op: str, kind: str, scope: Scope, generation: str | None = None) -> Waiting | None:
        """What :meth:`park_scope` answers now without a request: the Waiting of this process's last call of the
        scope while its horizon has not passed (see there), else None (the park must run)."""
        key = (host, op, kind, generation, scope)
        waited = self._waiting.pop(key, None)
        if waited is None or scope.evidence_at is None or self.clock.now_ms() >= waited.until:
            return None
        self._waiting[key] = waited
        return waited

    async def park_scope(self, *, host: str, op: str, kind: str, scope: Scope,
                         generation: str | None = None) -> ParkOutcome:
        """Park everything under ``scope.location`` (with ``generation``: only that generation's prefixes in it,
        a ``park-generation``) and verify after the horizon (§6.4). Idempotent: call it again after a crash or a
        :class:`Waiting` answer with the same arguments (the scope is persisted on the claim, so the evidence time
        is the original one)."""
        prefix = location_prefix(scope.location, host)
        if scope.evidence_at is None:
            raise ParkError(f"the {kind} scope of {host} has no evidence time; a park never starts its own horizon")
        deadline = scope.evidence_at + self.timing.horizon_ms(scope)
        # A call that answered Waiting had replayed every event's deletion set and listed the scope empty. Until
        # the horizon passes, another call could only replay those deletions (no-ops) and list again: empty, or a
        # late completion it would park as a further event. Nothing acknowledges before a listing later than the
        # horizon, which lists (and parks) whatever landed meanwhile, so the calls in between (every scan's pass
        # of the host, every minute while the park waits some 17 minutes) answer the same Waiting and touch
        # nothing. In memory only: a restarted agent replays from the manifests.
        memo_key = (host, op, kind, generation, scope)
        waited = self.waiting(host=host, op=op, kind=kind, scope=scope, generation=generation)
        if waited is not None:
            return waited
        events: list[str] = []
        n = 1
        while True:
            if len(events) >= MAX_EVENTS_PER_CALL:
                raise ParkError(f"the {kind} park of {host} wrote {len(events)} events and the scope still refills; "
                                "something keeps writing into a retired location")
            event = f"{kind}-{n}"
            manifest = await self.read_manifest(host, op, event)
            if manifest is not None:  # a replay: finish the event as its immutable manifest says
                _check_members(manifest, prefix, host, op, event, generation)
                await self._delete_set(manifest)
                events.append(event)
                n += 1
                continue
            listed_at = self.clock.now_ms()  # taken before the listing: the listing is no older than this
            entries = [e for p in member_prefixes(prefix, generation)
                       for e in await self.store.list_versions(self.bucket, p)]
            plan = plan_event(entries, host=host, op=op, event=event, prefix=prefix, scope=scope, listed_at=listed_at,
                              generation=generation)
            if not plan.deletion:
                if not rules.on("quiet-before-ack") or listed_at > deadline:
                    log.info("park %s of %s acknowledged after %d event(s)", kind, host, len(events),
                             extra=ctx(host=host, op_id=op, phase="park", park=kind, events=len(events),
                                       location=scope.location))
                    return Acknowledged(tuple(events), listed_at)
                waiting = Waiting(tuple(events), deadline + 1,
                                  f"waiting for the late-completion horizon: the scope is empty, but a request "
                                  f"signed before the evidence could still land until {utc_text(deadline)}")
                self._waiting[memo_key] = waiting
                return waiting
            await self._run_event(plan)
            events.append(event)
            n += 1

    async def _run_event(self, plan: ParkManifest) -> None:
        for a in plan.archive:
            if isinstance(await self.store.head(self.bucket, a.dest), Got):
                continue  # landed on an earlier attempt (model 2)
            await self.store.copy(self.bucket, a.dest, src_bucket=self.bucket, src_key=a.key,
                                  src_version_id=a.version_id)
        self._fault("after_copies")
        key = destination(plan.host, plan.op, plan.event) + "manifest.json"
        put = await self.store.put(self.bucket, key, canonical(plan), if_none_match=True)
        if isinstance(put, Lost):
            # Another attempt wrote this event's manifest first: the written one is the event (immutable).
            written = await self.read_manifest(plan.host, plan.op, plan.event)
            if written is None:
                raise ParkError(f"the manifest {key} was refused as existing but cannot be read; nothing was deleted")
            _check_members(written, plan.location, plan.host, plan.op, plan.event, plan.generation)
            plan = written
        self._fault("after_manifest")
        await self._delete_set(plan)

    async def _delete_set(self, manifest: ParkManifest) -> None:
        if not rules.on("park-by-version"):  # the mutation: bare-key deletes, one per key (markers pile up)
            for key in sorted({d.key for d in manifest.deletion}):
                await self.store.delete(self.bucket, key)
            return
        for d in manifest.deletion:
            await self.store.delete(self.bucket, d.key, version_id=d.version_id)
            self._fault("after_delete")
