"""Stop evidence from observable state only (spec §5.3, §9.3; digest D§10; K3, K13).

``ReconstructStopEvidence(host)`` reads the box's current state, so it gives the same answer after an agent
restart as before ("no entry in memory" is never evidence, codex R2-2):

1. **kill and drain** the host's cgroup until ``populated 0`` (the cleanup-only ``ReopenAndDrain``). An **absent**
   cgroup passes only when the box's spawn journal shows that no spawn of the host in this boot could have
   escaped containment (every one strict, or none at all: the "durably never-spawned" case); an unreadable journal
   or a non-strict spawn refuses with an alert (joint D3 "An absent host cgroup is insufficient where an earlier
   spawn could escape containment"; rule ``absent-cgroup-insufficient``);
2. **no stray process** in the agent's own leaf (anything there is unattributable: refuse and alert);
3. **no open database**: no process holds the database, WAL or SHM open (``/proc/*/fd``);
4. **lease released**: the host's lease is absent, released, or expired by more than its renewal margin;
5. after 1 to 4 only, the **final checkpoint** (the replica's final position N and the database sha256)
   and the digests of the files directory and of the timers.

The decision "evidence or refusal" is :func:`decide`, pure over the observations; :func:`observe` and
:func:`reconstruct_stop_evidence` are the thin shell. The result is written create-only
(``If-None-Match: *``) to ``moves/<host>/<op>/stopped-<role>.json`` in the deployment bucket (K13): a lost
create reads the existing evidence back and returns it when it records the same stopped state (so its original
``evidence_at``, which starts the H clock, is kept), and refuses otherwise.

The caller holds the host guard and has closed admission and drained spawn attempts (§5.3 joint D3) before it
asks; then it CASes the claim's execution holder to ``none`` citing the evidence (K3).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Literal
from urllib.parse import quote

from events.base import Durable, Ident, Millis, canonical, check_gen, decode, validate_ident
from events.ids import is_op_id
from kernel import rules
from kernel.ports import Clock
from services.box.instance.proctree import Drain, HolderScan, ProcessTree, SpawnHistory, StrayScan
from services.objstore.port import Missing, ObjectStore, StoreError, Won

__all__ = [
    "Checkpoint",
    "Cleared",
    "EvidenceFor",
    "EvidenceRefused",
    "Evidenced",
    "LeaseObservation",
    "Observed",
    "Refusal",
    "StepObservation",
    "StopEvidence",
    "StopHooks",
    "database_paths",
    "decide",
    "evidence_key",
    "file_sha256",
    "lease_file_check",
    "observe",
    "reconstruct_stop_evidence",
    "same_stop",
    "write_evidence",
]

Role = Literal["source", "target"]
StepName = Literal["kill-and-drain", "no-stray-process", "no-open-database", "lease-released", "final-checkpoint"]
RefusalCode = Literal[
    "live-process", "escape-possible", "stray-process", "database-held", "scan-incomplete", "lease-held", "conflict"
]
_HEX = frozenset("0123456789abcdef")

rules.register(
    "absent-cgroup-insufficient",
    section="§5.3 joint D3 'An absent host cgroup is insufficient where an earlier spawn could escape containment'",
    meaning="an absent host cgroup clears step 1 only when the box's spawn journal shows every spawn of the host in "
    "this boot strict, or none; a non-strict spawn or an unreadable journal refuses evidence with an alert",
    site="services/box/instance/evidence.py decide, step 1 with an absent group",
)


def _is_sha256(text: str) -> bool:
    return len(text) == 64 and set(text) <= _HEX


def _plain(text: str) -> str:
    """Durable text from an OS string (a path may carry undecodable bytes as lone surrogates)."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8").replace("\x00", "\\0")


# ---------------------------------------------------------------------------------------------------------
# The durable shape


class StepObservation(Durable, frozen=True):
    """What one step of §5.3 saw: ``ok`` and a plain-words ``detail``; ``pids`` it named (killed, stray, holders)."""

    step: int
    name: StepName
    ok: bool
    detail: str
    pids: tuple[int, ...] = ()


class StopEvidence(Durable, frozen=True):
    """``moves/<host>/<op>/stopped-<role>.json`` (§5.3, D§10): create-only per (op, role), recomputable (K13).

    ``n`` is the required final TXID (the source's; ``None`` without a local database); ``db_sha256`` is ``""``
    without one. ``evidence_at`` starts the late-completion horizon H (§5.3 "Evidence also starts a clock").
    """

    __durable_root__: ClassVar[bool] = True

    host: Ident
    box: Ident
    role: Role
    op_id: Ident
    incarnation: Ident
    claim_gen: int
    steps: tuple[StepObservation, ...]
    n: int | None
    db_sha256: str
    files_sha256: str
    timers_sha256: str
    evidence_at: Millis
    v: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        check_gen(self.claim_gen, "StopEvidence.claim_gen")
        if not is_op_id(self.op_id):
            raise ValueError(f"StopEvidence.op_id is not an operation id: {self.op_id!r}")
        if self.n is not None and self.n < 0:
            raise ValueError("StopEvidence.n must be a non-negative TXID")
        if self.db_sha256 and not _is_sha256(self.db_sha256):
            raise ValueError("StopEvidence.db_sha256 must be 64 lowercase hex characters or empty")
        for name in ("files_sha256", "timers_sha256"):
            if not _is_sha256(getattr(self, name)):
                raise ValueError(f"StopEvidence.{name} must be 64 lowercase hex characters")
        if [s.step for s in self.steps] != [1, 2, 3, 4, 5] or not all(s.ok for s in self.steps):
            raise ValueError("StopEvidence needs steps 1 to 5 of §5.3, in order, every one passed")


def evidence_key(host: str, op_id: str, role: Role) -> str:
    """``moves/<host>/<op>/stopped-<role>.json`` (D§0 lanes ``moves/<host>/<op>/``); the host is one
    percent-encoded path segment, as in the ledger's keys."""
    validate_ident(host, "host")
    if not is_op_id(op_id):
        raise ValueError(f"not an operation id: {op_id!r}")
    if role not in ("source", "target"):
        raise ValueError(f"role must be source or target, not {role!r}")
    return f"moves/{quote(host, safe='.-_~@+')}/{op_id}/stopped-{role}.json"


def same_stop(a: StopEvidence, b: StopEvidence) -> bool:
    """Whether two evidences record the same stopped state of the same participant (K13 "recomputable").

    Time, the claim gen read and the per-step details may differ between two reconstructions; the identity
    and what was stopped (N and the three digests) may not.
    """
    return (a.host, a.box, a.role, a.op_id, a.incarnation, a.n, a.db_sha256, a.files_sha256, a.timers_sha256) == (
        b.host,
        b.box,
        b.role,
        b.op_id,
        b.incarnation,
        b.n,
        b.db_sha256,
        b.files_sha256,
        b.timers_sha256,
    )


# ---------------------------------------------------------------------------------------------------------
# Inputs and results


@dataclass(frozen=True)
class EvidenceFor:
    """Who gives the evidence and for what: the claim ``gen`` is the one the caller read (K5)."""

    host: str
    op_id: str
    role: Role
    box: str
    incarnation: str
    claim_gen: int


@dataclass(frozen=True)
class LeaseObservation:
    """§5.3 step 4."""

    released: bool
    detail: str


@dataclass(frozen=True)
class Checkpoint:
    """§5.3 step 5: the replica's final position ``n`` (``None`` without a local database) and its sha256."""

    n: int | None
    db_sha256: str


@dataclass(frozen=True)
class StopHooks:
    """The injected parts: the lease check, the replicator's final checkpoint and the digests (§5.3 steps 4, 5)."""

    lease: Callable[[], LeaseObservation]
    final_checkpoint: Callable[[], Awaitable[Checkpoint]]
    files_digest: Callable[[], Awaitable[str]]
    timers_digest: Callable[[], Awaitable[str]]


@dataclass(frozen=True)
class Observed:
    """Steps 1 to 4 as observed, before any decision; ``history`` is the box's spawn journal for the host,
    which decides what an absent group proves (step 1)."""

    drain: Drain
    strays: StrayScan
    holders: HolderScan
    lease: LeaseObservation
    history: SpawnHistory


@dataclass(frozen=True)
class Cleared:
    """Steps 1 to 4 passed: the final checkpoint may run."""

    steps: tuple[StepObservation, ...]


@dataclass(frozen=True)
class Refusal:
    """Steps 1 to 4 did not all pass. ``reasons`` are plain words; ``codes`` are for alerting."""

    steps: tuple[StepObservation, ...]
    reasons: tuple[str, ...]
    codes: tuple[RefusalCode, ...]

    @property
    def alert(self) -> bool:
        """A lease still held is worth a retry; anything else is an incident (§13 paging: stray process)."""
        return any(c != "lease-held" for c in self.codes)


@dataclass(frozen=True)
class Evidenced:
    """The evidence in the bucket: ``created`` is false when an equal one was already there (its time kept)."""

    evidence: StopEvidence
    key: str
    created: bool


@dataclass(frozen=True)
class EvidenceRefused:
    """No evidence: the execution right stays where it is (INV-1). ``message`` is for the operator and the alert."""

    host: str
    op_id: str
    role: Role
    reasons: tuple[str, ...]
    codes: tuple[RefusalCode, ...]
    steps: tuple[StepObservation, ...]

    @property
    def alert(self) -> bool:
        return any(c != "lease-held" for c in self.codes)

    @property
    def message(self) -> str:
        return (
            f"stop evidence for host {self.host} ({self.role} of {self.op_id}) refused: "
            + "; ".join(self.reasons)
            + ". The host keeps its current execution holder until the box can prove the instance stopped."
        )


# ---------------------------------------------------------------------------------------------------------
# The pure decision


def _pids(pids: tuple[int, ...], names: tuple[str, ...] = ()) -> str:
    if names and len(names) == len(pids):
        return ", ".join(f"{p} ({n})" for p, n in zip(pids, names, strict=True))
    return ", ".join(str(p) for p in pids)


def _absent_group(host: str, d: Drain, history: SpawnHistory) -> tuple[StepObservation, str]:
    """Step 1 with no group to drain (§5.3 joint D3): what the absence proves depends on how the host was spawned.
    Answers the step and, when it refuses, the reason. A strict group cannot be removed while populated, so an
    absent one held nothing; a non-strict spawn's processes may be anywhere, and an unknown history proves nothing.
    """
    if not rules.on("absent-cgroup-insufficient"):
        detail = f"cgroup {d.leaf} absent: no strict spawn of this host is running (every spawn is strict)"
        return StepObservation(step=1, name="kill-and-drain", ok=True, detail=_plain(detail)), ""
    if not history.readable:
        detail = f"cgroup {d.leaf} absent and the spawn history is unknown: {history.detail}"
        reason = (
            f"host {host}'s process group is absent and the box cannot show that every earlier spawn of it was "
            f"contained ({history.detail}); an absent group proves a stop only with a readable spawn journal"
        )
        return StepObservation(step=1, name="kill-and-drain", ok=False, detail=_plain(detail)), _plain(reason)
    if history.loose:
        detail = f"cgroup {d.leaf} absent; {history.detail}"
        reason = (
            f"host {host}'s process group is absent, and this box spawned it {history.loose} time(s) in this boot "
            "without strict containment, so its processes may still run outside any group: find and stop them; "
            "the box's spawn journal counts this boot only, so evidence from an absent group needs a reboot"
        )
        return StepObservation(step=1, name="kill-and-drain", ok=False, detail=_plain(detail)), _plain(reason)
    why = (
        "every one was strict, and a strict group cannot be removed while populated" if history.strict
        else "nothing could have escaped a group"
    )
    detail = f"cgroup {d.leaf} absent; {history.detail}: {why}"
    return StepObservation(step=1, name="kill-and-drain", ok=True, detail=_plain(detail)), ""


def decide(host: str, seen: Observed) -> Cleared | Refusal:
    """Evidence or refusal from steps 1 to 4 (§5.3). Pure: the same observations give the same answer."""
    steps: list[StepObservation] = []
    reasons: list[str] = []
    codes: list[RefusalCode] = []

    d = seen.drain
    if d.error:
        steps.append(StepObservation(step=1, name="kill-and-drain", ok=False, detail=_plain(d.error), pids=d.remaining))
        reasons.append(f"host {host}'s process group could not be killed and drained ({_plain(d.error)})")
        codes.append("live-process")
    elif not d.drained:
        detail = f"cgroup {d.leaf} still populated after {d.waited_ms} ms; live pids {_pids(d.remaining) or 'unknown'}"
        steps.append(StepObservation(step=1, name="kill-and-drain", ok=False, detail=_plain(detail), pids=d.remaining))
        reasons.append(
            f"process {_pids(d.remaining) or '(unknown pid)'} of host {host} is still alive after the kill "
            f"(waited {d.waited_ms} ms)"
        )
        codes.append("live-process")
    elif not d.existed:
        step, reason = _absent_group(host, d, seen.history)
        steps.append(step)
        if reason:
            reasons.append(reason)
            codes.append("escape-possible")
    else:
        killed = f"; killed pids {_pids(d.pids_before)}" if d.pids_before else "; it was already empty"
        detail = f"cgroup {d.leaf} populated 0 after {d.waited_ms} ms{killed}"
        steps.append(StepObservation(step=1, name="kill-and-drain", ok=True, detail=_plain(detail), pids=d.pids_before))

    s = seen.strays
    if not s.readable:
        steps.append(StepObservation(step=2, name="no-stray-process", ok=False, detail=_plain(s.error)))
        reasons.append(f"the agent's own process group could not be checked ({_plain(s.error)})")
        codes.append("scan-incomplete")
    elif s.strays:
        detail = f"agent group {s.agent_dir} holds other processes: {_pids(s.strays, s.names)}"
        steps.append(StepObservation(step=2, name="no-stray-process", ok=False, detail=_plain(detail), pids=s.strays))
        reasons.append(
            f"stray process {_pids(s.strays, s.names)} runs in the agent's own group {s.agent_dir}: nothing started "
            "by hostmove belongs there, so its origin is unknown and the stop cannot be proven"
        )
        codes.append("stray-process")
    else:
        detail = f"agent group {s.agent_dir} holds only the agent"
        steps.append(StepObservation(step=2, name="no-stray-process", ok=True, detail=_plain(detail)))

    h = seen.holders
    if not h.complete:
        steps.append(StepObservation(step=3, name="no-open-database", ok=False, detail=_plain(h.error)))
        reasons.append(f"the scan for processes holding the database could not read /proc ({_plain(h.error)})")
        codes.append("scan-incomplete")
    elif h.holders:
        pids = tuple(sorted({x.pid for x in h.holders}))
        listed = "; ".join(f"process {x.pid} ({x.name}) holds {x.path} ({x.via})" for x in h.holders)
        steps.append(StepObservation(step=3, name="no-open-database", ok=False, detail=_plain(listed), pids=pids))
        reasons.append(_plain(listed))
        codes.append("database-held")
    else:
        detail = f"no process holds the database, WAL or SHM open ({h.scanned} processes scanned, {h.skipped} skipped)"
        steps.append(StepObservation(step=3, name="no-open-database", ok=True, detail=detail))

    lease = seen.lease
    steps.append(StepObservation(step=4, name="lease-released", ok=lease.released, detail=_plain(lease.detail)))
    if not lease.released:
        reasons.append(f"the host's lease is still held ({_plain(lease.detail)})")
        codes.append("lease-held")

    if reasons:
        return Refusal(tuple(steps), tuple(reasons), tuple(codes))
    return Cleared(tuple(steps))


# ---------------------------------------------------------------------------------------------------------
# The shell


def database_paths(db_path: str | Path) -> tuple[Path, ...]:
    """The files step 3 watches: the database, its WAL and SHM (and a rollback journal, to be safe)."""
    p = Path(db_path)
    return (p, Path(f"{p}-wal"), Path(f"{p}-shm"), Path(f"{p}-journal"))


async def observe(
    tree: ProcessTree,
    host: str,
    *,
    db_path: str | Path,
    lease: Callable[[], LeaseObservation],
    own_pid: int | None = None,
    holder_uid: int | None = None,
    drain_within_s: float = 10.0,
) -> Observed:
    """Run steps 1 to 4 against the box as it is now (§5.3). Every step runs, so a refusal names all causes."""
    drain = await tree.reopen_and_drain(host, within_s=drain_within_s)
    strays = tree.strays(own_pid if own_pid is not None else os.getpid())
    holders = tree.holders(database_paths(db_path), uid=holder_uid)
    return Observed(drain, strays, holders, lease(), tree.spawn_history(host))


async def reconstruct_stop_evidence(
    *,
    tree: ProcessTree,
    store: ObjectStore,
    bucket: str,
    clock: Clock,
    subject: EvidenceFor,
    db_path: str | Path,
    hooks: StopHooks,
    own_pid: int | None = None,
    holder_uid: int | None = None,
    drain_within_s: float = 10.0,
) -> Evidenced | EvidenceRefused:
    """``ReconstructStopEvidence(host)`` (§5.3): observe, decide, then checkpoint, digest and write create-only.

    Refusals are values (with plain-words reasons and ``alert``); a store failure or a corrupt existing object
    raises, and nothing is acted on (C6). Step 5's hooks run only after steps 1 to 4 passed.
    """
    seen = await observe(
        tree,
        subject.host,
        db_path=db_path,
        lease=hooks.lease,
        own_pid=own_pid,
        holder_uid=holder_uid,
        drain_within_s=drain_within_s,
    )
    verdict = decide(subject.host, seen)
    if isinstance(verdict, Refusal):
        return EvidenceRefused(subject.host, subject.op_id, subject.role, verdict.reasons, verdict.codes, verdict.steps)
    checkpoint = await hooks.final_checkpoint()
    files = await hooks.files_digest()
    timers = await hooks.timers_digest()
    position = "no local database" if checkpoint.n is None else f"final position N={checkpoint.n}"
    step5 = StepObservation(
        step=5,
        name="final-checkpoint",
        ok=True,
        detail=f"{position}; db sha256 {checkpoint.db_sha256 or '-'}; files {files}; timers {timers}",
    )
    evidence = StopEvidence(
        host=subject.host,
        box=subject.box,
        role=subject.role,
        op_id=subject.op_id,
        incarnation=subject.incarnation,
        claim_gen=subject.claim_gen,
        steps=(*verdict.steps, step5),
        n=checkpoint.n,
        db_sha256=checkpoint.db_sha256,
        files_sha256=files,
        timers_sha256=timers,
        evidence_at=clock.now_ms(),
    )
    return await write_evidence(store, bucket, evidence)


async def write_evidence(store: ObjectStore, bucket: str, evidence: StopEvidence) -> Evidenced | EvidenceRefused:
    """Create-only write (K13). A lost create returns the existing evidence if it records the same stop
    (:func:`same_stop`) and refuses, with an alert, when it records a different one."""
    key = evidence_key(evidence.host, evidence.op_id, evidence.role)
    result = await store.put(bucket, key, canonical(evidence), if_none_match=True)
    if isinstance(result, Won):
        return Evidenced(evidence, key, created=True)
    got = await store.get(bucket, key)
    if isinstance(got, Missing):
        raise StoreError(
            f"the create of {key} in {bucket} was refused because it exists, but reading it back found nothing; "
            "not acting on an inconsistent read"
        )
    existing = decode(got.body, StopEvidence)  # a corrupt object raises decode_failed (C6)
    if same_stop(existing, evidence):
        return Evidenced(existing, key, created=False)
    differs = [
        f"{name} {getattr(existing, name)!r} there vs {getattr(evidence, name)!r} now"
        for name in ("box", "incarnation", "n", "db_sha256", "files_sha256", "timers_sha256")
        if getattr(existing, name) != getattr(evidence, name)
    ]
    reason = (
        f"stop evidence {key} already exists and records a different stop ({'; '.join(differs)}): the instance's "
        "state changed after it was written, or another box wrote it"
    )
    return EvidenceRefused(evidence.host, evidence.op_id, evidence.role, (reason,), ("conflict",), evidence.steps)


# ---------------------------------------------------------------------------------------------------------
# Small helpers for the injected checks


def lease_file_check(path: str | Path, clock: Clock, renewal_margin_ms: int) -> Callable[[], LeaseObservation]:
    """§5.3 step 4 over a lease file: absent, ``"released": true``, or ``expires_at_ms`` older than
    ``now - renewal_margin_ms`` is released. An unreadable or malformed lease is held (fail closed)."""
    lease_path = Path(path)

    def check() -> LeaseObservation:
        try:
            raw = lease_path.read_bytes()
        except FileNotFoundError:
            return LeaseObservation(True, f"no lease at {lease_path}")
        except OSError as exc:
            return LeaseObservation(False, f"cannot read the lease {lease_path}: {exc.strerror or exc}")
        try:
            doc = json.loads(raw)
        except ValueError:
            return LeaseObservation(False, f"the lease {lease_path} is not valid JSON")
        if not isinstance(doc, dict):
            return LeaseObservation(False, f"the lease {lease_path} is not a JSON object")
        if doc.get("released") is True:
            return LeaseObservation(True, f"lease {lease_path} released")
        expires = doc.get("expires_at_ms")
        if isinstance(expires, bool) or not isinstance(expires, int):
            return LeaseObservation(False, f"the lease {lease_path} has no expires_at_ms and is not released")
        now = clock.now_ms()
        if now > expires + renewal_margin_ms:
            ago = now - expires
            return LeaseObservation(True, f"lease {lease_path} expired {ago} ms ago (margin {renewal_margin_ms} ms)")
        return LeaseObservation(
            False, f"lease {lease_path} held until {expires} (now {now}, renewal margin {renewal_margin_ms} ms)"
        )

    return check


def file_sha256(path: str | Path) -> str:
    """The sha256 of a file's bytes (for the final checkpoint's database digest)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
