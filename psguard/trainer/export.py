"""Standard TensorFlow checkpoints out of psguard stores: users are never locked in.

An export of checkpoint ``C`` (step ``N``) into a folder (a path or any store URL) writes what
``tf.train.CheckpointManager`` would have: ``ckpt-N.data-00000-of-00001`` and ``ckpt-N.index`` (one ``SaveV2`` of
every tensor under its TF key, partitioned variables as their logical tensors, TF's object graph byte for byte),
then, last, TF's ``checkpoint`` state file naming ``ckpt-N`` the latest (a local folder synced first), and only
then deletes the files of checkpoints a retention (``keep_last``) no longer lists. A remote folder gets the same
files, made in a local temporary folder. String tensors stay ``object`` arrays of ``bytes``: dtype ``S`` would
drop a serialized proto's trailing NUL.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from psguard.errors import ObjectNotFoundError
from psguard.storage.base import Backend
from psguard.storage.registry import check_url, open_backend, redact, split_url
from psguard.store import Store
from psguard.store.cli import (
    add_progress_argument,
    add_store_arguments,
    metered_progress,
    open_store,
    parse_storage_options,
    require_output_folder,
    require_output_store,
)
from psguard.trainer.variables import gather_variables

log = logging.getLogger(__name__)

OBJECT_GRAPH_KEY = "_CHECKPOINTABLE_OBJECT_GRAPH"
#: TF's state file, which ``tf.train.latest_checkpoint`` reads (``checkpoint_management._GetCheckpointFilename``).
STATE_FILE = "checkpoint"
#: Checkpoints are named ``ckpt-<step>``, as ``tf.train.CheckpointManager`` names them by default.
PREFIX_NAME = "ckpt"


def object_graph_bytes(root: Any) -> bytes:
    """TF's serialized ``TrackableObjectGraph`` for ``root``, as ``tf.train.Checkpoint.write`` makes it but
    without reading any variable (whole tables to the chief)."""
    from tensorflow.python.checkpoint import graph_view, save_util, util  # lazy: TF only when exporting

    view = graph_view.ObjectGraphView(root)
    trackable_data, _ = save_util._gather_trackable_data(view, None)
    proto = save_util._fill_object_graph_proto(trackable_data)
    keys = {id(obj): key for key, obj in gather_variables(root)}
    for td in trackable_data:
        key = keys.get(id(td.trackable))
        if key is not None:
            proto.nodes[td.node_id].attributes.add(
                name="VARIABLE_VALUE", checkpoint_key=key, full_name=util.get_full_name(td.trackable)
            )
    util.add_checkpoint_values_check(proto)
    return bytes(proto.SerializeToString(deterministic=True))


def export_checkpoint(
    store: Store, checkpoint_id: str, directory: str | Path, *, storage_options: dict[str, Any] | None = None
) -> str:
    """Write checkpoint ``checkpoint_id`` as a TF checkpoint into ``directory`` (a local folder or a store URL,
    opened with ``storage_options``) and name it the latest in the folder's state file; return its prefix."""
    info = store.manifest(checkpoint_id)
    with ExportFolder(directory, storage_options) as folder:
        return folder.write(f"{PREFIX_NAME}-{info.step}", store.load(checkpoint_id), info.committed_at)


class ExportFolder:
    """A folder (a local path or a store URL) TF checkpoints are written into, each named the latest in TF's state
    file once its files are whole; ``keep_last``: how many the state file lists (``None``: all)."""

    def __init__(
        self, directory: str | Path, storage_options: dict[str, Any] | None = None, *, keep_last: int | None = None
    ) -> None:
        scheme, rest = split_url(str(directory))
        self.local = require_output_folder(rest, "export folder") if scheme == "file" else None
        if self.local is not None:
            self.local.mkdir(parents=True, exist_ok=True)
        self.url = str(self.local) if self.local is not None else str(directory).rstrip("/")
        self.keep_last = keep_last
        self.backend = open_backend(self.url, storage_options)

    def close(self) -> None:
        self.backend.close()

    def __enter__(self) -> ExportFolder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def listed(self) -> list[tuple[str, float | None]]:
        """The checkpoints the state file lists, oldest first, with their timestamps (``None``: none for them)."""
        state = _state(self.backend)
        paths = [_basename(p) for p in state.all_model_checkpoint_paths]
        stamps = list(state.all_model_checkpoint_timestamps)
        return list(zip(paths, stamps if len(stamps) == len(paths) else [None] * len(paths), strict=True))

    def write(self, name: str, tensors: dict[str, np.ndarray], committed_at: float) -> str:
        """Write ``tensors`` (by TF checkpoint key; not changed) as checkpoint ``name``, then the state file naming
        it the latest, then delete the files of those it no longer lists; return its prefix."""
        if OBJECT_GRAPH_KEY in tensors:  # nodes' has_checkpoint_values set as TF writes them (older graphs lack it)
            from tensorflow.core.protobuf import trackable_object_graph_pb2
            from tensorflow.python.checkpoint import util

            proto = trackable_object_graph_pb2.TrackableObjectGraph()
            proto.ParseFromString(np.asarray(tensors[OBJECT_GRAPH_KEY]).item())
            util.add_checkpoint_values_check(proto)
            graph = np.array(bytes(proto.SerializeToString(deterministic=True)), dtype=object)
            tensors = {**tensors, OBJECT_GRAPH_KEY: graph}
        if self.local is not None:
            _save_v2(str(self.local / name), tensors)
            # The checkpoint's files and the folder on disk before the state file names them.
            for path in [*(p for p in self.local.iterdir() if _checkpoint_of(p.name) == name), self.local]:
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
        else:
            with tempfile.TemporaryDirectory(prefix="psguard-export-") as staging:
                _save_v2(str(Path(staging) / name), tensors)
                del tensors
                # One file at a time, the index (by which TF reads the checkpoint) last.
                for path in sorted(Path(staging).iterdir(), key=lambda p: (p.suffix == ".index", p.name)):
                    self.backend.put(path.name, path.read_bytes())
        from google.protobuf import text_format  # lazy: TF's dependency, only when exporting

        previous = _state(self.backend)
        state = _state_file(previous, name, committed_at, self.keep_last)
        self.backend.put(STATE_FILE, str(text_format.MessageToString(state)).encode())
        dropped = {_basename(p) for p in previous.all_model_checkpoint_paths}
        dropped -= {_basename(p) for p in state.all_model_checkpoint_paths}
        if dropped:  # only once the state file no longer names them
            self._delete(lambda key: _checkpoint_of(key) in dropped)
        return str(self.local / name) if self.local is not None else f"{self.url}/{name}"

    def remove_unlisted(self) -> list[str]:
        """Delete the files of checkpoints ``ckpt-<step>`` the state file does not list (what a killed
        writer left, ``SaveV2``'s ``.tempstate`` files included); return their names."""
        listed = {name for name, _ in self.listed()}
        names: set[str] = set()

        def unlisted(key: str) -> bool:
            name = _checkpoint_of(key)
            if name is None or name in listed or name.rsplit("-", 1)[0] != PREFIX_NAME:
                return False
            names.add(name)
            return True

        self._delete(unlisted)
        return sorted(names)

    def _delete(self, which: Callable[[str], bool]) -> None:
        """Delete the folder's files ``which`` selects, index files first (TF no longer opens the checkpoint)."""
        for key in sorted((k for k in self.backend.keys("") if which(k)), key=lambda k: ".index" not in k):
            self.backend.delete(key)


def _save_v2(prefix: str, tensors: dict[str, np.ndarray]) -> None:
    """One ``SaveV2`` of ``tensors``: each array goes to TF as it is (strings as ``object`` arrays of bytes)."""
    import tensorflow as tf  # lazy: TF only when exporting

    names = sorted(tensors)
    tf.raw_ops.SaveV2(
        prefix=prefix,
        tensor_names=names,
        shape_and_slices=[""] * len(names),
        tensors=[tf.constant(tensors[n]) for n in names],
    )


def _basename(path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[-1]


#: A checkpoint's files: ``NAME.index``, ``NAME.data-00000-of-00001``, and while ``SaveV2`` writes them
#: ``....tempstate<random>`` (renamed at the end).
_CHECKPOINT_FILE = re.compile(r"^([A-Za-z0-9_.-]+-[0-9]+)\.(?:index|data-[0-9]+-of-[0-9]+)(?:\.tempstate[0-9]+)?$")


def _checkpoint_of(key: str) -> str | None:
    """The checkpoint whose file ``key`` is (``ckpt-7`` for ``ckpt-7.index``), or ``None``."""
    m = _CHECKPOINT_FILE.match(key)
    return m.group(1) if m else None


def _state(backend: Backend) -> Any:
    """The folder's ``CheckpointState``; an empty one when there is none or TF could not read it (logged)."""
    from google.protobuf import text_format
    from tensorflow.python.training.checkpoint_state_pb2 import CheckpointState

    state = CheckpointState()
    try:
        text_format.Parse(backend.get(STATE_FILE).decode(), state)
    except ObjectNotFoundError:
        pass
    except (text_format.ParseError, UnicodeDecodeError) as e:
        log.warning("event=export_state_replaced reason=%s", f"the folder's {STATE_FILE} file is not TF's: {e}")
        state = CheckpointState()
    return state


def _state_file(state: Any, name: str, committed_at: float, keep_last: int | None = None) -> Any:
    """TF's ``checkpoint`` state naming ``name`` the latest, as ``tf.train.CheckpointManager`` writes it; the
    previous ``state``'s checkpoints stay listed (the ``keep_last - 1`` newest when set)."""
    from tensorflow.python.training.checkpoint_state_pb2 import CheckpointState

    paths = list(state.all_model_checkpoint_paths)
    stamps = list(state.all_model_checkpoint_timestamps)
    paired = len(stamps) == len(paths)  # TF's CheckpointManager ignores timestamps it cannot pair with paths
    keep = [i for i, p in enumerate(paths) if p != name]
    if keep_last is not None:
        keep = keep[max(0, len(keep) - (keep_last - 1)) :]
    return CheckpointState(
        model_checkpoint_path=name,
        all_model_checkpoint_paths=[paths[i] for i in keep] + [name],
        all_model_checkpoint_timestamps=[stamps[i] for i in keep] + [committed_at] if paired else [],
        last_preserved_timestamp=state.last_preserved_timestamp,
    )


def cmd_export(args: argparse.Namespace) -> int:
    require_output_store(args.out, "OUT")  # before reading anything: a bad OUT is a usage error
    check_url(args.out)
    with open_store(args) as store:
        cid = store.resolve(step=args.step, checkpoint_id=args.id)
        with metered_progress(args, "export", store.chain_bytes([cid]), store):
            prefix = export_checkpoint(store, cid, args.out, storage_options=parse_storage_options(args.out_option))
    doc = {"checkpoint": cid, "prefix": redact(prefix)}
    text = f"exported {cid} to {doc['prefix']} (TF's state file names it the latest: tf.train.latest_checkpoint)"
    print(json.dumps(doc) if args.json else text)
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("export", help="write a checkpoint as a standard TensorFlow checkpoint")
    add_store_arguments(p)
    p.add_argument("out", help="folder for the TF checkpoint and its state file: a path or a store URL (created)")
    p.add_argument("--out-option", action="append", metavar="KEY=VALUE", help="storage option for OUT; repeatable")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--step", type=int, help="the newest checkpoint of this step (default: the latest)")
    g.add_argument("--id", help="a checkpoint id")
    add_progress_argument(p)
    p.set_defaults(func=cmd_export)
