"""The box agent's backstop at the cost of what changed (issue 19 item 2, :mod:`services.agent.scan`).

- the pure plan: a claim new or with another ETag is read, one with the ETag last read is kept, other keys ignored;
- on the real SeaweedFS, counted by the S3 metrics (``hostmove_s3_requests_total``): 25 claims listed 10 to a page
  cost 3 LISTs and 25 GETs the first time, 3 LISTs and no GET the next, and then a GET only for each claim that
  changed or appeared; a claim that is never state is reported once and not read again until it changes.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Callable

import msgspec
import pytest
import pytest_asyncio

from bus.nats_log import NatsEventLog
from events.claim import Claim, Op
from events.envelope import Actor
from hostmove.stackinfo import StackInfo
from kernel import metrics
from kernel.ports import WallClock
from services.agent.scan import CLAIMS_PREFIX, ClaimScan, Seen, plan
from services.ledger.ledger import BadObject, Ledger, object_key
from services.objstore.port import ObjectEntry
from services.objstore.s3 import S3Store


def test_the_plan_reads_only_what_is_new_or_changed() -> None:
    seen = {"a.example": Seen('"1"', None), "b.example": Seen('"2"', None)}
    listing = [ObjectEntry(f"{CLAIMS_PREFIX}a.example.json", '"1"', 10),  # unchanged
               ObjectEntry(f"{CLAIMS_PREFIX}b.example.json", '"3"', 10),  # changed
               ObjectEntry(f"{CLAIMS_PREFIX}c.example.json", '"4"', 10),  # new
               ObjectEntry(f"{CLAIMS_PREFIX}d.example.json", None, 10),  # no ETag: read
               ObjectEntry(f"{CLAIMS_PREFIX}sub/e.json", '"5"', 10),  # not a claim
               ObjectEntry(f"{CLAIMS_PREFIX}f.example.txt", '"6"', 10)]
    got = plan(listing, seen)
    assert got.read == ("b.example", "c.example", "d.example") and got.kept == ("a.example",)


def requests() -> dict[str, float]:
    """This process's S3 requests so far, by operation (every status)."""
    out: dict[str, float] = {}
    for family in metrics.REGISTRY.collect():
        if family.name == "hostmove_s3_requests":
            for s in family.samples:
                if s.name.endswith("_total"):
                    out[s.labels["operation"]] = out.get(s.labels["operation"], 0.0) + s.value
    return out


def since(before: dict[str, float]) -> dict[str, float]:
    now = requests()
    return {op: n - before.get(op, 0.0) for op, n in now.items() if n - before.get(op, 0.0)}


@pytest_asyncio.fixture(loop_scope="session")
async def world(stack: StackInfo, unique: Callable[[str], str]) -> AsyncIterator[tuple[S3Store, Ledger, str]]:
    """A deployment bucket of its own, read by a store that lists 10 keys a request."""
    store = await S3Store.open(stack.s3_endpoint, stack.s3_access_key, stack.s3_secret_key, stack.s3_region,
                               page_size=10)
    events = await NatsEventLog.connect(stack.nats_url)
    bucket = unique("scan")
    await store.create_bucket(bucket, versioned=True)
    ledger = Ledger(store, events, WallClock(), Actor(service="test", pid=os.getpid(), nonce="scan"), bucket)
    try:
        yield store, ledger, bucket
    finally:
        await store.delete_bucket(bucket)
        await events.close()
        await store.close()


def serving(box: str) -> Callable[[Claim | None], Claim]:
    def decide(cur: Claim | None) -> Claim:
        return msgspec.structs.replace(cur or Claim(host="x", gen=1), op=Op(kind="serving", phase="", exec=box))

    return decide


@pytest.mark.asyncio(loop_scope="session")
async def test_a_look_gets_only_the_claims_that_changed(world: tuple[S3Store, Ledger, str]) -> None:
    store, ledger, bucket = world
    hosts = [f"h{i:02d}.example" for i in range(25)]
    for i, host in enumerate(hosts):
        await ledger.transition("claim", host, "created", serving("a" if i % 5 else "b"))
    reported: list[BadObject] = []

    async def report(bad: BadObject) -> None:
        reported.append(bad)

    scan = ClaimScan(store, bucket, ledger, report)
    before = requests()
    claims = await scan.look()
    assert sorted(claims) == hosts and claims["h00.example"].op.exec == "b" and claims["h01.example"].op.exec == "a"
    assert since(before) == {"list_objects_v2": 3, "get_object": 25}, "a first look reads every claim once"

    before = requests()
    assert await scan.look() == claims
    assert since(before) == {"list_objects_v2": 3}, "nothing changed: the listing alone"

    await ledger.transition("claim", hosts[3], "moved", serving("b"))
    await ledger.transition("claim", hosts[7], "moved", serving("b"))
    await ledger.transition("claim", "new.example", "created", serving("a"))
    before = requests()
    again = await scan.look()
    assert since(before) == {"list_objects_v2": 3, "get_object": 3}, "one GET per claim changed or new"
    assert again[hosts[3]].op.exec == "b" and again[hosts[7]].op.exec == "b" and "new.example" in again
    assert {h: c for h, c in again.items() if h not in (hosts[3], hosts[7], "new.example")} == {
        h: c for h, c in claims.items() if h not in (hosts[3], hosts[7])}

    await store.put(bucket, object_key("claim", "bad.example"), b"not a claim")  # written outside the ledger
    before = requests()
    found = await scan.look()
    assert "bad.example" not in found and [b.host for b in reported] == ["bad.example"]
    assert since(before) == {"list_objects_v2": 3, "get_object": 1}
    before = requests()
    await scan.look()
    assert since(before) == {"list_objects_v2": 3} and len(reported) == 1, "the same bad version is not read again"

    await store.delete(bucket, object_key("claim", hosts[0]))
    assert hosts[0] not in await scan.look() and hosts[0] not in scan.seen, "a deleted claim is forgotten"


def test_the_period_is_configured() -> None:
    from services.agent.service import FAST_AGENT, scan_override

    assert scan_override(FAST_AGENT, None) is FAST_AGENT and scan_override(FAST_AGENT, " ") is FAST_AGENT
    assert scan_override(FAST_AGENT, "45").scan_s == 45.0
    for bad in ("0", "-1", "soon", "inf"):
        with pytest.raises(ValueError, match="HOSTMOVE_SCAN_S must be a positive number of seconds"):
            scan_override(FAST_AGENT, bad)
