"""The demo's main job: a real move of a running instance from ``ie-1`` to ``uk-1`` (issue 4).

Everything is real: the instance is the sample app ``moveprobe`` in a cgroup v2 leaf on ``ie-1``, its
database replicates into the ``ie`` bucket, the door records the request, the source's preparing rounds
and cut stage it into the ``uk`` bucket, the target lands, probes and commits it, both parks retire the
superseded copies by exact version, and the claim is released to ``serving`` on ``uk-1``. This process
acts as both boxes' agents (the embedded default runs every service in one OS process).
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
from pathlib import Path

from events.ids import new_incarnation
from hostmove.probe_apps import ProbeApps, post_write
from hostmove.runtime import Runtime
from moveprobe.acks import RowAck, missing_from_db, read_acks
from moveprobe.config import probe_env
from services.box.activator import Activator, AppSpec, BoxContext, Started
from services.box.agentcg import box_session
from services.box.proctree import CgroupTree
from services.box.registry import Registry, RouteRow
from services.box.roster import BoxInit
from services.box.sealing import load_private_key, secrets_key_fp
from services.box.stamps import StampBook
from services.box.timers import Timers
from services.door.api import Door
from services.hosts.create import create_host
from services.ledger import Committed
from services.move.e2e import Deployment, MoveOutcome, SourceSide, TargetSide, run_move
from services.source.preparing import LaunchInputs
from services.target.budget import Rates
from services.target.probe import FAST as PROBE_FAST
from services.target.readiness import BoxFacts
from services.target.worker import LandingWorker, TargetBox


async def move_demo(rt: Runtime, ie: BoxInit, uk: BoxInit, say: object) -> MoveOutcome | str:
    """Create, wake, write, move. Answers the outcome, or why this machine cannot run it."""
    out = say  # the caller's printer
    assert callable(out)
    clock, store, ledger = rt.clock, rt.store, rt.ledger
    tree = CgroupTree.discover(ie.label, clock=clock, journal=ie.box_dir / "spawns")
    ok, why = tree.strict_available()
    if not ok:
        return f"this machine cannot spawn strictly ({why}); a box here refuses to take part in moves"
    buckets = {"ie": "hostmove-data-ie", "uk": "hostmove-data-uk"}
    for bucket in buckets.values():
        await store.create_bucket(bucket, versioned=True)
    src_key, tgt_key = load_private_key(ie.box_dir / "secrets.pem"), load_private_key(uk.box_dir / "secrets.pem")
    acks = Path(tempfile.mkdtemp(prefix="hostmove-demo-acks-"))
    host = f"shop-{rt.rng.token_bytes(3).hex()}.example.com"
    with box_session(tree) as home:
        ctx = BoxContext(label=ie.label, region="ie", box_dir=ie.box_dir, data_bucket=buckets["ie"], data_store=store,
                         ledger=ledger, tree=tree, registry=Registry.open(ie.box_dir, clock),
                         stamps=StampBook.open(ie.box_dir, clock), clock=clock, rng=rt.rng)

        def env(h: str, data_dir: Path, port: int, region: str) -> dict[str, str]:
            return probe_env(data_dir=data_dir, host=h, region=region, ack_log=acks / f"{h}.jsonl", port=port,
                             interval_s=3600)

        activator = Activator(ctx, AppSpec(argv=[sys.executable, "-m", "moveprobe"], env=env, ready_within_s=20))
        src_timers = Timers.open(ie.box_dir, clock)
        apps = ProbeApps(home, acks)
        tbox = TargetBox(label=uk.label, region="uk", box_dir=uk.box_dir, data_store=store, data_bucket=buckets["uk"],
                         ledger=ledger, registry=Registry.open(uk.box_dir, clock),
                         stamps=StampBook.open(uk.box_dir, clock), timers=Timers.open(uk.box_dir, clock),
                         clock=clock, rng=rt.rng, private_key=tgt_key, probe_factory=apps.factory,
                         probe_timing=PROBE_FAST, sync_interval_s=0.2)
        landing = LandingWorker(tbox)
        try:
            incarnation = new_incarnation(rt.rng)
            created = await create_host(ledger, host, box=ie.label, region="ie", incarnation=incarnation,
                                        causation="demo")
            if not isinstance(created, Committed):
                return f"{host} was not created: {created}"
            ctx.registry.insert(RouteRow(host=host, status="ready", incarnation=incarnation))
            started = await activator.wake(host)
            if not isinstance(started, Started):
                return f"{host} did not start on {ie.label}: {started}"
            out(f"   {host} serves on {ie.label}: moveprobe pid {started.pid} in a cgroup v2 leaf, "
                f"session {started.session}, replicating into s3://{buckets['ie']}/")
            seqs = [await asyncio.to_thread(post_write, started.port, f"order-{i}") for i in range(20)]
            out(f"   20 acknowledged writes (seq {seqs[0]}..{seqs[-1]})")

            async def launch(h: str) -> LaunchInputs:
                return LaunchInputs(env={"MOVEPROBE_HOST": h}, bundle_etags={"app": '"demo"'}, release="demo-1")

            source = SourceSide(ctx=ctx, activator=activator, timers=src_timers, secrets_key=src_key, launch=launch,
                                ready_url=lambda h: f"http://127.0.0.1:{started.port}/ready")
            facts = BoxFacts(protocol=1, console_secrets_key_fp=secrets_key_fp(src_key), rates=Rates(10, 250, 500),
                             environment_matches=True, release_staged=True, hosting_boxes=(uk.label,),
                             landing_armed=True, rollback_target_armed=True)
            regions = {"ie": (store, buckets["ie"]), "uk": (store, buckets["uk"])}
            deployment = Deployment(door=Door(ledger, clock=clock, rng=rt.rng), regions=regions.__getitem__,
                                    region_key=lambda r: tgt_key.public_key(), events=rt.events)
            out(f"   moving {host} from ie to uk (cut: auto) ...")
            outcome = await run_move(host, to="uk", deployment=deployment, source=source,
                                     target=TargetSide(landing, facts))
            if outcome.ok:
                acked = read_acks(acks / f"{host}.jsonl")
                missing = missing_from_db(tbox.db_path(host), acked)
                rows = sum(isinstance(a, RowAck) for a in acked)
                out(f"   {len(missing)} of {rows} acknowledged writes missing on {uk.label}")
                if missing:
                    return f"{len(missing)} acknowledged writes are missing on {uk.label}"
                after = await asyncio.to_thread(post_write, apps.ports[host], "written on uk")
                out(f"   {host} takes writes on {uk.label} (seq {after})")
            return outcome
        finally:
            await activator.close()
            for running in list(landing.running.values()):
                await running.stop()
            await apps.stop_all()
            for closable in (ctx.registry, ctx.stamps, src_timers, tbox.registry, tbox.stamps, tbox.timers):
                closable.close()
