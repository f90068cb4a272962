"""Sleeping hosts: the box runtime's ordinary idle stop and its wake on demand (model digest §4 actors "wake" and
"idle stop"; spec §5.2: a ``ready`` route is routable and "the activator wakes the instance on demand").

A serving host of this box whose instance has been idle for ``idle_s`` (no commit reached its replica, no router
demand, no timer delivery) is stopped the way every stop is (:meth:`services.box.instance.activator.Activator.stop`: the
tree drained, the final sync, a clean-close certificate when everything shipped) and marked **asleep** here. The
route stays ``ready``; the claim does not change (a sleeping host is still served by this box). The agent wakes a
sleeping host only on demand: a router's wake request, a due timer, a move (S1 probes the instance as it runs,
§7.3, so a move wakes its source). The wake is the ordinary cold admission (§5.1 step 9, ruling P7).

The mark is a file per host under ``<box_dir>/asleep/``: it survives an agent restart (a new agent does not wake
what slept) and goes with a lost disk (the host is then woken, which is always safe). A stale mark is harmless:
it is consulted only for a serving claim naming this box, and every wake removes it.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote, unquote

from kernel.fsutil import atomic_write, fsync_dir

ASLEEP_DIR = "asleep"


def idle_left(now_s: float, last_active_s: float, idle_s: float) -> float:
    """Seconds until the host counts as idle (0: it is idle now)."""
    return max(0.0, last_active_s + idle_s - now_s)


@dataclass
class Activity:
    """What the agent last saw of one running host: when it was last active and its replica's position then."""

    at_s: float
    position: int | None

    def observe(self, now_s: float, position: int | None) -> None:
        """A replica that moved since the last look is activity (the app committed)."""
        if position != self.position:
            self.at_s, self.position = now_s, position


class SleepMarks:
    """The box's asleep marks (see the module docstring)."""

    def __init__(self, box_dir: Path) -> None:
        self.dir = box_dir / ASLEEP_DIR

    def _path(self, host: str) -> Path:
        return self.dir / f"{quote(host, safe='')}.json"

    def asleep(self, host: str) -> bool:
        return self._path(host).exists()

    def mark(self, host: str, *, session: int, at_ms: int) -> None:
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        atomic_write(self._path(host), json.dumps({"host": host, "session": session, "at_ms": at_ms}).encode(),
                     mode=0o600)

    def clear(self, host: str) -> bool:
        """Remove the mark; answers whether there was one."""
        try:
            self._path(host).unlink()
        except FileNotFoundError:
            return False
        with contextlib.suppress(FileNotFoundError):
            fsync_dir(self.dir)
        return True

    def hosts(self) -> list[str]:
        if not self.dir.is_dir():
            return []
        return sorted(unquote(p.name[: -len(".json")]) for p in self.dir.glob("*.json"))


__all__ = ["ASLEEP_DIR", "Activity", "SleepMarks", "idle_left"]
