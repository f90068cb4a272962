"""The operator's reads beside the snapshot (issue 20 items 1 to 3): boxes, moves, the §13 move log and alerts.

Served by the projections service with its read API (:mod:`projections.api`), so the CLI's ``-o json``, the
dashboard and the API answer the same JSON. The views are pure functions of what they read (:func:`box_views`,
:func:`move_views`, :func:`alert_view`); :class:`Console` is the thin reader: the projection's SQLite snapshot, the
roster and the move log in the deployment bucket (read-only), the alerts on ``hm.alert.>`` of the facts stream.

**Access** (:class:`Access`): every route here is behind a status or operator token (``Authorization: Bearer`` or the
dashboard's ``hm_token`` cookie), unless the deployment opens it explicitly (``HOSTMOVE_DASHBOARD_OPEN=1``). A
dependency that does not answer is a 503 naming it (``"dependency": "s3" | "nats"``), never an empty list.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from bus.log import EventLog, LogError
from bus.subjects import ALERT_PREFIX, FACTS_STREAM
from events.base import decode
from events.record import Record
from projections.store import HostView
from services.box.roster import Roster, RosterBox, read_roster
from services.door.auth import (
    ENV_OPERATOR,
    ENV_OPERATOR_FILE,
    ENV_STATUS,
    ENV_STATUS_FILE,
    Identity,
    TokenConfigError,
    TokenSet,
    parse_entries,
)
from services.ledger.movelog import read_history, read_move, timings
from services.move.incidents import INCIDENT_KINDS
from services.objstore.port import ObjectStore, StoreError

ENV_OPEN = "HOSTMOVE_DASHBOARD_OPEN"
COOKIE = "hm_token"
MAX_ALERTS = 200
"""The alerts one answer carries at most (the newest)."""


class Unavailable(Exception):
    """A dependency of a read did not answer: ``dependency`` is ``s3`` or ``nats``."""

    def __init__(self, dependency: str, reason: str) -> None:
        self.dependency = dependency
        self.reason = reason
        super().__init__(reason)


# -- access ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Access:
    """Who may read the console: anyone holding a configured token, or everyone when ``open``."""

    tokens: TokenSet | None = field(default=None, repr=False)
    open: bool = False

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Access:
        """``HOSTMOVE_STATUS_TOKENS`` and ``HOSTMOVE_OPERATOR_TOKENS`` (and their ``_FILE`` forms, digests as the
        door takes them, :mod:`services.door.auth`), and ``HOSTMOVE_DASHBOARD_OPEN=1``."""
        from pathlib import Path

        env = os.environ if env is None else env
        entries = []
        for role, name, file_name in (("operator", ENV_OPERATOR, ENV_OPERATOR_FILE),
                                      ("status", ENV_STATUS, ENV_STATUS_FILE)):
            if env.get(name):
                entries += parse_entries(env[name].split(","), role, name)  # type: ignore[arg-type]
            if env.get(file_name):
                try:
                    lines = Path(env[file_name]).read_text(encoding="utf-8").splitlines()
                except OSError as exc:
                    raise TokenConfigError(f"{file_name} names {env[file_name]}, which cannot be read: "
                                           f"{exc.strerror}") from None
                entries += parse_entries(lines, role, file_name)  # type: ignore[arg-type]
        opened = env.get(ENV_OPEN, "").strip().lower() in ("1", "true", "yes")
        return cls(TokenSet(entries) if entries else None, opened)

    def identify(self, authorization: str | None, cookie: str | None) -> Identity | None:
        if self.open:
            return Identity("anyone", "status")
        if self.tokens is None:
            return None
        return self.tokens.identify_header(authorization) or self.tokens.identify(cookie)

    def refusal(self) -> str:
        """Why a read without a token is refused, and what opens it (§20: the operator's words)."""
        if self.tokens is None:
            return (f"the console is closed: no status token is configured; set {ENV_STATUS} (or {ENV_OPERATOR}) "
                    f"to sha256 digests of tokens, or {ENV_OPEN}=1 to open it to everyone who can reach it")
        return "a status or operator token is required: send it as a bearer token, or sign in on the dashboard"


# -- the pure views --------------------------------------------------------------------------------


def _record(view: HostView) -> Record | None:
    text = view.record_json
    if not isinstance(text, str):
        return None
    return decode(text.encode("utf-8"), Record)


def host_summary(view: HostView) -> dict[str, Any]:
    """A host's row for the fleet views: state, region, box, claim gen, its live move and its last move's outcome."""
    record = _record(view)
    last = record.last_move if record is not None else None
    return {
        "host": view.host, "deleted": view.deleted, "state": view.op_kind, "phase": view.op_phase,
        "region": view.region, "box": view.exec, "claim_gen": view.claim_gen, "record_gen": view.record_gen,
        "move_id": view.move_id, "move_state": view.move_state, "revision": view.revision,
        "last_move": ({"id": last.id, "outcome": last.outcome, "at": last.at} if last is not None else None),
    }


def _eligibility(box: RosterBox, roster: Roster) -> tuple[bool, str]:
    if box.fenced_at is not None:
        return False, "fenced: the box was terminated and never acts again"
    live = roster.live_in_region(box.region)
    if len(live) > 1:
        return False, (f"{box.region} has {len(live)} live boxes, and a move into or out of a region with more than "
                       "one box is refused")
    return True, ""


def box_views(roster: Roster | None, hosts: Sequence[HostView]) -> list[dict[str, Any]]:
    """Every box of the roster: region, eligibility (and why not), fenced or lost, and the hosts it runs."""
    if roster is None:
        return []
    running: dict[str, list[str]] = {}
    for h in hosts:
        if not h.deleted and h.exec and h.exec != "none":
            running.setdefault(h.exec, []).append(h.host)
    out = []
    for box in roster.boxes:
        eligible, why = _eligibility(box, roster)
        out.append({
            "label": box.label, "region": box.region, "registered_at": box.registered_at,
            "fenced_at": box.fenced_at, "fenced": box.fenced_at is not None, "lost": box.fenced_at is not None,
            "eligible": eligible, "why": why, "moves_protocol": box.moves_protocol,
            "running": sorted(running.get(box.label, [])),
        })
    return out


def move_views(hosts: Sequence[HostView], now_ms: int, *, live_only: bool = False) -> list[dict[str, Any]]:
    """Each host's live move (phase and §13 timings against their budgets) and, unless ``live_only``, its last
    closed move (its outcome). Newest first."""
    out: list[dict[str, Any]] = []
    for h in hosts:
        record = _record(h)
        if record is None:
            continue
        move = record.move
        if move is not None:
            out.append({
                "host": h.host, "move_id": move.id, "live": True, "state": move.state, "cut": move.cut,
                "cut_phase": move.cut_phase, "landing_phase": move.landing_phase, "from": move.from_, "to": move.to,
                "requested_at": move.requested_at, "requested_by": move.requested_by, "reason": move.reason,
                "outcome": None, "at": move.updated_at,
                "timings": [msgspec.to_builtins(t) for t in timings(move, now_ms)],
            })
        last = record.last_move
        if not live_only and last is not None and (move is None or move.id != last.id):
            out.append({"host": h.host, "move_id": last.id, "live": False, "state": "", "cut": "", "cut_phase": "",
                        "landing_phase": "", "from": "", "to": "", "requested_at": None, "requested_by": "",
                        "reason": "", "outcome": last.outcome, "at": last.at, "timings": []})
    out.sort(key=lambda m: (not m["live"], -(m["at"] or m["requested_at"] or 0), m["host"]))
    return out


def alert_view(seq: int, subject: str, data: bytes) -> dict[str, Any] | None:
    """An alert or incident from the facts stream, or None for a message that is not one."""
    try:
        body = msgspec.json.decode(data)
    except msgspec.DecodeError:
        return None
    if not isinstance(body, dict):
        return None
    raw_payload, raw_actor = body.get("payload"), body.get("actor")
    payload: dict[str, Any] = raw_payload if isinstance(raw_payload, dict) else {}
    actor: dict[str, Any] = raw_actor if isinstance(raw_actor, dict) else {}
    kind = str(body.get("kind", ""))
    return {
        "seq": seq, "kind": kind, "subject": str(body.get("subject", "")), "id": str(body.get("id", "")),
        "at": body.get("at"), "incident": kind in INCIDENT_KINDS or subject.count(".") > 2,
        "sentence": str(payload.get("sentence") or payload.get("reason") or ""),
        "actor": {"service": str(actor.get("service", "")), "box": str(actor.get("box", ""))},
        "payload": payload,
    }


# -- the reader ------------------------------------------------------------------------------------


class Console:
    """The console's reads for the API and the dashboard (the store and the events may be absent: those reads then
    answer :class:`Unavailable`)."""

    def __init__(self, store: ObjectStore | None, bucket: str, events: EventLog | None,
                 access: Access | None = None) -> None:
        self.store = store
        self.bucket = bucket
        self.events = events
        self.access = access or Access(open=True)
        self._alerts: list[dict[str, Any]] = []
        self._alerts_seq = 0  # the facts stream's last seq the cache has read up to
        self._alerts_lock = asyncio.Lock()
        self._alerts_task: asyncio.Future[None] | None = None

    def _need_store(self) -> ObjectStore:
        if self.store is None:
            raise Unavailable("s3", "this projections service reads no object store")
        return self.store

    async def roster(self) -> Roster | None:
        try:
            roster, _ = await read_roster(self._need_store(), self.bucket)
        except StoreError as exc:
            raise Unavailable("s3", f"the roster could not be read: {exc}") from None
        return roster

    async def move(self, move_id: str, host: str | None = None) -> dict[str, Any] | None:
        try:
            return await read_move(self._need_store(), self.bucket, move_id, host)
        except StoreError as exc:
            raise Unavailable("s3", f"the move log could not be read: {exc}") from None

    async def history(self, host: str) -> list[dict[str, Any]]:
        try:
            return await read_history(self._need_store(), self.bucket, host)
        except StoreError as exc:
            raise Unavailable("s3", f"the move log could not be read: {exc}") from None

    async def alerts(self, after: int = 0, limit: int = MAX_ALERTS, *, wait: bool = True
                     ) -> tuple[list[dict[str, Any]], int]:
        """The alerts after stream seq ``after`` (the newest ``limit``) and the last seq read. With ``wait=False``
        (the dashboard's render) the alerts read so far, while a read of the newer ones runs in the background: a
        filtered replay waits out its fetch timeout when the stream's last messages are other facts."""
        if self.events is None:
            raise Unavailable("nats", "this projections service reads no event stream")
        if not wait:
            if self._alerts_task is None or self._alerts_task.done():
                if self._alerts_task is not None and self._alerts_task.exception() is not None:
                    failed, self._alerts_task = self._alerts_task.exception(), None
                    raise Unavailable("nats", f"the alerts could not be read: {failed}")
                self._alerts_task = asyncio.ensure_future(self._locked_catch_up(self.events))
            if self._alerts_seq == 0:  # nothing read yet: this once, wait for it
                await asyncio.shield(self._alerts_task)
        else:
            await self._locked_catch_up(self.events)
        found = [a for a in self._alerts if a["seq"] > after]
        return found[-limit:], self._alerts_seq

    async def _locked_catch_up(self, events: EventLog) -> None:
        try:
            async with self._alerts_lock:
                await self._catch_up_alerts(events)
        except LogError as exc:
            raise Unavailable("nats", f"the alerts could not be read: {exc}") from None

    async def _catch_up_alerts(self, events: EventLog) -> None:
        """Read the alerts published since the last read into the cache (a replay of ``hm.alert.>`` only)."""
        last = (await events.state(FACTS_STREAM)).last_seq
        if last <= self._alerts_seq:
            return
        async for msg in events.replay(FACTS_STREAM, start_seq=self._alerts_seq + 1, subject=f"{ALERT_PREFIX}.>"):
            view = alert_view(msg.seq, msg.subject, msg.data)
            if view is not None:
                self._alerts.append(view)
        self._alerts = self._alerts[-10 * MAX_ALERTS:]
        self._alerts_seq = last


__all__ = ["COOKIE", "ENV_OPEN", "Access", "Console", "Unavailable", "alert_view", "box_views", "host_summary",
           "move_views"]
