"""The demo's main job: a real move of a running instance from ``ie-1`` to ``uk-1``, carried out by services
(issue 4 item 8; spec §14.4).

The console services (the door, the recovery pass) and one agent per box (``hostmove serve box``) run as their
own OS processes, as in production; this process only acts as the operator and the dashboard:

1. it publishes ``moveprobe`` as an app release (issue 18: like any app) and creates a host running it on ``ie-1``
   through the door; the ``ie-1`` agent renders the release, admits and starts it in a cgroup v2 leaf, replicating
   into the ``ie`` bucket; it writes continuously (a background row every 0.2 s, its schedule every 0.4 s, its
   once-timer due 4 s after its first boot) and takes 20 writes from us;
2. it runs ``hostmove move --host H --to uk`` (the CLI, against the door's HTTP API) and shows its live
   progress: the agents do the rest on ledger events (rounds, cut, landing, probe, commit, open, parks, close);
3. it prints the move's timings and the checks of §14.4 (:mod:`hostmove.rehearsal`).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import aiohttp
import msgspec

from hostmove import exitcodes, move_cli
from hostmove.probe_apps import free_port, post_write
from hostmove.procs import ServiceProc, service_env
from hostmove.rehearsal import Check, ack_logs, checks, last_move_state
from hostmove.runtime import Runtime
from hostmove.stackinfo import StackInfo
from kernel.ports import WallClock
from moveprobe import RELEASE_MANIFEST
from services.agent.config import region_bucket
from services.agent.service import read_endpoint
from services.apps.releases import load_manifest, publish
from services.box.instance.proctree import CgroupTree
from services.box.instance.sandbox import instance_dir
from services.box.roster import BoxInit, ensure_deployment
from services.door.auth import token_digest

T = TypeVar("T")
APP = {"MOVEPROBE_INTERVAL_S": "0.2", "MOVEPROBE_SCHEDULE_EVERY_S": "0.4", "MOVEPROBE_ONCE_AFTER_S": "4"}
ONCE_AFTER_MS = 4000
WRITES = 20


@dataclass(frozen=True)
class Shown:
    """What the demo's move showed: the host, its move, the status lines and the §14.4 checks."""

    host: str
    move_id: str
    status: list[str]
    checks: list[Check]

    @property
    def ok(self) -> bool:
        return bool(self.move_id) and all(c.ok for c in self.checks)


async def _until(check: Callable[[], T | None], what: str, timeout_s: float) -> T:
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not happen within {timeout_s:g} s")
        await asyncio.sleep(0.1)


DEMO_WINDOWS = {"HOSTMOVE_PROBE_WINDOW_S": "12", "HOSTMOVE_CUT_WINDOW_S": "30"}
"""The fast profile's seconds, but the landing probe's window (§7.3) doubled and the cut window T11 prices it against
30 s: the demo runs on whatever machine its reader has, and on a loaded one (a CI's, its tests beside it) the sample
app once answered its readiness path after the profile's 6 s, and a cut's steps took 13 s against its 12 s window
(T11 prices the fixed steps at the profile's constants, not at what they took), each rolling the move back."""


async def _door_up(url: str, proc: ServiceProc, timeout_s: float = 30.0) -> None:
    async with aiohttp.ClientSession() as session:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                async with session.get(f"{url}/openapi.json", timeout=aiohttp.ClientTimeout(total=2)) as resp:
                    if resp.status == 200:
                        return
            except (aiohttp.ClientError, TimeoutError, OSError):
                pass
            if not proc.alive() or time.monotonic() > deadline:
                raise TimeoutError(f"the door did not come up: {proc.output()[-500:]}")
            await asyncio.sleep(0.1)


async def move_demo(rt: Runtime, info: StackInfo, ie: BoxInit, uk: BoxInit, out: Callable[[str], None]
                    ) -> Shown | tuple[int, str]:
    """Start the services, create, write, move, check (``ie`` is the source box, ``uk`` the target, whatever their
    regions). Answers what it showed, or the exit code and why it could not run it here."""
    root = rt.settings.root
    deployment = await ensure_deployment(rt.store, rt.settings.bucket, rng=rt.rng, clock=rt.clock)
    ok, why = CgroupTree.discover(ie.label, deployment=deployment, clock=rt.clock).strict_available()
    if not ok:
        return exitcodes.FAILED, f"this machine cannot spawn strictly ({why}); a box here refuses to take part in moves"
    token = rt.rng.token_bytes(32).hex()
    env = service_env(info, root=root, bucket=rt.settings.bucket, extra={
        "HOSTMOVE_PROFILE": "fast", "HOSTMOVE_OPERATOR_TOKENS": f"demo={token_digest(token)}", **DEMO_WINDOWS})
    door_url = f"http://127.0.0.1:{free_port()}"
    logs = root / "logs"
    procs = [ServiceProc.serve("door", env, logs / "door.log", "--port", door_url.rsplit(":", 1)[1]),
             ServiceProc.serve("recovery", env, logs / "recovery.log")]
    procs += [ServiceProc.serve("box", env, logs / f"box-{b.label}.log", "--label", b.label) for b in (ie, uk)]
    for proc in procs:
        proc.start()
    out(f"   services up: door at {door_url}, recovery, and the agents of {ie.label} and {uk.label} "
        f"(logs in {logs}/)")
    try:
        return await _run(rt, ie, uk, door_url, token, procs[0], out)
    except TimeoutError as exc:
        return exitcodes.WAITING, f"{exc}; the services' logs are in {logs}/"
    finally:
        for proc in reversed(procs):
            proc.stop()


async def _run(rt: Runtime, ie: BoxInit, uk: BoxInit, door_url: str, token: str, door_proc: ServiceProc,
               out: Callable[[str], None]) -> Shown | tuple[int, str]:
    async with aiohttp.ClientSession() as session:
        door = move_cli.DoorClient(move_cli.DoorConfig(door_url, token), session)
        await _door_up(door_url, door_proc)
        host = f"shop-{rt.rng.token_bytes(3).hex()}.example.com"
        manifest, files = load_manifest(RELEASE_MANIFEST, name="moveprobe", env=APP)  # an app like any other
        release, ref = await publish(rt.store, rt.settings.bucket, manifest, files, clock=rt.clock, rng=rt.rng)
        out(f"   published the sample app as release {release.label} ({ref.digest[:19]}...)")
        created = await door.create(host, ie.label, app=release.name, release=release.release)
        if not created.ok:
            return move_cli.not_ok(created, sys.stderr), f"{host} was not created"
        port = await _until(lambda: read_endpoint(ie.box_dir, host), f"{host} serving on {ie.label}", 60)
        out(f"   {host} serves on {ie.label} (moveprobe in a cgroup v2 leaf, replicating into "
            f"s3://{region_bucket(ie.region)}/), writing a background row every 0.2 s")
        seqs = [await asyncio.to_thread(post_write, port, f"order-{i}") for i in range(WRITES)]
        out(f"   {WRITES} acknowledged writes (seq {seqs[0]}..{seqs[-1]}); now: hostmove move --host {host} "
            f"--to {uk.region}")
        args = argparse.Namespace(host=host, to=uk.region, manual_cut=False, wait=True, until="closed", timeout=180.0,
                                  interval=0.3, move_action=None)  # the checks read what the parks left: the close
        code = await move_cli.run(args, environ={move_cli.ENV_URL: door_url, move_cli.ENV_TOKEN: token})
        if code != move_cli.EXIT_DONE:
            return code, f"the move ended with exit code {code}"
        record = (await rt.ledger.read_record(host)).state
        move_id = record.last_move.id if record is not None and record.last_move is not None else ""
        last = await last_move_state(rt.events, host, move_id)
        now = WallClock().now_ms()
        lines = [t.line() for t in move_cli.timings(msgspec.to_builtins(last), now)] if last is not None else [
            "the move's last state is not on the stream"]
    new_port = await _until(lambda: read_endpoint(uk.box_dir, host), f"{host} serving on {uk.label}", 30)
    after = await asyncio.to_thread(post_write, new_port, "written on uk")
    out(f"   {host} takes writes on {uk.label} (seq {after})")
    root = rt.settings.root
    shown = await checks(
        events=rt.events, store=rt.store, host=host, port=new_port,
        target_db=instance_dir(uk.box_dir / "data", host) / f"{host}.db",
        ack_logs=ack_logs(root / "acks", host, ie.label, {uk.region: uk.label}), left_bucket=region_bucket(ie.region),
        left_local=[instance_dir(ie.box_dir / "data", host) / f"{host}.db",
                    instance_dir(ie.box_dir / "data", host) / host],
        once_after_ms=ONCE_AFTER_MS)
    return Shown(host, move_id, lines, shown)
