"""``hostmove token create`` and ``hostmove login`` (issue 20 item 4; spec §12) against a real door: its aiohttp
app on a loopback port over SeaweedFS and NATS, configured from the digest file ``token create`` wrote, and the CLI
run as the operator runs it (its own process, a config directory of the test's own).

The stored context is owner-only and refused when it is not; the environment overrides it setting by setting; a
stored token never goes to another door; no output holds the token but ``token create``'s one line.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import stat
import sys
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import pytest_asyncio
from aiohttp.test_utils import TestServer

from bus.nats_log import NatsEventLog
from events import Actor
from hostmove import exitcodes, move_cli
from hostmove.context import Context, ContextError, read_context, write_context
from hostmove.stackinfo import StackInfo
from kernel.ports import ManualClock, SystemRandom
from services.box.roster import init_box
from services.door.api import Door, make_app
from services.door.auth import ENV_OPERATOR_FILE, Identity, load_tokens
from services.ledger.ledger import Ledger
from services.objstore.s3 import S3Store


def clean_env(config: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOSTMOVE_")}
    return {**env, "XDG_CONFIG_HOME": str(config), **extra}


async def hostmove(argv: list[str], env: dict[str, str], stdin: str = "") -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "hostmove.cli", *argv, env=env,
                                                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(stdin.encode()), 60)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


@dataclass
class Rig:
    url: str
    host: str
    token: str
    tokens_file: Path
    config: Path


@pytest_asyncio.fixture(loop_scope="session")
async def rig(stack: StackInfo, unique: Callable[[str], str], tmp_path: Path) -> AsyncIterator[Rig]:
    config = tmp_path / "config"
    tokens_file = tmp_path / "door-tokens"
    code, out, err = await hostmove(["token", "create", "--role", "operator", "--label", "alice", "--digest-file",
                                     str(tokens_file)], clean_env(config))
    assert code == 0, err
    token = out.strip()
    assert len(out.splitlines()) == 1 and len(token) >= 40, "stdout is the token alone"
    assert token not in err and f"alice={hashlib.sha256(token.encode()).hexdigest()}" in err
    assert stat.S_IMODE(tokens_file.stat().st_mode) == 0o600

    store = await S3Store.open(stack.s3_endpoint, stack.s3_access_key, stack.s3_secret_key, stack.s3_region)
    events = await NatsEventLog.connect(stack.nats_url)
    bucket = unique("login")
    await store.create_bucket(bucket)
    clock = ManualClock()
    await init_box(root=tmp_path / "boxes", label="ie-1", region="ie", store=store, bucket=bucket, events=events,
                   clock=clock, actor=Actor(service="box-init", pid=1, nonce="n"))
    ledger = Ledger(store, events, clock, Actor(service="door", pid=1, nonce=uuid.uuid4().hex[:8]), bucket)
    door = Door(ledger, clock=clock, rng=SystemRandom())
    host = f"{unique('login')}.example.com"
    assert (await door.create(host, "ie-1", Identity("alice", "operator"))).status == 201
    server = TestServer(make_app(door, load_tokens({ENV_OPERATOR_FILE: str(tokens_file)})), host="127.0.0.1")
    await server.start_server()
    try:
        yield Rig(f"http://127.0.0.1:{server.port}", host, token, tokens_file, config)
    finally:
        await server.close()
        await store.delete_bucket(bucket)
        await events.close()
        await store.close()


async def test_token_create_then_login_then_a_command_with_no_token_in_the_environment(rig: Rig) -> None:
    env = clean_env(rig.config)
    code, out, err = await hostmove(["move", "status", "--host", rig.host], env)
    assert code == exitcodes.USAGE and "hostmove login --door URL" in err, "no login yet: it says what to run"

    code, out, err = await hostmove(["login", "--door", rig.url], env, stdin=rig.token + "\n")
    assert code == 0, err
    path = rig.config / "hostmove" / "context.json"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert rig.token not in out + err

    code, out, err = await hostmove(["move", "status", "--host", rig.host], env)
    assert code == 0, out + err
    assert rig.host in out and rig.token not in out + err

    wrong = clean_env(rig.config, HOSTMOVE_TOKEN="wrong-" + uuid.uuid4().hex)
    code, out, err = await hostmove(["move", "status", "--host", rig.host], wrong)
    assert code != 0, "the environment's token overrides the stored one (and the door does not know it)"


async def test_login_refuses_a_door_that_does_not_answer_and_a_bad_token(rig: Rig, tmp_path: Path) -> None:
    other = tmp_path / "other-config"
    code, _, err = await hostmove(["login", "--door", "http://127.0.0.1:9"], clean_env(other), stdin=rig.token)
    assert code == exitcodes.UNAVAILABLE and "unavailable" in err and rig.token not in err
    assert not (other / "hostmove").exists(), "nothing is stored for a door that did not answer"
    code, _, err = await hostmove(["login", "--door", rig.url], clean_env(other), stdin="two words\n")
    assert code == exitcodes.USAGE and "the token on stdin" in err
    code, _, err = await hostmove(["login", "--door", "ftp://door"], clean_env(other), stdin=rig.token)
    assert code == exitcodes.USAGE


def test_a_stored_login_readable_by_others_is_refused(tmp_path: Path) -> None:
    env = {"XDG_CONFIG_HOME": str(tmp_path)}
    path = write_context(env, Context("http://door.example:8081", "t0ken"))
    assert read_context(env) == Context("http://door.example:8081", "t0ken")
    assert "t0ken" not in repr(read_context(env))
    path.chmod(0o644)
    with pytest.raises(ContextError, match="readable by others"):
        read_context(env)
    with pytest.raises(move_cli.ConfigProblem, match="readable by others"):
        move_cli.load_config(env)


def test_the_environment_overrides_the_stored_login_and_its_token_stays_with_its_door(tmp_path: Path) -> None:
    env = {"XDG_CONFIG_HOME": str(tmp_path)}
    write_context(env, Context("http://door.example:8081", "stored-token"))
    assert move_cli.load_config(env) == move_cli.DoorConfig("http://door.example:8081", "stored-token")
    both = move_cli.load_config({**env, move_cli.ENV_URL: "http://other:1", move_cli.ENV_TOKEN: "env-token"})
    assert (both.url, both.token) == ("http://other:1", "env-token")
    assert move_cli.load_config({**env, move_cli.ENV_TOKEN: "env-token"}).token == "env-token"
    with pytest.raises(move_cli.ConfigProblem, match="hostmove login"):
        move_cli.load_config({**env, move_cli.ENV_URL: "http://other:1"})  # never the stored token to another door
    assert move_cli.load_config({"HOME": str(tmp_path / "nobody"), move_cli.ENV_TOKEN: "x"}).url == \
        move_cli.DEFAULT_URL, "no stored login: the default door"


async def test_token_create_refuses_a_label_the_door_would_refuse(tmp_path: Path) -> None:
    code, out, err = await hostmove(["token", "create", "--role", "status", "--label", "no spaces"],
                                    clean_env(tmp_path))
    assert code == exitcodes.USAGE and not out and "label" in err
    code, out, err = await hostmove(["token", "create", "--role", "status"], clean_env(tmp_path))
    assert code == 0 and "HOSTMOVE_STATUS_TOKENS" in err
    assert hashlib.sha256(out.strip().encode()).hexdigest() in err


def test_a_stored_token_is_redacted_from_every_log_line(tmp_path: Path) -> None:
    import logging

    from hostmove.logs import Redact

    env = {"XDG_CONFIG_HOME": str(tmp_path)}
    token = "stored-" + uuid.uuid4().hex
    write_context(env, Context("http://door.example:8081", token))
    assert move_cli.load_config(env).token == token
    record = logging.LogRecord("t", logging.INFO, __file__, 1, "sent %s", (token,), None)
    Redact().filter(record)
    assert token not in record.getMessage(), "the environment does not name it, the redaction still knows it"
