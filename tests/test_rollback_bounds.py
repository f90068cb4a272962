"""Rollback triggers, bounds and incidents (spec §7.8, §7.10, §13; issue 13 items 1 and 4), pure, and the incidents'
durability on the event-log twin. The real-stack runs are ``tests/test_rollback.py``."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from bus.memory_log import MemoryEventLog
from bus.subjects import FACTS_STREAM, incident_subject
from events.claim import Admission, Claim, Holder, Op
from events.envelope import Actor
from events.ids import is_op_id, rollback_id
from events.record import Move, MoveInputs, Record, ReturnSeal, Rollback
from services.ledger.ledger import NoChange, Refusal
from services.move import rollback
from services.move.follow import claim_half
from services.move.incidents import MOVE_STUCK, RELEASE_WAITING, incidents_owed, raise_owed
from services.source.revert import decide_revert_probe_failed
from services.target import phases

INC = "ab" * 32
MV = "mv_" + "q" * 26
RB = rollback_id(MV)
HOST = "h.example.com"
ACTOR = Actor(service="test", pid=1, nonce="n")


def landing(deadline: int = 100) -> Record:
    return Record(host=HOST, gen=4, move=Move(id=MV, incarnation=INC, to="uk", from_="ie", state="landing",
                                              cut_phase="flipped", landing_phase="probing", landing_deadline=deadline,
                                              cut_deadline=1_000))


def rolling(**rb: object) -> Record:
    rec = landing()
    assert rec.move is not None
    return msgspec.structs.replace(rec, move=msgspec.structs.replace(
        rec.move, state="rolling_back", rollback=Rollback(id=RB, **rb)))  # type: ignore[arg-type]


def test_every_trigger_names_the_moves_one_rollback() -> None:
    assert is_op_id(RB) and RB == rollback_id(MV) and RB != rollback_id("mv_" + "z" * 26)
    target = phases.decide_rollback(landing(), phases.Expect(MV, INC, "uk-1"), "the probe failed", 50, 1_000)
    source = rollback.decide_deadline_rollback(landing(), MV, INC, 101, 1_000)
    assert isinstance(target, Record) and isinstance(source, Record)
    assert target.move is not None and source.move is not None
    assert target.move.rollback is not None and source.move.rollback is not None
    assert target.move.rollback.id == source.move.rollback.id == RB
    assert source.move.rollback.release_deadline == 101 + 1_000


def test_the_deadline_trigger_only_after_the_deadline_and_only_from_landing() -> None:
    assert isinstance(rollback.decide_deadline_rollback(landing(), MV, INC, 100, 1_000), Refusal), "not yet"
    out = rollback.decide_deadline_rollback(landing(), MV, INC, 101, 1_000)
    assert isinstance(out, Record) and out.move is not None and out.move.state == "rolling_back"
    assert isinstance(rollback.decide_deadline_rollback(out, MV, INC, 102, 1_000), NoChange)
    base = landing()
    assert base.move is not None
    probed = msgspec.structs.replace(base, move=msgspec.structs.replace(base.move, landing_phase="probed"))
    committed = phases.decide_commit(probed, phases.Expect(MV, INC, "uk-1"), 90)
    assert isinstance(committed, Record)
    assert isinstance(rollback.decide_deadline_rollback(committed, MV, INC, 200, 1_000), Refusal), \
        "the commit won: nothing rolls back"
    rolled = rollback.decide_deadline_rollback(probed, MV, INC, 101, 1_000)
    assert isinstance(rolled, Record)
    assert isinstance(phases.decide_commit(rolled, phases.Expect(MV, INC, "uk-1"), 90), Refusal), \
        "the rollback won: the commit is refused"


def test_nine_failed_recovery_probes_are_stuck() -> None:
    rec: Record | NoChange | Refusal = rolling(source_phase="probing")
    for i in range(1, rollback.RECOVERY_PROBE_ATTEMPTS):
        assert isinstance(rec, Record)
        rec = rollback.decide_probe_failed(rec, MV, "not ready", 10 + i)
        assert isinstance(rec, Record) and rec.move is not None and rec.move.state == "rolling_back"
        assert rec.move.rollback is not None and rec.move.rollback.probe_failures == i
    assert isinstance(rec, Record)
    stuck = rollback.decide_probe_failed(rec, MV, "not ready", 99)
    assert isinstance(stuck, Record) and stuck.move is not None
    assert (stuck.move.state, stuck.move.stuck_at) == ("stuck", 99)
    assert "failed 9 times" in stuck.move.reason
    assert isinstance(rollback.decide_probe_failed(rolling(source_phase="restoring"), MV, "x", 1), Refusal)


def test_fifteen_minutes_of_failed_revert_probes_are_stuck() -> None:
    rec = Record(host=HOST, gen=2, move=Move(id=MV, incarnation=INC, to="uk", from_="ie", state="reverting"))
    first = decide_revert_probe_failed(rec, MV, "not ready", 1_000, 900_000)
    assert isinstance(first, Record) and first.move is not None and first.move.recovery_failed_at == 1_000
    assert isinstance(decide_revert_probe_failed(first, MV, "not ready", 900_999, 900_000), NoChange)
    stuck = decide_revert_probe_failed(first, MV, "not ready", 901_000, 900_000)
    assert isinstance(stuck, Record) and stuck.move is not None and stuck.move.state == "stuck"
    assert first.move is not None
    retried = msgspec.structs.replace(first, move=msgspec.structs.replace(first.move, retried_at=5_000))
    again = decide_revert_probe_failed(retried, MV, "not ready", 6_000, 900_000)
    assert isinstance(again, Record) and again.move is not None and again.move.recovery_failed_at == 6_000, \
        "a retry starts the fifteen minutes again"


@pytest.mark.parametrize(("covered", "db", "dirty"), [(True, "db1", False), (True, "db2", True), (False, "db1", True)])
def test_the_verdict_is_dirty_when_the_target_wrote_or_the_seal_was_not_covered(covered: bool, db: str,
                                                                                 dirty: bool) -> None:
    from events.record import MoveLanding

    rec = rolling()
    assert rec.move is not None
    move = msgspec.structs.replace(rec.move, landing=MoveLanding(installed_db_sha256="db1"))
    assert rollback.release_verdict(move, src_covered=covered, db_sha256=db, files_plain="", timers_sha256="")[0] \
        is dirty


def test_the_flip_journals_the_source_stamp_and_the_return_writes_it_back() -> None:
    holder = Holder(incarnation=INC, location=f"instances/{HOST}/{INC}/", generation="wsrc", stamp=7, session=7,
                    admissions=(Admission(session=7, box="ie-1", generation="wsrc", region="ie"),))
    moving = Claim(host=HOST, gen=9, holder=holder, op=Op(kind="moving", id=MV, exec="none",
                                                           participants=("ie-1", "uk-1")))
    flipped = landing()
    assert flipped.move is not None
    flipped = msgspec.structs.replace(flipped, move=msgspec.structs.replace(
        flipped.move, source=msgspec.structs.replace(flipped.move.source, evidence="ev-s")))
    half = claim_half(moving, flipped)
    assert isinstance(half, Claim)
    assert (half.op.source_stamp, half.op.journal["src_gen"]) == (7, "wsrc")
    landed = msgspec.structs.replace(half, holder=msgspec.structs.replace(holder, stamp=12, generation="mvgen"),
                                     op=msgspec.structs.replace(half.op, kind="restoring", exec="none", journal={
                                         **half.op.journal, "evidence.target": "ev-t"}))
    dirty = rollback.decide_source_claimed(landed, MV, "ie-1", clean=False, src_covered=True)
    assert isinstance(dirty, Claim) and dirty.holder is not None
    assert (dirty.op.exec, dirty.holder.stamp, dirty.holder.generation) == ("ie-1", 7, "mvgen")
    clean = rollback.decide_source_claimed(landed, MV, "ie-1", clean=True, src_covered=True)
    assert isinstance(clean, Claim) and clean.holder is not None
    assert (clean.holder.stamp, clean.holder.generation) == (7, "wsrc"), "a clean return names S's generation again"


def test_the_incidents_a_move_owes() -> None:
    claim = Claim(host=HOST, gen=3, op=Op(kind="restoring", id=MV, exec="uk-1", participants=("ie-1", "uk-1")))
    waiting = rolling(release_deadline=500)
    assert incidents_owed(waiting, claim, 500) == []
    (owed,) = incidents_owed(waiting, claim, 501)
    assert owed.kind == RELEASE_WAITING and owed.id == f"{MV}:500"
    assert owed.sentence == f"Waiting for uk-1 in uk to confirm it has stopped {HOST}. {HOST} is offline."
    evidenced = rolling(release_deadline=500, evidence="ev-t", target_phase="released")
    assert incidents_owed(evidenced, claim, 501) == [], "the target gave evidence: nothing is owed"
    assert waiting.move is not None
    stuck = msgspec.structs.replace(waiting, move=msgspec.structs.replace(
        waiting.move, state="stuck", stuck_at=700, reason="nine failed probes", inputs=MoveInputs()))
    (owed,) = incidents_owed(stuck, claim, 800)
    assert owed.kind == MOVE_STUCK and owed.id == f"{MV}:700"
    assert f"hostmove move resolve --host {HOST} --retry" in owed.sentence


def test_an_incident_is_raised_once_by_any_number_of_raisers() -> None:
    async def go() -> None:
        log = MemoryEventLog()
        claim = Claim(host=HOST, gen=3, op=Op(kind="restoring", id=MV, exec="uk-1", participants=("ie-1", "uk-1")))
        (owed,) = incidents_owed(rolling(release_deadline=5), claim, 6)
        raised = [await raise_owed(log, ACTOR, owed, 6) for _ in range(3)]  # three passes, or three restarts
        assert raised == [True, False, False]
        subject = incident_subject(owed.kind, HOST, owed.id)
        assert len([m async for m in log.replay(FACTS_STREAM, subject=subject)]) == 1

    asyncio.run(go())


def test_the_terminal_event_carries_every_timing_digest_and_reason() -> None:
    from events.record import MoveLanding, MoveSource
    from services.move.finalize import terminal_payload

    rec = rolling(dirty=True, reason="the probe failed", recovered_at=40, opened_at=41, target_parked_at=42,
                  seal=ReturnSeal(n=7))
    assert rec.move is not None
    move = msgspec.structs.replace(rec.move, cut_at=10, flipped_at=20, source=MoveSource(db_sha256="a" * 64),
                                   landing=MoveLanding(installed_db_sha256="b" * 64))
    out = terminal_payload(move)
    assert out["timings"] == {"cut_at": 10, "flipped_at": 20, "recovered_at": 40, "rollback_opened_at": 41,
                              "target_parked_at": 42}
    assert out["digests"] == {"db_sha256": "a" * 64, "installed_db_sha256": "b" * 64}
    assert out["rollback"] == {"id": RB, "dirty": True, "reason": "the probe failed", "evidence": "", "n": 7,
                               "probe_failures": 0}
