"""Settings and the wiring every service starts with (ARCHITECTURE §7, §9).

Endpoints come from the environment (``HOSTMOVE_NATS_URL``, ``HOSTMOVE_S3_ENDPOINT``,
``HOSTMOVE_S3_ACCESS_KEY``, ``HOSTMOVE_S3_SECRET_KEY``, ``HOSTMOVE_S3_REGION``,
``HOSTMOVE_BUCKET``) or, for the embedded default, from ``.hostmove/stack.json``. Every service
runs the object-store conformance probe at start and refuses to run on a store that fails it.

**Credentials** (issue 14 items 1 and 3). A process acts as one role (:mod:`hostmove.access`): its NATS nkey and its
S3 identity come from an owner-only file (:mod:`kernel.credentials`), never from a command line: the one
``HOSTMOVE_CREDENTIALS`` names, else its role's in ``HOSTMOVE_CREDENTIALS_DIR`` (a launcher's, which must hold it)
or in ``<root>/credentials/``; the operator's CLI on the embedded stack is the stack's admin (``stack.json``).
``HOSTMOVE_S3_ACCESS_KEY``/``HOSTMOVE_S3_SECRET_KEY`` stay for a role file that names no S3 identity.

A long-running service opens with ``wait=True``: a store or a stream that does not answer yet is waited for on a
capped backoff (the service's :class:`~hostmove.health.Health` says why it is not ready), never a reason to exit.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import msgspec

from bus.log import LogUnavailable
from bus.nats_log import NatsEventLog, stream_replicas
from bus.subjects import LEDGER_STREAM
from events.envelope import Actor
from hostmove.health import Health
from hostmove.stackinfo import StackInfo
from kernel.credentials import (
    ENV_CREDENTIALS_DIR,
    Credentials,
    CredentialsError,
    credentials_from_env,
    load_credentials,
    role_file,
)
from kernel.ports import Clock, Random, SystemRandom, WallClock, pid, process_nonce
from services.ledger.ledger import Ledger
from services.ledger.movelog import MoveLog
from services.objstore.port import Got, StoreUnavailable
from services.objstore.probe import PROBE_EXIT_CODE, conformance_probe
from services.objstore.s3 import S3Store

log = logging.getLogger("hostmove.runtime")

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
    local: bool  # the embedded stack: buckets may be created on first use (by its admin)
    credentials: Credentials | None = None
    """The role this process acts as (its NATS nkey and inbox, its S3 identity); None: the S3 keys above and no
    NATS credentials (a server with authentication refuses that)."""
    stream_replicas: int = 1
    """The streams' replica count (``HOSTMOVE_STREAM_REPLICAS``, else the embedded stack's; issue 19 item 4)."""

    def __repr__(self) -> str:  # never print the secret
        role = self.credentials.role if self.credentials is not None else "-"
        return f"Settings(nats={self.nats_url}, s3={self.s3_endpoint}, bucket={self.bucket}, role={role})"

    @property
    def may_create_buckets(self) -> bool:
        """The embedded stack's admin creates buckets on first use; a role never does (it has no right to)."""
        return self.local and (self.credentials is None or self.credentials.role == "admin")


def _role_credentials(root: Path, role: str | None) -> Credentials | None:
    """The credentials of this process: the file ``HOSTMOVE_CREDENTIALS`` names, else ``role``'s file in
    ``HOSTMOVE_CREDENTIALS_DIR`` (which must hold it) or in ``<root>/credentials/``."""
    env = os.environ
    try:
        explicit = credentials_from_env()
        if explicit is not None or role is None:
            return explicit
        directory = Path(env[ENV_CREDENTIALS_DIR]) if env.get(ENV_CREDENTIALS_DIR) else root / "credentials"
        path = role_file(directory, role)
        if path.exists():
            return load_credentials(path)
    except CredentialsError as exc:
        raise ConfigError(str(exc)) from None
    if env.get(ENV_CREDENTIALS_DIR):
        raise ConfigError(f"no credentials for the role {role} in {directory}: `hostmove deployment init` makes the "
                          "console's and the projections', `hostmove box init` a box's")
    return None


def load_settings(root: Path | None = None, *, role: str | None = None) -> Settings:
    """The settings of a process acting as ``role`` (:mod:`hostmove.access`; None: the operator's CLI)."""
    # absolute: a box hands paths under it to its instances, which run in a directory of their own
    root = Path(os.environ.get("HOSTMOVE_ROOT", root or DEFAULT_ROOT)).absolute()
    bucket = os.environ.get("HOSTMOVE_BUCKET", DEFAULT_BUCKET)
    env = os.environ
    if env.get("HOSTMOVE_NATS_URL") and env.get("HOSTMOVE_S3_ENDPOINT"):
        creds = _role_credentials(root, role)
        access = creds.s3_access_key if creds is not None and creds.s3_access_key else env.get("HOSTMOVE_S3_ACCESS_KEY")
        secret = creds.s3_secret_key if creds is not None and creds.s3_secret_key else env.get("HOSTMOVE_S3_SECRET_KEY")
        missing = [k for k, v in (("HOSTMOVE_S3_ACCESS_KEY", access), ("HOSTMOVE_S3_SECRET_KEY", secret)) if not v]
        if missing:
            raise ConfigError(f"set {', '.join(missing)} or HOSTMOVE_CREDENTIALS: the object store never runs "
                              "anonymous")
        return Settings(
            nats_url=env["HOSTMOVE_NATS_URL"],
            s3_endpoint=env["HOSTMOVE_S3_ENDPOINT"],
            s3_access_key=access or "",
            s3_secret_key=secret or "",
            s3_region=env.get("HOSTMOVE_S3_REGION", "us-east-1"),
            bucket=bucket,
            root=root,
            local=False,
            credentials=creds,
            stream_replicas=_replicas(env, 1),
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
    settings = settings_from_stack(info, root=root, bucket=bucket, credentials=_role_credentials(root, role))
    return replace(settings, stream_replicas=_replicas(env, settings.stream_replicas))


def _replicas(env: Mapping[str, str], default: int) -> int:
    """``HOSTMOVE_STREAM_REPLICAS`` when set, else ``default``; a bad value is a :class:`ConfigError`."""
    if not env.get("HOSTMOVE_STREAM_REPLICAS", "").strip():
        return default
    try:
        return stream_replicas(env)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def settings_from_stack(info: StackInfo, *, root: Path, bucket: str = DEFAULT_BUCKET,
                        credentials: Credentials | None = None) -> Settings:
    """The embedded stack's settings, as ``credentials``' role (default: the stack's admin, ``info.credentials``)."""
    creds = credentials
    if creds is None and info.credentials and Path(info.credentials).exists():
        try:
            creds = load_credentials(info.credentials)
        except CredentialsError as exc:
            raise ConfigError(str(exc)) from None
    own_s3 = creds is not None and bool(creds.s3_access_key)
    return Settings(
        nats_url=info.nats_url,
        s3_endpoint=info.s3_endpoint,
        s3_access_key=creds.s3_access_key if creds is not None and own_s3 else info.s3_access_key,
        s3_secret_key=creds.s3_secret_key if creds is not None and own_s3 else info.s3_secret_key,
        s3_region=info.s3_region,
        bucket=bucket,
        root=root,
        local=True,
        credentials=creds,
        stream_replicas=info.stream_replicas,
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


HEALTH_KEY = "_health/ping"
"""What the S3 readiness check reads: a small object written once, so the check reads data (SeaweedFS answers a HEAD
of a missing key, and lists buckets, before its volume server serves reads again after a restart)."""
HEALTH_BODY = b"hostmove readiness check: a read of this object must return it\n" * 16

START_WAIT_MAX_S = 5.0
"""The cap of the backoff while a service waits for S3 at start (NATS: :data:`bus.nats_log.RECONNECT_WAIT_MAX_S`)."""


async def s3_check(store: S3Store, bucket: str) -> dict[str, object]:
    """S3 serves a read (GET of :data:`HEALTH_KEY`, written when missing); raises the store's error when it does
    not."""
    got = await store.get(bucket, HEALTH_KEY)
    if not isinstance(got, Got):
        await store.put(bucket, HEALTH_KEY, HEALTH_BODY)
    elif got.body != HEALTH_BODY:
        raise StoreUnavailable(f"{HEALTH_KEY} read back {len(got.body)} bytes, not the {len(HEALTH_BODY)} written")
    return {}


async def nats_check(events: NatsEventLog) -> dict[str, object]:
    """The connection is up and JetStream answers (the ledger stream's info); answers its last sequence."""
    reason = events.down_reason()
    if reason is not None:
        raise LogUnavailable(reason)
    state = await events.state(LEDGER_STREAM)
    return {"last_seq": state.last_seq}


def _backoff(attempt: int, cap: float = START_WAIT_MAX_S) -> float:
    return float(min(cap, 0.25 * 2 ** min(attempt, 10)))


async def _prepare_store(store: S3Store, settings: Settings, *, probe: bool, wait: bool,
                         health: Health | None) -> None:
    """Create the bucket (embedded stack), check S3 answers and run the conformance probe. With ``wait``, an
    unreachable store (:class:`StoreUnavailable`, also inside the probe) is waited for on a capped backoff; a store
    that answers and fails the probe exits 3 (as :func:`~services.objstore.probe.run_probe_or_exit`)."""
    attempt = 0
    while True:
        try:
            if settings.may_create_buckets:
                await store.create_bucket(settings.bucket, versioned=True)
            await store.head(settings.bucket, HEALTH_KEY)
            if probe:
                report = await conformance_probe(store, settings.bucket)
                if not report.ok and any("StoreUnavailable" in c.detail for c in report.failed):
                    raise StoreUnavailable("the store stopped answering during the conformance probe: "
                                           + report.failed[0].detail)
                if not report.ok:  # the store answers and fails: what run_probe_or_exit says, and exit 3
                    first = report.failed[0]
                    print(f"object store conformance check failed: {first.name}: {first.detail}", file=sys.stderr)
                    for other in report.failed[1:]:
                        print(f"  also failed: {other.name}: {other.detail}", file=sys.stderr)
                    raise SystemExit(PROBE_EXIT_CODE)
            if health is not None:
                health.set("s3", True)
            return
        except StoreUnavailable as exc:
            if not wait:
                raise
            reason = f"S3 at {settings.s3_endpoint} does not answer: {exc}"
            if health is not None:
                health.set("s3", False, reason)
            if attempt == 0 or attempt % 10 == 0:
                log.warning("waiting for S3 at %s (%s)", settings.s3_endpoint, exc)
            await asyncio.sleep(_backoff(attempt))
            attempt += 1


async def open_runtime(settings: Settings, service: str, *, box: str = "", probe: bool = True, wait: bool = False,
                       health: Health | None = None) -> Runtime:
    """Connect to the store and the stream, run the conformance probe, build the ledger.

    ``wait`` (a long-running service): an unreachable S3 or NATS is waited for, forever, on a capped backoff
    (cancel to give up), its state reported to ``health``; without it (a command) it raises at once."""
    clock: Clock = WallClock()
    rng: Random = SystemRandom()
    store = await S3Store.open(
        endpoint=settings.s3_endpoint,
        access_key=settings.s3_access_key,
        secret_key=settings.s3_secret_key,
        region=settings.s3_region,
    )
    try:
        await _prepare_store(store, settings, probe=probe, wait=wait, health=health)

        def retrying(attempt: int, reason: str) -> None:
            if health is not None:
                health.set("nats", False, reason)
            if attempt == 0 or attempt % 10 == 0:
                log.warning("waiting for NATS at %s (%s)", settings.nats_url, reason)

        events = await NatsEventLog.connect(settings.nats_url, name=f"hostmove-{service}", wait=wait,
                                            on_retry=retrying, credentials=settings.credentials,
                                            replicas=settings.stream_replicas)
    except BaseException:
        await store.close()
        raise
    if health is not None:
        health.set("nats", True)
    actor = Actor(service=service, box=box, pid=pid(), nonce=process_nonce(rng))
    ledger = Ledger(store, events, clock, actor, settings.bucket, movelog=MoveLog(store, settings.bucket))  # §13
    return Runtime(settings, store, events, ledger, clock, rng, actor)
