"""The source side of a move, pure: readiness and the journaled cut (spec §7.3, §7.4, §7.5, §7.13; D§3.1, D§3.2).

The cut is the ``cut_phase`` machine ``requested -> admitted -> stopping -> stopped -> staged -> archived ->
flipped``. Each phase is written to the record (journal first) **before** its side effects, so a restarted worker
re-reads the record and the claim and replays the effects of the phase the journal names (§7.4, §7.13):

| phase     | effects after the journal write                         | done when (durable, never memory)          |
|-----------|---------------------------------------------------------|--------------------------------------------|
| requested | none                                                    | always                                     |
| admitted  | none (the CAS itself stamps ``cut_at``, ``cut_deadline``) | always                                   |
| stopping  | hold ``moving``, drain timers, stop, stop evidence (K13) | the evidence exists (create-only)          |
| stopped   | timers snapshot; claim ``exec -> none`` citing it (K3)   | the claim's ``exec`` is ``none``           |
| staged    | byte-final mirror into ``replica/``; the seal (§7.3)     | the claim's journal holds ``seal``         |
| archived  | sealed archive create-only, copy to ``files/``; digests  | the claim's phase is ``sealed``            |
| flipped   | the claim follows (:func:`services.move.follow.claim_half`) | the claim is ``landing``                |

The ``sealed`` CAS also records the lane's seal bound ``staging_bound`` (seal time + staging lease TTL), the staging
park's ``evidence_at`` (§6.4).

Every phase after ``admitted`` is refused once ``now > cut_deadline`` (§7.4 "One absolute deadline"): the worker
records the revert instead and the source recovers the host (:mod:`services.source.revert`, ``reverting``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Final, Literal

import msgspec

from events.claim import Claim
from events.record import FilesDigest, Move, MoveInputs, Record
from kernel import rules
from services.ledger.ledger import NoChange, Refusal
from services.move.guards import step_allowed
from services.move.lease import LeaseTiming

rules.register(
    "source-readiness",
    section="§7.3 S1 (model 3: S1 is load-bearing); issue 18 item 5",
    meaning="ready needs the source instance's fresh readiness answer, from its own process (its cgroup leaf)",
    site="services/source/phases.py not_ready",
)
rules.register(
    "cut-deadline",
    section="§7.4 One absolute deadline; D§3.2",
    meaning="no source cut phase proceeds once now is past cut_deadline",
    site="services/source/phases.py deadline_passed",
)
rules.register(
    "admit-fresh-inputs",
    section="§7.4 admitted; D§3.2 step 2; T13",
    meaning="the cut is admitted only with fresh reports, unchanged pinned inputs and source recovery armed",
    site="services/source/phases.py decide_admit",
)
rules.register(
    "flip-needs-seal",
    section="§7.3 seal by version; §7.4 flipped",
    meaning="the flip needs the seal (replica, timers and files versions) in the claim's op journal",
    site="services/source/phases.py plan",
)

CutPhase = Literal["requested", "admitted", "stopping", "stopped", "staged", "archived", "flipped"]
CUT_PHASES: Final[tuple[CutPhase, ...]] = (
    "requested", "admitted", "stopping", "stopped", "staged", "archived", "flipped",
)
NEXT_PHASE: Final[dict[str, CutPhase]] = {a: b for a, b in zip(CUT_PHASES, CUT_PHASES[1:], strict=False)}
SEALED: Final = "sealed"
"""The claim's ``op.phase`` once the seal is complete (D§3.1 flip: ``moving/sealed -> landing/checking``)."""

MIB: Final = 1 << 20


# -- timing -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TimingProfile:
    """Every duration the source path uses (ARCHITECTURE §7): ``production`` holds the spec's values."""

    name: str
    cut_window_s: float  # the operator's cut window, the M2 promise (§7.3 T11 default 120 s)
    open_budget_s: float  # §7.4: the post-commit open
    freshness_s: float  # §7.3 ready: round, target report and source readiness each under 10 minutes old
    landing_budget_s: float  # landing_deadline = flipped_at + this (D§13 ambiguity 4: no value given)
    drain_timeout_s: float  # §9.4 drain before the stop evidence
    bar_bytes: int = 16 * MIB  # §7.3 the 16 MiB bar for a round
    staging_lease_ttl_s: float = 1800.0  # §7.3 the staging-work lease's TTL (claim C3); > skew + signature age
    clock_skew_s: float = 10.0  # §7.3 SafeUntil's clock skew allowance
    signature_age_s: float = 900.0  # §7.3 S3's signature-age limit (15 min) in SafeUntil = Until - skew - 15 min
    prepare_bound_s: float = 3600.0  # §7.11: a move never ready this long after its request aborts itself (§13)
    release_budget_s: float = 900.0  # §7.8: release_deadline = the rollback's CAS + 15 min
    revert_probe_budget_s: float = 900.0  # §7.4 reverting: fifteen minutes of failed probes is stuck

    def __post_init__(self) -> None:
        if self.staging_lease_ttl_s <= self.clock_skew_s + self.signature_age_s:
            raise ValueError(f"timing profile {self.name}: the staging lease TTL must exceed the clock skew plus the "
                             "signature-age limit, or SafeUntil is already past when the lease is taken (§7.3)")

    @property
    def cut_budget_s(self) -> float:
        return self.cut_window_s

    @property
    def staging_lease_ttl_ms(self) -> int:
        return int(self.staging_lease_ttl_s * 1000)


PRODUCTION: Final = TimingProfile("production", cut_window_s=120.0, open_budget_s=5.0, freshness_s=600.0,
                                  landing_budget_s=900.0, drain_timeout_s=10.0)
FAST: Final = TimingProfile("fast", cut_window_s=12.0, open_budget_s=0.5, freshness_s=60.0,
                            landing_budget_s=30.0, drain_timeout_s=2.0, staging_lease_ttl_s=2.0,
                            clock_skew_s=0.05, signature_age_s=0.3, prepare_bound_s=120.0, release_budget_s=20.0,
                            revert_probe_budget_s=30.0)


# -- readiness ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Readiness:
    """What the source knows about readiness when it decides (§7.3): times are ms since the epoch, ``None`` =
    never. ``inputs`` are the **current** pinned input versions (bundle etags, overlay, release, launch report)."""

    round_at: int | None = None
    round_bytes: int = 0
    target_report_at: int | None = None
    target_passed: bool = False
    target_reason: str = ""
    source_ready_at: int | None = None  # S1 probe 200..399 from its own process
    source_strict: bool = False  # S2 the next spawn is strict
    recovery_armed: bool = False  # T13 recoverySourceArmed
    inputs: MoveInputs = field(default_factory=MoveInputs)


def not_ready(r: Readiness, now_ms: int, profile: TimingProfile) -> str | None:
    """Why the move is not ready (§7.3 ``ready``), in plain words, or None when it is."""
    fresh_ms = int(profile.freshness_s * 1000)

    def stale(at: int | None) -> bool:
        return at is None or now_ms - at > fresh_ms

    if stale(r.round_at):
        return f"no staging round in the last {profile.freshness_s:g} s"
    if r.round_bytes > profile.bar_bytes:
        return f"the last staging round moved {r.round_bytes} bytes, above the {profile.bar_bytes}-byte bar"
    if stale(r.target_report_at):
        return f"the target's readiness report is missing or older than {profile.freshness_s:g} s"
    if not r.target_passed:
        return f"the target's readiness report does not pass: {r.target_reason or 'no reason given'}"
    if stale(r.source_ready_at) and rules.on("source-readiness"):
        return "the source instance has not answered its readiness probe recently (declare moves.ready_path)"
    if not r.source_strict:
        return "the source's next spawn would not be strict (§5.3)"
    return None


def decide_ready(record: Record | None, move_id: str, incarnation: str, r: Readiness, now_ms: int,
                 profile: TimingProfile) -> Record | NoChange | Refusal:
    """``preparing -> ready`` (§7.3): stamps ``ready_at`` and pins the inputs the cut's admission compares."""
    move = _this_move(record, move_id, incarnation)
    if isinstance(move, NoChange):
        return move
    if move.state != "preparing":
        return NoChange(f"the move is {move.state}, not preparing")
    why = not_ready(r, now_ms, profile)
    if why is not None:
        return NoChange(why)
    assert record is not None
    return _with(record, move, state="ready", ready_at=now_ms, inputs=r.inputs, updated_at=now_ms)


# -- the cut ------------------------------------------------------------------------------------------------


def cut_deadline(cut_at: int, profile: TimingProfile) -> int:
    """§7.4: ``cut_deadline = cut_at + cut_budget - open_budget``. ``cut_budget`` is the operator's cut window
    (the promise), not the T11 estimate (D§13 ambiguity 3, resolved here)."""
    return cut_at + int((profile.cut_budget_s - profile.open_budget_s) * 1000)


def deadline_passed(move: Move, now_ms: int) -> bool:
    """§7.4: every pre-commit phase checks ``now <= cut_deadline``."""
    if not rules.on("cut-deadline"):
        return False
    return move.cut_deadline is not None and now_ms > move.cut_deadline


def _this_move(record: Record | None, move_id: str, incarnation: str) -> Move | NoChange:
    if record is None or record.move is None:
        return NoChange("the host has no move")
    move = record.move
    if move.id != move_id or move.incarnation != incarnation:
        return NoChange("the record holds another move")
    return move


def _with(record: Record, move: Move, **changes: Any) -> Record:
    return msgspec.structs.replace(record, move=msgspec.structs.replace(move, **changes))


def decide_admit(record: Record | None, move_id: str, incarnation: str, r: Readiness, now_ms: int,
                 profile: TimingProfile) -> Record | NoChange | Refusal:
    """``requested -> admitted`` stamping ``cut_at`` and ``cut_deadline``; or back to ``ready`` (cut_phase cleared)
    with the reason when a report is stale, a pinned input changed, or source recovery is unarmed (§7.4, T13)."""
    move = _this_move(record, move_id, incarnation)
    if isinstance(move, NoChange):
        return move
    assert record is not None
    if move.state != "cutting" or move.cut_phase != "requested":
        return NoChange(f"the move is {move.state}/{move.cut_phase or '-'}, not cutting/requested")
    why = admission_refused(move, r, now_ms, profile)
    if why is not None:
        return _with(record, move, state="ready", cut_phase="", reason=why, updated_at=now_ms)
    return _with(record, move, cut_phase="admitted", cut_at=now_ms, cut_budget_s=profile.cut_budget_s,
                 cut_deadline=cut_deadline(now_ms, profile), reason="", updated_at=now_ms)


def admission_refused(move: Move, r: Readiness, now_ms: int, profile: TimingProfile) -> str | None:
    """Why the cut may not be admitted now (§7.4 ``admitted``), or None."""
    if not rules.on("admit-fresh-inputs"):
        return None
    if not r.recovery_armed:
        return "the source box cannot recover this move if the cut fails (recoverySourceArmed is off)"
    why = not_ready(r, now_ms, profile)
    if why is not None:
        return why
    pinned, current = move.inputs, r.inputs
    for name in ("bundle_etags", "overlay_etag", "release", "env_report"):
        if getattr(pinned, name) != getattr(current, name):
            return f"the pinned input {name} changed since the move became ready; the checks run again"
    return None


def decide_unarmed(record: Record | None, move_id: str, incarnation: str, r: Readiness,
                   now_ms: int) -> Record | NoChange | Refusal:
    """T13 again at ``admitted``, before the stop: a source whose recovery is not armed returns the move to
    ``ready`` with the reason shown, never stuck (§7.3 T13). ``NoChange`` when it is armed."""
    move = _this_move(record, move_id, incarnation)
    if isinstance(move, NoChange):
        return move
    assert record is not None
    if move.state != "cutting" or move.cut_phase != "admitted":
        return NoChange(f"the move is {move.state}/{move.cut_phase or '-'}, not cutting/admitted")
    if r.recovery_armed or not rules.on("admit-fresh-inputs"):
        return NoChange("source recovery is armed")
    return _with(record, move, state="ready", cut_phase="", cut_at=None, cut_deadline=None, updated_at=now_ms,
                 reason="the source box cannot recover this move if the cut fails (recoverySourceArmed is off)")


def decide_enter(record: Record | None, move_id: str, incarnation: str, phase: CutPhase, now_ms: int,
                 **source: Any) -> Record | NoChange | Refusal:
    """The journal write of ``phase`` (one of ``stopping``, ``stopped``, ``staged``, ``archived``): legal only
    from the phase before it and only while ``now <= cut_deadline``. ``source`` fields are merged into
    ``move.source`` (``stopped`` records the evidence key and the digests, §7.4)."""
    if phase not in ("stopping", "stopped", "staged", "archived"):
        raise ValueError(f"decide_enter does not write {phase!r}")
    move = _this_move(record, move_id, incarnation)
    if isinstance(move, NoChange):
        return move
    assert record is not None
    if move.state == "cutting" and move.cut_phase == phase:
        return NoChange(f"the cut is already {phase}")
    prev = CUT_PHASES[CUT_PHASES.index(phase) - 1]
    if move.state != "cutting" or move.cut_phase != prev:
        return Refusal(f"the cut cannot enter {phase} from {move.state}/{move.cut_phase or '-'}; it needs {prev}")
    if deadline_passed(move, now_ms):
        return Refusal(f"the cut deadline passed {now_ms - (move.cut_deadline or 0)} ms ago; {phase} is not entered")
    if phase == "stopped" and not source.get("evidence"):
        return Refusal("stopped needs the stop evidence; it is never entered without it (K3)")
    new_source = msgspec.structs.replace(move.source, **source) if source else move.source
    return _with(record, move, cut_phase=phase, source=new_source, updated_at=now_ms)


def decide_files_digest(record: Record | None, move_id: str, incarnation: str, files: FilesDigest,
                        now_ms: int) -> Record | NoChange | Refusal:
    """``archived``'s completion: record both archive digests (§7.4). The plaintext digest must be the one
    recorded at ``stopped``: the files changed under a stopped instance otherwise."""
    move = _this_move(record, move_id, incarnation)
    if isinstance(move, NoChange):
        return move
    assert record is not None
    if move.state != "cutting" or move.cut_phase != "archived":
        return Refusal(f"archive digests belong to archived, the cut is {move.state}/{move.cut_phase or '-'}")
    if move.source.files.plain and move.source.files.plain != files.plain:
        return Refusal("the archive's plaintext digest differs from the one recorded at stopped: the files changed")
    if move.source.files == files:
        return NoChange("the digests are recorded")
    return _with(record, move, source=msgspec.structs.replace(move.source, files=files), updated_at=now_ms)


def decide_flip(record: Record | None, move_id: str, incarnation: str, now_ms: int,
                profile: TimingProfile) -> Record | NoChange | Refusal:
    """The flip CAS (§7.4 ``flipped``, §7.5, D§3.1): ``state = landing``, ``flipped_at``, ``landing_deadline``,
    conditional on ``now <= cut_deadline``. The record is the decision; the claim follows it."""
    move = _this_move(record, move_id, incarnation)
    if isinstance(move, NoChange):
        return move
    assert record is not None
    if move.state == "landing" and move.cut_phase == "flipped":
        return NoChange("the move is already flipped")
    if move.state != "cutting" or move.cut_phase != "archived":
        return Refusal(f"the flip needs cutting/archived, the cut is {move.state}/{move.cut_phase or '-'}")
    if deadline_passed(move, now_ms):
        return Refusal(f"the cut deadline passed {now_ms - (move.cut_deadline or 0)} ms ago; the flip is refused")
    if not move.source.evidence or not move.source.files.sealed:
        return Refusal("the flip needs the stop evidence and the sealed archive's digest recorded")
    return _with(record, move, state="landing", cut_phase="flipped", flipped_at=now_ms,
                 landing_deadline=now_ms + int(profile.landing_budget_s * 1000), updated_at=now_ms)


# -- the claim halves the source writes ---------------------------------------------------------------------


def _source_claim(claim: Claim | None, move_id: str, source: str, exec_box: str) -> Claim | Refusal:
    why = step_allowed(claim, op_id=move_id, kinds=("moving",), exec_box=exec_box)
    if why is not None:
        return Refusal(why)
    assert claim is not None
    if len(claim.op.participants) != 2 or claim.op.participants[0] != source:
        return Refusal(f"the move's claim does not name {source} as its source")
    return claim


def decide_exec_none(claim: Claim | None, move_id: str, source: str, evidence: str,
                     timers: dict[str, str]) -> Claim | NoChange | Refusal:
    """K3 at ``stopped``: the execution holder ``source -> none``, citing the stop evidence; the staged timers
    snapshot's version rides in the same CAS (``op.journal["timers"]``)."""
    if claim is not None and claim.op.id == move_id and claim.op.kind == "moving" and claim.op.exec == "none":
        if claim.op.journal.get("evidence.source") == evidence:
            return NoChange("the execution holder is already none")
    got = _source_claim(claim, move_id, source, source)
    if isinstance(got, Refusal):
        return got
    if not evidence:
        return Refusal("the execution holder is released only citing stop evidence (K3)")
    journal = {**got.op.journal, "evidence.source": evidence, "timers": timers}
    return msgspec.structs.replace(got, op=msgspec.structs.replace(got.op, exec="none", journal=journal))


def decide_seal(claim: Claim | None, move_id: str, source: str, seal: dict[str, Any]) -> Claim | NoChange | Refusal:
    """``staged``: the seal in the claim's op journal (§7.3 seal by version; §7.4 ``staged``)."""
    got = _source_claim(claim, move_id, source, "none")
    if isinstance(got, Refusal):
        return got
    if "seal" in got.op.journal:
        return NoChange("the seal is recorded") if got.op.journal["seal"] == seal else Refusal(
            "a different seal is already recorded for this move; a seal is never rewritten")
    journal = {**got.op.journal, "seal": seal}
    return msgspec.structs.replace(got, op=msgspec.structs.replace(got.op, journal=journal))


def decide_sealed(claim: Claim | None, move_id: str, source: str, files: dict[str, str], *,
                  staging_bound: int | None = None) -> Claim | NoChange | Refusal:
    """``archived``'s completion: the archive's staged versions join the seal and the claim's phase becomes
    ``sealed`` (the flip's claim half starts from ``moving/sealed``, D§3.1). ``staging_bound`` is the lane's seal
    bound, the seal time plus the staging lease's TTL, persisted with the seal: the staging park's ``evidence_at``
    (§6.4, :func:`services.move.follow.staging_evidence_at`)."""
    got = _source_claim(claim, move_id, source, "none")
    if isinstance(got, Refusal):
        return got
    seal = got.op.journal.get("seal")
    if not isinstance(seal, dict):
        return Refusal("the archive is sealed only after the replica and timers seal (staged)")
    if got.op.phase == SEALED:
        return NoChange("the claim is sealed") if seal.get("files") == files else Refusal(
            "a different archive is already sealed for this move")
    bound = {} if staging_bound is None else {"staging_bound": staging_bound}
    journal = {**got.op.journal, "seal": {**seal, "files": files, **bound}}
    return msgspec.structs.replace(got, op=msgspec.structs.replace(got.op, phase=SEALED, journal=journal))


# -- what to do next ----------------------------------------------------------------------------------------

StepKind = Literal["idle", "blocked", "deadline", "admit", "enter", "effects", "flip", "follow", "done"]


@dataclass(frozen=True)
class Step:
    """The next journaled step: ``enter`` writes ``phase`` then runs its effects; ``effects`` replays the effects
    of the phase the journal names (after a crash); ``follow`` writes the claim half of the flip."""

    kind: StepKind
    phase: str = ""
    reason: str = ""


def plan(record: Record | None, claim: Claim | None, *, source: str, move_id: str, incarnation: str,
         now_ms: int) -> Step:
    """The source's next step, from the record and the claim alone (§7.13: nothing in memory survives)."""
    move = _this_move(record, move_id, incarnation)
    if isinstance(move, NoChange):
        return Step("idle", reason=move.reason)
    if move.state == "landing" and move.cut_phase == "flipped":
        if claim is not None and claim.op.id == move_id and claim.op.kind == "moving":
            return Step("follow", "flipped")
        return Step("done", "flipped", "the move is flipped and the claim follows it")
    if move.state != "cutting":
        return Step("idle", reason=f"the move is {move.state}, not cutting")
    phase = move.cut_phase
    if phase not in CUT_PHASES:
        return Step("blocked", phase, f"the record names an unknown cut phase {phase!r}")
    expected_exec = source if phase in ("requested", "admitted", "stopping", "stopped") else "none"
    if phase == "stopped" and claim is not None and claim.op.exec == "none":
        expected_exec = "none"
    why = step_allowed(claim, op_id=move_id, kinds=("moving",), exec_box=expected_exec)
    if why is None and claim is not None and (len(claim.op.participants) != 2 or claim.op.participants[0] != source):
        why = f"the move's claim does not name {source} as its source"
    if why is not None:
        return Step("blocked", phase, why)
    assert claim is not None
    if phase == "requested":
        return Step("admit", "admitted")
    if deadline_passed(move, now_ms):
        return Step("deadline", phase, f"the cut deadline passed at {phase}; the failure path takes over")
    journal = claim.op.journal
    if phase == "admitted":
        return Step("enter", "stopping")
    if phase == "stopping":
        return Step("enter", "stopped")  # the stopping effects run first; their evidence is the entry's input
    if phase == "stopped":
        return Step("effects", "stopped") if claim.op.exec != "none" else Step("enter", "staged")
    if phase == "staged":
        return Step("effects", "staged") if "seal" not in journal else Step("enter", "archived")
    # archived
    if claim.op.phase != SEALED or not move.source.files.sealed:
        return Step("effects", "archived")
    if rules.on("flip-needs-seal") and not isinstance(journal.get("seal"), dict):
        return Step("blocked", phase, "the flip needs the seal in the claim's op journal")
    return Step("flip", "flipped")


def lease_timing(profile: TimingProfile) -> LeaseTiming:
    """The lease's durations from a source timing profile (ARCHITECTURE §7)."""
    return LeaseTiming(ttl_ms=profile.staging_lease_ttl_ms, skew_ms=int(profile.clock_skew_s * 1000),
                       signature_age_ms=int(profile.signature_age_s * 1000))


__all__ = [
    "CUT_PHASES", "FAST", "NEXT_PHASE", "PRODUCTION", "SEALED", "CutPhase", "Readiness", "Step", "TimingProfile",
    "admission_refused", "cut_deadline", "deadline_passed", "decide_admit", "decide_enter", "decide_exec_none",
    "decide_files_digest", "decide_flip", "decide_ready", "decide_seal", "decide_sealed", "decide_unarmed",
    "lease_timing", "not_ready", "plan",
]
