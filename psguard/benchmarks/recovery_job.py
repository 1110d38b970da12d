"""The job ``psguard bench recovery`` trains on both sides (:class:`Params`), and how one side's recovery is
measured from the progress records its trainer wrote (:func:`measure`; :mod:`psguard.benchmarks.recovery` says
what each figure means).
"""

from __future__ import annotations

import itertools
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from psguard.benchmarks.common import NORMAL_FACTOR, median

__all__ = ["NUM_WORKERS", "POLL", "Params", "Records", "child", "growth_after_build", "measure", "read_records"]

NUM_WORKERS = 1
POLL = 0.05


@dataclass(frozen=True)
class Params:
    vocab_size: int = 200_000
    embedding_dim: int = 16
    batch_size: int = 64
    num_ps: int = 2
    memory_every: int = 5
    durable_every: int = 50  # K: psguard's durable cadence and the baseline's CheckpointManager.save cadence
    kill_step: int = 0  # 0: 2K - 1
    after_steps: int = 30  # steps trained after the restore (enough to find the first one at normal speed)
    timeout: float = 600.0
    # "process": PS 0's server is killed, its agent restarts it. "node": PS 0's agent is killed with it (its
    # memory tier gone) and a new agent starts with an empty part folder, as on a replacement node. "chief": the
    # chief's trainer process is killed; psguard's agent starts a new one, plain TF's script restarts the chief.
    fault: str = "process"
    copies: str = "none"  # psguard's peers.copies ("full": each PS agent holds a copy of another's shards)
    keep_survivors: bool = False  # psguard's peers.keep_survivors (an in-process rejoin keeps a surviving PS)
    parity_group: int = 2  # with copies "parity": PS per XOR block (peers.parity_group)
    store: str = "local"  # psguard's durable log: "local" (a folder) or "s3" (a SeaweedFS server this run starts)

    @property
    def kill_at(self) -> int:
        return self.kill_step or 2 * self.durable_every - 1

    @property
    def settle_steps(self) -> int:
        return self.memory_every + 2

    @property
    def approx_state_bytes(self) -> int:
        """The embedding and its Adagrad accumulator (float32); the dense layers are a few KB more."""
        return 2 * self.vocab_size * self.embedding_dim * 4


# ------------------------------------------------------------------------------------------- the records


@dataclass
class Records:
    """One side's progress records of one run, read back: what :func:`measure` needs."""

    docs: list[dict[str, Any]] = field(default_factory=list)

    def of(self, event: str) -> list[dict[str, Any]]:
        return [d for d in self.docs if d.get("event") == event]

    def first(self, event: str) -> dict[str, Any]:
        found = self.of(event)
        if not found:
            raise RuntimeError(f"no {event!r} record")
        return found[0]


def read_records(path: Path) -> Records:
    from psguard.agent.process.launcher import ProgressReader

    return Records(ProgressReader(path).read()) if path.exists() else Records()


def _pace(steps: list[dict[str, Any]], after: int = 5) -> float:
    """Steps per second over ``steps`` past step ``after`` (at least the first 5: tracing), captures and all."""
    run = [d for d in steps if d["step"] > max(5, after)]
    if len(run) < 2 or run[-1]["t"] <= run[0]["t"]:
        return float("nan")
    return float(run[-1]["step"] - run[0]["step"]) / float(run[-1]["t"] - run[0]["t"])


def _settle(recs: Records) -> dict[str, Any] | None:
    """The trainer's ``settle`` record (psguard's side: where the peer copies were made), if any."""
    found = recs.of("settle")
    return found[0] if found else None


def _settle_wait(settle: dict[str, Any] | None, before: list[dict[str, Any]]) -> float | None:
    """Seconds from the trainer's ``settle`` record to its next step's: the wait for the peer copies."""
    if settle is None:
        return None
    after = [d for d in before if d["step"] > int(settle["step"])]
    return float(after[0]["t"]) - float(settle["t"]) if after else None


def measure(recs: Records, kill_t: float, p: Params, *, need_capture: bool) -> dict[str, Any]:
    """Recovery, lost steps, restore seconds and capture stalls of one side, from its records.

    Normal speed: the median duration of the steps before the kill that had no capture in them (the first 5
    skipped: tracing); recovery ends at the first step after the restore, ``settle_steps`` or more past the
    restored step (and after a capture when ``need_capture``), that took at most ``NORMAL_FACTOR`` times that.
    """
    steps = recs.of("step")
    before = [d for d in steps if d["gen"] == 0]
    plain = [b["t"] - a["t"] for a, b in itertools.pairwise(before) if not b["cap"] and b["step"] > 5]
    normal = median(plain) if plain else float("nan")
    restore = recs.of("restore")[-1]
    restored = int(restore["step"])
    after = [d for d in steps if d["gen"] >= 1]
    captures_after = [d for d in recs.of("capture") if d["gen"] >= 1]
    end, prev, reached, captured = None, float(restore["t1"]), False, False
    for d in after:
        captured = captured or d["cap"]
        ok = d["step"] >= restored + p.settle_steps and (captured or not need_capture) and not d["cap"]
        if ok and d["t"] - prev <= NORMAL_FACTOR * normal:
            end, reached = d["t"], True
            break
        prev = d["t"]
    if end is None:
        end = after[-1]["t"] if after else float("nan")
    stalls = [float(d["stall"]) for d in recs.of("capture") if d["gen"] == 0]
    settle = _settle(recs)
    return {
        "recovery_s": end - kill_t,
        "first_step_s": (after[0]["t"] - kill_t) if after else float("nan"),
        "normal_speed_reached": reached,
        "normal_step_s": normal,
        # From the settle point on (psguard's side: the peer copies made, as in a job that has run for hours).
        "steps_per_s": _pace(before, int(settle["step"]) if settle is not None else 5),
        # How long the trainer waited there: the first whole copy of every shard (once per job and node loss).
        "settle_wait_s": _settle_wait(settle, before),
        "lost_steps": p.kill_at - restored,
        "restored_step": restored,
        "restored_from": restore.get("source"),
        "restore_s": float(restore["t1"]) - float(restore["t0"]),
        "build_s": float(restore["build_s"]),
        "restore_end_to_first_step_s": (after[0]["t"] - float(restore["t1"])) if after else float("nan"),
        # The first capture is a full one in every job; the steady state is the rest.
        "capture_stall_s": median(stalls[1:]) if len(stalls) > 1 else (stalls[0] if stalls else float("nan")),
        "first_capture_stall_s": stalls[0] if stalls else float("nan"),
        "capture_after_restore_stall_s": float(captures_after[0]["stall"]) if captures_after else None,
        "capture_after_restore_rows": captures_after[0].get("rows_spilled") if captures_after else None,
        "restore_parts_s": restore.get("parts") or {},
        "first_capture_restorable_s": recs.of("first-restorable")[0]["seconds"]
        if recs.of("first-restorable")
        else None,
        "capture_rows": median([float(d.get("rows_spilled", 0)) for d in recs.of("capture")[1:]] or [0.0]),
    }


def growth_after_build(recs: Records) -> int:
    """The trainer's largest RSS growth over a generation, counted from its model's build (each process resets
    its kernel peak mark there): the peaks its records carry after that, minus its RSS then."""
    out = 0
    restores = recs.of("restore")
    for k, r in enumerate(restores):
        later = restores[k + 1]["t"] if k + 1 < len(restores) else float("inf")
        peaks = [int(d["hwm"]) for d in recs.docs if "hwm" in d and r["t"] <= d["t"] < later]
        peaks += [int(r.get("hwm", 0))]
        out = max(out, max(peaks) - int(r["built_rss"]))
    return out


def child(fn: str, *args: str, warm: bool = False) -> list[str]:
    """The command of a child process that runs :mod:`psguard.benchmarks.recovery_trainers`' ``fn`` on ``args``.

    ``warm``: as ``python -m MODULE``, a command a ``psguard agent`` keeps a warm standby of
    (:func:`~psguard.agent.process.standby.warm_trainer_command`), as it does for a user's ``python train.py``; the
    ``-c`` form gets none, so its restarts are cold."""
    if warm:
        return [sys.executable, "-m", "psguard.benchmarks.recovery_trainers", fn, *args]
    return [
        sys.executable,
        "-c",
        f"import sys; from psguard.benchmarks.recovery_trainers import {fn}; {fn}(*sys.argv[1:])",
        *args,
    ]
