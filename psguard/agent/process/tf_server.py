"""One ``tf.distribute.Server`` task (PS or worker) as its own OS process, so that it can be killed, frozen and
restarted alone. ``python -m psguard.agent.process.tf_server --cluster-spec JSON --job ps --index 0`` serves until
killed; with ``PSGUARD_STANDBY=1`` it is a warm standby (:mod:`psguard.agent.process.standby`).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import sys
import types
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, cast

from psguard.agent.process.reaper import die_with_parent
from psguard.handoff.contract import ENV_SERVER_IMPORT
from psguard.handoff.mapped import load_into_server
from psguard.handoff.standby import is_standby, wait_for_go


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m psguard.agent.process.tf_server", description=__doc__)
    p.add_argument("--cluster-spec", required=True, help='JSON, e.g. {"ps": ["127.0.0.1:1234"], ...}')
    p.add_argument("--job", required=True, choices=["ps", "worker", "chief", "evaluator"])
    p.add_argument("--index", required=True, type=int)
    p.add_argument("--parent-pid", type=int, default=0, help="die with this parent process (0: never)")
    return p.parse_args(argv)


class _ServerApi(Protocol):
    def TF_NewServer(self, server_def: bytes) -> Any: ...  # TF's C API names
    def TF_ServerStart(self, server: Any) -> None: ...
    def TF_ServerJoin(self, server: Any) -> None: ...
    def TF_ServerTarget(self, server: Any) -> str: ...


def lean_import_allowed(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether this process may load TF's server without ``import tensorflow`` (1 s instead of 9-10 s of CPU, on
    every cold restart's path): not where device plugins or modular filesystems, which only the full import
    loads, are configured, nor when the user asks for the full import."""
    if environ.get(ENV_SERVER_IMPORT, "").lower() == "full":
        return False
    if environ.get("TF_PLUGGABLE_DEVICE_LIBRARY_PATH"):
        return False
    if environ.get("TF_USE_MODULAR_FILESYSTEM", "0") in ("1", "true"):
        return False
    spec = importlib.util.find_spec("tensorflow")
    if spec is None or not spec.submodule_search_locations:
        return False
    return not any((Path(p).parent / "tensorflow-plugins").is_dir() for p in spec.submodule_search_locations)


def lean_server_api() -> _ServerApi:
    """TF's server C API with its kernels loaded, without running ``tensorflow/__init__.py``: a package object
    stands in for ``tensorflow`` so that importing its submodules does not run it. The unit tests compare the
    kernel registry with a full import's. Only for a process that serves and never runs TF's Python API."""
    spec = importlib.util.find_spec("tensorflow")
    assert spec is not None and spec.submodule_search_locations is not None
    package = types.ModuleType("tensorflow")
    package.__path__ = list(spec.submodule_search_locations)
    package.__file__ = spec.origin
    sys.modules["tensorflow"] = package
    importlib.import_module("tensorflow.python.pywrap_tensorflow")
    return cast(_ServerApi, importlib.import_module("tensorflow.python.client.pywrap_tf_session"))


def server_def(spec: Mapping[str, Any], job: str, index: int, protocol: str) -> bytes:
    """The serialized ``tf.train.ServerDef`` that ``tf.distribute.Server(ClusterSpec(spec), ...)`` builds.

    ``spec`` maps each job to a list of addresses (task i at position i) or to ``{index: address}``, as
    ``tf.train.ClusterSpec`` accepts. Importing the protos needs the ``tensorflow`` package stand-in or TF itself.
    """
    from tensorflow.core.protobuf import cluster_pb2, tensorflow_server_pb2

    cluster = cluster_pb2.ClusterDef()
    for name in sorted(spec):
        tasks = spec[name]
        job_def = cluster.job.add(name=name)
        pairs = enumerate(tasks) if isinstance(tasks, list) else ((int(k), v) for k, v in dict(tasks).items())
        for i, address in pairs:
            job_def.tasks[i] = address
    if job not in spec:
        raise ValueError(f"job {job!r} is not in the cluster spec (jobs: {sorted(spec)})")
    if index not in {int(i) for j in cluster.job if j.name == job for i in j.tasks}:
        raise ValueError(f"task {job}:{index} is not in the cluster spec")
    server = tensorflow_server_pb2.ServerDef(cluster=cluster, job_name=job, task_index=index, protocol=protocol)
    return bytes(server.SerializeToString())


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.parent_pid:
        die_with_parent(args.parent_pid)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
    spec = json.loads(args.cluster_spec)

    # Late: importing costs 1 s lean, 9-10 s full, and --help should pay neither.
    if lean_import_allowed():
        try:
            api = lean_server_api()
        except (ImportError, AttributeError, OSError) as e:
            # A TF whose layout the lean start does not know: start again the way TF documents.
            print(f"psguard server: lean start failed ({e!r}); importing tensorflow", file=sys.stderr, flush=True)
            args_again = list(sys.argv[1:] if argv is None else argv)
            env = {**os.environ, ENV_SERVER_IMPORT: "full"}
            os.execve(sys.executable, [sys.executable, "-m", __spec__.name if __spec__ else __name__, *args_again], env)
    else:  # device plugins and modular filesystems load with the package; the server is the same C API's
        importlib.import_module("tensorflow")
        api = cast(_ServerApi, importlib.import_module("tensorflow.python.client.pywrap_tf_session"))
    mapped = load_into_server()
    definition = server_def(spec, args.job, args.index, "grpc")
    # A warm standby (psguard.agent.process.standby): everything but the bind is done; serve only when told.
    if is_standby() and not wait_for_go():
        return 0
    server = api.TF_NewServer(definition)
    api.TF_ServerStart(server)
    # One line for the log file; readiness itself is observed on the port by whoever waits for us.
    op = ", zero-copy restore op loaded" if mapped else ""
    target = api.TF_ServerTarget(server)
    print(f"psguard server {args.job}:{args.index} serving {target} pid {os.getpid()}{op}", flush=True)
    api.TF_ServerJoin(server)
    return 0


if __name__ == "__main__":
    sys.exit(main())
