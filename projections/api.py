"""The projection's read API: snapshot, host, change feed, long-poll and SSE (ARCHITECTURE §8).

Read-only, no auth for reads. Every answer is JSON (``/v1/stream`` is ``text/event-stream``); bad
input gets a 400 with a plain reason, a cursor from another identity a 409 ``{"resync": true}``
(never silently wrong data). The routes are described by :func:`projections.openapi.document`.

Long-poll and SSE wake on an in-process commit (:meth:`ProjectionStore.wait`) and otherwise poll the
database every ``poll_interval`` seconds, so the API may run in another process than the projector.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from aiohttp import web

from bus.log import EventLog
from kernel.logctx import ctx
from kernel.ports import Clock, WallClock
from projections.console import Console
from projections.openapi import DEFAULT_LIMIT, DEFAULT_WAIT_S, MAX_LIMIT, MAX_WAIT_S, document
from projections.runner import Projector
from projections.store import ChangesPage, ProjectionStore, Resync
from projections.web import (
    _TRUE,
    CLOCK,
    PROJECTOR,
    PROJECTOR_STATE,
    SETTINGS,
    STORE,
    BadRequest,
    _dumps,
    _json,
    _params,
)

log = logging.getLogger("hostmove.projections")

def _limit(params: dict[str, str]) -> int:
    raw = params.get("limit")
    if raw is None:
        return DEFAULT_LIMIT
    if not raw.isascii() or not raw.isdigit() or len(raw) > 6:
        raise BadRequest(f"limit must be an integer from 1 to {MAX_LIMIT}")
    value = int(raw)
    if not 1 <= value <= MAX_LIMIT:
        raise BadRequest(f"limit must be an integer from 1 to {MAX_LIMIT}")
    return value


def _timeout(params: dict[str, str], ceiling: float) -> float:
    raw = params.get("timeout")
    if raw is None:
        return min(DEFAULT_WAIT_S, ceiling)
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or not 0 <= value <= ceiling:
        raise BadRequest(f"timeout must be a number of seconds from 0 to {ceiling:g}")
    return value


def _resync(r: Resync) -> web.Response:
    return _json({"resync": True, "reason": r.reason, "identity": r.identity}, status=409)


def _page(p: ChangesPage) -> dict[str, Any]:
    return {
        "identity": p.identity, "revision": p.revision, "cursor": p.cursor, "more": p.more,
        "changes": [v.as_dict() for v in p.changes],
    }


def _error(status: int, code: str, reason: str, headers: dict[str, str] | None = None) -> web.Response:
    resp = _json({"error": code, "reason": reason}, status=status)
    if headers:
        resp.headers.update(headers)
    return resp


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Plain JSON reasons for bad input, unknown routes and defects (never a stack trace)."""
    try:
        return await handler(request)
    except BadRequest as exc:
        return _error(400, "bad_request", exc.reason)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        headers = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
        return _error(exc.status, exc.reason.lower().replace(" ", "_"), exc.reason, headers)
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:
        log.exception("projection API %s %s failed", request.method, request.path,
                      extra=ctx(host=request.match_info.get("host"), phase="read-api", method=request.method,
                                path=request.path))
        return _error(500, "internal", "the projection could not be read")


# -- handlers ------------------------------------------------------------------------------------


async def openapi(request: web.Request) -> web.Response:
    _params(request, ())
    return _json(document())


async def healthz(request: web.Request) -> web.Response:
    _params(request, ())
    store = request.app[STORE]
    state = request.app[PROJECTOR_STATE]
    try:
        body: dict[str, Any] = {
            "ok": True, "identity": store.identity, "revision": store.revision(),
            "position": store.position(), "errors": store.error_counts(),
        }
    except Exception as exc:  # noqa: BLE001 - health reports, never raises
        reason = f"the projection is unreadable: {type(exc).__name__}"
        return _json({"ok": False, "reason": reason}, status=503)
    if "state" in state:
        body["projector"] = state["state"]
        if state["state"] != "running":
            body["ok"] = False
            body["reason"] = state.get("reason", "")
            return _json(body, status=503)
    return _json(body)


async def hosts(request: web.Request) -> web.Response:
    params = _params(request, ("include_deleted",))
    raw = params.get("include_deleted", "false").lower()
    if raw not in _TRUE:
        raise BadRequest("include_deleted must be true, false, 1 or 0")
    snap = request.app[STORE].snapshot(include_deleted=_TRUE[raw])
    return _json({
        "identity": snap.identity, "revision": snap.revision, "position": snap.position,
        "cursor": snap.cursor, "hosts": [h.as_dict() for h in snap.hosts],
    })


async def host(request: web.Request) -> web.Response:
    _params(request, ())
    name = request.match_info["host"]
    view = request.app[STORE].host(name)
    if view is None:
        return _error(404, "not_found", f"no host named {name!r} in this projection")
    return _json(view.as_dict())


async def changes(request: web.Request) -> web.Response:
    params = _params(request, ("cursor", "limit"))
    limit = _limit(params)
    page = request.app[STORE].changes(params.get("cursor"), limit)
    if isinstance(page, Resync):
        return _resync(page)
    return _json(_page(page))


async def wait_changes(request: web.Request) -> web.Response:
    params = _params(request, ("cursor", "limit", "timeout"))
    limit = _limit(params)
    settings = request.app[SETTINGS]
    timeout = _timeout(params, settings["max_wait"])
    store, clock = request.app[STORE], request.app[CLOCK]
    deadline = clock.monotonic() + timeout
    while True:
        page = store.changes(params.get("cursor"), limit)
        if isinstance(page, Resync):
            return _resync(page)
        remaining = deadline - clock.monotonic()
        if page.changes or remaining <= 0:
            return _json(_page(page))
        await store.wait(min(settings["poll_interval"], remaining))


def _sse(event: str, data: Any, event_id: str | None = None) -> bytes:
    lines = [f"event: {event}"]
    if event_id is not None:
        lines.append(f"id: {event_id}")
    lines.append(f"data: {_dumps(data)}")
    return ("\n".join(lines) + "\n\n").encode("utf-8")


async def stream(request: web.Request) -> web.StreamResponse:
    params = _params(request, ("cursor",))
    cursor = params.get("cursor") or request.headers.get("Last-Event-ID") or None
    store, clock, settings = request.app[STORE], request.app[CLOCK], request.app[SETTINGS]
    page = store.changes(cursor, MAX_LIMIT)
    if isinstance(page, Resync):
        return _resync(page)
    resp = web.StreamResponse(headers={
        "Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no",
    })
    await resp.prepare(request)
    await resp.write(b"retry: 2000\n\n")
    announced: str | None = None
    last_write = clock.monotonic()
    try:
        while True:
            for view in page.changes:
                await resp.write(_sse("change", view.as_dict(), f"{page.identity}:{view.revision}"))
            if page.changes:
                last_write = clock.monotonic()
            if not page.more:
                if page.cursor != announced:
                    await resp.write(_sse("caught-up", {"revision": page.revision}, page.cursor))
                    announced = page.cursor
                    last_write = clock.monotonic()
                elif clock.monotonic() - last_write >= settings["heartbeat"]:
                    await resp.write(b": keepalive\n\n")
                    last_write = clock.monotonic()
                await store.wait(settings["poll_interval"])
            nxt = store.changes(page.cursor, MAX_LIMIT)
            if isinstance(nxt, Resync):
                body = {"resync": True, "reason": nxt.reason, "identity": nxt.identity}
                await resp.write(_sse("resync", body))
                break
            page = nxt
    except ConnectionResetError:
        return resp  # the client went away
    with contextlib.suppress(ConnectionResetError):
        await resp.write_eof()
    return resp


class NotReady(Exception):
    """Why the projection is not ready (its text is the reason shown by ``/readyz``)."""


async def readiness(store: ProjectionStore, events: EventLog, state: dict[str, str], *,
                    max_lag: int) -> dict[str, Any]:
    """The projection's readiness (issue 11 item 3): its projector runs and it is at most ``max_lag`` messages behind
    the stream's last sequence. Answers ``{"lag", "position", "last_seq"}``; raises :class:`NotReady` (or the log's
    error) with the reason otherwise."""
    if state.get("state", "running") != "running":
        raise NotReady(f"the projector {state['state']}: {state.get('reason', '')}".rstrip(": "))
    last_seq = (await events.state(store.stream)).last_seq
    position = store.position()
    lag = max(0, last_seq - position)
    if lag > max_lag:
        raise NotReady(f"the projection is {lag} messages behind the stream (position {position}, last {last_seq}; "
                       f"the bound is {max_lag})")
    return {"lag": lag, "position": position, "last_seq": last_seq}


# -- the app -------------------------------------------------------------------------------------


def make_app(
    store: ProjectionStore,
    *,
    clock: Clock | None = None,
    projector: Projector | None = None,
    poll_interval: float = 0.5,
    max_wait: float = MAX_WAIT_S,
    heartbeat: float = 15.0,
    console: Console | None = None,
) -> web.Application:
    """The read API over ``store``. With ``projector``, the app also runs it while it is up
    (``/healthz`` answers 503 once it halted, e.g. on a poison message). With ``console``, also the console's reads
    (:mod:`projections.console_api`) and the dashboard at ``/`` (:mod:`projections.dashboard`)."""
    app = web.Application(middlewares=[_errors])
    app[STORE] = store
    app[CLOCK] = clock or store.clock or WallClock()
    app[SETTINGS] = {"poll_interval": poll_interval, "max_wait": max_wait, "heartbeat": heartbeat}
    app[PROJECTOR] = projector
    app[PROJECTOR_STATE] = {}
    app.router.add_get("/openapi.json", openapi)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/v1/hosts", hosts)
    app.router.add_get("/v1/hosts/{host:.+}", host)
    app.router.add_get("/v1/changes", changes)
    app.router.add_get("/v1/changes/wait", wait_changes)
    app.router.add_get("/v1/stream", stream)
    if console is not None:  # the console's reads and the dashboard (issue 20)
        from projections import console_api, dashboard

        console_api.install(app, console)
        dashboard.install(app)
    if projector is not None:
        app.cleanup_ctx.append(_run_projector)
    return app


async def _run_projector(app: web.Application) -> AsyncIterator[None]:
    projector = app[PROJECTOR]
    assert projector is not None
    state = app[PROJECTOR_STATE]
    state["state"] = "running"

    async def run() -> None:
        try:
            await projector.run()
            state["state"] = "stopped"
        except asyncio.CancelledError:
            state["state"] = "stopped"
            raise
        except Exception as exc:  # noqa: BLE001 - reported by /healthz and logged
            state.update(state="halted", reason=str(exc))
            log.error("projector halted: %s", exc, extra=ctx(phase="projection", reason=exc))

    task = asyncio.create_task(run())
    yield
    projector.stop()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def serve(app: web.Application, host: str = "127.0.0.1", port: int = 8080) -> web.AppRunner:
    """Start ``app`` on ``host:port``; ``await runner.cleanup()`` stops it."""
    runner = web.AppRunner(app, shutdown_timeout=5.0)  # an open change feed never holds a stop up for 60 s
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner
