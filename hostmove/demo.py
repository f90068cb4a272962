"""``hostmove demo``: what exists today, on the embedded default, with real parts only.

1. The stack comes up (NATS JetStream and SeaweedFS from the pip-installed binaries) and the object
   store passes the conformance probe.
2. Two boxes join the roster, one in region ``ie`` and one in ``uk``.
3. A host is created on ``ie-1`` through its claim, and the transitions appear in the change feed.
4. ``ie-1`` wakes it: a cold admission, then the sample app ``moveprobe`` in a cgroup v2 leaf; rows
   written through its API replicate into the region's bucket; a clean stop certifies the session.
5. ``uk-1``... is where the move would land. The door records the request (claim ``moving``, record
   ``preparing``); the source and target workers that carry a move out are not finished (issue 4),
   and the demo says so rather than pretending.
6. The audit replays the stream against S3.
"""

from __future__ import annotations

import json
import sys
import tempfile
import urllib.request
from pathlib import Path

from events.ids import new_incarnation
from hostmove.ports import Clock, Random
from hostmove.runtime import Runtime, open_runtime, settings_from_stack
from hostmove.stack import stack_up
from projections.runner import Projector
from projections.store import ChangesPage, ProjectionStore
from services.box.roster import init_box
from services.hosts.create import create_host
from services.ledger import Committed
from services.ledger.audit import run_audit


def _say(text: str) -> None:
    print(text, flush=True)


def _post(port: int, value: str) -> int:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/write", data=json.dumps({"value": value}).encode(),
                                 method="POST", headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=5) as resp:
        return int(json.loads(resp.read())["seq"])


async def _box_run(rt: Runtime, root: Path, host: str, clock: Clock, rng: Random) -> bool:
    """Wake ``host`` on ie-1 with the real activator, write rows, stop cleanly. False: not possible here."""
    import asyncio

    from moveprobe.config import probe_env
    from services.box.activator import Activator, AppSpec, BoxContext, Started
    from services.box.proctree import CgroupTree
    from services.box.registry import Registry, RouteRow
    from services.box.stamps import StampBook

    box_dir = root / "boxes" / "ie-1"
    tree = CgroupTree.discover("ie-1", clock=clock)
    ok, why = tree.strict_available()
    if not ok:
        _say(f"   this machine cannot spawn strictly ({why}); a box here refuses to run instances")
        return False
    data_bucket = "hostmove-data-ie"
    await rt.store.create_bucket(data_bucket, versioned=True)
    ctx = BoxContext(label="ie-1", region="ie", box_dir=box_dir, data_bucket=data_bucket, data_store=rt.store,
                     ledger=rt.ledger, tree=tree, registry=Registry.open(box_dir, clock),
                     stamps=StampBook.open(box_dir, clock), clock=clock, rng=rng)
    ctx.registry.insert(RouteRow(host=host, status="ready"))
    acks = Path(tempfile.mkdtemp(prefix="hostmove-demo-acks-"))

    def env(h: str, data_dir: Path, port: int, region: str) -> dict[str, str]:
        return probe_env(data_dir=data_dir, host=h, region=region, ack_log=acks / f"{h}.jsonl", port=port,
                         worker=False)

    activator = Activator(ctx, AppSpec(argv=[sys.executable, "-m", "moveprobe"], env=env, ready_within_s=20))
    started = await activator.wake(host)
    if not isinstance(started, Started):
        _say(f"   the wake did not start: {started}")
        return False
    _say(f"   admitted: session {started.session}, generation {started.generation} "
         f"(cold, P7); moveprobe pid {started.pid} in {tree.leaf(host)}")
    seqs = [await asyncio.to_thread(_post, started.port, f"row-{i}") for i in range(10)]
    _say(f"   10 acknowledged writes (seq {seqs[0]}..{seqs[-1]})")
    cert = await activator.stop(host)
    if cert is None:
        _say("   the stop could not certify the session")
        return False
    _say(f"   stopped and drained; every committed frame uploaded to s3://{data_bucket}/ "
         f"(TXID {cert.max_txid}); session {cert.session} certified")
    tree.remove_leaf(host)
    return True


async def run(root: Path) -> int:
    root = root.resolve()
    _say(f"1. Starting the embedded stack under {root}/ ...")
    info = stack_up(root)
    _say(f"   NATS JetStream at {info.nats_url}, S3 (SeaweedFS, auth on) at {info.s3_endpoint}")
    rt = await open_runtime(settings_from_stack(info, root=root), "demo")
    try:
        _say(f"   the object store passed the conformance probe (bucket {rt.settings.bucket})")
        _say("2. Boxes join the roster:")
        for label, region in (("ie-1", "ie"), ("uk-1", "uk")):
            box = await init_box(root=root, label=label, region=region, store=rt.store, bucket=rt.settings.bucket,
                                 events=rt.events, clock=rt.clock, actor=rt.actor)
            _say(f"   {box.label} in {box.region}, secrets key {box.secrets_key_fp[:19]}...")
        projection = ProjectionStore.open(root / "projections", rng=rt.rng, clock=rt.clock)
        projector = Projector(projection, rt.events, clock=rt.clock)
        await projector.catch_up()
        cursor = projection.cursor()
        host = f"shop-{rt.rng.token_bytes(3).hex()}.example.com"
        _say(f"3. Creating {host} on ie-1 through its claim:")
        created = await create_host(rt.ledger, host, box="ie-1", region="ie", incarnation=new_incarnation(rt.rng),
                                    causation="demo")
        if not isinstance(created, Committed):
            _say(f"   not created: {created}")
            return 1
        await projector.catch_up()
        page = projection.changes(cursor)
        if not isinstance(page, ChangesPage) or not any(r.host == host for r in page.changes):
            _say("   the new host is missing from the change feed")
            return 1
        for row in page.changes:
            _say(f"   change feed: {row.host}: {row.op_kind}, exec {row.exec}, claim gen {row.claim_gen}")
        _say("4. ie-1 wakes it (real process, cgroup v2 leaf, replication into the region's bucket):")
        await _box_run(rt, root, host, rt.clock, rt.rng)
        _say("5. An operator asks to move it to uk:")
        from services.door.api import Door
        from services.door.auth import Identity
        from services.door.decide import MoveRequest

        answer = await Door(rt.ledger, clock=rt.clock, rng=rt.rng).request_move(
            host, MoveRequest("uk", "auto"), Identity("demo-operator", "operator"))
        claim = (await rt.ledger.read_claim(host)).state
        record = (await rt.ledger.read_record(host)).state
        if claim is not None and record is not None and record.move is not None:
            _say(f"   door: claim {claim.op.kind} {claim.op.id} from {claim.op.participants[0]} "
                 f"to {claim.op.participants[1]}; record move {record.move.state}")
        else:
            _say(f"   door answered: {answer}")
        _say("   Not built yet: the source and target workers that carry the move out (issue 4).")
        check = await run_audit(rt.events, rt.ledger, host=host)
        _say(f"6. Audit of {host}: {check.messages} events, {'clean' if check.clean(strict=True) else 'NOT clean'}")
        for finding in check.findings:
            _say(f"   {finding.line()}")
        _say("The stack keeps running: `hostmove stack status`, `hostmove audit`, `hostmove stack down`.")
        projection.close()
        return 0 if check.clean(strict=True) else 1
    finally:
        await rt.close()
