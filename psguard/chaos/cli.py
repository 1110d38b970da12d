"""``psguard chaos run SCENARIO.yaml``, ``psguard chaos soak SCENARIO.yaml --duration 1h``, ``psguard chaos
explore --seed S`` and ``psguard chaos check history.jsonl``.

Exit codes: 0 every checker valid; 1 a checker found the run invalid (or the run failed); 2 bad input (a
scenario that does not validate names the key); 5 no checker invalid but some could not decide (unknown).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from psguard.errors import ConfigError
from psguard.run_folder import claim_folder

if TYPE_CHECKING:
    from psguard.chaos.runner import RunResult

EXIT_UNKNOWN = 5


def _print_verdicts(report: dict[str, object], directory: Path | None) -> None:
    verdicts = report["verdicts"]
    assert isinstance(verdicts, dict)
    for name, v in verdicts.items():
        print(f"  {v['status']:8} {name}: {v['summary']}")
    print(f"overall: {report['overall']}")
    if directory is not None:
        print(f"report: {directory / 'report.json'}, {directory / 'report.md'}, {directory / 'timeline.png'}")


def _exit_code(overall: str) -> int:
    return {"valid": 0, "invalid": 1}.get(overall, EXIT_UNKNOWN)


def _interrupt(*_: object) -> None:
    raise KeyboardInterrupt


def cmd_run(args: argparse.Namespace) -> int:
    from psguard.chaos.runner import DEFAULT_JOB, run_with_reference
    from psguard.chaos.scenario import load_scenario

    scenario = load_scenario(args.scenario)
    if scenario.soak is not None:
        raise ConfigError(
            f"{args.scenario}: a soak scenario; run it with psguard chaos soak {args.scenario} --duration 1h"
        )
    # Refuse a folder the run may not empty now, before a reference run or any process starts.
    directory = claim_folder(args.report or f"chaos-runs/{scenario.name}-seed{args.seed}", "psguard chaos run")

    def run() -> RunResult:
        if args.baseline:
            from psguard.chaos.baseline import run_side_by_side

            return run_side_by_side(scenario, directory, seed=args.seed)
        references = Path(args.reference_dir) if args.reference_dir else None
        return run_with_reference(
            scenario, directory, seed=args.seed, job=args.job or DEFAULT_JOB, references=references
        )

    return _judged(run, "run")


def _judged(run: Callable[[], RunResult], what: str) -> int:
    """Run with SIGTERM cleaning up like Ctrl-C, print the verdicts, and return the exit code they make."""
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        result = run()
    except KeyboardInterrupt:
        print(f"psguard chaos: interrupted; every process the {what} started was stopped", file=sys.stderr, flush=True)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    _print_verdicts(result.report, result.directory)
    return _exit_code(result.overall)


def cmd_soak(args: argparse.Namespace) -> int:
    import secrets

    from psguard.chaos.runner import DEFAULT_JOB
    from psguard.chaos.scenario import load_scenario
    from psguard.chaos.soak import check_soak, run_soak
    from psguard.config import parse_duration

    scenario = load_scenario(args.scenario)
    try:
        duration = parse_duration(args.duration)
    except ValueError as e:
        raise ConfigError(f"--duration: {e}") from None
    check_soak(scenario, duration)
    seed = args.seed if args.seed is not None else secrets.randbelow(2**31)
    print(f"psguard chaos soak {scenario.name}: seed {seed} (replay this run with --seed {seed})", flush=True)
    directory = claim_folder(args.report or f"chaos-runs/{scenario.name}-seed{seed}", "psguard chaos soak")
    return _judged(lambda: run_soak(scenario, directory, duration=duration, seed=seed, job=args.job or DEFAULT_JOB),
                   "soak")  # fmt: skip


def cmd_explore(args: argparse.Namespace) -> int:
    import secrets

    from psguard.chaos.explore import SPACES, explore
    from psguard.config import parse_duration

    seed = args.seed if args.seed is not None else secrets.randbelow(2**31)
    budget = None
    if args.budget is not None:
        try:
            budget = parse_duration(args.budget)
        except ValueError as e:
            raise ConfigError(f"--budget: {e}") from None
    cases = 1 if args.case is not None else args.cases
    if cases is None and budget is None:
        cases = 3
    start = args.case if args.case is not None else args.start
    print(f"psguard chaos explore: seed {seed}, space {args.space} (replay a case with --space {args.space} --seed "
          f"{seed} --case I)", flush=True)  # fmt: skip
    directory = claim_folder(args.report or f"chaos-runs/explore-seed{seed}", "psguard chaos explore")
    outcome: dict[str, int] = {}

    def run() -> int:
        results = explore(seed, directory, space=SPACES[args.space], cases=cases, budget_seconds=budget,
                          start=start, do_shrink=args.shrink)  # fmt: skip
        for r in results:
            outcome[r.overall] = outcome.get(r.overall, 0) + 1
        print(f"explored {len(results)} case(s): " + ", ".join(f"{n} {k}" for k, n in sorted(outcome.items())))
        print(f"summary: {directory / 'summary.md'}, cases: {directory / 'cases.jsonl'}")
        return 1 if outcome.get("invalid") else EXIT_UNKNOWN if outcome.get("unknown") or outcome.get("missed") else 0

    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        return run()
    except KeyboardInterrupt:
        print("psguard chaos explore: interrupted; every process it started was stopped", file=sys.stderr, flush=True)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)


def cmd_check(args: argparse.Namespace) -> int:
    from psguard.chaos.checkers import check_all, overall
    from psguard.chaos.history import read_history
    from psguard.chaos.report import write_report

    path = Path(args.history)
    if not path.is_file():
        raise ConfigError(f"{path}: no such history file")
    records = read_history(path)
    reference = read_history(args.reference) if args.reference else None
    verdicts = check_all(records, reference)
    if args.write_report:
        report = write_report(path.parent, records, verdicts)
    else:
        report = {"verdicts": {n: v.to_json() for n, v in verdicts.items()}, "overall": overall(verdicts)}
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        _print_verdicts(report, path.parent if args.write_report else None)
    return _exit_code(overall(verdicts))


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "chaos",
        help="inject faults into a real local PS job and check the history (kill, pause, storage faults)",
        description="Chaos runs on a real localhost cluster under psguard agents; see chaos/*.yaml.",
    )
    chaos = p.add_subparsers(dest="chaos_command", metavar="{run,soak,explore,check}")
    chaos.required = True
    run = chaos.add_parser("run", help="run a scenario and judge its history")
    run.add_argument("scenario", metavar="SCENARIO.yaml")
    run.add_argument("--seed", type=int, default=0, help="seeds the random faults, the model and the data")
    run.add_argument(
        "--report",
        metavar="DIR",
        help="run folder (default chaos-runs/NAME-seedS): new, empty, or made by a psguard run (then emptied)",
    )
    run.add_argument("--job", metavar="MODULE:FUNC", help="the trainer (default psguard.demo_trainer:main)")
    run.add_argument("--baseline", action="store_true", help="also run the plain-TF practice, side by side")
    run.add_argument("--reference-dir", metavar="DIR", help="where fault-free reference runs are kept and reused")
    run.set_defaults(func=cmd_run)
    soak = chaos.add_parser(
        "soak", help="faults at random times for a duration, resources sampled; judged as a whole (week in an hour)"
    )
    soak.add_argument("scenario", metavar="SCENARIO.yaml", help="a scenario with a soak: section (chaos/soak-*.yaml)")
    soak.add_argument("--duration", default="1h", help="how long faults are drawn, e.g. 5m, 1h (default 1h)")
    soak.add_argument("--seed", type=int, help="the fault schedule's seed (default: a fresh one, printed)")
    soak.add_argument("--report", metavar="DIR", help="run folder (default chaos-runs/NAME-seedS)")
    soak.add_argument("--job", metavar="MODULE:FUNC", help="the trainer (default psguard.demo_trainer:main)")
    soak.set_defaults(func=cmd_soak)
    explore = chaos.add_parser(
        "explore",
        help="draw cases (settings and faults) from a seed, run each on psguard and on plain TF, judge side by side",
    )
    explore.add_argument("--seed", type=int, help="the exploration's seed (default: a fresh one, printed)")
    explore.add_argument("--cases", type=int, help="how many cases (default 3 when no --budget is given)")
    explore.add_argument("--budget", help="explore until this much time has passed, e.g. 10m, 2h")
    explore.add_argument("--case", type=int, help="replay only case I of --seed")
    explore.add_argument("--start", type=int, default=0, help="the first case's index (default 0)")
    explore.add_argument(
        "--space", choices=("ci", "full", "full-v1", "full-v2"), default="ci",
        help="what to draw from (default ci; full-v1, full-v2: the full space before each widening, to replay its "
        "cases)",
    )  # fmt: skip
    explore.add_argument("--shrink", action="store_true", help="shrink each failing case to a smaller one")
    explore.add_argument("--report", metavar="DIR", help="run folder (default chaos-runs/explore-seedS)")
    explore.set_defaults(func=cmd_explore)
    check = chaos.add_parser("check", help="run the checkers again over a history file")
    check.add_argument("history", metavar="history.jsonl")
    check.add_argument("--reference", metavar="history.jsonl", help="a fault-free run's history (final loss)")
    check.add_argument("--write-report", action="store_true", help="rewrite report.json/.md/.png beside it")
    check.add_argument("--json", action="store_true")
    check.set_defaults(func=cmd_check)
