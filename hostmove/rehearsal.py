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
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

from bus.log import EventLog
from bus.subjects import LEDGER_STREAM, ledger_subject
from events.base import decode
from events.envelope import Transition
from moveprobe.acks import Ack, RowAck, TickAck, TimerAck, missing_from_db, read_acks
from services.objstore.port import ObjectStore

ONCE_TIMER = "once"
LIVE_EXEMPT = ("superseded/", "move-receipts/", "move-snapshots/")
"""Where a region keeps retired copies, receipts and a completed move's snapshots on purpose (§6.4 parks, §7.3
receipts, ruling K19 "F3's retention of snapshots covers completed moves"; all removed by the residency cleanup,
§16 F3 after the hold of M7): not a live namespace."""


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


def timers_once(port: int, *, cut_at_ms: int | None, now_ms: int, once_due_ms: int | None) -> Check:
    """Every timer run names a due time that ran once and only once; the once-timer ran exactly once when it
    was due; the schedule ran on both sides of the cut."""
    body = _get(port, "/timers/runs")
    assert isinstance(body, dict)
    runs = [r for r in body.get("runs", []) if isinstance(r, dict)]
    slots = Counter((r.get("name"), r.get("due_at_ms")) for r in runs if r.get("due_at_ms") is not None)
    twice = sorted(f"{n}@{d}" for (n, d), c in slots.items() if c > 1)
    once_runs = sum(1 for r in runs if r.get("name") == ONCE_TIMER)
    problems = []
    if twice:
        problems.append(f"ran more than once: {', '.join(twice[:5])}")
    if once_due_ms is not None and once_due_ms < now_ms and once_runs != 1:
        problems.append(f"the once-timer ran {once_runs} times")
    if cut_at_ms is not None:
        before = sum(1 for r in runs if r.get("name") != ONCE_TIMER and int(r.get("received_at_ms") or 0) < cut_at_ms)
        after = sum(1 for r in runs if r.get("name") != ONCE_TIMER and int(r.get("received_at_ms") or 0) > cut_at_ms)
        if before == 0 or after == 0:
            problems.append(f"the schedule ran {before} times before the cut and {after} after")
    detail = "; ".join(problems) or (f"{len(runs)} runs, each due time once, the once-timer {once_runs} time"
                                     f"{'' if once_runs == 1 else 's'}")
    return Check("every timer ran exactly once around the cut", not problems, detail)


def nothing_missing(db_path: Path, ack_logs: Sequence[Path], host: str) -> Check:
    """Every write, background row and timer run the app acknowledged, on either box, is in the target's
    database."""
    acks: list[Ack] = []
    for log in ack_logs:
        acks += read_acks(log, host=host)
    missing = missing_from_db(db_path, acks)
    kinds = Counter(type(a).__name__ for a in acks)
    seen = f"{kinds.get(RowAck.__name__, 0)} writes, {kinds.get(TickAck.__name__, 0)} background rows, " \
           f"{kinds.get(TimerAck.__name__, 0)} timer runs acknowledged"
    detail = f"{seen}; {len(missing)} missing" + (f" (first: {missing[0]})" if missing else "")
    return Check("no acknowledged row is missing", not missing and bool(acks), detail)


async def no_live_copy(store: ObjectStore, bucket: str, host: str, *, local: Sequence[Path] = ()) -> Check:
    """Nothing of ``host`` is current in the left region's bucket outside the parks, and nothing of it is left
    in the left box's live directories (``local``)."""
    residue = [k for k in await store.list_keys(bucket) if not k.startswith(LIVE_EXEMPT)
               and (host in k or quote(host, safe="") in k)]
    left = [str(p) for p in local if p.exists()]
    ok = not residue and not left
    detail = "none" if ok else f"{len(residue)} objects ({', '.join(residue[:3])}) and local {left}"
    return Check("no copy remains in a live namespace of the region it left", ok, detail)


def ack_logs(acks_dir: Path, host: str, regions: Sequence[str]) -> list[Path]:
    """The acknowledgement logs of ``host``'s instances: the first box's ``<host>.jsonl`` and each later box's
    ``<host>.<region>.jsonl`` (the forked worker's heartbeats beside them are not acknowledgements)."""
    return [acks_dir / f"{host}.jsonl", *(acks_dir / f"{host}.{r}.jsonl" for r in regions)]


async def cut_at(events: EventLog, host: str) -> int | None:
    """When the host's move was cut (the record's ``cut_at``), from its history on the stream."""
    async for m in events.replay(LEDGER_STREAM, subject=ledger_subject("record", host)):
        t = decode(m.data, Transition)
        if t.record is not None and t.record.move is not None and t.record.move.cut_at is not None:
            return t.record.move.cut_at
    return None


async def checks(*, events: EventLog, store: ObjectStore, host: str, port: int, target_db: Path,
                 ack_logs: Sequence[Path], left_bucket: str, left_local: Sequence[Path], once_after_ms: int,
                 settle_s: float = 15.0) -> list[Check]:
    """The checks of §14.4 after a move, the instance serving on ``port`` on the target box. The timer check
    is given until the once-timer's due time (``once_after_ms`` after the first acknowledgement) plus
    ``settle_s`` to hold."""
    acks = [a for log in ack_logs for a in read_acks(log, host=host)]
    genesis = min((a.ts_ms for a in acks), default=int(time.time() * 1000))
    cut = await cut_at(events, host)
    deadline = time.monotonic() + settle_s
    while True:
        timers = await asyncio.to_thread(timers_once, port, cut_at_ms=cut, now_ms=int(time.time() * 1000),
                                         once_due_ms=genesis + once_after_ms)
        if timers.ok or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.2)
    return [
        await asyncio.to_thread(key_verifies, port),
        timers,
        nothing_missing(target_db, ack_logs, host),
        await no_live_copy(store, left_bucket, host, local=left_local),
    ]


__all__ = ["Check", "ack_logs", "checks", "cut_at", "key_verifies", "no_live_copy", "nothing_missing", "timers_once"]
