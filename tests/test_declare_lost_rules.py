"""The legality table of ``--declare-lost`` and its two CASes, pure (spec §7.10 M16; :mod:`services.move.lost`). The
real-stack run is ``tests/test_declare_lost.py``."""

from __future__ import annotations

import msgspec
import pytest

from events.claim import Admission, Claim, Holder, LostBox, Obligation, Op, Predecessor, Scope
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
    loss_half_pending,
    loss_key,
    lost_op,
    region_park,
    region_park_blocks,
)
from services.sweeper.lostparks import decide_adopt, decide_region_parked, region_parks

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
    park = region_park(before, decl("dirty-unreturned"), "")
    assert half.obligations == (lane, park), "the lost box's chores dropped, the lane's park owed by the source"
    with rules.mutated(["lost-return-park", "lost-region-park"]):
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


def test_the_lost_target_release_queues_its_regions_park_and_covers_its_predecessors_in_the_same_cas() -> None:
    """§7.14 item 5: ``CoverRegionPredecessors`` in the CAS that queues the lost region's whole-location park, owed
    by a live box of that region or by the region (its next live box adopts it); never owed by the lost box."""
    there = Admission(session=3, box="uk-1", generation="g3", region="uk", predecessor=Predecessor(
        session=2, box="uk-1", generation="g2"), predecessor_region="uk")
    elsewhere = Admission(session=4, box="uk-1", generation="g4", region="uk", predecessor=Predecessor(
        session=3, box="ie-1", generation="g1"), predecessor_region="ie")
    before = msgspec.structs.replace(claim("landing"), holder=Holder(
        incarnation=INC, location=f"instances/{HOST}/{INC}/", admissions=(there, elsewhere)))
    out = decide_declared_record(record("landing"), before, decl("owes-evidence"), "k", 900_000)
    ref = {"enrollment": "e", "key": "k", "sha256": "s"}
    half = decide_declared_claim(before, out, decl("owes-evidence"), ref, source_region="ie")
    park = Obligation(kind="park-superseded", op=lost_op(MV), region="uk", owner="@region",
                      scope=Scope(location=f"instances/{HOST}/{INC}", incarnation=INC, evidence_at=5000))
    assert half.obligations == (park,)
    assert half.holder is not None and [a.covered for a in half.holder.admissions] == [True, False]
    owned = decide_declared_claim(before, out, decl("owes-evidence"), ref, source_region="ie", region_box="uk-2")
    assert [o.owner for o in owned.obligations] == ["uk-2"]
    assert decide_declared_claim(half, out, decl("owes-evidence"), ref, source_region="ie") == half, "idempotent"
    with rules.mutated(["lost-region-park"]):
        off = decide_declared_claim(before, out, decl("owes-evidence"), ref, source_region="ie")
        assert off.obligations == () and off.holder is not None and not any(a.covered for a in off.holder.admissions)
    # M-R27: unadopted, it blocks a move into its region only; adopted, every move
    assert region_park_blocks(park, "uk") and not region_park_blocks(park, "fr")
    assert region_park_blocks(msgspec.structs.replace(park, owner="uk-2"), "fr")


def test_the_regions_next_live_box_adopts_the_park_then_acknowledges_it() -> None:
    park = Obligation(kind="park-superseded", op=lost_op(MV), region="uk", owner="@region",
                      scope=Scope(location=f"instances/{HOST}/{INC}", incarnation=INC, evidence_at=5000))
    at_rest = claim("serving", exec_="ie-1", obligations=(park,))
    at_rest = msgspec.structs.replace(at_rest, op=Op(kind="serving", exec="ie-1", participants=("ie-1",)))
    assert region_parks(at_rest, "uk", "uk-2") == [park] and region_parks(at_rest, "ie", "ie-1") == []
    adopted = decide_adopt(at_rest, park, "uk-2")
    assert isinstance(adopted, Claim) and [o.owner for o in adopted.obligations] == ["uk-2"]
    assert region_parks(adopted, "uk", "uk-3") == [], "adopted: another box leaves it"
    assert not isinstance(decide_adopt(adopted, park, "uk-3"), Claim), "adopted once"
    mine = adopted.obligations[0]
    done = decide_region_parked(adopted, mine, 9000)
    assert isinstance(done, Claim) and done.obligations == () and done.quiet_after == {"uk": 9000}
    named = msgspec.structs.replace(at_rest, op=Op(kind="moving", id=MV, exec="ie-1", participants=("ie-1", "uk-2")))
    assert not isinstance(decide_adopt(named, park, "uk-2"), Claim), "never while an operation names the box"


def test_the_sources_recovery_waits_between_the_declarations_two_halves() -> None:
    """§7.10: the record's CAS comes first and already reads clean (``dirty`` false); a re-admission read between it
    and the claim half would be covered and leave the lost box's writes undeclared (CI, a dirty-unreturned target:
    the source admitted ``clean-return`` with no ``writes_lost``). Until the claim names the box lost, it waits."""
    dirty = record("rolling_back", Rollback(id=RB, target_phase="returning", dirty=True))
    before = claim(exec_="none")
    key = loss_key(HOST, MV, "uk-1")
    out = decide_declared_record(dirty, before, decl("dirty-unreturned"), key, 900_000)
    assert out.move is not None and out.move.rollback is not None and out.move.rollback.evidence == key
    assert loss_half_pending(out.move.rollback.evidence, before, "uk-1"), "the record's half alone: wait"
    half = decide_declared_claim(before, out, decl("dirty-unreturned"), {"enrollment": "e", "key": key, "sha256": "s"},
                                 source_region="ie")
    assert declared_lost(half, "uk-1") and not loss_half_pending(key, half, "uk-1"), "both halves: go on"
    fence = "control/box-fences/uk-1.json"  # a fenced target's evidence (§7.10 item 3), the recovery's two CASes
    assert loss_half_pending(fence, before, "uk-1") and not loss_half_pending(fence, half, "uk-1")
    assert not loss_half_pending("", before, "uk-1"), "a rollback citing no loss never waits for one"
