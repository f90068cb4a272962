"""The staging-work lease (spec §7.3 "The staging-work lease, sealing and draining", joint D4, N2; claim C3).

M17's push-only grant means the source can put and delete in the target region's ``moves/*`` but never read it, so
it cannot hold a lock there. Exclusion between staging writers uses one shared lease object in the **deployment
bucket**, keyed by target region and host: ``control/staging-leases/<region>/<host>.json``. Every preparing round,
the cut's final rounds and every staging retirement take it first, then revalidate the claim's op id and phase.

The lease is a CAS on that object with its ETag (``If-Match``, or ``If-None-Match`` to create), decided purely:

- :func:`decide_acquire`: absent or released: take it; held by this holder: renew; held by another holder: refused
  until ``now > until + skew`` (expired), then taken over.
- :func:`decide_renew`: only the holder named in the object renews (``until = now + TTL``); anyone else lost it.
- :func:`decide_release`: the holder clears ``holder`` (``until`` is kept, it still bounds what was signed).

A lease cannot fence a request already signed, so every staging request is checked **immediately before it is
signed** (:func:`sign_refused`): ``now < SafeUntil = Until - clock skew - signature-age limit``, the check's time
read after any pause (the lease renewal included). Past it, the request is dropped and the round stops
(:class:`StagingStopped`). S3 accepts a request only within the signature-age limit of its signature, so every
request the lease's holders sign is accepted before ``Until``, and the lane's retirement after ``seal + TTL + H``
(§6.4) finds every one of them.

Not done here: signing at the check with the check's time as ``X-Amz-Date`` and no re-signing on a retry (claim
CC19) is the object store adapter's (``services/objstore/s3.py``); this module checks right before the call.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Final

import msgspec

from events.base import Durable, Ident, Millis, canonical, decode
from kernel import rules
from kernel.logctx import ctx
from kernel.ports import Clock
from kernel.timetext import utc_text
from services.ledger.ledger import NoChange, Refusal
from services.move.follow import host_segment
from services.objstore.port import Got, Lost, ObjectStore

log = logging.getLogger("hostmove.source.lease")

rules.register(
    "staging-lease",
    section="§7.3 The staging-work lease (joint D4, N2); claim C3",
    meaning="every staging round, final round and staging retirement takes the shared staging-work lease "
            "(deployment bucket, keyed by target region and host) first, then revalidates the claim's op and phase",
    site="services/move/lease.py StagingWork.acquire",
)
rules.register(
    "sign-before-safeuntil",
    section="§7.3 Sign only before SafeUntil (model 14, CC14)",
    meaning="every staging PUT, COPY and DELETE checks now < SafeUntil = Until - skew - signature age immediately "
            "before it is signed, after any pause, and is dropped (the round stops) once past it",
    site="services/move/lease.py StagingWork.before_sign",
)

LEASE_VERSION: Final = 1
LEASE_PREFIX: Final = "control/staging-leases/"


class StagingStopped(Exception):
    """A staging round stopped without signing its next request: the lease is held by another writer, was lost,
    or its ``SafeUntil`` passed (§7.3). Nothing after the stop is written; the next round starts over."""


class StagingLease(Durable, frozen=True):
    """``control/staging-leases/<region>/<host>.json``: who may stage into ``region`` for ``host`` and until when.
    ``holder`` is one worker's token (``<box>/<nonce>``), ``""`` once released; ``op_id`` the op it stages for."""

    v: int
    region: Ident
    host: Ident
    op_id: Ident
    holder: str
    until: Millis
    taken_at: Millis


@dataclass(frozen=True)
class LeaseTiming:
    """The lease's durations (ms): TTL, the clock skew allowance and S3's signature-age limit (§7.3); a renewal is
    due once ``SafeUntil`` is nearer than ``renew_within_ms`` (half the safe window by default)."""

    ttl_ms: int
    skew_ms: int
    signature_age_ms: int
    renew_within_ms: int | None = None

    def __post_init__(self) -> None:
        if self.ttl_ms <= self.skew_ms + self.signature_age_ms:
            raise ValueError("the staging lease TTL must exceed the clock skew plus the signature-age limit (§7.3)")

    def safe_until(self, until: int) -> int:
        """``SafeUntil = Until - clock skew - signature-age limit`` (§7.3, CC19)."""
        return until - self.skew_ms - self.signature_age_ms

    @property
    def renew_margin_ms(self) -> int:
        if self.renew_within_ms is not None:
            return self.renew_within_ms
        return (self.ttl_ms - self.skew_ms - self.signature_age_ms) // 2


def lease_key(region: str, host: str) -> str:
    """``control/staging-leases/<region>/<host>.json`` in the deployment bucket (§7.3: keyed by target region and
    host); both segments percent-encoded as the ledger's keys are."""
    return f"{LEASE_PREFIX}{host_segment(region)}/{host_segment(host)}.json"


# -- the pure part ------------------------------------------------------------------------------------------


def decide_acquire(current: StagingLease | None, *, region: str, host: str, op_id: str, holder: str, now_ms: int,
                   timing: LeaseTiming) -> StagingLease | Refusal:
    """Take the lease (absent, released or expired past the skew allowance) or renew it (already this holder's);
    refused while another holder's lease runs."""
    if not holder:
        raise ValueError("a staging lease holder needs a token")
    fresh = StagingLease(v=LEASE_VERSION, region=region, host=host, op_id=op_id, holder=holder,
                         until=now_ms + timing.ttl_ms, taken_at=now_ms)
    if current is None or not current.holder:
        return fresh
    if current.region != region or current.host != host:
        raise ValueError(f"the lease object names {current.host} in {current.region}, not {host} in {region}")
    if current.holder == holder and current.op_id == op_id:
        return msgspec.structs.replace(current, until=max(current.until, now_ms + timing.ttl_ms))
    if now_ms > current.until + timing.skew_ms:
        return fresh
    return Refusal(f"another staging writer ({current.holder}, for {current.op_id}) holds the staging lease of "
                   f"{host} in {region} until {utc_text(current.until + timing.skew_ms)}; this round waits")


def decide_renew(current: StagingLease | None, *, holder: str, op_id: str, now_ms: int,
                 timing: LeaseTiming) -> StagingLease | Refusal:
    """Extend this holder's lease to ``now + TTL``; refused once the object names anyone else (the lease was lost:
    it expired and was taken over, or released)."""
    if current is None or current.holder != holder or current.op_id != op_id:
        who = "nobody" if current is None or not current.holder else current.holder
        return Refusal(f"the staging lease was lost (it now names {who}); the round stops before its next request")
    return msgspec.structs.replace(current, until=max(current.until, now_ms + timing.ttl_ms))


def decide_release(current: StagingLease | None, *, holder: str) -> StagingLease | NoChange:
    """Clear the holder so the next writer need not wait out the TTL; ``until`` stays (it bounds what was
    signed). Someone else's lease is left alone."""
    if current is None or current.holder != holder:
        return NoChange("the staging lease is not this holder's")
    return msgspec.structs.replace(current, holder="")


def sign_refused(until: int | None, now_ms: int, timing: LeaseTiming) -> str | None:
    """Why a staging request may not be signed now (§7.3 "Sign only before SafeUntil"), or None."""
    if until is None:
        return "no staging lease is held"
    safe_until = timing.safe_until(until)
    if now_ms >= safe_until:
        return f"the staging lease's SafeUntil passed {now_ms - safe_until} ms ago"
    return None


# -- the runner ---------------------------------------------------------------------------------------------


class StagingWork:
    """One writer's hold on the staging-work lease of (``region``, ``host``) for ``op_id``: :meth:`acquire` first,
    :meth:`before_sign` immediately before every staging request, :meth:`release` at the end of the round."""

    def __init__(self, store: ObjectStore, bucket: str, clock: Clock, timing: LeaseTiming, *, region: str, host: str,
                 op_id: str, holder: str) -> None:
        self.store, self.bucket, self.clock, self.timing = store, bucket, clock, timing
        self.region, self.host, self.op_id, self.holder = region, host, op_id, holder
        self.key = lease_key(region, host)
        self._etag: str | None = None
        self.until: int | None = None
        self.signed = 0

    async def _read(self) -> tuple[StagingLease | None, str | None]:
        got = await self.store.get(self.bucket, self.key)
        if not isinstance(got, Got):
            return None, None
        return decode(got.body, StagingLease), got.etag

    async def _write(self, lease: StagingLease, etag: str | None) -> bool:
        body = canonical(lease)
        if etag is None:
            out = await self.store.put(self.bucket, self.key, body, if_none_match=True)
        else:
            out = await self.store.put(self.bucket, self.key, body, if_match=etag)
        if isinstance(out, Lost):
            return False
        self._etag = out.etag
        return True

    async def acquire(self) -> None:
        """Take (or renew) the lease by CAS; :class:`StagingStopped` when another writer holds it or a racing
        writer won the CAS. The caller revalidates the claim's op and phase next (§7.3)."""
        if not rules.on("staging-lease"):
            self.until = self.clock.now_ms() + self.timing.ttl_ms  # mutated: no exclusion at all
            return
        current, etag = await self._read()
        out = decide_acquire(current, region=self.region, host=self.host, op_id=self.op_id, holder=self.holder,
                             now_ms=self.clock.now_ms(), timing=self.timing)
        if isinstance(out, Refusal):
            raise StagingStopped(out.reason)
        if not await self._write(out, etag):
            raise StagingStopped(f"another staging writer took the staging lease of {self.host} in {self.region} "
                                 "at the same time; this round waits")
        self.until = out.until
        log.info("staging lease of %s in %s taken (move %s) until %s", self.host, self.region, self.op_id,
                 utc_text(out.until), extra=ctx(host=self.host, op_id=self.op_id, phase="staging",
                                                region=self.region, until=out.until))

    async def renew(self) -> None:
        """Extend the lease by CAS on the ETag this holder last wrote; :class:`StagingStopped` when it was lost."""
        if not rules.on("staging-lease"):
            self.until = self.clock.now_ms() + self.timing.ttl_ms
            return
        current, etag = await self._read()
        out = decide_renew(current, holder=self.holder, op_id=self.op_id, now_ms=self.clock.now_ms(),
                           timing=self.timing)
        if isinstance(out, Refusal):
            self.until = None
            raise StagingStopped(out.reason)
        if not await self._write(out, etag):
            self.until = None
            raise StagingStopped("the staging lease changed under its renewal; the round stops before its next request")
        self.until = out.until

    async def before_sign(self, what: str) -> None:
        """The check immediately before ``what`` is signed (§7.3): a writer already past ``SafeUntil`` (it paused)
        drops the request and stops, even if it could still renew; one near it renews first, then reads the clock
        again after that pause and checks once more."""
        self._check(what)
        if self.until is not None and self.timing.safe_until(self.until) - self.clock.now_ms() \
                < self.timing.renew_margin_ms:
            await self.renew()
            self._check(what)
        self.signed += 1

    def _check(self, what: str) -> None:
        why = sign_refused(self.until, self.clock.now_ms(), self.timing)
        if why is not None and (self.until is None or rules.on("sign-before-safeuntil")):
            raise StagingStopped(f"{why}: {what} was not signed and the round stops")

    async def release(self) -> None:
        """Give the lease up at the end of a round (best effort: a lost release only makes the next writer wait
        out the TTL)."""
        self.until = None
        if not rules.on("staging-lease"):
            return
        current, etag = await self._read()
        out = decide_release(current, holder=self.holder)
        if isinstance(out, StagingLease) and etag is not None:
            await self.store.put(self.bucket, self.key, canonical(out), if_match=etag)




__all__ = [
    "LEASE_PREFIX", "LeaseTiming", "StagingLease", "StagingStopped", "StagingWork", "decide_acquire",
    "decide_release", "decide_renew", "lease_key", "sign_refused",
]
