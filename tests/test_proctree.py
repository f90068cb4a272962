"""Instances as real OS processes in a real cgroup v2 leaf (spec §5.3, §14.1; ARCHITECTURE §6)."""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kernel.ports import WallClock
from services.box.compute import BoxCompute, LocalCompute
from services.box.instance.agentcg import scrub
from services.box.instance.proctree import (
    AGENT_LEAF,
    CgroupTree,
    SpawnJournal,
    StrictRefused,
    current_cgroup_dir,
    find_cgroup2_root,
    host_of_leaf,
    leaf_name,
    open_holders,
    stray_processes,
)
from tests.helpers.cgtest import (
    TEST_DEPLOYMENT,
    Reaper,
    alive,
    as_agent,
    box_tree,
    cgroup_root,
    forker,
    python_env,
    read_pid,
    wait_for,
)

HOST = "shop.example.com"


@pytest.fixture
def box(unique: Callable[..., str]) -> Iterator[tuple[CgroupTree, Path]]:
    with box_tree(unique("box.proc")) as made:
        yield made


@pytest.fixture
def reaper() -> Iterator[Reaper]:
    r = Reaper()
    try:
        yield r
    finally:
        r.close()


def spawn_tree(tree: CgroupTree, host: str, work: Path) -> tuple[int, int]:
    """Start the forker's tree in the host's leaf; wait until the app exited and its descendant lives."""
    out = work / host
    out.mkdir()
    spawned = tree.spawn_strict(
        host,
        forker("tree", str(out)),
        env=python_env(),
        cwd=work,
        stdout=work / f"{host}.out",
        stderr=work / f"{host}.err",
    )
    assert spawned.process.wait(timeout=20) == 0, (work / f"{host}.err").read_text()
    parent = read_pid(out / "parent.pid")
    assert parent == spawned.pid
    return parent, read_pid(out / "descendant.pid")


# -- names and discovery -------------------------------------------------------------------------------------


@given(st.text(min_size=1, max_size=80))
def test_leaf_names_are_safe_and_reversible(name: str) -> None:
    token = leaf_name(name)
    assert "." not in token and "/" not in token and "@" not in token and "\x00" not in token
    assert len(token.encode()) <= 255
    if token.startswith("_~"):  # too long to spell out: a hash, unique but not reversible
        assert len(name.encode()) * 3 > 240 and host_of_leaf(token) is None
    else:
        assert host_of_leaf(token) == name


def test_leaf_names_for_dotted_and_long_hosts() -> None:
    assert leaf_name("shop.example.com") == "shop_2Eexample_2Ecom"
    assert leaf_name("a_b") == "a_5Fb"
    long = "x." * 150
    token = leaf_name(long)
    assert token.startswith("_~") and len(token) == 66 and host_of_leaf(token) is None
    assert leaf_name(long + "y") != token
    assert host_of_leaf("cgroup.procs") is None and host_of_leaf(AGENT_LEAF) is None


def test_find_cgroup2_root_reads_mounts(tmp_path: Path) -> None:
    hybrid = tmp_path / "hybrid"
    hybrid.write_text(
        "tmpfs /sys/fs/cgroup tmpfs rw 0 0\n"
        "cgroup /sys/fs/cgroup/memory cgroup rw,memory 0 0\n"
        "cgroup2 /sys/fs/cgroup/unified cgroup2 rw,relatime 0 0\n"
    )
    assert find_cgroup2_root(hybrid) == Path("/sys/fs/cgroup/unified")
    unified = tmp_path / "unified"
    unified.write_text("cgroup2 /sys/fs/cgroup cgroup2 rw,nsdelegate 0 0\n")
    assert find_cgroup2_root(unified) == Path("/sys/fs/cgroup")
    spaced = tmp_path / "spaced"
    spaced.write_text("none /mnt/my\\040groups cgroup2 rw 0 0\n")
    assert find_cgroup2_root(spaced) == Path("/mnt/my groups")
    v1 = tmp_path / "v1"
    v1.write_text("cgroup /sys/fs/cgroup/cpu cgroup rw,cpu 0 0\n")
    assert find_cgroup2_root(v1) is None
    assert find_cgroup2_root(tmp_path / "absent") is None
    real = find_cgroup2_root()
    assert real is not None and (real / "cgroup.controllers").exists()


def test_without_cgroup2_the_box_says_so_and_never_spawns(tmp_path: Path) -> None:
    mounts = tmp_path / "mounts"
    mounts.write_text("cgroup /sys/fs/cgroup/cpu cgroup rw,cpu 0 0\n")
    tree = CgroupTree.discover("box-a", deployment="d1", mounts=mounts)
    ok, reason = tree.strict_available()
    assert not ok and "no cgroup v2" in reason and "refuses" in reason
    marker = tmp_path / "ran"
    with pytest.raises(StrictRefused, match="no cgroup v2"):
        tree.spawn_strict(
            HOST, ["/bin/touch", str(marker)], env=python_env(), cwd=tmp_path,
            stdout=tmp_path / "o", stderr=tmp_path / "e",
        )
    assert not marker.exists()


def test_strict_available_on_this_machine(box: tuple[CgroupTree, Path]) -> None:
    tree, _ = box
    ok, reason = tree.strict_available()
    assert ok, reason
    assert tree.base is not None and (tree.base / "cgroup.kill").exists()


# -- strict spawns -------------------------------------------------------------------------------------------


def test_the_app_is_in_the_leaf_before_it_executes(box: tuple[CgroupTree, Path], tmp_path: Path) -> None:
    tree, _ = box
    out = tmp_path / "cg"
    spawned = tree.spawn_strict(
        HOST, forker("cgroup", str(out)), env=python_env(), cwd=tmp_path, stdout=tmp_path / "o", stderr=tmp_path / "e"
    )
    root = cgroup_root()

    def seen() -> str | None:
        return out.read_text() if out.exists() else None

    text = wait_for(seen, "the app's first look at its cgroup")
    line = next(x for x in text.splitlines() if x.startswith("0::"))
    assert root / line[3:].lstrip("/") == tree.leaf(HOST) == spawned.leaf
    assert tree.members(HOST) == (spawned.pid,)
    assert tree.populated(HOST)


def test_a_spawn_that_cannot_be_placed_never_runs(box: tuple[CgroupTree, Path], tmp_path: Path) -> None:
    """The kernel refuses processes in a "domain invalid" group (a sibling was made threaded): the shim's
    placement fails, the app never runs, the spawn refuses, and the group stays empty."""
    tree, _ = box
    leaf = tree.prepare_strict(HOST)
    sibling = tree.prepare_strict("threaded.sibling")
    (sibling / "cgroup.type").write_text("threaded")
    assert (leaf / "cgroup.type").read_text().strip() == "domain invalid"
    marker = tmp_path / "ran"
    try:
        with pytest.raises(StrictRefused, match="could not be placed"):
            tree.spawn_strict(
                HOST, ["/bin/touch", str(marker)], env=python_env(), cwd=tmp_path,
                stdout=tmp_path / "o", stderr=tmp_path / "e",
            )
        assert not marker.exists()
        assert not tree.populated(HOST)
    finally:
        sibling.rmdir()
    assert (leaf / "cgroup.type").read_text().strip() == "domain"
    tree.spawn_strict(
        HOST, ["/bin/touch", str(marker)], env=python_env(), cwd=tmp_path, stdout=tmp_path / "o", stderr=tmp_path / "e"
    ).process.wait(timeout=10)
    assert marker.exists()


def test_a_missing_program_is_a_plain_error(box: tuple[CgroupTree, Path], tmp_path: Path) -> None:
    tree, _ = box
    with pytest.raises(FileNotFoundError, match="no-such-program"):
        tree.spawn_strict(
            HOST, ["no-such-program"], env=python_env(), cwd=tmp_path, stdout=tmp_path / "o", stderr=tmp_path / "e"
        )
    assert not tree.populated(HOST)


async def test_a_descendant_that_outlives_its_parent_keeps_the_group_populated(
    box: tuple[CgroupTree, Path], tmp_path: Path
) -> None:
    tree, _ = box
    parent, descendant = spawn_tree(tree, HOST, tmp_path)
    # The app (the "main process") exited; a check that waits for it alone would call the host stopped.
    assert not alive(parent)
    assert alive(descendant)
    assert os.listdir(f"/proc/{descendant}/fd") == []  # it closed every descriptor
    assert tree.populated(HOST)
    assert tree.members(HOST) == (descendant,)
    with pytest.raises(StrictRefused, match="still has processes"):
        tree.prepare_strict(HOST)
    marker = tmp_path / "second"
    with pytest.raises(StrictRefused, match="still has processes"):
        tree.spawn_strict(
            HOST, ["/bin/touch", str(marker)], env=python_env(), cwd=tmp_path,
            stdout=tmp_path / "o", stderr=tmp_path / "e",
        )
    assert not marker.exists()

    drain = await tree.kill_and_drain(HOST, within_s=10)
    assert drain.existed and drain.drained and not drain.error
    assert drain.pids_before == (descendant,)
    assert not tree.populated(HOST)
    assert not alive(descendant)
    assert tree.prepare_strict(HOST) == tree.leaf(HOST)  # empty again: a strict spawn may proceed


async def test_a_restarted_agent_reopens_and_drains(box: tuple[CgroupTree, Path], tmp_path: Path) -> None:
    tree, _ = box
    _, descendant = spawn_tree(tree, HOST, tmp_path)
    assert tree.root is not None
    restarted = CgroupTree(tree.root, tree.box_label, deployment=tree.deployment)  # no memory of the spawn
    assert restarted.populated(HOST)
    assert restarted.members(HOST) == (descendant,)
    drain = await restarted.reopen_and_drain(HOST, within_s=10)
    assert drain.drained and drain.pids_before == (descendant,)
    assert not alive(descendant)
    assert not tree.populated(HOST) and not restarted.populated(HOST)


async def test_reopen_and_drain_never_creates_a_group(box: tuple[CgroupTree, Path]) -> None:
    tree, _ = box
    assert tree.strict_available()[0]
    drain = await tree.reopen_and_drain("never.spawned", within_s=1)
    assert drain.drained and not drain.existed and drain.pids_before == ()
    assert not tree.leaf("never.spawned").exists()
    assert not tree.populated("never.spawned")


async def test_hosts_are_isolated(box: tuple[CgroupTree, Path], tmp_path: Path) -> None:
    tree, _ = box
    _, d1 = spawn_tree(tree, "one.example", tmp_path)
    _, d2 = spawn_tree(tree, "two.example", tmp_path)
    await tree.kill_and_drain("one.example", within_s=10)
    assert not alive(d1) and alive(d2)
    assert tree.populated("two.example")
    await tree.kill_and_drain("two.example", within_s=10)
    assert not alive(d2)


# -- the spawn journal (§5.3 "An absent host cgroup is insufficient where an earlier spawn could escape") --------


def test_the_journal_counts_this_boots_spawns_durably(tmp_path: Path) -> None:
    boot = tmp_path / "boot_id"
    boot.write_text("boot-a\n")
    journal = SpawnJournal(tmp_path / "spawns", boot_id=boot)
    empty = journal.history(HOST)
    assert (empty.readable, empty.attempted) == (True, False) and "records no spawn" in empty.detail
    journal.record(HOST, strict=True)
    journal.record(HOST, strict=True)
    journal.record(HOST, strict=False)
    journal.record("other.example", strict=True)
    again = SpawnJournal(tmp_path / "spawns", boot_id=boot).history(HOST)  # a restarted agent: nothing in memory
    assert (again.readable, again.boot_id, again.strict, again.loose) == (True, "boot-a", 2, 1)

    boot.write_text("boot-b\n")  # after a reboot every earlier process is gone: the counts are void
    after = journal.history(HOST)
    assert (after.readable, after.strict, after.loose) == (True, 0, 0) and "earlier boot (boot-a)" in after.detail
    assert journal.record(HOST, strict=True).strict == 1 and journal.history(HOST).loose == 0


def test_an_unreadable_journal_is_unknown_never_empty(tmp_path: Path) -> None:
    boot = tmp_path / "boot_id"
    boot.write_text("boot-a\n")
    journal = SpawnJournal(tmp_path / "spawns", boot_id=boot)
    journal.path(HOST).write_text('{"host": "shop.example.com", "boot_id": "boot-a", "strict": -1, "loose": 0}')
    bad = journal.history(HOST)
    assert not bad.readable and "'strict'" in bad.detail
    journal.path(HOST).write_text("{not json")
    assert not journal.history(HOST).readable
    journal.path(HOST).unlink()
    (tmp_path / "spawns").rmdir()
    assert not journal.history(HOST).readable and "is gone" in journal.history(HOST).detail
    assert not SpawnJournal(tmp_path / "j2", boot_id=tmp_path / "no-boot-id").history(HOST).readable


def test_a_tree_without_a_journal_knows_nothing(box: tuple[CgroupTree, Path]) -> None:
    tree, _ = box
    history = tree.spawn_history(HOST)
    assert not history.readable and "keeps no spawn journal" in history.detail


def test_a_strict_spawn_is_journaled_before_it_runs(box: tuple[CgroupTree, Path], tmp_path: Path) -> None:
    tree, _ = box
    tree.journal = SpawnJournal(tmp_path / "spawns")
    marker = tmp_path / "ran"
    tree.spawn_strict(
        HOST, ["/bin/touch", str(marker)], env=python_env(), cwd=tmp_path, stdout=tmp_path / "o", stderr=tmp_path / "e"
    ).process.wait(timeout=10)
    assert marker.exists()
    history = tree.spawn_history(HOST)
    assert (history.readable, history.strict, history.loose) == (True, 1, 0)

    # A journal that cannot be written refuses the spawn: nothing runs that the journal does not know of.
    (tmp_path / "spawns").rename(tmp_path / "spawns.moved")
    (tmp_path / "spawns").write_text("not a directory")
    marker.unlink()
    with pytest.raises(StrictRefused, match="spawn journal"):
        tree.spawn_strict(
            HOST, ["/bin/touch", str(marker)], env=python_env(), cwd=tmp_path,
            stdout=tmp_path / "o", stderr=tmp_path / "e",
        )
    assert not marker.exists() and not tree.populated(HOST)


# -- scans ---------------------------------------------------------------------------------------------------


def test_open_holders_finds_database_wal_and_shm(tmp_path: Path, reaper: Reaper) -> None:
    db = tmp_path / "app.db"
    ready = tmp_path / "ready"
    proc = reaper.start(forker("hold", str(db), str(ready)))
    pid = read_pid(ready)
    assert pid == proc.pid
    paths = [db, Path(f"{db}-wal"), Path(f"{db}-shm")]
    scan = open_holders(paths)
    assert scan.complete and scan.scanned > 1
    mine = {h.path: h.via for h in scan.holders if h.pid == pid}
    assert mine == {str(db): "fd", f"{db}-wal": "fd", f"{db}-shm": "fd,map"}  # SQLite maps the SHM
    assert all(h.pid == pid for h in scan.holders)
    assert {h.name for h in scan.holders} == {"python"} or all(h.name != "?" for h in scan.holders)
    # through a symlinked directory, the same files are found
    link = tmp_path / "link"
    link.symlink_to(tmp_path)
    assert {h.pid for h in open_holders([link / "app.db"]).holders} == {pid}
    # an owner filter that does not match skips the process
    assert open_holders(paths, uid=os.getuid() + 12345).holders == ()
    proc.kill()
    proc.wait(timeout=10)
    assert open_holders(paths).holders == ()


def test_a_held_file_that_was_unlinked_still_counts(tmp_path: Path, reaper: Reaper) -> None:
    db = tmp_path / "gone.db"
    ready = tmp_path / "ready"
    reaper.start(forker("hold", str(db), str(ready)))
    pid = read_pid(ready)
    os.unlink(f"{db}-wal")
    held = {(h.pid, h.path) for h in open_holders([Path(f"{db}-wal")]).holders}
    assert (pid, f"{db}-wal") in held


def test_our_own_connection_is_a_holder(tmp_path: Path) -> None:
    """The agent is not exempt: the replicator must be closed before evidence (§5.3 joint D3)."""
    db = tmp_path / "self.db"
    conn = sqlite3.connect(db)
    try:
        conn.execute("CREATE TABLE t (x)")
        assert os.getpid() in {h.pid for h in open_holders([db]).holders}
    finally:
        conn.close()
    assert open_holders([db]).holders == ()


def test_an_unreadable_proc_is_never_no_holders(tmp_path: Path) -> None:
    missing = open_holders([tmp_path / "x.db"], proc=tmp_path / "no-proc")
    assert not missing.complete and "cannot list" in missing.error
    fake = tmp_path / "fake-proc"
    (fake / "1" / "fd").mkdir(parents=True)
    other_ns = open_holders([tmp_path / "x.db"], proc=fake)
    assert not other_ns.complete and "does not show this process" in other_ns.error


def test_stray_processes_in_the_agent_leaf(box: tuple[CgroupTree, Path], reaper: Reaper, tmp_path: Path) -> None:
    tree, home = box
    with as_agent(tree, home) as agent:
        assert current_cgroup_dir(cgroup_root()) == agent == tree.agent_dir()
        clean = tree.strays(os.getpid())
        assert clean.readable and clean.strays == ()
        # a child started the ordinary (non-strict) way inherits the agent's group: a stray
        ready = tmp_path / "stray"
        proc = reaper.start(forker("sleep", str(ready)))
        read_pid(ready)
        scan = stray_processes(agent, os.getpid())
        assert scan.readable and scan.strays == (proc.pid,)
        assert tree.strays(os.getpid()).strays == (proc.pid,)
        proc.kill()
        proc.wait(timeout=10)
        assert tree.strays(os.getpid()).strays == ()
    unreadable = stray_processes(tmp_path / "not-a-cgroup", os.getpid())
    assert not unreadable.readable and "cannot read" in unreadable.error


# -- two deployments on one machine (issue 11 item 5) -----------------------------------------------------------


def test_a_box_is_keyed_by_its_deployment_as_well_as_its_label(tmp_path: Path) -> None:
    root = tmp_path / "cgroup2"
    a = CgroupTree(root, "ie-1", deployment="dep-a")
    b = CgroupTree(root, "ie-1", deployment="dep-b")
    assert a.base == root / "hostmove" / "dep-a" / "ie-1" and b.base == root / "hostmove" / "dep-b" / "ie-1"
    assert a.leaf(HOST) == root / "hostmove" / "dep-a" / "ie-1" / "shop_2Eexample_2Ecom"
    assert a.leaf(HOST) != b.leaf(HOST) and a.agent_leaf() != b.agent_leaf()
    assert a.agent_leaf() == root / "hostmove" / "dep-a" / "ie-1" / AGENT_LEAF
    odd = CgroupTree(root, "ie-1", deployment="x.y/z")  # a name is always made safe: one directory, no dot
    assert odd.deployment_dir == root / "hostmove" / "x_2Ey_2Fz"
    with pytest.raises(ValueError, match="keyed by its deployment"):
        CgroupTree(root, "ie-1")
    assert CgroupTree(None, "ie-1").base is None  # no hierarchy here: nothing to key, every spawn refuses


def _stray_in(tree: CgroupTree, reaper: Reaper, ready: Path) -> int:
    """A process in the box's own ``@agent`` leaf that is not the agent: a stray of that box."""
    proc = reaper.start(forker("sleep", str(ready)))
    read_pid(ready)
    tree.enter_agent_leaf(proc.pid)
    return proc.pid


async def test_one_deployment_never_scans_or_kills_the_others_processes(
    unique: Callable[..., str], reaper: Reaper, tmp_path: Path
) -> None:
    """Two deployments name a box the same on one machine: each one's stray scan, kill and drain, scrub and
    fence stay inside its own subtree, and the other's instance and agent-leaf processes live on."""
    label = unique("ie-1")
    with box_tree(label, deployment=f"{TEST_DEPLOYMENT}-a") as (a, home), \
            box_tree(label, deployment=f"{TEST_DEPLOYMENT}-b") as (b, _):
        assert a.base is not None and b.base is not None and a.base != b.base and a.box_label == b.box_label
        (tmp_path / "a").mkdir()
        (tmp_path / "b").mkdir()
        _, a_descendant = spawn_tree(a, HOST, tmp_path / "a")
        _, b_descendant = spawn_tree(b, HOST, tmp_path / "b")
        assert b.strict_available()[0]
        b_stray = _stray_in(b, reaper, tmp_path / "b-stray")
        assert a.members(HOST) == (a_descendant,) and b.members(HOST) == (b_descendant,)

        with as_agent(a, home):
            scan = a.strays(os.getpid())
            assert scan.readable and scan.strays == (), scan  # b's stray is not a's to see
            drain = await a.kill_and_drain(HOST, within_s=10)
            assert drain.drained and drain.pids_before == (a_descendant,)
            assert not alive(a_descendant) and alive(b_descendant) and b.populated(HOST)
            again = await a.reopen_and_drain(HOST, within_s=10)
            assert again.drained and again.pids_before == () and alive(b_descendant)
        b_scan = b.strays(os.getpid())
        assert b_scan.readable is False and str(home) in b_scan.error  # not b's agent: b's group is not read
        with as_agent(b, home):
            assert b.strays(os.getpid()).strays == (b_stray,)
            assert a.strays(os.getpid()).readable is False, "an agent in b's leaf is never a's to scan"

        _, a_descendant = spawn_tree(a, "two.example", tmp_path / "a")
        scrub(a, home)  # a's agent stops: its whole subtree goes, nothing of b's
        assert not a.base.exists() and not alive(a_descendant)
        assert b.base.is_dir() and alive(b_descendant) and alive(b_stray) and b.populated(HOST)

        (tmp_path / "a2").mkdir()
        _, a_descendant = spawn_tree(a, HOST, tmp_path / "a2")
        a_stray = _stray_in(a, reaper, tmp_path / "a-stray")
        platform = LocalCompute(tmp_path / "platform", a.deployment, clock=WallClock())
        seen = await platform.terminate(BoxCompute(label, "ie", "fp@1"))  # terminating a's ie-1 kills a's ie-1 only
        assert seen.status == "terminated" and "every process of box" in seen.evidence and a.deployment in seen.evidence
        assert not alive(a_descendant) and not alive(a_stray)
        assert alive(b_descendant) and alive(b_stray) and b.members(HOST) == (b_descendant,)
