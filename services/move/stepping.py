"""Step a journaled runner until it stops progressing (§7.13: each step re-reads, acts, journals). Pure shell glue."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Protocol, TypeVar


class Stepped(Protocol):
    @property
    def progressed(self) -> bool: ...


R = TypeVar("R", bound=Stepped)


async def until_still(step: Callable[[], Awaitable[R]], first: R, max_steps: int) -> R:
    """Run ``step`` until a result did not progress, at most ``max_steps`` times; ``first`` answers when none ran."""
    result = first
    for _ in range(max_steps):
        result = await step()
        if not result.progressed:
            return result
    return result
