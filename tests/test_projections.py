"""Projections (ARCHITECTURE §8; run-store concepts, "Execution revisions"): exactly once across a
crash, keyset feed paging while a writer appends, tombstones, gaps, resync after a rebuild, and the
projector against the in-memory log and the real JetStream."""

from __future__ import annotations

import asyncio
import random
import re
import sqlite3
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from bus.memory_log import MemoryEventLog
from bus.subjects import LEDGER_STREAM, ledger_subject
from events import canonical
from hostmove.stackinfo import StackInfo
from kernel.ports import ManualClock, SeededRandom, WallClock
from projections.fold import as_json, step
from projections.runner import Projector
from projections.sample import Feeder, claim_state, record_state, transition
from projections.store import (
    MAX_SAFE_INTEGER,
    ChangesPage,
    HostView,
    ProjectionPoison,
    ProjectionStore,
    Resync,
    RevisionOverflow,
)

StoreFactory = Callable[..., ProjectionStore]


@pytest.fixture
def log() -> MemoryEventLog:
    return MemoryEventLog()


@pytest.fixture
def feeder(log: MemoryEventLog) -> Feeder:
    return Feeder(log)


@pytest.fixture
def open_store(tmp_path: Path) -> StoreFactory:
    seeds = iter(range(1, 1000))

    def make(root: Path | None = None, **kwargs: Any) -> ProjectionStore:
        kwargs.setdefault("rng", SeededRandom(next(seeds)))
        kwargs.setdefault("clock", ManualClock())
        return ProjectionStore.open(root or tmp_path / "proj", **kwargs)

    return make


@pytest.fixture
def store(open_store: StoreFactory) -> ProjectionStore:
    return open_store()


def page(result: ChangesPage | Resync) -> ChangesPage:
    assert isinstance(result, ChangesPage), result
    return result


def errors_of(store: ProjectionStore, kind: str) -> list[int]:
    return sorted(e.seq for e in store.errors(kind=kind))


# -- the pure fold -------------------------------------------------------------------------------


def test_fold_flattens_the_claim_and_the_record() -> None:
    state = claim_state("h.1", 1, op_kind="moving", op_phase="cutting", op_id="mv_x", region="us-2")
    c = transition(state, 10)
    row = step(None, c, 5).row
    assert row is not None
    assert (row.host, row.claim_gen, row.record_gen, row.op_kind, row.op_phase, row.op_id, row.exec) == (
        "h.1", 1, 0, "moving", "cutting", "mv_x", "box-a")
    assert (row.region, row.incarnation, row.deleted) == ("us-2", "a" * 64, False)
    assert (row.updated_at, row.seq) == (10, 5)
    assert row.record_json is None and '"gen":1' in str(as_json(row.claim_json) or "")

    r = transition(record_state("h.1", 1, move_state="cutting", at=100), 11)
    row2 = step(row, r, 6).row
    assert row2 is not None
    assert (row2.move_state, row2.move_to, row2.move_from, row2.cut_phase, row2.landing_phase) == (
        "cutting", "box-b", "box-a", "stopping", "probing")
    assert (row2.requested_at, row2.cut_at, row2.flipped_at, row2.committed_at) == (100, 101, 102, None)
    assert row2.op_kind == "moving" and row2.claim_json == row.claim_json  # the claim side is kept
    closed = step(row2, transition(record_state("h.1", 2), 12), 7).row
    assert closed is not None and closed.move_id == "" and closed.requested_at is None


def test_fold_notes_gaps_and_refuses_stale_events() -> None:
    first = step(None, transition(claim_state("h", 1), 1), 1).row
    gap = step(first, transition(claim_state("h", 4), 2), 2)
    assert gap.row is not None and gap.row.claim_gen == 4 and [n.kind for n in gap.notes] == ["gap"]
    stale = step(gap.row, transition(claim_state("h", 3), 3), 3)
    assert stale.row is None and [n.kind for n in stale.notes] == ["stale"]
    rebase = step(gap.row, transition(claim_state("h", 9), 4, kind="rebase"), 4)
    assert rebase.row is not None and rebase.notes == ()
    same = step(rebase.row, transition(claim_state("h", 9), 5, kind="rebase"), 5)
    assert same.row is not None and same.notes == ()  # a rebase restating the same gen is applied
    first_record = step(None, transition(record_state("h", 3), 1), 1)
    assert [n.kind for n in first_record.notes] == ["gap"]


def test_fold_tombstones() -> None:
    live = step(None, transition(claim_state("h", 1), 1), 1).row
    assert live is not None and not live.deleted
    freed = step(live, transition(claim_state("h", 2, live=False), 2), 2).row
    assert freed is not None and freed.deleted and freed.op_kind == "free" and freed.incarnation == ""
    after_record = step(freed, transition(record_state("h", 1), 3), 3).row
    assert after_record is not None and after_record.deleted  # a record event does not revive
    revived = step(after_record, transition(claim_state("h", 3), 4), 4).row
    assert revived is not None and not revived.deleted
    parking = step(freed, transition(claim_state("h", 3, op_kind="parking"), 5), 5).row
    assert parking is not None and not parking.deleted  # held: not a tombstone


# -- the source row and the revision -------------------------------------------------------------


async def test_source_identity_revision_and_position(store: ProjectionStore, feeder: Feeder,
                                                     log: MemoryEventLog) -> None:
    assert re.fullmatch(r"[0-9a-f]{32}", store.identity)
    assert (store.revision(), store.position()) == (0, 0)
    for i in range(3):
        await feeder.claim(f"h{i}")
    await feeder.record("h0", move_state="preparing")
    applied = await Projector(store, log).catch_up()
    assert applied == 4 and (store.revision(), store.position()) == (4, 4)
    views = {v.host: v for v in store.snapshot().hosts}
    assert views["h0"].revision == 4 and views["h0"].record_gen == 1 and views["h1"].revision == 2
    identity = store.identity
    store.close()
    again = ProjectionStore.open(store.root, rng=SeededRandom(99))
    assert again.identity == identity and (again.revision(), again.position()) == (4, 4)  # survives reopen


async def test_the_revision_refuses_to_overflow(
    store: ProjectionStore, feeder: Feeder, log: MemoryEventLog
) -> None:
    await feeder.claim("h")
    await Projector(store, log).catch_up()
    db = store._db()  # noqa: SLF001 - set the revision to the edge directly
    db.conn.execute("UPDATE source SET revision = ?", (MAX_SAFE_INTEGER,))
    await feeder.claim("h")
    with pytest.raises(RevisionOverflow):
        await Projector(store, log).catch_up()
    assert (store.revision(), store.position()) == (MAX_SAFE_INTEGER, 1)
    with pytest.raises(sqlite3.IntegrityError):  # and the schema refuses it too
        db.conn.execute("UPDATE source SET revision = ?", (MAX_SAFE_INTEGER + 1,))


# -- exactly once ----------------------------------------------------------------------------------


class Crash(Exception):
    pass


async def test_exactly_once_across_a_crash_in_the_middle_of_an_apply(
    open_store: StoreFactory, feeder: Feeder, log: MemoryEventLog, tmp_path: Path
) -> None:
    crashes: list[int] = []

    def crash_once(position: int) -> None:
        if not crashes:
            crashes.append(position)
            raise Crash(f"crash before commit at {position}")

    store = open_store(tmp_path / "p")
    for i in range(4):
        await feeder.claim(f"h{i}")
    await Projector(store, log).catch_up()
    before = (store.snapshot(include_deleted=True), store.revision(), store.position())

    await feeder.claim("h1")
    await feeder.record("h1", move_state="ready")
    await feeder.claim("h9")
    store.before_commit = crash_once
    with pytest.raises(Crash):
        await Projector(store, log, batch=10).catch_up()
    assert crashes == [7]  # the view was updated up to seq 7 inside the transaction, then it crashed
    assert (store.snapshot(include_deleted=True), store.revision(), store.position()) == before
    # the process dies: a new one opens the same root and sees the same state
    store.close()
    reopened = open_store(tmp_path / "p")
    assert (reopened.snapshot(include_deleted=True), reopened.revision(), reopened.position()) == before

    assert await Projector(reopened, log).catch_up() == 3
    assert (reopened.revision(), reopened.position()) == (7, 7)
    h1 = reopened.host("h1")
    assert h1 is not None and (h1.claim_gen, h1.record_gen, h1.revision) == (2, 1, 6)
    assert reopened.errors() == []  # a second application would have been noted as stale
    # replaying everything again applies nothing
    all_msgs = [m async for m in log.replay(LEDGER_STREAM)]
    result = reopened.apply_batch(all_msgs)
    assert (result.applied, result.skipped, result.revision) == (0, 7, 7)
    assert await Projector(reopened, log).catch_up() == 0


async def test_a_crash_rolls_back_the_whole_batch(
    store: ProjectionStore, feeder: Feeder, log: MemoryEventLog
) -> None:
    for i in range(10):
        await feeder.claim(f"b{i % 3}")
    msgs = [m async for m in log.replay(LEDGER_STREAM)]

    def boom(_position: int) -> None:
        raise Crash

    store.before_commit = boom
    with pytest.raises(Crash):
        store.apply_batch(msgs)
    assert (store.revision(), store.position(), store.snapshot(include_deleted=True).hosts) == (0, 0, [])
    store.before_commit = None
    assert store.apply_batch(msgs).applied == 10
    assert store.apply_batch(msgs).skipped == 10 and store.revision() == 10


async def test_the_writers_row_cache_never_outlives_a_rollback_or_another_writer(
    open_store: StoreFactory, feeder: Feeder, log: MemoryEventLog, tmp_path: Path
) -> None:
    """The rows a writer keeps between batches are its own last commit's: a rolled-back batch and a commit by
    another connection on the same root both make it read them again (else gens would look stale or gapped)."""
    for i in range(15):
        await feeder.claim(f"c{i % 3}")
        await feeder.record(f"c{i % 3}")
    msgs = [m async for m in log.replay(LEDGER_STREAM)]
    a, b = open_store(tmp_path / "shared"), open_store(tmp_path / "shared")
    a.apply_batch(msgs[:10])

    def boom(_position: int) -> None:
        raise Crash

    a.before_commit = boom
    with pytest.raises(Crash):
        a.apply_batch(msgs[10:20])
    a.before_commit = None
    assert a.apply_batch(msgs[10:20]).applied == 10
    assert b.apply_batch(msgs[20:25]).applied == 5
    assert a.apply_batch(msgs[25:]).applied == 5
    assert (a.revision(), a.position(), a.errors()) == (30, 30, [])
    single = open_store(tmp_path / "single")
    single.apply_batch(msgs)
    assert [h.state() for h in a.snapshot().hosts] == [h.state() for h in single.snapshot().hosts]


async def test_batches_coalesce_a_host_to_its_latest_revision(store: ProjectionStore, feeder: Feeder,
                                                              log: MemoryEventLog) -> None:
    for _ in range(5):
        await feeder.claim("same")
    await feeder.claim("other")
    await Projector(store, log, batch=100).catch_up()
    views = {v.host: v for v in store.snapshot().hosts}
    assert (views["same"].revision, views["same"].claim_gen, views["other"].revision) == (5, 5, 6)
    assert store.revision() == 6  # +1 per applied change, even when coalesced in one transaction


# -- poison, gaps, stale -------------------------------------------------------------------------


async def test_a_message_that_does_not_decode_is_recorded_and_raised_never_skipped_silently(
    store: ProjectionStore, feeder: Feeder, log: MemoryEventLog
) -> None:
    await feeder.claim("p1")
    await log.publish(LEDGER_STREAM, ledger_subject("claim", "p2"), b'{"kind": "transition", "truncated')
    await feeder.claim("p3")
    alerts: list[Exception] = []
    projector = Projector(store, log, on_alert=alerts.append)
    for _ in range(2):  # every attempt stops at the same message; the error is recorded once
        with pytest.raises(ProjectionPoison) as info:
            await projector.catch_up()
        assert info.value.seq == 2
    assert len(alerts) == 2
    assert (store.position(), store.revision()) == (1, 1)  # the good message before it was applied
    [entry] = store.errors(kind="decode")
    assert entry.seq == 2 and "decode_failed" in entry.reason
    assert [v.host for v in store.snapshot().hosts] == ["p1"]
    store.skip(2, "operator: a corrupt publish, see incident 7")
    assert await projector.catch_up() == 1
    assert [v.host for v in store.snapshot().hosts] == ["p1", "p3"] and errors_of(store, "skipped") == [2]


async def test_an_event_on_the_wrong_subject_is_poison(store: ProjectionStore, log: MemoryEventLog) -> None:
    t = transition(claim_state("right", 1), 1)
    await log.publish(LEDGER_STREAM, ledger_subject("claim", "wrong"), canonical(t))
    await log.publish(LEDGER_STREAM, ledger_subject("record", "right"), canonical(t))
    alerts: list[Exception] = []
    projector = Projector(store, log, poison="skip", on_alert=alerts.append)
    assert await projector.catch_up() == 0
    assert [getattr(a, "seq", None) for a in alerts] == [1, 2]
    assert errors_of(store, "decode") == [1, 2] and errors_of(store, "skipped") == [1, 2]
    assert store.position() == 2 and store.snapshot(include_deleted=True).hosts == []


async def test_gen_gaps_are_recorded_and_still_applied(store: ProjectionStore, feeder: Feeder,
                                                       log: MemoryEventLog) -> None:
    await feeder.claim("g", gen=1)
    await feeder.claim("g", gen=3)  # gen 2 never reached the stream
    await feeder.claim("g", gen=2)  # late: stale, not applied
    await feeder.claim("g", gen=8, kind="rebase")  # the stream lost history: restated, not a gap
    await feeder.claim("g", gen=9)
    await Projector(store, log).catch_up()
    assert errors_of(store, "gap") == [2] and errors_of(store, "stale") == [3]
    view = store.host("g")
    assert view is not None and view.claim_gen == 9 and store.revision() == 4 and store.position() == 5


async def test_a_stream_gap_is_recorded(store: ProjectionStore, feeder: Feeder, log: MemoryEventLog) -> None:
    await feeder.claim("s")
    await Projector(store, log).catch_up()
    await feeder.claim("s")
    log.purge(LEDGER_STREAM)  # history lost before the projection read seq 2
    await feeder.claim("s", gen=5, kind="rebase")
    await Projector(store, log).catch_up()
    assert errors_of(store, "stream_gap") == [3]
    view = store.host("s")
    assert view is not None and view.claim_gen == 5 and store.position() == 3


# -- tombstones ----------------------------------------------------------------------------------


async def test_tombstones_are_kept_and_a_live_event_revives_the_host(
    store: ProjectionStore, feeder: Feeder, log: MemoryEventLog
) -> None:
    projector = Projector(store, log)
    await feeder.claim("t.1")
    await feeder.claim("t.2")
    await projector.catch_up()
    cursor = store.cursor()
    await feeder.claim("t.1", live=False)  # purged: free, no holder
    await projector.catch_up()
    dead = store.host("t.1")
    assert dead is not None and dead.deleted and dead.revision == 3
    assert [v.host for v in store.snapshot().hosts] == ["t.2"]
    assert [v.host for v in store.snapshot(include_deleted=True).hosts] == ["t.1", "t.2"]
    feed = page(store.changes(cursor, 10))
    assert [(v.host, v.deleted, v.revision) for v in feed.changes] == [("t.1", True, 3)]
    for _ in range(3):  # tombstones are never removed by later activity
        await feeder.claim("t.2")
    await projector.catch_up()
    assert store.host("t.1") == dead
    await feeder.claim("t.1", op_kind="creating", exec_="none")  # recreated
    await projector.catch_up()
    revived = store.host("t.1")
    assert revived is not None and not revived.deleted and revived.revision == 7 > dead.revision
    assert [v.host for v in store.snapshot().hosts] == ["t.1", "t.2"]


async def test_a_host_whose_first_event_is_free_is_born_deleted(store: ProjectionStore, feeder: Feeder,
                                                                 log: MemoryEventLog) -> None:
    await feeder.claim("never", live=False)
    await Projector(store, log).catch_up()
    view = store.host("never")
    assert view is not None and view.deleted and store.snapshot().hosts == []


# -- the change feed -----------------------------------------------------------------------------


async def test_feed_paging_has_no_gap_and_no_duplicate_while_a_writer_appends(
    store: ProjectionStore, feeder: Feeder, log: MemoryEventLog
) -> None:
    rng = random.Random(20240601)
    hosts = [f"host.{i}/{'é' if i % 3 == 0 else 'x'}" for i in range(25)]
    projector = Projector(store, log, batch=rng.randint(1, 8))
    seen: set[tuple[str, int]] = set()
    replica: dict[str, HostView] = {}
    cursor: str | None = None
    for _ in range(400):
        for _ in range(rng.randint(0, 4)):  # the writer
            h = rng.choice(hosts)
            roll = rng.random()
            if roll < 0.1:
                await feeder.claim(h, live=False)
            elif roll < 0.6:
                await feeder.claim(h)
            else:
                await feeder.record(h, move_state=rng.choice([None, "preparing", "cutting", "landing"]))
        if rng.random() < 0.7:
            projector.batch = rng.randint(1, 8)
            await projector.catch_up()
        feed = page(store.changes(cursor, rng.randint(1, 6)))  # the reader
        names = [v.host for v in feed.changes]
        assert len(names) == len(set(names)), "a host twice in one page"
        revisions = [v.revision for v in feed.changes]
        assert revisions == sorted(revisions)
        for v in feed.changes:
            assert (v.host, v.revision) not in seen, "a (host, revision) pair twice"
            seen.add((v.host, v.revision))
            replica[v.host] = v
        cursor = feed.cursor
    await projector.catch_up()
    while True:
        feed = page(store.changes(cursor, 7))
        for v in feed.changes:
            assert (v.host, v.revision) not in seen
            seen.add((v.host, v.revision))
            replica[v.host] = v
        cursor = feed.cursor
        if not feed.more:
            break
    final = {v.host: v for v in store.snapshot(include_deleted=True).hosts}
    assert replica == final  # every host's final revision was seen
    assert cursor == store.cursor()
    assert page(store.changes(cursor, 10)).changes == []


async def test_a_snapshot_then_the_feed_after_it_has_no_gap(store: ProjectionStore, feeder: Feeder,
                                                            log: MemoryEventLog) -> None:
    projector = Projector(store, log)
    for i in range(6):
        await feeder.claim(f"s{i}")
    await projector.catch_up()
    snap = store.snapshot(include_deleted=True)
    assert snap.revision == 6 and snap.cursor == f"{store.identity}:6"
    view = {v.host: v for v in snap.hosts}
    await feeder.claim("s2")
    await feeder.claim("s3", live=False)
    await feeder.claim("s7")
    await feeder.record("s2", move_state="ready")
    await projector.catch_up()
    cursor = snap.cursor
    while True:
        feed = page(store.changes(cursor, 2))
        view.update({v.host: v for v in feed.changes})
        cursor = feed.cursor
        if not feed.more:
            break
    assert view == {v.host: v for v in store.snapshot(include_deleted=True).hosts}


def test_cursor_validation(store: ProjectionStore) -> None:
    for bad in ("nonsense", f"{store.identity}:-1", f"{store.identity}:01", f"{store.identity.upper()}:0",
                f"{store.identity}:0:0", f"{store.identity}:99999999999999999"):
        answer = store.changes(bad, 10)
        assert isinstance(answer, Resync) and answer.identity == store.identity, bad
    ahead = store.changes(f"{store.identity}:5", 10)
    assert isinstance(ahead, Resync) and "ahead" in ahead.reason
    foreign = store.changes(f"{'0' * 32}:0", 10)
    assert isinstance(foreign, Resync) and "another projection identity" in foreign.reason
    assert page(store.changes(None, 10)).cursor == f"{store.identity}:0"
    assert page(store.changes("", 10)).changes == []
    with pytest.raises(ValueError):
        store.changes(None, 0)


# -- rebuild -------------------------------------------------------------------------------------


async def test_rebuild_gives_a_new_identity_and_old_cursors_resync(
    open_store: StoreFactory, feeder: Feeder, log: MemoryEventLog, tmp_path: Path
) -> None:
    store = open_store(tmp_path / "r")
    reader = open_store(tmp_path / "r")  # another reader of the same root (as another process would be)
    projector = Projector(store, log, batch=3)
    for i in range(8):
        await feeder.claim(f"r{i % 4}")
    await feeder.record("r1", move_state="cutting")
    await feeder.claim("r2", live=False)
    await feeder.claim("r0", gen=9)  # a gap, recorded in both
    await projector.catch_up()
    original = store.snapshot(include_deleted=True)
    old_cursor = store.cursor()
    assert reader.identity == original.identity
    old_file = tmp_path / "r" / f"proj-{original.identity}.db"
    assert old_file.exists()

    identity = await store.rebuild(log, batch=4)
    assert identity != original.identity and store.identity == identity
    rebuilt = store.snapshot(include_deleted=True)
    assert rebuilt.hosts == original.hosts  # the same state, revisions included
    assert (rebuilt.revision, rebuilt.position) == (original.revision, original.position)
    assert errors_of(store, "gap") == [11]  # the rebuilt database recorded the same gap
    for r in (store, reader):
        answer = r.changes(old_cursor, 10)
        assert isinstance(answer, Resync) and answer.identity == identity
    assert reader.identity == identity  # the reader followed the swapped pointer
    assert not old_file.exists() and (tmp_path / "r" / f"proj-{identity}.db").exists()
    new_cursor = rebuilt.cursor
    assert page(store.changes(new_cursor, 10)).changes == []
    await feeder.claim("r3")
    await projector.catch_up()  # the projector goes on in the new database
    assert [v.host for v in page(reader.changes(new_cursor, 10)).changes] == ["r3"]
    assert errors_of(store, "gap") == [11]


async def test_rebuild_keeps_explicit_skips_and_leaves_the_view_on_failure(
    store: ProjectionStore, feeder: Feeder, log: MemoryEventLog
) -> None:
    await feeder.claim("k")
    await log.publish(LEDGER_STREAM, ledger_subject("claim", "k"), b"not json")
    await feeder.claim("k", gen=2)
    with pytest.raises(ProjectionPoison):
        await Projector(store, log).catch_up()
    store.skip(2, "operator decision")
    await Projector(store, log).catch_up()
    before = store.snapshot(include_deleted=True)
    identity = await store.rebuild(log)
    assert store.snapshot(include_deleted=True).hosts == before.hosts and errors_of(store, "skipped") == [2]
    # a new poison message makes a rebuild fail; the current projection stays and no file is left behind
    await log.publish(LEDGER_STREAM, ledger_subject("claim", "k"), b"{}")
    with pytest.raises(ProjectionPoison):
        await store.rebuild(log)
    assert store.identity == identity
    assert sorted(p.name for p in store.root.iterdir() if p.suffix == ".db") == [f"proj-{identity}.db"]


class YieldingLog:
    """The in-memory log, yielding to the event loop between replayed messages (as a network would)."""

    def __init__(self, inner: MemoryEventLog) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def replay(
        self, stream: str, *, start_seq: int = 1, subject: str | None = None
    ) -> AsyncIterator[Any]:
        async for msg in self.inner.replay(stream, start_seq=start_seq, subject=subject):
            await asyncio.sleep(0)
            yield msg


@pytest.mark.parametrize("same_instance", [True, False])
async def test_rebuild_while_the_projector_and_a_writer_run_loses_nothing(
    open_store: StoreFactory, feeder: Feeder, log: MemoryEventLog, tmp_path: Path, same_instance: bool
) -> None:
    slow = YieldingLog(log)
    store = open_store(tmp_path / "live")
    rebuilder = store if same_instance else open_store(tmp_path / "live")  # e.g. an operator's CLI
    projector = Projector(store, slow, clock=WallClock(), poll_interval=0.001, batch=3)  # type: ignore[arg-type]
    running = asyncio.create_task(projector.run())
    rng = random.Random(5)

    async def writer() -> None:
        for i in range(400):
            h = f"c{rng.randrange(17)}"
            if i % 3:
                await feeder.claim(h, live=rng.random() > 0.1)
            else:
                await feeder.record(h, move_state=rng.choice([None, "cutting"]))
            await asyncio.sleep(0)

    writing = asyncio.create_task(writer())
    identities = []
    try:
        for _ in range(3):
            await asyncio.sleep(0.005)
            identities.append(await rebuilder.rebuild(slow, batch=7))  # type: ignore[arg-type]
        await writing
        last = (await log.state(LEDGER_STREAM)).last_seq
        await wait_for(lambda: store.position() == last)
    finally:
        projector.stop()
        await asyncio.wait_for(running, 5)
    assert len(set(identities)) == 3 and store.identity == identities[-1]
    reference = open_store(tmp_path / "reference")
    await Projector(reference, log).catch_up()
    assert store.snapshot(include_deleted=True).hosts == reference.snapshot(include_deleted=True).hosts
    assert store.revision() == reference.revision()
    assert store.errors() == reference.errors() == []  # no stream gap, no stale re-application


# -- the projector ---------------------------------------------------------------------------------


async def test_the_projector_follows_new_messages(store: ProjectionStore, feeder: Feeder,
                                                  log: MemoryEventLog) -> None:
    projector = Projector(store, log, clock=WallClock(), poll_interval=30.0)  # only notify() wakes it
    task = asyncio.create_task(projector.run())
    try:
        await feeder.claim("f1")
        projector.notify()
        await wait_for(lambda: store.position() == 1)
        await feeder.claim("f2")
        projector.notify()
        await wait_for(lambda: store.position() == 2)
    finally:
        projector.stop()
        await asyncio.wait_for(task, 5)
    assert [v.host for v in store.snapshot().hosts] == ["f1", "f2"]


async def test_the_projector_polls_on_the_clock(store: ProjectionStore, feeder: Feeder,
                                                log: MemoryEventLog) -> None:
    projector = Projector(store, log, clock=WallClock(), poll_interval=0.02)
    task = asyncio.create_task(projector.run())
    try:
        for i in range(5):
            await feeder.claim(f"poll{i}")
            await asyncio.sleep(0.01)
        await wait_for(lambda: store.position() == 5)
    finally:
        projector.stop()
        await asyncio.wait_for(task, 5)


async def wait_for(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not cond():
        assert loop.time() < deadline, "timed out"
        await asyncio.sleep(0.01)


# -- against the real JetStream ----------------------------------------------------------------------


async def test_projection_over_real_jetstream(stack: StackInfo, tmp_path: Path) -> None:
    from bus.nats_log import NatsEventLog

    nlog = await NatsEventLog.connect(stack.nats_url)
    try:
        start = (await nlog.state(LEDGER_STREAM)).last_seq  # the stream is shared across the session
        tag = uuid.uuid4().hex[:8]
        hosts = [f"proj-{tag}.{i} é/x" for i in range(4)]
        feeder = Feeder(nlog)
        for h in hosts:
            await feeder.claim(h)
            await feeder.record(h, move_state="preparing")
        crashes: list[int] = []

        def crash_once(position: int) -> None:
            if not crashes:
                crashes.append(position)
                raise Crash

        root = tmp_path / "nats-proj"
        store = ProjectionStore.open(root, rng=SeededRandom(7), start_after=start, before_commit=crash_once)
        projector = Projector(store, nlog, batch=3, poll_interval=5.0)
        with pytest.raises(Crash):
            await projector.catch_up()
        assert (store.position(), store.revision()) == (start, 0)
        store.before_commit = None
        await projector.catch_up()
        mine = {v.host: v for v in store.snapshot().hosts if v.host in hosts}
        assert sorted(mine) == sorted(hosts)
        assert all((v.claim_gen, v.record_gen, v.move_state) == (1, 1, "preparing") for v in mine.values())
        assert store.errors(kind="gap") == [] and store.errors(kind="stale") == []
        cursor = store.cursor()

        # follow: a core NATS subscription wakes the projector as soon as a new event is published
        sub = await projector.wake_on(nlog.nc)
        task = asyncio.create_task(projector.run())
        try:
            await feeder.claim(hosts[0], live=False)
            await wait_for(lambda: getattr(store.host(hosts[0]), "deleted", False), timeout=4.0)
        finally:
            projector.stop()
            await asyncio.wait_for(task, 10)
            await sub.unsubscribe()
        feed = page(store.changes(cursor, 100))
        assert [(v.host, v.deleted) for v in feed.changes if v.host in hosts] == [(hosts[0], True)]

        # a rebuild from the origin reproduces the same view under a new identity
        before = store.snapshot(include_deleted=True)
        await store.rebuild(nlog, batch=2)
        assert store.snapshot(include_deleted=True).hosts == before.hosts
        assert isinstance(store.changes(cursor, 10), Resync)
        store.close()
    finally:
        await nlog.close()
