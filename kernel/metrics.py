"""The Prometheus metrics of every service: their one set of definitions (issue 19 item 5; ARCHITECTURE §9).

Every ``hostmove serve`` service serves :data:`REGISTRY` as ``/metrics`` on its health port
(:mod:`hostmove.health`); each part of the code that does the thing counted records it here:

- **moves** (the ledger, at the record transition it commits, so each move is counted once in the deployment, by
  the process that wrote it): ``hostmove_moves_started_total`` (a record gains a move, §7.2),
  ``hostmove_moves_ended_total{outcome}`` (the close, ruling M4: ``done``, ``rolled_back``, ``aborted``) and, at the
  close, ``hostmove_move_phase_seconds{phase}`` from the record's own journal times (:func:`move_observation`):
  ``prepare`` (``requested_at`` to ``ready_at``, §7.3), ``cut`` (``cut_at`` to ``flipped_at``, §7.4), ``land``
  (``flipped_at`` to ``committed_at``, §7.6-§7.9), ``offline`` (``cut_at`` to ``opened_at``: the stop-to-open window
  T11 prices against the cut window) and ``close`` (``opened_at`` to the close). Beside them
  ``hostmove_move_phase_budget_seconds{phase}``: the cut window for ``cut`` and ``offline`` (``cut_budget_s``), the
  landing's (``landing_deadline - flipped_at``) and the prepare bound (§7.11, set by a box from its profile); the
  close has no budget;
- **the ledger**: ``hostmove_ledger_transitions_total{object,outcome}``, ``hostmove_ledger_cas_conflicts_total``
  (each lost CAS) and ``hostmove_ledger_retries_total{object,reason}`` (each fresh read again: ``conflict``, the
  stream ahead of the read ``stale_read``, a publish tried again ``publish``);
- **S3** (the aioboto3 adapter): ``hostmove_s3_requests_total{operation,status}`` (``status`` the HTTP status, or
  ``unreachable``) and ``hostmove_s3_request_seconds{operation}``;
- **JetStream**: ``hostmove_jetstream_publish_seconds{stream,outcome}``; a durable consumer's
  ``hostmove_consumer_deliveries_total``, ``hostmove_consumer_redeliveries_total`` and ``hostmove_consumer_pending``
  (``num_pending`` at its last delivery), each by ``durable``;
- **alerts**: ``hostmove_alerts_total{kind}``, each alert and incident this process raised;
- **a box**: ``hostmove_box_instances_running{box}`` and ``hostmove_box_routes_held{box}``; its backstop (issue 19
  item 2): ``hostmove_box_scans_total{box}`` (each look at the claims ended) and
  ``hostmove_box_scan_claims_read_total{box}`` (the claims it GET: new or changed since its last look).

Recording never fails its caller and never blocks; the labels are bounded sets (no host names: a fleet has many).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from events.record import Move, Record
from kernel import ports

__all__ = [
    "CONTENT_TYPE", "PHASES", "REGISTRY", "MoveObservation", "alert_raised", "delivered", "exposition",
    "move_observation", "observe_record", "scanned", "set_budget",
]

REGISTRY: Final = CollectorRegistry()
ProcessCollector(registry=REGISTRY)
CONTENT_TYPE: Final = CONTENT_TYPE_LATEST

PHASES: Final = ("prepare", "cut", "land", "offline", "close")
_SECONDS: Final = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 900.0, 1800.0, 3600.0)
_REQUEST_SECONDS: Final = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

MOVES_STARTED = Counter("hostmove_moves_started", "Moves begun: a record gained a move (spec §7.2)",
                        registry=REGISTRY)
MOVES_ENDED = Counter("hostmove_moves_ended", "Moves closed, by outcome (ruling M4)", ["outcome"], registry=REGISTRY)
PHASE_SECONDS = Histogram("hostmove_move_phase_seconds", "A closed move's phase durations from its record (§7.3-§7.9)",
                          ["phase"], buckets=_SECONDS, registry=REGISTRY)
PHASE_BUDGET = Gauge("hostmove_move_phase_budget_seconds", "The budget of a move phase (the cut window, the landing "
                     "budget, the prepare bound)", ["phase"], registry=REGISTRY)

LEDGER_TRANSITIONS = Counter("hostmove_ledger_transitions", "Ledger transitions, by object and outcome",
                             ["object", "outcome"], registry=REGISTRY)
LEDGER_CAS_CONFLICTS = Counter("hostmove_ledger_cas_conflicts", "Ledger CASes lost to another writer",
                               ["object"], registry=REGISTRY)
LEDGER_RETRIES = Counter("hostmove_ledger_retries", "Ledger steps tried again (conflict, stale_read, publish)",
                         ["object", "reason"], registry=REGISTRY)

S3_REQUESTS = Counter("hostmove_s3_requests", "S3 requests, by operation and HTTP status (or unreachable)",
                      ["operation", "status"], registry=REGISTRY)
S3_SECONDS = Histogram("hostmove_s3_request_seconds", "S3 request latency, by operation", ["operation"],
                       buckets=_REQUEST_SECONDS, registry=REGISTRY)

PUBLISH_SECONDS = Histogram("hostmove_jetstream_publish_seconds", "JetStream publish latency to its ack, by stream "
                            "and outcome", ["stream", "outcome"], buckets=_REQUEST_SECONDS, registry=REGISTRY)
CONSUMER_DELIVERIES = Counter("hostmove_consumer_deliveries", "Messages a durable consumer delivered", ["durable"],
                              registry=REGISTRY)
CONSUMER_REDELIVERIES = Counter("hostmove_consumer_redeliveries", "Deliveries after the first of a message",
                                ["durable"], registry=REGISTRY)
CONSUMER_PENDING = Gauge("hostmove_consumer_pending", "Messages pending on a durable consumer at its last delivery",
                         ["durable"], registry=REGISTRY)

ALERTS = Counter("hostmove_alerts", "Alerts and incidents raised, by kind", ["kind"], registry=REGISTRY)

BOX_INSTANCES = Gauge("hostmove_box_instances_running", "Instances running on a box", ["box"], registry=REGISTRY)
BOX_ROUTES_HELD = Gauge("hostmove_box_routes_held", "Route rows held by a move on a box (§5.2)", ["box"],
                        registry=REGISTRY)
BOX_SCANS = Counter("hostmove_box_scans", "A box agent's backstop looks at the claims, ended (issue 19 item 2)",
                    ["box"], registry=REGISTRY)
BOX_SCAN_READS = Counter("hostmove_box_scan_claims_read", "Claims a box agent's backstop read: new or changed since "
                         "its last look", ["box"], registry=REGISTRY)


@dataclass(frozen=True)
class MoveObservation:
    """What one record transition tells of moves (:func:`move_observation`)."""

    started: bool = False
    ended: str | None = None
    phases: tuple[tuple[str, float], ...] = ()
    budgets: tuple[tuple[str, float], ...] = ()


def _span(start: int | None, end: int | None) -> float | None:
    return (end - start) / 1000 if start is not None and end is not None and end >= start else None


def _phases(move: Move, closed_at: int | None) -> tuple[tuple[str, float], ...]:
    spans = {
        "prepare": _span(move.requested_at, move.ready_at),
        "cut": _span(move.cut_at, move.flipped_at),
        "land": _span(move.flipped_at, move.committed_at),
        "offline": _span(move.cut_at, move.opened_at),
        "close": _span(move.opened_at, closed_at),
    }
    return tuple((phase, s) for phase in PHASES if (s := spans[phase]) is not None)


def _budgets(move: Move) -> tuple[tuple[str, float], ...]:
    out: list[tuple[str, float]] = []
    if move.cut_budget_s > 0:
        out += [("cut", move.cut_budget_s), ("offline", move.cut_budget_s)]
    land = _span(move.flipped_at, move.landing_deadline)
    if land is not None:
        out.append(("land", land))
    return tuple(out)


def move_observation(before: Record | None, after: Record) -> MoveObservation:
    """What the record transition ``before`` -> ``after`` tells: a move begun (the record gains a move it did not
    have), or a move closed (``move`` cleared, ``last_move`` naming it: its outcome, its phases from ``before``'s
    journal times, its budgets). Pure."""
    prev = before.move if before is not None else None
    now = after.move
    started = now is not None and (prev is None or prev.id != now.id)
    if prev is not None and now is None and after.last_move is not None and after.last_move.id == prev.id:
        return MoveObservation(started=started, ended=after.last_move.outcome,
                               phases=_phases(prev, after.last_move.at), budgets=_budgets(prev))
    return MoveObservation(started=started)


def observe_record(before: Record | None, after: Record) -> None:
    """Record what a committed record transition tells of moves (:func:`move_observation`)."""
    seen = move_observation(before, after)
    if seen.started:
        MOVES_STARTED.inc()
    if seen.ended is not None:
        MOVES_ENDED.labels(outcome=seen.ended).inc()
    for phase, seconds in seen.phases:
        PHASE_SECONDS.labels(phase=phase).observe(seconds)
    for phase, seconds in seen.budgets:
        PHASE_BUDGET.labels(phase=phase).set(seconds)


def set_budget(phase: str, seconds: float) -> None:
    """A phase budget a process knows from its configuration (a box's prepare bound, §7.11)."""
    if phase not in PHASES:
        raise ValueError(f"unknown move phase {phase!r}; one of {', '.join(PHASES)}")
    PHASE_BUDGET.labels(phase=phase).set(seconds)


def exposition() -> bytes:
    """The Prometheus text exposition of :data:`REGISTRY`."""
    return bytes(generate_latest(REGISTRY))


def alert_raised(kind: str) -> None:
    """Count an alert or incident of ``kind`` (``hostmove_alerts_total``). Not inside the simulation: a counter's
    first series of a label reads the wall clock (its ``_created``), which the simulation refuses."""
    if ports.simulated():
        return
    try:  # a metric never fails the alert it counts (the simulation's stand-in world refuses the wall clock too)
        ALERTS.labels(kind=kind).inc()
    except Exception:  # noqa: BLE001 - best effort by design: the alert itself is already durable
        return


def delivered(durable: str, num_delivered: int) -> None:
    """Count a delivery of ``durable``'s (and a redelivery when ``num_delivered`` > 1). Not inside the simulation,
    as :func:`alert_raised`."""
    if ports.simulated():
        return
    CONSUMER_DELIVERIES.labels(durable=durable).inc()
    if num_delivered > 1:
        CONSUMER_REDELIVERIES.labels(durable=durable).inc()


def scanned(box: str, claims_read: int) -> None:
    """Count one backstop look of ``box`` that read ``claims_read`` claims. Not inside the simulation, as
    :func:`alert_raised`."""
    if ports.simulated():
        return
    BOX_SCANS.labels(box=box).inc()
    BOX_SCAN_READS.labels(box=box).inc(claims_read)


# Every series of a bounded label set exists from the start, at zero (and the simulation, which runs the ledger,
# never makes one: a counter's new series reads the wall clock).
for _outcome in ("done", "rolled_back", "aborted"):
    MOVES_ENDED.labels(outcome=_outcome)
for _phase in PHASES:
    PHASE_SECONDS.labels(phase=_phase)
for _obj in ("claim", "record"):
    for _outcome in ("committed", "conflict", "refused", "no_change"):
        LEDGER_TRANSITIONS.labels(object=_obj, outcome=_outcome)
    LEDGER_CAS_CONFLICTS.labels(object=_obj)
    for _reason in ("conflict", "stale_read", "publish"):
        LEDGER_RETRIES.labels(object=_obj, reason=_reason)
