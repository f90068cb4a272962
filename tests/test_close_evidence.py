"""Exact declarations on the real stack (issue 16 items 4, 5; rule ``close-evidence``): a session whose upload timed out
and was retried is never certified until a version listing settles it; a session whose agent died with its app is
certified by the flush of the intact disk and not declared; a declaration names what may be missing."""

from __future__ import annotations

import asyncio
import dataclasses
import sqlite3
from collections.abc import Callable
from pathlib import Path

from hostmove.probe_apps import post_write
from moveprobe.acks import RowAck, missing_from_db, read_acks
from services.box.instance.activator import (
    Started,
    StartPolicy,
    certificate_key,
    certificates_enabled,
    remove_box_data,
)
from services.box.replica.restore import restore_generation
from services.objstore.port import Got, StoreUnavailable
from services.objstore.s3 import S3Store
from tests.test_generations import World, setup_host, world  # noqa: F401 - the fixture

__all__ = ["world"]


class FlakyPuts:
    """The box's store with the first ``n`` replica PUTs failing after the fact (``landed``: the server applied it and
    the answer was lost) or before it (the request never reached the server); everything else passes through."""

    def __init__(self, inner: S3Store, *, n: int, landed: bool) -> None:
        self.inner, self.left, self.landed = inner, n, landed

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    async def put(self, bucket: str, key: str, body: bytes, **kw: object) -> object:
        if self.left > 0 and key.endswith(".ltx"):
            self.left -= 1
            if self.landed:
                await self.inner.put(bucket, key, body, **kw)  # type: ignore[arg-type]
            raise StoreUnavailable(f"put {bucket}/{key}: no answer within 30 s; the outcome is unknown")
        return await self.inner.put(bucket, key, body, **kw)  # type: ignore[arg-type]


async def _retried_session(world: World, unique: Callable[[str], str], label: str, *, landed: bool
                           ) -> tuple[str, int, object]:
    ctx = world.box(label)
    host = await setup_host(world, unique, ctx)
    act = world.activator(ctx)
    started = await act.wake(host)
    assert isinstance(started, Started), started
    rep = act.running[host].replicator
    flaky = FlakyPuts(world.store, n=1, landed=landed)
    rep.store = flaky  # type: ignore[assignment]
    before = rep.position
    await asyncio.to_thread(post_write, started.port, "through a timeout")
    for _ in range(100):  # the sync loop retries the same bytes until the PUT is answered
        if flaky.left == 0 and not rep.pending and rep.position > before:
            break
        await asyncio.sleep(0.1)
    assert flaky.left == 0 and rep.position > before and rep.uncertain, "the retried upload is uncertain"
    cert = await act.stop(host)
    return host, started.session, cert


async def test_a_retried_upload_keeps_its_session_uncertified(world: World, unique: Callable[[str], str]) -> None:
    """The first PUT never reached the server and its retry landed: one version where two requests were sent, so the
    first one's outcome is unknown: the clean stop writes no certificate, and an admission that cannot flush the
    session's disk again (lost) declares it, naming the remote position."""
    host, session, cert = await _retried_session(world, unique, "ie-r", landed=False)
    assert cert is None, "a session with an unsettled upload is never certified"
    claim = await world.claim(host)
    assert claim.holder is not None
    got = await world.store.get(world.buckets["ie"], certificate_key(claim.holder.location, claim.holder.generation,
                                                                     session))
    assert not isinstance(got, Got)
    act = world.activators[-1]
    remove_box_data(act.ctx)
    assert isinstance(await act.wake(host), Started)
    declared = (await world.claim(host)).holder.admissions[-1].writes_lost  # type: ignore[union-attr]
    assert declared is not None and declared.session == session and declared.remote_max_txid >= 1


async def test_a_later_upload_of_the_range_settles_a_retried_one(world: World, unique: Callable[[str], str]) -> None:
    """The same uncertain session, its disk intact: the next wake's flush uploads a full file covering the uncertain
    range (a later successful upload of it, observed by version): the request in doubt can no longer replace anything
    the restore takes, so the session is certified by the flush and nothing is declared."""
    host, session, cert = await _retried_session(world, unique, "ie-q", landed=False)
    assert cert is None
    act = world.activators[-1]
    assert isinstance(await act.wake(host), Started)
    assert (await world.claim(host)).holder.admissions[-1].writes_lost is None  # type: ignore[union-attr]


async def test_a_retry_settled_by_a_version_listing_certifies(world: World, unique: Callable[[str], str]) -> None:
    """The first PUT landed and only its answer was lost; the retry landed too: the listing shows both requests as
    versions of the same bytes and the retry's as the latest, so nothing is left in flight: certified, nothing
    declared."""
    host, session, cert = await _retried_session(world, unique, "ie-s", landed=True)
    assert cert is not None and cert.session == session
    act = world.activators[-1]
    assert isinstance(await act.wake(host), Started)
    assert (await world.claim(host)).holder.admissions[-1].writes_lost is None  # type: ignore[union-attr]


async def _die(act: object) -> None:
    """The agent process dies: its replicators stop where they are, its app keeps running (the cgroup outlives it)."""
    running = act.running  # type: ignore[attr-defined]
    for inst in list(running.values()):
        inst.stop.set()
        if inst.task is not None:
            await asyncio.wait({inst.task})
        await inst.replicator.close()
    running.clear()


async def test_an_agent_dying_under_a_writing_app_declares_nothing(world: World, unique: Callable[[str], str],
                                                                    tmp_path: Path) -> None:
    """Five times: the agent dies while its app writes; the next agent stops the app, flushes what it committed from
    the intact disk and certifies the dead session by that flush; the next admission declares nothing and every
    acknowledged write is there. Then the box loses its disk with the last agent: only that session, whose tail was
    never uploaded, is declared, naming the remote position."""
    ctx = world.box("ie-k")
    host = await setup_host(world, unique, ctx)
    act = world.activator(ctx)
    started = await act.wake(host)
    assert isinstance(started, Started), started
    for i in range(5):
        seqs = [await asyncio.to_thread(post_write, started.port, f"k{i}-{j}") for j in range(5)]
        await _die(act)
        assert ctx.tree.populated(host), "the app outlived its agent"
        successor = world.activator(ctx)
        assert await successor.adopt_running() == [host]
        started = await successor.wake(host)
        assert isinstance(started, Started), started
        claim = await world.claim(host)
        assert claim.holder is not None and claim.holder.admissions[-1].writes_lost is None, \
            f"round {i}: a flushed, settled session is certified and not declared"
        assert max(seqs) <= (await asyncio.to_thread(post_write, started.port, f"after {i}"))
        act = successor
    acks = [a for a in read_acks(world.root / f"{host}.acks") if isinstance(a, RowAck)]
    assert missing_from_db(ctx.db_path(host), acks) == [], "every acknowledged write is served"
    assert all(a.writes_lost is None for a in (await world.claim(host)).holder.admissions)  # type: ignore[union-attr]

    # the disk goes with the agent: the tail written after the last upload exists nowhere else
    rep = act.running[host].replicator
    await rep.sync()
    uploaded = rep.position
    await asyncio.to_thread(post_write, started.port, "never uploaded")
    dead = (await world.claim(host)).holder  # type: ignore[union-attr]
    await _die(act)
    await ctx.tree.reopen_and_drain(host, within_s=10)
    for path in ctx.instance_dir(host).iterdir():  # lost with the disk (the files come back from their manifest)
        if path.is_file():
            path.unlink()
    successor = world.activator(ctx)
    assert isinstance(await successor.wake(host), Started)
    records = (await world.claim(host)).holder.admissions  # type: ignore[union-attr]
    declared = [a.writes_lost for a in records if a.writes_lost is not None]
    assert len(declared) == 1 and declared[0].session == dead.session and declared[0].remote_max_txid == uploaded
    assert declared[0].local_txid == 0, "no local copy could be read"


def test_the_certificate_setting_is_on_or_off() -> None:
    assert certificates_enabled({}) and certificates_enabled({"HOSTMOVE_CLEAN_CLOSE_CERTIFICATES": "ON"})
    assert not certificates_enabled({"HOSTMOVE_CLEAN_CLOSE_CERTIFICATES": "off"})
    assert StartPolicy(certificates=False).certificates is False
    for bad in ("no", "1", "maybe"):
        try:
            certificates_enabled({"HOSTMOVE_CLEAN_CLOSE_CERTIFICATES": bad})
        except ValueError as exc:
            assert "must be on or off" in str(exc)
        else:
            raise AssertionError(bad)


async def test_with_certificates_off_every_predecessor_is_declared(world: World, unique: Callable[[str], str]) -> None:
    """The deployment setting that turns the certificate off: a clean stop writes none, and the next admission
    declares the predecessor, as ruling P7 reads it."""
    ctx = world.box("ie-p")
    host = await setup_host(world, unique, ctx)
    act = world.activator(ctx)
    act.policy = dataclasses.replace(act.policy, certificates=False)
    started = await act.wake(host)
    assert isinstance(started, Started)
    await asyncio.to_thread(post_write, started.port, "x")
    assert await act.stop(host) is None
    assert isinstance(await act.wake(host), Started)
    declared = (await world.claim(host)).holder.admissions[-1].writes_lost  # type: ignore[union-attr]
    assert declared is not None and declared.box == "ie-p"


class HeldPut:
    """The dead process's request in flight: the first replica PUT is taken and held, to land only when released."""

    def __init__(self, inner: S3Store) -> None:
        self.inner = inner
        self.held: tuple[str, str, bytes] | None = None

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    async def put(self, bucket: str, key: str, body: bytes, **kw: object) -> object:
        if self.held is None and key.endswith(".ltx"):
            self.held = (bucket, key, body)
            await asyncio.Event().wait()  # never answered: the process dies with it in flight
        return await self.inner.put(bucket, key, body, **kw)  # type: ignore[arg-type]


async def test_a_late_upload_of_a_dead_process_lands_under_the_flush(world: World, unique: Callable[[str], str],
                                                                     tmp_path: Path) -> None:
    """The agent dies while a PUT of its session is in flight; the successor's flush covers that TXID range with a full
    file, which settles the dead request (a later upload of the same range, observed by version) and certifies the
    session; the dead request then lands, and a cold restore still holds every acknowledged write."""
    ctx = world.box("ie-h")
    host = await setup_host(world, unique, ctx)
    act = world.activator(ctx)
    started = await act.wake(host)
    assert isinstance(started, Started), started
    inst = act.running[host]
    held = HeldPut(world.store)
    inst.replicator.store = held  # type: ignore[assignment]
    seqs = [await asyncio.to_thread(post_write, started.port, f"h{j}") for j in range(4)]
    for _ in range(100):
        if held.held is not None:
            break
        await asyncio.sleep(0.05)
    assert held.held is not None and inst.replicator.uncertain, "the in-flight PUT is recorded before it is sent"
    assert inst.task is not None
    inst.task.cancel()  # the process dies with the request in flight
    await asyncio.wait({inst.task})
    await inst.replicator.close()
    act.running.clear()
    successor = world.activator(ctx)
    assert await successor.adopt_running() == [host]
    bucket, key, body = held.held
    await world.store.put(bucket, key, body)  # the dead request lands after the flush
    started = await successor.wake(host)
    assert isinstance(started, Started), started
    assert (await world.claim(host)).holder.admissions[-1].writes_lost is None  # type: ignore[union-attr]
    scratch = tmp_path / "cold.db"
    claim = await world.claim(host)
    assert claim.holder is not None
    await restore_generation(world.store, bucket, claim.holder.location, claim.holder.generation, scratch)
    with sqlite3.connect(scratch) as conn:
        have = {seq for (seq,) in conn.execute("SELECT seq FROM rows WHERE kind = 'write'")}
    assert set(seqs) <= have, f"acknowledged writes missing: {sorted(set(seqs) - have)}"
