"""Box agents as real OS processes (``hostmove serve box --label L``) against the session's stack, for the
service and crash-matrix tests: start, stop by SIGTERM, and watch a failpoint's SIGKILL.

Each world is its own deployment: its own deployment bucket, whose identity (``control/deployment.json``) the world
mints before its agents start and every agent reads, so its boxes' cgroup subtrees are
``hostmove/<that id>/<label>`` and no two worlds (of this run or of another run on this machine) share one."""

from __future__ import annotations

import asyncio
import os
import time
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from bus.nats_log import NatsEventLog
from events import Actor
from events.claim import AppRef
from hostmove.procs import ServiceProc, service_env
from hostmove.stackinfo import StackInfo
from kernel.ports import Clock, SystemRandom, WallClock
from moveprobe import RELEASE_MANIFEST
from services.apps.releases import load_manifest, publish, set_default_app
from services.box.deployment import init_deployment
from services.box.instance.proctree import CgroupTree
from services.box.roster import ensure_deployment, init_box
from services.door.decide import Floor
from services.ledger import Ledger
from services.ledger.audit import run_audit
from services.objstore.port import ObjectStore
from services.objstore.s3 import S3Store

T = TypeVar("T")


SAMPLE_ENV = {"MOVEPROBE_INTERVAL_S": "3600"}
"""The sample app's background loop, unless a world's ``app_env`` says otherwise: idle (hosts can sleep)."""


async def publish_sample(store: ObjectStore, bucket: str, clock: Clock,
                         env: dict[str, str] | None = None) -> AppRef:
    """Publish ``moveprobe`` (its manifest, ``env`` added) as an app release in ``bucket``: like any app."""
    manifest, files = load_manifest(RELEASE_MANIFEST, name="moveprobe", env={**SAMPLE_ENV, **(env or {})})
    _release, ref = await publish(store, bucket, manifest, files, clock=clock)
    return ref


async def eventually(check: Callable[[], Awaitable[T | None]], what: str, timeout_s: float = 60.0,
                     every_s: float = 0.25) -> T:
    """Poll ``check`` until it answers something truthy, or fail after ``timeout_s`` with ``what``. Every quarter
    of a second by default: a check reads the ledger (two GETs of S3, most of the test process's CPU), and ten a
    second were a tenth of a real-stack test's requests for no sooner an answer that matters."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = await check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
        await asyncio.sleep(every_s)


@dataclass
class AgentWorld:
    """A deployment of two boxes (``ie`` and ``uk``), each run by its own agent process, on the real stack.
    ``deploy`` is this world's deployment bucket (its roster names exactly these two boxes) and ``deployment`` its
    identity (the key of its cgroup subtrees); the data buckets are ``<prefix>-ie`` and ``<prefix>-uk``."""

    root: Path
    deploy: str
    prefix: str
    labels: dict[str, str]
    agents: dict[str, ServiceProc]
    store: S3Store
    events: NatsEventLog
    ledger: Ledger
    deployment: str = ""
    app: AppRef | None = None
    """The sample app's release this world published (``moveprobe``, issue 18): what its hosts are created with."""

    def box_dir(self, region: str) -> Path:
        return self.root / "boxes" / self.labels[region]

    def tree(self, label: str) -> CgroupTree:
        """Box ``label``'s cgroup tree in this world's deployment (``hostmove/<deployment>/<label>``)."""
        return CgroupTree.discover(label, deployment=self.deployment, clock=WallClock())

    def box_group(self, region: str) -> Path | None:
        """The region's box's cgroup subtree on this machine (which may not exist), ``None`` without cgroup v2."""
        return self.tree(self.labels[region]).base

    def acks(self, host: str, region: str = "ie") -> Path:
        """The acknowledgement log of ``host``'s instances on the region's box (the release's
        ``{side_dir}/{host}.{box}.jsonl``)."""
        return self.root / "acks" / f"{host}.{self.labels[region]}.jsonl"

    def stop(self) -> dict[str, int | None]:
        return {region: agent.stop() for region, agent in self.agents.items()}


def drain_box_groups(label: str, deployment: str) -> None:
    """Kill, drain and remove every cgroup leaf of box ``label`` of the deployment ``deployment`` and its group
    (what a box's agent scrubs when it stops gracefully; a SIGKILLed one cannot). Nothing of another deployment's
    box of the same label is touched."""
    tree = CgroupTree.discover(label, deployment=deployment, clock=WallClock())
    base = tree.base
    if base is None or not base.is_dir():
        return
    for leaf in sorted(p for p in base.iterdir() if p.is_dir()):
        with suppress(FileNotFoundError, OSError):
            (leaf / "cgroup.kill").write_text("1")
            deadline = time.monotonic() + 10
            while "populated 0" not in (leaf / "cgroup.events").read_text() and time.monotonic() < deadline:
                time.sleep(0.01)
            leaf.rmdir()
    with suppress(OSError):
        base.rmdir()
    tree.prune()


@asynccontextmanager
async def data_buckets(stack: StackInfo, unique: Callable[[str], str],
                       prefix: str) -> AsyncIterator[tuple[S3Store, NatsEventLog, str]]:
    """A store, an event log and the two regions' data buckets ``<p>-ie`` and ``<p>-uk`` (``p`` made unique from
    ``prefix``) for a test module, dropped afterwards (weed mini holds ~76 buckets)."""
    store = await S3Store.open(stack.s3_endpoint, stack.s3_access_key, stack.s3_secret_key, stack.s3_region)
    events = await NatsEventLog.connect(stack.nats_url)
    p = unique(prefix)
    for region in ("ie", "uk"):
        await store.create_bucket(f"{p}-{region}", versioned=True)
    try:
        yield store, events, p
    finally:
        for region in ("ie", "uk"):
            await store.delete_bucket(f"{p}-{region}")
        await events.close()
        await store.close()


async def audit_settles(events: NatsEventLog, ledger: Ledger, host: str, timeout_s: float = 30.0) -> None:
    """The host's history audits clean (strict) within ``timeout_s``: a CAS whose event is still on its way (a
    chore's, after a close) is drift only until it lands; on the deadline, the audit's findings."""
    async def clean() -> bool:
        return (await run_audit(events, ledger, host=host)).clean(strict=True)

    try:
        await eventually(clean, f"a clean audit of {host}", timeout_s, every_s=0.5)
    except AssertionError:
        audit = await run_audit(events, ledger, host=host)
        raise AssertionError([f.line() for f in audit.findings]) from None


@asynccontextmanager
async def agent_world(stack: StackInfo, unique: Callable[[str], str], root: Path, prefix: str, *, store: S3Store,
                      events: NatsEventLog, start: bool = True, extra: dict[str, dict[str, str]] | None = None,
                      app_env: dict[str, str] | None = None, agent_env: dict[str, str] | None = None,
                      labels: dict[str, str] | None = None, floor: Floor | None = None) -> AsyncIterator[AgentWorld]:
    """Two boxes under ``root`` registered in a fresh deployment bucket with its own identity, their agents
    started (unless ``start`` is False); on exit the agents are stopped by SIGTERM, every group of the world's boxes
    is drained and the deployment bucket dropped. The data buckets ``<prefix>-ie`` and ``<prefix>-uk`` belong to the
    caller (shared across worlds). ``labels`` names the boxes (``{"ie": ..., "uk": ...}``; unique ones by
    default). The world's deployment is initialized (its key and floor) and the sample app published as a release
    with ``app_env`` in its environment (``AgentWorld.app``; a ``HOSTMOVE_*`` setting in it is the agents');
    ``agent_env`` is added to every agent's own environment."""
    clock = WallClock()
    deploy = unique("agt-deploy")
    await store.create_bucket(deploy, versioned=True)
    deployment = await ensure_deployment(store, deploy, rng=SystemRandom(), clock=clock)
    actor = Actor(service="test-agents", pid=os.getpid(), nonce="agents")
    ledger = Ledger(store, events, clock, actor, deploy)
    labels = dict(labels) if labels is not None else {"ie": unique("ie"), "uk": unique("uk")}
    await init_deployment(root=root, store=store, bucket=deploy, clock=clock, floor=floor)
    for region, label in labels.items():
        await init_box(root=root, label=label, region=region, store=store, bucket=deploy, events=events, clock=clock,
                       actor=actor)
    platform = {k: v for k, v in (app_env or {}).items() if k.startswith("HOSTMOVE_")}  # the agents' settings
    app = await publish_sample(store, deploy, clock, {k: v for k, v in (app_env or {}).items() if k not in platform})
    await set_default_app(store, deploy, app)  # what a host created without --app runs here
    env = service_env(stack, root=root, bucket=deploy, extra={
        "HOSTMOVE_DATA_BUCKET_PREFIX": prefix, "HOSTMOVE_PROFILE": "fast", **platform, **(agent_env or {})})
    agents = {r: ServiceProc.serve("box", env, root / f"agent-{label}.log", "--label", label)
              for r, label in labels.items()}
    world = AgentWorld(root, deploy, prefix, labels, agents, store, events, ledger, deployment, app)
    try:
        if start:
            for region, agent in agents.items():
                agent.start((extra or {}).get(region))
        yield world
    finally:
        world.stop()
        for label in labels.values():  # an agent killed by a failpoint never scrubbed its groups: nothing stays
            drain_box_groups(label, deployment)
        await store.delete_bucket(deploy)


def answers_ready(port: int) -> bool:
    """The instance on ``port`` answers its readiness path with 200 to 399."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=2) as resp:
            return 200 <= resp.status < 400
    except OSError:
        return False
