"""``hostmove deployment init`` and ``hostmove app publish|list|show`` (issue 18).

- ``hostmove deployment init [--region R ...] [--secrets-key PEM]``: the deployment bucket and each region's data
  bucket, versioned and through the conformance probe (a store failing it is refused, issue 20 item 5); the
  deployment's key (the one given, or generated once under
  ``<root>/deployment/``) and its protocol floor, published to the console create-only
  (:func:`services.box.deployment.init_deployment`). ``hostmove box init`` then takes that key or refuses.
- ``hostmove app publish --name N manifest.toml``: the manifest as the app's next release, its secrets sealed to the
  deployment's key, stored create-only (:func:`services.apps.releases.publish`); prints the release and its digest.
- ``hostmove app list``: every app and its releases; ``hostmove app show N [--release K]``: one release (never a
  secret's value), as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from hostmove import exitcodes
from hostmove.runtime import load_settings, open_runtime


def add_parsers(sub: Any) -> None:
    dp = sub.add_parser("deployment", help="initialize the deployment: its secrets key and protocol floor")
    dp_sub = dp.add_subparsers(dest="deployment_action", required=True)
    di = dp_sub.add_parser("init", help="hold the deployment's secrets key and publish it and the floor (once)")
    di.add_argument("--secrets-key", help="the deployment's P-256 key (PEM, mode 0600); default: generated once")
    di.add_argument("--region", action="append", default=[], metavar="R",
                    help="a region whose data bucket to create (repeat for each region)")
    ap = sub.add_parser("app", help="publish and inspect app releases")
    ap_sub = ap.add_subparsers(dest="app_action", required=True)
    pub = ap_sub.add_parser("publish", help="publish a manifest as the app's next release")
    pub.add_argument("--name", required=True, help="the app's name (lowercase letters, digits and '-')")
    pub.add_argument("manifest", help="the release manifest (TOML)")
    ap_sub.add_parser("list", help="every app and its releases")
    show = ap_sub.add_parser("show", help="one release of an app (never a secret's value)")
    show.add_argument("name")
    show.add_argument("--release", type=int, default=None, help="the release number (default: the newest)")


async def run_deployment(args: argparse.Namespace) -> int:
    """Create the deployment bucket and each ``--region``'s data bucket with versioning on, refuse a store that
    fails the conformance probe (issue 20 item 5), then hold and publish the key and the floor. Idempotent."""
    from services.agent.config import region_bucket
    from services.box.deployment import init_deployment, prepare_buckets
    from services.box.roster import RosterRefusal
    from services.objstore.s3 import S3Store

    settings = load_settings(Path(args.root))
    buckets = [settings.bucket, *(region_bucket(r) for r in args.region)]
    store = await S3Store.open(endpoint=settings.s3_endpoint, access_key=settings.s3_access_key,
                               secret_key=settings.s3_secret_key, region=settings.s3_region)
    try:
        refused = await prepare_buckets(store, buckets)
    finally:
        await store.close()
    if refused is not None:
        print(f"deployment init refused: the object store at {settings.s3_endpoint} cannot hold this deployment: "
              f"bucket {refused.bucket}: {refused.why}. Point HOSTMOVE_S3_ENDPOINT at a store with versioning and "
              "conditional writes (AWS S3, MinIO, SeaweedFS)", file=sys.stderr)
        return exitcodes.NONCONFORMING
    print(f"buckets {', '.join(buckets)}: versioned, conformance probe passed")
    rt = await open_runtime(settings, "cli", probe=False)
    try:
        done = await init_deployment(root=settings.root, store=rt.store, bucket=settings.bucket, clock=rt.clock,
                                     secrets_key=Path(args.secrets_key) if args.secrets_key else None)
    except RosterRefusal as exc:
        print(f"deployment init refused: {exc}", file=sys.stderr)
        return exitcodes.REFUSED
    finally:
        await rt.close()
    print(f"deployment key {done.key.fp} (held at {done.key_path}); protocol floor {done.floor.min}"
          + (f", release {done.floor.min_release}" if done.floor.min_release else ""))
    return exitcodes.OK


async def run_app(args: argparse.Namespace) -> int:
    from services.apps.releases import ReleaseError, describe, list_releases, load_manifest, publish, read_release

    settings = load_settings(Path(args.root))
    rt = await open_runtime(settings, "cli", probe=False)
    try:
        if args.app_action == "publish":
            try:
                manifest, files = load_manifest(Path(args.manifest), name=args.name)
                release, ref = await publish(rt.store, settings.bucket, manifest, files, clock=rt.clock, rng=rt.rng)
            except ReleaseError as exc:
                print(f"{args.name} was not published: {exc}", file=sys.stderr)
                return exitcodes.REFUSED
            print(f"published {release.label} ({ref.digest}); create a host with: hostmove host create <host> "
                  f"--box <box> --app {release.name} --release {release.release}")
            return exitcodes.OK
        if args.app_action == "list":
            apps = await list_releases(rt.store, settings.bucket)
            if not apps:
                print("no app is published yet (hostmove app publish --name <app> <manifest.toml>)")
            for name, numbers in apps.items():
                print(f"{name}: releases {', '.join(str(n) for n in numbers)} (newest {numbers[-1]})")
            return exitcodes.OK
        try:
            release, ref, _body = await read_release(rt.store, settings.bucket, args.name, args.release)
        except ReleaseError as exc:
            print(str(exc), file=sys.stderr)
            return exitcodes.FAILED
        print(json.dumps(describe(release, ref), indent=2, sort_keys=True))
        return exitcodes.OK
    finally:
        await rt.close()


__all__ = ["add_parsers", "run_app", "run_deployment"]
