"""T11: the readiness budget (spec §7.3 "T11 budget", rev 7.11; digest D§5.3). Pure arithmetic.

The **whole** stop-to-open estimate must fit the operator's cut window (default 120 s), priced from
three measured rates: the cross-region copy path ``xr``, regional S3 ``s3`` and the box's ``disk``
(MiB/s), for a database of ``D`` MiB:

- ``pass = D/s3 + D/disk`` (one regional S3 transfer and one disk transfer of the whole database);
- fixed = stop + final checkpoint and ``SyncAndWait`` + final mirror (the 16 MiB bar at ``xr``) +
  archive build and upload + the target's build (restore, snapshot and anchor: one ``pass`` each) +
  the verification of the built database (``D/disk``) + render + the open (``open_budget``, 5 s);
- attempt 1 = ``pass`` (the probe's cold admission restores the prepared generation again) + 2 s
  (the admission's CAS, purge and ``generation.json``) + 30 s (probe window) + 20 s (settle);
- attempt i > 1 = attempt 1 + ``pass`` (a fresh generation's first upload of the whole database);
- attempts admitted = the largest k <= 3 with fixed + sum of attempts <= window; eligible iff k >= 1.

The spec's worked example leaves 6.0 s of the fixed costs unitemized (stop, checkpoint, archive,
render): they are inputs here, with defaults that sum to 6.0 s.

**Measured rates** (issue 18 item 4): a box measures its disk's write and read rates apart
(:mod:`services.target.rates`); with ``disk_read`` given, the passes price a disk write where the
database is written (the restore) and a disk read where it is read (the snapshot, the anchor, the
verification, a fresh generation's first upload). Without it, one ``disk`` rate prices both, as the
spec's example does. The constants of the probe's protocol (window, settle, admission, open) are the
box's timing profile (:class:`BudgetTiming`): the spec's for production, the fast profile's for the
tests and the demo, whose probe window and cut window are the fast profile's.
"""

from __future__ import annotations

from dataclasses import dataclass

MIRROR_BAR_MIB = 16.0
OPEN_BUDGET_S = 5.0
ADMISSION_S = 2.0
PROBE_WINDOW_S = 30.0
SETTLE_S = 20.0
MAX_ATTEMPTS = 3
DEFAULT_WINDOW_S = 120.0


@dataclass(frozen=True)
class Rates:
    """Measured rates in MiB/s (T11's three paths)."""

    cross_region: float
    regional_s3: float
    disk: float
    """The disk's write rate (and its read rate too when ``disk_read`` is None)."""
    disk_read: float | None = None

    def __post_init__(self) -> None:
        for name in ("cross_region", "regional_s3", "disk"):
            if not getattr(self, name) > 0:
                raise ValueError(f"the {name.replace('_', ' ')} rate must be positive")
        if self.disk_read is not None and not self.disk_read > 0:
            raise ValueError("the disk read rate must be positive")

    @property
    def disk_write(self) -> float:
        return self.disk

    @property
    def read(self) -> float:
        return self.disk_read if self.disk_read is not None else self.disk


@dataclass(frozen=True)
class FixedOverheads:
    """The costs the spec does not itemize, in seconds (defaults sum to the worked example's 6.0 s)."""

    stop_s: float = 2.0
    checkpoint_s: float = 1.0
    archive_s: float = 2.0
    render_s: float = 1.0

    @property
    def total(self) -> float:
        return self.stop_s + self.checkpoint_s + self.archive_s + self.render_s


@dataclass(frozen=True)
class BudgetTiming:
    """The constants of the cut's protocol T11 prices (the box's timing profile)."""

    probe_window_s: float = PROBE_WINDOW_S
    settle_s: float = SETTLE_S
    admission_s: float = ADMISSION_S
    open_budget_s: float = OPEN_BUDGET_S
    overheads: FixedOverheads = FixedOverheads()
    window_s: float = DEFAULT_WINDOW_S
    """The operator's cut window the estimate must fit."""


PRODUCTION_BUDGET = BudgetTiming()
FAST_BUDGET = BudgetTiming(probe_window_s=6.0, settle_s=0.3, admission_s=0.3, open_budget_s=0.5,
                           overheads=FixedOverheads(stop_s=0.5, checkpoint_s=0.2, archive_s=0.3, render_s=0.2),
                           window_s=12.0)
"""The fast profile's (``services.target.probe.FAST``, ``services.source.phases.FAST``): its probe window and settle,
its open budget and cut window, and what its stop, checkpoint, archive, render and admission take on one machine."""


@dataclass(frozen=True)
class Budget:
    db_mib: float
    window_s: float
    pass_s: float
    restore_s: float
    snapshot_s: float
    anchor_s: float
    verify_s: float
    mirror_s: float
    other_s: float
    fixed_s: float
    attempt_costs: tuple[float, ...]  # attempt 1..MAX_ATTEMPTS, whether admitted or not
    attempts: int  # how many the window admits (0: refused)

    @property
    def eligible(self) -> bool:
        return self.attempts >= 1

    @property
    def total_s(self) -> float:
        """Fixed costs plus the admitted attempts (or the first attempt when none is admitted)."""
        return self.fixed_s + sum(self.attempt_costs[: max(self.attempts, 1)])

    @property
    def margin_s(self) -> float:
        return self.window_s - self.total_s

    def summary(self, rates: Rates) -> dict[str, float]:
        """What the readiness report records of T11 (``move status --detail`` prints it): the rates used (MiB/s),
        the database priced, the estimate, the window and the attempts admitted."""
        return {"cross_region_mib_s": round(rates.cross_region, 3), "regional_s3_mib_s": round(rates.regional_s3, 3),
                "disk_write_mib_s": round(rates.disk_write, 3), "disk_read_mib_s": round(rates.read, 3),
                "db_mib": round(self.db_mib, 3), "fixed_s": round(self.fixed_s, 3),
                "first_attempt_s": round(self.attempt_costs[0], 3), "total_s": round(self.total_s, 3),
                "window_s": self.window_s, "attempts": float(self.attempts)}

    def reason(self) -> str:
        """Why T11 refuses, in the operator's words (M-C4's "<reason>")."""
        if self.eligible:
            return ""
        return (f"the cut would take about {self.total_s:.1f} s, more than the {self.window_s:.0f} s window "
                f"allows ({self.fixed_s:.1f} s of fixed costs and a {self.attempt_costs[0]:.1f} s probe attempt)")


def t11(
    db_mib: float,
    rates: Rates,
    *,
    window_s: float = DEFAULT_WINDOW_S,
    overheads: FixedOverheads | None = None,
    open_budget_s: float = OPEN_BUDGET_S,
    timing: BudgetTiming | None = None,
) -> Budget:
    """Price the cut of a ``db_mib`` MiB database and count the probe attempts the window admits. ``timing``, when
    given, sets the window, the overheads and the probe's constants (and overrides ``window_s``, ``overheads`` and
    ``open_budget_s``)."""
    if db_mib < 0:
        raise ValueError("the database size cannot be negative")
    if timing is not None:
        window_s, overheads, open_budget_s = timing.window_s, timing.overheads, timing.open_budget_s
    t = timing or BudgetTiming()
    over = overheads or FixedOverheads()
    write = db_mib / rates.regional_s3 + db_mib / rates.disk_write  # the restore: regional read, disk write
    read = db_mib / rates.read + db_mib / rates.regional_s3  # a snapshot, an anchor, an upload: disk read, S3 write
    pass_s = write if rates.disk_read is None else max(write, read)
    verify_s = db_mib / rates.read
    mirror_s = MIRROR_BAR_MIB / rates.cross_region
    fixed = over.total + mirror_s + write + 2 * read + verify_s + open_budget_s
    first = write + t.admission_s + t.probe_window_s + t.settle_s
    costs = tuple(first if i == 0 else first + read for i in range(MAX_ATTEMPTS))
    admitted, spent = 0, fixed
    for cost in costs:
        if spent + cost > window_s + 1e-9:
            break
        spent += cost
        admitted += 1
    return Budget(
        db_mib=db_mib, window_s=window_s, pass_s=pass_s, restore_s=write, snapshot_s=read, anchor_s=read,
        verify_s=verify_s, mirror_s=mirror_s, other_s=over.total + open_budget_s, fixed_s=fixed,
        attempt_costs=costs, attempts=admitted,
    )


def cross_region_transfer_s(db_mib: float, rates: Rates) -> float:
    """Copying the whole database across regions (the rev 7.5 sealed snapshot transfer T11 refuses)."""
    return db_mib / rates.cross_region
