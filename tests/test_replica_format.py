"""The replica file format, its CRC-64 trailer, the key layout and the WAL reader (spec §5.1; D§0, D§7)."""

from __future__ import annotations

import os
import random
import sqlite3
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.box.replica import ltx, wal
from services.box.replica.layout import (
    FileRef,
    GenerationScope,
    GenerationViolation,
    ltx_name,
    parse_ltx_name,
)

PS = 4096


def _pages(n: int, seed: int = 1, page_size: int = PS) -> list[tuple[int, bytes]]:
    rng = random.Random(seed)
    return [(i, rng.randbytes(page_size)) for i in range(1, n + 1)]


# ------------------------------------------------------------------------------------ CRC-64


def test_crc64_is_crc64_xz_and_fast_path_matches_table() -> None:
    # CRC-64/XZ (ECMA-182, reflected, init/xorout all ones): the catalogue's check value.
    assert ltx.crc64(b"123456789") == 0x995DC9BBDF1939FA
    assert ltx.crc64_py(b"123456789") == 0x995DC9BBDF1939FA
    assert ltx.crc64(b"") == 0
    data = os.urandom(10_000)
    assert ltx.crc64(data) == ltx.crc64_py(data)
    # continuing a CRC over a second buffer equals the CRC of the concatenation
    assert ltx.crc64(data[5000:], ltx.crc64(data[:5000])) == ltx.crc64(data)
    assert ltx.crc64_py(data[5000:], ltx.crc64_py(data[:5000])) == ltx.crc64(data)
    assert ltx.CRC64_IMPLEMENTATION == "liblzma", "liblzma should be loadable on this machine (fast CRC-64)"


@settings(max_examples=50, deadline=None)
@given(st.binary(max_size=3000), st.binary(max_size=3000))
def test_crc64_fast_and_pure_agree(a: bytes, b: bytes) -> None:
    assert ltx.crc64(a + b) == ltx.crc64_py(a + b) == ltx.crc64(b, ltx.crc64_py(a))


# ------------------------------------------------------------------------------------ format


@pytest.mark.parametrize("compress", [True, False])
def test_round_trip_carries_every_field(compress: bool) -> None:
    pages = _pages(5)
    data = ltx.encode(level=3, min_txid=7, max_txid=12, page_size=PS, commit=9, pages=reversed(pages),
                      timestamp_ms=1_700_000_000_123, wal_offset=32, compress=compress)
    f = ltx.decode(data)
    assert f.header == ltx.Header(3, 7, 12, PS, 9, 5, 1_700_000_000_123, 32,
                                  ltx.FLAG_ZSTD if compress else 0)
    assert dict(f.pages) == dict(pages)
    assert f.crc64 == ltx.crc64(data[:-8])
    assert not f.header.full


def test_full_file_and_compression() -> None:
    pages = [(i, bytes([i % 251]) * PS) for i in range(1, 65)]  # compressible pages
    data = ltx.encode(level=9, min_txid=1, max_txid=40, page_size=PS, commit=64, pages=pages,
                      timestamp_ms=5, full=True)
    header = ltx.verify(data)
    assert header.full and header.compressed and header.page_count == 64
    assert len(data) < 64 * PS // 20, "identical-byte pages must compress"
    with pytest.raises(ltx.LtxError, match="full file must hold every page"):
        ltx.encode(level=9, min_txid=1, max_txid=40, page_size=PS, commit=65, pages=pages, timestamp_ms=5,
                   full=True)


@pytest.mark.parametrize("compress", [True, False])
def test_a_full_image_streams_back_in_order(compress: bool) -> None:
    image = b"".join(img for _, img in _pages(700, seed=3, page_size=1024))
    data = ltx.encode_image(image, level=9, min_txid=1, max_txid=9, page_size=1024, timestamp_ms=1,
                            compress=compress)
    header = ltx.verify(data)
    assert header.full and header.commit == 700
    assert b"".join(bytes(c) for c in ltx.stream_full_image(header, data, chunk_pages=64)) == image
    assert dict(ltx.iter_pages(header, data)) == {i + 1: image[i * 1024:(i + 1) * 1024] for i in range(700)}
    partial = ltx.encode(level=0, min_txid=2, max_txid=2, page_size=1024, commit=700,
                         pages=[(5, image[:1024])], timestamp_ms=1)
    with pytest.raises(ltx.LtxError, match="only a full file"):
        list(ltx.stream_full_image(ltx.verify(partial), partial))


def test_encoding_is_deterministic_and_depends_on_the_timestamp() -> None:
    """A replayed build encodes identical bytes from the same inputs (spec §5.1 step 2, R6-5)."""
    kw = dict(level=9, min_txid=1, max_txid=3, page_size=PS, commit=4, pages=_pages(4), full=True)
    a = ltx.encode(timestamp_ms=100, **kw)  # type: ignore[arg-type]
    b = ltx.encode(timestamp_ms=100, **kw)  # type: ignore[arg-type]
    c = ltx.encode(timestamp_ms=101, **kw)  # type: ignore[arg-type]
    assert a == b
    assert a != c


def test_every_flipped_byte_fails_the_trailer() -> None:
    data = ltx.encode(level=0, min_txid=4, max_txid=4, page_size=512, commit=3, pages=_pages(3, page_size=512),
                      timestamp_ms=1)
    rng = random.Random(7)
    positions = {0, 5, len(data) // 2, len(data) - 9, len(data) - 1} | {rng.randrange(len(data)) for _ in range(40)}
    for pos in sorted(positions):
        bad = bytearray(data)
        bad[pos] ^= 0x40
        with pytest.raises(ltx.LtxError) as err:
            ltx.decode(bytes(bad))
        assert err.value.reason == "checksum", pos
    with pytest.raises(ltx.LtxError) as err:
        ltx.decode(data[:-3])
    assert err.value.reason == "checksum"
    with pytest.raises(ltx.LtxError) as err:
        ltx.decode(data[:20])
    assert err.value.reason == "format"


def test_a_valid_trailer_over_a_lying_header_is_still_refused() -> None:
    data = bytearray(ltx.encode(level=0, min_txid=4, max_txid=4, page_size=512, commit=3,
                                pages=_pages(3, page_size=512), timestamp_ms=1, compress=False))
    data[20:24] = (99).to_bytes(4, "big")  # page_count
    body = bytes(data[:-8])
    forged = body + ltx.crc64(body).to_bytes(8, "big")
    header = ltx.verify(forged)
    with pytest.raises(ltx.LtxError, match="pages need"):
        list(ltx.iter_pages(header, forged))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(pages=[(5, bytes(PS))], commit=4), "beyond the database size"),
        (dict(pages=[(1, bytes(100))], commit=4), "not the page size"),
        (dict(pages=[(1, bytes(PS)), (1, bytes(PS))], commit=4), "appears twice"),
        (dict(pages=[], commit=4, page_size=3000), "power of two"),
        (dict(pages=[], commit=4, min_txid=0), "range"),
        (dict(pages=[], commit=4, level=10), "level"),
    ],
)
def test_encode_refuses_malformed_input(kwargs: dict[str, object], message: str) -> None:
    base: dict[str, object] = dict(level=0, min_txid=1, max_txid=1, page_size=PS, timestamp_ms=0)
    base.update(kwargs)
    with pytest.raises(ltx.LtxError, match=message):
        ltx.encode(**base)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------ layout


def test_key_layout_is_the_pinned_clients() -> None:
    """Spec §5.1: a snapshot ending at 7 and a level-0 file for 8, under g-<op>/ or the location."""
    assert ltx_name(9, 1, 7) == "0009/0000000000000001-0000000000000007.ltx"
    assert ltx_name(0, 8, 8) == "0000/0000000000000008-0000000000000008.ltx"
    assert ltx_name(2, 0x1F, 0x2A0) == "0002/000000000000001f-00000000000002a0.ltx"
    op = GenerationScope("instances/h1/" + "a" * 64 + "/", "mv_0123456789abcdefghijklmnop")
    assert op.prefix == f"instances/h1/{'a' * 64}/g-mv_0123456789abcdefghijklmnop/"
    assert op.ltx_key(9, 1, 7) == op.prefix + "0009/0000000000000001-0000000000000007.ltx"
    assert op.install_key == op.prefix + "install.json"
    assert op.build_intent_key == op.prefix + "build-intent.json"
    origin = GenerationScope("instances/h1", "")
    assert origin.prefix == "instances/h1/"
    assert GenerationScope("instances/h1", "@root") == origin, "'' and '@root' are one origin"
    with pytest.raises(ValueError, match="origin generation has no"):
        _ = origin.install_key


def test_scopes_never_read_or_write_each_others_keys() -> None:
    """A writer is bound to its generation (§5.1 step 9): parse and check_owned both enforce it."""
    origin = GenerationScope("instances/h1", "")
    a = GenerationScope("instances/h1", "mv_a")
    ab = GenerationScope("instances/h1", "mv_ab")
    key_a = a.ltx_key(0, 3, 3)
    assert a.parse(key_a) == FileRef(0, 3, 3, key_a)
    assert origin.parse(key_a) is None, "the origin must not adopt g-*/ keys"
    assert ab.parse(key_a) is None and a.parse(ab.ltx_key(0, 3, 3)) is None
    assert origin.parse(origin.ltx_key(9, 1, 4)) == FileRef(9, 1, 4, origin.ltx_key(9, 1, 4))
    for bad in [ab.ltx_key(0, 3, 3), origin.ltx_key(0, 1, 1), "instances/h1/generation.json",
                a.prefix + "0000/x.ltx", a.prefix + "../" + ltx_name(0, 1, 1), "elsewhere/" + ltx_name(0, 1, 1)]:
        with pytest.raises(GenerationViolation):
            a.check_owned(bad)
    a.check_owned(key_a)
    a.check_owned(a.install_key)
    with pytest.raises(GenerationViolation):
        origin.check_owned(origin.prefix + "install.json")
    assert parse_ltx_name("0010/0000000000000001-0000000000000001.ltx") is None  # level 10
    assert parse_ltx_name("0000/0000000000000002-0000000000000001.ltx") is None  # min > max
    assert parse_ltx_name("0000/0000000000000000-0000000000000001.ltx") is None  # TXID 0
    with pytest.raises(ValueError, match="plain identifier"):
        GenerationScope("instances/h1", "mv/../x")


# ------------------------------------------------------------------------------------ WAL reader


def _wal_db(path: Path) -> sqlite3.Connection:
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA wal_autocheckpoint=0")
    conn.execute("CREATE TABLE t(id INTEGER PRIMARY KEY, v BLOB)")
    return conn


def test_wal_frames_up_to_mxframe_rebuild_the_database(tmp_path: Path) -> None:
    """The pages of frames (0, mxFrame] over an empty file are exactly what SQLite reads."""
    db = tmp_path / "a.db"
    conn = _wal_db(db)
    for i in range(40):
        conn.execute("INSERT INTO t VALUES (?, ?)", (i, os.urandom(700)))
    conn.execute("UPDATE t SET v = x'00' WHERE id % 3 = 0")
    # descriptors stay open while this process has a connection (closing one drops its locks)
    shm_fd = os.open(wal.shm_path(db), os.O_RDONLY)
    fd = os.open(wal.wal_path(db), os.O_RDONLY)
    shm = wal.read_shm_header(shm_fd)
    assert shm is not None and shm.mx_frame > 0
    try:
        header = wal.read_wal_header(fd)
        assert header is not None and header.salts == shm.salts and header.page_size == PS
        cap = wal.read_frames(fd, header, 0, shm.mx_frame, 0)
        # the checksum chain SQLite wrote validates frame by frame, and nothing follows mxFrame
        assert wal.frame_extends_epoch(fd, header.salts, b"\0" * 8, PS, shm.mx_frame + 1, cap.last_checksum,
                                       header.big_endian_checksum) is False
        conn.execute("BEGIN")
        image = conn.serialize()
        conn.execute("COMMIT")
        conn.close()
    finally:
        os.close(fd)
        os.close(shm_fd)
    assert cap.commit == len(image) // PS
    assert cap.pages == {i + 1: image[i * PS:(i + 1) * PS] for i in range(cap.commit)}


def test_frames_beyond_mxframe_are_not_read_and_a_moved_wal_is_detected(tmp_path: Path) -> None:
    db = tmp_path / "b.db"
    conn = _wal_db(db)
    conn.execute("INSERT INTO t VALUES (1, x'01')")
    shm_fd = os.open(wal.shm_path(db), os.O_RDONLY)
    fd = os.open(wal.wal_path(db), os.O_RDONLY)
    shm = wal.read_shm_header(shm_fd)
    assert shm is not None
    conn.execute("BEGIN")
    conn.execute("INSERT INTO t VALUES (2, ?)", (os.urandom(9000),))
    conn.execute("ROLLBACK")  # frames may have spilled; they are not committed
    try:
        header = wal.read_wal_header(fd)
        assert header is not None
        after = wal.read_shm_header(shm_fd)
        assert after is not None and after.mx_frame == shm.mx_frame
        wrong = wal.WalHeader(header.page_size, header.checkpoint_seq, b"\x01" * 8, header.checksum,
                              header.big_endian_checksum)
        with pytest.raises(wal.WalChanged):
            wal.read_frames(fd, wrong, 0, shm.mx_frame, 0)
        with pytest.raises(wal.WalChanged):
            wal.read_frames(fd, header, 0, shm.mx_frame + 50, 0)
        conn.close()
    finally:
        os.close(fd)
        os.close(shm_fd)
