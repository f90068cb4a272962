"""One seed, end to end (model digest §1, §8.9): a chaos phase, a calm phase that must reach quiescence,
the final oracle, and a :class:`Result` with the trace hash.

``run_seed(seed)`` is deterministic: the same seed (and the same mutations) gives the same trace and
the same hash, in any process (nothing in a run depends on ``PYTHONHASHSEED``, object ids or the wall
clock, which the sandbox refuses).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass, field

from kernel import rules
from sim.faults import FaultPlan, Timing
from sim.invariants import Violation
from sim.loop import SimBudgetExceeded, SimDeadlock, SimulationRefused, run
from sim.workload import Workload, draw_workload
from sim.world import REGIONS, MilestoneMissed, World

__all__ = ["DEFAULT_TIMING", "MAX_STEPS", "Result", "drive", "run_seed"]

DEFAULT_TIMING = Timing()
MAX_STEPS = 400_000
HARNESS_ERRORS = (SimDeadlock, SimBudgetExceeded, SimulationRefused)


@dataclass(frozen=True)
class Result:
    seed: int | str
    violations: tuple[Violation, ...]
    trace_hash: str
    steps: int
    trace: tuple[str, ...] = ()
    counters: dict[str, int] = field(default_factory=dict)
    consulted: dict[str, int] = field(default_factory=dict)
    error: str | None = None  # the harness failed (deadlock, budget, a refused call): never a detection
    cpu_s: float = 0.0
    """The CPU time the run cost its process (set by the gate's workers, outside the run: never in the trace)."""

    @property
    def violated(self) -> bool:
        return bool(self.violations)

    def report(self) -> list[str]:
        """``VIOLATION seed=<n> <invariant>: <what>`` lines, then ``COUNTERS {json}``."""
        out = [v.line() for v in self.violations]
        if self.error:
            out.append(f"ERROR seed={self.seed}: {self.error}")
        out.append("COUNTERS " + json.dumps(self.counters, sort_keys=True))
        return out


Script = Callable[[World], Awaitable[None]]


async def drive(world: World, script: Script | None) -> None:
    """Random run (``script`` None): chaos for ``chaos_s`` then the calm phase. Witness: the script,
    then the calm phase. Either way the run ends at quiescence (then the final oracle) or at the first
    violation."""
    stop = asyncio.Event()
    world.checker.on_violation = lambda _v: stop.set()
    await world.setup()

    async def phases() -> None:
        if script is None:
            world.run_actors()
            await asyncio.sleep(world.timing.chaos_s)
        else:
            try:
                await script(world)
            except MilestoneMissed as exc:
                world.checker.flag("INV-3", str(exc))
            except Exception as exc:  # noqa: BLE001 - a broken script is a harness error, not a detection
                world.harness_error = f"the witness script failed: {type(exc).__name__}: {exc}"
                return
            if world.checker.violations:
                return
        unmet = await world.settle()
        if unmet:
            world.checker.flag("INV-3", f"no quiescence {world.timing.calm_s / 3600:g} h into the calm phase: "
                                        + "; ".join(unmet[:4]))
        elif not world.checker.violations:
            await world.final_oracle()

    task = asyncio.ensure_future(phases())
    waiter = asyncio.ensure_future(stop.wait())
    await asyncio.wait([task, waiter], return_when=asyncio.FIRST_COMPLETED)
    world.stop()
    waiter.cancel()
    task.cancel()
    if task.done() and not task.cancelled() and task.exception() is not None:
        exc = task.exception()
        world.harness_error = f"{type(exc).__name__}: {exc}"


def execute(
    seed: int | str,
    make: Callable[[asyncio.AbstractEventLoop], World],
    script: Script | None,
    *,
    trace: bool,
    mutate: Iterable[str],
    max_steps: int = MAX_STEPS,
) -> Result:
    """Run one world to its verdict under ``mutate`` (rules switched off)."""
    holder: list[World] = []
    ended_at: list[float] = []
    error: str | None = None
    rules.reset_consulted()

    async def main() -> None:
        world = make(asyncio.get_running_loop())
        holder.append(world)
        with world.ports():
            await drive(world, script)
        ended_at.append(world.loop.time())

    with rules.mutated(mutate), _logs_into(holder):
        try:
            _, loop = run(main(), seed=seed, max_steps=max_steps)
            steps = loop.run_steps
            if loop.errors:
                error = "the event loop reported: " + str(loop.errors[0].get("message"))
        except HARNESS_ERRORS as exc:
            error = f"{type(exc).__name__}: {exc}"
            steps = -1
    if not holder:
        return Result(seed, (), "", steps, error=error or "the world was never built")
    world = holder[0]
    world.cleanup()
    error = error or world.harness_error
    violations = tuple(world.checker.violations)
    counters = {
        "steps": steps,
        "s3_requests": next(world.s3._ids) - 1,
        "stream_messages": sum(len(world.js.messages(s)) for s in list(world.js._streams)),
        "admissions": sum(1 for line in world.trace.lines if " admitted " in line),
        "crashes": sum(1 for line in world.trace.lines if " crash #" in line),
        "ledger_errors_logged": sum(1 for line in world.trace.lines if " log hostmove.ledger error:" in line),
        "faults_fired": sum(world.plan.fired.values()),
        "draws": sum(world.plan.draws.values()),
        "hosts": len(world.workload.hosts),
        "violations": len(violations),
        "virtual_ms": int(1000 * ended_at[0]) if ended_at else 0,
        **world.extra_counters(),
    }
    keep = trace or bool(violations) or error is not None
    return Result(
        seed=seed,
        violations=violations,
        trace_hash=world.trace.hexdigest(),
        steps=steps,
        trace=tuple(world.trace.lines) if keep else (),
        counters=counters,
        consulted=dict(rules.consulted()),
        error=error,
    )


class _TraceHandler(logging.Handler):
    """The services' log lines become trace lines (their text only: no wall time enters the trace)."""

    def __init__(self, holder: list[World]) -> None:
        super().__init__(logging.DEBUG)
        self.holder = holder

    def emit(self, record: logging.LogRecord) -> None:
        if self.holder:
            self.holder[0].trace.emit("log", f"{record.name} {record.levelname.lower()}: {record.getMessage()}")


@contextlib.contextmanager
def _logs_into(holder: list[World]) -> Iterator[None]:
    logger = logging.getLogger("hostmove")
    handler = _TraceHandler(holder)
    saved = (logger.level, logger.propagate)
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(saved[0])
        logger.propagate = saved[1]


def random_world(seed: int, timing: Timing) -> Callable[[asyncio.AbstractEventLoop], World]:
    def make(loop: asyncio.AbstractEventLoop) -> World:
        plan = FaultPlan(seed)
        boxes = {f"{r}-1": r for r in REGIONS}
        workload: Workload = draw_workload(plan, boxes, timing)
        return World(seed, plan, timing, loop, workload, boxes=boxes)

    return make


def run_seed(seed: int, *, trace: bool = False, mutate: Iterable[str] = (), timing: Timing = DEFAULT_TIMING,
             max_steps: int = MAX_STEPS) -> Result:
    """Run one seed: chaos, calm, quiescence, the final oracle. See :class:`Result`."""
    return execute(seed, random_world(seed, timing), None, trace=trace, mutate=tuple(mutate), max_steps=max_steps)
