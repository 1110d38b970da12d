"""Standard TensorFlow checkpoints out of psguard stores: users are never locked in.

psguard stores each logical tensor under its TF checkpoint key, plus TF's object graph (the
``_CHECKPOINTABLE_OBJECT_GRAPH`` tensor ``tf.train.Checkpoint`` writes), so an export is a plain ``SaveV2``
of those tensors: ``tf.train.Checkpoint(...).restore(prefix)`` and ``tf.train.list_variables`` read it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from psguard.store import Store
from psguard.store.cli import (
    add_progress_argument,
    add_store_arguments,
    metered_progress,
    open_store,
    require_output_folder,
)
from psguard.trainer.variables import gather_variables

OBJECT_GRAPH_KEY = "_CHECKPOINTABLE_OBJECT_GRAPH"
VARIABLE_SUFFIX = "/.ATTRIBUTES/VARIABLE_VALUE"


def object_graph_bytes(root: Any) -> bytes:
    """TF's serialized ``TrackableObjectGraph`` for ``root``, built without reading any variable.

    ``tf.train.Checkpoint.write`` produces the same proto but reads every tensor to do so (whole embedding
    tables to the chief); here only the graph is walked and each variable node gets the attribute that names
    its checkpoint key.
    """
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
    data: bytes = proto.SerializeToString(deterministic=True)
    return data


def export_checkpoint(store: Store, checkpoint_id: str, directory: str | Path, *, prefix_name: str = "ckpt") -> str:
    """Write checkpoint ``checkpoint_id`` as a TF checkpoint in ``directory``; return its prefix."""
    import numpy as np
    import tensorflow as tf

    out = require_output_folder(directory, "export folder")
    out.mkdir(parents=True, exist_ok=True)
    info = store.manifest(checkpoint_id)
    prefix = str(out / f"{prefix_name}-{info.step}")
    tensors = store.load(checkpoint_id)
    if OBJECT_GRAPH_KEY in tensors:
        tensors[OBJECT_GRAPH_KEY] = np.array(tensors[OBJECT_GRAPH_KEY].item())
    names = sorted(tensors)
    tf.raw_ops.SaveV2(
        prefix=prefix,
        tensor_names=names,
        shape_and_slices=[""] * len(names),
        tensors=[tf.constant(tensors[n]) for n in names],
    )
    name = Path(prefix).name
    (out / "checkpoint").write_text(f'model_checkpoint_path: "{name}"\nall_model_checkpoint_paths: "{name}"\n')
    return prefix


def cmd_export(args: argparse.Namespace) -> int:
    require_output_folder(args.out, "OUT")  # before reading anything: a bad OUT is a usage error
    with open_store(args) as store:
        cid = store.resolve(step=args.step, checkpoint_id=args.id)
        with metered_progress(args, "export", store.chain_bytes([cid]), store):
            prefix = export_checkpoint(store, cid, args.out)
    doc = {"checkpoint": cid, "prefix": prefix}
    print(json.dumps(doc) if args.json else f"exported {cid} to {prefix} (read it with tf.train.Checkpoint.restore)")
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("export", help="write a checkpoint as a standard TensorFlow checkpoint")
    add_store_arguments(p)
    p.add_argument("out", help="folder for the TF checkpoint (created)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--step", type=int, help="the newest checkpoint of this step (default: the latest)")
    g.add_argument("--id", help="a checkpoint id")
    add_progress_argument(p)
    p.set_defaults(func=cmd_export)
