"""The agent's own cgroup: run this process as a box's agent, and leave nothing behind (spec §5.3 step 2).

Stop evidence counts every process in the agent's leaf other than the agent as a stray, so the agent
lives in ``hostmove/<deployment>/<box>/@agent`` while it acts for the box. ``scrub`` kills, drains and removes
every leaf of that box of that deployment, and nothing outside it (another deployment's box of the same label
has its own subtree), and moves this process back to where it came from.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from services.box.instance.proctree import AGENT_LEAF, CgroupTree, current_cgroup_dir


def _pids(d: Path) -> list[int]:
    try:
        return [int(x) for x in (d / "cgroup.procs").read_text().split()]
    except (FileNotFoundError, ValueError):
        return []


def _wait_drained(leaf: Path, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while "populated 0" not in (leaf / "cgroup.events").read_text():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{leaf} did not drain within {timeout_s:.0f} s")
        time.sleep(0.005)


def scrub(tree: CgroupTree, home: Path) -> None:
    """Leave nothing behind: this process back in ``home``, every leaf of the box's own subtree
    (``hostmove/<deployment>/<box>``) killed, drained and removed, then the empty parents."""
    base = tree.base
    if base is None or not base.is_dir():
        return
    if os.getpid() in _pids(base / AGENT_LEAF):
        (home / "cgroup.procs").write_text(f"{os.getpid()}\n")
    for leaf in sorted(p for p in base.iterdir() if p.is_dir()):
        with suppress(FileNotFoundError):
            (leaf / "cgroup.kill").write_text("1")
            _wait_drained(leaf)
            leaf.rmdir()
    tree.reap()
    base.rmdir()
    tree.prune()  # other boxes or deployments may still have groups here


@contextmanager
def box_session(tree: CgroupTree) -> Iterator[Path]:
    """Act as the box's agent (inside ``@agent``) for the block; scrub the box's groups afterwards.
    Yields the cgroup this process came from (its "home")."""
    if tree.root is None:
        raise RuntimeError("no cgroup v2 hierarchy on this machine")
    home = current_cgroup_dir(tree.root)
    if home is None:
        raise RuntimeError("cannot find this process's own cgroup v2 directory")
    try:
        tree.enter_agent_leaf()
        try:
            yield home
        finally:
            (home / "cgroup.procs").write_text(f"{os.getpid()}\n")
    finally:
        scrub(tree, home)
