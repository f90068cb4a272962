"""The door's HTTP API on the real stack: SeaweedFS, NATS JetStream and real boxes in the roster.

One bucket for the module; every test uses its own host names. Every refusal is checked to write
nothing: the claim's and the record's gen and the last stream sequence of each are compared before
and after.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import pytest
import pytest_asyncio
from aiohttp import ClientSession, web
from aiohttp.test_utils import TestClient, TestServer

from bus.nats_log import NatsEventLog
from bus.subjects import LEDGER_STREAM, ledger_subject
from events import Actor, Record, Transition, decode
from hostmove.runtime import Runtime, settings_from_stack
from hostmove.stackinfo import StackInfo
from kernel.ports import ManualClock, SystemRandom
from services.box.fence import decide_fence_roster
from services.box.roster import RosterBox, decide_register, init_box, update_roster
from services.door.api import ROUTES, Door, document, make_app, serve_door
from services.door.auth import Identity, TokenSet
from services.door.decide import FLOOR_KEY, MoveRequest
from services.ledger.ledger import Committed, Crash, Ledger
from services.objstore.s3 import S3Store

OPERATOR = "op-" + uuid.uuid4().hex
READER = "rd-" + uuid.uuid4().hex
WRONG = "op-" + uuid.uuid4().hex


@dataclass
class Env:
    store: S3Store
    events: NatsEventLog
    bucket: str
    clock: ManualClock
    ledger: Ledger
    client: TestClient  # type: ignore[type-arg]
    app: web.Application
    unique: Callable[[str], str]

    def host(self, label: str = "h") -> str:
        return f"{self.unique(label)}.example.com"  # dots on purpose

    async def post(self, path: str, body: Any = None, token: str | None = OPERATOR,
                   raw: bytes | None = None) -> tuple[int, dict[str, Any]]:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        data = raw if raw is not None else (msgspec.json.encode(body) if body is not None else b"")
        resp = await self.client.post(path, data=data, headers=headers)
        return resp.status, await resp.json()

    async def get(self, path: str, token: str | None = OPERATOR) -> tuple[int, dict[str, Any]]:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        resp = await self.client.get(path, headers=headers)
        return resp.status, await resp.json()

    async def create(self, box: str = "ie-1", label: str = "h") -> str:
        host = self.host(label)
        status, body = await self.post(f"/v1/hosts/{host}/create", {"box": box})
        assert status == 201, body
        return host

    async def written(self, host: str) -> tuple[int, int, int, int]:
        """Claim gen, record gen and the last stream sequence of each: what a refusal must not move."""
        claim = (await self.ledger.read_claim(host)).state
        record = (await self.ledger.read_record(host)).state
        seqs = []
        for obj in ("claim", "record"):
            last = await self.events.last(LEDGER_STREAM, ledger_subject(obj, host))
            seqs.append(last.seq if last else 0)
        return (claim.gen if claim else 0, record.gen if record else 0, *seqs)  # type: ignore[return-value]

    async def last_event(self, obj: str, host: str) -> Transition:
        last = await self.events.last(LEDGER_STREAM, ledger_subject(obj, host))
        assert last is not None
        return decode(last.data, Transition)

    async def set_move(self, host: str, **changes: Any) -> None:
        """Stand in for the source box: move the record's journal along (through the ledger)."""
        def step(cur: Record | None) -> Record:
            assert cur is not None and cur.move is not None
            return msgspec.structs.replace(cur, move=msgspec.structs.replace(cur.move, **changes))

        assert isinstance(await self.ledger.transition("record", host, "test-source-step", step), Committed)


def make_ledger(store: S3Store, events: NatsEventLog, clock: ManualClock, bucket: str,
                faults: Callable[[str], None] | None = None) -> Ledger:
    return Ledger(store, events, clock, Actor(service="door", pid=1, nonce=uuid.uuid4().hex[:8]), bucket,
                  faults=faults)


@pytest_asyncio.fixture(loop_scope="session", scope="module")
async def env(stack: StackInfo, unique: Callable[[str], str],
              tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Env]:
    store = await S3Store.open(stack.s3_endpoint, stack.s3_access_key, stack.s3_secret_key, stack.s3_region)
    events = await NatsEventLog.connect(stack.nats_url)
    bucket = unique("door")
    await store.create_bucket(bucket)
    clock = ManualClock()
    root = tmp_path_factory.mktemp("door-boxes")
    actor = Actor(service="box-init", pid=1, nonce="n")
    for label, region in (("ie-1", "ie"), ("uk-1", "uk"), ("us-1", "us"), ("us-2", "us")):
        await init_box(root=root, label=label, region=region, store=store, bucket=bucket, events=events,
                       clock=clock, actor=actor)
    old = RosterBox(label="old-1", region="old", moves_protocol=0, secrets_key_fp="sha256:" + "0" * 64,
                    registered_at=clock.now_ms())  # a pre-moves binary publishes protocol 0
    await update_roster(store, bucket, lambda cur: decide_register(cur, old))
    ledger = make_ledger(store, events, clock, bucket)
    tokens = TokenSet.of(operators={"alice": OPERATOR}, status={"probe": READER})
    door = Door(ledger, clock=clock, rng=SystemRandom())
    app = make_app(door, tokens)
    client = TestClient(TestServer(app))
    await client.start_server()
    yield Env(store, events, bucket, clock, ledger, client, app, unique)
    await client.close()
    for key in await store.list_keys(bucket):
        for v in await store.list_versions(bucket, key):
            await store.delete(bucket, key, version_id=v.version_id)
    await store.delete_bucket(bucket)
    await events.close()
    await store.close()


# -- the happy path -------------------------------------------------------------------------------


async def test_create_then_move_names_the_target_and_publishes_both_events(env: Env) -> None:
    host = await env.create("ie-1")
    claim = (await env.ledger.read_claim(host)).state
    assert claim is not None and claim.op.kind == "serving" and claim.op.exec == "ie-1"
    assert claim.holder is not None and len(claim.holder.incarnation) == 64

    status, body = await env.post(f"/v1/hosts/{host}/move", {"to": "uk", "cut": "auto"})
    assert status == 201, body
    assert body["message"] == f"Moving {host} from ie to uk." and body["copy"] == "M-C1"
    assert body["started"] is True and body["record_written"] is True

    claim = (await env.ledger.read_claim(host)).state
    record = (await env.ledger.read_record(host)).state
    assert claim is not None and record is not None and record.move is not None
    op = claim.op
    assert op.kind == "moving" and op.id.startswith("mv_") and len(op.id) == 29
    assert op.exec == "ie-1" and op.participants == ("ie-1", "uk-1")
    assert op.intent["target"] == "uk-1" and op.intent["to"] == "uk" and op.intent["cut"] == "auto"
    move = record.move
    assert (move.id, move.state, move.from_, move.to, move.cut) == (op.id, "preparing", "ie", "uk", "auto")
    assert move.incarnation == claim.holder.incarnation  # type: ignore[union-attr]
    assert move.requested_by == "alice" and move.requested_at == env.clock.now_ms()
    assert body["move"]["id"] == op.id and body["claim"]["participants"] == ["ie-1", "uk-1"]

    claim_event = await env.last_event("claim", host)
    record_event = await env.last_event("record", host)
    assert claim_event.meta.name == "move-request" and claim_event.claim == claim
    assert record_event.meta.name == "move-requested" and record_event.record == record
    assert claim_event.meta.causation == "door: operator alice"

    status, view = await env.get(f"/v1/hosts/{host}/move")
    assert status == 200 and view["copy"] == "M-C2" and view["move"]["state"] == "preparing"
    assert view["claim"]["kind"] == "moving" and view["claim"]["exec"] == "ie-1" and "detail" not in view
    status, full = await env.get(f"/v1/hosts/{host}/move?detail=1")
    assert status == 200 and full["detail"]["op"]["participants"] == ["ie-1", "uk-1"]
    assert full["detail"]["move"]["inputs"]["bundle_etags"] == {}


async def test_the_same_request_again_answers_the_existing_move(env: Env) -> None:
    host = await env.create()
    status, first = await env.post(f"/v1/hosts/{host}/move", {"to": "uk"})
    assert status == 201 and first["move"]["cut"] == "manual", "the API default is a manual cut (M6)"
    before = await env.written(host)
    status, again = await env.post(f"/v1/hosts/{host}/move", {"to": "uk"})
    assert status == 200, again
    assert again["started"] is False and again["record_written"] is False
    assert again["move"]["id"] == first["move"]["id"]
    assert await env.written(host) == before
    status, other = await env.post(f"/v1/hosts/{host}/move", {"to": "uk", "cut": "auto"})
    assert status == 409 and other["copy"] == "M-R26" and first["move"]["id"] in other["reason"]
    assert await env.written(host) == before


async def test_a_crash_between_the_claim_and_the_record_is_finished_by_the_retry(env: Env) -> None:
    host = await env.create()

    def die_after_the_claim(point: str) -> None:
        if point == "after_publish":
            raise Crash("the door died after the claim CAS")

    crashing = Door(make_ledger(env.store, env.events, env.clock, env.bucket, faults=die_after_the_claim),
                    clock=env.clock, rng=SystemRandom())
    with pytest.raises(Crash):
        await crashing.request_move(host, MoveRequest("uk", "manual"), Identity("alice", "operator"))
    claim = (await env.ledger.read_claim(host)).state
    assert claim is not None and claim.op.kind == "moving"
    assert (await env.ledger.read_record(host)).state is None, "the crash came before the record"
    env.clock.advance(1_000)

    status, body = await env.post(f"/v1/hosts/{host}/move", {"to": "uk", "cut": "manual"})
    assert status == 200, body
    assert body["started"] is False and body["record_written"] is True and body["copy"] == "M-C2"
    record = (await env.ledger.read_record(host)).state
    assert record is not None and record.move is not None and record.move.id == claim.op.id
    assert record.move.requested_at == claim.op.intent["requested_at"], "the request's time, from the claim"
    after = await env.ledger.read_claim(host)
    assert after.state == claim, "the retry wrote no second claim transition"
    status, body = await env.post(f"/v1/hosts/{host}/move", {"to": "uk", "cut": "manual"})
    assert status == 200 and body["record_written"] is False


async def test_concurrent_requests_start_one_move(env: Env) -> None:
    host = await env.create()
    path = f"/v1/hosts/{host}/move"
    same = list(await asyncio.gather(*(env.post(path, {"to": "uk"}) for _ in range(4))))
    # Under contention SeaweedFS can fail a conditional PUT outright; the door then answers 503 (outcome
    # unknown, try again: C6) and the operator's retry must land on the same move.
    for i, (status, body) in enumerate(same):
        if status == 503:
            assert body["copy"] in ("M-R18", "M-R30", "M-R37"), body
            same[i] = await env.post(path, {"to": "uk"})
    assert sorted(s for s, _ in same) == [200, 200, 200, 201], same
    assert len({b["move"]["id"] for _, b in same}) == 1
    history = [decode(m.data, Transition)
               async for m in env.events.replay(LEDGER_STREAM, subject=ledger_subject("claim", host))]
    assert [e.claim.op.kind for e in history if e.claim] == ["creating", "serving", "moving"]
    rival = await env.create()
    mixed = await asyncio.gather(env.post(f"/v1/hosts/{rival}/move", {"to": "uk"}),
                                 env.post(f"/v1/hosts/{rival}/move", {"to": "uk", "cut": "auto"}))
    assert sorted(s for s, _ in mixed) == [201, 409] and {b["copy"] for _, b in mixed} == {"M-C1", "M-R26"}


# -- refusals write nothing -----------------------------------------------------------------------


async def assert_refused(env: Env, host: str, path: str, body: Any, status: int, copy: str,
                         raw: bytes | None = None) -> dict[str, Any]:
    before = await env.written(host)
    got_status, got = await env.post(path, body, raw=raw)
    assert (got_status, got["copy"]) == (status, copy), got
    assert got["error"] in ("bad_request", "refused", "not_found", "unavailable") and got["reason"]
    assert await env.written(host) == before, f"{copy} wrote something"
    return got


async def test_every_door_refusal_writes_nothing(env: Env) -> None:
    host = await env.create("ie-1")
    move = f"/v1/hosts/{host}/move"
    await assert_refused(env, host, move, {"to": "ie"}, 400, "M-R9")
    got = await assert_refused(env, host, move, {"to": "mars"}, 400, "M-R10")
    assert "ie, old, uk, us" in got["reason"]
    await assert_refused(env, host, move, {"to": "us"}, 409, "M-C21")
    await assert_refused(env, host, move, {"to": "old"}, 409, "M-R12")
    await assert_refused(env, host, move, None, 400, "M-R4", raw=b'{"to": ')
    await assert_refused(env, host, move, {"to": "uk", "force": True}, 400, "M-R5")
    await assert_refused(env, host, move, {"to": "uk", "cut": "later"}, 400, "M-R7")
    await assert_refused(env, host, move, {}, 400, "M-R6")
    await assert_refused(env, host, f"{move}?dry=1", {"to": "uk"}, 400, "M-R29")
    before = await env.written(host)
    big = await env.post(move, raw=b" " * (70 * 1024))
    assert big[0] == 413 and big[1]["copy"] == "M-R33" and await env.written(host) == before
    bad = await env.post(f"/v1/hosts/{host.upper()}/move", {"to": "uk"})
    assert bad[0] == 400 and bad[1]["copy"] == "M-R3"
    assert (await env.ledger.read_claim(host.upper())).state is None

    out_of_two = await env.create("us-1")
    await assert_refused(env, out_of_two, f"/v1/hosts/{out_of_two}/move", {"to": "uk"}, 409, "M-C21")

    status, _ = await env.post(move, {"to": "uk"})
    assert status == 201
    await assert_refused(env, host, move, {"to": "us"}, 409, "M-R26")

    missing = env.host("missing")
    await assert_refused(env, missing, f"/v1/hosts/{missing}/move", {"to": "uk"}, 404, "M-R2")


async def test_a_claim_that_is_not_serving_is_refused(env: Env) -> None:
    host = env.host("creating")
    from services.hosts.create import decide_begin_create

    begin = await env.ledger.transition("claim", host, "create-begin", lambda cur: decide_begin_create(
        cur, host=host, incarnation="c" * 64, box="ie-1", region="ie"))
    assert isinstance(begin, Committed)
    got = await assert_refused(env, host, f"/v1/hosts/{host}/move", {"to": "uk"}, 409, "M-R8")
    assert "creating" in got["reason"]


async def test_the_protocol_floor_object_is_honoured(env: Env) -> None:
    host = await env.create()
    move = f"/v1/hosts/{host}/move"
    try:
        await env.store.put(env.bucket, FLOOR_KEY, b'{"min": 2, "min_release": "v9.0.0"}')
        await assert_refused(env, host, move, {"to": "uk"}, 409, "M-R13")
        await env.store.put(env.bucket, FLOOR_KEY, b'{"min": "two"}')
        got = await assert_refused(env, host, move, {"to": "uk"}, 503, "M-R30")
        assert FLOOR_KEY in got["reason"] and "two" not in got["reason"]
        await env.store.put(env.bucket, FLOOR_KEY, b'{"min": 1, "min_release": "v1.0.0"}')
        status, body = await env.post(move, {"to": "uk"})
        assert status == 201, body
    finally:
        await env.store.delete(env.bucket, FLOOR_KEY)


# -- auth (§12, M18) ------------------------------------------------------------------------------


async def test_without_an_operator_token_every_route_is_the_same_404(
    env: Env, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    host = await env.create()
    missing = env.host("missing")
    bodies: set[bytes] = set()
    for token_header in (None, f"Bearer {WRONG}", f"Basic {OPERATOR}", f"Bearer {READER}", "Bearer "):
        headers = {"Authorization": token_header} if token_header else {}
        for name in (host, missing):
            before = await env.written(name)
            for path in (f"/v1/hosts/{name}/move", f"/v1/hosts/{name}/move/cut", f"/v1/hosts/{name}/move/abort",
                         f"/v1/hosts/{name}/create"):
                resp = await env.client.post(path, data=b'{"to": "uk"}', headers=headers)
                assert resp.status == 404, (path, token_header)
                bodies.add(await resp.read())
            assert await env.written(name) == before
        if token_header != f"Bearer {READER}":
            for name in (host, missing):
                resp = await env.client.get(f"/v1/hosts/{name}/move", headers=headers)
                assert resp.status == 404
                bodies.add(await resp.read())
    unknown = await env.client.get("/v1/nothing-here")
    bodies.add(await unknown.read())
    wrong_method = await env.client.get(f"/v1/hosts/{host}/move/cut")
    assert wrong_method.status == 405 and wrong_method.headers["Allow"] == "POST"
    assert (await wrong_method.json())["copy"] == "M-R32"
    assert len(bodies) == 1, bodies
    assert msgspec.json.decode(bodies.pop()) == {"error": "not_found", "reason": "Not found.", "copy": "M-R1"}

    status, view = await env.get(f"/v1/hosts/{host}/move", token=READER)
    assert status == 200 and view["claim"]["kind"] == "serving", "a status token reads the status (M18)"
    status, body = await env.get(f"/v1/hosts/{missing}/move")
    assert status == 404 and body["copy"] == "M-R2", "an operator learns the host does not exist"
    status, body = await env.post(f"/v1/hosts/{host}/move", {"to": "uk"})
    assert status == 201
    for secret in (OPERATOR, WRONG, READER):
        assert secret not in caplog.text and secret not in str(body)
    assert "alice" in caplog.text, "the operator's label is logged, never the token"


# -- cut and abort --------------------------------------------------------------------------------


async def test_manual_cut_request_and_abort_while_requested(env: Env) -> None:
    host = await env.create()
    status, started = await env.post(f"/v1/hosts/{host}/move", {"to": "uk", "cut": "manual"})
    assert status == 201
    cut, abort = f"/v1/hosts/{host}/move/cut", f"/v1/hosts/{host}/move/abort"
    got = await assert_refused(env, host, cut, None, 409, "M-R20")
    assert "preparing" in got["reason"]
    await env.set_move(host, state="ready")
    status, view = await env.get(f"/v1/hosts/{host}/move")
    assert view["copy"] == "M-C12" and f"hostmove move cut --host {host}" in view["message"]
    claim_before = (await env.ledger.read_claim(host)).state

    status, body = await env.post(cut, None)
    assert status == 200 and body["changed"] is True and body["copy"] == "M-S1"
    record = (await env.ledger.read_record(host)).state
    assert record is not None and record.move is not None
    assert (record.move.state, record.move.cut_phase) == ("cutting", "requested")
    assert (await env.last_event("record", host)).meta.name == "move-cut-requested"
    before = await env.written(host)
    status, body = await env.post(cut, {})
    assert status == 200 and body["changed"] is False and await env.written(host) == before

    status, body = await env.post(abort, None)
    assert status == 200 and body["changed"] is True and body["copy"] == "M-S2"
    record = (await env.ledger.read_record(host)).state
    assert record is not None and record.move is not None
    assert record.move.state == "aborted" and record.move.reason == "aborted by operator alice"
    assert record.move.id == started["move"]["id"]
    assert (await env.ledger.read_claim(host)).state == claim_before, "the abort decision is the record's"
    await assert_refused(env, host, cut, None, 409, "M-R22")
    before = await env.written(host)
    status, body = await env.post(abort, None)
    assert status == 200 and body["changed"] is False and await env.written(host) == before


async def test_abort_is_refused_once_the_cut_is_admitted(env: Env) -> None:
    host = await env.create()
    assert (await env.post(f"/v1/hosts/{host}/move", {"to": "uk", "cut": "auto"}))[0] == 201
    await assert_refused(env, host, f"/v1/hosts/{host}/move/cut", None, 409, "M-R21")  # an auto move, preparing
    await env.set_move(host, state="ready")
    await assert_refused(env, host, f"/v1/hosts/{host}/move/cut", None, 409, "M-R21")
    await env.set_move(host, state="cutting", cut_phase="admitted")
    got = await assert_refused(env, host, f"/v1/hosts/{host}/move/abort", None, 409, "M-C13")
    assert got["reason"] == "This move has started its cut. It will finish or move back on its own."
    await assert_refused(env, host, f"/v1/hosts/{host}/move/abort", {"now": 1}, 400, "M-R5")


async def test_abort_while_preparing_and_cut_or_abort_without_a_move(env: Env) -> None:
    host = await env.create()
    await assert_refused(env, host, f"/v1/hosts/{host}/move/abort", None, 409, "M-R19")
    await assert_refused(env, host, f"/v1/hosts/{host}/move/cut", None, 409, "M-R19")
    missing = env.host("missing")
    await assert_refused(env, missing, f"/v1/hosts/{missing}/move/abort", None, 404, "M-R2")
    assert (await env.post(f"/v1/hosts/{host}/move", {"to": "uk"}))[0] == 201
    status, body = await env.post(f"/v1/hosts/{host}/move/abort", None)
    assert status == 200 and body["move"]["state"] == "aborted"


# -- create, names, documents ---------------------------------------------------------------------


async def test_create_refusals_and_percent_encoded_dotted_names(env: Env) -> None:
    host = env.host("enc")
    encoded = host.replace(".", "%2E")
    status, body = await env.post(f"/v1/hosts/{encoded}/create", {"box": "uk-1"})
    assert status == 201 and body["region"] == "uk" and body["claim"]["exec"] == "uk-1"
    status, view = await env.get(f"/v1/hosts/{host}/move")
    assert status == 200 and view["host"] == host and view["copy"] == "M-S6"
    await assert_refused(env, host, f"/v1/hosts/{host}/create", {"box": "uk-1"}, 409, "M-R24")
    other = env.host("nobox")
    await assert_refused(env, other, f"/v1/hosts/{other}/create", {"box": "xx-9"}, 409, "M-R23")
    gone = RosterBox(label="ie-9", region="ie", moves_protocol=1, secrets_key_fp="sha256:" + "9" * 64,
                     registered_at=env.clock.now_ms())  # enrolled, then fenced: it counts nowhere from then on
    await update_roster(env.store, env.bucket, lambda cur: decide_register(cur, gone))
    await update_roster(env.store, env.bucket, lambda cur: decide_fence_roster(cur, "ie-9", env.clock.now_ms()))
    got = await assert_refused(env, other, f"/v1/hosts/{other}/create", {"box": "ie-9"}, 409, "M-R35")
    assert "fenced" in got["reason"] and "live box of ie" in got["reason"]
    await assert_refused(env, other, f"/v1/hosts/{other}/create", {}, 400, "M-R6")
    slash = await env.post("/v1/hosts/a%2Fb/create", {"box": "uk-1"})
    assert slash[0] == 400 and slash[1]["copy"] == "M-R3"


async def test_a_create_interrupted_after_its_intent_is_finished_by_the_retry(env: Env) -> None:
    host = env.host("half")
    from services.hosts.create import decide_begin_create

    inc = "d" * 64
    await env.ledger.transition("claim", host, "create-begin", lambda cur: decide_begin_create(
        cur, host=host, incarnation=inc, box="ie-1", region="ie"))
    status, body = await env.post(f"/v1/hosts/{host}/create", {"box": "ie-1"})
    assert status == 201 and body["incarnation"] == inc, "the intent's incarnation, not a second one"


async def test_the_openapi_document_matches_the_router(env: Env) -> None:
    resp = await env.client.get("/openapi.json")
    assert resp.status == 200
    doc = await resp.json()
    assert doc == msgspec.json.decode(msgspec.json.encode(document()))
    routed = {(r.method, r.resource.canonical) for r in env.app.router.routes()
              if r.method != "HEAD" and r.resource is not None}
    documented = {(m.upper(), p) for p, ops in doc["paths"].items() for m in ops}
    assert routed == documented == {(m, p) for m, p, _ in ROUTES}
    schemas = doc["components"]["schemas"]
    refs = {v.split("/")[-1] for v in _walk(doc) if isinstance(v, str) and v.startswith("#/components/schemas/")}
    assert refs <= set(schemas)
    status, health = await env.get("/healthz", token=None)
    assert status == 200 and health == {"ok": True, "service": "door", "moves_protocol": 1}


def _walk(node: Any) -> list[Any]:
    if isinstance(node, dict):
        return [x for v in node.values() for x in _walk(v)]
    if isinstance(node, list):
        return [x for v in node for x in _walk(v)]
    return [node]


async def test_serve_door_listens_on_a_real_port(env: Env, stack: StackInfo, tmp_path: Path) -> None:
    rt = Runtime(settings_from_stack(stack, root=tmp_path, bucket=env.bucket), env.store, env.events, env.ledger,
                 env.clock, SystemRandom(), Actor(service="door", pid=1, nonce="n"))
    door = Door(rt.ledger, clock=rt.clock, rng=rt.rng)
    runner = await serve_door(door, 0, tokens=TokenSet.of(operators={"alice": OPERATOR}))
    try:
        port = runner.addresses[0][1]
        async with ClientSession() as session:
            async with session.get(f"http://127.0.0.1:{port}/healthz") as resp:
                assert resp.status == 200 and (await resp.json())["ok"] is True
            async with session.get(f"http://127.0.0.1:{port}/v1/hosts/x/move") as resp:
                assert resp.status == 404
    finally:
        await runner.cleanup()
