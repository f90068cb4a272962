"""Bad objects, contained (issue 14 item 6): a claim or record that is never state, reported once per version.

A :class:`~services.ledger.ledger.BadObject` (too large, changed outside the ledger, failing its decoding) stops
nothing but its own host: the reader skips that host and carries on with every other. The operator hears of it once
per version of the object, whoever saw it and however often it restarted since: the alert ``hm.alert.bad-object``
is raised only when the create-only marker ``alerts/bad-objects/<key>/<etag>.json`` in the deployment bucket does
not exist yet, and the marker is written right after it. A version fixed and broken again is a new ETag and alerts
again. Two boxes that see the same version at once both publish with the same ``Nats-Msg-Id`` (the stream keeps
one); a crash between the publish and the marker, outside the stream's duplicate window, alerts twice at worst
(an alert is never lost for a marker written first). The set in memory only spares the bucket a HEAD per scan.
"""

from __future__ import annotations

import hashlib
import logging
from urllib.parse import quote

from bus.facts import Fact, publish_alert
from bus.log import EventLog, LogError
from events.base import canonical
from events.envelope import Actor
from kernel.logctx import ctx
from kernel.ports import Clock
from services.ledger.ledger import BadObject
from services.objstore.port import Got, ObjectStore, StoreError

log = logging.getLogger("hostmove.ledger")

ALERT_KIND = "bad-object"
MARKERS_PREFIX = "alerts/bad-objects/"
MAX_REASON_CHARS = 300


def marker_key(key: str, etag: str) -> str:
    """``alerts/bad-objects/<key, percent-encoded>/<etag>.json``: one per version of a bad object."""
    return f"{MARKERS_PREFIX}{quote(key, safe='')}/{quote(etag.strip(chr(34)), safe='')}.json"


def alert_id(key: str, etag: str) -> str:
    return hashlib.sha256(f"{key}\n{etag}".encode()).hexdigest()[:32]


class BadObjects:
    """One deployment's bad-object alerts (see the module doc); ``by`` names the reader (a box label, ``door``)."""

    def __init__(self, store: ObjectStore, bucket: str, events: EventLog, actor: Actor, clock: Clock, *,
                 by: str) -> None:
        self.store, self.bucket, self.events, self.actor, self.clock, self.by = store, bucket, events, actor, clock, by
        self._known: set[tuple[str, str]] = set()

    async def report(self, bad: BadObject) -> bool:
        """Skip-and-tell: log the first sighting in this process and raise the alert unless its marker exists.
        Answers whether this call raised it. A store or bus failure is logged and tried again at the next sighting
        (the marker is written only once the alert is on the stream)."""
        seen = (bad.key, bad.etag)
        if seen in self._known:
            return False
        log.error("the %s of %s (%s, ETag %s) is skipped: %s: %s; it is never taken as state, every other host "
                  "carries on", bad.obj, bad.host, bad.key, bad.etag, bad.limit, bad.reason[:MAX_REASON_CHARS],
                  extra=ctx(host=bad.host, phase="bad-object", reason=bad.limit, key=bad.key, etag=bad.etag))
        marker = marker_key(bad.key, bad.etag)
        fact = Fact(kind=ALERT_KIND, subject=bad.host, id=alert_id(bad.key, bad.etag), actor=self.actor,
                    at=self.clock.now_ms(), payload={
                        "object": bad.obj, "key": bad.key, "etag": bad.etag, "size": bad.size, "limit": bad.limit,
                        "reason": bad.reason[:MAX_REASON_CHARS], "seen_by": self.by, "marker": marker})
        try:
            if isinstance(await self.store.head(self.bucket, marker), Got):
                self._known.add(seen)
                return False
            await publish_alert(self.events, fact)
            await self.store.put(self.bucket, marker, canonical(fact), if_none_match=True)  # Lost: another's
        except (StoreError, LogError) as exc:
            log.warning("the alert for the bad %s of %s is not raised yet: %s", bad.obj, bad.host, exc,
                        extra=ctx(host=bad.host, phase="bad-object", reason=exc, key=bad.key))
            return False
        self._known.add(seen)
        return True


__all__ = ["ALERT_KIND", "MARKERS_PREFIX", "BadObjects", "alert_id", "marker_key"]
