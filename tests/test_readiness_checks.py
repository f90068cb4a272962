"""The target's readiness report observes the target (issue 18 items 2 and 3; spec §7.3, §10, §11), on the real stack
with both box agents as processes:

- T2: a target box initialized with a secrets key that is not the deployment's (a rebuilt box given a key of its
  own) fails T2 with its sentence, never becomes ready; the move never cuts and aborts itself within its prepare
  bound with the reason the operator sees.
- T3: the target box's overlay sets a variable of the release to another value: T3 names the variable (never its
  value) until the overlay is fixed; then the move completes.
- T7: the release's command is not on the target box's PATH: T7 fails until it is; then the move completes.
- T1 at boot: a box below the deployment's protocol floor refuses at boot to take part in moves.
"""

from __future__ import annotations

import asyncio
import os
import stat
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import msgspec
import pytest
import pytest_asyncio

from bus.nats_log import NatsEventLog
from events import Actor
from events.ids import new_incarnation
from hostmove.move_cli import readiness_lines
from hostmove.rehearsal import last_move_state
from hostmove.stackinfo import StackInfo
from kernel.ports import SystemRandom, WallClock
from moveprobe import RELEASE_MANIFEST
from services.agent.service import read_endpoint
from services.apps.releases import load_manifest, publish
from services.box.artifacts.sealing import generate_private_key, save_private_key, secrets_key_fp
from services.box.roster import init_box, read_deployment_key, read_roster
from services.door.api import Door
from services.door.auth import Identity
from services.door.decide import Floor, MoveRequest
from services.hosts.create import create_host
from services.ledger import Committed
from services.objstore.s3 import S3Store
from services.target.readiness import TargetReport, report_key
from tests.helpers.agents import AgentWorld, agent_world, answers_ready, data_buckets, eventually

QUIET = {"MOVEPROBE_INTERVAL_S": "0.5", "MOVEPROBE_SCHEDULE_EVERY_S": "3600", "MOVEPROBE_ONCE_AFTER_S": "3600"}


@pytest_asyncio.fixture(loop_scope="session", scope="module")
async def shared(stack: StackInfo, unique: Callable[[str], str]) -> AsyncIterator[tuple[S3Store, NatsEventLog, str]]:
    async with data_buckets(stack, unique, "rdy") as s:
        yield s


async def create_on_ie(w: AgentWorld, host: str, app: object | None = None) -> None:
    created = await create_host(w.ledger, host, box=w.labels["ie"], region="ie",
                                incarnation=new_incarnation(SystemRandom()), app=app or w.app)  # type: ignore[arg-type]
    assert isinstance(created, Committed), created

    async def serving() -> int | None:
        port = read_endpoint(w.box_dir("ie"), host)
        return port if port is not None and await asyncio.to_thread(answers_ready, port) else None

    await eventually(serving, f"{host} served on ie", 60)


async def request(w: AgentWorld, host: str) -> str:
    door = Door(w.ledger, clock=WallClock(), rng=SystemRandom())
    answer = await door.request_move(host, MoveRequest("uk", "auto"), Identity("op", "operator"))
    assert answer.status in (200, 201), answer.body
    return str(answer.body["move"]["id"])


async def target_report(w: AgentWorld, host: str, move_id: str) -> TargetReport | None:
    got = await w.store.get(w.deploy, report_key(host, move_id))
    body = getattr(got, "body", None)
    return msgspec.json.decode(body, type=TargetReport) if body is not None else None


async def failing(w: AgentWorld, host: str, move_id: str, check: str, saying: str = "") -> str:
    """The detail of ``check`` once the target's report fails it (saying ``saying``)."""

    async def seen() -> str | None:
        report = await target_report(w, host, move_id)
        found = [c for c in report.checks if c.check == check and c.status == "fail" and saying in c.detail] \
            if report else []
        return found[0].detail if found else None

    return await eventually(seen, f"the target's report failing {check}", 60)


async def closed(w: AgentWorld, host: str, move_id: str, timeout_s: float = 90) -> str:
    async def done() -> str | None:
        record = (await w.ledger.read_record(host)).state
        claim = (await w.ledger.read_claim(host)).state
        if (record is not None and record.move is None and record.last_move is not None
                and record.last_move.id == move_id and claim is not None and claim.op.kind == "serving"):
            return record.last_move.outcome
        return None

    try:
        return await eventually(done, f"the move {move_id} to close", timeout_s)
    except AssertionError:
        logs = "\n".join(a.output()[-3000:] for a in w.agents.values())
        raise AssertionError(f"not closed: {(await w.ledger.read_record(host)).state}\n{logs}") from None


@pytest.mark.asyncio(loop_scope="session")
async def test_a_target_with_another_key_fails_t2_and_the_move_aborts_itself(
        stack: StackInfo, unique: Callable[[str], str], shared: tuple[S3Store, NatsEventLog, str],
        tmp_path: Path) -> None:
    store, events, prefix = shared
    async with agent_world(stack, unique, tmp_path, prefix, store=store, events=events, app_env=QUIET, start=False,
                           agent_env={"HOSTMOVE_PREPARE_BOUND_S": "20"}) as w:
        rebuilt = generate_private_key()  # the uk box is rebuilt, and initialized with a key of its own
        own = tmp_path / "uk-own.pem"
        save_private_key(rebuilt, own)
        (w.box_dir("uk") / "secrets.pem").unlink()
        await init_box(root=w.root, label=w.labels["uk"], region="uk", store=store, bucket=w.deploy, events=events,
                       clock=WallClock(), actor=Actor(service="test", pid=os.getpid(), nonce="rebuilt"),
                       secrets_key=own)
        roster, _ = await read_roster(store, w.deploy)
        assert roster is not None and roster.box(w.labels["uk"]).secrets_key_fp == secrets_key_fp(rebuilt)  # type: ignore[union-attr]
        for agent in w.agents.values():
            agent.start()
        host = f"{unique('key')}.example.com"
        await create_on_ie(w, host)
        move_id = await request(w, host)
        detail = await failing(w, host, move_id, "T2")
        console = await read_deployment_key(store, w.deploy)
        assert console is not None
        assert detail.startswith(f"{w.labels['uk']} holds the secrets key {secrets_key_fp(rebuilt)[:23]}..., not the "
                                 f"deployment's {console.fp[:23]}...; install the deployment's key"), detail
        t3 = await failing(w, host, move_id, "T3", saying="(T2)")
        assert "does not hold the deployment's secrets key (T2)" in t3, t3
        assert await closed(w, host, move_id, timeout_s=60) == "aborted"
        last = await last_move_state(events, host, move_id)
        assert last is not None and last.state == "aborted" and last.cut_phase == "" and last.cut_at is None, last
        assert "aborted itself" in last.reason and "T2" in last.reason and "not the deployment's" in last.reason, \
            last.reason
        claim = (await w.ledger.read_claim(host)).state
        assert claim is not None and claim.op.exec == w.labels["ie"], "the host serves where it was"


@pytest.mark.asyncio(loop_scope="session")
async def test_t3_names_a_variable_the_target_sets_otherwise_until_it_matches(
        stack: StackInfo, unique: Callable[[str], str], shared: tuple[S3Store, NatsEventLog, str],
        tmp_path: Path) -> None:
    store, events, prefix = shared
    async with agent_world(stack, unique, tmp_path, prefix, store=store, events=events,
                           app_env={**QUIET, "APP_MODE": "standard"}) as w:
        overlay = w.box_dir("uk") / "overlay.env"
        overlay.write_text("# uk's settings for every instance\nAPP_MODE=strict-and-secret\n")
        host = f"{unique('env')}.example.com"
        await create_on_ie(w, host)
        move_id = await request(w, host)
        detail = await failing(w, host, move_id, "T3", saying="differs")
        assert detail == "the launch environment differs from the source's in: APP_MODE", detail
        assert "strict-and-secret" not in detail and "standard" not in detail
        record = (await w.ledger.read_record(host)).state
        assert record is not None and record.move is not None and record.move.state == "preparing"
        door = Door(w.ledger, clock=WallClock(), rng=SystemRandom())  # what `hostmove move status --detail` shows
        status = await door.status(host, detail=True)
        lines = readiness_lines(status.body)
        assert any(line.startswith("  T3 fails: the launch environment differs") for line in lines), lines
        t11 = status.body["detail"]["readiness"]["t11"]
        assert t11["disk_write_mib_s"] > 0 and t11["regional_s3_mib_s"] > 0 and t11["cross_region_mib_s"] > 0
        assert (t11["cross_region_mib_s"], t11["regional_s3_mib_s"]) != (10, 250), "measured, not the example's"
        assert any(line.startswith("  T11 rates used (MiB/s): cross-region ") for line in lines), lines
        overlay.write_text("APP_MODE=standard\n")  # the operator fixes the box
        assert await closed(w, host, move_id) == "done"
        claim = (await w.ledger.read_claim(host)).state
        assert claim is not None and claim.op.exec == w.labels["uk"]


@pytest.mark.asyncio(loop_scope="session")
async def test_t7_fails_until_the_release_s_command_is_on_the_target(
        stack: StackInfo, unique: Callable[[str], str], shared: tuple[S3Store, NatsEventLog, str],
        tmp_path: Path) -> None:
    store, events, prefix = shared
    bins = {region: tmp_path / f"bin-{region}" for region in ("ie", "uk")}
    for d in bins.values():
        d.mkdir(mode=0o755)
    tool = "moveprobe-server"
    script = f"#!/bin/sh\nexec {sys.executable} -m moveprobe \"$@\"\n"

    def install(region: str) -> None:
        path = bins[region] / tool
        path.write_text(script)
        path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH | stat.S_IROTH)

    install("ie")
    path = os.environ.get("PATH", "")
    async with agent_world(stack, unique, tmp_path, prefix, store=store, events=events, app_env=QUIET,
                           start=False) as w:
        for region, agent in w.agents.items():
            agent.start({"PATH": f"{bins[region]}:{path}"})
        doc = RELEASE_MANIFEST.read_text().replace('command = ["{python}", "-m", "moveprobe"]', f'command = ["{tool}"]')
        manifest_path = tmp_path / "moveprobe-tool.toml"
        manifest_path.write_text(doc)
        manifest, files = load_manifest(manifest_path, name="moveprobe-tool", env=QUIET)
        release, ref = await publish(store, w.deploy, manifest, files, clock=WallClock())
        host = f"{unique('tool')}.example.com"
        await create_on_ie(w, host, app=ref)
        move_id = await request(w, host)
        detail = await failing(w, host, move_id, "T7")
        assert f"the command of {release.label}, {tool}, is not found on {w.labels['uk']}'s PATH" in detail, detail
        install("uk")  # the release's program reaches the target box
        assert await closed(w, host, move_id) == "done"
        report = await target_report(w, host, move_id)
        assert report is not None and report.ready


@pytest.mark.asyncio(loop_scope="session")
async def test_a_box_below_the_floor_refuses_moves_at_boot(
        stack: StackInfo, unique: Callable[[str], str], shared: tuple[S3Store, NatsEventLog, str],
        tmp_path: Path) -> None:
    store, events, prefix = shared
    floor = Floor(min=1, min_release="v99.0.0")
    async with agent_world(stack, unique, tmp_path, prefix, store=store, events=events, app_env=QUIET,
                           floor=floor) as w:
        agent = w.agents["uk"]

        async def exited() -> bool:
            return not agent.alive()

        await eventually(exited, "the uk agent refusing at boot", 30)
        assert agent.proc is not None and agent.proc.returncode == 2
        assert "refuses at boot to take part in moves: this box runs release v" in agent.output()
        assert "below the floor's v99.0.0" in agent.output()
