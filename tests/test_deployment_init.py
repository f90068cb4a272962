"""``hostmove deployment init`` prepares the store (issue 20 item 5): the deployment bucket and each region's data
bucket created with versioning on, each through the conformance probe, the key's fingerprint and the protocol floor
published; idempotent; a store that keeps no versions or fails a check is refused, naming the bucket and the check.

The command as an OS process against the real SeaweedFS and NATS; the refusals on deliberately broken twins (a
real store that breaks the contract is not at hand).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
import pytest_asyncio

from hostmove.stackinfo import StackInfo
from services.box.deployment import prepare_buckets
from services.objstore.port import Got
from services.objstore.s3 import S3Store
from tests.test_objstore_probe import IgnoresIfMatch, NeverVersions

HOSTMOVE = [sys.executable, "-m", "hostmove.cli"]


def run(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(HOSTMOVE + args, env=env, capture_output=True, text=True, timeout=90)


@pytest_asyncio.fixture(loop_scope="session")
async def deployment(stack: StackInfo, unique: Callable[[str], str], tmp_path: Path
                     ) -> AsyncIterator[tuple[dict[str, str], S3Store, list[str]]]:
    bucket, prefix = unique("dinit"), unique("dinit-data")
    store = await S3Store.open(stack.s3_endpoint, stack.s3_access_key, stack.s3_secret_key, stack.s3_region)
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOSTMOVE_")}
    env.update(HOSTMOVE_NATS_URL=stack.nats_url, HOSTMOVE_S3_ENDPOINT=stack.s3_endpoint,
               HOSTMOVE_S3_ACCESS_KEY=stack.s3_access_key, HOSTMOVE_S3_SECRET_KEY=stack.s3_secret_key,
               HOSTMOVE_BUCKET=bucket, HOSTMOVE_ROOT=str(tmp_path / "root"), HOSTMOVE_DATA_BUCKET_PREFIX=prefix)
    if os.environ.get("HOSTMOVE_CREDENTIALS"):
        env["HOSTMOVE_CREDENTIALS"] = os.environ["HOSTMOVE_CREDENTIALS"]  # the stack's admin (NATS)
    buckets = [bucket, f"{prefix}-ie", f"{prefix}-uk"]
    try:
        yield env, store, buckets
    finally:
        for name in buckets:
            await store.delete_bucket(name)
        await store.close()


@pytest.mark.asyncio(loop_scope="session")
async def test_deployment_init_makes_versioned_buckets_publishes_the_key_and_floor_and_again_changes_nothing(
        deployment: tuple[dict[str, str], S3Store, list[str]]) -> None:
    env, store, buckets = deployment
    first = run(["deployment", "init", "--region", "ie", "--region", "uk"], env)
    assert first.returncode == 0, first.stdout + first.stderr
    assert f"buckets {', '.join(buckets)}: versioned, conformance probe passed" in first.stdout
    for name in buckets:
        assert await store.bucket_versioning(name), f"{name} keeps versions"
        assert await store.list_versions(name, "_probe/") == [], "the probe cleaned up after itself"
    key = await store.get(buckets[0], "control/secrets-key.json")
    floor = await store.get(buckets[0], "control/moves-protocol.json")
    assert isinstance(key, Got) and isinstance(floor, Got)
    fp = json.loads(key.body)["fp"]
    assert fp.startswith("sha256:") and f"deployment key {fp}" in first.stdout
    assert json.loads(floor.body)["min"] == 1

    again = run(["deployment", "init", "--region", "ie", "--region", "uk"], env)
    assert again.returncode == 0, again.stderr
    assert f"deployment key {fp}" in again.stdout, "the same key: nothing changes"
    assert [v.version_id for v in await store.list_versions(buckets[0], "control/secrets-key.json")] == \
        [(await store.head(buckets[0], "control/secrets-key.json")).version_id]  # type: ignore[union-attr]


async def test_a_store_without_versions_or_failing_a_check_is_refused_naming_the_bucket() -> None:
    never = await prepare_buckets(NeverVersions(rng=random.Random(1)), ["deploy", "data-ie"])
    assert never is not None and never.bucket == "deploy" and "versioning could not be turned on" in never.why
    cas = await prepare_buckets(IgnoresIfMatch(rng=random.Random(2)), ["deploy", "data-ie"])
    assert cas is not None and cas.bucket == "deploy" and "conformance check 'concurrent_if_match'" in cas.why
    from services.objstore.memory import MemoryStore

    good = MemoryStore(rng=random.Random(3))
    assert await prepare_buckets(good, ["deploy", "data-ie", "deploy"]) is None
    assert await good.bucket_versioning("data-ie")
