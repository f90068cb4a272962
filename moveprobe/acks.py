"""The ack log: one JSON line per acknowledged write, kept outside the instance (spec §14.4, INV-2).

moveprobe appends a line only after the write committed (WAL, ``synchronous=FULL``), fsyncs it, and
only then answers. So every line names a write the app was told succeeded, and a move that loses one
is caught by :func:`missing_from_db` reading the instance's database after the move.

Line shapes (``kind`` tells them apart):

- ``{"kind": "write", "host", "seq", "value", "session", "ts_ms"}``: ``POST /write``;
- ``{"kind": "tick", "host", "seq", "value": null, "session", "ts_ms"}``: a background-loop row;
- ``{"kind": "timer", "host", "name", "run", "due_at_ms", "delivery", "session", "ts_ms"}``: a timer delivery.
"""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path
from typing import Any

import msgspec


class RowAck(msgspec.Struct, frozen=True, tag_field="kind", tag="write"):
    """A ``POST /write`` row, acknowledged with its ``seq``."""

    host: str
    seq: int
    value: Any
    session: str
    ts_ms: int


class TickAck(msgspec.Struct, frozen=True, tag_field="kind", tag="tick"):
    """A background-loop row."""

    host: str
    seq: int
    value: None
    session: str
    ts_ms: int


class TimerAck(msgspec.Struct, frozen=True, tag_field="kind", tag="timer"):
    """A timer delivery, recorded as run ``run`` in ``timer_runs``."""

    host: str
    name: str
    run: int
    due_at_ms: int | None
    delivery: str | None
    session: str
    ts_ms: int


Ack = RowAck | TickAck | TimerAck

_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(Ack)


def encode_line(ack: Ack) -> bytes:
    """One ack as one newline-terminated line."""
    return _encoder.encode(ack) + b"\n"


class AckLogError(ValueError):
    """A complete line of the ack log is not an ack: the log is damaged and proves nothing."""


def read_acks(path: Path, *, host: str | None = None) -> list[Ack]:
    """Every ack in the log, in append order; only ``host``'s when given.

    A final line with no newline is a write that never finished appending, so its write was never
    acknowledged (the answer follows the fsync of the whole line): it is ignored.
    """
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return []
    lines = data.split(b"\n")
    out: list[Ack] = []
    for number, line in enumerate(lines[:-1], start=1):
        if not line.strip():
            continue
        try:
            ack = _decoder.decode(line)
        except msgspec.ValidationError as exc:
            raise AckLogError(f"{path} line {number} is not an ack: {exc}") from None
        except msgspec.DecodeError as exc:
            raise AckLogError(f"{path} line {number} is not JSON: {exc}") from None
        if host is None or ack.host == host:
            out.append(ack)
    return out


def canonical_value(value: Any) -> str:
    """The text stored in ``rows.value`` for a written JSON value (sorted keys, compact)."""
    return msgspec.json.encode(value, order="sorted").decode()


def missing_from_db(db_path: Path, acks: list[Ack]) -> list[Ack]:
    """The acks whose write is not in the database at ``db_path`` (opened read-only), in log order.

    No database at all means every ack is missing.

    A row ack is present when ``rows`` holds its seq with the same kind, session and value; a timer
    ack when ``timer_runs`` holds its run with the same name and session. A seq present with another
    session or value is a lost write overwritten by a later writer, so it counts as missing.
    """
    if not acks:
        return []
    if not db_path.exists():
        return list(acks)
    # A fully checkpointed database (no -wal file: stopped cleanly) is read as immutable, so the check
    # leaves no -wal or -shm beside it; otherwise the WAL's content is part of what was committed.
    wal = db_path.with_name(db_path.name + "-wal")
    flags = "mode=ro" if wal.exists() else "mode=ro&immutable=1"
    conn = sqlite3.connect(f"file:{db_path}?{flags}", uri=True)
    try:
        tables = {name for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        rows = {
            seq: (kind, session, value)
            for seq, kind, session, value in (
                conn.execute("SELECT seq, kind, session, value FROM rows") if "rows" in tables else ()
            )
        }
        runs = {
            run: (name, session)
            for run, name, session in (
                conn.execute("SELECT run, name, session FROM timer_runs") if "timer_runs" in tables else ()
            )
        }
    finally:
        conn.close()
    missing: list[Ack] = []
    for ack in acks:
        if isinstance(ack, TimerAck):
            if runs.get(ack.run) != (ack.name, ack.session):
                missing.append(ack)
            continue
        kind = "write" if isinstance(ack, RowAck) else "tick"
        value = None if isinstance(ack, TickAck) else canonical_value(ack.value)
        if rows.get(ack.seq) != (kind, ack.session, value):
            missing.append(ack)
    return missing


class AckLog:
    """The append side: one ``write`` of a whole line, then ``fsync``, before the caller answers."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)

    def append(self, ack: Ack) -> None:
        line = encode_line(ack)
        written = os.write(self._fd, line)
        if written != len(line):
            raise OSError(f"short write to the ack log {self.path}: {written} of {len(line)} bytes")
        os.fsync(self._fd)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
