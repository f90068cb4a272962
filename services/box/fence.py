"""Box termination fences (spec §7.10 "A source terminated", "The fence reference"; claim rev 6.28 §7.3; M16).

A box that is gone for good is **fenced**: its compute is verified dead first, then ``control/box-fences/<label>.json``
records it (create-only) and the roster marks the entry ``fenced_at``. A fenced box never acts again: its agent
refuses to start, its label can never register again, no operation chooses it. Its hosts are relocated to a
replacement box of its region (:mod:`services.recovery.relocation`).

Every transition that relies on a fence cites it as ``{"enrollment", "key", "sha256"}``: the box's enrollment, the
fence's key and the SHA-256 of the exact bytes the transition verified; a consumer re-reads the key and compares.

**Compute fencing** is the platform port (:mod:`services.box.compute`): the fence is written only after the
platform shows the box's compute, as the roster records it, ``terminated`` (never on the operator's word alone, and
never from a lease or a claim CAS: joint D6). On the embedded default the platform is :class:`LocalCompute` (the
box's cgroup subtree ``hostmove/<deployment>/<box>`` and its platform record), on EC2 ``DescribeInstances``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar
from urllib.parse import quote

import msgspec

from bus.facts import Fact, publish_alert
from bus.log import EventLog
from events.base import Durable, Ident, Millis, canonical, decode
from events.envelope import Actor
from kernel.ports import Clock
from services.box.compute import BoxCompute, ComputeRefused, ComputeState
from services.box.roster import Roster, RosterBox, RosterRefusal, read_roster, update_roster
from services.objstore.port import Got, ObjectStore

FENCES_PREFIX = "control/box-fences/"


class BoxFence(Durable, frozen=True):
    """``control/box-fences/<label>.json``: the box is dead and never acts again."""

    __durable_root__: ClassVar[bool] = True

    label: Ident
    region: Ident
    enrollment: str  # the roster entry it fences: "<secrets key fp>@<registered_at>"
    fenced_at: Millis
    evidence: str  # what showed the compute dead, in the operator's words


@dataclass(frozen=True)
class FenceRef:
    """What a transition cites (spec §7.10 "The fence reference")."""

    label: str
    enrollment: str
    key: str
    sha256: str

    def journal(self) -> dict[str, str]:
        return {"enrollment": self.enrollment, "key": self.key, "sha256": self.sha256}


def fence_key(label: str) -> str:
    return f"{FENCES_PREFIX}{quote(label, safe='')}.json"


def enrollment_of(entry_fp: str, registered_at: int) -> str:
    return f"{entry_fp}@{registered_at}"


async def read_fence(store: ObjectStore, bucket: str, label: str) -> tuple[BoxFence, FenceRef] | None:
    """The box's fence and its reference, or None. A corrupt fence raises (C6: a read error never acts)."""
    key = fence_key(label)
    got = await store.get(bucket, key)
    if not isinstance(got, Got):
        return None
    fence = decode(got.body, BoxFence)
    return fence, FenceRef(label, fence.enrollment, key, hashlib.sha256(got.body).hexdigest())


def verify_ref(ref: Mapping[str, object], fence: tuple[BoxFence, FenceRef] | None,
               entry: RosterBox | None = None) -> str | None:
    """Why a cited fence reference does not hold, or None (§7.10 "The fence reference": every consumer re-reads the
    record at ``key`` and requires its digest to equal ``sha256`` and its enrollment to be the cited one and, given
    the roster's ``entry`` for the box, the roster's)."""
    if fence is None:
        return "the cited fence does not exist"
    record, current = fence
    if dict(ref) != current.journal():
        return f"the cited fence of {current.label} is not the one at {current.key} now"
    if entry is not None and (entry.label != record.label or entry.region != record.region
                              or enrollment_of(entry.secrets_key_fp, entry.registered_at) != record.enrollment):
        return (f"the fence at {current.key} names enrollment {record.enrollment} in {record.region}, not the "
                f"roster's box {entry.label}")
    return None


class FenceRefused(Exception):
    """The box could not be fenced; nothing was recorded. The message is in the operator's words."""


def decide_fence_roster(current: Roster | None, label: str, at: int) -> Roster:
    """Mark the roster entry fenced (idempotent). An unknown box cannot be fenced."""
    entry = current.box(label) if current is not None else None
    if current is None or entry is None:
        raise RosterRefusal(f"box {label} is not in the roster; there is nothing to fence")
    if entry.fenced_at is not None:
        return current
    boxes = tuple(msgspec.structs.replace(b, fenced_at=at) if b.label == label else b for b in current.boxes)
    return Roster(gen=current.gen + 1, boxes=boxes)


async def fence_box(*, store: ObjectStore, bucket: str, events: EventLog, clock: Clock, actor: Actor, label: str,
                    compute: ComputeState) -> tuple[BoxFence, FenceRef]:
    """Fence ``label``: the platform must show its compute ``terminated`` first, then the record (create-only; an
    existing fence stands), then the roster entry and an alert. Safe to run again after a crash at any point."""
    roster, _ = await read_roster(store, bucket)
    entry = roster.box(label) if roster is not None else None
    if entry is None:
        raise FenceRefused(f"box {label} is not in the roster; there is nothing to fence")
    existing = await read_fence(store, bucket, label)
    if existing is None:
        try:
            seen = await compute.observe(BoxCompute.of(entry))
        except ComputeRefused as exc:
            raise FenceRefused(str(exc)) from None
        if seen.status != "terminated":
            raise FenceRefused(f"the platform shows box {label} {seen.status} ({seen.evidence}); only a terminated "
                               "machine is fenced, so nothing was recorded")
        fence = BoxFence(label=label, region=entry.region, enrollment=enrollment_of(entry.secrets_key_fp,
                         entry.registered_at), fenced_at=clock.now_ms(), evidence=seen.evidence)
        await store.put(bucket, fence_key(label), canonical(fence), if_none_match=True)  # Lost: another fencer's
        existing = await read_fence(store, bucket, label)  # record stands; either way the bytes read back are cited
        if existing is None:
            raise FenceRefused(f"the fence of box {label} was written but cannot be read back; run it again")
    record, ref = existing
    await update_roster(store, bucket, lambda cur: decide_fence_roster(cur, label, record.fenced_at))
    await publish_alert(events, Fact(kind="box-fenced", subject=label, id=f"box-fenced:{label}", actor=actor,
                                     at=clock.now_ms(), payload={"region": record.region, "evidence": record.evidence}))
    return record, ref


__all__ = ["FENCES_PREFIX", "BoxFence", "FenceRef", "FenceRefused", "decide_fence_roster", "fence_box", "fence_key",
           "read_fence", "verify_ref"]
