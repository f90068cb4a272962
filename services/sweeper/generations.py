"""``park-generation``: retiring one dead generation of a host's location in one region (spec §5.1 step 9, §6.4,
§7.14 items 5, 6; protocol digest D§8 "Obligations queued ... plus park-generation").

A cold admission's publication (:func:`services.box.instance.coverage.decide_publish_generation`) queues one chore
per dead generation whose objects are in the publishing region, owned by the publishing box, with its persisted
scope ``{location, incarnation, evidence_at}`` (``evidence_at``: the superseding publication). The owner runs it
like every other park (:class:`services.move.park.Parker`): every version under the generation's prefixes
(:func:`services.box.replica.layout.generation_prefixes`: its replica files, certificates, build journal and files
namespace; the origin's level directories) is copied by ``versionId`` into ``superseded/<host>/<op>/<event>/`` with
an immutable manifest, then deleted by ``versionId``; it acknowledges only on an empty listing taken later than
``evidence_at + H`` (a late upload found then is one more event), every reference checked against the scope.

Before the park the claim is read again (K5) and the chore refused while its generation is the host's current one
or the baseline of an admission not yet covered (rule ``baseline-live``), or while it holds the host's newest files
manifest and the current generation here has none (a start whose manifest the archive refused): the chore waits,
nothing is touched. The
acknowledgement is one claim CAS that removes exactly that obligation and raises the region's ``quiet_after``; its
event, and a ``park-acknowledged`` fact, say what was retired.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from bus.facts import Fact, publish_fact
from bus.log import EventLog, LogError
from events.claim import Claim, Obligation
from kernel.logctx import ctx
from services.box.artifacts.filesmanifest import read_manifest
from services.box.artifacts.markers import normalize
from services.box.instance.coverage import (
    chore_generation,
    decide_adopt_chore,
    decide_generation_parked,
    lost_owner_chores,
    pending_generation_chores,
    retire_refusal,
)
from services.ledger.ledger import Committed, Ledger, NoChange, Refusal
from services.move.park import Acknowledged, Parker, ParkError

log = logging.getLogger("hostmove.sweeper")


class NoRead:
    """No claim given: :meth:`GenerationParks.run` reads it."""


NO_READ = NoRead()


def event_kind(chore: Obligation) -> str:
    """The chore's retirement events are ``park-generation.<generation>-<n>``: one destination per event (D5)."""
    return f"{chore.kind}.{chore.generation or '@root'}"


@dataclass(frozen=True)
class ChoresReport:
    """What one run of a host's chores did; ``wake_at`` (ms): run again then (a park waiting for its horizon)."""

    did: tuple[str, ...] = ()
    wake_at: int | None = None
    retired: tuple[str, ...] = field(default_factory=tuple)


@dataclass
class GenerationParks:
    """One box's runner of the ``park-generation`` chores it owns, in its region's bucket (``parker``). Nothing kept
    in memory matters: the chore and its scope are on the claim, the park's events are immutable manifests."""

    box: str
    region: str
    ledger: Ledger
    parker: Parker
    events: EventLog | None = None
    retry_ms: int = 1000

    async def run(self, host: str, claim: Claim | None | NoRead = NO_READ) -> ChoresReport:
        """Run every chore this box owes for ``host``, each from a fresh claim read. ``claim``: the claim the caller
        has just read, to find the chores by (each chore still reads the claim again before it touches anything)."""
        did: list[str] = []
        retired: list[str] = []
        wakes: list[int] = []
        current = (await self.ledger.read_claim(host)).state if isinstance(claim, NoRead) else claim
        for lost in lost_owner_chores(current, self.region):  # a lost box's chores in this region: adopted first

            def adopt(cur: Claim | None, chore: Obligation = lost) -> Claim | NoChange | Refusal:
                return decide_adopt_chore(cur, chore, self.box)

            adopted = await self.ledger.transition("claim", host, "park-generation-adopted", adopt,
                                                   causation=f"{lost.op}:{lost.owner}->{self.box}")
            if isinstance(adopted, Committed):
                current = adopted.state
                did.append(f"park-generation {chore_generation(lost) or 'origin'}: adopted from lost {lost.owner}")
                log.info("park-generation of %s %s adopted from the lost box %s", host, chore_generation(lost),
                         lost.owner, extra=ctx(host=host, box=self.box, phase="park-generation", owner=lost.owner))
        for chore in pending_generation_chores(current, self.box):
            line, wake, done = await self._one(host, chore)
            did.append(line)
            if wake is not None:
                wakes.append(wake)
            if done:
                retired.append(chore_generation(chore))
        return ChoresReport(tuple(did), min(wakes) if wakes else None, tuple(retired))

    async def _files_kept(self, claim: Claim, chore: Obligation, gen: str) -> str | None:
        """Why the dead generation's files namespace is still the files' only durable copy, or None: a start whose
        files manifest could not be published (a file the archive refuses, M-C14) keeps the newest earlier manifest
        as that copy (§8.3, L17), so the generation holding it is not retired while the current one, here, has
        none."""
        holder = claim.holder
        if holder is None or not gen or not holder.admissions or holder.admissions[-1].region != chore.region:
            return None
        store, bucket = self.parker.store, self.parker.bucket
        if await read_manifest(store, bucket, holder.location, gen) is None:
            return None
        if normalize(holder.generation) and await read_manifest(store, bucket, holder.location,
                                                                holder.generation) is not None:
            return None
        return (f"generation {gen} holds the host's newest files manifest; the current generation "
                f"{holder.generation or 'origin'} has none yet")

    async def _one(self, host: str, chore: Obligation) -> tuple[str, int | None, bool]:
        gen = chore_generation(chore)
        name = gen or "origin"
        if chore.scope is not None:  # its park waits for the horizon and touches nothing before it (Parker.waiting)
            waiting = self.parker.waiting(host=host, op=chore.op, kind=event_kind(chore), scope=chore.scope,
                                          generation=gen)
            if waiting is not None:
                return f"park-generation {name}: {len(waiting.events)} event(s); {waiting.reason}", waiting.until, False
        claim = (await self.ledger.read_claim(host)).state  # K5: the claim right before anything is touched
        if claim is None or chore not in claim.obligations:
            return f"park-generation {name}: already acknowledged", None, False
        why = retire_refusal(claim, chore.region, gen) or await self._files_kept(claim, chore, gen)
        if why is not None:
            log.info("park-generation of %s %s waits: %s", host, name, why,
                     extra=ctx(host=host, box=self.box, phase="park-generation", generation=gen, reason=why))
            return f"park-generation {name} waits: {why}", self.ledger.clock.now_ms() + self.retry_ms, False
        if chore.scope is None:
            raise ParkError(f"the park-generation chore of {host} ({name}) has no scope; it never runs unscoped")
        outcome = await self.parker.park_scope(host=host, op=chore.op, kind=event_kind(chore), scope=chore.scope,
                                               generation=gen)
        if not isinstance(outcome, Acknowledged):
            return f"park-generation {name}: {len(outcome.events)} event(s); {outcome.reason}", outcome.until, False
        quiet_until = (chore.scope.evidence_at or 0) + self.parker.timing.horizon_ms(chore.scope)

        def ack(cur: Claim | None) -> Claim | NoChange:
            out = decide_generation_parked(cur, chore, quiet_until)
            return out if isinstance(out, Claim | NoChange) else NoChange(out.reason)

        done = await self.ledger.transition("claim", host, "park-generation-acknowledged", ack,
                                            causation=f"{chore.op}:{self.box}")
        if not isinstance(done, Committed | NoChange):
            return f"park-generation {name}: the claim changed; acknowledged on the next run", None, False
        log.info("park-generation of %s retired generation %s in %s after %d event(s)", host, name, chore.region,
                 len(outcome.events), extra=ctx(host=host, box=self.box, phase="park-generation", generation=gen,
                                                region=chore.region, events=len(outcome.events)))
        if self.events is not None and isinstance(done, Committed):
            fact = Fact(kind="park-acknowledged", subject=host, id=f"{chore.op}:{event_kind(chore)}:{self.box}",
                        actor=self.ledger.actor, at=self.ledger.clock.now_ms(),
                        payload={"obligation": chore.kind, "op": chore.op, "generation": gen, "region": chore.region,
                                 "events": list(outcome.events), "listed_at": outcome.listed_at})
            try:
                await publish_fact(self.events, fact)
            except LogError as exc:  # the claim holds the acknowledgement; the fact is for observers
                log.warning("fact park-acknowledged for %s not published: %s", host, exc)
        return f"park-generation {name}: retired after {len(outcome.events)} event(s)", None, True


__all__ = ["ChoresReport", "GenerationParks", "event_kind"]
