"""PS-side capture and restore (issue 12): a shard's bytes go between its PS and files on the PS's node.

The capture function, placed on each PS device, writes the changed rows of the shards that PS hosts as tensor
files into that PS's part folder; the chief gets only counts. A restore reads such files on each PS device and
assigns there. Both ends are checked against the agent's TF-less codec (:mod:`psguard.handoff.tensor_file`):
what TensorFlow writes the agent reads, and what the agent writes TensorFlow loads, bit for bit.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

import tensorflow as tf

from psguard.errors import CorruptCheckpointError, TensorMismatchError
from psguard.handoff.mapped import map_op
from psguard.handoff.parts import PartCapture, ShardFiles, ShardKey
from psguard.handoff.spool import Restored
from psguard.handoff.tensor_bundle import bundle_files, read_bundle, write_bundle
from psguard.handoff.tensor_file import read_tensor_file
from psguard.tensors import Same, apply_update
from psguard.testbed.model import ModelConfig, RecModel, Trainer, build_optimizer, make_optimizer
from psguard.trainer.capture import Capturer
from psguard.trainer.deferred_init import deferred_initial_values
from psguard.trainer.manager import CheckpointManager, RestoreInfo
from psguard.trainer.options import CaptureOptions, ManagerOptions
from psguard.trainer.recovery import StablePlacement, _rebuild
from psguard.trainer.variables import read_tensors
from tests.support.clusters import Chief


def check_coverage(parts: Sequence[PartCapture], what: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every spilled tensor covered exactly once by the parts' shards; name -> (shape, dtype)."""
    by_name: dict[str, list[ShardFiles]] = {}
    for p in parts:
        for s in p.shards:
            by_name.setdefault(s.key.name, []).append(s)
    out: dict[str, tuple[tuple[int, ...], str]] = {}
    for name, shards in by_name.items():
        shards.sort(key=lambda s: s.key.offset)
        at = 0
        for s in shards:
            if s.key.offset != at or (s.shape, s.dtype) != (shards[0].shape, shards[0].dtype):
                raise CorruptCheckpointError(f"{what}: the shards of {name} do not tile it")
            at += s.key.rows
        if at != shards[0].shape[0]:
            raise CorruptCheckpointError(f"{what}: the shards of {name} cover {at} of {shards[0].shape[0]} rows")
        out[name] = (shards[0].shape, shards[0].dtype)
    return out


CONFIG = ModelConfig(vocab_size=1000, embedding_dim=8, hidden=16, batch_size=32)
TABLE = "model/embedding/.ATTRIBUTES/VARIABLE_VALUE"


def fresh(chief: Chief, optimizer: str = "adagrad") -> tuple[Any, Any, Any]:
    with chief.strategies["fixed2"].scope():
        model = RecModel(CONFIG)
        opt = make_optimizer(optimizer, "tf_keras")
        build_optimizer(opt, list(model.trainable_variables))
    return model, opt, tf.train.Checkpoint(model=model, optimizer=opt)


def part_dirs(tmp_path: Path) -> dict[str, str]:
    dirs = {}
    for task in ("ps:0", "ps:1"):
        d = tmp_path / task.replace(":", "-")
        d.mkdir(mode=0o700)
        dirs[task] = str(d)
    return dirs


def apply_parts(
    state: dict[str, np.ndarray],
    parts: list[PartCapture],
    dirs: dict[str, str],
    fps: dict[ShardKey, np.ndarray] | None = None,
) -> None:
    """What a PS agent does with its part, done for every PS: read the files, apply them to the shards (and the
    rows' fingerprints to ``fps``)."""
    for part in parts:
        folder = Path(dirs[part.task]) / "incoming" / part.nonce
        for s in part.shards:
            lo, hi = s.key.offset, s.key.offset + s.key.rows
            full_rows = s.key.rows if s.kind == "full" else 0
            full = read_bundle(folder / f"{s.stem}.full", dtype=s.dtype, shape=(full_rows, *s.shape[1:]))
            ids = read_tensor_file(folder / f"{s.stem}.ids", dtype="int64")
            rows = read_tensor_file(folder / f"{s.stem}.rows", dtype=s.dtype)
            assert s.fps
            fp = read_tensor_file(folder / f"{s.stem}.fps", dtype="int64")
            assert fp.shape == (s.count,)
            if s.kind == "full":
                assert full.shape[0] == s.count == s.key.rows and ids.size == 0
                state.setdefault(s.key.name, np.zeros(s.shape, full.dtype))[lo:hi] = full
                if fps is not None:
                    fps[s.key] = fp
            elif s.kind == "rows":
                assert full.shape[0] == 0 and ids.size == rows.shape[0] == s.count > 0
                assert ids.min() >= 0 and ids.max() < s.key.rows
                state[s.key.name][lo + ids] = rows
                if fps is not None:
                    fps[s.key][ids] = fp
            else:
                assert full.shape[0] == 0 and ids.size == 0


def row_fingerprints(rows: np.ndarray) -> np.ndarray:
    """What the capture stores per row: farmhash64 of its bytes, as int64."""
    return np.asarray(tf.reshape(tf.bitcast(tf.fingerprint(tf.constant(rows)), tf.int64), [-1]).numpy())


@pytest.mark.slow
def test_capture_writes_each_shard_on_its_ps_and_restore_reads_it_there(chief: Chief, tmp_path: Path) -> None:
    model, opt, root = fresh(chief)
    dirs = part_dirs(tmp_path)
    trainer = Trainer(chief.strategies["fixed2"], chief.coordinator, model, opt)
    capturer = Capturer(root, coordinator=chief.coordinator, row_tracking_min_rows=64, spill_dirs=dirs)
    spilled = capturer.spilled
    assert TABLE in spilled and len(spilled[TABLE]) == 2
    state: dict[str, np.ndarray] = {}
    fps: dict[ShardKey, np.ndarray] = {}
    for round_ in range(3):
        updates = capturer.capture(full=round_ == 0)
        parts = capturer.last_parts
        assert [p.task for p in parts] == ["ps:0", "ps:1"]
        covered = check_coverage(parts, "capture")
        assert set(covered) == set(spilled) and not set(covered) & set(updates)
        # Only counts and small tensors reached the chief: far less than one shard's bytes.
        assert capturer.last_stats.bytes_read < CONFIG.vocab_size * CONFIG.embedding_dim * 4 / 4
        for name, u in updates.items():
            state[name] = apply_update(state.get(name), u)
        apply_parts(state, parts, dirs, fps)
        kinds = {s.kind for p in parts for s in p.shards if s.key.name == TABLE}
        assert kinds == ({"full"} if round_ == 0 else {"rows"}), kinds
        assert capturer.last_stats.rows_spilled > 0
        expected = read_tensors(root)
        assert sorted(state) == sorted(expected)
        for name in expected:
            assert state[name].tobytes() == expected[name].tobytes(), name
        for k, fp in fps.items():  # the fingerprints sent beside the rows are the rows' own
            assert np.array_equal(fp, row_fingerprints(state[k.name][k.offset : k.offset + k.rows])), k
        trainer.train(4, join=False)

    # The agent's end of a restore: one bundle per shard, written as the agent writes them (without TensorFlow);
    # each PS loads its own.
    restore_dir = tmp_path / "restore"
    restore_dir.mkdir()
    files: dict[ShardKey, str] = {}
    for name, keys in spilled.items():
        for k in keys:
            prefix = restore_dir / str(len(files))
            write_bundle(prefix, state[name][k.offset : k.offset + k.rows])
            files[k] = str(prefix)
    local = {n: v for n, v in state.items() if n not in spilled}

    _, _, root2 = fresh(chief)
    capturer2 = Capturer(root2, coordinator=chief.coordinator, row_tracking_min_rows=64, spill_dirs=dirs)
    # All or nothing: one damaged file and no variable changes.
    before = read_tensors(root2)
    victim_key, victim = next(iter(files.items()))
    index, data = bundle_files(victim)
    good = data.read_bytes()
    value = state[victim_key.name][victim_key.offset : victim_key.offset + victim_key.rows]
    flipped = bytearray(good)
    flipped[len(good) // 2] ^= 0x10
    damages: list[Callable[[], object]] = [
        lambda: data.write_bytes(good[:-5]),  # truncated
        lambda: data.write_bytes(bytes(flipped)),  # one bit: the CRC32C
        lambda: write_bundle(victim, value[:-1]),  # a row short
        lambda: write_bundle(victim, np.concatenate([value, value[:1]])),  # a row long
        lambda: index.unlink(),  # gone
    ]
    # Mapped (files that are their agents' tier files): the same but for the flipped bit, which is not looked for
    # there (psguard.handoff.mapped says why).
    mapped_too = [(d, set(files)) for k, d in enumerate(damages) if k != 1] if map_op() is not None else []
    for damage, mappable in [(d, set()) for d in damages] + mapped_too:
        damage()
        with pytest.raises(tf.errors.OpError):
            capturer2.restore_parts(local, files, mappable=mappable)
        after = read_tensors(root2)
        assert all(after[n].tobytes() == before[n].tobytes() for n in before)
        write_bundle(victim, value)
    Path(victim).write_bytes(good)
    with pytest.raises(TensorMismatchError, match="missing"):
        capturer2.restore_parts(local, dict(list(files.items())[1:]))
    # Each file's home is the PS whose agent wrote it: a shard the model now puts on another PS is refused
    # (on a real cluster that path is on another node), before anything is assigned.
    homes = {k: task for task, keys in capturer2.spilled_by_task().items() for k in keys}
    swapped = {k: "ps:1" if t == "ps:0" else "ps:0" for k, t in homes.items()}
    with pytest.raises(TensorMismatchError, match="on another PS than the one that captured them"):
        capturer2.restore_parts(local, files, homes=swapped)
    assert all(t.tobytes() == before[n].tobytes() for n, t in read_tensors(root2).items())

    capturer2.restore_parts(local, files, homes=homes)
    restored = read_tensors(root2)
    for name in state:
        assert restored[name].tobytes() == state[name].tobytes(), name
    # Rebased: nothing changed since the restore, so the next capture sends nothing, of the tables (their
    # fingerprints loaded) nor of the tensors the chief passed (hashed by the same function once assigned).
    after_restore = capturer2.capture()
    assert set(local) <= set(after_restore) and all(isinstance(u, Same) for u in after_restore.values())
    assert all(s.kind == "same" for p in capturer2.last_parts for s in p.shards)

    # With the fingerprints the agent kept, the PS loads them instead of hashing: a marked one shows it. That
    # restore (the usual one) was traced by the first capturer at its captures, for variables of the same
    # shapes: the second one's restore traces nothing.
    assert capturer2._functions is capturer._functions
    # The usual restore maps the tier files its agents link (when the op is built: `make test` builds it).
    ((mapped, usual),) = [
        (mapped, fn)
        for (_, with_fps, given, mapped), fn in capturer._functions.loads.items()
        if all(with_fps) and given
    ]
    assert all(mapped) == (map_op() is not None)
    assert usual.experimental_get_tracing_count() == 1
    fp_files: dict[ShardKey, str] = {}
    for k, fp in fps.items():
        prefix = restore_dir / f"fp-{len(fp_files)}"
        marked = fp.copy()
        marked[0] = 12345
        write_bundle(prefix, marked)
        fp_files[k] = str(prefix)
    counts = capturer2.restore_parts(local, files, fingerprints=fp_files, mappable=set(files))
    assert counts == (len(files) if map_op() is not None else 0, len(files))  # mapped, loaded
    restored = read_tensors(root2)
    assert all(restored[name].tobytes() == state[name].tobytes() for name in state)  # exact either way
    for j, k in enumerate(spilled[TABLE]):
        loaded = capturer2._tracked[TABLE].fingerprints[j].numpy()
        assert loaded[0] == 12345 and np.array_equal(loaded[1:], fps[k][1:])
    assert usual.experimental_get_tracing_count() == 1


def test_tensor_files_tensorflow_writes_are_read_exactly_and_damage_is_refused(tmp_path: Path) -> None:
    import ml_dtypes

    rng = np.random.default_rng(1)
    for dtype in ("float32", "float64", "int64", "bfloat16", "float16", "bool", "uint8"):
        for shape in [(5, 3), (0, 4), (), (7,), (2, 3, 4)]:
            value = (rng.standard_normal(shape) * 10).astype(ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype)
            path = tmp_path / f"{dtype}-{len(shape)}-{sum(shape)}.tp"
            tf.io.write_file(str(path), tf.io.serialize_tensor(tf.constant(value)))
            back = read_tensor_file(path, dtype=dtype, shape=shape)
            assert back.tobytes() == value.tobytes() and back.dtype == value.dtype and back.shape == shape
    path = tmp_path / "float32-2-8.tp"
    data = path.read_bytes()
    with pytest.raises(CorruptCheckpointError, match="shape"):
        read_tensor_file(path, shape=(3, 5))
    with pytest.raises(CorruptCheckpointError, match="dtype"):
        read_tensor_file(path, dtype="int64")
    for bad in (data[:-1], data[:5], b"", b"\x08\x01\x12\x06\x12\x04\x08\xff\xff\xff\x0f\x22\x04abcd", data + b"x"):
        path.write_bytes(bad)
        with pytest.raises(CorruptCheckpointError):
            read_tensor_file(path)
    with pytest.raises(CorruptCheckpointError, match="missing"):
        read_tensor_file(tmp_path / "absent.tp")


def test_part_descriptors_are_validated() -> None:
    good = {
        "task": "ps:0",
        "nonce": "0123456789abcdef",
        "shards": [
            {
                "name": "t",
                "offset": 0,
                "rows": 5,
                "shape": [10, 2],
                "dtype": "float32",
                "kind": "full",
                "count": 5,
                "stem": "0-0",
            },
        ],
    }
    part = PartCapture.from_json(good, "x")
    assert part.to_json() == good
    with pytest.raises(CorruptCheckpointError, match="cover 5 of 10"):
        check_coverage([part], "x")
    for change in (
        {"task": "worker:0"},
        {"nonce": "../../etc"},
        {"shards": [{**good["shards"][0], "offset": 8}]},  # past the end
        {"shards": [{**good["shards"][0], "stem": "../x"}]},
        {"shards": [{**good["shards"][0], "count": 4}]},  # a full shard sends every row
        {"shards": [{**good["shards"][0], "rows": 10**20}]},
        {"shards": [good["shards"][0], good["shards"][0]]},
    ):
        with pytest.raises(CorruptCheckpointError):
            PartCapture.from_json({**good, **change}, "x")


def test_shard_files_that_do_not_load_on_the_ps_send_the_restore_elsewhere_with_nothing_assigned(
    chief: Chief, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A damaged restore file (here truncated) made every new trainer generation crash on it, again and again:
    the manager now reports it and goes on to the durable log, the variables untouched."""
    _, _, source = fresh(chief)
    want = read_tensors(source)
    _, _, root = fresh(chief)
    dirs = part_dirs(tmp_path)
    manager = CheckpointManager(
        root,
        (tmp_path / "store").as_uri(),
        options=ManagerOptions(
            coordinator=chief.coordinator, capture=CaptureOptions(row_tracking_min_rows=64, spill_dirs=dirs)
        ),
    )
    try:
        for name, value in read_tensors(root).items():
            want.setdefault(name, value)  # the manager's own counter, which the source has not
        spilled = manager.capturer.spilled
        assert TABLE in spilled
        files: dict[ShardKey, str] = {}
        for name, keys in spilled.items():
            for k in keys:
                prefix = tmp_path / str(len(files))
                write_bundle(prefix, want[name][k.offset : k.offset + k.rows])
                files[k] = str(prefix)
        snap = Restored(7, {n: v for n, v in want.items() if n not in spilled}, {}, "tok", parts=files)
        info = RestoreInfo("memory:tok", 7, {}, "memory")
        before = read_tensors(root)
        victim = bundle_files(files[spilled[TABLE][1]])[1]
        good = victim.read_bytes()
        victim.write_bytes(good[: len(good) // 2])
        with caplog.at_level(logging.WARNING, "psguard.trainer.manager"):
            assert manager._load(info, snap) is False
        assert "did not load on the PS" in caplog.text and "RestoreV2" in caplog.text  # TF's read of the bundle
        after = read_tensors(root)
        assert all(after[n].tobytes() == before[n].tobytes() for n in before)
        victim.write_bytes(good)
        assert manager._load(info, snap) is True
        restored = read_tensors(root)
        assert all(restored[n].tobytes() == want[n].tobytes() for n in want)
    finally:
        manager.close()


def test_a_ps_lost_during_the_load_raises_rather_than_sending_the_restore_to_an_older_checkpoint(
    chief: Chief, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A PS killed while the trainer loaded the tiers' newest state is a cluster failure, not a bad checkpoint:
    falling back to the log's older step loaded that step into every tier, and the newer acknowledged state was
    lost (a 1-h soak: 300 steps). The load raises; recovery restores the newest again."""
    _, _, root = fresh(chief)
    manager = CheckpointManager(
        root,
        (tmp_path / "store").as_uri(),
        options=ManagerOptions(
            coordinator=chief.coordinator,
            capture=CaptureOptions(row_tracking_min_rows=64, spill_dirs=part_dirs(tmp_path)),
        ),
    )
    try:
        spilled = manager.capturer.spilled
        files = {k: str(tmp_path / f"{name}-{k.offset}") for name, keys in spilled.items() for k in keys}
        snap = Restored(7, {}, {}, "tok", parts=files)
        dead = tf.errors.UnavailableError(None, None, "failed to connect to all addresses; Connection refused")

        def restore_parts(*args: Any, **kwargs: Any) -> None:
            raise dead

        monkeypatch.setattr(manager.capturer, "restore_parts", restore_parts)
        with pytest.raises(tf.errors.UnavailableError):
            manager._load(RestoreInfo("memory:tok", 7, {}, "memory"), snap)
        damaged = CorruptCheckpointError("truncated restore file")  # the checkpoint's fault: the next source
        monkeypatch.setattr(manager.capturer, "restore_parts", lambda *a, **k: (_ for _ in ()).throw(damaged))
        assert manager._load(RestoreInfo("memory:tok", 7, {}, "memory"), snap) is False
    finally:
        manager.close()


def test_a_rebuild_before_a_restore_creates_big_variables_without_values_and_only_a_restore_completes_it(
    chief: Chief, tmp_path: Path
) -> None:
    """In-process recovery builds the model again and restores it at once: the big variables are created without
    values (their initial values cost seconds at 1 GB and are overwritten), and only a restore that assigned every
    one of them lets the rebuild stand; without a checkpoint the caller must build again (``_rebuild``)."""
    _, _, saved = fresh(chief)
    url = (tmp_path / "store").as_uri()
    with CheckpointManager(saved, url, options=ManagerOptions(coordinator=chief.coordinator)) as m:
        m.save(3)
        m.wait()
    want = read_tensors(saved)
    with deferred_initial_values(min_bytes=8192) as deferred:  # the table and its accumulator, 16 KB a shard
        _, _, root = fresh(chief)
        assert not deferred.complete and deferred.deferred == 4  # 2 tensors x 2 shards
        assert deferred.deferred_bytes == 2 * CONFIG.vocab_size * CONFIG.embedding_dim * 4
        with CheckpointManager(root, url, options=ManagerOptions(coordinator=chief.coordinator)) as m:
            assert m.restore_or_initialize() is not None
    assert deferred.complete
    got = read_tensors(root)
    assert all(got[n].tobytes() == want[n].tobytes() for n in want if n in got)

    with deferred_initial_values(min_bytes=8192) as deferred:
        _, _, root = fresh(chief)
        with CheckpointManager(
            root, (tmp_path / "empty").as_uri(), options=ManagerOptions(coordinator=chief.coordinator)
        ) as m:
            assert m.restore_or_initialize() is None  # nothing to restore: the variables hold no values
    assert not deferred.complete

    built: list[Any] = []

    def build() -> Any:
        _, _, root = fresh(chief)
        built.append(root)
        return root

    # A build that restores nothing is done again, with initial values.
    root = _rebuild(build, None, StablePlacement(), min_bytes=8192)
    assert len(built) == 2 and root is built[1] and read_tensors(root)[TABLE].any()


def test_a_generation_rebuilt_in_process_puts_every_shard_on_the_ps_the_first_did(chief: Chief) -> None:
    """TF's strategy places variables round robin, counting on from the last build; with an odd number of
    variables (here one more than the model's) on 2 PS, a rebuild put every shard on the other PS, where no
    agent kept it. ``run_with_recovery`` builds under :class:`StablePlacement`."""

    def build() -> list[str]:
        model, _, _ = fresh(chief)
        with chief.strategies["fixed2"].scope():
            extra = tf.Variable(0.0)  # makes the count odd
        return [v.device for v in model.trainable_variables] + [extra.device]

    first = build()
    assert build() != first  # TF alone: the next build is placed elsewhere (the control)
    placement = StablePlacement()
    with placement.building():
        first = build()
    for _ in range(2):
        with placement.building():
            assert build() == first


def test_psguards_functions_run_unoptimised_and_leave_the_users_options_alone(chief: Chief, tmp_path: Path) -> None:
    from tensorflow.core.protobuf import config_pb2
    from tensorflow.python.eager import context

    from psguard.trainer.capture_graph import unoptimized_calls

    ctx = context.context()
    before = ctx.function_call_options
    with unoptimized_calls():
        inside = ctx.function_call_options
    assert ctx.function_call_options is before
    config = config_pb2.ConfigProto()
    config.ParseFromString(inside.config_proto_serialized)
    assert config.graph_options.rewrite_options.disable_meta_optimizer
    assert inside.config_proto_serialized != before.config_proto_serialized
    _, _, root = fresh(chief)
    capturer = Capturer(root, coordinator=chief.coordinator, row_tracking_min_rows=64, spill_dirs=part_dirs(tmp_path))
    capturer.capture(full=True)
    capturer.rebase()
    assert ctx.function_call_options is before  # a capture and a rebase changed nothing of the caller's
