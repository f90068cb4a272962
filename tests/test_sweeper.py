"""The at-rest straggler sweep's deciders (spec §6.4 "The straggler sweep"; services/sweeper/straggler.py).

The runner parks through :class:`~services.move.park.Parker`, whose real-store tests are in tests/test_finalize.py;
the simulation's witness ``wStraggler`` drives the whole sweep (a held upload landing in a parked location)."""

from __future__ import annotations

import msgspec

from events.claim import Admission, Claim, Holder, Obligation, Op, Scope
from services.ledger.ledger import NoChange, Refusal
from services.sweeper.straggler import (
    PARK_SWEEP,
    decide_drop_sweep,
    decide_queue_sweep,
    serving_region,
    sweep_location,
    sweep_refused,
)

HOST = "h.example.com"
INC = "a" * 64
LOCATION = f"instances/{HOST}/{INC}"
NOW = 1_800_000_000_000


def moved_to_uk(**op: object) -> Claim:
    """Served on uk-1 after a move from ie-1: the admissions name both boxes, the newest is uk-1's."""
    holder = Holder(incarnation=INC, location=LOCATION + "/", generation="mv_x", session=4, writer_box="uk-1",
                    admissions=(Admission(session=3, box="ie-1", generation="w1", region="ie"),
                                Admission(session=4, box="uk-1", generation="mv_x", region="uk")))
    return Claim(host=HOST, gen=9, holder=holder,
                 op=Op(**{"kind": "serving", "exec": "uk-1", "participants": ("uk-1",), **op}))  # type: ignore[arg-type]


def test_only_a_host_at_rest_is_swept_and_only_where_it_is_not_served() -> None:
    claim = moved_to_uk()
    assert serving_region(claim) == "uk" and sweep_location(claim) == LOCATION
    assert sweep_refused(claim, "ie") is None
    assert sweep_refused(claim, "uk") is None, "the serving region is swept too: its residue, its dead generations"
    moving = moved_to_uk(kind="moving", id="mv_y", participants=("uk-1", "ie-1"))
    assert sweep_refused(moving, "ie") == "an operation runs (moving)"
    owed = msgspec.structs.replace(claim, obligations=(Obligation(kind="park-superseded", op="mv_x", region="ie",
                                                                   owner="ie-1"),))
    assert sweep_refused(owed, "ie") == "a chore of ie is pending", "the move's own park owns the location"
    assert sweep_refused(None, "ie") == "the host has no holder"
    unplaced = msgspec.structs.replace(claim, op=msgspec.structs.replace(claim.op, exec="none"))
    assert sweep_refused(unplaced, "ie") == "no admission names the serving box's region"


def test_the_queue_persists_the_scope_once_and_rechecks_the_fresh_claim() -> None:
    claim = moved_to_uk()
    queued = decide_queue_sweep(claim, region="ie", owner="ie-1", listed_at=NOW, location=LOCATION)
    assert isinstance(queued, Claim)
    (ob,) = queued.obligations
    assert (ob.kind, ob.op, ob.region, ob.owner) == (PARK_SWEEP, f"sweep-{NOW}-0", "ie", "ie-1")
    assert ob.scope == Scope(location=LOCATION, incarnation=INC, evidence_at=NOW), \
        "evidence_at is the sweeping box's listing, never a later clock"
    again = decide_queue_sweep(queued, region="ie", owner="ie-1", listed_at=NOW + 5, location=LOCATION)
    assert isinstance(again, NoChange), "a second look never rebinds the scope"
    moving = moved_to_uk(kind="moving", id="mv_y")
    refused = decide_queue_sweep(moving, region="ie", owner="ie-1", listed_at=NOW, location=LOCATION)
    assert isinstance(refused, Refusal) and "an operation runs" in refused.reason
    other = decide_queue_sweep(claim, region="ie", owner="ie-1", listed_at=NOW, location=LOCATION + "x")
    assert isinstance(other, Refusal) and "location changed" in other.reason


def test_the_acknowledgement_drops_only_its_own_sweep_and_raises_quiet_after() -> None:
    queued = decide_queue_sweep(moved_to_uk(), region="ie", owner="ie-1", listed_at=NOW, location=LOCATION)
    assert isinstance(queued, Claim)
    dropped = decide_drop_sweep(queued, op=f"sweep-{NOW}-0", owner="ie-1", region="ie", quiet_until=NOW + 1_020_000)
    assert isinstance(dropped, Claim) and dropped.obligations == () and dropped.quiet_after == {"ie": NOW + 1_020_000}
    assert isinstance(decide_drop_sweep(dropped, op=f"sweep-{NOW}-0", owner="ie-1", region="ie", quiet_until=0),
                      NoChange)
    stale = decide_drop_sweep(queued, op="sweep-1", owner="ie-1", region="ie", quiet_until=0)
    assert isinstance(stale, NoChange) and queued.obligations, "another sweep's acknowledgement leaves it queued"
