"""``moveprobe`` as the instance of the embedded default: one home for what the demo, ``bench/move`` and the
end-to-end tests all need (a free loopback port, an acknowledged write, the target's probe apps).

The target's probe apps are real processes moved out of the source box's agent leaf once spawned: the
embedded default runs both boxes' agents in one OS process, and a child left in the source's ``@agent``
leaf would be a stray there (§5.3 step 2).
"""

from __future__ import annotations

import json
import socket
import sys
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from moveprobe.config import probe_env
from services.target.probe import ProbeApp, ProcessApp


def free_port() -> int:
    """A loopback port free at the moment of asking."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def post_write(port: int, value: str, *, timeout_s: float = 5.0) -> int:
    """One acknowledged write through moveprobe's API; answers its ``seq``."""
    req = urllib.request.Request(f"http://127.0.0.1:{port}/write", data=json.dumps({"value": value}).encode(),
                                 method="POST", headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        return int(json.loads(resp.read())["seq"])


@dataclass
class HomedApp(ProcessApp):
    """A :class:`ProcessApp` whose process is moved into ``home`` (a cgroup directory) once spawned."""

    home: Path | None = None

    async def start(self) -> bool:
        ok = await super().start()
        if ok and self.proc is not None and self.home is not None:
            (self.home / "cgroup.procs").write_text(f"{self.proc.pid}\n")
        return ok


@dataclass
class ProbeApps:
    """The target box's probe factory: a moveprobe per attempt, all kept so they can be stopped at the end."""

    home: Path
    acks: Path
    region: str = "uk"
    apps: list[ProcessApp] = field(default_factory=list)
    ports: dict[str, int] = field(default_factory=dict)

    async def factory(self, host: str, attempt: int, db_path: Path) -> ProbeApp:
        port = free_port()
        app = HomedApp(argv=[sys.executable, "-m", "moveprobe"], port=port, ready_path="/ready",
                       env=probe_env(data_dir=db_path.parent, host=host, region=self.region,
                                     ack_log=self.acks / f"{host}.{self.region}.jsonl", port=port, interval_s=3600,
                                     worker=False),
                       request_timeout_s=0.5, home=self.home)
        self.apps.append(app)
        self.ports[host] = app.port
        return app

    async def stop_all(self) -> None:
        for app in self.apps:
            await app.stop()
