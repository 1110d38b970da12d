"""The TF cluster the ``chief`` fixture (tests/cluster/conftest.py) starts once per session: what it hands a test."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


def partitioners() -> dict[str, Any]:
    """One variable partitioner per name a test may ask the shared chief for (TF imported only when called)."""
    import tensorflow as tf

    p = tf.distribute.experimental.partitioners
    return {
        "fixed2": p.FixedShardsPartitioner(2),
        "fixed3": p.FixedShardsPartitioner(3),
        "min": p.MinSizePartitioner(min_shard_bytes=4 << 10, max_shards=4),
        "max": p.MaxSizePartitioner(max_shard_bytes=12 << 10),
        "none": None,
    }


@dataclass
class Chief:
    cluster: Any
    strategies: dict[str, Any] = field(default_factory=dict)
    coordinators: dict[str, Any] = field(default_factory=dict)
    coordinator: Any = None
