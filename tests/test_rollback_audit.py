"""``hostmove audit`` over rollbacks (spec §7.8, §7.10; issue 13 "audit"): the record histories the real deciders
write (clean, dirty, stuck then retried) audit clean under ``rollback-phase`` and ``move-state``, and a planted
transition that skips a phase, or leaves ``stuck`` without the operator's retry, is reported. The real-stack
histories are audited in ``tests/test_rollback.py``."""

from __future__ import annotations

from collections.abc import Callable

import msgspec
import pytest

from events import Actor
from events.envelope import EventMeta, Transition
from events.record import Move, MoveLanding, Record, ReturnSeal
from services.ledger.ledger import NoChange, Refusal
from services.ledger.protocol import ProtocolCheck, ProtocolFinding
from services.move import resolve, rollback
from services.target import phases

HOST = "a.example.com"
INC = "d" * 64
MV = "mv_" + "t" * 26
ACTOR = Actor(service="audit", pid=1, nonce="n")
Decide = Callable[[Record], "Record | NoChange | Refusal"]


def landing() -> Record:
    return Record(host=HOST, gen=2, move=Move(id=MV, incarnation=INC, to="uk", from_="ie", state="landing",
                                              cut_phase="flipped", landing_phase="probing", landing_deadline=10,
                                              landing=MoveLanding(installed_db_sha256="x")))


def history(steps: list[tuple[str, Decide]]) -> list[tuple[str, Record]]:
    """Each step's decider applied to the record so far (every one must decide a new record)."""
    rec = landing()
    out = [("start", rec)]
    for name, decide in steps:
        nxt = decide(rec)
        assert isinstance(nxt, Record), (name, nxt)
        rec = msgspec.structs.replace(nxt, gen=rec.gen + 1)
        out.append((name, rec))
    return out


def audit(records: list[tuple[str, Record]]) -> list[ProtocolFinding]:
    check = ProtocolCheck()
    for seq, (name, rec) in enumerate(records, start=1):
        check.feed(Transition(kind="transition", object="record", host=HOST, gen=rec.gen,
                              meta=EventMeta(name=name, actor=ACTOR, at=seq), record=rec), seq)
    return check.findings


def tgt(before: str, after: str, **fields: object) -> tuple[str, Decide]:
    return f"target-{after}", lambda r: rollback.decide_target_phase(r, MV, before, after, **fields)


def src(before: str, after: str, **fields: object) -> tuple[str, Decide]:
    return f"source-{after}", lambda r: rollback.decide_source_phase(r, MV, before, after, **fields)


TRIGGER = ("rollback", lambda r: phases.decide_rollback(r, phases.Expect(MV, INC, "uk-1"), "the probe failed", 5))
SEAL = ReturnSeal(n=3, replica={"0009/0000000000000001-0000000000000003.ltx": "v1"})
DIRTY = [TRIGGER, tgt("", "releasing"), tgt("releasing", "released", dirty=True, evidence="ev"),
         src("", "waiting"), tgt("released", "returning"), tgt("returning", "returned", seal=SEAL),
         src("waiting", "claimed"), src("claimed", "restoring"), src("restoring", "parking"),
         src("parking", "building"), src("building", "published"), src("published", "local"),
         src("local", "configured"), src("configured", "restored"), src("restored", "probing"),
         src("probing", "probed"), src("probed", "recovered", recovered_at=9), tgt("returned", "cleaning"),
         src("recovered", "opened", opened_at=10), tgt("cleaning", "cleaned", target_parked_at=11)]
CLEAN = [TRIGGER, tgt("", "releasing"), tgt("releasing", "released", evidence="ev"), src("", "waiting"),
         src("waiting", "claimed"), src("claimed", "restoring"), src("restoring", "verified"),
         src("verified", "probing"), src("probing", "probed"), src("probed", "recovered", recovered_at=9),
         tgt("released", "cleaning"), src("recovered", "opened", opened_at=10),
         tgt("cleaning", "cleaned", target_parked_at=11)]


def failures(n: int) -> list[tuple[str, Decide]]:
    return [(f"probe-failed-{i}", lambda r: rollback.decide_probe_failed(r, MV, "not ready", 20)) for i in range(n)]


def retry() -> tuple[str, Decide]:
    return "move-retry", _retry


def _retry(r: Record) -> Record | NoChange | Refusal:
    from events.claim import Claim, Holder, Op

    claim = Claim(host=HOST, gen=3, holder=Holder(incarnation=INC, location="x/"),
                  op=Op(kind="restoring", id=MV, exec="ie-1", participants=("ie-1", "uk-1")))
    return resolve.decide_retry(r, claim, 30)


@pytest.mark.parametrize("steps", [CLEAN, DIRTY], ids=["clean", "dirty"])
def test_the_rollback_journals_audit_clean(steps: list[tuple[str, Decide]]) -> None:
    assert audit(history(steps)) == []


def test_stuck_then_retried_audits_clean() -> None:
    steps = [*CLEAN[:8], *failures(rollback.RECOVERY_PROBE_ATTEMPTS), retry(), *CLEAN[8:]]
    records = history(steps)
    assert records[8 + rollback.RECOVERY_PROBE_ATTEMPTS][1].move.state == "stuck"  # type: ignore[union-attr]
    assert audit(records) == []


def one(findings: list[ProtocolFinding], name: str, *words: str) -> None:
    assert len(findings) == 1, [f.line() for f in findings]
    assert findings[0].rule == "rollback-phase" and findings[0].name == name, findings[0].line()
    for word in words:
        assert word in findings[0].what, findings[0].line()


@pytest.mark.parametrize(("steps", "planted", "at", "words"), [
    (DIRTY, "skip-install", "source-parking", ("restoring -> probing",)),
    (DIRTY, "skip-return", "target-returning", ("released -> cleaning",)),
    (CLEAN, "dirty-phase-in-a-clean-return", "source-verified", ("restoring -> parking",)),
])
def test_a_planted_transition_that_skips_a_phase_is_rejected(steps: list[tuple[str, Decide]], planted: str, at: str,
                                                             words: tuple[str, ...]) -> None:
    records = history(steps)
    i = next(k for k, (name, _r) in enumerate(records) if name == at)
    rec = records[i][1]
    assert rec.move is not None and rec.move.rollback is not None
    rb = rec.move.rollback
    if planted == "skip-install":
        rb = msgspec.structs.replace(rb, source_phase="probing")
    elif planted == "skip-return":
        rb = msgspec.structs.replace(rb, target_phase="cleaning")
    else:
        rb = msgspec.structs.replace(rb, source_phase="parking")
    forged = msgspec.structs.replace(rec, move=msgspec.structs.replace(rec.move, rollback=rb))
    one(audit([*records[:i], (planted, forged)]), planted, *words)


def test_cleaning_before_the_source_recovered_is_rejected() -> None:
    records = history(CLEAN[:8])
    rec = records[-1][1]
    assert rec.move is not None and rec.move.rollback is not None
    early = msgspec.structs.replace(rec, gen=rec.gen + 1, move=msgspec.structs.replace(
        rec.move, rollback=msgspec.structs.replace(rec.move.rollback, target_phase="cleaning")))
    one(audit([*records, ("early-clean", early)]), "early-clean", "before the source recorded recovered_at")


def test_leaving_stuck_without_the_retry_is_rejected() -> None:
    records = history([*CLEAN[:8], *failures(rollback.RECOVERY_PROBE_ATTEMPTS)])
    rec = records[-1][1]
    assert rec.move is not None and rec.move.state == "stuck"
    sneaked = msgspec.structs.replace(rec, gen=rec.gen + 1, move=msgspec.structs.replace(rec.move,
                                                                                        state="rolling_back"))
    one(audit([*records, ("sneak", sneaked)]), "sneak", "without the operator's retry")
