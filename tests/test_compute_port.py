"""The compute port's contract (spec §7.10 compute fencing, joint D6; issue 15 item 1), run against both adapters:
``local`` (a real cgroup v2 subtree and its platform record) and ``aws`` (EC2 through aioboto3 against moto's server
mode, started here). A running box is never evidence; a stopped or terminated one is; the platform cannot vouch for
a box that is not the one the roster records; and the termination fence is written only after the port shows
``terminated`` (real S3 and NATS)."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import suppress
from pathlib import Path
from typing import Any, Protocol

import boto3
import pytest
import pytest_asyncio
from moto.server import ThreadedMotoServer

from bus.nats_log import NatsEventLog
from events.envelope import Actor
from hostmove.stackinfo import StackInfo
from kernel.ports import WallClock
from services.box.compute import BoxCompute, ComputeRefused, ComputeState, LocalCompute, platform_record
from services.box.compute_aws import AwsCompute
from services.box.fence import FenceRefused, fence_box, read_fence
from services.box.roster import RosterBox, decide_register, read_roster, update_roster
from services.objstore.s3 import S3Store
from tests.helpers.cgtest import TEST_DEPLOYMENT, alive, box_tree, forker, python_env, read_pid

REGION = "eu-west-1"
ACCOUNT = "123456789012"  # moto's account


class Platform(Protocol):
    @property
    def port(self) -> ComputeState: ...

    def running(self) -> BoxCompute: ...
    async def terminate(self, box: BoxCompute) -> None: ...
    def dead(self, box: BoxCompute) -> bool: ...
    def foreign(self, box: BoxCompute) -> BoxCompute: ...


class Local:
    def __init__(self, root: Path, unique: Callable[[str], str]) -> None:
        self.root, self.unique = root, unique
        self.port = LocalCompute(root / "platform-root", TEST_DEPLOYMENT, clock=WallClock())
        self.pids: dict[str, int] = {}
        self._trees: list[Any] = []

    def running(self) -> BoxCompute:
        label = self.unique("cp")
        ctx = box_tree(label)
        tree, _home = ctx.__enter__()
        self._trees.append(ctx)
        work = self.root / label
        work.mkdir()
        spawned = tree.spawn_strict("h.example", forker("tree", str(work)), env=python_env(), cwd=work,
                                    stdout=work / "out", stderr=work / "err")
        assert spawned.process.wait(timeout=20) == 0
        self.pids[label] = read_pid(work / "descendant.pid")  # it outlives its parent, as §5.3 says one can
        return BoxCompute(label, "ie", "fp@1")

    async def terminate(self, box: BoxCompute) -> None:
        """The platform's own verb (the operator terminating the machine), not part of the port's contract."""
        assert isinstance(self.port, LocalCompute)
        await self.port.terminate(box)

    def dead(self, box: BoxCompute) -> bool:
        return not alive(self.pids[box.label])

    def foreign(self, box: BoxCompute) -> BoxCompute:
        return BoxCompute(box.label, box.region, "another-fp@2")

    def close(self) -> None:
        for ctx in self._trees:
            ctx.__exit__(None, None, None)


class Aws:
    def __init__(self, endpoint: str) -> None:
        self.port = AwsCompute(endpoint_url=endpoint, access_key="testing", secret_key="testing", stop_within_s=30)
        self.ec2 = boto3.client("ec2", region_name=REGION, endpoint_url=endpoint, aws_access_key_id="testing",
                                aws_secret_access_key="testing")

    def running(self) -> BoxCompute:
        made = self.ec2.run_instances(ImageId="ami-12c6146b", MinCount=1, MaxCount=1)
        iid = made["Instances"][0]["InstanceId"]
        return BoxCompute("ie-1", "ie", "fp@1", instance_id=iid, account=ACCOUNT, cloud_region=REGION)

    async def terminate(self, box: BoxCompute) -> None:
        self.ec2.terminate_instances(InstanceIds=[box.instance_id])

    def dead(self, box: BoxCompute) -> bool:
        state = self.ec2.describe_instances(InstanceIds=[box.instance_id])["Reservations"][0]["Instances"][0]
        return str(state["State"]["Name"]) in ("stopped", "terminated")

    def foreign(self, box: BoxCompute) -> BoxCompute:
        return BoxCompute(box.label, box.region, box.enrollment, instance_id=box.instance_id, account="210987654321",
                          cloud_region=REGION)


@pytest.fixture(scope="module")
def moto_endpoint() -> Iterator[str]:
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()


@pytest.fixture(params=["local", "aws"])
def platform(request: pytest.FixtureRequest, tmp_path: Path, unique: Callable[[str], str]) -> Iterator[Platform]:
    if request.param == "aws":
        yield Aws(request.getfixturevalue("moto_endpoint"))
        return
    local = Local(tmp_path, unique)
    try:
        yield local
    finally:
        local.close()


async def test_a_running_box_is_no_evidence_and_stopping_it_is(platform: Platform) -> None:
    box = platform.running()
    seen = await platform.port.observe(box)
    assert seen.status == "running" and box.label in seen.evidence
    assert not platform.dead(box)
    stopped = await platform.port.stop(box)
    assert stopped.status == "stopped" and platform.dead(box)
    assert (await platform.port.observe(box)).status == "stopped"
    assert (await platform.port.stop(box)).status == "stopped", "stopping a stopped box changes nothing"


async def test_a_terminated_box_shows_terminated_and_stays_so(platform: Platform) -> None:
    box = platform.running()
    await platform.terminate(box)
    seen = await platform.port.observe(box)
    assert seen.status == "terminated" and platform.dead(box)
    assert (await platform.port.stop(box)).status == "terminated", "a terminated machine is never merely stopped"


async def test_the_platform_does_not_vouch_for_a_box_that_is_not_the_rosters(platform: Platform) -> None:
    box = platform.running()
    await platform.port.stop(box)
    with pytest.raises(ComputeRefused):
        await platform.port.observe(platform.foreign(box))


async def test_aws_refuses_an_instance_it_does_not_know(moto_endpoint: str) -> None:
    aws = Aws(moto_endpoint)
    gone = BoxCompute("ie-9", "ie", "fp@1", instance_id="i-0123456789abcdef0", account=ACCOUNT, cloud_region=REGION)
    with pytest.raises(ComputeRefused, match="vanished instance is not evidence"):
        await aws.port.observe(gone)
    with pytest.raises(ComputeRefused, match="no EC2 instance"):
        await aws.port.observe(BoxCompute("ie-9", "ie", "fp@1"))


async def test_local_a_box_running_again_is_running_whatever_the_record_says(tmp_path: Path,
                                                                            unique: Callable[[str], str]) -> None:
    local = Local(tmp_path, unique)
    try:
        box = local.running()
        await local.port.stop(box)
        assert platform_record(tmp_path / "platform-root", TEST_DEPLOYMENT, box.label).is_file()
        assert platform_record(tmp_path / "platform-root", TEST_DEPLOYMENT, box.label).parent.parent.name == (
            "platform"), "the record is kept outside every box's directory"
        tree_ctx = box_tree(box.label)
        tree, _ = tree_ctx.__enter__()
        try:
            work = tmp_path / "again"
            work.mkdir()
            tree.spawn_strict("h.example", forker("tree", str(work)), env=python_env(), cwd=work,
                              stdout=work / "out", stderr=work / "err").process.wait(timeout=20)
            pid = read_pid(work / "descendant.pid")
            seen = await local.port.observe(box)
            assert seen.status == "running" and "although the platform recorded it stopped" in seen.evidence
            with suppress(ProcessLookupError):
                os.kill(pid, 9)
        finally:
            tree_ctx.__exit__(None, None, None)
    finally:
        local.close()


@pytest_asyncio.fixture(loop_scope="session")
async def deployment(stack: StackInfo, unique: Callable[[str], str]) -> AsyncIterator[tuple[S3Store, NatsEventLog,
                                                                                            str]]:
    store = await S3Store.open(stack.s3_endpoint, stack.s3_access_key, stack.s3_secret_key, stack.s3_region)
    events = await NatsEventLog.connect(stack.nats_url)
    bucket = unique("cpdeploy")
    await store.create_bucket(bucket, versioned=True)
    try:
        yield store, events, bucket
    finally:
        await store.delete_bucket(bucket)
        await events.close()
        await store.close()


@pytest.mark.asyncio(loop_scope="session")
async def test_the_fence_is_written_only_once_the_platform_shows_terminated(
        platform: Platform, deployment: tuple[S3Store, NatsEventLog, str]) -> None:
    store, events, bucket = deployment
    box = platform.running()
    await update_roster(store, bucket, lambda cur: decide_register(cur, RosterBox(
        label=box.label, region="ie", moves_protocol=1, secrets_key_fp="fp", registered_at=1,
        instance_id=box.instance_id, account=box.account, cloud_region=box.cloud_region)))
    clock, actor = WallClock(), Actor(service="test", pid=os.getpid(), nonce="cp")

    async def fence() -> object:
        return await fence_box(store=store, bucket=bucket, events=events, clock=clock, actor=actor, label=box.label,
                               compute=platform.port)

    with pytest.raises(FenceRefused, match="running"):
        await fence()
    await platform.port.stop(box)
    with pytest.raises(FenceRefused, match="stopped"):
        await fence()
    assert await read_fence(store, bucket, box.label) is None, "a stopped box is not fenced: nothing recorded"
    roster, _ = await read_roster(store, bucket)
    assert roster is not None and roster.box(box.label) is not None and roster.box(box.label).fenced_at is None  # type: ignore[union-attr]
    await platform.terminate(box)
    await fence()
    got = await read_fence(store, bucket, box.label)
    assert got is not None and got[0].enrollment == "fp@1"
    assert ("terminated" in got[0].evidence) and box.label in got[0].evidence
    roster, _ = await read_roster(store, bucket)
    assert roster is not None and roster.box(box.label).fenced_at == got[0].fenced_at  # type: ignore[union-attr]
