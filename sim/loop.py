"""The simulation's event loop: one thread, virtual time, seeded interleavings (ARCHITECTURE §7; model digest §8.2-4).

:class:`SimLoop` is an :class:`asyncio.BaseEventLoop` with no selector and no I/O:

- ``time()`` is virtual. When nothing is ready the loop jumps to the earliest timer; timers become
  ready in ``(time, seq)`` order, so equal times keep their scheduling order;
- when several callbacks are ready at once, the order they run in is drawn from the loop's seeded
  random source: interleavings vary by seed and replay exactly for one seed;
- ``run_in_executor``, thread-safe calls, name resolution, sockets and subprocesses raise
  :class:`SimulationRefused`;
- a loop with nothing ready and no timer raises :class:`SimDeadlock`; ``max_steps`` bounds a run.

:func:`sandbox` patches the process-wide sources of nondeterminism (wall clock, unseeded randomness,
threads, sockets, subprocesses) to raise while a simulation runs, and restores them afterwards.
:func:`run` runs one coroutine on a fresh loop inside the sandbox.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import heapq
import itertools
import os
import random
import secrets
import socket
import subprocess
import sys
import threading
import time
from asyncio import format_helpers
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, TypeVar

__all__ = [
    "EPOCH_MS", "OWNER", "SimBudgetExceeded", "SimDeadlock", "SimLoop", "SimulationRefused", "VirtualClock", "run",
    "sandbox",
]

T = TypeVar("T")

EPOCH_MS = 1_700_000_000_000
"""What virtual time 0 reads as on a :class:`VirtualClock` (milliseconds since the epoch)."""


OWNER: contextvars.ContextVar[str] = contextvars.ContextVar("sim_owner", default="")
"""The actor (a box's label) whose task runs: every task and callback a box's agent starts inherits it, so
:meth:`SimLoop.freeze` can stop the whole box (its agent, its replicators, its requests in flight) at once."""


class SimulationRefused(RuntimeError):
    """Something nondeterministic was used inside a simulation run."""


class SimDeadlock(RuntimeError):
    """Nothing is ready and no timer is pending, yet the run has not finished."""


class SimBudgetExceeded(RuntimeError):
    """The run took more loop steps than its budget."""


def _refuse(what: str) -> SimulationRefused:
    return SimulationRefused(
        f"{what} is refused in simulation mode: read time through the Clock port, draw randomness from "
        f"the seeded Random port, and do I/O through the twins"
    )


class SimLoop(asyncio.BaseEventLoop):
    """A selector-less event loop on virtual time with a seeded ready order (see the module docstring)."""

    def __init__(self, rng: random.Random, *, start: float = 0.0, max_steps: int | None = None) -> None:
        super().__init__()
        self._now = float(start)
        self._rng = rng
        self._timers: list[tuple[float, int, asyncio.TimerHandle]] = []
        self._seq = itertools.count()
        self.steps = 0
        self.run_steps = 0  # ``steps`` when ``main`` returned, before the leftover tasks were cancelled
        self.max_steps = max_steps
        self.errors: list[dict[str, Any]] = []
        self.set_exception_handler(self._record_error)
        self.frozen: set[str] = set()
        self._deferred: list[asyncio.Handle] = []

    # -- a whole box frozen (a paused VM): its callbacks wait, time moves on -------------------------

    def freeze(self, owner: str) -> None:
        """Every callback of ``owner``'s tasks waits from now on, its timers included, while virtual time moves on
        (a whole-VM pause, model 5). :meth:`thaw` runs them again, in their order."""
        self.frozen.add(owner)

    def thaw(self, owner: str) -> None:
        self.frozen.discard(owner)
        kept: list[asyncio.Handle] = []
        for handle in self._deferred:
            (kept if handle._context.get(OWNER) in self.frozen else self._ready).append(handle)  # type: ignore[attr-defined]
        self._deferred = kept

    # -- time ---------------------------------------------------------------------------------------

    def time(self) -> float:
        return self._now

    def call_at(  # type: ignore[override]
        self, when: float, callback: Callable[..., object], *args: Any, context: Any = None
    ) -> asyncio.TimerHandle:
        self._check_closed()  # type: ignore[attr-defined]
        timer = _Timer(when, callback, args, self, context) if not self._debug else asyncio.TimerHandle(  # type: ignore[attr-defined]
            when, callback, args, self, context)
        heapq.heappush(self._timers, (when, next(self._seq), timer))
        timer._scheduled = True  # type: ignore[attr-defined]
        return timer

    def call_later(  # type: ignore[override]
        self, delay: float, callback: Callable[..., object], *args: Any, context: Any = None
    ) -> asyncio.TimerHandle:
        """``BaseEventLoop.call_later`` without its extra frame (the simulation's hottest call)."""
        if delay is None:
            raise TypeError("delay must not be None")
        return self.call_at(self._now + delay, callback, *args, context=context)

    def call_soon(  # type: ignore[override]
        self, callback: Callable[..., object], *args: Any, context: Any = None
    ) -> asyncio.Handle:
        """``BaseEventLoop.call_soon`` without its extra frames when the loop is not in debug mode."""
        if self._debug:  # type: ignore[attr-defined]
            return super().call_soon(callback, *args, context=context)
        self._check_closed()  # type: ignore[attr-defined]
        handle = _Handle(callback, args, self, context)
        self._ready.append(handle)  # type: ignore[attr-defined]
        return handle

    def _timer_handle_cancelled(self, handle: asyncio.TimerHandle) -> None:
        """Cancelled timers are dropped lazily when they reach the head of the heap."""

    def pending_timers(self) -> int:
        return sum(1 for _, _, t in self._timers if not t.cancelled())

    # -- the one place callbacks run ----------------------------------------------------------------

    def _run_once(self) -> None:
        ready: Any = self._ready  # type: ignore[attr-defined]
        timers = self._timers
        if not ready and not self._stopping:  # type: ignore[attr-defined]
            while timers and timers[0][2].cancelled():
                heapq.heappop(timers)[2]._scheduled = False  # type: ignore[attr-defined]
            if not timers:
                raise SimDeadlock("nothing is ready and no timer is pending, but the run is not finished")
            if timers[0][0] > self._now:
                self._now = timers[0][0]
        while timers and timers[0][0] <= self._now:
            _, _, timer = heapq.heappop(timers)
            timer._scheduled = False  # type: ignore[attr-defined]
            if not timer.cancelled():
                ready.append(timer)
        batch = list(ready)
        ready.clear()
        if len(batch) > 1:
            self._rng.shuffle(batch)
        limit = self.max_steps
        frozen = self.frozen
        for handle in batch:
            if handle._cancelled:
                continue
            if frozen and handle._context.get(OWNER) in frozen:
                self._deferred.append(handle)
                continue
            self.steps += 1
            if limit is not None and self.steps > limit:
                raise SimBudgetExceeded(f"the run exceeded its budget of {self.max_steps} loop steps")
            try:  # ``Handle._run``, inline (one frame less a step)
                handle._context.run(handle._callback, *handle._args)
            except (SystemExit, KeyboardInterrupt):
                raise
            except BaseException as exc:
                _report(handle, exc)

    def _record_error(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        self.errors.append(context)

    # -- refused in simulation mode -----------------------------------------------------------------

    def run_in_executor(self, executor: Any, func: Callable[..., T], *args: Any) -> asyncio.Future[T]:  # type: ignore[override]
        raise _refuse("run_in_executor (a thread)")

    def set_default_executor(self, executor: Any) -> None:
        raise _refuse("an executor (threads)")

    def call_soon_threadsafe(self, callback: Callable[..., object], *args: Any, context: Any = None) -> asyncio.Handle:  # type: ignore[override]
        raise _refuse("call_soon_threadsafe (another thread)")

    async def getaddrinfo(self, *args: Any, **kwargs: Any) -> Any:
        raise _refuse("name resolution")

    async def getnameinfo(self, *args: Any, **kwargs: Any) -> Any:
        raise _refuse("name resolution")

    async def create_connection(self, *args: Any, **kwargs: Any) -> Any:
        raise _refuse("a network connection")

    async def create_server(self, *args: Any, **kwargs: Any) -> Any:
        raise _refuse("a network server")

    async def create_datagram_endpoint(self, *args: Any, **kwargs: Any) -> Any:
        raise _refuse("a network endpoint")

    async def create_unix_connection(self, *args: Any, **kwargs: Any) -> Any:
        raise _refuse("a socket connection")

    async def create_unix_server(self, *args: Any, **kwargs: Any) -> Any:
        raise _refuse("a socket server")

    async def sock_connect(self, *args: Any, **kwargs: Any) -> Any:
        raise _refuse("a socket")

    async def sock_recv(self, *args: Any, **kwargs: Any) -> Any:
        raise _refuse("a socket")

    async def sock_sendall(self, *args: Any, **kwargs: Any) -> Any:
        raise _refuse("a socket")

    async def sock_accept(self, *args: Any, **kwargs: Any) -> Any:
        raise _refuse("a socket")

    async def subprocess_exec(self, *args: Any, **kwargs: Any) -> Any:
        raise _refuse("a subprocess")

    async def subprocess_shell(self, *args: Any, **kwargs: Any) -> Any:
        raise _refuse("a subprocess")

    def add_reader(self, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        raise _refuse("file-descriptor I/O")

    def add_writer(self, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        raise _refuse("file-descriptor I/O")

    def add_signal_handler(self, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        raise _refuse("a signal handler")

    def _write_to_self(self) -> None:
        raise _refuse("waking the loop from another thread")

    def _process_events(self, event_list: Any) -> None:  # no selector: nothing to process
        pass


class _Handle(asyncio.Handle):
    """``asyncio.Handle`` as its ``__init__`` builds it outside debug mode, without its two extra calls."""

    __slots__ = ()

    def __init__(self, callback: Callable[..., object], args: tuple[Any, ...], loop: asyncio.AbstractEventLoop,
                 context: Any = None) -> None:
        self._context = context if context is not None else contextvars.copy_context()
        self._loop = loop
        self._callback = callback
        self._args = args
        self._cancelled = False
        self._repr = None
        self._source_traceback = None


class _Timer(asyncio.TimerHandle):
    """``asyncio.TimerHandle`` as its ``__init__`` builds it outside debug mode, without its three extra calls."""

    __slots__ = ()

    def __init__(self, when: float, callback: Callable[..., object], args: tuple[Any, ...],
                 loop: asyncio.AbstractEventLoop, context: Any = None) -> None:
        self._context = context if context is not None else contextvars.copy_context()
        self._loop = loop
        self._callback = callback
        self._args = args
        self._cancelled = False
        self._repr = None
        self._source_traceback = None
        self._when = when
        self._scheduled = False


def _report(handle: asyncio.Handle, exc: BaseException) -> None:
    """What ``Handle._run`` reports for a callback that raised."""
    h: Any = handle
    context: dict[str, Any] = {
        "message": f"Exception in callback {format_helpers._format_callback_source(h._callback, h._args)}",
        "exception": exc,
        "handle": handle,
    }
    if h._source_traceback:
        context["source_traceback"] = h._source_traceback
    h._loop.call_exception_handler(context)


class VirtualClock:
    """The Clock port on a :class:`SimLoop`'s virtual time, optionally skewed (spec §7.3 skew)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, *, epoch_ms: int = EPOCH_MS, skew_ms: int = 0) -> None:
        self.loop = loop
        self.epoch_ms = epoch_ms
        self.skew_ms = skew_ms

    def now_ms(self) -> int:
        return self.epoch_ms + round(self.loop.time() * 1000) + self.skew_ms

    def monotonic(self) -> float:
        return self.loop.time()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)

    def skewed(self, skew_ms: int) -> VirtualClock:
        return VirtualClock(self.loop, epoch_ms=self.epoch_ms, skew_ms=skew_ms)


# -- the sandbox ----------------------------------------------------------------------------------

_ALLOWED_CALLERS = frozenset({"logging"})
"""Modules that may still read the wall clock: a log record's timestamp never reaches a decision or
the trace."""

_ALLOWED: dict[str, frozenset[str]] = {
    "threading.Thread.start (a thread)": frozenset({"services.box.artifacts.archive"}),
    "time.monotonic (the wall clock)": frozenset({"services.box.replica.wal"}),
    "time.sleep (the wall clock)": frozenset({"services.box.replica.wal"}),
}
"""Narrow exceptions, each inside one blocking call that the port runs inline: the archive's pipeline stages are
threads joined before the call returns, each applying its steps in order, so the result does not depend on their
scheduling; the WAL-index header read spins with a wall-clock deadline only while another process is committing,
which never happens in a single-threaded run."""


def _refuser(what: str, original: Callable[..., Any]) -> Callable[..., Any]:
    allowed = _ALLOWED_CALLERS | _ALLOWED.get(what, frozenset())

    def refused(*args: Any, **kwargs: Any) -> Any:
        if sys._getframe(1).f_globals.get("__name__") in allowed:
            return original(*args, **kwargs)
        raise _refuse(what)

    refused.__name__ = getattr(original, "__name__", "refused")
    return refused


class _RefusedSocket(socket.socket):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise _refuse("a real socket")


def _patches() -> list[tuple[Any, str, Any]]:
    out: list[tuple[Any, str, Any]] = []
    for name in ("time", "time_ns", "monotonic", "monotonic_ns", "perf_counter", "perf_counter_ns", "sleep"):
        out.append((time, name, _refuser(f"time.{name} (the wall clock)", getattr(time, name))))
    for name in ("random", "randint", "randrange", "choice", "choices", "shuffle", "sample", "uniform",
                 "getrandbits", "randbytes", "gauss", "expovariate", "triangular", "betavariate"):
        out.append((random, name, _refuser(f"random.{name} (unseeded randomness)", getattr(random, name))))
    for name in ("random", "getrandbits", "randbytes"):
        out.append((random.SystemRandom, name,
                    _refuser(f"SystemRandom.{name} (unseeded randomness)", getattr(random.SystemRandom, name))))
    out.append((os, "urandom", _refuser("os.urandom (unseeded randomness)", os.urandom)))
    for name in ("token_bytes", "token_hex", "token_urlsafe", "randbelow", "choice"):
        out.append((secrets, name, _refuser(f"secrets.{name} (unseeded randomness)", getattr(secrets, name))))
    out.append((threading.Thread, "start", _refuser("threading.Thread.start (a thread)", threading.Thread.start)))
    out.append((socket, "socket", _RefusedSocket))
    for name in ("create_connection", "getaddrinfo", "socketpair"):
        out.append((socket, name, _refuser(f"socket.{name} (real networking)", getattr(socket, name))))
    out.append((subprocess.Popen, "__init__", _refuser("subprocess.Popen (a real process)", subprocess.Popen.__init__)))
    return out


@contextlib.contextmanager
def sandbox() -> Iterator[None]:
    """Refuse wall-clock time, unseeded randomness, threads, sockets and subprocesses inside the block."""
    saved: list[tuple[Any, str, Any]] = []
    try:
        for owner, name, replacement in _patches():
            saved.append((owner, name, owner.__dict__[name] if name in owner.__dict__ else getattr(owner, name)))
            setattr(owner, name, replacement)
        yield
    finally:
        for owner, name, original in reversed(saved):
            setattr(owner, name, original)


def run(main: Coroutine[Any, Any, T], *, seed: int | str, max_steps: int | None = None) -> tuple[T, SimLoop]:
    """Run ``main`` to completion on a fresh :class:`SimLoop` inside the :func:`sandbox`.

    The loop's ready order is drawn from ``seed``. Tasks still pending when ``main`` returns are
    cancelled. Must not be called while another event loop is running in this thread.
    """
    loop = SimLoop(random.Random(f"loop:{seed}"), max_steps=max_steps)
    try:
        with sandbox():
            try:
                result = loop.run_until_complete(main)
            finally:
                loop.run_steps = loop.steps  # the run's own steps; the cleanup's below depend on task set order
                _cancel_rest(loop)
    finally:
        loop.close()
    return result, loop


def _cancel_rest(loop: SimLoop, rounds: int = 20, budget: int = 20_000) -> None:
    """Cancel what is still pending, again while something swallows its cancellation (bounded)."""
    for _ in range(rounds):
        pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
        if not pending:
            return
        for task in pending:
            task.cancel()
        loop.max_steps = loop.steps + budget
        with contextlib.suppress(SimDeadlock, SimBudgetExceeded, asyncio.CancelledError):
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
