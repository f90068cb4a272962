"""The console's JSON routes on the projections service (issue 20 item 3): boxes, moves, the move log, alerts.

Described in :func:`projections.openapi.document`; the CLI's ``-o json`` prints these answers as they are. Every route
is behind :class:`projections.console.Access` (401 with the reason otherwise); a dependency that does not answer is
a 503 naming it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from projections.console import COOKIE, Console, Unavailable, box_views, move_views
from projections.web import _TRUE, CLOCK, STORE, BadRequest, _params
from projections.web import _json as _encode
from services.door.auth import Identity

CONSOLE: web.AppKey[Console] = web.AppKey("console", Console)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _json(body: Any, status: int = 200) -> web.Response:
    return _encode(body, status)  # one encoder for every route of the service


def _error(status: int, code: str, reason: str, **more: str) -> web.Response:
    return _json({"error": code, "reason": reason, **more}, status)


def identify(request: web.Request) -> Identity | None:
    """Who asks (a bearer token, or the dashboard's cookie), or None."""
    return request.app[CONSOLE].access.identify(request.headers.get("Authorization"), request.cookies.get(COOKIE))


def guarded(handler: Handler) -> Handler:
    """Answer 401 with the reason to a read without a token; 503 naming the dependency that did not answer."""

    async def run(request: web.Request) -> web.StreamResponse:
        console = request.app[CONSOLE]
        if identify(request) is None:
            return _error(401, "unauthorized", console.access.refusal())
        try:
            return await handler(request)
        except Unavailable as exc:
            return _error(503, "unavailable", exc.reason, dependency=exc.dependency)

    return run


def _only(request: web.Request, allowed: tuple[str, ...]) -> dict[str, str]:
    return _params(request, allowed)


def _flag(params: dict[str, str], name: str) -> bool:
    raw = params.get(name, "false").lower()
    if raw not in _TRUE:
        raise BadRequest(f"{name} must be true, false, 1 or 0")
    return _TRUE[raw]


async def boxes(request: web.Request) -> web.Response:
    _only(request, ())
    console = request.app[CONSOLE]
    roster = await console.roster()
    snap = request.app[STORE].snapshot()
    return _json({"roster_gen": roster.gen if roster is not None else 0,
                  "boxes": box_views(roster, snap.hosts)})


async def box(request: web.Request) -> web.Response:
    _only(request, ())
    label = request.match_info["label"]
    console = request.app[CONSOLE]
    found = [b for b in box_views(await console.roster(), request.app[STORE].snapshot().hosts) if b["label"] == label]
    if not found:
        return _error(404, "not_found", f"no box labelled {label!r} in the roster")
    return _json(found[0])


async def moves(request: web.Request) -> web.Response:
    params = _only(request, ("live",))
    snap = request.app[STORE].snapshot()
    return _json({"revision": snap.revision,
                  "moves": move_views(snap.hosts, request.app[CLOCK].now_ms(), live_only=_flag(params, "live"))})


async def move(request: web.Request) -> web.Response:
    params = _only(request, ("host",))
    move_id = request.match_info["move_id"]
    found = await request.app[CONSOLE].move(move_id, params.get("host") or None)
    if found is None:
        return _error(404, "not_found", f"the move log holds no move {move_id!r}")
    return _json(found)


async def history(request: web.Request) -> web.Response:
    params = _only(request, ("host",))
    host = params.get("host", "")
    if not host:
        raise BadRequest("host is required: the host whose moves to list")
    return _json({"host": host, "moves": await request.app[CONSOLE].history(host)})


async def alerts(request: web.Request) -> web.Response:
    params = _only(request, ("after", "limit"))
    raw = params.get("after", "0")
    if not raw.isascii() or not raw.isdigit() or len(raw) > 16 or int(raw) > 2**53 - 1:
        raise BadRequest("after must be a stream sequence (an integer, 0 for all)")
    limit_raw = params.get("limit", "200")
    if not limit_raw.isascii() or not limit_raw.isdigit() or not 1 <= int(limit_raw) <= 200:
        raise BadRequest("limit must be an integer from 1 to 200")
    found, last = await request.app[CONSOLE].alerts(int(raw), int(limit_raw))
    return _json({"alerts": found, "last_seq": last})


def install(app: web.Application, console: Console) -> None:
    """Register the console's JSON routes on ``app`` (the projections' read API)."""
    app[CONSOLE] = console
    app.router.add_get("/v1/boxes", guarded(boxes))
    app.router.add_get("/v1/boxes/{label}", guarded(box))
    app.router.add_get("/v1/moves", guarded(moves))
    app.router.add_get("/v1/moves/{move_id}", guarded(move))
    app.router.add_get("/v1/history", guarded(history))
    app.router.add_get("/v1/alerts", guarded(alerts))


__all__ = ["CONSOLE", "guarded", "identify", "install"]
