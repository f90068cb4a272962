"""Many hosts on the real stack (issue 19 item 7): what the box agents' backstop costs with 1,000 hosts.

A private stack, two box agents as real processes (``hostmove serve box``, the **production** profile: the backstop
every ``HOSTMOVE_SCAN_S`` = 15 s, the retention's look every 60 s, the at-rest sweeps every 600 s, hosts sleep after
15 minutes idle), ``SCALE_HOSTS`` hosts (1,000 by default) created straight through their claims
(:func:`services.hosts.create.create_host`), half on each box. ``SCALE_RUNNING`` of each box's hosts (40 by default)
run (the sample app, woken by the agent's first pass); the others are asleep on their box (its sleep marks, written
before the agents start: what an idle stop leaves), so the agent never starts them.

**(a) The backstop's cost.** Once every running instance serves and each agent's first two looks have ended (the
first reads every claim, new to it, and gives every other box's host its at-rest sweep), each agent's
``hostmove_s3_requests_total`` (its ``/metrics``, every operation and status) is read over HTTP at the end of one
look and at the end of ``SCALE_PERIODS`` looks later (10 by default, counted by ``hostmove_box_scans_total``: a
sleeping host's retention look, due 60 s after its last, is passed at the fifth look after it, so two rounds of
it). The figure is the requests per period divided by the hosts on that box; the worse box is the RESULT.
Everything the agent asks of S3 counts (its running instances' replication, its health check's GET a second, the
retention's looks that its passes of sleeping hosts run). The at-rest sweeps' own cadence (600 s) is longer than
the window: their first round is in the warm-up, not measured.

**(b) Concurrent moves** (§7.4: the cut window is per host). A second world of two agents (the fast profile, the
default pass workers), ``SCALE_MOVES`` + 1 hosts (20 + 1 by default) serving on ie, each given the same rows
(``SCALE_ROWS``, 50 by default) so each database is the same size. One host moves to uk alone first: its offline
window (``cut-stopping`` to the record's ``opened_at``, as ``bench/move``) is the baseline. Then the other
``SCALE_MOVES`` are requested at once; every one must end ``done`` with its offline window within its own
``cut_budget_s``. The figure is the slowest concurrent offline window divided by the lone one.

The RESULT is part (b)'s (the issue's): ``RESULT scale ratio=<slowest concurrent offline / lone offline>
target=3``; part (a) prints its own line above it (``part (a): ... ratio=<worse box's requests per period per
host> target=1.5``, not a RESULT line). The bench exits 1 when either misses, or a move does not end ``done``
within its budget. ``SCALE_PART=a`` or ``b`` runs one part; ``SCALE_CUT_SLOTS`` and ``SCALE_PREPARE_SLOTS`` set part
(b)'s agents' cut and preparing slots.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bench.common import private_stack, result
from bench.move import history, offline_window_s, phases
from bench.retention import unique_names
from events.ids import new_incarnation
from events.record import Record
from hostmove.probe_apps import post_write
from hostmove.stackinfo import StackInfo
from kernel.ports import SystemRandom, WallClock, free_port
from services.agent.service import read_endpoint
from services.box.instance.sleep import SleepMarks
from services.door.api import Door
from services.door.auth import Identity
from services.door.decide import MoveRequest
from services.hosts.create import create_host
from services.ledger import Committed
from tests.helpers.agents import AgentWorld, agent_world, answers_ready, data_buckets, eventually
from tests.helpers.webcalls import scrape

TARGET = 1.5
"""Part (a): S3 requests per reconciliation period per host on the box."""
CONCURRENT_TARGET = 3.0
"""Part (b): the slowest of the concurrent moves' offline windows over a lone move's."""
REGIONS = ("ie", "uk")
S3_REQUESTS = "hostmove_s3_requests_total{"


def requests_by_operation(values: dict[str, float]) -> dict[str, float]:
    """An agent's S3 requests so far by operation (every status), from its scraped ``/metrics``."""
    out: dict[str, float] = {}
    for key, value in values.items():
        if key.startswith(S3_REQUESTS):
            labels = dict(part.split("=", 1) for part in key[len(S3_REQUESTS):-1].split(","))
            out[labels["operation"]] = out.get(labels["operation"], 0.0) + value
    return out


async def register(w: AgentWorld, hosts: dict[str, str], running: int) -> None:
    """Create every host (``host -> region``) on its region's box; all but ``running`` of each box's asleep there."""
    rng, gate = SystemRandom(), asyncio.Semaphore(16)

    async def one(host: str, region: str) -> None:
        async with gate:
            created = await create_host(w.ledger, host, box=w.labels[region], region=region,
                                        incarnation=new_incarnation(rng), app=w.app)
            assert isinstance(created, Committed), created

    await asyncio.gather(*(one(h, r) for h, r in hosts.items()))
    for region in REGIONS:
        marks = SleepMarks(w.box_dir(region))
        for host in [h for h, r in hosts.items() if r == region][running:]:
            marks.mark(host, session=0, at_ms=int(time.time() * 1000))


async def instances_running(health: dict[str, int], w: AgentWorld, running: int, timeout_s: float) -> None:
    async def check() -> bool:
        for region, port in health.items():
            try:
                values = await asyncio.to_thread(scrape, port)
            except OSError:  # its health port is not open yet
                return False
            if values.get(f"hostmove_box_instances_running{{box={w.labels[region]}}}", 0.0) < running:
                return False
        return True

    await eventually(check, f"{running} instances running on each box", timeout_s, every_s=1.0)


def looks(values: dict[str, float], box: str) -> tuple[float, float]:
    """``(looks ended, claims they read)`` of ``box``'s backstop, from its scraped ``/metrics``."""
    return (values.get(f"hostmove_box_scans_total{{box={box}}}", 0.0),
            values.get(f"hostmove_box_scan_claims_read_total{{box={box}}}", 0.0))


async def at_look(port: int, box: str, after: float, timeout_s: float) -> tuple[dict[str, float], float]:
    """The agent's metrics just after its look number ``after`` + 1 ended (polled twice a second), and the time."""

    async def check() -> dict[str, float] | None:
        values = await asyncio.to_thread(scrape, port)
        return values if looks(values, box)[0] > after else None

    values = await eventually(check, f"look {after + 1:.0f} of {box}", timeout_s, every_s=0.5)
    return values, time.monotonic()


async def box_cost(w: AgentWorld, region: str, port: int, per_box: int, scan_s: float, periods: int) -> float:
    """Part (a) for one box: its S3 requests from the end of one look to the end of ``periods`` looks later (whole
    reconciliation periods, however long a look takes), per period, per host on the box."""
    box = w.labels[region]
    now = await asyncio.to_thread(scrape, port)
    before, t0 = await at_look(port, box, looks(now, box)[0], 10 * scan_s)
    after, t1 = await at_look(port, box, looks(before, box)[0] + periods - 1, periods * 10 * scan_s)
    b, a = requests_by_operation(before), requests_by_operation(after)
    ops = {op: a[op] - b.get(op, 0.0) for op in a if a[op] - b.get(op, 0.0)}
    n = looks(after, box)[0] - looks(before, box)[0]
    read = looks(after, box)[1] - looks(before, box)[1]
    per_period = sum(ops.values()) / n
    ratio = per_period / per_box
    print(f"box {box}: {sum(ops.values()):.0f} S3 requests in {n:.0f} periods ({(t1 - t0) / n:.1f} s each, the "
          f"backstop every {scan_s:g} s): {per_period:.0f} a period, {ratio:.3f} per host on the box; the backstop "
          f"read {read / n:.1f} claims a look; " + ", ".join(f"{op} {v:.0f}" for op, v in sorted(ops.items())),
          flush=True)
    return ratio


async def backstop_cost(w: AgentWorld, health: dict[str, int], per_box: int, scan_s: float, periods: int) -> float:
    """Part (a): each agent's S3 requests per period per host on its box, after its first two looks (the first
    reads every claim, new to it, and sweeps every other host once); the worse box's."""
    for region, port in health.items():
        await at_look(port, w.labels[region], 1, 40 * scan_s)
    ratios = await asyncio.gather(*(box_cost(w, r, p, per_box, scan_s, periods) for r, p in health.items()))
    return max(ratios)


async def measure(info: StackInfo, root: Path, hosts_n: int, running: int, scan_s: float, periods: int) -> float:
    """Part (a): the worse box's S3 requests per reconciliation period per host on its box."""
    unique: Callable[[str], str] = unique_names()  # type: ignore[assignment]
    health = {r: free_port() for r in REGIONS}
    async with data_buckets(info, unique, "scale") as (store, events, prefix), \
            agent_world(info, unique, root, prefix, store=store, events=events, start=False,
                        agent_env={"HOSTMOVE_PROFILE": "production", "HOSTMOVE_SCAN_S": f"{scan_s:g}"}) as w:
        hosts = {f"scale-{i:04d}.example.com": REGIONS[i % 2] for i in range(hosts_n)}
        t0 = time.monotonic()
        await register(w, hosts, running)
        per_box = hosts_n // len(REGIONS)
        print(f"{hosts_n} hosts registered in {time.monotonic() - t0:.0f} s, {per_box} on each of two boxes, "
              f"{running} of them running on each; the backstop every {scan_s:g} s (production profile)", flush=True)
        for region, agent in w.agents.items():
            agent.start({"HOSTMOVE_HEALTH_PORT": str(health[region])})
        t0 = time.monotonic()
        await instances_running(health, w, running, timeout_s=600)
        print(f"{running} instances running on each box {time.monotonic() - t0:.0f} s after the agents started",
              flush=True)
        return await backstop_cost(w, health, per_box, scan_s, periods)


async def serving_on(w: AgentWorld, region: str, host: str, timeout_s: float) -> int:
    """The port ``host`` answers its readiness path on, on ``region``'s box."""

    async def check() -> int | None:
        port = read_endpoint(w.box_dir(region), host)
        return port if port is not None and await asyncio.to_thread(answers_ready, port) else None

    return await eventually(check, f"{host} served on {w.labels[region]}", timeout_s, every_s=0.5)


async def request(w: AgentWorld, door: Door, host: str) -> str:
    answer = await door.request_move(host, MoveRequest("uk", "auto"), Identity("bench", "operator"))
    if answer.status not in (200, 201):
        raise RuntimeError(f"the move of {host} was refused: {answer.body}")
    return str(answer.body["move"]["id"])


@dataclass(frozen=True)
class Moved:
    host: str
    outcome: str
    offline_s: float
    budget_s: float
    why: str = ""
    """A rollback's reason (the record's ``rollback.reason``)."""
    phases: tuple[tuple[str, float], ...] = ()
    """Each record transition of the offline window, with its seconds since ``cut-stopping`` (where it went)."""
    stopping_ms: int = 0
    """When the cut stopped the host (``cut-stopping``'s ``EventMeta.at``)."""


async def done(w: AgentWorld, host: str, move_id: str, timeout_s: float) -> Moved:
    """How the move closed, its offline window (NaN unless it opened on the target) and its budget."""

    async def closed() -> Record | None:
        record = (await w.ledger.read_record(host)).state
        if record is None or record.move is not None or record.last_move is None:
            return None
        return record if record.last_move.id == move_id else None

    record = await eventually(closed, f"the move {move_id} of {host} to close", timeout_s, every_s=0.5)
    assert record is not None and record.last_move is not None
    transitions = await history(w.events, host)
    ours = [t for t in transitions if t.record is not None and t.record.move is not None
            and t.record.move.id == move_id]
    mine = [t.record.move for t in ours if t.record is not None and t.record.move is not None]
    budgets = [m.cut_budget_s for m in mine if m.cut_budget_s]
    why = next((m.rollback.reason for m in mine if m.rollback is not None), "") \
        or next((f"{m.state}/{m.cut_phase or '-'}: {m.reason}" for m in reversed(mine) if m.reason), "")
    outcome = record.last_move.outcome
    offline = offline_window_s(ours) if outcome == "done" else float("nan")
    return Moved(host, outcome, offline, budgets[-1] if budgets else float("nan"), why, tuple(phases(ours)),
                 next((t.meta.at for t in ours if t.meta.name == "cut-stopping"), 0))


def shown(m: Moved) -> str:
    return ", ".join(f"{name} {at:.2f}" for name, at in m.phases)


def slots_env() -> dict[str, str]:
    """``SCALE_CUT_SLOTS`` and ``SCALE_PREPARE_SLOTS``, when set, are the agents' ``HOSTMOVE_CUT_SLOTS`` and
    ``HOSTMOVE_PREPARE_SLOTS`` (a service's environment keeps no ``HOSTMOVE_*`` setting of this process's,
    :func:`hostmove.procs.service_env`)."""
    names = {"SCALE_CUT_SLOTS": "HOSTMOVE_CUT_SLOTS", "SCALE_PREPARE_SLOTS": "HOSTMOVE_PREPARE_SLOTS"}
    return {agent: os.environ[mine] for mine, agent in names.items() if os.environ.get(mine)}


async def concurrent(info: StackInfo, root: Path, moves: int, rows: int) -> tuple[float, bool]:
    """Part (b): ``(slowest concurrent offline / lone offline, every move done within its budget)``."""
    unique: Callable[[str], str] = unique_names()  # type: ignore[assignment]
    async with data_buckets(info, unique, "scalemv") as (store, events, prefix), \
            agent_world(info, unique, root, prefix, store=store, events=events, agent_env=slots_env()) as w:
        hosts = [f"scalemv-{i:02d}.example.com" for i in range(moves + 1)]
        rng, t0 = SystemRandom(), time.monotonic()
        for host in hosts:
            created = await create_host(w.ledger, host, box=w.labels["ie"], region="ie",
                                        incarnation=new_incarnation(rng), app=w.app)
            assert isinstance(created, Committed), created
        ports = await asyncio.gather(*(serving_on(w, "ie", h, 300) for h in hosts))
        for port in ports:
            for i in range(rows):
                await asyncio.to_thread(post_write, port, f"row {i}")
        print(f"part (b): {len(hosts)} hosts serving on ie with {rows} rows each in {time.monotonic() - t0:.0f} s",
              flush=True)
        door = Door(w.ledger, clock=WallClock(), rng=SystemRandom())
        lone = await done(w, hosts[0], await request(w, door, hosts[0]), 300)
        if lone.outcome != "done":
            raise RuntimeError(f"the lone move of {lone.host} ended {lone.outcome}: {lone.why}")
        print(f"part (b): the lone move of {lone.host}: offline {lone.offline_s:.2f} s (budget {lone.budget_s:g} s)",
              flush=True)
        t0 = time.monotonic()
        ids = await asyncio.gather(*(request(w, door, h) for h in hosts[1:]))
        ended = await asyncio.gather(*(done(w, h, m, 900) for h, m in zip(hosts[1:], ids, strict=True)))
        spent = time.monotonic() - t0
        moved = [m for m in ended if m.outcome == "done"]
        windows = sorted(m.offline_s for m in moved) or [float("nan")]
        over = [m for m in moved if not m.offline_s <= m.budget_s]
        failed = [m for m in ended if m.outcome != "done"]
        print(f"part (b): {moves} moves requested at once, {len(moved)} done in {spent:.0f} s; offline windows min "
              f"{windows[0]:.2f} s, median {statistics.median(windows):.2f} s, max {windows[-1]:.2f} s; "
              f"{len(over)} over their budget" + "".join(f"; {m.host} {m.offline_s:.2f} s > {m.budget_s:g} s"
                                                        for m in over), flush=True)
        for m in failed:
            print(f"part (b): {m.host} ended {m.outcome}: {m.why}", flush=True)
        print(f"part (b): the lone move's offline window: {shown(lone)}", flush=True)
        if moved:
            slowest = max(moved, key=lambda m: m.offline_s)
            print(f"part (b): the slowest, {slowest.host}: {shown(slowest)}", flush=True)
            first = min(m.stopping_ms for m in moved)
            print("part (b): offline windows in the order of their cuts (s after the first cut: offline s): "
                  + ", ".join(f"{(m.stopping_ms - first) / 1000:.1f}: {m.offline_s:.2f}"
                              for m in sorted(moved, key=lambda m: m.stopping_ms)), flush=True)
        return windows[-1] / lone.offline_s, not over and not failed


def main() -> int:
    hosts_n = int(os.environ.get("SCALE_HOSTS", "1000"))
    running = int(os.environ.get("SCALE_RUNNING", "40"))
    scan_s = float(os.environ.get("SCALE_SCAN_S", "15"))
    periods = int(os.environ.get("SCALE_PERIODS", "10"))
    moves = int(os.environ.get("SCALE_MOVES", "20"))
    rows = int(os.environ.get("SCALE_ROWS", "50"))
    part = os.environ.get("SCALE_PART", "")
    ok = True
    with private_stack() as info, tempfile.TemporaryDirectory(prefix="hostmove-bench-scale-") as tmp:
        if part in ("", "a"):
            cost = asyncio.run(measure(info, Path(tmp) / "a", hosts_n, running, scan_s, periods))
            print(f"part (a): the backstop's S3 requests per period per host ratio={cost:.3f} target={TARGET}",
                  flush=True)
            ok = ok and cost <= TARGET
        if part in ("", "b"):
            ratio, within = asyncio.run(concurrent(info, Path(tmp) / "b", moves, rows))
            ok = ok and within and ratio <= CONCURRENT_TARGET
            print(result("scale", ratio, CONCURRENT_TARGET))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
