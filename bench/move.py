"""A real move's offline window against the physical floor measured in the same run (issue 4, spec §7.4-§7.9).

For each database size (1, 16 and 64 MiB) a fresh ``moveprobe`` instance serves on the ``ie`` box (a real process in
a cgroup v2 leaf, real SQLite replicated into SeaweedFS), is filled through ``POST /write`` with incompressible
values, and is moved to the ``uk`` box by :func:`tests.helpers.e2e.run_move` on a private stack. Then:

- **Offline window**: from the ``cut-stopping`` transition (§7.4 ``stopping``: the journal write before the
  source stops serving) to the record's ``opened_at`` (§7.9 step 2: the target serves), both authority times
  (``EventMeta.at`` and ``move.opened_at``, ms, wall clock). The ``cutting`` + ``landing`` + ``opening`` stage
  timings of :class:`MoveOutcome` are printed beside it for comparison.
- **Physical floor**: the bytes the spec requires inside the window, at the rates measured right before the move
  against the same SeaweedFS by raw PUT and GET of objects of the same sizes as the instance's replica files (the
  better of sequential and eight in flight, the restore's concurrency): the landing's ``building`` reads the
  staged replica once (``B / GET rate``) and writes the prepared generation's snapshot ``[1, N]`` and anchor
  ``[N, N]``, every page each (§7.6, §5.1 step 7: ``2 B / PUT rate``); plus the probe's configured wait, the
  settle of the target box's probe profile (§7.8; the window is a deadline, not a wait). The staging of the
  replica into the target region happens while the source still serves (§7.3 rounds), so only the cut's small
  delta is in the window; an earlier version of this bench counted one PUT of ``B`` instead of the install's two,
  and its ratio is printed beside the RESULT for comparison.
- **Control-plane cost**: S3 requests per move by verb, split into the deployment bucket (claims, records,
  roster) and the data buckets (replica, lanes, evidence), counted by a proxy around the one ``ObjectStore`` every
  service here shares; and the messages each JetStream stream gained during the move.
- **A preparing round's cost against the history stored** (issue 19 item 9, §7.3 rounds): a host grown by many
  small writes (each a sync and the sync loop's compaction ladder) is asked to move with a manual cut; after the
  rounds that stage everything (one, or more when a round reaches its lease's ``SafeUntil``), each round follows
  three more such writes, and its S3 requests (the source's round and the target's readiness report) are printed
  against the objects stored, for :data:`ROUND_SYNCS` writes. Context only.

The last line is ``RESULT move ratio=<worst window/floor> target=3``; above the target it exits 1. A move that
does not close as done on the target, or loses an acknowledged write, also exits 1.
"""

from __future__ import annotations

import asyncio
import base64
import os
import sqlite3
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from bench.common import private_stack, result
from bus.log import EventLog
from bus.nats_log import NatsEventLog
from bus.subjects import FACTS_STREAM, LEDGER_STREAM, ledger_subject
from events import Actor
from events.base import decode
from events.envelope import Transition
from events.ids import new_incarnation
from hostmove.probe_apps import ProbeApps, post_write
from hostmove.stackinfo import StackInfo
from kernel.ports import SystemRandom, WallClock
from moveprobe.acks import RowAck, missing_from_db, read_acks
from moveprobe.config import probe_env
from services.agent.sides import SourceRunners, TargetRunners
from services.box.artifacts.sealing import load_private_key, secrets_key_fp
from services.box.instance.activator import Activator, AppSpec, BoxContext, Started
from services.box.instance.agentcg import box_session
from services.box.instance.proctree import CgroupTree
from services.box.instance.registry import Registry, RouteRow
from services.box.instance.stamps import StampBook
from services.box.instance.timers import Timers
from services.box.roster import ensure_deployment, init_box
from services.door.api import Door
from services.door.auth import Identity
from services.door.decide import MoveRequest
from services.hosts.create import create_host
from services.ledger import Committed, Ledger
from services.objstore.port import Got, Lost, Missing, ObjectEntry, ObjectStore, StoreError, VersionEntry, Won
from services.objstore.s3 import S3Store
from services.source.preparing import LaunchInputs
from services.target.budget import Rates
from services.target.probe import FAST as PROBE_FAST
from services.target.readiness import BoxFacts
from services.target.worker import LandingWorker, TargetBox
from tests.helpers.e2e import Deployment, MoveOutcome, SourceSide, TargetSide, Timings, run_move

TARGET = 3  # printed as `target=3`
MIB = 1 << 20
SIZES_MIB = (1, 16, 64)
VALUE_BYTES = 512 * 1024  # one POST /write value (moveprobe's HTTP server takes bodies up to 1 MiB)
IN_FLIGHT = 8  # the restore's concurrency (services/box/replica/restore.py)
# generous bounds for the bigger databases; the cut and landing deadlines stay the FAST profile's
RUN_TIMINGS = Timings(within_s=300.0, max_passes=400)
ROUND_SYNCS = (50, 1000)  # the stored history of the round-cost lines: writes, each its own level-0 file
ROUNDS = 3  # rounds measured after the first


# -- the counting proxy ------------------------------------------------------------------------------------------


@dataclass
class CountingStore:
    """An :class:`ObjectStore` that counts every request by ``(bucket kind, verb)`` and the body bytes moved.
    ``deploy`` names the deployment bucket (counted as ``control``); every other bucket counts as ``data``."""

    inner: ObjectStore
    deploy: str
    requests: Counter[tuple[str, str]] = field(default_factory=Counter)
    bytes_in: int = 0
    bytes_out: int = 0
    areas: Counter[str] = field(default_factory=Counter)  # body bytes by ``<verb> <first key segment>``

    def _count(self, bucket: str, verb: str) -> None:
        self.requests["control" if bucket == self.deploy else "data", verb] += 1

    def _area(self, verb: str, key: str, n: int) -> None:
        self.areas[f"{verb} {key.split('/', 1)[0]}/"] += n

    async def create_bucket(self, bucket: str, *, versioned: bool = True) -> None:
        self._count(bucket, "create_bucket")
        await self.inner.create_bucket(bucket, versioned=versioned)

    async def bucket_versioning(self, bucket: str) -> bool:
        self._count(bucket, "bucket_versioning")
        return await self.inner.bucket_versioning(bucket)

    async def get(self, bucket: str, key: str, *, version_id: str | None = None) -> Got | Missing:
        self._count(bucket, "get")
        got = await self.inner.get(bucket, key, version_id=version_id)
        if isinstance(got, Got):
            self.bytes_out += len(got.body)
            self._area("GET", key, len(got.body))
        return got

    async def head(self, bucket: str, key: str, *, version_id: str | None = None) -> Got | Missing:
        self._count(bucket, "head")
        return await self.inner.head(bucket, key, version_id=version_id)

    async def put(self, bucket: str, key: str, body: bytes, *, if_match: str | None = None,
                  if_none_match: bool = False, metadata: Mapping[str, str] | None = None) -> Won | Lost:
        self._count(bucket, "put")
        self.bytes_in += len(body)
        self._area("PUT", key, len(body))
        return await self.inner.put(bucket, key, body, if_match=if_match, if_none_match=if_none_match,
                                    metadata=metadata)

    async def delete(self, bucket: str, key: str, *, if_match: str | None = None,
                     version_id: str | None = None) -> Won | Lost:
        self._count(bucket, "delete")
        return await self.inner.delete(bucket, key, if_match=if_match, version_id=version_id)

    async def copy(self, bucket: str, key: str, *, src_bucket: str, src_key: str,
                   src_version_id: str | None = None) -> Won:
        self._count(bucket, "copy")
        return await self.inner.copy(bucket, key, src_bucket=src_bucket, src_key=src_key,
                                     src_version_id=src_version_id)

    async def list_versions(self, bucket: str, prefix: str = "", *, after: str = "") -> list[VersionEntry]:
        self._count(bucket, "list_versions")
        return await self.inner.list_versions(bucket, prefix, after=after)

    async def list_keys(self, bucket: str, prefix: str = "") -> list[str]:
        self._count(bucket, "list_keys")
        return await self.inner.list_keys(bucket, prefix)

    async def list_entries(self, bucket: str, prefix: str = "") -> list[ObjectEntry]:
        self._count(bucket, "list_keys")
        return await self.inner.list_entries(bucket, prefix)

    async def close(self) -> None:
        await self.inner.close()

    def snapshot(self) -> tuple[Counter[tuple[str, str]], int, int, Counter[str]]:
        return Counter(self.requests), self.bytes_in, self.bytes_out, Counter(self.areas)


# -- the probe apps and the instance -----------------------------------------------------------------------------


def db_bytes(path: Path) -> int:
    """The database's logical size (``page_count * page_size``), read by a short-lived read-only connection that is
    closed before the cut (stop evidence refuses a process holding the database open, §5.3)."""
    con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        pages = int(con.execute("PRAGMA page_count").fetchone()[0])
        size = int(con.execute("PRAGMA page_size").fetchone()[0])
    finally:
        con.close()
    return pages * size


# -- the floor's throughput ------------------------------------------------------------------------------------


async def throughput(store: ObjectStore, bucket: str, prefix: str, sizes: list[int]) -> tuple[float, float]:
    """Raw PUT and GET rates (bytes/s) for objects of ``sizes`` under ``prefix``: the better of sequential and
    :data:`IN_FLIGHT` at once, each direction. The objects are deleted by exact version afterwards."""
    bodies = [os.urandom(n) for n in sizes]
    total = sum(sizes)
    put_rates: list[float] = []
    get_rates: list[float] = []
    for round_, width in enumerate((1, IN_FLIGHT)):
        sem = asyncio.Semaphore(width)
        keys = [f"{prefix}r{round_}/{i:05d}" for i in range(len(bodies))]

        async def put(key: str, body: bytes, sem: asyncio.Semaphore = sem) -> None:
            async with sem:
                await store.put(bucket, key, body)

        async def get(key: str, n: int, sem: asyncio.Semaphore = sem) -> None:
            async with sem:
                got = await store.get(bucket, key)
                if not isinstance(got, Got) or len(got.body) != n:
                    raise RuntimeError(f"the throughput probe read back {key} wrong: {got!r:.80}")

        t0 = time.perf_counter()
        await asyncio.gather(*(put(k, b) for k, b in zip(keys, bodies, strict=True)))
        put_rates.append(total / (time.perf_counter() - t0))
        t0 = time.perf_counter()
        await asyncio.gather(*(get(k, len(b)) for k, b in zip(keys, bodies, strict=True)))
        get_rates.append(total / (time.perf_counter() - t0))
    for v in await store.list_versions(bucket, prefix):
        await store.delete(bucket, v.key, version_id=v.version_id)
    return max(put_rates), max(get_rates)


# -- one run ------------------------------------------------------------------------------------------------------


@dataclass
class Row:
    size_mib: int
    db_bytes: int
    replica_files: int
    replica_bytes: int
    put_rate: float
    get_rate: float
    settle_s: float
    window_s: float
    stages: dict[str, float]
    requests: Counter[tuple[str, str]]
    bytes_in: int
    bytes_out: int
    events: dict[str, int]
    areas: Counter[str]
    timeline: list[tuple[str, float]]
    ok: bool
    why: str = ""

    @property
    def floor_s(self) -> float:
        """What the offline window must move (see the module doc): the staged replica read once (``building``
        restores it), the install's snapshot and anchor written once each (every page, §7.6 and §5.1 step 7),
        plus the probe's settle."""
        b = self.db_bytes
        return b / self.get_rate + 2 * b / self.put_rate + self.settle_s

    @property
    def once_floor_s(self) -> float:
        """The earlier, narrower floor: the database moved once into the region and read once."""
        return self.db_bytes / self.put_rate + self.db_bytes / self.get_rate + self.settle_s

    @property
    def ratio(self) -> float:
        return self.window_s / self.floor_s


async def history(events: EventLog, host: str) -> list[Transition]:
    """The record's transitions, in stream order."""
    return [decode(m.data, Transition)  # type: ignore[misc]
            async for m in events.replay(LEDGER_STREAM, subject=ledger_subject("record", host))]


def offline_window_s(transitions: list[Transition]) -> float:
    """``cut-stopping`` (its ``EventMeta.at``) to the record's ``opened_at``, in seconds (see the module doc)."""
    stopping = [t.meta.at for t in transitions if t.meta.name == "cut-stopping"]
    opened = [t.record.move.opened_at for t in transitions
              if t.record is not None and t.record.move is not None and t.record.move.opened_at is not None]
    if not stopping or not opened:
        raise RuntimeError("the record's history holds no cut-stopping or no opened_at: the move never opened")
    return (opened[0] - stopping[0]) / 1000


def phases(transitions: list[Transition]) -> list[tuple[str, float]]:
    """Each record transition from ``cut-stopping`` to ``opened``, with its seconds since ``cut-stopping``: where the
    offline window goes."""
    start = next((t.meta.at for t in transitions if t.meta.name == "cut-stopping"), None)
    if start is None:
        return []
    out: list[tuple[str, float]] = []
    for t in transitions:
        if t.meta.at >= start:
            out.append((t.meta.name, (t.meta.at - start) / 1000))
        if t.meta.name == "opened":
            break
    return out


@dataclass
class Bench:
    raw: ObjectStore
    counting: CountingStore
    events: NatsEventLog
    buckets: dict[str, str]
    ctx: BoxContext
    activator: Activator
    tbox: TargetBox
    landing: LandingWorker
    apps: ProbeApps
    deployment: Deployment
    source_base: SourceSide
    facts: BoxFacts
    acks: Path

    async def stream_seqs(self) -> dict[str, int]:
        return {s: (await self.events.state(s)).last_seq for s in (LEDGER_STREAM, FACTS_STREAM)}

    async def started(self, name: str, ledger: Ledger) -> tuple[str, Started]:
        """A new host ``bench-<name>-<random>`` created on the source box, its route ready, and started there."""
        ctx, rng = self.ctx, SystemRandom()
        host = f"bench-{name}-{rng.token_bytes(3).hex()}.example.com"
        incarnation = new_incarnation(rng)
        created = await create_host(ledger, host, box=ctx.label, region="ie", incarnation=incarnation,
                                    causation="bench")
        if not isinstance(created, Committed):
            raise RuntimeError(f"{host} was not created: {created}")
        ctx.registry.insert(RouteRow(host=host, status="ready", incarnation=incarnation))
        started = await self.activator.wake(host)
        if not isinstance(started, Started):
            raise RuntimeError(f"{host} did not start on {ctx.label}: {started}")
        return host, started

    async def one(self, size_mib: int, ledger: Ledger) -> Row:
        ctx = self.ctx
        host, started = await self.started(f"{size_mib}m", ledger)
        writes = max(1, size_mib * MIB // VALUE_BYTES)
        for _ in range(writes):
            value = base64.b64encode(os.urandom(VALUE_BYTES * 3 // 4)).decode()  # incompressible for zstd
            await asyncio.to_thread(post_write, started.port, value, timeout_s=30)
        running = self.activator.running[host]
        while await running.replicator.sync() is not None:  # the replica caught up before the move starts
            pass
        size = db_bytes(ctx.db_path(host))
        replica = [v for v in await self.raw.list_versions(self.buckets["ie"], f"instances/{host}/")
                   if v.is_latest and not v.is_delete_marker and v.size > 0]
        sizes = [v.size for v in replica] or [size]
        put_rate, get_rate = await throughput(self.raw, self.buckets["uk"], f"bench-throughput/{host}/", sizes)

        source = SourceSide(ctx=ctx, activator=self.activator, timers=self.source_base.timers,
                            secrets_key=self.source_base.secrets_key, launch=self.source_base.launch,
                            ready_url=lambda h: f"http://127.0.0.1:{started.port}/ready")
        before, in0, out0, areas0 = self.counting.snapshot()
        seqs0 = await self.stream_seqs()
        outcome: MoveOutcome = await run_move(host, to="uk", deployment=self.deployment, source=source,
                                              target=TargetSide(self.landing, self.facts), timings=RUN_TIMINGS)
        after, in1, out1, areas1 = self.counting.snapshot()
        seqs1 = await self.stream_seqs()
        why = outcome.reason
        if outcome.ok:
            acked = read_acks(self.acks / f"{host}.jsonl")
            missing = missing_from_db(self.tbox.db_path(host), acked)
            rows = sum(isinstance(a, RowAck) for a in acked)
            if rows != writes:
                why = f"the source acknowledged {rows} of the {writes} writes sent before the move"
            elif missing:
                why = f"{len(missing)} of {rows} acknowledged writes are missing on {self.tbox.label}"
        transitions = await history(self.events, host)
        window = offline_window_s(transitions) if outcome.opened else float("nan")
        if host in self.landing.running:  # idle the target again so the next run counts only its own requests
            await self.landing.running.stop(host)
        settle = self.tbox.probe_timing.settle_s
        return Row(size_mib, size, len(replica), sum(sizes) if replica else 0, put_rate, get_rate, settle, window,
                   outcome.timings, after - before, in1 - in0, out1 - out0,
                   {s: seqs1[s] - seqs0[s] for s in seqs0}, areas1 - areas0, phases(transitions),
                   outcome.ok and not why, why)

    async def rounds(self, syncs: int, ledger: Ledger) -> RoundRow:
        """A preparing round's requests against the history stored (see the module doc)."""
        ctx = self.ctx
        host, started = await self.started(f"rounds-{syncs}", ledger)
        running = self.activator.running[host]
        running.stop.set()  # the writes below sync and compact one by one, as the loop would, only faster
        if running.task is not None:
            await running.task
        running.stop.clear()

        async def write(n: int) -> None:
            for i in range(n):
                await asyncio.to_thread(post_write, started.port, f"round-{i}", timeout_s=30)
                while await running.replicator.sync() is not None:
                    pass
                for level in (1, 2, 3):  # when three files wait at the level below, as the loop compacts
                    if (i + 1) % 3 ** level == 0:
                        await running.replicator.compact(level, min_inputs=3)

        await write(syncs)
        running.replicator.snapshots_held = True  # as the box agent holds them while the host is a move's source
        running.task = asyncio.create_task(running.replicator.run(running.stop))
        listed = await self.raw.list_versions(self.buckets["ie"], f"instances/{host}/")
        current = sum(v.is_latest and not v.is_delete_marker for v in listed)
        source = SourceSide(ctx=ctx, activator=self.activator, timers=self.source_base.timers,
                            secrets_key=self.source_base.secrets_key, launch=self.source_base.launch,
                            ready_url=lambda h: f"http://127.0.0.1:{started.port}/ready")
        src = SourceRunners(self.deployment, source, RUN_TIMINGS)
        tgt = TargetRunners(self.deployment, TargetSide(self.landing, self.facts), RUN_TIMINGS)
        answer = await self.deployment.door.request_move(host, MoveRequest("uk", "manual"),
                                                         Identity("op", "operator"))
        if answer.status not in (200, 201):
            raise RuntimeError(f"the move of {host} was refused: {answer.body}")

        async def one() -> tuple[Counter[tuple[str, str]], float]:
            record = (await ledger.read_record(host)).state
            claim = (await ledger.read_claim(host)).state
            assert record is not None
            c0, t0 = self.counting.snapshot()[0], time.perf_counter()
            try:
                await src.step(host, "preparing", record, claim)
            except StoreError as exc:  # as the agent's pass: logged, and the next round goes on from the journal
                print(f"  a round of {host} stopped: {exc}", flush=True)
            c1 = self.counting.snapshot()[0]
            await tgt.step(host, "preparing", record, claim, "ie")
            c2, t2 = self.counting.snapshot()[0], time.perf_counter()
            out: Counter[tuple[str, str]] = Counter()
            for side, counts in (("source", c1 - c0), ("target", c2 - c1)):
                for (_, verb), n in counts.items():
                    out[side, verb] += n
            return out, t2 - t0

        first, first_s = await one()
        last = first
        for _ in range(20):  # the first staging may take several rounds (each stops at its lease's SafeUntil)
            if last["source", "copy"] <= 3:
                break
            last, more_s = await one()
            first, first_s = first + last, first_s + more_s
        later = []
        for _ in range(ROUNDS):
            await write(3)
            later.append(await one())
        return RoundRow(syncs, len(listed), current, sum(first.values()), first_s, later)


@dataclass
class RoundRow:
    """A preparing round's cost (see the module doc): ``versions`` and ``current`` the objects stored under the
    host's generation before the rounds; ``first`` the requests of the rounds that staged it all (one, or more when
    a round reached its lease's ``SafeUntil`` first); ``rounds`` each later round's requests by ``(side, verb)`` and
    its seconds."""

    syncs: int
    versions: int
    current: int
    first: int
    first_s: float
    rounds: list[tuple[Counter[tuple[str, str]], float]]


def _mibs(rate: float) -> str:
    return f"{rate / MIB:.0f}"


def report(rows: list[Row]) -> float:
    print("offline window = cut-stopping (event time) -> record opened_at; floor = B/GET + 2B/PUT + probe settle "
          "(the staged replica read, the install's snapshot and anchor written)")
    print(f"{'db':>6} {'bytes':>10} {'files':>5} {'PUT MiB/s':>9} {'GET MiB/s':>9} {'settle':>6} {'floor s':>7} "
          f"{'window s':>8} {'ratio':>6}  cut+land+open s  total s")
    worst = 0.0
    for r in rows:
        stages = sum(r.stages.get(s, 0.0) for s in ("cutting", "landing", "opening"))
        print(f"{r.size_mib:>4}Mi {r.db_bytes:>10} {r.replica_files:>5} {_mibs(r.put_rate):>9} "
              f"{_mibs(r.get_rate):>9} {r.settle_s:>6.2f} {r.floor_s:>7.3f} {r.window_s:>8.3f} {r.ratio:>6.2f}  "
              f"{stages:>15.3f}  {r.stages.get('total', 0.0):>7.3f}")
        worst = max(worst, r.ratio) if r.ok else float("inf")
    print("\ncontrol-plane cost per move (S3 requests by verb; control = deployment bucket, data = region buckets)")
    verbs = sorted({v for r in rows for _, v in r.requests})
    print(f"{'db':>6} {'bucket':>7} " + " ".join(f"{v:>13}" for v in verbs) + f" {'all':>6}")
    for r in rows:
        for kind in ("control", "data"):
            counts = [r.requests.get((kind, v), 0) for v in verbs]
            print(f"{r.size_mib:>4}Mi {kind:>7} " + " ".join(f"{c:>13}" for c in counts) + f" {sum(counts):>6}")
    print(f"\n{'db':>6} {'S3 requests':>11} {'PUT MiB':>8} {'GET MiB':>8} {'ledger events':>13} {'fact events':>11}")
    for r in rows:
        print(f"{r.size_mib:>4}Mi {sum(r.requests.values()):>11} {r.bytes_in / MIB:>8.1f} {r.bytes_out / MIB:>8.1f} "
              f"{r.events[LEDGER_STREAM]:>13} {r.events[FACTS_STREAM]:>11}")
    print("\nfor comparison (not the RESULT): the earlier floor B/PUT + B/GET + settle, and the RESULT's floor on "
          "the replica's zstd bytes instead of the database's")
    for r in rows:
        b = r.replica_bytes
        compressed = b / r.get_rate + 2 * b / r.put_rate + r.settle_s
        print(f"{r.size_mib:>4}Mi earlier floor {r.once_floor_s:.3f} s ratio {r.window_s / r.once_floor_s:.2f}; "
              f"replica {b / MIB:.1f} MiB: floor {compressed:.3f} s ratio {r.window_s / compressed:.2f}")
    print("\nbody bytes moved during each move, MiB by verb and key area")
    for r in rows:
        print(f"{r.size_mib:>4}Mi " + "  ".join(f"{a} {n / MIB:.1f}" for a, n in sorted(r.areas.items())))
    print("\nthe offline window by record transition (seconds after cut-stopping)")
    for r in rows:
        print(f"{r.size_mib:>4}Mi " + " ".join(f"{name}@{at:.2f}" for name, at in r.timeline))
    for r in rows:
        if not r.ok:
            print(f"the {r.size_mib} MiB move failed: {r.why}")
    return worst


def report_rounds(rows: list[RoundRow]) -> None:
    print("\nS3 requests per preparing round against the objects stored under the host's generation (source round "
          "+ target readiness; after the rounds that stage it all, three writes before each)")
    verbs = sorted({k for r in rows for c, _ in r.rounds for k in c})
    for r in rows:
        mean = sum(sum(c.values()) for c, _ in r.rounds) / len(r.rounds)
        secs = sum(t for _, t in r.rounds) / len(r.rounds)
        print(f"stored {r.versions:>5} versions ({r.current:>4} current, {r.syncs} writes): staging it all {r.first} "
              f"requests {r.first_s:.2f} s; later rounds {mean:.1f} requests {secs:.2f} s each: "
              + " ".join(f"{side}:{verb}={sum(c[side, verb] for c, _ in r.rounds) / len(r.rounds):.1f}"
                         for side, verb in verbs))


async def run(info: StackInfo, tmp: Path) -> int:
    clock, rng = WallClock(), SystemRandom()
    raw = await S3Store.open(info.s3_endpoint, info.s3_access_key, info.s3_secret_key, info.s3_region)
    events = await NatsEventLog.connect(info.nats_url)
    tag = rng.token_bytes(3).hex()
    buckets = {"deploy": f"bench-move-deploy-{tag}", "ie": f"bench-move-ie-{tag}", "uk": f"bench-move-uk-{tag}"}
    for bucket in buckets.values():
        await raw.create_bucket(bucket)
    store = CountingStore(raw, buckets["deploy"])
    ledger = Ledger(store, events, clock, Actor(service="bench", pid=os.getpid(), nonce=tag), buckets["deploy"])
    actor = Actor(service="box-init", pid=os.getpid(), nonce="init")
    src_label, tgt_label = f"ie-{tag}", f"uk-{tag}"
    ie = await init_box(root=tmp / "deployment", label=src_label, region="ie", store=store, bucket=buckets["deploy"],
                        events=events, clock=clock, actor=actor)
    uk = await init_box(root=tmp / "deployment", label=tgt_label, region="uk", store=store, bucket=buckets["deploy"],
                        events=events, clock=clock, actor=actor)
    src_key, tgt_key = load_private_key(ie.box_dir / "secrets.pem"), load_private_key(uk.box_dir / "secrets.pem")
    acks = tmp / "acks"
    acks.mkdir()
    deployment_id = await ensure_deployment(store, buckets["deploy"], rng=rng, clock=clock)
    tree = CgroupTree.discover(src_label, deployment=deployment_id, clock=clock, journal=ie.box_dir / "spawns")
    strict, why = tree.strict_available()
    if not strict:
        print(f"this machine cannot spawn strictly ({why}); a box here refuses to take part in moves",
              file=sys.stderr)
        return 2
    rows: list[Row] = []
    round_rows: list[RoundRow] = []
    try:
        with box_session(tree) as home:
            ctx = BoxContext(label=src_label, region="ie", box_dir=ie.box_dir, data_bucket=buckets["ie"],
                             data_store=store, ledger=ledger, tree=tree, registry=Registry.open(ie.box_dir, clock),
                             stamps=StampBook.open(ie.box_dir, clock), clock=clock, rng=rng)

            def env(h: str, data_dir: Path, port: int, region: str) -> dict[str, str]:
                return probe_env(data_dir=data_dir, host=h, region=region, ack_log=acks / f"{h}.jsonl", port=port,
                                 interval_s=3600)

            activator = Activator(ctx, AppSpec(argv=[sys.executable, "-m", "moveprobe"], env=env,
                                               ready_within_s=20))
            src_timers = Timers.open(ie.box_dir, clock)
            apps = ProbeApps(home, acks)
            tbox = TargetBox(label=tgt_label, region="uk", box_dir=uk.box_dir, data_store=store,
                             data_bucket=buckets["uk"], ledger=ledger, registry=Registry.open(uk.box_dir, clock),
                             stamps=StampBook.open(uk.box_dir, clock), timers=Timers.open(uk.box_dir, clock),
                             clock=clock, rng=rng, private_key=tgt_key, probe_factory=apps.factory,
                             probe_timing=PROBE_FAST, sync_interval_s=0.2)
            landing = LandingWorker(tbox)

            async def launch(h: str) -> LaunchInputs:
                return LaunchInputs(env={"MOVEPROBE_HOST": h}, bundle_etags={"app": '"bench"'}, release="bench-1")

            base = SourceSide(ctx=ctx, activator=activator, timers=src_timers, secrets_key=src_key, launch=launch,
                              ready_url=lambda h: None)
            facts = BoxFacts(protocol=1, console_secrets_key_fp=secrets_key_fp(src_key), rates=Rates(10, 250, 500),
                             environment_matches=True, release_staged=True, hosting_boxes=(tgt_label,),
                             landing_armed=True, rollback_target_armed=True)
            regions = {"ie": (store, buckets["ie"]), "uk": (store, buckets["uk"])}
            deployment = Deployment(door=Door(ledger, clock=clock, rng=rng), regions=regions.__getitem__,
                                    region_key=lambda r: tgt_key.public_key(), events=events)
            bench = Bench(raw, store, events, buckets, ctx, activator, tbox, landing, apps, deployment, base, facts,
                          acks)
            try:
                for size_mib in SIZES_MIB:
                    print(f"moving a {size_mib} MiB database from {src_label} to {tgt_label} ...", flush=True)
                    rows.append(await bench.one(size_mib, ledger))
                for syncs in ROUND_SYNCS:
                    print(f"preparing rounds of a host grown by {syncs} writes ...", flush=True)
                    round_rows.append(await bench.rounds(syncs, ledger))
            finally:
                await activator.close()
                for host_ in list(landing.running):
                    await landing.running.stop(host_)
                for app in apps.apps:
                    await app.stop()
                for closable in (ctx.registry, ctx.stamps, src_timers, tbox.registry, tbox.stamps, tbox.timers):
                    closable.close()
    finally:
        await events.close()
        await raw.close()
    print()
    worst = report(rows)
    report_rounds(round_rows)
    print(result("move", worst, TARGET))
    return 0 if worst <= TARGET else 1


def main() -> int:
    with private_stack() as info, tempfile.TemporaryDirectory(prefix="hostmove-bench-move-") as tmp:
        return asyncio.run(run(info, Path(tmp)))


if __name__ == "__main__":
    sys.exit(main())
