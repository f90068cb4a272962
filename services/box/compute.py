"""The platform port for a box's compute (spec §7.10 "compute fencing", joint D6; §5.3; issue 15 item 1).

One question, asked of the platform that runs the box and never of the box itself: is the compute of this box, as
the roster records it (label, region, enrollment, instance id, account), ``running``, ``stopped`` or
``terminated``; and one action, stop it. ``--declare-lost`` needs ``stopped`` or ``terminated``; the termination
fence (:func:`services.box.fence.fence_box`) needs ``terminated``. A claim CAS is bookkeeping, never a fence, and
an expired lease is not enough (model 5: a whole-VM pause stops the watchdog with everything else), so nothing here
answers from the box's own say or from a lease.

Two adapters:

- :class:`LocalCompute`, the embedded default: a box's compute is its cgroup v2 subtree
  ``hostmove/<deployment>/<label>`` on this machine, and the platform's record of it is
  ``<root>/platform/<deployment>/<label>.json``, outside the box's directory (the box can neither write nor remove
  it). Stopping kills the subtree (``cgroup.kill``), waits for ``populated 0`` and records ``stopped``. A record
  says ``stopped`` or ``terminated`` only while the subtree is empty: a box whose processes run again reads
  ``running`` whatever the record says, and a box the platform never stopped reads ``running`` too.
- :class:`services.box.compute_aws.AwsCompute`: EC2 ``DescribeInstances`` / ``StopInstances`` through aioboto3.

An unreachable platform is :class:`ComputeUnavailable` (a dependency's outage, never a refusal); a box the
platform cannot vouch for (another account, an unknown instance, no record of it) is :class:`ComputeRefused`.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

from kernel.fsutil import atomic_write
from kernel.ports import Clock
from services.box.instance.proctree import CgroupTree, leaf_name
from services.box.roster import RosterBox

ComputeStatus = Literal["running", "stopped", "terminated"]
EVIDENCE_STATES: frozenset[str] = frozenset({"stopped", "terminated"})
"""What ``--declare-lost`` accepts (§7.10); the termination fence accepts ``terminated`` alone."""


@dataclass(frozen=True)
class BoxCompute:
    """A box's compute as the roster records it: the platform is asked about exactly this."""

    label: str
    region: str
    enrollment: str
    instance_id: str = ""
    account: str = ""
    cloud_region: str = ""

    @classmethod
    def of(cls, entry: RosterBox) -> BoxCompute:
        return cls(label=entry.label, region=entry.region, enrollment=f"{entry.secrets_key_fp}@{entry.registered_at}",
                   instance_id=entry.instance_id, account=entry.account, cloud_region=entry.cloud_region)


@dataclass(frozen=True)
class ComputeObservation:
    """What the platform showed: the state, the instance it is about, and the observation in the operator's words."""

    status: ComputeStatus
    instance: str
    evidence: str


class ComputeUnavailable(Exception):
    """The platform's API did not answer: an outage of a dependency, not a refusal. Nothing was concluded."""


class ComputeRefused(Exception):
    """The platform cannot vouch for this box (unknown instance, another account, no cgroup v2). Operator's words."""


class ComputeState(Protocol):
    """The platform port (module docstring)."""

    async def observe(self, box: BoxCompute) -> ComputeObservation: ...

    async def stop(self, box: BoxCompute) -> ComputeObservation: ...


def platform_record(root: Path, deployment: str, label: str) -> Path:
    """``<root>/platform/<deployment>/<label>.json``: the embedded platform's record of a box's compute."""
    return root / "platform" / leaf_name(deployment) / f"{leaf_name(label)}.json"


class LocalCompute:
    """The embedded default's platform (module docstring). ``terminate`` is the platform's own verb (the operator
    terminating the machine); nothing in a move calls it."""

    def __init__(self, root: str | Path, deployment: str, *, clock: Clock, mounts: str | Path = "/proc/mounts",
                 kill_within_s: float = 10.0) -> None:
        self.root = Path(root)
        self.deployment = deployment
        self.clock = clock
        self.mounts = mounts
        self.kill_within_s = kill_within_s

    def _tree(self, label: str) -> CgroupTree:
        return CgroupTree.discover(label, deployment=self.deployment, mounts=self.mounts)

    def _where(self, tree: CgroupTree) -> str:
        assert tree.base is not None and tree.root is not None
        return str(tree.base.relative_to(tree.root))

    def _populated(self, tree: CgroupTree) -> bool:
        assert tree.base is not None
        try:
            return "populated 1" in (tree.base / "cgroup.events").read_text()
        except FileNotFoundError:
            return False

    def _record(self, label: str) -> dict[str, object] | None:
        path = platform_record(self.root, self.deployment, label)
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            raise ComputeUnavailable(f"the platform record of box {label} ({path}) cannot be read: {exc}") from None
        return data if isinstance(data, dict) else None

    def _check(self, box: BoxCompute) -> CgroupTree:
        tree = self._tree(box.label)
        if tree.base is None or tree.root is None:
            raise ComputeRefused(f"the compute of box {box.label} cannot be observed on this machine (no cgroup v2 "
                                 "hierarchy); ask the platform that runs it")
        return tree

    async def observe(self, box: BoxCompute) -> ComputeObservation:
        tree = self._check(box)
        record = self._record(box.label)
        where = self._where(tree)
        state = record.get("state") if record is not None else None
        if record is not None and record.get("enrollment") not in (None, box.enrollment):
            raise ComputeRefused(f"the platform's record of box {box.label} is of another enrollment "
                                 f"({record.get('enrollment')}, the roster has {box.enrollment})")
        if self._populated(tree):
            said = f" although the platform recorded it {state}" if state in EVIDENCE_STATES else ""
            return ComputeObservation("running", where, f"processes of box {box.label} run (cgroup {where}){said}")
        if state == "terminated":
            return ComputeObservation("terminated", where, f"every process of box {box.label} was killed and the "
                                      f"platform recorded it terminated at {record.get('at') if record else '?'} "
                                      f"(cgroup {where}: populated 0)")
        if state == "stopped":
            return ComputeObservation("stopped", where, f"the platform stopped box {box.label} at "
                                      f"{record.get('at') if record else '?'} (cgroup {where}: populated 0)")
        return ComputeObservation("running", where, f"the platform never stopped box {box.label}: it may start any "
                                  f"moment (cgroup {where})")

    async def _kill(self, box: BoxCompute, tree: CgroupTree) -> None:
        base = tree.base
        assert base is not None
        if not base.is_dir():
            return
        ok, why = tree.strict_available()
        if not ok:
            raise ComputeRefused(f"box {box.label}'s processes cannot be killed on this machine ({why})")
        (base / "cgroup.kill").write_text("1")
        deadline = time.monotonic() + self.kill_within_s
        while self._populated(tree):
            if time.monotonic() > deadline:
                raise ComputeRefused(f"box {box.label}'s cgroup did not empty within {self.kill_within_s:g} s of "
                                     "cgroup.kill; it is not stopped")
            await asyncio.sleep(0.01)

    async def _set(self, box: BoxCompute, state: ComputeStatus) -> ComputeObservation:
        tree = self._check(box)
        record = self._record(box.label)
        await self._kill(box, tree)
        if record is not None and record.get("state") == "terminated":
            return await self.observe(box)  # terminated for good: never recorded as merely stopped
        path = platform_record(self.root, self.deployment, box.label)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, json.dumps({"label": box.label, "enrollment": box.enrollment, "state": state,
                                       "at": self.clock.now_ms()}).encode())
        return await self.observe(box)

    async def stop(self, box: BoxCompute) -> ComputeObservation:
        """Kill the box's subtree, wait for ``populated 0``, record ``stopped``."""
        return await self._set(box, "stopped")

    async def terminate(self, box: BoxCompute) -> ComputeObservation:
        """The platform terminates the machine: killed as by :meth:`stop`, recorded ``terminated`` for good."""
        return await self._set(box, "terminated")


__all__ = ["EVIDENCE_STATES", "BoxCompute", "ComputeObservation", "ComputeRefused", "ComputeState", "ComputeStatus",
           "ComputeUnavailable", "LocalCompute", "platform_record"]
