"""``copy_checkpoint``: a checkpoint and its chain carried to another store, verified there, and copied once."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from psguard.errors import CorruptCheckpointError
from psguard.store import Store
from psguard.store.copy import copy_checkpoint
from psguard.tensors import Full, Rows


def test_a_delta_arrives_with_its_chain_bit_exact_and_a_second_copy_writes_nothing(tmp_path: Path) -> None:
    table = np.arange(40, dtype=np.float32).reshape(10, 4)
    src, dst = Store.open(str(tmp_path / "src")), Store.open(str(tmp_path / "dst"))
    try:
        base = src.save(1, {"table": Full(table.copy())})
        table[[2, 7]] = -1.0
        delta = src.save(2, {"table": Rows(np.array([2, 7]), table[[2, 7]].copy(), table.shape)}, parent=base.id)

        report = copy_checkpoint(src, dst, delta.id)
        assert report.chain == (base.id, delta.id) and report.manifests_copied == 2
        assert report.chunks_copied > 0 and report.bytes_copied > 0 and report.verified.ok
        assert report.to_json()["chain"] == [base.id, delta.id]
        np.testing.assert_array_equal(dst.load(delta.id)["table"], table)

        again = copy_checkpoint(src, dst, delta.id)
        assert (again.manifests_copied, again.chunks_copied, again.bytes_copied) == (0, 0, 0)
    finally:
        src.close()
        dst.close()


def test_a_checkpoint_the_source_lacks_is_not_copied(tmp_path: Path) -> None:
    src, dst = Store.open(str(tmp_path / "src")), Store.open(str(tmp_path / "dst"))
    try:
        with pytest.raises(CorruptCheckpointError, match="000000000001-deadbeef"):
            copy_checkpoint(src, dst, "000000000001-deadbeef")
        assert dst.checkpoint_ids() == [] and dst.backend.keys("") == []
    finally:
        src.close()
        dst.close()
