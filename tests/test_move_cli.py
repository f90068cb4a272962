"""``hostmove move`` against a real door: SeaweedFS, NATS JetStream, real boxes in the roster, and the
door's aiohttp app on a real loopback port. The CLI's ``run(args)`` is called in-process.

Where a box would move the record along, the test stands in for it through the ledger, one step per
status read the CLI makes, so every step is seen exactly once. Every refusal is checked to write
nothing, and no output or log ever holds the token.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import pytest
import pytest_asyncio
from aiohttp import web
from aiohttp.test_utils import TestServer

from bus.nats_log import NatsEventLog
from bus.subjects import LEDGER_STREAM, ledger_subject
from events import Actor, Record
from events.copy import say
from events.record import LastMove, Rollback
from hostmove import exitcodes, move_cli
from hostmove.stackinfo import StackInfo
from kernel.ports import ManualClock, SystemRandom, WallClock
from services.box.roster import init_box
from services.door.api import Door, make_app
from services.door.auth import Identity, TokenSet
from services.hosts.create import decide_begin_create
from services.ledger.ledger import Committed, Ledger
from services.objstore.s3 import S3Store
from tests.helpers.stores import regions
from tests.test_move_e2e import Stack, assert_moved, rig

OPERATOR = "op-" + uuid.uuid4().hex
READER = "rd-" + uuid.uuid4().hex
WRONG = "op-" + uuid.uuid4().hex
SECRETS = (OPERATOR, READER, WRONG)


@dataclass
class Env:
    ledger: Ledger
    events: NatsEventLog
    clock: ManualClock
    url: str
    reads: asyncio.Queue[tuple[str, int]]
    unique: Callable[[str], str]

    def host(self, label: str = "h") -> str:
        return f"{self.unique(label)}.example.com"

    async def create(self, box: str = "ie-1") -> str:
        host = self.host()
        door = Door(self.ledger, clock=self.clock, rng=SystemRandom())
        answer = await door.create(host, box, Identity("alice", "operator"))
        assert answer.status == 201, answer.body
        return host

    async def cli(self, argv: list[str], token: str | None = OPERATOR, clock: Any = None) -> tuple[int, str]:
        return await cli(self.url, argv, token, clock or self.clock)

    async def written(self, host: str) -> tuple[int, ...]:
        """Claim gen, record gen and the last stream sequence of each: what a refusal must not move."""
        claim = (await self.ledger.read_claim(host)).state
        record = (await self.ledger.read_record(host)).state
        seqs = []
        for obj in ("claim", "record"):
            last = await self.events.last(LEDGER_STREAM, ledger_subject(obj, host))
            seqs.append(last.seq if last else 0)
        return (claim.gen if claim else 0, record.gen if record else 0, *seqs)

    async def step(self, host: str, **changes: Any) -> int:
        """Stand in for a box: move the record's journal along through the ledger."""
        def decide(cur: Record | None) -> Record:
            assert cur is not None and cur.move is not None
            return msgspec.structs.replace(cur, move=msgspec.structs.replace(cur.move, **changes))

        out = await self.ledger.transition("record", host, "test-box-step", decide)
        assert isinstance(out, Committed)
        return out.state.gen

    async def close(self, host: str, outcome: str) -> int:
        """Stand in for the close (§7.9 step 5): clear ``move`` into ``last_move``."""
        def decide(cur: Record | None) -> Record:
            assert cur is not None and cur.move is not None
            last = LastMove(id=cur.move.id, outcome=outcome, at=self.clock.now_ms())  # type: ignore[arg-type]
            return msgspec.structs.replace(cur, move=None, last_move=last)

        out = await self.ledger.transition("record", host, "test-close", decide)
        assert isinstance(out, Committed)
        return out.state.gen

    def drain(self) -> None:
        while not self.reads.empty():
            self.reads.get_nowait()


async def cli(url: str, argv: list[str], token: str | None, clock: Any) -> tuple[int, str]:
    """Parse ``argv`` as ``hostmove`` would and run it; returns the exit code and stdout + stderr."""
    parser = argparse.ArgumentParser(prog="hostmove")
    move_cli.add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    environ = {move_cli.ENV_URL: url}
    if token is not None:
        environ[move_cli.ENV_TOKEN] = token
    return await run_captured(args, environ, clock)


async def run_captured(args: argparse.Namespace, environ: dict[str, str], clock: Any) -> tuple[int, str]:
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        code = await move_cli.run(args, clock=clock, environ=environ)
    text = buf.getvalue()
    for secret in SECRETS:
        assert secret not in text, "a token reached the output"
    return code, text


@pytest_asyncio.fixture(loop_scope="session", scope="module")
async def env(stack: StackInfo, unique: Callable[[str], str],
              tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Env]:
    store = await S3Store.open(stack.s3_endpoint, stack.s3_access_key, stack.s3_secret_key, stack.s3_region)
    events = await NatsEventLog.connect(stack.nats_url)
    bucket = unique("movecli")
    await store.create_bucket(bucket)
    clock = ManualClock()
    root = tmp_path_factory.mktemp("movecli-boxes")
    actor = Actor(service="box-init", pid=1, nonce="n")
    for label, region in (("ie-1", "ie"), ("uk-1", "uk")):
        await init_box(root=root, label=label, region=region, store=store, bucket=bucket, events=events,
                       clock=clock, actor=actor)
    ledger = Ledger(store, events, clock, Actor(service="door", pid=1, nonce=uuid.uuid4().hex[:8]), bucket)
    app = make_app(Door(ledger, clock=clock, rng=SystemRandom()),
                   TokenSet.of(operators={"alice": OPERATOR}, status={"probe": READER}))
    reads: asyncio.Queue[tuple[str, int]] = asyncio.Queue()

    async def count_reads(request: web.Request, response: web.StreamResponse) -> None:
        """Each status read the CLI makes, with the record gen it was shown."""
        if request.method == "GET" and request.path.endswith("/move") and isinstance(response, web.Response):
            body = response.body if isinstance(response.body, bytes) else b"{}"
            reads.put_nowait((request.match_info.get("host", ""), int(json.loads(body).get("record_gen", 0))))

    app.on_response_prepare.append(count_reads)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    yield Env(ledger, events, clock, f"http://127.0.0.1:{server.port}", reads, unique)
    await server.close()
    for key in await store.list_keys(bucket):
        for v in await store.list_versions(bucket, key):
            await store.delete(bucket, key, version_id=v.version_id)
    await store.delete_bucket(bucket)
    await events.close()
    await store.close()


@pytest.fixture(autouse=True)
def no_token_in_logs(caplog: pytest.LogCaptureFixture) -> Any:
    caplog.set_level(logging.DEBUG)
    yield
    for secret in SECRETS:
        assert secret not in caplog.text, "a token reached a log"


# -- requests ---------------------------------------------------------------------------------------


async def test_no_wait_request_is_accepted_and_prints_m_c1(env: Env) -> None:
    host = await env.create()
    code, text = await env.cli(["move", "--host", host, "--to", "uk", "--no-wait"])
    assert code == 0, text
    assert text.strip() == say("M-C1", host=host, from_region="ie", to_region="uk")
    record = (await env.ledger.read_record(host)).state
    claim = (await env.ledger.read_claim(host)).state
    assert record is not None and record.move is not None and claim is not None
    assert (record.move.state, record.move.cut, record.move.requested_by) == ("preparing", "auto", "alice")
    assert claim.op.kind == "moving" and claim.op.id == record.move.id

    code, text = await env.cli(["move", "--host", host, "--to", "uk", "--no-wait"])
    assert code == 0 and record.move.id in text and "already requested" in text
    assert (await env.ledger.read_record(host)).state == record, "the same request again changes nothing"


async def test_wait_on_a_move_that_does_not_progress_exits_4_at_the_deadline(env: Env) -> None:
    host = await env.create()
    started = asyncio.get_running_loop().time()
    code, text = await env.cli(["move", "--host", host, "--to", "uk", "--manual-cut", "--timeout", "1.2",
                                "--interval", "0.2"], clock=WallClock())
    took = asyncio.get_running_loop().time() - started
    assert code == move_cli.EXIT_WAITING, text
    assert took >= 1.0 and took < 10, took  # it waited for its --timeout, then gave up
    lines = text.splitlines()
    assert lines[:3] == [say("M-C1", host=host, from_region="ie", to_region="uk"), say("M-C2", host=host),
                         say("M-C3", to_region="uk", host=host)], "each step once, in order"
    assert "Still waiting after 1.2 s" in lines[-1] and "preparing" in lines[-1]
    record = (await env.ledger.read_record(host)).state
    assert record is not None and record.move is not None and record.move.cut == "manual"


async def test_each_refusal_exits_5_with_the_doors_sentence_and_writes_nothing(env: Env) -> None:
    host = await env.create()
    cases = [
        ("ie", "M-R9", say("M-R9", host=host, region="ie")),
        ("mars", "M-R10", say("M-R10", region="'mars'", regions="ie, uk")),
    ]
    for to, _, sentence in cases:
        before = await env.written(host)
        code, text = await env.cli(["move", "--host", host, "--to", to])
        assert (code, text.strip()) == (move_cli.EXIT_REFUSED, sentence)
        assert await env.written(host) == before

    creating = env.host("creating")
    begun = await env.ledger.transition("claim", creating, "create-begin", lambda cur: decide_begin_create(
        cur, host=creating, incarnation="c" * 64, box="ie-1", region="ie"))
    assert isinstance(begun, Committed)
    before = await env.written(creating)
    code, text = await env.cli(["move", "--host", creating, "--to", "uk"])
    assert (code, text.strip()) == (move_cli.EXIT_REFUSED, say("M-R8", host=creating, kind="creating"))
    assert await env.written(creating) == before

    code, _ = await env.cli(["move", "--host", host, "--to", "uk", "--no-wait", "--manual-cut"])
    assert code == 0
    before = await env.written(host)
    code, text = await env.cli(["move", "--host", host, "--to", "uk"])  # auto: another request
    assert code == move_cli.EXIT_REFUSED and "is busy with move" in text
    assert await env.written(host) == before

    missing = env.host("missing")
    code, text = await env.cli(["move", "status", "--host", missing])
    assert (code, text.strip()) == (move_cli.EXIT_REFUSED, say("M-R2", host=missing))


async def test_a_missing_or_wrong_token_never_acts_and_is_never_echoed(env: Env) -> None:
    host = await env.create()
    before = await env.written(host)
    code, text = await env.cli(["move", "--host", host, "--to", "uk"], token=None)
    assert code == move_cli.EXIT_CONFIG and move_cli.ENV_TOKEN in text
    code, text = await env.cli(["move", "--host", host, "--to", "uk"], token=WRONG)
    assert code == move_cli.EXIT_REFUSED and "Not found" in text and move_cli.ENV_TOKEN in text
    code, text = await env.cli(["move", "--host", host, "--to", "uk"], token=READER)
    assert code == move_cli.EXIT_REFUSED and "status-only" in text
    code, text = await env.cli(["move", "--host", host, "--to", "uk"], token=f"{WRONG}\nX-Evil: 1")
    assert code == move_cli.EXIT_CONFIG and "control character" in text
    assert await env.written(host) == before
    code, text = await env.cli(["move", "status", "--host", host], token=READER)
    assert code == 0 and say("M-S6", host=host, box="ie-1") in text, "a status-only token reads the status"


async def test_an_unreachable_door_is_an_outage_and_a_wrong_url_a_configuration_problem(env: Env) -> None:
    args = argparse.Namespace(move_action="status", host="h.example.com", json=False)
    environ = {move_cli.ENV_URL: "http://127.0.0.1:9", move_cli.ENV_TOKEN: OPERATOR}
    code, text = await run_captured(args, environ, env.clock)
    assert code == move_cli.EXIT_UNAVAILABLE == exitcodes.UNAVAILABLE, text
    assert "could not reach the door at http://127.0.0.1:9 (" in text and "refused" not in text.split("(")[0]
    environ = {move_cli.ENV_URL: f"http://user:{WRONG}@127.0.0.1:9", move_cli.ENV_TOKEN: OPERATOR}
    code, text = await run_captured(args, environ, env.clock)
    assert code == move_cli.EXIT_CONFIG and "must not carry a user or password ('http://127.0.0.1:9')" in text
    code, text = await run_captured(args, {move_cli.ENV_URL: "ftp://x", move_cli.ENV_TOKEN: OPERATOR}, env.clock)
    assert code == move_cli.EXIT_CONFIG and move_cli.ENV_URL in text


# -- status, cut, abort -------------------------------------------------------------------------------


async def test_status_json_round_trips_and_status_shows_phase_reasons_and_timings(env: Env) -> None:
    host = await env.create()
    code, _ = await env.cli(["move", "--host", host, "--to", "uk", "--no-wait"])
    assert code == 0
    record = (await env.ledger.read_record(host)).state
    assert record is not None and record.move is not None and record.move.requested_at is not None
    t0 = record.move.requested_at
    await env.step(host, state="ready", ready_at=t0 + 42_000)
    await env.step(host, state="cutting", cut_phase="stopping", cut_at=t0 + 50_000, cut_budget_s=120.0,
                   cut_deadline=t0 + 50_000 + 115_000, reason="the archive is slow.")
    env.clock.advance(50_000 + 130_000 - (env.clock.now_ms() - t0))  # 130 s after the cut began

    code, text = await env.cli(["move", "status", "--host", host, "--json"])
    assert code == 0
    answered = json.loads(text)
    assert answered.pop("next_steps") == []  # a move cutting needs nobody (issue 20: hostmove.read_cli.next_steps)
    from aiohttp import ClientSession

    async with ClientSession() as s, s.get(f"{env.url}/v1/hosts/{host}/move?detail=1",
                                           headers={"Authorization": f"Bearer {OPERATOR}"}) as resp:
        assert answered == await resp.json()
    assert answered["detail"]["move"]["cut_phase"] == "stopping"

    code, text = await env.cli(["move", "status", "--host", host])
    assert code == 0
    lines = text.splitlines()
    assert lines[0] == say("M-C13")
    assert "phase: cutting, cut phase stopping, landing phase -" in lines
    assert "reason: the archive is slow." in lines
    timing = {ln.split()[0]: ln for ln in lines if ln.startswith("  ")}
    assert timing["prepare"].strip() == "prepare  42 s (budget 3600 s)"
    assert timing["cut"].strip() == "cut      130 s so far (budget 115 s, OVER BUDGET)"
    assert timing["land"].strip() == "land     not started (no budget yet)"
    assert timing["offline"].strip() == "offline  130 s so far (budget 120 s, OVER BUDGET)"


async def test_cut_on_a_manual_move_at_ready_and_abort_in_preparing(env: Env) -> None:
    host = await env.create()
    assert (await env.cli(["move", "--host", host, "--to", "uk", "--manual-cut", "--no-wait"]))[0] == 0
    before = await env.written(host)
    code, text = await env.cli(["move", "cut", "--host", host])
    assert code == move_cli.EXIT_REFUSED and "not ready to cut yet" in text
    assert await env.written(host) == before
    await env.step(host, state="ready")
    code, text = await env.cli(["move", "cut", "--host", host])
    assert (code, text.strip()) == (0, say("M-S1", host=host))
    move = (await env.ledger.read_record(host)).state.move  # type: ignore[union-attr]
    assert move is not None and (move.state, move.cut_phase) == ("cutting", "requested")
    code, text = await env.cli(["move", "cut", "--host", host])
    assert code == 0 and "(it already was)" in text

    other = await env.create()
    assert (await env.cli(["move", "--host", other, "--to", "uk", "--no-wait"]))[0] == 0
    code, text = await env.cli(["move", "abort", "--host", other])
    assert (code, text.strip()) == (0, say("M-S2", host=other, from_region="ie"))
    move = (await env.ledger.read_record(other)).state.move  # type: ignore[union-attr]
    assert move is not None and move.state == "aborted" and move.reason == "aborted by operator alice"
    code, text = await env.cli(["move", "cut", "--host", other])
    assert (code, text.strip()) == (move_cli.EXIT_REFUSED, say("M-R22"))


# -- --wait following a move to its outcome -------------------------------------------------------------


async def drive(env: Env, host: str, steps: list[Callable[[], Any]]) -> None:
    """Apply each step once the CLI has read the state the step before it left (its record gen), so the CLI
    sees every step exactly once, however fast it polls."""
    gen = 1
    for step in steps:
        while True:
            seen_host, seen_gen = await asyncio.wait_for(env.reads.get(), 10)
            if seen_host == host and seen_gen >= gen:
                break
        gen = await step()


async def test_wait_follows_a_move_to_done_printing_each_step_once(env: Env) -> None:
    host = await env.create()
    env.drain()
    t = env.clock.now_ms()
    steps = [
        lambda: env.step(host, reason=say("M-C4", to_region="uk", reason="the target is still restoring")),
        lambda: env.step(host, state="ready", reason="", ready_at=t + 1000),
        lambda: env.step(host, state="cutting", cut_phase="requested"),
        lambda: env.step(host, cut_phase="admitted", cut_at=t + 2000, cut_budget_s=12.0),
        lambda: env.step(host, state="landing", cut_phase="flipped", flipped_at=t + 4000),
        lambda: env.step(host, state="committed", committed_at=t + 6000, opened_at=t + 9000),
        lambda: env.close(host, "done"),
    ]
    driver = asyncio.create_task(drive(env, host, steps))
    code, text = await env.cli(["move", "--host", host, "--to", "uk", "--interval", "0.05", "--timeout", "30",
                                "--until", "closed"], clock=WallClock())
    await driver
    assert code == 0, text
    move_id = (await env.ledger.read_record(host)).state.last_move.id  # type: ignore[union-attr]
    assert text.splitlines() == [
        say("M-C1", host=host, from_region="ie", to_region="uk"),
        say("M-C2", host=host),
        say("M-C3", to_region="uk", host=host),
        say("M-C4", to_region="uk", reason="the target is still restoring"),
        say("M-S4", host=host),
        say("M-C5", host=host, estimate="12 seconds at most (its cut window)"),
        say("M-C6", from_region="ie", to_region="uk"),
        say("M-C7", host=host, to_region="uk", seconds="7"),
        say("M-S5", host=host, move_id=move_id, outcome="done"),
    ]


async def test_wait_exits_3_after_a_rollback_and_4_when_stuck(env: Env) -> None:
    host = await env.create()
    env.drain()
    t = env.clock.now_ms()
    rb = Rollback(id="rb_" + "a" * 26, requested_at=t + 5000, reason="the probe failed three times")
    steps = [
        lambda: env.step(host, state="cutting", cut_phase="admitted", cut_at=t + 1000, cut_budget_s=12.0),
        lambda: env.step(host, state="landing", cut_phase="flipped", flipped_at=t + 2000),
        lambda: env.step(host, state="rolling_back", rollback=rb, reason=rb.reason),
        lambda: env.step(host, state="restoring", rollback=msgspec.structs.replace(rb, opened_at=t + 20_000)),
        lambda: env.close(host, "rolled_back"),
    ]
    driver = asyncio.create_task(drive(env, host, steps))
    code, text = await env.cli(["move", "--host", host, "--to", "uk", "--interval", "0.05", "--until", "closed"],
                               clock=WallClock())
    await driver
    assert code == move_cli.EXIT_ROLLED_BACK, text
    lines = text.splitlines()
    sentence = say("M-C8", to_region="uk", host=host, reason="the probe failed three times", from_region="ie")
    assert sentence in lines and lines.count(sentence) == 1
    assert lines.index(sentence) < lines.index(say("M-C9", host=host, from_region="ie"))
    assert not any(ln == "the probe failed three times." for ln in lines), "the reason is in M-C8 once"

    stuck = await env.create()
    env.drain()
    driver = asyncio.create_task(drive(env, stuck, [lambda: env.step(stuck, state="stuck")]))
    code, text = await env.cli(["move", "--host", stuck, "--to", "uk", "--interval", "0.05"], clock=WallClock())
    await driver
    assert code == move_cli.EXIT_WAITING
    assert text.splitlines()[-1] == say("M-C11", host=stuck, to_region="uk", from_region="ie")


# -- the pure core ------------------------------------------------------------------------------------


def test_timings_of_a_rollback_end_at_the_sources_reopen() -> None:
    move = {"state": "restoring", "requested_at": 0, "ready_at": 10_000, "cut_at": 20_000, "cut_budget_s": 120.0,
            "cut_deadline": 135_000, "flipped_at": 30_000, "landing_deadline": 930_000,
            "rollback": {"requested_at": 40_000, "opened_at": 200_000}}
    got = {t.name: t for t in move_cli.timings(move, now_ms=10**9)}
    assert (got["prepare"].elapsed_ms, got["prepare"].running) == (10_000, False)
    assert (got["cut"].elapsed_ms, got["cut"].budget_s) == (10_000, 115.0)
    assert (got["land"].elapsed_ms, got["land"].budget_s) == (10_000, 900.0)
    assert (got["offline"].elapsed_ms, got["offline"].over) == (180_000, True)
    assert move_cli.offline_ms(move) == 180_000


def test_config_never_shows_the_token() -> None:
    config = move_cli.load_config({move_cli.ENV_TOKEN: OPERATOR})
    assert config.url == move_cli.DEFAULT_URL and OPERATOR not in repr(config)
    assert move_cli.redact_url("https://u:p@door.example:8443/x") == "https://door.example:8443/x"


def test_milestones_for_an_abort_a_late_release_and_a_relocation() -> None:
    watch = move_cli.Watch("h.example.com", "mv_1")
    aborted = {"move": {"id": "mv_1", "state": "aborted", "from": "ie", "to": "uk", "reason": ""},
               "message": say("M-S2", host="h.example.com", from_region="ie"), "copy": "M-S2", "last_move": None}
    assert move_cli.milestones(aborted, watch, 0) == [("state:aborted", aborted["message"])]
    assert move_cli.outcome(aborted, "mv_1") is None, "an abort is not over until the close"
    closed = {"move": None, "last_move": {"id": "mv_1", "outcome": "aborted", "at": 1}, "message": "", "copy": ""}
    assert move_cli.outcome(closed, "mv_1") == move_cli.EXIT_ROLLED_BACK
    assert move_cli.outcome(closed, "mv_2") is None, "another move's outcome is not this one's"

    late = {"move": {"id": "mv_1", "state": "rolling_back", "from": "ie", "to": "uk", "reason": "no start",
                     "rollback": {"id": "rb_1", "reason": "no start", "release_deadline": 1000}},
            "claim": {"kind": "restoring", "participants": ["ie-1", "uk-1"]}, "last_move": None}
    keys = dict(move_cli.milestones(late, watch, now_ms=999))
    assert "waiting-release" not in keys
    keys = dict(move_cli.milestones(late, watch, now_ms=1001))
    assert keys["waiting-release"] == say("M-C10", box="uk-1", region="uk", host="h.example.com")
    assert keys["rollback"] == say("M-C8", to_region="uk", host="h.example.com", reason="no start", from_region="ie")

    pinning = {"move": None, "claim": {"kind": "relocating"}, "copy": "M-C22", "message": "waiting for a box",
               "last_move": None}
    assert move_cli.milestones(pinning, watch, 0) == [("door:M-C22", "waiting for a box")]


# -- a real move, end to end ----------------------------------------------------------------------------


@pytest_asyncio.fixture(loop_scope="session", scope="module")
async def e2e(stack: StackInfo, unique: Callable[[str], str]) -> AsyncIterator[Stack]:
    """The deployment bucket and the two regions' data buckets of tests/test_move_e2e.py's rig."""
    async with regions(stack, unique, "cli") as s:
        yield s


async def test_the_cli_follows_a_real_move_of_a_running_instance_to_done(
    e2e: Stack, unique: Callable[[str], str], tmp_path: Path
) -> None:
    """A moveprobe instance serving on ie-1 with acknowledged writes: the CLI requests the move through a real
    door and follows it while the boxes' workers (tests/helpers/e2e.py) carry it to its close."""
    async with rig(e2e, unique, tmp_path) as r:
        server = TestServer(make_app(r.deployment.door, TokenSet.of(operators={"alice": OPERATOR})),
                            host="127.0.0.1")
        await server.start_server()
        try:
            async def boxes() -> Any:
                deadline = asyncio.get_running_loop().time() + 20
                while asyncio.get_running_loop().time() < deadline:
                    record = (await r.ledger.read_record(r.host)).state
                    if record is not None and record.move is not None:
                        return await r.run().drive(r.host, record.move.id)
                    await asyncio.sleep(0.05)
                raise AssertionError("the CLI's move request never reached the record")

            driver = asyncio.create_task(boxes())
            code, text = await cli(f"http://127.0.0.1:{server.port}",
                                   ["move", "--host", r.host, "--to", "uk", "--interval", "0.1", "--timeout", "45",
                                    "--until", "closed"], OPERATOR, WallClock())
            outcome = await driver
        finally:
            await server.close()
        assert code == 0, text
        await assert_moved(r, outcome)
        lines = text.splitlines()
        assert lines[0] == say("M-C1", host=r.host, from_region="ie", to_region="uk")
        assert lines[-1] == say("M-S5", host=r.host, move_id=outcome.move_id, outcome="done")
        assert say("M-C6", from_region="ie", to_region="uk") in lines
        assert say("M-S1", host=r.host) not in lines, "an auto cut is not the operator's request"
        assert len(lines) == len(set(lines)), "each step once"
        moved = [ln for ln in lines if ln.startswith("Moved. ")]
        if moved:  # printed when a status read fell between the open and the close
            seconds = float(moved[0].split("offline for ")[1].split(" seconds")[0])
            assert 0 < seconds < 45


# -- --wait returns once the host serves; watch follows a move someone else started ---------------------


def moved_steps(env: Env, host: str) -> list[Callable[[], Any]]:
    t = env.clock.now_ms()
    return [
        lambda: env.step(host, state="ready", ready_at=t + 1000),
        lambda: env.step(host, state="cutting", cut_phase="admitted", cut_at=t + 2000, cut_budget_s=12.0),
        lambda: env.step(host, state="landing", cut_phase="flipped", flipped_at=t + 4000),
        lambda: env.step(host, state="committed", committed_at=t + 6000),
        lambda: env.step(host, opened_at=t + 9000),
    ]


async def test_wait_returns_once_the_host_serves_on_the_target_and_says_the_move_goes_on_closing(env: Env) -> None:
    host = await env.create()
    env.drain()
    driver = asyncio.create_task(drive(env, host, moved_steps(env, host)))
    code, text = await env.cli(["move", "--host", host, "--to", "uk", "--interval", "0.05", "--timeout", "30"],
                               clock=WallClock())
    await driver
    assert code == exitcodes.OK, text
    record = (await env.ledger.read_record(host)).state
    assert record is not None and record.move is not None and record.last_move is None, "returned before the close"
    lines = text.splitlines()
    assert lines[-2] == say("M-C7", host=host, to_region="uk", seconds="7")
    assert lines[-1] == (f"The move {record.move.id} goes on closing in the background: ie parks what {host} left "
                         "there once the late-completion horizon has passed, then it closes. Follow it with: "
                         f"hostmove move watch --host {host} --until closed")
    assert not any(ln.startswith("The last move of") for ln in lines)

    env.drain()  # the close, followed by watch --until closed
    driver = asyncio.create_task(drive(env, host, [lambda: env.close(host, "done")]))
    code, text = await env.cli(["move", "watch", "--host", host, "--until", "closed", "--interval", "0.05"],
                               clock=WallClock())
    await driver
    assert code == exitcodes.OK, text
    assert text.splitlines()[-1] == say("M-S5", host=host, move_id=record.move.id, outcome="done")


async def test_wait_returns_3_once_the_source_serves_again_after_a_rollback(env: Env) -> None:
    host = await env.create()
    env.drain()
    t = env.clock.now_ms()
    rb = Rollback(id="rb_" + "b" * 26, requested_at=t + 5000, reason="the probe failed three times")
    steps = [
        lambda: env.step(host, state="cutting", cut_phase="admitted", cut_at=t + 1000, cut_budget_s=12.0),
        lambda: env.step(host, state="landing", cut_phase="flipped", flipped_at=t + 2000),
        lambda: env.step(host, state="rolling_back", rollback=rb, reason=rb.reason),
        lambda: env.step(host, state="restoring", rollback=msgspec.structs.replace(rb, opened_at=t + 20_000)),
    ]
    driver = asyncio.create_task(drive(env, host, steps))
    code, text = await env.cli(["move", "--host", host, "--to", "uk", "--interval", "0.05"], clock=WallClock())
    await driver
    assert code == exitcodes.ROLLED_BACK, text
    lines = text.splitlines()
    assert lines[-2] == say("M-C9", host=host, from_region="ie")
    assert lines[-1].startswith("The move ") and "uk parks what the move left there" in lines[-1]


async def test_wait_returns_3_at_an_abort_the_host_never_stopped_serving(env: Env) -> None:
    host = await env.create()
    env.drain()

    async def abort() -> int:
        code, _ = await env.cli(["move", "abort", "--host", host])
        assert code == 0
        return (await env.ledger.read_record(host)).state.gen  # type: ignore[union-attr]

    driver = asyncio.create_task(drive(env, host, [abort]))
    code, text = await env.cli(["move", "--host", host, "--to", "uk", "--interval", "0.05"], clock=WallClock())
    await driver
    assert code == exitcodes.ROLLED_BACK, text
    lines = text.splitlines()
    assert say("M-S2", host=host, from_region="ie") in lines
    assert "uk retires what the move staged there" in lines[-1]


@pytest.mark.parametrize("argv", [["move", "watch"], ["move", "status", "--watch"]])
async def test_watch_follows_a_move_another_command_started(env: Env, argv: list[str]) -> None:
    host = await env.create()
    code, _ = await env.cli(["move", "--host", host, "--to", "uk", "--no-wait"])
    assert code == 0
    move_id = (await env.ledger.read_record(host)).state.move.id  # type: ignore[union-attr]
    env.drain()
    driver = asyncio.create_task(drive(env, host, moved_steps(env, host)))
    code, text = await env.cli([*argv, "--host", host, "--interval", "0.05", "--timeout", "30"], clock=WallClock())
    await driver
    assert code == exitcodes.OK, text
    lines = text.splitlines()
    assert f"Following move {move_id} of {host} from ie to uk (requested by alice at " in text
    for sentence in (say("M-C2", host=host), say("M-S4", host=host), say("M-C6", from_region="ie", to_region="uk"),
                     say("M-C7", host=host, to_region="uk", seconds="7")):
        assert lines.count(sentence) == 1, (sentence, text)
    assert lines[-1].startswith(f"The move {move_id} goes on closing in the background")


async def test_watch_without_a_live_move_says_so_and_after_the_close_gives_the_outcome(env: Env) -> None:
    host = await env.create()
    code, text = await env.cli(["move", "watch", "--host", host])
    assert code == exitcodes.FAILED and say("M-R19", host=host) in text and "nothing to watch" in text
    code, _ = await env.cli(["move", "--host", host, "--to", "uk", "--no-wait"])
    assert code == 0
    move_id = (await env.ledger.read_record(host)).state.move.id  # type: ignore[union-attr]
    await env.close(host, "rolled_back")
    code, text = await env.cli(["move", "watch", "--host", host])
    assert (code, text.strip()) == (exitcodes.ROLLED_BACK, say("M-S5", host=host, move_id=move_id,
                                                               outcome="rolled back"))


def test_the_follow_options_mean_the_same_before_and_after_the_action() -> None:
    parser = argparse.ArgumentParser(prog="hostmove")
    move_cli.add_parser(parser.add_subparsers(dest="command", required=True))
    before = parser.parse_args(["move", "--timeout", "5", "--until", "closed", "watch", "--host", "h"])
    after = parser.parse_args(["move", "watch", "--host", "h", "--timeout", "5", "--until", "closed"])
    plain = parser.parse_args(["move", "watch", "--host", "h"])
    assert (before.timeout, before.until) == (after.timeout, after.until) == (5.0, "closed")
    assert (plain.timeout, plain.until, plain.interval) == (move_cli.DEFAULT_TIMEOUT_S, "serving", 1.0)
    assert parser.parse_args(["move", "--host", "h", "--to", "uk"]).until == "serving"


def test_serving_end_of_each_way_a_move_leaves_the_host_serving() -> None:
    def view(state: str, **move: Any) -> dict[str, Any]:
        return {"move": {"id": "mv_1", "state": state, **move}, "last_move": None}

    assert move_cli.serving_end(view("committed"), "mv_1") is None, "committed, not yet opened"
    assert move_cli.serving_end(view("committed", opened_at=5), "mv_1") == exitcodes.OK
    assert move_cli.serving_end(view("rolling_back", rollback={"id": "rb"}), "mv_1") is None
    assert move_cli.serving_end(view("restoring", rollback={"opened_at": 9}), "mv_1") == exitcodes.ROLLED_BACK
    assert move_cli.serving_end(view("aborted"), "mv_1") == exitcodes.ROLLED_BACK
    reverting = view("reverting") | {"detail": {"move": {"id": "mv_1", "state": "reverting", "from": "ie"},
                                                "op": {"journal": {"rev_phase": "probing"}}}}
    assert move_cli.serving_end(reverting, "mv_1") is None
    reverting["detail"]["op"]["journal"]["rev_phase"] = "opened"
    assert move_cli.serving_end(reverting, "mv_1") == exitcodes.ROLLED_BACK
    assert ("back", say("M-C9", host="h", from_region="ie")) in move_cli.milestones(
        reverting, move_cli.Watch("h", "mv_1"), 0)
    assert move_cli.serving_end(view("committed", opened_at=5), "mv_2") is None, "another move"
    assert move_cli.outcome(view("committed", opened_at=5), "mv_1") is None, "--until closed waits for the close"
    assert move_cli.outcome(view("committed", opened_at=5), "mv_1", "serving") == exitcodes.OK


# -- outages: their own exit code, never "refused" --------------------------------------------------------


@asynccontextmanager
async def answering(status: int, body: dict[str, Any]) -> AsyncIterator[str]:
    """A stand-in door that answers every route with ``status`` and ``body`` (the door's 503s and 500s)."""
    async def handler(request: web.Request) -> web.Response:
        return web.json_response(body, status=status)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    try:
        yield f"http://127.0.0.1:{server.port}"
    finally:
        await server.close()


async def test_a_door_answering_503_for_a_dependency_is_an_outage_never_a_refusal(env: Env) -> None:
    down = {"error": "unavailable", "copy": "M-R36", "dependency": "nats", "reason": "The event stream is down."}
    async with answering(503, down) as url:
        for argv in (["move", "--host", "h.example.com", "--to", "uk"], ["move", "status", "--host", "h.example.com"],
                     ["move", "watch", "--host", "h.example.com"], ["move", "cut", "--host", "h.example.com"]):
            code, text = await cli(url, argv, OPERATOR, env.clock)
            assert code == exitcodes.UNAVAILABLE, (argv, text)
            assert text.startswith("hostmove move: NATS (the event stream) is unavailable, so the door decided "
                                   "nothing: The event stream is down. (exit 6"), text
    s3 = {"error": "unavailable", "copy": "M-R37", "dependency": "s3", "reason": "S3 does not answer."}
    async with answering(503, s3) as url:
        code, text = await cli(url, ["move", "abort", "--host", "h.example.com"], OPERATOR, env.clock)
        assert code == exitcodes.UNAVAILABLE and "the object store (S3) is unavailable" in text, text
    unnamed = {"error": "unavailable", "copy": "M-R18", "reason": say("M-R18", what="The claim of h.example.com")}
    async with answering(503, unnamed) as url:
        code, text = await cli(url, ["move", "status", "--host", "h.example.com"], OPERATOR, env.clock)
        assert code == exitcodes.UNAVAILABLE and "a dependency of the door is unavailable" in text
    corrupt = {"error": "unavailable", "copy": "M-R30", "reason": say("M-R30", what="The claim of h.example.com")}
    async with answering(503, corrupt) as url:
        code, text = await cli(url, ["move", "status", "--host", "h.example.com"], OPERATOR, env.clock)
        assert (code, text.strip()) == (exitcodes.FAILED, corrupt["reason"]), "a corrupt object is no outage"
    async with answering(500, {"error": "internal", "copy": "M-R31", "reason": say("M-R31")}) as url:
        code, text = await cli(url, ["move", "abort", "--host", "h.example.com"], OPERATOR, env.clock)
        assert code == exitcodes.FAILED and text.strip() == say("M-R31")


async def test_a_door_that_goes_away_while_waiting_ends_as_an_outage_at_the_deadline(env: Env) -> None:
    host = await env.create()
    door = env.url
    reply_body: dict[str, Any] = {}

    class Gone(move_cli.DoorClient):
        async def status(self, host: str, timeout_s: float = 30.0) -> move_cli.Reply:
            raise move_cli.DoorUnreachable("could not reach the door at http://127.0.0.1:9 (Connection refused)")

    import aiohttp

    async with aiohttp.ClientSession() as session:
        real = move_cli.DoorClient(move_cli.DoorConfig(door, OPERATOR), session)
        accepted = await real.request_move(host, "uk", "auto")
        assert accepted.ok
        reply_body = accepted.body
        import contextlib
        import io

        buf = io.StringIO()
        with contextlib.redirect_stderr(buf):
            code = await move_cli.follow(Gone(real.config, session), host, str(reply_body["move"]["id"]), reply_body,
                                         WallClock(), timeout_s=0.3, interval_s=0.05, out=io.StringIO(), err=buf)
    assert code == exitcodes.UNAVAILABLE, buf.getvalue()
    lines = buf.getvalue().splitlines()
    assert lines[0].endswith("retrying until the deadline") and len(lines) == 2, "each trouble said once"
    assert lines[-1].startswith("The door could not tell where the move") and "preparing" in lines[-1]


def test_a_target_fenced_after_the_commit_is_said_while_the_move_closes() -> None:
    """§7.10: the committed move's target was fenced; the watch says so (M-S13) before the close, not silence."""
    watch = move_cli.Watch("h.example.com", "mv_1")
    view = {"move": {"id": "mv_1", "state": "committed", "from": "ie", "to": "uk", "reason": "",
                     "target_fenced": "control/box-fences/uk-1.json"},
            "claim": {"kind": "moving", "participants": ["ie-1", "uk-1"]}, "last_move": None}
    keys = dict(move_cli.milestones(view, watch, 0))
    assert keys["target-fenced"] == say("M-S13", box="uk-1", move_id="mv_1", host="h.example.com", region="uk")
    assert "moved" not in keys, "it never opened on the fenced box"
    plain = {**view, "move": {**view["move"], "target_fenced": ""}}
    assert "target-fenced" not in dict(move_cli.milestones(plain, watch, 0))
