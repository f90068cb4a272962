"""The simulation's speed (issues 5, 17): the gate timed on this machine, against the issue's bar of 60 s: 300 seeds
of the world with moves (the production agents, door and recovery pass under chaos; sim/moves.py), each once, the
first ten again, every witness three ways and every scenario, and the world without moves' 300 seeds (sim/world.py).

Prints the gate's time, the seeds of the world with moves per second (against the original Go model's figure of about
300 seeds a second, spec §14.2; model digest), the CPU a seed of it costs, and simulated seconds per wall second; then
``RESULT sim ratio=<gate seconds / 60> target=1.0``; above the target it exits 1. No stack is needed: the simulation
runs on its twins. The machine's cores are shared: compare ratios of one run, not times across runs.
"""

from __future__ import annotations

import os
import sys
import time

from bench.common import result
from sim.sweep import STAND_IN_SEEDS, gate

SEEDS = 300
BAR_S = 60.0
GO_SEEDS_PER_S = 300.0
TARGET = 1.0


def main() -> int:
    lines: list[str] = []
    cpu_before = os.times()
    started = time.perf_counter()
    report = gate(SEEDS, out=lines.append)
    wall = time.perf_counter() - started
    cpu_after = os.times()
    if not report.ok:
        print("\n".join(lines[-20:]))
        print(f"the gate failed ({len(report.failures)} problems); its time does not count")
        return 1
    cpu = (cpu_after.children_user + cpu_after.children_system) - (cpu_before.children_user
                                                                   + cpu_before.children_system)
    virtual_s = sum(r.counters.get("virtual_ms", 0) for r in report.results) / 1000
    steps = sum(r.steps for r in report.results)
    print(f"gate: {SEEDS} seeds of the world with moves, {STAND_IN_SEEDS} of the world without, every witness and "
          f"scenario in {wall:.1f} s on this machine ({os.cpu_count()} cores; {cpu:.0f} s of CPU in its workers)")
    print(f"seeds of the world with moves per second: {SEEDS / wall:.1f} (the Go model's ~{GO_SEEDS_PER_S:.0f}: "
          f"ratio {SEEDS / wall / GO_SEEDS_PER_S:.3f}); {steps / SEEDS:.0f} loop steps and "
          f"{virtual_s / SEEDS:.0f} simulated seconds a seed")
    print(f"simulated seconds per wall second: {virtual_s / wall:.0f}")
    print(f"seeds of the world with moves a {BAR_S:.0f} s gate fits at this rate: about {int(SEEDS * BAR_S / wall)} "
          f"({cpu / SEEDS:.2f} s of CPU a seed, witnesses and the world without moves included)")
    ratio = wall / BAR_S
    print(result("sim", ratio, TARGET))
    return 0 if ratio <= TARGET else 1


if __name__ == "__main__":
    sys.exit(main())
