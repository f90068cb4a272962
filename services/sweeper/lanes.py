"""What other regions' probes leave in this region's bucket (issue 16 item 6; spec §7.3 T10 and T11; ruling M17).

A target assesses its return lane (T10) and measures the cross-region rate (T11) by PUTting objects under
``moves/_lane/`` in the source region's bucket and deleting them again. M17 grants a box only a bare delete in
another region's bucket, so in a versioned bucket every probe leaves its version behind a delete marker: a few
bytes and two versions a move for T10, the rate probe's objects for T11, for ever. Nothing reads them.

So each region's box, in its own bucket, where it may delete by version, retires every version and delete marker
under ``moves/_lane/`` older than ``grace_ms`` (one sweep period): a probe still running is seconds old, and a
probe object that outlived its prober (a crash between the PUT and the delete) goes with the rest. Nothing else is
listed or touched: the prefix is the probes' own (``moves/<host>/`` lanes are the staging sweep's, §6.4).
:func:`probes_to_retire` is the pure rule; :class:`LaneProbeSweep` the runner the box agent calls every scan.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

from kernel.logctx import ctx
from kernel.ports import Clock
from services.objstore.port import ObjectStore, StoreError, VersionEntry

log = logging.getLogger("hostmove.sweeper")

LANE_PROBES = "moves/_lane/"
"""The prefix of T10's and T11's cross-region probes (``services/target/readiness.py``, ``rates.py``)."""


def probes_to_retire(versions: Iterable[VersionEntry], now_ms: int, grace_ms: int) -> list[VersionEntry]:
    """Every version and delete marker under :data:`LANE_PROBES` last modified more than ``grace_ms`` ago. Pure."""
    return [v for v in versions
            if v.key.startswith(LANE_PROBES) and v.key != LANE_PROBES and now_ms - v.last_modified_ms > grace_ms]


@dataclass
class LaneProbeSweep:
    """One box's sweep of the probes under ``moves/_lane/`` in its own region's ``bucket``, at most once every
    ``every_ms``. Nothing it keeps in memory matters: a missed run is the next one's."""

    box: str
    store: ObjectStore
    bucket: str
    clock: Clock
    every_ms: int
    _next_ms: int = 0

    async def run(self) -> int:
        """Retire what :func:`probes_to_retire` names, by exact version id; answers how many. A listing that fails
        retires nothing (a read error never acts); a delete that fails is retried at the next run."""
        now = self.clock.now_ms()
        if now < self._next_ms:
            return 0
        self._next_ms = now + self.every_ms
        try:
            versions = await self.store.list_versions(self.bucket, LANE_PROBES)
        except StoreError as exc:
            log.warning("lane probe sweep of %s on %s: the listing failed: %s", self.bucket, self.box, exc,
                        extra=ctx(box=self.box, phase="lane-sweep", bucket=self.bucket, reason=exc))
            return 0
        retired = 0
        for entry in probes_to_retire(versions, now, self.every_ms):
            try:
                await self.store.delete(self.bucket, entry.key, version_id=entry.version_id)
            except StoreError as exc:
                log.warning("lane probe sweep: %s (version %s) not deleted: %s", entry.key, entry.version_id, exc,
                            extra=ctx(box=self.box, phase="lane-sweep", key=entry.key, reason=exc))
                continue
            retired += 1
        if retired:
            log.info("lane probe sweep of %s: %d version(s) retired", self.bucket, retired,
                     extra=ctx(box=self.box, phase="lane-sweep", bucket=self.bucket, retired=retired))
        return retired


__all__ = ["LANE_PROBES", "LaneProbeSweep", "probes_to_retire"]
