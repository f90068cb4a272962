"""The box agent's backstop at the cost of what changed (issue 19 item 2, :mod:`services.agent.backstop`).

- the pure parts: which listed claims are read again (a new one, another ETag, none), and which hosts are passed
  (a changed claim naming the box, an instance running here, and each kind of work time alone makes due);
- on the real stack, one box agent as a process (``hostmove serve box``, the scan every second) counted by its own
  ``/metrics``: with a dozen claims unchanged its looks read no claim (its S3 GETs are its health check's); a claim
  rewritten through the ledger with no work notice sent (so only the scan can tell the box) names the box, and the
  next look reads it alone and the box serves the host.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
import pytest_asyncio

from bus.nats_log import NatsEventLog
from bus.subjects import LEDGER_STREAM, WORK_STREAM, ledger_subject, parse_work_subject
from events.claim import Claim, Holder, LostBox, Obligation, Op
from events.envelope import Actor
from events.ids import new_incarnation
from hostmove.stackinfo import StackInfo
from kernel.ports import SystemRandom, WallClock
from services.agent.backstop import CLAIMS_PREFIX, Here, Seen, look, to_read
from services.hosts.create import create_host
from services.ledger import Committed, Ledger
from services.move.resolve import CLEAR_FAILED
from services.objstore.port import ObjectEntry
from services.objstore.s3 import S3Store
from tests.helpers.agents import agent_world, data_buckets, eventually
from tests.helpers.webcalls import free_port, scrape
from tests.test_agent import serving_port

BOX, OTHER = "ie-1", "uk-1"


def test_a_claim_is_read_again_only_when_its_etag_moved() -> None:
    seen = {"a.example": Seen('"1"', None), "b.example": Seen('"2"', None)}
    listing = [ObjectEntry(f"{CLAIMS_PREFIX}a.example.json", '"1"', 10),  # unchanged: kept
               ObjectEntry(f"{CLAIMS_PREFIX}b.example.json", '"3"', 10),  # another ETag (newer, or a lagging list)
               ObjectEntry(f"{CLAIMS_PREFIX}c.example.json", '"4"', 10),  # new
               ObjectEntry(f"{CLAIMS_PREFIX}d.example.json", None, 10),  # no ETag: read
               ObjectEntry(f"{CLAIMS_PREFIX}sub/e.json", '"5"', 10),  # not a claim
               ObjectEntry(f"{CLAIMS_PREFIX}f.example.txt", '"6"', 10)]
    read, listed = to_read(listing, seen)
    assert read == ["b.example", "c.example", "d.example"]
    assert listed == ["a.example", "b.example", "c.example", "d.example"]


def _claim(kind: str = "serving", exec_: str = BOX, **fields: Any) -> Claim:
    holder = Holder(incarnation="i1", location="instances/h/i1/", writer_box=exec_)
    journal = fields.pop("journal", {})
    return Claim(host="h.example", gen=3, holder=holder, op=Op(kind=kind, exec=exec_, participants=(exec_,),
                                                                 journal=journal), **fields)


def _passes(claim: Claim, changed: bool = False, **here: bool) -> bool:
    return look(claim, label=BOX, region="ie", changed=changed, here=Here(**here)).passes


def test_an_unchanged_claim_of_a_sleeping_host_is_not_passed() -> None:
    assert not _passes(_claim(), asleep=True)
    assert _passes(_claim(), changed=True, asleep=True), "a changed claim naming the box is passed"
    assert _passes(_claim(exec_=OTHER), running=True), "K6: whatever its claim names"


def test_work_that_time_alone_makes_due_is_passed() -> None:
    assert _passes(_claim(), asleep=False), "a serving host of the box not running and not asleep: a wake is due"
    assert not _passes(_claim(), asleep=False, held_off=True), "its last wake's backoff still runs"
    assert _passes(_claim(), asleep=True, looks_due=True), "the retention's or the at-rest sweep's cadence"
    assert _passes(_claim(journal={CLEAR_FAILED: {"at": 1, "by": "op"}}), asleep=True)
    assert _passes(_claim(kind="moving"), asleep=True), "an operation in flight: its record moves alone"
    owned = Obligation(kind="park-local", op="m1", region="ie", owner=BOX)
    assert _passes(_claim(obligations=(owned,)), asleep=True), "a chore the box owns (K8)"


def test_another_box_s_host_is_swept_and_passed_only_for_a_chore() -> None:
    other = _claim(exec_=OTHER)
    decided = look(other, label=BOX, region="ie", changed=True, here=Here())
    assert not decided.passes and decided.sweeps, "a changed claim naming another box: its sweep only"
    lost = msgspec.structs.replace(other, lost=(LostBox(box="ie-0", fence="fences/ie-0.json", at=1),), obligations=(
        Obligation(kind="park-generation", op="g1", region="ie", owner="ie-0"),))
    decided = look(lost, label=BOX, region="ie", changed=False, here=Here())
    assert decided.passes and decided.sweeps, "a lost box's chore in this region, to adopt (§7.10)"


# -- the real stack ------------------------------------------------------------------------------------------


class Unnoticed:
    """An event log whose work notices are never sent: a ledger over it writes behind the agents' backs."""

    def __init__(self, inner: NatsEventLog) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def notice(self, stream: str, subject: str, data: bytes = b"") -> None:
        return None


def counts(port: int, box: str) -> tuple[float, float, float]:
    """The agent's S3 GETs (every status), its backstop's looks and the claims they read, from its ``/metrics``."""
    values = scrape(port)
    gets = sum(v for k, v in values.items() if k.startswith("hostmove_s3_requests_total{") and "operation=get_object,"
               in k)
    return (gets, values.get(f"hostmove_box_scans_total{{box={box}}}", 0.0),
            values.get(f"hostmove_box_scan_claims_read_total{{box={box}}}", 0.0))


@pytest_asyncio.fixture(loop_scope="session", scope="module")
async def shared(stack: StackInfo, unique: Callable[[str], str]) -> AsyncIterator[tuple[S3Store, NatsEventLog, str]]:
    async with data_buckets(stack, unique, "bks") as s:
        yield s


@pytest.mark.asyncio(loop_scope="session")
async def test_unchanged_claims_cost_a_listing_and_a_silent_change_is_still_found(
        stack: StackInfo, unique: Callable[[str], str], shared: tuple[S3Store, NatsEventLog, str],
        tmp_path: Path) -> None:
    store, events, prefix = shared
    health = free_port()
    async with agent_world(stack, unique, tmp_path, prefix, store=store, events=events, start=False,
                           agent_env={"HOSTMOVE_SCAN_S": "1"}) as w:
        ie, uk = w.labels["ie"], w.labels["uk"]
        hosts = [f"{unique('bk')}.example.com" for _ in range(12)]
        for host in hosts:  # served by uk, whose agent never runs here: nothing of ie's but its sweep on 10 s
            created = await create_host(w.ledger, host, box=uk, region="uk",
                                        incarnation=new_incarnation(SystemRandom()), app=w.app)
            assert isinstance(created, Committed), created
        w.agents["ie"].start({"HOSTMOVE_HEALTH_PORT": str(health)})

        async def scanned_twice() -> tuple[float, float, float] | None:  # the first look read every claim, once
            try:
                now = await asyncio.to_thread(counts, health, ie)
            except OSError:
                return None
            return now if now[1] >= 2 else None

        first = await eventually(scanned_twice, "two scans of the ie agent", 60)
        assert first[2] == len(hosts), f"the first look read every claim once, the second none: {first}"
        before = await asyncio.to_thread(counts, health, ie)
        t0 = time.monotonic()
        await asyncio.sleep(3.5)
        after = await asyncio.to_thread(counts, health, ie)
        looks, took = after[1] - before[1], time.monotonic() - t0
        assert looks >= 2, (before, after)  # it looked, every second
        assert after[2] == before[2], f"looks at unchanged claims read none: {before} -> {after}"
        gets = after[0] - before[0]  # besides the health check's one GET a second, nothing (was 12 a look)
        assert gets <= took + 1 and gets < len(hosts), f"{gets:.0f} S3 GETs in {looks:.0f} looks and {took:.1f} s"

        silent = Ledger(store, Unnoticed(events), WallClock(),  # type: ignore[arg-type]
                        Actor(service="test-backstop", pid=os.getpid(), nonce="quiet"), w.deploy)
        host = hosts[0]
        seq = (await events.state(WORK_STREAM)).last_seq
        ledger_seq = (await events.state(LEDGER_STREAM)).last_seq

        def to_ie(cur: Claim | None) -> Claim:
            assert cur is not None and cur.holder is not None
            return msgspec.structs.replace(cur, op=Op(kind="serving", exec=ie, participants=(ie,)))

        out = await silent.transition("claim", host, "handed-to-ie", to_ie, causation="test:behind-its-back")
        assert isinstance(out, Committed), out
        sent = (await events.state(WORK_STREAM)).last_seq  # before the agent's next look (and its own writes)
        async for msg in events.replay(WORK_STREAM, start_seq=seq + 1):
            if msg.seq > sent:
                break
            assert parse_work_subject(msg.subject) != (ie, host), "a notice was sent: the test proves nothing"
        await serving_port(w, "ie", host, timeout_s=60)  # only its scan could tell it
        final = await asyncio.to_thread(counts, health, ie)
        read = final[2] - after[2]  # that claim, and again after each of the box's own writes to it (the wake's)
        subject = ledger_subject("claim", host)
        writes = 0  # the claim's versions since: the silent change and the box's own CASes (each publishes)
        last = (await events.state(LEDGER_STREAM)).last_seq
        async for msg in events.replay(LEDGER_STREAM, start_seq=ledger_seq + 1, subject=subject):
            writes += 1
            if msg.seq >= last:
                break
        assert writes >= 1, "the silent change was published to the ledger"
        # at most once per version of that claim, plus one GET a lagging listing can cost (services.agent.backstop)
        assert 1 <= read <= writes + 1, (
            f"only the changed claim was read, at most once per version of it ({writes}): {after} -> {final} "
            "(GETs, looks, claims read)")
