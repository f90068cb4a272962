"""One contract for the object store port, run against SeaweedFS (``S3Store``) and the twin (``MemoryStore``).

Every ``store``-parametrized case runs on both; the twin must not drift from the real store (C3, C6).
Twin-only cases cover the fault hooks; S3-only cases cover error mapping and client set-up.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import time
from collections.abc import Callable
from typing import Any

import pytest
from aiohttp import web
from botocore.exceptions import ClientError

from hostmove.stackinfo import StackInfo
from services.objstore.memory import Faults, MemoryStore
from services.objstore.port import (
    AccessDenied,
    Got,
    InvalidRequest,
    Lost,
    Missing,
    NoSuchBucket,
    StoreUnavailable,
    Won,
)
from services.objstore.s3 import S3Store
from tests.helpers.stores import Store  # the backend, store and bucket fixtures come from there

B = "twin-bucket"


def md5_etag(body: bytes) -> str:
    return '"' + hashlib.md5(body).hexdigest() + '"'


def won(result: Won | Lost) -> Won:
    assert isinstance(result, Won), result
    return result


def got(result: Got | Missing) -> Got:
    assert isinstance(result, Got), result
    return result


# ---------------------------------------------------------------------- contract (both stores)


async def test_put_get_head_etag_and_version(store: Store, bucket: str) -> None:
    w = won(await store.put(bucket, "a/k", b"hello"))
    assert w.etag == md5_etag(b"hello")
    assert w.version_id
    g = got(await store.get(bucket, "a/k"))
    assert (g.body, g.etag, g.version_id) == (b"hello", w.etag, w.version_id)
    h = got(await store.head(bucket, "a/k"))
    assert (h.body, h.etag, h.version_id) == (b"", w.etag, w.version_id)
    assert isinstance(await store.get(bucket, "a/nope"), Missing)
    assert isinstance(await store.head(bucket, "a/nope"), Missing)


async def test_bucket_create_is_idempotent_and_versioned(store: Store, bucket: str) -> None:
    await store.create_bucket(bucket, versioned=True)  # again: fine
    assert await store.bucket_versioning(bucket) is True


async def test_if_match_wins_then_stale_loses_with_current_etag(store: Store, bucket: str) -> None:
    first = won(await store.put(bucket, "k", b"v1"))
    assert first.etag is not None
    second = won(await store.put(bucket, "k", b"v2", if_match=first.etag))
    assert second.etag == md5_etag(b"v2")
    stale = await store.put(bucket, "k", b"v3", if_match=first.etag)
    assert stale == Lost(current_etag=second.etag)
    # unquoted ETags are accepted too
    assert second.etag is not None
    won(await store.put(bucket, "k", b"v4", if_match=second.etag.strip('"')))
    assert got(await store.get(bucket, "k")).body == b"v4"


async def test_if_none_match_creates_once(store: Store, bucket: str) -> None:
    created = won(await store.put(bucket, "k", b"first", if_none_match=True))
    again = await store.put(bucket, "k", b"second", if_none_match=True)
    assert again == Lost(current_etag=created.etag)
    assert got(await store.get(bucket, "k")).body == b"first"


async def test_if_match_on_missing_key_or_delete_marker_loses(store: Store, bucket: str) -> None:
    assert await store.put(bucket, "missing", b"x", if_match=md5_etag(b"x")) == Lost(None)
    assert await store.put(bucket, "missing", b"x", if_match="*") == Lost(None)
    assert isinstance(await store.get(bucket, "missing"), Missing)
    w = won(await store.put(bucket, "gone", b"x"))
    won(await store.delete(bucket, "gone"))
    assert await store.put(bucket, "gone", b"y", if_match=w.etag) == Lost(None)
    # If-None-Match over a delete marker is accepted (as on AWS)
    won(await store.put(bucket, "gone", b"z", if_none_match=True))
    assert got(await store.get(bucket, "gone")).body == b"z"


async def test_if_match_and_if_none_match_are_exclusive(store: Store, bucket: str) -> None:
    with pytest.raises(InvalidRequest):
        await store.put(bucket, "k", b"x", if_match='"abc"', if_none_match=True)


async def test_delete_if_match(store: Store, bucket: str) -> None:
    one = won(await store.put(bucket, "k", b"one"))
    two = won(await store.put(bucket, "k", b"two"))
    assert await store.delete(bucket, "k", if_match=one.etag) == Lost(current_etag=two.etag)
    assert got(await store.get(bucket, "k")).body == b"two"
    marker = won(await store.delete(bucket, "k", if_match=two.etag))
    assert marker.version_id
    assert isinstance(await store.get(bucket, "k"), Missing)
    # the key is now a delete marker: a conditional delete finds nothing to match
    assert await store.delete(bucket, "k", if_match=two.etag) == Lost(None)
    assert await store.delete(bucket, "never", if_match=two.etag) == Lost(None)


async def test_delete_markers_in_listings(store: Store, bucket: str) -> None:
    w = won(await store.put(bucket, "p/k", b"x"))
    won(await store.put(bucket, "p/other", b"y"))
    marker = won(await store.delete(bucket, "p/k"))
    assert marker.version_id and marker.version_id != w.version_id
    assert isinstance(await store.get(bucket, "p/k"), Missing)
    entries = [e for e in await store.list_versions(bucket, "p/") if e.key == "p/k"]
    assert [(e.version_id, e.is_latest, e.is_delete_marker) for e in entries] == [
        (marker.version_id, True, True),
        (w.version_id, False, False),
    ]
    assert entries[0].etag is None and entries[0].size == 0
    assert entries[1].etag == w.etag and entries[1].size == 1
    assert await store.list_keys(bucket, "p/") == ["p/other"]
    # deleting the marker by version id restores the object
    won(await store.delete(bucket, "p/k", version_id=marker.version_id))
    assert got(await store.get(bucket, "p/k")).version_id == w.version_id
    assert await store.list_keys(bucket, "p/") == ["p/k", "p/other"]


async def test_versions_keep_server_order_with_markers_interleaved(store: Store, bucket: str) -> None:
    v1 = won(await store.put(bucket, "k", b"1"))
    m1 = won(await store.delete(bucket, "k"))
    v2 = won(await store.put(bucket, "k", b"22"))
    m2 = won(await store.delete(bucket, "k"))
    v3 = won(await store.put(bucket, "k", b"333"))
    listed = await store.list_versions(bucket, "k")
    assert [(e.version_id, e.is_delete_marker) for e in listed] == [
        (v3.version_id, False),
        (m2.version_id, True),
        (v2.version_id, False),
        (m1.version_id, True),
        (v1.version_id, False),
    ]
    assert [e.is_latest for e in listed] == [True, False, False, False, False]


async def test_get_copy_delete_by_version_id(store: Store, bucket: str) -> None:
    old = won(await store.put(bucket, "k", b"old", metadata={"rev": "1"}))
    new = won(await store.put(bucket, "k", b"new", metadata={"rev": "2"}))
    assert old.version_id != new.version_id
    g = got(await store.get(bucket, "k", version_id=old.version_id))
    assert (g.body, g.etag, g.version_id, dict(g.metadata)) == (
        b"old",
        old.etag,
        old.version_id,
        {"rev": "1"},
    )
    assert got(await store.head(bucket, "k", version_id=old.version_id)).etag == old.etag

    copied = await store.copy(bucket, "copy", src_bucket=bucket, src_key="k", src_version_id=old.version_id)
    assert copied.etag == old.etag and copied.version_id
    c = got(await store.get(bucket, "copy"))
    assert (c.body, c.version_id, dict(c.metadata)) == (b"old", copied.version_id, {"rev": "1"})
    latest = await store.copy(bucket, "copy2", src_bucket=bucket, src_key="k")
    assert latest.etag == new.etag

    deleted = won(await store.delete(bucket, "k", version_id=old.version_id))
    assert deleted.version_id == old.version_id
    assert isinstance(await store.get(bucket, "k", version_id=old.version_id), Missing)
    assert got(await store.get(bucket, "k")).version_id == new.version_id
    assert [e.version_id for e in await store.list_versions(bucket, "k") if e.key == "k"] == [new.version_id]
    # deleting an absent version succeeds, as in S3
    assert won(await store.delete(bucket, "k", version_id=old.version_id)).version_id == old.version_id
    assert got(await store.get(bucket, "k")).body == b"new"


async def test_get_a_delete_marker_by_version_id_is_missing(store: Store, bucket: str) -> None:
    won(await store.put(bucket, "k", b"x"))
    marker = won(await store.delete(bucket, "k"))
    assert isinstance(await store.get(bucket, "k", version_id=marker.version_id), Missing)
    assert isinstance(await store.head(bucket, "k", version_id=marker.version_id), Missing)


async def test_delete_if_match_by_version_compares_that_version(store: Store, bucket: str) -> None:
    old = won(await store.put(bucket, "k", b"old"))
    new = won(await store.put(bucket, "k", b"new"))
    assert await store.delete(bucket, "k", version_id=old.version_id, if_match=new.etag) == Lost(old.etag)
    won(await store.delete(bucket, "k", version_id=old.version_id, if_match=old.etag))
    assert isinstance(await store.get(bucket, "k", version_id=old.version_id), Missing)


async def test_copy_from_missing_source_is_invalid(store: Store, bucket: str) -> None:
    with pytest.raises(InvalidRequest):
        await store.copy(bucket, "dst", src_bucket=bucket, src_key="nope")
    w = won(await store.put(bucket, "k", b"x"))
    won(await store.delete(bucket, "k", version_id=w.version_id))
    with pytest.raises(InvalidRequest):
        await store.copy(bucket, "dst", src_bucket=bucket, src_key="k", src_version_id=w.version_id)


async def test_listing_pages(store: Store, bucket: str) -> None:
    keys = [f"many/{i:03d}" for i in range(30)]
    await asyncio.gather(*(store.put(bucket, k, k.encode()) for k in keys))
    await asyncio.gather(*(store.put(bucket, k, b"again") for k in keys[:5]))
    won(await store.put(bucket, "other/x", b"x"))
    assert await store.list_keys(bucket, "many/") == keys
    assert await store.list_keys(bucket) == [*keys, "other/x"]
    versions = await store.list_versions(bucket, "many/")
    assert len(versions) == 35
    assert [e.key for e in versions] == sorted(e.key for e in versions)
    for k in keys[:5]:
        mine = [e for e in versions if e.key == k]
        assert [e.is_latest for e in mine] == [True, False]
        assert mine[0].etag == md5_etag(b"again")


async def test_a_version_listing_starts_after_a_key(store: Store, bucket: str) -> None:
    """``after`` (S3's ``KeyMarker``): only the versions of keys that sort after it, across pages, a key's
    versions and markers all included; a marker that is no key starts where it would sort (issue 19 item 9)."""
    keys = [f"tail/{i:03d}" for i in range(30)]
    await asyncio.gather(*(store.put(bucket, k, k.encode()) for k in keys))
    await store.put(bucket, "tail/020", b"again")
    await store.delete(bucket, "tail/025")
    won(await store.put(bucket, "tailx", b"outside the prefix"))
    listed = await store.list_versions(bucket, "tail/", after="tail/011")
    assert [e.key for e in listed] == sorted(e.key for e in listed) and {e.key for e in listed} == set(keys[12:])
    assert len(listed) == 18 + 2, "tail/020's older version and tail/025's marker are listed too"
    assert sum(e.is_delete_marker for e in listed) == 1
    assert {e.key for e in await store.list_versions(bucket, "tail/", after="tail/0115")} == set(keys[12:])
    assert await store.list_versions(bucket, "tail/", after="tail/029") == []
    assert len(await store.list_versions(bucket, "tail/", after="")) == 32


async def test_keys_with_spaces_unicode_and_plus_round_trip(store: Store, bucket: str) -> None:
    keys = ["odd/a b", "odd/caf\u00e9", "odd/x+y", "odd/%41", "odd/t\u00e4g/1"]
    for k in keys:
        won(await store.put(bucket, k, k.encode()))
    assert await store.list_keys(bucket, "odd/") == sorted(keys)
    assert sorted(e.key for e in await store.list_versions(bucket, "odd/")) == sorted(keys)
    for k in keys:
        assert got(await store.get(bucket, k)).body == k.encode()


async def test_metadata_round_trip(store: Store, bucket: str) -> None:
    meta = {"rev": "7", "Run-Id": "r-1", "padded": " v ", "empty": ""}
    won(await store.put(bucket, "k", b"x", metadata=meta))
    # S3 lower-cases x-amz-meta-* names; SeaweedFS strips values and drops empty ones
    expected = {"rev": "7", "run-id": "r-1", "padded": "v"}
    assert dict(got(await store.get(bucket, "k")).metadata) == expected
    assert dict(got(await store.head(bucket, "k")).metadata) == expected
    won(await store.put(bucket, "k", b"y"))
    assert dict(got(await store.get(bucket, "k")).metadata) == {}
    for bad in ({"name": "caf\u00e9"}, {"name": "a\r\nx-amz-evil: 1"}):
        with pytest.raises(InvalidRequest):
            await store.put(bucket, "k", b"x", metadata=bad)
    assert got(await store.get(bucket, "k")).body == b"y"


async def test_concurrent_cas_race_has_exactly_one_winner(store: Store, bucket: str) -> None:
    base = won(await store.put(bucket, "cas", b"base"))
    n = 16
    results = await asyncio.gather(*(store.put(bucket, "cas", f"w{i}".encode(), if_match=base.etag) for i in range(n)))
    winners = [i for i, r in enumerate(results) if isinstance(r, Won)]
    assert len(winners) == 1
    assert sum(isinstance(r, Lost) for r in results) == n - 1
    assert got(await store.get(bucket, "cas")).body == f"w{winners[0]}".encode()


async def test_concurrent_creators_have_exactly_one_winner(store: Store, bucket: str) -> None:
    results = await asyncio.gather(*(store.put(bucket, "c", b"%d" % i, if_none_match=True) for i in range(16)))
    assert sum(isinstance(r, Won) for r in results) == 1


async def test_identical_bytes_give_identical_etags(store: Store, bucket: str) -> None:
    a = won(await store.put(bucket, "k", b"same"))
    won(await store.put(bucket, "k", b"different"))
    b = won(await store.put(bucket, "k", b"same"))
    c = won(await store.put(bucket, "other", b"same"))
    assert a.etag == b.etag == c.etag == md5_etag(b"same")
    assert a.version_id != b.version_id  # ABA: only the version id tells them apart


async def test_missing_bucket(store: Store, unique: Callable[..., str]) -> None:
    name = unique("absent")
    with pytest.raises(NoSuchBucket):
        await store.get(name, "k")
    with pytest.raises(NoSuchBucket):
        await store.list_keys(name)
    with pytest.raises(NoSuchBucket):
        await store.list_versions(name)
    with pytest.raises(NoSuchBucket):
        await store.delete(name, "k")
    # a HEAD error has no body to name the bucket: it reads as a missing key
    assert isinstance(await store.head(name, "k"), Missing)


async def test_delete_of_a_never_written_key_leaves_a_marker(store: Store, bucket: str) -> None:
    marker = won(await store.delete(bucket, "never"))
    assert marker.version_id
    listed = await store.list_versions(bucket, "never")
    assert [(e.version_id, e.is_delete_marker, e.is_latest) for e in listed] == [(marker.version_id, True, True)]


async def test_unversioned_bucket(store: Store, unique: Callable[..., str]) -> None:
    name = unique("unv")
    await store.create_bucket(name, versioned=False)
    try:
        assert await store.bucket_versioning(name) is False
        w = won(await store.put(name, "k", b"x"))
        assert w.version_id is None
        assert won(await store.delete(name, "k")) == Won(None, None)
        assert isinstance(await store.get(name, "k"), Missing)
        assert await store.list_versions(name) == []
    finally:
        await store.delete_bucket(name)


# ---------------------------------------------------------------------- twin only: fault hooks


async def test_twin_5xx_is_not_applied() -> None:
    store = MemoryStore()
    await store.create_bucket(B)
    store.faults.fail_next("put", "5xx")
    with pytest.raises(StoreUnavailable):
        await store.put(B, "k", b"x")
    assert isinstance(await store.get(B, "k"), Missing)
    won(await store.put(B, "k", b"x"))  # the fault was used up


async def test_twin_lost_response_is_applied() -> None:
    store = MemoryStore()
    await store.create_bucket(B)
    store.faults.fail_next("put", "lost_response")
    with pytest.raises(StoreUnavailable):
        await store.put(B, "k", b"x", if_none_match=True)
    assert got(await store.get(B, "k")).body == b"x"
    # a retry of the create now loses against its own first attempt
    assert await store.put(B, "k", b"x", if_none_match=True) == Lost(md5_etag(b"x"))


async def test_twin_late_request_lands_on_complete_late() -> None:
    store = MemoryStore()
    await store.create_bucket(B)
    first = won(await store.put(B, "k", b"v1"))
    store.faults.fail_next("put", "late", key="k")
    with pytest.raises(StoreUnavailable):
        await store.put(B, "k", b"late", if_match=first.etag)
    assert got(await store.get(B, "k")).body == b"v1"
    assert store.faults.pending_late == 1
    outcomes = store.faults.complete_late()
    assert len(outcomes) == 1 and isinstance(outcomes[0], Won)
    assert got(await store.get(B, "k")).body == b"late"
    assert store.faults.complete_late() == []


async def test_twin_late_request_checks_its_precondition_when_it_lands() -> None:
    store = MemoryStore()
    await store.create_bucket(B)
    first = won(await store.put(B, "k", b"v1"))
    store.faults.fail_next("put", "late")
    with pytest.raises(StoreUnavailable):
        await store.put(B, "k", b"late", if_match=first.etag)
    second = won(await store.put(B, "k", b"v2", if_match=first.etag))
    assert store.faults.complete_late() == [Lost(second.etag)]
    assert got(await store.get(B, "k")).body == b"v2"


async def test_twin_late_request_lands_after_delay_through_injected_sleep() -> None:
    slept: list[float] = []
    gate = asyncio.Event()

    async def fake_sleep(seconds: float) -> None:
        slept.append(seconds)
        if seconds >= 5:
            await gate.wait()  # virtual time: lands only when the test opens the gate
        else:
            await asyncio.sleep(0)

    store = MemoryStore(faults=Faults(sleep=fake_sleep))
    await store.create_bucket(B)
    store.faults.fail_next("delete", "late", delay=5.0)
    won(await store.put(B, "k", b"x"))
    with pytest.raises(StoreUnavailable):
        await store.delete(B, "k")
    assert got(await store.get(B, "k")).body == b"x"
    gate.set()
    for _ in range(5):
        await asyncio.sleep(0)
    assert 5.0 in slept
    assert isinstance(await store.get(B, "k"), Missing)
    assert store.faults.pending_late == 0


async def test_twin_latency_uses_injected_sleep_and_key_filter() -> None:
    slept: list[float] = []

    async def fake_sleep(seconds: float) -> None:
        slept.append(seconds)

    store = MemoryStore(faults=Faults(latency={"get": 0.25}, sleep=fake_sleep))
    await store.create_bucket(B)
    won(await store.put(B, "a", b"x"))
    store.faults.fail_next("get", "5xx", key="b")
    got(await store.get(B, "a"))  # not the faulted key
    with pytest.raises(StoreUnavailable):
        await store.get(B, "b")
    assert slept == [0.0, 0.0, 0.25, 0.25]
    assert store.faults.calls["get"] == 2
    with pytest.raises(ValueError):
        store.faults.fail_next("nope", "5xx")


async def test_twin_is_deterministic_given_rng() -> None:
    async def run() -> list[str | None]:
        store = MemoryStore(rng=random.Random(42))
        await store.create_bucket(B)
        out = [won(await store.put(B, "k", b"%d" % i)).version_id for i in range(3)]
        out.append(won(await store.delete(B, "k")).version_id)
        return out

    first, second = await run(), await run()
    assert first == second and len(set(first)) == 4


# ---------------------------------------------------------------------- S3Store only


async def test_s3_wrong_secret_is_access_denied_without_leaking_it(stack: StackInfo) -> None:
    secret = "not-the-secret-9f3c1e"
    s = await S3Store.open(stack.s3_endpoint, stack.s3_access_key, secret, stack.s3_region)
    try:
        with pytest.raises(AccessDenied) as caught:
            await s.get("any-bucket", "k")
        with pytest.raises(AccessDenied):
            await s.head("any-bucket", "k")
    finally:
        await s.close()
    assert secret not in str(caught.value) and secret not in repr(s)
    assert caught.value.__cause__ is None and caught.value.__suppress_context__


async def test_s3_unreachable_endpoint_is_unavailable_quickly() -> None:
    import socket

    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    s = await S3Store.open(f"http://127.0.0.1:{port}", "ak", "sk-secret", connect_timeout=1.0)
    started = time.monotonic()
    try:
        with pytest.raises(StoreUnavailable) as caught:
            await s.put("b", "k", b"x", if_match='"abc"')
    finally:
        await s.close()
    assert time.monotonic() - started < 10
    assert "sk-secret" not in str(caught.value)


async def test_s3_missing_ca_bundle_does_not_break_http(
    stack: StackInfo, monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    monkeypatch.setenv("AWS_CA_BUNDLE", str(tmp_path / "no-such-ca.pem"))
    s = await S3Store.open(stack.s3_endpoint, stack.s3_access_key, stack.s3_secret_key, stack.s3_region)
    try:
        with pytest.raises(NoSuchBucket):
            await s.list_keys("no-such-bucket-ca-test")
    finally:
        await s.close()


class FakeS3:
    """A tiny HTTP server answering every request with one canned S3 error; counts requests."""

    def __init__(self, status: int, code: str) -> None:
        self.status, self.code = status, code
        self.hits: list[tuple[str, str]] = []
        self.runner: web.AppRunner | None = None
        self.endpoint = ""

    async def handle(self, request: web.Request) -> web.Response:
        self.hits.append((request.method, request.path))
        body = f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{self.code}</Code><Message>m</Message></Error>'
        return web.Response(status=self.status, body=body.encode(), content_type="application/xml")

    async def __aenter__(self) -> FakeS3:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.handle)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = self.runner.addresses[0][1]
        self.endpoint = f"http://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.runner is not None
        await self.runner.cleanup()


async def test_s3_5xx_is_unavailable_and_conditional_writes_are_not_retried() -> None:
    async with FakeS3(500, "InternalError") as fake:
        s = await S3Store.open(fake.endpoint, "ak", "sk", max_attempts=2)
        try:
            with pytest.raises(StoreUnavailable):
                await s.put("b", "k", b"x")
            assert len(fake.hits) == 2  # one botocore retry for an unconditional write
            for conditional in (
                s.put("b", "k", b"x", if_match='"e"'),
                s.put("b", "k", b"x", if_none_match=True),
                s.delete("b", "k", if_match='"e"'),
            ):
                fake.hits.clear()
                with pytest.raises(StoreUnavailable):
                    await conditional
                assert len(fake.hits) == 1  # never retried: a retry could turn our win into Lost
        finally:
            await s.close()


@pytest.mark.parametrize(
    ("status", "code", "expected"),
    [
        (503, "SlowDown", StoreUnavailable),
        (403, "AccessDenied", AccessDenied),
        (400, "InvalidArgument", InvalidRequest),
    ],
)
async def test_s3_error_responses_map_end_to_end(status: int, code: str, expected: type[Exception]) -> None:
    async with FakeS3(status, code) as fake:
        s = await S3Store.open(fake.endpoint, "ak", "sk", max_attempts=1)
        try:
            with pytest.raises(expected):
                await s.get("b", "k")
            with pytest.raises(expected):
                await s.list_versions("b")
        finally:
            await s.close()


def _client_error(status: int, code: str, message: str = "") -> ClientError:
    response: Any = {
        "Error": {"Code": code, "Message": message},
        "ResponseMetadata": {"HTTPStatusCode": status},
    }
    return ClientError(response, "PutObject")


@pytest.mark.parametrize(
    ("status", "code", "expected"),
    [
        (500, "InternalError", StoreUnavailable),
        (503, "SlowDown", StoreUnavailable),
        (403, "AccessDenied", AccessDenied),
        (403, "SignatureDoesNotMatch", AccessDenied),
        (404, "NoSuchBucket", NoSuchBucket),
        (400, "InvalidBucketName", InvalidRequest),
        (400, "RequestTimeout", StoreUnavailable),
        (409, "BucketNotEmpty", InvalidRequest),
    ],
)
def test_s3_error_mapping(status: int, code: str, expected: type[Exception]) -> None:
    s = S3Store("http://127.0.0.1:1", "AKIDLEAK", "SECRETLEAK")
    err = s._map_client_error(_client_error(status, code, "bad key AKIDLEAK sig SECRETLEAK"), "put b/k")
    assert type(err) is expected
    assert "AKIDLEAK" not in str(err) and "SECRETLEAK" not in str(err)
    assert code in str(err) and "put b/k" in str(err)
