"""Ports for time and randomness (ARCHITECTURE §7).

Every service reads the time and draws randomness through these, so a deterministic simulation
can drive the real code on a virtual clock with one seed.
"""

from __future__ import annotations

import asyncio
import os
import random
import secrets
import time
from typing import Protocol


class Clock(Protocol):
    def now_ms(self) -> int:
        """Milliseconds since the epoch."""
        ...

    def monotonic(self) -> float: ...

    async def sleep(self, seconds: float) -> None: ...


class Random(Protocol):
    def token_bytes(self, n: int) -> bytes: ...

    def random(self) -> float: ...


class WallClock:
    def now_ms(self) -> int:
        return time.time_ns() // 1_000_000

    def monotonic(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


class SystemRandom:
    def token_bytes(self, n: int) -> bytes:
        return secrets.token_bytes(n)

    def random(self) -> float:
        return secrets.SystemRandom().random()


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
