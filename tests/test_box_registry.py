"""The box registry on a real SQLite file: holds, the conditional exit and reconcile (spec §5.2, §9.6)."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from events.claim import Claim, Holder, Op, OpKind
from kernel.ports import ManualClock
from services.box.instance.registry import (
    HOLD_STATUSES,
    LEAVE_HOLD_SQL,
    Keep,
    Mint,
    OpenStaleHold,
    Registry,
    RegistryError,
    RouteRow,
    held_status_for,
    holds_move_op,
    leaves_hold,
    reconcile_route,
)

HOST = "shop.example.app"
INC = "ab" * 32
MV = "mv_" + "a" * 26
MV2 = "mv_" + "b" * 26
RB = "rb_" + "c" * 26
SRC, TGT, OTHER = "box-us-1", "box-uk-1", "box-de-1"


def claim(kind: OpKind = "serving", *, phase: str = "", op_id: str = "", exec_: str = SRC,
          participants: tuple[str, ...] = ()) -> Claim:
    return Claim(
        host=HOST,
        gen=7,
        holder=Holder(incarnation=INC, location=f"instances/{HOST}/{INC}", stamp=5),
        op=Op(kind=kind, id=op_id, phase=phase, exec=exec_, participants=participants),
    )


@pytest.fixture
def reg(tmp_path: Path) -> Iterator[Registry]:
    r = Registry.open(tmp_path, ManualClock())
    yield r
    r.close()


def test_leave_hold_matches_only_the_holding_op(reg: Registry, tmp_path: Path) -> None:
    assert reg.insert(RouteRow(host=HOST, incarnation=INC))
    assert reg.hold(HOST, "moving", MV)
    before = reg.get(HOST)
    assert before is not None and before.status == "moving" and before.hold_op == MV

    assert not reg.leave_hold(HOST, MV2), "a stale op must match nothing"
    assert reg.get(HOST) == before

    assert reg.leave_hold(HOST, MV)
    after = reg.get(HOST)
    assert after is not None and (after.status, after.hold_op) == ("ready", "")

    # A new operation holds the row; the finished one's late exit changes nothing.
    assert reg.hold(HOST, "moving", MV2)
    assert not reg.leave_hold(HOST, MV)
    row = reg.get(HOST)
    assert row is not None and (row.status, row.hold_op) == ("moving", MV2)

    # Another process on the box sees the same file.
    other = Registry.open(tmp_path, ManualClock())
    try:
        seen = other.get(HOST)
        assert seen is not None and seen.hold_op == MV2
    finally:
        other.close()


def test_the_exit_is_the_spec_statement() -> None:
    assert LEAVE_HOLD_SQL == "UPDATE routes SET status='ready', hold_op='' WHERE host=? AND hold_op=?"
    held = RouteRow(host=HOST, status="landing", hold_op=MV)
    assert leaves_hold(held, MV) and not leaves_hold(held, MV2) and not leaves_hold(None, MV)


def test_nothing_else_opens_a_hold(reg: Registry) -> None:
    assert reg.hold(HOST, "landing", MV)
    assert not reg.set_status(HOST, "ready")
    assert not reg.set_status(HOST, "failed")
    row = reg.get(HOST)
    assert row is not None and (row.status, row.hold_op) == ("landing", MV)
    with pytest.raises(RegistryError):
        reg.set_status(HOST, "moving")  # type: ignore[arg-type]
    with pytest.raises(RegistryError):
        reg.leave_hold(HOST, "")
    # The table itself refuses a hold without its op, or an op on an open row.
    with pytest.raises(sqlite3.IntegrityError):
        reg.conn.execute("UPDATE routes SET hold_op='' WHERE host=?", (HOST,))
    with pytest.raises(sqlite3.IntegrityError):
        reg.conn.execute("INSERT INTO routes (host, status, hold_op) VALUES ('x.example', 'ready', ?)", (MV,))
    with pytest.raises(sqlite3.IntegrityError):
        reg.conn.execute("INSERT INTO routes (host, status) VALUES ('y.example', 'asleep')")
    with pytest.raises(RegistryError):
        reg.insert(RouteRow(host="z.example", status="moving"))


def test_entering_a_hold_is_conditional_too(reg: Registry) -> None:
    assert reg.insert(RouteRow(host=HOST, incarnation=INC))
    assert reg.hold(HOST, "moving", MV)
    assert reg.hold(HOST, "moving", MV), "a replay of the same hold is harmless"
    assert not reg.hold(HOST, "restoring", RB), "a hold over another op's hold needs replaces="
    assert reg.hold(HOST, "restoring", RB, replaces=MV)
    row = reg.get(HOST)
    assert row is not None and (row.status, row.hold_op) == ("restoring", RB)
    # A late write of the finished move cannot take the row back.
    assert not reg.hold(HOST, "moving", MV)
    assert not reg.delete_held(HOST, MV)
    assert reg.delete_held(HOST, RB)
    assert reg.get(HOST) is None
    # An absent row is created held only when the caller expects no hold.
    assert not reg.hold(HOST, "releasing", RB, replaces=MV)
    assert reg.hold(HOST, "landing", MV)
    assert reg.set_carried(HOST, replication="stream", next_due=1234)
    row = reg.get(HOST)
    assert row is not None and (row.status, row.replication, row.next_due) == ("landing", "stream", 1234)


def test_reconcile_mints_held_rows_for_participants() -> None:
    landing = claim("landing", phase="checking", op_id=MV, exec_=TGT, participants=(SRC, TGT))
    assert reconcile_route(landing, TGT, None) == Mint(
        RouteRow(host=HOST, incarnation=INC, status="landing", hold_op=MV)
    )
    assert reconcile_route(landing, SRC, None) == Mint(
        RouteRow(host=HOST, incarnation=INC, status="moving", hold_op=MV)
    )
    assert isinstance(reconcile_route(landing, OTHER, None), Keep)

    reverting = claim("reverting", op_id=MV, exec_=SRC, participants=(SRC, TGT))
    assert reconcile_route(reverting, SRC, None) == Mint(
        RouteRow(host=HOST, incarnation=INC, status="restoring", hold_op=MV)
    )
    assert isinstance(reconcile_route(reverting, TGT, None), Keep)

    restoring = claim("restoring", op_id=MV, exec_=TGT, participants=(SRC, TGT))
    assert isinstance(reconcile_route(restoring, TGT, None), Keep), "no rollback id, no mint"
    assert reconcile_route(restoring, TGT, None, rollback_id=RB) == Mint(
        RouteRow(host=HOST, incarnation=INC, status="releasing", hold_op=RB)
    )
    assert reconcile_route(restoring, SRC, None, rollback_id=RB) == Mint(
        RouteRow(host=HOST, incarnation=INC, status="restoring", hold_op=RB)
    )
    # After its finalization the box minted nothing back (the worker deleted the row).
    assert isinstance(reconcile_route(restoring, TGT, None, rollback_id=RB, installation_retired=True), Keep)

    # The record's reproduced columns are carried; identity and hold come from the claim.
    base = RouteRow(host="ignored", app="shop", account="acme", region="uk", status="ready", incarnation="x")
    minted = reconcile_route(landing, TGT, None, base=base)
    assert minted == Mint(RouteRow(host=HOST, app="shop", account="acme", region="uk", status="landing",
                                   hold_op=MV, incarnation=INC))


def test_reconcile_after_commit_and_when_serving() -> None:
    committed = claim("landing", phase="committed", op_id=MV, exec_=TGT, participants=(SRC, TGT))
    assert not holds_move_op(committed)
    assert reconcile_route(committed, TGT, None) == Mint(RouteRow(host=HOST, incarnation=INC, status="ready"))
    assert isinstance(reconcile_route(committed, SRC, None), Keep)

    serving = claim("serving", exec_=SRC)
    assert reconcile_route(serving, SRC, None) == Mint(RouteRow(host=HOST, incarnation=INC, status="ready"))
    assert isinstance(reconcile_route(serving, TGT, None), Keep)
    stale = RouteRow(host=HOST, incarnation=INC, status="moving", hold_op=MV)
    assert reconcile_route(serving, SRC, stale) == OpenStaleHold(HOST, MV)
    assert isinstance(reconcile_route(None, SRC, None), Keep)


def test_stale_hold_open_runs_the_conditional_statement(reg: Registry) -> None:
    serving = claim("serving", exec_=SRC)
    reg.hold(HOST, "moving", MV, incarnation=INC)
    decision = reconcile_route(serving, SRC, reg.get(HOST))
    assert decision == OpenStaleHold(HOST, MV)
    # Before it runs, a new operation holds the row: the decision made on the old read opens nothing.
    assert reg.hold(HOST, "moving", MV2, replaces=MV)
    assert not reg.apply(decision)
    row = reg.get(HOST)
    assert row is not None and row.hold_op == MV2


def test_mint_never_overwrites_a_row(reg: Registry) -> None:
    reg.insert(RouteRow(host=HOST, incarnation=INC, status="ready", region="us"))
    landing = claim("landing", phase="checking", op_id=MV, exec_=TGT, participants=(SRC, TGT))
    decision = reconcile_route(landing, TGT, None)  # decided on a read that saw no row
    assert not reg.apply(decision)
    row = reg.get(HOST)
    assert row is not None and (row.status, row.region) == ("ready", "us")
    # On a fresh read the participant's existing row is simply kept.
    assert isinstance(reconcile_route(landing, TGT, row), Keep)


KINDS: list[OpKind] = ["free", "creating", "serving", "moving", "landing", "reverting", "restoring", "pushing",
                       "relocating", "deleting", "parking", "purging", "placing"]
PHASES = ["", "sealed", "checking", "parking", "building", "probing", "committed", "pinning"]
BOXES = [SRC, TGT, OTHER, "none"]


@settings(max_examples=400, deadline=None)
@given(
    kind=st.sampled_from(KINDS),
    phase=st.sampled_from(PHASES),
    exec_=st.sampled_from(BOXES),
    participants=st.lists(st.sampled_from([SRC, TGT, OTHER]), min_size=0, max_size=2, unique=True),
    box=st.sampled_from([SRC, TGT, OTHER]),
    rollback=st.sampled_from(["", RB]),
    retired=st.booleans(),
    current=st.sampled_from(
        [None, RouteRow(host=HOST, incarnation=INC, status="ready"),
         RouteRow(host=HOST, incarnation=INC, status="moving", hold_op=MV),
         RouteRow(host=HOST, incarnation=INC, status="failed")]
    ),
)
def test_reconcile_never_mints_ready_under_a_move_op(
    kind: OpKind, phase: str, exec_: str, participants: list[str], box: str, rollback: str, retired: bool,
    current: RouteRow | None,
) -> None:
    c = claim(kind, phase=phase, op_id=MV if kind != "serving" else "", exec_=exec_, participants=tuple(participants))
    decision = reconcile_route(c, box, current, rollback_id=rollback, installation_retired=retired)
    if holds_move_op(c):
        assert not isinstance(decision, OpenStaleHold), "no hold is opened while a move op holds the claim"
        if isinstance(decision, Mint):
            assert decision.row.status in HOLD_STATUSES and decision.row.hold_op in (MV, RB)
            assert box in participants and current is None and not retired
            assert (decision.row.status, decision.row.hold_op) == held_status_for(c, box, rollback_id=rollback)
    if isinstance(decision, Mint):
        assert current is None, "reconcile only mints absent rows"
        assert decision.row.held == (decision.row.hold_op != "")
