"""The source side of a move (spec §7.3, §7.4, §7.5, §7.13): the pure cut machine, then real cuts on the stack
(SeaweedFS, NATS, real SQLite files replicated by the Replicator, cgroup v2 evidence)."""

from __future__ import annotations

import hashlib
import itertools
import sqlite3
import sys
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import pytest
import pytest_asyncio

from events import Actor
from events.base import canonical, decode
from events.claim import Claim, Holder, Op
from events.ids import new_incarnation, new_op_id
from events.record import FilesDigest, Move, MoveInputs, MoveSource, Record
from hostmove.probe_apps import post_write
from hostmove.stackinfo import StackInfo
from kernel import rules
from kernel.ports import Clock, ManualClock, SeededRandom, SystemRandom, WallClock
from moveprobe.config import probe_env
from services.box.artifacts.sealing import generate_private_key
from services.box.instance.activator import Activator, AppSpec, BoxContext, Certificate, Started, certificate_key
from services.box.instance.evidence import LeaseObservation, StopEvidence, lease_file_check
from services.box.instance.proctree import CgroupTree, SpawnJournal
from services.box.instance.registry import Registry, RouteRow
from services.box.instance.stamps import StampBook
from services.box.instance.timers import Timers, TimerSpec
from services.box.replica.layout import GenerationScope
from services.box.replica.replicator import Replicator
from services.box.replica.restore import restore_generation
from services.hosts.create import create_host
from services.ledger import Committed, Crash, Ledger, NoChange, Refusal
from services.move.follow import claim_half, snapshot_prefix
from services.move.lease import StagingWork
from services.objstore.port import Got, ObjectStore, StoreUnavailable
from services.objstore.s3 import S3Store
from services.source import phases
from services.source.phases import FAST, PRODUCTION, Readiness, cut_deadline, lease_timing
from services.source.staging import (
    MoveMarker,
    StagedSet,
    Stager,
    StagingConflict,
    journal_key,
    lane,
)
from services.source.worker import SourceBox, SourceWorker, StepResult
from tests.helpers.cgtest import as_agent, box_tree
from tests.helpers.pushonly import PushOnly
from tests.helpers.stores import Regions, regions

RNG = SeededRandom(7)
MV = new_op_id("mv", RNG)
INC = new_incarnation(RNG)
SRC, TGT = "ie-1", "uk-1"
NOW = 1_800_000_000_000
INPUTS = MoveInputs(bundle_etags={"app": '"e1"'}, overlay_etag='"o1"', release="r1", env_report="sha256:aa")


def fresh(now: int = NOW, **kw: Any) -> Readiness:
    base: dict[str, Any] = dict(round_at=now - 1000, round_bytes=1024, target_report_at=now - 1000,
                                target_passed=True, source_ready_at=now - 1000, source_strict=True,
                                recovery_armed=True, inputs=INPUTS)
    base.update(kw)
    return Readiness(**base)


def rec(host: str = "h.example.com", **kw: Any) -> Record:
    base: dict[str, Any] = dict(id=MV, incarnation=INC, to="uk", from_="ie", state="cutting", inputs=INPUTS)
    base.update(kw)
    return Record(host=host, gen=3, move=Move(**base))


def claim(host: str = "h.example.com", generation: str = "g1", **op_kw: Any) -> Claim:
    op: dict[str, Any] = dict(kind="moving", id=MV, exec=SRC, participants=(SRC, TGT))
    op.update(op_kw)
    return Claim(host=host, gen=4, holder=Holder(incarnation=INC, location=f"instances/{host}/{INC}",
                                                 generation=generation, session=1, stamp=1), op=Op(**op))


# -- the pure machine --------------------------------------------------------------------------------------------


ENTERED = ("stopping", "stopped", "staged", "archived")


@pytest.mark.parametrize(("current", "target"), list(itertools.product(phases.CUT_PHASES, ENTERED)))
def test_every_journal_write_is_legal_only_from_the_phase_before(current: str, target: str) -> None:
    r = rec(cut_phase=current, cut_deadline=NOW + 10_000)
    extra = {"evidence": "moves/h/x/stopped-source.json"} if target == "stopped" else {}
    out = phases.decide_enter(r, MV, INC, target, NOW, **extra)  # type: ignore[arg-type]
    if phases.NEXT_PHASE.get(current) == target:
        assert isinstance(out, Record) and out.move is not None and out.move.cut_phase == target
    elif current == target:
        assert isinstance(out, NoChange), "a replayed journal write changes nothing"
    else:
        assert isinstance(out, Refusal) and "cannot enter" in out.reason


def test_enter_refuses_another_move_a_closed_move_and_stopped_without_evidence() -> None:
    assert isinstance(phases.decide_enter(rec(cut_phase="admitted"), "mv_" + "z" * 26, INC, "stopping", NOW),
                      NoChange)
    assert isinstance(phases.decide_enter(rec(state="ready", cut_phase=""), MV, INC, "stopping", NOW), Refusal)
    no_ev = phases.decide_enter(rec(cut_phase="stopping"), MV, INC, "stopped", NOW)
    assert isinstance(no_ev, Refusal) and "evidence" in no_ev.reason
    with pytest.raises(ValueError):
        phases.decide_enter(rec(cut_phase="archived"), MV, INC, "flipped", NOW)  # type: ignore[arg-type]


def test_admission_stamps_the_deadline_from_the_cut_window() -> None:
    out = phases.decide_admit(rec(cut_phase="requested"), MV, INC, fresh(), NOW, PRODUCTION)
    assert isinstance(out, Record) and out.move is not None
    m = out.move
    assert (m.cut_phase, m.cut_at, m.cut_budget_s) == ("admitted", NOW, 120.0)
    assert m.cut_deadline == NOW + 115_000 == cut_deadline(NOW, PRODUCTION), "cut_at + 120 s - open 5 s"
    assert cut_deadline(NOW, FAST) == NOW + 11_500
    assert isinstance(phases.decide_admit(out, MV, INC, fresh(), NOW, PRODUCTION), NoChange), "admitted once"


@pytest.mark.parametrize(("why", "readiness"), [
    ("recoverySourceArmed", fresh(recovery_armed=False)),
    ("staging round", fresh(round_at=NOW - 601_000)),
    ("above the", fresh(round_bytes=17 << 20)),
    ("target's readiness report is missing", fresh(target_report_at=None)),
    ("does not pass: T6 disk", fresh(target_passed=False, target_reason="T6 disk")),
    ("readiness probe", fresh(source_ready_at=NOW - 700_000)),
    ("strict", fresh(source_strict=False)),
    ("release changed", fresh(inputs=msgspec.structs.replace(INPUTS, release="r2"))),
    ("bundle_etags changed", fresh(inputs=msgspec.structs.replace(INPUTS, bundle_etags={"app": '"e2"'}))),
])
def test_admission_returns_the_move_to_ready_with_the_reason(why: str, readiness: Readiness) -> None:
    out = phases.decide_admit(rec(cut_phase="requested"), MV, INC, readiness, NOW, PRODUCTION)
    assert isinstance(out, Record) and out.move is not None
    assert (out.move.state, out.move.cut_phase, out.move.cut_at) == ("ready", "", None)
    assert why in out.move.reason
    with rules.mutated(["admit-fresh-inputs"]):
        mutated = phases.decide_admit(rec(cut_phase="requested"), MV, INC, readiness, NOW, PRODUCTION)
        assert isinstance(mutated, Record) and mutated.move is not None and mutated.move.cut_phase == "admitted"


def test_ready_needs_every_report_fresh() -> None:
    prep = rec(state="preparing", inputs=MoveInputs())
    out = phases.decide_ready(prep, MV, INC, fresh(), NOW, PRODUCTION)
    assert isinstance(out, Record) and out.move is not None
    assert (out.move.state, out.move.ready_at, out.move.inputs) == ("ready", NOW, INPUTS)
    stale = phases.decide_ready(prep, MV, INC, fresh(target_report_at=NOW - 600_001), NOW, PRODUCTION)
    assert isinstance(stale, NoChange) and "older than 600 s" in stale.reason
    assert isinstance(phases.decide_ready(out, MV, INC, fresh(), NOW, PRODUCTION), NoChange)


def test_no_phase_and_no_flip_past_the_deadline() -> None:
    late = NOW + 1
    for current, target in zip(phases.CUT_PHASES[1:], ENTERED, strict=False):
        r = rec(cut_phase=current, cut_deadline=NOW, source=MoveSource(evidence="e"))
        out = phases.decide_enter(r, MV, INC, target, late, evidence="e")  # type: ignore[arg-type]
        assert isinstance(out, Refusal) and "deadline passed" in out.reason, (current, target)
        at = phases.decide_enter(r, MV, INC, target, NOW, evidence="e")  # type: ignore[arg-type]
        assert isinstance(at, Record), "at the deadline itself the phase is entered"
    sealed_src = MoveSource(evidence="e", files=FilesDigest(plain="a" * 64, sealed="b" * 64))
    r = rec(cut_phase="archived", cut_deadline=NOW, source=sealed_src)
    assert isinstance(phases.decide_flip(r, MV, INC, late, PRODUCTION), Refusal)
    step = phases.plan(r, claim(exec="none", phase="sealed", journal={"seal": {}}), source=SRC, move_id=MV,
                       incarnation=INC, now_ms=late)
    assert step.kind == "deadline"
    with rules.mutated(["cut-deadline"]):
        assert isinstance(phases.decide_flip(r, MV, INC, late, PRODUCTION), Record)


def test_flip_then_the_claim_follows_to_landing_checking_with_exec_target() -> None:
    src = MoveSource(evidence="moves/h/e/stopped-source.json", files=FilesDigest(plain="a" * 64, sealed="b" * 64))
    r = rec(cut_phase="archived", cut_deadline=NOW + 5, source=src)
    out = phases.decide_flip(r, MV, INC, NOW, FAST)
    assert isinstance(out, Record) and out.move is not None
    m = out.move
    assert (m.state, m.cut_phase, m.flipped_at, m.landing_deadline) == ("landing", "flipped", NOW, NOW + 30_000)
    assert isinstance(phases.decide_flip(out, MV, INC, NOW, FAST), NoChange)
    no_archive = rec(cut_phase="archived", cut_deadline=NOW + 5, source=MoveSource(evidence="e"))
    assert isinstance(phases.decide_flip(no_archive, MV, INC, NOW, FAST), Refusal)
    c = claim(exec="none", phase="sealed")
    followed = claim_half(c, out)
    assert isinstance(followed, Claim) and (followed.op.kind, followed.op.phase, followed.op.exec) == (
        "landing", "checking", TGT)


def test_claim_halves_cite_evidence_and_never_rewrite_a_seal() -> None:
    assert isinstance(phases.decide_exec_none(claim(), MV, SRC, "", {}), Refusal), "K3 needs the evidence"
    out = phases.decide_exec_none(claim(), MV, SRC, "ev", {"staged": "v1"})
    assert isinstance(out, Claim) and out.op.exec == "none" and out.op.journal["evidence.source"] == "ev"
    assert isinstance(phases.decide_exec_none(out, MV, SRC, "ev", {"staged": "v1"}), NoChange)
    assert isinstance(phases.decide_exec_none(claim(exec=TGT), MV, SRC, "ev", {}), Refusal), "K5: exec"
    assert isinstance(phases.decide_exec_none(claim(participants=(TGT, SRC)), MV, SRC, "ev", {}), Refusal)
    assert isinstance(phases.decide_sealed(out, MV, SRC, {"a": "1"}), Refusal), "files only after the seal"
    sealed = phases.decide_seal(out, MV, SRC, {"n": 3})
    assert isinstance(sealed, Claim) and sealed.op.journal["seal"] == {"n": 3}
    assert isinstance(phases.decide_seal(sealed, MV, SRC, {"n": 3}), NoChange)
    assert isinstance(phases.decide_seal(sealed, MV, SRC, {"n": 4}), Refusal)
    done = phases.decide_sealed(sealed, MV, SRC, {"a": "1"})
    assert isinstance(done, Claim) and done.op.phase == "sealed" and done.op.journal["seal"]["files"] == {"a": "1"}
    assert isinstance(phases.decide_sealed(done, MV, SRC, {"a": "1"}), NoChange)
    assert isinstance(phases.decide_sealed(done, MV, SRC, {"a": "2"}), Refusal)


@pytest.mark.parametrize(("record", "claim_state", "kind", "phase"), [
    (rec(cut_phase="requested"), claim(), "admit", "admitted"),
    (rec(cut_phase="admitted"), claim(), "enter", "stopping"),
    (rec(cut_phase="stopping"), claim(), "enter", "stopped"),
    (rec(cut_phase="stopped"), claim(), "effects", "stopped"),
    (rec(cut_phase="stopped"), claim(exec="none"), "enter", "staged"),
    (rec(cut_phase="staged"), claim(exec="none"), "effects", "staged"),
    (rec(cut_phase="staged"), claim(exec="none", journal={"seal": {}}), "enter", "archived"),
    (rec(cut_phase="archived"), claim(exec="none", journal={"seal": {}}), "effects", "archived"),
    (rec(state="landing", cut_phase="flipped"), claim(exec="none", phase="sealed"), "follow", "flipped"),
    (rec(state="landing", cut_phase="flipped"), claim(kind="landing", exec=TGT), "done", "flipped"),
    (rec(state="ready", cut_phase=""), claim(), "idle", ""),
    (rec(cut_phase="admitted"), claim(id="mv_" + "q" * 26), "blocked", "admitted"),
    (rec(cut_phase="admitted"), claim(kind="serving"), "blocked", "admitted"),
    (rec(cut_phase="staged"), claim(), "blocked", "staged"),  # exec must be none after stopped
    (rec(cut_phase="admitted"), claim(participants=(TGT, SRC)), "blocked", "admitted"),
    (rec(cut_phase="bogus"), claim(), "blocked", "bogus"),
])
def test_plan_names_the_next_step_from_durable_state_only(
    record: Record, claim_state: Claim, kind: str, phase: str
) -> None:
    step = phases.plan(record, claim_state, source=SRC, move_id=MV, incarnation=INC, now_ms=NOW)
    assert (step.kind, step.phase) == (kind, phase), step.reason


# -- the real stack ----------------------------------------------------------------------------------------------


Buckets = Regions


@pytest_asyncio.fixture(loop_scope="session", scope="module")
async def buckets(stack: StackInfo, unique: Callable[[str], str]) -> AsyncIterator[Buckets]:
    """One deployment bucket and the two regions' data buckets for the whole module; keys are per host."""
    async with regions(stack, unique, "src") as b:
        yield b


@dataclass
class World:
    """One host on the source box: a real WAL database replicated into ``ie``, its files and timers."""

    b: Buckets
    host: str
    move_id: str
    box_dir: Path
    tree: CgroupTree
    registry: Registry
    timers: Timers
    rep: Replicator
    clock: Clock
    key: Any = field(default_factory=lambda: generate_private_key(SeededRandom(1)))
    stops: int = 0
    final_sync: bool = True
    stop_fails: int = 0
    push: PushOnly | None = None

    @property
    def db(self) -> Path:
        return self.box_dir / "data" / f"{self.host}.db"

    @property
    def files(self) -> Path:
        return self.box_dir / "data" / self.host

    def ledger(self, faults: Callable[[str], None] | None = None) -> Ledger:
        return Ledger(self.b.store, self.b.events, self.clock, Actor(service="source", pid=1, nonce="s"),
                      self.b.deploy, faults=faults)

    async def stop(self, host: str) -> None:
        """The instance's stop and final sync (what ``Activator.stop`` does); harmless when nothing runs."""
        self.stops += 1
        if self.stop_fails:
            self.stop_fails -= 1
            raise Crash("the agent died while stopping the instance")
        if self.rep._closed:
            return
        if not self.final_sync:  # the agent restarted under the app: it is killed, nothing more is uploaded
            await self.rep.close()
            return
        await self.rep.sync()
        await self.rep.checkpoint("TRUNCATE")
        clean = await self.rep.sync() is None and not self.rep.pending
        await self.rep.close()
        if clean:  # the clean-close certificate, as Activator.stop writes it
            cert = Certificate(session=1, box=SRC, generation="g1", max_txid=self.rep.position,
                               closed_at=self.clock.now_ms())
            key = certificate_key(f"instances/{self.host}/{INC}", "g1", 1)
            await self.b.store.put(self.b.ie, key, canonical(cert), if_none_match=True)

    def worker(self, faults: Callable[[str], None] | None = None, profile: phases.TimingProfile = FAST,
               staging: Any = None) -> SourceWorker:
        b = self.b
        if self.push is None or staging is not None or self.push.store is not b.store:
            self.push = PushOnly(staging or b.store, b.uk)  # M17: the source never reads the target's bucket
        stores: dict[str, tuple[ObjectStore, str]] = {"uk": (self.push, b.uk), "ie": (b.store, b.ie)}
        box = SourceBox(
            label=SRC, region="ie", ledger=self.ledger(faults), deploy_store=b.store, deploy_bucket=b.deploy,
            data_store=b.store, data_bucket=b.ie, staging=stores.__getitem__,
            target_key=lambda region: self.key.public_key(), registry=self.registry, timers=self.timers,
            tree=self.tree, clock=self.clock, files_dir=lambda h: self.files, db_path=lambda h: self.db,
            stop=self.stop, lease=self.lease,
        )

        async def readiness(host: str) -> Readiness:
            return fresh(self.clock.now_ms())

        return SourceWorker(box, profile, readiness)

    def lease(self, host: str) -> Callable[[], LeaseObservation]:
        return lease_file_check(self.box_dir / "lease.json", self.clock, 1_000)

    def write(self, n: int) -> None:
        conn = sqlite3.connect(self.db)
        try:
            conn.executemany("INSERT INTO t (v) VALUES (?)", [(f"row-{i}".encode() * 50,) for i in range(n)])
            conn.commit()
        finally:
            conn.close()

    async def state(self) -> tuple[Record, Claim]:
        ledger = self.ledger()
        r, c = (await ledger.read_record(self.host)).state, (await ledger.read_claim(self.host)).state
        assert r is not None and c is not None
        return r, c


@pytest_asyncio.fixture(loop_scope="session")
async def world(buckets: Buckets, unique: Callable[[str], str], tmp_path: Path) -> AsyncIterator[World]:
    host = f"{unique('shop')}.example.com"
    move_id = new_op_id("mv", SystemRandom())
    box = unique("box.src")
    with box_tree(box) as (tree, home), as_agent(tree, home):
        tree.journal = SpawnJournal(tmp_path / "spawns")  # no spawn in this boot: an absent group is evidence
        data = tmp_path / "data"
        (data / host / "static").mkdir(parents=True)
        (data / host / "static" / "index.html").write_text("<h1>hello</h1>")
        (data / host / "notes.txt").write_text("kept across regions")
        db = data / f"{host}.db"
        conn = sqlite3.connect(db)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, v BLOB)")
        conn.commit()
        conn.close()
        clock = WallClock()
        location = f"instances/{host}/{INC}"
        rep = await Replicator.open(buckets.store, buckets.ie, location, "g1", db, clock)
        registry = Registry.open(tmp_path, clock)
        timers = Timers.open(tmp_path, clock)
        registry.insert(RouteRow(host=host, status="ready", incarnation=INC, replication="stream", next_due=5))
        timers.replace_timers(host, [TimerSpec(name="nightly", every_ms=86_400_000, payload="{}")])
        w = World(buckets, host, move_id, tmp_path, tree, registry, timers, rep, clock)
        w.write(40)
        await rep.sync()
        w.write(25)  # acknowledged by the app, not yet uploaded: the stop's final sync must carry it
        ledger = w.ledger()
        c = Claim(host=host, gen=1, holder=Holder(incarnation=INC, location=location, generation="g1", session=1,
                                                  stamp=1),
                  op=Op(kind="moving", id=move_id, exec=SRC, participants=(SRC, TGT),
                        intent={"to": "uk", "target": TGT}))
        m = Move(id=move_id, incarnation=INC, to="uk", from_="ie", state="cutting", cut_phase="requested",
                 inputs=INPUTS)
        for obj, state in (("claim", c), ("record", Record(host=host, gen=1, move=m))):
            out = await ledger.transition(obj, host, "test-setup", lambda cur, s=state: s)  # type: ignore
            assert isinstance(out, Committed)
        try:
            yield w
        finally:
            if not rep._closed:
                await rep.close()
            registry.close()
            timers.close()


def _rows(db: Path) -> list[tuple[int, bytes]]:
    conn = sqlite3.connect(db)
    try:
        return list(conn.execute("SELECT id, v FROM t ORDER BY id"))
    finally:
        conn.close()


async def assert_flipped_and_staged(w: World, tmp: Path) -> None:
    """The end state of a correct source cut: flipped record, claim following, and a seal that restores."""
    r, c = await w.state()
    assert r.move is not None
    m = r.move
    assert (m.state, m.cut_phase, m.to) == ("landing", "flipped", "uk")
    assert m.cut_at is not None and m.cut_deadline == cut_deadline(m.cut_at, FAST)
    assert m.flipped_at is not None and m.flipped_at <= m.cut_deadline
    assert m.landing_deadline == m.flipped_at + 30_000
    assert (c.op.kind, c.op.phase, c.op.exec) == ("landing", "checking", TGT)
    assert c.op.journal["evidence.source"] == m.source.evidence
    assert (m.source.replication, m.source.next_due) == ("stream", 5)
    assert m.source.timers_sha256 == w.timers.digest(w.host)
    row = w.registry.get(w.host)
    assert row is not None and (row.status, row.hold_op) == ("moving", w.move_id), "the route is held moving"
    got = await w.b.store.get(w.b.deploy, m.source.evidence)
    assert isinstance(got, Got)
    ev = decode(got.body, StopEvidence)
    seal = c.op.journal["seal"]
    assert ev.n == seal["n"] and ev.db_sha256 == m.source.db_sha256 and ev.files_sha256 == m.source.files.plain
    assert seal["src_covered"] is True and seal["from_db"] is True
    # Landing copies by versionId and nothing else: restore exactly the sealed versions into a fresh location.
    staged = lane(w.host, w.move_id)
    pinned = f"pinned/{w.host}"
    for rel, version in seal["replica"].items():
        await w.b.store.copy(w.b.uk, f"{pinned}/{rel}", src_bucket=w.b.uk, src_key=staged + "replica/" + rel,
                             src_version_id=version)
    restored = tmp / "restored.db"
    await restore_generation(w.b.store, w.b.uk, pinned, "", restored, required_txid=seal["n"])
    assert _rows(restored) == _rows(w.db) and len(_rows(restored)) == 65, "every acknowledged row is staged"
    timers = await w.b.store.get(w.b.uk, staged + "timers/timers.json", version_id=seal["timers"]["timers.json"])
    assert isinstance(timers, Got) and b"nightly" in timers.body
    manifest = await w.b.store.get(w.b.uk, staged + "files/manifest.json", version_id=seal["files"]["manifest.json"])
    assert isinstance(manifest, Got) and m.source.files.sealed.encode() in manifest.body
    archive = await w.b.store.get(w.b.uk, staged + "files/archive.sealed", version_id=seal["files"]["archive.sealed"])
    assert isinstance(archive, Got) and hashlib.sha256(archive.body).hexdigest() == m.source.files.sealed
    marker = await w.b.store.get(w.b.uk, staged + "move.json")
    assert isinstance(marker, Got) and decode(marker.body, MoveMarker).move_id == w.move_id
    assert w.push is not None and w.push.writes and not w.push.refused, "staged push-only, never reading (M17)"
    ttl = FAST.staging_lease_ttl_ms
    assert m.cut_at + ttl <= seal["staging_bound"] <= m.flipped_at + ttl, "the lane's seal bound: seal + TTL (§6.4)"


async def test_a_source_cut_runs_from_requested_to_flipped(world: World, tmp_path: Path) -> None:
    result = await world.worker().run(world.host, world.move_id, INC)
    assert (result.step.kind, result.progressed) == ("done", False), result.reason
    await assert_flipped_and_staged(world, tmp_path)
    assert world.stops == 1
    again = await world.worker().run(world.host, world.move_id, INC)
    assert again.step.kind == "done", "a finished cut is left alone"


async def test_a_crash_after_every_journal_write_replays_to_the_same_end(world: World, tmp_path: Path) -> None:
    """Each worker dies right after its first CAS (before any effect of the phase it wrote); a new worker with
    nothing in memory continues from the durable state. At each crash, the effects of the journaled phase are
    not there yet (journal first)."""
    world.stop_fails = 1  # and the first stop dies inside the effects too
    seen: list[tuple[str, str, str]] = []
    snapshots = snapshot_prefix(world.host, world.move_id)
    for _ in range(30):
        def faults(point: str) -> None:
            if point == "after_cas":
                raise Crash("the source worker died after its CAS")

        try:
            result = await world.worker(faults).run(world.host, world.move_id, INC)
        except Crash:
            r, c = await world.state()
            assert r.move is not None
            at = (r.move.cut_phase, c.op.exec, c.op.phase)
            if at == ("stopping", SRC, "") and world.stops == 0:
                row = world.registry.get(world.host)
                assert row is not None and row.hold_op == "", "the hold is stopping's effect: after the journal"
            if at == ("staged", "none", "") and "seal" not in c.op.journal:
                staged = await world.b.store.list_keys(world.b.uk, lane(world.host, world.move_id) + "replica/")
                assert staged == [], "the mirror is staged's effect: after the journal"
            if at == ("archived", "none", "") and not r.move.source.files.sealed:
                assert await world.b.store.list_keys(world.b.ie, snapshots) == [snapshots + "timers.json"], \
                    "the archive is archived's effect: after the journal"
            seen.append(at)
            continue
        assert result.step.kind == "done", result.reason
        break
    else:
        pytest.fail(f"the cut never finished: {seen}")
    assert seen == [
        ("admitted", SRC, ""), ("stopping", SRC, ""), ("stopping", SRC, ""),  # the second: the stop died
        ("stopped", SRC, ""), ("stopped", "none", ""), ("staged", "none", ""), ("staged", "none", ""),
        ("archived", "none", ""), ("archived", "none", ""), ("archived", "none", "sealed"),
        ("flipped", "none", "sealed"), ("flipped", TGT, "checking"),
    ], seen
    assert world.stops >= 2, "the stop that died inside its effects was replayed"
    await assert_flipped_and_staged(world, tmp_path)


class FailingCopies:
    """The real store, except that the first ``n`` copies fail as a 503 would (the outcome unknown)."""

    def __init__(self, store: S3Store, n: int) -> None:
        self.store, self.n = store, n

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)

    async def copy(self, *args: Any, **kw: Any) -> Any:
        if self.n:
            self.n -= 1
            raise StoreUnavailable("copy: 503 Service Unavailable (injected)")
        return await self.store.copy(*args, **kw)


async def test_a_store_failure_inside_staging_is_replayed_by_a_new_worker(world: World, tmp_path: Path) -> None:
    """A failed copy mid-mirror raises (a store failure is never a reason to act, C6); the journal stays at
    ``staged`` without a seal, and a new worker replays the round and seals exact versions."""
    with pytest.raises(StoreUnavailable):
        await world.worker(staging=FailingCopies(world.b.store, 2)).run(world.host, world.move_id, INC)
    r, c = await world.state()
    assert r.move is not None and r.move.cut_phase == "staged" and "seal" not in c.op.journal
    result = await world.worker().run(world.host, world.move_id, INC)
    assert result.step.kind == "done", result.reason
    await assert_flipped_and_staged(world, tmp_path)


async def test_a_source_that_lost_its_final_sync_seals_uncovered(world: World, tmp_path: Path) -> None:
    """An app killed without its final sync (an agent restart, §7.13): the seal mirrors the remote as it stands,
    says so (``src_covered`` and ``from_db`` false, so the landing declares the loss) and names N at the remote."""
    world.final_sync = False
    result = await world.worker().run(world.host, world.move_id, INC)
    assert result.step.kind == "done", result.reason
    _, c = await world.state()
    seal = c.op.journal["seal"]
    assert (seal["src_covered"], seal["from_db"]) == (False, False)
    assert seal["n"] == world.rep.position, "N is what the replica holds"
    staged = lane(world.host, world.move_id)
    pinned = f"pinned-uncovered/{world.host}"
    for rel, version in seal["replica"].items():
        await world.b.store.copy(world.b.uk, f"{pinned}/{rel}", src_bucket=world.b.uk,
                                 src_key=staged + "replica/" + rel, src_version_id=version)
    restored = tmp_path / "restored.db"
    await restore_generation(world.b.store, world.b.uk, pinned, "", restored, required_txid=seal["n"])
    assert len(_rows(restored)) == 40 and len(_rows(world.db)) == 65, "the 25 unsynced rows are not in the seal"


async def test_nothing_proceeds_past_the_cut_deadline(world: World) -> None:
    clock = ManualClock(start_ms=WallClock().now_ms())
    world.clock = clock
    worker = world.worker()
    assert (await worker.step(world.host, world.move_id, INC)).progressed  # admitted
    r, _ = await world.state()
    assert r.move is not None and r.move.cut_deadline == clock.now_ms() + 11_500
    clock.advance(11_501)
    out: StepResult = await world.worker().run(world.host, world.move_id, INC)
    assert out.step.kind == "deadline" and not out.progressed and "reverting" in out.reason
    r, c = await world.state()
    # §7.4: exceeding the deadline before the commit starts recovery: the cut records the revert and stops there
    assert r.move is not None and (r.move.state, r.move.cut_phase) == ("reverting", "admitted")
    assert "cut deadline passed at admitted" in r.move.reason
    assert c.op.exec == SRC and world.stops == 0, "nothing was stopped past the deadline"
    row = world.registry.get(world.host)
    assert row is not None and row.hold_op == ""


async def test_a_stale_readiness_sends_the_cut_back_to_ready(world: World) -> None:
    worker = world.worker()

    async def stale(host: str) -> Readiness:
        return fresh(world.clock.now_ms(), target_report_at=None)

    worker.readiness = stale
    out = await worker.step(world.host, world.move_id, INC)
    assert out.progressed
    r, _ = await world.state()
    assert r.move is not None and (r.move.state, r.move.cut_phase) == ("ready", "")
    assert "target's readiness report is missing" in r.move.reason
    assert (await worker.step(world.host, world.move_id, INC)).step.kind == "idle"


async def test_an_unarmed_source_recovery_at_admitted_returns_to_ready_before_any_stop(world: World) -> None:
    worker = world.worker()
    assert (await worker.step(world.host, world.move_id, INC)).progressed  # admitted

    async def unarmed(host: str) -> Readiness:
        return fresh(world.clock.now_ms(), recovery_armed=False)

    worker.readiness = unarmed
    out = await worker.step(world.host, world.move_id, INC)
    assert not out.progressed and "not armed" in out.reason
    r, c = await world.state()
    assert r.move is not None and (r.move.state, r.move.cut_phase, r.move.cut_deadline) == ("ready", "", None)
    assert "recoverySourceArmed" in r.move.reason and world.stops == 0 and c.op.exec == SRC


async def stager_for(w: World, holder: str = "ie-1/test") -> Stager:
    """A lane's :class:`Stager` for ``w`` under a freshly taken staging-work lease, push-only into ``uk`` (M17)."""
    b = w.b
    work = StagingWork(b.store, b.deploy, w.clock, lease_timing(FAST), region="uk", host=w.host, op_id=w.move_id,
                       holder=holder)
    await work.acquire()
    w.push = PushOnly(b.store, b.uk)
    return await Stager.open(work, w.push, b.uk, b.store, b.deploy, w.host, w.move_id, "uk")


async def journal_of(w: World) -> StagedSet:
    got = await w.b.store.get(w.b.deploy, journal_key(w.host, w.move_id))
    assert isinstance(got, Got)
    return decode(got.body, StagedSet)


async def test_the_mirror_decides_from_its_journal_and_deletes_only_what_it_staged(world: World) -> None:
    """§7.3 MirrorPrefix under M17: the source never lists the lane; it copies exact versions, records them in its
    staging journal, and deletes under ``replica/`` only what it staged and no longer has. An object someone
    else wrote (never in the journal) is neither named nor deleted; ``files/``, ``timers/``, ``move.json`` stay."""
    b, staged = world.b, lane(world.host, world.move_id)
    foreign = staged + "replica/0000/00000000000000fe-00000000000000fe.ltx"
    keep = [staged + "files/manifest.json", staged + "timers/timers.json", staged + "move.json"]
    for key in (foreign, *keep):
        await b.store.put(b.uk, key, b"old")
    scope = GenerationScope(f"instances/{world.host}/{INC}", "g1")
    stager = await stager_for(world)
    first = await stager.mirror(b.store, b.ie, scope)
    assert first.deleted == 0 and first.copied == len(first.versions) >= 1 and first.max_l0 == world.rep.position
    assert world.push is not None and world.push.refused == [], "nothing read or listed the target's bucket"
    journal = await journal_of(world)
    assert {k[len("replica/"):]: o.version for k, o in journal.objects.items()} == first.versions
    for rel, version in first.versions.items():
        src = await b.store.get(b.ie, scope.prefix + rel)
        dst = await b.store.get(b.uk, staged + "replica/" + rel, version_id=version)
        assert isinstance(src, Got) and isinstance(dst, Got) and src.body == dst.body
    world.write(3)
    await world.rep.sync()
    extra = scope.prefix + "0000/00000000000000ff-00000000000000ff.ltx"  # a file the source has, then drops
    await b.store.put(b.ie, extra, b"dropped by the next compaction")
    second = await (await stager_for(world)).mirror(b.store, b.ie, scope)
    assert second.copied == 2 and second.deleted == 0, "only the new level-0 file and the extra one move"
    assert {k: v for k, v in second.versions.items() if k in first.versions} == first.versions
    await b.store.delete(b.ie, extra)
    third = await (await stager_for(world)).mirror(b.store, b.ie, scope)
    assert (third.copied, third.deleted) == (0, 1) and third.max_l0 == world.rep.position > first.max_l0
    keys = await b.store.list_keys(b.uk, staged)
    assert staged + "replica/0000/00000000000000ff-00000000000000ff.ltx" not in keys, "what it staged and lost goes"
    assert foreign in keys and all(k in keys for k in keep), "what it never staged is never touched"
    assert world.push.refused == [] and all(w.startswith(("copy", "delete")) for w in world.push.writes)


class _CompactsAfterListing:
    """The source store, with the writer deleting one file's exact version right after the mirror's listing (its
    compaction or retention racing the round)."""

    def __init__(self, store: ObjectStore, key: str) -> None:
        self.store, self.key, self.deleted = store, key, False

    async def list_versions(self, bucket: str, prefix: str = "") -> list[Any]:
        entries = await self.store.list_versions(bucket, prefix)
        if not self.deleted:
            self.deleted = True
            for e in entries:
                if e.key == self.key:
                    await self.store.delete(bucket, self.key, version_id=e.version_id)
        return entries

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)


async def test_a_version_deleted_after_the_listing_makes_the_round_list_again(world: World) -> None:
    """The writer deletes its own uploads by exact version (issue 16): a file the mirror listed whose version is gone
    by the time of its COPY is no longer current, so the round lists again and mirrors that listing (rather than
    fail, or stage a set with a hole); its pending journal entry is resolved by a delete in the lane."""
    b, staged = world.b, lane(world.host, world.move_id)
    scope = GenerationScope(f"instances/{world.host}/{INC}", "g1")
    victim = scope.prefix + "0000/00000000000000fe-00000000000000fe.ltx"
    await b.store.put(b.ie, victim, b"compacted away during the round")
    racing = _CompactsAfterListing(b.store, victim)
    first = await (await stager_for(world)).mirror(racing, b.ie, scope)  # type: ignore[arg-type]
    rel = victim[len(scope.prefix):]
    assert racing.deleted and rel not in first.versions and first.versions and first.max_l0 == world.rep.position
    current = {k[len(scope.prefix):] for k in await b.store.list_keys(b.ie, scope.prefix)}
    assert set(first.versions) == current, "the round's set is the source's current set"
    assert first.deleted == 1 and staged + "replica/" + rel not in await b.store.list_keys(b.uk, staged)
    journal = await journal_of(world)
    assert {k[len("replica/"):]: o.version for k, o in journal.objects.items()} == first.versions
    second = await (await stager_for(world)).mirror(b.store, b.ie, scope)
    assert (second.copied, second.deleted) == (0, 0) and second.versions == first.versions


async def test_the_move_marker_is_create_only(world: World) -> None:
    """``move.json`` create-only (§7.3) without reading the lane (M17): a replay is a no-op from the journal; a
    412 after an earlier attempt of ours whose answer was lost is ours; a 412 on a first attempt is another's."""
    marker = MoveMarker(move_id=world.move_id, incarnation=INC, host=world.host, to="uk", from_="ie")
    stager = await stager_for(world)
    v1 = await stager.write_marker(marker)
    assert v1 and await stager.write_marker(marker) == v1, "a replay is a no-op"
    assert (await journal_of(world)).marker == v1
    # An earlier attempt landed but its answer was lost: the journal still says pending.
    j = await journal_of(world)
    got = await world.b.store.get(world.b.deploy, journal_key(world.host, world.move_id))
    assert isinstance(got, Got)
    await world.b.store.put(world.b.deploy, journal_key(world.host, world.move_id),
                            canonical(msgspec.structs.replace(j, marker="pending")), if_match=got.etag)
    assert await (await stager_for(world)).write_marker(marker) == "landed"
    # A first attempt that finds the object there: someone else wrote it.
    await world.b.store.delete(world.b.deploy, journal_key(world.host, world.move_id))
    with pytest.raises(StagingConflict, match="never wrote it"):
        await (await stager_for(world)).write_marker(msgspec.structs.replace(marker, incarnation="f" * 64))
    assert world.push is not None and world.push.refused == []


# -- end to end with the real app: the Activator runs moveprobe in a cgroup leaf -------------------------------


async def test_a_running_moveprobe_instance_is_cut_to_flipped(
    buckets: Buckets, unique: Callable[[str], str], tmp_path: Path
) -> None:
    """The real app under the real Activator: writes acknowledged over HTTP, then the cut stops it (the activator's
    final sync and clean-close certificate), takes evidence from the cgroup, stages, seals, archives and flips.
    Every row the app acknowledged is in the sealed replica."""
    b = buckets
    clock = WallClock()
    with box_tree(unique("box.probe")) as (tree, home), as_agent(tree, home):
        box_dir = tmp_path / "box"
        box_dir.mkdir()
        ledger = Ledger(b.store, b.events, clock, Actor(service="box", pid=1, nonce="a"), b.deploy)
        ctx = BoxContext(label=SRC, region="ie", box_dir=box_dir, data_bucket=b.ie, data_store=b.store, ledger=ledger,
                         tree=tree, registry=Registry.open(box_dir, clock), stamps=StampBook.open(box_dir, clock),
                         clock=clock, rng=SystemRandom())
        acks = tmp_path / "acks"
        acks.mkdir()

        def env(host: str, data_dir: Path, port: int, region: str) -> dict[str, str]:
            return probe_env(data_dir=data_dir, host=host, region=region, ack_log=acks / f"{host}.jsonl", port=port,
                             interval_s=3600)

        activator = Activator(ctx, AppSpec(argv=[sys.executable, "-m", "moveprobe"], env=env, ready_within_s=15))
        timers = Timers.open(box_dir, clock)
        host = f"{unique('probe')}.example.com"
        move_id = new_op_id("mv", SystemRandom())
        key = generate_private_key(SeededRandom(2))
        try:
            assert isinstance(await create_host(ledger, host, box=SRC, region="ie", incarnation=INC), Committed)
            ctx.registry.insert(RouteRow(host=host, status="ready", incarnation=INC))
            started = await activator.wake(host)
            assert isinstance(started, Started), started
            acked = [post_write(started.port, f"v{i}") for i in range(12)]
            ctx.files_dir(host).mkdir(parents=True, exist_ok=True)
            (ctx.files_dir(host) / "upload.txt").write_text("a user's file")

            def to_moving(cur: Claim | None) -> Claim:
                assert cur is not None
                return msgspec.structs.replace(cur, op=Op(kind="moving", id=move_id, exec=SRC, participants=(SRC, TGT),
                                                          intent={"to": "uk", "target": TGT}))

            assert isinstance(await ledger.transition("claim", host, "test-move", to_moving), Committed)
            m = Move(id=move_id, incarnation=INC, to="uk", from_="ie", state="cutting", cut_phase="requested",
                     inputs=INPUTS)
            rec_out = await ledger.transition("record", host, "test-move", lambda cur: Record(host=host, gen=1, move=m))
            assert isinstance(rec_out, Committed)

            box = SourceBox(
                label=SRC, region="ie", ledger=ledger, deploy_store=b.store, deploy_bucket=b.deploy, data_store=b.store,
                data_bucket=b.ie, staging=lambda region: (PushOnly(b.store, b.uk), b.uk),
                target_key=lambda region: key.public_key(),
                registry=ctx.registry, timers=timers, tree=tree, clock=clock, files_dir=ctx.files_dir,
                db_path=ctx.db_path, stop=activator.stop,
                lease=lambda h: lease_file_check(box_dir / "no-lease.json", clock, 1_000),
            )

            async def readiness(h: str) -> Readiness:
                return fresh(clock.now_ms())

            result = await SourceWorker(box, FAST, readiness).run(host, move_id, INC)
            assert result.step.kind == "done", result.reason
            assert not tree.populated(host), "the instance is stopped"
            r = (await ledger.read_record(host)).state
            c = (await ledger.read_claim(host)).state
            assert r is not None and r.move is not None and c is not None and c.holder is not None
            assert (r.move.state, r.move.cut_phase) == ("landing", "flipped")
            assert (c.op.kind, c.op.phase, c.op.exec) == ("landing", "checking", TGT)
            seal = c.op.journal["seal"]
            assert seal["src_covered"] is True and seal["generation"] == c.holder.generation
            staged, pinned = lane(host, move_id), f"pinned/{host}"
            for rel, version in seal["replica"].items():
                await b.store.copy(b.uk, f"{pinned}/{rel}", src_bucket=b.uk, src_key=staged + "replica/" + rel,
                                   src_version_id=version)
            restored = tmp_path / "restored.db"
            await restore_generation(b.store, b.uk, pinned, "", restored, required_txid=seal["n"])
            conn = sqlite3.connect(restored)
            try:
                seqs = [seq for (seq,) in conn.execute("SELECT seq FROM rows ORDER BY seq")]
            finally:
                conn.close()
            assert set(acked) <= set(seqs) and len(acked) == 12, "every acknowledged write is in the sealed replica"
        finally:
            await activator.close()
            timers.close()
