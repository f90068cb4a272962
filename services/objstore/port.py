"""The object store port (ARCHITECTURE §4, §7; spec claim C3, C6).

Races are values, defects are errors (run-store concepts, "Competition is a value"):

- :class:`Got` / :class:`Missing` answer a read;
- :class:`Won` (new ETag and version) / :class:`Lost` (the current ETag, or ``None`` when the key is
  missing) answer a conditional write or delete;
- :class:`StoreError` and its subclasses are defects: the caller must not act on them (C6).

ETags are carried **quoted**, exactly as S3 returns them. Version ids are opaque strings and are
never ordered (stack facts §5.6: SeaweedFS's decrease over time).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class Got:
    body: bytes
    etag: str
    version_id: str | None
    metadata: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Missing:
    """No current object at the key (absent, or its latest version is a delete marker)."""


@dataclass(frozen=True)
class Won:
    etag: str | None
    version_id: str | None
    attempts: int = 1
    """How many requests the client sent for this answer (an SDK's own retries included): above one, an earlier
    attempt's outcome is unknown and it may still land (§5.1 step 9 "a retry ... the session is uncertain")."""


@dataclass(frozen=True)
class Lost:
    """A precondition failed. ``current_etag`` is what a follow-up HEAD saw (``None``: missing)."""

    current_etag: str | None


@dataclass(frozen=True)
class VersionEntry:
    key: str
    version_id: str
    is_latest: bool
    is_delete_marker: bool
    etag: str | None
    size: int
    last_modified_ms: int


@dataclass(frozen=True)
class ObjectEntry:
    """A current object of a listing: its key and ETag (quoted), as ListObjectsV2 gives them, 1,000 a request."""

    key: str
    etag: str | None
    size: int


class StoreError(Exception):
    """A defect talking to the store. Never a reason to act (C6)."""


class StoreUnavailable(StoreError):
    """5xx, connection failure or timeout: the outcome of the request is unknown."""


class AccessDenied(StoreError):
    """403: the credentials or the role's policy do not allow this (M17)."""


class NoSuchBucket(StoreError):
    pass


class InvalidRequest(StoreError):
    """4xx other than 403/404/412: the request itself is wrong."""


class ObjectStore(Protocol):
    """What every service may ask of S3. Implemented by ``S3Store`` and ``MemoryStore``."""

    async def create_bucket(self, bucket: str, *, versioned: bool = True) -> None: ...

    async def bucket_versioning(self, bucket: str) -> bool: ...

    async def get(self, bucket: str, key: str, *, version_id: str | None = None) -> Got | Missing: ...

    async def head(self, bucket: str, key: str, *, version_id: str | None = None) -> Got | Missing:
        """Like :meth:`get` with an empty body."""
        ...

    async def put(
        self,
        bucket: str,
        key: str,
        body: bytes,
        *,
        if_match: str | None = None,
        if_none_match: bool = False,
        metadata: Mapping[str, str] | None = None,
    ) -> Won | Lost:
        """Unconditional, ``If-Match: <etag>`` or ``If-None-Match: *`` (create only)."""
        ...

    async def delete(
        self, bucket: str, key: str, *, if_match: str | None = None, version_id: str | None = None
    ) -> Won | Lost:
        """Delete the current object (leaves a delete marker when versioned) or one exact version."""
        ...

    async def copy(
        self, bucket: str, key: str, *, src_bucket: str, src_key: str, src_version_id: str | None = None
    ) -> Won: ...

    async def list_versions(self, bucket: str, prefix: str = "", *, after: str = "") -> list[VersionEntry]:
        """Every version and delete marker under ``prefix``, all pages, in key order; with ``after``, only those of
        keys that sort after it (S3's ``KeyMarker``: a listing that starts where an earlier one ended, so its cost is
        what is new, issue 19 item 9)."""
        ...

    async def list_keys(self, bucket: str, prefix: str = "") -> list[str]:
        """Current keys under ``prefix``, all pages, in key order."""
        ...

    async def list_entries(self, bucket: str, prefix: str = "") -> list[ObjectEntry]:
        """Current objects under ``prefix`` with their ETags, all pages, in key order (issue 19 item 2: a reader
        that keeps what it read by ETag GETs only what changed)."""
        ...

    async def close(self) -> None: ...
