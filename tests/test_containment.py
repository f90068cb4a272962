"""What one bad or forged object in the store can do to the boxes (issue 14 items 5 and 6), on the real stack with
box agents as processes (``tests/helpers/agents.py``).

- A claim that fails its decoding, one over the size limit and one changed outside the ledger are skipped for their
  hosts only, each with one durable alert, while a box restarts; every other host serves within its wake time and
  the door answers 503 with its sentence for them.
- A well-formed claim naming the other box, written straight into the store, is never two writers: the box that
  runs the instance stops it within a pass and alerts; the other box does not start it (nothing handed it over).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
import pytest_asyncio
from aiohttp.test_utils import TestClient, TestServer

from bus.facts import Fact
from bus.nats_log import NatsEventLog
from bus.subjects import FACTS_STREAM, alert_subject
from events.base import canonical, decode
from events.ids import new_incarnation
from hostmove.stackinfo import StackInfo
from kernel.ports import SystemRandom, WallClock
from services.agent.service import SECOND_WRITER, read_endpoint
from services.door.api import Door, make_app
from services.door.auth import TokenSet
from services.hosts.create import create_host
from services.ledger import Committed
from services.ledger.badobjects import ALERT_KIND, marker_key
from services.ledger.ledger import MAX_OBJECT_BYTES, META_SHA, object_key
from services.objstore.port import Got
from services.objstore.s3 import S3Store
from tests.helpers.agents import AgentWorld, agent_world, answers_ready, data_buckets, eventually

QUIET = {"MOVEPROBE_INTERVAL_S": "0.5", "MOVEPROBE_SCHEDULE_EVERY_S": "3600", "MOVEPROBE_ONCE_AFTER_S": "3600"}
WAKE_S = 30.0
"""A host's usual wake time on these boxes, with margin (restore, spawn, readiness)."""
OPERATOR = "op-containment-0123456789"


@pytest_asyncio.fixture(loop_scope="session", scope="module")
async def shared(stack: StackInfo, unique: Callable[[str], str]) -> AsyncIterator[tuple[S3Store, NatsEventLog, str]]:
    async with data_buckets(stack, unique, "cnt") as s:
        yield s


async def serving_port(w: AgentWorld, region: str, host: str, *, newer_than: int | None = None,
                       timeout_s: float = WAKE_S) -> int:
    async def check() -> int | None:
        port = read_endpoint(w.box_dir(region), host, newer_than=newer_than)
        return port if port is not None and await asyncio.to_thread(answers_ready, port) else None

    return await eventually(check, f"{host} served on {w.labels[region]}", timeout_s)


async def create(w: AgentWorld, host: str, region: str = "ie") -> None:
    created = await create_host(w.ledger, host, box=w.labels[region], region=region,
                                incarnation=new_incarnation(SystemRandom()))
    assert isinstance(created, Committed), created


async def put_claim(w: AgentWorld, host: str, body: bytes, *, digest: bool = True) -> str:
    """Write ``body`` as the claim of ``host`` straight into the store, as the ledger would label it (its digest)
    unless ``digest`` is False (an edit outside the ledger). Answers the key."""
    key = object_key("claim", host)
    metadata = {META_SHA: hashlib.sha256(body).hexdigest()} if digest else {}
    await w.store.put(w.deploy, key, body, metadata=metadata)
    return key


async def alerts(w: AgentWorld, kind: str, since_seq: int) -> list[Fact]:
    out = []
    async for msg in w.events.replay(FACTS_STREAM, start_seq=since_seq, subject=alert_subject(kind)):
        out.append(decode(msg.data, Fact))
    return out


async def facts_seq(w: AgentWorld) -> int:
    return (await w.events.state(FACTS_STREAM)).last_seq + 1


async def test_bad_claims_skip_their_hosts_only_and_alert_once_across_restarts(
        stack: StackInfo, unique: Callable[[str], str], tmp_path: Any,
        shared: tuple[S3Store, NatsEventLog, str]) -> None:
    store, events, prefix = shared
    since = 0
    async with agent_world(stack, unique, tmp_path, prefix, store=store, events=events, app_env=QUIET) as w:
        since = await facts_seq(w)
        ok = f"{unique('ok')}.example.com"
        await create(w, ok)
        await serving_port(w, "ie", ok)
        session = read_endpoint_session(w, "ie", ok)

        undecodable, oversized, edited = (f"{unique(n)}.example.com" for n in ("undecodable", "oversized", "edited"))
        bad: dict[str, str] = {
            undecodable: await put_claim(w, undecodable, json.dumps(
                {"host": undecodable, "gen": 1, "op": {"kind": "serving", "exec": w.labels["ie"]}, "holder": 7}
            ).encode()),
            oversized: await put_claim(w, oversized, json.dumps(
                {"host": oversized, "gen": 1, "inventory": {"pad": "x" * (2 * MAX_OBJECT_BYTES)}}).encode()),
        }
        await create(w, edited)  # a real claim, then edited outside the ledger: its digest no longer matches
        got = await w.store.get(w.deploy, object_key("claim", edited))
        assert isinstance(got, Got)
        bad[edited] = await put_claim(w, edited, got.body.replace(b'"gen":', b'"gen": '), digest=False)

        w.agents["ie"].stop()  # the box restarts with all three present
        w.agents["ie"].start()
        started = time.monotonic()
        await serving_port(w, "ie", ok, newer_than=session)
        assert time.monotonic() - started < WAKE_S

        async def one_each() -> bool:
            found = await alerts(w, ALERT_KIND, since)
            keys = sorted(f.payload["key"] for f in found if f.payload["key"] in bad.values())
            return keys == sorted(bad.values())

        await eventually(one_each, "one bad-object alert for each bad claim", 30)
        w.agents["uk"].stop()  # the other box restarts too; both scan every second
        w.agents["uk"].start()
        await asyncio.sleep(4)
        found = [f for f in await alerts(w, ALERT_KIND, since) if f.payload["key"] in bad.values()]
        assert sorted(f.payload["key"] for f in found) == sorted(bad.values()), "one alert per bad object, ever"
        by_key = {f.payload["key"]: f for f in found}
        assert by_key[bad[oversized]].payload["limit"] == "max_bytes"
        assert by_key[bad[edited]].payload["limit"] == "ledger_written"
        assert {f.subject for f in found} == set(bad)
        for key, fact in by_key.items():
            assert isinstance(await w.store.head(w.deploy, marker_key(key, str(fact.payload["etag"]))), Got)

        # A host created after them is woken as usual.
        later = f"{unique('later')}.example.com"
        await create(w, later)
        await serving_port(w, "ie", later)

        # The door answers 503 with its sentence for each, never a 500.
        door = Door(w.ledger, clock=WallClock(), rng=SystemRandom())
        async with TestClient(TestServer(make_app(door, TokenSet.of(operators={"op": OPERATOR})))) as client:
            auth = {"Authorization": f"Bearer {OPERATOR}"}
            for host in bad:
                for method, path, body in (("GET", f"/v1/hosts/{host}/move", None),
                                           ("POST", f"/v1/hosts/{host}/move", b'{"to": "uk"}')):
                    resp = await client.request(method, path, data=body, headers=auth)
                    answer = await resp.json()
                    assert resp.status == 503 and answer["copy"] == "M-R30", (host, method, answer)
                    assert answer["reason"] == f"The claim of {host} is unreadable, so nothing was changed. " \
                                               "Fix it and try again."
        logs = w.agents["ie"].output()
        assert "scan failed" not in logs and f"the claim of {undecodable}" in logs


def read_endpoint_session(w: AgentWorld, region: str, host: str) -> int:
    path = w.box_dir(region) / "endpoints"
    for p in path.glob("*.json"):
        body = json.loads(p.read_text())
        if body["host"] == host:
            return int(body["session"])
    raise AssertionError(f"{host} has no endpoint on {region}")


async def test_a_forged_claim_naming_the_other_box_never_makes_two_writers(
        stack: StackInfo, unique: Callable[[str], str], tmp_path: Any,
        shared: tuple[S3Store, NatsEventLog, str]) -> None:
    store, events, prefix = shared
    async with agent_world(stack, unique, tmp_path, prefix, store=store, events=events, app_env=QUIET) as w:
        since = await facts_seq(w)
        host = f"{unique('forged')}.example.com"
        await create(w, host)
        await serving_port(w, "ie", host)
        ie, uk = w.tree(w.labels["ie"]), w.tree(w.labels["uk"])
        assert ie.populated(host) and not uk.populated(host)

        both: list[float] = []
        ie_stopped: list[float] = []
        watching = True

        async def watch() -> None:  # both boxes' process trees of the host, every 5 ms
            while watching:
                on_ie, on_uk = ie.populated(host), uk.populated(host)
                if on_ie and on_uk:
                    both.append(time.monotonic())
                if not on_ie and not ie_stopped:
                    ie_stopped.append(time.monotonic())
                await asyncio.sleep(0.005)

        watcher = asyncio.create_task(watch())
        claim = (await w.ledger.read_claim(host)).state
        assert claim is not None
        forged = msgspec.structs.replace(claim, gen=claim.gen + 1, op=msgspec.structs.replace(
            claim.op, exec=w.labels["uk"], participants=(w.labels["uk"],)))
        await put_claim(w, host, canonical(forged))  # well-formed, labelled as the ledger labels its writes
        forged_at = time.monotonic()
        try:
            await eventually(lambda: asyncio.sleep(0, bool(ie_stopped)), "the ie box to stop its instance", 15)
            assert ie_stopped[0] - forged_at < 5.0, "within a pass (a scan every second)"

            async def alerted() -> list[Fact]:
                return [f for f in await alerts(w, SECOND_WRITER, since) if f.subject == host]

            found = await eventually(alerted, "the second-writer alert", 15)
            assert len(found) == 1 and found[0].payload["box"] == w.labels["ie"]
            assert found[0].payload["claim_exec"] == w.labels["uk"]
            await asyncio.sleep(4)  # several passes of both boxes
        finally:
            watching = False
            await watcher
        assert not both, "two writers at once"
        assert not ie.populated(host) and not uk.populated(host), "ie does not restart it and uk never takes it"
        note = json.loads((w.box_dir("ie") / "stops" / f"{host}.json").read_text())
        assert note["claim_exec"] == w.labels["uk"] and "names" in note["reason"]
        assert read_endpoint(w.box_dir("ie"), host) is None
        assert "no move or relocation handed it over" in w.agents["uk"].output()
