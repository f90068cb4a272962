"""Long runs that survive an interruption (issue 17 item 4; model digest §1 ``mutate.sh``): the sweep and the
baseline journal every finished run and pick up where they stopped.

A run is named by its world (``moves`` or ``stand-in``, or a witness), the rules switched off and its seed. Its
verdict (the first violation, a harness error, the guards it consulted, the trace hash) is appended as one JSON line
to ``<root>/<fingerprint>/runs.jsonl`` as soon as it finishes; the fingerprint is a digest of every source file the
runs execute, so a journal is reused only by the code that wrote it (model digest §1: ``mutate.sh`` "refuses a binary
older than the source") and another code's journal is never mixed in. ``hostmove sim sweep`` and ``hostmove sim
baseline`` start again after Ctrl-C, a crash or a reboot with the runs the journal holds.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sim.invariants import Violation
from sim.run import Result

__all__ = ["DEFAULT_ROOT", "Journal", "RunKey", "fingerprint", "run_journaled"]

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_ROOT = ROOT / ".hostmove" / "sim-journal"
SOURCES = ("bus", "events", "kernel", "moveprobe", "projections", "services", "sim")

RunKey = tuple[str, tuple[str, ...], int | str]
"""(world or witness name, the rules switched off, the seed; a witness's is its name)."""


def fingerprint(root: Path = ROOT) -> str:
    """A digest of every Python source the runs execute (paths and bytes, in order)."""
    h = hashlib.sha256()
    for package in SOURCES:
        for path in sorted((root / package).rglob("*.py")):
            h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def _key_text(key: RunKey) -> str:
    world, mutate, seed = key
    return f"{world}|{','.join(mutate)}|{seed}"


def to_record(key: RunKey, r: Result, *, all_consulted: bool) -> dict[str, Any]:
    world, mutate, _seed = key
    consulted = r.consulted if all_consulted else {n: r.consulted.get(n, 0) for n in mutate}
    return {"key": _key_text(key), "seed": r.seed, "hash": r.trace_hash, "steps": r.steps, "error": r.error,
            "violation": [r.violations[0].invariant, r.violations[0].what] if r.violations else None,
            "consulted": consulted, "counters": r.counters}


def from_record(rec: dict[str, Any]) -> Result:
    violations: tuple[Violation, ...] = ()
    if rec.get("violation"):
        invariant, what = rec["violation"]
        violations = (Violation(rec["seed"], invariant, what, 0.0),)
    return Result(seed=rec["seed"], violations=violations, trace_hash=rec["hash"], steps=rec["steps"],
                  counters=rec.get("counters", {}), consulted=rec.get("consulted", {}), error=rec.get("error"))


@dataclass
class Journal:
    """The finished runs of one code version (see the module docstring). ``None`` root: nothing is kept."""

    path: Path | None
    runs: dict[str, dict[str, Any]]

    @classmethod
    def open(cls, root: Path | None, kind: str) -> Journal:
        if root is None:
            return cls(None, {})
        path = root / f"{kind}-{fingerprint()}" / "runs.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        runs: dict[str, dict[str, Any]] = {}
        if path.exists():
            for line in path.read_text(encoding="utf-8").splitlines():
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue  # a line cut short by the interruption: that run runs again
                runs[rec["key"]] = rec
        return cls(path, runs)

    def get(self, key: RunKey) -> Result | None:
        rec = self.runs.get(_key_text(key))
        return from_record(rec) if rec is not None else None

    def put(self, key: RunKey, result: Result, *, all_consulted: bool) -> None:
        rec = to_record(key, result, all_consulted=all_consulted)
        self.runs[rec["key"]] = rec
        if self.path is not None:
            with self.path.open("a", encoding="utf-8") as f:
                f.write(json.dumps(rec, sort_keys=True) + "\n")


def run_journaled(calls: Sequence[tuple[RunKey, Callable[..., Result], tuple[object, ...]]], journal: Journal,
                  pool: ProcessPoolExecutor | None, *, all_consulted: bool = False,
                  progress: Callable[[int, int], None] | None = None) -> dict[RunKey, Result]:
    """Every call's result, from the journal when it holds the run, else run (in the pool) and journaled as soon
    as it finishes. ``all_consulted``: keep every guard's count (a baseline's, for the sweep's pruning)."""
    out: dict[RunKey, Result] = {}
    todo: list[tuple[RunKey, Callable[..., Result], tuple[object, ...]]] = []
    for key, fn, args in calls:
        done = journal.get(key)
        if done is not None:
            out[key] = done
        else:
            todo.append((key, fn, args))
    total, finished = len(calls), len(out)
    if progress is not None and todo:
        progress(finished, total)
    if pool is None:
        for key, fn, args in todo:
            out[key] = fn(*args)
            journal.put(key, out[key], all_consulted=all_consulted)
            finished += 1
            if progress is not None:
                progress(finished, total)
        return out
    pending: dict[Future[Result], RunKey] = {pool.submit(fn, *args): key for key, fn, args in todo}
    while pending:
        ready, _ = wait(pending, return_when=FIRST_COMPLETED)
        for fut in ready:
            key = pending.pop(fut)
            out[key] = fut.result()
            journal.put(key, out[key], all_consulted=all_consulted)
            finished += 1
            if progress is not None:
                progress(finished, total)
    return out


def cores() -> int:
    """Every core of the machine (the deep runs; the gate keeps its own default)."""
    return max(1, os.cpu_count() or 1)


def consulted_in(baseline: dict[RunKey, Result], world: str, seeds: Iterable[int], rule: str) -> list[int]:
    """The seeds whose unmutated run consulted ``rule``: only there can switching it off change anything (a run
    that never asks for the rule runs the same with it off)."""
    return [s for s in seeds if baseline[(world, (), s)].consulted.get(rule, 0)]
