"""Initializing a deployment, and the protocol floor every box checks at boot (issue 18; spec §10, §11).

``hostmove deployment init`` (:func:`init_deployment`) is the console's one set-up step: it holds the deployment's
secrets key under ``<root>/deployment/secrets.pem`` (the one given, or generated once) and publishes, create-only,

- ``control/secrets-key.json``: the key's public half and its §10 fingerprint, what T2 compares every box with
  (:func:`services.box.roster.publish_deployment_key`); and
- ``control/moves-protocol.json``: the protocol floor ``{"min": 1, "min_release": ""}`` (§11: "before the first
  production move the deployment writes" it), unless one is there already.

**The floor at boot** (rule ``floor-boot-recovery``: every path that activates an executable, boot recovery
included, refuses a release below the floor). :func:`below_floor` is pure: a box whose moves protocol is below
``min``, or whose release is below ``min_release``, answers the sentence it refuses with; the agent refuses to start
(:mod:`hostmove.serve`), and T1 fails for such a box (:mod:`services.target.observe`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from events.base import canonical, decode
from kernel import rules
from kernel.fsutil import atomic_write
from kernel.ports import Clock
from services.box.artifacts.sealing import load_private_key
from services.box.roster import (
    DEFAULT_FLOOR,
    FLOOR_KEY,
    MOVES_PROTOCOL,
    DeploymentKey,
    Floor,
    deployment_key_path,
    ensure_deployment_key,
    publish_deployment_key,
)
from services.objstore.port import Got, ObjectStore, StoreUnavailable
from services.objstore.probe import conformance_probe

rules.register(
    "floor-boot-recovery",
    section="§11, N12 (every activation path, boot recovery included, refuses sub-floor releases)",
    meaning="a box below the protocol floor (moves protocol or release) refuses at boot to take part in moves",
    site="services/box/deployment.py below_floor",
)

_VERSION = re.compile(r"^v?(\d+)(?:\.(\d+))?(?:\.(\d+))?")


def box_release() -> str:
    """This build's release, ``v<version>`` of the installed ``hostmove`` distribution."""
    try:
        return "v" + metadata.version("hostmove")
    except metadata.PackageNotFoundError:
        return "v0.0.0"


def version_key(text: str) -> tuple[int, int, int] | None:
    """``vX.Y.Z`` (or ``X.Y``, ``X``) as a comparable triple; None when it is not a version."""
    m = _VERSION.match(text.strip())
    if m is None:
        return None
    return int(m.group(1)), int(m.group(2) or 0), int(m.group(3) or 0)


async def read_floor(store: ObjectStore, bucket: str) -> Floor | None:
    """``control/moves-protocol.json`` if present. A corrupt one raises (a read error never acts)."""
    got = await store.get(bucket, FLOOR_KEY)
    return decode(got.body, Floor) if isinstance(got, Got) else None


def below_floor(floor: Floor | None, *, protocol: int = MOVES_PROTOCOL, release: str | None = None) -> str | None:
    """Why a box speaking ``protocol`` at ``release`` is below ``floor``, or None (absent: the default floor)."""
    if not rules.on("floor-boot-recovery"):
        return None
    minimum = floor.min if floor is not None else DEFAULT_FLOOR
    if protocol < minimum:
        return f"this box speaks moves protocol {protocol}, below the deployment's floor {minimum}"
    if floor is not None and floor.min_release:
        want, have = version_key(floor.min_release), version_key(release or box_release())
        if want is None:
            return f"the floor's min_release {floor.min_release!r} is not a version this box can compare"
        if have is None or have < want:
            return f"this box runs release {release or box_release()}, below the floor's {floor.min_release}"
    return None


@dataclass(frozen=True)
class DeploymentInit:
    key_path: Path
    key: DeploymentKey
    floor: Floor


async def init_deployment(*, root: Path, store: ObjectStore, bucket: str, clock: Clock,
                          secrets_key: Path | None = None, floor: Floor | None = None) -> DeploymentInit:
    """Hold the deployment's key under ``root`` and publish it and the floor, each create-only (module doc). Run
    again with the same key it changes nothing; a different key than the published one is refused."""
    key_path = ensure_deployment_key(root, secrets_key)
    held = deployment_key_path(root)
    if secrets_key is not None and not held.exists():  # boxes initialized under this root take it from here
        held.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        atomic_write(held, secrets_key.read_bytes(), mode=0o600)
    published = await publish_deployment_key(store, bucket, load_private_key(key_path), clock)
    current = await read_floor(store, bucket)
    if current is None:
        wanted = floor or Floor(min=MOVES_PROTOCOL)
        await store.put(bucket, FLOOR_KEY, canonical(wanted), if_none_match=True)
        current = await read_floor(store, bucket) or wanted
    return DeploymentInit(key_path=key_path, key=published, floor=current)


@dataclass(frozen=True)
class StoreRefused:
    """Why ``deployment init`` refuses the object store: a bucket that keeps no versions, or a conformance check it
    failed (the guarantees moves rely on, §3 and ARCHITECTURE §9); ``bucket`` is where."""

    bucket: str
    why: str


async def prepare_buckets(store: ObjectStore, buckets: Sequence[str]) -> StoreRefused | None:
    """Create each of ``buckets`` with versioning on (one that exists is kept), then require that each keeps
    versions and passes the conformance probe (issue 20 item 5). Idempotent. A store that stops answering raises
    :class:`StoreUnavailable` (an outage, never a refusal); one that answers and fails is :class:`StoreRefused`."""
    for bucket in dict.fromkeys(buckets):
        await store.create_bucket(bucket, versioned=True)
        if not await store.bucket_versioning(bucket):
            return StoreRefused(bucket, "versioning could not be turned on (every claim, record and replica is read "
                                        "by exact version)")
        report = await conformance_probe(store, bucket)
        if report.ok:
            continue
        first = report.failed[0]
        if "StoreUnavailable" in first.detail:
            raise StoreUnavailable(f"the store stopped answering during the conformance probe of {bucket}: "
                                   f"{first.detail}")
        also = f" (and {len(report.failed) - 1} more checks)" if len(report.failed) > 1 else ""
        return StoreRefused(bucket, f"it failed the conformance check {first.name!r} ({first.description}): "
                                    f"{first.detail}{also}")
    return None


__all__ = ["DeploymentInit", "StoreRefused", "below_floor", "box_release", "init_deployment", "prepare_buckets",
           "read_floor", "version_key"]
