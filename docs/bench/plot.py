"""Draw the plots that BENCHMARKS.md links, as small SVG files beside this script.

The data points are copied by hand from BENCHMARKS.md's tables (each block below names its section), not read
from a run: the benchmarks are too slow to re-run for a plot, and a copy keeps each figure traceable to the
dated run it comes from (docs/bench/history.md). When a table in BENCHMARKS.md gets new figures, change them
here too and run, from the repository's root:

    python docs/bench/plot.py

It needs matplotlib (``pip install 'psguard[plot]'`` or any matplotlib). The SVG keeps its text as text and
carries no date, so a run with unchanged data rewrites the same bytes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
from matplotlib.figure import Figure

HERE = Path(__file__).resolve().parent
PSGUARD: dict[str, Any] = {"color": "#1f77b4", "marker": "o", "label": "psguard"}
TF: dict[str, Any] = {"color": "#d62728", "marker": "s", "label": "plain TF"}

# BENCHMARKS.md, "`psguard bench scale`": 2026-12-02 10:26-10:40 UTC, 2 PS, one run per side and point.
STATE_GIB = [0.0625, 0.5, 1.0, 2.0]
STATE_LABELS = ["64 MiB", "512 MiB", "1 GiB", "2 GiB"]
STATE = {
    "capture stall (s)": ([0.036, 0.044, 0.039, 0.039], [0.33, 0.74, 1.31, 2.71]),
    "restore (s)": ([0.54, 0.87, 1.02, 2.07], [0.14, 0.36, 0.71, 1.55]),
    "recovery, kill to normal speed (s)": ([2.67, 2.93, 3.23, 5.63], [12.49, 13.32, 16.12, 24.84]),
}

# The same run, second sweep: 512 MiB of state over 1, 2 and 4 PS.
PS_COUNTS = [1, 2, 4]
PS = {
    "capture stall (s)": ([0.033, 0.044, 0.053], [1.10, 0.74, 0.62]),
    "restore (s)": ([0.68, 0.87, 0.93], [0.40, 0.36, 0.39]),
    "recovery, kill to normal speed (s)": ([2.22, 2.93, 3.79], [12.11, 13.32, 15.78]),
}

# BENCHMARKS.md, "`psguard bench capture` at 2 GB": 2026-12-02 09:36-09:41 UTC, 8,000,000 x 32 + Adagrad,
# stall against the share of the embedding's rows changed; TF's save of the whole state was 2.59-2.86 s.
CHANGED_PCT = [1, 10, 100]
CHIEF_PATH = [0.053, 0.35, 4.48]
PS_SIDE = [0.24, 0.38, 2.42]
TF_SAVE = (2.59, 2.86)


def _style() -> None:
    plt.rcParams.update(
        {
            "svg.fonttype": "none",  # text stays text: a few KB instead of glyph paths
            "svg.hashsalt": "psguard-bench",  # stable element ids
            "font.size": 8,
            "axes.spines.top": False,
            "axes.spines.right": False,
            "axes.grid": False,
            "lines.linewidth": 1.4,
            "lines.markersize": 4,
        }
    )


def _save(fig: Figure, name: str) -> None:
    fig.tight_layout()
    fig.savefig(HERE / name, format="svg", metadata={"Date": None})
    plt.close(fig)
    print(HERE / name)


def against_state() -> None:
    fig, axes = plt.subplots(1, 3, figsize=(9, 2.6))
    for ax, (title, (ours, theirs)) in zip(axes, STATE.items(), strict=True):
        ax.plot(STATE_GIB, theirs, **TF)
        ax.plot(STATE_GIB, ours, **PSGUARD)
        ax.set_title(title)
        ax.set_xlabel("state over 2 PS (first point: 64 MiB)")
        ax.set_xticks(STATE_GIB[1:], STATE_LABELS[1:])
        ax.set_ylim(bottom=0)
    axes[0].legend(frameon=False)
    fig.suptitle("bench scale, 2026-12-02: each cost against the state (2 PS, one run per point)", fontsize=9)
    _save(fig, "scale-state.svg")


def against_ps() -> None:
    fig, axes = plt.subplots(1, 3, figsize=(9, 2.6))
    for ax, (title, (ours, theirs)) in zip(axes, PS.items(), strict=True):
        ax.plot(PS_COUNTS, theirs, **TF)
        ax.plot(PS_COUNTS, ours, **PSGUARD)
        ax.set_title(title)
        ax.set_xlabel("PS (512 MiB of state in all, 2 cores)")
        ax.set_xticks(PS_COUNTS)
        ax.set_ylim(bottom=0)
    axes[0].legend(frameon=False)
    fig.suptitle("bench scale, 2026-12-02: each cost against the number of PS (one machine, 2 cores)", fontsize=9)
    _save(fig, "scale-ps.svg")


def against_changed_rows() -> None:
    fig, ax = plt.subplots(figsize=(4.5, 2.8))
    ax.axhspan(*TF_SAVE, color=TF["color"], alpha=0.2, label="TF's save of the whole state")
    ax.plot(CHANGED_PCT, CHIEF_PATH, color="#9467bd", marker="^", label="psguard, rows to the chief")
    ax.plot(CHANGED_PCT, PS_SIDE, **{**PSGUARD, "label": "psguard, PS-side (under PS agents)"})
    ax.set_xscale("log")
    ax.set_xticks(CHANGED_PCT, [f"{p} %" for p in CHANGED_PCT])
    ax.set_xlabel("rows of the embedding changed since the last save")
    ax.set_ylabel("stall of one save (s)")
    ax.set_ylim(bottom=0)
    ax.set_title("bench capture at 2 GB (8M x 32 + Adagrad), 2026-12-02", fontsize=9)
    ax.legend(frameon=False, loc="upper left")
    _save(fig, "capture-changed.svg")


def main() -> None:
    _style()
    against_state()
    against_ps()
    against_changed_rows()


if __name__ == "__main__":
    main()
