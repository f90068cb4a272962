"""Which boxes a transition concerns (issue 19 item 1; ARCHITECTURE §5 "an event is only a wake-up").

After each committed transition the ledger sends a work notice (``hm.work.<box>.<host>``,
:data:`bus.subjects.WORK_STREAM`) to every box the object named before or after it: a claim's execution holder, its
operation's participants, its writer's box and its obligations' owners; for a record (which names regions, not
boxes) those of the host's claim as the writer last saw it (a record writer revalidates against the claim first,
K5). A box's durable consumer takes only its own notices, so its cost follows its own hosts, not the deployment's.
A notice is never authority: the box reads the claim fresh, and a notice that never arrived is found by the
reconciliation scan (``scan_s``). Pure.
"""

from __future__ import annotations

from events.claim import Claim
from events.record import Record

__all__ = ["boxes_concerned"]


def _boxes(state: Claim | Record | None) -> set[str]:
    if isinstance(state, Claim):
        out = {state.op.exec, *state.op.participants, *(o.owner for o in state.obligations)}
        if state.holder is not None:
            out.add(state.holder.writer_box)
        return out
    return set()


def boxes_concerned(prev: Claim | Record | None, new: Claim | Record, claim: Claim | None = None) -> list[str]:
    """The boxes to notify of ``prev`` -> ``new``, sorted: every box label either names, and for a record those of
    ``claim`` (never ``none``, an empty name or a region's placeholder owner such as ``@region``)."""
    named = _boxes(prev) | _boxes(new) | (_boxes(claim) if isinstance(new, Record) else set())
    return sorted(b for b in named if b and b != "none" and not b.startswith("@"))
