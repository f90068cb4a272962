"""Projections (ARCHITECTURE §8): the ledger folded into a revisioned snapshot and change feed.

- :mod:`projections.fold`: the pure fold of one transition into a host's row;
- :mod:`projections.store`: the SQLite shell (identity, revision, position, tombstones, rebuild);
- :mod:`projections.runner`: the projector that catches up and follows ``HM_LEDGER``;
- :mod:`projections.api`: the read API (aiohttp) and :mod:`projections.openapi` its document.
"""

from projections.fold import HostRow, step
from projections.runner import Projector
from projections.store import (
    Applied,
    ChangesPage,
    ErrorEntry,
    HostView,
    ProjectionError,
    ProjectionPoison,
    ProjectionStore,
    Resync,
    RevisionOverflow,
    Snapshot,
    decode_event,
    make_cursor,
)

__all__ = [
    "Applied", "ChangesPage", "ErrorEntry", "HostRow", "HostView", "ProjectionError", "ProjectionPoison",
    "ProjectionStore", "Projector", "Resync", "RevisionOverflow", "Snapshot", "decode_event", "make_cursor",
    "step",
]
