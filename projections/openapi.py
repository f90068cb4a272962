"""The OpenAPI 3.1 document of the projection's read API (hand-written; see :mod:`projections.api`)."""

from __future__ import annotations

from typing import Any

from projections.fold import COLUMNS

MAX_LIMIT = 1000
DEFAULT_LIMIT = 100
MAX_WAIT_S = 60.0
DEFAULT_WAIT_S = 30.0

_NULLABLE_INT = {"type": ["integer", "null"], "minimum": 0, "description": "ms since the epoch"}
_COLUMN_SCHEMAS: dict[str, dict[str, Any]] = {
    "host": {"type": "string", "description": "the host name (any characters)"},
    "deleted": {"type": "boolean", "description": "a tombstone: the claim is free with no holder"},
    "claim_gen": {"type": "integer", "minimum": 0},
    "record_gen": {"type": "integer", "minimum": 0},
    "op_kind": {"type": "string", "description": "claim.op.kind, empty before the first claim event"},
    "op_phase": {"type": "string"},
    "op_id": {"type": "string"},
    "exec": {"type": "string", "description": "claim.op.exec: the execution holder, or none"},
    "region": {"type": "string", "description": "the latest admission's region, or empty"},
    "incarnation": {"type": "string", "description": "claim.holder.incarnation, or empty"},
    "move_id": {"type": "string"},
    "move_state": {"type": "string"},
    "cut_phase": {"type": "string"},
    "landing_phase": {"type": "string"},
    "move_to": {"type": "string"},
    "move_from": {"type": "string"},
    "requested_at": _NULLABLE_INT,
    "cut_at": _NULLABLE_INT,
    "flipped_at": _NULLABLE_INT,
    "committed_at": _NULLABLE_INT,
    "opened_at": _NULLABLE_INT,
    "updated_at": {"type": "integer", "minimum": 0, "description": "the last applied event's time (ms)"},
    "seq": {"type": "integer", "minimum": 1, "description": "the HM_LEDGER seq of the last applied event"},
}
assert set(_COLUMN_SCHEMAS) == set(COLUMNS) - {"claim_json", "record_json"}

_CURSOR_PARAM = {
    "name": "cursor", "in": "query", "required": False,
    "description": "an opaque cursor from a snapshot or a previous page; absent: from the start",
    "schema": {"type": "string"},
}
_LIMIT_PARAM = {
    "name": "limit", "in": "query", "required": False,
    "schema": {"type": "integer", "minimum": 1, "maximum": MAX_LIMIT, "default": DEFAULT_LIMIT},
}
_TIMEOUT_PARAM = {
    "name": "timeout", "in": "query", "required": False,
    "description": "seconds to wait for a change",
    "schema": {"type": "number", "minimum": 0, "maximum": MAX_WAIT_S, "default": DEFAULT_WAIT_S},
}


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(name: str, description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": _ref(name)}}}


_BAD_REQUEST = _json("Error", "bad input: the reason says which parameter and why")
_RESYNC = _json("Resync", "the cursor is not from this projection (rebuilt, malformed or ahead): resync")


def document() -> dict[str, Any]:
    """The OpenAPI 3.1 document. Every route of :func:`projections.api.make_app` is here."""
    page = "ChangesPage"
    doc: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {
            "title": "hostmove projections",
            "version": "1",
            "description": (
                "Read-only snapshot and change feed of every host's claim and record (ARCHITECTURE §8). "
                "Take GET /v1/hosts, then follow GET /v1/changes (or /v1/changes/wait, or the SSE "
                "/v1/stream) from its cursor: no gap, no duplicate. A 409 resync means: take a new snapshot."
            ),
        },
        "paths": {
            "/openapi.json": {"get": {
                "operationId": "openapi", "summary": "this document",
                "responses": {"200": {"description": "the OpenAPI document",
                                      "content": {"application/json": {"schema": {"type": "object"}}}}},
            }},
            "/healthz": {"get": {
                "operationId": "health",
                "summary": "the projection's identity, revision, position and errors",
                "responses": {"200": _json("Health", "readable"),
                              "503": _json("Health", "unreadable, or the projector halted")},
            }},
            "/v1/hosts": {"get": {
                "operationId": "snapshot",
                "summary": "all hosts and the revision they are at, read in one transaction",
                "parameters": [{
                    "name": "include_deleted", "in": "query", "required": False,
                    "schema": {"type": "boolean", "default": False},
                    "description": "also list tombstones (true/false/1/0)",
                }],
                "responses": {"200": _json("Snapshot", "the snapshot"), "400": _BAD_REQUEST},
            }},
            "/v1/hosts/{host}": {"get": {
                "operationId": "host", "summary": "one host (tombstones too: see deleted)",
                "parameters": [{
                    "name": "host", "in": "path", "required": True, "schema": {"type": "string"},
                    "description": (
                        "the host name, percent-encoded (it may contain dots, slashes, anything); encode a "
                        "name that is . or .. as %2E, since clients resolve dot segments"
                    ),
                }],
                "responses": {"200": _json("Host", "the host"),
                              "404": _json("Error", "no such host in this projection")},
            }},
            "/v1/changes": {"get": {
                "operationId": "changes",
                "summary": "hosts changed after the cursor, ordered by revision, each once at its latest",
                "parameters": [_CURSOR_PARAM, _LIMIT_PARAM],
                "responses": {"200": _json(page, "a page; follow cursor while more"),
                              "400": _BAD_REQUEST, "409": _RESYNC},
            }},
            "/v1/changes/wait": {"get": {
                "operationId": "waitChanges",
                "summary": "long-poll: /v1/changes, answered at the first change (or empty at the timeout)",
                "parameters": [_CURSOR_PARAM, _LIMIT_PARAM, _TIMEOUT_PARAM],
                "responses": {"200": _json(page, "changes, or an empty page after the timeout"),
                              "400": _BAD_REQUEST, "409": _RESYNC},
            }},
            "/v1/stream": {"get": {
                "operationId": "stream",
                "summary": "Server-Sent Events from the cursor (or the Last-Event-ID header)",
                "description": (
                    "Events: `change` (data: a Host; id: the cursor after it), `caught-up` (data: "
                    "{revision}; id: the cursor), `resync` (data: a Resync; the stream then ends). "
                    "Comment lines keep the connection alive."
                ),
                "parameters": [_CURSOR_PARAM, {
                    "name": "Last-Event-ID", "in": "header", "required": False, "schema": {"type": "string"},
                    "description": "the EventSource reconnect cursor; the query's cursor wins",
                }],
                "responses": {
                    "200": {"description": "an event stream",
                            "content": {"text/event-stream": {"schema": {"type": "string"}}}},
                    "400": _BAD_REQUEST, "409": _RESYNC,
                },
            }},
        },
        "components": {"schemas": {
            "Host": {
                "type": "object",
                "properties": {
                    **_COLUMN_SCHEMAS,
                    "revision": {"type": "integer", "minimum": 1, "description": "the host's revision"},
                    "claim": {"type": ["object", "null"], "description": "the full claim"},
                    "record": {"type": ["object", "null"], "description": "the full record"},
                },
                "required": [*_COLUMN_SCHEMAS, "revision", "claim", "record"],
            },
            "Snapshot": {
                "type": "object",
                "properties": {
                    "identity": {"type": "string", "pattern": "^[0-9a-f]{32}$"},
                    "revision": {"type": "integer", "minimum": 0},
                    "position": {"type": "integer", "minimum": 0, "description": "last applied stream seq"},
                    "cursor": {"type": "string", "description": "follow the feed from here"},
                    "hosts": {"type": "array", "items": _ref("Host")},
                },
                "required": ["identity", "revision", "position", "cursor", "hosts"],
            },
            page: {
                "type": "object",
                "properties": {
                    "identity": {"type": "string"},
                    "revision": {"type": "integer", "minimum": 0},
                    "cursor": {"type": "string"},
                    "more": {"type": "boolean"},
                    "changes": {"type": "array", "items": _ref("Host")},
                },
                "required": ["identity", "revision", "cursor", "more", "changes"],
            },
            "Resync": {
                "type": "object",
                "properties": {"resync": {"const": True}, "reason": {"type": "string"},
                               "identity": {"type": "string"}},
                "required": ["resync", "reason", "identity"],
            },
            "Error": {
                "type": "object",
                "properties": {"error": {"type": "string"}, "reason": {"type": "string"}},
                "required": ["error", "reason"],
            },
            "Health": {
                "type": "object",
                "properties": {
                    "ok": {"type": "boolean"}, "identity": {"type": "string"},
                    "revision": {"type": "integer"}, "position": {"type": "integer"},
                    "errors": {"type": "object", "additionalProperties": {"type": "integer"}},
                    "projector": {"type": "string"}, "reason": {"type": "string"},
                },
                "required": ["ok"],
            },
        }},
    }
    from projections.console_openapi import PATHS, SCHEMAS, SECURITY_SCHEMES  # the console's routes (issue 20)

    doc["paths"].update(PATHS)
    doc["components"]["schemas"].update(SCHEMAS)
    doc["components"]["securitySchemes"] = SECURITY_SCHEMES
    return doc
