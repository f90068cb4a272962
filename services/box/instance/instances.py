"""The one registry of a box's running instances (spec §5.1 step 9, §5.3; issue 11 item 1).

Exactly one :class:`Instances` exists per box process. Whatever started an instance (a wake's cold admission, a
landing's probe, a rollback's or a revert's recovery, a relocation), it is entered here with its writer session,
its port and its replication, and every reader asks here: the readiness URL, the edge table's endpoint, the
replication position, the idle clock, the timers' delivery URL, and every stop. At the open (§7.9) the landing
hands its probe over (:meth:`Instances.hand_over`): from then on the instance is the box's like any other, so a
host that arrived by a move leaves by the next one exactly as a host created on the box does.

What the registry does not hold: the route rows (:mod:`services.box.instance.registry`, durable on disk) and the
process tree (the cgroup leaf, which outlives the agent). After a restart the registry is empty and
:meth:`services.box.instance.activator.Activator.adopt_running` stops what the dead agent left (a new owner
process is a new session).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol

from kernel.fsutil import atomic_write
from kernel.logctx import ctx
from services.box.replica.replicator import Replicator

Origin = Literal["wake", "probe", "landed"]
"""How an instance came to run here: a cold admission of the box (``wake``: a start, a wake from sleep, a
recovery or relocation), a landing's probe before the open (``probe``: its route is held, it is not the
host's writer of record yet, and its stop writes no clean-close certificate), or a probe the open handed over
(``landed``: from then on exactly a ``wake``)."""


class Process(Protocol):
    """The handle of an instance's process tree that stops it (a landing's probe app). A woken instance has
    none: its tree is the host's cgroup leaf, which the activator kills and drains."""

    async def stop(self) -> None: ...


log = logging.getLogger("hostmove.box")

LOOP_END_S = 30.0
"""How long a stop waits for its instance's sync loop to end its round after the stop is signalled (a round's
requests answer within the S3 client's timeout) before it cancels the round."""


@dataclass
class Instance:
    """One instance running on this box, in one writer session."""

    host: str
    port: int
    session: int
    generation: str
    location: str
    replicator: Replicator
    origin: Origin
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None
    process: Process | None = None

    @property
    def url(self) -> str:
        """The instance's base URL on the box-local network."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def position(self) -> int:
        """The replica position its commits move (the idle clock watches it)."""
        return self.replicator.position


class AlreadyRunning(Exception):
    """A second instance of a host on one box: never two writers (INV-1)."""


def unshipped_path(db_path: Path) -> Path:
    """``<host>.unshipped``: written before a stop's final sync, removed once it shipped every frame. While it
    exists the local database may hold commits the bucket does not: the replicator's close after a failed upload
    lets SQLite checkpoint the unshipped frames into the database file (the last connection's checkpoint on
    close), so an empty WAL no longer proves there is nothing to ship (:meth:`Activator.flush_orphan`)."""
    return db_path.with_suffix(".unshipped")


async def final_sync(rep: Replicator) -> bool:
    """A stop's final sync once its tree is gone (§5.3 step 5, §7.4 ``stopped``): ship, checkpoint ``TRUNCATE``,
    ship again, close. ``<host>.unshipped`` (:func:`unshipped_path`) is written first and stays behind unless
    every frame shipped, so the next stop or wake flushes what did not (:meth:`Activator.flush_orphan`). Answers
    whether the stop is clean."""
    unshipped = unshipped_path(rep.db_path)
    atomic_write(unshipped, f"{rep.scope.generation}\n".encode())
    try:
        await rep.sync()
        await rep.checkpoint("TRUNCATE")
        clean = await rep.sync() is None and not rep.pending
    finally:
        await rep.close()
    if clean:
        unshipped.unlink(missing_ok=True)
    return clean


class Instances(dict[str, Instance]):
    """The box's running instances by host (see the module doc). A ``dict`` for reading; entered only with
    :meth:`enter` (which refuses a second instance of a host) and left only by the stop that ended it."""

    def enter(self, instance: Instance) -> None:
        if instance.host in self:
            raise AlreadyRunning(f"{instance.host} already runs on this box "
                                 f"(session {self[instance.host].session}, {self[instance.host].origin})")
        self[instance.host] = instance

    def hold_snapshots(self, host: str, held: bool) -> None:
        """Hold or release the snapshots of ``host``'s running replicator (:attr:`Replicator.snapshots_held`):
        held while the claim is a move this box is the source of (§7.3: the rounds stage the history as it grows,
        so the cut's final mirror copies only what changed since the last round, never a fresh snapshot)."""
        instance = self.get(host)
        if instance is not None:
            instance.replicator.snapshots_held = held

    def hand_over(self, host: str) -> Instance | None:
        """The open (§7.9): the landing's probe becomes the box's instance of the host (``landed``)."""
        instance = self.get(host)
        if instance is not None and instance.origin == "probe":
            instance.origin = "landed"
        return instance

    async def stop(self, host: str) -> bool:
        """End the instance's replication once its process tree is gone and leave the registry: the sync loop's
        own end, then the final sync (:func:`final_sync`). The caller drains the tree first (the activator's
        cgroup drain, or the probe's own :attr:`Instance.process`, which this calls too). The instance stays
        entered until its loop has ended, so a stop cancelled before that leaves it where the next stop finds
        it. Answers whether the stop is clean (False too when nothing ran)."""
        instance = self.get(host)
        if instance is None:
            return False
        if instance.process is not None:
            await instance.process.stop()
        instance.stop.set()
        if instance.task is not None:
            # Wait for the sync loop's own end, a cancelled loop included, without raising its outcome here: a
            # `suppress(CancelledError)` around `await task` also swallowed the cancellation of this caller (the
            # simulation's agent crash mid-stop: the dead agent's pass loop ran on beside its successor). A round
            # that does not end within LOOP_END_S (a request stalled after signing) is cancelled: the final sync
            # below ships what it had pending, and a request of it that lands late is the parks' late completion
            # (§6.4); waiting on it held a cut's stop past its deadline (simulation move seeds 219, 293).
            ended, _ = await asyncio.wait({instance.task}, timeout=LOOP_END_S)
            if not ended:
                log.warning("the sync loop of %s did not end within %g s of its stop: its round is cancelled",
                            host, LOOP_END_S, extra=ctx(host=host, phase="stop", session=instance.session))
                instance.task.cancel()
                await asyncio.wait({instance.task})
        if self.get(host) is instance:
            del self[host]
        return await final_sync(instance.replicator)

    def serving(self, host: str) -> Instance | None:
        """The instance of ``host`` that may serve (not a landing's probe, whose route is held until the open)."""
        instance = self.get(host)
        return instance if instance is not None and instance.origin != "probe" else None


__all__ = ["AlreadyRunning", "Instance", "Instances", "Origin", "Process", "final_sync", "unshipped_path"]
