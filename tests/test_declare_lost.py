"""``hostmove move resolve --host H --declare-lost BOX`` on the real stack (spec §7.10 M16, §20 M-C18; issue 15 item
2): box agents as processes, real NATS, SeaweedFS and cgroup v2, the door served over HTTP and the operator's CLI
run as a process.

The target agent dies right after the flip names it (a failpoint) and never comes back. The operator stops its box
through the platform (``hostmove box stop``: the ``local`` compute port), then declares it lost: every refusal
first, each with its sentence and nothing changed in S3; the unconfirmed request answers the M-C18 sentence and
changes nothing; confirmed (``--yes``), the move rolls back clean citing the declaration, the host serves on the
source again with the lost box's session declared ``writes_lost`` and nothing else missing, and it takes writes.
A target that released dirty and died before its ``returned`` CAS is declared lost the same way: the declaration
owes the return lane's park to the source, and the host moves on to a replacement box afterwards.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import pytest_asyncio
from aiohttp.test_utils import TestServer

from bus.nats_log import NatsEventLog
from bus.subjects import FACTS_STREAM, LEDGER_STREAM, alert_subject, ledger_subject
from events import Actor
from events.base import decode
from events.claim import Scope
from events.copy import say
from events.envelope import Transition
from hostmove.access import provision_deployment
from hostmove.probe_apps import post_write
from hostmove.procs import ServiceProc, service_env
from hostmove.rehearsal import ack_logs, declared_losses, nothing_missing
from hostmove.stackinfo import StackInfo
from kernel.failpoints import ENV
from kernel.ports import SystemRandom, WallClock
from kernel.timetext import utc_text
from services.agent.service import read_endpoint
from services.box.fence import read_fence
from services.box.instance.sandbox import instance_dir
from services.box.roster import init_box
from services.door.api import Door, make_app
from services.door.auth import Identity, TokenSet
from services.door.decide import MoveRequest
from services.door.declare import DeclareLost, declare_lost
from services.ledger.audit import run_audit
from services.move.follow import staging_lane, staging_scope_location
from services.move.lost import REGION_OWNER, LossDeclaration, loss_key, lost_op
from services.move.park import FAST
from services.objstore.port import Got
from services.objstore.s3 import S3Store
from services.recovery.recovery import RecoveryPass
from tests.helpers.agents import AgentWorld, agent_world, answers_ready, data_buckets, drain_box_groups, eventually
from tests.test_agent import APP, closed_on_ie, create_and_write, request_move, serving_port

HOSTMOVE = [sys.executable, "-m", "hostmove.cli"]
OPERATOR = "op-token-lost"


@pytest_asyncio.fixture(loop_scope="session", scope="module")
async def shared(stack: StackInfo, unique: Callable[[str], str]) -> AsyncIterator[tuple[S3Store, NatsEventLog, str]]:
    async with data_buckets(stack, unique, "lost") as s:
        yield s


async def etags(w: AgentWorld, host: str) -> tuple[str | None, str | None]:
    return (await w.ledger.read_claim(host)).etag, (await w.ledger.read_record(host)).etag


@contextmanager
def paused(agent: ServiceProc) -> Iterator[None]:
    """The agent's process stopped (SIGSTOP) for the block, so nothing but the call under test writes the host."""
    assert agent.proc is not None and agent.alive()
    os.kill(agent.proc.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(agent.proc.pid, signal.SIGCONT)


async def cli(stack: StackInfo, w: AgentWorld, door_url: str, *argv: str) -> subprocess.CompletedProcess[str]:
    env = service_env(stack, root=w.root, bucket=w.deploy, extra={
        "HOSTMOVE_DATA_BUCKET_PREFIX": w.prefix, "HOSTMOVE_CREDENTIALS": stack.credentials,
        "HOSTMOVE_DOOR_URL": door_url, "HOSTMOVE_TOKEN": OPERATOR})
    return await asyncio.to_thread(subprocess.run, [*HOSTMOVE, *argv], env=env, capture_output=True, text=True,
                                   timeout=120, stdin=subprocess.DEVNULL)


@pytest.mark.asyncio(loop_scope="session")
@pytest.mark.parametrize("dies", ["before_effects:checking", "after_effects:probing"])
async def test_a_target_gone_after_the_flip_is_declared_lost_and_the_host_serves_on_its_source(
        stack: StackInfo, unique: Callable[[str], str], shared: tuple[S3Store, NatsEventLog, str],
        tmp_path: Path, dies: str) -> None:
    """``dies``: the target agent dies before its landing started anything (it never wrote: nothing is lost), or
    right after its probe started the instance (its writes since the flip are declared lost, the probe's instance
    killed by the platform's stop)."""
    store, events, prefix = shared
    async with agent_world(stack, unique, tmp_path, prefix, store=store, events=events, app_env=APP,
                           extra={"uk": {ENV: dies}}) as w:
        host = f"{unique('dl')}.example.com"
        ie, uk = w.labels["ie"], w.labels["uk"]
        await create_and_write(w, host)
        move_id = await request_move(w, host)
        target = w.agents["uk"]

        async def died() -> bool:
            return not target.alive()

        await eventually(died, "the target's death after the flip", 90)
        door = Door(w.ledger, clock=WallClock(), rng=SystemRandom())
        server = TestServer(make_app(door, TokenSet.of(operators={"alice": OPERATOR})), host="127.0.0.1")
        await server.start_server()
        url = str(server.make_url("")).rstrip("/")
        try:
            # a box the platform never stopped is refused by the CLI itself: nothing is sent, nothing changes (the
            # source's agent is paused meanwhile: its landing deadline may pass on a loaded machine, and its own
            # rollback CAS is not what this checks)
            with paused(w.agents["ie"]):
                before = await etags(w, host)
                running = await cli(stack, w, url, "move", "resolve", "--host", host, "--declare-lost", uk, "--yes")
                assert running.returncode == 5, running
                assert "cannot be declared lost" in running.stderr and "hostmove box stop --label" in running.stderr
                assert await etags(w, host) == before

            stopped = await cli(stack, w, url, "box", "stop", "--label", uk)
            assert stopped.returncode == 0 and f"box {uk} is stopped" in stopped.stdout, stopped

            # every refusal at the door, with its sentence and nothing changed in S3 (no declaration either)
            op = Identity("alice", "operator")
            for box, status, copy in ((ie, "stopped", "M-R71"), ("nobody-9", "stopped", "M-R70"),
                                      (uk, "running", "M-R75")):
                with paused(w.agents["ie"]):
                    before = await etags(w, host)
                    answer = await declare_lost(door, host, DeclareLost(box, status, "test", confirmed=True), op)
                    assert answer.status == 409 and answer.body["copy"] == copy, answer.body
                    assert await etags(w, host) == before
                assert not isinstance(await store.get(w.deploy, loss_key(host, move_id, box)), Got)
            unconfirmed = await declare_lost(door, host, DeclareLost(uk, "stopped", "test", confirmed=False), op)
            record = (await w.ledger.read_record(host)).state
            assert record is not None and record.move is not None
            m_c18 = say("M-C18", box=uk, host=host, flipped_at=utc_text(record.move.flipped_at),
                         from_region="ie")
            assert unconfirmed.status == 409 and unconfirmed.body["copy"] == "M-R77", unconfirmed.body
            assert unconfirmed.body["confirm"] == m_c18 and "is lost" in m_c18
            assert not isinstance(await store.get(w.deploy, loss_key(host, move_id, uk)), Got)

            declared = await cli(stack, w, url, "move", "resolve", "--host", host, "--declare-lost", uk, "--yes")
            assert declared.returncode == 0, declared
            assert f"{uk} is declared lost" in declared.stdout
            got = await store.get(w.deploy, loss_key(host, move_id, uk))
            assert isinstance(got, Got)
            decl = decode(got.body, LossDeclaration)
            assert decl.compute_status == "stopped" and decl.operator == "alice" and decl.kind == "owes-evidence"
            again = await cli(stack, w, url, "move", "resolve", "--host", host, "--declare-lost", uk, "--yes")
            assert again.returncode == 5, again  # refused: declared already, or the move closed meanwhile
            assert "already declared lost" in again.stderr or "has no move in progress" in again.stderr, again
        finally:
            await server.close()

        await closed_on_ie(w, host, move_id, "rolled_back", lost_region_park=True)
        claim = (await w.ledger.read_claim(host)).state
        assert claim is not None and claim.holder is not None
        assert [b.box for b in claim.lost] == [uk]
        assert [(o.kind, o.region, o.owner) for o in claim.obligations] == [("park-superseded", "uk", REGION_OWNER)]
        back = next(a for a in reversed(claim.holder.admissions) if a.box == ie)
        landed = any(a.box == uk for a in claim.holder.admissions)
        assert landed == (dies == "after_effects:probing"), claim.holder.admissions
        if landed:  # the lost box's session is declared, never covered
            assert back.writes_lost is not None and back.writes_lost.box == uk and back.coverage == "", back
        else:
            assert back.writes_lost is None, back  # the target never wrote: nothing is lost
        declared_list = await declared_losses(w.events, host)
        assert {d.box for d in declared_list} <= {uk, ie}, declared_list
        alerts = [m async for m in w.events.replay(FACTS_STREAM, subject=alert_subject("box-declared-lost"))]
        assert any(host.encode() in m.data and uk.encode() in m.data for m in alerts)

        port = await serving_port(w, "ie", host, timeout_s=60)
        assert await asyncio.to_thread(post_write, port, "after-declare-lost")  # it serves and takes writes again
        logs = ack_logs(w.root / "acks", host, ie, {"uk": uk})
        check = nothing_missing(instance_dir(w.box_dir("ie") / "data", host) / f"{host}.db", logs, host, declared_list)
        assert check.ok, check.line()
        audit = await run_audit(w.events, w.ledger, host=host)
        assert audit.clean(strict=True), [f.line() for f in audit.findings]


@pytest.mark.asyncio(loop_scope="session")
async def test_a_fenced_target_before_the_commit_is_evidence_with_no_operator(
        stack: StackInfo, unique: Callable[[str], str], shared: tuple[S3Store, NatsEventLog, str],
        tmp_path: Path) -> None:
    """§7.10 (L14): the target's machine is terminated after its probe started and fenced (``hostmove box fence``
    reads the platform: terminated). The console's recovery pass rolls the move back clean through the declared-loss
    path, the fence record as the rollback's evidence and its reference in ``op.journal``; no operator declares
    anything. The host serves on ie again with the fenced session declared and nothing else missing."""
    store, events, prefix = shared
    async with agent_world(stack, unique, tmp_path, prefix, store=store, events=events, app_env=APP,
                           extra={"uk": {ENV: "after_effects:probing"}}) as w:
        host = f"{unique('ft')}.example.com"
        ie, uk = w.labels["ie"], w.labels["uk"]
        await create_and_write(w, host)
        move_id = await request_move(w, host)
        target = w.agents["uk"]

        async def died() -> bool:
            return not target.alive()

        await eventually(died, "the target's death after its probe started", 90)
        fenced = await cli(stack, w, "http://127.0.0.1:9", "box", "fence", "--label", uk, "--terminated")
        assert fenced.returncode == 0 and "terminated" in fenced.stdout, fenced
        got = await read_fence(store, w.deploy, uk)
        assert got is not None
        _fence, ref = got
        report = await RecoveryPass(w.ledger, w.events).run_once()
        assert any("is fenced" in line for line in report.claim_halves), report
        record = (await w.ledger.read_record(host)).state
        claim = (await w.ledger.read_claim(host)).state
        if record is not None and record.move is not None:  # the source may already have closed it
            assert record.move.rollback is not None and record.move.rollback.evidence == ref.key
        assert claim is not None and claim.op.journal.get(f"fence.{uk}") == ref.journal()
        assert claim.op.journal.get(f"loss.{uk}") == ref.journal() and [b.box for b in claim.lost] == [uk]
        assert (await RecoveryPass(w.ledger, w.events).run_once()).errors == [], "a second pass changes nothing"

        await closed_on_ie(w, host, move_id, "rolled_back", lost_region_park=True)
        claim = (await w.ledger.read_claim(host)).state
        assert claim is not None and claim.holder is not None
        back = next(a for a in reversed(claim.holder.admissions) if a.box == ie)
        assert back.writes_lost is not None and back.writes_lost.box == uk and back.coverage == "", back
        port = await serving_port(w, "ie", host, timeout_s=60)
        assert await asyncio.to_thread(post_write, port, "after-the-fence")
        declared_list = await declared_losses(w.events, host)
        logs = ack_logs(w.root / "acks", host, ie, {"uk": uk})
        check = nothing_missing(instance_dir(w.box_dir("ie") / "data", host) / f"{host}.db", logs, host, declared_list)
        assert check.ok, check.line()
        audit = await run_audit(w.events, w.ledger, host=host)
        assert audit.clean(strict=True), [f.line() for f in audit.findings]


@pytest.mark.asyncio(loop_scope="session")
async def test_the_lost_regions_next_live_box_parks_the_hosts_location_by_exact_versions(
        stack: StackInfo, unique: Callable[[str], str], shared: tuple[S3Store, NatsEventLog, str],
        tmp_path: Path) -> None:
    """§7.14 item 5 (rule ``lost-region-park``): the declaration's claim CAS queues the park of the host's location in
    the lost target's region, owed by that region (no live box there: the lost one is stopped), and covers its
    predecessors; the source's return is born covered under it. A replacement box enrolled in the region adopts the
    park, parks every version of the host's location there by exact versions (a manifest under ``superseded/``),
    acknowledges it after the horizon, and the audit is clean."""
    store, events, prefix = shared
    async with agent_world(stack, unique, tmp_path, prefix, store=store, events=events, app_env=APP,
                           extra={"uk": {ENV: "after_effects:probing"}}) as w:
        host = f"{unique('lr')}.example.com"
        ie, uk = w.labels["ie"], w.labels["uk"]
        await create_and_write(w, host)
        move_id = await request_move(w, host)
        target = w.agents["uk"]

        async def died() -> bool:
            return not target.alive()

        await eventually(died, "the target's death after its probe started", 90)
        stopped = await cli(stack, w, "http://127.0.0.1:9", "box", "stop", "--label", uk)
        assert stopped.returncode == 0, stopped
        door = Door(w.ledger, clock=WallClock(), rng=SystemRandom())
        answer = await declare_lost(door, host, DeclareLost(uk, "stopped", "test", confirmed=True),
                                    Identity("alice", "operator"))
        assert answer.status == 200, answer.body
        claim = (await w.ledger.read_claim(host)).state
        assert claim is not None and claim.holder is not None
        park = next(o for o in claim.obligations if o.op == lost_op(move_id))
        assert (park.kind, park.region, park.owner) == ("park-superseded", "uk", REGION_OWNER), park
        assert park.scope is not None and park.scope.location == claim.holder.location.rstrip("/")
        assert not any(not a.covered and a.predecessor_region == "uk" for a in claim.holder.admissions)

        await closed_on_ie(w, host, move_id, "rolled_back", lost_region_park=True)
        claim = (await w.ledger.read_claim(host)).state
        assert claim is not None and claim.holder is not None
        back = next(a for a in reversed(claim.holder.admissions) if a.box == ie)
        assert back.predecessor_region == "uk" and back.covered, back  # born covered under the region's park
        uk_bucket = f"{w.prefix}-uk"
        location = claim.holder.location.rstrip("/") + "/"
        before = await store.list_versions(uk_bucket, location)
        assert any(not e.is_delete_marker for e in before), "the lost probe wrote into its region"

        replacement = unique("uk-new")
        await init_box(root=w.root, label=replacement, region="uk", store=store, bucket=w.deploy, events=events,
                       clock=WallClock(), actor=Actor(service="test-agents", pid=0, nonce="replacement"))
        env = service_env(stack, root=w.root, bucket=w.deploy, extra={
            "HOSTMOVE_DATA_BUCKET_PREFIX": w.prefix, "HOSTMOVE_PROFILE": "fast",
            **{k: v for k, v in APP.items() if k.startswith("HOSTMOVE_")}})
        agent = ServiceProc.serve("box", env, w.root / f"agent-{replacement}.log", "--label", replacement)
        agent.start()
        try:
            async def parked() -> bool:
                cur = (await w.ledger.read_claim(host)).state
                return cur is not None and not any(o.op == lost_op(move_id) for o in cur.obligations)

            try:
                await eventually(parked, "the replacement box to park the lost region", 120)
            except AssertionError:
                raise AssertionError(agent.output()[-4000:]) from None
        finally:
            agent.stop()
        assert await store.list_versions(uk_bucket, location) == [], "every version parked, by its version id"
        manifests = await store.list_keys(uk_bucket, f"superseded/{host}/{lost_op(move_id)}/")
        archived = {k.rsplit("@", 1)[1] for k in manifests if "@" in k}
        assert {e.version_id for e in before if not e.is_delete_marker} <= archived, "each version archived exactly"
        claim = (await w.ledger.read_claim(host)).state
        assert claim is not None and claim.holder is not None and claim.quiet_after.get("uk")
        assert all(a.covered or a.predecessor_region != "uk" for a in claim.holder.admissions)
        assert len(claim.holder.admissions) <= 8 or claim.holder.admissions[0].covered is False
        audit = await run_audit(w.events, w.ledger, host=host)
        assert audit.clean(strict=True), [f.line() for f in audit.findings]


@contextmanager
def fail_switch() -> Iterator[tuple[Path, dict[str, str]]]:
    """``tests/test_rollback.py``'s dirty rollback (the target's probe acknowledges rows, then fails its readiness),
    only for a boot in uk that starts while the switch file exists; its directory readable by every instance's uid."""
    directory = Path(tempfile.mkdtemp(prefix="hostmove-switch-"))
    os.chmod(directory, 0o755)
    switch = directory / "fail-ready"
    try:
        yield switch, {**APP, "MOVEPROBE_FAIL_READY_IN": "uk", "MOVEPROBE_FAIL_READY_WHEN": "after-write",
                       "MOVEPROBE_FAIL_READY_SWITCH": str(switch)}
    finally:
        switch.unlink(missing_ok=True)
        directory.rmdir()


async def claim_transitions(w: AgentWorld, host: str) -> list[Transition]:
    return [decode(m.data, Transition)
            async for m in w.events.replay(LEDGER_STREAM, subject=ledger_subject("claim", host))]


@pytest.mark.asyncio(loop_scope="session")
async def test_a_target_that_released_dirty_and_had_not_returned_is_declared_lost_then_the_host_moves_again(
        stack: StackInfo, unique: Callable[[str], str], shared: tuple[S3Store, NatsEventLog, str],
        tmp_path: Path) -> None:
    """§7.10 (model 27, rule ``lost-return-park``), §7.8: the target's probe wrote and failed, so it released dirty;
    its agent dies after publishing its return into ie's lane but before the ``returned`` CAS (the failpoint
    ``returning:published``), and never comes back. The platform stops the box; the operator declares it lost. The
    declaration's claim CAS owes the return lane's ``park-staging`` to the source in ie, scoped from the declaration
    (parked after the horizon); the source re-admits from its own generation declaring the lost box's session
    ``writes_lost`` (with its ``remote_max_txid``), nothing else is missing; then the host moves to a replacement
    box in uk and closes ``done``."""
    store, events, prefix = shared
    with fail_switch() as (switch, app_env):
        await _dirty_unreturned_declared_lost(stack, unique, store, events, prefix, tmp_path, switch, app_env)


async def _dirty_unreturned_declared_lost(stack: StackInfo, unique: Callable[[str], str], store: S3Store,
                                          events: NatsEventLog, prefix: str, tmp_path: Path, switch: Path,
                                          app_env: dict[str, str]) -> None:
    async with agent_world(stack, unique, tmp_path, prefix, store=store, events=events, app_env=app_env,
                           extra={"uk": {ENV: "returning:published"}}) as w:
        host = f"{unique('dd')}.example.com"
        ie, uk = w.labels["ie"], w.labels["uk"]
        await create_and_write(w, host)
        switch.touch(mode=0o644)  # the landing's probe in uk fails after writing: a dirty release
        move_id = await request_move(w, host)
        target = w.agents["uk"]

        async def died() -> bool:
            return not target.alive()

        await eventually(died, "the target's death after publishing its return", 120)
        switch.unlink()  # a later boot in uk (the replacement's) is ready
        record = (await w.ledger.read_record(host)).state
        assert record is not None and record.move is not None and record.move.rollback is not None
        rb = record.move.rollback
        # §7.8 as the declaration finds it: released dirty, its return not sealed (never ``returned``)
        assert (record.move.state, rb.target_phase, rb.dirty, rb.seal) == ("rolling_back", "returning", True,
                                                                               None), rb
        claim = (await w.ledger.read_claim(host)).state
        assert claim is not None and claim.op.exec == "none", "the release's claim half ran"
        seal = claim.op.journal.get("seal")
        assert isinstance(seal, dict) and seal.get("src_covered") is True, seal
        assert not any(o.kind == "park-staging" and o.owner == ie for o in claim.obligations), claim.obligations
        ie_bucket = f"{w.prefix}-ie"
        lane = staging_lane(host, rb.id)
        assert await store.list_keys(ie_bucket, lane), "the lost target published its return into ie's lane"
        assert [p for p in (w.root / "acks").glob(f"{host}.{uk}.jsonl") if p.stat().st_size > 0], \
            "the target's probe acknowledged rows (the dirty case)"

        stopped = await cli(stack, w, "http://127.0.0.1:9", "box", "stop", "--label", uk)
        assert stopped.returncode == 0 and f"box {uk} is stopped" in stopped.stdout, stopped
        door = Door(w.ledger, clock=WallClock(), rng=SystemRandom())
        server = TestServer(make_app(door, TokenSet.of(operators={"alice": OPERATOR})), host="127.0.0.1")
        await server.start_server()
        try:
            url = str(server.make_url("")).rstrip("/")
            declared = await cli(stack, w, url, "move", "resolve", "--host", host, "--declare-lost", uk, "--yes")
        finally:
            await server.close()
        assert declared.returncode == 0 and f"{uk} is declared lost" in declared.stdout, declared
        got = await store.get(w.deploy, loss_key(host, move_id, uk))
        assert isinstance(got, Got)
        decl = decode(got.body, LossDeclaration)
        assert decl.kind == "dirty-unreturned" and decl.compute_status == "stopped", decl

        await closed_on_ie(w, host, move_id, "rolled_back", lost_region_park=True)
        history = await claim_transitions(w, host)
        at = next(i for i, t in enumerate(history) if t.claim is not None and any(b.box == uk for b in t.claim.lost))
        cas = history[at].claim
        assert cas is not None and history[at].meta.name == "box-declared-lost", history[at].meta
        owed = [o for o in cas.obligations if o.kind == "park-staging" and o.op == move_id]
        scope = Scope(location=staging_scope_location(host, rb.id), incarnation=record.move.incarnation,
                      evidence_at=decl.declared_at)
        assert [(o.region, o.owner, o.scope) for o in owed] == [("ie", ie, scope)], cas.obligations
        assert not any(o.owner == uk for o in cas.obligations), "the lost box's chores dropped in the same CAS"
        assert not any(t.claim is not None and any(o.kind == "park-staging" and o.owner == ie and o.op == move_id
                                                   for o in t.claim.obligations) for t in history[:at]), \
            "the lane's park is owed by the declaration's CAS, not before"
        acked = next(t for t in history[at:] if t.claim is not None and not any(
            o.kind == "park-staging" and o.op == move_id for o in t.claim.obligations))
        assert acked.meta.at >= decl.declared_at + FAST.horizon_ms(scope), "acknowledged after the lane's horizon"
        assert await store.list_keys(ie_bucket, lane) == [], "the partial return is parked"

        claim = (await w.ledger.read_claim(host)).state
        assert claim is not None and claim.holder is not None
        back = next(a for a in reversed(claim.holder.admissions) if a.box == ie)
        landed = next(a for a in reversed(claim.holder.admissions) if a.box == uk)
        lost = back.writes_lost
        assert lost is not None and (lost.box, lost.session) == (uk, landed.session) and back.coverage == "", back
        # its writes past the seal's position (where the source's own replica stopped, src_covered) are declared:
        # the operator finds them in the lost box's generation in uk; the seal held nothing more (one declaration)
        assert lost.remote_max_txid == seal["n"] >= 1 and back.additional_writes_lost == (), (back, seal)
        print(f"\ndeclared: writes_lost {lost.box} session {lost.session} past TXID {lost.remote_max_txid}")
        declared_list = await declared_losses(w.events, host)
        assert [(d.box, d.session) for d in declared_list] == [(uk, landed.session)], declared_list
        port = await serving_port(w, "ie", host, timeout_s=60)
        last = await asyncio.to_thread(post_write, port, "after-the-dirty-declare-lost")
        logs = ack_logs(w.root / "acks", host, ie, {"uk": uk})
        db = instance_dir(w.box_dir("ie") / "data", host) / f"{host}.db"
        bare = nothing_missing(db, logs, host)
        assert not bare.ok, f"the lost box's acknowledged rows are not here: {bare.line()}"
        check = nothing_missing(db, logs, host, declared_list)
        assert check.ok and "covered by a declared loss" in check.detail, check.line()
        print(f"on ie: {check.detail}")
        audit = await run_audit(w.events, w.ledger, host=host)
        assert audit.clean(strict=True), [f.line() for f in audit.findings]

        # the sequence works again: a replacement box in uk, the host moves to it and closes done
        replacement = unique("uk-new")
        await init_box(root=w.root, label=replacement, region="uk", store=store, bucket=w.deploy, events=events,
                       clock=w.ledger.clock, actor=w.ledger.actor)
        await asyncio.to_thread(provision_deployment, stack, w.root, deployment_bucket=w.deploy, data_prefix=prefix)
        env = {k: v for k, v in w.agents["uk"].env.items() if k != ENV}
        agent = ServiceProc.serve("box", env, tmp_path / f"agent-{replacement}.log", "--label", replacement)
        agent.start()
        try:
            async def accepted() -> str | None:
                """Chosen (the lost box is not), once the replacement ran the lost region's park (M-R27)."""
                answer = await door.request_move(host, MoveRequest("uk", "auto"), Identity("alice", "operator"))
                if answer.status == 409 and answer.body["copy"] == "M-R27":
                    return None
                assert answer.status in (200, 201), answer.body
                return str(answer.body["move"]["id"])

            again = await eventually(accepted, "a move to the replacement box", 150, every_s=1.0)

            async def done_there() -> bool:
                rec = (await w.ledger.read_record(host)).state
                cl = (await w.ledger.read_claim(host)).state
                return (rec is not None and rec.move is None and rec.last_move is not None
                        and (rec.last_move.id, rec.last_move.outcome) == (again, "done")
                        and cl is not None and (cl.op.kind, cl.op.exec) == ("serving", replacement))

            try:
                await eventually(done_there, f"the move {again} to {replacement} to close done", 180)
            except AssertionError:
                raise AssertionError(f"{(await w.ledger.read_record(host)).state}\n{agent.output()[-3000:]}\n"
                                     f"{w.agents['ie'].output()[-3000:]}") from None
            async def served_there() -> int | None:  # the endpoint is published by the pass after the open
                port = read_endpoint(w.root / "boxes" / replacement, host)
                return port if port is not None and await asyncio.to_thread(answers_ready, port) else None

            there = await eventually(served_there, f"{host} served on {replacement}", 60)
            assert await asyncio.to_thread(post_write, there, "on the replacement") > last
            logs = ack_logs(w.root / "acks", host, ie, {"uk": uk, "uk2": replacement})
            check = nothing_missing(instance_dir(w.root / "boxes" / replacement / "data", host) / f"{host}.db",
                                    logs, host, await declared_losses(w.events, host))
            assert check.ok, check.line()
            audit = await run_audit(w.events, w.ledger, host=host)
            assert audit.clean(strict=True), [f.line() for f in audit.findings]
        finally:
            agent.stop()
            drain_box_groups(replacement, w.deployment)
