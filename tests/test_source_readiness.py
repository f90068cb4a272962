"""S1 takes a readiness answer only from the instance's own process (issue 18 item 5; spec §7.3 S1, codex 14):
the processes holding the instance's listening socket must be its cgroup leaf's.

- the pure parts: the LISTEN sockets of a port in ``/proc/net/tcp``, and the verdict;
- on this machine: a server of this test process (outside every leaf) answering on a port is refused, naming it;
- on the real stack, both box agents as processes: the source instance dies and a stranger takes its port and
  answers 200 on the readiness path; S1 refuses it, the move is never ready, never cuts and aborts itself within its
  prepare bound with the reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest
import pytest_asyncio

from bus.nats_log import NatsEventLog
from events.ids import new_incarnation
from hostmove.rehearsal import last_move_state
from hostmove.stackinfo import StackInfo
from kernel.ports import SystemRandom, WallClock
from services.agent.service import read_endpoint
from services.box.instance.peer import answered_by_leaf, judge, parse_listeners
from services.door.api import Door
from services.door.auth import Identity
from services.door.decide import MoveRequest
from services.hosts.create import create_host
from services.ledger import Committed
from services.objstore.s3 import S3Store
from tests.helpers.agents import agent_world, answers_ready, data_buckets, eventually

TCP = """  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 4711 1 0 100 0 0 10 0
   1: 0100007F:1F90 0100007F:D431 01 00000000:00000000 00:00000000 00000000     0        0 4712 1 0 20 4 0 10 -1
   2: 00000000:0050 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 99 1 0 100 0 0 10 0
"""


def test_the_listening_socket_of_a_port_and_the_verdict() -> None:
    assert parse_listeners(TCP, 8080) == {4711}  # the LISTEN socket, not an established connection
    assert parse_listeners(TCP, 80) == {99} and parse_listeners(TCP, 81) == set()
    assert judge("h", 8080, {10: "python3", 11: "python3"}, [10, 11, 12]) == (True, "")
    ok, why = judge("h", 8080, {10: "python3", 66: "nc"}, [10, 11])
    assert not ok and why == "the answer on port 8080 came from process 66 (nc), outside h's cgroup leaf, not from " \
                             "the instance"
    ok, why = judge("h", 8080, {}, [10])
    assert not ok and "no process of h's cgroup leaf holds port 8080" in why


@contextlib.contextmanager
def stranger(port: int) -> Iterator[HTTPServer]:
    """An HTTP server of this test process (no leaf of any box) answering 200 on every GET."""

    class Answer(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"ok")

        def log_message(self, *args: object) -> None:
            return

    server = HTTPServer(("127.0.0.1", port), Answer)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def test_an_answer_from_this_process_is_not_the_instance_s() -> None:
    with stranger(0) as server:
        port = server.server_address[1]
        ok, why = answered_by_leaf("h.example.com", port, members=[])
        assert not ok and f"came from process {os.getpid()} (" in why and "outside h.example.com's cgroup leaf" in why


@pytest_asyncio.fixture(loop_scope="session", scope="module")
async def shared(stack: StackInfo, unique: Callable[[str], str]) -> AsyncIterator[tuple[S3Store, NatsEventLog, str]]:
    async with data_buckets(stack, unique, "sone") as s:
        yield s


@pytest.mark.asyncio(loop_scope="session")
async def test_a_readiness_answer_from_outside_the_leaf_is_refused_at_s1(
        stack: StackInfo, unique: Callable[[str], str], shared: tuple[S3Store, NatsEventLog, str],
        tmp_path: Path) -> None:
    store, events, prefix = shared
    quiet = {"MOVEPROBE_INTERVAL_S": "3600", "MOVEPROBE_SCHEDULE_EVERY_S": "3600", "MOVEPROBE_ONCE_AFTER_S": "3600"}
    async with agent_world(stack, unique, tmp_path, prefix, store=store, events=events, app_env=quiet,
                           agent_env={"HOSTMOVE_PREPARE_BOUND_S": "20"}) as w:
        host = f"{unique('peer')}.example.com"
        created = await create_host(w.ledger, host, box=w.labels["ie"], region="ie",
                                    incarnation=new_incarnation(SystemRandom()), app=w.app)
        assert isinstance(created, Committed)

        async def serving() -> int | None:
            port = read_endpoint(w.box_dir("ie"), host)
            return port if port is not None and await asyncio.to_thread(answers_ready, port) else None

        port = await eventually(serving, f"{host} served on ie", 60)
        leaf = w.tree(w.labels["ie"]).leaf(host)
        (leaf / "cgroup.kill").write_text("1")  # the instance dies; its agent has not noticed yet
        deadline = time.monotonic() + 10
        while "populated 0" not in (leaf / "cgroup.events").read_text() and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        with stranger(port):
            assert await asyncio.to_thread(answers_ready, port), "a stranger answers the instance's port"
            door = Door(w.ledger, clock=WallClock(), rng=SystemRandom())
            answer = await door.request_move(host, MoveRequest("uk", "auto"), Identity("op", "operator"))
            assert answer.status in (200, 201), answer.body
            move_id = str(answer.body["move"]["id"])

            async def refused() -> str | None:
                record = (await w.ledger.read_record(host)).state
                reason = record.move.reason if record is not None and record.move is not None else ""
                return reason if "outside" in reason else None

            reason = await eventually(refused, "S1 refusing the stranger's answer", 30)
            assert f"came from process {os.getpid()} (" in reason and f"outside {host}'s cgroup leaf" in reason, reason
            assert "does not answer its readiness path" in reason  # M-C16, the operator's sentence

            async def aborted() -> bool:
                record = (await w.ledger.read_record(host)).state
                return record is not None and record.move is None and record.last_move is not None \
                    and record.last_move.id == move_id

            await eventually(aborted, "the move to abort itself", 60)
        record = (await w.ledger.read_record(host)).state
        assert record is not None and record.last_move is not None and record.last_move.outcome == "aborted"
        last = await last_move_state(events, host, move_id)
        assert last is not None and last.cut_at is None and last.ready_at is None, "never ready, never cut"
