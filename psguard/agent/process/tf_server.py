"""One ``tf.distribute.Server`` task (PS or worker) as its own OS process.

Run as ``python -m psguard.agent.process.tf_server --cluster-spec JSON --job ps --index 0``. A separate process per
task is the point: a real PS or worker can then be killed, frozen and restarted alone, which is what
psguard's recovery has to survive. The process serves until it is killed. Started with ``PSGUARD_STANDBY=1``
it is a warm standby (:mod:`psguard.agent.process.standby`): it imports TensorFlow, then waits on stdin before binding.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import signal
import sys
from collections.abc import Sequence

from psguard.handoff.standby import is_standby, wait_for_go

_PR_SET_PDEATHSIG = 1


def _die_with_parent(parent_pid: int) -> None:
    """Ask the kernel to SIGKILL us when our parent dies.

    Servers run in their own session (so one can be killed alone), which also means nothing else stops
    them when a test process is killed with SIGKILL and cannot run its clean-up: they would hold ports and
    about 600 MB each until someone noticed. Linux only; elsewhere the parent's ``atexit`` has to do.
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    # The parent may have died between our fork and the prctl call: then nobody will signal us.
    if os.getppid() != parent_pid:
        os._exit(1)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m psguard.agent.process.tf_server", description=__doc__)
    p.add_argument("--cluster-spec", required=True, help='JSON, e.g. {"ps": ["127.0.0.1:1234"], ...}')
    p.add_argument("--job", required=True, choices=["ps", "worker", "chief", "evaluator"])
    p.add_argument("--index", required=True, type=int)
    p.add_argument("--protocol", default="grpc")
    p.add_argument(
        "--parent-pid",
        type=int,
        default=0,
        help="die (SIGKILL) when this process, our parent, exits; 0 keeps running",
    )
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.parent_pid:
        _die_with_parent(args.parent_pid)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
    spec = json.loads(args.cluster_spec)

    import tensorflow as tf  # late: importing costs 2.5-5 s, and --help should not pay it

    cluster = tf.train.ClusterSpec(spec)
    # A warm standby (psguard.agent.process.standby): everything but the bind is done; serve only when told to.
    if is_standby() and not wait_for_go():
        return 0
    server = tf.distribute.Server(
        cluster,
        job_name=args.job,
        task_index=args.index,
        protocol=args.protocol,
        start=True,
    )
    # One line for the log file; readiness itself is observed on the port by whoever waits for us.
    print(f"psguard server {args.job}:{args.index} serving {server.target} pid {os.getpid()}", flush=True)
    server.join()
    return 0


if __name__ == "__main__":
    sys.exit(main())
