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
import dataclasses
import multiprocessing
import os
import re
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from kernel import rules
from sim.faults import FaultPlan
from sim.run import Result, run_seed
from sim.witness import SCENARIOS, WITNESS_BY_NAME, WITNESSES, Witness, WitnessVerdict, judge, run_witness, subsets

__all__ = [
    "EXPECTED_PATH", "RESULTS_PATH", "Expected", "RuleVerdict", "classify", "gate", "load_expected", "sweep",
    "write_results",
]

EXPECTED_PATH = Path(__file__).with_name("expected-outcomes.txt")
RESULTS_PATH = Path(__file__).with_name("RESULTS.md")
SPEC_RULES_PATH = Path(__file__).with_name("spec-rules.txt")
KINDS = ("unexercised", "combination", "unreachable", "liveness-only", "rare", "not-applicable")
_LINE = re.compile(r"^(?P<rule>[a-z0-9-]+)\s+(?P<kind>unexercised|combination|unreachable|liveness-only|rare|"
                   r"not-applicable)(?:\s+(?P<n>\d+))?:?\s*(?P<reason>.*)$")

T = TypeVar("T")
Out = Callable[[str], None]


@dataclass(frozen=True)
class Expected:
    rule: str
    kind: str
    reason: str
    rare_n: int = 0


def spec_rules(path: Path = SPEC_RULES_PATH) -> dict[str, str]:
    """The rules of the spec's model (§14.2.5; model digest §4), name -> what it encodes (``sim/spec-rules.txt``)."""
    out: dict[str, str] = {}
    for raw in path.read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if line and not line.startswith("#"):
            name, _, encodes = line.partition(" ")
            out[name] = encodes.strip()
    return out


def not_applicable(path: Path = EXPECTED_PATH) -> dict[str, str]:
    """The spec's rules declared not applicable in ``expected-outcomes.txt``, with their reasons."""
    out: dict[str, str] = {}
    for raw in path.read_text(encoding="utf-8").splitlines():
        m = _LINE.match(raw.strip())
        if m is not None and m["kind"] == "not-applicable":
            out[m["rule"]] = m["reason"]
    return out


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
        if m["kind"] == "not-applicable":  # a spec rule of a feature this system does not have: no guard exists
            if rule in rules.RULES or rule not in spec_rules():
                raise ValueError(f"{path.name}:{number}: {rule!r} is declared not applicable, but it is "
                                 + ("a registered rule" if rule in rules.RULES else "no rule of the spec"))
            continue
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


def default_jobs() -> int:
    return max(1, min(os.cpu_count() or 1, 8))


def _timed(run: Callable[[], Result]) -> Result:
    """``run``'s result with the CPU time it cost (read outside the run's sandbox)."""
    started = time.process_time()
    result = run()
    return dataclasses.replace(result, cpu_s=time.process_time() - started)


def _seed(seed: int, mutate: tuple[str, ...]) -> Result:
    return _timed(lambda: run_seed(seed, mutate=mutate))


def _witness(name: str, mutate: tuple[str, ...]) -> Result:
    return _timed(lambda: run_witness(WITNESS_BY_NAME[name], mutate))


def _move_seed(seed: int, mutate: tuple[str, ...] = ()) -> Result:
    from sim.moves import run_move_seed

    return _timed(lambda: run_move_seed(seed, mutate=mutate))


def _run_all(calls: Sequence[tuple[Callable[..., T], tuple[object, ...]]], pool: ProcessPoolExecutor | None) -> list[T]:
    """Every call, in the pool when there is one (submitted at once: the longest first keeps every core busy)."""
    if pool is None:
        return [fn(*args) for fn, args in calls]
    futures = [pool.submit(fn, *args) for fn, args in calls]
    return [f.result() for f in futures]


# -- the gate -------------------------------------------------------------------------------------


REPEAT = 10
"""The gate runs its first seeds of each world again, in reverse order and so after other seeds in other worker
processes: the same trace each time (determinism, and no dependence on what a process ran before)."""
STAND_IN_SEEDS = 300
"""Seeds of the world without moves (sim/world.py) the gate draws from: it runs those of them that check what the
world with moves never does (:func:`stand_in_seeds`), at a fiftieth of a move seed's cost each."""


def stand_in_seeds(n: int) -> list[int]:
    """Of the world without moves' first ``n`` seeds, those whose workload draws a bias mode the world with moves
    never has (it draws the same workload and keeps only its hosts, :func:`sim.moves.move_world`): a box handling a
    fetched batch of claim events concurrently, wake requests that reach the wrong box, or generation markers taking
    the long tail (sim/README.md). The others (about one in eight) drive nothing that the world with moves' seeds, on
    the production agents, do not drive too: the gate leaves them to the sweep and the baseline."""
    from sim.run import DEFAULT_TIMING
    from sim.workload import draw_workload
    from sim.world import REGIONS

    boxes = {f"{r}-1": r for r in REGIONS}
    out = []
    for seed in range(n):
        w = draw_workload(FaultPlan(seed), boxes, DEFAULT_TIMING)  # the run's first draws (sim.run.random_world)
        if w.concurrent_batches or w.wrong_box or w.marker_tail:
            out.append(seed)
    return out


@dataclass
class GateReport:
    seeds: int
    failures: list[str] = field(default_factory=list)
    witness_lines: list[str] = field(default_factory=list)
    results: list[Result] = field(default_factory=list)
    """The world with moves' seeds, in seed order."""
    stand_in: list[Result] = field(default_factory=list)
    witnesses: list[Result] = field(default_factory=list)
    """Every witness and scenario run, in :data:`WITNESSES` order."""
    repeats: list[Result] = field(default_factory=list)
    """The seeds of both worlds run again (determinism)."""
    consulted: Counter[str] = field(default_factory=Counter)
    """How often each guard was consulted by the production code: the world with moves' seeds and witnesses."""

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


def gate(seeds: int = 300, *, stand_in: int = STAND_IN_SEEDS, repeat: int = REPEAT, jobs: int | None = None,
         out: Out = print, expected: dict[str, Expected] | None = None) -> GateReport:
    """The gate (model digest §1; issue 17 item 3): ``seeds`` seeds of the world with moves (the production agents,
    door and recovery pass; every host moved one to three times under crashes, reboots, lost disks, store and bus
    faults, sleeps and aborts) and those of the first ``stand_in`` seeds of the world without moves that check what
    the other never does (:func:`stand_in_seeds`), each once and clean; the first ``repeat`` of each again, in
    reverse order, to the same trace; every witness three ways and every scenario
    unmutated. Worker processes are reused: a seed's trace does not depend on what its process ran before (the
    repeats check it)."""
    jobs = jobs or default_jobs()
    expected = load_expected() if expected is None else expected
    report = GateReport(seeds)
    again = list(reversed(range(min(repeat, seeds))))
    plain = stand_in_seeds(stand_in)
    again_stand_in = list(reversed(plain[:repeat]))
    witness_runs = [(w.name, m) for w in WITNESSES for m in subsets(w.rules)] + [(sc.name, ()) for sc in SCENARIOS]
    calls: list[tuple[Callable[..., Result], tuple[object, ...]]] = [
        *((_move_seed, (s,)) for s in range(seeds)),
        *((_witness, job) for job in witness_runs),
        *((_move_seed, (s,)) for s in again),
        *((_seed, (s, ())) for s in plain),
        *((_seed, (s, ())) for s in again_stand_in),
    ]
    with contextlib.ExitStack() as stack:
        pool = _pool(jobs)
        if pool is not None:
            stack.enter_context(pool)
        results = _run_all(calls, pool)
    n_w = len(witness_runs)
    moves, rest = results[:seeds], results[seeds:]
    witnesses, rest = rest[:n_w], rest[n_w:]
    moves_again, rest = rest[:len(again)], rest[len(again):]
    stand_ins, stand_ins_again = rest[:len(plain)], rest[len(plain):]
    _judge_seeds(report, moves, {s: r for s, r in zip(again, moves_again, strict=True)}, out, "moves gate")
    report.results = moves
    stand_in_report = GateReport(len(plain))
    by_seed = {s: i for i, s in enumerate(plain)}
    _judge_seeds(stand_in_report, stand_ins, {by_seed[s]: r for s, r in zip(again_stand_in, stand_ins_again,
                                                                             strict=True)},
                 out, f"stand-in gate (of seeds 0..{stand_in - 1})")
    report.stand_in = stand_ins
    report.witnesses = witnesses
    report.repeats = [*moves_again, *stand_ins_again]
    report.failures += stand_in_report.failures
    _judge_witnesses(report, witness_runs, witnesses, out, expected)
    for r in [*moves, *(r for (name, _m), r in zip(witness_runs, witnesses, strict=True)
                        if WITNESS_BY_NAME[name].moves)]:
        report.consulted.update(r.consulted)
    never = sorted(set(rules.RULES) - {n for n, c in report.consulted.items() if c})
    out(f"gate: {len(rules.RULES) - len(never)} of {len(rules.RULES)} rules consulted by the production code"
        + (f"; never: {', '.join(never)}" if never else ""))
    out("gate: PASSED" if report.ok else f"gate: FAILED ({len(report.failures)} problems)")
    return report


def _judge_seeds(report: GateReport, first: list[Result], again: dict[int, Result], out: Out, what: str) -> None:
    """Every seed ran clean (no violation, no harness error), and each seed run again gave the same trace."""
    seeds = len(first)
    shown = False
    for a in first:
        if a.error:
            report.failures.append(f"ERROR seed={a.seed}: {a.error}")
            out(f"ERROR seed={a.seed}: {a.error}")
        elif a.violations:
            report.failures.append(a.violations[0].line())
            _print_violation(a, out, with_trace=not shown)
            shown = True
    same = True
    for i, b in sorted(again.items()):
        a = first[i]
        if a.trace_hash != b.trace_hash:
            same = False
            report.failures.append(
                f"NONDETERMINISTIC seed={a.seed}: trace {a.trace_hash[:12]} then {b.trace_hash[:12]}")
            out(report.failures[-1])
    distinct = len({r.trace_hash for r in first})
    if seeds > 1 and distinct < seeds:
        report.failures.append(f"only {distinct} distinct traces for {seeds} seeds: the seed does not reach the run")
    out(f"{what}: {seeds} seeds, {sum(1 for r in first if r.violations)} violated, "
        f"{sum(1 for r in first if r.error)} errors, determinism {'ok' if same else 'FAILED'} ({len(again)} run "
        f"again), {distinct} distinct traces, {sum(r.steps for r in first)} steps")


def _judge_witnesses(report: GateReport, runs: list[tuple[str, tuple[str, ...]]], results: list[Result], out: Out,
                     expected: dict[str, Expected]) -> None:
    for (name, mutate), result in zip(runs, results, strict=True):
        w = WITNESS_BY_NAME[name]
        if not w.rules:  # a scenario: it holds unmutated
            verdict = WitnessVerdict(name, (), "held" if not (result.violations or result.error) else (
                "error" if result.error else "violated"), result.error or (
                result.violations[0].line() if result.violations else ""), result)
            problem = "" if verdict.outcome == "held" else "a scenario must hold"
        else:
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
    out(f"gate: {len(WITNESSES)} witnesses and {len(SCENARIOS)} scenarios, {len(runs)} runs, "
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
          out: Out = print, expected: dict[str, Expected] | None = None, move_seeds: int = 0,
          journal: Path | None = None) -> list[RuleVerdict]:
    """Switch each rule off alone over the first ``seeds`` seeds of the world without moves, the first
    ``move_seeds`` of the world with moves and its single-rule witnesses; classify (model digest §1).

    Every seed runs once unmutated first; a seed whose unmutated run never consulted a rule runs the same with the
    rule off (the guard is the only difference, and it is never asked), so only the seeds that consulted it run
    again mutated. With ``journal`` (a directory, :mod:`sim.deep`) every finished run is kept and a sweep started
    again takes up where the last stopped. A seed that fails unmutated makes every verdict an ERROR."""
    from sim.deep import Journal, RunKey, consulted_in, run_journaled

    jobs = jobs or default_jobs()
    expected = load_expected() if expected is None else expected
    names = sorted(rule_names) if rule_names is not None else sorted(rules.RULES)
    book = Journal.open(journal, "sweep")
    base_calls: list[tuple[RunKey, Callable[..., Result], tuple[object, ...]]] = [
        *((("moves", (), s), _move_seed, (s,)) for s in range(move_seeds)),
        *((("stand-in", (), s), _seed, (s, ())) for s in range(seeds)),
    ]

    def progress(what: str) -> Callable[[int, int], None]:
        shown = [-1]

        def say(done: int, total: int) -> None:
            step = max(1, total // 20)
            if done == total or done // step != shown[0]:
                shown[0] = done // step
                out(f"sweep: {what} {done} of {total} runs")

        return say

    with contextlib.ExitStack() as stack:
        pool = _pool(jobs)
        if pool is not None:
            stack.enter_context(pool)
        base = run_journaled(base_calls, book, pool, all_consulted=True, progress=progress("unmutated"))
        calls: list[tuple[RunKey, Callable[..., Result], tuple[object, ...]]] = []
        for name in names:
            calls += [(("moves", (name,), s), _move_seed, (s, (name,)))
                      for s in consulted_in(base, "moves", range(move_seeds), name)]
            calls += [(("stand-in", (name,), s), _seed, (s, (name,)))
                      for s in consulted_in(base, "stand-in", range(seeds), name)]
            calls += [((w.name, (name,), w.name), _witness, (w.name, (name,)))
                      for w in WITNESSES if w.rules == (name,)]
        runs = run_journaled(calls, book, pool, progress=progress("mutated"))
    broken = [f"the unmutated {world} seed {seed} fails: {r.error or r.violations[0].line()}"
              for (world, _m, seed), r in sorted(base.items(), key=lambda kv: str(kv[0])) if r.error or r.violations]
    verdicts: list[RuleVerdict] = []
    for name in names:
        v = RuleVerdict(name, "", seeds, move_seeds=move_seeds)
        v.errors += broken[:1]
        stand = [runs.get(("stand-in", (name,), s)) or base[("stand-in", (), s)] for s in range(seeds)]
        moved = [runs.get(("moves", (name,), s)) or base[("moves", (), s)] for s in range(move_seeds)]
        v.hits, v.first_seed, v.first_violation = _tally(v, stand, "seed")
        v.move_hits, first, v.first_move_violation = _tally(v, moved, "move seed")
        v.first_move_seed = None if first is None else int(str(first).removeprefix("moves:"))
        for w in WITNESSES:
            if w.rules != (name,):
                continue
            r = runs[(w.name, (name,), w.name)]
            wv = judge(w, (name,), r)
            v.consulted += r.consulted.get(name, 0)
            if v.witness in ("none", "held", "unwired") or wv.outcome == "violated":
                v.witness = wv.outcome
        verdicts.append(classify(v, expected.get(name)))
        out(verdicts[-1].line())
    return verdicts


def baseline(seeds: int, *, stand_in: int = 0, jobs: int | None = None, out: Out = print,
             journal: Path | None = None) -> list[str]:
    """``seeds`` seeds of the world with moves and ``stand_in`` of the world without, unmutated, each once; the
    problems (a violation or a harness error), empty when every seed ran clean. Journaled like :func:`sweep`."""
    from sim.deep import Journal, RunKey, run_journaled

    book = Journal.open(journal, "baseline")
    calls: list[tuple[RunKey, Callable[..., Result], tuple[object, ...]]] = [
        *((("moves", (), s), _move_seed, (s,)) for s in range(seeds)),
        *((("stand-in", (), s), _seed, (s, ())) for s in range(stand_in)),
    ]
    step = max(1, len(calls) // 20)

    def say(done: int, total: int) -> None:
        if done == total or done % step == 0:
            out(f"baseline: {done} of {total} runs")

    with contextlib.ExitStack() as stack:
        pool = _pool(jobs or default_jobs())
        if pool is not None:
            stack.enter_context(pool)
        runs = run_journaled(calls, book, pool, progress=say)
    problems = []
    for (world, _m, seed), r in sorted(runs.items(), key=lambda kv: (kv[0][0], str(kv[0][2]))):
        if r.error:
            problems.append(f"ERROR {world} seed={seed}: {r.error}")
        elif r.violations:
            problems.append(f"{world}: {r.violations[0].line()}")
    moved = [r for (world, _m, _s), r in runs.items() if world == "moves"]
    done = {k: sum(r.counters.get(k, 0) for r in moved) for k in ("moves_done", "moves_aborted", "moves_rolled_back",
                                                                  "disks_lost", "crashes")}
    out(f"baseline: {seeds} seeds of the world with moves, {stand_in} of the world without: {len(problems)} failed; "
        + ", ".join(f"{k}={v}" for k, v in done.items()))
    for line in problems[:20]:
        out(line)
    return problems


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
        f"Generated by `hostmove sim sweep --seeds {seeds}{moves}`: each rule switched off alone over the world "
        f"without moves' seeds 0..{seeds - 1}{over} and its single-rule witnesses (model digest §1); a seed whose "
        "unmutated run never consulted the rule runs the same with it off and is counted held without a rerun. "
        "Do not edit; run the sweep again (`make sim-sweep` runs 3,000 seeds of each world, resumably).",
        "",
        "Totals: " + ", ".join(f"{k} {counts[k]}" for k in sorted(counts)),
        "",
        "| verdict | rule | without moves | first seed | with moves | first move seed | witness | guard consulted | "
        "spec | note |",
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
