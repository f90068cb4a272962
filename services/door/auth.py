"""Operator tokens for the door (spec §12, ruling M18).

Every move mutation needs an **operator**; a status-only token (the instance role of M18) may read
``GET .../move`` and nothing else; everyone else gets the family's 404 (§12), the same answer as for
a host that does not exist.

Tokens are configured as sha256 digests, never as raw tokens:

- ``HOSTMOVE_OPERATOR_TOKENS``: comma-separated entries, and/or
- ``HOSTMOVE_OPERATOR_TOKENS_FILE``: a file with one entry per line (``#`` starts a comment);
- ``HOSTMOVE_STATUS_TOKENS`` / ``HOSTMOVE_STATUS_TOKENS_FILE``: the same, for status-only tokens.

An entry is ``<64 hex>`` or ``<label>=<64 hex>``. The label is the operator's identity in the record
(``move.requested_by``) and in logs; an entry without one is labelled ``token-<first 8 hex>``.

A presented token is hashed and compared with **every** configured digest by
:func:`hmac.compare_digest` (no early exit), so the answer's timing does not depend on which digest,
if any, matched. The raw token is never stored, logged or echoed.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

Role = Literal["operator", "status"]

_HEX = re.compile(r"^[0-9a-f]{64}$")
_LABEL = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@-]{0,63}$")
MAX_TOKEN_CHARS = 4096

ENV_OPERATOR = "HOSTMOVE_OPERATOR_TOKENS"
ENV_OPERATOR_FILE = "HOSTMOVE_OPERATOR_TOKENS_FILE"
ENV_STATUS = "HOSTMOVE_STATUS_TOKENS"
ENV_STATUS_FILE = "HOSTMOVE_STATUS_TOKENS_FILE"


class TokenConfigError(Exception):
    """The token configuration is wrong; the message says where, never which token."""


@dataclass(frozen=True)
class Identity:
    """Who is asking: a label (never the token) and a role."""

    label: str
    role: Role

    @property
    def operator(self) -> bool:
        return self.role == "operator"


@dataclass(frozen=True)
class _Entry:
    digest: bytes
    identity: Identity


def token_digest(token: str) -> str:
    """The hex sha256 an operator configures for ``token``."""
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def parse_entries(entries: Iterable[str], role: Role, where: str) -> list[_Entry]:
    """Parse ``hex`` or ``label=hex`` entries. A bad entry is refused by its position, not its text."""
    out: list[_Entry] = []
    for n, raw in enumerate(entries, start=1):
        entry = raw.strip()
        if not entry or entry.startswith("#"):
            continue
        label, sep, hexdigest = entry.rpartition("=")
        hexdigest = hexdigest.strip().lower()
        if not _HEX.match(hexdigest):
            raise TokenConfigError(
                f"entry {n} of {where} is not a sha256 hex digest (64 hex characters, optionally after "
                "'label='); configure digests of tokens, never the tokens themselves"
            )
        label = label.strip() if sep else f"token-{hexdigest[:8]}"
        if not _LABEL.match(label):
            raise TokenConfigError(
                f"entry {n} of {where} has a label that is not 1 to 64 letters, digits, '.', '_', '@' or '-'"
            )
        out.append(_Entry(bytes.fromhex(hexdigest), Identity(label, role)))
    return out


class TokenSet:
    """The configured digests. :meth:`identify` answers who presented a token, or ``None``."""

    def __init__(self, entries: Iterable[_Entry]) -> None:
        self._entries = tuple(entries)
        digests = [e.digest for e in self._entries]
        if len(set(digests)) != len(digests):
            raise TokenConfigError("the same token digest is configured twice; give each token one entry")

    @classmethod
    def of(cls, operators: Mapping[str, str] | None = None, status: Mapping[str, str] | None = None) -> TokenSet:
        """Build from ``{label: raw token}`` maps (tests and embedded setups); only digests are kept."""
        entries = [_Entry(hashlib.sha256(t.encode()).digest(), Identity(label, "operator"))
                   for label, t in (operators or {}).items()]
        entries += [_Entry(hashlib.sha256(t.encode()).digest(), Identity(label, "status"))
                    for label, t in (status or {}).items()]
        return cls(entries)

    @property
    def operators(self) -> int:
        return sum(e.identity.operator for e in self._entries)

    def identify(self, token: str | None) -> Identity | None:
        """Constant-time lookup: every digest is compared, whatever matched."""
        if not token or len(token) > MAX_TOKEN_CHARS:
            return None
        presented = hashlib.sha256(token.encode("utf-8", errors="surrogatepass")).digest()
        found: Identity | None = None
        for entry in self._entries:
            if hmac.compare_digest(presented, entry.digest):
                found = entry.identity
        return found

    def identify_header(self, authorization: str | None) -> Identity | None:
        """``Authorization: Bearer <token>``; anything else is no identity."""
        if not authorization:
            return None
        scheme, _, token = authorization.strip().partition(" ")
        if scheme.lower() != "bearer":
            return None
        return self.identify(token.strip())

    def __repr__(self) -> str:  # never print digests
        return f"TokenSet({self.operators} operator, {len(self._entries) - self.operators} status)"


def _read_file(path: str, env_name: str) -> list[str]:
    try:
        return Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise TokenConfigError(f"{env_name} names {path}, which cannot be read: {exc.strerror}") from None


def load_tokens(env: Mapping[str, str] | None = None) -> TokenSet:
    """Tokens from the environment. At least one operator token is required: a door nobody can use
    is a configuration mistake, not a safe default."""
    env = os.environ if env is None else env
    entries: list[_Entry] = []
    for role, name, file_name in (("operator", ENV_OPERATOR, ENV_OPERATOR_FILE),
                                  ("status", ENV_STATUS, ENV_STATUS_FILE)):
        r: Role = "operator" if role == "operator" else "status"
        if env.get(name):
            entries += parse_entries(env[name].split(","), r, name)
        if env.get(file_name):
            entries += parse_entries(_read_file(env[file_name], file_name), r, f"{file_name} ({env[file_name]})")
    tokens = TokenSet(entries)
    if tokens.operators == 0:
        raise TokenConfigError(
            f"no operator token is configured: set {ENV_OPERATOR} (comma-separated sha256 hex digests of "
            f"tokens, each optionally 'label=digest') or {ENV_OPERATOR_FILE} (one per line)"
        )
    return tokens


__all__ = [
    "ENV_OPERATOR", "ENV_OPERATOR_FILE", "ENV_STATUS", "ENV_STATUS_FILE", "Identity", "Role", "TokenConfigError",
    "TokenSet", "load_tokens", "parse_entries", "token_digest",
]
