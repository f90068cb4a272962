"""A source terminated before the flip (spec §7.10 rev 7.20, rule ``fence-converts-moving``; issue 15 item 4), on the
real stack: box agents as processes, real NATS, SeaweedFS and cgroup v2.

A move waits at ``ready`` (a manual cut). The source's machine is terminated and fenced. The console's recovery pass
converts the move in one claim CAS to ``relocating`` at ``pinning`` (exec none, stamp and generation kept, the fence
reference in ``op.journal``) and closes the record ``aborted``; in the one-box region it waits, safe, with one alert
and no churn; a replacement box enrolls and the host serves there with every durable write."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
import pytest_asyncio

from bus.nats_log import NatsEventLog
from events.claim import Claim, Holder, Obligation, Op
from events.record import Move, Record
from hostmove.access import provision_deployment
from hostmove.probe_apps import post_write
from hostmove.procs import ServiceProc
from hostmove.stackinfo import StackInfo
from kernel import rules
from kernel.ports import SystemRandom, WallClock
from moveprobe.acks import RowAck, missing_from_db, read_acks
from services.agent.service import read_endpoint
from services.box.fence import FenceRef, read_fence
from services.box.instance.sandbox import instance_dir
from services.box.replica.restore import restore_generation
from services.box.roster import init_box
from services.door.api import Door
from services.door.auth import Identity
from services.door.decide import MoveRequest
from services.ledger.ledger import NoChange, Refusal
from services.objstore.s3 import S3Store
from services.recovery.recovery import RecoveryPass
from services.recovery.relocation import decide_converted_record, decide_fence_converts_moving
from tests.helpers.agents import agent_world, audit_settles, data_buckets, drain_box_groups, eventually
from tests.test_agent import APP, create_and_write
from tests.test_declare_lost import cli


@pytest_asyncio.fixture(loop_scope="session", scope="module")
async def shared(stack: StackInfo, unique: Callable[[str], str]) -> AsyncIterator[tuple[S3Store, NatsEventLog, str]]:
    async with data_buckets(stack, unique, "fsrc") as s:
        yield s


@pytest.mark.asyncio(loop_scope="session")
async def test_a_source_fenced_before_the_flip_becomes_a_relocation_that_waits_for_a_box_then_serves_there(
        stack: StackInfo, unique: Callable[[str], str], shared: tuple[S3Store, NatsEventLog, str],
        tmp_path: Path) -> None:
    store, events, prefix = shared
    async with agent_world(stack, unique, tmp_path, prefix, store=store, events=events, app_env=APP) as w:
        ie = w.labels["ie"]
        host = f"{unique('fs')}.example.com"
        seqs = await create_and_write(w, host)
        door = Door(w.ledger, clock=WallClock(), rng=SystemRandom())
        answer = await door.request_move(host, MoveRequest("uk", "manual"), Identity("alice", "operator"))
        assert answer.status in (200, 201), answer.body

        async def ready() -> bool:
            record = (await w.ledger.read_record(host)).state
            return record is not None and record.move is not None and record.move.state == "ready"

        await eventually(ready, "the move at ready (a manual cut)", 90)
        before = (await w.ledger.read_claim(host)).state
        assert before is not None and before.holder is not None and before.op.kind == "moving"
        acks = [a for a in read_acks(w.acks(host)) if isinstance(a, RowAck)]
        scratch = tmp_path / "durable.db"

        async def uploaded() -> bool:  # what the replacement must serve: every acknowledged write in the bucket
            scratch.unlink(missing_ok=True)
            assert before is not None and before.holder is not None
            await restore_generation(store, f"{prefix}-ie", before.holder.location, before.holder.generation, scratch)
            return missing_from_db(scratch, list(acks)) == []

        await eventually(uploaded, "the acknowledged writes in ie's bucket", 30)
        fenced = await cli(stack, w, "http://127.0.0.1:9", "box", "fence", "--label", ie, "--terminated")
        assert fenced.returncode == 0, fenced
        got = await read_fence(store, w.deploy, ie)
        assert got is not None
        _fence, ref = got

        recovery = RecoveryPass(w.ledger, w.events)
        report = await recovery.run_once()
        pinned = (await w.ledger.read_claim(host)).state
        assert pinned is not None and pinned.holder is not None
        assert (pinned.op.kind, pinned.op.phase, pinned.op.exec, pinned.op.id) == (
            "relocating", "pinning", "none", before.op.id), "one CAS: the move's op id, relocating at pinning"
        assert pinned.op.journal[f"fence.{ie}"] == ref.journal()
        assert (pinned.holder.stamp, pinned.holder.generation) == (before.holder.stamp, before.holder.generation)
        assert pinned.obligations == before.obligations and [b.box for b in pinned.lost] == [ie]
        assert any("relocation-waiting-for-box" in a for a in report.alerts), report
        record = (await w.ledger.read_record(host)).state
        assert record is not None and record.move is None and record.last_move is not None
        assert record.last_move.outcome == "aborted" and record.last_move.id == before.op.id
        again = await recovery.run_once()
        assert again.alerts == [] and (await w.ledger.read_claim(host)).state == pinned, "no churn, one alert"

        replacement = unique("ie")
        await init_box(root=w.root, label=replacement, region="ie", store=store, bucket=w.deploy, events=events,
                       clock=w.ledger.clock, actor=w.ledger.actor)
        await asyncio.to_thread(provision_deployment, stack, w.root, deployment_bucket=w.deploy, data_prefix=prefix)
        new_agent = ServiceProc.serve("box", w.agents["ie"].env, tmp_path / f"agent-{replacement}.log", "--label",
                                      replacement)
        new_agent.start()
        try:
            await recovery.run_once()

            async def served_there() -> int | None:
                claim = (await w.ledger.read_claim(host)).state
                if claim is None or claim.op.kind != "serving" or claim.op.exec != replacement:
                    return None
                return read_endpoint(w.root / "boxes" / replacement, host)

            try:
                port = await eventually(served_there, f"{host} serving on {replacement}", 60)
            except AssertionError:
                raise AssertionError(new_agent.output()[-3000:]) from None
            served_db = instance_dir(w.root / "boxes" / replacement / "data", host) / f"{host}.db"
            assert missing_from_db(served_db, list(acks)) == [], "every durable write serves on the replacement"
            assert await asyncio.to_thread(post_write, port, "after the conversion") > seqs[-1]
            await audit_settles(w.events, w.ledger, host)
        finally:
            new_agent.stop()
            drain_box_groups(replacement, w.deployment)


def test_the_conversion_is_one_cas_before_the_flip_and_refused_after_it() -> None:
    ref = FenceRef(label="ie-1", enrollment="fp@1", key="control/box-fences/ie-1.json", sha256="ab" * 32)
    holder = Holder(incarnation="i1", location="loc1", generation="g1", stamp=3, session=3, writer_box="ie-1")
    owed = (Obligation(kind="park-generation", op="g0", region="ie", owner="ie-1"),)
    moving = Claim(host="h.example", gen=5, holder=holder, obligations=owed,
                   op=Op(kind="moving", id="mv-1", exec="ie-1", participants=("ie-1", "uk-1"), journal={"a": 1}))

    def record(state: str) -> Record:
        return Record(host="h.example", gen=2, move=Move(id="mv-1", incarnation="i1", to="uk", state=state))  # type: ignore[arg-type]

    for state in ("preparing", "ready", "cutting"):
        out = decide_fence_converts_moving(moving, record(state), ref, "ie", 9)
        assert isinstance(out, Claim), out
        assert (out.op.kind, out.op.id, out.op.phase, out.op.exec) == ("relocating", "mv-1", "pinning", "none")
        assert out.op.journal == {"a": 1, "fence.ie-1": ref.journal()} and out.holder == holder
        assert out.obligations == owed and [b.box for b in out.lost] == ["ie-1"]
        assert isinstance(decide_fence_converts_moving(out, record(state), ref, "ie", 10), NoChange)
    for state in ("landing", "committed", "rolling_back"):
        assert isinstance(decide_fence_converts_moving(moving, record(state), ref, "ie", 9), Refusal), state
    assert isinstance(decide_fence_converts_moving(moving, record("ready"), dataclasses.replace(
        ref, label="uk-1"), "uk", 9), NoChange), "a fenced target is not converted"
    with rules.mutated(["fence-converts-moving"]):
        assert isinstance(decide_fence_converts_moving(moving, record("ready"), ref, "ie", 9), Refusal)
    closed = decide_converted_record(record("ready"), "mv-1", "fenced", 11)
    assert isinstance(closed, Record) and closed.move is None and closed.last_move is not None
    assert (closed.last_move.outcome, closed.extra["converted"]) == ("aborted", "fenced")
