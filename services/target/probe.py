"""The landing probe (spec §7.7; R12-2; INV-19; ``TestProbeWindow``, rev 7.13).

One **attempt** is one admission of the app: starts under the retry policy (§5.1 step 9: five
starts, the waits doubling from 1 s, 15 s in all) inside the attempt's **readiness window** (30 s),
which runs from the attempt's first start. Then a **settle** (20 s), the process still running, and
a second request. The deadline ``first start + window`` is checked **before each start** and
**before readiness is accepted**: an attempt whose window passed does not start the app at all, and
an app that answers at or after the deadline is stopped and the attempt fails. At most
``min(3, T11's admitted attempts)`` attempts; the absolute ``hard_deadline_ms`` (the cut deadline,
§7.4) bounds the whole. A probe never marks the host failed: its failure is the landing's rollback.

Every start is the box's **strict spawn** (§5.3 "Every spawn under a move is strict": the target's probe):
:class:`ProcessApp` starts through :meth:`~services.box.instance.proctree.ProcessTree.spawn_strict` into the host's leaf
and stops by killing and draining that leaf, so a forked worker that outlives the main process goes too. A
refused strict spawn (no cgroup v2, a populated leaf) raises :class:`~services.box.instance.proctree.StrictRefused`
from ``start``: the attempt fails at once with the box's reason (``strict_refused``) and no further attempt is
made, since retrying cannot contain the app.

Time is read only through the :class:`~kernel.ports.Clock` port; durations come from a
:class:`ProbeTiming` profile (``PRODUCTION`` = the spec's, ``FAST`` for tests and the demo).
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol

from kernel.ports import Clock, blocking, http_status
from services.box.instance.proctree import ProcessTree, Spawned, StrictRefused
from services.box.instance.sandbox import hand_over, instance_env, user_for
from services.target.budget import MAX_ATTEMPTS

FailReason = Literal[
    "window_passed_before_start",  # the deadline was reached before a (re)start: nothing started
    "deadline_unready",  # the deadline was reached while the started app had not answered
    "ready_after_deadline",  # the app answered at or after the deadline: stopped
    "starts_exhausted",  # the policy's fifth failed start
    "settle_exited",  # the process died during the settle
    "second_request_failed",  # the request after the settle did not answer 200-399
    "cut_deadline",  # the absolute cut deadline would be passed
    "strict_refused",  # the box refused to spawn the app strictly (§5.3): nothing started
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
    """One admitted instance the probe drives (a real process in production), answering on ``port``."""

    @property
    def port(self) -> int: ...

    async def start(self) -> bool:
        """Spawn it; False when the start failed at once (the policy retries). Raises
        :class:`~services.box.instance.proctree.StrictRefused` when the box refuses the strict spawn (§5.3):
        nothing ran."""
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
    detail: str = ""
    """The box's own words for a ``strict_refused`` attempt."""
    timing: ProbeTiming = PRODUCTION
    """The profile the attempt ran under: its sentence names the window and the settle it really had."""

    def describe(self) -> str:
        if self.ok:
            return "the probe passed"
        if self.reason == "strict_refused":
            return f"the box refused to start the app outside its cgroup: {self.detail}"
        window, settle = f"{self.timing.window_s:g} s", f"{self.timing.settle_s:g} s"
        return {
            "window_passed_before_start": f"the {window} readiness window ended before the app could be started "
                                          "again",
            "deadline_unready": f"the app did not answer its readiness path within the {window} window",
            "ready_after_deadline": f"the app answered its readiness path only after the {window} window had ended",
            "starts_exhausted": f"the app failed to start {self.timing.max_starts} times",
            "settle_exited": f"the app exited during the {settle} settle",
            "second_request_failed": "the app stopped answering its readiness path after the settle",
            "cut_deadline": "the cut deadline would pass before the probe could finish",
            "strict_refused": "the box refused to start the app outside its cgroup",
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

    def fail(reason: FailReason, ready_at: int | None = None, detail: str = "") -> AttemptResult:
        return AttemptResult(False, reason, first, deadline, ready_at, starts, detail, timing)

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
        try:
            started = await app.start()
        except StrictRefused as exc:
            return fail("strict_refused", detail=str(exc))
        if started:
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
        return AttemptResult(False, "cut_deadline", first, deadline, ready_at, starts, timing=timing)
    await clock.sleep(timing.settle_s)
    if not await app.running():
        await app.stop()
        return AttemptResult(False, "settle_exited", first, deadline, ready_at, starts, timing=timing)
    if not await app.ready():
        await app.stop()
        return AttemptResult(False, "second_request_failed", first, deadline, ready_at, starts, timing=timing)
    return AttemptResult(True, None, first, deadline, ready_at, starts, timing=timing)


async def run_probe(
    new_attempt: Callable[[int], Awaitable[ProbeApp]],
    clock: Clock,
    timing: ProbeTiming,
    *,
    t11_admitted: int,
    hard_deadline_ms: int | None = None,
) -> tuple[ProbeResult, ProbeApp | None]:
    """Up to :func:`allowed_attempts` attempts; ``new_attempt(i)`` admits attempt ``i`` (1-based; each a
    cold admission, §7.14). Answers the result and, on a pass, the running app (the probed writer). A refused
    strict spawn ends the probe: another attempt would be refused the same way (§5.3)."""
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
        if result.reason == "strict_refused":
            break
    return ProbeResult(False, tuple(results)), None


class ProbeStopUnproven(RuntimeError):
    """A probe's process group did not drain after ``cgroup.kill``: the app is not proven stopped (§5.3 step 1)."""


@dataclass
class ProcessApp:
    """A probe's app: a real OS process answering HTTP on ``127.0.0.1:port``, strictly spawned into ``host``'s
    cgroup leaf of the box's ``tree`` (§5.3 "Every spawn under a move is strict", the target's probe; §7.7).

    ``start`` is the box's own strict spawn (the shim places the process before the app executes, so the app and
    everything it forks run in the leaf from their first instruction); a refusal raises
    :class:`~services.box.instance.proctree.StrictRefused`. ``stop`` writes ``cgroup.kill`` and waits for
    ``populated 0`` (``KillAndEmpty``), so a forked worker that outlives the main process is gone too; a group
    that does not drain raises :class:`ProbeStopUnproven`. ``CARLOS_MOVE_PROBE=1`` is set (advisory, §7.7). The
    app's output goes to ``logs/<host>.probe.out`` and ``.err`` when ``logs`` is given, else nowhere.
    """

    argv: Sequence[str]
    port: int
    host: str
    tree: ProcessTree
    ready_path: str = "/"
    env: Mapping[str, str] = field(default_factory=dict)
    cwd: Path | None = None
    logs: Path | None = None
    data_dir: Path | None = None
    """The instance's directory holding the probe's database: handed to the host's instance user before the
    spawn (:func:`services.box.instance.sandbox.hand_over`, issue 14 item 4)."""
    request_timeout_s: float = 2.0
    drain_within_s: float = 10.0
    spawned: Spawned | None = None

    async def start(self) -> bool:
        home = self.data_dir / self.host if self.data_dir is not None else Path("/nonexistent")
        env = instance_env({**self.env, "CARLOS_MOVE_PROBE": "1"}, home=home)  # never the agent's environment
        out: Path | str = os.devnull
        err: Path | str = os.devnull
        if self.logs is not None:
            self.logs.mkdir(parents=True, exist_ok=True)
            out, err = self.logs / f"{self.host}.probe.out", self.logs / f"{self.host}.probe.err"
        try:
            if self.data_dir is not None:  # its files become the instance user's (SandboxError is an OSError)
                await blocking(hand_over, user_for(self.tree, self.host), self.data_dir, self.host)
            self.spawned = await blocking(
                self.tree.spawn_strict, self.host, list(self.argv), env=env,
                cwd=self.cwd or self.data_dir or os.getcwd(),
                stdout=out, stderr=err,
            )
        except OSError:  # the program is missing or could not be executed: nothing runs, the policy retries
            return False
        return True

    async def running(self) -> bool:
        return self.spawned is not None and self.spawned.process.poll() is None

    async def ready(self) -> bool:
        status = await http_status(f"http://127.0.0.1:{self.port}{self.ready_path}", self.request_timeout_s)
        return status is not None and 200 <= status <= 399  # the box-local network port (ARCHITECTURE §7)

    async def stop(self) -> None:
        spawned, self.spawned = self.spawned, None
        if spawned is not None:
            drain = await self.tree.kill_and_drain(self.host, within_s=self.drain_within_s)
            if not drain.drained:
                raise ProbeStopUnproven(
                    f"the probe of host {self.host} did not stop: its cgroup {drain.leaf} still holds "
                    f"{list(drain.remaining) or 'unknown processes'} after {drain.waited_ms} ms"
                    + (f" ({drain.error})" if drain.error else "")
                )
            await blocking(spawned.process.wait, 10)  # dead already: only reaps it
