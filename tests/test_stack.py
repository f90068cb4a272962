"""The local stack launcher, against the real pip-installed nats-server and weed binaries."""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import boto3
import msgspec
import nats
import pytest
from botocore import UNSIGNED
from botocore.config import Config
from botocore.exceptions import ClientError

from hostmove.stack import docker_engine_available, stack_down, stack_status, stack_up
from hostmove.stackinfo import StackInfo
from kernel.credentials import load_credentials

Running = tuple[Path, StackInfo, float]


def _s3(info: StackInfo, *, secret: str | None = None, unsigned: bool = False) -> Any:
    cfg = Config(s3={"addressing_style": "path"}, retries={"max_attempts": 1},
                 signature_version=UNSIGNED if unsigned else None)
    return boto3.session.Session().client(
        "s3", endpoint_url=info.s3_endpoint, region_name=info.s3_region, verify=False, config=cfg,
        aws_access_key_id=info.s3_access_key, aws_secret_access_key=secret or info.s3_secret_key)


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def _wait_gone(pid: int, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while not _gone(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _weed_sockets(status: dict[str, Any]) -> list[Path]:
    p = status["s3"]["ports"]
    ports = [p[k] for k in ("master_grpc", "volume_grpc", "filer_grpc", "s3_grpc", "admin_grpc")]
    ports.append(p["admin"] + 10000)
    return [s for port in ports for s in Path("/tmp").glob(f"seaweedfs-*-grpc-{port}.sock")]


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture(scope="module")
def running(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    root = tmp_path_factory.mktemp("up")
    try:
        t0 = time.perf_counter()
        info = stack_up(root)
        yield root, info, time.perf_counter() - t0
    finally:
        stack_down(root)


def test_up_writes_private_stack_json(running: Running) -> None:
    root, info, elapsed = running
    print(f"stack_up took {elapsed:.2f} s")  # a figure, not a bound: a timed test fails on a loaded machine only
    assert _mode(root / "stack.json") == 0o600
    assert _mode(root / "credentials.json") == 0o600
    assert msgspec.json.decode((root / "stack.json").read_bytes(), type=StackInfo) == info
    assert info.mode == "local" and info.root == str(root.resolve())
    assert info.s3_secret_key not in repr(info)
    assert (root / "nats").is_dir() and (root / "s3").is_dir() and (root / "logs").is_dir()


def test_s3_authenticated_put_get(running: Running, unique: Callable[..., str]) -> None:
    _, info, _ = running
    s3, bucket = _s3(info), unique("auth")
    s3.create_bucket(Bucket=bucket)
    s3.put_object(Bucket=bucket, Key="k", Body=b"hello")
    assert s3.get_object(Bucket=bucket, Key="k")["Body"].read() == b"hello"


def test_s3_refuses_anonymous_and_wrong_secret(running: Running, unique: Callable[..., str]) -> None:
    _, info, _ = running
    bucket = unique("anon")
    _s3(info).create_bucket(Bucket=bucket)
    _s3(info).put_object(Bucket=bucket, Key="k", Body=b"secret data")
    for url in (f"{info.s3_endpoint}/", f"{info.s3_endpoint}/{bucket}/k"):
        with pytest.raises(urllib.error.HTTPError) as exc:
            urllib.request.build_opener(urllib.request.ProxyHandler({})).open(url, timeout=5)
        assert exc.value.code == 403
    for client in (_s3(info, unsigned=True), _s3(info, secret="wrong-secret")):
        with pytest.raises(ClientError) as cerr:
            client.get_object(Bucket=bucket, Key="k")
        assert cerr.value.response["ResponseMetadata"]["HTTPStatusCode"] == 403
        with pytest.raises(ClientError) as cerr:
            client.put_object(Bucket=bucket, Key="evil", Body=b"x")
        assert cerr.value.response["ResponseMetadata"]["HTTPStatusCode"] == 403


async def test_nats_jetstream_publish(running: Running, unique: Callable[..., str]) -> None:
    _, info, _ = running
    name = unique("s").replace("-", "_").upper()
    with pytest.raises(nats.errors.Error, match="Authorization Violation"):  # nobody connects anonymously
        await nats.connect(info.nats_url, connect_timeout=5, allow_reconnect=False, max_reconnect_attempts=0)
    admin = load_credentials(info.credentials)  # the operator's nkey, owner-only under the stack's root
    nc = await nats.connect(info.nats_url, connect_timeout=5, max_reconnect_attempts=0, nkeys_seed_str=admin.nats_seed)
    try:
        js = nc.jetstream()
        await js.add_stream(name=name, subjects=[f"{name}.>"])
        ack = await js.publish(f"{name}.x", b"payload", headers={"Nats-Msg-Id": "m1"})
        assert ack.stream == name and ack.seq == 1
        dup = await js.publish(f"{name}.x", b"payload", headers={"Nats-Msg-Id": "m1"})
        assert dup.duplicate
    finally:
        await nc.close()


def test_second_up_reuses_same_processes(running: Running) -> None:
    root, info, _ = running
    t0 = time.perf_counter()
    again = stack_up(root)
    assert time.perf_counter() - t0 < 1.0
    assert again == info
    assert (again.nats_pid, again.weed_pid) == (info.nats_pid, info.weed_pid)


def test_status_healthy_without_secret(running: Running) -> None:
    root, info, _ = running
    status = stack_status(root)
    assert status["running"] is True
    assert status["nats"] | {"alive": True, "healthy": True, "pid": info.nats_pid} == status["nats"]
    assert status["s3"] | {"alive": True, "healthy": True, "pid": info.weed_pid} == status["s3"]
    assert status["nats"]["url"] == info.nats_url and status["s3"]["endpoint"] == info.s3_endpoint
    assert info.s3_secret_key not in json.dumps(status)


def test_session_stack_fixture(stack: StackInfo, unique: Callable[..., str]) -> None:
    s3, bucket = _s3(stack), unique("session")
    s3.create_bucket(Bucket=bucket)
    assert bucket in {b["Name"] for b in s3.list_buckets()["Buckets"]}


def test_down_and_fresh_up(tmp_path: Path) -> None:
    root = tmp_path / "hm"
    blocker = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        info = stack_up(root)
        _s3(info).create_bucket(Bucket="keep")
        _s3(info).put_object(Bucket="keep", Key="k", Body=b"persisted")
        status = stack_status(root)
        sockets = _weed_sockets(status)
        assert sockets, "weed should have created its /tmp gRPC sockets"

        assert stack_down(root) is True
        assert _wait_gone(info.nats_pid) and _wait_gone(info.weed_pid)
        assert not [s for s in sockets if s.exists()]
        assert not _weed_sockets(status)
        assert not list((root / "s3").glob("*.sock"))
        assert not (root / "stack.json").exists()
        assert stack_status(root)["running"] is False
        assert stack_down(root) is False

        # Occupy the old S3 port: the next up must pick new ports on the same data dir (mini.options pitfall).
        blocker.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # the old port may be in TIME_WAIT
        blocker.bind(("127.0.0.1", int(info.s3_endpoint.rsplit(":", 1)[1])))
        blocker.listen()
        again = stack_up(root)
        assert again.s3_endpoint != info.s3_endpoint
        assert {again.nats_pid, again.weed_pid}.isdisjoint({info.nats_pid, info.weed_pid})
        assert again.s3_access_key == info.s3_access_key
        assert _s3(again).get_object(Bucket="keep", Key="k")["Body"].read() == b"persisted"

        # One side dies: up restarts only it, on the ports the services already use (issue 11 item 3).
        os.kill(again.nats_pid, signal.SIGKILL)
        assert _wait_gone(again.nats_pid)
        third = stack_up(root)
        assert third.nats_pid != again.nats_pid and third.weed_pid == again.weed_pid
        assert (third.nats_url, third.s3_endpoint) == (again.nats_url, again.s3_endpoint)
        assert stack_status(root)["running"] is True
    finally:
        blocker.close()
        stack_down(root)


def test_docker_probe_is_quiet_without_engine(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path / 'no-such-docker.sock'}")
    t0 = time.perf_counter()
    assert docker_engine_available() is False
    assert time.perf_counter() - t0 < 3.0
    assert capfd.readouterr() == ("", "")
