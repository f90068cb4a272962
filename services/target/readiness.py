"""The target's readiness report ``moves/<host>/<op>/target.json`` in the deployment bucket
(spec §7.3 "Readiness report (target)"; digest D§5.2).

:func:`assess` is pure: observations in, one verdict per check out. The report passes only when
every check passes; a check this box cannot evaluate is reported as failing with the reason, never
as passing (a report without T13 "counts as unarmed", and the same rule is applied to every check).
:func:`report_readiness` is the thin runner: :func:`storage_probe` (T4), :func:`archive_opens` (T5),
:func:`disk_usage` (T6) and :func:`lane_probe` (T10) observe what this box can observe, :class:`BoxFacts`
carries what it knows of itself, and :func:`write_report` writes the report.
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal
from urllib.parse import quote

import msgspec

from events.base import canonical
from events.claim import Claim
from events.record import Record
from kernel import rules
from kernel.ports import Clock, blocking
from services.box.artifacts.archive import ArchiveError, extract
from services.box.artifacts.sealing import PrivateKey, public_point, secrets_key_fp
from services.ledger.ledger import Ledger
from services.objstore.port import Got, ObjectStore, StoreError, Won
from services.target.budget import DEFAULT_WINDOW_S, Budget, BudgetTiming, Rates, t11

rules.register(
    "readiness-key",
    section="§7.3 T2, §10 (a box publishes secrets_key_fp; key-ready when it equals the console's)",
    meaning="a target whose roster fingerprint is not the console's deployment key fails T2 and never becomes ready",
    site="services/target/readiness.py assess (T2)",
)

Status = Literal["pass", "fail"]
GIB = 1 << 30
DISK_USED_LIMIT = 0.85
CHECKS = ("T1", "T2", "T3", "T4", "T5", "T6", "T7", "T8", "T9", "T10", "T11", "T12", "T13")


class Check(msgspec.Struct, frozen=True):
    check: str
    status: Status
    detail: str = ""


class TargetReport(msgspec.Struct, frozen=True):
    """``target.json``: one verdict per check, the T11 attempts and the time of the assessment."""

    v: int
    host: str
    move_id: str
    box: str
    at: int
    ready: bool
    checks: tuple[Check, ...]
    t11_attempts: int = 0
    inputs: dict[str, str] = msgspec.field(default_factory=dict)
    t11: dict[str, float] = msgspec.field(default_factory=dict)
    """T11's rates and estimate (:meth:`services.target.budget.Budget.summary`): what ``move status --detail``
    prints."""

    def failing(self) -> list[Check]:
        return [c for c in self.checks if c.status != "pass"]


@dataclass(frozen=True)
class Observations:
    """What the target box observed. ``None`` means "not observed": the check fails saying so."""

    box: str
    region: str
    protocol: int | None = None
    protocol_floor: int = 1
    protocol_detail: str = ""  # T1: why this box is below the floor object (its release), when it is
    secrets_key_fp: str | None = None
    console_secrets_key_fp: str | None = None
    key_detail: str = ""  # T2: why this box does not hold the deployment's key, when it does not
    environment_matches: bool | None = None  # T3 (HMAC comparison, services.target.observe)
    environment_detail: str = ""
    storage_ok: bool | None = None  # T4
    storage_detail: str = ""
    archive_ok: bool | None = None  # T5
    archive_detail: str = ""
    disk_free_bytes: int | None = None  # T6
    disk_total_bytes: int | None = None
    replica_bytes: int = 0
    archive_bytes: int = 0
    release_staged: bool | None = None  # T7
    release_detail: str = ""
    hosting_boxes: tuple[str, ...] = ()  # T8: the boxes publishing the target placement
    hosting_detail: str = ""
    lane_ok: bool | None = None  # T10
    lane_detail: str = ""
    budget: Budget | None = None  # T11
    landing_armed: bool | None = None  # T13
    rollback_target_armed: bool | None = None
    armed_detail: str = ""
    inputs: dict[str, str] = field(default_factory=dict)


def _not_observed(check: str, what: str) -> Check:
    return Check(check, "fail", f"{what} was not observed on this box, so the check cannot pass")


def assess(obs: Observations, claim: Claim | None, record: Record | None, now_ms: int) -> TargetReport:
    """T1-T13 over the observations (§7.3). Pure."""
    move = record.move if record is not None else None
    if move is None or claim is None:
        raise ValueError("readiness is assessed only for a record carrying a move and its claim")
    out: list[Check] = []
    if obs.protocol is None:
        out.append(_not_observed("T1", "the box's protocol version"))
    elif obs.protocol_detail:
        out.append(Check("T1", "fail", obs.protocol_detail))
    else:
        ok = obs.protocol >= obs.protocol_floor
        out.append(Check("T1", "pass" if ok else "fail",
                         "" if ok else f"this box speaks protocol {obs.protocol}, below the floor "
                                       f"{obs.protocol_floor}"))
    if not rules.on("readiness-key"):
        out.append(Check("T2", "pass"))
    elif obs.key_detail:
        out.append(Check("T2", "fail", obs.key_detail))
    elif not obs.secrets_key_fp or not obs.console_secrets_key_fp:
        out.append(_not_observed("T2", "the secrets key fingerprint (the box's or the console's)"))
    else:
        ok = obs.secrets_key_fp == obs.console_secrets_key_fp
        out.append(Check("T2", "pass" if ok else "fail",
                         "" if ok else "this box's secrets key is not the console's"))
    out.append(_tri("T3", obs.environment_matches, "the composed launch environment compared by HMAC",
                    obs.environment_detail))
    out.append(_tri("T4", obs.storage_ok, "the storage probe", obs.storage_detail))
    out.append(_tri("T5", obs.archive_ok, "the newest archive", obs.archive_detail))
    out.append(_disk(obs))
    out.append(_tri("T7", obs.release_staged, "the pinned release staged on this box", obs.release_detail))
    if obs.hosting_boxes == (obs.box,):
        out.append(Check("T8", "pass"))
    else:
        out.append(Check("T8", "fail", obs.hosting_detail or f"{len(obs.hosting_boxes)} boxes publish the target "
                                                             "placement, not exactly this one"))
    out.append(_claim_check(obs, claim, record))
    out.append(_tri("T10", obs.lane_ok, "the return lane in the source's bucket", obs.lane_detail))
    if obs.budget is None:
        out.append(_not_observed("T11", "the measured rates"))
    else:
        out.append(Check("T11", "pass" if obs.budget.eligible else "fail",
                         f"{obs.budget.attempts} probe attempt(s) fit the window" if obs.budget.eligible
                         else obs.budget.reason()))
    quiet = claim.quiet_after.get(obs.region)
    if quiet is not None and now_ms < quiet:
        out.append(Check("T12", "fail", "the region was left less than the late-completion horizon ago; the move "
                                        "waits at ready"))
    else:
        out.append(Check("T12", "pass"))
    armed = obs.landing_armed is True and obs.rollback_target_armed is True
    out.append(Check("T13", "pass" if armed else "fail",
                     "" if armed else "this box does not report that it can land the move and roll it back"
                     + (f" ({obs.armed_detail})" if obs.armed_detail else "")))
    ready = all(c.status == "pass" for c in out)
    return TargetReport(v=1, host=record.host if record else "", move_id=move.id, box=obs.box, at=now_ms, ready=ready,
                        checks=tuple(out), t11_attempts=obs.budget.attempts if obs.budget else 0,
                        inputs=dict(obs.inputs))


def _tri(check: str, value: bool | None, what: str, detail: str) -> Check:
    if value is None:
        return _not_observed(check, what)
    return Check(check, "pass" if value else "fail", detail if not value else "")


def _disk(obs: Observations) -> Check:
    """T6: free space covers twice the replica, plus the archive, plus 2 GiB, and stays under 85%."""
    if obs.disk_free_bytes is None or not obs.disk_total_bytes:
        return _not_observed("T6", "free disk space")
    need = 2 * obs.replica_bytes + obs.archive_bytes + 2 * GIB
    used_after = (obs.disk_total_bytes - obs.disk_free_bytes + 2 * obs.replica_bytes + obs.archive_bytes)
    if obs.disk_free_bytes < need:
        return Check("T6", "fail", f"{obs.disk_free_bytes} bytes free, {need} needed")
    if used_after / obs.disk_total_bytes >= DISK_USED_LIMIT:
        return Check("T6", "fail", "the disk would be 85% full or more after the landing")
    return Check("T6", "pass")


def _claim_check(obs: Observations, claim: Claim, record: Record | None) -> Check:
    """T9: the claim is ``moving`` with this move id, its holder is the record's incarnation, and this
    region and box are in ``touched``."""
    move = record.move if record is not None else None
    assert move is not None
    if claim.op.kind != "moving" or claim.op.id != move.id:
        return Check("T9", "fail", f"the claim is {claim.op.kind} {claim.op.id or ''}, not moving {move.id}")
    if claim.holder is None or claim.holder.incarnation != move.incarnation:
        return Check("T9", "fail", "the claim's holder is not the record's incarnation")
    if obs.region not in claim.touched.regions or obs.box not in claim.touched.boxes:
        return Check("T9", "fail", "this region and box are not yet in the claim's touched set")
    return Check("T9", "pass")


def report_key(host: str, move_id: str) -> str:
    """``moves/<host>/<op>/target.json`` (digest D§0 lanes, D§2 deployment bucket)."""
    return f"moves/{quote(host, safe='.-_~@+')}/{move_id}/target.json"


PROBE_PREFIX = ".carlos-move-probe/"
LANE_PREFIX = "moves/_lane/"


async def storage_probe(store: ObjectStore, bucket: str, name: str) -> tuple[bool, str]:
    """T4 for one store: list one key, put, get and delete ``.carlos-move-probe/<name>``. The store is this box's
    own region's, so the delete names the version the PUT made: a versioned bucket keeps neither a noncurrent version
    nor a delete marker of a probe made at every assessment (issue 16 item 2)."""
    key = PROBE_PREFIX + name
    try:
        await store.list_keys(bucket, PROBE_PREFIX)
        put = await store.put(bucket, key, b"probe")
        got = await store.get(bucket, key)
        await store.delete(bucket, key, version_id=put.version_id if isinstance(put, Won) else None)
    except StoreError as exc:
        return False, f"the store refused the probe: {type(exc).__name__}"
    if not isinstance(got, Got) or got.body != b"probe":
        return False, "the probe object did not read back"
    return True, ""


async def lane_probe(store: ObjectStore, source_bucket: str, name: str) -> tuple[bool, str]:
    """T10: put and delete ``moves/_lane/<name>`` in the source's bucket (M17). The assessment names it by the move
    id, never the host: a probe a crash interrupts between the PUT and the delete is no host's object in the region
    the host leaves (§14.4 "no copy remains in a live namespace"), and that region's lane sweep retires it
    (:mod:`services.sweeper.lanes`)."""
    key = LANE_PREFIX + name
    try:
        await store.put(source_bucket, key, b"lane")
        await store.delete(source_bucket, key)
    except StoreError as exc:
        return False, f"the source's bucket refused the lane probe: {type(exc).__name__}"
    return True, ""


def disk_usage(path: Path) -> tuple[int, int]:
    """(free, total) bytes of the filesystem holding ``path`` (T6)."""
    usage = shutil.disk_usage(path)
    return usage.free, usage.total


_OPENED: dict[tuple[str, str, str, str, bytes], tuple[bool, str]] = {}
"""T5's verdicts by what they are a function of (the sealed bytes' and the manifest's digests, the op, the
incarnation, the box's public key): a target assesses each round, and re-extracting an archive it already
opened (or refused) told it nothing new. Bounded: the oldest verdict goes first."""
_OPENED_MAX = 64
_OPENED_LOCK = threading.Lock()


async def archive_opens(
    sealed: bytes, manifest: bytes, private_key: PrivateKey, *, op: str, incarnation: str
) -> tuple[bool, str]:
    """T5: the archive opens with this box's key, matches its manifest, has no special file and is under
    the cap: extract it into a scratch directory that is removed afterwards (once per archive: :data:`_OPENED`)."""
    def run() -> tuple[bool, str]:
        key = (hashlib.sha256(sealed).hexdigest(), hashlib.sha256(manifest).hexdigest(), op, incarnation,
               public_point(private_key))
        with _OPENED_LOCK:
            known = _OPENED.get(key)
        if known is not None:
            return known
        verdict = True, ""
        with tempfile.TemporaryDirectory() as scratch:
            try:
                extract(sealed, manifest, private_key, Path(scratch) / "x", expect_op=op,
                        expect_incarnation=incarnation, fsync=False)
            except (ArchiveError, ValueError) as exc:
                verdict = False, f"the archive does not open here: {exc}"
        with _OPENED_LOCK:
            if len(_OPENED) >= _OPENED_MAX:
                del _OPENED[next(iter(_OPENED))]
            _OPENED[key] = verdict
        return verdict

    return await blocking(run)


async def write_report(store: ObjectStore, deployment_bucket: str, report: TargetReport) -> str | None:
    """Write ``target.json`` (rewritten each assessment; the newest report is what ``ready`` reads)."""
    out = await store.put(deployment_bucket, report_key(report.host, report.move_id), canonical(report))
    return getattr(out, "version_id", None)


def report_again_in(ready: bool, last_in_s: float | None, *, poll_s: float, every_s: float) -> float:
    """When the target reports again (§7.3): a passing report is repeated every ``max(poll_s, every_s)``, well
    inside the source's freshness bound; a failing one first after ``poll_s``, then twice as long each time it still
    fails, up to the same period. Whatever changes the move (the source's round staging the first file, a reason
    written) is a transition whose work notice passes the target at once, so the pace only bounds the repeats that
    find nothing new: twenty moves preparing toward one box no longer report a hundred times a second."""
    cap = max(poll_s, every_s)
    if ready or last_in_s is None:
        return cap if ready else poll_s
    return min(cap, max(poll_s, 2 * last_in_s))


@dataclass(frozen=True)
class BoxFacts:
    """What the box knows about itself and cannot observe from the stores (T1, T2, T3, T7, T8, T11, T13)."""

    protocol: int | None
    console_secrets_key_fp: str | None
    rates: Rates | None
    protocol_floor: int = 1
    protocol_detail: str = ""
    secrets_key_fp: str | None = None
    """This box's fingerprint as the roster publishes it (None: the box's own key's, for a composition that
    publishes none)."""
    key_detail: str = ""
    environment_matches: bool | None = None
    environment_detail: str = ""
    release_staged: bool | None = None
    release_detail: str = ""
    hosting_boxes: tuple[str, ...] = ()
    hosting_detail: str = ""
    window_s: float = DEFAULT_WINDOW_S
    budget_timing: BudgetTiming | None = None
    """The box's timing profile T11 prices (its window overrides ``window_s``); None: the spec's constants."""
    landing_armed: bool | None = None
    rollback_target_armed: bool | None = None
    armed_detail: str = ""


async def report_readiness(
    *,
    ledger: Ledger,
    data_store: ObjectStore,
    data_bucket: str,
    source_store: ObjectStore,
    source_bucket: str,
    box: str,
    region: str,
    box_dir: Path,
    private_key: PrivateKey,
    facts: BoxFacts,
    host: str,
    clock: Clock,
) -> TargetReport | None:
    """The runner (§7.3): for a record whose ``move.to`` is this region, observe T4 (this bucket), T5 (the
    newest staged archive, current versions under ``files/``), T6 (this box's disk, priced on the staged
    replica and archive) and T10 (the source's lane), assess, and write ``target.json``. None when the
    record carries no move to this region."""
    record = (await ledger.read_record(host)).state
    claim = (await ledger.read_claim(host)).state
    move = record.move if record is not None else None
    if move is None or claim is None or move.to != region:
        return None
    lane = f"moves/{quote(host, safe='.-_~@+')}/{move.id}/"
    storage_ok, storage_detail = await storage_probe(data_store, data_bucket, f"{host}-{move.id}")
    lane_ok, lane_detail = await lane_probe(source_store, source_bucket, move.id)
    # the current objects only (ListObjectsV2): a listing of every version grew with each round's copies and deletes
    replica_bytes = sum(e.size for e in await data_store.list_entries(data_bucket, lane + "replica/"))
    archive = await data_store.get(data_bucket, lane + "files/archive.sealed")
    manifest = await data_store.get(data_bucket, lane + "files/manifest.json")
    archive_ok: bool | None = None
    archive_detail = "no archive is staged yet"
    archive_bytes = 0
    if isinstance(archive, Got) and isinstance(manifest, Got):
        archive_bytes = len(archive.body)
        archive_ok, archive_detail = await archive_opens(archive.body, manifest.body, private_key, op=move.id,
                                                         incarnation=move.incarnation)
    free, total = await blocking(disk_usage, box_dir)
    obs = Observations(
        box=box, region=region, protocol=facts.protocol, protocol_floor=facts.protocol_floor,
        protocol_detail=facts.protocol_detail,
        secrets_key_fp=facts.secrets_key_fp if facts.secrets_key_fp is not None else secrets_key_fp(private_key),
        console_secrets_key_fp=facts.console_secrets_key_fp, key_detail=facts.key_detail,
        environment_matches=facts.environment_matches, environment_detail=facts.environment_detail,
        storage_ok=storage_ok, storage_detail=storage_detail, archive_ok=archive_ok, archive_detail=archive_detail,
        disk_free_bytes=free, disk_total_bytes=total, replica_bytes=replica_bytes, archive_bytes=archive_bytes,
        release_staged=facts.release_staged, release_detail=facts.release_detail, hosting_boxes=facts.hosting_boxes,
        hosting_detail=facts.hosting_detail, lane_ok=lane_ok,
        lane_detail=lane_detail,
        budget=t11(replica_bytes / (1 << 20), facts.rates, window_s=facts.window_s, timing=facts.budget_timing)
        if facts.rates else None,
        landing_armed=facts.landing_armed, rollback_target_armed=facts.rollback_target_armed,
        armed_detail=facts.armed_detail,
    )
    report = assess(obs, claim, record, clock.now_ms())
    if obs.budget is not None and facts.rates is not None:
        report = msgspec.structs.replace(report, t11=obs.budget.summary(facts.rates))
    await write_report(ledger.store, ledger.bucket, report)
    return report
