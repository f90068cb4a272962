"""Least privilege below the door (issue 14 items 1 to 3): who may do what on the bus and in the store.

**Roles.** Every process of a deployment acts as one role, with its own credentials file
(:mod:`kernel.credentials`, owner-only, ``<root>/credentials/<role>.json``):

============== =============================================== ===============================================
role           who                                              what
============== =============================================== ===============================================
``admin``      the operator's CLI on the embedded stack         everything (creates streams, identities, users)
``console``    ``serve door``, ``serve recovery``,              writes the ledger (claims, records), facts and
               ``serve relay``                                  alerts; declares the two streams
``projections`` ``serve projections`` (the read API)            reads the ledger stream; publishes no message
``router``     whoever routes a request to a sleeping host      publishes wakes (``hm.box.*.wake``) and nothing
                                                                else
``box-<label>`` ``serve box --label <label>``                   writes the ledger (a box agent CASes claims and
                                                                records itself), its facts and alerts; takes its
                                                                own wakes only
============== =============================================== ===============================================

**NATS** (:func:`nats_permissions`): every role but ``admin`` is a user with an nkey (the server holds only the
public key) and an allow-list of subjects: nothing it is not listed for, JetStream's API included (no role may
delete, purge or edit a stream or a message, create a stream other than the two, or read another role's replies:
each has its own inbox prefix). Anonymous connections are refused.

What subject permissions cannot say: a box publishes ``hm.ledger.{claim,record}.<host>`` for **any** host, since a
ledger subject names the host and a host's box changes with every move (the box CASes the claim in S3 first; the
ledger's OCC and the box's one-writer check (issue 14 item 5) stand behind it); likewise its facts
(``hm.fact.<kind>.<host>``). What it cannot publish: a wake, a roster fact, a fencing alert, an incident, anything
on the JetStream API but reads. A role allowed to create consumers (``projections``) could, through a push
consumer's deliver subject, have JetStream redeliver the ledger's own stored messages to a subject it may not
publish (nats-server issue 8274, open on 2.15): it cannot forge a body, and the stream does not store them again.
A box learns of work from its own durable consumer on ``HM_WORK`` (``box-<label>``): it may fetch and acknowledge
that consumer only, but the legacy durable-create API it declares it with carries no filter in its subject, so a box
could give its consumer another box's filter and read which hosts have news there (host names, no bodies); it
subscribes to no ledger subject. The console's recovery takes every transition from its own durable consumer on
``HM_LEDGER`` (``recovery``), with the same grant: fetch and acknowledge that consumer only.

**S3** (:func:`s3_policy`): each role but ``admin`` is an IAM user with one inline policy, the same JSON for AWS
(``examples/iam/``) and for SeaweedFS's embedded IAM (which evaluates resource ARNs with key prefixes and the
``s3:prefix`` condition, shown by ``tests/test_access.py``). A box may write its own region's data bucket, in every
other region's bucket only ``moves/*`` (Put and Delete, List conditioned on the ``moves/`` prefix: M17's grant,
read as written), and in the deployment bucket only the claims, records, staging leases and bad-object markers;
never the roster, the fences, the deployment's key, floor or identity, nor an app release. What a key prefix cannot
say: a claim (``control/hosts/<host>.json``) is the host's, not a box's, so a box can CAS any host's claim; the
claim's content (``op.exec``) is what names the box, and the ledger is what checks it. The console writes the
ledger, the losses, the alerts and its move logs; of what the boxes rewrite (staging leases, move journals) it may
only delete a version by its id, the history sweep's one need (:data:`CONSOLE_SWEEPS`).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import secrets
import signal
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import msgspec

from bus.subjects import (
    ALERT_PREFIX,
    BOX_PREFIX,
    FACT_PREFIX,
    FACTS_STREAM,
    LEDGER_PREFIX,
    LEDGER_STREAM,
    RECOVERY_DURABLE,
    RECOVERY_FILTER,
    WORK_PREFIX,
    WORK_STREAM,
    box_durable,
    encode_token,
)
from hostmove.stackinfo import StackInfo
from kernel.credentials import Credentials, load_credentials, role_file, save_credentials
from kernel.fsutil import atomic_write

ADMIN = "admin"
CONSOLE = "console"
PROJECTIONS = "projections"
ROUTER = "router"
BOX_ROLE_PREFIX = "box-"
SERVICE_ROLES = {"door": CONSOLE, "recovery": CONSOLE, "relay": CONSOLE, "projections": PROJECTIONS}
DEPLOYMENT_ROLES = (CONSOLE, PROJECTIONS, ROUTER)
DEFAULT_DATA_PREFIX = "hostmove-data"


class AccessError(Exception):
    """An identity could not be provisioned; the message says why."""


def box_role(label: str) -> str:
    return f"{BOX_ROLE_PREFIX}{label}"


def role_of(service: str, label: str = "") -> str:
    """The role ``hostmove serve <service> [--label L]`` runs as."""
    if service == "box":
        return box_role(label)
    if service not in SERVICE_ROLES:
        raise AccessError(f"no role for service {service!r}")
    return SERVICE_ROLES[service]


def credentials_dir(root: Path) -> Path:
    return root / "credentials"


def inbox_prefix(role: str) -> str:
    return "_INBOX" if role == ADMIN else f"_INBOX_{encode_token(role)}"


# ---------------------------------------------------------------------------------------------- NATS permissions


def _js_read(*streams: str) -> list[str]:
    """Stream info and single-message reads (the ledger's last-message read, the health check's state)."""
    out: list[str] = []
    for s in streams:
        out += [f"$JS.API.STREAM.INFO.{s}", f"$JS.API.STREAM.MSG.GET.{s}"]
    return out


def _js_replay(stream: str) -> list[str]:
    """An ephemeral pull consumer: create, fetch, delete (:meth:`bus.nats_log.NatsEventLog.replay`)."""
    return [f"$JS.API.CONSUMER.CREATE.{stream}", f"$JS.API.CONSUMER.CREATE.{stream}.>",
            f"$JS.API.CONSUMER.MSG.NEXT.{stream}.*", f"$JS.API.CONSUMER.DELETE.{stream}.*",
            f"$JS.API.CONSUMER.INFO.{stream}.*"]


LEDGER_PUBLISH = [f"{LEDGER_PREFIX}.claim.*", f"{LEDGER_PREFIX}.record.*", f"{WORK_PREFIX}.*.*"]
"""A ledger writer publishes its transitions and the work notices they send (:mod:`services.ledger.notices`)."""


def _js_durable(stream: str, durable: str, filter_subject: str = "") -> list[str]:
    """One durable pull consumer of the role's own: declare, fetch and acknowledge (issue 19 item 1). Declared
    through the legacy durable API (it carries no filter, so the filter is the role's word, see the module's
    docstring), or, with ``filter_subject``, through the API whose subject names the consumer and its filter (what
    nats-py's ``pull_subscribe`` calls, so FastStream's subscriber: the filter is then the grant's)."""
    create = (f"$JS.API.CONSUMER.CREATE.{stream}.{durable}.{filter_subject}" if filter_subject
              else f"$JS.API.CONSUMER.DURABLE.CREATE.{stream}.{durable}")
    return [create, f"$JS.API.CONSUMER.INFO.{stream}.{durable}",
            f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{durable}", f"$JS.ACK.{stream}.{durable}.>"]
FACTS_PUBLISH = [f"{FACT_PREFIX}.*.*"]


def nats_permissions(role: str) -> dict[str, Any] | None:
    """The role's NATS ``permissions`` block (None: ``admin``, unrestricted)."""
    inbox = f"{inbox_prefix(role)}.>"
    if role == ADMIN:
        return None
    if role == CONSOLE:
        return {"publish": {"allow": [*LEDGER_PUBLISH, *FACTS_PUBLISH, f"{ALERT_PREFIX}.>",
                                      *_js_read(LEDGER_STREAM, FACTS_STREAM, WORK_STREAM),
                                      *_js_durable(LEDGER_STREAM, RECOVERY_DURABLE, RECOVERY_FILTER),
                                      f"$JS.API.STREAM.CREATE.{LEDGER_STREAM}",
                                      f"$JS.API.STREAM.CREATE.{FACTS_STREAM}",
                                      f"$JS.API.STREAM.CREATE.{WORK_STREAM}"],
                            "deny": [f"{FACT_PREFIX}.roster.*"]},
                "subscribe": {"allow": [inbox]}}
    if role == PROJECTIONS:
        return {"publish": {"allow": [f"$JS.API.STREAM.INFO.{LEDGER_STREAM}", f"$JS.API.STREAM.INFO.{FACTS_STREAM}",
                                      f"$JS.API.STREAM.INFO.{WORK_STREAM}", f"$JS.API.STREAM.MSG.GET.{LEDGER_STREAM}",
                                      *_js_replay(LEDGER_STREAM),
                                      *_js_replay(FACTS_STREAM)]},  # the alerts the console shows (issue 20)
                "subscribe": {"allow": [f"{LEDGER_PREFIX}.>", inbox]}}
    if role == ROUTER:
        return {"publish": {"allow": [f"{BOX_PREFIX}.*.wake", f"$JS.API.STREAM.INFO.{LEDGER_STREAM}",
                                      f"$JS.API.STREAM.INFO.{FACTS_STREAM}", f"$JS.API.STREAM.INFO.{WORK_STREAM}"]},
                "subscribe": {"allow": [inbox]}}
    if role.startswith(BOX_ROLE_PREFIX):
        label = role[len(BOX_ROLE_PREFIX):]
        return {"publish": {"allow": [*LEDGER_PUBLISH, *FACTS_PUBLISH, f"{ALERT_PREFIX}.*",
                                      *_js_read(LEDGER_STREAM, FACTS_STREAM, WORK_STREAM),
                                      *_js_durable(WORK_STREAM, box_durable(label))],
                            "deny": [f"{FACT_PREFIX}.roster.*", f"{ALERT_PREFIX}.box-fenced"]},
                "subscribe": {"allow": [f"{BOX_PREFIX}.{encode_token(label)}.wake", inbox]},
                "allow_responses": {"max": 1, "expires": "30s"}}
    raise AccessError(f"unknown role {role!r}")


# ---------------------------------------------------------------------------------------------- the NATS server's users


class NatsUser(msgspec.Struct, frozen=True):
    role: str
    nkey: str


class NatsUsers(msgspec.Struct):
    users: list[NatsUser] = msgspec.field(default_factory=list)


def new_nkey_seed() -> str:
    import nkeys

    return str(nkeys.encode_seed(secrets.token_bytes(32), nkeys.PREFIX_BYTE_USER).decode())


def public_nkey(seed: str) -> str:
    import nkeys

    kp = nkeys.from_seed(bytearray(seed.encode()))
    try:
        return str(kp.public_key.decode())
    finally:
        kp.wipe()


def nats_config(users: list[NatsUser]) -> dict[str, Any]:
    """The server configuration's ``authorization`` (a JSON document is a valid NATS configuration file)."""
    entries = []
    for u in users:
        entry: dict[str, Any] = {"nkey": u.nkey}
        perms = nats_permissions(u.role)
        if perms is not None:
            entry["permissions"] = perms
        entries.append(entry)
    return {"authorization": {"users": entries, "timeout": 5}}


def _users_path(stack_root: Path) -> Path:
    return stack_root / "nats-users.json"


def nats_conf_path(stack_root: Path) -> Path:
    return stack_root / "nats.conf"


@contextlib.contextmanager
def _flock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    with open(path, "a+b") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def write_nats_config(stack_root: Path, admin_seed: str) -> Path:
    """(Re)write ``<stack root>/nats.conf`` from the admin's key and the registered users; answers its path."""
    registered = _read_users(stack_root)
    users = [NatsUser(ADMIN, public_nkey(admin_seed)), *(u for u in registered.users if u.role != ADMIN)]
    path = nats_conf_path(stack_root)
    atomic_write(path, json.dumps(nats_config(users), indent=1).encode(), mode=0o600)
    return path


def _read_users(stack_root: Path) -> NatsUsers:
    try:
        return msgspec.json.decode(_users_path(stack_root).read_bytes(), type=NatsUsers)
    except FileNotFoundError:
        return NatsUsers()


def register_nats_user(stack: StackInfo, role: str, seed: str, *, timeout_s: float = 10.0) -> None:
    """Add ``role``'s public key to the embedded stack's NATS users (once) and reload the server; returns when a
    connection with ``seed`` is accepted."""
    if not stack.root:
        raise AccessError("this stack has no root directory: its NATS users are not managed here")
    stack_root = Path(stack.root)
    nkey = public_nkey(seed)
    admin = load_credentials(stack_root / "credentials" / f"{ADMIN}.json")
    with _flock(stack_root / ".nats-users.lock"):
        users = _read_users(stack_root)
        if NatsUser(role, nkey) in users.users:
            return
        users.users.append(NatsUser(role, nkey))
        atomic_write(_users_path(stack_root), msgspec.json.encode(users), mode=0o600)
        write_nats_config(stack_root, admin.nats_seed)
        if not _nats_running(stack):
            return  # the server reads the users when it starts again (`hostmove stack up`)
        reload_nats(stack)
    _await_accepted(stack.nats_url, seed, role, timeout_s)


def _nats_running(stack: StackInfo) -> bool:
    return any(_pid_running(pid) for pid in _current_nats_pids(stack))


def _pid_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie nobody reaped yet is not a server
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def reload_nats(stack: StackInfo) -> None:
    """Ask the stack's NATS servers to reload their configuration (SIGHUP to each pid the stack recorded: every node
    of a cluster reads the same users)."""
    pids = _current_nats_pids(stack)
    reloaded = 0
    for pid in pids:
        try:
            os.kill(pid, signal.SIGHUP)
            reloaded += 1
        except ProcessLookupError:
            continue  # a cluster node that is down reads the users when it starts again
    if not reloaded:
        raise AccessError(f"the stack's NATS server (pid {', '.join(map(str, pids))}) is not running: "
                          "`hostmove stack up`")


def _current_nats_pids(stack: StackInfo) -> list[int]:
    """The NATS pids of ``run.json`` (a restarted server's, or every node of a cluster), else the one ``stack``
    names."""
    try:
        run = json.loads((Path(stack.root) / "run.json").read_text())
        nodes = [int(n["pid"]) for n in run.get("nats_nodes") or []]
        return nodes or [int(run["nats_pid"])]
    except (OSError, ValueError, KeyError, TypeError):
        return [stack.nats_pid]


def _await_accepted(url: str, seed: str, role: str, timeout_s: float) -> None:
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    import nats

    async def once() -> bool:
        async def quiet(_exc: Exception) -> None:
            return None

        try:
            servers = [u.strip() for u in url.split(",") if u.strip()]  # a cluster lists every node
            nc = await nats.connect(servers, nkeys_seed_str=seed, inbox_prefix=inbox_prefix(role),
                                    allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=2,
                                    error_cb=quiet)
        except Exception:  # noqa: BLE001 - not yet reloaded
            return False
        await nc.close()
        return True

    deadline = time.monotonic() + timeout_s
    with ThreadPoolExecutor(1) as pool:  # a loop of its own: the caller may be inside one
        while True:
            if pool.submit(lambda: asyncio.run(once())).result():
                return
            if time.monotonic() > deadline:
                raise AccessError(f"the NATS server did not accept the {role} user within {timeout_s:g} s of a "
                                  "reload")
            time.sleep(0.05)


# ---------------------------------------------------------------------------------------------- S3 policies


def _arn(path: str) -> str:
    return f"arn:aws:s3:::{path}"


OBJECT_READ = ["s3:GetObject", "s3:GetObjectVersion"]
OBJECT_WRITE = ["s3:PutObject", "s3:DeleteObject", "s3:DeleteObjectVersion"]
BUCKET_LIST = ["s3:ListBucket", "s3:ListBucketVersions", "s3:GetBucketVersioning"]
CONSOLE_WRITES = ("control/hosts/", "control/records/", "control/losses/", "alerts/", "_probe/", "_health/",
                  "moves/*/log/", "moves/_by-id/")  # the move log of the transitions it makes (§13)
CONSOLE_SWEEPS = ("control/staging-leases/", "moves/")
"""Where the console's history sweep deletes noncurrent versions by id and writes nothing (:mod:`services.sweeper.
history`: a host's staging leases and move journals, which the boxes rewrite; ruling M17 lets no box delete there)."""
BOX_WRITES = ("control/hosts/", "control/records/", "control/staging-leases/", "alerts/bad-objects/", "moves/",
              "_probe/", "_health/")
"""What a box writes in the deployment bucket: claims and records (through the ledger), the staging-work lease, the
bad-object markers, a move's reports and journals (``moves/<host>/<op>/``), the probe's scratch and the readiness
check's object."""
LANE = "moves/"


def _statement(sid: str, actions: list[str], resources: list[str], condition: dict[str, Any] | None = None,
               ) -> dict[str, Any]:
    out: dict[str, Any] = {"Sid": sid, "Effect": "Allow", "Action": actions, "Resource": resources}
    if condition:
        out["Condition"] = condition
    return out


def s3_policy(role: str, *, deployment_bucket: str, data_prefix: str = DEFAULT_DATA_PREFIX, region: str = "",
              ) -> dict[str, Any]:
    """The role's IAM policy document (AWS's JSON; SeaweedFS's embedded IAM evaluates the same)."""
    d = deployment_bucket
    read_deployment = [_statement("DeploymentRead", OBJECT_READ, [_arn(f"{d}/*")]),
                       _statement("DeploymentList", BUCKET_LIST, [_arn(d)])]
    if role == CONSOLE:
        statements = [*read_deployment,
                      _statement("DeploymentWrite", OBJECT_WRITE, [_arn(f"{d}/{p}*") for p in CONSOLE_WRITES]),
                      _statement("HistorySweep", ["s3:DeleteObjectVersion"],
                                 [_arn(f"{d}/{p}*") for p in CONSOLE_SWEEPS])]
    elif role == PROJECTIONS:
        statements = read_deployment
    elif role == ROUTER:  # the readiness check's object only: a router reads nothing of the deployment
        statements = [_statement("HealthRead", ["s3:GetObject"], [_arn(f"{d}/_health/*")])]
    elif role.startswith(BOX_ROLE_PREFIX):
        if not region:
            raise AccessError(f"{role}: a box's policy needs its region")
        own = f"{data_prefix}-{region}"
        every = f"{data_prefix}-*"
        statements = [*read_deployment,
                      _statement("DeploymentWrite", OBJECT_WRITE, [_arn(f"{d}/{p}*") for p in BOX_WRITES]),
                      _statement("OwnRegion", [*OBJECT_READ, *OBJECT_WRITE], [_arn(f"{own}/*")]),
                      _statement("OwnRegionList", BUCKET_LIST, [_arn(own)]),
                      _statement("ReturnLane", ["s3:PutObject", "s3:DeleteObject"], [_arn(f"{every}/{LANE}*")]),
                      _statement("ReturnLaneList", ["s3:ListBucket"], [_arn(every)],
                                 {"StringLike": {"s3:prefix": [f"{LANE}*"]}})]
    else:
        raise AccessError(f"unknown role {role!r}")
    return {"Version": "2012-10-17", "Statement": statements}


# ---------------------------------------------------------------------------------------------- provisioning


def iam_user_name(role: str, deployment_bucket: str) -> str:
    """The IAM user of ``role`` in the deployment of ``deployment_bucket`` (at most 64 characters)."""
    digest = hashlib.sha256(deployment_bucket.encode()).hexdigest()[:10]
    name = f"hm-{digest}-{role}"
    if len(name) > 64 or any(not (c.isalnum() or c in "+=,.@_-") for c in name):
        name = f"hm-{digest}-{hashlib.sha256(role.encode()).hexdigest()[:20]}"
    return name


def _iam(stack: StackInfo) -> Any:
    import boto3

    return boto3.session.Session().client(
        "iam", endpoint_url=stack.s3_endpoint, region_name=stack.s3_region, verify=False,
        aws_access_key_id=stack.s3_access_key, aws_secret_access_key=stack.s3_secret_key)


def ensure_role(stack: StackInfo, root: Path, role: str, *, deployment_bucket: str,
                data_prefix: str = DEFAULT_DATA_PREFIX, region: str = "") -> Credentials:
    """``role``'s credentials under ``root`` (created once: an IAM user with its key, an nkey), its policy put again
    (it names this deployment's buckets) and its NATS user registered with the embedded stack."""
    from botocore.exceptions import BotoCoreError, ClientError

    path = role_file(credentials_dir(root), role)
    policy = json.dumps(s3_policy(role, deployment_bucket=deployment_bucket, data_prefix=data_prefix, region=region))
    iam = _iam(stack)
    user = iam_user_name(role, deployment_bucket)
    creds = load_credentials(path) if path.exists() else None
    if creds is not None and not _store_answers(stack):  # an outage: the role keeps what it was given
        register_nats_user(stack, role, creds.nats_seed)
        return creds
    try:
        if creds is None or not _key_known(iam, user, creds.s3_access_key):  # new, or a store that lost it
            with contextlib.suppress(iam.exceptions.EntityAlreadyExistsException):
                iam.create_user(UserName=user)
            key = iam.create_access_key(UserName=user)["AccessKey"]
            creds = Credentials(role=role, nats_seed=creds.nats_seed if creds else new_nkey_seed(),
                                inbox_prefix=inbox_prefix(role), s3_access_key=key["AccessKeyId"],
                                s3_secret_key=key["SecretAccessKey"])
            save_credentials(path, creds)
        iam.put_user_policy(UserName=user, PolicyName="hostmove", PolicyDocument=policy)
        _await_key(stack, creds)
    except ClientError as exc:
        code = (exc.response or {}).get("Error", {}).get("Code", "?")
        raise AccessError(f"the store's IAM refused provisioning {role} ({code})") from None
    except BotoCoreError as exc:
        raise AccessError(f"the store did not answer while provisioning {role} ({type(exc).__name__})") from None
    register_nats_user(stack, role, creds.nats_seed)
    return creds


def _store_answers(stack: StackInfo) -> bool:
    import urllib.request

    try:
        with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(f"{stack.s3_endpoint}/healthz",
                                                                               timeout=2) as resp:
            return bool(resp.status == 200)
    except (OSError, ValueError):
        return False


def _key_known(iam: Any, user: str, access_key: str) -> bool:
    """The store's IAM still has ``user`` with ``access_key`` (a stack started afresh under a kept root has not)."""
    from botocore.exceptions import ClientError

    try:
        keys = iam.list_access_keys(UserName=user).get("AccessKeyMetadata", [])
    except ClientError:
        return False
    return any(k.get("AccessKeyId") == access_key for k in keys)


def _await_key(stack: StackInfo, creds: Credentials, timeout_s: float = 10.0) -> None:
    """Until the store signs ``creds``' requests in (SeaweedFS applies a new identity a moment after IAM answers)."""
    import boto3
    from botocore.config import Config
    from botocore.exceptions import BotoCoreError, ClientError

    s3 = boto3.session.Session().client(
        "s3", endpoint_url=stack.s3_endpoint, region_name=stack.s3_region, verify=False,
        aws_access_key_id=creds.s3_access_key, aws_secret_access_key=creds.s3_secret_key,
        config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 1}))
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            s3.list_buckets()
            return
        except ClientError as exc:
            if (exc.response or {}).get("Error", {}).get("Code") == "AccessDenied":
                return  # the key is known: its policy just does not list buckets
            if time.monotonic() > deadline:
                raise AccessError(f"the store did not take {creds.role}'s new key within {timeout_s:g} s "
                                  f"({type(exc).__name__})") from None
            time.sleep(0.05)
        except BotoCoreError as exc:
            if time.monotonic() > deadline:
                raise AccessError(f"the store did not take {creds.role}'s new key within {timeout_s:g} s "
                                  f"({type(exc).__name__})") from None
            time.sleep(0.05)


def _ensure_buckets(stack: StackInfo, buckets: list[str]) -> None:
    """The deployment's buckets, versioned, made by the store's admin (a role may not make one)."""
    import boto3
    from botocore.config import Config
    from botocore.exceptions import ClientError

    s3 = boto3.session.Session().client(
        "s3", endpoint_url=stack.s3_endpoint, region_name=stack.s3_region, verify=False,
        aws_access_key_id=stack.s3_access_key, aws_secret_access_key=stack.s3_secret_key,
        config=Config(s3={"addressing_style": "path"}))
    for bucket in buckets:
        try:
            s3.head_bucket(Bucket=bucket)
            continue
        except ClientError:
            pass
        try:
            s3.create_bucket(Bucket=bucket)
        except ClientError as exc:
            if (exc.response or {}).get("Error", {}).get("Code") not in ("BucketAlreadyOwnedByYou",
                                                                        "BucketAlreadyExists"):
                raise AccessError(f"the store refused the bucket {bucket}") from None
        s3.put_bucket_versioning(Bucket=bucket, VersioningConfiguration={"Status": "Enabled"})


def boxes_under(root: Path) -> dict[str, str]:
    """``{label: region}`` of every box ``hostmove box init`` set up under ``root``."""
    out: dict[str, str] = {}
    for box_file in sorted((root / "boxes").glob("*/box.json")):
        with contextlib.suppress(OSError, ValueError, KeyError):
            identity = json.loads(box_file.read_text())
            out[str(identity["label"])] = str(identity["region"])
    return out


SCOPE_FILE = "scope"
"""Under the credentials directory: the buckets the roles' policies were made for, so that a later provisioning
that names no data prefix (a launcher of console services only) keeps the boxes' grants as they were."""


def _recorded_prefix(root: Path, deployment_bucket: str) -> str | None:
    try:
        scope = json.loads((credentials_dir(root) / SCOPE_FILE).read_text())
    except (OSError, ValueError):
        return None
    if scope.get("deployment_bucket") != deployment_bucket:
        return None
    return str(scope.get("data_prefix") or "") or None


def provision_deployment(stack: StackInfo, root: Path, *, deployment_bucket: str,
                         data_prefix: str | None = None) -> dict[str, Credentials]:
    """Every role of the deployment under ``root``: the console's, the projections', the router's and each box's
    (:func:`boxes_under`)."""
    prefix = data_prefix or _recorded_prefix(root, deployment_bucket) or DEFAULT_DATA_PREFIX
    directory = credentials_dir(root)
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    atomic_write(directory / SCOPE_FILE, json.dumps({"deployment_bucket": deployment_bucket,
                                                     "data_prefix": prefix}).encode(), mode=0o600)
    boxes = boxes_under(root)
    if _store_answers(stack):  # in an outage the buckets are what they were; new roles wait for the store below
        _ensure_buckets(stack, [deployment_bucket, *sorted({f"{prefix}-{region}" for region in boxes.values()})])
    out = {role: ensure_role(stack, root, role, deployment_bucket=deployment_bucket, data_prefix=prefix)
           for role in DEPLOYMENT_ROLES}
    for label, region in boxes.items():
        out[box_role(label)] = ensure_role(stack, root, box_role(label), deployment_bucket=deployment_bucket,
                                           data_prefix=prefix, region=region)
    return out


# ---------------------------------------------------------------------------------------------- the store's one door


STORE_COMPONENTS = ("master", "volume", "filer", "s3", "admin", "worker")
"""The servers of ``weed mini`` whose gRPC port takes only mutually authenticated TLS."""


def _certificates(tls: Path) -> None:
    """A private CA and one certificate (server and client use, host names unchecked by SeaweedFS) under ``tls``."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "hostmove store ca")])
    usage = {k: False for k in ("digital_signature", "content_commitment", "key_encipherment", "data_encipherment",
                                "key_agreement", "key_cert_sign", "crl_sign", "encipher_only", "decipher_only")}
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
          .not_valid_after(now + datetime.timedelta(days=3650))
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(**{**usage, "digital_signature": True, "key_cert_sign": True,
                                          "crl_sign": True}), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "hostmove-store")]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=3650))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    pem = serialization.Encoding.PEM
    atomic_write(tls / "store.key", key.private_bytes(pem, serialization.PrivateFormat.PKCS8,
                                                      serialization.NoEncryption()), mode=0o600)
    atomic_write(tls / "store.crt", cert.public_bytes(pem), mode=0o600)
    atomic_write(tls / "ca.crt", ca.public_bytes(pem), mode=0o600)


def store_security(s3_dir: Path, *, seen_at: Path | None = None) -> Path:
    """``weed``'s ``security.toml`` in ``s3_dir`` (its working directory, where it looks first), made once:

    - every gRPC port (master, volume, filer, S3, admin) and every HTTP port but S3's (master, volume, filer,
      admin) takes only TLS with a client certificate of the stack's own CA (``tls/``, owner-only), which only the
      server holds;
    - behind that, the volume server takes reads and writes only with a JWT the master signs, and the filer takes
      HTTP reads and writes only with one the S3 gateway signs (keys random, in this file).

    So the S3 port, which checks every request's signature, is the store's one door. ``seen_at``: where ``weed``
    sees ``s3_dir`` (a container's mount), when not where this process does."""
    tls = s3_dir / "tls"
    tls.mkdir(parents=True, exist_ok=True, mode=0o700)
    path = s3_dir / "security.toml"
    if path.exists() and (tls / "store.key").exists():
        return path
    _certificates(tls)
    seen = (seen_at or s3_dir) / "tls"
    crt, key, ca = seen / "store.crt", seen / "store.key", seen / "ca.crt"
    lines = ["# written by hostmove stack up (hostmove/access.py store_security): the store's one door is S3", ""]
    for section in ("jwt.signing", "jwt.signing.read", "jwt.filer_signing", "jwt.filer_signing.read"):
        lines += [f"[{section}]", f'key = "{secrets.token_urlsafe(32)}"', "expires_after_seconds = 10", ""]
    lines += ["[access]", "ui = false", "", "[filer.expose_directory_metadata]", "enabled = false", "",
              "[grpc]", f'ca = "{ca}"', ""]
    for component in STORE_COMPONENTS:
        lines += [f"[grpc.{component}]", f'cert = "{crt}"', f'key = "{key}"', ""]
    lines += ["[grpc.client]", f'cert = "{crt}"', f'key = "{key}"', "",
              "[https.client]", "enabled = true", f'cert = "{crt}"', f'key = "{key}"', f'ca = "{ca}"', ""]
    for component in ("volume", "master", "filer", "admin"):
        lines += [f"[https.{component}]", f'cert = "{crt}"', f'key = "{key}"', f'ca = "{ca}"', ""]
    atomic_write(path, "\n".join(lines).encode(), mode=0o600)
    return path


def provision_local(root: Path, deployment_bucket: str) -> str | None:
    """On the embedded stack (``<root>/stack.json``), every role of the deployment under ``root``
    (:func:`provision_deployment`); answers what it did, or None where the stack is not this machine's (there the
    operator gives each role its identity: ``examples/iam/``, ``compose.yaml``)."""
    try:
        info = msgspec.json.decode((root / "stack.json").read_bytes(), type=StackInfo)
    except (OSError, msgspec.DecodeError, msgspec.ValidationError):
        return None
    if info.mode != "local" or not info.root:
        return None
    made = provision_deployment(info, root, deployment_bucket=deployment_bucket,
                                data_prefix=os.environ.get("HOSTMOVE_DATA_BUCKET_PREFIX") or None)
    return f"identities {', '.join(sorted(made))} under {credentials_dir(root)} (owner-only)"


def render_deployment(out: Path, *, boxes: Mapping[str, str], deployment_bucket: str,
                      data_prefix: str = DEFAULT_DATA_PREFIX, iam: Any = None) -> dict[str, Credentials]:
    """For a deployment whose servers this machine does not run (``compose.yaml``): under ``out``,

    - ``credentials/<role>.json`` (0600) for ``admin``, the console, the projections, the router and each box of
      ``boxes`` (``{label: region}``), each with its own nkey seed, made once;
    - ``nats.conf``: the NATS server's users (public keys only) and their permissions;
    - ``iam/<role>.json``: each role's S3 policy;
    - ``store/``: the store's ``security.toml`` and TLS (:func:`store_security`), for ``/etc/seaweedfs``;
    - ``deployment-key.pem`` (0600): the deployment's secrets key, made once (``hostmove deployment init
      --secrets-key`` and ``hostmove box init --secrets-key`` take it; issue 20 item 6).

    With ``iam`` (an IAM client as the store's admin: SeaweedFS's embedded IAM or AWS), each role also gets its S3
    user, key (into its credentials file) and policy."""
    roles = [ADMIN, *DEPLOYMENT_ROLES, *(box_role(label) for label in boxes)]
    regions = {box_role(label): region for label, region in boxes.items()}
    made: dict[str, Credentials] = {}
    for role in roles:
        path = role_file(out / "credentials", role)
        creds = load_credentials(path) if path.exists() else Credentials(
            role=role, nats_seed=new_nkey_seed(), inbox_prefix=inbox_prefix(role))
        if role != ADMIN:
            policy = s3_policy(role, deployment_bucket=deployment_bucket, data_prefix=data_prefix,
                               region=regions.get(role, ""))
            (out / "iam").mkdir(parents=True, exist_ok=True)
            (out / "iam" / f"{role}.json").write_text(json.dumps(policy, indent=2) + "\n")
            if iam is not None:
                user = iam_user_name(role, deployment_bucket)
                if not creds.s3_access_key:
                    with contextlib.suppress(iam.exceptions.EntityAlreadyExistsException):
                        iam.create_user(UserName=user)
                    key = iam.create_access_key(UserName=user)["AccessKey"]
                    creds = msgspec.structs.replace(creds, s3_access_key=key["AccessKeyId"],
                                                    s3_secret_key=key["SecretAccessKey"])
                iam.put_user_policy(UserName=user, PolicyName="hostmove", PolicyDocument=json.dumps(policy))
        save_credentials(path, creds)
        made[role] = creds
    users = [NatsUser(role, public_nkey(c.nats_seed)) for role, c in made.items()]
    atomic_write(out / "nats.conf", json.dumps(nats_config(users), indent=1).encode(), mode=0o644)
    store_security(out / "store", seen_at=Path("/etc/seaweedfs"))  # the s3 container's security.toml and TLS
    key = out / "deployment-key.pem"  # the deployment's secrets key, made once: compose's deployment-key secret
    if not key.exists():
        from services.box.artifacts.sealing import generate_private_key, save_private_key

        save_private_key(generate_private_key(), key)
    return made


def main(argv: list[str] | None = None) -> int:
    """``python -m hostmove.access render --out DIR --box LABEL:REGION ...``: :func:`render_deployment`. With
    ``HOSTMOVE_S3_ENDPOINT`` and the store admin's ``HOSTMOVE_S3_ACCESS_KEY``/``HOSTMOVE_S3_SECRET_KEY`` in the
    environment it also makes each role's S3 identity."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m hostmove.access")
    sub = parser.add_subparsers(dest="action", required=True)
    render = sub.add_parser("render", help="credentials, nats.conf and IAM policies for a deployment")
    render.add_argument("--out", required=True, type=Path)
    render.add_argument("--box", action="append", default=[], help="LABEL:REGION (repeat for each box)")
    render.add_argument("--bucket", default="hostmove-deployment")
    render.add_argument("--data-prefix", default=DEFAULT_DATA_PREFIX)
    args = parser.parse_args(argv)
    boxes = dict(b.split(":", 1) for b in args.box)
    iam = None
    if os.environ.get("HOSTMOVE_S3_ENDPOINT") and os.environ.get("HOSTMOVE_S3_ACCESS_KEY"):
        iam = _iam(StackInfo(nats_url="", nats_monitor_url="", s3_endpoint=os.environ["HOSTMOVE_S3_ENDPOINT"],
                             s3_access_key=os.environ["HOSTMOVE_S3_ACCESS_KEY"],
                             s3_secret_key=os.environ.get("HOSTMOVE_S3_SECRET_KEY", ""),
                             s3_region=os.environ.get("HOSTMOVE_S3_REGION", "us-east-1")))
    made = render_deployment(args.out, boxes=boxes, deployment_bucket=args.bucket, data_prefix=args.data_prefix,
                             iam=iam)
    print(f"{len(made)} roles under {args.out}: nats.conf, credentials/ (owner-only), iam/"
          + ("" if iam else "; no S3 identity made (set HOSTMOVE_S3_ENDPOINT and the store admin's keys)"))
    return 0


def admin_credentials(stack_root: Path) -> Path:
    return stack_root / "credentials" / f"{ADMIN}.json"


def example_policies(deployment_bucket: str = "hostmove-deployment", data_prefix: str = DEFAULT_DATA_PREFIX,
                     box: tuple[str, str] = ("ie-1", "ie")) -> Mapping[str, dict[str, Any]]:
    """The IAM policies shipped in ``examples/iam/`` (AWS S3), for the default bucket names."""
    return {role: s3_policy(role, deployment_bucket=deployment_bucket, data_prefix=data_prefix,
                            region=box[1] if role.startswith(BOX_ROLE_PREFIX) else "")
            for role in (*DEPLOYMENT_ROLES, box_role(box[0]))}


__all__ = ["ADMIN", "CONSOLE", "PROJECTIONS", "ROUTER", "AccessError", "box_role", "ensure_role",
           "example_policies", "inbox_prefix", "nats_config", "nats_permissions", "provision_deployment",
           "register_nats_user", "role_of", "s3_policy", "write_nats_config"]


if __name__ == "__main__":
    raise SystemExit(main())
