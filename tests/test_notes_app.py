"""Any app, not only the sample (issue 18): ``notes`` (``examples/notes/``), an app no test helper knows, published
as a release with a sealed secret, created on ``ie`` and moved to ``uk`` by the two box agents, on the real stack.

After the move, the §14.4 checks that apply to it: its instance id verifies against its database on the target (the
files directory moved with the database), its secret is present (it is ready and takes writes with its token),
every note and its attachment file is there, its declared schedule ran exactly once per due time around the cut,
nothing of it is left live in the region it left, and the host's history audits clean."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
import pytest_asyncio

from bus.nats_log import NatsEventLog
from events.ids import new_incarnation
from hostmove.rehearsal import cut_at, no_live_copy, timers_once
from hostmove.stackinfo import StackInfo
from kernel.ports import SystemRandom, WallClock
from services.agent.service import read_endpoint
from services.apps.releases import load_manifest, publish
from services.box.instance.sandbox import instance_dir
from services.door.api import Door
from services.door.auth import Identity
from services.door.decide import MoveRequest
from services.hosts.create import create_host
from services.ledger import Committed
from services.ledger.audit import run_audit
from services.objstore.s3 import S3Store
from tests.helpers.agents import AgentWorld, agent_world, data_buckets, eventually

NOTES = Path(__file__).resolve().parent.parent / "examples" / "notes" / "release.toml"
TOKEN = "notes-token-7f3a"
NOTES_ENV = {"NOTES_COMPACT_EVERY_S": "0.4"}


@pytest_asyncio.fixture(loop_scope="session", scope="module")
async def shared(stack: StackInfo, unique: Callable[[str], str]) -> AsyncIterator[tuple[S3Store, NatsEventLog, str]]:
    async with data_buckets(stack, unique, "nts") as s:
        yield s


def call(port: int, method: str, path: str, body: object | None = None, token: str = "") -> tuple[int, object]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data, method=method,
                                 headers={"Content-Type": "application/json",
                                          **({"Authorization": f"Bearer {token}"} if token else {})})
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


async def served(w: AgentWorld, region: str, host: str, timeout_s: float = 60.0) -> int:
    async def check() -> int | None:
        port = read_endpoint(w.box_dir(region), host)
        if port is None:
            return None
        try:
            status, _ = await asyncio.to_thread(call, port, "GET", "/healthz")
        except OSError:
            return None
        return port if status == 200 else None

    return await eventually(check, f"{host} served on {w.labels[region]}", timeout_s)


@pytest.mark.asyncio(loop_scope="session")
async def test_the_notes_app_moves_with_its_files_timers_and_secret(stack: StackInfo, unique: Callable[[str], str],
                                                                   shared: tuple[S3Store, NatsEventLog, str],
                                                                   tmp_path: Path) -> None:
    store, events, prefix = shared
    async with agent_world(stack, unique, tmp_path, prefix, store=store, events=events) as w:
        manifest, files = load_manifest(NOTES, name="notes", env=NOTES_ENV, secrets={"NOTES_TOKEN": TOKEN})
        release, ref = await publish(store, w.deploy, manifest, files, clock=WallClock())
        host = f"{unique('notes')}.example.com"
        created = await create_host(w.ledger, host, box=w.labels["ie"], region="ie",
                                    incarnation=new_incarnation(SystemRandom()), app=ref)
        assert isinstance(created, Committed) and created.state.holder is not None
        assert created.state.holder.app == ref, "the claim names the release"
        port = await served(w, "ie", host)
        status, answer = await asyncio.to_thread(call, port, "POST", "/notes", {"title": "x", "body": "y"})
        assert status == 401, "a write needs the secret"
        ids = []
        for i in range(12):
            status, answer = await asyncio.to_thread(call, port, "POST", "/notes", {
                "title": f"note {i}", "body": f"body {i}", "attachment": f"attached to note {i}\n" * 50}, TOKEN)
            assert status == 201, answer
            assert isinstance(answer, dict)
            ids.append(int(answer["id"]))
        _, before = await asyncio.to_thread(call, port, "GET", "/status")
        assert isinstance(before, dict) and before["not_ready"] is None
        await asyncio.sleep(1.5)  # the schedule runs on ie first

        door = Door(w.ledger, clock=WallClock(), rng=SystemRandom())
        answer_move = await door.request_move(host, MoveRequest("uk", "auto"), Identity("op", "operator"))
        assert answer_move.status in (200, 201), answer_move.body
        move_id = str(answer_move.body["move"]["id"])

        async def moved() -> bool:
            record = (await w.ledger.read_record(host)).state
            claim = (await w.ledger.read_claim(host)).state
            return (record is not None and record.move is None and record.last_move is not None
                    and record.last_move.id == move_id and claim is not None and claim.op.kind == "serving")

        try:
            await eventually(moved, f"the move of {host} to close", 120)
        except AssertionError:
            logs = "\n".join(a.output()[-4000:] for a in w.agents.values())
            raise AssertionError(f"not moved: {(await w.ledger.read_record(host)).state}\n{logs}") from None
        record = (await w.ledger.read_record(host)).state
        claim = (await w.ledger.read_claim(host)).state
        assert record is not None and record.last_move is not None and record.last_move.outcome == "done", record
        assert claim is not None and claim.op.exec == w.labels["uk"] and claim.holder is not None
        assert claim.holder.app == ref, "the moved incarnation still runs the release it was created with"

        port = await served(w, "uk", host)
        _, after = await asyncio.to_thread(call, port, "GET", "/status")
        assert isinstance(after, dict)
        assert after["not_ready"] is None and after["instance_id"] == before["instance_id"], (before, after)
        for i, note_id in enumerate(ids):
            status, note = await asyncio.to_thread(call, port, "GET", f"/notes/{note_id}")
            assert status == 200 and isinstance(note, dict), note
            assert note["body"] == f"body {i}" and note["attachment"] == f"attached to note {i}\n" * 50
        status, _ = await asyncio.to_thread(call, port, "POST", "/notes", {"title": "on uk", "body": "z"}, TOKEN)
        assert status == 201, "the secret reached the target's instance"
        staged = w.box_dir("uk") / "releases" / "notes" / str(release.release) / "files" / "notes.py"
        assert staged.is_file(), "the target staged the release's files"

        cut = await cut_at(events, host)
        deadline = time.monotonic() + 10
        while True:  # the schedule must run on uk after the cut
            timers = await asyncio.to_thread(timers_once, port, cut_at_ms=cut, now_ms=int(time.time() * 1000),
                                             once_due_ms=None)
            if timers.ok or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.3)
        assert timers.ok, timers.detail
        left = await no_live_copy(store, f"{w.prefix}-ie", host, local=[
            instance_dir(w.box_dir("ie") / "data", host) / f"{host}.db",
            instance_dir(w.box_dir("ie") / "data", host) / host])
        assert left.ok, left.detail
        audit = await run_audit(w.events, w.ledger, host=host)
        assert audit.clean(strict=True), [f.line() for f in audit.findings]
