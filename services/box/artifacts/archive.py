"""The move archive: a host's files directory and ``.env``, tarred, compressed and sealed (spec §8; digest D§9).

**Content (§8.1).** One POSIX (PAX) tar stream: the files directory (F4) as ``files`` and its tree as
``files/<path>``, without the top-level ``.files-gen`` marker (F5), and ``.env`` (F6) as its own
entry ``.env``. Entries are in sorted path order (code-point order of the full archive path, which is
UTF-8 byte order), owners (uid, gid, uname, gname) and times (mtime) are zeroed and modes kept, and no
record padding follows the two end blocks, so equal content gives equal plaintext bytes. Only regular
files and directories move: a symlink, device, FIFO or socket refuses with its name (M-C14), and so
does a name that is not UTF-8. The cap (M5, default 256 MiB) bounds the tar plaintext and is enforced
while streaming: before each entry is read, the running total plus that entry's exact tar size is
checked, so a refusal (M-C15) comes before the bytes past the cap are ever read. Then zstd.

**Sealing (§8.2).** A fresh 256-bit data key, AES-256-GCM over 1 MiB chunks of the compressed stream
(:mod:`services.box.artifacts.sealing`), the data key sealed to the deployment's secrets key, bound to the op
id and the incarnation. Encryption is randomized: equal content gives an equal ``plain`` digest and a
different ``sealed`` one every time.

**Manifest (§8.2).** :class:`ArchiveManifest`: the sealed data key, ``sealed`` (sha256 of the sealed
object), ``plain`` (sha256 of the tar plaintext), ``bytes`` (the tar plaintext length, the capped
quantity), ``entries``, the per-file list (path, size, sha256), the op id and the incarnation.
Digests are 64 lowercase hex digits. :meth:`ArchiveManifest.files_digest` is the record's
``FilesDigest``; :func:`plain_digest` computes ``plain``, ``bytes`` and ``entries`` at ``stopped``
without sealing (§8.3).

**Extraction.** :func:`extract` verifies everything (the manifest, the key, every chunk's GCM tag, the
zstd checksum, the plaintext and sealed digests, the exact per-file list), accepts only regular files
and directories under ``files/`` and ``.env`` with clean relative paths in strictly sorted order,
restores modes, and writes into a fresh directory that appears (by rename) only once all of it verified.
"""

from __future__ import annotations

import errno
import hashlib
import io
import os
import queue
import shutil
import stat
import tarfile
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Literal, Protocol, cast

import msgspec
import zstandard

from events.base import Durable, DurableValueError, Ident, decode
from events.record import FilesDigest
from kernel.fsutil import fsync_dir
from kernel.ports import Random, SystemRandom
from services.box.artifacts.sealing import (
    DEFAULT_CHUNK_SIZE,
    TAG_BYTES,
    ChunkOpener,
    ChunkSealer,
    PrivateKey,
    PublicKey,
    SealedKey,
    SealError,
    new_data_key,
    open_key,
    seal_key,
)

DEFAULT_CAP = 256 << 20
FORMAT: Literal["hostmove-archive-v1"] = "hostmove-archive-v1"
FILES_ROOT = "files"
ENV_NAME = ".env"
MARKER = ".files-gen"
BLOCK = 512
END_OF_ARCHIVE = b"\0" * (2 * BLOCK)
DEFAULT_LEVEL = 1
_READ = 1 << 20
_FLUSH = 1 << 20

# The operator copy (spec §20). Drafts pending copy review; they belong in the operator-copy module
# (ARCHITECTURE §10) once it exists.
M_C14 = "{host} keeps a file this move cannot copy: {path}. Only regular files and folders move."
M_C15 = "{host} keeps more than {cap} of files beside its database. Keep large files in object storage."


# -- errors ---------------------------------------------------------------------------------------


class ArchiveError(Exception):
    """Base of the archive's refusals and verification failures. ``code`` names the kind."""

    code = "archive"


class UnsupportedEntry(ArchiveError):
    """M-C14: a path that is not a regular file or a directory (or whose name is not UTF-8)."""

    code = "unsupported_entry"

    def __init__(self, host: str, path: str, kind: str) -> None:
        self.host, self.path, self.kind = host, path, kind
        super().__init__(M_C14.format(host=host, path=path))


class ArchiveTooLarge(ArchiveError):
    """M-C15: the tar plaintext would pass the cap. Raised before the bytes past the cap are read.

    ``plain_bytes`` is the plaintext streamed before the refusal, ``read_bytes`` the file content read.
    """

    code = "too_large"

    def __init__(self, host: str, cap: int, plain_bytes: int, read_bytes: int, path: str) -> None:
        self.host, self.cap, self.plain_bytes, self.read_bytes, self.path = host, cap, plain_bytes, read_bytes, path
        super().__init__(M_C15.format(host=host, cap=_size_text(cap)))


class ArchiveChanged(ArchiveError):
    """A file changed size while it was being archived: the host was not stopped."""

    code = "changed"

    def __init__(self, host: str, path: str, how: str) -> None:
        self.host, self.path = host, path
        super().__init__(
            f"{host}: the file {path} {how} while it was being archived; the archive is taken only from a "
            "stopped host, so something is still writing to its files"
        )


class ArchiveMissing(ArchiveError):
    code = "missing"


class ArchiveInvalid(ArchiveError):
    """Extraction refused: ``reason`` is one of ``manifest``, ``binding``, ``wrong_key``, ``chunk``,
    ``compression``, ``too_large``, ``tar``, ``entry_type``, ``entry_path``, ``order``, ``sealed_digest``,
    ``plain_digest``, ``file_list``, ``counts``, ``destination``."""

    code = "invalid"

    def __init__(self, reason: str, detail: str) -> None:
        self.reason = reason
        super().__init__(f"the files archive did not verify and nothing was installed: {detail}")


def _size_text(n: int) -> str:
    if n % (1 << 20) == 0:
        return f"{n >> 20} MiB"
    if n % (1 << 10) == 0:
        return f"{n >> 10} KiB"
    return f"{n} bytes"


def _shown(name: str) -> str:
    """A path as an operator can read it, even when it is not valid UTF-8."""
    return os.fsencode(name).decode("utf-8", "backslashreplace")


# -- the manifest ---------------------------------------------------------------------------------

_HEX = frozenset("0123456789abcdef")


def _check_hex(value: str, what: str) -> None:
    if len(value) != 64 or not set(value) <= _HEX:
        raise ValueError(f"{what} must be 64 lowercase hex digits")


class ArchiveFile(Durable, frozen=True):
    """One regular file of the archive: its archive path, size and sha256 (§8.2)."""

    path: str
    size: int
    sha256: str

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_path(self.path, "ArchiveFile.path")
        if self.size < 0:
            raise ValueError("ArchiveFile.size must not be negative")
        _check_hex(self.sha256, "ArchiveFile.sha256")


class ArchiveManifest(Durable, frozen=True):
    """The manifest stored beside the sealed object (§8.2), canonical JSON via :func:`manifest_bytes`."""

    format: Literal["hostmove-archive-v1"]
    op: Ident
    incarnation: Ident
    key: SealedKey
    sealed: str
    sealed_bytes: int
    plain: str
    bytes: int
    entries: int
    chunk_size: int
    compression: Literal["zstd"]
    files: tuple[ArchiveFile, ...]

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_hex(self.sealed, "ArchiveManifest.sealed")
        _check_hex(self.plain, "ArchiveManifest.plain")
        if min(self.sealed_bytes, self.bytes, self.entries) < 0:
            raise ValueError("ArchiveManifest counts must not be negative")
        if not 1 <= self.chunk_size < 1 << 32:
            raise ValueError("ArchiveManifest.chunk_size is out of range")

    def files_digest(self) -> FilesDigest:
        """The record's ``move.source.files`` (§7.4, §8.3)."""
        return FilesDigest(plain=self.plain, sealed=self.sealed, bytes=self.bytes, entries=self.entries)


class PlainDigest(msgspec.Struct, frozen=True):
    """The content identity of a files directory and ``.env``, computed without sealing (§8.3)."""

    plain: str
    bytes: int
    entries: int
    files: tuple[ArchiveFile, ...]

    def files_digest(self) -> FilesDigest:
        return FilesDigest(plain=self.plain, bytes=self.bytes, entries=self.entries)


_MANIFEST_ENCODER = msgspec.json.Encoder(order="sorted")


def manifest_bytes(manifest: ArchiveManifest) -> bytes:
    """Canonical JSON (keys sorted, no whitespace). Not bound by the event node limit: a manifest lists
    one entry per file, and a 256 MiB archive may hold more files than an event may carry nodes."""
    return _MANIFEST_ENCODER.encode(manifest)


def decode_manifest(data: bytes) -> ArchiveManifest:
    """Decode and validate a stored manifest; anything malformed raises :class:`ArchiveInvalid`."""
    try:
        return decode(data, ArchiveManifest)
    except DurableValueError as exc:
        raise ArchiveInvalid("manifest", f"the manifest is malformed ({exc.reason})") from None


def key_binding(op: str, incarnation: str) -> bytes:
    """The associated data of the sealed data key: the manifest's op id and incarnation."""
    return b"hostmove-archive-key-v1\0" + op.encode() + b"\0" + incarnation.encode()


# -- building -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Entry:
    name: str  # the archive path
    src: str  # the path on disk
    is_dir: bool


def _check_path(name: str, what: str = "path") -> None:
    """A clean archive path: ``.env``, ``files`` or ``files/<relative path>`` with no empty, ``.`` or
    ``..`` component, no NUL and no lone surrogate."""
    if name in (ENV_NAME, FILES_ROOT):
        return
    if not name.startswith(FILES_ROOT + "/"):
        raise ValueError(f"{what} {name!r} is outside files/ and is not .env")
    for part in name.split("/"):
        if part in ("", ".", ".."):
            raise ValueError(f"{what} {name!r} has an empty, '.' or '..' component")
    if "\0" in name:
        raise ValueError(f"{what} contains a NUL")
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{what} is not valid UTF-8") from None


def _kind(mode: int) -> str:
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode):
        return "a character device"
    if stat.S_ISBLK(mode):
        return "a block device"
    return "not a regular file or folder"


def _scan(files_dir: Path, env_file: Path | None, host: str) -> list[_Entry]:
    """Every entry in archive order; refuses the first path that cannot move (M-C14), reading no content."""
    try:
        top = os.lstat(files_dir)
    except FileNotFoundError:
        raise ArchiveMissing(f"{host}: the files directory {files_dir} does not exist") from None
    if not stat.S_ISDIR(top.st_mode):
        raise UnsupportedEntry(host, str(files_dir), _kind(top.st_mode))
    entries = [_Entry(FILES_ROOT, str(files_dir), True)]
    if env_file is not None:
        try:
            st = os.lstat(env_file)
        except FileNotFoundError:
            raise ArchiveMissing(f"{host}: the .env file {env_file} does not exist") from None
        if not stat.S_ISREG(st.st_mode):
            raise UnsupportedEntry(host, ENV_NAME, _kind(st.st_mode))
        entries.append(_Entry(ENV_NAME, str(env_file), False))
    stack = [(str(files_dir), "")]
    while stack:
        src, rel = stack.pop()
        with os.scandir(src) as it:
            children = list(it)
        for child in children:
            if rel == "" and child.name == MARKER:
                continue  # F5: the protocol marker is never archived or digested
            crel = f"{rel}/{child.name}" if rel else child.name
            try:
                crel.encode("utf-8")
            except UnicodeEncodeError:
                raise UnsupportedEntry(host, _shown(crel), "a name that is not UTF-8") from None
            mode = child.stat(follow_symlinks=False).st_mode
            if stat.S_ISDIR(mode):
                entries.append(_Entry(f"{FILES_ROOT}/{crel}", child.path, True))
                stack.append((child.path, crel))
            elif stat.S_ISREG(mode):
                entries.append(_Entry(f"{FILES_ROOT}/{crel}", child.path, False))
            else:
                raise UnsupportedEntry(host, crel, _kind(mode))
    entries.sort(key=lambda e: e.name)
    return entries


_USTAR_NAME = 100
_USTAR_MAX_SIZE = 8**11  # an 11-digit octal size field
_USTAR_ZERO_IDS = b"0000000\x00" * 2  # uid, gid
_USTAR_ZERO_MTIME = b"00000000000\x00"
_USTAR_CHKSUM_BLANK = b" " * 8
# linkname, magic and version, uname, gname, devmajor, devminor, prefix, and the block's padding
_USTAR_TAIL = b"\0" * 100 + tarfile.POSIX_MAGIC + b"\0" * (32 + 32 + 8 + 8 + 155 + 12)


def _header(name: str, is_dir: bool, mode: int, size: int) -> bytes:
    """The tar header of one entry: ``tarfile``'s PAX_FORMAT header with owners and times zeroed (§8.1).

    A name that fits the ustar name field in ASCII (the common case) is encoded here directly, byte for
    byte what ``tarfile`` writes (a test holds the two equal), at a fraction of its cost per file; any
    other name or size, which needs a PAX extended header, goes through ``tarfile``.
    """
    path = name + "/" if is_dir else name
    if len(path) <= _USTAR_NAME and path.isascii() and size < _USTAR_MAX_SIZE:
        head = b"".join(
            (
                path.encode("ascii").ljust(_USTAR_NAME, b"\0"),
                b"%07o\x00" % stat.S_IMODE(mode),
                _USTAR_ZERO_IDS,
                b"%011o\x00" % (0 if is_dir else size),
                _USTAR_ZERO_MTIME,
                _USTAR_CHKSUM_BLANK,
                tarfile.DIRTYPE if is_dir else tarfile.REGTYPE,
                _USTAR_TAIL,
            )
        )
        # The checksum sums every byte with its own field read as spaces, as the header now holds it.
        return head[:148] + b"%06o\x00" % sum(head) + head[155:]
    info = tarfile.TarInfo(name)
    info.type = tarfile.DIRTYPE if is_dir else tarfile.REGTYPE
    info.mode = stat.S_IMODE(mode)
    info.size = 0 if is_dir else size
    info.mtime = 0
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info.tobuf(tarfile.PAX_FORMAT, "utf-8", "strict")


def _padding(size: int) -> int:
    return -size % BLOCK


class _Sink(Protocol):
    def write(self, data: bytes | bytearray) -> None: ...


def _display(name: str) -> str:
    return ENV_NAME if name == ENV_NAME else name[len(FILES_ROOT) + 1 :] or "."


def _stream_tar(
    entries: list[_Entry], sink: _Sink, host: str, cap: int, plain: hashlib._Hash | None
) -> tuple[int, tuple[ArchiveFile, ...]]:
    """Write the tar of ``entries`` to ``sink``, hashing it into ``plain`` (or, with ``None``, leaving
    that to the sink, which sees every byte in order); returns (bytes, files)."""
    total = 0
    read = 0
    files: list[ArchiveFile] = []
    buf = bytearray()

    def emit(data: bytes) -> None:
        """Hash and pass on plaintext; the sink owns what it is given (it is never mutated after). Small
        pieces (headers, small files, padding) gather into blocks; a whole read passes on without a copy."""
        nonlocal buf
        if plain is not None:
            plain.update(data)
        if len(data) >= _FLUSH:
            if buf:
                sink.write(buf)
                buf = bytearray()
            sink.write(data)
            return
        buf += data
        if len(buf) >= _FLUSH:
            sink.write(buf)
            buf = bytearray()

    for entry in entries:
        shown = _display(entry.name)
        if entry.is_dir:
            st = os.lstat(entry.src)
            if not stat.S_ISDIR(st.st_mode):
                raise UnsupportedEntry(host, shown, _kind(st.st_mode))
            head = _header(entry.name, True, st.st_mode, 0)
            if total + len(head) + len(END_OF_ARCHIVE) > cap:
                raise ArchiveTooLarge(host, cap, total, read, shown)
            emit(head)
            total += len(head)
            continue
        try:
            fd = os.open(entry.src, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as exc:
            if exc.errno == errno.ELOOP:  # it became a symlink after the scan
                raise UnsupportedEntry(host, shown, "a symbolic link") from None
            raise
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise UnsupportedEntry(host, shown, _kind(st.st_mode))
            size = st.st_size
            head = _header(entry.name, False, st.st_mode, size)
            if total + len(head) + size + _padding(size) + len(END_OF_ARCHIVE) > cap:
                raise ArchiveTooLarge(host, cap, total, read, shown)
            emit(head)
            digest = hashlib.sha256()
            left = size
            while left:
                piece = os.read(fd, min(left, _READ))
                if not piece:
                    raise ArchiveChanged(host, shown, "shrank")
                digest.update(piece)
                emit(piece)
                left -= len(piece)
                read += len(piece)
            if os.read(fd, 1):
                raise ArchiveChanged(host, shown, "grew")
        finally:
            os.close(fd)
        pad = _padding(size)
        if pad:
            emit(b"\0" * pad)
        total += len(head) + size + pad
        files.append(ArchiveFile(path=entry.name, size=size, sha256=digest.hexdigest()))
    emit(END_OF_ARCHIVE)
    total += len(END_OF_ARCHIVE)
    if buf:
        sink.write(buf)
    return total, tuple(files)


class _Stage:
    """One stage of the build pipeline: a worker thread applying ``step`` to each block, in order.

    Bounded (at most ``depth`` blocks wait), so memory does not grow with the archive. An
    error in ``step`` is kept and re-raised to the next :meth:`write` and at :meth:`close`; the worker
    keeps draining its queue, so a writer upstream never blocks on a stage that has stopped.
    :meth:`abandon` (a refusal or an error elsewhere) drops what is still queued and waits for the worker.

    The worker starts with the second block: a stream of one block (a small tree, the common case of
    :func:`plain_digest`) is stepped in the caller's thread at :meth:`close`, in the same order, without the cost
    of starting and joining a thread for it.
    """

    def __init__(self, step: Callable[[bytes | bytearray], None], name: str, depth: int = 8) -> None:
        self._step = step
        self._name = name
        self._depth = depth
        self._queue: queue.Queue[bytes | bytearray | None] | None = None
        self._first: bytes | bytearray | None = None
        self._error: BaseException | None = None
        self._closed = False
        self._abandoned = False
        self._thread: threading.Thread | None = None

    def _start(self) -> queue.Queue[bytes | bytearray | None]:
        q: queue.Queue[bytes | bytearray | None] = queue.Queue(maxsize=self._depth)
        if self._first is not None:
            q.put(self._first)
            self._first = None
        self._queue = q
        self._thread = threading.Thread(target=self._run, args=(q,), name=self._name, daemon=True)
        self._thread.start()
        return q

    def _run(self, q: queue.Queue[bytes | bytearray | None]) -> None:
        try:
            while (item := q.get()) is not None:
                if not self._abandoned:
                    self._step(item)
        except BaseException as exc:
            self._error = exc
            while q.get() is not None:  # keep draining so the producer never blocks
                pass

    def write(self, data: bytes | bytearray) -> None:
        if self._error is not None:
            raise self._error
        if self._queue is not None:
            self._queue.put(data)
        elif self._first is None:
            self._first = data
        else:
            self._start().put(data)

    def close(self, *, raising: bool = True) -> None:
        """Wait for the worker (once), or step the one block held; re-raise what it raised."""
        if not self._closed:
            self._closed = True
            if self._queue is not None and self._thread is not None:
                self._queue.put(None)
                self._thread.join()
            elif self._first is not None:
                first, self._first = self._first, None
                if not self._abandoned:
                    try:
                        self._step(first)
                    except BaseException as exc:
                        self._error = exc
        if raising and self._error is not None:
            raise self._error

    def abandon(self) -> None:
        """Stop without finishing: blocks still queued are dropped; an error the worker met is not raised."""
        self._abandoned = True
        self.close(raising=False)


def plain_digest(
    files_dir: str | Path, env_file: str | Path | None, *, host: str, cap: int = DEFAULT_CAP
) -> PlainDigest:
    """``plain``, ``bytes``, ``entries`` and the per-file list, without compressing or sealing (§8.3:
    computed at ``stopped`` so recoveries have a baseline before any archive exists). Same refusals.

    The two digests over the same bytes run at once: the caller's thread reads and takes the per-file
    digests, a worker takes ``plain`` over the tar blocks in order (``hashlib`` releases the GIL).
    """
    entries = _scan(Path(files_dir), None if env_file is None else Path(env_file), host)
    plain = hashlib.sha256()
    hashing = _Stage(plain.update, "archive-plain")
    try:
        total, files = _stream_tar(entries, hashing, host, cap, None)
        hashing.close()
    except BaseException:
        hashing.abandon()
        raise
    return PlainDigest(plain=plain.hexdigest(), bytes=total, entries=len(entries), files=files)


class _Writable(Protocol):
    def write(self, data: bytes, /) -> object: ...


class Sealer:
    """Compress (zstd) and seal a plaintext stream into ``out``, hashing the sealed bytes (§8.2).

    ``write`` takes plaintext; ``finish`` emits the flagged last chunk and returns the sealed key,
    the sealed digest and size. The two halves of ``write`` are also separate, for the pipeline:
    :meth:`compress` (zstd), then :meth:`seal` (AES-256-GCM chunks, the ``sealed`` digest, ``out``),
    with :meth:`flush` ending the zstd frame. The archive builder drives it; tests use it to seal
    crafted tars.
    """

    def __init__(
        self,
        out: _Writable,
        public_key: PublicKey,
        *,
        op: str,
        incarnation: str,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        level: int = DEFAULT_LEVEL,
        rng: Random | None = None,
    ) -> None:
        rng = rng or SystemRandom()
        data_key = new_data_key(rng)
        self.key = seal_key(data_key, public_key, rng, aad=key_binding(op, incarnation))
        self.chunk_size = chunk_size
        self._chunks = ChunkSealer(data_key, chunk_size)
        self._z = zstandard.ZstdCompressor(level=level, write_checksum=True).compressobj()
        self._flushed = False
        self._out = out
        self._hash = hashlib.sha256()
        self.sealed_bytes = 0

    def _emit(self, sealed: bytes) -> None:
        self._hash.update(sealed)
        self._out.write(sealed)
        self.sealed_bytes += len(sealed)

    def compress(self, data: bytes | bytearray) -> bytes:
        """The compressed bytes ``data`` completes (often none: zstd works in blocks)."""
        return self._z.compress(data)

    def flush(self) -> bytes:
        """End the zstd frame (with its checksum); the compressed bytes still owed."""
        self._flushed = True
        return self._z.flush()

    def seal(self, packed: bytes | bytearray) -> None:
        """Seal compressed bytes: every chunk they complete is encrypted, hashed and written."""
        if packed:
            for sealed in self._chunks.feed(packed):
                self._emit(sealed)

    def write(self, data: bytes | bytearray) -> None:
        self.seal(self.compress(data))

    def finish(self) -> tuple[SealedKey, str, int]:
        if not self._flushed:
            self.seal(self.flush())
        self._emit(self._chunks.finish())
        return self.key, self._hash.hexdigest(), self.sealed_bytes


def build_archive(
    files_dir: str | Path,
    env_file: str | Path | None,
    out: _Writable,
    public_key: PublicKey,
    *,
    host: str,
    op_id: str,
    incarnation: str,
    cap: int = DEFAULT_CAP,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    level: int = DEFAULT_LEVEL,
    rng: Random | None = None,
    pipelined: bool = True,
) -> ArchiveManifest:
    """Stream the sealed archive of ``files_dir`` and ``env_file`` into ``out``; return its manifest.

    Refusals: :class:`UnsupportedEntry` (M-C14) before any content is read, :class:`ArchiveTooLarge`
    (M-C15) while streaming, :class:`ArchiveChanged` when a file changes under it. After a refusal
    ``out`` holds a partial object the caller discards. zstd level 1 by default: the archive is taken
    inside the cut, where time is offline time.

    ``pipelined`` (the default) runs three stages at once, since ``hashlib``, zstd and AES-GCM release
    the GIL: the caller's thread reads, builds the tar and takes the per-file and ``plain`` digests, one
    worker compresses, another seals, hashes and calls ``out.write`` (so ``out`` sees one thread); an
    error in any stage stops the build. ``pipelined=False`` does it all in the caller's thread. Both
    give the same bytes: the same blocks reach zstd in the same order.
    """
    entries = _scan(Path(files_dir), None if env_file is None else Path(env_file), host)
    sealer = Sealer(out, public_key, op=op_id, incarnation=incarnation, chunk_size=chunk_size, level=level, rng=rng)
    plain = hashlib.sha256()
    if pipelined:
        total, files = _stream_pipelined(entries, sealer, host, cap, plain)
    else:
        total, files = _stream_tar(entries, sealer, host, cap, plain)
    key, sealed, sealed_bytes = sealer.finish()
    return ArchiveManifest(
        format=FORMAT,
        op=op_id,
        incarnation=incarnation,
        key=key,
        sealed=sealed,
        sealed_bytes=sealed_bytes,
        plain=plain.hexdigest(),
        bytes=total,
        entries=len(entries),
        chunk_size=chunk_size,
        compression="zstd",
        files=files,
    )


# Blocks (about 1 MiB each) that may wait for zstd. Deep enough to even out runs of the tree: on compressible
# text zstd is the slower stage, on incompressible media the hashes are; a shallow queue idles a core at each
# change (measured with bench/archive.py: depth 8 to 32 took ~5% off the build). It bounds memory at ~32 MiB.
_COMPRESS_DEPTH = 32


def _stream_pipelined(
    entries: list[_Entry], sealer: Sealer, host: str, cap: int, plain: hashlib._Hash
) -> tuple[int, tuple[ArchiveFile, ...]]:
    """:func:`_stream_tar` into ``sealer`` through two worker stages (compress, then seal); on return
    every compressed byte has been sealed except the last chunk, which :meth:`Sealer.finish` emits."""
    sealing = _Stage(sealer.seal, "archive-seal")

    def compress(block: bytes | bytearray) -> None:
        packed = sealer.compress(block)
        if packed:  # zstd often holds a block's bytes until the next
            sealing.write(packed)

    compressing = _Stage(compress, "archive-compress", depth=_COMPRESS_DEPTH)
    try:
        result = _stream_tar(entries, compressing, host, cap, plain)
        compressing.close()
        sealing.write(sealer.flush())
        sealing.close()
    except BaseException:
        compressing.abandon()  # a refusal is the producer's (or a worker's, re-raised); the workers only stop
        sealing.abandon()
        raise
    return result


# -- extraction -----------------------------------------------------------------------------------


class _Readable(Protocol):
    def read(self, n: int = -1, /) -> bytes: ...


class _Opened(io.RawIOBase):
    """The compressed stream: sealed bytes read from ``source``, hashed, and opened chunk by chunk."""

    def __init__(self, source: _Readable, opener: ChunkOpener) -> None:
        self._source = source
        self._opener = opener
        self._pending = bytearray()
        self._eof = False
        self.hash = hashlib.sha256()
        self.sealed_bytes = 0

    def readable(self) -> bool:
        return True

    def _fill(self) -> None:
        while not self._pending and not self._eof:
            data = self._source.read(self._opener.chunk_size + TAG_BYTES)
            try:
                if data:
                    self.hash.update(data)
                    self.sealed_bytes += len(data)
                    for piece in self._opener.feed(data):
                        self._pending += piece
                else:
                    self._eof = True
                    self._pending += self._opener.finish()
            except SealError as exc:
                raise ArchiveInvalid("chunk", str(exc)) from None

    def readinto(self, b: bytearray | memoryview) -> int:  # type: ignore[override]
        self._fill()
        n = min(len(b), len(self._pending))
        b[:n] = self._pending[:n]
        del self._pending[:n]
        return n

    def drain(self) -> None:
        """Read the sealed source to its end, so every chunk is authenticated and hashed."""
        while not self._eof:
            self._pending.clear()
            self._fill()
        self._pending.clear()


class _Plain(io.RawIOBase):
    """The tar plaintext: decompressed, hashed, counted and held to the cap."""

    def __init__(self, inner: _Readable, cap: int) -> None:
        self._inner = inner
        self._cap = cap
        self.hash = hashlib.sha256()
        self.bytes = 0

    def readable(self) -> bool:
        return True

    def readinto(self, b: bytearray | memoryview) -> int:  # type: ignore[override]
        try:
            data = self._inner.read(len(b))
        except zstandard.ZstdError as exc:
            raise ArchiveInvalid("compression", f"the compressed stream is corrupt ({exc})") from None
        n = len(data)
        self.bytes += n
        if self.bytes > self._cap:
            raise ArchiveInvalid("too_large", f"the archive expands past the cap of {_size_text(self._cap)}")
        self.hash.update(data)
        b[:n] = data
        return n


def _member_kind(member: tarfile.TarInfo) -> Literal["file", "dir"] | None:
    if member.type in (tarfile.REGTYPE, tarfile.AREGTYPE):
        return "file"
    if member.type == tarfile.DIRTYPE:
        return "dir"
    return None


_TAR_KINDS = {
    tarfile.SYMTYPE: "a symbolic link",
    tarfile.LNKTYPE: "a hard link",
    tarfile.CHRTYPE: "a character device",
    tarfile.BLKTYPE: "a block device",
    tarfile.FIFOTYPE: "a FIFO",
}


def _make_writable(root: str) -> None:
    for dirpath, dirnames, _ in os.walk(root):
        for d in dirnames:
            try:
                os.chmod(os.path.join(dirpath, d), 0o700)
            except OSError:
                pass


def extract(
    sealed: bytes | bytearray | memoryview | BinaryIO,
    manifest: ArchiveManifest | bytes,
    private_key: PrivateKey,
    dest_dir: str | Path,
    *,
    cap: int = DEFAULT_CAP,
    expect_op: str | None = None,
    expect_incarnation: str | None = None,
    fsync: bool = True,
) -> ArchiveManifest:
    """Verify and unpack a sealed archive into the fresh directory ``dest_dir`` (``files/`` and ``.env``).

    ``dest_dir`` must not exist; it is created (mode 0700) by renaming a private staging directory
    beside it only after every check passed, so a failure leaves nothing behind. Modes are restored;
    owners are the extracting user's (the installer sets them).
    """
    if not isinstance(manifest, ArchiveManifest):
        manifest = decode_manifest(bytes(manifest))
    if expect_op is not None and manifest.op != expect_op:
        raise ArchiveInvalid("binding", f"the manifest belongs to operation {manifest.op}, not {expect_op}")
    if expect_incarnation is not None and manifest.incarnation != expect_incarnation:
        raise ArchiveInvalid("binding", "the manifest belongs to another incarnation")
    if manifest.bytes > cap:
        raise ArchiveInvalid("too_large", f"the manifest declares {manifest.bytes} bytes, past the cap")
    dest = Path(dest_dir)
    if os.path.lexists(dest):
        raise ArchiveInvalid("destination", f"{dest} already exists; extraction writes only into a fresh directory")
    if not dest.parent.is_dir():
        raise ArchiveInvalid("destination", f"the parent directory {dest.parent} does not exist")
    try:
        data_key = open_key(manifest.key, private_key, aad=key_binding(manifest.op, manifest.incarnation))
    except SealError as exc:
        raise ArchiveInvalid("wrong_key", str(exc)) from None

    source: _Readable
    source = io.BytesIO(sealed) if isinstance(sealed, bytes | bytearray | memoryview) else sealed
    staging = tempfile.mkdtemp(prefix=f".{dest.name}.partial-", dir=dest.parent)
    try:
        _unpack(source, manifest, data_key, staging, cap, fsync)
        os.rename(staging, dest)
    except BaseException:
        _make_writable(staging)
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if fsync:
        fsync_dir(str(dest.parent))
    return manifest


def _unpack(source: _Readable, manifest: ArchiveManifest, data_key: bytes, root: str, cap: int, fsync: bool) -> None:
    opened = _Opened(source, ChunkOpener(data_key, manifest.chunk_size))
    zreader = zstandard.ZstdDecompressor().stream_reader(
        cast(BinaryIO, opened), read_across_frames=False, closefd=False
    )
    plain = _Plain(zreader, cap)
    try:
        dirs, files, count = _write_members(io.BufferedReader(plain, 1 << 16), root, fsync)
    except tarfile.TarError as exc:
        raise ArchiveInvalid("tar", f"the tar stream is malformed ({exc})") from None
    while plain.read(_READ):  # the end blocks, so the plaintext digest covers every byte
        pass
    opened.drain()
    if opened.sealed_bytes != manifest.sealed_bytes or opened.hash.hexdigest() != manifest.sealed:
        raise ArchiveInvalid("sealed_digest", "the sealed object's sha256 or size differs from the manifest")
    if plain.bytes != manifest.bytes or plain.hash.hexdigest() != manifest.plain:
        raise ArchiveInvalid("plain_digest", "the plaintext's sha256 or size differs from the manifest")
    if files != manifest.files:
        raise ArchiveInvalid("file_list", "the files in the archive differ from the manifest's list")
    if count != manifest.entries:
        raise ArchiveInvalid("counts", "the number of entries differs from the manifest")
    for name in sorted(dirs, key=len, reverse=True):  # children before parents: a 0555 folder is set last
        path = os.path.join(root, name)
        if fsync:
            fsync_dir(path)
        os.chmod(path, dirs[name])
    if fsync:
        fsync_dir(root)


def _write_members(stream: BinaryIO, root: str, fsync: bool) -> tuple[dict[str, int], tuple[ArchiveFile, ...], int]:
    """Check and write every tar member under ``root``; returns (folder modes, files, entry count).

    Only regular files and folders, at clean paths (``.env``, ``files``, ``files/...``), strictly
    sorted (so no duplicates), each after its parent folder. Files are created exclusively, never
    through a link; folders stay 0700 until every check passed.
    """
    dirs: dict[str, int] = {}
    files: list[ArchiveFile] = []
    previous = ""
    with tarfile.open(fileobj=stream, mode="r|") as tar:
        for member in tar:
            name = member.name
            kind = _member_kind(member)
            if kind is None:
                what = _TAR_KINDS.get(member.type, f"of tar type {member.type!r}")
                raise ArchiveInvalid("entry_type", f"the entry {name!r} is {what}; only regular files and folders move")
            try:
                _check_path(name, "the entry")
            except ValueError as exc:
                raise ArchiveInvalid("entry_path", f"{exc}: it would escape the destination") from None
            if name <= previous:
                raise ArchiveInvalid("order", f"the entry {name!r} is a duplicate or out of sorted order")
            previous = name
            parent = name.rpartition("/")[0]
            if parent and parent not in dirs:
                raise ArchiveInvalid("entry_path", f"the entry {name!r} comes without its parent folder")
            if name == ENV_NAME and kind != "file" or name == FILES_ROOT and kind != "dir":
                raise ArchiveInvalid("entry_type", f"the entry {name!r} has the wrong type")
            target = os.path.join(root, name)
            mode = stat.S_IMODE(member.mode)
            if kind == "dir":
                os.mkdir(target, 0o700)
                dirs[name] = mode
                continue
            files.append(_write_file(tar, member, target, mode, fsync))
        count = len(dirs) + len(files)
    if FILES_ROOT not in dirs:
        raise ArchiveInvalid("entry_path", "the archive has no files folder")
    return dirs, tuple(files), count


def _write_file(tar: tarfile.TarFile, member: tarfile.TarInfo, target: str, mode: int, fsync: bool) -> ArchiveFile:
    fileobj = tar.extractfile(member)
    assert fileobj is not None  # a regular member always has a reader
    digest = hashlib.sha256()
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        left = member.size
        while left:
            piece = fileobj.read(min(left, _READ))
            if not piece:
                raise ArchiveInvalid("tar", f"the entry {member.name!r} is cut short")
            digest.update(piece)
            view = memoryview(piece)
            while view:
                view = view[os.write(fd, view) :]
            left -= len(piece)
        os.fchmod(fd, mode)
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)
    return ArchiveFile(path=member.name, size=member.size, sha256=digest.hexdigest())


__all__ = [
    "DEFAULT_CAP",
    "ENV_NAME",
    "FILES_ROOT",
    "MARKER",
    "M_C14",
    "M_C15",
    "ArchiveChanged",
    "ArchiveError",
    "ArchiveFile",
    "ArchiveInvalid",
    "ArchiveManifest",
    "ArchiveMissing",
    "ArchiveTooLarge",
    "PlainDigest",
    "Sealer",
    "UnsupportedEntry",
    "build_archive",
    "decode_manifest",
    "extract",
    "key_binding",
    "manifest_bytes",
    "plain_digest",
]
