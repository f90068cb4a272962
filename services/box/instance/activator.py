"""The activator: every start of an instance on a box (spec §5.1 step 9, §7.14; digest D§6 "Start order").

A start is, in this order:

1. under the host guard (an exclusive ``flock`` plus a fresh claim read, §6.4): the box must be the
   claim's ``op.exec`` while the claim is ``serving``, the route must not be held or failed, and the
   box must be able to spawn strictly (§5.3);
2. **AdmitWriter**, one claim CAS before the app starts: cold (ruling P7), into a fresh generation,
   declaring the predecessor's ``writes_lost`` unless a clean-close certificate covers it;
3. purge the local database (error-returning); restore this region's baseline (the newest generation
   on the admissions chain that holds objects; none: an empty start); write ``<host>.gen``;
4. activate the new stamp in the box's stamp record; start the app in its cgroup leaf (strict);
   readiness (the readiness path answers 200 to 399 within the window);
5. the first upload, then ``generation.json`` (conditional, §5.1 markers), then replication opens.

Failed starts follow the retry policy: five attempts under one session, the waits doubling from one
second; a serving wake's fifth failure marks the route ``failed`` (no new session until an operator
clears it). A new owner process is a new session: :meth:`Activator.adopt_running` stops an app it
finds running and the next wake re-admits.

On a stop, the activator kills and drains the tree, runs the final sync and, when every frame the app
committed is uploaded, writes the session's **clean-close certificate** ``<location>g-<gen>/closed/
<session>.json`` (If-None-Match). The next admission reads it: a certified predecessor needs no
``writes_lost``. Ruling P7 keeps certificates off in the Go system because Litestream's clean close
was unsafe (#234); this replicator's final sync is acknowledged PUTs of captured WAL frames after the
tree is empty, and the certificate is guarded by the rule ``clean-close-certificate``.

**The certificate is a stated deviation from ruling P7**, and this is its argument. P7 declares every predecessor
because a clean close could not be proven; here it is proven by three facts the box observes itself: (1) the tree is
empty (cgroup drained), so nothing commits after the final capture; (2) every committed frame was captured and its
PUT acknowledged (``final_sync``: ship, checkpoint ``TRUNCATE``, ship again, nothing pending); (3) **no upload of the
session is unsettled** (rule ``close-evidence``, :mod:`services.box.replica.uploads`): an attempt whose answer was
not seen (a timeout, a lost response, the SDK's own retry, a process that died mid-request) may still land over a
newer object under the same key, so it keeps the session uncertain, durably and for good, until a version listing
shows every attempt landed and the key's latest version is the session's own. What a clean stop misses, the flush of
a dead agent's intact disk (:meth:`Activator.flush_orphan`) covers under the same three facts: it certifies the dead
session when it shipped every committed frame and the dead process left nothing unsettled. A session that fails any
of them has no certificate and the next admission declares it, naming the remote position and the local one it last
observed. The deployment setting ``HOSTMOVE_CLEAN_CLOSE_CERTIFICATES=off`` turns the certificate off: none is written
or read, and every predecessor is declared, as P7 reads it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import aiohttp

from bus.facts import Fact, publish_alert
from bus.log import EventLog, LogError
from events.base import Durable, Ident, Millis, canonical, decode
from events.claim import Claim, WriterRef
from events.record import Rollback
from kernel import rules
from kernel.fsutil import atomic_write, fsync_dir
from kernel.ports import Clock, Random, blocking, free_port, http_status
from services.box.artifacts.archive import ArchiveError, UnsupportedEntry
from services.box.artifacts.filesmanifest import (
    Binding,
    FilesManifestError,
    FilesManifestInvalid,
    FilesRestoreRefused,
    KeepFiles,
    decide_files,
    manifest_chain,
    newest_manifest,
    publish_manifest,
    restore_files,
)
from services.box.artifacts.markers import (
    ORIGIN,
    FilesGen,
    GenerationMarker,
    Refused,
    RestoreCold,
    admission_chain,
    cold_predecessor,
    normalize,
    publish_generation_marker,
    read_files_gen,
    read_generation_marker,
    read_local_gen,
    start_check,
    write_files_gen,
    write_local_gen,
)
from services.box.instance.admission import AdmitRequest, decide_admit_writer
from services.box.instance.coverage import ROOT, PublishRequest, link_covered, publication_owed, publish_generation
from services.box.instance.guard import Guarded, host_guard
from services.box.instance.instances import Instance, Instances, unshipped_path
from services.box.instance.proctree import ProcessTree, Spawned, StrictRefused
from services.box.instance.registry import Registry, is_held
from services.box.instance.sandbox import hand_over, instance_dir, instance_env, user_for
from services.box.instance.stamps import StampBook, installation_artifacts
from services.box.replica.install import read_install
from services.box.replica.layout import GenerationScope, generation_holds_objects, list_generation, parse_ltx_name
from services.box.replica.planner import replication_position
from services.box.replica.replicator import ReplicaOptions, Replicator, SyncResult
from services.box.replica.restore import RestoreRefused, restore_generation
from services.box.replica.uploads import Uploads, uploads_path
from services.ledger.ledger import BadObject, Committed, Ledger, Refusal
from services.objstore.port import Got, Lost, ObjectStore, StoreError

log = logging.getLogger("hostmove.activator")

rules.register(
    "exec-admission",
    section="§19.2 K1, K6",
    meaning="a box wakes a host only from a fresh claim read whose op.exec names it; otherwise it does not start it",
    site="services/box/instance/activator.py Activator._refusal, the op.exec check",
)
rules.register(
    "admit-before-start",
    section="digest D§6 start order; claim 6.10, R10-1 (rev 7.11: the admitting CAS comes first)",
    meaning="the admission CAS commits before the instance starts (its restore, its app, its readiness)",
    site="services/box/instance/activator.py Activator.wake",
)
rules.register(
    "clean-close-certificate",
    section="§5.1 step 9 (certificate), D§6; deviation from ruling P7 stated in the module docstring",
    meaning="a predecessor session counts as certified only with a certificate whose max_txid is the remote max",
    site="services/box/instance/activator.py Activator._certified",
)
rules.register(
    "start-retry-marks-failed",
    section="§5.1 step 9 retry policy; D§6",
    meaning="a serving wake's fifth failed start marks the route failed",
    site="services/box/instance/activator.py Activator.wake",
)


rules.register(
    "empty-generation-refused",
    section="§5.1 step 9 (an empty holder.generation the journal does not explain refuses the start); §7.14 item 3",
    meaning="a start whose run walk reaches the published generation and finds it empty in this region is refused "
            "and alerted, never restored to an empty database",
    site="services/box/instance/activator.py Activator._baseline",
)
rules.register(
    "final-checkpoint-after-restart",
    section="§5.3 step 5 (a final checkpoint of the local database into the box's own instances/)",
    meaning="a stop with no replicating process left flushes the local database's committed state first",
    site="services/box/instance/activator.py Activator.flush_orphan",
)
rules.register(
    "close-evidence",
    section="§5.1 step 9 (Certificate), §7.14 (first upload: 'the session is uncertain for good'); R8-5, R9-5, R10-7",
    meaning="a session is certified only when every upload it sent is settled: a timed-out or retried request "
            "keeps it uncertain until a version listing shows it settled",
    site="services/box/instance/activator.py Activator.stop, Activator.flush_orphan",
)
rules.register(
    "covered-baseline-refused",
    section="§7.14 item 3 (a covered local baseline refuses and alerts); claim 6.22, R13-1",
    meaning="the run walk never restores a generation already covered (queued for retirement, or retired)",
    site="services/box/instance/activator.py Activator._baseline",
)
rules.register(
    "restore-selected-baseline",
    section="§7.14 item 3; R14-1",
    meaning="a start restores what the run walk selected: the nearest uncovered local link with an object, else "
            "the marker's generation",
    site="services/box/instance/activator.py Activator._baseline",
)
rules.register(
    "source-serves-before-stopping",
    section="§19.1 (moving: the source may spawn while cut_phase is before stopping); §5.3 strict spawns",
    meaning="a moving host is started on its source only while the record's cut has not reached stopping",
    site="services/box/instance/activator.py Activator._refusal",
)

WAL_HEADER_BYTES = 32
"""A WAL file no longer than its header holds no frame (SQLite's WAL format)."""

SOURCE_SPAWNS_IN = frozenset({"", "requested", "admitted"})
"""The cut phases before ``stopping``, in which the source still serves as usual (§19.1)."""


class Certificate(Durable, frozen=True):
    """``closed/<session>.json``: every frame the session committed is uploaded (D§6 "Certificate")."""

    __durable_root__ = True

    session: int
    box: Ident
    generation: str
    max_txid: int
    closed_at: Millis


def certificate_key(location: str, generation: str, session: int) -> str:
    return f"{GenerationScope(location, generation).prefix}closed/{session}.json"


@dataclass(frozen=True)
class AppSpec:
    """How to run an instance: ``argv`` and the environment for ``(host, data_dir, port, region)``."""

    argv: Sequence[str]
    env: Callable[[str, Path, int, str], Mapping[str, str]]
    ready_path: str = "/ready"
    ready_within_s: float = 30.0


class AppUnavailable(Exception):
    """The host's app cannot be rendered on this box (no release, one not staged, a secret that does not open):
    nothing starts and nothing changes; ``str()`` is the reason in the operator's words."""


class AppSource(Protocol):
    """Renders the :class:`AppSpec` of a host from its claim (the host's app release, issue 18:
    :class:`services.apps.box.BoxApps`); raises :class:`AppUnavailable`."""

    async def spec(self, claim: Claim) -> AppSpec: ...


@dataclass(frozen=True)
class StartPolicy:
    attempts: int = 5
    first_backoff_s: float = 1.0
    sync_interval_s: float = 1.0
    drain_within_s: float = 10.0
    certificates: bool = field(default_factory=lambda: certificates_enabled(os.environ))
    """Clean-close certificates (the stated deviation from ruling P7, module doc). Off
    (``HOSTMOVE_CLEAN_CLOSE_CERTIFICATES=off``): none is written or read, so every predecessor is declared, as P7
    reads it."""
    ready_within_s: float | None = None
    """The readiness window of each start, when it is not the app's (a fast profile's recovery probe, §7.8)."""


CERTIFICATES_SETTING = "HOSTMOVE_CLEAN_CLOSE_CERTIFICATES"


def certificates_enabled(env: Mapping[str, str]) -> bool:
    """``HOSTMOVE_CLEAN_CLOSE_CERTIFICATES``: ``on`` (the default) or ``off``; anything else is refused."""
    text = (env.get(CERTIFICATES_SETTING) or "on").strip().lower()
    if text not in ("on", "off"):
        raise ValueError(f"{CERTIFICATES_SETTING} must be on or off, not {text!r}")
    return text == "on"


@dataclass(frozen=True)
class Started:
    host: str
    session: int
    generation: str
    baseline: str | None  # the generation restored from (None: an empty start)
    restored_txid: int
    port: int
    pid: int
    writes_lost: bool


@dataclass(frozen=True)
class StartRefused:
    """Nothing was started and nothing changed; ``reason`` is in the operator's words."""

    host: str
    reason: str


@dataclass(frozen=True)
class StartFailed:
    host: str
    reason: str
    attempts: int
    marked_failed: bool


@dataclass
class BoxContext:
    """What a box's activator holds: its identity, its ports and its local stores."""

    label: str
    region: str
    box_dir: Path
    data_bucket: str
    data_store: ObjectStore
    ledger: Ledger
    tree: ProcessTree
    registry: Registry
    stamps: StampBook
    clock: Clock
    rng: Random
    instances: Instances = field(default_factory=Instances)
    """The box's one registry of running instances, whatever started them (:mod:`.instances`)."""

    @property
    def data_dir(self) -> Path:
        return self.box_dir / "data"

    def instance_dir(self, host: str) -> Path:
        """``<data>/instances/<host>/``: every file of the host's instance, its own user's (issue 14)."""
        return instance_dir(self.data_dir, host)

    def db_path(self, host: str) -> Path:
        return self.instance_dir(host) / f"{host}.db"

    def files_dir(self, host: str) -> Path:
        return self.instance_dir(host) / host

    def env_path(self, host: str) -> Path:
        return self.instance_dir(host) / f"{host}.env"


def purge_local_db(db_path: Path) -> None:
    """Remove the local database, its WAL, SHM, ``.gen`` and ``.unshipped`` (step 3: error-returning)."""
    for path in (db_path, Path(f"{db_path}-wal"), Path(f"{db_path}-shm"), db_path.with_suffix(".gen"),
                 unshipped_path(db_path), uploads_path(db_path)):
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


class Activator:
    def __init__(self, ctx: BoxContext, app: AppSpec | AppSource, policy: StartPolicy | None = None) -> None:
        self.ctx = ctx
        self.app = app
        """A fixed app for every host, or the source that renders each host's from its release (every start)."""
        self.policy = policy or StartPolicy()
        self._specs: dict[str, AppSpec] = {}
        self._flushing = asyncio.Lock()  # the box's passes run concurrently (issue 19 item 3): one flush at a time

    async def app_spec(self, claim: Claim) -> AppSpec:
        """The app ``claim``'s host starts as on this box (:class:`AppUnavailable` when it cannot)."""
        return self.app if isinstance(self.app, AppSpec) else await self.app.spec(claim)

    def _spec(self, host: str) -> AppSpec:
        spec = self._specs.get(host)
        if spec is None:
            assert isinstance(self.app, AppSpec), "a rendered app is resolved by wake() before any start"
            return self.app
        return spec

    @property
    def running(self) -> Instances:
        """The box's instances (the context's one registry: a landing's are here too)."""
        return self.ctx.instances

    # -- reads ------------------------------------------------------------------------------------

    async def _read_claim(self, host: str) -> Claim | None:
        return (await self.ctx.ledger.read_claim(host)).state

    def _refusal(self, claim: Claim | None, host: str, cut_phase: str | None = None,
                 rollback: Rollback | None = None) -> str | None:
        """Why this box may not start ``host`` now (the decide step), or None. A ``moving`` host is started as
        usual while its cut has not reached ``stopping`` (§19.1 "source may spawn"; ``cut_phase`` is the
        record's, read under the guard)."""
        if claim is None or claim.holder is None:
            return f"{host} has no claim holder; nothing may start"
        row = self.ctx.registry.get(host)
        recovery_probe = False
        if claim.op.kind == "moving" and rules.on("source-serves-before-stopping"):
            if cut_phase not in SOURCE_SPAWNS_IN:
                return f"{host} is being cut ({cut_phase or 'no move in the record'}); the source does not start it"
        elif claim.op.kind == "reverting":  # §7.4 reverting: the recovery's probe under its own hold, then open
            phase = claim.op.journal.get("rev_phase")
            if phase not in ("probing", "probed", "opened"):
                return f"{host} is reverting and its recovery has not reached its probe"
            if phase != "opened" and (row is None or row.status != "restoring" or row.hold_op != claim.op.id):
                return f"{host} is reverting but its route is not held restoring by {claim.op.id}"
            recovery_probe = phase != "opened"
        elif claim.op.kind == "restoring":  # §7.8: the source's recovery probe under the rollback's hold, then open
            phase = rollback.source_phase if rollback is not None else ""
            if rollback is None or phase not in ("probing", "probed", "recovered", "opened"):
                return f"{host} is rolling back and its source recovery has not reached its probe"
            held = phase != "opened"
            if held and (row is None or row.status != "restoring" or row.hold_op != rollback.id):
                return f"{host} is rolling back but its route is not held restoring by {rollback.id}"
            recovery_probe = held
        elif claim.op.kind == "relocating":  # §7.10: the replacement box installs once the relocation chose it
            if claim.op.phase != "installing":
                return f"{host} is relocating ({claim.op.phase}): no box holds it yet"
        elif claim.op.kind != "serving":
            return f"{host} is {claim.op.kind}; only a serving host is woken here"
        if rules.on("exec-admission") and claim.op.exec != self.ctx.label:
            return f"{host} is served by {claim.op.exec}, not by this box ({self.ctx.label})"
        if claim.op.kind == "serving":  # K3, K4: execution never goes from one box to another directly
            holder = claim.holder
            last = holder.admissions[-1].box if holder.admissions else holder.writer_box
            if last and last != self.ctx.label and last not in {lost.box for lost in claim.lost}:
                return (f"{host} names this box ({self.ctx.label}) as its writer, but its last writer was {last} and "
                        "no move or relocation handed it over; it is not started here until its claim is put right")
        if row is not None and is_held(row.status) and not recovery_probe:
            return f"{host} is held ({row.status}) by operation {row.hold_op}"
        if row is not None and row.status == "failed":
            return f"{host} failed to start and waits for an operator to clear it"
        ok, why = self.ctx.tree.strict_available()
        if not ok:
            return f"this box cannot spawn strictly: {why}"
        return None

    async def _baseline(self, claim: Claim) -> tuple[str | None, int]:
        """This region's baseline, by the run walk (§7.14 item 3, §5.1 step 9; protocol digest "Run walk"): from
        ``holder.generation`` back along the unfinished admissions to the generation ``generation.json`` names
        (absent is the origin), newest first: a link in another region is passed over; a link already covered
        (queued for retirement, or retired) refuses, with an alert (rule ``covered-baseline-refused``); the nearest
        local link holding an object is the baseline; else the marker's generation. ``(None, 0)``: an empty start."""
        holder = claim.holder
        assert holder is not None
        if not rules.on("restore-selected-baseline"):  # the mutation: the newest generation anywhere on the chain
            return await self._newest_with_objects(claim)
        marker = await read_generation_marker(self.ctx.data_store, self.ctx.data_bucket, holder.location)
        named = normalize(marker.marker.op) if marker.marker is not None else ORIGIN
        chain = admission_chain(claim)
        links = chain[: chain.index(named) + 1] if named in chain else chain[:1]
        regions = {normalize(a.generation): a.region for a in holder.admissions}
        refuse_empty = rules.on("empty-generation-refused")
        for link in links:
            if regions.get(link, self.ctx.region) != self.ctx.region:
                continue  # a foreign link: its objects are in its own region's bucket
            if link_covered(claim, self.ctx.region, link) and rules.on("covered-baseline-refused"):
                why = (f"the baseline generation {link or 'origin'} of {claim.host} is already covered (queued for "
                       "retirement or retired); this box does not restore it")
                await self._alert_baseline(claim, link, why)
                raise BaselineRefused(why)
            files = await list_generation(self.ctx.data_store, self.ctx.data_bucket,
                                          GenerationScope(holder.location, link))
            if files:
                return link, max(f.max_txid for f in files)
            if link == named and named != ORIGIN and refuse_empty:
                # the marker is written after its generation's first upload (§5.1 step 9), so a published
                # generation holding nothing is missing data no journal explains: restoring it would start empty
                why = (f"the published generation {named} of {claim.host} holds no replica file in {self.ctx.region}; "
                       "its data is missing and this box does not start the host on an empty database")
                await self._alert_baseline(claim, link, why)
                raise BaselineRefused(why)
        return None, 0

    async def _alert_baseline(self, claim: Claim, link: str, why: str) -> None:
        """One durable alert per refused baseline and session (``baseline-refused``)."""
        assert claim.holder is not None
        outbox = AlertOutbox(self.ctx.box_dir)
        outbox.add(Fact(kind="baseline-refused", subject=claim.host,
                        id=f"{claim.host}:{claim.holder.session}:{link or ROOT}", actor=self.ctx.ledger.actor,
                        at=self.ctx.clock.now_ms(), payload={"generation": link, "reason": why}))
        await outbox.flush(self.ctx.ledger.events)

    async def _newest_with_objects(self, claim: Claim) -> tuple[str | None, int]:
        """The newest generation on the admissions chain holding objects, whatever covers it (the rule's mutation)."""
        assert claim.holder is not None
        chain = [claim.holder.generation]
        for adm in reversed(claim.holder.admissions):
            for gen in (adm.generation, adm.predecessor.generation if adm.predecessor else None):
                if gen is not None and gen not in chain:
                    chain.append(gen)
        for gen in chain:
            files = await list_generation(self.ctx.data_store, self.ctx.data_bucket,
                                          GenerationScope(claim.holder.location, gen))
            if files:
                return gen, max(f.max_txid for f in files)
        return None, 0

    async def _predecessor_empty(self, claim: Claim) -> bool:
        """Does the predecessor generation (the last record's, or the holder's before any record) hold nothing at
        all? Only this region's bucket can say: a foreign predecessor counts as holding something (§7.14 item 1)."""
        holder = claim.holder
        assert holder is not None
        last = holder.admissions[-1] if holder.admissions else None
        generation = last.generation if last is not None else holder.generation
        if last is not None and last.region != self.ctx.region:
            return False
        return not await generation_holds_objects(self.ctx.data_store, self.ctx.data_bucket, holder.location,
                                                  generation)

    async def _publish(self, claim: Claim) -> None:
        """``PublishGeneration`` for the admitted session (§7.14 item 5, after the marker): the walk over the uncovered
        records queues this region's ``park-generation`` chores and covers them. A refusal (the claim moved on) or a
        store or bus outage leaves the records uncovered for the next admission's publication: logged, never a
        failed start."""
        holder = claim.holder
        assert holder is not None
        req = PublishRequest(box=self.ctx.label, region=self.ctx.region, observed_op_id=claim.op.id,
                             observed_phase=claim.op.phase, observed_session=holder.session,
                             published_generation=holder.generation, now_ms=self.ctx.clock.now_ms())
        try:
            out = await publish_generation(self.ctx.ledger, claim.host, req, causation=f"wake:{self.ctx.label}")
        except (StoreError, LogError) as exc:
            log.warning("generation %s of %s not published (the next admission publishes): %s", holder.generation,
                        claim.host, exc)
            return
        if isinstance(out, Refusal):
            log.info("generation %s of %s not published: %s", holder.generation, claim.host, out.reason)

    async def republish(self, claim: Claim | None) -> bool:
        """``PublishGeneration`` again (§7.14 "retried after the timeout"): a publication that a store or bus outage or
        a moved claim stopped left records uncovered whose predecessors are this region's and dead. Only for this box's
        own writer, and only once ``generation.json`` here names ``holder.generation`` (never for an unfinished
        start: its marker comes first). Answers whether it published."""
        if claim is None or claim.holder is None or not publication_owed(claim, self.ctx.label, self.ctx.region):
            return False
        holder = claim.holder
        current = normalize(holder.generation)
        marker = await read_generation_marker(self.ctx.data_store, self.ctx.data_bucket, holder.location)
        if marker.marker is None or normalize(marker.marker.op) != current:
            return False
        await self._publish(claim)
        return True

    async def _declare(self, claim: Claim) -> None:
        """One alert per loss declaration of the admission just made (§7.14 item 2, INV-21), after its CAS, through
        the box's durable outbox (:class:`AlertOutbox`: retried until delivered)."""
        holder = claim.holder
        assert holder is not None
        record = holder.admissions[-1] if holder.admissions else None
        if record is None:
            return
        outbox = AlertOutbox(self.ctx.box_dir)
        for ref in (record.writes_lost, *record.additional_writes_lost):
            if ref is None:
                continue
            outbox.add(Fact(kind="writes-lost", subject=claim.host, id=f"{claim.host}:{ref.box}:{ref.session}",
                            actor=self.ctx.ledger.actor, at=self.ctx.clock.now_ms(), payload={
                                "box": ref.box, "session": ref.session, "generation": ref.generation,
                                "remote_max_txid": ref.remote_max_txid, "local_txid": ref.local_txid,
                                "declared_by": {"box": record.box, "session": record.session,
                                                "generation": record.generation}}))
            log.error("writes of %s by %s session %d past TXID %d (its own copy was at %s) are declared lost by the "
                      "admission of session %d", claim.host, ref.box, ref.session, ref.remote_max_txid,
                      ref.local_txid or "an unknown position", record.session)
        await outbox.flush(self.ctx.ledger.events)

    async def flush_alerts(self) -> int:
        """Deliver what the outbox still holds (the agent's passes call it, concurrently: one flush at a time);
        answers how many are left."""
        async with self._flushing:
            return await AlertOutbox(self.ctx.box_dir).flush(self.ctx.ledger.events)

    async def _certified(self, claim: Claim, baseline: str | None, remote_max: int) -> bool:
        """Does a clean-close certificate cover the predecessor session (the last admission)?"""
        assert claim.holder is not None
        last = claim.holder.admissions[-1] if claim.holder.admissions else None
        if last is None or baseline is None or last.generation != baseline or not self.policy.certificates:
            return False
        got = await self.ctx.data_store.get(
            self.ctx.data_bucket, certificate_key(claim.holder.location, last.generation, last.session))
        if not isinstance(got, Got):
            return False
        cert = decode(got.body, Certificate)
        if not rules.on("clean-close-certificate"):
            return True
        return cert.session == last.session and cert.box == last.box and cert.max_txid == remote_max

    # -- the start --------------------------------------------------------------------------------

    async def wake(self, host: str, *, coverage: str = "", prepared: str = "", policy: StartPolicy | None = None,
                   declare: tuple[WriterRef, ...] = ()) -> Started | StartRefused | StartFailed:
        """Start ``host`` on this box: admit, then up to five attempts under that session. ``coverage`` is the
        admission's (§5.1 step 9): ``clean-return`` for a clean rollback's recovery probe (§7.8). ``prepared`` names a
        generation an install built on this box's region (a dirty rollback's ``g-<rb>``, §7.8, §7.14): the admission
        is cold **into** it, covered by its seal (``sealed``: nothing is declared), opened once, and its
        ``generation.json`` is published with the install's snapshot identity before the app starts. ``policy``: this
        wake's starts, when they are not the box's (a recovery probe's, §7.8). ``declare``: further sessions whose
        writes the admission declares lost (``additional_writes_lost``: a declared-lost target's return, §7.10)."""
        if host in self.running:
            return StartRefused(host, f"{host} is already running on this box")
        async with host_guard(self.ctx.box_dir, host, lambda: self._read_claim(host), clock=self.ctx.clock) as g:
            if host in self.running:  # again under the guard: a wake that waited for it finds the one before it ran
                return StartRefused(host, f"{host} is already running on this box")
            claim = g.claim
            cut_phase = None
            rollback = None
            if claim is not None and claim.op.kind in ("moving", "restoring"):  # §19.1; §7.8
                record = (await self.ctx.ledger.read_record(host)).state
                move = record.move if record is not None else None
                cut_phase = move.cut_phase if move is not None and move.id == claim.op.id else "unknown"
                rollback = move.rollback if move is not None and move.id == claim.op.id else None
            reason = self._refusal(claim, host, cut_phase, rollback)
            if reason is not None:
                return StartRefused(host, reason)
            assert claim is not None and claim.holder is not None
            try:  # rendered before the admission: a host this box cannot render burns no session
                self._specs[host] = await self.app_spec(claim)
            except AppUnavailable as exc:
                return StartRefused(host, str(exc))
            # A stop whose final sync failed (an idle stop, a shutdown) left commits only on this disk: flush them
            # into the holder's generation before the admission's purge (§5.3 step 5), or they would be declared lost.
            flushed = await self.flush_orphan(host)
            baseline: str | None
            if prepared:
                baseline, remote_max, certified, generation, coverage = prepared, 0, False, prepared, "sealed"
            else:
                baseline, remote_max = await self._baseline(claim)
                certified = await self._certified(claim, baseline, remote_max)
                generation = "w" + self.ctx.rng.token_bytes(8).hex()
            request = AdmitRequest(
                box=self.ctx.label, region=self.ctx.region, observed_op_id=claim.op.id,
                observed_phase=claim.op.phase, observed_kind=claim.op.kind,
                observed_session=claim.holder.session, observed_generation=claim.holder.generation,
                new_generation=generation, remote_max_txid=remote_max, predecessor_certified=certified,
                coverage=coverage, predecessor_holds_nothing=await self._predecessor_empty(claim),
                local_txid=flushed or 0, additional_writes_lost=declare,
            )
            early: Started | StartFailed | None = None
            if not rules.on("admit-before-start"):  # the mutation (rev 7.10's order): the app starts, then admits
                early = await self._attempts(g, claim, baseline, publish_files=not prepared, policy=policy)
            admitted = await self.ctx.ledger.transition(
                "claim", host, "admit-writer", lambda cur: decide_admit_writer(cur, request),
                causation=f"wake:{self.ctx.label}",
            )
            if not isinstance(admitted, Committed):
                why = admitted.reason if isinstance(admitted, Refusal) else "the claim changed; wake again"
                return StartRefused(host, why)
            await self._declare(admitted.state)
            if not rules.on("baseline-live"):  # the mutation: rev 7.10's chore at the admission, before the marker
                await self._publish(admitted.state)
            g.claim = admitted.state
            self.ctx.stamps.init_record(g, self.ctx.label)
            if prepared:
                refused = await self._publish_prepared(admitted.state, prepared)
                if refused is not None:
                    return StartFailed(host, refused, 0, False)
            if early is not None:
                return early
            return await self._attempts(g, admitted.state, baseline, publish_files=not prepared, policy=policy)

    async def _publish_prepared(self, claim: Claim, prepared: str) -> str | None:
        """``generation.json`` naming the prepared generation, with its install manifest's snapshot identity, after
        the admission's CAS and before the app starts (§7.14; as the landing's probe does). Why not, or None."""
        assert claim.holder is not None
        holder, ctx = claim.holder, self.ctx
        manifest = await read_install(ctx.data_store, ctx.data_bucket, holder.location, prepared)
        if manifest is None:
            return f"the prepared generation {prepared} has no completed install manifest"
        current = await read_generation_marker(ctx.data_store, ctx.data_bucket, holder.location)
        marker = GenerationMarker(
            op=prepared, incarnation=holder.incarnation, host=claim.host, box=ctx.label,
            installed_at=ctx.clock.now_ms(), manifest_sha256=hashlib.sha256(canonical(manifest)).hexdigest(),
            snapshot_key=manifest.snapshot_key, snapshot_version=manifest.snapshot_version,
            snapshot_txid=manifest.snapshot_txid, snapshot_crc64=manifest.snapshot_crc64)
        published = await publish_generation_marker(ctx.data_store, ctx.data_bucket, holder.location, marker,
                                                    current.etag)
        return "generation.json changed under the admission" if isinstance(published, Lost) else None

    async def _attempts(self, g: Guarded, claim: Claim, baseline: str | None, *, publish_files: bool = True,
                        policy: StartPolicy | None = None) -> Started | StartFailed:
        """Up to five starts under the admitted session. ``publish_files`` False: the generation's files manifest is
        the install's prepared one (a dirty return's ``g-<rb>``, §7.6 ``local``), never a session's."""
        assert claim.holder is not None
        host = g.host
        last_error = ""
        starts = policy or self.policy
        restored = _Restored()
        for attempt in range(1, starts.attempts + 1):
            try:
                started = await self._start_once(claim, baseline, restored, publish_files=publish_files,
                                                 ready_within_s=starts.ready_within_s)
                files_dir = self.ctx.files_dir(host)
                if files_dir.exists():  # the carried files now belong to this installation (retag)
                    write_files_gen(files_dir, claim.holder.generation, claim.holder.incarnation)
                self._tag_installation(g, claim)
                return started
            except StartCheckRefused as exc:
                await self._stop_tree(host)
                return StartFailed(host, f"the start check refused: {exc}", attempt, False)
            except (RestoreRefused, StrictRefused, OSError, TimeoutError, aiohttp.ClientError, StartError) as exc:
                last_error = str(exc) or type(exc).__name__
                log.warning("start %d of %s failed: %s", attempt, host, last_error)
                await self._stop_tree(host)
                if attempt < starts.attempts:
                    await self.ctx.clock.sleep(starts.first_backoff_s * 2 ** (attempt - 1))
            except Exception:  # a store or bus error mid-start: the half-started app must not outlive it (INV-1)
                await self._stop_tree(host)
                raise
        marked = False
        if rules.on("start-retry-marks-failed"):
            marked = self.ctx.registry.set_status(host, "failed")
        return StartFailed(host, last_error, starts.attempts, marked)

    async def _start_once(self, claim: Claim, baseline: str | None, restored: _Restored, *,
                          publish_files: bool = True, ready_within_s: float | None = None) -> Started:
        """One start attempt of the admitted session. The first attempt purges the local database and restores the
        baseline; a later attempt of the same admission keeps the database an earlier one restored and ran the app
        on (``restored``), since what that app committed, its background rows and timer runs included, is this
        session's (§5.3 step 5: nothing acknowledged stays only on this disk or is dropped). Purging it lost those
        commits without a declaration, and a new host's second attempt found its ``instance.key`` with no record."""
        holder = claim.holder
        assert holder is not None
        host, ctx = claim.host, self.ctx
        db = ctx.db_path(host)
        ctx.instance_dir(host).mkdir(parents=True, exist_ok=True)
        await self._files_step(claim, baseline)
        options: ReplicaOptions | None = None
        if restored.kept(db, holder.generation):
            restored_txid = restored.txid or 0
            # the earlier attempt's uploads may still land: the first full file covers their ranges (flush_orphan)
            in_flight = Uploads.open(db, holder.generation).level0_ranges()
            cover = (min(r[0] for r in in_flight), max(r[1] for r in in_flight)) if in_flight else None
            options = ReplicaOptions(flush_first=True, cover=cover)
        else:
            purge_local_db(db)
            restored_txid = 0
            if baseline is not None:
                result = await restore_generation(ctx.data_store, ctx.data_bucket, holder.location, baseline, db)
                restored_txid = result.txid
            write_local_gen(db, holder.generation)
            restored.txid = restored_txid
        await self._start_check(claim)
        port = free_port()
        logs = ctx.box_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True, mode=0o700)  # the platform's: no instance lists or reads them
        app = self._spec(host)
        env = instance_env(app.env(host, ctx.instance_dir(host), port, ctx.region), home=ctx.files_dir(host))
        await blocking(hand_over, user_for(ctx.tree, host), ctx.instance_dir(host), host)
        spawned = await blocking(
            ctx.tree.spawn_strict, host, list(app.argv), env=env, cwd=str(ctx.box_dir),
            stdout=logs / f"{host}.out", stderr=logs / f"{host}.err",
        )
        await self._ready(port, spawned, logs / f"{host}.err", app, ready_within_s)
        # The files manifest before the generation's first upload: a generation that holds data always has a
        # manifest to restore its files from after a lost disk (L17; the simulation's lost disk found a first wake
        # that died between its first upload and its manifest, which left the host unstartable for good).
        if publish_files:
            await self._publish_files(claim)
        replicator = await Replicator.open(ctx.data_store, ctx.data_bucket, holder.location, holder.generation, db,
                                           ctx.clock, options=options)
        try:
            first = await replicator.sync()
            if options is not None:
                await self._supersede_covered(replicator, first, options.cover)
            current = await read_generation_marker(ctx.data_store, ctx.data_bucket, holder.location)
            marker = GenerationMarker(op=holder.generation, incarnation=holder.incarnation, host=host,
                                      box=ctx.label, installed_at=ctx.clock.now_ms(),
                                      snapshot_txid=restored_txid)
            published = await publish_generation_marker(ctx.data_store, ctx.data_bucket, holder.location, marker,
                                                        current.etag)
            if isinstance(published, Lost):
                raise StartError("generation.json changed under this start; the claim is re-read on the next wake")
        except BaseException:
            await replicator.close()
            raise
        if rules.on("baseline-live"):  # only now, with the marker naming the new generation (R10-2)
            await self._publish(claim)
        running = Instance(host, port, holder.session, holder.generation, holder.location, replicator, "wake")
        running.task = asyncio.create_task(replicator.run(running.stop, interval_s=self.policy.sync_interval_s))
        self.running.enter(running)
        writes_lost = bool(holder.admissions and holder.admissions[-1].writes_lost is not None)
        return Started(host, holder.session, holder.generation, baseline, restored_txid, port, spawned.pid,
                       writes_lost)

    async def _files_step(self, claim: Claim, baseline: str | None) -> None:
        """Before the app starts (L17, §7.6 "Files reachability"): a missing files directory, or a stale one of
        this incarnation (parked, never deleted: §6.3, INV-8), comes back from the newest files manifest on the
        admitted chain, tagged with the cold predecessor the start check accepts. Missing or malformed manifest
        data is never an empty-files bootstrap: only a host that never replicated anything, or a box that kept its
        local database (its disk was not lost) and has no files directory, starts without one."""
        holder = claim.holder
        assert holder is not None
        host, ctx = claim.host, self.ctx
        files_dir, env_file = ctx.files_dir(host), ctx.env_path(host)
        exists = os.path.lexists(files_dir)
        decision = decide_files(claim, exists, read_files_gen(files_dir) if exists else None, box=ctx.label)
        if isinstance(decision, KeepFiles):
            return
        try:
            found = await newest_manifest(ctx.data_store, ctx.data_bucket, holder.location, manifest_chain(claim))
        except FilesManifestInvalid as exc:
            raise StartCheckRefused(f"{decision.reason}, and its files manifest cannot be used: {exc}") from None
        if found is None:
            if not exists and (baseline is None or ctx.db_path(host).exists()):
                # A first installation, or a box that kept its disk and never had files: nothing was lost. The
                # directory the app will write is this installation's from the start, so a start that fails before
                # its first manifest leaves files the next admission keeps (its cold predecessor), not "an
                # earlier stay" that has no manifest to come back from.
                files_dir.mkdir(parents=True, exist_ok=True)
                write_files_gen(files_dir, normalize(holder.generation), holder.incarnation)
                return
            raise StartCheckRefused(f"{decision.reason}, and no files manifest exists on the host's admitted "
                                    "generations; its files are never started empty")
        if decision.park:
            parked = ctx.data_dir / ".parked" / f"superseded-{holder.generation}"
            parked.mkdir(parents=True, exist_ok=True)
            for path in (files_dir, env_file):
                if os.path.lexists(path):
                    os.rename(path, parked / path.name)
            fsync_dir(ctx.instance_dir(host))
        predecessor = cold_predecessor(claim)
        tag = FilesGen(op=normalize(holder.generation) if predecessor is None else predecessor,
                       incarnation=holder.incarnation)
        try:
            restored = await restore_files(ctx.data_store, ctx.data_bucket, found.manifest, region=ctx.region,
                                           files_dir=files_dir, env_file=env_file, tag=tag)
        except FilesRestoreRefused as exc:
            raise StartCheckRefused(f"{decision.reason}; its files could not be restored: {exc}") from None
        log.info("restored the files of %s from the manifest of generation %s (%d files): %s", host,
                 restored.generation, restored.files, decision.reason)

    async def _publish_files(self, claim: Claim) -> None:
        """L17 "every installation writes a files manifest in its new generation": publish the started
        installation's files directory and ``.env`` as ``holder.generation``'s first manifest, before
        ``.files-gen`` names it (§7.6, §8.3). A file the archive rules refuse (M-C14) does not stop a serving
        wake: it is logged, and the newest earlier manifest stays the files' durable copy."""
        holder = claim.holder
        assert holder is not None
        ctx = self.ctx
        binding = Binding(host=claim.host, incarnation=holder.incarnation, location=holder.location,
                          generation=holder.generation, op=f"session:{holder.session}", stamp=holder.stamp,
                          region=ctx.region)
        try:
            await publish_manifest(ctx.data_store, ctx.data_bucket, binding, ctx.files_dir(claim.host),
                                   ctx.env_path(claim.host))
        except UnsupportedEntry as exc:
            log.error("the files of %s have no manifest in generation %s: %s", claim.host, holder.generation, exc)
        except (FilesManifestError, ArchiveError) as exc:
            raise StartError(f"the files manifest of generation {holder.generation} could not be published: "
                             f"{exc}") from None
        # A StoreError propagates, as from the restore, the first upload and the marker: a store that does not
        # answer is not the app failing to start, so it never counts toward the five attempts that mark the route
        # failed for an operator (the simulation: a store outage at a first wake left a host failed for good).

    def installation_artifacts(self, host: str) -> dict[str, Path]:
        """The local artifacts of an installation (§6.1): the database, its WAL, SHM and ``.gen``, the files."""
        return installation_artifacts(self.ctx.db_path(host), self.ctx.files_dir(host))

    def _tag_installation(self, g: Guarded, claim: Claim) -> None:
        """Tag the installation's artifacts with its stamp (§6.4), so ``retire-installation`` parks them."""
        holder = claim.holder
        assert holder is not None
        for name, path in self.installation_artifacts(claim.host).items():
            self.ctx.stamps.tag(g, holder.incarnation, name, path, holder.stamp)

    async def _start_check(self, claim: Claim) -> None:
        """§5.1 "The start check" before every spawn (INV-4): the markers must name what the claim expects."""
        holder = claim.holder
        assert holder is not None
        ctx = self.ctx
        marker = await read_generation_marker(ctx.data_store, ctx.data_bucket, holder.location)
        files_dir = ctx.files_dir(claim.host)
        verdict = start_check(claim, marker.marker, read_files_gen(files_dir) if files_dir.exists() else None,
                              files_dir.exists(), read_local_gen(ctx.db_path(claim.host)), box=ctx.label)
        if isinstance(verdict, Refused):
            raise StartCheckRefused(verdict.reason)
        if isinstance(verdict, RestoreCold) and ctx.db_path(claim.host).exists():
            raise StartError(f"the local database does not match the claim after the restore: {verdict.reason}")

    async def _ready(self, port: int, spawned: Spawned, stderr: Path, app: AppSpec,
                     within_s: float | None = None) -> None:
        """The readiness path answers 200 to 399 within the window (S1, §7.7; ``within_s`` when given, else the
        app's). An app that exits fails the attempt at once, with the last line it wrote."""
        window = within_s or app.ready_within_s
        deadline = self.ctx.clock.monotonic() + window
        url = f"http://127.0.0.1:{port}{app.ready_path}"
        while True:
            code = spawned.process.poll()
            if code is not None:
                tail = stderr.read_text(errors="replace").strip().splitlines()[-1:] if stderr.exists() else []
                raise StartError(f"the instance exited with code {code} before it was ready"
                                 + (f": {tail[0][:300]}" if tail else ""))
            status = await http_status(url, 2.0)  # the box-local network port (ARCHITECTURE §7)
            if status is not None and 200 <= status < 400:
                return
            if self.ctx.clock.monotonic() > deadline:
                raise StartError(f"the instance did not answer {app.ready_path} within {window:.0f} s")
            await self.ctx.clock.sleep(0.1)

    # -- stopping ---------------------------------------------------------------------------------

    async def _stop_tree(self, host: str) -> None:
        drain = await self.ctx.tree.reopen_and_drain(host, within_s=self.policy.drain_within_s)
        if not drain.drained:
            raise StartError(f"the process tree of {host} did not drain: {drain.error or drain.remaining}")

    async def stop(self, host: str) -> Certificate | None:
        """Stop the instance of ``host``, whatever started it (a wake, a landing's probe, a recovery), run the final
        sync and certify the session when nothing is left behind (a landing's probe before the open is never
        certified: it is not the host's writer of record). The instance stays in :attr:`running` until its tree is
        drained and its sync loop has ended, so a stop that fails or is cancelled before that leaves it where the
        next stop (or the process's death) finds it."""
        running = self.running.get(host)
        await self._stop_tree(host)
        if running is None:
            await self.flush_orphan(host)
            return None
        clean = await self.running.stop(host)
        if not clean or running.origin == "probe" or not self.policy.certificates:
            return None
        rep = running.replicator
        uncertain = await rep.observe_uploads()
        if uncertain and rules.on("close-evidence"):
            log.warning("session %d of %s closed with %d upload(s) whose outcome no listing settled (first %s): no "
                        "certificate; the next admission declares it", running.session, host, len(uncertain),
                        uncertain[0])
            return None
        return await self._certify(running.location, running.generation, running.session, rep.position)

    async def _certify(self, location: str, generation: str, session: int, max_txid: int) -> Certificate:
        cert = Certificate(session=session, box=self.ctx.label, generation=generation, max_txid=max_txid,
                           closed_at=self.ctx.clock.now_ms())
        key = certificate_key(location, generation, session)
        await self.ctx.data_store.put(self.ctx.data_bucket, key, canonical(cert), if_none_match=True)
        return cert

    async def flush_orphan(self, host: str, *, certify: bool = True) -> int | None:
        """§5.3 step 5 when the process that replicated ``host`` is gone (an agent restarted under a running app,
        then the app was stopped): after the tree drained, capture the local database's committed state into the
        holder's generation, so nothing the app acknowledged stays only on this disk. Only for this box's own
        writer and a local database that belongs to the holder's generation. A replicator's first upload is a full
        image (every page), so no frame-to-TXID mapping of the dead process is needed. Answers the new position,
        or None when there was nothing of this box's to capture. ``certify`` False (a landing's probe, never the
        host's writer of record before the open, as :meth:`stop` has it) flushes and certifies nothing more."""
        if not rules.on("final-checkpoint-after-restart"):
            return None
        db = self.ctx.db_path(host)
        claim = await self._read_claim(host)
        if not db.exists() or claim is None or claim.holder is None:
            return None
        holder = claim.holder
        if holder.writer_box != self.ctx.label or read_local_gen(db) != holder.generation:
            return None
        wal = Path(f"{db}-wal")
        unshipped = unshipped_path(db)
        session = holder.admissions[-1].session if holder.admissions else 0
        last_here = bool(holder.admissions) and holder.admissions[-1].box == self.ctx.label and \
            normalize(holder.admissions[-1].generation) == normalize(holder.generation)
        if not unshipped.exists() and (not wal.exists() or wal.stat().st_size <= WAL_HEADER_BYTES):
            # every frame is in the database file already (a stop's final checkpoint emptied the WAL): flushed
            # already, unless the session has no certificate yet and may still be certified by a flush of it
            certifiable = last_here and certify and self.policy.certificates
            if not certifiable or isinstance(await self.ctx.data_store.head(
                    self.ctx.data_bucket, certificate_key(holder.location, holder.generation, session)), Got):
                return None
        await self._files_before_flush(claim)
        # What the dead process had in flight at level 0 may still land: the flush's full file covers those ranges
        # too, so a late one is passed over by the restore, and is settled by this later upload of its range
        in_flight = Uploads.open(db, holder.generation).level0_ranges()
        cover = (min(r[0] for r in in_flight), max(r[1] for r in in_flight)) if in_flight else None
        rep = await Replicator.open(self.ctx.data_store, self.ctx.data_bucket, holder.location, holder.generation,
                                    db, self.ctx.clock, options=ReplicaOptions(flush_first=True, cover=cover))
        try:
            first = await rep.sync()
            while await rep.sync() is not None:
                pass
            await rep.checkpoint("TRUNCATE")  # flushed: a replay of this stop finds an empty WAL and adds nothing
            flushed = not rep.pending
        finally:
            await rep.close()
        await self._supersede_covered(rep, first, cover)
        unshipped.unlink(missing_ok=True)
        log.info("final checkpoint of %s after a restart: generation %s at TXID %d", host, holder.generation,
                 rep.position)
        # The dead process's session is certified by this flush when it shipped every committed frame and nothing
        # that session sent is unsettled (item 5; close-evidence: a request in flight when it died may still land)
        if flushed and last_here and certify and self.policy.certificates:
            uncertain = await rep.observe_uploads()
            if uncertain and rules.on("close-evidence"):
                log.warning("session %d of %s is not certified by its flush: %d upload(s) of the dead process are "
                            "unsettled (first %s)", session, host, len(uncertain), uncertain[0])
            else:
                await self._certify(holder.location, holder.generation, session, rep.position)
        return rep.position

    async def _files_before_flush(self, claim: Claim) -> None:
        """L17 for a flush (§5.3 step 5): a generation that holds data has a files manifest. A start that died
        after its app ran but before its manifest was published (a store that did not answer) leaves the
        installation's files only on this disk; the flush that uploads its database publishes them first, or a
        later lost disk leaves a host with data and no files, which is never started empty (the simulation: move
        seed 259 stalled for good). A manifest already there is the generation's: nothing is written."""
        holder = claim.holder
        assert holder is not None
        ctx = self.ctx
        if not os.path.lexists(ctx.files_dir(claim.host)):
            return
        try:
            if await newest_manifest(ctx.data_store, ctx.data_bucket, holder.location, [holder.generation]):
                return
        except FilesManifestInvalid:
            return  # a manifest is there, malformed: the start's files step says so; never replaced here
        try:
            await self._publish_files(claim)
        except StartError as exc:  # the database still ships: its writes matter more than a manifest's error
            log.error("the files of %s have no manifest in generation %s: %s", claim.host, holder.generation, exc)

    async def _supersede_covered(self, rep: Replicator, first: SyncResult | None, cover: tuple[int, int] | None
                                 ) -> None:
        """A first full file that covers a dead attempt's in-flight ranges settles them (their late landing is
        passed over by the restore), so they no longer keep the session uncertain."""
        if cover is not None and first is not None and first.full:
            parsed = parse_ltx_name("/".join(first.key.split("/")[-2:]))
            if parsed is not None:
                await rep.uploads.supersede(self.ctx.data_store, self.ctx.data_bucket, first.key, first.version_id,
                                            parsed[1], parsed[2])

    async def adopt_running(self) -> list[str]:
        """A new owner process is a new session (§5.1 step 9): stop every app found running, then capture what
        it committed since the dead process's last upload (:meth:`flush_orphan`). No certificate is written for
        the dead session (a late PUT of the dead process could still land in its generation, §5.3 "Evidence
        also starts a clock"), so the next admission still declares its ``writes_lost``; the flush makes the
        declared loss one that, in practice, did not happen."""
        stopped = []
        for row in self.ctx.registry.rows():
            if self.ctx.tree.populated(row.host) and row.host not in self.running:
                await self._stop_tree(row.host)
                try:
                    await self.flush_orphan(row.host)
                except BadObject as bad:  # its commits stay on this disk; its next stop or wake flushes them
                    log.error("%s stopped; its local commits are not flushed while its %s is unreadable (%s)",
                              row.host, bad.obj, bad.limit)
                stopped.append(row.host)
        return stopped

    async def close(self) -> None:
        for host in list(self.running):
            with contextlib.suppress(Exception):
                await self.stop(host)


@dataclass
class _Restored:
    """What the first start attempt of an admission restored (:meth:`Activator._start_once`): ``txid`` is None until
    its database is restored and tagged with the admission's generation."""

    txid: int | None = None

    def kept(self, db: Path, generation: str) -> bool:
        """An earlier attempt of this admission restored ``db`` and it is still that generation's."""
        return self.txid is not None and db.exists() and read_local_gen(db) == generation


class StartError(Exception):
    """A start step failed; the attempt is counted and retried."""


class StartCheckRefused(Exception):
    """The markers do not name what the claim expects (§5.1 start check): refuse and page, never retry."""


class BaselineRefused(Exception):
    """The run walk met a covered local baseline (§7.14 item 3): nothing was admitted and nothing started; the
    operator is alerted (``baseline-refused``) and the agent tries again after its backoff."""


class AlertOutbox:
    """Alerts a box owes (§7.14 item 2: one per loss declaration, "retried until delivered"): each is a file under
    ``<box>/alerts/`` until the stream has it. The fact's id makes a redelivery one alert (``Nats-Msg-Id``)."""

    def __init__(self, box_dir: Path) -> None:
        self.dir = box_dir / "alerts"

    def add(self, fact: Fact) -> None:
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        name = hashlib.sha256(f"{fact.kind}:{fact.id}".encode()).hexdigest()[:32]
        atomic_write(self.dir / f"{name}.json", canonical(fact), mode=0o600)

    def pending(self) -> list[Path]:
        return sorted(self.dir.glob("*.json")) if self.dir.is_dir() else []

    async def flush(self, events: EventLog) -> int:
        left = 0
        for path in self.pending():
            try:
                body = path.read_bytes()
            except FileNotFoundError:  # delivered meanwhile by another flush
                continue
            try:
                await publish_alert(events, decode(body, Fact))
            except LogError as exc:
                log.warning("alert %s not delivered yet: %s", path.name, exc)
                left += 1
                continue
            path.unlink(missing_ok=True)
        return left


def remove_box_data(ctx: BoxContext) -> None:
    """Lose the disk (tests and the simulation): the box's data directory is gone."""
    shutil.rmtree(ctx.data_dir, ignore_errors=True)


__all__ = [
    "Activator", "AlertOutbox", "AppSource", "AppSpec", "AppUnavailable", "BaselineRefused", "BoxContext",
    "Certificate", "StartFailed",
    "StartPolicy", "StartRefused", "Started", "certificate_key", "purge_local_db", "replication_position",
]
