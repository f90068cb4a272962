"""The projection database: a thin SQLite shell around :func:`projections.fold.step` (ARCHITECTURE §8).

Modelled on run-store concepts, "Execution revisions and cancellation acknowledgement":

- ``source`` holds a random 128-bit identity (from the Random port), a revision (a non-negative safe
  integer, +1 per applied change; overflow refuses instead of wrapping) and the stream position (the
  last applied ``HM_LEDGER`` sequence);
- ``hosts`` holds each host's latest revision, its deleted flag (tombstones are kept forever; a later
  live event revives the host with a newer revision) and the snapshot columns;
- ``errors`` holds what the audit and the operator must see: decode failures (``decode``), gen gaps
  (``gap``), stale events (``stale``), stream gaps (``stream_gap``) and explicit skips (``skipped``).

**Exactly once**: a batch of messages is applied in one ``BEGIN IMMEDIATE`` transaction that also
advances the stored position; a message at or below the position is skipped, so a crash anywhere
before ``COMMIT`` leaves view and position untouched and the replay applies it once. A message that
does not decode is never skipped silently: it is recorded in ``errors`` and :class:`ProjectionPoison`
is raised with the position left before it; only :meth:`ProjectionStore.skip` moves past it.

**Files and rebuild**: the root directory holds ``CURRENT`` (the name of the live database file) and
``proj-<identity>.db``. :meth:`ProjectionStore.rebuild` replays the stream into a new file with a new
identity and swaps ``CURRENT`` with ``os.replace``. Every database keeps its own file name, so no WAL
of an old database can ever be paired with a new one (renaming over a WAL-mode database that another
connection still has open is a documented way to corrupt SQLite). Readers notice the swap by the
pointer's content (the file name) and reopen; old cursors then get :class:`Resync`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import operator
import os
import re
import sqlite3
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Literal

from bus.log import EventLog, StoredMessage
from bus.subjects import LEDGER_STREAM, SubjectError, parse_ledger_subject
from events import DurableValueError, Transition, decode
from kernel.logctx import ctx
from kernel.ports import Clock, Random, SystemRandom, WallClock
from projections.fold import COLUMNS, HostRow, as_json, step

log = logging.getLogger("hostmove.projections")

MAX_SAFE_INTEGER = 2**53 - 1
SCHEMA_VERSION = 1
POINTER = "CURRENT"
MAX_REASON_CHARS = 500
_IDENTITY_RE = re.compile(r"^[0-9a-f]{32}$")
_DB_NAME_RE = re.compile(r"^proj-[0-9a-f]{32}\.db$")
_CURSOR_RE = re.compile(r"^([0-9a-f]{32}):(0|[1-9][0-9]{0,15})$")

ErrorKind = Literal["decode", "gap", "stale", "stream_gap", "skipped"]

_SCHEMA = f"""
CREATE TABLE source (
  one INTEGER PRIMARY KEY CHECK (one = 1),
  identity TEXT NOT NULL CHECK (length(identity) = 32),
  revision INTEGER NOT NULL CHECK (revision BETWEEN 0 AND {MAX_SAFE_INTEGER}),
  position INTEGER NOT NULL CHECK (position >= 0),
  origin INTEGER NOT NULL CHECK (origin >= 0),
  stream TEXT NOT NULL,
  schema_version INTEGER NOT NULL,
  created_at INTEGER NOT NULL
) STRICT;
CREATE TABLE hosts (
  host TEXT PRIMARY KEY,
  revision INTEGER NOT NULL UNIQUE CHECK (revision BETWEEN 1 AND {MAX_SAFE_INTEGER}),
  deleted INTEGER NOT NULL CHECK (deleted IN (0, 1)),
  claim_gen INTEGER NOT NULL,
  record_gen INTEGER NOT NULL,
  op_kind TEXT NOT NULL,
  op_phase TEXT NOT NULL,
  op_id TEXT NOT NULL,
  exec TEXT NOT NULL,
  region TEXT NOT NULL,
  incarnation TEXT NOT NULL,
  move_id TEXT NOT NULL,
  move_state TEXT NOT NULL,
  cut_phase TEXT NOT NULL,
  landing_phase TEXT NOT NULL,
  move_to TEXT NOT NULL,
  move_from TEXT NOT NULL,
  requested_at INTEGER,
  cut_at INTEGER,
  flipped_at INTEGER,
  committed_at INTEGER,
  opened_at INTEGER,
  updated_at INTEGER NOT NULL,
  seq INTEGER NOT NULL,
  claim_json TEXT,
  record_json TEXT
) STRICT;
CREATE TABLE errors (
  seq INTEGER NOT NULL,
  kind TEXT NOT NULL,
  host TEXT,
  reason TEXT NOT NULL,
  at INTEGER NOT NULL,
  PRIMARY KEY (seq, kind)
) STRICT;
"""

_ROW_COLS = ", ".join(COLUMNS)
_VIEW_COLS = _ROW_COLS + ", revision"
_UPSERT = f"INSERT OR REPLACE INTO hosts ({_VIEW_COLS}) VALUES ({', '.join('?' * (len(COLUMNS) + 1))})"
_DELETED_IX = COLUMNS.index("deleted")
_IN_CHUNK = 500
ROW_CACHE_MAX = 100_000
"""Rows kept in memory between batches (the writer's own commits); past it the next batch reads them again."""
_SELECT_VIEW = f"SELECT {_VIEW_COLS} FROM hosts WHERE host = ?"
_SELECT_CHANGES = f"SELECT {_VIEW_COLS} FROM hosts WHERE revision > ? ORDER BY revision LIMIT ?"


class ProjectionError(Exception):
    """A defect the operator must see (alert-able); the caller decides whether to halt."""


class ProjectionPoison(ProjectionError):
    """The message at ``seq`` does not decode into a ledger transition. Recorded in ``errors``;
    the stored position stays before it until :meth:`ProjectionStore.skip` is called."""

    def __init__(self, seq: int, subject: str, reason: str, applied: int = 0) -> None:
        self.seq = seq
        self.subject = subject
        self.reason = reason
        self.applied = applied
        """How many messages before it in the same batch were applied (and committed)."""
        super().__init__(f"ledger message {seq} cannot be projected: {reason}")


class IdentityChanged(Exception):
    """The database was swapped by a rebuild while a replay was in flight: restart from its position."""

    def __init__(self, expected: str, actual: str) -> None:
        self.expected = expected
        self.actual = actual
        super().__init__(f"the projection identity changed from {expected} to {actual}")


class RevisionOverflow(ProjectionError):
    """The revision would pass 2**53 - 1: the change is refused (never wrapped)."""


@dataclass(frozen=True, slots=True)
class HostView(HostRow):
    """A host as read from the projection, at its latest ``revision``."""

    revision: int

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready: the claim and the record as objects."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        for key in ("claim", "record"):
            text = out.pop(f"{key}_json")
            out[key] = json.loads(text) if text is not None else None
        return out

    def state(self) -> HostRow:
        return HostRow(*(getattr(self, c) for c in COLUMNS))


def _view(row: Sequence[Any]) -> HostView:
    values = list(row)
    values[_DELETED_IX] = bool(values[_DELETED_IX])
    return HostView(*values)


def _row(row: Sequence[Any]) -> HostRow:
    values = list(row)
    values[_DELETED_IX] = bool(values[_DELETED_IX])
    return HostRow(*values)


_JSON_IX = (COLUMNS.index("claim_json"), COLUMNS.index("record_json"))
_ROW_VALUES = operator.attrgetter(*COLUMNS)


def _stored(row: HostRow) -> list[Any]:
    """The row's column values as written: claim and record structs as canonical JSON text."""
    values = list(_ROW_VALUES(row))
    for i in _JSON_IX:
        values[i] = as_json(values[i])
    return values


def make_cursor(identity: str, revision: int) -> str:
    """An opaque cursor: ``<identity>:<revision>``."""
    return f"{identity}:{revision}"


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Hosts and the revision they are at, read in one transaction: the feed from ``cursor`` has no gap."""

    identity: str
    revision: int
    position: int
    hosts: list[HostView]

    @property
    def cursor(self) -> str:
        return make_cursor(self.identity, self.revision)


@dataclass(frozen=True, slots=True)
class ChangesPage:
    """Hosts changed after the cursor, by revision, each at its latest revision only."""

    identity: str
    revision: int
    changes: list[HostView]
    cursor: str
    more: bool


@dataclass(frozen=True, slots=True)
class Resync:
    """The cursor is not from this projection (rebuilt, another database, malformed or ahead):
    take a new snapshot. Never answered with data."""

    reason: str
    identity: str
    resync: bool = True


@dataclass(frozen=True, slots=True)
class ErrorEntry:
    seq: int
    kind: str
    host: str | None
    reason: str
    at: int


@dataclass(frozen=True, slots=True)
class Applied:
    """What one batch did: messages applied, skipped (already at or below the position) and
    stale (not applied, noted), and the position and revision after it."""

    applied: int
    skipped: int
    stale: int
    position: int
    revision: int


@functools.lru_cache(maxsize=8192)
def _parse_subject(subject: str) -> tuple[str, str]:
    return parse_ledger_subject(subject)


def decode_event(msg: StoredMessage) -> Transition:
    """The transition a ledger message carries; raises ``ValueError`` with a plain reason otherwise."""
    try:
        obj, host = _parse_subject(msg.subject)
    except SubjectError:
        raise ValueError("not a ledger subject (hm.ledger.claim|record.<token>)") from None
    try:
        t = decode(msg.data, Transition)
    except DurableValueError as exc:
        raise ValueError(f"decode_failed: {exc.limit} at {exc.path}: {exc.reason}") from None
    if t.object != obj or t.host != host:
        raise ValueError("the event's object or host differs from its subject")
    return t


def _reason(text: str) -> str:
    return text if len(text) <= MAX_REASON_CHARS else text[: MAX_REASON_CHARS - 1] + "…"


class _Db:
    """One projection database file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        # mode=rw: never create a file here (a rebuild may have just removed this one)
        uri = path.resolve().as_uri() + "?mode=rw"
        self.conn = sqlite3.connect(uri, uri=True, isolation_level=None, check_same_thread=False)
        self.conn.execute("PRAGMA journal_mode=WAL")
        self.conn.execute("PRAGMA synchronous=NORMAL")  # a lost tail is re-applied from the stream
        self.conn.execute("PRAGMA busy_timeout=5000")
        row = self.conn.execute("SELECT identity, origin, stream FROM source").fetchone()
        if row is None:
            raise ProjectionError(f"{path.name} has no source row")
        self.identity: str = row[0]
        self.origin: int = row[1]
        self.stream: str = row[2]
        self._cache: tuple[tuple[int, int], dict[str, HostRow | None]] | None = None
        """The rows as of the last commit here, and the (revision, position) they are valid at."""

    @classmethod
    def create(cls, path: Path, identity: str, *, origin: int, stream: str, now_ms: int) -> _Db:
        if not _IDENTITY_RE.match(identity):
            raise ValueError("identity must be 32 lowercase hex characters")
        conn = sqlite3.connect(path, isolation_level=None)
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("BEGIN IMMEDIATE")
            for statement in _SCHEMA.split(";"):
                if statement.strip():
                    conn.execute(statement)
            conn.execute(
                "INSERT INTO source VALUES (1, ?, 0, ?, ?, ?, ?, ?)",
                (identity, origin, origin, stream, SCHEMA_VERSION, now_ms),
            )
            conn.execute("COMMIT")
        finally:
            conn.close()
        return cls(path)

    def close(self) -> None:
        with contextlib.suppress(sqlite3.Error):
            self.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        self.conn.close()

    # -- reads -----------------------------------------------------------------------------------

    def read(self, fn: Callable[[sqlite3.Connection], Any]) -> Any:
        """Run ``fn`` inside one read transaction (one consistent WAL snapshot)."""
        self.conn.execute("BEGIN")
        try:
            return fn(self.conn)
        finally:
            self.conn.execute("COMMIT")

    def source(self, conn: sqlite3.Connection) -> tuple[int, int]:
        revision, position = conn.execute("SELECT revision, position FROM source").fetchone()
        return revision, position

    def position(self) -> int:
        return self.read(lambda c: self.source(c)[1])  # type: ignore[no-any-return]

    # -- writes ----------------------------------------------------------------------------------

    def apply(
        self,
        decoded: Sequence[tuple[StoredMessage, Transition]],
        now_ms: int,
        before_commit: Callable[[int], None] | None,
    ) -> Applied:
        conn = self.conn
        conn.execute("BEGIN IMMEDIATE")
        try:
            revision, position = self.source(conn)
            start = (revision, position)
            rows = self._rows_at(start)
            dirty: dict[str, tuple[HostRow, int]] = {}
            notes: list[tuple[int, str, str | None, str, int]] = []
            applied = skipped = stale = 0
            self._load_missing(rows, {t.host for _, t in decoded if t.host not in rows})
            for msg, t in decoded:
                seq = msg.seq
                if seq <= position:
                    skipped += 1
                    continue
                if seq != position + 1:
                    gap = f"stream seq {position} -> {seq}: messages missing from the stream"
                    notes.append((seq, "stream_gap", None, gap, now_ms))
                out = step(rows[t.host], t, seq)
                for note in out.notes:
                    notes.append((seq, note.kind, t.host, _reason(note.reason), now_ms))
                if out.row is None:
                    stale += 1
                else:
                    if revision >= MAX_SAFE_INTEGER:
                        raise RevisionOverflow("the projection revision would pass 2**53 - 1")
                    revision += 1
                    rows[t.host] = out.row
                    dirty[t.host] = (out.row, revision)
                    applied += 1
                position = seq
            if dirty:
                params = [(*_stored(row), rev) for row, rev in dirty.values()]
                conn.executemany(_UPSERT, params)
                for values in params:  # the cache holds what was written (claim and record as text)
                    rows[values[0]] = _row(values[:-1])
            if notes:
                conn.executemany("INSERT OR IGNORE INTO errors VALUES (?, ?, ?, ?, ?)", notes)
            if (revision, position) != start:
                conn.execute("UPDATE source SET revision = ?, position = ?", (revision, position))
            if before_commit is not None:
                before_commit(position)
            conn.execute("COMMIT")
        except BaseException:
            self._cache = None
            conn.execute("ROLLBACK")
            raise
        self._cache = ((revision, position), rows) if len(rows) <= ROW_CACHE_MAX else None
        return Applied(applied, skipped, stale, position, revision)

    def _rows_at(self, source: tuple[int, int]) -> dict[str, HostRow | None]:
        """The rows cached by the last commit, when nothing changed the database since (same revision and
        position: every change to ``hosts`` bumps the revision); otherwise an empty cache."""
        if self._cache is not None and self._cache[0] == source:
            return self._cache[1]
        return {}

    def _load_missing(self, rows: dict[str, HostRow | None], hosts: set[str]) -> None:
        """Read the rows of ``hosts`` (``None`` for a host not in the view yet) into ``rows``, a few
        statements per batch instead of one per host."""
        missing = list(hosts)
        for i in range(0, len(missing), _IN_CHUNK):
            chunk = missing[i : i + _IN_CHUNK]
            for host in chunk:
                rows[host] = None
            sql = f"SELECT {_ROW_COLS} FROM hosts WHERE host IN ({', '.join('?' * len(chunk))})"
            for found in self.conn.execute(sql, chunk):
                rows[found[0]] = _row(found)

    def note(self, entry: tuple[int, str, str | None, str, int]) -> None:
        self.conn.execute("INSERT OR IGNORE INTO errors VALUES (?, ?, ?, ?, ?)", entry)

    def skip(self, seq: int, reason: str, now_ms: int, *, strict: bool = True) -> None:
        conn = self.conn
        conn.execute("BEGIN IMMEDIATE")
        try:
            _, position = self.source(conn)
            if seq <= position or (strict and seq != position + 1):
                raise ProjectionError(f"only the next message can be skipped (at {position}, asked {seq})")
            conn.execute("INSERT OR IGNORE INTO errors VALUES (?, 'skipped', NULL, ?, ?)",
                         (seq, _reason(reason), now_ms))
            conn.execute("UPDATE source SET position = ?", (seq,))
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise


class _Notifier:
    """In-process wake-ups for long-polls and streams (other processes poll)."""

    def __init__(self) -> None:
        self._waiters: set[asyncio.Future[None]] = set()

    def bump(self) -> None:
        for fut in self._waiters:
            if not fut.done():
                fut.set_result(None)
        self._waiters.clear()

    async def wait(self, clock: Clock, seconds: float) -> None:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.add(fut)
        sleeper = asyncio.ensure_future(clock.sleep(seconds))
        try:
            await asyncio.wait({fut, sleeper}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            sleeper.cancel()
            self._waiters.discard(fut)
            if not fut.done():
                fut.cancel()


class ProjectionStore:
    """The projection rooted at a directory. One writer (the :class:`~projections.runner.Projector`)
    per root; any number of readers, in this process or others."""

    def __init__(
        self,
        root: Path,
        *,
        rng: Random,
        clock: Clock,
        before_commit: Callable[[int], None] | None = None,
    ) -> None:
        self.root = root
        self.rng = rng
        self.clock = clock
        self.before_commit = before_commit
        """Test hook: called inside the apply transaction after the view update, before ``COMMIT``."""
        self._db_: _Db | None = None
        self._pointer: str | None = None
        self._notifier = _Notifier()

    # -- opening and the pointer -----------------------------------------------------------------

    @classmethod
    def open(
        cls,
        root: str | Path,
        *,
        rng: Random | None = None,
        clock: Clock | None = None,
        stream: str = LEDGER_STREAM,
        start_after: int = 0,
        before_commit: Callable[[int], None] | None = None,
    ) -> ProjectionStore:
        """Open the projection at ``root``, creating it (with a fresh identity) when absent.

        ``start_after`` only matters on creation: the projection then begins after that stream
        position (its *origin*; a rebuild replays from there too).
        """
        root = Path(root)
        root.mkdir(parents=True, exist_ok=True)
        store = cls(root, rng=rng or SystemRandom(), clock=clock or WallClock(), before_commit=before_commit)
        if not (root / POINTER).exists():
            identity = store._new_identity()
            name = store._create_db(identity, origin=start_after, stream=stream)
            store._swap_pointer(name)
        store._db()
        return store

    def _new_identity(self) -> str:
        return self.rng.token_bytes(16).hex()

    def _create_db(self, identity: str, *, origin: int, stream: str) -> str:
        name = f"proj-{identity}.db"
        db = _Db.create(self.root / name, identity, origin=origin, stream=stream, now_ms=self.clock.now_ms())
        db.close()
        return name

    def _swap_pointer(self, name: str) -> None:
        tmp = self.root / f"{POINTER}.tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(name + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, self.root / POINTER)
        dir_fd = os.open(self.root, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)

    def _db(self) -> _Db:
        """The live database, reopened when ``CURRENT`` was swapped (by a rebuild here or elsewhere)."""
        name = (self.root / POINTER).read_text(encoding="utf-8").strip()
        if self._db_ is None or name != self._pointer:
            if not _DB_NAME_RE.match(name):
                raise ProjectionError(f"{POINTER} does not name a projection database")
            try:
                db = _Db(self.root / name)
            except sqlite3.OperationalError:
                again = (self.root / POINTER).read_text(encoding="utf-8").strip()
                if again == name:
                    raise
                return self._db()  # swapped between reading the pointer and opening the file
            old, self._db_, self._pointer = self._db_, db, name
            if old is not None:
                old.close()
                self._notifier.bump()  # waiters re-read: their cursors now get resync
        return self._db_

    def close(self) -> None:
        if self._db_ is not None:
            self._db_.close()
            self._db_ = None

    # -- writes ----------------------------------------------------------------------------------

    @property
    def stream(self) -> str:
        return self._db().stream

    def apply(self, msg: StoredMessage) -> Applied:
        return self.apply_batch([msg])

    def apply_batch(self, msgs: Sequence[StoredMessage], *, identity: str | None = None) -> Applied:
        """Apply messages in stream order in ONE transaction with the position (exactly once).

        Messages before a poison one are committed; then the poison is recorded and raised. With
        ``identity``, raise :class:`IdentityChanged` instead of applying when a rebuild swapped the
        database since the caller read its position (its replay must restart from the new position).
        """
        decoded: list[tuple[StoredMessage, Transition]] = []
        poison: tuple[StoredMessage, str] | None = None
        for msg in msgs:
            try:
                decoded.append((msg, decode_event(msg)))
            except ValueError as exc:
                poison = (msg, str(exc))
                break
        db = self._db()
        if identity is not None and db.identity != identity:
            raise IdentityChanged(identity, db.identity)
        now = self.clock.now_ms()
        result = db.apply(decoded, now, self.before_commit)
        if result.applied:
            self._notifier.bump()
        if poison is not None:
            msg, reason = poison
            if msg.seq > result.position:
                db.note((msg.seq, "decode", None, _reason(reason), now))
                raise ProjectionPoison(msg.seq, msg.subject, _reason(reason), result.applied)
        return result

    def skip(self, seq: int, reason: str) -> None:
        """Explicitly move past the next message (an operator's decision after a poison alert)."""
        self._db().skip(seq, reason, self.clock.now_ms())

    def note_error(self, seq: int, kind: ErrorKind, reason: str, host: str | None = None) -> None:
        self._db().note((seq, kind, host, _reason(reason), self.clock.now_ms()))

    # -- reads -----------------------------------------------------------------------------------

    @property
    def identity(self) -> str:
        return self._db().identity

    @property
    def origin(self) -> int:
        return self._db().origin

    def position(self) -> int:
        return self._db().position()

    def revision(self) -> int:
        db = self._db()
        return db.read(lambda c: db.source(c)[0])  # type: ignore[no-any-return]

    def cursor(self) -> str:
        return make_cursor(self.identity, self.revision())

    def snapshot(self, *, include_deleted: bool = False) -> Snapshot:
        """All (live, or also deleted) hosts and the revision they are at, in ONE read transaction."""
        db = self._db()
        where = "" if include_deleted else "WHERE deleted = 0"

        def read(conn: sqlite3.Connection) -> Snapshot:
            revision, position = db.source(conn)
            rows = conn.execute(f"SELECT {_VIEW_COLS} FROM hosts {where} ORDER BY host").fetchall()
            return Snapshot(db.identity, revision, position, [_view(r) for r in rows])

        return db.read(read)  # type: ignore[no-any-return]

    def host(self, name: str) -> HostView | None:
        """One host (deleted ones too: check ``deleted``)."""
        db = self._db()
        row = db.read(lambda c: c.execute(_SELECT_VIEW, (name,)).fetchone())
        return None if row is None else _view(row)

    def changes(self, cursor: str | None, limit: int = 100) -> ChangesPage | Resync:
        """Hosts whose revision is after ``cursor`` (keyset), ordered by revision, at most ``limit``.

        ``None`` or ``""`` starts at revision 0 of this identity. A cursor of another identity, a
        malformed one, or one ahead of this projection gets :class:`Resync`.
        """
        if not 1 <= limit <= 10_000:
            raise ValueError("limit must be between 1 and 10000")
        db = self._db()
        if cursor:
            m = _CURSOR_RE.match(cursor)
            if m is None:
                return Resync("malformed cursor: take a new snapshot", db.identity)
            identity, after = m.group(1), int(m.group(2))
            if identity != db.identity:
                return Resync("the cursor is from another projection identity (rebuilt or another database): "
                              "take a new snapshot", db.identity)
        else:
            after = 0

        def read(conn: sqlite3.Connection) -> ChangesPage | Resync:
            revision, _ = db.source(conn)
            if after > revision:
                return Resync("the cursor is ahead of this projection (restored or rolled back): "
                              "take a new snapshot", db.identity)
            rows = conn.execute(
                _SELECT_CHANGES, (after, limit + 1)
            ).fetchall()
            more = len(rows) > limit
            views = [_view(r) for r in rows[:limit]]
            nxt = views[-1].revision if more else revision
            return ChangesPage(db.identity, revision, views, make_cursor(db.identity, nxt), more)

        return db.read(read)  # type: ignore[no-any-return]

    def errors(self, *, kind: str | None = None, limit: int = 100) -> list[ErrorEntry]:
        db = self._db()
        sql = "SELECT seq, kind, host, reason, at FROM errors"
        args: tuple[Any, ...] = ()
        if kind is not None:
            sql += " WHERE kind = ?"
            args = (kind,)
        sql += " ORDER BY seq DESC LIMIT ?"
        rows = db.read(lambda c: c.execute(sql, (*args, limit)).fetchall())
        return [ErrorEntry(*r) for r in rows]

    def error_counts(self) -> dict[str, int]:
        db = self._db()
        rows = db.read(lambda c: c.execute("SELECT kind, count(*) FROM errors GROUP BY kind").fetchall())
        return {k: n for k, n in rows}

    async def wait(self, seconds: float) -> None:
        """Return after an in-process commit or rebuild, or after ``seconds`` (the Clock port)."""
        await self._notifier.wait(self.clock, seconds)

    # -- rebuild ---------------------------------------------------------------------------------

    async def rebuild(self, event_log: EventLog, *, batch: int = 500) -> str:
        """Replay the stream from the origin into a new database with a new identity, then swap it in.

        Explicit skips recorded in the current database are honoured again. On any failure the new
        file is removed and the current projection stays. Returns the new identity.
        """
        old = self._db()
        origin, stream = old.origin, old.stream
        skipped = {e.seq: e.reason for e in self.errors(kind="skipped", limit=1_000_000)}
        identity = self._new_identity()
        name = self._create_db(identity, origin=origin, stream=stream)
        path = self.root / name
        new = _Db(path)
        try:
            pending: list[StoredMessage] = []

            def flush() -> None:
                decoded: list[tuple[StoredMessage, Transition]] = []
                now = self.clock.now_ms()
                for msg in pending:
                    if msg.seq in skipped:
                        new.apply(decoded, now, None)
                        decoded = []
                        new.skip(msg.seq, skipped[msg.seq], now, strict=False)
                        continue
                    try:
                        decoded.append((msg, decode_event(msg)))
                    except ValueError as exc:
                        new.apply(decoded, now, None)
                        raise ProjectionPoison(msg.seq, msg.subject, _reason(str(exc))) from None
                new.apply(decoded, now, None)
                pending.clear()

            while True:
                start = new.position() + 1
                async for msg in event_log.replay(stream, start_seq=start):
                    pending.append(msg)
                    if len(pending) >= batch:
                        flush()
                flush()
                # The live projection may have moved on meanwhile: never swap in a database behind it
                # (its projector would then skip what lies between). No await from the check to the swap.
                live = self._db()
                if new.position() >= live.position():
                    break
            new.close()
        except BaseException:
            new.close()
            for suffix in ("", "-wal", "-shm"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(f"{path}{suffix}")
            raise
        replaced = live.path
        self._swap_pointer(name)
        self._db()  # reopen here; closes the old connection and wakes waiters
        for suffix in ("", "-wal", "-shm"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(f"{replaced}{suffix}")
        log.info("projection rebuilt as %s (was %s)", identity, old.identity,
                 extra=ctx(phase="projection", identity=identity, previous=old.identity))
        return identity
