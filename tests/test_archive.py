"""The move archive and its sealing (spec §8, §10, §20 M-C14/M-C15; digest D§9), on real files.

Real directories, modes, owners and times on disk; a real FIFO, unix socket and device node; real
P-256 keys in real PEM files. Tampering is done on the real sealed bytes and manifests.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import socket
import stat
import tarfile
import threading
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest
import zstandard
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from hypothesis import given, settings
from hypothesis import strategies as st

from kernel.ports import SeededRandom
from services.box.artifacts import archive as A
from services.box.artifacts import sealing as S

HOST = "shop.example.com"
OP = "mv_" + "a" * 26
INC = "ab" * 32
SMALL_CHUNK = 4096


@pytest.fixture(scope="module")
def key() -> S.PrivateKey:
    return S.generate_private_key()


def build(files: Path, env: Path | None, key: S.PrivateKey, **kw: object) -> tuple[A.ArchiveManifest, bytes]:
    out = io.BytesIO()
    opts: dict[str, object] = {"host": HOST, "op_id": OP, "incarnation": INC, "chunk_size": SMALL_CHUNK} | kw
    m = A.build_archive(files, env, out, key.public_key(), **opts)  # type: ignore[arg-type]
    return m, out.getvalue()


def write(path: Path, data: bytes, mode: int | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    if mode is not None:
        os.chmod(path, mode)


def host_tree(root: Path, seed: int = 7) -> tuple[Path, Path]:
    """A files directory with nested and empty folders, modes, an empty file and binary data; and .env."""
    rng = SeededRandom(seed)
    files = root / "files"
    files.mkdir(parents=True)
    write(files / "README.txt", b"hello\n", 0o644)
    write(files / "uploads" / "2026" / "11" / "photo.bin", rng.token_bytes(50_000), 0o640)
    write(files / "uploads" / "big.bin", rng.token_bytes(3 * SMALL_CHUNK + 17), 0o600)
    write(files / "scripts" / "run.sh", b"#!/bin/sh\necho hi\n", 0o755)
    write(files / "empty-file", b"", 0o444)
    write(files / "caf\u00e9 menu.txt", "cr\u00e8me br\u00fbl\u00e9e\n".encode(), 0o644)
    write(files / ("long-" + "n" * 150) / "deep.txt", b"a long path needs a PAX header\n")
    (files / "empty-dir").mkdir()
    (files / "locked").mkdir()
    write(files / "locked" / "inside.txt", b"read only folder\n")
    os.chmod(files / "locked", 0o555)
    os.chmod(files / "scripts", 0o700)
    write(files / "a.txt", b"sorts between the folder a and a/b\n")
    write(files / "a" / "b", b"nested\n")
    write(files / A.MARKER, b"g-previous\n")  # F5: never archived
    env = root / ".env"
    write(env, b"CARLOS_ADMIN_TOKEN=secret-token\nFOO=bar\n", 0o600)
    return files, env


def snapshot(root: Path) -> dict[str, tuple[str, int, bytes]]:
    """Every path under ``root``: (kind, permission bits, content)."""
    out: dict[str, tuple[str, int, bytes]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            st_ = os.lstat(path)
            rel = str(path.relative_to(root))
            if stat.S_ISDIR(st_.st_mode):
                out[rel] = ("dir", stat.S_IMODE(st_.st_mode), b"")
            else:
                assert stat.S_ISREG(st_.st_mode), rel
                out[rel] = ("file", stat.S_IMODE(st_.st_mode), path.read_bytes())
    return out


# -- the round trip -------------------------------------------------------------------------------


def test_round_trip_restores_every_file_folder_and_mode(tmp_path: Path, key: S.PrivateKey) -> None:
    files, env = host_tree(tmp_path / "src")
    m, sealed = build(files, env, key)

    expected = snapshot(files)
    del expected[A.MARKER]
    dest = tmp_path / "restored"
    again = A.extract(sealed, A.manifest_bytes(m), key, dest, expect_op=OP, expect_incarnation=INC)
    assert again == m
    assert snapshot(dest / "files") == expected
    assert (dest / ".env").read_bytes() == env.read_bytes()
    assert stat.S_IMODE(os.lstat(dest / ".env").st_mode) == 0o600
    assert stat.S_IMODE(os.lstat(dest).st_mode) == 0o700  # the container stays private
    assert sorted(os.listdir(dest)) == [".env", "files"]

    # The manifest (§8.2): digests of what was streamed, the per-file list, op and incarnation.
    assert m.op == OP and m.incarnation == INC and m.compression == "zstd" and m.chunk_size == SMALL_CHUNK
    assert m.sealed == hashlib.sha256(sealed).hexdigest() and m.sealed_bytes == len(sealed)
    listed = {f.path: (f.size, f.sha256) for f in m.files}
    assert listed[".env"] == (len(env.read_bytes()), hashlib.sha256(env.read_bytes()).hexdigest())
    for rel, (kind, _, data) in expected.items():
        if kind == "file":
            assert listed.pop(f"files/{rel}") == (len(data), hashlib.sha256(data).hexdigest())
    assert set(listed) == {".env"}
    assert m.entries == len(expected) + 2  # every entry, the files folder and .env
    assert [f.path for f in m.files] == sorted(f.path for f in m.files)

    # The plaintext is a PAX tar in sorted order, owners and times zeroed, modes kept.
    plain = A.plain_digest(files, env, host=HOST)
    assert (plain.plain, plain.bytes, plain.entries, plain.files) == (m.plain, m.bytes, m.entries, m.files)
    assert m.files_digest() == msgspec.structs.replace(plain.files_digest(), sealed=m.sealed)
    decoded = A.decode_manifest(A.manifest_bytes(m))
    assert decoded == m and A.manifest_bytes(decoded) == A.manifest_bytes(m)


def test_the_plaintext_is_a_sorted_pax_tar_with_owners_and_times_zeroed(tmp_path: Path) -> None:
    files, env = host_tree(tmp_path)
    sink = _Capture()
    entries = A._scan(files, env, HOST)
    A._stream_tar(entries, sink, HOST, A.DEFAULT_CAP, hashlib.sha256())
    with tarfile.open(fileobj=io.BytesIO(bytes(sink.data)), mode="r:") as tar:
        members = tar.getmembers()
    names = [mem.name for mem in members]
    assert names == sorted(names) and names[:2] == [".env", "files"]
    assert "files/" + A.MARKER not in names
    assert all((mem.uid, mem.gid, mem.uname, mem.gname, mem.mtime) == (0, 0, "", "", 0) for mem in members)
    by_name = {mem.name: mem for mem in members}
    assert by_name["files/scripts/run.sh"].mode == 0o755 and by_name["files/locked"].mode == 0o555
    assert by_name["files/empty-dir"].isdir() and by_name["files/empty-file"].size == 0
    assert any(len(n) > 100 for n in names)  # the long path round-trips through a PAX header


class _Capture:
    def __init__(self) -> None:
        self.data = bytearray()

    def write(self, data: bytes | bytearray) -> None:
        self.data += data


def test_files_gen_marker_is_excluded_only_at_the_top(tmp_path: Path, key: S.PrivateKey) -> None:
    files, env = host_tree(tmp_path / "src")
    with_marker = A.plain_digest(files, env, host=HOST)
    (files / A.MARKER).unlink()
    without = A.plain_digest(files, env, host=HOST)
    assert with_marker == without
    (files / A.MARKER).write_bytes(b"g-other\n")
    assert A.plain_digest(files, env, host=HOST) == without

    write(files / "uploads" / A.MARKER, b"an app file that happens to share the name\n")
    m, sealed = build(files, env, key)
    assert "files/uploads/" + A.MARKER in {f.path for f in m.files}
    assert "files/" + A.MARKER not in {f.path for f in m.files}
    A.extract(sealed, m, key, tmp_path / "out")
    assert not (tmp_path / "out" / "files" / A.MARKER).exists()
    assert (tmp_path / "out" / "files" / "uploads" / A.MARKER).exists()


def test_equal_content_gives_equal_plain_and_different_sealed(tmp_path: Path, key: S.PrivateKey) -> None:
    one_files, one_env = host_tree(tmp_path / "one")
    two_files, two_env = host_tree(tmp_path / "two")
    for dirpath, dirnames, filenames in os.walk(two_files):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            os.chown(path, 1234, 5678, follow_symlinks=False)
            os.utime(path, (1_000_000, 1_000_000), follow_symlinks=False)
    os.chown(two_env, 4321, 8765)
    os.utime(two_env, (2_000_000, 2_000_000))
    assert os.stat(two_files / "README.txt").st_mtime != os.stat(one_files / "README.txt").st_mtime

    m1, s1 = build(one_files, one_env, key)
    m2, s2 = build(two_files, two_env, key)
    again, s3 = build(one_files, one_env, key)
    assert m1.plain == m2.plain == again.plain and m1.files == m2.files
    assert len({m1.sealed, m2.sealed, again.sealed}) == 3  # randomized: never deterministic (§8.2)
    assert len({s1, s2, s3}) == 3 and m1.key != again.key

    os.chmod(two_files / "README.txt", 0o600)  # modes are content
    assert A.plain_digest(two_files, two_env, host=HOST).plain != m1.plain
    for i, (m, s) in enumerate(((m1, s1), (m2, s2), (again, s3))):
        A.extract(s, m, key, tmp_path / f"out{i}")


def test_an_empty_files_directory_without_env_round_trips(tmp_path: Path, key: S.PrivateKey) -> None:
    files = tmp_path / "files"
    files.mkdir(mode=0o750)
    os.chmod(files, 0o750)
    m, sealed = build(files, None, key)
    assert m.files == () and m.entries == 1
    A.extract(sealed, m, key, tmp_path / "out")
    assert os.listdir(tmp_path / "out") == ["files"]
    assert stat.S_IMODE(os.lstat(tmp_path / "out" / "files").st_mode) == 0o750


# -- refusals at build time -----------------------------------------------------------------------


def _symlink(p: Path) -> None:
    os.symlink("../README.txt", p)


def _dir_symlink(p: Path) -> None:
    os.symlink("/etc", p)


def _fifo(p: Path) -> None:
    os.mkfifo(p)


def _socket(p: Path) -> None:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(p))
    s.close()  # the socket file stays on disk


def _device(mode: int, device: int) -> Callable[[Path], None]:
    def make(p: Path) -> None:
        try:
            os.mknod(p, mode | 0o600, device)
        except PermissionError:  # no CAP_MKNOD here: the scan's refusal is the FIFO's; what differs is its name
            raise _NoDeviceNode(mode) from None

    return make


class _NoDeviceNode(Exception):
    def __init__(self, mode: int) -> None:
        self.mode = mode


_char_device = _device(stat.S_IFCHR, os.makedev(1, 3))
_block_device = _device(stat.S_IFBLK, os.makedev(7, 0))


@pytest.mark.parametrize(
    ("make", "kind"),
    [
        (_symlink, "a symbolic link"),
        (_dir_symlink, "a symbolic link"),
        (_fifo, "a FIFO"),
        (_socket, "a socket"),
        (_char_device, "a character device"),
        (_block_device, "a block device"),
    ],
)
def test_anything_but_files_and_folders_refuses_with_its_name(
    tmp_path: Path, key: S.PrivateKey, make: Callable[[Path], None], kind: str
) -> None:
    files, env = host_tree(tmp_path / "h")
    try:
        make(files / "uploads" / "2026" / "odd")
    except _NoDeviceNode as no_node:  # the machine cannot make one: the scan names the mode it would have seen
        assert A._kind(no_node.mode | 0o600) == kind
        return
    out = io.BytesIO()
    with pytest.raises(A.UnsupportedEntry) as caught:
        A.build_archive(files, env, out, key.public_key(), host=HOST, op_id=OP, incarnation=INC)
    assert caught.value.path == "uploads/2026/odd" and caught.value.kind == kind
    assert str(caught.value) == (
        f"{HOST} keeps a file this move cannot copy: uploads/2026/odd. Only regular files and folders move."
    )
    assert out.getvalue() == b""  # refused from the scan, before any content was read or sealed
    with pytest.raises(A.UnsupportedEntry):
        A.plain_digest(files, env, host=HOST)


def test_a_symlinked_env_or_files_directory_refuses(tmp_path: Path) -> None:
    files, env = host_tree(tmp_path / "h")
    real_env = tmp_path / "real.env"
    env.rename(real_env)
    env.symlink_to(real_env)
    with pytest.raises(A.UnsupportedEntry) as caught:
        A.plain_digest(files, env, host=HOST)
    assert caught.value.path == ".env" and caught.value.kind == "a symbolic link"

    linked = tmp_path / "linked-files"
    linked.symlink_to(files)
    with pytest.raises(A.UnsupportedEntry):
        A.plain_digest(linked, None, host=HOST)
    with pytest.raises(A.ArchiveMissing, match="does not exist"):
        A.plain_digest(tmp_path / "nope", None, host=HOST)


def test_a_name_that_is_not_utf8_refuses(tmp_path: Path) -> None:
    files = tmp_path / "files"
    files.mkdir()
    (files / "ok.txt").write_bytes(b"x")
    with open(os.path.join(os.fsencode(files), b"bad-\xff.txt"), "wb") as f:
        f.write(b"x")
    with pytest.raises(A.UnsupportedEntry) as caught:
        A.plain_digest(files, None, host=HOST)
    assert caught.value.path == "bad-\\xff.txt"


@pytest.mark.parametrize("pipelined", [True, False])
def test_the_cap_refuses_while_streaming(tmp_path: Path, key: S.PrivateKey, pipelined: bool) -> None:
    files = tmp_path / "files"
    rng = SeededRandom(3)
    for i in range(10):
        write(files / f"part-{i}.bin", rng.token_bytes(64 * 1024))
    total = 10 * 64 * 1024
    cap = 200 * 1024
    before = threading.active_count()

    class Counting:
        def __init__(self) -> None:
            self.bytes = 0

        def write(self, data: bytes) -> int:
            self.bytes += len(data)
            return len(data)

    out = Counting()
    with pytest.raises(A.ArchiveTooLarge) as caught:
        A.build_archive(
            files, None, out, key.public_key(), host=HOST, op_id=OP, incarnation=INC, cap=cap, pipelined=pipelined
        )
    assert threading.active_count() == before  # the pipeline's workers stopped with the refusal
    err = caught.value
    assert (
        str(err) == f"{HOST} keeps more than 200 KiB of files beside its database. Keep large files in object storage."
    )
    # It stopped at the entry that would pass the cap: three files read of ten, nothing past the cap.
    assert err.read_bytes == 3 * 64 * 1024 < total
    assert err.plain_bytes <= cap and err.path == "part-3.bin"
    assert out.bytes < total

    # The default is 256 MiB, in the copy as the spec words it.
    assert A.DEFAULT_CAP == 256 << 20
    assert "256 MiB" in str(A.ArchiveTooLarge(HOST, A.DEFAULT_CAP, 0, 0, "x"))


def test_the_cap_refuses_mid_stream_with_blocks_in_flight(tmp_path: Path, key: S.PrivateKey) -> None:
    """Whole 1 MiB reads are in the compress and seal stages when the refusal comes: it still stops
    before the entry past the cap is read, and no worker outlives it (M5, M-C15)."""
    files = tmp_path / "files"
    rng = SeededRandom(8)
    for i in range(6):
        write(files / f"clip-{i}.bin", rng.token_bytes(3 << 20))
    cap = 10 << 20
    before = threading.active_count()
    out = io.BytesIO()
    with pytest.raises(A.ArchiveTooLarge) as caught:
        A.build_archive(files, None, out, key.public_key(), host=HOST, op_id=OP, incarnation=INC, cap=cap)
    assert caught.value.read_bytes == 3 * (3 << 20) and caught.value.path == "clip-3.bin"
    assert len(out.getvalue()) < caught.value.read_bytes + (64 << 10)  # nothing past what was read got out
    with pytest.raises(A.ArchiveTooLarge):
        A.plain_digest(files, None, host=HOST, cap=cap)
    assert threading.active_count() == before


def test_the_cap_is_exact_on_the_tar_plaintext(tmp_path: Path, key: S.PrivateKey) -> None:
    files, env = host_tree(tmp_path / "h")
    exact = A.plain_digest(files, env, host=HOST).bytes
    assert A.plain_digest(files, env, host=HOST, cap=exact).bytes == exact
    with pytest.raises(A.ArchiveTooLarge):
        A.plain_digest(files, env, host=HOST, cap=exact - 1)
    m, sealed = build(files, env, key, cap=exact)
    # The extractor holds the same cap: a manifest past it, or plaintext that expands past it, refuses.
    with pytest.raises(A.ArchiveInvalid) as caught:
        A.extract(sealed, m, key, tmp_path / "out", cap=exact - 1)
    assert caught.value.reason == "too_large"
    lying = msgspec.structs.replace(m, bytes=100)
    with pytest.raises(A.ArchiveInvalid) as caught:
        A.extract(sealed, lying, key, tmp_path / "out", cap=1000)
    assert caught.value.reason == "too_large" and "expands past the cap" in str(caught.value)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("change", "how"), [("append", "grew"), ("truncate", "shrank")])
def test_a_file_that_changes_while_archived_refuses(tmp_path: Path, change: str, how: str) -> None:
    files = tmp_path / "files"
    write(files / "log.txt", b"x" * (3 << 20))  # larger than one read, so the sink runs mid-file
    entries = A._scan(files, None, HOST)

    class Changing:
        def write(self, data: bytes | bytearray) -> None:
            with open(files / "log.txt", "r+b") as f:
                if change == "append":
                    f.seek(0, 2)
                    f.write(b"more")
                else:
                    f.truncate(1 << 20)

    with pytest.raises(A.ArchiveChanged, match=f"{how} while it was being archived"):
        A._stream_tar(entries, Changing(), HOST, A.DEFAULT_CAP, hashlib.sha256())


def test_a_failing_sink_stops_the_build_without_leaking_its_worker(tmp_path: Path, key: S.PrivateKey) -> None:
    files = tmp_path / "files"
    write(files / "big.bin", SeededRandom(4).token_bytes(6 << 20))

    class Full:
        def __init__(self) -> None:
            self.calls = 0

        def write(self, data: bytes) -> int:
            self.calls += 1
            if self.calls == 2:
                raise OSError(28, "No space left on device")
            return len(data)

    before = threading.active_count()
    with pytest.raises(OSError, match="No space left"):
        A.build_archive(files, None, Full(), key.public_key(), host=HOST, op_id=OP, incarnation=INC)
    assert threading.active_count() == before


def open_plaintext(sealed: bytes, m: A.ArchiveManifest, key: S.PrivateKey) -> bytes:
    """The tar plaintext inside a sealed archive, opened by hand (key, chunks, zstd)."""
    data_key = S.open_key(m.key, key, aad=A.key_binding(m.op, m.incarnation))
    opener = S.ChunkOpener(data_key, m.chunk_size)
    packed = b"".join(opener.feed(sealed)) + opener.finish()
    return zstandard.ZstdDecompressor().decompressobj().decompress(packed)


def the_tar(files: Path, env: Path | None) -> bytes:
    sink = _Capture()
    A._stream_tar(A._scan(files, env, HOST), sink, HOST, A.DEFAULT_CAP, None)
    return bytes(sink.data)


@pytest.mark.parametrize("chunk_size", [SMALL_CHUNK, S.DEFAULT_CHUNK_SIZE])
def test_the_pipeline_gives_the_serial_path_s_bytes(tmp_path: Path, key: S.PrivateKey, chunk_size: int) -> None:
    files, env = host_tree(tmp_path / "h")
    rng = SeededRandom(11)
    write(files / "media" / "clip.bin", rng.token_bytes((5 << 20) + 3))  # whole reads, passed on uncopied
    write(files / "media" / "notes.txt", b"the same words again\n" * 150_000)  # compresses: zstd holds bytes back
    for i in range(300):
        write(files / "uploads" / f"{i:03d}.dat", rng.token_bytes(i * 37))  # gathered into blocks
    m, sealed = build(files, env, key, chunk_size=chunk_size, rng=SeededRandom(5), pipelined=True)
    serial_m, serial_sealed = build(files, env, key, chunk_size=chunk_size, rng=SeededRandom(5), pipelined=False)
    # Same seed, same key and nonces: the pipeline and the serial path give the very same object.
    assert sealed == serial_sealed and m == serial_m
    tar = the_tar(files, env)
    assert open_plaintext(sealed, m, key) == tar
    assert m.plain == hashlib.sha256(tar).hexdigest() and m.bytes == len(tar)
    assert m.sealed == hashlib.sha256(sealed).hexdigest() and m.sealed_bytes == len(sealed)
    assert A.plain_digest(files, env, host=HOST) == A.PlainDigest(m.plain, m.bytes, m.entries, m.files)
    A.extract(sealed, m, key, tmp_path / "out")
    clip = Path("files") / "media" / "clip.bin"
    assert (tmp_path / "out" / clip).read_bytes() == (files.parent / clip).read_bytes()


def _tarfile_header(name: str, is_dir: bool, mode: int, size: int) -> bytes:
    info = tarfile.TarInfo(name)
    info.type = tarfile.DIRTYPE if is_dir else tarfile.REGTYPE
    info.mode, info.size, info.mtime, info.uid, info.gid, info.uname, info.gname = mode, size, 0, 0, 0, "", ""
    return info.tobuf(tarfile.PAX_FORMAT, "utf-8", "strict")


@settings(max_examples=300, deadline=None)
@given(
    name=st.one_of(
        st.text(st.characters(codec="ascii", exclude_characters="\0/"), min_size=1, max_size=100),
        st.text(st.characters(codec="utf-8", exclude_characters="\0/"), min_size=1, max_size=120),
    ),
    is_dir=st.booleans(),
    mode=st.integers(min_value=0, max_value=0o7777),
    size=st.one_of(st.integers(min_value=0, max_value=1 << 30), st.sampled_from([8**11 - 1, 8**11, 1 << 40])),
)
def test_the_tar_header_is_byte_for_byte_tarfile_s(name: str, is_dir: bool, mode: int, size: int) -> None:
    """§8.1's plaintext must not change with how its headers are made: the direct encoding of short ASCII
    names equals ``tarfile``'s PAX_FORMAT header (every other name goes through ``tarfile`` itself)."""
    path = f"files/{name}"
    assert A._header(path, is_dir, stat.S_IFDIR | mode if is_dir else stat.S_IFREG | mode, size) == (
        _tarfile_header(path, is_dir, mode, 0 if is_dir else size)
    )


@pytest.mark.parametrize("length", [98, 99, 100, 101])
def test_the_tar_header_at_the_name_field_s_edge(length: int) -> None:
    name = "files/" + "n" * (length - len("files/"))
    for is_dir in (False, True):
        assert A._header(name, is_dir, 0o755, 7) == _tarfile_header(name, is_dir, 0o755, 0 if is_dir else 7)


# -- verification at extraction -------------------------------------------------------------------


@pytest.fixture()
def sealed_tree(tmp_path: Path, key: S.PrivateKey) -> tuple[A.ArchiveManifest, bytes]:
    files, env = host_tree(tmp_path / "src")
    m, sealed = build(files, env, key)
    assert m.sealed_bytes > 8 * (SMALL_CHUNK + S.TAG_BYTES)  # several chunks to cut, swap and flip
    return m, sealed


def chunks_of(sealed: bytes, size: int = SMALL_CHUNK) -> list[bytes]:
    whole = size + S.TAG_BYTES
    return [sealed[i : i + whole] for i in range(0, len(sealed), whole)]


def refused(tmp_path: Path, sealed: bytes, m: A.ArchiveManifest | bytes, key: S.PrivateKey) -> A.ArchiveInvalid:
    dest = tmp_path / "dest"
    with pytest.raises(A.ArchiveInvalid) as caught:
        A.extract(sealed, m, key, dest)
    assert not dest.exists()
    assert [p for p in os.listdir(tmp_path) if ".partial-" in p] == []  # the staging directory is gone
    return caught.value


def test_a_wrong_private_key_fails(tmp_path: Path, sealed_tree: tuple[A.ArchiveManifest, bytes]) -> None:
    m, sealed = sealed_tree
    err = refused(tmp_path, sealed, m, S.generate_private_key())
    assert err.reason == "wrong_key" and "does not open with this secrets key" in str(err)


def test_a_truncated_object_fails(
    tmp_path: Path, key: S.PrivateKey, sealed_tree: tuple[A.ArchiveManifest, bytes]
) -> None:
    m, sealed = sealed_tree
    parts = chunks_of(sealed)
    assert refused(tmp_path, sealed[:-1], m, key).reason == "chunk"
    assert refused(tmp_path, b"".join(parts[:-1]), m, key).reason == "chunk"  # cut at a chunk boundary
    assert refused(tmp_path, b"".join(parts[:3]), m, key).reason == "chunk"
    assert refused(tmp_path, b"", m, key).reason == "chunk"
    assert refused(tmp_path, sealed + b"\0" * 20, m, key).reason == "chunk"  # and nothing may follow


def test_reordered_chunks_fail(tmp_path: Path, key: S.PrivateKey, sealed_tree: tuple[A.ArchiveManifest, bytes]) -> None:
    m, sealed = sealed_tree
    parts = chunks_of(sealed)
    swapped = [parts[1], parts[0], *parts[2:]]
    assert refused(tmp_path, b"".join(swapped), m, key).reason == "chunk"
    dropped = [parts[0], *parts[2:]]
    assert refused(tmp_path, b"".join(dropped), m, key).reason == "chunk"
    repeated = [parts[0], parts[0], *parts[1:]]
    assert refused(tmp_path, b"".join(repeated), m, key).reason == "chunk"


@pytest.mark.parametrize("where", [0, 100, 5000, -17, -1])
def test_a_flipped_byte_fails(
    tmp_path: Path, key: S.PrivateKey, sealed_tree: tuple[A.ArchiveManifest, bytes], where: int
) -> None:
    m, sealed = sealed_tree
    bad = bytearray(sealed)
    bad[where] ^= 0x01
    assert refused(tmp_path, bytes(bad), m, key).reason == "chunk"


def test_a_tampered_manifest_fails(
    tmp_path: Path, key: S.PrivateKey, sealed_tree: tuple[A.ArchiveManifest, bytes]
) -> None:
    m, sealed = sealed_tree
    # The key is bound to the op id and the incarnation: moving a manifest to another op does not open.
    assert refused(tmp_path, sealed, msgspec.structs.replace(m, op="mv_" + "b" * 26), key).reason == "wrong_key"
    assert refused(tmp_path, sealed, msgspec.structs.replace(m, incarnation="cd" * 32), key).reason == "wrong_key"
    assert refused(tmp_path, sealed, msgspec.structs.replace(m, plain="0" * 64), key).reason == "plain_digest"
    assert refused(tmp_path, sealed, msgspec.structs.replace(m, sealed="0" * 64), key).reason == "sealed_digest"
    assert refused(tmp_path, sealed, msgspec.structs.replace(m, chunk_size=SMALL_CHUNK * 2), key).reason == "chunk"
    edited = msgspec.structs.replace(m.files[1], sha256="1" * 64)
    files = (m.files[0], edited, *m.files[2:])
    assert refused(tmp_path, sealed, msgspec.structs.replace(m, files=files), key).reason == "file_list"
    assert refused(tmp_path, sealed, msgspec.structs.replace(m, files=m.files[:-1]), key).reason == "file_list"
    assert refused(tmp_path, sealed, msgspec.structs.replace(m, entries=m.entries + 1), key).reason == "counts"
    assert refused(tmp_path, sealed, b'{"format":"hostmove-archive-v1"}', key).reason == "manifest"
    assert refused(tmp_path, sealed, A.manifest_bytes(m)[:-1], key).reason == "manifest"
    with pytest.raises(A.ArchiveInvalid) as caught:
        A.extract(sealed, m, key, tmp_path / "dest", expect_op="mv_" + "c" * 26)
    assert caught.value.reason == "binding"


def test_extraction_needs_a_fresh_directory(
    tmp_path: Path, key: S.PrivateKey, sealed_tree: tuple[A.ArchiveManifest, bytes]
) -> None:
    m, sealed = sealed_tree
    (tmp_path / "dest").mkdir()
    with pytest.raises(A.ArchiveInvalid) as caught:
        A.extract(sealed, m, key, tmp_path / "dest")
    assert caught.value.reason == "destination" and os.listdir(tmp_path / "dest") == []
    # A stream source works as well as bytes.
    A.extract(io.BytesIO(sealed), m, key, tmp_path / "fresh")
    assert (tmp_path / "fresh" / ".env").exists()


# Crafted archives: sealed properly with the right key, so only the content check can refuse them.


def craft(members: list[tuple[tarfile.TarInfo, bytes]], key: S.PrivateKey) -> tuple[A.ArchiveManifest, bytes]:
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if info.isreg() else None)
    plain = raw.getvalue()
    out = io.BytesIO()
    sealer = A.Sealer(out, key.public_key(), op=OP, incarnation=INC, chunk_size=SMALL_CHUNK)
    sealer.write(plain)
    sealed_key, sealed, size = sealer.finish()
    files = tuple(
        A.ArchiveFile(path=i.name, size=len(d), sha256=hashlib.sha256(d).hexdigest())
        for i, d in members
        if i.isreg() and _safe(i.name)
    )
    m = A.ArchiveManifest(
        format=A.FORMAT,
        op=OP,
        incarnation=INC,
        key=sealed_key,
        sealed=sealed,
        sealed_bytes=size,
        plain=hashlib.sha256(plain).hexdigest(),
        bytes=len(plain),
        entries=len(members),
        chunk_size=SMALL_CHUNK,
        compression="zstd",
        files=files,
    )
    return m, out.getvalue()


def _safe(name: str) -> bool:
    try:
        A._check_path(name)
    except ValueError:
        return False
    return True


def entry(
    name: str, kind: bytes = tarfile.REGTYPE, data: bytes = b"", mode: int = 0o644, link: str = ""
) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.type, info.mode, info.size, info.linkname = kind, mode, len(data) if kind == tarfile.REGTYPE else 0, link
    return info, data


ROOT = entry("files", tarfile.DIRTYPE, mode=0o755)


@pytest.mark.parametrize(
    ("members", "reason"),
    [
        ([ROOT, entry("files/../../escaped", data=b"x")], "entry_path"),
        ([ROOT, entry("files/a/../../../escaped", data=b"x")], "entry_path"),
        ([entry("/tmp/escaped-absolute", data=b"x"), ROOT], "entry_path"),
        ([entry("../escaped", data=b"x"), ROOT], "entry_path"),
        ([ROOT, entry("files/./x", data=b"x")], "entry_path"),
        ([ROOT, entry("other/x", data=b"x")], "entry_path"),
        ([ROOT, entry("files/a/x", data=b"x")], "entry_path"),  # no parent folder entry
        ([ROOT, entry("files/link", tarfile.SYMTYPE, link="/etc/passwd")], "entry_type"),
        ([ROOT, entry("files/hard", tarfile.LNKTYPE, link="files/x")], "entry_type"),
        ([ROOT, entry("files/dev", tarfile.CHRTYPE)], "entry_type"),
        ([ROOT, entry("files/fifo", tarfile.FIFOTYPE)], "entry_type"),
        ([ROOT, entry("files/b", data=b"1"), entry("files/a", data=b"2")], "order"),
        ([ROOT, entry("files/a", data=b"1"), entry("files/a", data=b"2")], "order"),
        ([entry(".env", tarfile.DIRTYPE), ROOT], "entry_type"),
        ([entry("files", data=b"not a folder")], "entry_type"),
        ([entry(".env", data=b"A=1\n")], "entry_path"),  # no files folder at all
    ],
)
def test_extraction_refuses_unsafe_entries(
    tmp_path: Path, key: S.PrivateKey, members: list[tuple[tarfile.TarInfo, bytes]], reason: str
) -> None:
    m, sealed = craft(members, key)
    err = refused(tmp_path, sealed, m, key)
    assert err.reason == reason, str(err)
    assert not (tmp_path.parent / "escaped").exists() and not Path("/tmp/escaped-absolute").exists()


def test_a_crafted_archive_that_is_clean_extracts(tmp_path: Path, key: S.PrivateKey) -> None:
    m, sealed = craft([entry(".env", data=b"A=1\n", mode=0o600), ROOT, entry("files/x", data=b"hi")], key)
    A.extract(sealed, m, key, tmp_path / "out")
    assert (tmp_path / "out" / "files" / "x").read_bytes() == b"hi"


# -- the secrets key and its fingerprint (§10) ----------------------------------------------------


def test_secrets_key_fp_is_sha256_of_the_uncompressed_point(key: S.PrivateKey) -> None:
    nums = key.public_key().public_numbers()
    point = b"\x04" + nums.x.to_bytes(32, "big") + nums.y.to_bytes(32, "big")
    fp = S.secrets_key_fp(key)
    assert re.fullmatch(r"sha256:[0-9a-f]{64}", fp)
    assert fp == "sha256:" + hashlib.sha256(point).hexdigest()
    # The console computes it over the public key alone; equal means key-ready.
    assert S.secrets_key_fp(S.load_public_key(S.public_key_pem(key))) == fp
    assert S.secrets_key_fp(S.generate_private_key()) != fp
    assert S.secrets_key_fp(None) == ""


def test_the_key_file_is_owner_only(tmp_path: Path, key: S.PrivateKey) -> None:
    path = tmp_path / "secrets.pem"
    old = os.umask(0)
    try:
        S.save_private_key(key, path)
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    loaded = S.load_private_key(path)
    assert S.secrets_key_fp(loaded) == S.secrets_key_fp(key)
    with pytest.raises(S.SealError, match="refusing to overwrite"):
        S.save_private_key(S.generate_private_key(), path)
    assert S.secrets_key_fp(S.load_private_key(path)) == S.secrets_key_fp(key)

    os.chmod(path, 0o644)
    with pytest.raises(S.SealError, match="chmod 600") as caught:
        S.load_private_key(path)
    assert "PRIVATE KEY" not in str(caught.value)
    os.chmod(path, 0o600)

    other = ec.generate_private_key(ec.SECP384R1())
    p384 = tmp_path / "p384.pem"
    p384.write_bytes(
        other.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    os.chmod(p384, 0o600)
    with pytest.raises(S.SealError, match="not P-256"):
        S.load_private_key(p384)
    garbage = tmp_path / "garbage.pem"
    garbage.write_bytes(b"-----BEGIN PRIVATE KEY-----\nnot a key\n-----END PRIVATE KEY-----\n")
    os.chmod(garbage, 0o600)
    with pytest.raises(S.SealError, match="does not hold") as caught:
        S.load_private_key(garbage)
    with pytest.raises(S.SealError, match="does not exist"):
        S.load_private_key(tmp_path / "missing.pem")


def test_seal_key_round_trips_and_is_randomized(key: S.PrivateKey) -> None:
    data_key = S.new_data_key()
    a = S.seal_key(data_key, key.public_key(), aad=b"ctx")
    b = S.seal_key(data_key, key.public_key(), aad=b"ctx")
    assert a != b and a.epk != b.epk and a.nonce != b.nonce
    assert S.open_key(a, key, aad=b"ctx") == S.open_key(b, key, aad=b"ctx") == data_key
    with pytest.raises(S.SealError, match="does not open"):
        S.open_key(a, S.generate_private_key(), aad=b"ctx")
    with pytest.raises(S.SealError):
        S.open_key(a, key, aad=b"other")
    with pytest.raises(S.SealError):
        S.open_key(msgspec.structs.replace(a, ct=bytes([a.ct[0] ^ 1]) + a.ct[1:]), key, aad=b"ctx")
    # Randomness comes through the port: a seeded simulation reproduces it exactly.
    assert S.seal_key(data_key, key.public_key(), SeededRandom(5)) == S.seal_key(
        data_key, key.public_key(), SeededRandom(5)
    )
    assert S.secrets_key_fp(S.generate_private_key(SeededRandom(9))) == S.secrets_key_fp(
        S.generate_private_key(SeededRandom(9))
    )


@settings(max_examples=60, deadline=None)
@given(
    data=st.binary(max_size=700),
    chunk_size=st.integers(min_value=1, max_value=64),
    cuts=st.lists(st.integers(min_value=0, max_value=700), max_size=6),
)
def test_chunk_stream_round_trips_at_every_boundary(data: bytes, chunk_size: int, cuts: list[int]) -> None:
    data_key = bytes(range(32))
    sealer = S.ChunkSealer(data_key, chunk_size)
    bounds = sorted({0, len(data), *(c for c in cuts if c <= len(data))})
    sealed = b""
    for lo, hi in zip(bounds, bounds[1:], strict=False):
        sealed += b"".join(sealer.feed(data[lo:hi]))
    sealed += sealer.finish()
    chunks = max(1, -(-len(data) // chunk_size))
    assert len(sealed) == len(data) + chunks * S.TAG_BYTES
    opener = S.ChunkOpener(data_key, chunk_size)
    plain = b""
    for lo in range(0, len(sealed), 37):
        plain += b"".join(opener.feed(sealed[lo : lo + 37]))
    plain += opener.finish()
    assert plain == data


def test_the_chunk_sealer_takes_views_and_keeps_no_reference_to_its_input() -> None:
    data_key = bytes(range(32))
    data = SeededRandom(6).token_bytes(10_000)
    expected = b"".join(S.ChunkSealer(data_key, 1000).feed(data))
    sealer = S.ChunkSealer(data_key, 1000)
    fed = bytearray(data[:2500])
    sealed = b"".join(sealer.feed(fed))
    fed[:] = b"x" * len(fed)  # the caller reuses its buffer: what the sealer kept is its own copy
    sealed += b"".join(sealer.feed(memoryview(data)[2500:7000]))
    sealed += b"".join(sealer.feed(bytearray(data[7000:])))
    assert sealed == expected
    last = sealer.finish()
    opener = S.ChunkOpener(data_key, 1000)
    assert b"".join(opener.feed(memoryview(sealed + last))) + opener.finish() == data


def test_chunk_nonce_and_aad_encode_index_and_final_flag() -> None:
    assert S.chunk_nonce(1) == b"\0" * 11 + b"\x01" and len(S.chunk_nonce(2**64)) == 12
    assert (
        S.chunk_aad(1 << 20, 3, True)
        == b"hostmove-archive-v1" + (1 << 20).to_bytes(4, "big") + (3).to_bytes(8, "big") + b"\x01"
    )
    assert S.chunk_aad(1 << 20, 3, False)[-1:] == b"\x00"
    assert S.DEFAULT_CHUNK_SIZE == 1 << 20
    sealer = S.ChunkSealer(bytes(32), 4)
    one = b"".join(sealer.feed(b"12345678")) + sealer.finish()
    assert len(one) == 2 * (4 + S.TAG_BYTES)  # an exact multiple: the second full chunk is the final one
    opener = S.ChunkOpener(bytes(32), 4)
    with pytest.raises(S.SealError, match="failed authentication"):
        opener.feed(one[: 4 + S.TAG_BYTES])
        opener.finish()  # the first chunk alone, read as final, does not authenticate


def test_a_stage_of_one_block_steps_it_at_close_without_a_thread() -> None:
    """A small tree's one block is stepped in the caller's thread at close; a second block starts the worker, which
    steps every block in order; an error of the inline step is raised by close, not lost."""
    seen: list[bytes] = []
    started = threading.Thread.start
    starts: list[str] = []

    def counting(self: threading.Thread) -> None:
        starts.append(self.name)
        started(self)

    threading.Thread.start = counting  # type: ignore[method-assign]
    try:
        one = A._Stage(lambda b: seen.append(bytes(b)), "one")
        one.write(b"a")
        assert seen == [] and starts == []
        one.close()
        assert seen == [b"a"] and starts == []
        many = A._Stage(lambda b: seen.append(bytes(b)), "many")
        for block in (b"b", b"c", b"d"):
            many.write(block)
        many.close()
        assert seen == [b"a", b"b", b"c", b"d"] and starts == ["many"]
    finally:
        threading.Thread.start = started  # type: ignore[method-assign]

    def fail(_block: bytes | bytearray) -> None:
        raise OSError("the sink failed")

    failing = A._Stage(fail, "failing")
    failing.write(b"x")
    with pytest.raises(OSError, match="the sink failed"):
        failing.close()
    dropped = A._Stage(fail, "dropped")
    dropped.write(b"x")
    dropped.abandon()  # an abandoned stage steps nothing and raises nothing
