"""The invariants the simulation checks on the code that exists today (spec §4; model digest §3).

:class:`Checker` watches every write that lands on the object-store twin and every message stored on
the stream, keeps a shadow of the durable state, and checks at each event (after every step that can
change what it checks):

- ``ledger-history``: per object, the stream's gens are contiguous from 1 with no rebase (the
  simulation never loses stream history, so a rebase means the code lost it); every event restates
  exactly the bytes stored for its gen; no gen is ever written twice with different bytes or goes
  backwards (a write that was not a CAS); at the end, the fold of the stream equals the store byte for
  byte (:class:`services.ledger.audit.HistoryCheck`, strict);
- ``durable-boundary``: every stored claim, record, roster, marker and event passes the durable-value
  boundary (run-store "Durable values");
- ``INV-1`` one writer: at most one instance process per host anywhere, and every running process is
  the claim's current writer (its box and session); no two admissions share a session and the
  holder's session is the latest admission's (§4 INV-1, §19.2 K1);
- ``INV-13``: no writer is admitted while the claim is creating, deleting, parking, purging, placing
  or free (digest D§3.7);
- ``C5a``: claims and records are never deleted (a noncurrent version deleted by its id is history retired, not
  the object: :mod:`services.sweeper.history`; the current version never is); nor are a host's staging leases and
  move journals in the deployment bucket, whose noncurrent versions the same sweep retires by id (issue 16 item 2);
- ``marker-order``: ``generation.json`` never goes back to an older generation (§5.1, model 29); a retirement
  that removes the version judged against ends that history (what lands in a parked location is residue:
  the world with moves checks it under INV-10);
- ``M17``: no request the IAM policy denies (ruling M17);
- ``INV-3`` quiescence: the calm phase converges with no human (checked by the run);
- ``actor-error``: an actor failed with an exception no service may raise (a defect).

A violation is recorded once and reported as ``VIOLATION seed=<n> <invariant>: <what>``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import unquote

from bus.log import StoredMessage
from bus.subjects import LEDGER_STREAM, SubjectError, parse_ledger_subject
from events.base import canonical, decode
from events.claim import Claim
from events.durable import DurableValueError
from events.envelope import Transition
from events.record import Record
from services.box.artifacts.markers import GenerationMarker, normalize
from services.box.instance.admission import REFUSED_KINDS
from services.box.roster import ROSTER_KEY, Roster
from services.ledger.audit import HistoryCheck
from services.ledger.ledger import META_SHA
from services.move.lease import LEASE_PREFIX
from sim.twins.s3 import Landed

__all__ = ["Checker", "Proc", "Violation"]

PREFIXES = {"control/hosts/": "claim", "control/records/": "record"}


@dataclass(frozen=True)
class Violation:
    seed: int | str
    invariant: str
    what: str
    at: float

    def line(self) -> str:
        return f"VIOLATION seed={self.seed} {self.invariant}: {self.what}"


@dataclass
class Proc:
    """One instance process tree (the simulation's process supervisor)."""

    box: str
    host: str
    session: int | None  # None: started before any admission named it
    generation: str


def object_of_key(key: str) -> tuple[str, str] | None:
    for prefix, obj in PREFIXES.items():
        if key.startswith(prefix) and key.endswith(".json") and "/" not in key[len(prefix):]:
            return obj, unquote(key[len(prefix): -len(".json")])
    return None


class Checker:
    def __init__(self, seed: int | str, now: Callable[[], float], emit: Callable[[str, str], None],
                 deployment: str) -> None:
        self.seed = seed
        self.now = now
        self.emit = emit
        self.deployment = deployment
        self.violations: list[Violation] = []
        self._seen: set[tuple[str, str]] = set()
        self.on_violation: Callable[[Violation], None] | None = None
        # shadows of the durable state
        self.claims: dict[str, Claim] = {}
        self.bodies: dict[tuple[str, str], dict[int, bytes]] = {}
        self.current: dict[tuple[str, str], tuple[int, bytes]] = {}
        self.stream_last: dict[tuple[str, str], int] = {}
        self.markers: dict[tuple[str, str], tuple[int | None, str, str | None]] = {}  # session, gen, version
        self.ledger_current: dict[tuple[str, str], str | None] = {}  # a claim's or record's current version id
        self.gen_session: dict[tuple[str, str], int] = {}
        self.procs: list[Proc] = []

    # -- reporting ----------------------------------------------------------------------------------

    def flag(self, invariant: str, what: str) -> None:
        if (invariant, what) in self._seen:
            return
        self._seen.add((invariant, what))
        v = Violation(self.seed, invariant, what, self.now())
        self.violations.append(v)
        self.emit("checker", f"VIOLATION {invariant}: {what}")
        if self.on_violation is not None:
            self.on_violation(v)

    # -- the object store ---------------------------------------------------------------------------

    def on_landed(self, w: Landed) -> None:
        if w.bucket == self.deployment:
            found = object_of_key(w.key)
            if found is not None:
                self._ledger_object(w, *found)
            elif w.key.startswith(("moves/", LEASE_PREFIX)):
                self._history_object(w)
            elif w.key == ROSTER_KEY and w.body is not None:
                try:
                    decode(w.body, Roster)
                except DurableValueError as exc:
                    self.flag("durable-boundary", f"the roster written by {w.request.principal} fails it: {exc}")
        elif w.key.endswith("/generation.json") and w.body is not None:
            self._marker(w)
        elif w.key.endswith("/generation.json") and w.removed_version:
            prev = self.markers.get((w.bucket, w.key))
            if prev is not None and prev[2] == w.version_id:
                # A retirement removed the version the order is judged against: the location was parked (§6.4),
                # and what lands there later is residue for the straggler sweep (INV-10), not a step back.
                del self.markers[(w.bucket, w.key)]

    def _history_object(self, w: Landed) -> None:
        """A staging lease or a move journal: only a noncurrent version is ever deleted, by its id (C5a as
        :mod:`services.sweeper.history` extends it)."""
        if w.op != "delete":
            self.ledger_current[(w.bucket, w.key)] = w.version_id
            return
        current = self.ledger_current.get((w.bucket, w.key))
        if w.removed_version and w.version_id is not None and current is not None and w.version_id != current:
            return
        self.flag("C5a", f"{w.key} was deleted by {w.request.principal} (only a noncurrent version, by its id)")

    def _ledger_object(self, w: Landed, obj: str, host: str) -> None:
        who = w.request.principal
        if w.op == "delete":
            current = self.ledger_current.get((w.bucket, w.key))
            if w.removed_version and w.version_id is not None and current is not None and w.version_id != current:
                return  # a noncurrent version retired by its id: the object and its current version stand
            self.flag("C5a", f"the {obj} of {host} was deleted by {who} (claims and records are never deleted)")
            return
        if w.op == "put":
            self.ledger_current[(w.bucket, w.key)] = w.version_id
        if w.body is None:
            self.flag("durable-boundary", f"the {obj} of {host} was written by {who} without going through the ledger")
            return
        try:
            if w.metadata.get(META_SHA) != hashlib.sha256(w.body).hexdigest():
                raise DurableValueError("decode_failed", "ledger_written", "body digest missing or wrong")
            state: Claim | Record = decode(w.body, Claim) if obj == "claim" else decode(w.body, Record)
            if state.host != host:
                raise DurableValueError("decode_failed", "host_matches_key", "the object names another host")
        except DurableValueError as exc:
            self.flag("durable-boundary", f"the {obj} of {host} written by {who} fails the boundary: {exc}")
            return
        gens = self.bodies.setdefault((obj, host), {})
        earlier = gens.get(state.gen)
        if earlier is not None and earlier != w.body:
            self.flag("ledger-history", f"two different versions of the {obj} of {host} carry gen {state.gen} "
                                        f"(the second by {who}: a write that was not a compare-and-swap)")
        prev = self.current.get((obj, host))
        if prev is not None and state.gen <= prev[0] and earlier is None:
            self.flag("ledger-history", f"the {obj} of {host} went from gen {prev[0]} back to gen {state.gen}")
        gens[state.gen] = w.body
        self.current[(obj, host)] = (state.gen, w.body)
        if isinstance(state, Claim):
            self._claim(host, self.claims.get(host), state)

    def _claim(self, host: str, prev: Claim | None, new: Claim) -> None:
        self.claims[host] = new
        holder = new.holder
        if holder is not None:
            sessions = [a.session for a in holder.admissions]
            if len(set(sessions)) != len(sessions) or sessions != sorted(sessions):
                self.flag("INV-1", f"two admissions of {host} share a session, or go back ({sessions})")
            if holder.admissions and holder.session != holder.admissions[-1].session:
                self.flag("INV-1", f"the holder of {host} has session {holder.session}, "
                                   f"not its latest admission's {holder.admissions[-1].session}")
            for a in holder.admissions:
                self.gen_session[(host, normalize(a.generation))] = a.session
            prev_last = prev.holder.admissions[-1].session if prev and prev.holder and prev.holder.admissions else 0
            if holder.admissions and holder.admissions[-1].session != prev_last and prev is not None \
                    and prev.op.kind in REFUSED_KINDS:
                self.flag("INV-13", f"{holder.admissions[-1].box} was admitted as the writer of {host} "
                                    f"while the claim was {prev.op.kind}")
        self.check_writers(host)

    def _marker(self, w: Landed) -> None:
        assert w.body is not None
        try:
            marker = decode(w.body, GenerationMarker)
        except DurableValueError as exc:
            self.flag("durable-boundary", f"{w.bucket}/{w.key} fails the boundary: {exc}")
            return
        gen = normalize(marker.op)
        session = self.gen_session.get((marker.host, gen), 0 if gen == "" else None)
        prev = self.markers.get((w.bucket, w.key))
        if prev is not None and prev[0] is not None and session is not None and session < prev[0]:
            self.flag("marker-order", f"generation.json of {marker.host} went back from generation {prev[1]} "
                                      f"(session {prev[0]}) to the older {gen} (session {session}), "
                                      f"written by {w.request.principal}")
        self.markers[(w.bucket, w.key)] = (session, gen, w.version_id)

    # -- the stream ---------------------------------------------------------------------------------

    def on_message(self, stream: str, msg: StoredMessage) -> None:
        if stream != LEDGER_STREAM:
            return
        try:
            obj, host = parse_ledger_subject(msg.subject)
            event = decode(msg.data, Transition)
        except (SubjectError, DurableValueError, UnicodeDecodeError) as exc:
            self.flag("durable-boundary", f"stream message {msg.seq} fails the boundary: {exc}")
            return
        last = self.stream_last.get((obj, host), 0)
        if event.kind == "rebase":
            self.flag("ledger-history", f"the {obj} of {host} was rebased at gen {event.gen} after gen {last}: "
                                        f"the stream lost history")
        elif event.gen != last + 1:
            self.flag("ledger-history", f"the {obj} of {host}: gen {event.gen} follows gen {last} on the stream")
        stored = self.bodies.get((obj, host), {}).get(event.gen)
        if stored is None:
            self.flag("ledger-history", f"gen {event.gen} of the {obj} of {host} is on the stream but was never stored")
        elif stored != canonical(event.state):
            self.flag("ledger-history", f"the event of gen {event.gen} of the {obj} of {host} differs from the "
                                        f"stored gen {event.gen}")
        self.stream_last[(obj, host)] = max(last, event.gen)

    # -- processes (INV-1) --------------------------------------------------------------------------

    def check_writers(self, host: str) -> None:
        procs = [p for p in self.procs if p.host == host]
        if len(procs) > 1:
            where = ", ".join(f"{p.box} session {p.session}" for p in procs)
            self.flag("INV-1", f"{len(procs)} process trees run {host} at once ({where})")
        claim = self.claims.get(host)
        holder = claim.holder if claim is not None else None
        for p in procs:
            if holder is None or p.session != holder.session or p.box != holder.writer_box:
                named = f"{holder.writer_box or 'nobody'} session {holder.session}" if holder else "no holder"
                self.flag("INV-1", f"{p.box} runs {host} as session {p.session}, but the claim's writer is {named}")

    # -- the end of a run ---------------------------------------------------------------------------

    def final(self, messages: list[StoredMessage], store: dict[tuple[str, str], bytes | None]) -> None:
        """The fold of the whole stream against the store, byte for byte (strict: no rebase)."""
        check = HistoryCheck()
        for m in messages:
            check.feed(m)
        for (obj, host), body in sorted(store.items()):
            gen = None
            if body is not None:
                try:
                    gen = decode(body, Claim).gen if obj == "claim" else decode(body, Record).gen
                except DurableValueError as exc:
                    self.flag("durable-boundary", f"the {obj} of {host} in the store fails the boundary: {exc}")
            check.compare(obj, host, body, gen)
        for f in check.findings:
            self.flag("ledger-history", f"audit: {f.line()}")
