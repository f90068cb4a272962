"""The simulation's speed (issues 5, 17): the gate timed on this machine, against the issue's bar of 60 s: 300 seeds
of the world with moves (the production agents, door and recovery pass under chaos; sim/moves.py), each once, the
first ten again, every witness three ways and every scenario, and the seeds of the world without moves that check what
the other does not (sim/world.py; ``sim.sweep.stand_in_seeds``).

Prints the gate's time; for each world its seeds per second of the gate's wall time and per CPU second of one core
(each run's CPU is read by its worker: the cost of a seed, whatever the machine's load); the gate's CPU in all and
the wall time it would take on this machine's cores unshared (the CPU of the same run over the cores: the baseline the
load is judged against, not the RESULT); and the machine's load. Then ``RESULT sim ratio=<gate seconds / 60>
target=1.0``; above the target it exits 1. No stack is needed: the simulation runs on its twins. The machine's cores
are shared: compare ratios of one run, not times across runs.
"""

from __future__ import annotations

import os
import sys
import time

from bench.common import result
from sim.run import Result
from sim.sweep import STAND_IN_SEEDS, default_jobs, gate

SEEDS = 300
BAR_S = 60.0
GO_SEEDS_PER_S = 300.0
TARGET = 1.0


def _cpu(runs: list[Result]) -> float:
    return sum(r.cpu_s for r in runs)


def main() -> int:
    lines: list[str] = []
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    report = gate(SEEDS, out=lines.append)
    wall = time.perf_counter() - started
    load_after = os.getloadavg()[0]
    if not report.ok:
        print("\n".join(lines[-20:]))
        print(f"the gate failed ({len(report.failures)} problems); its time does not count")
        return 1
    jobs = default_jobs()
    moves, stand_in = report.results, report.stand_in
    cpu_moves, cpu_stand_in, cpu_witnesses, cpu_repeats = (_cpu(moves), _cpu(stand_in), _cpu(report.witnesses),
                                                           _cpu(report.repeats))
    cpu = cpu_moves + cpu_stand_in + cpu_witnesses + cpu_repeats
    virtual_s = sum(r.counters.get("virtual_ms", 0) for r in moves) / 1000
    steps = sum(r.steps for r in moves)
    print(f"gate: {len(moves)} seeds of the world with moves, {len(stand_in)} of the world without (of its first "
          f"{STAND_IN_SEEDS}), {len(report.witnesses)} witness and scenario runs, {len(report.repeats)} seeds again: "
          f"{wall:.1f} s on this machine ({os.cpu_count()} cores, {jobs} workers; load {load_before:.1f} before, "
          f"{load_after:.1f} after)")
    print(f"CPU: {cpu:.0f} s in the workers (world with moves {cpu_moves:.0f} s, without {cpu_stand_in:.1f} s, "
          f"witnesses {cpu_witnesses:.1f} s, repeats {cpu_repeats:.1f} s); on {jobs} unshared cores the gate would "
          f"take about {cpu / jobs:.0f} s (ratio {cpu / jobs / BAR_S:.3f}: for comparison, not the RESULT)")
    print(f"world with moves: {len(moves) / wall:.2f} seeds per second of the gate, {len(moves) / cpu_moves:.2f} per "
          f"CPU second ({cpu_moves / len(moves):.2f} s a seed; the Go model's ~{GO_SEEDS_PER_S:.0f} a second); "
          f"{steps / len(moves):.0f} loop steps and {virtual_s / len(moves):.0f} simulated seconds a seed, "
          f"{virtual_s / cpu_moves:.0f} simulated seconds per CPU second")
    if stand_in:
        print(f"world without moves: {len(stand_in) / cpu_stand_in:.1f} seeds per CPU second "
              f"({1000 * cpu_stand_in / len(stand_in):.0f} ms a seed)")
    print(f"seeds of the world with moves a {BAR_S:.0f} s gate fits at this run's rate: about "
          f"{int(len(moves) * BAR_S / wall)}")
    ratio = wall / BAR_S
    print(result("sim", ratio, TARGET))
    return 0 if ratio <= TARGET else 1


if __name__ == "__main__":
    sys.exit(main())
