"""The projection's read API (ARCHITECTURE §8): OpenAPI, snapshot, host, change feed, resync,
long-poll and Server-Sent Events, through aiohttp's test client and a real loopback server."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote

import aiohttp
import pytest
import pytest_asyncio
from aiohttp.test_utils import TestClient, TestServer
from yarl import URL

from bus.memory_log import MemoryEventLog
from bus.subjects import LEDGER_STREAM, ledger_subject
from kernel.ports import SeededRandom, WallClock
from projections.api import make_app, serve
from projections.openapi import document
from projections.runner import Projector
from projections.sample import Feeder
from projections.store import ProjectionStore

ODD_NAMES = ["a.b.c", "x/y z", "é%?#&=", "..", "sp ace+plus", "\U0001f600.emoji"]


class World:
    def __init__(self, root: Path) -> None:
        self.log = MemoryEventLog()
        self.feeder = Feeder(self.log)
        self.store = ProjectionStore.open(root, rng=SeededRandom(11), clock=WallClock())
        self.projector = Projector(self.store, self.log, clock=WallClock(), poll_interval=0.05)

    async def sync(self) -> None:
        await self.projector.catch_up()


@pytest_asyncio.fixture(loop_scope="session")
async def world(tmp_path: Path) -> World:
    w = World(tmp_path / "proj")
    for name in ["h1", "h2", *ODD_NAMES]:
        await w.feeder.claim(name)
    await w.feeder.record("h1", move_state="cutting")
    await w.feeder.claim("h2", live=False)
    await w.sync()
    return w


@pytest_asyncio.fixture(loop_scope="session")
async def client(world: World) -> AsyncIterator[TestClient[Any, Any]]:
    app = make_app(world.store, poll_interval=0.05, max_wait=10.0, heartbeat=0.2)
    async with TestClient(TestServer(app)) as c:
        yield c


async def get(client: TestClient[Any, Any], url: str | URL, status: int = 200, **kw: Any) -> Any:
    resp = await client.get(url, **kw)
    assert resp.status == status, (url, resp.status, await resp.text())
    assert resp.content_type == "application/json"
    return await resp.json()


def host_url(name: str) -> URL:
    """Percent-encode everything, dots too: clients resolve "." and ".." path segments otherwise."""
    return URL("/v1/hosts/" + quote(name, safe="").replace(".", "%2E"), encoded=True)


# -- OpenAPI and health --------------------------------------------------------------------------


async def test_openapi_describes_every_route(client: TestClient[Any, Any]) -> None:
    doc = await get(client, "/openapi.json")
    assert doc["openapi"] == "3.1.0" and doc == document()
    routes = {r.resource.canonical.replace("{host:.+}", "{host}") for r in client.app.router.routes()
              if r.method == "GET" and r.resource is not None}
    from projections.console_openapi import PATHS  # the console's routes, served with a console (tests/test_console.py)

    assert routes == set(doc["paths"]) - set(PATHS)
    for path, item in doc["paths"].items():
        for op in item.values():
            assert op["operationId"] and "200" in op["responses"], path
            for response in op["responses"].values():
                for media in response.get("content", {}).values():
                    ref = media["schema"].get("$ref")
                    if ref:
                        assert ref.rsplit("/", 1)[1] in doc["components"]["schemas"]


async def test_healthz(client: TestClient[Any, Any], world: World) -> None:
    body = await get(client, "/healthz")
    assert body["ok"] is True and body["identity"] == world.store.identity
    assert body["revision"] == world.store.revision() and body["position"] == world.store.position()


# -- snapshot and host ---------------------------------------------------------------------------


async def test_snapshot_lists_live_hosts_with_revision_and_cursor(
    client: TestClient[Any, Any], world: World
) -> None:
    body = await get(client, "/v1/hosts")
    names = [h["host"] for h in body["hosts"]]
    assert "h2" not in names and {"h1", *ODD_NAMES} == set(names)
    assert body["revision"] == world.store.revision() and body["cursor"] == world.store.cursor()
    h1 = next(h for h in body["hosts"] if h["host"] == "h1")
    assert h1["move_state"] == "cutting" and h1["claim"]["gen"] == 1 and h1["record"]["move"]["to"] == "box-b"
    assert "claim_json" not in h1
    everything = await get(client, "/v1/hosts?include_deleted=true")
    assert {"h2"} == {h["host"] for h in everything["hosts"]} - set(names)
    bad = await get(client, "/v1/hosts?include_deleted=maybe", status=400)
    assert bad["error"] == "bad_request" and "include_deleted" in bad["reason"]
    unknown = await get(client, "/v1/hosts?cursor=x", status=400)
    assert "unknown query parameter 'cursor'" in unknown["reason"]


@pytest.mark.parametrize("name", ODD_NAMES)
async def test_host_names_with_any_characters(client: TestClient[Any, Any], name: str) -> None:
    body = await get(client, host_url(name))
    assert body["host"] == name and body["claim"]["host"] == name


async def test_unknown_host_is_a_404_with_a_reason(client: TestClient[Any, Any]) -> None:
    body = await get(client, host_url("no.such/host"), status=404)
    assert body == {"error": "not_found", "reason": "no host named 'no.such/host' in this projection"}
    tomb = await get(client, host_url("h2"))
    assert tomb["deleted"] is True  # a tombstone is still a host
    route = await get(client, "/v2/nothing", status=404)
    assert route["error"] == "not_found"


# -- the change feed -----------------------------------------------------------------------------


async def test_changes_page_and_resume(client: TestClient[Any, Any], world: World) -> None:
    seen: list[tuple[str, int]] = []
    cursor = ""
    while True:
        body = await get(client, f"/v1/changes?cursor={cursor}&limit=3")
        assert len(body["changes"]) <= 3
        seen += [(c["host"], c["revision"]) for c in body["changes"]]
        cursor = body["cursor"]
        if not body["more"]:
            break
    snapshot = world.store.snapshot(include_deleted=True)
    assert sorted(seen) == sorted((h.host, h.revision) for h in snapshot.hosts)
    assert cursor == snapshot.cursor
    await world.feeder.claim("h1")
    await world.sync()
    body = await get(client, f"/v1/changes?cursor={cursor}")
    assert [(c["host"], c["claim_gen"]) for c in body["changes"]] == [("h1", 2)]


@pytest.mark.parametrize("limit", ["0", "1001", "abc", "-1", "1.5", "", "١"])
async def test_changes_refuses_a_malformed_limit(client: TestClient[Any, Any], limit: str) -> None:
    body = await get(client, f"/v1/changes?limit={quote(limit)}", status=400)
    assert body["error"] == "bad_request" and "limit" in body["reason"]


@pytest.mark.parametrize("cursor", ["garbage", "0" * 32 + ":0", "0" * 32 + ":x"])
async def test_a_foreign_or_malformed_cursor_gets_resync(client: TestClient[Any, Any], world: World,
                                                          cursor: str) -> None:
    for url in (f"/v1/changes?cursor={cursor}", f"/v1/changes/wait?cursor={cursor}&timeout=1",
                f"/v1/stream?cursor={cursor}"):
        body = await get(client, url, status=409)
        assert body["resync"] is True and body["reason"] and body["identity"] == world.store.identity


async def test_old_cursors_resync_after_a_rebuild(client: TestClient[Any, Any], world: World) -> None:
    old = (await get(client, "/v1/hosts"))["cursor"]
    before = (await get(client, "/v1/hosts?include_deleted=1"))["hosts"]
    await world.store.rebuild(world.log)
    body = await get(client, f"/v1/changes?cursor={old}", status=409)
    assert body["resync"] is True and "another projection identity" in body["reason"]
    fresh = await get(client, "/v1/hosts?include_deleted=1")
    assert fresh["cursor"] != old and fresh["hosts"] == before
    assert (await get(client, f"/v1/changes?cursor={fresh['cursor']}"))["changes"] == []


# -- long-poll -----------------------------------------------------------------------------------


async def test_long_poll_returns_empty_after_the_timeout(client: TestClient[Any, Any], world: World) -> None:
    cursor = world.store.cursor()
    t0 = time.monotonic()
    body = await get(client, f"/v1/changes/wait?cursor={cursor}&timeout=0.3")
    assert body["changes"] == [] and body["cursor"] == cursor and time.monotonic() - t0 >= 0.3


async def test_long_poll_returns_as_soon_as_there_is_a_change(
    client: TestClient[Any, Any], world: World
) -> None:
    cursor = world.store.cursor()

    async def later() -> None:
        await asyncio.sleep(0.2)
        await world.feeder.claim("late.host")
        await world.sync()

    writer = asyncio.create_task(later())
    t0 = time.monotonic()
    body = await get(client, f"/v1/changes/wait?cursor={cursor}&timeout=8")
    await writer
    assert [c["host"] for c in body["changes"]] == ["late.host"] and time.monotonic() - t0 < 4


@pytest.mark.parametrize("timeout", ["-1", "11", "nan", "inf", "soon"])
async def test_long_poll_refuses_a_bad_timeout(client: TestClient[Any, Any], timeout: str) -> None:
    body = await get(client, f"/v1/changes/wait?timeout={timeout}", status=400)
    assert "timeout" in body["reason"]


async def test_long_poll_from_another_process_polls_the_database(tmp_path: Path) -> None:
    """The API's store is a separate reader of the root: no in-process wake-up, only polling."""
    w = World(tmp_path / "shared")
    reader = ProjectionStore.open(tmp_path / "shared", rng=SeededRandom(12), clock=WallClock())
    app = make_app(reader, poll_interval=0.05)
    async with TestClient(TestServer(app)) as c:
        cursor = reader.cursor()

        async def later() -> None:
            await asyncio.sleep(0.2)
            await w.feeder.claim("elsewhere")
            await w.sync()

        writer = asyncio.create_task(later())
        body = await get(c, f"/v1/changes/wait?cursor={cursor}&timeout=5")
        await writer
        assert [x["host"] for x in body["changes"]] == ["elsewhere"]


# -- Server-Sent Events --------------------------------------------------------------------------


async def read_event(resp: aiohttp.ClientResponse, timeout: float = 5.0) -> dict[str, str]:
    """The next event (comment-only blocks are skipped)."""
    event: dict[str, str] = {}
    while True:
        line = (await asyncio.wait_for(resp.content.readline(), timeout)).decode("utf-8")
        assert line, "the stream ended"
        line = line.rstrip("\n")
        if line == "":
            if event:
                return event
            continue
        if line.startswith(":"):
            event.setdefault("_comments", "")
            event["_comments"] += line
            continue
        key, _, value = line.partition(": ")
        event[key] = value


async def test_sse_streams_changes_then_resync(client: TestClient[Any, Any], world: World) -> None:
    import json

    snap = await get(client, "/v1/hosts")
    resp = await client.get(f"/v1/stream?cursor={snap['cursor']}")
    assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
    try:
        first = await read_event(resp)
        assert first.get("retry") == "2000"
        caught = await read_event(resp)
        assert caught["event"] == "caught-up" and caught["id"] == snap["cursor"]
        await world.feeder.claim("sse.1")
        await world.feeder.record("sse.1", move_state="landing")
        await world.sync()
        change = await read_event(resp)
        data = json.loads(change["data"])
        assert change["event"] == "change" and data["host"] == "sse.1" and data["move_state"] == "landing"
        assert change["id"] == f"{snap['identity']}:{data['revision']}"
        caught = await read_event(resp)
        assert caught["event"] == "caught-up" and caught["id"] == change["id"]
        keepalive = await read_event(resp)  # nothing new: a heartbeat comment, then the same again
        assert keepalive.get("_comments", "").startswith(": keepalive")
        await world.store.rebuild(world.log)
        resync = await read_event(resp)
        assert resync["event"] == "resync" and json.loads(resync["data"])["resync"] is True
        assert await asyncio.wait_for(resp.content.read(), 5) == b""  # the stream ended
    finally:
        resp.close()


async def test_sse_resumes_from_last_event_id(client: TestClient[Any, Any], world: World) -> None:
    import json

    cursor = world.store.cursor()
    await world.feeder.claim("resume.1")
    await world.feeder.claim("resume.2")
    await world.sync()
    resp = await client.get("/v1/stream", headers={"Last-Event-ID": cursor})
    try:
        await read_event(resp)  # retry
        hosts = [json.loads((await read_event(resp))["data"])["host"] for _ in range(2)]
        assert hosts == ["resume.1", "resume.2"]
    finally:
        resp.close()


# -- a real server, with the projector inside ----------------------------------------------------------


async def test_real_server_runs_the_projector_and_reports_a_halt(tmp_path: Path) -> None:
    w = World(tmp_path / "served")
    app = make_app(w.store, projector=w.projector, poll_interval=0.05)
    runner = await serve(app, "127.0.0.1", 0)
    try:
        host, port = runner.addresses[0][:2]
        base = f"http://{host}:{port}"
        async with aiohttp.ClientSession() as http:
            await w.feeder.claim("served.1")
            w.projector.notify()

            async def fetch(path: str) -> tuple[int, Any]:
                async with http.get(base + path) as r:
                    return r.status, await r.json()

            status, body = await fetch(f"/v1/changes/wait?cursor={w.store.identity}:0&timeout=5")
            assert status == 200 and [c["host"] for c in body["changes"]] == ["served.1"]
            status, health = await fetch("/healthz")
            assert (status, health["ok"], health["projector"]) == (200, True, "running")
            await w.log.publish(LEDGER_STREAM, ledger_subject("claim", "bad"), b"[]")
            w.projector.notify()
            await until(lambda: bool(w.store.errors(kind="decode")))
            for _ in range(100):
                status, health = await fetch("/healthz")
                if status == 503:
                    break
                await asyncio.sleep(0.02)
            assert status == 503 and health["projector"] == "halted"
            assert "cannot be projected" in health["reason"]
            assert health["errors"] == {"decode": 1}
    finally:
        await runner.cleanup()


async def until(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)
