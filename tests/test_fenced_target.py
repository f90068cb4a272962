"""A move's target fenced after the record's commit (spec §7.10 L14, issue 15 item 3), on the real stack: box agents
as processes, real NATS, SeaweedFS and cgroup v2.

The target agent dies right after its commit CAS (a failpoint), its probe's instance still running and writing. The
target's machine is terminated through the ``local`` compute port and fenced (``hostmove box fence``). With no
operator, the console's recovery pass closes the move without the dead target (``last_move = done``, its open waived
and its staging park left to the region's sweep, citing the fence), the serving host of the fenced box is pinned
(``relocating`` at ``pinning``) and waits with one alert while uk has no live box; a replacement box enrolls and the
host serves there with every acknowledged write except the fenced session's declared losses. Then it moves back."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
import pytest_asyncio

from bus.nats_log import NatsEventLog
from bus.subjects import FACTS_STREAM, alert_subject
from events.claim import Claim, Holder, Obligation, Op, Scope
from events.record import Move, Record
from hostmove.access import provision_deployment
from hostmove.probe_apps import post_write
from hostmove.procs import ServiceProc
from hostmove.rehearsal import ack_logs, declared_losses, nothing_missing
from hostmove.stackinfo import StackInfo
from kernel.failpoints import ENV
from kernel.ports import SystemRandom, WallClock
from moveprobe.acks import read_acks
from services.agent.service import read_endpoint
from services.agent.sides import stage_of
from services.box.fence import FenceRef, read_fence
from services.box.instance.sandbox import instance_dir
from services.box.roster import init_box
from services.door.api import Door
from services.door.auth import Identity
from services.door.decide import MoveRequest
from services.ledger.ledger import NoChange, Refusal
from services.move.fenced_target import decide_fenced_target_claim, decide_fenced_target_record, open_waived
from services.move.finalize import decide_close
from services.move.follow import staging_lane
from services.objstore.s3 import S3Store
from services.recovery.recovery import RecoveryPass
from tests.helpers.agents import agent_world, answers_ready, audit_settles, data_buckets, drain_box_groups, eventually
from tests.test_agent import APP, create_and_write, request_move
from tests.test_declare_lost import cli


@pytest_asyncio.fixture(loop_scope="session", scope="module")
async def shared(stack: StackInfo, unique: Callable[[str], str]) -> AsyncIterator[tuple[S3Store, NatsEventLog, str]]:
    async with data_buckets(stack, unique, "ftc") as s:
        yield s


@pytest.mark.asyncio(loop_scope="session")
async def test_a_target_fenced_after_the_commit_closes_the_move_and_the_host_is_relocated_in_its_region(
        stack: StackInfo, unique: Callable[[str], str], shared: tuple[S3Store, NatsEventLog, str],
        tmp_path: Path) -> None:
    store, events, prefix = shared
    async with agent_world(stack, unique, tmp_path, prefix, store=store, events=events, app_env=APP,
                           extra={"uk": {ENV: "after_cas:record:commit"}}) as w:
        host = f"{unique('fc')}.example.com"
        ie, uk = w.labels["ie"], w.labels["uk"]
        started = time.monotonic()
        await create_and_write(w, host)
        move_id = await request_move(w, host)
        target = w.agents["uk"]

        async def died() -> bool:
            return not target.alive()

        await eventually(died, "the target's death right after its commit CAS", 150)
        committed = (await w.ledger.read_record(host)).state
        assert committed is not None and committed.move is not None and committed.move.state == "committed"
        assert committed.move.opened_at is None, "the target died before it opened"
        at_death = len(read_acks(w.acks(host, "uk"), host=host))

        async def wrote_on() -> bool:  # the probe's instance writes on beside its dead agent: never uploaded
            return len(read_acks(w.acks(host, "uk"), host=host)) > at_death

        await eventually(wrote_on, "the target's instance acknowledging writes after its agent died", 30)
        fenced = await cli(stack, w, "http://127.0.0.1:9", "box", "fence", "--label", uk, "--terminated")
        assert fenced.returncode == 0 and "terminated" in fenced.stdout, fenced
        fenced_at = time.monotonic()
        got = await read_fence(store, w.deploy, uk)
        assert got is not None
        _fence, ref = got

        assert await store.list_keys(f"{prefix}-uk", staging_lane(host, move_id)), "the lane the target owed a park"
        recovery = RecoveryPass(w.ledger, w.events)
        alerts: list[str] = []

        async def pinned() -> Claim | None:
            report = await recovery.run_once()
            alerts.extend(report.alerts)
            assert not any("fenced-box-in-operation" in a for a in report.alerts), report
            claim = (await w.ledger.read_claim(host)).state
            return claim if claim is not None and claim.op.kind == "relocating" else None

        try:
            claim = await eventually(pinned, "the move closed without its target and the host pinned", 150, 0.5)
        except AssertionError:
            logs = w.agents["ie"].output()[-4000:]
            raise AssertionError(f"{(await w.ledger.read_record(host)).state}\n"
                                 f"{(await w.ledger.read_claim(host)).state}\n{logs}") from None
        closed_s = time.monotonic() - fenced_at
        record = (await w.ledger.read_record(host)).state
        assert record is not None and record.move is None and record.last_move is not None
        assert (record.last_move.id, record.last_move.outcome) == (move_id, "done")
        assert (claim.op.phase, claim.op.exec) == ("pinning", "none")
        assert claim.op.journal[f"fence.{uk}"] == ref.journal()
        assert [b.box for b in claim.lost] == [uk] and claim.obligations == ()
        assert any("fenced-target-after-commit" in a for a in alerts), alerts
        assert any("relocation-waiting-for-box" in a for a in alerts), alerts
        subject = alert_subject("fenced-target-after-commit")
        said = [m.data async for m in w.events.replay(FACTS_STREAM, subject=subject)]
        assert any(host.encode() in d and b"was fenced (gone for good) after the move committed" in d for d in said)
        again = await recovery.run_once()
        assert again.alerts == [] and again.errors == [] and (await w.ledger.read_claim(host)).state == claim

        replacement = unique("uk")
        await init_box(root=w.root, label=replacement, region="uk", store=store, bucket=w.deploy, events=events,
                       clock=w.ledger.clock, actor=w.ledger.actor)
        await asyncio.to_thread(provision_deployment, stack, w.root, deployment_bucket=w.deploy, data_prefix=prefix)
        env = {k: v for k, v in w.agents["uk"].env.items() if k != ENV}
        new_agent = ServiceProc.serve("box", env, tmp_path / f"agent-{replacement}.log", "--label", replacement)
        new_agent.start()
        try:
            async def served_there() -> int | None:
                await recovery.run_once()
                claim = (await w.ledger.read_claim(host)).state
                if claim is None or claim.op.kind != "serving" or claim.op.exec != replacement:
                    return None
                port = read_endpoint(w.root / "boxes" / replacement, host)
                return port if port is not None and await asyncio.to_thread(answers_ready, port) else None

            try:
                port = await eventually(served_there, f"{host} serving on {replacement}", 120, 0.5)
            except AssertionError:
                raise AssertionError(new_agent.output()[-3000:]) from None
            relocated_s = time.monotonic() - fenced_at
            claim = (await w.ledger.read_claim(host)).state
            assert claim is not None and claim.holder is not None
            admitted = claim.holder.admissions[-1]
            assert admitted.box == replacement and admitted.writes_lost is not None
            assert admitted.writes_lost.box == uk, "the fenced session's writes since its last upload are declared"
            declared = await declared_losses(w.events, host)
            logs = ack_logs(w.root / "acks", host, ie, {"uk": uk})
            served_db = instance_dir(w.root / "boxes" / replacement / "data", host) / f"{host}.db"
            check = nothing_missing(served_db, logs, host, declared)
            assert check.ok, check.line()
            print(f"\nfenced target: {check.detail}")
            last = await asyncio.to_thread(post_write, port, "on the replacement")
            lane = staging_lane(host, move_id)

            async def lane_swept() -> bool:  # the fenced target's staging park, done by uk's sweep (sweep-staging)
                return await store.list_keys(f"{prefix}-uk", lane) == []

            await eventually(lane_swept, f"the staging lane {lane} parked by {replacement}'s at-rest sweep", 60, 0.5)
            await audit_settles(w.events, w.ledger, host)

            # the sequence works again: the host moves back to ie
            door = Door(w.ledger, clock=WallClock(), rng=SystemRandom())

            async def accepted() -> str | None:
                answer = await door.request_move(host, MoveRequest("ie", "auto"), Identity("op", "operator"))
                return str(answer.body["move"]["id"]) if answer.status in (200, 201) else None

            back_id = await eventually(accepted, "the move back accepted (the at-rest sweeps done first)", 90, 1.0)

            async def back_on_ie() -> bool:
                await recovery.run_once()
                record = (await w.ledger.read_record(host)).state
                claim = (await w.ledger.read_claim(host)).state
                return (record is not None and record.move is None and record.last_move is not None
                        and record.last_move.id == back_id and record.last_move.outcome == "done"
                        and claim is not None and claim.op.kind == "serving" and claim.op.exec == ie)

            try:
                await eventually(back_on_ie, "the move back to ie closed as done", 180, 1.0)
            except AssertionError:
                raise AssertionError(f"{(await w.ledger.read_record(host)).state}\n"
                                     f"{new_agent.output()[-3000:]}\n{w.agents['ie'].output()[-3000:]}") from None
            async def served_on_ie() -> int | None:  # the endpoint is published by the pass after the open
                port = read_endpoint(w.box_dir("ie"), host)
                return port if port is not None and await asyncio.to_thread(answers_ready, port) else None

            ie_port = await eventually(served_on_ie, f"{host} served on ie after the move back", 60, 0.5)
            assert await asyncio.to_thread(post_write, ie_port, "back on ie") > last
            logs = ack_logs(w.root / "acks", host, ie, {"uk": uk, "uk2": replacement})
            check = nothing_missing(instance_dir(w.box_dir("ie") / "data", host) / f"{host}.db", logs, host,
                                    await declared_losses(w.events, host))
            assert check.ok, check.line()
            await audit_settles(w.events, w.ledger, host)
            print(f"figures: closed and pinned {closed_s:.1f} s after the fence, serving on the replacement "
                  f"{relocated_s:.1f} s after it, the whole test {time.monotonic() - started:.1f} s")
        finally:
            new_agent.stop()
            drain_box_groups(replacement, w.deployment)


REF = FenceRef(label="uk-1", enrollment="fp@1", key="control/box-fences/uk-1.json", sha256="ab" * 32)


def _world(state: str = "committed", phase: str = "committed", opened: int | None = None) -> tuple[Claim, Record]:
    holder = Holder(incarnation="i1", location="instances/h/i1", generation="g1", stamp=3, session=4,
                    writer_box="uk-1")
    scope = Scope(location="instances/h/i1", incarnation="i1", evidence_at=5)
    owed = (Obligation(kind="park-superseded", op="mv-1", region="ie", owner="ie-1", scope=scope),
            Obligation(kind="park-staging", op="mv-1", region="uk", owner="uk-1", scope=scope),
            Obligation(kind="park-local", op="mv-1", region="uk", owner="uk-1"),
            Obligation(kind="park-generation", op="g0", region="uk", owner="uk-1"))
    claim = Claim(host="h.example", gen=7, holder=holder, obligations=owed, op=Op(
        kind="landing", id="mv-1", phase=phase, exec="uk-1", participants=("ie-1", "uk-1"), journal={"a": 1}))
    record = Record(host="h.example", gen=3, move=Move(id="mv-1", incarnation="i1", to="uk", state=state,  # type: ignore[arg-type]
                                                       from_="ie", committed_at=5, opened_at=opened))
    return claim, record


def test_the_fenced_target_after_the_commit_decider() -> None:
    """Pure: record first (the fence key, the open waived), then the claim (the fence cited, the target on lost, its
    chores of this move dropped and nothing else), then the close without ``opened_at`` once the source parked;
    refused before the commit and for a box that is not the target."""
    claim, record = _world()
    assert isinstance(decide_fenced_target_claim(claim, record, REF, 9), Refusal), "record first"
    decided = decide_fenced_target_record(record, claim, REF, 9)
    assert isinstance(decided, Record) and decided.move is not None
    assert decided.move.target_fenced == REF.key and decided.move.opened_at is None
    assert isinstance(decide_fenced_target_record(decided, claim, REF, 10), NoChange)
    assert stage_of(decided, claim, "mv-1")[0] == "finalizing", "the source parks without the target's open"
    assert stage_of(record, claim, "mv-1")[0] == "opening"

    half = decide_fenced_target_claim(claim, decided, REF, 9)
    assert isinstance(half, Claim)
    assert half.op.journal == {"a": 1, "fence.uk-1": REF.journal()} and (half.op.kind, half.op.exec) == (
        "landing", "uk-1")
    assert [(o.kind, o.owner) for o in half.obligations] == [("park-superseded", "ie-1"), ("park-generation", "uk-1")]
    assert [b.box for b in half.lost] == ["uk-1"] and half.holder == claim.holder
    assert isinstance(decide_fenced_target_claim(half, decided, REF, 10), NoChange)
    assert open_waived(decided, half) and not open_waived(decided, claim) and not open_waived(record, half)

    assert isinstance(decide_close(decided, claim, move_id="mv-1", now_ms=11), NoChange)
    assert isinstance(decide_close(decided, half, move_id="mv-1", now_ms=11), NoChange), "the source has not parked"
    from msgspec.structs import replace

    parked = replace(decided, move=replace(decided.move, source_parked_at=10))
    source_done = replace(half, obligations=tuple(o for o in half.obligations if o.kind != "park-superseded"))
    closed = decide_close(parked, source_done, move_id="mv-1", now_ms=12)
    assert isinstance(closed, Record) and closed.move is None and closed.last_move is not None
    assert (closed.last_move.id, closed.last_move.outcome) == ("mv-1", "done")
    unfenced = replace(parked, move=replace(parked.move, target_fenced=""))
    assert isinstance(decide_close(unfenced, source_done, move_id="mv-1", now_ms=12), NoChange), "waits to open"

    other = FenceRef(label="ie-1", enrollment="fp@2", key="control/box-fences/ie-1.json", sha256="cd" * 32)
    assert isinstance(decide_fenced_target_record(record, claim, other, 9), Refusal), "the source is not the target"
    for state in ("landing", "rolling_back"):
        early_claim, early = _world(state, "probing")
        assert isinstance(decide_fenced_target_record(early, early_claim, REF, 9), Refusal), state
    following_claim, following = _world(phase="probing")
    decided = decide_fenced_target_record(following, following_claim, REF, 9)
    assert isinstance(decided, Record)
    assert isinstance(decide_fenced_target_claim(following_claim, decided, REF, 9), Refusal), "follows commit first"
