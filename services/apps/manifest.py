"""An app's release: the manifest an operator writes, the release a box renders (issue 18; spec §6.1, §6.2, §7.1,
§7.3 T3, §9.4, §10). Pure: text and values in, a release, a rendering or a :class:`ManifestError` out.

**The manifest** (TOML, ``hostmove app publish --name N manifest.toml``)::

    command = ["{python}", "{release_dir}/notes.py"]   # argv; a bare argv[0] is looked up on the box's PATH
    files = ["notes.py"]            # shipped inside the release, beside this manifest (at most 64, 4 MiB in all)
    ready_path = "/healthz"         # the readiness path (S1, the start's readiness, the probe: §7.3, §7.7)
    ready_within_s = 20
    timers = "timers.json"          # where the app declares its timers, relative to the instance's directory
    files_dir = "files"             # where it keeps its files, relative to the instance's directory ("." default)
    sidecar_env = false             # a sidecar environment file beside the database (F8; a move refuses it)
    [env]                           # its environment; values may name the slots below
    NOTES_DB = "{db}"
    [secrets]                       # values sealed to the deployment's key at publish (§10); only the box opens them
    NOTES_TOKEN = "..."
    [stores.media]                  # a store binding; ``private = true`` is refused by a move (§7.1, M-C17)
    private = true
    [registry]                      # registry columns the app sets (§6.2); the refused ones are refused by a move
    pool = "blue"

**The instance's directory** is the host's files directory of the flat layout (§6.1 F4: ``<data>/<host>/``, carried
by every move); the database is always the platform's one SQLite file ``<data>/<host>.db`` (F1, replicated), handed
to the app as ``{db}``. The app's ``files_dir`` and ``timers`` are paths inside the instance's directory.

**Slots** a value may name (``{name}``; ``{{`` and ``}}`` are literal braces), each with its class for T3
(§7.3 "with these classes"): ``{host}`` (equal on every box), ``{region}`` (**region**: must differ), and the
**layout** slots whose value is the box's own (present on both sides, value not compared): ``{box}``, ``{port}``,
``{data_dir}`` (the directory holding ``<host>.db`` and ``<host>/``), ``{db}``, ``{instance_dir}``, ``{files_dir}``,
``{release_dir}`` (where the box staged the release's files), ``{side_dir}`` (a directory of the box outside every
instance that no move carries: side files such as the sample app's acknowledgement log) and ``{python}`` (the box's
Python interpreter). A variable that names no slot, and every secret, is **equal**: the same value on every box.
"""

from __future__ import annotations

import hashlib
import posixpath
import re
import string
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from events.base import Durable, Ident, Millis, canonical
from services.box.artifacts.sealing import SealedKey

SlotClass = Literal["equal", "region", "layout"]
SLOTS: dict[str, SlotClass] = {
    "host": "equal",
    "region": "region",
    "box": "layout",
    "port": "layout",
    "data_dir": "layout",
    "db": "layout",
    "instance_dir": "layout",
    "files_dir": "layout",
    "release_dir": "layout",
    "side_dir": "layout",
    "python": "layout",
}
_RANK: dict[SlotClass, int] = {"equal": 0, "region": 1, "layout": 2}

RELEASE_VERSION = 1
APP_NAME = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
PLATFORM_PREFIXES = ("CARLOS_", "HOSTMOVE_")
"""The platform's own variables: never an app's (the agent's settings, the probe's advisory flag)."""
MAX_ARGS = 64
MAX_VARS = 256
MAX_VALUE = 4096
MAX_FILES = 64
MAX_FILES_BYTES = 4 << 20
MAX_READY_WITHIN_S = 600.0

REPRODUCED_COLUMNS = frozenset({"channel", "environment", "hibernate", "steering", "gate", "seed"})
"""§6.2 registry columns a move reproduces from the record."""
REFUSED_COLUMNS = frozenset({"caps", "unit", "backing", "platform", "tunnel", "fleet_box", "pool", "canary", "addr",
                             "addrs", "health", "replica", "replicas"})
"""§6.2 registry columns a move refuses when set ("not the platform's to move"; a replica, or a home with
replicas)."""

TOP_KEYS = frozenset({"name", "command", "files", "ready_path", "ready_within_s", "timers", "files_dir",
                      "sidecar_env", "env", "secrets", "stores", "registry"})


class ManifestError(ValueError):
    """A manifest or a release this system refuses; the message says which key and why (never a secret's value)."""


class EnvVar(Durable, frozen=True):
    name: str
    value: str


class SealedSecret(Durable, frozen=True):
    """One secret variable, its value sealed to the deployment's key (§8.2's seal, §10), bound by its associated
    data to the app, the release and the variable's name (:func:`secret_aad`)."""

    name: str
    sealed: SealedKey


class ReleaseFile(Durable, frozen=True):
    """A file shipped inside the release (the app's code), staged by each box under ``{release_dir}``."""

    path: str
    mode: int
    sha256: str
    body: bytes


class StoreBinding(Durable, frozen=True):
    name: str
    private: bool = False


class Release(Durable, frozen=True):
    """``apps/<name>/releases/<release>.json`` in the deployment bucket, written create-only; a host's claim names it
    with the digest of these bytes (:class:`events.claim.AppRef`)."""

    __durable_root__: ClassVar[bool] = True

    v: int
    name: Ident
    release: int
    published_at: Millis
    key_fp: str
    """The fingerprint (§10) of the deployment key the secrets are sealed to."""
    command: tuple[str, ...]
    env: tuple[EnvVar, ...] = ()
    secrets: tuple[SealedSecret, ...] = ()
    files: tuple[ReleaseFile, ...] = ()
    ready_path: str = "/ready"
    ready_within_s: float = 30.0
    timers: str = ""
    files_dir: str = "."
    sidecar_env: bool = False
    stores: tuple[StoreBinding, ...] = ()
    registry: tuple[EnvVar, ...] = ()

    @property
    def label(self) -> str:
        """``<name>@<release>``: how an operator names it (and the launch input ``release``, §7.2)."""
        return f"{self.name}@{self.release}"

    def private_stores(self) -> list[str]:
        return sorted(s.name for s in self.stores if s.private)

    def refused_columns(self) -> list[str]:
        return sorted(c.name for c in self.registry if c.name in REFUSED_COLUMNS)


@dataclass(frozen=True)
class Manifest:
    """A parsed manifest: what :func:`build_release` needs besides the sealing and the files' bytes. ``secrets``
    holds plaintext values: it never leaves the publishing process."""

    name: str
    command: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)
    secrets: dict[str, str] = field(default_factory=dict)
    files: tuple[str, ...] = ()
    ready_path: str = "/ready"
    ready_within_s: float = 30.0
    timers: str = ""
    files_dir: str = "."
    sidecar_env: bool = False
    stores: tuple[StoreBinding, ...] = ()
    registry: dict[str, str] = field(default_factory=dict)


def slots_in(text: str, where: str) -> list[str]:
    """The slots ``text`` names; :class:`ManifestError` for an unknown slot, a format spec or an unmatched brace."""
    names: list[str] = []
    try:
        parsed = list(string.Formatter().parse(text))
    except ValueError as exc:
        raise ManifestError(f"{where}: {exc} (write {{{{ and }}}} for literal braces)") from None
    for _literal, name, spec, conversion in parsed:
        if name is None:
            continue
        if name not in SLOTS or spec or conversion:
            raise ManifestError(f"{where}: {{{name}}} is not a slot; the slots are "
                                + ", ".join(f"{{{s}}}" for s in SLOTS))
        names.append(name)
    return names


def _relative(value: object, where: str, *, allow_dot: bool) -> str:
    if not isinstance(value, str) or not value:
        raise ManifestError(f"{where} must be a relative path")
    norm = posixpath.normpath(value)
    if value.startswith("/") or norm.startswith("..") or "\\" in value or "\x00" in value or (
            norm == "." and not allow_dot):
        raise ManifestError(f"{where} must be a path inside the instance's directory, not {value!r}")
    return norm


def _text(value: object, where: str, *, limit: int = MAX_VALUE) -> str:
    if not isinstance(value, str):
        raise ManifestError(f"{where} must be a string")
    if len(value) > limit or "\x00" in value:
        raise ManifestError(f"{where} is longer than {limit} characters or holds a NUL")
    return value


def _table(doc: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    value = doc.get(key, {})
    if not isinstance(value, Mapping):
        raise ManifestError(f"{key} must be a table")
    return value


def _var_name(name: object, where: str) -> str:
    if not isinstance(name, str) or not ENV_NAME.match(name):
        raise ManifestError(f"{where}: {name!r} is not a variable name (letters, digits and _, not first a digit)")
    if name.startswith(PLATFORM_PREFIXES):
        raise ManifestError(f"{where}: {name} is the platform's own variable (CARLOS_*, HOSTMOVE_*), never an app's")
    return name


def parse_manifest(doc: Mapping[str, Any], *, name: str) -> Manifest:
    """Check a manifest (the parsed TOML) for app ``name``; :class:`ManifestError` names the first bad key."""
    if not APP_NAME.match(name):
        raise ManifestError(f"{name!r} is not an app name: lowercase letters, digits and '-', at most 63")
    unknown = sorted(set(doc) - TOP_KEYS)
    if unknown:
        raise ManifestError(f"the manifest has keys this system does not know: {', '.join(unknown)}; known: "
                            + ", ".join(sorted(TOP_KEYS)))
    if "name" in doc and doc["name"] != name:
        raise ManifestError(f"the manifest names the app {doc['name']!r}, not {name!r}")
    command = doc.get("command")
    if not isinstance(command, list) or not command or len(command) > MAX_ARGS:
        raise ManifestError(f"command must be a list of 1 to {MAX_ARGS} strings (the program and its arguments)")
    argv = tuple(_text(a, f"command[{i}]") for i, a in enumerate(command))
    for i, arg in enumerate(argv):
        slots_in(arg, f"command[{i}]")
    if not argv[0].strip():
        raise ManifestError("command[0] names no program")
    env: dict[str, str] = {}
    for key, value in _table(doc, "env").items():
        var = _var_name(key, "env")
        env[var] = _text(value, f"env.{var}")
        slots_in(env[var], f"env.{var}")
    secrets: dict[str, str] = {}
    for key, value in _table(doc, "secrets").items():
        var = _var_name(key, "secrets")
        if var in env:
            raise ManifestError(f"{var} is both in env and in secrets")
        secrets[var] = _text(value, f"secrets.{var}")
    if len(env) + len(secrets) > MAX_VARS:
        raise ManifestError(f"the environment has more than {MAX_VARS} variables")
    files_raw = doc.get("files", [])
    if not isinstance(files_raw, list) or len(files_raw) > MAX_FILES:
        raise ManifestError(f"files must be a list of at most {MAX_FILES} paths beside the manifest")
    files = tuple(_relative(f, f"files[{i}]", allow_dot=False) for i, f in enumerate(files_raw))
    if len(set(files)) != len(files):
        raise ManifestError("files names one path twice")
    ready_path = _text(doc.get("ready_path", "/ready"), "ready_path", limit=512)
    if not ready_path.startswith("/"):
        raise ManifestError("ready_path must be an absolute URL path such as /ready")
    within = doc.get("ready_within_s", 30.0)
    if isinstance(within, bool) or not isinstance(within, int | float) or not 0 < within <= MAX_READY_WITHIN_S:
        raise ManifestError(f"ready_within_s must be a number of seconds in (0, {MAX_READY_WITHIN_S:g}]")
    timers = _relative(doc["timers"], "timers", allow_dot=False) if "timers" in doc else ""
    files_dir = _relative(doc.get("files_dir", "."), "files_dir", allow_dot=True)
    sidecar = doc.get("sidecar_env", False)
    if not isinstance(sidecar, bool):
        raise ManifestError("sidecar_env must be true or false")
    stores = []
    for key, value in sorted(_table(doc, "stores").items()):
        if not isinstance(value, Mapping) or set(value) - {"private"} or not isinstance(value.get("private", False),
                                                                                        bool):
            raise ManifestError(f"stores.{key} must be a table with at most private = true or false")
        stores.append(StoreBinding(name=_text(key, "stores", limit=128), private=bool(value.get("private", False))))
    registry: dict[str, str] = {}
    for key, value in _table(doc, "registry").items():
        if key not in REPRODUCED_COLUMNS | REFUSED_COLUMNS:
            raise ManifestError(f"registry.{key} is not a registry column; the columns are "
                                + ", ".join(sorted(REPRODUCED_COLUMNS | REFUSED_COLUMNS)))
        registry[key] = _text(value, f"registry.{key}", limit=256)
    return Manifest(name=name, command=argv, env=env, secrets=secrets, files=files, ready_path=ready_path,
                    ready_within_s=float(within), timers=timers, files_dir=files_dir, sidecar_env=sidecar,
                    stores=tuple(stores), registry=registry)


def secret_aad(app: str, release: int, name: str) -> bytes:
    """The associated data a secret is sealed under: a sealed value opens only as this variable of this release."""
    return f"hostmove-app-secret-v1\x00{app}\x00{release}\x00{name}".encode()


def build_release(manifest: Manifest, *, release: int, published_at: int, key_fp: str,
                  sealed: Mapping[str, SealedKey], files: Sequence[ReleaseFile]) -> Release:
    """The release of ``manifest`` with its secrets ``sealed`` (name -> seal) and its ``files`` read."""
    if set(sealed) != set(manifest.secrets):
        raise ManifestError("every secret must be sealed, and only those")
    if sum(len(f.body) for f in files) > MAX_FILES_BYTES:
        raise ManifestError(f"the release's files hold more than {MAX_FILES_BYTES >> 20} MiB")
    return Release(
        v=RELEASE_VERSION, name=manifest.name, release=release, published_at=published_at, key_fp=key_fp,
        command=manifest.command, env=tuple(EnvVar(k, v) for k, v in sorted(manifest.env.items())),
        secrets=tuple(SealedSecret(k, sealed[k]) for k in sorted(sealed)), files=tuple(files),
        ready_path=manifest.ready_path, ready_within_s=manifest.ready_within_s, timers=manifest.timers,
        files_dir=manifest.files_dir, sidecar_env=manifest.sidecar_env, stores=manifest.stores,
        registry=tuple(EnvVar(k, v) for k, v in sorted(manifest.registry.items())))


def release_file(path: str, body: bytes, mode: int) -> ReleaseFile:
    return ReleaseFile(path=path, mode=mode & 0o755, sha256=hashlib.sha256(body).hexdigest(), body=body)


def release_bytes(release: Release) -> bytes:
    return canonical(release)


def digest(body: bytes) -> str:
    """``sha256:<hex>`` of a release's stored bytes: what a claim's :class:`~events.claim.AppRef` pins."""
    return "sha256:" + hashlib.sha256(body).hexdigest()


# -- rendering -------------------------------------------------------------------------------------------------------


def render_text(text: str, slots: Mapping[str, str]) -> str:
    return text.format_map({name: slots[name] for name in slots_in(text, "a value")})


def render_command(release: Release, slots: Mapping[str, str]) -> list[str]:
    return [render_text(a, slots) for a in release.command]


def render_env(release: Release, slots: Mapping[str, str], secrets: Mapping[str, str]) -> dict[str, str]:
    """The instance's environment from the release (its env rendered, its secrets opened): the ``instanceEnv`` of
    §7.3's composition, before the inherited and the agent-owned variables."""
    env = {v.name: render_text(v.value, slots) for v in release.env}
    env.update({s.name: secrets[s.name] for s in release.secrets})
    return env


def var_classes(release: Release) -> dict[str, SlotClass]:
    """Each variable's T3 class (§7.3): the strongest class among the slots its template names (layout over region
    over equal); a secret is equal."""
    out: dict[str, SlotClass] = {}
    for var in release.env:
        best: SlotClass = "equal"
        for slot in slots_in(var.value, f"env.{var.name}"):
            if _RANK[SLOTS[slot]] > _RANK[best]:
                best = SLOTS[slot]
        out[var.name] = best
    out.update({s.name: "equal" for s in release.secrets})
    return out


def check_release(release: Release, *, name: str, number: int) -> None:
    """A release read back must be the one asked for and renderable (:class:`ManifestError` otherwise)."""
    if release.v != RELEASE_VERSION:
        raise ManifestError(f"release {name}@{number} has format {release.v}, which this box cannot render")
    if release.name != name or release.release != number:
        raise ManifestError(f"the object of release {name}@{number} holds {release.label}")
    for i, arg in enumerate(release.command):
        slots_in(arg, f"command[{i}]")
    var_classes(release)


__all__ = [
    "APP_NAME", "REFUSED_COLUMNS", "SLOTS", "EnvVar", "Manifest", "ManifestError", "Release", "ReleaseFile",
    "SealedSecret", "SlotClass", "StoreBinding", "build_release", "check_release", "digest", "parse_manifest",
    "release_bytes", "release_file", "render_command", "render_env", "render_text", "secret_aad", "slots_in",
    "var_classes",
]
