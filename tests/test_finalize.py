"""Finalization of a committed move (spec §7.9 steps 3-5, §6.4, §5.3, K8) on the real stack: the bucket park by
exact versions, its crash replay, the horizon, a late completion, the close and the recovery of a crashed close."""

from __future__ import annotations

import sqlite3
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import msgspec
import pytest
import pytest_asyncio

from bus.nats_log import NatsEventLog
from events import Actor, Claim
from events.base import canonical
from events.claim import Holder, Op, Scope
from events.record import LastMove, Move, MoveSource, Record
from hostmove.stackinfo import StackInfo
from kernel.ports import ManualClock
from services.box.instance.guard import host_guard
from services.box.instance.registry import Registry, RouteRow
from services.box.instance.stamps import StampBook, StampRecord
from services.box.instance.timers import Timers, TimerSpec
from services.ledger import Committed, Ledger, NoChange
from services.ledger.ledger import Crash
from services.move.finalize import Finalizer, LocalRetirement, decide_close
from services.move.follow import claim_half
from services.move.lease import LeaseTiming, StagingWork
from services.move.park import (
    FAST,
    PRODUCTION,
    Acknowledged,
    DeletedVersion,
    Parker,
    ParkError,
    ParkManifest,
    Waiting,
    destination,
    in_scope,
    location_prefix,
)
from services.objstore.port import Got, VersionEntry
from services.objstore.s3 import S3Store
from services.recovery.recovery import RecoveryPass

INC = "ab" * 32
OTHER_INC = "cd" * 32
MV = "mv_" + "f" * 26
EVIDENCE = 1_700_000_000_000
H = PRODUCTION.horizon_ms(Scope(location="x"))  # 15 min + 120 s
KIND = "park-superseded"


@pytest_asyncio.fixture(loop_scope="session", scope="module")
async def parts(stack: StackInfo, unique: Callable[[str], str]) -> AsyncIterator[tuple[S3Store, NatsEventLog, str]]:
    store = await S3Store.open(stack.s3_endpoint, stack.s3_access_key, stack.s3_secret_key, stack.s3_region)
    events = await NatsEventLog.connect(stack.nats_url)
    bucket = unique("finalize")
    await store.create_bucket(bucket)
    yield store, events, bucket
    await store.delete_bucket(bucket)
    await events.close()
    await store.close()


async def seed(store: S3Store, bucket: str, prefix: str) -> dict[tuple[str, str], bytes]:
    """Three keys with several versions each, one whose latest is a delete marker, a nested key and the
    live lock. Answers every non-marker version's body by (key, version id)."""
    bodies: dict[tuple[str, str], bytes] = {}
    for name, count in (("a.ltx", 3), ("b.ltx", 2), ("0000/c.ltx", 2)):
        for i in range(count):
            body = f"{prefix}{name} v{i}".encode()
            won = await store.put(bucket, prefix + name, body)
            assert won.version_id is not None  # type: ignore[union-attr]
            bodies[(prefix + name, won.version_id)] = body  # type: ignore[union-attr]
    await store.delete(bucket, prefix + "b.ltx")  # a delete marker on top of b's versions
    await store.put(bucket, prefix + "lock.json", b'{"parker":"me"}')
    return bodies


def member_versions(entries: list[VersionEntry], prefix: str) -> list[VersionEntry]:
    return [e for e in entries if in_scope(e.key, prefix)]


def scope_of(host: str, inc: str = INC, evidence_at: int = EVIDENCE) -> Scope:
    return Scope(location=f"instances/{host}/{inc}", incarnation=inc, evidence_at=evidence_at)


# -- pure -------------------------------------------------------------------------------------------------


def test_scope_grammar_and_membership() -> None:
    assert location_prefix(f"instances/h/{INC}/", "h") == f"instances/h/{INC}/"
    assert location_prefix("moves/h/" + MV, "h") == f"moves/h/{MV}/"
    for bad in ("instances/other/" + INC, "superseded/h", "instances/h/not-an-incarnation", "instances", "/"):
        with pytest.raises(ParkError, match="is not a location of host"):
            location_prefix(bad, "h")
    assert not in_scope(f"instances/h/{INC}/lock.json", f"instances/h/{INC}/"), "the live lock is not data (N6)"
    assert in_scope(f"instances/h/{INC}/g-x/lock.json", f"instances/h/{INC}/")
    assert in_scope("instances/h/0000/a.ltx", "instances/h/"), "legacy level directory"
    assert not in_scope(f"instances/h/{INC}/a.ltx", "instances/h/"), "the legacy scope excludes incarnations"
    assert not in_scope(f"moves/h/{MV}/a", f"instances/h/{INC}/")


# -- the park on the real store ---------------------------------------------------------------------------


async def test_park_moves_every_exact_version_and_leaves_nothing_current(
    parts: tuple[S3Store, NatsEventLog, str], unique: Callable[[str], str]
) -> None:
    store, _, bucket = parts
    host = unique("park")
    prefix = f"instances/{host}/{INC}/"
    bodies = await seed(store, bucket, prefix)
    sibling = f"instances/{host}/{OTHER_INC}/keep.ltx"
    await store.put(bucket, sibling, b"another incarnation")
    await store.put(bucket, f"moves/{host}/{MV}/keep", b"a lane")
    before = member_versions(await store.list_versions(bucket, prefix), prefix)
    assert len(before) == 8, "seven versions and one delete marker"

    parker = Parker(store, bucket, ManualClock(EVIDENCE + H + 1))
    out = await parker.park_scope(host=host, op=MV, kind=KIND, scope=scope_of(host))

    assert out == Acknowledged((f"{KIND}-1",), EVIDENCE + H + 1)
    left = await store.list_versions(bucket, prefix)
    assert [e.key for e in left] == [prefix + "lock.json"], "every version and marker is gone; the lock stays"
    manifest = await parker.read_manifest(host, MV, f"{KIND}-1")
    assert manifest is not None
    assert {(a.key, a.version_id) for a in manifest.archive} == set(bodies), "the archive set: every non-marker"
    assert {(d.key, d.version_id) for d in manifest.deletion} == {(e.key, e.version_id) for e in before}
    assert sum(d.delete_marker for d in manifest.deletion) == 1
    dest = destination(host, MV, f"{KIND}-1")
    for a in manifest.archive:
        assert a.dest == f"{dest}{a.key}@{a.version_id}"
        got = await store.get(bucket, a.dest)
        assert isinstance(got, Got) and got.body == bodies[(a.key, a.version_id)], "the exact version was copied"
    assert len(await store.list_keys(bucket, dest)) == len(bodies) + 1, "the copies and the manifest, nothing else"
    assert isinstance(await store.get(bucket, sibling), Got), "another incarnation is outside the scope"
    assert isinstance(await store.get(bucket, f"moves/{host}/{MV}/keep"), Got), "an instances scope never touches moves"


@pytest.mark.parametrize("point", ["after_copies", "after_manifest", "after_delete"])
async def test_a_replay_after_a_crash_finishes_without_duplicating(
    parts: tuple[S3Store, NatsEventLog, str], unique: Callable[[str], str], point: str
) -> None:
    store, _, bucket = parts
    host = unique("replay")
    prefix = f"instances/{host}/{INC}/"
    bodies = await seed(store, bucket, prefix)
    clock = ManualClock(EVIDENCE + H + 1)
    crashed: list[str] = []

    def crash_once(at: str) -> None:
        if at == point and not crashed:
            crashed.append(at)
            raise Crash(at)

    with pytest.raises(Crash):
        await Parker(store, bucket, clock, faults=crash_once).park_scope(host=host, op=MV, kind=KIND,
                                                                         scope=scope_of(host))
    assert member_versions(await store.list_versions(bucket, prefix), prefix), "the crash left work to finish"
    out = await Parker(store, bucket, clock).park_scope(host=host, op=MV, kind=KIND, scope=scope_of(host))

    assert isinstance(out, Acknowledged) and out.events == (f"{KIND}-1",), "one event, not a second snapshot"
    assert member_versions(await store.list_versions(bucket, prefix), prefix) == []
    dest = destination(host, MV, f"{KIND}-1")
    archived = await store.list_versions(bucket, dest)
    assert len(archived) == len(bodies) + 1, "one version per copy and one manifest: nothing was copied twice"
    assert all(not e.is_delete_marker for e in archived)


async def test_the_acknowledgement_waits_for_evidence_plus_h(
    parts: tuple[S3Store, NatsEventLog, str], unique: Callable[[str], str]
) -> None:
    store, _, bucket = parts
    host = unique("horizon")
    prefix = f"instances/{host}/{INC}/"
    await seed(store, bucket, prefix)
    clock = ManualClock(EVIDENCE + 5_000)
    parker = Parker(store, bucket, clock)

    first = await parker.park_scope(host=host, op=MV, kind=KIND, scope=scope_of(host))
    assert isinstance(first, Waiting) and first.until == EVIDENCE + H + 1
    assert first.events == (f"{KIND}-1",), "it parks at once and waits only to acknowledge"
    assert member_versions(await store.list_versions(bucket, prefix), prefix) == []
    clock.advance(EVIDENCE + H - clock.now_ms())
    assert isinstance(await parker.park_scope(host=host, op=MV, kind=KIND, scope=scope_of(host)), Waiting), (
        "a listing at exactly evidence_at + H is not later than it"
    )
    clock.advance(1)
    done = await parker.park_scope(host=host, op=MV, kind=KIND, scope=scope_of(host))
    assert done == Acknowledged((f"{KIND}-1",), EVIDENCE + H + 1)

    fast_clock = ManualClock(EVIDENCE)
    fast = Parker(store, bucket, fast_clock, timing=FAST)
    assert isinstance(await fast.park_scope(host=host, op=MV, kind="park-staging", scope=scope_of(host)), Waiting)
    fast_clock.advance(FAST.horizon_ms(scope_of(host)) + 1)
    assert isinstance(await fast.park_scope(host=host, op=MV, kind="park-staging", scope=scope_of(host)), Acknowledged)


async def test_a_waiting_park_touches_nothing_again_until_its_horizon() -> None:
    """Every pass of a host calls its waiting parks (a scan's pass each minute, for the 17 minutes of H): a call
    before the horizon answers the Waiting of the call that parked, without a request; the first call after it lists,
    parks what landed late and acknowledges; a new process (another Parker) replays from the manifests."""
    from services.objstore.memory import MemoryStore

    store, bucket, host = MemoryStore(), "memo-bucket", "memo.example"
    await store.create_bucket(bucket)
    prefix = f"instances/{host}/{INC}/"
    await seed(store, bucket, prefix)  # type: ignore[arg-type]
    clock = ManualClock(EVIDENCE + 1_000)
    parker = Parker(store, bucket, clock)
    first = await parker.park_scope(host=host, op=MV, kind=KIND, scope=scope_of(host))
    assert isinstance(first, Waiting)
    await store.put(bucket, prefix + "0001/late.ltx", b"landed after the park")
    requests = sum(store.faults.calls.values())
    clock.advance(EVIDENCE + H - clock.now_ms())  # at the horizon, not later than it
    assert await parker.park_scope(host=host, op=MV, kind=KIND, scope=scope_of(host)) == first
    assert sum(store.faults.calls.values()) == requests, "a call before the horizon sends no request"
    replayed = await Parker(store, bucket, clock).park_scope(host=host, op=MV, kind=KIND, scope=scope_of(host))
    assert isinstance(replayed, Waiting) and replayed.events == (f"{KIND}-1", f"{KIND}-2"), "a new process lists"
    clock.advance(1)
    done = await parker.park_scope(host=host, op=MV, kind=KIND, scope=scope_of(host))
    assert isinstance(done, Acknowledged) and done.events == (f"{KIND}-1", f"{KIND}-2")
    assert [e.key for e in await store.list_versions(bucket, prefix)] == [prefix + "lock.json"]


async def test_a_late_completion_is_parked_by_the_verification_listing(
    parts: tuple[S3Store, NatsEventLog, str], unique: Callable[[str], str]
) -> None:
    store, _, bucket = parts
    host = unique("late")
    prefix = f"instances/{host}/{INC}/"
    await seed(store, bucket, prefix)
    clock = ManualClock(EVIDENCE + 1_000)
    parker = Parker(store, bucket, clock)
    assert isinstance(await parker.park_scope(host=host, op=MV, kind=KIND, scope=scope_of(host)), Waiting)

    late = await store.put(bucket, prefix + "0001/late.ltx", b"accepted before the evidence, landed after the park")
    clock.advance(H)
    out = await parker.park_scope(host=host, op=MV, kind=KIND, scope=scope_of(host))

    assert isinstance(out, Acknowledged) and out.events == (f"{KIND}-1", f"{KIND}-2")
    assert member_versions(await store.list_versions(bucket, prefix), prefix) == []
    second = await parker.read_manifest(host, MV, f"{KIND}-2")
    assert second is not None
    assert [(a.key, a.version_id) for a in second.archive] == [(prefix + "0001/late.ltx", late.version_id)]  # type: ignore[union-attr]
    got = await store.get(bucket, second.archive[0].dest)
    assert isinstance(got, Got) and got.body.startswith(b"accepted before")


# -- the close --------------------------------------------------------------------------------------------


def moving_claim(host: str) -> Claim:
    location = f"instances/{host}/{INC}/"
    return Claim(host=host, gen=1, holder=Holder(incarnation=INC, location=location, generation="g1", stamp=3,
                                                  session=3),
                 op=Op(kind="moving", id=MV, exec="ie-1", participants=("ie-1", "uk-1")))


def committed_pair(host: str, *, committed_at: int) -> tuple[Claim, Record]:
    """A claim at landing/committed with both obligations, built by the real follower, and its record."""
    moving = moving_claim(host)
    flipped = Record(host=host, gen=1, move=Move(id=MV, incarnation=INC, to="uk", from_="ie", state="landing",
                                                cut_phase="flipped", source=MoveSource(evidence="stopped-source.json")))
    landing = claim_half(moving, flipped)
    assert isinstance(landing, Claim)
    assert flipped.move is not None
    record = msgspec.structs.replace(flipped, move=msgspec.structs.replace(
        flipped.move, state="committed", committed_at=committed_at, opened_at=committed_at + 10))
    claim = claim_half(landing, record)
    assert isinstance(claim, Claim) and len(claim.obligations) == 2
    return claim, record


async def put(ledger: Ledger, state: Claim | Record) -> None:
    if isinstance(state, Claim):
        claim = state
        out: object = await ledger.transition("claim", state.host, "test-setup", lambda cur: claim)
    else:
        record = state
        out = await ledger.transition("record", state.host, "test-setup", lambda cur: record)
    assert isinstance(out, Committed)


def test_close_waits_for_both_parks_and_the_open() -> None:
    claim, record = committed_pair("h", committed_at=EVIDENCE)
    assert record.move is not None
    parked = msgspec.structs.replace(record, move=msgspec.structs.replace(record.move, source_parked_at=EVIDENCE))
    waiting = decide_close(parked, claim, move_id=MV, now_ms=1)
    assert isinstance(waiting, NoChange) and "park-staging" in waiting.reason
    bare = msgspec.structs.replace(claim, obligations=())
    assert parked.move is not None
    unopened = msgspec.structs.replace(parked, move=msgspec.structs.replace(parked.move, opened_at=None))
    assert isinstance(decide_close(unopened, bare, move_id=MV, now_ms=1), NoChange)
    closed = decide_close(parked, bare, move_id=MV, now_ms=7)
    assert isinstance(closed, Record) and closed.move is None
    assert closed.last_move == LastMove(id=MV, outcome="done", at=7)


async def setup_close(
    parts: tuple[S3Store, NatsEventLog, str], unique: Callable[[str], str], name: str
) -> tuple[str, Ledger, ManualClock, Parker]:
    store, events, bucket = parts
    host = f"{unique(name)}.example.com"
    clock = ManualClock(EVIDENCE + 1_000)
    ledger = Ledger(store, events, clock, Actor(service="finalize", pid=1, nonce="t"), bucket)
    claim, record = committed_pair(host, committed_at=EVIDENCE)
    await put(ledger, claim)
    await put(ledger, record)
    await seed(store, bucket, f"instances/{host}/{INC}/")
    await seed(store, bucket, f"moves/{host}/{MV}/")
    return host, ledger, clock, Parker(store, bucket, clock)


async def source_box(box_dir: Path, host: str, clock: ManualClock) -> tuple[StampBook, Registry, Timers, Path]:
    """The source box before the move: an active stamp record, a tagged SQLite database and files directory,
    the row held by the move, and the host's timers."""
    stamps, registry, timers = (StampBook.open(box_dir, clock), Registry.open(box_dir, clock),
                                Timers.open(box_dir, clock))
    db = box_dir / "data" / f"{host}.db"
    db.parent.mkdir(parents=True)
    with sqlite3.connect(db) as conn:
        conn.execute("CREATE TABLE t (x)")
        conn.execute("INSERT INTO t VALUES (1)")
    (box_dir / "data" / host).mkdir()
    (box_dir / "data" / host / "upload.bin").write_bytes(b"file")

    async def before_the_flip() -> Claim:
        return moving_claim(host)

    async with host_guard(box_dir, host, before_the_flip, clock=clock) as guarded:
        stamps.init_record(guarded, "ie-1")
        stamps.tag(guarded, INC, "db", db, 3)
        stamps.tag(guarded, INC, "files", box_dir / "data" / host, 3)
    registry.insert(RouteRow(host=host, incarnation=INC))
    assert registry.hold(host, "moving", MV)
    timers.replace_timers(host, [TimerSpec(name="tick", every_ms=60_000)])
    return stamps, registry, timers, db


async def test_the_full_close(
    parts: tuple[S3Store, NatsEventLog, str], unique: Callable[[str], str], tmp_path: Path
) -> None:
    store, events, bucket = parts
    host, ledger, clock, parker = await setup_close(parts, unique, "close")
    stamps, registry, timers, db = await source_box(tmp_path, host, clock)
    assert stamps.record(host, INC) == StampRecord(host, INC, 3, ())

    async def read_claim() -> Claim | None:
        return (await ledger.read_claim(host)).state

    local = LocalRetirement(tmp_path, stamps, registry, timers, read_claim, clock)
    source = Finalizer("ie-1", ledger, parker, events=events, local_retire=local)
    target = Finalizer("uk-1", ledger, parker, events=events)

    early = await source.source_park(host, MV)
    assert not early.done and early.wake_at == EVIDENCE + H + 1, "no acknowledgement before evidence_at + H"
    record = (await ledger.read_record(host)).state
    assert record is not None and record.move is not None and record.move.source_parked_at is None
    assert len((await ledger.read_claim(host)).state.obligations) == 2  # type: ignore[union-attr]
    assert db.exists() and registry.get(host) is not None, "the local park follows the acknowledged bucket park"
    wrong = await source.source_park(host, "mv_" + "z" * 26)
    assert not wrong.done and "not mv_" in wrong.reason, "K5: another op id is refused"

    clock.advance(H)
    first = await source.source_park(host, MV)
    assert first.done and "park-staging" in first.reason, "the source's part is over; the close waits for staging"
    parked = tmp_path / ".parked" / f"superseded-{MV}" / "park-superseded-local" / host
    assert not db.exists() and (parked / db.name).exists(), "the database was renamed into .parked, not deleted"
    assert (parked / host / "upload.bin").read_bytes() == b"file"
    assert stamps.record(host, INC) == StampRecord(host, INC, None, (3,)), "the installation's stamp is retired"
    assert registry.get(host) is None and timers.list(host) == [], "the held row and the timers are gone"
    record = (await ledger.read_record(host)).state
    claim = (await ledger.read_claim(host)).state
    assert record is not None and record.move is not None and record.move.source_parked_at == clock.now_ms()
    assert claim is not None and [o.kind for o in claim.obligations] == ["park-staging"]
    assert claim.op.kind == "landing", "the claim is not released while an obligation remains"

    # §7.3: a staging retirement takes the staging-work lease first; a staging writer holding it makes it wait
    timing = LeaseTiming(ttl_ms=60_000, skew_ms=10, signature_age_ms=100)
    leased = Finalizer("uk-1", ledger, parker, events=events, staging_lease=timing, staging_region="uk")
    writer = StagingWork(ledger.store, ledger.bucket, clock, timing, region="uk", host=host, op_id=MV,
                         holder="ie-1/round")
    await writer.acquire()
    blocked = await leased.staging_park(host, MV)
    assert not blocked.done and "staging lease" in blocked.reason and blocked.wake_at is not None
    assert [o.kind for o in (await ledger.read_claim(host)).state.obligations] == ["park-staging"]  # type: ignore[union-attr]
    await writer.release()
    second = await leased.staging_park(host, MV)
    assert second.done and second.reason.startswith("closed")
    record = (await ledger.read_record(host)).state
    claim = (await ledger.read_claim(host)).state
    assert record is not None and record.move is None and record.last_move == LastMove(id=MV, outcome="done",
                                                                                       at=clock.now_ms())
    assert claim is not None and (claim.op.kind, claim.op.exec, claim.obligations) == ("serving", "uk-1", ())
    assert claim.quiet_after == {"ie": EVIDENCE + H, "uk": EVIDENCE + H}
    for prefix in (f"instances/{host}/{INC}/", f"moves/{host}/{MV}/"):
        assert member_versions(await store.list_versions(bucket, prefix), prefix) == []
    again = await target.staging_park(host, MV)
    assert again.done, "a replay after the close changes nothing"
    assert (await ledger.read_claim(host)).state == claim


async def test_a_crashed_close_is_finished_by_the_recovery_pass(
    parts: tuple[S3Store, NatsEventLog, str], unique: Callable[[str], str]
) -> None:
    _, events, _ = parts
    host, ledger, clock, parker = await setup_close(parts, unique, "crash")
    clock.advance(H)
    seen: list[str] = []

    def crash_once(point: str) -> None:
        if point not in seen:
            seen.append(point)
            raise Crash(point)

    source = Finalizer("ie-1", ledger, parker, faults=crash_once)
    with pytest.raises(Crash):
        await source.source_park(host, MV)  # dies after source_parked_at, before dropping its obligation
    assert len((await ledger.read_claim(host)).state.obligations) == 2  # type: ignore[union-attr]
    assert (await source.source_park(host, MV)).done, "the replay drops the obligation"

    target = Finalizer("uk-1", ledger, parker, faults=crash_once)
    with pytest.raises(Crash):
        await target.staging_park(host, MV)  # dies between the record's close and the claim's release
    record = (await ledger.read_record(host)).state
    claim = (await ledger.read_claim(host)).state
    assert record is not None and record.last_move is not None and record.last_move.outcome == "done"
    assert claim is not None and claim.op.kind == "landing" and claim.obligations == ()

    report = await RecoveryPass(ledger, events).run_once()
    assert not [e for e in report.errors if host in e]
    claim = (await ledger.read_claim(host)).state
    assert claim is not None and (claim.op.kind, claim.op.exec) == ("serving", "uk-1")


async def test_a_persisted_manifest_naming_a_key_outside_the_scope_is_never_acted_on(
    parts: tuple[S3Store, NatsEventLog, str], unique: Callable[[str], str]
) -> None:
    store, _, bucket = parts
    host = unique("forged")
    prefix = f"instances/{host}/{INC}/"
    await seed(store, bucket, prefix)
    outside = await store.put(bucket, f"instances/{host}/{OTHER_INC}/keep.ltx", b"another incarnation's data")
    parker = Parker(store, bucket, ManualClock(EVIDENCE + H + 1))
    forged = ParkManifest(host=host, op=MV, event=f"{KIND}-1", location=prefix, incarnation=INC,
                          evidence_at=EVIDENCE, listed_at=EVIDENCE, archive=(),
                          deletion=(DeletedVersion(key=f"instances/{host}/{OTHER_INC}/keep.ltx",
                                                   version_id=outside.version_id or ""),))  # type: ignore[union-attr]
    await store.put(bucket, destination(host, MV, f"{KIND}-1") + "manifest.json", canonical(forged))

    with pytest.raises(ParkError, match="outside its scope"):
        await parker.park_scope(host=host, op=MV, kind=KIND, scope=scope_of(host))
    assert isinstance(await store.get(bucket, f"instances/{host}/{OTHER_INC}/keep.ltx"), Got)
    assert len(member_versions(await store.list_versions(bucket, prefix), prefix)) == 8, "nothing was deleted"


# -- an abort (§7.11) ------------------------------------------------------------------------------------


def aborted_record(host: str, *, at: int) -> Record:
    return Record(host=host, gen=1, move=Move(id=MV, incarnation=INC, to="uk", from_="ie", state="aborted",
                                              reason="aborted by operator op", updated_at=at))


def test_an_abort_owes_the_target_a_staging_park_once() -> None:
    """The claim half of an abort: phase ``aborted`` and a ``park-staging`` owned by the target, scoped to the
    lane, with the abort as its evidence time; once followed (or acknowledged) it is not owed again."""
    host = "h.example.com"
    record = aborted_record(host, at=EVIDENCE)
    followed = claim_half(moving_claim(host), record)
    assert isinstance(followed, Claim) and (followed.op.kind, followed.op.phase, followed.op.exec) == (
        "moving", "aborted", "ie-1")
    (ob,) = followed.obligations
    assert (ob.kind, ob.owner, ob.region) == ("park-staging", "uk-1", "uk")
    assert ob.scope is not None and ob.scope.location == f"moves/{host}/{MV}" and ob.scope.evidence_at == EVIDENCE
    assert isinstance(claim_half(followed, record), NoChange)
    acknowledged = msgspec.structs.replace(followed, obligations=())
    assert isinstance(claim_half(acknowledged, record), NoChange), "an acknowledged park is not owed again"
    assert isinstance(decide_close(record, followed, move_id=MV, now_ms=1), NoChange), "the park is still owed"
    unparked = decide_close(record, acknowledged, move_id=MV, now_ms=1)
    assert isinstance(unparked, NoChange) and "source" in unparked.reason
    assert record.move is not None
    parked = msgspec.structs.replace(record, move=msgspec.structs.replace(record.move, source_parked_at=5))
    closed = decide_close(parked, acknowledged, move_id=MV, now_ms=9)
    assert isinstance(closed, Record) and closed.last_move == LastMove(id=MV, outcome="aborted", at=9)


async def test_an_aborted_move_closes_on_the_source(
    parts: tuple[S3Store, NatsEventLog, str], unique: Callable[[str], str]
) -> None:
    """The whole abort on the real stack: the recovery pass writes the claim half, the target parks its staging
    lane after the horizon, the source retires its snapshots by exact versions and closes (record first,
    ``last_move = aborted``), and the claim serves on the source again with nothing owed."""
    store, events, bucket = parts
    host = f"{unique('abort')}.example.com"
    clock = ManualClock(EVIDENCE + 1_000)
    ledger = Ledger(store, events, clock, Actor(service="finalize", pid=1, nonce="t"), bucket)
    await put(ledger, moving_claim(host))
    await put(ledger, aborted_record(host, at=EVIDENCE))
    await seed(store, bucket, f"moves/{host}/{MV}/")
    snapshots = f"move-snapshots/{host}/{MV}/"
    await store.put(bucket, snapshots + "timers.json", b"[]")
    await store.put(bucket, snapshots + "timers.json", b"[1]")
    await RecoveryPass(ledger, events).run_once()
    claim = (await ledger.read_claim(host)).state
    assert claim is not None and claim.op.phase == "aborted" and [o.kind for o in claim.obligations] == [
        "park-staging"]
    parker = Parker(store, bucket, clock)
    source = Finalizer("ie-1", ledger, parker, events=events)
    target = Finalizer("uk-1", ledger, parker, events=events)
    early = await target.staging_park(host, MV)
    assert not early.done and early.wake_at is not None, "no acknowledgement before evidence_at + H"
    clock.advance(H)
    assert (await target.staging_park(host, MV)).done, "the target's part is over; the source closes"
    assert (await ledger.read_record(host)).state.move is not None  # type: ignore[union-attr]
    done = await source.source_park_unmoved(host, MV)
    assert done.done and done.reason.startswith("closed: last_move aborted"), done.reason
    record = (await ledger.read_record(host)).state
    claim = (await ledger.read_claim(host)).state
    assert record is not None and record.move is None and record.last_move is not None
    assert record.last_move.outcome == "aborted"
    assert claim is not None and (claim.op.kind, claim.op.exec, claim.obligations) == ("serving", "ie-1", ())
    assert await store.list_versions(bucket, snapshots) == [], "every snapshot version is gone"
    lane = f"moves/{host}/{MV}/"
    assert member_versions(await store.list_versions(bucket, lane), lane) == []
    assert (await source.source_park_unmoved(host, MV)).done, "a replay after the close changes nothing"
