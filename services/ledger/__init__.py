"""The ledger: the only writer of claims and records (ARCHITECTURE §4)."""

from services.ledger.ledger import (
    MAX_OBJECT_BYTES,
    BadObject,
    Committed,
    Conflict,
    Crash,
    Current,
    Ledger,
    LedgerDefect,
    NoChange,
    Refusal,
    object_key,
    validate_host,
)

__all__ = [
    "MAX_OBJECT_BYTES", "BadObject", "Committed", "Conflict", "Crash", "Current", "Ledger", "LedgerDefect",
    "NoChange", "Refusal", "object_key", "validate_host",
]
