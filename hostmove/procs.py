"""Services as OS processes (``hostmove serve <name>``), for the demo and the tests (ARCHITECTURE §2).

Each service runs in its own process group with its output in a log file; ``stop`` sends SIGTERM and waits (the
service stops what it runs and exits 0), a crash is a SIGKILL from outside or from a failpoint
(:mod:`kernel.failpoints`). The environment names the stack explicitly (``HOSTMOVE_NATS_URL`` and the S3
settings), so a service never guesses where the authority is.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from hostmove.access import credentials_dir, provision_deployment
from hostmove.logs import json_line
from hostmove.stackinfo import StackInfo
from kernel.credentials import ENV_CREDENTIALS_DIR


def service_env(stack: StackInfo, *, root: Path, bucket: str, extra: Mapping[str, str] | None = None,
                base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a service on ``stack``: this process's, without any other ``HOSTMOVE_*`` setting.

    No key is in it: each service takes its own role's credentials file from ``HOSTMOVE_CREDENTIALS_DIR``
    (``<root>/credentials/``, issue 14 items 1 and 3), which this provisions on the embedded stack for the
    deployment of ``bucket`` (:func:`hostmove.access.provision_deployment`: the console, the projections, the router
    and every box set up under ``root``)."""
    env = {k: v for k, v in (os.environ if base is None else base).items() if not k.startswith("HOSTMOVE_")}
    merged = {**env, **(extra or {})}
    if stack.mode == "local" and stack.root:
        provision_deployment(stack, root, deployment_bucket=bucket,
                             data_prefix=merged.get("HOSTMOVE_DATA_BUCKET_PREFIX") or None)
        keys = {ENV_CREDENTIALS_DIR: str(credentials_dir(root))}
    else:  # a stack this process did not start (containers): its one key, as before
        keys = {"HOSTMOVE_S3_ACCESS_KEY": stack.s3_access_key, "HOSTMOVE_S3_SECRET_KEY": stack.s3_secret_key}
    env.update({
        "HOSTMOVE_NATS_URL": stack.nats_url, "HOSTMOVE_S3_ENDPOINT": stack.s3_endpoint, **keys,
        "HOSTMOVE_S3_REGION": stack.s3_region, "HOSTMOVE_BUCKET": bucket, "HOSTMOVE_ROOT": str(root),
        "HOSTMOVE_STREAM_REPLICAS": str(stack.stream_replicas),
    })
    env.update(extra or {})
    return env


@dataclass
class ServiceProc:
    """One ``hostmove serve <argv>`` process; its output goes to ``log``."""

    argv: list[str]
    env: dict[str, str]
    log: Path
    proc: subprocess.Popen[bytes] | None = None
    starts: int = 0
    history: list[int | None] = field(default_factory=list)

    @classmethod
    def serve(cls, service: str, env: dict[str, str], log: Path, *args: str) -> ServiceProc:
        return cls(["-v", "serve", service, *args], env, log)

    def start(self, extra: Mapping[str, str] | None = None) -> None:
        assert self.proc is None or self.proc.poll() is not None, "already running"
        self.starts += 1
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("ab") as out:
            after = self.argv[self.argv.index("serve") + 1:] if "serve" in self.argv else [""]
            box = after[after.index("--label") + 1] if "--label" in after[:-1] else ""
            marker = json_line("hostmove.procs", f"--- start {self.starts} of hostmove {' '.join(self.argv)}",
                               service=after[0], box=box, environ={**self.env, **(extra or {})}, start=self.starts,
                               env=dict(sorted((extra or {}).items())))
            out.write(f"{marker}\n".encode())
            self.proc = subprocess.Popen([sys.executable, "-m", "hostmove.cli", *self.argv],
                                         env={**self.env, **(extra or {})}, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """SIGTERM and wait: a graceful stop. A service that does not stop in time is killed."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        rc = self.proc.returncode
        self.history.append(rc)
        return rc

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


__all__ = ["ServiceProc", "service_env"]
