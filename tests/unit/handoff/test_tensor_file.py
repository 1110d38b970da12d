"""The tensor files a PS's capture leaves for its agent are read only as regular files, never waited on."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from psguard.errors import CorruptCheckpointError
from psguard.handoff.tensor_bundle import bundle_files, read_bundle, write_bundle
from psguard.handoff.tensor_file import read_tensor_file
from tests.support.fifos import Fifos


def test_a_fifo_or_a_link_in_place_of_a_part_file_is_refused_at_once(tmp_path: Path, fifos: Fifos) -> None:
    fifos.put(tmp_path / "0.rows")
    with pytest.raises(CorruptCheckpointError, match=r"ps:0: the tensor file: 0\.rows is a FIFO"):
        fifos.within(lambda: read_tensor_file(tmp_path / "0.rows", what="ps:0"))
    value = np.arange(12, dtype=np.float32).reshape(3, 4)
    write_bundle(tmp_path / "b", value)
    assert np.array_equal(read_bundle(tmp_path / "b", dtype="float32", shape=(3, 4)), value)
    index, data = bundle_files(tmp_path / "b")
    data.rename(tmp_path / "elsewhere")
    data.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(CorruptCheckpointError, match=r"bundle data file: .* is a symbolic link"):
        read_bundle(tmp_path / "b", dtype="float32", shape=(3, 4))
    data.unlink()
    (tmp_path / "elsewhere").rename(data)
    fifos.put(index)
    with pytest.raises(CorruptCheckpointError, match=r"bundle index: .* is a FIFO"):
        fifos.within(lambda: read_bundle(tmp_path / "b", dtype="float32", shape=(3, 4)))
