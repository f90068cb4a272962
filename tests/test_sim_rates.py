"""The simulation's rate twins (issue 18 item 4): the spec's example rates everywhere but, in one seed in 20, one
region's cross-region path is slow enough that T11 refuses every move into it; the slow region is a function of the
seed alone, so every other seed replays as before."""

from __future__ import annotations

import asyncio

from services.target.budget import t11
from sim.faults import FaultPlan
from sim.twins.rates import EXAMPLE, SLOW_ONE_IN, PlanRates, slow_region

REGIONS = ("ie", "uk", "us")


def test_one_seed_in_twenty_has_a_slow_region_and_t11_refuses_moves_into_it() -> None:
    slow = {s: slow_region(f"moves:{s}", REGIONS) for s in range(600)}
    seeds = [s for s, region in slow.items() if region is not None]
    assert 600 // SLOW_ONE_IN // 2 <= len(seeds) <= 600 // SLOW_ONE_IN * 2
    assert slow == {s: slow_region(f"moves:{s}", REGIONS) for s in range(600)}, "a function of the seed"
    plan = FaultPlan(f"moves:{seeds[0]}")
    twin = PlanRates.of(plan, REGIONS)
    assert plan.draws == {}, "no draw from the plan's stream"
    into_slow = asyncio.run(twin.rates(slow[seeds[0]] or ""))
    others = [asyncio.run(twin.rates(r)) for r in REGIONS if r != slow[seeds[0]]]
    assert all(r == EXAMPLE for r in others)
    assert not t11(1, into_slow).eligible and "more than the 120 s window" in t11(1, into_slow).reason()
    assert t11(1, EXAMPLE).eligible


def test_a_seed_with_a_slow_region_is_refused_by_t11_and_stays_clean() -> None:
    """Move seed 2 makes uk's cross-region path slow: every move into uk is refused by the target's T11 and aborts
    itself at its prepare bound (never cutting); move-liveness excuses it, and no invariant fails."""
    from sim.moves import run_move_seed

    assert slow_region("moves:2", REGIONS) == "uk"
    result = run_move_seed(2, trace=True)
    assert not result.violations and result.error is None, result.report()
    refused = [line for line in result.trace
               if "T11 the cut would take" in line and "more than the 120 s window" in line]
    assert any(" uk-1#" in line for line in refused), "the uk target refuses at T11"
    assert any("uk cannot take this move yet" in line for line in refused), "the source shows why (M-C4)"
    assert result.counters["moves_aborted"] >= 1
