"""The floors of the house (docs/architecture.md), read from the imports with the standard library's ``ast``.

- the kernel (``kernel/``) imports nothing of the project but ``events/``; ``events/`` imports only itself;
- nothing below the shell (``events/``, ``kernel/``, ``bus/``, ``services/``, ``projections/``, ``moveprobe/``)
  imports the shell (``hostmove/``);
- no production package imports ``tests/`` or ``sim/``; the shell reaches ``sim/`` only for the ``hostmove sim``
  subcommand, lazily inside that command (a developer's tool that ships with the distribution).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROJECT = {"events", "kernel", "bus", "services", "projections", "moveprobe", "hostmove", "sim", "bench", "tests"}
BELOW_SHELL = ("events", "kernel", "bus", "services", "projections", "moveprobe")
PRODUCTION = (*BELOW_SHELL, "hostmove")
# (importing file, imported top package): the one lazy import the shell may make of the simulation
SHELL_TOOLS = {("hostmove/cli.py", "sim")}


def imports(path: Path) -> Iterator[tuple[str, int, bool]]:
    """Each project import of ``path``: (top package, line, at module level)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    top_level = {id(node) for node in tree.body}
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        for name in names:
            top = name.split(".")[0]
            if top in PROJECT:
                yield top, node.lineno, id(node) in top_level


def files(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def violations() -> list[str]:
    found: list[str] = []
    for package in PRODUCTION:
        for path in files(package):
            rel = path.relative_to(ROOT).as_posix()
            for top, line, module_level in imports(path):
                where = f"{rel}:{line} imports {top}"
                if package == "events" and top != "events":
                    found.append(f"{where}: events/ is the vocabulary and imports only itself")
                elif package == "kernel" and top not in ("kernel", "events"):
                    found.append(f"{where}: the kernel imports nothing of the project but events/")
                elif package in BELOW_SHELL and top == "hostmove":
                    found.append(f"{where}: nothing below the shell imports hostmove/")
                elif top == "tests":
                    found.append(f"{where}: production code never imports tests/")
                elif top == "sim" and ((rel, top) not in SHELL_TOOLS or module_level):
                    found.append(f"{where}: production code never imports sim/")
                elif top == "bench":
                    found.append(f"{where}: production code never imports bench/")
    return found


def test_the_floors_hold() -> None:
    assert violations() == []


def test_the_reader_sees_a_violation(tmp_path: Path) -> None:
    """The reader itself: an import that breaks a floor is found (a check that finds nothing proves nothing)."""
    bad = tmp_path / "bad.py"
    bad.write_text("from hostmove.cli import main\nimport tests.helpers\n\ndef f():\n    from sim import cli\n")
    got = list(imports(bad))
    assert got == [("hostmove", 1, True), ("tests", 2, True), ("sim", 5, False)]


def test_every_package_is_read() -> None:
    """A floor with no files would pass vacuously."""
    for package in PRODUCTION:
        assert files(package), package
    assert (ROOT / "kernel" / "ports.py").exists() and not (ROOT / "hostmove" / "ports.py").exists()


def test_no_test_helper_shadows_a_standard_module() -> None:
    """``tests/helpers/`` scripts run as ``python tests/helpers/x.py`` (the probe's apps), which puts that folder
    first on ``sys.path``: a helper named like a standard module (``http.py``) broke every app importing it."""
    import sys

    helpers = Path(__file__).resolve().parent / "helpers"
    shadowing = sorted(p.stem for p in helpers.glob("*.py") if p.stem in sys.stdlib_module_names)
    assert not shadowing, shadowing
