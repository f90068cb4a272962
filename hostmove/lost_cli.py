"""The operator's commands for boxes that are gone (spec §7.10; issue 15).

    hostmove box stop --label L                      the platform stops the box's compute (cgroup.kill, or EC2)
    hostmove box fence --label L --terminated        the termination fence, once the platform shows it terminated
    hostmove box readmit --label L                   a box declared lost, quarantined since: eligible again
    hostmove move resolve --host H --declare-lost B  a move's target that is gone (M16, M-C18; --yes confirms)

The platform is the compute port (:mod:`services.box.compute`), chosen by ``HOSTMOVE_COMPUTE``: ``local`` (the
default: this machine's cgroup v2 subtrees and the platform records under ``<root>/platform/``) or ``aws`` (EC2 in
the region and account the roster records for the box, with the operator's AWS credentials; ``HOSTMOVE_EC2_ENDPOINT``
names another EC2 endpoint). On ``local`` the platform is this machine, so ``box fence --terminated`` terminates
the box's machine first (kills its subtree and records it terminated); on ``aws`` the operator terminates the
instance in EC2 and the fence only reads it.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from events.copy import say
from hostmove import exitcodes
from hostmove.runtime import ConfigError, Runtime, Settings, load_settings, open_runtime
from services.box.compute import (
    EVIDENCE_STATES,
    BoxCompute,
    ComputeRefused,
    ComputeState,
    ComputeUnavailable,
    LocalCompute,
)

ENV_COMPUTE = "HOSTMOVE_COMPUTE"
ENV_EC2_ENDPOINT = "HOSTMOVE_EC2_ENDPOINT"


async def compute_port(settings: Settings, rt: Runtime) -> ComputeState:
    """The platform this deployment's boxes run on (module docstring)."""
    kind = os.environ.get(ENV_COMPUTE, "local")
    if kind == "aws":
        from services.box.compute_aws import AwsCompute

        return AwsCompute(endpoint_url=os.environ.get(ENV_EC2_ENDPOINT) or None)
    if kind != "local":
        raise ConfigError(f"{ENV_COMPUTE} is {kind!r}: it is local or aws")
    from services.box.roster import ensure_deployment

    deployment = await ensure_deployment(rt.store, settings.bucket, rng=rt.rng, clock=rt.clock)
    return LocalCompute(settings.root, deployment, clock=rt.clock)


async def roster_compute(rt: Runtime, bucket: str, label: str) -> BoxCompute | None:
    from services.box.roster import read_roster

    roster, _ = await read_roster(rt.store, bucket)
    entry = roster.box(label) if roster is not None else None
    return BoxCompute.of(entry) if entry is not None else None


async def box_stop(args: argparse.Namespace) -> int:
    """``hostmove box stop --label L``: the platform stops the box (its compute, not its agent's say)."""
    settings = load_settings(Path(args.root))
    rt = await open_runtime(settings, "cli", probe=False)
    try:
        return await stop_box(rt, args.label)
    finally:
        await rt.close()


async def stop_box(rt: Runtime, label: str) -> int:
    """:func:`box_stop` on an open runtime (the rehearsal's too)."""
    try:
        box = await roster_compute(rt, rt.settings.bucket, label)
        if box is None:
            print(f"box {label} was not stopped: it is not in the roster", file=sys.stderr)
            return exitcodes.REFUSED
        seen = await (await compute_port(rt.settings, rt)).stop(box)
    except ComputeRefused as exc:
        print(f"box {label} was not stopped: {exc}", file=sys.stderr)
        return exitcodes.REFUSED
    except ComputeUnavailable as exc:
        print(f"hostmove: {exc}; nothing was concluded. Try again once the platform answers", file=sys.stderr)
        return exitcodes.UNAVAILABLE
    print(f"box {label} is {seen.status}: {seen.evidence}")
    return exitcodes.OK


async def box_fence(args: argparse.Namespace) -> int:
    """``hostmove box fence --label L --terminated``: the fence record once the platform shows the box terminated
    (:func:`services.box.fence.fence_box`), then the roster entry; the recovery service relocates its hosts."""
    if not args.terminated:
        print(f"box {args.label} was not fenced: fencing kills every process of the box and it never acts or "
              "registers again; pass --terminated to confirm", file=sys.stderr)
        return exitcodes.USAGE
    settings = load_settings(Path(args.root))
    rt = await open_runtime(settings, "cli", probe=False)
    try:
        return await fence_terminated(rt, args.label)
    finally:
        await rt.close()


async def fence_terminated(rt: Runtime, label: str) -> int:
    """:func:`box_fence` on an open runtime (the rehearsal's too), once the operator confirmed ``--terminated``."""
    from services.box.fence import FenceRefused, fence_box
    from services.box.roster import RosterRefusal

    try:
        port = await compute_port(rt.settings, rt)
        box = await roster_compute(rt, rt.settings.bucket, label)
        if isinstance(port, LocalCompute) and box is not None:
            await port.terminate(box)  # this machine is the platform: the operator's terminate, then the fence reads it
        fence, ref = await fence_box(store=rt.store, bucket=rt.settings.bucket, events=rt.events, clock=rt.clock,
                                     actor=rt.actor, label=label, compute=port)
    except (FenceRefused, RosterRefusal, ComputeRefused) as exc:
        print(f"box {label} was not fenced: {exc}", file=sys.stderr)
        return exitcodes.REFUSED
    except ComputeUnavailable as exc:
        print(f"hostmove: {exc}; nothing was fenced. Try again once the platform answers", file=sys.stderr)
        return exitcodes.UNAVAILABLE
    print(f"box {fence.label} ({fence.region}) is fenced: {fence.evidence}. Its hosts relocate to a box of region "
          f"{fence.region} once one is enrolled (fence {ref.key}, sha256 {ref.sha256[:12]})")
    return exitcodes.OK


def add_declare_lost(resolve: Any) -> None:
    """``hostmove move resolve --host H --declare-lost BOX [--yes]`` (its runner: :func:`run_declare_lost`)."""
    resolve.add_argument("--declare-lost", metavar="BOX", help="a participant that is gone: the platform must show "
                         "it stopped or terminated; its writes since the flip are lost (§7.10)")
    resolve.add_argument("--yes", action="store_true", help="confirm what --declare-lost says is lost (scripts)")


async def run_declare_lost(args: argparse.Namespace, door: Any, out: TextIO, err: TextIO,
                           not_ok: Callable[[Any, TextIO], int]) -> int:
    """Ask the platform first (the operator's credentials), then the door; the M-C18 confirmation, asked on a
    terminal and given by ``--yes``. A running box is refused here and nothing is sent. ``not_ok`` answers a door
    reply that did not carry the request out (the move CLI's)."""
    box_label = args.declare_lost
    given: Runtime | None = getattr(args, "runtime", None)  # the rehearsal's own, already open
    try:
        rt = given or await open_runtime(load_settings(Path(args.root)), "cli", probe=False)
    except ConfigError as exc:
        print(f"hostmove move resolve: {exc}", file=err)
        return exitcodes.USAGE
    settings = rt.settings
    try:
        box = await roster_compute(rt, settings.bucket, box_label)
        if box is None:
            print(say("M-R23", box=box_label), file=err)
            return exitcodes.REFUSED
        seen = await (await compute_port(settings, rt)).observe(box)
    except ComputeRefused as exc:
        print(f"{box_label} was not declared lost: {exc}. Nothing was changed.", file=err)
        return exitcodes.REFUSED
    except ComputeUnavailable as exc:
        print(f"hostmove: {exc}; nothing was sent. Try again once the platform answers", file=err)
        return exitcodes.UNAVAILABLE
    finally:
        if given is None:
            await rt.close()
    if seen.status not in EVIDENCE_STATES:
        print(say("M-R75", box=box_label, status=seen.status), f"({seen.evidence})", file=err)
        return exitcodes.REFUSED
    compute = {"status": seen.status, "evidence": seen.evidence}
    reply = await door.declare_lost(args.host, box_label, compute, confirmed=bool(args.yes))
    if not reply.ok and reply.body.get("error") == "confirm":
        sentence = str(reply.body.get("confirm", ""))
        if not sys.stdin.isatty():
            print(reply.reason, file=err)
            return exitcodes.REFUSED
        print(sentence, file=out)
        answer = input(f"Type {box_label} to declare it lost: ").strip()
        if answer != box_label:
            print(f"{box_label} was not declared lost. Nothing was changed.", file=err)
            return exitcodes.REFUSED
        reply = await door.declare_lost(args.host, box_label, compute, confirmed=True)
    if not reply.ok:
        return int(not_ok(reply, err))
    print(str(reply.body.get("message", "")), file=out)
    return exitcodes.OK


async def box_readmit(args: argparse.Namespace) -> int:
    """``hostmove box readmit --label L`` (operator-only): the box off the ``lost`` list of every host it was declared
    lost for, each only once the box retired its local state of it (:func:`services.box.quarantine.
    decide_readmit_claim`). A fenced box is never readmitted."""
    from services.box.quarantine import readmit
    from services.box.roster import read_roster

    label = args.label
    settings = load_settings(Path(args.root))
    rt = await open_runtime(settings, "cli", probe=False)
    try:
        roster, _ = await read_roster(rt.store, settings.bucket)
        entry = roster.box(label) if roster is not None else None
        if entry is None:
            print(f"box {label} was not readmitted: it is not in the roster", file=sys.stderr)
            return exitcodes.REFUSED
        if entry.fenced_at is not None:
            print(f"box {label} was not readmitted: it was fenced (its machine was terminated), and a terminated "
                  "enrollment is never readmitted; enroll a replacement under a new label", file=sys.stderr)
            return exitcodes.REFUSED
        done = await readmit(rt.ledger, label)
    finally:
        await rt.close()
    readmitted, refused = done.readmitted, done.refused
    for why in refused:
        print(f"box {label}: {why}", file=sys.stderr)
    if not readmitted and not refused:
        print(f"box {label} was not readmitted: no host lists it lost; there is nothing to readmit", file=sys.stderr)
        return exitcodes.REFUSED
    if readmitted:
        print(f"box {label} is readmitted for {', '.join(readmitted)}: it may be chosen for them again")
    return exitcodes.REFUSED if refused else exitcodes.OK


async def run_box(args: argparse.Namespace) -> int:
    return await {"stop": box_stop, "fence": box_fence, "readmit": box_readmit}[args.box_action](args)


def add_box_parsers(box_actions: Any) -> None:
    """The ``hostmove box`` verbs of this module (``fence`` is registered in :mod:`hostmove.cli`)."""
    st = box_actions.add_parser("stop", help="the platform stops a box's compute (evidence for --declare-lost)")
    st.add_argument("--box", "--label", dest="label", required=True, help="the box's label")
    ra = box_actions.add_parser("readmit", help="a box declared lost that quarantined itself: eligible again")
    ra.add_argument("--box", "--label", dest="label", required=True, help="the box's label")


BOX_ACTIONS = ("stop", "fence", "readmit")

__all__ = ["BOX_ACTIONS", "ENV_COMPUTE", "ENV_EC2_ENDPOINT", "add_box_parsers", "add_declare_lost", "box_fence",
           "box_readmit", "box_stop", "compute_port", "fence_terminated", "roster_compute", "run_box",
           "run_declare_lost", "stop_box"]
