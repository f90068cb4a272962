"""The forked worker: a descendant that outlives the main process (spec §14.4, §5.3).

In production a flat child's descendant outlived it, and stop evidence that waited for the main
process alone certified a stop while the descendant still ran (spec §5.3, round 2). moveprobe forks
one such worker at every boot: ``os.fork`` then ``setsid``, so it leaves the main process's session
and process group and survives both SIGTERM and SIGKILL of the main pid. It appends one heartbeat
line to a side file (never the database) every interval until it is killed. Stop evidence must kill
it; a test sees it survive by its heartbeats. If optionally told to, it holds the database file
open, which the evidence's ``/proc/*/fd`` scan must see (spec §5.3 step 3).

The worker stops by itself only when the side file's directory is gone (nothing left to beat for),
so a forgotten worker cannot outlive its test's scratch directory for long.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import msgspec

from kernel.ports import Clock
from moveprobe.config import Config


class Heartbeat(msgspec.Struct, frozen=True, tag_field="kind", tag="heartbeat"):
    host: str
    region: str
    pid: int
    n: int
    ts_ms: int


_decoder = msgspec.json.Decoder(Heartbeat)


def read_heartbeats(path: Path, *, pid: int | None = None) -> list[Heartbeat]:
    """Every complete heartbeat line in the side file; only ``pid``'s when given."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return []
    beats = [_decoder.decode(line) for line in data.split(b"\n")[:-1] if line.strip()]
    return [b for b in beats if pid is None or b.pid == pid]


def _detach_stdio() -> None:
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    os.closerange(3, 1 << 16)


def _beat(cfg: Config, clock: Clock) -> None:
    path = cfg.heartbeat_path
    hold = None
    if cfg.worker_holds_db and cfg.db_path.exists():
        hold = os.open(cfg.db_path, os.O_RDONLY)  # held, never read: the stop evidence's fd scan must see it
    me = os.getpid()
    n = 0
    while True:
        n += 1
        line = msgspec.json.encode(Heartbeat(cfg.host, cfg.region, me, n, clock.now_ms())) + b"\n"
        try:
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        except FileNotFoundError:
            break
        try:
            os.write(fd, line)
        finally:
            os.close(fd)
        time.sleep(cfg.worker_interval_s)
    if hold is not None:
        os.close(hold)


def fork_worker(cfg: Config, *, clock: Clock) -> int:
    """Fork the worker and return its pid (which is also its process group and session id).

    Call before any thread or event loop exists: the child runs plain synchronous code only.
    """
    cfg.heartbeat_path.parent.mkdir(parents=True, exist_ok=True)
    pid = os.fork()
    if pid:
        return pid
    code = 0
    try:
        os.setsid()
        _detach_stdio()
        _beat(cfg, clock)
    except BaseException:
        code = 1
    finally:
        os._exit(code)
