"""The operator's commands for apps and the deployment's key (issue 18 items 1, 2), as OS processes against the
real stack: ``hostmove deployment init``, ``hostmove box init`` taking the deployment's key or refusing,
``hostmove app publish|list|show`` and ``hostmove host create --app``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
import pytest_asyncio

from hostmove import exitcodes
from hostmove.stackinfo import StackInfo
from services.box.artifacts.sealing import generate_private_key, save_private_key
from services.objstore.s3 import S3Store

HOSTMOVE = [sys.executable, "-m", "hostmove.cli"]
NOTES = Path(__file__).resolve().parent.parent / "examples" / "notes" / "release.toml"


def run(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(HOSTMOVE + args, env=env, capture_output=True, text=True, timeout=60)


@pytest_asyncio.fixture(loop_scope="session")
async def env(stack: StackInfo, unique: Callable[[str], str], tmp_path: Path) -> AsyncIterator[dict[str, str]]:
    bucket = unique("appcli")
    store = await S3Store.open(stack.s3_endpoint, stack.s3_access_key, stack.s3_secret_key, stack.s3_region)
    await store.create_bucket(bucket)
    out = dict(os.environ)
    out.update(HOSTMOVE_NATS_URL=stack.nats_url, HOSTMOVE_S3_ENDPOINT=stack.s3_endpoint,
               HOSTMOVE_S3_ACCESS_KEY=stack.s3_access_key, HOSTMOVE_S3_SECRET_KEY=stack.s3_secret_key,
               HOSTMOVE_BUCKET=bucket, HOSTMOVE_ROOT=str(tmp_path / "root"))
    try:
        yield out
    finally:
        await store.close()


@pytest.mark.asyncio(loop_scope="session")
async def test_box_init_takes_the_deployment_s_key_and_apps_are_published_and_named(env: dict[str, str],
                                                                                 tmp_path: Path) -> None:
    refused = run(["box", "init", "--label", "ie-1", "--region", "ie"], env)
    assert refused.returncode == exitcodes.REFUSED and "run `hostmove deployment init` first" in refused.stderr
    init = run(["deployment", "init"], env)
    assert init.returncode == 0, init.stderr
    assert "deployment key sha256:" in init.stdout and "protocol floor 1" in init.stdout
    assert run(["deployment", "init"], env).returncode == 0, "again: nothing changes"
    other = tmp_path / "other.pem"
    save_private_key(generate_private_key(), other)
    foreign = run(["box", "init", "--label", "uk-1", "--region", "uk", "--secrets-key", str(other)], env)
    assert foreign.returncode == exitcodes.REFUSED
    assert "is not the deployment's secrets key" in foreign.stderr and str(other) in foreign.stderr
    box = run(["box", "init", "--label", "ie-1", "--region", "ie"], env)
    assert box.returncode == 0, box.stderr
    held = Path(env["HOSTMOVE_ROOT"]) / "deployment" / "secrets.pem"
    assert (Path(env["HOSTMOVE_ROOT"]) / "boxes" / "ie-1" / "secrets.pem").read_bytes() == held.read_bytes()

    published = run(["app", "publish", "--name", "notes", str(NOTES)], env)
    assert published.returncode == 0, published.stderr
    assert published.stdout.startswith("published notes@1 (sha256:")
    assert run(["app", "publish", "--name", "notes", str(NOTES)], env).stdout.startswith("published notes@2 ")
    listed = run(["app", "list"], env)
    assert listed.stdout.strip() == "notes: releases 1, 2 (newest 2)"
    shown = json.loads(run(["app", "show", "notes", "--release", "1"], env).stdout)
    assert shown["app"] == "notes" and shown["release"] == 1 and shown["files"][0]["path"] == "notes.py"
    assert shown["sealed_to"] == init.stdout.split("deployment key ")[1].split(" ")[0]
    bad = tmp_path / "bad.toml"
    bad.write_text('command = ["x"]\n[env]\nHOSTMOVE_S3_SECRET_KEY = "steal"\n')
    refused_app = run(["app", "publish", "--name", "bad", str(bad)], env)
    assert refused_app.returncode == exitcodes.REFUSED and "the platform's own variable" in refused_app.stderr

    no_app = run(["host", "create", "h.example.com", "--box", "ie-1"], env)
    assert no_app.returncode == exitcodes.REFUSED and "--app" in no_app.stderr
    ghost = run(["host", "create", "h.example.com", "--box", "ie-1", "--app", "ghost"], env)
    assert ghost.returncode == exitcodes.REFUSED and "has no published release" in ghost.stderr
    made = run(["host", "create", "h.example.com", "--box", "ie-1", "--app", "notes", "--release", "1"], env)
    assert made.returncode == 0, made.stderr
    assert "running notes@1" in made.stdout
