"""The door: the operator's HTTP API for moves (spec §7.1, §7.4, §7.11, §12; ARCHITECTURE §2).

Routes (the OpenAPI document, :func:`document`, lists exactly these):

- ``POST /v1/hosts/{host}/move`` ``{"to": <region>, "cut": "auto" | "manual"}``: the move request, K2;
- ``GET  /v1/hosts/{host}/move[?detail=1]``: the move's status;
- ``POST /v1/hosts/{host}/move/cut``: the manual cut request (§7.4 ``requested``);
- ``POST /v1/hosts/{host}/move/abort``: the abort decision (§7.11);
- ``POST /v1/hosts/{host}/move/resolve`` ``{"retry": true}``: a stuck move's recovery probes again (§7.10);
- ``POST /v1/hosts/{host}/resolve`` ``{"clear_failed": true}``: a failed route is cleared by its box (§5.1 step 9);
- ``POST /v1/hosts/{host}/create`` ``{"box": <label>}``: set up a host (claim spec §4);
- ``GET  /openapi.json``, ``GET /healthz``: open.

**Auth (§12, M18).** Every mutation needs an operator token (``Authorization: Bearer``); the status
GET also accepts a status-only token. Without a valid token every ``/v1`` route answers the family's
404, byte for byte the answer for an unknown path, before anything is read: it says nothing about
whether the host exists. Tokens are checked by digest (:mod:`services.door.auth`) and never logged.

**Writes.** Only through the ledger (ARCHITECTURE §4), with the pure deciders of
:mod:`services.door.decide`. A refusal writes nothing. A read that fails never acts (C6): the answer
is a 503 with a plain sentence.

**Outages** (issue 11 item 3). A dependency that does not answer gets its own 503, naming it in ``dependency``
with a ``Retry-After``: a write while NATS is unreachable is refused before anything is read or written
(``nats``, M-R36: nothing was changed), and a request S3 does not answer is ``s3`` (M-R37). Neither is a refusal
of the request; reads of the status go on while only NATS is down.

**Not checked here (§7.1).** The box-side refusals, a refused registry column, a ``-sidecar.env``
and a private store bound to the instance, live on the source box: they are the source's first step
(later work) and every box step re-checks them; the door does not pretend to know them.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from aiohttp import web

from bus.log import LogUnavailable, require_available
from events.base import decode
from events.claim import AppRef, Claim
from events.copy import say
from events.durable import MAX_SAFE_INTEGER
from events.ids import new_incarnation, new_op_id
from events.record import Record
from kernel.logctx import ctx
from kernel.ports import Clock, Random
from services.apps.manifest import Release
from services.apps.releases import ReleaseError, list_releases, read_default_app, read_release
from services.box.roster import Roster, read_roster
from services.door.answers import (
    RETRY_AFTER_S,
    Answer,
    Unreadable,
    reading,
    refusal_answer,
    refused_transition,
    unavailable_answer,
)
from services.door.auth import Identity, TokenSet
from services.door.decide import (
    APP_PATTERN,
    CONSOLE_PROTOCOL,
    FLOOR_KEY,
    NAME_PATTERN,
    DoorRefusal,
    Floor,
    MoveRequest,
    check_host,
    claim_summary,
    decide_abort,
    decide_cut,
    decide_move_claim,
    decide_move_record,
    intent_matches,
    parse_create_request,
    parse_empty,
    parse_flag,
    parse_move_request,
    refuse,
    status_view,
)
from services.hosts.create import create_host
from services.ledger.ledger import Committed, Conflict, Ledger, NoChange, Refusal
from services.move.resolve import NotStuck, decide_clear_failed, decide_retry
from services.objstore.port import Got, StoreUnavailable
from services.target.readiness import TargetReport
from services.target.readiness import report_key as readiness_key

log = logging.getLogger("hostmove.door")

MAX_BODY = 64 * 1024
_ENCODER = msgspec.json.Encoder()


class Door:
    """The door's effects: read, decide (pure), CAS through the ledger, answer."""

    def __init__(
        self, ledger: Ledger, *, clock: Clock, rng: Random, console_protocol: int = CONSOLE_PROTOCOL
    ) -> None:
        self.ledger = ledger
        self.clock = clock
        self.rng = rng
        self.console_protocol = console_protocol

    # -- reads ------------------------------------------------------------------------------------

    def require_bus(self) -> None:
        """Before a write: NATS answers (a write it cannot publish is refused before anything is read or written:
        the door never commits an object its event cannot follow)."""
        with reading("The event stream"):
            require_available(self.ledger.events)

    async def roster(self) -> Roster:
        with reading("The roster (control/roster.json)"):
            roster, _ = await read_roster(self.ledger.store, self.ledger.bucket)
        return roster if roster is not None else Roster(gen=1)

    async def floor(self) -> Floor | None:
        """``control/moves-protocol.json`` if present (§11)."""
        with reading(f"The protocol floor ({FLOOR_KEY})"):
            got = await self.ledger.store.get(self.ledger.bucket, FLOOR_KEY)
            return decode(got.body, Floor) if isinstance(got, Got) else None

    async def app_release(self, host: str) -> tuple[AppRef, Release] | None:
        """The release the host's incarnation runs (its claim's, else the deployment's default app), read by its
        digest; None when the host names none (a move then refuses nothing of an app's declarations)."""
        claim = await self.claim(host)
        with reading(f"The app release of {host}"):
            ref = claim.holder.app if claim is not None and claim.holder is not None else None
            ref = ref or await read_default_app(self.ledger.store, self.ledger.bucket)
            if ref is None:
                return None
            try:
                release, ref, _body = await read_release(self.ledger.store, self.ledger.bucket, ref.name, ref=ref)
            except ReleaseError as exc:
                raise Unreadable(f"The app release of {host} ({exc})", corrupt=True) from None
        return ref, release

    async def claim(self, host: str) -> Claim | None:
        with reading(f"The claim of {host}"):
            return (await self.ledger.read_claim(host)).state

    async def record(self, host: str) -> Record | None:
        with reading(f"The record of {host}"):
            return (await self.ledger.read_record(host)).state

    # -- the move request (§7.1, K2) --------------------------------------------------------------

    async def request_move(self, host: str, request: MoveRequest, who: Identity) -> Answer:
        """Claim first, then record (D§13 ambiguity 1). A retry of the same request after a crash
        between the two finishes the record; a retry after both answers the existing move."""
        self.require_bus()
        floor = await self.floor()
        record = await self.record(host)
        release = await self.app_release(host)
        roster = await self.roster()  # last, right before the decision: a box fenced meanwhile is never chosen
        move_id = new_op_id("mv", self.rng)
        decide = functools.partial(
            decide_move_claim, host=host, record=record, roster=roster, floor=floor, request=request,
            move_id=move_id, operator=who.label, now_ms=self.clock.now_ms(), console=self.console_protocol,
            release=release,
        )
        with reading(f"The claim of {host}"):
            out = await self.ledger.transition("claim", host, "move-request", decide,
                                               causation=f"door: operator {who.label}")
        if isinstance(out, Refusal):
            log.info("move of %s refused (operator %s): %s", host, who.label, out.reason,
                     extra=ctx(host=host, phase="move-request", reason=out.reason, operator=who.label))
            return refusal_answer(out)
        if isinstance(out, Conflict):
            return refusal_answer(refuse(409, "M-R17", host=host))
        started = isinstance(out, Committed)
        claim = out.state if isinstance(out, Committed) else await self.claim(host)
        if claim is None or not intent_matches(claim.op, request):
            return refusal_answer(refuse(409, "M-R17", host=host))
        if started:
            intent = claim.op.intent
            log.info("move %s of %s requested from %s to %s (target %s, operator %s)", claim.op.id, host,
                     intent.get("from"), request.to, intent.get("target"), who.label,
                     extra=ctx(host=host, op_id=claim.op.id, phase="move-request", operator=who.label,
                               from_region=intent.get("from"), to_region=request.to, target=intent.get("target")))
        return await self._finish_record(host, claim, started=started)

    async def _finish_record(self, host: str, claim: Claim, *, started: bool) -> Answer:
        decide = functools.partial(decide_move_record, host=host, claim=claim, now_ms=self.clock.now_ms())
        with reading(f"The record of {host}"):
            out = await self.ledger.transition("record", host, "move-requested", decide,
                                               causation=f"move {claim.op.id}")
        if isinstance(out, Refusal):
            log.warning("move %s of %s holds the claim but its record was refused: %s", claim.op.id, host, out.reason,
                        extra=ctx(host=host, op_id=claim.op.id, phase="move-requested", reason=out.reason))
            return refusal_answer(out)
        if isinstance(out, Conflict):
            return refusal_answer(refuse(409, "M-R17", host=host))
        if isinstance(out, Committed) and not started:
            log.info("move %s of %s: record finished by a retry", claim.op.id, host,
                     extra=ctx(host=host, op_id=claim.op.id, phase="move-requested"))
        record = out.state if isinstance(out, Committed) else await self.record(host)
        view = status_view(host, claim, record, detail=False, now_ms=self.clock.now_ms())
        view.update(started=started, record_written=isinstance(out, Committed))
        if started:
            intent = claim.op.intent
            view.update(copy="M-C1", message=say("M-C1", host=host, from_region=intent["from"], to_region=intent["to"]))
        return Answer(201 if started else 200, view)

    # -- cut, abort, status -----------------------------------------------------------------------

    async def _record_step(
        self, host: str, name: str, decide: Callable[..., Record | NoChange | Refusal], who: Identity,
        copy_id: str, **kw: Any,
    ) -> Answer:
        self.require_bus()
        claim = await self.claim(host)
        if claim is None:
            return refusal_answer(refuse(404, "M-R2", host=host))
        step = functools.partial(decide, host=host, claim=claim, now_ms=self.clock.now_ms(), **kw)
        with reading(f"The record of {host}"):
            out = await self.ledger.transition("record", host, name, step, causation=f"door: operator {who.label}")
        if isinstance(out, Refusal):
            log.info("%s of %s refused (operator %s): %s", name, host, who.label, out.reason,
                     extra=ctx(host=host, op_id=claim.op.id or None, phase=name, reason=out.reason,
                               operator=who.label))
            return refusal_answer(out)
        if isinstance(out, Conflict):
            return refusal_answer(refuse(409, "M-R17", host=host))
        record = out.state if isinstance(out, Committed) else await self.record(host)
        view = status_view(host, claim, record, detail=False, now_ms=self.clock.now_ms())
        move = record.move if record is not None else None
        if isinstance(out, Committed):
            log.info("%s of %s: move %s (operator %s)", name, host, move.id if move else "-", who.label,
                     extra=ctx(host=host, op_id=move.id if move else None, phase=name, operator=who.label))
        values: dict[str, str] = {"host": host}
        if copy_id == "M-S2":
            values["from_region"] = move.from_ if move is not None else "?"
        view.update(changed=isinstance(out, Committed), copy=copy_id, message=say(copy_id, **values))
        return Answer(200, view)

    async def cut(self, host: str, who: Identity) -> Answer:
        """The manual cut request (§7.4): ``ready`` → ``cutting`` at ``requested``."""
        return await self._record_step(host, "move-cut-requested", decide_cut, who, "M-S1")

    async def abort(self, host: str, who: Identity) -> Answer:
        """The abort decision (§7.11): ``state = aborted``; retirement and the close are later steps."""
        return await self._record_step(host, "move-abort", decide_abort, who, "M-S2", operator=who.label)

    async def resolve(self, host: str, who: Identity) -> Answer:
        """§7.10 ``resolve --retry`` (operator-only): a ``stuck`` move's recovery reruns its ``probing`` phase, a new
        admission (:func:`services.move.resolve.decide_retry`); refused with its sentence in every other state."""
        self.require_bus()
        claim = await self.claim(host)
        if claim is None:
            return refusal_answer(refuse(404, "M-R2", host=host))
        now = self.clock.now_ms()

        def decide(cur: Record | None) -> Record | NoChange | Refusal:
            out = decide_retry(cur, claim, now)
            if isinstance(out, NotStuck):
                return refuse(409, "M-R50", host=host, state=out.state) if out.state else refuse(
                    409, "M-R19", host=host)
            return out

        with reading(f"The record of {host}"):
            out = await self.ledger.transition("record", host, "move-retry", decide,
                                               causation=f"door: operator {who.label}")
        if (refused := refused_transition(out, host)) is not None:
            return refused
        record = out.state if isinstance(out, Committed) else await self.record(host)
        move = record.move if record is not None else None
        log.warning("resolve --retry of %s: move %s back to %s (operator %s)", host, move.id if move else "-",
                    move.state if move else "-", who.label,
                    extra=ctx(host=host, op_id=move.id if move else None, phase="move-retry", operator=who.label))
        view = status_view(host, claim, record, detail=False, now_ms=self.clock.now_ms())
        view.update(changed=isinstance(out, Committed), copy="M-S9",
                    message=say("M-S9", host=host, from_region=move.from_ if move is not None else "its region"))
        return Answer(200, view)

    async def clear_failed(self, host: str, who: Identity) -> Answer:
        """``hostmove host resolve --clear-failed`` (operator-only): the serving box clears a route the retry policy
        marked failed (§5.1 step 9). Journaled on the claim; refused while a move or any operation holds the host."""
        self.require_bus()
        claim = await self.claim(host)
        if claim is None:
            return refusal_answer(refuse(404, "M-R2", host=host))
        if claim.op.kind != "serving":
            if claim.op.id:
                return refusal_answer(refuse(409, "M-R51", host=host, kind=claim.op.kind, op_id=claim.op.id))
            return refusal_answer(refuse(409, "M-R52", host=host, kind=claim.op.kind))
        now = self.clock.now_ms()

        def decide(cur: Claim | None) -> Claim | NoChange | Refusal:
            out = decide_clear_failed(cur, who.label, now)
            if isinstance(out, Refusal) and cur is not None:
                return refuse(409, "M-R52", host=host, kind=cur.op.kind)
            return out

        with reading(f"The claim of {host}"):
            out = await self.ledger.transition("claim", host, "clear-failed", decide,
                                               causation=f"door: operator {who.label}")
        if (refused := refused_transition(out, host)) is not None:
            return refused
        log.warning("clear-failed of %s on %s requested (operator %s)", host, claim.op.exec, who.label,
                    extra=ctx(host=host, box=claim.op.exec, phase="clear-failed", operator=who.label))
        after = out.state if isinstance(out, Committed) else await self.claim(host)
        return Answer(200, {"host": host, "claim": claim_summary(after) if after is not None else None,
                            "changed": isinstance(out, Committed), "copy": "M-S10",
                            "message": say("M-S10", host=host, box=claim.op.exec)})

    async def status(self, host: str, *, detail: bool) -> Answer:
        claim = await self.claim(host)
        record = await self.record(host)
        if claim is None and record is None:
            return refusal_answer(refuse(404, "M-R2", host=host))
        view = status_view(host, claim, record, detail=detail, now_ms=self.clock.now_ms())
        if detail and record is not None and record.move is not None and isinstance(view.get("detail"), dict):
            view["detail"]["readiness"] = await self.readiness(host, record.move.id)
        return Answer(200, view)

    async def readiness(self, host: str, move_id: str) -> dict[str, Any] | None:
        """The target's readiness report of this move (§7.3 ``target.json``): when, whether ready, the failing
        checks and T11's rates and estimate; None before the target wrote one."""
        with reading(f"The readiness report of {host}"):
            got = await self.ledger.store.get(self.ledger.bucket, readiness_key(host, move_id))
        if not isinstance(got, Got):
            return None
        try:
            report = msgspec.json.decode(got.body, type=TargetReport)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return None
        return {"box": report.box, "at": report.at, "ready": report.ready,
                "failing": [{"check": c.check, "detail": c.detail} for c in report.failing()], "t11": report.t11}

    # -- create -----------------------------------------------------------------------------------

    async def create(self, host: str, box: str, who: Identity, *, app: str | None = None,
                     release: int | None = None) -> Answer:
        """Create ``host`` on ``box`` with a fresh incarnation, running release ``release`` (the newest when None)
        of ``app`` (issue 18). A retry while the claim is still ``creating`` on the same box finishes that creation
        with its incarnation (C2)."""
        self.require_bus()
        roster = await self.roster()
        entry = roster.box(box)
        if entry is None:
            return refusal_answer(refuse(409, "M-R23", box=box))
        if entry.fenced_at is not None:
            return refusal_answer(refuse(409, "M-R35", box=box, host=host, region=entry.region))
        ref: AppRef | None = None
        if app is not None:
            with reading(f"The releases of {app}"):
                numbers = (await list_releases(self.ledger.store, self.ledger.bucket, app)).get(app, [])
                if not numbers:
                    return refusal_answer(refuse(409, "M-R43", app=app, host=host))
                if release is not None and release not in numbers:
                    return refusal_answer(refuse(409, "M-R44", app=app, release=release, newest=numbers[-1]))
                try:
                    _r, ref, _body = await read_release(self.ledger.store, self.ledger.bucket, app, release)
                except ReleaseError as exc:
                    return refusal_answer(refuse(409, "M-R25", host=host, reason=str(exc)))
        claim = await self.claim(host)
        incarnation = new_incarnation(self.rng)
        if claim is not None:
            pending = claim.op.intent.get("create") if claim.op.kind == "creating" else None
            if pending is not None and pending.get("box") == box:
                incarnation = pending["incarnation"]
            elif claim.op.kind != "free" or claim.holder is not None:
                return refusal_answer(refuse(409, "M-R24", host=host, kind=claim.op.kind))
        with reading(f"The claim of {host}"):
            out = await create_host(self.ledger, host, box=box, region=entry.region, incarnation=incarnation,
                                    app=ref, causation=f"door: operator {who.label}")
        if isinstance(out, Refusal):
            return refusal_answer(refuse(409, "M-R25", host=host, reason=out.reason))
        log.info("host %s created on box %s (%s, operator %s)", host, box, entry.region, who.label,
                 extra=ctx(host=host, box=box, phase="create", region=entry.region, operator=who.label))
        return Answer(201, {
            "host": host, "claim": claim_summary(out.state), "region": entry.region,
            "incarnation": incarnation, "copy": "M-S3",
            "message": say("M-S3", host=host, box=box, region=entry.region),
        })


# -- HTTP -----------------------------------------------------------------------------------------

DOOR: web.AppKey[Door] = web.AppKey("door", Door)
TOKENS: web.AppKey[TokenSet] = web.AppKey("tokens", TokenSet)


def _dumps(obj: Any) -> str:
    return _ENCODER.encode(obj).decode("utf-8")


def _json(answer: Answer) -> web.Response:
    return web.json_response(answer.body, status=answer.status, dumps=_dumps)


def hidden() -> web.Response:
    """The family's 404 (§12): one fixed body for an unknown path, a missing token, a wrong token."""
    return _json(Answer(404, {"error": "not_found", "reason": say("M-R1"), "copy": "M-R1"}))


class _Hidden(Exception):
    pass


class _Refused(Exception):
    def __init__(self, refusal: DoorRefusal) -> None:
        super().__init__(refusal.reason)
        self.refusal = refusal


def _who(request: web.Request, *, operator: bool) -> Identity:
    who = request.app[TOKENS].identify_header(request.headers.get("Authorization"))
    if who is None or (operator and not who.operator):
        raise _Hidden()
    return who


def _host(request: web.Request) -> str:
    host = request.match_info["host"]
    bad = check_host(host)
    if bad is not None:
        raise _Refused(bad)
    return host


def _query(request: web.Request, allowed: tuple[str, ...]) -> dict[str, str]:
    out: dict[str, str] = {}
    for key, value in request.query.items():
        if key not in allowed or key in out:
            raise _Refused(refuse(400, "M-R29", name=repr(key[:40]), allowed=", ".join(allowed) or "none"))
        out[key] = value
    return out


async def _body(request: web.Request) -> bytes:
    return await request.read()


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Plain sentences for every failure; never a stack trace, a token or a store's own error text."""
    try:
        return await handler(request)
    except _Hidden:
        return hidden()
    except _Refused as exc:
        return _json(refusal_answer(exc.refusal))
    except Unreadable as exc:
        if exc.dependency is not None:
            log.warning("door %s %s: %s unreachable (%s)", request.method, request.path, exc.dependency,
                        exc.__cause__, extra={"dependency": exc.dependency, "reason": str(exc.__cause__),
                                              "method": request.method, "path": request.path})
            resp = _json(unavailable_answer(exc.dependency, exc.what))
            resp.headers["Retry-After"] = str(RETRY_AFTER_S)
            return resp
        log.error("door %s %s: %s unreadable (%s)", request.method, request.path, exc.what,
                  type(exc.__cause__).__name__, extra=ctx(host=request.match_info.get("host"),
                                                          reason=type(exc.__cause__).__name__,
                                                          method=request.method, path=request.path))
        copy_id = "M-R30" if exc.corrupt else "M-R18"
        return _json(Answer(503, {"error": "unavailable", "reason": say(copy_id, what=exc.what), "copy": copy_id}))
    except web.HTTPException as exc:
        if exc.status == 404:
            return hidden()
        if exc.status < 400:
            raise
        code = exc.reason.lower().replace(" ", "_")
        if exc.status == 405:
            allowed = exc.headers.get("Allow", "")
            body = {"error": code, "reason": say("M-R32", method=request.method, allowed=allowed), "copy": "M-R32"}
            resp = _json(Answer(405, body))
            resp.headers["Allow"] = allowed
            return resp
        if exc.status == 413:
            return _json(Answer(413, {"error": code, "reason": say("M-R33", limit=MAX_BODY), "copy": "M-R33"}))
        return _json(Answer(exc.status, {"error": code, "reason": exc.reason, "copy": ""}))
    except (LogUnavailable, StoreUnavailable) as exc:  # an outage outside a named read
        dependency = "nats" if isinstance(exc, LogUnavailable) else "s3"
        log.warning("door %s %s: %s unreachable (%s)", request.method, request.path, dependency, exc,
                    extra={"dependency": dependency, "reason": str(exc), "method": request.method,
                           "path": request.path})
        resp = _json(unavailable_answer(dependency, "this request"))
        resp.headers["Retry-After"] = str(RETRY_AFTER_S)
        return resp
    except Exception:
        log.exception("door %s %s failed", request.method, request.path,
                      extra=ctx(host=request.match_info.get("host"), method=request.method, path=request.path))
        return _json(Answer(500, {"error": "internal", "reason": say("M-R31"), "copy": "M-R31"}))


async def post_move(request: web.Request) -> web.Response:
    who = _who(request, operator=True)
    host = _host(request)
    _query(request, ())
    parsed = parse_move_request(await _body(request))
    if isinstance(parsed, DoorRefusal):
        raise _Refused(parsed)
    return _json(await request.app[DOOR].request_move(host, parsed, who))


async def get_move(request: web.Request) -> web.Response:
    _who(request, operator=False)
    host = _host(request)
    raw = _query(request, ("detail",)).get("detail", "0").lower()
    if raw not in ("0", "1", "true", "false"):
        raise _Refused(refuse(400, "M-R38", name="detail", reason="it must be 1, 0, true or false"))
    return _json(await request.app[DOOR].status(host, detail=raw in ("1", "true")))


async def _bodiless(request: web.Request) -> tuple[Identity, str]:
    """An operator's mutation that takes no query and an empty body: who asks, and for which host."""
    who = _who(request, operator=True)
    host = _host(request)
    _query(request, ())
    bad = parse_empty(await _body(request))
    if bad is not None:
        raise _Refused(bad)
    return who, host


async def post_cut(request: web.Request) -> web.Response:
    who, host = await _bodiless(request)
    return _json(await request.app[DOOR].cut(host, who))


async def post_abort(request: web.Request) -> web.Response:
    who, host = await _bodiless(request)
    return _json(await request.app[DOOR].abort(host, who))


async def post_resolve(request: web.Request) -> web.Response:
    who = _who(request, operator=True)
    host = _host(request)
    _query(request, ())
    body = await _body(request)
    if b'"declare_lost"' in body:  # §7.10 --declare-lost (services/door/declare.py)
        from services.door.declare import declare_lost, parse_declare_lost

        req = parse_declare_lost(body)
        if isinstance(req, DoorRefusal):
            raise _Refused(req)
        return _json(await declare_lost(request.app[DOOR], host, req, who))
    bad = parse_flag(body, "retry")
    if bad is not None:
        raise _Refused(bad)
    return _json(await request.app[DOOR].resolve(host, who))


async def post_host_resolve(request: web.Request) -> web.Response:
    who = _who(request, operator=True)
    host = _host(request)
    _query(request, ())
    bad = parse_flag(await _body(request), "clear_failed")
    if bad is not None:
        raise _Refused(bad)
    return _json(await request.app[DOOR].clear_failed(host, who))


async def post_create(request: web.Request) -> web.Response:
    who = _who(request, operator=True)
    host = _host(request)
    _query(request, ())
    create = parse_create_request(await _body(request))
    if isinstance(create, DoorRefusal):
        raise _Refused(create)
    return _json(await request.app[DOOR].create(host, create.box, who, app=create.app, release=create.release))


async def openapi(request: web.Request) -> web.Response:
    _query(request, ())
    return web.json_response(document(), dumps=_dumps)


async def healthz(request: web.Request) -> web.Response:
    _query(request, ())
    return web.json_response({"ok": True, "service": "door", "moves_protocol": request.app[DOOR].console_protocol},
                             dumps=_dumps)


ROUTES: tuple[tuple[str, str, Handler], ...] = (
    ("GET", "/openapi.json", openapi),
    ("GET", "/healthz", healthz),
    ("POST", "/v1/hosts/{host}/move", post_move),
    ("GET", "/v1/hosts/{host}/move", get_move),
    ("POST", "/v1/hosts/{host}/move/cut", post_cut),
    ("POST", "/v1/hosts/{host}/move/abort", post_abort),
    ("POST", "/v1/hosts/{host}/move/resolve", post_resolve),
    ("POST", "/v1/hosts/{host}/resolve", post_host_resolve),
    ("POST", "/v1/hosts/{host}/create", post_create),
)


def make_app(door: Door, tokens: TokenSet) -> web.Application:
    """The door's aiohttp app (every route is in :func:`document`)."""
    app = web.Application(middlewares=[_errors], client_max_size=MAX_BODY)
    app[DOOR] = door
    app[TOKENS] = tokens
    for method, path, handler in ROUTES:
        app.router.add_route(method, path, handler)
    return app


async def serve_door(
    door: Door, port: int, *, tokens: TokenSet, host: str = "127.0.0.1"
) -> web.AppRunner:
    """Start ``door`` on ``host:port``; ``await runner.cleanup()`` stops it."""
    runner = web.AppRunner(make_app(door, tokens), shutdown_timeout=5.0)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    log.info("door listening on %s:%d (%r)", host, port, tokens, extra=ctx(port=port))
    return runner


# -- OpenAPI --------------------------------------------------------------------------------------


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _resp(name: str, description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": _ref(name)}}}


_HOST_PARAM = {
    "name": "host", "in": "path", "required": True,
    "schema": {"type": "string", "minLength": 1, "maxLength": 253,
               "pattern": r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?(\.[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?)*$"},
    "description": "the instance's host name: lowercase DNS labels joined by dots (percent-encoding is decoded)",
}
_BEARER: list[dict[str, list[str]]] = [{"operator": []}]
_HIDDEN = _resp("Error", "not found: an unknown path, or no valid token (the same answer either way, §12)")
_BAD = _resp("Error", "bad input: the reason says what and why; nothing was written")
_REFUSED = _resp("Error", "refused (§7.1): the reason is the operator's sentence; nothing was written")
_UNAVAILABLE = _resp("Error", "a read failed or found a corrupt object; nothing was changed (C6). When a dependency "
                             "did not answer, ``dependency`` names it (nats: nothing was changed; s3: repeat the "
                             "request) and ``Retry-After`` says when to try again")


def _mutation(op_id: str, summary: str, ok: dict[str, Any], body: dict[str, Any] | None) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "operationId": op_id, "summary": summary, "security": _BEARER, "parameters": [_HOST_PARAM],
        "responses": {**ok, "400": _BAD, "404": _HIDDEN, "409": _REFUSED, "503": _UNAVAILABLE},
    }
    if body is not None:
        spec["requestBody"] = {"required": True, "content": {"application/json": {"schema": body}}}
    else:
        spec["requestBody"] = {"required": False, "content": {"application/json": {
            "schema": {"type": "object", "additionalProperties": False}}}}
    return spec


def document() -> dict[str, Any]:
    """The OpenAPI 3.1 document; its paths and methods are exactly :data:`ROUTES`."""
    status = _resp("MoveStatus", "the move, or the last one, and the claim's op")
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "hostmove door",
            "version": "1",
            "description": (
                "The operator's door for moves (spec §7.1, §12). Every /v1 route needs a bearer token; "
                "mutations need an operator token, the status GET also takes a status-only token. "
                "Without one, every /v1 route answers the same 404. Refusals are 400 or 409 with the "
                "operator's sentence in reason and its copy id in copy."
            ),
        },
        "paths": {
            "/openapi.json": {"get": {
                "operationId": "openapi", "summary": "this document",
                "responses": {"200": {"description": "the OpenAPI document",
                                      "content": {"application/json": {"schema": {"type": "object"}}}}},
            }},
            "/healthz": {"get": {
                "operationId": "health", "summary": "the door is up, and the moves protocol it speaks",
                "responses": {"200": _resp("Health", "up")},
            }},
            "/v1/hosts/{host}/move": {
                "post": _mutation(
                    "requestMove", "request a move (K2: serving to moving, the target box named in the same CAS)",
                    {"201": _resp("MoveAnswer", "the move started: the claim is moving and the record holds it"),
                     "200": _resp("MoveAnswer", "the same request again: the existing move (its record finished "
                                               "if an earlier attempt stopped between the two writes)")},
                    _ref("MoveRequest"),
                ),
                "get": {
                    "operationId": "moveStatus", "summary": "the move's status (operator or status token)",
                    "security": [{"operator": []}, {"status": []}],
                    "parameters": [_HOST_PARAM, {
                        "name": "detail", "in": "query", "required": False,
                        "schema": {"type": "string", "enum": ["0", "1", "true", "false"], "default": "0"},
                        "description": "1: add every phase, report and evidence field the record and claim hold",
                    }],
                    "responses": {"200": status, "400": _BAD, "404": _HIDDEN, "503": _UNAVAILABLE},
                },
            },
            "/v1/hosts/{host}/move/cut": {"post": _mutation(
                "requestCut", "request the cut of a manual move that is ready (§7.4: ready to cutting, requested)",
                {"200": _resp("StepAnswer", "the cut is requested (changed false: it already was)")}, None,
            )},
            "/v1/hosts/{host}/move/abort": {"post": _mutation(
                "abortMove",
                "abort a move in preparing, ready, or cutting at requested (§7.11): the record's move becomes "
                "aborted; its staging is retired and the move closes later",
                {"200": _resp("StepAnswer", "the abort is recorded (changed false: it already was)")}, None,
            )},
            "/v1/hosts/{host}/move/resolve": {"post": _mutation(
                "resolveMove",
                "a stuck move's recovery runs its probe again, a new admission (§7.10 resolve --retry); refused in "
                "every other state",
                {"200": _resp("StepAnswer", "the retry is recorded: the move is rolling back or reverting again")},
                {"oneOf": [
                    {"type": "object", "additionalProperties": False, "required": ["retry"],
                     "properties": {"retry": {"const": True}}},
                    {"type": "object", "additionalProperties": False, "required": ["declare_lost", "compute"],
                     "properties": {"declare_lost": {"type": "string", "minLength": 1},
                                    "compute": {"type": "object", "required": ["status"],
                                                "properties": {"status": {"type": "string"},
                                                               "evidence": {"type": "string"}}},
                                    "confirmed": {"type": "boolean"}}}]},
            )},
            "/v1/hosts/{host}/resolve": {"post": _mutation(
                "resolveHost",
                "clear a route the retry policy marked failed (five failed starts of a serving wake): the serving "
                "box clears it and starts the host again; refused while an operation holds the host",
                {"200": _resp("HostResolved", "the request is journaled on the claim (changed false: it was)")},
                {"type": "object", "additionalProperties": False, "required": ["clear_failed"],
                 "properties": {"clear_failed": {"const": True}}},
            )},
            "/v1/hosts/{host}/create": {"post": _mutation(
                "createHost", "create a host on a box with a fresh incarnation (claim: creating, then serving)",
                {"201": _resp("Created", "the host is serving on the box")}, _ref("CreateRequest"),
            )},
        },
        "components": {
            "securitySchemes": {
                "operator": {"type": "http", "scheme": "bearer", "description": "an operator token"},
                "status": {"type": "http", "scheme": "bearer", "description": "a status-only token (M18)"},
            },
            "schemas": _schemas(),
        },
    }


def _schemas() -> dict[str, Any]:
    nullable_ms = {"type": ["integer", "null"], "minimum": 0, "description": "ms since the epoch"}
    move = {
        "type": "object",
        "properties": {
            "id": {"type": "string", "pattern": "^mv_[a-z2-7]{26}$"}, "incarnation": {"type": "string"},
            "from": {"type": "string"}, "to": {"type": "string"}, "cut": {"enum": ["auto", "manual"]},
            "state": {"type": "string"}, "cut_phase": {"type": "string"}, "landing_phase": {"type": "string"},
            "requested_by": {"type": "string", "description": "the operator's token label, never a token"},
            "requested_at": nullable_ms, "updated_at": nullable_ms, "reason": {"type": "string"},
        },
        "required": ["id", "incarnation", "from", "to", "cut", "state", "cut_phase", "landing_phase",
                     "requested_by", "requested_at", "updated_at", "reason"],
    }
    claim = {
        "type": "object",
        "properties": {
            "gen": {"type": "integer", "minimum": 1}, "kind": {"type": "string"}, "phase": {"type": "string"},
            "op_id": {"type": "string"}, "exec": {"type": "string", "description": "a box label, or none"},
            "participants": {"type": "array", "items": {"type": "string"},
                             "description": "[source box, target box] for a move"},
        },
        "required": ["gen", "kind", "phase", "op_id", "exec", "participants"],
    }
    status_props: dict[str, Any] = {
        "host": {"type": "string"},
        "claim": {"anyOf": [_ref("ClaimOp"), {"type": "null"}]},
        "move": {"anyOf": [_ref("Move"), {"type": "null"}]},
        "last_move": {"type": ["object", "null"], "description": "{id, outcome, at} of the last closed move"},
        "record_gen": {"type": "integer", "minimum": 0},
        "message": {"type": "string", "description": "the operator's sentence"},
        "copy": {"type": "string", "description": "the sentence's copy id"},
        "detail": {"type": "object", "description": "with detail=1: move, op, touched, obligations, lost"},
    }
    status_required = ["host", "claim", "move", "last_move", "record_gen", "message", "copy"]
    return {
        "MoveRequest": {
            "type": "object", "additionalProperties": False, "required": ["to"],
            "properties": {
                "to": {"type": "string", "pattern": NAME_PATTERN, "description": "the region to move to"},
                "cut": {"enum": ["auto", "manual"], "default": "manual",
                        "description": "manual (the API default, M6): cut on POST .../move/cut"},
            },
        },
        "CreateRequest": {
            "type": "object", "additionalProperties": False, "required": ["box"],
            "dependentRequired": {"release": ["app"]},
            "properties": {"box": {"type": "string", "pattern": NAME_PATTERN,
                                   "description": "a box label in the roster"},
                           "app": {"type": "string", "pattern": APP_PATTERN,
                                   "description": "the app the host runs (a published release, issue 18)"},
                           "release": {"type": "integer", "minimum": 1, "maximum": MAX_SAFE_INTEGER,
                                       "description": "the app's release number (default: its newest)"}},
        },
        "Move": move,
        "ClaimOp": claim,
        "MoveStatus": {"type": "object", "properties": status_props, "required": status_required},
        "MoveAnswer": {
            "type": "object",
            "properties": {**status_props, "started": {"type": "boolean"}, "record_written": {"type": "boolean"}},
            "required": [*status_required, "started", "record_written"],
        },
        "StepAnswer": {
            "type": "object", "properties": {**status_props, "changed": {"type": "boolean"}},
            "required": [*status_required, "changed"],
        },
        "HostResolved": {
            "type": "object",
            "properties": {"host": {"type": "string"}, "claim": {"anyOf": [_ref("ClaimOp"), {"type": "null"}]},
                           "changed": {"type": "boolean"}, "message": {"type": "string"}, "copy": {"type": "string"}},
            "required": ["host", "claim", "changed", "message", "copy"],
        },
        "Created": {
            "type": "object",
            "properties": {"host": {"type": "string"}, "claim": _ref("ClaimOp"), "region": {"type": "string"},
                           "incarnation": {"type": "string", "pattern": "^[0-9a-f]{64}$"},
                           "message": {"type": "string"}, "copy": {"type": "string"}},
            "required": ["host", "claim", "region", "incarnation", "message", "copy"],
        },
        "Error": {
            "type": "object",
            "properties": {"error": {"type": "string"}, "reason": {"type": "string"}, "copy": {"type": "string"},
                           "dependency": {"enum": ["nats", "s3"]}},
            "required": ["error", "reason", "copy"],
        },
        "Health": {
            "type": "object",
            "properties": {"ok": {"type": "boolean"}, "service": {"const": "door"},
                           "moves_protocol": {"type": "integer"}},
            "required": ["ok", "service", "moves_protocol"],
        },
    }


__all__ = [
    "MAX_BODY", "ROUTES", "Answer", "Door", "Unreadable", "document", "hidden", "make_app", "serve_door",
]
