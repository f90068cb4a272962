"""The operator's console (issue 20 items 1 to 3): the §13 move log, the read CLI in both outputs against the
OpenAPI schemas, ``move status -o json``'s ``next_steps``, and the dashboard's static views.

The real-stack test runs two moves of one host (ie -> uk with a manual cut, then back) between two agent processes,
with the door and the projections service in this process over real HTTP: the history grows by one per move."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import jsonschema_rs
import pytest
import pytest_asyncio
from aiohttp import web
from aiohttp.test_utils import TestServer

from bus.facts import Fact, publish_alert
from bus.nats_log import NatsEventLog
from events import Actor
from events.envelope import EventMeta
from events.ids import new_incarnation
from events.record import Move, Record
from hostmove import move_cli, read_cli
from hostmove.cli import build_parser
from hostmove.stackinfo import StackInfo
from kernel.ports import SystemRandom, WallClock
from projections.api import make_app as projection_app
from projections.console import Access, Console
from projections.openapi import document
from projections.runner import Projector
from projections.store import ProjectionStore
from services.agent.service import read_endpoint
from services.door.api import Door
from services.door.api import make_app as door_app
from services.door.auth import Identity, TokenSet
from services.door.decide import MoveRequest
from services.hosts.create import create_host
from services.ledger import Committed, Ledger
from services.ledger.movelog import MoveLog, entry_for, read_move, summary_for
from services.objstore.s3 import S3Store
from tests.helpers.agents import AgentWorld, agent_world, answers_ready, data_buckets, eventually

OPERATOR, STATUS = "op-token-console", "status-token-console"
APP = {"MOVEPROBE_INTERVAL_S": "0.2"}


# -- pure ------------------------------------------------------------------------------------------


def _view(state: str, **move: Any) -> dict[str, Any]:
    return {"move": {"id": "m1", "state": state, **move}, "claim": {}}


@pytest.mark.parametrize(("view", "commands"), [
    (_view("preparing"), ["hostmove move abort --host h.example"]),
    (_view("ready", cut="manual"), ["hostmove move cut --host h.example", "hostmove move abort --host h.example"]),
    (_view("ready", cut="auto"), ["hostmove move abort --host h.example"]),
    (_view("cutting", cut_phase="requested"), ["hostmove move abort --host h.example"]),
    (_view("cutting", cut_phase="stopped"), []),
    (_view("landing"), []),
    (_view("stuck"), ["hostmove move resolve --host h.example --retry"]),
    (_view("rolling_back", rollback={"release_deadline": 1000}), ["hostmove move resolve --host h.example "
                                                                   "--declare-lost"]),
    (_view("rolling_back", rollback={"release_deadline": 9000}), []),
    ({"move": None, "last_move": {"id": "m1", "outcome": "done"}}, []),
])
def test_next_steps_name_the_command_for_each_state(view: dict[str, Any], commands: list[str]) -> None:
    assert [s["command"] for s in read_cli.next_steps(view, "h.example", now_ms=5000)] == commands


def test_next_steps_quote_a_host_a_shell_would_split() -> None:
    steps = read_cli.next_steps(_view("preparing"), "a b", now_ms=0)
    assert steps[0]["command"] == "hostmove move abort --host 'a b'"


def _meta(name: str, at: int) -> EventMeta:
    return EventMeta(name=name, actor=Actor(service="box", pid=1, nonce="n", box="uk-1"), at=at)


def test_a_log_entry_per_transition_and_a_summary_at_the_close() -> None:
    move = Move(id="m1", incarnation="i" * 64, to="uk", state="landing", from_="ie", requested_at=1000, ready_at=3000,
                cut_at=4000, cut_deadline=64000, cut_budget_s=60.0, flipped_at=5000, landing_deadline=35000)
    landing = Record(host="h", gen=7, move=move)
    entry = entry_for(landing, _meta("flip", 5000))
    assert entry is not None and (entry.gen, entry.state, entry.actor.box) == (7, "landing", "uk-1")
    by = {t.name: t for t in entry.timings}
    assert by["prepare"].elapsed_ms == 2000 and not by["prepare"].running
    assert by["cut"].elapsed_ms == 1000 and by["cut"].budget_s == 60.0
    assert by["offline"].running and by["offline"].elapsed_ms == 1000
    assert len(entry.digests["record_sha256"]) == 64
    opened = Record(host="h", gen=8, move=msgspec_replace(move, state="committed", opened_at=9000))
    from events.record import LastMove

    closed = Record(host="h", gen=9, move=None, last_move=LastMove(id="m1", outcome="done", at=20000))
    assert entry_for(closed, _meta("close", 20000)) is None
    summary = summary_for(opened, closed, _meta("close", 20000))
    assert summary is not None and summary.outcome == "done"
    off = {t.name: t for t in summary.timings}["offline"]
    assert off.elapsed_ms == 5000 and not off.running and not off.over
    assert summary_for(landing, opened, _meta("open", 9000)) is None  # not a close


def msgspec_replace(move: Move, **changes: Any) -> Move:
    import msgspec

    return msgspec.structs.replace(move, **changes)


def test_access_refuses_in_words_and_opens_only_when_told() -> None:
    closed = Access.from_env({})
    assert closed.identify(None, None) is None and "HOSTMOVE_DASHBOARD_OPEN=1" in closed.refusal()
    from services.door.auth import token_digest

    tokens = Access.from_env({"HOSTMOVE_STATUS_TOKENS": f"viewer={token_digest(STATUS)}"})
    assert tokens.identify(f"Bearer {STATUS}", None) is not None and tokens.identify(None, STATUS) is not None
    assert tokens.identify("Bearer wrong", "wrong") is None
    assert Access.from_env({"HOSTMOVE_DASHBOARD_OPEN": "1"}).identify(None, None) is not None
    from services.door.auth import TokenConfigError

    with pytest.raises(TokenConfigError, match="cannot be read"):
        Access.from_env({"HOSTMOVE_STATUS_TOKENS_FILE": "/nonexistent/tokens"})


# -- the real stack ----------------------------------------------------------------------------------


@pytest_asyncio.fixture(loop_scope="session", scope="module")
async def shared(stack: StackInfo, unique: Callable[[str], str]) -> AsyncIterator[tuple[S3Store, NatsEventLog, str]]:
    async with data_buckets(stack, unique, "con") as s:
        yield s


_DOC = document()


def assert_schema(body: Any, name: str) -> None:
    """``body`` is valid against the OpenAPI schema ``name`` of the projections' document."""
    validator = jsonschema_rs.validator_for({"$ref": f"#/components/schemas/{name}",
                                             "components": _DOC["components"]})
    errors = [f"{e.instance_path}: {e.message}" for e in validator.iter_errors(body)]
    assert not errors, f"{name}: {errors[:5]}"


async def cli(capsys: pytest.CaptureFixture[str], env: dict[str, str], *argv: str) -> tuple[int, str]:
    """Run ``hostmove argv`` (a read verb, or a move verb through the door) in this process; (exit code, stdout, and
    stderr after it when the code is not 0)."""
    args = build_parser().parse_args(list(argv))
    capsys.readouterr()
    if getattr(args, "read", None) is not None:
        code = await read_cli.run(args, environ=env)
    else:
        code = await move_cli.run(args, environ=env)
    got = capsys.readouterr()
    return code, got.out if code == 0 else got.out + got.err


async def served(w: AgentWorld, host: str, region: str) -> int:
    async def check() -> int | None:
        port = read_endpoint(w.box_dir(region), host)
        return port if port is not None and await asyncio.to_thread(answers_ready, port) else None

    return await eventually(check, f"{host} served in {region}", 60)


async def closed(w: AgentWorld, host: str, move_id: str) -> None:
    async def done() -> bool:
        record = (await w.ledger.read_record(host)).state
        return record is not None and record.last_move is not None and record.last_move.id == move_id
    await eventually(done, f"the move {move_id} to close", 90)


@pytest.mark.asyncio(loop_scope="session")
async def test_two_moves_are_logged_and_every_read_verb_answers_in_both_outputs(
        stack: StackInfo, unique: Callable[[str], str], shared: tuple[S3Store, NatsEventLog, str], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    store, events, prefix = shared
    async with agent_world(stack, unique, tmp_path, prefix, store=store, events=events, app_env=APP) as w:
        clock = WallClock()
        console_ledger = Ledger(store, events, clock, Actor(service="door", pid=os.getpid(), nonce="con"), w.deploy,
                                movelog=MoveLog(store, w.deploy))
        door = Door(console_ledger, clock=clock, rng=SystemRandom())
        proj = ProjectionStore.open(tmp_path / "proj", rng=SystemRandom(), clock=clock)
        projector = Projector(proj, events, clock=clock, poll_interval=0.1)
        access = Access(TokenSet.of(status={"viewer": STATUS}))
        papp = projection_app(proj, clock=clock, projector=projector, poll_interval=0.1,
                              console=Console(store, w.deploy, events, access))
        dapp: web.Application = door_app(door, TokenSet.of(operators={"alice": OPERATOR}, status={}))
        async with TestServer(papp) as psrv, TestServer(dapp) as dsrv:
            env = {"HOSTMOVE_PROJECTIONS_URL": str(psrv.make_url("")).rstrip("/"), "HOSTMOVE_TOKEN": STATUS}
            door_env = {"HOSTMOVE_DOOR_URL": str(dsrv.make_url("")).rstrip("/"), "HOSTMOVE_TOKEN": OPERATOR}
            host = f"{unique('con')}.example.com"
            created = await create_host(console_ledger, host, box=w.labels["ie"], region="ie",
                                        incarnation=new_incarnation(SystemRandom()))
            assert isinstance(created, Committed), created
            await served(w, host, "ie")

            # without a token the console says why, in words (exit 2: configuration)
            code, said = await cli(capsys, {**env, "HOSTMOVE_TOKEN": ""}, "box", "list")
            assert code == 2 and "a status or operator token is required" in said, said

            # move 1: ie -> uk, cut by hand; next_steps at preparing and at ready
            code, out = await cli(capsys, door_env, "move", "--host", host, "--to", "uk", "--manual-cut", "--no-wait")
            assert code == 0, out
            code, out = await cli(capsys, door_env, "move", "status", "--host", host, "-o", "json")
            status = json.loads(out)
            first = status["move"]["id"]
            assert status["move"]["state"] in ("preparing", "ready")
            assert f"hostmove move abort --host {host}" in [s["command"] for s in status["next_steps"]]

            async def ready() -> dict[str, Any] | None:
                _, out = await cli(capsys, door_env, "move", "status", "--host", host, "-o", "json")
                body = json.loads(out)
                return body if (body.get("move") or {}).get("state") == "ready" else None

            status = await eventually(ready, "the manual move to be ready", 60, every_s=0.3)
            assert [s["command"] for s in status["next_steps"]] == [f"hostmove move cut --host {host}",
                                                                      f"hostmove move abort --host {host}"]
            code, out = await cli(capsys, door_env, "move", "status", "--host", host)
            assert code == 0 and f"next: hostmove move cut --host {host} (" in out, out
            async def listed_ready() -> dict[str, Any] | None:
                code, out = await cli(capsys, env, "move", "list", "--live", "-o", "json")
                assert code == 0, out
                rows = [m for m in json.loads(out)["moves"] if m["host"] == host and m["state"] == "ready"]
                return {"body": json.loads(out), "row": rows[0]} if rows else None

            listed = await eventually(listed_ready, "the projection to show the move ready", 30, every_s=0.2)
            assert_schema(listed["body"], "Moves")
            row = listed["row"]
            assert row["live"] and row["move_id"] == first
            assert {t["name"] for t in row["timings"]} == {"prepare", "cut", "land", "offline"}
            code, out = await cli(capsys, door_env, "move", "cut", "--host", host)
            assert code == 0, out
            await closed(w, host, first)
            code, out = await cli(capsys, door_env, "move", "status", "--host", host, "-o", "json")
            assert json.loads(out)["next_steps"] == []

            # move 2: uk -> ie, automatic
            answer = await door.request_move(host, MoveRequest("ie", "auto"), Identity("op", "operator"))
            second = str(answer.body["move"]["id"])
            await closed(w, host, second)
            await served(w, host, "ie")

            # an alert on hm.alert.* (what a service publishes when the operator must look)
            alert_id = unique("alert")
            await publish_alert(events, Fact(kind="test-console", subject=host, id=alert_id,
                                             actor=Actor(service="test", pid=1, nonce="t"), at=clock.now_ms(),
                                             payload={"sentence": f"{host} needs a look."}))

            async def projected() -> bool:
                v = proj.host(host)
                return v is not None and v.move_id == "" and v.exec == w.labels["ie"]
            await eventually(projected, "the projection to show the second move closed", 30)

            # every read verb, in both outputs; JSON against the OpenAPI schema
            verbs: list[tuple[list[str], str]] = [
                (["host", "list"], "Snapshot"), (["host", "show", "--host", host], "Host"),
                (["box", "list"], "Boxes"), (["box", "show", "--box", w.labels["ie"]], "Box"),
                (["move", "list"], "Moves"), (["move", "list", "--live"], "Moves"),
                (["move", "history", "--host", host], "History"), (["move", "show", first], "MoveLog"),
                (["move", "show", second, "--host", host], "MoveLog"), (["alerts"], "Alerts")]
            bodies: dict[str, Any] = {}
            for argv, schema in verbs:
                code, out = await cli(capsys, env, *argv, "-o", "json")
                assert code == 0, (argv, out)
                body = json.loads(out)
                assert_schema(body, schema)
                bodies.setdefault(" ".join(argv[:2]) + (" live" if "--live" in argv else ""), body)
                code, table = await cli(capsys, env, "-o", "table", *argv)
                assert code == 0 and table.strip(), argv
                if argv[0] != "alerts":
                    assert table.splitlines()[0].isupper() or table.startswith("move "), table
            history = bodies["move history"]["moves"]
            assert [m["move_id"] for m in history] == [first, second]  # the history grows by one per move
            assert [(m["from"], m["to"], m["outcome"]) for m in history] == [("ie", "uk", "done"),
                                                                             ("uk", "ie", "done")]
            for m in history:
                t = {x["name"]: x for x in m["timings"]}
                assert t["cut"]["elapsed_ms"] is not None and t["offline"]["elapsed_ms"] is not None
                assert not t["offline"]["running"]
            log = bodies["move show"]
            states = [e["state"] for e in log["entries"]]
            assert states[0] == "preparing" and "ready" in states and "cutting" in states and "landing" in states
            assert log["summary"]["outcome"] == "done" and log["summary"]["from"] == "ie"
            writers = {(e["actor"]["service"], e["actor"]["box"]) for e in log["entries"]}
            assert ("door", "") in writers and any(box == w.labels["ie"] for _, box in writers), writers
            assert any(box == w.labels["uk"] for _, box in writers), writers  # the target logs its own transitions
            assert all(len(e["digests"]["record_sha256"]) == 64 for e in log["entries"])
            claims = log["claim_entries"]
            assert claims[0]["kind"] == "moving" and claims[0]["exec"] == w.labels["ie"], claims[0]
            assert any(c["kind"] == "landing" and c["exec"] == w.labels["uk"] for c in claims), claims
            assert claims[-1]["kind"] == "serving" and claims[-1]["exec"] == w.labels["uk"], claims[-1]
            gens = [e["gen"] for e in log["entries"]]
            assert gens == sorted(set(gens))
            boxes = {b["label"]: b for b in bodies["box list"]["boxes"]}
            assert boxes[w.labels["ie"]]["running"] == [host] and boxes[w.labels["uk"]]["running"] == []
            assert all(b["eligible"] and not b["fenced"] for b in boxes.values())
            hosts = {h["host"]: h for h in bodies["host list"]["hosts"]}
            assert hosts[host]["record"]["last_move"]["id"] == second
            assert any(m["host"] == host and m["move_id"] == second and m["outcome"] == "done"
                       for m in bodies["move list"]["moves"])
            assert not any(m["host"] == host for m in bodies["move list live"]["moves"])
            mine = [a for a in bodies["alerts"]["alerts"] if a["id"] == alert_id]
            assert len(mine) == 1 and mine[0]["sentence"] == f"{host} needs a look." and not mine[0]["incident"]

            # the dashboard's static views (no script needed), behind the token
            import aiohttp

            async with aiohttp.ClientSession() as http:
                base = env["HOSTMOVE_PROJECTIONS_URL"]
                async with http.get(base + "/") as resp:
                    assert resp.status == 401 and "token" in await resp.text()
                headers = {"Authorization": f"Bearer {STATUS}"}
                async with http.get(base + "/", headers=headers) as resp:
                    page = await resp.text()
                assert resp.status == 200 and f'data-host="{host}"' in page and w.labels["uk"] in page
                assert "test-console" in page
                async with http.get(base + "/hosts/" + host, headers=headers) as resp:
                    page = await resp.text()
                assert resp.status == 200 and first in page and second in page and 'data-timing="offline"' in page
                async with http.post(base + "/login", data={"token": STATUS}, allow_redirects=False) as resp:
                    assert resp.status == 303 and "hm_token" in resp.cookies
        proj.close()


def test_the_cli_registers_one_naming_and_completion() -> None:
    p = build_parser()
    assert p.parse_args(["-o", "json", "host", "list"]).output == "json"
    assert p.parse_args(["host", "list", "-o", "json"]).output == "json"
    assert p.parse_args(["host", "list"]).output == "table"
    assert p.parse_args(["move", "status", "--host", "h", "-o", "json"]).output == "json"
    assert p.parse_args(["box", "show", "--box", "ie-1"]).box == "ie-1"
    with pytest.raises(SystemExit):
        p.parse_args(["--version"])
    ns = p.parse_args(["completion", "bash"])  # the parsed command carries the whole parser it completes
    import io

    buf = io.StringIO()
    assert read_cli.completion(ns, buf) == 0 and "hostmove" in buf.getvalue() and "history" in buf.getvalue()


def test_the_document_describes_every_console_route(tmp_path: Path) -> None:
    from bus.memory_log import MemoryEventLog
    from projections.console_openapi import PATHS
    from services.objstore.memory import MemoryStore

    store = ProjectionStore.open(tmp_path, rng=SystemRandom(), clock=WallClock())
    app = projection_app(store, console=Console(MemoryStore(), "b", MemoryEventLog()))
    routes = {r.resource.canonical.replace("{host:.+}", "{host}") for r in app.router.routes()
              if r.method == "GET" and r.resource is not None and r.resource.canonical.startswith("/v1/")}
    assert routes == {p for p in document()["paths"] if p.startswith("/v1/")}
    assert set(PATHS) <= routes
    store.close()


async def test_the_writer_logs_each_transition_once_and_a_relay_logs_a_dead_writers() -> None:
    """The ledger logs a record transition after its CAS (create-only: a retry writes nothing twice); a writer that
    dies between its CAS and its log leaves the entry to the relay, which writes it under the writer's own actor."""
    from bus.memory_log import MemoryEventLog
    from kernel.ports import ManualClock
    from services.ledger import Crash
    from services.ledger.movelog import entry_key, index_key, read_history
    from services.objstore.memory import MemoryStore

    store, events, clock, bucket = MemoryStore(), MemoryEventLog(), ManualClock(), "deploy"
    await store.create_bucket(bucket)
    log = MoveLog(store, bucket)
    move = Move(id="m1", incarnation="i" * 64, to="uk", state="preparing", from_="ie", requested_at=0)

    def crash_after_cas(point: str) -> None:
        if point == "after_cas:record:prepared":
            raise Crash(point)

    writer = Ledger(store, events, clock, Actor(service="box", pid=1, nonce="a", box="ie-1"), bucket,
                    faults=crash_after_cas, movelog=log)
    out = await writer.transition("record", "h", "request", lambda cur: Record(host="h", gen=1, move=move))
    assert isinstance(out, Committed)
    with pytest.raises(Crash):
        await writer.transition("record", "h", "prepared",
                                lambda cur: Record(host="h", gen=1, move=msgspec_replace(move, state="ready")))
    assert [r["move_id"] for r in await read_history(store, bucket, "h")] == ["m1"]
    assert (await store.get(bucket, entry_key("h", "m1", 2))).__class__.__name__ == "Missing"
    relay = Ledger(store, events, clock, Actor(service="relay", pid=2, nonce="b"), bucket, movelog=log)
    await relay.relay("record", "h")
    got = await read_move(store, bucket, "m1")
    assert got is not None and [(e["gen"], e["state"], e["actor"]["box"]) for e in got["entries"]] == [
        (1, "preparing", "ie-1"), (2, "ready", "ie-1")]
    assert (await store.get(bucket, index_key("m1"))).__class__.__name__ == "Got"
    await log.note(None, Record(host="h", gen=2, move=msgspec_replace(move, state="cutting")), _meta("x", 9))
    again = await read_move(store, bucket, "m1")
    assert again is not None and again["entries"][1]["state"] == "ready"  # create-only: never rewritten


@pytest.mark.asyncio(loop_scope="session")
async def test_alerts_follow_prints_each_new_alert_once(stack: StackInfo, unique: Callable[[str], str],
                                                       tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from services.objstore.memory import MemoryStore

    monkeypatch.setattr(read_cli, "FOLLOW_EVERY_S", 0.1)
    events = await NatsEventLog.connect(stack.nats_url)
    proj = ProjectionStore.open(tmp_path, rng=SystemRandom(), clock=WallClock())
    app = projection_app(proj, console=Console(MemoryStore(), "b", events, Access(open=True)))
    kind = unique("follow")
    actor = Actor(service="test", pid=1, nonce="t")
    try:
        async with TestServer(app) as server:
            env = {"HOSTMOVE_PROJECTIONS_URL": str(server.make_url("")).rstrip("/")}
            await publish_alert(events, Fact(kind=kind, subject="h1", id="one", actor=actor, at=1000,
                                             payload={"sentence": "the first one."}))
            capsys.readouterr()
            task = asyncio.ensure_future(read_cli.run(build_parser().parse_args(["alerts", "--follow"]), environ=env))

            async def printed(text: str) -> str | None:
                await asyncio.sleep(0)
                return seen if text in (seen := seen_out()) else None

            out: list[str] = []

            def seen_out() -> str:
                out.append(capsys.readouterr().out)
                return "".join(out)

            await eventually(lambda: printed("the first one."), "the first alert printed", 15)
            await publish_alert(events, Fact(kind=kind, subject="h2", id="two", actor=actor, at=2000,
                                             payload={"sentence": "the second one."}))
            text = await eventually(lambda: printed("the second one."), "the second alert printed", 15)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert text.count("the first one.") == 1 and text.count("the second one.") == 1
            assert f"alert {kind} on h2: the second one." in text
    finally:
        await events.close()
        proj.close()


def test_a_rolled_back_moves_summary_counts_offline_to_the_sources_reopen() -> None:
    from events.record import LastMove, Rollback

    rb = Rollback(id="rb1", requested_at=7000, reason="the probe failed", opened_at=12000)
    move = Move(id="m2", incarnation="i" * 64, to="uk", state="rolled_back", from_="ie", requested_at=1000,
                cut_at=4000, cut_deadline=64000, cut_budget_s=6.0, flipped_at=5000, landing_deadline=35000,
                rollback=rb)
    summary = summary_for(Record(host="h", gen=4, move=move),
                          Record(host="h", gen=5, last_move=LastMove(id="m2", outcome="rolled_back", at=13000)),
                          _meta("close", 13000))
    assert summary is not None and summary.rolled_back and summary.reason == "the probe failed"
    by = {t.name: t for t in summary.timings}
    assert by["land"].elapsed_ms == 2000  # the flip to the rollback's request
    assert by["offline"].elapsed_ms == 8000 and by["offline"].over  # the cut to the source's reopen, past 6 s
