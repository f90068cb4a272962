"""An instance holds none of the platform's secrets and none of another instance's (issue 14 item 4 and its gap
"one OS user per instance"), on the real stack with box agents as processes: its environment is its release's (no
``HOSTMOVE_`` variable, no S3 or NATS setting), each host runs as a uid of its own in its own 0700 directory, and the
kernel refuses each instance the other's database and directory, the box's key files and the box's table of users;
a move lands the host on the other box under a user of its own there, and the move back does the same."""

from __future__ import annotations

import asyncio
import os
import stat
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
import pytest_asyncio

from bus.nats_log import NatsEventLog
from events.ids import new_incarnation
from hostmove.access import box_role, credentials_dir
from hostmove.stackinfo import StackInfo
from kernel.credentials import role_file
from kernel.ports import SystemRandom, WallClock
from services.agent.service import read_endpoint
from services.box.instance.sandbox import (
    UID_BASE,
    UID_SPAN,
    USERS_FILE,
    InstanceUser,
    InstanceUsers,
    choose_uid,
    drop_argv,
    first_uid,
    instance_dir,
    instance_env,
)
from services.box.roster import deployment_key_path
from services.door.api import Door
from services.door.auth import Identity
from services.door.decide import MoveRequest
from services.hosts.create import create_host
from services.ledger import Committed
from services.objstore.s3 import S3Store
from tests.helpers.agents import AgentWorld, agent_world, answers_ready, data_buckets, eventually

QUIET = {"MOVEPROBE_INTERVAL_S": "0.5", "MOVEPROBE_SCHEDULE_EVERY_S": "3600", "MOVEPROBE_ONCE_AFTER_S": "3600"}
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="instances run as their own users only under a root agent")


def test_an_instance_environment_is_its_release_s_only() -> None:
    env = instance_env({"APP": "1", "HOSTMOVE_S3_SECRET_KEY": "s", "AWS_SECRET_ACCESS_KEY": "s", "NATS_URL": "n"},
                       home="/data/h")
    assert env == {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": "/data/h", "APP": "1"}


def test_a_box_never_gives_one_uid_to_two_of_its_hosts(tmp_path: Path) -> None:
    a = first_uid("a.example.com")
    assert UID_BASE <= a < UID_BASE + UID_SPAN and first_uid("a.example.com") == a
    assert choose_uid("b.example.com", {"a.example.com": first_uid("b.example.com")}) == first_uid("b.example.com") + 1
    assert choose_uid("a.example.com", {"a.example.com": 7}) == 7, "a host keeps the uid its box gave it"
    top = UID_BASE + UID_SPAN - 1
    assert choose_uid("z", {}, in_use=range(first_uid("z"), top + 1)) == UID_BASE, "the range wraps"
    users = InstanceUsers(tmp_path)
    one = users.user("a.example.com")
    assert users.user("a.example.com") == one and InstanceUsers(tmp_path).user("a.example.com") == one
    assert stat.S_IMODE((tmp_path / USERS_FILE).stat().st_mode) == 0o600
    (tmp_path / "i").mkdir()
    (tmp_path / "i" / "left.txt").write_text("x")
    os.chown(tmp_path / "i" / "left.txt", one.uid, one.gid)
    users.release("a.example.com", tmp_path / "i")
    assert (tmp_path / "i" / "left.txt").stat().st_uid == 0 and stat.S_IMODE((tmp_path / "i").stat().st_mode) == 0o700
    assert "a.example.com" not in (tmp_path / USERS_FILE).read_text()


@pytest_asyncio.fixture(loop_scope="session", scope="module")
async def shared(stack: StackInfo, unique: Callable[[str], str]) -> AsyncIterator[tuple[S3Store, NatsEventLog, str]]:
    async with data_buckets(stack, unique, "sbx") as s:
        yield s


def _as(uid: int, code: str) -> subprocess.CompletedProcess[bytes]:
    """``code`` run by a process with ``uid`` and its group only: what the kernel lets that instance do."""
    argv = drop_argv(InstanceUser(f"uid {uid}", uid, uid), [sys.executable, "-I", "-S"])
    return subprocess.run([*argv, "-c", code], capture_output=True, timeout=30)


def _refused(uid: int, code: str) -> bool:
    done = _as(uid, code)
    return done.returncode != 0 and b"PermissionError" in done.stderr


def _uids(w: AgentWorld, region: str, host: str) -> set[int]:
    pids = w.tree(w.labels[region]).members(host)
    assert pids, f"{host} runs in its leaf on {w.labels[region]}"
    out = set()
    for pid in pids:
        status = Path(f"/proc/{pid}/status").read_text().splitlines()
        out |= {int(u) for u in next(line for line in status if line.startswith("Uid:")).split()[1:]}
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        names = {e.split(b"=", 1)[0].decode() for e in environ if e}
        assert not {n for n in names if n.startswith(("HOSTMOVE_", "AWS_", "NATS_"))}, names
        assert "MOVEPROBE_HOST" in names
    return out


async def _served(w: AgentWorld, region: str, host: str) -> int:
    async def check() -> int | None:
        port = read_endpoint(w.box_dir(region), host)
        return port if port is not None and await asyncio.to_thread(answers_ready, port) else None

    try:
        return await eventually(check, f"{host} served on {w.labels[region]}", 60)
    except AssertionError:
        errs = "\n".join(p.read_text()[-1500:] for p in (w.box_dir(region) / "logs").glob("*.err"))
        raise AssertionError(errs + "\n" + "\n".join(a.output()[-3000:] for a in w.agents.values())) from None


async def _move(w: AgentWorld, host: str, to: str) -> None:
    door = Door(w.ledger, clock=WallClock(), rng=SystemRandom())
    answer = await door.request_move(host, MoveRequest(to, "auto"), Identity("op", "operator"))
    assert answer.status in (200, 201), answer.body
    move_id = str(answer.body["move"]["id"])

    async def done() -> bool:
        record = (await w.ledger.read_record(host)).state
        return (record is not None and record.move is None and record.last_move is not None
                and record.last_move.id == move_id and record.last_move.outcome == "done")

    try:
        await eventually(done, f"the move of {host} to {to}", 90)
    except AssertionError:
        raise AssertionError("\n".join(a.output()[-3000:] for a in w.agents.values())) from None


def _one_instance_cannot_reach_the_other(w: AgentWorld, region: str, me: str, uid: int, other: str) -> None:
    """The kernel refuses ``me``'s user the other host's database, files and directory, the box's key files, its
    table of users and its listings; its own database it opens."""
    data = w.box_dir(region) / "data"
    mine, theirs = instance_dir(data, me), instance_dir(data, other)
    box_key, users = w.box_dir(region) / "secrets.pem", w.box_dir(region) / USERS_FILE
    assert _as(uid, f"open({str(mine / f'{me}.db')!r}, 'r+b').read(16)").returncode == 0, "its own database"
    for what, code in {
        "the other's database": f"open({str(theirs / f'{other}.db')!r}, 'rb')",
        "the other's key file": f"open({str(theirs / other / 'instance.key')!r}, 'rb')",
        "a listing of the other's directory": f"import os; os.listdir({str(theirs)!r})",
        "a file in the other's directory": f"open({str(theirs / 'planted')!r}, 'wb')",
        "the box's key file": f"open({str(box_key)!r}, 'rb')",
        "the deployment's key": f"open({str(deployment_key_path(w.root))!r}, 'rb')",
        "the box's table of users": f"open({str(users)!r}, 'rb')",
        "the box agent's credentials": f"open({str(role_file(credentials_dir(w.root), box_role(w.labels[region])))!r})",
        "a listing of the data directory": f"import os; os.listdir({str(data)!r})",
        "a listing of the instances": f"import os; os.listdir({str(data / 'instances')!r})",
        "a listing of the box": f"import os; os.listdir({str(w.box_dir(region))!r})",
        "a file beside the databases": f"open({str(data / 'instances' / 'planted.db')!r}, 'wb')",
    }.items():
        assert _refused(uid, code), f"{me} ({uid}) was not refused {what} of {other}"
    st = mine.stat()
    assert st.st_uid == uid and stat.S_IMODE(st.st_mode) == 0o700, f"{mine} is {me}'s own, 0700"
    assert (mine / f"{me}.db").stat().st_uid == uid
    assert stat.S_IMODE(data.stat().st_mode) == 0o711 and data.stat().st_uid == 0
    assert role_file(credentials_dir(w.root), box_role(w.labels[region])).is_file(), "the agent's own credentials"


async def test_each_instance_runs_as_its_own_user_and_a_move_lands_it_under_one_of_its_own(
        stack: StackInfo, unique: Callable[[str], str], tmp_path: Path,
        shared: tuple[S3Store, NatsEventLog, str]) -> None:
    store, events, prefix = shared
    async with agent_world(stack, unique, tmp_path, prefix, store=store, events=events, app_env=QUIET) as w:
        a, b = f"{unique('sbxa')}.example.com", f"{unique('sbxb')}.example.com"
        for host in (a, b):
            created = await create_host(w.ledger, host, box=w.labels["ie"], region="ie",
                                        incarnation=new_incarnation(SystemRandom()))
            assert isinstance(created, Committed)
        await asyncio.gather(_served(w, "ie", a), _served(w, "ie", b))
        (ua,), (ub,) = _uids(w, "ie", a), _uids(w, "ie", b)
        assert ua != ub and 0 not in (ua, ub), "each host runs as a user of its own"
        assert all(UID_BASE <= u < UID_BASE + UID_SPAN for u in (ua, ub))
        _one_instance_cannot_reach_the_other(w, "ie", a, ua, b)
        _one_instance_cannot_reach_the_other(w, "ie", b, ub, a)

        await _move(w, a, "uk")  # the landing hands the files to a user of a's own on uk
        await _served(w, "uk", a)
        (ua_uk,) = _uids(w, "uk", a)
        assert ua_uk not in (0, ub)
        own = instance_dir(w.box_dir("uk") / "data", a)
        assert own.stat().st_uid == ua_uk and stat.S_IMODE(own.stat().st_mode) == 0o700
        assert (own / a).stat().st_uid == ua_uk and (own / a / "instance.key").stat().st_uid == ua_uk
        assert _refused(ua_uk, f"open({str(instance_dir(w.box_dir('ie') / 'data', b) / f'{b}.db')!r}, 'rb')")

        async def released() -> bool:  # the source parked a's files and gave its uid back
            return a not in (w.box_dir("ie") / USERS_FILE).read_text()

        await eventually(released, f"{a}'s user released on ie", 30)
        assert _uids(w, "ie", b) == {ub}, "b kept running as its own user"

        await _move(w, a, "ie")  # and back: a user of its own on ie again, never b's
        await _served(w, "ie", a)
        (ua_back,) = _uids(w, "ie", a)
        assert ua_back not in (0, ub)
        _one_instance_cannot_reach_the_other(w, "ie", a, ua_back, b)
        _one_instance_cannot_reach_the_other(w, "ie", b, ub, a)
