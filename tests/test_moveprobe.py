"""moveprobe, the rehearsal app (spec §14.4), run as real OS processes over real SQLite files."""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest

from moveprobe import (
    ConfigError,
    Declared,
    RowAck,
    TickAck,
    TimerAck,
    decide_key,
    load_config,
    missing_from_db,
    probe_env,
    read_acks,
    read_heartbeats,
)
from moveprobe.harness import Running, alive, kill_all, poll, request, spawn, start, stop, wait_status
from moveprobe.instance import FinishGenesis, Genesis, Refuse, Verified

HOST = "app.example"


class Probes:
    """Starts moveprobe processes over one data directory and kills every one (and its worker) at teardown."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.data = root / "data"
        self.ack_log = root / "acks" / "acks.jsonl"
        self.running: list[Running] = []

    @property
    def db(self) -> Path:
        return self.data / f"{HOST}.db"

    @property
    def files(self) -> Path:
        return self.data / HOST

    @property
    def heartbeats(self) -> Path:
        return self.ack_log.parent / f"{HOST}.worker.jsonl"

    def env(self, region: str = "ie", **kw: Any) -> dict[str, str]:
        kw.setdefault("interval_s", 0.02)
        kw.setdefault("worker_interval_s", 0.02)
        return probe_env(data_dir=self.data, host=HOST, region=region, ack_log=self.ack_log, **kw)

    def start(self, region: str = "ie", **kw: Any) -> Running:
        running = start(self.env(region, **kw), self.root / "logs")
        self.running.append(running)
        return running

    def refused(self, env: dict[str, str]) -> tuple[int, str]:
        """Run a boot that must not start; (exit status, stderr)."""
        proc, _, err = spawn(env, self.root / "logs", "refused")
        try:
            code = proc.wait(timeout=15)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        return code, err.read_text()

    def cleanup(self) -> None:
        for running in self.running:
            kill_all(running)


@pytest.fixture
def probes(tmp_path: Path) -> Iterator[Probes]:
    p = Probes(tmp_path)
    try:
        yield p
    finally:
        p.cleanup()


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def query(db: Path, sql: str, *args: Any) -> list[tuple[Any, ...]]:
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        return conn.execute(sql, args).fetchall()
    finally:
        conn.close()


# --- pure rules ----------------------------------------------------------------------------------


def test_decide_key_never_mints_over_a_recorded_key(tmp_path: Path) -> None:
    d = dict(files_dir=tmp_path)
    assert decide_key(recorded=None, on_disk=None, pending=None, has_rows=False, **d) == Genesis()
    assert decide_key(recorded=None, on_disk=None, pending="x", has_rows=False, **d) == Genesis()
    assert decide_key(recorded="a", on_disk="a", pending=None, has_rows=True, **d) == Verified()
    assert decide_key(recorded="a", on_disk=None, pending="a", has_rows=False, **d) == FinishGenesis()
    missing = decide_key(recorded="a", on_disk=None, pending="b", has_rows=True, **d)
    assert isinstance(missing, Refuse) and "missing" in missing.reason and "finding 2a" in missing.reason
    changed = decide_key(recorded="a", on_disk="b", pending=None, has_rows=True, **d)
    assert isinstance(changed, Refuse) and "does not match" in changed.reason
    stranger = decide_key(recorded=None, on_disk="b", pending=None, has_rows=False, **d)
    assert isinstance(stranger, Refuse) and "no record" in stranger.reason
    orphan_rows = decide_key(recorded=None, on_disk=None, pending=None, has_rows=True, **d)
    assert isinstance(orphan_rows, Refuse) and "rows" in orphan_rows.reason


def test_config_refuses_what_cannot_run(tmp_path: Path) -> None:
    good = probe_env(data_dir=tmp_path / "d", host=HOST, region="ie", ack_log=tmp_path / "a.jsonl")
    cfg = load_config(good)
    assert cfg.db_path == tmp_path / "d" / f"{HOST}.db" and cfg.key_path == tmp_path / "d" / HOST / "instance.key"
    assert not cfg.failing_here and cfg.writes_allowed
    cases = [
        ("MOVEPROBE_DATA_DIR", "", "not set"),
        ("MOVEPROBE_HOST", "../x", "file name"),
        ("MOVEPROBE_ACK_LOG", str(tmp_path / "d" / "acks.jsonl"), "outside the instance"),
        ("MOVEPROBE_FAIL_READY_WHEN", "sometimes", "before-write or after-write"),
        ("MOVEPROBE_INTERVAL_S", "nan", "finite"),
        ("MOVEPROBE_PORT", "70000", "not a TCP port"),
        ("MOVEPROBE_WORKER_FILE", str(tmp_path / "d" / HOST / "w"), "inside the instance"),
    ]
    for name, value, words in cases:
        with pytest.raises(ConfigError, match=words) as err:
            load_config({**good, name: value})
        assert name in str(err.value), "the message names the variable to fix"
    failing = load_config({**good, "MOVEPROBE_FAIL_READY_IN": "ie"})
    assert failing.failing_here and not failing.writes_allowed
    after = load_config({**good, "MOVEPROBE_FAIL_READY_IN": "ie", "MOVEPROBE_FAIL_READY_WHEN": "after-write"})
    assert after.failing_here and after.writes_allowed
    assert not load_config({**good, "MOVEPROBE_FAIL_READY_IN": "uk"}).failing_here
    assert load_config({**good, "MOVEPROBE_FAIL_READY_IN": "uk, ie"}).failing_here, "a list of regions"
    switch = tmp_path / "switch"
    switched = {**good, "MOVEPROBE_FAIL_READY_IN": "ie", "MOVEPROBE_FAIL_READY_SWITCH": str(switch)}
    booted_before = load_config(switched)
    assert not booted_before.failing_here, "off for a boot while the switch file is absent"
    switch.touch()
    assert load_config(switched).failing_here, "on for a boot while it exists"
    assert not booted_before.failing_here, "an instance booted before the switch keeps answering"


# --- boots and the key ---------------------------------------------------------------------------


def test_first_boot_writes_the_key_and_every_boot_verifies_it(probes: Probes) -> None:
    first = probes.start()
    wait_status(first, "/ready", 200)
    key = probes.files / "instance.key"
    key_bytes = key.read_bytes()
    assert len(key_bytes) == 32
    assert query(probes.db, "SELECT v FROM meta WHERE k = 'key_sha256'") == [(sha256(key),)]
    (genesis_ms,) = query(probes.db, "SELECT v FROM meta WHERE k = 'genesis_ms'")[0]
    on_disk = msgspec.json.decode((probes.files / "timers.json").read_bytes(), type=Declared)
    code, served = request(first.url + "/timers/declared")
    assert code == 200 and msgspec.convert(served, Declared) == on_disk
    assert [s.name for s in on_disk.schedules] == ["periodic"] and on_disk.once[0].name == "once"
    assert on_disk.once[0].due_at_ms == int(genesis_ms) + 60_000
    assert request(first.url + "/write", "POST", {"value": "before"})[0] == 200
    assert stop(first) == 0
    assert not (probes.data / f"{HOST}.db-wal").exists(), "a clean stop checkpoints the WAL into the database"
    assert missing_from_db(probes.db, read_acks(probes.ack_log)) == []
    assert sorted(p.name for p in probes.data.iterdir()) == [HOST, f"{HOST}.db"], "the check left no -wal or -shm"
    timers_bytes = (probes.files / "timers.json").read_bytes()

    second = probes.start()
    wait_status(second, "/ready", 200)
    assert key.read_bytes() == key_bytes, "a second boot must verify the key, never mint another"
    assert (probes.files / "timers.json").read_bytes() == timers_bytes
    code, body = request(second.url + "/write", "POST", {"value": "after"})
    assert code == 200 and body["session"] == second.session != first.session
    assert query(probes.db, "SELECT session FROM boots ORDER BY boot") == [(first.session,), (second.session,)]
    before_seq = query(probes.db, "SELECT seq FROM rows WHERE value = '\"before\"'")[0][0]
    assert body["seq"] > before_seq


def test_a_changed_or_missing_key_refuses_to_start(probes: Probes) -> None:
    first = probes.start()
    wait_status(first, "/ready", 200)
    assert stop(first) == 0
    key = probes.files / "instance.key"
    original = key.read_bytes()
    db_digest = sha256(probes.db)

    key.write_bytes(bytes([original[0] ^ 1]) + original[1:])
    code, err = probes.refused(probes.env())
    assert code == 3 and "does not match the key the database recorded" in err
    assert original.hex() not in err and sha256(probes.db) == db_digest

    key.unlink()
    code, err = probes.refused(probes.env())
    assert code == 3 and "instance.key is missing" in err
    assert not key.exists(), "a boot that finds the key missing must not mint a new one"

    key.write_bytes(original)
    probes.db.rename(probes.root / "elsewhere.db")
    code, err = probes.refused(probes.env())
    assert code == 3 and "no record of it" in err
    assert not probes.db.exists(), "a refused boot creates no database"

    (probes.root / "elsewhere.db").rename(probes.db)
    again = probes.start()
    wait_status(again, "/ready", 200)


def test_a_bad_configuration_exits_2_saying_why(probes: Probes) -> None:
    env = probes.env()
    env["MOVEPROBE_ACK_LOG"] = str(probes.data / "acks.jsonl")
    code, err = probes.refused(env)
    assert code == 2 and "MOVEPROBE_ACK_LOG" in err and "outside" in err
    assert not probes.data.exists()


# --- acknowledged writes -------------------------------------------------------------------------


async def test_every_acknowledged_write_is_in_the_log_and_the_database(probes: Probes) -> None:
    running = probes.start()
    wait_status(running, "/ready", 200)

    async with aiohttp.ClientSession() as http:

        async def write(i: int) -> tuple[int, Any]:
            value = {"i": i, "tag": f"w{i}"}
            async with http.post(running.url + "/write", json={"value": value}) as resp:
                assert resp.status == 200, await resp.text()
                return (await resp.json())["seq"], value

        answered = await asyncio.gather(*(write(i) for i in range(40)))
        async with http.post(running.url + "/write", json={"nope": 1}) as resp:
            assert resp.status == 400 and "value" in (await resp.json())["error"]

    poll("a few background rows", lambda: True if len(read_acks(probes.ack_log)) >= 45 else None)
    running.proc.send_signal(signal.SIGKILL)  # no clean stop: the acks must hold on commit alone
    running.proc.wait()

    acks = read_acks(probes.ack_log, host=HOST)
    writes = {a.seq: a.value for a in acks if isinstance(a, RowAck)}
    assert {seq: value for seq, value in answered} == writes, "every answered write is logged, and nothing else"
    assert any(isinstance(a, TickAck) for a in acks)
    seqs = [a.seq for a in acks if isinstance(a, RowAck | TickAck)]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs), "the log is in commit order"
    assert (probes.data / f"{HOST}.db-wal").exists(), "SIGKILL left the WAL unmerged"
    assert missing_from_db(probes.db, acks) == []
    db_seqs = [s for (s,) in query(probes.db, "SELECT seq FROM rows ORDER BY seq")]
    assert db_seqs == list(range(1, len(db_seqs) + 1)), "no sequenced row is missing"
    assert set(seqs) <= set(db_seqs)

    # The checker catches a lost write, and one overwritten by a later writer.
    last = max(seqs)
    lost = RowAck(HOST, last + 1000, "never written", running.session, 0)
    forged = next(a for a in acks if isinstance(a, RowAck))
    overwritten = RowAck(HOST, forged.seq, forged.value, "another-session", 0)
    assert missing_from_db(probes.db, [*acks, lost, overwritten]) == [lost, overwritten]
    assert missing_from_db(probes.root / "no-such.db", acks) == acks


# --- the readiness switch ------------------------------------------------------------------------


def test_failing_readiness_before_writing_writes_nothing(probes: Probes) -> None:
    home = probes.start("ie", fail_ready_in="uk")
    assert wait_status(home, "/ready", 200)["region"] == "ie", "the switch names another region: ready here"
    assert request(home.url + "/write", "POST", {"value": "home"})[0] == 200
    assert stop(home) == 0
    db_digest, timers = sha256(probes.db), (probes.files / "timers.json").read_bytes()
    acks_before = probes.ack_log.read_bytes()

    away = probes.start("uk", fail_ready_in="uk", fail_ready_when="before-write")
    body = wait_status(away, "/ready", 503)
    assert "uk" in body["reason"] and "before writing" in body["reason"]
    code, body = request(away.url + "/write", "POST", {"value": "refused"})
    assert code == 503 and "writes nothing" in body["error"]
    assert request(away.url + "/timers/once", "POST")[0] == 503
    # Let the background loop's interval pass many times over (the worker beats at the same pace).
    assert away.worker_pid is not None
    poll(
        "20 worker heartbeats",
        lambda: True if len(read_heartbeats(probes.heartbeats, pid=away.worker_pid)) >= 20 else None,
    )
    assert request(away.url + "/status")[1]["ticks"] == 0
    assert stop(away) == 0
    assert sha256(probes.db) == db_digest, "a before-write boot leaves the database byte for byte"
    assert (probes.files / "timers.json").read_bytes() == timers
    assert probes.ack_log.read_bytes() == acks_before
    assert query(probes.db, "SELECT count(*) FROM boots") == [(1,)]


def test_a_first_boot_failing_before_writing_creates_nothing(probes: Probes) -> None:
    running = probes.start("uk", fail_ready_in="uk")
    assert "before writing" in wait_status(running, "/ready", 503)["reason"]
    assert request(running.url + "/timers/declared")[0] == 503
    assert stop(running) == 0
    assert not probes.db.exists() and not probes.files.exists()


def test_failing_readiness_after_writing_has_written_by_the_first_answer(probes: Probes) -> None:
    home = probes.start("ie", fail_ready_in="uk", fail_ready_when="after-write")
    wait_status(home, "/ready", 200)
    assert stop(home) == 0

    away = probes.start("uk", fail_ready_in="uk", fail_ready_when="after-write", interval_s=0)
    code, body = request(away.url + "/ready")  # the very first answer
    assert code == 503 and "after writing" in body["reason"]
    mine = query(probes.db, "SELECT seq, kind FROM rows WHERE session = ?", away.session)
    assert len(mine) == 1 and mine[0][1] == "tick", "exactly the boot's row, committed before it listened"
    code, body = request(away.url + "/write", "POST", {"value": "still writes"})
    assert code == 200 and body["seq"] == mine[0][0] + 1
    assert request(away.url + "/ready")[0] == 503
    acks = read_acks(probes.ack_log)
    assert [a.seq for a in acks if isinstance(a, RowAck | TickAck) and a.session == away.session] == [
        mine[0][0],
        body["seq"],
    ]
    assert missing_from_db(probes.db, acks) == []


def test_readiness_waits_for_the_secret_and_never_shows_it(probes: Probes) -> None:
    env = probes.env(secret_var="PROBE_SECRET")
    without = start(env, probes.root / "logs")
    probes.running.append(without)
    assert "PROBE_SECRET is not set" in wait_status(without, "/ready", 503)["reason"]
    assert stop(without) == 0
    with_secret = start({**env, "PROBE_SECRET": "s3cr3t-value"}, probes.root / "logs")
    probes.running.append(with_secret)
    wait_status(with_secret, "/ready", 200)
    code, status = request(with_secret.url + "/status")
    assert code == 200 and status["secret_present"] is True
    assert stop(with_secret) == 0
    assert "s3cr3t-value" not in with_secret.stdout.read_text() + with_secret.stderr.read_text()


# --- timers --------------------------------------------------------------------------------------


def test_timer_deliveries_are_recorded_once_each(probes: Probes) -> None:
    running = probes.start(interval_s=0)
    wait_status(running, "/ready", 200)
    once = request(running.url + "/timers/once", "POST", {"delivery": "d-1"})
    assert once == (200, {"run": 1, "repeat": False, "name": "once", "due_at_ms": None, "runs": 1})
    assert request(running.url + "/timers/periodic", "POST", {"due_at_ms": 1000})[1]["runs"] == 1
    assert request(running.url + "/timers/periodic", "POST", {"due_at_ms": 2000})[1]["runs"] == 1
    again = request(running.url + "/timers/periodic", "POST", {"due_at_ms": 1000})
    assert again[0] == 200 and again[1]["runs"] == 2, "without a delivery id a second delivery is a second run"
    code, body = request(running.url + "/timers/nightly", "POST")
    assert code == 404 and "periodic, once" in body["error"]
    assert request(running.url + "/timers/once", "POST", {"due_at_ms": "soon"})[0] == 400

    runs = query(probes.db, "SELECT name, due_at_ms, delivery, session FROM timer_runs ORDER BY run")
    s = running.session
    assert runs == [
        ("once", None, "d-1", s),
        ("periodic", 1000, None, s),
        ("periodic", 2000, None, s),
        ("periodic", 1000, None, s),
    ]
    served = request(running.url + "/timers/runs")[1]["runs"]
    assert [(r["name"], r["due_at_ms"]) for r in served] == [(n, d) for n, d, _, _ in runs]
    acks = read_acks(probes.ack_log)
    assert [(a.name, a.run) for a in acks if isinstance(a, TimerAck)] == [
        ("once", 1),
        ("periodic", 2),
        ("periodic", 3),
        ("periodic", 4),
    ]
    assert missing_from_db(probes.db, acks) == []


def test_a_repeated_delivery_id_runs_once(probes: Probes) -> None:
    """The box's runner delivers at least once (a runner killed between the app's answer and its bookkeeping
    delivers the same due time again, with the same delivery id): the app applies it once, answers with the run it
    has, and records the repeat where the §14.4 check can count it."""
    running = probes.start(interval_s=0)
    wait_status(running, "/ready", 200)
    body = {"due_at_ms": 5000, "delivery": "r1:5000"}
    first = request(running.url + "/timers/periodic", "POST", body)
    second = request(running.url + "/timers/periodic", "POST", body)
    assert first[0] == second[0] == 200
    assert first[1]["repeat"] is False and second[1]["repeat"] is True
    assert second[1]["run"] == first[1]["run"] and second[1]["runs"] == 1
    other = request(running.url + "/timers/periodic", "POST", {"due_at_ms": 5400, "delivery": "r1:5400"})
    assert other[1]["repeat"] is False and other[1]["run"] == first[1]["run"] + 1
    served = request(running.url + "/timers/runs")[1]
    assert [(r["name"], r["due_at_ms"]) for r in served["runs"]] == [("periodic", 5000), ("periodic", 5400)]
    assert [(r["run"], r["delivery"]) for r in served["repeats"]] == [(first[1]["run"], "r1:5000")]
    acks = [a for a in read_acks(probes.ack_log) if isinstance(a, TimerAck)]
    assert [a.run for a in acks] == [first[1]["run"], first[1]["run"], other[1]["run"]]
    assert missing_from_db(probes.db, read_acks(probes.ack_log)) == []


# --- the forked worker ---------------------------------------------------------------------------


def test_the_forked_worker_outlives_the_main_process(probes: Probes) -> None:
    running = probes.start(worker_holds_db=True)
    wait_status(running, "/ready", 200)
    worker = running.worker_pid
    assert worker is not None and worker != running.pid
    assert os.getsid(worker) == worker and os.getpgid(worker) == worker, "the worker leads its own session"
    assert os.getpgid(running.pid) != worker
    held = {os.readlink(f"/proc/{worker}/fd/{fd}") for fd in os.listdir(f"/proc/{worker}/fd")}
    assert str(probes.db) in held, "the worker holds the database open, as stop evidence must find"

    running.proc.send_signal(signal.SIGKILL)
    running.proc.wait()
    assert not alive(running.pid)
    beats = len(read_heartbeats(probes.heartbeats, pid=worker))
    poll(
        "the worker to keep beating",
        lambda: True if len(read_heartbeats(probes.heartbeats, pid=worker)) > beats + 3 else None,
    )
    assert alive(worker)

    # A clean stop does not stop its worker either.
    second = probes.start()
    wait_status(second, "/ready", 200)
    assert second.worker_pid not in (None, worker)
    assert stop(second) == 0
    assert second.worker_pid is not None
    after = len(read_heartbeats(probes.heartbeats, pid=second.worker_pid))
    poll(
        "the second worker to keep beating",
        lambda: True if len(read_heartbeats(probes.heartbeats, pid=second.worker_pid)) > after + 3 else None,
    )
    second_beats = read_heartbeats(probes.heartbeats, pid=second.worker_pid)
    assert [b.n for b in second_beats] == list(range(1, len(second_beats) + 1))
    assert {b.host for b in second_beats} == {HOST}
