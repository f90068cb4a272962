"""One move from request to close, by stepping both boxes' runners in one loop (spec §7.1-§7.9; issue 4).

:func:`run_move` drives a move in one process, for the end-to-end tests, the protocol audit's tests and
``bench/move``: the door's request (§7.1), then each pass reads the record and the claim and takes the source's
step and the target's step for the stage they say (:mod:`services.agent.sides`, the same runners each box's agent
takes on events, :mod:`services.agent.service`). It holds no state of its own, so a run after a crash reads
everything again (ARCHITECTURE §5). A run that stops answers a :class:`MoveOutcome` saying where and why, never an
exception for a race or a refusal (store and bus failures still raise: a read error never acts, C6).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from services.agent.sides import (
    FAST,
    STAGES,
    Deployment,
    SourceRunners,
    SourceSide,
    Stage,
    TargetRunners,
    TargetSide,
    Timings,
    stage_of,
)
from services.door.auth import Identity
from services.door.decide import CutMode, MoveRequest

log = logging.getLogger("hostmove.move.e2e")


@dataclass(frozen=True)
class MoveOutcome:
    """How a run ended. ``ok`` only when the move closed as done with the claim serving on the target.
    ``stage`` is the last stage reached; ``reason`` says in plain words why the run stopped there. ``timings``
    holds seconds per stage (monotonic, this process) and ``total``; ``passes`` counts the loop's re-reads."""

    host: str
    move_id: str
    ok: bool
    stage: Stage
    reason: str
    exec_box: str = ""
    committed: bool = False
    opened: bool = False
    closed: bool = False
    timings: dict[str, float] = field(default_factory=dict)
    passes: int = 0


class MoveRun:
    """Both sides' runners of one move, built once; :meth:`run` and :meth:`drive` step them (see the module doc)."""

    def __init__(self, deployment: Deployment, source: SourceSide, target: TargetSide,
                 timings: Timings = FAST) -> None:
        self.d, self.source, self.target, self.t = deployment, source, target, timings
        self.clock = source.ctx.clock  # time only through the Clock port (ARCHITECTURE §7)
        self.ledger = deployment.door.ledger
        self.src = SourceRunners(deployment, source, timings)
        self.tgt = TargetRunners(deployment, target, timings)

    async def run(self, host: str, *, to: str, cut: CutMode = "auto", who: Identity | None = None) -> MoveOutcome:
        """Request the move at the door, then step it to its close (or until it stops; see :class:`MoveOutcome`)."""
        who = who or Identity("op", "operator")
        started = self.clock.monotonic()
        marks: dict[str, float] = {"request": started}
        answer = await self.d.door.request_move(host, MoveRequest(to, cut), who)
        if answer.status not in (200, 201):
            return MoveOutcome(host, "", False, "request", answer.body.get("reason", f"the door answered "
                                                                                  f"{answer.status}"),
                               timings={"request": self.clock.monotonic() - started})
        move_id = str(answer.body["move"]["id"])
        return await self.drive(host, move_id, started=started, marks=marks)

    async def drive(self, host: str, move_id: str, *, started: float | None = None,
                    marks: dict[str, float] | None = None) -> MoveOutcome:
        """Step an already requested move to its close. Safe to call again after a crash: it reads everything."""
        started = self.clock.monotonic() if started is None else started
        marks = {} if marks is None else marks
        deadline = started + self.t.within_s
        stage: Stage = "request"
        reason = ""
        passes = 0
        while passes < self.t.max_passes:
            passes += 1
            record = (await self.ledger.read_record(host)).state
            claim = (await self.ledger.read_claim(host)).state
            stage, stop = stage_of(record, claim, move_id)
            marks.setdefault(stage, self.clock.monotonic())
            log.info("move pass", extra={"host": host, "op": move_id, "stage": stage, "pass": passes})
            if stage == "done" or (stage == "request" and stop):
                reason = stop
                break
            if self.clock.monotonic() > deadline:
                reason = f"the move did not finish within {self.t.within_s:g} s; it stopped at {stage}"
                break
            assert record is not None
            src = await self.src.step(host, stage, record, claim)
            if src.stop:
                reason = src.stop
                break
            if src.closed:
                continue
            from_region = record.move.from_ if record.move is not None else ""
            tgt = await self.tgt.step(host, stage, record, claim, from_region or self.source.ctx.region)
            if tgt.stop:
                reason = tgt.stop
                break
            if tgt.closed:
                continue
            if stage in ("aborting", "reverting", "rolling_back", "finalizing"):
                wakes = [w for w in (src.wake_at, tgt.wake_at) if w is not None]
                why = "; ".join(r for r in (src.wait, tgt.wait) if r)
                if wakes:  # a park waits out its horizon (§6.4): wake then
                    wait_s = max(0.0, (min(wakes) - self.clock.now_ms()) / 1000)
                    await self.clock.sleep(min(wait_s, max(0.0, deadline - self.clock.monotonic())))
                elif why and "waiting" not in why:
                    reason = why
                    break
            elif stage == "preparing" and (src.wait or tgt.wait):  # not ready yet: poll again shortly
                await self.clock.sleep(self.t.poll_s)
        else:
            reason = f"the move took more than {self.t.max_passes} passes; it stopped at {stage}"
        return await self._outcome(host, move_id, stage, reason, started, marks, passes)

    async def _outcome(self, host: str, move_id: str, stage: Stage, reason: str, started: float,
                       marks: dict[str, float], passes: int) -> MoveOutcome:
        record = (await self.ledger.read_record(host)).state
        claim = (await self.ledger.read_claim(host)).state
        end = self.clock.monotonic()
        order = [s for s in STAGES if s in marks]
        timings: dict[str, float] = {s: round((marks[order[i + 1]] if i + 1 < len(order) else end) - marks[s], 3)
                   for i, s in enumerate(order)}
        timings["total"] = round(end - started, 3)
        move = record.move if record is not None else None
        last = record.last_move if record is not None else None
        closed = move is None and last is not None and last.id == move_id and last.outcome == "done"
        committed = closed or (move is not None and move.id == move_id and move.committed_at is not None)
        opened = closed or (move is not None and move.id == move_id and move.opened_at is not None)
        exec_box = claim.op.exec if claim is not None else ""
        ok = closed and claim is not None and claim.op.kind == "serving" and exec_box == \
            self.target.worker.box.label
        if ok:
            reason = ""
        elif not reason:
            reason = f"the move stopped at {stage}"
        return MoveOutcome(host, move_id, ok, stage, reason, exec_box, committed, opened, closed, timings, passes)


async def run_move(host: str, *, to: str, deployment: Deployment, source: SourceSide, target: TargetSide,
                   cut: CutMode = "auto", who: Identity | None = None, timings: Timings = FAST) -> MoveOutcome:
    """Move ``host`` from the source box to the target box (in region ``to``) and close it (§7.1-§7.9)."""
    return await MoveRun(deployment, source, target, timings).run(host, to=to, cut=cut, who=who)


__all__ = ["FAST", "STAGES", "Deployment", "MoveOutcome", "MoveRun", "SourceSide", "Stage", "TargetSide",
           "Timings", "run_move"]
