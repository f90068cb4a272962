"""Step a journaled runner until it stops progressing (§7.13: each step re-reads, acts, journals). Pure shell glue."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TypeVar

if TYPE_CHECKING:
    from services.move.finalize import StepReport


class Stepped(Protocol):
    @property
    def progressed(self) -> bool: ...


R = TypeVar("R", bound=Stepped)


@dataclass(frozen=True)
class RunnerResult:
    """One step of a rollback runner (the target's release, the source's recovery): ``progressed`` (step again
    now), or why not (``reason``); ``report`` when the finalizer answered; ``stuck`` when only an operator can go on."""

    progressed: bool
    reason: str = ""
    report: StepReport | None = None
    stuck: bool = False


async def until_still(step: Callable[[], Awaitable[R]], first: R, max_steps: int) -> R:
    """Run ``step`` until a result did not progress, at most ``max_steps`` times; ``first`` answers when none ran."""
    result = first
    for _ in range(max_steps):
        result = await step()
        if not result.progressed:
            return result
    return result
