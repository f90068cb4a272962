"""``hostmove.testing``: a pytest plugin for a platform's integration tests against a real hostmove (issue 20 item 7).

Installed with the package (a ``pytest11`` entry point), its fixtures give a test, in a few lines, what ``make demo``
shows:

- ``hostmove_stack`` (session): NATS JetStream and SeaweedFS, from the compose images through testcontainers where
  a Docker engine answers, else the ``embedded`` extra's binaries under a session directory;
- ``hostmove_deployment``: a deployment of its own on that stack (its own buckets, what ``hostmove deployment init``
  makes), a box in each of two regions (``ie-1`` in ``ie``, ``uk-1`` in ``uk``; what ``hostmove box init`` does) and
  its services as processes (the door, the recovery pass, one agent per box), an operator token for the door; a
  :class:`Deployment`, whose methods run the operator's CLI (:meth:`Deployment.hostmove`);
- ``hostmove_app``: the sample app ``moveprobe`` published as a release (:meth:`Deployment.publish`);
- ``hostmove_host``: a host running it, serving on the first box (:meth:`Deployment.create_host`).

``hostmove_deployment.move(host, to="uk")`` moves it as ``hostmove move`` does and answers a :class:`Moved`. A box
refuses to take part in moves where it cannot spawn strictly (cgroup v2, a delegated subtree, ``cgroup.kill``): on
such a machine the deployment fixture skips, saying why. Everything a deployment made (its buckets, its processes,
its instances) is removed at its end.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import secrets
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from hostmove.probe_apps import free_port
from hostmove.procs import ServiceProc, service_env
from hostmove.stackinfo import StackInfo

REGIONS = (("ie-1", "ie"), ("uk-1", "uk"))
"""The deployment's boxes, ``(label, region)``: the first is where :meth:`Deployment.create_host` puts a host."""
FAST = {"MOVEPROBE_INTERVAL_S": "0.2", "MOVEPROBE_SCHEDULE_EVERY_S": "0.4", "MOVEPROBE_ONCE_AFTER_S": "4"}
"""The sample app's cadence in the demo (a write every 0.2 s)."""


class HostmoveFailed(AssertionError):
    """An operator command failed where the fixture needed it; the message carries its output."""


@contextmanager
def embedded_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StackInfo]:
    """NATS + S3 for a test session: containers when a Docker engine answers, else the pip-installed binaries."""
    from hostmove.stack import docker_engine_available, stack_down, stack_up, start_containers

    if docker_engine_available():
        containers = start_containers()
        try:
            yield containers.info
        finally:
            containers.stop()
        return
    root = tmp_path_factory.mktemp("hostmove-stack")
    info = stack_up(root)
    try:
        yield info
    finally:
        stack_down(root)


@dataclass(frozen=True)
class Moved:
    """How ``hostmove move --until closed`` ended: its exit code (:mod:`hostmove.exitcodes`), what it printed, and
    the door's status of the host afterwards."""

    host: str
    code: int
    output: str
    status: dict[str, Any]

    @property
    def done(self) -> bool:
        last = self.status.get("last_move") or {}
        return self.code == 0 and last.get("outcome") == "done"


@dataclass
class Deployment:
    """A deployment on ``stack`` under ``root``, driven through the operator's CLI (see the module doc)."""

    stack: StackInfo
    root: Path
    bucket: str
    data_prefix: str
    boxes: Sequence[tuple[str, str]] = REGIONS
    token: str = field(default="", repr=False)
    door_url: str = ""
    procs: list[ServiceProc] = field(default_factory=list)

    # -- the operator's CLI -----------------------------------------------------------------------------

    def operator_env(self) -> dict[str, str]:
        """The CLI's environment: the stack's operator (its admin role file), this deployment's bucket, the door."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("HOSTMOVE_")}
        env.update(HOSTMOVE_NATS_URL=self.stack.nats_url, HOSTMOVE_S3_ENDPOINT=self.stack.s3_endpoint,
                   HOSTMOVE_S3_REGION=self.stack.s3_region, HOSTMOVE_S3_ACCESS_KEY=self.stack.s3_access_key,
                   HOSTMOVE_S3_SECRET_KEY=self.stack.s3_secret_key, HOSTMOVE_BUCKET=self.bucket,
                   HOSTMOVE_ROOT=str(self.root), HOSTMOVE_DATA_BUCKET_PREFIX=self.data_prefix)
        if self.stack.credentials:
            env["HOSTMOVE_CREDENTIALS"] = self.stack.credentials
        if self.door_url:
            env.update(HOSTMOVE_DOOR_URL=self.door_url, HOSTMOVE_TOKEN=self.token)
        return env

    def hostmove(self, *args: str, check: bool = True, timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
        """Run ``hostmove ARGS`` as this deployment's operator; ``check``: a non-zero exit fails with its output."""
        done = subprocess.run([sys.executable, "-m", "hostmove.cli", *args], env=self.operator_env(),
                              capture_output=True, text=True, timeout=timeout)
        if check and done.returncode != 0:
            raise HostmoveFailed(f"hostmove {' '.join(args)} exited {done.returncode}:\n"
                                 f"{self._redact(done.stdout + done.stderr)}")
        return done

    def _redact(self, text: str) -> str:
        return text.replace(self.token, "[token]") if self.token else text

    # -- set-up -----------------------------------------------------------------------------------------

    def init(self) -> None:
        """What ``hostmove deployment init --region ...`` and ``hostmove box init`` of each box do (its buckets,
        versioned and probed; its key and floor; the roster), in this process: one connection, not a command each."""
        _run_async(self._init())

    async def _init(self) -> None:
        from hostmove.runtime import open_runtime, settings_from_stack
        from services.box.deployment import init_deployment, prepare_buckets
        from services.box.roster import ensure_deployment, init_box

        rt = await open_runtime(settings_from_stack(self.stack, root=self.root, bucket=self.bucket), "testing",
                                probe=False)
        try:
            refused = await prepare_buckets(rt.store, [self.bucket, *(f"{self.data_prefix}-{region}"
                                                                      for _, region in self.boxes)])
            if refused is not None:
                raise HostmoveFailed(f"the store cannot hold a deployment: bucket {refused.bucket}: {refused.why}")
            await init_deployment(root=self.root, store=rt.store, bucket=self.bucket, clock=rt.clock)
            await ensure_deployment(rt.store, self.bucket, rng=rt.rng, clock=rt.clock)  # its identity: a box reads it
            for label, region in self.boxes:
                await init_box(root=self.root, label=label, region=region, store=rt.store, bucket=self.bucket,
                               events=rt.events, clock=rt.clock, actor=rt.actor)
        finally:
            await rt.close()

    def strict_unavailable(self) -> str:
        """Why a box cannot spawn strictly on this machine, or ``""``."""
        from kernel.ports import WallClock
        from services.box.instance.proctree import CgroupTree

        ok, why = CgroupTree.discover(self.boxes[0][0], deployment=f"probe-{secrets.token_hex(4)}",
                                      clock=WallClock()).strict_available()
        return "" if ok else str(why)

    def start(self, extra: Mapping[str, str] | None = None) -> None:
        """The door (a fresh operator token), the recovery pass and every box's agent, each its own process."""
        from services.door.auth import token_digest

        self.token = secrets.token_urlsafe(32)
        env = service_env(self.stack, root=self.root, bucket=self.bucket, extra={
            "HOSTMOVE_PROFILE": "fast", "HOSTMOVE_DATA_BUCKET_PREFIX": self.data_prefix,
            "HOSTMOVE_OPERATOR_TOKENS": f"testing={token_digest(self.token)}", **(extra or {})})
        port = free_port()
        logs = self.root / "logs"
        self.procs = [ServiceProc.serve("door", env, logs / "door.log", "--port", str(port)),
                      ServiceProc.serve("recovery", env, logs / "recovery.log")]
        self.procs += [ServiceProc.serve("box", env, logs / f"box-{label}.log", "--label", label)
                       for label, _ in self.boxes]
        for proc in self.procs:
            proc.start()
        self.door_url = f"http://127.0.0.1:{port}"
        _until(lambda: _answers(f"{self.door_url}/healthz"), "the door answering", 60,
               lambda: self.procs[0].output()[-2000:])

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()

    # -- what a test does -------------------------------------------------------------------------------

    def publish(self, manifest: Path | None = None, name: str = "moveprobe") -> int:
        """Publish ``manifest`` as ``name``'s next release (``hostmove app publish``); without one, the sample app
        at the demo's cadence (in this process). Answers the release's number."""
        if manifest is None:
            return int(_run_async(self._publish_sample(name)))
        out = self.hostmove("app", "publish", "--name", name, str(manifest)).stdout
        found = re.search(r"--release (\d+)", out)
        if found is None:
            raise HostmoveFailed(f"app publish did not name the release: {out}")
        return int(found.group(1))

    async def _publish_sample(self, name: str) -> int:
        from hostmove.runtime import open_runtime, settings_from_stack
        from moveprobe import RELEASE_MANIFEST
        from services.apps.releases import load_manifest, publish

        rt = await open_runtime(settings_from_stack(self.stack, root=self.root, bucket=self.bucket), "testing",
                                probe=False)
        try:
            manifest, files = load_manifest(RELEASE_MANIFEST, name=name, env=FAST)
            release, _ref = await publish(rt.store, self.bucket, manifest, files, clock=rt.clock, rng=rt.rng)
        finally:
            await rt.close()
        return int(release.release)

    def create_host(self, host: str, *, app: str = "moveprobe", box: str | None = None,
                    timeout_s: float = 60.0) -> str:
        """Create ``host`` running ``app`` on ``box`` (default the first) and wait until its agent serves it."""
        from services.agent.service import read_endpoint

        label = box or self.boxes[0][0]
        self.hostmove("host", "create", host, "--box", label, "--app", app)
        box_dir = self.root / "boxes" / label
        _until(lambda: read_endpoint(box_dir, host), f"{host} serving on {label}", timeout_s,
               lambda: self._box_log(label))
        return host

    def move(self, host: str, *, to: str, timeout_s: float = 240.0) -> Moved:
        """``hostmove move --host H --to R --until closed``, then the door's status of ``host``."""
        done = self.hostmove("move", "--host", host, "--to", to, "--until", "closed", "--timeout", str(timeout_s),
                             "--interval", "0.3", check=False, timeout=timeout_s + 60)
        return Moved(host, done.returncode, self._redact(done.stdout + done.stderr), self.status(host))

    def status(self, host: str) -> dict[str, Any]:
        """The door's status of ``host`` (``hostmove move status --json``)."""
        done = self.hostmove("move", "status", "--host", host, "--json", check=False)
        try:
            body = json.loads(done.stdout)
        except ValueError:
            raise HostmoveFailed(f"move status answered no JSON ({done.returncode}): "
                                 f"{self._redact(done.stdout + done.stderr)}") from None
        return body if isinstance(body, dict) else {"status": body}

    def serving_on(self, host: str) -> str | None:
        """The box whose edge table serves ``host`` on this machine, or None."""
        from services.agent.service import read_endpoint

        for label, _ in self.boxes:
            if read_endpoint(self.root / "boxes" / label, host) is not None:
                return label
        return None

    def _box_log(self, label: str) -> str:
        log = self.root / "logs" / f"box-{label}.log"
        return log.read_text(errors="replace")[-2000:] if log.exists() else ""

    def drop_buckets(self) -> None:
        """Delete this deployment's buckets (SeaweedFS's ``weed mini`` holds only some dozens)."""
        from services.objstore.s3 import S3Store

        async def drop() -> None:
            store = await S3Store.open(self.stack.s3_endpoint, self.stack.s3_access_key, self.stack.s3_secret_key,
                                       self.stack.s3_region)
            try:
                for name in (self.bucket, *(f"{self.data_prefix}-{r}" for _, r in self.boxes)):
                    await store.delete_bucket(name)
            finally:
                await store.close()

        _run_async(drop())


def _answers(url: str) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=2) as resp:  # noqa: S310 - the test's own loopback door
            return bool(resp.status == 200)
    except OSError:
        return False


def _until(check: Callable[[], Any], what: str, timeout_s: float, why: Callable[[], str] = lambda: "") -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise HostmoveFailed(f"{what} did not happen within {timeout_s:g} s\n{why()}")
        time.sleep(0.1)


def _run_async(coro: Any) -> Any:
    """Run ``coro`` to its end whether or not the caller runs an event loop (a fixture of an async test)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


def _name(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(4)}"


@pytest.fixture(scope="session")
def hostmove_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StackInfo]:
    """The session's NATS JetStream and SeaweedFS (module doc)."""
    with embedded_stack(tmp_path_factory) as info:
        yield info


@pytest.fixture
def hostmove_deployment(hostmove_stack: StackInfo, tmp_path: Path) -> Iterator[Deployment]:
    """A deployment of its own with a box in each of two regions and its services running (module doc)."""
    deployment = Deployment(hostmove_stack, tmp_path / "hostmove", bucket=_name("hm-deploy"),
                            data_prefix=_name("hm-data"))
    why = deployment.strict_unavailable()
    if why:
        pytest.skip(f"this machine cannot spawn strictly ({why}); a box here refuses to take part in moves")
    try:
        deployment.init()
        deployment.start()
        yield deployment
    finally:
        deployment.stop()
        deployment.drop_buckets()


@pytest.fixture
def hostmove_app(hostmove_deployment: Deployment) -> str:
    """The sample app ``moveprobe``, published; answers its name."""
    hostmove_deployment.publish()
    return "moveprobe"


@pytest.fixture
def hostmove_host(hostmove_deployment: Deployment, hostmove_app: str) -> str:
    """A host running the sample app, serving on the deployment's first box; answers its name."""
    return hostmove_deployment.create_host(f"{_name('host')}.example.com", app=hostmove_app)


__all__ = ["Deployment", "HostmoveFailed", "Moved", "embedded_stack", "hostmove_app", "hostmove_deployment",
           "hostmove_host", "hostmove_stack"]
