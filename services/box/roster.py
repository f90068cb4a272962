"""The roster and box initialization (issue 3 item 1; spec §7.1 "over the roster", §10, §11).

``control/roster.json`` in the deployment bucket lists every box: label, region, ``moves_protocol``
(§11: every box publishes ``moves_protocol: 1``) and ``secrets_key_fp`` (§10). It is rewritten whole
by compare-and-swap (If-Match, or If-None-Match to create), with a ``gen`` per write so identical
bytes never reproduce an old ETag. Each registration is also a ``roster`` fact on the stream.

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
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, ClassVar

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
DEPLOYMENT_KEY = "control/deployment.json"
DEPLOYMENT_SECRETS_KEY = "control/secrets-key.json"
MOVES_PROTOCOL = 1
FLOOR_KEY = "control/moves-protocol.json"
DEFAULT_FLOOR = 1
"""The floor when ``control/moves-protocol.json`` is absent: a box that does not speak protocol 1
cannot take part in a move at all (§11)."""
_DEPLOYMENT_ID = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")


class Floor(Durable, frozen=True):
    """``control/moves-protocol.json`` (§11): ``{"min": 1, "min_release": "vX.Y.Z"}``. ``min_release``
    binds the paths that activate an executable, not the door; it is read and carried, not checked."""

    min: Annotated[int, msgspec.Meta(ge=1)]
    min_release: str = ""


class RosterBox(Durable, frozen=True):
    label: Ident
    region: Ident
    moves_protocol: int
    secrets_key_fp: str
    registered_at: Millis
    fenced_at: Millis | None = None
    """Set once the box is fenced (:mod:`services.box.fence`): it never acts, registers or is chosen again."""
    instance_id: str = ""
    """The box's compute as its platform knows it (:mod:`services.box.compute`): the instance id (EC2), the
    account that owns it and the platform's region; empty on the embedded default, whose platform knows a box by
    its label and the deployment's identity."""
    account: str = ""
    cloud_region: str = ""


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


async def read_roster(store: ObjectStore, bucket: str) -> tuple[Roster | None, str | None]:
    """The roster and its ETag. A corrupt roster raises ``DurableValueError`` (C6)."""
    got = await store.get(bucket, ROSTER_KEY)
    if not isinstance(got, Got):
        return None, None
    return decode(got.body, Roster), got.etag


async def update_roster(
    store: ObjectStore, bucket: str, decide: Callable[[Roster | None], Roster], attempts: int = 5
) -> Roster:
    """Read, decide, CAS; a lost CAS re-reads and decides again."""
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
) -> BoxInit:
    """Create the box directory, hold the secrets key (0600) and register the box in the roster.

    With ``expect_fp`` (``hostmove box init``: the fingerprint the console published, :func:`read_deployment_key`)
    the key must be the deployment's: a missing key is never generated and another key is refused; a box that held
    another key is given the deployment's. Without it (an embedded composition), the deployment key under
    ``root`` is used, generated once."""
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
    roster = await update_roster(store, bucket, lambda cur: decide_register(cur, entry))
    await publish_fact(
        events,
        Fact(
            kind="roster",
            subject=label,
            id=f"{label}:{roster.gen}",
            actor=actor,
            at=clock.now_ms(),
            payload=msgspec.to_builtins(entry),
        ),
    )
    return BoxInit(label=label, region=region, box_dir=box_dir, secrets_key_fp=fp, roster_gen=roster.gen)
