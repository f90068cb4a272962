"""Times in the operator's words: a millisecond timestamp as UTC text (spec §20: refusals name times a person reads).

A refusal that names a deadline names it as an absolute time, never as "N ms more": the text of a reason that is
re-derived every round must not change while nothing changed (a reason is written only when it changes)."""

from __future__ import annotations

from datetime import UTC, datetime

__all__ = ["utc_text"]


def utc_text(ms: int | float | None) -> str:
    """``2026-11-30 12:00:00 UTC``; ``-`` for none."""
    if ms is None:
        return "-"
    return datetime.fromtimestamp(int(ms) / 1000, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
