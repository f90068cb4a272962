"""moveprobe: the sample app a move must carry whole (spec §14.4, the rehearsal app).

Shaped like the production app that lost its key (spec §1.2 finding 2a): a SQLite database, a files
directory with an ``instance.key`` written at first boot and verified at every boot, a background loop
writing sequenced rows, an HTTP write endpoint that acknowledges only after commit, a declared
schedule and a once-timer, a forked worker that outlives the main process, and a switch that fails
readiness in a named region, before or after writing. Every acknowledged write is also appended to a
log outside the instance, so a test can check that a move lost none (:func:`moveprobe.acks.missing_from_db`).

Run it with ``python -m moveprobe``. Configuration, all from the environment:

- ``MOVEPROBE_DATA_DIR`` (required): holds ``<host>.db`` and the files directory ``<host>/`` (spec §6.1
  F1, F4), which holds ``instance.key`` and ``timers.json``.
- ``MOVEPROBE_HOST`` (required): the instance's name; a plain file name.
- ``MOVEPROBE_REGION``: the region this process runs in (compared with the fail switch); default "".
- ``MOVEPROBE_ACK_LOG`` (required): the ack log; must lie outside ``MOVEPROBE_DATA_DIR``.
- ``MOVEPROBE_PORT``: TCP port, default 0 (a free one; the ``listening`` log line names it).
- ``MOVEPROBE_BIND``: address, default ``127.0.0.1``.
- ``MOVEPROBE_INTERVAL_S``: seconds between background rows, default 0.5; 0 disables the loop.
- ``MOVEPROBE_FAIL_READY_IN``: a region, or several separated by commas; when one equals ``MOVEPROBE_REGION``,
  ``GET /ready`` answers 503.
- ``MOVEPROBE_FAIL_READY_SWITCH``: a file; when set, the fail switch is on only for a boot that starts while the
  file exists (an instance booted before keeps answering; a rehearsal "fixes the cause" by removing it, without a new
  release).
- ``MOVEPROBE_FAIL_READY_WHEN``: ``before-write`` (default: the boot writes nothing at all to the
  instance, and ``/write`` and timer deliveries answer 503) or ``after-write`` (the boot commits one
  row before it listens, then writes as usual; only readiness fails).
- ``MOVEPROBE_HOLD_READY_FILE`` and ``MOVEPROBE_HOLD_READY_IN`` (a region, or several separated by commas): in a
  named region, ``GET /ready`` answers 503 while the file exists (checked at every request: a slow readiness).
- ``MOVEPROBE_WORKER``: 1 (default) forks the worker at every boot; 0 does not.
- ``MOVEPROBE_WORKER_FILE``: the worker's heartbeat side file, default
  ``<ack log dir>/<host>.worker.jsonl``; never inside the instance.
- ``MOVEPROBE_WORKER_INTERVAL_S``: seconds between heartbeats, default 0.5.
- ``MOVEPROBE_WORKER_HOLDS_DB``: 1 makes the worker hold ``<host>.db`` open (stop evidence step 3); default 0.
- ``MOVEPROBE_SCHEDULE_EVERY_S``: the declared schedule ``periodic``'s period, default 60.
- ``MOVEPROBE_ONCE_AFTER_S``: the once-timer ``once`` is due this long after first boot, default 60.
- ``MOVEPROBE_SESSION``: the writer session recorded on every row; default a random one per boot.
- ``MOVEPROBE_SECRET_VAR``: the name of an environment variable that must be set (the sealed secret
  the config delivers); readiness fails while it is empty. Its value is never read out or logged.

HTTP: ``GET /ready`` (200 or 503 with the reason), ``GET /status``, ``GET /rows`` (``count``, ``max_seq``),
``POST /write`` ``{"value": ...}`` (200 ``{"seq", "session"}`` after commit and ack), ``POST /timers/<name>``
(optional body ``{"due_at_ms", "delivery"}``; 404 for an undeclared name; a delivery id already applied is
answered with its first run and ``"repeat": true`` and recorded in ``timer_repeats``: the box's runner delivers at
least once), ``GET /timers/declared``, ``GET /timers/runs`` (``runs`` and ``repeats``).

Exit status: 0 after SIGTERM or SIGINT (WAL checkpointed), 2 bad configuration, 3 the key check
refused to start, 1 could not listen.
"""

from pathlib import Path

from moveprobe.acks import Ack, AckLogError, RowAck, TickAck, TimerAck, missing_from_db, read_acks
from moveprobe.config import Config, ConfigError, load_config, probe_env
from moveprobe.instance import Declared, decide_key, declared_timers
from moveprobe.worker import Heartbeat, read_heartbeats

RELEASE_MANIFEST = Path(__file__).with_name("release.toml")
"""moveprobe's app release manifest (issue 18): published like any app, ``hostmove app publish --name moveprobe``."""

__all__ = [
    "RELEASE_MANIFEST",
    "Ack",
    "AckLogError",
    "Config",
    "ConfigError",
    "Declared",
    "Heartbeat",
    "RowAck",
    "TickAck",
    "TimerAck",
    "decide_key",
    "declared_timers",
    "load_config",
    "missing_from_db",
    "probe_env",
    "read_acks",
    "read_heartbeats",
]
