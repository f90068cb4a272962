"""The dashboard (issue 20 item 1): server-rendered HTML at ``/`` on the projections service, read-only.

- ``/``: the hosts (state, region, box, claim gen, last move's outcome), the boxes (region, eligibility, fenced or
  lost, running instances), the live moves with their phase and a timeline of their §13 timings against the
  budgets, and the alerts and incidents;
- ``/hosts/<host>``: one host, its live move's timeline and its move history from the move log (§13);
- ``/moves/<move>``: one move's log, transition by transition;
- ``/login``: a form that keeps a status token in an HTTP-only cookie (the dashboard sits behind
  :class:`projections.console.Access`, like the console's JSON routes).

Every view works without the script. ``/dashboard.js`` follows the change feed (``/v1/stream``, SSE) and swaps in
the re-rendered ``/fragment/main`` on each change, and takes a fresh snapshot (its cursor rides in the fragment) after
a ``resync``, without a reload. The renderers are pure functions of the views :mod:`projections.console` builds.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from typing import Any
from urllib.parse import quote

from aiohttp import web

from kernel.timetext import utc_text
from projections.console import COOKIE, Unavailable, box_views, host_summary, move_views
from projections.console_api import CONSOLE, identify
from projections.web import CLOCK, STORE

_CSS = """
body{font-family:system-ui,sans-serif;margin:0;color:#111;background:#fff;line-height:1.4}
header,main,footer{padding:0 1.5rem}
header{border-bottom:1px solid #767676}
a{color:#0b4f9c}
.skip{position:absolute;left:-999px}.skip:focus{left:1rem;top:1rem;background:#fff;padding:.25rem}
table{border-collapse:collapse;margin:.5rem 0 1.5rem;min-width:40rem}
caption{text-align:left;font-weight:600;padding:.25rem 0}
th,td{border:1px solid #767676;padding:.25rem .5rem;text-align:left;vertical-align:top}
.over{color:#8b0000;font-weight:600}
.bar{display:inline-block;width:10rem;height:.75rem;border:1px solid #555;vertical-align:middle}
.bar span{display:block;height:100%;background:#0b4f9c}
.bar span.over{background:#8b0000}
#live{font-size:.9rem}
"""

_SCRIPT = r"""
(function () {
  "use strict";
  var main = document.getElementById("main");
  var live = document.getElementById("live");
  if (!main || !window.EventSource || !window.fetch) { return; }
  var source = null, pending = null;
  function say(text) { if (live) { live.textContent = text; } }
  function refresh() {
    pending = null;
    var url = "/fragment/main?page=" + encodeURIComponent(location.pathname);
    return fetch(url, {credentials: "same-origin"}).then(function (r) {
      if (!r.ok) { throw new Error("the dashboard answered " + r.status); }
      return r.text();
    }).then(function (text) {
      main.innerHTML = text;
      say("Live: updated " + new Date().toISOString().slice(11, 19) + " UTC.");
    }).catch(function (e) { say("Not live: " + e.message + "; retrying."); });
  }
  function soon() { if (!pending) { pending = setTimeout(refresh, 150); } }
  function cursor() {
    var el = main.querySelector("[data-cursor]");
    return el ? el.getAttribute("data-cursor") : "";
  }
  function follow() {
    if (source) { source.close(); }
    source = new EventSource("/v1/stream?cursor=" + encodeURIComponent(cursor()));
    source.addEventListener("change", soon);
    source.addEventListener("caught-up", function () { say("Live: following the change feed."); });
    source.addEventListener("resync", function () {
      source.close();
      say("The projection was rebuilt: taking a new snapshot.");
      refresh().then(follow);
    });
    source.onerror = function () { say("Not live: the change feed dropped; reconnecting."); };
  }
  follow();
  setInterval(function () { if (main.querySelector("[data-running]")) { soon(); } }, 2000);
  setInterval(soon, 10000);
})();
"""


def _e(value: object) -> str:
    return html.escape("" if value is None else str(value), quote=True)


def _host_href(host: str) -> str:
    return "/hosts/" + quote(host, safe="")


def _move_href(move_id: str, host: str) -> str:
    return f"/moves/{quote(move_id, safe='')}?host={quote(host, safe='')}"


def _secs(ms: int | float | None) -> str:
    if ms is None:
        return "-"
    return (f"{ms / 1000:.1f}".rstrip("0").rstrip(".")) + " s"


def page(title: str, body: str, *, script: bool = True) -> str:
    """A whole page: the skip link, the header, ``body`` in ``<main id="main">`` and the live region."""
    js = '<script src="/dashboard.js" defer></script>' if script else ""
    return (
        f'<!doctype html><html lang="en"><head><meta charset="utf-8">'
        f'<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{_e(title)}</title><style>{_CSS}</style>{js}</head><body>"
        f'<a class="skip" href="#main">Skip to the content</a>'
        f'<header><p><a href="/">hostmove fleet</a></p>'
        f'<p id="live" role="status" aria-live="polite">Static view: reload for the latest.</p></header>'
        f'<main id="main">{body}</main>'
        f"<footer><p>Read-only. JSON: <a href=\"/openapi.json\">the API</a>.</p></footer></body></html>")


def timeline(timings: Sequence[dict[str, Any]], caption: str) -> str:
    """A move's §13 timings against their budgets: one row each, with a bar (decoration; the cells say it all)."""
    rows = []
    for t in timings:
        elapsed, budget = t.get("elapsed_ms"), t.get("budget_s")
        over = bool(t.get("over"))
        if elapsed is None:
            took = "not started"
        elif t.get("running"):
            took = f"{_secs(elapsed)} so far"
        else:
            took = _secs(elapsed)
        share = min(100.0, 100.0 * elapsed / (budget * 1000)) if elapsed is not None and budget else 0.0
        status = "over budget" if over else ("running" if t.get("running") else ("within budget"
                                                                                    if elapsed is not None else "-"))
        klass = ' class="over"' if over else ""
        running = " data-running" if t.get("running") else ""
        rows.append(
            f'<tr data-timing="{_e(t.get("name"))}"{running}><th scope="row">{_e(t.get("name"))}</th>'
            f'<td class="elapsed">{_e(took)}</td><td>{_e(_secs(budget * 1000) if budget else "no budget yet")}</td>'
            f"<td{klass}>{_e(status)}</td>"
            f'<td><span class="bar" aria-hidden="true"><span{klass} style="width:{share:.0f}%"></span></span></td>'
            "</tr>")
    return (f'<table class="timeline"><caption>{_e(caption)}</caption><thead><tr><th scope="col">timing</th>'
            '<th scope="col">elapsed</th><th scope="col">budget</th><th scope="col">status</th>'
            '<th scope="col">against the budget</th></tr></thead><tbody>' + "".join(rows) + "</tbody></table>")


def hosts_table(hosts: Sequence[dict[str, Any]]) -> str:
    rows = []
    for h in hosts:
        last = h.get("last_move") or {}
        phase = h["move_state"] or h["phase"] or "-"
        outcome = f'{last.get("outcome", "")} ({utc_text(last.get("at"))})' if last else "-"
        rows.append(
            f'<tr data-host="{_e(h["host"])}"><th scope="row"><a href="{_e(_host_href(h["host"]))}">{_e(h["host"])}'
            f'</a></th><td class="state">{_e(h["state"] or "-")}</td><td class="phase">{_e(phase)}</td>'
            f'<td>{_e(h["region"] or "-")}</td><td>{_e(h["box"] or "-")}</td><td>{_e(h["claim_gen"])}</td>'
            f'<td class="last">{_e(outcome)}</td></tr>')
    if not rows:
        rows.append('<tr><td colspan="7">No hosts yet.</td></tr>')
    return ('<table id="hosts"><caption>Hosts</caption><thead><tr><th scope="col">host</th><th scope="col">state</th>'
            '<th scope="col">phase</th><th scope="col">region</th><th scope="col">box</th>'
            '<th scope="col">claim gen</th><th scope="col">last move</th></tr></thead><tbody>'
            + "".join(rows) + "</tbody></table>")


def boxes_table(boxes: Sequence[dict[str, Any]] | None, why: str = "") -> str:
    if boxes is None:
        return f'<h2 id="boxes-h">Boxes</h2><p role="alert">The boxes could not be read: {_e(why)}</p>'
    rows = []
    for b in boxes:
        state = "fenced (lost)" if b["fenced"] else "live"
        eligible = "yes" if b["eligible"] else f"no: {b['why']}"
        running = ", ".join(b["running"]) or "none"
        rows.append(f'<tr data-box="{_e(b["label"])}"><th scope="row">{_e(b["label"])}</th><td>{_e(b["region"])}</td>'
                    f"<td>{_e(state)}</td><td>{_e(eligible)}</td><td>{_e(running)}</td></tr>")
    if not rows:
        rows.append('<tr><td colspan="5">No boxes in the roster.</td></tr>')
    return ('<h2 id="boxes-h">Boxes</h2><table id="boxes"><caption>Boxes in the roster</caption><thead><tr>'
            '<th scope="col">box</th><th scope="col">region</th><th scope="col">state</th>'
            '<th scope="col">eligible</th><th scope="col">running instances</th></tr></thead><tbody>'
            + "".join(rows) + "</tbody></table>")


def moves_section(moves: Sequence[dict[str, Any]]) -> str:
    live = [m for m in moves if m["live"]]
    if not live:
        return '<h2 id="moves-h">Live moves</h2><p id="moves">No move is live.</p>'
    parts = ['<h2 id="moves-h">Live moves</h2><div id="moves">']
    for m in live:
        phase = m["state"] + (f", cut phase {m['cut_phase']}" if m["cut_phase"] else "") + (
            f", landing phase {m['landing_phase']}" if m["landing_phase"] else "")
        parts.append(
            f'<section class="move" data-move="{_e(m["move_id"])}" aria-labelledby="m-{_e(m["move_id"])}">'
            f'<h3 id="m-{_e(m["move_id"])}"><a href="{_e(_host_href(m["host"]))}">{_e(m["host"])}</a>: '
            f'{_e(m["from"])} to {_e(m["to"])}</h3><p>Move <a href="{_e(_move_href(m["move_id"], m["host"]))}">'
            f'{_e(m["move_id"])}</a>, <span class="move-phase">{_e(phase)}</span>; requested by '
            f'{_e(m["requested_by"] or "-")} at {_e(utc_text(m["requested_at"]))}.</p>'
            + (f"<p>Reason: {_e(m['reason'])}</p>" if m["reason"] else "")
            + timeline(m["timings"], f"Timings of move {m['move_id']} (§13) against their budgets") + "</section>")
    parts.append("</div>")
    return "".join(parts)


def alerts_section(alerts: Sequence[dict[str, Any]] | None, why: str = "") -> str:
    if alerts is None:
        return f'<h2 id="alerts-h">Alerts and incidents</h2><p role="alert">The alerts could not be read: {_e(why)}</p>'
    if not alerts:
        return '<h2 id="alerts-h">Alerts and incidents</h2><p id="alerts">No alert has been raised.</p>'
    items = []
    for a in reversed(alerts[-50:]):
        kind = "incident" if a["incident"] else "alert"
        text = a["sentence"] or ", ".join(f"{k}: {v}" for k, v in list(a["payload"].items())[:4])
        items.append(f'<li data-alert="{_e(a["kind"])}"><strong>{_e(kind)} {_e(a["kind"])}</strong> on '
                     f'{_e(a["subject"])} at {_e(utc_text(a["at"]))}: {_e(text)}</li>')
    return ('<h2 id="alerts-h">Alerts and incidents</h2><ul id="alerts" aria-labelledby="alerts-h">'
            + "".join(items) + "</ul>")


async def _alerts(request: web.Request) -> tuple[list[dict[str, Any]] | None, str]:
    try:
        found, _ = await request.app[CONSOLE].alerts(wait=False)
        return found, ""
    except Unavailable as exc:
        return None, exc.reason


async def fleet_main(request: web.Request) -> str:
    """The fleet view's ``<main>`` content."""
    snap = request.app[STORE].snapshot()
    now = request.app[CLOCK].now_ms()
    console = request.app[CONSOLE]
    try:
        boxes: list[dict[str, Any]] | None = box_views(await console.roster(), snap.hosts)
        why = ""
    except Unavailable as exc:
        boxes, why = None, exc.reason
    alerts, alerts_why = await _alerts(request)
    hosts = [host_summary(h) for h in snap.hosts]
    return (f'<h1 data-cursor="{_e(snap.cursor)}">The fleet</h1>'
            f"<p>Projection revision {snap.revision}, {len(hosts)} hosts.</p>"
            + hosts_table(hosts) + boxes_table(boxes, why) + moves_section(move_views(snap.hosts, now))
            + alerts_section(alerts, alerts_why))


async def host_main(request: web.Request, host: str) -> str | None:
    store = request.app[STORE]
    view = store.host(host)
    if view is None:
        return None
    snap_cursor = store.cursor()
    h = host_summary(view)
    now = request.app[CLOCK].now_ms()
    live = [m for m in move_views([view], now, live_only=True)]
    try:
        history: list[dict[str, Any]] | None = await request.app[CONSOLE].history(host)
        why = ""
    except Unavailable as exc:
        history, why = None, exc.reason
    parts = [f'<h1 data-cursor="{_e(snap_cursor)}">Host {_e(host)}</h1>', hosts_table([h]), moves_section(live),
             '<h2 id="history-h">Move history</h2>']
    if history is None:
        parts.append(f'<p role="alert">The move log could not be read: {_e(why)}</p>')
    elif not history:
        parts.append('<p id="history">The move log holds no move of this host.</p>')
    else:
        parts.append('<ol id="history" aria-labelledby="history-h">')
        for m in reversed(history):
            outcome = m.get("outcome") or f"live ({m.get('state') or '-'})"
            parts.append(
                f'<li data-move="{_e(m["move_id"])}"><h3 id="h-{_e(m["move_id"])}">'
                f'<a href="{_e(_move_href(m["move_id"], host))}">{_e(m["move_id"])}</a>: {_e(m.get("from"))} to '
                f'{_e(m.get("to"))}, <span class="outcome">{_e(outcome)}</span></h3><p>Requested at '
                f'{_e(utc_text(m.get("requested_at")))}, closed at {_e(utc_text(m.get("closed_at")))}.</p>'
                + (f"<p>Reason: {_e(m['reason'])}</p>" if m.get("reason") else "")
                + (timeline(m["timings"], f"Timings of move {m['move_id']} (§13)") if m.get("timings") else "")
                + "</li>")
        parts.append("</ol>")
    return "".join(parts)


async def move_main(request: web.Request, move_id: str, host: str | None) -> str | None:
    log = await request.app[CONSOLE].move(move_id, host)
    if log is None:
        return None
    rows = []
    for e in log["entries"]:
        actor = e.get("actor") or {}
        who = actor.get("service", "") + (f" on {actor['box']}" if actor.get("box") else "")
        phases = ", ".join(p for p in (e.get("cut_phase"), e.get("landing_phase"), e.get("rollback_target_phase"),
                                       e.get("rollback_source_phase")) if p) or "-"
        rows.append(f'<tr><td>{_e(e.get("gen"))}</td><td>{_e(utc_text(e.get("at")))}</td><td>{_e(e.get("name"))}</td>'
                    f'<td>{_e(e.get("state"))}</td><td>{_e(phases)}</td><td>{_e(who)}</td>'
                    f'<td>{_e(e.get("reason") or "-")}</td></tr>')
    summary = log.get("summary")
    parts = [f'<h1>Move {_e(move_id)} of <a href="{_e(_host_href(log["host"]))}">{_e(log["host"])}</a></h1>']
    if summary:
        parts.append(f'<p>Closed <span class="outcome">{_e(summary.get("outcome"))}</span> at '
                     f'{_e(utc_text(summary.get("closed_at")))}, from {_e(summary.get("from"))} to '
                     f'{_e(summary.get("to"))}.</p>' + timeline(summary.get("timings") or [], "Timings (§13)"))
    parts.append('<table id="entries"><caption>The move log, transition by transition</caption><thead><tr>'
                 '<th scope="col">gen</th><th scope="col">at</th><th scope="col">transition</th>'
                 '<th scope="col">state</th><th scope="col">phases</th><th scope="col">written by</th>'
                 '<th scope="col">reason</th></tr></thead><tbody>' + "".join(rows) + "</tbody></table>")
    claims = []
    for c in log.get("claim_entries") or []:
        actor = c.get("actor") or {}
        who = actor.get("service", "") + (f" on {actor['box']}" if actor.get("box") else "")
        claims.append(f'<tr><td>{_e(c.get("gen"))}</td><td>{_e(utc_text(c.get("at")))}</td><td>{_e(c.get("name"))}'
                      f'</td><td>{_e(c.get("kind"))}</td><td>{_e(c.get("phase") or "-")}</td><td>{_e(c.get("exec"))}'
                      f"</td><td>{_e(who)}</td></tr>")
    if claims:
        parts.append('<table id="claim-entries"><caption>The claim through the move: who executes</caption><thead>'
                     '<tr><th scope="col">gen</th><th scope="col">at</th><th scope="col">transition</th>'
                     '<th scope="col">op</th><th scope="col">phase</th><th scope="col">executes</th>'
                     '<th scope="col">written by</th></tr></thead><tbody>' + "".join(claims) + "</tbody></table>")
    return "".join(parts)


# -- handlers --------------------------------------------------------------------------------------


def _html(text: str, status: int = 200) -> web.Response:
    return web.Response(text=text, status=status, content_type="text/html", charset="utf-8",
                        headers={"Cache-Control": "no-store"})


def _login_body(reason: str) -> str:
    return (f'<h1>Sign in</h1><p role="alert">{_e(reason)}</p><form method="post" action="/login">'
            '<p><label for="token">Status or operator token</label> '
            '<input id="token" name="token" type="password" autocomplete="current-password" required></p>'
            '<p><button type="submit">Sign in</button></p></form>')


def _guard(request: web.Request) -> web.Response | None:
    if identify(request) is None:
        return _html(page("Sign in: hostmove", _login_body(request.app[CONSOLE].access.refusal()), script=False), 401)
    return None


async def index(request: web.Request) -> web.Response:
    if (denied := _guard(request)) is not None:
        return denied
    return _html(page("hostmove fleet", await fleet_main(request)))


async def fragment(request: web.Request) -> web.Response:
    if (denied := _guard(request)) is not None:
        return denied
    path = request.query.get("page", "")
    if path.startswith("/hosts/"):
        from urllib.parse import unquote

        body = await host_main(request, unquote(path[len("/hosts/"):]))
        return _html(body or "<h1>No such host</h1>")
    return _html(await fleet_main(request))


async def host_page(request: web.Request) -> web.Response:
    if (denied := _guard(request)) is not None:
        return denied
    host = request.match_info["host"]
    body = await host_main(request, host)
    if body is None:
        return _html(page("No such host", f"<h1>No host named {_e(host)}</h1>", script=False), 404)
    return _html(page(f"Host {host}: hostmove", body))


async def move_page(request: web.Request) -> web.Response:
    if (denied := _guard(request)) is not None:
        return denied
    move_id = request.match_info["move_id"]
    try:
        body = await move_main(request, move_id, request.query.get("host") or None)
    except Unavailable as exc:
        return _html(page("Move log unavailable", f'<h1>Move {_e(move_id)}</h1><p role="alert">{_e(exc.reason)}</p>',
                          script=False), 503)
    if body is None:
        return _html(page("No such move", f"<h1>The move log holds no move {_e(move_id)}</h1>", script=False), 404)
    return _html(page(f"Move {move_id}: hostmove", body, script=False))


async def login_form(request: web.Request) -> web.Response:
    return _html(page("Sign in: hostmove", _login_body("Sign in with a status or operator token."), script=False))


async def login(request: web.Request) -> web.Response:
    form = await request.post()
    token = str(form.get("token", ""))
    access = request.app[CONSOLE].access
    if access.identify(f"Bearer {token}", None) is None:
        return _html(page("Sign in: hostmove", _login_body("That token is not configured here."), script=False), 401)
    resp = web.HTTPSeeOther("/")
    resp.set_cookie(COOKIE, token, httponly=True, samesite="Strict", path="/",
                    secure=request.secure)
    raise resp


async def script(request: web.Request) -> web.Response:
    return web.Response(text=_SCRIPT, content_type="application/javascript", charset="utf-8")


def install(app: web.Application) -> None:
    """The dashboard's routes (after :func:`projections.console_api.install`, whose console it reads)."""
    app.router.add_get("/", index)
    app.router.add_get("/fragment/main", fragment)
    app.router.add_get("/hosts/{host:.+}", host_page)
    app.router.add_get("/moves/{move_id}", move_page)
    app.router.add_get("/login", login_form)
    app.router.add_post("/login", login)
    app.router.add_get("/dashboard.js", script)


__all__ = ["alerts_section", "boxes_table", "hosts_table", "install", "moves_section", "page", "timeline"]
