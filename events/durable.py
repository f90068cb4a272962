"""The durable-value boundary (run-store concepts, "Durable values").

Every value that crosses into S3 or onto the stream is checked here, on write and again on read:

- shape, not size: depth at most ``MAX_DEPTH`` and at most ``MAX_NODES`` nodes;
- text: no embedded NUL and no lone surrogate anywhere;
- identifiers: non-empty, at most ``MAX_IDENT_UNITS`` UTF-16 code units;
- timestamps: non-negative safe integers (at most 2**53 - 1), each checked on its own;
- numbers: finite only (msgspec would silently encode NaN as ``null``, so the check runs first).

Values come back as inert frozen copies: structs are frozen, arrays are tuples and maps are
:class:`FrozenMap`. A value past a limit raises :class:`DurableValueError` naming the limit; bytes
that fail on read raise it with ``code == "decode_failed"`` and are never handed back as state.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any, Literal, NoReturn

MAX_DEPTH = 128
MAX_NODES = 100_000
MAX_IDENT_UNITS = 1024
MAX_SAFE_INTEGER = 2**53 - 1

ErrorCode = Literal["invalid_value", "decode_failed"]


class DurableValueError(ValueError):
    """A value refused at the durable boundary. ``limit`` names the rule it broke."""

    def __init__(self, code: ErrorCode, limit: str, reason: str, path: str = "$") -> None:
        self.code: ErrorCode = code
        self.limit = limit
        self.reason = reason
        self.path = path
        super().__init__(f"{code}: {limit} at {path}: {reason}")

    def as_decode_failed(self) -> DurableValueError:
        return DurableValueError("decode_failed", self.limit, self.reason, self.path)


class FrozenMap(dict[str, Any]):
    """A dict that refuses mutation: the inert copy of a JSON object.

    It stays a ``dict`` subclass so that msgspec encodes it natively.
    """

    def _refuse(self, *_a: Any, **_k: Any) -> NoReturn:
        raise TypeError("durable values are frozen")

    __setitem__ = _refuse
    __delitem__ = _refuse
    clear = _refuse
    pop = _refuse
    popitem = _refuse
    setdefault = _refuse
    update = _refuse  # type: ignore[assignment]
    __ior__ = _refuse  # type: ignore[assignment]

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(tuple(sorted(self.items(), key=lambda kv: kv[0])))

    def __reduce__(self) -> Any:
        return (FrozenMap, (dict(self),))


def utf16_units(text: str) -> int:
    """Length of ``text`` in UTF-16 code units (an astral character counts two)."""
    return len(text.encode("utf-16-le", errors="surrogatepass")) // 2


def _fail(limit: str, reason: str, path: str) -> NoReturn:
    raise DurableValueError("invalid_value", limit, reason, path)


_SURROGATE = re.compile("[\ud800-\udfff]")


def check_text(text: str, path: str = "$") -> None:
    """Well-formed durable text: no NUL, no lone surrogate."""
    if "\x00" in text:
        _fail("no_nul", "text contains an embedded NUL", path)
    if _SURROGATE.search(text):
        _fail("no_lone_surrogate", "text contains a lone UTF-16 surrogate", path)


def check_ident(text: str, path: str = "$") -> None:
    """An identifier: non-empty, at most 1,024 UTF-16 units, well-formed text."""
    if not isinstance(text, str) or text == "":
        _fail("ident_nonempty", "an identifier must be a non-empty string", path)
    check_text(text, path)
    if utf16_units(text) > MAX_IDENT_UNITS:
        _fail("ident_max_units", f"identifier longer than {MAX_IDENT_UNITS} UTF-16 units", path)


def check_timestamp(value: int, path: str = "$") -> None:
    """A timestamp: a non-negative safe integer (milliseconds since the epoch)."""
    if isinstance(value, bool) or not isinstance(value, int):
        _fail("timestamp_integer", "a timestamp must be an integer", path)
    if value < 0 or value > MAX_SAFE_INTEGER:
        _fail("timestamp_safe_range", "a timestamp must be a non-negative safe integer", path)


def _path(link: tuple[Any, Any, bool] | None) -> str:
    """The path of a node from its chain of (parent link, key, parent is a map): built only when a check fails."""
    parts: list[str] = []
    while link is not None:
        link, key, is_map = link
        parts.append(f".{key}" if is_map else f"[{key}]")
    return "$" + "".join(reversed(parts))


def check_tree(value: Any) -> None:
    """Check a builtins tree (dicts, lists, str, int, float, bool, None) against the shape limits.

    Iterative, so the check itself never recurses past ``MAX_DEPTH``. The exact types a decoder or
    ``to_builtins`` produces take the fast paths; a node's path is spelled out only when it fails.
    """
    nodes = 0
    stack: list[tuple[Any, int, tuple[Any, Any, bool] | None]] = [(value, 1, None)]
    pop, push, surrogate = stack.pop, stack.append, _SURROGATE.search
    while stack:
        node, depth, link = pop()
        nodes += 1
        if nodes > MAX_NODES:
            _fail("max_nodes", f"value has more than {MAX_NODES} nodes", _path(link))
        if depth > MAX_DEPTH:
            _fail("max_depth", f"value is nested deeper than {MAX_DEPTH}", _path(link))
        kind = type(node)
        if kind is str:
            if "\x00" in node or surrogate(node):
                check_text(node, _path(link))
        elif kind is int:
            if not -MAX_SAFE_INTEGER <= node <= MAX_SAFE_INTEGER:
                _fail("safe_integer", "integer outside the safe range", _path(link))
        elif node is None or kind is bool:
            pass
        elif kind is dict:
            for key, child in node.items():
                if type(key) is not str:
                    _fail("string_keys", "object keys must be strings", "$")
                if "\x00" in key or surrogate(key):
                    check_text(key, _path((link, key, True)))
                push((child, depth + 1, (link, key, True)))
        elif kind is list:
            for i, child in enumerate(node):
                push((child, depth + 1, (link, i, False)))
        elif isinstance(node, str):
            check_text(node, _path(link))
        elif isinstance(node, bool):
            pass
        elif isinstance(node, int):
            if abs(node) > MAX_SAFE_INTEGER:
                _fail("safe_integer", "integer outside the safe range", _path(link))
        elif isinstance(node, float):
            if not math.isfinite(node):
                _fail("finite_number", "non-finite number", _path(link))
        elif isinstance(node, Mapping):
            for key, child in node.items():
                if not isinstance(key, str):
                    _fail("string_keys", "object keys must be strings", "$")
                check_text(key, _path((link, key, True)))
                push((child, depth + 1, (link, key, True)))
        elif isinstance(node, list | tuple):
            for i, child in enumerate(node):
                push((child, depth + 1, (link, i, False)))
        else:
            _fail("plain_data", f"unsupported type {type(node).__name__}", _path(link))


def freeze(value: Any) -> Any:
    """An inert deep copy: dicts become :class:`FrozenMap`, lists become tuples."""
    if isinstance(value, Mapping):
        return FrozenMap({k: freeze(v) for k, v in value.items()})
    if isinstance(value, list | tuple):
        return tuple(freeze(v) for v in value)
    return value
