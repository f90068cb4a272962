"""Coverage and retirement of admitted generations (spec §5.1 step 9, §7.14 "Admissions, coverage and retirement"
items 1 to 8; protocol digest D§6; model digest rules ``cover-at-park``, ``foreign-region-uncovered``,
``baseline-live``, ``covered-baseline-refused``).

Every cold admission leaves the generation it restored from behind. An admission record (``holder.admissions``)
names that **predecessor** and its region, and stays **uncovered** until something has taken charge of retiring the
predecessor's objects. A record becomes covered in exactly four ways (item 5):

1. **at birth**: a warm record, or one admitted while the claim already holds a whole-location park of the
   predecessor's region (an unscoped ``park-replica``, or a park scoped exactly to ``holder.location``);
2. **by publication**: :func:`decide_publish_generation`, after the marker names the new generation, walks the
   uncovered records in order: a predecessor that holds nothing anywhere (``predecessor_region == ""``) is covered
   with no chore; one that is the live generation again is left uncovered; one in the publishing region gets one
   deduplicated ``park-generation`` chore there and is covered; one in another region stays uncovered, with no
   chore, for that region's own publication or whole-location park (rule ``foreign-region-uncovered``);
3. **by** :func:`cover_region_predecessors`, inside the CAS that queues a region's whole-location park (the
   commit's park of the source region, the target's release, a lost target's release; rule ``cover-at-park``);
4. **by** :func:`cover_parked_predecessors`, in the CASes that queue and acknowledge an at-rest sweep, for the
   generations that sweep parks.

Covered records are trimmed from the front only, while more than eight remain, never past an uncovered one (item 8,
:func:`trim_admissions`), so ``holder.admissions`` is bounded however often a host wakes.

A ``park-generation`` chore (:class:`events.claim.Obligation` with ``generation`` set; the origin is named
``"@root"``) is executed by its owner box like the other parks (:mod:`services.sweeper.generations`). It never
retires a generation that is the host's current one or the baseline of an uncovered admission (rule
``baseline-live``, :func:`retire_refusal`).

Everything here is pure; :func:`publish_generation` is the thin runner around the ledger.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final

import msgspec

from events.claim import Admission, Claim, Holder, Obligation, Scope
from kernel import rules
from services.box.artifacts.markers import normalize
from services.ledger.ledger import Ledger, NoChange, Outcome, Refusal

PARK_GENERATION: Final = "park-generation"
ROOT: Final = "@root"
"""The origin generation as a chore names it (§5.1 step 9: ``""`` and ``"@root"`` are one origin)."""
MAX_ADMISSIONS: Final = 8
"""Covered records are trimmed from the front while more than this many remain (item 8, D§2.1)."""
WHOLE_LOCATION_KINDS: Final = frozenset({"park-superseded", "park-replica", "park-sweep"})

rules.register(
    "foreign-region-uncovered",
    section="§7.14 item 5 (publication), claim 6.14 item 5; §5.1 step 9",
    meaning="a publication queues no chore into another region: a foreign-region predecessor stays uncovered",
    site="services/box/instance/coverage.py decide_publish_generation",
)
rules.register(
    "cover-at-park",
    section="§7.14 items 5, 6 (CoverRegionPredecessors, CoverParkedPredecessors); claim 6.14 item 6",
    meaning="the CAS that queues a region's whole-location park (or a sweep's) covers the records whose "
            "predecessors it retires",
    site="services/box/instance/coverage.py cover_region_predecessors, cover_parked_predecessors",
)
rules.register(
    "baseline-live",
    section="§7.14 'marker (cold)' row, claim 6.10, R10-2; §6.4",
    meaning="a predecessor is queued for retirement only once the marker names its successor, and a generation "
            "is never retired while it is the host's current one or the baseline of an uncovered admission",
    site="services/box/instance/activator.py Activator._publish; services/box/instance/coverage.py retire_refusal",
)


def chore_name(generation: str) -> str:
    """A chore's name for a generation: the origin is ``"@root"`` so a chore can name it."""
    return normalize(generation) or ROOT


def chore_generation(ob: Obligation) -> str:
    """The generation a ``park-generation`` chore retires, normalized (the origin is ``""``)."""
    return normalize(ob.generation)


def trim_admissions(admissions: Iterable[Admission]) -> tuple[Admission, ...]:
    """Trim covered records from the front only, while more than eight, stopping at the first uncovered one."""
    kept = list(admissions)
    while len(kept) > MAX_ADMISSIONS and kept[0].covered:
        kept.pop(0)
    return tuple(kept)


def chore_op(op_id: str, session: int) -> str:
    """A chore's ``op``: the operation's id inside one, ``session:<s>`` while serving (§5.1 step 9)."""
    return op_id or f"session:{session}"


def is_whole_location(ob: Obligation, location: str) -> bool:
    """A park of the whole ``location`` (an unscoped ``park-replica``, or a park scoped exactly to it)."""
    if ob.kind not in WHOLE_LOCATION_KINDS:
        return False
    if ob.scope is None:
        return ob.kind == "park-replica"
    return ob.scope.location.rstrip("/") == location.rstrip("/")


def born_covered(claim: Claim, predecessor_region: str) -> bool:
    """Item 5, first way: the claim already holds a whole-location park of the predecessor's region (a rollback's
    return, admitted after the target's release queued its park)."""
    if claim.holder is None or not predecessor_region:
        return False
    location = claim.holder.location
    return any(o.region == predecessor_region and is_whole_location(o, location) for o in claim.obligations)


def _with_admissions(claim: Claim, holder: Holder, admissions: Iterable[Admission],
                     obligations: tuple[Obligation, ...] | None = None) -> Claim:
    new_holder = msgspec.structs.replace(holder, admissions=trim_admissions(admissions))
    return msgspec.structs.replace(claim, holder=new_holder,
                                   obligations=claim.obligations if obligations is None else obligations)


def _cover(a: Admission) -> Admission:
    return msgspec.structs.replace(a, covered=True)


# -- publication ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PublishRequest:
    """``PublishGeneration(observedOpID, observedPhase, observedSession, publishedGeneration, region, newID)``
    (§7.14 item 5): the box publishing, and the time of the publication (the chores' ``evidence_at``)."""

    box: str
    region: str
    observed_op_id: str
    observed_phase: str
    observed_session: int
    published_generation: str
    now_ms: int


def decide_publish_generation(claim: Claim | None, req: PublishRequest) -> Claim | NoChange | Refusal:
    """The walk over the uncovered records (module doc, way 2). Pure."""
    if claim is None or claim.holder is None:
        return Refusal("this host has no holder; nothing is published")
    op, holder = claim.op, claim.holder
    if (op.id, op.phase, holder.session) != (req.observed_op_id, req.observed_phase, req.observed_session):
        return Refusal("the claim changed since the admission; the next admission publishes instead")
    published = normalize(req.published_generation)
    if normalize(holder.generation) != published:
        return Refusal(f"generation {published or 'origin'} is not the host's current generation")
    if not any(normalize(a.generation) == published for a in holder.admissions):
        return Refusal(f"no admission names generation {published or 'origin'}")
    location = holder.location.rstrip("/")
    obligations = list(claim.obligations)
    queued = {(o.region, chore_generation(o)) for o in obligations if o.kind == PARK_GENERATION}
    out: list[Admission] = []
    changed = False
    for a in holder.admissions:
        pred = a.predecessor
        if a.covered:
            out.append(a)
            continue
        if pred is None or not a.predecessor_region:  # the predecessor holds nothing anywhere
            out.append(_cover(a))
            changed = True
            continue
        gen = normalize(pred.generation)
        if gen == published:  # live again (a clean return named it once more): nothing may retire it
            out.append(a)
            continue
        region, owner = req.region, req.box
        if a.predecessor_region != req.region:
            if rules.on("foreign-region-uncovered"):
                out.append(a)  # that region's own publication or whole-location park retires it
                continue
            region, owner = a.predecessor_region, pred.box or req.box  # the mutation: queued into that region
        if (region, gen) not in queued:
            obligations.append(Obligation(
                kind=PARK_GENERATION, op=chore_op(op.id, holder.session), region=region, owner=owner,
                generation=chore_name(gen),
                scope=Scope(location=location, incarnation=holder.incarnation, evidence_at=req.now_ms)))
            queued.add((region, gen))
        out.append(_cover(a))
        changed = True
    if not changed:
        return NoChange("every record is covered or waits for its own region")
    return _with_admissions(claim, holder, out, tuple(obligations))


async def publish_generation(ledger: Ledger, host: str, req: PublishRequest, *, causation: str = "") -> Outcome[Claim]:
    """Run :func:`decide_publish_generation` through the ledger (one CAS, one event)."""
    return await ledger.transition("claim", host, "publish-generation",  # type: ignore[return-value]
                                   lambda cur: decide_publish_generation(cur, req), causation=causation)


# -- parks cover what they retire -------------------------------------------------------------------------------


def cover_region_predecessors(claim: Claim, region: str) -> Claim:
    """``CoverRegionPredecessors(op, phase, region)``: inside the CAS that queues ``region``'s park of the whole
    location, cover every record whose predecessor's objects are that region's. Queues nothing."""
    holder = claim.holder
    if holder is None or not region or not rules.on("cover-at-park"):
        return claim
    if not any(not a.covered and a.predecessor_region == region for a in holder.admissions):
        return claim
    out = [_cover(a) if not a.covered and a.predecessor_region == region else a for a in holder.admissions]
    return _with_admissions(claim, holder, out)


def cover_parked_predecessors(claim: Claim, region: str, generations: Iterable[str]) -> Claim:
    """``CoverParkedPredecessors(op, phase, region, generations)``: in the CASes that queue and acknowledge an at-rest
    sweep, cover only the records whose predecessor is among the generations that sweep parks in ``region``."""
    holder = claim.holder
    parked = {normalize(g) for g in generations}
    if holder is None or not parked or not rules.on("cover-at-park"):
        return claim

    def hit(a: Admission) -> bool:
        return (not a.covered and a.predecessor is not None and a.predecessor_region == region
                and normalize(a.predecessor.generation) in parked)

    if not any(hit(a) for a in holder.admissions):
        return claim
    return _with_admissions(claim, holder, [_cover(a) if hit(a) else a for a in holder.admissions])


# -- retirement -------------------------------------------------------------------------------------------------


def live_generations(claim: Claim, region: str) -> frozenset[str]:
    """What no retirement in ``region`` may touch (``baseline-live``): the host's current generation, and every
    generation an uncovered admission names as its baseline (predecessor) in this region. Normalized."""
    holder = claim.holder
    if holder is None:
        return frozenset()
    live = {normalize(holder.generation)}
    for a in holder.admissions:
        if not a.covered and a.predecessor is not None and a.predecessor_region in (region, ""):
            live.add(normalize(a.predecessor.generation))
    return frozenset(live)


def retire_refusal(claim: Claim | None, region: str, generation: str) -> str | None:
    """Why ``generation`` may not be retired in ``region`` now (rule ``baseline-live``), or None."""
    if claim is None or claim.holder is None:
        return "the host has no holder"
    gen = normalize(generation)
    if not rules.on("baseline-live"):
        return None
    if gen == normalize(claim.holder.generation):
        return f"generation {gen or 'origin'} is the host's current generation"
    if gen in live_generations(claim, region):
        return f"generation {gen or 'origin'} is the baseline of an admission not yet covered"
    return None


def link_covered(claim: Claim, region: str, generation: str) -> bool:
    """Is ``generation`` of ``region`` already covered: named by a covered record as its predecessor there, by a
    pending ``park-generation`` of that region, or inside a pending whole-location park of that region? A covered
    generation is being retired or is gone, so no start restores it (§7.14 item 3)."""
    holder = claim.holder
    if holder is None:
        return False
    gen = normalize(generation)
    for a in holder.admissions:
        if a.covered and a.predecessor is not None and a.predecessor_region == region \
                and normalize(a.predecessor.generation) == gen:
            return True
    for o in claim.obligations:
        if o.region != region:
            continue
        if o.kind == PARK_GENERATION and chore_generation(o) == gen:
            return True
        if is_whole_location(o, holder.location):
            return True
    return False


def pending_generation_chores(claim: Claim | None, owner: str) -> list[Obligation]:
    """The ``park-generation`` chores ``owner`` must run for the host."""
    if claim is None:
        return []
    return [o for o in claim.obligations if o.kind == PARK_GENERATION and o.owner == owner]


def lost_owner_chores(claim: Claim | None, region: str) -> list[Obligation]:
    """The ``park-generation`` chores of ``region`` owed by a box the claim lists as lost (§7.10): the box never runs
    them again, so a live box of the region adopts each (:func:`decide_adopt_chore`)."""
    if claim is None:
        return []
    lost = {b.box for b in claim.lost}
    return [o for o in claim.obligations if o.kind == PARK_GENERATION and o.region == region and o.owner in lost]


def publication_owed(claim: Claim | None, box: str, region: str) -> bool:
    """Does ``box``, the serving writer of ``claim``, owe a ``PublishGeneration`` (§7.14 "retried after the
    timeout"): admission records left uncovered whose predecessors are this region's and dead, a publication a store
    or bus outage or a moved claim stopped. Only for the box's own writer and its own last admission."""
    if claim is None or claim.holder is None or claim.op.exec != box:
        return False
    holder = claim.holder
    current = normalize(holder.generation)
    owed = [a for a in holder.admissions if not a.covered and a.predecessor is not None
            and a.predecessor_region in (region, "") and normalize(a.predecessor.generation) != current]
    return bool(owed) and holder.writer_box == box and holder.admissions[-1].box == box


def decide_adopt_chore(claim: Claim | None, chore: Obligation, box: str) -> Claim | NoChange | Refusal:
    """The adoption CAS of a lost box's chore: ``chore`` becomes ``box``'s, its scope and evidence time kept (K8: a
    chore is acknowledged only by its owner, so it needs one that lives)."""
    if claim is None:
        return Refusal("the host has no claim")
    if chore not in claim.obligations:
        return NoChange("the chore was adopted or acknowledged meanwhile")
    if chore.owner not in {b.box for b in claim.lost}:
        return Refusal(f"the chore's owner {chore.owner} is not lost")
    mine = msgspec.structs.replace(chore, owner=box)
    return msgspec.structs.replace(claim, obligations=tuple(mine if o == chore else o for o in claim.obligations))


def decide_generation_parked(claim: Claim | None, chore: Obligation, quiet_until: int) -> Claim | NoChange | Refusal:
    """Acknowledge a ``park-generation``: remove exactly that obligation (K8) and raise the region's
    ``quiet_after`` to its horizon (T12), once."""
    if claim is None or chore not in claim.obligations:
        return NoChange("the chore is already acknowledged")
    quiet = dict(claim.quiet_after)
    quiet[chore.region] = max(quiet.get(chore.region, 0), quiet_until)
    return msgspec.structs.replace(claim, obligations=tuple(o for o in claim.obligations if o != chore),
                                   quiet_after=quiet)


__all__ = [
    "MAX_ADMISSIONS", "PARK_GENERATION", "ROOT", "PublishRequest", "born_covered", "chore_generation", "chore_name",
    "chore_op", "cover_parked_predecessors", "cover_region_predecessors", "decide_generation_parked",
    "decide_publish_generation", "is_whole_location", "link_covered", "live_generations", "pending_generation_chores",
    "publication_owed", "publish_generation", "retire_refusal", "trim_admissions",
]
