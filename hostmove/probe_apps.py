"""``moveprobe`` as the instance of the embedded default: one home for what the demo, ``bench/move`` and the
end-to-end tests all need (a free loopback port, an acknowledged write, the target's probe apps).

The target's probe apps are the box's strict spawns (§5.3 "Every spawn under a move is strict", the target's probe):
each attempt starts through :meth:`~services.box.instance.proctree.CgroupTree.spawn_strict` into the host's leaf,
with moveprobe's forked worker on, and stops by killing and draining that leaf. Nothing is spawned first and moved
afterwards, so nothing ever runs in the agent's own leaf (where §5.3 step 2 would count it a stray).
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import socket
import sys
import urllib.request
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path

from kernel.ports import blocking
from moveprobe.config import probe_env
from services.box.instance.proctree import CgroupTree, find_cgroup2_root
from services.box.instance.sandbox import shared_dirs, user_for
from services.target.probe import ProbeApp, ProcessApp


def free_port() -> int:
    """A loopback port free at the moment of asking."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def post_write(port: int, value: str, *, timeout_s: float = 5.0) -> int:
    """One acknowledged write through moveprobe's API; answers its ``seq``."""
    req = urllib.request.Request(f"http://127.0.0.1:{port}/write", data=json.dumps({"value": value}).encode(),
                                 method="POST", headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        return int(json.loads(resp.read())["seq"])


@dataclass
class _TidiedApp(ProcessApp):
    """A probe app of a tree :class:`ProbeApps` made for itself: after the drain its empty leaf is removed, and
    the tree's box group with it once no other leaf is left (a test or demo leaves no cgroup behind)."""

    owner: ProbeApps | None = None

    async def start(self) -> bool:
        if self.owner is None:
            return await super().start()
        async with self.owner.lock:  # never while the owner removes the box group
            return await super().start()

    async def stop(self) -> None:
        await super().stop()
        if self.owner is not None:
            async with self.owner.lock:
                self.owner.tidy(self.host)


@dataclass
class ProbeApps:
    """The target box's probe factory: a moveprobe per attempt, strictly spawned, all kept so they can be stopped.

    ``tree`` is the target box's :class:`CgroupTree`. Without one, the first attempt makes a tree of its own,
    ``hostmove/<deployment>/<region>.probe.<random>/<host>`` on this machine's cgroup v2 mount (a refusing one
    without it, so every attempt fails with the box's reason), and each app's stop removes what it made;
    ``deployment`` keys it (a private ``probe-<random>`` when not given, so it is nobody else's). ``home`` is the cgroup
    this process came from; the apps no longer need it (nothing is moved there) and it is kept for the callers.
    """

    home: Path
    acks: Path
    region: str = "uk"
    tree: CgroupTree | None = None
    deployment: str = ""
    apps: list[ProcessApp] = field(default_factory=list)
    ports: dict[str, int] = field(default_factory=dict)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    _owned: bool = False

    def target_tree(self) -> CgroupTree:
        """The target box's tree: the one given, or one of its own made on first use."""
        if self.tree is None:
            deployment = self.deployment or f"probe-{secrets.token_hex(6)}"
            self.tree = CgroupTree(find_cgroup2_root(), f"{self.region}.probe.{secrets.token_hex(4)}",
                                   deployment=deployment)
            self._owned = True
        return self.tree

    async def factory(self, host: str, attempt: int, db_path: Path) -> ProbeApp:
        port = free_port()
        tree = self.target_tree()
        env = probe_env(data_dir=db_path.parent, host=host, region=self.region,
                        ack_log=self.acks / f"{host}.{self.region}.jsonl", port=port, interval_s=3600,
                        worker_file=self.acks / f"{host}.{self.region}.worker.jsonl")
        # The sample app's own settings from this box's environment (its fail switch among them), nothing else of
        # it: an instance's environment is its release's (issue 14 item 4).
        env = {**{k: v for k, v in os.environ.items() if k.startswith("MOVEPROBE_")}, **env}
        if user_for(tree, host) is not None:  # the host runs as its own user: the side directory is shared
            await blocking(shared_dirs, [self.acks])
        app = _TidiedApp(argv=[sys.executable, "-m", "moveprobe"], port=port, host=host, tree=tree,
                         ready_path="/ready", env=env, request_timeout_s=0.5, owner=self if self._owned else None,
                         data_dir=db_path.parent)
        self.apps.append(app)
        self.ports[host] = app.port
        return app

    def tidy(self, host: str) -> None:
        """Remove the host's drained leaf, then the box group, the deployment's and ``hostmove`` when empty (only
        a tree it made)."""
        tree = self.tree
        if not self._owned or tree is None or tree.base is None:
            return
        with suppress(OSError):  # populated (a later attempt runs) or already gone
            tree.remove_leaf(host)
        with suppress(OSError):  # another leaf is still there
            tree.base.rmdir()
        tree.prune()  # another box or deployment may still have its group there

    async def stop_all(self) -> None:
        for app in self.apps:
            await app.stop()
