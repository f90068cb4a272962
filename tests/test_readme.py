"""The README's "Your second move", followed as written after a demo (issue 20 item 8).

``hostmove demo`` runs in a directory of the test's own (what ``make demo`` runs, its ``.hostmove/`` there and its
``.venv`` the project's), then the section's ``sh`` block runs there in one shell, line by line as a reader pastes it.
Two things differ from the page, both so tests can run side by side: the door's port 8081 becomes a free one, and
the user's config directory (where ``hostmove login`` keeps the token) is the test's. The move must end ``done``:
``hostmove move --until closed`` exits 0 and the status the block prints says the last move was done.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

from hostmove.probe_apps import free_port
from hostmove.stack import stack_down

ROOT = Path(__file__).resolve().parent.parent
SECTION = "## Your second move"


def second_move_block(readme: str) -> str:
    """The first ```sh block after the section's heading."""
    start = readme.index(SECTION)
    match = re.search(r"```sh\n(.*?)```", readme[start:], re.S)
    assert match is not None, f"{SECTION} has no sh block"
    return match.group(1)


def clean_env(config: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HOSTMOVE_", "VIRTUAL_ENV"))}
    env["XDG_CONFIG_HOME"] = str(config)
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep)
                                  if not p.startswith(str(ROOT / ".venv")))
    return env


def test_the_readme_s_second_move_ends_done_after_a_demo(tmp_path: Path) -> None:
    work = tmp_path / "repo"
    work.mkdir()
    (work / ".venv").symlink_to(ROOT / ".venv" if (ROOT / ".venv").exists() else Path(sys.prefix))
    env = clean_env(tmp_path / "config")
    block = second_move_block((ROOT / "README.md").read_text())
    assert "hostmove move --host" in block and "hostmove login --door" in block
    port = str(free_port())
    script = block.replace("8081", port)
    shell: subprocess.Popen[str] | None = None
    try:
        demo = subprocess.run([str(work / ".venv" / "bin" / "hostmove"), "demo"], cwd=work, env=env,
                              capture_output=True, text=True, timeout=600)
        assert demo.returncode == 0, demo.stdout + demo.stderr
        shell = subprocess.Popen(["bash", "-e", "-u", "-o", "pipefail", "-x"], cwd=work, env=env, text=True,
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 start_new_session=True)
        try:
            out, _ = shell.communicate(script, timeout=420)
        except subprocess.TimeoutExpired:
            os.killpg(shell.pid, signal.SIGKILL)
            out, _ = shell.communicate()
            raise AssertionError(f"the section did not finish: {out[-3000:]}\n{logs(work)}") from None
        assert shell.returncode == 0, f"{out[-4000:]}\n{status_of(work, env)}\n{logs(work)}"
        token = (work / ".hostmove" / "my-token").read_text().strip()
        assert token and token not in out, "the token is never printed but by token create, into its file"
        status = out.split("+ hostmove move status --host second.example.com", 1)[1]
        assert re.search(r"\bdone\b", status), status
        services = [p for p in sorted((work / ".hostmove" / "logs").glob("*.log")) if p.name not in NOT_SERVICES]
        refused = [line for p in services for line in p.read_text(errors="replace").splitlines()
                   if any(word in line for word in REFUSALS)]
        assert not refused, "a service was refused what its role needs:\n" + "\n".join(refused[:5])
        assert "the ledger consumer recovery started" in (work / ".hostmove" / "logs" / "recovery-2.log").read_text()
        for box in ("ie-1", "uk-1"):  # the section's windows reached its agents (a loaded machine's room)
            assert "cut window 30 s, landing probe window 12 s" in (
                work / ".hostmove" / "logs" / f"box-{box}-2.log").read_text(), box
        assert not list(work.glob("**/context.json")), "the login went to the user's config directory"
        assert (tmp_path / "config" / "hostmove" / "context.json").exists()
    finally:
        if shell is not None:  # the section's services, if it stopped before its last line: only its own group
            with contextlib.suppress(ProcessLookupError):
                os.killpg(shell.pid, signal.SIGTERM)
        stack_down(work / ".hostmove")


NOT_SERVICES = ("nats.log", "weed.log")
REFUSALS = ("Authorization Violation", "permissions violation", "AccessDenied")
"""What a service's log shows when its role lacks a grant it needs (hostmove.access)."""


def status_of(work: Path, env: dict[str, str]) -> str:
    """On a failure: the second host's move status as the CLI prints it (a move that rolled back says why; the CI
    run keeps no files, only this message)."""
    try:
        got = subprocess.run([str(work / ".venv" / "bin" / "hostmove"), "move", "status", "--host",
                              "second.example.com"], cwd=work, env=env, capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        return "--- move status: no answer in 60 s"
    return f"--- move status (exit {got.returncode})\n{(got.stdout + got.stderr)[-2500:]}"


def logs(work: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-1500:]}"
                     for p in sorted((work / ".hostmove" / "logs").glob("*-2.log")))
