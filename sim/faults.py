"""Faults from named, seeded draws (model digest §2 "Faults injected", §8.4-5).

Every random choice a run makes goes through a :class:`FaultPlan`: ``plan.fault("s3.lost_response", p)``
names the draw, counts it, and answers from the seed's own random source. In the calm phase no new
fault fires (faults heal); :class:`QuietPlan` takes the inject-nothing branch of every draw and the
low end of every range, which is what witnesses run on (they never draw from a seed).

The distributions mirror the model's where they apply to the code that exists (late completions with
a long tail, a quarter of the tail landing at exactly ``H``, rare stragglers up to ``11·H``; lost
responses; pauses between a check and the request it guards; crashes; clock skew within the
allowance). Durations are the production profile (ARCHITECTURE §7): virtual time costs nothing.
"""

from __future__ import annotations

import hashlib
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Timing:
    """Durations in virtual seconds (the ``production`` profile of ARCHITECTURE §7)."""

    sig_age_s: float = 15 * 60.0  # S3 refuses a request signed longer ago (spec §5.3 "Evidence also starts a clock")
    request_limit_s: float = 120.0  # claim §6.2a request limit
    client_timeout_s: float = 30.0  # the client gives up; the outcome is unknown (port: StoreUnavailable)
    skew_allowance_s: float = 5.0  # each actor's clock is off by at most this (spec §7.3 SafeUntil)
    ack_wait_s: float = 30.0  # JetStream ack wait (FastStream's default, bus.app.RedeliveryPolicy)
    max_deliver: int = 8
    dedup_window_s: float = 120.0  # JetStream's default duplicate window (stack facts §3)
    reconcile_s: float = 300.0  # a box's periodic reconcile, beside event wake-ups
    relay_s: float = 60.0  # the relay's period
    chaos_s: float = 1800.0  # the chaos phase
    calm_s: float = 6 * 3600.0  # the calm phase must reach quiescence within this

    @property
    def horizon_s(self) -> float:
        """``H`` = the signature-age limit plus the request limit (spec §6.4, claim §6.2a)."""
        return self.sig_age_s + self.request_limit_s


@dataclass(frozen=True)
class RequestFate:
    """How one object-store request travels (decided when it is issued)."""

    pause_before_sign: float = 0.0  # the caller is paused between its check and signing
    pause_after_sign: float = 0.0  # signed, not yet sent: the signature ages
    transit: float = 0.01  # sent -> arrives (the signature is checked on arrival)
    processing: float = 0.0  # arrives -> the effect lands (a 412 is judged then)
    answer: float = 0.01  # the effect -> the caller hears
    fail_5xx: bool = False  # refused on arrival, nothing applied
    lost_response: bool = False  # applied, the caller never hears


@dataclass(frozen=True)
class PublishFate:
    latency: float = 0.005
    fail: bool = False  # never reaches the stream; the caller sees an unknown outcome
    lose_ack: bool = False  # stored; the caller sees an unknown outcome


class FaultPlan:
    """Named, counted draws from one seed. ``calm`` switches fault injection off (not other draws)."""

    quiet = False

    def __init__(self, seed: int | str) -> None:
        self.seed = seed
        self._rng = random.Random(f"faults:{seed}")
        self.draws: Counter[str] = Counter()
        self.fired: Counter[str] = Counter()
        self.calm = False

    # -- primitive draws ---------------------------------------------------------------------------

    def fault(self, name: str, p: float) -> bool:
        """A fault fires with probability ``p``; never in the calm phase."""
        self.draws[name] += 1
        hit = self._rng.random() < p
        if hit and not self.calm:
            self.fired[name] += 1
            return True
        return False

    def chance(self, name: str, p: float) -> bool:
        """A workload or bias choice (not a fault: it is drawn in the calm phase too)."""
        self.draws[name] += 1
        return self._rng.random() < p

    def uniform(self, name: str, lo: float, hi: float) -> float:
        self.draws[name] += 1
        return self._rng.uniform(lo, hi)

    def randint(self, name: str, lo: int, hi: int) -> int:
        self.draws[name] += 1
        return self._rng.randint(lo, hi)

    def choice(self, name: str, options: Sequence[T]) -> T:
        self.draws[name] += 1
        return options[self._rng.randrange(len(options))]

    def token(self, name: str, nbytes: int) -> bytes:
        self.draws[name] += 1
        return self._rng.randbytes(nbytes)

    # -- composite draws ---------------------------------------------------------------------------

    def s3_request(self, op: str, key: str, timing: Timing, *, long_tail_p: float = 0.08) -> RequestFate:
        """The fate of one object-store request (model digest §2: 70% at once, a long tail, lost
        responses, signature-age refusals after a pause)."""
        cls = type(self)
        if cls.fault is not FaultPlan.fault or cls.uniform is not FaultPlan.uniform:  # its own draws (QuietPlan)
            return self._s3_request_drawn(timing, long_tail_p)
        # The draws of fault() and uniform() inline, in the same order (a request's fate is the hottest draw).
        draws, random, uniform = self.draws, self._rng.random, self._rng.uniform
        draws["s3.pause_before_sign"] += 1
        pause_before: float = 0
        if random() < 0.02 and not self.calm:
            self.fired["s3.pause_before_sign"] += 1
            pause_before = self.uniform("s3.pause_before_sign.s", 1, 600)
        draws["s3.pause_after_sign"] += 1
        pause_after: float = 0
        if random() < 0.01 and not self.calm:
            self.fired["s3.pause_after_sign"] += 1
            pause_after = self.uniform("s3.pause_after_sign.s", 1, 1.3 * timing.sig_age_s)
        draws["s3.transit"] += 1
        transit = uniform(0.002, 0.02)
        processing = 0.0
        if self.fault("s3.late", long_tail_p):
            tail = self.uniform("s3.late.kind", 0, 1)
            if tail < 0.25:
                processing = timing.horizon_s  # a quarter of the tail lands at exactly H
            elif tail < 0.30:
                processing = self.uniform("s3.late.straggler", timing.horizon_s, 11 * timing.horizon_s)
            else:
                processing = self.uniform("s3.late.s", timing.client_timeout_s, timing.client_timeout_s
                                          + timing.request_limit_s)
        draws["s3.answer"] += 1
        answer = uniform(0.002, 0.02)
        return RequestFate(pause_before, pause_after, transit, processing, answer, self.fault("s3.5xx", 0.02),
                           self.fault("s3.lost_response", 0.03))

    def _s3_request_drawn(self, timing: Timing, long_tail_p: float) -> RequestFate:
        """:meth:`s3_request` through the plan's own draw methods (the same draws, in the same order)."""
        pause_before = self.uniform("s3.pause_before_sign.s", 1, 600) if self.fault("s3.pause_before_sign", 0.02) else 0
        pause_after = self.uniform("s3.pause_after_sign.s", 1, 1.3 * timing.sig_age_s) if self.fault(
            "s3.pause_after_sign", 0.01) else 0
        transit = self.uniform("s3.transit", 0.002, 0.02)
        processing = 0.0
        if self.fault("s3.late", long_tail_p):
            tail = self.uniform("s3.late.kind", 0, 1)
            if tail < 0.25:
                processing = timing.horizon_s
            elif tail < 0.30:
                processing = self.uniform("s3.late.straggler", timing.horizon_s, 11 * timing.horizon_s)
            else:
                processing = self.uniform("s3.late.s", timing.client_timeout_s, timing.client_timeout_s
                                          + timing.request_limit_s)
        return RequestFate(
            pause_before_sign=pause_before,
            pause_after_sign=pause_after,
            transit=transit,
            processing=processing,
            answer=self.uniform("s3.answer", 0.002, 0.02),
            fail_5xx=self.fault("s3.5xx", 0.02),
            lost_response=self.fault("s3.lost_response", 0.03),
        )

    def publish(self) -> PublishFate:
        return PublishFate(
            latency=self.uniform("js.latency", 0.001, 0.01),
            fail=self.fault("js.publish_fail", 0.02),
            lose_ack=self.fault("js.lost_ack", 0.04),
        )

    def pause(self, name: str, p: float = 0.05, hi: float = 300.0) -> float:
        """A pause between a check and the request it guards (0 when none fires)."""
        return self.uniform(f"{name}.s", 1, hi) if self.fault(name, p) else 0.0


class QuietPlan(FaultPlan):
    """Every draw takes the inject-nothing branch and the low end of every range (witnesses)."""

    quiet = True

    def fault(self, name: str, p: float) -> bool:
        self.draws[name] += 1
        return False

    def chance(self, name: str, p: float) -> bool:
        self.draws[name] += 1
        return False

    def uniform(self, name: str, lo: float, hi: float) -> float:
        self.draws[name] += 1
        return lo

    def randint(self, name: str, lo: int, hi: int) -> int:
        self.draws[name] += 1
        return lo

    def choice(self, name: str, options: Sequence[T]) -> T:
        self.draws[name] += 1
        return options[0]

    def token(self, name: str, nbytes: int) -> bytes:
        # Ids must still be distinct: derive them from the draw count, never from a seed.
        self.draws[name] += 1
        return hashlib.shake_256(f"{name}:{self.draws[name]}".encode()).digest(nbytes)
