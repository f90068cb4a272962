"""Two liveness mends found by the simulation once the box agents woke on work notices (issue 19 item 1):

- a ``park-generation`` chore owed by a box the claim lists as lost is adopted by a live box of its region in one
  CAS (§7.10, K8: only its owner acknowledges a chore, and the lost box never runs again): move seed 296 left one
  overdue for good;
- a stop waits for its instance's sync loop at most ``LOOP_END_S``, then cancels the round: a request stalled after
  signing held a cut's stop past its deadline (move seeds 219, 293)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from events.claim import Claim, Holder, LostBox, Obligation, Op, Scope
from services.box.instance import instances as instances_mod
from services.box.instance.coverage import decide_adopt_chore, lost_owner_chores
from services.box.instance.instances import Instance, Instances
from services.ledger.ledger import NoChange, Refusal


def _chore(owner: str, region: str = "ie") -> Obligation:
    return Obligation(kind="park-generation", op="session:4", region=region, owner=owner, generation="wdead",
                      scope=Scope(location="instances/h/x", incarnation="x", evidence_at=1_000))


def _claim(*obligations: Obligation, lost: tuple[str, ...] = ("ie-1",)) -> Claim:
    return Claim(host="h", gen=7, holder=Holder(incarnation="x", location="instances/h/x"),
                 op=Op(kind="serving", exec="uk-1"), obligations=obligations,
                 lost=tuple(LostBox(box=b, fence=f"control/box-fences/{b}.json") for b in lost))


def test_a_lost_box_s_chore_is_adopted_by_a_live_box_of_its_region() -> None:
    dead, live_uk = _chore("ie-1"), _chore("uk-1", "uk")
    claim = _claim(dead, live_uk)
    assert lost_owner_chores(claim, "ie") == [dead]
    assert lost_owner_chores(claim, "uk") == []  # a live owner's chore is its own
    assert lost_owner_chores(_claim(dead, lost=()), "ie") == []  # an owner not lost keeps it
    adopted = decide_adopt_chore(claim, dead, "ie-2")
    assert isinstance(adopted, Claim)
    mine = [o for o in adopted.obligations if o.region == "ie"]
    assert len(mine) == 1 and mine[0].owner == "ie-2" and mine[0].scope == dead.scope  # evidence time kept
    assert live_uk in adopted.obligations and adopted.lost == claim.lost
    assert isinstance(decide_adopt_chore(adopted, dead, "ie-3"), NoChange)  # adopted meanwhile: nothing twice
    assert isinstance(decide_adopt_chore(_claim(dead, lost=()), dead, "ie-2"), Refusal)
    assert isinstance(decide_adopt_chore(None, dead, "ie-2"), Refusal)


class _Replicator:
    """What a stop's final sync uses of a replicator."""

    def __init__(self, db: Path) -> None:
        self.db_path = db
        self.scope = type("Scope", (), {"generation": "wg"})()
        self.pending: list[Any] = []
        self.closed = False

    async def sync(self) -> None:
        return None

    async def checkpoint(self, _mode: str) -> None:
        return None

    async def close(self) -> None:
        self.closed = True


@pytest.mark.asyncio
async def test_a_stop_cancels_a_sync_round_that_does_not_end(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(instances_mod, "LOOP_END_S", 0.2)
    stalled = asyncio.get_running_loop().create_future()  # a round's request that never answers

    async def loop() -> None:
        await stalled  # never looks at the stop event

    rep = _Replicator(tmp_path / "h.db")
    registry = Instances()
    instance = Instance(host="h", port=1, session=3, generation="wg", location="l", replicator=rep,  # type: ignore[arg-type]
                        origin="wake")
    instance.task = asyncio.ensure_future(loop())
    registry.enter(instance)
    clean = await asyncio.wait_for(registry.stop("h"), 5)
    assert instance.task.cancelled(), "the stalled round was cancelled"
    assert clean and rep.closed and "h" not in registry  # the final sync ran and the instance left
