"""The OpenAPI description of the console's routes (:mod:`projections.console_api`), merged into
:func:`projections.openapi.document`."""

from __future__ import annotations

from typing import Any

_MS = {"type": ["integer", "null"], "description": "ms since the epoch"}
_STR = {"type": "string"}


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _ok(name: str, description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": _ref(name)}}}


_ERR = {"description": "", "content": {"application/json": {"schema": _ref("Error")}}}


def _err(description: str) -> dict[str, Any]:
    return {**_ERR, "description": description}


_GUARDED = {"401": _err("no status or operator token (or the console is closed): the reason says what opens it"),
            "503": _ok("Unavailable", "a dependency did not answer: the object store (s3) or NATS (nats)")}

_TIMING = {
    "type": "object",
    "properties": {"name": {"enum": ["prepare", "cut", "land", "offline"]},
                   "elapsed_ms": {"type": ["integer", "null"]}, "running": {"type": "boolean"},
                   "budget_s": {"type": ["number", "null"]}, "over": {"type": "boolean"}},
    "required": ["name", "elapsed_ms", "running", "budget_s", "over"],
}
_ACTOR = {"type": "object", "properties": {"service": _STR, "box": _STR}, "required": ["service", "box"]}

SCHEMAS: dict[str, Any] = {
    "Timing": _TIMING,
    "Box": {
        "type": "object",
        "properties": {
            "label": _STR, "region": _STR, "registered_at": {"type": "integer"}, "fenced_at": _MS,
            "fenced": {"type": "boolean"}, "lost": {"type": "boolean"},
            "eligible": {"type": "boolean", "description": "a move may choose it"},
            "why": {"type": "string", "description": "why not eligible, or empty"},
            "moves_protocol": {"type": "integer"},
            "running": {"type": "array", "items": _STR, "description": "the hosts it executes"},
        },
        "required": ["label", "region", "registered_at", "fenced_at", "fenced", "lost", "eligible", "why",
                     "moves_protocol", "running"],
    },
    "Boxes": {"type": "object", "properties": {"roster_gen": {"type": "integer"},
                                               "boxes": {"type": "array", "items": _ref("Box")}},
              "required": ["roster_gen", "boxes"]},
    "MoveRow": {
        "type": "object",
        "properties": {
            "host": _STR, "move_id": _STR, "live": {"type": "boolean"}, "state": _STR, "cut": _STR,
            "cut_phase": _STR, "landing_phase": _STR, "from": _STR, "to": _STR, "requested_at": _MS,
            "requested_by": _STR, "reason": _STR,
            "outcome": {"type": ["string", "null"], "enum": ["done", "rolled_back", "aborted", None]},
            "at": _MS, "timings": {"type": "array", "items": _ref("Timing")},
        },
        "required": ["host", "move_id", "live", "state", "outcome", "at", "timings", "from", "to"],
    },
    "Moves": {"type": "object", "properties": {"revision": {"type": "integer"},
                                               "moves": {"type": "array", "items": _ref("MoveRow")}},
              "required": ["revision", "moves"]},
    "LogEntry": {
        "type": "object",
        "properties": {
            "v": {"const": 1}, "host": _STR, "move_id": _STR, "gen": {"type": "integer"}, "at": {"type": "integer"},
            "name": _STR, "actor": _ACTOR, "causation": _STR, "state": _STR, "cut_phase": _STR,
            "landing_phase": _STR, "rollback_target_phase": _STR, "rollback_source_phase": _STR, "from": _STR,
            "to": _STR, "reason": _STR, "digests": {"type": "object", "additionalProperties": _STR},
            "timings": {"type": "array", "items": _ref("Timing")},
        },
        "required": ["v", "host", "move_id", "gen", "at", "name", "actor", "state", "digests", "timings"],
    },
    "LogSummary": {
        "type": "object",
        "properties": {
            "v": {"const": 1}, "host": _STR, "move_id": _STR,
            "outcome": {"enum": ["done", "rolled_back", "aborted"]}, "closed_at": {"type": "integer"},
            "closed_by": _ACTOR, "from": _STR, "to": _STR, "cut": _STR, "requested_by": _STR, "requested_at": _MS,
            "reason": _STR, "rolled_back": {"type": "boolean"}, "timings": {"type": "array", "items": _ref("Timing")},
        },
        "required": ["v", "host", "move_id", "outcome", "closed_at", "closed_by", "timings"],
    },
    "ClaimLogEntry": {
        "type": "object",
        "properties": {
            "v": {"const": 1}, "host": _STR, "move_id": _STR, "gen": {"type": "integer"}, "at": {"type": "integer"},
            "name": _STR, "actor": _ACTOR, "causation": _STR,
            "kind": {"type": "string", "description": "claim.op.kind after the transition"}, "phase": _STR,
            "exec": {"type": "string", "description": "the execution holder after it"},
            "participants": {"type": "array", "items": _STR},
            "digests": {"type": "object", "additionalProperties": _STR},
        },
        "required": ["v", "host", "move_id", "gen", "at", "name", "actor", "kind", "phase", "exec", "participants",
                     "digests"],
    },
    "MoveLog": {
        "type": "object",
        "properties": {"host": _STR, "move_id": _STR, "entries": {"type": "array", "items": _ref("LogEntry")},
                       "claim_entries": {"type": "array", "items": _ref("ClaimLogEntry")},
                       "summary": {"oneOf": [_ref("LogSummary"), {"type": "null"}]}},
        "required": ["host", "move_id", "entries", "claim_entries", "summary"],
    },
    "HistoryRow": {
        "type": "object",
        "properties": {"move_id": _STR, "host": _STR,
                       "outcome": {"type": ["string", "null"], "enum": ["done", "rolled_back", "aborted", None]},
                       "requested_at": _MS, "closed_at": _MS, "from": {"type": ["string", "null"]},
                       "to": {"type": ["string", "null"]}, "state": _STR, "reason": _STR,
                       "timings": {"type": "array", "items": _ref("Timing")}},
        "required": ["move_id", "host", "outcome"],
    },
    "History": {"type": "object", "properties": {"host": _STR,
                                                 "moves": {"type": "array", "items": _ref("HistoryRow")}},
                "required": ["host", "moves"]},
    "Alert": {
        "type": "object",
        "properties": {"seq": {"type": "integer", "minimum": 1}, "kind": _STR, "subject": _STR, "id": _STR,
                       "at": _MS, "incident": {"type": "boolean"}, "sentence": _STR, "actor": _ACTOR,
                       "payload": {"type": "object"}},
        "required": ["seq", "kind", "subject", "id", "at", "incident", "sentence", "actor", "payload"],
    },
    "Alerts": {"type": "object", "properties": {"alerts": {"type": "array", "items": _ref("Alert")},
                                                "last_seq": {"type": "integer", "minimum": 0}},
               "required": ["alerts", "last_seq"]},
    "Unavailable": {"type": "object", "properties": {"error": {"const": "unavailable"}, "reason": _STR,
                                                     "dependency": {"enum": ["s3", "nats"]}},
                    "required": ["error", "reason", "dependency"]},
}


def _get(op: str, summary: str, ok: dict[str, Any], params: list[dict[str, Any]] | None = None,
         extra: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"get": {"operationId": op, "summary": summary, "parameters": params or [],
                    "security": [{"bearer": []}, {"cookie": []}, {}],
                    "responses": {"200": ok, **_GUARDED, **(extra or {})}}}


def _q(name: str, description: str, schema: dict[str, Any], required: bool = False) -> dict[str, Any]:
    return {"name": name, "in": "query", "required": required, "description": description, "schema": schema}


PATHS: dict[str, Any] = {
    "/v1/boxes": _get("boxes", "every box of the roster: region, eligibility, fenced or lost, running hosts",
                      _ok("Boxes", "the boxes")),
    "/v1/boxes/{label}": _get("box", "one box", _ok("Box", "the box"),
                              [{"name": "label", "in": "path", "required": True, "schema": _STR}],
                              {"404": _err("no such box in the roster")}),
    "/v1/moves": _get("moves", "each host's live move (§13 timings against budgets) and last move",
                      _ok("Moves", "the moves, live first, newest first"),
                      [_q("live", "only the live moves (true/false/1/0)", {"type": "boolean", "default": False})],
                      {"400": _err("bad input")}),
    "/v1/moves/{move_id}": _get("moveLog", "one move's log (§13): its transitions and its summary once closed",
                                _ok("MoveLog", "the move log"),
                                [{"name": "move_id", "in": "path", "required": True, "schema": _STR},
                                 _q("host", "the host it moved (default: found by the move's id)", _STR)],
                                {"404": _err("the move log holds no such move"), "400": _err("bad input")}),
    "/v1/history": _get("history", "a host's moves from the move log (§13), oldest first",
                        _ok("History", "the host's moves"),
                        [_q("host", "the host", {"type": "string", "minLength": 1}, True)],
                        {"400": _err("no host given")}),
    "/v1/alerts": _get("alerts", "alerts and incidents raised on hm.alert.> (the newest 200 after a sequence)",
                       _ok("Alerts", "the alerts; follow with after=last_seq"),
                       [_q("after", "only alerts after this facts-stream sequence",
                           {"type": "integer", "minimum": 0, "maximum": 2**53 - 1}),
                        _q("limit", "at most this many (the newest)",
                           {"type": "integer", "minimum": 1, "maximum": 200})],
                       {"400": _err("bad input")}),
}

SECURITY_SCHEMES = {"bearer": {"type": "http", "scheme": "bearer", "description": "a status or operator token"},
                    "cookie": {"type": "apiKey", "in": "cookie", "name": "hm_token",
                               "description": "the dashboard's sign-in"}}

__all__ = ["PATHS", "SCHEMAS", "SECURITY_SCHEMES"]
