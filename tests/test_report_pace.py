"""The target's readiness report's pace (§7.3; :func:`services.target.readiness.report_again_in`): pure."""

from __future__ import annotations

from services.target.readiness import report_again_in


def test_a_failing_report_backs_off_to_the_period_and_a_passing_one_repeats_at_it() -> None:
    paces, last = [], None
    for _ in range(6):
        last = report_again_in(False, last, poll_s=0.2, every_s=2.0)
        paces.append(last)
    assert paces == [0.2, 0.4, 0.8, 1.6, 2.0, 2.0]
    assert report_again_in(True, 0.4, poll_s=0.2, every_s=2.0) == 2.0
    assert report_again_in(False, 2.0, poll_s=0.2, every_s=2.0) == 2.0  # a report failing again stays paced


def test_a_poll_longer_than_the_period_is_never_shortened() -> None:
    assert report_again_in(True, None, poll_s=5.0, every_s=2.0) == 5.0
    assert report_again_in(False, None, poll_s=5.0, every_s=2.0) == 5.0
    assert report_again_in(False, 5.0, poll_s=5.0, every_s=2.0) == 5.0
