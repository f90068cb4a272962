"""Moves that repeat (issue 11 item 2), on the real stack: three boxes in three regions (three data buckets), each
run by its own agent process, one host moved on and back, its app writing throughout; the §14.4 checks after every
move and the audit clean at the end. A move off a box the host landed on must behave exactly like a move off the
box it was created on (a landed instance lived in the landing's own list, so the next move never found it ready).

- six moves ie -> uk -> us -> ie -> uk -> us -> ie, no agent restarted;
- three moves with the agent of the box the host landed on restarted between two of them;
- a rollback (the app fails its readiness in uk) returns the host to ie, and it then moves on to us and back.
"""

from __future__ import annotations

import asyncio
import contextlib
import urllib.error
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
import pytest_asyncio

from bus.nats_log import NatsEventLog
from events.claim import Claim
from events.ids import new_incarnation
from hostmove.probe_apps import post_write
from hostmove.rehearsal import ack_logs, checks
from hostmove.stackinfo import StackInfo
from kernel.ports import SystemRandom, WallClock
from services.agent.service import read_endpoint
from services.box.instance.coverage import MAX_ADMISSIONS
from services.box.instance.sandbox import instance_dir
from services.box.replica.layout import generation_prefixes
from services.door.api import Door
from services.door.auth import Identity
from services.door.decide import MoveRequest
from services.hosts.create import create_host
from services.ledger import Committed
from services.ledger.audit import run_audit
from services.objstore.s3 import S3Store
from tests.helpers.agents import AgentWorld, agent_world, answers_ready, data_buckets, eventually

REGIONS = ("ie", "uk", "us")
APP = {"MOVEPROBE_INTERVAL_S": "0.2", "MOVEPROBE_SCHEDULE_EVERY_S": "0.4", "MOVEPROBE_ONCE_AFTER_S": "4"}
ONCE_AFTER_MS = 4000


@pytest_asyncio.fixture(loop_scope="session", scope="module")
async def shared(stack: StackInfo, unique: Callable[[str], str]) -> AsyncIterator[tuple[S3Store, NatsEventLog, str]]:
    """The store, the event log and the prefix of the three regions' data buckets, for the whole module."""
    async with data_buckets(stack, unique, "rpt") as (store, events, prefix):
        await store.create_bucket(f"{prefix}-us", versioned=True)
        try:
            yield store, events, prefix
        finally:
            await store.delete_bucket(f"{prefix}-us")


def _world(stack: StackInfo, unique: Callable[[str], str], root: Path, shared: tuple[S3Store, NatsEventLog, str],
           app_env: dict[str, str] | None = None) -> contextlib.AbstractAsyncContextManager[AgentWorld]:
    store, events, prefix = shared
    return agent_world(stack, unique, root, prefix, store=store, events=events, app_env={**APP, **(app_env or {})},
                       labels={r: unique(r) for r in REGIONS})


async def serving_port(w: AgentWorld, region: str, host: str, timeout_s: float = 60.0) -> int:
    async def check() -> int | None:  # named in the box's edge table and answering its readiness path
        port = read_endpoint(w.box_dir(region), host)
        return port if port is not None and await asyncio.to_thread(answers_ready, port) else None

    return await eventually(check, f"{host} served on {w.labels[region]}", timeout_s)


class Writer:
    """The app's traffic: one write at a time to whichever box's edge table names the host, throughout the moves
    (a write refused or unanswered during a cut is retried, never counted: only the app's acknowledgements are)."""

    def __init__(self, w: AgentWorld, host: str) -> None:
        self.w, self.host, self.acked, self.stopped = w, host, 0, asyncio.Event()
        self.task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        n = 0
        while not self.stopped.is_set():
            for region in REGIONS:
                port = read_endpoint(self.w.box_dir(region), self.host)
                if port is None:
                    continue
                with contextlib.suppress(OSError, urllib.error.URLError, ValueError, KeyError):
                    await asyncio.to_thread(post_write, port, f"w{n}", timeout_s=2.0)
                    self.acked += 1
                    n += 1
            await asyncio.sleep(0.05)

    async def stop(self) -> int:
        self.stopped.set()
        await self.task
        return self.acked


async def move(w: AgentWorld, host: str, to: str, outcome: str = "done", timeout_s: float = 120.0) -> str:
    """Request a move of ``host`` to region ``to`` through the door and wait until it closed as ``outcome`` with the
    claim serving (on ``to`` when done)."""
    door = Door(w.ledger, clock=WallClock(), rng=SystemRandom())
    answer = await door.request_move(host, MoveRequest(to, "auto"), Identity("op", "operator"))
    assert answer.status in (200, 201), answer.body
    move_id = str(answer.body["move"]["id"])

    async def closed() -> bool:
        record = (await w.ledger.read_record(host)).state
        claim = (await w.ledger.read_claim(host)).state
        return (record is not None and record.move is None and record.last_move is not None
                and record.last_move.id == move_id and claim is not None and claim.op.kind == "serving")

    try:
        await eventually(closed, f"the move {move_id} of {host} to {to} to close", timeout_s)
    except AssertionError:
        record = (await w.ledger.read_record(host)).state
        logs = "\n".join(a.output()[-3000:] for a in w.agents.values())
        raise AssertionError(f"the move to {to} did not close; record {record}\n{logs}") from None
    record = (await w.ledger.read_record(host)).state
    claim = (await w.ledger.read_claim(host)).state
    assert record is not None and record.last_move is not None and record.last_move.outcome == outcome, record
    expected = to if outcome == "done" else None
    if expected is not None:
        assert claim is not None and claim.op.exec == w.labels[to], claim
    return move_id


async def served_after_move(w: AgentWorld, host: str, frm: str, to: str, visited: list[str]) -> None:
    """The §14.4 checks after a move from ``frm`` to ``to``: the key verifies, every timer ran once around the cut,
    no acknowledged write of any instance the host ever had is missing on ``to``, nothing of the host is left live
    in ``frm`` (its bucket and its box); ``to`` takes a write and ``frm`` names no instance."""
    port = await serving_port(w, to, host)
    assert await asyncio.to_thread(post_write, port, f"after the move to {to}") > 0
    later = {r: w.labels[r] for r in dict.fromkeys(visited)}
    shown = await checks(
        events=w.events, store=w.store, host=host, port=port,
        target_db=instance_dir(w.box_dir(to) / "data", host) / f"{host}.db",
        ack_logs=ack_logs(w.root / "acks", host, w.labels["ie"], later), left_bucket=f"{w.prefix}-{frm}",
        left_local=[instance_dir(w.box_dir(frm) / "data", host) / f"{host}.db",
                    instance_dir(w.box_dir(frm) / "data", host) / host],
        once_after_ms=ONCE_AFTER_MS, agent_logs=[a.log for a in w.agents.values()])
    assert all(c.ok for c in shown), f"{frm} -> {to}:\n" + "\n".join(c.line() for c in shown)
    assert read_endpoint(w.box_dir(frm), host) is None, f"{frm} still names an instance of {host}"


async def create(w: AgentWorld, host: str) -> None:
    created = await create_host(w.ledger, host, box=w.labels["ie"], region="ie",
                                incarnation=new_incarnation(SystemRandom()))
    assert isinstance(created, Committed), created
    await serving_port(w, "ie", host)


async def audit_clean(w: AgentWorld, host: str) -> None:
    await storage_settled(w, host)
    audit = await run_audit(w.events, w.ledger, host=host)
    assert audit.clean(strict=True), [f.line() for f in audit.findings]


async def storage_settled(w: AgentWorld, host: str) -> None:
    """Bounded storage after the moves (issue 16 item 2): every chore acknowledged, every admission covered (the
    commits' CoverRegionPredecessors, the publications, a return's birth under the target's park), at most eight
    records, and in the serving region's bucket no generation of the location but the current one holds anything."""
    async def settled() -> Claim | None:
        claim = (await w.ledger.read_claim(host)).state
        if claim is None or claim.holder is None or claim.obligations:
            return None
        return claim if all(a.covered for a in claim.holder.admissions) else None

    try:
        claim = await eventually(settled, f"the chores of {host} to finish and its admissions to be covered", 30)
    except AssertionError:
        raise AssertionError(f"not settled: {(await w.ledger.read_claim(host)).state}") from None
    assert claim.holder is not None and len(claim.holder.admissions) <= MAX_ADMISSIONS
    region = next(r for r, label in w.labels.items() if label == claim.op.exec)
    location = claim.holder.location.rstrip("/") + "/"
    keys = await w.store.list_keys(f"{w.prefix}-{region}", location)
    current = generation_prefixes(location, claim.holder.generation)
    stray = [k for k in keys if not k.startswith(current) and not k.endswith(("generation.json", "lock.json"))]
    assert stray == [], f"objects of dead generations left in {region}: {stray[:5]}"


@pytest.mark.asyncio(loop_scope="session")
async def test_a_host_moves_six_times_across_three_regions(stack: StackInfo, unique: Callable[[str], str],
                                                           shared: tuple[S3Store, NatsEventLog, str],
                                                           tmp_path: Path) -> None:
    async with _world(stack, unique, tmp_path, shared) as w:
        host = f"{unique('six')}.example.com"
        await create(w, host)
        writer = Writer(w, host)
        here, visited = "ie", []
        for to in ("uk", "us", "ie", "uk", "us", "ie"):
            await move(w, host, to)
            visited.append(to)
            await served_after_move(w, host, here, to, visited)
            here = to
        assert await writer.stop() > 0
        await audit_clean(w, host)
        rcs = w.stop()
    assert all(rc == 0 for rc in rcs.values()), rcs


@pytest.mark.asyncio(loop_scope="session")
async def test_moves_repeat_after_the_target_agent_restarts(stack: StackInfo, unique: Callable[[str], str],
                                                            shared: tuple[S3Store, NatsEventLog, str],
                                                            tmp_path: Path) -> None:
    """The agent of the box the host landed on is restarted (SIGTERM: it stops the landed instance cleanly, the new
    agent wakes it in a new session); the host moves on from that box and back."""
    async with _world(stack, unique, tmp_path, shared) as w:
        host = f"{unique('rst')}.example.com"
        await create(w, host)
        writer = Writer(w, host)
        await move(w, host, "uk")
        await served_after_move(w, host, "ie", "uk", ["uk"])
        before = (await w.ledger.read_claim(host)).state
        assert before is not None and before.holder is not None
        assert w.agents["uk"].stop() == 0
        w.agents["uk"].start()

        async def readmitted() -> bool:
            claim = (await w.ledger.read_claim(host)).state
            return claim is not None and claim.holder is not None and claim.holder.session > before.holder.session

        await eventually(readmitted, "the restarted agent's admission of the landed host")
        await serving_port(w, "uk", host)
        await move(w, host, "us")
        await served_after_move(w, host, "uk", "us", ["uk", "us"])
        await move(w, host, "ie")
        await served_after_move(w, host, "us", "ie", ["uk", "us", "ie"])
        assert await writer.stop() > 0
        await audit_clean(w, host)


@pytest.mark.asyncio(loop_scope="session")
async def test_a_host_moves_on_after_a_rollback_returned_it(stack: StackInfo, unique: Callable[[str], str],
                                                            shared: tuple[S3Store, NatsEventLog, str],
                                                            tmp_path: Path) -> None:
    """The app fails its readiness in uk, so the move there rolls back to ie (§7.8, the clean return); the host then
    moves to us and back to ie like any other."""
    async with _world(stack, unique, tmp_path, shared, app_env={"MOVEPROBE_FAIL_READY_IN": "uk"}) as w:
        host = f"{unique('rbm')}.example.com"
        await create(w, host)
        await move(w, host, "uk", outcome="rolled_back")
        claim = (await w.ledger.read_claim(host)).state
        assert claim is not None and claim.op.exec == w.labels["ie"]
        await serving_port(w, "ie", host)
        writer = Writer(w, host)
        await move(w, host, "us")
        await served_after_move(w, host, "ie", "us", ["us"])
        await move(w, host, "ie")
        await served_after_move(w, host, "us", "ie", ["us", "ie"])
        assert await writer.stop() > 0
        await audit_clean(w, host)
