"""A box lost for good, and its replacement under a new label (issue 5 item 1; spec §7.10 "A source terminated",
"The fence reference"; :mod:`services.box.fence`, :mod:`services.recovery.relocation`), on the real stack.

``hostmove box fence --terminated`` kills every process of the box (its cgroup subtree) and records the fence; the
recovery pass moves the box's serving host to ``relocating`` at ``pinning`` (no writer, one alert, no churn while
the region has no box); a replacement box enrolled under a new label is chosen, restores the host from the region's
bucket with a cold admission that declares the fenced session's writes lost, and serves every durable write. The
fenced box can neither run nor register again."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import msgspec
import pytest
import pytest_asyncio

from bus.nats_log import NatsEventLog
from events.claim import Claim, Holder, Op
from events.ids import new_incarnation
from hostmove.access import provision_deployment
from hostmove.probe_apps import post_write
from hostmove.procs import ServiceProc, service_env
from hostmove.stackinfo import StackInfo
from kernel.ports import SystemRandom
from moveprobe.acks import RowAck, missing_from_db, read_acks
from services.agent.service import read_endpoint
from services.box.fence import FenceRef, read_fence
from services.box.instance.sandbox import instance_dir
from services.box.replica.restore import restore_generation
from services.box.roster import RosterRefusal, init_box, read_roster
from services.hosts.create import create_host
from services.ledger import Committed
from services.ledger.ledger import NoChange, Refusal
from services.objstore.s3 import S3Store
from services.recovery.recovery import RecoveryPass
from services.recovery.relocation import (
    decide_fence_host,
    decide_relocation_release,
    decide_relocation_target,
    relocation_id,
)
from tests.helpers.agents import agent_world, answers_ready, audit_settles, data_buckets, drain_box_groups, eventually

HOSTMOVE = [sys.executable, "-m", "hostmove.cli"]


@pytest_asyncio.fixture(loop_scope="session", scope="module")
async def shared(stack: StackInfo, unique: Callable[[str], str]) -> AsyncIterator[tuple[S3Store, NatsEventLog, str]]:
    async with data_buckets(stack, unique, "rel") as s:
        yield s


def written(db: Path, acks: list[RowAck]) -> set[int]:
    missing = {a.seq for a in missing_from_db(db, list(acks)) if isinstance(a, RowAck)}
    return {a.seq for a in acks} - missing


@pytest.mark.asyncio(loop_scope="session")
async def test_a_fenced_box_hands_its_host_to_a_replacement_under_a_new_label(
        stack: StackInfo, unique: Callable[[str], str], shared: tuple[S3Store, NatsEventLog, str],
        tmp_path: Path) -> None:
    store, events, prefix = shared
    async with agent_world(stack, unique, tmp_path, prefix, store=store, events=events) as w:
        lost, bucket = w.labels["ie"], f"{prefix}-ie"
        host = f"{unique('lost')}.example.com"
        created = await create_host(w.ledger, host, box=lost, region="ie", incarnation=new_incarnation(SystemRandom()))
        assert isinstance(created, Committed), created

        async def serving_on(box: str) -> int | None:
            return read_endpoint(w.root / "boxes" / box, host)

        port = await eventually(lambda: serving_on(lost), f"{host} served on {lost}", 30)
        seqs = [await asyncio.to_thread(post_write, port, f"v{i}") for i in range(6)]
        acks = [a for a in read_acks(w.acks(host)) if isinstance(a, RowAck)]
        assert [a.seq for a in acks] == seqs
        before = (await w.ledger.read_claim(host)).state
        assert before is not None and before.holder is not None
        scratch = tmp_path / "durable.db"

        async def uploaded() -> bool:  # every acknowledged write is in the bucket: nothing is only on the lost box
            scratch.unlink(missing_ok=True)
            assert before is not None and before.holder is not None
            await restore_generation(store, bucket, before.holder.location, before.holder.generation, scratch)
            return written(scratch, acks) == set(seqs)

        await eventually(uploaded, "the acknowledged writes to reach the bucket", 30)

        env = service_env(stack, root=w.root, bucket=w.deploy, extra={  # the operator's command: the admin's keys
            "HOSTMOVE_DATA_BUCKET_PREFIX": prefix, "HOSTMOVE_CREDENTIALS": stack.credentials})
        refused = await asyncio.to_thread(subprocess.run, [*HOSTMOVE, "box", "fence", "--label", lost], env=env,
                                          capture_output=True, text=True, timeout=60)
        assert refused.returncode == 2 and "pass --terminated to confirm" in refused.stderr
        assert await read_fence(store, w.deploy, lost) is None, "an unconfirmed fence records nothing"
        fenced = await asyncio.to_thread(subprocess.run, [*HOSTMOVE, "box", "fence", "--label", lost, "--terminated"],
                                         env=env, capture_output=True, text=True, timeout=60)
        assert fenced.returncode == 0, fenced.stderr
        assert "every process of box" in fenced.stdout
        agent = w.agents["ie"]
        assert agent.proc is not None and agent.proc.wait(10) != 0, "the fence killed the box's agent"
        assert not await asyncio.to_thread(answers_ready, port), "the fence killed the instance"

        recovery = RecoveryPass(w.ledger, w.events)
        report = await recovery.run_once()
        pinned = (await w.ledger.read_claim(host)).state
        assert pinned is not None and pinned.holder is not None
        assert (pinned.op.kind, pinned.op.phase, pinned.op.exec) == ("relocating", "pinning", "none")
        assert pinned.holder.generation == before.holder.generation and pinned.holder.stamp == before.holder.stamp
        assert [b.box for b in pinned.lost] == [lost]
        assert any("relocation-waiting-for-box" in a for a in report.alerts), report
        again = await recovery.run_once()
        assert again.alerts == [] and (await w.ledger.read_claim(host)).state == pinned, "no churn, one alert"

        restart = ServiceProc.serve("box", agent.env, tmp_path / "fenced-again.log", "--label", lost)
        restart.start()
        assert restart.proc is not None and restart.proc.wait(60) == 2
        assert "was fenced" in restart.output() and "never acts again" in restart.output()
        with pytest.raises(RosterRefusal, match="fenced"):
            await init_box(root=w.root, label=lost, region="ie", store=store, bucket=w.deploy, events=events,
                           clock=w.ledger.clock, actor=w.ledger.actor)

        replacement = unique("ie")
        await init_box(root=w.root, label=replacement, region="ie", store=store, bucket=w.deploy, events=events,
                       clock=w.ledger.clock, actor=w.ledger.actor)
        await asyncio.to_thread(provision_deployment, stack, w.root, deployment_bucket=w.deploy,
                                data_prefix=prefix)  # the replacement's own identity, as `hostmove box init` makes it
        new_agent = ServiceProc.serve("box", agent.env, tmp_path / f"agent-{replacement}.log", "--label", replacement)
        new_agent.start()
        try:
            await recovery.run_once()
            chosen = (await w.ledger.read_claim(host)).state
            assert chosen is not None and (chosen.op.phase, chosen.op.exec) in (
                ("installing", replacement), ("", replacement))

            async def served_there() -> int | None:
                claim = (await w.ledger.read_claim(host)).state
                if claim is None or claim.op.kind != "serving" or claim.op.exec != replacement:
                    return None
                return await serving_on(replacement)

            try:
                new_port = await eventually(served_there, f"{host} serving on {replacement}", 60)
            except AssertionError:
                raise AssertionError(new_agent.output()[-3000:]) from None
            after = (await w.ledger.read_claim(host)).state
            assert after is not None and after.holder is not None
            admission = after.holder.admissions[-1]
            assert admission.box == replacement and admission.region == "ie"
            assert admission.writes_lost is not None and admission.writes_lost.box == lost, \
                "the fenced box's session is declared: it had no clean close"
            served_db = instance_dir(w.root / "boxes" / replacement / "data", host) / f"{host}.db"
            assert missing_from_db(served_db, list(acks)) == [], "every durable write serves on the replacement"
            assert await asyncio.to_thread(post_write, new_port, "after the relocation") > seqs[-1]
            await audit_settles(w.events, w.ledger, host)
            roster, _ = await read_roster(store, w.deploy)
            entry = roster.box(lost) if roster is not None else None
            assert entry is not None and entry.fenced_at is not None
        finally:
            new_agent.stop()
            drain_box_groups(replacement, w.deployment)


# -- the deciders (pure) ---------------------------------------------------------------------------------------

REF = FenceRef(label="ie-1", enrollment="fp@1", key="control/box-fences/ie-1.json", sha256="ab" * 32)


def serving(exec_: str = "ie-1") -> Claim:
    return Claim(host="h.example", gen=4, holder=Holder(incarnation="i1", location="loc1", generation="g1", stamp=3,
                                                         session=3, writer_box=exec_),
                 op=Op(kind="serving", exec=exec_))


def test_only_a_serving_host_of_the_fenced_box_is_pinned_and_replays_change_nothing() -> None:
    out = decide_fence_host(serving(), REF, "ie", 100)
    assert isinstance(out, Claim)
    assert (out.op.kind, out.op.phase, out.op.exec, out.op.id) == ("relocating", "pinning", "none", relocation_id(REF))
    assert out.op.journal == {"fence.ie-1": REF.journal()} and out.holder == serving().holder
    assert isinstance(decide_fence_host(out, REF, "ie", 200), NoChange)
    assert isinstance(decide_fence_host(serving("ie-2"), REF, "ie", 100), NoChange)
    moving = msgspec.structs.replace(serving(), op=Op(kind="moving", id="mv-1", exec="ie-1",
                                                      participants=("ie-1", "uk-1")))
    assert isinstance(decide_fence_host(moving, REF, "ie", 100), Refusal)


def test_the_replacement_is_chosen_from_pinning_and_released_only_after_its_admission() -> None:
    pinned = decide_fence_host(serving(), REF, "ie", 100)
    assert isinstance(pinned, Claim)
    lost_box = decide_relocation_target(pinned, pinned.op.id, "ie-1", "ie")
    assert isinstance(lost_box, Refusal), "a lost box is never chosen"
    installing = decide_relocation_target(pinned, pinned.op.id, "ie-2", "ie")
    assert isinstance(installing, Claim) and (installing.op.phase, installing.op.exec) == ("installing", "ie-2")
    assert "ie-2" in installing.touched.boxes and "ie" in installing.touched.regions
    assert isinstance(decide_relocation_target(installing, pinned.op.id, "ie-3", "ie"), NoChange)
    assert isinstance(decide_relocation_release(installing, pinned.op.id, "ie-2"), Refusal), "not admitted yet"
    assert installing.holder is not None
    admitted = msgspec.structs.replace(installing, holder=msgspec.structs.replace(installing.holder,
                                                                                   writer_box="ie-2", session=6))
    released = decide_relocation_release(admitted, pinned.op.id, "ie-2")
    assert isinstance(released, Claim) and released.op == Op(kind="serving", exec="ie-2")
    assert released.lost == pinned.lost

