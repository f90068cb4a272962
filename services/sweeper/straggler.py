"""The at-rest straggler sweep (spec §6.4 "The straggler sweep", J2-R2-1, CC15, model 17; claim rev 5 §6.2a).

S3's signature limit bounds when a request is *accepted*, not when it completes: a request accepted before a
retirement's verification listing can land after it, as residue in a location the host has left (the
simulation's seeds put an old ``generation.json`` into a parked source location about 1,000 s after its park).
No later retirement of that location would ever run, so each region's box sweeps it: **for a host with no
operation running**, the box of a region the host is not served in lists the host's location there and, when it
finds anything current, queues a ``park-sweep`` obligation it owns, with its persisted scope
(``{location, incarnation, evidence_at}``; ``evidence_at`` is the sweeping box's complete listing, §6.4), parks
by exact versions (:class:`~services.move.park.Parker`: copy, manifest, delete by ``VersionId``, verify after
``evidence_at + H``) and acknowledges by removing the obligation in a claim CAS.

- The queue CAS re-checks on the fresh claim (K5) that no operation runs and the region is not the serving one;
  the door refuses any operation while an obligation is pending (M-R27, CC11), so nothing can install into the
  location while it is parked.
- Scope: the host's current location (``holder.location``, ``instances/<host>/<inc>``) in a region other than the
  serving one. **Not swept** (stated limits): older incarnations' locations, the serving region's dead generations (the
  generation chores own those, §6.4), and a ``moves/<host>`` namespace.

The deciders are pure; :class:`StragglerSweep` is the thin runner the box agent calls on its scan's cadence.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Final

import msgspec

from bus.log import EventLog
from events.claim import Claim, Obligation, Scope
from kernel import rules
from kernel.logctx import ctx
from kernel.ports import Clock
from services.box.instance.coverage import pending_generation_chores
from services.ledger.ledger import Committed, Ledger, NoChange, Refusal
from services.move.park import Acknowledged, Parker, location_prefix
from services.sweeper.generations import GenerationParks
from services.sweeper.retention import RetentionSweep

log = logging.getLogger("hostmove.sweeper")

PARK_SWEEP: Final = "park-sweep"

rules.register(
    "straggler-sweep",
    section="§6.4 The straggler sweep (J2-R2-1, CC15, model 17); INV-10",
    meaning="each region's box retires what lands in a location a host at rest has left, after its parks",
    site="services/sweeper/straggler.py StragglerSweep.look",
)


def serving_region(claim: Claim) -> str | None:
    """The region of the box that serves the host: the latest admission of ``op.exec`` names it."""
    if claim.holder is None:
        return None
    for a in reversed(claim.holder.admissions):
        if a.box == claim.op.exec:
            return a.region
    return None


def sweep_location(claim: Claim) -> str:
    """The holder's location (``instances/<host>/<inc>``), the scope a sweep parks."""
    assert claim.holder is not None
    return claim.holder.location.rstrip("/")


def sweep_refused(claim: Claim | None, region: str) -> str | None:
    """Why the host's location in ``region`` may not be swept now, or None (§6.4: at rest, not the serving
    region, no chore of this region pending: the parks of an operation own their own scopes)."""
    if claim is None or claim.holder is None:
        return "the host has no holder"
    if claim.op.kind != "serving":
        return f"an operation runs ({claim.op.kind})"
    served = serving_region(claim)
    if served is None:
        return "no admission names the serving box's region"
    if served == region:
        return f"the host is served in {region}"
    if any(o.region == region for o in claim.obligations):
        return f"a chore of {region} is pending"
    return None


def pending_sweep(claim: Claim | None, owner: str, region: str) -> Obligation | None:
    if claim is None:
        return None
    return next((o for o in claim.obligations if o.kind == PARK_SWEEP and o.owner == owner and o.region == region),
                None)


def decide_queue_sweep(claim: Claim | None, *, region: str, owner: str, listed_at: int, location: str
                       ) -> Claim | NoChange | Refusal:
    """Queue ``park-sweep`` with its scope bound now, once (§6.4: the scope is persisted at the queuing CAS)."""
    if pending_sweep(claim, owner, region) is not None:
        return NoChange("a sweep of this region is already queued")
    why = sweep_refused(claim, region)
    if why is not None or claim is None or claim.holder is None:
        return Refusal(f"the sweep of {region} is not queued: {why}")
    if sweep_location(claim) != location:
        return Refusal("the host's location changed since the listing; the sweep lists again")
    ob = Obligation(kind=PARK_SWEEP, op=f"sweep-{listed_at}", region=region, owner=owner,
                    scope=Scope(location=location, incarnation=claim.holder.incarnation, evidence_at=listed_at))
    return msgspec.structs.replace(claim, obligations=(*claim.obligations, ob))


def decide_drop_sweep(claim: Claim | None, *, op: str, owner: str, region: str, quiet_until: int
                      ) -> Claim | NoChange | Refusal:
    """Acknowledge: remove the obligation (K8) and raise the region's ``quiet_after`` to its horizon (T12)."""
    ob = pending_sweep(claim, owner, region)
    if claim is None or ob is None or ob.op != op:
        return NoChange("the sweep is already acknowledged")
    quiet = dict(claim.quiet_after)
    quiet[region] = max(quiet.get(region, 0), quiet_until)
    return msgspec.structs.replace(claim, obligations=tuple(o for o in claim.obligations if o != ob),
                                   quiet_after=quiet)


@dataclass(frozen=True)
class SweepReport:
    """What one look at a host did; ``wake_at`` (ms): look again then (a park waiting for its horizon)."""

    did: str = ""
    wake_at: int | None = None


@dataclass
class StragglerSweep:
    """One box's sweep of its region's bucket (``parker``). Nothing kept in memory matters: the obligation and
    its scope are on the claim, the park's events are immutable manifests."""

    box: str
    region: str
    ledger: Ledger
    parker: Parker
    clock: Clock
    events: EventLog | None = None
    retention_ms: int | None = None
    """How long parks' archives are kept (:mod:`services.sweeper.retention`); None: the deployment's setting."""
    generations: GenerationParks = field(init=False)
    """The ``park-generation`` chores this box owns (:mod:`services.sweeper.generations`)."""
    retention: RetentionSweep = field(init=False)
    """The retention of ``superseded/`` and ``move-snapshots/`` in this box's bucket."""

    def __post_init__(self) -> None:
        self.generations = GenerationParks(self.box, self.region, self.ledger, self.parker, self.events)
        self.retention = RetentionSweep(self.box, self.region, self.parker.store, self.parker.bucket, self.clock,
                                        events=self.events, actor=self.ledger.actor)
        if self.retention_ms is not None:
            self.retention.retention_ms = self.retention_ms
            self.retention.every_ms = max(min(self.retention_ms // 2, 60_000), 500)

    async def look(self, host: str, claim: Claim | None) -> SweepReport:
        """``claim``: the caller's fresh read (the agent's scan just read it); every write re-checks the claim it
        reads in its CAS (K5). A host this box does not serve may still owe it chores (a publication of its last
        stay here): they run first."""
        if pending_generation_chores(claim, self.box):
            chores = await self.generations.run(host)
            return SweepReport("; ".join(chores.did), chores.wake_at)
        retired = await self.retention.look(host, claim, (await self.ledger.read_record(host)).state)
        if retired:
            return SweepReport("; ".join(retired))
        if not rules.on("straggler-sweep"):
            return SweepReport()
        ob = pending_sweep(claim, self.box, self.region)
        if ob is None:
            if sweep_refused(claim, self.region) is not None:
                return SweepReport()
            assert claim is not None
            location = sweep_location(claim)
            listed_at = self.clock.now_ms()  # taken before the listing: the listing is no older than this
            found = await self.parker.store.list_keys(self.parker.bucket, location_prefix(location, host))
            if not found:
                return SweepReport()
            queued = await self.ledger.transition("claim", host, "park-sweep-queued", lambda cur: decide_queue_sweep(
                cur, region=self.region, owner=self.box, listed_at=listed_at, location=location))
            if not isinstance(queued, Committed | NoChange):
                return SweepReport(f"sweep not queued: {getattr(queued, 'reason', 'the claim changed')}")
            log.warning("straggler sweep of %s in %s: %d current objects in its left location (first %s)", host,
                        self.region, len(found), found[0],
                        extra=ctx(host=host, box=self.box, phase="straggler-sweep", region=self.region,
                                  location=location, objects=len(found)))
            ob = pending_sweep(queued.state if isinstance(queued, Committed) else
                               (await self.ledger.read_claim(host)).state, self.box, self.region)
            if ob is None:
                return SweepReport("the sweep was acknowledged meanwhile")
        assert ob.scope is not None
        outcome = await self.parker.park_scope(host=host, op=ob.op, kind=PARK_SWEEP, scope=ob.scope)
        if not isinstance(outcome, Acknowledged):
            return SweepReport(f"sweep {ob.op} parked {len(outcome.events)} event(s); {outcome.reason}", outcome.until)
        quiet_until = (ob.scope.evidence_at or 0) + self.parker.timing.horizon_ms(ob.scope)
        dropped = await self.ledger.transition("claim", host, "park-sweep-acknowledged", lambda cur: decide_drop_sweep(
            cur, op=ob.op, owner=self.box, region=self.region, quiet_until=quiet_until))
        if isinstance(dropped, Refusal):
            return SweepReport(f"sweep {ob.op} not acknowledged: {dropped.reason}")
        return SweepReport(f"sweep {ob.op} acknowledged after {len(outcome.events)} event(s)")
