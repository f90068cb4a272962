"""Reading SQLite's WAL and its wal-index header, for change capture (spec §5.1; D§7).

Formats (sqlite.org/fileformat2.html "WAL file format", sqlite.org/walformat.html):

- WAL header, 32 bytes, big-endian: magic ``0x377f0682``/``0x377f0683`` (the low bit selects the
  checksum's word order), format version, page size, checkpoint sequence, salt-1, salt-2,
  checksum-1, checksum-2.
- Frame = 24-byte header (page number, database size after commit or 0, salt-1, salt-2, cumulative
  checksum-1, checksum-2) + one page image. Frame ``i`` (1-based) starts at ``32 + (i-1)*(24+page)``.
- The wal-index header, at the start of the ``-shm`` file, in native byte order, twice (readers
  take it only when both copies agree and its checksum holds): ``mxFrame`` is the last
  **committed** frame, ``aSalt`` the current epoch's salts. ``WalCkptInfo.nBackfill`` follows.

``mxFrame`` is what makes a frame committed: frames beyond it may be an open transaction or the
leftovers of a writer that died mid-commit, however valid their own checksums look, so capture
reads exactly ``(shipped, mxFrame]`` of the epoch whose salts the file header and the wal-index
share. Salt-1 grows by one at every WAL restart (``walRestartHdr``), so the difference between two
salt-1 values counts restarts.
"""

from __future__ import annotations

import os
import struct
import sys
import time
from dataclasses import dataclass

WAL_MAGIC_LE = 0x377F0682
WAL_MAGIC_BE = 0x377F0683
WAL_HEADER_SIZE = 32
FRAME_HEADER_SIZE = 24
_FRAME_HEADER = struct.Struct(">II8s8s")
_SHM_HDR_SIZE = 48
_SHM_HDR = struct.Struct("=IIIBBHII8s8s")  # native order, without the trailing aCksum[2]
_NATIVE_BIG = sys.byteorder == "big"


class WalChanged(Exception):
    """The WAL moved under a read (a restart or an unexpected frame): read again."""


@dataclass(frozen=True)
class WalHeader:
    page_size: int
    checkpoint_seq: int
    salts: bytes  # salt-1 and salt-2, the 8 raw bytes
    checksum: tuple[int, int]
    big_endian_checksum: bool

    @property
    def salt1(self) -> int:
        return int.from_bytes(self.salts[:4], "big")


@dataclass(frozen=True)
class ShmHeader:
    mx_frame: int
    n_page: int
    salts: bytes
    page_size: int
    n_backfill: int

    @property
    def salt1(self) -> int:
        return int.from_bytes(self.salts[:4], "big")


@dataclass(frozen=True)
class Capture:
    """Pages from frames ``(start, end]`` of one epoch."""

    pages: dict[int, bytes]
    commit: int  # database size in pages after frame ``end``
    min_commit: int  # smallest database size any commit in the range left
    end: int
    last_checksum: tuple[int, int]


def wal_path(db_path: str | os.PathLike[str]) -> str:
    return os.fspath(db_path) + "-wal"


def shm_path(db_path: str | os.PathLike[str]) -> str:
    return os.fspath(db_path) + "-shm"


def frame_offset(frame: int, page_size: int) -> int:
    """Byte offset of 1-based frame ``frame``."""
    return WAL_HEADER_SIZE + (frame - 1) * (FRAME_HEADER_SIZE + page_size)


def checksum(data: bytes, s1: int, s2: int, big_endian: bool) -> tuple[int, int]:
    """SQLite's WAL checksum (``walChecksumBytes``) over ``data`` (a multiple of 8 bytes)."""
    words = struct.unpack(f"{'>' if big_endian else '<'}{len(data) // 4}I", data)
    mask = 0xFFFFFFFF
    it = iter(words)
    for a, b in zip(it, it, strict=True):
        s1 = (s1 + a + s2) & mask
        s2 = (s2 + b + s1) & mask
    return s1, s2


def read_wal_header(fd: int) -> WalHeader | None:
    """The WAL header, or ``None`` when the file is empty or holds no valid header."""
    raw = os.pread(fd, WAL_HEADER_SIZE, 0)
    if len(raw) < WAL_HEADER_SIZE:
        return None
    magic, _version, page_size, seq, salts = struct.unpack(">IIII8s", raw[:24])
    c1, c2 = struct.unpack(">II", raw[24:32])
    if magic not in (WAL_MAGIC_LE, WAL_MAGIC_BE):
        return None
    big = magic == WAL_MAGIC_BE
    if checksum(raw[:24], 0, 0, big) != (c1, c2):
        return None
    return WalHeader(page_size, seq, salts, (c1, c2), big)


def read_shm_header(fd: int, deadline_s: float = 2.0) -> ShmHeader | None:
    """A consistent wal-index header (both copies equal, checksum valid) from an open ``-shm``
    descriptor, or ``None`` when it was never initialized. Retries a header caught mid-update.

    The descriptor must stay open for as long as this process has SQLite connections to the
    database: POSIX record locks belong to the process, and closing *any* descriptor of the file
    drops every lock the process holds on it, SQLite's read marks included."""
    give_up = time.monotonic() + deadline_s
    pause = 0.00001
    while True:
        raw = os.pread(fd, 2 * _SHM_HDR_SIZE + 4, 0)
        if len(raw) < 2 * _SHM_HDR_SIZE + 4:
            return None
        first, second = raw[:_SHM_HDR_SIZE], raw[_SHM_HDR_SIZE : 2 * _SHM_HDR_SIZE]
        if first == second:
            _version, _unused, _change, is_init, _big, sz, mx, npage, _fck, salts = _SHM_HDR.unpack_from(first)
            if not is_init:
                return None
            stored = struct.unpack_from("=II", first, 40)
            if checksum(first[:40], 0, 0, _NATIVE_BIG) == stored:
                page_size = 65536 if sz == 1 else sz
                (n_backfill,) = struct.unpack_from("=I", raw, 2 * _SHM_HDR_SIZE)
                return ShmHeader(mx, npage, salts, page_size, n_backfill)
        if time.monotonic() > give_up:
            raise WalChanged("the wal-index header kept changing while being read")
        time.sleep(pause)  # caught mid-update by a committing writer: read again shortly
        pause = min(pause * 2, 0.01)


def read_frames(fd: int, header: WalHeader, start: int, end: int, prev_size: int) -> Capture:
    """Pages changed by frames ``(start, end]`` of the epoch ``header`` names.

    Every frame must carry the epoch's salts and frame ``end`` must be a commit; otherwise the WAL
    changed under the read (:class:`WalChanged`). The caller re-reads the header afterwards: an
    overwrite of these frames is always preceded by a new header (``sqlite3WalFrames``).
    ``prev_size`` (the database size at ``start``) bounds the smallest size seen, for truncation.
    """
    page_size = header.page_size
    size = FRAME_HEADER_SIZE + page_size
    pages: dict[int, bytes] = {}
    commit = 0
    min_commit = prev_size
    last_checksum = header.checksum
    if end <= start:
        return Capture(pages, prev_size, prev_size, start, last_checksum)
    offset = frame_offset(start + 1, page_size)
    want = (end - start) * size
    raw = os.pread(fd, want, offset)
    if len(raw) != want:
        raise WalChanged(f"the WAL is shorter than its {end} committed frames")
    view = memoryview(raw)
    salts = header.salts
    pos = 0
    for _ in range(end - start):
        pgno, db_size, frame_salts, cks = _FRAME_HEADER.unpack_from(raw, pos)
        if frame_salts != salts or pgno == 0:
            raise WalChanged("a frame of the current epoch carries other salts")
        pages[pgno] = bytes(view[pos + FRAME_HEADER_SIZE : pos + size])
        if db_size:
            commit = db_size
            min_commit = min(min_commit, db_size)
        pos += size
    if not db_size:
        raise WalChanged("the last committed frame is not a commit frame")
    last_checksum = struct.unpack(">II", cks)
    for pgno in [p for p in pages if p > commit]:
        del pages[pgno]
    return Capture(pages, commit, min_commit, end, last_checksum)


def frame_extends_epoch(fd: int, old_salts: bytes, new_salts: bytes, page_size: int, frame: int,
                        prev_checksum: tuple[int, int], big_endian: bool) -> bool | None:
    """Whether frame ``frame`` in the file continues the old epoch (salts ``old_salts``) from a
    frame whose cumulative checksum is ``prev_checksum``.

    ``False``: it is not that epoch's frame (absent, or an older epoch's leftovers), so the old
    epoch ended before it. ``True``: a valid continuation (the old epoch grew past the caller's
    position). ``None``: cannot tell (the new epoch already overwrote the slot, or the old epoch's
    salts with a checksum that does not hold: a frame caught being written).
    """
    size = FRAME_HEADER_SIZE + page_size
    raw = os.pread(fd, size, frame_offset(frame, page_size))
    if len(raw) < size:
        return False
    _pgno, _db, salts, cks = _FRAME_HEADER.unpack_from(raw, 0)
    if salts == new_salts:
        return None
    if salts != old_salts:
        return False
    got = checksum(raw[:8] + raw[FRAME_HEADER_SIZE:], prev_checksum[0], prev_checksum[1], big_endian)
    return True if got == struct.unpack(">II", cks) else None
