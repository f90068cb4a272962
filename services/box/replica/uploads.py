"""A writer session's uncertain uploads, durable beside its database (spec §5.1 step 9 "Certificate", §7.14 "first
upload ... the session is uncertain for good"; model rule ``close-evidence``, R8-5, R9-5, R10-7).

A PUT whose answer was not seen (a timeout, a lost response, a client that retried on its own, a process that died
mid-request) may still land later, and since LTX keys are reused (a TXID range) a late one can replace a newer
object under the same key. A session with such an attempt is **uncertain**: its clean close writes no certificate,
so the next admission declares it (the uncertainty is sticky).

``<host>.uploads`` records, before every request, the key and the ETag (MD5) of the bytes sent, and the count of
attempts; a request answered on its first attempt is settled at once. Otherwise the key stays uncertain until a
version listing **observes** it settled: every attempt of every body sent to the key appears as a version of that
ETag (a request lands at most once), and the key's latest version is the last upload this session saw succeed (or
the delete marker of its own compaction): nothing unresolved can land over it any more. The file survives the
process, so a successor flushing the same generation (``Activator.flush_orphan``) knows what a dead process had in
flight; it is removed with the local database (``purge_local_db``).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from kernel.fsutil import atomic_write
from services.box.replica.layout import parse_ltx_name
from services.objstore.port import ObjectStore


def uploads_path(db_path: Path) -> Path:
    return db_path.with_suffix(".uploads")


def body_etag(body: bytes) -> str:
    """The ETag S3 gives a single-part PUT of ``body`` (its MD5, quoted)."""
    return '"' + hashlib.md5(body, usedforsecurity=False).hexdigest() + '"'


class KeyUploads(msgspec.Struct):
    attempts: dict[str, int] = msgspec.field(default_factory=dict)  # ETag -> requests sent
    won: str | None = None  # the version id of the last request this session saw succeed


class UploadsFile(msgspec.Struct):
    generation: str
    keys: dict[str, KeyUploads] = msgspec.field(default_factory=dict)


def _same(a: str | None, b: str) -> bool:
    return a is not None and a.strip('"') == b.strip('"')


@dataclass
class Uploads:
    """The durable record of one generation's uncertain uploads on this box (module doc)."""

    path: Path
    generation: str
    keys: dict[str, KeyUploads] = field(default_factory=dict)

    @classmethod
    def open(cls, db_path: Path, generation: str) -> Uploads:
        """The record of ``generation`` beside ``db_path``: what an earlier process of the same generation left,
        or an empty one (another generation's record belongs to a session already admitted over)."""
        path = uploads_path(db_path)
        try:
            found = msgspec.json.decode(path.read_bytes(), type=UploadsFile)
        except (FileNotFoundError, msgspec.DecodeError):
            found = None
        keys = dict(found.keys) if found is not None and found.generation == generation else {}
        return cls(path, generation, keys)

    def _save(self) -> None:
        if not self.keys:
            self.path.unlink(missing_ok=True)
            return
        if self.path.parent.exists():
            atomic_write(self.path, msgspec.json.encode(UploadsFile(self.generation, self.keys)), mode=0o600)

    def begin(self, key: str, etag: str) -> None:
        """Before a request: one more attempt of ``etag`` at ``key``, durably."""
        entry = self.keys.setdefault(key, KeyUploads())
        entry.attempts[etag] = entry.attempts.get(etag, 0) + 1
        self._save()

    def answered(self, key: str, etag: str, version_id: str | None, attempts: int) -> bool:
        """A request's answer (``attempts``: what the client sent for it). Settles the key at once when nothing but
        this one attempt was ever sent to it; answers whether the key is still uncertain."""
        entry = self.keys.setdefault(key, KeyUploads())
        entry.attempts[etag] = entry.attempts.get(etag, 1) + max(attempts - 1, 0)
        entry.won = version_id
        if entry.attempts == {etag: 1}:
            del self.keys[key]
            self._save()
            return False
        self._save()
        return True

    @property
    def uncertain(self) -> list[str]:
        return sorted(self.keys)

    async def observe(self, store: ObjectStore, bucket: str) -> list[str]:
        """Settle every key a version listing shows settled (module doc); answers the keys still uncertain."""
        for key in list(self.keys):
            entry = self.keys[key]
            versions = [v for v in await store.list_versions(bucket, key) if v.key == key]
            landed = all(sum(1 for v in versions if _same(v.etag, etag)) >= n for etag, n in entry.attempts.items())
            latest = next((v for v in versions if v.is_latest), None)
            ours = latest is not None and (latest.is_delete_marker or (entry.won is not None
                                                                      and latest.version_id == entry.won))
            if landed and ours:
                del self.keys[key]
        self._save()
        return self.uncertain

    def level0_ranges(self) -> list[tuple[int, int]]:
        """The TXID ranges of the uncertain level-0 keys (a dead writer's uploads in flight)."""
        out = []
        for key in self.keys:
            parsed = parse_ltx_name("/".join(key.split("/")[-2:]))
            if parsed is not None and parsed[0] == 0:
                out.append((parsed[1], parsed[2]))
        return sorted(out)

    async def supersede(self, store: ObjectStore, bucket: str, key: str, version_id: str | None, lo: int, hi: int
                        ) -> list[str]:
        """A later successful upload of the same range, observed by version: once ``key``'s latest version is
        ``version_id`` (a full level-0 file ``[lo, hi]``), every uncertain level-0 key inside ``[lo, hi]`` is
        settled, since whatever of it lands later is a file the restore passes over for this one (§5.1 step 4:
        the file reaching the higher TXID wins). Answers the keys still uncertain."""
        versions = [v for v in await store.list_versions(bucket, key) if v.key == key]
        latest = next((v for v in versions if v.is_latest), None)
        if latest is None or version_id is None or latest.version_id != version_id:
            return self.uncertain
        for k in list(self.keys):
            parsed = parse_ltx_name("/".join(k.split("/")[-2:]))
            if k != key and parsed is not None and parsed[0] == 0 and lo <= parsed[1] and parsed[2] <= hi:
                del self.keys[k]
        self._save()
        return self.uncertain

    def discard(self) -> None:
        self.keys.clear()
        self.path.unlink(missing_ok=True)


__all__ = ["KeyUploads", "Uploads", "UploadsFile", "body_etag", "uploads_path"]
