"""Concurrent passes on the real stack (issue 19 item 3; spec §7.4: the cut window is per host): three hosts move from
``ie`` to ``uk`` with manual cuts. The third is cut first and its landing's probe is held on ``uk`` (its app's
readiness answers 503 while a hold file exists: a slow landing); the other two are cut then, and both commit and open
on ``uk`` while the third's probe is still held: the box lands them beside the slow one, neither waits for it. The
hold is lifted only once both have committed, so a box that passed its hosts one at a time would fail the test: its
pass of the held landing would keep the other two from landing until the third's probe window ran out."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import pytest_asyncio

from bus.nats_log import NatsEventLog
from bus.subjects import LEDGER_STREAM, ledger_subject
from events.base import decode
from events.envelope import Transition
from events.ids import new_incarnation
from events.record import Record
from hostmove.probe_apps import post_write
from hostmove.stackinfo import StackInfo
from kernel.ports import SystemRandom, WallClock
from services.door.api import Door
from services.door.auth import Identity
from services.door.decide import MoveRequest
from services.hosts.create import create_host
from services.ledger import Committed
from services.ledger.audit import run_audit
from services.objstore.s3 import S3Store
from tests.helpers.agents import AgentWorld, agent_world, data_buckets, eventually, publish_sample
from tests.test_agent import moved, serving_port

OPERATOR = Identity("op", "operator")


@pytest_asyncio.fixture(loop_scope="session", scope="module")
async def shared(stack: StackInfo, unique: Callable[[str], str]) -> AsyncIterator[tuple[S3Store, NatsEventLog, str]]:
    async with data_buckets(stack, unique, "cpa") as s:
        yield s


@dataclass(frozen=True)
class Window:
    """A move's times from its record's history (ms): the cut asked, the commit, the open."""

    cut_at: int
    committed_at: int
    opened_at: int


async def window(w: AgentWorld, host: str, move_id: str) -> Window:
    """The latest cut, commit and open times the host's record carried for ``move_id`` (read from the stream: the
    close keeps only the outcome)."""
    found: dict[str, int] = {}
    async for msg in w.events.replay(LEDGER_STREAM, subject=ledger_subject("record", host)):
        record = decode(msg.data, Transition).record
        move = record.move if isinstance(record, Record) else None
        if move is None or move.id != move_id:
            continue
        for name in ("cut_at", "committed_at", "opened_at"):
            value = getattr(move, name)
            if value is not None:
                found[name] = value
    assert set(found) == {"cut_at", "committed_at", "opened_at"}, (host, found)
    return Window(**found)


async def record_of(w: AgentWorld, host: str) -> Record | None:
    return (await w.ledger.read_record(host)).state


@pytest.mark.asyncio(loop_scope="session")
async def test_two_hosts_are_cut_on_a_box_while_a_third_landing_there_is_slow(
        stack: StackInfo, unique: Callable[[str], str], shared: tuple[S3Store, NatsEventLog, str],
        tmp_path: Path) -> None:
    store, events, prefix = shared
    async with agent_world(stack, unique, tmp_path, prefix, store=store, events=events,
                           agent_env={"HOSTMOVE_PASS_WORKERS": "4", "HOSTMOVE_PROBE_WINDOW_S": "30",
                                      "HOSTMOVE_CUT_WINDOW_S": "50"}) as w:
        hold = w.root / "acks" / "hold-ready"  # the acks directory: every instance of the world reads it
        held_app = await publish_sample(w.store, w.deploy, WallClock(), {
            "MOVEPROBE_HOLD_READY_IN": "uk", "MOVEPROBE_HOLD_READY_FILE": str(hold)})
        slow, quick = f"{unique('slow')}.example.com", [f"{unique(f'q{i}')}.example.com" for i in (1, 2)]
        for host in (slow, *quick):
            created = await create_host(w.ledger, host, box=w.labels["ie"], region="ie",
                                        incarnation=new_incarnation(SystemRandom()),
                                        app=held_app if host == slow else w.app)
            assert isinstance(created, Committed), created
        for host in (slow, *quick):
            port = await serving_port(w, "ie", host)
            assert await asyncio.to_thread(post_write, port, "before the move") > 0

        door = Door(w.ledger, clock=WallClock(), rng=SystemRandom())
        moves: dict[str, str] = {}
        for host in (slow, *quick):
            asked = await door.request_move(host, MoveRequest("uk", "manual"), OPERATOR)
            assert asked.status in (200, 201), asked.body
            moves[host] = str(asked.body["move"]["id"])

        async def all_ready() -> bool:
            records = [await record_of(w, h) for h in moves]
            return all(r is not None and r.move is not None and r.move.state == "ready" for r in records)

        await eventually(all_ready, "the three manual-cut moves to be ready", 90)
        hold.touch()
        try:
            assert (await door.cut(slow, OPERATOR)).status == 200

            async def probing() -> bool:
                record = await record_of(w, slow)
                return record is not None and record.move is not None and record.move.landing_phase == "probing"

            await eventually(probing, f"the landing of {slow} to be probing on uk (held)", 30, every_s=0.02)
            for host in quick:
                assert (await door.cut(host, OPERATOR)).status == 200

            async def both_committed() -> bool:
                records = [await record_of(w, h) for h in quick]
                return all(r is not None and (r.move.committed_at is not None if r.move is not None else
                                              r.last_move is not None and r.last_move.outcome == "done")
                           for r in records)

            await eventually(both_committed, "both quick hosts committed while the slow landing is held", 40,
                             every_s=0.02)
            held = await record_of(w, slow)
            assert held is not None and held.move is not None and held.move.committed_at is None, held
            assert held.move.landing_phase == "probing", held.move  # still held: the quick ones did not wait
        finally:
            hold.unlink(missing_ok=True)
        for host, move_id in moves.items():
            await moved(w, host, move_id)
        times = {h: await window(w, h, moves[h]) for h in moves}
        first, second = (times[h] for h in quick)
        assert max(first.cut_at, second.cut_at) < min(first.opened_at, second.opened_at), times  # cut concurrently
        for h in quick:  # inside the slow one's landing: cut after it, committed and opened before it committed
            assert times[slow].cut_at < times[h].cut_at < times[h].opened_at < times[slow].committed_at, times
        for host in moves:
            port = await serving_port(w, "uk", host)
            assert await asyncio.to_thread(post_write, port, "after the move") > 0
            audit = await run_audit(w.events, w.ledger, host=host)
            assert audit.clean(strict=True), [f.line() for f in audit.findings]
