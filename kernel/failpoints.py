"""Failpoints for the crash matrix: the acting process dies by SIGKILL at a named point (issue 4).

The workers and the ledger already call a ``faults(point)`` hook at every journaled step (the ledger after each
CAS and each publish, the landing before and after each phase's effects, the finalizer between its CASes). A
box agent passes a :class:`Failpoints` as that hook. ``HOSTMOVE_FAILPOINT=<point>@<n>`` kills the process with
SIGKILL at the ``n``-th time ``point`` is reached (``n`` defaults to 1): no ``finally`` runs, no buffer is
flushed, exactly what a power cut or the OOM killer does. ``HOSTMOVE_FAILPOINT_LOG=<file>`` appends every point
reached, one per line, so a clean run lists the points a matrix can target.
"""

from __future__ import annotations

import os
import signal
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

ENV = "HOSTMOVE_FAILPOINT"
ENV_LOG = "HOSTMOVE_FAILPOINT_LOG"


def parse(spec: str) -> tuple[str, int]:
    """``"after_cas@3"`` -> ``("after_cas", 3)``; a bare point is its first occurrence."""
    point, _, nth = spec.partition("@")
    if not point:
        raise ValueError(f"{ENV} names no point: {spec!r}")
    try:
        n = int(nth) if nth else 1
    except ValueError:
        raise ValueError(f"{ENV}: the occurrence after '@' must be a number, got {nth!r}") from None
    if n < 1:
        raise ValueError(f"{ENV}: occurrences count from 1, got {n}")
    return point, n


@dataclass
class Failpoints:
    target: tuple[str, int] | None = None
    log: Path | None = None
    seen: Counter[str] = field(default_factory=Counter)

    @classmethod
    def from_env(cls) -> Failpoints:
        spec = os.environ.get(ENV, "")
        log = os.environ.get(ENV_LOG, "")
        return cls(parse(spec) if spec else None, Path(log) if log else None)

    def __call__(self, point: str) -> None:
        self.seen[point] += 1
        if self.log is not None:
            with self.log.open("a") as f:
                f.write(f"{point}\n")
        if self.target is not None and self.target == (point, self.seen[point]):
            os.kill(os.getpid(), signal.SIGKILL)
