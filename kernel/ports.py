"""Ports for time, randomness and blocking work (ARCHITECTURE §7).

Every service reads the time and draws randomness through these, so a deterministic simulation
can drive the real code on a virtual clock with one seed. Blocking work (SQLite, hashing, archives,
file I/O) goes through :func:`blocking`: a worker thread in production, inline inside a simulation
run (:func:`inline_blocking`), where threads are refused and one thread keeps the run replayable.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import os
import random
import secrets
import socket
import time
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, ParamSpec, Protocol, TypeVar

if TYPE_CHECKING:
    import aiohttp

P = ParamSpec("P")
T = TypeVar("T")

_INLINE: contextvars.ContextVar[bool] = contextvars.ContextVar("hostmove_blocking_inline", default=False)
_SEEDED: contextvars.ContextVar[Random | None] = contextvars.ContextVar("hostmove_seeded_random", default=None)
_NET: contextvars.ContextVar[LocalNet | None] = contextvars.ContextVar("hostmove_local_net", default=None)


async def blocking(fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
    """Run the blocking ``fn(*args, **kwargs)`` off the event loop (``asyncio.to_thread``), or in the caller's
    thread while :func:`inline_blocking` is in force (the simulation: no threads, ARCHITECTURE §7)."""
    if _INLINE.get():
        return fn(*args, **kwargs)
    return await asyncio.to_thread(fn, *args, **kwargs)


def blocking_inline() -> bool:
    """Whether blocking work runs inline here (callers that would start threads of their own run single-threaded)."""
    return _INLINE.get()


@contextlib.contextmanager
def inline_blocking() -> Iterator[None]:
    """Run :func:`blocking` work inline for the tasks created inside the block (they copy this context)."""
    token = _INLINE.set(True)
    try:
        yield
    finally:
        _INLINE.reset(token)


@contextlib.contextmanager
def simulation(rng: Random, net: LocalNet) -> Iterator[None]:
    """The simulation's ports for the tasks created inside the block: blocking work inline, ``SystemRandom``
    drawn from the run's seeded ``rng``, and the box-local network answered by ``net`` (ARCHITECTURE §7)."""
    tokens = (_INLINE.set(True), _SEEDED.set(rng), _NET.set(net))
    try:
        yield
    finally:
        _NET.reset(tokens[2])
        _SEEDED.reset(tokens[1])
        _INLINE.reset(tokens[0])


def free_port() -> int:
    """A free local TCP port for an instance's next start (the simulation's twin inside :func:`simulation`)."""
    net = _NET.get()
    if net is not None:
        return net.free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def http_status(url: str, timeout_s: float) -> int | None:
    """One GET of a box-local ``url``, redirects not followed: its status, or None when nothing answered within
    ``timeout_s`` (the simulation's twin inside :func:`simulation`)."""
    net = _NET.get()
    if net is not None:
        return await net.get_status(url, timeout_s)
    import aiohttp  # only the production path needs it

    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session, \
                session.get(url, allow_redirects=False) as resp:
            return resp.status
    except (TimeoutError, aiohttp.ClientError, OSError):
        return None


async def http_post_json(url: str, body: Mapping[str, Any], timeout_s: float,
                         session: aiohttp.ClientSession | None = None) -> int | None:
    """One POST of a JSON body to a box-local ``url`` (a timer delivery, §9.4): its status, or None when nothing
    answered within ``timeout_s`` (the simulation's twin inside :func:`simulation`). ``session``: reuse its pool."""
    net = _NET.get()
    if net is not None:
        return await net.post_json(url, body, timeout_s)
    import aiohttp  # only the production path needs it

    try:
        async with contextlib.AsyncExitStack() as stack:
            if session is None:
                session = await stack.enter_async_context(aiohttp.ClientSession())
            async with session.post(url, json=dict(body), timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
                await resp.read()
                return resp.status
    except (TimeoutError, aiohttp.ClientError, OSError):
        return None


def simulated() -> bool:
    """Inside :func:`simulation`: the box-local network is the simulation's twin (no sockets)."""
    return _NET.get() is not None


class Clock(Protocol):
    def now_ms(self) -> int:
        """Milliseconds since the epoch."""
        ...

    def monotonic(self) -> float: ...

    async def sleep(self, seconds: float) -> None: ...


class Random(Protocol):
    def token_bytes(self, n: int) -> bytes: ...

    def random(self) -> float: ...


class LocalNet(Protocol):
    """The box-local network an agent uses to reach its own instances: a free port for the next start, and one
    HTTP GET's status (None: no answer). Real sockets in production; the simulation's twin answers in-process."""

    def free_port(self) -> int: ...

    async def get_status(self, url: str, timeout_s: float) -> int | None: ...

    async def post_json(self, url: str, body: Mapping[str, Any], timeout_s: float) -> int | None: ...


class WallClock:
    def now_ms(self) -> int:
        return time.time_ns() // 1_000_000

    def monotonic(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


class SystemRandom:
    """The operating system's randomness; inside :func:`simulation`, the run's seeded source instead."""

    def token_bytes(self, n: int) -> bytes:
        seeded = _SEEDED.get()
        return seeded.token_bytes(n) if seeded is not None else secrets.token_bytes(n)

    def random(self) -> float:
        seeded = _SEEDED.get()
        return seeded.random() if seeded is not None else secrets.SystemRandom().random()


class SeededRandom:
    """Deterministic randomness from one seed (tests and the simulation)."""

    def __init__(self, seed: int) -> None:
        self._rng = random.Random(seed)

    def token_bytes(self, n: int) -> bytes:
        return self._rng.randbytes(n)

    def random(self) -> float:
        return self._rng.random()


class ManualClock:
    """A clock that moves only when told (tests and the simulation)."""

    def __init__(self, start_ms: int = 1_700_000_000_000) -> None:
        self._ms = start_ms

    def now_ms(self) -> int:
        return self._ms

    def monotonic(self) -> float:
        return self._ms / 1000.0

    def advance(self, ms: int) -> None:
        self._ms += ms

    async def sleep(self, seconds: float) -> None:
        self._ms += int(seconds * 1000)
        await asyncio.sleep(0)


def process_nonce(rng: Random) -> str:
    """A per-process nonce for the actor of an event."""
    return rng.token_bytes(8).hex()


def pid() -> int:
    return os.getpid()
