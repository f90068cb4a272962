"""Health of a long-running service: ``/livez`` and ``/readyz`` on a small HTTP port (issue 11 item 3).

Every ``hostmove serve`` service (door, projections, relay, recovery, box) starts one :class:`Health` before it
connects to anything, so a service waiting for NATS or S3 at start already answers:

- ``GET /livez``: the process works (its event loop answers and no part of it declared itself dead). 200 or 503.
- ``GET /readyz``: every dependency answers: ``nats`` (the connection is up and JetStream answered a stream info
  within the last few seconds), ``s3`` (a cheap request succeeded recently), and for the projections
  ``projection`` (the projector runs and its lag behind the stream is within a bound). 200 or 503.
- ``GET /metrics``: the process's Prometheus metrics (:mod:`kernel.metrics`, issue 19 item 5), text exposition.

Both answer JSON naming each dependency's state and, when it is not ok, the reason::

    {"service": "relay", "ready": false, "dependencies": {"nats": {"ok": false, "reason": "NATS at ... is not
     connected (reconnecting for 4 s)", "for_s": 4.1, "checked_s_ago": 0.3}, "s3": {"ok": true, ...}}}

Dependencies are checked in the background every ``interval_s`` with a bounded ``timeout_s`` each (never on the
request path, so a probe of ``/readyz`` is cheap and never waits on a dead dependency); a check older than
``stale_s`` counts as failed. Each change of a dependency's state is logged once.

The port is ``--health-port`` or ``HOSTMOVE_HEALTH_PORT`` (default 0: a free port, printed and logged at start);
the address ``HOSTMOVE_HEALTH_BIND`` (default ``127.0.0.1``; ``0.0.0.0`` in a container).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from kernel import metrics

log = logging.getLogger("hostmove.health")

PORT_ENV = "HOSTMOVE_HEALTH_PORT"
BIND_ENV = "HOSTMOVE_HEALTH_BIND"
DEFAULT_BIND = "127.0.0.1"
INTERVAL_S = 1.0
TIMEOUT_S = 2.0

Check = Callable[[], Awaitable[Mapping[str, Any] | None]]
"""A dependency's check: returns details (or None) when it answers, raises when it does not (the exception's text is
the reason shown)."""


@dataclass
class DependencyState:
    ok: bool = False
    reason: str = "not checked yet"
    changed_at: float = field(default_factory=time.monotonic)
    checked_at: float | None = None
    detail: dict[str, Any] = field(default_factory=dict)


def health_address(port: int | None = None, env: Mapping[str, str] | None = None) -> tuple[str, int]:
    """``(bind, port)`` from the flag (when given) or the environment; a bad value raises ``ValueError``."""
    env = os.environ if env is None else env
    bind = env.get(BIND_ENV, "").strip() or DEFAULT_BIND
    if port is None:
        raw = env.get(PORT_ENV, "").strip() or "0"
        if not raw.isdigit():
            raise ValueError(f"{PORT_ENV} must be a port number (0: a free port), not {raw!r}")
        port = int(raw)
    if not 0 <= port <= 65535:
        raise ValueError(f"the health port must be 0 to 65535, not {port}")
    return bind, port


def _reason(exc: BaseException) -> str:
    """A failed check's reason: the exception's first line (its type when it has no text)."""
    text = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ""
    return text or type(exc).__name__


class Health:
    """One service's liveness and readiness (see the module doc)."""

    def __init__(self, service: str, *, interval_s: float = INTERVAL_S, timeout_s: float = TIMEOUT_S,
                 stale_s: float | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.service = service
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.stale_s = stale_s if stale_s is not None else interval_s + timeout_s + 1.0
        self.clock = clock
        self.started_at = clock()
        self.deps: dict[str, DependencyState] = {}
        self._checks: dict[str, Check] = {}
        self._dead: str | None = None
        self._task: asyncio.Task[None] | None = None
        self._runner: web.AppRunner | None = None
        self.port: int | None = None
        self.bind: str | None = None

    # -- what the service tells ------------------------------------------------------------------------------

    def expect(self, *names: str, reason: str = "not checked yet") -> None:
        """Declare dependencies before their checks exist (e.g. while the first connect waits): not ready."""
        for name in names:
            self.deps.setdefault(name, DependencyState(reason=reason, changed_at=self.clock()))

    def set(self, name: str, ok: bool, reason: str = "", **detail: Any) -> None:
        """Record a dependency's state now (a push, beside or instead of a check)."""
        now = self.clock()
        state = self.deps.setdefault(name, DependencyState(changed_at=now))
        reason = "" if ok else (reason or "not ready")
        first = state.checked_at is None
        if ok != state.ok:
            if ok and first:
                log.info("%s: %s is ready", self.service, name)
            elif ok:
                log.warning("%s: %s is ready again after %.1f s", self.service, name, now - state.changed_at)
            else:
                log.warning("%s: %s is not ready: %s", self.service, name, reason)
            state.changed_at = now
        elif first and not ok:
            log.warning("%s: %s is not ready: %s", self.service, name, reason)
        state.ok, state.reason, state.checked_at, state.detail = ok, reason, now, dict(detail)

    def check(self, name: str, fn: Check) -> None:
        """Run ``fn`` every ``interval_s`` (bounded by ``timeout_s``) and record its answer as ``name``."""
        self.expect(name)
        self._checks[name] = fn

    def dead(self, reason: str) -> None:
        """A part of the process stopped for good: ``/livez`` fails from now on (a restart is the remedy)."""
        if self._dead is None:
            log.error("%s is not live: %s", self.service, reason)
        self._dead = reason

    # -- answers ---------------------------------------------------------------------------------------------

    def _dep_body(self, name: str, state: DependencyState, now: float) -> dict[str, Any]:
        ok, reason = state.ok, state.reason
        if ok and name in self._checks and (state.checked_at is None or now - state.checked_at > self.stale_s):
            ok, reason = False, f"no answer to the check in {now - (state.checked_at or self.started_at):.0f} s"
        body: dict[str, Any] = {"ok": ok, "for_s": round(now - state.changed_at, 1)}
        if not ok:
            body["reason"] = reason
        if state.checked_at is not None:
            body["checked_s_ago"] = round(now - state.checked_at, 1)
        body.update(state.detail)
        return body

    def readiness(self) -> tuple[bool, dict[str, Any]]:
        now = self.clock()
        deps = {name: self._dep_body(name, state, now) for name, state in sorted(self.deps.items())}
        ready = self._dead is None and all(d["ok"] for d in deps.values())
        body: dict[str, Any] = {"service": self.service, "ready": ready, "dependencies": deps}
        if self._dead is not None:
            body["reason"] = f"not live: {self._dead}"
        elif not ready:
            body["reason"] = "; ".join(f"{n}: {d.get('reason', '')}" for n, d in deps.items() if not d["ok"])
        return ready, body

    def liveness(self) -> tuple[bool, dict[str, Any]]:
        body: dict[str, Any] = {"service": self.service, "live": self._dead is None,
                                "uptime_s": round(self.clock() - self.started_at, 1)}
        if self._dead is not None:
            body["reason"] = self._dead
        return self._dead is None, body

    # -- the checks ------------------------------------------------------------------------------------------

    async def check_once(self) -> None:
        """Run every check once, concurrently, each bounded by ``timeout_s``."""

        async def one(name: str, fn: Check) -> None:
            try:
                detail = await asyncio.wait_for(fn(), self.timeout_s)
            except asyncio.CancelledError:
                raise
            except TimeoutError:
                self.set(name, False, f"no answer in {self.timeout_s:g} s")
            except Exception as exc:  # noqa: BLE001 - a failed check is the answer
                self.set(name, False, _reason(exc))
            else:
                self.set(name, True, **dict(detail or {}))

        await asyncio.gather(*(one(n, fn) for n, fn in list(self._checks.items())))

    async def _loop(self) -> None:
        while True:
            started = self.clock()
            try:
                await self.check_once()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - the loop never dies of a check
                log.exception("%s: health checks failed", self.service)
            await asyncio.sleep(max(0.05, self.interval_s - (self.clock() - started)))

    # -- the server ------------------------------------------------------------------------------------------

    def add_routes(self, app: web.Application) -> None:
        async def livez(_request: web.Request) -> web.Response:
            ok, body = self.liveness()
            return web.json_response(body, status=200 if ok else 503)

        async def readyz(_request: web.Request) -> web.Response:
            ok, body = self.readiness()
            return web.json_response(body, status=200 if ok else 503)

        async def metrics_(_request: web.Request) -> web.Response:
            return web.Response(body=metrics.exposition(), headers={"Content-Type": metrics.CONTENT_TYPE})

        app.router.add_get("/livez", livez)
        app.router.add_get("/readyz", readyz)
        app.router.add_get("/metrics", metrics_)

    async def start(self, bind: str = DEFAULT_BIND, port: int = 0) -> int:
        """Serve ``/livez`` and ``/readyz`` on ``bind:port`` (0: a free port) and start the checks; answers the
        port."""
        app = web.Application()
        self.add_routes(app)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, bind, port)
        await site.start()
        self._runner = runner
        self.bind = bind
        self.port = next((a[1] for a in runner.addresses if isinstance(a, tuple)), port)
        self._task = asyncio.ensure_future(self._loop())
        return self.port

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()


__all__ = ["BIND_ENV", "PORT_ENV", "Check", "DependencyState", "Health", "health_address"]
