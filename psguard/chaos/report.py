"""The chaos report: ``report.json`` (verdicts, per-fault recovery and lost steps, goodput), ``report.md`` for
people, ``timeline.png`` (step over time per trainer process, faults and heals marked, restores starred).

Everything here is derived from the history (and the checkers' verdicts over it), so a report can be rebuilt
from ``history.jsonl`` alone by ``psguard chaos check``.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from psguard.chaos.checkers import Verdict, overall
from psguard.chaos.history import Op, Record, harness_seconds, operations
from psguard.chaos.outcomes import FAULTS, HEALS, fault_outcomes
from psguard.chaos.resources import resource_series

__all__ = ["durable_lag", "goodput", "write_report", "write_side_by_side"]


def durable_lag(ops: Sequence[Op]) -> dict[str, Any]:
    """How far the durable log trailed the saves due for it (psguard.policy.lag), and how long training held.

    Per durable save committed: seconds from its capture's start to its commit, and steps training had completed
    past it by then. ``hold_seconds``: what the trainers' saves waited for the durable log in all (the default
    ``durable_lag`` holds each durable save until committed: lag in steps 0, lag in seconds the write's time).
    ``committed_steps``: the steps of the durable commits acknowledged (explore asks what plain TF's saver would
    have lost at another step)."""
    captures: dict[tuple[str, int], Op] = {}
    for o in ops:
        if o.f == "capture" and o.process.startswith("trainer") and "durable" in o.invoke.value.get("tiers", []):
            captures.setdefault((o.process.split("/")[0], int(o.invoke.value.get("step", -1))), o)
    trained = sorted((o.end, int(o.value["step"])) for o in ops if o.f == "train" and o.type == "ok" and o.end)
    seconds: list[float] = []
    steps: list[int] = []
    for c in ops:
        if c.f != "durable-commit" or c.type != "ok" or c.end is None or not c.process.startswith("trainer"):
            continue
        asked = int(c.value.get("asked", c.value.get("step", -1)))
        capture = captures.get((c.process.split("/")[0], asked))
        if capture is None:
            continue
        seconds.append(c.end - capture.start)
        done = [step for end, step in trained if end <= c.end and end >= capture.start]
        steps.append(max(0, max(done, default=asked) - asked))
    holds = [float(o.value.get("hold") or 0.0) for o in ops if o.f == "capture" and o.type == "ok"]
    committed = {int(c.value["step"]) for c in ops if c.f == "durable-commit" and c.type == "ok" and "step" in c.value}
    return {
        "commits": len(seconds),
        "committed_steps": sorted(committed),  # what the trainers heard durable: the saver's cadence as it ran
        "max_seconds": round(max(seconds), 3) if seconds else None,
        "mean_seconds": round(sum(seconds) / len(seconds), 3) if seconds else None,
        "max_steps": max(steps) if steps else None,
        "hold_seconds": round(sum(holds), 3),
    }


def goodput(ops: Sequence[Op], target: int | None) -> dict[str, Any]:
    """Useful steps per second of training wall time, and the share of trained steps that were kept.

    The harness's own time is left out: the trainers digest every variable at each capture and restore to prove
    restores exact (``harness_seconds`` in those records), which a user's job does not do. psguard's side digests
    at every memory capture, the plain-TF side only at its saves, so counting it would charge psguard for the
    harness.
    """
    trains = [o for o in ops if o.f == "train" and o.process.startswith("trainer")]
    ok = [o for o in trains if o.type == "ok" and o.end is not None]
    if not ok:
        return {"steps_per_second": None, "seconds": None, "steps_trained": 0, "useful_fraction": None}
    start = min(o.start for o in trains)
    reached = next((o for o in ok if target is not None and int(o.value["step"]) >= target), ok[-1])
    end = reached.end or reached.start
    harness = harness_seconds(ops, start, end)
    seconds = end - start - harness
    final = int(reached.value["step"])
    trained = sum(int(o.value.get("steps", 0)) for o in trains)  # every chunk scheduled, kept or lost
    return {
        "steps_per_second": final / seconds if seconds > 0 else None,
        "fault_free_steps_per_second": _fault_free_pace(ops, ok),
        "seconds": seconds,
        "harness_seconds": harness,
        "final_step": final,
        "steps_scheduled": trained,
        "useful_fraction": final / trained if trained else None,
    }


def _fault_free_pace(ops: Sequence[Op], ok: Sequence[Op]) -> float | None:
    """Steps per second before the first fault, the harness's digests left out: the price of checkpointing
    itself (captures and saves between the chunks count), comparable between psguard and plain TF. The first
    two chunks are warm-up (tracing), as for the checkers' normal speed."""
    first_fault = min((o.start for o in ops if o.process == "nemesis"), default=float("inf"))
    calm = [o for o in ok if (o.end or 0.0) < first_fault][2:]
    if len(calm) < 2:
        return None
    begin, end = calm[0].end or calm[0].start, calm[-1].end or calm[-1].start
    harness = harness_seconds(ops, begin, end)
    steps = sum(int(o.invoke.value.get("steps", 0)) for o in calm[1:])
    seconds = end - begin - harness
    return steps / seconds if seconds > 0 and steps > 0 else None


def write_report(
    directory: Path,
    records: Sequence[Record],
    verdicts: Mapping[str, Verdict],
    *,
    wall_seconds: float | None = None,
    scenario: Any = None,
) -> dict[str, Any]:
    ops = operations(records)
    run = next((o.value for o in ops if o.process == "harness" and o.f == "run"), {})
    outcomes = fault_outcomes(records)
    target = run.get("target_step")
    finish = [o for o in ops if o.process == "harness" and o.f == "finish" and o.type == "ok"]
    if finish:  # a soak names its last step when its duration is over
        target = finish[-1].value.get("target_step")
    report: dict[str, Any] = {
        "scenario": run.get("scenario"),
        "proves": run.get("proves"),
        "seed": run.get("seed"),
        "mode": run.get("mode", "psguard"),
        "overall": overall(verdicts),
        "verdicts": {name: v.to_json() for name, v in verdicts.items()},
        "faults": outcomes,
        "goodput": goodput(ops, int(target) if target is not None else None),
        "durable_lag": durable_lag(ops),
        "wall_seconds": wall_seconds,
        "schedule": run.get("schedule", []),
    }
    if run.get("soak"):
        report["soak"] = _soak_summary(run["soak"], outcomes, verdicts)
    (directory / "report.json").write_text(json.dumps(report, indent=2, default=str))
    (directory / "report.md").write_text(_markdown(report))
    with contextlib.suppress(ImportError):  # matplotlib is a dependency; a stripped install still gets the rest
        _timeline(ops, report, directory / "timeline.png")
        if run.get("soak"):
            _resources_plot(resource_series(records), directory / "resources.png")
    return report


def _soak_summary(
    soak: Mapping[str, Any], outcomes: Sequence[Mapping[str, Any]], verdicts: Mapping[str, Verdict]
) -> dict[str, Any]:
    """What the issue asks a soak to show: faults by kind, recoveries, lost steps per fault, acknowledged
    commits lost, each resource's slope per hour and what a week of it makes."""
    kinds: dict[str, int] = {}
    for f in outcomes:
        kind = f"{f['fault']} {str(f['target']).split(':')[0]}"
        kinds[kind] = kinds.get(kind, 0) + 1
    lost = [f["lost_steps"] for f in outcomes if f.get("lost_steps") is not None]
    kept = verdicts.get("durable-commits-kept")
    resources = verdicts.get("resources-bounded")
    return {
        "duration_seconds": soak.get("duration"),
        "faults_by_kind": kinds,
        "recoveries": sum(1 for f in outcomes if f.get("restored_step") is not None),
        "lost_steps_per_fault": {"mean": sum(lost) / len(lost) if lost else None, "max": max(lost, default=None)},
        "acknowledged_commits_lost": len(kept.evidence.get("missing", [])) if kept is not None else None,
        "resources": list(resources.evidence.get("series", [])) if resources is not None else [],
    }


def _resources_plot(series: Mapping[str, Sequence[tuple[float, float]]], path: Path) -> None:
    """One panel per kind of resource (RSS, threads, fds, children, folder bytes), one line per role."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = ("rss_bytes", "threads", "fds", "children", "bytes")
    fig, axes = plt.subplots(len(kinds), 1, figsize=(10, 2.4 * len(kinds)), sharex=True)
    start = min((pts[0][0] for pts in series.values() if pts), default=0.0)
    for ax, kind in zip(axes, kinds, strict=True):
        for name, pts in sorted(series.items()):
            if name.rpartition("/")[2] != kind:
                continue
            scale = 2**20 if kind.endswith("bytes") else 1
            ax.plot([(t - start) / 60 for t, _ in pts], [v / scale for _, v in pts], label=name.rpartition("/")[0])
        ax.set_ylabel(f"{kind} (MiB)" if kind.endswith("bytes") else kind)
        if ax.lines:
            ax.legend(fontsize=6, ncol=3, loc="upper left")
    axes[-1].set_xlabel("minutes")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _markdown(report: Mapping[str, Any]) -> str:
    lines = [f"# chaos: {report['scenario']} (seed {report['seed']}, {report['mode']}): **{report['overall']}**", ""]
    if report.get("proves"):
        lines += [str(report["proves"]).strip(), ""]
    if report.get("baseline"):
        lines += _side_by_side(report), ""
    lag = report.get("durable_lag") or {}
    if lag.get("commits"):
        said = f"at most {lag['max_steps']} step(s) and {lag['max_seconds']} s behind their save"
        lines += [f"Durable lag: {lag['commits']} commit(s), {said}; training held {lag['hold_seconds']} s.", ""]
    lines += ["| checker | verdict | summary |", "| --- | --- | --- |"]
    for name, v in report["verdicts"].items():
        lines.append(f"| {name} | {v['status']} | {v['summary']} |")
    lines += ["", "| fault | target | at step | restored step | source | lost steps (bound) | first steps s "
              "| recovery s |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for f in report["faults"]:
        rec = "-" if f["recovery_seconds"] is None else f"{f['recovery_seconds']:.1f}"
        resumed = "-" if f.get("resumed_seconds") is None else f"{f['resumed_seconds']:.1f}"
        restored = "-" if f["restored_step"] is None else f["restored_step"]
        lost = "-" if f["lost_steps"] is None else f["lost_steps"]
        lines.append(
            f"| {f['fault']} | {f['target']} | {f['at_step']} | {restored}"
            f" | {f['restore_source'] or '-'} | {lost} ({f['max_lost_steps']}) | {resumed} | {rec} |"
        )
    lines += ["", "first steps s: from the fault to the first chunk of steps done; recovery s: to training at "
              "normal speed again (the first capture after a restore included)."]  # fmt: skip
    g = report["goodput"]
    if g.get("steps_per_second") is not None:
        lines += ["", f"Goodput: {g['steps_per_second']:.1f} steps/s over {g['seconds']:.1f}s of training; "
                  f"{g['useful_fraction']:.0%} of scheduled steps kept (the harness's own "
                  f"{g.get('harness_seconds', 0.0):.1f}s of digests left out)."]  # fmt: skip
    if report.get("wall_seconds") is not None:
        lines += [f"Wall time: {report['wall_seconds']:.0f}s."]
    if report.get("soak"):
        lines += _soak_markdown(report["soak"])
    return "\n".join(lines) + "\n"


def _soak_markdown(soak: Mapping[str, Any]) -> list[str]:
    kinds = ", ".join(f"{k} {n}" for k, n in sorted(soak["faults_by_kind"].items())) or "none"
    lost = soak["lost_steps_per_fault"]
    mean = "-" if lost["mean"] is None else f"{lost['mean']:.1f}"
    lines = ["", f"## Soak: {float(soak['duration_seconds'] or 0) / 60:.0f} minutes", "",
             f"Faults by kind: {kinds}. Recoveries (restores): {soak['recoveries']}. Lost steps per fault: mean "
             f"{mean}, max {lost['max']}. Acknowledged durable commits lost: {soak['acknowledged_commits_lost']}.",
             "", "| resource | slope per hour | bound per hour | last | a week at that slope |",
             "| --- | --- | --- | --- | --- |"]  # fmt: skip
    for r in soak["resources"]:
        mib = r["unit"] == "bytes"

        def fmt(x: float, mib: bool = mib) -> str:
            return f"{x / 2**20:.2f} MiB" if mib else f"{x:.2f}"

        lines.append(
            f"| {r['series']} | {fmt(r['slope_per_hour'])} | {fmt(r['bound_per_hour'])} | {fmt(r['last'])} "
            f"| {fmt(r['week'])} |"
        )
    lines += ["", "Plots: resources.png."]
    return lines


def _side_by_side(report: Mapping[str, Any]) -> str:
    b = report["baseline"]
    rows = ["| | psguard | baseline (plain TF) |", "| --- | --- | --- |"]
    g, bg = report["goodput"], b["goodput"]

    def fmt(x: float | None, spec: str) -> str:
        return "-" if x is None else format(x, spec)

    rows.append(
        f"| goodput (steps/s) | {fmt(g.get('steps_per_second'), '.1f')} | {fmt(bg.get('steps_per_second'), '.1f')} |"
    )
    ours, theirs = g.get("fault_free_steps_per_second"), bg.get("fault_free_steps_per_second")
    ratio = f" ({ours / theirs:.0%} of plain TF's)" if ours and theirs else ""
    rows.append(f"| steps/s before the first fault | {fmt(ours, '.1f')}{ratio} | {fmt(theirs, '.1f')} |")
    rec = [f["recovery_seconds"] for f in report["faults"]]
    brec = [f["recovery_seconds"] for f in b["faults"]]
    rows.append(f"| recovery s per fault | {_list(rec)} | {_list(brec)} |")
    rows.append(f"| lost steps per fault | {[f['lost_steps'] for f in report['faults']]} | "
                f"{[f['lost_steps'] for f in b['faults']]} |")  # fmt: skip
    lag, blag = report.get("durable_lag") or {}, b.get("durable_lag") or {}
    rows.append(f"| durable lag: max steps / max s / held s | {_lag_cell(lag)} | {_lag_cell(blag)} |")
    return "\n".join(rows)


def _lag_cell(lag: Mapping[str, Any]) -> str:
    return f"{lag.get('max_steps')} / {lag.get('max_seconds')} / {lag.get('hold_seconds')}"


def _list(values: Sequence[float | None]) -> str:
    return "[" + ", ".join("-" if v is None else f"{v:.1f}" for v in values) + "]"


def _timeline(ops: Sequence[Op], report: Mapping[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    trains = [o for o in ops if o.f == "train" and o.type == "ok" and o.end is not None]
    if not ops:
        return
    t0 = min(o.start for o in ops if o.process.startswith("trainer")) if trains else ops[0].start
    fig, ax = plt.subplots(figsize=(11, 5), dpi=100)
    processes = sorted({o.process for o in trains}, key=lambda p: min(o.start for o in trains if o.process == p))
    colors = plt.get_cmap("tab10")
    for i, proc in enumerate(processes):
        mine = [o for o in trains if o.process == proc]
        # One line per generation: the step falls back at a restore.
        xs: list[float] = []
        ys: list[int] = []
        first = True
        for o in mine:
            step = int(o.value["step"])
            if ys and step < ys[-1]:
                ax.plot(xs, ys, color=colors(i), lw=1.6, label=proc if first else None)
                first, xs, ys = False, [], []
            xs.append((o.end or o.start) - t0)
            ys.append(step)
        ax.plot(xs, ys, color=colors(i), lw=1.6, label=proc if first else None)
    for o in ops:
        if o.process == "nemesis" and o.f in FAULTS and o.type == "ok":
            ax.axvline(o.start - t0, color="tab:red", ls="--", lw=1.2)
            ax.annotate(f"{o.f} {o.value.get('target')}", (o.start - t0, 0), rotation=90, fontsize=7, color="tab:red",
                        xytext=(2, 4), textcoords="offset points")  # fmt: skip
        elif o.process == "nemesis" and o.f in HEALS and o.type == "ok":
            ax.axvline(o.start - t0, color="tab:green", ls=":", lw=1.2)
    shaded = False
    for f in report.get("faults", []):
        if f.get("recovery_seconds") is not None and f.get("at") is not None:
            ax.axvspan(f["at"] - t0, f["at"] - t0 + f["recovery_seconds"], color="tab:red", alpha=0.1,
                       label=None if shaded else "recovery: fault to normal speed")  # fmt: skip
            shaded = True
    restores = [o for o in ops if o.f == "restore" and o.type == "ok" and o.value.get("source")]
    if restores:
        ax.scatter([(o.end or o.start) - t0 for o in restores], [int(o.value["step"]) for o in restores], marker="*",
                   s=160, color="tab:orange", zorder=4, label="restore")  # fmt: skip
    commits = [o for o in ops if o.f == "durable-commit" and o.type == "ok" and o.end is not None]
    if commits:
        ax.scatter([(o.end or 0) - t0 for o in commits], [int(o.value["step"]) for o in commits], marker="D", s=18,
                   color="tab:purple", zorder=3, label="durable commit")  # fmt: skip
    ax.set_xlabel("seconds since the first trainer operation")
    ax.set_ylabel("training step")
    ax.set_title(f"chaos {report['scenario']} (seed {report['seed']}): {report['overall']}  "
                 "(red: fault, green: heal)")  # fmt: skip
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def write_side_by_side(directory: Path, ours: Mapping[str, Any], baseline: Mapping[str, Any]) -> dict[str, Any]:
    """``report.json`` / ``report.md`` with psguard's run and the baseline's on the same scenario and seed."""
    report = {**ours, "baseline": dict(baseline)}
    (directory / "report.json").write_text(json.dumps(report, indent=2, default=str))
    lines = [f"# chaos: {ours['scenario']} (seed {ours['seed']}): psguard vs the plain-TF baseline", ""]
    lines += [str(ours.get("proves") or "").strip(), "", _side_by_side(report), ""]
    lines += ["| checker | psguard | baseline |", "| --- | --- | --- |"]
    for name, v in ours["verdicts"].items():
        b = baseline["verdicts"].get(name, {})
        lines.append(f"| {name} | {v['status']}: {v['summary']} | {b.get('status')}: {b.get('summary')} |")
    lines += ["", "Details: [psguard/report.md](psguard/report.md), [baseline/report.md](baseline/report.md)."]
    (directory / "report.md").write_text("\n".join(lines) + "\n")
    return report
