"""Instances as real OS processes in a cgroup v2 leaf, and the scans stop evidence reads (spec §5.3, §9.3).

The :class:`ProcessTree` port is what the activator and :mod:`services.box.instance.evidence` ask of a box's
processes; :class:`CgroupTree` is the real implementation over the cgroup v2 hierarchy.

- **Layout.** ``<cgroup2>/hostmove/<deployment>/<box>/<host>``: one leaf per host, the agent in
  ``<box>/@agent``, names made safe and reversible by :func:`leaf_name` (``[A-Za-z0-9-]`` kept, any other UTF-8
  byte as ``_XX``). A name never contains a dot, so it cannot collide with a cgroup interface file. The cgroup2
  mount is found in ``/proc/mounts``.
- **Keyed by the deployment** (issue 11 item 5). ``<deployment>`` is the deployment's identity
  (``control/deployment.json`` in its bucket, :func:`services.box.roster.ensure_deployment`), so two deployments
  on one machine that both name a box ``ie-1`` (two checkouts running the demo at once, two test runs) have two
  subtrees. Everything that kills or scans (a drain, the stray scan, the agent's scrub, the fence, adopting
  what a dead agent left) reads only its own deployment's box subtree: :meth:`CgroupTree.strays` refuses to scan
  a group that is not this box's ``@agent`` leaf.
- **Strict spawns only** (§5.3 "Every spawn under a move is strict", joint D3). :meth:`CgroupTree.prepare_strict`
  refuses a populated group; :meth:`CgroupTree.spawn_strict` starts ``/bin/sh`` as a shim that writes its own
  pid into the leaf's ``cgroup.procs``, reports the placement on a pipe and only then ``exec``s the app, so the
  app never runs outside the leaf. A shim that cannot place itself exits 125 without running the app, and the
  spawn raises :class:`StrictRefused`. There is no best-effort path.
- **Kill and drain** (§5.3 step 1, ``KillAndEmpty``): write ``cgroup.kill``, poll ``cgroup.events`` until
  ``populated 0`` within a deadline. :meth:`CgroupTree.reopen_and_drain` is the cleanup-only call
  (``ReopenAndDrain``): it kills and drains an existing group and never creates one, so it grants no spawn right.
- **The spawn journal** (§5.3 "An absent host cgroup is insufficient where an earlier spawn could escape
  containment"): :class:`SpawnJournal` records, durably and before the process exists, every spawn attempt of a
  host in this boot and whether it was strict. A tree given a journal writes it in :meth:`CgroupTree.spawn_strict`;
  :meth:`CgroupTree.spawn_history` reads it back, so stop evidence can tell an absent leaf that proves nothing ran
  outside containment from one that proves nothing. Counts from an earlier boot are void (a reboot ended them).
- **Without cgroup v2** the box says so (:meth:`CgroupTree.strict_available`) and every spawn refuses: strict
  spawns are a precondition of taking part in a move (ARCHITECTURE §6).
- **Scans.** :func:`open_holders` reads ``/proc/*/fd`` (and ``/proc/*/maps``, since SQLite maps the SHM) for
  the database, WAL and SHM (§5.3 step 3); :func:`stray_processes` lists the agent's own leaf (§5.3 step 2).
  A process that vanishes mid-scan or whose entries may not be read is skipped (and counted); an unreadable
  ``/proc`` is reported as an incomplete scan, never read as "no holders".

Callers serialize spawns and stops of one host with the host guard (spec §6.4); this module does not lock.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import select
import shutil
import subprocess
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from bus.subjects import SubjectError, decode_token, encode_token
from kernel.fsutil import atomic_write
from kernel.ports import Clock, WallClock
from services.box.instance.sandbox import PLATFORM, InstanceUsers, drop_argv, user_for

__all__ = [
    "AGENT_LEAF",
    "BOOT_ID",
    "CgroupTree",
    "Drain",
    "Holder",
    "HolderScan",
    "ProcessTree",
    "SpawnHistory",
    "SpawnJournal",
    "Spawned",
    "StrayScan",
    "StrictRefused",
    "current_cgroup_dir",
    "find_cgroup2_root",
    "host_of_leaf",
    "leaf_name",
    "open_holders",
    "process_name",
    "read_boot_id",
    "stray_processes",
]

BASE_DIR = "hostmove"
AGENT_LEAF = "@agent"
"""The agent's own leaf under ``<cgroup2>/hostmove/<deployment>/<box>/`` (``@`` never appears in a leaf name)."""
_MKDIR_ATTEMPTS = 5
SHIM_REFUSED = 125
_MAX_LEAF_BYTES = 240
_LEAF = re.compile(r"^(?:[A-Za-z0-9-]|_[0-9A-F]{2})+$")
_POLL_S = 0.005
_REKILL_S = 0.1
_PLACEMENT_TIMEOUT_S = 10.0
BOOT_ID = Path("/proc/sys/kernel/random/boot_id")

# The shim: place itself, say so on the status pipe (its stdin while it runs), give the app /dev/null as
# stdin, exec the app. It never execs unplaced. (dash takes only one-digit descriptors, hence fd 0.)
_SHIM = r"""
procs=$1; shift
printf '%s\n' "$$" > "$procs" || exit 125
printf 'placed' >&0 || exit 125
exec 0</dev/null
exec "$@"
"""


class StrictRefused(Exception):
    """A strict spawn (or its preparation) was refused; the app was not started. The message says why."""


# ---------------------------------------------------------------------------------------------------------
# Names and discovery


def leaf_name(name: str) -> str:
    """A safe, reversible directory name for a host or box label (``h.example`` -> ``h_2Eexample``):
    the subject-token encoding of :mod:`bus.subjects`, which never produces a dot.

    Names longer than 240 bytes encoded become ``_~<sha256>``: unique but not reversible (a host name is at
    most 253 characters, so only a pathological name gets there).
    """
    if not name:
        raise ValueError("a cgroup leaf needs a non-empty name")
    try:
        token = encode_token(name)
    except SubjectError:
        token = ""
    if not token or len(token) > _MAX_LEAF_BYTES:
        return "_~" + hashlib.sha256(name.encode("utf-8")).hexdigest()
    return token


def host_of_leaf(token: str) -> str | None:
    """The inverse of :func:`leaf_name`; ``None`` for a hashed or foreign name."""
    try:
        return decode_token(token)
    except (SubjectError, UnicodeDecodeError):
        return None


def _unescape_mount(field_text: str) -> str:
    """``/proc/mounts`` writes space, tab, newline and backslash as octal escapes (``\\040``)."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field_text)


def find_cgroup2_root(mounts: str | Path = "/proc/mounts") -> Path | None:
    """The mount point of the cgroup v2 hierarchy (fstype ``cgroup2``), or ``None`` when there is none.

    Works for the unified layout (``/sys/fs/cgroup``) and the hybrid one (``/sys/fs/cgroup/unified``).
    """
    try:
        text = Path(mounts).read_text(encoding="utf-8", errors="surrogateescape")
    except OSError:
        return None
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 3 and parts[2] == "cgroup2":
            return Path(_unescape_mount(parts[1]))
    return None


def current_cgroup_dir(root: Path, pid: int | str = "self") -> Path | None:
    """The cgroup v2 directory of a process (``0::<path>`` in ``/proc/<pid>/cgroup``), or ``None``."""
    try:
        text = Path(f"/proc/{pid}/cgroup").read_text(encoding="utf-8", errors="surrogateescape")
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("0::"):
            rel = line[3:].strip().lstrip("/")
            path = root / rel if rel else root
            return path if path.is_dir() else None
    return None


def process_name(pid: int) -> str:
    """The command name of a process (``/proc/<pid>/comm``), or ``"?"`` when it cannot be read."""
    try:
        return Path(f"/proc/{pid}/comm").read_text(encoding="utf-8", errors="replace").strip() or "?"
    except OSError:
        return "?"


def _read_pids(procs: Path) -> tuple[int, ...]:
    text = procs.read_text(encoding="ascii")
    return tuple(sorted(int(x) for x in text.split()))


def _populated(leaf: Path) -> bool:
    for line in (leaf / "cgroup.events").read_text(encoding="ascii").splitlines():
        key, _, value = line.partition(" ")
        if key == "populated":
            return value.strip() == "1"
    raise OSError(f"{leaf / 'cgroup.events'} has no 'populated' line")


# ---------------------------------------------------------------------------------------------------------
# Observations


@dataclass(frozen=True)
class Drain:
    """What one kill-and-drain saw (§5.3 step 1)."""

    host: str
    leaf: str
    existed: bool
    """The leaf directory existed. An absent leaf means no strict spawn is running: every spawn is strict."""
    pids_before: tuple[int, ...]
    drained: bool
    """``cgroup.events`` said ``populated 0`` before the deadline."""
    waited_ms: int
    remaining: tuple[int, ...] = ()
    error: str = ""


@dataclass(frozen=True)
class Holder:
    """A process that has one of the watched files open (``via="fd"``), mapped (``"map"``) or both (``"fd,map"``)."""

    pid: int
    path: str
    via: str
    name: str = "?"


@dataclass(frozen=True)
class HolderScan:
    """§5.3 step 3. ``complete`` is false when ``/proc`` itself could not be read: never "no holders"."""

    holders: tuple[Holder, ...]
    complete: bool
    scanned: int
    skipped: int
    """Processes whose entries could not be read (permission) and were skipped."""
    error: str = ""


@dataclass(frozen=True)
class StrayScan:
    """§5.3 step 2: processes in the agent's own leaf other than the agent."""

    agent_dir: str
    strays: tuple[int, ...]
    readable: bool
    error: str = ""
    names: tuple[str, ...] = ()


@dataclass
class Spawned:
    """A strictly placed instance process. ``process`` lets the agent reap it; it is never evidence."""

    host: str
    pid: int
    leaf: Path
    process: subprocess.Popen[bytes] = field(repr=False)


@dataclass(frozen=True)
class SpawnHistory:
    """What the box's spawn journal says about one host's spawns in the current boot (§5.3, joint D3).

    ``readable`` is false when the journal is missing, unreadable or the boot cannot be identified: then nothing is
    known, never "no spawn". ``strict`` and ``loose`` count the spawn attempts of this boot (``loose``: placed
    best-effort or not at all, so its processes may run outside the host's group).
    """

    host: str
    readable: bool
    boot_id: str = ""
    strict: int = 0
    loose: int = 0
    detail: str = ""

    @property
    def attempted(self) -> bool:
        return self.strict + self.loose > 0


# ---------------------------------------------------------------------------------------------------------
# The spawn journal


def read_boot_id(path: str | Path = BOOT_ID) -> str:
    """This boot's identity (the kernel's random ``boot_id``); raises ``OSError`` when it cannot be read."""
    text = Path(path).read_text(encoding="ascii").strip()
    if not text:
        raise OSError(f"{path} is empty")
    return text


class SpawnJournal:
    """A box's durable record of spawn attempts per host (§5.3 "An absent host cgroup is insufficient where an
    earlier spawn could escape containment").

    One file per host, ``<dir>/<leaf_name(host)>.json``: ``{"host", "boot_id", "strict", "loose", "last_at_ms"}``,
    replaced atomically and fsynced **before** the spawn it records starts, so a crash can only overstate what ran.
    A record of an earlier boot counts for nothing (every process of that boot ended with it). Callers serialize
    spawns of one host with the host guard (§6.4); the journal holds no memory, so a restarted agent reads the same.
    """

    def __init__(self, directory: str | Path, *, clock: Clock | None = None, boot_id: str | Path = BOOT_ID) -> None:
        """Open (creating) the journal directory: from then on the absence of a host's record means no spawn."""
        self.dir = Path(directory)
        self.clock: Clock = clock or WallClock()
        self._boot_path = Path(boot_id)
        self.dir.mkdir(parents=True, exist_ok=True)

    def path(self, host: str) -> Path:
        return self.dir / f"{leaf_name(host)}.json"

    def _read(self, host: str) -> tuple[str, int, int] | None:
        """``(boot_id, strict, loose)`` of the host's record, ``None`` without one; ``ValueError`` when malformed."""
        path = self.path(host)
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return None
        doc = json.loads(raw)
        if not isinstance(doc, dict) or doc.get("host") != host:
            raise ValueError(f"{path} is not this host's spawn record")
        boot, strict, loose = doc.get("boot_id"), doc.get("strict"), doc.get("loose")
        if not isinstance(boot, str) or not boot:
            raise ValueError(f"{path} has no boot_id")
        for name, value in (("strict", strict), ("loose", loose)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{path} has no valid {name!r} count")
        assert isinstance(strict, int) and isinstance(loose, int)
        return boot, strict, loose

    def history(self, host: str) -> SpawnHistory:
        """The host's spawns in the current boot, from the journal alone. Never raises: an unreadable journal or
        boot identity is ``readable=False`` with the reason."""
        try:
            boot = read_boot_id(self._boot_path)
        except OSError as exc:
            return SpawnHistory(host, False, detail=f"cannot identify this boot ({self._boot_path}): {exc}")
        if not self.dir.is_dir():
            return SpawnHistory(host, False, boot, detail=f"the box's spawn journal {self.dir} is gone")
        try:
            got = self._read(host)
        except (OSError, ValueError) as exc:
            return SpawnHistory(host, False, boot, detail=f"cannot read the spawn journal {self.path(host)}: {exc}")
        if got is None:
            return SpawnHistory(host, True, boot, detail=f"the spawn journal {self.dir} records no spawn of the host")
        if got[0] != boot:
            return SpawnHistory(host, True, boot, detail=f"the spawn journal records spawns only from an earlier "
                                f"boot ({got[0]}), whose processes ended with it")
        _, strict, loose = got
        return SpawnHistory(host, True, boot, strict, loose,
                            f"the spawn journal records {strict} strict and {loose} non-strict spawn(s) in this boot")

    def record(self, host: str, *, strict: bool) -> SpawnHistory:
        """Record one spawn attempt of ``host`` before it starts (durable when this returns). Raises ``OSError`` or
        ``ValueError`` when it cannot, and then the spawn must not happen."""
        boot = read_boot_id(self._boot_path)
        got = self._read(host)
        strict_n, loose_n = (got[1], got[2]) if got is not None and got[0] == boot else (0, 0)
        strict_n, loose_n = (strict_n + 1, loose_n) if strict else (strict_n, loose_n + 1)
        body = {"host": host, "boot_id": boot, "strict": strict_n, "loose": loose_n, "last_at_ms": self.clock.now_ms()}
        atomic_write(self.path(host), json.dumps(body, sort_keys=True).encode("utf-8"))  # fsyncs file and directory
        return SpawnHistory(host, True, boot, strict_n, loose_n)


# ---------------------------------------------------------------------------------------------------------
# Scans


def open_holders(paths: Iterable[str | Path], *, proc: str | Path = "/proc", uid: int | None = None) -> HolderScan:
    """Every process that holds any of ``paths`` open or mapped (§5.3 step 3: ``/proc/*/fd``).

    ``uid`` restricts the scan to one owner (the spec's instance uid); ``None`` scans every process. A file
    that was unlinked while held (``(deleted)``) still counts. A vanished process is skipped quietly; one whose
    entries may not be read is skipped and counted in ``skipped``. When ``/proc`` cannot be listed, or does
    not show this process (another pid namespace), the scan is ``complete=False``.
    """
    targets: set[str] = set()
    for p in paths:
        for form in {os.path.abspath(p), os.path.realpath(p)}:
            targets.add(form)
            targets.add(form + " (deleted)")
    proc_dir = Path(proc)
    try:
        pids = sorted(int(e) for e in os.listdir(proc_dir) if e.isdigit())
    except OSError as exc:
        return HolderScan((), False, 0, 0, f"cannot list {proc_dir}: {exc.strerror or exc}")
    if os.getpid() not in pids:
        return HolderScan((), False, len(pids), 0, f"{proc_dir} does not show this process (another pid namespace?)")
    found: dict[tuple[int, str], Holder] = {}
    skipped = 0
    for pid in pids:
        base = proc_dir / str(pid)
        try:
            if uid is not None and base.stat().st_uid != uid:
                continue
            fds = os.listdir(base / "fd")
        except (FileNotFoundError, ProcessLookupError):
            continue
        except PermissionError:
            skipped += 1
            continue
        except OSError:
            continue
        hits: list[tuple[str, str]] = []
        for fd in fds:
            try:
                target = os.readlink(base / "fd" / fd)
            except OSError:
                continue  # closed meanwhile, or the process is gone
            if target in targets:
                hits.append((target, "fd"))
        try:
            with open(base / "maps", encoding="utf-8", errors="surrogateescape") as maps:
                for line in maps:
                    parts = line.rstrip("\n").split(maxsplit=5)
                    if len(parts) == 6 and parts[5] in targets:
                        hits.append((parts[5], "map"))
        except OSError:
            pass  # vanished or unreadable maps: the fd scan above is the spec's requirement
        for path, via in hits:
            clean = path.removesuffix(" (deleted)")
            prior = found.get((pid, clean))
            if prior is None:
                found[(pid, clean)] = Holder(pid, clean, via, process_name(pid))
            elif via not in prior.via.split(","):
                found[(pid, clean)] = Holder(pid, clean, f"{prior.via},{via}", prior.name)
    holders = tuple(sorted(found.values(), key=lambda h: (h.pid, h.path)))
    return HolderScan(holders, True, len(pids), skipped)


def stray_processes(agent_cgroup_dir: str | Path, own_pid: int) -> StrayScan:
    """Processes in the agent's own leaf other than ``own_pid`` (§5.3 step 2). Unreadable: ``readable=False``."""
    d = Path(agent_cgroup_dir)
    try:
        pids = _read_pids(d / "cgroup.procs")
    except (OSError, ValueError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        return StrayScan(str(d), (), False, f"cannot read {d / 'cgroup.procs'}: {reason}")
    strays = tuple(p for p in pids if p != own_pid)
    return StrayScan(str(d), strays, True, "", tuple(process_name(p) for p in strays))


# ---------------------------------------------------------------------------------------------------------
# The port


class ProcessTree(Protocol):
    """What a box asks of its instance processes (spec §5.3, §9.3)."""

    def strict_available(self) -> tuple[bool, str]:
        """Whether strict spawns are possible here, and why not in plain words."""
        ...

    def prepare_strict(self, host: str) -> Path:
        """The host's empty leaf, created if needed. Raises :class:`StrictRefused` on a populated group."""
        ...

    def spawn_strict(
        self,
        host: str,
        argv: Sequence[str],
        *,
        env: Mapping[str, str],
        cwd: str | Path,
        stdout: str | Path,
        stderr: str | Path,
    ) -> Spawned: ...

    def populated(self, host: str) -> bool: ...

    def spawn_history(self, host: str) -> SpawnHistory:
        """The box's durable record of this host's spawns in the current boot (§5.3, joint D3)."""
        ...

    def members(self, host: str) -> tuple[int, ...]: ...

    async def kill_and_drain(self, host: str, *, within_s: float) -> Drain: ...

    async def reopen_and_drain(self, host: str, *, within_s: float) -> Drain: ...

    def agent_dir(self) -> Path | None:
        """The agent's own cgroup leaf, read from ``/proc/self/cgroup``."""
        ...

    def strays(self, own_pid: int) -> StrayScan: ...

    def holders(self, paths: Iterable[str | Path], *, uid: int | None = None) -> HolderScan: ...


class CgroupTree:
    """The real :class:`ProcessTree` over cgroup v2: ``<root>/hostmove/<deployment>/<box>/<host>`` (spec §5.3).

    Holds no state that evidence depends on: a new object (a restarted agent) reads the same groups.
    ``deployment`` is the deployment's identity (:func:`services.box.roster.ensure_deployment`); a tree on a real
    hierarchy needs one, so two deployments with the same box labels never share a group.
    ``root=None`` (no cgroup v2 on this machine) makes every strict spawn refuse. ``journal`` is the box's
    :class:`SpawnJournal` (a directory in the box's state): every strict spawn is recorded there first. Without
    one nothing is recorded and :meth:`spawn_history` knows nothing, so an absent leaf never counts as evidence.
    ``instance_users``: every strict spawn of a host runs as that host's own user (placed first, then dropped:
    issue 14 item 4); None runs it as this process's user.
    """

    instance_users: InstanceUsers | None = None

    def __init__(
        self,
        root: str | Path | None,
        box_label: str,
        *,
        deployment: str = "",
        clock: Clock | None = None,
        journal: SpawnJournal | str | Path | None = None,
    ) -> None:
        self.root = Path(root) if root is not None else None
        if self.root is not None and not deployment:
            raise ValueError(f"box {box_label}'s cgroup subtree is keyed by its deployment's identity: name it "
                             "(control/deployment.json in the deployment bucket)")
        self.box_label = box_label
        self.deployment = deployment
        self.clock: Clock = clock or WallClock()
        self.deployment_dir = self.root / BASE_DIR / leaf_name(deployment) if self.root is not None else None
        """``<root>/hostmove/<deployment>``: every box group of this deployment on this machine."""
        self.base = self.deployment_dir / leaf_name(box_label) if self.deployment_dir is not None else None
        self.journal = journal if isinstance(journal, SpawnJournal) or journal is None else SpawnJournal(
            journal, clock=self.clock)
        self._children: list[subprocess.Popen[bytes]] = []

    @classmethod
    def discover(
        cls,
        box_label: str,
        *,
        deployment: str,
        clock: Clock | None = None,
        mounts: str | Path = "/proc/mounts",
        journal: SpawnJournal | str | Path | None = None,
    ) -> CgroupTree:
        """A tree on this machine's cgroup v2 mount (found in ``/proc/mounts``), or a refusing one without it,
        for box ``box_label`` of the deployment ``deployment`` (its identity, never only the label)."""
        return cls(find_cgroup2_root(mounts), box_label, deployment=deployment, clock=clock, journal=journal)

    # -- layout ---------------------------------------------------------------------------------------

    def leaf(self, host: str) -> Path:
        if self.base is None:
            raise StrictRefused(self._no_cgroup2())
        return self.base / leaf_name(host)

    def _no_cgroup2(self) -> str:
        return (
            "this machine has no cgroup v2 hierarchy (no 'cgroup2' mount in /proc/mounts), so an instance's "
            "processes cannot be contained and proven stopped; this box refuses strict spawns and moves"
        )

    def strict_available(self) -> tuple[bool, str]:
        """Strict spawns need a cgroup2 mount, a writable ``hostmove/<deployment>/<box>`` group, ``cgroup.kill``
        (Linux 5.14+) and ``cgroup.events`` (ARCHITECTURE §6: without them the box refuses moves)."""
        if self.root is None or self.base is None:
            return False, self._no_cgroup2()
        try:
            for attempt in range(_MKDIR_ATTEMPTS):
                try:
                    self.base.mkdir(parents=True, exist_ok=True)
                    break
                except FileNotFoundError:  # another box's clean-up removed an empty parent meanwhile: again
                    if attempt == _MKDIR_ATTEMPTS - 1:
                        raise
        except OSError as exc:
            return False, (
                f"cannot create the cgroup {self.base} ({exc.strerror or exc}); the agent needs a delegated, "
                "writable cgroup v2 subtree to contain instances, so this box refuses strict spawns and moves"
            )
        for needed in ("cgroup.kill", "cgroup.events", "cgroup.procs"):
            if not (self.base / needed).exists():
                why = "the kernel is older than 5.14" if needed == "cgroup.kill" else "the hierarchy is incomplete"
                return False, (
                    f"the cgroup {self.base} has no {needed} ({why}), so a process tree cannot be killed and "
                    "proven empty; this box refuses strict spawns and moves"
                )
        if not os.access(self.base / "cgroup.procs", os.W_OK):
            return False, (
                f"the agent may not move processes into {self.base} (cgroup.procs is not writable); "
                "this box refuses strict spawns and moves"
            )
        return True, f"cgroup v2 at {self.root}; instances run in {self.base}/<host>"

    # -- strict spawn ---------------------------------------------------------------------------------

    def prepare_strict(self, host: str) -> Path:
        """The host's leaf, created empty; refuses a populated group (§5.3, ``PrepareStrict``)."""
        ok, reason = self.strict_available()
        if not ok:
            raise StrictRefused(reason)
        leaf = self.leaf(host)
        try:
            leaf.mkdir(exist_ok=True)
            busy = _populated(leaf)
        except OSError as exc:
            raise StrictRefused(f"cannot prepare the cgroup {leaf} for host {host!r}: {exc.strerror or exc}") from None
        if busy:
            pids = self._members_or_empty(leaf)
            raise StrictRefused(
                f"host {host!r} still has processes in its cgroup {leaf} (pids {list(pids) or 'unknown'}); "
                "a strict spawn needs an empty group: kill and drain it first"
            )
        return leaf

    def spawn_strict(
        self,
        host: str,
        argv: Sequence[str],
        *,
        env: Mapping[str, str],
        cwd: str | Path,
        stdout: str | Path,
        stderr: str | Path,
    ) -> Spawned:
        """Start ``argv`` inside the host's empty leaf; it is placed before the app executes (§5.3 strict).

        Raises :class:`StrictRefused` (nothing ran) when the group is populated, the spawn cannot be journaled
        or placement fails, and ``FileNotFoundError`` when ``argv[0]`` is not found on the given ``PATH``.
        """
        if not argv:
            raise ValueError("spawn_strict needs a program to run")
        if shutil.which(argv[0], path=env.get("PATH", os.defpath)) is None:
            raise FileNotFoundError(f"program not found for host {host!r}: {argv[0]}")
        leaf = self.prepare_strict(host)
        if self.journal is not None:
            try:
                self.journal.record(host, strict=True)
            except (OSError, ValueError) as exc:
                raise StrictRefused(
                    f"host {host!r} was not started: its spawn could not be recorded in the box's spawn journal "
                    f"{self.journal.dir} ({exc}); fix the journal's directory so stop evidence can rely on it"
                ) from None
        read_end, write_end = os.pipe()
        try:
            with open(stdout, "ab") as out, open(stderr, "ab") as err:
                proc = subprocess.Popen(
                    ["/bin/sh", "-c", _SHIM, "hostmove-shim", str(leaf / "cgroup.procs"),
                     *drop_argv(user_for(self, host), argv)],
                    env={k: v for k, v in env.items() if not k.startswith(PLATFORM)},
                    cwd=str(cwd),
                    stdin=write_end,
                    stdout=out,
                    stderr=err,
                    close_fds=True,
                    start_new_session=True,
                )
        except BaseException:
            os.close(read_end)
            os.close(write_end)
            raise
        os.close(write_end)
        self._children.append(proc)
        try:
            placed = self._await_placement(read_end)
        finally:
            os.close(read_end)
        if not placed:
            if proc.poll() is None:
                proc.kill()
            code = proc.wait()
            raise StrictRefused(
                f"host {host!r} was not started: its process could not be placed in the cgroup {leaf} "
                f"(shim exit {code}); an instance never runs outside its group"
            )
        return Spawned(host, proc.pid, leaf, proc)

    def _await_placement(self, fd: int) -> bool:
        got = b""
        deadline = self.clock.monotonic() + _PLACEMENT_TIMEOUT_S
        while True:
            left = deadline - self.clock.monotonic()
            if left <= 0:
                return False
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                return False
            chunk = os.read(fd, 64)
            if not chunk:
                return got == b"placed"
            got += chunk
            if got == b"placed":
                return True

    # -- observation ----------------------------------------------------------------------------------

    def populated(self, host: str) -> bool:
        """``cgroup.events`` says ``populated 1``. An absent leaf is empty (every spawn is strict)."""
        leaf = self.leaf(host)
        try:
            return _populated(leaf)
        except FileNotFoundError:
            return False

    def spawn_history(self, host: str) -> SpawnHistory:
        """The journal's account of this host's spawns in this boot; unknown (``readable=False``) without one."""
        if self.journal is None:
            return SpawnHistory(host, False, detail=f"box {self.box_label} keeps no spawn journal")
        return self.journal.history(host)

    def members(self, host: str) -> tuple[int, ...]:
        leaf = self.leaf(host)
        try:
            return _read_pids(leaf / "cgroup.procs")
        except FileNotFoundError:
            return ()

    def _members_or_empty(self, leaf: Path) -> tuple[int, ...]:
        try:
            return _read_pids(leaf / "cgroup.procs")
        except (OSError, ValueError):
            return ()

    def agent_dir(self) -> Path | None:
        return current_cgroup_dir(self.root) if self.root is not None else None

    def agent_leaf(self) -> Path | None:
        """Where this box's agent lives: ``<root>/hostmove/<deployment>/<box>/@agent``."""
        return self.base / AGENT_LEAF if self.base is not None else None

    def strays(self, own_pid: int) -> StrayScan:
        """§5.3 step 2 over this box's own ``@agent`` leaf and nothing else: an agent found in any other group
        (another deployment's, another box's, the machine's) is a scan that cannot be made, never a list of
        someone else's processes."""
        d = self.agent_dir()
        if d is None:
            return StrayScan("", (), False, "the agent's own cgroup could not be found in /proc/self/cgroup")
        own = self.agent_leaf()
        if own is None or d != own:
            return StrayScan(str(d), (), False, f"the agent runs in the cgroup {d}, not in its box's own group "
                             f"{own}; only that group is this box's to scan")
        return stray_processes(d, own_pid)

    def holders(self, paths: Iterable[str | Path], *, uid: int | None = None) -> HolderScan:
        return open_holders(paths, uid=uid)

    # -- kill and drain -------------------------------------------------------------------------------

    async def kill_and_drain(self, host: str, *, within_s: float) -> Drain:
        """Write ``cgroup.kill`` and wait until ``populated 0`` (§5.3 step 1, ``KillAndEmpty``).

        Never creates the leaf. A deadline passed with processes left is a value (``drained=False``).
        """
        return await self._drain(host, within_s)

    async def reopen_and_drain(self, host: str, *, within_s: float) -> Drain:
        """The cleanup-only call (§5.3 joint D3, ``ReopenAndDrain``): reopen an existing group, identify,
        kill and drain it. It never creates a group and hands back no spawn right; evidence uses it."""
        return await self._drain(host, within_s)

    async def _drain(self, host: str, within_s: float) -> Drain:
        leaf = self.leaf(host)
        start = self.clock.monotonic()
        if not leaf.is_dir():
            return Drain(host, str(leaf), False, (), True, 0)
        try:
            before = _read_pids(leaf / "cgroup.procs")
            (leaf / "cgroup.kill").write_text("1", encoding="ascii")
            last_kill = start
            while _populated(leaf):
                now = self.clock.monotonic()
                if now - start >= within_s:
                    remaining = self._members_or_empty(leaf)
                    return Drain(host, str(leaf), True, before, False, int((now - start) * 1000), remaining)
                if now - last_kill >= _REKILL_S:
                    (leaf / "cgroup.kill").write_text("1", encoding="ascii")
                    last_kill = now
                await self.clock.sleep(_POLL_S)
        except FileNotFoundError:
            # removed meanwhile: the kernel removes only an empty group, so nothing of it runs
            return Drain(host, str(leaf), False, (), True, int((self.clock.monotonic() - start) * 1000))
        except OSError as exc:
            waited = int((self.clock.monotonic() - start) * 1000)
            error = f"cannot kill and drain the cgroup {leaf}: {exc.strerror or exc}"
            return Drain(host, str(leaf), True, (), False, waited, self._members_or_empty(leaf), error)
        self.reap()
        return Drain(host, str(leaf), True, before, True, int((self.clock.monotonic() - start) * 1000))

    def reap(self) -> None:
        """Collect exit statuses of processes this object started (housekeeping only, never evidence)."""
        self._children = [p for p in self._children if p.poll() is None]

    # -- agent leaf and clean-up ----------------------------------------------------------------------

    def enter_agent_leaf(self, pid: int | None = None) -> Path:
        """Move the agent (this process by default) into ``<root>/hostmove/<deployment>/<box>/@agent``, so
        that §5.3 step 2 can tell the agent's own group apart from everything else. Returns the leaf."""
        ok, reason = self.strict_available()
        if not ok or self.base is None:
            raise StrictRefused(reason)
        leaf = self.base / AGENT_LEAF
        leaf.mkdir(exist_ok=True)
        (leaf / "cgroup.procs").write_text(f"{pid or os.getpid()}\n", encoding="ascii")
        return leaf

    def remove_leaf(self, host: str) -> bool:
        """Remove the host's empty leaf. ``False`` when absent; raises ``OSError`` (EBUSY) when populated."""
        try:
            self.leaf(host).rmdir()
        except FileNotFoundError:
            return False
        return True

    def remove_box(self) -> None:
        """Remove ``hostmove/<deployment>/<box>`` once every leaf is empty and removed, then the deployment's
        and ``hostmove`` groups if nothing else is left in them."""
        if self.base is None:
            return
        for d in (self.base / AGENT_LEAF, self.base):
            try:
                d.rmdir()
            except FileNotFoundError:
                continue
        self.prune()

    def prune(self) -> None:
        """Remove ``hostmove/<deployment>`` and ``hostmove`` when empty; a group that still holds another box's
        (or another deployment's) group stays."""
        if self.deployment_dir is None:
            return
        for d in (self.deployment_dir, self.deployment_dir.parent):
            try:
                d.rmdir()
            except OSError:  # absent, or another box or deployment still has its group here
                continue
