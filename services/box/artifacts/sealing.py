"""The deployment's secrets key and the archive's sealing (spec §8.2, §10; digest D§9).

- The secrets key is a P-256 keypair (the deployment's config keypair, ``appconfig/crypto.go``).
  Private keys live in PEM files with owner-only permissions (0600); loading refuses a file that
  group or others can read.
- :func:`secrets_key_fp` is §10's shared fingerprint: ``"sha256:"`` and 64 lowercase hex digits of
  SHA-256 over the uncompressed public point (65 bytes, ``(*ecdh.PublicKey).Bytes()``).
- :func:`seal_key` / :func:`open_key` wrap a data key for a public key (§8.2, "``appconfig.Seal``,
  fresh ephemeral key and nonce"): ECDH with a fresh ephemeral P-256 key, HKDF-SHA256 to a 256-bit
  wrapping key, AES-256-GCM with a fresh random nonce. The spec leaves the KDF open (digest §13.8);
  ours binds both public points into the HKDF info.
- :class:`ChunkSealer` / :class:`ChunkOpener` are the archive's streaming encryption (§8.2): a fresh
  256-bit data key, AES-256-GCM over fixed-size plaintext chunks (1 MiB), nonce = the chunk index as
  a 96-bit big-endian integer, and the associated data ``b"hostmove-archive-v1" + chunk_size (4 bytes)
  + index (8 bytes) + final flag (1 byte)``, so a truncated, reordered, resized or extended stream
  fails authentication. The spec leaves the flag's encoding open (digest §13.8).

Randomness (data keys, ephemeral keys, nonces) comes through the :class:`~kernel.ports.Random`
port, so a simulation can seed it; production passes :class:`~kernel.ports.SystemRandom`.
No key material ever appears in an error message.
"""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Callable
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from events.base import Durable
from kernel.fsutil import atomic_write
from kernel.ports import Random, SystemRandom

PrivateKey = ec.EllipticCurvePrivateKey
PublicKey = ec.EllipticCurvePublicKey

CURVE = ec.SECP256R1()
# The order of the P-256 group: a private scalar is in [1, N).
_N = 0xFFFFFFFF00000000FFFFFFFFFFFFFFFFBCE6FAADA7179E84F3B9CAC2FC632551

SEAL_ALG = "p256-ecdh-hkdf-sha256-aes256gcm"
_SEAL_INFO = b"hostmove-seal-v1"
DATA_KEY_BYTES = 32
NONCE_BYTES = 12
TAG_BYTES = 16
POINT_BYTES = 65
DEFAULT_CHUNK_SIZE = 1 << 20
MAX_CHUNK_SIZE = (1 << 32) - 1
CHUNK_AAD_PREFIX = b"hostmove-archive-v1"

Buffer = bytes | bytearray | memoryview


class SealError(Exception):
    """A key that does not open, a key file that cannot be used, or a sealed stream that fails to verify."""


# -- keys -----------------------------------------------------------------------------------------


def _scalar(rng: Random) -> int:
    """A uniform private scalar in [1, N) by rejection sampling over 256 random bits."""
    while True:
        k = int.from_bytes(rng.token_bytes(32), "big")
        if 0 < k < _N:
            return k


def generate_private_key(rng: Random | None = None) -> PrivateKey:
    """A fresh P-256 private key, its scalar drawn through the ``Random`` port."""
    return ec.derive_private_key(_scalar(rng or SystemRandom()), CURVE)


def _check_curve(key: PrivateKey | PublicKey, what: str) -> None:
    if not isinstance(key.curve, ec.SECP256R1):
        raise SealError(f"{what} is on curve {key.curve.name}, not P-256 (secp256r1)")


def save_private_key(key: PrivateKey, path: str | Path, *, overwrite: bool = False) -> None:
    """Write the key as unencrypted PKCS#8 PEM, readable by its owner only (mode 0600).

    The bytes go to a temporary file created 0600 in the same directory, fsynced, then renamed into
    place, so a reader never sees a partial key or a moment of wider permissions. An existing file is
    refused unless ``overwrite``: replacing a deployment's secrets key is never an accident.
    """
    _check_curve(key, "the secrets key")
    path = Path(path)
    if path.exists() and not overwrite:
        raise SealError(f"refusing to overwrite the existing key file {path}")
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    atomic_write(path, pem, mode=0o600)


def load_private_key(path: str | Path) -> PrivateKey:
    """Read a PEM private key, refusing a file that anyone but its owner can read or write."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise SealError(f"the key file {path} does not exist") from None
    except OSError as exc:
        raise SealError(f"cannot open the key file {path}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise SealError(f"the key file {path} is not a regular file")
        if st.st_mode & 0o077:
            raise SealError(
                f"the key file {path} has mode {stat.S_IMODE(st.st_mode):04o}; a secrets key must be readable "
                "by its owner only (chmod 600)"
            )
        with os.fdopen(os.dup(fd), "rb") as f:
            pem = f.read()
    finally:
        os.close(fd)
    return load_private_key_pem(pem, f"the key file {path}")


def load_private_key_pem(pem: bytes, what: str = "the secrets key") -> PrivateKey:
    """A P-256 private key from unencrypted PEM (PKCS#8 or SEC1), e.g. a key passed in the environment."""
    try:
        key = serialization.load_pem_private_key(pem, password=None)
    except (ValueError, TypeError):
        raise SealError(f"{what} does not hold an unencrypted PEM private key") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise SealError(f"{what} does not hold an elliptic-curve key")
    _check_curve(key, what)
    return key


def public_key_pem(key: PrivateKey | PublicKey) -> bytes:
    """The public half as SubjectPublicKeyInfo PEM (what the console keeps as the public key)."""
    pub = key.public_key() if isinstance(key, ec.EllipticCurvePrivateKey) else key
    return pub.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)


def load_public_key(pem: bytes) -> PublicKey:
    try:
        key = serialization.load_pem_public_key(pem)
    except (ValueError, TypeError):
        raise SealError("the public key is not a PEM SubjectPublicKeyInfo") from None
    if not isinstance(key, ec.EllipticCurvePublicKey):
        raise SealError("the public key is not an elliptic-curve key")
    _check_curve(key, "the public key")
    return key


def public_point(key: PrivateKey | PublicKey) -> bytes:
    """The uncompressed public point, 65 bytes (Go's ``(*ecdh.PublicKey).Bytes()``)."""
    pub = key.public_key() if isinstance(key, ec.EllipticCurvePrivateKey) else key
    return pub.public_bytes(serialization.Encoding.X962, serialization.PublicFormat.UncompressedPoint)


def secrets_key_fp(key: PrivateKey | PublicKey | None) -> str:
    """§10's ``secrets_key_fp``: ``"sha256:" + hex(SHA-256(uncompressed point))``; ``""`` when there is no key.

    A box computes it over its secrets key, the console over the public key; equal values mean the
    box is key-ready. (Absent, "unknown", is the edges file's business, not this function's.)
    """
    if key is None:
        return ""
    _check_curve(key, "the secrets key")
    return "sha256:" + hashlib.sha256(public_point(key)).hexdigest()


# -- sealing a data key ---------------------------------------------------------------------------


class SealedKey(Durable, frozen=True):
    """A data key sealed to a public key (§8.2). Bytes fields encode as base64 in JSON."""

    alg: str
    epk: bytes  # the ephemeral public key, uncompressed point
    nonce: bytes
    ct: bytes  # the AES-256-GCM ciphertext and tag

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.alg != SEAL_ALG:
            raise ValueError(f"SealedKey.alg must be {SEAL_ALG!r}, not {self.alg!r}")
        if len(self.epk) != POINT_BYTES or self.epk[:1] != b"\x04":
            raise ValueError("SealedKey.epk must be an uncompressed P-256 point (65 bytes)")
        if len(self.nonce) != NONCE_BYTES:
            raise ValueError(f"SealedKey.nonce must be {NONCE_BYTES} bytes")
        if len(self.ct) < TAG_BYTES:
            raise ValueError("SealedKey.ct is shorter than a GCM tag")


def _wrapping_key(shared: bytes, epk: bytes, recipient: bytes) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=_SEAL_INFO + epk + recipient).derive(shared)


def seal_key(data_key: bytes, public_key: PublicKey, rng: Random | None = None, *, aad: bytes = b"") -> SealedKey:
    """Seal ``data_key`` to ``public_key`` with a fresh ephemeral key and nonce (§8.2)."""
    _check_curve(public_key, "the public key")
    rng = rng or SystemRandom()
    eph = generate_private_key(rng)
    epk = public_point(eph)
    wrap = _wrapping_key(eph.exchange(ec.ECDH(), public_key), epk, public_point(public_key))
    nonce = rng.token_bytes(NONCE_BYTES)
    return SealedKey(alg=SEAL_ALG, epk=epk, nonce=nonce, ct=AESGCM(wrap).encrypt(nonce, data_key, aad))


def open_key(sealed: SealedKey, private_key: PrivateKey, *, aad: bytes = b"") -> bytes:
    """Open a sealed data key; a wrong key or a corrupted seal raises :class:`SealError`."""
    _check_curve(private_key, "the secrets key")
    try:
        epk = ec.EllipticCurvePublicKey.from_encoded_point(CURVE, sealed.epk)
        shared = private_key.exchange(ec.ECDH(), epk)
    except ValueError:
        raise SealError("the sealed key's ephemeral public key is not a valid P-256 point") from None
    wrap = _wrapping_key(shared, sealed.epk, public_point(private_key))
    try:
        return AESGCM(wrap).decrypt(sealed.nonce, sealed.ct, aad)
    except InvalidTag:
        raise SealError(
            "the sealed data key does not open with this secrets key: the key is not the one it was sealed "
            "to, or the sealed key is corrupted"
        ) from None


def new_data_key(rng: Random | None = None) -> bytes:
    """A fresh 256-bit data key (§8.2: never reused, never derived from content)."""
    return (rng or SystemRandom()).token_bytes(DATA_KEY_BYTES)


# -- streaming chunk encryption -------------------------------------------------------------------


def _check_chunk_size(chunk_size: int) -> int:
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or not 1 <= chunk_size <= MAX_CHUNK_SIZE:
        raise ValueError(f"chunk size must be an integer in [1, {MAX_CHUNK_SIZE}], not {chunk_size!r}")
    return chunk_size


def chunk_nonce(index: int) -> bytes:
    """The nonce of chunk ``index``: the index as a 96-bit big-endian integer (§8.2)."""
    return index.to_bytes(NONCE_BYTES, "big")


def chunk_aad(chunk_size: int, index: int, final: bool) -> bytes:
    """The associated data of one chunk: prefix, chunk size, index and the final flag (§8.2)."""
    return CHUNK_AAD_PREFIX + chunk_size.to_bytes(4, "big") + index.to_bytes(8, "big") + (b"\x01" if final else b"\x00")


def _whole_pieces(
    buf: bytearray, data: Buffer, size: int, process: Callable[[Buffer], bytes]
) -> tuple[list[bytes], bytearray]:
    """Cut ``buf + data`` into ``size``-byte pieces, processing every piece that is known not to be the last
    (more bytes follow it); answers the processed pieces and the bytes kept for later. Shared by the sealer
    (plaintext chunks) and the opener (ciphertext chunks), so both frame the stream the same way.

    Copies only what must wait: ``buf`` is topped up to one piece, whole pieces of ``data`` are processed
    in place (views), and the tail is kept. ``process`` must not keep the view it is given.
    """
    view = memoryview(data).cast("B")
    out: list[bytes] = []
    if buf:
        take = min(size - len(buf), len(view))
        buf += view[:take]
        view = view[take:]
        if not view:  # nothing follows yet, so even a full buffer may be the last piece
            return out, buf
        out.append(process(buf))
    while len(view) > size:
        out.append(process(view[:size]))
        view = view[size:]
    return out, bytearray(view)


class ChunkSealer:
    """Encrypt a plaintext stream into AES-256-GCM chunks; :meth:`finish` emits the flagged last chunk.

    A chunk is emitted only once more plaintext follows it, so the last chunk (1 to ``chunk_size``
    bytes, or 0 bytes for an empty stream) is always the one flagged final. Output chunks are
    ``chunk_size + 16`` bytes except the last.
    """

    def __init__(self, data_key: bytes, chunk_size: int = DEFAULT_CHUNK_SIZE) -> None:
        if len(data_key) != DATA_KEY_BYTES:
            raise ValueError("the data key must be 32 bytes")
        self.chunk_size = _check_chunk_size(chunk_size)
        self._aead = AESGCM(data_key)
        self._buf = bytearray()
        self._index = 0
        self._done = False

    def _seal(self, data: bytes | bytearray | memoryview, final: bool) -> bytes:
        out = self._aead.encrypt(chunk_nonce(self._index), data, chunk_aad(self.chunk_size, self._index, final))
        self._index += 1
        return out

    def feed(self, data: bytes | bytearray | memoryview) -> list[bytes]:
        """Add plaintext; returns the ciphertext chunks that are now complete (never the last one)."""
        if self._done:
            raise ValueError("the sealer is finished")
        out, self._buf = _whole_pieces(self._buf, data, self.chunk_size, lambda piece: self._seal(piece, False))
        return out

    def finish(self) -> bytes:
        """The last chunk, flagged final."""
        if self._done:
            raise ValueError("the sealer is finished")
        self._done = True
        last = self._seal(self._buf, final=True)
        self._buf = bytearray()
        return last

    @property
    def chunks(self) -> int:
        return self._index


class ChunkOpener:
    """Decrypt a :class:`ChunkSealer` stream, authenticating every chunk before releasing its plaintext.

    Truncation (the stream ends without the final chunk, or is cut at a chunk boundary), reordering,
    a flipped byte, a different chunk size or data after the final chunk all raise :class:`SealError`.
    """

    def __init__(self, data_key: bytes, chunk_size: int = DEFAULT_CHUNK_SIZE) -> None:
        if len(data_key) != DATA_KEY_BYTES:
            raise ValueError("the data key must be 32 bytes")
        self.chunk_size = _check_chunk_size(chunk_size)
        self._aead = AESGCM(data_key)
        self._buf = bytearray()
        self._index = 0
        self._done = False

    def _open(self, data: bytes | bytearray | memoryview, final: bool) -> bytes:
        try:
            out = self._aead.decrypt(chunk_nonce(self._index), data, chunk_aad(self.chunk_size, self._index, final))
        except InvalidTag:
            where = "the last chunk" if final else f"chunk {self._index}"
            raise SealError(
                f"{where} of the sealed stream failed authentication: the stream is truncated, reordered, "
                "corrupted or sealed under another key"
            ) from None
        self._index += 1
        return out

    def feed(self, data: bytes | bytearray | memoryview) -> list[bytes]:
        """Add ciphertext; returns plaintext of chunks that are complete and known not to be the last."""
        if self._done:
            raise SealError("data follows the final chunk of the sealed stream")
        out, self._buf = _whole_pieces(
            self._buf, data, self.chunk_size + TAG_BYTES, lambda piece: self._open(piece, False)
        )
        return out

    def finish(self) -> bytes:
        """Open the remaining bytes as the final chunk."""
        if self._done:
            raise SealError("the sealed stream was already finished")
        self._done = True
        if len(self._buf) < TAG_BYTES:
            raise SealError("the sealed stream is truncated: it ends inside a chunk")
        last = self._open(self._buf, final=True)
        self._buf = bytearray()
        return last


__all__ = [
    "CHUNK_AAD_PREFIX",
    "DATA_KEY_BYTES",
    "DEFAULT_CHUNK_SIZE",
    "TAG_BYTES",
    "ChunkOpener",
    "ChunkSealer",
    "PrivateKey",
    "PublicKey",
    "SealError",
    "SealedKey",
    "chunk_aad",
    "chunk_nonce",
    "generate_private_key",
    "load_private_key",
    "load_private_key_pem",
    "load_public_key",
    "new_data_key",
    "open_key",
    "public_key_pem",
    "public_point",
    "save_private_key",
    "seal_key",
    "secrets_key_fp",
]
