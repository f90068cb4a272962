"""The trace of one simulated run (model digest §8.9): one line per event, hashed as it grows.

A line is ``<virtual seconds> <actor> <what>``. Nothing nondeterministic may enter a line (no object
ids, no wall time, no set order), so one seed gives one trace and one hash.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable


class Trace:
    def __init__(self, now: Callable[[], float]) -> None:
        self._now = now
        self._hash = hashlib.sha256()
        self.lines: list[str] = []
        self.closed = False

    def emit(self, actor: str, what: str) -> None:
        if self.closed:
            return
        line = f"{self._now():.3f} {actor} {what}"
        self._hash.update(line.encode("utf-8", "backslashreplace") + b"\n")
        self.lines.append(line)

    def close(self) -> None:
        """Stop recording: whatever runs after the verdict (task clean-up) is not part of the run."""
        self.closed = True

    def hexdigest(self) -> str:
        return self._hash.hexdigest()
