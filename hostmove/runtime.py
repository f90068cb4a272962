"""Settings and the wiring every service starts with (ARCHITECTURE §7, §9).

Endpoints come from the environment (``HOSTMOVE_NATS_URL``, ``HOSTMOVE_S3_ENDPOINT``,
``HOSTMOVE_S3_ACCESS_KEY``, ``HOSTMOVE_S3_SECRET_KEY``, ``HOSTMOVE_S3_REGION``,
``HOSTMOVE_BUCKET``) or, for the embedded default, from ``.hostmove/stack.json``. Every service
runs the object-store conformance probe at start and refuses to run on a store that fails it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import msgspec

from bus.nats_log import NatsEventLog
from events.envelope import Actor
from hostmove.stackinfo import StackInfo
from kernel.ports import Clock, Random, SystemRandom, WallClock, pid, process_nonce
from services.ledger.ledger import Ledger
from services.objstore.probe import run_probe_or_exit
from services.objstore.s3 import S3Store

DEFAULT_BUCKET = "hostmove-deployment"
DEFAULT_ROOT = Path(".hostmove")


class ConfigError(Exception):
    """The settings are missing or wrong; the message says what to do."""


@dataclass(frozen=True)
class Settings:
    nats_url: str
    s3_endpoint: str
    s3_access_key: str
    s3_secret_key: str
    s3_region: str
    bucket: str
    root: Path
    local: bool  # the embedded stack: buckets may be created on first use

    def __repr__(self) -> str:  # never print the secret
        return f"Settings(nats={self.nats_url}, s3={self.s3_endpoint}, bucket={self.bucket})"


def load_settings(root: Path | None = None) -> Settings:
    root = Path(os.environ.get("HOSTMOVE_ROOT", root or DEFAULT_ROOT))
    bucket = os.environ.get("HOSTMOVE_BUCKET", DEFAULT_BUCKET)
    env = os.environ
    if env.get("HOSTMOVE_NATS_URL") and env.get("HOSTMOVE_S3_ENDPOINT"):
        missing = [k for k in ("HOSTMOVE_S3_ACCESS_KEY", "HOSTMOVE_S3_SECRET_KEY") if not env.get(k)]
        if missing:
            raise ConfigError(f"set {', '.join(missing)}: the object store never runs anonymous")
        return Settings(
            nats_url=env["HOSTMOVE_NATS_URL"],
            s3_endpoint=env["HOSTMOVE_S3_ENDPOINT"],
            s3_access_key=env["HOSTMOVE_S3_ACCESS_KEY"],
            s3_secret_key=env["HOSTMOVE_S3_SECRET_KEY"],
            s3_region=env.get("HOSTMOVE_S3_REGION", "us-east-1"),
            bucket=bucket,
            root=root,
            local=False,
        )
    stack_file = root / "stack.json"
    if not stack_file.exists():
        raise ConfigError(
            f"no stack at {stack_file}: run `hostmove stack up`, or set HOSTMOVE_NATS_URL and "
            "HOSTMOVE_S3_ENDPOINT with HOSTMOVE_S3_ACCESS_KEY and HOSTMOVE_S3_SECRET_KEY"
        )
    try:
        info = msgspec.json.decode(stack_file.read_bytes(), type=StackInfo)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ConfigError(
            f"{stack_file} is unreadable ({exc}); run `hostmove stack down` then `up`"
        ) from None
    return settings_from_stack(info, root=root, bucket=bucket)


def settings_from_stack(info: StackInfo, *, root: Path, bucket: str = DEFAULT_BUCKET) -> Settings:
    return Settings(
        nats_url=info.nats_url,
        s3_endpoint=info.s3_endpoint,
        s3_access_key=info.s3_access_key,
        s3_secret_key=info.s3_secret_key,
        s3_region=info.s3_region,
        bucket=bucket,
        root=root,
        local=True,
    )


@dataclass
class Runtime:
    """What a service holds: its ports, bound to the real store and stream."""

    settings: Settings
    store: S3Store
    events: NatsEventLog
    ledger: Ledger
    clock: Clock
    rng: Random
    actor: Actor

    async def close(self) -> None:
        await self.events.close()
        await self.store.close()


async def open_runtime(settings: Settings, service: str, *, box: str = "", probe: bool = True) -> Runtime:
    """Connect to the store and the stream, run the conformance probe, build the ledger."""
    clock: Clock = WallClock()
    rng: Random = SystemRandom()
    store = await S3Store.open(
        endpoint=settings.s3_endpoint,
        access_key=settings.s3_access_key,
        secret_key=settings.s3_secret_key,
        region=settings.s3_region,
    )
    try:
        if settings.local:
            await store.create_bucket(settings.bucket, versioned=True)
        if probe:
            await run_probe_or_exit(store, settings.bucket)
        events = await NatsEventLog.connect(settings.nats_url, name=f"hostmove-{service}")
    except BaseException:
        await store.close()
        raise
    actor = Actor(service=service, box=box, pid=pid(), nonce=process_nonce(rng))
    ledger = Ledger(store, events, clock, actor, settings.bucket)
    return Runtime(settings, store, events, ledger, clock, rng, actor)
