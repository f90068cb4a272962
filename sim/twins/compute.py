"""The compute port's twin (:class:`services.box.compute.ComputeState`; spec §7.10 compute fencing, model 5).

The simulated platform answers what a real one would: a box whose machine runs, or is frozen whole (a paused VM:
the platform still runs it), is ``running``; a box the platform stopped is ``stopped`` (every process of it dead,
its disk kept) until the platform starts it again; a machine the world terminated is ``terminated``. ``stop`` is
the platform's own act: it kills the box's agent and every process of its tree (a frozen box too: a stopped VM
does not resume, it boots again), and the box starts again only when the world's platform starts it
(:meth:`sim.moves.MoveWorld.start_machine`), with its old disk: a new boot, whose agent quarantines first.
"""

from __future__ import annotations

from typing import Protocol

from services.box.compute import BoxCompute, ComputeObservation

__all__ = ["SimCompute"]


class Machines(Protocol):
    """What the twin reads and does of the world (:class:`sim.moves.MoveWorld`)."""

    terminated: set[str]
    stopped: set[str]

    def stop_machine(self, label: str) -> None: ...


class SimCompute:
    """The platform of the world with moves (module docstring)."""

    def __init__(self, world: Machines) -> None:
        self.world = world
        self.stops = 0

    async def observe(self, box: BoxCompute) -> ComputeObservation:
        label = box.label
        if label in self.world.terminated:
            return ComputeObservation("terminated", label, f"the machine of box {label} was terminated")
        if label in self.world.stopped:
            return ComputeObservation("stopped", label, f"the platform stopped box {label}: none of its processes "
                                                        "runs")
        return ComputeObservation("running", label, f"the machine of box {label} runs")

    async def stop(self, box: BoxCompute) -> ComputeObservation:
        if box.label not in self.world.terminated and box.label not in self.world.stopped:
            self.stops += 1
            self.world.stop_machine(box.label)
        return await self.observe(box)
