"""moveprobe's process: boot, the forked worker, the background loop and the HTTP surface (spec §14.4).

Boot order: read the configuration; open the instance and verify its key (or write it at first boot,
:mod:`moveprobe.instance`); fork the worker (:mod:`moveprobe.worker`); when failing readiness here
*after* writing, commit one row; then listen. SIGTERM or SIGINT stops cleanly: in-flight requests
finish, the loop stops, the WAL is checkpointed into the database file, exit 0. The worker is not
stopped: outliving the main process is its purpose.

Every write (``POST /write``, a background row, a timer delivery) is committed first and then
appended, fsynced, to the ack log (:mod:`moveprobe.acks`); only then does the app answer. All of
it runs on the event loop's one thread, so the ack log is in commit order.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import sys
from collections.abc import Mapping
from typing import Any

import msgspec
from aiohttp import web

from kernel.ports import Clock, SystemRandom, WallClock
from moveprobe.acks import AckLog, RowAck, TickAck, TimerAck, canonical_value
from moveprobe.config import Config, ConfigError, load_config
from moveprobe.instance import Instance, KeyRefused, TimerRun, boot
from moveprobe.worker import fork_worker

EXIT_CONFIG = 2
EXIT_KEY = 3
EXIT_START = 1


def readiness(cfg: Config, *, initialized: bool, secret_present: bool, loop_error: str | None) -> str | None:
    """None when ready, else why not, in plain words (spec §14.4's fail switch first)."""
    if cfg.failing_here:
        if cfg.fail_ready_when == "before-write":
            return (
                f"failing readiness on purpose: MOVEPROBE_FAIL_READY_IN names this region ({cfg.region}), "
                "before writing; this boot has written nothing"
            )
        return (
            f"failing readiness on purpose: MOVEPROBE_FAIL_READY_IN names this region ({cfg.region}), "
            "after writing; this boot committed a row before it first answered"
        )
    if cfg.held_here:
        return f"readiness held: {cfg.hold_ready_file} exists (MOVEPROBE_HOLD_READY_FILE) in {cfg.region}"
    if not initialized:
        return "the instance has no database yet"
    if not secret_present:
        return f"the secret {cfg.secret_var} is not set in the environment"
    if loop_error is not None:
        return f"the background loop cannot write: {loop_error}"
    return None


class Probe:
    """The running app: one instance, its ack log, the worker's pid and the loop's health."""

    def __init__(
        self, cfg: Config, inst: Instance, acks: AckLog, *, clock: Clock, worker_pid: int | None, secret_present: bool
    ) -> None:
        self.cfg = cfg
        self.inst = inst
        self.acks = acks
        self.clock = clock
        self.worker_pid = worker_pid
        self.secret_present = secret_present
        self.loop_error: str | None = None
        self.ticks = 0

    # --- writes (each commits, then appends its ack, then returns) -------------------------------

    def tick(self) -> int:
        seq, ts = self.inst.insert_row("tick", None)
        self.acks.append(TickAck(self.cfg.host, seq, None, self.inst.session, ts))
        self.ticks += 1
        return seq

    def write(self, value: Any) -> int:
        seq, ts = self.inst.insert_row("write", canonical_value(value))
        try:
            self.acks.append(RowAck(self.cfg.host, seq, value, self.inst.session, ts))
        except OSError as exc:
            raise AckFailed(f"the write committed as seq {seq} but its ack could not be logged: {exc}") from exc
        return seq

    def timer(self, name: str, due_at_ms: int | None, delivery: str | None) -> TimerRun:
        """Apply a delivery (once per delivery id) and log its ack; a repeat acknowledges the run it already has."""
        done = self.inst.record_timer(name, due_at_ms, delivery)
        try:
            self.acks.append(TimerAck(self.cfg.host, name, done.run, due_at_ms, delivery, done.session, done.ts_ms))
        except OSError as exc:
            raise AckFailed(f"the delivery committed as run {done.run} but its ack could not be logged: {exc}") from exc
        return done

    def not_ready(self) -> str | None:
        return readiness(
            self.cfg,
            initialized=self.inst.initialized,
            secret_present=self.secret_present,
            loop_error=self.loop_error,
        )

    def write_refusal(self) -> str | None:
        if not self.cfg.writes_allowed:
            return (
                f"this boot writes nothing: MOVEPROBE_FAIL_READY_IN names this region ({self.cfg.region}) "
                "with before-write"
            )
        if not self.inst.initialized:
            return "the instance has no database yet"
        return None

    async def background(self, stop: asyncio.Event) -> None:
        """Commit one sequenced row every ``interval_s`` (0 disables the loop)."""
        if self.cfg.interval_s <= 0 or not self.cfg.writes_allowed:
            return
        while not stop.is_set():
            try:
                self.tick()
            except Exception as exc:  # the loop reports through readiness and keeps trying
                if self.loop_error is None:
                    log(self.cfg, self.inst.session, "loop_failed", error=str(exc))
                self.loop_error = str(exc)
            else:
                self.loop_error = None
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), self.cfg.interval_s)


class AckFailed(Exception):
    """A commit whose ack could not be logged: the client is told it is not acknowledged."""


class _WriteBody(msgspec.Struct, frozen=True):
    value: Any


class _TimerBody(msgspec.Struct, frozen=True):
    due_at_ms: int | None = None
    delivery: str | None = None


def _json(data: Mapping[str, Any], status: int = 200) -> web.Response:
    return web.Response(body=msgspec.json.encode(data), status=status, content_type="application/json")


def make_app(probe: Probe) -> web.Application:
    """The HTTP surface: ``/ready``, ``/status``, ``/rows``, ``/write``, ``/timers/...``."""
    cfg, inst = probe.cfg, probe.inst

    async def ready(_: web.Request) -> web.Response:
        reason = probe.not_ready()
        if reason is None:
            return _json({"ready": True, "host": cfg.host, "region": cfg.region, "session": inst.session})
        return _json({"ready": False, "reason": reason}, 503)

    async def status(_: web.Request) -> web.Response:
        counts = inst.counts()
        return _json(
            {
                "host": cfg.host,
                "region": cfg.region,
                "session": inst.session,
                "pid": os.getpid(),
                "worker_pid": probe.worker_pid,
                "initialized": inst.initialized,
                "writes_allowed": cfg.writes_allowed,
                "not_ready": probe.not_ready(),
                "secret_present": probe.secret_present,
                "ticks": probe.ticks,
                "rows": counts.rows,
                "max_seq": counts.max_seq,
                "timer_runs": counts.timer_runs,
            }
        )

    async def rows(_: web.Request) -> web.Response:
        counts = inst.counts()
        return _json({"count": counts.rows, "max_seq": counts.max_seq})

    async def write(request: web.Request) -> web.Response:
        refusal = probe.write_refusal()
        if refusal is not None:
            return _json({"error": refusal}, 503)
        try:
            body = msgspec.json.decode(await request.read(), type=_WriteBody)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            return _json({"error": f'the body must be a JSON object {{"value": ...}}: {exc}'}, 400)
        try:
            seq = probe.write(body.value)
        except AckFailed as exc:
            return _json({"error": str(exc)}, 500)
        return _json({"seq": seq, "session": inst.session})

    async def timer(request: web.Request) -> web.Response:
        name = request.match_info["name"]
        declared = inst.declared()
        if declared is None:
            return _json({"error": "the instance has no database yet, so no timer is declared"}, 503)
        if name not in declared.names():
            known = ", ".join(declared.names())
            return _json({"error": f"no timer named {name!r} is declared (declared: {known})"}, 404)
        refusal = probe.write_refusal()
        if refusal is not None:
            return _json({"error": refusal}, 503)
        raw = await request.read()
        try:
            body = msgspec.json.decode(raw, type=_TimerBody) if raw.strip() else _TimerBody()
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            return _json({"error": f'the body must be empty or {{"due_at_ms": int, "delivery": str}}: {exc}'}, 400)
        try:
            done = probe.timer(name, body.due_at_ms, body.delivery)
        except AckFailed as exc:
            return _json({"error": str(exc)}, 500)
        return _json({"run": done.run, "repeat": done.repeat, "name": name, "due_at_ms": body.due_at_ms,
                      "runs": inst.runs_of(name, body.due_at_ms)})

    async def timers_declared(_: web.Request) -> web.Response:
        declared = inst.declared()
        if declared is None:
            return _json({"error": "the instance has no database yet, so no timer is declared"}, 503)
        return web.Response(body=msgspec.json.encode(declared), content_type="application/json")

    async def timer_runs(_: web.Request) -> web.Response:
        return _json({"runs": inst.timer_runs(), "repeats": inst.timer_repeats()})

    app = web.Application()
    app.router.add_get("/ready", ready)
    app.router.add_get("/status", status)
    app.router.add_get("/rows", rows)
    app.router.add_post("/write", write)
    app.router.add_get("/timers/declared", timers_declared)
    app.router.add_get("/timers/runs", timer_runs)
    app.router.add_post("/timers/{name}", timer)
    return app


def log(cfg: Config, session: str, event: str, **fields: Any) -> None:
    """One JSON line on stdout; never a key, a secret or an environment value."""
    line = {"event": event, "ts_ms": WallClock().now_ms(), "host": cfg.host, "region": cfg.region, "session": session}
    line.update(fields)
    sys.stdout.buffer.write(msgspec.json.encode(line) + b"\n")
    sys.stdout.flush()


async def serve(probe: Probe) -> int:
    """Listen until SIGTERM or SIGINT, then stop cleanly."""
    cfg = probe.cfg
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((cfg.bind, cfg.port))
    except OSError as exc:
        sock.close()
        print(f"moveprobe: cannot listen on {cfg.bind}:{cfg.port}: {exc}", file=sys.stderr, flush=True)
        return EXIT_START
    runner = web.AppRunner(make_app(probe), access_log=None, handle_signals=False)
    await runner.setup()
    await web.SockSite(runner, sock).start()
    port = sock.getsockname()[1]
    task = asyncio.create_task(probe.background(stop))
    log(
        cfg,
        probe.inst.session,
        "listening",
        port=port,
        pid=os.getpid(),
        worker_pid=probe.worker_pid,
        initialized=probe.inst.initialized,
        writes_allowed=cfg.writes_allowed,
    )
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
        stop.set()
        await task
    return 0


def main(environ: Mapping[str, str] | None = None) -> int:
    """Run moveprobe from the ``MOVEPROBE_*`` environment; the exit status says how it ended."""
    env = os.environ if environ is None else environ
    try:
        cfg = load_config(env)
    except ConfigError as exc:
        print(f"moveprobe: {exc}", file=sys.stderr, flush=True)
        return EXIT_CONFIG
    clock, rng = WallClock(), SystemRandom()
    session = cfg.session or rng.token_bytes(8).hex()
    try:
        inst = boot(cfg, clock=clock, rng=rng, session=session, pid=os.getpid())
    except KeyRefused as exc:
        print(f"moveprobe: refusing to start {cfg.host}: {exc}", file=sys.stderr, flush=True)
        return EXIT_KEY
    acks = AckLog(cfg.ack_log)
    secret_present = bool(env.get(cfg.secret_var)) if cfg.secret_var else True
    sys.stdout.flush()
    worker_pid = fork_worker(cfg, clock=clock) if cfg.worker else None
    probe = Probe(cfg, inst, acks, clock=clock, worker_pid=worker_pid, secret_present=secret_present)
    try:
        if cfg.failing_here and cfg.fail_ready_when == "after-write":
            seq = probe.tick()
            log(cfg, session, "wrote_before_failing_readiness", seq=seq)
        code = asyncio.run(serve(probe))
    finally:
        inst.close()
        acks.close()
    log(cfg, session, "stopped", code=code)
    return code
