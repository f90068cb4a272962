"""The target's pure deciders: the ``landing_phase`` machine, the commit, the open and the landing
failure's rollback request (spec §7.6, §7.7, §7.8 triggers, §7.9 steps 1-2, §7.13; digest D§3.4).

Every decider takes the record as read fresh and answers the new record, :class:`NoChange` (a replay:
the journal already says so) or :class:`Refusal` (in plain words). Each phase is journaled in
``landing_phase`` **before** its effects (§7.6), so entering phase ``q`` is the CAS that closes
phase ``q - 1``'s "done when".

| phase        | replay rule (§7.6)                                                                |
|--------------|-----------------------------------------------------------------------------------|
| checking     | replayable                                                                        |
| parking      | replayable: a present park manifest replays its deletion set                     |
| building     | replayable at every boundary; completion is the install manifest, never the intent |
| published    | replayable (journal only; ``generation.json`` is the probe admission's)           |
| local        | each sub-step idempotent; ``.files-gen`` last vouches for all of them             |
| configured   | replayable; an input mismatch is a rollback                                      |
| restored     | replayable until ``probing``; a sha256 or CheckDB mismatch is a rollback          |
| probing      | never replays an earlier phase (INV-7); a crash restarts only the probe           |
| probed       | the probe passed; next is the commit                                             |
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from events.claim import Claim
from events.record import Move, MoveLanding, Record
from kernel import rules
from services.ledger.ledger import NoChange, Refusal
from services.move.guards import live_move, step_allowed
from services.move.rollback import new_rollback

LANDING_PHASES: tuple[str, ...] = (
    "checking", "parking", "building", "published", "local", "configured", "restored", "probing", "probed",
)
"""§7.6's order. ``""`` (not yet started) precedes ``checking``."""

REPLAY: dict[str, str] = {
    "checking": "replay",
    "parking": "replay",
    "building": "replay",
    "published": "replay",
    "local": "replay",
    "configured": "replay",
    "restored": "replay",
    "probing": "restart-probe",
    "probed": "commit",
}
"""What a restarted worker does when the journal names a phase (§7.6 "replay" column, §7.13)."""

ROLLBACK_RELEASE_MS = 15 * 60 * 1000
"""``release_deadline = now + 15 min`` (§7.8)."""


@dataclass(frozen=True)
class Expect:
    """Which move, incarnation and box a step acts for (K5, §7.2)."""

    move_id: str
    incarnation: str
    box: str


def next_phase(phase: str) -> str | None:
    """The phase after ``phase`` (``""`` -> ``checking``); None after ``probed``."""
    if phase == "":
        return LANDING_PHASES[0]
    if phase not in LANDING_PHASES:
        raise ValueError(f"{phase!r} is not a landing phase")
    i = LANDING_PHASES.index(phase)
    return LANDING_PHASES[i + 1] if i + 1 < len(LANDING_PHASES) else None


def claim_refusal(claim: Claim | None, expect: Expect, *, committed: bool = False) -> str | None:
    """K5 for a target step: the claim is this move's ``landing`` op with this box as ``exec``, and its
    phase is before the commit (``committed=False``) or ``committed`` (``committed=True``) (§19 K5)."""
    why = step_allowed(claim, op_id=expect.move_id, kinds=("landing",), exec_box=expect.box)
    if why is not None:
        return why
    assert claim is not None
    if committed != (claim.op.phase == "committed"):
        return ("the claim has not followed the commit yet" if committed
                else "the claim says the landing is already committed")
    return None


def _live(record: Record | None, expect: Expect) -> Move | Refusal:
    move = live_move(record, expect.move_id, expect.incarnation)
    if move is None:
        return Refusal(f"the record no longer carries move {expect.move_id} of this incarnation")
    return move


def _landing_deadline_passed(move: Move, now_ms: int) -> bool:
    return move.landing_deadline is not None and now_ms > move.landing_deadline


def decide_enter(
    record: Record | None, expect: Expect, phase: str, now_ms: int, *, installed_db_sha256: str = ""
) -> Record | NoChange | Refusal:
    """Journal ``phase`` (§7.6): legal only as the successor of the journaled phase; the same phase
    again is a replay (NoChange); an earlier phase is refused (never replay before ``probing``, INV-7).
    Entering ``probing`` closes ``restored`` and records ``landing.installed_db_sha256``."""
    move = _live(record, expect)
    if isinstance(move, Refusal):
        return move
    assert record is not None
    if phase not in LANDING_PHASES:
        return Refusal(f"{phase!r} is not a landing phase")
    if move.state != "landing":
        return Refusal(f"the move is {move.state}, not landing; the target journals no landing phase")
    if move.rollback is not None:
        return Refusal("a rollback is recorded for this move; the landing does not go on")
    current = move.landing_phase
    if current == phase:
        return NoChange(f"landing_phase is already {phase}")
    if current and current not in LANDING_PHASES:
        return Refusal(f"the record's landing_phase {current!r} is not one this worker knows")
    if next_phase(current) != phase:
        return Refusal(f"landing_phase {current or '(none)'} cannot be followed by {phase}")
    if _landing_deadline_passed(move, now_ms):
        return Refusal("the landing deadline has passed; the landing is rolled back, not continued (§7.8)")
    landing = move.landing
    if phase == "probing":
        if not installed_db_sha256:
            return Refusal("entering probing needs the verified database's sha256 (§7.6 restored)")
        landing = MoveLanding(installed_db_sha256=installed_db_sha256)
    elif installed_db_sha256:
        return Refusal("the installed database's sha256 is recorded only when restored completes")
    new_move = msgspec.structs.replace(move, landing_phase=phase, landing=landing, updated_at=now_ms)
    return msgspec.structs.replace(record, move=new_move)


rules.register(
    "commit-deadline",
    section="§7.9 step 1; §7.7 (the probe's absolute deadline); §7.4 One absolute deadline",
    meaning="the target neither probes past nor commits after min(cut_deadline, landing_deadline)",
    site="services/target/phases.py decide_commit; services/target/worker.py (probe, commit)",
)


def commit_bound(move: Move) -> int | None:
    """The commit's bound: the earlier of ``cut_deadline`` and ``landing_deadline`` (§7.9, P2-deadline)."""
    bounds = [b for b in (move.cut_deadline, move.landing_deadline) if b is not None]
    return min(bounds) if bounds else None


def decide_commit(record: Record | None, expect: Expect, now_ms: int) -> Record | NoChange | Refusal:
    """§7.9 step 1: the record CAS ``probed`` -> ``committed``, only while ``now <= min(cut_deadline,
    landing_deadline)`` and no rollback reason is recorded. A late commit never lands."""
    move = _live(record, expect)
    if isinstance(move, Refusal):
        return move
    assert record is not None
    if move.state == "committed":
        return NoChange("the move is already committed")
    if move.state != "landing":
        return Refusal(f"the move is {move.state}; only a landing can commit")
    if move.rollback is not None or move.reason:
        return Refusal("a rollback reason is recorded; the commit is refused (§7.9)")
    if move.landing_phase != "probed":
        return Refusal(f"the landing is at {move.landing_phase or '(not started)'}, not probed; nothing to commit")
    bound = commit_bound(move)
    if bound is None:
        return Refusal("the move has no cut deadline; a commit cannot prove it is in time")
    if now_ms > bound and rules.on("commit-deadline"):
        which = "cut" if bound == move.cut_deadline else "landing"
        return Refusal(f"the {which} deadline passed before the commit; the move rolls back instead (§7.9)")
    new_move = msgspec.structs.replace(move, state="committed", committed_at=now_ms, updated_at=now_ms)
    return msgspec.structs.replace(record, move=new_move)


def decide_opened(record: Record | None, expect: Expect, now_ms: int) -> Record | NoChange | Refusal:
    """§7.9 step 2's CAS ``opened_at``, after the registry's conditional open on ``hold_op``."""
    move = _live(record, expect)
    if isinstance(move, Refusal):
        return move
    assert record is not None
    if move.state != "committed" or move.committed_at is None:
        return Refusal(f"the move is {move.state}; the target opens only after the commit")
    if move.opened_at is not None:
        return NoChange("the target is already open")
    return msgspec.structs.replace(record, move=msgspec.structs.replace(move, opened_at=now_ms, updated_at=now_ms))


def decide_rollback(
    record: Record | None, expect: Expect, reason: str, now_ms: int, release_ms: int = ROLLBACK_RELEASE_MS
) -> Record | NoChange | Refusal:
    """A landing failure (§7.8 triggers): the record CAS ``landing`` -> ``rolling_back`` with the move's rollback
    id, the reason and ``release_deadline = now + 15 min``. The commit CASes the same field, so exactly one wins; a
    committed move is never rolled back here. (``landing_deadline`` is the source's and the console's trigger too:
    :func:`services.move.rollback.decide_deadline_rollback`.)"""
    move = _live(record, expect)
    if isinstance(move, Refusal):
        return move
    assert record is not None
    if move.state == "rolling_back":
        return NoChange("the rollback is already recorded")
    if move.state != "landing":
        return Refusal(f"the move is {move.state}; only a landing rolls back")
    if not reason:
        return Refusal("a rollback needs a reason")
    return msgspec.structs.replace(record, move=new_rollback(move, reason, now_ms, release_ms))


def decide_touch(claim: Claim | None, expect: Expect, region: str) -> Claim | NoChange | Refusal:
    """§7.6 ``checking``: CAS-add this box (and region) to ``touched`` before any local write (claim
    spec §2, K12), only while the claim is this move's ``landing`` op with this box as ``exec``."""
    why = claim_refusal(claim, expect)
    if why is not None:
        return Refusal(why)
    assert claim is not None
    touched = claim.touched
    if expect.box in touched.boxes and region in touched.regions:
        return NoChange("this box and region are already in touched")
    boxes = touched.boxes if expect.box in touched.boxes else (*touched.boxes, expect.box)
    regions = touched.regions if region in touched.regions else (*touched.regions, region)
    return msgspec.structs.replace(claim, touched=msgspec.structs.replace(touched, boxes=boxes, regions=regions))
