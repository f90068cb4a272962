"""The operator's ways out of a held state (spec §7.10, §12; issue 13 item 5): ``resolve --retry`` of a stuck move and
``host resolve --clear-failed`` of a failed route, through the door (operator-only, refused with a sentence in every
other state), on the in-memory store and event log. The real-stack run of a stuck move retried is
``tests/test_rehearse.py``."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import msgspec
import pytest
from aiohttp.test_utils import TestClient, TestServer

from bus.memory_log import MemoryEventLog
from events import Actor
from events.copy import say
from events.ids import rollback_id
from events.record import Move, Record, Rollback
from kernel.ports import ManualClock, SeededRandom
from services.box.roster import init_box
from services.door.api import Door, make_app
from services.door.auth import Identity, TokenSet
from services.hosts.create import create_host
from services.ledger.ledger import Committed, Ledger, NoChange, Refusal
from services.move.resolve import (
    CLEAR_FAILED,
    NotStuck,
    decide_clear_failed,
    decide_clear_failed_done,
    decide_retry,
)
from services.objstore.memory import MemoryStore

HOST = "r.example.com"
INC = "c" * 64
MV = "mv_" + "s" * 26
RB = rollback_id(MV)
OPERATOR = "op-token-resolve"
OP = Identity("alice", "operator")


def stuck_record(rollback: Rollback | None, state: str = "stuck") -> Record:
    return Record(host=HOST, gen=7, move=Move(id=MV, incarnation=INC, to="uk", from_="ie", state=state,  # type: ignore[arg-type]
                                              cut_phase="flipped", rollback=rollback, reason="nine failed probes",
                                              stuck_at=50))


async def world(tmp_path: Path) -> tuple[Ledger, Door, ManualClock]:
    clock = ManualClock()
    store, events = MemoryStore(), MemoryEventLog()
    await store.create_bucket("deploy")
    actor = Actor(service="test", pid=1, nonce="resolve")
    for label, region in (("ie-1", "ie"), ("uk-1", "uk")):
        await init_box(root=tmp_path, label=label, region=region, store=store, bucket="deploy", events=events,
                       clock=clock, actor=actor)
    ledger = Ledger(store, events, clock, actor, "deploy")
    created = await create_host(ledger, HOST, box="ie-1", region="ie", incarnation=INC)
    assert isinstance(created, Committed), created
    return ledger, Door(ledger, clock=clock, rng=SeededRandom(3)), clock


async def hold(ledger: Ledger, kind: str, record: Record | None) -> None:
    """Put the host's claim under a move op of ``kind`` and the record as given (what a stuck move leaves)."""
    def claim(cur: Any) -> Any:
        return msgspec.structs.replace(cur, op=msgspec.structs.replace(
            cur.op, kind=kind, id=MV, exec="ie-1", participants=("ie-1", "uk-1")))

    assert isinstance(await ledger.transition("claim", host=HOST, name="test-hold", decide=claim), Committed)
    if record is not None:
        assert isinstance(await ledger.transition("record", HOST, "test-stuck", lambda cur: msgspec.structs.replace(
            record, gen=cur.gen if cur is not None else 1)), Committed)


@pytest.mark.parametrize(("phase", "after"), [("probing", "probing"), ("verified", "probing"),
                                              ("building", "building"), ("recovered", "probing")])
def test_retry_reruns_the_probe_or_the_install_phase_it_stopped_at(phase: str, after: str) -> None:
    from events.claim import Claim, Holder, Op

    claim = Claim(host=HOST, gen=3, holder=Holder(incarnation=INC, location="instances/x/"),
                  op=Op(kind="restoring", id=MV, exec="ie-1", participants=("ie-1", "uk-1")))
    rec = stuck_record(Rollback(id=RB, source_phase=phase, probe_failures=9, dirty=phase == "building"))
    out = decide_retry(rec, claim, 99)
    assert isinstance(out, Record) and out.move is not None and out.move.rollback is not None
    assert (out.move.state, out.move.rollback.source_phase, out.move.rollback.probe_failures) == (
        "rolling_back", after, 0)
    assert out.move.retried_at == out.move.rollback.retried_at == 99
    revert = stuck_record(None)
    reverting = msgspec.structs.replace(claim, op=msgspec.structs.replace(claim.op, kind="reverting"))
    back = decide_retry(revert, reverting, 99)
    assert isinstance(back, Record) and back.move is not None and back.move.state == "reverting"
    for state in ("rolling_back", "landing", "committed"):
        refused = decide_retry(stuck_record(Rollback(id=RB), state=state), claim, 99)
        assert isinstance(refused, NotStuck) and refused.state == state
    assert isinstance(decide_retry(Record(host=HOST, gen=1), claim, 99), NotStuck)


def test_clear_failed_is_journaled_for_the_serving_box_only() -> None:
    from events.claim import Claim, Holder, Op

    serving = Claim(host=HOST, gen=3, holder=Holder(incarnation=INC, location="instances/x/"),
                    op=Op(kind="serving", exec="ie-1", participants=("ie-1",)))
    asked = decide_clear_failed(serving, "alice", 10)
    assert isinstance(asked, Claim) and asked.op.journal[CLEAR_FAILED] == {"at": 10, "by": "alice"}
    assert isinstance(decide_clear_failed(asked, "bob", 11), NoChange)
    moving = msgspec.structs.replace(serving, op=msgspec.structs.replace(serving.op, kind="moving", id=MV))
    assert isinstance(decide_clear_failed(moving, "alice", 10), Refusal)
    assert isinstance(decide_clear_failed_done(asked, "uk-1", 10), Refusal), "only the serving box"
    done = decide_clear_failed_done(asked, "ie-1", 10)
    assert isinstance(done, Claim) and CLEAR_FAILED not in done.op.journal
    assert isinstance(decide_clear_failed_done(done, "ie-1", 10), NoChange)


def test_the_door_retries_a_stuck_move_and_refuses_every_other_state(tmp_path: Path) -> None:
    async def go() -> None:
        ledger, door, _clock = await world(tmp_path)
        refused = await door.resolve(HOST, OP)
        assert refused.status == 409 and refused.body["copy"] == "M-R19", refused.body
        await hold(ledger, "restoring", stuck_record(Rollback(id=RB, source_phase="probing", probe_failures=9),
                                                     state="rolling_back"))
        refused = await door.resolve(HOST, OP)
        assert refused.status == 409 and refused.body["copy"] == "M-R50", refused.body
        assert refused.body["reason"] == say("M-R50", host=HOST, state="rolling_back")
        rec = (await ledger.read_record(HOST)).state
        assert rec is not None and rec.move is not None
        stuck = msgspec.structs.replace(rec, move=msgspec.structs.replace(rec.move, state="stuck"))
        assert isinstance(await ledger.transition("record", HOST, "test-stuck", lambda cur: msgspec.structs.replace(
            stuck, gen=cur.gen if cur is not None else 1)), Committed)
        answer = await door.resolve(HOST, OP)
        assert answer.status == 200 and answer.body["copy"] == "M-S9", answer.body
        after = (await ledger.read_record(HOST)).state
        assert after is not None and after.move is not None and after.move.rollback is not None
        assert (after.move.state, after.move.rollback.source_phase) == ("rolling_back", "probing")
        clear = await door.clear_failed(HOST, OP)
        assert clear.status == 409 and clear.body["copy"] == "M-R51", "refused while a move holds the host"

    asyncio.run(go())


def test_the_routes_are_operator_only_and_take_their_one_flag(tmp_path: Path) -> None:
    async def go() -> None:
        _ledger, door, _clock = await world(tmp_path)
        app = make_app(door, TokenSet.of(operators={"alice": OPERATOR}, status={"reader": "status-token"}))
        async with TestClient(TestServer(app)) as client:
            for path, body in ((f"/v1/hosts/{HOST}/move/resolve", {"retry": True}),
                               (f"/v1/hosts/{HOST}/resolve", {"clear_failed": True})):
                for token in (None, "status-token"):
                    headers = {"Authorization": f"Bearer {token}"} if token else {}
                    resp = await client.post(path, json=body, headers=headers)
                    assert resp.status == 404, (path, token)
                bad = await client.post(path, json={"retry": False, "clear_failed": False},
                                        headers={"Authorization": f"Bearer {OPERATOR}"})
                assert bad.status == 400, path
            resp = await client.post(f"/v1/hosts/{HOST}/resolve", json={"clear_failed": True},
                                     headers={"Authorization": f"Bearer {OPERATOR}"})
            body = await resp.json()
            assert resp.status == 200 and body["copy"] == "M-S10" and body["changed"] is True, body
            resp = await client.post(f"/v1/hosts/{HOST}/move/resolve", json={"retry": True},
                                     headers={"Authorization": f"Bearer {OPERATOR}"})
            body = await resp.json()
            assert resp.status == 409 and body["copy"] == "M-R19", body

    asyncio.run(go())
