"""The host guard (spec §6.4; claim C7; ARCHITECTURE §2).

An exclusive ``fcntl.flock`` per host on ``<box_dir>/locks/<host>.lock``, shared by every OS
process on the box that writes host state, followed by a **fresh claim read** under it. The body
gets the claim as it was after the lock was taken, so anything admitted before a retirement is
drained and anything after it sees the retirement (C7; model rules ``hostguard``, ``fence-stamp``).

``flock`` locks belong to an open file description, so two coroutines of one process exclude each
other too; the kernel drops the lock when its holder dies. The guard is not reentrant: taking it
again for the same host inside its own body waits for itself and times out.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from urllib.parse import quote

from events.base import validate_ident
from events.claim import Claim
from kernel import rules
from kernel.ports import Clock, WallClock

LOCK_DIR = "locks"

rules.register(
    "hostguard",
    section="§6.4 host guard; claim §6.4 (C7)",
    meaning="one step per host at a time on a box: the exclusive host guard, the claim read under it",
    site="services/box/instance/guard.py host_guard",
)
DEFAULT_TIMEOUT_S = 30.0

ReadClaim = Callable[[], Awaitable[Claim | None]]


class GuardTimeout(Exception):
    """The host guard was not free before the deadline; nothing was done."""


class Guarded:
    """What the body of :func:`host_guard` holds: the host and the claim read fresh under the lock.

    ``held`` is False once the guard is released, so code that must run under the guard (the stamp
    record, §6.4) can refuse a stale handle.
    """

    __slots__ = ("host", "claim", "_held")

    def __init__(self, host: str, claim: Claim | None) -> None:
        self.host = host
        self.claim = claim
        self._held = True

    @property
    def held(self) -> bool:
        return self._held

    def require(self, host: str) -> None:
        """Raise unless this handle is the live guard of ``host``."""
        if not self._held:
            raise RuntimeError(f"the host guard for {self.host} was already released; take it again")
        if host != self.host:
            raise RuntimeError(f"this is the host guard for {self.host}, not for {host}")


def lock_path(box_dir: Path, host: str) -> Path:
    """``<box_dir>/locks/<host>.lock``; the host name percent-encoded (hashed if very long)."""
    validate_ident(host, "host")
    name = quote(host, safe="")
    if len(name) > 200:
        name = "h-" + hashlib.sha256(host.encode()).hexdigest()
    return Path(box_dir) / LOCK_DIR / f"{name}.lock"


def _holder_pid(fd: int) -> str:
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        return ""
    return text if text.isdigit() else ""


@asynccontextmanager
async def host_guard(
    box_dir: Path,
    host: str,
    read_claim: ReadClaim,
    *,
    clock: Clock | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    poll_s: float = 0.01,
) -> AsyncIterator[Guarded]:
    """Take ``host``'s guard (polling, never blocking the event loop), then read the claim fresh.

    Raises :class:`GuardTimeout` if another holder keeps it past ``timeout_s``. A failing
    ``read_claim`` releases the guard and propagates: a read error never acts (C6).
    """
    clk = clock or WallClock()
    path = lock_path(box_dir, host)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    guarded: Guarded | None = None
    try:
        deadline = clk.monotonic() + timeout_s
        while rules.on("hostguard"):  # the mutation: no exclusion, the claim read as if under the lock
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as exc:
                if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                    raise
            if clk.monotonic() >= deadline:
                holder = _holder_pid(fd)
                by = f" (held by process {holder})" if holder else ""
                raise GuardTimeout(
                    f"the host guard for {host} stayed busy for {timeout_s:g} s{by}; another process on this "
                    "box is writing the host's state. Nothing was changed; the step retries later."
                )
            await clk.sleep(poll_s)
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        claim = await read_claim()
        guarded = Guarded(host, claim)
        yield guarded
    finally:
        if guarded is not None:
            guarded._held = False
        os.close(fd)  # closing the last descriptor releases the flock
