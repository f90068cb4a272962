"""A box declared lost that starts again is quarantined, then readmitted (spec §7.10 "A returning box is
quarantined", claim §7.2; issue 15 item 6), on the real stack: box agents as processes, real NATS, SeaweedFS and
cgroup v2.

The target agent dies right after its probe started the instance on it; the operator stops the box through the
platform and declares it lost; the host rolls back to ie. The lost box still holds its local state of the host (its
database, its route row, its stamps). ``hostmove box readmit`` is refused until the box quarantined itself. Started
again, the box retires every local artifact of the host before anything else and runs nothing of it; readmitted,
it is chosen again: the host moves to it and is served there."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path

import msgspec
import pytest
import pytest_asyncio

from bus.nats_log import NatsEventLog
from events.claim import Claim, Holder, LostBox, Op
from hostmove.stackinfo import StackInfo
from kernel import rules
from kernel.failpoints import ENV
from kernel.ports import ManualClock, SystemRandom, WallClock
from services.agent.service import read_endpoint
from services.box.instance.guard import host_guard
from services.box.instance.registry import Registry
from services.box.instance.sandbox import instance_dir
from services.box.instance.stamps import StampBook
from services.box.instance.timers import Timers
from services.box.quarantine import (
    decide_readmit_claim,
    decide_retired,
    owes_quarantine,
    quarantine,
    quarantine_event,
)
from services.door.api import Door
from services.door.auth import Identity
from services.door.decide import MoveRequest
from services.door.declare import DeclareLost, declare_lost
from services.ledger.ledger import NoChange, Refusal
from services.objstore.s3 import S3Store
from tests.helpers.agents import agent_world, data_buckets, eventually
from tests.test_agent import APP, closed_on_ie, create_and_write, moved, request_move
from tests.test_declare_lost import cli


@pytest_asyncio.fixture(loop_scope="session", scope="module")
async def shared(stack: StackInfo, unique: Callable[[str], str]) -> AsyncIterator[tuple[S3Store, NatsEventLog, str]]:
    async with data_buckets(stack, unique, "qua") as s:
        yield s


@pytest.mark.asyncio(loop_scope="session")
async def test_a_lost_box_that_comes_back_is_quarantined_then_readmitted_and_chosen_again(
        stack: StackInfo, unique: Callable[[str], str], shared: tuple[S3Store, NatsEventLog, str],
        tmp_path: Path) -> None:
    store, events, prefix = shared
    async with agent_world(stack, unique, tmp_path, prefix, store=store, events=events, app_env=APP,
                           extra={"uk": {ENV: "after_effects:probing"}}) as w:
        host = f"{unique('qu')}.example.com"
        uk = w.labels["uk"]
        await create_and_write(w, host)
        move_id = await request_move(w, host)
        target = w.agents["uk"]

        async def died() -> bool:
            return not target.alive()

        await eventually(died, "the target's death after its probe started", 90)
        stopped = await cli(stack, w, "http://127.0.0.1:9", "box", "stop", "--label", uk)
        assert stopped.returncode == 0, stopped
        door = Door(w.ledger, clock=WallClock(), rng=SystemRandom())
        answer = await declare_lost(door, host, DeclareLost(uk, "stopped", "the platform stopped it", True),
                                    Identity("alice", "operator"))
        assert answer.status == 200, answer.body
        await closed_on_ie(w, host, move_id, "rolled_back", lost_region_park=True)

        uk_dir = w.box_dir("uk")
        db = instance_dir(uk_dir / "data", host) / f"{host}.db"
        assert db.exists(), "the lost box still holds its local copy of the host"
        refused = await cli(stack, w, "http://127.0.0.1:9", "box", "readmit", "--label", uk)
        assert refused.returncode == 5 and "has not retired its local state" in refused.stderr, refused

        target.start()  # the machine is started again: its agent quarantines before anything else

        async def retired() -> bool:
            claim = (await w.ledger.read_claim(host)).state
            return claim is not None and any(b.box == uk and b.retired_at is not None for b in claim.lost)

        await eventually(retired, "the lost box's quarantine of the host", 60)
        assert not db.exists(), "its database is parked out of the live namespace"
        assert any(p.is_file() for p in (uk_dir / ".parked").rglob("*")), "parked, not deleted"
        registry = Registry.open(uk_dir, WallClock())
        try:
            assert registry.get(host) is None, "its route row is gone"
        finally:
            registry.close()
        assert read_endpoint(uk_dir, host) is None, "nothing of the host runs on the lost box"
        async def refused_for_want_of_a_box() -> dict[str, object] | None:
            """Not chosen while lost (M-R11), once the chores of the earlier operation are done (M-R27 until then:
            the source's dead generations, and the region's straggler sweep of what the lost box left in uk)."""
            answer = await door.request_move(host, MoveRequest("uk", "auto"), Identity("alice", "operator"))
            assert answer.status == 409 and answer.body["copy"] in ("M-R11", "M-R27"), answer.body
            return answer.body if answer.body["copy"] == "M-R11" else None

        await eventually(refused_for_want_of_a_box, "a move refused for want of an eligible box", 120)
        readmitted = await cli(stack, w, "http://127.0.0.1:9", "box", "readmit", "--label", uk)
        assert readmitted.returncode == 0 and f"box {uk} is readmitted for {host}" in readmitted.stdout, readmitted
        claim = (await w.ledger.read_claim(host)).state
        assert claim is not None and claim.lost == ()

        async def accepted() -> str | None:
            """Chosen again, once the readmitted box has run the lost region's park it adopts (M-R27 until then)."""
            answer = await door.request_move(host, MoveRequest("uk", "auto"), Identity("alice", "operator"))
            if answer.status == 409 and answer.body["copy"] == "M-R27":
                return None
            assert answer.status in (200, 201), answer.body
            return str(answer.body["move"]["id"])

        again = await eventually(accepted, "a move to the readmitted box", 120, every_s=1.0)
        await moved(w, host, again)
        claim = (await w.ledger.read_claim(host)).state
        assert claim is not None and not any(o.op == f"lost:{move_id}" for o in claim.obligations)


def test_readmission_waits_for_the_quarantine_and_never_readmits_a_terminated_enrollment() -> None:
    holder = Holder(incarnation="i" * 64, location="instances/q/")
    serving = Claim(host="q.example", gen=3, holder=holder, op=Op(kind="serving", exec="ie-1"),
                    lost=(LostBox(box="uk-1", fence="control/losses/q/mv/uk-1.json", at=5),))
    assert owes_quarantine(serving, "uk-1") and not owes_quarantine(serving, "ie-1")
    out = decide_readmit_claim(serving, "uk-1")
    assert isinstance(out, Refusal) and "has not retired" in out.reason
    retired = decide_retired(serving, "uk-1", 9)
    assert isinstance(retired, Claim) and retired.lost[0].retired_at == 9 and not owes_quarantine(retired, "uk-1")
    assert isinstance(decide_retired(retired, "uk-1", 10), NoChange), "recorded once"
    readmitted = decide_readmit_claim(retired, "uk-1")
    assert isinstance(readmitted, Claim) and readmitted.lost == ()
    busy = msgspec.structs.replace(retired, op=Op(kind="moving", exec="ie-1", participants=("ie-1", "uk-1")))
    assert isinstance(decide_readmit_claim(busy, "uk-1"), Refusal)
    fenced = msgspec.structs.replace(retired, lost=(LostBox(box="uk-1", fence="control/box-fences/uk-1.json",
                                                            retired_at=9),))
    out = decide_readmit_claim(fenced, "uk-1")
    assert isinstance(out, Refusal) and "never readmitted" in out.reason
    assert isinstance(decide_readmit_claim(serving, "us-1"), NoChange)
    with rules.mutated(["lost-quarantine"]):
        assert isinstance(decide_readmit_claim(serving, "uk-1"), Claim), "the mutation readmits an unquarantined box"


async def test_a_box_declared_lost_twice_for_a_host_quarantines_each_time_into_a_park_of_its_own(
        tmp_path: Path) -> None:
    """§6.4 "one destination per retirement event": a box readmitted, chosen again and declared lost again for the
    same host quarantines a second time; its second installation is parked beside the first one's, never onto it
    (the simulation's move seed 193 with frozen targets: the agent's start failed, the destination existed)."""
    host, inc, box = "q.example", "e" * 64, "uk-1"
    clock = ManualClock()
    stamps, registry, timers = StampBook.open(tmp_path, clock), Registry.open(tmp_path, clock), Timers.open(
        tmp_path, clock)
    try:
        for stamp, declared_at in ((10, 5_000), (20, 9_000)):
            serving = Claim(host=host, gen=stamp, op=Op(kind="serving", exec=box),
                            holder=Holder(incarnation=inc, location=f"instances/{host}/{inc}", stamp=stamp))

            async def installing(c: Claim = serving) -> Claim | None:
                return c

            async with host_guard(tmp_path, host, installing, clock=clock) as g:  # the box serves the host
                stamps.init_record(g, box)
                db = tmp_path / "data" / f"{host}.db"
                db.parent.mkdir(parents=True, exist_ok=True)
                db.write_text(f"installation {stamp}")
                stamps.tag(g, inc, "db", db, stamp)
            lost = LostBox(box=box, fence=f"control/losses/q.example/mv_{stamp}/{box}.json", at=declared_at)
            declared = msgspec.structs.replace(serving, op=Op(kind="serving", exec="ie-1"), lost=(lost,))

            async def after(c: Claim = declared) -> Claim | None:
                return c

            done = await quarantine(box_dir=tmp_path, host=host, stamps=stamps, registry=registry, timers=timers,
                                    read_claim=after, clock=clock, event=quarantine_event(lost))
            assert done is not None and done.parked == 1 and not db.exists()
        parks = tmp_path / ".parked" / "superseded-quarantine"
        assert (parks / "quarantine-local-5000" / host / f"{host}.db").read_text() == "installation 10"
        assert (parks / "quarantine-local-9000" / host / f"{host}.db").read_text() == "installation 20"
    finally:
        for closable in (stamps, registry, timers):
            closable.close()
