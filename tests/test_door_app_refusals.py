"""The door's refusals of §7.1 that apply once apps exist (issue 18 item 6): a host whose release declares a sidecar
environment file, a private store bound to its environment, or a registry column §6.2 refuses is refused a move
(409, with its sentence) and nothing changes; a host whose release declares none of them moves on. The create
route refuses an app or a release that does not exist."""

from __future__ import annotations

from pathlib import Path

import pytest

from bus.memory_log import MemoryEventLog
from events import Actor
from events.copy import say
from kernel.ports import ManualClock, SeededRandom
from services.apps.manifest import parse_manifest
from services.apps.releases import publish
from services.box.deployment import init_deployment
from services.box.roster import init_box
from services.door.api import Door
from services.door.auth import Identity
from services.door.decide import MoveRequest
from services.ledger.ledger import Ledger
from services.objstore.memory import MemoryStore

BUCKET = "door-apps"
OPERATOR = Identity("alice", "operator")


async def door_with_apps(root: Path) -> Door:
    clock = ManualClock()
    store, events = MemoryStore(), MemoryEventLog()
    await store.create_bucket(BUCKET)
    await init_deployment(root=root, store=store, bucket=BUCKET, clock=clock)
    actor = Actor(service="test", pid=1, nonce="apps")
    for label, region in (("ie-1", "ie"), ("uk-1", "uk")):
        await init_box(root=root, label=label, region=region, store=store, bucket=BUCKET, events=events, clock=clock,
                       actor=actor)
    return Door(Ledger(store, events, clock, actor, BUCKET), clock=clock, rng=SeededRandom(3))


@pytest.mark.parametrize(("declares", "copy", "sentence"), [
    ({"sidecar_env": True}, "M-R41",
     "h.example.com keeps a sidecar environment file (h.example.com-sidecar.env), which a move cannot carry."),
    ({"stores": {"media": {"private": True}}}, "M-C17", say("M-C17", host="h.example.com")),
    ({"registry": {"pool": "blue", "channel": "beta"}}, "M-R42",
     "h.example.com runs shop@1, which sets the registry columns pool; a move does not carry them."),
])
async def test_a_release_a_move_cannot_carry_is_refused_and_nothing_changes(
        tmp_path: Path, declares: dict[str, object], copy: str, sentence: str) -> None:
    door = await door_with_apps(tmp_path)
    store, bucket = door.ledger.store, door.ledger.bucket
    manifest = parse_manifest({"command": ["{python}", "-m", "shop"], **declares}, name="shop")
    await publish(store, bucket, manifest, [], clock=door.clock)
    created = await door.create("h.example.com", "ie-1", OPERATOR, app="shop")
    assert created.status == 201, created.body
    before = (await door.ledger.read_claim("h.example.com"))
    answer = await door.request_move("h.example.com", MoveRequest("uk", "auto"), OPERATOR)
    assert (answer.status, answer.body.get("copy")) == (409, copy), answer.body
    assert str(answer.body["reason"]).startswith(sentence), answer.body
    after = await door.ledger.read_claim("h.example.com")
    assert after.state == before.state and after.etag == before.etag, "nothing changed"
    assert (await door.ledger.read_record("h.example.com")).state is None


async def test_a_release_that_declares_none_of_them_moves_on(tmp_path: Path) -> None:
    door = await door_with_apps(tmp_path)
    manifest = parse_manifest({"command": ["{python}", "-m", "shop"], "registry": {"channel": "beta"},
                               "stores": {"media": {"private": False}}}, name="shop")
    await publish(door.ledger.store, door.ledger.bucket, manifest, [], clock=door.clock)
    assert (await door.create("h.example.com", "ie-1", OPERATOR, app="shop")).status == 201
    answer = await door.request_move("h.example.com", MoveRequest("uk", "auto"), OPERATOR)
    assert answer.status in (200, 201), answer.body


async def test_create_refuses_an_app_or_a_release_that_does_not_exist(tmp_path: Path) -> None:
    door = await door_with_apps(tmp_path)
    none = await door.create("h.example.com", "ie-1", OPERATOR, app="ghost")
    assert (none.status, none.body.get("copy")) == (409, "M-R43")
    manifest = parse_manifest({"command": ["{python}", "-m", "shop"]}, name="shop")
    await publish(door.ledger.store, door.ledger.bucket, manifest, [], clock=door.clock)
    missing = await door.create("h.example.com", "ie-1", OPERATOR, app="shop", release=7)
    assert (missing.status, missing.body.get("copy")) == (409, "M-R44")
    assert "its newest is 1" in str(missing.body["reason"])
    assert (await door.ledger.read_claim("h.example.com")).state is None
    made = await door.create("h.example.com", "ie-1", OPERATOR, app="shop", release=1)
    assert made.status == 201
    claim = (await door.ledger.read_claim("h.example.com")).state
    assert claim is not None and claim.holder is not None and claim.holder.app is not None
    assert (claim.holder.app.name, claim.holder.app.release) == ("shop", 1)
