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

(b) (not yet) 20 moves at once between the two boxes.

The last line is ``RESULT scale ratio=<worse box's requests per period per host> target=1.5``; above it exits 1.
"""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from bench.common import private_stack, result
from bench.retention import unique_names
from events.ids import new_incarnation
from hostmove.stackinfo import StackInfo
from kernel.ports import SystemRandom, free_port
from services.box.instance.sleep import SleepMarks
from services.hosts.create import create_host
from services.ledger import Committed
from tests.helpers.agents import AgentWorld, agent_world, data_buckets, eventually
from tests.helpers.webcalls import scrape

TARGET = 1.5
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


async def measure(info: StackInfo, root: Path, hosts_n: int, running: int, scan_s: float, periods: int) -> int:
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
        ratio = await backstop_cost(w, health, per_box, scan_s, periods)
        print(result("scale", ratio, TARGET))
        return 0 if ratio <= TARGET else 1


def main() -> int:
    hosts_n = int(os.environ.get("SCALE_HOSTS", "1000"))
    running = int(os.environ.get("SCALE_RUNNING", "40"))
    scan_s = float(os.environ.get("SCALE_SCAN_S", "15"))
    periods = int(os.environ.get("SCALE_PERIODS", "10"))
    with private_stack() as info, tempfile.TemporaryDirectory(prefix="hostmove-bench-scale-") as tmp:
        return asyncio.run(measure(info, Path(tmp), hosts_n, running, scan_s, periods))


if __name__ == "__main__":
    sys.exit(main())
