"""The source's preparing stage (spec §7.3; D§3.1, D§5.2): the pure deciders, then real rounds on the stack
(SeaweedFS, NATS, a real WAL database replicated by the Replicator, a real HTTP process for S1, cgroup v2 for S2)."""

from __future__ import annotations

import dataclasses
import socket
import sqlite3
import subprocess
import sys
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import pytest
import pytest_asyncio

from events import Actor
from events.base import decode
from events.claim import Claim, Holder, Op, Touched
from events.copy import say
from events.ids import new_incarnation, new_op_id
from events.record import Move, MoveInputs, Record
from hostmove.stackinfo import StackInfo
from kernel import metrics
from kernel.ports import ManualClock, SeededRandom, SystemRandom, WallClock
from services.box.artifacts.archive import extract
from services.box.artifacts.sealing import generate_private_key
from services.box.instance.proctree import CgroupTree
from services.box.replica.layout import GenerationScope
from services.box.replica.replicator import Replicator
from services.ledger import Committed, Crash, Ledger, NoChange, Refusal
from services.move.lease import StagingWork
from services.objstore.port import Got, ObjectStore
from services.source import report as lr
from services.source.phases import PRODUCTION, TimingProfile, admission_refused, lease_timing
from services.source.preparing import (
    LaunchInputs,
    Observed,
    PreparingBox,
    PreparingRunner,
    decide_auto_cut,
    decide_preparing,
    decide_touch,
    plan_preparing,
    staging_refused,
)
from services.source.staging import MoveMarker, lane
from services.target.readiness import Check, TargetReport, write_report
from tests.helpers.cgtest import box_tree
from tests.helpers.pushonly import PushOnly
from tests.helpers.stores import Regions, regions

RNG = SeededRandom(11)
MV = new_op_id("mv", RNG)
INC = new_incarnation(RNG)
SRC, TGT = "ie-1", "uk-1"
NOW = 1_800_000_000_000
KEY = generate_private_key(SeededRandom(5))
OTHER_KEY = generate_private_key(SeededRandom(6))
UK_KEY = generate_private_key(SeededRandom(8))  # the target region's key the round archives are sealed to (§8)
SECRET = "s3cr3t-value-never-in-clear"
INSTANCE_ENV = {"APP_SECRET": SECRET, "PORT": "8080"}
AGENT_ENV = {"CARLOS_REGION": "ie", "CARLOS_HOST": "h"}
INHERITED = {"PATH": "/usr/bin", "CARLOS_SECRETS_KEY": "k", "PORT": "1"}
LAUNCH = LaunchInputs(env=lr.compose_env(INSTANCE_ENV, AGENT_ENV, INHERITED), bundle_etags={"app": '"e1"'},
                      overlay_etag='"o1"', release="r1")


def rec(state: str = "preparing", cut: str = "auto", **kw: Any) -> Record:
    move = Move(id=MV, incarnation=INC, to="uk", from_="ie", state=state, cut=cut, **kw)  # type: ignore[arg-type]
    return Record(host="h.example.com", gen=2, move=move)


def claim(touched: bool = True, **op_kw: Any) -> Claim:
    op: dict[str, Any] = dict(kind="moving", id=MV, exec=SRC, participants=(SRC, TGT))
    op.update(op_kw)
    t = Touched(regions=("ie", "uk"), boxes=(SRC, TGT)) if touched else Touched(regions=("ie",), boxes=(SRC,))
    return Claim(host="h.example.com", gen=3, holder=Holder(incarnation=INC, location=f"instances/h/{INC}",
                                                            generation="g1", session=1, stamp=1),
                 op=Op(**op), touched=t)


def target_report(host: str, move_id: str, at: int, ready: bool = True) -> TargetReport:
    checks = tuple(Check(f"T{i}", "pass") for i in range(1, 14)) if ready else (Check("T6", "fail", "disk full"),)
    return TargetReport(v=1, host=host, move_id=move_id, box=TGT, at=at, ready=ready, checks=checks)


def observed(now: int = NOW, **kw: Any) -> Observed:
    base: dict[str, Any] = dict(at=now, round_bytes=100, s1_ok=True, s1_detail="answered 200", strict=True,
                                strict_detail="", target=target_report("h.example.com", MV, now - 1000),
                                target_detail="", inputs=MoveInputs(release="r1", env_report="sha256:aa"))
    base.update(kw)
    return Observed(**base)


# -- pure ------------------------------------------------------------------------------------------------------


def test_the_report_reveals_names_and_equality_only_and_binds_its_move() -> None:
    report = lr.build_report(KEY, host="h.example.com", move_id=MV, box=SRC, at=NOW, env=LAUNCH.env,
                             inputs={"release": "r1"})
    assert set(report.env) == {"APP_SECRET", "PORT", "CARLOS_REGION", "CARLOS_HOST", "PATH"}, \
        "inherited CARLOS_* variables are not the agent's to pass on"
    assert SECRET.encode() not in msgspec.json.encode(report)
    v = lr.Verifier(report, KEY, host="h.example.com", move_id=MV)
    assert v.env_equal("PORT", "8080") is True, "instanceEnv wins over the inherited value"
    assert v.env_equal("PORT", "1") is False and v.env_equal("NOPE", "x") is None
    assert v.env_mismatches({**LAUNCH.env, "APP_SECRET": "other", "EXTRA": "1"}) == ["APP_SECRET", "EXTRA"]
    assert v.env_mismatches(dict(LAUNCH.env)) == []
    assert lr.Verifier(report, OTHER_KEY, host="h.example.com", move_id=MV).env_mismatches(dict(LAUNCH.env)) \
        == sorted(LAUNCH.env), "another secrets key matches nothing"
    other_op = new_op_id("mv", RNG)
    assert lr.derive_key(KEY, host="h.example.com", move_id=other_op) != lr.derive_key(KEY, host="h.example.com",
                                                                                      move_id=MV)
    with pytest.raises(lr.ReportError):
        lr.Verifier(report, KEY, host="h.example.com", move_id=other_op)
    later = msgspec.structs.replace(report, at=NOW + 5, measures={lr.DB_BYTES: "00"})
    assert later.digest() == report.digest(), "the pinned env_report changes with neither time nor measures"
    assert lr.build_report(KEY, host="h.example.com", move_id=MV, box=SRC, at=NOW, env={**LAUNCH.env, "PORT": "9"},
                           inputs={"release": "r1"}).digest() != report.digest()


@pytest.mark.parametrize(("record", "state", "kind"), [
    (rec(), claim(), "round"),
    (rec("ready"), claim(), "round"),
    (rec(), claim(touched=False), "touch"),
    (rec("cutting", cut_phase="requested"), claim(), "idle"),
    (rec(), claim(exec=TGT), "blocked"),
    (rec(), claim(id="mv_" + "q" * 26), "blocked"),
    (rec(), claim(kind="serving"), "blocked"),
    (rec(), claim(participants=(TGT, SRC)), "blocked"),
])
def test_plan_names_the_preparing_step_from_durable_state(record: Record, state: Claim, kind: str) -> None:
    step = plan_preparing(record, state, source=SRC, move_id=MV, incarnation=INC)
    assert step.kind == kind, step.reason
    assert plan_preparing(record, state, source=SRC, move_id=MV, incarnation="other").kind == "idle"


def test_touch_adds_the_target_region_and_box_once_under_k5() -> None:
    out = decide_touch(claim(touched=False), MV, SRC, "uk")
    assert isinstance(out, Claim) and out.touched.regions == ("ie", "uk") and out.touched.boxes == (SRC, TGT)
    assert isinstance(decide_touch(out, MV, SRC, "uk"), NoChange)
    assert isinstance(decide_touch(claim(touched=False, exec=TGT), MV, SRC, "uk"), Refusal)


def test_preparing_records_the_reason_once_and_clears_it_at_ready() -> None:
    out = decide_preparing(rec(), MV, INC, observed(s1_ok=False, s1_detail="refused"), NOW, PRODUCTION, "h")
    assert isinstance(out, Record) and out.move is not None and out.move.state == "preparing"
    assert out.move.reason.startswith(say("M-C16", host="h")) and "refused" in out.move.reason
    again = decide_preparing(out, MV, INC, observed(s1_ok=False, s1_detail="refused"), NOW, PRODUCTION, "h")
    assert isinstance(again, NoChange), "an unchanged reason is not rewritten"
    ready = decide_preparing(out, MV, INC, observed(), NOW, PRODUCTION, "h")
    assert isinstance(ready, Record) and ready.move is not None
    assert (ready.move.state, ready.move.reason, ready.move.ready_at) == ("ready", "", NOW)
    other = observed(target=target_report("h.example.com", "mv_" + "z" * 26, NOW))
    missing = decide_preparing(rec(), MV, INC, other, NOW, PRODUCTION, "h")
    assert isinstance(missing, Record) and missing.move is not None and "uk cannot take" in missing.move.reason
    assert isinstance(decide_preparing(rec("cutting"), MV, INC, observed(), NOW, PRODUCTION, "h"), NoChange)


def test_auto_cut_requests_the_cut_and_manual_waits() -> None:
    out = decide_auto_cut(rec("ready"), MV, INC, NOW, "h")
    assert isinstance(out, Record) and out.move is not None
    assert (out.move.state, out.move.cut_phase) == ("cutting", "requested")
    assert isinstance(decide_auto_cut(out, MV, INC, NOW, "h"), NoChange), "requested once"
    manual = decide_auto_cut(rec("ready", cut="manual"), MV, INC, NOW, "h")
    assert isinstance(manual, NoChange) and manual.reason == say("M-C12", host="h")
    assert isinstance(decide_auto_cut(rec(), MV, INC, NOW, "h"), NoChange), "only a ready move is cut"
    held = decide_auto_cut(rec("ready"), MV, INC, NOW, "h", blocked="the pinned input release changed")
    assert isinstance(held, NoChange) and "release" in held.reason, "no cut the admission would bounce"


def test_at_ready_a_changed_input_is_re_pinned_only_when_every_check_is_fresh() -> None:
    pinned = MoveInputs(release="r1", env_report="sha256:aa")
    ready = rec("ready", inputs=pinned, ready_at=NOW - 5000)
    assert isinstance(decide_preparing(ready, MV, INC, observed(inputs=pinned), NOW, PRODUCTION, "h"), NoChange)
    moved = MoveInputs(release="r2", env_report="sha256:aa")
    out = decide_preparing(ready, MV, INC, observed(inputs=moved), NOW, PRODUCTION, "h")
    assert isinstance(out, Record) and out.move is not None
    assert (out.move.state, out.move.inputs, out.move.ready_at) == ("ready", moved, NOW)
    stale = decide_preparing(ready, MV, INC, observed(inputs=moved, s1_ok=False), NOW, PRODUCTION, "h")
    assert isinstance(stale, NoChange) and "release changed" in stale.reason


# -- the real stack --------------------------------------------------------------------------------------------


Buckets = Regions


@pytest_asyncio.fixture(loop_scope="session", scope="module")
async def buckets(stack: StackInfo, unique: Callable[[str], str]) -> AsyncIterator[Buckets]:
    """One deployment bucket and the two regions' data buckets for the module; keys are per host and move."""
    async with regions(stack, unique, "prep") as b:
        yield b


@pytest.fixture(scope="module")
def instance_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real OS process answering HTTP: the running instance S1 probes (its readiness path answers 200)."""
    root = tmp_path_factory.mktemp("www")
    (root / "healthz").write_text("ok")
    proc = subprocess.Popen([sys.executable, "-u", "-m", "http.server", "0", "--bind", "127.0.0.1",
                             "--directory", str(root)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().decode()  # "Serving HTTP on 127.0.0.1 port N (...)", printed once bound
        assert "port" in line, f"the HTTP server did not start: {line!r}"
        port = int(line.split("port")[1].split()[0])
        yield f"http://127.0.0.1:{port}/healthz"
    finally:
        proc.kill()
        proc.wait(timeout=10)


def closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/healthz"  # nothing listens: the instance does not answer


@dataclass
class World:
    b: Buckets
    host: str
    move_id: str
    box_dir: Path
    rep: Replicator
    clock: ManualClock
    tree: CgroupTree
    url: str | None
    launch: LaunchInputs = LAUNCH
    during_round: Callable[[], Awaitable[None]] | None = None
    push: PushOnly | None = None

    @property
    def db(self) -> Path:
        return self.box_dir / "data" / f"{self.host}.db"

    def ledger(self, faults: Callable[[str], None] | None = None) -> Ledger:
        return Ledger(self.b.store, self.b.events, self.clock, Actor(service="source", pid=1, nonce="p"),
                      self.b.deploy, faults=faults)

    def runner(self, profile: TimingProfile = PRODUCTION, tree: Any = None, armed: bool = False,
               faults: Callable[[str], None] | None = None) -> PreparingRunner:
        b = self.b
        if self.push is None:
            self.push = PushOnly(b.store, b.uk)  # M17: the source never reads the target's bucket
        stores: dict[str, tuple[ObjectStore, str]] = {"uk": (self.push, b.uk)}

        async def launch(host: str) -> LaunchInputs:
            if self.during_round is not None:
                await self.during_round()
            return self.launch

        box = PreparingBox(
            label=SRC, region="ie", ledger=self.ledger(faults), deploy_store=b.store, deploy_bucket=b.deploy,
            data_store=b.store, data_bucket=b.ie, staging=stores.__getitem__, secrets_key=KEY,
            tree=tree or self.tree, clock=self.clock, files_dir=lambda h: self.box_dir / "data" / h,
            db_path=lambda h: self.db, launch=launch, ready_url=lambda h: self.url, probe_timeout_s=2.0,
            recovery_armed=lambda h: armed, target_key=lambda region: UK_KEY.public_key(),
        )
        return PreparingRunner(box, profile)

    async def target_ready(self, at: int | None = None) -> None:
        await write_report(self.b.store, self.b.deploy, target_report(self.host, self.move_id,
                                                                      self.clock.now_ms() if at is None else at))

    def write(self, n: int) -> None:
        conn = sqlite3.connect(self.db)
        try:
            conn.executemany("INSERT INTO t (v) VALUES (?)", [(f"row-{i}".encode() * 50,) for i in range(n)])
            conn.commit()
        finally:
            conn.close()

    async def record(self) -> Record:
        r = (await self.ledger().read_record(self.host)).state
        assert r is not None
        return r

    async def move(self) -> Move:
        m = (await self.record()).move
        assert m is not None
        return m

    async def setup(self, cut: str) -> None:
        location = f"instances/{self.host}/{INC}"
        c = Claim(host=self.host, gen=1, holder=Holder(incarnation=INC, location=location, generation="g1",
                                                       session=1, stamp=1),
                  op=Op(kind="moving", id=self.move_id, exec=SRC, participants=(SRC, TGT),
                        intent={"to": "uk", "target": TGT}),
                  touched=Touched(regions=("ie",), boxes=(SRC,)))
        m = Move(id=self.move_id, incarnation=INC, to="uk", from_="ie", state="preparing",
                 cut=cut, requested_at=self.clock.now_ms())  # type: ignore[arg-type]
        ledger = self.ledger()
        for obj, state in (("claim", c), ("record", Record(host=self.host, gen=1, move=m))):
            out = await ledger.transition(obj, self.host, "test-setup", lambda cur, s=state: s)  # type: ignore
            assert isinstance(out, Committed)


@pytest_asyncio.fixture(loop_scope="session")
async def make_world(buckets: Buckets, unique: Callable[[str], str], tmp_path: Path,
                     instance_url: str) -> AsyncIterator[Callable[..., Any]]:
    made: list[World] = []
    with box_tree(unique("box.prep")) as (tree, _home):

        async def make(cut: str = "auto", url: str | None = instance_url) -> World:
            host = f"{unique('shop')}.example.com"
            box_dir = tmp_path / host
            (box_dir / "data" / host).mkdir(parents=True)
            (box_dir / "data" / host / "notes.txt").write_text("kept across regions")
            db = box_dir / "data" / f"{host}.db"
            conn = sqlite3.connect(db)
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, v BLOB)")
            conn.commit()
            conn.close()
            rep = await Replicator.open(buckets.store, buckets.ie, f"instances/{host}/{INC}", "g1", db, WallClock())
            w = World(buckets, host, new_op_id("mv", SystemRandom()), box_dir, rep, ManualClock(NOW), tree, url)
            made.append(w)
            w.write(40)
            await rep.sync()
            await w.setup(cut)
            return w

        try:
            yield make
        finally:
            for w in made:
                if not w.rep._closed:
                    await w.rep.close()


def s3_requests() -> Counter[str]:
    """This process's S3 requests so far by operation (``hostmove_s3_requests_total``, issue 19 item 5)."""
    out: Counter[str] = Counter()
    for metric in metrics.S3_REQUESTS.collect():
        for sample in metric.samples:
            if sample.name.endswith("_total"):
                out[sample.labels["operation"]] += int(sample.value)
    return out


async def grow(w: World, syncs: int) -> None:
    """``syncs`` level-0 files, each a write and a sync, compacted into level 1 as the sync loop does (every third
    file; compaction deletes what it merged, bar the newest level-0 file: the stored history grows in versions)."""
    for i in range(syncs):
        w.write(1)
        await w.rep.sync()
        if i % 3 == 2:
            await w.rep.compact(1, min_inputs=3)


@pytest.mark.timeout(900)
async def test_a_round_costs_what_changed_not_what_is_stored(make_world: Any) -> None:
    """Issue 19 item 9 (§7.3 rounds): after its first round, a preparing round of a host with about 360 files
    stored makes as many S3 requests (within one) as one with about 15, for the same change since the last round
    (three new level-0 files merged into a new level-1 file): it lists each level only after what the journal records
    there and looks again only at what the new file covers. The lane mirrors the source's current files exactly.
    (The writer deletes its own merged uploads by exact version, so the history stored is files, not versions; the
    ladder here stops at level 1, so they pile up as a long session's would between snapshots.)"""
    costs: dict[int, Counter[str]] = {}
    stored: dict[int, int] = {}
    for syncs in (21, 540):
        w: World = await make_world()
        await grow(w, syncs)
        scope = GenerationScope(f"instances/{w.host}/{INC}", "g1")
        stored[syncs] = len(await w.b.store.list_versions(w.b.ie, scope.prefix))
        first = await w.runner().run(w.host, w.move_id, INC)
        assert first.step.kind == "round" and first.observed is not None and not first.observed.staging_refused
        await grow(w, 3)
        w.clock.advance(1_000)
        before = s3_requests()
        second = await w.runner().run(w.host, w.move_id, INC)
        costs[syncs] = s3_requests() - before
        assert second.observed is not None and second.observed.round_bytes > 0, "the new files were staged"
        staged = lane(w.host, w.move_id) + "replica/"
        src = {k[len(scope.prefix):] for k in await w.b.store.list_keys(w.b.ie, scope.prefix) if scope.parse(k)}
        assert {k[len(staged):] for k in await w.b.store.list_keys(w.b.uk, staged)} == src, \
            "replica/ holds exactly the generation's current files after the round"
    assert stored[540] >= 20 * stored[21] > 0, stored
    small, big = sum(costs[21].values()), sum(costs[540].values())
    assert big <= small + 1, f"a round with {stored[540]} versions stored made {big} requests, with {stored[21]} " \
        f"{small}: {dict(costs[540])} against {dict(costs[21])}"
    assert costs[540]["list_object_versions"] == costs[21]["list_object_versions"]


async def test_a_round_stages_the_marker_once_mirrors_the_replica_and_reports(make_world: Any) -> None:
    w: World = await make_world()
    first = await w.runner().run(w.host, w.move_id, INC)
    assert (first.step.kind, first.state) == ("round", "preparing"), "no target report yet: not ready"
    assert first.reason == say("M-C4", to_region="uk",
                               reason="the target's readiness report is missing or older than 600 s")
    assert (await w.move()).reason == first.reason, "the reason is on the record for the operator"
    claim_now = (await w.ledger().read_claim(w.host)).state
    assert claim_now is not None and "uk" in claim_now.touched.regions and TGT in claim_now.touched.boxes
    staged = lane(w.host, w.move_id)
    marker_versions = [v for v in await w.b.store.list_versions(w.b.uk, staged + "move.json")]
    assert len(marker_versions) == 1
    got = await w.b.store.get(w.b.uk, staged + "move.json")
    assert isinstance(got, Got) and decode(got.body, MoveMarker) == MoveMarker(
        move_id=w.move_id, incarnation=INC, host=w.host, from_="ie", to="uk")
    scope = GenerationScope(f"instances/{w.host}/{INC}", "g1")
    src_files = [k[len(scope.prefix):] for k in await w.b.store.list_keys(w.b.ie, scope.prefix)
                 if scope.parse(k) is not None]
    replica = [k[len(staged + "replica/"):] for k in await w.b.store.list_keys(w.b.uk, staged + "replica/")]
    assert src_files and replica == src_files, "replica/ holds exactly the generation's current files"
    assert first.observed is not None and first.observed.round_bytes > 0

    w.write(10)
    await w.rep.sync()
    w.clock.advance(1_000)
    second = await w.runner().run(w.host, w.move_id, INC)
    assert second.observed is not None and 0 < second.observed.round_bytes < first.observed.round_bytes
    assert await w.b.store.list_versions(w.b.uk, staged + "move.json") == marker_versions, \
        "a second round does not rewrite move.json"
    assert w.push is not None and w.push.writes and w.push.refused == [], "push-only: never a read of uk (M17)"

    body = await w.b.store.get(w.b.deploy, lr.report_key(w.host, w.move_id))
    assert isinstance(body, Got) and SECRET.encode() not in body.body
    report = await lr.read_report(w.b.store, w.b.deploy, w.host, w.move_id)
    assert report.at == w.clock.now_ms() and report.box == SRC
    v = lr.Verifier(report, KEY, host=w.host, move_id=w.move_id)
    assert v.env_mismatches(dict(LAUNCH.env)) == []
    assert v.measure_equal(lr.DB_BYTES, str(w.db.stat().st_size)) is True
    assert v.measure_equal(lr.DB_BYTES, "1") is False
    assert v.input_equal(lr.RELEASE, "r1") and v.input_equal(lr.BUNDLE_PREFIX + "app", '"e1"')
    assert lr.Verifier(report, OTHER_KEY, host=w.host, move_id=w.move_id).env_mismatches(dict(LAUNCH.env)) == \
        sorted(LAUNCH.env), "another key verifies nothing"
    other_op = new_op_id("mv", SystemRandom())
    forged = msgspec.structs.replace(report, move_id=other_op)
    assert lr.Verifier(forged, KEY, host=w.host, move_id=other_op).env_mismatches(dict(LAUNCH.env)) == \
        sorted(LAUNCH.env), "a report moved to another op verifies nothing"


async def test_fresh_reports_make_the_move_ready_with_inputs_pinned_then_auto_cut(make_world: Any) -> None:
    w: World = await make_world()
    await w.target_ready()
    result = await w.runner().run(w.host, w.move_id, INC)
    assert (result.state, result.reason) == ("cutting", ""), result.reason
    m = await w.move()
    assert (m.state, m.cut_phase, m.ready_at, m.reason) == ("cutting", "requested", NOW, "")
    report = await lr.read_report(w.b.store, w.b.deploy, w.host, w.move_id)
    assert m.inputs.env_report == report.digest()
    assert (dict(m.inputs.bundle_etags), m.inputs.overlay_etag, m.inputs.release) == ({"app": '"e1"'}, '"o1"', "r1")
    assert m.inputs.files_plain.startswith("sha256:") and len(m.inputs.files_plain) == 71
    gen = (await w.record()).gen
    again = await w.runner().run(w.host, w.move_id, INC)
    assert again.step.kind == "idle" and (await w.record()).gen == gen, "a cut move is left to the cut worker"


async def test_a_manual_move_stays_ready_and_says_so(make_world: Any) -> None:
    w: World = await make_world(cut="manual")
    await w.target_ready()
    result = await w.runner().run(w.host, w.move_id, INC)
    assert (result.state, result.reason) == ("ready", say("M-C12", host=w.host))
    gen = (await w.record()).gen
    w.clock.advance(5_000)
    again = await w.runner().run(w.host, w.move_id, INC)
    assert (again.state, again.step.kind) == ("ready", "round"), "rounds continue at ready for the admission"
    m = await w.move()
    assert (await w.record()).gen == gen and m.ready_at == NOW and m.cut_phase == ""


async def test_s1_failing_keeps_the_move_preparing_with_the_reason(make_world: Any) -> None:
    w: World = await make_world(url=closed_port_url())
    await w.target_ready()
    result = await w.runner().run(w.host, w.move_id, INC)
    assert result.state == "preparing"
    m = await w.move()
    assert m.state == "preparing" and m.ready_at is None
    assert m.reason.startswith(say("M-C16", host=w.host)) and "did not answer" in m.reason
    w.url = None
    await w.runner().run(w.host, w.move_id, INC)
    assert "no readiness path is declared" in (await w.move()).reason


async def test_s2_without_strict_spawns_keeps_the_move_preparing(make_world: Any) -> None:
    w: World = await make_world()
    await w.target_ready()
    result = await w.runner(tree=CgroupTree(None, "no-cgroup")).run(w.host, w.move_id, INC)
    assert result.state == "preparing"
    reason = (await w.move()).reason
    assert "would not be strict" in reason and "no cgroup v2" in reason


async def test_a_round_over_the_bar_keeps_preparing_until_a_round_fits(make_world: Any) -> None:
    """The bar is the profile's (16 MiB in production); a 4 KiB bar lets real rounds cross it cheaply."""
    w: World = await make_world(cut="manual")
    w.write(200)
    await w.rep.sync()
    await w.target_ready()
    small = dataclasses.replace(PRODUCTION, bar_bytes=4096)
    over = await w.runner(small).run(w.host, w.move_id, INC)
    assert over.observed is not None and over.observed.round_bytes > 4096
    assert over.state == "preparing" and "above the 4096-byte bar" in over.reason
    w.clock.advance(1_000)
    fits = await w.runner(small).run(w.host, w.move_id, INC)
    assert fits.observed is not None and fits.observed.round_bytes == 0, "nothing new: the round copies nothing"
    assert fits.state == "ready"


async def test_a_move_never_ready_within_its_prepare_bound_aborts_itself(make_world: Any) -> None:
    """§7.11: readiness never comes (the source's readiness path does not answer); one prepare bound after the
    request the source records the abort with the reason, so the abort's close runs with no human. A move that
    was ready (a manual cut waiting for its operator) never aborts itself."""
    w: World = await make_world(url=closed_port_url())
    await w.target_ready()
    assert (await w.runner().run(w.host, w.move_id, INC)).state == "preparing"
    requested = (await w.move()).requested_at
    assert requested is not None
    w.clock.advance(int(PRODUCTION.prepare_bound_s * 1000) - (w.clock.now_ms() - requested))
    assert (await w.runner().run(w.host, w.move_id, INC)).state == "preparing", "not before the bound"
    w.clock.advance(1)
    out = await w.runner().run(w.host, w.move_id, INC)
    m = await w.move()
    assert out.state == "aborted" and m.state == "aborted" and "never ready within 3600 s" in m.reason
    assert "no reason recorded" not in m.reason and "cannot take this move yet" in m.reason, (
        "the reason it was not ready is kept")
    manual: World = await make_world(cut="manual")
    await manual.target_ready()
    assert (await manual.runner().run(manual.host, manual.move_id, INC)).state == "ready"
    manual.clock.advance(int(PRODUCTION.prepare_bound_s * 1000) * 2)
    assert (await manual.move()).state == "ready"
    await manual.runner().run(manual.host, manual.move_id, INC)
    assert (await manual.move()).state == "ready", "a ready move waits for its operator"


async def test_a_stale_target_report_does_not_make_ready(make_world: Any) -> None:
    w: World = await make_world()
    await w.target_ready()
    w.clock.advance(600_001)  # the report is now older than 10 minutes (§7.3)
    stale = await w.runner().run(w.host, w.move_id, INC)
    assert stale.state == "preparing" and "older than 600 s" in stale.reason
    assert (await w.move()).ready_at is None
    await w.target_ready()
    fresh = await w.runner().run(w.host, w.move_id, INC)
    assert fresh.state == "cutting"


async def test_a_crash_after_the_ready_cas_replays_to_the_auto_cut(make_world: Any) -> None:
    """Journal first: the worker dies right after ``preparing -> ready``; a new runner (nothing in memory) finds
    ``ready`` and requests the cut, without a second ready write."""
    w: World = await make_world()
    await w.target_ready()
    cases: list[str] = []

    def faults(point: str) -> None:
        if point == "after_cas":
            cases.append(point)
            if len(cases) == 2:  # 1: the touch of the claim, 2: preparing -> ready
                raise Crash("the source died after the ready CAS")

    with pytest.raises(Crash):
        await w.runner(faults=faults).run(w.host, w.move_id, INC)
    m = await w.move()
    assert (m.state, m.ready_at) == ("ready", NOW)
    w.clock.advance(2_000)
    again = await w.runner().run(w.host, w.move_id, INC)
    m = await w.move()
    assert (again.state, m.state, m.cut_phase, m.ready_at) == ("cutting", "cutting", "requested", NOW)


async def test_the_readiness_port_feeds_the_cut_admission_with_stable_inputs(make_world: Any) -> None:
    """``PreparingRunner.readiness`` is ``SourceWorker``'s port: a later round's inputs equal the pinned ones
    (the report's digest ignores its time), so the admission passes once source recovery is armed (T13)."""
    w: World = await make_world()
    await w.target_ready()
    await w.runner().run(w.host, w.move_id, INC)
    m = await w.move()
    assert m.state == "cutting"
    w.clock.advance(30_000)
    await w.target_ready()
    armed = await w.runner(armed=True).readiness(w.host)
    assert armed.inputs == m.inputs and armed.source_ready_at == w.clock.now_ms()
    assert admission_refused(m, armed, w.clock.now_ms(), PRODUCTION) is None
    unarmed = await w.runner().readiness(w.host)
    assert "recoverySourceArmed" in (admission_refused(m, unarmed, w.clock.now_ms(), PRODUCTION) or "")
    w.write(500)
    await w.rep.sync()
    (w.box_dir / "data" / w.host / "upload.bin").write_bytes(b"x" * 1000)
    busy = await w.runner(armed=True).readiness(w.host)
    assert busy.inputs.files_plain != m.inputs.files_plain, "the files changed"
    assert admission_refused(m, busy, w.clock.now_ms(), PRODUCTION) is None, \
        "a serving instance's own writes never refuse its cut"
    w.launch = dataclasses.replace(LAUNCH, env={**LAUNCH.env, "APP_SECRET": "rotated"})
    changed = await w.runner(armed=True).readiness(w.host)
    why = admission_refused(m, changed, w.clock.now_ms(), PRODUCTION)
    assert why is not None and "env_report changed" in why, "a changed launch environment is checked again"


async def test_a_changed_launch_input_at_ready_is_re_pinned_once_the_checks_are_fresh(make_world: Any) -> None:
    w: World = await make_world(cut="manual")
    await w.target_ready()
    await w.runner().run(w.host, w.move_id, INC)
    first = await w.move()
    assert first.state == "ready" and first.inputs.release == "r1"
    w.launch = dataclasses.replace(LAUNCH, release="r2")
    w.clock.advance(600_001)  # the target's report is stale now: nothing is re-pinned on stale checks
    stale = await w.runner().run(w.host, w.move_id, INC)
    assert (await w.move()).inputs.release == "r1" and stale.state == "ready"
    await w.target_ready()
    await w.runner().run(w.host, w.move_id, INC)
    m = await w.move()
    assert (m.state, m.inputs.release, m.ready_at) == ("ready", "r2", w.clock.now_ms())
    assert m.inputs.env_report != first.inputs.env_report, "the launch report names the release it launches"


def exec_to(box: str) -> Callable[[Claim | None], Claim]:
    def decide(c: Claim | None) -> Claim:
        assert c is not None
        return msgspec.structs.replace(c, op=msgspec.structs.replace(c.op, exec=box))
    return decide


async def test_k5_blocks_a_round_before_any_staging_write(make_world: Any) -> None:
    w: World = await make_world()
    await w.target_ready()
    await w.ledger().transition("claim", w.host, "test-exec", exec_to(TGT))  # type: ignore[arg-type]
    blocked = await w.runner().run(w.host, w.move_id, INC)
    assert blocked.step.kind == "blocked" and f"execution holder is {TGT}" in blocked.reason
    assert await w.b.store.list_keys(w.b.uk, lane(w.host, w.move_id)) == [], "nothing is staged under a lost K5"
    assert not isinstance(await w.b.store.get(w.b.deploy, lr.report_key(w.host, w.move_id)), Got)
    await w.ledger().transition("claim", w.host, "test-exec", exec_to(SRC))  # type: ignore[arg-type]
    await w.runner().run(w.host, w.move_id, INC)
    assert (await w.move()).state == "cutting"


async def test_a_claim_taken_during_the_round_blocks_the_ready_cas(make_world: Any) -> None:
    w: World = await make_world()
    await w.target_ready()

    async def taken() -> None:
        w.during_round = None
        await w.ledger().transition("claim", w.host, "test-exec", exec_to(TGT))  # type: ignore[arg-type]

    w.during_round = taken
    result = await w.runner().run(w.host, w.move_id, INC)
    assert result.step.kind == "blocked" and f"execution holder is {TGT}" in result.reason
    m = await w.move()
    assert (m.state, m.ready_at) == ("preparing", None), "no ready CAS after the claim changed mid-round"


async def test_each_round_stages_its_files_archive_when_the_files_change(make_world: Any, tmp_path: Path) -> None:
    """§7.3 "Snapshot rounds": a round builds the files archive, sealed to the target region's key, when the
    plaintext digest changes, and stages it at ``files/`` where T5 reads the newest; an unchanged round rebuilds
    nothing. All push-only (M17)."""
    w: World = await make_world()
    staged = lane(w.host, w.move_id)
    await w.runner().run(w.host, w.move_id, INC)
    first = [v for v in await w.b.store.list_versions(w.b.uk, staged + "files/") if v.is_latest]
    assert sorted(v.key for v in first) == [staged + "files/archive.sealed", staged + "files/manifest.json"]
    archive = await w.b.store.get(w.b.uk, staged + "files/archive.sealed")
    manifest = await w.b.store.get(w.b.uk, staged + "files/manifest.json")
    assert isinstance(archive, Got) and isinstance(manifest, Got)
    out = extract(archive.body, manifest.body, UK_KEY, tmp_path / "t5", expect_op=w.move_id, expect_incarnation=INC,
                  fsync=False)
    assert (tmp_path / "t5" / "files" / "notes.txt").read_text() == "kept across regions" and out.entries >= 1
    w.clock.advance(1_000)
    await w.runner().run(w.host, w.move_id, INC)
    assert [v for v in await w.b.store.list_versions(w.b.uk, staged + "files/") if v.is_latest] == first, \
        "unchanged files: no new archive"
    (w.box_dir / "data" / w.host / "notes.txt").write_text("changed before the cut")
    w.clock.advance(1_000)
    await w.runner().run(w.host, w.move_id, INC)
    newest = await w.b.store.get(w.b.uk, staged + "files/manifest.json")
    assert isinstance(newest, Got) and newest.version_id != manifest.version_id, "changed files: a new archive"
    assert w.push is not None and w.push.refused == []


async def test_a_round_waits_while_another_writer_holds_the_staging_lease(make_world: Any) -> None:
    """§7.3, claim C3: a round takes the staging-work lease first. While another live writer holds it the round
    stages nothing, is not a round (never ``ready`` on it), and says why; once it is released the round stages."""
    w: World = await make_world()
    await w.target_ready()
    other = StagingWork(w.b.store, w.b.deploy, w.clock, lease_timing(PRODUCTION), region="uk", host=w.host,
                        op_id=w.move_id, holder="ie-1/stalled")
    await other.acquire()
    held = await w.runner().run(w.host, w.move_id, INC)
    assert held.state == "preparing" and "another staging writer" in held.reason
    assert held.observed is not None and held.observed.staging_refused
    assert await w.b.store.list_keys(w.b.uk, lane(w.host, w.move_id)) == [], "nothing staged without the lease"
    await other.release()
    again = await w.runner().run(w.host, w.move_id, INC)
    assert again.state == "cutting", again.reason
    assert await w.b.store.list_keys(w.b.uk, lane(w.host, w.move_id) + "replica/")


def test_staging_is_refused_once_the_rounds_have_ended_or_k5_k12_fail() -> None:
    """The revalidation after the staging lease (§7.3): the claim's op and phase, the record's state."""
    host = "h.example.com"
    c = Claim(host=host, gen=1, holder=Holder(incarnation=INC, location=f"instances/{host}/{INC}", generation="g1",
                                              session=1, stamp=1),
              op=Op(kind="moving", id=MV, exec=SRC, participants=(SRC, TGT)),
              touched=Touched(regions=("ie", "uk"), boxes=(SRC, TGT)))
    m = Move(id=MV, incarnation=INC, to="uk", from_="ie", state="preparing")

    def why(move: Move = m, claim: Claim = c) -> str | None:
        return staging_refused(Record(host=host, gen=1, move=move), claim, source=SRC, move_id=MV, incarnation=INC)

    assert why() is None
    assert why(msgspec.structs.replace(m, state="cutting", cut_phase="admitted")) is None, "the admission's round"
    assert "rounds have ended" in (why(msgspec.structs.replace(m, state="cutting", cut_phase="stopping")) or "")
    assert "sealed" in (why(claim=msgspec.structs.replace(c, op=msgspec.structs.replace(c.op, phase="sealed"))) or "")
    assert "execution holder" in (why(claim=msgspec.structs.replace(c, op=msgspec.structs.replace(c.op, exec=TGT)))
                                  or "")
    assert "touched" in (why(claim=msgspec.structs.replace(c, touched=Touched(regions=("ie",), boxes=(SRC,)))) or "")
    assert why(msgspec.structs.replace(m, incarnation="f" * 64)) == "the record holds another move"
