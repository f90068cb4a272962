"""The exit codes of every ``hostmove`` command: one table (issue 11 item 6).

Every subcommand answers with one of these, and means the same by it. ``hostmove --help`` prints the table
(:func:`table_text`) and README.md carries it (``tests/test_cli.py`` holds the two to this one). The move's own
codes are §12's (0 done, 3 rolled back, 4 stuck or waiting, 5 refused); the rest are the shell's.

An outage of something a command depends on (NATS, the object store, the door: unreachable, or the door
answering 503 because one of its own dependencies is down) is :data:`UNAVAILABLE` with a sentence naming it,
never :data:`REFUSED`: nothing decided against the request, and repeating it once the dependency is back is
safe.
"""

from __future__ import annotations

from dataclasses import dataclass

OK = 0
"""Done: what was asked happened (a move: the host serves where it was asked to)."""
FAILED = 1
"""It did not work: an audit finding, a failed check, a component that did not do its part."""
USAGE = 2
"""Bad usage or configuration: a missing flag or setting, a wrong URL, credentials the store rejects."""
ROLLED_BACK = 3
"""The move ended without moving: rolled back to the source, or aborted (the host serves where it was)."""
WAITING = 4
"""Not over: the move is stuck waiting for an operator, or still going when the command's deadline passed."""
REFUSED = 5
"""Refused: the door or the protocol did not carry the request out; the sentence says why (§20)."""
UNAVAILABLE = 6
"""A dependency is unavailable (NATS, the object store, the door or a box's agent): try again once it is back."""
NONCONFORMING = 7
"""The object store answered but failed the conformance probe: it cannot give the guarantees moves rely on."""
INTERRUPTED = 130
"""Interrupted (Ctrl-C). A move goes on without the command that was following it."""


@dataclass(frozen=True)
class Code:
    code: int
    name: str
    meaning: str


TABLE: tuple[Code, ...] = (
    Code(OK, "ok", "done: what was asked happened (a move: the host serves on the target)"),
    Code(FAILED, "failed", "it did not work: an audit finding, a host with no history, a failed check"),
    Code(USAGE, "usage", "bad usage or configuration (a flag, a setting, a URL, rejected credentials)"),
    Code(ROLLED_BACK, "rolled back", "the move ended without moving: rolled back to the source, or aborted"),
    Code(WAITING, "waiting", "not over: the move is stuck for an operator, or still going at the deadline"),
    Code(REFUSED, "refused", "the door or the protocol refused the request; the sentence says why"),
    Code(UNAVAILABLE, "unavailable", "a dependency is down or unreachable (NATS, S3, the door, a box's agent)"),
    Code(NONCONFORMING, "nonconforming", "the object store failed the conformance probe"),
    Code(INTERRUPTED, "interrupted", "interrupted (Ctrl-C); a move goes on without the command"),
)


def table_text() -> str:
    """The table as ``hostmove --help`` prints it."""
    width = max(len(c.name) for c in TABLE)
    return "exit codes (the same in every subcommand):\n" + "\n".join(
        f"  {c.code:>3}  {c.name:<{width}}  {c.meaning}" for c in TABLE)


def table_markdown() -> str:
    """The table as README.md carries it."""
    rows = ["| code | name | meaning |", "|---|---|---|"]
    rows += [f"| {c.code} | {c.name} | {c.meaning} |" for c in TABLE]
    return "\n".join(rows)


__all__ = [
    "FAILED", "INTERRUPTED", "NONCONFORMING", "OK", "REFUSED", "ROLLED_BACK", "TABLE", "UNAVAILABLE", "USAGE",
    "WAITING", "Code", "table_markdown", "table_text",
]
