"""The gate and the mutation sweep (model digest §1; spec §14.2.1).

- :func:`gate`: the seeds unmutated (no violation, no harness error), each seed run twice with equal
  trace hashes (determinism), and every witness three ways (unmutated and every proper subset hold;
  the whole set violates with its named invariant, or is ``unwired`` for a rule declared
  ``unexercised``).
- :func:`sweep`: each rule switched off alone, over the seeds and its single-rule witnesses, then
  classified: **CAUGHT** (a seed or its witness reported the violation), **MISSED** (not caught and not
  declared), **EXPECTED-MISS** (declared in ``sim/expected-outcomes.txt`` with its reason), **ERROR**
  (a harness failure: deadlock, step budget, a refused call, a broken script; never a detection) or
  **STALE** (declared, but caught). It writes ``sim/RESULTS.md``; the caller exits non-zero on any
  ERROR, MISSED or STALE.

Seeds run in worker processes (``fork``); a run is deterministic, so the split changes nothing.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import re
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from kernel import rules
from sim.run import Result, run_seed
from sim.witness import WITNESSES, Witness, WitnessVerdict, judge, run_witness, subsets

__all__ = [
    "EXPECTED_PATH", "RESULTS_PATH", "Expected", "RuleVerdict", "classify", "gate", "load_expected", "sweep",
    "write_results",
]

EXPECTED_PATH = Path(__file__).with_name("expected-outcomes.txt")
RESULTS_PATH = Path(__file__).with_name("RESULTS.md")
KINDS = ("unexercised", "combination", "unreachable", "liveness-only", "rare")
_LINE = re.compile(r"^(?P<rule>[a-z0-9-]+)\s+(?P<kind>unexercised|combination|unreachable|liveness-only|rare)"
                   r"(?:\s+(?P<n>\d+))?:?\s*(?P<reason>.*)$")

T = TypeVar("T")
Out = Callable[[str], None]


@dataclass(frozen=True)
class Expected:
    rule: str
    kind: str
    reason: str
    rare_n: int = 0


def load_expected(path: Path = EXPECTED_PATH) -> dict[str, Expected]:
    """Parse ``expected-outcomes.txt``. A malformed line or an unknown rule is an error (typos must fail).
    Every module that registers rules is imported first."""
    rules.load_all()
    out: dict[str, Expected] = {}
    for number, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line)
        if m is None:
            raise ValueError(f"{path.name}:{number}: expected '<rule> <kind>: <reason>' with a kind of {KINDS}")
        rule = m["rule"]
        if rule not in rules.RULES:
            raise ValueError(f"{path.name}:{number}: {rule!r} is not a registered rule")
        if m["kind"] == "rare" and not m["n"]:
            raise ValueError(f"{path.name}:{number}: 'rare' needs a seed count, e.g. 'rare 30000'")
        out[rule] = Expected(rule, m["kind"], m["reason"], int(m["n"] or 0))
    return out


def _init_worker() -> None:
    rules.load_all()  # a fresh interpreter registers every rule before it switches any off


def _pool(jobs: int, *, fresh: bool = False) -> ProcessPoolExecutor | None:
    """Worker processes started fresh (``spawn``: nothing of the parent's threads or loop is inherited); with
    ``fresh`` each task gets a new process (and a single job still runs in a child, never in the caller)."""
    if jobs <= 1 and not fresh:
        return None
    return ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn"),
                               initializer=_init_worker, max_tasks_per_child=1 if fresh else None)


def _pmap(fn: Callable[..., T], args: Sequence[tuple[object, ...]], pool: ProcessPoolExecutor | None) -> list[T]:
    if pool is None or len(args) < 2:
        return [fn(*a) for a in args]
    futures = [pool.submit(fn, *a) for a in args]
    return [f.result() for f in futures]


def default_jobs() -> int:
    return max(1, min(os.cpu_count() or 1, 8))


def _seed(seed: int, mutate: tuple[str, ...]) -> Result:
    return run_seed(seed, mutate=mutate)


def _witness(name: str, mutate: tuple[str, ...]) -> Result:
    w = next(w for w in WITNESSES if w.name == name)
    return run_witness(w, mutate)


# -- the gate -------------------------------------------------------------------------------------


@dataclass
class GateReport:
    seeds: int
    failures: list[str] = field(default_factory=list)
    witness_lines: list[str] = field(default_factory=list)
    results: list[Result] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures


def _print_violation(r: Result, out: Out, *, with_trace: bool) -> None:
    for line in r.report():
        out(line)
    if with_trace:
        out(f"--- trace of seed {r.seed} ({len(r.trace)} lines; hash {r.trace_hash})")
        for line in r.trace:
            out(line)
        out("--- end of trace")


def gate(seeds: int = 300, *, jobs: int | None = None, out: Out = print,
         expected: dict[str, Expected] | None = None) -> GateReport:
    """300 seeds unmutated, each twice with the same trace hash, and every witness (model digest §1)."""
    jobs = jobs or default_jobs()
    expected = load_expected() if expected is None else expected
    report = GateReport(seeds)
    with contextlib.ExitStack() as stack:
        pool = _pool(jobs)
        if pool is not None:
            stack.enter_context(pool)
        _gate(report, seeds, pool, out, expected)
    out("gate: PASSED" if report.ok else f"gate: FAILED ({len(report.failures)} problems)")
    return report


def _judge_seeds(report: GateReport, first: list[Result], second: list[Result], out: Out, what: str) -> None:
    """Every seed ran clean (no violation, no harness error) and its second run gave the same trace."""
    seeds = len(first)
    report.results = first
    shown = False
    for a, b in zip(first, second, strict=True):
        if a.error:
            report.failures.append(f"ERROR seed={a.seed}: {a.error}")
            out(f"ERROR seed={a.seed}: {a.error}")
        elif a.violations:
            report.failures.append(a.violations[0].line())
            _print_violation(a, out, with_trace=not shown)
            shown = True
        if a.trace_hash != b.trace_hash:
            report.failures.append(
                f"NONDETERMINISTIC seed={a.seed}: trace {a.trace_hash[:12]} then {b.trace_hash[:12]}")
            out(report.failures[-1])
    distinct = len({r.trace_hash for r in first})
    if seeds > 1 and distinct < seeds:
        report.failures.append(f"only {distinct} distinct traces for {seeds} seeds: the seed does not reach the run")
    out(f"{what}: {seeds} seeds, {sum(1 for r in first if r.violations)} violated, "
        f"{sum(1 for r in first if r.error)} errors, determinism "
        f"{'ok' if all(a.trace_hash == b.trace_hash for a, b in zip(first, second, strict=True)) else 'FAILED'}, "
        f"{distinct} distinct traces, {sum(r.steps for r in first)} steps")


def _move_seed(seed: int, mutate: tuple[str, ...] = ()) -> Result:
    from sim.moves import run_move_seed

    return run_move_seed(seed, mutate=mutate)


def moves_gate(seeds: int = 20, *, jobs: int | None = None, out: Out = print) -> GateReport:
    """The first ``seeds`` seeds of the world with moves (sim/moves.py: the production agents, door and recovery
    under chaos), each twice with the same trace hash: every one converges clean. Slower than the gate's world
    (seconds a seed, not milliseconds), so fewer seeds. Each run gets a fresh process, as a replay does: a seed
    run after others in one process can take another path (open, sim/README.md "Determinism")."""
    report = GateReport(seeds)
    with contextlib.ExitStack() as stack:
        pool = _pool(jobs or default_jobs(), fresh=True)
        if pool is not None:
            stack.enter_context(pool)
        runs = _pmap(_move_seed, [(s,) for s in range(seeds)] * 2, pool)
    _judge_seeds(report, runs[:seeds], runs[seeds:], out, "moves gate")
    out("moves gate: PASSED" if report.ok else f"moves gate: FAILED ({len(report.failures)} problems)")
    return report


def _gate(report: GateReport, seeds: int, pool: ProcessPoolExecutor | None, out: Out,
          expected: dict[str, Expected]) -> None:
    runs = _pmap(_seed, [(s, ()) for s in range(seeds)] * 2, pool)
    _judge_seeds(report, runs[:seeds], runs[seeds:], out, "gate")
    jobs_w = [(w.name, m) for w in WITNESSES for m in subsets(w.rules)]
    results = _pmap(_witness, jobs_w, pool)
    by_name = {w.name: w for w in WITNESSES}
    for (name, mutate), result in zip(jobs_w, results, strict=True):
        w = by_name[name]
        verdict = judge(w, mutate, result)
        problem = _witness_problem(w, verdict, expected)
        line = f"witness {name} [{','.join(mutate) or 'unmutated'}]: {verdict.outcome}"
        if verdict.detail:
            line += f" ({verdict.detail})"
        report.witness_lines.append(line)
        if problem:
            report.failures.append(f"{line}: {problem}")
            out(f"FAILED {line}: {problem}")
            if result.trace:
                _print_violation(result, out, with_trace=True)
    out(f"gate: {len(WITNESSES)} witnesses, {len(jobs_w)} runs, "
        f"{sum(1 for f in report.failures if f.startswith('witness'))} failed")


def _witness_problem(w: Witness, v: WitnessVerdict, expected: dict[str, Expected]) -> str:
    full = set(v.mutate) == set(w.rules)
    if v.outcome == "error":
        return "the witness run failed (a harness error, never a detection)"
    if not full:
        return "" if v.outcome == "held" else "must hold with all rules on or under a proper subset"
    if v.outcome == "unwired":
        missing = [r for r in v.mutate if not v.result.consulted.get(r)]
        undeclared = [r for r in missing if expected.get(r) is None or expected[r].kind != "unexercised"]
        if undeclared:
            return f"never consulted but not declared unexercised: {', '.join(undeclared)}"
        return ""
    if v.outcome == "wrong-failure":
        return f"must violate {w.failure}"
    if v.outcome == "held":
        return f"must violate {w.failure} under its whole mutation set"
    stale = [r for r in w.rules if r in expected and expected[r].kind == "unexercised"]
    if stale:
        return f"STALE: caught now; remove {', '.join(stale)} from expected-outcomes.txt (or give the real reason)"
    return ""


# -- the sweep ------------------------------------------------------------------------------------


@dataclass
class RuleVerdict:
    rule: str
    verdict: str
    seeds: int
    hits: int = 0
    first_seed: int | str | None = None
    first_violation: str = ""
    witness: str = "none"  # "violated", "held", "unwired", "wrong-failure", "error", "none"
    consulted: int = 0
    errors: list[str] = field(default_factory=list)
    note: str = ""
    move_seeds: int = 0
    move_hits: int = 0
    first_move_seed: int | None = None
    first_move_violation: str = ""

    def line(self) -> str:
        first = f" (first seed {self.first_seed})" if self.first_seed is not None else ""
        text = f"{self.verdict} {self.rule}: sweep {self.hits} of {self.seeds}{first}"
        if self.move_seeds:
            mfirst = f" (first seed {self.first_move_seed})" if self.first_move_seed is not None else ""
            text += f"; moves {self.move_hits} of {self.move_seeds}{mfirst}"
        text += f"; witness {self.witness}"
        return text + (f"; {self.note}" if self.note else "")


def classify(v: RuleVerdict, expected: Expected | None) -> RuleVerdict:
    caught = v.hits > 0 or v.move_hits > 0 or v.witness == "violated"
    if v.errors or v.witness == "error":
        v.verdict = "ERROR"
        v.note = v.errors[0] if v.errors else "a witness run failed"
    elif expected is not None and expected.kind == "rare":
        if caught:
            v.verdict = "CAUGHT"
        else:
            v.verdict = "EXPECTED-MISS" if v.seeds < expected.rare_n else "MISSED"
            v.note = f"rare {expected.rare_n}"
    elif caught:
        v.verdict = "STALE" if expected is not None else "CAUGHT"
        if expected is not None:
            v.note = f"declared {expected.kind} but caught: update expected-outcomes.txt"
    elif expected is None:
        v.verdict = "MISSED"
        if not v.consulted:
            v.note = "its guard was never consulted"
    elif expected.kind == "unexercised" and v.consulted:
        v.verdict = "MISSED"
        v.note = f"declared unexercised but its guard was consulted {v.consulted} times: write its real reason"
    else:
        v.verdict = "EXPECTED-MISS"
        v.note = f"{expected.kind}: {expected.reason}"
    return v


def _tally(v: RuleVerdict, runs: Sequence[Result], what: str) -> tuple[int, int | str | None, str]:
    """Fold one world's runs of ``v``'s rule into its consulted count and errors; answer the runs that violated,
    the first of them and its violation."""
    hits, first, line = 0, None, ""
    for r in runs:
        v.consulted += r.consulted.get(v.rule, 0)
        if r.error:
            v.errors.append(f"{what} {r.seed}: {r.error}")
        elif r.violations:
            hits += 1
            if first is None:
                first, line = r.seed, r.violations[0].line()
    return hits, first, line


def sweep(seeds: int, *, rule_names: Iterable[str] | None = None, jobs: int | None = None,
          out: Out = print, expected: dict[str, Expected] | None = None, move_seeds: int = 0) -> list[RuleVerdict]:
    """Switch each rule off alone; run the seeds, the first ``move_seeds`` seeds of the world with moves (each in a
    fresh process, as the moves gate runs them) and its single-rule witnesses; classify."""
    jobs = jobs or default_jobs()
    expected = load_expected() if expected is None else expected
    names = sorted(rule_names) if rule_names is not None else sorted(rules.RULES)
    seed_jobs = [(s, (name,)) for name in names for s in range(seeds)]
    move_jobs = [(s, (name,)) for name in names for s in range(move_seeds)]
    witness_jobs = [(w.name, (name,)) for name in names for w in WITNESSES if w.rules == (name,)]
    with contextlib.ExitStack() as stack:
        pool = _pool(jobs)
        if pool is not None:
            stack.enter_context(pool)
        results = _pmap(_seed, seed_jobs, pool)
        wresults = _pmap(_witness, witness_jobs, pool)
    mresults: list[Result] = []
    if move_jobs:
        with _pool(jobs, fresh=True) as fresh:  # type: ignore[union-attr]
            mresults = _pmap(_move_seed, move_jobs, fresh)
    verdicts: list[RuleVerdict] = []
    for i, name in enumerate(names):
        v = RuleVerdict(name, "", seeds, move_seeds=move_seeds)
        v.hits, v.first_seed, v.first_violation = _tally(v, results[i * seeds:(i + 1) * seeds], "seed")
        v.move_hits, first, v.first_move_violation = _tally(
            v, mresults[i * move_seeds:(i + 1) * move_seeds], "move seed")
        v.first_move_seed = None if first is None else int(str(first).removeprefix("moves:"))
        for (wname, mutate), r in zip(witness_jobs, wresults, strict=True):
            if mutate != (name,):
                continue
            w = next(x for x in WITNESSES if x.name == wname)
            wv = judge(w, mutate, r)
            v.consulted += r.consulted.get(name, 0)
            if v.witness in ("none", "held", "unwired") or wv.outcome == "violated":
                v.witness = wv.outcome
        verdicts.append(classify(v, expected.get(name)))
        out(verdicts[-1].line())
    return verdicts


def write_results(verdicts: Sequence[RuleVerdict], seeds: int, path: Path = RESULTS_PATH, move_seeds: int = 0) -> None:
    """``sim/RESULTS.md``: the classification table, regenerated from the verdicts (never edited)."""
    counts: dict[str, int] = {}
    for v in verdicts:
        counts[v.verdict] = counts.get(v.verdict, 0) + 1
    moves = f" --move-seeds {move_seeds}" if move_seeds else ""
    over = f", the world with moves' seeds 0..{move_seeds - 1}" if move_seeds else ""
    lines = [
        "# Mutation sweep results",
        "",
        f"Generated by `hostmove sim sweep --seeds {seeds}{moves}`: each rule switched off alone over seeds "
        f"0..{seeds - 1}{over} and its single-rule witnesses (model digest §1). Do not edit; run the sweep again.",
        "",
        "Totals: " + ", ".join(f"{k} {counts[k]}" for k in sorted(counts)),
        "",
        "| verdict | rule | sweep | first seed | moves | first move seed | witness | guard consulted | spec | note |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for v in verdicts:
        rule = rules.RULES.get(v.rule)
        section = rule.section if rule else "?"
        first = "" if v.first_seed is None else str(v.first_seed)
        mfirst = "" if v.first_move_seed is None else str(v.first_move_seed)
        note = v.note.replace("|", "\\|")
        lines.append(f"| {v.verdict} | `{v.rule}` | {v.hits} of {v.seeds} | {first} | {v.move_hits} of "
                     f"{v.move_seeds} | {mfirst} | {v.witness} | {v.consulted} | {section} | {note} |")
    firsts = [v for v in verdicts if v.first_violation]
    if firsts:
        lines += ["", "First violation per caught rule (replay with `hostmove sim --seed N --rules RULE --trace`):", ""]
        lines += [f"- `{v.rule}`: `{v.first_violation}`" for v in firsts]
    mfirsts = [v for v in verdicts if v.first_move_violation]
    if mfirsts:
        lines += ["", "First violation per rule caught in the world with moves (replay with `hostmove sim moves "
                      "--first N --seeds 1 --rules RULE --trace`):", ""]
        lines += [f"- `{v.rule}`: `{v.first_move_violation}`" for v in mfirsts]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
