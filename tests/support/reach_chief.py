"""A chief that puts a worker's gRPC connection to a PS into reconnect backoff, for test_recovery.py.

It owns a 2-PS, 1-worker LocalCluster. It kills ps:0 and calls it from the worker while it is down (the call
fails to connect: the worker's gRPC backs off that address for up to 1.2 s), restarts ps:0, resets the cluster
context and runs psguard.trainer.recovery.reach_every_ps, then calls ps:0 from the worker at once. Then it
kills the worker (a reach goes on without it) and ps:1 for good (a reach with a short deadline fails). Prints one
JSON line.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

import tensorflow as tf

from psguard.testbed.cluster import LocalCluster
from psguard.trainer.recovery import is_cluster_failure, reach_every_ps, reset_cluster_context

PS0 = "/job:ps/replica:0/task:0"
WORKER = "/job:worker/replica:0/task:0"


def main() -> None:
    out: dict[str, Any] = {}
    with LocalCluster(num_ps=2, num_workers=1, standby=True) as cluster:
        tf.distribute.experimental.ParameterServerStrategy(cluster.cluster_resolver())  # connects this process

        def on_ps0() -> Any:
            with tf.device(PS0):
                return tf.timestamp()

        from_worker = tf.function(on_ps0, autograph=False)

        def call_from_worker() -> None:
            with tf.device(WORKER):
                from_worker().numpy()

        call_from_worker()
        cluster.wait_standby()
        cluster.kill("ps", 0)
        try:  # only the worker calls the dead PS: the chief's own reset would wait its backoff out for both
            call_from_worker()
            out["down_call_failed"] = False
        except tf.errors.OpError:
            out["down_call_failed"] = True
        cluster.restart("ps", 0)
        reset_cluster_context()
        out["chief_failed_calls"] = reach_every_ps(workers=False)
        out["worker_failed_calls"] = reach_every_ps(workers=True)
        try:
            call_from_worker()
            out["worker_call_after_reach"] = "ok"
        except tf.errors.OpError as e:
            out["worker_call_after_reach"] = str(e).splitlines()[0]

        cluster.kill("worker", 0)  # a worker down itself: left to the coordinator, the reach goes on without it
        t0 = time.monotonic()
        out["dead_worker_failed_calls"] = reach_every_ps(workers=True, deadline=10.0)
        out["dead_worker_seconds"] = time.monotonic() - t0

        cluster.kill("ps", 1)
        t0 = time.monotonic()
        try:
            reach_every_ps(workers=False, deadline=1.0)
            out["dead_ps"] = "reached"
        except tf.errors.OpError as e:
            out["dead_ps"] = "cluster failure" if is_cluster_failure(e) else f"other: {e}"
        out["dead_ps_seconds"] = time.monotonic() - t0
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
