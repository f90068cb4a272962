"""A box's process side in the simulation (ARCHITECTURE §7; issue 5 item 2): the process tree, the instances
and the box-local network, as twins.

- :class:`SimTree` implements :class:`~services.box.instance.proctree.ProcessTree`: one leaf per host, strict spawns
  recorded in a spawn journal per boot, ``kill_and_drain`` that empties the leaf at once, ``holders`` that names
  the live instances holding the watched database files. It belongs to the box, not to the agent: an agent crash
  leaves its instances running in their leaves (as cgroups do); a box reboot ends them and starts a new boot.
- :class:`SimInstance` behaves like ``moveprobe``: it opens the real SQLite file at the instance's database
  path (WAL), commits each write in the ``rows`` table moveprobe uses, and acknowledges only after the commit;
  it answers readiness while it runs. A killed instance commits nothing more.
- :class:`SimNet` is the :class:`~kernel.ports.LocalNet` port: ports are handed out in order and a GET (or a
  timer delivery's POST) reaches the instance listening on the port, without sockets.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast
from urllib.parse import urlsplit

from services.box.instance.proctree import (
    Drain,
    Holder,
    HolderScan,
    Spawned,
    SpawnHistory,
    StrayScan,
    StrictRefused,
    leaf_name,
)

__all__ = ["Ack", "SimInstance", "SimNet", "SimTree"]

SCHEMA = """
CREATE TABLE IF NOT EXISTS rows (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    ts_ms INTEGER NOT NULL,
    session TEXT NOT NULL,
    kind TEXT NOT NULL,
    value TEXT
);
"""


@dataclass(frozen=True)
class Ack:
    """One acknowledged write: the instance committed it before answering (moveprobe's ack log)."""

    host: str
    box: str
    writer_session: int | None  # the claim's writer session the instance was started under
    app_session: str  # the instance's own boot token, stored in the row
    seq: int
    value: str
    at: float


class SimInstance:
    """One running instance (see the module docstring); ``process`` duck-types ``subprocess.Popen``."""

    def __init__(self, pid: int, box: str, host: str, db_path: Path, writer_session: int | None, port: int,
                 probe: bool, fail_ready: str = "") -> None:
        self.pid = pid
        self.fail_ready = fail_ready
        """``before-write`` or ``after-write``: its readiness fails (moveprobe's fail switch, §14.4)."""
        self.box = box
        self.host = host
        self.db_path = db_path
        self.writer_session = writer_session
        self.port = port
        self.probe = probe
        self.app_session = f"{box}:{pid}"
        self.returncode: int | None = None
        db_path.parent.mkdir(parents=True, exist_ok=True)
        self.conn: sqlite3.Connection | None = sqlite3.connect(str(db_path), isolation_level=None)
        self.conn.execute("PRAGMA journal_mode=WAL")
        self.conn.executescript(SCHEMA)

    # -- Popen's surface ----------------------------------------------------------------------------

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        return self.returncode if self.returncode is not None else -9

    def kill(self) -> None:
        if self.returncode is None:
            self.returncode = -9
            if self.conn is not None:
                self.conn.close()
                self.conn = None

    @property
    def alive(self) -> bool:
        return self.returncode is None

    # -- the app ------------------------------------------------------------------------------------

    def timer(self, delivery: str) -> None:
        """A timer delivery, committed before the answer, as ``moveprobe`` records a run."""
        assert self.conn is not None and self.alive
        self.conn.execute("INSERT INTO rows (ts_ms, session, kind, value) VALUES (0, ?, 'timer', ?)",
                          (self.app_session, delivery))

    def write(self, value: str, now_ms: int) -> int:
        """Commit one row, then answer its seq (the acknowledgement follows the commit)."""
        assert self.conn is not None and self.alive
        cur = self.conn.execute("INSERT INTO rows (ts_ms, session, kind, value) VALUES (?, ?, 'write', ?)",
                                (now_ms, self.app_session, value))
        return int(cur.lastrowid or 0)


class SimNet:
    """The box-local network port (:class:`kernel.ports.LocalNet`) for every box of one run."""

    def __init__(self) -> None:
        self._next = 20000
        self.listening: dict[int, SimInstance] = {}
        self.on_timer: Callable[[SimInstance, Mapping[str, Any]], None] | None = None

    def free_port(self) -> int:
        self._next += 1
        return self._next

    async def get_status(self, url: str, timeout_s: float) -> int | None:
        port = urlsplit(url).port
        inst = self.listening.get(port or 0)
        if inst is None or not inst.alive:
            return None
        return 503 if inst.fail_ready else 200

    async def post_json(self, url: str, body: Mapping[str, Any], timeout_s: float) -> int | None:
        """A timer delivery (``POST /timers/<name>``, §9.4): the live instance on the port takes it."""
        parts = urlsplit(url)
        inst = self.listening.get(parts.port or 0)
        if inst is None or not inst.alive or not parts.path.startswith("/timers/"):
            return None
        inst.timer(str(body.get("delivery", "")))
        if self.on_timer is not None:
            self.on_timer(inst, body)
        return 200


@dataclass
class SimTree:
    """A box's process tree (:class:`~services.box.instance.proctree.ProcessTree`), durable across agent restarts."""

    box: str
    net: SimNet
    next_pid: Callable[[], int]
    writer_session: Callable[[str], int | None]  # the claim's writer session of a host now (the admission first)
    on_start: Callable[[SimInstance], None]
    on_stop: Callable[[SimInstance, str], None]
    boot: int = 1
    leaves: dict[str, list[SimInstance]] = field(default_factory=dict)
    journal: dict[str, tuple[int, int]] = field(default_factory=dict)  # host -> (boot, strict spawns)

    def _leaf(self, host: str) -> Path:
        return Path("/sim/cgroup") / self.box / leaf_name(host)

    def live(self, host: str) -> list[SimInstance]:
        return [p for p in self.leaves.get(host, []) if p.alive]

    def strict_available(self) -> tuple[bool, str]:
        return True, ""

    def prepare_strict(self, host: str) -> Path:
        if self.live(host):
            raise StrictRefused(f"the leaf of {host} is populated")
        self.leaves.setdefault(host, [])
        return self._leaf(host)

    def spawn_strict(self, host: str, argv: Sequence[str], *, env: Mapping[str, str], cwd: str | Path,
                     stdout: str | Path, stderr: str | Path) -> Spawned:
        leaf = self.prepare_strict(host)
        boot, strict = self.journal.get(host, (self.boot, 0))
        self.journal[host] = (self.boot, (strict if boot == self.boot else 0) + 1)
        port = int(env.get("SIM_PORT", "0")) or self.net.free_port()
        inst = SimInstance(self.next_pid(), self.box, host, Path(env["SIM_DB"]), self.writer_session(host), port,
                           probe=env.get("CARLOS_MOVE_PROBE") == "1", fail_ready=env.get("SIM_FAIL_READY", ""))
        self.leaves[host].append(inst)
        self.net.listening[port] = inst
        self.on_start(inst)
        return Spawned(host=host, pid=inst.pid, leaf=leaf, process=cast(Any, inst))

    def populated(self, host: str) -> bool:
        return bool(self.live(host))

    def spawn_history(self, host: str) -> SpawnHistory:
        boot, strict = self.journal.get(host, (self.boot, 0))
        return SpawnHistory(host, True, f"boot-{self.boot}", strict if boot == self.boot else 0, 0)

    def members(self, host: str) -> tuple[int, ...]:
        return tuple(p.pid for p in self.live(host))

    def kill(self, host: str, why: str) -> tuple[int, ...]:
        pids = self.members(host)
        for p in self.live(host):
            p.kill()
            self.net.listening.pop(p.port, None)
            self.on_stop(p, why)
        if host in self.leaves:
            self.leaves[host] = []
        return pids

    async def kill_and_drain(self, host: str, *, within_s: float) -> Drain:
        existed = host in self.leaves
        pids = self.kill(host, "killed and drained")
        return Drain(host=host, leaf=str(self._leaf(host)), existed=existed, pids_before=pids, drained=True,
                     waited_ms=0)

    async def reopen_and_drain(self, host: str, *, within_s: float) -> Drain:
        return await self.kill_and_drain(host, within_s=within_s)

    def agent_dir(self) -> Path | None:
        return Path("/sim/cgroup") / self.box / "agent"

    def strays(self, own_pid: int) -> StrayScan:
        return StrayScan(agent_dir=str(self.agent_dir()), strays=(), readable=True)

    def holders(self, paths: Iterable[str | Path], *, uid: int | None = None) -> HolderScan:
        watched = {str(p) for p in paths}
        found = tuple(Holder(pid=p.pid, path=str(p.db_path), via="fd", name="sim-instance")
                      for procs in self.leaves.values() for p in procs if p.alive and str(p.db_path) in watched)
        return HolderScan(holders=found, complete=True, scanned=sum(len(v) for v in self.leaves.values()), skipped=0)

    def reboot(self) -> None:
        """The box restarts: every instance ends, a new boot starts (the journal's old boot counts for nothing)."""
        for host in sorted(self.leaves):
            self.kill(host, "the box rebooted")
        self.leaves.clear()
        self.boot += 1
