"""The target side of a move (spec §7.3 target readiness, §7.6 landing, §7.7 probe, §7.9 commit and open,
§7.13 crashes): pure deciders, the probe window's boundary (``TestProbeWindow``), and landings on the real
stack (SeaweedFS, NATS, real SQLite files, a real probe process) from staged inputs, with a crash after
every phase's effects."""

from __future__ import annotations

import io
import json
import os
import signal
import sqlite3
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import pytest
import pytest_asyncio

from bus.nats_log import NatsEventLog
from events import Actor, Claim
from events.claim import Holder, Op, Touched
from events.record import Move, MoveSource, Record, Rollback
from hostmove.probe_apps import ProbeApps, free_port
from hostmove.stackinfo import StackInfo
from kernel import rules
from kernel.ports import ManualClock, SystemRandom, WallClock
from moveprobe.config import probe_env
from services.box.artifacts.archive import build_archive, manifest_bytes
from services.box.artifacts.filesmanifest import read_manifest
from services.box.artifacts.markers import read_files_gen, read_generation_marker, read_local_gen
from services.box.artifacts.sealing import generate_private_key, secrets_key_fp
from services.box.instance.proctree import CgroupTree, SpawnJournal, current_cgroup_dir
from services.box.instance.registry import Registry
from services.box.instance.stamps import StampBook
from services.box.instance.timers import TimerRow, Timers, TimerSpec
from services.box.replica.install import read_install
from services.box.replica.replicator import Replicator
from services.box.replica.restore import restore_generation
from services.ledger import Committed, Ledger, NoChange, Refusal
from services.ledger.ledger import Crash
from services.objstore.port import Got, Won
from services.objstore.s3 import S3Store
from services.target import phases
from services.target.budget import Rates, t11
from services.target.phases import LANDING_PHASES, Expect
from services.target.probe import FAST, ProbeApp, ProbeTiming, ProcessApp, allowed_attempts, probe_attempt, run_probe
from services.target.readiness import (
    BoxFacts,
    Observations,
    archive_opens,
    assess,
    lane_probe,
    report_key,
    report_readiness,
    storage_probe,
    write_report,
)
from services.target.worker import Configure, LandingWorker, TargetBox, staging_prefix
from tests.helpers.cgtest import alive, box_tree, cgroup_root, forker, python_env, read_pid, wait_for

INC = "ef" * 32
MV = "mv_" + "a" * 26
SRC, TGT = "ie-1", "uk-1"
T0 = 1_700_000_000_000
EXPECT = Expect(MV, INC, TGT)


def landing_record(host: str = "h.example.com", **kw: Any) -> Record:
    base: dict[str, Any] = dict(id=MV, incarnation=INC, to="uk", from_="ie", state="landing", cut_phase="flipped",
                                cut_deadline=T0 + 120_000, landing_deadline=T0 + 300_000,
                                source=MoveSource(evidence=f"moves/{host}/{MV}/stopped-source.json"))
    base.update(kw)
    return Record(host=host, gen=4, move=Move(**base))


def landing_claim(host: str = "h.example.com", **op_kw: Any) -> Claim:
    op: dict[str, Any] = dict(kind="landing", id=MV, phase="checking", exec=TGT, participants=(SRC, TGT))
    op.update(op_kw)
    return Claim(host=host, gen=5, holder=Holder(incarnation=INC, location=f"instances/{host}/{INC}/",
                                                  generation="g0", stamp=2, session=1),
                 op=Op(**op), touched=Touched(regions=("ie",), boxes=(SRC,)))


def at_phase(phase: str, **kw: Any) -> Record:
    return landing_record(landing_phase=phase, **kw)


# -- the landing_phase machine (§7.6) ---------------------------------------------------------------


def test_every_legal_step_journals_the_next_phase_and_a_replay_changes_nothing() -> None:
    prev = ""
    for phase in LANDING_PHASES:
        sha = "ab" * 32 if phase == "probing" else ""
        out = phases.decide_enter(at_phase(prev), EXPECT, phase, T0, installed_db_sha256=sha)
        assert isinstance(out, Record) and out.move is not None
        assert out.move.landing_phase == phase and out.move.updated_at == T0
        if phase == "probing":
            assert out.move.landing.installed_db_sha256 == "ab" * 32
        assert isinstance(phases.decide_enter(out, EXPECT, phase, T0, installed_db_sha256=sha), NoChange)
        prev = phase
    assert phases.next_phase("probed") is None


@pytest.mark.parametrize("current", ["", *LANDING_PHASES])
def test_every_illegal_step_is_refused(current: str) -> None:
    legal = {current, phases.next_phase(current)}
    for phase in LANDING_PHASES:
        if phase in legal:
            continue
        out = phases.decide_enter(at_phase(current), EXPECT, phase, T0, installed_db_sha256="ab" * 32)
        assert isinstance(out, Refusal), (current, phase)


def test_probing_never_replays_an_earlier_phase() -> None:
    for earlier in LANDING_PHASES[:7]:
        assert isinstance(phases.decide_enter(at_phase("probing"), EXPECT, earlier, T0), Refusal)
    assert phases.REPLAY["probing"] == "restart-probe"


def test_enter_refusals() -> None:
    assert isinstance(phases.decide_enter(at_phase("restored"), EXPECT, "probing", T0), Refusal), "needs the sha"
    assert isinstance(phases.decide_enter(at_phase("local"), EXPECT, "configured", T0, installed_db_sha256="x"),
                      Refusal)
    late = at_phase("local", landing_deadline=T0)
    assert isinstance(phases.decide_enter(late, EXPECT, "configured", T0 + 1), Refusal)
    assert isinstance(phases.decide_enter(late, EXPECT, "configured", T0), Record), "at the deadline is in time"
    assert isinstance(phases.decide_enter(at_phase("local"), Expect(MV, "00" * 32, TGT), "configured", T0), Refusal)
    assert isinstance(phases.decide_enter(at_phase("local", state="committed"), EXPECT, "configured", T0), Refusal)
    rb = at_phase("local", rollback=Rollback(id="rb_" + "b" * 26, reason="x"))
    assert isinstance(phases.decide_enter(rb, EXPECT, "configured", T0), Refusal)
    assert isinstance(phases.decide_enter(None, EXPECT, "checking", T0), Refusal)


# -- the commit, the open and the rollback (§7.9, §7.8) ------------------------------------------------


def test_commit_is_bounded_by_the_earlier_deadline_and_never_lands_late() -> None:
    rec = at_phase("probed", cut_deadline=T0 + 100, landing_deadline=T0 + 200)
    ok = phases.decide_commit(rec, EXPECT, T0 + 100)
    assert isinstance(ok, Record) and ok.move is not None
    assert (ok.move.state, ok.move.committed_at) == ("committed", T0 + 100)
    late = phases.decide_commit(rec, EXPECT, T0 + 101)
    assert isinstance(late, Refusal) and "cut deadline" in late.reason
    rec2 = at_phase("probed", cut_deadline=T0 + 200, landing_deadline=T0 + 100)
    assert isinstance(phases.decide_commit(rec2, EXPECT, T0 + 100), Record)
    late2 = phases.decide_commit(rec2, EXPECT, T0 + 101)
    assert isinstance(late2, Refusal) and "landing deadline" in late2.reason
    assert isinstance(phases.decide_commit(at_phase("probed", cut_deadline=None, landing_deadline=None), EXPECT, T0),
                      Refusal)
    assert isinstance(phases.decide_commit(ok, EXPECT, T0 + 5000), NoChange), "a replay of a landed commit"


def test_commit_refused_before_probed_or_once_a_rollback_reason_is_recorded() -> None:
    for phase in ("", *LANDING_PHASES[:-1]):
        assert isinstance(phases.decide_commit(at_phase(phase), EXPECT, T0), Refusal)
    assert isinstance(phases.decide_commit(at_phase("probed", reason="probe failed"), EXPECT, T0), Refusal)
    rb = at_phase("probed", rollback=Rollback(id="rb_" + "b" * 26, reason="deadline"))
    assert isinstance(phases.decide_commit(rb, EXPECT, T0), Refusal)


def test_commit_and_rollback_exclude_each_other() -> None:
    rec = at_phase("probed")
    committed = phases.decide_commit(rec, EXPECT, T0)
    assert isinstance(committed, Record)
    assert isinstance(phases.decide_rollback(committed, EXPECT, "late", T0), Refusal)
    rolled = phases.decide_rollback(rec, EXPECT, "probe failed", T0)
    assert isinstance(rolled, Record) and rolled.move is not None and rolled.move.rollback is not None
    assert rolled.move.state == "rolling_back" and rolled.move.rollback.release_deadline == T0 + 15 * 60_000
    assert isinstance(phases.decide_commit(rolled, EXPECT, T0), Refusal)
    assert isinstance(phases.decide_rollback(rolled, EXPECT, "again", T0), NoChange)


def test_open_only_after_the_commit_and_once() -> None:
    assert isinstance(phases.decide_opened(at_phase("probed"), EXPECT, T0), Refusal)
    committed = phases.decide_commit(at_phase("probed"), EXPECT, T0)
    assert isinstance(committed, Record)
    opened = phases.decide_opened(committed, EXPECT, T0 + 1)
    assert isinstance(opened, Record) and opened.move is not None and opened.move.opened_at == T0 + 1
    assert isinstance(phases.decide_opened(opened, EXPECT, T0 + 2), NoChange)


def test_k5_and_touched() -> None:
    assert phases.claim_refusal(landing_claim(), EXPECT) is None
    assert "execution holder" in (phases.claim_refusal(landing_claim(exec=SRC), EXPECT) or "")
    assert phases.claim_refusal(landing_claim(kind="moving"), EXPECT) is not None
    assert phases.claim_refusal(landing_claim(id="mv_" + "z" * 26), EXPECT) is not None
    assert phases.claim_refusal(landing_claim(phase="committed"), EXPECT) is not None
    assert phases.claim_refusal(landing_claim(phase="committed"), EXPECT, committed=True) is None
    with rules.mutated(["k5-revalidate"]):
        assert phases.claim_refusal(landing_claim(exec=SRC), EXPECT) is None
    touched = phases.decide_touch(landing_claim(), EXPECT, "uk")
    assert isinstance(touched, Claim) and touched.touched.boxes == (SRC, TGT)
    assert touched.touched.regions == ("ie", "uk")
    assert isinstance(phases.decide_touch(touched, EXPECT, "uk"), NoChange)
    assert isinstance(phases.decide_touch(landing_claim(exec=SRC), EXPECT, "uk"), Refusal)


# -- the probe (§7.7) ----------------------------------------------------------------------------------


@dataclass
class EnvApp:
    """An app whose start fails until its environment is ready ``k`` seconds after the first start
    (the model of ``TestProbeWindow``); once started it answers readiness at once."""

    clock: ManualClock
    k: int
    first: int | None = None
    started_at: list[int] | None = None
    up: bool = False

    async def start(self) -> bool:
        now = self.clock.now_ms()
        self.first = now if self.first is None else self.first
        self.started_at = [*(self.started_at or []), now]
        self.up = now - self.first >= self.k * 1000
        return self.up

    async def running(self) -> bool:
        return self.up

    async def ready(self) -> bool:
        return self.up

    async def stop(self) -> None:
        self.up = False


STEP = ProbeTiming(window_s=30, settle_s=20, max_starts=100, first_backoff_s=1, backoff_factor=1, poll_s=1)


@pytest.mark.parametrize(("k", "ok", "reason"), [
    (29, True, None), (30, False, "window_passed_before_start"), (31, False, "window_passed_before_start"),
])
async def test_probe_window_boundary(k: int, ok: bool, reason: str | None) -> None:
    """``TestProbeWindow`` (rev 7.13, R12-2): k = 29 accepted; k = 30 fails before the start; k = 31 fails
    at the deadline with the environment still unready. No start ever happens at or after the deadline."""
    clock = ManualClock(T0)
    app = EnvApp(clock, k)
    res = await probe_attempt(app, clock, STEP)
    assert (res.ok, res.reason) == (ok, reason)
    assert res.deadline_ms == T0 + 30_000
    assert app.started_at is not None and max(app.started_at) < T0 + 30_000, "never started after the window"
    if ok:
        assert res.ready_at_ms == T0 + 29_000 and clock.now_ms() == T0 + 29_000 + 20_000, "settle then accept"
    else:
        assert clock.now_ms() == T0 + 30_000
        assert not app.up and (k == 30 or T0 + k * 1000 > clock.now_ms()), "k=31: the environment is still unready"


async def test_a_failed_attempt_names_the_window_and_settle_it_ran_under() -> None:
    """The operator's sentence names the profile's own window (the fast profile's 6 s, not production's 30 s)."""
    clock = ManualClock(T0)
    res = await probe_attempt(EnvApp(clock, 60), clock, ProbeTiming(window_s=6, settle_s=0.5, max_starts=100,
                                                                    first_backoff_s=1, backoff_factor=1, poll_s=1))
    assert res.reason == "window_passed_before_start"
    assert "the 6 s readiness window" in res.describe() and "30 s" not in res.describe()
    starts = await probe_attempt(EnvApp(clock, 60), clock, ProbeTiming(max_starts=3, first_backoff_s=1, poll_s=1))
    assert starts.reason == "starts_exhausted" and "failed to start 3 times" in starts.describe()


@dataclass
class SlowReady:
    """Answers readiness only after the request took ``delay_ms`` (the answer lands at the deadline)."""

    clock: ManualClock
    delay_ms: int
    stopped: bool = False
    alive: bool = True
    second_ok: bool = True
    calls: int = 0

    async def start(self) -> bool:
        return True

    async def running(self) -> bool:
        return self.alive

    async def ready(self) -> bool:
        self.calls += 1
        if self.calls == 1:
            self.clock.advance(self.delay_ms)
            return True
        return self.second_ok

    async def stop(self) -> None:
        self.stopped = True


async def test_readiness_at_the_deadline_is_stopped_and_fails() -> None:
    clock = ManualClock(T0)
    app = SlowReady(clock, 30_000)
    res = await probe_attempt(app, clock, STEP)
    assert (res.ok, res.reason, app.stopped) == (False, "ready_after_deadline", True)
    clock2 = ManualClock(T0)
    app2 = SlowReady(clock2, 29_999)
    assert (await probe_attempt(app2, clock2, STEP)).ok


async def test_settle_requires_the_process_and_a_second_request() -> None:
    clock = ManualClock(T0)
    app = SlowReady(clock, 0, second_ok=False)
    assert (await probe_attempt(app, clock, STEP)).reason == "second_request_failed"


async def test_five_failed_starts_end_the_attempt_and_the_waits_double() -> None:
    clock = ManualClock(T0)
    app = EnvApp(clock, 10_000)
    res = await probe_attempt(app, clock, ProbeTiming(window_s=30, settle_s=20, poll_s=1))
    assert (res.ok, res.reason, res.starts) == (False, "starts_exhausted", 5)
    assert app.started_at == [T0, T0 + 1000, T0 + 3000, T0 + 7000, T0 + 15_000], "waits 1, 2, 4, 8 s (15 s)"


@pytest.mark.parametrize(("admitted", "expected"), [(0, 0), (1, 1), (2, 2), (3, 3), (7, 3)])
async def test_attempts_never_exceed_t11(admitted: int, expected: int) -> None:
    clock = ManualClock(T0)
    made: list[int] = []

    async def attempt(i: int) -> ProbeApp:
        made.append(i)
        return EnvApp(clock, 10_000)

    res, app = await run_probe(attempt, clock, STEP, t11_admitted=admitted)
    assert not res.ok and app is None and len(res.attempts) == expected == allowed_attempts(admitted)
    assert made == list(range(1, expected + 1))


async def test_the_cut_deadline_bounds_the_whole_probe() -> None:
    clock = ManualClock(T0)
    app = EnvApp(clock, 5)
    res = await probe_attempt(app, clock, STEP, hard_deadline_ms=T0 + 10_000)
    assert (res.ok, res.reason) == (False, "cut_deadline"), "a settle past the cut deadline is not begun"


# -- the probe is a strict spawn (§5.3 "Every spawn under a move is strict", §7.7) ---------------------------------

CGSERVE = Path(__file__).parent / "helpers" / "cgserve.py"
QUICK = ProbeTiming(window_s=15, settle_s=0.2, first_backoff_s=0.05, poll_s=0.05, request_timeout_s=1.0)
PROBED = "probe.example.com"


@pytest.fixture
def probe_box(unique: Callable[[str], str], tmp_path: Path) -> Iterator[CgroupTree]:
    """A target box's cgroups with its spawn journal, scrubbed afterwards."""
    with box_tree(unique("box.probe")) as (tree, _home):
        tree.journal = SpawnJournal(tmp_path / "spawns")
        yield tree


def v2_cgroup(text: str) -> str:
    """The cgroup v2 path in a ``/proc/<pid>/cgroup`` text (``0::<path>``; hybrid hosts list v1 lines too)."""
    return next(line[3:] for line in text.splitlines() if line.startswith("0::"))


def leaf_path(tree: CgroupTree, host: str) -> str:
    return "/" + str(tree.leaf(host).relative_to(cgroup_root()))


async def test_the_probe_and_its_forked_worker_run_in_the_leaf_and_stop_drains_it(
    probe_box: CgroupTree, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    port = free_port()
    app = ProcessApp(argv=[sys.executable, str(CGSERVE), str(port), str(out)], port=port, host=PROBED,
                     tree=probe_box, request_timeout_s=1.0)
    try:
        res = await probe_attempt(app, WallClock(), QUICK)
        assert res.ok, res.describe()
        assert app.spawned is not None
        main_pid, worker = app.spawned.pid, read_pid(out / "worker.pid")
        # each read its own cgroup as its first act: both were in the host's leaf from the start
        assert v2_cgroup(read_text(out / "main.cgroup")) == leaf_path(probe_box, PROBED)
        assert v2_cgroup(read_text(out / "worker.cgroup")) == leaf_path(probe_box, PROBED)
        assert set(probe_box.members(PROBED)) == {main_pid, worker}
        history = probe_box.spawn_history(PROBED)
        assert (history.readable, history.strict, history.loose) == (True, 1, 0), "journaled as strict"

        os.kill(main_pid, signal.SIGKILL)  # the main process dies; its worker outlives it in the leaf
        wait_for(lambda: app.spawned is not None and app.spawned.process.poll() is not None, "the main process")
        assert not await app.running() and alive(worker) and probe_box.populated(PROBED)

        await app.stop()
        assert not alive(worker), "the forked worker was killed with the leaf"
        assert "populated 0" in (probe_box.leaf(PROBED) / "cgroup.events").read_text()
        assert probe_box.members(PROBED) == ()
    finally:
        await app.stop()


def read_text(path: Path) -> str:
    wait_for(path.exists, f"{path}")
    return path.read_text()


async def test_without_cgroup_v2_the_probe_fails_its_attempt_and_starts_nothing(tmp_path: Path) -> None:
    tree = CgroupTree(None, "box-without-cgroup2")
    marker = tmp_path / "ran"
    made: list[ProcessApp] = []

    async def attempt(i: int) -> ProbeApp:
        app = ProcessApp(argv=[sys.executable, "-c", f"open({str(marker)!r}, 'w')"], port=free_port(),
                         host=PROBED, tree=tree)
        made.append(app)
        return app

    res, running = await run_probe(attempt, WallClock(), QUICK, t11_admitted=3)
    assert not res.ok and running is None
    assert [(a.reason, a.starts) for a in res.attempts] == [("strict_refused", 1)], "one attempt, no retry"
    assert len(made) == 1 and made[0].spawned is None
    assert "refused to start the app outside its cgroup" in res.describe() and "no cgroup v2" in res.describe()
    assert not marker.exists(), "nothing ran"


async def test_a_populated_leaf_refuses_the_probe_and_leaves_no_process(probe_box: CgroupTree, tmp_path: Path) -> None:
    """A strict spawn needs an empty group: a process already there refuses the attempt (never a second,
    unaccounted process beside it), and the refused app's stop touches nothing it did not start."""
    ready, marker = tmp_path / "sleeper.pid", tmp_path / "ran"
    sleeper = probe_box.spawn_strict(PROBED, forker("sleep", str(ready)), env=python_env(), cwd=tmp_path,
                                     stdout=tmp_path / "o", stderr=tmp_path / "e")
    read_pid(ready)
    app = ProcessApp(argv=[sys.executable, "-c", f"open({str(marker)!r}, 'w')"], port=free_port(), host=PROBED,
                     tree=probe_box)
    res = await probe_attempt(app, WallClock(), QUICK)
    assert (res.ok, res.reason, res.starts) == (False, "strict_refused", 1)
    assert "still has processes" in res.detail and str(sleeper.pid) in res.detail
    assert probe_box.members(PROBED) == (sleeper.pid,) and not marker.exists()
    assert probe_box.spawn_history(PROBED).strict == 1, "a refused spawn is not journaled: it never started"
    await app.stop()
    assert alive(sleeper.pid) and probe_box.members(PROBED) == (sleeper.pid,)


async def test_probe_apps_spawn_moveprobe_strictly_and_leave_no_cgroup(tmp_path: Path) -> None:
    """The embedded default's probe factory: moveprobe and its forked worker in the host's leaf of a tree of the
    factory's own; the stop drains it and removes what the factory made."""
    home = current_cgroup_dir(cgroup_root())
    assert home is not None
    (tmp_path / "data").mkdir()
    apps = ProbeApps(home, tmp_path)
    app = await apps.factory(PROBED, 1, tmp_path / "data" / f"{PROBED}.db")
    tree = apps.tree
    assert tree is not None and tree.base is not None
    try:
        res = await probe_attempt(app, WallClock(), QUICK)
        assert res.ok, res.describe()
        members = tree.members(PROBED)
        assert len(members) == 2, f"moveprobe and its forked worker, both in the leaf: {members}"
        for pid in members:
            assert v2_cgroup(Path(f"/proc/{pid}/cgroup").read_text()) == leaf_path(tree, PROBED)
    finally:
        await apps.stop_all()
    assert not any(alive(pid) for pid in members)
    assert not tree.base.exists(), "the factory's own cgroups are removed"


# -- readiness (§7.3) -------------------------------------------------------------------------------


def good_obs(**kw: Any) -> Observations:
    base: dict[str, Any] = dict(
        box=TGT, region="uk", protocol=1, secrets_key_fp="fp", console_secrets_key_fp="fp",
        environment_matches=True, storage_ok=True, archive_ok=True, disk_free_bytes=100 << 30,
        disk_total_bytes=200 << 30, replica_bytes=1 << 20, release_staged=True, hosting_boxes=(TGT,), lane_ok=True,
        budget=t11(64, Rates(10, 250, 500)), landing_armed=True, rollback_target_armed=True,
    )
    base.update(kw)
    return Observations(**base)


def moving_claim() -> Claim:
    c = landing_claim(kind="moving", phase="sealed", exec=SRC)
    return msgspec.structs.replace(c, touched=Touched(regions=("ie", "uk"), boxes=(SRC, TGT)))


def test_readiness_passes_only_when_every_check_passes() -> None:
    rep = assess(good_obs(), moving_claim(), landing_record(state="preparing"), T0)
    assert rep.ready and [c.check for c in rep.checks] == [f"T{i}" for i in range(1, 14)]
    assert rep.t11_attempts == 2
    unobserved = {"protocol": "T1", "secrets_key_fp": "T2", "environment_matches": "T3", "storage_ok": "T4",
                  "archive_ok": "T5", "disk_free_bytes": "T6", "release_staged": "T7", "lane_ok": "T10",
                  "budget": "T11", "landing_armed": "T13"}
    for field_name, check in unobserved.items():
        bad = assess(good_obs(**{field_name: None}), moving_claim(), landing_record(state="preparing"), T0)
        assert not bad.ready and [c.check for c in bad.failing()] == [check], field_name
        assert check == "T13" or "not observed" in bad.failing()[0].detail
    checks = {
        "T2": good_obs(console_secrets_key_fp="other"),
        "T6": good_obs(disk_free_bytes=1 << 30),
        "T8": good_obs(hosting_boxes=(TGT, "uk-2")),
        "T11": good_obs(budget=t11(4096, Rates(10, 250, 500))),
        "T13": good_obs(rollback_target_armed=False),
    }
    for check, obs in checks.items():
        bad = assess(obs, moving_claim(), landing_record(state="preparing"), T0)
        assert [c.check for c in bad.failing()] == [check]


def test_readiness_t9_and_t12() -> None:
    rec = landing_record(state="preparing")
    untouched = msgspec.structs.replace(moving_claim(), touched=Touched(regions=("ie",), boxes=(SRC,)))
    assert [c.check for c in assess(good_obs(), untouched, rec, T0).failing()] == ["T9"]
    quiet = msgspec.structs.replace(moving_claim(), quiet_after={"uk": T0 + 1})
    assert [c.check for c in assess(good_obs(), quiet, rec, T0).failing()] == ["T12"]
    assert assess(good_obs(), quiet, rec, T0 + 1).ready


# -- the real stack ------------------------------------------------------------------------------------


@dataclass
class World:
    store: S3Store
    events: NatsEventLog
    bucket: str
    ledger: Ledger
    root: Path
    key: Any
    apps: list[ProcessApp]
    workers: list[LandingWorker]
    tree: CgroupTree


@pytest_asyncio.fixture(loop_scope="session", scope="module")
async def world_module(stack: StackInfo, unique: Callable[[str], str],
                tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[World]:
    store = await S3Store.open(stack.s3_endpoint, stack.s3_access_key, stack.s3_secret_key, stack.s3_region)
    events = await NatsEventLog.connect(stack.nats_url)
    bucket = unique("target")
    await store.create_bucket(bucket)
    ledger = Ledger(store, events, WallClock(), Actor(service="target", pid=1, nonce="t"), bucket)
    with box_tree(unique("box.uk")) as (tree, _home):  # the target box's cgroups: every probe is a strict spawn
        w = World(store, events, bucket, ledger, tmp_path_factory.mktemp("target"), generate_private_key(), [], [],
                  tree)
        yield w
        for app in w.apps:
            await app.stop()
    await store.delete_bucket(bucket)
    await events.close()
    await store.close()


@pytest_asyncio.fixture(loop_scope="session")
async def world(world_module: World) -> AsyncIterator[World]:
    """The module's world for one test; afterwards every probed writer a worker still runs is stopped (its
    replication loop included), so no test's background syncs slow the next."""
    yield world_module
    for worker in world_module.workers:
        for host_ in list(worker.running):
            await worker.running.stop(host_)
    world_module.workers.clear()


def make_box(w: World, label: str, *, ready: bool = True, faults: Callable[[str], None] | None = None,
             timing: ProbeTiming = FAST, configure: Configure | None = None, moveprobe: bool = False) -> LandingWorker:
    box_dir = w.root / label
    box_dir.mkdir(parents=True, exist_ok=True)
    clock = WallClock()

    async def factory(host: str, attempt: int, db_path: Path) -> ProbeApp:
        port = free_port()
        env: dict[str, str] = {}
        ready_path = "/"
        if moveprobe:  # the sample app: it opens the installed database and writes a boot row into it
            argv = [sys.executable, "-m", "moveprobe"]
            env = probe_env(data_dir=db_path.parent, host=host, region="uk", ack_log=box_dir / f"{host}.acks",
                            port=port, interval_s=3600)  # with its forked worker: the stop drains the leaf
            ready_path = "/ready"
        elif ready:  # a real process answering on its readiness path, serving the installed files
            argv = [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1",
                    "--directory", str(db_path.parent / host)]
        else:  # a real process that never answers
            argv = [sys.executable, "-c", "import time; time.sleep(60)"]
        app = ProcessApp(argv=argv, port=port, host=host, tree=w.tree, ready_path=ready_path, env=env,
                         request_timeout_s=0.5)
        w.apps.append(app)
        return app

    box = TargetBox(
        label=TGT, region="uk", box_dir=box_dir, data_store=w.store, data_bucket=w.bucket, ledger=w.ledger,
        registry=Registry.open(box_dir, clock), stamps=StampBook.open(box_dir, clock),
        timers=Timers.open(box_dir, clock), clock=clock, rng=SystemRandom(), private_key=w.key,
        probe_factory=factory, probe_timing=timing, configure=configure, sync_interval_s=0.2,
    )
    worker = LandingWorker(box, faults=faults)
    w.workers.append(worker)
    return worker


async def put_state(ledger: Ledger, obj: str, state: Claim | Record) -> None:
    out = await ledger.transition(obj, state.host, "test-setup", lambda cur: state)  # type: ignore[type-var,arg-type,return-value,misc]
    assert isinstance(out, Committed)


ROWS = 40


async def stage(w: World, host: str, *, now: int, cut_s: float = 120, seal_txid_delta: int = 0,
                staged_incarnation: str = INC, earlier_stay: bool = False, claim_exec: str = TGT) -> str:
    """What the source leaves before the flip: a replicated database in ``replica/``, a sealed archive,
    a timers snapshot, ``move.json`` and the stop evidence; a claim at landing/checking with exec = target
    and the seal; a record at state=landing. Answers the database's expected content digest."""
    lane = staging_prefix(host, MV)
    src = w.root / f"src-{host}"
    src.mkdir()
    db = src / "app.db"
    conn = sqlite3.connect(db, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("CREATE TABLE t(id INTEGER PRIMARY KEY, v TEXT)")
    rep = await Replicator.open(w.store, w.bucket, lane + "replica", "", db, ManualClock())
    for i in range(ROWS):
        conn.execute("INSERT INTO t VALUES (?, ?)", (i, f"row-{i}-" + "x" * 200))
        if i % 10 == 9:
            await rep.sync()
    await rep.close()
    conn.close()
    txid = rep.position
    versions = [v for v in await w.store.list_versions(w.bucket, lane + "replica/") if v.is_latest]
    assert versions and txid >= 4
    files = src / "files"
    (files / "uploads").mkdir(parents=True)
    (files / "uploads" / "a.txt").write_text("carried file")
    (files / "notes.txt").write_text("k-123")
    env = src / ".env"
    env.write_text("APP_MODE=moved\n")
    out = io.BytesIO()
    manifest = build_archive(files, env, out, w.key.public_key(), host=host, op_id=MV, incarnation=INC)

    async def put(key: str, body: bytes) -> str:
        res = await w.store.put(w.bucket, key, body)
        assert isinstance(res, Won) and res.version_id
        return res.version_id

    timers = Timers.open(src, WallClock())
    # a schedule, and a once-timer the source already delivered: its bookkeeping travels with the snapshot
    timers.replace_timers(host, [TimerSpec(name="tick", every_ms=60_000, payload="p"),
                                 TimerRow(name="once", at_ms=1_000, next_at=1_000, completed=True, last_run_at=1_500,
                                          registration=7)])
    seal = {  # the source's seal (services/source: staged, then archived adds the files)
        "n": txid + seal_txid_delta,
        "generation": "g0",
        "replica": {v.key[len(lane + "replica/"):]: v.version_id for v in versions},
        "timers": {"timers.json": await put(lane + "timers/timers.json", msgspec.json.encode(timers.list(host)))},
        "files": {"archive.sealed": await put(lane + "files/archive.sealed", out.getvalue()),
                  "manifest.json": await put(lane + "files/manifest.json", manifest_bytes(manifest))},
    }
    timers_sha = timers.digest(host)
    timers.close()
    if earlier_stay:  # what an earlier stay of this incarnation left at holder.location in this bucket
        await put(f"instances/{host}/{INC}/g-old/0000/0000000000000001-0000000000000001.ltx", b"old")
        await put(f"instances/{host}/{INC}/generation.json", b'{"op":"old"}')
    await put(lane + "move.json", json.dumps({"move_id": MV, "incarnation": staged_incarnation, "host": host,
                                              "from": "ie",
                                              "to": "uk"}).encode())
    evidence = f"moves/{host}/{MV}/stopped-source.json"
    await put(evidence, b'{"box":"ie-1"}')
    claim = landing_claim(host, journal={"seal": seal, "evidence.source": evidence}, exec=claim_exec)
    await put_state(w.ledger, "claim", claim)
    await put_state(w.ledger, "record", landing_record(
        host, cut_deadline=now + int(cut_s * 1000), landing_deadline=now + 600_000,
        source=MoveSource(evidence=evidence, timers_sha256=timers_sha)))
    return hashlib_rows(db)


def hashlib_rows(db: Path) -> str:
    conn = sqlite3.connect(db)
    try:
        return json.dumps(conn.execute("SELECT id, v FROM t ORDER BY id").fetchall())
    finally:
        conn.close()


async def replicated_boots(w: World, worker: LandingWorker, host: str) -> int:
    """Stop the probed writer (final sync), then restore its generation from the bucket and count boots."""
    await worker.running.stop(host)
    claim = (await w.ledger.read_claim(host)).state
    assert claim is not None and claim.holder is not None
    dest = w.root / f"check-{host}.db"
    await restore_generation(w.store, w.bucket, claim.holder.location, claim.holder.generation, dest)
    conn = sqlite3.connect(dest)
    try:
        assert hashlib_rows(dest) == hashlib_rows(worker.box.db_path(host)), "the remote holds the local database"
        return int(conn.execute("SELECT count(*) FROM boots").fetchone()[0])
    finally:
        conn.close()


async def assert_landed(
    w: World, worker: LandingWorker, host: str, rows: str, *, restarted: bool = False, running: bool = True
) -> None:
    rec = (await w.ledger.read_record(host)).state
    claim = (await w.ledger.read_claim(host)).state
    assert rec is not None and rec.move is not None and claim is not None and claim.holder is not None
    move = rec.move
    assert (move.state, move.landing_phase) == ("committed", "probed")
    assert move.committed_at is not None and move.opened_at is not None and move.cut_deadline is not None
    assert move.committed_at <= move.cut_deadline
    manifest = await read_install(w.store, w.bucket, claim.holder.location, MV)
    assert manifest is not None and move.landing.installed_db_sha256 == manifest.db_sha256
    assert claim.op.phase == "committed" and TGT in claim.touched.boxes and "uk" in claim.touched.regions
    # §7.14: the probe's cold admission moved holder.generation; the commit moved none (R10-3)
    admissions = claim.holder.admissions
    assert admissions[-1].box == TGT and claim.holder.generation == admissions[-1].generation
    marker = await read_generation_marker(w.store, w.bucket, claim.holder.location)
    assert marker.marker is not None and marker.marker.op == claim.holder.generation
    if restarted:  # a restarted probe: cold into a fresh generation restored from the dead probe's
        assert [a.generation for a in admissions] == [MV, claim.holder.generation] and claim.holder.generation != MV
        lost = admissions[-1].writes_lost
        assert lost is not None and (lost.box, lost.generation, lost.session) == (TGT, MV, admissions[0].session)
        # L17: the fresh generation holds its own files manifest, so the dead generation's park is not kept waiting
        files = await read_manifest(w.store, w.bucket, claim.holder.location, claim.holder.generation)
        assert files is not None, "the restarted probe's generation has no files manifest"
        assert "uploads/a.txt" in {e.path for e in files.manifest.files}, files.manifest
    else:
        assert [a.generation for a in admissions] == [MV] and admissions[0].coverage == "sealed"
        assert admissions[0].writes_lost is None
        assert marker.marker.snapshot_key == manifest.snapshot_key
    # a restarted probe's publication retires the dead probe's generation here (§7.14 item 5)
    owed = ["park-generation"] if restarted else []
    assert sorted(o.kind for o in claim.obligations) == [*owed, "park-staging", "park-superseded"]
    box = worker.box
    row = box.registry.get(host)
    assert row is not None and row.hold_op == "" and not row.held, "the conditional open left the hold"
    db = box.db_path(host)
    assert hashlib_rows(db) == rows and read_local_gen(db) == claim.holder.generation
    files_gen = read_files_gen(box.files_dir(host))
    assert files_gen is not None and (files_gen.op, files_gen.incarnation) == (MV, INC)
    assert (box.files_dir(host) / "uploads" / "a.txt").read_text() == "carried file"
    assert box.env_path(host).read_text() == "APP_MODE=moved\n"
    landed = {t.name: t for t in box.timers.list(host)}
    assert sorted(landed) == ["once", "tick"]
    assert landed["once"].completed and landed["once"].last_run_at == 1_500, "a delivered once-timer stays delivered"
    app = worker.running.get(host)
    if running:
        assert app is not None and app.process is not None, "the probed writer keeps running"
        assert await app.process.running() and await app.process.ready(), "the probed writer keeps running"
    else:  # the process that probed died after the commit; the next wake admits a writer (§7.9 step 2, K6)
        assert app is None


async def test_landing_on_the_real_stack(world: World, unique: Callable[[str], str]) -> None:
    host = f"{unique('land')}.example.com"
    rows = await stage(world, host, now=WallClock().now_ms(), earlier_stay=True)
    worker = make_box(world, "box-a", moveprobe=True)
    step = await worker.run(host)
    assert step.outcome == "opened", step
    await assert_landed(world, worker, host, rows)
    assert await replicated_boots(world, worker, host) == 1, "the probed writer's boot row reached its generation"
    # parking: the earlier stay's objects were copied under superseded/<host>/<op>/ and deleted (§7.6)
    old = f"instances/{host}/{INC}/g-old/0000/0000000000000001-0000000000000001.ltx"
    assert not isinstance(await world.store.get(world.bucket, old), Got)
    parked = await world.store.get(world.bucket, f"superseded/{host}/{MV}/objects/{old}")
    assert isinstance(parked, Got) and parked.body == b"old"
    assert isinstance(await world.store.get(world.bucket, f"superseded/{host}/{MV}/manifest.json"), Got)
    again = await worker.step(host)
    assert again.outcome == "done", "a replay of an open landing changes nothing"


class Crashes:
    def __init__(self, point: str) -> None:
        self.point = point
        self.fired = False

    def __call__(self, point: str) -> None:
        if point == self.point and not self.fired:
            self.fired = True
            raise Crash(point)


@pytest.mark.parametrize("point", [f"after_effects:{p}" for p in LANDING_PHASES[:-1]]
                         + ["building:restored", "open:after_leave_hold"])
async def test_crash_after_each_phase_replays_to_the_same_landing(
    world: World, unique: Callable[[str], str], point: str
) -> None:
    """§7.13: the process dies after a phase's effects and before its successor is journaled; a fresh
    worker (nothing in memory) replays the journaled phase by its rule and lands the same database."""
    host = f"{unique('crash')}.example.com"
    rows = await stage(world, host, now=WallClock().now_ms())
    label = f"box-{point.replace(':', '-')}"
    crash = Crashes(point)
    probing = point == "after_effects:probing"
    first = make_box(world, label, faults=crash, moveprobe=probing)
    with pytest.raises(Crash):
        await first.run(host)
    assert crash.fired
    for host_ in list(first.running):  # the dead process's probe app dies with it
        await first.running.stop(host_)
    rec = (await world.ledger.read_record(host)).state
    assert rec is not None and rec.move is not None
    expected = {"building:restored": "building", "open:after_leave_hold": "probed"}.get(point, point.split(":")[1])
    assert rec.move.landing_phase == expected
    if point == "open:after_leave_hold":  # committed, the hold left, opened_at not yet written
        assert rec.move.state == "committed" and rec.move.opened_at is None
    second = make_box(world, label, moveprobe=probing)
    step = await second.run(host)
    assert step.outcome == "opened", step
    await assert_landed(world, second, host, rows, restarted=probing, running=point != "open:after_leave_hold")
    if probing:  # the restarted probe's fresh generation was restored from the dead probe's, its boot included
        assert await replicated_boots(world, second, host) == 2


async def test_a_probe_that_never_answers_rolls_the_landing_back(world: World, unique: Callable[[str], str]) -> None:
    host = f"{unique('noprobe')}.example.com"
    await stage(world, host, now=WallClock().now_ms())
    timing = ProbeTiming(window_s=1.0, settle_s=0.2, first_backoff_s=0.05, poll_s=0.05, request_timeout_s=0.2)
    worker = make_box(world, "box-noprobe", ready=False, timing=timing)
    step = await worker.run(host)
    assert step.outcome == "rolled_back" and "probe failed" in step.detail, step
    rec = (await world.ledger.read_record(host)).state
    claim = (await world.ledger.read_claim(host)).state
    assert rec is not None and rec.move is not None and rec.move.rollback is not None
    assert rec.move.state == "rolling_back" and rec.move.committed_at is None and rec.move.landing_phase == "probing"
    assert claim is not None and claim.op.kind == "restoring" and claim.op.exec == TGT
    assert (await worker.step(host)).outcome == "stopped"


class ShiftClock(WallClock):
    """The wall clock, shifted forward on demand (the box's clock port; sleeps stay real)."""

    def __init__(self) -> None:
        self.offset_ms = 0

    def now_ms(self) -> int:
        return super().now_ms() + self.offset_ms


async def test_a_late_commit_never_lands(world: World, unique: Callable[[str], str]) -> None:
    """§7.9: the landing reaches ``probed`` in time, then the box's clock passes the cut deadline: the commit
    is refused and the move rolls back; nothing is committed or opened."""
    host = f"{unique('late')}.example.com"
    await stage(world, host, now=WallClock().now_ms(), cut_s=60)
    worker = make_box(world, "box-late")
    clock = ShiftClock()
    worker.box.clock = clock
    for _ in range(30):
        step = await worker.step(host)
        if step.phase == "probed":
            break
    assert step.outcome == "advanced" and step.phase == "probed", step
    clock.offset_ms = 61_000
    step = await worker.step(host)
    assert step.outcome == "rolled_back" and "cut deadline" in step.detail, step
    rec = (await world.ledger.read_record(host)).state
    assert rec is not None and rec.move is not None and rec.move.landing_phase == "probed"
    assert rec.move.state == "rolling_back" and rec.move.committed_at is None and rec.move.opened_at is None
    assert host not in worker.running, "the probed app is stopped when the landing rolls back"
    assert worker.box.registry.get(host) is not None and worker.box.registry.get(host).held  # type: ignore[union-attr]


async def test_an_expired_cut_deadline_gives_the_probe_no_attempt(world: World, unique: Callable[[str], str]) -> None:
    host = f"{unique('expired')}.example.com"
    await stage(world, host, now=WallClock().now_ms(), cut_s=0.001)
    step = await make_box(world, "box-expired").run(host)
    assert step.outcome == "rolled_back" and "after 0 attempt" in step.detail, step
    rec = (await world.ledger.read_record(host)).state
    assert rec is not None and rec.move is not None and rec.move.committed_at is None


async def test_a_seal_that_does_not_reach_n_rolls_back_in_building(world: World, unique: Callable[[str], str]) -> None:
    host = f"{unique('short')}.example.com"
    await stage(world, host, now=WallClock().now_ms(), seal_txid_delta=1)
    worker = make_box(world, "box-short")
    step = await worker.run(host)
    assert step.outcome == "rolled_back" and "does not restore" in step.detail, step
    rec = (await world.ledger.read_record(host)).state
    assert rec is not None and rec.move is not None and rec.move.landing_phase == "building"
    claim = (await world.ledger.read_claim(host)).state
    assert claim is not None and claim.holder is not None
    assert await read_install(world.store, world.bucket, claim.holder.location, MV) is None, "no completion"


async def test_readiness_probes_and_report_on_the_real_stack(world: World, unique: Callable[[str], str]) -> None:
    name = unique("probe")
    assert await storage_probe(world.store, world.bucket, name) == (True, "")
    assert await lane_probe(world.store, world.bucket, name) == (True, "")
    assert await world.store.list_keys(world.bucket, ".carlos-move-probe/" + name) == []
    assert await world.store.list_keys(world.bucket, "moves/_lane/" + name) == []
    host = f"{name}.example.com"
    rep = assess(good_obs(), moving_claim(), landing_record(host, state="preparing"), T0)
    await write_report(world.store, world.bucket, rep)
    got = await world.store.get(world.bucket, report_key(host, MV))
    assert isinstance(got, Got) and json.loads(got.body)["ready"] is True
    assert json.loads(got.body)["t11_attempts"] == 2


@pytest.mark.parametrize(("phase", "absent"), [("building", "install"), ("local", "files-gen")])
async def test_each_phase_is_journaled_before_its_effects(
    world: World, unique: Callable[[str], str], phase: str, absent: str
) -> None:
    """Journal first (§7.6): a crash as the phase's effects begin finds the phase already journaled and none of
    its effects done; the replay then does them."""
    host = f"{unique('jfirst')}.example.com"
    rows = await stage(world, host, now=WallClock().now_ms())
    label = f"box-jfirst-{phase}"
    crash = Crashes(f"before_effects:{phase}")
    first = make_box(world, label, faults=crash)
    with pytest.raises(Crash):
        await first.run(host)
    rec = (await world.ledger.read_record(host)).state
    assert rec is not None and rec.move is not None and rec.move.landing_phase == phase
    if absent == "install":
        assert await read_install(world.store, world.bucket, f"instances/{host}/{INC}/", MV) is None
    else:
        assert not (first.box.files_dir(host) / ".files-gen").exists() and not first.box.env_path(host).exists()
    second = make_box(world, label)
    assert (await second.run(host)).outcome == "opened"
    await assert_landed(world, second, host, rows)


async def test_k5_a_claim_naming_another_exec_writes_nothing(world: World, unique: Callable[[str], str]) -> None:
    host = f"{unique('k5')}.example.com"
    await stage(world, host, now=WallClock().now_ms(), claim_exec=SRC)
    worker = make_box(world, "box-k5")
    before = await world.ledger.read_record(host)
    step = await worker.run(host)
    assert step.outcome == "blocked" and "execution holder" in step.detail
    after = await world.ledger.read_record(host)
    assert after.etag == before.etag, "the record was not written"
    claim = (await world.ledger.read_claim(host)).state
    assert claim is not None and TGT not in claim.touched.boxes
    assert worker.box.registry.get(host) is None and not worker.box.journal_dir(host, MV).exists()


async def test_a_staging_lane_of_another_incarnation_rolls_back_in_checking(
    world: World, unique: Callable[[str], str]
) -> None:
    host = f"{unique('otherinc')}.example.com"
    await stage(world, host, now=WallClock().now_ms(), staged_incarnation="01" * 32)
    worker = make_box(world, "box-otherinc")
    step = await worker.run(host)
    assert step.outcome == "rolled_back" and "another move or incarnation" in step.detail, step
    rec = (await world.ledger.read_record(host)).state
    assert rec is not None and rec.move is not None and rec.move.landing_phase == "checking"
    assert worker.box.registry.get(host) is None, "no hold was written for a lane that is not this move's"


async def test_changed_configuration_rolls_back(world: World, unique: Callable[[str], str]) -> None:
    host = f"{unique('config')}.example.com"
    await stage(world, host, now=WallClock().now_ms())
    seen: list[str] = []

    async def configure(move: Move) -> str | None:
        seen.append(move.id)
        return "the bundle etag differs from move.inputs"

    step = await make_box(world, "box-config", configure=configure).run(host)
    assert seen == [MV] and step.outcome == "rolled_back" and "configuration changed" in step.detail
    rec = (await world.ledger.read_record(host)).state
    assert rec is not None and rec.move is not None and rec.move.landing_phase == "configured"


async def test_a_built_database_that_changed_rolls_back_in_restored(world: World, unique: Callable[[str], str]) -> None:
    host = f"{unique('tamper')}.example.com"
    await stage(world, host, now=WallClock().now_ms())
    label = "box-tamper"
    first = make_box(world, label, faults=Crashes("before_effects:restored"))
    with pytest.raises(Crash):
        await first.run(host)
    build = first.box.journal_dir(host, MV) / "build.db"
    conn = sqlite3.connect(build)
    conn.execute("UPDATE t SET v = 'changed' WHERE id = 3")
    conn.commit()
    conn.close()
    step = await make_box(world, label).run(host)
    assert step.outcome == "rolled_back" and "sha256" in step.detail, step
    rec = (await world.ledger.read_record(host)).state
    assert rec is not None and rec.move is not None and rec.move.landing.installed_db_sha256 == ""


async def test_t5_the_archive_opens_only_with_this_box_key(world: World, tmp_path: Path) -> None:
    files = tmp_path / "files"
    files.mkdir()
    (files / "a").write_text("a")
    out = io.BytesIO()
    manifest = build_archive(files, None, out, world.key.public_key(), host="h", op_id=MV, incarnation=INC)
    body = manifest_bytes(manifest)
    assert await archive_opens(out.getvalue(), body, world.key, op=MV, incarnation=INC) == (True, "")
    ok, why = await archive_opens(out.getvalue(), body, generate_private_key(), op=MV, incarnation=INC)
    assert not ok and "does not open" in why
    ok, why = await archive_opens(out.getvalue(), body, world.key, op=MV, incarnation="02" * 32)
    assert not ok


async def test_t5_an_archive_is_extracted_once_per_key_and_op(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A target reassesses each round: the same sealed bytes, manifest, op, incarnation and key give the verdict kept
    from the first extraction; another key (or op) is extracted and judged on its own."""
    from services.target import readiness

    files = tmp_path / "files"
    files.mkdir()
    (files / "a").write_text("a")
    key, other = generate_private_key(), generate_private_key()
    out = io.BytesIO()
    body = manifest_bytes(build_archive(files, None, out, key.public_key(), host="h", op_id=MV, incarnation=INC))
    extracted: list[object] = []
    real = readiness.extract

    def counting(*args: Any, **kwargs: Any) -> None:
        extracted.append(args[2])
        real(*args, **kwargs)

    monkeypatch.setattr(readiness, "extract", counting)
    monkeypatch.setattr(readiness, "_OPENED", {})
    for _ in range(3):
        assert await archive_opens(out.getvalue(), body, key, op=MV, incarnation=INC) == (True, "")
    assert extracted == [key]
    for _ in range(2):
        ok, why = await archive_opens(out.getvalue(), body, other, op=MV, incarnation=INC)
        assert not ok and "does not open" in why
    ok, _why = await archive_opens(out.getvalue(), body, key, op=MV, incarnation="02" * 32)
    assert not ok and extracted == [key, other, key]


async def test_the_landing_deadline_rolls_back_mid_landing(world: World, unique: Callable[[str], str]) -> None:
    """§7.8 trigger: past ``landing_deadline`` the target does not continue a phase; it records the rollback."""
    host = f"{unique('ldl')}.example.com"
    await stage(world, host, now=WallClock().now_ms())
    worker = make_box(world, "box-ldl")
    clock = ShiftClock()
    worker.box.clock = clock
    for _ in range(4):
        assert (await worker.step(host)).outcome == "advanced"
    clock.offset_ms = 601_000
    step = await worker.step(host)
    assert step.outcome == "rolled_back" and "landing deadline" in step.detail, step
    rec = (await world.ledger.read_record(host)).state
    assert rec is not None and rec.move is not None and rec.move.state == "rolling_back"
    assert rec.move.rollback is not None and rec.move.rollback.reason == step.detail


async def test_report_readiness_observes_and_writes_target_json(world: World, unique: Callable[[str], str]) -> None:
    """The readiness runner on the real stack: T4 and T10 probe the buckets, T5 opens the staged archive with
    this box's key, T6 reads the disk; the report lands at ``moves/<host>/<op>/target.json``."""
    host = f"{unique('ready')}.example.com"
    await stage(world, host, now=WallClock().now_ms())
    claim = msgspec.structs.replace(moving_claim(), host=host)
    await put_state(world.ledger, "claim", claim)
    await put_state(world.ledger, "record", landing_record(host, state="preparing", landing_phase=""))
    box_dir = world.root / "box-ready"
    box_dir.mkdir()
    facts = BoxFacts(protocol=1, console_secrets_key_fp=secrets_key_fp(world.key), rates=Rates(10, 250, 500),
                     environment_matches=True, release_staged=True, hosting_boxes=(TGT,), landing_armed=True,
                     rollback_target_armed=True)

    async def report(key: Any) -> Any:
        return await report_readiness(
            ledger=world.ledger, data_store=world.store, data_bucket=world.bucket, source_store=world.store,
            source_bucket=world.bucket, box=TGT, region="uk", box_dir=box_dir, private_key=key, facts=facts,
            host=host, clock=WallClock())

    rep = await report(world.key)
    assert rep is not None and rep.ready, rep.failing()
    got = await world.store.get(world.bucket, report_key(host, MV))
    assert isinstance(got, Got) and json.loads(got.body)["ready"] is True
    wrong = await report(generate_private_key())
    assert wrong is not None and not wrong.ready
    assert [c.check for c in wrong.failing()] == ["T2", "T5"]
    got = await world.store.get(world.bucket, report_key(host, MV))
    assert isinstance(got, Got) and json.loads(got.body)["ready"] is False, "the newest report is what ready reads"
    elsewhere = await report_readiness(
        ledger=world.ledger, data_store=world.store, data_bucket=world.bucket, source_store=world.store,
        source_bucket=world.bucket, box=TGT, region="us", box_dir=box_dir, private_key=world.key, facts=facts,
        host=host, clock=WallClock())
    assert elsewhere is None, "only a record whose move.to is this region is assessed"


async def test_a_rollback_recorded_by_another_actor_wins_over_a_stale_commit(
    world: World, unique: Callable[[str], str]
) -> None:
    """§7.5/§7.9: the commit and a rollback CAS the same record; a commit decided from a read taken before
    the source's deadline rollback re-reads in the CAS and is refused."""
    host = f"{unique('race')}.example.com"
    await stage(world, host, now=WallClock().now_ms())
    worker = make_box(world, "box-race")
    for _ in range(30):
        step = await worker.step(host)
        if step.phase == "probed":
            break
    assert step.phase == "probed"
    stale = (await world.ledger.read_record(host)).state
    assert stale is not None and stale.move is not None
    out = await world.ledger.transition("record", host, "landing-deadline", lambda r: phases.decide_rollback(
        r, EXPECT, "the landing deadline passed", WallClock().now_ms()))
    assert isinstance(out, Committed)
    step = await worker._commit(host, EXPECT, stale.move)
    assert step.outcome == "blocked" and "rolling_back" in step.detail, step
    rec = (await world.ledger.read_record(host)).state
    assert rec is not None and rec.move is not None
    assert rec.move.state == "rolling_back" and rec.move.committed_at is None
    for host_ in list(worker.running):
        await worker.running.stop(host_)
