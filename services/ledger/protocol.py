"""The protocol audit: every transition in the ledger's history checked against the spec's tables (issue 4 item 9).

A pure fold. Feed the decoded :class:`~events.envelope.Transition` events in stream order, across all subjects;
the checker keeps the latest claim and record per host and checks each ``(previous state, name, new state)``:

- ``claim-kind``: ``op.kind`` changes only along the edges of §19.1 / D§3 (absent or ``free`` -> ``creating`` ->
  ``serving`` -> ``moving`` (the door, K2) -> ``landing`` (the flip, §7.5) -> ``restoring`` (a rollback, §7.8);
  ``moving`` -> ``reverting`` (§7.4); every move kind -> ``serving`` (the release, K8)); one move keeps one op id.
- ``move-state``, ``cut-phase``, ``landing-phase``: the record's ``move.state`` (§7.2-§7.11), ``cut_phase`` (§7.4)
  and ``landing_phase`` (§7.6) advance one step at a time along their machines; the only backward steps are the
  documented returns (``cutting`` at ``requested``/``admitted`` -> ``ready`` with ``cut_phase`` cleared, §7.4, T13).
  A close clears ``move`` into a ``last_move`` naming it, with the outcome its state allows (ruling M4).
- ``rollback-phase``: a rollback appears only with the landing's CAS to ``rolling_back`` and keeps its id; its
  ``target_phase`` and ``source_phase`` advance one step along §7.8's machines (clean or dirty), ``cleaning`` only
  after ``recovered_at``; ``stuck`` is left only through the operator's retry (§7.10), to ``rolling_back`` (the
  recovery back at ``probing`` or its install phase) or ``reverting``.
- ``follows-record``: the claim halves of §7.5 (flip, commit, rollback) mirror a record transition already made.
- ``k3-exec-none``: ``exec`` goes from a box to ``none`` only on stop evidence (the claim's journal cites it, or
  the record names ``move.source.evidence`` / ``move.rollback.evidence``), and only from a participant (§19.2 K3).
- ``k4-exec-handoff``: ``exec`` goes from ``none`` only to a participant and only citing evidence in the op
  journal; never directly from one box to another (§19.2 K4).
- ``k8-release``: a release to ``serving`` from a move kind happens only when the latest record no longer carries
  the move and ``last_move`` names it, no obligation of the op remains on the claim, and the new ``exec`` is the
  executor ``last_move.outcome`` names (target after ``done``, source otherwise) (§19.2 K8, §7.5, ruling M4).
- ``baseline-live``: no ``park-generation`` is queued for, or acknowledged over, the host's current generation or a
  generation an uncovered admission's baseline names in the chore's region (§7.14 items 5, 6; issue 16 item 3).

The stream orders events per subject; across the claim and the record it is the publish order, which a crash
between a CAS and its publish can invert (the relay publishes the record late). So a claim event whose check needs
a newer record is held until that host's next record event: it passes if that event (no later than the claim's,
by ``meta.at``) satisfies it, and is reported otherwise, or when the history ends without one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final, Literal

from events.claim import Claim, Op
from events.envelope import Transition
from events.record import Move, Record, Rollback

Severity = Literal["error", "notice"]
Rule = Literal[
    "claim-kind", "move-state", "cut-phase", "landing-phase", "follows-record",
    "k3-exec-none", "k4-exec-handoff", "k8-release", "baseline-live", "rollback-phase",
]

NONE: Final = "none"
MOVE_KINDS: Final = frozenset({"moving", "landing", "reverting", "restoring"})

KIND_EDGES: Final[frozenset[tuple[str, str]]] = frozenset({
    ("free", "creating"),  # create: intent first (C2)
    ("creating", "serving"),  # create finished, the holder written
    ("serving", "moving"),  # the door's request (§7.1, K2)
    ("moving", "landing"),  # the flip's claim half (§7.5)
    ("moving", "reverting"),  # pre-flip recovery (§7.4 reverting)
    ("landing", "restoring"),  # the rollback's claim half (§7.5, §7.8)
    ("moving", "serving"), ("landing", "serving"), ("reverting", "serving"), ("restoring", "serving"),  # K8
    ("serving", "relocating"), ("relocating", "serving"),  # a fenced box's host and its release (§7.10)
    ("moving", "relocating"),  # a source fenced before the flip (§7.10 rule fence-converts-moving): see _converted
})
"""The claim ``op.kind`` edges §19.1 and D§3 allow (a kind to itself is a step inside the op, always allowed)."""

MOVE_STATE_EDGES: Final[dict[str, frozenset[str]]] = {
    "preparing": frozenset({"ready", "aborted"}),  # §7.3, §7.11
    "ready": frozenset({"cutting", "aborted"}),  # §7.4 (manual cut or auto), §7.11
    "cutting": frozenset({"ready", "aborted", "landing", "reverting"}),  # T13 return, §7.11, the flip, §7.4
    "landing": frozenset({"committed", "rolling_back"}),  # §7.9 step 1, §7.8
    "committed": frozenset(),
    "rolling_back": frozenset({"stuck"}),  # §7.8: nine failed recovery probes, a clean verify's mismatch
    "reverting": frozenset({"stuck"}),  # §7.4: fifteen minutes of failed probes
    "stuck": frozenset({"rolling_back", "reverting"}),  # §7.10: the operator's resolve --retry (retried_at)
    "aborted": frozenset(),
}
"""``move.state`` edges (§7.2-§7.11; D§3.1). A state to itself is a step inside it."""

STATE_ENTRY: Final[dict[tuple[str, str], tuple[str, str]]] = {
    ("ready", "cutting"): ("cut_phase", "requested"),  # §7.4: the cut request
    ("cutting", "ready"): ("cut_phase", ""),  # §7.4, T13: the return clears the cut
    ("cutting", "landing"): ("cut_phase", "flipped"),  # §7.4 flipped, §7.5
    ("landing", "committed"): ("landing_phase", "probed"),  # §7.9 step 1
}
"""What a ``move.state`` edge must write with it."""

CLOSE_OUTCOMES: Final[dict[str, str]] = {
    "committed": "done", "aborted": "aborted", "rolling_back": "rolled_back", "reverting": "rolled_back",
}
"""The ``last_move.outcome`` a close from each state writes (§7.5 close, §7.8, §7.9 step 5, §7.11)."""

CUT_PHASES: Final = ("requested", "admitted", "stopping", "stopped", "staged", "archived", "flipped")
LANDING_PHASES: Final = (
    "checking", "parking", "building", "published", "local", "configured", "restored", "probing", "probed",
)
TARGET_PHASES_CLEAN: Final = ("releasing", "released", "cleaning", "cleaned")
TARGET_PHASES_DIRTY: Final = ("releasing", "released", "returning", "returned", "cleaning", "cleaned")
SOURCE_PHASES_CLEAN: Final = ("waiting", "claimed", "restoring", "verified", "probing", "probed", "recovered", "opened")
SOURCE_PHASES_DIRTY: Final = ("waiting", "claimed", "restoring", "parking", "building", "published", "local",
                              "configured", "restored", "probing", "probed", "recovered", "opened")
"""The rollback's two journals (§7.8; D§3.5, D§3.6), clean and dirty."""
RETRY_SOURCE_PHASES: Final = frozenset({"probing", "parking", "building", "published", "local", "configured",
                                        "restored"})
"""Where the operator's retry of a stuck rollback puts its recovery (§7.10): its probe, or the install phase it
stopped at (each replayable, §7.6)."""
EVIDENCE_KEYS: Final = ("evidence.source", "evidence.target", "evidence")
"""Where a claim's op journal cites stop evidence (§5.3, K3, K4)."""


@dataclass(frozen=True)
class ProtocolFinding:
    """One broken rule: the same ``(severity, object, host, what)`` shape as the audit's findings."""

    severity: Severity
    object: str
    host: str
    what: str
    rule: Rule
    seq: int
    name: str

    def line(self) -> str:
        return f"{self.severity.upper()} {self.object} {self.host}: {self.what}"


@dataclass
class _Pending:
    """A claim event whose check needs a record the stream may publish after it."""

    check: Callable[[Record | None], str | None]
    first: str  # why it failed against the record the stream held when the claim event came
    rule: Rule
    seq: int
    name: str
    at: int


@dataclass
class _Host:
    claim: Claim | None = None
    record: Record | None = None
    claim_known: bool = False  # False until the first event: the state before it is unknown
    record_known: bool = False
    pending: list[_Pending] = field(default_factory=list)


def _cited(op: Op) -> str:
    for key in EVIDENCE_KEYS:
        value = op.journal.get(key)
        if isinstance(value, str) and value:
            return value
    return ""


def _origin(generation: str) -> str:
    """``""`` and ``"@root"`` are one origin (§5.1 step 9)."""
    return "" if generation in ("", "@root") else generation


def _live(record: Record | None, op_id: str) -> Move | None:
    if record is None or record.move is None or record.move.id != op_id:
        return None
    return record.move


def _record_evidence(record: Record | None, op_id: str) -> str:
    move = _live(record, op_id)
    if move is None:
        return ""
    if move.source.evidence:
        return move.source.evidence
    return move.rollback.evidence if move.rollback is not None else ""


def _next(phases: tuple[str, ...], phase: str) -> str:
    if phase == "":
        return phases[0]
    i = phases.index(phase) if phase in phases else len(phases)
    return phases[i + 1] if i + 1 < len(phases) else ""


LOSSES_PREFIXES = ("control/losses/", "control/box-fences/")
"""Where a ``--declare-lost`` declaration (``services.move.lost.LOSSES_PREFIX``) or a termination fence
(``services.box.fence.FENCES_PREFIX``) lives: a lost target's evidence (spec §7.10)."""


CONVERTIBLE: Final = frozenset({"preparing", "ready", "cutting", "aborted"})
"""The record states before the flip, where a fence of the source converts the move (§7.10)."""


def _converted(op0: Op, op1: Op) -> bool:
    """§7.10 fence-converts-moving: the move's op id, ``pinning``, exec none, citing the source's fence."""
    source = op0.participants[0] if op0.participants else ""
    return (op1.id == op0.id and op1.phase == "pinning" and op1.exec == "none"
            and isinstance(op1.journal.get(f"fence.{source}"), dict))


def _declared_lost(rb: Rollback) -> bool:
    """A rollback whose target was declared lost (§7.10): its evidence is the declaration, its target ``cleaned``
    for want of a box, the rollback clean, all in the declaration's one record CAS."""
    return rb.evidence.startswith(LOSSES_PREFIXES) and rb.target_phase == "cleaned" and not rb.dirty


def _next_target_phase(phase: str, dirty: bool) -> str:
    return _next(TARGET_PHASES_DIRTY if dirty else TARGET_PHASES_CLEAN, phase)


def _next_source_phase(phase: str, dirty: bool) -> str:
    return _next(SOURCE_PHASES_DIRTY if dirty else SOURCE_PHASES_CLEAN, phase)


def _phase_index(phases: tuple[str, ...], phase: str) -> int | None:
    """``""`` is -1 (not started); an unknown phase is None."""
    if phase == "":
        return -1
    return phases.index(phase) if phase in phases else None


@dataclass
class ProtocolCheck:
    """Feed the ledger's transitions in stream order; read :attr:`findings` at the end."""

    hosts: dict[str, _Host] = field(default_factory=dict)
    events: int = 0
    last_seq: int = 0
    _findings: list[ProtocolFinding] = field(default_factory=list)

    @property
    def findings(self) -> list[ProtocolFinding]:
        """Every finding so far, and the held claim checks no record event has settled (reported as broken)."""
        held = [
            ProtocolFinding("error", "claim", host,
                            self._what(p.rule, p.seq, p.name, f"{why}; no later record transition settles it"),
                            p.rule, p.seq, p.name)
            for host, h in sorted(self.hosts.items()) for p in h.pending
            if (why := p.check(h.record)) is not None
        ]
        return [*self._findings, *held]

    def clean(self) -> bool:
        return not any(f.severity == "error" for f in self.findings)

    @staticmethod
    def _what(rule: Rule, seq: int, name: str, why: str) -> str:
        return f"[{rule}] seq {seq} ({name}): {why}"

    def _add(self, obj: str, host: str, rule: Rule, seq: int, name: str, why: str) -> None:
        self._findings.append(ProtocolFinding("error", obj, host, self._what(rule, seq, name, why), rule, seq, name))

    def feed(self, event: Transition, seq: int) -> None:
        """One event of the ledger stream, ``seq`` its stream sequence. Events must come in stream order across
        both subjects (a replay of the whole stream, or the two subjects merged by ``seq``): the cross-object
        rules are about what was written before what. Raises ``ValueError`` otherwise (a caller's defect)."""
        if seq <= self.last_seq:
            raise ValueError(f"protocol audit: event seq {seq} came after seq {self.last_seq}; "
                             "feed the ledger stream in stream order (merge the claim and record subjects by seq)")
        self.last_seq = seq
        self.events += 1
        h = self.hosts.setdefault(event.host, _Host())
        name = event.meta.name
        if event.object == "record":
            new_record = event.record
            assert new_record is not None
            if event.kind == "transition" and (h.record_known or new_record.gen == 1):
                self._record(event.host, h.record, new_record, seq, name)
            h.record, h.record_known = new_record, True
            self._settle(event.host, h, event.meta.at)
            return
        new_claim = event.claim
        assert new_claim is not None
        if event.kind == "rebase":
            # An explicit loss of history (ARCHITECTURE §4): the restated state is the new baseline.
            h.claim, h.claim_known = new_claim, True
            return
        if h.claim_known:
            self._claim(event.host, h, h.claim, new_claim, seq, name, event.meta.at)
        elif new_claim.gen == 1:
            self._claim(event.host, h, None, new_claim, seq, name, event.meta.at)
        h.claim, h.claim_known = new_claim, True

    # -- record -------------------------------------------------------------------------------------------

    def _record(self, host: str, old: Record | None, new: Record, seq: int, name: str) -> None:
        def bad(rule: Rule, why: str) -> None:
            self._add("record", host, rule, seq, name, why)

        before = old.move if old is not None else None
        after = new.move
        if before is None and after is None:
            return
        if before is None:
            assert after is not None
            if after.state != "preparing" or after.cut_phase or after.landing_phase:
                bad("move-state", f"move {after.id} appears as {after.state}/{after.cut_phase or '-'}/"
                    f"{after.landing_phase or '-'}; a move starts in preparing with no phase (§7.2)")
            return
        if after is None:
            last = new.last_move
            want = CLOSE_OUTCOMES.get(before.state)
            if last is None or last.id != before.id:
                bad("move-state", f"move {before.id} was cleared without a last_move naming it (§7.5, ruling M4)")
            elif want is None and not (before.state in CONVERTIBLE and last.outcome == "aborted"
                                       and "converted" in new.extra):
                bad("move-state", f"move {before.id} was closed from {before.state}, a state no close leaves from")
            elif want is None:
                pass  # §7.10: the move a fence of its source converted to a relocation closes aborted
            elif last.outcome != want:
                bad("move-state", f"move {before.id} closed from {before.state} as {last.outcome}; "
                    f"that state closes as {want}")
            return
        if after.id != before.id:
            bad("move-state", f"move {after.id} replaced move {before.id} without a close in between (§7.5)")
            return
        s0, s1 = before.state, after.state
        if s0 != s1 and s1 not in MOVE_STATE_EDGES.get(s0, frozenset()):
            bad("move-state", f"move.state went {s0} -> {s1}, which the move's machine does not allow")
        elif s0 == "cutting" and s1 == "aborted" and before.cut_phase != "requested":
            bad("move-state", f"the move was aborted at cut_phase {before.cut_phase}; "
                "abort is legal only up to cutting/requested (§7.11)")
        elif (s0, s1) in STATE_ENTRY:
            attr, want = STATE_ENTRY[(s0, s1)]
            if getattr(after, attr) != want:
                bad("move-state", f"move.state went {s0} -> {s1} with {attr} {getattr(after, attr) or '(none)'}; "
                    f"that edge writes {attr} {want or '(none)'}")
        self._cut(before, after, bad)
        self._landing(before, after, bad)
        self._rollback(before, after, bad)

    @staticmethod
    def _cut(before: Move, after: Move, bad: Callable[[Rule, str], None]) -> None:
        p0, p1 = before.cut_phase, after.cut_phase
        if p0 == p1:
            return
        i0, i1 = _phase_index(CUT_PHASES, p0), _phase_index(CUT_PHASES, p1)
        if i0 is None or i1 is None:
            bad("cut-phase", f"cut_phase went {p0 or '-'} -> {p1 or '-'}; {p1 if i1 is None else p0!r} "
                "is not a cut phase (§7.4)")
        elif i1 == -1:
            if not (before.state == "cutting" and after.state == "ready" and p0 in ("requested", "admitted")):
                bad("cut-phase", f"cut_phase was cleared from {p0} (move {before.state} -> {after.state}); only a "
                    "refused or unarmed admission returns the cut to ready (§7.4, T13)")
        elif i1 != i0 + 1:
            direction = "went back" if i1 < i0 else "skipped ahead"
            bad("cut-phase", f"cut_phase {direction} from {p0 or '(none)'} to {p1}; each phase is journaled in "
                "order (§7.4)")
        elif p1 == "requested" and after.state != "cutting":
            bad("cut-phase", f"cut_phase requested was written with the move {after.state}, not cutting")
        elif p1 == "flipped" and after.state != "landing":
            bad("cut-phase", f"cut_phase flipped was written with the move {after.state}; the flip sets landing")
        elif p1 != "flipped" and after.state != "cutting":
            bad("cut-phase", f"cut_phase {p1} was written with the move {after.state}, not cutting")

    @staticmethod
    def _rollback(before: Move, after: Move, bad: Callable[[Rule, str], None]) -> None:
        """``rollback-phase`` (§7.8, §7.10): a rollback appears only with ``landing -> rolling_back``, phases not
        started, and keeps its id; ``target_phase`` and ``source_phase`` advance one step along their machines
        (dirty through the return lane and the install, clean through ``released`` and ``verified``); ``cleaning``
        only after ``recovered_at``; ``stuck`` leaves only through the operator's retry, to ``rolling_back`` for a
        rollback (its recovery back at ``probing`` or the install phase it stopped at) or ``reverting`` for a revert."""
        rb0, rb1 = before.rollback, after.rollback
        if (before.state, after.state) == ("stuck", "rolling_back") or (before.state, after.state) == (
                "stuck", "reverting"):
            if after.retried_at is None or after.retried_at == before.retried_at:
                bad("rollback-phase", f"the move left stuck for {after.state} without the operator's retry (§7.10)")
            if (after.state == "rolling_back") != (rb1 is not None):
                bad("rollback-phase", f"a stuck move went to {after.state}, but it "
                    f"{'holds no' if rb1 is None else 'holds a'} rollback (§7.10)")
        if rb1 is None:
            if rb0 is not None:
                bad("rollback-phase", f"rollback {rb0.id} vanished from the move")
            return
        if rb0 is None:
            if (before.state, after.state) != ("landing", "rolling_back"):
                bad("rollback-phase", f"rollback {rb1.id} appeared with the move {before.state} -> {after.state}; a "
                    "rollback is the landing's CAS to rolling_back (§7.8)")
            elif (rb1.target_phase or rb1.source_phase) and not _declared_lost(rb1):
                bad("rollback-phase", f"rollback {rb1.id} appeared with its phases already started")
            return
        if rb0.id != rb1.id:
            bad("rollback-phase", f"rollback {rb0.id} became {rb1.id}; a move rolls back once (§7.8)")
            return
        t0, t1 = rb0.target_phase, rb1.target_phase
        if t0 != t1 and _declared_lost(rb1) and not _declared_lost(rb0):
            pass  # §7.10: the declaration stands for the lost target's every remaining phase
        elif t0 != t1:
            want = _next_target_phase(t0, rb1.dirty)
            if t1 != want:
                bad("rollback-phase", f"target_phase went {t0 or '(none)'} -> {t1}; after {t0 or '(none)'} a "
                    f"{'dirty' if rb1.dirty else 'clean'} release journals {want or 'nothing'} (§7.8)")
            elif t1 == "cleaning" and rb1.recovered_at is None:
                bad("rollback-phase", "the target began cleaning before the source recorded recovered_at (§7.8)")
        s0, s1 = rb0.source_phase, rb1.source_phase
        if s0 != s1:
            retried = before.state == "stuck" and after.state == "rolling_back"
            want = _next_source_phase(s0, rb1.dirty)
            if s1 != want and not (retried and s1 in RETRY_SOURCE_PHASES):
                bad("rollback-phase", f"source_phase went {s0 or '(none)'} -> {s1}; after {s0 or '(none)'} a "
                    f"{'dirty' if rb1.dirty else 'clean'} recovery journals {want or 'nothing'} (§7.8)")

    @staticmethod
    def _landing(before: Move, after: Move, bad: Callable[[Rule, str], None]) -> None:
        p0, p1 = before.landing_phase, after.landing_phase
        if p0 == p1:
            return
        i0, i1 = _phase_index(LANDING_PHASES, p0), _phase_index(LANDING_PHASES, p1)
        if i0 is None or i1 is None:
            bad("landing-phase", f"landing_phase went {p0 or '-'} -> {p1 or '-'}; "
                f"{p1 if i1 is None else p0!r} is not a landing phase (§7.6)")
        elif i1 < i0:
            bad("landing-phase", f"landing_phase went back from {p0} to {p1 or '(none)'}; a landing never replays "
                "an earlier phase (§7.6, INV-7)")
        elif i1 != i0 + 1:
            bad("landing-phase", f"landing_phase skipped from {p0 or '(none)'} to {p1}; each phase is journaled "
                "in order (§7.6)")
        elif after.state != "landing":
            bad("landing-phase", f"landing_phase {p1} was written with the move {after.state}, not landing")

    # -- claim --------------------------------------------------------------------------------------------

    def _claim(self, host: str, h: _Host, old: Claim | None, new: Claim, seq: int, name: str, at: int) -> None:
        def bad(rule: Rule, why: str) -> None:
            self._add("claim", host, rule, seq, name, why)

        def later(rule: Rule, check: Callable[[Record | None], str | None]) -> None:
            """A check on the record: now if the record the stream holds passes, else held (module docstring)."""
            why = check(h.record)
            if why is not None:
                h.pending.append(_Pending(check, why, rule, seq, name, at))

        self._retirements(old, new, bad)
        op0 = old.op if old is not None else Op()
        op1 = new.op
        k0, k1 = op0.kind, op1.kind
        if k0 != k1 and (k0, k1) not in KIND_EDGES:
            bad("claim-kind", f"op.kind went {k0} -> {k1}, an edge the op kinds of §19.1 do not have")
            return
        if (k0, k1) == ("moving", "relocating") and not _converted(op0, op1):
            bad("claim-kind", "a move became a relocation without its source's fence, or not at pinning with exec "
                "none under the move's op id (§7.10 fence-converts-moving)")
            return
        if k0 == k1 and k0 in MOVE_KINDS and op0.id != op1.id:
            bad("claim-kind", f"the {k0} op {op0.id} became op {op1.id} without a release")
            return
        if k0 in MOVE_KINDS and k1 == "serving":
            self._release(new, op0, op1, bad, later)
            return
        if k1 in MOVE_KINDS and k0 != k1 and op0.id and k0 in MOVE_KINDS and op0.id != op1.id:
            bad("claim-kind", f"op {op0.id} ({k0}) became op {op1.id} ({k1}); one op id runs through a move (§19.1)")
            return
        self._follows(op0, op1, later)
        if op0.exec != op1.exec and (k1 in MOVE_KINDS or k0 in MOVE_KINDS):
            self._exec(op0, op1, bad, later)
        elif op0.exec != op1.exec and k0 == k1 and op0.exec != NONE and op1.exec != NONE:
            bad("k4-exec-handoff", f"exec moved directly from {op0.exec} to {op1.exec} under {k1}; never box to "
                "box (K4)")

    @staticmethod
    def _retirements(old: Claim | None, new: Claim, bad: Callable[[Rule, str], None]) -> None:
        """``baseline-live`` (§7.14 items 5, 6): a ``park-generation`` is never queued for, and never acknowledged
        over, a generation that is the host's current one or the baseline (predecessor) of an uncovered admission in
        its region, in the claim the chore is queued into or acknowledged from."""
        def chores(c: Claim | None) -> set[tuple[str, str, str]]:
            if c is None:
                return set()
            return {(o.op, o.region, o.generation) for o in c.obligations if o.kind == "park-generation"}

        def live(c: Claim | None, region: str) -> set[str]:
            if c is None or c.holder is None:
                return set()
            out = {_origin(c.holder.generation)}
            out.update(_origin(a.predecessor.generation) for a in c.holder.admissions
                       if not a.covered and a.predecessor is not None and a.predecessor_region == region)
            return out

        before, after = chores(old), chores(new)
        for op, region, gen in sorted(after - before):
            if _origin(gen) in live(new, region):
                bad("baseline-live", f"park-generation of {gen or '@root'} in {region} was queued ({op}) while it is "
                    "the current generation or an uncovered admission's baseline")
        for op, region, gen in sorted(before - after):
            if _origin(gen) in live(old, region):
                bad("baseline-live", f"park-generation of {gen or '@root'} in {region} was acknowledged ({op}) while "
                    "it is the current generation or an uncovered admission's baseline")

    @staticmethod
    def _follows(op0: Op, op1: Op, later: Callable[[Rule, Callable[[Record | None], str | None]], None]) -> None:
        """§7.5: the flip, the commit and the rollback are claim halves of record transitions."""
        op_id = op1.id
        if op0.kind == "moving" and op1.kind == "landing":
            def flipped(record: Record | None) -> str | None:
                move = _live(record, op_id)
                if move is None or move.state != "landing" or move.cut_phase != "flipped":
                    return "the claim went moving -> landing but the record has not flipped this move (§7.5)"
                return None
            later("follows-record", flipped)
        elif op0.kind == "landing" and op1.kind == "restoring":
            def rolling(record: Record | None) -> str | None:
                move = _live(record, op_id)
                if move is None or move.state not in ("rolling_back", "stuck") or move.rollback is None:
                    return "the claim went landing -> restoring but the record holds no rollback of this move (§7.5)"
                return None
            later("follows-record", rolling)
        elif op1.kind == "landing" and op1.phase == "committed" and op0.phase != "committed":
            def committed(record: Record | None) -> str | None:
                move = _live(record, op_id)
                if move is None or move.state != "committed":
                    return "the claim's phase became committed but the record has not committed this move (§7.9)"
                return None
            later("follows-record", committed)

    @staticmethod
    def _exec(op0: Op, op1: Op, bad: Callable[[Rule, str], None],
              later: Callable[[Rule, Callable[[Record | None], str | None]], None]) -> None:
        """K3 and K4 (§19.2) for a change of ``exec`` under a move kind."""
        e0, e1 = op0.exec, op1.exec
        if e0 != NONE and e1 != NONE:
            bad("k4-exec-handoff", f"exec moved directly from {e0} to {e1}; it passes through none on evidence (K4)")
            return
        if e1 == NONE:
            if e0 not in op0.participants:
                bad("k3-exec-none", f"exec went from {e0}, not a participant of the move, to none (K3)")
                return
            if _cited(op1) or isinstance(op1.journal.get(f"fence.{e0}"), dict):  # a fence is the box's evidence
                return
            op_id = op1.id

            def evidence(record: Record | None) -> str | None:
                if _record_evidence(record, op_id):
                    return None
                return f"exec went from {e0} to none but neither the claim's journal nor the record cites stop " \
                       "evidence (K3, §5.3)"
            later("k3-exec-none", evidence)
            return
        if e1 not in op1.participants:
            bad("k4-exec-handoff", f"exec went from none to {e1}, which is not a participant of the move (K4)")
        elif not _cited(op1):
            bad("k4-exec-handoff", f"exec went from none to {e1} without citing stop evidence in the op journal (K4)")

    @staticmethod
    def _release(new: Claim, op0: Op, op1: Op, bad: Callable[[Rule, str], None],
                 later: Callable[[Rule, Callable[[Record | None], str | None]], None]) -> None:
        """K8 (§19.2; §7.5 close, ruling M4)."""
        left = sorted(o.kind for o in new.obligations if o.op == op0.id)
        if left:
            bad("k8-release", f"the {op0.kind} op {op0.id} was released with its obligations {', '.join(left)} "
                "still on the claim (K8)")
        op_id, participants, executor = op0.id, op0.participants, op1.exec

        def closed(record: Record | None) -> str | None:
            if record is None:
                return f"the {op0.kind} op {op_id} was released but the host has no record of its close (K8)"
            if record.move is not None:
                if record.move.id == op_id:
                    return f"the {op0.kind} op {op_id} was released while the record still carries the move, " \
                           f"{record.move.state} (K8: record first, ruling M4)"
                return f"the {op0.kind} op {op_id} was released while the record carries move {record.move.id}"
            last = record.last_move
            if last is None or last.id != op_id:
                return f"the {op0.kind} op {op_id} was released but the record's last_move is " \
                       f"{last.id if last else 'empty'}, not this move (K8)"
            if len(participants) != 2:
                return f"the {op0.kind} op {op_id} names no source and target; its executor cannot be checked"
            want = participants[1] if last.outcome == "done" else participants[0]
            if executor != want:
                return f"the release after {last.outcome} named {executor} as exec; {last.outcome} hands the " \
                       f"host to {want} (K8)"
            return None
        later("k8-release", closed)

    def _settle(self, host: str, h: _Host, at: int) -> None:
        """The host's next record event settles its held claim checks (module docstring)."""
        held, h.pending = h.pending, []
        for p in held:
            why = p.check(h.record)
            if why is None and at > p.at:
                why = f"{p.first}; the record's next transition was written after it (by meta.at)"
            if why is not None:
                self._add("claim", host, p.rule, p.seq, p.name, why)


__all__ = [
    "CLOSE_OUTCOMES", "CUT_PHASES", "KIND_EDGES", "LANDING_PHASES", "MOVE_KINDS", "MOVE_STATE_EDGES", "STATE_ENTRY",
    "ProtocolCheck", "ProtocolFinding", "Rule",
]
