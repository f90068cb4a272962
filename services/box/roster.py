"""The roster and box initialization (issue 3 item 1; spec §7.1 "over the roster", §10, §11).

``control/roster.json`` in the deployment bucket lists every box: label, region, ``moves_protocol``
(§11: every box publishes ``moves_protocol: 1``) and ``secrets_key_fp`` (§10). It is rewritten whole
by compare-and-swap (If-Match, or If-None-Match to create), with a ``gen`` per write so identical
bytes never reproduce an old ETag, by the operator's roles only (the fence, an embedded composition).

A box registers itself in an object of its own, ``control/boxes/<label>.json`` (:class:`BoxRegistration`, CASed
the same way), the one object of the roster its S3 identity may write (spec §0.1 M17, issue 14: a box never
writes the roster, another box's entry or a fence). Every reader reads both (:func:`read_roster`): an entry of
``roster.json`` that is fenced stands whatever the box's own object says (a box never unfences itself), a box's
object never changes the region ``roster.json`` records, and an object that names another box, or fails decoding
or its size bound, is skipped for that box only. Each registration is also a ``roster`` fact on the stream, from
the roles that may publish one (the box role may not: its object is its record).

``init_box`` creates the box's directory (``<root>/boxes/<label>/``), holds the deployment's P-256
secrets key there with owner-only permissions, and registers the box.

``control/deployment.json`` is the deployment's identity (issue 11 item 5): a random id, created once, create-only
(If-None-Match), by whoever first needs it (:func:`ensure_deployment`: a box's agent at its start, the fence, the
demo), and never rewritten, so every service of the deployment reads the same id across restarts of each of them
and of the stack (the bucket persists; ports do not). It keys the box's cgroup subtree on the machine,
``hostmove/<deployment>/<label>`` (:class:`services.box.instance.proctree.CgroupTree`): two deployments that both
name a box ``ie-1`` on one machine never see, kill or share each other's processes.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import msgspec

from bus.facts import Fact, publish_fact
from bus.log import EventLog
from events.base import Durable, DurableValueError, Ident, Millis, canonical, check_gen, decode, validate_ident
from events.envelope import Actor
from kernel.fsutil import atomic_write
from kernel.ports import Clock, Random
from services.box.artifacts.sealing import (
    PrivateKey,
    SealError,
    generate_private_key,
    load_private_key,
    public_key_pem,
    save_private_key,
    secrets_key_fp,
)
from services.objstore.port import Got, Lost, ObjectStore

ROSTER_KEY = "control/roster.json"
BOXES_PREFIX = "control/boxes/"
MAX_ENTRY_BYTES = 64 * 1024
"""A box's own roster object is a few hundred bytes; anything larger is skipped before it is decoded."""
DEPLOYMENT_KEY = "control/deployment.json"
DEPLOYMENT_SECRETS_KEY = "control/secrets-key.json"
MOVES_PROTOCOL = 1
_DEPLOYMENT_ID = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")
log = logging.getLogger("hostmove.roster")


class RosterBox(Durable, frozen=True):
    label: Ident
    region: Ident
    moves_protocol: int
    secrets_key_fp: str
    registered_at: Millis
    fenced_at: Millis | None = None
    """Set once the box is fenced (:mod:`services.box.fence`): it never acts, registers or is chosen again."""


class Roster(Durable, frozen=True):
    __durable_root__: ClassVar[bool] = True

    gen: int
    boxes: tuple[RosterBox, ...] = ()

    def __post_init__(self) -> None:
        super().__post_init__()
        check_gen(self.gen, "Roster.gen")

    def box(self, label: str) -> RosterBox | None:
        return next((b for b in self.boxes if b.label == label), None)

    def in_region(self, region: str) -> list[RosterBox]:
        return [b for b in self.boxes if b.region == region]

    def live_in_region(self, region: str) -> list[RosterBox]:
        """The region's boxes that are not fenced (the ones an operation may choose)."""
        return [b for b in self.in_region(region) if b.fenced_at is None]


class BoxRegistration(Durable, frozen=True):
    """``control/boxes/<label>.json``: a box's own entry in the roster, the one the box's identity writes."""

    __durable_root__: ClassVar[bool] = True

    gen: int
    box: RosterBox

    def __post_init__(self) -> None:
        super().__post_init__()
        check_gen(self.gen, "BoxRegistration.gen")


def box_entry_key(label: str) -> str:
    return f"{BOXES_PREFIX}{label}.json"


class RosterRefusal(Exception):
    """A registration the roster refuses, in the operator's words."""


class DeploymentId(Durable, frozen=True):
    """``control/deployment.json``: who this deployment is, whatever its ports or box labels."""

    __durable_root__: ClassVar[bool] = True

    id: Ident
    """Lowercase letters, digits and ``-``, at most 63 (a cgroup directory name as it stands)."""
    created_at: Millis

    def __post_init__(self) -> None:
        super().__post_init__()
        if not _DEPLOYMENT_ID.match(self.id):
            raise DurableValueError("invalid_value", "deployment_id", "a deployment id is lowercase letters, digits "
                                    "and '-', at most 63, starting with a letter or digit", "DeploymentId.id")


def new_deployment_id(rng: Random) -> str:
    """A fresh deployment id: 64 random bits in hex."""
    return rng.token_bytes(8).hex()


async def read_deployment(store: ObjectStore, bucket: str) -> DeploymentId | None:
    """The deployment's identity, or ``None`` before anyone needed one. A corrupt one raises (C6)."""
    got = await store.get(bucket, DEPLOYMENT_KEY)
    if not isinstance(got, Got):
        return None
    return decode(got.body, DeploymentId)


async def ensure_deployment(store: ObjectStore, bucket: str, *, rng: Random, clock: Clock) -> str:
    """The deployment's id, created create-only on first need: of two first readers one write wins and both
    answer its id."""
    current = await read_deployment(store, bucket)
    if current is not None:
        return current.id
    minted = DeploymentId(id=new_deployment_id(rng), created_at=clock.now_ms())
    result = await store.put(bucket, DEPLOYMENT_KEY, canonical(minted), if_none_match=True)
    if not isinstance(result, Lost):
        return minted.id
    current = await read_deployment(store, bucket)  # another service's first write stands
    if current is None:
        raise RosterRefusal(f"the deployment's identity {DEPLOYMENT_KEY} was written but cannot be read back; "
                            "start again")
    return current.id


def decide_register(current: Roster | None, entry: RosterBox) -> Roster:
    """Add or refresh a box. A label never moves to another region (that would be a new box)."""
    boxes = list(current.boxes) if current else []
    existing = next((b for b in boxes if b.label == entry.label), None)
    if existing is not None:
        if existing.fenced_at is not None:
            raise RosterRefusal(f"box {entry.label} was fenced (terminated) and never comes back; enroll the "
                                "replacement under a new label")
        if existing.region != entry.region:
            raise RosterRefusal(
                f"box {entry.label} is registered in region {existing.region}; a box never changes region"
            )
        boxes = [entry if b.label == entry.label else b for b in boxes]
    else:
        boxes.append(entry)
    boxes.sort(key=lambda b: b.label)
    return Roster(gen=(current.gen + 1) if current else 1, boxes=tuple(boxes))


async def _read_roster_object(store: ObjectStore, bucket: str) -> tuple[Roster | None, str | None]:
    got = await store.get(bucket, ROSTER_KEY)
    if not isinstance(got, Got):
        return None, None
    return decode(got.body, Roster), got.etag


async def _read_registration(store: ObjectStore, bucket: str, label: str,
                             ) -> tuple[BoxRegistration | None, str | None]:
    """A box's own object and its ETag; one that is too large, fails decoding or names another box raises."""
    key = box_entry_key(label)
    got = await store.get(bucket, key)
    if not isinstance(got, Got):
        return None, None
    if len(got.body) > MAX_ENTRY_BYTES:  # before anything decodes it
        raise DurableValueError("decode_failed", "max_bytes", f"{key} is {len(got.body)} bytes; at most "
                                f"{MAX_ENTRY_BYTES}", "BoxRegistration")
    reg = decode(got.body, BoxRegistration)
    if reg.box.label != label:
        raise DurableValueError("invalid_value", "box_label", f"{key} names the box {reg.box.label}",
                                "BoxRegistration.box.label")
    return reg, got.etag


def merge_roster(listed: Roster | None, own: list[RosterBox]) -> Roster | None:
    """The roster every reader sees: ``roster.json``'s entries and the boxes' own (pure). A fenced entry stands, a
    box's own entry never changes its recorded region, and otherwise the later registration wins."""
    boxes = {b.label: b for b in listed.boxes} if listed else {}
    for entry in own:
        known = boxes.get(entry.label)
        if known is None:
            boxes[entry.label] = msgspec.structs.replace(entry, fenced_at=None)
        elif known.fenced_at is None and known.region == entry.region and entry.registered_at >= known.registered_at:
            boxes[entry.label] = msgspec.structs.replace(entry, fenced_at=None)
    if listed is None and not boxes:
        return None
    return Roster(gen=listed.gen if listed else 1, boxes=tuple(sorted(boxes.values(), key=lambda b: b.label)))


async def _own_entries(store: ObjectStore, bucket: str) -> list[RosterBox]:
    out = []
    for key in await store.list_keys(bucket, BOXES_PREFIX):
        label = key[len(BOXES_PREFIX):].removesuffix(".json")
        if not key.endswith(".json") or "/" in label:
            continue
        try:
            reg, _ = await _read_registration(store, bucket, label)
        except DurableValueError as exc:
            log.error("the roster skips box %s: its entry %s cannot be used (%s)", label, key, exc)
            continue
        if reg is not None:
            out.append(reg.box)
    return out


async def read_roster(store: ObjectStore, bucket: str) -> tuple[Roster | None, str | None]:
    """The roster (``roster.json`` and every box's own object, :func:`merge_roster`) and ``roster.json``'s ETag. A
    corrupt ``roster.json`` raises ``DurableValueError`` (C6); a box's unusable object skips that box only."""
    listed, etag = await _read_roster_object(store, bucket)
    return merge_roster(listed, await _own_entries(store, bucket)), etag


async def update_roster(
    store: ObjectStore, bucket: str, decide: Callable[[Roster | None], Roster], attempts: int = 5
) -> Roster:
    """Read, decide, CAS ``roster.json`` (the operator's roles); ``decide`` sees the whole roster, boxes' own
    entries included, so a fence can mark a box that registered itself. A lost CAS re-reads and decides again."""
    for _ in range(attempts):
        current, etag = await read_roster(store, bucket)
        new = decide(current)
        result = await store.put(bucket, ROSTER_KEY, canonical(new), if_match=etag, if_none_match=etag is None)
        if not isinstance(result, Lost):
            return new
    raise RosterRefusal("the roster kept changing under this registration; try again")


@dataclass(frozen=True)
class BoxInit:
    label: str
    region: str
    box_dir: Path
    secrets_key_fp: str
    roster_gen: int


def deployment_key_path(root: Path) -> Path:
    return root / "deployment" / "secrets.pem"


def ensure_deployment_key(root: Path, source: Path | None = None, *, generate: bool = True) -> Path:
    """The deployment's secrets key for the embedded default: ``source`` if given, else the one under
    ``<root>/deployment/``, generated once (unless ``generate`` is False: then a missing key is refused)."""
    if source is not None:
        try:
            load_private_key(source)  # refuses a world-readable or malformed key
        except SealError as exc:
            raise RosterRefusal(str(exc)) from None
        return source
    path = deployment_key_path(root)
    if not path.exists():
        if not generate:
            raise RosterRefusal(f"there is no deployment secrets key at {path}: pass the deployment's key with "
                                "--secrets-key (a box never makes a key of its own)")
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        save_private_key(generate_private_key(), path)
    return path


class DeploymentKey(Durable, frozen=True):
    """``control/secrets-key.json``: the deployment's secrets key as the console holds it (§10: the console computes
    ``secrets_key_fp`` over ``CARLOS_SECRETS_PUBKEY``), published once, create-only, when the deployment is
    initialized (:func:`publish_deployment_key`). T2 compares every box's roster ``secrets_key_fp`` with ``fp``;
    releases seal their secrets to ``public_key``."""

    __durable_root__: ClassVar[bool] = True

    fp: str
    public_key: bytes
    """SubjectPublicKeyInfo PEM."""
    published_at: Millis


async def read_deployment_key(store: ObjectStore, bucket: str) -> DeploymentKey | None:
    """The console's deployment key, or ``None`` before the deployment was initialized. A corrupt one raises."""
    got = await store.get(bucket, DEPLOYMENT_SECRETS_KEY)
    if not isinstance(got, Got):
        return None
    return decode(got.body, DeploymentKey)


async def publish_deployment_key(store: ObjectStore, bucket: str, key: PrivateKey, clock: Clock) -> DeploymentKey:
    """Publish the deployment's key once (If-None-Match). Publishing the same key again answers the published one;
    another key is refused: the deployment's key is never replaced by a publication."""
    fp = secrets_key_fp(key)
    current = await read_deployment_key(store, bucket)
    if current is None:
        mint = DeploymentKey(fp=fp, public_key=public_key_pem(key), published_at=clock.now_ms())
        result = await store.put(bucket, DEPLOYMENT_SECRETS_KEY, canonical(mint), if_none_match=True)
        if not isinstance(result, Lost):
            return mint
        current = await read_deployment_key(store, bucket)
        if current is None:
            raise RosterRefusal(f"{DEPLOYMENT_SECRETS_KEY} was written but cannot be read back; try again")
    if current.fp != fp:
        raise RosterRefusal(f"the deployment already holds the secrets key {current.fp}; this key ({fp}) is not it")
    return current


async def init_box(
    *,
    root: Path,
    label: str,
    region: str,
    store: ObjectStore,
    bucket: str,
    events: EventLog,
    clock: Clock,
    actor: Actor,
    secrets_key: Path | None = None,
    expect_fp: str | None = None,
    announce: bool = True,
) -> BoxInit:
    """Create the box directory, hold the secrets key (0600) and register the box in the roster.

    With ``expect_fp`` (``hostmove box init``: the fingerprint the console published, :func:`read_deployment_key`)
    the key must be the deployment's: a missing key is never generated and another key is refused; a box that held
    another key is given the deployment's. Without it (an embedded composition), the deployment key under
    ``root`` is used, generated once. The box registers in its own object (:func:`register_box`); ``announce``
    publishes the ``roster`` fact too (a box's own identity may not publish one)."""
    validate_ident(label, "box label")
    validate_ident(region, "region")
    if "/" in label or label.startswith("."):
        raise RosterRefusal("a box label cannot contain '/' or start with '.'")
    key_path = ensure_deployment_key(root, secrets_key, generate=expect_fp is None)
    if expect_fp is not None:
        given = secrets_key_fp(load_private_key(key_path))
        if given != expect_fp:
            raise RosterRefusal(f"the key {key_path} ({given}) is not the deployment's secrets key ({expect_fp}); "
                                "pass the deployment's key with --secrets-key")
    box_dir = root / "boxes" / label
    box_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    held = box_dir / "secrets.pem"
    if not held.exists() or (expect_fp is not None and secrets_key_fp(load_private_key(held)) != expect_fp):
        atomic_write(held, key_path.read_bytes(), mode=0o600)
    fp = secrets_key_fp(load_private_key(held))
    identity = {"label": label, "region": region}
    box_file = box_dir / "box.json"
    if box_file.exists() and json.loads(box_file.read_text()) != identity:
        raise RosterRefusal(f"{box_dir} already belongs to another box")
    box_file.write_text(json.dumps(identity))
    entry = RosterBox(
        label=label, region=region, moves_protocol=MOVES_PROTOCOL, secrets_key_fp=fp, registered_at=clock.now_ms()
    )
    gen = await register_box(store, bucket, entry)
    if announce:
        await publish_fact(
            events,
            Fact(
                kind="roster",
                subject=label,
                id=f"{label}:{gen}",
                actor=actor,
                at=clock.now_ms(),
                payload=msgspec.to_builtins(entry),
            ),
        )
    return BoxInit(label=label, region=region, box_dir=box_dir, secrets_key_fp=fp, roster_gen=gen)


async def register_box(store: ObjectStore, bucket: str, entry: RosterBox, attempts: int = 5) -> int:
    """Write ``entry`` into the box's own object (CAS), checked against the whole roster by
    :func:`decide_register` (a fenced box never registers again, a box never changes region); answers the object's
    new ``gen``."""
    key = box_entry_key(entry.label)
    for _ in range(attempts):
        current, _etag = await read_roster(store, bucket)
        decide_register(current, entry)
        try:
            own, etag = await _read_registration(store, bucket, entry.label)
        except DurableValueError:  # the box's own unusable object: its registration replaces it
            head = await store.head(bucket, key)
            own, etag = None, head.etag if isinstance(head, Got) else None
        gen = own.gen + 1 if own is not None else 1
        result = await store.put(bucket, key, canonical(BoxRegistration(gen=gen, box=entry)), if_match=etag,
                                 if_none_match=etag is None)
        if not isinstance(result, Lost):
            return gen
    raise RosterRefusal("the box's roster entry kept changing under this registration; try again")
