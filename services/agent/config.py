"""What a box's agent is configured with (ARCHITECTURE §2, §9): its identity from ``hostmove box init``, the
deployment's region buckets and key.

What an instance runs is its host's app release (:mod:`services.apps`, issue 18): nothing here names an app. The
box's side directory ``<root>/acks/`` (the release slot ``{side_dir}``) holds what an app keeps outside every
instance (the sample app ``moveprobe`` logs its acknowledged writes there, so the demo and the tests can check that
none is lost). A composition that runs one fixed app (the simulation) launches it with :func:`sample_launch`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import msgspec

from services.box.artifacts.sealing import PrivateKey, load_private_key, secrets_key_fp
from services.box.instance.timers import TimerError, TimerSpec
from services.source.preparing import LaunchInputs
from services.target.budget import Rates
from services.target.readiness import BoxFacts

DATA_BUCKET_PREFIX = "hostmove-data"


class BoxConfigError(Exception):
    """The box is not set up here; the message says what to run."""


def region_bucket(region: str) -> str:
    """A region's data bucket (the deployment bucket holds claims, records, roster and evidence; §3)."""
    return f"{os.environ.get('HOSTMOVE_DATA_BUCKET_PREFIX', DATA_BUCKET_PREFIX)}-{region}"


@dataclass(frozen=True)
class BoxConfig:
    root: Path
    label: str
    region: str
    box_dir: Path

    @property
    def acks_dir(self) -> Path:
        return self.root / "acks"

    @property
    def data_bucket(self) -> str:
        return region_bucket(self.region)

    def secrets_key(self) -> PrivateKey:
        return load_private_key(self.box_dir / "secrets.pem")


def load_box(root: Path, label: str) -> BoxConfig:
    """The box ``label`` as ``hostmove box init`` left it under ``root``."""
    box_dir = root / "boxes" / label
    try:
        identity = json.loads((box_dir / "box.json").read_text())
    except FileNotFoundError:
        raise BoxConfigError(f"box {label} is not set up under {root}: run `hostmove box init --label {label} "
                             "--region <region>` first") from None
    except (OSError, ValueError) as exc:
        raise BoxConfigError(f"{box_dir / 'box.json'} cannot be read ({exc}); run `hostmove box init` again") from None
    if identity.get("label") != label or not identity.get("region"):
        raise BoxConfigError(f"{box_dir / 'box.json'} does not describe box {label}")
    return BoxConfig(root=root, label=label, region=str(identity["region"]), box_dir=box_dir)


class _Schedule(msgspec.Struct, frozen=True):
    name: str
    every_s: float


class _Once(msgspec.Struct, frozen=True):
    name: str
    due_at_ms: int


class _Declared(msgspec.Struct, frozen=True):
    schedules: tuple[_Schedule, ...] = ()
    once: tuple[_Once, ...] = ()


TIMER_PATH = "/timers/{name}"
"""Where an app takes a timer delivery (the box's runner fills in the name, §9.4): the platform's contract with
every app that declares timers."""


def declared_timers(files_dir: Path) -> list[TimerSpec] | None:
    """:func:`declared_timers_at` ``timers.json`` in ``files_dir`` (a fixed app's declaration)."""
    return declared_timers_at(files_dir / "timers.json")


def declared_timers_at(path: Path) -> list[TimerSpec] | None:
    """The timers an app declares in the file its release names (``timers``, relative to the instance's
    directory; spec §14.4 "a declared schedule and a once-timer"): ``{"schedules": [{"name", "every_s"}], "once":
    [{"name", "due_at_ms"}]}``, as the box's timer specs; None when it has declared none yet. A declaration that
    cannot be read raises :class:`TimerError` (a read error never acts)."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    try:
        declared = msgspec.json.decode(raw, type=_Declared)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise TimerError(f"{path} cannot be read: {exc}") from None
    return ([TimerSpec(name=s.name, every_ms=max(1, round(s.every_s * 1000))) for s in declared.schedules]
            + [TimerSpec(name=o.name, at_ms=o.due_at_ms) for o in declared.once])


async def sample_launch(host: str) -> LaunchInputs:
    """What a fixed app's next spawn gets (§7.3 launch report): no overlay, one bundle."""
    return LaunchInputs(env={"MOVEPROBE_HOST": host}, bundle_etags={"app": '"embedded"'}, release="embedded-1")


def embedded_facts(label: str, key: PrivateKey) -> BoxFacts:
    """The readiness facts of an embedded-default box (T1-T3, T7, T8, T11 rates, T13)."""
    return BoxFacts(protocol=1, console_secrets_key_fp=secrets_key_fp(key), rates=Rates(10, 250, 500),
                    environment_matches=True, release_staged=True, hosting_boxes=(label,), landing_armed=True,
                    rollback_target_armed=True)
