"""``hostmove rehearse --scenario move|clean-rollback|dirty-rollback|stuck-retry|declare-lost|fenced-target|
fenced-target-committed|fenced-source`` (spec §14.4; issue 13 item 6, issue 15 item 7).

The rehearsal runs on the embedded stack as ``make demo`` does: the door, the recovery pass and one agent per box as
their own processes, ``moveprobe`` published as an app release and writing throughout (a background row every
0.2 s, its schedule every 0.4 s, its once-timer 4 s after its first boot), its fail switch set in the release for the
target region (``MOVEPROBE_FAIL_READY_IN``, before or after writing). It prints the outcome, the §13 timings and the
§14.4 checks, and exits 0 only when the scenario ended as it must and every check passed:

| scenario           | the fail switch                                | must end                                    |
|--------------------|------------------------------------------------|---------------------------------------------|
| ``move``           | none                                           | ``done``, served on the target              |
| ``clean-rollback`` | the target, before writing                     | ``rolled_back`` clean, the source's         |
|                    |                                                | generation named again at the return        |
| ``dirty-rollback`` | the target, after writing                      | ``rolled_back`` dirty, every row the target |
|                    |                                                | acknowledged on the source, none declared   |
| ``stuck-retry``    | both regions, while a switch file exists (set  | ``stuck`` after nine failed recovery        |
|                    | once the host serves on the source)            | probes, then, the file removed and          |
|                    |                                                | ``hostmove move resolve --retry`` run,      |
|                    |                                                | ``rolled_back``                             |
| ``declare-lost``   | none: the target's agent dies right after its  | ``rolled_back`` clean citing the operator's |
|                    | probe started (a failpoint); ``hostmove box    | declaration, the lost session declared;     |
|                    | stop`` and ``hostmove move resolve             | the box started again quarantines itself    |
|                    | --declare-lost --yes``                         | (and its region's residue is swept)         |
| ``fenced-target``  | the same death; ``hostmove box fence           | ``rolled_back`` clean citing the fence, no  |
|                    | --terminated`` and nothing else                | operator; a replacement box enrolls and     |
|                    |                                                | sweeps its region                           |
| ``fenced-target-`` | none: the target's agent dies right after its  | ``done`` with its open waived, citing the   |
| ``committed``      | commit CAS (a failpoint), its instance writing | fence (§7.10 L14); the host pinned in uk,   |
|                    | on; ``hostmove box fence --terminated`` and    | then relocated to a replacement box, the    |
|                    | nothing else                                   | fenced session's writes declared lost       |
| ``fenced-source``  | none: a manual move waits at ``ready``; the    | ``aborted``: converted to a relocation at   |
|                    | source's machine is terminated and fenced      | pinning, waiting for a box in the source's  |
|                    |                                                | one-box region; a replacement enrolls and   |
|                    |                                                | serves it with every durable write          |

After a rollback the checks run on the source (the region that kept the host): the key verifies, every timer ran
once, no acknowledged row of either box is missing, nothing of the host is left live in the target region, and the
return lane is parked.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

import aiohttp
import msgspec

from bus.subjects import FACTS_STREAM, LEDGER_STREAM, alert_subject, ledger_subject
from events.base import decode
from events.copy import say
from events.envelope import Transition
from hostmove import exitcodes, move_cli
from hostmove.demo import choose_boxes
from hostmove.demo_move import _door_up, _until
from hostmove.probe_apps import free_port, post_write
from hostmove.procs import ServiceProc, service_env
from hostmove.rehearsal import Check, ack_logs, checks, last_move_state
from hostmove.runtime import Runtime, open_runtime, settings_from_stack
from hostmove.stack import stack_up
from hostmove.stackinfo import StackInfo
from kernel.failpoints import ENV
from kernel.ports import WallClock
from moveprobe import RELEASE_MANIFEST
from services.agent.config import region_bucket
from services.agent.service import read_endpoint
from services.apps.releases import load_manifest, publish
from services.box.deployment import init_deployment
from services.box.instance.proctree import CgroupTree
from services.box.instance.sandbox import instance_dir
from services.box.roster import BoxInit, ensure_deployment, init_box
from services.door.auth import token_digest
from services.move.follow import host_segment

COMMITTED: Final = "fenced-target-committed"
SCENARIOS: Final = ("move", "clean-rollback", "dirty-rollback", "stuck-retry", "declare-lost", "fenced-target",
                    COMMITTED, "fenced-source")
LOST: Final = ("declare-lost", "fenced-target")
"""The scenarios of §7.10 (issue 15 item 7): the target box is gone after its probe started."""
DIES: Final = {"declare-lost": "after_effects:probing", "fenced-target": "after_effects:probing",
               COMMITTED: "after_cas:record:commit"}
"""Where the target's agent dies in a scenario of §7.10 (a failpoint, :mod:`kernel.failpoints`): after its probe
started (before the record's commit), or right after its commit CAS."""
APP: Final = {"MOVEPROBE_INTERVAL_S": "0.2", "MOVEPROBE_SCHEDULE_EVERY_S": "0.4", "MOVEPROBE_ONCE_AFTER_S": "4"}
ONCE_AFTER_MS: Final = 4000
WRITES: Final = 10
MOVE_TIMEOUT_S: Final = 300.0


@dataclass(frozen=True)
class Outcome:
    """What a scenario showed: its name, how the move ended (``done``, ``rolled_back``, ``""``: not closed), whether
    it was stuck on its way, the timings, the checks and the exit code the scenario must answer."""

    scenario: str
    host: str
    move_id: str
    ended: str
    stuck_first: bool
    timings: list[str] = field(default_factory=list)
    checks: list[Check] = field(default_factory=list)
    why: str = ""

    @property
    def expected(self) -> tuple[str, bool]:
        return {"move": ("done", False), "clean-rollback": ("rolled_back", False),
                "dirty-rollback": ("rolled_back", False), "stuck-retry": ("rolled_back", True),
                "declare-lost": ("rolled_back", False), "fenced-target": ("rolled_back", False),
                COMMITTED: ("done", False), "fenced-source": ("aborted", False)}[self.scenario]

    @property
    def ok(self) -> bool:
        return (self.ended, self.stuck_first) == self.expected and bool(self.checks) and all(
            c.ok for c in self.checks)


def release_env(scenario: str, source_region: str, target_region: str, switch: Path | None) -> dict[str, str]:
    """The sample app's release environment for ``scenario`` (the module table). Pure."""
    env = dict(APP)
    if scenario == "clean-rollback":
        env.update(MOVEPROBE_FAIL_READY_IN=target_region, MOVEPROBE_FAIL_READY_WHEN="before-write")
    elif scenario == "dirty-rollback":
        env.update(MOVEPROBE_FAIL_READY_IN=target_region, MOVEPROBE_FAIL_READY_WHEN="after-write")
    elif scenario == "stuck-retry":
        assert switch is not None
        env.update(MOVEPROBE_FAIL_READY_IN=f"{target_region},{source_region}", MOVEPROBE_FAIL_READY_WHEN="before-write",
                   MOVEPROBE_FAIL_READY_SWITCH=str(switch))
    return env


async def _history_checks(rt: Runtime, host: str, move_id: str, scenario: str, ie: BoxInit, uk: BoxInit
                          ) -> list[Check]:
    """The rollback's own checks from the host's history: its verdict, what the return declared and named, and the
    return lane parked."""
    out: list[Check] = []
    last = await last_move_state(rt.events, host, move_id)
    rb = last.rollback if last is not None else None
    want_dirty = scenario == "dirty-rollback"
    dirty = rb is not None and rb.dirty
    out.append(Check("the release was " + ("dirty" if want_dirty else "clean"), rb is not None and dirty == want_dirty,
                     f"rollback {rb.id if rb else '-'}: {'dirty' if dirty else 'clean'}"))
    claim = (await rt.ledger.read_claim(host)).state
    admissions = claim.holder.admissions if claim is not None and claim.holder is not None else ()
    declared = [a for a in admissions if a.box == ie.label and a.writes_lost is not None]
    if scenario in LOST:  # §7.10: the lost box's session is declared, and nothing else
        lost = [a.writes_lost for a in declared if a.writes_lost is not None]
        ok = bool(lost) and all(w.box == uk.label for w in lost)
        out.append(Check(f"the return declared {uk.label}'s session lost", ok, "; ".join(
            f"writes_lost {w.box} session {w.session} past TXID {w.remote_max_txid}" for w in lost) or "none"))
        cited = rb.evidence if rb is not None else ""
        want = "control/losses/" if scenario == "declare-lost" else "control/box-fences/"
        out.append(Check("the rollback cites the " + ("declaration" if scenario == "declare-lost" else "fence"),
                         cited.startswith(want), cited or "no evidence"))
    else:
        out.append(Check("the return declared nothing lost", not declared,
                         "no admission of the source declares writes_lost" if not declared else f"{declared[0]}"))
    if want_dirty:
        sealed = [a for a in admissions if rb is not None and a.generation == rb.id]
        out.append(Check("the source was admitted into the return generation", bool(sealed) and all(
            a.coverage == "sealed" for a in sealed), f"g-{rb.id if rb else '-'}: {sealed[:1]}"))
        rows = [p for p in (rt.settings.root / "acks").glob(f"{host}.{uk.label}.jsonl") if p.stat().st_size > 0]
        out.append(Check("the target acknowledged rows during its probe", bool(rows), ", ".join(p.name for p in rows)
                         or "none: the release was dirty for another reason"))
    else:
        named = ""
        async for m in rt.events.replay(LEDGER_STREAM, subject=ledger_subject("claim", host)):
            t = decode(m.data, Transition)
            if t.meta.name == "rollback-source-claimed" and t.claim is not None and t.claim.holder is not None:
                named = f"{t.claim.holder.generation} (src_gen {t.claim.op.journal.get('src_gen')})"
                ok = t.claim.holder.generation == t.claim.op.journal.get("src_gen")
                out.append(Check("the return named the source's pre-move generation again", ok, named))
        if not named:
            out.append(Check("the return named the source's pre-move generation again", False,
                             "no rollback-source-claimed transition on the stream"))
    lane = f"moves/{host_segment(host)}/{rb.id}/" if rb is not None else ""
    left = await rt.store.list_keys(region_bucket(ie.region), lane) if lane else []
    out.append(Check("the return lane is parked", not left, "nothing current" if not left else ", ".join(left[:3])))
    return out


async def _stuck(rt: Runtime, host: str, timeout_s: float) -> str:
    """Wait for the record's ``stuck``; answers its reason."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        record = (await rt.ledger.read_record(host)).state
        if record is not None and record.move is not None and record.move.state == "stuck":
            return record.move.reason
        if record is not None and record.move is None:
            return ""
        await asyncio.sleep(0.5)
    return ""


async def rehearse(rt: Runtime, info: StackInfo, ie: BoxInit, uk: BoxInit, scenario: str,
                   out: Callable[[str], None]) -> Outcome:
    """Run ``scenario`` from ``ie`` (the source box) to ``uk`` (the target) with the services as processes."""
    root = rt.settings.root
    deployment = await ensure_deployment(rt.store, rt.settings.bucket, rng=rt.rng, clock=rt.clock)
    ok, why = CgroupTree.discover(ie.label, deployment=deployment, clock=rt.clock).strict_available()
    if not ok:
        return Outcome(scenario, "", "", "", False, why=f"this machine cannot spawn strictly ({why})")
    for box in (ie, uk):
        await rt.store.create_bucket(region_bucket(box.region), versioned=True)
    token = rt.rng.token_bytes(32).hex()

    def services_env() -> dict[str, str]:  # provisions the credentials of every box set up under root by now
        return service_env(info, root=root, bucket=rt.settings.bucket, extra={
            "HOSTMOVE_PROFILE": "fast", "HOSTMOVE_OPERATOR_TOKENS": f"rehearse={token_digest(token)}"})

    env = services_env()
    door_url = f"http://127.0.0.1:{free_port()}"
    logs = root / "logs"
    procs = [ServiceProc.serve("door", env, logs / "door.log", "--port", door_url.rsplit(":", 1)[1]),
             ServiceProc.serve("recovery", env, logs / "recovery.log")]
    procs += [ServiceProc.serve("box", env, logs / f"box-{b.label}.log", "--label", b.label) for b in (ie, uk)]
    for proc in procs:
        proc.start({ENV: DIES[scenario]} if scenario in DIES and proc.argv[-1] == uk.label else None)
    out(f"   services up: door at {door_url}, recovery, the agents of {ie.label} and {uk.label} (logs in {logs}/)")
    switch_dir = Path(tempfile.mkdtemp(prefix="hostmove-switch-"))
    os.chmod(switch_dir, 0o755)  # the instance's user reads the switch (services.box.instance.sandbox)
    switch = switch_dir / "fail-ready"
    agents: dict[str, ServiceProc] = {}
    try:
        agents = {p.argv[-1]: p for p in procs[2:]}
        return await _scenario(rt, ie, uk, scenario, door_url, token, procs[0], switch, out, agents, services_env)
    except TimeoutError as exc:
        return Outcome(scenario, "", "", "", False, why=f"{exc}; the services' logs are in {logs}/")
    finally:
        for proc in reversed(procs):
            proc.stop()
        for proc in agents.values():  # and a replacement box a lost scenario enrolled
            if proc not in procs:
                proc.stop()
        switch.unlink(missing_ok=True)
        switch_dir.rmdir()


async def _scenario(rt: Runtime, ie: BoxInit, uk: BoxInit, scenario: str, door_url: str, token: str,
                    door_proc: ServiceProc, switch: Path, out: Callable[[str], None],
                    agents: dict[str, ServiceProc], services_env: Callable[[], dict[str, str]]) -> Outcome:
    environ = {move_cli.ENV_URL: door_url, move_cli.ENV_TOKEN: token}
    async with aiohttp.ClientSession() as session:
        door = move_cli.DoorClient(move_cli.DoorConfig(door_url, token), session)
        await _door_up(door_url, door_proc)
        host = f"{scenario.split('-')[0]}-{rt.rng.token_bytes(3).hex()}.example.com"
        manifest, files = load_manifest(RELEASE_MANIFEST, name="moveprobe", env=release_env(
            scenario, ie.region, uk.region, switch if scenario == "stuck-retry" else None))
        release, _ref = await publish(rt.store, rt.settings.bucket, manifest, files, clock=rt.clock, rng=rt.rng)
        out(f"   published moveprobe as release {release.label}, its fail switch: "
            f"{ {k: v for k, v in release_env(scenario, ie.region, uk.region, switch).items() if 'FAIL' in k} }")
        created = await door.create(host, ie.label, app=release.name, release=release.release)
        if not created.ok:
            return Outcome(scenario, host, "", "", False, why=f"{host} was not created: {created.reason}")
        port = await _until(lambda: read_endpoint(ie.box_dir, host), f"{host} serving on {ie.label}", 60)
        seqs = [await asyncio.to_thread(post_write, port, f"order-{i}") for i in range(WRITES)]
        out(f"   {host} serves on {ie.label}; {WRITES} acknowledged writes (seq {seqs[0]}..{seqs[-1]})")
        if scenario == "stuck-retry":
            switch.touch(mode=0o644)
            out(f"   the fail switch is on ({switch} exists): {uk.region} and {ie.region} both fail readiness now")
        if scenario == "fenced-source":
            return await _fenced_source(rt, ie, uk, host, environ, agents, services_env, out)
        if scenario == COMMITTED:
            return await _fenced_committed(rt, ie, uk, host, environ, agents, services_env, out)
        out(f"   hostmove move --host {host} --to {uk.region}")
        args = argparse.Namespace(host=host, to=uk.region, manual_cut=False, wait=scenario not in LOST,
                                  until="closed", timeout=MOVE_TIMEOUT_S, interval=0.5, move_action=None)
        code = await move_cli.run(args, environ=environ)
        if scenario in LOST:
            code = await _lost(rt, uk, scenario, host, environ, agents[uk.label], out)
        stuck_first = False
        if scenario == "stuck-retry":
            reason = await _stuck(rt, host, MOVE_TIMEOUT_S) if code == exitcodes.WAITING else ""
            stuck_first = bool(reason)
            out(f"   stuck: {reason or 'it was not'}")
            if stuck_first:
                switch.unlink()
                out(f"   the cause is fixed ({switch} removed); hostmove move resolve --host {host} --retry")
                resolve = argparse.Namespace(host=host, move_action="resolve", retry=True)
                if await move_cli.run(resolve, environ=environ) != exitcodes.OK:
                    return Outcome(scenario, host, "", "", True, why="resolve --retry was refused")
                watch = argparse.Namespace(host=host, move_action="watch", until="closed", timeout=MOVE_TIMEOUT_S,
                                           interval=0.5)
                code = await move_cli.run(watch, environ=environ)
        record = (await rt.ledger.read_record(host)).state
        last_move = record.last_move if record is not None else None
        move_id = last_move.id if last_move is not None else ""
        ended = last_move.outcome if last_move is not None and record is not None and record.move is None else ""
        out(f"   the move ended {ended or 'not closed'} (exit {code})")
        last = await last_move_state(rt.events, host, move_id) if move_id else None
        now = WallClock().now_ms()
        lines = [t.line() for t in move_cli.timings(msgspec.to_builtins(last), now)] if last is not None else [
            "the move's last state is not on the stream"]
    if ended not in ("done", "rolled_back"):
        return Outcome(scenario, host, move_id, ended, stuck_first, lines,
                       [Check("the move ended done or rolled back", False, f"it ended {ended or 'not closed'}")])
    served, left = (uk, ie) if ended == "done" else (ie, uk)
    new_port = await _until(lambda: read_endpoint(served.box_dir, host), f"{host} serving on {served.label}", 60)
    try:
        after = await asyncio.to_thread(post_write, new_port, f"written on {served.label}")
    except OSError as exc:  # urllib's HTTPError is one: the instance did not take the write
        return Outcome(scenario, host, move_id, ended, stuck_first, lines,
                       [Check(f"{host} takes writes on {served.label}", False, str(exc))])
    out(f"   {host} takes writes on {served.label} (seq {after})")
    root = rt.settings.root
    if scenario in LOST:  # the lost region's residue is its live box's to sweep: the box back, or its replacement
        await _sweeper_back(rt, uk, scenario, host, agents, services_env, out)
    fenced_disk = scenario == "fenced-target"  # a terminated machine's disk is gone with it
    shown = await checks(
        events=rt.events, store=rt.store, host=host, port=new_port,
        target_db=instance_dir(served.box_dir / "data", host) / f"{host}.db",
        ack_logs=ack_logs(root / "acks", host, ie.label, {uk.region: uk.label}), left_bucket=region_bucket(left.region),
        left_local=[] if fenced_disk else [instance_dir(left.box_dir / "data", host) / f"{host}.db",
                                           instance_dir(left.box_dir / "data", host) / host],
        once_after_ms=ONCE_AFTER_MS, agent_logs=sorted((root / "logs").glob("box-*.log")))
    if scenario != "move" and ended == "rolled_back":
        shown += await _history_checks(rt, host, move_id, scenario if scenario in (*LOST, "dirty-rollback")
                                       else "clean-rollback", ie, uk)
    return Outcome(scenario, host, move_id, ended, stuck_first, lines, shown)


async def _lost(rt: Runtime, uk: BoxInit, scenario: str, host: str, environ: dict[str, str], agent: ServiceProc,
                out: Callable[[str], None]) -> int:
    """§7.10's operator steps once the target's agent died after its probe started: the platform stops the box and
    the operator declares it lost (``declare-lost``), or the machine is terminated and fenced and the recovery
    service takes the fence as evidence (``fenced-target``). Then the move is followed until it closes."""
    from hostmove import lost_cli

    await _until(lambda: True if not agent.alive() else None, f"the target {uk.label}'s agent to die", 120)
    out(f"   {uk.label}'s agent died after its probe started; its instance keeps running in its cgroup")
    root = str(rt.settings.root)
    if scenario == "declare-lost":
        out(f"   hostmove box stop --label {uk.label}")
        if await lost_cli.stop_box(rt, uk.label) != exitcodes.OK:
            return exitcodes.FAILED
        out(f"   hostmove move resolve --host {host} --declare-lost {uk.label} --yes")
        resolve = argparse.Namespace(host=host, move_action="resolve", retry=False, declare_lost=uk.label, yes=True,
                                     root=root, runtime=rt)
        if (code := await move_cli.run(resolve, environ=environ)) != exitcodes.OK:
            return code
    else:
        out(f"   hostmove box fence --label {uk.label} --terminated (the machine is terminated; no operator after)")
        if await lost_cli.fence_terminated(rt, uk.label) != exitcodes.OK:
            return exitcodes.FAILED
    watch = argparse.Namespace(host=host, move_action="watch", until="closed", timeout=MOVE_TIMEOUT_S, interval=0.5)
    return await move_cli.run(watch, environ=environ)


async def _sweeper_back(rt: Runtime, uk: BoxInit, scenario: str, host: str, agents: dict[str, ServiceProc],
                        services_env: Callable[[], dict[str, str]], out: Callable[[str], None]) -> None:
    """A live box in the lost region again: the lost box started again (it quarantines itself first), or, for a
    fenced one, a replacement enrolled under a new label; its straggler sweep parks what the lost box left."""
    if scenario == "declare-lost":
        agent = agents[uk.label]
        agent.start()
        out(f"   {uk.label} is started again: it retires its local state of {host} before anything else")
    else:
        label = f"{uk.label}-r{rt.rng.token_bytes(2).hex()}"
        box = await init_box(root=rt.settings.root, label=label, region=uk.region, store=rt.store,
                             bucket=rt.settings.bucket, events=rt.events, clock=rt.clock, actor=rt.actor)
        agent = ServiceProc.serve("box", services_env(), rt.settings.root / "logs" / f"box-{label}.log",
                                  "--label", box.label)
        agent.start()
        agents[label] = agent
        out(f"   a replacement box {label} enrolls in {uk.region}")
    left = (f"instances/{host_segment(host)}/", f"moves/{host_segment(host)}/")

    async def swept() -> bool | None:  # its location and the move's forward staging lane (rule sweep-staging)
        for prefix in left:
            if await rt.store.list_keys(region_bucket(uk.region), prefix):
                return None
        return True

    try:
        await _until_async(swept, f"{uk.region}'s sweep of {host}", 180)
    except TimeoutError:
        out(f"   {uk.region} still holds objects of {host} (the check below says which)")


async def _fenced_source(rt: Runtime, ie: BoxInit, uk: BoxInit, host: str, environ: dict[str, str],
                         agents: dict[str, ServiceProc], services_env: Callable[[], dict[str, str]],
                         out: Callable[[str], None]) -> Outcome:
    """§7.10 rev 7.20: a source terminated before its flip. The move waits at ``ready`` (a manual cut); the source's
    machine is terminated and fenced; the recovery service converts the move to a relocation at ``pinning`` in
    one CAS; the one-box region waits for a box; a replacement enrolls and serves the host."""
    from hostmove import lost_cli

    scenario = "fenced-source"
    out(f"   hostmove move --host {host} --to {uk.region} --manual-cut --no-wait")
    args = argparse.Namespace(host=host, to=uk.region, manual_cut=True, wait=False, until="closed",
                              timeout=MOVE_TIMEOUT_S, interval=0.5, move_action=None)
    await move_cli.run(args, environ=environ)

    async def state(want: str) -> bool | None:
        record = (await rt.ledger.read_record(host)).state
        return True if record is not None and record.move is not None and record.move.state == want else None

    await _until_async(lambda: state("ready"), "the move at ready", MOVE_TIMEOUT_S)
    before = (await rt.ledger.read_claim(host)).state
    move_id = before.op.id if before is not None else ""
    out(f"   move {move_id} is ready; {ie.label}'s machine is terminated: hostmove box fence --label {ie.label} "
        "--terminated")
    if await lost_cli.fence_terminated(rt, ie.label) != exitcodes.OK:
        return Outcome(scenario, host, move_id, "", False, why=f"{ie.label} could not be fenced")

    async def pinned() -> bool | None:
        claim = (await rt.ledger.read_claim(host)).state
        return True if claim is not None and (claim.op.kind, claim.op.phase) == ("relocating", "pinning") else None

    await _until_async(pinned, "the conversion to a relocation at pinning", 120)
    out(f"   {say('M-C22', host=host, region=ie.region)}")
    label, box, port = await _replacement_serves(rt, ie, host, agents, services_env, out)
    record = (await rt.ledger.read_record(host)).state
    ended = record.last_move.outcome if record is not None and record.last_move is not None and (
        record.last_move.id == move_id) else ""
    lane = f"moves/{host_segment(host)}/"

    async def lane_swept() -> bool | None:  # the move's staging lane in the target region (rule sweep-staging)
        return True if not await rt.store.list_keys(region_bucket(uk.region), lane) else None

    try:
        await _until_async(lane_swept, f"{uk.region}'s sweep of the move's staging lane", 180)
    except TimeoutError:
        out(f"   {uk.region} still holds the move's staging lane (the check below says which)")
    root = rt.settings.root
    shown = await checks(
        events=rt.events, store=rt.store, host=host, port=port,
        target_db=instance_dir(box.box_dir / "data", host) / f"{host}.db",
        ack_logs=ack_logs(root / "acks", host, ie.label, {uk.region: uk.label, f"{ie.region}-r": label}),
        left_bucket=region_bucket(uk.region), left_local=[instance_dir(uk.box_dir / "data", host) / f"{host}.db"],
        once_after_ms=ONCE_AFTER_MS, runner_deaths=1,  # the fence killed the source's agent mid-run
        agent_logs=sorted((root / "logs").glob("box-*.log")))
    converted = ""
    async for m in rt.events.replay(LEDGER_STREAM, subject=ledger_subject("claim", host)):
        t = decode(m.data, Transition)
        if t.meta.name == "fence-converts-moving" and t.claim is not None:
            converted = f"{t.claim.op.kind}/{t.claim.op.phase}, exec {t.claim.op.exec}, op {t.claim.op.id}"
    shown.append(Check("the move became a relocation at pinning in one CAS citing the fence",
                       converted == f"relocating/pinning, exec none, op {move_id}", converted or "no such transition"))
    return Outcome(scenario, host, move_id, ended, False, [], shown)


async def _fenced_committed(rt: Runtime, ie: BoxInit, uk: BoxInit, host: str, environ: dict[str, str],
                            agents: dict[str, ServiceProc], services_env: Callable[[], dict[str, str]],
                            out: Callable[[str], None]) -> Outcome:
    """§7.10 L14, after the record's commit (:mod:`services.move.fenced_target`): the target's agent dies right after
    its commit CAS, its instance writing on; the machine is terminated and fenced, and nothing else. The recovery
    service closes the move without the target (``done``, its open waived, citing the fence), pins the host
    (``relocating`` at ``pinning``, exec none) while uk has no live box; a replacement enrolls and the host is
    relocated to it, the fenced session's writes since its last upload declared lost."""
    from hostmove import lost_cli
    from services.box.fence import read_fence

    scenario = COMMITTED
    out(f"   hostmove move --host {host} --to {uk.region} --no-wait")
    args = argparse.Namespace(host=host, to=uk.region, manual_cut=False, wait=False, until="closed",
                              timeout=MOVE_TIMEOUT_S, interval=0.5, move_action=None)
    await move_cli.run(args, environ=environ)
    agent = agents[uk.label]
    await _until(lambda: True if not agent.alive() else None, f"the target {uk.label}'s agent to die", MOVE_TIMEOUT_S)
    record = (await rt.ledger.read_record(host)).state
    move = record.move if record is not None else None
    move_id = move.id if move is not None else ""
    if move is None or move.state != "committed":
        return Outcome(scenario, host, move_id, "", False, why=f"{uk.label}'s agent died with the move "
                       f"{move.state if move is not None else 'closed'}, not committed")
    out(f"   {uk.label}'s agent died right after move {move_id}'s commit CAS; its instance writes on, never uploaded")
    out(f"   hostmove box fence --label {uk.label} --terminated (the machine is terminated; no operator after)")
    if await lost_cli.fence_terminated(rt, uk.label) != exitcodes.OK:
        return Outcome(scenario, host, move_id, "", False, why=f"{uk.label} could not be fenced")
    fenced = await read_fence(rt.store, rt.settings.bucket, uk.label)
    if fenced is None:
        return Outcome(scenario, host, move_id, "", False, why=f"{uk.label}'s fence record is missing")
    ref = fenced[1]

    async def pinned() -> bool | None:
        claim = (await rt.ledger.read_claim(host)).state
        return True if claim is not None and (claim.op.kind, claim.op.phase) == ("relocating", "pinning") else None

    await _until_async(pinned, "the move closed without its target and the host pinned", MOVE_TIMEOUT_S)
    record = (await rt.ledger.read_record(host)).state
    last_move = record.last_move if record is not None and record.move is None else None
    ended = last_move.outcome if last_move is not None and last_move.id == move_id else ""
    out(f"   the move ended {ended or 'not closed'} without {uk.label}; {say('M-C22', host=host, region=uk.region)}")
    label, box, port = await _replacement_serves(rt, uk, host, agents, services_env, out)
    lane = f"moves/{host_segment(host)}/{move_id}/"

    async def lane_swept() -> bool | None:  # the fenced target's staging park: uk's at-rest sweep (sweep-staging)
        return True if not await rt.store.list_keys(region_bucket(uk.region), lane) else None

    try:
        await _until_async(lane_swept, f"{uk.region}'s sweep of the move's staging lane", 180)
    except TimeoutError:
        out(f"   {uk.region} still holds the move's staging lane (the check below says which)")
    last = await last_move_state(rt.events, host, move_id)
    lines = [t.line() for t in move_cli.timings(msgspec.to_builtins(last), WallClock().now_ms())] if (
        last is not None) else ["the move's last state is not on the stream"]
    root = rt.settings.root
    shown = await checks(
        events=rt.events, store=rt.store, host=host, port=port,
        target_db=instance_dir(box.box_dir / "data", host) / f"{host}.db",
        ack_logs=ack_logs(root / "acks", host, ie.label, {uk.region: uk.label, f"{uk.region}-r": label}),
        left_bucket=region_bucket(ie.region), left_local=[instance_dir(ie.box_dir / "data", host) / f"{host}.db",
                                                          instance_dir(ie.box_dir / "data", host) / host],
        once_after_ms=ONCE_AFTER_MS, runner_deaths=1,  # the failpoint killed the target's agent mid-run
        agent_logs=sorted((root / "logs").glob("box-*.log")))
    waived = last is not None and last.target_fenced == ref.key and last.opened_at is None
    shown.append(Check("the move closed without its target's open, citing the fence", waived,
                       f"target_fenced {last.target_fenced or '-'}, opened_at {last.opened_at}" if last is not None
                       else "no last state"))
    cited = pinning = ""
    async for m in rt.events.replay(LEDGER_STREAM, subject=ledger_subject("claim", host)):
        t = decode(m.data, Transition)
        if t.claim is None:
            continue
        op = t.claim.op
        if not cited and op.id == move_id and op.journal.get(f"fence.{uk.label}") == ref.journal() and any(
                b.box == uk.label for b in t.claim.lost):
            cited = f"{t.meta.name}: fence.{uk.label} = {ref.key} (sha256 {ref.sha256[:12]}), {uk.label} on lost"
        if not pinning and (op.kind, op.phase, op.exec) == ("relocating", "pinning", "none"):
            pinning = f"{t.meta.name}: relocating/pinning, exec none, op {op.id}"
    shown.append(Check("the claim cites the fence and puts the target on lost", bool(cited), cited or "no such CAS"))
    shown.append(Check("the host was pinned in its region while it had no box", bool(pinning),
                       pinning or "no such transition"))
    claim = (await rt.ledger.read_claim(host)).state
    admissions = claim.holder.admissions if claim is not None and claim.holder is not None else ()
    lost = [a.writes_lost for a in admissions if a.box == label and a.writes_lost is not None]
    shown.append(Check(f"the relocation declared {uk.label}'s session lost", bool(lost) and all(
        w.box == uk.label for w in lost), "; ".join(
        f"writes_lost {w.box} session {w.session} past TXID {w.remote_max_txid}" for w in lost) or "none"))
    alerted = [m async for m in rt.events.replay(FACTS_STREAM, subject=alert_subject("fenced-target-after-commit"))
               if host.encode() in m.data]
    shown.append(Check("the operator was alerted once (fenced-target-after-commit)", len(alerted) == 1,
                       f"{len(alerted)} alert(s)"))
    return Outcome(scenario, host, move_id, ended, False, lines, shown)


async def _replacement_serves(rt: Runtime, lost: BoxInit, host: str, agents: dict[str, ServiceProc],
                              services_env: Callable[[], dict[str, str]],
                              out: Callable[[str], None]) -> tuple[str, BoxInit, int]:
    """A replacement box enrolls in ``lost``'s region, its agent started (kept in ``agents``); answered once ``host``
    serves there and takes a write (§7.10: the relocation completes on the region's next box): its label, its box
    and the port it serves the host on."""
    label = f"{lost.label}-r{rt.rng.token_bytes(2).hex()}"
    box = await init_box(root=rt.settings.root, label=label, region=lost.region, store=rt.store,
                         bucket=rt.settings.bucket, events=rt.events, clock=rt.clock, actor=rt.actor)
    agent = ServiceProc.serve("box", services_env(), rt.settings.root / "logs" / f"box-{label}.log", "--label", label)
    agent.start()
    agents[label] = agent
    out(f"   a replacement box {label} enrolls in {lost.region}")

    async def serving() -> bool | None:
        claim = (await rt.ledger.read_claim(host)).state
        return True if claim is not None and claim.op.kind == "serving" and claim.op.exec == label else None

    await _until_async(serving, f"{host} relocated to {label}", MOVE_TIMEOUT_S)
    port = await _until(lambda: read_endpoint(box.box_dir, host), f"{host} serving on {label}", 60)
    after = await asyncio.to_thread(post_write, port, f"written on {label}")
    out(f"   {host} serves on {label} and takes writes (seq {after})")
    return label, box, port


async def _until_async(check: Callable[[], Awaitable[bool | None]], what: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        await asyncio.sleep(1.0)


def _say(text: str) -> None:
    print(text, flush=True)


async def run(root: Path, scenario: str) -> int:
    """``hostmove rehearse``: the embedded stack, two boxes, the scenario; exit 0 only when it ended as it must."""
    if scenario not in SCENARIOS:
        print(f"hostmove rehearse: --scenario must be one of {', '.join(SCENARIOS)}", file=sys.stderr)
        return exitcodes.USAGE
    root = root.resolve()
    _say(f"1. The embedded stack under {root}/ ...")
    info = stack_up(root)
    rt = await open_runtime(settings_from_stack(info, root=root), "rehearse")
    try:
        choice = await choose_boxes(rt, root)
        for why in choice.passed:
            _say(f"   passed over {why}")
        if len(choice.boxes) < 2:
            _say(f"   no two regions can be used beside what this deployment holds; start clean: "
                 f"`hostmove --root {root} stack down && rm -rf {root}`")
            return exitcodes.FAILED
        await init_deployment(root=root, store=rt.store, bucket=rt.settings.bucket, clock=rt.clock)
        boxes = [await init_box(root=root, label=label, region=region, store=rt.store, bucket=rt.settings.bucket,
                                events=rt.events, clock=rt.clock, actor=rt.actor) for label, region, _ in choice.boxes]
        source, target = boxes
        _say(f"2. Rehearsal {scenario}: {source.label} ({source.region}) to {target.label} ({target.region})")
        shown = await rehearse(rt, info, source, target, scenario, _say)
        return report(shown, _say)
    finally:
        await rt.close()


def report(shown: Outcome, say: Callable[[str], None]) -> int:
    """Print the outcome, the §13 timings and the §14.4 checks; the exit code."""
    if shown.why:
        say(f"   the rehearsal could not run: {shown.why}")
        return exitcodes.FAILED
    want, stuck = shown.expected
    say(f"3. Outcome: {shown.ended or 'not closed'}{' after stuck and resolve --retry' if shown.stuck_first else ''}"
        f" (the scenario must end {want}{' after stuck' if stuck else ''})")
    say(f"4. The move {shown.move_id}: its §13 timings against their budgets")
    for line in shown.timings:
        say(f"   {line}")
    say("5. The checks of §14.4:")
    for c in shown.checks:
        say(f"   {c.line()}")
    say(f"Rehearsal {shown.scenario}: {'passed' if shown.ok else 'FAILED'}")
    return exitcodes.OK if shown.ok else exitcodes.FAILED


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    rh = subparsers.add_parser("rehearse", help="rehearse a move, a clean or dirty rollback, a stuck move retried, "
                                               "a target that is gone before or after the commit, or a source "
                                               "gone before the flip (§14.4, §7.10) on the embedded stack",
                               epilog=exitcodes.table_text(), formatter_class=argparse.RawDescriptionHelpFormatter)
    rh.add_argument("--scenario", required=True, choices=SCENARIOS,
                    help="declare-lost, fenced-target: the target gone after its probe started (before the commit); "
                         "fenced-target-committed: the target fenced after the record's commit; fenced-source: the "
                         "source fenced before the flip")


__all__ = ["SCENARIOS", "Outcome", "add_parser", "rehearse", "release_env", "report", "run"]
