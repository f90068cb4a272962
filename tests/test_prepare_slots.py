"""Preparing slots on the real stack (issue 19 item 7(b); :mod:`services.source.cutslots`): with one slot on the
source box, a second move waits ``preparing`` while the first stages, says why in its record (§20), and begins once
the first is ready; both then move, and the slot keeps working for the moves that follow (back and on again).

The first host's app holds its readiness on ``ie`` while a hold file exists, so its move stays ``preparing`` (S1
fails, §7.3) and keeps the slot for as long as the test needs: a box that did not pace its stagings would stage the
second move meanwhile and make it ready, and the test would fail."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
import pytest_asyncio

from bus.nats_log import NatsEventLog
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
from services.source.cutslots import PREPARE_SLOTS_ENV
from tests.helpers.agents import AgentWorld, agent_world, data_buckets, eventually, publish_sample
from tests.test_agent import serving_port

OPERATOR = Identity("op", "operator")


@pytest_asyncio.fixture(loop_scope="session", scope="module")
async def shared(stack: StackInfo, unique: Callable[[str], str]) -> AsyncIterator[tuple[S3Store, NatsEventLog, str]]:
    async with data_buckets(stack, unique, "pslot") as s:
        yield s


async def record_of(w: AgentWorld, host: str) -> Record | None:
    return (await w.ledger.read_record(host)).state


async def moved_to(w: AgentWorld, host: str, move_id: str, region: str) -> None:
    """The move closed as done and the claim serves on ``region``'s box (K8)."""

    async def check() -> bool:
        record = await record_of(w, host)
        claim = (await w.ledger.read_claim(host)).state
        return (record is not None and record.move is None and record.last_move is not None
                and record.last_move.id == move_id and record.last_move.outcome == "done"
                and claim is not None and claim.op.kind == "serving" and claim.op.exec == w.labels[region])

    try:
        await eventually(check, f"the move {move_id} of {host} to close as done on {region}", 150)
    except AssertionError:
        logs = "\n".join(a.output()[-3000:] for a in w.agents.values())
        raise AssertionError(f"not moved; record {await record_of(w, host)}\n{logs}") from None


@pytest.mark.asyncio(loop_scope="session")
async def test_a_move_beyond_the_preparing_slots_waits_says_why_and_begins_when_one_frees(
        stack: StackInfo, unique: Callable[[str], str], shared: tuple[S3Store, NatsEventLog, str],
        tmp_path: Path) -> None:
    store, events, prefix = shared
    async with agent_world(stack, unique, tmp_path, prefix, store=store, events=events,
                           agent_env={PREPARE_SLOTS_ENV: "1", "HOSTMOVE_PASS_WORKERS": "4"}) as w:
        hold = w.root / "acks" / "hold-ready"  # the acks directory: every instance of the world reads it
        held_app = await publish_sample(w.store, w.deploy, WallClock(), {
            "MOVEPROBE_HOLD_READY_IN": "ie", "MOVEPROBE_HOLD_READY_FILE": str(hold)})
        first, second = f"{unique('first')}.example.com", f"{unique('second')}.example.com"
        for host in (first, second):
            created = await create_host(w.ledger, host, box=w.labels["ie"], region="ie",
                                        incarnation=new_incarnation(SystemRandom()),
                                        app=held_app if host == first else w.app)
            assert isinstance(created, Committed), created
        for host in (first, second):
            port = await serving_port(w, "ie", host)
            assert await asyncio.to_thread(post_write, port, "before the move") > 0

        door = Door(w.ledger, clock=WallClock(), rng=SystemRandom())
        hold.touch()
        try:
            asked = await door.request_move(first, MoveRequest("uk", "manual"), OPERATOR)
            assert asked.status in (200, 201), asked.body
            first_id = str(asked.body["move"]["id"])

            async def first_staging() -> bool:  # its round ran (it holds the slot) and S1 keeps it preparing
                r = await record_of(w, first)
                return r is not None and r.move is not None and r.move.state == "preparing" and bool(r.move.reason) \
                    and PREPARE_SLOTS_ENV not in r.move.reason

            await eventually(first_staging, f"{first} to stage and wait for its own readiness", 60)
            asked = await door.request_move(second, MoveRequest("uk", "manual"), OPERATOR)
            assert asked.status in (200, 201), asked.body
            second_id = str(asked.body["move"]["id"])

            async def second_waits() -> bool:
                r = await record_of(w, second)
                return r is not None and r.move is not None and PREPARE_SLOTS_ENV in r.move.reason

            await eventually(second_waits, f"{second}'s record to say it waits for a preparing slot", 30)
            waiting = await record_of(w, second)
            assert waiting is not None and waiting.move is not None and waiting.move.state == "preparing"
            assert "keeps serving" in waiting.move.reason, waiting.move.reason
            held = await record_of(w, first)
            assert held is not None and held.move is not None and held.move.state == "preparing", held
        finally:
            hold.unlink(missing_ok=True)

        async def both_ready() -> bool:
            records = [await record_of(w, h) for h in (first, second)]
            return all(r is not None and r.move is not None and r.move.state == "ready" for r in records)

        await eventually(both_ready, "both moves ready once the first gave its slot up", 90)
        ready = await record_of(w, second)
        assert ready is not None and ready.move is not None and ready.move.reason == "", ready.move
        for host in (first, second):
            assert (await door.cut(host, OPERATOR)).status == 200
        await moved_to(w, first, first_id, "uk")
        await moved_to(w, second, second_id, "uk")

        # Again, right after: back to ie and on to uk, through uk's slot and then ie's, each free once more.
        for region in ("ie", "uk"):
            asked = await door.request_move(second, MoveRequest(region, "auto"), OPERATOR)
            assert asked.status in (200, 201), asked.body
            await moved_to(w, second, str(asked.body["move"]["id"]), region)
        for host in (first, second):
            port = await serving_port(w, "uk", host)
            assert await asyncio.to_thread(post_write, port, "after the moves") > 0
            audit = await run_audit(w.events, w.ledger, host=host)
            assert audit.clean(strict=True), [f.line() for f in audit.findings]
