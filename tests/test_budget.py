"""T11's arithmetic exactly as spec §7.3 states it (the worked example and the further vectors, D§5.3)."""

from __future__ import annotations

import pytest

from services.target.budget import DEFAULT_WINDOW_S, FixedOverheads, Rates, cross_region_transfer_s, t11

GIB = 1024.0
EXAMPLE = Rates(cross_region=10, regional_s3=250, disk=500)


def approx(x: float) -> object:
    return pytest.approx(x, abs=0.06)  # the spec rounds to one decimal (117.848 is "117.9")


def test_worked_example_two_gib_admits_one_attempt_by_two_seconds() -> None:
    b = t11(2 * GIB, EXAMPLE)
    assert (b.restore_s, b.snapshot_s, b.anchor_s) == (approx(12.3),) * 3
    assert b.verify_s == approx(4.1)
    assert b.mirror_s + b.other_s == approx(12.6)
    assert b.fixed_s == approx(53.6)
    assert b.attempt_costs[0] == approx(64.3)
    assert b.total_s == approx(117.9)
    assert b.attempts == 1 and b.eligible
    assert b.margin_s == approx(2.1)
    assert b.attempt_costs[1] == approx(76.6), "a second attempt would add 76.6 s"
    assert b.fixed_s + b.attempt_costs[0] + b.attempt_costs[1] == approx(194.4)


def test_cross_region_snapshot_transfer_is_refused() -> None:
    assert cross_region_transfer_s(2 * GIB, EXAMPLE) == approx(204.8)
    assert cross_region_transfer_s(2 * GIB, EXAMPLE) > DEFAULT_WINDOW_S


def test_two_and_a_half_gib_is_refused() -> None:
    b = t11(2.5 * GIB, EXAMPLE)
    assert b.fixed_s == approx(63.8) and b.attempt_costs[0] == approx(67.36)
    assert b.total_s == approx(131.16) and not b.eligible
    assert "131.2 s" in b.reason() and "120 s" in b.reason()


def test_three_gib_at_one_rate_is_refused() -> None:
    assert not t11(3 * GIB, Rates(200, 200, 200)).eligible


def test_a_tiny_database_admits_two_attempts_never_three() -> None:
    b = t11(0.001, EXAMPLE)
    assert b.attempts == 2
    assert b.fixed_s + b.attempt_costs[0] + b.attempt_costs[1] == approx(116.6)


def test_zero_size_boundary_is_68_seconds_of_fixed_costs() -> None:
    """Under rev 7.11 one 52 s attempt fits exactly when the fixed costs are 68 s (D§5.3: pin this)."""
    rates = Rates(cross_region=16, regional_s3=1, disk=1)  # mirror 1.0 s, database of 0 MiB
    at = t11(0, rates, overheads=FixedOverheads(stop_s=62.0, checkpoint_s=0, archive_s=0, render_s=0))
    assert at.fixed_s == approx(68.0) and at.attempts == 1
    over = t11(0, rates, overheads=FixedOverheads(stop_s=62.01, checkpoint_s=0, archive_s=0, render_s=0))
    assert over.attempts == 0


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(ValueError):
        Rates(0, 1, 1)
    with pytest.raises(ValueError):
        t11(-1, EXAMPLE)
