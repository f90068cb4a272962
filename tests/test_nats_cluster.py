"""A three-node JetStream cluster (issue 19 item 4): ``hostmove stack up --nats-cluster 3`` on loopback, the streams
with three replicas, every service connected with the cluster's URLs.

One node, the ledger stream's leader, is killed while a move prepares: the move finishes ``done``, the stream holds
every transition of the host's claim and record without a gap (no rebase), the projections show the last of each,
and the audit is clean. ``hostmove stack up`` then starts the dead node again and it rejoins.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from bus.log import LogUnavailable
from bus.nats_log import NatsEventLog
from bus.subjects import LEDGER_STREAM, ledger_subject
from events.base import decode
from events.envelope import Transition
from events.ids import new_incarnation
from hostmove.procs import ServiceProc, service_env
from hostmove.stack import StackError, nats_nodes, stack_down, stack_status, stack_up
from hostmove.stackinfo import StackInfo
from kernel.credentials import ENV_CREDENTIALS, load_credentials
from kernel.ports import SystemRandom, WallClock
from services.door.api import Door
from services.door.auth import Identity
from services.door.decide import MoveRequest
from services.hosts.create import create_host
from services.ledger import Committed
from services.ledger.audit import run_audit
from tests.helpers.agents import agent_world, data_buckets, eventually
from tests.helpers.webcalls import free_port, get_json

APP = {"MOVEPROBE_INTERVAL_S": "0.5"}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, stack: StackInfo) -> Iterator[tuple[Path, StackInfo]]:
    """A stack of this module's own, its NATS a three-node cluster; this module acts as its operator (after the
    session's stack is up: its fixture names its own operator in the environment when it starts)."""
    root = tmp_path_factory.mktemp("cluster-stack")
    info = stack_up(root, nats_cluster=3)
    session = os.environ.get(ENV_CREDENTIALS)
    os.environ[ENV_CREDENTIALS] = info.credentials
    try:
        yield root, info
    finally:
        if session is None:
            os.environ.pop(ENV_CREDENTIALS, None)
        else:
            os.environ[ENV_CREDENTIALS] = session
        stack_down(root)


def test_the_cluster_is_three_nodes_and_its_url_lists_them(cluster: tuple[Path, StackInfo]) -> None:
    root, info = cluster
    nodes = nats_nodes(root)
    assert len(nodes) == 3 and info.stream_replicas == 3
    assert info.nats_url.split(",") == [n.url for n in nodes]
    status = stack_status(root)
    assert status["running"] and [n["healthy"] for n in status["nats"]["nodes"]] == [True] * 3, status
    assert stack_up(root, nats_cluster=3) == info, "a healthy cluster is reused as it is"


def test_the_command_starts_a_cluster_and_a_stack_of_another_size_is_refused(tmp_path: Path,
                                                                           stack: StackInfo) -> None:
    root = tmp_path / "cli-stack"
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOSTMOVE_")}

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "hostmove.cli", "--root", str(root), "stack", *args],
                              capture_output=True, text=True, timeout=120, env=env)

    try:
        up = cli("up", "--nats-cluster", "3")
        assert up.returncode == 0, up.stderr
        urls = up.stdout.split("NATS ", 1)[1].split(",", 2)
        assert len(urls) == 3, up.stdout
        status = json.loads(cli("status").stdout)
        assert status["running"] and len(status["nats"]["nodes"]) == 3, status
        again = cli("up")  # one node asked of a running three-node cluster: refused, saying what to do
        assert again.returncode != 0 and "hostmove stack down" in again.stderr, again
    finally:
        assert cli("down").returncode == 0
    assert stack.root, "the session's stack is the embedded one"
    with pytest.raises(StackError, match="with 1 NATS node"):
        stack_up(stack.root, nats_cluster=3)  # the running one-server stack is left as it is
    assert stack_status(stack.root)["running"]


async def history_gens(events: NatsEventLog, host: str) -> dict[str, list[tuple[str, int]]]:
    """Each object's events on the stream, in order: ``(kind, gen)``."""
    out: dict[str, list[tuple[str, int]]] = {}
    for obj in ("claim", "record"):
        out[obj] = [(t.kind, t.gen) for t in [decode(m.data, Transition) async for m in  # type: ignore[misc]
                                              events.replay(LEDGER_STREAM, subject=ledger_subject(obj, host))]]
    return out


@pytest.mark.asyncio(loop_scope="session")
async def test_a_move_finishes_when_the_stream_leader_dies(cluster: tuple[Path, StackInfo],
                                                           unique: Callable[[str], str], tmp_path: Path) -> None:
    root, info = cluster
    async with data_buckets(info, unique, "ncl") as (store, events, prefix):
        await events.close()  # the test's own connection declares the streams with the cluster's replicas
        events = await NatsEventLog.connect(info.nats_url, credentials=load_credentials(info.credentials),
                                            replicas=info.stream_replicas)
        ledger_info = await events.js.stream_info(LEDGER_STREAM)
        assert ledger_info.config.num_replicas == 3, ledger_info.config
        # a cut window of 60 s, not the fast profile's 12: the election's seconds of outage and a loaded machine's
        # landing must not turn the move the test watches into a (correct) rollback at its deadline
        async with agent_world(info, unique, tmp_path, prefix, store=store, events=events, app_env=APP,
                               agent_env={"HOSTMOVE_CUT_WINDOW_S": "60"}) as w:
            projections_port, health_port = free_port(), free_port()
            env = service_env(info, root=w.root, bucket=w.deploy)
            assert env["HOSTMOVE_NATS_URL"] == info.nats_url and env["HOSTMOVE_STREAM_REPLICAS"] == "3"
            procs = {"projections": ServiceProc.serve("projections", env, w.root / "projections.log", "--port",
                                                      str(projections_port)),
                     "relay": ServiceProc.serve("relay", env, w.root / "relay.log")}
            procs["projections"].start({"HOSTMOVE_HEALTH_PORT": str(health_port)})
            procs["relay"].start()
            try:
                host = f"{unique('ncl')}.example.com"
                created = await create_host(w.ledger, host, box=w.labels["ie"], region="ie",
                                            incarnation=new_incarnation(SystemRandom()))
                assert isinstance(created, Committed), created

                async def serving() -> bool:
                    claim = (await w.ledger.read_claim(host)).state
                    return claim is not None and claim.holder is not None and claim.holder.session > 0

                await eventually(serving, f"{host} serving on ie", 60)
                door = Door(w.ledger, clock=WallClock(), rng=SystemRandom())
                answer = await door.request_move(host, MoveRequest("uk", "auto"), Identity("op", "operator"))
                assert answer.status in (200, 201), answer.body
                move_id = str(answer.body["move"]["id"])

                leader = (await events.js.stream_info(LEDGER_STREAM)).cluster
                assert leader is not None and leader.leader, "a replicated stream has a leader"
                victim = next(n for n in nats_nodes(root) if n.name == leader.leader)
                os.kill(victim.pid, signal.SIGKILL)  # the stream's leader, while the move prepares
                killed_at = time.monotonic()

                async def closed() -> bool:
                    record = (await w.ledger.read_record(host)).state
                    return record is not None and record.last_move is not None and record.last_move.id == move_id

                try:
                    await eventually(closed, f"the move {move_id} to close with {victim.name} dead", 150)
                except AssertionError:
                    logs = "\n".join(a.output()[-3000:] for a in w.agents.values())
                    raise AssertionError(f"{(await w.ledger.read_record(host)).state}\n{logs}") from None
                closed_s = time.monotonic() - killed_at
                record = (await w.ledger.read_record(host)).state
                claim = (await w.ledger.read_claim(host)).state
                assert record is not None and record.last_move is not None and record.last_move.outcome == "done"
                now_led = (await events.js.stream_info(LEDGER_STREAM)).cluster
                assert now_led is not None and now_led.leader not in ("", victim.name), now_led
                assert claim is not None and claim.op.exec == w.labels["uk"], claim

                async def settled() -> dict[str, list[tuple[str, int]]] | None:  # the relay publishes a gen a
                    try:  # writer's publish lost to the election; a replay may meet the cluster still electing
                        gens = await history_gens(events, host)
                    except LogUnavailable:
                        return None
                    now = (await w.ledger.read_claim(host)).state, (await w.ledger.read_record(host)).state
                    assert now[0] is not None and now[1] is not None  # the claim goes on after the close (its chores)
                    last = {"claim": now[0].gen, "record": now[1].gen}
                    return gens if all(gens[o] and gens[o][-1][1] == last[o] for o in gens) else None

                try:
                    gens = await eventually(settled, "every gen on the stream", 30)
                except AssertionError:
                    seen = await history_gens(events, host)
                    raise AssertionError(f"gens at the close: claim {claim.gen}, record {record.gen}; seen {seen}\n"
                                         f"{procs['relay'].output()[-3000:]}") from None
                for obj, seen in gens.items():
                    assert seen == [("transition", g) for g in range(1, len(seen) + 1)], (obj, seen)

                async def projected() -> dict[str, object] | None:
                    status, row = await asyncio.to_thread(get_json, projections_port, f"/v1/hosts/{host}")
                    now = (await w.ledger.read_claim(host)).state, (await w.ledger.read_record(host)).state
                    gens_now = (now[0].gen if now[0] else None, now[1].gen if now[1] else None)
                    if status != 200 or (row.get("claim_gen"), row.get("record_gen")) != gens_now:
                        return None
                    return row

                await eventually(projected, "the projections at the last gens", 30)
                status, health = await asyncio.to_thread(get_json, projections_port, "/healthz")
                assert status == 200, health
                assert not {k: n for k, n in health["errors"].items() if k in ("gap", "stream_gap", "decode")}, health
                audit = await run_audit(events, w.ledger, host=host)
                assert audit.clean(strict=True), [f.line() for f in audit.findings]
                print(f"\nCLUSTER killed {victim.name} (the ledger stream's leader); move done {closed_s:.1f} s later; "
                      f"new leader {now_led.leader}; claim gens {len(gens['claim'])}, record gens "
                      f"{len(gens['record'])}, all on the stream")
            finally:
                rcs = {name: proc.stop() for name, proc in procs.items()}
            assert rcs == dict.fromkeys(procs, 0), {n: p.output()[-2000:] for n, p in procs.items()}
            assert all(rc == 0 for rc in w.stop().values())
        await events.close()

    again = await asyncio.to_thread(stack_up, root, nats_cluster=3)  # only the dead node starts, and rejoins
    assert again.nats_url == info.nats_url
    assert all(n["alive"] and n["healthy"] for n in stack_status(root)["nats"]["nodes"])
