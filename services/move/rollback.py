"""The rollback after the flip (spec §7.8; digest D§3.5, D§3.6), pure: the record's ``rollback`` journal, the claim's
halves and the clean-or-dirty decision.

**Triggers** (§7.8): a landing failure (the target, :func:`services.target.phases.decide_rollback`) or
``landing_deadline`` passed with no commit (the source or the console's recovery pass,
:func:`decide_deadline_rollback`). Each is the one record CAS ``landing -> rolling_back`` guarded by move id and
incarnation; the commit CASes the same field from ``probed``, so exactly one wins whoever races. Every trigger names
the same rollback id (:func:`events.ids.rollback_id`). The claim follows to ``restoring`` with ``exec`` still the
target. Then two journals in ``move.rollback``, each phase written before its effects:

| target (``target_phase``) | effects                                                                    |
|---------------------------|----------------------------------------------------------------------------|
| releasing                 | row ``releasing`` (``hold_op`` = rollback id), stop the probe, stop evidence |
| released                  | clean or dirty (:func:`release_verdict`), ``stopped-target.json``; the claim: |
|                           | exec -> none citing it, the target's ``park-superseded`` and ``park-staging``  |
| returning (dirty)         | the return lane ``moves/<host>/<rb>/`` in the source region's bucket           |
| returned (dirty)          | its seal (``rollback.seal``: every version and ``N'``)                      |
| cleaning                  | after the source's ``recovered_at``: park its location and its staging lane, local park |
| cleaned                   | ``target_parked_at``; the obligations dropped                               |

| source (``source_phase``) | effects                                                                   |
|---------------------------|---------------------------------------------------------------------------|
| waiting                   | until ``released`` (clean) or ``returned`` (dirty), and exec none         |
| claimed                   | the claim: exec none -> source citing the target's evidence (K4);         |
|                           | ``holder.stamp = op.source_stamp``; clean with ``src_covered``:           |
|                           | ``holder.generation = op.journal.src_gen``                                |
| restoring                 | row ``restoring`` (``hold_op`` = rollback id)                             |
| verified (clean)          | files and timers as at ``stopped`` (else ``stuck``)                       |
| parking .. restored       | dirty: §7.6's install from the return lane into ``g-<rb>``                |
|                           | (:mod:`services.source.return_install`)                                   |
| probing, probed           | the probe, an ``AdmitWriter``: clean ``clean-return``; dirty cold into    |
|                           | ``g-<rb>``, ``sealed``                                                    |
| recovered                 | ``recovered_at``                                                          |
| opened                    | the conditional open on the rollback id; ``opened_at``                    |

**Bounds** (§7.8, §7.10): nine failed recovery probe attempts (three times the landing's budget) record ``stuck``
(:func:`decide_probe_failed`); the move is held for an operator (``hostmove move resolve --retry``). Past
``release_deadline`` with no target evidence the move stays ``rolling_back``: nothing runs anywhere, an incident
pages, and it converges when the target returns (INV-3).

The close (record first, ``last_move = rolled_back``, then the release to ``serving`` on the source) waits for
``recovered_at``, ``opened_at``, ``target_parked_at``, the source's own snapshot retirement and every obligation.
"""

from __future__ import annotations

from typing import Any, Final

import msgspec

from events.claim import Claim, Obligation, Scope
from events.ids import rollback_id
from events.record import Move, Record, Rollback
from kernel import rules
from services.box.instance.coverage import cover_region_predecessors
from services.ledger.ledger import NoChange, Refusal
from services.move.follow import staging_scope_location
from services.move.guards import live_move, step_allowed
from services.target.budget import MAX_ATTEMPTS

rules.register(
    "dirty-return",
    section="§7.8 released (the target wrote: dirty; the return lane carries its writes); model rule dirty-return",
    meaning="a target whose database, files or timers changed after the install releases dirty and returns them",
    site="services/move/rollback.py release_verdict",
)
rules.register(
    "seal-return",
    section="§7.8 released and returning (rev 7.11, INV-15); model rule seal-return",
    meaning="a release is clean only when the seal recorded src_covered; otherwise the return carries the seal",
    site="services/move/rollback.py release_verdict; services/target/returning.py",
)
rules.register(
    "target-park",
    section="§7.8 Obligations (the target's released CAS adds its park-superseded); model rule target-park",
    meaning="the target's release adds, in the same claim write, the parks of its location and staging lane",
    site="services/move/rollback.py decide_target_released",
)
rules.register(
    "return-stamp",
    section="§7.8 claimed (holder.stamp = op.source_stamp; claim rev 6.5, R6-4); model rule return-stamp",
    meaning="the return CAS writes the source installation's own stamp back into holder.stamp",
    site="services/move/rollback.py decide_source_claimed",
)

TARGET_PHASES: Final = ("releasing", "released", "returning", "returned", "cleaning", "cleaned")
DIRTY_INSTALL: Final = ("parking", "building", "published", "local", "configured", "restored")
"""§7.8: the landing's install phases of §7.6, run on the source from the return lane (dirty only)."""
SOURCE_PHASES: Final = ("waiting", "claimed", "restoring", "verified", *DIRTY_INSTALL, "probing", "probed",
                        "recovered", "opened")
RECOVERY_PROBE_ATTEMPTS: Final = 3 * MAX_ATTEMPTS
"""§7.8, §7.10: nine failed recovery probe attempts (three times the landing's budget) are ``stuck``."""
PROBED_LANDING: Final = frozenset({"probing", "probed"})
"""Landing phases from which the target's probe may have written: before them a release is clean by itself."""


def live_rollback(record: Record | None, move_id: str) -> tuple[Move, Rollback] | Refusal:
    if record is None or record.move is None or record.move.id != move_id:
        return Refusal("the record holds no such move")
    move = record.move
    if move.state != "rolling_back" or move.rollback is None:
        return Refusal(f"the move is {move.state}, not rolling back")
    return move, move.rollback


def _phase(record: Record | None, move_id: str, field: str, order: tuple[str, ...], before: str, after: str,
           fields: dict[str, Any]) -> Record | NoChange | Refusal:
    got = live_rollback(record, move_id)
    if isinstance(got, Refusal):
        return got
    assert record is not None
    move, rb = got
    current = getattr(rb, field)
    if current == after or (current in order and order.index(current) > order.index(after)):
        return NoChange(f"{field} is already {current}")
    if current != before:
        return Refusal(f"{field} is {current or 'not started'}, not {before or 'not started'}; {after} waits")
    new_rb = msgspec.structs.replace(rb, **{field: after}, **fields)
    return msgspec.structs.replace(record, move=msgspec.structs.replace(move, rollback=new_rb))


def decide_target_phase(record: Record | None, move_id: str, before: str, after: str, **fields: Any
                        ) -> Record | NoChange | Refusal:
    """The journal write of the target's next release phase, from ``before`` only (``""`` = not started)."""
    return _phase(record, move_id, "target_phase", TARGET_PHASES, before, after, fields)


def decide_source_phase(record: Record | None, move_id: str, before: str, after: str, **fields: Any
                        ) -> Record | NoChange | Refusal:
    """The journal write of the source's next recovery phase, from ``before`` only."""
    return _phase(record, move_id, "source_phase", SOURCE_PHASES, before, after, fields)


def release_verdict(move: Move, *, src_covered: bool, db_sha256: str, files_plain: str, timers_sha256: str
                    ) -> tuple[bool, str]:
    """§7.8 ``released``: ``(dirty, why)``. Clean when the landing never reached its probe, or when the database,
    the files and the timers are what was installed; **and** the seal recorded ``src_covered`` (rev 7.11, rule
    ``seal-return``: otherwise the seal holds a write the source's replica does not). Dirty otherwise (rule
    ``dirty-return``): the return lane carries the target's state back."""
    if not src_covered and rules.on("seal-return"):
        return True, "the source's own replica did not reach its stopped database (src_covered is false)"
    if move.landing_phase not in PROBED_LANDING:
        return False, f"the landing stopped at {move.landing_phase or 'its start'}, before its probe"
    if rules.on("dirty-return"):
        if move.landing.installed_db_sha256 and db_sha256 != move.landing.installed_db_sha256:
            return True, "the target's database changed after it was installed (its probe wrote)"
        if move.source.files.plain and files_plain and files_plain != move.source.files.plain:
            return True, "the target's files changed after they were installed"
        if move.source.timers_sha256 and timers_sha256 != move.source.timers_sha256:
            return True, "the target's timers changed after they were installed"
    return False, "the target's database, files and timers are what was installed"


def new_rollback(move: Move, reason: str, now_ms: int, release_ms: int) -> Move:
    """The move after the trigger's CAS (§7.8): ``rolling_back`` with ``rollback.id`` (the move's one rollback id),
    the reason, ``requested_at`` and ``release_deadline = now + release_ms`` (15 min in production)."""
    rb = Rollback(id=rollback_id(move.id), requested_at=now_ms, reason=reason, release_deadline=now_ms + release_ms)
    return msgspec.structs.replace(move, state="rolling_back", rollback=rb, reason=reason, updated_at=now_ms)


def decide_deadline_rollback(record: Record | None, move_id: str, incarnation: str, now_ms: int, release_ms: int
                             ) -> Record | NoChange | Refusal:
    """The ``landing_deadline`` trigger (§7.8), taken by the source or the console's recovery pass: the record CAS
    ``landing -> rolling_back`` once the deadline passed with no commit. The commit CASes the same field from
    ``probed`` (§7.9), so exactly one of them wins."""
    move = live_move(record, move_id, incarnation)
    if record is None or move is None:
        return Refusal(f"the record no longer carries move {move_id} of this incarnation")
    if move.state == "rolling_back":
        return NoChange("the rollback is already recorded")
    if move.state != "landing":
        return Refusal(f"the move is {move.state}; only a landing rolls back")
    if move.landing_deadline is None or now_ms <= move.landing_deadline:
        return Refusal("the landing deadline has not passed; the target may still land")
    reason = "the landing deadline passed before the target committed"
    return msgspec.structs.replace(record, move=new_rollback(move, reason, now_ms, release_ms))


def decide_probe_failed(record: Record | None, move_id: str, why: str, now_ms: int,
                        budget: int = RECOVERY_PROBE_ATTEMPTS) -> Record | NoChange | Refusal:
    """One failed recovery probe attempt counted (§7.8, §7.10); the ``budget``-th records ``stuck`` with the reason,
    held for an operator. Only while the source's recovery is probing."""
    got = live_rollback(record, move_id)
    if isinstance(got, Refusal):
        return got
    assert record is not None
    move, rb = got
    if rb.source_phase not in ("probing", "probed", "recovered"):
        return Refusal(f"the source's recovery is {rb.source_phase or 'not started'}, not probing")
    failures = rb.probe_failures + 1
    new_rb = msgspec.structs.replace(rb, probe_failures=failures)
    if failures < budget:
        return msgspec.structs.replace(record, move=msgspec.structs.replace(move, rollback=new_rb, updated_at=now_ms))
    reason = f"the source's recovery probe failed {failures} times: {why}"
    return msgspec.structs.replace(record, move=msgspec.structs.replace(
        move, rollback=new_rb, state="stuck", reason=reason, stuck_at=now_ms, updated_at=now_ms))


def decide_target_released(claim: Claim | None, move_id: str, target: str, evidence: str, *, region: str,
                           evidence_at: int) -> Claim | NoChange | Refusal:
    """The claim half of ``released`` (§7.8, K3): exec target -> none citing the target's stop evidence, and in the
    same write (rule ``target-park``) the target's obligations: ``park-superseded`` for its location in its region
    and ``park-staging`` for the lane, both owned by the target and discharged by its ``cleaning``."""
    why = step_allowed(claim, op_id=move_id, kinds=("restoring",))
    if why is not None or claim is None or claim.holder is None:
        return Refusal(why or "the claim names no holder")
    op = claim.op
    if evidence and op.journal.get("evidence.target") == evidence:
        return NoChange("the target's release is already on the claim")
    if op.exec != target:
        return Refusal(f"the execution holder is {op.exec}, not the target {target}")
    if rules.on("exec-needs-evidence") and not evidence:
        return Refusal("the target names no stop evidence; execution does not leave it without it (K3)")
    inc = claim.holder.incarnation
    owed = (
        Obligation(kind="park-superseded", op=move_id, region=region, owner=target,
                   scope=Scope(location=claim.holder.location.rstrip("/"), incarnation=inc, evidence_at=evidence_at)),
        Obligation(kind="park-staging", op=move_id, region=region, owner=target,
                   scope=Scope(location=staging_scope_location(claim.host, move_id), incarnation=inc,
                               evidence_at=evidence_at)),
    ) if rules.on("target-park") else ()
    journal = {**op.journal, "evidence.target": evidence}
    released = msgspec.structs.replace(
        claim, op=msgspec.structs.replace(op, exec="none", journal=journal),
        obligations=claim.obligations + tuple(o for o in owed if o not in claim.obligations))
    # CoverRegionPredecessors (§7.14 item 6): the target region's whole-location park covers the records whose
    # predecessors are there (a restarted probe's dead generations); the source's recovery is born covered after it
    return cover_region_predecessors(released, region) if owed else released


def decide_source_claimed(claim: Claim | None, move_id: str, source: str, *, clean: bool = True,
                          src_covered: bool = False) -> Claim | NoChange | Refusal:
    """§7.8 ``claimed``: exec none -> the source, citing the target's evidence (K4); ``holder.stamp =
    op.source_stamp``, the source installation's own stamp the flip journaled (rule ``return-stamp``); and for a
    clean return with ``src_covered``, ``holder.generation = op.journal.src_gen``, the source's generation again."""
    why = step_allowed(claim, op_id=move_id, kinds=("restoring",))
    if why is not None or claim is None:
        return Refusal(why or "the host has no claim")
    op = claim.op
    if op.exec == source:
        return NoChange("the source already holds execution")
    if op.exec != "none":
        return Refusal(f"the execution holder is {op.exec}; the source waits for the target's release")
    if rules.on("exec-needs-evidence") and not op.journal.get("evidence.target"):
        return Refusal("the claim cites no target evidence; execution does not return without it (K4)")
    holder = claim.holder
    if holder is not None:
        if op.source_stamp and rules.on("return-stamp"):
            holder = msgspec.structs.replace(holder, stamp=op.source_stamp)
        src_gen = op.journal.get("src_gen")
        if clean and src_covered and isinstance(src_gen, str):
            holder = msgspec.structs.replace(holder, generation=src_gen)
    return msgspec.structs.replace(claim, holder=holder, op=msgspec.structs.replace(op, exec=source))


def decide_stuck(record: Record | None, move_id: str, reason: str, now_ms: int) -> Record | NoChange | Refusal:
    """``rolling_back -> stuck`` with the reason (§7.8, §7.10): the recovery waits for an operator."""
    got = live_rollback(record, move_id)
    if isinstance(got, Refusal):
        if record is not None and record.move is not None and record.move.state == "stuck":
            return NoChange("the move is already stuck")
        return got
    assert record is not None
    move, _rb = got
    return msgspec.structs.replace(record, move=msgspec.structs.replace(
        move, state="stuck", reason=reason, stuck_at=now_ms, updated_at=now_ms))


__all__ = ["DIRTY_INSTALL", "PROBED_LANDING", "RECOVERY_PROBE_ATTEMPTS", "SOURCE_PHASES", "TARGET_PHASES",
           "decide_deadline_rollback", "decide_probe_failed", "decide_source_claimed", "decide_source_phase",
           "decide_stuck", "decide_target_phase", "decide_target_released", "live_rollback", "new_rollback",
           "release_verdict"]
