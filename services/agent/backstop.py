"""The box agent's backstop at the cost of what changed (issue 19 item 2; ARCHITECTURE §5). Pure.

Every ``scan_s`` the agent LISTs the claims prefix with the ETags (1,000 keys a request) and GETs only the claims
whose listed ETag differs from the one its own last GET answered (:func:`to_read`); an unchanged claim is the one
read then. Which hosts it then passes is :func:`look`: a claim that changed and names this box, an instance running
here (K6), or work that time alone makes due here; the other hosts get the region's straggler sweep on its own
cadence. A pass reads its host fresh before it acts (K5), so what is kept is only ever a hint.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import unquote

from events.claim import Claim
from services.box.instance.coverage import lost_owner_chores, publication_owed
from services.move.resolve import CLEAR_FAILED
from services.objstore.port import ObjectEntry

CLAIMS_PREFIX = "control/hosts/"


@dataclass(frozen=True)
class Seen:
    """A claim as the agent last read it: the ETag that GET answered, and the state (None: none, or a bad object,
    reported once per version and read again only when its ETag changes)."""

    etag: str | None
    claim: Claim | None


def host_of(key: str) -> str | None:
    """The host a key of the claims prefix names (``control/hosts/<quoted host>.json``), None for any other key."""
    if not key.startswith(CLAIMS_PREFIX) or not key.endswith(".json") or "/" in key[len(CLAIMS_PREFIX):]:
        return None
    return unquote(key[len(CLAIMS_PREFIX):-len(".json")])


def to_read(listing: list[ObjectEntry], seen: dict[str, Seen]) -> tuple[list[str], list[str]]:
    """``(hosts to GET, every host listed)``: a host is read when it is new, listed without an ETag, or listed with
    another ETag than its last read answered (a listing older than that read only costs a GET that finds it
    unchanged)."""
    read: list[str] = []
    listed: list[str] = []
    for entry in listing:
        host = host_of(entry.key)
        if host is None:
            continue
        listed.append(host)
        last = seen.get(host)
        if last is None or entry.etag is None or last.etag != entry.etag:
            read.append(host)
    return read, listed


@dataclass(frozen=True)
class Here:
    """What this box holds of one host, when the scan looks: an instance running, the host asleep, its last wake's
    backoff still running, and whether its pass's at-rest looks (the retention's, the serving box's sweep) are due."""

    running: bool = False
    asleep: bool = False
    held_off: bool = False
    looks_due: bool = False


@dataclass(frozen=True)
class Look:
    """What the scan does with one host: pass it (``why``), and/or give it the straggler sweep (on its cadence)."""

    passes: bool
    sweeps: bool
    why: str = ""


def look(claim: Claim, *, label: str, region: str, changed: bool, here: Here) -> Look:
    """The backstop's decision for one host (module doc). Every reason the pass of an unchanged claim has work is
    kept: an operation in flight (its record moves without its claim: a missed record notice), a serving host of
    this box not running, not asleep and not held off (a wake is due), an operator's ``--clear-failed`` left
    pending, a publication an outage stopped (§7.14), the retention's and the at-rest sweep's cadence, and the
    chores this box owns or adopts from a lost box (K8, §7.10). The timers of a sleeping host wake it through the
    timer runner's demand, not here."""
    names = claim.op.exec == label or label in claim.op.participants
    owes = any(o.owner == label for o in claim.obligations) or bool(lost_owner_chores(claim, region))
    if here.running:
        return Look(True, False, "an instance runs here (K6)")
    if not names:
        return Look(True, True, "a chore this box owns") if owes else Look(False, True)
    if changed:
        return Look(True, False, "its claim changed")
    if claim.op.kind != "serving":
        return Look(True, False, f"an operation in flight ({claim.op.kind})")
    if owes:
        return Look(True, False, "a chore this box owns")
    if claim.op.exec != label or claim.holder is None:
        return Look(False, False)
    if CLEAR_FAILED in claim.op.journal:
        return Look(True, False, "a clear-failed request")
    if not here.asleep and not here.held_off:
        return Look(True, False, "a wake is due")
    if publication_owed(claim, label, region):
        return Look(True, False, "a publication is owed")
    if here.looks_due:
        return Look(True, False, "its at-rest looks are due")
    return Look(False, False)


__all__ = ["CLAIMS_PREFIX", "Here", "Look", "Seen", "host_of", "look", "to_read"]
