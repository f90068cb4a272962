"""Every sentence an operator reads, in one place (spec §20; ARCHITECTURE §10).

The CLI and the API both speak through :func:`say`. Three families, all drafts pending the copy
review (§20: "None is approved"), none with an em dash:

- ``M-C1`` .. ``M-C18``, ``M-C21``, ``M-C22``: the spec's table (§20). The spec's ``<...>``
  placeholders were stripped in its text; they are restored here as named fields (``{host}``,
  ``{from_region}``, ``{to_region}``, ``{region}``, ``{box}``, ``{reason}``, ...). M-C18 is truncated
  in the spec and M-C21 and M-C22 have no text there: they are completed from §7.10, §7.1 and §13.
  The spec's ``carlos`` commands are this system's ``hostmove`` commands.
- ``M-R*``: the door's refusals that §20 does not word (§7.1, §11, §12; digest D§5.1).
- ``M-S*``: the door's answers and status lines that §20 does not word.

A value is inserted as text; never pass a secret (a token, a key) as a value.
"""

from __future__ import annotations

import string
from dataclasses import dataclass
from typing import Literal

Origin = Literal["spec", "restored", "door"]


@dataclass(frozen=True)
class Copy:
    """One sentence: its id, its text with ``{named}`` fields, and where the words come from."""

    id: str
    text: str
    origin: Origin

    @property
    def fields(self) -> frozenset[str]:
        return frozenset(name for _, name, _, _ in string.Formatter().parse(self.text) if name)


def _table(*rows: tuple[str, Origin, str]) -> dict[str, Copy]:
    table: dict[str, Copy] = {}
    for cid, origin, text in rows:
        if cid in table:
            raise ValueError(f"copy id {cid} is defined twice")
        table[cid] = Copy(cid, text, origin)
    return table


COPY: dict[str, Copy] = _table(
    # -- §20, placeholders restored --------------------------------------------------------------
    ("M-C1", "spec", "Moving {host} from {from_region} to {to_region}."),
    ("M-C2", "spec", "Copying data. {host} keeps serving while this runs."),
    ("M-C3", "spec", "Checking that {to_region} can run {host}."),
    ("M-C4", "spec", "{to_region} cannot take this move yet: {reason}."),
    ("M-C5", "spec", "{host} is ready. Starting the cut. {host} will be offline for about {estimate}."),
    ("M-C6", "spec", "Stopped in {from_region}. Starting in {to_region}."),
    ("M-C7", "spec", "Moved. {host} is served from {to_region}. It was offline for {seconds} seconds."),
    ("M-C8", "spec", "{to_region} could not start {host}: {reason}. Moving it back to {from_region}."),
    ("M-C9", "spec", "{host} is back in {from_region} and serving. Nothing was lost."),
    ("M-C10", "spec", "Waiting for {box} in {region} to confirm it has stopped {host}. {host} is offline."),
    ("M-C11", "spec",
     "{host} could not start in {to_region} or in {from_region}. It is offline. "
     "Run hostmove move resolve --host {host} --retry once the cause is fixed."),
    ("M-C12", "spec", "Ready to cut. Run hostmove move cut --host {host} when you are ready."),
    ("M-C13", "spec", "This move has started its cut. It will finish or move back on its own."),
    ("M-C14", "spec", "{host} keeps a file this move cannot copy: {path}. Only regular files and folders move."),
    ("M-C15", "spec",
     "{host} keeps more than 256 MiB of files beside its database. Keep large files in object storage."),
    ("M-C16", "spec", "{host} does not answer its readiness path. Declare moves.ready_path for this app."),
    ("M-C17", "spec", "{host} uses private storage. Instances with private storage cannot move yet."),
    # -- §20 truncated or without text: completed from §7.10, §7.1 (rev 7.20) and §13 --------------
    ("M-C18", "restored",
     "This declares {box} lost. Anything {host} wrote on {box} after {flipped_at} is lost, "
     "and {host} goes back to {from_region}."),
    ("M-C21", "restored",
     "{host} cannot move: {region} has more than one box, and moves into or out of a region with "
     "more than one box are not supported yet."),
    ("M-C22", "restored",
     "{host} is waiting for a box in {region} (relocating, pinning). Its data is kept in {region}'s "
     "storage and it recovers when a box joins; writes its lost box never uploaded may then be declared lost."),
    # -- the door's refusals (§7.1, §11, §12; D§5.1) ---------------------------------------------
    ("M-R1", "door", "Not found."),
    ("M-R2", "door", "There is no host named {host}."),
    ("M-R3", "door", "{host} is not a valid host name: {reason}."),
    ("M-R4", "door", "The request body is not valid: {reason}."),
    ("M-R5", "door", "The request has a field this door does not know: {field}. Allowed: {allowed}."),
    ("M-R6", "door", "The request needs {field}."),
    ("M-R7", "door", "cut must be auto or manual, not {value}."),
    ("M-R8", "door", "{host} is busy with another operation ({kind}). A move starts only while it is serving."),
    ("M-R9", "door", "{host} is already in {region}. Pick another region."),
    ("M-R10", "door", "{region} is not a region of this deployment. Regions: {regions}."),
    ("M-R11", "door", "{region} has no box that can take {host} now."),
    ("M-R12", "door",
     "{box} in {region} speaks moves protocol {have}, below the floor {floor}. Upgrade it before moving {host}."),
    ("M-R13", "door",
     "This console speaks moves protocol {have}, below the floor {floor}. Upgrade the console first."),
    ("M-R14", "door", "{host} runs on {box}, which is not in the roster. Register the box before moving {host}."),
    ("M-R15", "door", "The record of {host} still holds move {move_id}. Wait for it to close."),
    ("M-R16", "door", "The record of {host} belongs to another incarnation. Nothing was changed."),
    ("M-R17", "door", "{host} kept changing while this request ran. Nothing was changed; try again."),
    ("M-R18", "door", "{what} could not be read, so nothing was changed. Try again in a moment."),
    ("M-R19", "door", "{host} has no move in progress."),
    ("M-R20", "door", "{host} is not ready to cut yet (the move is {state}). Wait for: Ready to cut."),
    ("M-R21", "door", "This move cuts on its own once it is ready. There is nothing to request."),
    ("M-R22", "door", "This move is being aborted. It cannot be cut."),
    ("M-R23", "door", "{box} is not in the roster. Run hostmove box init for it first."),
    ("M-R24", "door", "{host} already exists ({kind}). Nothing was changed."),
    ("M-R25", "door", "{host} was not created: {reason}"),
    ("M-R26", "door", "{host} is busy with move {move_id} to {to_region}. Abort it, or wait for it to finish."),
    ("M-R27", "door",
     "{host} still has {count} cleanup chores from an earlier operation. A move starts once they are done."),
    ("M-R28", "door",
     "The claim and the record of {host} disagree about move {move_id}. Nothing was changed; "
     "the recovery pass settles this."),
    ("M-R29", "door", "Unknown query parameter {name}. Allowed: {allowed}."),
    ("M-R38", "door", "The query parameter {name} is not valid: {reason}."),
    ("M-R30", "door", "{what} is unreadable, so nothing was changed. Fix it and try again."),
    ("M-R31", "door",
     "The door hit an internal error. Its log has the details; repeating the request is safe and shows "
     "where it stands."),
    ("M-R32", "door", "This path does not take {method}. Allowed: {allowed}."),
    ("M-R33", "door", "The request body is larger than {limit} bytes."),
    # the ways out of a held state (§7.10, issue 13)
    ("M-R50", "door",
     "{host} is not stuck (the move is {state}). resolve --retry reruns the probe of a stuck move's recovery only."),
    ("M-R51", "door",
     "{host} is busy with {kind} {op_id}. A failed start is cleared once the host serves again."),
    ("M-R52", "door", "{host} is {kind}, not serving, so there is no failed start to clear."),
    ("M-R34", "door",
     "{host} runs on {box}, which was fenced (gone for good). It is being relocated to a replacement box in {region}; "
     "move it once it serves there."),
    ("M-R35", "door", "{box} was fenced (gone for good). Create {host} on a live box of {region}."),
    ("M-R36", "door",
     "The event stream (NATS) cannot be reached, so nothing was changed. Try again once it is back: the door "
     "reconnects on its own."),
    ("M-R37", "door",
     "The object store (S3) did not answer about {what}. Try again once it is back: repeating the request is safe "
     "and shows where it stands."),
    # boxes that are gone: --declare-lost (§7.10, issue 15)
    ("M-R70", "door",
     "{box} is not a participant of move {move_id} of {host} (its source is {source}, its target {target}). "
     "Nothing was changed."),
    ("M-R71", "door",
     "{box} is the source of move {move_id} of {host}, and a source is never declared lost: before the flip a "
     "terminated source is fenced (hostmove box fence), after it {host} runs on the target. Nothing was changed."),
    ("M-R72", "door",
     "Move {move_id} of {host} was committed, so {host} belongs to {box} now and the move cannot declare it lost. "
     "Fence {box} (hostmove box fence) and {host} is relocated. Nothing was changed."),
    ("M-R73", "door",
     "Move {move_id} of {host} has not flipped (it is {state}), so {box} holds nothing of {host} yet. Abort the move "
     "instead. Nothing was changed."),
    ("M-R74", "door",
     "{box} owes {host} nothing this move waits for (its release is at {phase}). Nothing was changed."),
    ("M-R75", "door",
     "The platform shows {box} {status}, so it cannot be declared lost: only a stopped or terminated box can be. "
     "Stop it first (hostmove box stop --label {box}). Nothing was changed."),
    ("M-R76", "door", "{box} is already declared lost for {host}. Nothing was changed."),
    ("M-R77", "door",
     "Declaring {box} lost needs your confirmation of what is lost: {sentence} Nothing was changed; run it again "
     "with --yes to confirm."),
    ("M-S11", "door",
     "{box} is declared lost. {host} goes back to {from_region} and serves there once its recovery opens; the writes "
     "declared lost are in its admission's writes_lost."),
    ("M-S12", "door", "{box} also released {host} with writes it never returned; they are lost with it."),
    ("M-S13", "door",
     "{box}, the target of move {move_id} of {host}, was fenced (gone for good) after the move committed. The move "
     "closes without it, and {host} is relocated to a live box of {region}; anything {host} wrote on {box} after its "
     "last upload is declared lost."),
    # -- apps and their releases (issue 18) ----------------------------------------------------------
    ("M-R43", "door", "There is no app named {app}, so {host} was not created. Publish it with hostmove app publish."),
    ("M-R44", "door", "{app} has no release {release} (its newest is {newest}). Nothing was changed."),
    ("M-R41", "door",
     "{host} keeps a sidecar environment file ({file}), which a move cannot carry. Fold it into the app's release "
     "first."),
    ("M-R42", "door",
     "{host} runs {release}, which sets the registry columns {columns}; a move does not carry them. Publish a "
     "release without them first."),
    # -- the door's answers and status lines ------------------------------------------------------
    ("M-S1", "door", "Cut requested for {host}. The source starts it once its checks are fresh."),
    ("M-S2", "door",
     "Abort recorded for {host}. It keeps serving in {from_region}; the move closes once its staging is retired."),
    ("M-S3", "door", "Created {host} on {box} in {region}."),
    ("M-S4", "door", "{host} is ready. The cut starts on its own."),
    ("M-S5", "door", "The last move of {host} ({move_id}) ended: {outcome}."),
    ("M-S6", "door", "{host} is serving on {box}. No move is in progress."),
    ("M-S7", "door", "{host} is {kind} ({phase})."),
    ("M-S8", "door",
     "The cut of {host} did not finish in time: {reason}. Moving it back to {from_region}, where it serves again "
     "once its recovery opens."),
    ("M-S9", "door", "Retry recorded for {host}: its recovery in {from_region} runs its probe again."),
    ("M-S10", "door",
     "Clearing the failed start of {host} on {box}: the box clears it and starts {host} again."),
)


class CopyError(Exception):
    """A programming error: an unknown id, or values that do not fit the sentence."""


def say(copy_id: str, /, **values: object) -> str:
    """The sentence ``copy_id`` with its fields filled. Every field must be given, and nothing else."""
    entry = COPY.get(copy_id)
    if entry is None:
        raise CopyError(f"no operator copy with id {copy_id}")
    given = set(values)
    missing, extra = entry.fields - given, given - entry.fields
    if missing or extra:
        raise CopyError(
            f"copy {copy_id} needs {sorted(entry.fields)}; missing {sorted(missing)}, unexpected {sorted(extra)}"
        )
    return entry.text.format(**{k: str(v) for k, v in values.items()})


__all__ = ["COPY", "Copy", "CopyError", "say"]
