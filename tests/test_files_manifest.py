"""The files manifest per installation (spec §0.5 L17, §7.6 ``local`` and "Files reachability", §8.3) on real
SeaweedFS: publish, replay, restore byte for byte, refuse a tampered or missing object with nothing installed,
refuse a path that is not a regular file or folder; the landing's ``local`` publishes the prepared manifest of
``g-<move>`` before ``.files-gen``; a cold admission on another box brings the files back after a lost disk."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import msgspec
import pytest
import pytest_asyncio

from bus.nats_log import NatsEventLog
from events import Actor
from events.claim import Admission, Claim, Holder, Op, Predecessor
from hostmove.stackinfo import StackInfo
from kernel.ports import WallClock
from services.box.artifacts.archive import UnsupportedEntry
from services.box.artifacts.filesmanifest import (
    Binding,
    FilesEntry,
    FilesManifestConflict,
    FilesManifestInvalid,
    FilesRestoreRefused,
    KeepFiles,
    RestoreFiles,
    decide_files,
    decode_manifest,
    manifest_bytes,
    manifest_key,
    object_key,
    publish_manifest,
    read_manifest,
    restore_files,
)
from services.box.artifacts.markers import (
    FilesGen,
    Refused,
    RestoreCold,
    files_generations,
    read_files_gen,
    start_check,
    write_files_gen,
)
from services.box.artifacts.sealing import generate_private_key
from services.box.instance.activator import Started, StartFailed, remove_box_data
from services.box.instance.registry import RouteRow
from services.ledger import Ledger
from services.ledger.ledger import Crash
from services.objstore.port import Got
from services.objstore.s3 import S3Store
from tests import test_target as tt
from tests.helpers.cgtest import box_tree
from tests.test_activator import INC as ACT_INC
from tests.test_activator import open_world, reassign, setup_host, tree_of

INC = "ab" * 32
LOCATION = f"instances/fm.example.com/{INC}"


@pytest_asyncio.fixture(loop_scope="session", scope="module")
async def s3(stack: StackInfo, unique: Callable[[str], str]) -> AsyncIterator[tuple[S3Store, str]]:
    """One bucket for the module's store-level tests, dropped afterwards (weed holds ~76 buckets)."""
    store = await S3Store.open(stack.s3_endpoint, stack.s3_access_key, stack.s3_secret_key, stack.s3_region)
    bucket = unique("files-manifest")
    await store.create_bucket(bucket)
    try:
        yield store, bucket
    finally:
        await store.delete_bucket(bucket)
        await store.close()


def binding(generation: str, *, stamp: int = 7) -> Binding:
    return Binding(host="fm.example.com", incarnation=INC, location=LOCATION, generation=generation,
                   op="mv_" + "c" * 26, stamp=stamp, region="uk")


def make_installation(root: Path) -> tuple[Path, Path]:
    """A files directory shaped like a real one: nested and empty folders, modes, binary, empty and duplicate
    content, a non-ASCII name, a stale ``.files-gen`` (never published), and a ``.env`` beside it."""
    files = root / "files"
    (files / "uploads" / "2026").mkdir(parents=True)
    (files / "empty").mkdir()
    (files / "instance.key").write_bytes(os.urandom(32))
    (files / "instance.key").chmod(0o600)
    (files / "uploads" / "2026" / "photo.bin").write_bytes(os.urandom(70_000))
    (files / "uploads" / "same-a.txt").write_text("same bytes")
    (files / "uploads" / "same-b.txt").write_text("same bytes")
    (files / "uploads" / "empty.txt").write_bytes(b"")
    (files / "run.sh").write_text("#!/bin/sh\necho hi\n")
    (files / "run.sh").chmod(0o750)
    (files / "notes-é.txt").write_text("non-ascii name")
    (files / ".files-gen").write_text('{"op":"x","incarnation":"y"}')
    (files / "uploads").chmod(0o750)
    env = root / "host.env"
    env.write_text("APP_MODE=test\n")
    env.chmod(0o640)
    return files, env


async def test_round_trip_restores_every_file_byte_for_byte(s3: tuple[S3Store, str], tmp_path: Path) -> None:
    store, bucket = s3
    files, env = make_installation(tmp_path / "src")
    published = await publish_manifest(store, bucket, binding("g1"), files, env)
    assert not published.reused
    assert published.key == manifest_key(LOCATION, "g1") == f"{LOCATION}/files/g-g1/manifest.json"
    m = published.manifest
    assert (m.host, m.incarnation, m.generation, m.op, m.stamp, m.sequence, m.region) == (
        "fm.example.com", INC, "g1", "mv_" + "c" * 26, 7, 0, "uk")
    assert [f.path for f in m.files] == sorted(["instance.key", "notes-é.txt", "run.sh", "uploads/2026/photo.bin",
                                                "uploads/empty.txt", "uploads/same-a.txt", "uploads/same-b.txt"])
    assert ".files-gen" not in {f.path for f in m.files}, "the protocol marker is never published (F5)"
    assert [(f.path, f.mode) for f in m.folders] == [("empty", 0o755), ("uploads", 0o750), ("uploads/2026", 0o755)]
    assert m.env is not None and m.env.mode == 0o640
    keys = await store.list_keys(bucket, f"{LOCATION}/files/g-g1/objects/")
    assert len(keys) == len({f.sha256 for f in m.files} | {m.env.sha256}), "content-addressed: one object per content"
    read = await read_manifest(store, bucket, LOCATION, "g1")
    assert read is not None and read.manifest == m and read.version_id == published.version_id

    dest, dest_env = tmp_path / "box" / "host", tmp_path / "box" / "host.env"
    tag = FilesGen(op="g1", incarnation=INC)
    restored = await restore_files(store, bucket, m, region="uk", files_dir=dest, env_file=dest_env, tag=tag)
    assert restored.files == 7 and restored.env
    assert tree_of(dest) == tree_of(files), "every file, folder and mode came back"
    assert dest_env.read_bytes() == env.read_bytes() and dest_env.stat().st_mode & 0o777 == 0o640
    assert read_files_gen(dest) == tag
    assert sorted(p.name for p in dest.parent.iterdir()) == ["host", "host.env"], "no scratch is left behind"


async def test_a_replay_is_harmless_and_a_manifest_is_never_replaced(s3: tuple[S3Store, str], tmp_path: Path) -> None:
    store, bucket = s3
    files, env = make_installation(tmp_path / "src")
    first = await publish_manifest(store, bucket, binding("g2"), files, env)
    versions = await store.list_versions(bucket, f"{LOCATION}/files/g-g2/")
    again = await publish_manifest(store, bucket, binding("g2"), files, env)
    assert again.reused and again.manifest == first.manifest and again.version_id == first.version_id
    assert await store.list_versions(bucket, f"{LOCATION}/files/g-g2/") == versions, "a replay writes no version"
    (files / "instance.key").write_bytes(b"another key")
    with pytest.raises(FilesManifestConflict, match="never replaced"):
        await publish_manifest(store, bucket, binding("g2"), files, env)
    got = await store.get(bucket, manifest_key(LOCATION, "g2"))
    assert isinstance(got, Got) and got.body == manifest_bytes(first.manifest), "the first manifest stands"
    with pytest.raises(FilesManifestConflict):  # same files, another binding (stamp): still not replaced
        await publish_manifest(store, bucket, binding("g2", stamp=8), files, env)


@pytest.mark.parametrize("damage", ["tampered", "missing"])
async def test_a_damaged_object_refuses_and_nothing_is_installed(
    s3: tuple[S3Store, str], tmp_path: Path, damage: str
) -> None:
    store, bucket = s3
    files, env = make_installation(tmp_path / "src")
    generation = f"g3-{damage}"
    m = (await publish_manifest(store, bucket, binding(generation), files, env)).manifest
    victim = next(f for f in m.files if f.path == "uploads/2026/photo.bin")
    if damage == "tampered":
        await store.put(bucket, victim.key, b"x" * victim.size)  # same size, other bytes
    else:
        await store.delete(bucket, victim.key)
    box = tmp_path / "box"
    box.mkdir()
    with pytest.raises(FilesRestoreRefused, match="photo.bin") as refused:
        await restore_files(store, bucket, m, region="uk", files_dir=box / "host", env_file=box / "host.env",
                            tag=FilesGen(op=generation, incarnation=INC))
    assert ("differ" if damage == "tampered" else "missing") in str(refused.value)
    assert "nothing was installed" in str(refused.value)
    assert list(box.iterdir()) == [], "no files directory, no .env, no scratch"


async def test_restore_refuses_another_region_and_an_occupied_destination(
    s3: tuple[S3Store, str], tmp_path: Path
) -> None:
    store, bucket = s3
    files, env = make_installation(tmp_path / "src")
    m = (await publish_manifest(store, bucket, binding("g4"), files, env)).manifest
    box = tmp_path / "box"
    box.mkdir()
    with pytest.raises(FilesRestoreRefused, match="region uk"):
        await restore_files(store, bucket, m, region="ie", files_dir=box / "host", env_file=None, tag=None)
    assert list(box.iterdir()) == []
    (box / "host").mkdir()
    with pytest.raises(FilesRestoreRefused, match="already exists"):
        await restore_files(store, bucket, m, region="uk", files_dir=box / "host", env_file=None, tag=None)


@pytest.mark.parametrize("kind", ["symlink", "fifo"])
async def test_a_path_that_is_not_a_regular_file_or_folder_refuses_with_its_name(
    s3: tuple[S3Store, str], tmp_path: Path, kind: str
) -> None:
    store, bucket = s3
    files, env = make_installation(tmp_path / "src")
    odd = files / "uploads" / "odd-entry"
    if kind == "symlink":
        odd.symlink_to(files / "instance.key")
    else:
        os.mkfifo(odd)
    with pytest.raises(UnsupportedEntry, match="uploads/odd-entry"):
        await publish_manifest(store, bucket, binding(f"g5-{kind}"), files, env)
    assert await store.list_keys(bucket, f"{LOCATION}/files/g-g5-{kind}/") == [], "refused before anything is written"


async def test_an_installation_without_files_publishes_an_empty_manifest(
    s3: tuple[S3Store, str], tmp_path: Path
) -> None:
    store, bucket = s3
    m = (await publish_manifest(store, bucket, binding("g6"), tmp_path / "absent", None)).manifest
    assert not m.files_dir and m.files == () and m.env is None
    out = await restore_files(store, bucket, m, region="uk", files_dir=tmp_path / "dest", env_file=None, tag=None)
    assert out.files == 0 and not (tmp_path / "dest").exists()


# -- the pure parts -------------------------------------------------------------------------------


def _entry(path: str, sha: str = "a" * 64, size: int = 1) -> FilesEntry:
    return FilesEntry(path=path, mode=0o644, size=size, sha256=sha, region="uk",
                      key=object_key(LOCATION, "g1", sha, size))


@pytest.mark.parametrize(("change", "why"), [
    ({"files": [_entry("../escape")]}, "clean relative path"),
    ({"files": [_entry("b"), _entry("a")]}, "sorted order"),
    ({"files": [_entry("dir/x")]}, "without its parent folder"),
    ({"files": [_entry(".files-gen")]}, "protocol marker"),
    ({"files": [{**msgspec.to_builtins(_entry("a")), "key": object_key(LOCATION, "g1", "b" * 64, 1)}]},
     "content-addressed"),
    ({"generation": "g9"}, "belongs to generation g9"),
    ({"format": "v0"}, "malformed"),
    ({"surprise": 1}, "malformed"),
])
def test_a_malformed_or_misbound_manifest_is_refused(change: dict[str, object], why: str) -> None:
    base = {"format": "hostmove-files-manifest-v1", "host": "h", "incarnation": INC, "location": LOCATION,
            "generation": "g1", "op": "o", "stamp": 1, "sequence": 0, "region": "uk", "files_dir": True,
            "root_mode": 0o755, "folders": [], "files": [], "env": None}
    decode_manifest(msgspec.json.encode(base), location=LOCATION, generation="g1")  # the base is valid
    with pytest.raises(FilesManifestInvalid, match=why):
        decode_manifest(msgspec.json.encode({**base, **change}), location=LOCATION, generation="g1")


def _claim(generation: str, predecessor: str) -> Claim:
    adm = Admission(session=5, box="b", generation=generation, region="ie",
                    predecessor=Predecessor(session=3, box="a", generation=predecessor, stamp=3))
    return Claim(host="h.example.com", gen=5, op=Op(kind="serving", exec="b"),
                 holder=Holder(incarnation=INC, location=LOCATION, generation=generation, stamp=5, session=5,
                               writer_box="b", admissions=(adm,)))


def test_decide_files() -> None:
    claim = _claim("w2", "w1")
    assert isinstance(decide_files(claim, False, None), RestoreFiles)
    assert isinstance(decide_files(claim, True, FilesGen(op="w1", incarnation=INC)), KeepFiles), "cold predecessor"
    assert isinstance(decide_files(claim, True, FilesGen(op="w2", incarnation=INC)), KeepFiles)
    stale = decide_files(claim, True, FilesGen(op="w0", incarnation=INC))
    assert isinstance(stale, RestoreFiles) and stale.park and "w0" in stale.reason
    assert isinstance(decide_files(claim, True, FilesGen(op="w1", incarnation="cd" * 32)), KeepFiles), (
        "another incarnation's files are the start check's to refuse, never touched")


def _run(*links: tuple[str, str, str]) -> Claim:
    """A claim whose admissions are ``(box, generation, predecessor)``, oldest first; the last is the holder's."""
    adms = tuple(Admission(session=i + 1, box=box, generation=gen, region="ie",
                           predecessor=Predecessor(session=i, box="x", generation=pred, stamp=i))
                 for i, (box, gen, pred) in enumerate(links))
    last = adms[-1]
    return Claim(host="h.example.com", gen=9, op=Op(kind="serving", exec=last.box),
                 holder=Holder(incarnation=INC, location=LOCATION, generation=last.generation, stamp=9,
                               session=last.session, writer_box=last.box, admissions=adms))


def test_files_of_a_run_of_failed_starts_on_this_box_are_kept() -> None:
    """Two failed starts in a row (a store outage at a first wake) leave the files tagged two links back: within
    one unbroken run of this box's cold admissions they are still this stay's, so the start keeps them instead of
    refusing forever; an earlier stay (another box admitted in between) is still stale."""
    run = _run(("a", "w1", ""), ("a", "w2", "w1"), ("a", "w3", "w2"))
    tagged_w1 = FilesGen(op="w1", incarnation=INC)
    assert files_generations(run, "a") == {"w3", "w2", "w1", ""}
    assert isinstance(decide_files(run, True, tagged_w1, box="a"), KeepFiles)
    assert isinstance(decide_files(run, True, tagged_w1), RestoreFiles), "without the box, the spec's two links"
    assert isinstance(start_check(run, None, tagged_w1, True, None, box="a"), RestoreCold)
    assert isinstance(start_check(run, None, tagged_w1, True, None), Refused)
    broken = _run(("a", "w1", ""), ("b", "w2", "w1"), ("a", "w3", "w2"))
    assert files_generations(broken, "a") == {"w3", "w2"}
    stale = decide_files(broken, True, tagged_w1, box="a")
    assert isinstance(stale, RestoreFiles) and stale.park, "files of a stay before b's are an earlier stay"
    assert files_generations(run, "b") == {"w3", "w2"}, "another box's run is not this box's"


# -- through the activator: lose the disk, cold-admit on another box ------------------------------


async def test_files_come_back_from_the_manifest_after_a_lost_disk(
    stack: StackInfo, unique: Callable[[str], str], tmp_path: Path
) -> None:
    async with open_world(stack, unique, tmp_path) as world:
        a_ctx, b_ctx, c_ctx = world.box("fm-a"), world.box("fm-b"), world.box("fm-c")
        host = await setup_host(world, unique, a_ctx)
        user = a_ctx.files_dir(host) / "uploads"
        user.mkdir(parents=True)
        (user / "report.pdf").write_bytes(os.urandom(200_000))
        (user / "private.txt").write_text("only mine")
        (user / "private.txt").chmod(0o600)
        a_ctx.env_path(host).write_text("SECRET_MODE=on\n")
        a = world.activator(a_ctx)
        first = await a.wake(host)
        assert isinstance(first, Started), first
        assert await a.stop(host) is not None
        before = tree_of(a_ctx.files_dir(host))
        assert {"instance.key", "uploads/report.pdf", "uploads/private.txt"} <= set(before)
        m1 = await read_manifest(world.store, world.bucket, f"instances/{host}/{ACT_INC}", first.generation)
        assert m1 is not None and m1.manifest.stamp > 0 and m1.manifest.op == f"session:{first.session}"

        remove_box_data(a_ctx)
        await reassign(world.ledger, host, "fm-b")
        b_ctx.registry.insert(RouteRow(host=host, status="ready", incarnation=ACT_INC))
        b = world.activator(b_ctx)
        second = await b.wake(host)
        assert isinstance(second, Started), second
        assert tree_of(b_ctx.files_dir(host)) == before, "byte-identical, modes included"
        assert b_ctx.env_path(host).read_text() == "SECRET_MODE=on\n"
        tag = read_files_gen(b_ctx.files_dir(host))
        assert tag is not None and tag.op == second.generation, ".files-gen names the new installation"
        m2 = await read_manifest(world.store, world.bucket, f"instances/{host}/{ACT_INC}", second.generation)
        assert m2 is not None and [f.sha256 for f in m2.manifest.files] == [f.sha256 for f in m1.manifest.files]
        await b.stop(host)

        # Stale files of this incarnation (an earlier stay's tag) are parked, never deleted, and restored (§6.3).
        write_files_gen(b_ctx.files_dir(host), "w-earlier-stay", ACT_INC)
        (b_ctx.files_dir(host) / "uploads" / "private.txt").write_text("stale")
        third = await b.wake(host)
        assert isinstance(third, Started), third
        assert tree_of(b_ctx.files_dir(host)) == before
        parked = b_ctx.data_dir / ".parked" / f"superseded-{third.generation}" / host
        assert (parked / "uploads" / "private.txt").read_text() == "stale"
        await b.stop(host)

        # Without any manifest on the chain, a lost files directory is never started empty (§7.6).
        for gen in (first.generation, second.generation, third.generation):
            for v in await world.store.list_versions(world.bucket, f"instances/{host}/{ACT_INC}/files/g-{gen}/"):
                await world.store.delete(world.bucket, v.key, version_id=v.version_id)
        remove_box_data(b_ctx)
        await reassign(world.ledger, host, "fm-c")
        c_ctx.registry.insert(RouteRow(host=host, status="ready", incarnation=ACT_INC))
        refused = await world.activator(c_ctx).wake(host)
        assert isinstance(refused, StartFailed) and "never started empty" in refused.reason, refused
        assert not c_ctx.files_dir(host).exists() and not c_ctx.tree.populated(host)


# -- the landing's local: the prepared manifest of g-<move>, before .files-gen ----------------------


@pytest_asyncio.fixture(loop_scope="session", scope="module")
async def landing(stack: StackInfo, unique: Callable[[str], str],
                  tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[tt.World]:
    store = await S3Store.open(stack.s3_endpoint, stack.s3_access_key, stack.s3_secret_key, stack.s3_region)
    events = await NatsEventLog.connect(stack.nats_url)
    bucket = unique("fm-landing")
    await store.create_bucket(bucket)
    ledger = Ledger(store, events, WallClock(), Actor(service="target", pid=1, nonce="f"), bucket)
    try:
        with box_tree(unique("box.fm")) as (tree, _home):  # the target box's cgroups, as tests/test_target.py
            w = tt.World(store, events, bucket, ledger, tmp_path_factory.mktemp("fm-landing"),
                         generate_private_key(), [], [], tree)
            yield w
            for worker in w.workers:
                for host_ in list(worker.running):
                    await worker.running.stop(host_)
            for app in w.apps:
                await app.stop()
    finally:
        await store.delete_bucket(bucket)
        await events.close()
        await store.close()


async def _prepared(w: tt.World, host: str) -> tuple[str, Got]:
    claim = (await w.ledger.read_claim(host)).state
    assert claim is not None and claim.holder is not None
    got = await w.store.get(w.bucket, manifest_key(claim.holder.location, tt.MV))
    assert isinstance(got, Got), "local published the prepared manifest of g-<move>"
    return claim.holder.location, got


@pytest.mark.parametrize("crash_at", [None, "local:manifest-published"])
async def test_local_publishes_the_prepared_manifest_of_the_move_generation(
    landing: tt.World, unique: Callable[[str], str], crash_at: str | None
) -> None:
    host = f"{unique('fm-land')}.example.com"
    await tt.stage(landing, host, now=WallClock().now_ms())
    label = f"fm-box-{crash_at is not None}"
    faults = tt.Crashes(crash_at) if crash_at is not None else None
    worker = tt.make_box(landing, label, faults=faults)
    if faults is not None:
        with pytest.raises(Crash):
            await worker.run(host)
        assert read_files_gen(worker.box.files_dir(host)) is None, ".files-gen is written only after the manifest"
        worker = tt.make_box(landing, label)
    step = await worker.run(host)
    assert step.outcome == "opened", step
    location, got = await _prepared(landing, host)
    m = decode_manifest(got.body, location=location, generation=tt.MV)
    claim = (await landing.ledger.read_claim(host)).state
    assert claim is not None and claim.holder is not None
    assert claim.holder.generation == tt.MV, "the probe's first admission opened the prepared generation"
    assert (m.op, m.incarnation, m.sequence, m.region, m.host) == (tt.MV, tt.INC, 0, "uk", host)
    assert [f.path for f in m.files] == ["notes.txt", "uploads/a.txt"] and m.env is not None
    versions = await landing.store.list_versions(landing.bucket, manifest_key(location, tt.MV))
    assert len(versions) == 1, "create-only: a replay after the crash reused the manifest"
    box = worker.box
    dest = landing.root / f"restored-{host}"
    await restore_files(landing.store, landing.bucket, m, region="uk", files_dir=dest / "files",
                        env_file=dest / "env", tag=None)
    assert tree_of(dest / "files") == tree_of(box.files_dir(host))
    assert (dest / "env").read_bytes() == box.env_path(host).read_bytes()
