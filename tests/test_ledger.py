"""The ledger against the real stack (SeaweedFS + JetStream) and the twins (issue 2 item 5).

Every case runs on both; the property test crashes writers between the CAS and the publish and
loses publish acknowledgements, then checks that every object's history is contiguous from gen 1
and that the fold of the stream equals the S3 object byte for byte (and that the audit agrees).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import msgspec
import pytest
import pytest_asyncio

from bus.log import EventLog, LogError, PubAck
from bus.memory_log import MemoryEventLog
from bus.nats_log import NatsEventLog
from bus.subjects import LEDGER_STREAM, ledger_subject
from events import Actor, Claim, DurableValueError, Op, Record, Transition
from events.base import canonical, decode
from hostmove.stackinfo import StackInfo
from kernel.ports import ManualClock
from services.ledger import Committed, Conflict, Crash, Ledger, LedgerDefect, NoChange, Refusal, object_key
from services.ledger.audit import run_audit
from services.objstore.memory import MemoryStore
from services.objstore.port import Got, ObjectStore
from services.objstore.s3 import S3Store


class LossyLog:
    """Wraps an event log: ``lose_acks`` publishes land, then the caller sees an unknown outcome."""

    def __init__(self, inner: EventLog) -> None:
        self.inner = inner
        self.lose_acks = 0
        self.publishes = 0

    async def publish(self, stream: str, subject: str, data: bytes, **kw: object) -> PubAck:
        self.publishes += 1
        ack = await self.inner.publish(stream, subject, data, **kw)  # type: ignore[arg-type]
        if self.lose_acks:
            self.lose_acks -= 1
            raise LogError("publish outcome unknown: acknowledgement lost (test)")
        return ack

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)


@dataclass
class Env:
    kind: str
    store: ObjectStore
    events: LossyLog
    bucket: str
    purge: Callable[[str], object]
    clock: ManualClock = field(default_factory=ManualClock)
    counter: int = 0

    def ledger(self, faults: Callable[[str], None] | None = None, service: str = "test") -> Ledger:
        self.counter += 1
        actor = Actor(service=service, pid=1000 + self.counter, nonce=f"n{self.counter}")
        return Ledger(self.store, self.events, self.clock, actor, self.bucket, faults=faults)  # type: ignore[arg-type]


@pytest_asyncio.fixture(loop_scope="session", scope="module")
async def real_parts(
    stack: StackInfo, unique: Callable[[str], str]
) -> AsyncIterator[tuple[S3Store, NatsEventLog, str]]:
    """One bucket for the module (weed mini holds about 76 written buckets); hosts are unique per test."""
    store = await S3Store.open(stack.s3_endpoint, stack.s3_access_key, stack.s3_secret_key, stack.s3_region)
    events = await NatsEventLog.connect(stack.nats_url)
    bucket = unique("ledger")
    await store.create_bucket(bucket)
    yield store, events, bucket
    await store.delete_bucket(bucket)
    await events.close()
    await store.close()


@pytest_asyncio.fixture(loop_scope="session", params=["memory", "real"])
async def env(
    request: pytest.FixtureRequest, unique: Callable[[str], str], real_parts: tuple[S3Store, NatsEventLog, str]
) -> Env:
    if request.param == "memory":
        bucket = unique("ledger")
        mem_log = MemoryEventLog()
        store: ObjectStore = MemoryStore()
        await store.create_bucket(bucket)

        async def purge_mem(subject: str) -> None:
            mem_log.purge(LEDGER_STREAM)

        return Env("memory", store, LossyLog(mem_log), bucket, purge_mem)
    s3, nats_log, bucket = real_parts

    async def purge_real(subject: str) -> None:
        await nats_log.js.purge_stream(LEDGER_STREAM, subject=subject)

    return Env("real", s3, LossyLog(nats_log), bucket, purge_real)


def nested(depth: int) -> list:
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


def host_name(unique: Callable[[str], str], label: str) -> str:
    return f"{unique(label)}.example.com"  # dots on purpose: they must map to safe subject tokens


def set_phase(phase: str) -> Callable[[Claim | None], Claim]:
    def decide(cur: Claim | None) -> Claim:
        base = cur or Claim(host="placeholder", gen=1)
        return msgspec.structs.replace(base, op=Op(kind="serving", phase=phase, exec="box-a"))

    return decide


async def history(env: Env, obj: str, host: str) -> list[Transition]:
    return [
        decode(m.data, Transition)
        async for m in env.events.inner.replay(LEDGER_STREAM, subject=ledger_subject(obj, host))
    ]


async def assert_history_matches_store(env: Env, obj: str, host: str) -> list[Transition]:
    events = await history(env, obj, host)
    assert [e.gen for e in events] == list(range(1, len(events) + 1)), "gens contiguous from 1"
    got = await env.store.get(env.bucket, object_key(obj, host))  # type: ignore[arg-type]
    assert isinstance(got, Got)
    assert canonical(events[-1].state) == got.body, "fold of the stream equals the S3 object"
    return events


async def test_transitions_publish_full_state_in_order(env: Env, unique: Callable[[str], str]) -> None:
    host = host_name(unique, "order")
    ledger = env.ledger(service="door")
    for i, phase in enumerate(["a", "b", "c"]):
        out = await ledger.transition("claim", host, f"step-{phase}", set_phase(phase), causation=f"req-{i}")
        assert isinstance(out, Committed) and out.state.gen == i + 1 and out.seq is not None
    events = await assert_history_matches_store(env, "claim", host)
    assert [e.meta.name for e in events] == ["step-a", "step-b", "step-c"]
    assert [e.meta.causation for e in events] == ["req-0", "req-1", "req-2"]
    assert all(e.meta.actor.service == "door" and e.kind == "transition" for e in events)
    assert events[-1].claim is not None and events[-1].claim.op.phase == "c"


async def test_no_change_and_refusal_write_nothing(env: Env, unique: Callable[[str], str]) -> None:
    host = host_name(unique, "nochange")
    ledger = env.ledger()
    await ledger.transition("claim", host, "create", set_phase("x"))
    before = await env.events.inner.last(LEDGER_STREAM, ledger_subject("claim", host))
    assert isinstance(await ledger.transition("claim", host, "noop", lambda c: NoChange("same")), NoChange)
    refused = await ledger.transition("claim", host, "nope", lambda c: Refusal("not serving"))
    assert refused == Refusal("not serving")
    after = await env.events.inner.last(LEDGER_STREAM, ledger_subject("claim", host))
    assert before is not None and after is not None and before.seq == after.seq
    assert (await ledger.read_claim(host)).state.gen == 1  # type: ignore[union-attr]


def crash_after_cas(point: str) -> None:
    """A ledger fault that stops the writer between its CAS and its publish."""
    if point == "after_cas":
        raise Crash(point)


async def test_crash_between_cas_and_publish_is_relayed_by_the_next_writer(
    env: Env, unique: Callable[[str], str]
) -> None:
    host = host_name(unique, "crash")
    await env.ledger().transition("claim", host, "create", set_phase("a"))
    with pytest.raises(Crash):
        crasher = env.ledger(crash_after_cas, service="crasher")
        await crasher.transition("claim", host, "lost-step", set_phase("b"))
    assert [e.gen for e in await history(env, "claim", host)] == [1], "gen 2 not on the stream yet"
    out = await env.ledger().transition("claim", host, "next", set_phase("c"))
    assert isinstance(out, Committed) and out.state.gen == 3
    events = await assert_history_matches_store(env, "claim", host)
    relayed = events[1]
    assert relayed.meta.name == "lost-step" and relayed.meta.actor.service == "crasher"


async def test_an_audit_waits_for_an_event_on_its_way_and_reports_one_that_never_comes(
    env: Env, unique: Callable[[str], str]
) -> None:
    """A live store runs ahead of its stream between a CAS and its publish: the audit reads the object again with
    its subject's new events, so an event the relay publishes while it waits is no finding; one that never comes is,
    and says what happened (a writer stopped between its CAS and its publish)."""
    host = host_name(unique, "inflight")
    await env.ledger().transition("claim", host, "create", set_phase("a"))
    with pytest.raises(Crash):
        await env.ledger(crash_after_cas, service="crasher").transition("claim", host, "lost-step", set_phase("b"))
    alone = await run_audit(env.events.inner, env.ledger(), host=host, protocol=False, settle_s=0.6)
    assert [f.what for f in alone.findings] == [
        "last state differs from the object in S3 (stream gen 1, store gen 2): gen 2 has no event on the stream "
        "after 0.6 s (a writer stopped between its CAS and its publish: its next transition, or the relay, "
        "publishes it)"], alone.findings

    await env.ledger().transition("claim", host, "next", set_phase("c"))  # relays gen 2, publishes gen 3
    with pytest.raises(Crash):
        await env.ledger(crash_after_cas, service="crasher").transition("claim", host, "again", set_phase("d"))

    async def relay_late() -> None:
        await asyncio.sleep(0.8)
        await env.ledger().relay_all()

    relaying = asyncio.ensure_future(relay_late())
    settled = await run_audit(env.events.inner, env.ledger(), host=host, protocol=False, settle_s=10)
    await relaying
    assert settled.clean(strict=True), settled.findings
    assert settled.tracks[("claim", host)].last_gen == 4 and settled.messages == 4


async def test_relay_all_publishes_missing_last_gens(env: Env, unique: Callable[[str], str]) -> None:
    hosts = [host_name(unique, "relay") for _ in range(3)]
    for h in hosts:
        with pytest.raises(Crash):
            await env.ledger(crash_after_cas).transition("record", h, "create", lambda r, h=h: Record(host=h, gen=1))
        assert await history(env, "record", h) == []
    failed = await env.ledger().relay_all()
    assert not [line for line in failed if any(h in line for h in hosts)]
    for h in hosts:
        assert [e.meta.name for e in await assert_history_matches_store(env, "record", h)] == ["create"]


async def test_lost_publish_ack_is_resolved_by_reading_the_last_message(
    env: Env, unique: Callable[[str], str]
) -> None:
    host = host_name(unique, "lostack")
    ledger = env.ledger()
    await ledger.transition("claim", host, "create", set_phase("a"))
    env.events.lose_acks = 1
    out = await ledger.transition("claim", host, "second", set_phase("b"))
    assert isinstance(out, Committed) and out.seq is not None
    await assert_history_matches_store(env, "claim", host)
    assert len(await history(env, "claim", host)) == 2, "the retry did not duplicate the event"


async def test_two_writers_with_stale_hints_keep_the_history_contiguous(
    env: Env, unique: Callable[[str], str]
) -> None:
    host = host_name(unique, "two")
    a, b = env.ledger(), env.ledger()
    for i in range(6):
        writer = a if i % 2 == 0 else b
        assert isinstance(await writer.transition("claim", host, f"s{i}", set_phase(str(i))), Committed)
    await assert_history_matches_store(env, "claim", host)


async def test_concurrent_writers_one_winner_per_gen(env: Env, unique: Callable[[str], str]) -> None:
    host = host_name(unique, "race")
    await env.ledger().transition("claim", host, "create", set_phase("0"))
    writers = [env.ledger() for _ in range(6)]
    outs = await asyncio.gather(
        *(w.transition("claim", host, f"w{i}", set_phase(f"w{i}"), attempts=1) for i, w in enumerate(writers))
    )
    winners = [o for o in outs if isinstance(o, Committed)]
    assert len(winners) == 1 and all(isinstance(o, Conflict) for o in outs if o not in winners)
    await assert_history_matches_store(env, "claim", host)


async def test_lost_history_gets_a_rebase_event(env: Env, unique: Callable[[str], str]) -> None:
    host = host_name(unique, "rebase")
    ledger = env.ledger()
    for p in "abc":
        await ledger.transition("claim", host, f"s{p}", set_phase(p))
    await env.purge(ledger_subject("claim", host))
    out = await env.ledger().transition("claim", host, "after-loss", set_phase("d"))
    assert isinstance(out, Committed) and out.state.gen == 4
    events = await history(env, "claim", host)
    assert [(e.kind, e.gen) for e in events] == [("rebase", 3), ("transition", 4)]
    check = await run_audit(env.events.inner, ledger, host=host, protocol=False)  # synthetic states
    assert check.clean() and not check.clean(strict=True)
    assert any("rebased" in f.what for f in check.findings)


async def test_a_read_of_the_bytes_last_read_is_not_decoded_again(
    env: Env, unique: Callable[[str], str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every read is a GET; only bytes and metadata equal to the last ones read skip the validation (the same
    frozen value), and a new version is validated from scratch."""
    import services.ledger.ledger as ledger_module

    host = host_name(unique, "cached")
    ledger = env.ledger()
    await ledger.transition("claim", host, "create", set_phase("a"))
    first = await ledger.read_claim(host)
    decoded: list[bytes] = []
    monkeypatch.setattr(ledger_module, "decode", lambda data, cls: decoded.append(data) or decode(data, cls))
    again = await ledger.read_claim(host)
    assert again.state is first.state and again.etag == first.etag and decoded == []
    await env.ledger().transition("claim", host, "moved-on", set_phase("b"))  # another process writes
    fresh = await ledger.read_claim(host)
    assert fresh.state is not None and fresh.state.op.phase == "b" and len(decoded) >= 1


async def test_object_edited_behind_the_ledgers_back_is_refused(
    env: Env, unique: Callable[[str], str]
) -> None:
    host = host_name(unique, "edited")
    ledger = env.ledger()
    await ledger.transition("claim", host, "create", set_phase("a"))
    key = object_key("claim", host)
    original = await env.store.get(env.bucket, key)
    assert isinstance(original, Got)
    tampered = original.body.replace(b'"phase":"a"', b'"phase":"z"')
    await env.store.put(env.bucket, key, tampered, metadata=dict(original.metadata))
    with pytest.raises(DurableValueError) as err:
        await ledger.read_claim(host)
    assert err.value.code == "decode_failed" and err.value.limit == "ledger_written"
    with pytest.raises(DurableValueError):
        await ledger.transition("claim", host, "after-edit", set_phase("b"))
    now = await env.store.get(env.bucket, key)
    assert isinstance(now, Got) and now.body == tampered, "nothing was written"
    assert len(await history(env, "claim", host)) == 1
    check = await run_audit(env.events.inner, ledger, host=host, protocol=False)  # synthetic states
    assert not check.clean() and any("fails the boundary" in f.what for f in check.findings)


@pytest.mark.parametrize(
    ("bad", "limit"),
    [
        ({"nan": float("nan")}, "finite_number"),
        ({"surrogate": "\ud800"}, "no_lone_surrogate"),
        ({"deep": nested(130)}, "max_depth"),
        ({"nul": "a\x00"}, "no_nul"),
    ],
)
async def test_bad_input_is_refused_and_nothing_is_written(
    env: Env, unique: Callable[[str], str], bad: dict, limit: str
) -> None:
    host = host_name(unique, "bad")
    ledger = env.ledger()
    await ledger.transition("claim", host, "create", set_phase("a"))

    def decide(cur: Claim | None) -> Claim:
        assert cur is not None
        return msgspec.structs.replace(cur, inventory=bad)

    with pytest.raises(DurableValueError) as err:
        await ledger.transition("claim", host, "bad", decide)
    assert err.value.limit == limit
    assert (await ledger.read_claim(host)).state.gen == 1  # type: ignore[union-attr]
    assert len(await history(env, "claim", host)) == 1


async def test_bad_host_names_are_refused(env: Env) -> None:
    ledger = env.ledger()
    for bad in ["", "a\x00b", "\udc00x", "x" * 1025]:
        with pytest.raises(DurableValueError):
            await ledger.transition("claim", bad, "create", set_phase("a"))


async def test_store_ahead_of_missing_stream_is_a_defect_when_object_missing(
    env: Env, unique: Callable[[str], str]
) -> None:
    """History on the stream for an object the store lacks: never papered over (C6)."""
    host = host_name(unique, "vanished")
    ledger = env.ledger()
    await ledger.transition("claim", host, "create", set_phase("a"))
    await env.store.delete(env.bucket, object_key("claim", host))
    with pytest.raises(LedgerDefect):
        await env.ledger().transition("claim", host, "recreate", set_phase("b"))


async def test_property_crashes_and_lost_acks_leave_contiguous_histories(
    env: Env, unique: Callable[[str], str]
) -> None:
    rng = random.Random(20261130 if env.kind == "memory" else 7)
    hosts = [host_name(unique, f"prop{i}") for i in range(8 if env.kind == "real" else 20)]
    steps = 80 if env.kind == "real" else 400
    crashes = lost_acks = 0
    for step in range(steps):
        host = rng.choice(hosts)
        obj = rng.choice(["claim", "record"])
        fault = rng.random()
        point = "after_cas" if fault < 0.15 else "after_publish" if fault < 0.25 else None

        def faults(p: str, point: str | None = point) -> None:
            if p == point:
                raise Crash(p)

        if 0.25 <= fault < 0.35:
            env.events.lose_acks = 1
            lost_acks += 1
        ledger = env.ledger(faults)
        decide: Callable = (
            set_phase(f"p{step}")
            if obj == "claim"
            else (lambda r, h=host, s=step: Record(host=h, gen=1, extra={"step": s}))
        )
        try:
            await ledger.transition(obj, host, f"step{step}", decide)  # type: ignore[arg-type]
        except Crash:
            crashes += 1
        env.events.lose_acks = 0
    assert crashes > 5 and lost_acks > 3
    failed = await env.ledger().relay_all()  # the bucket is shared: other tests' tampered objects show here
    assert not [line for line in failed if any(h in line for h in hosts)]
    for host in hosts:
        for obj in ("claim", "record"):
            if isinstance(await env.store.get(env.bucket, object_key(obj, host)), Got):
                await assert_history_matches_store(env, obj, host)
    for host in hosts:
        check = await run_audit(env.events.inner, env.ledger(), host=host, protocol=False)
        assert check.clean(strict=True), [f.line() for f in check.findings]

