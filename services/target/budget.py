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

    def __post_init__(self) -> None:
        for name in ("cross_region", "regional_s3", "disk"):
            if not getattr(self, name) > 0:
                raise ValueError(f"the {name.replace('_', ' ')} rate must be positive")


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
) -> Budget:
    """Price the cut of a ``db_mib`` MiB database and count the probe attempts the window admits."""
    if db_mib < 0:
        raise ValueError("the database size cannot be negative")
    over = overheads or FixedOverheads()
    pass_s = db_mib / rates.regional_s3 + db_mib / rates.disk
    verify_s = db_mib / rates.disk
    mirror_s = MIRROR_BAR_MIB / rates.cross_region
    fixed = over.total + mirror_s + 3 * pass_s + verify_s + open_budget_s
    first = pass_s + ADMISSION_S + PROBE_WINDOW_S + SETTLE_S
    costs = tuple(first if i == 0 else first + pass_s for i in range(MAX_ATTEMPTS))
    admitted, spent = 0, fixed
    for cost in costs:
        if spent + cost > window_s + 1e-9:
            break
        spent += cost
        admitted += 1
    return Budget(
        db_mib=db_mib, window_s=window_s, pass_s=pass_s, restore_s=pass_s, snapshot_s=pass_s, anchor_s=pass_s,
        verify_s=verify_s, mirror_s=mirror_s, other_s=over.total + open_budget_s, fixed_s=fixed,
        attempt_costs=costs, attempts=admitted,
    )


def cross_region_transfer_s(db_mib: float, rates: Rates) -> float:
    """Copying the whole database across regions (the rev 7.5 sealed snapshot transfer T11 refuses)."""
    return db_mib / rates.cross_region
