"""The start-up conformance probe: passes on SeaweedFS and the twin, names the check a broken store fails."""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping

import pytest

from hostmove.stackinfo import StackInfo
from services.objstore.memory import MemoryStore
from services.objstore.port import Lost, Won
from services.objstore.probe import CHECKS, ProbeFailed, conformance_probe, run_probe_or_exit
from services.objstore.s3 import S3Store
from tests.helpers.stores import Store  # the backend, store and bucket fixtures come from there

BUCKET = "probe-twin"


async def test_probe_passes_and_cleans_up(store: Store, bucket: str) -> None:
    won = await store.put(bucket, "keep/me", b"x")  # a bystander the probe must not touch
    assert isinstance(won, Won)
    report = await conformance_probe(store, bucket)
    assert report.ok, report.summary()
    assert [c.name for c in report.checks] == list(CHECKS)
    assert report.prefix.startswith("_probe/")
    assert report.cleanup_errors == []
    assert await store.list_versions(bucket, "_probe/") == []
    assert [e.version_id for e in await store.list_versions(bucket)] == [won.version_id]
    report.raise_for_failure()  # no-op
    await run_probe_or_exit(store, bucket)  # returns normally


# ---------------------------------------------------------------------- deliberately broken twins


class IgnoresIfMatch(MemoryStore):
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
        return await super().put(bucket, key, body, if_none_match=if_none_match, metadata=metadata)


class NeverVersions(MemoryStore):
    async def create_bucket(self, bucket: str, *, versioned: bool = True) -> None:
        await super().create_bucket(bucket, versioned=False)


class CopiesLatest(MemoryStore):
    async def copy(
        self, bucket: str, key: str, *, src_bucket: str, src_key: str, src_version_id: str | None = None
    ) -> Won:
        return await super().copy(bucket, key, src_bucket=src_bucket, src_key=src_key)


class DeleteIgnoresIfMatch(MemoryStore):
    async def delete(
        self, bucket: str, key: str, *, if_match: str | None = None, version_id: str | None = None
    ) -> Won | Lost:
        return await super().delete(bucket, key, version_id=version_id)


class DeleteWithoutMarkers(MemoryStore):
    """Deletes the latest version outright instead of stacking a delete marker."""

    async def delete(
        self, bucket: str, key: str, *, if_match: str | None = None, version_id: str | None = None
    ) -> Won | Lost:
        if version_id is None and if_match is None:
            entries = [e for e in await self.list_versions(bucket, key) if e.key == key and e.is_latest]
            if entries:
                return await super().delete(bucket, key, version_id=entries[0].version_id)
        return await super().delete(bucket, key, if_match=if_match, version_id=version_id)


@pytest.mark.parametrize(
    ("broken", "check"),
    [
        (IgnoresIfMatch, "concurrent_if_match"),
        (NeverVersions, "versioning_on"),
        (CopiesLatest, "copy_by_version"),
        (DeleteIgnoresIfMatch, "delete_if_match"),
        (DeleteWithoutMarkers, "delete_markers_listed"),
    ],
)
async def test_broken_twin_fails_the_named_check(broken: type[MemoryStore], check: str) -> None:
    store = broken(rng=random.Random(3))
    await store.create_bucket(BUCKET)
    report = await conformance_probe(store, BUCKET)
    assert not report.ok
    assert report.failed[0].name == check, report.summary()
    with pytest.raises(ProbeFailed) as caught:
        report.raise_for_failure()
    assert caught.value.check == check
    assert check in str(caught.value) and CHECKS[check] in str(caught.value)
    assert await store.list_versions(BUCKET, "_probe/") == []


async def test_ignoring_if_match_also_fails_the_missing_key_check() -> None:
    store = IgnoresIfMatch()
    await store.create_bucket(BUCKET)
    failed = {c.name for c in (await conformance_probe(store, BUCKET)).failed}
    assert failed == {"concurrent_if_match", "if_match_missing_refused"}


async def test_store_errors_fail_checks_rather_than_pass() -> None:
    store = MemoryStore()
    await store.create_bucket(BUCKET)
    store.faults.fail_next("copy", "5xx")
    report = await conformance_probe(store, BUCKET)
    assert [c.name for c in report.failed] == ["copy_by_version"]
    assert "StoreUnavailable" in report.failed[0].detail


async def test_missing_bucket_fails_the_probe() -> None:
    report = await conformance_probe(MemoryStore(), "no-such-bucket")
    assert not report.ok and report.failed[0].name == "concurrent_if_match"
    assert "NoSuchBucket" in report.failed[0].detail


async def test_run_probe_or_exit_exits_non_zero_naming_the_check(capsys: pytest.CaptureFixture[str]) -> None:
    store = CopiesLatest()
    await store.create_bucket(BUCKET)
    with pytest.raises(SystemExit) as caught:
        await run_probe_or_exit(store, BUCKET)
    assert caught.value.code == 3
    err = capsys.readouterr().err
    assert err.startswith("object store conformance check failed: copy_by_version: ")


async def test_unversioned_seaweedfs_bucket_fails_versioning_check(
    stack: StackInfo, unique: Callable[..., str]
) -> None:
    s = await S3Store.open(stack.s3_endpoint, stack.s3_access_key, stack.s3_secret_key, stack.s3_region)
    name = unique("probe-unv")
    try:
        await s.create_bucket(name, versioned=False)
        report = await conformance_probe(s, name, n=4)
        assert report.failed and report.failed[0].name == "versioning_on", report.summary()
        assert await s.list_versions(name, "_probe/") == []
    finally:
        await s.delete_bucket(name)
        await s.close()
