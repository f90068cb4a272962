"""Sleeping hosts on the real stack (issue 5 item 4 "hosts created, woken, writing, sleeping";
:mod:`services.box.instance.sleep`): ``hostmove serve box`` processes with ``HOSTMOVE_IDLE_S`` set, moveprobe instances.

An idle instance is stopped cleanly (a clean-close certificate), its box's edge table forgets it, the claim does not
change, and a restarted agent leaves it asleep; a router's request (``hostmove box wake``) wakes it with every
acknowledged write and no declared loss; a due timer wakes it without any request."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
import pytest_asyncio

from bus.nats_log import NatsEventLog
from events.claim import Claim
from events.ids import new_incarnation
from hostmove.probe_apps import post_write
from hostmove.procs import service_env
from hostmove.rehearsal import timers_once
from hostmove.stackinfo import StackInfo
from kernel.ports import SystemRandom
from moveprobe.acks import RowAck, missing_from_db, read_acks
from services.agent.service import FAST_AGENT, PRODUCTION_AGENT, idle_override, read_endpoint
from services.box.instance.activator import certificate_key
from services.box.instance.sandbox import instance_dir
from services.box.instance.sleep import Activity, SleepMarks, idle_left
from services.hosts.create import create_host
from services.ledger import Committed
from services.objstore.port import Got
from services.objstore.s3 import S3Store
from tests.helpers.agents import AgentWorld, agent_world, answers_ready, data_buckets, eventually

HOSTMOVE = [sys.executable, "-m", "hostmove.cli"]
IDLE_S = "2"
QUIET = {"HOSTMOVE_IDLE_S": IDLE_S, "MOVEPROBE_SCHEDULE_EVERY_S": "3600", "MOVEPROBE_ONCE_AFTER_S": "3600"}
"""Instances that write only when asked and have no timer due within the test: idle after ``IDLE_S``."""


@pytest_asyncio.fixture(loop_scope="session", scope="module")
async def shared(stack: StackInfo, unique: Callable[[str], str]) -> AsyncIterator[tuple[S3Store, NatsEventLog, str]]:
    async with data_buckets(stack, unique, "slp") as s:
        yield s


async def claim_of(w: AgentWorld, host: str) -> Claim:
    claim = (await w.ledger.read_claim(host)).state
    assert claim is not None and claim.holder is not None
    return claim


async def served(w: AgentWorld, host: str, newer_than: int | None = None) -> int:
    async def check() -> int | None:
        port = read_endpoint(w.box_dir("ie"), host, newer_than=newer_than)
        return port if port is not None and await asyncio.to_thread(answers_ready, port) else None

    return await eventually(check, f"{host} served on {w.labels['ie']}", 60)  # a cold wake on a loaded machine


async def asleep(w: AgentWorld, host: str, port: int) -> None:
    """The instance stopped on its own and its box marks it asleep; the edge table no longer names it."""
    marks = SleepMarks(w.box_dir("ie"))

    async def check() -> bool:
        return (marks.asleep(host) and read_endpoint(w.box_dir("ie"), host) is None
                and not await asyncio.to_thread(answers_ready, port))

    await eventually(check, f"{host} to fall asleep after {IDLE_S} s idle", 30)


async def create(w: AgentWorld, host: str) -> int:
    created = await create_host(w.ledger, host, box=w.labels["ie"], region="ie",
                                incarnation=new_incarnation(SystemRandom()))
    assert isinstance(created, Committed), created
    return await served(w, host)


@pytest.mark.asyncio(loop_scope="session")
async def test_an_idle_host_sleeps_and_a_request_wakes_it(stack: StackInfo, unique: Callable[[str], str],
                                                          shared: tuple[S3Store, NatsEventLog, str],
                                                          tmp_path: Path) -> None:
    store, events, prefix = shared
    async with agent_world(stack, unique, tmp_path, prefix, store=store, events=events, app_env=QUIET) as w:
        host = f"{unique('nap')}.example.com"
        port = await create(w, host)
        seqs = [await asyncio.to_thread(post_write, port, f"v{i}") for i in range(5)]
        awake = await claim_of(w, host)
        assert awake.holder is not None
        await asleep(w, host, port)

        slept = await claim_of(w, host)
        assert slept.holder == awake.holder and slept.op == awake.op, "an idle stop changes nothing in the claim"
        cert = await store.get(f"{prefix}-ie", certificate_key(awake.holder.location, awake.holder.generation,
                                                              awake.holder.session))
        assert isinstance(cert, Got), "the idle stop shipped every frame and certified its session"

        agent = w.agents["ie"]  # a new agent process does not wake what slept
        assert agent.proc is not None
        banners = agent.output().count("agent running")
        os.kill(agent.proc.pid, 9)
        agent.proc.wait()
        agent.start()

        async def restarted() -> bool:
            return await asyncio.to_thread(lambda: agent.output().count("agent running") > banners)

        await eventually(restarted, "the restarted agent's banner", 30)
        watch_until = time.monotonic() + 3.0  # three scans of the fast profile
        while time.monotonic() < watch_until:
            assert SleepMarks(w.box_dir("ie")).asleep(host) and read_endpoint(w.box_dir("ie"), host) is None
            assert (await claim_of(w, host)).holder == awake.holder, "the restarted agent woke a sleeping host"
            await asyncio.sleep(0.2)

        env = service_env(stack, root=w.root, bucket=w.deploy, extra={"HOSTMOVE_DATA_BUCKET_PREFIX": prefix})
        woke = await asyncio.to_thread(subprocess.run, [*HOSTMOVE, "box", "wake", host, "--label", w.labels["ie"]],
                                       env=env, capture_output=True, text=True, timeout=90)
        assert woke.returncode == 0, woke.stderr
        assert "is served on box" in woke.stdout, woke.stdout
        after = await claim_of(w, host)
        assert after.holder is not None and after.holder.session > awake.holder.session
        admission = after.holder.admissions[-1]
        assert admission.writes_lost is None, "the certified idle stop declares no loss"
        new_port = await served(w, host, newer_than=awake.holder.session)
        acks = [a for a in read_acks(w.acks(host)) if isinstance(a, RowAck)]
        assert [a.seq for a in acks] == seqs
        assert missing_from_db(instance_dir(w.box_dir("ie") / "data", host) / f"{host}.db", list(acks)) == []
        assert await asyncio.to_thread(post_write, new_port, "after the nap") > seqs[-1]


@pytest.mark.asyncio(loop_scope="session")
async def test_a_due_timer_wakes_a_sleeping_host(stack: StackInfo, unique: Callable[[str], str],
                                                 shared: tuple[S3Store, NatsEventLog, str], tmp_path: Path) -> None:
    store, events, prefix = shared
    app = {**QUIET, "HOSTMOVE_IDLE_S": "3", "MOVEPROBE_SCHEDULE_EVERY_S": "8"}
    async with agent_world(stack, unique, tmp_path, prefix, store=store, events=events, app_env=app) as w:
        host = f"{unique('tick')}.example.com"
        port = await create(w, host)
        await asleep(w, host, port)
        slept = await claim_of(w, host)
        assert slept.holder is not None
        session = slept.holder.session
        fell_asleep_ms = int(time.time() * 1000)

        async def woken_and_ran() -> int | None:  # no request: only the schedule's next due time wakes it
            claim = await claim_of(w, host)
            port = read_endpoint(w.box_dir("ie"), host, newer_than=session)
            if port is None or claim.holder is None or claim.holder.session <= session:
                return None
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/timers/runs", timeout=2) as resp:
                    runs = json.load(resp).get("runs", [])
            except OSError:
                return None
            late = [r for r in runs if r.get("name") == "periodic" and int(r.get("due_at_ms") or 0) > fell_asleep_ms]
            return port if late else None

        port = await eventually(woken_and_ran, "the schedule's due time to wake the sleeping host and run", 45)
        check = await asyncio.to_thread(timers_once, port, cut_at_ms=None, now_ms=int(time.time() * 1000),
                                        once_due_ms=None)
        assert check.ok, check.line()


def test_the_idle_setting_is_a_positive_number_of_seconds_or_never() -> None:
    assert idle_override(FAST_AGENT, None) == FAST_AGENT and idle_override(FAST_AGENT, " ") == FAST_AGENT
    assert idle_override(PRODUCTION_AGENT, "never").idle_s is None
    assert idle_override(FAST_AGENT, "2.5").idle_s == 2.5
    for bad in ("0", "-3", "soon", "inf", "nan"):
        with pytest.raises(ValueError, match="HOSTMOVE_IDLE_S must be a positive number of seconds or 'never'"):
            idle_override(FAST_AGENT, bad)


def test_a_replica_that_moved_is_activity_and_idleness_counts_from_it() -> None:
    seen = Activity(at_s=100.0, position=7)
    seen.observe(150.0, 7)
    assert seen.at_s == 100.0 and idle_left(150.0, seen.at_s, 60.0) == 10.0
    seen.observe(170.0, 9)  # the app committed since the last look
    assert seen.at_s == 170.0 and idle_left(200.0, seen.at_s, 60.0) == 30.0
    assert idle_left(300.0, seen.at_s, 60.0) == 0.0


def test_asleep_marks_survive_a_reopen_and_name_their_hosts(tmp_path: Path) -> None:
    marks = SleepMarks(tmp_path)
    assert marks.hosts() == [] and not marks.clear("a.example.com")
    marks.mark("a.example.com", session=3, at_ms=1)
    marks.mark("b/odd name", session=4, at_ms=2)
    again = SleepMarks(tmp_path)
    assert again.asleep("a.example.com") and again.hosts() == ["a.example.com", "b/odd name"]
    assert again.clear("b/odd name") and not again.asleep("b/odd name")

