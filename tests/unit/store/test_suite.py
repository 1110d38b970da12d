"""One suite, every backend: the durable log's promises checked on local disk, memory, S3, GCS and HDFS."""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from collections.abc import Iterator
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from psguard.errors import (
    ConfigError,
    CorruptCheckpointError,
    NoCheckpointError,
    ObjectExistsError,
    ObjectNotFoundError,
    SaveError,
    StorageError,
    UnreadableChunkError,
    UnsupportedFormatError,
)
from psguard.storage import Backend, RetryConfig, open_backend
from psguard.storage.retry import RetryingBackend
from psguard.store import Store
from psguard.store.lease import acquire_writer_lease
from psguard.store.manifest import CHUNK_PREFIX, chunk_key, manifest_key
from psguard.tensors import Full, Rows, Same
from tests.support.storage_targets import BACKENDS, Delegating, Target, UnreadableKeys, make_target

FAST_RETRY = RetryConfig(deadline=5.0, initial_backoff=0.05, max_backoff=0.5)


# The store's own logic over a backend's plain get/put/delete (manifest checks, verify, fallback, refusals):
# local, memory and one S3 server. S3 on moto, GCS, HDFS and WebHDFS run every test above that logic (the backend
# contract, round trips, deltas, gc, compaction, concurrent writers), so their get/put/delete paths stay covered.
STORE_LOGIC = pytest.mark.parametrize(
    "target", [p for p in BACKENDS if p.id in ("local", "memory", "s3-seaweedfs")], indirect=True
)


@pytest.fixture(params=BACKENDS)
def target(request: pytest.FixtureRequest, tmp_path: Path, unique: str) -> Target:
    return make_target(request.param, request, tmp_path, unique)


@pytest.fixture
def backend(target: Target) -> Iterator[Backend]:
    b = open_backend(target.url, target.options, retry=FAST_RETRY)
    yield b
    b.close()


@pytest.fixture
def store(target: Target) -> Iterator[Store]:
    # chunk_grace=0: these tests' unreferenced chunks are garbage at once (the age guard has its own tests)
    s = Store.open(target.url, target.options, retry=FAST_RETRY, chunk_bytes=4096, io_threads=4, chunk_grace=0)
    yield s
    s.close()


def bits(a: np.ndarray) -> bytes:
    """Bytes of an array, so NaN payloads and -0.0 compare exactly."""
    if a.dtype == object:
        return json.dumps([x.hex() for x in a.reshape(-1)]).encode() + str(a.shape).encode()
    return np.ascontiguousarray(a).tobytes() + str(a.shape).encode() + a.dtype.name.encode()


def assert_same(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name].dtype == want[name].dtype, name
        assert bits(got[name]) == bits(want[name]), name


def sample_tensors(rng: np.random.Generator) -> dict[str, np.ndarray]:
    f32 = rng.standard_normal((300, 8)).astype(np.float32)
    f32[0, 0] = -0.0
    f32[0, 1] = np.float32("nan")
    f32.view(np.uint32)[0, 2] = 0x7FC00123  # a NaN with a payload
    return {
        "emb/table": f32,
        "f16": rng.standard_normal((17, 3)).astype(np.float16),
        "f64": rng.standard_normal(5),
        "bf16": rng.standard_normal((40, 4)).astype(ml_dtypes.bfloat16),
        "i32": rng.integers(-(2**31), 2**31 - 1, size=(9, 2), dtype=np.int32),
        "i64": rng.integers(-(2**62), 2**62, size=(11,), dtype=np.int64),
        "bool": rng.random((6, 6)) > 0.5,
        "strings": np.array([[b"", b"a" * 5000], [b"\x00\xff", "é".encode()]], dtype=object),
        "scalar": np.array(42, dtype=np.int64),
        "empty": np.zeros((0, 8), dtype=np.float32),
    }


# ------------------------------------------------------------------------------------------------ backend
def test_backend_put_get_overwrite_delete(backend: Backend) -> None:
    backend.put("a/b/c.bin", b"one")
    assert backend.get("a/b/c.bin") == b"one"
    backend.put("a/b/c.bin", b"two")
    assert backend.get("a/b/c.bin") == b"two"
    assert backend.exists("a/b/c.bin")
    backend.delete("a/b/c.bin")
    assert not backend.exists("a/b/c.bin")
    backend.delete("a/b/c.bin")  # idempotent
    with pytest.raises(ObjectNotFoundError):
        backend.get("a/b/c.bin")


def test_backend_put_new_never_overwrites(backend: Backend) -> None:
    backend.put_new("m/x.json", b"first")
    with pytest.raises(ObjectExistsError):
        backend.put_new("m/x.json", b"second")
    assert backend.get("m/x.json") == b"first"


def test_backend_keys_lists_recursively_by_prefix(backend: Backend) -> None:
    for k in ("p/1", "p/q/2", "r/3"):
        backend.put(k, k.encode())
    assert backend.keys("p/") == ["p/1", "p/q/2"]
    assert backend.keys("") == ["p/1", "p/q/2", "r/3"]
    assert backend.keys("nothing/") == []


def test_backend_get_into_reads_into_buffer(backend: Backend) -> None:
    backend.put("k", bytes(range(200)))
    buf = bytearray(200)
    assert backend.get_into("k", memoryview(buf)) == 200
    assert bytes(buf) == bytes(range(200))


@pytest.mark.parametrize("key", ["../x", "/abs", "a/../../b", "a//b", "", "a/./b"])
def test_backend_refuses_keys_outside_the_store(backend: Backend, key: str) -> None:
    with pytest.raises(ConfigError):
        backend.put(key, b"x")


# ------------------------------------------------------------------------------------------------ store
def test_full_roundtrip_is_bit_identical_for_every_dtype(store: Store) -> None:
    tensors = sample_tensors(np.random.default_rng(1))
    info = store.save(7, tensors, metadata={"data_position": 1234, "partitioning": {"emb/table": [150, 150]}})
    assert info.kind == "full" and info.step == 7 and info.tensors == len(tensors)
    assert_same(store.load(info.id), tensors)
    m = store.manifest(info.id)
    assert m.metadata["data_position"] == 1234
    assert len(m.tensors["emb/table"].chunks) > 1  # split into bounded chunks (chunk_bytes=4096)


def test_chain_of_ten_deltas_restores_every_step(store: Store) -> None:
    rng = np.random.default_rng(2)
    rows = 256  # 4 chunks of 4096 bytes: a full and ten row deltas; more rows only add chunk round trips
    table = rng.standard_normal((rows, 16)).astype(np.float32)
    dense = rng.standard_normal((4, 4)).astype(np.float32)
    label = np.array([b"x"], dtype=object)
    snapshots = {}
    parent = store.save(0, {"table": table.copy(), "dense": dense.copy(), "label": label}).id
    snapshots[parent] = (table.copy(), dense.copy())
    for step in range(1, 11):
        ids = np.unique(rng.integers(0, rows, size=rng.integers(1, 40)))
        table[ids] += rng.standard_normal((len(ids), 16)).astype(np.float32)
        dense += 1
        upd = {
            "table": Rows(ids, table[ids].copy(), table.shape),
            "dense": Full(dense.copy()),
            "label": Same(label.shape, label.dtype),
        }
        info = store.save(step, upd, parent=parent)
        assert info.kind == "delta" and info.parent == parent
        parent = info.id
        snapshots[parent] = (table.copy(), dense.copy())
    for cid, (t, d) in snapshots.items():
        got = store.load(cid)
        assert bits(got["table"]) == bits(t) and bits(got["dense"]) == bits(d)
        assert got["label"].tolist() == [b"x"]
    assert store.manifest(parent).chain_length == 10
    assert [e["id"] for e in store.journal()] == list(snapshots)


def test_delta_stores_only_changed_rows(store: Store) -> None:
    table = np.random.default_rng(3).standard_normal((2000, 32)).astype(np.float32)
    full = store.save(0, {"t": table})
    ids = np.arange(0, 2000, 100)
    table[ids] = 0
    delta = store.save(1, {"t": Rows(ids, table[ids], table.shape)}, parent=full.id)
    assert delta.stored_bytes == len(ids) * (32 * 4 + 8)
    assert delta.logical_bytes == full.logical_bytes == table.nbytes


def test_identical_chunks_are_stored_once(store: Store) -> None:
    table = np.random.default_rng(4).standard_normal((500, 8)).astype(np.float32)
    first = store.save(0, {"t": table})
    table[0] += 1  # changes one chunk out of several
    second = store.save(1, {"t": table}, dedup_against=first.id)
    assert second.kind == "full"
    assert 0 < second.stored_bytes <= 4096
    assert bits(store.load(second.id)["t"]) == bits(table)


@STORE_LOGIC
def test_verify_finds_flipped_bit_truncation_and_missing_chunk(store: Store) -> None:
    rng = np.random.default_rng(5)
    info = store.save(0, {"a": rng.standard_normal((3000,)).astype(np.float32)})
    assert store.verify(info.id).ok
    refs = store.manifest(info.id).refs()
    assert len(refs) >= 3
    b = store.backend
    flipped = bytearray(b.get(chunk_key(refs[0].hash)))
    flipped[10] ^= 0x04
    b.put(chunk_key(refs[0].hash), flipped)
    b.put(chunk_key(refs[1].hash), b.get(chunk_key(refs[1].hash))[:-7])
    b.delete(chunk_key(refs[2].hash))
    report = store.verify(info.id)
    assert not report.ok
    by_chunk = {p.chunk: p.message for p in report.problems}
    assert "CRC32C" in by_chunk[refs[0].hash]
    assert "truncated" in by_chunk[refs[1].hash]
    assert "missing" in by_chunk[refs[2].hash]
    assert all(info.id in msg for msg in by_chunk.values())
    with pytest.raises(CorruptCheckpointError) as e:
        store.load(info.id)
    assert e.value.checkpoint == info.id


@STORE_LOGIC
def test_load_latest_falls_back_past_a_corrupt_checkpoint(store: Store, caplog: pytest.LogCaptureFixture) -> None:
    rng = np.random.default_rng(6)
    good = {"w": rng.standard_normal((64, 4)).astype(np.float32)}
    old = store.save(1, good)
    newer = store.save(2, {"w": good["w"] + 1})
    ref = store.manifest(newer.id).refs()[0]
    data = bytearray(store.backend.get(chunk_key(ref.hash)))
    data[0] ^= 1
    store.backend.put(chunk_key(ref.hash), data)
    result = store.load_latest()
    assert result.info.id == old.id
    assert [p.checkpoint for p in result.skipped] == [newer.id]
    assert bits(result.tensors["w"]) == bits(good["w"])
    assert "falling back" in caplog.text


def unreadable_store(target: Target, keys: set[str]) -> tuple[Store, UnreadableKeys]:
    """A store of ``target`` whose reads of ``keys`` fail with EIO, through the retry wrapper with no time to
    retry (a failing disk's reads are retried for a minute first): each failed read is one read psguard made."""
    faulty = UnreadableKeys(open_backend(target.url, target.options, retry=RetryConfig(deadline=0)), keys)
    return Store(RetryingBackend(faulty, RetryConfig(deadline=0)), chunk_bytes=4096, io_threads=4), faulty


@STORE_LOGIC
def test_load_latest_falls_back_past_a_chunk_the_storage_cannot_read(
    target: Target, store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    """An I/O error, not bad bytes: the newest checkpoint is passed over like a corrupt one, saying so, and a base
    its deltas share is tried once, not once per delta."""
    rng = np.random.default_rng(8)
    table = rng.standard_normal((64, 4)).astype(np.float32)
    old = store.save(1, {"w": table, "b": np.ones(3, np.int64)})
    base = store.save(2, {"w": table + 1, "b": np.ones(3, np.int64)})
    same_b = Same((3,), np.dtype(np.int64))
    deltas = [
        store.save(3 + i, {"w": Rows(np.array([i]), table[i : i + 1], table.shape), "b": same_b}, parent=base.id)
        for i in range(3)
    ]
    bad = store.manifest(base.id).tensors["w"].chunks[0]
    reader, faulty = unreadable_store(target, {chunk_key(bad.hash)})
    try:
        with caplog.at_level(logging.WARNING, logger="psguard.store.reader"):
            result = reader.load_latest()
        assert result.info.id == old.id
        assert bits(result.tensors["w"]) == bits(table)
        assert [p.checkpoint for p in result.skipped] == [d.id for d in reversed(deltas)] + [base.id]
        assert all(p.chunk == bad.hash and "could not be read" in p.message for p in result.skipped)
        assert f"checkpoint {deltas[-1].id} is unreadable" in caplog.text and "falling back" in caplog.text
        assert faulty.failed_reads == 1  # the deltas need the chunk the base could not give: not tried again
        with pytest.raises(UnreadableChunkError) as raised:
            reader.load(base.id)
        assert (raised.value.checkpoint, raised.value.chunk) == (base.id, bad.hash)
    finally:
        reader.close()


@STORE_LOGIC
def test_load_latest_never_says_no_checkpoint_when_one_could_not_be_read(target: Target, store: Store) -> None:
    """Callers start from scratch on NoCheckpointError: a checkpoint that could not be read may be sound, so
    when nothing else loads the call fails with the storage's error instead."""
    info = store.save(1, {"w": np.arange(8, dtype=np.float32)})
    keys = {chunk_key(r.hash) for r in store.manifest(info.id).refs()}
    reader, _ = unreadable_store(target, keys)
    try:
        with pytest.raises(StorageError, match="could not be read") as raised:
            reader.load_latest()
        assert not isinstance(raised.value, NoCheckpointError)
    finally:
        reader.close()


@STORE_LOGIC
@pytest.mark.parametrize(
    "damage",
    ["truncate", "garbage", "bitflip", "future-version", "escape-path", "bad-parent"],
)
def test_damaged_manifests_are_refused_with_a_clear_error(store: Store, damage: str) -> None:
    rng = np.random.default_rng(7)
    base = store.save(1, {"w": rng.standard_normal((8,)).astype(np.float32)})
    victim = store.save(2, {"w": rng.standard_normal((8,)).astype(np.float32)})
    key = manifest_key(victim.id)
    raw = store.backend.get(key)
    doc = json.loads(raw)
    if damage == "truncate":
        bad = raw[: len(raw) // 2]
    elif damage == "garbage":
        bad = b"\x00\x01not json"
    elif damage == "bitflip":
        bad = raw.replace(b'"step": 2', b'"step": 3')
    else:
        body = doc["body"]
        if damage == "future-version":
            doc["format_version"] = 99
        elif damage == "escape-path":
            body["tensors"]["w"]["chunks"][0]["hash"] = "../../../etc/passwd"
        else:
            body["kind"] = "delta"
            body["parent"] = "../manifests/x"
        canon = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()
        doc["sha256"] = hashlib.sha256(canon).hexdigest()  # a well-formed lie: the checksum matches
        bad = json.dumps(doc).encode()
    assert bad != raw
    store.backend.put(key, bad)
    fresh = Store(store.backend)  # no cached manifest
    try:
        expected = UnsupportedFormatError if damage == "future-version" else CorruptCheckpointError
        with pytest.raises(expected) as e:
            fresh.load(victim.id)
        assert victim.id in str(e.value)
        result = fresh.load_latest()
        assert result.info.id == base.id
        assert result.skipped and result.skipped[0].checkpoint == victim.id
    finally:
        fresh._pool.shutdown()


@STORE_LOGIC
def test_missing_parent_makes_the_delta_unusable_not_wrong(store: Store) -> None:
    a = np.arange(20, dtype=np.float32).reshape(5, 4)
    base = store.save(0, {"a": a})
    d = store.save(1, {"a": Rows(np.array([1]), a[1:2] + 1, a.shape)}, parent=base.id)
    store.backend.delete(manifest_key(base.id))
    fresh = Store(store.backend)
    try:
        with pytest.raises(CorruptCheckpointError, match="parent"):
            fresh.load(d.id)
        with pytest.raises(NoCheckpointError):
            fresh.load_latest()
    finally:
        fresh._pool.shutdown()


def test_gc_keeps_what_kept_checkpoints_need(store: Store) -> None:
    rng = np.random.default_rng(8)
    t = rng.standard_normal((400, 8)).astype(np.float32)
    full0 = store.save(0, {"t": t.copy()})
    chain = [full0.id]
    for step in range(1, 4):
        t[step] += 1
        chain.append(store.save(step, {"t": Rows(np.array([step]), t[step : step + 1], t.shape)}, parent=chain[-1]).id)
    want = t.copy()
    t2 = rng.standard_normal((400, 8)).astype(np.float32)
    lone = store.save(4, {"t": t2})  # a new base
    report = store.gc(keep_last=2)
    # kept: the newest two (step 3's delta and step 4's full) plus step 3's whole chain
    assert set(report.kept) == {*chain, lone.id}
    assert report.deleted_checkpoints == ()
    report = store.gc(keep_last=1)
    assert set(report.kept) == {lone.id}
    assert set(report.deleted_checkpoints) == set(chain)
    assert report.deleted_chunks > 0
    assert bits(store.load(lone.id)["t"]) == bits(t2)
    assert store.verify(lone.id).ok
    remaining = {k.rsplit("/", 1)[-1] for k in store.backend.keys(CHUNK_PREFIX)}
    assert remaining == {r.hash for r in store.manifest(lone.id).refs()}
    del want


def test_gc_refuses_retention_that_keeps_nothing(store: Store) -> None:
    with pytest.raises(ConfigError):
        store.gc(keep_last=0)
    with pytest.raises(ConfigError):
        store.gc()


def test_gc_defers_chunk_deletion_while_a_writer_is_active(store: Store) -> None:
    a = store.save(0, {"x": np.ones(100, np.float32)})
    b = store.save(1, {"x": np.zeros(100, np.float32)})
    lease, keeper = acquire_writer_lease(store.backend, "000000000002-00000000", b.id, store.lock_ttl)
    try:
        report = store.gc(keep_last=1)
        assert report.deleted_checkpoints == (a.id,)
        assert report.chunks_deferred and report.deleted_chunks == 0
    finally:
        keeper.stop()
        lease.release()
    report = store.gc(keep_last=1)
    assert not report.chunks_deferred and report.deleted_chunks == 1


def test_compaction_keeps_contents(store: Store) -> None:
    rng = np.random.default_rng(9)
    t = rng.standard_normal((600, 4)).astype(np.float32)
    s = np.array([b"keep"], dtype=object)
    cur = store.save(0, {"t": t.copy(), "s": s}).id
    for step in range(1, 6):
        ids = np.array([step, 100 + step])
        t[ids] -= 3
        cur = store.save(step, {"t": Rows(ids, t[ids], t.shape), "s": Same(s.shape, s.dtype)}, parent=cur).id
    compacted = store.compact(cur)
    assert compacted is not None and compacted.kind == "full" and compacted.step == 5
    assert store.manifest(compacted.id).metadata["compacted_from"] == cur
    assert compacted.stored_bytes < t.nbytes  # unchanged chunks were shared with the base
    assert bits(store.load(compacted.id)["t"]) == bits(t)
    assert store.resolve(step=5) == compacted.id  # the newest commit of the step wins
    assert store.compact(compacted.id) is None
    store.gc(keep_last=1)
    assert [i.id for i in store.checkpoints()] == [compacted.id]
    assert bits(store.load_latest().tensors["t"]) == bits(t)


def test_two_writers_lose_no_commit(target: Target) -> None:
    stores = [Store.open(target.url, target.options, retry=FAST_RETRY, chunk_bytes=4096) for _ in range(2)]
    committed: list[str] = []
    errors: list[BaseException] = []
    lock = threading.Lock()
    start = threading.Barrier(2)

    def writer(idx: int) -> None:
        try:
            start.wait()
            for step in range(5):
                info = stores[idx].save(step, {"w": np.full((50, 4), idx * 100 + step, np.float32)})
                with lock:
                    committed.append(info.id)
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(i,), name=f"writer-{i}") for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert not errors
        ids = stores[0].checkpoint_ids()
        assert sorted(ids) == sorted(committed) and len(ids) == 10
        journal_ids = [e["id"] for e in stores[0].journal()]
        assert sorted(journal_ids) == sorted(committed)
        for cid in committed:
            value = stores[1].load(cid)["w"]
            assert len(np.unique(value)) == 1
    finally:
        for s in stores:
            s.close()


@STORE_LOGIC
def test_bad_saves_are_refused_and_leave_nothing(store: Store) -> None:
    base = store.save(0, {"a": np.zeros((10, 2), np.float32)})
    with pytest.raises(ConfigError, match="whole"):
        store.save(1, {"a": Same((10, 2), np.dtype(np.float32))})
    with pytest.raises(ConfigError, match="cannot apply"):
        store.save(1, {"a": Rows(np.array([0]), np.zeros((1, 3), np.float32), (10, 3))}, parent=base.id)
    with pytest.raises(ConfigError, match="sorted"):
        store.save(1, {"a": Rows(np.array([3, 1]), np.zeros((2, 2), np.float32), (10, 2))}, parent=base.id)
    with pytest.raises(ConfigError, match="every tensor"):
        store.save(1, {}, parent=base.id)
    with pytest.raises(ConfigError, match="JSON"):
        store.save(1, {"a": np.zeros(1)}, metadata={"x": object()})
    assert store.checkpoint_ids() == [base.id]


#: Checkpoint keys TF writes (``tf.train.Checkpoint``: an attribute ``a.b/c`` is the part ``a..b.Sc``; a lookup
#: table's tensors; a slot; a TF1 name) and names with characters a path would not need: all stored as they are.
TF_NAMES = [
    "model/embedding/.ATTRIBUTES/VARIABLE_VALUE",
    "model/a..b.Sc/.ATTRIBUTES/VARIABLE_VALUE",
    "model/t/.ATTRIBUTES/table-keys",
    "model/emb/.OPTIMIZER_SLOT/optimizer/accumulator/.ATTRIBUTES/VARIABLE_VALUE",
    "_CHECKPOINTABLE_OBJECT_GRAPH",
    "dense_1/kernel:0",
    "a\\b c/ünïcode/...",
]
PATH_NAMES = ["../../../../tmp/x", "model/../../x", "/etc/x", "a//b", "a/", "./a", "", "a\x00b", "a\rb"]


@STORE_LOGIC
def test_tensor_names_that_could_be_paths_are_refused_on_write_and_tf_names_are_kept(store: Store) -> None:
    values = {name: np.full(3, i, np.float32) for i, name in enumerate(TF_NAMES)}
    info = store.save(0, values)
    assert store.verify(info.id).ok
    assert {n: bits(v) for n, v in store.load(info.id).items()} == {n: bits(v) for n, v in values.items()}
    for name in PATH_NAMES:
        with pytest.raises(ConfigError, match="tensor name"):
            store.save(1, {**values, name: np.zeros(3, np.float32)})
        with pytest.raises(ConfigError, match="tensor name"):
            store.save(1, {name: Same((3,), np.dtype(np.float32))}, parent=info.id)
        with pytest.raises(ConfigError, match="tensor name"):
            store.write_part(name, np.zeros((2, 3), np.float32), shape=(4, 3), offset=0)
        part = store.write_part("ok/name", np.zeros((4, 3), np.float32), shape=(4, 3), offset=0)
        with store.begin_save(1) as tx, pytest.raises(ConfigError, match="tensor name"):
            tx.commit({}, parts={name: [part]})
    assert store.checkpoint_ids() == [info.id]


@STORE_LOGIC
def test_save_failure_is_a_clear_error_and_commits_nothing(target: Target) -> None:
    class FailingBackend(Delegating):
        def __init__(self, inner: Backend, fail_after: int) -> None:
            super().__init__(inner)
            self.left = fail_after

        def put(self, key: str, data: bytes | bytearray | memoryview) -> None:
            self.left -= 1
            if self.left < 0 and key.startswith(CHUNK_PREFIX):
                raise PermissionError("access denied by test")
            self.inner.put(key, data)

    inner = open_backend(target.url, target.options, retry=FAST_RETRY)
    store = Store(FailingBackend(inner, fail_after=3), chunk_bytes=1024)
    try:
        with pytest.raises(SaveError, match="access denied"):
            store.save(0, {"x": np.zeros(10_000, np.float32)})
        assert store.checkpoint_ids() == []
        assert store.latest() is None
        assert store.backend.keys("locks/") == []
    finally:
        store.close()
