"""Stream and subject layout (ARCHITECTURE §4).

- ``HM_LEDGER``: ``hm.ledger.claim.<host>`` and ``hm.ledger.record.<host>``, one subject per
  object, every transition in order and without gaps.
- ``HM_FACTS``: ``hm.fact.<kind>.<host>`` (evidence, seals, park acknowledgements, the move log)
  and ``hm.alert.<kind>`` (alerts, including poison messages that exhausted their redelivery).

A host name becomes one safe, reversible subject token: ``[A-Za-z0-9-]`` stay as they are and
every other UTF-8 byte (``.``, ``_``, ``*``, ``>``, spaces, non-ASCII) becomes ``_XX`` (hex).
"""

from __future__ import annotations

import hashlib
import re
from functools import lru_cache

LEDGER_STREAM = "HM_LEDGER"
FACTS_STREAM = "HM_FACTS"
LEDGER_PREFIX = "hm.ledger"
FACT_PREFIX = "hm.fact"
ALERT_PREFIX = "hm.alert"
BOX_PREFIX = "hm.box"
"""Core NATS (no stream): ``hm.box.<label>.wake``, the router's request that a box wake a sleeping host."""
WORK_STREAM = "HM_WORK"
WORK_PREFIX = "hm.work"
"""``hm.work.<box>.<host>`` on ``HM_WORK`` (issue 19 item 1): a work notice, one per transition and box it concerns,
the newest only per subject (a per-box index of the hosts with news); a box's durable consumer takes its own."""
RECOVERY_DURABLE = "recovery"
"""The console recovery's durable consumer of ``HM_LEDGER`` (issue 19 item 1, :mod:`services.recovery.consumer`)."""
RECOVERY_FILTER = f"{LEDGER_PREFIX}.>"
"""Its filter: every transition (the console role's grant names it, :func:`hostmove.access.nats_permissions`)."""
LEDGER_SUBJECTS = [f"{LEDGER_PREFIX}.>"]
FACTS_SUBJECTS = [f"{FACT_PREFIX}.>", f"{ALERT_PREFIX}.>"]
WORK_SUBJECTS = [f"{WORK_PREFIX}.*.*"]

MAX_TOKEN_BYTES = 1000
_SAFE = re.compile(rb"[A-Za-z0-9-]")
_TOKEN = re.compile(r"^(?:[A-Za-z0-9-]|_[0-9A-F]{2})+$")


class SubjectError(ValueError):
    pass


@lru_cache(maxsize=4096)
def encode_token(name: str) -> str:
    """A safe, reversible NATS subject token for any non-empty name (remembered: every event names its host's)."""
    if not name:
        raise SubjectError("a subject token needs a non-empty name")
    out = []
    for byte in name.encode("utf-8", errors="strict"):
        b = bytes([byte])
        out.append(b.decode() if _SAFE.match(b) else f"_{byte:02X}")
    token = "".join(out)
    if len(token) > MAX_TOKEN_BYTES:
        raise SubjectError(f"the name is too long for a subject token (over {MAX_TOKEN_BYTES} bytes encoded)")
    return token


@lru_cache(maxsize=4096)
def decode_token(token: str) -> str:
    """The inverse of :func:`encode_token`. Refuses anything it would not have produced (remembered, like it)."""
    if not _TOKEN.match(token):
        raise SubjectError(f"not a subject token: {token!r}")
    raw = bytearray()
    i = 0
    while i < len(token):
        if token[i] == "_":
            raw.append(int(token[i + 1 : i + 3], 16))
            i += 3
        else:
            raw.append(ord(token[i]))
            i += 1
    return raw.decode("utf-8")


def ledger_subject(obj: str, host: str) -> str:
    if obj not in ("claim", "record"):
        raise SubjectError(f"unknown object kind {obj!r}")
    return f"{LEDGER_PREFIX}.{obj}.{encode_token(host)}"


def parse_ledger_subject(subject: str) -> tuple[str, str]:
    """``(object, host)`` of a ledger subject."""
    parts = subject.split(".")
    if len(parts) != 4 or ".".join(parts[:2]) != LEDGER_PREFIX or parts[2] not in ("claim", "record"):
        raise SubjectError(f"not a ledger subject: {subject!r}")
    return parts[2], decode_token(parts[3])


def fact_subject(kind: str, host: str) -> str:
    return f"{FACT_PREFIX}.{encode_token(kind)}.{encode_token(host)}"


def alert_subject(kind: str) -> str:
    return f"{ALERT_PREFIX}.{encode_token(kind)}"


def incident_subject(kind: str, subject: str, incident: str) -> str:
    """``hm.alert.<kind>.<subject>.<incident>``: one subject per incident, so its one message is the durable record
    that it was raised (:func:`bus.facts.raise_incident`)."""
    return f"{ALERT_PREFIX}.{encode_token(kind)}.{encode_token(subject)}.{encode_token(incident)}"


def ledger_msg_id(obj: str, host: str, gen: int) -> str:
    """The ``Nats-Msg-Id`` of an object's gen: unique across the stream, bounded in length."""
    digest = hashlib.sha256(host.encode("utf-8")).hexdigest()[:32]
    return f"{obj}:{digest}:{gen}"


def work_subject(box: str, host: str) -> str:
    """The work notice subject of ``host`` for ``box`` (:data:`WORK_STREAM`)."""
    return f"{WORK_PREFIX}.{encode_token(box)}.{encode_token(host)}"


def work_filter(box: str) -> str:
    """The filter of ``box``'s durable consumer: its own notices only."""
    return f"{WORK_PREFIX}.{encode_token(box)}.*"


def parse_work_subject(subject: str) -> tuple[str, str]:
    """``(box, host)`` of a work notice subject."""
    parts = subject.split(".")
    if len(parts) != 4 or ".".join(parts[:2]) != WORK_PREFIX:
        raise SubjectError(f"not a work notice subject: {subject!r}")
    return decode_token(parts[2]), decode_token(parts[3])


def box_durable(box: str) -> str:
    """The name of ``box``'s durable consumer on :data:`WORK_STREAM` (a consumer name has no dots or wildcards)."""
    return f"box-{encode_token(box)}"


def box_wake_subject(label: str) -> str:
    """The subject a box's agent answers wake requests on (core NATS request/reply; the body is the host name)."""
    return f"{BOX_PREFIX}.{encode_token(label)}.wake"
