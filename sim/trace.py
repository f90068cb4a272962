"""The trace of one simulated run (model digest §8.9): one line per event, hashed when the hash is asked for.

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
        self._hashed = 0  # lines[:_hashed] are in _hash: the hash is taken when asked for, over whole lines
        self.lines: list[str] = []
        self.closed = False

    def emit(self, actor: str, what: str) -> None:
        if self.closed:
            return
        self.lines.append(f"{self._now():.3f} {actor} {what}")

    def close(self) -> None:
        """Stop recording: whatever runs after the verdict (task clean-up) is not part of the run."""
        self.closed = True

    def hexdigest(self) -> str:
        """The SHA-256 of every line so far, each ``\\n``-terminated, UTF-8 with lone surrogates backslash-escaped
        (one update over the lines since the last call: the same bytes as one update a line)."""
        if self._hashed < len(self.lines):
            fresh = self.lines[self._hashed:]
            self._hash.update(("\n".join(fresh) + "\n").encode("utf-8", "backslashreplace"))
            self._hashed += len(fresh)
        return self._hash.hexdigest()
