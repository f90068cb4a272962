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


LONG_FIRST = (
    "tests/test_sim.py::test_the_gate",
    "tests/test_crash_matrix.py",
    "tests/test_demo.py",
    "tests/test_outages.py",
    "tests/test_rollback.py",
    "tests/test_repeat_moves.py",
    "tests/test_app_cli.py::test_box_init",
    "tests/test_sleep.py",
    "tests/test_agent.py",
    "tests/test_declare_lost.py",
    "tests/test_fenced_target.py",
    "tests/test_concurrent_passes.py",
    "tests/test_work_notices.py",
    "tests/test_nats_cluster.py",
    "tests/test_relocation.py",
    "tests/test_readiness_checks.py",
    "tests/test_source_readiness.py",
    "tests/test_deployments.py",
    "tests/test_sim_rates.py",
    "tests/test_readme.py",
    "tests/test_deployment_init.py",
    "examples/test_platform.py",
    "tests/test_login.py",
    "tests/test_dashboard_browser.py",
    "tests/test_console.py",
)
"""The longest tests (measured), in the order a parallel run starts them: under pytest-xdist (``make test`` runs
``-n 4 --maxschedchunk 1``) each worker begins with one of them and the short tests fill the gaps, so the run ends
with the longest test, not behind it."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under xdist, start the long tests first, interleaved with short ones (one long test to each worker's first
    pair of tests); a serial run keeps the files' order."""
    if not (getattr(config.option, "numprocesses", None) or hasattr(config, "workerinput")):
        return

    def rank(item: pytest.Item) -> int:
        return next((i for i, p in enumerate(LONG_FIRST) if item.nodeid.startswith(p)), len(LONG_FIRST))

    long = sorted((it for it in items if rank(it) < len(LONG_FIRST)), key=rank)  # stable: a file keeps its order
    short = [it for it in items if rank(it) == len(LONG_FIRST)]
    ordered: list[pytest.Item] = []
    for i, item in enumerate(long):
        ordered.append(item)
        if i < 8 and short:
            ordered.append(short.pop(0))
    items[:] = ordered + short
