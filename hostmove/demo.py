"""``hostmove demo``: the main job on the embedded default, with real parts only.

1. The stack comes up (NATS JetStream and SeaweedFS from the pip-installed binaries) and the object
   store passes the conformance probe.
2. Two boxes join the roster, ``ie-1`` in region ``ie`` and ``uk-1`` in ``uk``.
3. A host is created on ``ie-1`` through its claim and woken there (the sample app ``moveprobe`` in a
   cgroup v2 leaf, replicating into the ``ie`` bucket); acknowledged writes go in; then it moves to
   ``uk-1`` (door, preparing, cut, landing, probe, commit, open, parks, close) and is checked there:
   every acknowledged write is on ``uk-1`` (:mod:`hostmove.demo_move`).
4. The change feed shows what a dashboard sees.
5. The audit replays the host's history from the stream against S3.
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
        _say("3. A running instance moves from ie-1 to uk-1:")
        from hostmove.demo_move import move_demo

        outcome = await move_demo(rt, boxes["ie-1"], boxes["uk-1"], _say)
        if isinstance(outcome, str):
            _say(f"   the move could not run here: {outcome}")
            projection.close()
            return 1
        timing = ", ".join(f"{k} {v:.1f} s" for k, v in outcome.timings.items())
        if not outcome.ok:
            _say(f"   the move stopped at {outcome.stage}: {outcome.reason}")
            projection.close()
            return 1
        _say(f"   moved: {outcome.move_id} committed, opened and closed; {timing}")
        host = outcome.host
        await projector.catch_up()
        page = projection.changes(cursor)
        if not isinstance(page, ChangesPage):
            _say(f"   the change feed asked for a resync: {page.reason}")
            projection.close()
            return 1
        _say("4. The change feed (what a dashboard sees):")
        for row in page.changes:
            _say(f"   {row.host}: {row.op_kind}, exec {row.exec}, region {row.region}, claim gen {row.claim_gen}, "
                 f"record gen {row.record_gen}")
        check = await run_audit(rt.events, rt.ledger, host=host)
        _say(f"5. Audit of {host}: {check.messages} events, {'clean' if check.clean(strict=True) else 'NOT clean'}")
        for finding in check.findings:
            _say(f"   {finding.line()}")
        _say("The stack keeps running: `hostmove stack status`, `hostmove audit`, `hostmove stack down`.")
        projection.close()
        return 0 if check.clean(strict=True) else 1
    finally:
        await rt.close()
