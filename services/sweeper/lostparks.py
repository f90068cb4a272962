"""A lost target's region park, adopted and run by that region's next live box (spec §7.14 item 5, §7.10, §6.4;
rule ``lost-region-park``; :mod:`services.move.lost` queues it).

Declaring a move's target lost queues, in the declaration's claim CAS, the park of the host's whole location in the
lost box's region (``park-superseded``, op ``lost:<move>``, ``evidence_at`` the declaration) and covers that
region's predecessors there. The lost box never runs it: the chore is owed by a live box of the region, or by
``@region`` (:data:`~services.move.lost.REGION_OWNER`) while the region has none. A box of that region that sees it
on a host it does not serve **adopts** it in one claim CAS (the owner becomes this box), then parks the scope by
exact versions like every park (:meth:`~services.move.park.Parker.park_scope`: copy, manifest, delete by
``VersionId``, acknowledge only after a listing later than ``evidence_at + H``) and acknowledges by removing the
obligation (K8), raising the region's ``quiet_after`` (T12). The platform showed the lost box stopped before the
declaration, so nothing it signed lands after the horizon. The deciders are pure; :class:`LostRegionParks` is the
thin runner :class:`~services.sweeper.straggler.StragglerSweep` calls first in its look at a host.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import msgspec

from events.claim import Claim, Obligation
from kernel.logctx import ctx
from services.ledger.ledger import Committed, Ledger, NoChange, Refusal
from services.move.lost import LOST_OP_PREFIX, REGION_OWNER
from services.move.park import Acknowledged, Parker

log = logging.getLogger("hostmove.sweeper")
KIND = "park-superseded"


def region_parks(claim: Claim | None, region: str, box: str) -> list[Obligation]:
    """The lost-region parks of ``region`` that ``box`` runs (owed to it) or may adopt (owed to the region)."""
    if claim is None:
        return []
    return [o for o in claim.obligations if o.kind == KIND and o.op.startswith(LOST_OP_PREFIX)
            and o.region == region and o.owner in (box, REGION_OWNER) and o.scope is not None]


def decide_adopt(claim: Claim | None, ob: Obligation, box: str) -> Claim | NoChange | Refusal:
    """The adoption CAS: the region's park ``ob`` becomes ``box``'s, its scope (and so its evidence time) kept.
    Refused while an operation names this box (the host is being installed here: M-R27 keeps a move out of the
    region while the park is pending, this is the second check, K5)."""
    if claim is None:
        return Refusal("the host has no claim")
    if ob not in claim.obligations:
        return NoChange("the park was adopted or acknowledged meanwhile")
    if claim.op.exec == box or box in claim.op.participants:
        return Refusal(f"an operation names {box}; its region's park waits")
    mine = msgspec.structs.replace(ob, owner=box)
    return msgspec.structs.replace(claim, obligations=tuple(mine if o == ob else o for o in claim.obligations))


def decide_region_parked(claim: Claim | None, ob: Obligation, quiet_until: int) -> Claim | NoChange:
    """Acknowledge: remove exactly ``ob`` (K8) and raise its region's ``quiet_after`` to the horizon (T12), once."""
    if claim is None or ob not in claim.obligations:
        return NoChange("the park is already acknowledged")
    quiet = dict(claim.quiet_after)
    quiet[ob.region] = max(quiet.get(ob.region, 0), quiet_until)
    return msgspec.structs.replace(claim, obligations=tuple(o for o in claim.obligations if o != ob),
                                   quiet_after=quiet)


@dataclass(frozen=True)
class RegionParksReport:
    did: tuple[str, ...] = ()
    wake_at: int | None = None


@dataclass
class LostRegionParks:
    """This box's runs of its region's lost-target parks (module docstring)."""

    box: str
    region: str
    ledger: Ledger
    parker: Parker

    async def run(self, host: str, claim: Claim | None) -> RegionParksReport:
        did: list[str] = []
        wakes: list[int] = []
        for ob in region_parks(claim, self.region, self.box):
            if ob.owner != self.box:
                def adopt(cur: Claim | None, ob: Obligation = ob) -> Claim | NoChange | Refusal:
                    return decide_adopt(cur, ob, self.box)

                adopted = await self.ledger.transition("claim", host, "lost-region-park-adopted", adopt,
                                                       causation=f"{ob.op}:{self.box}")
                if not isinstance(adopted, Committed):
                    did.append(f"{ob.op} not adopted: {getattr(adopted, 'reason', 'the claim changed')}")
                    continue
                log.warning("%s adopts the park of %s's location in %s (%s, the lost target's region)", self.box,
                            host, self.region, ob.op,
                            extra=ctx(host=host, box=self.box, op_id=ob.op, phase="lost-region-park",
                                      region=self.region))
                ob = msgspec.structs.replace(ob, owner=self.box)
            assert ob.scope is not None
            outcome = await self.parker.park_scope(host=host, op=ob.op, kind=KIND, scope=ob.scope)
            if not isinstance(outcome, Acknowledged):
                did.append(f"{ob.op} parked {len(outcome.events)} event(s); {outcome.reason}")
                wakes.append(outcome.until)
                continue
            quiet_until = (ob.scope.evidence_at or 0) + self.parker.timing.horizon_ms(ob.scope)

            def ack(cur: Claim | None, ob: Obligation = ob, q: int = quiet_until) -> Claim | NoChange:
                return decide_region_parked(cur, ob, q)

            done = await self.ledger.transition("claim", host, "lost-region-park-acknowledged", ack,
                                                causation=f"{ob.op}:{self.box}")
            if isinstance(done, Committed | NoChange):
                did.append(f"{ob.op} of {ob.scope.location} acknowledged after {len(outcome.events)} event(s)")
            else:
                did.append(f"{ob.op} not acknowledged: {getattr(done, 'reason', 'the claim changed')}")
        return RegionParksReport(tuple(did), min(wakes) if wakes else None)


__all__ = ["LostRegionParks", "RegionParksReport", "decide_adopt", "decide_region_parked", "region_parks"]
