"""The first end-to-end move on the real stack (issue 4): a moveprobe instance serving on ``ie-1`` (a real process
in a cgroup v2 leaf, real SQLite replicated into SeaweedFS) is moved to ``uk-1`` through the door, the source's
preparing rounds, the cut, the landing and the finalization (spec §7.1-§7.9), and is served there with every
acknowledged write; the ledger's history on NATS JetStream audits clean."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import urllib.request
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest_asyncio

from bus.log import EventLog
from bus.subjects import LEDGER_STREAM, ledger_subject
from events import Actor
from events.base import decode
from events.copy import say
from events.envelope import Transition
from events.ids import new_incarnation
from hostmove.probe_apps import ProbeApps, post_write
from hostmove.stackinfo import StackInfo
from kernel.ports import SystemRandom, WallClock
from moveprobe.acks import RowAck, missing_from_db, read_acks
from moveprobe.config import probe_env
from services.box.artifacts.sealing import load_private_key, secrets_key_fp
from services.box.instance.activator import Activator, AppSpec, BoxContext, Started
from services.box.instance.proctree import CgroupTree
from services.box.instance.registry import Registry, RouteRow
from services.box.instance.stamps import StampBook
from services.box.instance.timers import Timers
from services.box.roster import init_box
from services.door.api import Door
from services.door.auth import Identity
from services.hosts.create import create_host
from services.ledger import Committed, Ledger
from services.ledger.audit import run_audit
from services.source.preparing import LaunchInputs
from services.target.budget import Rates
from services.target.probe import FAST as PROBE_FAST
from services.target.readiness import BoxFacts
from services.target.worker import LandingWorker, TargetBox, read_seal
from tests.helpers.cgtest import as_agent, box_tree
from tests.helpers.e2e import FAST, Deployment, MoveOutcome, MoveRun, SourceSide, TargetSide, Timings, run_move
from tests.helpers.stores import Regions, regions

SRC, TGT = "ie-1", "uk-1"
WRITES = 20


Stack = Regions


@pytest_asyncio.fixture(loop_scope="session", scope="module")
async def buckets(stack: StackInfo, unique: Callable[[str], str]) -> AsyncIterator[Stack]:
    """The deployment bucket and the two regions' data buckets, separate as in production: the target's staging
    park parks ``moves/<host>/<op>/`` of the uk bucket, which must not be where the evidence lives."""
    async with regions(stack, unique, "e2e") as s:
        yield s


def rows(port: int) -> dict[str, int]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/rows", timeout=5) as resp:
        return json.loads(resp.read())  # type: ignore[no-any-return]


async def history(events: EventLog, obj: str, host: str) -> list[Transition]:
    """The transitions of one object, in stream order."""
    return [decode(m.data, Transition)
            async for m in events.replay(LEDGER_STREAM, subject=ledger_subject(obj, host))]  # type: ignore[arg-type]


@dataclass
class Rig:
    """One deployment with the two boxes and one host serving on ``ie-1`` with acknowledged writes."""

    s: Stack
    ledger: Ledger
    host: str
    incarnation: str
    seqs: list[int]
    acks: Path
    ctx: BoxContext
    tree: CgroupTree
    activator: Activator
    tbox: TargetBox
    landing: LandingWorker
    apps: ProbeApps
    deployment: Deployment
    source: SourceSide
    target: TargetSide
    src_box_dir: Path

    def run(self, timings: Timings = FAST) -> MoveRun:
        """A fresh runner: nothing in memory from an earlier one (a restarted console, §7.13)."""
        return MoveRun(self.deployment, self.source, self.target, timings)


@asynccontextmanager
async def rig(s: Stack, unique: Callable[[str], str], tmp_path: Path) -> AsyncIterator[Rig]:
    clock = WallClock()
    ledger = Ledger(s.store, s.events, clock, Actor(service="e2e", pid=os.getpid(), nonce="e2e"), s.deploy)
    actor = Actor(service="box-init", pid=os.getpid(), nonce="init")
    root = tmp_path / "deployment"
    ie = await init_box(root=root, label=SRC, region="ie", store=s.store, bucket=s.deploy, events=s.events,
                        clock=clock, actor=actor)
    uk = await init_box(root=root, label=TGT, region="uk", store=s.store, bucket=s.deploy, events=s.events,
                        clock=clock, actor=actor)
    src_key, tgt_key = load_private_key(ie.box_dir / "secrets.pem"), load_private_key(uk.box_dir / "secrets.pem")
    acks = tmp_path / "acks"
    acks.mkdir()
    host = f"{unique('e2e')}.example.com"

    with box_tree(unique("box.ie")) as (tree, home), as_agent(tree, home):
        ctx = BoxContext(label=SRC, region="ie", box_dir=ie.box_dir, data_bucket=s.ie, data_store=s.store,
                         ledger=ledger, tree=tree, registry=Registry.open(ie.box_dir, clock),
                         stamps=StampBook.open(ie.box_dir, clock), clock=clock, rng=SystemRandom())

        def env(h: str, data_dir: Path, port: int, region: str) -> dict[str, str]:
            return probe_env(data_dir=data_dir, host=h, region=region, ack_log=acks / f"{h}.jsonl", port=port,
                             interval_s=3600)

        activator = Activator(ctx, AppSpec(argv=[sys.executable, "-m", "moveprobe"], env=env, ready_within_s=15))
        src_timers = Timers.open(ie.box_dir, clock)
        apps = ProbeApps(home, tmp_path)
        tbox = TargetBox(label=TGT, region="uk", box_dir=uk.box_dir, data_store=s.store, data_bucket=s.uk,
                         ledger=ledger, registry=Registry.open(uk.box_dir, clock),
                         stamps=StampBook.open(uk.box_dir, clock), timers=Timers.open(uk.box_dir, clock),
                         clock=clock, rng=SystemRandom(), private_key=tgt_key, probe_factory=apps.factory,
                         probe_timing=PROBE_FAST, sync_interval_s=0.2)
        landing = LandingWorker(tbox)
        try:
            incarnation = new_incarnation(SystemRandom())
            assert isinstance(await create_host(ledger, host, box=SRC, region="ie", incarnation=incarnation),
                              Committed)
            ctx.registry.insert(RouteRow(host=host, status="ready", incarnation=incarnation))
            started = await activator.wake(host)
            assert isinstance(started, Started), started
            seqs = [await asyncio.to_thread(post_write, started.port, f"v{i}") for i in range(WRITES)]
            assert len(set(seqs)) == WRITES

            async def launch(h: str) -> LaunchInputs:
                return LaunchInputs(env={"MOVEPROBE_HOST": h}, bundle_etags={"app": '"e1"'}, release="r1")

            source = SourceSide(ctx=ctx, activator=activator, timers=src_timers, secrets_key=src_key,
                                launch=launch, ready_url=lambda h: f"http://127.0.0.1:{started.port}/ready")
            facts = BoxFacts(protocol=1, console_secrets_key_fp=secrets_key_fp(src_key), rates=Rates(10, 250, 500),
                             environment_matches=True, release_staged=True, hosting_boxes=(TGT,),
                             landing_armed=True, rollback_target_armed=True)
            regions = {"ie": (s.store, s.ie), "uk": (s.store, s.uk)}
            deployment = Deployment(door=Door(ledger, clock=clock, rng=SystemRandom()),
                                    regions=regions.__getitem__, region_key=lambda r: tgt_key.public_key(),
                                    events=s.events)
            yield Rig(s, ledger, host, incarnation, seqs, acks, ctx, tree, activator, tbox, landing, apps,
                      deployment, source, TargetSide(landing, facts), ie.box_dir)
        finally:
            await activator.close()
            for host_ in list(landing.running):
                await landing.running.stop(host_)
            for process_app in apps.apps:
                await process_app.stop()
            for closable in (ctx.registry, ctx.stamps, src_timers, tbox.registry, tbox.stamps, tbox.timers):
                closable.close()


async def assert_moved(r: Rig, outcome: MoveOutcome, *, cut_by: str = "move-cut-auto") -> None:
    """The end state of a move done: closed on the authority, served on uk-1 with every acknowledged write,
    nothing left running or current on the source, and a history that audits clean."""
    s, host, ctx = r.s, r.host, r.ctx
    assert outcome.ok, outcome
    assert (outcome.stage, outcome.exec_box, outcome.committed, outcome.opened, outcome.closed) == (
        "done", TGT, True, True, True)
    # the authority: the record closed as done, the claim released to serving on the target (K8)
    record = (await r.ledger.read_record(host)).state
    claim = (await r.ledger.read_claim(host)).state
    assert record is not None and record.move is None and record.last_move is not None
    assert (record.last_move.id, record.last_move.outcome) == (outcome.move_id, "done")
    assert claim is not None and claim.holder is not None
    assert (claim.op.kind, claim.op.exec, claim.op.participants, claim.obligations) == ("serving", TGT, (TGT,), ())
    assert claim.holder.incarnation == r.incarnation, "a move keeps the incarnation"
    assert claim.holder.admissions[-1].box == TGT and claim.holder.admissions[-1].writes_lost is None
    names = [e.meta.name for e in await history(s.events, "record", host)]
    for step in ("move-requested", "move-ready", cut_by, "cut-admit", "cut-stopped", "cut-flip",
                 "commit", "opened", "source-parked", "move-done"):
        assert step in names, (step, names)
    assert names.index("cut-flip") < names.index("commit") < names.index("opened") < names.index("move-done")
    # the seal the real source wrote is the one the landing parses (services/target/worker.read_seal)
    flipped = [e.claim for e in await history(s.events, "claim", host) if e.meta.name == "move-follow"]
    assert flipped and flipped[0] is not None
    raw = flipped[0].op.journal["seal"]
    seal = read_seal(flipped[0])
    assert raw["src_covered"] is True and seal.n >= 1 and seal.replica and set(seal.files) == {
        "archive.sealed", "manifest.json"} and set(seal.timers) == {"timers.json"}
    # the source's instance is stopped, its tree empty, its local installation parked
    assert host not in r.activator.running and not r.tree.populated(host)
    assert not ctx.db_path(host).exists() and ctx.registry.get(host) is None
    parked = r.src_box_dir / ".parked" / f"superseded-{outcome.move_id}" / "park-superseded-local" / host
    assert (parked / ctx.db_path(host).name).exists(), "the source's database was parked, not deleted"
    # both parks by exact version: nothing current is left at the source's location or in the lane
    for bucket, prefix in ((s.ie, f"instances/{host}/"), (s.uk, f"moves/{host}/{outcome.move_id}/")):
        left = [v.key for v in await s.store.list_versions(bucket, prefix) if not v.key.endswith("lock.json")]
        assert left == [], (bucket, left)
    # the target serves, and holds every write the source acknowledged
    row = r.tbox.registry.get(host)
    assert row is not None and not row.held, "the open left the landing hold"
    app = r.landing.running.get(host)
    assert app is not None and app.process is not None and await app.process.running() and await app.process.ready()
    acked = read_acks(r.acks / f"{host}.jsonl")
    assert sorted(a.seq for a in acked if isinstance(a, RowAck)) == sorted(r.seqs)
    assert missing_from_db(r.tbox.db_path(host), acked) == [], "every acknowledged write is on uk-1"
    port = r.apps.ports[host]
    seen = await asyncio.to_thread(rows, port)
    assert seen["max_seq"] >= max(r.seqs) and seen["count"] >= WRITES
    after = await asyncio.to_thread(post_write, port, "written on uk")
    assert after > max(r.seqs), "uk-1 takes writes after the move"
    # the history on the stream replays to exactly what S3 holds
    audit = await run_audit(s.events, r.ledger, host=host)
    assert audit.clean(), [f.line() for f in audit.findings]
    assert audit.tracks[("record", host)].events == len(names)


async def test_a_running_instance_moves_from_ie_to_uk_with_nothing_lost(
    buckets: Stack, unique: Callable[[str], str], tmp_path: Path
) -> None:
    async with rig(buckets, unique, tmp_path) as r:
        outcome = await run_move(r.host, to="uk", deployment=r.deployment, source=r.source, target=r.target)
        await assert_moved(r, outcome)
        assert set(outcome.timings) >= {"request", "preparing", "cutting", "landing", "finalizing", "total"}
        assert outcome.timings["total"] < 60


async def test_a_new_runner_finishes_a_move_an_interrupted_one_left(
    buckets: Stack, unique: Callable[[str], str], tmp_path: Path
) -> None:
    """The helper keeps nothing in memory: a run cut short (here by its pass budget) stops saying where, and a
    new runner continues from the record and the claim alone (§7.13)."""
    async with rig(buckets, unique, tmp_path) as r:
        first = await r.run(Timings(max_passes=2)).run(r.host, to="uk")
        assert not first.ok and first.move_id and first.stage in ("preparing", "cutting")
        assert "more than 2 passes" in first.reason and first.stage in first.reason
        record = (await r.ledger.read_record(r.host)).state
        assert record is not None and record.move is not None and record.move.id == first.move_id
        outcome = await r.run().drive(r.host, first.move_id)
        await assert_moved(r, outcome)
        assert outcome.move_id == first.move_id


async def test_a_manual_move_waits_at_ready_for_the_operators_cut(
    buckets: Stack, unique: Callable[[str], str], tmp_path: Path
) -> None:
    """``cut: manual`` (M6): the run stops at ``ready`` with M-C12 and nothing is stopped; after the door's cut
    request (§7.4 ``requested``) the move runs to its close."""
    async with rig(buckets, unique, tmp_path) as r:
        waiting = await r.run().run(r.host, to="uk", cut="manual")
        assert not waiting.ok and waiting.stage == "preparing" and waiting.reason == say("M-C12", host=r.host)
        record = (await r.ledger.read_record(r.host)).state
        assert record is not None and record.move is not None and record.move.state == "ready"
        assert r.host in r.activator.running and r.tree.populated(r.host), "nothing stops before the cut"
        cut = await r.deployment.door.cut(r.host, Identity("op", "operator"))
        assert cut.status == 200, cut.body
        await assert_moved(r, await r.run().drive(r.host, waiting.move_id), cut_by="move-cut-requested")
