"""``hostmove demo`` beside what a deployment already holds, and twice in a row (issue 11 item 6).

The pure choice of the demo's boxes (:func:`hostmove.demo.plan_boxes`), then the demo itself as the operator runs
it: a real OS process on its own embedded stack, run twice, and once more after another box joined ``ie`` (a
region no move may enter or leave while it holds two boxes, M-C21).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hostmove.demo import plan_boxes
from hostmove.stack import stack_down
from services.box.roster import MOVES_PROTOCOL, Roster, RosterBox


def box(label: str, region: str, fenced: bool = False) -> RosterBox:
    return RosterBox(label=label, region=region, moves_protocol=MOVES_PROTOCOL, secrets_key_fp="sha256:x",
                     registered_at=1, fenced_at=2 if fenced else None)


def roster(*boxes: RosterBox) -> Roster:
    return Roster(gen=1, boxes=tuple(boxes))


def test_a_fresh_deployment_gets_ie_1_and_uk_1(tmp_path: Path) -> None:
    choice = plan_boxes(None, tmp_path, set())
    assert choice.boxes == [("ie-1", "ie", False), ("uk-1", "uk", False)] and not choice.passed


def test_the_demo_reuses_a_regions_one_box_and_passes_over_what_it_cannot_use(tmp_path: Path) -> None:
    again = plan_boxes(roster(box("ie-1", "ie"), box("uk-1", "uk")), tmp_path, set())
    assert again.boxes == [("ie-1", "ie", True), ("uk-1", "uk", True)], "a second run reuses the first run's boxes"

    two = plan_boxes(roster(box("ie-1", "ie"), box("ie-2", "ie"), box("uk-1", "uk")), tmp_path, set())
    assert two.boxes == [("uk-1", "uk", True), ("fr-1", "fr", False)]
    assert two.passed == ["ie has 2 boxes (ie-1, ie-2), and a move into or out of a region with more than one box "
                          "is refused"]

    fenced = plan_boxes(roster(box("ie-1", "ie", fenced=True), box("uk-7", "uk")), tmp_path, set())
    assert fenced.boxes == [("ie-2", "ie", False), ("uk-7", "uk", True)], "a fenced label never comes back"

    busy = plan_boxes(roster(box("ie-1", "ie"), box("uk-1", "uk")), tmp_path, {"ie-1"})
    assert busy.boxes == [("uk-1", "uk", True), ("fr-1", "fr", False)]
    assert "box ie-1 has an agent running already" in busy.passed[0]

    (tmp_path / "boxes" / "uk-1").mkdir(parents=True)
    (tmp_path / "boxes" / "uk-1" / "box.json").write_text(json.dumps({"label": "uk-1", "region": "gb"}))
    taken = plan_boxes(None, tmp_path, set())
    assert taken.boxes == [("ie-1", "ie", False), ("fr-1", "fr", False)] and "belongs to another box" in taken.passed[0]


def clean_env() -> dict[str, str]:
    """The environment without any HOSTMOVE_ setting: the demo's own embedded stack under its --root."""
    return {k: v for k, v in os.environ.items() if not k.startswith("HOSTMOVE_")}


def demo(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "hostmove.cli", "--root", str(root), "demo"], env=clean_env(),
                          capture_output=True, text=True, timeout=600)


@pytest.mark.timeout(900)  # three demos, each with its own stack: about 3 minutes alone, far longer on a loaded machine
def test_the_demo_runs_twice_and_beside_another_box(tmp_path: Path) -> None:
    root = tmp_path / "hm"
    try:
        first = demo(root)
        assert first.returncode == 0, first.stdout + first.stderr
        assert "moves from ie-1 to uk-1" in first.stdout
        second = demo(root)
        assert second.returncode == 0, second.stdout + second.stderr
        assert "ie-1 in ie (already in the roster: reused)" in second.stdout
        audited = [ln.split()[3] for out in (first, second) for ln in out.stdout.splitlines()
                   if ln.startswith("7. Audit of ")]
        assert len(audited) == len(set(audited)) == 2, "each run moved a host of its own"
        joined = subprocess.run([sys.executable, "-m", "hostmove.cli", "--root", str(root), "box", "init", "--label",
                                 "ie-2", "--region", "ie"], env=clean_env(), capture_output=True, text=True,
                                timeout=120)
        assert joined.returncode == 0, joined.stderr
        third = demo(root)
        assert third.returncode == 0, third.stdout + third.stderr
        assert "passed over ie has 2 boxes (ie-1, ie-2)" in third.stdout
        assert "moves from uk-1 to fr-1" in third.stdout
    finally:
        stack_down(root)
