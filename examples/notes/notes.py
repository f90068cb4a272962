"""notes: a small notes service, a second sample app for hostmove (issue 18). Standard library only; nothing of
hostmove is imported: it is an app a platform user brings, published as a release (``release.toml`` beside it).

It keeps its notes in its own SQLite database (WAL), each note's attachment as a file in its files directory, an
instance id written at first boot and verified at every boot against the database (a moved instance must carry
both), and it declares one schedule, ``compact``, in its timers file; each delivery is applied once (by its delivery
id) and recorded in the database.

Environment:

- ``NOTES_DB``: the SQLite database; ``NOTES_FILES``: the attachments directory; ``NOTES_INSTANCE``: the instance's
  directory (``instance.id`` lives there); ``NOTES_TIMERS``: where it declares its timers; ``NOTES_PORT``: the port;
- ``NOTES_TOKEN``: the bearer token a write must carry (a secret: without it the app is not ready);
- ``NOTES_COMPACT_EVERY_S``: the schedule's period (default 60); ``NOTES_GREETING``: shown by ``/status``.

HTTP: ``GET /healthz`` (ready: 200, else 503 with why), ``POST /notes`` ``{"title", "body", "attachment"}`` (bearer
token), ``GET /notes``, ``GET /notes/<id>``, ``POST /timers/<name>`` (a timer delivery), ``GET /timers/runs``,
``GET /status``. SIGTERM stops it cleanly (the WAL checkpointed).
"""

from __future__ import annotations

import hmac
import json
import os
import secrets
import signal
import sqlite3
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (k TEXT PRIMARY KEY, v TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS notes (id INTEGER PRIMARY KEY AUTOINCREMENT, title TEXT NOT NULL, body TEXT NOT NULL,
    attachment TEXT, created_ms INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS timer_runs (delivery TEXT PRIMARY KEY, name TEXT NOT NULL, due_at_ms INTEGER,
    ran_ms INTEGER NOT NULL, repeats INTEGER NOT NULL DEFAULT 0);
"""


class Notes:
    def __init__(self, env: dict[str, str]) -> None:
        self.db_path = Path(env["NOTES_DB"])
        self.files = Path(env["NOTES_FILES"])
        self.instance = Path(env["NOTES_INSTANCE"])
        self.timers = Path(env["NOTES_TIMERS"])
        self.token = env.get("NOTES_TOKEN", "")
        self.every_s = float(env.get("NOTES_COMPACT_EVERY_S", "60"))
        self.greeting = env.get("NOTES_GREETING", "")
        self.lock = threading.Lock()
        self.not_ready = ""
        self.files.mkdir(parents=True, exist_ok=True)
        self.conn = sqlite3.connect(self.db_path, isolation_level=None, check_same_thread=False)
        self.conn.execute("PRAGMA busy_timeout = 5000")
        self.conn.execute("PRAGMA journal_mode = WAL")
        self.conn.execute("PRAGMA synchronous = FULL")
        self.conn.executescript(SCHEMA)
        self.instance_id = self._instance_id()
        self._declare_timers()
        if not self.token:
            self.not_ready = "NOTES_TOKEN is not set: its secret did not reach it"

    def _instance_id(self) -> str:
        """Written at first boot, verified at every boot: the id file and the database must agree."""
        path = self.instance / "instance.id"
        row = self.conn.execute("SELECT v FROM meta WHERE k='instance_id'").fetchone()
        on_disk = path.read_text().strip() if path.exists() else None
        if row is None and on_disk is None:
            new = secrets.token_hex(16)
            tmp = path.with_name(".instance.id.tmp")
            tmp.write_text(new + "\n")
            os.replace(tmp, path)
            self.conn.execute("INSERT INTO meta (k, v) VALUES ('instance_id', ?)", (new,))
            return new
        if row is None or on_disk is None or row[0] != on_disk:
            self.not_ready = f"instance.id ({on_disk}) does not match the database ({row[0] if row else None})"
        return on_disk or ""

    def _declare_timers(self) -> None:
        wanted = json.dumps({"schedules": [{"name": "compact", "every_s": self.every_s}]}).encode() + b"\n"
        if not self.timers.exists() or self.timers.read_bytes() != wanted:
            tmp = self.timers.with_name(f".{self.timers.name}.tmp")
            tmp.write_bytes(wanted)
            os.replace(tmp, self.timers)

    def add(self, title: str, body: str, attachment: str | None) -> int:
        with self.lock:
            now = int(time.time() * 1000)
            self.conn.execute("BEGIN IMMEDIATE")
            cur = self.conn.execute("INSERT INTO notes (title, body, attachment, created_ms) VALUES (?, ?, ?, ?)",
                                    (title, body, None, now))
            note_id = int(cur.lastrowid or 0)
            if attachment is not None:
                name = f"{note_id}.txt"
                path = self.files / name
                with open(path, "w") as f:
                    f.write(attachment)
                    f.flush()
                    os.fsync(f.fileno())
                self.conn.execute("UPDATE notes SET attachment=? WHERE id=?", (name, note_id))
            self.conn.execute("COMMIT")
            return note_id

    def get(self, note_id: int) -> dict[str, object] | None:
        row = self.conn.execute("SELECT id, title, body, attachment FROM notes WHERE id=?", (note_id,)).fetchone()
        if row is None:
            return None
        attachment = (self.files / row[3]).read_text() if row[3] else None
        return {"id": row[0], "title": row[1], "body": row[2], "attachment": attachment}

    def timer(self, name: str, delivery: str, due_at_ms: int | None) -> None:
        with self.lock:
            self.conn.execute("BEGIN IMMEDIATE")
            cur = self.conn.execute("INSERT OR IGNORE INTO timer_runs (delivery, name, due_at_ms, ran_ms) "
                                    "VALUES (?, ?, ?, ?)", (delivery, name, due_at_ms, int(time.time() * 1000)))
            if cur.rowcount == 0:
                self.conn.execute("UPDATE timer_runs SET repeats = repeats + 1 WHERE delivery=?", (delivery,))
            self.conn.execute("COMMIT")

    def close(self) -> None:
        with self.lock:
            self.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            self.conn.close()


def handler(app: Notes) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, fmt: str, *args: object) -> None:
            return

        def _send(self, status: int, body: object) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _body(self) -> dict[str, object]:
            length = int(self.headers.get("Content-Length") or 0)
            value = json.loads(self.rfile.read(length) or b"{}")
            return value if isinstance(value, dict) else {}

        def do_GET(self) -> None:  # noqa: N802 - the http.server name
            if self.path == "/healthz":
                self._send(503 if app.not_ready else 200, {"ready": not app.not_ready, "why": app.not_ready})
            elif self.path == "/status":
                count = app.conn.execute("SELECT count(*) FROM notes").fetchone()[0]
                self._send(200, {"instance_id": app.instance_id, "not_ready": app.not_ready or None,
                                 "notes": count, "greeting": app.greeting})
            elif self.path == "/notes":
                rows = app.conn.execute("SELECT id, title FROM notes ORDER BY id").fetchall()
                self._send(200, {"notes": [{"id": r[0], "title": r[1]} for r in rows]})
            elif self.path.startswith("/notes/") and self.path[7:].isdigit():
                note = app.get(int(self.path[7:]))
                self._send(200 if note else 404, note or {"error": "no such note"})
            elif self.path == "/timers/runs":
                rows = app.conn.execute("SELECT name, due_at_ms, delivery, repeats, ran_ms FROM timer_runs "
                                        "ORDER BY ran_ms").fetchall()
                self._send(200, {"runs": [{"name": r[0], "due_at_ms": r[1], "delivery": r[2], "received_at_ms": r[4]}
                                          for r in rows],
                                 "repeats": [{"name": r[0], "due_at_ms": r[1]} for r in rows if r[3]]})
            else:
                self._send(404, {"error": "not found"})

        def do_POST(self) -> None:  # noqa: N802 - the http.server name
            if self.path == "/notes":
                given = self.headers.get("Authorization", "").removeprefix("Bearer ")
                if not app.token or not hmac.compare_digest(given, app.token):
                    self._send(401, {"error": "a write needs the bearer token"})
                    return
                body = self._body()
                attachment = body.get("attachment")
                note_id = app.add(str(body.get("title", "")), str(body.get("body", "")),
                                  str(attachment) if attachment is not None else None)
                self._send(201, {"id": note_id})
            elif self.path.startswith("/timers/"):
                body = self._body()
                due = body.get("due_at_ms")
                app.timer(self.path[len("/timers/"):], str(body.get("delivery", "")),
                          int(due) if isinstance(due, int) else None)
                self._send(200, {"applied": True})
            else:
                self._send(404, {"error": "not found"})

    return Handler


def main() -> int:
    env = dict(os.environ)
    try:
        app = Notes(env)
    except (KeyError, OSError, sqlite3.Error) as exc:
        print(f"notes cannot start: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    server = ThreadingHTTPServer(("127.0.0.1", int(env.get("NOTES_PORT", "0"))), handler(app))
    stopping = threading.Event()

    def stop(_sig: int, _frame: object) -> None:
        if not stopping.is_set():
            stopping.set()
            threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        server.serve_forever(poll_interval=0.1)
    finally:
        server.server_close()
        app.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
