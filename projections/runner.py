"""The projector: catch up from the stored position, then follow the ledger (ARCHITECTURE §8).

The stored position is the only checkpoint: :meth:`Projector.catch_up` replays ``HM_LEDGER`` from
``position + 1`` up to the last message at call time and applies it in batches, each batch one
SQLite transaction together with the position (exactly once; run-store concepts, "Execution
revisions"). :meth:`Projector.run` repeats that on a short poll interval (the Clock port's sleep),
woken early by :meth:`Projector.notify`, which :meth:`Projector.wake_on` wires to a core NATS
subscription on ``hm.ledger.>``. A wake-up carries no data: the replay is the only input.

A message that does not decode is recorded and raised as :class:`~projections.store.ProjectionPoison`
after ``on_alert``: with ``poison="halt"`` (the default) the projector stops there; with
``poison="skip"`` it records an explicit skip and goes on. Never a silent skip.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sqlite3
from collections.abc import Callable
from typing import Any, Literal

from bus.log import EventLog, LogError, StoredMessage
from bus.subjects import LEDGER_PREFIX, SubjectError, parse_ledger_subject
from kernel.logctx import ctx
from kernel.ports import Clock, WallClock
from projections.store import Applied, IdentityChanged, ProjectionError, ProjectionPoison, ProjectionStore

log = logging.getLogger("hostmove.projections")

MAX_BACKOFF_S = 5.0
"""The cap of the catch-up's backoff while the log is unreachable (a reconnect's :meth:`Projector.notify` cuts it
short)."""


def _log_alert(exc: ProjectionError) -> None:
    extra: dict[str, Any] = ctx(phase="projection", reason=exc, alert="projection")
    if isinstance(exc, ProjectionPoison):
        extra.update(reason=exc.reason, seq=exc.seq, subject=exc.subject)
        with contextlib.suppress(SubjectError):
            extra["host"] = parse_ledger_subject(exc.subject)[1]
    log.error("projection alert: %s", exc, extra=extra)


class Projector:
    """Folds the ledger stream into a :class:`ProjectionStore`. One projector per store root."""

    def __init__(
        self,
        store: ProjectionStore,
        event_log: EventLog,
        *,
        clock: Clock | None = None,
        batch: int = 256,
        poll_interval: float = 0.5,
        poison: Literal["halt", "skip"] = "halt",
        on_alert: Callable[[ProjectionError], None] = _log_alert,
    ) -> None:
        if batch < 1:
            raise ValueError("batch must be at least 1")
        self.store = store
        self.log = event_log
        self.clock = clock or WallClock()
        self.batch = batch
        self.poll_interval = poll_interval
        self.poison = poison
        self.on_alert = on_alert
        self._wake = asyncio.Event()
        self._stopped = False

    def _apply(self, msgs: list[StoredMessage], identity: str) -> int:
        applied = 0
        while True:
            try:
                result: Applied = self.store.apply_batch(msgs, identity=identity)
                return applied + result.applied
            except ProjectionPoison as exc:
                applied += exc.applied
                self.on_alert(exc)
                if self.poison != "skip":
                    raise
                self.store.skip(exc.seq, f"skipped by the projector (poison=skip): {exc.reason}")
                msgs = [m for m in msgs if m.seq > exc.seq]

    async def catch_up(self) -> int:
        """Apply everything after the stored position, up to the last message now. Returns how many
        messages changed the view."""
        applied = 0
        while True:
            identity, start = self.store.identity, self.store.position() + 1
            pending: list[StoredMessage] = []
            try:
                async for msg in self.log.replay(self.store.stream, start_seq=start):
                    pending.append(msg)
                    if len(pending) >= self.batch:
                        applied += self._apply(pending, identity)
                        pending = []
                if pending:
                    applied += self._apply(pending, identity)
                return applied
            except IdentityChanged:
                continue  # rebuilt meanwhile: replay from the new database's position

    def notify(self) -> None:
        """Wake :meth:`run` now (new messages may be on the stream)."""
        self._wake.set()

    def stop(self) -> None:
        self._stopped = True
        self._wake.set()

    async def wake_on(self, nc: Any) -> Any:
        """Subscribe (core NATS, no JetStream state) to ledger subjects to wake early. Returns the
        subscription; unsubscribe it when done."""

        async def cb(_msg: Any) -> None:
            self.notify()

        return await nc.subscribe(f"{LEDGER_PREFIX}.>", cb=cb)

    async def _idle(self, seconds: float) -> None:
        sleeper = asyncio.ensure_future(self.clock.sleep(seconds))
        woken = asyncio.ensure_future(self._wake.wait())
        try:
            await asyncio.wait({sleeper, woken}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            sleeper.cancel()
            woken.cancel()
        self._wake.clear()

    async def run(self) -> None:
        """Catch up, then follow until :meth:`stop`. A log outage backs off and retries; a poison
        message with ``poison="halt"`` propagates (the caller decides)."""
        self._stopped = False
        backoff = self.poll_interval
        while not self._stopped:
            try:
                await self.catch_up()
                backoff = self.poll_interval
            except (ProjectionError, sqlite3.Error):
                raise
            except (LogError, Exception) as exc:  # the log is unreachable: the outcome is unknown, retry
                backoff = min(max(backoff * 2, self.poll_interval), MAX_BACKOFF_S)
                log.warning("projection catch-up failed, retrying in %g s: %s", backoff, exc,
                            extra=ctx(phase="projection", reason=exc))
                await self._idle(backoff)
                continue
            if self._stopped:
                break
            await self._idle(self.poll_interval)
