"""The source's launch report ``moves/<host>/<op>/source.json`` in the deployment bucket (spec §7.3 "Snapshot
rounds (source)"; digest D§5.2, D§9).

The report names every variable of the **composed** launch environment the source's next spawn would get
(``childEnv`` over ``instanceEnv`` plus the agent-owned variables, plus the non-``CARLOS_*`` variables inherited
from the agent; :func:`compose_env`), the launch's inputs (bundle and overlay etags, release) and the measures the
target checks (database size, files plaintext digest). Each value is reported only as an HMAC-SHA256 under a key
derived by HKDF from the deployment's secrets key (``CARLOS_SECRETS_KEY``), so the report reveals names and
equality, never a value.

The spec leaves salt and info unstated (D§9). Resolved here: ``IKM`` = the secrets key's private scalar (32 bytes,
big-endian; both regions hold the same key, T2), ``salt = b"hostmove-launch-report-v1"``, ``info`` names the op and
the host, so a report verifies only for its own move. Each MAC covers ``name NUL value``, so equal values under
different names are not revealed as equal.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping
from typing import Final
from urllib.parse import quote

import msgspec
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from events.base import Durable, Ident, Millis, canonical, decode
from services.box.artifacts.sealing import PrivateKey
from services.objstore.port import Got, ObjectStore

REPORT_VERSION: Final = 1
KDF_SALT: Final = b"hostmove-launch-report-v1"
KDF_NAME: Final = "hkdf-sha256/hmac-sha256/v1"
INHERITED_EXCLUDED_PREFIX: Final = "CARLOS_"

# Input names in ``LaunchReport.inputs`` (what the target checks beside the environment, §7.3 T3/T5/T7).
DB_BYTES: Final = "db_bytes"
OVERLAY_ETAG: Final = "overlay_etag"
RELEASE: Final = "release"
FILES_PLAIN: Final = "files_plain"
BUNDLE_PREFIX: Final = "bundle_etag:"


class ReportError(Exception):
    """A launch report that is missing, unreadable, or for another move. Never carries a value or a key."""


class LaunchReport(Durable, frozen=True):
    """``source.json``: names in clear, values as lowercase hex HMAC-SHA256 (§7.3). ``env`` is the composed launch
    environment, ``inputs`` the launch's input identities (bundle etags, overlay, release), ``measures`` what the
    running instance changes by itself (database size, files digest). ``at`` is when the round wrote it."""

    v: int
    host: Ident
    move_id: Ident
    box: str
    at: Millis
    kdf: str
    env: dict[str, str]
    inputs: dict[str, str]
    measures: dict[str, str] = msgspec.field(default_factory=dict)

    def digest(self) -> str:
        """``sha256:<hex>`` over the launch (``env`` and ``inputs``), without ``at`` and ``measures``: the pinned
        ``inputs.env_report`` (§7.4 ``admitted`` compares it). A serving instance changes its database and files
        every round; pinning them would refuse every cut of a busy instance."""
        body = canonical(msgspec.structs.replace(self, at=0, measures={}))
        return "sha256:" + hashlib.sha256(body).hexdigest()


def compose_env(instance_env: Mapping[str, str], agent_owned: Mapping[str, str],
                inherited: Mapping[str, str]) -> dict[str, str]:
    """The composed launch environment (§7.3): the agent's inherited non-``CARLOS_*`` variables, under
    ``instanceEnv``, under the agent-owned variables (the agent's own values win)."""
    env = {k: v for k, v in inherited.items() if not k.startswith(INHERITED_EXCLUDED_PREFIX)}
    env.update(instance_env)
    env.update(agent_owned)
    return env


def _ikm(secrets_key: PrivateKey) -> bytes:
    return secrets_key.private_numbers().private_value.to_bytes(32, "big")


def derive_key(secrets_key: PrivateKey, *, host: str, move_id: str) -> bytes:
    """The report's MAC key: HKDF-SHA256 over the secrets key, its info naming the op and the host (§7.3)."""
    info = b"hostmove launch report\x00op=" + move_id.encode() + b"\x00host=" + host.encode()
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=KDF_SALT, info=info).derive(_ikm(secrets_key))


def mac(key: bytes, name: str, value: str) -> str:
    """HMAC-SHA256 of ``name NUL value``, lowercase hex."""
    return hmac.new(key, name.encode() + b"\x00" + value.encode(), hashlib.sha256).hexdigest()


def input_values(*, bundle_etags: Mapping[str, str], overlay_etag: str, release: str) -> dict[str, str]:
    """The clear launch inputs the report MACs: :data:`OVERLAY_ETAG`, :data:`RELEASE`, :data:`BUNDLE_PREFIX`
    ``<bundle>``."""
    values = {OVERLAY_ETAG: overlay_etag, RELEASE: release}
    values.update({BUNDLE_PREFIX + name: etag for name, etag in bundle_etags.items()})
    return values


def measure_values(*, db_bytes: int, files_plain: str) -> dict[str, str]:
    """The clear measures the report MACs: :data:`DB_BYTES` and :data:`FILES_PLAIN`."""
    return {DB_BYTES: str(db_bytes), FILES_PLAIN: files_plain}


def build_report(secrets_key: PrivateKey, *, host: str, move_id: str, box: str, at: int,
                 env: Mapping[str, str], inputs: Mapping[str, str],
                 measures: Mapping[str, str] | None = None) -> LaunchReport:
    """The launch report of one round; every value replaced by its MAC under :func:`derive_key`."""
    key = derive_key(secrets_key, host=host, move_id=move_id)

    def macs(values: Mapping[str, str]) -> dict[str, str]:
        return {name: mac(key, name, value) for name, value in sorted(values.items())}

    return LaunchReport(v=REPORT_VERSION, host=host, move_id=move_id, box=box, at=at, kdf=KDF_NAME,
                        env=macs(env), inputs=macs(inputs), measures=macs(measures or {}))


def report_key(host: str, move_id: str) -> str:
    """``moves/<host>/<op>/source.json`` in the deployment bucket, beside the target's ``target.json`` (§7.3)."""
    return f"moves/{quote(host, safe='.-_~@+')}/{move_id}/source.json"


async def write_report(store: ObjectStore, bucket: str, report: LaunchReport) -> str | None:
    """Rewrite ``source.json`` (each round; the newest is what the target reads). Answers the version."""
    out = await store.put(bucket, report_key(report.host, report.move_id), canonical(report))
    return getattr(out, "version_id", None)


async def read_report(store: ObjectStore, bucket: str, host: str, move_id: str) -> LaunchReport:
    """The current ``source.json`` of this move; :class:`ReportError` when missing or for another move."""
    got = await store.get(bucket, report_key(host, move_id))
    if not isinstance(got, Got):
        raise ReportError(f"the source has not written its launch report for move {move_id} of {host} yet")
    report = decode(got.body, LaunchReport)
    if report.host != host or report.move_id != move_id:
        raise ReportError(f"the launch report at {report_key(host, move_id)} names another host or move")
    if report.v != REPORT_VERSION or report.kdf != KDF_NAME:
        raise ReportError(f"the launch report uses version {report.v} / {report.kdf}, which this box cannot check")
    return report


class Verifier:
    """The target's side (§7.3 T3): recompute the MAC of a value it composed and compare in constant time."""

    def __init__(self, report: LaunchReport, secrets_key: PrivateKey, *, host: str, move_id: str) -> None:
        if report.host != host or report.move_id != move_id:
            raise ReportError("the launch report names another host or move; it is not compared")
        self.report = report
        self._key = derive_key(secrets_key, host=host, move_id=move_id)

    def env_equal(self, name: str, value: str) -> bool | None:
        """Whether the source's ``name`` has ``value``; ``None`` when the source has no such variable."""
        have = self.report.env.get(name)
        return None if have is None else hmac.compare_digest(have, mac(self._key, name, value))

    def input_equal(self, name: str, value: str) -> bool | None:
        have = self.report.inputs.get(name)
        return None if have is None else hmac.compare_digest(have, mac(self._key, name, value))

    def measure_equal(self, name: str, value: str) -> bool | None:
        have = self.report.measures.get(name)
        return None if have is None else hmac.compare_digest(have, mac(self._key, name, value))

    def env_mismatches(self, env: Mapping[str, str], *, ignore: frozenset[str] = frozenset()) -> list[str]:
        """Names (never values) that differ, are missing on either side, or are extra; ``ignore`` skips names
        the caller classes separately (region, layout, box allow-list)."""
        names = (set(env) | set(self.report.env)) - ignore
        return sorted(n for n in names if n not in env or not self.env_equal(n, env[n]))

    def input_mismatches(self, inputs: Mapping[str, str]) -> list[str]:
        names = set(inputs) | set(self.report.inputs)
        return sorted(n for n in names if n not in inputs or not self.input_equal(n, inputs[n]))


__all__ = [
    "BUNDLE_PREFIX", "DB_BYTES", "FILES_PLAIN", "KDF_NAME", "KDF_SALT", "OVERLAY_ETAG", "RELEASE", "LaunchReport",
    "ReportError", "Verifier", "build_report", "compose_env", "derive_key", "input_values", "mac", "measure_values",
    "read_report",
    "report_key", "write_report",
]
