"""Quarantine and readmission of a box declared lost (spec §7.10 "A returning box is quarantined", claim §7.2; model
rule ``lost-quarantine``; issue 15 item 6).

A declaration puts the box on the host's ``lost`` list (``claim.lost``): ``choose()`` never names it for that host
and the activator never starts the host there. A box declared lost that starts again (a stopped machine started)
first, before it adopts or starts anything, finds every claim that lists it lost and not yet retired, and for each
retires **every local artifact of that host** under the host guard (the retired marker first, then each artifact
parked, the route row and the timers deleted: :func:`quarantine`), then records ``retired_at`` on its entry of the
claim's ``lost`` list (:func:`decide_retired`, a claim CAS a box may write; it never writes the roster). It runs
nothing of those hosts. Only then can an operator ``hostmove box readmit --label L`` take the box off each host's
list (:func:`decide_readmit_claim`), once no operation of the host names it. A fenced box (a terminated enrollment)
is never readmitted. Without the quarantine a restarted box would keep stale local state for the host (the model
starts stopped boxes again after they were declared lost).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote

import msgspec

from events.claim import Claim, LostBox
from kernel import rules
from kernel.ports import Clock
from services.box.fence import FENCES_PREFIX
from services.box.instance.guard import host_guard
from services.box.instance.registry import Registry
from services.box.instance.stamps import StampBook
from services.box.instance.timers import Timers
from services.ledger.ledger import BadObject, Committed, Ledger, NoChange, Refusal
from services.objstore.port import StoreUnavailable

rules.register(
    "lost-quarantine",
    section="§7.10 'A returning box is quarantined'; claim §7.2; model rule lost-quarantine (CC12)",
    meaning="a box declared lost that starts again retires every local artifact of those hosts before anything else",
    site="services/box/quarantine.py quarantine",
)
log = logging.getLogger("hostmove.quarantine")
QUARANTINE_OP = "quarantine"
CLAIMS_PREFIX = "control/hosts/"


def owes_quarantine(claim: Claim | None, label: str) -> bool:
    """The claim lists ``label`` lost and the box has not retired its local state of the host yet."""
    return claim is not None and any(b.box == label and b.retired_at is None for b in claim.lost)


def decide_retired(claim: Claim | None, label: str, at: int) -> Claim | NoChange | Refusal:
    """The box's acknowledgement: it retired every local artifact of the host (``retired_at`` on its entry)."""
    if claim is None or not any(b.box == label for b in claim.lost):
        return NoChange(f"box {label} is not on this host's lost list")
    if not owes_quarantine(claim, label):
        return NoChange("the quarantine is already recorded")
    lost = tuple(msgspec.structs.replace(b, retired_at=at) if b.box == label else b for b in claim.lost)
    return msgspec.structs.replace(claim, lost=lost)


def decide_readmit_claim(claim: Claim | None, label: str) -> Claim | NoChange | Refusal:
    """``hostmove box readmit``'s claim CAS: the box off the host's ``lost`` list, refused with its reason while it
    has not retired its local state, while it is fenced there (a terminated enrollment), or while an operation of
    the host still names it."""
    entry = next((b for b in claim.lost if b.box == label), None) if claim is not None else None
    if claim is None or entry is None:
        return NoChange(f"box {label} is not on this host's lost list")
    if entry.fence.startswith(FENCES_PREFIX):
        return Refusal(f"box {label} was fenced (its machine was terminated): a terminated enrollment is never "
                       "readmitted; enroll a replacement under a new label")
    if entry.retired_at is None and rules.on("lost-quarantine"):
        return Refusal(f"box {label} has not retired its local state of {claim.host} yet: start it (its agent retires "
                       "that state before anything else) and readmit it then")
    if claim.op.kind != "serving" or label in claim.op.participants or claim.op.exec == label:
        return Refusal(f"{claim.host} is {claim.op.kind}; box {label} leaves its lost list once it serves again")
    return msgspec.structs.replace(claim, lost=tuple(b for b in claim.lost if b.box != label))


@dataclass(frozen=True)
class Readmission:
    """What one ``hostmove box readmit`` did: the hosts whose ``lost`` list it left, and each refusal's reason."""

    readmitted: tuple[str, ...]
    refused: tuple[str, ...]


async def readmit(ledger: Ledger, label: str) -> Readmission:
    """``hostmove box readmit --label L``'s claim CASes (module docstring): every host whose claim lists ``label``
    lost, each through :func:`decide_readmit_claim` (refused while the box has not retired its state of the host,
    while an operation of the host names it, or for a fenced box). The caller checks the roster first."""
    readmitted: list[str] = []
    refused: list[str] = []
    for key in await ledger.store.list_keys(ledger.bucket, CLAIMS_PREFIX):
        if not key.endswith(".json"):
            continue
        host = unquote(key[len(CLAIMS_PREFIX):-5])
        claim = (await ledger.read_claim(host)).state
        if claim is None or not any(b.box == label for b in claim.lost):
            continue
        out = await ledger.transition("claim", host, "box-readmitted", lambda cur: decide_readmit_claim(cur, label),
                                      causation="operator")
        if isinstance(out, Committed):
            readmitted.append(host)
        elif isinstance(out, Refusal):
            refused.append(out.reason)
        else:
            refused.append(f"{host} kept changing; run it again")
    return Readmission(tuple(readmitted), tuple(refused))


@dataclass(frozen=True)
class Quarantined:
    """What the quarantine retired of one host: artifacts parked, whether a row went, how many timers."""

    host: str
    parked: int
    row_deleted: bool
    timers_deleted: int


def quarantine_event(lost: LostBox) -> str:
    """The retirement event of one declaration's quarantine (§6.4 "one destination per retirement event"): a box
    readmitted, chosen again and declared lost again for the same host quarantines again, into a directory of its
    own (``.parked/superseded-quarantine/quarantine-local-<declared at>/<host>/``); a replay of one quarantine
    names the same."""
    return f"quarantine-local-{lost.at or 0}"


async def quarantine(*, box_dir: Path, host: str, stamps: StampBook, registry: Registry, timers: Timers,
                     read_claim: Callable[[], Awaitable[Claim | None]], clock: Clock,
                     event: str) -> Quarantined | None:
    """Retire, under the host's guard, every local artifact of ``host`` (module docstring) as retirement ``event``
    (:func:`quarantine_event`); None with the rule off (the mutation: nothing is retired). Idempotent: a replay
    parks nothing new."""
    if not rules.on("lost-quarantine"):
        return None
    async with host_guard(box_dir, host, read_claim, clock=clock) as guarded:
        parked = 0
        for incarnation in stamps.incarnations(host):
            parked += len(stamps.retire_installation(guarded, incarnation, op=QUARANTINE_OP, event=event))
        return Quarantined(host, parked, registry.delete_retired(host), timers.delete_all(host))


async def quarantine_on_start(*, label: str, box_dir: Path, stamps: StampBook, registry: Registry, timers: Timers,
                              ledger: Ledger, clock: Clock, stop: asyncio.Event | None = None,
                              retry_s: float = 1.0) -> list[Quarantined]:
    """A box agent's first act: every host whose claim lists this box lost and unretired is quarantined and its
    ``retired_at`` recorded. An outage of the store is waited out (a read error never acts)."""
    while True:
        try:
            keys = await ledger.store.list_keys(ledger.bucket, CLAIMS_PREFIX)
            break
        except StoreUnavailable as exc:
            log.warning("box %s waits for the store to list the claims before anything else: %s", label, exc)
            if stop is not None and stop.is_set():
                return []
            await asyncio.sleep(retry_s)
    done: list[Quarantined] = []
    for key in keys:
        if not key.endswith(".json"):
            continue
        host = unquote(key[len(CLAIMS_PREFIX):-5])
        try:
            claim = (await ledger.read_claim(host)).state
        except BadObject as bad:  # that host only (issue 14 item 6): the agent's scan alerts it once; never its own
            log.warning("box %s cannot read the claim of %s before anything else (%s); skipped", label, host, bad)
            continue
        owed = next((b for b in claim.lost if b.box == label and b.retired_at is None), None) if claim else None
        if owed is None:
            continue

        async def read_claim(host: str = host) -> Claim | None:
            return (await ledger.read_claim(host)).state

        retired = await quarantine(box_dir=box_dir, host=host, stamps=stamps, registry=registry, timers=timers,
                                   read_claim=read_claim, clock=clock, event=quarantine_event(owed))
        if retired is None:
            continue
        at = clock.now_ms()
        out = await ledger.transition("claim", host, "box-quarantined",
                                      lambda cur, at=at: decide_retired(cur, label, at),  # type: ignore[misc]
                                      causation=f"quarantine:{label}")
        if isinstance(out, Committed | NoChange):
            done.append(retired)
        log.warning("box %s was declared lost for %s: it retired its local state (%d artifacts parked) before "
                    "anything else and runs nothing of it; readmit it with hostmove box readmit --label %s", label,
                    host, retired.parked, label)
    return done


__all__ = ["QUARANTINE_OP", "Quarantined", "Readmission", "decide_readmit_claim", "decide_retired", "owes_quarantine",
           "quarantine", "quarantine_event", "quarantine_on_start", "readmit"]
