"""Which checkpoints to keep: one pure function, shared by ``psguard gc``, the agent and retention policies.

The function only chooses; the store turns the choice into deletions and adds every parent a kept delta
needs, so a retention rule can never break a chain.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class Candidate:
    """What retention needs to know of a committed checkpoint."""

    id: str
    step: int
    committed_at: float  # seconds since the epoch
    metrics: Mapping[str, float]


def select_kept(
    candidates: Sequence[Candidate],
    *,
    keep_last: int | None = None,
    keep_every_hours: float | None = None,
    keep_best: int | None = None,
    metric: str | None = None,
    mode: Literal["min", "max"] = "min",
) -> set[str]:
    """The ids to keep (rules validated by :class:`psguard.policy.engine.Retention` or ``Store.gc``); the newest
    always. ``keep_every_hours`` keeps the oldest checkpoint of each window of that many hours; ``keep_best`` the N
    best by ``metric`` among those that reported it."""
    if not candidates:
        return set()
    ordered = sorted(candidates, key=lambda c: (c.step, c.committed_at))
    kept = {ordered[-1].id}
    if keep_last:
        kept.update(c.id for c in ordered[-keep_last:])
    if keep_every_hours is not None:
        window = keep_every_hours * 3600.0
        seen: set[int] = set()
        for c in sorted(candidates, key=lambda c: c.committed_at):
            bucket = math.floor(c.committed_at / window)
            if bucket not in seen:
                seen.add(bucket)
                kept.add(c.id)
    if keep_best is not None and metric is not None:
        scored = [c for c in candidates if metric in c.metrics]
        scored.sort(key=lambda c: c.metrics[metric], reverse=(mode == "max"))
        kept.update(c.id for c in scored[:keep_best])
    return kept
