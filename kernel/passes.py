"""Concurrent passes, bounded, one at a time per host (issue 19 item 3; spec §7.4: the cut window is per host;
ARCHITECTURE §5: a box's agent and the console's recovery pass).

A box passes different hosts at once, at most ``workers`` of them, so a long landing never delays another host's
cut; a host's passes never overlap (its pass reads the claim and the record fresh and acts on them: two at once
would race their own steps). A host owed a pass while its pass runs (dirtied by an event meanwhile) is passed again
once it ends.

- :class:`PassSlots` is the decision (no I/O): which owed hosts start now, in sorted order, within the bound.
- :class:`PassPool` runs them as tasks (``spawn``: the simulation's actors spawn theirs, so a crash takes them, and
  tasks created in sorted order keep its virtual-clock runs deterministic).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

DEFAULT_WORKERS = 8
WORKERS_ENV = "HOSTMOVE_PASS_WORKERS"

T = TypeVar("T")


def whole_setting(name: str, text: str | None, default: int, what: str) -> int:
    """The setting ``name`` as a positive whole number of ``what``; unset keeps ``default``. Anything else is refused
    with the reason."""
    if text is None or not text.strip():
        return default
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"{name} must be a positive whole number of {what}, not {text!r}")
    return value


def workers_override(text: str | None, default: int = DEFAULT_WORKERS) -> int:
    """``HOSTMOVE_PASS_WORKERS``: how many hosts a box (or the recovery pass) passes at once; unset keeps
    ``default``. Anything but a positive whole number is refused with the reason."""
    return whole_setting(WORKERS_ENV, text, default, "concurrent passes")


@dataclass
class PassSlots:
    """Which hosts pass now: ``owed`` hosts start in the order they were owed (the hosts of one :meth:`want` sorted),
    while fewer than ``workers`` run, never one that runs already (it stays owed: passed again once its pass ends).
    First owed, first started: a host dirtied again and again never starves the others of the bound."""

    workers: int
    running: set[str] = field(default_factory=set)
    owed: dict[str, None] = field(default_factory=dict)  # in the order owed

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError(f"at least one pass worker, not {self.workers}")

    def want(self, hosts: Iterable[str]) -> None:
        for host in sorted(set(hosts)):
            self.owed.setdefault(host, None)

    def take(self) -> list[str]:
        """The hosts to start now (marked running, no longer owed)."""
        free = self.workers - len(self.running)
        start = [h for h in self.owed if h not in self.running][:max(free, 0)]
        for host in start:
            del self.owed[host]
        self.running.update(start)
        return start

    def done(self, host: str) -> None:
        self.running.discard(host)

    def withdraw(self) -> set[str]:
        """The owed hosts not started yet, no longer owed (an outage keeps them for later: the caller's backoff)."""
        taken, self.owed = set(self.owed), {}
        return taken

    @property
    def idle(self) -> bool:
        return not self.running and not self.owed


Spawn = Callable[[Coroutine[Any, Any, None], str], "asyncio.Future[None]"]


def _spawn(coro: Coroutine[Any, Any, None], _host: str) -> asyncio.Future[None]:
    return asyncio.ensure_future(coro)


class PassPool:
    """Runs ``run(host)`` for the hosts :meth:`submit` owes, as :class:`PassSlots` decides; ``ended`` is set
    whenever a pass ends (the loop's wake to start what waited). ``run`` handles its own errors: an exception
    escaping it ends that host's task only (never another host's pass)."""

    def __init__(self, workers: int, run: Callable[[str], Awaitable[None]], *, spawn: Spawn = _spawn) -> None:
        self.slots = PassSlots(workers)
        self._run, self._spawn = run, spawn
        self._tasks: dict[str, asyncio.Future[None]] = {}
        self.ended = asyncio.Event()
        self.closed = False

    def submit(self, hosts: Iterable[str]) -> None:
        """Owe ``hosts`` a pass and start what the bound allows."""
        self.slots.want(hosts)
        self._start()

    def withdraw(self) -> set[str]:
        return self.slots.withdraw()

    @property
    def running(self) -> set[str]:
        return set(self.slots.running)

    @property
    def idle(self) -> bool:
        return self.slots.idle

    def _start(self) -> None:
        if self.closed:  # a pass ending after the close (its process dying) starts none
            return
        for host in self.slots.take():
            self._tasks[host] = self._spawn(self._one(host), host)

    async def _one(self, host: str) -> None:
        try:
            await self._run(host)
        finally:
            self._tasks.pop(host, None)
            self.slots.done(host)
            self.ended.set()
            self._start()

    async def drain(self) -> None:
        """Wait for the passes running to end, starting none (what is owed stays owed)."""
        self.slots.owed, owed = {}, self.slots.owed
        try:
            while self._tasks:
                await asyncio.wait(list(self._tasks.values()))
        finally:
            self.slots.owed = {**owed, **self.slots.owed}

    def close(self) -> list[asyncio.Future[None]]:
        """Start nothing more and cancel the running passes (answered: their tasks)."""
        self.closed, self.slots.owed = True, {}
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        return tasks

    async def cancel(self) -> None:
        """:meth:`close`, then wait for the running passes to end."""
        tasks = self.close()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task


async def bounded(items: Iterable[T], workers: int, run: Callable[[T], Awaitable[None]],
                  stop: Callable[[], bool] = lambda: False) -> None:
    """``run(item)`` for every item in order, at most ``workers`` at once, starting none once ``stop()`` says so (the
    ones running end first). ``run`` handles its own errors; tasks are created in the items' order."""
    pending = list(items)
    running: list[asyncio.Future[None]] = []  # in the order created
    try:
        while pending or running:
            while pending and len(running) < workers and not stop():
                running.append(asyncio.ensure_future(run(pending.pop(0))))
            if not running:
                return
            await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
            for task in [t for t in running if t.done()]:
                running.remove(task)
                task.result()
            if stop():
                pending = []
    finally:
        for task in running:
            task.cancel()

__all__ = ["DEFAULT_WORKERS", "WORKERS_ENV", "PassPool", "PassSlots", "bounded", "whole_setting", "workers_override"]
