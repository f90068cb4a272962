"""The ``aws`` adapter of the compute port (spec §7.10; issue 15 item 1): EC2 through aioboto3.

The box's instance is asked about in the region and the account the roster records: ``DescribeInstances`` for the
instance id in ``cloud_region``, its reservation's ``OwnerId`` must be ``account``. EC2's states map onto the
port's three: ``stopped`` and ``terminated`` are themselves; ``pending``, ``running``, ``stopping`` and
``shutting-down`` are ``running`` (a machine on its way down may still write). An instance EC2 no longer knows is
refused, never read as terminated (a vanished box is the operator's ``--declare-lost`` only once the platform shows
it stopped or terminated). The credentials are the operator's (the standard AWS chain, or those given); they reach
no log, event or error.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aioboto3
from botocore.exceptions import BotoCoreError, ClientError

from services.box.compute import BoxCompute, ComputeObservation, ComputeRefused, ComputeStatus, ComputeUnavailable

_STATES: dict[str, ComputeStatus] = {"pending": "running", "running": "running", "stopping": "running",
                                     "shutting-down": "running", "stopped": "stopped", "terminated": "terminated"}
_UNKNOWN = ("InvalidInstanceID.NotFound", "InvalidInstanceID.Malformed")


class AwsCompute:
    """EC2 as the compute port. ``endpoint_url`` for a local EC2 endpoint; keys default to the AWS chain."""

    def __init__(self, *, endpoint_url: str | None = None, access_key: str | None = None,
                 secret_key: str | None = None, stop_within_s: float = 300.0) -> None:
        self.endpoint_url = endpoint_url
        self._session = aioboto3.Session(aws_access_key_id=access_key, aws_secret_access_key=secret_key)
        self.stop_within_s = stop_within_s

    def _client(self, box: BoxCompute) -> Any:
        if not box.instance_id or not box.account or not box.cloud_region:
            raise ComputeRefused(f"the roster records no EC2 instance, account and region for box {box.label}, so "
                                 "the platform cannot be asked about it")
        return self._session.client("ec2", region_name=box.cloud_region, endpoint_url=self.endpoint_url)

    async def _call(self, box: BoxCompute, what: str, ec2: Any, method: str, **kw: Any) -> dict[str, Any]:
        try:
            result: dict[str, Any] = await getattr(ec2, method)(**kw)
            return result
        except ClientError as exc:
            code = exc.response.get("Error", {}).get("Code", "")
            if code in _UNKNOWN:
                raise ComputeRefused(f"EC2 in {box.cloud_region} does not know instance {box.instance_id} of box "
                                     f"{box.label} ({code}): a vanished instance is not evidence") from None
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
            if code in ("UnauthorizedOperation", "AuthFailure") or 400 <= int(status or 0) < 500:
                raise ComputeRefused(f"EC2 refused to {what} instance {box.instance_id} of box {box.label} "
                                     f"({code})") from None
            raise ComputeUnavailable(f"EC2 in {box.cloud_region} did not answer to {what} instance "
                                     f"{box.instance_id} ({code or status})") from None
        except (BotoCoreError, OSError) as exc:
            raise ComputeUnavailable(f"EC2 in {box.cloud_region} cannot be reached to {what} instance "
                                     f"{box.instance_id} ({type(exc).__name__})") from None

    async def _observe(self, box: BoxCompute, ec2: Any) -> ComputeObservation:
        out = await self._call(box, "describe", ec2, "describe_instances", InstanceIds=[box.instance_id])
        found = [(r.get("OwnerId", ""), i) for r in out.get("Reservations", ()) for i in r.get("Instances", ())
                 if i.get("InstanceId") == box.instance_id]
        if not found:
            raise ComputeRefused(f"EC2 in {box.cloud_region} does not list instance {box.instance_id} of box "
                                 f"{box.label}: a vanished instance is not evidence")
        owner, inst = found[0]
        if owner != box.account:
            raise ComputeRefused(f"instance {box.instance_id} belongs to account {owner}, not to {box.account} as "
                                 f"the roster records box {box.label}")
        name = str(inst.get("State", {}).get("Name", ""))
        status = _STATES.get(name)
        if status is None:
            raise ComputeRefused(f"EC2 shows instance {box.instance_id} of box {box.label} in state {name!r}, "
                                 "which is no evidence either way")
        return ComputeObservation(status, box.instance_id, f"EC2 ({box.account}, {box.cloud_region}) shows "
                                  f"instance {box.instance_id} of box {box.label} {name}")

    async def observe(self, box: BoxCompute) -> ComputeObservation:
        async with self._client(box) as ec2:
            return await self._observe(box, ec2)

    async def stop(self, box: BoxCompute) -> ComputeObservation:
        """``StopInstances``, then ``DescribeInstances`` until EC2 shows it ``stopped`` (or ``terminated``)."""
        async with self._client(box) as ec2:
            seen = await self._observe(box, ec2)  # identity first: never stop another account's instance
            if seen.status != "running":
                return seen
            await self._call(box, "stop", ec2, "stop_instances", InstanceIds=[box.instance_id])
            deadline = time.monotonic() + self.stop_within_s
            while (seen := await self._observe(box, ec2)).status == "running":
                if time.monotonic() > deadline:
                    raise ComputeRefused(f"instance {box.instance_id} of box {box.label} did not stop within "
                                         f"{self.stop_within_s:g} s")
                await asyncio.sleep(1.0)
            return seen


__all__ = ["AwsCompute"]
