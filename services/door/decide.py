"""The door's decisions, pure (spec §7.1, §7.2, §7.4, §7.11, §11, §19.2 K2, K5; digest D§5.1).

State in, next state or a refusal out; nothing here reads a clock, a store or randomness. The shell
(:mod:`services.door.api`) reads the claim, the record, the roster and the floor, mints the move id,
and runs these inside ``Ledger.transition``.

A move request is two CASes, **claim first** (K2, digest D§13 ambiguity 1): the claim's ``moving``
op carries the whole request in ``op.intent`` (``target``, ``to``, ``cut``, ``from``,
``requested_by``, ``requested_at``), so the record's ``move`` is fully determined by the claim and
whoever finds a ``moving`` claim without its record (a retry of the request, or the recovery pass)
writes the same record (:func:`decide_move_record`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal

import msgspec

from events.base import canonical
from events.claim import AppRef, Claim, Op
from events.copy import say
from events.durable import MAX_SAFE_INTEGER, DurableValueError
from events.record import Move, Record
from services.apps.manifest import Release
from services.box.roster import DEFAULT_FLOOR, FLOOR_KEY, MOVES_PROTOCOL, Floor, Roster, RosterBox
from services.ledger.ledger import NoChange, Refusal
from services.move.lost import region_park_blocks

CONSOLE_PROTOCOL = MOVES_PROTOCOL
"""The moves protocol this console speaks (§11: "the console reports its own")."""

CutMode = Literal["auto", "manual"]
DEFAULT_CUT: CutMode = "manual"
"""Ruling M6: person-started moves cut automatically from the CLI, but the API default stays manual."""

MOVE_FIELDS = ("to", "cut")
CREATE_FIELDS = ("box", "app", "release")
ABORTABLE = ("preparing", "ready")
"""§7.11: abort is legal in ``preparing``, ``ready`` and ``cutting`` at ``cut_phase = requested``."""

_HOST_LABEL = r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?"
_HOST_RE = re.compile(rf"^{_HOST_LABEL}(?:\.{_HOST_LABEL})*$")
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$"
"""A region name or a box label as the door takes them (``to``, ``box``); the OpenAPI document carries it."""
_REGION_RE = re.compile(NAME_PATTERN)
MAX_ECHO = 80


@dataclass(frozen=True)
class DoorRefusal(Refusal):
    """A refusal with its HTTP status and copy id (§7.1: "refused (400 or 409, with the sentence)")."""

    status: int = 409
    copy: str = ""


def refuse(status: int, copy_id: str, /, **values: object) -> DoorRefusal:
    return DoorRefusal(reason=say(copy_id, **values), status=status, copy=copy_id)


def echo(value: object) -> str:
    """Operator input quoted back, bounded and printable (a value no durable document may hold, such as an integer
    outside the safe range, is quoted as Python writes it: a refusal never fails on the input it names)."""
    try:
        text = value if isinstance(value, str) else canonical(value).decode("utf-8", "replace")
    except DurableValueError:
        text = repr(value)[: MAX_ECHO + 1]
    text = "".join(ch if ch.isprintable() else "?" for ch in text)
    return repr(text if len(text) <= MAX_ECHO else text[:MAX_ECHO] + "...")


# -- input ----------------------------------------------------------------------------------------


def check_host(host: str) -> DoorRefusal | None:
    """A host is an instance hostname (digest D§1): lowercase DNS labels joined by dots, at most 253
    characters. Lowercase only, so one instance never has two claims."""
    if not 1 <= len(host) <= 253:
        return refuse(400, "M-R3", host=echo(host), reason="it must be 1 to 253 characters")
    if not _HOST_RE.match(host):
        return refuse(400, "M-R3", host=echo(host),
                      reason="use lowercase letters, digits and '-', in labels of 1 to 63 joined by dots")
    return None


MAX_BODY_DEPTH = 8
"""A request body is one flat JSON object: text nested deeper than this is refused before it is decoded (a decoder
recursing 30,000 levels deep failed the request with a 500)."""

_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)


def body_depth(body: bytes) -> int:
    """How deeply arrays and objects nest in JSON text, strings skipped: a scan of the bytes, no recursion, so it is
    safe on any text within the door's body cap."""
    depth = deepest = 0
    for ch in _JSON_STRING.sub(b'""', body):
        if ch in b"[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in b"]}":
            depth -= 1
    return deepest


class _Duplicate(Exception):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            raise _Duplicate(key)
        seen[key] = value
    return seen


def duplicate_key(body: bytes) -> str | None:
    """The first key an object of ``body`` names twice, or None (JSON decoders keep the last; the door refuses)."""
    try:
        json.loads(body.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except _Duplicate as exc:
        return exc.key
    except (ValueError, RecursionError):
        return None  # not JSON at all: the decoder's refusal says so
    return None


def _object(body: bytes, allowed: tuple[str, ...], *, empty_ok: bool) -> dict[str, Any] | DoorRefusal:
    if not body.strip():
        if empty_ok:
            return {}
        return refuse(400, "M-R4", reason="it is empty; send a JSON object")
    depth = body_depth(body)
    if depth > MAX_BODY_DEPTH:
        return refuse(400, "M-R4", reason=f"it nests {depth} levels deep; send one flat JSON object")
    try:
        value = msgspec.json.decode(body)
    except msgspec.DecodeError as exc:
        return refuse(400, "M-R4", reason=f"it is not JSON ({exc})")
    if not isinstance(value, dict):
        return refuse(400, "M-R4", reason="it must be a JSON object")
    twice = duplicate_key(body)
    if twice is not None:
        return refuse(400, "M-R4", reason=f"it names the field {echo(twice)} twice")
    unknown = sorted(k for k in value if k not in allowed)
    if unknown:
        return refuse(400, "M-R5", field=echo(unknown[0]), allowed=", ".join(allowed) or "none")
    return value


@dataclass(frozen=True)
class MoveRequest:
    to: str
    cut: CutMode = DEFAULT_CUT


def parse_move_request(body: bytes) -> MoveRequest | DoorRefusal:
    """``{"to": <region>, "cut": "auto" | "manual"}`` (§7.1; ``cut`` defaults to manual, M6)."""
    value = _object(body, MOVE_FIELDS, empty_ok=False)
    if isinstance(value, DoorRefusal):
        return value
    if "to" not in value:
        return refuse(400, "M-R6", field="to (the region to move to)")
    to = value["to"]
    if not isinstance(to, str) or not _REGION_RE.match(to):
        return refuse(400, "M-R4", reason=f"to must be a region name, not {echo(to)}")
    cut = value.get("cut", DEFAULT_CUT)
    if cut not in ("auto", "manual"):
        return refuse(400, "M-R7", value=echo(cut))
    return MoveRequest(to=to, cut=cut)


@dataclass(frozen=True)
class CreateRequest:
    """``{"box": <label>, "app": <name>, "release": <n>}``: the box the new host is created on and the app release
    it runs (issue 18; ``release`` defaults to the app's newest)."""

    box: str
    app: str | None = None
    release: int | None = None


APP_PATTERN = r"^[a-z0-9][a-z0-9-]{0,62}$"
_APP_RE = re.compile(APP_PATTERN)


def parse_create_request(body: bytes) -> CreateRequest | DoorRefusal:
    """The create request (:class:`CreateRequest`)."""
    value = _object(body, CREATE_FIELDS, empty_ok=False)
    if isinstance(value, DoorRefusal):
        return value
    box = value.get("box")
    if box is None:
        return refuse(400, "M-R6", field="box (the box label to create the host on)")
    if not isinstance(box, str) or not _REGION_RE.match(box):
        return refuse(400, "M-R4", reason=f"box must be a box label, not {echo(box)}")
    app, release = value.get("app"), value.get("release")
    if isinstance(release, float) and release.is_integer():  # JSON Schema's integer: 3.0 is the number 3
        release = int(release)
    if app is not None and (not isinstance(app, str) or not _APP_RE.match(app)):
        return refuse(400, "M-R4", reason=f"app must be an app name, not {echo(app)}")
    if release is not None and (app is None or isinstance(release, bool) or not isinstance(release, int)
                                or not 1 <= release <= MAX_SAFE_INTEGER):
        return refuse(400, "M-R4", reason=f"release must be a release number (1 or more) of the app, not "
                                          f"{echo(release)}")
    return CreateRequest(box=box, app=app, release=release)


def parse_empty(body: bytes) -> DoorRefusal | None:
    """Cut and abort take no fields: an empty body or ``{}``."""
    value = _object(body, (), empty_ok=True)
    return value if isinstance(value, DoorRefusal) else None


def parse_flag(body: bytes, name: str) -> DoorRefusal | None:
    """``{"<name>": true}``, the one verb a resolve door takes (§7.10: ``{"retry": true}``; a host's
    ``{"clear_failed": true}``)."""
    value = _object(body, (name,), empty_ok=False)
    if isinstance(value, DoorRefusal):
        return value
    if value.get(name) is not True:
        return refuse(400, "M-R4", reason=f"{name} must be true, not {echo(value.get(name))}")
    return None


# -- the target and the floor ---------------------------------------------------------------------


def eligible_boxes(roster: Roster, region: str, lost: frozenset[str]) -> list[RosterBox]:
    """Phase 1's ``eligibleBoxes(region)``: the roster's boxes in ``region`` that are not fenced and not
    quarantined on the claim's ``lost`` list."""
    return [b for b in roster.live_in_region(region) if b.label not in lost]


def choose(roster: Roster, region: str, lost: frozenset[str], host: str) -> RosterBox | DoorRefusal:
    """Region HA's ``choose()`` as Phase 1 scopes it (§7.1, rev 7.20): the region's one eligible box.
    A region with more than one is refused with M-C21 (a scope rule, not a safety rule)."""
    if not roster.in_region(region):
        return refuse(400, "M-R10", region=echo(region),
                      regions=", ".join(sorted({b.region for b in roster.boxes})) or "none")
    eligible = eligible_boxes(roster, region, lost)
    if len(eligible) > 1:
        return refuse(409, "M-C21", host=host, region=region)
    if not eligible:
        return refuse(409, "M-R11", region=region, host=host)
    return eligible[0]


def check_floor(
    roster: Roster, regions: tuple[str, ...], floor: Floor | None, host: str, console: int = CONSOLE_PROTOCOL
) -> DoorRefusal | None:
    """§11, K10: the console and every box in both regions at or above the floor."""
    minimum = floor.min if floor is not None else DEFAULT_FLOOR
    if console < minimum:
        return refuse(409, "M-R13", have=console, floor=minimum)
    for box in sorted((b for b in roster.boxes if b.region in regions and b.fenced_at is None),
                      key=lambda b: (b.region, b.label)):
        if box.moves_protocol < minimum:
            return refuse(409, "M-R12", box=box.label, region=box.region, have=box.moves_protocol,
                          floor=minimum, host=host)
    return None


# -- what the app's release declares (§7.1, §6.1 F8, §6.2; issue 18) ------------------------------


def release_refusal(release: Release, host: str) -> DoorRefusal | None:
    """§7.1: a move is refused for an instance whose release declares a sidecar environment file (F8), a private
    store bound to its environment (codex 12, F4: M-C17) or a registry column §6.2 refuses. Pure."""
    if release.sidecar_env:
        return refuse(409, "M-R41", host=host, file=f"{host}-sidecar.env")
    if release.private_stores():
        return refuse(409, "M-C17", host=host)
    columns = release.refused_columns()
    if columns:
        return refuse(409, "M-R42", host=host, columns=", ".join(columns), release=release.label)
    return None


# -- the move request (K2) ------------------------------------------------------------------------


def intent_matches(op: Op, request: MoveRequest) -> bool:
    """A retry of the same request: the live move goes to the same region with the same cut."""
    return op.kind == "moving" and op.intent.get("to") == request.to and op.intent.get("cut") == request.cut


def decide_move_claim(
    current: Claim | None,
    *,
    host: str,
    record: Record | None,
    roster: Roster,
    floor: Floor | None,
    request: MoveRequest,
    move_id: str,
    operator: str,
    now_ms: int,
    console: int = CONSOLE_PROTOCOL,
    release: tuple[AppRef, Release] | None = None,
) -> Claim | NoChange | DoorRefusal:
    """K2: ``serving`` → ``moving`` with the target named in the same CAS (§7.1, L15). ``release`` is the host's app
    release as the door read it (§7.1's refusals of what the app declares: :func:`release_refusal`).

    A claim already ``moving`` for the same request answers :class:`NoChange`: the caller then
    finishes the record (a retry after a crash between the two CASes)."""
    if current is None or (current.op.kind == "free" and current.holder is None):
        return refuse(404, "M-R2", host=host)
    op = current.op
    if op.kind == "moving":
        if intent_matches(op, request):
            return NoChange("this move was already requested")
        return refuse(409, "M-R26", host=host, move_id=op.id, to_region=op.intent.get("to", "?"))
    if op.kind != "serving" or current.holder is None:
        return refuse(409, "M-R8", host=host, kind=op.kind)
    # A park-generation retires a dead generation's own prefixes, which no operation ever writes again (a
    # generation is opened once, §5.1 step 9): it blocks no move. A lost region's park nobody adopted yet blocks a
    # move into that region only (§7.14 item 5, services/move/lost.py). Every other chore does (M-R27, CC11).
    blocking = [o for o in current.obligations if o.kind != "park-generation" and region_park_blocks(o, request.to)]
    if blocking:
        return refuse(409, "M-R27", host=host, count=len(blocking))
    source = roster.box(op.exec)
    if source is None:
        return refuse(409, "M-R14", host=host, box=op.exec)
    if source.fenced_at is not None:  # its relocation comes first (§7.10); a move from a dead box never ends
        return refuse(409, "M-R34", host=host, box=source.label, region=source.region)
    if request.to == source.region:
        return refuse(400, "M-R9", host=host, region=source.region)
    lost = frozenset(b.box for b in current.lost)
    target = choose(roster, request.to, lost, host)
    if isinstance(target, DoorRefusal):
        return target
    if len(eligible_boxes(roster, source.region, lost)) > 1:
        return refuse(409, "M-C21", host=host, region=source.region)
    below = check_floor(roster, (source.region, request.to), floor, host, console)
    if below is not None:
        return below
    if release is not None:
        if current.holder.app not in (None, release[0]):
            return refuse(409, "M-R17", host=host)
        declared = release_refusal(release[1], host)
        if declared is not None:
            return declared
    if record is not None:
        if record.move is not None:
            return refuse(409, "M-R15", host=host, move_id=record.move.id)
        recorded = record.extra.get("incarnation")
        if recorded is not None and recorded != current.holder.incarnation:
            return refuse(409, "M-R16", host=host)
    intent = {
        "target": target.label, "to": request.to, "cut": request.cut, "from": source.region,
        "requested_by": operator, "requested_at": now_ms,
    }
    return msgspec.structs.replace(
        current,
        op=Op(kind="moving", id=move_id, phase="", intent=intent, exec=source.label,
              participants=(source.label, target.label)),
    )


def decide_move_record(
    current: Record | None, *, host: str, claim: Claim, now_ms: int
) -> Record | NoChange | DoorRefusal:
    """The record half of the request: ``move`` in ``preparing`` (§7.2), from the claim's op alone."""
    op = claim.op
    if op.kind != "moving" or claim.holder is None:
        return refuse(409, "M-R17", host=host)
    if current is not None:
        if current.move is not None:
            if current.move.id == op.id:
                return NoChange("the record already holds this move")
            return refuse(409, "M-R15", host=host, move_id=current.move.id)
        if current.last_move is not None and current.last_move.id == op.id:
            return NoChange("this move already closed")
        recorded = current.extra.get("incarnation")
        if recorded is not None and recorded != claim.holder.incarnation:
            return refuse(409, "M-R16", host=host)
    intent = op.intent
    move = Move(
        id=op.id,
        incarnation=claim.holder.incarnation,
        to=intent["to"],
        state="preparing",
        cut=intent.get("cut", DEFAULT_CUT),
        requested_by=intent.get("requested_by", ""),
        requested_at=intent.get("requested_at"),
        updated_at=now_ms,
        from_=intent.get("from", ""),
    )
    base = current if current is not None else Record(host=host, gen=1)
    return msgspec.structs.replace(base, move=move)


# -- cut and abort (§7.4, §7.11; K5) --------------------------------------------------------------


_PAST_CUT = ("landing", "committed", "rolling_back", "reverting", "restoring", "done", "rolled_back", "stuck")


def _live_move(current: Record | None, claim: Claim | None, host: str) -> Move | DoorRefusal:
    """The record's live move, revalidated against the claim's op (K5)."""
    if current is None or current.move is None:
        return refuse(409, "M-R19", host=host)
    move = current.move
    if claim is None or claim.op.id != move.id or claim.holder is None or claim.holder.incarnation != move.incarnation:
        return refuse(409, "M-R28", host=host, move_id=move.id)
    return move


def decide_cut(
    current: Record | None, *, host: str, claim: Claim | None, now_ms: int
) -> Record | NoChange | DoorRefusal:
    """The manual cut request: ``ready`` → ``cutting`` at ``cut_phase = requested`` (§7.4), for a
    ``manual`` move only; the source takes it from there."""
    move = _live_move(current, claim, host)
    if isinstance(move, DoorRefusal):
        return move
    assert current is not None and claim is not None
    if move.state == "aborted":
        return refuse(409, "M-R22")
    if move.state == "cutting":
        if move.cut_phase == "requested":
            return NoChange("the cut was already requested")
        return refuse(409, "M-C13")
    if move.state in _PAST_CUT or claim.op.kind != "moving":
        return refuse(409, "M-C13")
    if move.cut != "manual":
        return refuse(409, "M-R21")
    if move.state != "ready":
        return refuse(409, "M-R20", host=host, state=move.state)
    new = msgspec.structs.replace(move, state="cutting", cut_phase="requested", updated_at=now_ms)
    return msgspec.structs.replace(current, move=new)


def decide_abort(
    current: Record | None, *, host: str, claim: Claim | None, operator: str, now_ms: int
) -> Record | NoChange | DoorRefusal:
    """§7.11: legal in ``preparing``, ``ready``, and ``cutting`` with ``cut_phase = requested``.

    The decision is the record CAS ``state = aborted`` (with ``reason``): the move stays live in the
    record while its chores run (the target region's ``park-staging``, the source's snapshots); the
    closing actor then clears it into ``last_move = aborted`` and releases the claim (record first,
    §7.5, K8). The source's ``requested`` → ``admitted`` CAS reads the whole record by ETag, so exactly
    one of the two wins."""
    move = _live_move(current, claim, host)
    if isinstance(move, DoorRefusal):
        return move
    assert current is not None and claim is not None
    if move.state == "aborted":
        return NoChange("the abort was already recorded")
    legal = move.state in ABORTABLE or (move.state == "cutting" and move.cut_phase == "requested")
    if not legal or claim.op.kind != "moving":
        return refuse(409, "M-C13")
    new = msgspec.structs.replace(move, state="aborted", reason=f"aborted by operator {operator}", updated_at=now_ms)
    return msgspec.structs.replace(current, move=new)


# -- status (§12) ---------------------------------------------------------------------------------


def status_line(host: str, claim: Claim | None, record: Record | None, *, now_ms: int | None = None
                ) -> tuple[str, str]:
    """``(copy id, sentence)`` for ``GET .../move``. With ``now_ms``, a rollback past its ``release_deadline`` whose
    target has not released is M-C10 (§7.8: the host is offline until the target confirms its stop)."""
    move = record.move if record is not None else None
    op = claim.op if claim is not None else Op()
    if op.kind == "relocating" and op.phase == "pinning":
        region = move.from_ if move is not None else str(op.intent.get("from", "its region"))
        return "M-C22", say("M-C22", host=host, region=region)
    if move is not None:
        if move.state == "preparing":
            return "M-C2", say("M-C2", host=host)
        if move.state == "ready":
            if move.cut == "manual":
                return "M-C12", say("M-C12", host=host)
            return "M-S4", say("M-S4", host=host)
        if move.state == "cutting" and move.cut_phase == "requested":
            return "M-S1", say("M-S1", host=host)
        if move.state == "cutting":
            return "M-C13", say("M-C13")
        if move.state == "landing":
            return "M-C6", say("M-C6", from_region=move.from_, to_region=move.to)
        if move.state == "aborted":
            return "M-S2", say("M-S2", host=host, from_region=move.from_ or "its region")
        if move.state == "reverting":  # §7.4 reverting
            return "M-S8", say("M-S8", host=host, reason=move.reason.rstrip(".") or "the cut stopped",
                               from_region=move.from_ or "its region")
        rb = move.rollback
        if (move.state == "rolling_back" and rb is not None and now_ms is not None and rb.release_deadline is not None
                and now_ms > rb.release_deadline and rb.target_phase in ("", "releasing")):
            target = claim.op.participants[1] if claim is not None and len(claim.op.participants) > 1 else "the target"
            return "M-C10", say("M-C10", box=target, region=move.to, host=host)
        if move.state == "rolling_back":  # §7.8
            return "M-C8", say("M-C8", to_region=move.to, host=host, reason=move.reason.rstrip(".") or "it failed",
                               from_region=move.from_ or "its region")
        if move.state == "stuck":  # §7.10: held for the operator's resolve --retry
            return "M-C11", say("M-C11", host=host, to_region=move.to, from_region=move.from_ or "its region")
    if move is None and record is not None and record.last_move is not None and op.kind == "serving":
        last = record.last_move
        return "M-S5", say("M-S5", host=host, move_id=last.id, outcome=last.outcome.replace("_", " "))
    if move is None and op.kind == "serving":
        return "M-S6", say("M-S6", host=host, box=op.exec)
    return "M-S7", say("M-S7", host=host, kind=op.kind, phase=move.state if move else (op.phase or "no phase"))


def move_summary(move: Move) -> dict[str, Any]:
    """The fields every status answer carries."""
    return {
        "id": move.id, "incarnation": move.incarnation, "from": move.from_, "to": move.to, "cut": move.cut,
        "state": move.state, "cut_phase": move.cut_phase, "landing_phase": move.landing_phase,
        "requested_by": move.requested_by, "requested_at": move.requested_at, "updated_at": move.updated_at,
        "reason": move.reason,
    }


def claim_summary(claim: Claim) -> dict[str, Any]:
    op = claim.op
    return {"gen": claim.gen, "kind": op.kind, "phase": op.phase, "op_id": op.id, "exec": op.exec,
            "participants": list(op.participants)}


def status_view(host: str, claim: Claim | None, record: Record | None, *, detail: bool,
                now_ms: int | None = None) -> dict[str, Any]:
    """``GET .../move`` (§12): the record's move (or ``last_move``) and the claim's op kind, phase and
    exec; ``detail`` adds every phase, report and evidence field the record and claim hold."""
    move = record.move if record is not None else None
    last = record.last_move if record is not None else None
    copy_id, message = status_line(host, claim, record, now_ms=now_ms)
    view: dict[str, Any] = {
        "host": host,
        "claim": claim_summary(claim) if claim is not None else None,
        "move": move_summary(move) if move is not None else None,
        "last_move": msgspec.to_builtins(last) if last is not None else None,
        "record_gen": record.gen if record is not None else 0,
        "message": message,
        "copy": copy_id,
    }
    if detail:
        view["detail"] = {
            "move": msgspec.to_builtins(move) if move is not None else None,
            "op": msgspec.to_builtins(claim.op) if claim is not None else None,
            "touched": msgspec.to_builtins(claim.touched) if claim is not None else None,
            "obligations": msgspec.to_builtins(claim.obligations) if claim is not None else [],
            "lost": msgspec.to_builtins(claim.lost) if claim is not None else [],
        }
    return view


__all__ = [
    "ABORTABLE", "CONSOLE_PROTOCOL", "DEFAULT_CUT", "DEFAULT_FLOOR", "FLOOR_KEY", "DoorRefusal", "Floor",
    "MoveRequest", "check_floor", "check_host", "choose", "claim_summary", "decide_abort", "decide_cut",
    "decide_move_claim", "decide_move_record", "eligible_boxes", "intent_matches", "move_summary",
    "parse_create_request", "parse_empty", "parse_move_request", "refuse", "status_line", "status_view",
]
