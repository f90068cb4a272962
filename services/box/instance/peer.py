"""Who answered: the process holding an instance's listening socket, and whether it is in the host's cgroup leaf
(spec §7.3 S1: "answers 200 to 399 **from its own process**", codex 14; issue 18 item 5).

S1 probes the readiness path on the instance's port. A port is only a number: a process outside the instance (a
stray left by an earlier run, anything else on the box) can hold it once the instance is gone, and a readiness
answer from it proves nothing about the instance. So an answer is accepted only when the processes holding the
port's listening socket are the host's own: every holder is a member of the host's cgroup leaf, and there is at
least one. :func:`listener_inodes` reads ``/proc/net/tcp`` and ``tcp6`` (the LISTEN sockets of a port),
:func:`socket_holders` finds the processes holding those inodes (``/proc/<pid>/fd``), :func:`judge` is the pure
verdict.

Only a process this one may inspect is seen (root sees every process): a holder it cannot see is not counted, so an
unseen stranger leaves no member holding the socket, and the answer is still refused.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

LISTEN = "0A"


def parse_listeners(text: str, port: int) -> set[int]:
    """The inodes of the LISTEN sockets on ``port`` in a ``/proc/net/tcp`` or ``tcp6`` table. Pure."""
    out = set()
    for line in text.splitlines()[1:]:
        parts = line.split()
        if len(parts) < 10 or parts[3] != LISTEN:
            continue
        _addr, _, hexport = parts[1].rpartition(":")
        try:
            if int(hexport, 16) == port:
                out.add(int(parts[9]))
        except ValueError:
            continue
    return out


def listener_inodes(port: int, proc: Path = Path("/proc")) -> set[int]:
    inodes: set[int] = set()
    for table in ("net/tcp", "net/tcp6"):
        try:
            inodes |= parse_listeners((proc / table).read_text(), port)
        except OSError:
            continue
    return inodes


def socket_holders(inodes: Iterable[int], proc: Path = Path("/proc")) -> dict[int, str]:
    """Each process holding one of the socket ``inodes``, with its command name."""
    wanted = {f"socket:[{i}]" for i in inodes}
    found: dict[int, str] = {}
    if not wanted:
        return found
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fds = os.listdir(entry / "fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(entry / "fd" / fd)
            except OSError:
                continue
            if target in wanted:
                try:
                    name = (entry / "comm").read_text().strip()
                except OSError:
                    name = "?"
                found[int(entry.name)] = name
                break
    return found


def judge(host: str, port: int, holders: dict[int, str], members: Iterable[int]) -> tuple[bool, str]:
    """S1's verdict on who holds the port (module doc). Pure."""
    leaf = set(members)
    strangers = {pid: name for pid, name in holders.items() if pid not in leaf}
    if strangers:
        named = ", ".join(f"{pid} ({name})" for pid, name in sorted(strangers.items()))
        return False, (f"the answer on port {port} came from process {named}, outside {host}'s cgroup leaf, not from "
                       "the instance")
    if not holders:
        return False, f"no process of {host}'s cgroup leaf holds port {port}, so the answer is not the instance's"
    return True, ""


def answered_by_leaf(host: str, port: int, members: Iterable[int], proc: Path = Path("/proc")) -> tuple[bool, str]:
    """Whether the processes holding ``port``'s listening socket are all of ``host``'s leaf (``members``)."""
    return judge(host, port, socket_holders(listener_inodes(port, proc), proc), members)


__all__ = ["answered_by_leaf", "judge", "listener_inodes", "parse_listeners", "socket_holders"]
