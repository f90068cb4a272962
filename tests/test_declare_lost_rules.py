"""The legality table of ``--declare-lost`` and its two CASes, pure (spec §7.10 M16; :mod:`services.move.lost`). The
real-stack run is ``tests/test_declare_lost.py``."""

from __future__ import annotations

import pytest

from events.claim import Claim, Holder, LostBox, Obligation, Op, Scope
from events.ids import rollback_id
from events.record import Move, Record, Rollback
from kernel import rules
from services.move.follow import staging_scope_location
from services.move.lost import (
    LossDeclaration,
    NotLegal,
    decide_declared_claim,
    decide_declared_record,
    declaration_kind,
    declared_lost,
    loss_key,
)

HOST = "d.example.com"
MV = "mv_" + "d" * 26
RB = rollback_id(MV)
INC = "i" * 64


def claim(kind: str = "restoring", exec_: str = "uk-1", obligations: tuple[Obligation, ...] = (),
          lost: tuple[LostBox, ...] = ()) -> Claim:
    return Claim(host=HOST, gen=9, holder=Holder(incarnation=INC, location=f"instances/{HOST}/{INC}/"),
                 op=Op(kind=kind, id=MV, exec=exec_, participants=("ie-1", "uk-1")),  # type: ignore[arg-type]
                 obligations=obligations, lost=lost)


def record(state: str = "landing", rb: Rollback | None = None) -> Record:
    return Record(host=HOST, gen=4, move=Move(id=MV, incarnation=INC, to="uk", from_="ie", state=state,  # type: ignore[arg-type]
                                              cut_phase="flipped", flipped_at=1000, rollback=rb))


def decl(kind: str) -> LossDeclaration:
    return LossDeclaration(host=HOST, move=MV, box="uk-1", role="target", kind=kind, enrollment="fp@1",  # type: ignore[arg-type]
                           region="uk", compute_status="stopped", compute_evidence="stopped", operator="alice",
                           declared_at=5000, flipped_at=1000)


def refused(rec: Record, cl: Claim, box: str = "uk-1", status: str = "stopped") -> str:
    with pytest.raises(NotLegal) as caught:
        declaration_kind(rec, cl, box, status)
    return caught.value.copy


def test_legal_in_exactly_the_states_the_spec_lists() -> None:
    assert declaration_kind(record("landing"), claim("landing"), "uk-1", "stopped") == "owes-evidence"
    for phase in ("", "releasing"):
        rec = record("rolling_back", Rollback(id=RB, target_phase=phase))
        assert declaration_kind(rec, claim(), "uk-1", "terminated") == "owes-evidence"
    for phase in ("released", "returning"):
        rec = record("rolling_back", Rollback(id=RB, target_phase=phase, dirty=True))
        assert declaration_kind(rec, claim(), "uk-1", "stopped") == "dirty-unreturned"
    local = Obligation(kind="park-local", op=MV, region="uk", owner="uk-1")
    assert declaration_kind(record("committed"), claim("landing", obligations=(local,)), "uk-1",
                            "stopped") == "local-only", "only local chores: legal after the commit"


def test_refused_everywhere_else_with_its_sentence() -> None:
    assert refused(record("committed"), claim("landing")) == "M-R72"
    assert refused(record("preparing"), claim("moving", exec_="ie-1")) == "M-R73"
    assert refused(record("rolling_back", Rollback(id=RB, target_phase="returned", dirty=True)), claim()) == "M-R74"
    assert refused(record("rolling_back", Rollback(id=RB, target_phase="released")), claim()) == "M-R74"
    assert refused(record("landing"), claim("landing"), box="ie-1") == "M-R71"
    assert refused(record("landing"), claim("landing"), box="us-1") == "M-R70"
    assert refused(record("landing"), claim("landing"), status="running") == "M-R75"
    assert refused(record("landing"), claim("landing", lost=(LostBox(box="uk-1"),))) == "M-R76"
    assert refused(Record(host=HOST, gen=1), claim("serving", exec_="ie-1")) == "M-R19"


def test_a_running_box_is_legal_only_with_the_rule_off() -> None:
    with rules.mutated(["declare-lost-compute"]):
        assert declaration_kind(record("landing"), claim("landing"), "uk-1", "running") == "owes-evidence"


def test_a_landing_becomes_a_clean_rollback_citing_the_declaration() -> None:
    key = loss_key(HOST, MV, "uk-1")
    out = decide_declared_record(record("landing"), claim("landing"), decl("owes-evidence"), key, 900_000)
    assert out.move is not None and out.move.state == "rolling_back" and out.move.rollback is not None
    rb = out.move.rollback
    assert (rb.id, rb.target_phase, rb.dirty, rb.evidence, rb.target_parked_at) == (RB, "cleaned", False, key, 5000)
    ref = {"enrollment": "fp@1", "key": key, "sha256": "ab"}
    half = decide_declared_claim(claim("landing"), out, decl("owes-evidence"), ref, source_region="ie")
    assert half.op.kind == "restoring" and half.op.exec == "none"
    assert half.op.journal["evidence.target"] == key and half.op.journal["loss.uk-1"] == ref
    assert [b.box for b in half.lost] == ["uk-1"] and declared_lost(half, "uk-1")
    assert decide_declared_claim(half, out, decl("owes-evidence"), ref, source_region="ie") == half, "idempotent"


def test_a_dirty_target_that_had_not_returned_owes_the_return_lanes_park_to_the_source() -> None:
    dirty = record("rolling_back", Rollback(id=RB, target_phase="returning", dirty=True))
    own = (Obligation(kind="park-superseded", op=MV, region="uk", owner="uk-1"),
           Obligation(kind="park-staging", op=MV, region="uk", owner="uk-1"))
    before = claim(exec_="none", obligations=own)
    out = decide_declared_record(dirty, before, decl("dirty-unreturned"), "k", 900_000)
    assert out.move is not None and out.move.rollback is not None and not out.move.rollback.dirty
    half = decide_declared_claim(before, out, decl("dirty-unreturned"), {"enrollment": "e", "key": "k", "sha256": "s"},
                                 source_region="ie")
    lane = Obligation(kind="park-staging", op=MV, region="ie", owner="ie-1",
                      scope=Scope(location=staging_scope_location(HOST, RB), incarnation=INC, evidence_at=5000))
    assert half.obligations == (lane,), "the lost box's chores dropped, the lane's park owed by the source"
    with rules.mutated(["lost-return-park"]):
        assert decide_declared_claim(before, out, decl("dirty-unreturned"), {"enrollment": "e", "key": "k",
                                     "sha256": "s"}, source_region="ie").obligations == ()


def test_a_box_that_owes_only_local_chores_has_them_removed_and_nothing_else_changes() -> None:
    local = Obligation(kind="park-local", op=MV, region="uk", owner="uk-1")
    other = Obligation(kind="park-superseded", op=MV, region="ie", owner="ie-1")
    before = claim("landing", exec_="uk-1", obligations=(other, local))
    rec = record("committed")
    assert decide_declared_record(rec, before, decl("local-only"), "k", 1) == rec
    half = decide_declared_claim(before, rec, decl("local-only"),
                                 {"enrollment": "e", "key": "k", "sha256": "s"}, source_region="ie")
    assert half.obligations == (other,) and half.op.exec == "uk-1" and "evidence.target" not in half.op.journal
