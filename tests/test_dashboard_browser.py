"""The dashboard in a real browser during a real move (issue 20, "How it is shown"): Debian's headless chromium,
driven by playwright (no browser download), watches ``/`` while a host moves ie -> uk between two agent processes.

- the host's row changes phase live, without a reload (the page follows the change feed, SSE);
- the live move's timeline shows the cut and the offline window, and the host page shows the closed move's;
- an alert appears when the test provokes one (a claim written outside the ledger: the agents' scan raises
  ``bad-object``);
- axe-core, run in the same page, finds no violation on the fleet view or the host page.

Screenshots are kept under the test's tmp dir. Without ``/usr/bin/chromium`` (``make browser`` installs it as root)
the test is skipped, saying so.
"""

from __future__ import annotations

import asyncio
import os
import shutil
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from aiohttp.test_utils import TestServer

from bus.nats_log import NatsEventLog
from events import Actor
from events.ids import new_incarnation
from hostmove.stackinfo import StackInfo
from kernel.ports import SystemRandom, WallClock
from projections.api import make_app as projection_app
from projections.console import Access, Console
from projections.runner import Projector
from projections.store import ProjectionStore
from services.agent.service import read_endpoint
from services.door.api import Door
from services.door.auth import Identity
from services.door.decide import MoveRequest
from services.hosts.create import create_host
from services.ledger import Committed, Ledger
from services.ledger.movelog import MoveLog
from services.objstore.s3 import S3Store
from tests.helpers.agents import AgentWorld, agent_world, answers_ready, data_buckets, eventually

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"


@pytest.fixture(autouse=True)
def chromium() -> None:
    """The project installs Debian's chromium (``make browser``, a prerequisite of ``make test``): missing, the
    test fails rather than skips, since a skipped browser test proves nothing."""
    assert os.path.exists(CHROMIUM), "no chromium: `make browser` (as root) installs Debian's"

OBSERVER = """() => {
  window.__marker = "no reload";
  window.__phases = []; window.__timings = [];
  const seen = () => {
    const row = document.querySelector(`tr[data-host="${window.__host}"] td.phase`);
    const phase = row ? row.textContent : "";
    if (phase && window.__phases[window.__phases.length - 1] !== phase) { window.__phases.push(phase); }
    for (const tr of document.querySelectorAll("section.move tr[data-timing]")) {
      const text = tr.getAttribute("data-timing") + ":" + tr.querySelector(".elapsed").textContent;
      if (window.__timings[window.__timings.length - 1] !== text) { window.__timings.push(text); }
    }
  };
  seen();
  new MutationObserver(seen).observe(document.getElementById("main"), {childList: true, subtree: true});
  window.__said = [];
  const live = document.getElementById("live");
  new MutationObserver(() => window.__said.push(live.textContent)).observe(live, {childList: true, subtree: true,
                                                                                 characterData: true});
}"""


@pytest_asyncio.fixture(loop_scope="session", scope="module")
async def shared(stack: StackInfo, unique: Callable[[str], str]) -> AsyncIterator[tuple[S3Store, NatsEventLog, str]]:
    async with data_buckets(stack, unique, "dash") as s:
        yield s


async def _closed(w: AgentWorld, host: str, move_id: str) -> bool:
    record = (await w.ledger.read_record(host)).state
    return record is not None and record.last_move is not None and record.last_move.id == move_id


async def axe_clean(page: Any, what: str) -> None:
    from axe_playwright_python.async_playwright import Axe

    results = await Axe().run(page)
    assert results.violations_count == 0, f"{what}: {results.generate_report()}"


@pytest.mark.asyncio(loop_scope="session")
async def test_the_dashboard_follows_a_real_move_live(stack: StackInfo, unique: Callable[[str], str],
                                                       shared: tuple[S3Store, NatsEventLog, str],
                                                       tmp_path: Path) -> None:
    from playwright.async_api import async_playwright

    store, events, prefix = shared
    shots = tmp_path / "screenshots"
    shots.mkdir()
    async with agent_world(stack, unique, tmp_path, prefix, store=store, events=events,
                           app_env={"MOVEPROBE_INTERVAL_S": "0.2"}) as w:
        clock = WallClock()
        ledger = Ledger(store, events, clock, Actor(service="door", pid=os.getpid(), nonce="dash"), w.deploy,
                        movelog=MoveLog(store, w.deploy))
        proj = ProjectionStore.open(tmp_path / "proj", rng=SystemRandom(), clock=clock)
        projector = Projector(proj, events, clock=clock, poll_interval=0.1)
        app = projection_app(proj, clock=clock, projector=projector, poll_interval=0.1,
                             console=Console(store, w.deploy, events, Access(open=True)))
        host = f"{unique('dash')}.example.com"
        created = await create_host(ledger, host, box=w.labels["ie"], region="ie",
                                    incarnation=new_incarnation(SystemRandom()))
        assert isinstance(created, Committed), created

        async def serving(region: str) -> int | None:
            port = read_endpoint(w.box_dir(region), host)
            return port if port is not None and await asyncio.to_thread(answers_ready, port) else None

        await eventually(lambda: serving("ie"), f"{host} served in ie", 60)
        async with TestServer(app) as server, async_playwright() as pw:
            base = str(server.make_url("")).rstrip("/")
            browser = await pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
            try:
                page = await browser.new_page(viewport={"width": 1280, "height": 1000})
                await page.goto(base + "/")
                row = page.locator(f'tr[data-host="{host}"]')
                await row.wait_for(timeout=30_000)
                assert await row.locator("td.state").text_content() == "serving"
                await page.evaluate(f"window.__host = {host!r}")
                await page.evaluate(OBSERVER)
                await page.wait_for_function("document.getElementById('live').textContent.startsWith('Live')",
                                             timeout=15_000)
                await page.screenshot(path=str(shots / "1-before.png"), full_page=True)
                await axe_clean(page, "the fleet view")

                door = Door(ledger, clock=clock, rng=SystemRandom())
                answer = await door.request_move(host, MoveRequest("uk", "auto"), Identity("op", "operator"))
                assert answer.status in (200, 201), answer.body
                move_id = str(answer.body["move"]["id"])
                bad = f"{unique('bad')}.example.com"
                await store.put(w.deploy, f"control/hosts/{bad}.json", b"{not json")  # outside the ledger

                await page.wait_for_selector(f'section.move[data-move="{move_id}"]', timeout=30_000)
                await page.screenshot(path=str(shots / "2-moving.png"), full_page=True)

                await eventually(lambda: _closed(w, host, move_id), f"the move {move_id} to close", 90)
                await page.wait_for_function(
                    f"""() => {{ const r = document.querySelector('tr[data-host="{host}"]');
                    return r && r.querySelector('td.state').textContent === 'serving'
                      && r.textContent.includes('{w.labels["uk"]}') && r.querySelector('td.last').textContent
                      .startsWith('done'); }}""", timeout=30_000)
                await page.wait_for_selector('li[data-alert="bad-object"]', timeout=30_000)
                await page.screenshot(path=str(shots / "3-after.png"), full_page=True)

                phases: list[str] = await page.evaluate("window.__phases")
                timings: list[str] = await page.evaluate("window.__timings")
                assert await page.evaluate("window.__marker") == "no reload"
                assert phases[0] == "-" and phases[-1] == "-", phases  # serving, at rest, before and after
                assert any(p in ("preparing", "ready", "cutting", "landing", "committed") for p in phases), phases
                assert "preparing" in phases and len(set(phases)) >= 3, phases  # it changed live, several times
                assert any(t.startswith("cut:") and t.split(":", 1)[1][0].isdigit() for t in timings), timings
                assert any(t.startswith("offline:") and t.split(":", 1)[1][0].isdigit() for t in timings), timings
                alert = await page.locator('li[data-alert="bad-object"]').first.text_content()
                assert alert is not None and bad in alert
                await axe_clean(page, "the fleet view after the move")

                # a rebuild of the projection (a new identity: the feed answers resync), then the move back: the
                # page takes a new snapshot and follows again, still without a reload
                await proj.rebuild(events)
                await page.wait_for_function("window.__phases.length > 0", timeout=5_000)
                await page.evaluate("window.__phases = []")
                back = await door.request_move(host, MoveRequest("ie", "auto"), Identity("op", "operator"))
                assert back.status in (200, 201), back.body
                back_id = str(back.body["move"]["id"])
                await eventually(lambda: _closed(w, host, back_id), f"the move {back_id} to close", 90)
                await page.wait_for_function(
                    f"""() => {{ const r = document.querySelector('tr[data-host="{host}"]');
                    return r && r.textContent.includes('{w.labels["ie"]}')
                      && r.querySelector('td.state').textContent === 'serving'; }}""", timeout=30_000)
                assert await page.evaluate("window.__marker") == "no reload"
                said: list[str] = await page.evaluate("window.__said")
                assert any(t.startswith("The projection was rebuilt") for t in said), said[-5:]
                assert "preparing" in await page.evaluate("window.__phases")  # followed after the resync

                await page.goto(base + "/hosts/" + host)
                assert await page.locator("#history li[data-move]").count() == 2  # the history grew by one
                entry = page.locator(f'#history li[data-move="{move_id}"]')
                await entry.wait_for(timeout=10_000)
                assert await entry.locator(".outcome").text_content() == "done"
                for name in ("cut", "offline"):
                    took = await entry.locator(f'tr[data-timing="{name}"] .elapsed').text_content()
                    assert took is not None and took[0].isdigit() and took.endswith(" s"), (name, took)
                await page.screenshot(path=str(shots / "4-host.png"), full_page=True)
                await axe_clean(page, "the host page")
                await page.goto(base + f"/moves/{move_id}?host={host}")
                assert await page.locator("#entries tbody tr").count() >= 5
                await axe_clean(page, "the move page")
            finally:
                await browser.close()
        proj.close()
    assert sorted(p.name for p in shots.iterdir()) == ["1-before.png", "2-moving.png", "3-after.png", "4-host.png"]
