"""Schema fuzzing of both HTTP APIs (issue 14 item 7): schemathesis generates requests from each OpenAPI document,
valid and invalid, and every answer must be documented, conform to its schema and never be a 5xx.

The door runs over the in-memory store and event log (its behaviour does not depend on S3 or NATS here), with two
boxes in the roster and a host created on one, so the generated requests reach the deciders; the projection API
runs over a projection of sample hosts. Each server runs on a loopback port in its own thread with its own event
loop (schemathesis calls it synchronously). Bounded: a few dozen examples per operation and mode, seconds in all.
The live feed (``/v1/changes/wait`` and the SSE ``/v1/stream``) is left out: a long poll answers at its timeout.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
import schemathesis
from aiohttp import web
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis.generation import GenerationMode

from bus.memory_log import MemoryEventLog
from events import Actor
from kernel.ports import ManualClock, SeededRandom, WallClock
from projections.api import make_app as projection_app
from projections.openapi import document as projection_document
from projections.sample import Feeder
from projections.store import ProjectionStore
from services.box.roster import init_box
from services.door.api import Door, make_app
from services.door.api import document as door_document
from services.door.auth import TokenSet
from services.hosts.create import create_host
from services.ledger.ledger import Ledger
from services.objstore.memory import MemoryStore

OPERATOR = "op-fuzz-0123456789abcdef"
EXAMPLES = 30
LIVE_FEED = ("/v1/changes/wait", "/v1/stream")


class Served:
    """An aiohttp app on a loopback port, in a thread of its own with its own event loop."""

    def __init__(self, build: Callable[[], Awaitable[web.Application]]) -> None:
        self._build = build
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.base_url = ""

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._runner = self._loop.run_until_complete(self._start())
        self._ready.set()
        self._loop.run_forever()
        self._loop.run_until_complete(self._runner.cleanup())
        self._loop.close()

    async def _start(self) -> web.AppRunner:
        runner = web.AppRunner(await self._build())
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.base_url = f"http://127.0.0.1:{port}"
        return runner

    def __enter__(self) -> Served:
        self._thread.start()
        assert self._ready.wait(30), "the server did not start"
        return self

    def __exit__(self, *exc: object) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(30)


async def _door_app(root: Path) -> web.Application:
    clock = ManualClock()
    store, events = MemoryStore(), MemoryEventLog()
    bucket = "fuzz-deploy"
    await store.create_bucket(bucket)
    actor = Actor(service="fuzz", pid=1, nonce="fuzz")
    for label, region in (("ie-1", "ie"), ("uk-1", "uk")):
        await init_box(root=root, label=label, region=region, store=store, bucket=bucket, events=events,
                       clock=clock, actor=actor)
    ledger = Ledger(store, events, clock, actor, bucket)
    await create_host(ledger, "a.example.com", box="ie-1", region="ie", incarnation="a" * 64)
    door = Door(ledger, clock=clock, rng=SeededRandom(7))
    return make_app(door, TokenSet.of(operators={"alice": OPERATOR}, status={}))


async def _projection_app(root: Path) -> web.Application:
    log = MemoryEventLog()
    feeder = Feeder(log)
    store = ProjectionStore.open(root, rng=SeededRandom(11), clock=WallClock())
    from projections.runner import Projector

    for name in ("h1", "h2", "a.b.c"):
        await feeder.claim(name)
    await feeder.record("h1", move_state="cutting")
    await Projector(store, log, clock=WallClock(), poll_interval=0.05).catch_up()
    from projections.console import Console

    objects, bucket = MemoryStore(), "fuzz-deploy"  # the console's reads: a roster of two boxes (issue 20)
    await objects.create_bucket(bucket)
    actor = Actor(service="fuzz", pid=1, nonce="fuzz")
    for label, region in (("ie-1", "ie"), ("uk-1", "uk")):
        await init_box(root=root.parent / "boxes", label=label, region=region, store=objects, bucket=bucket,
                       events=log, clock=WallClock(), actor=actor)
    return projection_app(store, poll_interval=0.05, max_wait=1.0, heartbeat=0.2,
                          console=Console(objects, bucket, log))


def _operations(doc: dict[str, Any]) -> list[Any]:
    schema = schemathesis.openapi.from_dict(doc)
    ops = [r.ok() for r in schema.get_all_operations()]
    return [op for op in ops if op.path not in LIVE_FEED]


def _fuzz(served: Served, doc: dict[str, Any], headers: dict[str, str]) -> list[str]:
    """Every operation, valid and invalid requests; the failures found (none is the pass)."""
    failures: list[str] = []
    session = requests.Session()
    for op in _operations(doc):
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

            @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
                      suppress_health_check=list(HealthCheck))
            @given(case=op.as_strategy(generation_mode=mode))
            def run(case: Any) -> None:
                response = case.call(base_url=served.base_url, session=session, headers=headers, timeout=10)
                case.validate_response(response)

            try:
                run()
            except Unsatisfiable:  # nothing of this operation can be made invalid (no parameter, no body)
                assert mode is GenerationMode.NEGATIVE, f"no valid request for {op.method} {op.path}"
            except (Exception, BaseExceptionGroup) as exc:  # noqa: BLE001 - every operation's first failure, reported together
                failures.append(f"{op.method.upper()} {op.path} [{mode.value}]: {exc}")
    return failures


@pytest.fixture
def door(tmp_path: Path) -> Iterator[Served]:
    with Served(lambda: _door_app(tmp_path / "boxes")) as served:
        yield served


@pytest.fixture
def projections(tmp_path: Path) -> Iterator[Served]:
    with Served(lambda: _projection_app(tmp_path / "proj")) as served:
        yield served


def test_the_door_answers_as_its_schema_says(door: Served) -> None:
    failures = _fuzz(door, door_document(), {"Authorization": f"Bearer {OPERATOR}"})
    assert not failures, "\n".join(failures[:20])


def test_the_projection_api_answers_as_its_schema_says(projections: Served) -> None:
    failures = _fuzz(projections, projection_document(), {})
    assert not failures, "\n".join(failures[:20])


def test_the_door_names_the_part_of_the_request_it_refuses(door: Served) -> None:
    """A bad query parameter is named as one (it was "the request body is not valid"); 30,000 levels of nesting under
    the body cap and a field named twice are 400s with the sentence, never a 500 or the last value taken."""
    auth = {"Authorization": f"Bearer {OPERATOR}"}
    got = requests.get(f"{door.base_url}/v1/hosts/a.example.com/move?detail=yes", headers=auth, timeout=10)
    assert got.status_code == 400 and got.json()["copy"] == "M-R38", got.text
    assert got.json()["reason"] == "The query parameter detail is not valid: it must be 1, 0, true or false."
    deep = b"[" * 30_000 + b"]" * 30_000
    assert len(deep) < 64 * 1024
    for body, needle in ((deep, "30000 levels deep"), (b'{"to": "uk", "to": "ie"}', "'to' twice")):
        got = requests.post(f"{door.base_url}/v1/hosts/a.example.com/move", data=body, headers=auth, timeout=10)
        assert got.status_code == 400 and got.json()["copy"] == "M-R4" and needle in got.json()["reason"], got.text
    doc = door_document()["components"]["schemas"]
    assert doc["MoveRequest"]["properties"]["to"]["pattern"] == doc["CreateRequest"]["properties"]["box"]["pattern"]
