"""The store fixtures the object-store contract and probe tests share: the same cases on the real
SeaweedFS (the session's ``stack``) and on the in-memory twin, each test in a fresh versioned bucket."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator, Callable

import pytest
import pytest_asyncio

from hostmove.stackinfo import StackInfo
from services.objstore.memory import MemoryStore
from services.objstore.s3 import S3Store

Store = S3Store | MemoryStore
PAGE = 7  # a small page size, so listings of 30+ entries cross several pages


@pytest.fixture(params=["seaweedfs", "memory"])
def backend(request: pytest.FixtureRequest) -> tuple[str, StackInfo | None]:
    if request.param == "seaweedfs":
        return "seaweedfs", request.getfixturevalue("stack")
    return "memory", None


@pytest_asyncio.fixture(loop_scope="session")
async def store(backend: tuple[str, StackInfo | None]) -> AsyncIterator[Store]:
    kind, info = backend
    s: Store
    if kind == "seaweedfs":
        assert info is not None
        s = await S3Store.open(info.s3_endpoint, info.s3_access_key, info.s3_secret_key, info.s3_region, page_size=PAGE)
    else:
        s = MemoryStore(rng=random.Random(1234))
    try:
        yield s
    finally:
        await s.close()


@pytest_asyncio.fixture(loop_scope="session")
async def bucket(store: Store, unique: Callable[..., str]) -> AsyncIterator[str]:
    """A fresh versioned bucket, dropped afterwards (weed mini only holds ~76 written buckets)."""
    name = unique("oc")
    await store.create_bucket(name, versioned=True)
    try:
        yield name
    finally:
        await store.delete_bucket(name)
