"""How many cuts, and how many first stagings, a source box carries at once (spec §7.4: the cut window is per host;
issue 19 item 7(b)).

A cut's clock starts at its admission (``cut_at``, :func:`services.source.phases.decide_admit`) and runs through the
target's landing to the open. A box that admitted every requested cut at once would run them all in parallel on its
cores and queue their landings behind each other on the target's pass workers: measured with 20 moves requested at
once between two boxes (``bench/scale`` part (b)), every one passed its cut deadline and rolled back. So a source
admits at most ``slots`` cuts at a time (``HOSTMOVE_CUT_SLOTS``); a cut beyond them stays ``requested``, its host
serving as before and nothing offline, and is admitted when a slot frees (a move that opened, ended or rolled back):
the runner wakes the waiting hosts' passes then, rather than polling them (measured: 19 hosts polling for a slot
every 0.2 s, each pass two claim and record GETs, slowed the one cut in flight).

A slot is this process's knowledge, not the ledger's: after a restart the passes hold again the slots of the cuts
they find in flight (:meth:`Slots.hold`), and a slot nobody released is given up after ``stale_ms`` (the cut's
and the landing's budgets: past them the move has opened or rolled back). Safety never rests on it: it only paces
admissions. The decision is pure; the source's runner (:class:`services.agent.sides.SourceRunners`) applies it.

**Preparing slots** (``HOSTMOVE_PREPARE_SLOTS``) pace the same way the moves still ``preparing`` (§7.3: the first
rounds, which mirror the whole replica and seal the files archive): with 20 moves requested at once, 20 hosts
staging at once took the two cores every cut needed, and measured, none of the 20 ended ``done`` whatever the cut
slots. A move beyond the slots stays ``preparing``, its host serving, with the reason in the pass; once ``ready`` it
gives its slot up (its later rounds mirror only what changed, and a manual cut may wait for the operator for long).
Its prepare bound (§7.11) still runs while it waits, so the slots must be sized to prepare what is requested within
it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final

from kernel.passes import whole_setting

DEFAULT_SLOTS: Final = 4
SLOTS_ENV: Final = "HOSTMOVE_CUT_SLOTS"
DEFAULT_PREPARE_SLOTS: Final = 4
PREPARE_SLOTS_ENV: Final = "HOSTMOVE_PREPARE_SLOTS"
CUT_BUSY: Final = ("this box carries {held} cuts already, at most {slots} at once ({env}): the cut is admitted when "
                   "one of them opens or ends; the host keeps serving meanwhile")
PREPARE_BUSY: Final = ("this box stages {held} moves already, at most {slots} at once ({env}): this one begins when "
                       "one of them is ready or ends; the host keeps serving meanwhile")


def slots_override(text: str | None, default: int = DEFAULT_SLOTS) -> int:
    """``HOSTMOVE_CUT_SLOTS``: how many cuts a source box carries at once; unset keeps ``default``. Anything but a
    positive whole number is refused with the reason."""
    return whole_setting(SLOTS_ENV, text, default, "cuts a box carries at once")


def prepare_slots_override(text: str | None, default: int = DEFAULT_PREPARE_SLOTS) -> int:
    """``HOSTMOVE_PREPARE_SLOTS``: how many moves a source box stages at once before they are ready; unset keeps
    ``default``. Anything but a positive whole number is refused with the reason."""
    return whole_setting(PREPARE_SLOTS_ENV, text, default, "moves a box stages at once")


@dataclass
class Slots:
    """The hosts holding one of this box's slots of a kind (host -> when its slot was taken, ms): the cuts in
    flight (:data:`CUT_BUSY`) or the moves still preparing (:data:`PREPARE_BUSY`)."""

    slots: int = DEFAULT_SLOTS
    stale_ms: int = 0
    busy: str = CUT_BUSY
    """Why a host waits, formatted with ``held``, ``slots`` and ``env``."""
    env: str = SLOTS_ENV
    held: dict[str, int] = field(default_factory=dict)
    waiting: set[str] = field(default_factory=set)
    """Hosts waiting for a slot: woken when one frees (:meth:`release`), not polled."""

    def __post_init__(self) -> None:
        if self.slots < 1:
            raise ValueError(f"at least one slot ({self.env}), not {self.slots}")

    def _expire(self, now_ms: int) -> None:
        if self.stale_ms > 0:
            for host in [h for h, at in self.held.items() if now_ms - at > self.stale_ms]:
                del self.held[host]

    def take(self, host: str, now_ms: int) -> str | None:
        """A slot for ``host`` (``None``: go on now), or why it waits."""
        self._expire(now_ms)
        if host in self.held or len(self.held) < self.slots:
            self.held.setdefault(host, now_ms)
            self.waiting.discard(host)
            return None
        self.waiting.add(host)
        return self.busy.format(held=len(self.held), slots=self.slots, env=self.env)

    def hold(self, host: str, now_ms: int) -> None:
        """``host`` is in flight (a cut admitted, landing or opening): it holds its slot."""
        self.held.setdefault(host, now_ms)

    def release(self, host: str) -> tuple[str, ...]:
        """``host`` is done with its slot (or never held one); the hosts to wake when that freed a slot."""
        self.waiting.discard(host)
        if self.held.pop(host, None) is None or not self.waiting:
            return ()
        return tuple(sorted(self.waiting))
