"""The checks a rehearsal passes (spec §14.4): after a move of ``moveprobe``, "the key verifies, ... every timer
ran exactly once around the cut, no background row is missing, and no copy remains in a live namespace of the
region that lost". The demo prints them and the end-to-end and crash-matrix tests require them.

Each check answers in plain words what it saw, so a failing rehearsal says what to look at.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

from bus.log import EventLog
from bus.subjects import LEDGER_STREAM, ledger_subject
from events.base import decode
from events.envelope import Transition
from events.record import Move
from moveprobe.acks import Ack, RowAck, TickAck, TimerAck, missing_from_db, read_acks
from services.objstore.port import ObjectStore

ONCE_TIMER = "once"
LIVE_EXEMPT = ("superseded/", "move-receipts/", "move-snapshots/", "retired/")
"""Where a region keeps retired copies, receipts and a completed move's snapshots on purpose (§6.4 parks, §7.3
receipts, ruling K19 "F3's retention of snapshots covers completed moves"; all removed by the residency cleanup,
§16 F3 after the hold of M7), and the manifests of what retention deleted from them (issue 16 item 7): not a live
namespace."""


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str

    def line(self) -> str:
        return f"{'ok ' if self.ok else 'FAILED'} {self.name}: {self.detail}"


def _get(port: int, path: str, timeout_s: float = 5.0) -> object:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout_s) as resp:
        return json.loads(resp.read())


def key_verifies(port: int) -> Check:
    """moveprobe verifies ``instance.key`` against its database at every boot and refuses readiness on a
    mismatch; serving and ready on the target is the verification."""
    status = _get(port, "/status")
    assert isinstance(status, dict)
    ok = bool(status.get("initialized")) and status.get("not_ready") is None
    why = "verified at boot on the target" if ok else f"not ready: {status.get('not_ready')}"
    return Check("the key verifies", ok, why)


def unanswered_deliveries(logs: Sequence[Path], host: str) -> frozenset[tuple[str, int]]:
    """``(timer, due_at)`` of every delivery to ``host`` a box's runner logged as unanswered (§9.4 runner: no answer
    within its timeout, so the outcome is unknown and the timer stays due): the app may have applied it, and the
    next delivery of the same due time is then a repeat the app deduplicates."""
    out: set[tuple[str, int]] = set()
    for path in logs:
        if not path.exists():
            continue
        for line in path.read_text(errors="replace").splitlines():
            if '"no answer"' not in line or '"phase": "timer"' not in line:
                continue
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            if entry.get("host") == host and entry.get("reason") == "no answer" and \
                    isinstance(entry.get("timer"), str) and isinstance(entry.get("due_at"), int):
                out.add((entry["timer"], entry["due_at"]))
    return frozenset(out)


def timers_once(port: int, *, cut_at_ms: int | None, now_ms: int, once_due_ms: int | None,
                lost_runs: frozenset[tuple[str, int | None]] = frozenset(), repeats_allowed: int = 0,
                unanswered: frozenset[tuple[str, int]] = frozenset()) -> Check:
    """Every timer run names a due time that ran once and only once, the schedule's due times only advance
    (missed occurrences are coalesced by design, §9.4 runner), the once-timer ran exactly once when it was due,
    and the schedule runs after the cut. ``lost_runs`` are ``(name, due)`` runs the app acknowledged in a
    session declared lost (INV-2's exemption): a run lost that way is no failure, nor is its one run again in the
    next session (the app's row of it reached the bucket, the runner's record of it did not).

    The runner delivers at least once, and the app applies a delivery id once, counting the repeats: a repeat is
    what a runner killed between the app's answer and its bookkeeping leaves, one at most per runner death.
    ``repeats_allowed`` is the number of runner deaths the caller caused (0 for a move nothing killed). A repeat of
    a delivery the runner logged as unanswered (``unanswered``, :func:`unanswered_deliveries`: the app applied it
    after the runner's timeout) is at-least-once working as designed and is not counted; any other repeat beyond
    ``repeats_allowed`` is a failure, so a bookkeeping regression (a snapshot that forgot a delivery) is never hidden
    by the app's deduplication."""
    body = _get(port, "/timers/runs")
    assert isinstance(body, dict)
    runs = [r for r in body.get("runs", []) if isinstance(r, dict)]
    repeats = [r for r in body.get("repeats", []) if isinstance(r, dict)]
    slots = Counter((r.get("name"), r.get("due_at_ms")) for r in runs if r.get("due_at_ms") is not None)
    twice = sorted(f"{n}@{d}" for (n, d), c in slots.items() if c > (2 if (n, d) in lost_runs else 1))
    once_runs = sum(1 for r in runs if r.get("name") == ONCE_TIMER)
    once_lost = any(name == ONCE_TIMER for name, _ in lost_runs)
    problems = []
    if twice:
        problems.append(f"ran more than once: {', '.join(twice[:5])}")
    unexplained = [r for r in repeats if (r.get("name"), r.get("due_at_ms")) not in unanswered]
    if len(unexplained) > repeats_allowed:
        again = ", ".join(f"{r.get('name')}@{r.get('due_at_ms')}" for r in unexplained[:5])
        problems.append(f"{len(unexplained)} deliveries repeated one the app had applied ({again}), more than the "
                        f"{repeats_allowed} a killed runner can leave (and no runner logged them unanswered)")
    # a once-timer run in a session declared lost may be lost (0 runs) or, when the app's row of it reached the
    # bucket but the runner's record of it did not, run again in the next session (2): both are the declared loss
    if once_due_ms is not None and once_due_ms < now_ms and once_runs != 1 and not (once_lost and once_runs in (0, 2)):
        problems.append(f"the once-timer ran {once_runs} times")
    schedule = [r for r in runs if r.get("name") != ONCE_TIMER and r.get("due_at_ms") is not None]
    dues = [int(r["due_at_ms"]) for r in schedule]
    if dues != sorted(set(dues)):
        problems.append("the schedule's due times went backwards or repeated across the cut")
    before = after = 0
    if cut_at_ms is not None:
        before = sum(1 for r in schedule if int(r.get("received_at_ms") or 0) < cut_at_ms)
        after = len(schedule) - before
        if after == 0:
            problems.append(f"the schedule ran {before} times before the cut and never after it")
    detail = "; ".join(problems) or (f"{len(runs)} runs ({before} before the cut, {after} after), each due time "
                                     f"once, the once-timer {once_runs} time{'' if once_runs == 1 else 's'}")
    if lost_runs and not problems:
        detail += f"; {len(lost_runs)} runs were in a session declared lost"
    if repeats and not problems:
        detail += f"; {len(repeats)} repeated deliver{'y' if len(repeats) == 1 else 'ies'} applied once (a runner died)"
    return Check("every timer ran exactly once around the cut", not problems, detail)


@dataclass(frozen=True)
class LossWindow:
    """A writer session whose loss the system declared (``writes_lost``, §5.1 step 9, D§6): box ``box``'s
    writes acknowledged between its admission (``start_ms``) and its successor's (``end_ms``)."""

    box: str
    session: int
    start_ms: int
    end_ms: int

    def covers(self, box: str, ts_ms: int) -> bool:
        return box == self.box and self.start_ms <= ts_ms <= self.end_ms


async def declared_losses(events: EventLog, host: str) -> list[LossWindow]:
    """Every ``writes_lost`` declaration in the host's claim history, as the time window of the session it names."""
    admitted: dict[int, tuple[str, int]] = {}
    out: dict[tuple[str, int], LossWindow] = {}
    async for m in events.replay(LEDGER_STREAM, subject=ledger_subject("claim", host)):
        t = decode(m.data, Transition)
        if t.claim is None or t.claim.holder is None:
            continue
        for a in t.claim.holder.admissions:
            admitted.setdefault(a.session, (a.box, t.meta.at))
            for lost in (a.writes_lost, *a.additional_writes_lost):
                if lost is not None and (lost.box, lost.session) not in out:
                    start = admitted.get(lost.session, (lost.box, 0))[1]
                    out[(lost.box, lost.session)] = LossWindow(lost.box, lost.session, start, admitted[a.session][1])
    return list(out.values())


def nothing_missing(db_path: Path, ack_logs: Sequence[tuple[Path, str]], host: str,
                    declared: Sequence[LossWindow] = ()) -> Check:
    """Every write, background row and timer run the app acknowledged, on either box, is in the target's
    database, unless a ``writes_lost`` declaration covers it (INV-2: the session that acknowledged it was
    declared lost, on the box it ran on). ``ack_logs`` pairs each log with the box its instance ran on."""
    acks: list[tuple[Ack, str]] = [(a, box) for log, box in ack_logs for a in read_acks(log, host=host)]
    missing = missing_from_db(db_path, [a for a, _ in acks])
    box_of = {id(a): box for a, box in acks}
    uncovered = [a for a in missing if not any(w.covers(box_of[id(a)], a.ts_ms) for w in declared)]
    kinds = Counter(type(a).__name__ for a, _ in acks)
    seen = f"{kinds.get(RowAck.__name__, 0)} writes, {kinds.get(TickAck.__name__, 0)} background rows, " \
           f"{kinds.get(TimerAck.__name__, 0)} timer runs acknowledged"
    detail = f"{seen}; {len(uncovered)} missing"
    if len(missing) > len(uncovered):
        detail += f" ({len(missing) - len(uncovered)} more covered by a declared loss of " \
                  f"{', '.join(sorted({f'{w.box} session {w.session}' for w in declared}))})"
    if uncovered:
        boxes = ", ".join(f"{b}: {n}" for b, n in sorted(Counter(box_of[id(a)] for a in uncovered).items()))
        detail += f" (first: {uncovered[0]}; acknowledged on {boxes})"
    return Check("no acknowledged row is missing", not uncovered and bool(acks), detail)


async def no_live_copy(store: ObjectStore, bucket: str, host: str, *, local: Sequence[Path] = ()) -> Check:
    """Nothing of ``host`` is current in the left region's bucket outside the parks, and nothing of it is left
    in the left box's live directories (``local``)."""
    residue = [k for k in await store.list_keys(bucket) if not k.startswith(LIVE_EXEMPT)
               and (host in k or quote(host, safe="") in k)]
    left = [str(p) for p in local if p.exists()]
    ok = not residue and not left
    detail = "none" if ok else f"{len(residue)} objects ({', '.join(residue[:3])}) and local {left}"
    return Check("no copy remains in a live namespace of the region it left", ok, detail)


def ack_logs(acks_dir: Path, host: str, first: str, later: Mapping[str, str]) -> list[tuple[Path, str]]:
    """The acknowledgement logs of ``host``'s instances with the box each ran on: each box's
    ``<host>.<box>.jsonl`` (what the sample app's release names, ``{side_dir}/{host}.{box}.jsonl``), and, for a
    composition that runs the app with its own paths, the first box's ``<host>.jsonl`` and each later box's
    ``<host>.<region>.jsonl`` (``later``: region -> box; the forked worker's heartbeats beside them are not
    acknowledgements). A log that does not exist holds nothing."""
    logs = [(acks_dir / f"{host}.jsonl", first), *((acks_dir / f"{host}.{r}.jsonl", b) for r, b in later.items())]
    for box in dict.fromkeys([first, *later.values()]):
        logs.append((acks_dir / f"{host}.{box}.jsonl", box))
    return logs


async def last_move_state(events: EventLog, host: str, move_id: str) -> Move | None:
    """The record's ``move`` as it stood last, before the close cleared it: the closed move's §13 timings."""
    last = None
    async for m in events.replay(LEDGER_STREAM, subject=ledger_subject("record", host)):
        t = decode(m.data, Transition)
        if t.record is not None and t.record.move is not None and t.record.move.id == move_id:
            last = t.record.move
    return last


async def cut_at(events: EventLog, host: str) -> int | None:
    """When the host's latest move was cut (the record's ``cut_at``), from its history on the stream: a host moved
    again is checked around its last cut."""
    latest = None
    async for m in events.replay(LEDGER_STREAM, subject=ledger_subject("record", host)):
        t = decode(m.data, Transition)
        if t.record is not None and t.record.move is not None and t.record.move.cut_at is not None:
            latest = t.record.move.cut_at
    return latest


async def checks(*, events: EventLog, store: ObjectStore, host: str, port: int, target_db: Path,
                 ack_logs: Sequence[tuple[Path, str]], left_bucket: str, left_local: Sequence[Path],
                 once_after_ms: int, settle_s: float = 15.0, runner_deaths: int = 0,
                 agent_logs: Sequence[Path] = ()) -> list[Check]:
    """The checks of §14.4 after a move, the instance serving on ``port`` on the target box. The timer check
    is given until the once-timer's due time (``once_after_ms`` after the first acknowledgement) plus
    ``settle_s`` to hold. ``runner_deaths``: the agents the caller killed (each may leave one repeated delivery);
    ``agent_logs``: the box agents' JSON logs, whose unanswered deliveries explain their repeats."""
    acks = [(a, box) for log, box in ack_logs for a in read_acks(log, host=host)]
    genesis = min((a.ts_ms for a, _ in acks), default=int(time.time() * 1000))
    cut = await cut_at(events, host)
    declared = await declared_losses(events, host)
    lost_runs = frozenset((a.name, a.due_at_ms) for a, box in acks
                          if isinstance(a, TimerAck) and any(w.covers(box, a.ts_ms) for w in declared))
    deadline = time.monotonic() + settle_s
    while True:
        timers = await asyncio.to_thread(timers_once, port, cut_at_ms=cut, now_ms=int(time.time() * 1000),
                                         once_due_ms=genesis + once_after_ms, lost_runs=lost_runs,
                                         repeats_allowed=runner_deaths,
                                         unanswered=unanswered_deliveries(agent_logs, host))
        once_passed = time.time() * 1000 > genesis + once_after_ms + 1_000  # its run had a second to land
        if (timers.ok and once_passed) or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.2)
    return [
        await asyncio.to_thread(key_verifies, port),
        timers,
        nothing_missing(target_db, ack_logs, host, declared),
        await no_live_copy(store, left_bucket, host, local=left_local),
    ]


__all__ = ["Check", "LossWindow", "ack_logs", "checks", "cut_at", "declared_losses", "key_verifies",
           "last_move_state", "no_live_copy", "nothing_missing", "timers_once", "unanswered_deliveries"]
