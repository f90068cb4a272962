"""The functional core of the projection: fold one transition into a host's snapshot row.

Pure (no I/O, no clock): :func:`step` takes the host's previous row and one decoded
:class:`~events.Transition` and returns the next row, or ``None`` when the event must not be
applied, plus the notes the shell records in the ``errors`` table (ARCHITECTURE §8; run-store
concepts, "Execution revisions": the revision comparison rejects stale updates). Revisions are
assigned by the shell, one per applied change.

Rules:

- gens: an event of gen ``previous + 1`` is the normal case; a larger gen is applied and noted as a
  ``gap`` (the audit owns gap reporting); a gen at or below the view's is ``stale`` and not applied
  (applying it would move the view backwards). A ``rebase`` restates the full state: never a gap,
  applied unless it is older than the view.
- tombstones: a claim with no holder and ``op.kind == "free"`` marks the host ``deleted``; the row is
  kept, and a later live claim revives it. A host whose first event is such a claim is born deleted
  (it never existed as a live host). Record events leave the flag as it was.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Literal

import msgspec

from events import Claim, Record, Transition

NoteKind = Literal["gap", "stale"]

_JSON = msgspec.json.Encoder(order="sorted")


@dataclass(frozen=True, slots=True)
class HostRow:
    """A host's snapshot: the claim's and the record's latest state flattened for dashboards."""

    host: str
    deleted: bool
    claim_gen: int
    record_gen: int
    op_kind: str
    op_phase: str
    op_id: str
    exec: str
    region: str
    incarnation: str
    move_id: str
    move_state: str
    cut_phase: str
    landing_phase: str
    move_to: str
    move_from: str
    requested_at: int | None
    cut_at: int | None
    flipped_at: int | None
    committed_at: int | None
    opened_at: int | None
    updated_at: int
    seq: int
    claim_json: str | Claim | None  # a struct until the row is written (encoded once, see :func:`as_json`)
    record_json: str | Record | None


COLUMNS: tuple[str, ...] = HostRow.__slots__  # type: ignore[assignment]
"""The row's columns in declaration order (the ``hosts`` table adds ``revision``)."""


@dataclass(frozen=True, slots=True)
class Note:
    kind: NoteKind
    reason: str


@dataclass(frozen=True, slots=True)
class Step:
    row: HostRow | None
    notes: tuple[Note, ...] = ()


def as_json(value: object) -> object:
    """A column value as stored: claim and record structs become canonical JSON text. Encoding is
    deferred to the write, so events superseded within one batch are never encoded."""
    if isinstance(value, Claim | Record):
        return _JSON.encode(value).decode("utf-8")
    return value


def _claim_part(claim: Claim) -> tuple[object, ...]:
    """The claim's columns, in :data:`_CLAIM_KEYS` order."""
    holder, op = claim.holder, claim.op
    region = holder.admissions[-1].region if holder is not None and holder.admissions else ""
    return (holder is None and op.kind == "free", claim.gen, op.kind, op.phase, op.id, op.exec, region,
            holder.incarnation if holder is not None else "", claim)


_NO_MOVE: tuple[object, ...] = ("", "", "", "", "", "", None, None, None, None, None)


def _record_part(record: Record) -> tuple[object, ...]:
    """The record's columns, in :data:`_RECORD_KEYS` order."""
    move = record.move
    if move is None:
        return (*_NO_MOVE, record.gen, record)
    return (move.id, move.state, move.cut_phase, move.landing_phase, move.to, move.from_, move.requested_at,
            move.cut_at, move.flipped_at, move.committed_at, move.opened_at, record.gen, record)


_CLAIM_KEYS = ("deleted", "claim_gen", "op_kind", "op_phase", "op_id", "exec", "region", "incarnation", "claim_json")
_RECORD_KEYS = ("move_id", "move_state", "cut_phase", "landing_phase", "move_to", "move_from", "requested_at",
                "cut_at", "flipped_at", "committed_at", "opened_at", "record_gen", "record_json")
_EMPTY_CLAIM = (False, 0, "", "", "", "", "", "", None)
_EMPTY_RECORD = (*_NO_MOVE, 0, None)
_CLAIM_OF = operator.attrgetter(*_CLAIM_KEYS)
_RECORD_OF = operator.attrgetter(*_RECORD_KEYS)
assert COLUMNS == ("host", *_CLAIM_KEYS[:2], "record_gen", *_CLAIM_KEYS[2:-1], *_RECORD_KEYS[:-2],
                   "updated_at", "seq", "claim_json", "record_json"), "HostRow's columns moved: update the fold"


def _row(host: str, claim: tuple[object, ...], record: tuple[object, ...], at: int, seq: int) -> HostRow:
    """A row from its claim and record parts (the order of :class:`HostRow`'s fields)."""
    return HostRow(host, claim[0], claim[1], record[11], *claim[2:8], *record[:11], at, seq,  # type: ignore[arg-type, call-arg]
                   claim[8], record[12])


def step(prev: HostRow | None, t: Transition, seq: int) -> Step:
    """The next row of ``t.host`` after the event at stream position ``seq``."""
    obj = t.object
    prev_gen = 0 if prev is None else (prev.claim_gen if obj == "claim" else prev.record_gen)
    notes: list[Note] = []
    if t.gen < prev_gen or (t.gen == prev_gen and t.kind != "rebase"):
        return Step(None, (Note("stale", f"{obj} gen {t.gen} is not after the view's gen {prev_gen}; "
                                         f"not applied ({t.kind})"),))
    if t.kind != "rebase" and t.gen != prev_gen + 1:
        notes.append(Note("gap", f"{obj} gen {prev_gen} -> {t.gen}: gens {prev_gen + 1}..{t.gen - 1} "
                                 "are not on the stream"))
    if obj == "claim":
        claim = _claim_part(t.state)  # type: ignore[arg-type]
        record = _EMPTY_RECORD if prev is None else _RECORD_OF(prev)
    else:
        record = _record_part(t.state)  # type: ignore[arg-type]
        claim = _EMPTY_CLAIM if prev is None else _CLAIM_OF(prev)
    return Step(_row(t.host, claim, record, t.meta.at, seq), tuple(notes))
