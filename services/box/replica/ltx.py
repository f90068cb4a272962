"""The LTX-style replica file: header, page images, CRC-64 trailer (spec §5.1 steps 2, 4, 5; D§7).

One file carries the state of a set of database pages at its ``max_txid``, for the TXID range
``[min_txid, max_txid]`` it covers. A TXID is **one sync** of the replicator (one level-0 file),
not one SQLite transaction. Byte compatibility with Litestream's LTX is not a goal; its rules are:

- the header names the level, the range, the page size, ``commit`` (the database size in pages at
  ``max_txid``), the page count, the timestamp (from the Clock port, so a replay can encode the same
  bytes, spec §5.1 step 2, R6-5) and ``wal_offset`` (the anchor carries the WAL header size, as the
  pinned writers do, fact R5-1c);
- pre- and post-apply checksums do not exist, as with ``HeaderFlagNoChecksum`` (fact R5-2): what the
  format supplies is **per-file integrity**, a CRC-64 trailer over every byte before it, checked by
  :func:`decode` (Litestream's ``Decoder.Verify``) before any page is handed out.

Layout (big-endian)::

    header   64 bytes   magic "HMLT", version, flags, level, page_size, commit, page_count,
                        min_txid, max_txid, timestamp_ms, wal_offset, body_len
    body     body_len   the page numbers (u32 each, ascending), then the page images in the
                        same order; one zstd frame when FLAG_ZSTD is set, raw otherwise
    trailer  8 bytes    CRC-64 of header + body

``FLAG_FULL`` marks a file that holds every page ``1..commit`` (a snapshot, an anchor, the first
file of a generation, a resync): it can be applied over nothing, and its image block *is* the
database, written in one piece by a restore.

**CRC-64 choice.** CRC-64/XZ: the ECMA-182 polynomial 0x42F0E1EBA9EA3693, reflected, initial value
and final XOR all ones (also known as CRC-64/GO-ECMA; check value ``0x995DC9BBDF1939FA`` over
``b"123456789"``). Litestream's ``ltx`` uses the ISO polynomial; ECMA-182 is chosen here because the
system's ``liblzma`` exports it as ``lzma_crc64`` (C speed, several GB/s, through :mod:`ctypes`).
Where ``liblzma`` cannot be loaded, a table-driven pure-Python implementation of the same CRC
(tested equal) is used; it is correct but slow (tens of MB/s).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import struct
import sys
from array import array
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import zstandard

MAGIC = b"HMLT"
VERSION = 1
FLAG_ZSTD = 0x1
FLAG_FULL = 0x2
_KNOWN_FLAGS = FLAG_ZSTD | FLAG_FULL

SNAPSHOT_LEVEL = 9
"""Level 9 holds snapshots ``[1, N]`` (spec §5.1 step 2)."""
MAX_LEVEL = 9
WAL_HEADER_SIZE = 32
"""SQLite's WAL header size: the anchor's ``wal_offset`` (fact R5-1c)."""

_HEADER = struct.Struct(">4sHHIIIIQQQQQ")
HEADER_SIZE = _HEADER.size
TRAILER_SIZE = 8
_MAX_U32 = 0xFFFFFFFF
ZSTD_LEVEL = 1


# ---------------------------------------------------------------------------------------- CRC-64

_POLY_REFLECTED = 0xC96C5795D7870F42  # ECMA-182 0x42F0E1EBA9EA3693, bit-reversed
_MASK64 = 0xFFFFFFFFFFFFFFFF


def _make_table() -> tuple[int, ...]:
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ _POLY_REFLECTED if crc & 1 else crc >> 1
        table.append(crc)
    return tuple(table)


_TABLE = _make_table()


def crc64_py(data: bytes, crc: int = 0) -> int:
    """CRC-64/XZ in pure Python, table-driven. ``crc`` continues an earlier result."""
    table = _TABLE
    crc ^= _MASK64
    for byte in data:
        crc = table[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ _MASK64


def _load_liblzma() -> Any:
    for name in (ctypes.util.find_library("lzma"), "liblzma.so.5", "liblzma.dylib"):
        if not name:
            continue
        try:
            lib = ctypes.CDLL(name)
            fn = lib.lzma_crc64
        except (OSError, AttributeError):
            continue
        fn.restype = ctypes.c_uint64
        fn.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_uint64]
        if fn(b"123456789", 9, 0) == 0x995DC9BBDF1939FA:
            return fn
    return None


_LZMA_CRC64 = _load_liblzma()
CRC64_IMPLEMENTATION = "liblzma" if _LZMA_CRC64 is not None else "python"


def crc64(data: bytes, crc: int = 0, *, length: int | None = None) -> int:
    """CRC-64/XZ of ``data`` (of its first ``length`` bytes when given, without copying); pass an
    earlier result as ``crc`` to continue it over more bytes."""
    n = len(data) if length is None else length
    if _LZMA_CRC64 is not None:
        return int(_LZMA_CRC64(data if type(data) is bytes else bytes(data), n, crc))
    return crc64_py(bytes(memoryview(data)[:n]), crc)


def format_crc(value: int) -> str:
    """The CRC as it is written into JSON (``install.json``, ``generation.json``): 16 hex digits."""
    return f"{value:016x}"


# ---------------------------------------------------------------------------------------- format


class LtxError(ValueError):
    """A file that is not a valid replica file. ``reason`` is ``checksum`` or ``format``."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class Header:
    level: int
    min_txid: int
    max_txid: int
    page_size: int
    commit: int
    page_count: int
    timestamp_ms: int
    wal_offset: int = 0
    flags: int = 0

    @property
    def full(self) -> bool:
        return bool(self.flags & FLAG_FULL)

    @property
    def compressed(self) -> bool:
        return bool(self.flags & FLAG_ZSTD)


@dataclass(frozen=True)
class LtxFile:
    """A decoded, verified file: its header, its pages (page number -> image) and its CRC-64."""

    header: Header
    pages: Mapping[int, bytes]
    crc64: int


def _check_page_size(page_size: int) -> None:
    if page_size < 512 or page_size > 65536 or page_size & (page_size - 1):
        raise LtxError("format", f"page size {page_size} is not a power of two between 512 and 65536")


def _check_range(level: int, min_txid: int, max_txid: int) -> None:
    if not 0 <= level <= MAX_LEVEL:
        raise LtxError("format", f"level {level} is outside 0..{MAX_LEVEL}")
    if not 1 <= min_txid <= max_txid:
        raise LtxError("format", f"TXID range [{min_txid}, {max_txid}] is not a range starting at 1 or later")


def encode(
    *,
    level: int,
    min_txid: int,
    max_txid: int,
    page_size: int,
    commit: int,
    pages: Iterable[tuple[int, bytes | memoryview]],
    timestamp_ms: int,
    full: bool = False,
    wal_offset: int = 0,
    compress: bool = True,
) -> bytes:
    """Encode one file. ``pages`` are (page number, image) pairs; they are sorted here, and pages
    beyond ``commit`` are refused (the caller truncates first). Deterministic: the same inputs give
    the same bytes (zstd at a fixed level is deterministic), which replays rely on (R6-5)."""
    _check_range(level, min_txid, max_txid)
    _check_page_size(page_size)
    if not 0 <= commit <= _MAX_U32:
        raise LtxError("format", f"commit {commit} is out of range")
    ordered = sorted(pages, key=lambda item: item[0])
    numbers = array("I")
    last = 0
    for pgno, image in ordered:
        if pgno <= last:
            raise LtxError("format", f"page {pgno} appears twice")
        if pgno > commit:
            raise LtxError("format", f"page {pgno} lies beyond the database size of {commit} pages")
        if len(image) != page_size:
            raise LtxError("format", f"page {pgno} is {len(image)} bytes, not the page size {page_size}")
        numbers.append(pgno)
        last = pgno
    if full and len(ordered) != commit:
        raise LtxError("format", f"a full file must hold every page 1..{commit}, it holds {len(ordered)}")
    return _assemble(level, min_txid, max_txid, page_size, commit, numbers, b"".join(img for _, img in ordered),
                     timestamp_ms, full, wal_offset, compress)


def encode_image(
    image: bytes | memoryview,
    *,
    level: int,
    min_txid: int,
    max_txid: int,
    page_size: int,
    timestamp_ms: int,
    wal_offset: int = 0,
    compress: bool = True,
) -> bytes:
    """Encode a whole database image (pages ``1..n`` in order) as one full file, without copying
    it page by page (snapshots, anchors, first files, resyncs)."""
    _check_range(level, min_txid, max_txid)
    _check_page_size(page_size)
    if len(image) % page_size:
        raise LtxError("format", f"an image of {len(image)} bytes is not a whole number of {page_size}-byte pages")
    count = len(image) // page_size
    return _assemble(level, min_txid, max_txid, page_size, count, array("I", range(1, count + 1)), image,
                     timestamp_ms, True, wal_offset, compress)


def _assemble(level: int, min_txid: int, max_txid: int, page_size: int, commit: int, numbers: array[int],
              images: bytes | memoryview, timestamp_ms: int, full: bool, wal_offset: int, compress: bool) -> bytes:
    if sys.byteorder == "little":
        numbers.byteswap()
    raw = numbers.tobytes() + bytes(images)
    flags = FLAG_FULL if full else 0
    if compress:
        body = zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_checksum=False).compress(raw)
        flags |= FLAG_ZSTD
    else:
        body = raw
    header = _HEADER.pack(
        MAGIC, VERSION, flags, level, page_size, commit, len(numbers),
        min_txid, max_txid, timestamp_ms, wal_offset, len(body),
    )
    crc = crc64(body, crc64(header))
    return header + body + crc.to_bytes(TRAILER_SIZE, "big")


def read_header(data: bytes) -> Header:
    """Parse the header only (no CRC check): for listings and cross-checks before a full decode."""
    if len(data) < HEADER_SIZE + TRAILER_SIZE:
        raise LtxError("format", f"file is {len(data)} bytes, shorter than a header and a trailer")
    (magic, version, flags, level, page_size, commit, page_count,
     min_txid, max_txid, timestamp_ms, wal_offset, body_len) = _HEADER.unpack_from(data, 0)
    if magic != MAGIC:
        raise LtxError("format", "not a replica file (bad magic)")
    if version != VERSION:
        raise LtxError("format", f"replica file version {version} is not supported (expected {VERSION})")
    if flags & ~_KNOWN_FLAGS:
        raise LtxError("format", f"unknown flags {flags:#x}")
    _check_range(level, min_txid, max_txid)
    _check_page_size(page_size)
    if body_len != len(data) - HEADER_SIZE - TRAILER_SIZE:
        raise LtxError("format", f"body length {body_len} does not match the file size {len(data)}")
    return Header(level, min_txid, max_txid, page_size, commit, page_count, timestamp_ms, wal_offset, flags)


def stored_crc(data: bytes) -> int:
    """The CRC-64 written in the trailer."""
    return int.from_bytes(data[-TRAILER_SIZE:], "big")


def verify(data: bytes) -> Header:
    """Check the trailer's CRC-64 over the whole file, then the header. Raises :class:`LtxError`."""
    if len(data) < HEADER_SIZE + TRAILER_SIZE:
        raise LtxError("format", f"file is {len(data)} bytes, shorter than a header and a trailer")
    want = stored_crc(data)
    got = crc64(data, length=len(data) - TRAILER_SIZE)
    if got != want:
        raise LtxError("checksum", f"CRC-64 mismatch: trailer says {want:016x}, content gives {got:016x}")
    return read_header(data)


def page_block(header: Header, data: bytes) -> tuple[array[int], memoryview]:
    """The page numbers and the contiguous image block of a file already passed through
    :func:`verify`, with the format checks (ascending, within ``commit``, whole pages)."""
    body = memoryview(data)[HEADER_SIZE:-TRAILER_SIZE]
    expected = header.page_count * (4 + header.page_size)
    raw: bytes | memoryview = body
    if header.compressed:
        try:
            raw = zstandard.ZstdDecompressor().decompress(body, max_output_size=expected)
        except zstandard.ZstdError as exc:
            raise LtxError("format", f"page data does not decompress: {exc}") from None
    if len(raw) != expected:
        raise LtxError("format", f"page data is {len(raw)} bytes, {header.page_count} pages need {expected}")
    if header.full and header.page_count != header.commit:
        raise LtxError("format", f"full file holds {header.page_count} pages, its database has {header.commit}")
    numbers = array("I")
    numbers.frombytes(bytes(raw[: 4 * header.page_count]))
    if sys.byteorder == "little":
        numbers.byteswap()
    last = 0
    for pgno in numbers:
        if pgno <= last or pgno > header.commit:
            raise LtxError("format", f"page number {pgno} is out of order or beyond {header.commit} pages")
        last = pgno
    return numbers, memoryview(raw)[4 * header.page_count :]


def stream_full_image(header: Header, data: bytes, chunk_pages: int = 256) -> Iterator[memoryview]:
    """The image block of a verified **full** file, in order, in chunks of whole pages, decompressed
    as it goes (no buffer the size of the database): what a restore writes at offset 0."""
    if not header.full:
        raise LtxError("format", "only a full file streams as a database image")
    body = memoryview(data)[HEADER_SIZE:-TRAILER_SIZE]
    count = header.page_count
    if not header.compressed:
        if len(body) != count * (4 + header.page_size):
            raise LtxError("format", f"page data is {len(body)} bytes, {count} pages need more")
        _check_numbers(body[: 4 * count], header)
        yield body[4 * count :]
        return
    reader = zstandard.ZstdDecompressor().stream_reader(body, read_across_frames=False)
    _check_numbers(_read_exactly(reader, 4 * count), header)
    want = count * header.page_size
    step = chunk_pages * header.page_size
    buf = bytearray(step)
    got = 0
    while got < want:
        n = reader.readinto(memoryview(buf)[: min(step, want - got)])
        if n <= 0:
            raise LtxError("format", f"page data ends after {got} of {want} bytes")
        got += n
        yield memoryview(buf)[:n]
    if reader.read(1):
        raise LtxError("format", "page data runs past its pages")


def _read_exactly(reader: Any, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = reader.read(n - len(out))
        if not chunk:
            raise LtxError("format", "page data ends inside the page numbers")
        out += chunk
    return bytes(out)


def _check_numbers(raw: bytes | memoryview, header: Header) -> None:
    numbers = array("I")
    numbers.frombytes(bytes(raw))
    if sys.byteorder == "little":
        numbers.byteswap()
    if numbers != array("I", range(1, header.commit + 1)):
        raise LtxError("format", f"a full file must number its pages 1..{header.commit} in order")


def iter_pages(header: Header, data: bytes) -> Iterator[tuple[int, bytes]]:
    """Pages of a file already passed through :func:`verify`, ascending, as bytes."""
    numbers, images = page_block(header, data)
    ps = header.page_size
    for i, pgno in enumerate(numbers):
        yield pgno, bytes(images[i * ps : (i + 1) * ps])


def decode(data: bytes) -> LtxFile:
    """Verify (CRC-64 first, then the format) and decode a whole file."""
    header = verify(data)
    pages = dict(iter_pages(header, data))
    return LtxFile(header, pages, stored_crc(data))
