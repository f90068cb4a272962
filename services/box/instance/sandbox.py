"""What an instance may hold and reach (issue 14 item 4): none of the platform's secrets, nor another instance's.

- **Its environment** is built from its release only (:func:`instance_env`): the app's own settings over a minimal
  base (``PATH``, ``LANG``, ``HOME``); never the agent's environment, so no ``HOSTMOVE_*`` setting, no S3 or NATS
  credential and no token digest. Whatever a caller passes, a platform variable is dropped (:data:`PLATFORM`).
- **Its user.** An agent running as root starts each instance as a user of its own: a uid of a reserved range
  (:data:`UID_BASE`, :data:`UID_SPAN`: systemd's unused ``0x70000000`` block; no ``/etc/passwd`` entry, no login, a
  group of the same number), allocated idempotently per host by the box (:class:`InstanceUsers`, the table
  ``<box>/instance-users.json``, root's, 0600) and released when the host leaves the box. The first choice is a
  digest of the host's name, so a host keeps its uid across the boxes of one machine; a box never gives one uid to
  two of its hosts. The process is placed in its cgroup leaf first and only then drops to that user
  (:func:`drop_argv`, the strict-spawn shim runs it as the app's ``argv``).
- **Its directory** (:func:`instance_dir`, :func:`hand_over`): every file of the instance (spec §6.1's flat
  names: ``<host>.db`` with its WAL and SHM, ``.gen``, ``<host>.env``, the files directory ``<host>/``) lives in
  ``<data>/instances/<host>/``, owned by its user, 0700, so SQLite creates its WAL and SHM there and no other
  instance can read, write or list any of it. The data directory and ``instances/`` are root's and only
  searchable (0711); the box's directory, its logs and its key files stay root's, 0700 and 0600. The agent (root)
  reads and writes every instance's directory for replication, restore and the landing.

Stated limits: the box's side directory (``{side_dir}``, where the sample app logs its acknowledged writes) is shared
by the box's instances: sticky and not listable (1733), so an instance writes and reads only the files it made, and
could create a file under another host's name before that host does. An instance's own protocol markers (``.gen``,
the replicator's journals beside its database) sit in its directory, so an instance can damage its own
replication and no other's. A Unix socket an app makes in its directory is its own; the loopback TCP port the box
routes to (``{port}``) is reachable by every process of the machine, as any loopback port is.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import pwd
import stat
import sys
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from kernel.fsutil import atomic_write

log = logging.getLogger("hostmove.sandbox")

INSTANCES_DIR = "instances"
UID_BASE = 0x70000000
UID_SPAN = 1 << 27
"""The reserved uids: ``0x70000000`` to ``0x77ffffff``, in the block systemd leaves unused (0x70000000 to
0x7ffdffff)."""
USERS_FILE = "instance-users.json"
BASE_PATH = "/usr/local/bin:/usr/bin:/bin"
PLATFORM = ("HOSTMOVE_", "AWS_", "NATS_", "CARLOS_SECRETS", "S3_")
"""Prefixes of the platform's variables: never in an instance's environment, whoever built it."""

_DROP = ("import os,sys;u,g=int(sys.argv[1]),int(sys.argv[2]);os.setgroups([]);os.setresgid(g,g,g);"
         "os.setresuid(u,u,u);os.execv(sys.argv[3],sys.argv[3:])")


class SandboxError(OSError):
    """An instance's user cannot be had, or its files cannot be handed to it: nothing is started."""


@dataclass(frozen=True)
class InstanceUser:
    name: str
    uid: int
    gid: int


def instance_dir(data_dir: Path, host: str) -> Path:
    """``<data>/instances/<host>/``: the directory of every file of ``host``'s instance (its user's, 0700)."""
    return data_dir / INSTANCES_DIR / host


def first_uid(host: str) -> int:
    """The uid a box tries first for ``host`` (pure): a digest of its name in the reserved range."""
    return UID_BASE + int.from_bytes(hashlib.sha256(host.encode()).digest()[:8], "big") % UID_SPAN


def choose_uid(host: str, taken: Mapping[str, int], in_use: Iterable[int] = ()) -> int:
    """``host``'s uid (pure): the one the table gives it, else the first free one from :func:`first_uid` on, past
    every uid of another host of the box and every uid the machine names (``in_use``)."""
    if host in taken:
        return taken[host]
    busy = {*taken.values(), *in_use}
    uid = first_uid(host)
    while uid in busy:
        uid = UID_BASE + (uid - UID_BASE + 1) % UID_SPAN
    return uid


class InstanceUsers:
    """A box's instance users: one uid per host, allocated idempotently, kept in ``<box>/instance-users.json``
    (root's, 0600) under a lock, released when the host leaves the box (:meth:`release`)."""

    def __init__(self, box_dir: Path) -> None:
        self.path = box_dir / USERS_FILE
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def _locked(self) -> Iterator[dict[str, int]]:
        with self._lock, open(self.path.with_name(f".{USERS_FILE}.lock"), "a+b") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield self._read()
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def _read(self) -> dict[str, int]:
        try:
            doc = json.loads(self.path.read_bytes())
        except FileNotFoundError:
            return {}
        except ValueError as exc:
            raise SandboxError(f"the box's instance users {self.path} cannot be read ({exc}); nothing is started "
                               "until it is repaired") from None
        if not isinstance(doc, dict) or not all(isinstance(k, str) and type(v) is int for k, v in doc.items()):
            raise SandboxError(f"the box's instance users {self.path} is not a table of hosts and uids; nothing is "
                               "started until it is repaired")
        return doc

    def _write(self, table: Mapping[str, int]) -> None:
        atomic_write(self.path, json.dumps(dict(sorted(table.items())), indent=1).encode(), mode=0o600)

    def user(self, host: str) -> InstanceUser:
        """``host``'s user on this box, allocated on first need."""
        try:
            with self._locked() as table:
                if host not in table:
                    uid = choose_uid(host, table, (e.pw_uid for e in pwd.getpwall()))
                    table[host] = uid
                    self._write(table)
                uid = table[host]
        except OSError as exc:
            raise SandboxError(f"no user could be allocated for {host} ({exc})") from None
        return InstanceUser(f"uid {uid}", uid, uid)

    def release(self, host: str, instance: Path) -> None:
        """``host`` left the box (its files were parked out of every instance's reach first): what is left of its
        directory goes back to root (0700) and its uid may go to another host. Nothing without a table."""
        if not self.path.exists():
            return
        with self._locked() as table:
            if os.path.isdir(instance) and not os.path.islink(instance):
                for root, dirs, names in os.walk(instance):
                    for n in [*dirs, *names]:
                        os.chown(Path(root) / n, 0, 0, follow_symlinks=False)
                os.chown(instance, 0, 0)
                os.chmod(instance, 0o700)
            if table.pop(host, None) is not None:
                self._write(table)


def user_for(tree: object, host: str) -> InstanceUser | None:
    """The user ``host`` runs as under ``tree`` (a box agent's :class:`~.proctree.CgroupTree` as root), or None."""
    users = getattr(tree, "instance_users", None)
    return users.user(host) if isinstance(users, InstanceUsers) else None


def instance_env(release: Mapping[str, str], *, home: Path | str) -> dict[str, str]:
    """An instance's whole environment: a minimal base under the release's own settings, platform variables
    dropped."""
    env = {"PATH": BASE_PATH, "LANG": "C.UTF-8", "HOME": str(home), **release}
    return {k: v for k, v in env.items() if not k.startswith(PLATFORM)}


def drop_argv(user: InstanceUser | None, argv: Sequence[str]) -> list[str]:
    """``argv`` run as ``user``: a small exec wrapper that drops every group and id, then execs the app in the same
    process (so the cgroup placement, made before, stays the app's). Unchanged without a user. The way to the
    wrapper's interpreter and to the app's program is made searchable (an interpreter under ``/root``, 0700, was
    out of the instance user's reach)."""
    if user is None:
        return list(argv)
    for program in (sys.executable, argv[0]):
        searchable(Path(os.path.realpath(program)).parent)
    return [sys.executable, "-I", "-S", "-c", _DROP, str(user.uid), str(user.gid), *argv]


def _own(path: Path, user: InstanceUser, mode: int) -> None:
    os.chown(path, user.uid, user.gid, follow_symlinks=False)
    if not path.is_symlink():
        os.chmod(path, mode)


def searchable(path: Path) -> None:
    """Every directory from ``/`` down to ``path`` searchable by others (``o+x``; never readable): the instance
    user reaches its own directory by name and lists nothing on the way."""
    for d in [*reversed(path.parents), path]:
        mode = d.stat().st_mode
        if not mode & stat.S_IXOTH:
            os.chmod(d, stat.S_IMODE(mode) | stat.S_IXOTH)


def _root_only_searchable(path: Path) -> None:
    path.mkdir(parents=True, exist_ok=True)
    os.chown(path, 0, 0, follow_symlinks=False)
    os.chmod(path, 0o711)


def hand_over(user: InstanceUser | None, instance: Path, host: str) -> None:
    """Before a spawn as ``user``: ``instance`` (:func:`instance_dir`) and everything in it become the user's
    (directories 0700, the database files and ``.env`` 0600 where they were more open); the data directory and
    ``instances/`` above it are root's and only searchable (0711), the way to them searchable. Nothing happens
    without a user."""
    if user is None:
        return
    try:
        instance.mkdir(parents=True, exist_ok=True)
        if instance.parent.name == INSTANCES_DIR:
            _root_only_searchable(instance.parent.parent)
            _root_only_searchable(instance.parent)
        searchable(instance.parent)
        _own(instance, user, 0o700)
        db = instance / f"{host}.db"
        for path in (db, Path(f"{db}-wal"), Path(f"{db}-shm"), Path(f"{db}-journal"), instance / f"{host}.env"):
            if os.path.lexists(path):
                _own(path, user, 0o600)
        for root, dirs, names in os.walk(instance):
            for n in [*dirs, *names]:
                os.chown(Path(root) / n, user.uid, user.gid, follow_symlinks=False)
        files = instance / host
        if files.is_dir() and not files.is_symlink():
            _own(files, user, 0o700)
    except OSError as exc:
        raise SandboxError(f"the files of {host} could not be handed to its instance user ({user.name}): "
                           f"{exc}") from None


def shared_dirs(dirs: Iterable[Path]) -> None:
    """Directories outside every instance that its apps write (the box's side directory, where the sample app logs
    its acknowledged writes), for an agent that starts instances as their own users: created, root's, sticky and
    not listable (1733: each instance writes and reads only the files it made), the way to them searchable."""
    for d in dirs:
        d.mkdir(parents=True, exist_ok=True)
        searchable(d.parent)
        os.chown(d, 0, 0, follow_symlinks=False)
        os.chmod(d, 0o1733)


__all__ = ["INSTANCES_DIR", "PLATFORM", "UID_BASE", "UID_SPAN", "InstanceUser", "InstanceUsers",
           "SandboxError", "choose_uid", "drop_argv", "first_uid", "hand_over",
           "shared_dirs", "instance_dir", "instance_env", "searchable", "user_for"]
