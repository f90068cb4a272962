"""The box registry: the ``routes`` table, its holds, and the reconcile rule (spec §5.2, §6.2, §9.6).

One SQLite file per box directory (``<box_dir>/registry.db``, WAL), shared by every OS process on
the box. The rules are pure functions (:func:`reconcile_route`, :func:`held_status_for`,
:func:`leaves_hold`); :class:`Registry` is the thin shell that runs them as single statements.

- A **hold** status (``moving``, ``landing``, ``restoring``, ``releasing``, and region HA's
  ``relocating``, §9.4) is one the edge does not serve, ticks refuse and no ordinary wake reaches.
  Writing a hold always sets ``hold_op`` (§5.2); a trigger refuses any row whose status and
  ``hold_op`` disagree.
- **Leaving a hold** is only ``UPDATE routes SET status='ready', hold_op='' WHERE host=? AND
  hold_op=?`` (§5.2): a late write from a finished operation matches nothing (codex 6).
  :meth:`Registry.set_status` never touches a held row, so nothing else can open one.
- **Reconcile** mints held rows for the participants the claim names and never mints ``ready``
  while the claim holds a move operation (§5.2, §9.6, §19 K9). It never removes a row.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Final, Literal, TypeAlias

import msgspec
import sqlite_utils

from events.base import validate_ident
from events.claim import Claim
from kernel.ports import Clock

HoldStatus: TypeAlias = Literal["moving", "landing", "restoring", "releasing", "relocating"]
OrdinaryStatus: TypeAlias = Literal["ready", "stopped", "failed"]
Status: TypeAlias = HoldStatus | OrdinaryStatus

HOLD_STATUSES: Final[frozenset[str]] = frozenset({"moving", "landing", "restoring", "releasing", "relocating"})
"""§5.2 (source ``moving``, target ``landing``, recovering source ``restoring``, rolling-back target
``releasing``) plus region HA's ``relocating`` (§9.4, L17)."""

ORDINARY_STATUSES: Final[frozenset[str]] = frozenset({"ready", "stopped", "failed"})
"""``ready``: routable (the activator wakes the instance on demand); ``stopped``: not served, by an
operator's choice; ``failed``: a serving wake's fifth failure (§5.1 step 9) until cleared."""

STATUSES: Final[frozenset[str]] = HOLD_STATUSES | ORDINARY_STATUSES

MOVE_OP_KINDS: Final[frozenset[str]] = frozenset({"moving", "reverting", "landing", "restoring"})

REGISTRY_FILE = "registry.db"

LEAVE_HOLD_SQL: Final[str] = "UPDATE routes SET status='ready', hold_op='' WHERE host=? AND hold_op=?"
"""The one statement that leaves a hold (§5.2), verbatim."""


class RegistryError(Exception):
    """A registry write was refused as invalid (a defect in the caller, never a race)."""


class RouteRow(msgspec.Struct, frozen=True, kw_only=True):
    """One ``routes`` row: the §6.2 columns a Phase 1 flat exec host needs.

    ``app``/``account``/``region``/``db_path`` are *reproduced* from the record; ``replication``
    and ``next_due`` are *carried*; ``version`` and ``last_error`` are *reset* (§6.2).
    """

    host: str
    status: str = "ready"
    hold_op: str = ""
    incarnation: str = ""
    app: str = ""
    account: str = ""
    region: str = ""
    db_path: str = ""
    replication: str = ""
    next_due: int = 0
    version: str = ""
    last_error: str = ""
    created_at: int = 0
    updated_at: int = 0

    @property
    def held(self) -> bool:
        return self.status in HOLD_STATUSES


# --- the pure rules ----------------------------------------------------------------------------


class Keep(msgspec.Struct, frozen=True):
    """Reconcile writes nothing. ``reason`` says why, in plain words."""

    reason: str


class Mint(msgspec.Struct, frozen=True):
    """Reconcile creates the row (only if it is still absent when written)."""

    row: RouteRow


class OpenStaleHold(msgspec.Struct, frozen=True):
    """A hold left on the serving exec's row by an operation that is over (digest D§10, CC10).

    Run as the §5.2 conditional statement on the hold_op that was read, so a hold written since by a
    new operation is not opened."""

    host: str
    hold_op: str


RouteDecision: TypeAlias = Keep | Mint | OpenStaleHold


def is_held(status: str) -> bool:
    return status in HOLD_STATUSES


def holds_move_op(claim: Claim) -> bool:
    """True while the claim holds a move operation: ``moving``, ``reverting``, ``landing`` before the
    commit, or ``restoring`` (§5.2). A landing phase other than ``committed`` counts as before."""
    kind = claim.op.kind
    if kind == "landing":
        return claim.op.phase != "committed"
    return kind in MOVE_OP_KINDS


def leaves_hold(row: RouteRow | None, op_id: str) -> bool:
    """Whether :data:`LEAVE_HOLD_SQL` matches ``row`` for ``op_id`` (the pure mirror, for the sim)."""
    return row is not None and row.hold_op == op_id


def held_status_for(claim: Claim, box: str, *, rollback_id: str = "") -> tuple[HoldStatus, str] | None:
    """The (hold status, hold_op) a participant's row is minted with under a move op (§9.6, §7.6,
    §7.8; D§3.3-3.6), or None when this box mints no row in this state.

    - ``moving``: source ``moving``; the target has no row before the flip.
    - ``reverting``: source ``restoring`` with ``hold_op`` = the move id (D§3.3).
    - ``landing`` before the commit: target ``landing``, source ``moving``, both on the move id.
    - ``restoring``: source ``restoring``, target ``releasing``, both on the rollback id, which the
      record carries (``move.rollback.id``): without it nothing is minted.
    """
    op = claim.op
    if not holds_move_op(claim) or not op.id or box not in op.participants:
        return None
    source = op.participants[0]
    target = op.participants[1] if len(op.participants) > 1 else ""
    if op.kind == "moving":
        return ("moving", op.id) if box == source else None
    if op.kind == "reverting":
        return ("restoring", op.id) if box == source else None
    if op.kind == "landing":
        if box == target:
            return ("landing", op.id)
        return ("moving", op.id) if box == source else None
    if op.kind == "restoring":
        if not rollback_id:
            return None
        if box == target:
            return ("releasing", rollback_id)
        return ("restoring", rollback_id) if box == source else None
    return None


def reconcile_route(
    claim: Claim | None,
    box: str,
    current: RouteRow | None,
    *,
    rollback_id: str = "",
    installation_retired: bool = False,
    base: RouteRow | None = None,
) -> RouteDecision:
    """Decide what reconcile writes for one host on ``box`` (§5.2, §9.6, §19 K9). Pure.

    ``claim`` must be a fresh read (under the host guard); ``None`` means it is absent. ``base``
    carries the columns reproduced from the record (``routeFor``); host, incarnation, status and
    hold_op always come from the claim. ``installation_retired`` is this box's stamp record saying
    ``retire-installation`` ran for the holder's incarnation (§6.4): the move worker deleted its row
    at finalization, and minting it again would leave a hold nobody opens.

    Reconcile only mints absent rows; it never removes or demotes one (§9.6 "Removal"), never
    mints ``ready`` under a move op, and opens only a stale hold on the serving exec's own row.
    """
    if claim is None or claim.holder is None:
        return Keep("the claim names no holder, so there is nothing to mint")
    host = claim.host
    incarnation = claim.holder.incarnation
    op = claim.op
    if holds_move_op(claim) or (op.kind == "landing" and box in op.participants):
        if box not in op.participants:
            return Keep(f"this box is not a participant of {op.kind} operation {op.id}")
        if current is not None:
            return Keep("a participant's row is kept as it is; the move worker writes its holds")
        if installation_retired:
            return Keep("this box retired its installation; the move worker deleted the row at finalization")
        if op.kind == "landing" and not holds_move_op(claim):
            # Committed landing: the target may serve; the source is being finalized.
            if box == op.exec:
                return Mint(_minted(base, host, incarnation, "ready", ""))
            return Keep("after the commit the source's row is the source park's to delete")
        held = held_status_for(claim, box, rollback_id=rollback_id)
        if held is None:
            if op.kind == "restoring":
                return Keep("the rollback id is not known yet, so the held row cannot be minted")
            return Keep(f"this box has no row in {op.kind} phase {op.phase or '(none)'}")
        status, hold_op = held
        return Mint(_minted(base, host, incarnation, status, hold_op))
    if op.kind == "serving":
        if op.exec != box:
            return Keep("this box is not the serving box")
        if current is None:
            return Mint(_minted(base, host, incarnation, "ready", ""))
        if current.incarnation and current.incarnation != incarnation:
            return Keep("the row belongs to another incarnation; orphan retirement is not reconcile's mint")
        if current.held:
            return OpenStaleHold(host, current.hold_op)
        return Keep("the serving row is already open")
    return Keep(f"reconcile mints nothing while the claim's operation is {op.kind}")


def _minted(base: RouteRow | None, host: str, incarnation: str, status: str, hold_op: str) -> RouteRow:
    template = base if base is not None else RouteRow(host=host)
    return msgspec.structs.replace(template, host=host, incarnation=incarnation, status=status, hold_op=hold_op)


# --- the SQLite shell -------------------------------------------------------------------------


def open_db(path: Path) -> sqlite_utils.Database:
    """Open (creating) a box SQLite file in WAL mode, autocommit, with a busy timeout so several
    OS processes on the box can share it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    conn = sqlite3.connect(str(path), timeout=10.0, isolation_level=None)
    conn.execute("PRAGMA busy_timeout=10000")
    db = sqlite_utils.Database(conn)
    db.enable_wal()
    conn.execute("PRAGMA synchronous=FULL")
    return db


@contextmanager
def transaction(conn: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    """One write transaction (``BEGIN IMMEDIATE``): all of it commits or none of it does."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield conn
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")


_ROUTE_COLUMNS: dict[str, type] = {
    "host": str,
    "status": str,
    "hold_op": str,
    "incarnation": str,
    "app": str,
    "account": str,
    "region": str,
    "db_path": str,
    "replication": str,
    "next_due": int,
    "version": str,
    "last_error": str,
    "created_at": int,
    "updated_at": int,
}
_FIELDS = tuple(_ROUTE_COLUMNS)

_HOLD_LIST = ", ".join(f"'{s}'" for s in sorted(HOLD_STATUSES))
_STATUS_LIST = ", ".join(f"'{s}'" for s in sorted(STATUSES))
_CONSISTENT = f"(NEW.status NOT IN ({_STATUS_LIST})) OR ((NEW.status IN ({_HOLD_LIST})) <> (NEW.hold_op <> ''))"


def ensure_routes(db: sqlite_utils.Database) -> None:
    """Create ``routes`` and the triggers that refuse an unknown status or a hold without its op."""
    db.table("routes").create(
        _ROUTE_COLUMNS,
        pk="host",
        not_null=set(_FIELDS),
        defaults={k: (0 if t is int else "") for k, t in _ROUTE_COLUMNS.items() if k != "host"},
        if_not_exists=True,
    )
    for event in ("INSERT", "UPDATE"):
        db.execute(
            f"CREATE TRIGGER IF NOT EXISTS routes_hold_{event.lower()} BEFORE {event} ON routes "
            f"WHEN {_CONSISTENT} BEGIN SELECT RAISE(ABORT, "
            "'a route status must be known, and a hold must carry its operation (hold_op)'); END"
        )


class Registry:
    """The thin shell over ``routes`` (§5.2, §6.2). Every write is one statement or one transaction."""

    def __init__(self, db: sqlite_utils.Database, clock: Clock) -> None:
        self.db = db
        self.conn: sqlite3.Connection = db.conn
        self.clock = clock
        ensure_routes(db)

    @classmethod
    def open(cls, box_dir: Path, clock: Clock) -> Registry:
        return cls(open_db(Path(box_dir) / REGISTRY_FILE), clock)

    def close(self) -> None:
        self.conn.close()

    # reads

    def get(self, host: str) -> RouteRow | None:
        cur = self.conn.execute(f"SELECT {', '.join(_FIELDS)} FROM routes WHERE host=?", (host,))
        row = cur.fetchone()
        return None if row is None else RouteRow(**dict(zip(_FIELDS, row, strict=True)))

    def rows(self) -> list[RouteRow]:
        cur = self.conn.execute(f"SELECT {', '.join(_FIELDS)} FROM routes ORDER BY host")
        return [RouteRow(**dict(zip(_FIELDS, r, strict=True))) for r in cur.fetchall()]

    # writes

    def insert(self, row: RouteRow) -> bool:
        """Mint ``row`` if the host has none; True if it was written. A row that exists is kept."""
        _check_row(row)
        now = self.clock.now_ms()
        values = msgspec.structs.asdict(msgspec.structs.replace(row, created_at=now, updated_at=now))
        cur = self.conn.execute(
            f"INSERT OR IGNORE INTO routes ({', '.join(_FIELDS)}) VALUES ({', '.join('?' * len(_FIELDS))})",
            tuple(values[f] for f in _FIELDS),
        )
        return cur.rowcount == 1

    def set_status(self, host: str, status: OrdinaryStatus) -> bool:
        """Set an ordinary status on an open row. A held row is never touched: only
        :meth:`leave_hold` opens one (§5.2)."""
        if status not in ORDINARY_STATUSES:
            raise RegistryError(f"{status!r} is a hold or an unknown status; holds are written with hold()")
        cur = self.conn.execute(
            "UPDATE routes SET status=?, updated_at=? WHERE host=? AND hold_op=''",
            (status, self.clock.now_ms(), host),
        )
        return cur.rowcount == 1

    def hold(self, host: str, status: HoldStatus, op_id: str, *, replaces: str = "", incarnation: str = "") -> bool:
        """Write a hold for ``op_id`` (§5.2), conditionally: only over a row whose ``hold_op`` is
        ``replaces`` ("" = open) or already ``op_id`` (a replay). An absent row is created held when
        ``replaces`` is "" (the landing target's first write). True if the hold is now in place."""
        if status not in HOLD_STATUSES:
            raise RegistryError(f"{status!r} is not a hold status")
        validate_ident(op_id, "hold_op")
        now = self.clock.now_ms()
        with transaction(self.conn):
            cur = self.conn.execute("SELECT hold_op FROM routes WHERE host=?", (host,))
            found = cur.fetchone()
            if found is None:
                if replaces != "":
                    return False
                validate_ident(host, "host")
                self.conn.execute(
                    "INSERT INTO routes (host, status, hold_op, incarnation, created_at, updated_at) "
                    "VALUES (?, ?, ?, ?, ?, ?)",
                    (host, status, op_id, incarnation, now, now),
                )
                return True
            if found[0] not in (replaces, op_id):
                return False
            self.conn.execute(
                "UPDATE routes SET status=?, hold_op=?, updated_at=? WHERE host=?", (status, op_id, now, host)
            )
            return True

    def leave_hold(self, host: str, op_id: str) -> bool:
        """Leave the hold of ``op_id``: exactly :data:`LEAVE_HOLD_SQL` (§5.2). True if it matched; a
        finished operation's late call matches nothing and changes nothing."""
        if not op_id:
            raise RegistryError("leaving a hold needs the operation id that wrote it")
        cur = self.conn.execute(LEAVE_HOLD_SQL, (host, op_id))
        return cur.rowcount == 1

    def delete_held(self, host: str, op_id: str) -> bool:
        """The move worker's own finalization delete, conditional on ``hold_op`` (§7.9, D§3.5)."""
        if not op_id:
            raise RegistryError("deleting a held row needs the operation id that holds it")
        cur = self.conn.execute("DELETE FROM routes WHERE host=? AND hold_op=?", (host, op_id))
        return cur.rowcount == 1

    def delete_retired(self, host: str) -> bool:
        """Quarantine's delete (§7.10, claim §7.2): the row of a host this box was declared lost for, whatever its
        status, under the host guard once every artifact of the host is retired."""
        return self.conn.execute("DELETE FROM routes WHERE host=?", (host,)).rowcount == 1

    def set_carried(self, host: str, *, replication: str, next_due: int) -> bool:
        """Write the carried columns (§6.2 ``Replication``, ``NextDue``); the status is untouched."""
        cur = self.conn.execute(
            "UPDATE routes SET replication=?, next_due=?, updated_at=? WHERE host=?",
            (replication, next_due, self.clock.now_ms(), host),
        )
        return cur.rowcount == 1

    def apply(self, decision: RouteDecision) -> bool:
        """Run a reconcile decision; True if it wrote."""
        if isinstance(decision, Mint):
            return self.insert(decision.row)
        if isinstance(decision, OpenStaleHold):
            return self.leave_hold(decision.host, decision.hold_op)
        return False


def _check_row(row: RouteRow) -> None:
    validate_ident(row.host, "host")
    if row.status not in STATUSES:
        raise RegistryError(f"unknown route status {row.status!r}")
    if is_held(row.status) != (row.hold_op != ""):
        raise RegistryError("a held row must carry the operation that holds it, and an open row none")
