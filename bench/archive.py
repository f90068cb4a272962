"""The move archive's throughput against the ceiling of the work spec §8 requires, in the same run.

The data is 64 MiB of mixed files written once under a temp directory: large incompressible files
(media), semi-compressible text, structured JSON lines, and a thousand small files. The archive side
runs the full pipeline of :func:`services.box.artifacts.archive.build_archive` (scan, sorted tar with per-file
and plaintext sha256, zstd, 1 MiB AES-256-GCM chunks, sealed sha256) into a sink that discards the
bytes. Rates are file bytes per second, best of several interleaved rounds.

**The baseline is the required work, not raw AES-GCM** (issue 19 item 8, a decision of the round): the ceiling
is the work §8 requires (two SHA-256 passes over the plaintext, the per-file and ``plain`` digests; zstd; AES-GCM
and a SHA-256 pass over the sealed bytes) measured in the same run and spread perfectly over every core this
process may use, with no reading and no tar at all. Against raw AES-GCM no implementation can pass on two cores:
raw AES-GCM runs at ~9.7 GiB/s, one SHA-256 pass at ~0.20 of it and zstd level 1 at ~0.075 of it per core
(2-core AMD EPYC, SHA-NI, AES-NI, 2026-11-30), so the required work caps that ratio near 0.075; it is printed as
context. The last line is ``RESULT archive ratio=<archive/ceiling> target=0.85``; below the target it exits 1.
"""

from __future__ import annotations

import hashlib
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import zstandard
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from bench.common import result
from services.box.artifacts.archive import DEFAULT_LEVEL, build_archive
from services.box.artifacts.sealing import chunk_aad, chunk_nonce, generate_private_key

TARGET = 0.85
MIB = 1 << 20
ROUNDS = 5
WORDS = [
    w.encode()
    for w in (
        "move host region cut seal park claim record holder stamp scope horizon obligation lease session "
        "generation snapshot anchor marker replica archive manifest digest landing probe rollback commit"
    ).split()
]


def _text(rng: random.Random, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        out += b" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 14))) + b"\n"
    return bytes(out[:n])


def _jsonl(rng: random.Random, n: int) -> bytes:
    out = bytearray()
    i = 0
    while len(out) < n:
        out += b'{"id":%d,"user":"u%06d","score":%d,"token":"%s"}\n' % (
            i,
            rng.randrange(10**6),
            rng.randrange(10**9),
            rng.randbytes(8).hex().encode(),
        )
        i += 1
    return bytes(out[:n])


def make_tree(root: Path) -> list[bytes]:
    """Write 64 MiB of mixed files under ``root``; returns their contents (for the raw baseline)."""
    rng = random.Random(20261130)
    contents: list[bytes] = []

    def put(rel: str, data: bytes) -> None:
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        contents.append(data)

    for i in range(4):
        put(f"media/clip-{i}.bin", rng.randbytes(4 * MIB))
    for i in range(64):
        put(f"docs/{i // 16}/note-{i}.txt", _text(rng, 256 * 1024))
    for i in range(16):
        put(f"data/events-{i}.jsonl", _jsonl(rng, MIB))
    for i in range(1024):
        data = rng.randbytes(16 * 1024) if i % 2 else _text(rng, 16 * 1024)
        put(f"uploads/{i % 32:02d}/f-{i}.dat", data)
    return contents


class _Null:
    def write(self, data: bytes, /) -> int:
        return len(data)


def raw_rate(contents: list[bytes]) -> float:
    aead = AESGCM(os.urandom(32))
    blob = b"".join(contents)
    total = len(blob)
    view = memoryview(blob)
    t0 = time.perf_counter()
    for index, start in enumerate(range(0, total, MIB)):
        aead.encrypt(chunk_nonce(index), bytes(view[start : start + MIB]), chunk_aad(MIB, index, start + MIB >= total))
    return total / (time.perf_counter() - t0)


def sha256_rate(contents: list[bytes]) -> float:
    """One SHA-256 pass over the same bytes: the spec needs three (per file, ``plain``, ``sealed``)."""
    blob = b"".join(contents)
    t0 = time.perf_counter()
    hashlib.sha256(blob).digest()
    return len(blob) / (time.perf_counter() - t0)


def zstd_rate(contents: list[bytes]) -> tuple[float, int]:
    """zstd over the same bytes, as the archive runs it (its level, checksum, 1 MiB blocks); one core."""
    blob = b"".join(contents)
    view = memoryview(blob)
    z = zstandard.ZstdCompressor(level=DEFAULT_LEVEL, write_checksum=True).compressobj()
    packed = 0
    t0 = time.perf_counter()
    for start in range(0, len(blob), MIB):
        packed += len(z.compress(view[start : start + MIB]))
    packed += len(z.flush())
    return len(blob) / (time.perf_counter() - t0), packed


def archive_rate(files: Path, env: Path, total: int) -> tuple[float, int, int]:
    key = generate_private_key().public_key()
    t0 = time.perf_counter()
    m = build_archive(files, env, _Null(), key, host="bench.example.com", op_id="mv_" + "a" * 26, incarnation="ab" * 32)
    return total / (time.perf_counter() - t0), m.bytes, m.sealed_bytes


def required_work_ceiling(raw: float, sha: float, zstd: float, sealed_share: float, cores: int) -> float:
    """The ratio the work §8 requires allows: per file byte, two SHA-256 passes (per-file and ``plain``),
    zstd, and AES-GCM and SHA-256 over ``sealed_share`` sealed bytes, on ``cores`` cores with perfect
    parallelism and nothing else (no reading, no tar, no handoffs)."""
    seconds_per_byte = 2 / sha + 1 / zstd + sealed_share / sha + sealed_share / raw
    return cores / seconds_per_byte / raw


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="hostmove-bench-archive-") as tmp:
        files = Path(tmp) / "files"
        contents = make_tree(files)
        env = Path(tmp) / ".env"
        env.write_bytes(b"CARLOS_ADMIN_TOKEN=bench\n")
        contents.append(env.read_bytes())
        total = sum(map(len, contents))
        archive_rate(files, env, total)  # warm the page cache and the code paths
        raw_rate(contents)
        raw_rates, archive_rates, sha_rates, zstd_rates = [], [], [], []
        plain_bytes = sealed_bytes = 0
        for _ in range(ROUNDS):  # interleaved, so drift in machine load hits both
            raw_rates.append(raw_rate(contents))
            rate, plain_bytes, sealed_bytes = archive_rate(files, env, total)
            archive_rates.append(rate)
            sha_rates.append(sha256_rate(contents))
            zstd_rates.append(zstd_rate(contents)[0])
    raw, arch = max(raw_rates), max(archive_rates)
    print(
        f"data: {total / MIB:.1f} MiB in {len(contents)} files; tar {plain_bytes / MIB:.1f} MiB, "
        f"sealed {sealed_bytes / MIB:.1f} MiB"
    )
    print(
        f"archive (tar + zstd + seal): {arch / MIB:.0f} MiB/s  raw AES-256-GCM: {raw / MIB:.0f} MiB/s  "
        f"(best of {ROUNDS})"
    )
    sha, zstd = max(sha_rates), max(zstd_rates)
    cores = len(os.sched_getaffinity(0))
    ceiling = required_work_ceiling(raw, sha, zstd, sealed_bytes / total, cores)
    print(
        f"ceilings (same run, ratio to raw AES-256-GCM): one SHA-256 pass {sha / MIB:.0f} MiB/s = {sha / raw:.3f}; "
        f"zstd level {DEFAULT_LEVEL} {zstd / MIB:.0f} MiB/s = {zstd / raw:.3f} per core"
    )
    print(
        f"ceiling of the work §8 requires (per-file, plain and sealed SHA-256, zstd, AES-GCM) on {cores} cores, "
        f"perfectly parallel, no reading and no tar: {ceiling:.3f}"
    )
    print(f"for comparison (not the RESULT): archive / raw AES-256-GCM = {arch / raw:.3f}")
    ratio = arch / raw / ceiling
    print(result("archive", ratio, TARGET))
    return 0 if ratio >= TARGET else 1


if __name__ == "__main__":
    sys.exit(main())
