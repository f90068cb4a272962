"""The deterministic simulation (issue 5): the loop, the twins held to the real servers, the invariants,
the gate, determinism, refusals and a planted bug caught.

The contract cases are one set of functions run twice: on the twin inside a simulation run (virtual
time) and on the real servers of the ``stack`` fixture (SeaweedFS, nats-server).
"""

from __future__ import annotations

import asyncio
import contextvars
import os
import random
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import pytest_asyncio
from nats.js.api import StorageType, StreamConfig

from bus.log import LogError, StoredMessage, WrongLastSequence
from bus.nats_log import NatsEventLog
from bus.subjects import LEDGER_STREAM, ledger_msg_id, ledger_subject
from events.base import canonical
from events.claim import Admission, Claim, Holder, Op
from events.envelope import Actor, EventMeta, Transition
from hostmove.stackinfo import StackInfo
from kernel import rules
from kernel.ports import WallClock
from services.box.artifacts.markers import GenerationMarker
from services.ledger.ledger import META_SHA
from services.objstore.port import AccessDenied, Got, Lost, Missing, ObjectStore, StoreUnavailable, Won
from services.objstore.s3 import S3Store
from sim import cli
from sim.faults import FaultPlan, PublishFate, QuietPlan, RequestFate, Timing
from sim.invariants import Checker, Proc
from sim.loop import SimDeadlock, SimulationRefused, VirtualClock, run
from sim.run import run_seed
from sim.sweep import (
    Expected,
    RuleVerdict,
    classify,
    gate,
    load_expected,
    not_applicable,
    spec_rules,
    stand_in_seeds,
    sweep,
    write_results,
)
from sim.trace import Trace
from sim.twins.jetstream import Consumers, SimEventLog, SimJetStream, subject_matches
from sim.twins.nats_consumers import NatsConsumers
from sim.twins.s3 import Access, Landed, M17Policy, Principal, Request, RequestExpired, SimS3
from sim.witness import MOVE_CRASHES, PROBE_REBOOT, REPEAT_MOVES, WITNESS_BY_NAME, WITNESSES, Witness, run_witness
from sim.workload import draw_workload
from sim.world import REGIONS, World

ROOT = Path(__file__).resolve().parents[1]
TIMING = Timing()
GATE_TIMEOUT_S = 3600
"""Its wall-time bound: a hang guard, not a speed bar (that is bench/sim's). In a full `make test` its workers get a
small share of the two cores: 870 s measured at stop 24 under the whole suite, 167 s alone, so 900 s left no margin;
the world with moves took 1,034 to 1,372 s under the suite later (523 s alone) and 1,920 s on a machine that also ran
two other engineers' tests, past the 1,500 s bound that stood then."""

# =================================================================================================
# the loop and the sandbox


def test_virtual_time_jumps_and_timers_fire_in_time_order() -> None:
    async def main() -> list[tuple[str, float]]:
        loop = asyncio.get_running_loop()
        seen: list[tuple[str, float]] = []

        async def at(name: str, delay: float) -> None:
            await asyncio.sleep(delay)
            seen.append((name, loop.time()))

        await asyncio.gather(at("hour", 3600), at("minute", 60), at("day", 86400))
        return seen

    started = time.perf_counter()
    seen, loop = run(main(), seed=1)
    assert seen == [("minute", 60.0), ("hour", 3600.0), ("day", 86400.0)]
    assert time.perf_counter() - started < 1.0, "a virtual day costs no wall time"
    assert loop.time() == 86400.0


def test_a_frozen_owner_runs_nothing_while_time_moves_on_and_resumes_where_it_was() -> None:
    """SimLoop.freeze (a whole-VM pause, sim/README.md "Frozen targets"): every callback of the frozen owner's tasks
    waits, its timers included, while the others run and virtual time moves on; thawed, it continues where it was,
    with the clock jumped."""
    from sim.loop import OWNER

    async def main() -> list[tuple[str, float]]:
        loop = asyncio.get_running_loop()
        seen: list[tuple[str, float]] = []

        async def ticker(name: str) -> None:
            for _ in range(3):
                await asyncio.sleep(10.0)
                seen.append((name, loop.time()))

        def owned(name: str) -> asyncio.Task[None]:
            context = contextvars.copy_context()
            context.run(OWNER.set, name)
            return loop.create_task(ticker(name), context=context)

        tasks = [owned("a"), owned("b")]
        await asyncio.sleep(15.0)
        loop.freeze("a")  # type: ignore[attr-defined]
        await asyncio.sleep(100.0)
        loop.thaw("a")  # type: ignore[attr-defined]
        await asyncio.gather(*tasks)
        return seen

    seen, _loop = run(main(), seed=3)
    assert [t for n, t in seen if n == "b"] == [10.0, 20.0, 30.0]
    assert [t for n, t in seen if n == "a"] == [10.0, 115.0, 125.0], seen


def _interleaving(seed: int) -> list[int]:
    async def main() -> list[int]:
        order: list[int] = []

        async def step(n: int) -> None:
            for _ in range(3):
                await asyncio.sleep(0)
                order.append(n)

        await asyncio.gather(*(step(n) for n in range(6)))
        return order

    return run(main(), seed=seed)[0]


def test_ready_order_is_drawn_from_the_seed_and_replays() -> None:
    assert _interleaving(7) == _interleaving(7)
    orders = {tuple(_interleaving(s)) for s in range(8)}
    assert len(orders) > 4, "different seeds interleave differently"


@pytest.mark.parametrize(
    "call",
    [
        lambda: time.time(),
        lambda: time.monotonic(),
        lambda: random.random(),
        lambda: os.urandom(4),
        lambda: threading.Thread(target=print).start(),
        lambda: socket.socket(),
        lambda: subprocess.Popen(["true"]),
    ],
    ids=["time.time", "time.monotonic", "random.random", "os.urandom", "thread", "socket", "subprocess"],
)
def test_nondeterminism_is_refused_inside_a_run_and_restored_after(call: Callable[[], object]) -> None:
    async def main() -> None:
        call()

    with pytest.raises(SimulationRefused, match="refused in simulation mode"):
        run(main(), seed=1)
    assert time.time() > 1e9 and 0 <= random.random() < 1, "the patches are undone after the run"


def test_executors_and_real_connections_are_refused() -> None:
    async def executor() -> None:
        await asyncio.get_running_loop().run_in_executor(None, print)

    async def connection() -> None:
        await asyncio.open_connection("127.0.0.1", 1)

    for main in (executor, connection):
        with pytest.raises(SimulationRefused):
            run(main(), seed=1)


def test_a_run_that_waits_on_nothing_is_a_deadlock() -> None:
    async def main() -> None:
        await asyncio.get_running_loop().create_future()

    with pytest.raises(SimDeadlock):
        run(main(), seed=1)


# =================================================================================================
# rules


def test_rules_are_on_unless_a_simulation_switches_them_off() -> None:
    assert rules.on("hostguard")
    with rules.mutated(["hostguard"]):
        assert not rules.on("hostguard") and rules.on("exec-admission")

        async def inner() -> bool:
            return await asyncio.ensure_future(_on("hostguard"))

        assert run(inner(), seed=1)[0] is False, "tasks created inside inherit the mutation"
    assert rules.on("hostguard")
    with pytest.raises(rules.UnknownRule):
        rules.on("hostgaurd")
    with pytest.raises(rules.UnknownRule), rules.mutated(["no-such-rule"]):
        pass


async def _on(name: str) -> bool:
    return rules.on(name)


def test_every_rule_has_a_witness_or_a_declared_outcome() -> None:
    """The meta-test of model digest §8.7: no rule goes unjudged, no declaration names an unknown rule."""
    assert rules.load_all() == []
    expected = load_expected()
    witnessed = {r for w in WITNESSES for r in w.rules}
    for name, rule in sorted(rules.RULES.items()):
        assert rule.section and rule.site, name
        assert name in witnessed or name in expected, (
            f"rule {name} ({rule.site}) has neither a witness in sim/witness.py nor a line in "
            f"sim/expected-outcomes.txt; add e.g. '{name} unexercised: <why the simulation cannot reach it yet>'")


def test_every_rule_is_guarded_in_production_under_its_name() -> None:
    """Issue 17 item 1: every registered rule's guard site is production code (a file outside sim/ and tests/ that
    consults it by name), the spec's renamed rules go by the spec's names (an old name only as an alias a test reads),
    and a spec rule declared not applicable is a rule of the spec's model and no registered rule."""
    rules.load_all()
    for name, rule in sorted(rules.RULES.items()):
        path = rule.site.split()[0]
        assert not path.startswith(("sim/", "tests/")), f"{name} is guarded in {rule.site}, not in production code"
        assert f'rules.on("{name}")' in (ROOT / path).read_text(), f"{name}: {path} does not consult it"
    for old, new in (("close-record-first", "record-first-close"), ("k5-revalidate", "revalidate-before-effect"),
                     ("park-exact-versions", "park-by-version"), ("park-scope-membership", "scope-membership"),
                     ("park-verify-after-horizon", "quiet-before-ack"), ("admit-observed", "admit-bind-op")):
        assert new in rules.RULES and old not in rules.RULES, (old, new)
    assert set(rules.ALIASES) == {"k5-revalidate"}, "an alias only where a test reads the old name"
    declared, spec = not_applicable(), spec_rules()
    assert declared and set(declared) <= set(spec) and not set(declared) & set(rules.RULES)
    assert len(spec) == 109 and all(reason for reason in declared.values())


# =================================================================================================
# the object store: the same contract on the twin and on SeaweedFS


async def s3_versions_and_delete_markers(store: ObjectStore, bucket: str, prefix: str) -> None:
    key = f"{prefix}versions"
    v1 = await store.put(bucket, key, b"one")
    v2 = await store.put(bucket, key, b"two")
    assert isinstance(v1, Won) and isinstance(v2, Won) and v1.version_id != v2.version_id
    gone = await store.delete(bucket, key)
    assert isinstance(gone, Won)
    assert isinstance(await store.get(bucket, key), Missing)
    listed = await store.list_versions(bucket, key)
    assert [(e.is_latest, e.is_delete_marker) for e in listed] == [(True, True), (False, False), (False, False)]
    old = await store.get(bucket, key, version_id=v1.version_id)
    assert isinstance(old, Got) and old.body == b"one"
    await store.delete(bucket, key, version_id=gone.version_id)  # remove the marker: v2 is current again
    back = await store.get(bucket, key)
    assert isinstance(back, Got) and back.body == b"two"


async def s3_stale_etag_is_412(store: ObjectStore, bucket: str, prefix: str) -> None:
    key = f"{prefix}cas"
    first = await store.put(bucket, key, b"a", if_none_match=True)
    assert isinstance(first, Won)
    second = await store.put(bucket, key, b"b", if_match=first.etag)
    assert isinstance(second, Won)
    stale = await store.put(bucket, key, b"c", if_match=first.etag)
    assert isinstance(stale, Lost) and stale.current_etag == second.etag
    again = await store.put(bucket, key, b"d", if_none_match=True)
    assert isinstance(again, Lost)
    got = await store.get(bucket, key)
    assert isinstance(got, Got) and got.body == b"b"


async def s3_if_none_match_over_a_delete_marker(store: ObjectStore, bucket: str, prefix: str) -> None:
    key = f"{prefix}marker"
    await store.put(bucket, key, b"x")
    await store.delete(bucket, key)
    assert isinstance(await store.put(bucket, key, b"y", if_match='"0123"'), Lost)
    assert isinstance(await store.put(bucket, key, b"y", if_none_match=True), Won)


async def s3_conditional_delete(store: ObjectStore, bucket: str, prefix: str) -> None:
    key = f"{prefix}cdel"
    put = await store.put(bucket, key, b"x")
    assert isinstance(put, Won)
    assert isinstance(await store.delete(bucket, key, if_match='"ffff"'), Lost)
    assert isinstance(await store.get(bucket, key), Got)
    assert isinstance(await store.delete(bucket, key, if_match=put.etag), Won)
    assert isinstance(await store.get(bucket, key), Missing)


S3_CONTRACT = [s3_versions_and_delete_markers, s3_stale_etag_is_412, s3_if_none_match_over_a_delete_marker,
               s3_conditional_delete]


def _s3_world(loop: asyncio.AbstractEventLoop, *, timing: Timing = TIMING) -> tuple[SimS3, VirtualClock]:
    clock = VirtualClock(loop)
    server = SimS3(now_ms=clock.now_ms, rng=random.Random(5), timing=timing, trace=Trace(loop.time),
                   policy=M17Policy("deploy", {"ie": "data-ie", "uk": "data-uk"}))
    return server, clock


ADMIN = Principal("admin", "admin")


@pytest.mark.parametrize("body", S3_CONTRACT, ids=lambda f: f.__name__)
def test_s3_contract_on_the_twin(body: Callable[[ObjectStore, str, str], Awaitable[None]]) -> None:
    async def main() -> None:
        server, clock = _s3_world(asyncio.get_running_loop())
        await server.create_bucket("contract")
        await body(server.client(ADMIN, clock), "contract", "t/")

    run(main(), seed=1)


@pytest_asyncio.fixture(loop_scope="session", scope="module")
async def real_s3(stack: StackInfo, unique: Callable[[str], str]) -> AsyncIterator[tuple[S3Store, str]]:
    store = await S3Store.open(stack.s3_endpoint, stack.s3_access_key, stack.s3_secret_key, stack.s3_region)
    bucket = unique("simct")
    await store.create_bucket(bucket)
    yield store, bucket
    await store.delete_bucket(bucket)
    await store.close()


@pytest.mark.parametrize("body", S3_CONTRACT, ids=lambda f: f.__name__)
async def test_s3_contract_on_seaweedfs(body: Callable[[ObjectStore, str, str], Awaitable[None]],
                                        real_s3: tuple[S3Store, str], unique: Callable[[str], str]) -> None:
    store, bucket = real_s3
    await body(store, bucket, unique("t") + "/")


SignedPut = Callable[[str, float], Awaitable[int]]
"""``put(key, minutes)``: a PUT signed ``minutes`` before it is sent (negative: in the future); the status."""


async def s3_signature_age_limit(put: SignedPut, get: Callable[[str], Awaitable[bool]]) -> None:
    statuses = [await put(f"sig{m}", m) for m in (0, 14, 16, -16)]
    assert statuses == [200, 200, 403, 403], "refused once the signature is 15 minutes off the server's time"
    assert await get("sig14") and not await get("sig16"), "a refused request applies nothing"


def test_signature_age_on_the_twin() -> None:
    async def main() -> None:
        server, clock = _s3_world(asyncio.get_running_loop())
        await server.create_bucket("deploy")
        admin = server.client(ADMIN, clock)

        async def put(key: str, minutes: float) -> int:
            signer = server.client(ADMIN, clock.skewed(-round(minutes * 60_000)))
            try:
                await signer.put("deploy", key, b"x")
            except RequestExpired:
                return 403
            return 200

        async def get(key: str) -> bool:
            return isinstance(await admin.get("deploy", key), Got)

        await s3_signature_age_limit(put, get)

    run(main(), seed=1)


async def test_signature_age_on_seaweedfs(real_s3: tuple[S3Store, str], stack: StackInfo,
                                          unique: Callable[[str], str], monkeypatch: pytest.MonkeyPatch) -> None:
    import datetime

    import aiohttp
    import botocore.auth
    import botocore.awsrequest
    import botocore.credentials

    store, bucket = real_s3
    prefix = unique("sig")
    creds = botocore.credentials.Credentials(stack.s3_access_key, stack.s3_secret_key)

    async def put(key: str, minutes: float) -> int:
        when = datetime.datetime.now(datetime.UTC).replace(tzinfo=None) - datetime.timedelta(minutes=minutes)
        monkeypatch.setattr(botocore.auth, "get_current_datetime", lambda: when)
        req = botocore.awsrequest.AWSRequest(method="PUT", url=f"{stack.s3_endpoint}/{bucket}/{prefix}/{key}",
                                             data=b"x")
        botocore.auth.S3SigV4Auth(creds, "s3", stack.s3_region).add_auth(req)
        monkeypatch.undo()
        prepared = req.prepare()
        async with aiohttp.ClientSession() as http, http.put(prepared.url, data=b"x",
                                                             headers=dict(prepared.headers)) as resp:
            if resp.status == 403:
                assert "RequestTimeTooSkewed" in await resp.text()
            return resp.status

    async def get(key: str) -> bool:
        return isinstance(await store.get(bucket, f"{prefix}/{key}"), Got)

    await s3_signature_age_limit(put, get)


# -- twin only: what the real server's port cannot show -------------------------------------------


@dataclass
class Fixed:
    fate: RequestFate

    def s3_request(self, op: str, key: str, timing: Timing, *, long_tail_p: float = 0.0) -> RequestFate:
        return self.fate


def test_a_request_signed_more_than_15_minutes_before_it_arrives_is_refused() -> None:
    async def main() -> None:
        server, clock = _s3_world(asyncio.get_running_loop())
        await server.create_bucket("deploy")
        admin = server.client(ADMIN, clock)
        stale = server.client(ADMIN, clock, fates=Fixed(RequestFate(pause_after_sign=16 * 60)))
        with pytest.raises(RequestExpired, match="RequestTimeTooSkewed"):
            await stale.put("deploy", "k", b"late")
        assert isinstance(await admin.get("deploy", "k"), Missing), "nothing was applied"
        fresh = server.client(ADMIN, clock, fates=Fixed(RequestFate(pause_after_sign=14 * 60)))
        assert isinstance(await fresh.put("deploy", "k", b"in time"), Won)
        ahead = server.client(ADMIN, clock.skewed(16 * 60 * 1000))
        with pytest.raises(RequestExpired):
            await ahead.get("deploy", "k")
        paused_before = server.client(ADMIN, clock, fates=Fixed(RequestFate(pause_before_sign=60 * 60)))
        assert isinstance(await paused_before.get("deploy", "k"), Got), "a pause before signing signs fresh"

    run(main(), seed=1)


def test_late_completion_lands_after_the_caller_gave_up_and_its_412_is_judged_then() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        server, clock = _s3_world(loop)
        await server.create_bucket("deploy")
        admin = server.client(ADMIN, clock)
        late = server.client(ADMIN, clock, fates=Fixed(RequestFate(processing=100.0)))
        with pytest.raises(StoreUnavailable, match="outcome is unknown"):
            await late.put("deploy", "late", b"eventually")
        assert loop.time() == pytest.approx(30.0, abs=0.1), "the caller gave up at its timeout"
        assert isinstance(await admin.get("deploy", "late"), Missing)
        await asyncio.sleep(80)
        got = await admin.get("deploy", "late")
        assert isinstance(got, Got) and got.body == b"eventually", "the request landed long after"
        # a create-only PUT that lands after someone else created the key: 412 at completion
        creator = server.client(ADMIN, clock, fates=Fixed(RequestFate(processing=100.0)))
        with pytest.raises(StoreUnavailable):
            await creator.put("deploy", "race", b"late", if_none_match=True)
        assert isinstance(await admin.put("deploy", "race", b"first", if_none_match=True), Won)
        await asyncio.sleep(80)
        got = await admin.get("deploy", "race")
        assert isinstance(got, Got) and got.body == b"first"
        assert server.idle()

    run(main(), seed=1)


def test_lost_response_applies_and_a_crashed_caller_does_not_stop_its_request() -> None:
    async def main() -> None:
        server, clock = _s3_world(asyncio.get_running_loop())
        await server.create_bucket("deploy")
        admin = server.client(ADMIN, clock)
        lossy = server.client(ADMIN, clock, fates=Fixed(RequestFate(lost_response=True)))
        with pytest.raises(StoreUnavailable, match="connection reset"):
            await lossy.put("deploy", "lost", b"applied")
        assert isinstance(await admin.get("deploy", "lost"), Got)
        slow = server.client(ADMIN, clock, fates=Fixed(RequestFate(transit=5.0)))
        caller = asyncio.ensure_future(slow.put("deploy", "orphan", b"still lands"))
        await asyncio.sleep(1.0)
        caller.cancel()  # the caller's process dies with the request on the wire
        await asyncio.sleep(10.0)
        got = await admin.get("deploy", "orphan")
        assert isinstance(got, Got) and got.body == b"still lands"

    run(main(), seed=1)


M17 = M17Policy("deploy", {"ie": "data-ie", "uk": "data-uk"})
IE = Principal("box", "ie-1", "ie")
CONSOLE = Principal("console", "console")


@pytest.mark.parametrize(
    ("who", "access", "allowed"),
    [
        (IE, Access("put", "data-ie", "instances/h/x/generation.json"), True),
        (IE, Access("list_versions", "data-ie", "instances/"), True),
        (IE, Access("delete_version", "data-ie", "instances/h/x/a"), True),
        (IE, Access("put", "data-uk", "moves/h/mv_1/staging/a"), True),
        (IE, Access("delete", "data-uk", "moves/h/mv_1/staging/a"), True),
        (IE, Access("list_keys", "data-uk", "moves/h/mv_1/"), True),
        (IE, Access("get", "data-uk", "moves/h/mv_1/staging/a"), False),
        (IE, Access("put", "data-uk", "instances/h/x/a"), False),
        (IE, Access("list_versions", "data-uk", "moves/"), False),
        (IE, Access("delete_version", "data-uk", "moves/h/a"), False),
        (IE, Access("list_keys", "data-uk", ""), False),
        (IE, Access("put", "deploy", "control/hosts/h.json"), True),
        (IE, Access("delete", "deploy", "control/hosts/h.json"), False),
        (IE, Access("put", "deploy", "other/x"), False),
        (IE, Access("create_bucket", "data-ie", ""), False),
        (CONSOLE, Access("delete", "deploy", "control/x"), True),
        (CONSOLE, Access("get", "data-uk", "instances/h/x/a"), True),
        (CONSOLE, Access("put", "data-uk", "instances/h/x/a"), False),
    ],
)
def test_the_m17_policy(who: Principal, access: Access, allowed: bool) -> None:
    reason = M17(who, access)
    assert (reason is None) == allowed, reason


def test_a_denied_request_is_refused_and_recorded() -> None:
    async def main() -> None:
        server, clock = _s3_world(asyncio.get_running_loop())
        await server.create_bucket("data-uk")
        seen: list[str] = []
        server.on_denied = seen.append
        box = server.client(IE, clock)
        with pytest.raises(AccessDenied, match="M17"):
            await box.put("data-uk", "instances/h/x/a", b"no")
        assert len(seen) == 1 and "box:ie-1 put data-uk/instances/h/x/a" in seen[0]
        assert isinstance(await box.put("data-uk", "moves/h/mv_1/a", b"yes"), Won)

    run(main(), seed=1)


# =================================================================================================
# JetStream: the same contract on the twin and on nats-server


@dataclass
class JsEnv:
    log: SimEventLog | NatsEventLog
    consumers: Consumers
    clock: WallClock | VirtualClock
    make_stream: Callable[[float], Awaitable[tuple[str, str]]]
    crash: Callable[[], Awaitable[None]]


async def js_dedup_then_expected_sequence(env: JsEnv) -> None:
    stream, p = await env.make_stream(60.0)
    first = await env.log.publish(stream, f"{p}.a", b"1", msg_id="m1", expected_last_subject_seq=0)
    assert (first.seq, first.duplicate) == (1, False)
    with pytest.raises(WrongLastSequence):  # the retry with the same id: 10071 before dedup (stack facts §3)
        await env.log.publish(stream, f"{p}.a", b"1", msg_id="m1", expected_last_subject_seq=0)
    dup = await env.log.publish(stream, f"{p}.a", b"1", msg_id="m1")
    assert (dup.seq, dup.duplicate) == (1, True)
    other = await env.log.publish(stream, f"{p}.b", b"x", msg_id="m1")
    assert other.duplicate, "dedup is stream-wide"
    b = await env.log.publish(stream, f"{p}.b", b"2", msg_id="m2", expected_last_subject_seq=0)
    c = await env.log.publish(stream, f"{p}.a", b"3", msg_id="m3", expected_last_subject_seq=1)
    assert (b.seq, c.seq) == (2, 3), "subjects are checked independently"
    with pytest.raises(WrongLastSequence):
        await env.log.publish(stream, f"{p}.a", b"4", msg_id="m4", expected_last_subject_seq=1)
    last = await env.log.last(stream, f"{p}.a")
    assert last is not None and (last.seq, last.msg_id, last.data) == (3, "m3", b"3")


async def js_dedup_window_expires(env: JsEnv) -> None:
    stream, p = await env.make_stream(1.0)
    await env.log.publish(stream, f"{p}.a", b"1", msg_id="w")
    assert (await env.log.publish(stream, f"{p}.a", b"1", msg_id="w")).duplicate
    await env.clock.sleep(1.6)
    again = await env.log.publish(stream, f"{p}.a", b"1", msg_id="w")
    assert (again.seq, again.duplicate) == (2, False), "the same id is new once the window has passed"


async def _seqs(env: JsEnv, stream: str, durable: str, batch: int, timeout: float) -> list[tuple[int, int]]:
    got = await env.consumers.fetch(stream, durable, batch=batch, timeout=timeout)
    return [(d.msg.seq, d.num_delivered) for d in got]


async def js_redelivery_after_ack_wait(env: JsEnv) -> None:
    stream, p = await env.make_stream(60.0)
    await env.consumers.add_consumer(stream, "c", filter_subject=f"{p}.>", ack_wait_s=1.0)
    await env.log.publish(stream, f"{p}.a", b"1")
    assert await _seqs(env, stream, "c", 1, 1.0) == [(1, 1)]
    assert await _seqs(env, stream, "c", 1, 0.3) == [], "not before the ack wait"
    got = await env.consumers.fetch(stream, "c", batch=1, timeout=3.0)
    assert [(d.msg.seq, d.num_delivered) for d in got] == [(1, 2)]
    await got[0].ack()
    assert await _seqs(env, stream, "c", 1, 1.3) == [], "an acknowledged message is not redelivered"


async def js_nak_with_delay(env: JsEnv) -> None:
    stream, p = await env.make_stream(60.0)
    await env.consumers.add_consumer(stream, "c", filter_subject=f"{p}.>", ack_wait_s=30.0)
    await env.log.publish(stream, f"{p}.a", b"1")
    (first,) = await env.consumers.fetch(stream, "c", batch=1, timeout=1.0)
    await first.nak(0.6)
    assert await _seqs(env, stream, "c", 1, 0.2) == []
    got = await env.consumers.fetch(stream, "c", batch=1, timeout=2.0)
    assert [(d.msg.seq, d.num_delivered) for d in got] == [(1, 2)]
    await got[0].ack()


async def js_out_of_order_after_a_consumer_crash(env: JsEnv) -> None:
    stream, p = await env.make_stream(60.0)
    await env.consumers.add_consumer(stream, "c", filter_subject=f"{p}.>", ack_wait_s=1.0)
    for i in range(3):
        await env.log.publish(stream, f"{p}.a", str(i).encode())
    assert await _seqs(env, stream, "c", 3, 1.0) == [(1, 1), (2, 1), (3, 1)]
    await env.crash()  # the consumer dies holding three unacknowledged messages
    for i in range(3, 6):
        await env.log.publish(stream, f"{p}.a", str(i).encode())
    assert await _seqs(env, stream, "c", 3, 0.5) == [(4, 1), (5, 1), (6, 1)], "newer messages come first"
    got = await env.consumers.fetch(stream, "c", batch=3, timeout=3.0)
    assert [(d.msg.seq, d.num_delivered) for d in got] == [(1, 2), (2, 2), (3, 2)], "then the old ones"
    for d in got:
        await d.ack()


async def js_max_deliver(env: JsEnv) -> None:
    stream, p = await env.make_stream(60.0)
    await env.consumers.add_consumer(stream, "c", filter_subject=f"{p}.>", ack_wait_s=1.0, max_deliver=2)
    await env.log.publish(stream, f"{p}.a", b"poison")
    assert await _seqs(env, stream, "c", 1, 1.0) == [(1, 1)]
    assert await _seqs(env, stream, "c", 1, 3.0) == [(1, 2)]
    assert await _seqs(env, stream, "c", 1, 2.5) == [], "never a third delivery"


JS_CONTRACT = [js_dedup_then_expected_sequence, js_dedup_window_expires, js_redelivery_after_ack_wait,
               js_nak_with_delay, js_out_of_order_after_a_consumer_crash, js_max_deliver]


@pytest.mark.parametrize("body", JS_CONTRACT, ids=lambda f: f.__name__)
def test_jetstream_contract_on_the_twin(body: Callable[[JsEnv], Awaitable[None]]) -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        clock = VirtualClock(loop)
        server = SimJetStream(now_ms=clock.now_ms)
        log = SimEventLog(server, "test")

        async def make_stream(window_s: float) -> tuple[str, str]:
            server.windows["CT"] = int(window_s * 1000)
            return "CT", "ct"

        async def crash() -> None:
            return None  # the twin keeps no client-side state: the server's pending set is the truth

        await body(JsEnv(log, log, clock, make_stream, crash))

    run(main(), seed=1)


@pytest_asyncio.fixture(loop_scope="session")
async def real_js(stack: StackInfo, unique: Callable[[str], str]) -> AsyncIterator[JsEnv]:
    log = await NatsEventLog.connect(stack.nats_url)
    consumers = NatsConsumers(log.js)
    made: list[str] = []

    async def make_stream(window_s: float) -> tuple[str, str]:
        token = unique("simct").replace("-", "_")
        name = token.upper()
        await log.js.add_stream(StreamConfig(name=name, subjects=[f"{token}.>"], storage=StorageType.MEMORY,
                                             duplicate_window=window_s))
        made.append(name)
        return name, token

    try:
        yield JsEnv(log, consumers, WallClock(), make_stream, consumers.crash)
    finally:
        await consumers.crash()
        for name in made:
            await log.js.delete_stream(name)
        await log.close()


@pytest.mark.parametrize("body", JS_CONTRACT, ids=lambda f: f.__name__)
async def test_jetstream_contract_on_nats_server(body: Callable[[JsEnv], Awaitable[None]], real_js: JsEnv) -> None:
    await body(real_js)


def test_subject_matching() -> None:
    assert subject_matches("hm.ledger.claim.*", "hm.ledger.claim.h1")
    assert not subject_matches("hm.ledger.claim.*", "hm.ledger.record.h1")
    assert not subject_matches("hm.ledger.claim.*", "hm.ledger.claim.h1.x")
    assert subject_matches("hm.>", "hm.ledger.claim.h1") and not subject_matches("hm.>", "hm")


def test_the_twin_publish_faults_come_from_the_plan() -> None:
    class LoseAck:
        def publish(self) -> PublishFate:
            return PublishFate(lose_ack=True)

        def fault(self, name: str, p: float) -> bool:
            return False

    async def main() -> None:
        clock = VirtualClock(asyncio.get_running_loop())
        server = SimJetStream(now_ms=clock.now_ms)
        with pytest.raises(LogError, match="acknowledgement was lost"):
            await SimEventLog(server, "t", fates=LoseAck()).publish("S", "s.a", b"x", msg_id="i")
        assert [m.seq for m in server.messages("S")] == [1], "stored although the caller never heard"

    run(main(), seed=1)


# =================================================================================================
# the invariants (pure checks on what lands)


def _checker() -> tuple[Checker, list[str]]:
    lines: list[str] = []
    return Checker(1, lambda: 0.0, lambda a, w: lines.append(w), "deploy"), lines


def _landed(key: str, body: bytes | None, *, bucket: str = "deploy", op: str = "put",
            meta: dict[str, str] | None = None) -> Landed:
    req = Request(1, IE, Access(op, bucket, key), 0, RequestFate())
    return Landed(req, op, bucket, key, "v", body, meta or {})  # type: ignore[arg-type]


def _claim_landed(claim: Claim) -> Landed:
    import hashlib

    body = canonical(claim)
    return _landed(f"control/hosts/{claim.host}.json", body, meta={META_SHA: hashlib.sha256(body).hexdigest()})


def _serving(gen: int, session: int, box: str = "ie-1", generation: str = "g") -> Claim:
    admissions = (Admission(session=session, box=box, generation=generation, region="ie"),) if session else ()
    holder = Holder(incarnation="ab" * 32, location="instances/h/x/", generation=generation, session=session,
                    writer_box=box if session else "", admissions=admissions)
    return Claim(host="h", gen=gen, holder=holder, op=Op(kind="serving", exec=box, participants=(box,)))


def test_checker_flags_a_deleted_claim_and_a_write_outside_the_ledger() -> None:
    c, _ = _checker()
    c.on_landed(_landed("control/hosts/h.json", None, op="delete"))
    c.on_landed(_landed("control/hosts/g.json", b'{"host":"g","gen":1}'))
    assert [v.invariant for v in c.violations] == ["C5a", "durable-boundary"]


def test_checker_flags_two_writes_of_one_gen_and_a_marker_going_back() -> None:
    c, lines = _checker()
    c.on_landed(_claim_landed(_serving(3, 3, generation="g3")))
    c.on_landed(_claim_landed(_serving(4, 4, generation="g4")))
    c.on_landed(_claim_landed(_serving(4, 4, generation="other")))
    assert [v.invariant for v in c.violations] == ["ledger-history"]
    marker = "instances/h/x/generation.json"
    for gen in ("g4", "g3"):
        body = canonical(GenerationMarker(op=gen, incarnation="ab" * 32, host="h", box="ie-1", installed_at=1))
        c.on_landed(_landed(marker, body, bucket="data-ie"))
    assert c.violations[-1].invariant == "marker-order" and "back from generation g4" in c.violations[-1].what
    assert any(line.startswith("VIOLATION marker-order") for line in lines)


def test_checker_flags_a_gap_a_rebase_and_a_second_writer() -> None:
    c, _ = _checker()
    claims = [_serving(g, 0) for g in (1, 2, 3)]
    for claim in claims:
        c.on_landed(_claim_landed(claim))
    actor = Actor(service="t", pid=1, nonce="n")

    def event(claim: Claim, kind: str = "transition") -> StoredMessage:
        t = Transition(kind=kind, object="claim", host="h", gen=claim.gen,  # type: ignore[arg-type]
                       meta=EventMeta(name="x", actor=actor, at=1), claim=claim)
        return StoredMessage(claim.gen, ledger_subject("claim", "h"), canonical(t),
                             {"Nats-Msg-Id": ledger_msg_id("claim", "h", claim.gen)})

    c.on_message(LEDGER_STREAM, event(claims[0]))
    c.on_message(LEDGER_STREAM, event(claims[2]))
    assert c.violations[-1].what == "the claim of h: gen 3 follows gen 1 on the stream"
    c.on_message(LEDGER_STREAM, event(claims[2], "rebase"))
    assert "rebased" in c.violations[-1].what
    c.procs.append(Proc("uk-1", "h", 7, "g"))
    c.check_writers("h")
    assert c.violations[-1].invariant == "INV-1"


# =================================================================================================
# the simulation: runs, determinism, the gate, a planted bug, the sweep


def test_a_seed_runs_the_real_code_paths_to_quiescence() -> None:
    result = run_seed(1, trace=True)
    assert not result.violations and result.error is None
    text = "\n".join(result.trace)
    for what in ("create h", "registered (roster gen", "admitted h", "marker of h", "crash #", "calm phase",
                 "admin: "):
        assert what in text, what
    assert result.counters["admissions"] > 0 and result.counters["faults_fired"] > 0


def test_the_same_seed_gives_the_same_trace_in_another_process() -> None:
    """Determinism across processes and hash seeds: nothing in a run depends on PYTHONHASHSEED."""
    here = run_seed(11)
    lines = []
    for hash_seed in ("0", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        out = subprocess.run([sys.executable, "-m", "sim", "--seed", "11"], cwd=ROOT, env=env, capture_output=True,
                             text=True, timeout=120, check=False)
        assert out.returncode == 0, out.stdout + out.stderr
        lines.append(out.stdout.strip().splitlines()[-1])
    assert lines[0] == lines[1] == f"seed=11 steps={here.steps} trace={here.trace_hash}"


@pytest.mark.timeout(GATE_TIMEOUT_S)
def test_the_gate() -> None:
    """The gate (issue 17 item 3): 300 seeds of the world with moves (the production agents, door and recovery pass
    under chaos: crashes, reboots, lost disks, store and bus faults, failpoints, sleeping hosts, aborts; each host
    moved one to three times) and the seeds of the first 300 of the world without moves that check what the other
    does not (``stand_in_seeds``: about 250), each once and clean, the first ten of each again to the same trace,
    every witness three ways and every scenario. (A machine replaced under a new label: the scripted test below, and
    some of the seeds.)"""
    started = time.perf_counter()
    lines: list[str] = []
    report = gate(300, out=lines.append)
    assert report.ok, "\n".join(lines[-60:])
    assert len({r.trace_hash for r in report.results}) == 300, "different seeds give different traces"
    total = {k: sum(r.counters.get(k, 0) for r in report.results)
             for k in ("moves_done", "moves_aborted", "moves_rolled_back", "idle_stops", "wake_requests", "disks_lost",
                       "reboots", "crashes", "faults_fired")}
    assert total["moves_done"] >= 300 and total["moves_aborted"] >= 10, f"the seeds move hosts: {total}"
    assert total["idle_stops"] >= 1000 and total["wake_requests"] >= 300, f"hosts sleep and are woken: {total}"
    assert total["disks_lost"] >= 30 and total["reboots"] >= 60, f"boxes reboot and lose their disks: {total}"
    several = sum(1 for r in report.results if r.counters.get("moves_done", 0) >= 2)
    assert several >= 100, f"hosts move several times a seed ({several} seeds with two moves done or more)"
    unexercised = {n for n, e in load_expected().items() if e.kind == "unexercised"}
    never = sorted(n for n in rules.RULES if not report.consulted.get(n) and n not in unexercised)
    assert not never, f"guards the gate's production code never consults (reach them, or declare them): {never}"
    assert time.perf_counter() - started < GATE_TIMEOUT_S


def test_the_gate_runs_the_world_without_moves_only_where_it_checks_more() -> None:
    """The world without moves' seeds in the gate are those whose workload draws a bias the world with moves never
    has (it keeps only the hosts of the same draw); the seeds left out draw none."""
    chosen = stand_in_seeds(300)
    assert 200 <= len(chosen) < 300 and chosen == sorted(chosen)
    for seed in range(40):  # the world without moves draws its workload first (sim.run.random_world)
        drawn = draw_workload(FaultPlan(seed), {f"{r}-1": r for r in REGIONS}, TIMING)
        assert (seed in chosen) == (drawn.concurrent_batches or drawn.wrong_box or drawn.marker_tail)


def test_a_planted_bug_is_caught_and_its_trace_shows_it() -> None:
    """Switch the host guard off: some seed runs two wake passes of one host at once on one box."""
    caught = next((r for r in (run_seed(s, mutate=["hostguard"]) for s in range(40)) if r.violations), None)
    assert caught is not None, "no seed in 40 caught the missing host guard"
    v = caught.violations[0]
    assert v.invariant == "INV-1" and v.line().startswith(f"VIOLATION seed={caught.seed} INV-1: ")
    assert any(line.endswith(f"VIOLATION INV-1: {v.what}") for line in caught.trace)
    starts = [line for line in caught.trace if " start h" in line and "session" in line]
    assert len(starts) >= 2, "the trace shows the processes that ran at once"
    assert not run_seed(int(caught.seed), mutate=()).violations, "the same seed holds with the rule on"


def test_the_cli_replays_a_violating_seed(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--seed", "0", "--rules", "admit-before-start"]) == 1
    out = capsys.readouterr().out
    assert out.startswith("VIOLATION seed=0 INV-1: ")
    assert "--- trace of seed 0 with admit-before-start off" in out and "VIOLATION INV-1" in out
    assert cli.main(["--seed", "0"]) == 0
    assert cli.main(["--seed", "0", "--rules", "no-such-rule"]) == 2


def test_the_sweep_classifies_and_writes_results(tmp_path: Path) -> None:
    lines: list[str] = []
    verdicts = sweep(4, rule_names=["admit-before-start", "exec-admission"], jobs=1, out=lines.append)
    by_rule = {v.rule: v for v in verdicts}
    assert by_rule["admit-before-start"].verdict == "CAUGHT"
    assert by_rule["admit-before-start"].hits == 4 and by_rule["admit-before-start"].witness == "violated"
    assert by_rule["exec-admission"].verdict == "EXPECTED-MISS" and by_rule["exec-admission"].consulted > 0
    out = tmp_path / "RESULTS.md"
    write_results(verdicts, 4, out)
    text = out.read_text()
    assert "| CAUGHT | `admit-before-start` | 4 of 4 | 0 | 0 of 0 |  | violated |" in text
    assert "VIOLATION seed=0 INV-1" in text


def test_the_sweep_runs_the_rules_over_seeds_of_the_world_with_moves(tmp_path: Path) -> None:
    """``--move-seeds``: each rule also over the first seeds of the world with moves, each in a fresh process; a
    violation there counts as a detection with its own first seed and replay line."""
    (v,) = sweep(1, rule_names=["record-first-close"], jobs=1, out=lambda _line: None, move_seeds=1)
    assert (v.verdict, v.hits, v.move_seeds, v.move_hits, v.first_move_seed) == ("CAUGHT", 0, 1, 1, 0)
    assert v.first_move_violation.startswith("VIOLATION seed=0 ")
    out = tmp_path / "RESULTS.md"
    write_results([v], 1, out, move_seeds=1)
    text = out.read_text()
    assert "`hostmove sim sweep --seeds 1 --move-seeds 1`" in text
    assert "| CAUGHT | `record-first-close` | 0 of 1 |  | 1 of 1 | 0 |" in text
    assert "hostmove sim moves --first N --seeds 1 --rules RULE --trace" in text


def test_a_sweep_resumes_from_its_journal_and_runs_only_what_a_rule_can_change(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 17 item 4: every finished run is journaled (sim/deep.py), so a sweep started again takes every run it
    finished from the journal and runs only the rest (a line the interruption cut short runs again); and a seed whose
    unmutated run never consulted a rule runs the same with it off, so it is not run again mutated."""
    import json

    import sim.sweep as sweeping

    first = sweep(3, rule_names=["hostguard", "record-first-close"], jobs=1, out=lambda _l: None, journal=tmp_path)
    (path,) = tmp_path.glob("sweep-*/runs.jsonl")
    keys = [json.loads(line)["key"] for line in path.read_text().splitlines()]
    assert sorted(k for k in keys if k.startswith("stand-in||")) == [f"stand-in||{s}" for s in range(3)]
    assert not [k for k in keys if k.startswith("stand-in|record-first-close|")], "never consulted there: not rerun"
    assert any(k.startswith("stand-in|hostguard|") for k in keys) and "wMove|record-first-close|wMove" in keys
    lines = path.read_text().splitlines()
    path.write_text("\n".join(lines[:-1]) + "\n" + lines[-1][: len(lines[-1]) // 2])  # the last run cut short
    ran: list[tuple[object, ...]] = []

    def counted(fn: object) -> object:
        def run(*args: object) -> object:
            ran.append(args)
            return fn(*args)  # type: ignore[operator]
        return run

    monkeypatch.setattr(sweeping, "_seed", counted(sweeping._seed))
    monkeypatch.setattr(sweeping, "_witness", counted(sweeping._witness))
    again = sweep(3, rule_names=["hostguard", "record-first-close"], jobs=1, out=lambda _l: None, journal=tmp_path)
    assert [v.line() for v in again] == [v.line() for v in first]
    assert len(ran) == 1, f"only the run cut short runs again: {ran}"


@pytest.mark.parametrize(
    ("hits", "witness", "consulted", "expected", "verdict"),
    [
        (3, "none", 9, None, "CAUGHT"),
        (0, "violated", 9, None, "CAUGHT"),
        (0, "none", 9, None, "MISSED"),
        (0, "none", 0, Expected("r", "unexercised", "x"), "EXPECTED-MISS"),
        (0, "none", 5, Expected("r", "unexercised", "x"), "MISSED"),
        (0, "none", 5, Expected("r", "combination", "x"), "EXPECTED-MISS"),
        (2, "none", 5, Expected("r", "combination", "x"), "STALE"),
        (0, "none", 5, Expected("r", "rare", "", 30000), "EXPECTED-MISS"),
        (1, "none", 5, Expected("r", "rare", "", 30000), "CAUGHT"),
    ],
)
def test_classification(hits: int, witness: str, consulted: int, expected: Expected | None, verdict: str) -> None:
    v = classify(RuleVerdict("r", "", 100, hits=hits, witness=witness, consulted=consulted), expected)
    assert v.verdict == verdict, v.note
    errored = classify(RuleVerdict("r", "", 100, hits=3, errors=["seed 4: SimDeadlock"]), None)
    assert errored.verdict == "ERROR", "a harness failure is never a detection"


def test_a_quiet_plan_draws_nothing_harmful() -> None:
    plan = QuietPlan("w")
    fate = plan.s3_request("put", "k", TIMING)
    assert fate == RequestFate(transit=0.002, answer=0.002)
    assert plan.token("x", 8) != plan.token("x", 8), "ids stay distinct"
    noisy = FaultPlan(3)
    assert sum(noisy.fault("f", 0.5) for _ in range(200)) > 50
    noisy.calm = True
    assert not any(noisy.fault("f", 0.9) for _ in range(50)), "no fault fires in the calm phase"



# =================================================================================================
# moves: the production agents, the door and the recovery pass in the simulation (sim/moves.py)


def _move_trace(result: object) -> str:
    return "\n".join(getattr(result, "trace", ()))


def test_a_move_runs_the_real_runners_and_every_acknowledged_write_is_served() -> None:
    """wMove unmutated: the door's request, the source's rounds and cut, the landing, both parks and the close,
    with writes acknowledged before and after; the final oracle (INV-2, INV-10, the protocol audit) passes."""
    result = run_witness(WITNESS_BY_NAME["wMove"], trace=True)
    assert not result.violations and result.error is None, result.report()
    text = _move_trace(result)
    for what in (" requested from ie to uk", "preparing round", "cutting: ", "landing: ", "(probe)",
                 "park park-staging", "move-done", "write before4 to h1.example on ie-1: acknowledged",
                 "write after2 to h1.example on uk-1: acknowledged", "list_versions hostmove-data-uk/moves/"):
        assert what in text, what
    assert result.counters["violations"] == 0


def test_a_move_survives_both_agents_crashing_mid_move() -> None:
    """INV-3 and INV-2 across an agent crash in the cut and another in the landing (memory lost, disk kept)."""
    result = run_witness(MOVE_CRASHES, trace=True)
    assert not result.violations and result.error is None, result.report()
    text = _move_trace(result)
    assert "crash #1 (witness: the source agent dies in its cut)" in text
    assert "crash #1 (witness: the target agent dies in its landing)" in text
    assert "move-done" in text and "write after2 to h1.example on uk-1: acknowledged" in text


def test_a_sequence_of_moves_ends_done_and_the_repeat_move_defect_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """move-liveness (issue 17 item 5): wRepeatMoves takes one host ie -> uk -> us -> ie with no fault, every move
    done. The defect it exists for, planted again: the agent's readiness URL looks only at instances it woke itself,
    so the second move, off the box the host landed on, never sees its source ready, stalls in preparing and aborts
    itself after the preparing bound; move-liveness reports it (the calm phase's INV-3 would only have said, hours
    later, that the world never came to rest)."""
    result = run_witness(REPEAT_MOVES, trace=True)
    assert not result.violations and result.error is None, result.report()
    assert result.counters["moves_done"] == 3 and result.counters["moves_aborted"] == 0
    text = _move_trace(result)
    for hop in ("from ie to uk", "from uk to us", "from us to ie"):
        assert f"requested {hop}" in text, hop

    import services.agent.service as service

    def ready_url_of_woken_only(self: service.BoxAgent, host: str) -> str | None:
        running = self.instances.get(host)
        return f"{running.url}/ready" if running is not None and running.origin == "wake" else None

    monkeypatch.setattr(service.BoxAgent, "_ready_url", ready_url_of_woken_only)
    planted = run_witness(REPEAT_MOVES)
    assert [v.invariant for v in planted.violations] == ["move-liveness"], planted.report()
    assert "move 2 of h1.example" in planted.violations[0].what and "ended aborted" in planted.violations[0].what


def test_a_probe_killed_with_its_box_releases_dirty_and_its_write_comes_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """INV-2 (§7.8 ``released``, §5.3 step 5): wProbeReboot freezes uk-1 the moment its probe has acknowledged a
    row, lets the landing's deadline roll the move back and has the platform reboot uk-1 with its disk. The release
    flushes the dead probe's WAL before it hashes the database, so it is dirty and ie-1 serves the row. The defect,
    planted again (the agent gives the landing no flush): the release reads the database as installed, is clean,
    and the row is lost with no session declared lost (move seed 250 with issue 19 item 9)."""
    result = run_witness(PROBE_REBOOT, trace=True)
    assert not result.violations and result.error is None, result.report()
    text = _move_trace(result)
    assert "reboot: boot 2, every process of the box died, its disk kept" in text
    assert "dirty (the target's database changed after it was installed (its probe wrote))" in text

    import services.agent.service as service
    from services.target.worker import TargetBox

    def without_flush(**kw: object) -> TargetBox:
        return TargetBox(**{**kw, "flush_orphan": None})  # type: ignore[arg-type]

    monkeypatch.setattr(service, "TargetBox", without_flush)
    planted = run_witness(PROBE_REBOOT)
    assert {v.invariant for v in planted.violations} == {"INV-2"}, planted.report()
    assert "probe-" in planted.violations[0].what and "no admission declared that session lost" in \
        planted.violations[0].what


def test_a_lost_acknowledged_write_is_inv2() -> None:
    """The INV-2 oracle is not vacuous: a write acknowledged by a session nobody declared lost, missing from the
    serving database and from a cold restore of the serving generation, is reported by both forms."""
    from sim.moves import MoveWorld
    from sim.twins.box import Ack

    seen: list[MoveWorld] = []

    async def script(world: World) -> None:
        assert isinstance(world, MoveWorld)
        seen.append(world)
        await WITNESS_BY_NAME["wMove"].script(world)
        world.acks.append(Ack("h1.example", "uk-1", 999, "uk-1:0", 424242, "never-written", 0.0))

    w = Witness("wLost", (), "INV-2", (("h1.example", "ie-1"),), script, "", moves=True)
    result = run_witness(w)
    assert [v.invariant for v in result.violations] == ["INV-2", "INV-2"], result.report()
    cold, serving = (v.what for v in result.violations)
    assert "never-written" in cold and "a cold restore of generation" in cold
    assert "never-written" in serving and "the serving database" in serving


def test_the_move_world_is_deterministic_and_refuses_nothing() -> None:
    a, b = run_witness(WITNESS_BY_NAME["wMove"]), run_witness(WITNESS_BY_NAME["wMove"])
    assert a.trace_hash == b.trace_hash and a.error is None


def test_blocking_runs_inline_only_inside_the_simulation() -> None:
    from kernel import ports

    async def where() -> tuple[bool, int]:
        return ports.blocking_inline(), await ports.blocking(threading.get_ident)

    inline, ident = asyncio.run(where())
    assert not inline and ident != threading.get_ident(), "production: a worker thread"

    async def simulated() -> tuple[bool, int]:
        with ports.inline_blocking():
            return ports.blocking_inline(), await ports.blocking(threading.get_ident)

    (inline, ident), _ = run(simulated(), seed=1)
    assert inline and ident == threading.get_ident(), "simulation: the caller's thread"


def test_a_random_move_seed_converges_and_replays_in_another_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """A seed of the world with moves under chaos (crashes, store and bus faults, failpoints) converges with its
    moves done, and replays to the same trace in fresh processes, from both entry points (``python -m sim moves``
    and ``hostmove sim moves`` import the modules in different orders), with other hash seeds, and after another
    seed in the same process. Frozen targets off (seed 0 freezes its one move's target: the test below)."""
    import sim.moves
    from sim.moves import run_move_seed

    monkeypatch.setattr(sim.moves, "FREEZE_P", 0.0)
    monkeypatch.setenv("HOSTMOVE_SIM_FREEZE_P", "0")
    result = run_move_seed(0)
    assert not result.violations and result.error is None, result.report()
    assert result.counters["moves_done"] >= 1 and result.counters["crashes"] > 0
    assert result.counters["faults_fired"] > 0 and result.counters["writes_acknowledged"] > 0
    lines = []
    entry_points = (("0", [sys.executable, "-m", "sim"]),
                    ("12345", [str(Path(sys.executable).parent / "hostmove"), "sim"]))
    for hash_seed, argv in entry_points:
        out = subprocess.run([*argv, "moves", "--seeds", "1"], cwd=ROOT, capture_output=True,
                             env={**os.environ, "PYTHONHASHSEED": hash_seed}, text=True, timeout=300, check=False)
        assert out.returncode == 0, out.stdout + out.stderr
        lines.append(out.stdout.splitlines()[0])
    traces = [line.split(" trace=")[1].split()[0] for line in lines]
    assert traces[0] == traces[1] and all("moves_done=" in x and x.endswith(" ok") for x in lines), lines
    # After other seeds in the same process (the order that once diverged: seed 0 after seed 2; sim/README.md
    # "Determinism"), in a process of its own so nothing of this test process's state takes part.
    script = "from sim.moves import run_move_seed as r; r(2); print(r(0).trace_hash)"
    after = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300,
                           check=False)
    assert after.returncode == 0, after.stderr
    assert after.stdout.split()[-1] == traces[0]


def test_a_frozen_target_is_declared_lost_and_the_seed_converges_the_same_twice() -> None:
    """With frozen targets on (``HOSTMOVE_SIM_FREEZE_P``, 0.1 by default: sim/moves.py FREEZE_P), move seed 0
    freezes its move's target whole during the landing's probe; the operator's declaration on the box's silence
    alone is refused (the platform shows it running), the platform stops it, the declaration through the door is
    taken, the source recovers, the platform starts the box again (it quarantines) and the operator readmits it;
    the lost target's forward lane in its region is parked by that region's at-rest sweep (§6.4, rule
    ``sweep-staging``) before the world is at rest: converged clean, the same trace twice."""
    env = {**os.environ, "HOSTMOVE_SIM_FREEZE_P": "0.1"}
    out = subprocess.run([sys.executable, "-m", "sim", "moves", "--seeds", "1"], cwd=ROOT, capture_output=True,
                         env=env, text=True, timeout=600, check=False)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr
    line = out.stdout.splitlines()[0]
    assert "targets_frozen=1 declared_lost=2 platform_stops=1 readmitted=1 ok" in line, line
    script = ("from sim.moves import run_move_seed as r; x = r(0, trace=True); print(x.trace_hash); "
              "print(*x.violations, sep='\\n'); print('\\n'.join(x.trace))")
    again = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, env=env, text=True,
                           timeout=600, check=False)
    assert again.returncode == 0, again.stderr
    assert f"trace={again.stdout.split()[0]} " in line, "the same trace twice"
    trace = again.stdout
    readmitted = re.search(r"operator readmit ((\w+)-\d+): readmitted for \['h3\.example'\], refused \[\]", trace)
    assert readmitted is not None, "the frozen target is readmitted by the operator"
    region = readmitted.group(2)  # the frozen target's (which box the seed's move chose: its schedule's)
    assert f"at-rest sweep of h3.example in {region}: 1 locations or lanes to park (moves/h3.example/mv_" in trace, (
        "the lost target's forward lane is its region's at-rest sweep's")


def test_a_machine_gone_for_good_is_replaced_and_its_host_relocated() -> None:
    """Issue 5 item 1, scripted in the world with moves: a host serving on ie-1 takes writes; ie-1's machine is
    terminated (every process and file of it); the platform fences it and enrolls ie-2; the recovery pass pins the
    host and hands it to ie-2, whose agent restores it from the bucket and serves it with every uploaded write
    (INV-2, the writes after the last upload declared lost); ie-1 never starts again."""
    from sim.run import DEFAULT_TIMING, execute
    from sim.witness import H, _serving_on, _serving_with_writes, _world, _writes

    async def script(world: World) -> None:
        mw = await _serving_with_writes(world, 3)
        await asyncio.sleep(60.0)  # two sync intervals: the writes so far are in the bucket
        await _writes(mw, 1, "unsynced")
        world.crash("ie-1", "scenario: the machine is terminated")
        mw.terminate("ie-1")
        await _serving_on(mw, "ie-2")
        await _writes(mw, 2, "after")

    scenario = Witness("sBoxReplaced", (), "", ((H, "ie-1"),), script, "", moves=True)
    result = execute("scenario:sBoxReplaced", _world(scenario, DEFAULT_TIMING), script, trace=True, mutate=())
    assert not result.violations, "\n".join(result.trace[-40:])
    assert result.counters.get("terminations") == 1
    trace = "\n".join(result.trace)
    assert "platform fenced ie-1" in trace and "relocating/installing on ie-2" in trace
    assert f"ie-2#1 {H} relocated here from a fenced box" in trace
    assert "ie-1 start #" not in trace.split("terminated: the machine is gone for good")[1], "ie-1 never starts again"
