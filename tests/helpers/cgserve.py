"""A probe's test app, run as a real OS process (spec §5.3 strict spawns, §7.7 the probe).

``python cgserve.py PORT OUT``: as its very first act the process copies its own ``/proc/self/cgroup`` to
``OUT/main.cgroup``; it then forks a worker that, as its first act after the fork, copies its ``/proc/self/cgroup``
to ``OUT/worker.cgroup``, starts a new session (so it outlives the main process and its process group), writes
``OUT/worker.pid`` and sleeps. The main process answers ``200`` to every ``GET`` on ``127.0.0.1:PORT``.
"""

from __future__ import annotations

import os
import signal
import sys


def _copy_cgroup(path: str) -> None:
    with open("/proc/self/cgroup") as f:
        text = f.read()
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as out:
        out.write(text)
    os.replace(tmp, path)


def main(port: int, out: str) -> None:
    _copy_cgroup(os.path.join(out, "main.cgroup"))
    if os.fork() == 0:
        _copy_cgroup(os.path.join(out, "worker.cgroup"))
        os.setsid()
        with open(os.path.join(out, "worker.pid.tmp"), "w") as f:
            f.write(str(os.getpid()))
        os.replace(os.path.join(out, "worker.pid.tmp"), os.path.join(out, "worker.pid"))
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)
        while True:
            signal.pause()

    from http.server import BaseHTTPRequestHandler, HTTPServer

    class Ok(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the http.server hook's name
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"ok")

        def log_message(self, *args: object) -> None:
            pass

    HTTPServer(("127.0.0.1", port), Ok).serve_forever()


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
