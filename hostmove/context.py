"""The operator's stored context: the door's URL and an operator token, as ``hostmove login`` keeps them (issue 20
item 4; spec §12: every move mutation needs an operator token).

The context lives in the user's config directory, ``$XDG_CONFIG_HOME/hostmove/context.json`` (default
``~/.config/hostmove/context.json``), the directory ``0700`` and the file ``0600``: a token is a secret. A file
another user can read is refused, never used. The environment still overrides it, setting by setting
(``HOSTMOVE_DOOR_URL``, ``HOSTMOVE_TOKEN``; :func:`hostmove.move_cli.load_config`).

Pure where it can be: :func:`context_path` reads only the mapping it is given, so a test's environment never finds
the user's real file.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from kernel.fsutil import atomic_write

CONTEXT_FILE = "context.json"


class ContextError(Exception):
    """The stored context cannot be used; the message says what to do (never the token)."""


@dataclass(frozen=True)
class Context:
    door_url: str
    token: str = field(repr=False)

    def __repr__(self) -> str:  # the token never reaches a log or a traceback
        return f"Context(door_url={self.door_url!r})"


def context_path(environ: Mapping[str, str]) -> Path | None:
    """Where the context is kept for this environment: ``$XDG_CONFIG_HOME/hostmove/``, else
    ``$HOME/.config/hostmove/``; None when the environment names neither (no context)."""
    base = environ.get("XDG_CONFIG_HOME", "").strip()
    if base:
        return Path(base) / "hostmove" / CONTEXT_FILE
    home = environ.get("HOME", "").strip()
    return Path(home) / ".config" / "hostmove" / CONTEXT_FILE if home else None


def read_context(environ: Mapping[str, str]) -> Context | None:
    """The stored context, or None when there is none. A file others may read or write is refused."""
    path = context_path(environ)
    if path is None:
        return None
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ContextError(f"the stored login {path} cannot be read ({exc.strerror})") from None
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ContextError(f"the stored login {path} is readable by others (mode {stat.S_IMODE(st.st_mode):o}): "
                           "it holds a token; remove it and run `hostmove login` again")
    try:
        body = json.loads(path.read_text(encoding="utf-8"))
        return Context(door_url=str(body["door_url"]), token=str(body["token"]))
    except (OSError, ValueError, KeyError, TypeError):
        raise ContextError(f"the stored login {path} is not one `hostmove login` wrote; run it again") from None


def write_context(environ: Mapping[str, str], context: Context) -> Path:
    """Store ``context`` owner-only (directory 0700, file 0600, written atomically); answers where."""
    path = context_path(environ)
    if path is None:
        raise ContextError("neither XDG_CONFIG_HOME nor HOME is set: there is no config directory to keep a login in")
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(path.parent, 0o700)
    body = json.dumps({"door_url": context.door_url, "token": context.token}, indent=2) + "\n"
    atomic_write(path, body.encode(), mode=0o600)
    return path


def remove_context(environ: Mapping[str, str]) -> Path | None:
    """Forget the stored login; answers the file removed, or None when there was none."""
    path = context_path(environ)
    if path is None or not path.exists():
        return None
    path.unlink()
    return path


__all__ = ["Context", "ContextError", "context_path", "read_context", "remove_context", "write_context"]
