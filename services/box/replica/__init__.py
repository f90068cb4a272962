"""The replicator and the restore contract over real SQLite files (spec §5.1; D§7).

- :mod:`.ltx`: the file format (header, page images, CRC-64 trailer);
- :mod:`.layout`: keys, generations (``g-<op>/``), :class:`GenerationScope`;
- :mod:`.planner`: the pure restore planner (root rule, overlap rule, preference order, refusals);
- :mod:`.wal`: reading SQLite's WAL and wal-index header;
- :mod:`.replicator`: the writer's sync loop, compaction, snapshots, retention, checkpoints;
- :mod:`.restore`: the fail-closed restore executor;
- :mod:`.install`: the build intent, the snapshot and anchor, ``install.json``, the wake's anchor.
"""

from services.box.replica.install import (
    BuildIntent,
    InstallError,
    InstallManifest,
    build_generation,
    ensure_anchor,
    read_install,
)
from services.box.replica.layout import (
    ORIGIN,
    FileRef,
    GenerationScope,
    GenerationViolation,
    list_generation,
)
from services.box.replica.planner import PinnedRoot, Plan, Refusal, plan_restore, replication_position
from services.box.replica.replicator import (
    CompactResult,
    ReplicaError,
    ReplicaOptions,
    Replicator,
    RetentionResult,
    SyncResult,
)
from services.box.replica.restore import RestoreRefused, RestoreResult, restore_files, restore_generation

__all__ = [
    "ORIGIN",
    "BuildIntent",
    "CompactResult",
    "FileRef",
    "GenerationScope",
    "GenerationViolation",
    "InstallError",
    "InstallManifest",
    "PinnedRoot",
    "Plan",
    "Refusal",
    "ReplicaError",
    "ReplicaOptions",
    "Replicator",
    "RestoreRefused",
    "RestoreResult",
    "RetentionResult",
    "SyncResult",
    "build_generation",
    "ensure_anchor",
    "list_generation",
    "plan_restore",
    "read_install",
    "replication_position",
    "restore_files",
    "restore_generation",
]
