"""``psguard policy``: check a policy file, or simulate what it costs.

    psguard policy check FILE...
    psguard policy show PRESET > my-policy.yaml
    psguard policy simulate FILE --mtbf 6h --stall 0.5s --persist 20s --duration 7d [--json] [--plot out.png]

FILE may also name a preset (``default``, ``spot-preemptible``, ...). Durations read like ``500ms``, ``0.5s``,
``20s``, ``10m``, ``6h``, ``7d`` (or ``1h30m``). A bad file exits with status 2 and a message naming the file,
the key and what was expected.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from psguard.config import format_duration, parse_duration
from psguard.errors import ConfigError
from psguard.policy.files import load_policy, preset_names, preset_text
from psguard.policy.sim import Job, format_report, plot, simulate
from psguard.store.cli import require_output_folder


def _duration(text: str) -> float:
    try:
        return parse_duration(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def register(subparsers: Any) -> None:
    """Add ``psguard policy check``, ``psguard policy show`` and ``psguard policy simulate``."""
    policy = subparsers.add_parser("policy", help="check or simulate a checkpoint policy file")
    sub = policy.add_subparsers(dest="policy_command", metavar="ACTION")
    sub.required = True

    check = sub.add_parser("check", help="validate policy files and say what they do")
    check.add_argument("files", nargs="+", metavar="FILE", help=f"policy file or preset ({', '.join(preset_names())})")
    check.set_defaults(func=run_check)

    show = sub.add_parser("show", help="print a preset (with its comments), to copy and edit")
    show.add_argument("preset", metavar="PRESET", help=f"preset name ({', '.join(preset_names())})")
    show.set_defaults(func=run_show)

    sim = sub.add_parser("simulate", help="expected saves, stall, lost work and overhead of a policy")
    sim.add_argument("file", metavar="FILE", help="policy file or preset")
    sim.add_argument("--mtbf", type=_duration, required=True, help="mean time between failures of the job (6h)")
    sim.add_argument("--stall", type=_duration, required=True, help="training blocked per save (0.5s)")
    sim.add_argument("--persist", type=_duration, required=True, help="time to commit a durable save (20s)")
    sim.add_argument("--duration", type=_duration, required=True, help="how long the job runs (7d)")
    sim.add_argument("--step-time", type=_duration, default=0.02, help="time per training step (default 20ms)")
    sim.add_argument(
        "--delta-percent", type=float, default=2.0, help="size of a durable delta in %% of the base (default 2)"
    )
    sim.add_argument("--json", action="store_true", help="print JSON instead of a table")
    sim.add_argument("--plot", metavar="PNG", help="also write a figure to this PNG file")
    sim.set_defaults(func=run_simulate)


def run_check(args: argparse.Namespace) -> int:
    """Load every file; print what each does. A bad file raises ConfigError (exit status 2)."""
    for name in args.files:
        spec = load_policy(name)
        print(f"{name}: ok" + (f" - {spec.description.strip().splitlines()[0]}" if spec.description.strip() else ""))
        for part, what in spec.summary().items():
            print(f"  {part:10} {what}")
    return 0


def run_show(args: argparse.Namespace) -> int:
    """Print the preset's YAML; an unknown name raises ConfigError (exit status 2)."""
    print(preset_text(args.preset), end="")
    return 0


def run_simulate(args: argparse.Namespace) -> int:
    """Simulate the policy and print the report (or JSON); write the plot if asked."""
    spec = load_policy(args.file)
    if args.plot:
        if Path(args.plot).is_dir():
            raise ConfigError(f"--plot {args.plot}: is a folder; give a .png file name")
        require_output_folder(Path(args.plot).parent, "--plot")
    try:
        job = Job(args.mtbf, args.stall, args.persist, args.duration, args.step_time, args.delta_percent)
        result = simulate(spec.schedule, job)
    except ValueError as e:
        raise ConfigError(f"psguard policy simulate: {e}") from None
    if args.plot:
        title = f"{args.file}: MTBF {format_duration(args.mtbf)}, stall {format_duration(args.stall)}/save"
        plot(result, args.plot, title=f"{title}, persist {format_duration(args.persist)}")
    if args.json:
        out = result.to_dict() | {"file": args.file}
        if args.plot:
            out["plot"] = args.plot
        print(json.dumps(out, indent=2))
    else:
        print(format_report(result, title=args.file))
        if args.plot:
            print(f"plot written to {args.plot}")
    return 0
