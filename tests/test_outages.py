"""Services that survive the bus and the store (issue 11 item 3).

The long-running services (door, projections, relay, recovery, both box agents) run as processes on a stack of
this module's own, which the tests stop and start again on the same ports (``hostmove stack up`` restarts only the
dead component). A move is requested and preparing while the app writes; then NATS (or SeaweedFS) stops for longer
than the old reconnect budget (nats-py gave up after 3 reconnects 2 s apart, about 8 s). Required: every service's
``/readyz`` fails during the outage naming the dependency and passes after it, ``/livez`` passes throughout, no
process dies, a door write during the outage is a 503 naming the dependency; afterwards the move finishes, the
projections show every transition made after the outage (their position reaches the stream's end with no gap,
and the host's row holds the authority's last gens) and nothing acknowledged is lost (§14.4's checks and the
audit).

``HOSTMOVE_OUTAGE_S`` sets how long each outage lasts (default 15 s; ``make outages`` runs 60 s ones).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import pytest

from bus.log import LogUnavailable
from bus.memory_log import MemoryEventLog
from bus.nats_log import RECONNECT_WAIT_MAX_S, NatsEventLog, next_server, reconnect_delay
from bus.subjects import LEDGER_STREAM, ledger_subject
from events import Actor
from events.claim import Claim, Holder, Op
from events.copy import say
from hostmove.health import Health, health_address
from hostmove.probe_apps import post_write
from hostmove.procs import ServiceProc, service_env
from hostmove.stack import RunState, _pid_alive, _signal, stack_down, stack_up
from hostmove.stackinfo import StackInfo
from kernel.credentials import ENV_CREDENTIALS
from kernel.ports import SystemRandom, WallClock, free_port
from services.ledger import Committed, Ledger
from services.objstore.memory import MemoryStore
from services.objstore.port import StoreUnavailable
from services.recovery.recovery import RecoveryPass
from tests.helpers.agents import AgentWorld, agent_world, data_buckets, eventually
from tests.helpers.webcalls import get_json as get
from tests.test_agent import APP, assert_served_on_uk, create_and_write, moved, serving_port

OUTAGE_S = float(os.environ.get("HOSTMOVE_OUTAGE_S", "15"))
OLD_BUDGET_S = 8.0
"""What the old client lasted without a server: 3 reconnects, 2 s apart, then closed for good."""
TOKEN = "outage-operator-token"


# -- pure pieces ---------------------------------------------------------------------------------------------


def test_the_reconnect_backoff_doubles_up_to_its_cap() -> None:
    mid = [reconnect_delay(a, rng=lambda: 0.5) for a in range(8)]
    assert mid[:5] == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.6])
    assert mid[5:] == [RECONNECT_WAIT_MAX_S] * 3
    assert all(reconnect_delay(a, rng=lambda: 0.999) <= RECONNECT_WAIT_MAX_S for a in range(100))
    assert reconnect_delay(1000) <= RECONNECT_WAIT_MAX_S


def test_a_reconnect_tries_the_cluster_s_server_that_failed_least_never_the_dead_first_one_forever() -> None:
    """nats-py's reconnect hook answers a server: a cluster whose first URL died is left for the next."""
    from nats.aio.client import Server
    from nats.aio.client import urlparse as parse

    dead, b, c = (Server(parse(f"nats://127.0.0.1:{p}")) for p in (4001, 4002, 4003))
    dead.reconnects = 3
    chosen, delay = next_server([dead, b, c], rng=lambda: 0.5)
    assert chosen is b and delay == pytest.approx(0.1)
    b.reconnects = 4  # b failed too: c, then the one of the fewest failures, after its own backoff
    assert next_server([dead, b, c], rng=lambda: 0.5)[0] is c
    c.reconnects = 5
    chosen, delay = next_server([dead, b, c], rng=lambda: 0.5)
    assert chosen is dead and delay == pytest.approx(0.8)
    alone = Server(parse("nats://127.0.0.1:4222"))  # one server: it, after the backoff of its failures
    alone.reconnects = 2
    assert next_server([alone], rng=lambda: 0.5) == (alone, pytest.approx(0.4))


def test_the_health_address_comes_from_the_flag_or_the_environment() -> None:
    assert health_address(None, {}) == ("127.0.0.1", 0)
    assert health_address(None, {"HOSTMOVE_HEALTH_PORT": "9001", "HOSTMOVE_HEALTH_BIND": "0.0.0.0"}) == ("0.0.0.0",
                                                                                                        9001)
    assert health_address(9002, {"HOSTMOVE_HEALTH_PORT": "9001"}) == ("127.0.0.1", 9002)
    with pytest.raises(ValueError, match="HOSTMOVE_HEALTH_PORT"):
        health_address(None, {"HOSTMOVE_HEALTH_PORT": "http"})


async def test_readiness_names_each_dependency_and_liveness_the_process() -> None:
    now = [100.0]
    health = Health("relay", interval_s=1.0, timeout_s=0.2, clock=lambda: now[0])
    health.expect("nats", "s3", reason="connecting")
    ready, body = health.readiness()
    assert not ready and body["dependencies"]["nats"] == {"ok": False, "for_s": 0.0, "reason": "connecting"}
    up = {"s3": True}

    async def s3() -> dict[str, Any]:
        if not up["s3"]:
            raise LogUnavailable("S3 did not answer")
        return {}

    async def slow() -> None:
        await asyncio.sleep(5)

    health.check("s3", s3)
    health.set("nats", True, last_seq=7)
    await health.check_once()
    ready, body = health.readiness()
    assert ready and body["dependencies"]["nats"]["last_seq"] == 7, body
    up["s3"] = False
    now[0] += 3
    await health.check_once()
    ready, body = health.readiness()
    assert not ready and body["dependencies"]["s3"]["reason"] == "S3 did not answer", body
    assert body["reason"] == "s3: S3 did not answer"
    up["s3"] = True
    await health.check_once()
    assert health.readiness()[0]
    now[0] += 10  # a check that stopped answering is stale, not ok
    assert not health.readiness()[0] and "no answer to the check" in health.readiness()[1]["reason"]
    health.check("s3", slow)  # bounded by timeout_s
    await health.check_once()
    assert health.readiness()[1]["dependencies"]["s3"]["reason"] == "no answer in 0.2 s"
    assert health.liveness()[0]
    health.dead("the projector halted")
    assert health.liveness() == (False, {"service": "relay", "live": False, "uptime_s": 13.0,
                                         "reason": "the projector halted"})
    assert not health.readiness()[0]


async def test_the_health_server_answers_livez_and_readyz() -> None:
    health = Health("door")
    health.expect("nats")
    port = await health.start("127.0.0.1", 0)
    try:
        assert await asyncio.to_thread(get, port, "/livez") == (200, {"service": "door", "live": True,
                                                                      "uptime_s": pytest.approx(0.0, abs=1)})
        status, body = await asyncio.to_thread(get, port, "/readyz")
        assert status == 503 and body["dependencies"]["nats"]["reason"] == "not checked yet"
        health.set("nats", True)
        assert (await asyncio.to_thread(get, port, "/readyz"))[0] == 200
    finally:
        await health.stop()


class DownLog(MemoryEventLog):
    """The log twin with an outage switch: while ``down`` is set it reports itself down and every call raises
    :class:`LogUnavailable`, as :class:`NatsEventLog` does."""

    def __init__(self) -> None:
        super().__init__()
        self.down: str | None = None
        self.calls = 0

    def down_reason(self) -> str | None:
        return self.down

    def _gate(self) -> None:
        self.calls += 1
        if self.down:
            raise LogUnavailable(self.down)

    async def publish(self, *args: Any, **kwargs: Any) -> Any:
        self._gate()
        return await super().publish(*args, **kwargs)

    async def last(self, stream: str, subject: str) -> Any:
        self._gate()
        return await super().last(stream, subject)


def serving_claim(host: str) -> Claim:
    inc = "inc-" + hashlib.sha256(host.encode()).hexdigest()[:8]
    return Claim(host=host, gen=1, holder=Holder(incarnation=inc, location=f"instances/{host}/{inc}/"),
                 op=Op(kind="serving", exec="ie-1", participants=("ie-1",)))


def memory_ledger(events: DownLog, store: MemoryStore | None = None) -> Ledger:
    return Ledger(store or MemoryStore(), events, WallClock(), Actor(service="t", pid=1, nonce="n"), "deploy")


async def test_the_door_answers_an_outage_with_the_dependency_it_met() -> None:
    from aiohttp.test_utils import TestClient, TestServer

    from services.door.api import Door, make_app
    from services.door.auth import TokenSet, parse_entries, token_digest

    events, store = DownLog(), MemoryStore()
    await store.create_bucket("deploy")
    ledger = memory_ledger(events, store)
    door = Door(ledger, clock=WallClock(), rng=SystemRandom())
    tokens = TokenSet(parse_entries([f"ops={token_digest(TOKEN)}"], "operator", "test"))
    auth = {"Authorization": f"Bearer {TOKEN}"}
    async with TestClient(TestServer(make_app(door, tokens))) as client:
        events.down = "NATS at nats://x is not connected (reconnecting for 3 s)"
        resp = await client.post("/v1/hosts/a.example.com/create", json={"box": "ie-1"}, headers=auth)
        body = await resp.json()
        assert resp.status == 503 and resp.headers["Retry-After"] == "5", body
        assert body == {"error": "unavailable", "dependency": "nats", "copy": "M-R36", "reason": say("M-R36")}
        assert await store.list_keys("deploy") == [] and events.calls == 0, "refused before anything was touched"
        resp = await client.get("/v1/hosts/a.example.com/move", headers=auth)
        assert resp.status == 404, "a read goes on while only NATS is down"
        events.down = None
        store.faults.fail_next("get", "5xx", times=5)
        resp = await client.post("/v1/hosts/a.example.com/move", json={"to": "uk"}, headers=auth)
        body = await resp.json()
        assert resp.status == 503 and body["dependency"] == "s3" and body["copy"] == "M-R37", body
        read_first = ("the protocol floor (control/moves-protocol.json)", "the roster (control/roster.json)")
        assert body["reason"] in {say("M-R37", what=what) for what in read_first}, body  # the first read it met


async def test_a_relay_pass_stops_at_an_unreachable_nats_instead_of_failing_every_object() -> None:
    events = DownLog()
    ledger = memory_ledger(events)
    await ledger.store.create_bucket("deploy")
    for i in range(3):
        host = f"h{i}.example.com"
        assert isinstance(await ledger.transition("claim", host, "created", lambda _c, h=host: serving_claim(h)),
                          Committed)
    events.down = "NATS is not connected"
    events.calls = 0
    with pytest.raises(LogUnavailable):
        await ledger.relay_all()
    assert events.calls == 1, "one refusal stops the pass"
    events.down = None
    assert await ledger.relay_all() == []


async def test_a_recovery_pass_stops_at_an_outage_and_names_it() -> None:
    events = DownLog()
    store = MemoryStore()
    ledger = memory_ledger(events, store)
    await store.create_bucket("deploy")
    for i in range(4):
        host = f"h{i}.example.com"
        assert isinstance(await ledger.transition("claim", host, "created", lambda _c, h=host: serving_claim(h)),
                          Committed)
    recovery = RecoveryPass(ledger, events)
    assert (await recovery.run_once()).unavailable is None
    store.faults.fail_next("list_keys", "5xx")
    report = await recovery.run_once()
    assert report.unavailable is not None and report.unavailable[0] == "s3" and report.hosts == 0, report
    store.faults.fail_next("get", "5xx", key="control/records/h1.example.com.json", times=3)
    report = await recovery.run_once()  # one object failing is that host's error, not an outage
    assert report.unavailable is None and report.hosts == 4 and len(report.errors) == 1, report
    store.faults.fail_next("get", "5xx", times=20)
    report = await recovery.run_once()  # the four hosts are looked at at once (issue 19 item 3)
    assert report.unavailable is not None and report.unavailable[0] == "s3" and report.hosts == 4, report
    one_at_a_time = RecoveryPass(ledger, events, workers=1)
    report = await one_at_a_time.run_once()  # three failing in a row: no fourth host is started
    assert report.unavailable is not None and report.unavailable[0] == "s3" and report.hosts == 3, report
    store.faults.clear()
    assert (await recovery.run_once()).unavailable is None


# -- helpers (free_port and get: tests/helpers/webcalls.py) ---------------------------------------------------


def post(port: int, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any], dict[str, str]]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {TOKEN}"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read()), dict(resp.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read()), dict(exc.headers)


def run_state(root: Path) -> RunState:
    return msgspec.json.decode((root / "run.json").read_bytes(), type=RunState)


def stop_part(root: Path, name: str) -> int:
    """SIGTERM the stack's ``nats`` or ``weed`` and wait until it is gone; answers its pid."""
    state = run_state(root)
    pid = state.nats_pid if name == "nats" else state.weed_pid
    _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + 20
    while _pid_alive(pid):
        if time.monotonic() > deadline:
            _signal(pid, signal.SIGKILL)
        time.sleep(0.05)
    return pid


@pytest.fixture(scope="module")
def own(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, StackInfo]]:
    """A stack of this module's own: its tests stop and restart its parts."""
    root = tmp_path_factory.mktemp("outage-stack")
    info = stack_up(root)
    session = os.environ.get(ENV_CREDENTIALS)
    os.environ[ENV_CREDENTIALS] = info.credentials  # this module acts as its own stack's operator (issue 14)
    try:
        yield root, info
    finally:
        if session is None:
            os.environ.pop(ENV_CREDENTIALS, None)
        else:
            os.environ[ENV_CREDENTIALS] = session
        stack_down(root)


def restart(root: Path, before: StackInfo) -> StackInfo:
    """``hostmove stack up`` with one part dead: only it starts again, on the same ports."""
    ports = run_state(root).ports
    after = stack_up(root)
    assert run_state(root).ports == ports
    assert (after.nats_url, after.s3_endpoint) == (before.nats_url, before.s3_endpoint)
    return after


# -- the stack and the event log -----------------------------------------------------------------------------


def test_stack_up_restarts_only_the_dead_component_on_its_ports(own: tuple[Path, StackInfo]) -> None:
    root, info = own
    first = run_state(root)
    stop_part(root, "nats")
    again = restart(root, info)
    assert again.weed_pid == first.weed_pid and again.nats_pid != first.nats_pid
    stop_part(root, "weed")
    third = restart(root, info)
    assert third.nats_pid == again.nats_pid and third.weed_pid != first.weed_pid
    assert stack_up(root) == third, "a healthy stack is reused as it is"


async def test_the_event_log_refuses_at_once_while_down_and_reconnects_with_its_subscriptions(
        own: tuple[Path, StackInfo]) -> None:
    root, info = own
    events = await NatsEventLog.connect(info.nats_url)
    got: list[str] = []

    async def cb(msg: Any) -> None:
        got.append(msg.subject)

    try:
        await events.nc.subscribe("outage.>", cb=cb)
        await events.state(LEDGER_STREAM)
        stop_part(root, "nats")
        await eventually(lambda: asyncio.sleep(0, result=not events.connected), "the loss noticed", 5)
        started = time.monotonic()
        with pytest.raises(LogUnavailable, match="not connected"):
            await events.last(LEDGER_STREAM, ledger_subject("claim", "outage.example.com"))
        with pytest.raises(LogUnavailable):
            await events.publish(LEDGER_STREAM, ledger_subject("claim", "outage.example.com"), b"{}")
        assert time.monotonic() - started < 0.5, "an outage is refused at once, not after a timeout"
        await asyncio.sleep(OLD_BUDGET_S + 2)  # longer than the old client lasted
        await asyncio.to_thread(restart, root, info)
        await eventually(lambda: asyncio.sleep(0, result=events.connected), "the reconnect", 10)
        assert (await events.state(LEDGER_STREAM)).last_seq >= 0
        await events.nc.publish("outage.ping", b"")
        await eventually(lambda: asyncio.sleep(0, result=got == ["outage.ping"]), "the core subscription again", 5)
    finally:
        await events.close()


async def test_a_first_connect_waits_for_a_server_started_later(tmp_path: Path) -> None:
    port = free_port()
    tries: list[str] = []
    waiting = asyncio.ensure_future(NatsEventLog.connect(f"nats://127.0.0.1:{port}", wait=True,
                                                         on_retry=lambda _a, reason: tries.append(reason)))
    await asyncio.sleep(1.5)
    assert not waiting.done() and tries and "cannot reach NATS" in tries[0]
    from hostmove.stack import NATS_BIN

    server = await asyncio.create_subprocess_exec(str(NATS_BIN), "-js", "-sd", str(tmp_path / "nats"), "-a",
                                                  "127.0.0.1", "-p", str(port), stdout=asyncio.subprocess.DEVNULL,
                                                  stderr=asyncio.subprocess.DEVNULL)
    try:
        events = await asyncio.wait_for(waiting, 10)
        assert events.connected and (await events.state(LEDGER_STREAM)).messages == 0
        await events.close()
        with pytest.raises(LogUnavailable, match="cannot reach NATS"):
            await NatsEventLog.connect(f"nats://127.0.0.1:{free_port()}")  # a command does not wait
    finally:
        server.terminate()
        await server.wait()


# -- the services --------------------------------------------------------------------------------------------


@dataclass
class Services:
    """door, projections, relay and recovery as processes, and the health port of each (with the agents')."""

    procs: dict[str, ServiceProc]
    health: dict[str, int]
    door_port: int
    projections_port: int
    timeline: list[str] = field(default_factory=list)

    def all_alive(self) -> dict[str, bool]:
        return {name: p.alive() for name, p in self.procs.items()}

    async def answers(self, path: str) -> dict[str, tuple[int, dict[str, Any]]]:
        out = await asyncio.gather(*(asyncio.to_thread(get, port, path) for port in self.health.values()))
        return dict(zip(self.health, out, strict=True))

    async def ready(self) -> bool:
        return all(status == 200 for status, _ in (await self.answers("/readyz")).values())

    async def none_ready(self, dependency: str) -> bool:
        """No service is ready, each naming ``dependency`` as not ok (the projections need no S3)."""
        answers = await self.answers("/readyz")
        for name, (status, body) in answers.items():
            if dependency == "s3" and name == "projections":
                continue
            if status != 503 or body.get("dependencies", {}).get(dependency, {}).get("ok") is not False:
                return False
        return True


@asynccontextmanager
async def services(info: StackInfo, w: AgentWorld, agent_health: dict[str, int]) -> AsyncIterator[Services]:
    ports = {name: free_port() for name in ("door", "projections", "relay", "recovery")}
    door_port, projections_port = free_port(), free_port()
    env = service_env(info, root=w.root, bucket=w.deploy, extra={
        "HOSTMOVE_OPERATOR_TOKENS": "ops=" + hashlib.sha256(TOKEN.encode()).hexdigest()})
    procs = {
        "door": ServiceProc.serve("door", env, w.root / "door.log", "--port", str(door_port)),
        "projections": ServiceProc.serve("projections", env, w.root / "projections.log", "--port",
                                         str(projections_port)),
        "relay": ServiceProc.serve("relay", env, w.root / "relay.log"),
        "recovery": ServiceProc.serve("recovery", env, w.root / "recovery.log"),
    }
    for name, proc in procs.items():
        proc.start({"HOSTMOVE_HEALTH_PORT": str(ports[name])})
    svc = Services(procs, {**ports, **{f"box-{r}": p for r, p in agent_health.items()}}, door_port, projections_port)
    try:
        await eventually(svc.ready, "every service ready", 60)
        yield svc
    except BaseException:
        for proc in procs.values():
            proc.stop()
        raise
    rcs = {name: proc.stop() for name, proc in procs.items()}
    logs = "\n".join(f"== {n}\n{p.output()[-3000:]}" for n, p in procs.items())
    assert rcs == dict.fromkeys(procs, 0), (rcs, logs)


class Writer:
    """The app's writes during the move: one every 0.1 s to whichever box serves the host; each acknowledged
    write is in moveprobe's ack log (what §14.4's check reads)."""

    def __init__(self, w: AgentWorld, host: str) -> None:
        self.w, self.host = w, host
        self.acked: list[int] = []
        self.failed = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        from services.agent.service import read_endpoint

        i = 0
        while not self._stop.is_set():
            port = read_endpoint(self.w.box_dir("ie"), self.host) or read_endpoint(self.w.box_dir("uk"), self.host)
            if port is not None:
                try:
                    self.acked.append(post_write(port, f"during-{i}", timeout_s=2))
                except OSError:
                    self.failed += 1
            i += 1
            self._stop.wait(0.1)

    def __enter__(self) -> Writer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)


async def projection_shows_the_end(w: AgentWorld, svc: Services, host: str, events: NatsEventLog) -> dict[str, Any]:
    """The projection reached the stream's last sequence, with no gap, and shows the authority's last gens."""
    claim = (await w.ledger.read_claim(host)).state
    record = (await w.ledger.read_record(host)).state
    assert claim is not None and record is not None
    last = (await events.state(LEDGER_STREAM)).last_seq

    async def caught_up() -> dict[str, Any] | None:
        status, health = await asyncio.to_thread(get, svc.projections_port, "/healthz")
        status_h, row = await asyncio.to_thread(get, svc.projections_port, f"/v1/hosts/{host}")
        if status != 200 or status_h != 200 or health["position"] < last:
            return None
        return {"health": health, "row": row}

    seen = await eventually(caught_up, "the projection at the stream's end", 30)
    assert not {k: n for k, n in seen["health"]["errors"].items() if k in ("gap", "stream_gap", "decode")}, seen
    row = seen["row"]
    assert (row["claim_gen"], row["record_gen"]) == (claim.gen, record.gen), (row, claim.gen, record.gen)
    return seen


async def moved_despite_blips(w: AgentWorld, host: str, move_id: str, timeout_s: float = 120.0) -> None:
    """:func:`moved`, the test's own reads retrying a 500 SeaweedFS may still answer in its first seconds back."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return await moved(w, host, move_id, timeout_s=max(1.0, deadline - time.monotonic()))
        except StoreUnavailable:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.5)


async def during_outage(svc: Services, dependency: str, host: str) -> dict[str, Any]:
    """Every service not ready naming ``dependency``, every one live; a door write is a 503 naming it."""
    started = time.monotonic()
    await eventually(lambda: svc.none_ready(dependency), f"every service not ready for {dependency}", 15, 0.2)
    noticed = time.monotonic() - started
    lives = await svc.answers("/livez")
    assert all(status == 200 for status, _ in lives.values()), lives
    status, body, headers = await asyncio.to_thread(post, svc.door_port, f"/v1/hosts/{host}/move/cut", {})
    assert status == 503 and body["dependency"] == dependency and headers.get("Retry-After") == "5", body
    assert body["copy"] == ("M-R36" if dependency == "nats" else "M-R37"), body
    return {"noticed_s": round(noticed, 2), "door": body["reason"]}


async def outage_during_a_move(own: tuple[Path, StackInfo], unique: Callable[[str], str], tmp_path: Path,
                               part: str) -> dict[str, Any]:
    root, info = own
    dependency = "nats" if part == "nats" else "s3"
    figures: dict[str, Any] = {"outage": part}
    async with data_buckets(info, unique, f"out-{part}") as (store, events, prefix):
        agent_health = {"ie": free_port(), "uk": free_port()}
        extra = {r: {"HOSTMOVE_HEALTH_PORT": str(p)} for r, p in agent_health.items()}
        async with agent_world(info, unique, tmp_path, prefix, store=store, events=events, app_env=APP,
                               extra=extra) as w, services(info, w, agent_health) as svc:
            host = f"{unique(f'out-{part}')}.example.com"
            await create_and_write(w, host)
            with Writer(w, host) as writer:
                status, body, _ = await asyncio.to_thread(post, svc.door_port, f"/v1/hosts/{host}/move",
                                                          {"to": "uk", "cut": "auto"})
                assert status == 201, body
                move_id = str(body["move"]["id"])

                async def preparing() -> bool:
                    record = (await w.ledger.read_record(host)).state
                    return record is not None and record.move is not None and record.move.state == "preparing"

                await eventually(preparing, "the move preparing", 30, 0.05)
                writes_before = len(writer.acked)
                down_at = time.monotonic()
                stop_part(root, part)
                figures.update(await during_outage(svc, dependency, host))
                await asyncio.sleep(max(0.0, OUTAGE_S - (time.monotonic() - down_at)))
                assert all(svc.all_alive().values()), svc.all_alive()
                assert all(a.alive() for a in w.agents.values()), "no agent died of the outage"
                still = await svc.answers("/readyz")
                assert all(s == 503 for n, (s, _) in still.items() if not (part == "weed" and n == "projections"))
                figures["outage_s"] = round(time.monotonic() - down_at, 1)
                figures["writes_during"] = len(writer.acked) - writes_before
                up_at = time.monotonic()
                await asyncio.to_thread(restart, root, info)
                figures["restart_s"] = round(time.monotonic() - up_at, 2)
                await eventually(svc.ready, "every service ready again", 60, 0.1)
                figures["ready_again_s"] = round(time.monotonic() - up_at, 2)
                after_seq = (await events.state(LEDGER_STREAM)).last_seq
                await moved_despite_blips(w, host, move_id)
                figures["move_done_s"] = round(time.monotonic() - up_at, 2)
                await serving_port(w, "uk", host)
            figures["writes_acked"], figures["writes_failed"] = len(writer.acked), writer.failed
            await assert_served_on_uk(w, host, move_id)
            seen = await projection_shows_the_end(w, svc, host, events)
            figures["transitions_after"] = (await events.state(LEDGER_STREAM)).last_seq - after_seq
            figures["projection_position"] = seen["health"]["position"]
            recovery_log = svc.procs["recovery"].output()
            assert "Traceback" not in recovery_log and "Traceback" not in svc.procs["relay"].output()
    print(f"\nOUTAGE {json.dumps(figures)}")
    return figures


@pytest.mark.asyncio(loop_scope="session")
async def test_a_nats_outage_while_a_move_prepares(own: tuple[Path, StackInfo], unique: Callable[[str], str],
                                                   tmp_path: Path) -> None:
    figures = await outage_during_a_move(own, unique, tmp_path, "nats")
    assert figures["outage_s"] > OLD_BUDGET_S


@pytest.mark.asyncio(loop_scope="session")
async def test_a_seaweedfs_outage_while_a_move_prepares(own: tuple[Path, StackInfo], unique: Callable[[str], str],
                                                        tmp_path: Path) -> None:
    await outage_during_a_move(own, unique, tmp_path, "weed")


@pytest.mark.asyncio(loop_scope="session")
async def test_services_started_before_the_stack_wait_not_ready(own: tuple[Path, StackInfo],
                                                                unique: Callable[[str], str], tmp_path: Path) -> None:
    """A service started while NATS is down waits (live, not ready), and is ready once NATS is up: no restart."""
    from services.objstore.s3 import S3Store

    root, info = own
    bucket = unique("out-early")
    async with await S3Store.open(info.s3_endpoint, info.s3_access_key, info.s3_secret_key, info.s3_region) as store:
        await store.create_bucket(bucket, versioned=True)
    stop_part(root, "nats")
    port = free_port()
    env = service_env(info, root=tmp_path, bucket=bucket)
    proc = ServiceProc.serve("recovery", env, tmp_path / "recovery.log", "--health-port", str(port))
    proc.start({"HOSTMOVE_HEALTH_PORT": "1"})  # the flag wins over the environment
    try:
        async def waiting() -> bool:
            status, body = await asyncio.to_thread(get, port, "/readyz")
            return status == 503 and body["dependencies"]["nats"]["ok"] is False

        await eventually(waiting, "the recovery pass waiting for NATS", 30)
        assert (await asyncio.to_thread(get, port, "/livez"))[0] == 200
        await asyncio.sleep(3)
        assert proc.alive()
        await asyncio.to_thread(restart, root, info)
        await eventually(lambda: asyncio.to_thread(lambda: get(port, "/readyz")[0] == 200), "ready", 30)
    finally:
        assert proc.stop() == 0, proc.output()[-3000:]


async def test_a_recovery_pass_reports_an_unreachable_store_instead_of_raising(
        own: tuple[Path, StackInfo], unique: Callable[[str], str]) -> None:
    """``run_once`` with S3 gone: the pass stops with ``unavailable`` naming s3 (it used to raise out of the
    service while listing the hosts)."""
    from services.objstore.s3 import S3Store

    root, info = own
    store = await S3Store.open(info.s3_endpoint, info.s3_access_key, info.s3_secret_key, info.s3_region,
                               connect_timeout=1.0, read_timeout=2.0, max_attempts=1)
    events = await NatsEventLog.connect(info.nats_url)
    try:
        bucket = unique("out-recovery")
        await store.create_bucket(bucket, versioned=True)
        recovery = RecoveryPass(Ledger(store, events, WallClock(), Actor(service="t", pid=1, nonce="n"), bucket),
                                events)
        assert (await recovery.run_once()).unavailable is None
        stop_part(root, "weed")
        try:
            report = await recovery.run_once()
            assert report.unavailable is not None and report.unavailable[0] == "s3", report
        finally:
            await asyncio.to_thread(restart, root, info)
        assert (await recovery.run_once()).unavailable is None
        await store.delete_bucket(bucket)
    finally:
        await events.close()
        await store.close()
