"""The services' logs: one JSON object a line (issue 11 item 4).

``hostmove serve <service>`` calls :func:`configure_service` first. From then on everything the process writes
goes through one handler on the root logger with :class:`JsonLines` (python-json-logger) as its formatter:

- every ``logging`` call of the project and of its libraries (aiohttp's access log, nats, faststream, botocore);
- Python warnings (``logging.captureWarnings``);
- uncaught exceptions of the main thread, of other threads and "exception ignored" ones (the hooks);
- whatever is still ``print``-ed or written to ``sys.stdout``/``sys.stderr``: each line becomes a record of the
  logger ``hostmove.stdout`` / ``hostmove.stderr``.

A line is ``{"time", "level", "logger", "message", "service", "box"?, "pid", <fields>..., "traceback"?}``:
``time`` is UTC ISO-8601 with milliseconds (``2026-11-30T12:00:00.123Z``), ``<fields>`` are the call site's
``extra=`` (see :mod:`kernel.logctx` for their names), ``traceback`` is the formatted exception as one string.

No secret reaches a line: :class:`Redact` (a filter on the handler) replaces every known secret in the message,
the traceback and every field with ``[redacted]``, and the formatter runs the same redaction over the finished line
(for values that only become text when encoded). The known secrets are the values of the environment's secret
settings (:func:`secrets_from_env`: ``HOSTMOVE_S3_SECRET_KEY``, the entries of ``HOSTMOVE_OPERATOR_TOKENS`` and
``HOSTMOVE_STATUS_TOKENS`` and of their files, ``HOSTMOVE_TOKEN``, any variable named ``*SECRET*``, ``*PASSWORD*``
or ``*_TOKEN(S)``, the variables named in ``HOSTMOVE_LOG_SECRETS``, and the nkey seeds and S3 secrets of the
credentials files ``HOSTMOVE_CREDENTIALS`` and ``HOSTMOVE_CREDENTIALS_DIR`` name), those the service adds
(:func:`add_secret`: the S3 secret of ``stack.json``, its role's credentials), any PEM private key block and any
bearer credential.

Interactive commands keep human lines on the terminal (:func:`configure_terminal`), with the same redaction.
``HOSTMOVE_LOG_LEVEL`` sets the level (default ``INFO`` for a service).
"""

from __future__ import annotations

import io
import json
import logging
import os
import re
import sys
import threading
import traceback
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TextIO

from pythonjsonlogger.core import RESERVED_ATTRS
from pythonjsonlogger.json import JsonFormatter

__all__ = [
    "JsonLines", "Redact", "Redactor", "add_secret", "configure_service", "configure_terminal", "iso_utc",
    "json_line", "secrets_from_env",
]

REDACTED = "[redacted]"
ENV_LEVEL = "HOSTMOVE_LOG_LEVEL"
ENV_SECRETS = "HOSTMOVE_LOG_SECRETS"
SECRET_LISTS = ("HOSTMOVE_OPERATOR_TOKENS", "HOSTMOVE_STATUS_TOKENS")
CREDENTIAL_FILES = ("HOSTMOVE_CREDENTIALS", "HOSTMOVE_CREDENTIALS_DIR")
"""Settings that name credentials files: their secrets (nkey seeds, S3 secrets) are never logged."""
SECRET_NAME = re.compile(r"SECRET|PASSWORD|PASSPHRASE|PRIVATE_KEY|(^|_)TOKENS?$")
MIN_SECRET = 6  # a shorter value would redact ordinary words; no real secret is that short
# Library loggers that say too much at INFO for a service's log (each request to S3, credential discovery).
QUIET = {"botocore": logging.WARNING, "aiobotocore": logging.WARNING, "boto3": logging.WARNING,
         "s3transfer": logging.WARNING, "urllib3": logging.WARNING, "asyncio": logging.WARNING}
_PATTERNS = (
    re.compile(r"-----BEGIN [A-Z0-9 ]*PRIVATE KEY-----.*?(-----END [A-Z0-9 ]*PRIVATE KEY-----|$)", re.S),
    re.compile(r"(?<=Bearer )[^\s\"',;]+"),
)
_STANDARD = frozenset(RESERVED_ATTRS) | {"taskName", "color_message"}


def iso_utc(created: float) -> str:
    """A record's time as UTC ISO-8601 with milliseconds: ``2026-11-30T12:00:00.123Z``."""
    return datetime.fromtimestamp(created, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _split_entries(text: str) -> list[str]:
    out = []
    for entry in re.split(r"[,\n]", text):
        entry = entry.split("#", 1)[0].strip()
        if entry:
            out += [entry, entry.rsplit("=", 1)[-1].strip()]
    return out


def secrets_from_env(environ: Mapping[str, str] | None = None) -> list[str]:
    """The secret values of the environment (see the module's doc); never a path (``*_FILE`` is read instead)."""
    env = os.environ if environ is None else environ
    found: list[str] = []
    named = {n.strip() for n in env.get(ENV_SECRETS, "").split(",") if n.strip()}
    for name, value in env.items():
        if not value:
            continue
        if name in SECRET_LISTS:
            found += _split_entries(value)
        elif name.endswith("_FILE") and name[: -len("_FILE")] in SECRET_LISTS:
            try:
                with open(value, encoding="utf-8") as fh:
                    found += _split_entries(fh.read())
            except OSError:
                pass
        elif name in named or name == "HOSTMOVE_TOKEN" or (not name.endswith("_FILE") and SECRET_NAME.search(name)):
            found.append(value)
        elif name in CREDENTIAL_FILES:  # a role's credentials file, or a directory of them (issue 14)
            found += _credential_secrets(Path(value))
    return found


def _credential_secrets(path: Path) -> list[str]:
    """The nkey seeds and S3 secrets of a credentials file (:mod:`kernel.credentials`) or of every ``*.json`` of a
    directory of them; what cannot be read is skipped (its loader says why, elsewhere)."""
    from kernel.credentials import CredentialsError, load_credentials

    out: list[str] = []
    for f in sorted(path.glob("*.json")) if path.is_dir() else [path]:
        try:
            out += load_credentials(f).secrets()
        except (CredentialsError, OSError):
            continue
    return out


class Redactor:
    """Replaces every known secret (and PEM private keys, bearer credentials) in text with ``[redacted]``."""

    def __init__(self, secrets: Iterable[str] = ()) -> None:
        self._secrets: set[str] = set()
        self._lock = threading.Lock()
        self._rx: re.Pattern[str] | None = None
        self.add(*secrets)

    def add(self, *secrets: str) -> None:
        with self._lock:
            for s in secrets:
                s = s.strip() if isinstance(s, str) else ""
                if len(s) >= MIN_SECRET:
                    self._secrets.add(s)
                    escaped = json.dumps(s, ensure_ascii=False)[1:-1]  # its form inside a JSON string
                    if escaped != s:
                        self._secrets.add(escaped)
            alts = sorted(self._secrets, key=len, reverse=True)
            self._rx = re.compile("|".join(map(re.escape, alts))) if alts else None

    def text(self, text: str) -> str:
        rx = self._rx
        if rx is not None:
            text = rx.sub(REDACTED, text)
        for pattern in _PATTERNS:
            text = pattern.sub(REDACTED, text)
        return text

    def value(self, value: Any) -> Any:
        """``value`` with every string in it redacted (dicts, lists and tuples walked); other values as they are
        (the finished line is redacted again)."""
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, dict):
            return {self.value(k): self.value(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [self.value(v) for v in value]
        return value


_REDACTOR = Redactor()


def add_secret(*secrets: str) -> None:
    """Never log these (values the service holds that the environment does not name, e.g. ``stack.json``'s)."""
    _REDACTOR.add(*secrets)


class Redact(logging.Filter):
    """The redaction filter: the record's message (with its arguments), traceback, stack and fields, redacted in
    place. A record that passes it holds no known secret and no live exception."""

    def __init__(self, redactor: Redactor | None = None) -> None:
        super().__init__()
        self.redactor = redactor or _REDACTOR

    def filter(self, record: logging.LogRecord) -> bool:
        r = self.redactor
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - a bad format string still logs, as what it was given
            message = f"{record.msg!r} {record.args!r}"
        record.msg, record.args = r.text(message), None
        if record.exc_info:
            record.exc_text = "".join(traceback.format_exception(*record.exc_info)).rstrip("\n")
            record.exc_info = None
        if record.exc_text:
            record.exc_text = r.text(record.exc_text)
        if record.stack_info:
            record.stack_info = r.text(record.stack_info)
        for key, value in list(record.__dict__.items()):
            if key not in _STANDARD and not key.startswith("_"):
                record.__dict__[key] = r.value(value)
        return True


class JsonLines(JsonFormatter):
    """One JSON object a line: ``time``, ``level``, ``logger``, ``message``, ``service``, ``box``, ``pid``, the
    record's fields, ``traceback``."""

    def __init__(self, *, service: str, box: str = "", redactor: Redactor | None = None, pid: bool = True) -> None:
        static: dict[str, Any] = {"service": service}
        if box:
            static["box"] = box
        if pid:
            static["pid"] = os.getpid()
        super().__init__(
            ["levelname", "name", "message"],
            rename_fields={"levelname": "level", "name": "logger", "exc_info": "traceback", "stack_info": "stack"},
            static_fields=static, json_ensure_ascii=False,
        )
        self.redactor = redactor or _REDACTOR

    def add_fields(self, log_data: dict[str, Any], record: logging.LogRecord, message_dict: dict[str, Any]) -> None:
        log_data["time"] = iso_utc(record.created)
        super().add_fields(log_data, record, message_dict)

    def serialize_log_record(self, log_data: dict[str, Any]) -> str:
        return self.redactor.text(super().serialize_log_record(log_data))


class _LineStream(io.TextIOBase):
    """``sys.stdout``/``sys.stderr`` of a service: every line written becomes a record of ``logger``."""

    def __init__(self, logger: logging.Logger, level: int, under: TextIO) -> None:
        super().__init__()
        self._logger, self._level, self._under = logger, level, under
        self._buf = ""
        self._lock = threading.RLock()
        self._inside = threading.local()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return "utf-8"

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        return self._under.fileno()

    def write(self, s: str) -> int:
        if getattr(self._inside, "on", False):  # the handler itself failing: straight to the file, no loop
            return self._under.write(s)
        with self._lock:
            self._buf += s
            *lines, self._buf = self._buf.split("\n")
        for line in lines:
            self._emit(line)
        return len(s)

    def flush(self) -> None:
        with self._lock:
            rest, self._buf = self._buf, ""
        self._emit(rest)

    def _emit(self, line: str) -> None:
        line = line.rstrip("\r")
        if not line.strip():
            return
        self._inside.on = True
        try:
            self._logger.log(self._level, line)
        finally:
            self._inside.on = False


_installed: dict[str, Any] = {}


def _hooks() -> None:
    crash = logging.getLogger("hostmove.crash")

    def excepthook(kind: type[BaseException], exc: BaseException, tb: Any) -> None:
        crash.critical("uncaught %s: %s", kind.__name__, exc, exc_info=(kind, exc, tb))

    def thread_hook(args: threading.ExceptHookArgs) -> None:
        if args.exc_type is SystemExit:
            return
        name = args.thread.name if args.thread is not None else "?"
        crash.error("uncaught %s in thread %s: %s", args.exc_type.__name__, name, args.exc_value,
                    exc_info=(args.exc_type, args.exc_value, args.exc_traceback))  # type: ignore[arg-type]

    def unraisable_hook(u: Any) -> None:
        what = u.err_msg or "Exception ignored in"
        crash.error("%s: %r", what, u.object,
                    exc_info=(u.exc_type, u.exc_value, u.exc_traceback) if u.exc_value is not None else None)

    sys.excepthook = excepthook
    threading.excepthook = thread_hook
    sys.unraisablehook = unraisable_hook
    logging.captureWarnings(True)  # warnings as py.warnings lines, under the filters in force


def _level(default: int) -> int:
    name = os.environ.get(ENV_LEVEL, "").strip().upper()
    level = logging.getLevelName(name) if name else default
    return level if isinstance(level, int) else default


def configure_service(service: str, *, box: str = "", stream: TextIO | None = None,
                      capture_std: bool = True) -> logging.Handler:
    """Make every line this process writes a JSON object (see the module's doc). Idempotent: a second call
    replaces the first's handler (a service named later, a box learned later)."""
    _REDACTOR.add(*secrets_from_env())
    root = logging.getLogger()
    old = _installed.get("handler")
    if old is not None:
        root.removeHandler(old)
    for h in list(root.handlers):  # basicConfig's, or anyone's: one handler, one format
        root.removeHandler(h)
    out = stream or _installed.get("stream") or sys.stderr
    if capture_std and "stream" not in _installed:
        _installed["stream"] = out
    handler = logging.StreamHandler(out)
    handler.setFormatter(JsonLines(service=service, box=box))
    handler.addFilter(Redact())
    root.addHandler(handler)
    root.setLevel(_level(logging.INFO))
    for name, level in QUIET.items():
        logging.getLogger(name).setLevel(level)
    _installed["handler"] = handler
    if capture_std:
        if not isinstance(sys.stdout, _LineStream):
            sys.stdout = _LineStream(logging.getLogger("hostmove.stdout"), logging.INFO, out)
        if not isinstance(sys.stderr, _LineStream):
            sys.stderr = _LineStream(logging.getLogger("hostmove.stderr"), logging.WARNING, out)
        _hooks()
    return handler


def configure_terminal(verbose: bool) -> None:
    """Interactive commands: human lines on stderr, ``WARNING`` and up (``INFO`` with ``-v``), redacted."""
    _REDACTOR.add(*secrets_from_env())
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    handler.addFilter(Redact())
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(logging.INFO if verbose else logging.WARNING)
    for name, level in QUIET.items():
        logging.getLogger(name).setLevel(level)


def json_line(logger: str, message: str, *, service: str, box: str = "", environ: Mapping[str, str] | None = None,
              level: int = logging.INFO, **fields: Any) -> str:
    """One JSON line as a service would log it, for a line another process writes into a service's log (the
    launcher's start marker), redacted of the secrets of ``environ`` too."""
    record = logging.LogRecord(logger, level, __file__, 0, message, None, None)
    record.__dict__.update(fields)
    redactor = Redactor(secrets_from_env(environ or {}))
    redactor.add(*_REDACTOR._secrets)
    Redact(redactor).filter(record)
    return JsonLines(service=service, box=box, redactor=redactor, pid=False).format(record)
