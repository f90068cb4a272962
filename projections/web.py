"""What every route of the projections' HTTP service shares (ARCHITECTURE §8): the application's keys and the
strict reading of a query string. The read API (:mod:`projections.api`), the console's routes
(:mod:`projections.console_api`) and the dashboard (:mod:`projections.dashboard`) import it."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import msgspec
from aiohttp import web

from kernel.ports import Clock
from projections.runner import Projector
from projections.store import ProjectionStore

STORE: web.AppKey[ProjectionStore] = web.AppKey("store", ProjectionStore)
CLOCK: web.AppKey[Clock] = web.AppKey("clock", object)  # type: ignore[arg-type]
SETTINGS: web.AppKey[dict[str, float]] = web.AppKey("settings", dict)
PROJECTOR: web.AppKey[Projector | None] = web.AppKey("projector", object)  # type: ignore[arg-type]
PROJECTOR_STATE: web.AppKey[dict[str, str]] = web.AppKey("projector_state", dict)

_ENCODER = msgspec.json.Encoder()
_TRUE = {"true": True, "1": True, "false": False, "0": False}


def _dumps(obj: Any) -> str:
    return _ENCODER.encode(obj).decode("utf-8")


def _json(obj: Any, status: int = 200) -> web.Response:
    return web.json_response(obj, status=status, dumps=_dumps)


class BadRequest(Exception):
    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(reason)


def _params(request: web.Request, allowed: Iterable[str]) -> dict[str, str]:
    allowed = tuple(allowed)
    out: dict[str, str] = {}
    for key, value in request.query.items():
        if key not in allowed:
            names = ", ".join(allowed) or "none"
            raise BadRequest(f"unknown query parameter {key!r} (allowed: {names})")
        if key in out:
            raise BadRequest(f"query parameter {key!r} given more than once")
        out[key] = value
    return out


__all__ = ["CLOCK", "PROJECTOR", "PROJECTOR_STATE", "SETTINGS", "STORE", "BadRequest"]
