"""The AsyncAPI 3 document of the event stream (issue 19 item 6): ``hostmove asyncapi`` prints it.

The channels are FastStream publishers on a broker that never connects (the document is FastStream's own AsyncAPI
generator's); each message's payload schema is then the JSON Schema msgspec generates from the type the code
encodes on that subject (:data:`CHANNELS`): the transition envelope (with its claim or record), a fact, an alert, an
incident, the poison alert of :mod:`bus.app`. A channel's address is its subject with ``{placeholders}`` for the
tokens :mod:`bus.subjects` encodes; ``tests/test_asyncapi.py`` holds the document to the subject functions, to the
live streams' subjects and to messages read back from a live stream.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import msgspec
from faststream.nats import JStream, NatsBroker
from faststream.specification import AsyncAPI

from bus.app import PoisonAlert
from bus.facts import Fact
from bus.subjects import FACTS_STREAM, LEDGER_STREAM, WORK_STREAM
from events.envelope import Transition

TITLE = "hostmove event stream"
VERSION = "1"


@dataclass(frozen=True)
class Channel:
    """One subject family: ``address`` with ``{parameters}``, its stream (None: core NATS), its payload type."""

    name: str
    address: str
    stream: str | None
    payload: type[Any] | None
    description: str
    parameters: dict[str, str]


CHANNELS: tuple[Channel, ...] = (
    Channel("ledger-claim", "hm.ledger.claim.{host}", LEDGER_STREAM, Transition,
            "Every transition of a host's claim, in order and without gaps (one CAS, one event; ARCHITECTURE §4).",
            {"host": "the host name as a subject token (bus.subjects.encode_token)"}),
    Channel("ledger-record", "hm.ledger.record.{host}", LEDGER_STREAM, Transition,
            "Every transition of a host's record (its move journal, spec §7.2), in order and without gaps.",
            {"host": "the host name as a subject token (bus.subjects.encode_token)"}),
    Channel("fact", "hm.fact.{kind}.{subject}", FACTS_STREAM, Fact,
            "A fact: evidence, seals, park acknowledgements, roster changes (bus.facts.publish_fact).",
            {"kind": "the fact's kind as a subject token", "subject": "its host or box as a subject token"}),
    Channel("alert", "hm.alert.{kind}", FACTS_STREAM, Fact,
            "An alert the operator must look at (bus.facts.publish_alert); ``kind`` names it.",
            {"kind": "the alert's kind as a subject token"}),
    Channel("alert-poison", "hm.alert.poison", FACTS_STREAM, PoisonAlert,
            "A message whose redelivery was exhausted (bus.app): acknowledged only once this alert is on the stream.",
            {}),
    Channel("incident", "hm.alert.{kind}.{subject}.{incident}", FACTS_STREAM, Fact,
            "An incident, raised once ever: its subject's only message (bus.facts.raise_incident, spec §13).",
            {"kind": "the incident's kind", "subject": "its host or box", "incident": "the incident's id"}),
    Channel("work-notice", "hm.work.{box}.{host}", WORK_STREAM, None,
            "A work notice (empty body): a transition of the host's claim or record concerns the box "
            "(services.ledger.notices); the stream keeps the newest per subject, the box's durable consumer "
            "box-{box} takes its own (issue 19 item 1). Only a wake-up: the box reads the claim.",
            {"box": "the box's label as a subject token", "host": "the host name as a subject token"}),
    Channel("box-wake", "hm.box.{label}.wake", None, None,
            "Core NATS request/reply: a router asks a box to wake a sleeping host; the body is the host name "
            "(text), the reply JSON {host, running}.",
            {"label": "the box's label as a subject token"}),
)


def _broker() -> NatsBroker:
    """A broker that is never connected: FastStream's publishers of every channel, for its generator."""
    broker = NatsBroker("nats://127.0.0.1:4222")
    for ch in CHANNELS:
        stream = JStream(ch.stream, declare=False) if ch.stream is not None else None
        broker.publisher(ch.address, stream=stream, title=ch.name, description=ch.description, schema=bytes)
    return broker


def specification() -> dict[str, Any]:
    """The AsyncAPI 3.0.0 document (a JSON value)."""
    spec = AsyncAPI(_broker(), title=TITLE, version=VERSION, schema_version="3.0.0",
                    description="Every subject hostmove publishes (bus/subjects.py): the ledger stream HM_LEDGER, the "
                                "facts stream HM_FACTS and the boxes' core NATS wake requests.")
    doc: dict[str, Any] = json.loads(spec.to_specification().to_json())
    types = [ch.payload for ch in CHANNELS if ch.payload is not None]
    (_refs, schemas) = msgspec.json.schema_components(types, ref_template="#/components/schemas/{name}")
    components = doc.setdefault("components", {})
    components["schemas"] = schemas
    messages = components.setdefault("messages", {})
    doc.pop("servers", None)  # the placeholder broker's address is no deployment's: the servers are its own
    for ch in CHANNELS:
        channel = doc["channels"][ch.name]
        channel.pop("servers", None)
        channel["address"] = ch.address
        if ch.parameters:
            channel["parameters"] = {name: {"description": text} for name, text in ch.parameters.items()}
        if ch.stream is not None:
            channel.setdefault("bindings", {}).setdefault("nats", {})["x-jetstream-stream"] = ch.stream
        for ref in channel.get("messages", {}).values():
            key = ref["$ref"].rsplit("/", 1)[-1]
            message = messages.setdefault(key, {})
            if ch.payload is not None:
                message["payload"] = {"$ref": f"#/components/schemas/{ch.payload.__name__}"}
                message["contentType"] = "application/json"
            else:
                message["payload"] = {"type": "string", "description": "the host name, UTF-8"}
                message["contentType"] = "text/plain"
    return json.loads(json.dumps(doc))  # a JSON value throughout (msgspec gives tuple defaults)


def address_pattern(address: str) -> re.Pattern[str]:
    """A regular expression of the subjects a channel ``address`` stands for (a parameter: one token)."""
    parts = [r"[^.]+" if re.fullmatch(r"\{[a-z_]+\}", p) else re.escape(p) for p in address.split(".")]
    return re.compile(r"\.".join(parts) + r"\Z")


def channel_of(subject: str) -> Channel | None:
    """The channel a concrete subject belongs to: the most specific whose address matches (``hm.alert.poison`` is
    its own, not ``hm.alert.{kind}``)."""
    found = [ch for ch in CHANNELS if address_pattern(ch.address).match(subject)]
    found.sort(key=lambda ch: ch.address.count("{"))
    return found[0] if found else None


__all__ = ["CHANNELS", "Channel", "address_pattern", "channel_of", "specification"]
