"""A box's apps: every start of every instance on this box rendered from the host's release (issue 18).

:class:`BoxApps` is what the box's agent hands its activator (a serving wake, a recovery's probe, a relocation: the
activator's ``app``), its landing (the probe's apps: :meth:`BoxApps.probe_factory`), its source side (the launch
report's inputs, :meth:`BoxApps.launch`) and its timer converger (:meth:`BoxApps.timers_path`). For a host it reads the
claim's :class:`~events.claim.AppRef`, stages that release on this box (:class:`~services.apps.releases.ReleaseBook`,
verified by digest), opens its secrets with this box's secrets key (§10; a box without the deployment's key cannot),
and renders the command and the environment with this box's slots (:mod:`services.apps.manifest`). A bare program
name is resolved on the agent's ``PATH``. A command this box cannot resolve, a secret it cannot open, a release it
cannot stage is an :class:`AppUnavailable` with the reason: nothing starts.

**The box's overlay** (``<box>/overlay.env``, ``KEY=VALUE`` lines, ``#`` comments; §7.2's ``overlay_etag`` is its
sha256): the operator's box-level settings over every instance's release environment on this box (a box's proxy, its
time zone). The composed launch environment (§7.3 "Snapshot rounds") is the release's rendered environment under the
overlay; an instance inherits nothing from the agent (issue 14 item 4), so that is what both the source's launch
report and the target's T3 compose (:meth:`BoxApps.composed`).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from events.claim import Claim
from kernel.ports import free_port
from services.apps.manifest import (
    ENV_NAME,
    PLATFORM_PREFIXES,
    SlotClass,
    render_command,
    render_env,
    secret_aad,
    var_classes,
)
from services.apps.releases import ReleaseBook, ReleaseError, Staged, read_default_app
from services.box.artifacts.sealing import PrivateKey, SealError, open_key, secrets_key_fp
from services.box.instance.activator import AppSpec, AppUnavailable
from services.box.instance.proctree import ProcessTree
from services.box.instance.sandbox import instance_dir
from services.source.preparing import LaunchInputs
from services.source.report import compose_env
from services.target.probe import ProbeApp, ProcessApp

OVERLAY_FILE = "overlay.env"
APP_BUNDLE = "app"
"""The launch input naming the release's digest (``bundle_etags``, §7.2 ``move.inputs``): the release is this
system's config bundle."""


@dataclass
class BoxApps:
    label: str
    region: str
    box_dir: Path
    side_dir: Path
    book: ReleaseBook
    read_claim: Callable[[str], Awaitable[Claim | None]]
    secrets_key: PrivateKey | None
    tree: ProcessTree | None = None
    python: str = sys.executable
    environ: Mapping[str, str] = field(default_factory=lambda: dict(os.environ))
    probe_request_timeout_s: float = 1.0
    _current: dict[str, Staged] = field(default_factory=dict)

    @property
    def data_dir(self) -> Path:
        return self.box_dir / "data"

    # -- the release of a host ---------------------------------------------------------------------------------

    async def staged_for(self, claim: Claim | None) -> Staged:
        """The host's release, staged on this box (fetched and verified the first time)."""
        if claim is None or claim.holder is None:
            raise AppUnavailable("the host has no holder, so no release to run")
        ref = claim.holder.app or await read_default_app(self.book.store, self.book.bucket)
        if ref is None:
            raise AppUnavailable(f"{claim.host} names no app release (create it with --app) and the deployment "
                                 "names no default app")
        try:
            staged = await self.book.stage(ref)
        except ReleaseError as exc:
            raise AppUnavailable(f"release {ref.name}@{ref.release} is not staged on {self.label}: {exc}") from None
        self._current[claim.host] = staged
        return staged

    def slots(self, host: str, staged: Staged, port: int) -> dict[str, str]:
        data = instance_dir(self.data_dir, host)  # the instance's own directory (issue 14)
        instance = data / host
        return {
            "host": host, "region": self.region, "box": self.label, "port": str(port), "data_dir": str(data),
            "db": str(data / f"{host}.db"), "instance_dir": str(instance),
            "files_dir": str(instance / staged.release.files_dir), "release_dir": str(staged.dir),
            "side_dir": str(self.side_dir), "python": self.python,
        }

    def secrets(self, staged: Staged) -> dict[str, str]:
        """The release's secrets, opened with this box's key (§10)."""
        release = staged.release
        if not release.secrets:
            return {}
        if self.secrets_key is None:
            raise AppUnavailable(f"{self.label} holds no secrets key, so the secrets of {release.label} stay sealed")
        out = {}
        for secret in release.secrets:
            try:
                value = open_key(secret.sealed, self.secrets_key, aad=secret_aad(release.name, release.release,
                                                                               secret.name))
            except SealError:
                raise AppUnavailable(
                    f"the secret {secret.name} of {release.label} does not open with {self.label}'s secrets key "
                    f"({secrets_key_fp(self.secrets_key)}; it is sealed to {release.key_fp})") from None
            out[secret.name] = value.decode("utf-8", "replace")
        return out

    def command(self, staged: Staged, slots: Mapping[str, str]) -> list[str]:
        """The rendered argv with its program resolved on this box (T7 "its command resolvable")."""
        argv = render_command(staged.release, slots)
        program = argv[0]
        if "/" in program:
            if not (os.path.isfile(program) and os.access(program, os.X_OK)):
                raise AppUnavailable(f"the command of {staged.release.label}, {program}, is not an executable file "
                                     f"on {self.label}")
            return argv
        found = shutil.which(program, path=self.environ.get("PATH", os.defpath))
        if found is None:
            raise AppUnavailable(f"the command of {staged.release.label}, {program}, is not found on {self.label}'s "
                                 "PATH")
        return [found, *argv[1:]]

    def overlay(self) -> tuple[dict[str, str], str]:
        """The box's overlay and its etag (``sha256:<hex>`` of the file; ``""`` without one). A line that is not a
        setting, or names a platform variable, is an :class:`AppUnavailable` (never silently dropped)."""
        path = self.box_dir / OVERLAY_FILE
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return {}, ""
        out: dict[str, str] = {}
        for number, line in enumerate(raw.decode("utf-8", "replace").splitlines(), start=1):
            text = line.strip()
            if not text or text.startswith("#"):
                continue
            name, eq, value = text.partition("=")
            name = name.strip()
            if not eq or not ENV_NAME.match(name) or name.startswith(PLATFORM_PREFIXES):
                raise AppUnavailable(f"{path} line {number} is not a KEY=VALUE setting of an app variable")
            out[name] = value
        return out, "sha256:" + hashlib.sha256(raw).hexdigest()

    def instance_env(self, host: str, staged: Staged, port: int, secrets: Mapping[str, str]) -> dict[str, str]:
        """The release's environment rendered for this box, under the box's overlay."""
        return {**render_env(staged.release, self.slots(host, staged, port), secrets), **self.overlay()[0]}

    # -- what the box does with it -----------------------------------------------------------------------------

    async def spec(self, claim: Claim) -> AppSpec:
        """The activator's :class:`AppSpec` for ``claim``'s host (every start: :meth:`Activator.wake`)."""
        staged = await self.staged_for(claim)
        secrets = self.secrets(staged)
        argv = self.command(staged, self.slots(claim.host, staged, 0))

        def env(host: str, _data_dir: Path, port: int, _region: str) -> dict[str, str]:
            return self.instance_env(host, staged, port, secrets)

        release = staged.release
        return AppSpec(argv=argv, env=env, ready_path=release.ready_path, ready_within_s=release.ready_within_s)

    async def probe_factory(self, host: str, attempt: int, db_path: Path) -> ProbeApp:
        """The landing's probe app for attempt ``attempt`` (§7.7): the host's release rendered on this box, strictly
        spawned into the host's leaf of the box's tree. An app this box cannot render raises (the landing fails)."""
        if self.tree is None:
            raise AppUnavailable(f"{self.label} has no process tree to start a probe in")
        claim = await self.read_claim(host)
        staged = await self.staged_for(claim)
        secrets = self.secrets(staged)
        port = free_port()
        slots = self.slots(host, staged, port)
        app = ProcessApp(argv=self.command(staged, slots), port=port, host=host, tree=self.tree,
                         ready_path=staged.release.ready_path, env=self.instance_env(host, staged, port, secrets),
                         logs=self.box_dir / "logs", request_timeout_s=self.probe_request_timeout_s)
        if hasattr(app, "data_dir"):  # the sandbox hands the probe's files to the instance user (issue 14 item 4)
            app.data_dir = instance_dir(self.data_dir, host)
        else:
            app.cwd = self.box_dir
        return app

    async def composed(self, claim: Claim | None, *, port: int = 0) -> tuple[Staged, dict[str, str],
                                                                          dict[str, SlotClass]]:
        """The composed launch environment of the host's next spawn on this box (§7.3) and each release variable's
        T3 class (:func:`~services.apps.manifest.var_classes`)."""
        staged = await self.staged_for(claim)
        assert claim is not None
        env = compose_env(self.instance_env(claim.host, staged, port, self.secrets(staged)), {}, {})
        return staged, env, var_classes(staged.release)

    async def launch(self, host: str) -> LaunchInputs:
        """What this box's next spawn of ``host`` would get (the source's launch report, §7.3): the composed
        environment and the release's identity as its input versions."""
        staged, env, _classes = await self.composed(await self.read_claim(host))
        return LaunchInputs(env=env, bundle_etags={APP_BUNDLE: staged.ref.digest}, overlay_etag=self.overlay()[1],
                            release=staged.release.label)

    def ready_path(self, host: str) -> str:
        """The readiness path of the host's release as this box last rendered it (``/ready`` before any)."""
        staged = self._current.get(host)
        return staged.release.ready_path if staged is not None else "/ready"

    def timers_path(self, host: str) -> Path | None:
        """Where the host's running release declares its timers (None: it declares none, or none runs here)."""
        staged = self._current.get(host)
        if staged is None or not staged.release.timers:
            return None
        return instance_dir(self.data_dir, host) / host / staged.release.timers


__all__ = ["APP_BUNDLE", "AppUnavailable", "BoxApps"]
