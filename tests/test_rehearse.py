"""``hostmove rehearse`` (spec §14.4; issue 13 item 6): each scenario on the real stack with the services as their own
processes (``make rehearse``, or ``HOSTMOVE_REHEARSE=1``: several minutes, the stuck one about two and a half), and
its pure parts in ``make test``: the fail switch each scenario sets, and an exit code that is 0 only when the
scenario ended as it must and every check passed."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from hostmove import exitcodes
from hostmove.rehearsal import Check
from hostmove.rehearse import SCENARIOS, Outcome, rehearse, release_env, report
from hostmove.stackinfo import StackInfo

REHEARSE = os.environ.get("HOSTMOVE_REHEARSE", "") == "1"


def test_each_scenario_sets_its_fail_switch(tmp_path: Path) -> None:
    switch = tmp_path / "switch"
    assert "MOVEPROBE_FAIL_READY_IN" not in release_env("move", "ie", "uk", None)
    for lost in ("declare-lost", "fenced-target", "fenced-target-committed"):  # §7.10: the target's agent dies
        assert "MOVEPROBE_FAIL_READY_IN" not in release_env(lost, "ie", "uk", None)
    clean, dirty = release_env("clean-rollback", "ie", "uk", None), release_env("dirty-rollback", "ie", "uk", None)
    assert (clean["MOVEPROBE_FAIL_READY_IN"], clean["MOVEPROBE_FAIL_READY_WHEN"]) == ("uk", "before-write")
    assert (dirty["MOVEPROBE_FAIL_READY_IN"], dirty["MOVEPROBE_FAIL_READY_WHEN"]) == ("uk", "after-write")
    stuck = release_env("stuck-retry", "ie", "uk", switch)
    assert (stuck["MOVEPROBE_FAIL_READY_IN"], stuck["MOVEPROBE_FAIL_READY_SWITCH"]) == ("uk,ie", str(switch))


@pytest.mark.parametrize(("scenario", "ended", "stuck", "ok"), [
    ("move", "done", False, True), ("move", "rolled_back", False, False),
    ("dirty-rollback", "rolled_back", False, True), ("stuck-retry", "rolled_back", False, False),
    ("stuck-retry", "rolled_back", True, True),
    ("declare-lost", "rolled_back", False, True), ("fenced-target", "rolled_back", False, True),
    ("fenced-target", "", False, False), ("fenced-target-committed", "done", False, True),
    ("fenced-target-committed", "rolled_back", False, False), ("fenced-target-committed", "", False, False),
    ("fenced-source", "aborted", False, True),
    ("fenced-source", "rolled_back", False, False),
])
def test_the_exit_code_is_0_only_when_the_scenario_ended_as_it_must(scenario: str, ended: str, stuck: bool,
                                                                    ok: bool) -> None:
    lines: list[str] = []
    passed = Outcome(scenario, "h", "mv", ended, stuck, ["prepare 1 s"], [Check("c", True, "fine")])
    assert report(passed, lines.append) == (exitcodes.OK if ok else exitcodes.FAILED)
    assert lines[-1].endswith("passed" if ok else "FAILED")
    failed = Outcome(scenario, "h", "mv", ended, stuck, [], [Check("c", True, ""), Check("d", False, "no")])
    assert report(failed, lines.append) == exitcodes.FAILED


@pytest.mark.skipif(not REHEARSE, reason="the rehearsals run in `make rehearse` (HOSTMOVE_REHEARSE=1)")
@pytest.mark.timeout(900)
@pytest.mark.asyncio(loop_scope="session")
@pytest.mark.parametrize("scenario", SCENARIOS)
async def test_a_rehearsal_ends_as_its_scenario_must(stack: StackInfo, unique: Callable[[str], str], tmp_path: Path,
                                                     scenario: str) -> None:
    from hostmove.runtime import open_runtime, settings_from_stack
    from services.box.deployment import init_deployment
    from services.box.roster import init_box
    from services.objstore.s3 import S3Store

    bucket = unique("rehearse")
    store = await S3Store.open(stack.s3_endpoint, stack.s3_access_key, stack.s3_secret_key, stack.s3_region)
    await store.create_bucket(bucket, versioned=True)
    await store.close()
    rt = await open_runtime(settings_from_stack(stack, root=tmp_path, bucket=bucket), "rehearse-test", probe=False)
    try:
        await init_deployment(root=tmp_path, store=rt.store, bucket=bucket, clock=rt.clock)
        ie, uk = [await init_box(root=tmp_path, label=unique(region), region=region, store=rt.store, bucket=bucket,
                                 events=rt.events, clock=rt.clock, actor=rt.actor) for region in ("ie", "uk")]
        lines: list[str] = []
        shown = await rehearse(rt, stack, ie, uk, scenario, lines.append)
        code = report(shown, lines.append)
        assert code == exitcodes.OK, "\n".join(lines)
    finally:
        await rt.close()


def test_a_once_timer_of_a_session_declared_lost_may_be_lost_or_run_once_again_never_more(
        tmp_path: Path) -> None:
    """``timers_once`` (the rehearsals' check): the once-timer runs exactly once, but a run acknowledged in a
    session declared lost may be gone (0 runs) or run again in the next session (2); a third run, or a repeat of a
    run no lost session holds, stays a failure."""
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from hostmove.rehearsal import ONCE_TIMER, timers_once

    body: dict[str, object] = {}

    class Runs(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Runs)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    once = {"name": ONCE_TIMER, "due_at_ms": 1_000, "received_at_ms": 1_001}
    lost = frozenset({(ONCE_TIMER, 1_000)})
    try:
        for runs, lost_runs, ok in (([once], frozenset(), True), ([once, once], frozenset(), False),
                                    ([], lost, True), ([once, once], lost, True), ([once] * 3, lost, False),
                                    ([], frozenset(), False)):
            body = {"runs": runs, "repeats": []}
            got = timers_once(port, cut_at_ms=None, now_ms=2_000, once_due_ms=1_000, lost_runs=lost_runs)
            assert got.ok is ok, (len(runs), lost_runs, got)
    finally:
        server.shutdown()
