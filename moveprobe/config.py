"""moveprobe's configuration: read once from the environment, checked, then frozen (spec §14.4).

The variables are documented in :mod:`moveprobe`. :func:`load_config` is pure (environment in,
:class:`Config` or :class:`ConfigError` out); :func:`probe_env` builds the environment a box or a
test passes to the process.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

FailWhen = Literal["before-write", "after-write"]
FAIL_WHEN: tuple[FailWhen, ...] = ("before-write", "after-write")

_HOST = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,252}$")

DEFAULT_INTERVAL_S = 0.5
DEFAULT_WORKER_INTERVAL_S = 0.5
DEFAULT_SCHEDULE_EVERY_S = 60.0
DEFAULT_ONCE_AFTER_S = 60.0


class ConfigError(ValueError):
    """The environment does not describe a runnable instance; the message says which variable and why."""


@dataclass(frozen=True)
class Config:
    data_dir: Path
    host: str
    region: str
    ack_log: Path
    bind: str = "127.0.0.1"
    port: int = 0
    interval_s: float = DEFAULT_INTERVAL_S
    fail_ready_in: str = ""
    fail_ready_when: FailWhen = "before-write"
    fail_ready_switch: Path | None = None
    worker: bool = True
    worker_file: Path | None = None
    worker_interval_s: float = DEFAULT_WORKER_INTERVAL_S
    worker_holds_db: bool = False
    schedule_every_s: float = DEFAULT_SCHEDULE_EVERY_S
    once_after_s: float = DEFAULT_ONCE_AFTER_S
    session: str = ""
    secret_var: str = ""
    hold_ready_in: str = ""
    hold_ready_file: Path | None = None

    @property
    def held_here(self) -> bool:
        """True while the hold file exists and the hold names this region: a slow readiness, live (a test holds a
        landing's probe for as long as it needs, then lets it answer)."""
        return (self.hold_ready_file is not None and self.region in {r.strip() for r in self.hold_ready_in.split(",")}
                and self.hold_ready_file.exists())

    @property
    def db_path(self) -> Path:
        """``<data>/<host>.db``: the flat layout of spec §6.1 F1."""
        return self.data_dir / f"{self.host}.db"

    @property
    def files_dir(self) -> Path:
        """``<data>/<host>/``: the files directory (spec §6.1 F4, the database path without ``.db``)."""
        return self.data_dir / self.host

    @property
    def key_path(self) -> Path:
        return self.files_dir / "instance.key"

    @property
    def timers_path(self) -> Path:
        return self.files_dir / "timers.json"

    @property
    def heartbeat_path(self) -> Path:
        """The forked worker's side file: never the database, never inside the instance."""
        return self.worker_file or self.ack_log.parent / f"{self.host}.worker.jsonl"

    @property
    def failing_here(self) -> bool:
        """True when the fail switch names this process's region (one of a comma-separated list). With a switch file
        the switch is this boot's: on when the file existed as it booted (:func:`load_config`), so an instance that
        booted before the switch was set keeps answering, and every later boot fails until the file is removed."""
        return self.region in {r.strip() for r in self.fail_ready_in.split(",") if r.strip()}

    @property
    def writes_allowed(self) -> bool:
        """False only when failing here before writing: then nothing is written to the instance at all."""
        return not (self.failing_here and self.fail_ready_when == "before-write")


def _float(env: Mapping[str, str], name: str, default: float, *, minimum: float) -> float:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a number of seconds") from None
    if not minimum <= value < float("inf"):
        raise ConfigError(f"{name}={raw!r} must be a finite number of seconds of at least {minimum}")
    return value


def _flag(env: Mapping[str, str], name: str, default: bool) -> bool:
    raw = env.get(name, "").strip().lower()
    if not raw:
        return default
    if raw in ("1", "true", "yes", "on"):
        return True
    if raw in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{name}={raw!r} must be 1 or 0")


def _inside(path: Path, directory: Path) -> bool:
    try:
        path.relative_to(directory)
    except ValueError:
        return False
    return True


def load_config(env: Mapping[str, str]) -> Config:
    """Read and check every ``MOVEPROBE_*`` variable; raise :class:`ConfigError` naming the first bad one."""
    data = env.get("MOVEPROBE_DATA_DIR", "").strip()
    if not data:
        raise ConfigError("MOVEPROBE_DATA_DIR is not set: it names the directory holding <host>.db and <host>/")
    host = env.get("MOVEPROBE_HOST", "").strip()
    if not host:
        raise ConfigError("MOVEPROBE_HOST is not set: it names the instance (its database is <host>.db)")
    if not _HOST.match(host) or host in (".", ".."):
        raise ConfigError(f"MOVEPROBE_HOST={host!r} is not a usable file name (letters, digits, '.', '_', '-')")
    ack = env.get("MOVEPROBE_ACK_LOG", "").strip()
    if not ack:
        raise ConfigError("MOVEPROBE_ACK_LOG is not set: it names the file outside the instance that records acks")
    data_dir = Path(os.path.abspath(data))
    ack_log = Path(os.path.abspath(ack))
    if _inside(ack_log, data_dir):
        raise ConfigError(
            f"MOVEPROBE_ACK_LOG ({ack_log}) is inside MOVEPROBE_DATA_DIR ({data_dir}): the log must live outside "
            "the instance so that it survives whatever happens to the instance"
        )
    port_raw = env.get("MOVEPROBE_PORT", "").strip() or "0"
    if not port_raw.isdigit() or int(port_raw) > 65535:
        raise ConfigError(f"MOVEPROBE_PORT={port_raw!r} is not a TCP port (0 picks a free one)")
    fail_in = env.get("MOVEPROBE_FAIL_READY_IN", "").strip()
    when_raw = env.get("MOVEPROBE_FAIL_READY_WHEN", "").strip() or "before-write"
    when: FailWhen
    if when_raw == "before-write":
        when = "before-write"
    elif when_raw == "after-write":
        when = "after-write"
    else:
        raise ConfigError(f"MOVEPROBE_FAIL_READY_WHEN={when_raw!r} must be before-write or after-write")
    switch_raw = env.get("MOVEPROBE_FAIL_READY_SWITCH", "").strip()
    worker_file_raw = env.get("MOVEPROBE_WORKER_FILE", "").strip()
    worker_file = Path(os.path.abspath(worker_file_raw)) if worker_file_raw else None
    cfg = Config(
        data_dir=data_dir,
        host=host,
        region=env.get("MOVEPROBE_REGION", "").strip(),
        ack_log=ack_log,
        bind=env.get("MOVEPROBE_BIND", "").strip() or "127.0.0.1",
        port=int(port_raw),
        interval_s=_float(env, "MOVEPROBE_INTERVAL_S", DEFAULT_INTERVAL_S, minimum=0.0),
        fail_ready_in="" if switch_raw and not os.path.exists(switch_raw) else fail_in,  # the switch is off: this boot
        fail_ready_when=when,
        fail_ready_switch=Path(os.path.abspath(switch_raw)) if switch_raw else None,
        worker=_flag(env, "MOVEPROBE_WORKER", True),
        worker_file=worker_file,
        worker_interval_s=_float(env, "MOVEPROBE_WORKER_INTERVAL_S", DEFAULT_WORKER_INTERVAL_S, minimum=0.01),
        worker_holds_db=_flag(env, "MOVEPROBE_WORKER_HOLDS_DB", False),
        schedule_every_s=_float(env, "MOVEPROBE_SCHEDULE_EVERY_S", DEFAULT_SCHEDULE_EVERY_S, minimum=0.001),
        once_after_s=_float(env, "MOVEPROBE_ONCE_AFTER_S", DEFAULT_ONCE_AFTER_S, minimum=0.0),
        session=env.get("MOVEPROBE_SESSION", "").strip(),
        secret_var=env.get("MOVEPROBE_SECRET_VAR", "").strip(),
        hold_ready_in=env.get("MOVEPROBE_HOLD_READY_IN", "").strip(),
        hold_ready_file=Path(os.path.abspath(hold_raw)) if (hold_raw := env.get("MOVEPROBE_HOLD_READY_FILE",
                                                                                 "").strip()) else None,
    )
    if worker_file is not None and (_inside(worker_file, cfg.files_dir) or worker_file == cfg.db_path):
        raise ConfigError(
            f"MOVEPROBE_WORKER_FILE ({worker_file}) is inside the instance: the worker writes a side file, "
            "never the instance's own state"
        )
    return cfg


def probe_env(
    *,
    data_dir: Path,
    host: str,
    region: str,
    ack_log: Path,
    port: int = 0,
    interval_s: float | None = None,
    fail_ready_in: str = "",
    fail_ready_when: FailWhen | None = None,
    worker: bool = True,
    worker_file: Path | None = None,
    worker_interval_s: float | None = None,
    worker_holds_db: bool = False,
    schedule_every_s: float | None = None,
    once_after_s: float | None = None,
    session: str = "",
    secret_var: str = "",
) -> dict[str, str]:
    """The ``MOVEPROBE_*`` variables for one process (add them to the rest of its environment)."""
    env = {
        "MOVEPROBE_DATA_DIR": str(data_dir),
        "MOVEPROBE_HOST": host,
        "MOVEPROBE_REGION": region,
        "MOVEPROBE_ACK_LOG": str(ack_log),
        "MOVEPROBE_PORT": str(port),
        "MOVEPROBE_WORKER": "1" if worker else "0",
        "MOVEPROBE_WORKER_HOLDS_DB": "1" if worker_holds_db else "0",
    }
    optional: dict[str, object | None] = {
        "MOVEPROBE_INTERVAL_S": interval_s,
        "MOVEPROBE_FAIL_READY_IN": fail_ready_in or None,
        "MOVEPROBE_FAIL_READY_WHEN": fail_ready_when,
        "MOVEPROBE_WORKER_FILE": worker_file,
        "MOVEPROBE_WORKER_INTERVAL_S": worker_interval_s,
        "MOVEPROBE_SCHEDULE_EVERY_S": schedule_every_s,
        "MOVEPROBE_ONCE_AFTER_S": once_after_s,
        "MOVEPROBE_SESSION": session or None,
        "MOVEPROBE_SECRET_VAR": secret_var or None,
    }
    env.update({k: str(v) for k, v in optional.items() if v is not None})
    return env
