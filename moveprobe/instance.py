"""The instance's own state: ``<host>.db``, ``<host>/instance.key`` and the declared timers (spec §14.4).

``instance.key`` is the state that did not move in production (spec §1.2 finding 2a): the app kept a
key in its files directory, the database moved without it, and the app minted a new one. moveprobe
therefore writes its key once, records the key's sha256 in its database, and at every boot refuses to
start when the two disagree, rather than mint another. :func:`decide_key` is that rule, pure.

First boot is crash-safe: the key is written to a temporary name and fsynced, its digest committed,
and only then renamed into place; a boot that finds the digest committed and the key still at the
temporary name finishes the rename (:class:`FinishGenesis`).
"""

from __future__ import annotations

import hashlib
import os
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import msgspec

from kernel.ports import Clock, Random
from moveprobe.config import Config

KEY_BYTES = 32
PENDING_KEY = ".instance.key.tmp"

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (k TEXT PRIMARY KEY, v TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS rows (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    ts_ms INTEGER NOT NULL,
    session TEXT NOT NULL,
    kind TEXT NOT NULL CHECK (kind IN ('write', 'tick')),
    value TEXT
);
CREATE TABLE IF NOT EXISTS timer_runs (
    run INTEGER PRIMARY KEY AUTOINCREMENT,
    name TEXT NOT NULL,
    due_at_ms INTEGER,
    delivery TEXT,
    received_at_ms INTEGER NOT NULL,
    session TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS timer_runs_delivery ON timer_runs (delivery);
CREATE TABLE IF NOT EXISTS timer_repeats (
    repeat INTEGER PRIMARY KEY AUTOINCREMENT,
    run INTEGER NOT NULL,
    name TEXT NOT NULL,
    due_at_ms INTEGER,
    delivery TEXT NOT NULL,
    received_at_ms INTEGER NOT NULL,
    session TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS boots (
    boot INTEGER PRIMARY KEY AUTOINCREMENT,
    session TEXT NOT NULL,
    region TEXT NOT NULL,
    pid INTEGER NOT NULL,
    started_at_ms INTEGER NOT NULL
);
"""


class KeyRefused(Exception):
    """The key and the database disagree; the message says how, in plain words, and never holds the key."""


# --- the key rule (pure) -------------------------------------------------------------------------


@dataclass(frozen=True)
class Genesis:
    """No key and no record of one: this is the instance's first boot."""


@dataclass(frozen=True)
class FinishGenesis:
    """The digest is committed and the key still at its temporary name: finish the rename."""


@dataclass(frozen=True)
class Verified:
    """The key on disk is the one the database recorded."""


@dataclass(frozen=True)
class Refuse:
    reason: str


KeyDecision = Genesis | FinishGenesis | Verified | Refuse


def decide_key(
    *, recorded: str | None, on_disk: str | None, pending: str | None, has_rows: bool, files_dir: Path
) -> KeyDecision:
    """What a boot does with the key, from the recorded digest and the digests of the files found."""
    if recorded is None:
        if on_disk is not None:
            return Refuse(
                f"instance.key exists in {files_dir} but the database has no record of it: the database is not "
                "this instance's (it is missing, new, or was replaced); refusing to start with it"
            )
        if has_rows:
            return Refuse(
                "the database holds rows but no record of an instance key: it is damaged or not this app's; "
                "refusing to start rather than mint a new key"
            )
        return Genesis()
    if on_disk == recorded:
        return Verified()
    if on_disk is None:
        if pending == recorded:
            return FinishGenesis()
        return Refuse(
            f"instance.key is missing from {files_dir}, but the database records that one was written at first "
            "boot: the files directory did not arrive with the database (spec §1.2 finding 2a); refusing to start "
            "rather than mint a new key"
        )
    return Refuse(
        f"instance.key in {files_dir} does not match the key the database recorded at first boot: the files "
        "directory and the database belong to different instances, or the key was altered; refusing to start"
    )


# --- declared timers (pure) ----------------------------------------------------------------------


class Schedule(msgspec.Struct, frozen=True):
    """A declared schedule: the box delivers ``POST <path>`` every ``every_s`` seconds."""

    name: str
    every_s: float
    path: str


class OnceTimer(msgspec.Struct, frozen=True):
    """A once-timer the app registered at first boot: one ``POST <path>`` at or after ``due_at_ms``."""

    name: str
    due_at_ms: int
    path: str


class Declared(msgspec.Struct, frozen=True):
    """``timers.json`` in the files directory, and ``GET /timers/declared``."""

    host: str
    schedules: tuple[Schedule, ...]
    once: tuple[OnceTimer, ...]

    def names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.schedules) + tuple(o.name for o in self.once)


SCHEDULE_NAME = "periodic"
ONCE_NAME = "once"


def declared_timers(cfg: Config, genesis_ms: int) -> Declared:
    """The declared timers; the once-timer's due time is fixed by the first boot, so the file never churns."""
    return Declared(
        host=cfg.host,
        schedules=(Schedule(SCHEDULE_NAME, cfg.schedule_every_s, f"/timers/{SCHEDULE_NAME}"),),
        once=(OnceTimer(ONCE_NAME, genesis_ms + round(cfg.once_after_s * 1000), f"/timers/{ONCE_NAME}"),),
    )


# --- files ---------------------------------------------------------------------------------------


def sha256_file(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except FileNotFoundError:
        return None


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_durably(path: Path, data: bytes, mode: int = 0o644) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, mode)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_durably(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (temporary file, fsync, rename, fsync of the directory)."""
    tmp = path.with_name(f".{path.name}.tmp")
    _write_durably(tmp, data)
    os.replace(tmp, path)
    _fsync_dir(path.parent)


# --- the database --------------------------------------------------------------------------------


def _has_table(conn: sqlite3.Connection, name: str) -> bool:
    return conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (name,)).fetchone() is not None


def _meta(conn: sqlite3.Connection, key: str) -> str | None:
    if not _has_table(conn, "meta"):
        return None
    row = conn.execute("SELECT v FROM meta WHERE k = ?", (key,)).fetchone()
    return None if row is None else str(row[0])


def _connect(path: Path, *, create: bool) -> sqlite3.Connection:
    mode = "rwc" if create else "rw"
    conn = sqlite3.connect(f"file:{path}?mode={mode}", uri=True, isolation_level=None, check_same_thread=False)
    conn.execute("PRAGMA busy_timeout = 5000")
    conn.execute("PRAGMA synchronous = FULL")
    return conn


@dataclass
class Counts:
    rows: int
    max_seq: int
    timer_runs: int


@dataclass(frozen=True)
class TimerRun:
    """A delivery applied: its run, the session that ran it first, when this delivery came, whether it repeated."""

    run: int
    session: str
    ts_ms: int
    repeat: bool


class Instance:
    """One boot's view of the instance. ``conn`` is None when there is no instance yet and none may be made."""

    def __init__(
        self, cfg: Config, conn: sqlite3.Connection | None, *, session: str, genesis_ms: int | None, clock: Clock
    ) -> None:
        self.cfg = cfg
        self.conn = conn
        self.session = session
        self.genesis_ms = genesis_ms
        self._clock = clock

    @property
    def initialized(self) -> bool:
        return self.conn is not None and self.genesis_ms is not None

    def declared(self) -> Declared | None:
        return None if self.genesis_ms is None else declared_timers(self.cfg, self.genesis_ms)

    @contextmanager
    def _writing(self) -> Iterator[sqlite3.Connection]:
        """One write transaction (``BEGIN IMMEDIATE``), committed on success; only on a boot that may write."""
        if self.conn is None or not self.cfg.writes_allowed:
            raise RuntimeError("this boot may not write to the instance (MOVEPROBE_FAIL_READY_WHEN=before-write)")
        self.conn.execute("BEGIN IMMEDIATE")
        try:
            yield self.conn
            self.conn.execute("COMMIT")
        except BaseException:
            self.conn.execute("ROLLBACK")
            raise

    def insert_row(self, kind: str, value: str | None) -> tuple[int, int]:
        """Commit one sequenced row; (seq, ts_ms). Returns only after the commit is durable (synchronous=FULL)."""
        ts = self._clock.now_ms()
        with self._writing() as conn:
            cur = conn.execute("INSERT INTO rows (ts_ms, session, kind, value) VALUES (?, ?, ?, ?)",
                               (ts, self.session, kind, value))
        assert cur.lastrowid is not None
        return cur.lastrowid, ts

    def record_timer(self, name: str, due_at_ms: int | None, delivery: str | None) -> TimerRun:
        """Apply one timer delivery, once per delivery id: the runner delivers at least once (a runner that dies
        between the app's answer and its own bookkeeping delivers the same due time again, §9.4 runner), so a
        delivery whose id already ran is recorded in ``timer_repeats`` and answered with the run it already has."""
        ts = self._clock.now_ms()
        with self._writing() as conn:
            first = None if delivery is None else conn.execute(
                "SELECT run, session FROM timer_runs WHERE delivery = ? ORDER BY run LIMIT 1", (delivery,)).fetchone()
            if first is not None:
                conn.execute("INSERT INTO timer_repeats (run, name, due_at_ms, delivery, received_at_ms, session) "
                             "VALUES (?, ?, ?, ?, ?, ?)", (first[0], name, due_at_ms, delivery, ts, self.session))
                return TimerRun(int(first[0]), str(first[1]), ts, repeat=True)
            cur = conn.execute("INSERT INTO timer_runs (name, due_at_ms, delivery, received_at_ms, session) "
                               "VALUES (?, ?, ?, ?, ?)", (name, due_at_ms, delivery, ts, self.session))
        assert cur.lastrowid is not None
        return TimerRun(cur.lastrowid, self.session, ts, repeat=False)

    def runs_of(self, name: str, due_at_ms: int | None) -> int:
        assert self.conn is not None
        row = self.conn.execute(
            "SELECT count(*) FROM timer_runs WHERE name = ? AND due_at_ms IS ?", (name, due_at_ms)
        ).fetchone()
        return int(row[0])

    def timer_runs(self) -> list[dict[str, object]]:
        return self._table("timer_runs", "run, name, due_at_ms, delivery, received_at_ms, session", "run")

    def timer_repeats(self) -> list[dict[str, object]]:
        """The deliveries that repeated one already applied (each answered with its first run)."""
        return self._table("timer_repeats", "repeat, run, name, due_at_ms, delivery, received_at_ms, session",
                           "repeat")

    def _table(self, table: str, columns: str, order: str) -> list[dict[str, object]]:
        if self.conn is None or not _has_table(self.conn, table):
            return []
        cur = self.conn.execute(f"SELECT {columns} FROM {table} ORDER BY {order}")
        cols = [d[0] for d in cur.description]
        return [dict(zip(cols, r, strict=True)) for r in cur.fetchall()]

    def counts(self) -> Counts:
        if self.conn is None or not _has_table(self.conn, "rows"):
            return Counts(0, 0, 0)
        n, top = self.conn.execute("SELECT count(*), coalesce(max(seq), 0) FROM rows").fetchone()
        (runs,) = self.conn.execute("SELECT count(*) FROM timer_runs").fetchone()
        return Counts(int(n), int(top), int(runs))

    def close(self) -> None:
        """Checkpoint the WAL into the database file and close (a clean stop)."""
        if self.conn is None:
            return
        if self.cfg.writes_allowed:
            self.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        self.conn.close()
        self.conn = None


def boot(cfg: Config, *, clock: Clock, rng: Random, session: str, pid: int) -> Instance:
    """Open the instance, verifying (or, at first boot, writing) its key; raise :class:`KeyRefused`.

    A boot that may not write (failing readiness here, before writing) verifies what exists and
    changes nothing: no database, key, schema, boot row or ``timers.json`` is created.
    """
    files_dir = cfg.files_dir
    db_exists = cfg.db_path.exists()
    conn = _connect(cfg.db_path, create=False) if db_exists else None
    try:
        recorded = _meta(conn, "key_sha256") if conn else None
        has_rows = bool(conn and _has_table(conn, "rows") and conn.execute("SELECT 1 FROM rows LIMIT 1").fetchone())
        decision = decide_key(
            recorded=recorded,
            on_disk=sha256_file(cfg.key_path),
            pending=sha256_file(files_dir / PENDING_KEY),
            has_rows=has_rows,
            files_dir=files_dir,
        )
        if isinstance(decision, Refuse):
            raise KeyRefused(decision.reason)
        if not cfg.writes_allowed:
            if isinstance(decision, Verified):
                genesis = _meta(conn, "genesis_ms") if conn else None
                return Instance(cfg, conn, session=session, genesis_ms=int(genesis) if genesis else None, clock=clock)
            if conn is not None:
                conn.close()
            return Instance(cfg, None, session=session, genesis_ms=None, clock=clock)
        if isinstance(decision, Genesis):
            cfg.data_dir.mkdir(parents=True, exist_ok=True)
            files_dir.mkdir(parents=True, exist_ok=True)
            pending = files_dir / PENDING_KEY
            _write_durably(pending, rng.token_bytes(KEY_BYTES), 0o600)
            if conn is None:
                conn = _connect(cfg.db_path, create=True)
                _fsync_dir(cfg.data_dir)
            conn.execute("PRAGMA journal_mode = WAL")
            conn.executescript(SCHEMA)
            conn.execute("BEGIN IMMEDIATE")
            conn.executemany(
                "INSERT INTO meta (k, v) VALUES (?, ?)",
                [("key_sha256", sha256_file(pending)), ("genesis_ms", str(clock.now_ms())), ("host", cfg.host)],
            )
            conn.execute("COMMIT")
            decision = FinishGenesis()
        assert conn is not None
        if isinstance(decision, FinishGenesis):
            os.replace(files_dir / PENDING_KEY, cfg.key_path)
            _fsync_dir(files_dir)
        conn.execute("PRAGMA journal_mode = WAL")
        conn.executescript(SCHEMA)
        genesis_ms = int(_meta(conn, "genesis_ms") or "0")
        conn.execute("BEGIN IMMEDIATE")
        conn.execute(
            "INSERT INTO boots (session, region, pid, started_at_ms) VALUES (?, ?, ?, ?)",
            (session, cfg.region, pid, clock.now_ms()),
        )
        conn.execute("COMMIT")
        inst = Instance(cfg, conn, session=session, genesis_ms=genesis_ms, clock=clock)
        wanted = msgspec.json.encode(declared_timers(cfg, genesis_ms)) + b"\n"
        if not cfg.timers_path.exists() or cfg.timers_path.read_bytes() != wanted:
            replace_durably(cfg.timers_path, wanted)
        return inst
    except BaseException:
        if conn is not None:
            conn.close()
        raise
