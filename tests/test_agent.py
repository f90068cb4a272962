"""Box agents as services (issue 4 "box services driven by NATS events"; ARCHITECTURE §2, §5): two
``hostmove serve box`` processes, one per region, and nothing else acting. A host created on ``ie`` is woken by
its agent; a move requested at the door is carried out by the two agents on ledger events alone (the source's
rounds and cut, the target's report, landing, probe, commit and open, both parks, the close), and the instance
serves on ``uk`` with every acknowledged write. A new agent process is a new session (§5.1 step 9)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sqlite3
import time
import urllib.request
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime
from pathlib import Path

import pytest
import pytest_asyncio

from bus.nats_log import NatsEventLog
from bus.subjects import LEDGER_STREAM, ledger_subject
from events.base import decode
from events.durable import DurableValueError
from events.envelope import Transition
from events.ids import new_incarnation
from hostmove.probe_apps import post_write
from hostmove.rehearsal import ack_logs, checks, timers_once, unanswered_deliveries
from hostmove.stackinfo import StackInfo
from kernel.failpoints import ENV
from kernel.ports import SystemRandom, WallClock
from moveprobe.acks import Ack, RowAck, TimerAck, missing_from_db, read_acks
from services.agent.service import read_endpoint
from services.box.instance.sandbox import instance_dir
from services.door.api import Door
from services.door.auth import Identity
from services.door.decide import MoveRequest
from services.hosts.create import create_host
from services.ledger import Committed
from services.ledger.audit import run_audit
from services.objstore.s3 import S3Store
from tests.helpers.agents import AgentWorld, agent_world, answers_ready, data_buckets, eventually

WRITES = 10
ONCE_AFTER_MS = 4000
APP = {"MOVEPROBE_INTERVAL_S": "0.2", "MOVEPROBE_SCHEDULE_EVERY_S": "0.4", "MOVEPROBE_ONCE_AFTER_S": "4"}
"""The sample app writes continuously (a background row every 0.2 s), runs its schedule every 0.4 s and its
once-timer 4 s after its first boot: around the cut (spec §14.4)."""


@pytest_asyncio.fixture(loop_scope="session", scope="module")
async def shared(stack: StackInfo, unique: Callable[[str], str]) -> AsyncIterator[tuple[S3Store, NatsEventLog, str]]:
    """The store, the event log and the two data buckets' prefix, for the whole module."""
    async with data_buckets(stack, unique, "agt") as s:
        yield s


def get_json(port: int, path: str) -> dict[str, list[dict[str, object]]]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
        body = json.load(resp)
    assert isinstance(body, dict)
    return body


async def serving_port(w: AgentWorld, region: str, host: str, timeout_s: float = 30.0,
                       newer_than: int | None = None) -> int:
    async def check() -> int | None:  # named in the box's edge table and answering its readiness path
        port = read_endpoint(w.box_dir(region), host, newer_than=newer_than)
        return port if port is not None and await asyncio.to_thread(answers_ready, port) else None

    return await eventually(check, f"{host} served on {w.labels[region]}", timeout_s)


async def create_and_write(w: AgentWorld, host: str, writes: int = WRITES) -> list[int]:
    created = await create_host(w.ledger, host, box=w.labels["ie"], region="ie",
                                incarnation=new_incarnation(SystemRandom()), app=w.app)
    assert isinstance(created, Committed), created
    port = await serving_port(w, "ie", host)
    return [await asyncio.to_thread(post_write, port, f"v{i}") for i in range(writes)]


async def request_move(w: AgentWorld, host: str) -> str:
    door = Door(w.ledger, clock=WallClock(), rng=SystemRandom())
    answer = await door.request_move(host, MoveRequest("uk", "auto"), Identity("op", "operator"))
    assert answer.status in (200, 201), answer.body
    return str(answer.body["move"]["id"])


async def moved(w: AgentWorld, host: str, move_id: str, timeout_s: float = 150.0) -> None:
    """The move closed as done and the claim serves on the target (K8)."""

    async def check() -> bool:
        record = (await w.ledger.read_record(host)).state
        claim = (await w.ledger.read_claim(host)).state
        return (record is not None and record.move is None and record.last_move is not None
                and record.last_move.id == move_id and record.last_move.outcome == "done"
                and claim is not None and claim.op.kind == "serving" and claim.op.exec == w.labels["uk"])

    try:
        await eventually(check, f"the move {move_id} of {host} to close as done", timeout_s)
    except AssertionError:
        record = (await w.ledger.read_record(host)).state
        logs = "\n".join(a.output()[-3000:] for a in w.agents.values())
        raise AssertionError(f"not moved; record {record}{await rollbacks(w, host, move_id)}"
                             f"{warnings(w, host)}\n{logs}") from None


async def rollbacks(w: AgentWorld, host: str, move_id: str) -> str:
    """On a failure: every rollback the ledger recorded for ``move_id`` (its reason and evidence), so a move that
    rolled back says why (the CI run keeps no files, only this message)."""
    seen: list[str] = []
    async for msg in w.events.replay(LEDGER_STREAM, subject=ledger_subject("record", host)):
        with contextlib.suppress(DurableValueError, ValueError):
            event = decode(msg.data, Transition)
            move = event.record.move if event.record is not None else None
            if move is not None and move.id == move_id and move.rollback is not None:
                why = f"{move.rollback.reason} (evidence {move.rollback.evidence or 'none'})"
                if not any(line.endswith(why) for line in seen):  # the event that recorded it, not its followers
                    seen.append(f"{event.meta.name} by {event.meta.actor.box or event.meta.actor.service}: {why}")
    return "".join(f"\nrollback: {line}" for line in seen)


def warnings(w: AgentWorld, host: str, cap: int = 60) -> str:
    """On a failure: the agents' warnings and errors about ``host``, in time order."""
    out: list[str] = []
    for region, agent in w.agents.items():
        with contextlib.suppress(OSError):
            for raw in agent.log.read_text(errors="replace").splitlines():
                with contextlib.suppress(ValueError):
                    line = json.loads(raw)
                    about = line.get("host") == host or host in str(line.get("message", ""))
                    if about and line.get("level") in ("WARNING", "ERROR"):
                        out.append(f"{str(line.get('time', ''))[:23]} {region} {line.get('message', '')}"[:400])
    out.sort()
    return "\nwarnings about the host:\n  " + "\n  ".join(out[-cap:]) if out else ""


def where_acks_are(w: AgentWorld, host: str) -> str:
    """On a failure: which of the boxes' databases of ``host`` (live, parked, superseded) hold each acknowledgement
    uk's database misses, so a loss says whether it happened on the source's disk or on the way."""
    logs = ack_logs(w.root / "acks", host, w.labels["ie"], {"uk": w.labels["uk"]})
    acks = [a for log, _ in logs for a in read_acks(log, host=host)]
    target = instance_dir(w.box_dir("uk") / "data", host) / f"{host}.db"
    missing = missing_from_db(target, acks)
    if not missing:
        return ""
    lines = [f"\n{len(missing)} acknowledgement(s) missing on uk; the databases of {host} on the boxes:"]
    for region in ("ie", "uk"):
        for db in sorted(w.box_dir(region).rglob(f"{host}.db")):
            lacks = missing_from_db(db, missing)
            lines.append(f"  {db.relative_to(w.root)}: holds {len(missing) - len(lacks)} of them"
                         + "".join(f"\n    {near}" for near in _near(db, missing[:3])))
    return "\n".join(lines) + timeline(w, host, min(a.ts_ms for a in missing))


def _near(db: Path, acks: list[Ack]) -> list[str]:
    """What ``db`` holds where each missing acknowledgement should be (the row of its seq or run, and a timer
    delivery's rows by id), and the WAL beside it: whether the write is elsewhere or absent."""
    wal = db.with_name(db.name + "-wal")
    out = [f"-wal: {wal.stat().st_size if wal.exists() else 'none'} bytes"]
    try:
        conn = sqlite3.connect(f"file:{db}?mode=ro{'' if wal.exists() else '&immutable=1'}", uri=True)
    except sqlite3.Error as exc:
        return [*out, f"not opened: {exc}"]
    try:
        for a in acks:
            if isinstance(a, TimerAck):
                rows = conn.execute("SELECT run, name, due_at_ms, delivery, session FROM timer_runs "
                                    "WHERE run = ? OR delivery = ? OR due_at_ms = ?",
                                    (a.run, a.delivery, a.due_at_ms)).fetchall()
                top = conn.execute("SELECT max(run) FROM timer_runs").fetchone()
            else:
                rows = conn.execute("SELECT seq, kind, session, value FROM rows WHERE seq = ?",
                                    (a.seq,)).fetchall()
                top = conn.execute("SELECT max(seq) FROM rows").fetchone()
            out.append(f"for {type(a).__name__} {getattr(a, 'run', getattr(a, 'seq', '?'))}: {rows}; last {top}")
    except sqlite3.Error as exc:
        out.append(f"not read: {exc}")
    finally:
        conn.close()
    return out


def timeline(w: AgentWorld, host: str, at_ms: int, around_ms: int = 4000, cap: int = 80) -> str:
    """The agents' log lines about ``host`` within ``around_ms`` of ``at_ms``, in time order: what each box did
    around a missing acknowledgement (the CI run keeps no files, only this message)."""
    out: list[tuple[str, str]] = []
    lo = datetime.fromtimestamp((at_ms - around_ms) / 1000, UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:23]
    hi = datetime.fromtimestamp((at_ms + around_ms) / 1000, UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:23]
    for region, agent in w.agents.items():
        with contextlib.suppress(OSError):
            for raw in agent.log.read_text(errors="replace").splitlines():
                with contextlib.suppress(ValueError):
                    line = json.loads(raw)
                    stamp = str(line.get("time", ""))[:23]
                    if line.get("host") == host and lo <= stamp <= hi:
                        out.append((stamp, f"{stamp} {region} {line.get('message', '')}"[:300]))
    out.sort()
    shown = [text for _, text in out[:cap]]
    return f"\nthe agents around {at_ms} (±{around_ms} ms):\n  " + "\n  ".join(shown) if shown else ""


async def assert_served_on_uk(w: AgentWorld, host: str, move_id: str, runner_deaths: int = 0) -> None:
    """The checks of §14.4 after the move, on the real boxes: the key verifies, every timer ran exactly once
    around the cut, every acknowledged write and background row (either box's) is in uk's database, and nothing
    of the host is left live in ie; uk takes writes; the audit of the host's history is clean. ``runner_deaths``:
    the agents the test killed (each may leave one repeated timer delivery, applied once by the app)."""
    port = await serving_port(w, "uk", host)
    assert await asyncio.to_thread(post_write, port, "after the move") > 0
    shown = await checks(
        events=w.events, store=w.store, host=host, port=port,
        target_db=instance_dir(w.box_dir("uk") / "data", host) / f"{host}.db",
        ack_logs=ack_logs(w.root / "acks", host, w.labels["ie"], {"uk": w.labels["uk"]}), left_bucket=f"{w.prefix}-ie",
        left_local=[instance_dir(w.box_dir("ie") / "data", host) / f"{host}.db",
                    instance_dir(w.box_dir("ie") / "data", host) / host],
        once_after_ms=ONCE_AFTER_MS, runner_deaths=runner_deaths,
        agent_logs=[a.log for a in w.agents.values()])
    assert all(c.ok for c in shown), "\n".join(c.line() for c in shown) + where_acks_are(w, host)
    assert read_endpoint(w.box_dir("ie"), host) is None
    await audited_clean(w, host)


async def audited_clean(w: AgentWorld, host: str, timeout_s: float = 20.0) -> None:
    """The audit of the host's history is clean, polled: a chore of the close (a park's acknowledgement) may have
    CASed the claim and not published its event yet when the host already serves (the ledger publishes after the
    CAS); an event that never comes still fails, at the deadline."""

    async def clean() -> bool:
        return (await run_audit(w.events, w.ledger, host=host)).clean(strict=True)

    with contextlib.suppress(AssertionError):
        await eventually(clean, f"a clean audit of {host}", timeout_s, every_s=0.5)
    audit = await run_audit(w.events, w.ledger, host=host)
    assert audit.clean(strict=True), [f.line() for f in audit.findings]


async def closed_on_ie(w: AgentWorld, host: str, move_id: str, outcome: str, *, lost_region_park: bool = False
                       ) -> None:
    """The move closed record first as ``outcome`` and the claim serves on ie again with nothing owed (K8); with
    ``lost_region_park``, nothing but the lost target's region park (op ``lost:<move>``, §7.14 item 5)."""

    async def closed() -> bool:
        record = (await w.ledger.read_record(host)).state
        claim = (await w.ledger.read_claim(host)).state
        return (record is not None and record.move is None and record.last_move is not None
                and record.last_move.id == move_id and claim is not None and claim.op.kind == "serving")

    try:
        await eventually(closed, f"the move {move_id} to close {outcome}", 90)
    except AssertionError:
        record, claim = (await w.ledger.read_record(host)).state, (await w.ledger.read_claim(host)).state
        logs = "\n".join(a.output()[-4000:] for a in w.agents.values())
        raise AssertionError(f"not closed; record {record}\nclaim {claim}{await rollbacks(w, host, move_id)}"
                             f"{warnings(w, host)}\n{logs}") from None
    record = (await w.ledger.read_record(host)).state
    claim = (await w.ledger.read_claim(host)).state
    assert record is not None and record.last_move is not None and record.last_move.outcome == outcome
    assert claim is not None and claim.op.exec == w.labels["ie"]
    owed = tuple(o for o in claim.obligations if lost_region_park and o.op == f"lost:{move_id}")
    assert claim.obligations == owed and len(owed) == lost_region_park, claim.obligations


async def still_served_on_ie(w: AgentWorld, host: str, note: str) -> None:
    """A move that did not move: ie takes a write, every acknowledged write is in its database, nothing runs on
    uk, and the audit of the host's history is clean."""
    port = await serving_port(w, "ie", host, timeout_s=60)
    seq = await asyncio.to_thread(post_write, port, note)
    acks = [a for a in read_acks(w.acks(host)) if isinstance(a, RowAck)]
    assert acks[-1].seq == seq
    assert missing_from_db(instance_dir(w.box_dir("ie") / "data", host) / f"{host}.db", list(acks)) == []
    assert read_endpoint(w.box_dir("uk"), host) is None, "nothing runs on the target"
    audit = await run_audit(w.events, w.ledger, host=host)
    assert audit.clean(strict=True), [f.line() for f in audit.findings]


@pytest.mark.asyncio(loop_scope="session")
async def test_agents_carry_out_a_move_on_events(stack: StackInfo, unique: Callable[[str], str],
                                                 shared: tuple[S3Store, NatsEventLog, str], tmp_path: Path) -> None:
    store, events, prefix = shared
    async with agent_world(stack, unique, tmp_path, prefix, store=store, events=events, app_env=APP) as w:
        host = f"{unique('svc')}.example.com"
        await create_and_write(w, host)
        move_id = await request_move(w, host)
        await moved(w, host, move_id)
        await assert_served_on_uk(w, host, move_id)
        rcs = w.stop()
    assert rcs == {"ie": 0, "uk": 0}, (rcs, w.agents["uk"].output()[-2000:])
    for region in w.labels:  # nothing left running: every leaf of the box (of this deployment) is gone
        group = w.box_group(region)
        assert group is None or not group.exists() or not any(p.is_dir() for p in group.iterdir())


@pytest.mark.asyncio(loop_scope="session")
async def test_a_new_agent_process_is_a_new_session(stack: StackInfo, unique: Callable[[str], str],
                                                    shared: tuple[S3Store, NatsEventLog, str],
                                                    tmp_path: Path) -> None:
    """SIGKILL the agent under a writing app, five times in a row, its disk intact: each restarted agent stops the app
    it finds, flushes what the app committed and re-admits it (a new session, a new generation); the flush of the
    intact disk certifies the killed session (issue 16 item 5), so no session is declared lost, and every write
    acknowledged before is served after."""
    store, events, prefix = shared
    async with agent_world(stack, unique, tmp_path, prefix, store=store, events=events) as w:
        host = f"{unique('sess')}.example.com"
        await create_and_write(w, host)
        agent = w.agents["ie"]
        for kill in range(5):
            before = (await w.ledger.read_claim(host)).state
            assert before is not None and before.holder is not None
            port = await serving_port(w, "ie", host, newer_than=before.holder.session - 1)
            writing = asyncio.ensure_future(asyncio.gather(*(asyncio.to_thread(post_write, port, f"k{kill}-{i}")
                                                             for i in range(3))))
            await asyncio.sleep(0.05)
            assert agent.proc is not None
            os.kill(agent.proc.pid, 9)
            agent.proc.wait()
            with contextlib.suppress(Exception):  # a write in flight at the kill may go unanswered: never counted
                await writing
            agent.start()
            old_session = before.holder.session

            async def readmitted(old_session: int = old_session) -> bool:
                claim = (await w.ledger.read_claim(host)).state
                return claim is not None and claim.holder is not None and claim.holder.session > old_session

            await eventually(readmitted, f"a new admission after the agent's restart {kill + 1}")
            after = (await w.ledger.read_claim(host)).state
            assert after is not None and after.holder is not None
            assert after.holder.generation != before.holder.generation, "a cold admission opens a new generation"
            port = await serving_port(w, "ie", host, newer_than=before.holder.session)
            seq = await asyncio.to_thread(post_write, port, f"after restart {kill + 1}")
            acks = [a for a in read_acks(w.acks(host)) if isinstance(a, RowAck)]
            missing = missing_from_db(instance_dir(w.box_dir("ie") / "data", host) / f"{host}.db", list(acks))
            assert acks[-1].seq == seq and missing == [], missing[:3]
            declared = [a for a in after.holder.admissions if a.writes_lost is not None or a.additional_writes_lost]
            assert declared == [], f"restart {kill + 1}: a session was declared lost: {declared}"


@pytest.mark.asyncio(loop_scope="session")
async def test_a_runner_killed_after_a_delivery_repeats_it_once(stack: StackInfo, unique: Callable[[str], str],
                                                                shared: tuple[S3Store, NatsEventLog, str],
                                                                tmp_path: Path) -> None:
    """The timer runner delivers at least once (§9.4): SIGKILL the agent after the app answered a delivery and
    before the runner's bookkeeping; the restarted agent delivers that due time again under the same delivery id,
    the app applies it once and counts the repeat, and the §14.4 timer check allows exactly the one repeat the
    death explains."""
    store, events, prefix = shared
    async with agent_world(stack, unique, tmp_path, prefix, store=store, events=events, app_env=APP,
                           extra={"ie": {ENV: "timer:after_delivery@1"}}) as w:
        host = f"{unique('rpt')}.example.com"
        await create_host(w.ledger, host, box=w.labels["ie"], region="ie", incarnation=new_incarnation(SystemRandom()),
                          app=w.app)
        agent = w.agents["ie"]

        async def died() -> bool:
            return not agent.alive()

        await eventually(died, "the agent's death after its first timer delivery", 30)
        assert agent.proc is not None and agent.proc.wait() == -9, agent.output()[-2000:]
        agent.start()  # the same box, a new process, no failpoint

        async def repeated() -> tuple[int, dict[str, list[dict[str, object]]]] | None:
            port = read_endpoint(w.box_dir("ie"), host)  # the restarted agent restarts the app: a new endpoint
            try:
                body = None if port is None else await asyncio.to_thread(get_json, port, "/timers/runs")
            except OSError:
                return None
            return (port, body) if port is not None and body is not None and body["repeats"] else None

        port, body = await eventually(repeated, "the due time the dead runner delivered, delivered again", 60)
        (repeat,) = body["repeats"]
        first = [r for r in body["runs"] if r["delivery"] == repeat["delivery"]]
        assert len(first) == 1 and first[0]["run"] == repeat["run"], (repeat, body["runs"])
        now = int(time.time() * 1000)
        strict = timers_once(port, cut_at_ms=None, now_ms=now, once_due_ms=None)
        assert not strict.ok and "repeated" in strict.detail, strict.line()
        allowed = timers_once(port, cut_at_ms=None, now_ms=now, once_due_ms=None, repeats_allowed=1)
        assert allowed.ok, allowed.line()
        slot = (str(repeat["name"]), int(str(repeat["due_at_ms"])))
        explained = timers_once(port, cut_at_ms=None, now_ms=now, once_due_ms=None, unanswered=frozenset({slot}))
        assert explained.ok, explained.line()
        other = frozenset({(slot[0], slot[1] + 1)})
        assert not timers_once(port, cut_at_ms=None, now_ms=now, once_due_ms=None, unanswered=other).ok


def test_unanswered_deliveries_are_read_from_the_runner_log(tmp_path: Path) -> None:
    """The runner's own log names each delivery it saw no answer to (its outcome unknown): only those, of the host."""
    log = tmp_path / "agent.log"
    line = {"logger": "hostmove.box.timers", "message": "timer periodic of a.example: delivery failed (no answer)",
            "host": "a.example", "phase": "timer", "reason": "no answer", "timer": "periodic", "due_at": 1200}
    log.write_text("\n".join([json.dumps(line), json.dumps({**line, "host": "b.example", "due_at": 7}),
                              json.dumps({**line, "reason": "HTTP 503", "due_at": 9}), "not json {\"no answer\"",
                              json.dumps({**line, "due_at": 1600})]) + "\n")
    got = unanswered_deliveries([log, tmp_path / "missing.log"], "a.example")
    assert got == frozenset({("periodic", 1200), ("periodic", 1600)})


@pytest.mark.asyncio(loop_scope="session")
async def test_an_aborted_move_closes_and_the_source_keeps_serving(stack: StackInfo, unique: Callable[[str], str],
                                                                   shared: tuple[S3Store, NatsEventLog, str],
                                                                   tmp_path: Path) -> None:
    """§7.11 on the real stack: a manual-cut move waits ready; the operator aborts it at the door; the two agents
    park the staging lane (the target's obligation) and the source's snapshots, close the record first
    (``last_move = aborted``) and release the claim to ``serving`` on the source. The instance never stopped: every
    acknowledged write is still served on ie and it takes writes; nothing is left in the staging lane."""
    store, events, prefix = shared
    async with agent_world(stack, unique, tmp_path, prefix, store=store, events=events, app_env=APP) as w:
        host = f"{unique('abt')}.example.com"
        await create_and_write(w, host)
        door = Door(w.ledger, clock=WallClock(), rng=SystemRandom())
        asked = await door.request_move(host, MoveRequest("uk", "manual"), Identity("op", "operator"))
        assert asked.status in (200, 201), asked.body
        move_id = str(asked.body["move"]["id"])

        async def ready() -> bool:
            record = (await w.ledger.read_record(host)).state
            return record is not None and record.move is not None and record.move.state == "ready"

        await eventually(ready, "the manual-cut move to be ready", 60)
        lane = f"moves/{host}/{move_id}/"
        assert await w.store.list_keys(f"{w.prefix}-uk", lane), "the rounds staged into the target's lane"
        aborted = await door.abort(host, Identity("op", "operator"))
        assert aborted.status == 200, aborted.body

        await closed_on_ie(w, host, move_id, "aborted")
        assert await w.store.list_keys(f"{w.prefix}-uk", lane) == [], "the staging lane is parked"
        await still_served_on_ie(w, host, "after the abort")


@pytest.mark.asyncio(loop_scope="session")
async def test_a_cut_past_its_deadline_reverts_to_the_source(stack: StackInfo, unique: Callable[[str], str],
                                                             shared: tuple[S3Store, NatsEventLog, str],
                                                             tmp_path: Path) -> None:
    """§7.4 ``reverting`` on the real stack: the source's agent dies by SIGKILL right after journaling
    ``stopping`` and comes back only after the cut's deadline. The restarted agent does not go on with the cut:
    it records the revert, takes the stop evidence under a ``restoring`` hold, starts the instance again on ie (a
    new admission), opens it, and once the target has parked its staging lane the move closes record first as
    ``rolled_back`` and the claim serves on ie. Every acknowledged write is served on ie; the audit is clean."""
    store, events, prefix = shared
    async with agent_world(stack, unique, tmp_path, prefix, store=store, events=events, app_env=APP,
                           extra={"ie": {ENV: "after_cas:record:cut-stopping@1"}}) as w:
        host = f"{unique('rev')}.example.com"
        await create_and_write(w, host)
        move_id = await request_move(w, host)
        agent = w.agents["ie"]

        async def died() -> bool:
            return not agent.alive()

        await eventually(died, "the source agent's death after journaling stopping", 60)
        assert agent.proc is not None and agent.proc.wait() == -9, agent.output()[-2000:]

        async def past_deadline() -> bool:
            record = (await w.ledger.read_record(host)).state
            move = record.move if record is not None else None
            assert move is not None and move.cut_phase == "stopping", move
            return move.cut_deadline is not None and time.time() * 1000 > move.cut_deadline + 500

        await eventually(past_deadline, "the cut's deadline to pass while the source is down", 60)
        agent.start()

        await closed_on_ie(w, host, move_id, "rolled_back")
        assert await w.store.list_keys(f"{w.prefix}-uk", f"moves/{host}/{move_id}/") == []
        assert await w.store.list_keys(f"{w.prefix}-ie", f"move-snapshots/{host}/{move_id}/") == []
        await still_served_on_ie(w, host, "after the revert")


@pytest.mark.asyncio(loop_scope="session")
async def test_a_target_that_will_not_start_rolls_back_to_the_source(stack: StackInfo, unique: Callable[[str], str],
                                                                     shared: tuple[S3Store, NatsEventLog, str],
                                                                     tmp_path: Path) -> None:
    """§7.8, the clean return, on the real stack: the app fails its readiness in uk (before writing), so the
    landing's probe fails after the flip and the target records the rollback. The target stops its probe, gives its
    stop evidence and releases clean (exec to none); the source takes execution back citing it, verifies its files
    and timers, starts the instance again (a ``clean-return`` admission: nothing declared lost) and opens; the target
    parks what it released; the move closes record first as ``rolled_back`` and the claim serves on ie. Every
    acknowledged write is served on ie; the audit is clean."""
    store, events, prefix = shared
    async with agent_world(stack, unique, tmp_path, prefix, store=store, events=events,
                           app_env={**APP, "MOVEPROBE_FAIL_READY_IN": "uk"}) as w:
        host = f"{unique('rb')}.example.com"
        await create_and_write(w, host)
        move_id = await request_move(w, host)
        await closed_on_ie(w, host, move_id, "rolled_back")
        record = (await w.ledger.read_record(host)).state
        claim = (await w.ledger.read_claim(host)).state
        assert record is not None and claim is not None and claim.holder is not None
        admission = claim.holder.admissions[-1]
        assert admission.box == w.labels["ie"] and admission.writes_lost is None, admission
        assert await w.store.list_keys(f"{w.prefix}-uk", f"moves/{host}/{move_id}/") == []
        assert await w.store.list_keys(f"{w.prefix}-uk", claim.holder.location) == [], "the target parked it all"
        assert await w.store.list_keys(f"{w.prefix}-ie", f"move-snapshots/{host}/{move_id}/") == []
        await still_served_on_ie(w, host, "after the rollback")


def test_the_edge_table_never_names_an_instance_whose_route_is_held(tmp_path: Path) -> None:
    """§5.2: the edge never serves a held row. A landing's probe app runs before the commit under the target's
    ``landing`` hold; naming it in the edge table sent public traffic to the target early (INV-5, found by the
    simulation at move seed 187)."""
    from types import SimpleNamespace

    from kernel.ports import WallClock
    from services.agent.service import BoxAgent
    from services.box.instance.instances import Instance, Instances
    from services.box.instance.registry import Registry, RouteRow

    registry = Registry.open(tmp_path, WallClock())
    instances = Instances()
    probe = Instance("h.example", 4321, 7, "g", "l", replicator=None, origin="probe")  # type: ignore[arg-type]
    instances.enter(probe)
    agent = SimpleNamespace(registry=registry, instances=instances)
    registry.insert(RouteRow(host="h.example", status="ready"))
    assert BoxAgent._endpoint(agent, "h.example") is None, "a probe is never named before the open"  # type: ignore[arg-type]
    instances.hand_over("h.example")
    assert BoxAgent._endpoint(agent, "h.example") == (4321, 7)  # type: ignore[arg-type]
    assert registry.hold("h.example", "landing", "mv_" + "a" * 26)
    assert BoxAgent._endpoint(agent, "h.example") is None  # type: ignore[arg-type]
    assert registry.leave_hold("h.example", "mv_" + "a" * 26)
    assert BoxAgent._endpoint(agent, "h.example") == (4321, 7)  # type: ignore[arg-type]
    registry.close()
