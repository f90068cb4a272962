"""Least privilege below the door (issue 14 items 1 to 3), on the real stack: an authenticated bus with per-role
permissions, a store whose only door is its signed S3 port, and a scoped S3 identity per role."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import ssl
import stat
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import boto3
import nats
import pytest
import pytest_asyncio
from botocore import UNSIGNED
from botocore.config import Config
from botocore.exceptions import ClientError
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from bus.log import LogUnavailable
from bus.nats_log import NatsEventLog
from bus.subjects import FACTS_STREAM, LEDGER_STREAM, alert_subject, box_wake_subject, fact_subject, ledger_subject
from events import Actor
from hostmove.access import (
    ADMIN,
    CONSOLE,
    PROJECTIONS,
    ROUTER,
    box_role,
    credentials_dir,
    example_policies,
    inbox_prefix,
    nats_permissions,
    provision_deployment,
)
from hostmove.stack import stack_status
from hostmove.stackinfo import StackInfo
from kernel.credentials import Credentials, CredentialsError, load_credentials, role_file
from kernel.ports import WallClock
from services.box.artifacts.sealing import load_private_key
from services.box.roster import ROSTER_KEY, init_box
from services.objstore.s3 import S3Store

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Deployment:
    root: Path
    bucket: str
    prefix: str
    labels: dict[str, str]
    creds: dict[str, Credentials]

    def box(self, region: str) -> Credentials:
        return self.creds[box_role(self.labels[region])]


@pytest_asyncio.fixture(scope="module")
async def deployment(stack: StackInfo, unique: Callable[[str], str],
                     tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Deployment]:
    """A deployment of two boxes (ie, uk) whose every role is provisioned, as ``hostmove deployment init`` and
    ``hostmove box init`` (or a launcher's ``service_env``) do."""
    root = tmp_path_factory.mktemp("access")
    bucket, prefix = unique("acc-deploy"), unique("acc-data")
    store = await S3Store.open(stack.s3_endpoint, stack.s3_access_key, stack.s3_secret_key, stack.s3_region)
    events = await NatsEventLog.connect(stack.nats_url)
    for b in (bucket, f"{prefix}-ie", f"{prefix}-uk"):
        await store.create_bucket(b, versioned=True)
    labels = {"ie": unique("ie"), "uk": unique("uk")}
    actor = Actor(service="test-access", pid=os.getpid(), nonce="access")
    for region, label in labels.items():
        await init_box(root=root, label=label, region=region, store=store, bucket=bucket, events=events,
                       clock=WallClock(), actor=actor)
    await store.put(bucket, "control/hosts/h1.json", b"{}")
    creds = await asyncio.to_thread(provision_deployment, stack, root, deployment_bucket=bucket, data_prefix=prefix)
    try:
        yield Deployment(root, bucket, prefix, labels, creds)
    finally:
        for b in (bucket, f"{prefix}-ie", f"{prefix}-uk"):
            await store.delete_bucket(b)
        await events.close()
        await store.close()


# ------------------------------------------------------------------------------------------------------- NATS


class Conn:
    """A raw NATS connection as one role, collecting the server's permission violations."""

    def __init__(self, nc: Any, errors: list[str]) -> None:
        self.nc, self.errors = nc, errors

    @classmethod
    async def open(cls, stack: StackInfo, creds: Credentials) -> Conn:
        errors: list[str] = []

        async def on_error(exc: Exception) -> None:
            errors.append(str(exc))

        nc = await nats.connect(stack.nats_url, nkeys_seed_str=creds.nats_seed, inbox_prefix=creds.inbox_prefix,
                                error_cb=on_error, allow_reconnect=False, max_reconnect_attempts=0)
        return cls(nc, errors)

    async def denied_publish(self, subject: str) -> bool:
        await self.nc.publish(subject, b'{"forged": true}')
        await self.nc.flush()
        await asyncio.sleep(0.15)
        return self._violated("publish to", subject)

    def _violated(self, what: str, subject: str) -> bool:
        """The server's permissions violation for ``subject`` (its text has the subject in lower case)."""
        return any(f'{what} "{subject}"'.lower() in e.lower() for e in self.errors)

    async def denied_subscribe(self, subject: str) -> bool:
        await self.nc.subscribe(subject)
        await self.nc.flush()
        await asyncio.sleep(0.15)
        return self._violated("subscription to", subject)

    async def refused_api(self, subject: str, body: bytes = b"{}") -> bool:
        """A JetStream API request the server never answers for this role (the request is a refused publish)."""
        try:
            await self.nc.request(subject, body, timeout=1.0)
        except (nats.errors.TimeoutError, nats.errors.NoRespondersError):
            return self._violated("publish to", subject)
        return False

    async def close(self) -> None:
        await self.nc.close()


async def _stored(events: NatsEventLog, stream: str, subject: str) -> bytes | None:
    last = await events.last(stream, subject)
    return last.data if last is not None else None


async def test_an_anonymous_nats_connection_is_refused(stack: StackInfo) -> None:
    with pytest.raises(nats.errors.Error, match="Authorization Violation"):
        await nats.connect(stack.nats_url, allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=2)
    stranger = Credentials(role="stranger", nats_seed=_new_seed())
    with pytest.raises(LogUnavailable, match="refused the stranger credentials"):
        await NatsEventLog.connect(stack.nats_url, credentials=stranger, timeout=30.0)  # a loaded machine is slow


def _new_seed() -> str:
    from hostmove.access import new_nkey_seed

    return new_nkey_seed()


@pytest_asyncio.fixture(loop_scope="session")
async def forged(stack: StackInfo) -> AsyncIterator[list[int]]:
    """The ledger-stream sequences of the undecodable messages a test publishes: deleted when it ends, so a
    projector started later in the session (serve projections, the dashboard) does not halt on them (a poison
    message halts a projection by design, never a silent skip)."""
    seqs: list[int] = []
    yield seqs
    admin = await NatsEventLog.connect(stack.nats_url)
    try:
        for seq in seqs:
            await admin.js.delete_msg(LEDGER_STREAM, seq)
    finally:
        await admin.close()


async def test_a_status_reader_publishes_nothing_and_reads_the_ledger(stack: StackInfo, deployment: Deployment,
                                                                     forged: list[int]) -> None:
    admin = await NatsEventLog.connect(stack.nats_url)
    host = f"forge-{deployment.prefix}"
    forged.append((await admin.publish(LEDGER_STREAM, ledger_subject("claim", host), b'{"gen": 1}')).seq)
    reader = await Conn.open(stack, deployment.creds[PROJECTIONS])
    try:
        for subject in (ledger_subject("claim", host), ledger_subject("record", host), fact_subject("evidence", host),
                        alert_subject("poison"), box_wake_subject(deployment.labels["ie"])):
            assert await reader.denied_publish(subject), subject
        for api in (f"$JS.API.STREAM.DELETE.{LEDGER_STREAM}", f"$JS.API.STREAM.PURGE.{LEDGER_STREAM}",
                    f"$JS.API.STREAM.MSG.DELETE.{LEDGER_STREAM}", f"$JS.API.STREAM.UPDATE.{LEDGER_STREAM}",
                    f"$JS.API.STREAM.CREATE.{FACTS_STREAM}", f"$JS.API.STREAM.PURGE.{FACTS_STREAM}"):
            assert await reader.refused_api(api), api
        assert await reader.denied_subscribe("_INBOX.>")  # another role's replies are not its to read
        assert await reader.denied_subscribe("hm.box.>")
    finally:
        await reader.close()
    assert await _stored(admin, LEDGER_STREAM, ledger_subject("claim", host)) == b'{"gen": 1}'  # nothing forged
    # ... and what it is for: the ledger stream, read through its own connection (a replay, a last message).
    events = await NatsEventLog.connect(stack.nats_url, credentials=deployment.creds[PROJECTIONS])
    try:
        got = [m.data async for m in events.replay(LEDGER_STREAM, subject=ledger_subject("claim", host))]
        assert got == [b'{"gen": 1}']
        assert (await events.state(LEDGER_STREAM)).last_seq >= 1
        await admin.publish(FACTS_STREAM, alert_subject("forge-test"), b'{"kind": "forge-test"}')
        alerts = [m.data async for m in events.replay(FACTS_STREAM, subject=alert_subject("forge-test"))]
        assert b'{"kind": "forge-test"}' in alerts  # the alerts the console shows (issue 20)
    finally:
        await events.close()
        await admin.close()


async def test_a_box_takes_its_own_wakes_and_writes_only_what_a_box_writes(stack: StackInfo, deployment: Deployment,
                                                                           forged: list[int]) -> None:
    ie, uk = deployment.labels["ie"], deployment.labels["uk"]
    box = await Conn.open(stack, deployment.box("ie"))
    admin = await NatsEventLog.connect(stack.nats_url)
    try:
        for subject in (box_wake_subject(uk), box_wake_subject(ie),  # a wake is the router's to send
                        fact_subject("roster", ie), alert_subject("box-fenced"),  # the operator's
                        f"hm.alert.release-deadline.{ie}.x",  # an incident: the recovery pass's
                        "hm.other.subject"):
            assert await box.denied_publish(subject), subject
        assert await box.denied_subscribe(box_wake_subject(uk))  # another box's work
        assert not await box.denied_subscribe(box_wake_subject(ie))
        for api in (f"$JS.API.STREAM.DELETE.{LEDGER_STREAM}", f"$JS.API.STREAM.PURGE.{LEDGER_STREAM}",
                    f"$JS.API.STREAM.MSG.DELETE.{LEDGER_STREAM}", f"$JS.API.CONSUMER.CREATE.{LEDGER_STREAM}",
                    f"$JS.API.STREAM.CREATE.{LEDGER_STREAM}"):
            assert await box.refused_api(api), api
    finally:
        await box.close()
    # What subject permissions cannot say: a ledger subject names a host, not a box, and a host's box changes with
    # every move, so a box's credentials publish any host's transition (the S3 CAS is what decides; module doc).
    events = await NatsEventLog.connect(stack.nats_url, credentials=deployment.box("ie"))
    try:
        host = f"any-{deployment.prefix}"
        forged.append((await events.publish(LEDGER_STREAM, ledger_subject("claim", host), b'{"gen": 1}')).seq)
        await events.publish(FACTS_STREAM, fact_subject("evidence", host), b"{}")
        assert await _stored(admin, LEDGER_STREAM, ledger_subject("claim", host)) == b'{"gen": 1}'
    finally:
        await events.close()
        await admin.close()


async def test_the_recovery_declares_and_takes_only_its_own_ledger_consumer(stack: StackInfo, deployment: Deployment,
                                                                            forged: list[int]) -> None:
    """The console's recovery consumer (services/recovery/consumer.py, FastStream's pull subscriber) starts under
    the console's grant and receives a transition; another durable, or its own name with another filter, is refused
    (the name and the filter are in the create API's subject, so the grant pins both)."""
    from bus.app import make_broker, subscribe
    from bus.subjects import RECOVERY_DURABLE, RECOVERY_FILTER

    durable = RECOVERY_DURABLE
    admin = await NatsEventLog.connect(stack.nats_url)
    with contextlib.suppress(Exception):  # a consumer an earlier test or run of this stack left
        await admin.js.delete_consumer(LEDGER_STREAM, durable)
    seen: list[bytes] = []

    async def handle(body: bytes, _headers: Any) -> None:
        seen.append(body)

    broker = make_broker(stack.nats_url, credentials=deployment.creds[CONSOLE])
    subscribe(broker, service="recovery", subject=RECOVERY_FILTER, stream=LEDGER_STREAM, durable=durable,
              handler=handle, deliver_new=True, credentials=deployment.creds[CONSOLE])
    console = await Conn.open(stack, deployment.creds[CONSOLE])
    try:
        await asyncio.wait_for(broker.start(), 20)
        body = json.dumps({"host": f"rec-{deployment.prefix}"}).encode()
        forged.append((await admin.publish(LEDGER_STREAM, ledger_subject("claim", f"rec-{deployment.prefix}"),
                                           body)).seq)  # not a transition: deleted when the test ends
        deadline = asyncio.get_running_loop().time() + 20
        while body not in seen:
            assert asyncio.get_running_loop().time() < deadline, seen
            await asyncio.sleep(0.1)
        for api in (f"$JS.API.CONSUMER.CREATE.{LEDGER_STREAM}.other.{RECOVERY_FILTER}",
                    f"$JS.API.CONSUMER.CREATE.{LEDGER_STREAM}.{durable}.hm.fact.>",
                    f"$JS.API.CONSUMER.DURABLE.CREATE.{LEDGER_STREAM}.other",
                    f"$JS.API.CONSUMER.DELETE.{LEDGER_STREAM}.{durable}"):
            assert await console.refused_api(api), api
    finally:
        await broker.stop()
        await console.close()
        with contextlib.suppress(Exception):
            await admin.js.delete_consumer(LEDGER_STREAM, durable)
        await admin.close()


async def test_only_the_router_sends_a_wake(stack: StackInfo, deployment: Deployment) -> None:
    label = deployment.labels["uk"]
    box = await Conn.open(stack, deployment.box("uk"))
    woken: list[bytes] = []

    async def answer(msg: Any) -> None:
        woken.append(msg.data)
        await msg.respond(b"ok")

    await box.nc.subscribe(box_wake_subject(label), cb=answer)
    await box.nc.flush()
    console, router = await Conn.open(stack, deployment.creds[CONSOLE]), await Conn.open(stack,
                                                                                          deployment.creds[ROUTER])
    try:
        assert await console.denied_publish(box_wake_subject(label))
        reply = await router.nc.request(box_wake_subject(label), b"h1", timeout=3.0)  # the box may answer it
        assert reply.data == b"ok" and woken == [b"h1"]
        for subject in (ledger_subject("claim", "h1"), fact_subject("evidence", "h1"), alert_subject("poison")):
            assert await router.denied_publish(subject), subject
    finally:
        for c in (box, console, router):
            await c.close()


async def test_a_push_consumer_cannot_store_what_the_reader_may_not_publish(stack: StackInfo,
                                                                            deployment: Deployment) -> None:
    """nats-server does not check a push consumer's deliver subject against its creator's rights (issue 8274): the
    projections' role can have the ledger's own stored messages delivered elsewhere. It cannot store them again."""
    admin = await NatsEventLog.connect(stack.nats_url)
    reader = await nats.connect(stack.nats_url, nkeys_seed_str=deployment.creds[PROJECTIONS].nats_seed,
                                inbox_prefix=deployment.creds[PROJECTIONS].inbox_prefix)
    target = fact_subject("evidence", f"deliver-{deployment.prefix}")
    try:
        info = await reader.jetstream().add_consumer(LEDGER_STREAM, ConsumerConfig(
            deliver_subject=target, ack_policy=AckPolicy.NONE, deliver_policy=DeliverPolicy.LAST,
            inactive_threshold=5.0))
        await asyncio.sleep(0.5)
        assert await _stored(admin, FACTS_STREAM, target) is None
        await admin.js.delete_consumer(LEDGER_STREAM, info.name)
    finally:
        await reader.close()
        await admin.close()


def test_every_role_but_the_operator_has_an_allow_list() -> None:
    assert nats_permissions(ADMIN) is None
    for role in (CONSOLE, PROJECTIONS, ROUTER, box_role("ie-1")):
        perms = nats_permissions(role)
        assert perms is not None and perms["publish"]["allow"] and perms["subscribe"]["allow"] == [
            *perms["subscribe"]["allow"][:-1], f"{inbox_prefix(role)}.>"]
        assert not any(s.startswith(("$JS.API.STREAM.DELETE", "$JS.API.STREAM.PURGE", "$JS.API.STREAM.MSG.DELETE",
                                     "$JS.API.STREAM.UPDATE", ">")) for s in perms["publish"]["allow"])
    assert nats_permissions(PROJECTIONS)["publish"]["allow"] == [  # type: ignore[index]
        s for s in nats_permissions(PROJECTIONS)["publish"]["allow"] if s.startswith("$JS.API.")]  # type: ignore


# ------------------------------------------------------------------------------------------------------- the store


def _ports(stack: StackInfo) -> dict[str, int]:
    return dict(stack_status(stack.root)["s3"]["ports"])


def _http(url: str, context: ssl.SSLContext | None = None) -> str:
    try:
        with urllib.request.urlopen(url, timeout=3, context=context) as resp:
            return f"{resp.status}: {resp.read()[:200]!r}"
    except urllib.error.HTTPError as exc:
        return f"refused {exc.code}"
    except (OSError, ssl.SSLError) as exc:
        return f"refused {type(exc).__name__}: {exc}"


def _no_client_cert() -> ssl.SSLContext:
    ctx = ssl.create_default_context()
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    return ctx


@pytest.mark.skipif(os.environ.get("HOSTMOVE_TEST_CONTAINERS") == "1", reason="the embedded stack's ports")
def test_every_port_of_the_store_but_s3_refuses_an_unsigned_request(stack: StackInfo,
                                                                     deployment: Deployment) -> None:
    ports = _ports(stack)
    roster = f"/buckets/{deployment.bucket}/{ROSTER_KEY}"
    for name in ("master", "volume", "filer", "admin"):
        for path in (roster, "/dir/assign", "/status", "/"):
            for scheme, ctx in (("http", None), ("https", _no_client_cert())):
                answer = _http(f"{scheme}://127.0.0.1:{ports[name]}{path}", ctx)
                assert answer.startswith("refused"), (name, scheme, path, answer)
                if scheme == "https":
                    assert "CERTIFICATE_REQUIRED" in answer, answer
    upload = urllib.request.Request(f"http://127.0.0.1:{ports['filer']}/buckets/{deployment.bucket}/planted",
                                    data=b"x", method="PUT")
    assert _http(upload.full_url).startswith("refused")  # plain HTTP to a TLS port
    for name in ("master_grpc", "volume_grpc", "filer_grpc", "s3_grpc", "admin_grpc"):
        raw = socket.create_connection(("127.0.0.1", ports[name]), timeout=3)
        raw.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes.fromhex("000000040000000000"))
        try:
            assert not raw.recv(64).startswith(b"\x00\x00"), name  # no HTTP/2 frame: not gRPC in the clear
        except OSError:
            pass
        raw.close()
        ctx = _no_client_cert()
        ctx.set_alpn_protocols(["h2"])
        with pytest.raises(ssl.SSLError, match="CERTIFICATE_REQUIRED"):
            with ctx.wrap_socket(socket.create_connection(("127.0.0.1", ports[name]), timeout=3)) as tls:
                tls.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
                tls.recv(64)
    unsigned = boto3.session.Session().client(
        "s3", endpoint_url=stack.s3_endpoint, region_name=stack.s3_region, verify=False,
        config=Config(signature_version=UNSIGNED, s3={"addressing_style": "path"}, retries={"max_attempts": 1}))
    with pytest.raises(ClientError, match="AccessDenied"):
        unsigned.get_object(Bucket=deployment.bucket, Key=ROSTER_KEY)
    with pytest.raises(ClientError, match="AccessDenied"):
        unsigned.put_object(Bucket=deployment.bucket, Key="planted", Body=b"x")


def _listeners(port: int) -> set[str]:
    """The local addresses listening on TCP ``port`` (``/proc/net/tcp`` and ``tcp6``, state 0A)."""
    out = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(FileNotFoundError):
            for line in Path(table).read_text().splitlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                address, hexport = local.rsplit(":", 1)
                if state == "0A" and int(hexport, 16) == port:
                    out.add(socket.inet_ntop(socket.AF_INET, bytes.fromhex(address)[::-1]) if len(address) == 8
                            else address)
    return out


@pytest.mark.skipif(os.environ.get("HOSTMOVE_TEST_CONTAINERS") == "1", reason="the embedded stack's ports")
def test_the_nats_monitoring_port_listens_on_loopback_only(stack: StackInfo) -> None:
    """Issue 14 (the monitoring port): NATS's monitor has no authentication of its own (``/connz`` names every
    connection and its subscriptions), so the embedded stack binds it to loopback only, as its client port."""
    port = int(stack.nats_monitor_url.rsplit(":", 1)[1])
    assert _listeners(port) == {"127.0.0.1"}
    assert _listeners(int(stack.nats_url.rsplit(":", 1)[1])) == {"127.0.0.1"}


def test_behind_the_tls_the_filer_still_wants_a_signed_token(stack: StackInfo, deployment: Deployment) -> None:
    """Defence in depth: even with the store's own client certificate, the filer serves no read without a JWT."""
    tls = Path(stack.root) / "s3" / "tls"
    ctx = ssl.create_default_context(cafile=str(tls / "ca.crt"))
    ctx.check_hostname = False
    ctx.load_cert_chain(tls / "store.crt", tls / "store.key")
    answer = _http(f"https://127.0.0.1:{_ports(stack)['filer']}/buckets/{deployment.bucket}/{ROSTER_KEY}", ctx)
    assert answer == "refused 401", answer
    for path in (tls / "store.key", Path(stack.root) / "s3" / "security.toml"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path


def _s3(stack: StackInfo, creds: Credentials) -> Any:
    return boto3.session.Session().client(
        "s3", endpoint_url=stack.s3_endpoint, region_name=stack.s3_region, verify=False,
        aws_access_key_id=creds.s3_access_key, aws_secret_access_key=creds.s3_secret_key,
        config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 1}))


def _denied(call: Callable[[], Any]) -> bool:
    try:
        call()
    except ClientError as exc:  # refused by the policy: a key the store does not know is another error
        code = exc.response.get("Error", {}).get("Code")
        if code:
            return code in ("AccessDenied", "403")
        return exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 403
    return False


def test_a_box_identity_writes_only_where_a_box_may(stack: StackInfo, deployment: Deployment) -> None:
    s3 = _s3(stack, deployment.box("ie"))
    d, own, other = deployment.bucket, f"{deployment.prefix}-ie", f"{deployment.prefix}-uk"
    uk = deployment.labels["uk"]
    refused = {
        "the roster": lambda: s3.put_object(Bucket=d, Key=ROSTER_KEY, Body=b"{}"),
        "another box's fence": lambda: s3.put_object(Bucket=d, Key=f"control/box-fences/{uk}.json", Body=b"{}"),
        "the deployment's key": lambda: s3.put_object(Bucket=d, Key="control/secrets-key.json", Body=b"{}"),
        "the floor": lambda: s3.put_object(Bucket=d, Key="control/moves-protocol.json", Body=b"{}"),
        "the deployment's identity": lambda: s3.put_object(Bucket=d, Key="control/deployment.json", Body=b"{}"),
        "an app release": lambda: s3.put_object(Bucket=d, Key="apps/x/releases/1.json", Body=b"{}"),
        "another box's instances": lambda: s3.put_object(Bucket=other, Key="instances/h1/db", Body=b"x"),
        "another box's generation certificate": lambda: s3.put_object(
            Bucket=other, Key="instances/h1/g/closed/1.json", Body=b"{}"),
        "a read of another region's staging (push-only, M17)": lambda: s3.get_object(Bucket=other,
                                                                                      Key="moves/h1/op/x"),
        "a listing of another region's bucket outside moves/": lambda: s3.list_objects_v2(Bucket=other),
        "a new bucket": lambda: s3.create_bucket(Bucket=f"{deployment.prefix}-zz"),
        "the deployment bucket's removal": lambda: s3.delete_bucket(Bucket=d),
    }
    for what, call in refused.items():
        assert _denied(call), what
    s3.put_object(Bucket=own, Key="instances/h1/db", Body=b"x")  # its own region's data
    s3.put_object(Bucket=other, Key="moves/h1/op/x", Body=b"x")  # M17: Put in every other region's moves/*
    s3.delete_object(Bucket=other, Key="moves/h1/op/x")
    s3.list_objects_v2(Bucket=other, Prefix="moves/")  # ... and the prefix-conditioned List
    s3.put_object(Bucket=d, Key="control/staging-leases/uk/h1.json", Body=b"{}")
    s3.get_object(Bucket=d, Key=ROSTER_KEY)
    # What a key prefix cannot say: a claim is the host's, not a box's (module doc of hostmove.access).
    s3.put_object(Bucket=d, Key="control/hosts/h1.json", Body=b"{}")
    iam = boto3.session.Session().client("iam", endpoint_url=stack.s3_endpoint, region_name=stack.s3_region,
                                         aws_access_key_id=deployment.box("ie").s3_access_key,
                                         aws_secret_access_key=deployment.box("ie").s3_secret_key)
    assert _denied(lambda: iam.create_user(UserName="escalated"))  # a box cannot mint itself an identity


def test_the_read_only_and_console_identities(stack: StackInfo, deployment: Deployment) -> None:
    d, own = deployment.bucket, f"{deployment.prefix}-ie"
    reader = _s3(stack, deployment.creds[PROJECTIONS])
    assert reader.get_object(Bucket=d, Key="control/hosts/h1.json")["Body"].read() == b"{}"
    for call in (lambda: reader.put_object(Bucket=d, Key="control/hosts/h1.json", Body=b"x"),
                 lambda: reader.delete_object(Bucket=d, Key="control/hosts/h1.json"),
                 lambda: reader.get_object(Bucket=own, Key="instances/h1/db")):
        assert _denied(call)
    console = _s3(stack, deployment.creds[CONSOLE])
    console.put_object(Bucket=d, Key="control/records/h1.json", Body=b"{}")
    console.put_object(Bucket=d, Key="moves/h1/op1/log/000000000001.json", Body=b"{}")  # its move log (§13)
    console.put_object(Bucket=d, Key="moves/_by-id/op1.json", Body=b"{}")
    for call in (lambda: console.put_object(Bucket=d, Key=ROSTER_KEY, Body=b"{}"),
                 lambda: console.put_object(Bucket=d, Key="moves/h1/op1/stopped-source.json", Body=b"{}"),
                 lambda: console.put_object(Bucket=own, Key="instances/h1/db", Body=b"x"),
                 lambda: console.get_object(Bucket=own, Key="instances/h1/db")):
        assert _denied(call)
    router = _s3(stack, deployment.creds[ROUTER])
    assert _denied(lambda: router.get_object(Bucket=d, Key="control/hosts/h1.json"))


def test_the_console_deletes_a_lease_or_journal_version_by_id_and_writes_neither(stack: StackInfo,
                                                                                 deployment: Deployment) -> None:
    """The recovery's history sweep (services/sweeper/history.py) deletes noncurrent versions of what the boxes
    rewrite, by exact version id; the console may not write those objects, nor delete one without its id."""
    d = deployment.bucket
    box, console = _s3(stack, deployment.box("ie")), _s3(stack, deployment.creds[CONSOLE])
    for key in ("control/staging-leases/uk/h2.json", "moves/h2/op1/source.json"):
        old = box.put_object(Bucket=d, Key=key, Body=b'{"n": 1}')["VersionId"]
        box.put_object(Bucket=d, Key=key, Body=b'{"n": 2}')
        assert _denied(lambda k=key: console.put_object(Bucket=d, Key=k, Body=b"{}")), key
        assert _denied(lambda k=key: console.delete_object(Bucket=d, Key=k)), key  # a delete marker: never
        console.delete_object(Bucket=d, Key=key, VersionId=old)
        versions = console.list_object_versions(Bucket=d, Prefix=key).get("Versions", [])
        assert [v["VersionId"] for v in versions if v["Key"] == key and v["VersionId"] == old] == [], key
        assert console.get_object(Bucket=d, Key=key)["Body"].read() == b'{"n": 2}', key


# ------------------------------------------------------------------------------------------------------- files


def test_every_credentials_file_is_owner_only(deployment: Deployment, tmp_path: Path) -> None:
    files = sorted(credentials_dir(deployment.root).glob("*.json"))
    assert {f.stem for f in files} == {CONSOLE, PROJECTIONS, ROUTER, *(box_role(x) for x in deployment.labels.values())}
    for f in files:
        assert stat.S_IMODE(f.stat().st_mode) == 0o600, f
    assert stat.S_IMODE(credentials_dir(deployment.root).stat().st_mode) == 0o700
    loose = tmp_path / "loose.json"
    loose.write_bytes(role_file(credentials_dir(deployment.root), CONSOLE).read_bytes())
    loose.chmod(0o644)
    with pytest.raises(CredentialsError, match="owner-only"):
        load_credentials(loose)
    assert deployment.creds[CONSOLE].nats_seed not in repr(deployment.creds[CONSOLE])


def test_the_shipped_iam_examples_are_the_policies() -> None:
    shipped = {p.stem: json.loads(p.read_text()) for p in (ROOT / "examples" / "iam").glob("*.json")}
    assert shipped == dict(example_policies())


# ------------------------------------------------------------------------------------------------------- services


async def test_a_service_gets_its_role_and_logs_none_of_its_secrets(stack: StackInfo, deployment: Deployment,
                                                                    tmp_path: Path) -> None:
    """A launcher's environment names no key, only where the roles' files are; the relay (the console's role)
    connects with its own nkey and S3 key, and none of them reaches its log."""
    from hostmove.procs import ServiceProc, service_env

    env = service_env(stack, root=deployment.root, bucket=deployment.bucket,
                      extra={"HOSTMOVE_DATA_BUCKET_PREFIX": deployment.prefix})
    assert not {"HOSTMOVE_S3_ACCESS_KEY", "HOSTMOVE_S3_SECRET_KEY", "HOSTMOVE_CREDENTIALS"} & set(env)
    assert all(stack.s3_secret_key not in v for v in env.values())
    relay = ServiceProc.serve("relay", env, tmp_path / "relay.log")
    relay.start()
    try:
        async def ready() -> bool:
            return '"relay: passes' in relay.output() or "nats is ready" in relay.output()

        deadline = asyncio.get_running_loop().time() + 30
        while not await ready():
            assert relay.alive(), relay.output()
            assert asyncio.get_running_loop().time() < deadline, relay.output()
            await asyncio.sleep(0.2)
    finally:
        assert relay.stop() == 0, relay.output()
    out = relay.output()
    secrets = [s for c in deployment.creds.values() for s in c.secrets()] + [stack.s3_secret_key]
    assert not [s for s in secrets if s in out]
    assert "Authorization Violation" not in out and "AccessDenied" not in out, out


# ------------------------------------------------------------------------------------------------------- compose


def test_a_rendered_deployment_is_what_compose_mounts(stack: StackInfo, unique: Callable[[str], str],
                                                      tmp_path: Path) -> None:
    """``python -m hostmove.access render``: the NATS configuration (which nats-server accepts), one owner-only
    credentials file per role that compose.yaml mounts, each role's policy, and the store's security settings; with
    the store admin's IAM, each role's S3 identity too."""
    import subprocess

    import yaml

    from hostmove.access import _iam, render_deployment, s3_policy
    from hostmove.stack import NATS_BIN

    bucket = unique("rendered")
    made = render_deployment(tmp_path, boxes={"ie-1": "ie"}, deployment_bucket=bucket, iam=_iam(stack))
    checked = subprocess.run([str(NATS_BIN), "-t", "-c", str(tmp_path / "nats.conf")], capture_output=True,
                             text=True, timeout=30)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    conf = json.loads((tmp_path / "nats.conf").read_text())
    assert len(conf["authorization"]["users"]) == len(made) == 5
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    for name, secret in compose["secrets"].items():
        path = tmp_path / Path(secret["file"]).relative_to("deploy")
        if name.startswith("box-") and name != "box-ie-1":
            continue  # a box this render was not asked for
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, name
        if name == "deployment-key":
            load_private_key(path)  # the deployment's key, made once by render (issue 20 item 6)
            continue
        assert load_credentials(path).role == name
    for name in ("relay", "projections", "door", "recovery", "box-ie-1"):
        assert compose["services"][name]["secrets"][0]["target"] == "hostmove", name
    assert "HOSTMOVE_S3_SECRET_KEY" not in compose["x-hostmove"]["environment"]
    assert compose["services"]["nats"]["command"][:2] == ["-c", "/etc/nats/nats.conf"]
    assert "ca = \"/etc/seaweedfs/tls/ca.crt\"" in (tmp_path / "store" / "security.toml").read_text()
    policy = json.loads((tmp_path / "iam" / "box-ie-1.json").read_text())
    assert policy == s3_policy("box-ie-1", deployment_bucket=bucket, region="ie")
    box = made["box-ie-1"]
    assert box.s3_access_key and box.s3_secret_key and box.nats_seed
    s3 = _s3(stack, box)
    assert _denied(lambda: s3.put_object(Bucket=bucket, Key=ROSTER_KEY, Body=b"{}"))
    again = render_deployment(tmp_path, boxes={"ie-1": "ie"}, deployment_bucket=bucket)  # made once
    assert again["box-ie-1"] == box


def test_a_role_whose_key_the_store_lost_gets_a_new_one(stack: StackInfo, deployment: Deployment) -> None:
    """A kept root on a store that no longer knows the role's key (a stack made afresh): provisioning again gives
    the role a new key and keeps its nkey."""
    from hostmove.access import _iam, ensure_role, iam_user_name

    before = deployment.creds[ROUTER]
    iam = _iam(stack)
    iam.delete_access_key(UserName=iam_user_name(ROUTER, deployment.bucket), AccessKeyId=before.s3_access_key)
    after = ensure_role(stack, deployment.root, ROUTER, deployment_bucket=deployment.bucket,
                        data_prefix=deployment.prefix)
    assert after.s3_access_key != before.s3_access_key and after.nats_seed == before.nats_seed
    assert load_credentials(role_file(credentials_dir(deployment.root), ROUTER)) == after
    admin = _s3(stack, Credentials(role=ADMIN, s3_access_key=stack.s3_access_key, s3_secret_key=stack.s3_secret_key))
    admin.put_object(Bucket=deployment.bucket, Key="_health/ping", Body=b"ok")
    s3 = _s3(stack, after)  # the new key is signed in, and its policy holds
    assert s3.get_object(Bucket=deployment.bucket, Key="_health/ping")["Body"].read() == b"ok"
    assert _denied(lambda: s3.get_object(Bucket=deployment.bucket, Key="control/hosts/h1.json"))
    deployment.creds[ROUTER] = after


def test_provisioning_again_without_the_prefix_keeps_the_boxes_grants(stack: StackInfo,
                                                                      deployment: Deployment) -> None:
    """A launcher of console services names no data prefix: the boxes keep the grants they were given."""
    again = provision_deployment(stack, deployment.root, deployment_bucket=deployment.bucket)
    assert again[box_role(deployment.labels["ie"])] == deployment.box("ie")
    _s3(stack, deployment.box("ie")).put_object(Bucket=f"{deployment.prefix}-ie", Key="instances/h2/db", Body=b"x")
