"""Every service's ``/metrics`` (issue 19 item 5, :mod:`kernel.metrics`).

- the pure reading of a record transition: a move begun, a move closed with its phases and budgets, nothing else;
- on the real stack, door, projections, relay, recovery and two box agents as processes: each one's ``/metrics``
  parses with the Prometheus text parser, and a real move requested through the door moves the counters and the
  phase histograms summed over the services (each transition is counted by the process that wrote it).
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

from bus.memory_log import MemoryEventLog
from events.claim import Claim, Op
from events.envelope import Actor
from events.ids import new_incarnation
from events.record import LastMove, Move, Record
from hostmove.procs import ServiceProc, service_env
from hostmove.stackinfo import StackInfo
from kernel import metrics
from kernel.metrics import PHASES, move_observation
from kernel.ports import ManualClock, SystemRandom
from services.hosts.create import create_host
from services.ledger import Committed, Ledger
from services.objstore.memory import MemoryStore
from tests.helpers.agents import agent_world, data_buckets, eventually
from tests.helpers.webcalls import free_port, get_json, post_json, scrape

TOKEN = "metrics-operator-token"
APP = {"MOVEPROBE_INTERVAL_S": "0.5"}


def _move(**fields: object) -> Move:
    return Move(id="mv_1", incarnation="inc", to="uk", state="preparing", **fields)  # type: ignore[arg-type]


def test_a_record_that_gains_a_move_starts_one() -> None:
    seen = move_observation(Record(host="h", gen=1), Record(host="h", gen=2, move=_move(requested_at=1000)))
    assert seen.started and seen.ended is None and seen.phases == ()
    again = move_observation(Record(host="h", gen=2, move=_move()), Record(host="h", gen=3, move=_move(ready_at=5)))
    assert not again.started and again.ended is None, "a step inside the same move starts nothing"


def test_the_close_reports_the_outcome_phases_and_budgets() -> None:
    move = _move(requested_at=1_000, ready_at=4_000, cut_at=5_000, cut_budget_s=12.0, flipped_at=7_000,
                 landing_deadline=37_000, committed_at=8_500, opened_at=9_000)
    before = Record(host="h", gen=9, move=msgspec.structs.replace(move, state="committed"))
    after = Record(host="h", gen=10, last_move=LastMove(id="mv_1", outcome="done", at=10_000))
    seen = move_observation(before, after)
    assert seen.ended == "done" and not seen.started
    assert dict(seen.phases) == {"prepare": 3.0, "cut": 2.0, "land": 1.5, "offline": 4.0, "close": 1.0}
    assert dict(seen.budgets) == {"cut": 12.0, "offline": 12.0, "land": 30.0}
    aborted = move_observation(Record(host="h", gen=3, move=_move(requested_at=1_000)),
                               Record(host="h", gen=4, last_move=LastMove(id="mv_1", outcome="aborted", at=2_000)))
    assert aborted.ended == "aborted" and aborted.phases == (), "no phase without both of its times"
    other = move_observation(Record(host="h", gen=3, move=_move()),
                             Record(host="h", gen=4, last_move=LastMove(id="mv_0", outcome="done", at=2_000)))
    assert other.ended is None, "a close names the move it closes"


def test_the_exposition_parses_and_carries_every_move_series() -> None:
    families = {f.name: f for f in text_string_to_metric_families(metrics.exposition().decode())}
    for name in ("hostmove_moves_started", "hostmove_moves_ended", "hostmove_move_phase_seconds",
                 "hostmove_s3_requests", "hostmove_jetstream_publish_seconds", "hostmove_alerts"):
        assert name in families, sorted(families)
    phases = {s.labels["phase"] for s in families["hostmove_move_phase_seconds"].samples}
    assert phases == set(PHASES)
    with pytest.raises(ValueError, match="unknown move phase"):
        metrics.set_budget("lunch", 1.0)


class Racing:
    """A store on which another writer's transition lands right before this ledger's next conditional write."""

    def __init__(self, inner: MemoryStore, other: Ledger) -> None:
        self.inner, self.other, self.races = inner, other, 1

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def put(self, bucket: str, key: str, body: bytes, **kw: Any) -> Any:
        if self.races and kw.get("if_match"):
            self.races -= 1
            await self.other.transition("claim", "h.example", "raced", lambda cur: cur and msgspec.structs.replace(
                cur, op=Op(kind="serving", exec="other")))
        return await self.inner.put(bucket, key, body, **kw)


async def test_the_ledger_counts_a_lost_cas_and_its_retry() -> None:
    store, events, clock = MemoryStore(), MemoryEventLog(), ManualClock()
    await store.create_bucket("metrics-b", versioned=True)
    actor = Actor(service="test", pid=1, nonce="m")
    other = Ledger(store, events, clock, actor, "metrics-b")
    ledger = Ledger(Racing(store, other), events, clock, actor, "metrics-b")  # type: ignore[arg-type]
    await ledger.transition("claim", "h.example", "created", lambda cur: Claim(host="h.example", gen=1))
    sample = metrics.REGISTRY.get_sample_value
    before = {n: sample(n, {"object": "claim"}) or 0.0 for n in ("hostmove_ledger_cas_conflicts_total",)}
    retries = sample("hostmove_ledger_retries_total", {"object": "claim", "reason": "conflict"}) or 0.0
    out = await ledger.transition("claim", "h.example", "moved", lambda cur: cur and msgspec.structs.replace(
        cur, op=Op(kind="serving", exec="mine")))
    assert isinstance(out, Committed) and out.state.gen == 3 and out.state.op.exec == "mine"
    assert sample("hostmove_ledger_cas_conflicts_total", {"object": "claim"}) == \
        before["hostmove_ledger_cas_conflicts_total"] + 1
    assert sample("hostmove_ledger_retries_total", {"object": "claim", "reason": "conflict"}) == retries + 1


# -- the real stack ------------------------------------------------------------------------------------------


def total(scrapes: dict[str, dict[str, float]], sample: str) -> float:
    return sum(values.get(sample, 0.0) for values in scrapes.values())


async def scrape_all(health: dict[str, int]) -> dict[str, dict[str, float]]:
    got = await asyncio.gather(*(asyncio.to_thread(scrape, port) for port in health.values()))
    return dict(zip(health, got, strict=True))


@pytest.mark.asyncio(loop_scope="session")
async def test_every_service_serves_metrics_that_a_move_moves(stack: StackInfo, unique: Callable[[str], str],
                                                              tmp_path: Path) -> None:
    async with data_buckets(stack, unique, "met") as (store, events, prefix):
        agent_health = {"ie": free_port(), "uk": free_port()}
        extra = {r: {"HOSTMOVE_HEALTH_PORT": str(p)} for r, p in agent_health.items()}
        async with agent_world(stack, unique, tmp_path, prefix, store=store, events=events, app_env=APP,
                               extra=extra) as w:
            health = {"door": free_port(), "projections": free_port(), "relay": free_port(),
                      "recovery": free_port(), **{f"box-{r}": p for r, p in agent_health.items()}}
            door_port = free_port()
            env = service_env(stack, root=w.root, bucket=w.deploy, extra={
                "HOSTMOVE_OPERATOR_TOKENS": "ops=" + hashlib.sha256(TOKEN.encode()).hexdigest()})
            procs = {
                "door": ServiceProc.serve("door", env, w.root / "door.log", "--port", str(door_port)),
                "projections": ServiceProc.serve("projections", env, w.root / "projections.log", "--port",
                                                 str(free_port())),
                "relay": ServiceProc.serve("relay", env, w.root / "relay.log"),
                "recovery": ServiceProc.serve("recovery", env, w.root / "recovery.log"),
            }
            for name, proc in procs.items():
                proc.start({"HOSTMOVE_HEALTH_PORT": str(health[name])})
            try:
                async def ready() -> bool:
                    answers = await asyncio.gather(*(asyncio.to_thread(get_json, p, "/readyz")
                                                     for p in health.values()))
                    return all(status == 200 for status, _ in answers)

                await eventually(ready, "every service ready", 60)
                host = f"{unique('met')}.example.com"
                created = await create_host(w.ledger, host, box=w.labels["ie"], region="ie",
                                            incarnation=new_incarnation(SystemRandom()))
                assert isinstance(created, Committed), created
                before = await scrape_all(health)
                for name, values in before.items():  # every service: the move series, S3 and the process
                    assert "hostmove_moves_started_total{}" in values, name
                    assert "process_cpu_seconds_total{}" in values, name
                    assert any(k.startswith("hostmove_s3_requests_total{") for k in values), name

                status, body = await asyncio.to_thread(post_json, door_port, f"/v1/hosts/{host}/move",
                                                       {"to": "uk", "cut": "auto"}, token=TOKEN)
                assert status == 201, body
                move_id = str(body["move"]["id"])

                async def closed() -> bool:
                    record = (await w.ledger.read_record(host)).state
                    return record is not None and record.last_move is not None and record.last_move.id == move_id

                await eventually(closed, f"the move {move_id} to close", 120)
                record = (await w.ledger.read_record(host)).state
                assert record is not None and record.last_move is not None and record.last_move.outcome == "done"

                async def counted() -> dict[str, dict[str, float]] | None:
                    now = await scrape_all(health)
                    ended = 'hostmove_moves_ended_total{outcome=done}'
                    return now if total(now, ended) - total(before, ended) >= 1 else None

                after = await eventually(counted, "the move's end counted", 15)
            finally:
                rcs = {name: proc.stop() for name, proc in procs.items()}
            assert rcs == dict.fromkeys(procs, 0), {n: p.output()[-2000:] for n, p in procs.items()}

    started = "hostmove_moves_started_total{}"
    assert after["door"][started] - before["door"][started] == 1, "the door began the move"
    assert total(after, started) - total(before, started) == 1
    for phase in PHASES:
        count = f"hostmove_move_phase_seconds_count{{phase={phase}}}"
        assert total(after, count) - total(before, count) == 1, (phase, {n: v.get(count) for n, v in after.items()})
        summed = f"hostmove_move_phase_seconds_sum{{phase={phase}}}"
        assert total(after, summed) > total(before, summed) or phase == "close"
    budgets = {k: v for values in after.values() for k, v in values.items()
               if k.startswith("hostmove_move_phase_budget_seconds")}
    assert {"hostmove_move_phase_budget_seconds{phase=offline}", "hostmove_move_phase_budget_seconds{phase=prepare}",
            "hostmove_move_phase_budget_seconds{phase=land}"} <= set(budgets), budgets
    print("\nMETRICS phases " + " ".join(
        f"{p}={total(after, f'hostmove_move_phase_seconds_sum{{phase={p}}}'):.2f}s" for p in PHASES))
    boxes = [after[f"box-{r}"] for r in ("ie", "uk")]
    assert boxes[1][f"hostmove_box_instances_running{{box={w.labels['uk']}}}"] == 1, "the host runs on uk now"
    assert boxes[0][f"hostmove_box_instances_running{{box={w.labels['ie']}}}"] == 0
    committed = "hostmove_ledger_transitions_total{object=record,outcome=committed}"
    assert total(after, committed) - total(before, committed) >= 5
    for name in ("door", "box-ie", "box-uk"):  # S3 by operation and status, JetStream publishes, both with latency
        assert after[name]["hostmove_s3_requests_total{operation=put_object,status=200}"] > 0, name
        assert after[name]["hostmove_s3_request_seconds_count{operation=get_object}"] > 0, name
        publishes = sum(v for k, v in after[name].items()
                        if k.startswith("hostmove_jetstream_publish_seconds_count{outcome=ok,stream=HM_LEDGER"))
        assert publishes > 0, name

