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
- Scope (issue 16 item 6): **the namespace** (rule ``sweep-namespace``): every location of the host found under
  ``instances/<host>/`` in the region (``holder.location`` where the host is not served, an older incarnation's
  anywhere, a legacy layout it left), one ``park-sweep`` each, with ``CoverParkedPredecessors`` in its queuing and
  acknowledging CASes; **the staging lanes** (rule ``sweep-staging``): every ``moves/<host>/<op>/`` no live operation
  owns; and, by the serving box (:meth:`StragglerSweep.serving`), **the serving region's dead generations** of
  ``holder.location``: everything but the region-qualified live set (rules ``live-set-region``,
  ``absent-marker-origin``) is queued as a ``park-generation`` its chores retire (:mod:`services.sweeper.generations`).
  A ``generation.json`` that names a generation off the admitted chain touches nothing and is logged as an error.

The deciders are pure; :class:`StragglerSweep` is the thin runner the box agent calls on its scan's cadence.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from typing import Final

import msgspec

from bus.log import EventLog
from events.claim import Claim, Obligation, Scope
from kernel import rules
from kernel.logctx import ctx
from kernel.ports import Clock
from services.box.artifacts.markers import ORIGIN, admission_chain, normalize, read_generation_marker
from services.box.instance.coverage import (
    PARK_GENERATION,
    ROOT,
    chore_generation,
    chore_name,
    chore_op,
    cover_parked_predecessors,
    live_generations,
    pending_generation_chores,
)
from services.ledger.ledger import Committed, Ledger, NoChange, Refusal
from services.move.follow import host_segment
from services.move.park import Acknowledged, Parker
from services.sweeper.generations import GenerationParks
from services.sweeper.lostparks import LostRegionParks
from services.sweeper.retention import RetentionSweep

log = logging.getLogger("hostmove.sweeper")

PARK_SWEEP: Final = "park-sweep"
_INCARNATION: Final = re.compile(r"[0-9a-f]{64}")

rules.register(
    "sweep-namespace",
    section="§6.4 At-rest sweep (R3-4): locations discovered from the namespace",
    meaning="the at-rest sweep parks every location of the host it finds in its region, not only holder.location",
    site="services/sweeper/straggler.py sweep_targets",
)
rules.register(
    "sweep-staging",
    section="§6.4 At-rest sweep, CC20, model 25: moves/<host>/ lanes",
    meaning="the at-rest sweep also parks the host's staging lanes no live operation owns",
    site="services/sweeper/straggler.py sweep_targets",
)
rules.register(
    "live-set-region",
    section="§6.4 (the region-qualified live set, R4-3)",
    meaning="the serving region's sweep of dead generations keeps exactly its region's live set",
    site="services/sweeper/straggler.py dead_generations",
)
rules.register(
    "absent-marker-origin",
    section="§5.1 step 9 (R11-1): the sweep reads an absent generation.json as the origin",
    meaning="an absent marker names the origin, which stays live while the chain leads to it",
    site="services/sweeper/straggler.py dead_generations",
)
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
    """Why the host's namespace in ``region`` may not be swept now, or None (§6.4: at rest, no chore of this region
    pending: the parks of an operation own their own scopes)."""
    if claim is None or claim.holder is None:
        return "the host has no holder"
    if claim.op.kind != "serving":
        return f"an operation runs ({claim.op.kind})"
    if serving_region(claim) is None:
        return "no admission names the serving box's region"
    if any(o.region == region for o in claim.obligations):
        return f"a chore of {region} is pending"
    return None


def location_of(key: str, host: str) -> str | None:
    """The location a key of ``instances/<host>/`` belongs to: ``instances/<host>/<inc>`` for a 64-hex child, else
    the legacy location ``instances/<host>`` (its levels, generations, markers directly under the host)."""
    base = f"instances/{host_segment(host)}/"
    if not key.startswith(base):
        return None
    first = key[len(base):].split("/", 1)[0]
    return f"{base}{first}" if _INCARNATION.fullmatch(first) else base.rstrip("/")


def lane_of(key: str, host: str) -> str | None:
    """The staging lane ``moves/<host>/<op>`` a key of ``moves/<host>/`` belongs to."""
    base = f"moves/{host_segment(host)}/"
    if not key.startswith(base) or "/" not in key[len(base):]:
        return None
    return base + key[len(base):].split("/", 1)[0]


def generations_of(keys: list[str], location: str) -> set[str]:
    """The generations a location's keys hold (``g-<gen>/``, ``files/g-<gen>/``; the origin's level directories and
    certificates), by their chore names (the origin is ``@root``)."""
    base = location.rstrip("/") + "/"
    gens: set[str] = set()
    for key in keys:
        if not key.startswith(base):
            continue
        parts = key[len(base):].split("/")
        if parts[0].startswith("g-") and len(parts) > 1:
            gens.add(parts[0][2:])
        elif parts[0] == "files" and len(parts) > 2 and parts[1].startswith("g-"):
            gens.add(parts[1][2:])
        elif parts[0] == "closed" or (len(parts[0]) == 4 and parts[0].isdigit()):
            gens.add(ROOT)
    return gens


def sweep_targets(claim: Claim, region: str, instance_keys: list[str], lane_keys: list[str]) -> list[str]:
    """What the at-rest sweep of ``region`` parks, each a scope location (§6.4 "At-rest sweep"): in a region the
    host is not served in, every location of the host found there (rule ``sweep-namespace``; without it only
    ``holder.location``); in the serving region, every location but ``holder.location`` (older incarnations, a
    legacy layout the host left); in both, every staging lane ``moves/<host>/<op>`` no live operation owns (rule
    ``sweep-staging``)."""
    assert claim.holder is not None
    host = claim.host
    current = claim.holder.location.rstrip("/")
    served = serving_region(claim) == region
    found = {loc for k in instance_keys if (loc := location_of(k, host)) is not None}
    if not rules.on("sweep-namespace"):
        found &= {current}
    targets = sorted(loc for loc in found if not (served and loc == current))
    if current == f"instances/{host_segment(host)}" and served:  # an adopted legacy host: its children only
        targets = [t for t in targets if t != current]
    if rules.on("sweep-staging"):
        lanes = {lane for k in lane_keys if (lane := lane_of(k, host)) is not None}
        targets += sorted(lane for lane in lanes if lane.rsplit("/", 1)[1] != claim.op.id)
    return targets


def pending_sweeps(claim: Claim | None, owner: str, region: str) -> list[Obligation]:
    if claim is None:
        return []
    return [o for o in claim.obligations if o.kind == PARK_SWEEP and o.owner == owner and o.region == region]


def pending_sweep(claim: Claim | None, owner: str, region: str) -> Obligation | None:
    found = pending_sweeps(claim, owner, region)
    return found[0] if found else None


def _scope_incarnation(claim: Claim, location: str) -> str:
    """A scope's incarnation (§6.4): the location's own, else the holder's (a lane; the legacy location)."""
    assert claim.holder is not None
    last = location.rsplit("/", 1)[-1]
    return last if location.startswith("instances/") and _INCARNATION.fullmatch(last) else claim.holder.incarnation


def decide_queue_sweeps(claim: Claim | None, *, region: str, owner: str, listed_at: int, location: str,
                        targets: list[tuple[str, tuple[str, ...]]]) -> Claim | NoChange | Refusal:
    """Queue one ``park-sweep`` per target with its scope bound now (§6.4: persisted at the queuing CAS; ``evidence_at``
    the complete listing), and cover the records whose predecessors they park (``CoverParkedPredecessors``)."""
    if pending_sweeps(claim, owner, region):
        return NoChange("a sweep of this region is already queued")
    why = sweep_refused(claim, region)
    if why is not None or claim is None or claim.holder is None:
        return Refusal(f"the sweep of {region} is not queued: {why}")
    if sweep_location(claim) != location:
        return Refusal("the host's location changed since the listing; the sweep lists again")
    obs = tuple(Obligation(kind=PARK_SWEEP, op=f"sweep-{listed_at}-{i}", region=region, owner=owner,
                           generation=" ".join(sorted(gens)),
                           scope=Scope(location=target, incarnation=_scope_incarnation(claim, target),
                                       evidence_at=listed_at))
                for i, (target, gens) in enumerate(targets))
    out = msgspec.structs.replace(claim, obligations=(*claim.obligations, *obs))
    parked = [g for target, gens in targets if target == location for g in gens]
    return cover_parked_predecessors(out, region, parked)


def decide_queue_sweep(claim: Claim | None, *, region: str, owner: str, listed_at: int, location: str
                       ) -> Claim | NoChange | Refusal:
    """One ``park-sweep`` of ``holder.location`` (the sweep before the namespace: kept for its callers)."""
    return decide_queue_sweeps(claim, region=region, owner=owner, listed_at=listed_at, location=location,
                               targets=[(location, ())])


def decide_drop_sweep(claim: Claim | None, *, op: str, owner: str, region: str, quiet_until: int
                      ) -> Claim | NoChange | Refusal:
    """Acknowledge: remove the obligation (K8), raise the region's ``quiet_after`` to its horizon (T12), and cover the
    records whose predecessors it parked (``CoverParkedPredecessors``, §7.14 item 6)."""
    ob = next((o for o in pending_sweeps(claim, owner, region) if o.op == op), None)
    if claim is None or ob is None:
        return NoChange("the sweep is already acknowledged")
    quiet = dict(claim.quiet_after)
    quiet[region] = max(quiet.get(region, 0), quiet_until)
    out = msgspec.structs.replace(claim, obligations=tuple(o for o in claim.obligations if o != ob),
                                  quiet_after=quiet)
    if claim.holder is not None and ob.scope is not None and ob.scope.location == sweep_location(claim):
        out = cover_parked_predecessors(out, region, ob.generation.split())
    return out


def dead_generations(claim: Claim, region: str, keys: list[str], marker: str | None) -> list[str] | str:
    """The serving region's dead generations of ``holder.location`` (§6.4: "non-current generations inside
    ``holder.location`` are residue"), or why nothing may be touched. Live, never touched: the region-qualified live
    set (rule ``live-set-region``): ``holder.generation``, the generation ``generation.json`` names (absent: the
    origin, rule ``absent-marker-origin``) and the unfinished chain between them, every baseline of an uncovered
    admission in this region; and what a ``park-generation`` already retires. A marker off the chain (not the
    normal lag) touches nothing."""
    assert claim.holder is not None
    if marker is None:
        named = ORIGIN if rules.on("absent-marker-origin") else normalize(claim.holder.generation)
    else:
        named = normalize(marker)
    chain = admission_chain(claim)
    if named not in chain:
        return f"generation.json names {named or 'origin'}, which is not on the host's admitted chain"
    live = set(chain[: chain.index(named) + 1])
    qualified = rules.on("live-set-region")
    live |= {g for g in live_generations(claim, region)} if qualified else {
        normalize(a.predecessor.generation) for a in claim.holder.admissions if a.predecessor is not None}
    if not qualified:  # the mutation: a generation live in any region counts as live here
        live |= {normalize(a.generation) for a in claim.holder.admissions}
    queued = {chore_generation(o) for o in claim.obligations if o.kind == PARK_GENERATION and o.region == region}
    found = {normalize(g) for g in generations_of(keys, sweep_location(claim))}
    return sorted(g for g in found if g not in live and g not in queued)


def decide_queue_dead(claim: Claim | None, *, region: str, owner: str, listed_at: int, generation: str, session: int,
                      dead: list[str]) -> Claim | NoChange | Refusal:
    """Queue a ``park-generation`` (op ``session:<s>``, owned by the serving box) per dead generation, covering the
    records whose predecessors they are, in one CAS bound to the generation and session the listing saw (K5)."""
    if claim is None or claim.holder is None:
        return Refusal("the host has no holder")
    if claim.op.kind != "serving" or claim.op.exec != owner:
        return Refusal("the host is not at rest on this box")
    if (claim.holder.generation, claim.holder.session) != (generation, session):
        return Refusal("the host was admitted again since the listing; the sweep lists again")
    queued = {chore_generation(o) for o in claim.obligations if o.kind == PARK_GENERATION and o.region == region}
    location = sweep_location(claim)
    new = tuple(Obligation(kind=PARK_GENERATION, op=chore_op("", session), region=region, owner=owner,
                           generation=chore_name(g), scope=Scope(location=location,
                                                                 incarnation=claim.holder.incarnation,
                                                                 evidence_at=listed_at))
                for g in dead if g not in queued and g not in live_generations(claim, region))
    if not new:
        return NoChange("every dead generation is already queued")
    out = msgspec.structs.replace(claim, obligations=(*claim.obligations, *new))
    return cover_parked_predecessors(out, region, [chore_generation(o) for o in new])


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
    lost_parks: LostRegionParks = field(init=False)
    """The lost targets' parks of this box's region it adopts and runs (:mod:`services.sweeper.lostparks`)."""
    every_ms: int = 10_000
    """How often the serving box sweeps its own region for a host (:meth:`serving`)."""
    _serving_next: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.generations = GenerationParks(self.box, self.region, self.ledger, self.parker, self.events)
        self.lost_parks = LostRegionParks(self.box, self.region, self.ledger, self.parker)
        self.retention = RetentionSweep(self.box, self.region, self.parker.store, self.parker.bucket, self.clock,
                                        events=self.events, actor=self.ledger.actor,
                                        horizon_ms=self.parker.timing.horizon_ms(Scope(location="instances")))
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
        region_parks = await self.lost_parks.run(host, claim)  # a lost target's region park (§7.14 item 5)
        if region_parks.did:
            return SweepReport("; ".join(region_parks.did), region_parks.wake_at)
        retired = await self.retention.look(host, claim, (await self.ledger.read_record(host)).state)
        if retired:
            return SweepReport("; ".join(retired))
        return await self.namespace(host, claim)

    async def namespace(self, host: str, claim: Claim | None) -> SweepReport:
        """The at-rest sweep of this region's namespace of the host (:func:`sweep_targets`): queue one ``park-sweep``
        per location or lane found, park each by exact versions, acknowledge each after its horizon."""
        if not rules.on("straggler-sweep"):
            return SweepReport()
        obs = pending_sweeps(claim, self.box, self.region)
        if not obs:
            if sweep_refused(claim, self.region) is not None:
                return SweepReport()
            assert claim is not None and claim.holder is not None
            location = sweep_location(claim)
            listed_at = self.clock.now_ms()  # taken before the listing: the listing is no older than this
            store, bucket = self.parker.store, self.parker.bucket
            instance_keys = await store.list_keys(bucket, f"instances/{host_segment(host)}/")
            lane_keys = await store.list_keys(bucket, f"moves/{host_segment(host)}/")
            targets = sweep_targets(claim, self.region, instance_keys, lane_keys)
            if not targets:
                return SweepReport()
            found = [(t, tuple(sorted(generations_of(instance_keys, t)))) for t in targets]
            queued = await self.ledger.transition("claim", host, "park-sweep-queued", lambda cur: decide_queue_sweeps(
                cur, region=self.region, owner=self.box, listed_at=listed_at, location=location, targets=found))
            if not isinstance(queued, Committed | NoChange):
                return SweepReport(f"sweep not queued: {getattr(queued, 'reason', 'the claim changed')}")
            log.warning("at-rest sweep of %s in %s: %d locations or lanes to park (%s)", host, self.region,
                        len(targets), ", ".join(targets[:3]),
                        extra=ctx(host=host, box=self.box, phase="straggler-sweep", region=self.region,
                                  location=location, objects=len(instance_keys) + len(lane_keys)))
            obs = pending_sweeps(queued.state if isinstance(queued, Committed) else
                                 (await self.ledger.read_claim(host)).state, self.box, self.region)
            if not obs:
                return SweepReport("the sweep was acknowledged meanwhile")
        did, wakes = [], []
        for ob in obs:
            assert ob.scope is not None
            outcome = await self.parker.park_scope(host=host, op=ob.op, kind=PARK_SWEEP, scope=ob.scope)
            if not isinstance(outcome, Acknowledged):
                did.append(f"sweep {ob.op} parked {len(outcome.events)} event(s); {outcome.reason}")
                wakes.append(outcome.until)
                continue
            quiet_until = (ob.scope.evidence_at or 0) + self.parker.timing.horizon_ms(ob.scope)

            def drop(cur: Claim | None, op: str = ob.op, quiet_until: int = quiet_until) -> Claim | NoChange | Refusal:
                return decide_drop_sweep(cur, op=op, owner=self.box, region=self.region, quiet_until=quiet_until)

            dropped = await self.ledger.transition("claim", host, "park-sweep-acknowledged", drop)
            if isinstance(dropped, Refusal):
                did.append(f"sweep {ob.op} not acknowledged: {dropped.reason}")
            else:
                did.append(f"sweep {ob.op} of {ob.scope.location} acknowledged after {len(outcome.events)} event(s)")
        return SweepReport("; ".join(did), min(wakes) if wakes else None)

    def serving_due(self, host: str, now_ms: int) -> bool:
        """Is the serving box's sweep of ``host`` due (:meth:`serving` would not skip it on its cadence)."""
        return self._serving_next.get(host, 0) <= now_ms

    async def serving(self, host: str, claim: Claim | None) -> SweepReport:
        """The serving box's at-rest sweep of its own region (§6.4): the namespace's residue (older locations, lanes),
        and the dead generations of ``holder.location`` (:func:`dead_generations`), each queued as a
        ``park-generation`` its chores retire. At most once per ``every_ms`` per host."""
        now = self.clock.now_ms()
        if self._serving_next.get(host, 0) > now or claim is None or claim.holder is None:
            return SweepReport()
        self._serving_next[host] = now + self.every_ms
        if claim.op.kind != "serving" or claim.op.exec != self.box or not rules.on("straggler-sweep"):
            return SweepReport()
        report = await self.namespace(host, claim)
        if report.did:
            return report
        holder = claim.holder
        listed_at = self.clock.now_ms()
        keys = await self.parker.store.list_keys(self.parker.bucket, sweep_location(claim) + "/")
        marker = await read_generation_marker(self.parker.store, self.parker.bucket, holder.location)
        dead = dead_generations(claim, self.region, keys, marker.marker.op if marker.marker is not None else None)
        if isinstance(dead, str):
            log.error("the sweep of %s in %s touches nothing: %s", host, self.region, dead,
                      extra=ctx(host=host, box=self.box, phase="straggler-sweep", region=self.region, reason=dead))
            return SweepReport(f"nothing swept: {dead}")
        if not dead:
            return SweepReport()
        out = await self.ledger.transition("claim", host, "park-generation-swept", lambda cur: decide_queue_dead(
            cur, region=self.region, owner=self.box, listed_at=listed_at, generation=holder.generation,
            session=holder.session, dead=dead))
        if isinstance(out, Committed):
            log.warning("at-rest sweep of %s in %s: %d dead generation(s) queued for retirement (%s)", host,
                        self.region, len(dead), ", ".join(g or "origin" for g in dead[:3]),
                        extra=ctx(host=host, box=self.box, phase="straggler-sweep", region=self.region))
            return SweepReport(f"dead generations queued: {', '.join(g or 'origin' for g in dead)}")
        return SweepReport()
