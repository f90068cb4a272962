"""T11's rates, measured by the box itself (spec §7.3 T11 "from three measured rates"; issue 18 item 4).

:class:`RateProbe` measures, in MiB/s:

- the **disk**: a probe file written and fsynced (the write rate: what a restore does), then, evicted from the page
  cache (``posix_fadvise(DONTNEED)``), read back (the read rate: what a snapshot, an anchor and a verification do);
- **regional S3**: objects PUT into, then GET from, this box's own region's bucket (``.carlos-move-probe/``, what
  T4 probes too), ``in_flight`` at a time as a restore and a staging mirror move a replica's files; the slower of
  the two directions;
- the **cross-region** path to a peer region: objects PUT into the peer's bucket under ``moves/_lane/`` (the
  return lane T10 probes, M17's grant: Put and Delete), ``in_flight`` at a time, then deleted.

Each measurement is cached in ``<box>/rates.json`` with the time it was taken and measured again once it is older
than ``max_age_s`` (the local rates once for all peers; the cross-region rate per peer region). A probe that fails
answers None: T11 then fails as "not observed", never on a guess.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kernel.fsutil import atomic_write
from kernel.ports import Clock, blocking
from services.objstore.port import Got, ObjectStore, StoreError, Won
from services.target.budget import Rates

MIB = 1 << 20
PROBE_PREFIX = ".carlos-move-probe/"
LANE_PREFIX = "moves/_lane/"


@dataclass
class RateProbe:
    label: str
    box_dir: Path
    store: ObjectStore
    own_bucket: str
    bucket_of: Callable[[str], str]
    clock: Clock
    max_age_s: float = 600.0
    disk_mib: int = 16
    s3_mib: int = 8
    in_flight: int = 8
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def cache_path(self) -> Path:
        return self.box_dir / "rates.json"

    def cached(self) -> dict[str, Any]:
        try:
            value = json.loads(self.cache_path.read_text())
        except (OSError, ValueError):
            return {}
        return value if isinstance(value, dict) else {}

    def _fresh(self, entry: object) -> bool:
        return isinstance(entry, dict) and isinstance(entry.get("at"), int) and \
            self.clock.now_ms() - entry["at"] <= self.max_age_s * 1000

    async def rates(self, peer_region: str) -> Rates | None:
        """The rates for a cut from ``peer_region`` into this box (measured when the cache is stale)."""
        async with self._lock:
            cache = self.cached()
            local, cross = cache.get("local"), dict(cache.get("cross") or {})
            try:
                if not self._fresh(local):
                    local = {"at": self.clock.now_ms(), **await self.measure_local()}
                if not self._fresh(cross.get(peer_region)):
                    cross[peer_region] = {"at": self.clock.now_ms(),
                                          "mib_s": await self.measure_cross(self.bucket_of(peer_region))}
            except (OSError, StoreError, ZeroDivisionError):
                return None
            await blocking(atomic_write, self.cache_path, json.dumps({"local": local, "cross": cross}).encode(),
                           mode=0o600)
            assert isinstance(local, dict)
            return Rates(cross_region=cross[peer_region]["mib_s"], regional_s3=local["regional_s3"],
                         disk=local["disk_write"], disk_read=local["disk_read"])

    def measured_at(self) -> int | None:
        local = self.cached().get("local")
        return local.get("at") if isinstance(local, dict) else None

    def _objects(self, prefix: str) -> list[tuple[str, bytes]]:
        size = self.s3_mib * MIB // self.in_flight
        return [(f"{prefix}rates-{self.label}-{i}", os.urandom(size)) for i in range(self.in_flight)]

    async def _put_all(self, bucket: str, objects: list[tuple[str, bytes]],
                       versions: dict[str, str] | None = None) -> float:
        """PUT every object at once; the seconds it took. ``versions`` collects the version each PUT made."""
        started = self.clock.monotonic()
        outs = await asyncio.gather(*(self.store.put(bucket, key, body) for key, body in objects))
        if versions is not None:
            versions.update({key: out.version_id for (key, _body), out in zip(objects, outs, strict=True)
                             if isinstance(out, Won) and out.version_id})
        return self.clock.monotonic() - started

    async def _delete_all(self, bucket: str, objects: list[tuple[str, bytes]],
                          versions: dict[str, str] | None = None) -> None:
        """Delete every object: by the version its PUT made where ``versions`` names one (this box's own bucket: no
        noncurrent version or delete marker of a 1 MiB probe is left, issue 16 item 2), else bare (another region's
        bucket, where M17 grants only a bare delete)."""
        for key, _body in objects:
            with contextlib.suppress(StoreError):
                await self.store.delete(bucket, key, version_id=(versions or {}).get(key))

    async def measure_local(self) -> dict[str, float]:
        write, read = await blocking(self._disk)
        objects = self._objects(PROBE_PREFIX)
        versions: dict[str, str] = {}
        try:
            put_s = await self._put_all(self.own_bucket, objects, versions)
            started = self.clock.monotonic()
            got = await asyncio.gather(*(self.store.get(self.own_bucket, key) for key, _body in objects))
            get_s = self.clock.monotonic() - started
        finally:
            await self._delete_all(self.own_bucket, objects, versions)
        if any(not isinstance(g, Got) or g.body != body for g, (_key, body) in zip(got, objects, strict=True)):
            raise OSError("the rate probe's objects did not read back")
        s3 = min(self.s3_mib / max(put_s, 1e-6), self.s3_mib / max(get_s, 1e-6))
        return {"disk_write": write, "disk_read": read, "regional_s3": s3}

    async def measure_cross(self, bucket: str) -> float:
        objects = self._objects(LANE_PREFIX)
        try:
            put_s = await self._put_all(bucket, objects)
        finally:
            await self._delete_all(bucket, objects)
        return self.s3_mib / max(put_s, 1e-6)

    def _disk(self) -> tuple[float, float]:
        path = self.box_dir / ".rates-probe"
        chunk = os.urandom(MIB)
        started = self.clock.monotonic()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            for _ in range(self.disk_mib):
                os.write(fd, chunk)
            os.fsync(fd)
        finally:
            os.close(fd)
        write_s = self.clock.monotonic() - started
        fd = os.open(path, os.O_RDONLY)
        try:
            with contextlib.suppress(AttributeError, OSError):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # read the disk, not the page cache
            started = self.clock.monotonic()
            while os.read(fd, MIB):
                pass
            read_s = self.clock.monotonic() - started
        finally:
            os.close(fd)
            path.unlink(missing_ok=True)
        return self.disk_mib / max(write_s, 1e-6), self.disk_mib / max(read_s, 1e-6)


__all__ = ["RateProbe"]
