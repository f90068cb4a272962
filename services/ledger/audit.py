"""``hostmove audit``: replay the ledger stream and check it against the authority (ARCHITECTURE §4).

Reports, per object: gaps, out-of-order gens, events that fail the durable-value boundary, and a
last state that differs from the object in S3 (byte for byte in the canonical encoding). A
``rebase`` event is an explicit, declared loss of history: it is reported as a notice, and fails the
audit only with ``strict``. A live deployment's store runs ahead of its stream for a moment (a writer CASes, then
publishes; the relay publishes what a writer that stopped between the two did not): an object the store holds at a
later gen than the stream's is read again, its subject's new events with it, for ``settle_s`` before it is a finding,
so an audit of a running deployment reports only what stays wrong. The fold is pure (:class:`HistoryCheck`);
:func:`run_audit` is the shell;
:func:`verdict` is what ``hostmove audit`` says at the end (clean, not clean, nothing to audit, or the store
unavailable: an outage, never a finding about the history).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Literal

from bus.log import EventLog, StoredMessage
from bus.subjects import LEDGER_STREAM, SubjectError, ledger_subject, parse_ledger_subject
from events.base import canonical, decode
from events.durable import DurableValueError
from events.envelope import Transition
from services.ledger.ledger import Ledger
from services.objstore.port import StoreError, StoreUnavailable

Severity = Literal["error", "notice"]
Verdict = Literal["clean", "not-clean", "no-history", "unavailable"]


@dataclass(frozen=True)
class Finding:
    severity: Severity
    object: str
    host: str
    what: str

    def line(self) -> str:
        return f"{self.severity.upper()} {self.object} {self.host}: {self.what}"


@dataclass
class _Track:
    last_gen: int = 0
    last_body: bytes | None = None
    events: int = 0
    last_seq: int = 0


@dataclass
class HistoryCheck:
    """The pure fold of the stream: feed messages in stream order, then compare with the store."""

    tracks: dict[tuple[str, str], _Track] = field(default_factory=dict)
    findings: list[Finding] = field(default_factory=list)
    messages: int = 0
    unavailable: list[str] = field(default_factory=list)
    """Objects the store could not be asked about (an outage: unreachable, 5xx, no answer in time)."""
    present: int = 0
    """Objects the store holds among those compared."""

    def _add(self, severity: Severity, obj: str, host: str, what: str) -> None:
        self.findings.append(Finding(severity, obj, host, what))

    def feed(self, msg: StoredMessage) -> None:
        self.messages += 1
        try:
            obj, host = parse_ledger_subject(msg.subject)
        except (SubjectError, UnicodeDecodeError):
            self._add("error", "?", msg.subject, f"seq {msg.seq}: not a ledger subject")
            return
        track = self.tracks.setdefault((obj, host), _Track())
        try:
            event = decode(msg.data, Transition)
        except DurableValueError as exc:
            self._add("error", obj, host, f"seq {msg.seq}: event fails the durable-value boundary ({exc})")
            return
        if event.object != obj or event.host != host:
            self._add("error", obj, host, f"seq {msg.seq}: event names another object")
            return
        gen = event.gen
        if event.kind == "rebase":
            if gen < track.last_gen:
                self._add(
                    "error", obj, host, f"seq {msg.seq}: rebase to gen {gen} after gen {track.last_gen}"
                )
            else:
                self._add(
                    "notice",
                    obj,
                    host,
                    f"seq {msg.seq}: history rebased at gen {gen} (the stream had gen {track.last_gen})",
                )
        elif gen <= track.last_gen:
            self._add("error", obj, host, f"seq {msg.seq}: out-of-order gen {gen} after gen {track.last_gen}")
            return
        elif gen != track.last_gen + 1:
            self._add("error", obj, host, f"seq {msg.seq}: gap, gen {gen} follows gen {track.last_gen}")
        track.last_gen = gen
        track.last_body = canonical(event.state)
        track.events += 1
        track.last_seq = max(track.last_seq, msg.seq)

    def last_gen(self, obj: str, host: str) -> int:
        track = self.tracks.get((obj, host))
        return track.last_gen if track is not None else 0

    def last_seq(self, obj: str, host: str) -> int:
        track = self.tracks.get((obj, host))
        return track.last_seq if track is not None else 0

    def behind(self, obj: str, host: str, store_gen: int | None) -> bool:
        """The stream's last event of the object is older than the store's gen (its event may still be on its way)."""
        return store_gen is not None and store_gen > self.last_gen(obj, host)

    def compare(self, obj: str, host: str, store_body: bytes | None, store_gen: int | None,
                settled_s: float | None = None) -> None:
        """Compare the fold's last state with the object the store holds (None: missing); ``settled_s``, when the
        shell waited that long for a store ahead of the stream, names the wait in the finding."""
        self.present += store_body is not None
        track = self.tracks.get((obj, host))
        if track is None or track.last_body is None:
            if store_body is not None:
                self._add("error", obj, host, f"no history on the stream for gen {store_gen}")
            return
        if store_body is None:
            self._add("error", obj, host, "the stream has history but the store has no object")
        elif store_body != track.last_body:
            waited = (f": gen {store_gen} has no event on the stream after {settled_s:g} s (a writer stopped between "
                      "its CAS and its publish: its next transition, or the relay, publishes it)"
                      if settled_s is not None and self.behind(obj, host, store_gen) else "")
            self._add(
                "error",
                obj,
                host,
                f"last state differs from the object in S3 "
                f"(stream gen {track.last_gen}, store gen {store_gen}){waited}",
            )

    def clean(self, strict: bool = False) -> bool:
        return not any(f.severity == "error" or strict for f in self.findings)


SETTLE_S = 5.0
"""How long an object the store holds ahead of the stream is read again before it is a finding: a writer's publish
follows its CAS within its publish budget; the relay publishes a stopped writer's within its own pass."""


async def run_audit(
    events: EventLog, ledger: Ledger, *, host: str | None = None, protocol: bool = True, settle_s: float = SETTLE_S
) -> HistoryCheck:
    """Replay the stream (all of it, or one host's two subjects) and compare with S3; an object S3 holds ahead of
    the stream is read again with its subject's new events for ``settle_s`` (module doc). With ``protocol``,
    every transition is also checked against the protocol's tables, K3, K4 and K8
    (:class:`services.ledger.protocol.ProtocolCheck`); its findings join the audit's."""
    from services.ledger.protocol import ProtocolCheck

    check = HistoryCheck()
    subjects = [ledger_subject("claim", host), ledger_subject("record", host)] if host else [None]
    messages = []
    for subject in subjects:
        async for msg in events.replay(LEDGER_STREAM, subject=subject):
            check.feed(msg)
            messages.append(msg)
    objects: set[tuple[str, str]] = set(check.tracks)
    if host is not None:
        objects |= {("claim", host), ("record", host)}
    else:
        from urllib.parse import unquote

        for obj, prefix in (("claim", "control/hosts/"), ("record", "control/records/")):
            for key in await ledger.store.list_keys(ledger.bucket, prefix):
                if key.endswith(".json") and "/" not in key[len(prefix) :]:
                    objects.add((obj, unquote(key[len(prefix) : -len(".json")])))
    loop = asyncio.get_running_loop()
    deadline = loop.time() + settle_s  # one wait for the whole audit, however many objects are on their way
    for obj, name in sorted(objects):
        while True:
            try:
                cur = await ledger.read(obj, name)  # type: ignore[arg-type]
            except DurableValueError as exc:
                check.findings.append(Finding("error", obj, name, f"the object in S3 fails the boundary: {exc}"))
                break
            except StoreError as exc:
                check.findings.append(Finding("error", obj, name, f"the object could not be read: {exc}"))
                if isinstance(exc, StoreUnavailable):
                    check.unavailable.append(f"{obj} {name}")
                break
            gen = cur.state.gen if cur.state is not None else None
            if check.behind(obj, name, gen):  # the subject's events since the replay, then the gens again
                async for msg in events.replay(LEDGER_STREAM, start_seq=check.last_seq(obj, name) + 1,
                                               subject=ledger_subject(obj, name)):
                    check.feed(msg)
                    messages.append(msg)
            if gen is not None and check.last_gen(obj, name) != gen and loop.time() < deadline:
                await asyncio.sleep(0.25)  # the publish that follows the CAS, or the relay's; or the store moved on
                continue
            check.compare(obj, name, cur.body if cur.state is not None else None, gen, settle_s)
            break
    if protocol:
        rules = ProtocolCheck()
        for msg in sorted(messages, key=lambda m: m.seq):  # one host's two subjects, merged in stream order
            try:
                event = decode(msg.data, Transition)
            except DurableValueError:
                continue  # already reported by the history check
            rules.feed(event, msg.seq)
        check.findings.extend(Finding(f.severity, f.object, f.host, f.what) for f in rules.findings)
    return check


def verdict(check: HistoryCheck, *, host: str | None, strict: bool = False) -> tuple[Verdict, str]:
    """What ``hostmove audit`` concludes, and its last line: ``unavailable`` when the store could not be read
    (nothing is known, the history is not at fault), ``no-history`` when ``host`` has no event on the stream and
    no claim or record in the store (a name that is not a host here), else ``clean`` or ``not-clean``."""
    scope = f"host {host}" if host else "every host"
    if check.unavailable:
        return "unavailable", (f"audit of {scope}: the object store could not be read for "
                               f"{', '.join(check.unavailable[:4])}{' ...' if len(check.unavailable) > 4 else ''}; "
                               "nothing was audited. Try again once it answers")
    if host is not None and check.messages == 0 and check.present == 0 and not check.findings:
        return "no-history", (f"audit of host {host}: no events on the ledger stream and no claim or record in the "
                              f"store: {host} is not a host of this deployment (check the name and HOSTMOVE_BUCKET)")
    clean = check.clean(strict=strict)
    errors = sum(f.severity == "error" for f in check.findings)
    return ("clean" if clean else "not-clean"), (
        f"audit of {scope}: {check.messages} events, {len(check.tracks)} objects, {errors} errors: "
        f"{'clean' if clean else 'NOT clean'}")
