"""TensorBoard's own reading of a log folder, for tests of what psguard writes there."""

from __future__ import annotations

from pathlib import Path

import tensorflow as tf
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator


def scalars(logdir: Path) -> dict[str, dict[int, float]]:
    """Every scalar in the run folder ``logdir`` as TensorBoard reads it: tag -> step -> value."""
    events = EventAccumulator(str(logdir), size_guidance={"tensors": 0})
    events.Reload()
    return {
        tag: {e.step: float(tf.make_ndarray(e.tensor_proto)) for e in events.Tensors(tag)}
        for tag in events.Tags()["tensors"]
    }
