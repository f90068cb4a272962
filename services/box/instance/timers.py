"""The box's ``timers`` table, ``ReplaceTimers``, the canonical timers digest and the runner (spec §9.4).

The table lives in the registry file beside ``routes`` (§6.2: carried as a snapshot), so the runner
can see holds in the same transaction as the timers it is about to deliver.

- **Replaced exactly** (§9.4): :meth:`Timers.replace_timers` deletes the host's rows and inserts
  the given ones in one transaction, preserving the bookkeeping (``next_at``, ``due_at``,
  ``attempts``, ``registration``): a row given with bookkeeping (a snapshot) keeps it as given, a
  row given without keeps the bookkeeping of the same-named timer it replaces, a new one starts
  fresh. Nothing like ``UpsertTimer``'s reset on rearm happens here.
- **Canonical digest** (§9.4, joint N14): sha256 over the active rows and their bookkeeping,
  excluding disposable history (completed once-timers), so the runner's prune never changes it.
- **Frozen** (§9.4): the runner skips a held row with no request and no bookkeeping; a refused or
  failed delivery changes nothing.
- **Drained** (§9.4): a delivery registers itself in ``timer_inflight`` in the same transaction
  that checks the route is open, so once a hold is written, :meth:`TimerRunner.drain` waiting for
  the host's in-flight rows to go is enough: nothing can start after the hold.

Schedules are fixed intervals (``every_ms``) or one instant (``at_ms``). Bookkeeping: ``next_at`` is
the next occurrence to deliver; ``due_at`` the occurrence last delivered (0 = none); ``attempts``
the deliveries made; ``registration`` when the timer was first registered on any box;
``last_run_at`` the local delivery time (not carried, not digested); ``completed`` marks a
delivered once-timer (history).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import sqlite3
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Final
from urllib.parse import quote

import aiohttp
import msgspec
import sqlite_utils

from events.base import validate_ident
from kernel.logctx import ctx
from kernel.ports import Clock, http_post_json
from services.box.instance.registry import HOLD_STATUSES, REGISTRY_FILE, ensure_routes, open_db, transaction

log = logging.getLogger("hostmove.box.timers")

MAX_NAME_CHARS: Final = 200
MAX_PAYLOAD_CHARS: Final = 64 * 1024


class TimerError(Exception):
    """A timer write was refused; the table is as it was before the call."""


class TimersBusy(Exception):
    """A delivery for the host is still in flight after the drain's deadline."""


class TimerSpec(msgspec.Struct, frozen=True, kw_only=True):
    """A timer as the app or the converger declares it: a name and either an interval or an instant."""

    name: str
    every_ms: int | None = None
    at_ms: int | None = None
    payload: str = ""

    def __post_init__(self) -> None:
        if not self.name or len(self.name) > MAX_NAME_CHARS or not self.name.isprintable():
            raise TimerError(f"a timer name must be 1 to {MAX_NAME_CHARS} printable characters, not {self.name!r}")
        if (self.every_ms is None) == (self.at_ms is None):
            raise TimerError(f"timer {self.name!r} needs exactly one of an interval (every_ms) or an instant (at_ms)")
        if self.every_ms is not None and self.every_ms <= 0:
            raise TimerError(f"timer {self.name!r} has an interval of {self.every_ms} ms; it must be positive")
        if self.at_ms is not None and self.at_ms < 0:
            raise TimerError(f"timer {self.name!r} has a negative instant")
        if len(self.payload) > MAX_PAYLOAD_CHARS:
            raise TimerError(f"timer {self.name!r} carries more than {MAX_PAYLOAD_CHARS} characters of payload")

    @property
    def once(self) -> bool:
        return self.at_ms is not None


class TimerRow(TimerSpec, frozen=True, kw_only=True):
    """A timer with its bookkeeping: what the table holds and what a snapshot carries (§9.4)."""

    next_at: int
    due_at: int = 0
    attempts: int = 0
    registration: int = 0
    last_run_at: int = 0
    completed: bool = False

    @property
    def spec(self) -> TimerSpec:
        return TimerSpec(name=self.name, every_ms=self.every_ms, at_ms=self.at_ms, payload=self.payload)


_COLUMNS: dict[str, type] = {
    "host": str,
    "name": str,
    "every_ms": int,
    "at_ms": int,
    "payload": str,
    "next_at": int,
    "due_at": int,
    "attempts": int,
    "registration": int,
    "last_run_at": int,
    "completed": int,
}
_ROW_FIELDS = tuple(c for c in _COLUMNS if c != "host")
_DIGESTED = ("name", "every_ms", "at_ms", "payload", "next_at", "due_at", "attempts", "registration")
_ENCODER = msgspec.json.Encoder(order="sorted")


def timers_digest(rows: Iterable[TimerRow]) -> str:
    """The canonical timers digest (§9.4): 64 lowercase hex of sha256 over the canonical JSON of the
    active rows, sorted by name, each with its schedule, payload and bookkeeping (``next_at``,
    ``due_at``, ``attempts``, ``registration``). Completed once-timers are history and excluded, so
    pruning them never changes it (joint N14); ``last_run_at`` is a local observation and excluded.
    """
    active = sorted((r for r in rows if not r.completed), key=lambda r: r.name)
    entries = [{f: getattr(r, f) for f in _DIGESTED} for r in active]
    return hashlib.sha256(_ENCODER.encode(entries)).hexdigest()


def fresh_bookkeeping(spec: TimerSpec, now_ms: int) -> TimerRow:
    """A newly registered timer: an instant is due at that instant; an interval one interval from now."""
    next_at = spec.at_ms if spec.at_ms is not None else now_ms + (spec.every_ms or 0)
    return TimerRow(
        name=spec.name,
        every_ms=spec.every_ms,
        at_ms=spec.at_ms,
        payload=spec.payload,
        next_at=next_at,
        registration=now_ms,
    )


def after_delivery(row: TimerRow, now_ms: int) -> TimerRow:
    """Bookkeeping after a successful delivery: a once-timer completes; an interval advances on its
    own grid past ``now_ms`` (missed occurrences are delivered once, not replayed)."""
    if row.every_ms is None:
        next_at = row.next_at
    else:
        missed = max(0, (now_ms - row.next_at) // row.every_ms)
        next_at = row.next_at + (missed + 1) * row.every_ms
    return msgspec.structs.replace(
        row,
        next_at=next_at,
        due_at=row.next_at,
        attempts=row.attempts + 1,
        last_run_at=now_ms,
        completed=row.every_ms is None,
    )


def ensure_timers(db: sqlite_utils.Database) -> None:
    db.table("timers").create(
        _COLUMNS,
        pk=("host", "name"),
        not_null={c for c in _COLUMNS if c not in ("every_ms", "at_ms")},
        defaults={"payload": "", "due_at": 0, "attempts": 0, "registration": 0, "last_run_at": 0, "completed": 0},
        if_not_exists=True,
    )
    db.table("timer_inflight").create(
        {"host": str, "name": str, "runner": str, "started_at": int},
        pk=("host", "name"),
        not_null={"host", "name", "runner", "started_at"},
        if_not_exists=True,
    )


def _row(values: Sequence[object]) -> TimerRow:
    d = dict(zip(_ROW_FIELDS, values, strict=True))
    d["completed"] = bool(d["completed"])
    return msgspec.convert(d, TimerRow)


class Timers:
    """The ``timers`` table of one box (§9.4)."""

    def __init__(self, db: sqlite_utils.Database, clock: Clock) -> None:
        self.db = db
        self.conn: sqlite3.Connection = db.conn
        self.clock = clock
        ensure_routes(db)
        ensure_timers(db)

    @classmethod
    def open(cls, box_dir: Path, clock: Clock) -> Timers:
        return cls(open_db(Path(box_dir) / REGISTRY_FILE), clock)

    def close(self) -> None:
        self.conn.close()

    def list(self, host: str) -> list[TimerRow]:
        cur = self.conn.execute(f"SELECT {', '.join(_ROW_FIELDS)} FROM timers WHERE host=? ORDER BY name", (host,))
        return [_row(r) for r in cur.fetchall()]

    def digest(self, host: str) -> str:
        """The host's canonical timers digest (§9.4), read in one statement."""
        return timers_digest(self.list(host))

    def replace_timers(self, host: str, timers: Sequence[TimerSpec]) -> None:
        """``ReplaceTimers(host, rows)`` (§9.4): afterwards the host holds exactly ``timers``.

        One transaction deletes every row of the host and inserts the given ones; any failure rolls
        all of it back, so the old set stands. Bookkeeping is preserved as the module docstring says.
        """
        validate_ident(host, "host")
        now = self.clock.now_ms()
        try:
            with transaction(self.conn):
                old = {
                    r.name: r
                    for r in (
                        _row(v)
                        for v in self.conn.execute(
                            f"SELECT {', '.join(_ROW_FIELDS)} FROM timers WHERE host=?", (host,)
                        ).fetchall()
                    )
                }
                self.conn.execute("DELETE FROM timers WHERE host=?", (host,))
                for spec in timers:
                    row = _with_bookkeeping(spec, old.get(spec.name), now)
                    values = msgspec.structs.asdict(row)
                    values["completed"] = int(row.completed)
                    self.conn.execute(
                        f"INSERT INTO timers (host, {', '.join(_ROW_FIELDS)}) "
                        f"VALUES (?, {', '.join('?' * len(_ROW_FIELDS))})",
                        (host, *(values[f] for f in _ROW_FIELDS)),
                    )
        except sqlite3.IntegrityError as exc:
            raise TimerError(
                f"the timers for {host} were not replaced: two of the new timers share a name, or one is "
                f"malformed ({exc}); the previous timers are unchanged"
            ) from None

    def prune_completed(self, older_than_ms: int) -> int:
        """The runner's history sweep (joint N14): delete completed once-timers delivered before
        ``older_than_ms``, for every host. Never changes a digest."""
        cur = self.conn.execute("DELETE FROM timers WHERE completed=1 AND last_run_at<?", (older_than_ms,))
        return cur.rowcount

    def delete_all(self, host: str) -> int:
        """Clear the host's timers (a finalization's own step, D§3.5 ``cleaning``, §7.9)."""
        return self.conn.execute("DELETE FROM timers WHERE host=?", (host,)).rowcount


def _with_bookkeeping(spec: TimerSpec, old: TimerRow | None, now_ms: int) -> TimerRow:
    if isinstance(spec, TimerRow):
        return spec
    if old is not None:
        return TimerRow(
            name=spec.name,
            every_ms=spec.every_ms,
            at_ms=spec.at_ms,
            payload=spec.payload,
            next_at=old.next_at,
            due_at=old.due_at,
            attempts=old.attempts,
            registration=old.registration,
            last_run_at=old.last_run_at,
            completed=old.completed,
        )
    return fresh_bookkeeping(spec, now_ms)


# --- the runner -------------------------------------------------------------------------------


class RunReport(msgspec.Struct, kw_only=True):
    """What one :meth:`TimerRunner.run_due` pass did, by ``(host, name)``."""

    delivered: list[tuple[str, str]] = msgspec.field(default_factory=list)
    skipped_held: list[tuple[str, str]] = msgspec.field(default_factory=list)
    skipped_closed: list[tuple[str, str]] = msgspec.field(default_factory=list)
    failed: list[tuple[str, str]] = msgspec.field(default_factory=list)


def _process_start(pid: int) -> str | None:
    """The kernel's start time of ``pid`` (field 22 of /proc/<pid>/stat), or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read().decode("ascii", "replace")
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def runner_identity() -> str:
    """``pid:starttime`` of this process: unique on the box while it lives, so a dead runner's
    in-flight rows are recognized and never waited for."""
    pid = os.getpid()
    return f"{pid}:{_process_start(pid)}"


def _alive(identity: str) -> bool:
    pid_text, _, start = identity.partition(":")
    try:
        pid = int(pid_text)
    except ValueError:
        return False
    return _process_start(pid) == start


InstanceUrl = Callable[[str], str | None]


class TimerRunner:
    """Delivers due timers to their instances over HTTP (§9.4).

    ``instance_url(host)`` gives the instance's local base URL (or None when it has none); a timer
    is POSTed to ``<base><path>`` (``{name}`` in ``path`` is the timer's name, URL-quoted) as JSON
    ``{"host", "name", "payload", "due_at", "due_at_ms", "delivery"}``; ``delivery`` names this attempt
    (``<registration>:<due_at>``), so an app can tell a repeated delivery of one due time from a new one.
    A 2xx answer is a delivery; anything else, or no answer within ``timeout_s``, changes nothing and the timer
    stays due. Only rows whose route is open and ``ready`` are delivered.

    Delivery is **at least once**: a runner that dies between the app's answer and its own bookkeeping leaves the
    row due, and the next runner (on this box, or on the target after a move: the snapshot carries the row) delivers
    the same due time again under the same ``delivery`` id. No runner can close that window; an app applies a
    delivery id once (``moveprobe`` does, and counts the repeats). ``faults("timer:after_delivery")`` is called in
    that window, so the crash tests can put a SIGKILL there.
    """

    def __init__(
        self,
        timers: Timers,
        clock: Clock,
        session: aiohttp.ClientSession | None,
        instance_url: InstanceUrl,
        *,
        path: str = "/_hostmove/timer",
        timeout_s: float = 10.0,
        faults: Callable[[str], None] | None = None,
    ) -> None:
        self.timers = timers
        self.conn = timers.conn
        self.clock = clock
        self.session = session
        self.instance_url = instance_url
        self.path = path
        self.timeout_s = timeout_s
        self.identity = runner_identity()
        self.faults = faults

    async def run_due(self, now_ms: int | None = None) -> RunReport:
        """Deliver every timer due at ``now_ms`` (the Clock's now by default). Hosts run concurrently,
        each host's timers in name order."""
        now = self.clock.now_ms() if now_ms is None else now_ms
        report = RunReport()
        self._reap_dead()
        cur = self.conn.execute(
            f"SELECT host, {', '.join(_ROW_FIELDS)} FROM timers WHERE completed=0 AND next_at<=? ORDER BY host, name",
            (now,),
        )
        by_host: dict[str, list[TimerRow]] = {}
        for values in cur.fetchall():
            by_host.setdefault(values[0], []).append(_row(values[1:]))
        await asyncio.gather(*(self._run_host(h, rows, now, report) for h, rows in by_host.items()))
        return report

    async def _run_host(self, host: str, rows: list[TimerRow], now: int, report: RunReport) -> None:
        for row in rows:
            verdict = self._begin(host, row, now)
            if verdict == "held":
                report.skipped_held.append((host, row.name))
                continue
            if verdict != "begun":
                report.skipped_closed.append((host, row.name))
                continue
            delivered = False
            try:
                delivered = await self._post(host, row)
                if delivered and self.faults is not None:
                    self.faults("timer:after_delivery")
            finally:
                self._finish(host, row, now, delivered)
            (report.delivered if delivered else report.failed).append((host, row.name))

    def _begin(self, host: str, row: TimerRow, now: int) -> str:
        """In one transaction: the route must be open and ready, the row unchanged and not in flight;
        then register the delivery as in flight (what :meth:`drain` waits for)."""
        with transaction(self.conn):
            route = self.conn.execute("SELECT status, hold_op FROM routes WHERE host=?", (host,)).fetchone()
            if route is None:
                return "no-route"
            if route[0] in HOLD_STATUSES or route[1] != "":
                return "held"
            if route[0] != "ready":
                return "not-ready"
            same = self.conn.execute(
                "SELECT 1 FROM timers WHERE host=? AND name=? AND next_at=? AND completed=0",
                (host, row.name, row.next_at),
            ).fetchone()
            if same is None:
                return "changed"
            cur = self.conn.execute(
                "INSERT OR IGNORE INTO timer_inflight (host, name, runner, started_at) VALUES (?, ?, ?, ?)",
                (host, row.name, self.identity, now),
            )
            return "begun" if cur.rowcount == 1 else "in-flight"

    async def _post(self, host: str, row: TimerRow) -> bool:
        base = self.instance_url(host)
        if not base:
            return False
        body = {"host": host, "name": row.name, "payload": row.payload, "due_at": row.next_at,
                "due_at_ms": row.next_at, "delivery": f"{row.registration}:{row.next_at}"}
        path = self.path.replace("{name}", quote(row.name, safe=""))
        status = await http_post_json(base.rstrip("/") + path, body, self.timeout_s, self.session)
        if status is None:
            log.info("timer %s of %s: delivery failed (no answer)", row.name, host,
                     extra=ctx(host=host, phase="timer", reason="no answer", timer=row.name, due_at=row.next_at))
            return False
        if not 200 <= status < 300:
            log.info("timer %s of %s: delivery refused (HTTP %d)", row.name, host, status,
                     extra=ctx(host=host, phase="timer", reason=f"HTTP {status}", timer=row.name,
                               due_at=row.next_at, status=status))
            return False
        return True

    def _finish(self, host: str, row: TimerRow, now: int, delivered: bool) -> None:
        with transaction(self.conn):
            if delivered:
                done = after_delivery(row, now)
                self.conn.execute(
                    "UPDATE timers SET next_at=?, due_at=?, attempts=?, last_run_at=?, completed=? "
                    "WHERE host=? AND name=? AND next_at=? AND completed=0 AND EXISTS "
                    "(SELECT 1 FROM timer_inflight WHERE host=? AND name=? AND runner=?)",
                    (
                        done.next_at,
                        done.due_at,
                        done.attempts,
                        done.last_run_at,
                        int(done.completed),
                        host,
                        row.name,
                        row.next_at,
                        host,
                        row.name,
                        self.identity,
                    ),
                )
            self.conn.execute(
                "DELETE FROM timer_inflight WHERE host=? AND name=? AND runner=?", (host, row.name, self.identity)
            )

    def _reap_dead(self) -> None:
        rows = self.conn.execute("SELECT host, name, runner FROM timer_inflight").fetchall()
        for host, name, runner in rows:
            if runner != self.identity and not _alive(runner):
                self.conn.execute(
                    "DELETE FROM timer_inflight WHERE host=? AND name=? AND runner=?", (host, name, runner)
                )

    async def drain(self, host: str, *, timeout_s: float, poll_s: float = 0.02) -> None:
        """Wait until no delivery is in flight for ``host`` in any runner process on the box (§9.4
        "Drained"). Call it after the hold is written. Raises :class:`TimersBusy` at the deadline."""
        await drain(self.conn, self.clock, host, timeout_s=timeout_s, poll_s=poll_s)


async def drain(conn: sqlite3.Connection, clock: Clock, host: str, *, timeout_s: float, poll_s: float = 0.02) -> None:
    """:meth:`TimerRunner.drain` for a process that runs no runner (the source's cut worker)."""
    deadline = clock.monotonic() + timeout_s
    while True:
        runners = [r for (r,) in conn.execute("SELECT runner FROM timer_inflight WHERE host=?", (host,))]
        if not any(_alive(r) for r in runners):
            return
        if clock.monotonic() >= deadline:
            raise TimersBusy(
                f"a timer delivery to {host} is still running after {timeout_s:g} s; the stop waits for it, "
                "so stop evidence is not taken yet"
            )
        await clock.sleep(poll_s)
