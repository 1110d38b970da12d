"""The memory tier: applies all-or-nothing, tokens guard deltas, dirty marks survive a failed persist."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest

from psguard.agent.tiers.memory_tier import MemoryTier
from psguard.errors import ConfigError, PsguardError, TensorMismatchError
from psguard.storage.registry import open_backend
from psguard.store import Store
from psguard.tensors import Full, FullStream, Rows, Same, TensorUpdate


def bits(a: np.ndarray) -> bytes:
    """Bytes of an array, so NaN payloads and -0.0 compare exactly."""
    if a.dtype == object:
        return repr([bytes(x) for x in a.reshape(-1)]).encode() + str(a.shape).encode()
    return np.ascontiguousarray(a).tobytes() + str(a.shape).encode() + a.dtype.name.encode()


def assert_same(got: dict[str, np.ndarray] | object, want: dict[str, np.ndarray]) -> None:
    assert isinstance(got, dict) or hasattr(got, "items")
    got_d = dict(got)  # type: ignore[call-overload]
    assert sorted(got_d) == sorted(want)
    for name in want:
        assert got_d[name].dtype == want[name].dtype, name
        assert bits(got_d[name]) == bits(want[name]), name


def state(rng: np.random.Generator) -> dict[str, np.ndarray]:
    emb = rng.standard_normal((1000, 8)).astype(np.float32)
    emb[0, 0] = -0.0
    emb.view(np.uint32)[0, 1] = 0x7FC00123  # a NaN with a payload
    return {
        "emb": emb,
        "slot": rng.standard_normal((1000, 8)).astype(ml_dtypes.bfloat16),
        "dense": rng.standard_normal((4, 4)),
        "step": np.array(7, dtype=np.int64),
        "vocab": np.array([b"a", b"", b"\xff" * 3], dtype=object),
    }


def full(tensors: dict[str, np.ndarray]) -> dict[str, TensorUpdate]:
    return {n: Full(v.copy()) for n, v in tensors.items()}


def delta(
    tensors: dict[str, np.ndarray], rows: dict[str, np.ndarray], dense: dict[str, np.ndarray]
) -> dict[str, TensorUpdate]:
    """Update ``tensors`` in place (the trainer's truth) and return the capture that says so."""
    out: dict[str, TensorUpdate] = {}
    for name, value in tensors.items():
        if name in rows:
            ids = np.unique(rows[name]).astype(np.int64)
            value[ids] = (value[ids].astype(np.float32) + 1).astype(value.dtype)
            out[name] = Rows(ids, value[ids].copy(), value.shape)
        elif name in dense:
            value[...] = dense[name]
            out[name] = Full(value.copy())
        else:
            out[name] = Same(value.shape, value.dtype)
    return out


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1)


def test_full_then_deltas_track_the_trainer_bit_for_bit(rng: np.random.Generator) -> None:
    truth = state(rng)
    tier = MemoryTier()
    assert tier.empty and tier.take_dirty() is None
    res = tier.apply(full(truth), step=1, token="g-1", parent=None, metadata={"pos": 1})
    assert res.ok and res.token == "g-1"
    for k in range(2, 6):
        cap = delta(truth, {"emb": rng.integers(0, 1000, 30), "slot": rng.integers(0, 1000, 5)}, {})
        res = tier.apply(cap, step=k, token=f"g-{k}", parent=f"g-{k - 1}", metadata={"pos": k})
        assert res.ok
    with tier.export() as snap:
        assert (snap.step, snap.token, snap.metadata) == (5, "g-5", {"pos": 5})
        assert_same(snap.tensors, truth)
        assert not snap.tensors["emb"].flags.writeable


def test_delta_on_the_wrong_state_needs_full_and_changes_nothing(rng: np.random.Generator) -> None:
    truth = state(rng)
    tier = MemoryTier()
    cap = delta(truth, {"emb": [1, 2]}, {})
    res = tier.apply(cap, step=2, token="g-2", parent="g-1")
    assert res.status == "need_full" and "empty" in res.message
    tier.apply(full(truth), step=1, token="g-1", parent=None)
    before = {n: a.copy() for n, a in truth.items()}
    again = tier.apply({}, step=1, token="g-1", parent="g-0")  # the same capture processed twice
    assert again.ok and again.message == "already applied"
    res = tier.apply(delta(truth, {"emb": [3]}, {}), step=2, token="h-2", parent="other-1")
    assert res.status == "need_full" and "g-1" in res.message
    with tier.export() as snap:
        assert snap.step == 1 and snap.token == "g-1"
        assert_same(snap.tensors, before)


def test_invalid_capture_is_rejected_whole(rng: np.random.Generator) -> None:
    truth = state(rng)
    tier = MemoryTier()
    tier.apply(full(truth), step=1, token="g-1", parent=None)
    good = Rows(np.array([1, 2]), np.zeros((2, 8), np.float32), (1000, 8))
    bad_ids = Rows(np.array([5, 5]), np.zeros((2, 8), ml_dtypes.bfloat16), (1000, 8))
    same = {n: Same(v.shape, v.dtype) for n, v in truth.items()}
    with pytest.raises(TensorMismatchError, match="sorted, unique"):
        tier.apply({**same, "emb": good, "slot": bad_ids}, step=2, token="g-2", parent="g-1")
    wrong_shape = Rows(np.array([1]), np.zeros((1, 4), np.float32), (1000, 4))
    with pytest.raises(TensorMismatchError, match="does not fit"):
        tier.apply({**same, "emb": wrong_shape}, step=2, token="g-2", parent="g-1")
    with pytest.raises(ConfigError, match="every tensor"):
        tier.apply({"emb": good}, step=2, token="g-2", parent="g-1")
    with pytest.raises(ConfigError, match="must be whole"):
        tier.apply({**full(truth), "emb": good}, step=2, token="g-2", parent=None)
    with tier.export() as snap:
        assert snap.token == "g-1"
        assert_same(snap.tensors, truth)  # the valid "emb" rows of the rejected capture were not applied


def test_take_dirty_gives_current_rows_and_changed_dense(rng: np.random.Generator) -> None:
    truth = state(rng)
    tier = MemoryTier()
    tier.apply(full(truth), step=1, token="g-1", parent=None)
    take = tier.take_dirty()
    assert take is not None and take.base and all(isinstance(u, Full) for u in take.updates.values())
    take.commit()
    again = tier.take_dirty()
    assert again is not None and not again.base and not again.changed
    again.commit()

    tier.apply(delta(truth, {"emb": [3, 10]}, {}), step=2, token="g-2", parent="g-1")
    tier.apply(delta(truth, {"emb": [10, 20]}, {"dense": np.ones((4, 4))}), step=3, token="g-3", parent="g-2")
    take = tier.take_dirty()
    assert take is not None and not take.base and take.step == 3 and take.token == "g-3"
    emb = take.updates["emb"]
    assert isinstance(emb, Rows)
    assert emb.ids.tolist() == [3, 10, 20]
    assert bits(emb.values) == bits(truth["emb"][[3, 10, 20]])  # current values, not the first write's
    assert isinstance(take.updates["dense"], Full)
    assert bits(take.updates["dense"].value) == bits(truth["dense"])
    assert isinstance(take.updates["slot"], Same) and isinstance(take.updates["vocab"], Same)
    assert take.payload_bytes == 3 * (32 + 8) + truth["dense"].nbytes
    take.commit()
    assert tier.status().dirty_tensors == 0
    with pytest.raises(PsguardError, match="already committed"):
        take.commit()


def test_failed_persist_merges_marks_back(rng: np.random.Generator) -> None:
    truth = state(rng)
    tier = MemoryTier()
    tier.apply(full(truth), step=1, token="g-1", parent=None)
    tier.take_dirty().commit()  # type: ignore[union-attr]
    tier.apply(delta(truth, {"emb": [1, 2]}, {"dense": np.zeros((4, 4))}), step=2, token="g-2", parent="g-1")
    first = tier.take_dirty()
    assert first is not None
    with pytest.raises(PsguardError, match="one take at a time"):
        tier.take_dirty()
    # training goes on while the persist runs, then the persist fails
    tier.apply(delta(truth, {"emb": [2, 5], "slot": [7]}, {}), step=3, token="g-3", parent="g-2")
    first.abort()
    retry = tier.take_dirty()
    assert retry is not None and retry.step == 3
    emb, slot = retry.updates["emb"], retry.updates["slot"]
    assert isinstance(emb, Rows) and emb.ids.tolist() == [1, 2, 5]
    assert bits(emb.values) == bits(truth["emb"][[1, 2, 5]])
    assert isinstance(slot, Rows) and slot.ids.tolist() == [7]
    assert isinstance(retry.updates["dense"], Full)
    retry.commit()
    nothing = tier.take_dirty()
    assert nothing is not None and not nothing.changed
    nothing.abort()


def test_leased_arrays_are_copied_on_write(rng: np.random.Generator) -> None:
    truth = state(rng)
    tier = MemoryTier()
    tier.apply(full(truth), step=1, token="g-1", parent=None)
    take = tier.take_dirty()  # a base: whole tensors leased, not copied
    assert take is not None
    taken = take.updates["emb"]
    assert isinstance(taken, Full)
    before = truth["emb"].copy()
    snap = tier.export()
    tier.apply(delta(truth, {"emb": [0, 1, 2]}, {}), step=2, token="g-2", parent="g-1")
    assert bits(taken.value) == bits(before)  # the persist still sees step 1
    assert bits(snap.tensors["emb"]) == bits(before)  # and so does the restore
    assert tier.status().copy_on_write_bytes == truth["emb"].nbytes
    snap.release()
    take.commit()
    assert tier.status().leased_arrays == 0
    tier.apply(delta(truth, {"emb": [4]}, {}), step=3, token="g-3", parent="g-2")
    assert tier.status().copy_on_write_bytes == truth["emb"].nbytes  # no lease: written in place
    with tier.export() as s:
        assert_same(s.tensors, truth)


def test_whole_capture_over_the_same_layout_persists_as_rows(rng: np.random.Generator) -> None:
    truth = state(rng)
    tier = MemoryTier(diff_min_bytes=1024)
    tier.apply(full(truth), step=1, token="g-1", parent=None)
    tier.take_dirty().commit()  # type: ignore[union-attr]
    truth["emb"][[4, 9]] += 1
    truth["emb"].view(np.uint32)[11, 0] ^= 0x80000000  # only the sign bit: bytes differ, maybe values not
    res = tier.apply(full(truth), step=2, token="h-2", parent=None)  # e.g. resent after need_full
    assert res.ok
    take = tier.take_dirty()
    assert take is not None and not take.base
    emb = take.updates["emb"]
    assert isinstance(emb, Rows) and emb.ids.tolist() == [4, 9, 11]
    assert isinstance(take.updates["slot"], Rows) is False  # unchanged: compared equal, nothing marked
    assert isinstance(take.updates["slot"], Same)
    take.commit()


def test_layout_change_makes_a_base_and_strings_go_whole(rng: np.random.Generator) -> None:
    truth = state(rng)
    tier = MemoryTier()
    tier.apply(full(truth), step=1, token="g-1", parent=None)
    tier.take_dirty().commit()  # type: ignore[union-attr]
    cap = delta(truth, {}, {"vocab": np.array([b"x", b"y", b"z"], dtype=object)})
    tier.apply(cap, step=2, token="g-2", parent="g-1")
    take = tier.take_dirty()
    assert take is not None and not take.base and isinstance(take.updates["vocab"], Full)
    take.commit()
    same = {n: Same(v.shape, v.dtype) for n, v in truth.items()}
    rows = Rows(np.array([1]), np.array([b"new"], dtype=object), (3,))
    assert tier.apply({**same, "vocab": rows}, step=2, token="g-2b", parent="g-2").ok
    take = tier.take_dirty()
    assert take is not None and isinstance(take.updates["vocab"], Full)  # the log stores strings whole
    assert take.updates["vocab"].value.tolist() == [b"x", b"new", b"z"]
    take.commit()
    # an optimizer slot appears after the first step (Adam creates slots lazily): new tensor, whole
    cap = delta(truth, {}, {})
    cap["new_slot"] = Full(np.zeros((1000, 8), np.float32))
    assert tier.apply(cap, step=3, token="g-3", parent="g-2b").ok
    take = tier.take_dirty()
    assert take is not None and take.base and len(take.updates) == 6
    take.abort()
    take = tier.take_dirty()
    assert take is not None and take.base  # still a base after the failed one
    take.commit()
    take = tier.take_dirty()
    assert take is not None and not take.base
    take.commit()


def test_many_dirty_rows_persist_whole(rng: np.random.Generator) -> None:
    truth = state(rng)
    tier = MemoryTier()
    tier.apply(full(truth), step=1, token="g-1", parent=None)
    tier.take_dirty().commit()  # type: ignore[union-attr]
    tier.apply(delta(truth, {"emb": np.arange(600)}, {}), step=2, token="g-2", parent="g-1")
    take = tier.take_dirty()
    assert take is not None and isinstance(take.updates["emb"], Full)
    take.commit()


def test_seeded_from_the_durable_log_is_clean(rng: np.random.Generator) -> None:
    truth = state(rng)
    tier = MemoryTier()
    tier.seed(40, {n: v.copy() for n, v in truth.items()}, metadata={"pos": 40}, token="g-40")
    take = tier.take_dirty()
    assert take is not None and not take.base and not take.changed
    take.commit()
    assert tier.apply(delta(truth, {"emb": [1]}, {}), step=41, token="g-41", parent="g-40").ok
    unseeded = MemoryTier()
    unseeded.seed(40, truth, durable=False)
    take = unseeded.take_dirty()
    assert take is not None and take.base
    take.commit()


def test_a_persist_streams_big_tensors_and_a_capture_meanwhile_saves_rows_not_the_tensor(
    rng: np.random.Generator,
) -> None:
    truth = state(rng)
    tier = MemoryTier(stream_min_bytes=16_000)  # emb (32 KB) and slot (16 KB) stream; the rest is by reference
    tier.apply(full(truth), step=1, token="g-1", parent=None)
    before = {n: v.copy() for n, v in truth.items()}
    take = tier.take_dirty()
    assert take is not None and take.base
    emb, slot = take.updates["emb"], take.updates["slot"]
    assert isinstance(emb, FullStream) and isinstance(slot, FullStream)
    assert isinstance(take.updates["dense"], Full)
    assert list(take.updates) == list(truth)  # every tensor, in the tier's order
    # Three captures during the write, overlapping rows: the first write of a row saves it, the rest do not.
    tier.apply(delta(truth, {"emb": [0, 1, 2, 999]}, {}), step=2, token="g-2", parent="g-1")
    half = emb.read(0, 500)
    tier.apply(delta(truth, {"emb": [1, 2, 3, 600], "slot": [5]}, {}), step=3, token="g-3", parent="g-2")
    tier.apply(delta(truth, {"emb": [2, 998]}, {}), step=4, token="g-4", parent="g-3")
    got = np.concatenate([half, emb.read(500, 700), emb.read(700, 1000)])
    assert bits(got) == bits(before["emb"])  # the persist sees step 1, however its reads interleave
    assert bits(slot.read(0, 1000)) == bits(before["slot"])
    assert bits(emb.read(3, 3)) == bits(before["emb"][3:3])
    with pytest.raises(ValueError):
        emb.read(0, 1001)
    row = truth["emb"][0].nbytes + 8
    assert tier.status().copy_on_write_bytes == 7 * row + (truth["slot"][0].nbytes + 8)  # 7 emb rows, 1 slot row
    with tier.export() as snap:  # the live state moved on, in place
        assert_same(snap.tensors, truth)
    take.commit()
    assert tier.status().leased_arrays == 0
    with pytest.raises(PsguardError, match="closed"):
        emb.read(0, 1)


def test_an_export_during_a_streamed_persist_copies_and_both_see_their_state(rng: np.random.Generator) -> None:
    truth = state(rng)
    tier = MemoryTier(stream_min_bytes=16 << 10)
    tier.apply(full(truth), step=1, token="g-1", parent=None)
    take = tier.take_dirty()
    assert take is not None
    tier.apply(delta(truth, {"emb": [7]}, {}), step=2, token="g-2", parent="g-1")
    at2 = truth["emb"].copy()
    snap = tier.export()
    tier.apply(delta(truth, {"emb": [7, 8]}, {}), step=3, token="g-3", parent="g-2")  # the export's view: a copy
    stream = take.updates["emb"]
    assert isinstance(stream, FullStream)
    assert bits(snap.tensors["emb"]) == bits(at2)
    snap.release()
    take.abort()
    take = tier.take_dirty()
    assert take is not None
    stream = take.updates["emb"]
    assert isinstance(stream, FullStream)  # still a base: nothing was committed
    assert bits(stream.read(0, 1000)) == bits(truth["emb"])
    take.commit()


def test_a_streamed_tensor_is_stored_as_the_same_chunks_as_a_whole_one(
    tmp_path: Path, request: pytest.FixtureRequest, rng: np.random.Generator
) -> None:
    truth = state(rng)
    store = Store(open_backend(tmp_path.as_uri()), chunk_bytes=4096)
    request.addfinalizer(store.close)
    whole = store.save(1, {"emb": truth["emb"]})
    tier = MemoryTier(stream_min_bytes=16 << 10)
    tier.apply(full({"emb": truth["emb"]}), step=1, token="g-1", parent=None)
    take = tier.take_dirty()
    assert take is not None
    tier.apply(delta({"emb": truth["emb"]}, {"emb": [3, 500]}, {}), step=2, token="g-2", parent="g-1")
    streamed = store.save(1, take.updates, dedup_against=whole.id)
    take.commit()
    a, b = store.manifest(whole.id).tensors["emb"], store.manifest(streamed.id).tensors["emb"]
    assert [r.hash for r in a.refs()] == [r.hash for r in b.refs()] and len(a.refs()) == 8
    assert store.manifest(streamed.id).stats["bytes_written"] == 0  # every chunk deduplicated
    assert bits(store.load(streamed.id)["emb"]) == bits(store.load(whole.id)["emb"])
    # A PS agent writes its shard's part the same way.
    take = tier.take_dirty(base=True)
    assert take is not None
    stream = take.updates["emb"]
    assert isinstance(stream, FullStream)
    with store.begin_save(2):
        as_stream = store.write_part("emb", stream, shape=(1000, 8), offset=0)
        as_array = store.write_part("emb", Full(truth["emb"]), shape=(1000, 8), offset=0)
    take.commit()
    assert as_stream["chunks"] == as_array["chunks"] and len(as_stream["chunks"]) == 8


@pytest.mark.parametrize("stream_min_bytes", [1 << 30, 1], ids=["by-reference", "streamed"])
def test_applies_and_takes_from_two_threads_lose_nothing(rng: np.random.Generator, stream_min_bytes: int) -> None:
    """A persister thread taking and failing/committing while the agent applies: the final take after the
    last commit must equal exactly the rows touched since, whatever the interleaving."""
    truth = state(rng)
    tier = MemoryTier(stream_min_bytes=stream_min_bytes)
    tier.apply(full(truth), step=0, token="g-0", parent=None)
    tier.take_dirty().commit()  # type: ignore[union-attr]
    durable = {n: v.copy() for n, v in truth.items()}
    stop = threading.Event()
    errors: list[BaseException] = []

    def persister() -> None:
        n = 0
        try:
            while not stop.is_set():
                take = tier.take_dirty()
                assert take is not None
                n += 1
                if n % 3 == 0:
                    take.abort()
                    continue
                for name, u in take.updates.items():  # "write" the take to a durable copy
                    if isinstance(u, Rows):
                        durable[name][u.ids] = u.values
                    elif isinstance(u, Full):
                        durable[name] = u.value.copy()
                    elif isinstance(u, FullStream):
                        durable[name] = np.concatenate([u.read(0, 10), u.read(10, u.shape[0])])
                take.commit()
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=persister, name="test-persister")
    t.start()
    try:
        for k in range(1, 200):
            cap = delta(truth, {"emb": rng.integers(0, 1000, 20), "slot": rng.integers(0, 1000, 3)}, {})
            assert tier.apply(cap, step=k, token=f"g-{k}", parent=f"g-{k - 1}").ok
    finally:
        stop.set()
        t.join()
    assert not errors
    final = tier.take_dirty()
    assert final is not None
    for name, u in final.updates.items():
        if isinstance(u, Rows):
            durable[name][u.ids] = u.values
        elif isinstance(u, Full):
            durable[name] = u.value.copy()
        elif isinstance(u, FullStream):
            durable[name] = u.read(0, u.shape[0])
    final.commit()
    assert_same(durable, truth)


def test_a_streamed_tensor_reads_no_further_ahead_of_its_uploads_than_the_window(tmp_path: Path) -> None:
    """The bytes a PS agent holds beyond its shards during a durable write: the window, read before it was
    acquired no more (each chunk's read waited for nothing, so one chunk more than the window was held)."""
    from concurrent.futures import ThreadPoolExecutor

    from psguard.store.chunks import ChunkWriter

    chunk, window = 64 << 10, 4 * (64 << 10)
    rows = np.arange(64 * 1024 * 8, dtype=np.float32).reshape(-1, 64)  # 32 chunks of 64 KiB
    backend = open_backend(str(tmp_path / "store"))
    gate, window_full = threading.Event(), threading.Event()
    lock = threading.Lock()
    held = {"read": 0, "stored": 0, "most": 0}
    real_put = backend.put

    def put(key: str, data: bytes | memoryview) -> None:
        assert gate.wait(60), "the window never filled"
        real_put(key, data)
        with lock:
            held["stored"] += len(data)

    def read(a: int, b: int) -> np.ndarray:
        value = rows[a:b].copy()
        with lock:
            held["read"] += value.nbytes
            held["most"] = max(held["most"], held["read"] - held["stored"])
            if held["read"] >= window:
                window_full.set()
        return value

    backend.put = put  # type: ignore[method-assign]  # uploads wait until the window has filled
    with ThreadPoolExecutor(4) as pool:
        writer = ChunkWriter(backend, pool, inflight_bytes=window, known=set())
        stream = FullStream(rows.shape, rows.dtype, read)
        result: list[Any] = []
        submitter = threading.Thread(target=lambda: result.append(writer.submit_stream(stream, chunk)))
        submitter.start()
        assert window_full.wait(60)
        gate.set()
        submitter.join(60)
        refs = [f.result(60) for f in result[0]]
    assert len(refs) == rows.nbytes // chunk and held["stored"] == rows.nbytes
    assert held["most"] <= window, held


def test_glibc_takes_the_settings_that_bound_freed_buffers() -> None:
    """A PS agent moves shards through MB-sized buffers on many threads; with glibc's defaults their freed memory
    stays in per-thread arenas (the 1 GB node-loss bench: +0.5 GB). The settings must take on this platform."""
    from psguard.agent.tiers.memory_tier import limit_malloc_retention

    assert limit_malloc_retention() is True
