"""Which boxes a transition concerns (issue 19 item 1; ARCHITECTURE §5 "an event is only a wake-up").

After each committed transition the ledger sends a work notice (``hm.work.<box>.<host>``, :data:`bus.subjects.
WORK_STREAM`) to every box the object named before or after it: a claim's execution holder, its operation's
participants, its writer's box and its obligations' owners; a record's source and target. A box's durable consumer
takes only its own notices, so its cost follows its own hosts, not the deployment's. A notice is never authority:
the box reads the claim fresh (ARCHITECTURE §5), and a notice that never arrived is found by the reconciliation
scan (``scan_s``). Pure.
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
    if isinstance(state, Record) and state.move is not None:
        return {state.move.from_, state.move.to}
    return set()


def boxes_concerned(prev: Claim | Record | None, new: Claim | Record) -> list[str]:
    """The boxes to notify of ``prev`` -> ``new``, sorted: every box label either names (never ``none``, an empty
    name or a region's placeholder owner such as ``@region``)."""
    return sorted(b for b in _boxes(prev) | _boxes(new) if b and b != "none" and not b.startswith("@"))
