"""The source box's cut slots (issue 19 item 7(b); spec §7.4: the cut window is per host), pure: a cut beyond the
box's slots waits, its host serving; a slot frees when its cut opens or ends, or after the budgets ran out."""

from __future__ import annotations

import pytest

from services.agent.service import FAST_AGENT, cut_slots_override
from services.source.cutslots import CutSlots, slots_override


def test_a_cut_beyond_the_slots_waits_until_one_frees() -> None:
    slots = CutSlots(2, stale_ms=10_000)
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
    slots = CutSlots(1, stale_ms=1_000)
    slots.hold("landing", 0)  # a pass found this cut in flight after a restart
    assert slots.take("next", 500) is not None
    assert slots.take("next", 1_001) is None, "past the cut's and the landing's budgets the slot is given up"


def test_the_setting_is_a_positive_whole_number() -> None:
    assert slots_override(None) == slots_override("") == CutSlots().slots
    assert slots_override("3") == 3
    for bad in ("0", "-1", "two", "1.5"):
        with pytest.raises(ValueError, match="HOSTMOVE_CUT_SLOTS must be a positive whole number"):
            slots_override(bad)
    assert cut_slots_override(FAST_AGENT, "6").move.cut_slots == 6
    assert cut_slots_override(FAST_AGENT, None) == FAST_AGENT
