"""The door's pure parts: the copy, operator tokens, input parsing and every decider (issue 4 item 1).

Each refusal rule of §7.1 and §11 that the door can check is exercised alone: the state that
triggers it, the sentence and status it answers, and that the nearest legal state is accepted.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from events.base import decode
from events.claim import Claim, Holder, LostBox, Obligation, Op
from events.copy import COPY, CopyError, say
from events.durable import DurableValueError
from events.record import LastMove, Move, Record
from services.box.roster import Roster, RosterBox
from services.door.auth import TokenConfigError, TokenSet, load_tokens, parse_entries, token_digest
from services.door.decide import (
    CreateRequest,
    DoorRefusal,
    Floor,
    MoveRequest,
    body_depth,
    check_floor,
    check_host,
    choose,
    decide_abort,
    decide_cut,
    decide_move_claim,
    decide_move_record,
    duplicate_key,
    parse_create_request,
    parse_empty,
    parse_move_request,
    status_line,
    status_view,
)
from services.ledger.ledger import NoChange

HOST = "app.example.com"
INC = "a" * 64
MOVE_ID = "mv_" + "a" * 26
NOW = 1_700_000_000_000


def box(label: str, region: str, protocol: int = 1) -> RosterBox:
    return RosterBox(label=label, region=region, moves_protocol=protocol, secrets_key_fp="sha256:x", registered_at=1)


ROSTER = Roster(gen=1, boxes=(box("ie-1", "ie"), box("uk-1", "uk"), box("us-1", "us"), box("us-2", "us"),
                              box("au-1", "au", protocol=0)))


def serving(exec_box: str = "ie-1", **kw: Any) -> Claim:
    return Claim(host=HOST, gen=3, holder=Holder(incarnation=INC, location=f"instances/{HOST}/{INC}/"),
                 op=Op(kind="serving", exec=exec_box, participants=(exec_box,)), **kw)


def request_claim(current: Claim | None, to: str = "uk", *, record: Record | None = None,
                  roster: Roster = ROSTER, floor: Floor | None = None, cut: str = "manual",
                  console: int = 1) -> Claim | NoChange | DoorRefusal:
    return decide_move_claim(current, host=HOST, record=record, roster=roster, floor=floor,
                             request=MoveRequest(to=to, cut=cut),  # type: ignore[arg-type]
                             move_id=MOVE_ID, operator="alice", now_ms=NOW, console=console)


def refused(out: object, status: int, copy: str) -> DoorRefusal:
    assert isinstance(out, DoorRefusal), out
    assert (out.status, out.copy) == (status, copy), out
    assert out.reason == out.reason.strip() and "{" not in out.reason and "—" not in out.reason
    return out


# -- the copy (§20) -------------------------------------------------------------------------------


def test_copy_holds_every_spec_id_with_named_placeholders_and_no_em_dash() -> None:
    spec_ids = {f"M-C{n}" for n in (*range(1, 19), 21, 22)}
    assert spec_ids <= set(COPY)
    for entry in COPY.values():
        assert "—" not in entry.text and "<" not in entry.text, entry.id
        assert re.fullmatch(r"M-[CRS]\d+", entry.id)
        assert all(re.fullmatch(r"[a-z_]+", f) for f in entry.fields), entry.id
    assert COPY["M-C1"].fields == {"host", "from_region", "to_region"}
    assert say("M-C1", host="h", from_region="ie", to_region="uk") == "Moving h from ie to uk."
    assert COPY["M-C18"].fields == {"box", "host", "flipped_at", "from_region"}
    assert "carlos" not in " ".join(c.text for c in COPY.values())


def test_say_refuses_missing_unknown_and_extra_values() -> None:
    with pytest.raises(CopyError, match="missing \\['to_region'\\]"):
        say("M-C1", host="h", from_region="ie")
    with pytest.raises(CopyError, match="unexpected \\['typo'\\]"):
        say("M-C2", host="h", typo="x")
    with pytest.raises(CopyError, match="no operator copy"):
        say("M-C99")
    assert say("M-C2", host="{host}") == "Copying data. {host} keeps serving while this runs.", "values not re-parsed"


# -- tokens (§12, M18) ----------------------------------------------------------------------------


def test_tokens_identify_by_digest_with_labels_and_roles(tmp_path: Path) -> None:
    secret, reader = "op-secret-1", "status-secret-2"
    listing = tmp_path / "tokens"
    listing.write_text(f"# operators\nbob={token_digest('op-secret-3')}\n\n")
    tokens = load_tokens({
        "HOSTMOVE_OPERATOR_TOKENS": f"alice={token_digest(secret)}, {token_digest('anon')}",
        "HOSTMOVE_OPERATOR_TOKENS_FILE": str(listing),
        "HOSTMOVE_STATUS_TOKENS": f"probe={token_digest(reader).upper()}",
    })
    alice = tokens.identify_header(f"Bearer {secret}")
    assert alice is not None and (alice.label, alice.operator) == ("alice", True)
    anon = tokens.identify("anon")
    assert anon is not None and anon.label == f"token-{token_digest('anon')[:8]}"
    bob = tokens.identify("op-secret-3")
    assert bob is not None and bob.label == "bob"
    probe = tokens.identify_header(f"bearer {reader}")
    assert probe is not None and (probe.label, probe.operator) == ("probe", False)
    for bad in (None, "", f"Basic {secret}", "Bearer", f"Bearer {secret}x", "Bearer " + "x" * 5000):
        assert tokens.identify_header(bad) is None
    assert secret not in repr(tokens) and token_digest(secret) not in repr(tokens)


def test_token_configuration_errors_name_the_place_never_the_value(tmp_path: Path) -> None:
    raw = "my-raw-token-value"
    with pytest.raises(TokenConfigError) as err:
        load_tokens({"HOSTMOVE_OPERATOR_TOKENS": raw})
    assert raw not in str(err.value) and "entry 1 of HOSTMOVE_OPERATOR_TOKENS" in str(err.value)
    with pytest.raises(TokenConfigError, match="no operator token"):
        load_tokens({"HOSTMOVE_STATUS_TOKENS": token_digest("s")})
    with pytest.raises(TokenConfigError, match="cannot be read"):
        load_tokens({"HOSTMOVE_OPERATOR_TOKENS_FILE": str(tmp_path / "absent")})
    with pytest.raises(TokenConfigError, match="twice"):
        TokenSet(parse_entries([token_digest("a"), f"x={token_digest('a')}"], "operator", "test"))
    with pytest.raises(TokenConfigError, match="label"):
        parse_entries([f"bad label={token_digest('a')}"], "operator", "test")


@given(st.text(min_size=1, max_size=40))
def test_only_the_configured_token_is_accepted(token: str) -> None:
    tokens = TokenSet.of(operators={"alice": "the-one-token"})
    assert (tokens.identify(token) is not None) == (token == "the-one-token")


# -- input ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("body, copy", [
    (b"", "M-R4"), (b"{", "M-R4"), (b"[]", "M-R4"), (b'"uk"', "M-R4"), (b"{}", "M-R6"),
    (b'{"to": "uk", "region": "uk"}', "M-R5"), (b'{"to": 7}', "M-R4"), (b'{"to": "u k"}', "M-R4"),
    (b'{"to": "uk", "cut": "now"}', "M-R7"), (b'{"to": "uk", "cut": null}', "M-R7"),
])
def test_bad_move_bodies_are_refused_with_400(body: bytes, copy: str) -> None:
    refused(parse_move_request(body), 400, copy)


def test_move_body_defaults_to_a_manual_cut() -> None:
    assert parse_move_request(b'{"to": "uk"}') == MoveRequest("uk", "manual")
    assert parse_move_request(b'{"to": "uk", "cut": "auto"}') == MoveRequest("uk", "auto")
    assert parse_create_request(b'{"box": "ie-1"}') == CreateRequest("ie-1")
    assert parse_create_request(b'{"box": "ie-1", "app": "notes", "release": 2}') == CreateRequest("ie-1", "notes", 2)
    refused(parse_create_request(b'{"box": "ie-1", "app": "Not An App"}'), 400, "M-R4")
    refused(parse_create_request(b'{"box": "ie-1", "release": 2}'), 400, "M-R4")
    refused(parse_create_request(b'{"box": "ie-1", "app": "notes", "release": 0}'), 400, "M-R4")
    refused(parse_create_request(b'{"box": ""}'), 400, "M-R4")
    refused(parse_create_request(b'{"label": "x"}'), 400, "M-R5")
    assert parse_empty(b"") is None and parse_empty(b" {} ") is None
    refused(parse_empty(b'{"force": true}'), 400, "M-R5")


def test_deep_nesting_and_duplicate_keys_are_refused_before_they_are_taken() -> None:
    """Issue 14 item 7: 30,000 levels under the 64 KiB cap is a 400 (it was a decoder's RecursionError, a 500), and
    a field named twice is refused (the decoder kept the last)."""
    deep = refused(parse_move_request(b"[" * 30_000 + b"]" * 30_000), 400, "M-R4")
    assert "30000 levels deep" in deep.reason and "flat JSON object" in deep.reason
    refused(parse_move_request(b'{"to": {"a": ' * 20 + b"1" + b"}" * 20 + b"}"), 400, "M-R4")
    assert body_depth(b'{"to": "[[[{{{", "cut": "\\"[["}') == 1, "brackets inside strings do not nest"
    twice = refused(parse_move_request(b'{"to": "uk", "to": "ie"}'), 400, "M-R4")
    assert "'to' twice" in twice.reason
    refused(parse_create_request(b'{"box": "ie-1", "box": "uk-1"}'), 400, "M-R4")
    refused(parse_empty(b'{"x": 1, "x": 2}'), 400, "M-R4")
    assert duplicate_key(b'{"a": {"b": 1, "b": 2}}') == "b" and duplicate_key(b'{"a": 1, "b": {"a": 2}}') is None


@pytest.mark.parametrize("host", ["a", "kpmg.bdn.oncarlos.com", "x-1.y-2", "a" * 63 + ".b"])
def test_host_names_that_pass(host: str) -> None:
    assert check_host(host) is None


@pytest.mark.parametrize("host", ["", "A.example.com", "a..b", "-a", "a-", "a/b", "a_b", ".", "a" * 64, "é",
                                  ("a" * 60 + ".") * 5])
def test_bad_host_names_are_refused(host: str) -> None:
    refused(check_host(host), 400, "M-R3")


# -- the move request (K2, §7.1) ------------------------------------------------------------------


def test_the_request_moves_the_claim_and_names_the_target_in_the_same_cas() -> None:
    out = request_claim(serving(), "uk", cut="auto")
    assert isinstance(out, Claim)
    assert out.op.kind == "moving" and out.op.id == MOVE_ID and out.op.phase == ""
    assert out.op.exec == "ie-1", "exec unchanged: the source"
    assert out.op.participants == ("ie-1", "uk-1")
    assert dict(out.op.intent) == {"target": "uk-1", "to": "uk", "cut": "auto", "from": "ie",
                                   "requested_by": "alice", "requested_at": NOW}
    assert out.holder == serving().holder


def test_a_retry_of_the_same_request_changes_nothing() -> None:
    moving = request_claim(serving(), "uk")
    assert isinstance(moving, Claim)
    assert isinstance(request_claim(moving, "uk"), NoChange)
    refused(request_claim(moving, "uk", cut="auto"), 409, "M-R26")
    refused(request_claim(moving, "us"), 409, "M-R26")


def test_no_host_and_a_free_claim_are_404() -> None:
    refused(request_claim(None), 404, "M-R2")
    refused(request_claim(Claim(host=HOST, gen=2)), 404, "M-R2")


@pytest.mark.parametrize("kind", ["creating", "landing", "reverting", "restoring", "pushing", "relocating",
                                  "deleting", "parking", "purging", "placing"])
def test_a_claim_that_is_not_serving_is_refused(kind: str) -> None:
    claim = msgspec.structs.replace(serving(), op=Op(kind=kind, exec="ie-1"))  # type: ignore[arg-type]
    out = refused(request_claim(claim), 409, "M-R8")
    assert kind in out.reason


def test_region_rules() -> None:
    refused(request_claim(serving(), "ie"), 400, "M-R9")
    out = refused(request_claim(serving(), "mars"), 400, "M-R10")
    assert "au, ie, uk, us" in out.reason
    refused(request_claim(serving(), "us"), 409, "M-C21")  # into a two-box region
    refused(request_claim(serving("us-1"), "uk"), 409, "M-C21")  # out of one
    refused(request_claim(serving("gone-1"), "uk"), 409, "M-R14")


def test_a_fenced_box_is_never_a_source_or_a_target_and_does_not_count_in_its_region() -> None:
    fenced_us2 = Roster(gen=2, boxes=tuple(msgspec.structs.replace(b, fenced_at=5) if b.label == "us-2" else b
                                           for b in ROSTER.boxes))
    out = request_claim(serving(), "us", roster=fenced_us2)  # us-2 is gone: us is a one-box region again
    assert isinstance(out, Claim) and out.op.participants == ("ie-1", "us-1")
    fenced_ie1 = Roster(gen=2, boxes=tuple(msgspec.structs.replace(b, fenced_at=5) if b.label == "ie-1" else b
                                           for b in ROSTER.boxes))
    out = refused(request_claim(serving(), "uk", roster=fenced_ie1), 409, "M-R34")
    assert "ie-1" in out.reason and "relocated" in out.reason
    refused(request_claim(serving("uk-1"), "ie", roster=fenced_ie1), 409, "M-R11")


def test_lost_boxes_are_not_eligible() -> None:
    lost_one = serving(lost=(LostBox(box="us-2"),))
    out = request_claim(lost_one, "us")
    assert isinstance(out, Claim) and out.op.participants == ("ie-1", "us-1")
    refused(request_claim(serving(lost=(LostBox(box="uk-1"),)), "uk"), 409, "M-R11")


def test_choose_names_the_regions_one_box() -> None:
    assert choose(ROSTER, "uk", frozenset(), HOST) == box("uk-1", "uk")
    refused(choose(Roster(gen=1), "uk", frozenset(), HOST), 400, "M-R10")


def test_protocol_floor() -> None:
    refused(request_claim(serving(), "au"), 409, "M-R12")  # absent floor: protocol 1 is the floor
    out = refused(request_claim(serving("au-1"), "uk"), 409, "M-R12")
    assert "au-1" in out.reason
    refused(request_claim(serving(), "uk", floor=Floor(min=2)), 409, "M-R13")  # the console first
    refused(request_claim(serving(), "uk", floor=Floor(min=2), console=2), 409, "M-R12")
    assert isinstance(request_claim(serving(), "uk", floor=Floor(min=1)), Claim), "au's old box is not involved"
    assert check_floor(ROSTER, ("ie", "uk"), Floor(min=1), HOST) is None


def test_floor_object_is_read_strictly() -> None:
    assert decode(b'{"min": 1, "min_release": "v1.2.3"}', Floor) == Floor(min=1, min_release="v1.2.3")
    for bad in (b'{"min": 0}', b'{"min": true}', b'{"min": 1, "extra": 1}', b"{}", b'{"min": "1"}'):
        with pytest.raises(DurableValueError):
            decode(bad, Floor)


def test_record_and_claim_preconditions_of_k2() -> None:
    live = Record(host=HOST, gen=4, move=Move(id="mv_" + "b" * 26, incarnation=INC, to="uk", state="aborted"))
    refused(request_claim(serving(), record=live), 409, "M-R15")
    other = Record(host=HOST, gen=4, extra={"incarnation": "b" * 64})
    refused(request_claim(serving(), record=other), 409, "M-R16")
    same = Record(host=HOST, gen=4, extra={"incarnation": INC},
                  last_move=LastMove(id="mv_" + "c" * 26, outcome="done"))
    assert isinstance(request_claim(serving(), record=same), Claim)
    chores = serving(obligations=(Obligation(kind="park-local", op="mv_x", region="ie", owner="ie-1"),))
    refused(request_claim(chores), 409, "M-R27")


# -- the record half ------------------------------------------------------------------------------


def moving_claim(cut: str = "manual") -> Claim:
    out = request_claim(serving(), "uk", cut=cut)
    assert isinstance(out, Claim)
    return out


def test_the_record_move_is_determined_by_the_claim() -> None:
    claim = moving_claim()
    out = decide_move_record(None, host=HOST, claim=claim, now_ms=NOW + 5)
    assert isinstance(out, Record) and out.move is not None
    m = out.move
    assert (m.id, m.incarnation, m.from_, m.to, m.cut, m.state) == (MOVE_ID, INC, "ie", "uk", "manual", "preparing")
    assert (m.requested_by, m.requested_at, m.updated_at) == ("alice", NOW, NOW + 5)
    assert m.inputs == type(m.inputs)(), "inputs empty for now"
    assert msgspec.to_builtins(m)["from"] == "ie"
    assert isinstance(decide_move_record(out, host=HOST, claim=claim, now_ms=NOW), NoChange)
    kept = Record(host=HOST, gen=2, last_move=LastMove(id="mv_" + "c" * 26, outcome="done"), extra={"k": 1})
    again = decide_move_record(kept, host=HOST, claim=claim, now_ms=NOW)
    assert isinstance(again, Record) and again.last_move == kept.last_move and again.extra == {"k": 1}


def test_the_record_half_refuses_what_it_cannot_own() -> None:
    claim = moving_claim()
    other = Record(host=HOST, gen=2, move=Move(id="mv_" + "b" * 26, incarnation=INC, to="us", state="ready"))
    refused(decide_move_record(other, host=HOST, claim=claim, now_ms=NOW), 409, "M-R15")
    refused(decide_move_record(None, host=HOST, claim=serving(), now_ms=NOW), 409, "M-R17")
    closed = Record(host=HOST, gen=2, last_move=LastMove(id=MOVE_ID, outcome="aborted"))
    assert isinstance(decide_move_record(closed, host=HOST, claim=claim, now_ms=NOW), NoChange)
    wrong = Record(host=HOST, gen=2, extra={"incarnation": "b" * 64})
    refused(decide_move_record(wrong, host=HOST, claim=claim, now_ms=NOW), 409, "M-R16")


# -- cut and abort --------------------------------------------------------------------------------


def record_in(state: str, cut_phase: str = "", cut: str = "manual") -> tuple[Record, Claim]:
    claim = moving_claim(cut)
    rec = decide_move_record(None, host=HOST, claim=claim, now_ms=NOW)
    assert isinstance(rec, Record) and rec.move is not None
    move = msgspec.structs.replace(rec.move, state=state, cut_phase=cut_phase)
    return msgspec.structs.replace(rec, move=move), claim


def cut(rec: Record | None, claim: Claim | None) -> Record | NoChange | DoorRefusal:
    return decide_cut(rec, host=HOST, claim=claim, now_ms=NOW + 9)  # type: ignore[return-value]


def abort(rec: Record | None, claim: Claim | None) -> Record | NoChange | DoorRefusal:
    return decide_abort(rec, host=HOST, claim=claim, operator="bob", now_ms=NOW + 9)  # type: ignore[return-value]


def test_manual_cut_request() -> None:
    rec, claim = record_in("ready")
    out = cut(rec, claim)
    assert isinstance(out, Record) and out.move is not None
    assert (out.move.state, out.move.cut_phase, out.move.updated_at) == ("cutting", "requested", NOW + 9)
    assert isinstance(cut(out, claim), NoChange)
    refused(cut(*record_in("preparing")), 409, "M-R20")
    refused(cut(*record_in("ready", cut="auto")), 409, "M-R21")
    refused(cut(*record_in("cutting", "admitted")), 409, "M-C13")
    refused(cut(*record_in("landing", "flipped")), 409, "M-C13")
    refused(cut(*record_in("aborted")), 409, "M-R22")
    refused(cut(None, claim), 409, "M-R19")
    refused(cut(rec, serving()), 409, "M-R28")


@pytest.mark.parametrize("state, phase", [("preparing", ""), ("ready", ""), ("cutting", "requested")])
def test_abort_is_legal_before_admitted(state: str, phase: str) -> None:
    rec, claim = record_in(state, phase)
    out = abort(rec, claim)
    assert isinstance(out, Record) and out.move is not None
    assert out.move.state == "aborted" and out.move.reason == "aborted by operator bob"
    assert out.move.id == MOVE_ID and out.move.updated_at == NOW + 9
    assert isinstance(abort(out, claim), NoChange)


@pytest.mark.parametrize("state, phase", [
    ("cutting", "admitted"), ("cutting", "stopping"), ("cutting", "archived"), ("landing", "flipped"),
    ("committed", ""), ("rolling_back", ""), ("reverting", ""), ("stuck", ""),
])
def test_abort_is_refused_from_admitted_on(state: str, phase: str) -> None:
    refused(abort(*record_in(state, phase)), 409, "M-C13")


def test_abort_revalidates_the_claim() -> None:
    rec, claim = record_in("ready")
    refused(abort(None, claim), 409, "M-R19")
    refused(abort(rec, None), 409, "M-R28")
    other = msgspec.structs.replace(claim, op=msgspec.structs.replace(claim.op, id="mv_" + "d" * 26))
    refused(abort(rec, other), 409, "M-R28")
    landing = msgspec.structs.replace(claim, op=msgspec.structs.replace(claim.op, kind="landing"))
    refused(abort(rec, landing), 409, "M-C13")


# -- status ---------------------------------------------------------------------------------------


def state_line(state: str, phase: str = "", cut: str = "manual") -> str:
    rec, claim = record_in(state, phase, cut)
    return status_line(HOST, claim, rec)[0]


def test_status_lines_follow_the_move() -> None:
    assert status_line(HOST, serving(), None)[0] == "M-S6"
    rec, claim = record_in("preparing")
    assert status_line(HOST, claim, rec) == ("M-C2", say("M-C2", host=HOST))
    assert [state_line("ready"), state_line("ready", cut="auto"), state_line("cutting", "requested"),
            state_line("cutting", "stopping"), state_line("aborted"), state_line("reverting", "stopping")] == [
        "M-C12", "M-S4", "M-S1", "M-C13", "M-S2", "M-S8"]
    landing, claim = record_in("landing", "flipped")
    assert status_line(HOST, claim, landing) == ("M-C6", "Stopped in ie. Starting in uk.")
    pinned = msgspec.structs.replace(claim, op=Op(kind="relocating", phase="pinning", intent={"from": "ie"}))
    code, line = status_line(HOST, pinned, None)
    assert code == "M-C22" and "waiting for a box in ie" in line and "nothing was lost" not in line.lower()
    done = Record(host=HOST, gen=5, last_move=LastMove(id=MOVE_ID, outcome="rolled_back"))
    assert status_line(HOST, serving("uk-1"), done) == (
        "M-S5", f"The last move of {HOST} ({MOVE_ID}) ended: rolled back.")


def test_a_rollback_past_its_release_deadline_waits_on_the_target_m_c10() -> None:
    """§7.8: until the deadline the host is moving back (M-C8); past it, with the target not yet released, the line
    says what the host waits for (M-C10), naming the target box; once released it is M-C8 again."""
    from events.record import Rollback

    rec, claim = record_in("rolling_back")
    assert rec.move is not None
    rb = Rollback(id="rb_1", reason="the target failed its probe", target_phase="releasing",
                  release_deadline=NOW + 1_000)
    rec = msgspec.structs.replace(rec, move=msgspec.structs.replace(rec.move, rollback=rb))
    assert status_line(HOST, claim, rec, now_ms=NOW)[0] == "M-C8"
    code, line = status_line(HOST, claim, rec, now_ms=NOW + 1_001)
    assert (code, line) == ("M-C10", say("M-C10", box=claim.op.participants[1], region=rec.move.to, host=HOST))
    released = msgspec.structs.replace(rb, target_phase="released")
    rec = msgspec.structs.replace(rec, move=msgspec.structs.replace(rec.move, rollback=released))
    assert status_line(HOST, claim, rec, now_ms=NOW + 1_001)[0] == "M-C8"


def test_status_detail_adds_the_journal() -> None:
    rec, claim = record_in("ready")
    short = status_view(HOST, claim, rec, detail=False)
    assert short["move"]["state"] == "ready" and short["claim"]["participants"] == ["ie-1", "uk-1"]
    assert "detail" not in short
    full = status_view(HOST, claim, rec, detail=True)
    assert full["detail"]["move"]["source"]["evidence"] == "" and "rollback" in full["detail"]["move"]
    assert full["detail"]["op"]["intent"]["target"] == "uk-1"


def test_a_refusal_quotes_an_integer_no_durable_document_may_hold() -> None:
    """Found by the schema fuzzing: a release number outside the safe integer range made the refusal itself fail
    (the quoted value went through the durable-value check), a 500 where the request deserves its 400."""
    from services.door.decide import parse_create_request

    for n in (2**90, -(2**90)):
        got = parse_create_request(b'{"box": "ie-1", "app": "notes", "release": %d}' % n)
        assert isinstance(got, DoorRefusal) and got.status == 400 and str(n) in got.reason, got
