"""The target's move worker: the runner of the landing (spec §7.6, §7.7, §7.9 steps 1-2, §7.13).

Each :meth:`LandingWorker.step` reads the claim and the record fresh, revalidates the claim (K5),
runs the effects of the phase the journal names (``landing_phase``) and then journals the next
phase through the ledger, so every phase is written **before** its effects. A restart therefore
replays the journaled phase by its rule (:data:`services.target.phases.REPLAY`): every phase up to
``restored`` is idempotent, ``probing`` restarts only the probe, ``probed`` commits. Nothing is kept
in memory across steps except the running probe app, which a restart loses (and re-probes).

Races are values: a refused decider or a lost CAS stops the step with the reason. A read or store
error propagates and never acts (C6). A **landing failure** (a refused restore, a digest mismatch, a
failed probe, an input mismatch, the landing deadline) is the record's rollback CAS (§7.8).

The seal is the source's (``services/source``): ``op.journal["seal"] = {"n": N, "replica": {<name under
replica/>: <version>}, "timers": {"timers.json": <version>}, "files": {"archive.sealed": <version>,
"manifest.json": <version>}, ...}``; landing reads those exact versions and nothing else (§7.3).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import shutil
import sqlite3
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal
from urllib.parse import quote

import msgspec

from bus.log import LogError
from events.base import canonical
from events.claim import Claim
from events.record import Move, Record
from kernel import rules
from kernel.fsutil import atomic_write, fsync_dir
from kernel.logctx import ctx
from kernel.ports import Clock, Random, blocking
from services.box.artifacts.archive import ENV_NAME, FILES_ROOT, ArchiveError, extract
from services.box.artifacts.filesmanifest import Binding, FilesManifestError, publish_manifest
from services.box.artifacts.markers import (
    GenerationMarker,
    publish_generation_marker,
    read_files_gen,
    read_generation_marker,
    read_local_gen,
    write_files_gen,
    write_local_gen,
)
from services.box.artifacts.sealing import PrivateKey
from services.box.instance.activator import purge_local_db
from services.box.instance.admission import AdmitRequest, decide_admit_writer
from services.box.instance.coverage import PublishRequest, publish_generation
from services.box.instance.guard import host_guard
from services.box.instance.instances import AlreadyRunning, Instance, Instances
from services.box.instance.proctree import ProcessTree
from services.box.instance.registry import Registry
from services.box.instance.sandbox import instance_dir
from services.box.instance.stamps import Refuse as StampRefuse
from services.box.instance.stamps import StampBook, installation_artifacts
from services.box.instance.timers import TimerError, TimerRow, Timers, timers_digest
from services.box.replica.install import InstallError, build_generation, read_install
from services.box.replica.layout import FileRef, GenerationScope, list_generation, parse_ltx_name
from services.box.replica.planner import replication_position
from services.box.replica.replicator import Replicator
from services.box.replica.restore import RestoreRefused, restore_files, restore_generation
from services.ledger.ledger import Committed, Conflict, Ledger, NoChange, Refusal
from services.move.follow import claim_half
from services.objstore.port import Got, Lost, ObjectStore, StoreError
from services.target import phases
from services.target.phases import Expect
from services.target.probe import FAST, ProbeApp, ProbeTiming, run_probe
from services.target.readiness import report_key

log = logging.getLogger("hostmove.target")

Outcome = Literal["advanced", "replayed", "done", "blocked", "rolled_back", "committed", "opened", "stopped"]


class LandingFailure(Exception):
    """A failure from ``checking`` to ``probing``: the landing rolls back (§7.6, §7.8)."""


class VersionRef(msgspec.Struct, frozen=True):
    key: str
    version_id: str


class Seal(msgspec.Struct, frozen=True):
    """The seal the source's ``staged`` and ``archived`` write in the claim's op journal (§7.3 "Seal by
    version"; ``services/source``): names relative to the lane's subprefix, each with its exact version."""

    n: int
    replica: dict[str, str]
    generation: str = ""
    timers: dict[str, str] = msgspec.field(default_factory=dict)
    files: dict[str, str] = msgspec.field(default_factory=dict)

    def ref(self, host: str, move_id: str, subprefix: str, name: str) -> VersionRef | None:
        table = {"timers/": self.timers, "files/": self.files}[subprefix]
        version = table.get(name)
        return VersionRef(staging_prefix(host, move_id) + subprefix + name, version) if version else None


class MoveJson(msgspec.Struct, frozen=True):
    """``moves/<host>/<op>/move.json`` (§7.3): create-only, written by the source before round 1."""

    move_id: str
    incarnation: str
    host: str
    to: str
    from_: str = msgspec.field(default="", name="from")


def staging_prefix(host: str, move_id: str) -> str:
    return f"moves/{quote(host, safe='.-_~@+')}/{move_id}/"


def read_seal(claim: Claim) -> Seal:
    raw = claim.op.journal.get("seal")
    if raw is None:
        raise LandingFailure("the claim's op journal carries no seal; nothing staged can be installed")
    try:
        return msgspec.convert(raw, Seal)
    except msgspec.ValidationError as exc:
        raise LandingFailure(f"the seal in the claim's op journal is malformed: {exc}") from None


def seal_files(seal: Seal, host: str, move_id: str) -> list[FileRef]:
    """The seal's replica versions as planner files; a key outside ``replica/`` of this lane is refused."""
    prefix = staging_prefix(host, move_id) + "replica/"
    out: list[FileRef] = []
    for name, version in sorted(seal.replica.items()):
        parsed = parse_ltx_name(name)
        if parsed is None or not version:
            raise LandingFailure(f"the seal names replica/{name}, which is not a versioned replica file")
        out.append(FileRef(parsed[0], parsed[1], parsed[2], prefix + name, version))
    return out


ProbeFactory = Callable[[str, int, Path], Awaitable[ProbeApp]]
"""``(host, attempt, db_path) -> app``: admits one probe attempt (§7.7)."""

Configure = Callable[[Move], Awaitable[str | None]]
"""§7.6 ``configured``: render and materialize; answers a mismatch reason or None."""


@dataclass
class ProbeInstance:
    """A probe attempt's app, entered in the box's registry of instances (:mod:`services.box.instance.instances`)
    with its writer session's replication from the moment the attempt is admitted (§7.14: replication opens after
    the admission's ``generation.json``). ``stop`` is the registry's: the app's tree is killed and drained, then
    the final sync runs and the instance leaves the registry."""

    instances: Instances
    instance: Instance
    app: ProbeApp

    @property
    def port(self) -> int:
        return self.instance.port

    async def start(self) -> bool:
        return await self.app.start()

    async def running(self) -> bool:
        return await self.app.running()

    async def ready(self) -> bool:
        return await self.app.ready()

    async def stop(self) -> None:
        if self.instances.get(self.instance.host) is not self.instance:
            await self.app.stop()  # handed over or stopped already: only make sure the app's tree is gone
            return
        try:
            await self.instances.stop(self.instance.host)
        except Exception as exc:  # logged: the marker it left makes the next stop or wake flush what did not ship
            log.warning("final sync of the probe's session failed: %s", exc,
                        extra=ctx(host=self.instance.host, phase="probe", reason=exc))


@dataclass
class TargetBox:
    """The target box's identity, ports and local stores."""

    label: str
    region: str
    box_dir: Path
    data_store: ObjectStore
    data_bucket: str
    ledger: Ledger
    registry: Registry
    stamps: StampBook
    timers: Timers
    clock: Clock
    rng: Random
    private_key: PrivateKey
    probe_factory: ProbeFactory
    probe_timing: ProbeTiming = FAST
    configure: Configure | None = None
    sync_interval_s: float = 1.0
    tree: ProcessTree | None = None  # the box's process tree: a restarted landing drains what a dead one left
    instances: Instances = field(default_factory=Instances)
    """The box's one registry of running instances (the agent passes the activator's)."""
    release_budget_ms: int = phases.ROLLBACK_RELEASE_MS
    """A rollback's ``release_deadline`` from its CAS (§7.8: 15 min; the fast profile's is shorter)."""
    flush_orphan: Callable[[str], Awaitable[int | None]] | None = None
    """§5.3 step 5 for a probe whose process is gone (the box rebooted or its agent restarted under it): capture
    its database's committed state, the WAL a killed process never checkpointed, into its generation (the agent
    passes the activator's :meth:`~services.box.instance.activator.Activator.flush_orphan`, certifying nothing: a
    probe is never the host's writer of record before the open)."""

    @property
    def data_dir(self) -> Path:
        return self.box_dir / "data"

    def instance_dir(self, host: str) -> Path:
        """``<data>/instances/<host>/`` (:func:`services.box.instance.sandbox.instance_dir`, issue 14)."""
        return instance_dir(self.data_dir, host)

    def db_path(self, host: str) -> Path:
        return self.instance_dir(host) / f"{host}.db"

    def files_dir(self, host: str) -> Path:
        return self.instance_dir(host) / host

    def env_path(self, host: str) -> Path:
        return self.instance_dir(host) / f"{host}.env"

    def journal_dir(self, host: str, move_id: str) -> Path:
        """F12: ``<box>/.moves/<host>/<op>/``."""
        return self.box_dir / ".moves" / host / move_id


@dataclass(frozen=True)
class Step:
    host: str
    outcome: Outcome
    phase: str
    detail: str = ""


@dataclass
class LandingWorker:
    box: TargetBox
    faults: Callable[[str], None] | None = None

    @property
    def running(self) -> Instances:
        """The box's instances (one registry: the landing enters its probe there and hands it over at the open)."""
        return self.box.instances

    async def stop_probe(self, host: str) -> None:
        """Stop a landing's probe of ``host`` (before the open); an instance the open handed over is not a probe."""
        instance = self.running.get(host)
        if instance is not None and instance.origin == "probe":
            try:
                await self.running.stop(host)
            except Exception as exc:  # logged: the marker it left makes the next stop or wake flush what did not ship
                log.warning("final sync of the probe's session failed: %s", exc,
                            extra=ctx(host=host, box=self.box.label, phase="probe", reason=exc))

    def _fault(self, point: str) -> None:
        if self.faults is not None:
            self.faults(point)

    async def run(self, host: str, *, max_steps: int = 30) -> Step:
        """Step until the landing is open, rolled back, blocked or stopped."""
        step = Step(host, "stopped", "")
        for _ in range(max_steps):
            step = await self.step(host)
            if step.outcome not in ("advanced", "replayed", "committed"):
                return step
        return step

    async def step(self, host: str) -> Step:
        led = self.box.ledger
        claim = (await led.read_claim(host)).state
        record = (await led.read_record(host)).state
        move = record.move if record is not None else None
        if move is None or claim is None or record is None:
            return Step(host, "stopped", "", "the record carries no move")
        expect = Expect(move.id, move.incarnation, self.box.label)
        if claim.op.id == move.id and claim.op.kind == "moving" and move.state == "landing":
            await self._follow(host, record)
            return Step(host, "advanced", move.landing_phase, "the claim followed the flip")
        if move.state == "committed":
            return await self._open(host, claim, record, move, expect)
        if move.state != "landing":
            return Step(host, "stopped", move.landing_phase, f"the move is {move.state}")
        why = phases.claim_refusal(claim, expect)
        if why is not None:
            return Step(host, "blocked", move.landing_phase, why)
        now = self.box.clock.now_ms()
        if move.landing_deadline is not None and now > move.landing_deadline:
            return await self._rollback(host, expect, "the landing deadline passed before the target was ready")
        phase = move.landing_phase
        if phase == "":
            return await self._enter(host, expect, "checking")
        if phase == "probed":
            return await self._commit(host, expect, move)
        self._fault(f"before_effects:{phase}")
        try:
            sha = await self._effects(phase, host, claim, move, expect)
        except LandingFailure as exc:
            return await self._rollback(host, expect, str(exc))
        self._fault(f"after_effects:{phase}")
        nxt = phases.next_phase(phase)
        assert nxt is not None
        return await self._enter(host, expect, nxt, installed_db_sha256=sha if nxt == "probing" else "")

    # -- journal ---------------------------------------------------------------------------------

    async def _enter(self, host: str, expect: Expect, phase: str, *, installed_db_sha256: str = "") -> Step:
        clock = self.box.clock
        out = await self.box.ledger.transition(
            "record", host, f"landing-{phase}",
            lambda r: phases.decide_enter(r, expect, phase, clock.now_ms(), installed_db_sha256=installed_db_sha256),
        )
        if isinstance(out, Committed):
            log.info("landing %s %s: journaled %s", host, expect.move_id, phase,
                     extra=ctx(host=host, op_id=expect.move_id, box=self.box.label, phase="landing", step=phase))
            return Step(host, "advanced", phase)
        if isinstance(out, NoChange):
            return Step(host, "replayed", phase, out.reason)
        reason = out.reason if isinstance(out, Refusal) else "another writer changed the record"
        return Step(host, "blocked", phase, reason)

    async def _follow(self, host: str, record: Record) -> None:
        out = await self.box.ledger.transition("claim", host, "claim-follows-record", lambda c: claim_half(c, record))
        if isinstance(out, Refusal):
            log.warning("claim of %s does not follow its record: %s", host, out.reason,
                        extra=ctx(host=host, box=self.box.label, phase="landing", reason=out.reason))

    async def _rollback(self, host: str, expect: Expect, reason: str) -> Step:
        await self.stop_probe(host)
        now = self.box.clock.now_ms()
        release_ms = self.box.release_budget_ms
        out = await self.box.ledger.transition(
            "record", host, "landing-failed",
            lambda r: phases.decide_rollback(r, expect, reason, now, release_ms),
        )
        if isinstance(out, Committed):
            log.warning("landing %s %s rolls back: %s", host, expect.move_id, reason,
                        extra=ctx(host=host, op_id=expect.move_id, box=self.box.label, phase="rollback", reason=reason))
            await self._follow(host, out.state)
            return Step(host, "rolled_back", "", reason)
        detail = out.reason if isinstance(out, NoChange | Refusal) else "another writer changed the record"
        return Step(host, "blocked", "", f"{reason}; the rollback was not recorded: {detail}")

    # -- commit and open (§7.9) -------------------------------------------------------------------

    async def _commit(self, host: str, expect: Expect, move: Move) -> Step:
        now = self.box.clock.now_ms()
        bound = phases.commit_bound(move)
        if bound is not None and now > bound and rules.on("commit-deadline"):
            return await self._rollback(host, expect, "the cut deadline passed before the commit")
        clock = self.box.clock  # the time is read inside the decision, so a CAS retry cannot commit late
        out = await self.box.ledger.transition("record", host, "commit",
                                               lambda r: phases.decide_commit(r, expect, clock.now_ms()))
        if isinstance(out, Committed):
            await self._follow(host, out.state)
            return Step(host, "committed", "probed")
        detail = out.reason if isinstance(out, NoChange | Refusal) else "another writer changed the record"
        return Step(host, "blocked", "probed", detail)

    async def _open(self, host: str, claim: Claim, record: Record, move: Move, expect: Expect) -> Step:
        if move.opened_at is not None:
            self.running.hand_over(host)
            return Step(host, "done", "probed", "the target is open")
        if claim.op.id == move.id and claim.op.phase != "committed":
            await self._follow(host, record)
            claim_now = (await self.box.ledger.read_claim(host)).state
            if claim_now is None:
                return Step(host, "blocked", "probed", "the host has no claim")
            claim = claim_now
        why = phases.claim_refusal(claim, expect, committed=True)
        if why is not None:
            return Step(host, "blocked", "probed", why)
        row = self.box.registry.get(host)
        if not self.box.registry.leave_hold(host, move.id) and (row is None or row.hold_op not in ("", move.id)):
            return Step(host, "blocked", "probed", "the route is held by another operation; the target is not opened")
        self.running.hand_over(host)  # the probe is the box's instance now, like one a wake started (§7.9)
        self._fault("open:after_leave_hold")
        now = self.box.clock.now_ms()
        out = await self.box.ledger.transition("record", host, "opened",
                                               lambda r: phases.decide_opened(r, expect, now))
        if isinstance(out, Committed | NoChange):
            return Step(host, "opened", "probed")
        detail = out.reason if isinstance(out, Refusal) else "another writer changed the record"
        return Step(host, "blocked", "probed", detail)

    # -- the phases' effects (§7.6) ---------------------------------------------------------------

    async def _effects(self, phase: str, host: str, claim: Claim, move: Move, expect: Expect) -> str:
        if phase == "checking":
            await self._checking(host, claim, move, expect)
        elif phase == "parking":
            await self._parking(host, claim, move)
        elif phase == "building":
            await self._building(host, claim, move)
        elif phase == "published":
            pass  # the journal records it; generation.json is the probe admission's (R10-3)
        elif phase == "local":
            await self._local(host, claim, move)
        elif phase == "configured":
            if self.box.configure is not None:
                mismatch = await self.box.configure(move)
                if mismatch:
                    raise LandingFailure(f"configuration changed during the move: {mismatch}")
        elif phase == "restored":
            return await self._restored(host, claim, move)
        elif phase == "probing":
            await self._probing(host, move)
        else:
            raise LandingFailure(f"the journal names an unknown landing phase {phase!r}")
        return ""

    async def _checking(self, host: str, claim: Claim, move: Move, expect: Expect) -> None:
        led = self.box.ledger
        evidence = move.source.evidence
        if not evidence or not isinstance(await led.store.head(led.bucket, evidence), Got):
            raise LandingFailure("the source's stop evidence is missing; the landing cannot start without it")
        out = await led.transition("claim", host, "touch-target",
                                   lambda c: phases.decide_touch(c, expect, self.box.region))
        if isinstance(out, Refusal | Conflict):
            raise LandingFailure(f"this box could not be added to the claim's touched set: "
                                 f"{out.reason if isinstance(out, Refusal) else 'the claim kept changing'}")
        got = await self.box.data_store.get(self.box.data_bucket, staging_prefix(host, move.id) + "move.json")
        if not isinstance(got, Got):
            raise LandingFailure("the staging lane has no move.json; nothing was staged for this move here")
        try:
            staged = msgspec.json.decode(got.body, type=MoveJson)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise LandingFailure(f"the staging lane's move.json is malformed: {exc}") from None
        if (staged.move_id, staged.incarnation, staged.host) != (move.id, move.incarnation, host):
            raise LandingFailure("the staging lane's move.json belongs to another move or incarnation")
        async with host_guard(self.box.box_dir, host, lambda: self._read_claim(host), clock=self.box.clock) as guarded:
            decision = self.box.stamps.init_record(guarded, self.box.label)
        if isinstance(decision, StampRefuse):
            raise LandingFailure(f"this box cannot record the installation stamp: {decision.reason}")
        if not self.box.registry.hold(host, "landing", move.id, incarnation=move.incarnation):
            raise LandingFailure("the route is held by another operation on this box")
        self.box.journal_dir(host, move.id).mkdir(parents=True, exist_ok=True)

    async def _read_claim(self, host: str) -> Claim | None:
        return (await self.box.ledger.read_claim(host)).state

    async def _parking(self, host: str, claim: Claim, move: Move) -> None:
        """Bucket-park whatever is at ``holder.location`` into ``superseded/<host>/<op>/`` (an earlier
        stay). The manifest (create-only) is written before any delete; a replay deletes its set."""
        assert claim.holder is not None
        await park_location(self.box.data_store, self.box.data_bucket, claim.holder.location,
                            f"superseded/{quote(host, safe='.-_~@+')}/{move.id}/")

    def _build_db(self, host: str, move_id: str) -> Path:
        return self.box.journal_dir(host, move_id) / "build.db"

    async def _restore_seal(self, host: str, claim: Claim, move: Move) -> Path:
        seal = read_seal(claim)
        dest = self._build_db(host, move.id)
        dest.parent.mkdir(parents=True, exist_ok=True)
        for path in (dest, Path(f"{dest}-wal"), Path(f"{dest}-shm")):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        try:
            await restore_files(self.box.data_store, self.box.data_bucket, seal_files(seal, host, move.id), dest,
                                required_txid=seal.n)
        except RestoreRefused as exc:
            raise LandingFailure(f"the staged replica does not restore: {exc}") from None
        return dest

    async def _building(self, host: str, claim: Claim, move: Move) -> None:
        """Restore the sealed versions, then the shared install routine (intent, snapshot, anchor,
        ``install.json``); complete only when ``install.json`` exists (§7.6 ``building``)."""
        assert claim.holder is not None
        location = claim.holder.location
        if await read_install(self.box.data_store, self.box.data_bucket, location, move.id) is not None:
            if self._build_db(host, move.id).exists():
                return
        seal = read_seal(claim)
        db = await self._restore_seal(host, claim, move)
        self._fault("building:restored")
        try:
            await build_generation(self.box.data_store, self.box.data_bucket, location, move.id, host, db,
                                   seal.n, self.box.clock)
        except InstallError as exc:
            raise LandingFailure(f"the generation could not be built: {exc}") from None

    async def _local(self, host: str, claim: Claim, move: Move) -> None:
        """Retire an earlier stay's artifacts, extract files and ``.env``, ``ReplaceTimers``, the prepared files
        manifest of ``g-<move>`` (L17), the carried columns, fsync, then ``.files-gen`` last (§7.6 ``local``; each
        sub-step journaled, F12)."""
        files_dir = self.box.files_dir(host)
        done = read_files_gen(files_dir) if files_dir.exists() else None
        if done is not None and (done.op, done.incarnation) == (move.id, move.incarnation):
            return
        seal = read_seal(claim)
        journal = _LocalJournal(self.box.journal_dir(host, move.id) / "local.json")
        data = self.box.data_dir
        self.box.instance_dir(host).mkdir(parents=True, exist_ok=True)
        if not journal.done("retired"):
            parked = data / ".parked" / f"superseded-{move.id}"
            for path in (self.box.db_path(host), Path(f"{self.box.db_path(host)}-wal"),
                         Path(f"{self.box.db_path(host)}-shm"), self.box.db_path(host).with_suffix(".gen"),
                         files_dir, self.box.env_path(host)):
                if os.path.lexists(path):
                    parked.mkdir(parents=True, exist_ok=True)
                    os.rename(path, parked / path.name)
            fsync_dir(data)
            journal.mark("retired")
        await self._tag_installation(host)
        if not journal.done("extracted"):
            archive_ref = seal.ref(host, move.id, "files/", "archive.sealed")
            manifest_ref = seal.ref(host, move.id, "files/", "manifest.json")
            if archive_ref is None or manifest_ref is None:
                raise LandingFailure("the seal names no files archive")
            sealed = await self._get_version(archive_ref)
            manifest = await self._get_version(manifest_ref)
            scratch = self.box.journal_dir(host, move.id) / "extract"
            if scratch.exists():
                shutil.rmtree(scratch)
            try:
                await blocking(extract, sealed, manifest, self.box.private_key, scratch,
                                        expect_op=move.id, expect_incarnation=move.incarnation)
            except (ArchiveError, ValueError) as exc:
                raise LandingFailure(f"the files archive does not open on this box: {exc}") from None
            if os.path.lexists(files_dir):
                shutil.rmtree(files_dir)
            os.rename(scratch / FILES_ROOT, files_dir)
            if (scratch / ENV_NAME).exists():
                os.rename(scratch / ENV_NAME, self.box.env_path(host))
            fsync_dir(data)
            journal.mark("extracted")
        if not journal.done("timers"):
            timers_ref = seal.ref(host, move.id, "timers/", "timers.json")
            if timers_ref is None:
                raise LandingFailure("the seal names no timers snapshot")
            try:
                rows = msgspec.json.decode(await self._get_version(timers_ref), type=list[TimerRow])
            except (msgspec.DecodeError, msgspec.ValidationError, TimerError) as exc:
                raise LandingFailure(f"the timers snapshot cannot be read: {exc}") from None
            if move.source.timers_sha256 and timers_digest(rows) != move.source.timers_sha256:
                raise LandingFailure("the staged timers snapshot differs from the digest the source's evidence took")
            try:
                # §9.4 ReplaceTimers with the snapshot's bookkeeping (next due, completed once-timers): a timer
                # the source delivered before the cut is not delivered again here.
                self.box.timers.replace_timers(host, rows)
            except TimerError as exc:
                raise LandingFailure(f"the timers snapshot cannot be installed: {exc}") from None
            journal.mark("timers")
        if not journal.done("manifest"):  # L17: the prepared manifest of g-<move>, before .files-gen (§7.6, §8.3)
            assert claim.holder is not None
            binding = Binding(host=host, incarnation=move.incarnation, location=claim.holder.location,
                              generation=move.id, op=move.id, stamp=claim.holder.stamp, region=self.box.region)
            try:
                await publish_manifest(self.box.data_store, self.box.data_bucket, binding, files_dir,
                                       self.box.env_path(host))
            except (FilesManifestError, ArchiveError, ValueError) as exc:
                raise LandingFailure(f"the installed files could not be published as the files manifest of "
                                     f"generation {move.id}: {exc}") from None
            self._fault("local:manifest-published")
            journal.mark("manifest")
        self.box.registry.set_carried(host, replication=move.source.replication, next_due=move.source.next_due)
        write_files_gen(files_dir, move.id, move.incarnation)
        fsync_dir(files_dir)

    async def _tag_installation(self, host: str) -> None:
        """Tag what this landing installs (the database, its WAL, SHM and ``.gen``, the files) with the stamp the
        claim names, under the host guard (§6.4), before it exists: whichever way the landing ends (opened, then
        moved away; or released by a rollback before or after its probe), the ``retire-installation`` of the local
        park parks all of it, so no live copy stays on this box (§7.8 ``cleaning``, §7.9 step 3)."""
        box = self.box
        async with host_guard(box.box_dir, host, lambda: self._read_claim(host), clock=box.clock) as guarded:
            holder = guarded.claim.holder if guarded.claim is not None else None
            if holder is None:
                raise LandingFailure("the claim names no holder; nothing is installed")
            for name, path in installation_artifacts(box.db_path(host), box.files_dir(host)).items():
                box.stamps.tag(guarded, holder.incarnation, name, path, holder.stamp)

    async def _get_version(self, ref: VersionRef) -> bytes:
        got = await self.box.data_store.get(self.box.data_bucket, ref.key, version_id=ref.version_id)
        if not isinstance(got, Got):
            raise LandingFailure(f"the sealed version of {ref.key} is missing from the staging lane")
        return got.body

    async def _restored(self, host: str, claim: Claim, move: Move) -> str:
        """Verify the built database (sha256 = the manifest's, CheckDB), put it in place and write
        ``.gen``; answers the sha256 that ``probing``'s CAS records (§7.6 ``restored``)."""
        assert claim.holder is not None
        manifest = await read_install(self.box.data_store, self.box.data_bucket, claim.holder.location, move.id)
        if manifest is None:
            raise LandingFailure("building left no completed install manifest")
        db_path = self.box.db_path(host)
        build = self._build_db(host, move.id)
        if not build.exists():
            if read_local_gen(db_path) == move.id and await blocking(_check_db, db_path) == (
                manifest.db_sha256, "ok"
            ):
                return manifest.db_sha256  # a replay after the rename
            build = await self._restore_seal(host, claim, move)
        sha, integrity = await blocking(_check_db, build)
        if integrity != "ok":
            raise LandingFailure(f"the built database fails its integrity check: {integrity[:200]}")
        if sha != manifest.db_sha256:
            raise LandingFailure("the built database's sha256 differs from the install manifest's")
        for path in (db_path, Path(f"{db_path}-wal"), Path(f"{db_path}-shm")):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        db_path.parent.mkdir(parents=True, exist_ok=True)
        os.rename(build, db_path)
        fsync_dir(db_path.parent)
        write_local_gen(db_path, move.id)
        return sha

    async def _probing(self, host: str, move: Move) -> None:
        """§7.7: at most min(3, T11) attempts, bounded by the commit's deadline. Only the probe reruns
        after a crash (INV-7). Each attempt is a cold admission (§7.14) made by :meth:`_admit`."""
        await self.stop_probe(host)
        if self.box.tree is not None:  # a probe left running by a dead agent: kill and drain it first (§5.3)
            drain = await self.box.tree.reopen_and_drain(host, within_s=10.0)
            if not drain.drained:
                raise LandingFailure(f"an earlier probe of {host} did not drain: {drain.error or drain.remaining}")
        admitted = await self._t11_attempts(host, move.id)
        db_path = self.box.db_path(host)

        async def attempt(i: int) -> ProbeApp:
            generation = await self._admit(host, move)
            app = await self.box.probe_factory(host, i, db_path)
            return await self._replicated(host, move, generation, app)

        result, app = await run_probe(attempt, self.box.clock, self.box.probe_timing, t11_admitted=admitted,
                                      hard_deadline_ms=phases.commit_bound(move) if rules.on("commit-deadline")
                                      else None)
        if not result.ok or app is None:
            raise LandingFailure(result.describe())

    async def _admit(self, host: str, move: Move) -> str:
        """One probe attempt's ``AdmitWriter`` within the landing (§7.14 table, ``landing: probing``): cold
        into the prepared generation ``g-<move>`` the first time (opened once, covered by the seal); a
        restarted probe is cold into a fresh generation restored from the newest completed generation of
        the chain, declaring the dead probe's session lost (it has no certificate). Then purge, restore,
        ``.gen`` and ``generation.json`` (R10-3: the admission publishes it, never ``published``)."""
        box, led = self.box, self.box.ledger
        expect = Expect(move.id, move.incarnation, box.label)
        claim = (await led.read_claim(host)).state
        why = phases.claim_refusal(claim, expect)
        if why is not None:
            raise LandingFailure(f"the probe cannot be admitted: {why}")
        assert claim is not None and claim.holder is not None
        holder = claim.holder
        location = holder.location
        prepared_opened = any(a.generation == move.id for a in holder.admissions)
        base = await self._newest_completed(location, [a.generation for a in holder.admissions], move.id)
        if not prepared_opened:
            new_gen, coverage, remote_max = move.id, "sealed", 0
        else:
            new_gen = f"{move.id}.p{claim.gen + 1}"
            coverage = ""
            remote_max = replication_position(
                await list_generation(box.data_store, box.data_bucket, GenerationScope(location, holder.generation)))
        request = AdmitRequest(
            box=box.label, region=box.region, observed_op_id=claim.op.id, observed_phase=claim.op.phase,
            observed_kind=claim.op.kind, observed_session=holder.session, observed_generation=holder.generation,
            new_generation=new_gen, keep_stamp=True, coverage=coverage, remote_max_txid=remote_max,
        )
        out = await led.transition("claim", host, "admit-probe", lambda c: decide_admit_writer(c, request))
        if not isinstance(out, Committed):
            detail = out.reason if isinstance(out, Refusal | NoChange) else "the claim kept changing"
            raise LandingFailure(f"the probe's admission was refused: {detail}")
        async with host_guard(box.box_dir, host, lambda: self._read_claim(host), clock=box.clock) as guarded:
            stamped = box.stamps.init_record(guarded, box.label)
            admitted = guarded.claim.holder if guarded.claim is not None else None
            if not isinstance(stamped, StampRefuse) and admitted is not None:
                # the installation is this box's now, as a wake's is: the next move away parks it (§6.4, §7.9)
                for name, path in installation_artifacts(box.db_path(host), box.files_dir(host)).items():
                    box.stamps.tag(guarded, admitted.incarnation, name, path, admitted.stamp)
        if isinstance(stamped, StampRefuse):
            raise LandingFailure(f"this box cannot record the admitted stamp: {stamped.reason}")
        db_path = box.db_path(host)
        purge_local_db(db_path)
        base_manifest = await read_install(box.data_store, box.data_bucket, location, base)
        assert base_manifest is not None
        pinned = base_manifest.pinned_root() if base == move.id else None
        try:
            restored = await restore_generation(box.data_store, box.data_bucket, location, base, db_path,
                                                pinned=pinned)
        except RestoreRefused as exc:
            raise LandingFailure(f"the probe's cold restore of generation {base} failed: {exc}") from None
        manifest = base_manifest
        if new_gen != base:  # the fresh generation's first upload: its snapshot and anchor (§7.14)
            try:
                manifest = await build_generation(box.data_store, box.data_bucket, location, new_gen, host, db_path,
                                                  restored.txid, box.clock)
            except InstallError as exc:
                raise LandingFailure(f"the restarted probe's generation could not be written: {exc}") from None
            await self._probe_files(host, out.state, new_gen)
        write_local_gen(db_path, new_gen)
        current = await read_generation_marker(box.data_store, box.data_bucket, location)
        marker = GenerationMarker(
            op=new_gen, incarnation=holder.incarnation, host=host, box=box.label, installed_at=box.clock.now_ms(),
            manifest_sha256=hashlib.sha256(canonical(manifest)).hexdigest(), snapshot_key=manifest.snapshot_key,
            snapshot_version=manifest.snapshot_version, snapshot_txid=manifest.snapshot_txid,
            snapshot_crc64=manifest.snapshot_crc64,
        )
        if isinstance(await publish_generation_marker(box.data_store, box.data_bucket, location, marker,
                                                      current.etag), Lost):
            raise LandingFailure("generation.json changed under the probe's admission")
        log.info("landing %s %s: probe admitted into %s from %s", host, move.id, new_gen, base,
                 extra=ctx(host=host, op_id=move.id, box=box.label, phase="probe", generation=new_gen, base=base))
        await self._publish(host, out.state)
        return new_gen

    async def _probe_files(self, host: str, claim: Claim, generation: str) -> None:
        """L17 "every installation writes a files manifest in its new generation": a restarted probe's fresh
        generation gets the installed files' manifest before its marker. Without it ``g-<move>`` stays the host's
        newest manifest, so its ``park-generation`` waits for good and the move never closes (the crash matrix's
        kill during probing). Create-only: a replay with the same files is a replay."""
        assert claim.holder is not None
        holder = claim.holder
        binding = Binding(host=host, incarnation=holder.incarnation, location=holder.location,
                          generation=generation, op=claim.op.id, stamp=holder.stamp, region=self.box.region)
        try:
            await publish_manifest(self.box.data_store, self.box.data_bucket, binding, self.box.files_dir(host),
                                   self.box.env_path(host))
        except (FilesManifestError, ArchiveError, ValueError) as exc:
            raise LandingFailure(f"the installed files could not be published as the files manifest of the "
                                 f"restarted probe's generation {generation}: {exc}") from None

    async def _publish(self, host: str, claim: Claim) -> None:
        """``PublishGeneration`` after the probe's marker (§7.14 item 5: every cold admission publishes, a prepared
        generation's included): the source's generation stays uncovered for the commit (another region); a
        restarted probe's dead generation here gets its ``park-generation``. A refusal or an outage leaves the records
        for the next publication."""
        assert claim.holder is not None
        box = self.box
        req = PublishRequest(box=box.label, region=box.region, observed_op_id=claim.op.id,
                             observed_phase=claim.op.phase, observed_session=claim.holder.session,
                             published_generation=claim.holder.generation, now_ms=box.clock.now_ms())
        try:
            published = await publish_generation(box.ledger, host, req, causation=f"probe:{box.label}")
        except (StoreError, LogError) as exc:
            log.warning("landing %s: generation %s not published: %s", host, claim.holder.generation, exc)
            return
        if isinstance(published, Refusal):
            log.info("landing %s: generation %s not published: %s", host, claim.holder.generation, published.reason)

    async def _replicated(self, host: str, move: Move, generation: str, app: ProbeApp) -> ProbeInstance:
        """Open the admitted session's replication into ``generation`` (its position is the anchor's, §5.1
        step 7), run its loop until the app stops, and enter the attempt in the box's registry of instances."""
        box = self.box
        claim = (await box.ledger.read_claim(host)).state
        assert claim is not None and claim.holder is not None
        holder = claim.holder
        rep = await Replicator.open(box.data_store, box.data_bucket, holder.location, generation,
                                    box.db_path(host), box.clock)
        instance = Instance(host, app.port, holder.session, generation, holder.location, rep, "probe", process=app)
        instance.task = asyncio.create_task(rep.run(instance.stop, interval_s=box.sync_interval_s))
        try:
            box.instances.enter(instance)
        except AlreadyRunning:
            instance.stop.set()
            await asyncio.wait({instance.task})
            await rep.close()
            raise
        return ProbeInstance(box.instances, instance, app)

    async def _newest_completed(self, location: str, chain: list[str], prepared: str) -> str:
        """The newest generation of the admissions chain with a completed install manifest (an admitted
        writer that died before its first upload leaves an unfinished one, §7.13); the prepared one else."""
        for generation in reversed(chain):
            if generation.startswith(prepared) and await read_install(
                self.box.data_store, self.box.data_bucket, location, generation
            ) is not None:
                return generation
        return prepared

    async def _t11_attempts(self, host: str, move_id: str) -> int:
        """The attempts T11 admitted, from this box's own ``target.json``; one when there is none."""
        led = self.box.ledger
        got = await led.store.get(led.bucket, report_key(host, move_id))
        if isinstance(got, Got):
            try:
                attempts = int(msgspec.json.decode(got.body).get("t11_attempts", 1))
            except (msgspec.DecodeError, AttributeError, TypeError, ValueError):
                attempts = 1
            return max(attempts, 1)
        return 1


async def park_location(store: ObjectStore, bucket: str, location: str, park: str) -> None:
    """§7.6 ``parking`` (a landing's, and a dirty return's on the source, §7.8): copy every current version under
    ``location`` into ``<park>objects/``, write ``<park>manifest.json`` (create-only) naming them, then delete
    exactly those versions. A replay that finds the manifest deletes its set again; nothing else is touched."""
    manifest_key = park + "manifest.json"
    got = await store.get(bucket, manifest_key)
    if isinstance(got, Got):
        entries = msgspec.json.decode(got.body, type=list[VersionRef])
    else:
        prefix = location.rstrip("/") + "/"
        versions = [v for v in await store.list_versions(bucket, prefix) if v.is_latest and not v.is_delete_marker]
        if not versions:
            return
        entries = [VersionRef(v.key, v.version_id) for v in versions]
        for ref in entries:
            await store.copy(bucket, park + "objects/" + ref.key, src_bucket=bucket, src_key=ref.key,
                             src_version_id=ref.version_id)
        await store.put(bucket, manifest_key, msgspec.json.encode(entries), if_none_match=True)
        got = await store.get(bucket, manifest_key)
        if isinstance(got, Got):
            entries = msgspec.json.decode(got.body, type=list[VersionRef])
    for ref in entries:
        await store.delete(bucket, ref.key, version_id=ref.version_id)


def _check_db(path: Path) -> tuple[str, str]:
    """(sha256 of the database image, integrity_check): the install routine's measure (CheckDB)."""
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        rows = conn.execute("PRAGMA integrity_check").fetchall()
        conn.execute("BEGIN")
        data = conn.serialize()
        conn.execute("COMMIT")
    finally:
        conn.close()
    integrity = "ok" if rows == [("ok",)] else "; ".join(str(r[0]) for r in rows)
    return hashlib.sha256(data).hexdigest(), integrity


check_db = _check_db


class _LocalJournal:
    """F12: ``local``'s sub-steps, one JSON file written atomically."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.steps: list[str] = msgspec.json.decode(path.read_bytes(), type=list[str]) if path.exists() else []

    def done(self, step: str) -> bool:
        return step in self.steps

    def mark(self, step: str) -> None:
        self.steps.append(step)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(self.path, canonical(self.steps))
