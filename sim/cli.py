"""``hostmove sim``: the deterministic simulation's command line (model digest §1 "Commands").

    hostmove sim --seed N [--trace] [--rules a,b]    replay one seed (mutated with --rules)
    hostmove sim gate [--seeds 300] [--stand-in 300] [--repeat 10] [--jobs J]
                                                      seeds of the world with moves and of the world without,
                                                      unmutated; the first --repeat again (determinism); every
                                                      witness three ways and every scenario
    hostmove sim sweep --seeds N [--move-seeds M] [--rules a,b] [--jobs J] [--out PATH] [--journal DIR]
                                                      each rule off alone, classified; writes sim/RESULTS.md
                                                      (resumable: every finished run is journaled)
    hostmove sim baseline --seeds N [--stand-in M] [--jobs J] [--journal DIR]
                                                      N seeds of the world with moves unmutated (resumable)
    hostmove sim witness [NAME] [--rules a,b] [--trace]
                                                      run witnesses (all three ways, or under --rules)
    hostmove sim moves [--seeds N] [--first S] [--rules a,b] [--trace]
                                                      random seeds of the world with moves (sim/moves.py)
    hostmove sim rules                                the registered rules with their spec sections

Exit codes: 0 clean, 1 a violation or a failed gate/sweep (ERROR, MISSED or STALE), 2 bad usage.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from kernel import rules

__all__ = ["main"]

COMMANDS = ("gate", "sweep", "baseline", "witness", "moves", "rules")
MOVE_COUNTERS = ("moves_done", "moves_aborted", "moves_rolled_back", "rollbacks_clean", "rollbacks_dirty", "reboots",
                 "disks_lost", "timer_deliveries", "timer_repeats", "idle_stops", "wake_requests", "terminations",
                 "generations_retired", "targets_frozen", "declared_lost", "platform_stops",
                 "readmitted")


def _rules_arg(text: str) -> tuple[str, ...]:
    try:
        return rules.parse(text)
    except rules.UnknownRule as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _seed_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hostmove sim", description="Replay one seed of the deterministic simulation.")
    p.add_argument("--seed", type=int, required=True, help="the seed to run")
    p.add_argument("--trace", action="store_true", help="print the whole trace")
    p.add_argument("--rules", type=_rules_arg, default=(), help="rules to switch off, comma-separated")
    return p


def _command_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hostmove sim")
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("gate", help="seeds unmutated, the determinism check and every witness")
    g.add_argument("--seeds", type=int, default=300, help="seeds of the world with moves (sim/moves.py)")
    g.add_argument("--stand-in", type=int, default=300, help="seeds of the world without moves (sim/world.py)")
    g.add_argument("--repeat", type=int, default=10, help="the first seeds of each world run again (determinism)")
    g.add_argument("--jobs", type=int, default=None)
    s = sub.add_parser("sweep", help="switch each rule off alone and classify")
    s.add_argument("--seeds", type=int, required=True)
    s.add_argument("--rules", type=_rules_arg, default=None)
    s.add_argument("--move-seeds", type=int, default=0,
                   help="also each rule over the first N seeds of the world with moves (seconds a seed)")
    s.add_argument("--jobs", type=int, default=None)
    s.add_argument("--out", type=Path, default=None, help="where to write the results (default sim/RESULTS.md)")
    s.add_argument("--journal", type=Path, default=None,
                   help="where finished runs are kept for a resumed sweep (default .hostmove/sim-journal)")
    s.add_argument("--no-journal", action="store_true", help="keep nothing: every run runs")
    b = sub.add_parser("baseline", help="seeds of the world with moves unmutated, resumable")
    b.add_argument("--seeds", type=int, required=True)
    b.add_argument("--stand-in", type=int, default=0, help="also seeds of the world without moves")
    b.add_argument("--jobs", type=int, default=None)
    b.add_argument("--journal", type=Path, default=None)
    b.add_argument("--no-journal", action="store_true")
    w = sub.add_parser("witness", help="run witnesses")
    w.add_argument("name", nargs="?", default=None)
    w.add_argument("--rules", type=_rules_arg, default=None, help="run under exactly these rules switched off")
    w.add_argument("--trace", action="store_true")
    m = sub.add_parser("moves", help="random seeds of the world with moves")
    m.add_argument("--seeds", type=int, default=10)
    m.add_argument("--first", type=int, default=0)
    m.add_argument("--rules", type=_rules_arg, default=())
    m.add_argument("--trace", action="store_true", help="print the trace of each failing seed")
    sub.add_parser("rules", help="list the registered rules")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point for ``hostmove sim ...`` (the CLI passes the arguments after ``sim``)."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    failed = rules.load_all()
    for line in failed:
        print(f"warning: {line} (its rules are not registered)", file=sys.stderr)
    try:
        if args_list and args_list[0] in COMMANDS:
            args = _command_parser().parse_args(args_list)
        else:
            args = _seed_parser().parse_args(args_list)
            args.command = "seed"
    except SystemExit as exc:
        return 2 if exc.code not in (0, None) else 0
    if args.command == "seed":
        return _cmd_seed(args)
    if args.command == "gate":
        from sim.sweep import gate

        try:
            return 0 if gate(args.seeds, stand_in=args.stand_in, repeat=args.repeat, jobs=args.jobs).ok else 1
        except ValueError as exc:
            print(f"gate: {exc}", file=sys.stderr)
            return 2
    if args.command == "sweep":
        return _cmd_sweep(args)
    if args.command == "baseline":
        from sim.deep import DEFAULT_ROOT
        from sim.sweep import baseline

        if args.seeds < 1:
            print("baseline: --seeds must be at least 1", file=sys.stderr)
            return 2
        journal = None if args.no_journal else (args.journal or DEFAULT_ROOT)
        return 1 if baseline(args.seeds, stand_in=max(0, args.stand_in), jobs=args.jobs, journal=journal) else 0
    if args.command == "witness":
        return _cmd_witness(args)
    if args.command == "moves":
        return _cmd_moves(args)
    for name in sorted(rules.RULES):
        r = rules.RULES[name]
        print(f"{name}: {r.meaning} [{r.section}] at {r.site}")
    return 0


def _cmd_seed(args: argparse.Namespace) -> int:
    from sim.run import run_seed

    result = run_seed(args.seed, trace=args.trace, mutate=args.rules)
    for v in result.violations:
        print(v.line())
    if result.error:
        print(f"ERROR seed={args.seed}: {result.error}")
    if result.trace:
        print(f"--- trace of seed {args.seed}" + (f" with {','.join(args.rules)} off" if args.rules else ""))
        for line in result.trace:
            print(line)
        print("--- end of trace")
    print(result.report()[-1])
    print(f"seed={args.seed} steps={result.steps} trace={result.trace_hash}")
    return 1 if result.violations or result.error else 0


def _cmd_sweep(args: argparse.Namespace) -> int:
    from sim.sweep import RESULTS_PATH, sweep, write_results

    if args.seeds < 1:
        print("sweep: --seeds must be at least 1", file=sys.stderr)
        return 2
    from sim.deep import DEFAULT_ROOT

    journal = None if args.no_journal else (args.journal or DEFAULT_ROOT)
    try:
        verdicts = sweep(args.seeds, rule_names=args.rules, jobs=args.jobs, move_seeds=max(0, args.move_seeds),
                         journal=journal)
    except ValueError as exc:
        print(f"sweep: {exc}", file=sys.stderr)
        return 2
    out = args.out or RESULTS_PATH
    write_results(verdicts, args.seeds, out, move_seeds=max(0, args.move_seeds))
    bad = [v for v in verdicts if v.verdict in ("ERROR", "MISSED", "STALE")]
    print(f"sweep: {len(verdicts)} rules, {len(bad)} ERROR/MISSED/STALE; results in {out}")
    return 1 if bad else 0


def _cmd_moves(args: argparse.Namespace) -> int:
    from sim.moves import run_move_seed

    bad = 0
    for seed in range(args.first, args.first + args.seeds):
        result = run_move_seed(seed, mutate=args.rules, trace=args.trace)
        lines = result.report()
        failed = bool(result.violations or result.error)
        bad += failed
        shown = " ".join(f"{k}={result.counters.get(k, 0)}" for k in MOVE_COUNTERS)
        print(f"moves seed={seed} steps={result.steps} trace={result.trace_hash} {shown} "
              f"{'FAILED' if failed else 'ok'}")
        for line in lines[:-1]:
            print("  " + line)
        if failed and args.trace:
            for line in result.trace:
                print("    " + line)
    print(f"moves: {args.seeds - bad} of {args.seeds} seeds converged clean")
    return 1 if bad else 0


def _cmd_witness(args: argparse.Namespace) -> int:
    from sim.sweep import load_expected
    from sim.witness import FINDINGS, SCENARIOS, WITNESSES, check_witness, judge, run_witness

    known = (*WITNESSES, *SCENARIOS, *FINDINGS) if args.name is not None else (*WITNESSES, *SCENARIOS)
    chosen = [w for w in known if args.name in (None, w.name)]  # open findings only by name
    if not chosen:
        print(f"no witness named {args.name}; known: {', '.join(w.name for w in (*WITNESSES, *SCENARIOS, *FINDINGS))}",
              file=sys.stderr)
        return 2
    expected = load_expected()
    bad = 0
    for w in chosen:
        if not w.rules:  # a scenario: it holds unmutated (or under --rules, whatever they break)
            result = run_witness(w, args.rules or (), trace=args.trace)
            held = not (result.violations or result.error)
            bad += 0 if held or args.rules else 1
            detail = result.error or (result.violations[0].line() if result.violations else "")
            print(f"{w.name} [{','.join(args.rules or ()) or 'unmutated'}]: {'held' if held else 'violated'}"
                  + (f" {detail}" if detail else ""))
            if args.trace:
                for line in result.trace:
                    print(line)
            continue
        verdicts = ([judge(w, args.rules, run_witness(w, args.rules, trace=args.trace))]
                    if args.rules is not None else check_witness(w, trace=args.trace))
        for v in verdicts:
            unwired_ok = v.outcome == "unwired" and all(
                expected.get(r) is not None and expected[r].kind == "unexercised"
                for r in v.mutate if not v.result.consulted.get(r))
            ok = v.ok and (v.outcome != "unwired" or unwired_ok)
            bad += 0 if ok else 1
            print(f"{w.name} [{','.join(v.mutate) or 'unmutated'}]: {v.outcome}{' ' + v.detail if v.detail else ''}")
            if args.trace:
                for line in v.result.trace:
                    print(line)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
