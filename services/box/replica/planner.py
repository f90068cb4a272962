"""The restore planner: pure, listing in, plan or refusal out (spec §5.1 steps 4, 5, 6, 8; D§7).

**Root rule** (step 4, step 8 "root advancement"). The root is the newest current level-9 file of
the named generation whose ``max_txid`` is at least the pinned ``snapshot_txid`` (a successor
snapshot; one that fails its CRC-64 check is not a *verified* successor, and the executor re-plans
without it). When no successor is current, the root is the pinned snapshot, opened by its version
id. A generation with no pinned root (the origin, a fresh generation) roots at its newest snapshot
when it has one, else at nothing (TXID 0), where the chain must start with a full file.

**Chain, overlap rule and preference order** (step 4, Litestream's ``CalcRestorePlan``). From
``current = root.max`` take, among current files at levels 0 to 8, one with
``min <= current + 1`` and ``max > current`` (overlap allowed: a compacted ``[91, 110]`` over a
snapshot at 100 is exact, its pages are the state at 110), preferring the highest ``max``, then
the lowest ``min``, then the higher level; set ``current = max``; repeat.

**Refusals** (step 5, fail closed): a gap (a current file starts beyond ``current + 1`` once
nothing extends the range: Litestream's "non-contiguous ltx files"; step 6: a gap is a missing or
not-yet-landed object, never healthy), a pinned root whose key does not name ``[1, snapshot_txid]``
at level 9, and a final TXID other than the one required. CRC-64 and ``PRAGMA integrity_check``
refusals need the bytes and are the executor's (:mod:`services.box.replica.restore`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from services.box.replica.layout import FileRef, parse_ltx_name
from services.box.replica.ltx import SNAPSHOT_LEVEL


@dataclass(frozen=True)
class PinnedRoot:
    """The install's snapshot identity (``generation.json`` / ``install.json``, §5.1 step 3)."""

    key: str
    version_id: str | None
    txid: int
    crc64: int | None = None


@dataclass(frozen=True)
class Plan:
    root: FileRef | None
    chain: tuple[FileRef, ...]
    final_txid: int
    root_is_pinned: bool = False

    @property
    def files(self) -> tuple[FileRef, ...]:
        return ((self.root,) if self.root is not None else ()) + self.chain


@dataclass(frozen=True)
class Refusal:
    """Why a restore must not produce a database. ``reason`` is a stable code; ``message`` says
    what is wrong in plain words, without secrets."""

    reason: str
    message: str
    details: dict[str, int | str] = field(default_factory=dict)


GAP = "gap"
WRONG_TXID = "wrong_txid"
NO_ROOT = "no_root"
ROOT_MISMATCH = "root_mismatch"


def _better(a: FileRef, b: FileRef) -> bool:
    """Preference order: higher max, then lower min, then higher level."""
    return (a.max_txid, -a.min_txid, a.level) > (b.max_txid, -b.min_txid, b.level)


def extend_chain(start: int, files: Iterable[FileRef]) -> tuple[list[FileRef], int]:
    """Follow the overlap rule from TXID ``start`` over ``files`` (levels 0..8 only)."""
    candidates = [f for f in files if f.level < SNAPSHOT_LEVEL]
    chain: list[FileRef] = []
    current = start
    while True:
        best: FileRef | None = None
        for f in candidates:
            if f.min_txid <= current + 1 and f.max_txid > current and (best is None or _better(f, best)):
                best = f
        if best is None:
            return chain, current
        chain.append(best)
        current = best.max_txid


def newest_level0(files: Iterable[FileRef]) -> FileRef | None:
    """The newest current level-0 file: where a fresh writer reads its position (§5.1 step 7)."""
    best: FileRef | None = None
    for f in files:
        if f.level == 0 and (best is None or f.max_txid > best.max_txid):
            best = f
    return best


def replication_position(files: Iterable[FileRef]) -> int:
    """The TXID a writer continues after: the newest level-0 file's max, 0 when there is none."""
    newest = newest_level0(files)
    return newest.max_txid if newest is not None else 0


def choose_root(
    files: Sequence[FileRef], pinned: PinnedRoot | None, exclude: frozenset[str] = frozenset()
) -> tuple[FileRef | None, bool] | Refusal:
    """(root, is_pinned) by the root rule, or a refusal when the pinned key is malformed."""
    floor = pinned.txid if pinned is not None else 0
    successors = [
        f for f in files
        if f.level == SNAPSHOT_LEVEL and f.min_txid == 1 and f.max_txid >= floor and f.key not in exclude
    ]
    if successors:
        return max(successors, key=lambda f: f.max_txid), False
    if pinned is None:
        return None, False
    parts = pinned.key.rsplit("/", 2)
    parsed = parse_ltx_name("/".join(parts[-2:])) if len(parts) >= 2 else None
    if parsed != (SNAPSHOT_LEVEL, 1, pinned.txid):
        return Refusal(
            ROOT_MISMATCH,
            f"the pinned snapshot {pinned.key!r} does not name a level-9 snapshot [1, {pinned.txid}]",
        )
    if pinned.key in exclude:
        return Refusal(NO_ROOT, f"no usable root: the pinned snapshot {pinned.key!r} failed verification")
    return FileRef(SNAPSHOT_LEVEL, 1, pinned.txid, pinned.key, pinned.version_id), True


def plan_restore(
    files: Sequence[FileRef],
    *,
    pinned: PinnedRoot | None = None,
    required_txid: int | None = None,
    exclude_roots: frozenset[str] = frozenset(),
) -> Plan | Refusal:
    """Plan a restore of one generation from its **current** files (or a seal's pinned set)."""
    rooted = choose_root(files, pinned, exclude_roots)
    if isinstance(rooted, Refusal):
        return rooted
    root, is_pinned = rooted
    start = root.max_txid if root is not None else 0
    chain, current = extend_chain(start, files)
    beyond = [f for f in files if f.level < SNAPSHOT_LEVEL and f.max_txid > current]
    if beyond:
        nxt = min(f.min_txid for f in beyond)
        return Refusal(
            GAP,
            f"non-contiguous ltx files: have up to {current} but next file starts at {nxt}; "
            "a file is missing or has not landed yet",
            {"have": current, "next": nxt},
        )
    if required_txid is not None and current != required_txid:
        return Refusal(
            WRONG_TXID,
            f"the replica restores to TXID {current}, but exactly {required_txid} is required",
            {"have": current, "required": required_txid},
        )
    return Plan(root, tuple(chain), current, is_pinned)
