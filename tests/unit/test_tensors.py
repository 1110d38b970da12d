"""Update algebra: merging two updates equals applying them in order, for every combination."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from psguard.tensors import Full, Rows, Same, TensorUpdate, apply_update, merge_updates


def make(kind: str, base: np.ndarray, rng: np.random.Generator) -> TensorUpdate:
    if kind == "same":
        return Same(base.shape, base.dtype)
    if kind == "full":
        return Full(rng.standard_normal(base.shape).astype(base.dtype))
    ids = np.unique(rng.integers(0, base.shape[0], size=7))
    return Rows(ids, rng.standard_normal((len(ids), *base.shape[1:])).astype(base.dtype), base.shape)


@pytest.mark.parametrize(("a", "b"), list(itertools.product(["same", "full", "rows"], repeat=2)))
def test_merge_equals_sequential_application(a: str, b: str) -> None:
    rng = np.random.default_rng(hash((a, b)) % 2**32)
    base = rng.standard_normal((20, 3)).astype(np.float32)
    first, second = make(a, base, rng), make(b, base, rng)
    sequential = apply_update(apply_update(base.copy(), first), second)
    merged = apply_update(base.copy(), merge_updates(first, second))
    assert sequential.tobytes() == merged.tobytes()


def test_rows_validate_their_shape() -> None:
    with pytest.raises(ValueError):
        Rows(np.array([1, 2]), np.zeros((3, 4)), (10, 4))
    with pytest.raises(ValueError):
        Rows(np.array([1]), np.zeros((1, 5)), (10, 4))
