"""How many cuts a source box carries at once (spec §7.4: the cut window is per host; issue 19 item 7(b)).

A cut's clock starts at its admission (``cut_at``, :func:`services.source.phases.decide_admit`) and runs through the
target's landing to the open. A box that admitted every requested cut at once would run them all in parallel on its
cores and queue their landings behind each other on the target's pass workers: measured with 20 moves requested at
once between two boxes (``bench/scale`` part (b)), every one passed its cut deadline and rolled back. So a source
admits at most ``slots`` cuts at a time (``HOSTMOVE_CUT_SLOTS``); a cut beyond them stays ``requested``, its host
serving as before and nothing offline, and is admitted when a slot frees (a move that opened, ended or rolled back):
the runner wakes the waiting hosts' passes then, rather than polling them (measured: 19 hosts polling for a slot
every 0.2 s, each pass two claim and record GETs, slowed the one cut in flight).

A slot is this process's knowledge, not the ledger's: after a restart the passes hold again the slots of the cuts
they find in flight (:meth:`CutSlots.hold`), and a slot nobody released is given up after ``stale_ms`` (the cut's
and the landing's budgets: past them the move has opened or rolled back). Safety never rests on it: it only paces
admissions. The decision is pure; the source's runner (:class:`services.agent.sides.SourceRunners`) applies it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final

from kernel.passes import whole_setting

DEFAULT_SLOTS: Final = 4
SLOTS_ENV: Final = "HOSTMOVE_CUT_SLOTS"


def slots_override(text: str | None, default: int = DEFAULT_SLOTS) -> int:
    """``HOSTMOVE_CUT_SLOTS``: how many cuts a source box carries at once; unset keeps ``default``. Anything but a
    positive whole number is refused with the reason."""
    return whole_setting(SLOTS_ENV, text, default, "cuts a box carries at once")


@dataclass
class CutSlots:
    """The cuts this box carries (host -> when its slot was taken, ms)."""

    slots: int = DEFAULT_SLOTS
    stale_ms: int = 0
    held: dict[str, int] = field(default_factory=dict)
    waiting: set[str] = field(default_factory=set)
    """Hosts whose cut waits for a slot: woken when one frees (:meth:`release`), not polled."""

    def __post_init__(self) -> None:
        if self.slots < 1:
            raise ValueError(f"at least one cut slot, not {self.slots}")

    def _expire(self, now_ms: int) -> None:
        if self.stale_ms > 0:
            for host in [h for h, at in self.held.items() if now_ms - at > self.stale_ms]:
                del self.held[host]

    def take(self, host: str, now_ms: int) -> str | None:
        """A slot for ``host``'s cut (``None``: admit it now), or why it waits."""
        self._expire(now_ms)
        if host in self.held or len(self.held) < self.slots:
            self.held.setdefault(host, now_ms)
            self.waiting.discard(host)
            return None
        self.waiting.add(host)
        return (f"this box carries {len(self.held)} cuts already, at most {self.slots} at once ({SLOTS_ENV}): the cut "
                "is admitted when one of them opens or ends; the host keeps serving meanwhile")

    def hold(self, host: str, now_ms: int) -> None:
        """``host``'s cut is in flight (admitted, landing or opening): it holds its slot."""
        self.held.setdefault(host, now_ms)

    def release(self, host: str) -> tuple[str, ...]:
        """``host``'s cut is over (or was never in flight); the hosts to wake when that freed a slot."""
        self.waiting.discard(host)
        if self.held.pop(host, None) is None or not self.waiting:
            return ()
        return tuple(sorted(self.waiting))
