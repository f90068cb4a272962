"""The operator's command line as real OS processes against the real stack (issue 2 items 5, 6, 8)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import IO

import msgspec
import pytest
import pytest_asyncio

from bus.nats_log import NatsEventLog
from bus.subjects import LEDGER_STREAM, ledger_subject
from events import Actor, Claim, Op
from hostmove.probe_apps import free_port
from hostmove.stackinfo import StackInfo
from kernel.ports import WallClock
from services.hosts.create import create_host
from services.ledger import Committed, Crash, Ledger, object_key
from services.objstore.port import Got
from services.objstore.s3 import S3Store

HOSTMOVE = [sys.executable, "-m", "hostmove.cli"]


@pytest.fixture(scope="module")
def cli_bucket(unique: Callable[[str], str]) -> str:
    return unique("cli")


@pytest.fixture
def cli_env(stack: StackInfo, cli_bucket: str, tmp_path: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        HOSTMOVE_NATS_URL=stack.nats_url,
        HOSTMOVE_S3_ENDPOINT=stack.s3_endpoint,
        HOSTMOVE_S3_ACCESS_KEY=stack.s3_access_key,
        HOSTMOVE_S3_SECRET_KEY=stack.s3_secret_key,
        HOSTMOVE_BUCKET=cli_bucket,
        HOSTMOVE_ROOT=str(tmp_path / "root"),
    )
    return env


@pytest_asyncio.fixture(loop_scope="session")
async def parts(
    stack: StackInfo, cli_env: dict[str, str]
) -> AsyncIterator[tuple[S3Store, NatsEventLog, str]]:
    store = await S3Store.open(stack.s3_endpoint, stack.s3_access_key, stack.s3_secret_key, stack.s3_region)
    events = await NatsEventLog.connect(stack.nats_url)
    bucket = cli_env["HOSTMOVE_BUCKET"]
    await store.create_bucket(bucket)
    yield store, events, bucket
    await events.close()
    await store.close()


def ledger_for(
    parts: tuple[S3Store, NatsEventLog, str], faults: Callable[[str], None] | None = None
) -> Ledger:
    store, events, bucket = parts
    return Ledger(
        store, events, WallClock(), Actor(service="test", pid=os.getpid(), nonce="t"), bucket, faults
    )


def serving(phase: str) -> Callable[[Claim | None], Claim]:
    def decide(cur: Claim | None) -> Claim:
        return msgspec.structs.replace(cur or Claim(host="x", gen=1), op=Op(kind="serving", phase=phase))

    return decide


def run_cli(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(HOSTMOVE + args, env=env, capture_output=True, text=True, timeout=60)


async def test_probe_passes_on_seaweedfs(cli_env: dict[str, str], parts: object) -> None:
    out = await asyncio.to_thread(run_cli, ["probe"], cli_env)
    assert out.returncode == 0, out.stderr
    assert "passed" in out.stdout
    assert cli_env["HOSTMOVE_S3_SECRET_KEY"] not in out.stdout + out.stderr


async def test_audit_is_clean_then_names_an_out_of_band_edit(
    cli_env: dict[str, str], parts: tuple[S3Store, NatsEventLog, str], unique: Callable[[str], str]
) -> None:
    host = f"{unique('audit')}.example.com"
    ledger = ledger_for(parts)
    assert isinstance(await create_host(ledger, host, box="ie-1", region="ie", incarnation="ab" * 32), Committed)

    def note(cur: Claim | None) -> Claim:
        assert cur is not None
        return msgspec.structs.replace(cur, inventory={"c": 1})

    assert isinstance(await ledger.transition("claim", host, "inventory", note), Committed)
    out = await asyncio.to_thread(run_cli, ["audit", "--host", host], cli_env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "3 events" in out.stdout and "clean" in out.stdout
    store, _, bucket = parts
    got = await store.get(bucket, object_key("claim", host))
    assert isinstance(got, Got)
    await store.put(
        bucket, object_key("claim", host), got.body.replace(b'"c"', b'"z"'), metadata=got.metadata
    )
    out = await asyncio.to_thread(run_cli, ["audit", "--host", host], cli_env)
    assert out.returncode == 1
    assert f"ERROR claim {host}" in out.stdout and "changed outside the ledger" in out.stdout


async def test_audit_checks_the_protocol(
    cli_env: dict[str, str], parts: tuple[S3Store, NatsEventLog, str], unique: Callable[[str], str]
) -> None:
    """A claim that jumps from serving to landing (no move, no flip) breaks the protocol's tables."""
    host = f"{unique('jump')}.example.com"
    ledger = ledger_for(parts)
    assert isinstance(await create_host(ledger, host, box="ie-1", region="ie", incarnation="ab" * 32), Committed)

    def jump(cur: Claim | None) -> Claim:
        assert cur is not None
        return msgspec.structs.replace(cur, op=msgspec.structs.replace(cur.op, kind="landing"))

    assert isinstance(await ledger.transition("claim", host, "jump", jump), Committed)
    out = await asyncio.to_thread(run_cli, ["audit", "--host", host], cli_env)
    assert out.returncode == 1 and "[claim-kind]" in out.stdout, out.stdout
    history_only = await asyncio.to_thread(run_cli, ["audit", "--host", host, "--no-protocol"], cli_env)
    assert history_only.returncode == 0, history_only.stdout


async def test_missing_configuration_is_a_clear_refusal(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOSTMOVE_")}
    env["HOSTMOVE_ROOT"] = str(tmp_path / "nothing")
    out = await asyncio.to_thread(run_cli, ["audit"], env)
    assert out.returncode == 2
    assert "hostmove stack up" in out.stderr and "Traceback" not in out.stderr


async def wait_until(check: Callable[[], object], deadline_s: float = 30.0) -> object:
    end = time.monotonic() + deadline_s
    while True:
        value = await check() if asyncio.iscoroutinefunction(check) else check()  # type: ignore[misc]
        if value:
            return value
        if time.monotonic() > end:
            raise AssertionError("condition not met before the deadline")
        await asyncio.sleep(0.1)


def service_output(tmp_path: Path, name: str) -> IO[bytes]:
    """A file for a service's output: a pipe nobody reads fills up and blocks the service in its next log line."""
    return (tmp_path / f"{name}.out").open("w+b")


def read_output(out: IO[bytes]) -> str:
    out.flush()
    return (Path(out.name).read_text(errors="replace"))[-4000:]


async def test_serve_relay_publishes_a_crashed_writers_event(
    cli_env: dict[str, str], parts: tuple[S3Store, NatsEventLog, str], unique: Callable[[str], str], tmp_path: Path
) -> None:
    host = f"{unique('relay')}.example.com"
    _, events, _ = parts

    def crash(point: str) -> None:
        if point == "after_cas":
            raise Crash(point)

    with pytest.raises(Crash):
        await ledger_for(parts, crash).transition("claim", host, "created", serving("a"))
    assert await events.last(LEDGER_STREAM, ledger_subject("claim", host)) is None
    out = service_output(tmp_path, "relay")
    proc = subprocess.Popen(HOSTMOVE + ["serve", "relay"], env=cli_env, stdout=out, stderr=subprocess.STDOUT)
    try:

        async def relayed() -> bool:
            return await events.last(LEDGER_STREAM, ledger_subject("claim", host)) is not None

        await wait_until(relayed)
    finally:
        proc.send_signal(signal.SIGTERM)
        rc = await asyncio.to_thread(proc.wait, 30)
    assert rc == 0, read_output(out)


async def test_serve_projections_answers_the_read_api(
    cli_env: dict[str, str], parts: tuple[S3Store, NatsEventLog, str], unique: Callable[[str], str], tmp_path: Path
) -> None:
    host = f"{unique('proj')}.example.com"
    await ledger_for(parts).transition("claim", host, "created", serving("a"))
    port = free_port()
    out = service_output(tmp_path, "projections")
    proc = subprocess.Popen(HOSTMOVE + ["serve", "projections", "--port", str(port)], env=cli_env, stdout=out,
                            stderr=subprocess.STDOUT)

    def fetch(path: str) -> dict | None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as resp:
                return json.loads(resp.read())
        except OSError:
            return None

    try:

        def has_host() -> bool:
            body = fetch("/v1/hosts")
            return bool(body) and any(h["host"] == host for h in body["hosts"])  # type: ignore[index]

        end = time.monotonic() + 90  # a loaded machine starts a service (credentials, probe, health) slowly
        while not await asyncio.to_thread(has_host):
            assert time.monotonic() < end, "host never reached the projection\n" + read_output(out)
            assert proc.poll() is None, read_output(out)
            await asyncio.sleep(0.2)
        doc = await asyncio.to_thread(fetch, "/openapi.json")
        assert doc is not None and doc["openapi"].startswith("3.")
    finally:
        proc.send_signal(signal.SIGTERM)
        rc = await asyncio.to_thread(proc.wait, 30)
    assert rc == 0, read_output(out)


async def test_serve_door_requires_tokens_and_hides_everything_without_one(
    cli_env: dict[str, str], parts: object, tmp_path: Path
) -> None:
    env = {k: v for k, v in cli_env.items() if not k.startswith("HOSTMOVE_OPERATOR")}
    out = await asyncio.to_thread(run_cli, ["serve", "door", "--port", str(free_port())], env)
    assert out.returncode == 2 and "token" in (out.stdout + out.stderr).lower()
    import hashlib

    token = "s3cret-operator-token"
    env["HOSTMOVE_OPERATOR_TOKENS"] = "ops=" + hashlib.sha256(token.encode()).hexdigest()
    port = free_port()
    out = service_output(tmp_path, "door")
    proc = subprocess.Popen(HOSTMOVE + ["serve", "door", "--port", str(port)], env=env, stdout=out,
                            stderr=subprocess.STDOUT)

    def post(path: str, auth: str | None) -> tuple[int, bytes]:
        req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=b'{"to":"uk"}', method="POST")
        if auth:
            req.add_header("Authorization", auth)
        try:
            with urllib.request.urlopen(req, timeout=2) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as err:
            return err.code, err.read()
        except OSError:
            return 0, b""

    try:
        end = time.monotonic() + 30
        while (await asyncio.to_thread(post, "/v1/hosts/a.example.com/move", None))[0] == 0:
            assert time.monotonic() < end and proc.poll() is None, "door never answered"
            await asyncio.sleep(0.2)
        anon = await asyncio.to_thread(post, "/v1/hosts/a.example.com/move", None)
        wrong = await asyncio.to_thread(post, "/v1/hosts/b.example.com/move", "Bearer nope")
        assert anon[0] == wrong[0] == 404 and anon[1] == wrong[1], "a refusal that reveals nothing"
        authed = await asyncio.to_thread(post, "/v1/hosts/a.example.com/move", f"Bearer {token}")
        assert authed[0] == 404 and authed[1] != anon[1], "an operator learns the host does not exist"
    finally:
        proc.send_signal(signal.SIGTERM)
        rc = await asyncio.to_thread(proc.wait, 30)
        out.flush()
        logs = Path(out.name).read_text(errors="replace")
    assert rc == 0 and "door: operator API on" in logs and token not in logs


# -- the small truths (issue 11 item 6): one exit-code table, outages, stack status, an audit of nothing ----------


def test_the_exit_code_table_is_one_in_help_move_help_and_the_readme() -> None:
    from hostmove import exitcodes, move_cli
    from hostmove.cli import build_parser

    table = exitcodes.table_text()
    assert table in build_parser().format_help()
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert exitcodes.table_markdown() in readme, "README.md's exit-code table is hostmove/exitcodes.py's"
    assert [c.code for c in exitcodes.TABLE] == sorted({c.code for c in exitcodes.TABLE}), "each code once"
    assert (move_cli.EXIT_DONE, move_cli.EXIT_ROLLED_BACK, move_cli.EXIT_WAITING, move_cli.EXIT_REFUSED) == (
        0, 3, 4, 5), "§12's codes"
    out = run_cli(["move", "--help"], dict(os.environ))
    assert out.returncode == 0 and "exit codes (the same in every subcommand)" in out.stdout
    assert "6  unavailable" in out.stdout


def test_stack_status_exits_0_when_healthy_and_6_naming_what_is_down(stack: StackInfo, tmp_path: Path) -> None:
    from hostmove.stack import stack_problems

    if stack.mode == "local" and stack.root:
        out = run_cli(["--root", stack.root, "stack", "status"], dict(os.environ))
        assert out.returncode == 0, out.stdout + out.stderr
        assert json.loads(out.stdout)["running"] is True and not out.stderr
    out = run_cli(["--root", str(tmp_path / "none"), "stack", "status"], dict(os.environ))
    assert out.returncode == 6 and f"no stack runs under {tmp_path / 'none'}" in out.stderr
    half = {"root": "/r", "running": False,
            "nats": {"pid": 7, "alive": False, "healthy": False, "monitor_url": "http://127.0.0.1:1"},
            "s3": {"pid": 8, "alive": True, "healthy": False, "endpoint": "http://127.0.0.1:2"}}
    assert stack_problems(half) == [
        "NATS JetStream (pid 7) is not running: `hostmove stack up` starts the stack again",
        "SeaweedFS S3 (pid 8) runs but fails its health check (http://127.0.0.1:2/healthz)",
    ]
    assert stack_problems(half | {"running": True}) == []


async def test_audit_of_a_host_without_events_says_so_and_fails(
    cli_env: dict[str, str], parts: object, unique: Callable[[str], str]
) -> None:
    host = f"{unique('nobody')}.example.com"
    out = await asyncio.to_thread(run_cli, ["audit", "--host", host], cli_env)
    assert out.returncode == 1, out.stdout + out.stderr
    assert (f"audit of host {host}: no events on the ledger stream and no claim or record in the store: {host} is "
            "not a host of this deployment") in out.stderr


async def test_an_outage_of_nats_or_the_store_is_exit_6_naming_it(cli_env: dict[str, str], parts: object) -> None:
    closed = free_port()  # nothing listens there
    no_nats = cli_env | {"HOSTMOVE_NATS_URL": f"nats://127.0.0.1:{closed}"}
    out = await asyncio.to_thread(run_cli, ["audit", "--host", "h.example.com"], no_nats)
    assert out.returncode == 6, out.stderr
    assert out.stderr.startswith(f"hostmove: NATS at nats://127.0.0.1:{closed} is unavailable (")
    assert "Traceback" not in out.stderr and "refused" not in out.stderr.split("(")[0]
    no_s3 = cli_env | {"HOSTMOVE_S3_ENDPOINT": f"http://127.0.0.1:{closed}"}
    for argv in (["audit", "--host", "h.example.com"], ["audit"], ["probe"], ["host", "create", "h.example.com",
                                                                              "--box", "ie-1"]):
        out = await asyncio.to_thread(run_cli, argv, no_s3)
        assert out.returncode == 6, (argv, out.stdout, out.stderr)
        assert f"hostmove: the object store at http://127.0.0.1:{closed} is unavailable (" in out.stderr, argv
        assert "Traceback" not in out.stderr and cli_env["HOSTMOVE_S3_SECRET_KEY"] not in out.stderr


def test_a_failed_probe_is_7_when_the_store_answers_and_6_when_it_does_not(
    cli_env: dict[str, str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import argparse

    from hostmove.cli import _outage
    from services.objstore.probe import PROBE_EXIT_CODE

    for key, value in cli_env.items():
        monkeypatch.setenv(key, value)
    args = argparse.Namespace(root=cli_env["HOSTMOVE_ROOT"], command="probe")
    assert _outage(SystemExit(PROBE_EXIT_CODE), args) == 7
    assert "answered but failed the conformance probe" in capsys.readouterr().err
    monkeypatch.setenv("HOSTMOVE_S3_ENDPOINT", f"http://127.0.0.1:{free_port()}")
    assert _outage(SystemExit(PROBE_EXIT_CODE), args) == 6
    assert "is unavailable (" in capsys.readouterr().err
    assert _outage(SystemExit(1), args) is None and _outage(ValueError("x"), args) is None, "not a dependency's"


async def test_a_box_whose_agent_does_not_answer_is_an_outage(cli_env: dict[str, str], parts: object,
                                                              unique: Callable[[str], str]) -> None:
    label = unique("noagent")
    out = await asyncio.to_thread(run_cli, ["box", "wake", "h.example.com", "--label", label], cli_env)
    assert out.returncode == 6, out.stdout + out.stderr
    assert f"box {label}'s agent did not answer" in out.stderr
