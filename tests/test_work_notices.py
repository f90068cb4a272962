"""Work notices on durable consumers (issue 19 item 1), on the real stack: a box agent learns of its work from its
own consumer on ``HM_WORK``, which keeps what was sent while the agent was down.

The target box's agent is stopped; one host's move to it is requested and another host's manual move (ready before
the stop) is cut; the agent is started again with its reconciliation scan an hour away. (The cut window is 90 s,
not the fast profile's 12 s: the manual host's cut deadline runs from the cut, made while the target is down, and a
loaded machine's agent start alone can take most of 12 s; a restart past the window rolls back, as it should.)
The target holds nothing local of either host (no instance, no route row), so only its consumer can tell it: both
moves must end ``done``.
Then the pure decider of which boxes a transition concerns, and the consumer's permissions."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
import pytest_asyncio

from bus.nats_log import NatsEventLog
from bus.subjects import WORK_STREAM, box_durable, parse_work_subject, work_filter, work_subject
from events.claim import Claim, Holder, Obligation, Op
from events.ids import new_incarnation
from events.record import Move, Record
from hostmove.access import nats_permissions
from hostmove.probe_apps import post_write
from hostmove.stackinfo import StackInfo
from kernel.ports import SystemRandom, WallClock
from services.box.instance.registry import Registry
from services.door.api import Door
from services.door.auth import Identity
from services.door.decide import MoveRequest
from services.hosts.create import create_host
from services.ledger import Committed
from services.ledger.audit import run_audit
from services.ledger.notices import boxes_concerned
from services.objstore.s3 import S3Store
from tests.helpers.agents import agent_world, data_buckets, eventually
from tests.test_agent import moved, serving_port

OPERATOR = Identity("op", "operator")


@pytest_asyncio.fixture(loop_scope="session", scope="module")
async def shared(stack: StackInfo, unique: Callable[[str], str]) -> AsyncIterator[tuple[S3Store, NatsEventLog, str]]:
    async with data_buckets(stack, unique, "wkn") as s:
        yield s


@pytest.mark.asyncio(loop_scope="session")
async def test_a_restarted_target_takes_what_was_asked_while_it_was_down_from_its_consumer(
        stack: StackInfo, unique: Callable[[str], str], shared: tuple[S3Store, NatsEventLog, str],
        tmp_path: Path) -> None:
    store, events, prefix = shared
    async with agent_world(stack, unique, tmp_path, prefix, store=store, events=events,
                           agent_env={"HOSTMOVE_SCAN_S": "3600", "HOSTMOVE_CUT_WINDOW_S": "90"}) as w:
        auto, manual = f"{unique('wa')}.example.com", f"{unique('wm')}.example.com"
        for host in (auto, manual):  # created with the scan an hour away: the source hears of them by notice
            created = await create_host(w.ledger, host, box=w.labels["ie"], region="ie",
                                        incarnation=new_incarnation(SystemRandom()), app=w.app)
            assert isinstance(created, Committed), created
        for host in (auto, manual):
            port = await serving_port(w, "ie", host, timeout_s=60)
            assert await asyncio.to_thread(post_write, port, "before the move") > 0
        door = Door(w.ledger, clock=WallClock(), rng=SystemRandom())
        asked = await door.request_move(manual, MoveRequest("uk", "manual"), OPERATOR)
        assert asked.status in (200, 201), asked.body
        manual_id = str(asked.body["move"]["id"])

        async def ready() -> bool:
            record = (await w.ledger.read_record(manual)).state
            return record is not None and record.move is not None and record.move.state == "ready"

        await eventually(ready, f"the manual move of {manual} to be ready", 90)
        uk = w.labels["uk"]
        assert w.agents["uk"].stop() == 0, "the target's agent stops cleanly"
        before = (await events.state(WORK_STREAM)).last_seq
        asked = await door.request_move(auto, MoveRequest("uk", "auto"), OPERATOR)
        assert asked.status in (200, 201), asked.body
        auto_id = str(asked.body["move"]["id"])
        assert (await door.cut(manual, OPERATOR)).status == 200

        async def notices_for_uk() -> set[str] | None:  # what waits for the stopped agent, on the stream
            hosts: set[str] = set()
            async for msg in events.replay(WORK_STREAM, start_seq=before + 1):
                box, host = parse_work_subject(msg.subject)
                if box == uk:
                    hosts.add(host)
            return hosts if {auto, manual} <= hosts else None

        await eventually(notices_for_uk, "work notices for both hosts kept for the stopped target", 30)
        rows = Registry.open(w.box_dir("uk"), WallClock())
        try:  # the target holds nothing local of the auto host: only its consumer can tell it
            assert rows.get(auto) is None and auto not in {r.host for r in rows.rows()}
        finally:
            rows.close()
        w.agents["uk"].start()
        await moved(w, auto, auto_id, timeout_s=120)
        await moved(w, manual, manual_id, timeout_s=120)
        for host in (auto, manual):
            port = await serving_port(w, "uk", host)
            assert await asyncio.to_thread(post_write, port, "after the move") > 0
            audit = await run_audit(w.events, w.ledger, host=host)
            assert audit.clean(strict=True), [f.line() for f in audit.findings]
        info = await events.js.consumer_info(WORK_STREAM, box_durable(uk))
        assert info.config.filter_subject == work_filter(uk)
        assert info.num_ack_pending == 0 or info.num_pending == 0, info  # answered, or answering the last passes

        # A sequence: the auto host moves back to ie (the source box's agent was never restarted; the target's was).
        back = await door.request_move(auto, MoveRequest("ie", "auto"), OPERATOR)
        assert back.status in (200, 201), back.body
        back_id = str(back.body["move"]["id"])

        async def home() -> bool:
            record = (await w.ledger.read_record(auto)).state
            claim = (await w.ledger.read_claim(auto)).state
            return (record is not None and record.last_move is not None and record.last_move.id == back_id
                    and record.last_move.outcome == "done" and claim is not None and claim.op.exec == w.labels["ie"])

        await eventually(home, f"{auto} moved back to ie with the scans an hour away", 120)


def _claim(**op: object) -> Claim:
    return Claim(host="h", gen=1, holder=Holder(incarnation="i1", location="l1", writer_box="ie-1"), op=Op(**op))


def test_a_transition_concerns_the_boxes_either_side_names() -> None:
    prev = _claim(kind="moving", id="m1", exec="ie-1", participants=("ie-1", "uk-1"))
    new = _claim(kind="serving", exec="uk-1")
    assert boxes_concerned(prev, new) == ["ie-1", "uk-1"]  # the source hears of the close that drops it
    parked = Claim(host="h", gen=2, op=Op(kind="serving", exec="uk-1"), obligations=(
        Obligation(kind="park-superseded", op="lost:m1", region="us", owner="@region"),
        Obligation(kind="park-local", op="m1", region="ie", owner="ie-2")))
    assert boxes_concerned(None, parked) == ["ie-2", "uk-1"]  # an owner box, never a region's placeholder
    assert boxes_concerned(None, Claim(host="h", gen=1)) == []  # exec "none": nobody
    record = Record(host="h", gen=3, move=Move(id="m1", incarnation="i1", to="uk", state="ready", from_="ie"))
    assert boxes_concerned(Record(host="h", gen=2), record, prev) == ["ie-1", "uk-1"]  # the claim's boxes
    assert boxes_concerned(Record(host="h", gen=2), record) == []  # a record names regions, not boxes


def test_a_box_may_consume_its_own_notices_only_and_publishes_every_box_s() -> None:
    perms = nats_permissions("box-ie-1")
    assert perms is not None
    allowed = perms["publish"]["allow"]
    assert f"$JS.API.CONSUMER.MSG.NEXT.{WORK_STREAM}.{box_durable('ie-1')}" in allowed
    assert not any(box_durable("uk-1") in a for a in allowed), "never another box's consumer"
    assert "hm.work.*.*" in allowed  # a writer notifies the other participant
    assert "hm.ledger.>" not in perms["subscribe"]["allow"], "a box subscribes to no ledger subject any more"
    assert work_subject("ie-1", "a.b") == "hm.work.ie-1.a_2Eb" and parse_work_subject("hm.work.ie-1.a_2Eb") == (
        "ie-1", "a.b")
