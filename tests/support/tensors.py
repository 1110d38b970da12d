"""Tensors for hand-off tests: one of every dtype psguard carries (with the edge values that break a careless
copy), and a TensorFlow bundle read back the way a PS reads it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from psguard.handoff.tensor_bundle import BUNDLE_KEY


def every_dtype() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3)
    f32 = rng.standard_normal((64, 4)).astype(np.float32)
    f32[0, 0] = -0.0
    f32.view(np.uint32)[0, 1] = 0x7FC00123  # NaN with a payload
    out: dict[str, np.ndarray] = {
        "f32": f32,
        "f16": rng.standard_normal((8, 3)).astype(np.float16),
        "f64": rng.standard_normal((5, 2)),
        "bf16": rng.standard_normal((40, 4)).astype(ml_dtypes.bfloat16),
        "f8": rng.standard_normal((6, 2)).astype(ml_dtypes.float8_e4m3fn),
        "f8e5": rng.standard_normal((6,)).astype(ml_dtypes.float8_e5m2),
        "c64": (rng.standard_normal(4) + 1j * rng.standard_normal(4)).astype(np.complex64),
        "c128": rng.standard_normal(3) + 1j,
        "bool": rng.random((5, 5)) > 0.5,
        "strings": np.array([[b"", b"a" * 5000], [b"\x00\xff", "é".encode()]], dtype=object),
        "scalar": np.array(42, dtype=np.int64),
        "empty": np.zeros((0, 4), np.float32),
        "fortran": np.asfortranarray(rng.standard_normal((4, 3)).astype(np.float32)),
    }
    for dt in ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"):
        info = np.iinfo(dt)
        out[dt] = rng.integers(info.min, info.max, size=(7, 3), dtype=dt, endpoint=True)
    return out


def lazy_tf() -> Any:
    """TensorFlow, imported on first use: collecting these tests must not load it."""
    import tensorflow as tf

    return tf


def restore_bundle(prefix: str | Path, dtype: Any) -> Any:
    """The bundle at ``prefix`` read as the PS reads it (``RestoreV2``)."""
    tf = lazy_tf()
    return tf.raw_ops.RestoreV2(
        prefix=str(prefix), tensor_names=[BUNDLE_KEY], shape_and_slices=[""], dtypes=[tf.as_dtype(dtype)]
    )[0]
