"""What an instance may hold and reach (issue 14 item 4): none of the platform's secrets.

- **Its environment** is built from its release only (:func:`instance_env`): the app's own settings over a minimal
  base (``PATH``, ``LANG``, ``HOME``); never the agent's environment, so no ``HOSTMOVE_*`` setting, no S3 or NATS
  credential and no token digest. Whatever a caller passes, a platform variable is dropped (:data:`PLATFORM`).
- **Its user.** An agent running as root starts every instance as the unprivileged system user ``hostmove-app``
  (:func:`ensure_instance_user`, created with ``useradd`` on first use), placed in its cgroup leaf first and only
  then dropping to that user (:func:`drop_argv`, the strict-spawn shim runs it as the app's ``argv``).
- **Its files** (:func:`hand_over`): the box's data directory and the instance's database, its WAL and SHM, its
  ``.env`` and its files directory belong to that user, directories 0700 and files 0600; the box's directory and
  everything above it are only searchable (``o+x``, never listed) so the data directory can be reached, and the
  box's key files stay root's, 0600, outside it.

Stated limit: one instance user for every instance of the box, so an instance's process can read another
instance's database (the flat layout of spec §6.1 keeps every ``<host>.db`` in one directory, which SQLite must be
able to write to). Per-instance users need a directory per instance; what is kept from every instance now is the
platform's: its environment, its keys, its logs and its state.
"""

from __future__ import annotations

import logging
import os
import pwd
import stat
import subprocess
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("hostmove.sandbox")

INSTANCE_USER = "hostmove-app"
BASE_PATH = "/usr/local/bin:/usr/bin:/bin"
PLATFORM = ("HOSTMOVE_", "AWS_", "NATS_", "CARLOS_SECRETS", "S3_")
"""Prefixes of the platform's variables: never in an instance's environment, whoever built it."""

_DROP = ("import os,sys;u,g=int(sys.argv[1]),int(sys.argv[2]);os.setgroups([]);os.setresgid(g,g,g);"
         "os.setresuid(u,u,u);os.execv(sys.argv[3],sys.argv[3:])")


class SandboxError(OSError):
    """The instance user cannot be had, or its files cannot be handed to it: nothing is started."""


@dataclass(frozen=True)
class InstanceUser:
    name: str
    uid: int
    gid: int


def ensure_instance_user(name: str = INSTANCE_USER) -> InstanceUser | None:
    """The instance user, created as a system user (no home, no login) if missing. ``None`` when this process is
    not root: it cannot start anything as another user (the instance then runs as the agent's own user)."""
    if os.geteuid() != 0:
        return None
    for attempt in range(2):
        try:
            entry = pwd.getpwnam(name)
            return InstanceUser(name, entry.pw_uid, entry.pw_gid)
        except KeyError:
            if attempt:
                break
        done = subprocess.run(["useradd", "--system", "--user-group", "--no-create-home", "--home-dir",
                               "/nonexistent", "--shell", "/usr/sbin/nologin", name],
                              capture_output=True, text=True, check=False)
        if done.returncode not in (0, 9):  # 9: created meanwhile by another agent
            raise SandboxError(f"the instance user {name} could not be created: {done.stderr.strip()}")
    raise SandboxError(f"the instance user {name} does not exist after useradd")


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


def hand_over(user: InstanceUser | None, data_dir: Path, host: str, *, writable: Iterable[Path] = ()) -> None:
    """Before a spawn as ``user``: its data directory, the instance's database files, ``.env`` and files directory
    (recursively) become the user's (directories 0700, files 0600 where they were more open), the way to them
    searchable; each of ``writable`` (a directory outside the instance the app writes, such as the sample app's
    acknowledgement log) is created and handed over too. Nothing happens without a user."""
    if user is None:
        return
    try:
        data_dir.mkdir(parents=True, exist_ok=True)
        searchable(data_dir.parent)
        _own(data_dir, user, 0o700)
        db = data_dir / f"{host}.db"
        for path in (db, Path(f"{db}-wal"), Path(f"{db}-shm"), Path(f"{db}-journal"), data_dir / f"{host}.env"):
            if os.path.lexists(path):
                _own(path, user, 0o600)
        files = data_dir / host
        if files.is_dir() and not files.is_symlink():
            _own(files, user, 0o700)
            for root, dirs, names in os.walk(files):
                for n in [*dirs, *names]:
                    os.chown(Path(root) / n, user.uid, user.gid, follow_symlinks=False)
        hand_over_dirs(user, writable)
    except OSError as exc:
        raise SandboxError(f"the files of {host} could not be handed to the instance user {user.name}: {exc}") from None


def hand_over_dirs(user: InstanceUser | None, dirs: Iterable[Path]) -> None:
    """Directories outside every instance that its app writes (the box's side directory, where the sample app logs
    its acknowledged writes): created, the instance user's (0700), the way to them searchable."""
    if user is None:
        return
    for d in dirs:
        d.mkdir(parents=True, exist_ok=True)
        searchable(d.parent)
        _own(d, user, 0o700)


__all__ = ["INSTANCE_USER", "PLATFORM", "InstanceUser", "SandboxError", "drop_argv", "ensure_instance_user",
           "hand_over", "hand_over_dirs", "instance_env", "searchable"]
