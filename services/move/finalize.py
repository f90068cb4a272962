"""Finalization of a committed move (spec §7.9 steps 3-5, §6.4, §19.2 K5 and K8; digest D§8).

After the commit the claim carries two obligations (:func:`services.move.follow.claim_half`):
``park-superseded`` owned by the source box, scoped to the holder's location, and ``park-staging`` owned
by the target box, scoped to the staging lane ``moves/<host>/<op>/``.

- **Source park** (§7.9 step 3): bucket-park the location by exact versions and acknowledge after the
  horizon (:mod:`services.move.park`); the local park (an injected ``local_retire``); record CAS
  ``source_parked_at``; claim CAS removing ``park-superseded``.
- **Staging park** (§7.9 step 4): bucket-park the lane; claim CAS removing ``park-staging``.
- **Close** (§7.9 step 5): once both obligations are gone, record CAS clearing ``move`` into
  ``last_move = done`` (record first, ruling M4, §7.5); then the claim's release to ``serving`` with the
  target as ``exec`` (K8), which is :func:`services.move.follow.claim_half`, so the console's recovery pass
  finishes a close that crashed between the two CASes.

**An abort** (§7.11) ends the same way: the door's record CAS ``state = aborted``; the claim half adds a
``park-staging`` owned by the target (:func:`services.move.follow.claim_half`, claim phase ``aborted``); the target
parks its staging lane; the source retires its own ``move-snapshots/<host>/<op>/`` by exact versions and stamps
``source_parked_at``; then the close, record first (``last_move = aborted``), and the release to ``serving`` with the
source still ``exec``.

The deciders are pure. Every step revalidates the claim first (K5) and every step is idempotent: the park's
journal is its manifests in the bucket, the CASes are conditional and decide NoChange when already done.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import msgspec

from bus.facts import Fact, publish_fact
from bus.log import EventLog, LogError
from events.claim import Claim, Obligation
from events.record import LastMove, Move, Record
from kernel import rules
from kernel.logctx import ctx
from kernel.ports import Clock
from services.box.instance.guard import ReadClaim, host_guard
from services.box.instance.registry import Registry
from services.box.instance.sandbox import InstanceUsers, instance_dir
from services.box.instance.stamps import ParkedArtifact, StampBook
from services.box.instance.timers import Timers
from services.ledger.ledger import Committed, Ledger, NoChange, Refusal
from services.move.fenced_target import open_waived
from services.move.follow import claim_half, snapshot_prefix
from services.move.guards import live_move, step_allowed
from services.move.lease import LeaseTiming, StagingStopped, StagingWork
from services.move.park import Acknowledged, Parker
from services.move.rollback import decide_target_phase

log = logging.getLogger("hostmove.finalize")

rules.register(
    "record-first-close",
    section="§7.5, K8, ruling M4 (rev 7.23); §7.9 step 5",
    meaning="the close clears the record's move into last_move only when both parks are acknowledged and the "
            "target has opened; the claim is released after the record, never before",
    site="services/move/finalize.py decide_close",
)

PARK_SUPERSEDED = "park-superseded"
PARK_STAGING = "park-staging"
_ENDINGS: dict[str, tuple[str, str, str]] = {
    "committed": ("landing", "committed", "done"),  # §7.9
    "aborted": ("moving", "aborted", "aborted"),  # §7.11
    "reverting": ("reverting", "", "rolled_back"),  # §7.4 reverting, once its journal says opened
    "rolling_back": ("restoring", "", "rolled_back"),  # §7.8, once recovered, opened and the target parked
}
"""For each record state a move ends from: the claim's op kind and phase while it finalizes, and the outcome."""


# -- pure deciders ----------------------------------------------------------------------------------------


def finalization_refused(claim: Claim | None, move_id: str) -> str | None:
    """K5 (§19.2): a finalization step runs only while the claim holds this move at ``landing/committed``, or
    ``moving/aborted`` for an abort."""
    op_kind = claim.op.kind if claim is not None else ""
    for kind, phase, _outcome in _ENDINGS.values():
        if kind == op_kind:
            return step_allowed(claim, op_id=move_id, kinds={kind}, phases={phase})
    return step_allowed(claim, op_id=move_id, kinds={k for k, _p, _o in _ENDINGS.values()})


def pending(claim: Claim | None, *, move_id: str, kind: str, owner: str) -> Obligation | None:
    """The obligation of ``kind`` this box owes for the move, if it is still on the claim."""
    if claim is None:
        return None
    for o in claim.obligations:
        if o.kind == kind and o.op == move_id and o.owner == owner:
            return o
    return None


def decide_source_parked(record: Record | None, *, move_id: str, incarnation: str, now_ms: int
                         ) -> Record | NoChange | Refusal:
    """Record CAS ``source_parked_at`` (§7.9 step 3), once."""
    if record is not None and record.move is None and record.last_move is not None and record.last_move.id == move_id:
        return NoChange("the move is already closed")
    move = live_move(record, move_id, incarnation)
    if record is None or move is None:
        return Refusal(f"the record no longer holds move {move_id}; the source park is not recorded")
    if move.state not in _ENDINGS:
        return Refusal(f"the move is {move.state}, not committed or aborted; the source does not park")
    if move.source_parked_at is not None:
        return NoChange("source_parked_at is already stamped")
    return msgspec.structs.replace(
        record, move=msgspec.structs.replace(move, source_parked_at=now_ms, updated_at=now_ms))


def decide_drop_obligation(claim: Claim | None, *, move_id: str, kind: str, owner: str, quiet_until: int
                           ) -> Claim | NoChange | Refusal:
    """Claim CAS removing the acknowledged obligation (K8) and raising the region's ``quiet_after`` to the
    park's horizon (digest D§1, T12: defence in depth)."""
    why = finalization_refused(claim, move_id)
    if why is not None or claim is None:
        return Refusal(why or "the host has no claim")
    ob = pending(claim, move_id=move_id, kind=kind, owner=owner)
    if ob is None:
        return NoChange(f"{kind} is already acknowledged")
    quiet = dict(claim.quiet_after)
    quiet[ob.region] = max(quiet.get(ob.region, 0), quiet_until)
    return msgspec.structs.replace(claim, obligations=tuple(o for o in claim.obligations if o != ob),
                                   quiet_after=quiet)


def decide_close(record: Record | None, claim: Claim | None, *, move_id: str, now_ms: int
                 ) -> Record | NoChange | Refusal:
    """Record CAS clearing ``move`` into ``last_move`` (``done`` §7.9 step 5, ``aborted`` §7.11; ruling M4)."""
    if record is not None and record.move is None and record.last_move is not None and record.last_move.id == move_id:
        return NoChange("the record is already closed")
    why = finalization_refused(claim, move_id)
    if why is not None or claim is None or claim.holder is None:
        return Refusal(why or "the claim names no holder")
    move = live_move(record, move_id, claim.holder.incarnation)
    if record is None or move is None:
        return Refusal(f"the record no longer holds move {move_id}")
    ending = _ENDINGS.get(move.state)
    if ending is None:
        return Refusal(f"the move is {move.state}, not committed or aborted; it does not close here")
    if rules.on("record-first-close"):
        left = sorted(o.kind for o in claim.obligations if o.op == move_id)
        if left:
            return NoChange(f"waiting for {', '.join(left)} to be acknowledged")
        if ending[2] == "done" and move.opened_at is None and not open_waived(record, claim):
            return NoChange("waiting for the target to open")  # unless fenced after the commit (§7.10)
        if move.state == "reverting" and claim.op.journal.get("rev_phase") != "opened":
            return NoChange("waiting for the source's recovery to open")
        rb = move.rollback
        if move.state == "rolling_back" and (rb is None or rb.recovered_at is None or rb.opened_at is None):
            return NoChange("waiting for the source's recovery to open")
        if move.state == "rolling_back" and rb is not None and rb.target_parked_at is None:
            return NoChange("waiting for the target to park what it released")
        if move.source_parked_at is None:
            return NoChange("waiting for the source to record its park")
    outcome: Literal["done", "rolled_back", "aborted"] = (
        "done" if ending[2] == "done" else "rolled_back" if ending[2] == "rolled_back" else "aborted")
    return msgspec.structs.replace(record, move=None, last_move=LastMove(id=move_id, outcome=outcome, at=now_ms))


def terminal_payload(move: Move) -> dict[str, object]:
    """What the terminal log event of a move carries (§7.8 "Finalization", §13 "Move log"): every timing, the digests
    the cut and the landing recorded, the reason and, after a rollback, its id, verdict and seal's ``N'``. Pure."""
    rb = move.rollback
    timings = {k: v for k, v in (
        ("requested_at", move.requested_at), ("ready_at", move.ready_at), ("cut_at", move.cut_at),
        ("flipped_at", move.flipped_at), ("committed_at", move.committed_at), ("opened_at", move.opened_at),
        ("source_parked_at", move.source_parked_at),
        ("rollback_requested_at", rb.requested_at if rb else None), ("recovered_at", rb.recovered_at if rb else None),
        ("rollback_opened_at", rb.opened_at if rb else None),
        ("target_parked_at", rb.target_parked_at if rb else None)) if v is not None}
    digests = {"db_sha256": move.source.db_sha256, "files_plain": move.source.files.plain,
               "files_sealed": move.source.files.sealed, "timers_sha256": move.source.timers_sha256,
               "installed_db_sha256": move.landing.installed_db_sha256}
    out: dict[str, object] = {"from": move.from_, "to": move.to, "reason": move.reason, "timings": timings,
                              "digests": {k: v for k, v in digests.items() if v}}
    if rb is not None:
        out["rollback"] = {"id": rb.id, "dirty": rb.dirty, "reason": rb.reason, "evidence": rb.evidence,
                           "n": rb.seal.n if rb.seal is not None else None, "probe_failures": rb.probe_failures}
    return out


# -- the source's local park ---------------------------------------------------------------------------------


class FinalizeError(Exception):
    """A finalization step found the box's state not what the claim says; the message says why."""


@dataclass(frozen=True)
class LocalRetired:
    parked: tuple[ParkedArtifact, ...]
    row_deleted: bool
    timers_deleted: int


@dataclass
class LocalRetirement:
    """The source's local park (§7.9 step 3; §6.4 "Local retirement"): under the host guard and a fresh claim
    read (K5 again), ``retire-installation`` of the holder's incarnation (the retired marker first, then every
    tagged artifact renamed into ``.parked/superseded-<op>/park-superseded-local/<host>/``), then the row's
    delete conditional on ``hold_op = move id``, the host's timers rows and its instance user (issue 14).
    Idempotent: a replay parks nothing new and deletes nothing more. Usable as :attr:`Finalizer.local_retire`."""

    box_dir: Path
    stamps: StampBook
    registry: Registry
    timers: Timers
    read_claim: ReadClaim
    clock: Clock

    async def __call__(self, host: str, move_id: str, hold_op: str = "") -> LocalRetired:
        async with host_guard(self.box_dir, host, self.read_claim, clock=self.clock) as guarded:
            claim = guarded.claim
            why = finalization_refused(claim, move_id)
            if why is not None or claim is None or claim.holder is None:
                raise FinalizeError(f"the local park of {host} did not run: {why or 'the claim names no holder'}")
            parked = self.stamps.retire_installation(guarded, claim.holder.incarnation, op=move_id,
                                                     event=f"{PARK_SUPERSEDED}-local")
            row_deleted = self.registry.delete_held(host, hold_op or move_id)
            timers_deleted = self.timers.delete_all(host)
            InstanceUsers(self.box_dir).release(host, instance_dir(self.box_dir / "data", host))  # issue 14
        return LocalRetired(tuple(parked), row_deleted, timers_deleted)


LocalRetire = Callable[[str, str, str], Awaitable[object]]
"""``(host, move_id, hold_op) -> ...``: a box's local park under the host guard (:class:`LocalRetirement`)."""


# -- the runner -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StepReport:
    """What a finalization step did: ``done`` (its part is over), or why not and when to wake again."""

    done: bool
    reason: str = ""
    wake_at: int | None = None


@dataclass
class Finalizer:
    """One box's finalization worker for one region's bucket (``parker``). ``local_retire(host, move_id)``
    is the source's local park (``retire-installation`` of §6.4), injected by the box; ``faults`` is a test
    hook called at ``after_source_parked`` and ``after_record_close`` that may raise to simulate a crash."""

    box: str
    ledger: Ledger
    parker: Parker
    events: EventLog | None = None
    local_retire: Callable[[str, str], Awaitable[object]] | None = None
    faults: Callable[[str], None] | None = None
    staging_lease: LeaseTiming | None = None
    """With it, the staging park takes the staging-work lease of (``staging_region``, host) first and revalidates
    the claim under it, so it never runs beside a staging writer (§7.3 "every staging retirement takes it
    first"; claim C3)."""
    staging_region: str = ""

    def _fault(self, point: str) -> None:
        if self.faults is not None:
            self.faults(point)

    async def source_park(self, host: str, move_id: str) -> StepReport:
        """§7.9 step 3 on the source box."""
        return await self._park(host, move_id, PARK_SUPERSEDED)

    async def follow(self, host: str) -> None:
        """Write the claim half the record has decided, when the claim does not follow it yet (§7.5): either
        participant may, as the console's recovery pass may; the CAS makes it once."""
        claim = (await self.ledger.read_claim(host)).state
        record = (await self.ledger.read_record(host)).state
        if isinstance(claim_half(claim, record), Claim):
            await self.ledger.transition("claim", host, "move-follow", lambda cur: claim_half(cur, record))

    async def source_park_unmoved(self, host: str, move_id: str) -> StepReport:
        """The source's part of a move that did not move, aborted (§7.11) or reverted once its recovery opened
        (§7.4): retire its own ``move-snapshots/<host>/<op>/`` by exact versions (ruling K19: every version
        through ``DeleteVersion``; F3 keeps the snapshots of completed moves only), stamp ``source_parked_at``, then
        the close (which waits for the target's ``park-staging``)."""
        await self.follow(host)
        claim = (await self.ledger.read_claim(host)).state
        record = (await self.ledger.read_record(host)).state
        if record is not None and record.last_move is not None and record.last_move.id == move_id:
            return await self.close(host, move_id)
        why = finalization_refused(claim, move_id)
        if why is not None or claim is None or claim.holder is None or record is None or record.move is None:
            return StepReport(False, why or "the claim or the record holds no move")
        move = record.move
        if move.state not in ("aborted", "reverting", "rolling_back"):
            return StepReport(False, f"the move is {move.state}, not aborted, reverting or rolling back")
        if (move.state == "reverting" and claim.op.journal.get("rev_phase") != "opened") or (
                move.state == "rolling_back" and (move.rollback is None or move.rollback.opened_at is None)):
            return StepReport(False, "the source's recovery has not opened yet")
        if record.move.source_parked_at is None:
            store, bucket = self.parker.store, self.parker.bucket
            for v in await store.list_versions(bucket, snapshot_prefix(host, move_id)):
                await store.delete(bucket, v.key, version_id=v.version_id)
            failed = await self._source_parked(host, move_id, claim.holder.incarnation)
            if failed is not None:
                return failed
        return await self.close(host, move_id)

    async def _source_parked(self, host: str, move_id: str, incarnation: str) -> StepReport | None:
        """The record CAS ``source_parked_at`` (§7.9 step 3, §7.11); a report when it did not land."""
        now = self.ledger.clock.now_ms()

        def stamp(cur: Record | None) -> Record | NoChange | Refusal:
            return decide_source_parked(cur, move_id=move_id, incarnation=incarnation, now_ms=now)

        out = await self.ledger.transition("record", host, "source-parked", stamp, causation=move_id)
        if isinstance(out, Refusal):
            return StepReport(False, out.reason)
        if not isinstance(out, Committed | NoChange):
            return StepReport(False, "another writer changed the record; the step runs again")
        self._fault("after_source_parked")
        return None

    async def target_release_park(self, host: str, move_id: str, local: LocalRetire) -> StepReport:
        """§7.8 ``cleaning`` on the target box, only after the source's ``recovered_at``: park its location and its
        staging lane by exact versions (its two obligations), the local park (``local``, the row's delete
        conditional on the rollback id), then ``cleaned`` with ``target_parked_at``, the obligations dropped, and
        the close (which waits for the source's open and its snapshots)."""
        claim = (await self.ledger.read_claim(host)).state
        record = (await self.ledger.read_record(host)).state
        if record is not None and record.last_move is not None and record.last_move.id == move_id:
            return await self.close(host, move_id)
        why = finalization_refused(claim, move_id)
        move = record.move if record is not None else None
        if why is not None or claim is None or move is None or move.rollback is None:
            return StepReport(False, why or "the record holds no rollback")
        rb = move.rollback
        if rb.recovered_at is None:
            return StepReport(False, "waiting for the source to recover before the target cleans (§7.8)")
        quiet: dict[str, int] = {}
        for kind in (PARK_SUPERSEDED, PARK_STAGING):
            ob = pending(claim, move_id=move_id, kind=kind, owner=self.box)
            if ob is None or ob.scope is None:
                continue
            outcome = await self.parker.park_scope(host=host, op=move_id, kind=kind, scope=ob.scope)
            if not isinstance(outcome, Acknowledged):
                return StepReport(False, outcome.reason, outcome.until)
            quiet[kind] = (ob.scope.evidence_at or 0) + self.parker.timing.horizon_ms(ob.scope)
        if rb.target_parked_at is None:
            await local(host, move_id, rb.id)
            now = self.ledger.clock.now_ms()

            def cleaned(cur: Record | None) -> Record | NoChange | Refusal:
                return decide_target_phase(cur, move_id, "cleaning", "cleaned", target_parked_at=now)

            out = await self.ledger.transition("record", host, "rollback-target-cleaned", cleaned, causation=move_id)
            if isinstance(out, Refusal):
                return StepReport(False, out.reason)
        for kind, until in quiet.items():
            def drop(cur: Claim | None, kind: str = kind, until: int = until) -> Claim | NoChange | Refusal:
                return decide_drop_obligation(cur, move_id=move_id, kind=kind, owner=self.box, quiet_until=until)

            await self.ledger.transition("claim", host, f"{kind}-acknowledged", drop, causation=move_id)
        return await self.close(host, move_id)

    async def staging_park(self, host: str, move_id: str) -> StepReport:
        """§7.9 step 4 on the target box, under the staging-work lease when one is configured."""
        if self.staging_lease is None or not rules.on("staging-lease"):
            return await self._park(host, move_id, PARK_STAGING)
        work = StagingWork(self.ledger.store, self.ledger.bucket, self.ledger.clock, self.staging_lease,
                           region=self.staging_region, host=host, op_id=move_id, holder=f"{self.box}/staging-park")
        try:
            await work.acquire()
        except StagingStopped as exc:
            return StepReport(False, f"waiting for the staging lease: {exc}",
                              self.ledger.clock.now_ms() + self.staging_lease.ttl_ms // 4)
        try:
            return await self._park(host, move_id, PARK_STAGING)  # revalidates the claim first (K5)
        finally:
            await work.release()

    async def _park(self, host: str, move_id: str, kind: str) -> StepReport:
        claim = (await self.ledger.read_claim(host)).state
        record = (await self.ledger.read_record(host)).state
        if record is not None and record.last_move is not None and record.last_move.id == move_id:
            return await self.close(host, move_id)  # closed already: at most the release is left
        why = finalization_refused(claim, move_id)
        if why is not None or claim is None or claim.holder is None:
            return StepReport(False, why or "the claim names no holder")
        incarnation = claim.holder.incarnation
        ob = pending(claim, move_id=move_id, kind=kind, owner=self.box)
        if ob is None:
            return await self.close(host, move_id)
        if ob.scope is None:
            return StepReport(False, f"the {kind} obligation has no scope; it cannot run unscoped (INV-22)")
        outcome = await self.parker.park_scope(host=host, op=move_id, kind=kind, scope=ob.scope)
        if not isinstance(outcome, Acknowledged):
            return StepReport(False, outcome.reason, outcome.until)
        quiet_until = (ob.scope.evidence_at or 0) + self.parker.timing.horizon_ms(ob.scope)
        if kind == PARK_SUPERSEDED:
            if self.local_retire is not None:
                await self.local_retire(host, move_id)
            failed = await self._source_parked(host, move_id, incarnation)
            if failed is not None:
                return failed

        def drop(cur: Claim | None) -> Claim | NoChange | Refusal:
            return decide_drop_obligation(cur, move_id=move_id, kind=kind, owner=self.box, quiet_until=quiet_until)

        dropped = await self.ledger.transition("claim", host, f"{kind}-acknowledged", drop, causation=move_id)
        if isinstance(dropped, Refusal):
            return StepReport(False, dropped.reason)
        if not isinstance(dropped, Committed | NoChange):
            return StepReport(False, "another writer changed the claim; the step runs again")
        await self._fact("park-acknowledged", host, f"{move_id}:{kind}:{self.box}",
                         {"move": move_id, "obligation": kind, "events": list(outcome.events),
                          "listed_at": outcome.listed_at})
        return await self.close(host, move_id)

    async def close(self, host: str, move_id: str) -> StepReport:
        """§7.9 step 5: record first, then the claim's release (K8). Harmless to call at any time."""
        claim = (await self.ledger.read_claim(host)).state
        before = (await self.ledger.read_record(host)).state
        now = self.ledger.clock.now_ms()

        def close_record(cur: Record | None) -> Record | NoChange | Refusal:
            return decide_close(cur, claim, move_id=move_id, now_ms=now)

        state = before.move.state if before is not None and before.move is not None else ""
        name = {"aborted": "move-aborted", "reverting": "move-reverted",
                "rolling_back": "move-rolled-back"}.get(state, "move-done")  # how it ended
        out = await self.ledger.transition("record", host, name, close_record, causation=move_id)
        if isinstance(out, Refusal):
            return StepReport(False, out.reason)
        if isinstance(out, NoChange) and out.reason != "the record is already closed":
            return StepReport(True, out.reason)  # this box's part is over; the other participant closes
        if not isinstance(out, Committed | NoChange):
            return StepReport(False, "another writer changed the record; the close runs again")
        record = (await self.ledger.read_record(host)).state
        outcome = record.last_move.outcome if record is not None and record.last_move is not None else "done"
        if isinstance(out, Committed):  # the terminal log event, with every timing, digest and reason (§7.8, §13)
            closed = before.move if before is not None and before.move is not None else None
            await self._fact(f"move-{outcome}", host, f"{move_id}:{outcome}", {
                "move": move_id, "outcome": outcome, **(terminal_payload(closed) if closed is not None else {})})
        self._fault("after_record_close")

        def release(cur: Claim | None) -> Claim | NoChange | Refusal:
            return claim_half(cur, record)

        rel = await self.ledger.transition("claim", host, "release", release, causation=move_id)
        if isinstance(rel, Refusal):
            return StepReport(False, rel.reason)
        if not isinstance(rel, Committed | NoChange):
            return StepReport(False, "another writer changed the claim; the release runs again")
        where = "the target" if outcome == "done" else "the source"
        return StepReport(True, f"closed: last_move {outcome}, the claim serves on {where}")

    async def _fact(self, kind: str, host: str, fact_id: str, payload: dict[str, object]) -> None:
        if self.events is None:
            return
        fact = Fact(kind=kind, subject=host, id=fact_id, actor=self.ledger.actor, at=self.ledger.clock.now_ms(),
                    payload=payload)
        try:
            await publish_fact(self.events, fact)
        except LogError as exc:  # the authority already holds the step; the fact is for observers
            log.warning("fact %s for %s not published: %s", kind, host, exc,
                        extra=ctx(host=host, op_id=fact_id.split(":", 1)[0], box=self.box,
                                  phase="fact", reason=exc, fact=kind, fact_id=fact_id))
