"""The store fixtures the object-store contract and probe tests share: the same cases on the real
SeaweedFS (the session's ``stack``) and on the in-memory twin, each test in a fresh versioned bucket."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

import pytest
import pytest_asyncio

from bus.nats_log import NatsEventLog
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


@asynccontextmanager
async def seaweed_versioned(stack: StackInfo, name: str) -> AsyncIterator[tuple[S3Store, str]]:
    """A store on the session's SeaweedFS and a fresh versioned bucket ``name``; afterwards every version and
    marker in it is deleted by id, then the bucket (a versioned bucket with versions left is not dropped)."""
    s = await S3Store.open(stack.s3_endpoint, stack.s3_access_key, stack.s3_secret_key, stack.s3_region)
    await s.create_bucket(name, versioned=True)
    try:
        yield s, name
    finally:
        for e in await s.list_versions(name, ""):
            await s.delete(name, e.key, version_id=e.version_id)
        await s.delete_bucket(name)
        await s.close()


@dataclass
class Regions:
    """One deployment bucket and the two regions' data buckets (ie, uk), separate as in production, with a
    store and an event log on the session's real stack."""

    store: S3Store
    events: NatsEventLog
    deploy: str
    ie: str
    uk: str


@asynccontextmanager
async def regions(stack: StackInfo, unique: Callable[[str], str], prefix: str) -> AsyncIterator[Regions]:
    """The three buckets for a module, created here and dropped afterwards (weed mini holds ~76 buckets)."""
    store = await S3Store.open(stack.s3_endpoint, stack.s3_access_key, stack.s3_secret_key, stack.s3_region)
    events = await NatsEventLog.connect(stack.nats_url)
    r = Regions(store, events, unique(f"{prefix}-deploy"), unique(f"{prefix}-ie"), unique(f"{prefix}-uk"))
    for name in (r.deploy, r.ie, r.uk):
        await store.create_bucket(name)
    try:
        yield r
    finally:
        for name in (r.deploy, r.ie, r.uk):
            await store.delete_bucket(name)
        await events.close()
        await store.close()
