"""The object store port and its implementations (ARCHITECTURE §4, §7; C3, C6).

``S3Store`` is imported lazily so that the twin and the simulation do not pay for aioboto3.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from services.objstore.memory import Faults, MemoryStore
from services.objstore.port import (
    AccessDenied,
    Got,
    InvalidRequest,
    Lost,
    Missing,
    NoSuchBucket,
    ObjectStore,
    StoreError,
    StoreUnavailable,
    VersionEntry,
    Won,
)
from services.objstore.probe import (
    CheckResult,
    ProbeFailed,
    ProbeReport,
    conformance_probe,
    run_probe_or_exit,
)

if TYPE_CHECKING:
    from services.objstore.s3 import S3Store

__all__ = [
    "AccessDenied",
    "CheckResult",
    "Faults",
    "Got",
    "InvalidRequest",
    "Lost",
    "MemoryStore",
    "Missing",
    "NoSuchBucket",
    "ObjectStore",
    "ProbeFailed",
    "ProbeReport",
    "S3Store",
    "StoreError",
    "StoreUnavailable",
    "VersionEntry",
    "Won",
    "conformance_probe",
    "run_probe_or_exit",
]


def __getattr__(name: str) -> Any:
    if name == "S3Store":
        from services.objstore.s3 import S3Store

        return S3Store
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
