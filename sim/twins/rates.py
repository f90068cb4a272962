"""The twins' T11 rates, from the seed's fault plan (issue 18 item 4; spec §7.3 T11).

A real box measures its rates (:mod:`services.target.rates`); a simulated box reports the rates its seed gives it:
the spec's worked example (10 MiB/s across regions, 250 MiB/s to regional S3, 500 MiB/s of disk) everywhere, but
in one seed in :data:`SLOW_ONE_IN` one region's cross-region path is slow (:data:`SLOW_MIB_S`): the cut's final
mirror alone (the 16 MiB bar) then takes longer than the cut window, so T11 refuses every move into that region and
the move aborts itself at its prepare bound (§7.11), never cutting.

The slow region is a function of the seed only (a hash, not a draw from the plan's stream), so a seed without one
replays exactly as it did before the twins reported rates.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

from services.target.budget import Rates
from sim.faults import FaultPlan

SLOW_ONE_IN = 20
SLOW_MIB_S = 0.05
EXAMPLE = Rates(cross_region=10, regional_s3=250, disk=500)


def slow_region(seed: int | str, regions: Sequence[str]) -> str | None:
    """The region whose cross-region path is slow in this seed, or None (most seeds)."""
    digest = hashlib.sha256(f"{seed}:slow-region".encode()).digest()
    if digest[0] % SLOW_ONE_IN:
        return None
    return regions[digest[1] % len(regions)]


@dataclass(frozen=True)
class PlanRates:
    """One box's rate twin: ``await rates(region)`` as a box's rate source (:class:`services.agent.service.BoxAgent`
    ``rates=``)."""

    slow: str | None

    @classmethod
    def of(cls, plan: FaultPlan, regions: Sequence[str]) -> PlanRates:
        return cls(slow_region(plan.seed, regions))

    async def rates(self, region: str) -> Rates:
        if region == self.slow:
            return Rates(cross_region=SLOW_MIB_S, regional_s3=EXAMPLE.regional_s3, disk=EXAMPLE.disk)
        return EXAMPLE


__all__ = ["EXAMPLE", "SLOW_MIB_S", "SLOW_ONE_IN", "PlanRates", "slow_region"]
