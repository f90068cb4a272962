"""K5: every box step revalidates the claim's op id, kind and phase (and ``exec``) first (spec §19.2 K5,
§7.2 "Every box transition is a CAS on the record guarded by move.id and move.incarnation, and
revalidates the claim's op id, kind and phase first"). Pure.
"""

from __future__ import annotations

from collections.abc import Collection

from events.claim import Claim
from events.record import Move, Record
from kernel import rules

rules.register(
    "revalidate-before-effect",
    section="§19.2 K5; claim C3; §7.2",
    meaning="a box step acts only while the claim's op id, kind and phase (and exec) are what it expects",
    site="services/move/guards.py step_allowed",
)
rules.alias("k5-revalidate", "revalidate-before-effect")  # tests/test_target.py reads the project's old name


def live_move(record: Record | None, move_id: str, incarnation: str) -> Move | None:
    """The record's move when it is still this move (id and incarnation), else None."""
    if record is None or record.move is None:
        return None
    move = record.move
    return move if move.id == move_id and move.incarnation == incarnation else None


def step_allowed(
    claim: Claim | None,
    *,
    op_id: str,
    kinds: Collection[str],
    phases: Collection[str] | None = None,
    exec_box: str | None = None,
) -> str | None:
    """None when the box may take its step; otherwise why not, in plain words."""
    if not rules.on("revalidate-before-effect"):
        return None
    if claim is None:
        return "the host has no claim"
    op = claim.op
    if op.id != op_id:
        return f"the claim holds operation {op.id or 'none'}, not {op_id}"
    if op.kind not in kinds:
        return f"the claim is {op.kind}, not {' or '.join(sorted(kinds))}"
    if phases is not None and op.phase not in phases:
        return f"the claim's phase is {op.phase or 'empty'}, not {' or '.join(sorted(phases))}"
    if exec_box is not None and op.exec != exec_box:
        return f"the execution holder is {op.exec}, not {exec_box}"
    return None
