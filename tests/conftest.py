"""Shared fixtures: one real NATS JetStream + S3 stack per test session, and unique names."""

from __future__ import annotations

import itertools
import os
import re
import uuid
from collections.abc import Callable, Iterator

import pytest

from hostmove.stackinfo import StackInfo
from kernel.credentials import ENV_CREDENTIALS

# the object-store backend/store/bucket fixtures; the package's own plugin (also its pytest11 entry point, under the
# same name, so an installed hostmove registers it once)
pytest_plugins = ["tests.helpers.stores", "hostmove.testing"]


@pytest.fixture(scope="session")
def stack(hostmove_stack: StackInfo) -> Iterator[StackInfo]:
    """NATS + S3 endpoints: the ``hostmove.testing`` plugin's stack (containers when a Docker engine answers, else
    the pip-installed binaries), shared with the examples' tests."""
    if hostmove_stack.mode != "local" or not hostmove_stack.credentials:
        yield hostmove_stack
        return
    # The tests act as the stack's operator (its admin nkey and S3 key); a service they start gets its own role's
    # credentials (hostmove.procs.service_env), never these.
    os.environ[ENV_CREDENTIALS] = hostmove_stack.credentials
    try:
        yield hostmove_stack
    finally:
        os.environ.pop(ENV_CREDENTIALS, None)


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
