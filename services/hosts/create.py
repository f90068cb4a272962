"""Creating a host through its claim (issue 3 item 1; claim spec §4 via spec §0.4).

Two pure deciders: ``begin_create`` takes an absent or free claim to a ``creating`` op that names
the box, region and fresh incarnation in its intent (C2: intent before effect); ``finish_create``
takes it to ``serving`` with the holder (a fresh 64-hex incarnation and its own location, C3a) and
the box as the execution holder.
"""

from __future__ import annotations

import functools

import msgspec

from events.claim import AppRef, Claim, Holder, Op, Touched
from services.ledger.ledger import Committed, Conflict, Ledger, NoChange, Refusal


def location_for(host: str, incarnation: str) -> str:
    """``instances/<host>/<incarnation>/`` (C3a: no location shared between incarnations)."""
    return f"instances/{host}/{incarnation}/"


def decide_begin_create(
    current: Claim | None, *, host: str, incarnation: str, box: str, region: str, app: AppRef | None = None
) -> Claim | NoChange | Refusal:
    create: dict[str, object] = {"incarnation": incarnation, "box": box, "region": region}
    if app is not None:  # the release the incarnation runs (issue 18), named in the intent before any effect (C2)
        create["app"] = msgspec.to_builtins(app)
    intent = {"create": create}
    if current is not None:
        if current.op.kind == "creating" and current.op.intent == intent:
            return NoChange("already creating")
        if current.op.kind != "free" or current.holder is not None:
            return Refusal(f"{host} already exists ({current.op.kind}); nothing was changed.")
        if incarnation in current.retired_incarnations:
            return Refusal(f"incarnation {incarnation[:12]}... was used before and is never reused.")
    base = current or Claim(host=host, gen=1)
    return msgspec.structs.replace(
        base,
        op=Op(kind="creating", intent=intent, exec="none", participants=(box,)),
        touched=Touched(regions=(region,), boxes=(box,), complete=True),
    )


def decide_finish_create(current: Claim | None, *, incarnation: str) -> Claim | NoChange | Refusal:
    if current is None:
        return Refusal("there is no claim to finish creating")
    if current.op.kind == "serving" and current.holder and current.holder.incarnation == incarnation:
        return NoChange("already serving")
    if current.op.kind != "creating" or current.op.intent.get("create", {}).get("incarnation") != incarnation:
        return Refusal(f"{current.host} is not being created with this incarnation; nothing was changed.")
    box = current.op.intent["create"]["box"]
    named = current.op.intent["create"].get("app")
    app = msgspec.convert(dict(named), AppRef) if named is not None else None
    holder = Holder(incarnation=incarnation, location=location_for(current.host, incarnation), writer_box="",
                    app=app)
    return msgspec.structs.replace(
        current, holder=holder, op=Op(kind="serving", exec=box, participants=(box,))
    )


async def create_host(ledger: Ledger, host: str, *, box: str, region: str, incarnation: str,
                      app: AppRef | None = None, causation: str = "") -> Committed[Claim] | Refusal:
    """Create ``host`` on ``box`` running the release ``app``: the ``creating`` CAS (intent first, C2), then
    ``serving`` with the holder naming the release.

    A crash between the two leaves ``creating`` with the intent; running this again with the same
    incarnation finishes it.
    """
    begin = await ledger.transition(
        "claim", host, "create-begin",
        functools.partial(decide_begin_create, host=host, incarnation=incarnation, box=box, region=region, app=app),
        causation=causation,
    )
    if isinstance(begin, Refusal):
        return begin
    if isinstance(begin, Conflict):
        return Refusal(f"{host} kept changing while it was being created; try again")
    finish = await ledger.transition(
        "claim", host, "create-serving", functools.partial(decide_finish_create, incarnation=incarnation),
        causation=causation,
    )
    if isinstance(finish, Committed):
        return finish
    if isinstance(finish, NoChange):
        current = await ledger.read_claim(host)
        assert current.state is not None
        return Committed(current.state, current.etag, current.version_id, None)
    if isinstance(finish, Conflict):
        return Refusal(f"{host} kept changing while it was being created; try again")
    return finish
