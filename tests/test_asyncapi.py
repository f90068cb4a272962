"""The AsyncAPI document of the event stream (issue 19 item 6, :mod:`bus.asyncapi`), held to the code and to a live
stream: every channel's address is what :mod:`bus.subjects` makes, every JetStream channel lies inside its live
stream's subjects, and messages the ledger and the facts publish on the real NATS are read back on the channel the
document names, their payloads decoding as the type whose schema it gives."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable

import msgspec
import pytest

from bus.asyncapi import CHANNELS, address_pattern, channel_of, specification
from bus.facts import Fact, publish_alert, publish_fact, raise_incident
from bus.nats_log import NatsEventLog
from bus.subjects import (
    FACTS_STREAM,
    LEDGER_STREAM,
    WORK_STREAM,
    alert_subject,
    box_wake_subject,
    fact_subject,
    incident_subject,
    ledger_subject,
    work_subject,
)
from events.claim import Claim, Op
from events.envelope import Actor
from hostmove.stackinfo import StackInfo
from kernel.ports import WallClock
from services.ledger.ledger import Committed, Ledger
from services.objstore.s3 import S3Store
from tests.helpers.agents import eventually

ACTOR = Actor(service="test", pid=1, nonce="asyncapi")


def test_the_document_is_asyncapi_3_with_a_schema_for_every_payload() -> None:
    doc = specification()
    assert doc["asyncapi"] == "3.0.0" and doc["info"]["title"]
    assert "servers" not in doc, "no deployment's address is in the document"
    schemas = doc["components"]["schemas"]
    assert {"Transition", "Claim", "Record", "Fact", "PoisonAlert"} <= set(schemas), sorted(schemas)
    for ch in CHANNELS:
        channel = doc["channels"][ch.name]
        assert channel["address"] == ch.address
        assert set(re.findall(r"\{([a-z_]+)\}", ch.address)) == set(channel.get("parameters", {})), ch.name
        (ref,) = channel["messages"].values()
        message = doc["components"]["messages"][ref["$ref"].rsplit("/", 1)[-1]]
        payload = message["payload"]
        if ch.payload is None:
            assert payload["type"] == "string" and message["contentType"] == "text/plain"
            continue
        assert payload == {"$ref": f"#/components/schemas/{ch.payload.__name__}"}
        _refs, own = msgspec.json.schema_components([ch.payload], ref_template="#/components/schemas/{name}")
        assert schemas[ch.payload.__name__] == own[ch.payload.__name__], "generated from the type the code encodes"
    operations = {op["channel"]["$ref"].rsplit("/", 1)[-1] for op in doc["operations"].values()}
    assert operations == {ch.name for ch in CHANNELS}


def test_every_subject_the_code_makes_is_on_its_channel() -> None:
    host = "a.b_c*d>.example"  # every odd character the token encoding escapes
    made = {
        ledger_subject("claim", host): "ledger-claim",
        ledger_subject("record", host): "ledger-record",
        fact_subject("evidence", host): "fact",
        alert_subject("second-writer"): "alert",
        alert_subject("poison"): "alert-poison",
        incident_subject("stuck", host, "mv_1"): "incident",
        box_wake_subject("box-1"): "box-wake",
    }
    for subject, name in made.items():
        found = channel_of(subject)
        assert found is not None and found.name == name, (subject, found)
    assert channel_of("hm.other.thing") is None
    assert not address_pattern("hm.ledger.claim.{host}").match("hm.ledger.claim.a.b"), "a parameter is one token"


def test_the_cli_prints_the_document() -> None:
    out = subprocess.run([sys.executable, "-m", "hostmove.cli", "asyncapi"], capture_output=True, text=True,
                         timeout=60, env={k: v for k, v in os.environ.items() if not k.startswith("HOSTMOVE_")})
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == specification()


def _covers(pattern: str, subject: str) -> bool:
    """NATS subject matching: ``*`` one token, ``>`` the rest."""
    p, s = pattern.split("."), subject.split(".")
    for i, token in enumerate(p):
        if token == ">":
            return len(s) > i
        if i >= len(s) or (token != "*" and token != s[i]):
            return False
    return len(p) == len(s)


@pytest.mark.asyncio(loop_scope="session")
async def test_the_live_streams_carry_the_documented_channels(stack: StackInfo, unique: Callable[[str], str]) -> None:
    events = await NatsEventLog.connect(stack.nats_url)
    store = await S3Store.open(stack.s3_endpoint, stack.s3_access_key, stack.s3_secret_key, stack.s3_region)
    bucket = unique("asyncapi")
    await store.create_bucket(bucket, versioned=True)
    try:
        live = {name: (await events.js.stream_info(name)).config.subjects or []
                for name in (LEDGER_STREAM, FACTS_STREAM, WORK_STREAM)}
        for ch in CHANNELS:
            if ch.stream is not None:
                concrete = re.sub(r"\{[a-z_]+\}", "x", ch.address)
                assert any(_covers(p, concrete) for p in live[ch.stream]), (ch.address, live[ch.stream])

        host = f"{unique('api')}.example.com"
        ledger = Ledger(store, events, WallClock(), ACTOR, bucket)
        out = await ledger.transition("claim", host, "created", lambda cur: Claim(
            host=host, gen=1, op=Op(kind="serving", exec="box-a")))
        assert isinstance(out, Committed) and out.seq is not None
        now = WallClock().now_ms()
        fact = Fact(kind="evidence", subject=host, id=unique("f"), actor=ACTOR, at=now, payload={"k": 1})
        alert = Fact(kind="asyncapi-check", subject=host, id=unique("a"), actor=ACTOR, at=now)
        incident = Fact(kind="asyncapi-check", subject=host, id=unique("i"), actor=ACTOR, at=now)
        await publish_fact(events, fact)
        await publish_alert(events, alert)
        assert await raise_incident(events, incident)
        published = [(LEDGER_STREAM, ledger_subject("claim", host)), (FACTS_STREAM, fact_subject("evidence", host)),
                     (FACTS_STREAM, alert_subject(alert.kind)),
                     (FACTS_STREAM, incident_subject(incident.kind, host, incident.id))]
        for stream, subject in published:
            msg = await events.last(stream, subject)
            assert msg is not None, subject
            on = channel_of(msg.subject)
            assert on is not None and on.stream == stream and on.payload is not None, msg.subject
            value = msgspec.json.decode(msg.data, type=on.payload)  # the documented type decodes what is on it
            assert getattr(value, "host", None) == host or getattr(value, "subject", None) == host
        notice = await eventually(lambda: events.last(WORK_STREAM, work_subject("box-a", host)),
                                  "the transition's work notice to box-a on its stream", 10)
        on = channel_of(notice.subject)  # sent with no acknowledgement awaited: looked for until it is there
        assert on is not None and on.name == "work-notice" and on.stream == WORK_STREAM and notice.data == b""
    finally:
        await store.delete_bucket(bucket)
        await store.close()
        await events.close()
