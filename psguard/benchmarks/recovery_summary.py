"""What ``psguard bench recovery`` prints: the runs of each side summed up into one document of medians and ratios.

Apart from :mod:`psguard.benchmarks.recovery` (which runs the jobs) so that each stays one reader's job.
"""

from __future__ import annotations

import os
from statistics import median
from typing import Any, Protocol

__all__ = ["compare_no_copies", "compare_ps_kill", "summarize"]


class Job(Protocol):
    """What a summary says of the job (:class:`psguard.benchmarks.recovery_job.Params`, read-only)."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def embedding_dim(self) -> int: ...

    @property
    def num_ps(self) -> int: ...

    @property
    def memory_every(self) -> int: ...

    @property
    def durable_every(self) -> int: ...

    @property
    def fault(self) -> str: ...

    @property
    def copies(self) -> str: ...

    @property
    def parity_group(self) -> int: ...

    @property
    def keep_survivors(self) -> bool: ...

    @property
    def store(self) -> str: ...

    @property
    def kill_at(self) -> int: ...


def _med(docs: list[dict[str, Any]], key: str) -> float:
    values = [float(d[key]) for d in docs if d.get(key) is not None]
    return median(values) if values else float("nan")


def summarize(
    p: Job, ours: list[dict[str, Any]], theirs: list[dict[str, Any]], xs: list[float], ys: list[float]
) -> dict[str, Any]:
    lost_ours = _med(ours, "lost_steps")
    lost_theirs = _med(theirs, "lost_steps")

    def phases(docs: list[dict[str, Any]]) -> dict[str, float]:
        return {k: round(median([d["phases"][k] for d in docs]), 3) for k in docs[0]["phases"]}

    return {
        "recovery_ratio": median(xs) / median(ys),
        "lost_steps_ratio": lost_ours / lost_theirs if lost_theirs else float("nan"),
        "agents": True,
        "state_bytes": int(ours[0]["state_bytes"]),
        "chief_peak_rss_growth_ratio": _med(ours, "chief_peak_rss_growth_ratio"),
        "chief_peak_rss_growth_ratio_with_build": _med(ours, "chief_peak_rss_growth_ratio_with_build"),
        "ps_agent_peak_rss_ratio": _med(ours, "ps_agent_peak_rss_ratio"),
        "restore_vs_raw_ratio": _med(ours, "restore_vs_raw_ratio"),
        "ps_side_shards": all(d["ps_side_shards"] for d in ours),
        "psguard_recovery_s": median(xs),
        "baseline_recovery_s": median(ys),
        "psguard_first_step_s": _med(ours, "first_step_s"),
        "baseline_first_step_s": _med(theirs, "first_step_s"),
        "psguard_lost_steps": lost_ours,
        "baseline_lost_steps": lost_theirs,
        "psguard_restore_s": _med(ours, "restore_s"),
        "baseline_restore_s": _med(theirs, "restore_s"),
        "psguard_restore_mib_s": _med(ours, "restore_mib_s"),
        "restore_gib_per_s": _med(ours, "restore_mib_s") / 1024,  # the state over the restore's time
        "raw_restore_mib_s": _med(ours, "raw_restore_mib_s"),
        "psguard_capture_stall_s": _med(ours, "capture_stall_s"),
        "baseline_capture_stall_s": _med(theirs, "capture_stall_s"),
        "psguard_capture_after_restore_stall_s": _med(ours, "capture_after_restore_stall_s"),
        "psguard_capture_after_restore_rows": [d["capture_after_restore_rows"] for d in ours],
        "psguard_capture_rows": _med(ours, "capture_rows"),
        "psguard_first_capture_stall_s": _med(ours, "first_capture_stall_s"),
        "psguard_first_capture_restorable_s": _med(ours, "first_capture_restorable_s"),
        "psguard_restore_parts_s": {
            k: round(median([d["restore_parts_s"].get(k, 0.0) for d in ours]), 3)
            for k in ("snapshot_s", "load_s", "rebase_s")
        },
        "psguard_trainer_rss_after_build_bytes": _med(ours, "trainer_rss_after_build_bytes"),
        "psguard_chief_rss_growth_bytes": _med(ours, "chief_rss_growth_bytes"),
        "psguard_trainer_rss_growth_bytes": _med(ours, "trainer_rss_growth_bytes"),
        "psguard_chief_agent_rss_growth_bytes": _med(ours, "chief_agent_rss_growth_bytes"),
        "baseline_chief_rss_growth_bytes": _med(theirs, "chief_rss_growth_bytes"),
        "psguard_chief_rss_growth_with_build_bytes": _med(ours, "chief_rss_growth_with_build_bytes"),
        "baseline_chief_rss_growth_with_build_bytes": _med(theirs, "chief_rss_growth_with_build_bytes"),
        "ps_agent_rss_growth_bytes_runs": [d["ps_agent_rss_growth_bytes"] for d in ours],
        "ps_shard_bytes": ours[0]["ps_shard_bytes"],
        "normal_speed_reached": {
            "psguard": [d["normal_speed_reached"] for d in ours],
            "baseline": [d["normal_speed_reached"] for d in theirs],
        },
        "recovery_ratio_per_run": [x / y for x, y in zip(xs, ys, strict=True)],
        "psguard_recovery_s_runs": xs,
        "baseline_recovery_s_runs": ys,
        "psguard_lost_steps_runs": [d["lost_steps"] for d in ours],
        "baseline_lost_steps_runs": [d["lost_steps"] for d in theirs],
        "psguard_restored_from": [d["restored_from"] for d in ours],
        "fault": p.fault,
        "copies": p.copies,
        "keep_survivors": p.keep_survivors,
        "store": p.store,
        "peer_copy_lag_steps": [d["peer_copy_lag_steps"] for d in ours],
        "peer_rss_ratio": _med(ours, "peer_rss_ratio"),
        "peer_rss_peak_ratio": _med(ours, "peer_rss_peak_ratio"),
        "copy_overhead_ratio": _med(ours, "copy_overhead_ratio"),
        "parity_group": p.parity_group if p.copies == "parity" else None,
        "psguard_phases_s": phases(ours),
        "baseline_phases_s": phases(theirs),
        "kill_step": p.kill_at,
        "memory_every": p.memory_every,
        "durable_every": p.durable_every,
        "num_ps": p.num_ps,
        "table": f"{p.vocab_size}x{p.embedding_dim}",
        "runs": len(xs),
        "load_average": list(os.getloadavg()),
    }


def compare_no_copies(ours: list[dict[str, Any]], no_copies: list[dict[str, Any]], xs: list[float]) -> dict[str, Any]:
    """With peer copies on and ``fault="node"``: what the copies buy (time, lost steps) and cost (goodput, the
    holder's memory), against the same fault with copies off."""
    off_s = median([float(d["recovery_s"]) for d in no_copies])
    result: dict[str, Any] = dict(
        recovery_vs_no_copies_ratio=median(xs) / off_s,
        psguard_no_copies_recovery_s=off_s,
        psguard_no_copies_lost_steps=_med(no_copies, "lost_steps"),
        psguard_no_copies_restored_from=[d["restored_from"] for d in no_copies],
        # Steps per second from the settle point to the fault, captures included, copies on over
        # off: what keeping the copies current costs training.
        goodput_copies_on_vs_off=_med(ours, "steps_per_s") / _med(no_copies, "steps_per_s"),
        goodput_steps_per_s_runs={"on": [d["steps_per_s"] for d in ours], "off": [d["steps_per_s"] for d in no_copies]},
        # The first whole copies' time at the settle point, copies on minus off (standbys warm in both).
        first_copy_s=_med(ours, "settle_wait_s") - _med(no_copies, "settle_wait_s"),
    )
    # What holding a copy costs its holder: its RSS just before the kill, copies on minus off (the same job,
    # the same step, nothing being written: the libraries the durable writer loads are in both), over the shards
    # its copies cover (an owner's for a full copy, the group's for a parity block: the bound is then 1.1/K).
    pairs = [
        (t, (grown_on - grown_off) / c)
        for d_on, d_off in zip(ours, no_copies, strict=False)
        for t, c in (d_on.get("copies_cover_bytes") or {}).items()
        if c
        and t != "ps:0"
        and (grown_on := (d_on.get("ps_agent_steady_growth_bytes") or {}).get(t)) is not None
        and (grown_off := (d_off.get("ps_agent_steady_growth_bytes") or {}).get(t)) is not None
    ]
    if pairs:
        result["peer_rss_vs_no_copies_ratio"] = median([r for _, r in pairs])
    return result


def compare_ps_kill(ps_kill: list[dict[str, Any]], xs: list[float]) -> dict[str, Any]:
    """With ``fault="chief"``: psguard's recovery from its trainer's kill (``xs``) over its recovery from a PS
    kill of the same job (``ps_kill``, the runs beside them): the issue's "a trainer failure as fast as a PS
    failure" as one figure."""
    ps_s = [float(d["recovery_s"]) for d in ps_kill]
    return {
        "recovery_vs_ps_kill_ratio": median(xs) / median(ps_s),
        "psguard_ps_kill_recovery_s": median(ps_s),
        "psguard_ps_kill_recovery_s_runs": ps_s,
        "psguard_ps_kill_lost_steps": _med(ps_kill, "lost_steps"),
        "psguard_ps_kill_phases_s": {
            k: round(median([d["phases"][k] for d in ps_kill]), 3) for k in ps_kill[0]["phases"]
        },
    }
