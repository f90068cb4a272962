"""An instance holds none of the platform's secrets (issue 14 item 4), on the real stack with box agents as processes:
its environment is its release's (no ``HOSTMOVE_`` variable, no S3 or NATS setting), it runs as the unprivileged
instance user, and that user can read neither the box's key file nor the deployment's."""

from __future__ import annotations

import asyncio
import os
import pwd
import stat
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest_asyncio

from bus.nats_log import NatsEventLog
from events.ids import new_incarnation
from hostmove.stackinfo import StackInfo
from kernel.ports import SystemRandom
from services.agent.service import read_endpoint
from services.box.instance.sandbox import INSTANCE_USER, drop_argv, ensure_instance_user, instance_env
from services.box.roster import deployment_key_path
from services.hosts.create import create_host
from services.ledger import Committed
from services.objstore.s3 import S3Store
from tests.helpers.agents import agent_world, answers_ready, data_buckets, eventually

QUIET = {"MOVEPROBE_INTERVAL_S": "0.5", "MOVEPROBE_SCHEDULE_EVERY_S": "3600", "MOVEPROBE_ONCE_AFTER_S": "3600"}


def test_an_instance_environment_is_its_release_s_only() -> None:
    env = instance_env({"APP": "1", "HOSTMOVE_S3_SECRET_KEY": "s", "AWS_SECRET_ACCESS_KEY": "s", "NATS_URL": "n"},
                       home="/data/h")
    assert env == {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": "/data/h", "APP": "1"}


@pytest_asyncio.fixture(loop_scope="session", scope="module")
async def shared(stack: StackInfo, unique: Callable[[str], str]) -> AsyncIterator[tuple[S3Store, NatsEventLog, str]]:
    async with data_buckets(stack, unique, "sbx") as s:
        yield s


def _can_read(user_argv: list[str], path: Path) -> bool:
    done = subprocess.run([*user_argv, "-c", f"open({str(path)!r}, 'rb').read()"], capture_output=True, timeout=30)
    return done.returncode == 0


async def test_an_instance_runs_as_the_instance_user_without_the_platform_s_secrets(
        stack: StackInfo, unique: Callable[[str], str], tmp_path: Path,
        shared: tuple[S3Store, NatsEventLog, str]) -> None:
    store, events, prefix = shared
    async with agent_world(stack, unique, tmp_path, prefix, store=store, events=events, app_env=QUIET) as w:
        host = f"{unique('sbx')}.example.com"
        created = await create_host(w.ledger, host, box=w.labels["ie"], region="ie",
                                    incarnation=new_incarnation(SystemRandom()))
        assert isinstance(created, Committed)

        async def served() -> int | None:
            port = read_endpoint(w.box_dir("ie"), host)
            return port if port is not None and await asyncio.to_thread(answers_ready, port) else None

        try:
            await eventually(served, f"{host} served", 30)
        except AssertionError:
            errs = "\n".join(p.read_text()[-1500:] for p in (w.box_dir("ie") / "logs").glob("*.err"))
            raise AssertionError(errs) from None
        user = pwd.getpwnam(INSTANCE_USER)
        pids = w.tree(w.labels["ie"]).members(host)
        assert pids, "the instance runs in its leaf"
        for pid in pids:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            names = {e.split(b"=", 1)[0].decode() for e in environ if e}
            assert not {n for n in names if n.startswith(("HOSTMOVE_", "AWS_", "NATS_"))}, names
            assert "MOVEPROBE_HOST" in names
            uids = next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                        if line.startswith("Uid:")).split()[1:]
            assert {int(u) for u in uids} == {user.pw_uid}, f"pid {pid} runs as {uids}"

        box_key = w.box_dir("ie") / "secrets.pem"
        for key in (box_key, deployment_key_path(w.root)):
            st = key.stat()
            assert st.st_uid == 0 and stat.S_IMODE(st.st_mode) == 0o600, key
        instance_user = ensure_instance_user()
        assert instance_user is not None
        as_instance = drop_argv(instance_user, [sys.executable, "-I", "-S"])
        data = w.box_dir("ie") / "data"
        assert _can_read(as_instance, data / f"{host}.db"), "its own database is the instance user's"
        assert not _can_read(as_instance, box_key) and not _can_read(as_instance, deployment_key_path(w.root))
        assert not os.access(w.box_dir("ie"), os.R_OK, effective_ids=False) or os.geteuid() == 0
        files = data / host
        assert files.stat().st_uid == user.pw_uid and stat.S_IMODE(files.stat().st_mode) == 0o700
        assert stat.S_IMODE(data.stat().st_mode) == 0o700 and data.stat().st_uid == user.pw_uid
        listing = subprocess.run([*as_instance, "-c", f"import os; os.listdir({str(w.box_dir('ie'))!r})"],
                                 capture_output=True, timeout=30)
        assert listing.returncode != 0, "the box's directory is searchable only, never listed"
