"""The context of a log line, as fields (issue 11 item 4).

A call site keeps a readable message and passes what it knows as ``extra=`` fields, named the same everywhere so
an operator can filter one host's, one move's or one box's lines out of every service's log::

    log.info("park %s of %s acknowledged", kind, host, extra=ctx(host=host, op_id=op_id, box=box, phase="park"))

- ``host``: the host the line is about;
- ``op_id``: the move (the claim's op id, the record's move id) it is about;
- ``box``: the box acting or acted on (its label);
- ``phase``: the step of the protocol (``preparing``, ``cut``, ``landing``, ``commit``, ``park``, ``relay``, ...);
- ``reason``: why (a refusal's reason, an exception's text);
- anything else as keyword fields (``gen``, ``region``, ``subject``, ...). Never a secret: the shell's log
  configuration redacts the known ones, but a field is for facts an operator may read.

Fields whose value is ``None`` are left out. A field may not take the name of a ``logging.LogRecord`` attribute
(``message``, ``name``, ``module``, ``filename``, ...): :func:`ctx` refuses them at the call site (``logging``
would raise only when the line is logged).
"""

from __future__ import annotations

from typing import Any

__all__ = ["RESERVED", "ctx"]

RESERVED = frozenset({
    "args", "asctime", "created", "exc_info", "exc_text", "filename", "funcName", "levelname", "levelno", "lineno",
    "module", "msecs", "message", "msg", "name", "pathname", "process", "processName", "relativeCreated",
    "stack_info", "taskName", "thread", "threadName",
})


def ctx(*, host: str | None = None, op_id: str | None = None, box: str | None = None, phase: str | None = None,
        reason: object = None, **more: Any) -> dict[str, Any]:
    """The ``extra=`` of a log call: the given fields, none that is ``None``; ``reason`` as text."""
    bad = RESERVED.intersection(more)
    if bad:
        raise ValueError(f"log fields {sorted(bad)} are logging.LogRecord attributes; name them otherwise")
    fields: dict[str, Any] = {"host": host, "op_id": op_id, "box": box, "phase": phase,
                              "reason": None if reason is None else str(reason), **more}
    return {k: v for k, v in fields.items() if v is not None}
