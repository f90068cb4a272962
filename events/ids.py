"""Operation ids (digest D§1): ``mv_`` or ``rb_`` and 26 lowercase base32 characters.

Console-minted, opaque and never ordered. Randomness comes through the :class:`~kernel.ports.Random`
port, so a simulation draws them from its seed.
"""

from __future__ import annotations

import base64
import hashlib
import re
from typing import Literal, Protocol

OP_ID_RE = re.compile(r"^(mv|rb)_[a-z2-7]{26}$")

OpPrefix = Literal["mv", "rb"]


class _Bytes(Protocol):
    def token_bytes(self, n: int) -> bytes: ...


def new_op_id(prefix: OpPrefix, rng: _Bytes) -> str:
    """``mv_…`` or ``rb_…``: 128 random bits as 26 lowercase base32 characters."""
    if prefix not in ("mv", "rb"):
        raise ValueError(f"op id prefix must be mv or rb, not {prefix!r}")
    raw = rng.token_bytes(16)
    return f"{prefix}_" + base64.b32encode(raw).decode("ascii").lower().rstrip("=")


def rollback_id(move_id: str) -> str:
    """The one rollback id of a move (``rb_…``, derived from the move id): a move rolls back at most once (§7.8), so
    every actor that may trigger it (the target, the source, the console's recovery pass) names the same rollback
    and racing triggers decide the same record."""
    raw = hashlib.sha256(f"rollback:{move_id}".encode()).digest()[:16]
    return "rb_" + base64.b32encode(raw).decode("ascii").lower().rstrip("=")


def is_op_id(text: str) -> bool:
    return bool(OP_ID_RE.match(text))


def new_incarnation(rng: _Bytes) -> str:
    """A fresh incarnation: 64 lowercase hex characters, never reused (digest D§1)."""
    return rng.token_bytes(32).hex()
