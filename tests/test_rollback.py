"""Rollback after the flip on the real stack (spec §7.8, §7.10, §13; issue 13): box agents as processes, real NATS,
SeaweedFS and cgroup v2, the sample app writing throughout.

- **Dirty**: the app commits and acknowledges rows on the target during its probe, then fails its readiness there.
  The target releases dirty and returns its stopped state through the return lane; the source installs it into the
  rollback's own generation and is admitted cold into it: every row either box acknowledged is in the source's
  database, and nothing is declared lost.
- **A target killed after the flip**, never restarted: the source takes the ``landing_deadline`` trigger, the move
  waits in ``rolling_back`` with nothing running anywhere, paged once (durably) past ``release_deadline``; the target
  restarted later releases and the move converges.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
import pytest_asyncio

from bus.nats_log import NatsEventLog
from bus.subjects import FACTS_STREAM, incident_subject
from hostmove.rehearsal import ack_logs, declared_losses, nothing_missing
from hostmove.stackinfo import StackInfo
from kernel.failpoints import ENV
from services.agent.service import read_endpoint
from services.box.instance.sandbox import instance_dir
from services.ledger.audit import run_audit
from services.move.incidents import RELEASE_WAITING
from services.objstore.s3 import S3Store
from services.recovery.recovery import RecoveryPass
from tests.helpers.agents import AgentWorld, agent_world, data_buckets, eventually
from tests.test_agent import APP, closed_on_ie, create_and_write, request_move, serving_port


@pytest_asyncio.fixture(loop_scope="session", scope="module")
async def shared(stack: StackInfo, unique: Callable[[str], str]) -> AsyncIterator[tuple[S3Store, NatsEventLog, str]]:
    async with data_buckets(stack, unique, "rbk") as s:
        yield s


async def every_row_home(w: AgentWorld, host: str) -> None:
    """Every write, background row and timer run either box acknowledged is in ie's database, none exempted by a
    declared loss (§7.8 dirty: the return lane carries the target's writes), and the source's return declared
    nothing (a landing's restarted probe declares its dead attempt's session, §7.14, whose rows it restored: they are
    here all the same); the audit is clean."""
    declared = await declared_losses(w.events, host)
    assert all(d.box == w.labels["uk"] for d in declared), declared
    claim = (await w.ledger.read_claim(host)).state
    assert claim is not None and claim.holder is not None
    assert all(a.writes_lost is None for a in claim.holder.admissions if a.box == w.labels["ie"]), \
        claim.holder.admissions
    logs = ack_logs(w.root / "acks", host, w.labels["ie"], {"uk": w.labels["uk"]})
    check = nothing_missing(instance_dir(w.box_dir("ie") / "data", host) / f"{host}.db", logs, host)
    if not (check.ok and "covered" not in check.detail):
        tails = "\n".join(f"--- {r}\n{a.output()[-6000:]}" for r, a in w.agents.items())
        raise AssertionError(f"{check.line()}\ndeclared losses: {declared}\n{tails}")
    assert read_endpoint(w.box_dir("uk"), host) is None, "nothing runs on the target"
    audit = await run_audit(w.events, w.ledger, host=host)
    assert audit.clean(strict=True), [f.line() for f in audit.findings]


@pytest.mark.asyncio(loop_scope="session")
async def test_a_dirty_rollback_carries_the_targets_writes_home(stack: StackInfo, unique: Callable[[str], str],
                                                                shared: tuple[S3Store, NatsEventLog, str],
                                                                tmp_path: Path) -> None:
    store, events, prefix = shared
    env = {**APP, "MOVEPROBE_FAIL_READY_IN": "uk", "MOVEPROBE_FAIL_READY_WHEN": "after-write"}
    async with agent_world(stack, unique, tmp_path, prefix, store=store, events=events, app_env=env) as w:
        host = f"{unique('dirty')}.example.com"
        await create_and_write(w, host)
        move_id = await request_move(w, host)
        await closed_on_ie(w, host, move_id, "rolled_back")
        record = (await w.ledger.read_record(host)).state
        claim = (await w.ledger.read_claim(host)).state
        assert record is not None and claim is not None and claim.holder is not None
        target_rows = [p for p in (w.root / "acks").glob(f"{host}.uk*.jsonl")
                       if not p.name.endswith(".worker.jsonl") and p.stat().st_size > 0]
        assert target_rows, "the target's probe acknowledged rows (the dirty case)"
        admission = claim.holder.admissions[-1]
        assert admission.box == w.labels["ie"] and admission.writes_lost is None, admission
        assert any(a.generation.startswith("rb_") and a.coverage == "sealed" for a in claim.holder.admissions), \
            claim.holder.admissions
        rb_lane = f"moves/{host}/"
        assert [k for k in await w.store.list_keys(f"{w.prefix}-ie", rb_lane) if "/rb_" in k] == [], \
            "the return lane is parked"
        assert await w.store.list_keys(f"{w.prefix}-uk", claim.holder.location) == [], "the target parked it all"
        port = await serving_port(w, "ie", host, timeout_s=60)
        assert port
        await every_row_home(w, host)


@pytest.mark.asyncio(loop_scope="session")
async def test_a_target_killed_after_the_flip_is_rolled_back_at_its_deadline(
        stack: StackInfo, unique: Callable[[str], str], shared: tuple[S3Store, NatsEventLog, str],
        tmp_path: Path) -> None:
    """The target agent dies by SIGKILL right after the flip's claim half names it (nothing restarts it). The source
    takes the ``landing_deadline`` trigger; without the target's evidence the move waits in ``rolling_back``, safe
    (nothing runs anywhere) and paged once past ``release_deadline``, however often the recovery pass runs and
    restarts; restarted, the target releases and the move converges to ``rolled_back`` on ie."""
    store, events, prefix = shared
    async with agent_world(stack, unique, tmp_path, prefix, store=store, events=events, app_env=APP,
                           extra={"uk": {ENV: "before_effects:checking"}}) as w:
        host = f"{unique('kill')}.example.com"
        await create_and_write(w, host)
        move_id = await request_move(w, host)
        target = w.agents["uk"]

        async def died() -> bool:
            return not target.alive()

        await eventually(died, "the target's death after the flip", 90)

        async def rolling_back() -> bool:
            record = (await w.ledger.read_record(host)).state
            return record is not None and record.move is not None and record.move.state == "rolling_back"

        await eventually(rolling_back, "the source's landing_deadline trigger", 90)
        record = (await w.ledger.read_record(host)).state
        assert record is not None and record.move is not None and record.move.rollback is not None
        rb = record.move.rollback
        assert rb.release_deadline is not None and rb.target_phase == "" and rb.evidence == ""

        async def past_release() -> bool:
            return w.ledger.clock.now_ms() > (rb.release_deadline or 0)

        await eventually(past_release, "the release deadline", 60)
        for _ in range(2):  # the console's pass, restarted: no memory, one incident
            await RecoveryPass(w.ledger, w.events).run_once()
        subject = incident_subject(RELEASE_WAITING, host, f"{move_id}:{rb.release_deadline}")
        incidents = [m async for m in w.events.replay(FACTS_STREAM, subject=subject)]
        assert len(incidents) == 1, incidents
        assert b"Waiting for" in incidents[0].data
        record = (await w.ledger.read_record(host)).state
        assert record is not None and record.move is not None and record.move.state == "rolling_back"
        assert read_endpoint(w.box_dir("ie"), host) is None, "nothing runs on the source while the target owes evidence"
        await asyncio.sleep(0)
        target.start()  # the same box, a new process: it releases and the move converges
        await closed_on_ie(w, host, move_id, "rolled_back")
        port = await serving_port(w, "ie", host, timeout_s=60)
        assert port
        audit = await run_audit(w.events, w.ledger, host=host)
        assert audit.clean(strict=True), [f.line() for f in audit.findings]
