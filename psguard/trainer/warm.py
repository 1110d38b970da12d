"""A warm trainer: the next trainer process, started ahead of need with TensorFlow imported, waiting to run the
user's script (starting Python and importing TensorFlow was most of a trainer restart: 5.7-8.0 s).

``python -m psguard.trainer.warm SCRIPT ARGS...`` (or ``-m MODULE ARGS...``) imports TensorFlow, says it is ready
(:mod:`psguard.handoff.standby`) and blocks on stdin. On ``go`` it reads the environment the trainer must have now
(one JSON line), replaces its own with it and runs the script as ``python SCRIPT ARGS...`` would; end of file
instead: it exits 0. Only psguard's own variables can differ from a cold start, and TensorFlow reads none.
"""

from __future__ import annotations

import json
import os
import runpy
import sys

from psguard.handoff.standby import READY_ENV, STANDBY_ENV, wait_for_go


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or (args[0] == "-m" and len(args) < 2):
        print("usage: python -m psguard.trainer.warm SCRIPT [ARGS...] | -m MODULE [ARGS...]", file=sys.stderr)
        return 2
    if os.environ.get(STANDBY_ENV) == "1":
        import tensorflow  # noqa: F401  - the point of a warm trainer: this import is most of a restart

        if not wait_for_go():
            return 0
        try:
            env = json.loads(sys.stdin.buffer.readline())
        except ValueError:
            env = None
        if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
            print("psguard.trainer.warm: no JSON object of strings (the environment) after 'go'", file=sys.stderr)
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
