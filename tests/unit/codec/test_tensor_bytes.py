"""A tensor's bytes as the spool, the tier files and the store's chunks all hold them."""

from __future__ import annotations

import numpy as np
import pytest

from psguard.codec.tensor_bytes import as_le_bytes, byte_view, crc32c, deserialize_strings, serialize_strings
from tests.support.tensors import every_dtype


def test_strings_round_trip_in_their_shape() -> None:
    value = every_dtype()["strings"]
    blob = serialize_strings(value)
    assert blob[:8] == (0).to_bytes(8, "little") and blob[8:16] == (5000).to_bytes(8, "little")
    back = deserialize_strings(memoryview(blob), value.shape)
    assert back.shape == value.shape and back.tolist() == value.tolist()


def test_str_elements_are_stored_as_utf8() -> None:
    assert deserialize_strings(serialize_strings(np.array(["é", "ab"], dtype=object)), (2,)).tolist() == [
        "é".encode(),
        b"ab",
    ]


BLOB = serialize_strings(np.array([b"ab", b"c"], dtype=object))


@pytest.mark.parametrize(
    ("blob", "why"), [(BLOB[:-1], "does not match"), (BLOB + b"x", "does not match"), (BLOB[:15], "shorter")]
)
def test_a_blob_that_disagrees_with_its_length_table_is_refused(blob: bytes, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        deserialize_strings(blob, (2,))


@pytest.mark.parametrize("case", ["f32", "fortran", "scalar", "empty", "int16", "bf16"])
def test_le_bytes_are_c_order_little_endian(case: str) -> None:
    value = every_dtype()[case]
    expected = np.ascontiguousarray(value).astype(value.dtype.newbyteorder("<")).tobytes()
    assert bytes(as_le_bytes(value)) == expected
    assert bytes(as_le_bytes(value.astype(value.dtype.newbyteorder(">")))) == expected


def test_byte_view_is_the_arrays_own_memory() -> None:
    value = np.zeros(4, np.int32)
    byte_view(value)[4:8] = (7).to_bytes(4, "little")
    assert value.tolist() == [0, 7, 0, 0]


def test_crc32c_is_castagnoli() -> None:
    assert crc32c(b"123456789") == 0xE3069283  # the standard check value of CRC-32C
    assert crc32c(memoryview(b"123456789")) == 0xE3069283
