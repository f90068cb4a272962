"""``S3Store``: the object store port over aioboto3, tuned for SeaweedFS (stack facts §2, §5).

Rules this adapter keeps:

- Long-lived clients (:meth:`S3Store.open` enters the aioboto3 contexts once), path-style addressing,
  ``max_pool_connections=64``, and small botocore retries so a 5xx surfaces quickly. Conditional
  writes and deletes go through a second client with no retries: a retry after a lost response
  would meet our own write and turn a win into a false :class:`Lost` (C6).
- ``verify=False`` for ``http://`` endpoints: aiobotocore builds its SSL context eagerly and a missing
  ``AWS_CA_BUNDLE`` file breaks even plain-http requests (stack facts §2, §5.9).
- Races are values: 412 answers :class:`Lost` with the ETag a follow-up HEAD sees; 404 on a read
  answers :class:`Missing`. Everything else is a :class:`StoreError` the caller must not act on (C6).
- Versions are exact (C3): get/head/delete/copy can address one version id; listings keep the server's
  newest-first order within a key (SeaweedFS version ids decrease, so they are never sorted, §5.6).
- Error messages carry the operation, bucket, key, S3 code and HTTP status, never credentials.

SeaweedFS quirks handled here: ``copy_object`` returns an *unquoted* ETag (re-quoted); HEAD errors have
no body (code ``"404"``/``"403"``), so a HEAD on a missing bucket reads as :class:`Missing`.
"""

from __future__ import annotations

import time
import xml.etree.ElementTree as ET
from collections.abc import Mapping
from contextlib import AsyncExitStack
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import aioboto3
from botocore.config import Config
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    NoCredentialsError,
    ParamValidationError,
    PartialCredentialsError,
)

from kernel import metrics
from services.objstore.memory import normalize_metadata
from services.objstore.port import (
    AccessDenied,
    Got,
    InvalidRequest,
    Lost,
    Missing,
    NoSuchBucket,
    ObjectEntry,
    StoreError,
    StoreUnavailable,
    VersionEntry,
    Won,
)

__all__ = ["S3Store", "quote_etag"]

_ORDER_KEY = "HostmoveEntryOrder"  # injected into the parsed ListObjectVersions response
_UNAVAILABLE_CODES = frozenset({"SlowDown", "RequestTimeout", "ServiceUnavailable", "InternalError"})


def quote_etag(etag: str) -> str:
    """ETags are carried quoted (port docstring); SeaweedFS's copy result is unquoted."""
    return etag if etag.startswith('"') or etag.startswith('W/"') else f'"{etag}"'


@dataclass(frozen=True)
class _Rejection:
    """An S3 error response the calling method asked to handle itself (404, 409, 412)."""

    status: int
    code: str


def _status_code(exc: ClientError) -> tuple[int, str]:
    resp: Mapping[str, Any] = exc.response or {}
    status = int(resp.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
    code = str(resp.get("Error", {}).get("Code") or status or "Unknown")
    return status, code


class S3Store:
    """The :class:`~services.objstore.port.ObjectStore` port over aioboto3 (path-style, one client)."""

    def __init__(
        self,
        endpoint: str,
        access_key: str,
        secret_key: str,
        region: str = "us-east-1",
        *,
        page_size: int = 1000,
        connect_timeout: float = 5.0,
        read_timeout: float = 30.0,
        max_attempts: int = 2,
        verify: bool | str | None = None,
    ) -> None:
        if not 1 <= page_size <= 1000:
            raise ValueError("page_size must be in 1..1000")
        self.endpoint = endpoint
        self.region = region
        self.page_size = page_size
        self._access_key = access_key
        self._secret_key = secret_key
        # http:// never needs a CA bundle; passing False sidesteps the AWS_CA_BUNDLE pitfall (§2).
        self._verify: bool | str | None = False if endpoint.startswith("http://") else verify
        base = Config(
            region_name=region,
            s3={"addressing_style": "path"},
            max_pool_connections=64,
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
        )
        # ``max_attempts`` counts every attempt. botocore's own ``retries["max_attempts"]`` counts
        # retries *after* the first attempt, so ``{"max_attempts": 2}`` would send 3 requests.
        self._config = base.merge(Config(retries={"total_max_attempts": max_attempts, "mode": "standard"}))
        # Conditional writes are never retried by botocore: a retry after a lost response would
        # meet our own write and answer 412, turning a win into a false Lost. The caller gets
        # StoreUnavailable instead and must re-read before acting (C6).
        self._once_config = base.merge(Config(retries={"total_max_attempts": 1, "mode": "standard"}))
        self._stack: AsyncExitStack | None = None
        self._client: Any = None
        self._once: Any = None

    def __repr__(self) -> str:  # never show the secret
        return f"S3Store(endpoint={self.endpoint!r}, region={self.region!r})"

    @classmethod
    async def open(
        cls,
        endpoint: str,
        access_key: str,
        secret_key: str,
        region: str = "us-east-1",
        **options: Any,
    ) -> S3Store:
        """Build the store and enter its long-lived aioboto3 client. Pair with :meth:`close`."""
        store = cls(endpoint, access_key, secret_key, region, **options)
        await store.start()
        return store

    async def start(self) -> None:
        if self._client is not None:
            return
        session = aioboto3.Session(
            aws_access_key_id=self._access_key,
            aws_secret_access_key=self._secret_key,
            region_name=self.region,
        )
        stack = AsyncExitStack()
        try:
            clients = []
            for config in (self._config, self._once_config):
                client = await stack.enter_async_context(
                    session.client(
                        "s3",
                        endpoint_url=self.endpoint,
                        region_name=self.region,
                        aws_access_key_id=self._access_key,
                        aws_secret_access_key=self._secret_key,
                        verify=self._verify,
                        config=config,
                    )
                )
                client.meta.events.register("before-parse.s3.ListObjectVersions", _record_entry_order)
                clients.append(client)
        except BaseException:
            await stack.aclose()
            raise
        self._client, self._once = clients
        self._stack = stack

    async def close(self) -> None:
        stack, self._stack, self._client, self._once = self._stack, None, None, None
        if stack is not None:
            await stack.aclose()

    async def __aenter__(self) -> S3Store:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ------------------------------------------------------------------ plumbing

    def _scrub(self, text: str) -> str:
        for secret in (self._secret_key, self._access_key):
            if secret:
                text = text.replace(secret, "<redacted>")
        return text

    def _map_client_error(self, exc: ClientError, what: str) -> StoreError:
        status, code = _status_code(exc)
        message = str((exc.response or {}).get("Error", {}).get("Message") or "")
        text = self._scrub(f"{what}: {code} (HTTP {status or '?'}){': ' + message if message else ''}")
        if code == "NoSuchBucket":
            return NoSuchBucket(text)
        if status == 403:
            return AccessDenied(text)
        if status >= 500 or status == 0 or code in _UNAVAILABLE_CODES:
            return StoreUnavailable(text)
        return InvalidRequest(text)

    def _map_other(self, exc: BaseException, what: str) -> StoreError:
        text = self._scrub(f"{what}: {type(exc).__name__}: {exc}")
        if isinstance(exc, ParamValidationError):
            return InvalidRequest(text)
        if isinstance(exc, NoCredentialsError | PartialCredentialsError):
            return AccessDenied(text)
        # Connection errors, timeouts, truncated bodies: the outcome is unknown (C6).
        return StoreUnavailable(text)

    def _require_client(self, *, once: bool = False) -> Any:
        client = self._once if once else self._client
        if client is None:
            raise StoreUnavailable(f"S3Store for {self.endpoint} is not open")
        return client

    async def _call(
        self,
        method: str,
        what: str,
        *,
        handle: frozenset[int] = frozenset(),
        once: bool = False,
        **params: Any,
    ) -> dict[str, Any] | _Rejection:
        """Call one client method (``once``: on the client without retries). Error responses with a
        status in ``handle`` come back as a :class:`_Rejection` (except NoSuchBucket); every other
        failure raises a mapped StoreError."""
        client = self._require_client(once=once)
        started, status_text = time.monotonic(), "unreachable"
        try:
            response: dict[str, Any] = await getattr(client, method)(**params)
            status_text = str((response.get("ResponseMetadata") or {}).get("HTTPStatusCode") or 200)
            return response
        except ClientError as exc:
            status, code = _status_code(exc)
            status_text = str(status or "unreachable")
            if status in handle and code != "NoSuchBucket":
                return _Rejection(status, code)
            raise self._map_client_error(exc, what) from None
        except (TimeoutError, BotoCoreError, OSError) as exc:
            raise self._map_other(exc, what) from None
        except Exception as exc:  # aiohttp and friends leaking through aiobotocore
            if type(exc).__module__.startswith(("aiohttp", "botocore", "aiobotocore")):
                raise self._map_other(exc, what) from None
            status_text = "error"
            raise
        except BaseException:  # cancelled mid-request
            status_text = "cancelled"
            raise
        finally:  # every request, by operation and answer (issue 19 item 5)
            metrics.S3_REQUESTS.labels(operation=method, status=status_text).inc()
            metrics.S3_SECONDS.labels(operation=method).observe(time.monotonic() - started)

    async def _current_etag(self, bucket: str, key: str, version_id: str | None = None) -> str | None:
        """The follow-up HEAD behind every :class:`Lost` (port: ``current_etag``)."""
        seen = await self.head(bucket, key, version_id=version_id)
        return seen.etag if isinstance(seen, Got) else None

    # ------------------------------------------------------------------ buckets

    async def create_bucket(self, bucket: str, *, versioned: bool = True) -> None:
        """Create ``bucket`` (an existing bucket we can reach is fine) and enable versioning."""
        params: dict[str, Any] = {"Bucket": bucket}
        if self.region != "us-east-1":
            params["CreateBucketConfiguration"] = {"LocationConstraint": self.region}
        what = f"create_bucket {bucket}"
        res = await self._call("create_bucket", what, handle=frozenset({409}), **params)
        if isinstance(res, _Rejection) and res.code != "BucketAlreadyOwnedByYou":
            # BucketAlreadyExists (or another conflict): fine only if we can reach the bucket.
            probe = await self._call("head_bucket", f"head_bucket {bucket}", handle=frozenset({404}), Bucket=bucket)
            if isinstance(probe, _Rejection):
                raise InvalidRequest(f"{what}: {res.code} (HTTP {res.status})")
        if versioned:
            await self._call(
                "put_bucket_versioning",
                f"put_bucket_versioning {bucket}",
                Bucket=bucket,
                VersioningConfiguration={"Status": "Enabled"},
            )

    async def bucket_versioning(self, bucket: str) -> bool:
        res = await self._call("get_bucket_versioning", f"get_bucket_versioning {bucket}", Bucket=bucket)
        assert isinstance(res, dict)
        return res.get("Status") == "Enabled"

    async def delete_bucket(self, bucket: str) -> None:
        """Not part of the port: purge every version and marker, then drop the bucket.

        Tests must call this: ``weed mini`` holds about 76 written buckets, then PUTs fail with 500.
        A missing bucket is fine.
        """
        try:
            entries = await self.list_versions(bucket)
        except NoSuchBucket:
            return
        for start in range(0, len(entries), 1000):
            chunk = entries[start : start + 1000]
            objects = [{"Key": e.key, "VersionId": e.version_id} for e in chunk]
            res = await self._call(
                "delete_objects",
                f"delete_objects {bucket}",
                Bucket=bucket,
                Delete={"Objects": objects, "Quiet": True},
            )
            assert isinstance(res, dict)
            if res.get("Errors"):
                first = res["Errors"][0]
                raise StoreUnavailable(f"delete_objects {bucket}: {first.get('Code')} on {first.get('Key')}")
        await self._call("delete_bucket", f"delete_bucket {bucket}", handle=frozenset({404}), Bucket=bucket)

    # ------------------------------------------------------------------ objects

    async def get(self, bucket: str, key: str, *, version_id: str | None = None) -> Got | Missing:
        what = f"get {bucket}/{key}" + (f"@{version_id}" if version_id else "")
        params: dict[str, Any] = {"Bucket": bucket, "Key": key}
        if version_id is not None:
            params["VersionId"] = version_id
        # 404 NoSuchKey / NoSuchVersion / latest is a delete marker; 405 is AWS's answer for a marker by id.
        res = await self._call("get_object", what, handle=frozenset({404, 405}), **params)
        if isinstance(res, _Rejection):
            return Missing()
        try:
            async with res["Body"] as stream:
                body: bytes = await stream.read()
        except (TimeoutError, BotoCoreError, OSError) as exc:
            raise self._map_other(exc, what) from None
        except Exception as exc:
            if type(exc).__module__.startswith(("aiohttp", "botocore", "aiobotocore")):
                raise self._map_other(exc, what) from None
            raise
        return _got(res, body)

    async def head(self, bucket: str, key: str, *, version_id: str | None = None) -> Got | Missing:
        what = f"head {bucket}/{key}" + (f"@{version_id}" if version_id else "")
        params: dict[str, Any] = {"Bucket": bucket, "Key": key}
        if version_id is not None:
            params["VersionId"] = version_id
        res = await self._call("head_object", what, handle=frozenset({404, 405}), **params)
        if isinstance(res, _Rejection):
            return Missing()
        return _got(res, b"")

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
        """Unconditional, ``If-Match`` or ``If-None-Match: *``. 412 (and AWS's 409
        ConditionalRequestConflict, where nothing was written) answer :class:`Lost`."""
        what = f"put {bucket}/{key}"
        if if_match is not None and if_none_match:
            raise InvalidRequest(f"{what}: if_match and if_none_match are exclusive")
        params: dict[str, Any] = {"Bucket": bucket, "Key": key, "Body": body}
        if if_match is not None:
            params["IfMatch"] = if_match
        if if_none_match:
            params["IfNoneMatch"] = "*"
        if metadata:
            # Validate here: botocore would send a header-injection error as an HTTPClientError.
            params["Metadata"] = normalize_metadata(what, metadata)
        conditional = if_match is not None or if_none_match
        handle = frozenset({409, 412}) if conditional else frozenset()
        res = await self._call("put_object", what, handle=handle, once=conditional, **params)
        if isinstance(res, _Rejection):
            if res.status == 409 and res.code != "ConditionalRequestConflict":
                raise InvalidRequest(f"{what}: {res.code} (HTTP 409)")
            return Lost(await self._current_etag(bucket, key))
        retries = int((res.get("ResponseMetadata") or {}).get("RetryAttempts") or 0)  # botocore's own retries
        return Won(quote_etag(res["ETag"]) if res.get("ETag") else None, res.get("VersionId"), attempts=1 + retries)

    async def delete(
        self, bucket: str, key: str, *, if_match: str | None = None, version_id: str | None = None
    ) -> Won | Lost:
        """Delete the current object (a delete marker when versioned) or one exact version (C3).

        Deleting an absent key or version succeeds, as in S3. With ``if_match`` a stale ETag, a
        missing key or a delete marker answers :class:`Lost` (SeaweedFS: 412; AWS may say 404).
        With both, the ETag is compared against that version (SeaweedFS behaviour).
        """
        what = f"delete {bucket}/{key}" + (f"@{version_id}" if version_id else "")
        params: dict[str, Any] = {"Bucket": bucket, "Key": key}
        if version_id is not None:
            params["VersionId"] = version_id
        if if_match is not None:
            params["IfMatch"] = if_match
        res = await self._call("delete_object", what, handle=frozenset({404, 412}), once=if_match is not None, **params)
        if isinstance(res, _Rejection):
            if res.status == 412 or if_match is not None:
                return Lost(await self._current_etag(bucket, key, version_id))
            return Won(None, version_id)  # NoSuchKey / NoSuchVersion: already gone
        return Won(None, res.get("VersionId") or version_id)

    async def copy(
        self, bucket: str, key: str, *, src_bucket: str, src_key: str, src_version_id: str | None = None
    ) -> Won:
        """Server-side copy of one exact source version (C3); metadata is copied with it.

        A missing source (or version) is an :class:`InvalidRequest`. SeaweedFS answers a copy into a
        missing bucket with 500, which surfaces as :class:`StoreUnavailable`.
        """
        what = f"copy {src_bucket}/{src_key}" + (f"@{src_version_id}" if src_version_id else "")
        what += f" -> {bucket}/{key}"
        source: dict[str, str] = {"Bucket": src_bucket, "Key": src_key}
        if src_version_id is not None:
            source["VersionId"] = src_version_id
        res = await self._call(
            "copy_object", what, handle=frozenset({404, 405}), Bucket=bucket, Key=key, CopySource=source
        )
        if isinstance(res, _Rejection):
            raise InvalidRequest(f"{what}: copy source is missing ({res.code})")
        etag = res.get("CopyObjectResult", {}).get("ETag")
        return Won(quote_etag(etag) if etag else None, res.get("VersionId"))

    # ------------------------------------------------------------------ listings

    async def list_versions(self, bucket: str, prefix: str = "", *, after: str = "") -> list[VersionEntry]:
        """Every version and delete marker under ``prefix`` (of keys after ``after``: the first page's
        ``KeyMarker``), all pages, sorted by key; within a key the server's order (newest first) is kept,
        markers interleaved where the server put them."""
        entries: list[VersionEntry] = []
        params: dict[str, Any] = {"Bucket": bucket, "Prefix": prefix, "MaxKeys": self.page_size}
        if after:
            params["KeyMarker"] = after
        what = f"list_versions {bucket}/{prefix}"
        while True:
            res = await self._call("list_object_versions", what, **params)
            assert isinstance(res, dict)
            entries.extend(_page_entries(res))
            if not res.get("IsTruncated"):
                break
            key_marker, vid_marker = res.get("NextKeyMarker"), res.get("NextVersionIdMarker")
            if not key_marker:
                raise StoreUnavailable(f"{what}: truncated page without a NextKeyMarker")
            if (key_marker, vid_marker) == (params.get("KeyMarker"), params.get("VersionIdMarker")):
                raise StoreUnavailable(f"{what}: pagination did not advance")
            params["KeyMarker"] = key_marker
            if vid_marker:
                params["VersionIdMarker"] = vid_marker
            else:
                params.pop("VersionIdMarker", None)
        entries.sort(key=lambda e: e.key)  # stable: keeps the order within a key
        return [e for e in entries if e.key > after] if after else entries

    async def list_keys(self, bucket: str, prefix: str = "") -> list[str]:
        return [e.key for e in await self._list_objects(bucket, prefix, f"list_keys {bucket}/{prefix}")]

    async def list_entries(self, bucket: str, prefix: str = "") -> list[ObjectEntry]:
        return await self._list_objects(bucket, prefix, f"list_entries {bucket}/{prefix}")

    async def _list_objects(self, bucket: str, prefix: str, what: str) -> list[ObjectEntry]:
        """ListObjectsV2, every page (``page_size`` keys each), sorted by key."""
        entries: list[ObjectEntry] = []
        params: dict[str, Any] = {"Bucket": bucket, "Prefix": prefix, "MaxKeys": self.page_size}
        while True:
            res = await self._call("list_objects_v2", what, **params)
            assert isinstance(res, dict)
            entries.extend(ObjectEntry(item["Key"], quote_etag(item["ETag"]) if item.get("ETag") else None,
                                       int(item.get("Size") or 0)) for item in res.get("Contents", []))
            if not res.get("IsTruncated"):
                break
            token = res.get("NextContinuationToken")
            if not token or token == params.get("ContinuationToken"):
                raise StoreUnavailable(f"{what}: pagination did not advance")
            params["ContinuationToken"] = token
        return sorted(entries, key=lambda e: e.key)


# ---------------------------------------------------------------------- helpers


def _got(res: Mapping[str, Any], body: bytes) -> Got:
    etag = res.get("ETag")
    return Got(
        body=body,
        etag=quote_etag(etag) if etag else "",
        version_id=res.get("VersionId"),
        metadata=dict(res.get("Metadata") or {}),
    )


def _ms(value: Any) -> int:
    return int(value.timestamp() * 1000) if isinstance(value, datetime) else 0


def _record_entry_order(response_dict: Mapping[str, Any], customized_response_dict: dict[str, Any], **_: Any) -> None:
    """botocore parses ``<Version>`` and ``<DeleteMarker>`` into two lists and loses how the server
    interleaved them; record the element order from the raw body so listings keep it."""
    body = response_dict.get("body")
    status = response_dict.get("status_code")
    if not isinstance(body, bytes | bytearray) or status != 200:
        return
    try:
        root = ET.fromstring(body)
    except ET.ParseError:
        return
    order = []
    for child in root:
        tag = child.tag.rsplit("}", 1)[-1]
        if tag in ("Version", "DeleteMarker"):
            order.append(tag)
    customized_response_dict[_ORDER_KEY] = order


def _page_entries(res: Mapping[str, Any]) -> list[VersionEntry]:
    versions = [_version_entry(v, marker=False) for v in res.get("Versions", [])]
    markers = [_version_entry(m, marker=True) for m in res.get("DeleteMarkers", [])]
    order = res.get(_ORDER_KEY)
    if (
        isinstance(order, list)
        and order.count("Version") == len(versions)
        and order.count("DeleteMarker") == len(markers)
    ):
        vi, mi = iter(versions), iter(markers)
        return [next(vi) if tag == "Version" else next(mi) for tag in order]
    # Fallback: latest first, then newest first by time (1 s resolution on SeaweedFS).
    merged = versions + markers
    merged.sort(key=lambda e: (e.key, not e.is_latest, -e.last_modified_ms))
    return merged


def _version_entry(item: Mapping[str, Any], *, marker: bool) -> VersionEntry:
    etag = item.get("ETag")
    return VersionEntry(
        key=item["Key"],
        version_id=str(item.get("VersionId") or "null"),
        is_latest=bool(item.get("IsLatest")),
        is_delete_marker=marker,
        etag=None if marker or not etag else quote_etag(etag),
        size=0 if marker else int(item.get("Size") or 0),
        last_modified_ms=_ms(item.get("LastModified")),
    )
