"""The source box's cut slots (issue 19 item 7(b); spec §7.4: the cut window is per host), pure: a cut beyond the
box's slots waits, its host serving; a slot frees when its cut opens or ends, or after the budgets ran out."""

from __future__ import annotations

import msgspec
import pytest

from events.record import Move, Record
from services.agent.service import FAST_AGENT, cut_slots_override
from services.agent.service import prepare_slots_override as agent_prepare_slots
from services.ledger.ledger import NoChange
from services.source.cutslots import (
    DEFAULT_PREPARE_SLOTS,
    PREPARE_BUSY,
    PREPARE_SLOTS_ENV,
    Slots,
    prepare_slots_override,
    slots_override,
)
from services.source.preparing import decide_waiting


def test_a_cut_beyond_the_slots_waits_until_one_frees() -> None:
    slots = Slots(2, stale_ms=10_000)
    assert slots.take("a", 0) is None and slots.take("b", 0) is None
    why = slots.take("c", 5)
    assert why is not None and "2 cuts already" in why and "keeps serving" in why
    assert slots.take("a", 6) is None, "a cut that holds its slot is admitted again (a replayed admission)"
    assert slots.release("a") == ("c",), "a freed slot names the cut waiting for it, to be woken"
    assert slots.release("a") == (), "releasing what holds no slot wakes nobody"
    assert slots.take("c", 7) is None
    assert slots.take("a", 8) is not None, "released, the slot went to the waiting cut"
    assert slots.release("b") == ("a",) and slots.take("a", 9) is None
    assert slots.release("c") == (), "nobody waits any more"


def test_a_restarted_box_holds_the_slots_of_the_cuts_in_flight_and_gives_up_stale_ones() -> None:
    slots = Slots(1, stale_ms=1_000)
    slots.hold("landing", 0)  # a pass found this cut in flight after a restart
    assert slots.take("next", 500) is not None
    assert slots.take("next", 1_001) is None, "past the cut's and the landing's budgets the slot is given up"


def test_the_setting_is_a_positive_whole_number() -> None:
    assert slots_override(None) == slots_override("") == Slots().slots
    assert slots_override("3") == 3
    for bad in ("0", "-1", "two", "1.5"):
        with pytest.raises(ValueError, match="HOSTMOVE_CUT_SLOTS must be a positive whole number"):
            slots_override(bad)
    assert cut_slots_override(FAST_AGENT, "6").move.cut_slots == 6
    assert cut_slots_override(FAST_AGENT, None) == FAST_AGENT


def test_preparing_slots_say_why_a_move_waits_in_the_operators_words() -> None:
    slots = Slots(1, stale_ms=120_000, busy=PREPARE_BUSY, env=PREPARE_SLOTS_ENV)
    assert slots.take("a", 0) is None
    why = slots.take("b", 1)
    assert why is not None and "stages 1 moves already, at most 1" in why and PREPARE_SLOTS_ENV in why
    assert "keeps serving" in why
    assert slots.release("a") == ("b",) and slots.take("b", 2) is None
    assert prepare_slots_override(None) == DEFAULT_PREPARE_SLOTS and prepare_slots_override("2") == 2
    with pytest.raises(ValueError, match="HOSTMOVE_PREPARE_SLOTS must be a positive whole number"):
        prepare_slots_override("0")
    assert agent_prepare_slots(FAST_AGENT, "3").move.prepare_slots == 3


def test_a_waiting_move_writes_its_reason_once_and_only_while_preparing() -> None:
    move = Move(id="mv_" + "a" * 26, incarnation="ab" * 32, to="uk", state="preparing")
    record = Record(host="h.example.com", gen=1, move=move)
    out = decide_waiting(record, move.id, move.incarnation, "waits for a slot", 5)
    assert isinstance(out, Record) and out.move is not None and out.move.reason == "waits for a slot"
    assert out.move.updated_at == 5
    assert isinstance(decide_waiting(out, move.id, move.incarnation, "waits for a slot", 6), NoChange)
    ready = msgspec.structs.replace(record, move=msgspec.structs.replace(move, state="ready"))
    assert isinstance(decide_waiting(ready, move.id, move.incarnation, "waits", 7), NoChange)
    assert isinstance(decide_waiting(record, "mv_" + "b" * 26, move.incarnation, "waits", 7), NoChange)
    assert isinstance(decide_waiting(None, move.id, move.incarnation, "waits", 7), NoChange)
