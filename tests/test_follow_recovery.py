"""The claim follows the record (§7.5, §7.9, K4, K8) and the console's recovery pass, on the real stack."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

import msgspec
import pytest
import pytest_asyncio

from bus.nats_log import NatsEventLog
from bus.subjects import FACTS_STREAM, alert_subject
from events import Actor, Claim
from events.claim import Holder, Obligation, Op
from events.record import LastMove, Move, MoveSource, Record, Rollback
from hostmove.stackinfo import StackInfo
from kernel import rules
from kernel.ports import ManualClock
from services.ledger import Committed, Ledger, NoChange, Refusal
from services.move.follow import claim_half
from services.objstore.s3 import S3Store
from services.recovery.recovery import RecoveryPass, deadlines_passed

INC = "ab" * 32
MV = "mv_" + "a" * 26


def moving_claim(host: str = "h.example.com", **op_kw: object) -> Claim:
    op = Op(kind="moving", id=MV, exec="ie-1", participants=("ie-1", "uk-1"), **op_kw)  # type: ignore[arg-type]
    return Claim(host=host, gen=3, holder=Holder(incarnation=INC, location=f"instances/{host}/{INC}/",
                                                  generation="g1", session=3, stamp=3), op=op)


def record(host: str = "h.example.com", **move_kw: object) -> Record:
    base: dict[str, object] = dict(id=MV, incarnation=INC, to="uk", from_="ie", state="preparing")
    base.update(move_kw)
    return Record(host=host, gen=2, move=Move(**base))  # type: ignore[arg-type]


FLIPPED = dict(state="landing", cut_phase="flipped", source=MoveSource(evidence=f"moves/h/{MV}/stopped-source.json"))


def test_flip_moves_exec_to_the_target_citing_the_evidence() -> None:
    out = claim_half(moving_claim(), record(**FLIPPED))
    assert isinstance(out, Claim)
    assert (out.op.kind, out.op.phase, out.op.exec) == ("landing", "checking", "uk-1")
    assert out.op.journal["evidence.source"].endswith("stopped-source.json")
    assert isinstance(claim_half(out, record(**FLIPPED)), NoChange), "applying it again changes nothing"


def test_no_exec_without_evidence_unless_the_rule_is_mutated() -> None:
    bare = record(state="landing", cut_phase="flipped")
    assert isinstance(claim_half(moving_claim(), bare), Refusal)
    with rules.mutated(["exec-needs-evidence"]):
        assert isinstance(claim_half(moving_claim(), bare), Claim)


def test_commit_adds_the_parks_and_keeps_the_generation() -> None:
    landing = claim_half(moving_claim(), record(**FLIPPED))
    assert isinstance(landing, Claim)
    committed = claim_half(landing, record(**{**FLIPPED, "state": "committed", "committed_at": 99}))
    assert isinstance(committed, Claim) and committed.op.phase == "committed"
    assert committed.holder == landing.holder, "holder.generation is not written by the commit (R10-3)"
    kinds = sorted((o.kind, o.owner, o.region) for o in committed.obligations)
    assert kinds == [("park-staging", "uk-1", "uk"), ("park-superseded", "ie-1", "ie")]


def test_the_staging_park_is_scoped_to_the_lane_from_the_seal_bound() -> None:
    """§6.4: a staging lane's scope is ``moves/<host>/<op>`` (no trailing ``/``, the grammar INV-23 checks) and its
    ``evidence_at`` is the lane's own seal bound, seal time + staging lease TTL, persisted in the seal; not the
    commit time."""
    sealed = moving_claim(journal={"seal": {"n": 3, "staging_bound": 5_000}})
    landing = claim_half(sealed, record(**FLIPPED))
    assert isinstance(landing, Claim)
    committed = claim_half(landing, record(**{**FLIPPED, "state": "committed", "committed_at": 99}))
    assert isinstance(committed, Claim)
    (staging,) = [o for o in committed.obligations if o.kind == "park-staging"]
    assert staging.scope is not None
    assert (staging.scope.location, staging.scope.evidence_at, staging.scope.incarnation) == (
        f"moves/h.example.com/{MV}", 5_000, INC)
    odd = claim_half(moving_claim("a/b", journal={"seal": {"n": 3, "staging_bound": 5_000}}),
                     record("a/b", **FLIPPED))
    assert isinstance(odd, Claim)
    odd_committed = claim_half(odd, record("a/b", **{**FLIPPED, "state": "committed", "committed_at": 99}))
    assert isinstance(odd_committed, Claim)
    assert [o.scope.location for o in odd_committed.obligations if o.kind == "park-staging" and o.scope] == [
        f"moves/a%2Fb/{MV}"], "the host is one percent-encoded segment, as the lane's keys are"


def test_rollback_decision_makes_the_claim_restoring_with_exec_unchanged() -> None:
    landing = claim_half(moving_claim(), record(**FLIPPED))
    assert isinstance(landing, Claim)
    rb = record(**{**FLIPPED, "state": "rolling_back", "rollback": Rollback(id="rb_" + "b" * 26)})
    out = claim_half(landing, rb)
    assert isinstance(out, Claim) and out.op.kind == "restoring" and out.op.exec == "uk-1"
    assert out.op.journal["rollback.id"] == "rb_" + "b" * 26


@pytest.mark.parametrize(("outcome", "executor"), [("done", "uk-1"), ("rolled_back", "ie-1"), ("aborted", "ie-1")])
def test_release_from_last_move(outcome: str, executor: str) -> None:
    closed = Record(host="h.example.com", gen=5, last_move=LastMove(id=MV, outcome=outcome))  # type: ignore[arg-type]
    out = claim_half(moving_claim(), closed)
    assert isinstance(out, Claim) and out.op.kind == "serving" and out.op.exec == executor
    pending = msgspec.structs.replace(
        moving_claim(), obligations=(Obligation(kind="park-staging", op=MV, region="uk", owner="uk-1"),)
    )
    assert isinstance(claim_half(pending, closed), NoChange), "release waits for the move's obligations (K8)"


def test_deadline_alerts_are_pure() -> None:
    live = record(state="cutting", cut_phase="stopping", cut_deadline=100)
    assert [a.kind for a in deadlines_passed(live, 101)] == ["cut-deadline"]
    assert deadlines_passed(live, 100) == []
    landing = record(**{**FLIPPED, "landing_deadline": 50, "cut_deadline": 10**12})
    assert [a.kind for a in deadlines_passed(landing, 51)] == ["landing-deadline"]


# -- the recovery pass on the real stack ----------------------------------------------------------


@pytest_asyncio.fixture(loop_scope="session", scope="module")
async def parts(stack: StackInfo, unique: Callable[[str], str]) -> AsyncIterator[tuple[S3Store, NatsEventLog, str]]:
    store = await S3Store.open(stack.s3_endpoint, stack.s3_access_key, stack.s3_secret_key, stack.s3_region)
    events = await NatsEventLog.connect(stack.nats_url)
    bucket = unique("recovery")
    await store.create_bucket(bucket)
    yield store, events, bucket
    await store.delete_bucket(bucket)
    await events.close()
    await store.close()


async def put(ledger: Ledger, obj: str, state: Claim | Record) -> None:
    out = await ledger.transition(obj, state.host, "test-setup", lambda cur: state)  # type: ignore[arg-type,return-value]
    assert isinstance(out, Committed)


async def test_recovery_writes_claim_halves_releases_and_alerts_once(
    parts: tuple[S3Store, NatsEventLog, str], unique: Callable[[str], str]
) -> None:
    store, events, bucket = parts
    clock = ManualClock(start_ms=1_000)
    ledger = Ledger(store, events, clock, Actor(service="recovery", pid=1, nonce="r"), bucket)
    flipped_host, closed_host, late_host = (f"{unique(n)}.example.com" for n in ("flip", "closed", "late"))
    await put(ledger, "claim", moving_claim(flipped_host))
    await put(ledger, "record", record(flipped_host, **FLIPPED))
    await put(ledger, "claim", moving_claim(closed_host))
    await put(ledger, "record", Record(host=closed_host, gen=1, last_move=LastMove(id=MV, outcome="done")))
    await put(ledger, "claim", moving_claim(late_host))
    await put(ledger, "record", record(late_host, state="cutting", cut_phase="stopping", cut_deadline=500))
    recovery = RecoveryPass(ledger, events)
    report = await recovery.run_once()
    assert not [e for e in report.errors if flipped_host in e or closed_host in e or late_host in e]
    claim = (await ledger.read_claim(flipped_host)).state
    assert claim is not None and (claim.op.kind, claim.op.exec) == ("landing", "uk-1")
    released = (await ledger.read_claim(closed_host)).state
    assert released is not None and (released.op.kind, released.op.exec) == ("serving", "uk-1")
    assert f"{late_host}: cut-deadline" in report.alerts
    again = await recovery.run_once()
    assert not [a for a in again.alerts if late_host in a], "an alert is raised once"
    assert not [h for h in again.claim_halves if flipped_host in h or closed_host in h], "nothing more to follow"
    alerts = [m async for m in events.replay(FACTS_STREAM, subject=alert_subject("cut-deadline"))]
    assert any(late_host.encode() in m.data for m in alerts)


async def test_recovery_finishes_a_door_request_that_crashed_between_claim_and_record(
    parts: tuple[S3Store, NatsEventLog, str], unique: Callable[[str], str], tmp_path: object
) -> None:
    from pathlib import Path

    from kernel.ports import SystemRandom
    from services.box.roster import init_box
    from services.door.api import Door
    from services.door.auth import Identity
    from services.door.decide import MoveRequest
    from services.hosts.create import create_host
    from services.ledger import Crash

    store, events, bucket = parts
    clock = ManualClock(start_ms=5_000)
    actor = Actor(service="door", pid=1, nonce="d")
    for label, region in (("ie-1", "ie"), ("uk-1", "uk")):
        await init_box(root=Path(str(tmp_path)), label=label, region=region, store=store, bucket=bucket,
                       events=events, clock=clock, actor=actor)
    ledger = Ledger(store, events, clock, actor, bucket)
    host = f"{unique('doorcrash')}.example.com"
    assert isinstance(await create_host(ledger, host, box="ie-1", region="ie", incarnation=INC), Committed)

    def die_after_the_claim(point: str) -> None:
        if point == "after_publish":
            raise Crash(point)

    crashing = Door(Ledger(store, events, clock, actor, bucket, faults=die_after_the_claim), clock=clock,
                    rng=SystemRandom())
    with pytest.raises(Crash):
        await crashing.request_move(host, MoveRequest("uk", "manual"), Identity("alice", "operator"))
    assert (await ledger.read_record(host)).state is None
    report = await RecoveryPass(Ledger(store, events, clock, Actor(service="recovery", pid=2, nonce="r"), bucket),
                                events).run_once()
    assert host in report.records_finished
    rec = (await ledger.read_record(host)).state
    claim = (await ledger.read_claim(host)).state
    assert rec is not None and rec.move is not None and claim is not None and rec.move.id == claim.op.id


async def test_the_recovery_takes_each_transition_from_its_durable_consumer_across_restarts(
    parts: tuple[S3Store, NatsEventLog, str], stack: StackInfo, unique: Callable[[str], str]
) -> None:
    """Issue 19 item 1: no pass runs; each record flip is followed from the ledger consumer, the ones published
    while the consumer was stopped once it starts again, twice in a row (a restart, then another)."""
    import asyncio

    from services.recovery.consumer import SETTLE_S, ledger_consumer
    from tests.helpers.agents import eventually

    store, events, bucket = parts
    ledger = Ledger(store, events, ManualClock(start_ms=1_000), Actor(service="recovery", pid=3, nonce="c"), bucket)
    recovery = RecoveryPass(ledger, events)
    durable = unique("recovery")

    async def followed(host: str) -> bool:
        claim = (await ledger.read_claim(host)).state
        return claim is not None and claim.op.kind == "landing"

    def follows(host: str) -> Callable[[], Awaitable[bool]]:
        return lambda: followed(host)

    broker = ledger_consumer(stack.nats_url, recovery, workers=2, credentials=None, durable=durable)
    await broker.start()
    try:
        live = f"{unique('live')}.example.com"
        await put(ledger, "claim", moving_claim(live))
        await put(ledger, "record", record(live, **FLIPPED))
        await asyncio.sleep(SETTLE_S / 4)  # an absence: a live writer gets SETTLE_S to write its own claim half
        assert not await followed(live), "the recovery raced the writer: it follows only a settled transition"
        await eventually(follows(live), f"{live} followed while the consumer runs", 30)
        for restart in range(2):
            await broker.stop()
            missed = f"{unique(f'missed{restart}')}.example.com"
            await put(ledger, "claim", moving_claim(missed))
            await put(ledger, "record", record(missed, **FLIPPED))
            assert not await followed(missed), "nothing follows while the consumer is stopped"
            broker = ledger_consumer(stack.nats_url, recovery, workers=2, credentials=None, durable=durable)
            await broker.start()
            await eventually(follows(missed), f"{missed} followed after restart {restart + 1}", 30)
    finally:
        await broker.stop()
        await events.js.delete_consumer("HM_LEDGER", durable)
