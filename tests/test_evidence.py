"""Stop evidence from observable state (spec §5.3, §14.1; D§10; K13): real processes, the real cgroup v2
hierarchy, real SQLite files and real SeaweedFS."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import signal
import sqlite3
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import pytest
import pytest_asyncio

from events.base import DurableValueError, canonical, decode
from events.ids import new_op_id
from hostmove.stackinfo import StackInfo
from kernel import rules
from kernel.ports import ManualClock, SeededRandom, WallClock
from services.box.instance.evidence import (
    Checkpoint,
    Cleared,
    Evidenced,
    EvidenceFor,
    EvidenceRefused,
    LeaseObservation,
    Observed,
    Refusal,
    StepName,
    StepObservation,
    StopEvidence,
    StopHooks,
    decide,
    evidence_key,
    file_sha256,
    lease_file_check,
    reconstruct_stop_evidence,
)
from services.box.instance.proctree import (
    BOOT_ID,
    CgroupTree,
    Drain,
    Holder,
    HolderScan,
    SpawnHistory,
    SpawnJournal,
    StrayScan,
)
from services.objstore.port import Got, Missing
from services.objstore.s3 import S3Store
from tests.helpers.cgtest import Reaper, alive, as_agent, box_tree, forker, python_env, read_pid, wait_for

RNG = SeededRandom(5003)
SHA_A = "a" * 64
SHA_B = "b" * 64


# -- the pure decision ---------------------------------------------------------------------------------------

GOOD = Observed(
    drain=Drain("h.example", "/cg/h", True, (41,), True, 12),
    strays=StrayScan("/cg/@agent", (), True),
    holders=HolderScan((), True, 90, 0),
    lease=LeaseObservation(True, "no lease"),
    history=SpawnHistory("h.example", True, "boot-1", 1, 0, "1 strict"),
)


def test_all_four_steps_clear() -> None:
    verdict = decide("h.example", GOOD)
    assert isinstance(verdict, Cleared)
    assert [(s.step, s.name, s.ok) for s in verdict.steps] == [
        (1, "kill-and-drain", True),
        (2, "no-stray-process", True),
        (3, "no-open-database", True),
        (4, "lease-released", True),
    ]
    assert verdict.steps[0].pids == (41,) and "killed pids 41" in verdict.steps[0].detail


@pytest.mark.parametrize(
    ("seen", "code", "words", "alert"),
    [
        (
            dataclasses.replace(GOOD, drain=Drain("h.example", "/cg/h", True, (41, 42), False, 10000, (42,))),
            "live-process",
            "process 42 of host h.example is still alive after the kill",
            True,
        ),
        (
            dataclasses.replace(GOOD, drain=Drain("h.example", "/cg/h", True, (), False, 3, (), "cannot: EIO")),
            "live-process",
            "could not be killed and drained",
            True,
        ),
        (
            dataclasses.replace(GOOD, strays=StrayScan("/cg/@agent", (77,), True, "", ("sleep",))),
            "stray-process",
            "stray process 77 (sleep) runs in the agent's own group",
            True,
        ),
        (
            dataclasses.replace(GOOD, strays=StrayScan("/cg/@agent", (), False, "cannot read procs")),
            "scan-incomplete",
            "could not be checked",
            True,
        ),
        (
            dataclasses.replace(GOOD, holders=HolderScan((Holder(88, "/d/h.db-wal", "fd", "python3"),), True, 90, 0)),
            "database-held",
            "process 88 (python3) holds /d/h.db-wal",
            True,
        ),
        (
            dataclasses.replace(GOOD, holders=HolderScan((), False, 0, 0, "cannot list /proc")),
            "scan-incomplete",
            "could not read /proc",
            True,
        ),
        (
            dataclasses.replace(GOOD, lease=LeaseObservation(False, "held until 99")),
            "lease-held",
            "lease is still held",
            False,
        ),
    ],
)
def test_each_failing_step_refuses_alone(seen: Observed, code: str, words: str, alert: bool) -> None:
    verdict = decide("h.example", seen)
    assert isinstance(verdict, Refusal)
    assert verdict.codes == (code,)
    assert len(verdict.reasons) == 1 and words in verdict.reasons[0]
    assert verdict.alert is alert
    assert [s.ok for s in verdict.steps].count(False) == 1
    assert decide("h.example", seen) == verdict  # pure


def test_every_cause_is_named() -> None:
    seen = Observed(
        drain=Drain("h", "/cg/h", True, (1,), False, 50, (5,)),
        strays=StrayScan("/cg/@agent", (6,), True),
        holders=HolderScan((Holder(7, "/d/h.db", "fd"),), True, 3, 0),
        lease=LeaseObservation(False, "held"),
        history=SpawnHistory("h", True, "boot-1", 1, 0),
    )
    verdict = decide("h", seen)
    assert isinstance(verdict, Refusal)
    assert verdict.codes == ("live-process", "stray-process", "database-held", "lease-held")


ABSENT = Drain("h", "/cg/h", False, (), True, 0)


@pytest.mark.parametrize(("history", "words"), [
    (SpawnHistory("h", True, "boot-1", 0, 0, "the spawn journal records no spawn of the host"),
     "nothing could have escaped"),
    (SpawnHistory("h", True, "boot-1", 3, 0, "3 strict"), "a strict group cannot be removed while populated"),
])
def test_an_absent_group_clears_step_one_only_after_strict_or_no_spawns(history: SpawnHistory, words: str) -> None:
    """§5.3: the durably never-spawned host, and a host every spawn of which was strict (its group could only
    be removed empty), pass step 1 without a group to drain."""
    verdict = decide("h", dataclasses.replace(GOOD, drain=ABSENT, history=history))
    assert isinstance(verdict, Cleared)
    assert "absent" in verdict.steps[0].detail and words in verdict.steps[0].detail


@pytest.mark.parametrize(("history", "words"), [
    (SpawnHistory("h", True, "boot-1", 4, 1, "4 strict and 1 non-strict"),
     "spawned it 1 time(s) in this boot without strict containment"),
    (SpawnHistory("h", False, "", detail="box b keeps no spawn journal"),
     "cannot show that every earlier spawn of it was contained (box b keeps no spawn journal)"),
    (SpawnHistory("h", False, "boot-1", detail="cannot read the spawn journal /j/h.json: bad"),
     "cannot show that every earlier spawn of it was contained"),
])
def test_an_absent_group_refuses_where_an_earlier_spawn_could_escape(history: SpawnHistory, words: str) -> None:
    """Joint D3: "An absent host cgroup is insufficient where an earlier spawn could escape containment"."""
    seen = dataclasses.replace(GOOD, drain=ABSENT, history=history)
    verdict = decide("h", seen)
    assert isinstance(verdict, Refusal)
    assert verdict.codes == ("escape-possible",) and verdict.alert
    assert len(verdict.reasons) == 1 and words in verdict.reasons[0]
    assert not verdict.steps[0].ok and all(s.ok for s in verdict.steps[1:])
    assert decide("h", seen) == verdict  # pure: the same observations, the same answer
    with rules.mutated(["absent-cgroup-insufficient"]):
        assert isinstance(decide("h", seen), Cleared), "the named rule is the guard"


def test_a_group_that_exists_and_drains_does_not_need_the_journal() -> None:
    """Step 1 with a group: ``populated 0`` after the kill proves it, whatever the journal says."""
    unknown = SpawnHistory("h.example", False, detail="no journal")
    assert isinstance(decide("h.example", dataclasses.replace(GOOD, history=unknown)), Cleared)


def test_the_evidence_shape_refuses_what_is_not_evidence() -> None:
    names: list[StepName] = [
        "kill-and-drain", "no-stray-process", "no-open-database", "lease-released", "final-checkpoint"
    ]
    steps = tuple(StepObservation(step=i, name=n, ok=True, detail="d") for i, n in enumerate(names, start=1))
    op = new_op_id("mv", RNG)
    good = StopEvidence(
        host="h.example", box="box-a", role="source", op_id=op, incarnation="1" * 64, claim_gen=3, steps=steps,
        n=7, db_sha256=SHA_A, files_sha256=SHA_B, timers_sha256=SHA_A, evidence_at=1_700_000_000_000,
    )
    assert decode(canonical(good), StopEvidence) == good
    with pytest.raises(ValueError, match="files_sha256"):
        msgspec.structs.replace(good, files_sha256="nope")
    with pytest.raises(ValueError, match="every one passed"):
        msgspec.structs.replace(good, steps=steps[:4])
    with pytest.raises(ValueError, match="every one passed"):
        msgspec.structs.replace(good, steps=(*steps[:4], msgspec.structs.replace(steps[4], ok=False)))
    with pytest.raises(ValueError, match="operation id"):
        msgspec.structs.replace(good, op_id="mv_x")
    with pytest.raises(DurableValueError):
        decode(canonical(good).replace(b'"v":1', b'"v":1,"extra":true'), StopEvidence)


def test_evidence_key_layout() -> None:
    op = new_op_id("rb", RNG)
    assert evidence_key("shop.example.com", op, "target") == f"moves/shop.example.com/{op}/stopped-target.json"
    assert evidence_key("a/b c", op, "source") == f"moves/a%2Fb%20c/{op}/stopped-source.json"
    with pytest.raises(ValueError):
        evidence_key("h", "not-an-op", "source")
    with pytest.raises(ValueError):
        evidence_key("h", op, "bystander")  # type: ignore[arg-type]


def test_lease_file_check(tmp_path: Path) -> None:
    clock = ManualClock(start_ms=1_000_000)
    lock = tmp_path / "lock.json"
    check = lease_file_check(lock, clock, renewal_margin_ms=5_000)
    assert check().released  # absent
    lock.write_text(json.dumps({"holder": "box-a", "expires_at_ms": 1_002_000}))
    assert not check().released
    clock.advance(6_000)  # expired 4 s ago: still within the renewal margin
    held = check()
    assert not held.released and "renewal margin 5000" in held.detail
    clock.advance(1_001)
    assert check().released
    lock.write_text(json.dumps({"holder": "box-a", "expires_at_ms": 10**15, "released": True}))
    assert check().released
    lock.write_text("{not json")
    assert not check().released and "not valid JSON" in check().detail
    lock.write_text(json.dumps({"holder": "box-a"}))
    assert not check().released


# -- the real box --------------------------------------------------------------------------------------------


@pytest_asyncio.fixture(loop_scope="session", scope="module")
async def s3(stack: StackInfo, unique: Callable[[str], str]) -> AsyncIterator[tuple[S3Store, str]]:
    """One deployment bucket for the module; keys are unique per test (host and op id)."""
    store = await S3Store.open(stack.s3_endpoint, stack.s3_access_key, stack.s3_secret_key, stack.s3_region)
    bucket = unique("evidence")
    await store.create_bucket(bucket)
    try:
        yield store, bucket
    finally:
        await store.delete_bucket(bucket)
        await store.close()


@dataclass
class World:
    """One host on one box: its data directory, database, files, timers and lease, as the activator sees them."""

    tree: CgroupTree
    home: Path
    data: Path
    host: str
    subject: EvidenceFor
    reaper: Reaper
    checkpoints: list[Checkpoint] = field(default_factory=list)

    @property
    def db(self) -> Path:
        return self.data / f"{self.host}.db"

    @property
    def files(self) -> Path:
        return self.data / self.host

    @property
    def lock(self) -> Path:
        return self.data / "lock.json"

    def hooks(self) -> StopHooks:
        async def final_checkpoint() -> Checkpoint:
            if not self.db.exists():
                cp = Checkpoint(None, "")
            else:
                conn = sqlite3.connect(self.db)
                try:
                    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
                    (n,) = conn.execute("SELECT count(*) FROM t").fetchone()
                finally:
                    conn.close()
                cp = Checkpoint(int(n), file_sha256(self.db))
            self.checkpoints.append(cp)
            return cp

        async def files_digest() -> str:
            h = hashlib.sha256()
            for p in sorted(self.files.rglob("*")):
                if p.is_file():
                    h.update(str(p.relative_to(self.files)).encode() + b"\0" + p.read_bytes())
            return h.hexdigest()

        async def timers_digest() -> str:
            return hashlib.sha256(b'[{"name":"nightly","next_at":1700000000000}]').hexdigest()

        return StopHooks(lease_file_check(self.lock, WallClock(), 1_000), final_checkpoint, files_digest, timers_digest)

    async def evidence(
        self, tree: CgroupTree | None = None, store: tuple[S3Store, str] | None = None
    ) -> Evidenced | EvidenceRefused:
        assert store is not None
        return await reconstruct_stop_evidence(
            tree=tree or self.tree,
            store=store[0],
            bucket=store[1],
            clock=WallClock(),
            subject=self.subject,
            db_path=self.db,
            hooks=self.hooks(),
            drain_within_s=10,
        )

    def write_rows(self, n: int) -> None:
        conn = sqlite3.connect(self.db)
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("CREATE TABLE IF NOT EXISTS t (x INTEGER)")
            conn.executemany("INSERT INTO t VALUES (?)", [(i,) for i in range(n)])
            conn.commit()
        finally:
            conn.close()

    def spawn_tree(self, escape_to: Path | None = None) -> int:
        """The instance: its app forks a descendant that closes its descriptors and outlives it."""
        out = self.data / "tree"
        out.mkdir(exist_ok=True)
        argv = forker("tree", str(out), *([str(escape_to)] if escape_to else []))
        spawned = self.tree.spawn_strict(
            self.host, argv, env=python_env(), cwd=self.data,
            stdout=self.data / "app.out", stderr=self.data / "app.err",
        )
        assert spawned.process.wait(timeout=20) == 0, (self.data / "app.err").read_text()
        return read_pid(out / "descendant.pid")


@pytest.fixture
def world(
    s3: tuple[S3Store, str], unique: Callable[[str], str], tmp_path: Path
) -> Iterator[World]:
    """A box whose agent is this test process (inside ``hostmove/<box>/@agent``), and one host on it."""
    box = unique("box.ev")
    host = f"{unique('shop')}.example.com"
    reaper = Reaper()
    with box_tree(box) as (tree, home), as_agent(tree, home):
        tree.journal = SpawnJournal(tmp_path / "spawns")  # the box's spawn journal, in its state directory
        try:
            data = tmp_path / "data"
            (data / host).mkdir(parents=True)
            (data / host / "index.html").write_text("<h1>hello</h1>")
            subject = EvidenceFor(host, new_op_id("mv", RNG), "source", box, "c" * 64, claim_gen=4)
            yield World(tree, home, data, host, subject, reaper)
        finally:
            reaper.close()


async def stored(s3: tuple[S3Store, str], w: World) -> Got | Missing:
    return await s3[0].get(s3[1], evidence_key(w.host, w.subject.op_id, w.subject.role))


async def test_a_descendant_outliving_its_app_is_killed_then_evidenced(world: World, s3: tuple[S3Store, str]) -> None:
    world.write_rows(5)
    descendant = world.spawn_tree()
    # The app exited; its descendant lives on in the group, so the host is NOT stopped yet.
    assert alive(descendant) and world.tree.populated(world.host)

    result = await world.evidence(store=s3)
    assert isinstance(result, Evidenced), getattr(result, "message", "")
    ev = result.evidence
    assert result.created and ev.host == world.host and ev.role == "source" and ev.claim_gen == 4
    assert [(s.step, s.ok) for s in ev.steps] == [(1, True), (2, True), (3, True), (4, True), (5, True)]
    assert ev.steps[0].pids == (descendant,)  # found and killed, though its parent was long gone
    assert not alive(descendant) and not world.tree.populated(world.host)
    assert ev.n == 5 and ev.db_sha256 == file_sha256(world.db)
    got = await stored(s3, world)
    assert isinstance(got, Got) and decode(got.body, StopEvidence) == ev and got.body == canonical(ev)


async def test_an_escaped_descendant_refuses_evidence_while_it_lives(world: World, s3: tuple[S3Store, str]) -> None:
    """A descendant that left its group (as a best-effort placement would leave it) for the agent's own group:
    the host's group drains empty, yet the process lives. Evidence refuses, naming it, writes nothing and never
    checkpoints (§5.3 step 2, joint D3 "an absent host cgroup is insufficient")."""
    world.write_rows(2)
    agent = world.tree.agent_dir()
    assert agent is not None
    escaped = world.spawn_tree(escape_to=agent / "cgroup.procs")
    assert alive(escaped) and not world.tree.populated(world.host)

    refused = await world.evidence(store=s3)
    assert isinstance(refused, EvidenceRefused)
    assert refused.codes == ("stray-process",) and refused.alert
    assert f"stray process {escaped} (python" in refused.message
    assert refused.steps[1].pids == (escaped,) and refused.steps[0].ok
    assert alive(escaped)
    assert world.checkpoints == []
    assert isinstance(await stored(s3, world), Missing)

    os.kill(escaped, signal.SIGKILL)
    wait_for(lambda: not alive(escaped), "the escaped descendant to die")
    result = await world.evidence(store=s3)
    assert isinstance(result, Evidenced) and result.created and result.evidence.n == 2


async def test_a_process_holding_the_database_refuses_evidence(world: World, s3: tuple[S3Store, str]) -> None:
    ready = world.data / "holder.pid"
    holder = world.reaper.start(forker("hold", str(world.db), str(ready)), home=world.home)  # outside both groups
    read_pid(ready)

    refused = await world.evidence(store=s3)
    assert isinstance(refused, EvidenceRefused)
    assert refused.codes == ("database-held",) and refused.alert
    for suffix in ("", "-wal", "-shm"):
        assert f"process {holder.pid} (python" in refused.message
        assert f"holds {world.db}{suffix} (" in refused.message
    assert refused.steps[2].pids == (holder.pid,) and refused.steps[1].ok and refused.steps[0].ok
    assert world.checkpoints == [] and isinstance(await stored(s3, world), Missing)

    holder.kill()
    holder.wait(timeout=10)
    result = await world.evidence(store=s3)
    assert isinstance(result, Evidenced) and result.evidence.n == 1


async def test_a_held_lease_refuses_without_alert(world: World, s3: tuple[S3Store, str]) -> None:
    world.lock.write_text(json.dumps({"holder": "box-a", "expires_at_ms": WallClock().now_ms() + 3_600_000}))
    refused = await world.evidence(store=s3)
    assert isinstance(refused, EvidenceRefused) and refused.codes == ("lease-held",) and not refused.alert
    world.lock.write_text(json.dumps({"holder": "box-a", "expires_at_ms": 1, "released": True}))
    assert isinstance(await world.evidence(store=s3), Evidenced)


async def test_evidence_is_create_only_and_the_same_after_a_restart(world: World, s3: tuple[S3Store, str]) -> None:
    world.write_rows(3)
    descendant = world.spawn_tree()
    first = await world.evidence(store=s3)
    assert isinstance(first, Evidenced) and first.created and not alive(descendant)

    # The agent restarts: a new tree object with no memory of the spawn or of the first evidence.
    assert world.tree.root is not None
    assert world.tree.journal is not None
    restarted = CgroupTree(world.tree.root, world.tree.box_label, deployment=world.tree.deployment,
                           journal=world.tree.journal.dir)
    again = await world.evidence(tree=restarted, store=s3)
    assert isinstance(again, Evidenced) and not again.created
    assert again.evidence == first.evidence  # the original, with its evidence_at (the H clock's start)

    # Something changed the files after the stop: the stored evidence no longer describes this state.
    (world.files / "index.html").write_text("<h1>changed after the stop</h1>")
    conflict = await world.evidence(tree=restarted, store=s3)
    assert isinstance(conflict, EvidenceRefused) and conflict.codes == ("conflict",) and conflict.alert
    assert "already exists and records a different stop" in conflict.message and "files_sha256" in conflict.message
    versions = await s3[0].list_versions(s3[1], evidence_key(world.host, world.subject.op_id, "source"))
    assert len(versions) == 1
    got = await stored(s3, world)
    assert isinstance(got, Got) and decode(got.body, StopEvidence) == first.evidence


async def test_a_never_spawned_host_still_runs_every_step(world: World, s3: tuple[S3Store, str]) -> None:
    """§5.3 "A durably never-spawned operation": the box's spawn journal records no spawn of the host, and every
    step still runs."""
    result = await world.evidence(store=s3)
    assert isinstance(result, Evidenced)
    ev = result.evidence
    assert "absent" in ev.steps[0].detail and "records no spawn of the host" in ev.steps[0].detail
    assert ev.steps[0].pids == ()
    assert not world.tree.leaf(world.host).exists()  # the cleanup-only call created nothing
    assert ev.n is None and ev.db_sha256 == ""


def restarted(world: World, *, boot_id: Path | None = None) -> CgroupTree:
    """The agent after a restart: a new tree and journal over the same box state, nothing in memory."""
    assert world.tree.root is not None and world.tree.journal is not None
    journal = SpawnJournal(world.tree.journal.dir, boot_id=boot_id or BOOT_ID)
    return CgroupTree(world.tree.root, world.tree.box_label, deployment=world.tree.deployment, journal=journal)


async def test_an_absent_group_after_strict_spawns_is_evidence_after_a_restart(
    world: World, s3: tuple[S3Store, str]
) -> None:
    world.write_rows(2)
    descendant = world.spawn_tree()
    drain = await world.tree.kill_and_drain(world.host, within_s=10)
    assert drain.drained and not alive(descendant)
    assert world.tree.remove_leaf(world.host)  # the group is gone: only the journal says how the host ran

    result = await world.evidence(tree=restarted(world), store=s3)
    assert isinstance(result, Evidenced), getattr(result, "message", "")
    step1 = result.evidence.steps[0]
    assert step1.ok and "absent" in step1.detail and "1 strict and 0 non-strict" in step1.detail
    again = await world.evidence(tree=restarted(world), store=s3)
    assert isinstance(again, Evidenced) and not again.created and again.evidence == result.evidence


async def test_an_absent_group_after_a_non_strict_spawn_refuses_with_an_alert(
    world: World, s3: tuple[S3Store, str], tmp_path: Path
) -> None:
    """A spawn placed best-effort (journaled non-strict) whose process runs outside every group hostmove reads:
    neither the host's group (absent) nor the agent's (step 2) can show it, so evidence refuses until the box
    reboots, with the same answer after an agent restart (joint D3)."""
    assert world.tree.journal is not None
    world.tree.journal.record(world.host, strict=False)  # the pre-move best-effort child of §5.3
    ready = tmp_path / "loose.pid"
    loose = world.reaper.start(forker("sleep", str(ready)), home=world.home)  # outside the host's and agent's groups
    read_pid(ready)

    refused = await world.evidence(store=s3)
    assert isinstance(refused, EvidenceRefused)
    assert refused.codes == ("escape-possible",) and refused.alert
    assert "spawned it 1 time(s) in this boot without strict containment" in refused.message
    assert not refused.steps[0].ok and all(s.ok for s in refused.steps[1:])
    assert world.checkpoints == [] and isinstance(await stored(s3, world), Missing)

    after_restart = await world.evidence(tree=restarted(world), store=s3)
    assert isinstance(after_restart, EvidenceRefused)
    assert (after_restart.codes, after_restart.reasons) == (refused.codes, refused.reasons)

    loose.kill()
    loose.wait(timeout=10)
    still = await world.evidence(tree=restarted(world), store=s3)
    assert isinstance(still, EvidenceRefused) and still.codes == ("escape-possible",), "the journal is not memory"

    rebooted = tmp_path / "boot_id"
    rebooted.write_text("00000000-0000-4000-8000-000000000000\n")
    result = await world.evidence(tree=restarted(world, boot_id=rebooted), store=s3)
    assert isinstance(result, Evidenced), getattr(result, "message", "")
    assert "only from an earlier boot" in result.evidence.steps[0].detail


async def test_an_absent_group_without_a_spawn_journal_refuses(world: World, s3: tuple[S3Store, str]) -> None:
    assert world.tree.root is not None
    unjournaled = CgroupTree(world.tree.root, world.tree.box_label, deployment=world.tree.deployment)
    refused = await world.evidence(tree=unjournaled, store=s3)
    assert isinstance(refused, EvidenceRefused) and refused.codes == ("escape-possible",) and refused.alert
    assert "keeps no spawn journal" in refused.message
    assert world.checkpoints == [] and isinstance(await stored(s3, world), Missing)


async def test_a_corrupt_existing_evidence_is_an_error(world: World, s3: tuple[S3Store, str]) -> None:
    key = evidence_key(world.host, world.subject.op_id, "source")
    await s3[0].put(s3[1], key, b'{"not":"evidence"}')
    with pytest.raises(DurableValueError) as info:
        await world.evidence(store=s3)
    assert info.value.code == "decode_failed"
    assert isinstance(await stored(s3, world), Got)
