"""``hostmove demo``: the main job on the embedded default, with real parts only.

1. The stack comes up (NATS JetStream and SeaweedFS from the pip-installed binaries) and the object
   store passes the conformance probe.
2. Two boxes join the roster, ``ie-1`` in region ``ie`` and ``uk-1`` in ``uk``: on a deployment that already
   holds boxes, the demo works beside them (:func:`choose_boxes`): it reuses the one box of a region, and
   passes over a region it cannot move into or out of (two boxes, M-C21) or whose box has an agent of its own
   running, for the next region of :data:`REGIONS`. Each run creates a host of its own (a fresh name), so it
   runs again and again; the hosts of earlier runs serve again while the demo's agents run.
3. The door, the recovery pass and one agent per box start as their own processes. A host is created on
   the first box through the door and woken there by its agent (the sample app ``moveprobe`` in a cgroup v2
   leaf, replicating into its region's bucket, writing continuously); then ``hostmove move`` moves it to the
   second with live progress, the agents carrying it out on events (:mod:`hostmove.demo_move`).
4. The move's timings as ``hostmove move status`` shows them (prepare, cut, land, offline).
5. The checks of §14.4: the key verifies, every timer ran exactly once around the cut, no acknowledged row
   is missing, no copy is left in a live namespace of the region it left.
6. The change feed shows what a dashboard sees.
7. The audit replays the host's history from the stream against S3.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from bus.subjects import box_wake_subject
from hostmove import exitcodes
from hostmove.runtime import Runtime, open_runtime, settings_from_stack
from hostmove.stack import stack_up
from projections.runner import Projector
from projections.store import ChangesPage, ProjectionStore
from services.agent.config import region_bucket
from services.box.deployment import init_deployment, prepare_buckets
from services.box.roster import Roster, init_box, read_roster
from services.ledger.audit import run_audit

REGIONS = ("ie", "uk", "fr", "de", "nl", "se", "es", "it")
"""The regions the demo may use, in order: the first two it can use beside what the deployment holds."""


def _say(text: str) -> None:
    print(text, flush=True)


@dataclass
class Choice:
    """The two boxes the demo moves between (``(label, region, reused)``), and the regions it passed over."""

    boxes: list[tuple[str, str, bool]] = field(default_factory=list)
    passed: list[str] = field(default_factory=list)


def plan_boxes(roster: Roster | None, root: Path, running: set[str]) -> Choice:
    """Pure: for each region of :data:`REGIONS` in turn, its one live box (reused), or a fresh label when it has
    none (``<region>-<n>``, past any fenced label); a region with more than one live box (a move into or out of
    it is refused, M-C21), whose box directory here belongs to another box, or whose box has an agent running
    (``running``: not the demo's, and a box runs one agent) is passed over with the reason."""
    choice = Choice()
    labels = {b.label for b in roster.boxes} if roster else set()
    for region in REGIONS:
        live = roster.live_in_region(region) if roster else []
        if len(live) > 1:
            choice.passed.append(f"{region} has {len(live)} boxes ({', '.join(b.label for b in live)}), and a move "
                                 "into or out of a region with more than one box is refused")
            continue
        if live:
            label, reused = live[0].label, True
        else:
            label = next(f"{region}-{n}" for n in range(1, len(labels) + 2) if f"{region}-{n}" not in labels)
            reused = False
        owner = _box_identity(root / "boxes" / label)
        if owner is not None and owner != {"label": label, "region": region}:
            choice.passed.append(f"{region}: {root / 'boxes' / label} belongs to another box ({owner})")
            continue
        if label in running:
            choice.passed.append(f"{region}: box {label} has an agent running already (`hostmove serve box "
                                 f"--label {label}`); the demo runs its own")
            continue
        choice.boxes.append((label, region, reused))
        if len(choice.boxes) == 2:
            break
    return choice


def _box_identity(box_dir: Path) -> dict[str, object] | None:
    try:
        value = json.loads((box_dir / "box.json").read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else {"box.json": value}


async def _agents_running(rt: Runtime, roster: Roster | None) -> set[str]:
    """The live boxes of :data:`REGIONS` whose agent answers on NATS (an empty wake request: answered with an
    error, acting on nothing)."""
    running = set()
    for box in roster.boxes if roster else ():
        if box.region not in REGIONS or box.fenced_at is not None:
            continue
        try:
            await rt.events.nc.request(box_wake_subject(box.label), b"", timeout=0.5)
        except Exception:  # noqa: BLE001 - no responder, or no answer in time: no agent runs for it
            continue
        running.add(box.label)
    return running


async def choose_boxes(rt: Runtime, root: Path) -> Choice:
    """The two boxes the demo uses beside what the deployment holds (:func:`plan_boxes`)."""
    roster, _ = await read_roster(rt.store, rt.settings.bucket)
    return plan_boxes(roster, root, await _agents_running(rt, roster))


async def run(root: Path) -> int:
    root = root.resolve()
    _say(f"1. Starting the embedded stack under {root}/ ...")
    info = stack_up(root)
    _say(f"   NATS JetStream at {info.nats_url}, S3 (SeaweedFS, auth on) at {info.s3_endpoint}")
    rt = await open_runtime(settings_from_stack(info, root=root), "demo")
    try:
        _say(f"   the object store passed the conformance probe (bucket {rt.settings.bucket})")
        _say("2. Boxes join the roster:")
        choice = await choose_boxes(rt, root)
        for why in choice.passed:
            _say(f"   passed over {why}")
        if len(choice.boxes) < 2:
            _say(f"   the demo found no two regions it can use beside what this deployment holds. Start clean: "
                 f"`hostmove --root {root} stack down && rm -rf {root}` (the default: `make stack-down && rm -rf "
                 ".hostmove`), then run the demo again")
            return exitcodes.FAILED
        buckets = [rt.settings.bucket, *(region_bucket(region) for _, region, _ in choice.boxes)]
        refused = await prepare_buckets(rt.store, buckets)  # what `hostmove deployment init --region` does
        if refused is not None:
            _say(f"   the object store cannot hold this deployment: bucket {refused.bucket}: {refused.why}")
            return exitcodes.NONCONFORMING
        _say(f"   buckets {', '.join(buckets)}: versioned, conformance probe passed")
        key = await init_deployment(root=root, store=rt.store, bucket=rt.settings.bucket, clock=rt.clock)
        _say(f"   the deployment's secrets key {key.key.fp[:19]}... and protocol floor {key.floor.min} are published")
        boxes = []
        for label, region, reused in choice.boxes:
            box = await init_box(root=root, label=label, region=region, store=rt.store, bucket=rt.settings.bucket,
                                 events=rt.events, clock=rt.clock, actor=rt.actor)
            boxes.append(box)
            again = " (already in the roster: reused)" if reused else ""
            _say(f"   {box.label} in {box.region}{again}, secrets key {box.secrets_key_fp[:19]}...")
        source, target = boxes
        projection = ProjectionStore.open(root / "projections", rng=rt.rng, clock=rt.clock)
        projector = Projector(projection, rt.events, clock=rt.clock)
        await projector.catch_up()
        cursor = projection.cursor()
        _say(f"3. The console services and one agent per box start; a running instance moves from {source.label} "
             f"to {target.label}:")
        from hostmove.demo_move import move_demo

        shown = await move_demo(rt, info, source, target, _say)
        if isinstance(shown, tuple):
            code, why = shown
            _say(f"   the move could not run here: {why}")
            projection.close()
            return code
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
            return exitcodes.FAILED
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
        return exitcodes.OK if check.clean(strict=True) and shown.ok else exitcodes.FAILED
    finally:
        await rt.close()
