"""The source's ``preparing`` stage, before the cut (spec §7.3; digest D§3.1, D§5.2).

One preparing round, from durable state only (§7.13):

1. Re-read the record and the claim; K5: the claim is this move's ``moving`` op with this box as ``exec`` and
   source (:func:`plan_preparing`).
2. Journal first: the target region and box join the claim's ``touched`` by CAS before the first staging write
   (claim spec §2, K12; T9 checks it).
3. The staging-work lease first (§7.3, claim C3; :mod:`services.move.lease`), then the claim's op and phase
   revalidated (:func:`staging_refused`); then, push-only (M17, :class:`services.source.staging.Stager`):
   ``move.json`` create-only, ``replica/`` mirrored by exact version, and the files archive sealed to the target
   region's key whenever the files' plaintext digest changed (§7.3 "Snapshot rounds"; T5 reads it). Every request
   checks ``SafeUntil`` right before it is signed; a round that cannot stage says why and is not a round.
4. The launch report ``source.json`` (:mod:`services.source.report`).
5. S1: the instance as it runs now answers its readiness path with 200..399; S2: its next spawn is strict.
   Every spawn on this box is strict (the activator only spawns into a cgroup v2 leaf), so S2 is whether strict
   spawns are available here; there is never a non-strict child to stop.
6. ``preparing -> ready`` via :func:`services.source.phases.decide_ready` when the round is within the 16 MiB bar
   and the target report and source readiness are each under 10 minutes old; otherwise the move stays
   ``preparing`` with the reason in ``move.reason`` (written only when it changes).
7. The auto cut: ``ready -> cutting/requested`` when ``move.cut == "auto"``; a manual move waits (M-C12).

Every write is idempotent on replay: the touch and both record CASes answer ``NoChange`` when done, ``move.json``
is create-only, the mirror skips what the staging journal records as staged, the archive is rebuilt only when the
files changed, the report is rewritten whole.

S1 takes an answer only from the instance's own process when the box can tell (``PreparingBox.ready_peer``: the
holders of the port's listening socket are the host's cgroup leaf, :mod:`services.box.instance.peer`).
"""

from __future__ import annotations

import contextlib
import io
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

import msgspec
from cryptography.hazmat.primitives.asymmetric.ec import EllipticCurvePublicKey

from events.claim import Claim
from events.copy import say
from events.record import MoveInputs, Record
from kernel.logctx import ctx
from kernel.ports import Clock, Random, SystemRandom, blocking, http_status, process_nonce
from services.box.artifacts.archive import ArchiveError, build_archive, manifest_bytes, plain_digest
from services.box.artifacts.sealing import PrivateKey
from services.box.replica.layout import GenerationScope
from services.ledger.ledger import Committed, Conflict, Ledger, NoChange, Refusal
from services.move.guards import step_allowed
from services.move.lease import StagingStopped, StagingWork
from services.objstore.port import Got, ObjectStore, StoreError
from services.source import report as launch_report
from services.source.phases import SEALED, Readiness, TimingProfile, decide_ready, lease_timing, not_ready
from services.source.staging import Mirrored, MoveMarker, Stager
from services.target.readiness import TargetReport
from services.target.readiness import report_key as target_report_key

log = logging.getLogger("hostmove.source.preparing")

# -- the pure part ------------------------------------------------------------------------------------------

PrepKind = Literal["idle", "blocked", "touch", "round"]


@dataclass(frozen=True)
class PrepStep:
    kind: PrepKind
    reason: str = ""


def plan_preparing(record: Record | None, claim: Claim | None, *, source: str, move_id: str,
                   incarnation: str) -> PrepStep:
    """The next preparing step (§7.3), from the record and the claim alone. Rounds continue at ``ready`` so the
    cut's admission finds fresh reports (§7.4 ``admitted``)."""
    if record is None or record.move is None:
        return PrepStep("idle", "the host has no move")
    move = record.move
    if move.id != move_id or move.incarnation != incarnation:
        return PrepStep("idle", "the record holds another move")
    if move.state not in ("preparing", "ready"):
        return PrepStep("idle", f"the move is {move.state}, not preparing or ready")
    why = step_allowed(claim, op_id=move_id, kinds=("moving",), exec_box=source)
    if why is not None:
        return PrepStep("blocked", why)
    assert claim is not None
    if len(claim.op.participants) != 2 or claim.op.participants[0] != source:
        return PrepStep("blocked", f"the move's claim does not name {source} as its source")
    if claim.holder is None:
        return PrepStep("blocked", "the claim has no holder, so there is no replica to stage")
    touched = claim.touched
    if move.to not in touched.regions or claim.op.participants[1] not in touched.boxes:
        return PrepStep("touch", f"{move.to} and {claim.op.participants[1]} join touched before staging")
    return PrepStep("round")


def decide_self_abort(record: Record | None, move_id: str, incarnation: str, now_ms: int,
                      profile: TimingProfile) -> Record | NoChange:
    """§7.11 "A move whose readiness never comes aborts itself after a bound, so an unreachable target never needs
    a human": still ``preparing`` ``prepare_bound_s`` after its request (the §13 prepare budget), the record CAS
    ``state = aborted`` with the reason; the abort then closes as the operator's does. A move that became ready
    (a manual cut waiting for its operator) is never aborted here."""
    if record is None or record.move is None:
        return NoChange("the host has no move")
    move = record.move
    if move.id != move_id or move.incarnation != incarnation or move.state != "preparing":
        return NoChange("only a move still preparing aborts itself")
    bound_ms = int(profile.prepare_bound_s * 1000)
    if move.requested_at is None or now_ms - move.requested_at <= bound_ms:
        return NoChange("within its prepare bound")
    reason = (f"the move was never ready within {profile.prepare_bound_s:g} s of its request "
              f"({move.reason or 'no reason recorded'}); it aborted itself")
    return msgspec.structs.replace(record, move=msgspec.structs.replace(
        move, state="aborted", reason=reason, updated_at=now_ms))


def decide_waiting(record: Record | None, move_id: str, incarnation: str, why: str, now_ms: int) -> Record | NoChange:
    """A move still ``preparing`` that waits for one of its source box's preparing slots
    (:mod:`services.source.cutslots`) says so in ``move.reason``, written only when it changes, so the operator reads
    why it has not begun (§20) and a self-abort past the bound names it (§7.11)."""
    if record is None or record.move is None:
        return NoChange("the host has no move")
    move = record.move
    if move.id != move_id or move.incarnation != incarnation or move.state != "preparing":
        return NoChange("only a move still preparing waits for a preparing slot")
    if move.reason == why:
        return NoChange(why)
    return msgspec.structs.replace(record, move=msgspec.structs.replace(move, reason=why, updated_at=now_ms))


def staging_refused(record: Record | None, claim: Claim | None, *, source: str, move_id: str,
                    incarnation: str) -> str | None:
    """Why a preparing round may not stage now, read fresh right after the staging-work lease was taken (§7.3:
    "then revalidate the claim's op id and phase"), or None. Rounds run while the move is ``preparing`` or
    ``ready`` and for the cut's admission (``cutting`` at ``requested``/``admitted``, §7.4); K5 and K12 hold."""
    if record is None or record.move is None:
        return "the host has no move"
    move = record.move
    if move.id != move_id or move.incarnation != incarnation:
        return "the record holds another move"
    if move.state not in ("preparing", "ready") and not (
            move.state == "cutting" and move.cut_phase in ("requested", "admitted")):
        return f"the move is {move.state}/{move.cut_phase or '-'}; its preparing rounds have ended"
    why = step_allowed(claim, op_id=move_id, kinds=("moving",), exec_box=source)
    if why is not None:
        return why
    assert claim is not None
    if claim.op.phase == SEALED:
        return "the staging lane is sealed"
    if len(claim.op.participants) != 2 or claim.op.participants[0] != source:
        return f"the move's claim does not name {source} as its source"
    if claim.holder is None:
        return "the claim has no holder, so there is no replica to stage"
    if move.to not in claim.touched.regions or claim.op.participants[1] not in claim.touched.boxes:
        return f"{move.to} and {claim.op.participants[1]} have not joined touched; nothing is staged (K12)"
    return None


def decide_touch(claim: Claim | None, move_id: str, source: str, region: str) -> Claim | NoChange | Refusal:
    """Add the target region and box (``participants[1]``) to ``touched`` before the first staging write
    (claim spec §2, K12; §7.3 T9), only while K5 holds."""
    why = step_allowed(claim, op_id=move_id, kinds=("moving",), exec_box=source)
    if why is not None:
        return Refusal(why)
    assert claim is not None
    if len(claim.op.participants) != 2 or claim.op.participants[0] != source:
        return Refusal(f"the move's claim does not name {source} as its source")
    box = claim.op.participants[1]
    t = claim.touched
    if region in t.regions and box in t.boxes:
        return NoChange("the target region and box are already in touched")
    regions = t.regions if region in t.regions else (*t.regions, region)
    boxes = t.boxes if box in t.boxes else (*t.boxes, box)
    return msgspec.structs.replace(claim, touched=msgspec.structs.replace(t, regions=regions, boxes=boxes))


@dataclass(frozen=True)
class Observed:
    """What one round observed (§7.3). Times are ms since the epoch; details are plain words, never values."""

    at: int
    round_bytes: int
    s1_ok: bool
    s1_detail: str
    strict: bool
    strict_detail: str
    target: TargetReport | None
    target_detail: str
    inputs: MoveInputs
    recovery_armed: bool = False
    staging_refused: str = ""  # the round could not stage (e.g. the files cannot be archived, M-C14/M-C15)


def readiness_of(obs: Observed, move_id: str) -> Readiness:
    """The :class:`Readiness` the deciders take. A target report for another move counts as missing."""
    target = obs.target if obs.target is not None and obs.target.move_id == move_id else None
    failing = "; ".join(f"{c.check} {c.detail}".strip() for c in target.failing()) if target else ""
    return Readiness(
        round_at=None if obs.staging_refused else obs.at, round_bytes=obs.round_bytes,
        target_report_at=target.at if target else None, target_passed=bool(target and target.ready),
        target_reason=failing or obs.target_detail, source_ready_at=obs.at if obs.s1_ok else None,
        source_strict=obs.strict, recovery_armed=obs.recovery_armed, inputs=obs.inputs,
    )


def explain(obs: Observed, why: str, host: str, to_region: str) -> str:
    """The operator's reason for a move kept in ``preparing`` (§20): the failing check with its observation."""
    if obs.staging_refused:
        return obs.staging_refused
    if "readiness probe" in why:
        return f"{say('M-C16', host=host)} The probe: {obs.s1_detail}."
    if "strict" in why:
        return f"{why}: {obs.strict_detail}"
    if "target's readiness report" in why:
        return say("M-C4", to_region=to_region, reason=why)
    return why


def pinned_inputs_differ(pinned: MoveInputs, current: MoveInputs) -> str | None:
    """The first input the cut's admission compares (§7.4 ``admitted``) that changed since it was pinned."""
    for name in ("bundle_etags", "overlay_etag", "release", "env_report"):
        if getattr(pinned, name) != getattr(current, name):
            return name
    return None


def decide_preparing(record: Record | None, move_id: str, incarnation: str, obs: Observed, now_ms: int,
                     profile: TimingProfile, host: str) -> Record | NoChange | Refusal:
    """``preparing -> ready`` (§7.3, ``decide_ready`` pins the inputs), clearing the reason; or the move stays
    ``preparing`` with why, written only when it changed (no write per idle round).

    At ``ready`` (rounds continue there), a launch input that changed since it was pinned is re-pinned with a new
    ``ready_at`` once every check is fresh again: the admission sends a changed move back to ``ready`` saying
    "the checks run again" (§7.4), and this is where they do; without it an auto move would loop."""
    r = readiness_of(obs, move_id)
    if record is not None and record.move is not None and record.move.state == "ready":
        move = record.move
        if move.id != move_id or move.incarnation != incarnation:
            return NoChange("the record holds another move")
        changed = pinned_inputs_differ(move.inputs, r.inputs)
        if changed is None:
            return NoChange("the move is ready and its pinned inputs are current")
        why = not_ready(r, now_ms, profile)
        if why is not None:
            return NoChange(f"the pinned input {changed} changed and the checks do not pass yet: {why}")
        return msgspec.structs.replace(record, move=msgspec.structs.replace(
            move, ready_at=now_ms, inputs=r.inputs, reason="", updated_at=now_ms))
    out = decide_ready(record, move_id, incarnation, r, now_ms, profile)
    if isinstance(out, Record):
        assert out.move is not None
        return msgspec.structs.replace(out, move=msgspec.structs.replace(out.move, reason=""))
    if isinstance(out, Refusal) or record is None or record.move is None or record.move.state != "preparing":
        return out
    move = record.move
    if move.id != move_id or move.incarnation != incarnation:
        return out
    reason = explain(obs, out.reason, host, move.to)
    if move.reason == reason:
        return NoChange(reason)
    return msgspec.structs.replace(record, move=msgspec.structs.replace(move, reason=reason, updated_at=now_ms))


def decide_auto_cut(record: Record | None, move_id: str, incarnation: str, now_ms: int,
                    host: str, *, blocked: str = "") -> Record | NoChange | Refusal:
    """The auto cut (§7.3, D§3.1 ``→cutting (requested)``): ``ready -> cutting/requested`` when ``cut`` is
    ``auto``. A manual move stays ``ready`` and waits for the operator (M-C12). ``blocked`` is why this round's
    checks would refuse the admission now (stale, or the pinned inputs changed): the cut is not requested then,
    so an auto move does not bounce between ``ready`` and ``cutting``."""
    if record is None or record.move is None:
        return NoChange("the host has no move")
    move = record.move
    if move.id != move_id or move.incarnation != incarnation:
        return NoChange("the record holds another move")
    if move.state != "ready":
        return NoChange(f"the move is {move.state}, not ready")
    if move.cut != "auto":
        return NoChange(say("M-C12", host=host))
    if blocked:
        return NoChange(blocked)
    return msgspec.structs.replace(record, move=msgspec.structs.replace(
        move, state="cutting", cut_phase="requested", updated_at=now_ms))


# -- the runner ---------------------------------------------------------------------------------------------


class StrictCheck(Protocol):
    def strict_available(self) -> tuple[bool, str]: ...


@dataclass(frozen=True)
class LaunchInputs:
    """What the box's next spawn would get (§7.3): the composed environment (:func:`report.compose_env`) and the
    input versions it was rendered from."""

    env: Mapping[str, str]
    bundle_etags: Mapping[str, str] = field(default_factory=dict)
    overlay_etag: str = ""
    release: str = ""


@dataclass(frozen=True)
class PreparingBox:
    """The source box's ports for preparing. ``ready_url`` is the instance's readiness URL as it runs now
    (``None``: no readiness path declared); ``recovery_armed`` is T13's ``recoverySourceArmed``."""

    label: str
    region: str
    ledger: Ledger
    deploy_store: ObjectStore
    deploy_bucket: str
    data_store: ObjectStore
    data_bucket: str
    staging: Callable[[str], tuple[ObjectStore, str]]  # target region -> its store and bucket
    secrets_key: PrivateKey
    tree: StrictCheck
    clock: Clock
    files_dir: Callable[[str], Path]
    db_path: Callable[[str], Path]
    launch: Callable[[str], Awaitable[LaunchInputs]]
    ready_url: Callable[[str], str | None]
    recovery_armed: Callable[[str], bool] = lambda host: False
    probe_timeout_s: float = 5.0
    rng: Random = field(default_factory=SystemRandom)  # the staging lease holder's nonce
    # target region -> its public key, to seal each round's files archive to (§7.3, §8). Without it the rounds
    # stage no archive and the target's T5 cannot pass.
    target_key: Callable[[str], EllipticCurvePublicKey] | None = None
    # S1 "from its own process" (§7.3, codex 14): whether the readiness answer came from the host's cgroup leaf
    # (:mod:`services.box.instance.peer`), with why not. None: the composition cannot tell (the answer is taken).
    ready_peer: Callable[[str], Awaitable[tuple[bool, str]]] | None = None


@dataclass(frozen=True)
class PrepResult:
    """One step's outcome: the step taken, the record's move state after it, and why it did not advance."""

    step: PrepStep
    state: str = ""
    reason: str = ""
    observed: Observed | None = None
    report_version: str | None = None


async def probe_ready(url: str | None, timeout_s: float) -> tuple[bool, str]:
    """S1 (§7.3, §7.7): one GET of the readiness path; 200..399 passes (redirects are answers, not followed)."""
    if url is None:
        return False, "no readiness path is declared"
    status = await http_status(url, timeout_s)  # the box-local network port (ARCHITECTURE §7)
    if status is None:
        return False, f"the instance did not answer within {timeout_s:g} s"
    if 200 <= status <= 399:
        return True, f"answered {status}"
    return False, f"answered {status}, not 200 to 399"


class PreparingRunner:
    def __init__(self, box: PreparingBox, profile: TimingProfile) -> None:
        self.box = box
        self.profile = profile
        self.holder = f"{box.label}/{process_nonce(box.rng)}"  # this runner's staging lease token (§7.3)

    async def run(self, host: str, move_id: str, incarnation: str) -> PrepResult:
        """Steps until a round ran (touch first when needed), or the stage stops (idle, blocked)."""
        result = await self.step(host, move_id, incarnation)
        if result.step.kind == "touch" and not result.reason:
            result = await self.step(host, move_id, incarnation)
        return result

    async def wait(self, host: str, move_id: str, incarnation: str, why: str) -> PrepResult:
        """No round: the move waits for a preparing slot. Under K5 (the claim is still this move's, this box its
        source) the record says ``why``, and the prepare bound still aborts it (§7.11)."""
        box = self.box
        record = (await box.ledger.read_record(host)).state
        claim = (await box.ledger.read_claim(host)).state
        step = plan_preparing(record, claim, source=box.label, move_id=move_id, incarnation=incarnation)
        state = record.move.state if record is not None and record.move is not None else ""
        if step.kind in ("idle", "blocked"):
            return PrepResult(step, state, step.reason)
        if isinstance(decide_self_abort(record, move_id, incarnation, box.clock.now_ms(), self.profile), Record):
            out = await box.ledger.transition("record", host, "move-self-abort", lambda r: decide_self_abort(
                r, move_id, incarnation, box.clock.now_ms(), self.profile))  # type: ignore[arg-type,misc]
            return PrepResult(PrepStep("idle", "aborted"), "aborted" if isinstance(out, Committed) else state,
                              "the move was never ready within its prepare bound; it aborted itself")
        out = await box.ledger.transition("record", host, "move-wait-slot", lambda r: decide_waiting(
            r, move_id, incarnation, why, box.clock.now_ms()))  # type: ignore[arg-type,misc]
        return PrepResult(PrepStep("idle", why), state, why if isinstance(out, Committed | NoChange) else _why_not(out))

    async def step(self, host: str, move_id: str, incarnation: str) -> PrepResult:
        box = self.box
        record = (await box.ledger.read_record(host)).state
        claim = (await box.ledger.read_claim(host)).state
        step = plan_preparing(record, claim, source=box.label, move_id=move_id, incarnation=incarnation)
        log.info("preparing step %s of %s (move %s)", step.kind, host, move_id,
                 extra=ctx(host=host, op_id=move_id, box=box.label, phase="preparing", step=step.kind))
        state = record.move.state if record is not None and record.move is not None else ""
        if step.kind in ("idle", "blocked"):
            return PrepResult(step, state, step.reason)
        now = box.clock.now_ms()
        if isinstance(decide_self_abort(record, move_id, incarnation, now, self.profile), Record):
            out = await box.ledger.transition("record", host, "move-self-abort", lambda r: decide_self_abort(
                r, move_id, incarnation, box.clock.now_ms(), self.profile))  # type: ignore[arg-type,misc]
            return PrepResult(PrepStep("idle", "aborted"), "aborted" if isinstance(out, Committed) else state,
                              "the move was never ready within its prepare bound; it aborted itself")
        assert record is not None and record.move is not None and claim is not None
        to = record.move.to
        if step.kind == "touch":
            touched = await box.ledger.transition("claim", host, "move-touch-target", lambda c: decide_touch(
                c, move_id, box.label, to))  # type: ignore[arg-type,misc]
            return PrepResult(step, state, _why_not(touched))
        obs, version = await self._round(host, record, claim)
        # K5 again after the round's I/O, before the CAS: an abort or another op may have taken the claim meanwhile.
        again = plan_preparing((await box.ledger.read_record(host)).state, (await box.ledger.read_claim(host)).state,
                               source=box.label, move_id=move_id, incarnation=incarnation)
        if again.kind != "round":
            return PrepResult(again, state, again.reason or "the claim changed during the round", obs, version)
        now = box.clock.now_ms()
        out = await box.ledger.transition("record", host, "move-ready", lambda r: decide_preparing(
            r, move_id, incarnation, obs, now, self.profile, host))  # type: ignore[arg-type,misc]
        if isinstance(out, Refusal | Conflict):
            return PrepResult(step, state, _why_not(out), obs, version)
        blocked = self._blocked(obs, move_id, box.clock.now_ms())
        cut = await box.ledger.transition("record", host, "move-cut-auto", lambda r: decide_auto_cut(
            r, move_id, incarnation, box.clock.now_ms(), host,
            blocked=blocked(r)))  # type: ignore[arg-type,misc]
        fresh = (await box.ledger.read_record(host)).state
        move = fresh.move if fresh is not None else None
        state = move.state if move is not None and move.id == move_id else ""
        reason = move.reason if move is not None and state == "preparing" else ""
        if state == "ready" and isinstance(cut, NoChange):
            reason = cut.reason
        elif isinstance(cut, Refusal | Conflict):
            reason = _why_not(cut)
        return PrepResult(step, state, reason, obs, version)

    def _blocked(self, obs: Observed, move_id: str, now_ms: int) -> Callable[[Record | None], str]:
        r = readiness_of(obs, move_id)

        def why(record: Record | None) -> str:
            if record is None or record.move is None:
                return ""
            changed = pinned_inputs_differ(record.move.inputs, r.inputs)
            if changed is not None:
                return f"the pinned input {changed} changed since the move became ready; the checks run again"
            return not_ready(r, now_ms, self.profile) or ""

        return why

    async def readiness(self, host: str) -> Readiness:
        """A fresh round's :class:`Readiness` for the cut's admission (``SourceWorker``'s ``readiness`` port).
        A read that finds no move or a blocked claim answers an empty (never ready) :class:`Readiness`."""
        box = self.box
        record = (await box.ledger.read_record(host)).state
        claim = (await box.ledger.read_claim(host)).state
        if record is None or record.move is None or claim is None or claim.holder is None:
            return Readiness()
        move = record.move
        if step_allowed(claim, op_id=move.id, kinds=("moving",), exec_box=box.label) is not None:
            return Readiness()
        obs, _ = await self._round(host, record, claim)
        return readiness_of(obs, move.id)

    async def _round(self, host: str, record: Record, claim: Claim) -> tuple[Observed, str | None]:
        """Stage, report and observe (§7.3). Store failures raise (a read error never acts, C6)."""
        box = self.box
        assert record.move is not None and claim.holder is not None
        move = record.move
        refused = ""
        try:
            files_plain = "sha256:" + (await blocking(plain_digest, box.files_dir(host), None,
                                                               host=host)).plain
        except ArchiveError as exc:
            files_plain, refused = "", f"the files beside the database cannot move: {exc}"
        mirrored, stopped = await self._stage(host, record, claim, files_plain)
        refused = refused or stopped
        launch = await box.launch(host)
        db = box.db_path(host)
        db_bytes = db.stat().st_size if db.exists() else 0
        values = launch_report.input_values(bundle_etags=launch.bundle_etags, overlay_etag=launch.overlay_etag,
                                            release=launch.release)
        measures = launch_report.measure_values(db_bytes=db_bytes, files_plain=files_plain)
        report = launch_report.build_report(box.secrets_key, host=host, move_id=move.id, box=box.label,
                                            at=box.clock.now_ms(), env=launch.env, inputs=values, measures=measures)
        version = await launch_report.write_report(box.deploy_store, box.deploy_bucket, report)
        s1_ok, s1_detail = await probe_ready(box.ready_url(host), box.probe_timeout_s)
        if s1_ok and box.ready_peer is not None:  # the answer counts only from the instance's own process
            s1_ok, why = await box.ready_peer(host)
            s1_detail = s1_detail if s1_ok else f"{s1_detail}, but {why}"
        strict, strict_detail = box.tree.strict_available()
        target, target_detail = await self._target_report(host, move.id)
        inputs = MoveInputs(bundle_etags=dict(launch.bundle_etags), overlay_etag=launch.overlay_etag,
                            release=launch.release, files_plain=files_plain, env_report=report.digest())
        obs = Observed(at=box.clock.now_ms(), round_bytes=mirrored.bytes if mirrored else 0, s1_ok=s1_ok,
                       s1_detail=s1_detail, strict=strict, strict_detail=strict_detail, target=target,
                       target_detail=target_detail,
                       inputs=inputs, recovery_armed=box.recovery_armed(host), staging_refused=refused)
        log.info("preparing round of %s (move %s): %d bytes, staged %s, S1 %s, strict %s, target ready %s", host,
                 move.id, obs.round_bytes, not refused, s1_ok, strict, bool(target and target.ready),
                 extra=ctx(host=host, op_id=move.id, box=box.label, phase="preparing",
                           copied=mirrored.copied if mirrored else 0, bytes=obs.round_bytes, staged=not refused,
                           s1=s1_ok, strict=strict, target_ready=bool(target and target.ready)))
        return obs, version

    async def _stage(self, host: str, record: Record, claim: Claim, files_plain: str) -> tuple[Mirrored | None, str]:
        """One staging round under the staging-work lease (§7.3): take it, revalidate, stage push-only (M17), give
        it back. Answers the mirror, or why the round could not stage (then it is not a round)."""
        box = self.box
        assert record.move is not None and claim.holder is not None
        move = record.move
        store, bucket = box.staging(move.to)
        work = StagingWork(box.deploy_store, box.deploy_bucket, box.clock, lease_timing(self.profile),
                           region=move.to, host=host, op_id=move.id, holder=self.holder)
        try:
            await work.acquire()
            try:
                why = staging_refused((await box.ledger.read_record(host)).state,
                                      (await box.ledger.read_claim(host)).state, source=box.label, move_id=move.id,
                                      incarnation=move.incarnation)
                if why is not None:
                    return None, why
                stager = await Stager.open(work, store, bucket, box.deploy_store, box.deploy_bucket, host, move.id,
                                           move.to)
                await stager.write_marker(MoveMarker(move_id=move.id, incarnation=move.incarnation, host=host,
                                                     from_=move.from_ or box.region, to=move.to))
                scope = GenerationScope(claim.holder.location, claim.holder.generation)
                mirrored = await stager.mirror(box.data_store, box.data_bucket, scope, final=False)
                if files_plain and box.target_key is not None and not stager.round_archive_current(files_plain):
                    try:
                        archive, manifest = await blocking(self._archive, host, record)
                    except ArchiveError as exc:
                        return None, f"the files beside the database cannot move: {exc}"
                    await stager.stage_round_archive(files_plain, archive, manifest)
                return mirrored, ""
            finally:
                with contextlib.suppress(StoreError):
                    await work.release()
        except StagingStopped as exc:
            log.info("preparing round of %s (move %s) stopped: %s", host, move.id, exc,
                     extra=ctx(host=host, op_id=move.id, box=box.label, phase="preparing", reason=exc))
            return None, str(exc)

    def _archive(self, host: str, record: Record) -> tuple[bytes, bytes]:
        """The round's files archive sealed to the target region's key (§7.3, §8), and its manifest."""
        assert record.move is not None
        move = record.move
        out = io.BytesIO()
        assert self.box.target_key is not None
        manifest = build_archive(self.box.files_dir(host), None, out, self.box.target_key(move.to), host=host,
                                 op_id=move.id, incarnation=move.incarnation)
        return out.getvalue(), manifest_bytes(manifest)

    async def _target_report(self, host: str, move_id: str) -> tuple[TargetReport | None, str]:
        got = await self.box.deploy_store.get(self.box.deploy_bucket, target_report_key(host, move_id))
        if not isinstance(got, Got):
            return None, "the target has not written its readiness report yet"
        try:
            return msgspec.json.decode(got.body, type=TargetReport), ""
        except msgspec.DecodeError:
            return None, "the target's readiness report is unreadable"


def _why_not(out: Any) -> str:
    if isinstance(out, Committed | NoChange):
        return ""
    if isinstance(out, Refusal):
        return out.reason
    return "another writer kept changing the object; the next wake retries"


__all__ = [
    "LaunchInputs", "Observed", "PrepResult", "PrepStep", "PreparingBox", "PreparingRunner", "StrictCheck",
    "decide_auto_cut", "decide_preparing", "decide_touch", "explain", "pinned_inputs_differ", "plan_preparing",
    "probe_ready", "readiness_of", "staging_refused",
]
