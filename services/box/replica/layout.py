"""Replica keys: generations, levels, TXID ranges (spec §5.1 "Location and generation"; D§0).

Within ``holder.location`` every installed state is a **generation** with its own prefix:

- the origin (``""``; legacy ``"@root"`` is the same origin) lives directly under the location;
- an operation's generation ``op`` lives under ``g-<op>/``.

Inside a generation prefix the files follow the pinned S3 client's layout
``<level %04d>/<min %016x>-<max %016x>.ltx``: a snapshot ending at TXID 7 is
``0009/0000000000000001-0000000000000007.ltx``, a level-0 file for TXID 8 is
``0000/0000000000000008-0000000000000008.ltx``. The build intent and the install manifest are
``g-<op>/build-intent.json`` and ``g-<op>/install.json`` (§5.1 step 2).

A :class:`GenerationScope` is bound to one ``(location, generation)`` and is the only way the
replicator names keys: :meth:`GenerationScope.check_owned` refuses any key outside its prefix, so
a writer's uploads, compaction, snapshots and retention deletes stay in the generation it was
admitted to (§5.1 step 9, "Writers are bound to their generation").
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from services.box.replica.ltx import MAX_LEVEL, SNAPSHOT_LEVEL
from services.objstore.port import ObjectStore

ORIGIN = ""
LEGACY_ORIGIN = "@root"
BUILD_INTENT = "build-intent.json"
INSTALL_MANIFEST = "install.json"

_LTX_NAME = re.compile(r"^(\d{4})/([0-9a-f]{16})-([0-9a-f]{16})\.ltx$")
_GENERATION = re.compile(r"^[A-Za-z0-9_.:-]{1,200}$")


class GenerationViolation(AssertionError):
    """A key outside the generation a writer is bound to: a defect, never a request to make."""


def normalize_generation(generation: str) -> str:
    """``""`` and ``"@root"`` are one origin (§5.1 step 9, R11-2)."""
    return ORIGIN if generation in (ORIGIN, LEGACY_ORIGIN) else generation


def ltx_name(level: int, min_txid: int, max_txid: int) -> str:
    """``<level %04d>/<min %016x>-<max %016x>.ltx``."""
    if not 0 <= level <= MAX_LEVEL or not 1 <= min_txid <= max_txid:
        raise ValueError(f"no replica file is named for level {level}, range [{min_txid}, {max_txid}]")
    return f"{level:04d}/{min_txid:016x}-{max_txid:016x}.ltx"


@dataclass(frozen=True, order=True)
class FileRef:
    """One replica file of a generation, as a listing or a seal names it.

    ``version_id`` is set when the file must be read at an exact version (a seal's pinned set, the
    pinned root); ``None`` reads the current object.
    """

    level: int
    min_txid: int
    max_txid: int
    key: str
    version_id: str | None = None

    @property
    def is_snapshot(self) -> bool:
        return self.level == SNAPSHOT_LEVEL


def parse_ltx_name(name: str) -> tuple[int, int, int] | None:
    """(level, min, max) of a file name inside a generation prefix, or ``None``."""
    m = _LTX_NAME.match(name)
    if not m:
        return None
    level, lo, hi = int(m.group(1)), int(m.group(2), 16), int(m.group(3), 16)
    if level > MAX_LEVEL or not 1 <= lo <= hi:
        return None
    return level, lo, hi


@dataclass(frozen=True)
class GenerationScope:
    """One generation of one location: the prefix every key of its writer must live under."""

    location: str
    generation: str

    def __post_init__(self) -> None:
        location = self.location.strip("/")
        if not location:
            raise ValueError("a replica location must not be empty")
        object.__setattr__(self, "location", location)
        generation = normalize_generation(self.generation)
        if generation and not _GENERATION.match(generation):
            raise ValueError(f"generation name {generation!r} is not a plain identifier")
        object.__setattr__(self, "generation", generation)

    @property
    def is_origin(self) -> bool:
        return self.generation == ORIGIN

    @property
    def prefix(self) -> str:
        if self.is_origin:
            return f"{self.location}/"
        return f"{self.location}/g-{self.generation}/"

    def ltx_key(self, level: int, min_txid: int, max_txid: int) -> str:
        return self.prefix + ltx_name(level, min_txid, max_txid)

    @property
    def build_intent_key(self) -> str:
        self._require_op("a build intent")
        return self.prefix + BUILD_INTENT

    @property
    def install_key(self) -> str:
        self._require_op("an install manifest")
        return self.prefix + INSTALL_MANIFEST

    def _require_op(self, what: str) -> None:
        if self.is_origin:
            raise ValueError(f"the origin generation has no {what}; only an operation's generation is built")

    def parse(self, key: str, version_id: str | None = None) -> FileRef | None:
        """The file a key names when it is a replica file of **this** generation, else ``None``.

        For the origin, ``g-*/`` keys under the location belong to other generations and never match.
        """
        if not key.startswith(self.prefix):
            return None
        parsed = parse_ltx_name(key[len(self.prefix) :])
        if parsed is None:
            return None
        return FileRef(parsed[0], parsed[1], parsed[2], key, version_id)

    def check_owned(self, key: str) -> None:
        """Refuse a key this generation's writer may not touch (§5.1 step 9)."""
        if self.parse(key) is None and key not in (self._op_key(BUILD_INTENT), self._op_key(INSTALL_MANIFEST)):
            raise GenerationViolation(
                f"refusing to write {key!r}: it is outside generation {self.generation or '(origin)'!r} "
                f"({self.prefix!r})"
            )

    def _op_key(self, name: str) -> str | None:
        return None if self.is_origin else self.prefix + name


def generation_prefixes(location: str, generation: str) -> tuple[str, ...]:
    """Every prefix a generation's objects live under, what retiring it removes (§6.4 ``park-generation``): an
    operation's generation is ``g-<op>/`` (its LTX files, build intent, install manifest and clean-close
    certificates) and its files namespace ``files/g-<op>/`` (§8.3); the origin lives directly under the location,
    so it is its level directories and its certificates, never another generation's prefix, ``files/``,
    ``generation.json`` or ``lock.json``."""
    scope = GenerationScope(location, generation)
    if scope.is_origin:
        return (*(f"{scope.location}/{level:04d}/" for level in range(MAX_LEVEL + 1)), f"{scope.location}/closed/")
    return scope.prefix, f"{scope.location}/files/g-{scope.generation}/"


async def generation_holds_objects(store: ObjectStore, bucket: str, location: str, generation: str) -> bool:
    """Does the generation hold any current object in this bucket (its replica files, its files namespace, its
    certificates)?"""
    for prefix in generation_prefixes(location, generation):
        if await store.list_keys(bucket, prefix):
            return True
    return False


async def list_generation(store: ObjectStore, bucket: str, scope: GenerationScope) -> list[FileRef]:
    """Every **current** replica file of the generation (§5.1 step 4: current versions only)."""
    keys = await store.list_keys(bucket, scope.prefix)
    files = [ref for key in keys if (ref := scope.parse(key)) is not None]
    files.sort(key=lambda f: (f.level, f.min_txid, f.max_txid))
    return files
