"""Markers and the start check (spec §5.1 "Markers" and "The start check", INV-4; digest D§6).

Three markers, all protocol metadata (excluded from archives and digests; absent means origin):

- ``generation.json`` in the bucket, beside ``lock.json`` in the holder's location, written
  **conditionally**: If-Match the marker it supersedes, or If-None-Match when there is none (model 29);
- ``<host>.gen`` beside the local database: the generation's name, plain text, one line;
- ``.files-gen`` inside the files directory, ``{"op", "incarnation"}``, written **last**.

The start check is pure (:func:`start_check`); reading and writing the markers is the shell.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from events.base import Durable, Ident, Millis, canonical, decode
from events.claim import Admission, Claim
from events.durable import DurableValueError
from kernel import rules
from kernel.fsutil import atomic_write
from services.objstore.port import Got, Lost, ObjectStore, Won

ORIGIN = ""
"""The origin generation's name (legacy ``@root`` is the same origin)."""


class GenerationMarker(Durable, frozen=True):
    """``generation.json``: the pinned root of an installed generation (§5.1 markers table)."""

    __durable_root__ = True

    op: str
    incarnation: Ident
    host: Ident
    box: Ident
    installed_at: Millis
    manifest_sha256: str = ""
    snapshot_key: str = ""
    snapshot_version: str = ""
    snapshot_txid: int = 0
    snapshot_crc64: str = ""


class FilesGen(Durable, frozen=True):
    """``.files-gen``: which installation the files directory belongs to."""

    op: str
    incarnation: Ident


def normalize(generation: str) -> str:
    return ORIGIN if generation in ("", "@root") else generation


def marker_key(location: str) -> str:
    return f"{location.rstrip('/')}/generation.json"


# -- the start check (pure) -----------------------------------------------------------------------


@dataclass(frozen=True)
class Ready:
    """Every marker names what the claim expects: start on the local database."""


@dataclass(frozen=True)
class RestoreCold:
    """The local database is from another stay (or absent): park it and restore cold."""

    reason: str


@dataclass(frozen=True)
class Refused:
    """A mismatch: the start refuses with a member-safe reason, and pages."""

    reason: str


def admission_chain(claim: Claim) -> list[str]:
    """``holder.generation`` and the predecessors a lagging ``generation.json`` may still name:
    walk the admissions newest first while each names the current link (§5.1 step 9)."""
    assert claim.holder is not None
    link = normalize(claim.holder.generation)
    chain = [link]
    for adm in reversed(claim.holder.admissions):
        if normalize(adm.generation) != link or adm.predecessor is None:
            continue
        link = normalize(adm.predecessor.generation)
        if link in chain:
            break
        chain.append(link)
    return chain


def cold_predecessor(claim: Claim) -> str | None:
    """The generation the newest cold admission into ``holder.generation`` was restored from."""
    assert claim.holder is not None
    current = normalize(claim.holder.generation)
    for adm in reversed(claim.holder.admissions):
        if normalize(adm.generation) == current and adm.mode == "cold" and adm.predecessor is not None:
            pred = normalize(adm.predecessor.generation)
            if pred != current:  # warm self-links skipped
                return pred
    return None


def _cold_admission_into(claim: Claim, generation: str) -> Admission | None:
    assert claim.holder is not None
    for adm in reversed(claim.holder.admissions):
        if normalize(adm.generation) == generation and adm.mode == "cold" and adm.predecessor is not None:
            if normalize(adm.predecessor.generation) != generation:  # warm self-links skipped
                return adm
    return None


def files_generations(claim: Claim, box: str | None = None) -> frozenset[str]:
    """The generations whose ``.files-gen`` tag rule 2 of the start check accepts (§5.1): ``holder.generation``
    and its cold predecessor; and, for the box ``box``, every generation of its current **stay**, the unbroken run
    of cold admissions on this box back from ``holder.generation``, with the predecessor the run began from.

    The run is this document's reading, not the spec's words (which name the cold predecessor only): the files are
    retagged after a start completes, so two failed starts in a row (a store outage at a host's first wake) leave
    the tag two links back, and the strict reading then refuses every later start of a host whose only copy of its
    files is that directory (no manifest was ever published): stuck with no human (INV-3). Within one run on one
    box no other writer existed, and the directory is the one the failed starts' apps used; an earlier stay (a move
    away and back) is broken by the other box's admission and still refused."""
    holder = claim.holder
    assert holder is not None
    current = normalize(holder.generation)
    accepted = {current}
    pred = cold_predecessor(claim)
    if pred is not None:
        accepted.add(pred)
    link, walked = current, set()
    while box is not None and link != ORIGIN and link not in walked:
        walked.add(link)
        adm = _cold_admission_into(claim, link)
        if adm is None or adm.box != box or adm.predecessor is None:
            break
        link = normalize(adm.predecessor.generation)
        accepted.add(link)
    return frozenset(accepted)


def start_check(
    claim: Claim,
    bucket_marker: GenerationMarker | None,
    files_gen: FilesGen | None,
    files_dir_exists: bool,
    local_gen: str | None,
    *,
    box: str | None = None,
) -> Ready | RestoreCold | Refused:
    """Before every spawn (``Start``, ``Seed``, ``ProbeWake``): §5.1 "The start check" rules 1 to 3 (rule 2 over
    :func:`files_generations` of ``box``)."""
    holder = claim.holder
    if holder is None:
        return Refused("this host has no holder, so nothing may start")
    expected = normalize(holder.generation)
    # 1. generation.json names the generation the claim expects (a lagging one through admissions),
    #    with the holder's incarnation.
    named = normalize(bucket_marker.op) if bucket_marker is not None else ORIGIN
    if named not in admission_chain(claim):
        return Refused(f"the replica marker names generation {named or 'origin'}, not {expected or 'origin'}")
    if bucket_marker is not None and bucket_marker.incarnation != holder.incarnation:
        return Refused("the replica marker belongs to another incarnation of this host")
    # 2. .files-gen, when the files directory exists: the holder's incarnation and holder.generation
    #    or its cold predecessor.
    if files_dir_exists:
        if files_gen is None:
            files_op, files_inc = ORIGIN, holder.incarnation
        else:
            files_op, files_inc = normalize(files_gen.op), files_gen.incarnation
        if files_inc != holder.incarnation:
            return Refused("the files on this box belong to another incarnation of this host")
        if files_op not in files_generations(claim, box):
            return Refused(f"the files on this box are from generation {files_op or 'origin'}, "
                           f"not {expected or 'origin'}")
    # 3. <host>.gen names it exactly; otherwise the warm database is from an earlier stay.
    if local_gen is None:
        return RestoreCold("no local database")
    if normalize(local_gen) != expected:
        return RestoreCold(f"the local database is from generation {local_gen or 'origin'}")
    return Ready()


# -- the shell ------------------------------------------------------------------------------------


def write_local_gen(db_path: Path, generation: str) -> None:
    """``<host>.gen`` beside the database: the name, one line (written after a restore completes)."""
    atomic_write(db_path.with_suffix(".gen"), (normalize(generation) + "\n").encode())


def read_local_gen(db_path: Path) -> str | None:
    """The local generation, or None when there is no local database."""
    if not db_path.exists():
        return None
    marker = db_path.with_suffix(".gen")
    if not marker.exists():
        return ORIGIN
    return normalize(marker.read_text(encoding="utf-8").strip())


def write_files_gen(files_dir: Path, op: str, incarnation: str) -> None:
    """``.files-gen``, written last (after files, ``.env``, timers and registry columns are durable)."""
    atomic_write(files_dir / ".files-gen", canonical(FilesGen(op=op, incarnation=incarnation)))


def read_files_gen(files_dir: Path) -> FilesGen | None:
    path = files_dir / ".files-gen"
    if not path.exists():
        return None
    return decode(path.read_bytes(), FilesGen)


@dataclass(frozen=True)
class MarkerRead:
    marker: GenerationMarker | None
    etag: str | None


async def read_generation_marker(store: ObjectStore, bucket: str, location: str) -> MarkerRead:
    """Read ``generation.json``. A corrupt marker raises (C6: a read error never acts)."""
    got = await store.get(bucket, marker_key(location))
    if not isinstance(got, Got):
        return MarkerRead(None, None)
    return MarkerRead(decode(got.body, GenerationMarker), got.etag)


async def publish_generation_marker(
    store: ObjectStore, bucket: str, location: str, marker: GenerationMarker, supersedes_etag: str | None
) -> Won | Lost:
    """Write ``generation.json`` conditionally: If-Match the marker it supersedes, or If-None-Match
    when there is none, so a late publication can never put an older generation back (model 29)."""
    body = canonical(marker)
    if not rules.on("generation-conditional"):
        return await store.put(bucket, marker_key(location), body)
    return await store.put(
        bucket, marker_key(location), body, if_match=supersedes_etag, if_none_match=supersedes_etag is None
    )


__all__ = [
    "FilesGen", "GenerationMarker", "MarkerRead", "ORIGIN", "Ready", "Refused", "RestoreCold",
    "DurableValueError", "admission_chain", "cold_predecessor", "marker_key", "normalize",
    "publish_generation_marker", "read_files_gen", "read_generation_marker", "read_local_gen", "start_check",
    "write_files_gen", "write_local_gen",
]
