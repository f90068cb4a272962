"""Test programs run as real OS processes (spec §14.1: a forked descendant that closes its descriptors and
outlives its parent).

``python forker.py tree DIR [PROCS]``  the "app": forks a descendant that starts a new session (double fork),
                                (with ``PROCS``: moves itself into that ``cgroup.procs``, escaping its group), writes
                                ``DIR/descendant.pid``, closes every descriptor and sleeps; the app then writes
                                ``DIR/parent.pid`` and exits, leaving the descendant behind.
``python forker.py hold DB READY``  opens the SQLite database in WAL mode, writes a row and holds the database,
                                WAL and SHM open; writes its pid to ``READY``.
``python forker.py sleep READY``    writes its pid to ``READY`` and sleeps.
``python forker.py cgroup OUT`` writes its own ``/proc/self/cgroup`` to ``OUT`` as its first act, then sleeps.
"""

from __future__ import annotations

import os
import signal
import sqlite3
import sys
import time


def _write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _forever() -> None:
    while True:
        signal.pause()


def tree(out_dir: str, escape_to: str | None) -> None:
    child = os.fork()
    if child == 0:
        os.setsid()
        if os.fork() != 0:
            os._exit(0)  # the intermediate parent: the descendant is re-parented away from the app
        if escape_to:
            with open(escape_to, "w") as procs:
                procs.write(f"{os.getpid()}\n")
        _write_atomic(os.path.join(out_dir, "descendant.pid"), str(os.getpid()))
        os.closerange(0, os.sysconf("SC_OPEN_MAX"))
        _forever()
    os.waitpid(child, 0)
    deadline = time.monotonic() + 10
    while not os.path.exists(os.path.join(out_dir, "descendant.pid")):
        if time.monotonic() > deadline:
            sys.exit("the descendant did not start")
        time.sleep(0.002)
    _write_atomic(os.path.join(out_dir, "parent.pid"), str(os.getpid()))


def hold(db: str, ready: str) -> None:
    conn = sqlite3.connect(db, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("CREATE TABLE IF NOT EXISTS t (x INTEGER)")
    conn.execute("INSERT INTO t VALUES (1)")
    conn.execute("SELECT count(*) FROM t").fetchone()
    _write_atomic(ready, str(os.getpid()))
    _forever()


def main(argv: list[str]) -> None:
    mode = argv[1]
    if mode == "cgroup":
        with open("/proc/self/cgroup") as f:
            _write_atomic(argv[2], f.read())
        _forever()
    elif mode == "tree":
        tree(argv[2], argv[3] if len(argv) > 3 else None)
    elif mode == "hold":
        hold(argv[2], argv[3])
    elif mode == "sleep":
        _write_atomic(argv[2], str(os.getpid()))
        _forever()
    else:
        sys.exit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main(sys.argv)
