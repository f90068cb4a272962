"""Bounded storage on the real stack (issue 16 item 2, 3): every cold admission publishes its generation and the
generation it left is retired by a ``park-generation`` chore (exact versions, a manifest, verified after the
horizon); the admissions list stays bounded; a publication queues nothing into another region; a chore never
retires a live baseline (``baseline-live``) and a start never restores a covered one (``covered-baseline-refused``).

Real cgroup leaves, the real moveprobe app, real SQLite and SeaweedFS, the real ledger on NATS; the agents' loop is
replaced by calling the activator and the chore runner directly, with the fast park horizon."""

from __future__ import annotations

import asyncio
import sqlite3
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import pytest
import pytest_asyncio

from bus.facts import Fact
from bus.nats_log import NatsEventLog
from bus.subjects import FACTS_STREAM, alert_subject
from events import Actor, Claim
from events.base import decode
from events.claim import Admission, Holder, LostBox, Obligation, Op, Predecessor, Scope
from events.envelope import EventMeta, Transition
from hostmove.probe_apps import post_write
from hostmove.stackinfo import StackInfo
from kernel.ports import SystemRandom, WallClock
from moveprobe.config import probe_env
from services.box.artifacts.filesmanifest import manifest_key
from services.box.artifacts.markers import marker_key
from services.box.instance.activator import Activator, AppSpec, BaselineRefused, BoxContext, Started
from services.box.instance.coverage import MAX_ADMISSIONS, PARK_GENERATION, chore_name
from services.box.instance.proctree import CgroupTree
from services.box.instance.registry import Registry, RouteRow
from services.box.instance.sandbox import instance_dir
from services.box.instance.stamps import StampBook
from services.box.replica.layout import generation_prefixes
from services.box.replica.restore import restore_generation
from services.hosts.create import create_host
from services.ledger import Committed, Ledger
from services.ledger.protocol import ProtocolCheck
from services.move.park import FAST, Parker, destination
from services.objstore.port import VersionEntry
from services.objstore.s3 import S3Store
from services.sweeper.generations import GenerationParks, event_kind
from services.sweeper.retention import RetentionSweep
from services.sweeper.straggler import StragglerSweep
from tests.helpers.cgtest import TEST_DEPLOYMENT

INC = "ef" * 32


@dataclass
class World:
    store: S3Store
    events: NatsEventLog
    deploy: str
    buckets: dict[str, str]
    ledger: Ledger
    root: Path
    trees: list[CgroupTree] = field(default_factory=list)
    activators: list[Activator] = field(default_factory=list)

    def box(self, label: str, region: str = "ie") -> BoxContext:
        box_dir = self.root / label
        box_dir.mkdir(parents=True, exist_ok=True)
        clock = WallClock()
        tree = CgroupTree.discover(f"t-{label}-{self.deploy[-10:]}", deployment=TEST_DEPLOYMENT, clock=clock)
        self.trees.append(tree)
        return BoxContext(label=label, region=region, box_dir=box_dir, data_bucket=self.buckets[region],
                          data_store=self.store, ledger=self.ledger, tree=tree, registry=Registry.open(box_dir, clock),
                          stamps=StampBook.open(box_dir, clock), clock=clock, rng=SystemRandom())

    def activator(self, ctx: BoxContext) -> Activator:
        def env(host: str, data_dir: Path, port: int, region: str) -> dict[str, str]:
            return probe_env(data_dir=data_dir, host=host, region=region, ack_log=self.root / f"{host}.acks",
                             port=port, interval_s=3600)

        act = Activator(ctx, AppSpec(argv=[sys.executable, "-m", "moveprobe"], env=env, ready_within_s=15))
        self.activators.append(act)
        return act

    def chores(self, ctx: BoxContext) -> GenerationParks:
        return GenerationParks(ctx.label, ctx.region, self.ledger,
                               Parker(self.store, ctx.data_bucket, WallClock(), timing=FAST), self.events)

    async def claim(self, host: str) -> Claim:
        claim = (await self.ledger.read_claim(host)).state
        assert claim is not None and claim.holder is not None
        return claim


@asynccontextmanager
async def open_world(stack: StackInfo, unique: Callable[[str], str], root: Path) -> AsyncIterator[World]:
    store = await S3Store.open(stack.s3_endpoint, stack.s3_access_key, stack.s3_secret_key, stack.s3_region)
    events = await NatsEventLog.connect(stack.nats_url)
    deploy = unique("gens")
    buckets = {"ie": f"{deploy}-ie", "uk": f"{deploy}-uk"}
    for bucket in (deploy, *buckets.values()):
        await store.create_bucket(bucket)
    ledger = Ledger(store, events, WallClock(), Actor(service="box", pid=1, nonce="g"), deploy)
    w = World(store, events, deploy, buckets, ledger, root)
    try:
        yield w
    finally:
        for activator in w.activators:
            await activator.close()
        for tree in w.trees:
            if tree.base is None or not tree.base.exists():
                continue
            for leaf in [p for p in tree.base.iterdir() if p.is_dir()]:
                await tree.reopen_and_drain(leaf.name, within_s=10)
                for _ in range(100):
                    tree.reap()
                    try:
                        leaf.rmdir()
                        break
                    except OSError:
                        await asyncio.sleep(0.05)
            tree.remove_box()
        for bucket in (deploy, *buckets.values()):
            await store.delete_bucket(bucket)
        await events.close()
        await store.close()


@pytest_asyncio.fixture(loop_scope="session")
async def world(stack: StackInfo, unique: Callable[[str], str], tmp_path: Path) -> AsyncIterator[World]:
    async with open_world(stack, unique, tmp_path / "boxes") as w:
        yield w


async def setup_host(w: World, unique: Callable[[str], str], ctx: BoxContext) -> str:
    host = f"{unique('gen')}.example.com"
    assert isinstance(await create_host(w.ledger, host, box=ctx.label, region=ctx.region, incarnation=INC), Committed)
    ctx.registry.insert(RouteRow(host=host, status="ready", incarnation=INC))
    return host


async def versions_of(w: World, bucket: str, location: str, generation: str) -> int:
    return sum([len(await w.store.list_versions(bucket, p)) for p in generation_prefixes(location, generation)])


async def retire_all(w: World, ctx: BoxContext, host: str, timeout_s: float = 20.0) -> list[str]:
    """Run the box's chores until it owes none for ``host``; answers the generations retired."""
    parks = w.chores(ctx)
    retired: list[str] = []
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        report = await parks.run(host)
        retired += report.retired
        claim = await w.claim(host)
        if not [o for o in claim.obligations if o.kind == PARK_GENERATION and o.owner == ctx.label]:
            return retired
        assert loop.time() < deadline, f"the chores of {host} did not finish: {report.did}"
        await asyncio.sleep(0.2)


async def test_every_wake_retires_the_generation_it_left(world: World, unique: Callable[[str], str],
                                                         tmp_path: Path) -> None:
    """Wake, write, sleep, a dozen times: each wake's publication queues exactly one chore for the generation it
    left, which is retired by exact versions with a manifest; the admissions stay at most eight, all covered; the
    bytes of the host's location do not grow; a cold restore of the current generation holds every write."""
    ctx = world.box("ie-a")
    host = await setup_host(world, unique, ctx)
    act = world.activator(ctx)
    written: list[int] = []
    sizes: list[int] = []
    for i in range(12):
        before = await world.claim(host)
        started = await act.wake(host)
        assert isinstance(started, Started), started
        claim = await world.claim(host)
        assert claim.holder is not None
        chores = [o for o in claim.obligations if o.kind == PARK_GENERATION]
        if i == 0:
            assert chores == [], "the first admission's predecessor (the origin) holds nothing: covered, no chore"
        else:
            assert before.holder is not None
            dead = before.holder.generation
            assert [(o.generation, o.region, o.owner, o.op) for o in chores] == [
                (chore_name(dead), "ie", "ie-a", f"session:{claim.holder.session}")], chores
            assert chores[0].scope is not None and chores[0].scope.evidence_at is not None
            assert await versions_of(world, ctx.data_bucket, claim.holder.location, dead) > 0
            assert await retire_all(world, ctx, host) == [dead]
            assert await versions_of(world, ctx.data_bucket, claim.holder.location, dead) == 0, \
                "every version of the dead generation is gone (exact versions, markers included)"
            manifest = await world.store.get(
                ctx.data_bucket, destination(host, chores[0].op, f"{event_kind(chores[0])}-1") + "manifest.json")
            assert manifest.__class__.__name__ == "Got", "one immutable manifest per retirement event"
        after = await world.claim(host)
        assert after.holder is not None
        assert len(after.holder.admissions) <= MAX_ADMISSIONS and all(a.covered for a in after.holder.admissions)
        assert not [o for o in after.obligations if o.kind == PARK_GENERATION]
        written += [await asyncio.to_thread(post_write, started.port, f"w{i}-{k}") for k in range(3)]
        cert = await act.stop(host)
        assert cert is not None, "the idle stop certifies the session"
        listed = await world.store.list_versions(ctx.data_bucket, after.holder.location.rstrip("/") + "/")
        sizes.append(sum(v.size for v in listed))
    assert len((await world.claim(host)).holder.admissions) == MAX_ADMISSIONS  # type: ignore[union-attr]
    assert max(sizes[3:]) <= 2 * sizes[2], f"the location's bytes grow with the wakes: {sizes}"
    final = await world.claim(host)
    assert final.holder is not None
    scratch = tmp_path / "cold.db"
    await restore_generation(world.store, ctx.data_bucket, final.holder.location, final.holder.generation, scratch)
    with sqlite3.connect(scratch) as conn:
        have = {seq for (seq,) in conn.execute("SELECT seq FROM rows WHERE kind = 'write'")}
    assert set(written) <= have, f"acknowledged writes missing: {sorted(set(written) - have)}"


async def replace_claim(w: World, host: str, name: str, change: Callable[[Claim], Claim]) -> Claim:
    out = await w.ledger.transition("claim", host, name, lambda cur: change(cur) if cur is not None else cur)
    assert isinstance(out, Committed), out
    return out.state


async def test_a_foreign_region_predecessor_waits_for_its_own_region(world: World,
                                                                     unique: Callable[[str], str]) -> None:
    """A cold admission in uk over a predecessor in ie publishes in uk: no chore is queued into ie and the record stays
    uncovered (for ie's own whole-location park, which the commit queues with CoverRegionPredecessors); the next wake
    in uk retires uk's own dead generation and still leaves the ie one alone."""
    ie, uk = world.box("ie-f", "ie"), world.box("uk-f", "uk")
    host = await setup_host(world, unique, ie)
    a, b = world.activator(ie), world.activator(uk)
    assert isinstance(await a.wake(host), Started)
    await a.stop(host)
    ie_gen = (await world.claim(host)).holder.generation  # type: ignore[union-attr]
    await replace_claim(world, host, "test-replace-box", lambda c: msgspec.structs.replace(  # ie-f fenced
        c, op=Op(kind="serving", exec="uk-f", participants=("uk-f",)), lost=(*c.lost, LostBox(box="ie-f"))))
    uk.registry.insert(RouteRow(host=host, status="ready", incarnation=INC))
    for _ in range(2):
        assert isinstance(await b.wake(host), Started)
        await b.stop(host)
        await retire_all(world, uk, host)
        claim = await world.claim(host)
        assert claim.holder is not None
        foreign = [r for r in claim.holder.admissions if r.predecessor_region == "ie"]
        assert len(foreign) == 1 and not foreign[0].covered, "the ie predecessor stays uncovered"
        assert not [o for o in claim.obligations if o.region == "ie"], "nothing is queued into ie from uk"
        assert all(r.covered for r in claim.holder.admissions if r.predecessor_region == "uk")
    assert await versions_of(world, world.buckets["ie"], claim.holder.location, ie_gen) > 0


async def test_a_chore_never_retires_a_live_baseline(world: World, unique: Callable[[str], str]) -> None:
    """``baseline-live``: a chore naming the host's current generation, or the baseline of an admission not yet
    covered, waits and touches nothing."""
    ctx = world.box("ie-l")
    host = await setup_host(world, unique, ctx)
    act = world.activator(ctx)
    assert isinstance(await act.wake(host), Started)
    await act.stop(host)
    assert isinstance(await act.wake(host), Started)
    await act.stop(host)
    await retire_all(world, ctx, host)
    claim = await world.claim(host)
    holder = claim.holder
    assert holder is not None
    scope = Scope(location=holder.location.rstrip("/"), incarnation=INC, evidence_at=0)
    current = Obligation(kind=PARK_GENERATION, op="session:1", region="ie", owner="ie-l",
                         generation=chore_name(holder.generation), scope=scope)
    await replace_claim(world, host, "test-chore",
                        lambda c: msgspec.structs.replace(c, obligations=(*c.obligations, current)))
    before = await versions_of(world, ctx.data_bucket, holder.location, holder.generation)
    report = await world.chores(ctx).run(host)
    assert report.retired == () and "is the host's current generation" in report.did[0], report
    assert await versions_of(world, ctx.data_bucket, holder.location, holder.generation) == before

    # the baseline of a record not yet covered: the last record uncovered again, a chore for its predecessor
    last = holder.admissions[-1]
    assert last.predecessor is not None
    baseline = last.predecessor.generation

    def uncover(c: Claim) -> Claim:
        assert c.holder is not None
        recs = (*c.holder.admissions[:-1], msgspec.structs.replace(c.holder.admissions[-1], covered=False))
        chore = msgspec.structs.replace(current, generation=chore_name(baseline))
        return msgspec.structs.replace(c, holder=msgspec.structs.replace(c.holder, admissions=recs),
                                       obligations=(chore,))

    await replace_claim(world, host, "test-uncover", uncover)
    report = await world.chores(ctx).run(host)
    assert report.retired == () and "baseline of an admission not yet covered" in report.did[0], report


async def test_a_covered_local_baseline_is_refused_with_an_alert(world: World, unique: Callable[[str], str]) -> None:
    """``covered-baseline-refused``: the run walk meets a generation already queued for retirement: nothing is
    admitted, nothing starts, and the operator is alerted."""
    ctx = world.box("ie-c")
    host = await setup_host(world, unique, ctx)
    act = world.activator(ctx)
    assert isinstance(await act.wake(host), Started)
    await act.stop(host)
    claim = await world.claim(host)
    holder = claim.holder
    assert holder is not None
    chore = Obligation(kind=PARK_GENERATION, op="session:1", region="ie", owner="ie-c",
                       generation=chore_name(holder.generation),
                       scope=Scope(location=holder.location.rstrip("/"), incarnation=INC, evidence_at=0))
    covered = await replace_claim(world, host, "test-chore",
                                  lambda c: msgspec.structs.replace(c, obligations=(chore,)))
    with pytest.raises(BaselineRefused, match="already covered"):
        await act.wake(host)
    assert (await world.claim(host)) == covered, "nothing was admitted"
    assert not ctx.tree.populated(host), "nothing started"
    alerts = [decode(m.data, Fact) async for m in world.events.replay(FACTS_STREAM,
                                                                      subject=alert_subject("baseline-refused"))]
    assert [a for a in alerts if a.subject == host], "the refusal is alerted"


async def test_a_published_generation_found_empty_is_refused_with_an_alert(world: World,
                                                                          unique: Callable[[str], str]) -> None:
    """``empty-generation-refused`` (§5.1 step 9): the marker names a generation that holds no replica file (its
    objects deleted out of band, the box's disk lost): the start is refused and alerted, never restored to an empty
    database; each wake refuses again and nothing is admitted."""
    ctx = world.box("ie-e")
    host = await setup_host(world, unique, ctx)
    act = world.activator(ctx)
    assert isinstance(await act.wake(host), Started)
    await act.stop(host)
    assert isinstance(await act.wake(host), Started), "a healthy second wake"
    await act.stop(host)
    claim = await world.claim(host)
    holder = claim.holder
    assert holder is not None
    bucket = world.buckets["ie"]
    gone = 0
    for prefix in generation_prefixes(holder.location, holder.generation):
        for v in await world.store.list_versions(bucket, prefix):
            await world.store.delete(bucket, v.key, version_id=v.version_id)
            gone += 1
    assert gone, "the generation held objects before"
    for path in instance_dir(ctx.data_dir, host).glob(f"{host}.db*"):  # the disk lost too (else the next wake
        path.unlink()                                                    # flushes it back, §5.3)
    for _ in range(2):
        with pytest.raises(BaselineRefused, match="holds no replica file"):
            await act.wake(host)
        assert (await world.claim(host)) == claim, "nothing was admitted"
        assert not ctx.tree.populated(host), "nothing started"
    alerts = [decode(m.data, Fact) async for m in world.events.replay(FACTS_STREAM,
                                                                      subject=alert_subject("baseline-refused"))]
    mine = [a for a in alerts if a.subject == host]
    assert mine and "holds no replica file" in str(mine[0].payload["reason"]), "the refusal is alerted"


async def test_retention_deletes_old_archives_by_exact_versions(world: World, unique: Callable[[str], str]) -> None:
    """Item 7: the parks' ``superseded/`` destinations and a move's ``move-snapshots/`` older than the retention are
    deleted by exact versions, each with a manifest under ``retired/``; never one an obligation or the claim's
    operation names; nothing of the live namespace is touched."""
    ctx = world.box("ie-t")
    host = await setup_host(world, unique, ctx)
    act = world.activator(ctx)
    for _ in range(3):
        assert isinstance(await act.wake(host), Started)
        await act.stop(host)
        await retire_all(world, ctx, host)
    bucket = ctx.data_bucket
    await world.store.put(bucket, f"move-snapshots/{host}/mv_old/archive.sealed", b"sealed")
    archived = await world.store.list_versions(bucket, f"superseded/{host}/")
    assert archived, "the parks archived what they retired"
    claim = await world.claim(host)
    assert claim.holder is not None
    live = {(v.key, v.version_id) for v in await world.store.list_versions(bucket, claim.holder.location + "/")}
    sweep = RetentionSweep("ie-t", "ie", world.store, bucket, WallClock(), retention_ms=60_000)
    assert await sweep.look(host, claim, None, force=True) == [], "nothing is older than the retention yet"
    sweep.retention_ms = 0
    op = archived[0].key.split("/")[2]
    named = msgspec.structs.replace(claim, obligations=(Obligation(kind=PARK_GENERATION, op=op, region="ie",
                                                                   owner="ie-t"),))
    done = await sweep.look(host, named, None, force=True)
    left = await world.store.list_versions(bucket, f"superseded/{host}/")
    assert left and all(v.key.split("/")[2] == op for v in left), "an entry an obligation names is kept"
    assert any("move-snapshots" in line for line in done)
    assert await sweep.look(host, claim, None, force=True)
    assert await world.store.list_versions(bucket, f"superseded/{host}/") == []
    assert await world.store.list_versions(bucket, f"move-snapshots/{host}/") == []
    manifests = await world.store.list_keys(bucket, f"retired/{host}/")
    assert len(manifests) == len({tuple(v.key.split("/")[2:4]) for v in archived}) + 1, manifests
    after = {(v.key, v.version_id) for v in await world.store.list_versions(bucket, claim.holder.location + "/")}
    assert after == live, "nothing of the live namespace is touched"


async def test_the_serving_box_bounds_its_markers_noncurrent_versions(world: World,
                                                                     unique: Callable[[str], str]) -> None:
    """Issue 16 item 2: every cold admission's publication rewrites ``generation.json``; at rest the serving box
    deletes its noncurrent versions older than ``H`` beyond the newest four, by version id, never the current one,
    and nothing while another box executes the host."""
    ctx = world.box("ie-t")
    host = await setup_host(world, unique, ctx)
    act = world.activator(ctx)
    bucket = ctx.data_bucket
    for _ in range(7):
        assert isinstance(await act.wake(host), Started)
        await act.stop(host)
    claim = await world.claim(host)
    assert claim.holder is not None and claim.op.kind == "serving" and claim.op.exec == "ie-t"
    key = marker_key(claim.holder.location)

    async def versions() -> list[VersionEntry]:
        return [v for v in await world.store.list_versions(bucket, key) if v.key == key]

    before = await versions()
    assert len(before) >= 7, "each wake published the marker again"
    current = next(v for v in before if v.is_latest)
    await asyncio.sleep(1.2)  # the newest noncurrent version older than the one-second slack of LastModified
    sweep = RetentionSweep("ie-t", "ie", world.store, bucket, WallClock(), retention_ms=60_000, horizon_ms=0)
    elsewhere = msgspec.structs.replace(claim, op=msgspec.structs.replace(claim.op, exec="uk-t"))
    assert await sweep.look(host, elsewhere, None, force=True) == [] and len(await versions()) == len(before)
    did = await sweep.look(host, claim, None, force=True)
    after = await versions()
    assert did and 5 <= len(after) < len(before), (did, len(before), len(after))
    assert next(v for v in after if v.is_latest).version_id == current.version_id, "the current marker stays"
    assert not any(v.is_delete_marker for v in after)
    assert await sweep.look(host, claim, None, force=True) == [], "nothing left to retire"


def test_the_audit_flags_a_retirement_of_a_live_baseline() -> None:
    """The protocol audit's ``baseline-live``: a park-generation queued for, or acknowledged over, the current
    generation or an uncovered admission's baseline is a finding; one over a covered record's is not."""
    holder = Holder(incarnation=INC, location=f"instances/h.example/{INC}", generation="g2", session=5, stamp=5,
                    writer_box="ie-1", admissions=(
                        Admission(session=4, box="ie-1", generation="g1", region="ie", covered=True,
                                  predecessor=Predecessor(session=3, box="ie-1", generation="g0"),
                                  predecessor_region="ie"),
                        Admission(session=5, box="ie-1", generation="g2", region="ie", covered=False,
                                  predecessor=Predecessor(session=4, box="ie-1", generation="g1"),
                                  predecessor_region="ie")))
    base = Claim(host="h.example", gen=5, holder=holder, op=Op(kind="serving", exec="ie-1", participants=("ie-1",)))

    def chore(gen: str) -> Obligation:
        return Obligation(kind=PARK_GENERATION, op="session:5", region="ie", owner="ie-1", generation=gen,
                          scope=Scope(location=holder.location, incarnation=INC, evidence_at=1))

    def findings(*claims: Claim) -> list[str]:
        check = ProtocolCheck()
        for seq, claim in enumerate(claims, 1):
            meta = EventMeta(name="step", actor=Actor(service="t", pid=1, nonce="n"), at=seq)
            stated = msgspec.structs.replace(claim, gen=base.gen + seq - 1)
            check.feed(Transition(kind="rebase" if seq == 1 else "transition", object="claim", host="h.example",
                                  gen=stated.gen, meta=meta, claim=stated), seq)
        return [f.what for f in check.findings if f.rule == "baseline-live"]

    ok = msgspec.structs.replace(base, obligations=(chore("g0"),))
    assert findings(base, ok, base) == [], "the covered record's predecessor may be retired"
    for live in ("g1", "g2"):  # the uncovered record's baseline; the current generation
        queued = msgspec.structs.replace(base, obligations=(chore(live),))
        found = findings(base, queued, base)
        assert len(found) == 2 and "was queued" in found[0] and "was acknowledged" in found[1], found


def sweeper(w: World, ctx: BoxContext) -> StragglerSweep:
    sweep = StragglerSweep(ctx.label, ctx.region, w.ledger, Parker(w.store, ctx.data_bucket, WallClock(), timing=FAST),
                           WallClock(), events=w.events, retention_ms=3_600_000)
    sweep.every_ms = 0
    return sweep


async def until_acknowledged(run: Callable[[], Awaitable[object]], done: Callable[[], Awaitable[bool]],
                             timeout_s: float = 20.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not await done():
        assert loop.time() < deadline, "the sweep did not finish"
        await run()
        await asyncio.sleep(0.2)


async def test_the_at_rest_sweep_parks_every_location_and_lane_of_the_host(world: World,
                                                                           unique: Callable[[str], str]) -> None:
    """Item 6, the namespace and staging sweeps: in a region the host is not served in, every location of the host
    (its own, an older incarnation's) and every staging lane no operation owns is queued as a park-sweep with its
    scope, parked by exact versions after the horizon and acknowledged; the records whose predecessors were there are
    covered (CoverParkedPredecessors)."""
    ie, uk = world.box("ie-n", "ie"), world.box("uk-n", "uk")
    host = await setup_host(world, unique, ie)
    act = world.activator(ie)
    assert isinstance(await act.wake(host), Started)
    await act.stop(host)
    claim = await world.claim(host)
    assert claim.holder is not None
    bucket = world.buckets["uk"]
    loc = claim.holder.location.rstrip("/")
    residue = [f"{loc}/0000/0000000000000001-0000000000000001.ltx",  # the origin, the first record's predecessor
               f"instances/{host}/{'ab' * 32}/g-wold/0000/0000000000000001-0000000000000001.ltx",
               f"moves/{host}/mv_{'x' * 26}/replica/0000/0000000000000001-0000000000000001.ltx"]
    for key in residue:
        await world.store.put(bucket, key, b"late")
    # a record whose predecessor is in uk: the sweep of the location covers it
    def uk_pred(c: Claim) -> Claim:
        assert c.holder is not None
        last = msgspec.structs.replace(c.holder.admissions[-1], predecessor_region="uk", covered=False)
        return msgspec.structs.replace(c, holder=msgspec.structs.replace(
            c.holder, admissions=(*c.holder.admissions[:-1], last)))

    await replace_claim(world, host, "test-uk-predecessor", uk_pred)
    sweep = sweeper(world, uk)

    async def clean() -> bool:
        c = await world.claim(host)
        return not c.obligations and all([not await world.store.list_versions(bucket, k) for k in residue])

    first = await sweep.look(host, await world.claim(host))
    queued = await world.claim(host)
    assert len([o for o in queued.obligations if o.kind == "park-sweep"]) == 3 or "acknowledged" in first.did, first
    assert all(o.scope is not None and o.scope.evidence_at for o in queued.obligations)
    assert queued.holder is not None and queued.holder.admissions[-1].covered, "CoverParkedPredecessors"

    async def again() -> object:
        return await sweep.look(host, await world.claim(host))

    await until_acknowledged(again, clean)
    ie_keys = await world.store.list_keys(world.buckets["ie"], loc + "/")
    assert ie_keys, "the serving region's live location is untouched"


async def test_the_serving_region_sweep_retires_dead_generations_only(world: World,
                                                                      unique: Callable[[str], str]) -> None:
    """Item 6, the serving region's dead generations: a dead generation's late object (no chore names it any more) is
    queued as a park-generation and retired; the current generation, the one generation.json names and an uncovered
    record's baseline are never touched; a marker off the admitted chain touches nothing."""
    ctx = world.box("ie-d")
    host = await setup_host(world, unique, ctx)
    act = world.activator(ctx)
    for _ in range(3):
        assert isinstance(await act.wake(host), Started)
        await act.stop(host)
        await retire_all(world, ctx, host)
    claim = await world.claim(host)
    holder = claim.holder
    assert holder is not None
    bucket, loc = ctx.data_bucket, holder.location.rstrip("/")
    late = f"{loc}/g-wlate0001/0000/0000000000000002-0000000000000002.ltx"
    await world.store.put(bucket, late, b"a late upload into a retired generation")
    sweep = sweeper(world, ctx)
    report = await sweep.serving(host, await world.claim(host))
    assert "dead generations queued: wlate0001" in report.did, report
    assert await retire_all(world, ctx, host) == ["wlate0001"]
    assert await world.store.list_versions(bucket, late) == []
    current = await versions_of(world, bucket, holder.location, holder.generation)
    assert current > 0, "the current generation is live"

    # generation.json off the chain: nothing is touched
    await world.store.put(bucket, late, b"again")
    marker = await world.store.get(bucket, f"{loc}/generation.json")
    assert marker.__class__.__name__ == "Got"
    await world.store.put(bucket, f"{loc}/generation.json", marker.body.replace(  # type: ignore[union-attr]
        holder.generation.encode(), b"wstranger"))
    report = await sweep.serving(host, await world.claim(host))
    assert "touches nothing" in report.did or "nothing swept" in report.did, report
    assert await world.store.list_versions(bucket, late), "nothing was queued or parked"


async def test_a_publication_an_outage_stopped_is_made_again(world: World, unique: Callable[[str], str]) -> None:
    """The publication is retried (§7.14 "retried after the timeout"): a wake whose PublishGeneration never landed
    leaves its predecessor uncovered; the box's next pass publishes again and queues the chore, once the marker names
    the current generation, never for an unfinished start."""
    ctx = world.box("ie-p2")
    host = await setup_host(world, unique, ctx)
    act = world.activator(ctx)
    for _ in range(2):
        assert isinstance(await act.wake(host), Started)
        await act.stop(host)
    await retire_all(world, ctx, host)

    def unpublished(c: Claim) -> Claim:  # as if the second wake's publication had been lost to an outage
        assert c.holder is not None
        last = msgspec.structs.replace(c.holder.admissions[-1], covered=False)
        return msgspec.structs.replace(c, holder=msgspec.structs.replace(
            c.holder, admissions=(*c.holder.admissions[:-1], last)), obligations=())

    lost = await replace_claim(world, host, "test-unpublished", unpublished)
    assert await act.republish(lost)
    again = await world.claim(host)
    assert again.holder is not None and again.holder.admissions[-1].covered
    assert [o.kind for o in again.obligations] == [PARK_GENERATION]
    assert not await act.republish(again), "nothing is owed any more"


async def test_a_dead_generation_holding_the_only_files_manifest_waits(world: World,
                                                                       unique: Callable[[str], str]) -> None:
    """A start whose files manifest was not published (a file the archive refuses) leaves the dead generation's
    manifest the files' only durable copy: its chore waits, touching nothing, until the current generation has one."""
    ctx = world.box("ie-m")
    host = await setup_host(world, unique, ctx)
    act = world.activator(ctx)
    assert isinstance(await act.wake(host), Started)
    await act.stop(host)
    assert isinstance(await act.wake(host), Started)
    claim = await world.claim(host)
    assert claim.holder is not None and [o.kind for o in claim.obligations] == [PARK_GENERATION]
    current = manifest_key(claim.holder.location, claim.holder.generation)
    await world.store.delete(ctx.data_bucket, current)  # as if this start's manifest had been refused
    report = await world.chores(ctx).run(host)
    assert report.retired == () and "newest files manifest" in report.did[0], report
