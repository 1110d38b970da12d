"""``psguard follow URL``: print each checkpoint as it is committed, for scripts and for people watching a job.

It reads manifests only (no tensor data, no TensorFlow); a process that wants the checkpoints' values in its
own variables uses :class:`psguard.Follower`.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time

from psguard.errors import ConfigError
from psguard.store.cli import add_store_arguments, open_store
from psguard.store.index import CheckpointInfo


def _line(info: CheckpointInfo, json_lines: bool) -> str:
    if json_lines:
        return json.dumps({**info.to_json(), "seen_at": time.time()})
    return (
        f"step {info.step:>10}  {info.kind:5}  {info.id}  "
        f"{info.stored_bytes} bytes stored  (lag {max(0.0, time.time() - info.committed_at):.1f}s)"
    )


def follow(args: argparse.Namespace, stop: threading.Event | None = None) -> int:
    stop = stop or threading.Event()
    printed = 0
    with open_store(args, must_exist=False) as store:  # may start before the job creates the store
        seen: set[str] = set()
        if not args.from_start:
            latest = store.latest()
            if latest is not None:
                print(_line(latest, args.json), flush=True)
                printed += 1
            seen.update(store.checkpoint_ids())
        while not stop.is_set() and (args.exit_after is None or printed < args.exit_after):
            for info in store.checkpoints():  # oldest first: commits are printed in step order
                if info.id in seen:
                    continue
                seen.add(info.id)
                print(_line(info, args.json), flush=True)
                printed += 1
                if args.exit_after is not None and printed >= args.exit_after:
                    return 0
            stop.wait(args.interval)
    return 0


def _cmd(args: argparse.Namespace) -> int:
    if not args.interval > 0:
        raise ConfigError(f"--interval must be a number of seconds > 0, got {args.interval}")
    if args.exit_after is not None and args.exit_after < 1:
        raise ConfigError(f"--exit-after must be at least 1, got {args.exit_after}")
    try:
        return follow(args)
    except BrokenPipeError:  # `psguard follow ... | head`: the reader is gone, so are we
        sys.stderr.close()
        return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("follow", help="print each newly committed checkpoint as it lands (until Ctrl-C)")
    add_store_arguments(p)
    p.add_argument("--interval", type=float, default=1.0, metavar="SECONDS", help="how often to list (default 1)")
    p.add_argument("--from-start", action="store_true", help="print every committed checkpoint first, oldest first")
    p.add_argument("--exit-after", type=int, metavar="N", help="exit after printing N checkpoints")
    p.set_defaults(func=_cmd)
