"""The staging-work lease and the SafeUntil rule (spec §7.3 "The staging-work lease, sealing and draining"; claim C3;
model 14, CC14, CC19), the push-only mirror's decision (M17), and the staging lane's park scope (§6.4): the pure
deciders first, then the lease on SeaweedFS."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import msgspec
import pytest
import pytest_asyncio

from events.base import decode
from events.claim import Claim, Holder, Op
from events.ids import new_incarnation, new_op_id
from events.record import Move, MoveSource, Record
from hostmove.stackinfo import StackInfo
from kernel import rules
from kernel.ports import ManualClock, SeededRandom
from services.ledger.ledger import NoChange, Refusal
from services.move.follow import (
    claim_half,
    host_segment,
    snapshot_prefix,
    staging_evidence_at,
    staging_lane,
    staging_scope_location,
)
from services.move.lease import (
    LeaseTiming,
    StagingLease,
    StagingStopped,
    StagingWork,
    decide_acquire,
    decide_release,
    decide_renew,
    lease_key,
    sign_refused,
)
from services.move.park import location_prefix
from services.objstore.port import Got
from services.source import phases
from services.source.phases import lease_timing
from services.source.staging import (
    REPLICA,
    StagedObject,
    StagedSet,
    Stager,
    covered,
    lane,
    plan_mirror,
    plan_round,
    round_tails,
)
from tests.helpers.pushonly import PushOnly
from tests.helpers.stores import Regions, regions

RNG = SeededRandom(11)
MV = new_op_id("mv", RNG)
INC = new_incarnation(RNG)
T = LeaseTiming(ttl_ms=10_000, skew_ms=500, signature_age_ms=3_000)  # SafeUntil = until - 3.5 s
NOW = 1_800_000_000_000
HOST = "h.example.com"


def take(holder: str = "ie-1/a", now: int = NOW, current: StagingLease | None = None) -> StagingLease | Refusal:
    return decide_acquire(current, region="uk", host=HOST, op_id=MV, holder=holder, now_ms=now, timing=T)


# -- the pure lease ---------------------------------------------------------------------------------------------


def test_the_lease_is_taken_renewed_by_its_holder_and_refused_to_another_until_expired_past_the_skew() -> None:
    a = take()
    assert isinstance(a, StagingLease) and (a.holder, a.until, a.taken_at) == ("ie-1/a", NOW + 10_000, NOW)
    renewed = take(now=NOW + 4_000, current=a)
    assert isinstance(renewed, StagingLease) and renewed.until == NOW + 14_000 and renewed.taken_at == NOW
    held = take("ie-1/b", NOW + 10_000 + 500, a)
    assert isinstance(held, Refusal) and "another staging writer (ie-1/a" in held.reason, "within the skew: held"
    over = take("ie-1/b", NOW + 10_000 + 501, a)
    assert isinstance(over, StagingLease) and over.holder == "ie-1/b" and over.until == NOW + 20_501
    released = decide_release(a, holder="ie-1/a")
    assert isinstance(released, StagingLease) and released.holder == "" and released.until == a.until
    assert isinstance(take("ie-1/b", NOW + 1, released), StagingLease), "a released lease is taken at once"
    assert isinstance(decide_release(a, holder="ie-1/b"), NoChange), "another holder's lease is left alone"
    other_op = take(current=msgspec.structs.replace(a, op_id=new_op_id("mv", RNG)), now=NOW + 1)
    assert isinstance(other_op, Refusal), "the same worker token for another op does not renew it"
    with pytest.raises(ValueError):
        take("")


def test_the_refusal_names_when_the_lease_frees_and_reads_the_same_every_round() -> None:
    """The reason lands in the record's move reason, written only when it changes: a countdown in it rewrote the
    record every round and woke every agent again (the simulation's seed 28 spun for 40 virtual minutes)."""
    a = take()
    assert isinstance(a, StagingLease)
    first, later = take("ie-1/b", NOW + 1, a), take("ie-1/b", NOW + 7_000, a)
    assert isinstance(first, Refusal) and isinstance(later, Refusal)
    assert first.reason == later.reason
    assert "until 2027-01-15 08:00:10 UTC" in first.reason, first.reason


def test_only_the_holder_named_in_the_object_renews() -> None:
    a = take()
    assert isinstance(a, StagingLease)
    assert isinstance(decide_renew(a, holder="ie-1/a", op_id=MV, now_ms=NOW + 9_000, timing=T), StagingLease)
    b = take("ie-1/b", NOW + 11_000, a)
    assert isinstance(b, StagingLease)
    lost = decide_renew(b, holder="ie-1/a", op_id=MV, now_ms=NOW + 11_001, timing=T)
    assert isinstance(lost, Refusal) and "lost" in lost.reason and "ie-1/b" in lost.reason
    assert isinstance(decide_renew(None, holder="ie-1/a", op_id=MV, now_ms=NOW, timing=T), Refusal)


def test_safe_until_leaves_the_skew_and_the_signature_age_before_until() -> None:
    until = NOW + 10_000
    assert T.safe_until(until) == NOW + 6_500
    assert sign_refused(until, NOW + 6_499, T) is None
    assert "passed 0 ms ago" in (sign_refused(until, NOW + 6_500, T) or "")
    assert sign_refused(None, NOW, T) == "no staging lease is held"
    prod = lease_timing(phases.PRODUCTION)
    assert prod.safe_until(0) == -(10_000 + 900_000), "production: Until - skew - 15 min"
    with pytest.raises(ValueError):
        LeaseTiming(ttl_ms=3_500, skew_ms=500, signature_age_ms=3_000)
    with pytest.raises(ValueError):
        phases.TimingProfile("bad", 1, 1, 1, 1, 1, staging_lease_ttl_s=900.0)


def test_the_lease_is_keyed_by_target_region_and_host_encoded() -> None:
    assert lease_key("uk", HOST) == "control/staging-leases/uk/h.example.com.json"
    assert lease_key("uk", "a/b c") == "control/staging-leases/uk/a%2Fb%20c.json"


# -- the push-only mirror's decision (M17) ------------------------------------------------------------------------


def test_the_mirror_plan_comes_from_the_journal_never_from_the_target() -> None:
    staged = StagedSet(v=1, host=HOST, move_id=MV, region="uk", objects={
        REPLICA + "a": StagedObject(version="va", src="s1"),
        REPLICA + "b": StagedObject(version="", src="s2"),  # pending: its write may or may not have landed
        REPLICA + "c": StagedObject(version="vc", src="s3"),
        REPLICA + "gone": StagedObject(version="vg", src="s4"),
        "files/archive.sealed": StagedObject(version="vf", src="round:x"),
    })
    plan = plan_mirror(staged, {"a": "s1", "b": "s2", "c": "s3-new", "d": "s5"})
    assert plan.keep == {"a": "va"}
    assert plan.copy == {"b": "s2", "c": "s3-new", "d": "s5"}, "pending, changed and new are copied"
    assert plan.delete == ("gone",), "only what it staged under replica/ and no longer has"


def _ltx(level: int, lo: int, hi: int) -> str:
    return f"{level:04d}/{lo:016x}-{hi:016x}.ltx"


def test_a_round_lists_each_level_after_what_the_journal_records_there() -> None:
    """Issue 19 item 9 (§7.3 rounds): the tails are the newest recorded name of each level, never a pending one;
    the level above the highest and the snapshot level are listed from their start; no recorded replica file: a
    first round lists the whole generation."""
    objects = {REPLICA + _ltx(0, 5, 5): StagedObject(version="v5", src="s5"),
               REPLICA + _ltx(0, 6, 6): StagedObject(version="v6", src="s6"),
               REPLICA + _ltx(0, 7, 7): StagedObject(version="", src="s7"),  # pending: listed again
               REPLICA + _ltx(1, 1, 3): StagedObject(version="v13", src="s13"),
               "files/archive.sealed": StagedObject(version="vf", src="round:x")}
    staged = StagedSet(v=1, host=HOST, move_id=MV, region="uk", objects=objects)
    assert round_tails(staged) == {0: _ltx(0, 6, 6), 1: _ltx(1, 1, 3), 2: "", 9: ""}
    assert round_tails(StagedSet(v=1, host=HOST, move_id=MV, region="uk", objects={
        REPLICA + _ltx(0, 1, 1): StagedObject(version="", src="s1")})) is None


def test_a_round_lists_every_level_below_the_highest_recorded_even_one_the_journal_holds_nothing_of() -> None:
    """A level-2 compaction merges and deletes every level-1 file, so a journal may record levels 0 and 2 and none
    of 1; the next level-1 file (a compaction of new level-0 files, which it deletes) must still be listed, or the
    round misses what it holds and reports fewer bytes than the cut's final mirror then copies (§7.3 ``ready``).
    A journal of a snapshot alone (a built generation before its first write) lists levels 0 and 1 from the start."""
    gap = StagedSet(v=1, host=HOST, move_id=MV, region="uk", objects={
        REPLICA + _ltx(0, 9, 9): StagedObject(version="v9", src="s9"),
        REPLICA + _ltx(2, 1, 8): StagedObject(version="v18", src="s18")})
    assert round_tails(gap) == {0: _ltx(0, 9, 9), 1: "", 2: _ltx(2, 1, 8), 3: "", 9: ""}
    snapshot = StagedSet(v=1, host=HOST, move_id=MV, region="uk", objects={
        REPLICA + _ltx(9, 1, 4): StagedObject(version="v14", src="s14")})
    assert round_tails(snapshot) == {0: "", 1: "", 9: _ltx(9, 1, 4)}


def test_a_round_copies_what_is_new_and_deletes_what_a_compaction_merged_and_the_source_dropped() -> None:
    """A new level-1 file ``[4, 6]`` covers the staged level-0 files 4 to 6: those are looked at again (one HEAD
    each, as many as were merged); the ones the source dropped go, the newest it keeps stays; a level-0 file a new
    level-1 file does not cover is not looked at; a file listed after its tail with the recorded version is kept."""
    objects = {REPLICA + _ltx(0, n, n): StagedObject(version=f"v{n}", src=f"s{n}") for n in (3, 4, 5, 6)}
    objects[REPLICA + _ltx(1, 1, 3)] = StagedObject(version="v13", src="s13")
    staged = StagedSet(v=1, host=HOST, move_id=MV, region="uk", objects=objects)
    new = {_ltx(0, 7, 7): "s7", _ltx(1, 4, 6): "s46"}
    assert covered(staged, new) == (_ltx(0, 4, 4), _ltx(0, 5, 5), _ltx(0, 6, 6))
    plan = plan_round(staged, new, frozenset({_ltx(0, 4, 4), _ltx(0, 5, 5)}))
    assert plan.copy == new
    assert plan.delete == (_ltx(0, 4, 4), _ltx(0, 5, 5))
    assert plan.keep == {_ltx(0, 3, 3): "v3", _ltx(0, 6, 6): "v6", _ltx(1, 1, 3): "v13"}
    again = plan_round(staged, {_ltx(0, 6, 6): "s6", _ltx(0, 5, 5): "s5-rewritten"})
    assert again.copy == {_ltx(0, 5, 5): "s5-rewritten"} and again.delete == () and _ltx(0, 6, 6) in again.keep


# -- the staging lane's names and park scope (§6.4, §7.3) ---------------------------------------------------------


def test_the_lane_and_snapshots_encode_the_host_as_the_evidence_and_report_keys_do() -> None:
    odd = "a/b c"
    assert host_segment(odd) == "a%2Fb%20c"
    assert staging_lane(odd, MV) == lane(odd, MV) == f"moves/a%2Fb%20c/{MV}/"
    assert snapshot_prefix(odd, MV) == f"move-snapshots/a%2Fb%20c/{MV}/"
    assert staging_lane(HOST, MV) == f"moves/{HOST}/{MV}/"


def _landing(journal: dict[str, object]) -> tuple[Claim, Record]:
    claim = Claim(host=HOST, gen=4, holder=Holder(incarnation=INC, location=f"instances/{HOST}/{INC}",
                                                  generation="g1", session=1, stamp=1),
                  op=Op(kind="landing", id=MV, exec="uk-1", participants=("ie-1", "uk-1"), phase="probed",
                        journal=journal))
    record = Record(host=HOST, gen=9, move=Move(id=MV, incarnation=INC, to="uk", from_="ie", state="committed",
                                                cut_phase="flipped", committed_at=NOW + 60_000,
                                                source=MoveSource(evidence="e")))
    return claim, record


def test_the_staging_park_scope_is_the_lane_without_a_slash_and_starts_at_seal_plus_the_lease_ttl() -> None:
    sealed = phases.decide_sealed(
        Claim(host=HOST, gen=3, op=Op(kind="moving", id=MV, exec="none", participants=("ie-1", "uk-1"),
                                      journal={"seal": {"n": 3}})),
        MV, "ie-1", {"archive.sealed": "v1"}, staging_bound=NOW + 1_800_000)
    assert isinstance(sealed, Claim) and sealed.op.journal["seal"]["staging_bound"] == NOW + 1_800_000
    claim, record = _landing(sealed.op.journal)
    out = claim_half(claim, record)
    assert isinstance(out, Claim)
    (ob,) = [o for o in out.obligations if o.kind == "park-staging"]
    assert ob.scope is not None
    assert ob.scope.location == staging_scope_location(HOST, MV) == f"moves/{HOST}/{MV}", "no trailing /"
    assert location_prefix(ob.scope.location, HOST) == staging_lane(HOST, MV), "the park accepts the scope"
    assert ob.scope.evidence_at == NOW + 1_800_000, "seal + staging lease TTL, never the commit time"
    assert ob.scope.incarnation == INC, "the staging op's holder incarnation names the archive (§6.4)"
    assert staging_evidence_at(claim.op, 7) == NOW + 1_800_000
    old, _ = _landing({"seal": {"n": 3}})
    assert staging_evidence_at(old.op, NOW + 60_000) == NOW + 60_000, "a seal without its bound: the commit time"


# -- on SeaweedFS --------------------------------------------------------------------------------------------------


@pytest_asyncio.fixture(loop_scope="session", scope="module")
async def buckets(stack: StackInfo, unique: Callable[[str], str]) -> AsyncIterator[Regions]:
    async with regions(stack, unique, "lease") as b:
        yield b


FAST_T = lease_timing(phases.FAST)  # TTL 2 s, skew 50 ms, signature age 300 ms: SafeUntil = until - 350 ms


def work(b: Regions, clock: ManualClock, host: str, holder: str, timing: LeaseTiming = FAST_T) -> StagingWork:
    return StagingWork(b.store, b.deploy, clock, timing, region="uk", host=host, op_id=MV, holder=holder)


async def lease_object(b: Regions, host: str) -> StagingLease:
    got = await b.store.get(b.deploy, lease_key("uk", host))
    assert isinstance(got, Got)
    return decode(got.body, StagingLease)


async def test_two_workers_race_for_the_lease_and_exactly_one_stages(buckets: Regions,
                                                                      unique: Callable[[str], str]) -> None:
    """A restarted agent beside a stalled one (§7.3): both take the lease at once; the CAS lets one in."""
    b, host = buckets, f"{unique('race')}.example.com"
    clock = ManualClock(NOW)
    one, two = work(b, clock, host, "ie-1/one"), work(b, clock, host, "ie-1/two")
    outcomes = await asyncio.gather(one.acquire(), two.acquire(), return_exceptions=True)
    won = [w for w, o in zip((one, two), outcomes, strict=True) if o is None]
    lost = [o for o in outcomes if isinstance(o, StagingStopped)]
    assert len(won) == 1 and len(lost) == 1, outcomes
    assert (await lease_object(b, host)).holder == won[0].holder
    loser = two if won[0] is one else one
    with pytest.raises(StagingStopped, match="another staging writer"):
        await loser.acquire()  # still held: it waits, it never stages
    await won[0].release()
    await loser.acquire()
    assert (await lease_object(b, host)).holder == loser.holder


async def test_a_round_past_safe_until_does_not_put(buckets: Regions, unique: Callable[[str], str]) -> None:
    """Model 14: a writer that paused past its lease's ``SafeUntil`` drops the request and stops the round, even
    with nobody else holding the lease; nothing reaches the target. With the rule mutated, the PUT happens."""
    b, host = buckets, f"{unique('paused')}.example.com"
    clock = ManualClock(NOW)
    w = work(b, clock, host, "ie-1/paused")
    await w.acquire()
    push = PushOnly(b.store, b.uk)
    stager = await Stager.open(w, push, b.uk, b.store, b.deploy, host, MV, "uk")
    clock.advance(2_000 - 350)  # the pause: exactly at SafeUntil
    with pytest.raises(StagingStopped, match="SafeUntil passed 0 ms ago"):
        await stager.stage_timers(b'{"timers": []}')
    assert push.writes == [] and await b.store.list_keys(b.uk, lane(host, MV)) == [], "no PUT was sent"
    assert (await lease_object(b, host)).until == NOW + 2_000, "no renewal after the pause either"
    with rules.mutated(["sign-before-safeuntil"]):
        await stager.stage_timers(b'{"timers": []}')
    assert push.writes == [f"put {lane(host, MV)}timers/timers.json"]


async def test_a_long_round_renews_before_safe_until_and_a_stalled_one_loses_its_lease(
        buckets: Regions, unique: Callable[[str], str]) -> None:
    """A live round renews while it is near ``SafeUntil`` (each check re-reads the clock); a stalled writer whose
    lease expired and was taken over cannot renew: its next request is dropped."""
    b, host = buckets, f"{unique('renew')}.example.com"
    clock = ManualClock(NOW)
    live = work(b, clock, host, "ie-1/live")
    await live.acquire()
    for _ in range(6):  # 6 x 900 ms: far past the first Until, always renewed in time
        clock.advance(900)
        await live.before_sign("a staging request")
    assert (await lease_object(b, host)).until > NOW + 5_400
    stalled = live
    clock.advance(5_000)  # stalled past Until + skew
    other = work(b, clock, host, "ie-1/restarted")
    await other.acquire()
    with pytest.raises(StagingStopped):
        await stalled.before_sign("the stalled writer's PUT")
    stalled.until = clock.now_ms() + 2_000  # even believing its lease fresh, its renewal is refused by the object
    clock.advance(1_000)
    with pytest.raises(StagingStopped, match="lost"):
        await stalled.before_sign("the stalled writer's PUT")
    assert (await lease_object(b, host)).holder == "ie-1/restarted"
