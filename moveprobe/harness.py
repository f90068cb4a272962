"""Run moveprobe as a real OS process from a test, and clean up after it (worker included).

:func:`start` spawns ``python -m moveprobe`` with stdout and stderr in files, waits (with a deadline,
never a fixed sleep) for its ``listening`` line, and returns a :class:`Running`. :func:`kill_all` kills
the main process and the forked worker's process group and waits until both are gone.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

_PACKAGE_ROOT = Path(__file__).resolve().parent.parent


class HarnessError(AssertionError):
    """moveprobe did not do what the harness waited for; the message carries its stderr."""


@dataclass
class Running:
    proc: subprocess.Popen[bytes]
    stdout: Path
    stderr: Path
    port: int
    pid: int
    worker_pid: int | None
    session: str

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def logs(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.stdout.read_text().splitlines() if line.startswith("{")]


def poll(what: str, check: Callable[[], T | None], *, timeout: float = 15.0, every: float = 0.02) -> T:
    """Call ``check`` until it returns something other than None; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        found = check()
        if found is not None:
            return found
        if time.monotonic() > deadline:
            raise HarnessError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(every)


def spawn(env: Mapping[str, str], log_dir: Path, name: str = "moveprobe") -> tuple[subprocess.Popen[bytes], Path, Path]:
    """Start ``python -m moveprobe`` with ``env`` over this environment (``MOVEPROBE_*`` replaced)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    full = {k: v for k, v in os.environ.items() if not k.startswith("MOVEPROBE_")}
    full.update(env)
    n = len(list(log_dir.glob(f"{name}-*.out")))
    out, err = log_dir / f"{name}-{n}.out", log_dir / f"{name}-{n}.err"
    with out.open("wb") as o, err.open("wb") as e:
        proc = subprocess.Popen(
            [sys.executable, "-m", "moveprobe"],
            env=full,
            stdout=o,
            stderr=e,
            stdin=subprocess.DEVNULL,
            cwd=_PACKAGE_ROOT,
        )
    return proc, out, err


def start(env: Mapping[str, str], log_dir: Path, *, name: str = "moveprobe", timeout: float = 15.0) -> Running:
    """Spawn moveprobe and wait for its ``listening`` line; raise with its stderr if it exits first."""
    proc, out, err = spawn(env, log_dir, name)

    def listening() -> dict[str, Any] | None:
        for line in out.read_text().splitlines():
            if line.startswith("{"):
                event = json.loads(line)
                if event.get("event") == "listening":
                    return dict(event)
        if proc.poll() is not None:
            raise HarnessError(f"moveprobe exited with {proc.returncode} before listening: {err.read_text().strip()}")
        return None

    try:
        event = poll("moveprobe to listen", listening, timeout=timeout)
    except BaseException:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        raise
    return Running(
        proc, out, err, int(event["port"]), int(event["pid"]), event.get("worker_pid"), str(event["session"])
    )


def request(url: str, method: str = "GET", body: Any = None, timeout: float = 10.0) -> tuple[int, Any]:
    """One HTTP request; (status, decoded JSON body) for 2xx and error statuses alike."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"null")


def wait_status(running: Running, path: str, status: int, *, timeout: float = 15.0) -> Any:
    """Poll ``GET path`` until it answers ``status``; its JSON body."""

    def check() -> Any:
        if running.proc.poll() is not None:
            raise HarnessError(f"moveprobe exited with {running.proc.returncode}: {running.stderr.read_text().strip()}")
        try:
            code, body = request(running.url + path, timeout=2.0)
        except OSError:
            return None
        return {"body": body} if code == status else None

    return poll(f"GET {path} to answer {status}", check, timeout=timeout)["body"]


def alive(pid: int) -> bool:
    """True while ``pid`` runs; a zombie (killed, not yet reaped) counts as gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def stop(running: Running, *, timeout: float = 15.0) -> int:
    """SIGTERM the main process and wait for its exit status (the worker keeps running)."""
    if running.proc.poll() is None:
        running.proc.send_signal(signal.SIGTERM)
    try:
        return running.proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        raise HarnessError(f"moveprobe did not stop within {timeout}s of SIGTERM") from None


def kill_worker(pid: int, *, timeout: float = 10.0) -> None:
    """SIGKILL the worker's process group (it leads its own) and the worker itself; wait until it is gone."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    poll(f"worker {pid} to die", lambda: True if not alive(pid) else None, timeout=timeout)


def kill_all(running: Running) -> None:
    """SIGKILL the main process and the worker; wait for both."""
    if running.proc.poll() is None:
        running.proc.kill()
    running.proc.wait()
    if running.worker_pid is not None:
        kill_worker(running.worker_pid)
