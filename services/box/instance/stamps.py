"""The stamp record per host incarnation, and the two local retirements (spec §6.4; claim rev 6.5 §6.4).

An installation's stamp is the claim ``gen`` of the CAS that made it current, written into
``holder.stamp``. Each box keeps, under the host guard, ``{active_stamp | none, retired_stamps}``
per ``(host, incarnation)``, durably in ``<box_dir>/stamps.db`` (SQLite, WAL, synchronous FULL), and
an inventory of the local artifacts it holds for the incarnation, each tagged with the stamp of the
installation that produced it.

- **Initialization** (:meth:`StampBook.init_record`): only from a fresh claim read under the guard
  that names this box ``op.exec`` or the landing participant; ``active_stamp = holder.stamp``.
- **Activation** is one of the two moves of a stamp: the old active stamp, if any, goes into
  ``retired_stamps``, then the new one is set. A stamp this box retired is never activated again.
- **Admission** (:meth:`StampBook.admit`): a writer's ``{incarnation, stamp}`` captured at work
  selection is admitted only if it **equals** the active stamp; a lower or retired stamp, any stamp
  while the active one is none, and any stamp with no record are refused.
- ``retire-artifacts(S)`` (:meth:`StampBook.retire_artifacts`) parks the artifacts tagged ``S`` and
  **moves no stamp**.
- ``retire-installation`` (:meth:`StampBook.retire_installation`) first writes the retired marker
  (active into retired, none), then parks every artifact of the incarnation.

A local park renames into ``<box_dir>/.parked/superseded-<op>/<event>/<host>/`` (one destination
per retirement event, joint D5), with a ``manifest.json``; nothing is deleted (INV-8).
"""

from __future__ import annotations

import json
import os
import sqlite3
from collections.abc import Collection, Iterable
from pathlib import Path
from urllib.parse import quote

import msgspec
import sqlite_utils

from events.base import validate_ident
from events.claim import Claim
from kernel.fsutil import atomic_write, fsync_dir
from kernel.ports import Clock
from services.box.instance.guard import Guarded
from services.box.instance.registry import open_db, transaction

STAMPS_FILE = "stamps.db"
PARKED_DIR = ".parked"


class StampError(Exception):
    """A stamp-record operation was refused; the record is unchanged."""


class StampRecord(msgspec.Struct, frozen=True):
    """``{active_stamp | none, retired_stamps}`` for one host incarnation (§6.4)."""

    host: str
    incarnation: str
    active_stamp: int | None = None
    retired_stamps: tuple[int, ...] = ()


class Artifact(msgspec.Struct, frozen=True):
    """A local artifact of an incarnation (``db``, ``gen``, ``files``, ``env``, ...) and its tag."""

    name: str
    path: str
    stamp: int


class ParkedArtifact(msgspec.Struct, frozen=True):
    name: str
    stamp: int
    source: str
    parked_to: str


# --- the pure rules ----------------------------------------------------------------------------


class Activate(msgspec.Struct, frozen=True):
    stamp: int


class NoChange(msgspec.Struct, frozen=True):
    stamp: int


class Refuse(msgspec.Struct, frozen=True):
    reason: str


InitDecision = Activate | NoChange | Refuse


def decide_init(claim: Claim | None, box: str, record: StampRecord | None) -> InitDecision:
    """What a fresh claim read under the guard does to this box's record (§6.4 "Initialization").

    Only a read that names ``box`` as ``op.exec`` or the landing participant (the target of a
    ``landing`` op) initializes; the stamp is ``holder.stamp``. A stamp the record already retired
    is refused: the claim names an installation this box has finished with (INV-6 ``return-stamp``).
    """
    if claim is None or claim.holder is None:
        return Refuse("the claim names no holder, so this box has no installation to record")
    op = claim.op
    landing_participant = op.kind == "landing" and len(op.participants) > 1 and op.participants[1] == box
    if op.exec != box and not landing_participant:
        return Refuse(f"the claim does not name this box ({box}) as the executor or the landing box")
    stamp = claim.holder.stamp
    if stamp <= 0:
        return Refuse("the claim carries no installation stamp (holder.stamp) yet")
    if record is not None:
        if record.active_stamp == stamp:
            return NoChange(stamp)
        if stamp in record.retired_stamps:
            return Refuse(
                f"the claim names installation stamp {stamp}, which this box already retired; it is not reused"
            )
    return Activate(stamp)


def activated(record: StampRecord | None, host: str, incarnation: str, stamp: int) -> StampRecord:
    """Activation (§6.4): the old active stamp, if any, into ``retired_stamps``, then the new one."""
    if record is None:
        return StampRecord(host, incarnation, stamp, ())
    retired = record.retired_stamps
    if record.active_stamp is not None and record.active_stamp != stamp and record.active_stamp not in retired:
        retired = (*retired, record.active_stamp)
    return msgspec.structs.replace(record, active_stamp=stamp, retired_stamps=retired)


def installation_retired(record: StampRecord | None, host: str, incarnation: str) -> StampRecord:
    """``retire-installation``'s move (§6.4): active into retired, then none."""
    if record is None:
        return StampRecord(host, incarnation, None, ())
    retired = record.retired_stamps
    if record.active_stamp is not None and record.active_stamp not in retired:
        retired = (*retired, record.active_stamp)
    return msgspec.structs.replace(record, active_stamp=None, retired_stamps=retired)


def admits(record: StampRecord | None, stamp: int) -> bool:
    """A writer is admitted only at the active stamp (§6.4): no record, none active, a retired or any
    other stamp is refused."""
    return record is not None and record.active_stamp is not None and stamp == record.active_stamp


# --- the durable store -------------------------------------------------------------------------


def _component(text: str, what: str) -> str:
    validate_ident(text, what)
    if "/" in text or text in (".", "..") or "\x00" in text:
        raise StampError(f"the {what} {text!r} cannot name a park directory")
    return text


def installation_artifacts(db: Path, files: Path) -> dict[str, Path]:
    """The local artifacts of an installation (§6.1): the database, its WAL, SHM and ``.gen``, the files. Whatever
    installed them (a wake's cold admission, a landing's probe admission) tags them with its stamp, so the
    ``retire-installation`` of a move away parks them all (§6.4, §7.9 step 3)."""
    return {"db": db, "db-wal": Path(f"{db}-wal"), "db-shm": Path(f"{db}-shm"), "db-gen": db.with_suffix(".gen"),
            "files": files}


class StampBook:
    """The box's stamp records and artifact tags (§6.4). Mutations require the live host guard."""

    def __init__(self, db: sqlite_utils.Database, box_dir: Path, clock: Clock) -> None:
        self.db = db
        self.conn: sqlite3.Connection = db.conn
        self.box_dir = Path(box_dir)
        self.clock = clock
        db.table("stamp_records").create(
            {"host": str, "incarnation": str, "active_stamp": int, "retired_stamps": str, "updated_at": int},
            pk=("host", "incarnation"),
            not_null={"host", "incarnation", "retired_stamps", "updated_at"},
            if_not_exists=True,
        )
        db.table("artifacts").create(
            {"host": str, "incarnation": str, "name": str, "path": str, "stamp": int, "parked_to": str},
            pk=("host", "incarnation", "name"),
            not_null={"host", "incarnation", "name", "path", "stamp", "parked_to"},
            defaults={"parked_to": ""},
            if_not_exists=True,
        )

    @classmethod
    def open(cls, box_dir: Path, clock: Clock) -> StampBook:
        return cls(open_db(Path(box_dir) / STAMPS_FILE), box_dir, clock)

    def close(self) -> None:
        self.conn.close()

    # reads

    def record(self, host: str, incarnation: str) -> StampRecord | None:
        row = self.conn.execute(
            "SELECT active_stamp, retired_stamps FROM stamp_records WHERE host=? AND incarnation=?",
            (host, incarnation),
        ).fetchone()
        if row is None:
            return None
        return StampRecord(host, incarnation, row[0], tuple(json.loads(row[1])))

    def incarnations(self, host: str) -> list[str]:
        """Every incarnation of ``host`` this box holds a stamp record or an unparked artifact of (quarantine)."""
        cur = self.conn.execute(
            "SELECT incarnation FROM stamp_records WHERE host=? UNION "
            "SELECT incarnation FROM artifacts WHERE host=? AND parked_to='' ORDER BY 1", (host, host))
        return [r[0] for r in cur.fetchall()]

    def artifacts(self, host: str, incarnation: str) -> list[Artifact]:
        cur = self.conn.execute(
            "SELECT name, path, stamp FROM artifacts WHERE host=? AND incarnation=? AND parked_to='' ORDER BY name",
            (host, incarnation),
        )
        return [Artifact(n, p, s) for n, p, s in cur.fetchall()]

    def admit(self, guarded: Guarded, incarnation: str, stamp: int) -> bool:
        """Admit a host-state writer (config sync, release adoption, the activator's admission) that
        captured ``{incarnation, stamp}`` from this record when it selected its work (§6.4).

        Under the guard: the fresh claim must still hold ``incarnation``, and ``stamp`` must equal
        the record's active stamp."""
        guarded.require(guarded.host)
        claim = guarded.claim
        if claim is None or claim.holder is None or claim.holder.incarnation != incarnation:
            return False
        return admits(self.record(guarded.host, incarnation), stamp)

    # writes (under the guard)

    def init_record(self, guarded: Guarded, box: str, *, retag: Iterable[str] = ()) -> InitDecision:
        """Create or refresh the record from the guard's fresh claim read (§6.4 "Initialization").

        On activation, the artifacts named in ``retag`` take the new stamp in the same transaction
        (a cold admission's carried files; the return generation's artifacts at ``R``, §7.8)."""
        guarded.require(guarded.host)
        claim = guarded.claim
        host = guarded.host
        with transaction(self.conn):
            holder = claim.holder if claim is not None else None
            record = self.record(host, holder.incarnation) if holder is not None else None
            decision = decide_init(claim, box, record)
            if isinstance(decision, Activate):
                assert holder is not None
                self._write(activated(record, host, holder.incarnation, decision.stamp))
                for name in retag:
                    self.conn.execute(
                        "UPDATE artifacts SET stamp=? WHERE host=? AND incarnation=? AND name=? AND parked_to=''",
                        (decision.stamp, host, holder.incarnation, name),
                    )
        return decision

    def tag(self, guarded: Guarded, incarnation: str, name: str, path: Path | str, stamp: int) -> None:
        """Record a local artifact and the stamp of the installation that produced it (§6.4)."""
        guarded.require(guarded.host)
        validate_ident(name, "artifact name")
        record = self.record(guarded.host, incarnation)
        if record is not None and stamp in record.retired_stamps:
            raise StampError(
                f"{guarded.host}: stamp {stamp} is retired on this box, so nothing new may be tagged with it"
            )
        self.conn.execute(
            "INSERT INTO artifacts (host, incarnation, name, path, stamp, parked_to) VALUES (?, ?, ?, ?, ?, '') "
            "ON CONFLICT (host, incarnation, name) DO UPDATE SET path=excluded.path, stamp=excluded.stamp "
            "WHERE parked_to=''",
            (guarded.host, incarnation, name, str(Path(path)), stamp),
        )

    def retire_artifacts(
        self,
        guarded: Guarded,
        incarnation: str,
        stamp: int,
        *,
        op: str,
        event: str,
        names: Collection[str] | None = None,
        include_retired: bool = False,
    ) -> list[ParkedArtifact]:
        """``retire-artifacts(S)`` (§6.4): park the artifacts tagged ``stamp`` and move no stamp.

        ``names`` limits it to those artifacts (the database alone, where the files directory is
        carried into the new generation); ``include_retired`` also parks leftovers tagged with a
        stamp the record has retired (a dirty install's source, §7.8, rev 7.11)."""
        guarded.require(guarded.host)
        host = guarded.host
        record = self.record(host, incarnation)
        tags = {stamp}
        if include_retired and record is not None:
            tags.update(record.retired_stamps)
        chosen = [
            a for a in self.artifacts(host, incarnation) if a.stamp in tags and (names is None or a.name in names)
        ]
        return self._park(host, incarnation, chosen, op=op, event=event)

    def retire_installation(self, guarded: Guarded, incarnation: str, *, op: str, event: str) -> list[ParkedArtifact]:
        """``retire-installation`` (§6.4): write the retired marker first (active into retired, none),
        so any stale writer of this incarnation is refused from here on (C7); then park every
        artifact of the incarnation, whatever its tag. A delete, a move away (§7.9), a rolled-back
        target's ``cleaning`` and quarantine call it; never a predecessor's cleanup."""
        guarded.require(guarded.host)
        host = guarded.host
        with transaction(self.conn):
            self._write(installation_retired(self.record(host, incarnation), host, incarnation))
        return self._park(host, incarnation, self.artifacts(host, incarnation), op=op, event=event)

    def resume_parks(self, guarded: Guarded, incarnation: str) -> list[ParkedArtifact]:
        """Finish parks a crash interrupted (artifacts whose destination is journaled); every retire
        call does this first too."""
        guarded.require(guarded.host)
        return self._resume(guarded.host, incarnation)

    # internals

    def _write(self, record: StampRecord) -> None:
        self.conn.execute(
            "INSERT INTO stamp_records (host, incarnation, active_stamp, retired_stamps, updated_at) "
            "VALUES (?, ?, ?, ?, ?) ON CONFLICT (host, incarnation) DO UPDATE SET "
            "active_stamp=excluded.active_stamp, retired_stamps=excluded.retired_stamps, "
            "updated_at=excluded.updated_at",
            (
                record.host,
                record.incarnation,
                record.active_stamp,
                json.dumps(list(record.retired_stamps)),
                self.clock.now_ms(),
            ),
        )

    def park_dir(self, host: str, op: str, event: str) -> Path:
        """``<box_dir>/.parked/superseded-<op>/<event>/<host>/`` (§6.4, one per retirement event)."""
        return (
            self.box_dir
            / PARKED_DIR
            / f"superseded-{_component(op, 'op id')}"
            / _component(event, "retirement event id")
            / quote(host, safe="")
        )

    def _park(
        self, host: str, incarnation: str, chosen: list[Artifact], *, op: str, event: str
    ) -> list[ParkedArtifact]:
        """Park ``chosen`` into this event's destination: the manifest first (it names the event's
        set), then the destinations journaled in the table, then the renames."""
        dest = self.park_dir(host, op, event)
        resumed = [p for p in self._resume(host, incarnation) if Path(p.parked_to).parent == dest]
        manifest = dest / "manifest.json"
        entries: dict[str, dict[str, object]] = {}
        if manifest.exists():
            entries = {e["name"]: e for e in json.loads(manifest.read_bytes())["artifacts"]}
        used = {Path(str(e["parked_to"])).name for e in entries.values()}
        plan: list[tuple[Artifact, Path]] = []
        for a in chosen:
            known = entries.get(a.name)
            if known is not None and known["source"] == a.path:  # planned by an interrupted run
                plan.append((a, Path(str(known["parked_to"]))))
                continue
            base = Path(a.path).name or quote(a.name, safe="")
            leaf = base if base not in used else f"{quote(a.name, safe='')}__{base}"
            used.add(leaf)
            plan.append((a, dest / leaf))
        if not plan:
            return resumed
        for a, to in plan:
            entries[a.name] = msgspec.structs.asdict(ParkedArtifact(a.name, a.stamp, a.path, str(to)))
        dest.mkdir(parents=True, exist_ok=True)
        body = {
            "host": host,
            "incarnation": incarnation,
            "op": op,
            "event": event,
            "artifacts": [entries[k] for k in sorted(entries)],
        }
        atomic_write(manifest, json.dumps(body, sort_keys=True, indent=1).encode())
        with transaction(self.conn):
            for a, to in plan:
                self.conn.execute(
                    "UPDATE artifacts SET parked_to=? WHERE host=? AND incarnation=? AND name=? AND parked_to=''",
                    (str(to), host, incarnation, a.name),
                )
        return resumed + [self._move(host, incarnation, a, to) for a, to in plan]

    def _resume(self, host: str, incarnation: str) -> list[ParkedArtifact]:
        cur = self.conn.execute(
            "SELECT name, path, stamp, parked_to FROM artifacts WHERE host=? AND incarnation=? AND parked_to<>''",
            (host, incarnation),
        )
        return [self._move(host, incarnation, Artifact(n, p, s), Path(t)) for n, p, s, t in cur.fetchall()]

    def _move(self, host: str, incarnation: str, a: Artifact, target: Path) -> ParkedArtifact:
        src = Path(a.path)
        if src.exists() or src.is_symlink():
            if target.exists():
                raise StampError(
                    f"cannot park {src} for {host}: {target} already exists; the park destination is never overwritten"
                )
            target.parent.mkdir(parents=True, exist_ok=True)
            os.rename(src, target)
            fsync_dir(target.parent)
            fsync_dir(src.parent)
        # gone already: moved by an interrupted run of this park, or deleted by a purge (not a retirement)
        self.conn.execute(
            "DELETE FROM artifacts WHERE host=? AND incarnation=? AND name=?", (host, incarnation, a.name)
        )
        return ParkedArtifact(a.name, a.stamp, a.path, str(target))


