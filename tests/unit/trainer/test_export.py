"""``psguard export``: a TF checkpoint TensorFlow's own tools read, byte for byte, into any folder psguard writes.

The fast tests use ``tf.Module`` roots without a cluster; each model style of the compatibility suite
(tests/support/model_styles.py) is checkpointed through psguard, exported and read back by TF's tools (slow: a
Keras model is built, trained and evaluated). A PS-held model is in tests/cluster/test_export.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

import tensorflow as tf
from tensorflow.core.protobuf import trackable_object_graph_pb2
from tensorflow.python.checkpoint import checkpoint_management

from psguard import cli
from psguard.storage import open_backend
from psguard.store import Store
from psguard.trainer.export import OBJECT_GRAPH_KEY, STATE_FILE, export_checkpoint, object_graph_bytes
from psguard.trainer.manager import CheckpointManager
from psguard.trainer.variables import bitwise_equal, read_tensors
from tests.support.model_styles import STYLES, differing, round_trip
from tests.support.paths import QUIET, ROOT
from tests.support.storage_targets import make_target


class Tower(tf.Module):
    """A layer-like module whose last child holds nothing: the last node of the object graph has no value."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        rng = np.random.default_rng(seed)
        self.kernel = tf.Variable(rng.standard_normal((4, 3)).astype(np.float32))
        self.names = tf.Variable([b"a\x00", b"\x00b", b"c\x00\x00"])  # NULs inside, leading and trailing
        self.label = tf.Variable(b"tail\x00\x00")  # a scalar string ending in NULs
        self.dropout = tf.Module()  # weightless, as a Dropout layer


def tower_root(seed: int = 0) -> tf.train.Checkpoint:
    return tf.train.Checkpoint(step=tf.Variable(0, dtype=tf.int64), tower=Tower(seed))


def tf_graph(root: tf.train.Checkpoint, folder: Path) -> bytes:
    """The object graph TF itself writes for ``root``."""
    graph: bytes = tf.train.load_checkpoint(root.write(str(folder / "ckpt"))).get_tensor(OBJECT_GRAPH_KEY)
    return graph


@pytest.fixture
def saved(tmp_path: Path) -> tuple[tf.train.Checkpoint, str, str]:
    """A ``Tower`` root saved through psguard at step 3: (root, store URL, checkpoint id)."""
    root = tower_root()
    url = str(tmp_path / "store")
    with CheckpointManager(root, url) as manager:
        info = manager.save(3).result(timeout=60)
    return root, url, info.id


def export(url: str, cid: str, out: str | Path) -> str:
    with Store.open(url) as store:
        return export_checkpoint(store, cid, out)


# ----------------------------------------------------------------------------------------------- bytes
def test_an_object_graph_ending_in_a_nul_byte_is_exported_whole(
    saved: tuple[tf.train.Checkpoint, str, str], tmp_path: Path
) -> None:
    """The issue's DecodeError: the graph went through a fixed-width numpy string, which drops trailing NULs."""
    root, url, cid = saved
    want = tf_graph(root, tmp_path / "tf")
    assert want.endswith(b"\x00"), "the case under test: TF's graph ends in a NUL byte"
    prefix = export(url, cid, tmp_path / "out")
    assert tf.train.load_checkpoint(prefix).get_tensor(OBJECT_GRAPH_KEY) == want
    fresh = tower_root(seed=1)
    tf.train.Checkpoint(step=fresh.step, tower=fresh.tower).restore(prefix).assert_consumed()
    assert fresh.tower.label.numpy() == b"tail\x00\x00"
    assert fresh.tower.names.numpy().tolist() == [b"a\x00", b"\x00b", b"c\x00\x00"]


def test_every_tensor_is_exported_as_psguard_stored_it(
    saved: tuple[tf.train.Checkpoint, str, str], tmp_path: Path
) -> None:
    root, url, cid = saved
    with Store.open(url) as store:
        stored = store.load(cid)
    assert stored["tower/label/.ATTRIBUTES/VARIABLE_VALUE"].item() == b"tail\x00\x00"
    prefix = export(url, cid, tmp_path / "out")
    assert not differing(stored, prefix)
    restored = tower_root(seed=1)
    restored.restore(prefix).assert_consumed()
    live = read_tensors(root)
    assert all(bitwise_equal(live[k], v) for k, v in read_tensors(restored).items())


def test_the_object_graph_psguard_saves_is_the_one_tf_writes(tmp_path: Path) -> None:
    root = tower_root()
    assert object_graph_bytes(root) == tf_graph(root, tmp_path)


def test_a_graph_saved_without_has_checkpoint_values_is_exported_as_tf_writes_it(tmp_path: Path) -> None:
    """Checkpoints saved before psguard set the nodes' ``has_checkpoint_values`` export the graph TF writes."""
    root = tower_root()
    want = tf_graph(root, tmp_path / "tf")
    old = trackable_object_graph_pb2.TrackableObjectGraph.FromString(want)
    for node in old.nodes:
        node.ClearField("has_checkpoint_values")
    tensors = {k: v for k, v in read_tensors(root).items()}
    tensors[OBJECT_GRAPH_KEY] = np.array(old.SerializeToString(), dtype=object)
    url = str(tmp_path / "store")
    with Store.open(url) as store:
        cid = store.save(4, tensors).id
    prefix = export(url, cid, tmp_path / "out")
    assert tf.train.load_checkpoint(prefix).get_tensor(OBJECT_GRAPH_KEY) == want


# ----------------------------------------------------------------------------------------------- state file
def test_the_state_file_is_the_one_tf_writes(saved: tuple[tf.train.Checkpoint, str, str], tmp_path: Path) -> None:
    _, url, cid = saved
    prefix = export(url, cid, tmp_path / "out")
    with Store.open(url) as store:
        stamp = store.manifest(cid).committed_at
    (tmp_path / "tf").mkdir()
    checkpoint_management.update_checkpoint_state_internal(
        str(tmp_path / "tf"),
        "ckpt-3",
        ["ckpt-3"],
        save_relative_paths=True,
        all_model_checkpoint_timestamps=[stamp],
    )
    assert (tmp_path / "out" / STATE_FILE).read_bytes() == (tmp_path / "tf" / STATE_FILE).read_bytes()
    assert tf.train.latest_checkpoint(str(tmp_path / "out")) == prefix
    assert next(tf.train.checkpoints_iterator(str(tmp_path / "out"), timeout=1)) == prefix


def test_exports_into_one_folder_are_listed_as_tfs_checkpoint_manager_lists_them(tmp_path: Path) -> None:
    root = tower_root()
    url = str(tmp_path / "store")
    with CheckpointManager(root, url) as manager:
        ids = [manager.save(step).result(timeout=60).id for step in (3, 5)]
    out = tmp_path / "out"
    for cid in (ids[0], ids[1], ids[0]):  # the last: step 3 again, which becomes the latest
        export(url, cid, out)
    state = tf.train.get_checkpoint_state(str(out))
    assert state.model_checkpoint_path == str(out / "ckpt-3")
    assert list(state.all_model_checkpoint_paths) == [str(out / "ckpt-5"), str(out / "ckpt-3")]
    assert len(state.all_model_checkpoint_timestamps) == 2
    # TF's CheckpointManager picks the folder up where the exports left it
    manager = tf.train.CheckpointManager(tower_root(), str(out), max_to_keep=5)
    assert manager.checkpoints == [str(out / "ckpt-5"), str(out / "ckpt-3")]


def test_a_state_file_tensorflow_cannot_read_is_replaced(
    saved: tuple[tf.train.Checkpoint, str, str], tmp_path: Path
) -> None:
    _, url, cid = saved
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / STATE_FILE).write_bytes(b"\xff not a CheckpointState {")
    prefix = export(url, cid, tmp_path / "out")
    assert tf.train.latest_checkpoint(str(tmp_path / "out")) == prefix


# ----------------------------------------------------------------------------------------------- destinations
@pytest.mark.parametrize(
    "backend",
    [
        "memory",
        pytest.param("seaweed", id="s3-seaweedfs", marks=pytest.mark.slow),
        pytest.param("hdfs", id="hdfs-native", marks=pytest.mark.slow),
        pytest.param("gcs", id="gcs-fake-gcs-server", marks=pytest.mark.slow),
    ],
)
def test_a_remote_folder_gets_the_files_of_a_local_export(
    backend: str,
    saved: tuple[tf.train.Checkpoint, str, str],
    request: pytest.FixtureRequest,
    tmp_path: Path,
    unique: str,
) -> None:
    """TF 2.21 reads no s3://, gs:// or hdfs:// path itself: the export writes them through psguard's storage, and what
    lands there is the local export, file for file and byte for byte (a reader with a filesystem plugin, or a copy
    to local disk, reads what a local export holds)."""
    _, url, cid = saved
    target = make_target(backend, request, tmp_path, unique)
    local = export(url, cid, tmp_path / "local")
    with Store.open(url) as store:
        remote = export_checkpoint(store, cid, target.url, storage_options=target.options)
    assert remote == f"{target.url}/ckpt-3"
    files = sorted(p.name for p in (tmp_path / "local").iterdir())
    assert files == [STATE_FILE, "ckpt-3.data-00000-of-00001", "ckpt-3.index"]
    written = open_backend(target.url, target.options)
    try:
        assert written.keys("") == files
        assert all(written.get(name) == (tmp_path / "local" / name).read_bytes() for name in files)
    finally:
        written.close()
    assert local == str(tmp_path / "local" / "ckpt-3")


def test_the_cli_exports_to_a_store_url_not_to_a_local_folder_named_after_it(
    saved: tuple[tf.train.Checkpoint, str, str],
    tmp_path: Path,
    unique: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    _, url, cid = saved
    monkeypatch.chdir(tmp_path)
    assert cli.main(["export", url, f"memory://{unique}/tf", "--id", cid, "--quiet", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"checkpoint": cid, "prefix": f"memory://{unique}/tf/ckpt-3"}
    assert not (tmp_path / "memory:").exists()
    written = open_backend(f"memory://{unique}/tf")
    assert written.keys("") == [STATE_FILE, "ckpt-3.data-00000-of-00001", "ckpt-3.index"]


def test_the_cli_refuses_an_unknown_scheme_before_reading_the_store(
    saved: tuple[tf.train.Checkpoint, str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, url, _ = saved
    assert cli.main(["export", url, "nosuch://bucket/tf", "--quiet"]) == cli.EXIT_USAGE
    assert "unknown storage scheme 'nosuch'" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------- model styles
@pytest.mark.slow
@pytest.mark.parametrize("style", sorted(set(STYLES) - {"tfrs"}))
def test_each_model_style_round_trips_through_tfs_tools(style: str, tmp_path: Path) -> None:
    assert round_trip(style, tmp_path) == str(tmp_path / "export" / "ckpt-3")


@pytest.mark.slow
def test_the_tfrs_style_round_trips_through_tfs_tools(tmp_path: Path) -> None:
    """TFRS needs tf.keras to be tf_keras, which only a fresh process can promise (model_styles' docstring)."""
    env = dict(os.environ, **QUIET, TF_USE_LEGACY_KERAS="1", PYTHONPATH=str(ROOT))
    run = subprocess.run(
        [sys.executable, "-m", "tests.support.model_styles", "tfrs", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=540,
        env=env,
        cwd=ROOT,
    )
    assert run.returncode == 0, run.stderr[-6000:]
    assert run.stdout.strip().endswith("round trip ok")
    assert tf.train.latest_checkpoint(str(tmp_path / "export")) == str(tmp_path / "export" / "ckpt-3")
