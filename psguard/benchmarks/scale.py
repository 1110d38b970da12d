"""``psguard bench scale``: how psguard's and plain TF's costs grow with the state and with the number of PS.

Each point is one ``psguard bench recovery`` (:func:`psguard.benchmarks.recovery.run`: every task under
``psguard agent``, the PS-side data path on, against the plain-TF whole-job restart, alternating), so its
figures mean exactly what that module's docstring says. Two sweeps:

- **state**: ``--sizes`` (default 64M, 512M, 1G, 2G; binary units) of state at ``--ps`` PS (default 2). The state
  is the embedding and its Adagrad accumulator: ``vocab = size / (2 * dim * 4)`` rows of ``--embedding-dim``
  (default 32) float32.
- **PS count**: ``--ps-counts`` (default 1, 2, 4) at a fixed ``--ps-state`` (default 512M). A point of the
  first sweep with the same state and PS count is reused, not run twice.

Per point and side: capture stall (psguard: the median steady-state ``save()`` stall; TF: its
``CheckpointManager.save``), restore seconds (the trainer's own timing of its restore call), recovery seconds
(kill to the first step at normal speed), lost steps, and the chief's RSS growth (psguard: trainer + chief
agent; TF: its chief). ``--plot FILE.png`` draws each of them against the sweep's variable (``psguard[plot]``:
matplotlib is an optional extra).

``--node-loss`` adds, at every point with two PS or more, the same job with PS 0 lost with its node (its agent
killed too, a new one started with an empty tier: ``bench recovery --fault node --store s3``), psguard with peer
copies on and off against plain TF: the recovery panel's node-loss lines and each point's ``node``.

Why these and not more points: each point costs two job starts, two trainings to the kill step and two
recoveries, about 1-3 minutes at 1 GB on this machine; ``--runs`` repeats each point.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

from psguard.benchmarks.common import parse_size, print_results, progress
from psguard.benchmarks.recovery import add_job_options, params_from_args, run
from psguard.benchmarks.recovery_job import Params

#: What each point reports, per side: (key in the point, key of recovery.run's results for psguard, for TF).
METRICS: dict[str, tuple[str, str]] = {
    "capture_stall_s": ("psguard_capture_stall_s", "baseline_capture_stall_s"),
    "restore_s": ("psguard_restore_s", "baseline_restore_s"),
    "recovery_s": ("psguard_recovery_s", "baseline_recovery_s"),
    "lost_steps": ("psguard_lost_steps", "baseline_lost_steps"),
    "chief_rss_growth_bytes": ("psguard_chief_rss_growth_bytes", "baseline_chief_rss_growth_bytes"),
}
TITLES = {
    "capture_stall_s": "capture stall (s)",
    "restore_s": "restore (s)",
    "recovery_s": "recovery: kill to normal speed (s)",
    "lost_steps": "lost steps",
    "chief_rss_growth_bytes": "chief RSS growth (MiB)",
}
NODE_LINES = (
    ("psguard", "tab:blue", "psguard, node lost"),
    ("no_copies", "tab:green", "psguard, node lost, no copies"),
    ("tf", "tab:orange", "plain TF, PS lost"),
)
RATIOS = ("recovery_ratio", "restore_vs_raw_ratio", "chief_peak_rss_growth_ratio", "ps_agent_peak_rss_ratio")


def vocab_for(state_bytes: int, dim: int) -> int:
    """Rows of a ``dim``-wide float32 table whose table + Adagrad accumulator make ``state_bytes``."""
    return max(1000, round(state_bytes / (2 * dim * 4)))


def point(sweep: str, p: Params, results: dict[str, Any]) -> dict[str, Any]:
    """One point of a sweep: the job's size and PS count, each metric for both sides, the ratios."""
    doc: dict[str, Any] = {
        "sweep": sweep,
        "state_bytes": results["state_bytes"],
        "num_ps": p.num_ps,
        "table": results["table"],
        "psguard": {k: results[a] for k, (a, _) in METRICS.items()},
        "tf": {k: results[b] for k, (_, b) in METRICS.items()},
        "psguard_phases_s": results["psguard_phases_s"],
        "baseline_phases_s": results["baseline_phases_s"],
        "load_average": results["load_average"],
    }
    doc.update({k: results[k] for k in RATIOS})
    return doc


def node_point(results: dict[str, Any]) -> dict[str, Any]:
    """A point's node-loss figures, from a ``bench recovery --fault node`` run with copies on."""
    return {
        "recovery_s": {
            "psguard": results["psguard_recovery_s"],
            "no_copies": results["psguard_no_copies_recovery_s"],
            "tf": results["baseline_recovery_s"],
        },
        "lost_steps": {
            "psguard": results["psguard_lost_steps"],
            "no_copies": results["psguard_no_copies_lost_steps"],
            "tf": results["baseline_lost_steps"],
        },
        "restored_from": results["psguard_restored_from"],
        "recovery_ratio": results["recovery_ratio"],
        "recovery_vs_no_copies_ratio": results["recovery_vs_no_copies_ratio"],
        "psguard_phases_s": results["psguard_phases_s"],
    }


def run_scale(
    base: Params, sizes: list[int], ps_counts: list[int], ps_state: int, runs: int, *, node_loss: bool = False
) -> dict[str, Any]:
    """Both sweeps; ``base`` gives everything but the table's rows and the PS count. ``node_loss``: each point
    with two PS or more also gets :func:`node_point` (a node needs another PS to hold its copy)."""
    points: list[dict[str, Any]] = []
    done: dict[tuple[int, int], dict[str, Any]] = {}
    node_done: dict[tuple[int, int], dict[str, Any]] = {}

    def measure(sweep: str, state: int, num_ps: int) -> None:
        p = replace(base, vocab_size=vocab_for(state, base.embedding_dim), num_ps=num_ps)
        key = (p.vocab_size, num_ps)
        if key not in done:
            progress(f"scale: {state / 2**20:.0f} MiB of state over {num_ps} PS")
            done[key] = run(p, runs=runs)
        pt = point(sweep, p, done[key])
        if node_loss and num_ps >= 2:
            if key not in node_done:
                progress(f"scale: {state / 2**20:.0f} MiB of state over {num_ps} PS, a PS node lost")
                node_done[key] = run(replace(p, fault="node", copies="full", store="s3"), runs=runs)
            pt["node"] = node_point(node_done[key])
        points.append(pt)

    for size in sizes:
        measure("state", size, base.num_ps)
    for n in ps_counts:
        measure("ps", ps_state, n)
    return {
        "points": points,
        "sizes": sizes,
        "ps_counts": ps_counts,
        "ps_state_bytes": ps_state,
        "embedding_dim": base.embedding_dim,
        "runs": runs,
    }


def plot(results: dict[str, Any], path: str | os.PathLike[str]) -> None:
    """One row per sweep, one panel per metric: psguard and plain TF against the state (log) or the PS count."""
    from psguard.dependencies import import_optional

    backend = import_optional("matplotlib.backends.backend_agg")
    figure = import_optional("matplotlib.figure")
    fig = figure.Figure(figsize=(4 * len(METRICS), 7), layout="constrained")
    backend.FigureCanvasAgg(fig)
    axes = fig.subplots(2, len(METRICS), squeeze=False)
    for row, (sweep, xlabel) in enumerate((("state", "state (MiB)"), ("ps", "PS tasks"))):
        pts = sorted(
            (pt for pt in results["points"] if pt["sweep"] == sweep),
            key=lambda pt: pt["state_bytes"] if sweep == "state" else pt["num_ps"],
        )
        xs = [pt["state_bytes"] / 2**20 if sweep == "state" else pt["num_ps"] for pt in pts]
        for col, metric in enumerate(METRICS):
            ax = axes[row][col]
            scale = 2**20 if metric.endswith("_bytes") else 1
            for side, colour in (("psguard", "tab:blue"), ("tf", "tab:orange")):
                ys = [pt[side][metric] / scale for pt in pts]
                ax.plot(xs, ys, marker="o", color=colour, label="psguard" if side == "psguard" else "plain TF")
            lost = [(x, pt["node"]) for x, pt in zip(xs, pts, strict=True) if "node" in pt]
            if metric == "recovery_s" and lost:
                for side, colour, label in NODE_LINES:
                    ys = [n["recovery_s"][side] for _, n in lost]
                    ax.plot([x for x, _ in lost], ys, marker="x", linestyle="--", color=colour, label=label)
            if sweep == "state" and len(xs) > 1:
                ax.set_xscale("log", base=2)
            ax.set_xlabel(xlabel)
            ax.set_title(TITLES[metric])
            if sweep == "ps":
                ax.set_xticks(xs)
            ax.grid(alpha=0.3)
            if col == 0 or (metric == "recovery_s" and lost):
                ax.legend(fontsize="small")
    ps_state = results["ps_state_bytes"] / 2**20
    fig.suptitle(f"psguard bench scale: state sweep (top), PS sweep at {ps_state:.0f} MiB (bottom)")
    fig.savefig(str(path), dpi=100)


def _sizes(text: str) -> list[int]:
    try:
        return [parse_size(t) for t in text.split(",") if t.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _counts(text: str) -> list[int]:
    try:
        counts = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of PS counts: {text!r} (e.g. 1,2,4)") from None
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"PS counts must be >= 1: {text!r}")
    return counts


def cmd(args: argparse.Namespace) -> int:
    base = params_from_args(args, vocab_size=1000)
    results = run_scale(base, args.sizes, args.ps_counts, args.ps_state, args.runs, node_loss=args.node_loss)
    if args.plot:
        plot(results, args.plot)
        progress(f"plot written to {Path(args.plot).resolve()}")
    if args.json:
        print_results(results, as_json=True)
    else:
        for pt in results["points"]:
            name = f"{pt['sweep']:5} {pt['state_bytes'] / 2**20:7.0f} MiB {pt['num_ps']} PS"
            figures = "  ".join(f"{k} {pt['psguard'][k]:.3g}/{pt['tf'][k]:.3g}" for k in METRICS)
            if "node" in pt:
                r = pt["node"]["recovery_s"]
                figures += f"  node lost: recovery_s {r['psguard']:.3g}/{r['tf']:.3g} ({r['no_copies']:.3g} no copies)"
            print(f"{name}  (psguard/TF) {figures}")
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("scale", help="costs of psguard and plain TF against the state size and the PS count")
    p.add_argument("--sizes", type=_sizes, default=_sizes("64M,512M,1G,2G"), help="states (default 64M,512M,1G,2G)")
    p.add_argument("--ps-counts", type=_counts, default=[1, 2, 4], help="PS counts of the second sweep (default 1,2,4)")
    p.add_argument("--ps-state", type=parse_size, default=parse_size("512M"), help="its state (default 512M)")
    p.add_argument("--runs", type=int, default=1, help="recoveries per side and point (default 1)")
    p.add_argument(
        "--node-loss",
        action="store_true",
        help="also lose PS 0 with its node at each point of 2+ PS (peer copies on and off; a SeaweedFS log)",
    )
    p.add_argument("--plot", metavar="FILE.png", help="draw each cost against the sweeps (needs psguard[plot])")
    add_job_options(p, embedding_dim=32)
    p.set_defaults(func=cmd)
