"""M17's push-only grant as a store wrapper (spec §0.1 M17; model digest "IAM (M17)").

The source region's principal may Put, bare-Delete and CopyObject **into** another region's ``moves/*`` and
nothing else there: no Get, no Head, no listing, no version delete. :class:`PushOnly` wraps the real store and
answers every other request on the guarded bucket with :class:`AccessDenied` (a 403, as S3 does), and records
what it refused, so a test can show the source staged without ever reading the target.
"""

from __future__ import annotations

from collections.abc import Mapping

from services.objstore.port import AccessDenied, Got, Lost, Missing, ObjectEntry, ObjectStore, VersionEntry, Won


class PushOnly:
    """``store`` as the source's principal sees it: ``bucket`` (another region's) is push-only under ``moves/``."""

    def __init__(self, store: ObjectStore, bucket: str) -> None:
        self.store, self.bucket = store, bucket
        self.refused: list[str] = []
        self.writes: list[str] = []

    def _deny(self, op: str, bucket: str, key: str = "") -> None:
        if bucket == self.bucket:
            self.refused.append(f"{op} {key}")
            raise AccessDenied(f"{op} {bucket}/{key}: AccessDenied (M17: the source may only push into moves/*)")

    def _push(self, op: str, bucket: str, key: str) -> None:
        if bucket == self.bucket:
            if not key.startswith("moves/"):
                self._deny(op, bucket, key)
            self.writes.append(f"{op} {key}")

    async def create_bucket(self, bucket: str, *, versioned: bool = True) -> None:
        self._deny("create_bucket", bucket)
        await self.store.create_bucket(bucket, versioned=versioned)

    async def bucket_versioning(self, bucket: str) -> bool:
        self._deny("bucket_versioning", bucket)
        return await self.store.bucket_versioning(bucket)

    async def get(self, bucket: str, key: str, *, version_id: str | None = None) -> Got | Missing:
        self._deny("get", bucket, key)
        return await self.store.get(bucket, key, version_id=version_id)

    async def head(self, bucket: str, key: str, *, version_id: str | None = None) -> Got | Missing:
        self._deny("head", bucket, key)
        return await self.store.head(bucket, key, version_id=version_id)

    async def put(self, bucket: str, key: str, body: bytes, *, if_match: str | None = None,
                  if_none_match: bool = False, metadata: Mapping[str, str] | None = None) -> Won | Lost:
        self._push("put", bucket, key)
        return await self.store.put(bucket, key, body, if_match=if_match, if_none_match=if_none_match,
                                    metadata=metadata)

    async def delete(self, bucket: str, key: str, *, if_match: str | None = None,
                     version_id: str | None = None) -> Won | Lost:
        if version_id is not None or if_match is not None:
            self._deny("delete-version", bucket, key)
        self._push("delete", bucket, key)
        return await self.store.delete(bucket, key, if_match=if_match, version_id=version_id)

    async def copy(self, bucket: str, key: str, *, src_bucket: str, src_key: str,
                   src_version_id: str | None = None) -> Won:
        self._deny("copy-from", src_bucket, src_key)
        self._push("copy", bucket, key)
        return await self.store.copy(bucket, key, src_bucket=src_bucket, src_key=src_key,
                                     src_version_id=src_version_id)

    async def list_versions(self, bucket: str, prefix: str = "", *, after: str = "") -> list[VersionEntry]:
        self._deny("list_versions", bucket, prefix)
        return await self.store.list_versions(bucket, prefix, after=after)

    async def list_keys(self, bucket: str, prefix: str = "") -> list[str]:
        self._deny("list_keys", bucket, prefix)
        return await self.store.list_keys(bucket, prefix)

    async def list_entries(self, bucket: str, prefix: str = "") -> list[ObjectEntry]:
        self._deny("list_keys", bucket, prefix)
        return await self.store.list_entries(bucket, prefix)

    async def close(self) -> None:
        await self.store.close()
