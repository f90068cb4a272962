"""Shared set-up for the cgroup tests: a per-test box group that is always scrubbed, and polling helpers.

Every tree here belongs to this test run's own deployment, :data:`TEST_DEPLOYMENT` (``hostmove/<it>/<box>``), so
two test runs on one machine (two engineers' pytest at once) never see each other's processes, whatever labels
their boxes carry."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any, TypeVar

from services.box.instance.agentcg import scrub as agent_scrub
from services.box.instance.proctree import CgroupTree, current_cgroup_dir, find_cgroup2_root

FORKER = Path(__file__).with_name("forker.py")
T = TypeVar("T")
TEST_DEPLOYMENT = f"test-{os.getpid()}-{secrets.token_hex(4)}"
"""This test run's deployment identity: it keys every cgroup subtree the run's trees make (issue 11 item 5)."""


def wait_for(check: Callable[[], T | None], what: str, timeout: float = 10.0) -> T:
    """Poll ``check`` until it returns a truthy value, or fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.005)


def read_pid(path: Path, timeout: float = 10.0) -> int:
    def check() -> int | None:
        try:
            return int(path.read_text())
        except (FileNotFoundError, ValueError):
            return None

    return wait_for(check, f"a pid in {path}", timeout)


def alive(pid: int) -> bool:
    """Running (a zombie waiting to be reaped by someone else counts as gone)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return "\nState:\tZ" not in status


def cgroup_root() -> Path:
    root = find_cgroup2_root()
    assert root is not None, "these tests need a cgroup v2 hierarchy (a 'cgroup2' line in /proc/mounts)"
    return root


def python_env() -> dict[str, str]:
    return {"PATH": os.environ.get("PATH", os.defpath), "PYTHONDONTWRITEBYTECODE": "1"}


def forker(*args: str) -> list[str]:
    return [sys.executable, str(FORKER), *args]


def scrub(tree: CgroupTree, home: Path) -> None:
    """Leave nothing behind (the box agent's own clean-up, :func:`services.box.instance.agentcg.scrub`)."""
    agent_scrub(tree, home)


def run_tree(box: str, *, deployment: str = TEST_DEPLOYMENT, **kwargs: Any) -> CgroupTree:
    """A tree on this machine's cgroup v2 mount for ``box`` of this run's deployment (or the one named)."""
    return CgroupTree.discover(box, deployment=deployment, **kwargs)


@contextmanager
def box_tree(box: str, *, deployment: str = TEST_DEPLOYMENT) -> Iterator[tuple[CgroupTree, Path]]:
    """A :class:`CgroupTree` for a fresh box label of this run's deployment (or the one named), scrubbed
    afterwards; also where this process lives now."""
    root = cgroup_root()
    home = current_cgroup_dir(root)
    assert home is not None, "cannot find this process's own cgroup v2 directory"
    tree = CgroupTree(root, box, deployment=deployment)
    try:
        yield tree, home
    finally:
        scrub(tree, home)


@contextmanager
def as_agent(tree: CgroupTree, home: Path) -> Iterator[Path]:
    """Run this (test) process as the box's agent: inside ``hostmove/<deployment>/<box>/@agent`` until the block
    ends."""
    leaf = tree.enter_agent_leaf()
    try:
        yield leaf
    finally:
        (home / "cgroup.procs").write_text(f"{os.getpid()}\n")


class Reaper:
    """Processes a test started outside any tree: killed and reaped at the end whatever happened."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, argv: list[str], *, home: Path | None = None) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, start_new_session=True)
        self.procs.append(proc)
        if home is not None:
            (home / "cgroup.procs").write_text(f"{proc.pid}\n")
        return proc

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                with suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
