"""The host lifecycle claim, ``control/hosts/<host>.json`` (spec §0.4, §5.1, §6.4, §7.14, §19;
protocol digest D§2.1).

Rewritten whole by compare-and-swap and never deleted (C5a). ``gen`` is the per-write revision
(not a data generation, J-D2): +1 on every write, so identical bytes never reproduce an old ETag.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

import msgspec

from events.base import Durable, Ident, Millis, check_gen

OpKind = Literal[
    "free",
    "creating",
    "serving",
    "moving",
    "landing",
    "reverting",
    "restoring",
    "pushing",
    "relocating",
    "deleting",
    "parking",
    "purging",
    "placing",
]
"""Op kinds (§19.1, claim spec §4). ``free``: no holder (a purged or never-created host)."""

ObligationKind = Literal[
    "park-superseded", "park-staging", "park-replica", "park-generation", "park-sweep", "park-local"
]


class WriterRef(Durable, frozen=True, omit_defaults=True):
    """A writer session a loss declaration names (§5.1 step 9, D§6: ``{box, generation, session,
    remote_max_txid}``; R14-2: unique by ``(box, session)``). Writes of that session past
    ``remote_max_txid`` are declared lost. ``local_txid`` is the session's local position last observed (the TXID
    the box's own copy of it reached, when the admitting box could read that copy), 0 when none could be read: what
    may be missing lies between the two."""

    box: Ident
    session: int
    generation: str = ""
    remote_max_txid: int = 0
    local_txid: int = 0


class Predecessor(Durable, frozen=True, omit_defaults=True):
    """The writer an admission supersedes (§7.14)."""

    session: int = 0
    box: str = ""
    generation: str = ""
    stamp: int = 0


class Admission(Durable, frozen=True, omit_defaults=True):
    """One admitted writer (``AdmitWriter``, §5.1 step 9, §7.14). Cold while ruling P7 stands.

    Encoded with its fields at their defaults omitted (``writes_lost?``, ``additional_writes_lost?``, D§2.1; an
    empty ``coverage``, ``covered`` false, ``mode`` cold; the same in :class:`Predecessor` and :class:`WriterRef`):
    every reader decodes the claim through :class:`Claim`, which restores each missing field to its default, so the
    meaning is the same and each of the eight records the claim spec keeps (item 8) costs about 215 bytes, not 290
    (issue 16: the claim is bounded by its records)."""

    session: int
    box: Ident
    generation: str
    region: Ident
    predecessor: Predecessor | None = None
    predecessor_region: str = ""
    mode: Literal["cold", "warm"] = "cold"
    coverage: str = ""
    covered: bool = False
    writes_lost: WriterRef | None = None
    additional_writes_lost: tuple[WriterRef, ...] = ()


class AppRef(Durable, frozen=True):
    """The app release an incarnation runs (issue 18): ``apps/<name>/releases/<release>.json`` in the deployment
    bucket, whose bytes hash to ``digest`` (``sha256:<hex>``). Every start on every box renders from it."""

    name: Ident
    release: int
    digest: str


class Holder(Durable, frozen=True):
    """The owning incarnation and its writer (C1, C3a). ``location`` is immutable while it holds; so is ``app``,
    the release the incarnation was created with (None: a host created before app releases, or by a composition
    that runs a fixed app)."""

    incarnation: Ident
    location: Ident
    generation: str = ""
    stamp: int = 0
    session: int = 0
    writer_box: str = ""
    admissions: tuple[Admission, ...] = ()
    app: AppRef | None = None


class Op(Durable, frozen=True):
    """The one running operation (claim spec §4). ``exec`` is the execution holder (a box, or
    ``"none"``); ``participants`` is ``[source, target]`` for a move (§7.1, L15)."""

    kind: OpKind = "free"
    id: str = ""
    phase: str = ""
    intent: dict[str, Any] = msgspec.field(default_factory=dict)
    journal: dict[str, Any] = msgspec.field(default_factory=dict)
    exec: str = "none"
    participants: tuple[Ident, ...] = ()
    source_stamp: int = 0


class Touched(Durable, frozen=True):
    """Regions and boxes an operation may have written, CAS-added before the first write (K12)."""

    regions: tuple[Ident, ...] = ()
    boxes: tuple[Ident, ...] = ()
    complete: bool = False


class Scope(Durable, frozen=True):
    """A retirement scope (§6.4): what a park may touch and the horizon it waits for."""

    location: Ident
    incarnation: str = ""
    evidence_at: Millis | None = None
    request_limit_ms: int = 120_000


class Obligation(Durable, frozen=True):
    """A durable chore (§6.4, K8): release waits for every obligation to acknowledge."""

    kind: ObligationKind
    op: Ident
    region: Ident
    owner: Ident
    generation: str = ""
    scope: Scope | None = None
    not_before: Millis | None = None


class LostBox(Durable, frozen=True):
    """A quarantined box (claim §7.2): fenced, cited by its fence object."""

    box: Ident
    fence: str = ""
    at: Millis | None = None
    retired_at: Millis | None = None
    """The box, started again, retired every local artifact of this host (its quarantine, §7.10): only then may an
    operator readmit it (``hostmove box readmit``)."""


class Claim(Durable, frozen=True):
    """``control/hosts/<host>.json``."""

    __durable_root__: ClassVar[bool] = True

    host: Ident
    gen: int
    holder: Holder | None = None
    op: Op = msgspec.field(default_factory=Op)
    touched: Touched = msgspec.field(default_factory=Touched)
    inventory: dict[str, Any] = msgspec.field(default_factory=dict)
    obligations: tuple[Obligation, ...] = ()
    lost: tuple[LostBox, ...] = ()
    retired_incarnations: tuple[Ident, ...] = ()
    quiet_after: dict[str, Millis] = msgspec.field(default_factory=dict)
    cancelled_creates: tuple[Ident, ...] = ()

    def __post_init__(self) -> None:
        super().__post_init__()
        check_gen(self.gen, "Claim.gen")
