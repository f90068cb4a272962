"""The noncurrent history of a host's claim and record, staging leases and move journals, bounded (issue 16
"Bounded storage"; claim C5a; §6.4's horizon ``H``; rule ``ledger-history-bounded``).

The claim and the record are rewritten by CAS in a versioned bucket, so every transition (each wake's admission and
publication, each step of a move) leaves the version it replaced behind as a noncurrent version, for ever. Nothing
reads one: the ledger's relay and rebase read the **current** object and the stream (``Ledger.ensure_published``),
the audit folds the JetStream history and compares it with the current objects (:mod:`services.ledger.audit`), and
a CAS conditions on the current ETag. So the console's recovery pass (ruling M17: no box deletes in the deployment
bucket), at most once a minute per host, deletes a noncurrent
version of ``control/hosts/<host>.json`` and ``control/records/<host>.json`` by its exact ``VersionId`` when it is
older than ``H`` and beyond the newest :data:`KEEP_NONCURRENT` noncurrent ones (an operator's recent history, by
hand). Never the current version, never a delete marker (a claim or record is never deleted, C5a: there are none),
nothing on a listing error (it raises before any delete). :func:`noncurrent_to_retire` is the pure decider.

The same holds for the other objects of a host the deployment bucket rewrites in place (issue 16 item 2, found by
``bench/retention``'s per-object version listing): its staging lease in each region of the roster
(``control/staging-leases/<region>/<host>.json``, renewed every preparing round, §7.3) and the journals of its moves
under ``moves/<host>/<op>/`` (``source.json`` and ``target.json`` rewritten at each assessment, ``staged-source.json``
at each mirror round, §7.3), a move leaving hundreds of noncurrent versions of each. Their current versions are what
the door's status, an operator and the audit read, and they stay; nothing under the lane of an operation the claim
or the record still names is touched (:func:`journals_to_retire`), and the sweep runs only at rest.

An S3 lifecycle rule (``NoncurrentVersionExpiration``) would do the same where a store honours it; SeaweedFS 4.48
stores such a rule and reads it back, but evaluates it only in its admin lifecycle worker at day granularity, which
a deployment here cannot show working: the sweep is what bounds it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Final

from kernel import rules
from kernel.logctx import ctx
from kernel.ports import Clock
from services.ledger.ledger import object_key
from services.move.follow import host_segment
from services.move.lease import lease_key
from services.objstore.port import ObjectStore, VersionEntry, Won

log = logging.getLogger("hostmove.sweeper")

KEEP_NONCURRENT: Final = 4
"""Noncurrent versions of each object kept however old (the newest ones)."""
CLOCK_SLACK_MS: Final = 1_000
"""S3's ``LastModified`` has one-second resolution: a version is older than ``H`` only by this much more."""

rules.register(
    "ledger-history-bounded",
    section="issue 16 (bounded storage); claim C5a; §6.4 (the horizon H)",
    meaning="noncurrent versions of a host's claim and record older than H and beyond the newest few are deleted "
            "by exact version id, never the current one",
    site="services/sweeper/history.py noncurrent_to_retire",
)


def noncurrent_to_retire(entries: list[VersionEntry], key: str, *, now_ms: int, horizon_ms: int,
                         keep: int = KEEP_NONCURRENT) -> list[VersionEntry]:
    """The versions of exactly ``key`` to delete: noncurrent, not a delete marker, not among the ``keep`` newest
    noncurrent ones (ties in ``LastModified`` kept together), and last modified more than ``horizon_ms`` (plus the
    clock's slack) before ``now_ms``. Nothing when the listing shows no current version of ``key``. Pure."""
    if not rules.on("ledger-history-bounded"):
        return []
    mine = [e for e in entries if e.key == key]
    if not any(e.is_latest and not e.is_delete_marker for e in mine):
        return []
    older = [e for e in mine if not e.is_latest and not e.is_delete_marker]
    if len(older) <= keep:
        return []
    floor = sorted((e.last_modified_ms for e in older), reverse=True)[keep - 1] if keep > 0 else None
    cutoff = now_ms - horizon_ms - CLOCK_SLACK_MS
    return sorted((e for e in older if (floor is None or e.last_modified_ms < floor) and e.last_modified_ms < cutoff),
                  key=lambda e: e.last_modified_ms)


def journals_to_retire(entries: list[VersionEntry], prefix: str, *, live_ops: frozenset[str], now_ms: int,
                       horizon_ms: int, keep: int = KEEP_NONCURRENT) -> list[VersionEntry]:
    """Of a listing of a host's move journals (``prefix`` is ``moves/<host>/``), what :func:`noncurrent_to_retire`
    names for each key, except under the lane of an operation in ``live_ops`` (one the claim or the record still
    names). Pure."""
    keys = sorted({e.key for e in entries if e.key.startswith(prefix)})
    out: list[VersionEntry] = []
    for key in keys:
        if key[len(prefix):].split("/", 1)[0] in live_ops:
            continue
        out += noncurrent_to_retire(entries, key, now_ms=now_ms, horizon_ms=horizon_ms, keep=keep)
    return out


@dataclass
class LedgerHistory:
    """Deletes what :func:`noncurrent_to_retire` names for one host, in the deployment bucket: its claim and record,
    its staging lease in each of ``regions``, and its move journals outside the lanes of ``live_ops``."""

    store: ObjectStore
    bucket: str
    clock: Clock
    horizon_ms: int
    keep: int = KEEP_NONCURRENT

    async def look(self, host: str, *, regions: tuple[str, ...] = (), live_ops: frozenset[str] = frozenset()
                   ) -> list[str]:
        did: list[str] = []
        objects = [(obj, object_key(obj, host)) for obj in ("claim", "record")]  # type: ignore[arg-type]
        objects += [(f"staging lease in {region}", lease_key(region, host)) for region in regions]
        for obj, key in objects:
            now = self.clock.now_ms()
            entries = await self.store.list_versions(self.bucket, key)  # an error raises: nothing deleted
            retire = noncurrent_to_retire(entries, key, now_ms=now, horizon_ms=self.horizon_ms, keep=self.keep)
            await self._delete(host, obj, retire, did)
        prefix = f"moves/{host_segment(host)}/"
        now = self.clock.now_ms()
        entries = await self.store.list_versions(self.bucket, prefix)
        retire = journals_to_retire(entries, prefix, live_ops=live_ops, now_ms=now, horizon_ms=self.horizon_ms,
                                    keep=self.keep)
        await self._delete(host, "move journals", retire, did)
        return did

    async def _delete(self, host: str, obj: str, retire: list[VersionEntry], did: list[str]) -> None:
        deleted = 0
        for e in retire:
            out = await self.store.delete(self.bucket, e.key, version_id=e.version_id)
            deleted += isinstance(out, Won)
        if deleted:
            did.append(f"{deleted} noncurrent version(s) of the {obj} deleted")
            log.info("%d noncurrent version(s) of the %s of %s deleted by version id", deleted, obj, host,
                     extra=ctx(host=host, phase="ledger-history", obj=obj, objects=deleted))


__all__ = ["KEEP_NONCURRENT", "LedgerHistory", "journals_to_retire", "noncurrent_to_retire"]
