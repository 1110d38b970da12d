"""The durable log's format version 2: a tensor stored in parts that different processes wrote, committed once.

Each "PS" writes its shard's chunks with ``Store.write_part`` (threads, or real processes where it matters) and
the coordinator commits one manifest with ``begin_save``/``commit``. Everything is read back bit-exact against
a numpy reference, on real local stores (and once on S3, SeaweedFS).
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import psguard.store.lease as lease_module
from psguard.errors import ConfigError, CorruptCheckpointError, NoCheckpointError, SaveError, UnsupportedFormatError
from psguard.storage.metered import MeteredBackend
from psguard.store import SaveTransaction, Store
from psguard.store.manifest import CHUNK_PREFIX, LOCK_PREFIX, chunk_key, manifest_key, new_checkpoint_id
from psguard.tensors import Full, Rows, Same, TensorUpdate
from tests.support.paths import ROOT

CHUNK = 512  # small chunks: every part spans several, so range reads cross chunk and part boundaries


def bits(a: np.ndarray) -> bytes:
    """An array's bytes, shape and dtype, so NaN payloads, -0.0 and bfloat16 compare exactly."""
    return np.ascontiguousarray(a).tobytes() + str(a.shape).encode() + a.dtype.name.encode()


def open_store(url: str, **kwargs: Any) -> Store:
    kwargs.setdefault("chunk_bytes", CHUNK)
    return Store.open(url, **kwargs)


@pytest.fixture
def url(tmp_path: Path) -> str:
    return str(tmp_path / "store")


@pytest.fixture
def stores(url: str) -> Iterator[tuple[Store, list[Store]]]:
    """The coordinator's store and two PS agents' stores: separate instances, as separate processes have."""
    coordinator = open_store(url, chunk_grace=0)
    ps = [open_store(url) for _ in range(2)]
    yield coordinator, ps
    for s in (coordinator, *ps):
        s.close()


Shard = tuple[int, TensorUpdate | np.ndarray]  # (offset, the shard's update)


def commit_parts(
    coordinator: Store,
    writers: Sequence[Store],
    step: int,
    sharded: Mapping[str, tuple[tuple[int, ...], Sequence[Shard]]],
    *,
    parent: str | None = None,
    tensors: Mapping[str, TensorUpdate | np.ndarray] | None = None,
) -> str:
    """One transaction: every shard written by a "PS" in its own thread, then one commit."""
    with coordinator.begin_save(step, parent=parent) as tx:
        jobs = [(name, shape, off, upd) for name, (shape, shards) in sharded.items() for off, upd in shards]
        with ThreadPoolExecutor(max_workers=len(jobs), thread_name_prefix="test-ps") as pool:
            futures = [
                (
                    name,
                    pool.submit(
                        writers[i % len(writers)].write_part, name, upd, shape=shape, offset=off, dedup_against=parent
                    ),
                )
                for i, (name, shape, off, upd) in enumerate(jobs)
            ]
            parts: dict[str, list[dict[str, Any]]] = {}
            for name, f in futures:
                parts.setdefault(name, []).append(f.result())
        for plist in parts.values():
            plist.reverse()  # the coordinator gets parts in any order
        return tx.commit(tensors or {}, parts=parts, metadata={"parts": True}).id


def on_disk_version(url: str, checkpoint_id: str) -> int:
    return int(json.loads((Path(url) / manifest_key(checkpoint_id)).read_bytes())["format_version"])


def check_ranges(store: Store, cid: str, name: str, want: np.ndarray, ranges: Sequence[tuple[int, int]]) -> None:
    for start, stop in ranges:
        got = store.read_rows(cid, name, start, stop)
        assert bits(got) == bits(want[start:stop]), (cid, name, start, stop)


def table(rng: np.random.Generator, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    if np.dtype(dtype).kind in "iu":
        return rng.integers(-(2**40), 2**40, size=shape).astype(dtype)
    return rng.standard_normal(shape).astype(dtype)


# ----------------------------------------------------------------------------------------------- round trips
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.int64], ids=["float32", "bfloat16", "int64"])
@pytest.mark.parametrize("row_shape", [(), (3, 4)], ids=["1-D", "2-D rows"])
def test_two_ps_writers_commit_once_and_read_back_bit_exact(
    stores: tuple[Store, list[Store]], url: str, dtype: Any, row_shape: tuple[int, ...]
) -> None:
    coordinator, ps = stores
    rng = np.random.default_rng(1)
    shape = (250, *row_shape)
    emb = table(rng, shape, dtype)
    dense = rng.standard_normal((8, 2)).astype(np.float32)
    base = commit_parts(
        coordinator, ps, 0, {"emb": (shape, [(0, emb[:130]), (130, Full(emb[130:]))])}, tensors={"dense": dense}
    )
    assert on_disk_version(url, base) == 2
    with open_store(url) as reader:  # a fresh reader: nothing from the writers' caches
        got = reader.load(base)
        assert bits(got["emb"]) == bits(emb) and bits(got["dense"]) == bits(dense)
        check_ranges(reader, base, "emb", emb, [(0, 250), (0, 1), (129, 131), (130, 250), (7, 200), (249, 250)])
        assert reader.verify(base).ok
        info = reader.manifest(base)
        assert info.kind == "full" and [(p.offset, p.rows) for p in info.tensors["emb"].parts] == [(0, 130), (130, 120)]
        assert info.stats["logical_bytes"] == emb.nbytes + dense.nbytes
        assert info.stats["bytes_written"] >= emb.nbytes  # the PS agents' bytes are counted
    # a delta: each PS sends the rows it changed, ids relative to its shard
    want = emb.copy()
    ids0, ids1 = np.array([0, 5, 129]), np.array([0, 119])
    want[ids0] = table(rng, (3, *row_shape), dtype)
    want[130 + ids1] = table(rng, (2, *row_shape), dtype)
    delta = commit_parts(
        coordinator,
        ps,
        1,
        {
            "emb": (
                shape,
                [
                    (0, Rows(ids0, want[ids0], (130, *row_shape))),
                    (130, Rows(ids1, want[130 + ids1], (120, *row_shape))),
                ],
            )
        },
        parent=base,
        tensors={"dense": Same(dense.shape, dense.dtype)},
    )
    with open_store(url) as reader:
        assert bits(reader.load(delta)["emb"]) == bits(want)
        check_ranges(reader, delta, "emb", want, [(0, 250), (0, 6), (125, 135), (131, 250), (249, 250)])
        update = reader.updates(delta)[0]["emb"]
        assert isinstance(update, Rows)
        assert update.ids.tolist() == [0, 5, 129, 130, 249] and bits(update.values) == bits(want[update.ids])


WRITER = """
import json, sys
import numpy as np
from psguard.store import Store
from psguard.tensors import Rows
url, name, offset, shape = sys.argv[1], sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4])
npy, ids = sys.argv[5], sys.argv[6]
value = np.load(npy)
update = value if ids == "-" else Rows(np.load(ids), value, (json.loads(sys.argv[7]), *shape[1:]))
with Store.open(url, chunk_bytes=512) as store:
    print(json.dumps(store.write_part(name, update, shape=tuple(shape), offset=offset)))
"""


def write_part_in_process(
    tmp_path: Path,
    url: str,
    name: str,
    shape: tuple[int, ...],
    offset: int,
    value: np.ndarray,
    ids: np.ndarray | None = None,
    shard_rows: int = 0,
) -> subprocess.Popen[str]:
    """A PS agent as its own process: writes one part, prints its JSON."""
    npy = tmp_path / f"{name.replace('/', '_')}-{offset}-values.npy"
    np.save(npy, value)
    ids_arg = "-"
    if ids is not None:
        np.save(tmp_path / f"{name.replace('/', '_')}-{offset}-ids.npy", ids)
        ids_arg = str(tmp_path / f"{name.replace('/', '_')}-{offset}-ids.npy")
    args = [
        sys.executable,
        "-c",
        WRITER,
        url,
        name,
        str(offset),
        json.dumps(list(shape)),
        str(npy),
        ids_arg,
        str(shard_rows),
    ]
    return subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, text=True)


def part_of(proc: subprocess.Popen[str]) -> dict[str, Any]:
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    doc: dict[str, Any] = json.loads(out)
    return doc


def test_ps_writers_as_separate_processes(tmp_path: Path, url: str) -> None:
    rng = np.random.default_rng(2)
    emb = rng.standard_normal((300, 16)).astype(np.float32)
    with open_store(url) as coordinator, coordinator.begin_save(7) as tx:
        procs = [
            write_part_in_process(tmp_path, url, "model/emb", emb.shape, off, emb[off : off + n])
            for off, n in ((0, 100), (100, 200))
        ]
        parts = [part_of(p) for p in procs]
        info = tx.commit({"step": np.array(7, np.int64)}, parts={"model/emb": parts})
    with open_store(url) as reader:
        got = reader.load_latest()
        assert got.info.id == info.id and bits(got.tensors["model/emb"]) == bits(emb)
        check_ranges(reader, info.id, "model/emb", emb, [(50, 150), (99, 101), (0, 300)])


# ----------------------------------------------------------------------------------------------- chains
def test_a_chain_across_partitionings_materialises_like_numpy(stores: tuple[Store, list[Store]], url: str) -> None:
    """v1 full -> sharded delta (2 parts) -> sharded delta (3 parts, other offsets: restored onto 3 PS) ->
    sharded whole delta -> sharded full checkpoint -> v1 rows delta over it: every checkpoint, every range."""
    coordinator, ps = stores
    rng = np.random.default_rng(3)
    shape = (100, 5)
    ref = rng.standard_normal(shape).astype(np.float32)
    small = np.arange(6, dtype=np.int32)
    want: dict[str, np.ndarray] = {}

    c0 = coordinator.save(0, {"emb": ref.copy(), "small": small}).id
    assert on_disk_version(url, c0) == 1
    want[c0] = ref.copy()

    # 2 PS: [0, 60) changes rows 3, 59; [60, 100) is written whole
    ref[[3, 59]] = rng.standard_normal((2, 5)).astype(np.float32)
    ref[60:] = rng.standard_normal((40, 5)).astype(np.float32)
    c1 = commit_parts(
        coordinator,
        ps,
        1,
        {"emb": (shape, [(0, Rows(np.array([3, 59]), ref[[3, 59]], (60, 5))), (60, ref[60:].copy())])},
        parent=c0,
        tensors={"small": Same(small.shape, small.dtype)},
    )
    want[c1] = ref.copy()

    # 3 PS: [0, 30) rows 0 and 29, [30, 70) unchanged, [70, 100) rows 0 and 1 (logical 70, 71)
    ref[[0, 29]] = rng.standard_normal((2, 5)).astype(np.float32)
    ref[[70, 71]] = rng.standard_normal((2, 5)).astype(np.float32)
    c2 = commit_parts(
        coordinator,
        ps,
        2,
        {
            "emb": (
                shape,
                [
                    (0, Rows(np.array([0, 29]), ref[[0, 29]], (30, 5))),
                    (30, Same((40, 5), np.dtype(np.float32))),
                    (70, Rows(np.array([0, 1]), ref[[70, 71]], (30, 5))),
                ],
            )
        },
        parent=c1,
        tensors={"small": small + 1},
    )
    want[c2] = ref.copy()

    # every part full, in a delta: the chain is read from here on
    ref = rng.standard_normal(shape).astype(np.float32)
    c3 = commit_parts(
        coordinator,
        ps,
        3,
        {"emb": (shape, [(0, ref[:45].copy()), (45, ref[45:].copy())])},
        parent=c2,
        tensors={"small": Same(small.shape, small.dtype)},
    )
    want[c3] = ref.copy()

    # a full checkpoint of parts, then a v1 delta over it
    ref = rng.standard_normal(shape).astype(np.float32)
    c4 = commit_parts(
        coordinator, ps, 4, {"emb": (shape, [(0, ref[:10].copy()), (10, ref[10:].copy())])}, tensors={"small": small}
    )
    want[c4] = ref.copy()
    ref[[10, 11, 99]] = 7.0
    c5 = coordinator.save(
        5, {"emb": Rows(np.array([10, 11, 99]), ref[[10, 11, 99]], shape), "small": small}, parent=c4
    ).id
    want[c5] = ref.copy()
    assert [on_disk_version(url, c) for c in (c0, c1, c2, c3, c4, c5)] == [1, 2, 2, 2, 2, 1]

    ranges = [(0, 100), (0, 1), (0, 30), (29, 31), (59, 61), (55, 75), (69, 72), (99, 100), (13, 87), (40, 40)]
    with open_store(url) as reader:
        for cid, value in want.items():
            got = reader.load(cid)
            assert bits(got["emb"]) == bits(value), cid
            check_ranges(reader, cid, "emb", value, ranges)
            assert dict(reader.iter_tensors(cid)).keys() == {"emb", "small"}
            assert reader.verify(cid).ok
        assert bits(reader.load(c2)["small"]) == bits(small + 1)
        # what each checkpoint itself changed, over the logical tensor
        u1, u2, u3 = (reader.updates(c)[0]["emb"] for c in (c1, c2, c3))
        assert isinstance(u1, Rows) and u1.ids.tolist() == [3, 59, *range(60, 100)]
        assert bits(u1.values) == bits(want[c1][u1.ids])
        assert isinstance(u2, Rows) and u2.ids.tolist() == [0, 29, 70, 71]
        assert isinstance(u3, Full) and bits(u3.value) == bits(want[c3])
        # a follower applying every update in order ends where a full load does
        state = want[c0].copy()
        for cid in (c1, c2, c3):
            update = reader.updates(cid)[0]["emb"]
            if isinstance(update, Full):
                state = update.value.copy()
            elif isinstance(update, Rows):
                state[update.ids] = update.values
        assert bits(state) == bits(want[c3])


def test_updates_of_an_all_same_sharded_entry_is_same(stores: tuple[Store, list[Store]]) -> None:
    coordinator, ps = stores
    t = np.ones((10, 2), np.float32)
    base = coordinator.save(0, {"t": t}).id
    d = commit_parts(
        coordinator, ps, 1, {"t": ((10, 2), [(0, Same((4, 2), t.dtype)), (4, Same((6, 2), t.dtype))])}, parent=base
    )
    update = coordinator.updates(d)[0]["t"]
    assert isinstance(update, Same) and update.shape == (10, 2)
    assert bits(coordinator.load(d)["t"]) == bits(t)


def test_read_rows_reads_only_the_chunks_it_needs(url: str) -> None:
    rng = np.random.default_rng(4)
    emb = rng.standard_normal((4000, 8)).astype(np.float32)  # 32 bytes a row, 16 rows a chunk
    with open_store(url) as s:
        base = commit_parts(s, [s], 0, {"emb": (emb.shape, [(0, emb[:2000]), (2000, emb[2000:])])})
        ids = np.array([0, 1999])
        emb[2000 + ids] = 0.5
        delta = commit_parts(
            s,
            [s],
            1,
            {"emb": (emb.shape, [(0, Same((2000, 8), emb.dtype)), (2000, Rows(ids, emb[2000 + ids], (2000, 8)))])},
            parent=base,
        )
    read = [0]

    def count(n: int) -> None:
        read[0] += n

    with open_store(url) as reader:
        reader.chain(delta)  # manifests read (and cached) first: only chunk reads are counted
        reader.backend = MeteredBackend(reader.backend, count)
        got = reader.read_rows(delta, "emb", 1990, 2010)  # 20 rows across the parts' boundary
        assert bits(got) == bits(emb[1990:2010])
        # two or three 512-byte chunks of the base, the delta's ids and one values chunk: not 128 KB
        assert read[0] <= 3 * CHUNK + 16 + 64, read[0]
        read[0] = 0
        assert bits(reader.read_rows(delta, "emb", 96, 112)) == bits(emb[96:112])
        assert read[0] == CHUNK  # exactly the one chunk holding these rows; the delta's parts are elsewhere


# ----------------------------------------------------------------------------------------------- damage
def test_verify_and_reads_catch_a_flipped_byte_in_a_part_chunk(stores: tuple[Store, list[Store]], url: str) -> None:
    coordinator, ps = stores
    emb = np.arange(2000, dtype=np.float32).reshape(500, 4)
    cid = commit_parts(coordinator, ps, 0, {"emb": (emb.shape, [(0, emb[:250]), (250, emb[250:])])})
    part = coordinator.manifest(cid).tensors["emb"].parts[1]
    ref = part.chunks[2]
    path = Path(url) / chunk_key(ref.hash)
    data = bytearray(path.read_bytes())
    data[7] ^= 0x10
    path.write_bytes(data)
    with open_store(url) as reader:
        report = reader.verify(cid)
        assert not report.ok and [p.chunk for p in report.problems] == [ref.hash]
        with pytest.raises(CorruptCheckpointError) as e:
            reader.load(cid)
        assert e.value.chunk == ref.hash and cid in str(e.value)
        first = 250 + 2 * (CHUNK // 16)  # the damaged chunk's first row
        with pytest.raises(CorruptCheckpointError):
            reader.read_rows(cid, "emb", first + 3, first + 4)
        # rows elsewhere do not touch the damaged chunk
        assert bits(reader.read_rows(cid, "emb", 0, 260)) == bits(emb[:260])
        with pytest.raises(NoCheckpointError, match="no usable"):
            reader.load_latest()


def test_a_commit_refuses_a_part_whose_chunk_is_gone_and_commits_nothing(
    stores: tuple[Store, list[Store]], url: str
) -> None:
    coordinator, ps = stores
    emb = np.ones((64, 4), np.float32)
    with coordinator.begin_save(0) as tx:
        parts = [
            ps[0].write_part("emb", emb[:32], shape=emb.shape, offset=0),
            ps[1].write_part("emb", emb[32:] * 2, shape=emb.shape, offset=32),
        ]
        (Path(url) / chunk_key(parts[1]["chunks"][0]["hash"])).unlink()
        with pytest.raises(SaveError, match="is not in"):
            tx.commit({}, parts={"emb": parts})
    with coordinator.begin_save(0) as tx:
        parts = [
            ps[0].write_part("emb", emb[:32], shape=emb.shape, offset=0),
            ps[1].write_part("emb", emb[32:] * 3, shape=emb.shape, offset=32),
        ]
        (Path(url) / chunk_key(parts[1]["chunks"][0]["hash"])).write_bytes(b"short")
        with pytest.raises(SaveError, match="has 5 bytes"):
            tx.commit({}, parts={"emb": parts})
    assert coordinator.checkpoint_ids() == []
    assert coordinator.backend.keys(LOCK_PREFIX) == []  # the lease went with the failed commit


def test_commit_checks_parts_against_the_parent_and_the_tensors(stores: tuple[Store, list[Store]]) -> None:
    coordinator, ps = stores
    base = coordinator.save(0, {"emb": np.zeros((10, 2), np.float32), "b": np.zeros(3, np.float32)}).id
    with coordinator.begin_save(1, parent=base) as tx:
        wrong = [ps[0].write_part("emb", np.zeros((10, 3), np.float32), shape=(10, 3), offset=0)]
        with pytest.raises(ConfigError, match="parent"):
            tx.commit({"b": np.ones(3, np.float32)}, parts={"emb": wrong})
    with coordinator.begin_save(1, parent=base) as tx:
        part = ps[0].write_part("emb", np.ones((10, 2), np.float32), shape=(10, 2), offset=0)
        with pytest.raises(ConfigError, match="both whole and in parts"):
            tx.commit({"emb": np.ones((10, 2), np.float32), "b": np.ones(3, np.float32)}, parts={"emb": [part]})
    with coordinator.begin_save(1, parent=base) as tx, pytest.raises(ConfigError, match="every tensor of its parent"):
        tx.commit({}, parts={"emb": [part]})
    with coordinator.begin_save(1, parent=base) as tx, pytest.raises(ConfigError, match="dtype and logical shape"):
        tx.commit(
            {"b": Same((3,), np.dtype(np.float32))},
            parts={"emb": [{k: v for k, v in part.items() if k != "dtype"}]},
        )
    with coordinator.begin_save(2) as tx:  # a full checkpoint: parts must be whole
        rows = ps[0].write_part(
            "emb", Rows(np.array([1]), np.ones((1, 2), np.float32), (10, 2)), shape=(10, 2), offset=0
        )
        with pytest.raises(CorruptCheckpointError, match="row updates in a full checkpoint"):
            tx.commit({}, parts={"emb": [rows]})
    assert coordinator.checkpoint_ids() == [base]


def test_write_part_refuses_shards_that_do_not_fit(stores: tuple[Store, list[Store]]) -> None:
    _, ps = stores
    w = ps[0]
    with pytest.raises(ConfigError, match="does not fit"):
        w.write_part("t", np.zeros((5, 2), np.float32), shape=(8, 2), offset=4)
    with pytest.raises(ConfigError, match="does not fit"):
        w.write_part("t", np.zeros((5, 3), np.float32), shape=(8, 2), offset=0)
    with pytest.raises(ConfigError, match="does not fit"):
        w.write_part("t", np.zeros((5, 2), np.float32), shape=(8, 2), offset=-1)
    with pytest.raises(ConfigError, match="rank"):
        w.write_part("t", np.array(1.0, np.float32), shape=(), offset=0)
    with pytest.raises(ConfigError, match="string"):
        w.write_part("t", np.array([b"a", b"b"], dtype=object), shape=(2,), offset=0)
    with pytest.raises(ConfigError, match=r"within the shard's \[0, 5\)"):
        w.write_part("t", Rows(np.array([5]), np.zeros((1, 2), np.float32), (5, 2)), shape=(8, 2), offset=0)
    with pytest.raises(ConfigError, match="sorted"):
        w.write_part("t", Rows(np.array([2, 1]), np.zeros((2, 2), np.float32), (5, 2)), shape=(8, 2), offset=0)


def test_a_transaction_left_without_commit_aborts(stores: tuple[Store, list[Store]], url: str) -> None:
    coordinator, ps = stores
    with coordinator.begin_save(3) as tx:
        assert isinstance(tx, SaveTransaction) and tx.checkpoint_id.startswith("000000000003-")
        assert [k for k in coordinator.backend.keys(LOCK_PREFIX) if tx.checkpoint_id in k]
        ps[0].write_part("t", np.ones((4, 2), np.float32), shape=(4, 2), offset=0)
        with pytest.raises(ConfigError, match="already open"):  # not a deadlock on its own lock
            coordinator.save(3, {"t": np.ones(1)})
    assert coordinator.checkpoint_ids() == [] and coordinator.backend.keys(LOCK_PREFIX) == []
    with pytest.raises(ConfigError, match="already committed or aborted"):
        tx.commit({"t": np.ones(1)})
    assert coordinator.save(4, {"t": np.ones((4, 2), np.float32)}).step == 4  # the save lock was released


# ----------------------------------------------------------------------------------------------- gc
def part_hashes(store: Store, cid: str) -> set[str]:
    return {r.hash for t in store.manifest(cid).tensors.values() for p in t.parts for r in p.refs()}


def chunk_hashes(url: str) -> set[str]:
    return {p.name for p in (Path(url) / CHUNK_PREFIX).rglob("*") if p.is_file()}


def test_gc_and_retention_keep_part_chunks_and_delete_them_once_unreferenced(
    stores: tuple[Store, list[Store]], url: str
) -> None:
    coordinator, ps = stores
    rng = np.random.default_rng(5)
    emb = rng.standard_normal((200, 4)).astype(np.float32)
    c0 = commit_parts(coordinator, ps, 0, {"emb": (emb.shape, [(0, emb[:100]), (100, emb[100:])])})
    emb[[1, 150]] = 9.0
    c1 = commit_parts(
        coordinator,
        ps,
        1,
        {
            "emb": (
                emb.shape,
                [(0, Rows(np.array([1]), emb[[1]], (100, 4))), (100, Rows(np.array([50]), emb[[150]], (100, 4)))],
            )
        },
        parent=c0,
    )
    kept_parts = part_hashes(coordinator, c0) | part_hashes(coordinator, c1)
    report = coordinator.gc(keep_last=1)
    assert set(report.kept) == {c0, c1} and report.deleted_chunks == 0  # c1 needs its parent's parts
    assert kept_parts <= chunk_hashes(url)
    assert bits(coordinator.load(c1)["emb"]) == bits(emb)
    # a new full checkpoint, written whole by this process: the parts are no longer referenced
    c2 = coordinator.save(2, {"emb": emb * 2}).id
    report = coordinator.retain(keep_last=1, keep_every_hours=None)
    assert report is not None and set(report.deleted_checkpoints) == {c0, c1}
    gone = kept_parts - {r.hash for r in coordinator.manifest(c2).refs()}
    assert gone and report.deleted_chunks >= len(gone)
    assert not gone & chunk_hashes(url)
    assert coordinator.verify(c2).ok


def test_gc_during_an_open_transaction_keeps_the_parts_written_under_it(
    tmp_path: Path, url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A coordinator with a 2 s lease (standing for a long save) whose wall clock is an hour behind; a PS
    agent in another process writes its part; the transaction stays open for over a lease TTL; a gc that
    spares no young chunk (chunk_grace=0) runs meanwhile. The lease, refreshed, keeps every part chunk; after
    an abort, the same gc deletes them: it was the lease."""
    ttl = 2.0
    rng = np.random.default_rng(6)
    emb = rng.standard_normal((256, 8)).astype(np.float32)
    with open_store(url) as setup:
        old = setup.save(0, {"emb": np.zeros_like(emb)}).id
    monkeypatch.setattr(lease_module, "time", _SkewedClock())
    for commit in (True, False):
        with open_store(url, lock_ttl=ttl) as coordinator, open_store(url, chunk_grace=0) as gc_store:
            tx = coordinator.begin_save(1)
            try:
                procs = [
                    write_part_in_process(tmp_path, url, "emb", emb.shape, off, emb[off : off + 128] + commit)
                    for off in (0, 128)
                ]
                parts = [part_of(p) for p in procs]
                written = {c["hash"] for p in parts for c in p["chunks"]}
                assert written <= chunk_hashes(url)
                time.sleep(1.5 * ttl)  # the lease lives only if refreshed
                report = gc_store.gc(keep_last=1)
                assert report.chunks_deferred and report.deleted_chunks == 0, report
                assert written <= chunk_hashes(url)
                if commit:
                    info = tx.commit({}, parts={"emb": parts})
            finally:
                tx.abort()
            if commit:
                assert bits(gc_store.load(info.id)["emb"]) == bits(emb + 1)
                report = gc_store.gc(keep_last=1)
                assert written <= chunk_hashes(url) and gc_store.verify(info.id).ok
            else:
                report = gc_store.gc(keep_last=1)  # no lease any more: the aborted parts' chunks go
                assert not report.chunks_deferred and report.deleted_chunks >= len(written)
                assert not written & chunk_hashes(url)
    assert old not in chunk_hashes(url)


class _SkewedClock:
    """The coordinator's wall clock an hour behind (as lease.py sees ``time``); monotonic time is real."""

    def time(self) -> float:
        return time.time() - 3600.0

    def monotonic(self) -> float:
        return time.monotonic()

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)


# ----------------------------------------------------------------------------------------------- compaction
def test_compact_a_v2_chain(stores: tuple[Store, list[Store]], url: str) -> None:
    coordinator, ps = stores
    rng = np.random.default_rng(7)
    emb = rng.standard_normal((120, 3)).astype(ml_dtypes.bfloat16)
    c0 = commit_parts(coordinator, ps, 0, {"emb": (emb.shape, [(0, emb[:60]), (60, emb[60:])])})
    emb[[0, 119]] = ml_dtypes.bfloat16(1.5)
    c1 = commit_parts(
        coordinator,
        ps,
        1,
        {
            "emb": (
                emb.shape,
                [
                    (0, Rows(np.array([0]), emb[[0]], (40, 3))),
                    (40, Same((40, 3), emb.dtype)),
                    (80, Rows(np.array([39]), emb[[119]], (40, 3))),
                ],
            )
        },
        parent=c0,
    )
    # One part (in the newest partitioning: 3 x 40 rows) materialised at a time, each once, while the writer's
    # chunks of 7 rows straddle the parts' edges.
    reads: list[tuple[int, int]] = []
    read_rows = coordinator._reader.read_chain_rows

    def spy(chain: Any, name: str, start: int, stop: int, verify_hash: bool) -> np.ndarray:
        reads.append((start, stop))
        return read_rows(chain, name, start, stop, verify_hash)

    coordinator._reader.read_chain_rows = spy  # type: ignore[method-assign]
    coordinator.chunk_bytes = 7 * 3 * 2
    info = coordinator.compact(c1)
    assert reads == [(0, 40), (40, 80), (80, 120)]
    assert info is not None and info.kind == "full" and info.step == 1
    assert on_disk_version(url, info.id) == 1  # compaction writes the logical tensor whole
    with open_store(url) as reader:
        assert bits(reader.load(info.id)["emb"]) == bits(emb)
        assert reader.verify(info.id).ok
        report = reader.gc(keep_last=1)
    assert report.kept == (info.id,)


# ----------------------------------------------------------------------------------------------- hostile input
def put_manifest(url: str, body_tensors: dict[str, Any], *, kind: str = "full", version: int = 2) -> str:
    """A manifest written by hand (checksum right), so only its parts are wrong."""
    cid = new_checkpoint_id(5)
    parent = new_checkpoint_id(4) if kind == "delta" else None
    body = {
        "id": cid,
        "step": 5,
        "kind": kind,
        "parent": parent,
        "base": parent or cid,
        "chain_length": 1 if parent else 0,
        "committed_at": 1.0,
        "writer": "test",
        "tensors": body_tensors,
        "metadata": {},
        "metrics": {},
        "stats": {},
    }
    canon = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()
    doc = {
        "format": "psguard-manifest",
        "format_version": version,
        "sha256": hashlib.sha256(canon).hexdigest(),
        "body": body,
    }
    path = Path(url) / manifest_key(cid)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(json.dumps(doc).encode())
    return cid


def ref(size: int, seed: int = 0) -> dict[str, Any]:
    return {"hash": hashlib.sha256(bytes([seed])).hexdigest(), "size": size, "crc32c": 0}


def full_part(offset: int, rows: int, row_bytes: int = 8) -> dict[str, Any]:
    return {"offset": offset, "rows": rows, "encoding": "full", "chunks": [ref(rows * row_bytes)] if rows else []}


def sharded(parts: list[Any], shape: list[int] | None = None, dtype: str = "float32") -> dict[str, Any]:
    return {"dtype": dtype, "shape": shape if shape is not None else [100, 2], "encoding": "sharded", "parts": parts}


HOSTILE: dict[str, tuple[dict[str, Any], str]] = {
    "gap": (sharded([full_part(0, 40), full_part(50, 50)]), "leaves a gap"),
    "overlap": (sharded([full_part(0, 60), full_part(50, 50)]), "overlaps"),
    "unsorted offsets": (sharded([full_part(50, 50), full_part(0, 50)]), "expected 0"),
    "out of bounds": (sharded([full_part(0, 50), full_part(50, 60)]), "out of bounds"),
    "short cover": (sharded([full_part(0, 50), full_part(50, 40)]), "cover rows"),
    "absurd rows": (sharded([full_part(0, 10**18)], shape=[10**12, 10**6]), "out of bounds"),
    "absurd shape, a gap": (
        sharded([full_part(0, 1, 4 * 10**6), full_part(2, 10**12 - 2, 4 * 10**6)], shape=[10**12, 10**6]),
        "gap",
    ),
    "string dtype": (sharded([full_part(0, 100)], dtype="string"), "string"),
    "rank 0": (sharded([], shape=[]), "rank 0"),
    "negative offset": (sharded([{**full_part(0, 100), "offset": -1}]), "negative"),
    "chunks short of the rows": (sharded([{**full_part(0, 100), "chunks": [ref(792)]}]), "whole rows"),
    "chunk cutting a row": (sharded([{**full_part(0, 100), "chunks": [ref(396), ref(404)]}]), "whole rows"),
    "unknown part encoding": (sharded([{**full_part(0, 100), "encoding": "zstd"}]), "encoding"),
    "nested sharded": (sharded([{**full_part(0, 100), "encoding": "sharded"}]), "encoding"),
    "parts not a list": ({**sharded([]), "parts": {"0": 1}}, "parts has type"),
    "a hash as a path": (
        sharded([{**full_part(0, 100), "chunks": [{**ref(800), "hash": "../../etc/passwd"}]}]),
        "not a SHA-256",
    ),
    "more parts than rows": (sharded([full_part(0, 0)] * 5 + [full_part(0, 3)], shape=[3, 2]), "parts for 3 rows"),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_parts_are_refused_before_anything_is_allocated(url: str, case: str) -> None:
    entry, message = HOSTILE[case]
    cid = put_manifest(url, {"model/emb": entry})
    with open_store(url) as store:
        for read in (
            lambda: store.manifest(cid),
            lambda: store.load(cid),
            lambda: store.read_rows(cid, "model/emb", 0, 1),
        ):
            with pytest.raises(CorruptCheckpointError) as e:
                read()
            assert cid in str(e.value) and "model/emb" in str(e.value) and message in str(e.value), str(e.value)
            assert e.value.checkpoint == cid


def test_hostile_parts_in_a_delta_and_in_a_v1_manifest(url: str) -> None:
    rows_part = {
        "offset": 0,
        "rows": 100,
        "encoding": "rows",
        "count": 1,
        "segments": [{"count": 1, "ids": ref(8), "values": ref(8)}],
    }
    cases = [
        (put_manifest(url, {"t": sharded([rows_part])}, kind="full"), "row updates in a full checkpoint"),
        (put_manifest(url, {"t": sharded([{**full_part(0, 100), "encoding": "same"}])}), "'same' in a full"),
        (
            put_manifest(
                url,
                {"t": sharded([{**rows_part, "segments": [{"count": 1, "ids": ref(8), "values": ref(9)}]}])},
                kind="delta",
            ),
            "do not match",
        ),
        (
            put_manifest(
                url,
                {
                    "t": sharded(
                        [
                            {
                                **rows_part,
                                "rows": 100,
                                "segments": [{"count": 200, "ids": ref(1600), "values": ref(1600)}],
                            }
                        ]
                    )
                },
                kind="delta",
            ),
            "changes 200 rows",
        ),
        (put_manifest(url, {"t": sharded([full_part(0, 100)])}, version=1), "sharded in a format_version 1"),
    ]
    with open_store(url) as store:
        for cid, message in cases:
            with pytest.raises(CorruptCheckpointError, match=message):
                store.manifest(cid)
        newer = put_manifest(url, {"t": sharded([full_part(0, 100)])}, version=3)
        with pytest.raises(UnsupportedFormatError, match="upgrade"):
            store.manifest(newer)


def test_part_ids_out_of_range_are_caught_on_read(stores: tuple[Store, list[Store]], url: str) -> None:
    """Ids live in chunks: a part whose ids leave its rows (a bug in a PS agent) is refused when read, never
    scattered into the neighbouring PS's rows."""
    coordinator, ps = stores
    t = np.zeros((20, 2), np.float32)
    base = coordinator.save(0, {"t": t}).id
    with coordinator.begin_save(1, parent=base) as tx:
        good = ps[0].write_part("t", Rows(np.array([9]), np.ones((1, 2), np.float32), (10, 2)), shape=(20, 2), offset=0)
        other = ps[1].write_part("t", Same((10, 2), np.dtype(np.float32)), shape=(20, 2), offset=10)
        info = tx.commit({}, parts={"t": [good, other]})
    # the same chunks, now claimed by a 5-row part: id 9 is out of its range
    m = coordinator.manifest(info.id)
    body = m.body()
    body["tensors"]["t"]["parts"] = [
        {**body["tensors"]["t"]["parts"][0], "rows": 5},
        {"offset": 5, "rows": 15, "encoding": "same"},
    ]
    bad = put_manifest(url, body["tensors"], kind="delta")
    raw = json.loads((Path(url) / manifest_key(bad)).read_bytes())
    raw["body"]["parent"] = raw["body"]["base"] = base
    raw["sha256"] = hashlib.sha256(
        json.dumps(raw["body"], sort_keys=True, separators=(",", ":"), allow_nan=False).encode()
    ).hexdigest()
    (Path(url) / manifest_key(bad)).write_bytes(json.dumps(raw).encode())
    with open_store(url) as reader:
        for read in (lambda: reader.load(bad), lambda: reader.read_rows(bad, "t", 0, 20), lambda: reader.updates(bad)):
            with pytest.raises(CorruptCheckpointError, match="out of range"):
                read()
        assert bits(reader.load(info.id)["t"][9]) == bits(np.ones(2, np.float32))


# ----------------------------------------------------------------------------------------------- compatibility
def test_a_v1_store_is_read_unchanged_and_stays_version_1(url: str) -> None:
    rng = np.random.default_rng(8)
    t = rng.standard_normal((300, 4)).astype(np.float32)
    s = np.array([b"x", b"yy"], dtype=object)
    with open_store(url) as store:
        ids = [store.save(0, {"t": t.copy(), "s": s}).id]
        for step in (1, 2):
            t[step * 7] = step
            ids.append(
                store.save(
                    step,
                    {"t": Rows(np.array([step * 7]), t[[step * 7]], t.shape), "s": Same(s.shape, s.dtype)},
                    parent=ids[-1],
                ).id
            )
        ids.append(store.compact(ids[-1]).id)  # type: ignore[union-attr]
    for cid in ids:
        doc = json.loads((Path(url) / manifest_key(cid)).read_bytes())
        assert doc["format_version"] == 1
        assert all(e["encoding"] in ("full", "rows", "same") for e in doc["body"]["tensors"].values())
    with open_store(url) as reader:
        got = reader.load(ids[2])
        assert bits(got["t"]) == bits(t) and list(got["s"]) == [b"x", b"yy"]
        check_ranges(reader, ids[2], "t", t, [(0, 300), (13, 15), (0, 1), (250, 300)])
        assert list(reader.read_rows(ids[2], "s", 1, 2)) == [b"yy"]
        with pytest.raises(ConfigError):
            reader.read_rows(ids[2], "t", 5, 301)


# ----------------------------------------------------------------------------------------------- CLI
def psguard(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "psguard.cli", *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )


@pytest.fixture
def v2_store(url: str) -> tuple[str, list[str], np.ndarray]:
    emb = np.arange(1200, dtype=np.float32).reshape(300, 4)
    with open_store(url) as s:
        c0 = commit_parts(
            s,
            [s],
            10,
            {"emb": (emb.shape, [(0, emb[:100]), (100, emb[100:])])},
            tensors={"bias": np.ones(3, np.float32)},
        )
        emb[[5, 200]] = -1
        c1 = commit_parts(
            s,
            [s],
            20,
            {
                "emb": (
                    emb.shape,
                    [(0, Rows(np.array([5]), emb[[5]], (150, 4))), (150, Rows(np.array([50]), emb[[200]], (150, 4)))],
                )
            },
            parent=c0,
            tensors={"bias": Same((3,), np.dtype(np.float32))},
        )
    return url, [c0, c1], emb


def test_cli_ls_verify_inspect_on_a_v2_store(v2_store: tuple[str, list[str], np.ndarray]) -> None:
    url, ids, _ = v2_store
    ls = psguard("ls", url, "--json")
    assert ls.returncode == 0, ls.stderr
    assert [c["id"] for c in json.loads(ls.stdout)["checkpoints"]] == ids
    verify = psguard("verify", url, "--quiet")
    assert verify.returncode == 0 and verify.stdout.count(": ok") == 2, verify.stdout + verify.stderr
    out = psguard("inspect", url, "--step", "20", "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["format_version"] == 2
    emb = doc["tensors"]["emb"]
    assert emb["encoding"] == "sharded" and emb["shape"] == [300, 4]
    assert [(p["offset"], p["rows"], p["encoding"], p["rows_changed"]) for p in emb["parts"]] == [
        (0, 150, "rows", 1),
        (150, 150, "rows", 1),
    ]
    assert all(p["bytes"] == 8 + 16 for p in emb["parts"])
    assert "parts" not in doc["tensors"]["bias"]
    text = psguard("inspect", url, "--step", "10")
    assert text.returncode == 0 and "part rows [100, 300)  full" in text.stdout, text.stdout
    # damage a part chunk: verify exits 3 naming it
    with open_store(url) as s:
        h = s.manifest(ids[0]).tensors["emb"].parts[1].chunks[0].hash
    path = Path(url) / chunk_key(h)
    data = bytearray(path.read_bytes())
    data[0] ^= 0xFF
    path.write_bytes(data)
    bad = psguard("verify", url, "--step", "20", "--quiet")
    assert bad.returncode == 3 and h in bad.stdout


def test_copy_of_a_v2_chain(v2_store: tuple[str, list[str], np.ndarray], tmp_path: Path) -> None:
    url, ids, emb = v2_store
    dest = str(tmp_path / "copy")
    out = psguard("copy", url, "--id", ids[1], dest, "--quiet", "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["verified"]["ok"]
    with open_store(dest) as copy:
        assert bits(copy.load(ids[1])["emb"]) == bits(emb)
        assert on_disk_version(dest, ids[1]) == 2


@pytest.mark.slow
def test_cli_export_of_a_v2_checkpoint_is_a_plain_tf_checkpoint(
    v2_store: tuple[str, list[str], np.ndarray], tmp_path: Path
) -> None:
    url, _, emb = v2_store
    out = psguard("export", url, str(tmp_path / "tf"), "--quiet", "--json", timeout=300)
    assert out.returncode == 0, out.stderr
    prefix = json.loads(out.stdout)["prefix"]
    import tensorflow as tf

    reader = tf.train.load_checkpoint(prefix)
    assert bits(reader.get_tensor("emb")) == bits(emb)
    assert bits(reader.get_tensor("bias")) == bits(np.ones(3, np.float32))


# ----------------------------------------------------------------------------------------------- S3
@pytest.mark.slow
def test_two_ps_writers_on_s3(seaweed: Any, unique: str) -> None:
    s3_url, options = seaweed.url(unique), dict(seaweed.storage_options)
    rng = np.random.default_rng(9)
    emb = rng.standard_normal((400, 8)).astype(np.float32)

    def s3(**kw: Any) -> Store:
        return Store.open(s3_url, options, chunk_bytes=1024, **kw)

    with s3() as coordinator, s3() as ps0, s3() as ps1:
        base = commit_parts(coordinator, [ps0, ps1], 0, {"emb": (emb.shape, [(0, emb[:150]), (150, emb[150:])])})
        emb[[3, 399]] = 2.0
        delta = commit_parts(
            coordinator,
            [ps0, ps1],
            1,
            {
                "emb": (
                    emb.shape,
                    [(0, Rows(np.array([3]), emb[[3]], (200, 8))), (200, Rows(np.array([199]), emb[[399]], (200, 8)))],
                )
            },
            parent=base,
        )
    with s3() as reader:
        assert bits(reader.load(delta)["emb"]) == bits(emb)
        check_ranges(reader, delta, "emb", emb, [(0, 400), (140, 210), (399, 400)])
        assert reader.verify(delta).ok
        with reader.begin_save(2) as tx:
            part = reader.write_part("emb", emb, shape=emb.shape, offset=0)
            reader.backend.delete(chunk_key(part["chunks"][0]["hash"]))
            with pytest.raises(SaveError, match="is not in"):
                tx.commit({}, parts={"emb": [part]})
