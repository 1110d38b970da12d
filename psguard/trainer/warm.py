"""A warm trainer: the next trainer process, started ahead of need with TensorFlow imported, waiting to run the
user's script.

A trainer that cannot rejoin in process (no model factory: ``exit_for_restart``, or any crash) is restarted by its
``psguard agent``, and most of that restart was starting Python and importing TensorFlow again (measured under
``psguard wrap`` with the unmodified custom-loop example: 5.7-8.0 s from a kill -9 of the trainer to its next
capture). The agent keeps one such process ready instead, as it does for the PS and worker servers
(:mod:`psguard.agent.process.standby`): ``python -m psguard.trainer.warm SCRIPT ARGS...`` (or ``-m MODULE ARGS...``)
imports TensorFlow, says it is ready, and blocks on stdin. On ``go`` it reads the environment the trainer must
have *now* (one JSON line: the agent may have learnt things since the standby started, such as the PS-side
shard folders), replaces its own with it, and runs the script as ``python SCRIPT ARGS...`` would: as
``__main__``, with ``sys.argv`` and ``sys.path[0]`` set the same way. End of file instead of ``go``: nobody
needs it any more, it exits 0.

What differs from a cold start, and why it is safe: modules imported before the script runs (TensorFlow and
what it imports) were initialised under the environment the standby was started with, which is the agent's
environment for the task minus what it learnt later; those are only psguard's own variables, which TensorFlow
does not read.
"""

from __future__ import annotations

import json
import os
import runpy
import sys

from psguard.handoff.standby import READY_ENV, STANDBY_ENV, wait_for_go

__all__ = ["main"]


def _usage() -> int:
    print("usage: python -m psguard.trainer.warm SCRIPT [ARGS...] | -m MODULE [ARGS...]", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or (args[0] == "-m" and len(args) < 2):
        return _usage()
    if os.environ.get(STANDBY_ENV) == "1":
        import tensorflow  # noqa: F401  - the point of a warm trainer: this import is most of a restart

        if not wait_for_go():
            return 0
        line = sys.stdin.buffer.readline()
        try:
            env = json.loads(line)
        except ValueError:
            print("psguard.trainer.warm: no environment after 'go'; not starting", file=sys.stderr)
            return 2
        if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
            print("psguard.trainer.warm: the environment after 'go' is not a JSON object of strings", file=sys.stderr)
            return 2
        os.environ.clear()
        os.environ.update(env)
    # Whatever the spawner said, the script must not believe it is a standby (nor pass that on to its children).
    os.environ.pop(STANDBY_ENV, None)
    os.environ.pop(READY_ENV, None)
    if args[0] == "-m":
        sys.argv = [args[1], *args[2:]]
        sys.path[0] = os.getcwd()
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(args)
        sys.path[0] = os.path.dirname(os.path.realpath(args[0]))  # as python SCRIPT does: symlinks resolved
        runpy.run_path(args[0], run_name="__main__")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
