"""The dtype names a manifest and a spool capture may record, and nothing else."""

from __future__ import annotations

import numpy as np
import pytest

from psguard.codec.dtypes import DTYPE_NAMES, STRING, dtype_from_name, dtype_name, itemsize_of, logical_nbytes
from tests.support.tensors import every_dtype


@pytest.mark.parametrize("name", sorted(DTYPE_NAMES))
def test_every_allowed_name_round_trips(name: str) -> None:
    dtype = dtype_from_name(name)
    assert dtype_name(dtype) == name
    if name != STRING:
        assert itemsize_of(name) == dtype.itemsize


@pytest.mark.parametrize("case", sorted(every_dtype()))
def test_every_array_psguard_saves_has_an_allowed_name(case: str) -> None:
    assert dtype_name(every_dtype()[case].dtype) in DTYPE_NAMES


@pytest.mark.parametrize("name", ["object", "O", "datetime64", "float128", "<f4", "x" * 500])
def test_any_other_name_is_refused(name: str) -> None:
    with pytest.raises(ValueError, match="unknown dtype"):
        dtype_from_name(name)


def test_logical_size() -> None:
    assert logical_nbytes("bfloat16", (3, 4)) == 24
    assert logical_nbytes("int64", ()) == 8

    class Sized:
        size = 11

    assert logical_nbytes(STRING, (2,), [Sized(), Sized()]) == 22
    assert itemsize_of(STRING) == 8
    assert dtype_from_name(STRING) == np.dtype(object)
