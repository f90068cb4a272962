"""The vocabulary and the durable-value boundary (run-store "Durable values"; issue 2 item 4)."""

from __future__ import annotations

import math

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from bus.subjects import SubjectError, decode_token, encode_token, ledger_subject, parse_ledger_subject
from events import Actor, Claim, DurableValueError, EventMeta, FrozenMap, Holder, Move, Op, Record, Transition
from events.base import _bytes_within_limits, canonical, decode
from events.durable import MAX_DEPTH, MAX_NODES
from events.ids import is_op_id, new_incarnation, new_op_id
from kernel.ports import SeededRandom


def claim(**kw: object) -> Claim:
    return Claim(host=kw.pop("host", "a.example.com"), gen=kw.pop("gen", 1), **kw)  # type: ignore[arg-type]


def test_claim_round_trips_canonically_and_is_frozen() -> None:
    c = claim(
        holder=Holder(incarnation="ab" * 32, location="instances/a/x/"),
        op=Op(kind="serving", exec="box-ie", journal={"seal": {"n": 7, "ids": ["v1", "v2"]}}),
        quiet_after={"uk": 5},
    )
    body = canonical(c)
    again = decode(body, Claim)
    assert again == c and canonical(again) == body
    assert isinstance(again.op.journal, FrozenMap)
    assert again.op.journal["seal"]["ids"] == ("v1", "v2")
    with pytest.raises(TypeError):
        again.op.journal["x"] = 1  # type: ignore[index]
    with pytest.raises(AttributeError):
        again.gen = 2  # type: ignore[misc]


def test_keys_are_sorted_in_the_canonical_encoding() -> None:
    body = canonical(claim(inventory={"b": 1, "a": 2}))
    assert body.index(b'"a":2') < body.index(b'"b":1')
    assert b" " not in body


@pytest.mark.parametrize(
    ("data", "limit"),
    [
        (b'{"host":"h","gen":1,"surprise":1}', "schema"),
        (b'{"host":"h","gen":0}', "gen_positive"),
        (b'{"host":"\\ud800","gen":1}', "json"),
        (b'{"host":"h\\u0000","gen":1}', "no_nul"),
        (b'{"host":"h","gen":1,"inventory":{"x":1e999}}', "schema"),
        (b'{"host":"h","gen":1,', "json"),
        (b"not json", "json"),
        (b'{"host":"","gen":1}', "ident_nonempty"),
        (b'{"host":"h","gen":1,"quiet_after":{"uk":-1}}', "schema"),
        (b'{"host":"h","gen":9007199254740992}', "safe_integer"),
    ],
)
def test_bad_bytes_fail_as_decode_failed_naming_the_limit(data: bytes, limit: str) -> None:
    with pytest.raises(DurableValueError) as err:
        decode(data, Claim)
    assert err.value.code == "decode_failed"
    assert err.value.limit == limit


def test_identifier_limit_counts_utf16_units() -> None:
    claim(host="x" * 1024)
    claim(host="\U0001f600" * 512)  # 1,024 UTF-16 units
    with pytest.raises(DurableValueError) as err:
        claim(host="\U0001f600" * 512 + "x")
    assert err.value.limit == "ident_max_units"
    with pytest.raises(DurableValueError) as err:
        claim(host="x" * 1025)
    assert err.value.limit == "ident_max_units"


def test_fffd_and_astral_text_are_ordinary() -> None:
    c = claim(host="caf\u00e9-\ufffd-\U0001f600")
    assert decode(canonical(c), Claim).host == c.host


@pytest.mark.parametrize(
    ("value", "limit"),
    [
        (float("nan"), "finite_number"),
        (float("inf"), "finite_number"),
        ("a\x00b", "no_nul"),
        ("\udc00", "no_lone_surrogate"),
        (2**53, "safe_integer"),
    ],
)
def test_write_side_refuses_values_past_a_limit(value: object, limit: str) -> None:
    with pytest.raises(DurableValueError) as err:
        claim(inventory={"v": value})
    assert err.value.code == "invalid_value" and err.value.limit == limit


def test_depth_and_node_limits() -> None:
    deep: dict = {}
    cur = deep
    for _ in range(MAX_DEPTH):
        cur["a"] = {}
        cur = cur["a"]
    with pytest.raises(DurableValueError) as err:
        claim(inventory=deep)
    assert err.value.limit == "max_depth"
    with pytest.raises(DurableValueError) as err:
        claim(inventory={"many": list(range(MAX_NODES))})
    assert err.value.limit == "max_nodes"
    # just inside the node limit is fine
    claim(inventory={"many": list(range(MAX_NODES - 200))})


def test_timestamps_are_non_negative_safe_integers() -> None:
    with pytest.raises(DurableValueError) as err:
        EventMeta(name="x", actor=Actor(service="t", pid=1, nonce="n"), at=-1)
    assert err.value.limit == "timestamp_safe_range"
    with pytest.raises(DurableValueError):
        Record(host="h", gen=1, move=Move(id="mv_a", incarnation="i", to="uk", state="ready", cut_at=2**53))


def test_nan_never_reaches_the_encoder_silently() -> None:
    # msgspec alone encodes NaN as null; the boundary refuses it before encoding.
    assert msgspec.json.encode(math.nan) == b"null"
    with pytest.raises(DurableValueError):
        canonical({"x": math.nan})


def test_transition_envelope_carries_exactly_its_state() -> None:
    meta = EventMeta(name="create", actor=Actor(service="door", pid=1, nonce="n1"), at=5)
    c = claim()
    t = Transition(kind="transition", object="claim", host=c.host, gen=1, meta=meta, claim=c)
    assert decode(canonical(t), Transition).state == c
    with pytest.raises(DurableValueError):
        Transition(kind="transition", object="record", host=c.host, gen=1, meta=meta, claim=c)
    with pytest.raises(DurableValueError):
        Transition(kind="transition", object="claim", host=c.host, gen=2, meta=meta, claim=c)


def test_op_ids() -> None:
    rng = SeededRandom(7)
    ids = {new_op_id("mv", rng) for _ in range(100)}
    assert len(ids) == 100 and all(is_op_id(i) and len(i) == 29 for i in ids)
    assert is_op_id(new_op_id("rb", rng))
    assert not is_op_id("mv_" + "A" * 26) and not is_op_id("xx_" + "a" * 26)
    with pytest.raises(ValueError):
        new_op_id("zz", rng)  # type: ignore[arg-type]
    assert len(new_incarnation(rng)) == 64


@given(st.text(min_size=1, max_size=60).filter(lambda s: not any(0xD800 <= ord(c) <= 0xDFFF for c in s)))
def test_subject_tokens_are_safe_and_reversible(name: str) -> None:
    token = encode_token(name)
    assert all(c.isascii() and (c.isalnum() or c in "-_") for c in token)
    assert decode_token(token) == name
    assert parse_ledger_subject(ledger_subject("claim", name)) == ("claim", name)


def test_subject_tokens_for_dotted_hosts() -> None:
    assert encode_token("kpmg.bdn.oncarlos.com") == "kpmg_2Ebdn_2Eoncarlos_2Ecom"
    assert encode_token("a_b") == "a_5Fb"
    assert encode_token("a*b>c d") == "a_2Ab_3Ec_20d"
    with pytest.raises(SubjectError):
        decode_token("a.b")
    with pytest.raises(SubjectError):
        encode_token("")


def test_read_side_bounds_agree_with_the_exact_walk() -> None:
    """decode() skips the exact walk only when cheap byte bounds prove it unnecessary."""
    ok = canonical(claim(inventory={"text": "a\\u0000b", "n": 2**53 - 1}))
    assert decode(ok, Claim).inventory["text"] == "a\\u0000b"  # an escaped backslash, not a NUL
    deep = b'{"host":"h","gen":1,"inventory":{"x":' + b"[" * 130 + b"]" * 130 + b"}}"
    with pytest.raises(DurableValueError) as err:
        decode(deep, Claim)
    assert err.value.limit == "max_depth"
    many = b'{"host":"h","gen":1,"inventory":{"x":[' + b",".join([b"1"] * MAX_NODES) + b"]}}"
    with pytest.raises(DurableValueError) as err:
        decode(many, Claim)
    assert err.value.limit == "max_nodes"
    big = b'{"host":"h","gen":1,"inventory":{"x":-9007199254740993}}'
    with pytest.raises(DurableValueError) as err:
        decode(big, Claim)
    assert err.value.limit == "safe_integer"
    for number in (b"[1,90071992547409930]", b"[ 90071992547409930]", b"[1.0,1e+0000000000000999]"):
        assert not _bytes_within_limits(b'{"x":' + number + b"}"), number
    # Sixteen digits inside a string are no number: a TXID range keeps the claim on the cheap bounds.
    named = canonical(claim(inventory={"range": "0000000000000001-0000000000000002", "at": "x9007199254740993"}))
    assert _bytes_within_limits(named) and decode(named, Claim).inventory["range"].startswith("0000")


@given(st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**60), max_value=2**60)
    | st.text(alphabet=st.characters(blacklist_categories=["Cs"]), max_size=5),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=3), children, max_size=4),
    max_leaves=30,
))
def test_decode_refuses_exactly_what_the_write_side_refuses(value: object) -> None:
    try:
        built = claim(inventory={"v": value})
    except DurableValueError as exc:
        write_limit: str | None = exc.limit
    else:
        write_limit = None
    raw = msgspec.json.encode({"host": "h", "gen": 1, "inventory": {"v": value}})
    try:
        decode(raw, Claim)
    except DurableValueError as exc:
        assert write_limit == exc.limit
    else:
        assert write_limit is None and decode(canonical(built), Claim) == built


def test_decoded_identifiers_are_counted_in_utf16_units() -> None:
    """msgspec counts code points; astral text makes the read side check UTF-16 units exactly."""
    ok = canonical(claim(host="\U0001f600" * 512))
    assert decode(ok, Claim).host == "\U0001f600" * 512
    over = ok.replace(("\U0001f600" * 512).encode(), ("\U0001f600" * 513).encode())
    with pytest.raises(DurableValueError) as err:
        decode(over, Claim)
    assert err.value.code == "decode_failed" and err.value.limit == "ident_max_units"
    escaped = b'{"host":"' + b"\\ud83d\\ude00" * 513 + b'","gen":1}'
    with pytest.raises(DurableValueError) as err:
        decode(escaped, Claim)
    assert err.value.limit == "ident_max_units"
    assert decode(b'{"host":"' + b"x" * 1024 + b'","gen":1}', Claim).host == "x" * 1024
