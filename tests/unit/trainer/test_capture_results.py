"""What a capture's per-shard answers become: one update per tensor, an alias's cut from its owner's."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from psguard.tensors import Full, Rows, Same
from psguard.trainer.capture_results import assemble, capture_stats
from psguard.trainer.variables import Shard, TensorInfo

DIM = 2


@dataclass
class Answer:
    """A value as the capture function returns it (anything with ``numpy()``)."""

    value: Any

    def numpy(self) -> Any:
        return self.value


@dataclass
class Tracked:
    info: TensorInfo
    by_row: bool = True
    spill: bool = False


def table(name: str = "emb") -> TensorInfo:
    shards = (Shard(var=None, offset=0, rows=4), Shard(var=None, offset=4, rows=4))
    return TensorInfo(name, (8, DIM), np.dtype(np.float32), shards)


def whole(first: float) -> list[Answer]:
    """A shard sent whole: (sent all, its rows flattened)."""
    return [Answer(np.bool_(True)), Answer(np.arange(first, first + 4 * DIM, dtype=np.float32))]


def changed(ids: list[int]) -> list[Answer]:
    """A shard that sent only rows ``ids`` (their values: the row id)."""
    rows = np.repeat(np.array(ids, np.float32)[:, None], DIM, axis=1)
    return [Answer(np.bool_(False)), Answer(np.zeros(0, np.float32)), Answer(np.array(ids, np.int64)), Answer(rows)]


def test_a_tensor_some_of_whose_shards_went_whole_is_rows_covering_them_and_an_alias_is_cut_from_it() -> None:
    info = table()
    alias = TensorInfo("alias", (4, DIM), info.dtype, info.shards[1:], alias_of="emb", alias_offset=4)
    updates, nbytes = assemble([Tracked(info)], [[whole(0), changed([1])]], {"emb": info, "alias": alias})
    emb = updates["emb"]
    assert isinstance(emb, Rows) and emb.ids.tolist() == [0, 1, 2, 3, 5]
    assert np.array_equal(emb.values[:4], np.arange(8, dtype=np.float32).reshape(4, DIM))
    assert emb.values[4].tolist() == [1.0, 1.0]  # shard 1's row 1 is the tensor's row 5
    cut = updates["alias"]
    assert isinstance(cut, Rows) and cut.ids.tolist() == [1] and cut.shape == (4, DIM)
    assert nbytes == 1 + 8 * 4 + 1 + 0 + 8 + 2 * 4
    stats = capture_stats({"emb": info, "alias": alias}, updates, 0.5, nbytes)
    assert stats.rows == {"emb": 5} and stats.logical_bytes == 8 * DIM * 4  # the alias is its owner's bytes


def test_every_shard_whole_is_a_full_update_and_no_change_is_same() -> None:
    info = table()
    updates, _ = assemble([Tracked(info)], [[whole(0), whole(8)]], {"emb": info})
    assert isinstance(updates["emb"], Full) and np.array_equal(updates["emb"].value.ravel(), np.arange(16))
    updates, _ = assemble([Tracked(info)], [[changed([]), changed([])]], {"emb": info})
    assert isinstance(updates["emb"], Same)
    spilled, nbytes = assemble([Tracked(info, spill=True)], [[whole(0), whole(8)]], {"emb": info})
    assert spilled == {} and nbytes == 0  # its shards are in files on their PS nodes: not here
