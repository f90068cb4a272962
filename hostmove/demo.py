"""``hostmove demo``: the main job on the embedded default, with real parts only.

1. The stack comes up (NATS JetStream and SeaweedFS from the pip-installed binaries) and the object
   store passes the conformance probe.
2. Two boxes join the roster, ``ie-1`` in region ``ie`` and ``uk-1`` in ``uk``.
3. The door, the recovery pass and one agent per box start as their own processes. A host is created on
   ``ie-1`` through the door and woken there by its agent (the sample app ``moveprobe`` in a cgroup v2 leaf,
   replicating into the ``ie`` bucket, writing continuously); then ``hostmove move`` moves it to ``uk-1``
   with live progress, the agents carrying it out on events (:mod:`hostmove.demo_move`).
4. The move's timings as ``hostmove move status`` shows them (prepare, cut, land, offline).
5. The checks of §14.4: the key verifies, every timer ran exactly once around the cut, no acknowledged row
   is missing, no copy is left in a live namespace of the region it left.
6. The change feed shows what a dashboard sees.
7. The audit replays the host's history from the stream against S3.
"""

from __future__ import annotations

from pathlib import Path

from hostmove.runtime import open_runtime, settings_from_stack
from hostmove.stack import stack_up
from projections.runner import Projector
from projections.store import ChangesPage, ProjectionStore
from services.box.roster import init_box
from services.ledger.audit import run_audit


def _say(text: str) -> None:
    print(text, flush=True)


async def run(root: Path) -> int:
    root = root.resolve()
    _say(f"1. Starting the embedded stack under {root}/ ...")
    info = stack_up(root)
    _say(f"   NATS JetStream at {info.nats_url}, S3 (SeaweedFS, auth on) at {info.s3_endpoint}")
    rt = await open_runtime(settings_from_stack(info, root=root), "demo")
    try:
        _say(f"   the object store passed the conformance probe (bucket {rt.settings.bucket})")
        _say("2. Boxes join the roster:")
        boxes = {}
        for label, region in (("ie-1", "ie"), ("uk-1", "uk")):
            box = await init_box(root=root, label=label, region=region, store=rt.store, bucket=rt.settings.bucket,
                                 events=rt.events, clock=rt.clock, actor=rt.actor)
            boxes[label] = box
            _say(f"   {box.label} in {box.region}, secrets key {box.secrets_key_fp[:19]}...")
        projection = ProjectionStore.open(root / "projections", rng=rt.rng, clock=rt.clock)
        projector = Projector(projection, rt.events, clock=rt.clock)
        await projector.catch_up()
        cursor = projection.cursor()
        _say("3. The console services and one agent per box start; a running instance moves from ie-1 to uk-1:")
        from hostmove.demo_move import move_demo

        shown = await move_demo(rt, info, boxes["ie-1"], boxes["uk-1"], _say)
        if isinstance(shown, str):
            _say(f"   the move could not run here: {shown}")
            projection.close()
            return 1
        _say(f"4. The move {shown.move_id}: its §13 timings against their budgets")
        for line in shown.status:
            _say(f"   {line}")
        _say("5. The checks of §14.4:")
        for c in shown.checks:
            _say(f"   {c.line()}")
        host = shown.host
        await projector.catch_up()
        page = projection.changes(cursor)
        if not isinstance(page, ChangesPage):
            _say(f"   the change feed asked for a resync: {page.reason}")
            projection.close()
            return 1
        _say("6. The change feed (what a dashboard sees):")
        for row in page.changes:
            if row.host != host:
                continue
            _say(f"   {row.host}: {row.op_kind}, exec {row.exec}, region {row.region}, claim gen {row.claim_gen}, "
                 f"record gen {row.record_gen}")
        check = await run_audit(rt.events, rt.ledger, host=host)
        _say(f"7. Audit of {host}: {check.messages} events, {'clean' if check.clean(strict=True) else 'NOT clean'}")
        for finding in check.findings:
            _say(f"   {finding.line()}")
        _say("The stack keeps running: `hostmove stack status`, `hostmove audit`, `hostmove stack down`.")
        projection.close()
        return 0 if check.clean(strict=True) and shown.ok else 1
    finally:
        await rt.close()
