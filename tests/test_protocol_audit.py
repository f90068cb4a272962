"""The protocol audit (issue 4 item 9; spec §7.5, §19.1, §19.2 K3, K4, K8): real histories audit clean, and each
forged history breaks exactly the rule it was forged to break.

The real histories are written by the real deciders through the real ledger into SeaweedFS, published on NATS
JetStream and read back from the stream: a move that lands and closes (door, source cut, flip, landing, commit,
parks, close, release), an abort, and a rollback whose box steps the code does not write yet (the target's
evidence and the source's return, §7.8) written as the spec's table says. Forgeries edit those real events."""

from __future__ import annotations

import functools
import os
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import pytest
import pytest_asyncio

from bus.nats_log import NatsEventLog
from bus.subjects import LEDGER_STREAM, ledger_subject
from events import Actor
from events.base import decode
from events.claim import Claim, Obligation, Op
from events.envelope import Transition
from events.record import FilesDigest, LastMove, MoveInputs, Record
from hostmove.stackinfo import StackInfo
from kernel.ports import ManualClock
from services.box.roster import Roster, RosterBox
from services.door import decide as door
from services.hosts.create import create_host
from services.ledger import Committed, Ledger, NoChange, Refusal
from services.ledger.protocol import ProtocolCheck, ProtocolFinding
from services.move import finalize, follow
from services.objstore.s3 import S3Store
from services.source import phases as src
from services.target import phases as tgt
from tests.helpers.e2e import run_move
from tests.test_move_e2e import Stack, buckets, rig  # noqa: F401 (the e2e rig's module fixture, reused here)

SRC, TGT = "ie-1", "uk-1"
EVIDENCE = "moves/h/op/stopped-source.json"
TARGET_EVIDENCE = "moves/h/op/stopped-target.json"
ROSTER = Roster(gen=1, boxes=(
    RosterBox(label=SRC, region="ie", moves_protocol=1, secrets_key_fp="sha256:x", registered_at=1),
    RosterBox(label=TGT, region="uk", moves_protocol=1, secrets_key_fp="sha256:x", registered_at=1),
))
INPUTS = MoveInputs(release="v1", env_report="r1")

Event = tuple[int, Transition]


@dataclass
class Env:
    ledger: Ledger
    events: NatsEventLog
    clock: ManualClock
    unique: Callable[[str], str]


@pytest_asyncio.fixture(loop_scope="session", scope="module")
async def env(stack: StackInfo, unique: Callable[[str], str]) -> AsyncIterator[Env]:
    store = await S3Store.open(stack.s3_endpoint, stack.s3_access_key, stack.s3_secret_key, stack.s3_region)
    events = await NatsEventLog.connect(stack.nats_url)
    bucket = unique("protocol-audit")
    await store.create_bucket(bucket)
    clock = ManualClock()
    ledger = Ledger(store, events, clock, Actor(service="audit-test", pid=os.getpid(), nonce="audit"), bucket)
    try:
        yield Env(ledger, events, clock, unique)
    finally:
        await store.delete_bucket(bucket)
        await events.close()
        await store.close()


# -- writing real histories -----------------------------------------------------------------------------------


class Writer:
    """Steps through the real ledger; every step must commit (a NoChange or refusal here is a broken fixture)."""

    def __init__(self, e: Env, host: str) -> None:
        self.e, self.host = e, host
        self.move_id = ""
        self.incarnation = ""

    def now(self) -> int:
        self.e.clock.advance(10)
        return self.e.clock.now_ms()

    async def claim(self, name: str, decide: Callable[[Claim | None], Any]) -> Claim:
        out = await self.e.ledger.transition("claim", self.host, name, decide)
        assert isinstance(out, Committed), f"{name}: {out}"
        return out.state  # type: ignore[no-any-return]

    async def record(self, name: str, decide: Callable[[Record | None], Any]) -> Record:
        out = await self.e.ledger.transition("record", self.host, name, decide)
        assert isinstance(out, Committed), f"{name}: {out}"
        return out.state  # type: ignore[no-any-return]

    async def current(self) -> tuple[Claim, Record]:
        claim = (await self.e.ledger.read_claim(self.host)).state
        record = (await self.e.ledger.read_record(self.host)).state
        assert claim is not None and record is not None
        return claim, record

    async def follow(self, name: str) -> Claim:
        _, record = await self.current()
        return await self.claim(name, lambda cur: follow.claim_half(cur, record))

    async def create_and_request(self) -> None:
        self.incarnation = "a" * 64
        assert isinstance(await create_host(self.e.ledger, self.host, box=SRC, region="ie",
                                            incarnation=self.incarnation), Committed)
        self.move_id = "mv-" + self.e.unique("op")
        now = self.now()
        await self.claim("move-request", functools.partial(
            door.decide_move_claim, host=self.host, record=None, roster=ROSTER, floor=None,
            request=door.MoveRequest(to="uk", cut="manual"), move_id=self.move_id, operator="ops", now_ms=now))
        claim = (await self.e.ledger.read_claim(self.host)).state
        assert claim is not None
        await self.record("move-record", functools.partial(
            door.decide_move_record, host=self.host, claim=claim, now_ms=now))

    def readiness(self, now: int) -> src.Readiness:
        return src.Readiness(round_at=now, target_report_at=now, target_passed=True, source_ready_at=now,
                             source_strict=True, recovery_armed=True, inputs=INPUTS)

    async def ready_and_cut(self) -> None:
        m, inc = self.move_id, self.incarnation
        now = self.now()
        await self.record("ready", lambda cur: src.decide_ready(cur, m, inc, self.readiness(now), now, src.FAST))
        claim, _ = await self.current()
        await self.record("cut", lambda cur: door.decide_cut(cur, host=self.host, claim=claim, now_ms=self.now()))

    async def cut_to_flip(self) -> None:
        m, inc = self.move_id, self.incarnation
        now = self.now()
        await self.record("admitted", lambda cur: src.decide_admit(cur, m, inc, self.readiness(now), now, src.FAST))
        await self.record("stopping", lambda cur: src.decide_enter(cur, m, inc, "stopping", self.now()))
        await self.record("stopped", lambda cur: src.decide_enter(cur, m, inc, "stopped", self.now(),
                                                                  evidence=EVIDENCE))
        await self.claim("exec-none", lambda cur: src.decide_exec_none(cur, m, SRC, EVIDENCE, {"timers": "v1"}))
        await self.record("staged", lambda cur: src.decide_enter(cur, m, inc, "staged", self.now()))
        await self.claim("seal", lambda cur: src.decide_seal(cur, m, SRC, {"n": 7, "replica": {"a": "v1"}}))
        await self.record("archived", lambda cur: src.decide_enter(cur, m, inc, "archived", self.now()))
        files = FilesDigest(plain="p", sealed="s", bytes=10, entries=1)
        await self.record("files", lambda cur: src.decide_files_digest(cur, m, inc, files, self.now()))
        await self.claim("sealed", lambda cur: src.decide_sealed(cur, m, SRC, {"files": "v1"}))
        await self.record("flip", lambda cur: src.decide_flip(cur, m, inc, self.now(), src.FAST))
        await self.follow("flip-claim")

    async def land_to(self, last: str) -> None:
        expect = tgt.Expect(self.move_id, self.incarnation, TGT)
        await self.claim("touch", lambda cur: tgt.decide_touch(cur, expect, "uk"))
        for phase in tgt.LANDING_PHASES[: tgt.LANDING_PHASES.index(last) + 1]:
            sha = "d" * 64 if phase == "probing" else ""
            await self.record(f"landing-{phase}", functools.partial(
                tgt.decide_enter, expect=expect, phase=phase, now_ms=self.now(), installed_db_sha256=sha))

    async def commit_and_close(self) -> None:
        m, inc = self.move_id, self.incarnation
        expect = tgt.Expect(m, inc, TGT)
        await self.record("commit", lambda cur: tgt.decide_commit(cur, expect, self.now()))
        await self.follow("commit-claim")
        await self.record("opened", lambda cur: tgt.decide_opened(cur, expect, self.now()))
        await self.record("source-parked", lambda cur: finalize.decide_source_parked(
            cur, move_id=m, incarnation=inc, now_ms=self.now()))
        for kind, owner in (("park-superseded", SRC), ("park-staging", TGT)):
            await self.claim(f"{kind}-acknowledged", functools.partial(
                finalize.decide_drop_obligation, move_id=m, kind=kind, owner=owner, quiet_until=self.now()))
        claim, _ = await self.current()
        await self.record("move-done", lambda cur: finalize.decide_close(cur, claim, move_id=m, now_ms=self.now()))
        await self.follow("release")


async def history(e: Env, host: str) -> list[Event]:
    """The host's claim and record transitions from the stream, in stream order."""
    out: list[Event] = []
    for obj in ("claim", "record"):
        async for msg in e.events.replay(LEDGER_STREAM, subject=ledger_subject(obj, host)):  # type: ignore[arg-type]
            out.append((msg.seq, decode(msg.data, Transition)))
    return sorted(out, key=lambda ev: ev[0])


@pytest_asyncio.fixture(loop_scope="session", scope="module")
async def done_history(env: Env) -> list[Event]:
    """A manual-cut move from ie-1 to uk-1 that lands, commits, parks, closes and releases."""
    w = Writer(env, f"{env.unique('done')}.example.com")
    await w.create_and_request()
    await w.ready_and_cut()
    await w.cut_to_flip()
    await w.land_to("probed")
    await w.commit_and_close()
    return await history(env, w.host)


def audit(events: list[Event]) -> list[ProtocolFinding]:
    """The findings for ``events`` published in this order: a forged history is a stream of its own, so its
    events are numbered 1..n in list order (real histories keep their seqs in the tests that feed them)."""
    check = ProtocolCheck()
    for position, (_, event) in enumerate(events, start=1):
        check.feed(event, position)
    return check.findings


def audit_real(events: list[Event]) -> list[ProtocolFinding]:
    """The findings for a history read from the stream, fed with its own stream sequences."""
    check = ProtocolCheck()
    for seq, event in events:
        check.feed(event, seq)
    return check.findings


def names(events: list[Event]) -> list[str]:
    return [ev.meta.name for _, ev in events]


def index(events: list[Event], name: str) -> int:
    return names(events).index(name)


def one(findings: list[ProtocolFinding], rule: str, name: str, *words: str) -> ProtocolFinding:
    assert len(findings) == 1, "\n".join(f.line() for f in findings)
    f = findings[0]
    assert (f.rule, f.name, f.severity) == (rule, name, "error"), f.line()
    assert f.what.startswith(f"[{rule}] seq {f.seq} ({name}): ")
    for word in words:
        assert word in f.what, f.line()
    return f


# -- forging: edit real events -------------------------------------------------------------------------------


def edit_claim(ev: Event, **op_changes: Any) -> Event:
    seq, t = ev
    assert t.claim is not None
    claim = msgspec.structs.replace(t.claim, op=msgspec.structs.replace(t.claim.op, **op_changes))
    return seq, msgspec.structs.replace(t, claim=claim)


def with_claim(ev: Event, claim: Claim) -> Event:
    return ev[0], msgspec.structs.replace(ev[1], claim=claim)


def with_record(ev: Event, record: Record) -> Event:
    return ev[0], msgspec.structs.replace(ev[1], record=record)


def forged(template: Event, state: Claim | Record, name: str, at_shift: int = 0) -> Event:
    """A new event of the template's object carrying ``state`` (its gen one past the template's)."""
    seq, t = template
    gen = t.gen + 1
    meta = msgspec.structs.replace(t.meta, name=name, at=t.meta.at + at_shift)
    if isinstance(state, Claim):
        return seq, Transition(kind="transition", object="claim", host=t.host, gen=gen, meta=meta,
                               claim=msgspec.structs.replace(state, gen=gen))
    return seq, Transition(kind="transition", object="record", host=t.host, gen=gen, meta=meta,
                           record=msgspec.structs.replace(state, gen=gen))


def claim_of(ev: Event) -> Claim:
    assert ev[1].claim is not None
    return ev[1].claim


def record_of(ev: Event) -> Record:
    assert ev[1].record is not None
    return ev[1].record


# -- real histories ------------------------------------------------------------------------------------------


async def test_a_real_move_that_lands_audits_clean(done_history: list[Event]) -> None:
    assert names(done_history)[:4] == ["create-begin", "create-serving", "move-request", "move-record"]
    assert names(done_history)[-2:] == ["move-done", "release"]
    release = claim_of(done_history[-1])
    assert (release.op.kind, release.op.exec) == ("serving", TGT)
    check = ProtocolCheck()
    for seq, event in done_history:
        check.feed(event, seq)
    assert check.findings == []
    assert check.events == len(done_history) and check.clean()
    assert [k for k in (claim_of(e).op.kind for e in done_history if e[1].object == "claim")] == [
        "creating", "serving", "moving", "moving", "moving", "moving", "landing", "landing", "landing",
        "landing", "landing", "serving"]


async def test_a_real_abort_audits_clean(env: Env) -> None:
    w = Writer(env, f"{env.unique('abort')}.example.com")
    await w.create_and_request()
    await w.ready_and_cut()
    claim, _ = await w.current()
    await w.record("abort", lambda cur: door.decide_abort(cur, host=w.host, claim=claim, operator="ops",
                                                          now_ms=w.now()))

    def close(cur: Record | None) -> Record | NoChange | Refusal:  # §7.11: record first, then the release
        assert cur is not None and cur.move is not None and cur.move.state == "aborted"
        return msgspec.structs.replace(cur, move=None, last_move=LastMove(id=w.move_id, outcome="aborted",
                                                                          at=w.now()))

    await w.record("move-aborted", close)
    released = await w.follow("release")
    assert (released.op.kind, released.op.exec) == ("serving", SRC)
    events = await history(env, w.host)
    assert audit_real(events) == []
    # The same history released to the target: an abort hands the host back to the source (K8).
    wrong = [*events[:-1], edit_claim(events[-1], exec=TGT, participants=(TGT,))]
    one(audit(wrong), "k8-release", "release", "after aborted named uk-1", "hands the host to ie-1")


async def test_a_rollback_through_restoring_audits_clean(env: Env) -> None:
    """§7.8: the record rolls back, the claim follows to ``restoring`` (real deciders); then the target's evidence
    (exec target -> none, K3) and the source's claim (none -> source citing it, K4), the close as rolled_back and
    the release to the source, written as §7.8's table says (no runner writes these yet)."""
    w = Writer(env, f"{env.unique('rollback')}.example.com")
    await w.create_and_request()
    await w.ready_and_cut()
    await w.cut_to_flip()
    await w.land_to("configured")
    expect = tgt.Expect(w.move_id, w.incarnation, TGT)
    await w.record("rollback", lambda cur: tgt.decide_rollback(cur, expect, "the probe failed", w.now()))
    restoring = await w.follow("rollback-claim")
    assert (restoring.op.kind, restoring.op.exec) == ("restoring", TGT)

    def op(cur: Claim | None, **changes: Any) -> Claim:
        assert cur is not None
        journal = {**cur.op.journal, "evidence.target": TARGET_EVIDENCE}
        return msgspec.structs.replace(cur, op=msgspec.structs.replace(cur.op, journal=journal, **changes))

    await w.claim("target-released", lambda cur: op(cur, exec="none"))
    await w.claim("source-claimed", lambda cur: op(cur, exec=SRC, phase="claimed"))

    def close(cur: Record | None) -> Record:
        assert cur is not None
        return msgspec.structs.replace(cur, move=None, last_move=LastMove(id=w.move_id, outcome="rolled_back"))

    await w.record("move-rolled-back", close)
    released = await w.follow("release")
    assert (released.op.kind, released.op.exec) == ("serving", SRC)
    events = await history(env, w.host)
    assert audit_real(events) == []
    # Forged: the target hands execution straight to the source, skipping none (K4: never box to box).
    i = index(events, "target-released")
    direct = [*events[:i], edit_claim(events[i], exec=SRC), *events[i + 1:]]
    one(audit(direct), "k4-exec-handoff", "target-released", "directly from uk-1 to ie-1")


async def test_the_real_end_to_end_move_audits_clean(
    buckets: Stack, unique: Callable[[str], str], tmp_path: Any  # noqa: F811
) -> None:
    """The real move of ``tests/helpers/e2e.py`` (a moveprobe process in a cgroup leaf, real SQLite replicated
    into SeaweedFS, door to close) leaves a history with no protocol finding."""
    async with rig(buckets, unique, tmp_path) as r:
        outcome = await run_move(r.host, to="uk", deployment=r.deployment, source=r.source, target=r.target)
        assert outcome.ok and outcome.closed, outcome
        events: list[Event] = []
        for obj in ("claim", "record"):
            async for msg in buckets.events.replay(LEDGER_STREAM, subject=ledger_subject(obj, r.host)):
                events.append((msg.seq, decode(msg.data, Transition)))
        events.sort(key=lambda ev: ev[0])
    kinds = [claim_of(ev).op.kind for ev in events if ev[1].object == "claim"]
    assert {"creating", "serving", "moving", "landing"} <= set(kinds) and kinds[-1] == "serving"
    assert audit_real(events) == []


# -- forged histories ----------------------------------------------------------------------------------------


def test_exec_to_a_participant_without_evidence(done_history: list[Event]) -> None:
    stripped = [edit_claim(ev, journal={k: v for k, v in claim_of(ev).op.journal.items() if k != "evidence.source"})
                if ev[1].object == "claim" else ev for ev in done_history]
    one(audit(stripped), "k4-exec-handoff", "flip-claim", "from none to uk-1", "without citing stop evidence")


def test_exec_to_someone_not_a_participant(done_history: list[Event]) -> None:
    """The flip hands execution to a box the move never named; the next claim step then moves it box to box."""
    i = index(done_history, "flip-claim")
    findings = audit([*done_history[:i], edit_claim(done_history[i], exec="us-1"), *done_history[i + 1:]])
    assert [(f.rule, f.name) for f in findings] == [("k4-exec-handoff", "flip-claim"), ("k4-exec-handoff", "touch")]
    assert "none to us-1, which is not a participant" in findings[0].what
    assert "directly from us-1 to uk-1" in findings[1].what


def test_a_claim_half_the_record_had_not_decided(done_history: list[Event]) -> None:
    """§7.5: the claim's flip half is published before the record's flip, and the record's flip (carried by the
    next record event) was written after it: the claim acted on a decision not yet taken."""
    i, j = index(done_history, "flip"), index(done_history, "flip-claim")
    assert j == i + 1
    flip_claim = done_history[j]
    rest = [(s, msgspec.structs.replace(t, meta=msgspec.structs.replace(t.meta, at=t.meta.at + 1_000)))
            for s, t in done_history[j + 1:]]
    one(audit([*done_history[:i], flip_claim, *rest]), "follows-record", "flip-claim",
        "moving -> landing but the record has not flipped", "written after it")


def test_a_rebase_is_a_new_baseline(done_history: list[Event]) -> None:
    """ARCHITECTURE §4: a rebase restates the state after lost history; nothing before it is checked against it."""
    i, j = index(done_history, "move-request"), index(done_history, "release")
    before_release = max(k for k in range(j) if done_history[k][1].object == "claim")
    seq, t = done_history[before_release]
    rebase = (seq, msgspec.structs.replace(t, kind="rebase", meta=msgspec.structs.replace(t.meta, name="rebase")))
    kept = [ev for k, ev in enumerate(done_history) if k < i or ev[1].object == "record" or k == j]
    at = kept.index(done_history[j])
    assert audit([*kept[:at], rebase, *kept[at:]]) == []
    # Without the rebase the gap shows: the serving claim's executor jumps from the source to the target.
    one(audit(kept), "k4-exec-handoff", "release", "directly from ie-1 to uk-1")


def test_exec_to_none_without_any_stop_evidence(done_history: list[Event]) -> None:
    """K3: neither the claim's journal nor the record names the evidence; the flip then cites one (K4 passes)."""
    out: list[Event] = []
    for ev in done_history:
        if ev[1].meta.name == "exec-none":
            ev = edit_claim(ev, journal={"timers": {"timers": "v1"}})
        elif ev[1].object == "record" and record_of(ev).move is not None:
            rec = record_of(ev)
            assert rec.move is not None
            move = msgspec.structs.replace(rec.move, source=msgspec.structs.replace(rec.move.source, evidence=""))
            ev = with_record(ev, msgspec.structs.replace(rec, move=move))
        out.append(ev)
    one(audit(out), "k3-exec-none", "exec-none", "from ie-1 to none", "cites stop evidence")


def test_release_while_the_record_still_carries_the_move(done_history: list[Event]) -> None:
    """The release is written while the record is still committed: reported when the record's close arrives
    later (by ``meta.at``), and also when the history ends without one."""
    i = index(done_history, "move-done")
    acknowledged = done_history[i - 1]
    assert acknowledged[1].meta.name == "park-staging-acknowledged" and claim_of(acknowledged).obligations == ()
    release = claim_of(done_history[-1])
    early = forged(acknowledged, release, "early-release")
    close = done_history[i]
    late_close = (close[0], msgspec.structs.replace(close[1], meta=msgspec.structs.replace(
        close[1].meta, at=early[1].meta.at + 1)))
    one(audit([*done_history[:i], early, late_close]), "k8-release", "early-release",
        "still carries the move, committed", "record first")
    one(audit([*done_history[:i], early]), "k8-release", "early-release", "still carries the move",
        "no later record transition settles it")


def test_a_release_published_before_the_close_it_followed_is_not_a_finding(done_history: list[Event]) -> None:
    """A crash between the record's CAS and its publish lets the relay publish the close after the release; the
    close's time shows it came first (module docstring of :mod:`services.ledger.protocol`)."""
    swapped = [*done_history[:-2], done_history[-1], done_history[-2]]
    assert audit(swapped) == []


def test_release_with_an_obligation_left(done_history: list[Event]) -> None:
    last = done_history[-1]
    owed = Obligation(kind="park-staging", op=claim_of(done_history[-3]).op.id, region="uk", owner=TGT)
    kept = [*done_history[:-1], with_claim(last, msgspec.structs.replace(claim_of(last), obligations=(owed,)))]
    one(audit(kept), "k8-release", "release", "obligations park-staging still on the claim")


def test_a_backward_landing_phase(done_history: list[Event]) -> None:
    i = index(done_history, "landing-probing")
    probing = record_of(done_history[i])
    assert probing.move is not None
    back = msgspec.structs.replace(probing, move=msgspec.structs.replace(probing.move, landing_phase="restored"))
    again = forged(forged(done_history[i], back, "x"), probing, "probing-again")
    rest = [(s, msgspec.structs.replace(t, gen=t.gen + 2, record=msgspec.structs.replace(t.record, gen=t.gen + 2)))
            if t.object == "record" and t.record is not None else (s, t) for s, t in done_history[i + 1:]]
    findings = audit([*done_history[: i + 1], forged(done_history[i], back, "replay-restored"), again, *rest])
    one(findings, "landing-phase", "replay-restored", "went back from probing to restored")


def test_a_kind_edge_that_does_not_exist(done_history: list[Event]) -> None:
    released = claim_of(done_history[-1])
    jump = msgspec.structs.replace(released, op=Op(kind="landing", id="mv-x", exec=TGT, participants=(SRC, TGT)))
    one(audit([*done_history, forged(done_history[-1], jump, "jump")]), "claim-kind", "jump",
        "serving -> landing")


def test_a_cut_phase_that_goes_back_and_a_move_state_off_its_machine(done_history: list[Event]) -> None:
    i = index(done_history, "staged")
    staged = record_of(done_history[i])
    assert staged.move is not None
    back = with_record(done_history[i], msgspec.structs.replace(
        staged, move=msgspec.structs.replace(staged.move, cut_phase="stopping")))
    findings = audit([*done_history[:i], back])
    one(findings, "cut-phase", "staged", "went back from stopped to stopping")
    j = index(done_history, "commit")
    committed = record_of(done_history[j])
    assert committed.move is not None
    off = with_record(done_history[j], msgspec.structs.replace(
        committed, move=msgspec.structs.replace(committed.move, state="preparing")))
    one(audit([*done_history[:j], off]), "move-state", "commit", "landing -> preparing")


def test_a_commit_before_the_probe_passed(done_history: list[Event]) -> None:
    """§7.9 step 1: the commit is the edge probed -> committed; a commit written at probing is reported."""
    i, j = index(done_history, "landing-probed"), index(done_history, "commit")
    committed = record_of(done_history[j])
    assert committed.move is not None
    early = with_record(done_history[j], msgspec.structs.replace(
        committed, move=msgspec.structs.replace(committed.move, landing_phase="probing")))
    one(audit([*done_history[:i], early]), "move-state", "commit",
        "landing -> committed with landing_phase probing", "writes landing_phase probed")


@pytest.mark.parametrize("outcome", ["aborted", "rolled_back"])
def test_a_close_must_name_the_outcome_its_state_allows(done_history: list[Event], outcome: str) -> None:
    i = index(done_history, "move-done")
    rec = record_of(done_history[i])
    assert rec.last_move is not None
    wrong = with_record(done_history[i], msgspec.structs.replace(
        rec, last_move=msgspec.structs.replace(rec.last_move, outcome=outcome)))
    findings = audit([*done_history[:i], wrong])
    one(findings, "move-state", "move-done", f"closed from committed as {outcome}")


def test_the_finding_carries_the_audit_shape(done_history: list[Event]) -> None:
    released = claim_of(done_history[-1])
    jump = msgspec.structs.replace(released, op=Op(kind="restoring", id="mv-x"))
    f = one(audit([*done_history, forged(done_history[-1], jump, "jump")]), "claim-kind", "jump")
    assert (f.severity, f.object, f.host) == ("error", "claim", released.host)
    assert f.line() == f"ERROR claim {released.host}: {f.what}"
    assert f.seq == len(done_history) + 1


def test_events_out_of_stream_order_are_refused(done_history: list[Event]) -> None:
    """The cross-object rules need stream order; a caller replaying subject by subject is told so."""
    check = ProtocolCheck()
    check.feed(done_history[1][1], done_history[1][0])
    with pytest.raises(ValueError, match="merge the claim and record subjects by seq"):
        check.feed(done_history[0][1], done_history[0][0])
