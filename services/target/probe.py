"""The landing probe (spec §7.7; R12-2; INV-19; ``TestProbeWindow``, rev 7.13).

One **attempt** is one admission of the app: starts under the retry policy (§5.1 step 9: five
starts, the waits doubling from 1 s, 15 s in all) inside the attempt's **readiness window** (30 s),
which runs from the attempt's first start. Then a **settle** (20 s), the process still running, and
a second request. The deadline ``first start + window`` is checked **before each start** and
**before readiness is accepted**: an attempt whose window passed does not start the app at all, and
an app that answers at or after the deadline is stopped and the attempt fails. At most
``min(3, T11's admitted attempts)`` attempts; the absolute ``hard_deadline_ms`` (the cut deadline,
§7.4) bounds the whole. A probe never marks the host failed: its failure is the landing's rollback.

Time is read only through the :class:`~hostmove.ports.Clock` port; durations come from a
:class:`ProbeTiming` profile (``PRODUCTION`` = the spec's, ``FAST`` for tests and the demo).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol

import aiohttp

from hostmove.ports import Clock
from services.target.budget import MAX_ATTEMPTS

FailReason = Literal[
    "window_passed_before_start",  # the deadline was reached before a (re)start: nothing started
    "deadline_unready",  # the deadline was reached while the started app had not answered
    "ready_after_deadline",  # the app answered at or after the deadline: stopped
    "starts_exhausted",  # the policy's fifth failed start
    "settle_exited",  # the process died during the settle
    "second_request_failed",  # the request after the settle did not answer 200-399
    "cut_deadline",  # the absolute cut deadline would be passed
]


@dataclass(frozen=True)
class ProbeTiming:
    """A timing profile for the probe (ARCHITECTURE §7)."""

    window_s: float = 30.0
    settle_s: float = 20.0
    max_starts: int = 5
    first_backoff_s: float = 1.0
    backoff_factor: float = 2.0
    poll_s: float = 0.25
    request_timeout_s: float = 2.0


PRODUCTION = ProbeTiming()
FAST = ProbeTiming(window_s=6.0, settle_s=0.3, first_backoff_s=0.05, poll_s=0.05, request_timeout_s=1.0)


class ProbeApp(Protocol):
    """One admitted instance the probe drives (a real process in production)."""

    async def start(self) -> bool:
        """Spawn it; False when the start failed at once (the policy retries)."""
        ...

    async def running(self) -> bool: ...

    async def ready(self) -> bool:
        """One readiness request: True iff it answered 200 to 399 from the spawned tree."""
        ...

    async def stop(self) -> None: ...


@dataclass(frozen=True)
class AttemptResult:
    ok: bool
    reason: FailReason | None
    first_start_ms: int | None
    deadline_ms: int | None
    ready_at_ms: int | None
    starts: int

    def describe(self) -> str:
        if self.ok:
            return "the probe passed"
        return {
            "window_passed_before_start": "the 30 s readiness window ended before the app could be started again",
            "deadline_unready": "the app did not answer its readiness path within the 30 s window",
            "ready_after_deadline": "the app answered its readiness path only after the 30 s window had ended",
            "starts_exhausted": "the app failed to start five times",
            "settle_exited": "the app exited during the 20 s settle",
            "second_request_failed": "the app stopped answering its readiness path after the settle",
            "cut_deadline": "the cut deadline would pass before the probe could finish",
            None: "the probe failed",
        }[self.reason]


@dataclass(frozen=True)
class ProbeResult:
    ok: bool
    attempts: tuple[AttemptResult, ...]

    def describe(self) -> str:
        if self.ok:
            return "the probe passed"
        last = self.attempts[-1].describe() if self.attempts else "no attempt was allowed"
        return f"the landing probe failed after {len(self.attempts)} attempt(s): {last}"


def allowed_attempts(t11_admitted: int) -> int:
    """At most three, and never more than T11 admitted (§7.3, R3-7)."""
    return max(0, min(MAX_ATTEMPTS, t11_admitted))


async def probe_attempt(
    app: ProbeApp, clock: Clock, timing: ProbeTiming, *, hard_deadline_ms: int | None = None
) -> AttemptResult:
    """One attempt of §7.7 with the deadline checked before each start and before acceptance (R12-2)."""
    first: int | None = None
    deadline: int | None = None
    starts = 0
    wait = timing.first_backoff_s

    def fail(reason: FailReason, ready_at: int | None = None) -> AttemptResult:
        return AttemptResult(False, reason, first, deadline, ready_at, starts)

    while starts < timing.max_starts:
        now = clock.now_ms()
        if deadline is not None and now >= deadline:
            return fail("window_passed_before_start")
        if hard_deadline_ms is not None and now >= hard_deadline_ms:
            return fail("cut_deadline")
        if first is None:
            first = now
            deadline = first + round(timing.window_s * 1000)
        assert deadline is not None
        starts += 1
        if await app.start():
            while True:
                now = clock.now_ms()
                if now >= deadline:
                    await app.stop()
                    return fail("deadline_unready")
                if not await app.running():
                    break
                if await app.ready():
                    at = clock.now_ms()
                    if at >= deadline or (hard_deadline_ms is not None and at >= hard_deadline_ms):
                        await app.stop()
                        return fail("ready_after_deadline", at)
                    return await _settle(app, clock, timing, first, deadline, at, starts, hard_deadline_ms)
                await clock.sleep(timing.poll_s)
            await app.stop()
        if starts < timing.max_starts:
            await clock.sleep(wait)
            wait *= timing.backoff_factor
    return fail("starts_exhausted")


async def _settle(
    app: ProbeApp, clock: Clock, timing: ProbeTiming, first: int, deadline: int, ready_at: int, starts: int,
    hard_deadline_ms: int | None,
) -> AttemptResult:
    if hard_deadline_ms is not None and clock.now_ms() + round(timing.settle_s * 1000) > hard_deadline_ms:
        await app.stop()
        return AttemptResult(False, "cut_deadline", first, deadline, ready_at, starts)
    await clock.sleep(timing.settle_s)
    if not await app.running():
        await app.stop()
        return AttemptResult(False, "settle_exited", first, deadline, ready_at, starts)
    if not await app.ready():
        await app.stop()
        return AttemptResult(False, "second_request_failed", first, deadline, ready_at, starts)
    return AttemptResult(True, None, first, deadline, ready_at, starts)


async def run_probe(
    new_attempt: Callable[[int], Awaitable[ProbeApp]],
    clock: Clock,
    timing: ProbeTiming,
    *,
    t11_admitted: int,
    hard_deadline_ms: int | None = None,
) -> tuple[ProbeResult, ProbeApp | None]:
    """Up to :func:`allowed_attempts` attempts; ``new_attempt(i)`` admits attempt ``i`` (1-based; each a
    cold admission, §7.14). Answers the result and, on a pass, the running app (the probed writer)."""
    results: list[AttemptResult] = []
    for i in range(1, allowed_attempts(t11_admitted) + 1):
        if hard_deadline_ms is not None and clock.now_ms() >= hard_deadline_ms:
            break
        app = await new_attempt(i)
        result = await probe_attempt(app, clock, timing, hard_deadline_ms=hard_deadline_ms)
        results.append(result)
        if result.ok:
            return ProbeResult(True, tuple(results)), app
        await app.stop()
    return ProbeResult(False, tuple(results)), None


@dataclass
class ProcessApp:
    """A real OS process answering HTTP on ``127.0.0.1:port`` (a probe's app; the strict cgroup spawn of
    §5.3 is the activator's and is not done here). ``CARLOS_MOVE_PROBE=1`` is set (advisory, §7.7)."""

    argv: Sequence[str]
    port: int
    ready_path: str = "/"
    env: Mapping[str, str] = field(default_factory=dict)
    cwd: Path | None = None
    request_timeout_s: float = 2.0
    proc: asyncio.subprocess.Process | None = None
    _session: aiohttp.ClientSession | None = None

    async def start(self) -> bool:
        env = {**os.environ, **self.env, "CARLOS_MOVE_PROBE": "1"}
        try:
            self.proc = await asyncio.create_subprocess_exec(
                *self.argv, env=env, cwd=self.cwd, stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL, start_new_session=True,
            )
        except OSError:
            return False
        return True

    async def running(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    async def ready(self) -> bool:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.request_timeout_s))
        try:
            async with self._session.get(f"http://127.0.0.1:{self.port}{self.ready_path}") as resp:
                return 200 <= resp.status <= 399
        except (TimeoutError, aiohttp.ClientError):
            return False

    async def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, 9)
            await proc.wait()
        if self._session is not None:
            await self._session.close()
            self._session = None
