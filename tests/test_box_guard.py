"""The host guard across real OS processes, and the stamp record under it (spec §6.4, claim C7)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from contextlib import AbstractAsyncContextManager
from pathlib import Path

import pytest

from events.claim import Claim, Holder, Op, OpKind
from kernel.ports import ManualClock, WallClock
from services.box.instance.guard import Guarded, GuardTimeout, host_guard, lock_path
from services.box.instance.stamps import (
    Activate,
    NoChange,
    Refuse,
    StampBook,
    StampError,
    StampRecord,
    admits,
    decide_init,
)

ROOT = Path(__file__).resolve().parents[1]
HOST = "shop.example.app"
INC = "ef" * 32
INC2 = "12" * 32
MV = "mv_" + "a" * 26
SRC, TGT = "box-us-1", "box-uk-1"

WORKER = textwrap.dedent(
    """
    import asyncio, os, sys
    from pathlib import Path
    from services.box.instance.guard import host_guard

    box, host, log, counter, rounds = sys.argv[1], sys.argv[2], Path(sys.argv[3]), Path(sys.argv[4]), int(sys.argv[5])
    me = str(os.getpid())

    def append(line):
        with open(log, "a") as fh:
            fh.write(line + "\\n")

    async def read_claim():
        append("read " + me)
        return None

    async def main():
        for _ in range(rounds):
            async with host_guard(Path(box), host, read_claim, timeout_s=60, poll_s=0.001):
                append("+ " + me)
                n = int(counter.read_text() or "0")  # a racy read-modify-write, safe only under the guard
                await asyncio.sleep(0.001)
                counter.write_text(str(n + 1))
                append("- " + me)

    asyncio.run(main())
    """
)

HOLDER = textwrap.dedent(
    """
    import asyncio, sys
    from pathlib import Path
    from services.box.instance.guard import host_guard

    async def read_claim():
        return None

    async def main():
        async with host_guard(Path(sys.argv[1]), sys.argv[2], read_claim):
            print("held", flush=True)
            await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)

    asyncio.run(main())
    """
)


def spawn(script: str, *args: str, stdin: int | None = None, stdout: int | None = None) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [sys.executable, "-c", script, *args], cwd=ROOT, env=env, text=True, stdin=stdin, stdout=stdout
    )


def test_two_processes_never_hold_the_guard_at_once(tmp_path: Path) -> None:
    log, counter = tmp_path / "log", tmp_path / "counter"
    counter.write_text("0")
    procs, rounds = 4, 25
    workers = [spawn(WORKER, str(tmp_path / "box"), HOST, str(log), str(counter), str(rounds)) for _ in range(procs)]
    for w in workers:
        assert w.wait(timeout=120) == 0
    lines = log.read_text().splitlines()
    assert len(lines) == 3 * procs * rounds
    assert len({line.split()[1] for line in lines}) == procs, "every process took part"
    # Each critical section is read, enter, leave by one process, never interleaved with another's.
    for i in range(0, len(lines), 3):
        (r, pr), (e, pe), (x, px) = (line.split() for line in lines[i : i + 3])
        assert (r, e, x) == ("read", "+", "-") and pr == pe == px, lines[i : i + 3]
    assert int(counter.read_text()) == procs * rounds, "no increment was lost to a concurrent holder"


async def test_a_busy_guard_times_out_and_a_dead_holder_frees_it(tmp_path: Path) -> None:
    holder = spawn(HOLDER, str(tmp_path), HOST, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert holder.stdout is not None
        assert await asyncio.to_thread(holder.stdout.readline) == "held\n"
        reads: list[int] = []

        async def read_claim() -> Claim | None:
            reads.append(1)
            return None

        with pytest.raises(GuardTimeout) as err:
            async with host_guard(tmp_path, HOST, read_claim, timeout_s=0.3):
                pytest.fail("the guard was taken while another process holds it")
        assert HOST in str(err.value) and str(holder.pid) in str(err.value)
        assert reads == [], "no claim read happens without the guard"

        holder.send_signal(signal.SIGKILL)  # the kernel drops a dead holder's flock
        await asyncio.to_thread(holder.wait, 10)
        async with host_guard(tmp_path, HOST, read_claim, timeout_s=10) as g:
            assert g.held and reads == [1]
        assert not g.held
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()


async def test_guard_in_one_process_and_a_failed_read(tmp_path: Path) -> None:
    order: list[str] = []
    inside = asyncio.Event()
    release = asyncio.Event()

    async def read() -> Claim | None:
        return None

    async def first() -> None:
        async with host_guard(tmp_path, HOST, read, timeout_s=5):
            order.append("first in")
            inside.set()
            await release.wait()
            order.append("first out")

    async def second() -> None:
        await inside.wait()
        async with host_guard(tmp_path, HOST, read, timeout_s=5):
            order.append("second in")

    t1, t2 = asyncio.create_task(first()), asyncio.create_task(second())
    await inside.wait()
    await asyncio.sleep(0.05)  # give the second coroutine time to try: it must still be waiting
    assert order == ["first in"]
    release.set()
    await asyncio.wait_for(asyncio.gather(t1, t2), 5)
    assert order == ["first in", "first out", "second in"]

    async def broken() -> Claim | None:
        raise OSError("the object store did not answer")

    with pytest.raises(OSError, match="did not answer"):
        async with host_guard(tmp_path, HOST, broken, timeout_s=1):
            pytest.fail("a failed claim read never reaches the body")
    async with host_guard(tmp_path, HOST, read, timeout_s=0.5) as g:  # released despite the failure
        assert g.claim is None
    assert lock_path(tmp_path, "a/../b").name == "a%2F..%2Fb.lock"


# --- stamps ----------------------------------------------------------------------------------


def claim(*, stamp: int, exec_: str = SRC, kind: OpKind = "serving", incarnation: str = INC,
          participants: tuple[str, ...] = ()) -> Claim:
    return Claim(
        host=HOST,
        gen=stamp + 3,
        holder=Holder(incarnation=incarnation, location=f"instances/{HOST}/{incarnation}", stamp=stamp),
        op=Op(kind=kind, id="" if kind == "serving" else MV, exec=exec_, participants=participants),
    )


@pytest.fixture
def book(tmp_path: Path) -> Iterator[StampBook]:
    b = StampBook.open(tmp_path, ManualClock())
    yield b
    b.close()


def guard(tmp_path: Path, c: Claim | None) -> AbstractAsyncContextManager[Guarded]:
    async def read() -> Claim | None:
        return c

    return host_guard(tmp_path, HOST, read, clock=WallClock(), timeout_s=5)


def test_decide_init_rules() -> None:
    assert isinstance(decide_init(None, SRC, None), Refuse)
    assert decide_init(claim(stamp=10), SRC, None) == Activate(10)
    assert isinstance(decide_init(claim(stamp=10), TGT, None), Refuse), "not the executor"
    landing = claim(stamp=20, exec_="none", kind="landing", participants=(SRC, TGT))
    assert decide_init(landing, TGT, None) == Activate(20), "the landing participant initializes"
    assert isinstance(decide_init(landing, SRC, None), Refuse)
    rec = StampRecord(HOST, INC, 10, (4,))
    assert decide_init(claim(stamp=10), SRC, rec) == NoChange(10)
    assert isinstance(decide_init(claim(stamp=4), SRC, rec), Refuse), "a retired stamp is never reused"
    assert isinstance(decide_init(claim(stamp=0), SRC, None), Refuse)
    assert not admits(None, 10) and not admits(StampRecord(HOST, INC, None, (10,)), 10)
    assert admits(rec, 10) and not admits(rec, 4) and not admits(rec, 9) and not admits(rec, 11)


async def test_admit_only_the_active_stamp_and_survive_reopening(tmp_path: Path, book: StampBook) -> None:
    async with guard(tmp_path, claim(stamp=10)) as g:
        assert not book.admit(g, INC, 10), "no record: refuse"
        assert book.init_record(g, SRC) == Activate(10)
        assert book.admit(g, INC, 10)
        assert not book.admit(g, INC, 9) and not book.admit(g, INC, 11)
        assert not book.admit(g, INC2, 10), "another incarnation's writer"
        assert book.init_record(g, SRC) == NoChange(10)
    with pytest.raises(RuntimeError, match="released"):
        book.admit(g, INC, 10)

    # A new installation (a dirty return's probe CAS, R): activation retires the old stamp first.
    async with guard(tmp_path, claim(stamp=15)) as g:
        assert book.init_record(g, SRC) == Activate(15)
        assert not book.admit(g, INC, 10) and book.admit(g, INC, 15)
    assert book.record(HOST, INC) == StampRecord(HOST, INC, 15, (10,))

    # A claim naming a retired stamp is refused and changes nothing.
    async with guard(tmp_path, claim(stamp=10)) as g:
        assert isinstance(book.init_record(g, SRC), Refuse)
    book.close()

    again = StampBook.open(tmp_path, ManualClock())
    try:
        assert again.record(HOST, INC) == StampRecord(HOST, INC, 15, (10,))
        async with guard(tmp_path, claim(stamp=15)) as g:
            assert again.admit(g, INC, 15) and not again.admit(g, INC, 10)
    finally:
        again.close()


def make(path: Path, text: str = "x") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


async def test_retire_artifacts_parks_by_tag_and_moves_no_stamp(tmp_path: Path, book: StampBook) -> None:
    data = tmp_path / "data"
    old_db, new_db = make(data / "old" / f"{HOST}.db", "old"), make(data / f"{HOST}.db", "new")
    files, env = make(data / HOST / "a.txt"), make(data / f"{HOST}.env")
    async with guard(tmp_path, claim(stamp=10)) as g:
        book.init_record(g, SRC)
        book.tag(g, INC, "old-db", old_db, 10)  # a leftover of installation 10
    async with guard(tmp_path, claim(stamp=12)) as g:
        book.init_record(g, SRC)  # 10 retired, 12 active
        book.tag(g, INC, "db", new_db, 12)
        book.tag(g, INC, "files", files.parent, 12)
        book.tag(g, INC, "env", env, 12)
        with pytest.raises(StampError, match="retired"):
            book.tag(g, INC, "late", make(data / "late"), 10)
        before = book.record(HOST, INC)

        parked = book.retire_artifacts(g, INC, 12, op=MV, event="ev-local", names={"db"})
        assert [p.name for p in parked] == ["db"], "the database alone, where the files are carried"
        dest = tmp_path / ".parked" / f"superseded-{MV}" / "ev-local" / HOST
        assert not new_db.exists() and (dest / f"{HOST}.db").read_text() == "new"
        assert (dest / "manifest.json").exists()
        assert book.record(HOST, INC) == before, "retire-artifacts moves no stamp"
        assert book.admit(g, INC, 12)

        parked = book.retire_artifacts(g, INC, 12, op=MV, event="ev-2")
        assert sorted(p.name for p in parked) == ["env", "files"]
        assert old_db.exists(), "an artifact tagged with another stamp stays"
        assert [a.name for a in book.artifacts(HOST, INC)] == ["old-db"]
        parked = book.retire_artifacts(g, INC, 12, op=MV, event="ev-3", include_retired=True)
        assert [p.name for p in parked] == ["old-db"] and not old_db.exists()
        assert book.record(HOST, INC) == before
        with pytest.raises(StampError):
            book.retire_artifacts(g, INC, 12, op="../x", event="e")


async def test_retire_installation_marks_first_then_parks_everything(tmp_path: Path, book: StampBook) -> None:
    data = tmp_path / "data"
    db, gen, files = make(data / f"{HOST}.db"), make(data / f"{HOST}.gen"), make(data / HOST / "f")
    async with guard(tmp_path, claim(stamp=30)) as g:
        book.init_record(g, SRC)
        book.tag(g, INC, "db", db, 30)
        book.tag(g, INC, "gen", gen, 30)
        book.tag(g, INC, "files", files.parent, 30)
        captured = 30  # a config pass selects its work under stamp 30
    # The second name collides with a file already at the destination: the park stops half-way.
    dest = tmp_path / ".parked" / f"superseded-{MV}" / "ev-final" / HOST
    make(dest / f"{HOST}.gen", "someone else's")
    async with guard(tmp_path, claim(stamp=30)) as g:
        with pytest.raises(StampError, match="never overwritten"):
            book.retire_installation(g, INC, op=MV, event="ev-final")
        # The retired marker was written first: the stale pass is refused already.
        assert book.record(HOST, INC) == StampRecord(HOST, INC, None, (30,))
        assert not book.admit(g, INC, captured)
    (dest / f"{HOST}.gen").unlink()
    async with guard(tmp_path, claim(stamp=30)) as g:
        book.resume_parks(g, INC)
        assert book.artifacts(HOST, INC) == []
        assert not db.exists() and not gen.exists() and not files.parent.exists()
        assert sorted(p.name for p in dest.iterdir()) == sorted([f"{HOST}.db", f"{HOST}.gen", HOST, "manifest.json"])
        assert not book.admit(g, INC, 30)
        # The claim naming the retired installation again does not bring it back.
        assert isinstance(book.init_record(g, SRC), Refuse)
    # A later landing of this incarnation activates its own new stamp.
    landing = claim(stamp=44, exec_=TGT, kind="landing", participants=(TGT, SRC))
    async with guard(tmp_path, landing) as g:
        assert book.init_record(g, TGT) == Activate(44)
        assert book.record(HOST, INC) == StampRecord(HOST, INC, 44, (30,))


async def test_stamp_guard_handle_is_bound_to_its_host(tmp_path: Path, book: StampBook) -> None:
    async with guard(tmp_path, claim(stamp=5)) as g:
        with pytest.raises(RuntimeError, match="not for other.example"):
            g.require("other.example")
        assert book.init_record(g, SRC) == Activate(5)
    with pytest.raises(RuntimeError, match="released"):
        book.init_record(g, SRC)
    unguarded = Guarded(HOST, None)
    assert isinstance(book.init_record(unguarded, SRC), Refuse)
