"""Timers on a real SQLite file, delivered to a real local HTTP server (spec §9.4)."""

from __future__ import annotations

import asyncio
import hashlib
import sqlite3
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from aiohttp import web
from msgspec.structs import replace

from kernel.ports import ManualClock, WallClock
from services.box.instance.registry import Registry, RouteRow
from services.box.instance.timers import (
    TimerError,
    TimerRow,
    TimerRunner,
    Timers,
    TimersBusy,
    TimerSpec,
    drain,
    timers_digest,
)

HOST = "shop.example.app"
OTHER = "blog.example.app"
INC = "cd" * 32
MV = "mv_" + "a" * 26
T0 = 1_700_000_000_000


class Instance:
    """A real aiohttp server standing in for the instance: records every timer POST."""

    def __init__(self) -> None:
        self.received: list[dict[str, Any]] = []
        self.status = 200
        self.gate: asyncio.Event | None = None
        self.entered = asyncio.Event()
        self.url = ""

    async def handle(self, request: web.Request) -> web.Response:
        self.received.append(await request.json())
        self.entered.set()
        if self.gate is not None:
            await self.gate.wait()
        return web.Response(status=self.status, text="ok")


@pytest_asyncio.fixture(loop_scope="session")
async def instance() -> AsyncIterator[Instance]:
    inst = Instance()
    app = web.Application()
    app.router.add_post("/_hostmove/timer", inst.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    inst.url = f"http://{host}:{port}"
    try:
        yield inst
    finally:
        await runner.cleanup()


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(T0)


@pytest.fixture
def box(tmp_path: Path, clock: ManualClock) -> Iterator[tuple[Registry, Timers]]:
    reg = Registry.open(tmp_path, clock)
    timers = Timers.open(tmp_path, clock)
    yield reg, timers
    timers.close()
    reg.close()


def snapshot_rows() -> list[TimerRow]:
    return [
        TimerRow(name="digest", every_ms=60_000, payload='{"k":1}', next_at=T0 + 5_000, due_at=T0 - 55_000,
                 attempts=12, registration=T0 - 3_600_000),
        TimerRow(name="remind", at_ms=T0 + 1_000, payload="r", next_at=T0 + 1_000, registration=T0 - 10),
        TimerRow(name="sent", at_ms=T0 - 9_000, next_at=T0 - 9_000, due_at=T0 - 9_000, attempts=1,
                 registration=T0 - 20_000, last_run_at=T0 - 8_000, completed=True),
    ]


def test_replace_is_exact_and_keeps_bookkeeping(box: tuple[Registry, Timers], clock: ManualClock) -> None:
    _, timers = box
    timers.replace_timers(HOST, snapshot_rows())
    timers.replace_timers(OTHER, [TimerSpec(name="other", every_ms=1_000)])
    assert timers.list(HOST) == sorted(snapshot_rows(), key=lambda r: r.name), "a snapshot's bookkeeping is kept"

    clock.advance(30_000)
    timers.replace_timers(
        HOST,
        [TimerSpec(name="digest", every_ms=60_000, payload='{"k":2}'), TimerSpec(name="fresh", every_ms=10_000)],
    )
    rows = {r.name: r for r in timers.list(HOST)}
    assert set(rows) == {"digest", "fresh"}, "afterwards the host holds exactly the given timers"
    old = snapshot_rows()[0]
    survivor = rows["digest"]
    assert (survivor.next_at, survivor.due_at, survivor.attempts, survivor.registration) == (
        old.next_at, old.due_at, old.attempts, old.registration
    )
    assert survivor.payload == '{"k":2}'
    fresh = rows["fresh"]
    assert (fresh.next_at, fresh.attempts, fresh.registration) == (T0 + 30_000 + 10_000, 0, T0 + 30_000)
    assert [r.name for r in timers.list(OTHER)] == ["other"], "another host's timers are untouched"

    timers.replace_timers(HOST, [])
    assert timers.list(HOST) == []


def test_replace_is_atomic(box: tuple[Registry, Timers], tmp_path: Path) -> None:
    _, timers = box
    timers.replace_timers(HOST, snapshot_rows())
    before, digest = timers.list(HOST), timers.digest(HOST)
    # The third insert fails inside the transaction, after the delete and two inserts ran.
    bad = [TimerSpec(name="a", every_ms=1), TimerSpec(name="b", every_ms=1), TimerSpec(name="a", every_ms=2)]
    with pytest.raises(TimerError, match="previous timers are unchanged"):
        timers.replace_timers(HOST, bad)
    assert timers.list(HOST) == before
    assert timers.digest(HOST) == digest
    # And from another connection to the same file (another process's view).
    conn = sqlite3.connect(tmp_path / "registry.db")
    try:
        names = [n for (n,) in conn.execute("SELECT name FROM timers WHERE host=? ORDER BY name", (HOST,))]
    finally:
        conn.close()
    assert names == ["digest", "remind", "sent"]
    with pytest.raises(TimerError):
        TimerSpec(name="both", every_ms=1, at_ms=1)
    with pytest.raises(TimerError):
        TimerSpec(name="neither")


def test_digest_is_canonical(box: tuple[Registry, Timers], clock: ManualClock) -> None:
    _, timers = box
    rows = snapshot_rows()
    active = [r for r in rows if not r.completed]
    assert timers_digest([]) == hashlib.sha256(b"[]").hexdigest()
    assert timers_digest(rows) == timers_digest(active), "completed once-timers are history, not digested"
    assert timers_digest(rows) == timers_digest(list(reversed(rows))), "row order does not matter"

    timers.replace_timers(HOST, rows)
    digest = timers.digest(HOST)
    assert digest == timers_digest(active)
    # The runner's prune removes aged history: the digest a clean recovery compares does not move.
    assert timers.prune_completed(older_than_ms=T0) == 1
    assert [r.name for r in timers.list(HOST)] == ["digest", "remind"]
    assert timers.digest(HOST) == digest

    changed_schedule = [TimerSpec(name="digest", every_ms=30_000, payload='{"k":1}'), active[1]]
    timers.replace_timers(HOST, changed_schedule)
    assert timers.digest(HOST) != digest, "a schedule change changes the digest"
    assert timers_digest([active[0], replace(active[1], payload="other")]) != digest
    assert timers_digest([replace(active[0], attempts=13), active[1]]) != digest, "bookkeeping is digested"
    assert timers_digest([replace(active[0], last_run_at=1), active[1]]) == digest


@pytest_asyncio.fixture(loop_scope="session")
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


def runner_for(timers: Timers, clock: ManualClock, session: aiohttp.ClientSession, url: str | None) -> TimerRunner:
    return TimerRunner(timers, clock, session, lambda host: url, timeout_s=5.0)


async def test_held_row_is_skipped_without_bookkeeping(
    box: tuple[Registry, Timers], clock: ManualClock, instance: Instance, session: aiohttp.ClientSession
) -> None:
    reg, timers = box
    reg.insert(RouteRow(host=HOST, incarnation=INC))
    timers.replace_timers(HOST, snapshot_rows())
    assert reg.hold(HOST, "moving", MV)
    clock.advance(10_000)  # both active timers are due
    before, digest = timers.list(HOST), timers.digest(HOST)

    report = await runner_for(timers, clock, session, instance.url).run_due()
    assert sorted(report.skipped_held) == [(HOST, "digest"), (HOST, "remind")]
    assert report.delivered == [] and report.failed == []
    assert instance.received == [], "a held row's timer never reaches the instance"
    assert timers.list(HOST) == before and timers.digest(HOST) == digest

    # Leaving the hold: the same timers are delivered, and bookkeeping advances.
    assert reg.leave_hold(HOST, MV)
    report = await runner_for(timers, clock, session, instance.url).run_due()
    assert sorted(report.delivered) == [(HOST, "digest"), (HOST, "remind")]
    assert sorted(r["name"] for r in instance.received) == ["digest", "remind"]
    assert {r["name"]: r["payload"] for r in instance.received} == {"digest": '{"k":1}', "remind": "r"}
    rows = {r.name: r for r in timers.list(HOST)}
    assert rows["remind"].completed and rows["remind"].attempts == 1 and rows["remind"].due_at == T0 + 1_000
    # T0+5s was due; now is T0+10s: the next occurrence on the 60 s grid is T0+65s.
    assert (rows["digest"].next_at, rows["digest"].due_at, rows["digest"].attempts) == (T0 + 65_000, T0 + 5_000, 13)
    assert rows["digest"].last_run_at == T0 + 10_000
    assert timers.digest(HOST) != digest


async def test_refused_or_failed_delivery_changes_nothing(
    box: tuple[Registry, Timers], clock: ManualClock, instance: Instance, session: aiohttp.ClientSession
) -> None:
    reg, timers = box
    reg.insert(RouteRow(host=HOST, incarnation=INC))
    timers.replace_timers(HOST, snapshot_rows())
    clock.advance(10_000)
    before = timers.list(HOST)

    instance.status = 503
    report = await runner_for(timers, clock, session, instance.url).run_due()
    assert sorted(report.failed) == [(HOST, "digest"), (HOST, "remind")]
    assert len(instance.received) == 2, "the instance was asked and refused"
    assert timers.list(HOST) == before

    # No instance listening at all.
    dead = "http://127.0.0.1:9"  # discard port: nothing listens there
    report = await runner_for(timers, clock, session, dead).run_due()
    assert len(report.failed) == 2 and timers.list(HOST) == before

    # A row that is not ready (an ordinary status) is not delivered either.
    assert reg.set_status(HOST, "stopped")
    instance.status = 200
    report = await runner_for(timers, clock, session, instance.url).run_due()
    assert len(report.skipped_closed) == 2 and len(instance.received) == 2 and timers.list(HOST) == before
    assert timers.conn.execute("SELECT count(*) FROM timer_inflight").fetchone() == (0,)


async def test_drain_waits_for_a_delivery_in_flight(
    box: tuple[Registry, Timers], clock: ManualClock, instance: Instance, session: aiohttp.ClientSession,
    tmp_path: Path,
) -> None:
    reg, timers = box
    reg.insert(RouteRow(host=HOST, incarnation=INC))
    timers.replace_timers(HOST, [TimerSpec(name="slow", at_ms=T0)])
    instance.gate = asyncio.Event()
    runner = runner_for(timers, clock, session, instance.url)
    run = asyncio.create_task(runner.run_due())
    await asyncio.wait_for(instance.entered.wait(), 5)

    # The source writes its hold, then drains (§9.4) from its own connection, as another process would.
    assert reg.hold(HOST, "moving", MV)
    cut_side = Timers.open(tmp_path, clock)
    try:
        with pytest.raises(TimersBusy, match=HOST):
            await drain(cut_side.conn, clock, HOST, timeout_s=0.2)
        instance.gate.set()
        await drain(cut_side.conn, WallClock(), HOST, timeout_s=10)
        report = await asyncio.wait_for(run, 5)
    finally:
        cut_side.close()
    assert report.delivered == [(HOST, "slow")]
    # After the hold nothing new starts.
    timers.replace_timers(HOST, [TimerSpec(name="later", at_ms=T0)])
    report = await runner.run_due()
    assert report.skipped_held == [(HOST, "later")]
    # A dead runner's in-flight row is never waited for.
    timers.conn.execute("INSERT INTO timer_inflight VALUES (?, 'ghost', '999999999:1', 0)", (HOST,))
    await drain(timers.conn, clock, HOST, timeout_s=0)
