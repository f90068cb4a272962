"""What the target box observes of itself for its readiness report (spec §7.3 T1, T2, T3, T7, T8, T11, T13; issue 18).

The readiness report (:mod:`services.target.readiness`) assesses observations; this module makes the observations a
box cannot take from the staging lane alone, every one of them read, none asserted:

- **T1**: the protocol floor object ``control/moves-protocol.json`` (§11) against this box's moves protocol and its
  release (:func:`services.box.deployment.below_floor`).
- **T2**: this box's ``secrets_key_fp`` as the roster publishes it (written by ``hostmove box init``, §10) against
  the console's, the fingerprint published once when the deployment was initialized (``control/secrets-key.json``),
  and the key the box holds now against both (a key file replaced after the box was initialized).
- **T3**: the launch environment of the host's release as this box would compose it (rendered for this box, under its
  overlay: :meth:`services.apps.box.BoxApps.composed`), compared value by value with the source's HMAC launch report
  (:class:`services.source.report.Verifier`) by each variable's class: **equal** variables must match, **region**
  variables must differ, **layout** variables must be present on both sides. A mismatch names the variables, never a
  value. The launch inputs (the release and its digest) must match too.
- **T7**: the host's release staged on this box (fetched, verified by digest, its files written) and its command
  resolvable here.
- **T8**: this box is the one the door chose (``op.participants[1]``) and it is live in the roster (not fenced).
- **T11**: the rates (:class:`services.target.budget.Rates`) the box's rate source gives.
- **T13**: the box can land the move (its release renders, its spawns are strict) and roll it back (its journal is
  writable).

:func:`compare_environment` is the pure part of T3; :class:`TargetObserver` the runner.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from events.claim import Claim
from events.record import Record
from kernel import rules
from services.apps.box import APP_BUNDLE, BoxApps
from services.apps.manifest import SlotClass
from services.box.artifacts.sealing import PrivateKey, secrets_key_fp
from services.box.deployment import below_floor, box_release, read_floor
from services.box.instance.activator import AppUnavailable
from services.box.roster import DEFAULT_FLOOR, MOVES_PROTOCOL, read_deployment_key, read_roster
from services.objstore.port import ObjectStore
from services.source import report as launch_report
from services.target.budget import PRODUCTION_BUDGET, BudgetTiming, Rates
from services.target.readiness import BoxFacts

RateSource = Callable[[str], Awaitable[Rates | None]]
"""The rates for a cut from a source region into this box (:meth:`services.target.rates.RateProbe.rates`)."""


def compare_environment(mine: Mapping[str, str], classes: Mapping[str, SlotClass],
                        verifier: launch_report.Verifier) -> list[str]:
    """T3 (§7.3): each variable of the two composed environments by its class, as the operator reads it: the name
    and why, never a value. Pure (the verifier recomputes MACs)."""
    theirs = verifier.report.env
    out = []
    for name in sorted(set(mine) | set(theirs)):
        if name not in mine:
            out.append(f"{name} (only on the source)")
            continue
        if name not in theirs:
            out.append(f"{name} (only on this box)")
            continue
        kind = classes.get(name, "equal")
        if kind == "layout":
            continue
        same = verifier.env_equal(name, mine[name])
        if kind == "region" and same:
            out.append(f"{name} (the same in both regions, where it must differ)")
        elif kind == "equal" and not same:
            out.append(name)
    return out


def key_detail(box: str, have: str | None, want: str | None) -> str | None:
    """T2's sentence (§7.3, §10), or None when this box holds the deployment's key."""
    if want is None:
        return "the console holds no deployment secrets key (run hostmove deployment init)"
    if have is None:
        return f"{box} is not in the roster, so its secrets key is unknown"
    if have == "":
        return (f"{box} holds no secrets key, so it cannot open its instances' secrets; install the deployment's "
                "key with hostmove box init --secrets-key")
    if have != want:
        return (f"{box} holds the secrets key {have[:23]}..., not the deployment's {want[:23]}...; install the "
                "deployment's key with hostmove box init --secrets-key")
    return None


@dataclass
class TargetObserver:
    """The target box's observations (module doc). ``strict`` is the box tree's ``strict_available``."""

    label: str
    region: str
    store: ObjectStore
    bucket: str
    apps: BoxApps
    secrets_key: PrivateKey | None
    read_claim: Callable[[str], Awaitable[Claim | None]]
    read_record: Callable[[str], Awaitable[Record | None]]
    strict: Callable[[], tuple[bool, str]]
    rates: RateSource
    journal_dir: Path
    protocol: int = MOVES_PROTOCOL
    release: str = ""
    budget: BudgetTiming = PRODUCTION_BUDGET

    async def facts(self, host: str) -> BoxFacts:
        claim, record = await self.read_claim(host), await self.read_record(host)
        floor = await read_floor(self.store, self.bucket)
        console = await read_deployment_key(self.store, self.bucket)
        roster, _ = await read_roster(self.store, self.bucket)
        entry = roster.box(self.label) if roster is not None else None
        have = entry.secrets_key_fp if entry is not None else None
        want = console.fp if console is not None else None
        held = secrets_key_fp(self.secrets_key)
        t2 = key_detail(self.label, have, want)
        if t2 is None and held != have:  # the key file was replaced after the box was initialized
            t2 = key_detail(self.label, held, want) or (
                f"{self.label} holds the secrets key {held[:23]}..., not the one the roster publishes for it")
        below = below_floor(floor, protocol=self.protocol, release=self.release or box_release())
        # T7 and T3: the release staged and rendered here, its environment against the source's launch report.
        staged_ok, staged_detail = False, ""
        env_ok: bool | None = None
        env_detail = ""
        try:
            staged, env, classes = await self.apps.composed(claim)
            self.apps.command(staged, self.apps.slots(host, staged, 0))
            staged_ok = True
        except AppUnavailable as exc:
            staged_detail = str(exc)
            env_ok, env_detail = False, f"the release cannot be rendered here: {exc}"
        move = record.move if record is not None else None
        if staged_ok and move is not None:
            env_ok, env_detail = await self._environment(host, move.id, env, classes, staged.release.label,
                                                          staged.ref.digest, t2)
        # T8: the box the door chose, live in the roster.
        chosen = claim.op.participants[1] if claim is not None and len(claim.op.participants) == 2 else ""
        if chosen != self.label:
            hosting: tuple[str, ...] = (chosen,) if chosen else ()
            hosting_detail = f"the door chose {chosen or 'no box'} for this move, not {self.label}"
        elif entry is None or entry.fenced_at is not None:
            hosting, hosting_detail = (), f"{self.label} is not live in the roster"
        else:
            hosting, hosting_detail = (self.label,), ""
        strict_ok, strict_why = self.strict()
        journal_ok = _writable(self.journal_dir)
        return BoxFacts(
            protocol=self.protocol, protocol_floor=floor.min if floor is not None else DEFAULT_FLOOR,
            protocol_detail=below or "", console_secrets_key_fp=want,
            secrets_key_fp=have, key_detail=t2 or "", rates=await self.rates(self._source_region(claim, record)),
            environment_matches=env_ok,
            environment_detail=env_detail,
            release_staged=staged_ok, release_detail=staged_detail, hosting_boxes=hosting,
            hosting_detail=hosting_detail, window_s=self.budget.window_s, budget_timing=self.budget,
            landing_armed=staged_ok and strict_ok,
            rollback_target_armed=strict_ok and journal_ok,
            armed_detail="" if strict_ok and journal_ok else (strict_why if not strict_ok else
                                                              f"{self.journal_dir} is not writable"))

    @staticmethod
    def _source_region(claim: Claim | None, record: Record | None) -> str:
        move = record.move if record is not None else None
        if move is not None and move.from_:
            return move.from_
        return str(claim.op.intent.get("from", "")) if claim is not None else ""

    async def _environment(self, host: str, move_id: str, env: Mapping[str, str], classes: Mapping[str, SlotClass],
                           release: str, digest: str, t2: str | None) -> tuple[bool, str]:
        if t2 is not None and rules.on("readiness-key"):
            return False, "not compared: this box does not hold the deployment's secrets key (T2)"
        if self.secrets_key is None:
            return False, "not compared: this box holds no secrets key"
        try:
            report = await launch_report.read_report(self.store, self.bucket, host, move_id)
            verifier = launch_report.Verifier(report, self.secrets_key, host=host, move_id=move_id)
        except launch_report.ReportError as exc:
            return False, str(exc)
        differs = compare_environment(env, classes, verifier)
        inputs = [name for name, value in ((launch_report.RELEASE, release),
                                           (launch_report.BUNDLE_PREFIX + APP_BUNDLE, digest))
                  if not verifier.input_equal(name, value)]
        if inputs:
            return False, (f"the source launches another release than this box stages ({', '.join(inputs)} "
                           "differ)")
        if differs:
            return False, f"the launch environment differs from the source's in: {', '.join(differs)}"
        return True, ""


def _writable(path: Path) -> bool:
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(dir=path, prefix=".armed-")
        os.close(fd)
        os.unlink(name)
    except OSError:
        return False
    return True


__all__ = ["RateSource", "TargetObserver", "compare_environment", "key_detail"]
