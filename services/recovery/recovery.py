"""The console's recovery pass (spec §7.5, §7.9 step 5, §7.13; issue 4 item 5).

For every host with a record, with no memory of its own:

- writes the claim half of any transition the record has decided (:func:`services.move.follow.claim_half`);
- releases the claim from ``last_move`` after a crash between the two halves of a close (K8);
- finishes a door request that crashed between its claim and record CASes (K2; digest D§13.1);
- raises an alert, once per move and kind, for a deadline passed (``cut_deadline`` before the flip,
  ``landing_deadline`` before the commit);
- takes the ``landing_deadline`` trigger of a rollback (§7.8): a landing past its deadline with no commit is rolled
  back by the record CAS ``landing -> rolling_back`` (the commit CASes the same field, so one wins), and the claim
  follows;
- raises the incidents a move owes (:mod:`services.move.incidents`: ``stuck``, ``rolling_back`` past
  ``release_deadline`` with no target evidence), each exactly once, durably: the stream is their memory, so a
  restarted pass raises nothing twice;
- relocates the hosts of a fenced box (:mod:`services.recovery.relocation`): a serving host of a fenced box to
  ``relocating`` at ``pinning``, and from there to its region's replacement box once one is enrolled (alerting
  once while none is);
- bounds the history of each host at rest (:mod:`services.sweeper.history`: its claim and record, its staging lease in
  each region of the roster, its move journals): noncurrent versions
  older than ``H`` and beyond the newest four are deleted by exact version id, at most once per
  :data:`HISTORY_EVERY_MS` per host (the console's, since ruling M17 lets no box delete in the deployment bucket, C5a).

It decides nothing the record has not decided: every write is conditional on the claim it read.

An outage stops a pass without raising (issue 11 item 3): an unreachable NATS (:class:`~bus.log.LogUnavailable`),
a listing S3 does not answer, or S3 failing :data:`UNAVAILABLE_IN_A_ROW` hosts in a row
(:class:`~services.objstore.port.StoreUnavailable`) ends it with ``report.unavailable`` naming the dependency; the
service backs off and the next pass starts from the store again (one object S3 keeps failing on is reported and
passed over, as any read error).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from urllib.parse import unquote

import msgspec

from bus.facts import Fact, publish_alert, publish_fact
from bus.log import EventLog, LogError, LogUnavailable
from events.claim import Claim, Scope
from events.copy import say
from events.durable import DurableValueError
from events.record import Record
from kernel.logctx import ctx
from kernel.passes import DEFAULT_WORKERS, bounded
from services.box.fence import BoxFence, FenceRef, read_fence, verify_ref
from services.box.roster import Roster, RosterBox, read_roster
from services.door.decide import choose
from services.ledger.ledger import Committed, Ledger, NoChange, Refusal
from services.move.fenced_target import decide_fenced_target_claim, decide_fenced_target_record
from services.move.finalize import decide_close, terminal_payload
from services.move.follow import MOVE_KINDS, claim_half
from services.move.incidents import incidents_owed, raise_owed
from services.move.lost import (
    LossDeclaration,
    NotLegal,
    decide_declared_claim,
    decide_declared_record,
    declaration_kind,
    live_region_box,
)
from services.move.park import PRODUCTION, ParkTiming
from services.move.rollback import decide_deadline_rollback
from services.objstore.port import StoreError, StoreUnavailable
from services.recovery.relocation import (
    PINNING,
    decide_converted_record,
    decide_fence_converts_moving,
    decide_fence_host,
    decide_relocation_target,
)
from services.sweeper.history import LedgerHistory
from services.target.phases import ROLLBACK_RELEASE_MS

log = logging.getLogger("hostmove.recovery")

RECORDS_PREFIX = "control/records/"
UNAVAILABLE_IN_A_ROW = 3
"""Hosts in a row S3 did not answer for before a pass counts the store as down and stops."""
HISTORY_EVERY_MS = 60_000
"""How often a host's claim and record history is looked at (two version listings)."""
FAST_HISTORY_EVERY_MS = 5_000
"""The same in the fast profile (tests, benchmarks)."""


@dataclass(frozen=True)
class DeadlineAlert:
    kind: str  # "cut-deadline", "landing-deadline", "release-deadline"
    move_id: str
    deadline: int


def deadlines_passed(record: Record | None, now_ms: int) -> list[DeadlineAlert]:
    """Deadlines the live move has passed without the step they bound. Pure."""
    move = record.move if record is not None else None
    if move is None:
        return []
    out = []
    if move.cut_deadline is not None and now_ms > move.cut_deadline and move.state not in (
        "committed", "rolling_back", "done", "rolled_back", "aborted"
    ) and move.committed_at is None:
        out.append(DeadlineAlert("cut-deadline", move.id, move.cut_deadline))
    if move.landing_deadline is not None and now_ms > move.landing_deadline and move.state == "landing":
        out.append(DeadlineAlert("landing-deadline", move.id, move.landing_deadline))
    return out  # release_deadline is an incident (services/move/incidents.py), raised durably once


@dataclass
class PassReport:
    hosts: int = 0
    claim_halves: list[str] = field(default_factory=list)
    records_finished: list[str] = field(default_factory=list)
    alerts: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    history: list[str] = field(default_factory=list)
    """Noncurrent versions deleted (claims, records, staging leases, move journals: :mod:`services.sweeper.history`)."""
    unavailable: tuple[str, str] | None = None
    """``(dependency, reason)`` when an outage stopped the pass (``nats`` or ``s3``); the rest was not looked at."""


def log_report(report: PassReport) -> None:
    """What a look at the hosts wrote and could not settle, one line each (the pass's and the consumer's)."""
    for line in report.claim_halves + report.records_finished:
        log.info("recovery wrote %s", line, extra=ctx(phase="recovery"))
    for line in report.errors:
        log.error("recovery could not settle %s", line, extra=ctx(phase="recovery", reason=line))


class RecoveryPass:
    def __init__(self, ledger: Ledger, events: EventLog, *, release_ms: int = ROLLBACK_RELEASE_MS,
                 park_timing: ParkTiming = PRODUCTION, history_every_ms: int = HISTORY_EVERY_MS,
                 workers: int = DEFAULT_WORKERS) -> None:
        self.ledger = ledger
        self.workers = workers
        """How many hosts the pass looks at at once, each once (issue 19 item 3: a slow host never delays the
        others' deadlines; ``HOSTMOVE_PASS_WORKERS``)."""
        self.events = events
        self.release_ms = release_ms
        self.history = LedgerHistory(ledger.store, ledger.bucket, ledger.clock,
                                     park_timing.horizon_ms(Scope(location="control")))
        """The noncurrent versions of each host's claim and record, bounded (:mod:`services.sweeper.history`): the
        console's, since M17 lets no box delete in the deployment bucket (C5a)."""
        self.history_every_ms = history_every_ms
        self._history_next: dict[str, int] = {}
        self._alerted: set[tuple[str, str]] = set()
        self._roster: Roster | None = None
        self._fenced: frozenset[str] = frozenset()
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}
        """One look at a host at a time, the pass's or the ledger consumer's (:meth:`host`): each host's lock and
        how many looks hold or wait for it; the last look out drops it, so the map holds only hosts being looked
        at, never every host the console ever saw."""

    @asynccontextmanager
    async def _lock(self, host: str) -> AsyncIterator[None]:
        lock, looks = self._locks.get(host, (asyncio.Lock(), 0))
        self._locks[host] = (lock, looks + 1)
        try:
            async with lock:
                yield
        finally:
            lock, looks = self._locks[host]
            if looks <= 1:
                del self._locks[host]
            else:
                self._locks[host] = (lock, looks - 1)

    async def host(self, host: str) -> PassReport:
        """Look at one host now, as the pass does, with the roster the last pass read (issue 19 item 1: the ledger
        consumer's wake-up, :mod:`services.recovery.consumer`). An outage raises (:class:`~bus.log.LogUnavailable`,
        :class:`~services.objstore.port.StoreUnavailable`): the caller waits for the dependency. A read error is
        reported and never acted on (C6)."""
        report = PassReport(hosts=1)
        try:
            async with self._lock(host):
                await self._host(host, report)
        except (LogUnavailable, StoreUnavailable):
            raise
        except (DurableValueError, StoreError, LogError) as exc:
            report.errors.append(f"{host}: {exc}")
        return report

    async def hosts(self) -> list[str]:
        keys = await self.ledger.store.list_keys(self.ledger.bucket, RECORDS_PREFIX)
        claims = await self.ledger.store.list_keys(self.ledger.bucket, "control/hosts/")
        names = {unquote(k[len(RECORDS_PREFIX):-5]) for k in keys if k.endswith(".json")}
        names |= {unquote(k[len("control/hosts/"):-5]) for k in claims if k.endswith(".json")}
        return sorted(n for n in names if "/" not in n)

    async def run_once(self) -> PassReport:
        report = PassReport()
        try:
            self._roster, _ = await read_roster(self.ledger.store, self.ledger.bucket)
        except (DurableValueError, StoreError) as exc:  # C6: without it, nothing is relocated this pass
            self._roster = None
            report.errors.append(f"the roster is unreadable: {exc}")
        # The roster marks a box fenced only after its fence record exists (fence_box), so a fence is read only
        # for a host whose box the roster marks, and never listed.
        self._fenced = frozenset(b.label for b in self._roster.boxes if b.fenced_at is not None) \
            if self._roster is not None else frozenset()
        try:
            hosts = await self.hosts()
        except StoreError as exc:
            report.unavailable = ("s3", f"the hosts could not be listed: {exc}")
            return report
        in_a_row = 0

        async def one(host: str) -> None:
            nonlocal in_a_row
            report.hosts += 1
            try:
                async with self._lock(host):
                    await self._host(host, report)
                in_a_row = 0
            except LogUnavailable as exc:  # no transition can be published: the pass stops here
                report.unavailable = report.unavailable or ("nats", f"{host}: {exc}")
            except (DurableValueError, StoreError, LogError) as exc:
                # C6: a read error never acts. Report it and go on with the other hosts.
                in_a_row = in_a_row + 1 if isinstance(exc, StoreUnavailable) else 0
                if in_a_row >= UNAVAILABLE_IN_A_ROW:
                    report.unavailable = report.unavailable or ("s3", f"{host}: {exc}")
                    return
                report.errors.append(f"{host}: {exc}")
                log.error("recovery skipped %s: %s", host, exc, extra=ctx(host=host, phase="recovery", reason=exc))

        # Hosts concurrently, in order, ``workers`` at once; an outage starts no further host (the running end).
        await bounded(hosts, self.workers, one, stop=lambda: report.unavailable is not None)
        return report

    async def _host(self, host: str, report: PassReport) -> None:
        record = (await self.ledger.read_record(host)).state
        claim = (await self.ledger.read_claim(host)).state
        if claim is not None and claim.op.kind == "moving" and _record_lacks_move(record, claim):
            await self._finish_door_record(host, claim, report)
            record = (await self.ledger.read_record(host)).state
        if claim is not None and record is not None and not isinstance(claim_half(claim, record), NoChange):
            decided = record

            def follow(cur: Claim | None) -> Claim | NoChange | Refusal:
                return claim_half(cur, decided)

            out = await self.ledger.transition("claim", host, "follow-record", follow, causation="recovery")
            if isinstance(out, Committed):
                report.claim_halves.append(f"{host}: {out.state.op.kind}/{out.state.op.phase}")
                claim = out.state
            elif isinstance(out, Refusal):
                report.errors.append(f"{host}: {out.reason}")
        now = self.ledger.clock.now_ms()
        if claim is not None and record is not None and _landing_overdue(record, now):
            await self._deadline_rollback(host, record, report)
            record, claim = (await self.ledger.read_record(host)).state, (await self.ledger.read_claim(host)).state
        for alert in deadlines_passed(record, now):
            await self._alert_once(host, alert.move_id, alert.kind, {"move": alert.move_id, "deadline": alert.deadline},
                                   report)
        for incident in incidents_owed(record, claim, now):
            if await raise_owed(self.events, self.ledger.actor, incident, now):
                report.alerts.append(f"{host}: {incident.kind}")
        if claim is not None and self._roster is not None:
            await self._relocate(host, claim, report)
        at_rest = claim is not None and claim.op.kind == "serving" and (record is None or record.move is None)
        if at_rest and self._history_next.get(host, 0) <= now:  # at rest, at most once per history_every_ms
            self._history_next[host] = now + self.history_every_ms
            regions = tuple(sorted({b.region for b in self._roster.boxes})) if self._roster is not None else ()
            live = frozenset(i for i in (claim.op.id if claim is not None else "",
                                         record.move.id if record is not None and record.move is not None else "")
                             if i)
            report.history += await self.history.look(host, regions=regions, live_ops=live)

    async def _deadline_rollback(self, host: str, record: Record, report: PassReport) -> None:
        """§7.8's ``landing_deadline`` trigger, then the claim half it decided (§7.5)."""
        assert record.move is not None
        move_id, incarnation, now, release_ms = record.move.id, record.move.incarnation, self.ledger.clock.now_ms(), \
            self.release_ms
        out = await self.ledger.transition("record", host, "landing-deadline-rollback", lambda cur: (
            decide_deadline_rollback(cur, move_id, incarnation, now, release_ms)), causation="recovery")
        if not isinstance(out, Committed):
            return
        report.claim_halves.append(f"{host}: rolling_back (the landing deadline passed)")
        decided = out.state
        half = await self.ledger.transition("claim", host, "follow-record", lambda cur: claim_half(cur, decided),
                                            causation="recovery")
        if isinstance(half, Refusal):
            report.errors.append(f"{host}: {half.reason}")

    async def _alert_once(self, host: str, op_id: str, kind: str, payload: dict[str, object],
                          report: PassReport) -> None:
        if (op_id, kind) in self._alerted:
            return
        fact = Fact(kind=kind, subject=host, id=f"{op_id}:{kind}", actor=self.ledger.actor,
                    at=self.ledger.clock.now_ms(), payload=payload)
        await publish_alert(self.events, fact)
        self._alerted.add((op_id, kind))
        report.alerts.append(f"{host}: {kind}")

    async def _fence(self, label: str) -> tuple[BoxFence, FenceRef] | None:
        """The box's fence, read fresh (a consumer re-reads the cited record, §7.10 "The fence reference")."""
        return await read_fence(self.ledger.store, self.ledger.bucket, label)

    async def _relocate(self, host: str, claim: Claim, report: PassReport) -> None:
        """The recovery pass's part of a relocation (:mod:`services.recovery.relocation`)."""
        assert self._roster is not None
        op = claim.op
        fenced = await self._fence(op.exec) if op.exec in self._fenced and op.kind == "serving" else None
        if fenced is not None:
            record_, ref = fenced
            now = self.ledger.clock.now_ms()
            out = await self.ledger.transition(
                "claim", host, "relocation-fence", lambda cur: decide_fence_host(cur, ref, record_.region, now),
                causation="recovery")
            if isinstance(out, Committed):
                report.claim_halves.append(f"{host}: relocating/pinning (box {ref.label} is fenced)")
                claim, op = out.state, out.state.op
            elif isinstance(out, Refusal):
                report.errors.append(f"{host}: {out.reason}")
        elif op.kind in MOVE_KINDS and len(op.participants) == 2 and op.participants[1] in self._fenced and (
                await self._fenced_target(host, claim, report)):
            return
        elif op.kind == "moving" and len(op.participants) == 2 and op.participants[0] in self._fenced and (
                converted := await self._fenced_source(host, claim, report)) is not None:
            claim, op = converted, converted.op
        elif op.kind != "relocating" and self._fenced & {op.exec, *op.participants}:
            await self._alert_once(host, op.id or op.kind, "fenced-box-in-operation",
                                   {"kind": op.kind, "boxes": sorted(self._fenced & {op.exec, *op.participants})},
                                   report)
        if op.kind != "relocating" or op.phase != PINNING:
            return
        for name, cited in sorted(op.journal.items()):
            if name.startswith("fence."):
                label = name[len("fence."):]
                why = verify_ref(cited, await self._fence(label), self._roster.box(label))
                if why is not None:
                    report.errors.append(f"{host}: the relocation waits: {why}")
                    return
        region = str(op.intent.get("from", ""))
        chosen = choose(self._roster, region, frozenset(b.box for b in claim.lost), host)
        if not isinstance(chosen, RosterBox):
            await self._alert_once(host, op.id, "relocation-waiting-for-box",
                                   {"region": region, "reason": chosen.reason}, report)
            return
        op_id, box = op.id, chosen.label
        out = await self.ledger.transition(
            "claim", host, "relocation-target", lambda cur: decide_relocation_target(cur, op_id, box, region),
            causation="recovery")
        if isinstance(out, Committed):
            report.claim_halves.append(f"{host}: relocating/installing on {box}")
        elif isinstance(out, Refusal):
            report.errors.append(f"{host}: {out.reason}")

    async def _fenced_source(self, host: str, claim: Claim, report: PassReport) -> Claim | None:
        """§7.10 (rule ``fence-converts-moving``): a source fenced before the flip converts the move to a
        relocation at ``pinning`` in one claim CAS, then the record closes ``aborted``; None when it is not
        converted (past the flip: alerted as before)."""
        source = claim.op.participants[0]
        fenced = await self._fence(source)
        if fenced is None:
            return None
        fence, ref = fenced
        record = (await self.ledger.read_record(host)).state
        entry = self._roster.box(source) if self._roster is not None else None
        now = self.ledger.clock.now_ms()

        def convert(cur: Claim | None) -> Claim | NoChange | Refusal:
            why = verify_ref(ref.journal(), fenced, entry)
            return Refusal(why) if why is not None else decide_fence_converts_moving(cur, record, ref, fence.region,
                                                                                     now)

        out = await self.ledger.transition("claim", host, "fence-converts-moving", convert, causation="recovery")
        if isinstance(out, Refusal):
            return None
        current = out.state if isinstance(out, Committed) else (await self.ledger.read_claim(host)).state
        if current is None or current.op.kind != "relocating":
            return None
        if isinstance(out, Committed):
            report.claim_halves.append(f"{host}: relocating/pinning (its source {source} was fenced before the flip)")
        op_id = current.op.id
        reason = f"the source {source} was fenced before the flip ({ref.key}); the move became a relocation"
        await self.ledger.transition("record", host, "move-aborted", lambda cur: decide_converted_record(
            cur, op_id, reason, now), causation="recovery")
        return current

    async def _fenced_target(self, host: str, claim: Claim, report: PassReport) -> bool:
        """§7.10 (L14): a move's fenced target is the evidence ``--declare-lost`` would have supplied, with no
        operator: before the record's commit the move rolls back clean through the declared-loss path, the fence
        record as ``rollback.evidence`` and ``fenced_at`` as the evidence time; a target owing only local chores has
        them removed. After the commit the move is not what recovers the host (answers False: alerted as before)."""
        target = claim.op.participants[1]
        fenced = await self._fence(target)
        record = (await self.ledger.read_record(host)).state
        if fenced is not None and record is not None and record.move is None and record.last_move is not None \
                and record.last_move.id == claim.op.id and record.last_move.outcome == "done":
            return True  # closed without its fenced target: the release is the claim half's, then the relocation
        if fenced is None or record is None or record.move is None or record.move.id != claim.op.id:
            return False
        fence, ref = fenced
        if record.move.state == "committed":
            await self._fenced_committed(host, claim, record, fenced, report)
            return True
        try:
            kind = declaration_kind(record, claim, target, "terminated")
        except NotLegal:
            return False
        decl = LossDeclaration(host=host, move=record.move.id, box=target, role="target", kind=kind,
                               enrollment=fence.enrollment, region=fence.region, compute_status="terminated",
                               compute_evidence=fence.evidence, operator="the termination fence",
                               declared_at=fence.fenced_at, flipped_at=record.move.flipped_at,
                               timers_lost=record.move.source.timers_sha256)
        cited = ref.journal()

        def decide_record(cur: Record | None) -> Record | NoChange | Refusal:
            rb = cur.move.rollback if cur is not None and cur.move is not None else None
            if rb is not None and rb.evidence == ref.key:
                return NoChange("the fence is already the rollback's evidence")
            why = verify_ref(cited, fenced, self._roster.box(target) if self._roster is not None else None)
            if why is not None:
                return Refusal(why)
            try:
                return decide_declared_record(cur, claim, decl, ref.key, self.release_ms)
            except NotLegal as exc:
                return Refusal(exc.copy)

        if kind != "local-only":
            out = await self.ledger.transition("record", host, "move-target-fenced", decide_record,
                                               causation="recovery")
            if isinstance(out, Refusal):
                report.errors.append(f"{host}: {out.reason}")
                return True
        record = (await self.ledger.read_record(host)).state

        def decide_claim(cur: Claim | None) -> Claim | NoChange | Refusal:
            if cur is not None and cur.op.journal.get(f"fence.{target}") == cited:
                return NoChange("the fence is already on the claim")
            try:
                half = decide_declared_claim(cur, record, decl, cited, source_region=decl_region(record),
                                             region_box=live_region_box(self._roster, fence.region, cur, target)
                                             if self._roster is not None else "")
            except NotLegal as exc:
                return Refusal(exc.copy)
            return msgspec.structs.replace(half, op=msgspec.structs.replace(
                half.op, journal={**half.op.journal, f"fence.{target}": cited}))

        half = await self.ledger.transition("claim", host, "move-target-fenced", decide_claim, causation="recovery")
        if isinstance(half, Committed):
            report.claim_halves.append(f"{host}: rolling back clean (its target {target} is fenced)")
            await self._alert_once(host, claim.op.id, "fenced-target-rolled-back",
                                   {"box": target, "fence": ref.key, "kind": kind}, report)
        elif isinstance(half, Refusal):
            report.errors.append(f"{host}: {half.reason}")
        return True

    async def _fenced_committed(self, host: str, claim: Claim, record: Record,
                                fenced: tuple[BoxFence, FenceRef], report: PassReport) -> None:
        """§7.10 L14 after the record's commit (:mod:`services.move.fenced_target`): the move records its target's
        fence (record first), the claim cites it and drops the target's chores, and the close runs once the source
        parked (``last_move = done``, the open waived); the release to ``serving`` and the relocation follow in
        the next pass. Every step re-verifies the fence reference against the roster first."""
        fence, ref = fenced
        target = ref.label
        entry = self._roster.box(target) if self._roster is not None else None
        why = verify_ref(ref.journal(), fenced, entry)
        if why is not None:
            report.errors.append(f"{host}: the fenced target is not acted on: {why}")
            return
        now = self.ledger.clock.now_ms()
        out = await self.ledger.transition("record", host, "move-target-fenced", lambda cur: (
            decide_fenced_target_record(cur, claim, ref, now)), causation="recovery")
        if isinstance(out, Refusal):
            report.errors.append(f"{host}: {out.reason}")
            return
        decided = (await self.ledger.read_record(host)).state
        half = await self.ledger.transition("claim", host, "move-target-fenced", lambda cur: (
            decide_fenced_target_claim(cur, decided, ref, now)), causation="recovery")
        if isinstance(half, Refusal):
            report.errors.append(f"{host}: {half.reason}")
            return
        if isinstance(half, Committed):
            report.claim_halves.append(f"{host}: closing without its target {target}, which is fenced")
        move_id = claim.op.id
        await self._alert_once(host, move_id, "fenced-target-after-commit", {
            "box": target, "fence": ref.key, "move": move_id,
            "text": say("M-S13", box=target, move_id=move_id, host=host, region=fence.region)}, report)
        current = (await self.ledger.read_claim(host)).state

        def close(cur: Record | None) -> Record | NoChange | Refusal:
            return decide_close(cur, current, move_id=move_id, now_ms=self.ledger.clock.now_ms())

        closed = await self.ledger.transition("record", host, "move-done", close, causation="recovery")
        if isinstance(closed, Committed):
            report.records_finished.append(f"{host}: move {move_id} done without its fenced target")
            last = closed.state
            closing = decided.move if decided is not None and decided.move is not None else None
            await publish_fact(self.events, Fact(  # the terminal log event the finalizer's close writes (§13)
                kind="move-done", subject=host, id=f"{move_id}:done", actor=self.ledger.actor,
                at=self.ledger.clock.now_ms(), payload={
                    "move": move_id, "outcome": "done", **(terminal_payload(closing) if closing else {})}))

            def release(cur: Claim | None) -> Claim | NoChange | Refusal:
                return claim_half(cur, last)

            rel = await self.ledger.transition("claim", host, "release", release, causation="recovery")
            if isinstance(rel, Refusal):
                report.errors.append(f"{host}: {rel.reason}")

    async def _finish_door_record(self, host: str, claim: Claim, report: PassReport) -> None:
        from services.door.decide import decide_move_record

        now = self.ledger.clock.now_ms()

        def finish(cur: Record | None) -> Record | NoChange | Refusal:
            return decide_move_record(cur, host=host, claim=claim, now_ms=now)

        out = await self.ledger.transition("record", host, "move-requested", finish, causation="recovery")
        if isinstance(out, Committed):
            report.records_finished.append(host)


def decl_region(record: Record | None) -> str:
    """The move's source region (where a lost target's return lane is parked)."""
    return record.move.from_ if record is not None and record.move is not None else ""


def _landing_overdue(record: Record, now_ms: int) -> bool:
    move = record.move
    return move is not None and move.state == "landing" and move.landing_deadline is not None and \
        now_ms > move.landing_deadline


def _record_lacks_move(record: Record | None, claim: Claim) -> bool:
    if record is None:
        return True
    if record.move is not None and record.move.id == claim.op.id:
        return False
    return not (record.last_move is not None and record.last_move.id == claim.op.id)
