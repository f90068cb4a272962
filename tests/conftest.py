"""Shared fixtures: one real NATS JetStream + S3 stack per test session, and unique names."""

from __future__ import annotations

import itertools
import os
import re
import uuid
from collections.abc import Callable, Iterator

import pytest

from hostmove.stack import docker_engine_available, stack_down, stack_up, start_containers
from hostmove.stackinfo import StackInfo
from kernel.credentials import ENV_CREDENTIALS

pytest_plugins = ["tests.helpers.stores"]  # the object-store backend/store/bucket fixtures


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StackInfo]:
    """NATS + S3 endpoints: containers when a Docker engine answers, else the pip-installed binaries."""
    if docker_engine_available():
        containers = start_containers()
        try:
            yield containers.info
        finally:
            containers.stop()
        return
    root = tmp_path_factory.mktemp("stack")
    info = stack_up(root)
    # The tests act as the stack's operator (its admin nkey and S3 key); a service they start gets its own role's
    # credentials (hostmove.procs.service_env), never these.
    os.environ[ENV_CREDENTIALS] = info.credentials
    try:
        yield info
    finally:
        os.environ.pop(ENV_CREDENTIALS, None)
        stack_down(root)


@pytest.fixture(scope="session")
def unique() -> Callable[..., str]:
    """``unique("bucket")`` -> a session-unique, S3-bucket-safe name such as ``bucket-3f9a1c-7``."""
    token = uuid.uuid4().hex[:6]
    counter = itertools.count()

    def make(prefix: str = "t") -> str:
        base = re.sub(r"[^a-z0-9-]+", "-", prefix.lower()).strip("-") or "t"
        suffix = f"-{token}-{next(counter)}"
        return base[: 63 - len(suffix)] + suffix

    return make
