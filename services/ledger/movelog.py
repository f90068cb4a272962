"""The move log (spec §13 "Move log" and "Timings"): one object per transition of a move, and a summary at its close.

Written by the actor that made the transition, right after its record CAS (:meth:`MoveLog.note`, called by
:meth:`services.ledger.Ledger.transition`), into the deployment bucket beside the move's reports and evidence:

- ``moves/<host>/<move>/log/<gen>.json``: one :class:`Entry` per record transition of the move (its state, phases,
  reason, digests and §13 timings as they stood at that gen), create-only, so a retry writes nothing twice;
- ``moves/<host>/<move>/log/claim-<gen>.json``: one :class:`ClaimEntry` per claim transition of the move's op (the
  execution holder, the participants, the op's phase), up to the claim's return to ``serving``;
- ``moves/<host>/<move>/log/summary.json``: the :class:`Summary` the closing transition writes (outcome, timings);
- ``moves/_by-id/<move>.json``: which host a move id belongs to (``hostmove move show MOVE_ID``).

The decision is pure (:func:`entry_for`, :func:`summary_for`, :func:`timings`); the writer and the readers are thin.
A failed write never fails the transition it describes: the record is the authority and the log its account; the
failure is logged with the key it missed.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any

import msgspec

from events.base import canonical
from events.claim import Claim
from events.envelope import EventMeta
from events.record import Move, Record
from kernel.logctx import ctx
from services.objstore.port import Got, ObjectStore, StoreError

log = logging.getLogger("hostmove.movelog")

VERSION = 1
PREPARE_BUDGET_S = 3600.0
"""§13 paging: ``preparing`` with no promotable round for 60 minutes is a warning: the prepare budget."""
INDEX_PREFIX = "moves/_by-id/"


class Timing(msgspec.Struct, frozen=True):
    """One §13 timing: ``elapsed_ms`` (None: not started), whether it still runs, its budget (None: not known yet)."""

    name: str
    elapsed_ms: int | None
    running: bool
    budget_s: float | None
    over: bool


class Actor(msgspec.Struct, frozen=True):
    service: str
    box: str = ""


class Entry(msgspec.Struct, frozen=True):
    """One transition of a move as its writer made it (§13 "Move log")."""

    v: int
    host: str
    move_id: str
    gen: int
    at: int
    name: str
    actor: Actor
    causation: str
    state: str
    cut_phase: str
    landing_phase: str
    rollback_target_phase: str
    rollback_source_phase: str
    from_: str = msgspec.field(name="from")
    to: str = ""
    reason: str = ""
    digests: dict[str, str] = msgspec.field(default_factory=dict)
    timings: list[Timing] = msgspec.field(default_factory=list)


class ClaimEntry(msgspec.Struct, frozen=True):
    """One claim transition of a move (the execution holder, the participants, the op's phase) as its writer made it."""

    v: int
    host: str
    move_id: str
    gen: int
    at: int
    name: str
    actor: Actor
    causation: str
    kind: str
    phase: str
    exec: str
    participants: list[str]
    digests: dict[str, str] = msgspec.field(default_factory=dict)


class Summary(msgspec.Struct, frozen=True):
    """A move's close (§13): its outcome, who asked, when, and its timings against their budgets."""

    v: int
    host: str
    move_id: str
    outcome: str
    closed_at: int
    closed_by: Actor
    from_: str = msgspec.field(name="from")
    to: str = ""
    cut: str = "auto"
    requested_by: str = ""
    requested_at: int | None = None
    reason: str = ""
    rolled_back: bool = False
    timings: list[Timing] = msgspec.field(default_factory=list)


def host_segment(host: str) -> str:
    from urllib.parse import quote

    return quote(host, safe=".-_~@+")


def log_prefix(host: str, move_id: str) -> str:
    """``moves/<host>/<move>/log/`` in the deployment bucket (§13: beside the reports and evidence)."""
    return f"moves/{host_segment(host)}/{move_id}/log/"


def entry_key(host: str, move_id: str, gen: int) -> str:
    return f"{log_prefix(host, move_id)}{gen:012d}.json"


def claim_entry_key(host: str, move_id: str, gen: int) -> str:
    return f"{log_prefix(host, move_id)}claim-{gen:012d}.json"


def summary_key(host: str, move_id: str) -> str:
    return f"{log_prefix(host, move_id)}summary.json"


def index_key(move_id: str) -> str:
    return f"{INDEX_PREFIX}{move_id}.json"


# -- the pure core ---------------------------------------------------------------------------------


def _span(start: int | None, end: int | None, now_ms: int, running: bool) -> tuple[int | None, bool]:
    if start is None:
        return None, False
    if end is not None:
        return end - start, False
    if running:
        return max(0, now_ms - start), True
    return None, False


def _timing(name: str, span: tuple[int | None, bool], budget_s: float | None) -> Timing:
    elapsed, running = span
    over = elapsed is not None and budget_s is not None and elapsed > budget_s * 1000
    return Timing(name, elapsed, running, budget_s, over)


def timings(move: Move, now_ms: int, *, closed: bool = False) -> list[Timing]:
    """§13 "Timings": prepare (``requested_at`` to ``ready_at``, budget 60 min), cut (``cut_at`` to ``flipped_at``,
    budget ``cut_deadline - cut_at``), land (``flipped_at`` to the open or the rollback, budget
    ``landing_deadline - flipped_at``) and offline (``cut_at`` to the open, or to the source's reopen after a
    rollback, budget the cut window). ``closed``: nothing still runs."""
    state = move.state
    rb = move.rollback
    live = not closed
    prep = _span(move.requested_at, move.ready_at, now_ms, live and state == "preparing")
    cut = _span(move.cut_at, move.flipped_at, now_ms, live and state == "cutting")
    land_end = move.opened_at or (rb.requested_at if rb is not None else None)
    land = _span(move.flipped_at, land_end, now_ms, live and state in ("landing", "committed"))
    off_end = move.opened_at or (rb.opened_at if rb is not None else None)
    off = _span(move.cut_at, off_end, now_ms, live and state not in ("stuck", "aborted", "done", "rolled_back"))
    cut_budget = (move.cut_deadline - move.cut_at) / 1000 if move.cut_at and move.cut_deadline else None
    land_budget = ((move.landing_deadline - move.flipped_at) / 1000
                   if move.flipped_at and move.landing_deadline else None)
    return [_timing("prepare", prep, PREPARE_BUDGET_S), _timing("cut", cut, cut_budget),
            _timing("land", land, land_budget), _timing("offline", off, move.cut_budget_s or None)]


def digests(move: Move, record_body: bytes) -> dict[str, str]:
    """What a transition fixed, by digest: the record's bytes at that gen, the move's inputs (release, overlay), the
    source's files (plain and sealed) and the stop evidence each side cited (§5.3, §8)."""
    out = {"record_sha256": hashlib.sha256(record_body).hexdigest()}
    src, rb = move.source, move.rollback
    for name, value in (("release", move.inputs.release), ("overlay_etag", move.inputs.overlay_etag),
                        ("files_plain", src.files.plain), ("files_sealed", src.files.sealed),
                        ("source_evidence", src.evidence),
                        ("rollback_evidence", rb.evidence if rb is not None else "")):
        if value:
            out[name] = value
    return out


def _actor(meta: EventMeta) -> Actor:
    return Actor(service=meta.actor.service, box=meta.actor.box)


def entry_for(new: Record, meta: EventMeta) -> Entry | None:
    """The log entry of the record transition to ``new`` (None: the record holds no live move)."""
    move = new.move
    if move is None:
        return None
    rb = move.rollback
    reason = move.reason or (rb.reason if rb is not None else "")
    return Entry(
        v=VERSION, host=new.host, move_id=move.id, gen=new.gen, at=meta.at, name=meta.name, actor=_actor(meta),
        causation=meta.causation, state=move.state, cut_phase=move.cut_phase, landing_phase=move.landing_phase,
        rollback_target_phase=rb.target_phase if rb is not None else "",
        rollback_source_phase=rb.source_phase if rb is not None else "",
        from_=move.from_, to=move.to, reason=reason, digests=digests(move, canonical(new)),
        timings=timings(move, meta.at))


MOVE_OPS = ("moving", "landing", "reverting", "restoring")
"""The claim's op kinds while a move runs (§7.1 to §7.8): its op id is the move's."""


def claim_entry_for(prev: Claim | None, new: Claim, meta: EventMeta) -> ClaimEntry | None:
    """The log entry of the claim transition to ``new``: a move's op (``new``'s, or the one ``prev`` held when
    ``new`` ends it), else None."""
    if new.op.kind in MOVE_OPS and new.op.id:
        move_id = new.op.id
    elif prev is not None and prev.op.kind in MOVE_OPS and prev.op.id:
        move_id = prev.op.id
    else:
        return None
    return ClaimEntry(v=VERSION, host=new.host, move_id=move_id, gen=new.gen, at=meta.at, name=meta.name,
                      actor=_actor(meta), causation=meta.causation, kind=new.op.kind, phase=new.op.phase,
                      exec=new.op.exec, participants=list(new.op.participants),
                      digests={"claim_sha256": hashlib.sha256(canonical(new)).hexdigest()})


def summary_for(prev: Record | None, new: Record, meta: EventMeta) -> Summary | None:
    """The close's summary: ``new`` ends the live move ``prev`` held (its ``last_move`` names it). None otherwise."""
    if prev is None or prev.move is None or new.move is not None or new.last_move is None:
        return None
    move, last = prev.move, new.last_move
    if last.id != move.id:
        return None
    rb = move.rollback
    return Summary(
        v=VERSION, host=new.host, move_id=move.id, outcome=last.outcome, closed_at=last.at or meta.at,
        closed_by=_actor(meta), from_=move.from_, to=move.to, cut=move.cut, requested_by=move.requested_by,
        requested_at=move.requested_at, reason=move.reason or (rb.reason if rb is not None else ""),
        rolled_back=rb is not None, timings=timings(move, last.at or meta.at, closed=True))


# -- the writer ------------------------------------------------------------------------------------


class MoveLog:
    """Writes a move's log objects into the deployment bucket, create-only (a retry or a relay writes nothing
    twice)."""

    def __init__(self, store: ObjectStore, bucket: str) -> None:
        self.store = store
        self.bucket = bucket

    async def _create(self, key: str, value: Any, host: str, move_id: str) -> None:
        try:
            await self.store.put(self.bucket, key, canonical(value), if_none_match=True)
        except StoreError as exc:  # the transition stands; its account misses one object, said here
            log.warning("move log object %s not written: %s", key, exc,
                        extra=ctx(host=host, op_id=move_id, phase="move-log", reason=exc))

    async def note(self, prev: Record | Claim | None, new: Record | Claim, meta: EventMeta) -> None:
        """Log the transition ``prev`` -> ``new`` made under ``meta`` (§13): a record's or a claim's."""
        if isinstance(new, Claim):
            claimed = claim_entry_for(prev if isinstance(prev, Claim) else None, new, meta)
            if claimed is not None:
                await self._create(claim_entry_key(new.host, claimed.move_id, new.gen), claimed, new.host,
                                   claimed.move_id)
            return
        prev = prev if isinstance(prev, Record) else None
        entry = entry_for(new, meta)
        if entry is not None:
            if prev is None or prev.move is None or prev.move.id != entry.move_id:
                await self._create(index_key(entry.move_id), {"host": new.host, "move_id": entry.move_id},
                                   new.host, entry.move_id)
            await self._create(entry_key(new.host, entry.move_id, new.gen), entry, new.host, entry.move_id)
        summary = summary_for(prev, new, meta)
        if summary is not None:
            await self._create(summary_key(new.host, summary.move_id), summary, new.host, summary.move_id)


# -- the readers -----------------------------------------------------------------------------------


def _json(body: bytes) -> Any:
    return msgspec.json.decode(body)


async def read_move(store: ObjectStore, bucket: str, move_id: str, host: str | None = None
                    ) -> dict[str, Any] | None:
    """One move's log: ``{"host", "move_id", "entries": [...], "summary": {...} | None}``, or None when no log
    names it. Raises the store's errors (an outage is not an empty log)."""
    if host is None:
        got = await store.get(bucket, index_key(move_id))
        if not isinstance(got, Got):
            return None
        host = str(_json(got.body).get("host", ""))
        if not host:
            return None
    prefix = log_prefix(host, move_id)
    keys = await store.list_keys(bucket, prefix)
    if not keys:
        return None
    entries: list[Any] = []
    claims: list[Any] = []
    summary: Any = None
    for key in keys:
        got = await store.get(bucket, key)
        if not isinstance(got, Got):
            continue
        if key.endswith("/summary.json"):
            summary = _json(got.body)
        elif key[len(prefix):].startswith("claim-"):
            claims.append(_json(got.body))
        else:
            entries.append(_json(got.body))
    entries.sort(key=lambda e: int(e.get("gen", 0)))
    claims.sort(key=lambda e: int(e.get("gen", 0)))
    return {"host": host, "move_id": move_id, "entries": entries, "claim_entries": claims, "summary": summary}


async def read_history(store: ObjectStore, bucket: str, host: str) -> list[dict[str, Any]]:
    """Every move of ``host`` the log holds, oldest first: each move's summary once closed, else its latest entry
    (a live move, or one whose close was not logged) marked ``"outcome": null``."""
    base = f"moves/{host_segment(host)}/"
    keys = await store.list_keys(bucket, base)
    moves: dict[str, list[str]] = {}
    for key in keys:
        parts = key[len(base):].split("/")
        if len(parts) == 3 and parts[1] == "log":
            moves.setdefault(parts[0], []).append(key)
    out: list[dict[str, Any]] = []
    for move_id, mkeys in moves.items():
        summary = next((k for k in mkeys if k.endswith("/summary.json")), None)
        records = [k for k in mkeys if k != summary and not k.rsplit("/", 1)[1].startswith("claim-")]
        first, latest = min(records, default=None), max(records, default=None)
        row: dict[str, Any] = {"move_id": move_id, "host": host, "outcome": None}
        if first is not None and isinstance(got := await store.get(bucket, first), Got):
            e = _json(got.body)
            row.update(requested_at=e.get("at"), **{"from": e.get("from"), "to": e.get("to")})
        if summary is not None and isinstance(got := await store.get(bucket, summary), Got):
            s = _json(got.body)
            row.update(outcome=s.get("outcome"), closed_at=s.get("closed_at"), timings=s.get("timings", []),
                       requested_at=s.get("requested_at") or row.get("requested_at"), reason=s.get("reason", ""),
                       **{"from": s.get("from"), "to": s.get("to")})
        elif latest is not None and isinstance(got := await store.get(bucket, latest), Got):
            e = _json(got.body)
            row.update(state=e.get("state"), timings=e.get("timings", []), reason=e.get("reason", ""))
        out.append(row)
    out.sort(key=lambda r: (r.get("requested_at") or 0, r["move_id"]))
    return out


__all__ = ["MOVE_OPS", "ClaimEntry", "Entry", "MoveLog", "Summary", "Timing", "claim_entry_for", "claim_entry_key",
           "entry_for", "entry_key", "index_key", "log_prefix", "read_history", "read_move", "summary_for",
           "summary_key", "timings"]
