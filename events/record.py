"""The host record's move fields, ``control/records/<host>.json`` (spec §7.2; digest D§2.2).

The record carries the move's phase journal; the claim carries the cross-operation serialization
(§19). Each move decision is one record CAS and the claim follows it (§7.5). The close is one CAS
clearing ``move`` and setting ``last_move`` (ruling M4). Times are milliseconds since the epoch.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

import msgspec

from events.base import Durable, Ident, Millis, check_gen

MoveState = Literal[
    "preparing", "ready", "cutting", "landing", "committed", "rolling_back", "reverting",
    "restoring", "done", "rolled_back", "aborted", "stuck",
]


class MoveInputs(Durable, frozen=True):
    """The pinned inputs the cut's admission compares (§7.4 ``admitted``)."""

    bundle_etags: dict[str, str] = msgspec.field(default_factory=dict)
    overlay_etag: str = ""
    release: str = ""
    files_plain: str = ""
    env_report: str = ""


class FilesDigest(Durable, frozen=True):
    plain: str = ""
    sealed: str = ""
    bytes: int = 0
    entries: int = 0


class MoveSource(Durable, frozen=True):
    """What the source proved at ``stopped`` (§7.4)."""

    replication: str = "stream"
    next_due: int = 0
    db_sha256: str = ""
    files: FilesDigest = msgspec.field(default_factory=FilesDigest)
    timers_sha256: str = ""
    evidence: str = ""


class MoveLanding(Durable, frozen=True):
    installed_db_sha256: str = ""


class ReturnSeal(Durable, frozen=True):
    """The return lane's seal (§7.8 ``returning``): ``moves/<host>/<rb>/`` in the source region's bucket, each name
    relative to its subprefix with its exact version, and ``N'`` the returned snapshot's TXID. ``from_db`` is false
    when the target never restored a database and returned the staged seal as it was given."""

    n: int
    replica: dict[str, str] = msgspec.field(default_factory=dict)
    files: dict[str, str] = msgspec.field(default_factory=dict)
    timers: dict[str, str] = msgspec.field(default_factory=dict)
    from_db: bool = True


class Rollback(Durable, frozen=True):
    """A rollback's own journal (§7.8). ``seal`` is the dirty return's (``returned``); ``recovery_inputs`` what the
    source's dirty install rendered (``configured``, ``recovery.inputs``); ``probe_failures`` counts the source's
    failed recovery probe attempts (nine: ``stuck``); ``retried_at`` the operator's last ``resolve --retry``."""

    id: Ident
    requested_at: Millis | None = None
    reason: str = ""
    target_phase: str = ""
    dirty: bool = False
    evidence: str = ""
    source_phase: str = ""
    recovered_at: Millis | None = None
    opened_at: Millis | None = None
    target_parked_at: Millis | None = None
    release_deadline: Millis | None = None
    seal: ReturnSeal | None = None
    recovery_inputs: MoveInputs | None = None
    probe_failures: int = 0
    retried_at: Millis | None = None


class Move(Durable, frozen=True):
    """``record.move`` (§7.2). Guarded on every box CAS by ``id`` and ``incarnation`` (K5)."""

    id: Ident
    incarnation: Ident
    to: Ident
    state: MoveState
    cut: Literal["auto", "manual"] = "auto"
    requested_by: str = ""
    requested_at: Millis | None = None
    updated_at: Millis | None = None
    ready_at: Millis | None = None
    inputs: MoveInputs = msgspec.field(default_factory=MoveInputs)
    cut_phase: str = ""
    cut_at: Millis | None = None
    cut_budget_s: float = 0.0
    cut_deadline: Millis | None = None
    source: MoveSource = msgspec.field(default_factory=MoveSource)
    flipped_at: Millis | None = None
    landing_deadline: Millis | None = None
    landing_phase: str = ""
    landing: MoveLanding = msgspec.field(default_factory=MoveLanding)
    committed_at: Millis | None = None
    opened_at: Millis | None = None
    source_parked_at: Millis | None = None
    rollback: Rollback | None = None
    reason: str = ""
    from_: str = msgspec.field(default="", name="from")
    recovery_failed_at: Millis | None = None
    """A ``reverting`` recovery's first failed probe (§7.4: fifteen minutes of them is ``stuck``)."""
    stuck_at: Millis | None = None
    retried_at: Millis | None = None
    """The operator's last ``resolve --retry`` of this move (§7.10)."""
    target_fenced: str = ""
    """The fence key (``control/box-fences/<target>.json``) of a target fenced after the record's commit (§7.10
    L14): its open is waived and the move closes without it (:mod:`services.move.fenced_target`)."""


class LastMove(Durable, frozen=True):
    """What the close leaves behind (ruling M4)."""

    id: Ident
    outcome: Literal["done", "rolled_back", "aborted"]
    at: Millis | None = None


class Record(Durable, frozen=True):
    """``control/records/<host>.json``: the move fields this system owns."""

    __durable_root__: ClassVar[bool] = True

    host: Ident
    gen: int
    move: Move | None = None
    last_move: LastMove | None = None
    extra: dict[str, Any] = msgspec.field(default_factory=dict)

    def __post_init__(self) -> None:
        super().__post_init__()
        check_gen(self.gen, "Record.gen")
