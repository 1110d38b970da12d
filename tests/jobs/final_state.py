"""The test's only hook in the job scripts: their final step and a digest of every variable, as one JSON line.

``report(root, step)`` walks the object graph that a ``tf.train.Checkpoint`` of ``root`` would save (TF's own
traversal, slot variables included) and prints ``{"event": "final", "step": ..., "state": {path: digest}}``.
A partitioned variable is digested whole (its shards concatenated), as a checkpoint stores it. The test then
looks every digest up in the newest checkpoint the job left: the final state must be there bit for bit.
Nothing here knows about psguard (and TensorFlow is imported only by ``state``: the test uses ``digest``).
"""

import hashlib
import json

import numpy as np


def digest(value) -> str:
    """dtype, shape and bytes of an array, hashed (the test computes the same from a checkpoint)."""
    a = np.ascontiguousarray(np.asarray(value))
    h = hashlib.sha256(f"{a.dtype.str}{a.shape}".encode())
    h.update(a.tobytes())
    return h.hexdigest()


def _value(obj):
    from tensorflow.python.distribute import sharded_variable

    if isinstance(obj, sharded_variable.ShardedVariableMixin):
        return np.concatenate([v.numpy() for v in obj.variables], axis=0)
    return obj.numpy()


def state(root) -> dict:
    """{checkpoint path: digest} of every variable a checkpoint of ``root`` holds."""
    import tensorflow as tf
    from tensorflow.python.checkpoint import graph_view, util
    from tensorflow.python.distribute import sharded_variable

    view = graph_view.ObjectGraphView(root)
    objects, _, _, _, names = util.objects_ids_and_slot_variables_and_paths(view)
    shards = {id(v) for obj in objects if isinstance(obj, sharded_variable.ShardedVariableMixin) for v in obj.variables}
    out = {}
    for obj in objects:
        if id(obj) in shards:
            continue  # a part of a partitioned variable that the traversal also reached on its own
        if isinstance(obj, sharded_variable.ShardedVariableMixin | tf.Variable):
            out[names[obj] or "(root)"] = digest(_value(obj))
    return out


def report(root, step) -> None:
    print(json.dumps({"event": "final", "step": int(step), "state": state(root)}), flush=True)
