"""The services' logs are JSON lines (issue 11 item 4): the formatter, the redaction, a service process's every
line (prints, warnings, uncaught exceptions included), and every line of every service log of the demo."""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import re
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from hostmove.logs import JsonLines, Redact, Redactor, json_line, secrets_from_env
from kernel.logctx import ctx

ISO_UTC = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")
S3_SECRET = "s3-secret-Zq81xVbnP0"
OPERATOR_TOKEN = "operator-token-7f3e9b1c"
OPERATOR_DIGEST = hashlib.sha256(OPERATOR_TOKEN.encode()).hexdigest()
PEM = "-----BEGIN PRIVATE KEY-----\nMIGHAgEAMBMGByqGSM49AgEGCCqGSM49\nAwEHBG0wawIBAQQg\n-----END PRIVATE KEY-----"
ENV = {"HOSTMOVE_S3_SECRET_KEY": S3_SECRET, "HOSTMOVE_OPERATOR_TOKENS": f"ops={OPERATOR_DIGEST}",
       "HOSTMOVE_TOKEN": OPERATOR_TOKEN, "HOSTMOVE_S3_ACCESS_KEY": "access-key-id", "HOSTMOVE_BUCKET": "deploy"}


@pytest.fixture
def captured() -> Iterator[tuple[logging.Logger, io.StringIO]]:
    """A logger whose lines go through the service handler's formatter and filter into a buffer."""
    buf = io.StringIO()
    handler = logging.StreamHandler(buf)
    redactor = Redactor(secrets_from_env(ENV))
    handler.setFormatter(JsonLines(service="door", box="ie-1", redactor=redactor))
    handler.addFilter(Redact(redactor))
    logger = logging.getLogger(f"hostmove.test-logs.{id(buf)}")
    logger.propagate, logger.level = False, logging.DEBUG
    logger.addHandler(handler)
    try:
        yield logger, buf
    finally:
        logger.removeHandler(handler)


def lines(buf: io.StringIO) -> list[dict[str, object]]:
    text = buf.getvalue()
    assert text.endswith("\n")
    return [json.loads(line) for line in text.splitlines()]


def test_one_object_a_line_with_the_fields(captured: tuple[logging.Logger, io.StringIO]) -> None:
    logger, buf = captured
    logger.info("park %s of %s acknowledged", "source", "a.example.com",
                extra=ctx(host="a.example.com", op_id="mv-1", box="uk-1", phase="park", reason=None, events=2))
    logger.warning("a line\nwith a newline in it")
    first, second = lines(buf)
    assert list(first)[:4] == ["time", "level", "logger", "message"]
    assert ISO_UTC.match(str(first["time"])), first["time"]
    assert abs(time.time() - time.mktime(time.strptime(str(first["time"])[:19], "%Y-%m-%dT%H:%M:%S"))
               + time.timezone) < 60, "the time is UTC"
    assert first["level"] == "INFO" and first["logger"] == logger.name
    assert first["message"] == "park source of a.example.com acknowledged"
    assert first["service"] == "door" and isinstance(first["pid"], int)
    assert {k: first[k] for k in ("host", "op_id", "box", "phase", "events")} == {
        "host": "a.example.com", "op_id": "mv-1", "box": "uk-1", "phase": "park", "events": 2}
    assert "reason" not in first, "a field that is None is left out"
    assert second["message"] == "a line\nwith a newline in it" and second["box"] == "ie-1"


def test_a_traceback_is_one_field(captured: tuple[logging.Logger, io.StringIO]) -> None:
    logger, buf = captured
    try:
        {}["missing"]  # noqa: B018
    except KeyError:
        logger.exception("door POST /v1/moves failed", extra=ctx(host="a.example.com"))
    (line,) = lines(buf)
    assert line["level"] == "ERROR" and line["message"] == "door POST /v1/moves failed"
    tb = str(line["traceback"])
    assert tb.startswith("Traceback (most recent call last):") and tb.rstrip().endswith("KeyError: 'missing'")
    assert "test_a_traceback_is_one_field" in tb and "exc_info" not in line


def test_ctx_refuses_a_record_attribute() -> None:
    with pytest.raises(ValueError, match="message"):
        ctx(host="h", message="x")


def test_secrets_are_redacted_from_the_message_and_every_field(captured: tuple[logging.Logger, io.StringIO]) -> None:
    logger, buf = captured

    class Holder:
        def __str__(self) -> str:
            return f"holder of {S3_SECRET}"

    logger.info("settings: secret %s, token %s", S3_SECRET, OPERATOR_TOKEN,
                extra={"cfg": {"key": S3_SECRET, "list": [OPERATOR_DIGEST]}, "obj": Holder(), "pem": PEM,
                       "auth": f"Bearer {OPERATOR_TOKEN}x"})
    logger.info("a header: Authorization: Bearer abcdef123456 and the key\n%s", PEM)
    try:
        raise RuntimeError(f"the store refused {S3_SECRET}")
    except RuntimeError:
        logger.exception("failed with %s", OPERATOR_DIGEST)
    text = buf.getvalue()
    for secret in (S3_SECRET, OPERATOR_TOKEN, OPERATOR_DIGEST, "abcdef123456", "MIGHAgEAMBMGByqGSM49", "AwEHBG0w"):
        assert secret not in text, secret
    first, second, third = lines(buf)
    assert first["message"] == "settings: secret [redacted], token [redacted]"
    assert first["cfg"] == {"key": "[redacted]", "list": ["[redacted]"]} and first["obj"] == "holder of [redacted]"
    assert first["pem"] == "[redacted]" and first["auth"] == "Bearer [redacted]"
    assert second["message"] == "a header: Authorization: Bearer [redacted] and the key\n[redacted]"
    assert "RuntimeError: the store refused [redacted]" in str(third["traceback"])


def test_secrets_from_env_names_the_secret_settings(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text(f"# operators\nops2={'b' * 64}\n{'c' * 64}\n")
    found = set(secrets_from_env({**ENV, "HOSTMOVE_OPERATOR_TOKENS_FILE": str(tokens),
                                  "AWS_SECRET_ACCESS_KEY": "aws-secret-1", "HOSTMOVE_LOG_SECRETS": "MY_THING",
                                  "MY_THING": "my-thing-value", "HOSTMOVE_STATUS_TOKENS_FILE": "/nonexistent"}))
    assert {S3_SECRET, OPERATOR_DIGEST, OPERATOR_TOKEN, "b" * 64, "c" * 64, "aws-secret-1",
            "my-thing-value"} <= found
    assert "deploy" not in found and "access-key-id" not in found and str(tokens) not in found


def test_the_launchers_start_marker_is_a_json_line() -> None:
    line = json.loads(json_line("hostmove.procs", "--- start 1", service="box", box="ie-1",
                                environ={"HOSTMOVE_S3_SECRET_KEY": S3_SECRET}, start=1, env={"X": S3_SECRET}))
    assert line["service"] == "box" and line["box"] == "ie-1" and line["env"] == {"X": "[redacted]"}
    assert ISO_UTC.match(str(line["time"]))


SERVICE_SCRIPT = textwrap.dedent("""
    import logging, sys, threading, warnings
    from hostmove.logs import add_secret, configure_service
    configure_service("relay")
    add_secret("held-secret-value")
    print("door: operator API on http://127.0.0.1:1/ with held-secret-value")
    print("two\\nlines", flush=True)
    sys.stderr.write("a partial ")
    sys.stderr.write("line on stderr\\n")
    warnings.warn("this is deprecated", DeprecationWarning, stacklevel=1)
    logging.getLogger("aiohttp.access").info('127.0.0.1 "GET / HTTP/1.1" 200', extra={"remote_address": "127.0.0.1"})
    logging.getLogger("nats.aio.client").error("nats: connection closed")
    t = threading.Thread(target=lambda: 1 / 0, name="worker")
    t.start(); t.join()
    sys.stdout.write("no newline at the end")
    raise ValueError("the service fell over with " + sys.argv[1])
""")


def test_a_service_process_writes_nothing_but_json_lines(tmp_path: Path) -> None:
    """Everything a configured process writes, by logging, print, sys.stderr, a warning, a thread's and the main
    thread's uncaught exceptions, is one JSON object a line; the secrets of its environment never appear."""
    script = tmp_path / "svc.py"
    script.write_text(SERVICE_SCRIPT)
    env = {**os.environ, **ENV, "PYTHONWARNINGS": "always"}
    out = subprocess.run([sys.executable, str(script), S3_SECRET], env=env, capture_output=True, text=True,
                         timeout=60, cwd=Path(__file__).resolve().parents[1])
    assert out.returncode == 1
    assert out.stdout == "", "a service writes its lines to one stream"
    assert S3_SECRET not in out.stderr and "held-secret-value" not in out.stderr
    records = [json.loads(line) for line in out.stderr.splitlines()]
    by = {(r["logger"], r["message"]): r for r in records}
    assert ("hostmove.stdout", "door: operator API on http://127.0.0.1:1/ with [redacted]") in by
    assert ("hostmove.stdout", "two") in by and ("hostmove.stdout", "lines") in by
    assert by[("hostmove.stderr", "a partial line on stderr")]["level"] == "WARNING"
    assert any(r["logger"] == "py.warnings" and "this is deprecated" in str(r["message"]) for r in records)
    assert by[("aiohttp.access", '127.0.0.1 "GET / HTTP/1.1" 200')]["remote_address"] == "127.0.0.1"
    assert ("nats.aio.client", "nats: connection closed") in by
    thread = next(r for r in records if str(r["message"]).startswith("uncaught ZeroDivisionError in thread worker"))
    assert "ZeroDivisionError" in str(thread["traceback"])
    assert ("hostmove.stdout", "no newline at the end") in by
    crash = next(r for r in records if r["level"] == "CRITICAL")
    assert crash["level"] == "CRITICAL" and crash["logger"] == "hostmove.crash"
    assert crash["message"] == "uncaught ValueError: the service fell over with [redacted]"
    assert str(crash["traceback"]).startswith("Traceback") and crash["service"] == "relay"
    assert all(ISO_UTC.match(str(r["time"])) for r in records)


def _parse_log(path: Path) -> list[dict[str, object]]:
    records = []
    for n, line in enumerate(path.read_text(errors="strict").splitlines(), 1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise AssertionError(f"{path.name}:{n} is not JSON ({exc}): {line[:300]!r}") from None
        assert isinstance(record, dict), f"{path.name}:{n} is not one object: {line[:300]!r}"
        assert ISO_UTC.match(str(record.get("time"))), f"{path.name}:{n} has no UTC ISO time: {line[:300]!r}"
        assert {"level", "logger", "message", "service"} <= set(record), f"{path.name}:{n}: {line[:300]!r}"
        records.append(record)
    return records


@pytest.mark.timeout(420)
def test_every_line_of_every_service_log_of_the_demo_is_json(tmp_path: Path) -> None:
    """``hostmove demo`` on a fresh root (its own stack; the door, the recovery pass and two box agents as
    processes, a real move), then ``serve relay`` and ``serve projections`` on the same stack: every line of every
    hostmove service log under ``<root>/logs/`` parses as one JSON object with the fields, and the stack's S3
    secret appears in none. ``nats.log`` and ``weed.log`` (and ``logs/weed/``) are nats-server's and SeaweedFS's
    own logs, not ours: they are not read."""
    import msgspec

    from hostmove.probe_apps import free_port
    from hostmove.procs import ServiceProc, service_env
    from hostmove.runtime import DEFAULT_BUCKET
    from hostmove.stack import stack_down
    from hostmove.stackinfo import StackInfo

    root = tmp_path / "demo"
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOSTMOVE_")}
    try:
        demo = subprocess.run([sys.executable, "-m", "hostmove.cli", "--root", str(root), "demo"], env=env,
                              capture_output=True, text=True, timeout=300, cwd=Path(__file__).resolve().parents[1])
        cannot = "the move could not run here" in demo.stdout
        # what is tested is the logs of a demo that ran its services (whatever its checks found)
        assert "services up:" in demo.stdout or cannot, demo.stdout[-3000:] + demo.stderr[-3000:]
        info = msgspec.json.decode((root / "stack.json").read_bytes(), type=StackInfo)
        logs = root / "logs"
        senv = service_env(info, root=root, bucket=DEFAULT_BUCKET)
        more = [ServiceProc.serve("relay", senv, logs / "relay.log"),
                ServiceProc.serve("projections", senv, logs / "projections.log", "--port", str(free_port()))]
        for proc in more:
            proc.start()
        deadline = time.monotonic() + 60
        while not all("relay: settling" in p.output() or "read API on" in p.output() for p in more):
            assert time.monotonic() < deadline and all(p.alive() for p in more), [p.output()[-2000:] for p in more]
            time.sleep(0.2)
        assert [p.stop() for p in more] == [0, 0]
    finally:
        stack_down(root)
    ours = sorted(p for p in logs.glob("*.log") if p.name not in ("nats.log", "weed.log"))
    names = {p.name for p in ours}
    assert {"door.log", "recovery.log", "relay.log", "projections.log"} <= names
    assert cannot or {"box-ie-1.log", "box-uk-1.log"} <= names, names
    records = {p.name: _parse_log(p) for p in ours}
    for path in ours:
        assert info.s3_secret_key not in path.read_text(), f"the S3 secret is in {path.name}"
    messages = {name: [str(r["message"]) for r in rs] for name, rs in records.items()}
    assert any(m.startswith("door: operator API on") for m in messages["door.log"])
    assert any(r["logger"] == "aiohttp.access" for r in records["door.log"]), "the access log is JSON too"
    assert any(m.startswith("projections: read API on") for m in messages["projections.log"])
    assert all(r["service"] == "projections" for r in records["projections.log"])
    if not cannot:
        banner = next(r for r in records["box-ie-1.log"] if "agent running" in str(r["message"]))
        assert banner["box"] == "ie-1" and banner["service"] == "box"
        moved = [r for name in ("door.log", "box-ie-1.log", "box-uk-1.log") for r in records[name] if "op_id" in r]
        assert moved and all(r.get("host") for r in moved), "a move's lines name its host and op id as fields"
