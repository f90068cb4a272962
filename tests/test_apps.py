"""App releases (issue 18): the manifest, publishing create-only with sealed secrets, reading by digest, staging on a
box, and the rendering every start uses (slots, secrets opened with the box's key, the overlay, T3's classes)."""

from __future__ import annotations

import os
from pathlib import Path

import msgspec
import pytest

from events.claim import AppRef, Claim, Holder
from kernel.ports import ManualClock
from services.apps.box import BoxApps
from services.apps.manifest import ManifestError, parse_manifest, var_classes
from services.apps.releases import (
    ReleaseBook,
    ReleaseError,
    list_releases,
    load_manifest,
    publish,
    read_default_app,
    read_release,
    release_key,
    set_default_app,
)
from services.box.artifacts.sealing import generate_private_key
from services.box.instance.activator import AppUnavailable
from services.box.roster import publish_deployment_key
from services.objstore.memory import MemoryStore

NOTES = Path(__file__).resolve().parent.parent / "examples" / "notes" / "release.toml"
BUCKET = "apps-deploy"


def manifest_doc(**extra: object) -> dict[str, object]:
    return {"command": ["{python}", "-m", "app"], "env": {"DB": "{db}", "WHERE": "{region}", "MODE": "fast"},
            **extra}


def test_a_manifest_is_checked_key_by_key() -> None:
    m = parse_manifest(manifest_doc(secrets={"TOKEN": "s"}, timers="t.json", files_dir="files"), name="notes")
    assert m.command == ("{python}", "-m", "app") and m.secrets == {"TOKEN": "s"} and m.files_dir == "files"
    for doc, why in [
        ({"env": {}}, "command must be a list"),
        (manifest_doc(env={"X": "{nope}"}), "is not a slot"),
        (manifest_doc(env={"HOSTMOVE_S3": "x"}), "the platform's own variable"),
        (manifest_doc(timers="../escape.json"), "inside the instance's directory"),
        (manifest_doc(files_dir="/abs"), "inside the instance's directory"),
        (manifest_doc(registry={"colour": "x"}), "is not a registry column"),
        (manifest_doc(ready_path="ready"), "absolute URL path"),
        (manifest_doc(surprise=1), "keys this system does not know"),
        (manifest_doc(env={"X": "{port:05}"}), "is not a slot"),
        (manifest_doc(secrets={"MODE": "x"}), "both in env and in secrets"),
    ]:
        with pytest.raises(ManifestError, match=why):
            parse_manifest(doc, name="notes")
    with pytest.raises(ManifestError, match="not an app name"):
        parse_manifest(manifest_doc(), name="Not An App")


async def deployment() -> tuple[MemoryStore, ManualClock, object]:
    store = MemoryStore()
    await store.create_bucket(BUCKET)
    clock = ManualClock()
    key = generate_private_key()
    await publish_deployment_key(store, BUCKET, key, clock)
    return store, clock, key


async def test_publishing_is_create_only_numbered_and_sealed(tmp_path: Path) -> None:
    store, clock, _key = await deployment()
    manifest, files = load_manifest(NOTES, name="notes", secrets={"NOTES_TOKEN": "tok-1"})
    first, ref1 = await publish(store, BUCKET, manifest, files, clock=clock)
    second, ref2 = await publish(store, BUCKET, manifest, files, clock=clock)
    assert (first.release, second.release) == (1, 2) and ref1.digest != ref2.digest  # every seal is fresh
    assert await list_releases(store, BUCKET) == {"notes": [1, 2]}
    stored = await store.get(BUCKET, release_key("notes", 1))
    assert b"tok-1" not in stored.body  # type: ignore[union-attr]
    release, ref, _ = await read_release(store, BUCKET, "notes", ref=ref1)
    assert ref == ref1 and release.label == "notes@1" and [f.path for f in release.files] == ["notes.py"]
    with pytest.raises(ReleaseError, match="does not match its digest"):
        await read_release(store, BUCKET, "notes", ref=msgspec.structs.replace(ref1, digest="sha256:" + "0" * 64))
    newest, _, _ = await read_release(store, BUCKET, "notes")
    assert newest.release == 2
    await set_default_app(store, BUCKET, ref2)
    assert await read_default_app(store, BUCKET) == ref2


async def test_publishing_needs_the_deployment_key() -> None:
    store = MemoryStore()
    await store.create_bucket(BUCKET)
    manifest = parse_manifest(manifest_doc(), name="app")
    with pytest.raises(ReleaseError, match="hostmove deployment init"):
        await publish(store, BUCKET, manifest, [], clock=ManualClock())


def claim_for(host: str, ref: AppRef) -> Claim:
    return Claim(host=host, gen=3, holder=Holder(incarnation="a" * 64, location=f"instances/{host}/x/", app=ref))


def box_apps(tmp_path: Path, store: MemoryStore, key: object, label: str, region: str, claim: Claim) -> BoxApps:
    async def read_claim(host: str) -> Claim | None:
        return claim

    box_dir = tmp_path / label
    box_dir.mkdir(parents=True, exist_ok=True)
    return BoxApps(label=label, region=region, box_dir=box_dir, side_dir=tmp_path / "side",
                   book=ReleaseBook(box_dir / "releases", store, BUCKET), read_claim=read_claim,
                   secrets_key=key, environ={"PATH": os.environ.get("PATH", "")})  # type: ignore[arg-type]


async def test_a_box_stages_and_renders_every_start_from_the_release(tmp_path: Path) -> None:
    store, clock, key = await deployment()
    manifest, files = load_manifest(NOTES, name="notes", secrets={"NOTES_TOKEN": "tok-1"})
    _release, ref = await publish(store, BUCKET, manifest, files, clock=clock)
    claim = claim_for("n.example.com", ref)
    ie = box_apps(tmp_path, store, key, "ie-1", "ie", claim)
    spec = await ie.spec(claim)
    staged = ie.book.staged(ref)
    assert staged is not None and (staged.dir / "notes.py").is_file()  # T7: staged, verified, its files there
    env = dict(spec.env("n.example.com", tmp_path, 4321, "ie"))
    assert env["NOTES_TOKEN"] == "tok-1" and env["NOTES_PORT"] == "4321"
    assert env["NOTES_DB"] == str(tmp_path / "ie-1" / "data" / "instances" / "n.example.com" / "n.example.com.db")
    assert spec.argv[1] == str(staged.dir / "notes.py") and os.path.isabs(spec.argv[0])
    assert ie.timers_path("n.example.com") == (tmp_path / "ie-1" / "data" / "instances" / "n.example.com"
                                               / "n.example.com" / "timers.json")
    classes = var_classes(staged.release)
    assert classes["NOTES_DB"] == "layout" and classes["NOTES_TOKEN"] == "equal"
    launch = await ie.launch("n.example.com")
    assert launch.release == "notes@1" and launch.bundle_etags == {"app": ref.digest} and launch.overlay_etag == ""
    (tmp_path / "ie-1" / "overlay.env").write_text("# the box's settings\nNOTES_GREETING=hello from ie\n")
    assert (await ie.launch("n.example.com")).env["NOTES_GREETING"] == "hello from ie"
    (tmp_path / "ie-1" / "overlay.env").write_text("HOSTMOVE_S3_SECRET_KEY=x\n")
    with pytest.raises(AppUnavailable, match="not a KEY=VALUE setting of an app variable"):
        await ie.launch("n.example.com")


async def test_a_box_with_another_key_cannot_open_the_secrets(tmp_path: Path) -> None:
    store, clock, _key = await deployment()
    manifest, files = load_manifest(NOTES, name="notes", secrets={"NOTES_TOKEN": "tok-1"})
    _release, ref = await publish(store, BUCKET, manifest, files, clock=clock)
    claim = claim_for("n.example.com", ref)
    stranger = box_apps(tmp_path, store, generate_private_key(), "uk-1", "uk", claim)
    with pytest.raises(AppUnavailable, match="does not open with uk-1's secrets key"):
        await stranger.spec(claim)
    keyless = box_apps(tmp_path, store, None, "us-1", "us", claim)
    with pytest.raises(AppUnavailable, match="holds no secrets key"):
        await keyless.spec(claim)


async def test_a_command_the_box_cannot_resolve_is_refused(tmp_path: Path) -> None:
    store, clock, key = await deployment()
    manifest = parse_manifest({"command": ["no-such-program-anywhere", "--x"]}, name="ghost")
    _release, ref = await publish(store, BUCKET, manifest, [], clock=clock)
    claim = claim_for("g.example.com", ref)
    apps = box_apps(tmp_path, store, key, "ie-1", "ie", claim)
    with pytest.raises(AppUnavailable, match="is not found on ie-1's PATH"):
        await apps.spec(claim)
