"""Local dev stack: NATS JetStream plus SeaweedFS S3 (``weed mini``), run as detached processes.

All state lives under one root directory (default ``.hostmove/`` in the cwd)::

    <root>/credentials.json   S3 access key and secret (0600), created on first ``up``: the store's admin
    <root>/credentials/       one owner-only role file each (:mod:`kernel.credentials`): ``admin.json`` (the
                              operator's NATS nkey and the S3 admin key), then what :mod:`hostmove.access` provisions
    <root>/nats.conf          the NATS users (public nkeys) and their permissions; anonymous connections are refused
    <root>/nats-users.json    the users :func:`hostmove.access.register_nats_user` added (then SIGHUP: a reload)
    <root>/s3/security.toml   weed's security settings and ``s3/tls/``: every port but S3's takes only TLS with a
                              client certificate of the stack's own CA, and the filer and volume servers a JWT
    <root>/stack.json         msgspec JSON of :class:`StackInfo` (0600, includes the secret), after health
    <root>/run.json           pids of the running processes (written right after spawn, removed by ``down``)
    <root>/ports.json         the last ports used; reused on the next ``up`` when they are still free
    <root>/nats/  <root>/s3/  <root>/logs/

``up`` on a running stack with one component dead (or unhealthy) restarts only that one, on the ports in
``run.json``: the services keep the endpoints they already use (NATS clients reconnect, S3 requests succeed again).

When a Docker engine answers, :func:`start_containers` offers the same stack through testcontainers.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import random
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from hostmove.access import ADMIN, admin_credentials, nats_conf_path, new_nkey_seed, store_security, write_nats_config
from hostmove.stackinfo import StackInfo
from kernel.credentials import Credentials, load_credentials, save_credentials
from kernel.fsutil import atomic_write

BIN_DIR = Path(sys.executable).parent
NATS_BIN = BIN_DIR / "nats-server"
WEED_BIN = BIN_DIR / "weed"
DEFAULT_ROOT = Path(".hostmove")
HOST = "127.0.0.1"
REGION = "us-east-1"
NATS_IMAGE = "nats:2.15.1-alpine"  # the versions of the embedded extra (compose.yaml too)
SEAWEED_IMAGE = "chrislusf/seaweedfs:4.48"

UP_TIMEOUT = 30.0  # seconds until both services must be healthy
STOP_TIMEOUT = 15.0  # SIGTERM grace (weed mini needs up to ~11 s after load), then SIGKILL
_POLL = 0.025
_PORT_RANGE = (20000, 32000)  # below the ephemeral range; +10000 (weed's implicit gRPC offset) stays valid
_SOCK_MAX = 100  # AF_UNIX path limit is 108 bytes
_START_ATTEMPTS = 3
PORTS_FREE_S = 10.0  # how long a restart waits for a dead component's ports to be free again

# Popen objects of the processes this interpreter started, so we can reap them (no zombies in tests).
_CHILDREN: dict[int, subprocess.Popen[Any]] = {}


class StackError(RuntimeError):
    """The stack could not be started or is not in the expected state."""


class _EarlyExit(StackError):
    """A server process exited while we waited for it (often a port taken in the meantime)."""


class Ports(msgspec.Struct, frozen=True):
    nats: int
    nats_monitor: int
    master: int
    master_grpc: int
    volume: int
    volume_grpc: int
    filer: int
    filer_grpc: int
    s3: int
    s3_grpc: int
    admin: int
    admin_grpc: int

    def socket_ports(self) -> list[int]:
        """Ports weed names its hard-coded ``/tmp/seaweedfs-<svc>-grpc-<port>.sock`` files after."""
        return [self.master_grpc, self.volume_grpc, self.filer_grpc, self.s3_grpc, self.admin_grpc,
                self.admin + 10000]


class NatsNode(msgspec.Struct, frozen=True):
    """One node of a NATS cluster (``stack up --nats-cluster N``): its client, monitor and route ports, its pid."""

    name: str
    client: int
    monitor: int
    cluster: int
    pid: int = 0

    @property
    def url(self) -> str:
        return f"nats://{HOST}:{self.client}"

    @property
    def monitor_url(self) -> str:
        return f"http://{HOST}:{self.monitor}"


class RunState(msgspec.Struct, frozen=True):
    ports: Ports
    nats_pid: int
    weed_pid: int
    started_at: float
    nats_nodes: list[NatsNode] = []
    """A cluster's nodes (node 0 on ``ports.nats`` with ``nats_pid``); empty: one server."""


# ------------------------------------------------------------------------------------------ paths, files


def _root(root: Path | str | None) -> Path:
    return Path(root if root is not None else Path.cwd() / DEFAULT_ROOT).expanduser().resolve()


def _sock_dir(root: Path) -> Path:
    """Directory for weed's localSocket files: under root unless that path would be too long for AF_UNIX."""
    d = root / "s3"
    if len(str(d / "filer.sock").encode()) <= _SOCK_MAX:
        return d
    return Path(tempfile.gettempdir()) / f"hostmove-{hashlib.sha1(str(root).encode()).hexdigest()[:12]}"


def _write_private(path: Path, data: bytes) -> None:
    """Atomically write ``data`` to ``path`` with mode 0600."""
    atomic_write(path, data, mode=0o600)


def _read(path: Path, typ: type[Any]) -> Any:
    try:
        return msgspec.json.decode(path.read_bytes(), type=typ)
    except (OSError, msgspec.DecodeError, msgspec.ValidationError):
        return None


@contextlib.contextmanager
def _locked(root: Path) -> Iterator[None]:
    """Serialise up/down on one root across processes."""
    with open(root / ".lock", "a+b") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


class _Credentials(msgspec.Struct):
    access_key: str
    secret_key: str


def _new_credentials() -> _Credentials:
    return _Credentials(access_key="HM" + secrets.token_hex(9).upper(), secret_key=secrets.token_urlsafe(30))


def _admin(root: Path, creds: _Credentials) -> Credentials:
    """The operator's role file (``<root>/credentials/admin.json``): the stack's S3 admin key and a NATS nkey of
    its own, made once."""
    path = admin_credentials(root)
    held = load_credentials(path) if path.exists() else None
    if held is not None and held.s3_access_key == creds.access_key and held.nats_seed:
        return held
    admin = Credentials(role=ADMIN, nats_seed=held.nats_seed if held else new_nkey_seed(), inbox_prefix="_INBOX",
                        s3_access_key=creds.access_key, s3_secret_key=creds.secret_key)
    save_credentials(path, admin)
    return admin


def _credentials(root: Path) -> _Credentials:
    path = root / "credentials.json"
    creds = _read(path, _Credentials)
    if creds is None:
        creds = _new_credentials()
        _write_private(path, msgspec.json.encode(creds))
    elif path.stat().st_mode & 0o077:
        os.chmod(path, 0o600)
    return creds


# ------------------------------------------------------------------------------------------ ports, processes


def _bindable(port: int) -> bool:
    """True if a server could listen on ``port`` (SO_REUSEADDR like Go servers: TIME_WAIT is no obstacle)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((HOST, port))
        except OSError:
            return False
    return True


def _pick_ports(previous: Ports | None) -> Ports:
    """Reuse ``previous`` if all its ports are still free, else pick new free loopback ports by binding."""
    if previous is not None:
        wanted = (*msgspec.structs.astuple(previous), previous.admin + 10000)
        if all(_bindable(p) for p in wanted):
            return previous
    chosen: list[int] = []
    while len(chosen) < len(Ports.__struct_fields__):
        port = random.randrange(*_PORT_RANGE)
        # weed also dials (and names a socket after) admin+10000: keep that clear too.
        extra = [port + 10000] if Ports.__struct_fields__[len(chosen)] == "admin" else []
        if port not in chosen and all(_bindable(p) for p in (port, *extra)):
            chosen.append(port)
    return Ports(*chosen)


def _cluster_nodes(ports: Ports, count: int) -> list[NatsNode]:
    """``count`` nodes: node 0 on ``ports.nats``/``ports.nats_monitor``, the rest on new free loopback ports."""
    taken = {*msgspec.structs.astuple(ports), ports.admin + 10000}
    extra: list[int] = []
    while len(extra) < 3 * count - 2:
        port = random.randrange(*_PORT_RANGE)
        if port not in taken and port not in extra and _bindable(port):
            extra.append(port)
    nodes = [NatsNode("hm-n0", ports.nats, ports.nats_monitor, extra[0])]
    for i in range(1, count):
        client, monitor, route = extra[3 * i - 2: 3 * i + 1]
        nodes.append(NatsNode(f"hm-n{i}", client, monitor, route))
    return nodes


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    proc = _CHILDREN.get(pid)
    if proc is not None:
        if proc.poll() is None:
            return True
        _CHILDREN.pop(pid, None)
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie nobody reaps still answers kill(0)
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        return state != "Z"
    except (OSError, IndexError):
        return True


def _is_ours(pid: int, exe: Path, root: Path) -> bool:
    """True if ``pid`` is alive and is ``exe`` started for ``root`` (guards against pid reuse)."""
    if not _pid_alive(pid):
        return False
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except FileNotFoundError:
        return not Path("/proc/self").exists()  # no procfs (macOS): trust the pid; else it just exited
    except OSError:
        return True
    if Path(os.fsdecode(argv[0])).name != exe.name:
        return False
    if exe == NATS_BIN:  # its store directory ``<root>/nats``, or a cluster node's file ``<root>/nats-<node>.conf``
        store = os.fsencode(root / "nats")
        return store in argv or any(a.startswith(store + b"-") and a.endswith(b".conf") for a in argv)
    return os.fsencode(f"-dir={root / 's3'}") in argv  # an exact argv element


def _spawn(argv: list[str], log: Path, cwd: Path, env: dict[str, str] | None = None) -> subprocess.Popen[Any]:
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        proc = subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True, close_fds=True)
    _CHILDREN[proc.pid] = proc
    return proc


def _remove_grpc_sockets(ports: Ports) -> None:
    """Remove weed's hard-coded ``/tmp/seaweedfs-<svc>-grpc-<port>.sock`` files of ports nobody listens on."""
    for port in ports.socket_ports():
        if _bindable(port):
            for path in Path("/tmp").glob(f"seaweedfs-*-grpc-{port}.sock"):
                path.unlink(missing_ok=True)


def _nats_argv(root: Path, ports: Ports, node: NatsNode | None = None) -> list[str]:
    """``nats.conf`` holds the users (nkeys, per-role permissions: :mod:`hostmove.access`); anonymous is refused.
    The monitoring port (``-m``) has no authentication: it listens where ``-a`` binds the client port (nats-server
    takes its host from ``-a`` when the configuration names no ``http``), loopback only (issue 14), and a cluster
    node's file names its ``http`` on loopback. A cluster's ``node`` runs from its own file (:func:`_node_conf`),
    which includes the same ``nats.conf``."""
    if node is None:
        return [str(NATS_BIN), "-c", str(nats_conf_path(root)), "-js", "-sd", str(root / "nats"), "-a", HOST,
                "-p", str(ports.nats), "-m", str(ports.nats_monitor)]
    return [str(NATS_BIN), "-c", str(_node_conf(root, node))]


def _node_conf(root: Path, node: NatsNode) -> Path:
    """``<root>/nats-<node>.conf``: the node's name, ports, store and routes, then ``include "nats.conf"`` (the
    users), so the SIGHUP that :func:`hostmove.access.reload_nats` sends re-reads the users with the cluster intact
    (a reload of flags given on the command line loses ``server_name`` and fails)."""
    return root / f"nats-{node.name}.conf"


def _write_node_conf(root: Path, node: NatsNode, nodes: list[NatsNode]) -> None:
    routes = ", ".join(f'"nats://{HOST}:{n.cluster}"' for n in nodes if n.name != node.name)
    store = json.dumps(str(root / "nats" / node.name))
    text = (f"server_name: {node.name}\nlisten: {HOST}:{node.client}\nhttp: {HOST}:{node.monitor}\n"
            f"jetstream {{ store_dir: {store} }}\n"
            f"cluster {{ name: hostmove, listen: {HOST}:{node.cluster}, routes: [{routes}] }}\n"
            f'include "{nats_conf_path(root).name}"\n')
    _write_private(_node_conf(root, node), text.encode())


def _spawn_node(root: Path, ports: Ports, node: NatsNode, nodes: list[NatsNode]) -> subprocess.Popen[Any]:
    (root / "nats" / node.name).mkdir(parents=True, exist_ok=True)
    _write_node_conf(root, node, nodes)
    return _spawn(_nats_argv(root, ports, node), root / "logs" / f"nats-{node.name}.log", root / "nats")


def _wait_cluster(nodes: list[NatsNode], deadline: float,
                  procs: dict[str, tuple[subprocess.Popen[Any], Path]] | None = None) -> None:
    """Every node answers its full health check: JetStream up and in contact with a meta leader (a stream with
    replicas can be created)."""
    while True:
        for name, (proc, log) in (procs or {}).items():
            if proc.poll() is not None:
                raise _EarlyExit(f"{name} exited with code {proc.returncode}; {log}:\n{_log_tail(log)}")
        waiting = [n.name for n in nodes if not _http_ok(f"{n.monitor_url}/healthz")]
        if not waiting:
            return
        if time.monotonic() > deadline:
            raise StackError(f"NATS cluster not healthy in time (waiting for {', '.join(waiting)})")
        time.sleep(_POLL * 4)


def _weed_argv(root: Path, ports: Ports) -> list[str]:
    p, sock = ports, _sock_dir(root)
    return [
        str(WEED_BIN), f"-logdir={root / 'logs' / 'weed'}", "mini", f"-dir={root / 's3'}",
        f"-ip={HOST}", f"-ip.bind={HOST}",
        f"-master.port={p.master}", f"-master.port.grpc={p.master_grpc}",
        f"-volume.port={p.volume}", f"-volume.port.grpc={p.volume_grpc}",
        f"-filer.port={p.filer}", f"-filer.port.grpc={p.filer_grpc}",
        f"-filer.localSocket={sock / 'filer.sock'}",
        f"-s3.port={p.s3}", f"-s3.port.grpc={p.s3_grpc}", f"-s3.localSocket={sock / 's3.sock'}",
        "-s3.port.iceberg=0", "-s3.port.lance=0", "-webdav=false", "-admin.ui=false",
        f"-admin.port={p.admin}", f"-admin.port.grpc={p.admin_grpc}",
        "-master.telemetry=false", "-volume.preStopSeconds=0",
        "-s3.iam.readOnly=false",  # the admin identity provisions each role's (hostmove.access.ensure_role)
    ]


def _log_tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


# ------------------------------------------------------------------------------------------ health


_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never route loopback via a proxy


def _http_ok(url: str, timeout: float = 1.0) -> bool:
    try:
        with _OPENER.open(url, timeout=timeout) as r:
            return bool(r.status == 200)
    except (OSError, ValueError):
        return False


def _endpoints(ports: Ports) -> tuple[str, str, str]:
    return f"nats://{HOST}:{ports.nats}", f"http://{HOST}:{ports.nats_monitor}", f"http://{HOST}:{ports.s3}"


def _s3_client(endpoint: str, creds: _Credentials) -> Any:
    import boto3
    from botocore.config import Config

    return boto3.session.Session().client(
        "s3", endpoint_url=endpoint, region_name=REGION, verify=False,  # plain http; sidesteps AWS_CA_BUNDLE
        aws_access_key_id=creds.access_key, aws_secret_access_key=creds.secret_key,
        config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 1, "mode": "standard"},
                      connect_timeout=1, read_timeout=3),
    )


def _wait_ready(nats_monitor: str, s3_endpoint: str, creds: _Credentials, deadline: float,
                procs: dict[str, tuple[subprocess.Popen[Any], Path]] | None = None, *, nats: bool = True,
                s3: bool = True) -> None:
    """Poll until NATS JetStream is healthy and an authenticated S3 call works (only the parts asked for); raise at
    ``deadline``."""
    from botocore.exceptions import BotoCoreError, ClientError

    nats_ok, s3_up = not nats, not s3
    s3_auth = not s3
    client = None
    last_err = ""
    while True:
        for name, (proc, log) in (procs or {}).items():
            if proc.poll() is not None:
                raise _EarlyExit(f"{name} exited with code {proc.returncode}; {log}:\n{_log_tail(log)}")
        nats_ok = nats_ok or _http_ok(f"{nats_monitor}/healthz?js-enabled-only=true")
        s3_up = s3_up or _http_ok(f"{s3_endpoint}/healthz")
        if s3_up and not s3_auth:
            client = client or _s3_client(s3_endpoint, creds)
            try:
                client.list_buckets()
                s3_auth = True
            except (BotoCoreError, ClientError) as e:
                last_err = str(e)
        if nats_ok and s3_auth:
            return
        if time.monotonic() > deadline:
            detail = f"nats={nats_ok}, s3 healthz={s3_up}, s3 auth={s3_auth} {last_err}".strip()
            raise StackError(f"stack not healthy in time ({detail})")
        time.sleep(_POLL)


# ------------------------------------------------------------------------------------------ start / stop


def _start(root: Path, creds: _Credentials, timeout: float, nats_cluster: int = 1) -> StackInfo:
    for exe in (NATS_BIN, WEED_BIN):
        if not os.access(exe, os.X_OK):
            raise StackError(f"{exe} not found; install the embedded stack into this venv: "
                             "pip install 'hostmove[embedded]' (make does)")
    ports = _pick_ports(_read(root / "ports.json", Ports))
    for d in ("nats", "s3", "logs"):
        (root / d).mkdir(parents=True, exist_ok=True)
    sock = _sock_dir(root)
    sock.mkdir(parents=True, exist_ok=True, mode=0o700)
    # mini persists its flags in DIR/mini.options and re-applies them; start from the command line only.
    for stale in (root / "s3" / "mini.options", sock / "filer.sock", sock / "s3.sock"):
        stale.unlink(missing_ok=True)
    _remove_grpc_sockets(ports)

    admin = _admin(root, creds)
    write_nats_config(root, admin.nats_seed)  # before the server starts: it never runs without authentication
    store_security(root / "s3")  # weed's working directory: every port but S3's takes only the stack's own TLS
    env = {k: v for k, v in os.environ.items() if k not in ("S3_BUCKET", "AWS_PROFILE")}
    env |= {"AWS_ACCESS_KEY_ID": creds.access_key, "AWS_SECRET_ACCESS_KEY": creds.secret_key}
    nats_log, weed_log = root / "logs" / "nats.log", root / "logs" / "weed.log"
    nodes: list[NatsNode] = _cluster_nodes(ports, nats_cluster) if nats_cluster > 1 else []
    node_procs = [_spawn_node(root, ports, node, nodes) for node in nodes]
    nats = node_procs[0] if node_procs else _spawn(_nats_argv(root, ports), nats_log, root / "nats")
    nodes = [msgspec.structs.replace(n, pid=p.pid) for n, p in zip(nodes, node_procs, strict=True)]
    weed = _spawn(_weed_argv(root, ports), weed_log, root / "s3", env)
    _write_private(root / "run.json", msgspec.json.encode(RunState(ports, nats.pid, weed.pid, time.time(), nodes)))
    _write_private(root / "ports.json", msgspec.json.encode(ports))

    nats_url, monitor_url, s3_endpoint = _endpoints(ports)
    deadline = time.monotonic() + timeout
    procs = {"weed": (weed, weed_log)}
    procs |= {n.name: (p, root / "logs" / f"nats-{n.name}.log") for n, p in zip(nodes, node_procs, strict=True)}
    if not nodes:
        procs["nats-server"] = (nats, nats_log)
    _wait_ready(monitor_url, s3_endpoint, creds, deadline, procs)
    if nodes:
        _wait_cluster(nodes, deadline, procs)
        nats_url = ",".join(n.url for n in nodes)
    info = StackInfo(nats_url=nats_url, nats_monitor_url=monitor_url, s3_endpoint=s3_endpoint,
                     s3_access_key=creds.access_key, s3_secret_key=creds.secret_key, s3_region=REGION,
                     root=str(root), nats_pid=nats.pid, weed_pid=weed.pid, mode="local",
                     credentials=str(admin_credentials(root)), stream_replicas=max(1, min(nats_cluster, 5)))
    _write_private(root / "stack.json", msgspec.json.encode(info))
    return info


def _wait_gone(pids: list[int], deadline: float) -> list[int]:
    while True:
        pids = [p for p in pids if _pid_alive(p)]
        if not pids or time.monotonic() > deadline:
            return pids
        time.sleep(_POLL)


def _signal(pid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pid, sig)  # started with start_new_session, so pid == pgid
    except (ProcessLookupError, PermissionError):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def _stop(root: Path, timeout: float = STOP_TIMEOUT) -> bool:
    """Stop whatever run.json/stack.json record for ``root``; clean sockets and state files."""
    state: RunState | None = _read(root / "run.json", RunState)
    info: StackInfo | None = _read(root / "stack.json", StackInfo)
    candidates = {(state.nats_pid, NATS_BIN), (state.weed_pid, WEED_BIN)} if state else set()
    candidates |= {(n.pid, NATS_BIN) for n in (state.nats_nodes if state else [])}
    if info is not None:
        candidates |= {(info.nats_pid, NATS_BIN), (info.weed_pid, WEED_BIN)}
    pids = [pid for pid, exe in candidates if _is_ours(pid, exe, root)]
    for pid in pids:
        _signal(pid, signal.SIGTERM)
    left = _wait_gone(pids, time.monotonic() + timeout)
    for pid in left:
        _signal(pid, signal.SIGKILL)
    left = _wait_gone(left, time.monotonic() + 3.0)
    if left:
        raise StackError(f"processes did not exit: {left}")

    sock = _sock_dir(root)
    for stale in (sock / "filer.sock", sock / "s3.sock"):
        stale.unlink(missing_ok=True)
    if sock != root / "s3":
        with contextlib.suppress(OSError):
            sock.rmdir()
    if state is not None:
        _remove_grpc_sockets(state.ports)
    for name in ("stack.json", "run.json"):
        (root / name).unlink(missing_ok=True)
    return bool(pids)


def _restart_parts(root: Path, timeout: float) -> StackInfo | None:
    """A recorded stack with one component dead (or still unhealthy after ``timeout``) and the other ours and alive:
    restart only the dead one, on the ports in ``run.json``, and answer the endpoints. None: nothing of the recorded
    stack runs (or nothing is recorded), so the caller starts afresh."""
    state: RunState | None = _read(root / "run.json", RunState)
    info: StackInfo | None = _read(root / "stack.json", StackInfo)
    creds: _Credentials | None = _read(root / "credentials.json", _Credentials)
    if state is None or info is None or creds is None:
        return None
    if state.nats_nodes:
        return _restart_cluster_parts(root, state, info, creds, timeout)
    nats_url, monitor_url, s3_endpoint = _endpoints(state.ports)
    parts = {
        "nats-server": (NATS_BIN, state.nats_pid, f"{monitor_url}/healthz?js-enabled-only=true"),
        "weed": (WEED_BIN, state.weed_pid, f"{s3_endpoint}/healthz"),
    }
    alive = {name: _is_ours(pid, exe, root) for name, (exe, pid, _) in parts.items()}
    if not any(alive.values()):
        return None
    deadline = time.monotonic() + timeout
    pids = {"nats-server": state.nats_pid, "weed": state.weed_pid}
    for name, (_exe, pid, health) in parts.items():
        if alive[name]:
            while not _http_ok(health) and time.monotonic() < deadline:  # starting, or JetStream recovering
                time.sleep(0.1)
            if _http_ok(health):
                continue
            _signal(pid, signal.SIGTERM)  # alive but never healthy: restart it like a dead one
            if _wait_gone([pid], time.monotonic() + STOP_TIMEOUT):
                _signal(pid, signal.SIGKILL)
                _wait_gone([pid], time.monotonic() + 3.0)
        pids[name] = _restart_one(root, name, state.ports, creds, timeout)
        state = RunState(state.ports, pids["nats-server"], pids["weed"], state.started_at)
        _write_private(root / "run.json", msgspec.json.encode(state))
    info = msgspec.structs.replace(info, nats_pid=pids["nats-server"], weed_pid=pids["weed"])
    _write_private(root / "stack.json", msgspec.json.encode(info))
    return info


def _restart_cluster_parts(root: Path, state: RunState, info: StackInfo, creds: _Credentials,
                           timeout: float) -> StackInfo | None:
    """:func:`_restart_parts` of a cluster: each dead node started again on its ports (it rejoins and catches up
    from its peers), weed as on one server. None: nothing of the recorded stack runs."""
    nodes = list(state.nats_nodes)
    alive = [_is_ours(n.pid, NATS_BIN, root) for n in nodes]
    weed_alive = _is_ours(state.weed_pid, WEED_BIN, root)
    if not any(alive) and not weed_alive:
        return None
    for i, node in enumerate(nodes):
        if alive[i]:
            continue
        wanted = [node.client, node.monitor, node.cluster]
        free_by = time.monotonic() + PORTS_FREE_S
        while (taken := [p for p in wanted if not _bindable(p)]) and time.monotonic() < free_by:
            time.sleep(0.1)
        if taken:
            raise StackError(f"cannot restart NATS node {node.name}: ports {', '.join(map(str, taken))} are taken")
        proc = _spawn_node(root, state.ports, node, nodes)
        nodes[i] = msgspec.structs.replace(node, pid=proc.pid)
    weed_pid = state.weed_pid if weed_alive else _restart_one(root, "weed", state.ports, creds, timeout)
    state = RunState(state.ports, nodes[0].pid, weed_pid, state.started_at, nodes)
    _write_private(root / "run.json", msgspec.json.encode(state))
    _wait_cluster(nodes, time.monotonic() + timeout)
    info = msgspec.structs.replace(info, nats_pid=nodes[0].pid, weed_pid=weed_pid)
    _write_private(root / "stack.json", msgspec.json.encode(info))
    return info


def _restart_one(root: Path, name: str, ports: Ports, creds: _Credentials, timeout: float) -> int:
    """Start ``name`` (``nats-server`` or ``weed``) again on ``ports``; answers its pid once healthy."""
    wanted = [ports.nats, ports.nats_monitor] if name == "nats-server" else [
        ports.master, ports.master_grpc, ports.volume, ports.volume_grpc, ports.filer, ports.filer_grpc, ports.s3,
        ports.s3_grpc, ports.admin, ports.admin_grpc]
    free_by = time.monotonic() + PORTS_FREE_S  # a killed server's sockets may take a moment to go
    while (taken := [p for p in wanted if not _bindable(p)]) and time.monotonic() < free_by:
        time.sleep(0.1)
    if taken:
        raise StackError(f"cannot restart {name} on its ports: {', '.join(map(str, taken))} taken by another process; "
                         "free them, or `hostmove stack down` then `up` (new ports: restart the services too)")
    _nats_url, monitor_url, s3_endpoint = _endpoints(ports)
    log = root / "logs" / f"{'nats' if name == 'nats-server' else 'weed'}.log"
    for attempt in range(_START_ATTEMPTS):
        if name == "nats-server":
            proc = _spawn(_nats_argv(root, ports), log, root / "nats")
        else:
            sock = _sock_dir(root)
            sock.mkdir(parents=True, exist_ok=True, mode=0o700)
            for stale in (root / "s3" / "mini.options", sock / "filer.sock", sock / "s3.sock"):
                stale.unlink(missing_ok=True)
            _remove_grpc_sockets(ports)
            env = {k: v for k, v in os.environ.items() if k not in ("S3_BUCKET", "AWS_PROFILE")}
            env |= {"AWS_ACCESS_KEY_ID": creds.access_key, "AWS_SECRET_ACCESS_KEY": creds.secret_key}
            proc = _spawn(_weed_argv(root, ports), log, root / "s3", env)
        try:
            _wait_ready(monitor_url, s3_endpoint, creds, time.monotonic() + timeout, {name: (proc, log)},
                        nats=name == "nats-server", s3=name == "weed")
            return proc.pid
        except _EarlyExit:
            if attempt == _START_ATTEMPTS - 1:
                raise
            time.sleep(0.5)
        except BaseException:
            _signal(proc.pid, signal.SIGKILL)
            raise
    raise AssertionError("unreachable")


def _reusable(root: Path) -> StackInfo | None:
    info: StackInfo | None = _read(root / "stack.json", StackInfo)
    if info is None:
        return None
    state: RunState | None = _read(root / "run.json", RunState)
    nodes = state.nats_nodes if state is not None else []
    if nodes:
        every = all(_is_ours(n.pid, NATS_BIN, root) and _http_ok(f"{n.monitor_url}/healthz") for n in nodes)
        return info if every and _is_ours(info.weed_pid, WEED_BIN, root) and _http_ok(
            f"{info.s3_endpoint}/healthz") else None
    alive = _is_ours(info.nats_pid, NATS_BIN, root) and _is_ours(info.weed_pid, WEED_BIN, root)
    healthy = alive and _http_ok(f"{info.nats_monitor_url}/healthz?js-enabled-only=true")
    return info if healthy and _http_ok(f"{info.s3_endpoint}/healthz") else None


# ------------------------------------------------------------------------------------------ public API


def stack_up(root: Path | str | None = None, *, timeout: float = UP_TIMEOUT, nats_cluster: int = 1) -> StackInfo:
    """Start (or reuse) NATS JetStream and SeaweedFS S3 under ``root``; return endpoints once healthy.

    ``nats_cluster`` > 1 (issue 19 item 4): that many JetStream nodes of one cluster on loopback, from the same
    binary and the same users; ``nats_url`` lists them all and the streams get that many replicas (at most 5)."""
    if not 1 <= nats_cluster <= 5:
        raise StackError(f"a NATS cluster here has 1 to 5 nodes, not {nats_cluster}")
    root = _root(root)
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    with _locked(root):
        recorded: RunState | None = _read(root / "run.json", RunState)
        if recorded is not None and (_stack_alive(root, recorded)
                                     and len(recorded.nats_nodes or [None]) != nats_cluster):
            raise StackError(f"a stack with {len(recorded.nats_nodes or [None])} NATS node(s) runs under {root}: "
                             f"`hostmove stack down` before `hostmove stack up --nats-cluster {nats_cluster}`")
        info = _reusable(root)
        if info is not None:
            return info
        info = _restart_parts(root, timeout)  # one component dead: only it, on the ports the services use
        if info is not None:
            return info
        _stop(root)  # nothing of the recorded stack runs (or it is unreadable): clean up, start fresh
        creds = _credentials(root)
        for attempt in range(_START_ATTEMPTS):
            try:
                return _start(root, creds, timeout, nats_cluster)
            except _EarlyExit:
                _stop(root)
                if attempt == _START_ATTEMPTS - 1:
                    raise
            except BaseException:
                _stop(root)
                raise
    raise AssertionError("unreachable")


def _stack_alive(root: Path, state: RunState) -> bool:
    pids = [state.nats_pid, *(n.pid for n in state.nats_nodes)]
    return any(_is_ours(p, NATS_BIN, root) for p in pids) or _is_ours(state.weed_pid, WEED_BIN, root)


def nats_nodes(root: Path | str | None = None) -> list[NatsNode]:
    """The nodes of the NATS cluster running under ``root`` (empty: one server, or no stack)."""
    state: RunState | None = _read(_root(root) / "run.json", RunState)
    return list(state.nats_nodes) if state is not None else []


def stack_down(root: Path | str | None = None, *, timeout: float = STOP_TIMEOUT) -> bool:
    """Stop the stack under ``root`` (SIGTERM, SIGKILL after ``timeout``); True if anything was running."""
    root = _root(root)
    if not root.is_dir():
        return False
    with _locked(root):
        return _stop(root, timeout)


def stack_status(root: Path | str | None = None) -> dict[str, Any]:
    """Per-component pid, liveness, health and endpoints (never the secret)."""
    root = _root(root)
    state: RunState | None = _read(root / "run.json", RunState) if root.is_dir() else None
    creds: _Credentials | None = _read(root / "credentials.json", _Credentials) if root.is_dir() else None
    if state is None:
        return {"root": str(root), "mode": "local", "running": False,
                "nats": {"pid": None, "alive": False, "healthy": False},
                "s3": {"pid": None, "alive": False, "healthy": False}}
    nats_url, monitor_url, s3_endpoint = _endpoints(state.ports)
    nats_alive = _is_ours(state.nats_pid, NATS_BIN, root)
    weed_alive = _is_ours(state.weed_pid, WEED_BIN, root)
    nats = {"pid": state.nats_pid, "alive": nats_alive, "url": nats_url, "monitor_url": monitor_url,
            "healthy": nats_alive and _http_ok(f"{monitor_url}/healthz?js-enabled-only=true")}
    s3 = {"pid": state.weed_pid, "alive": weed_alive, "endpoint": s3_endpoint, "region": REGION,
          "access_key": creds.access_key if creds else None, "ports": msgspec.structs.asdict(state.ports),
          "healthy": weed_alive and _http_ok(f"{s3_endpoint}/healthz")}
    if state.nats_nodes:  # a cluster: every node, each alive and healthy
        nodes = [{"name": n.name, "pid": n.pid, "url": n.url, "alive": _is_ours(n.pid, NATS_BIN, root),
                  "healthy": _http_ok(f"{n.monitor_url}/healthz")} for n in state.nats_nodes]
        nats |= {"nodes": nodes, "url": ",".join(n.url for n in state.nats_nodes),
                 "healthy": all(n["alive"] and n["healthy"] for n in nodes)}
    return {"root": str(root), "mode": "local", "running": bool(nats["healthy"] and s3["healthy"]),
            "nats": nats, "s3": s3}


def stack_problems(status: dict[str, Any]) -> list[str]:
    """What :func:`stack_status` shows down, one sentence each (empty: both components are healthy)."""
    if status.get("running"):
        return []
    nats, s3 = status.get("nats") or {}, status.get("s3") or {}
    if nats.get("pid") is None and s3.get("pid") is None:
        return [f"no stack runs under {status.get('root')}: start it with `hostmove stack up`"]
    out = []
    for name, part, check in (("NATS JetStream", nats, f"{nats.get('monitor_url')}/healthz?js-enabled-only=true"),
                              ("SeaweedFS S3", s3, f"{s3.get('endpoint')}/healthz")):
        if not part.get("alive"):
            out.append(f"{name} (pid {part.get('pid')}) is not running: `hostmove stack up` starts the stack again")
        elif not part.get("healthy"):
            out.append(f"{name} (pid {part.get('pid')}) runs but fails its health check ({check})")
    return out


# ------------------------------------------------------------------------------------------ containers


def docker_engine_available() -> bool:
    """True if a Docker engine answers a ping (a ``docker`` CLI on PATH is not enough)."""
    try:
        import docker

        client = docker.from_env(timeout=2)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except Exception:
        return False


@dataclass
class ContainerStack:
    """A stack started with testcontainers; call :meth:`stop` when done."""

    info: StackInfo
    containers: list[Any] = field(default_factory=list)

    def stop(self) -> None:
        for c in reversed(self.containers):
            with contextlib.suppress(Exception):
                c.stop()
        self.containers.clear()


def start_containers(timeout: float = 120.0) -> ContainerStack:
    """Start NATS (``-js``) and SeaweedFS ``mini`` (S3 auth on) in containers; needs a Docker engine."""
    from testcontainers.core.container import DockerContainer

    creds = _new_credentials()
    nats = DockerContainer(NATS_IMAGE).with_command("-js -m 8222").with_exposed_ports(4222, 8222)
    weed = (
        DockerContainer(SEAWEED_IMAGE)
        .with_command("mini -dir=/data -ip.bind=0.0.0.0 -s3.port=8333 -s3.port.iceberg=0 -s3.port.lance=0"
                      " -webdav=false -admin.ui=false -master.telemetry=false -volume.preStopSeconds=0")
        .with_env("AWS_ACCESS_KEY_ID", creds.access_key)
        .with_env("AWS_SECRET_ACCESS_KEY", creds.secret_key)
        .with_exposed_ports(8333)
    )
    started: list[Any] = []
    try:
        for c in (nats, weed):
            c.start()
            started.append(c)
        nhost, whost = nats.get_container_host_ip(), weed.get_container_host_ip()
        monitor = f"http://{nhost}:{nats.get_exposed_port(8222)}"
        endpoint = f"http://{whost}:{weed.get_exposed_port(8333)}"
        _wait_ready(monitor, endpoint, creds, time.monotonic() + timeout)
        info = StackInfo(nats_url=f"nats://{nhost}:{nats.get_exposed_port(4222)}", nats_monitor_url=monitor,
                         s3_endpoint=endpoint, s3_access_key=creds.access_key, s3_secret_key=creds.secret_key,
                         s3_region=REGION, mode="containers")
        return ContainerStack(info, started)
    except BaseException:
        ContainerStack(StackInfo("", "", "", "", ""), started).stop()
        raise
