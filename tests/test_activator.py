"""The activator on the real stack: real cgroup leaves, the real moveprobe app, real SQLite and SeaweedFS
(issue 3 items 3, 5 and "how it is shown": write, sync, kill, lose the disk, cold-admit on another box;
``writes_lost`` exactly when acknowledged writes had not been uploaded; the files directory comes back from
the files manifest every installation publishes, L17)."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import sys
import urllib.request
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import msgspec
import pytest
import pytest_asyncio

from bus.nats_log import NatsEventLog
from events import Actor, Claim
from events.claim import LostBox, Op
from hostmove.probe_apps import post_write
from hostmove.stackinfo import StackInfo
from kernel.ports import SystemRandom, WallClock
from moveprobe.acks import RowAck, missing_from_db, read_acks
from moveprobe.config import probe_env
from services.box.artifacts.filesmanifest import read_manifest
from services.box.artifacts.markers import read_files_gen
from services.box.instance.activator import (
    Activator,
    AppSpec,
    BoxContext,
    Certificate,
    Started,
    StartFailed,
    StartPolicy,
    StartRefused,
    remove_box_data,
    unshipped_path,
)
from services.box.instance.proctree import CgroupTree
from services.box.instance.registry import Registry, RouteRow
from services.box.instance.stamps import StampBook
from services.box.replica.restore import restore_generation
from services.hosts.create import create_host
from services.ledger import Committed, Ledger
from services.objstore.port import StoreUnavailable
from services.objstore.s3 import S3Store
from tests.helpers.cgtest import TEST_DEPLOYMENT

INC = "cd" * 32


@dataclass
class World:
    store: S3Store
    events: NatsEventLog
    bucket: str
    ledger: Ledger
    acks: Path
    root: Path
    trees: list[CgroupTree]
    activators: list[Activator]

    def box(self, label: str, *, attempts: int = 5) -> BoxContext:
        box_dir = self.root / label
        box_dir.mkdir(parents=True, exist_ok=True)
        clock = WallClock()
        tree = CgroupTree.discover(f"t-{label}-{self.bucket[-10:]}", deployment=TEST_DEPLOYMENT, clock=clock)
        self.trees.append(tree)
        return BoxContext(
            label=label, region="ie", box_dir=box_dir, data_bucket=self.bucket, data_store=self.store,
            ledger=self.ledger, tree=tree, registry=Registry.open(box_dir, clock),
            stamps=StampBook.open(box_dir, clock), clock=clock, rng=SystemRandom(),
        )

    def activator(self, ctx: BoxContext, app: AppSpec | None = None, policy: StartPolicy | None = None) -> Activator:
        act = Activator(ctx, app or self.app(), policy)
        self.activators.append(act)
        return act

    def app(self) -> AppSpec:
        def env(host: str, data_dir: Path, port: int, region: str) -> dict[str, str]:
            return probe_env(data_dir=data_dir, host=host, region=region, ack_log=self.acks / f"{host}.jsonl",
                             port=port, interval_s=3600)

        return AppSpec(argv=[sys.executable, "-m", "moveprobe"], env=env, ready_within_s=15)


@asynccontextmanager
async def open_world(stack: StackInfo, unique: Callable[[str], str], tmp_path: Path) -> AsyncIterator[World]:
    """A bucket, a ledger and box directories on the real stack; every leaf and the bucket go afterwards."""
    store = await S3Store.open(stack.s3_endpoint, stack.s3_access_key, stack.s3_secret_key, stack.s3_region)
    events = await NatsEventLog.connect(stack.nats_url)
    bucket = unique("activator")
    await store.create_bucket(bucket)
    ledger = Ledger(store, events, WallClock(), Actor(service="box", pid=1, nonce="a"), bucket)
    (tmp_path / "acks").mkdir()
    w = World(store, events, bucket, ledger, tmp_path / "acks", tmp_path / "boxes", [], [])
    yield w
    for activator in w.activators:
        await activator.close()
    for tree in w.trees:  # kill and remove every leaf this test made, even after a failure
        if tree.base is None or not tree.base.exists():
            continue
        for leaf in [p for p in tree.base.iterdir() if p.is_dir()]:
            drain = await tree.reopen_and_drain(leaf.name, within_s=10)
            assert drain.drained, drain
            for _ in range(100):  # an exited child stays a zombie until reaped, keeping the group busy
                tree.reap()
                try:
                    leaf.rmdir()
                    break
                except OSError:
                    await asyncio.sleep(0.05)
        tree.remove_box()
    await store.delete_bucket(bucket)
    await events.close()
    await store.close()


@pytest_asyncio.fixture(loop_scope="session")
async def world(stack: StackInfo, unique: Callable[[str], str], tmp_path: Path) -> AsyncIterator[World]:
    async with open_world(stack, unique, tmp_path) as w:
        yield w


def tree_of(root: Path) -> dict[str, tuple[int, bytes | None]]:
    """Every entry under ``root`` but ``.files-gen``: (mode, bytes, or None for a folder)."""
    out: dict[str, tuple[int, bytes | None]] = {}
    for path in sorted(root.rglob("*")):
        rel = str(path.relative_to(root))
        if rel == ".files-gen":
            continue
        out[rel] = (path.stat().st_mode & 0o7777, None if path.is_dir() else path.read_bytes())
    return out


def rows(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/rows", timeout=5) as resp:
        return json.loads(resp.read())  # type: ignore[no-any-return]


async def reassign(ledger: Ledger, host: str, box: str) -> None:
    """Test set-up: the box is replaced (outside the move protocol) and the claim names the new one, the old one
    quarantined on its ``lost`` list as a fence leaves it (a serving claim that hands execution from one box to
    another with neither is refused by the new box, K3)."""
    def decide(cur: Claim | None) -> Claim:
        assert cur is not None
        old = cur.op.exec
        lost = cur.lost if old in ("none", box) else (*cur.lost, LostBox(box=old))
        return msgspec.structs.replace(cur, op=Op(kind="serving", exec=box, participants=(box,)), lost=lost)

    assert isinstance(await ledger.transition("claim", host, "test-replace-box", decide), Committed)


async def setup_host(w: World, unique: Callable[[str], str], box: BoxContext) -> str:
    host = f"{unique('act')}.example.com"
    assert isinstance(await create_host(w.ledger, host, box=box.label, region="ie", incarnation=INC), Committed)
    box.registry.insert(RouteRow(host=host, status="ready", incarnation=INC))
    return host


async def test_clean_stop_certifies_and_a_cold_admission_elsewhere_loses_nothing(
    world: World, unique: Callable[[str], str]
) -> None:
    a_ctx, b_ctx = world.box("ie-a"), world.box("ie-b")
    host = await setup_host(world, unique, a_ctx)
    a, b = world.activator(a_ctx), world.activator(b_ctx)
    first = await a.wake(host)
    assert isinstance(first, Started), first
    assert first.baseline is None and not first.writes_lost, "a first admission into an empty generation"
    seqs = [await asyncio.to_thread(post_write, first.port, f"v{i}") for i in range(15)]
    cert = await a.stop(host)
    assert cert is not None and cert.session == first.session and cert.max_txid >= 1
    assert not a_ctx.tree.populated(host), "the tree is drained, the forked worker included"
    # The files directory (instance.key) is not in the database: the first installation published it as its
    # generation's files manifest (L17, §8.3), and the cold admission on ie-b restores it from there.
    files_before = tree_of(a_ctx.files_dir(host))
    assert "instance.key" in files_before
    remove_box_data(a_ctx)
    await reassign(world.ledger, host, "ie-b")
    b_ctx.registry.insert(RouteRow(host=host, status="ready", incarnation=INC))
    second = await b.wake(host)
    assert isinstance(second, Started), second
    assert second.baseline == first.generation and second.restored_txid == cert.max_txid
    assert not second.writes_lost, "the certificate covers the predecessor session"
    assert tree_of(b_ctx.files_dir(host)) == files_before, "the files came back from the manifest, byte for byte"
    tag = read_files_gen(b_ctx.files_dir(host))
    assert tag is not None and (tag.op, tag.incarnation) == (second.generation, INC)
    seen = await asyncio.to_thread(rows, second.port)
    assert seen["max_seq"] >= max(seqs)
    acked = [x for x in read_acks(world.acks / f"{host}.jsonl") if isinstance(x, RowAck)]
    assert len(acked) == 15
    claim = (await world.ledger.read_claim(host)).state
    assert claim is not None and claim.holder is not None
    last = claim.holder.admissions[-1]
    assert last.box == "ie-b" and last.writes_lost is None and last.predecessor is not None
    assert last.predecessor.box == "ie-a"
    await b.close()


async def test_unsynced_acknowledged_writes_are_declared_lost(world: World, unique: Callable[[str], str]) -> None:
    a_ctx, b_ctx = world.box("ie-c"), world.box("ie-d")
    host = await setup_host(world, unique, a_ctx)
    a, b = world.activator(a_ctx), world.activator(b_ctx)
    first = await a.wake(host)
    assert isinstance(first, Started), first
    synced = [await asyncio.to_thread(post_write, first.port, f"s{i}") for i in range(5)]
    uploaded = await a.running[host].replicator.sync()
    assert uploaded is not None
    position = a.running[host].replicator.position
    unsynced = [await asyncio.to_thread(post_write, first.port, f"u{i}") for i in range(5)]
    # the box dies with its disk: no final sync, no certificate
    running = a.running.pop(host)
    running.stop.set()
    if running.task is not None:
        await running.task
    await running.replicator.close()
    await a_ctx.tree.reopen_and_drain(host, within_s=10)
    files_before = tree_of(a_ctx.files_dir(host))
    remove_box_data(a_ctx)  # the files come back from the first installation's files manifest (L17)
    await reassign(world.ledger, host, "ie-d")
    b_ctx.registry.insert(RouteRow(host=host, status="ready", incarnation=INC))
    second = await b.wake(host)
    assert isinstance(second, Started), second
    assert second.writes_lost, "acknowledged writes past the upload were not proven: declared"
    claim = (await world.ledger.read_claim(host)).state
    assert claim is not None and claim.holder is not None
    declared = claim.holder.admissions[-1].writes_lost
    assert declared is not None and declared.box == "ie-c" and declared.remote_max_txid == position
    assert tree_of(b_ctx.files_dir(host)) == files_before
    seen = await asyncio.to_thread(rows, second.port)
    assert seen["max_seq"] >= max(synced), "every uploaded row is there"
    assert seen["max_seq"] < max(unsynced), "the unsynced tail is what the declaration covers"
    await b.close()


class _PutsTimeOut:
    """The box's store with every PUT timing out (the outcome unknown); everything else passes through."""

    def __init__(self, inner: S3Store) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    async def put(self, bucket: str, key: str, body: bytes, **kw: object) -> object:
        raise StoreUnavailable(f"put {bucket}/{key}: no answer within 30 s; the outcome is unknown")


async def test_a_stop_whose_final_sync_failed_ships_every_commit_on_the_next_stop(
    world: World, unique: Callable[[str], str], tmp_path: Path
) -> None:
    """The replicator's close after a failed final upload is the database's last connection, and SQLite checkpoints
    on the last close: the unshipped frames move into the database file and the WAL empties, so "an empty WAL has
    nothing to ship" would lose them for good (found by the simulation's wStraggler: a cut's final PUT held on the
    server). ``<host>.unshipped`` makes the next stop flush the whole database."""
    ctx = world.box("ie-u")
    host = await setup_host(world, unique, ctx)
    act = world.activator(ctx)
    started = await act.wake(host)
    assert isinstance(started, Started), started
    seqs = [await asyncio.to_thread(post_write, started.port, f"w{i}") for i in range(6)]
    running = act.running[host]
    running.replicator.store = _PutsTimeOut(world.store)  # type: ignore[assignment]
    with pytest.raises(StoreUnavailable):
        await act.stop(host)
    db = ctx.db_path(host)
    assert unshipped_path(db).exists(), "the failed final sync leaves its mark"
    wal = Path(f"{db}-wal")
    assert not wal.exists() or wal.stat().st_size == 0, "SQLite's checkpoint on the last close emptied the WAL"
    assert await act.stop(host) is None, "no certificate: the session did not close clean"
    claim = (await world.ledger.read_claim(host)).state
    assert claim is not None and claim.holder is not None
    scratch = tmp_path / "restored.db"
    await restore_generation(world.store, world.bucket, claim.holder.location, started.generation, scratch)
    with sqlite3.connect(scratch) as conn:
        have = {seq for (seq,) in conn.execute("SELECT seq FROM rows WHERE kind = 'write'")}
    assert set(seqs) <= have, f"acknowledged writes missing from the bucket: {sorted(set(seqs) - have)}"
    assert not unshipped_path(db).exists(), "shipped: the next stop of this installation adds nothing"


async def test_refusals_change_nothing(world: World, unique: Callable[[str], str]) -> None:
    a_ctx, other = world.box("ie-e"), world.box("ie-f")
    host = await setup_host(world, unique, a_ctx)
    before = (await world.ledger.read_claim(host)).state
    refused = await world.activator(other).wake(host)
    assert isinstance(refused, StartRefused) and "not by this box" in refused.reason
    a_ctx.registry.hold(host, "moving", "mv_" + "a" * 26)
    held = await world.activator(a_ctx).wake(host)
    assert isinstance(held, StartRefused) and "held" in held.reason
    assert (await world.ledger.read_claim(host)).state == before, "nothing was written"


async def test_five_failed_starts_mark_the_route_failed(world: World, unique: Callable[[str], str]) -> None:
    a_ctx = world.box("ie-g")
    host = await setup_host(world, unique, a_ctx)

    def env(host: str, data_dir: Path, port: int, region: str) -> dict[str, str]:
        return {"MOVEPROBE_DATA_DIR": str(data_dir)}  # missing settings: the app refuses to start

    app = AppSpec(argv=[sys.executable, "-m", "moveprobe"], env=env, ready_within_s=2)
    out = await world.activator(a_ctx, app, StartPolicy(first_backoff_s=0.01)).wake(host)
    assert isinstance(out, StartFailed) and out.attempts == 5 and out.marked_failed
    row = a_ctx.registry.get(host)
    assert row is not None and row.status == "failed"
    again = await world.activator(a_ctx).wake(host)
    assert isinstance(again, StartRefused) and "operator" in again.reason
    assert not a_ctx.tree.populated(host)


class _FilesPutsTimeOut(_PutsTimeOut):
    """Only the files manifest's PUTs time out (a store outage while a start publishes it)."""

    async def put(self, bucket: str, key: str, body: bytes, **kw: object) -> object:
        if "/files/" in key:
            return await super().put(bucket, key, body, **kw)
        return await self.inner.put(bucket, key, body, **kw)


async def test_a_store_outage_during_a_start_is_not_a_failed_start(world: World, unique: Callable[[str], str]) -> None:
    """Only the app failing counts toward the five attempts that mark the route failed for an operator: a store
    that does not answer raises, nothing is marked, nothing is left running, and the next wake starts (the
    simulation: an outage at a first wake left the host failed for good, with no human to clear it)."""
    ctx = world.box("ie-s")
    host = await setup_host(world, unique, ctx)
    ctx.data_store = _FilesPutsTimeOut(world.store)  # type: ignore[assignment]
    with pytest.raises(StoreUnavailable):
        await world.activator(ctx, policy=StartPolicy(first_backoff_s=0.01)).wake(host)
    row = ctx.registry.get(host)
    assert row is not None and row.status == "ready", "a store outage never marks the route failed"
    assert not ctx.tree.populated(host), "the half-started app was stopped"
    ctx.data_store = world.store
    first = (await world.ledger.read_claim(host)).state
    assert first is not None and first.holder is not None
    assert await read_manifest(world.store, world.bucket, first.holder.location, first.holder.generation) is None
    started = await world.activator(ctx).wake(host)
    assert isinstance(started, Started), started
    # the next wake's flush of what that app committed published its files first (L17: a generation that holds
    # data has a manifest), so a disk lost later still finds the installation's files
    assert await read_manifest(world.store, world.bucket, first.holder.location, first.holder.generation) is not None


class _FirstMarkerTimesOut(_PutsTimeOut):
    """The first ``generation.json`` PUT of a start, after the app acknowledged some of its own rows, times out: a
    start attempt that fails after readiness (counted, retried under the same admission)."""

    def __init__(self, inner: S3Store, acks: Path, host: str) -> None:
        super().__init__(inner)
        self.acks, self.host, self.failed = acks, host, False

    async def put(self, bucket: str, key: str, body: bytes, **kw: object) -> object:
        if not self.failed and key.endswith("generation.json"):
            self.failed = True
            deadline = asyncio.get_running_loop().time() + 30
            while len(read_acks(self.acks, host=self.host)) < 3:  # the app runs and acknowledges meanwhile
                assert asyncio.get_running_loop().time() < deadline, "the app acknowledged nothing while it ran"
                await asyncio.sleep(0.05)
            raise TimeoutError(f"put {bucket}/{key}: no answer")
        return await self.inner.put(bucket, key, body, **kw)


async def test_a_retried_start_keeps_what_the_failed_attempt_committed(
    world: World, unique: Callable[[str], str], tmp_path: Path
) -> None:
    """A start attempt that fails after its app was ready (its marker's PUT timed out) is retried under the same
    admission on the database that app wrote: every row it acknowledged is kept and shipped, nothing is declared.
    Purging it for a fresh restore dropped those rows undeclared, and a new host's next attempts were refused by the
    app for good (its ``instance.key`` with no record in the database). Then it is stopped and woken again."""
    ctx = world.box("ie-r")
    host = await setup_host(world, unique, ctx)
    acks = world.acks / f"{host}.jsonl"

    def env(host: str, data_dir: Path, port: int, region: str) -> dict[str, str]:
        return probe_env(data_dir=data_dir, host=host, region=region, ack_log=acks, port=port, interval_s=0.1)

    app = AppSpec(argv=[sys.executable, "-m", "moveprobe"], env=env, ready_within_s=15)
    ctx.data_store = _FirstMarkerTimesOut(world.store, acks, host)  # type: ignore[assignment]
    act = world.activator(ctx, app, StartPolicy(first_backoff_s=0.01))
    started = await act.wake(host)
    assert isinstance(started, Started), started
    assert ctx.data_store.failed, "the first attempt's marker PUT was the one that failed"
    assert isinstance(await act.stop(host), Certificate), "the session closed clean: nothing to declare"
    claim = (await world.ledger.read_claim(host)).state
    assert claim is not None and claim.holder is not None
    scratch = tmp_path / "restored.db"
    await restore_generation(world.store, world.bucket, claim.holder.location, started.generation, scratch)
    acknowledged = read_acks(acks, host=host)
    assert len(acknowledged) >= 3
    assert missing_from_db(scratch, acknowledged) == [], "every row the failed attempt's app acknowledged is kept"
    again = await act.wake(host)  # and the host starts again from what it shipped
    assert isinstance(again, Started), again
    latest = (await world.ledger.read_claim(host)).state
    assert latest is not None and latest.holder is not None and latest.holder.admissions[-1].writes_lost is None
    await act.stop(host)


async def test_the_start_check_refuses_files_of_another_incarnation(world: World, unique: Callable[[str], str]) -> None:
    from services.box.artifacts.markers import write_files_gen

    a_ctx = world.box("ie-h")
    host = await setup_host(world, unique, a_ctx)
    a_ctx.files_dir(host).mkdir(parents=True)
    write_files_gen(a_ctx.files_dir(host), "", "ef" * 32)  # files left by another incarnation
    out = await world.activator(a_ctx).wake(host)
    assert isinstance(out, StartFailed) and "another incarnation" in out.reason and out.attempts == 1
    assert not out.marked_failed and not a_ctx.tree.populated(host), "refused before any spawn"


async def test_a_new_owner_process_stops_a_running_app_and_readmits(world: World, unique: Callable[[str], str]) -> None:
    a_ctx = world.box("ie-i")
    host = await setup_host(world, unique, a_ctx)
    first = await world.activator(a_ctx).wake(host)
    assert isinstance(first, Started)
    # the agent process dies; a new one starts with no memory of the app it left running
    old = world.activators.pop()
    for running in old.running.values():
        running.stop.set()
        if running.task is not None:
            await running.task
        await running.replicator.close()
    old.running.clear()
    successor = world.activator(a_ctx)
    assert a_ctx.tree.populated(host)
    assert await successor.adopt_running() == [host]
    assert not a_ctx.tree.populated(host)
    second = await successor.wake(host)
    assert isinstance(second, Started) and second.session > first.session, "a new owner is a new session"


async def test_a_stop_cancelled_while_it_waits_for_the_sync_loop_is_cancelled(tmp_path: Path) -> None:
    """The caller's cancellation propagates out of :meth:`Activator.stop` (an agent crash mid-stop): it was swallowed
    with the sync loop's own, and the dead agent's pass loop ran on beside its successor (found by the simulation)."""
    from types import SimpleNamespace

    from services.box.instance.instances import Instance, Instances

    class Drained:
        async def reopen_and_drain(self, host: str, within_s: float) -> SimpleNamespace:
            return SimpleNamespace(drained=True, error="", remaining=[])

    synced: list[str] = []

    class Replicator:
        async def sync(self) -> None:
            synced.append("sync")

    hang = asyncio.Event()
    loop_task = asyncio.ensure_future(hang.wait())  # a sync loop that has not seen its stop yet
    ctx = SimpleNamespace(tree=Drained(), label="ie-x", instances=Instances())
    activator = Activator(ctx, AppSpec(argv=["true"], env=lambda *_: {}))  # type: ignore[arg-type]
    activator.running.enter(Instance("h.example", port=1, session=1, generation="g", location="l",
                                     replicator=Replicator(), origin="wake", task=loop_task))  # type: ignore[arg-type]
    stopping = asyncio.ensure_future(activator.stop("h.example"))
    for _ in range(5):
        await asyncio.sleep(0)
    stopping.cancel()
    with pytest.raises(asyncio.CancelledError):
        await stopping
    assert synced == [], "the cancelled stop went on to its final sync"
    hang.set()
    await loop_task
