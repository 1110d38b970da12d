"""The built-in server's lean start: TF's runtime without ``import tensorflow``, the same server and kernels."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from psguard.agent.process import tf_server
from psguard.handoff.contract import ENV_SERVER_IMPORT, PLAIN_TF_SERVERS

SPECS = [
    {"ps": ["127.0.0.1:1001", "127.0.0.1:1002"], "worker": ["127.0.0.1:1003"], "chief": ["127.0.0.1:1004"]},
    {"worker": {"3": "127.0.0.1:2003", "0": "127.0.0.1:2000"}, "ps": ["127.0.0.1:2010"]},  # sparse, as TF allows
]


@pytest.mark.parametrize("spec", SPECS)
def test_the_server_def_is_the_one_tf_distribute_server_builds(spec: dict[str, object]) -> None:
    import tensorflow as tf
    from tensorflow.python.training import server_lib

    job, index = ("worker", 3) if isinstance(spec["worker"], dict) else ("ps", 1)
    sparse = {k: ({int(i): a for i, a in v.items()} if isinstance(v, dict) else v) for k, v in spec.items()}
    theirs = server_lib._make_server_def(tf.train.ClusterSpec(sparse), job, index, "grpc", None)
    ours = tf_server.server_def(json.loads(json.dumps(spec)), job, index, "grpc")
    assert type(theirs).FromString(ours) == theirs


def test_a_task_outside_the_spec_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="job 'chief' is not in the cluster spec"):
        tf_server.server_def({"ps": ["a:1"]}, "chief", 0, "grpc")
    with pytest.raises(ValueError, match="task ps:2 is not in the cluster spec"):
        tf_server.server_def({"ps": ["a:1", "a:2"]}, "ps", 2, "grpc")


def test_the_full_import_is_kept_when_asked_or_when_plugins_are_configured(tmp_path: Path) -> None:
    assert tf_server.lean_import_allowed({})
    assert not tf_server.lean_import_allowed(PLAIN_TF_SERVERS)
    assert not tf_server.lean_import_allowed({ENV_SERVER_IMPORT: "FULL"})
    assert not tf_server.lean_import_allowed({"TF_PLUGGABLE_DEVICE_LIBRARY_PATH": str(tmp_path / "plugin.so")})
    assert not tf_server.lean_import_allowed({"TF_USE_MODULAR_FILESYSTEM": "1"})


_REGISTRY = """
import json, sys
from psguard.agent.process import tf_server
if sys.argv[1] == "lean":
    tf_server.lean_server_api()
else:
    import tensorflow
from tensorflow.python.client import pywrap_tf_session as c_api
from tensorflow.core.framework import kernel_def_pb2
kernels = kernel_def_pb2.KernelList.FromString(c_api.TF_GetBuffer(c_api.TF_GetAllRegisteredKernels()))
print(json.dumps({
    "kernels": sorted({k.op + "/" + k.device_type for k in kernels.kernel}),
    "keras": any(m.split(".")[0] == "keras" for m in sys.modules),
}))
"""


@pytest.mark.slow
def test_the_lean_start_registers_every_kernel_a_full_import_does() -> None:
    """The PS runs whatever ops the coordinator sends it: a kernel missing from the lean start would fail a job.

    TF's Python API loads one contrib op library of its own (``AudioMicrofrontend``, tf.lite's audio frontend), a
    PS never runs it; anything else missing is a TF layout the lean start does not know.
    """
    out = {}
    for mode in ("lean", "full"):
        done = subprocess.run(
            [sys.executable, "-c", _REGISTRY, mode],
            capture_output=True,
            text=True,
            timeout=300,
            env={"TF_CPP_MIN_LOG_LEVEL": "3", "PATH": "/usr/bin:/bin"},
        )
        assert done.returncode == 0, done.stderr[-3000:]
        out[mode] = json.loads(done.stdout.strip().splitlines()[-1])
    lean, full = set(out["lean"]["kernels"]), set(out["full"]["kernels"])
    assert len(full) > 1000
    assert full - lean <= {"AudioMicrofrontend/CPU"}, sorted(full - lean)
    assert not out["lean"]["keras"] and out["full"]["keras"]  # what the lean start saves
