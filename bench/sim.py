"""The simulation's speed (issue 5): the 300-seed gate (each seed twice for the determinism check, then every
witness) timed on this machine, against the issue's bar of 60 s, and the seeds per second against the original Go
model's figure of about 300 seeds a second (spec §14.2; model digest).

Prints seeds per second and simulated seconds per wall second (the runs' virtual clock, when they report it), then
``RESULT sim ratio=<gate seconds / 60> target=1``; above the target it exits 1. No stack is needed: the
simulation runs on its twins.
"""

from __future__ import annotations

import sys
import time

from bench.common import result
from sim.sweep import gate

SEEDS = 300
BAR_S = 60.0
GO_SEEDS_PER_S = 300.0
TARGET = 1.0


def main() -> int:
    lines: list[str] = []
    started = time.perf_counter()
    report = gate(SEEDS, out=lines.append)
    wall = time.perf_counter() - started
    if not report.ok:
        print("\n".join(lines[-20:]))
        print(f"the gate failed ({len(report.failures)} problems); its time does not count")
        return 1
    runs = 2 * SEEDS  # each seed twice: the determinism check
    virtual_ms = sum(r.counters.get("virtual_ms", 0) for r in report.results)
    print(f"gate: {SEEDS} seeds twice and every witness in {wall:.1f} s on this machine")
    print(f"seeds per second: {runs / wall:.1f} (the Go model's ~{GO_SEEDS_PER_S:.0f}: ratio "
          f"{runs / wall / GO_SEEDS_PER_S:.3f})")
    if virtual_ms:
        print(f"simulated seconds per wall second: {virtual_ms / 1000 / (wall / 2):.1f}")
    else:
        print("simulated seconds per wall second: not reported by this version of the runs")
    ratio = wall / BAR_S
    print(result("sim", ratio, TARGET))
    return 0 if ratio <= TARGET else 1


if __name__ == "__main__":
    sys.exit(main())
