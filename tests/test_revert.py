"""``reverting`` (spec §7.4) and the clean rollback (§7.8): the deciders and the plans, pure. The real-stack runs
are ``tests/test_agent.py::test_a_cut_past_its_deadline_reverts_to_the_source`` and
``::test_a_target_that_will_not_start_rolls_back_to_the_source``."""

from __future__ import annotations

import msgspec
import pytest

from events.claim import Claim, Holder, Op
from events.record import FilesDigest, LastMove, Move, MoveSource, Record
from services.ledger.ledger import NoChange, Refusal
from services.move.finalize import decide_close
from services.move.follow import claim_half
from services.source.revert import decide_rev_phase, decide_revert, decide_stuck, plan_revert, verify_refused

INC = "ab" * 32
MV = "mv_" + "r" * 26
HOST = "h.example.com"


def record(cut_phase: str, state: str = "cutting", **source: object) -> Record:
    return Record(host=HOST, gen=3, move=Move(id=MV, incarnation=INC, to="uk", from_="ie", state=state,
                                              cut_phase=cut_phase, source=MoveSource(**source), updated_at=50))


def claim(exec_box: str = "ie-1", kind: str = "moving", **journal: object) -> Claim:
    return Claim(host=HOST, gen=7, holder=Holder(incarnation=INC, location=f"instances/{HOST}/{INC}/", generation="g1",
                                                 stamp=3, session=3),
                 op=Op(kind=kind, id=MV, exec=exec_box, participants=("ie-1", "uk-1"), journal=dict(journal)))


@pytest.mark.parametrize("phase", ["admitted", "stopping", "stopped", "staged", "archived"])
def test_a_cut_between_its_admission_and_its_flip_reverts(phase: str) -> None:
    out = decide_revert(record(phase), MV, INC, 99, "the cut deadline passed")
    assert isinstance(out, Record) and out.move is not None
    assert (out.move.state, out.move.cut_phase, out.move.reason) == ("reverting", phase, "the cut deadline passed")
    assert isinstance(decide_revert(out, MV, INC, 100, "again"), NoChange)


@pytest.mark.parametrize(("phase", "state"), [("requested", "cutting"), ("flipped", "landing"), ("", "ready")])
def test_nothing_else_reverts(phase: str, state: str) -> None:
    assert isinstance(decide_revert(record(phase, state), MV, INC, 99, "x"), Refusal)
    assert isinstance(decide_revert(record("stopping"), "mv_" + "z" * 26, INC, 99, "x"), Refusal)


def test_the_claim_follows_a_revert_from_stopping_without_moving_exec() -> None:
    rec = decide_revert(record("stopping"), MV, INC, 99, "late")
    assert isinstance(rec, Record)
    out = claim_half(claim(), rec)
    assert isinstance(out, Claim)
    assert (out.op.kind, out.op.exec, out.op.journal["rev_phase"]) == ("reverting", "ie-1", "evidence")
    assert "evidence.source" not in out.op.journal
    (ob,) = out.obligations
    assert (ob.kind, ob.owner, ob.region) == ("park-staging", "uk-1", "uk")
    assert isinstance(claim_half(out, rec), NoChange)


def test_the_claim_follows_a_revert_after_stopped_only_citing_the_evidence() -> None:
    """K4: execution returns from none to the source only citing its stop evidence; the recovery starts at verify."""
    rec = decide_revert(record("staged", evidence="moves/h/mv/stopped-source.json"), MV, INC, 99, "late")
    assert isinstance(rec, Record)
    out = claim_half(claim("none"), rec)
    assert isinstance(out, Claim)
    assert (out.op.exec, out.op.journal["rev_phase"]) == ("ie-1", "verify")
    assert out.op.journal["evidence.source"] == "moves/h/mv/stopped-source.json"
    bare = decide_revert(record("staged"), MV, INC, 99, "late")
    assert isinstance(bare, Record) and isinstance(claim_half(claim("none"), bare), Refusal)


def test_the_plan_walks_the_journal_and_never_goes_back_to_verify() -> None:
    rec = decide_revert(record("stopped"), MV, INC, 99, "late")
    assert isinstance(rec, Record)
    assert plan_revert(rec, claim("none"), source="ie-1", move_id=MV).kind == "follow"
    seen = []
    for phase, kind in (("evidence", "evidence"), ("verify", "verify"), ("probing", "probe"), ("probed", "open"),
                        ("opened", "close")):
        seen.append(plan_revert(rec, claim(kind="reverting", rev_phase=phase), source="ie-1", move_id=MV).kind)
        assert seen[-1] == kind
    assert plan_revert(rec, claim("uk-1", kind="reverting", rev_phase="probing"), source="ie-1",
                       move_id=MV).kind == "blocked", "K5: only the source that holds execution recovers"
    assert plan_revert(record("stopped"), claim(), source="ie-1", move_id=MV).kind == "idle"
    c = claim(kind="reverting", rev_phase="probing")
    assert isinstance(decide_rev_phase(c, MV, "ie-1", "verify", "probing"), NoChange)
    back = decide_rev_phase(claim(kind="reverting", rev_phase="probed"), MV, "ie-1", "verify", "probing")
    assert isinstance(back, Refusal), "verify never runs once probing is journaled (joint N11)"
    nxt = decide_rev_phase(c, MV, "ie-1", "probing", "probed")
    assert isinstance(nxt, Claim) and nxt.op.journal["rev_phase"] == "probed"


def test_verify_and_stuck() -> None:
    rec = record("stopped", files=FilesDigest(plain="sha256:f"), timers_sha256="t")
    assert verify_refused(rec, "sha256:f", "t") is None
    assert "files changed" in (verify_refused(rec, "sha256:g", "t") or "")
    assert "timers changed" in (verify_refused(rec, "sha256:f", "u") or "")
    reverting = decide_revert(rec, MV, INC, 99, "late")
    assert isinstance(reverting, Record)
    stuck = decide_stuck(reverting, MV, "the files changed", 100)
    assert isinstance(stuck, Record) and stuck.move is not None and stuck.move.state == "stuck"
    assert isinstance(decide_stuck(rec, MV, "x", 100), Refusal)


def test_a_revert_closes_rolled_back_only_once_opened_and_parked() -> None:
    rec = decide_revert(record("stopping"), MV, INC, 99, "late")
    assert isinstance(rec, Record) and rec.move is not None
    parked = msgspec.structs.replace(rec, move=msgspec.structs.replace(rec.move, source_parked_at=120))
    probing = claim(kind="reverting", rev_phase="probed")
    assert isinstance(decide_close(parked, probing, move_id=MV, now_ms=130), NoChange)
    opened = claim(kind="reverting", rev_phase="opened")
    assert isinstance(decide_close(rec, opened, move_id=MV, now_ms=130), NoChange), "the source's park first"
    closed = decide_close(parked, opened, move_id=MV, now_ms=130)
    assert isinstance(closed, Record) and closed.move is None
    assert closed.last_move == LastMove(id=MV, outcome="rolled_back", at=130)
    released = claim_half(opened, closed)
    assert isinstance(released, Claim) and (released.op.kind, released.op.exec) == ("serving", "ie-1")


# -- the rollback after the flip (§7.8), pure ------------------------------------------------------------------

RB = "rb_" + "q" * 26


def rolling(landing_phase: str = "probing", **rb: object) -> Record:
    from events.record import MoveLanding, Rollback

    return Record(host=HOST, gen=5, move=Move(
        id=MV, incarnation=INC, to="uk", from_="ie", state="rolling_back", cut_phase="flipped",
        landing_phase=landing_phase, landing=MoveLanding(installed_db_sha256="db1"),
        source=MoveSource(files=FilesDigest(plain="sha256:f"), timers_sha256="t", evidence="ev-s"),
        rollback=Rollback(id=RB, **rb)))  # type: ignore[arg-type]


def test_the_release_verdict_is_clean_only_when_nothing_changed_and_the_source_was_covered() -> None:
    from services.move.rollback import release_verdict

    move = rolling().move
    assert move is not None
    assert not release_verdict(move, src_covered=True, db_sha256="db1", files_plain="sha256:f", timers_sha256="t")[0]
    assert release_verdict(move, src_covered=True, db_sha256="db2", files_plain="sha256:f", timers_sha256="t")[0]
    assert release_verdict(move, src_covered=True, db_sha256="db1", files_plain="sha256:g", timers_sha256="t")[0]
    assert release_verdict(move, src_covered=True, db_sha256="db1", files_plain="sha256:f", timers_sha256="u")[0]
    assert release_verdict(move, src_covered=False, db_sha256="db1", files_plain="sha256:f", timers_sha256="t")[0]
    early = rolling("building").move
    assert early is not None
    assert not release_verdict(early, src_covered=True, db_sha256="x", files_plain="", timers_sha256="")[0], (
        "a landing that never reached its probe releases clean")


def test_the_rollback_journals_walk_forward_only() -> None:
    from services.move.rollback import decide_source_phase, decide_target_phase

    rec = rolling()
    nxt = decide_target_phase(rec, MV, "", "releasing")
    assert isinstance(nxt, Record) and nxt.move is not None and nxt.move.rollback is not None
    assert nxt.move.rollback.target_phase == "releasing"
    assert isinstance(decide_target_phase(nxt, MV, "", "releasing"), NoChange)
    assert isinstance(decide_target_phase(nxt, MV, "released", "cleaning"), Refusal)
    done = decide_source_phase(rolling(source_phase="probed"), MV, "probed", "recovered", recovered_at=9)
    assert isinstance(done, Record) and done.move is not None and done.move.rollback is not None
    assert (done.move.rollback.source_phase, done.move.rollback.recovered_at) == ("recovered", 9)
    assert isinstance(decide_source_phase(done, MV, "claimed", "verified"), NoChange), "never back"


def test_execution_goes_target_none_source_only_on_evidence() -> None:
    from services.move.rollback import decide_source_claimed, decide_target_released

    restoring = claim("uk-1", kind="restoring")
    early = decide_source_claimed(restoring, MV, "ie-1")
    assert isinstance(early, Refusal), "the source waits for the target's release"
    released = decide_target_released(restoring, MV, "uk-1", "ev-t", region="uk", evidence_at=40)
    assert isinstance(released, Claim) and released.op.exec == "none"
    assert released.op.journal["evidence.target"] == "ev-t"
    assert sorted(o.kind for o in released.obligations) == ["park-staging", "park-superseded"]
    assert all(o.owner == "uk-1" and o.scope is not None and o.scope.evidence_at == 40 for o in released.obligations)
    assert isinstance(decide_target_released(restoring, MV, "uk-1", "", region="uk", evidence_at=40), Refusal)
    claimed = decide_source_claimed(released, MV, "ie-1")
    assert isinstance(claimed, Claim) and claimed.op.exec == "ie-1"
    assert isinstance(decide_target_released(claimed, MV, "uk-1", "ev-t", region="uk", evidence_at=41), NoChange)
    bare = msgspec.structs.replace(released, op=msgspec.structs.replace(released.op, journal={}))
    assert isinstance(decide_source_claimed(bare, MV, "ie-1"), Refusal), "K4: never without the target's evidence"


def test_a_rollback_closes_only_when_recovered_opened_and_parked() -> None:
    opened = rolling(source_phase="opened", target_phase="cleaned", recovered_at=5, opened_at=6, target_parked_at=7)
    assert opened.move is not None
    parked = msgspec.structs.replace(opened, move=msgspec.structs.replace(opened.move, source_parked_at=8))
    c = claim("ie-1", kind="restoring")
    closed = decide_close(parked, c, move_id=MV, now_ms=9)
    assert isinstance(closed, Record) and closed.last_move == LastMove(id=MV, outcome="rolled_back", at=9)
    unparked = rolling(source_phase="opened", target_phase="cleaning", recovered_at=5, opened_at=6)
    assert unparked.move is not None
    unparked = msgspec.structs.replace(unparked, move=msgspec.structs.replace(unparked.move, source_parked_at=8))
    assert isinstance(decide_close(unparked, c, move_id=MV, now_ms=9), NoChange), "the target's park first"
