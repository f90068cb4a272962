"""The base of every durable shape, and the one canonical JSON encoding (ARCHITECTURE §10).

``Durable`` structs are frozen and refuse unknown fields. Field annotations mark identifiers
(:data:`Ident`) and timestamps (:data:`Millis`); ``__post_init__`` checks them on construction
(write) and msgspec runs it again on decode (read). Free-form maps are frozen into
:class:`~events.durable.FrozenMap`.
"""

from __future__ import annotations

import contextvars
import re
import typing
from functools import cache
from typing import Annotated, Any, TypeVar

import msgspec

from events.durable import (
    MAX_DEPTH,
    MAX_IDENT_UNITS,
    MAX_NODES,
    MAX_SAFE_INTEGER,
    DurableValueError,
    FrozenMap,
    check_ident,
    check_text,
    check_timestamp,
    check_tree,
    freeze,
)


class _Kind:
    def __init__(self, name: str) -> None:
        self.name = name


_IDENT = _Kind("ident")
_MILLIS = _Kind("millis")

Ident = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_IDENT_UNITS), _IDENT]
"""An identifier: non-empty, at most 1,024 UTF-16 units, no NUL, no lone surrogate."""
Millis = Annotated[int, msgspec.Meta(ge=0, le=2**53 - 1), _MILLIS]
"""A timestamp in milliseconds since the epoch: a non-negative safe integer."""


def _kind_of(tp: Any) -> tuple[str, bool] | None:
    """(kind, is_sequence) when ``tp`` is Ident/Millis, optional or a tuple of them."""
    origin = typing.get_origin(tp)
    if origin is Annotated:
        for meta in tp.__metadata__:
            if isinstance(meta, _Kind):
                return meta.name, False
        return None
    if origin is tuple:
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            inner = _kind_of(args[0])
            if inner:
                return inner[0], True
        return None
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        for arg in typing.get_args(tp):
            if arg is type(None):
                continue
            found = _kind_of(arg)
            if found:
                return found
    return None


@cache
def _field_kinds(cls: type) -> tuple[tuple[str, str, bool, bool], ...]:
    """(field, kind, is_sequence, may_be_empty): an identifier whose default is "" may be empty."""
    hints = typing.get_type_hints(cls, include_extras=True)
    out = []
    for f in msgspec.structs.fields(cls):
        found = _kind_of(hints[f.name])
        if found:
            out.append((f.name, found[0], found[1], f.default == ""))
    return tuple(out)


@cache
def _map_fields(cls: type) -> tuple[str, ...]:
    hints = typing.get_type_hints(cls)
    out = []
    for name in cls.__struct_fields__:  # type: ignore[attr-defined]
        tp = hints[name]
        if typing.get_origin(tp) is dict or tp is Any:
            out.append(name)
    return tuple(out)


_SHORT = MAX_IDENT_UNITS // 2
"""At most this many code points is at most 1,024 UTF-16 units, whatever the characters."""

_SHAPE_CHECKED: contextvars.ContextVar[int] = contextvars.ContextVar("_SHAPE_CHECKED", default=0)
"""Set by :func:`decode` while the bytes it decodes were already bounded (see :func:`_bytes_within_limits`)."""


def _is_utf8(text: str) -> bool:
    """No lone surrogate (the only text Python holds that UTF-8 cannot encode)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


_NUL_ESCAPE = re.compile(rb"(?<!\\)(?:\\\\)*\\u0000")
_DIGITS = bytes(0x30 if 0x30 <= b <= 0x39 else 0x2D if b == 0x2D else 0x7C if b in b":,[.eE+ \t\r\n" else 0x20
                for b in range(256))
"""Digits become ``0``; what may come right before a number's first digit (``:``, ``,``, ``[``, whitespace; and,
conservatively, a fraction's ``.``, an exponent's ``e`` and its ``+``) becomes ``|``; a minus sign stays; the rest
is blank."""
_SIXTEEN_DIGITS = (b"|" + b"0" * 16, b"|-" + b"0" * 16)
"""A number of sixteen digits or more may exceed 2**53 - 1. Digits inside a string never make one: a run preceded
by a letter, a quote or a digit and a minus sign (a TXID range ``0000000000000001-0000000000000002``, a hex
digest) is no number, and it no longer sends every claim that names one through the exact walk."""


_BOUNDED = 1
_BMP_ONLY = 2
# ASCII bytes with no ``\u`` escape hold no astral text, so code points (what msgspec's Meta counts on
# an Ident) equal UTF-16 units; anything else takes the exact per-identifier check.


def _bytes_within_limits(data: bytes) -> bool:
    """Cheap, conservative bounds on JSON bytes: when they hold, the decoded value is within every
    shape limit (depth, nodes, safe integers, no NUL) and the exact tree walk can be skipped.
    Structural characters inside strings only inflate the counts, so a pass is never wrong; a
    failure just means the exact walk runs (JSON itself cannot carry NaN or infinities, and
    msgspec refuses lone surrogate escapes)."""
    if data.count(b"{") + data.count(b"[") >= MAX_DEPTH:
        return False
    if data.count(b",") + data.count(b":") + data.count(b"[") + 1 > MAX_NODES:
        return False
    if b"\\u0000" in data and _NUL_ESCAPE.search(data):
        return False
    shape = b"|" + data.translate(_DIGITS)  # a number may start the text
    return not any(run in shape for run in _SIXTEEN_DIGITS)


_PLANS: dict[
    type,
    tuple[tuple[tuple[str, str, bool, bool], ...], tuple[tuple[str, bool, bool], ...], tuple[str, ...], bool],
] = {}
_EMPTY_MAP = FrozenMap()


class Durable(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=False, gc=False):
    """A frozen durable shape. Subclasses set ``__durable_root__ = True`` to be tree-checked."""

    def __post_init__(self) -> None:
        cls = type(self)
        plan = _PLANS.get(cls)
        if plan is None:
            kinds_all = _field_kinds(cls)
            plan = _PLANS[cls] = (
                kinds_all,
                tuple((n, seq, empty) for n, k, seq, empty in kinds_all if k == "ident"),
                _map_fields(cls),
                bool(getattr(cls, "__durable_root__", False)),
            )
        kinds, idents, maps, root = plan
        level = _SHAPE_CHECKED.get()
        if level == _BMP_ONLY:
            pass  # msgspec's Meta on Ident counted code points, which equal UTF-16 units without astral text
        elif level == _BOUNDED:
            # Decoded from bounded bytes: msgspec refused lone surrogates and checked every timestamp's
            # range (Millis' Meta); the bytes carried no NUL. Only identifier lengths remain to check.
            for name, is_seq, may_be_empty in idents:
                value = getattr(self, name)
                if value is None:
                    continue
                for item in value if is_seq else (value,):
                    if not 0 < len(item) <= _SHORT and not (item == "" and may_be_empty):
                        check_ident(item, f"{cls.__name__}.{name}")
        else:
            self._check_fields(cls, kinds)
        for name in maps:
            value = getattr(self, name)
            if type(value) is dict:
                msgspec.structs.force_setattr(self, name, freeze(value) if value else _EMPTY_MAP)
            elif isinstance(value, list):
                msgspec.structs.force_setattr(self, name, freeze(value))
        if root and not level:
            check_tree(msgspec.to_builtins(self))

    def _check_fields(self, cls: type, kinds: tuple[tuple[str, str, bool, bool], ...]) -> None:
        """Identifiers and timestamps of a value built in code (the write side)."""
        for name, kind, is_seq, may_be_empty in kinds:
            value = getattr(self, name)
            if value is None:
                continue
            values = value if is_seq else (value,)
            for i, item in enumerate(values):
                if kind == "ident":
                    if item == "" and may_be_empty:
                        continue  # "" is the spec's "none" for an optional identifier
                    if type(item) is str and 0 < len(item) <= _SHORT and "\x00" not in item and _is_utf8(item):
                        continue  # fast path: short well-formed text is within every identifier limit
                    check_ident(item, f"{cls.__name__}.{name}" + (f"[{i}]" if is_seq else ""))
                elif not (type(item) is int and 0 <= item <= MAX_SAFE_INTEGER):
                    check_timestamp(item, f"{cls.__name__}.{name}" + (f"[{i}]" if is_seq else ""))


_ENCODER = msgspec.json.Encoder(order="sorted")

T = TypeVar("T", bound=Durable)


def canonical(value: Any) -> bytes:
    """The canonical encoding: JSON, keys sorted, no whitespace. Refuses what the boundary refuses.

    A durable root was checked when it was built and is frozen, so it is not walked again.
    """
    if not getattr(type(value), "__durable_root__", False):
        check_tree(msgspec.to_builtins(value))
    return _ENCODER.encode(value)


@cache
def _decoder(cls: type[T]) -> msgspec.json.Decoder[T]:
    return msgspec.json.Decoder(cls)


def decode(data: bytes, cls: type[T]) -> T:
    """Decode and validate bytes read from the store or the stream.

    Anything that fails (malformed JSON, unknown fields, a limit) raises
    :class:`DurableValueError` with ``code == "decode_failed"``.
    """
    bounded = _bytes_within_limits(data)
    level = (_BMP_ONLY if data.isascii() and b"\\u" not in data else _BOUNDED) if bounded else 0
    token = _SHAPE_CHECKED.set(level)
    try:
        value = _decoder(cls).decode(data)
        if not bounded and not getattr(cls, "__durable_root__", False):
            check_tree(msgspec.to_builtins(value))  # a root's __post_init__ already ran the exact walk
    except DurableValueError as exc:
        raise exc.as_decode_failed() from None
    except msgspec.ValidationError as exc:
        cause = exc.__cause__ or exc.__context__
        if isinstance(cause, DurableValueError):
            raise cause.as_decode_failed() from None
        text = str(exc)
        if text.startswith("Expected `str` of length >= 1"):
            raise DurableValueError("decode_failed", "ident_nonempty", text) from None
        if text.startswith(f"Expected `str` of length <= {MAX_IDENT_UNITS}"):
            raise DurableValueError("decode_failed", "ident_max_units", text) from None
        raise DurableValueError("decode_failed", "schema", str(exc)) from None
    except msgspec.DecodeError as exc:
        msg = str(exc)
        if "truncated" in msg and b"\\u" in data:
            msg = "malformed JSON text (a lone surrogate escape or truncated input)"
        raise DurableValueError("decode_failed", "json", msg) from None
    except RecursionError:
        raise DurableValueError("decode_failed", "max_depth", "value nested too deeply") from None
    finally:
        _SHAPE_CHECKED.reset(token)
    return value


def check_gen(gen: int, path: str) -> None:
    """``gen`` is the per-write revision: a safe integer from 1."""
    if isinstance(gen, bool) or not isinstance(gen, int) or gen < 1 or gen > 2**53 - 1:
        raise DurableValueError("invalid_value", "gen_positive", "gen must be a safe integer from 1", path)


def validate_ident(text: str, what: str) -> str:
    """Check a free-standing identifier (a host name, a box label)."""
    check_ident(text, what)
    return text


__all__ = [
    "Durable",
    "DurableValueError",
    "FrozenMap",
    "Ident",
    "Millis",
    "canonical",
    "check_gen",
    "check_text",
    "decode",
    "validate_ident",
]
