"""A role's credentials file (issue 14 items 1 and 3): what one service or box authenticates with.

Every role of a deployment (``console``, ``projections``, ``router``, ``box-<label>``, and the operator's ``admin``)
holds one JSON file, owner-only (0600, owned by the user reading it)::

    {"role": "box-ie-1", "nats_seed": "SU...", "inbox_prefix": "_INBOX_box-ie-1",
     "s3_access_key": "AKIA...", "s3_secret_key": "..."}

- ``nats_seed`` is the role's NATS user nkey seed: the server's configuration holds only its public half, and the
  seed never leaves this file (the client signs the server's nonce with it);
- ``inbox_prefix`` is the only reply subject space the role may subscribe to (another role's replies are not its);
- ``s3_access_key``/``s3_secret_key`` is the role's own S3 identity, scoped by its policy
  (:mod:`hostmove.access`).

A file readable by group or others, or owned by another user, is refused (:class:`CredentialsError`): a credential
never comes from the command line, and a file anyone could read is no credential. ``HOSTMOVE_CREDENTIALS`` names
the file a process uses when nothing names one explicitly (:func:`credentials_from_env`).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from pathlib import Path

import msgspec

from kernel.fsutil import atomic_write

ENV_CREDENTIALS = "HOSTMOVE_CREDENTIALS"
"""The path of the credentials file this process uses by default."""
ENV_CREDENTIALS_DIR = "HOSTMOVE_CREDENTIALS_DIR"
"""A directory of role files ``<role>.json``: a launcher's, whose services each pick their own role's."""


class CredentialsError(Exception):
    """The credentials file is missing, unreadable, or not owner-only; the message says which and what to do."""


class Credentials(msgspec.Struct, frozen=True, kw_only=True):
    role: str
    nats_seed: str = ""
    inbox_prefix: str = "_INBOX"
    s3_access_key: str = ""
    s3_secret_key: str = ""

    def __repr__(self) -> str:  # never print a secret
        return f"Credentials(role={self.role}, s3={self.s3_access_key or '-'})"

    __str__ = __repr__

    def secrets(self) -> list[str]:
        """The values a log must never show."""
        return [s for s in (self.nats_seed, self.s3_secret_key) if s]


def role_file(directory: Path, role: str) -> Path:
    return directory / f"{role}.json"


def check_private(path: Path) -> None:
    """Refuse a credentials file that group or others may read or write, or that another user owns."""
    try:
        st = path.stat()
    except FileNotFoundError:
        raise CredentialsError(f"no credentials file at {path}") from None
    if not stat.S_ISREG(st.st_mode):
        raise CredentialsError(f"{path} is not a regular file")
    if st.st_mode & 0o077:
        raise CredentialsError(f"{path} is readable by others (mode {stat.S_IMODE(st.st_mode):04o}): a credentials "
                               "file must be owner-only (chmod 600)")
    if hasattr(os, "geteuid") and st.st_uid != os.geteuid():
        raise CredentialsError(f"{path} belongs to uid {st.st_uid}, not to this user ({os.geteuid()})")


def load_credentials(path: Path | str) -> Credentials:
    path = Path(path)
    check_private(path)
    try:
        return msgspec.json.decode(path.read_bytes(), type=Credentials)
    except (OSError, msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise CredentialsError(f"{path} is not a credentials file ({type(exc).__name__})") from None


def save_credentials(path: Path, creds: Credentials) -> None:
    """Write ``creds`` to ``path`` (0600, its directory 0700), atomically."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    atomic_write(path, msgspec.json.encode(creds), mode=0o600)


def credentials_from_env(environ: Mapping[str, str] | None = None) -> Credentials | None:
    """The credentials ``HOSTMOVE_CREDENTIALS`` names, or None when it names none."""
    env = os.environ if environ is None else environ
    path = env.get(ENV_CREDENTIALS, "").strip()
    return load_credentials(path) if path else None


__all__ = ["ENV_CREDENTIALS", "ENV_CREDENTIALS_DIR", "Credentials", "CredentialsError", "check_private",
           "credentials_from_env", "load_credentials", "role_file", "save_credentials"]
