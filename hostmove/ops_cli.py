"""``hostmove login`` and ``hostmove token create``: operator credentials the way flyctl and kubectl keep them (issue
20 item 4; spec §12).

    hostmove login --door URL        read a token from stdin (or a prompt), check the door answers, store both
    hostmove logout                  forget the stored login
    hostmove token create --role operator|status [--label L] [--digest-file F]
                                     a new token, printed once, and the digest entry the door is configured with

The door never holds a token, only its sha256 (:mod:`services.door.auth`): ``token create`` prints the token (keep
it: it is never shown again) and the entry ``label=<sha256>`` for ``HOSTMOVE_OPERATOR_TOKENS`` (or
``HOSTMOVE_STATUS_TOKENS``), or appends it to the door's tokens file (``--digest-file``, owner-only). A token is
never taken from the command line (it would be in every process listing): ``login`` reads it from stdin.
"""

from __future__ import annotations

import argparse
import getpass
import os
import secrets
import sys
from pathlib import Path
from typing import Any, TextIO

import aiohttp

from hostmove import exitcodes
from hostmove.context import Context, ContextError, remove_context, write_context

TOKEN_BYTES = 32


def add_parsers(sub: Any) -> None:
    lg = sub.add_parser("login", help="store the door's URL and your token (read from stdin) for later commands")
    lg.add_argument("--door", required=True, help="the door's URL, e.g. http://127.0.0.1:8081")
    sub.add_parser("logout", help="forget the stored login")
    tk = sub.add_parser("token", help="make tokens for the door")
    tk_sub = tk.add_subparsers(dest="token_action", required=True)
    tc = tk_sub.add_parser("create", help="a new token, printed once, and the digest entry the door takes")
    tc.add_argument("--role", choices=("operator", "status"), required=True,
                    help="operator: request, cut, abort, resolve; status: read a move's status only")
    tc.add_argument("--label", default="", help="who holds it, as the door records it (default token-<digest>)")
    tc.add_argument("--digest-file", help="append the entry to this door tokens file (created owner-only)")


def new_token() -> str:
    """A fresh bearer token: 32 random bytes, URL-safe."""
    return secrets.token_urlsafe(TOKEN_BYTES)


def digest_entry(token: str, label: str) -> str:
    """The line the door's configuration takes for ``token`` (:func:`services.door.auth.parse_entries`)."""
    from services.door.auth import parse_entries, token_digest

    entry = f"{label}={token_digest(token)}" if label else token_digest(token)
    parse_entries([entry], "operator", "--label")  # a label the door would refuse is refused here
    return entry


def _append_entry(path: Path, entry: str) -> None:
    """Append ``entry`` to the tokens file, created 0600; a file others may read is refused (it names who holds
    which token)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        if os.fstat(fd).st_mode & 0o077:
            raise ContextError(f"{path} is readable by others; make it owner-only (chmod 600) first")
        os.write(fd, (entry + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def _token_create(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    from services.door.auth import ENV_OPERATOR, ENV_OPERATOR_FILE, ENV_STATUS, ENV_STATUS_FILE, TokenConfigError

    token = new_token()
    try:
        entry = digest_entry(token, args.label)
    except TokenConfigError:
        print(f"token create refused: the label {args.label!r} is not 1 to 64 letters, digits, '.', '_', '@' or '-'",
              file=err)
        return exitcodes.USAGE
    env, env_file = (ENV_OPERATOR, ENV_OPERATOR_FILE) if args.role == "operator" else (ENV_STATUS, ENV_STATUS_FILE)
    if args.digest_file:
        try:
            _append_entry(Path(args.digest_file), entry)
        except (ContextError, OSError) as exc:
            print(f"token create failed: {exc}", file=err)
            return exitcodes.FAILED
        where = f"appended to {args.digest_file} (the door's {env_file})"
    else:
        where = f"give the door this entry in {env} (comma-separated) or as a line of {env_file}"
    print(token, file=out)
    print(f"{args.role} token above, shown once: keep it (`hostmove login --door URL` reads it from stdin). Its "
          f"digest entry, {where}:\n{entry}", file=err)
    return exitcodes.OK


def _read_token(stdin: TextIO) -> str:
    if stdin.isatty():
        return getpass.getpass("token: ").strip()
    return stdin.readline().strip()


async def _door_answers(url: str) -> str:
    """``""`` when ``url`` is the door (its ``/healthz`` says so), else why not."""
    try:
        async with aiohttp.ClientSession() as session, session.get(
                f"{url}/healthz", timeout=aiohttp.ClientTimeout(total=10)) as resp:
            body = await resp.json(content_type=None) if resp.status == 200 else None
    except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as exc:
        return f"it did not answer ({type(exc).__name__})"
    if not isinstance(body, dict) or body.get("service") != "door":
        return "what answered there is not a hostmove door"
    return ""


async def _login(args: argparse.Namespace, out: TextIO, err: TextIO, stdin: TextIO) -> int:
    from hostmove.move_cli import ConfigProblem, load_config, redact_url

    url = args.door.strip().rstrip("/")
    token = _read_token(stdin)
    try:
        load_config({"HOSTMOVE_DOOR_URL": url, "HOSTMOVE_TOKEN": token})  # the same checks as every command's
    except ConfigProblem as exc:
        print(f"login refused: {str(exc).replace('HOSTMOVE_TOKEN', 'the token on stdin')}", file=err)
        return exitcodes.USAGE
    why = await _door_answers(url)
    if why:
        print(f"login failed: the door at {redact_url(url)} is unavailable: {why}; nothing was stored", file=err)
        return exitcodes.UNAVAILABLE
    try:
        path = write_context(os.environ, Context(door_url=url, token=token))
    except (ContextError, OSError) as exc:
        print(f"login failed: {exc}", file=err)
        return exitcodes.FAILED
    print(f"logged in to the door at {url} (stored in {path}, owner-only; HOSTMOVE_DOOR_URL and HOSTMOVE_TOKEN "
          "override it)", file=out)
    return exitcodes.OK


async def run(args: argparse.Namespace) -> int:
    """``login``, ``logout`` and ``token create``; the exit code (:mod:`hostmove.exitcodes`)."""
    if args.command == "token":
        return _token_create(args, sys.stdout, sys.stderr)
    if args.command == "logout":
        removed = remove_context(os.environ)
        print(f"forgot the login in {removed}" if removed else "no login was stored")
        return exitcodes.OK
    return await _login(args, sys.stdout, sys.stderr, sys.stdin)


__all__ = ["add_parsers", "digest_entry", "new_token", "run"]
