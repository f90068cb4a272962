"""The box agent's backstop: its periodic look at every claim, at the cost of what changed (issue 19 item 2).

Events wake a box for its work; the look every ``scan_s`` catches what an event missed. It LISTs the claims prefix
(ListObjectsV2: 1,000 keys and their ETags a request) and GETs only the claims whose ETag differs from the one it
last read (:func:`plan`, pure); an unchanged claim is the value read before. So a period costs ``ceil(claims /
1000)`` LISTs and one GET per claim changed since the last look, whichever box it names (a claim is read to know
which box it names), instead of a GET of every claim in the deployment.

What is kept is a hint only: every pass reads its host's claim fresh before it acts (K5), so a stale entry costs at
most one period's delay, never a wrong step. A claim that is never state (:class:`BadObject`) is reported once per
version and kept as such until its ETag changes.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from urllib.parse import unquote

from events.claim import Claim
from services.ledger.ledger import BadObject, Ledger
from services.objstore.port import ObjectEntry, ObjectStore

CLAIMS_PREFIX = "control/hosts/"


@dataclass(frozen=True)
class Seen:
    """A claim as last read: the ETag of that read and the state (None: no claim, or a bad object)."""

    etag: str | None
    claim: Claim | None
    bad: bool = False


@dataclass(frozen=True)
class Plan:
    """What a look does with a listing (:func:`plan`): the hosts to GET, the hosts whose last read stands."""

    read: tuple[str, ...]
    kept: tuple[str, ...]


def host_of(key: str) -> str | None:
    """The host a key of the claims prefix names (``control/hosts/<quoted host>.json``), None for another key."""
    if not key.startswith(CLAIMS_PREFIX) or not key.endswith(".json") or "/" in key[len(CLAIMS_PREFIX):]:
        return None
    return unquote(key[len(CLAIMS_PREFIX):-len(".json")])


def plan(listing: list[ObjectEntry], seen: dict[str, Seen]) -> Plan:
    """GET what is new or whose ETag changed; keep the rest. Pure."""
    read: list[str] = []
    kept: list[str] = []
    for entry in listing:
        host = host_of(entry.key)
        if host is None:
            continue
        last = seen.get(host)
        if last is not None and entry.etag is not None and last.etag == entry.etag:
            kept.append(host)
        else:
            read.append(host)
    return Plan(tuple(read), tuple(kept))


class ClaimScan:
    """The look (see the module doc). One per agent; what it keeps is its own."""

    def __init__(self, store: ObjectStore, bucket: str, ledger: Ledger,
                 report_bad: Callable[[BadObject], Awaitable[object]]) -> None:
        self.store, self.bucket, self.ledger, self.report_bad = store, bucket, ledger, report_bad
        self.seen: dict[str, Seen] = {}

    async def look(self) -> dict[str, Claim]:
        """Every claim in the deployment (a bad one left out), GETting only what changed since the last look."""
        listing = await self.store.list_entries(self.bucket, CLAIMS_PREFIX)
        todo = plan(listing, self.seen)
        listed = set(todo.read) | set(todo.kept)
        for host in [h for h in self.seen if h not in listed]:  # deleted since
            del self.seen[host]
        for host in todo.read:
            try:
                current = await self.ledger.read_claim(host)
            except BadObject as bad:  # this host only: every other claim is read on (issue 14 item 6)
                await self.report_bad(bad)
                self.seen[host] = Seen(bad.etag, None, bad=True)
                continue
            self.seen[host] = Seen(current.etag, current.state)
        return {h: s.claim for h in sorted(listed) if (s := self.seen.get(h)) is not None and s.claim is not None}


__all__ = ["CLAIMS_PREFIX", "ClaimScan", "Plan", "Seen", "host_of", "plan"]
