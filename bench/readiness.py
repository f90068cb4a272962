"""T11's budget from the target's measured rates against the cut's observed offline window (issue 18 item 4; spec
§7.3 T11, §7.4).

On a private stack, two box agents as processes (``hostmove serve box``, the fast profile), each database size
(16 and 64 MiB) in a fresh ``moveprobe`` instance on the ``ie`` box, filled through ``POST /write`` with
incompressible values, then moved to ``uk`` by the agents on their own:

- **budget**: what the target's readiness report priced for this move (``target.json``'s T11, the last one before
  the cut): the whole stop-to-open estimate from the rates the ``uk`` box measured itself (its disk's write and read,
  its region's S3, the path from ``ie``: :mod:`services.target.rates`) and the fast profile's constants
  (:data:`services.target.budget.FAST_BUDGET`), against a 30 s cut window (:data:`CUT_WINDOW_S`);
- **window**: the cut's observed offline window, ``cut-stopping`` (the journal write before the source stops
  serving) to the record's ``opened_at`` (the target serves), both authority times.

The target: every window within its budget (T11 is an upper bound: a budget below its window admitted a move the
deadline then rolls back) and every budget at most 3x its window (an estimate that far above the cut refuses moves
that would fit). The last line is ``RESULT readiness ratio=<worst budget/window> target=3``; it exits 1 on a
window above its budget, a ratio above the target, or a move that does not close as done.
"""

from __future__ import annotations

import asyncio
import base64
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import msgspec

from bench.common import private_stack, result
from bench.move import history, offline_window_s
from events.ids import new_incarnation
from hostmove.probe_apps import post_write
from hostmove.stackinfo import StackInfo
from kernel.ports import SystemRandom, WallClock
from services.agent.service import read_endpoint
from services.door.api import Door
from services.door.auth import Identity
from services.door.decide import MoveRequest
from services.hosts.create import create_host
from services.ledger import Committed
from services.target.readiness import TargetReport, report_key
from tests.helpers.agents import AgentWorld, agent_world, answers_ready, data_buckets

TARGET = 3
MIB = 1 << 20
SIZES_MIB = (16, 64)
VALUE_BYTES = 512 * 1024
CUT_WINDOW_S = 30.0
"""The operator's cut window both agents take (``HOSTMOVE_CUT_WINDOW_S``): the fast profile's 12 s admits no 64 MiB
cut at this machine's S3 rates once the probe's 6 s window is priced, so T11 (rightly) refuses it there."""
QUIET = {"MOVEPROBE_INTERVAL_S": "3600", "MOVEPROBE_SCHEDULE_EVERY_S": "3600", "MOVEPROBE_ONCE_AFTER_S": "3600"}


@dataclass
class Row:
    size_mib: int
    t11: dict[str, float]
    window_s: float
    ok: bool
    why: str = ""

    @property
    def budget_s(self) -> float:
        """The estimate of a cut whose first probe attempt passes (fixed costs and attempt 1): what the observed cut
        did. ``total_s`` (every attempt the window admits) is the worst case T11 fits to the window."""
        return float(self.t11.get("fixed_s", float("nan"))) + float(self.t11.get("first_attempt_s", float("nan")))

    @property
    def ratio(self) -> float:
        return self.budget_s / self.window_s if self.window_s > 0 else float("inf")


async def until(check: object, what: str, timeout_s: float) -> object:
    deadline = time.monotonic() + timeout_s
    while True:
        value = await check()  # type: ignore[operator]
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not happen within {timeout_s:g} s")
        await asyncio.sleep(0.1)


async def one(w: AgentWorld, size_mib: int) -> Row:
    rng = SystemRandom()
    host = f"rdy-{size_mib}m-{rng.token_bytes(3).hex()}.example.com"
    created = await create_host(w.ledger, host, box=w.labels["ie"], region="ie", incarnation=new_incarnation(rng),
                                app=w.app)
    if not isinstance(created, Committed):
        return Row(size_mib, {}, float("nan"), False, f"{host} was not created: {created}")

    async def serving() -> int | None:
        port = read_endpoint(w.box_dir("ie"), host)
        return port if port is not None and await asyncio.to_thread(answers_ready, port) else None

    port = await until(serving, f"{host} serving on ie", 60)
    assert isinstance(port, int)
    for _ in range(max(1, size_mib * MIB // VALUE_BYTES)):
        value = base64.b64encode(os.urandom(VALUE_BYTES * 3 // 4)).decode()  # incompressible
        await asyncio.to_thread(post_write, port, value, timeout_s=30)
    await asyncio.sleep(2.0)  # the replica catches up (the fast profile syncs every 0.2 s)
    door = Door(w.ledger, clock=WallClock(), rng=rng)
    answer = await door.request_move(host, MoveRequest("uk", "auto"), Identity("bench", "operator"))
    if answer.status not in (200, 201):
        return Row(size_mib, {}, float("nan"), False, f"the move was refused: {answer.body.get('reason')}")
    move_id = str(answer.body["move"]["id"])
    last_t11: dict[str, float] = {}
    deadline = time.monotonic() + 240
    while True:  # the last report before the cut is the one the cut was admitted on
        record = (await w.ledger.read_record(host)).state
        move = record.move if record is not None else None
        if move is not None and move.state in ("preparing", "ready"):
            got = await w.store.get(w.deploy, report_key(host, move_id))
            body = getattr(got, "body", None)
            if body is not None:
                last_t11 = dict(msgspec.json.decode(body, type=TargetReport).t11) or last_t11
        if record is not None and record.move is None and record.last_move is not None \
                and record.last_move.id == move_id:
            if record.last_move.outcome != "done":
                return Row(size_mib, last_t11, float("nan"), False, f"the move ended {record.last_move.outcome}")
            break
        if time.monotonic() > deadline:
            return Row(size_mib, last_t11, float("nan"), False, f"the move did not close: {move}")
        await asyncio.sleep(0.05)
    window = offline_window_s(await history(w.events, host))
    ok = bool(last_t11) and window <= last_t11.get("fixed_s", 0) + last_t11.get("first_attempt_s", 0)
    return Row(size_mib, last_t11, window, ok, "" if ok else "the window is above its budget" if last_t11 else
               "no T11 estimate was read")


def report(rows: list[Row]) -> float:
    print("budget = the target's T11 estimate from its measured rates (fast profile); window = cut-stopping -> "
          "opened_at")
    print("budget = fixed costs + the first probe attempt (the cut observed ran one); worst = every attempt the "
          "window admits")
    print(f"{'db':>6} {'priced MiB':>10} {'xr MiB/s':>9} {'S3 MiB/s':>9} {'disk w':>7} {'disk r':>7} "
          f"{'budget s':>9} {'worst s':>8} {'attempts':>8} {'window s':>9} {'ratio':>6}")
    worst = 0.0
    for r in rows:
        t = r.t11
        print(f"{r.size_mib:>4}Mi {t.get('db_mib', 0):>10.1f} {t.get('cross_region_mib_s', 0):>9.0f} "
              f"{t.get('regional_s3_mib_s', 0):>9.0f} {t.get('disk_write_mib_s', 0):>7.0f} "
              f"{t.get('disk_read_mib_s', 0):>7.0f} {r.budget_s:>9.3f} {t.get('total_s', 0):>8.3f} "
              f"{int(t.get('attempts', 0)):>8} {r.window_s:>9.3f} {r.ratio:>6.2f}")
        worst = max(worst, r.ratio) if r.ok else float("inf")
    for r in rows:
        if not r.ok:
            print(f"the {r.size_mib} MiB move: {r.why}")
    return worst


async def run(info: StackInfo, tmp: Path) -> int:
    tag = SystemRandom().token_bytes(3).hex()

    def unique(prefix: str) -> str:
        return f"{prefix}-{tag}-{SystemRandom().token_bytes(2).hex()}"

    rows: list[Row] = []
    async with data_buckets(info, unique, "rdy") as (store, events, prefix), \
            agent_world(info, unique, tmp, prefix, store=store, events=events, app_env=QUIET,
                        agent_env={"HOSTMOVE_CUT_WINDOW_S": str(CUT_WINDOW_S)}) as w:
        for size_mib in SIZES_MIB:
            print(f"moving a {size_mib} MiB database from {w.labels['ie']} to {w.labels['uk']} ...", flush=True)
            rows.append(await one(w, size_mib))
    print()
    worst = report(rows)
    print(result("readiness", worst, TARGET))
    return 0 if worst <= TARGET else 1


def main() -> int:
    with private_stack() as info, tempfile.TemporaryDirectory(prefix="hostmove-bench-readiness-") as tmp:
        return asyncio.run(run(info, Path(tmp)))


if __name__ == "__main__":
    sys.exit(main())
