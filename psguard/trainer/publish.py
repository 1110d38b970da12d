"""``psguard publish STORE FOLDER``: TF checkpoints of a job's durable commits, for tools that read only TF's.

A publisher is a process of its own (a publication costs a full TF checkpoint write, which the trainer must not
pay): as durable commits land it writes them into a folder as ``psguard export`` does
(:mod:`psguard.trainer.export`). It holds the tensors of the commit it published last and moves them to the next
as a :class:`~psguard.Follower` does: by the deltas when they cost fewer bytes, else by a full read, everything
verified before anything changes (a corrupt commit is skipped and never published). Killed at any moment, it
leaves a folder TF reads; the next publisher deletes what the state file does not list and carries on from the
checkpoint it lists last. Cadence (``--every``, ``--min-interval`` between commit times, or every commit) is
asked about the newest commit only: skipped commits are not written later.
"""

from __future__ import annotations

import argparse
import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np

from psguard.errors import ConfigError, CorruptCheckpointError, NoCheckpointError, UnsupportedFormatError
from psguard.policy.engine import EveryInterval, EverySteps, SaveContext, SavePolicy, TierState
from psguard.storage.registry import check_url, redact
from psguard.store import CheckpointInfo, Store
from psguard.store.cli import add_store_arguments, open_store, parse_storage_options, require_output_store
from psguard.tensors import Rows, apply_update
from psguard.trainer.export import PREFIX_NAME, ExportFolder
from psguard.trainer.follower import deltas_on_the_way, full_bytes
from psguard.trainer.variables import writable

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Published:
    """One publication: the commit, the TF prefix, how the commit was read and at what cost, how long the
    write took and how long after the commit it was listed."""

    checkpoint: str
    step: int
    prefix: str
    via: str  # "deltas" or "a full read"
    bytes_read: int
    write_seconds: float
    lag_seconds: float


class Publisher:
    """Publish the newest durable commit of ``store`` into ``folder`` whenever ``cadence`` says it is due
    (``None``: every commit). Checkpoints are named ``ckpt-<step>``."""

    def __init__(self, store: Store, folder: ExportFolder, *, cadence: SavePolicy | None = None) -> None:
        self.store = store
        self.folder = folder
        self.cadence = cadence
        self._tensors: dict[str, np.ndarray] | None = None  # the commit held, by TF checkpoint key
        self._held: str | None = None
        self._bad: dict[str, str] = {}  # commit id -> why it is not published (not tried again)
        removed = folder.remove_unlisted()
        if removed:
            log.warning(
                "event=publish_unlisted_removed folder=%s checkpoints=%s reason=%s",
                redact(folder.url),
                ",".join(removed),
                "files of checkpoints the state file does not list (a publisher killed mid-write left them)",
            )

    def poll(self) -> Published | None:
        """Publish the newest commit if it is due and not listed yet; what was published, or ``None``."""
        last = self._last()
        for info in reversed(self.store.checkpoints()):
            if last is not None and last.step is not None and info.step <= last.step:
                return None
            if info.id in self._bad:
                continue
            if last is not None and self.cadence is not None:  # by the commit times: a restart decides as before
                verdict = self.cadence.should_save(info.step, info.committed_at, last=last, context=SaveContext())
                if not verdict:
                    log.debug("event=publish_waiting checkpoint=%s reason=%s", info.id, verdict.reason)
                    return None
            try:
                return self._publish(info)
            except (CorruptCheckpointError, UnsupportedFormatError, NoCheckpointError) as e:
                self._bad[info.id] = str(e)
                log.warning("event=publish_skipped checkpoint=%s step=%d reason=%s", info.id, info.step, e)
        return None

    def run(
        self,
        *,
        poll_interval: float = 1.0,
        stop: threading.Event | None = None,
        exit_after: int | None = None,
        on_published: Callable[[Published], None] | None = None,
    ) -> int:
        """Publish until ``stop`` is set (or ``exit_after`` publications); how many were published."""
        stop = stop or threading.Event()
        done = 0
        while not stop.is_set() and (exit_after is None or done < exit_after):
            published = self.poll()
            if published is None:
                stop.wait(poll_interval)
                continue
            done += 1
            if on_published is not None:
                on_published(published)
        return done

    # ------------------------------------------------------------------------------------------ deciding
    def _last(self) -> TierState | None:
        """The folder's latest listed checkpoint of this prefix: its step and commit time (``None``: none)."""
        for name, stamp in reversed(self.folder.listed()):
            head, _, number = name.rpartition("-")
            if head == PREFIX_NAME and number.isdigit():
                return TierState(step=int(number), at=stamp)
        return None

    # ------------------------------------------------------------------------------------------ writing
    def _publish(self, info: CheckpointInfo) -> Published:
        via, nbytes = self._move_to(info)
        assert self._tensors is not None
        started = time.monotonic()
        prefix = self.folder.write(f"{PREFIX_NAME}-{info.step}", self._tensors, info.committed_at)
        lag = max(0.0, time.time() - info.committed_at)
        done = Published(info.id, info.step, redact(prefix), via, nbytes, time.monotonic() - started, lag)
        log.info(
            "event=published %s",
            " ".join(f"{k}={round(v, 2) if isinstance(v, float) else v}" for k, v in asdict(done).items()),
        )
        return done

    def _move_to(self, info: CheckpointInfo) -> tuple[str, int]:
        """Make the tensors held those of commit ``info``: by its deltas when they cost no more, else whole;
        everything read and verified before the tensors held change."""
        chain = self.store.chain(info.id)
        names = list(chain[-1].tensors)
        on_the_way = deltas_on_the_way(chain, self._held, names)
        if self._tensors is not None and on_the_way is not None:
            read = [self.store.updates(m.id) for m in on_the_way]
            held, self._tensors, self._held = self._tensors, None, None  # unknown until every update is in
            for updates, _ in read:
                for name, update in updates.items():
                    current = held.get(name)  # rows are written in place: a read-only buffer is copied first
                    held[name] = apply_update(
                        writable(current) if isinstance(update, Rows) and current is not None else current, update
                    )
            self._tensors, self._held = {name: held[name] for name in names}, info.id
            return "deltas", sum(n for _, n in read)
        self._tensors, self._held = None, None
        self._tensors, self._held = self.store.load(info.id), info.id
        return "a full read", full_bytes(chain, names)


def cmd_publish(args: argparse.Namespace) -> int:
    require_output_store(args.out, "FOLDER")  # before reading anything: a bad FOLDER is a usage error
    check_url(args.out)
    if args.keep < 1:
        raise ConfigError(f"--keep must be at least 1, got {args.keep}")
    if not args.poll > 0:
        raise ConfigError(f"--poll must be a number of seconds > 0, got {args.poll}")
    if args.exit_after is not None and args.exit_after < 1:
        raise ConfigError(f"--exit-after must be at least 1, got {args.exit_after}")
    cadence: SavePolicy | None = None  # every commit
    if args.every is not None:
        cadence = EverySteps(args.every)
    elif args.min_interval is not None:
        cadence = EveryInterval(args.min_interval)

    def show(p: Published) -> None:
        if args.json:
            print(json.dumps(asdict(p)), flush=True)
        else:
            print(
                f"step {p.step:>10}  {p.checkpoint}  -> {p.prefix}  ({p.via}, {p.bytes_read} bytes read, "
                f"written in {p.write_seconds:.1f}s, lag {p.lag_seconds:.1f}s)",
                flush=True,
            )

    options = parse_storage_options(args.out_option)
    with open_store(args, must_exist=False) as store, ExportFolder(args.out, options, keep_last=args.keep) as folder:
        Publisher(store, folder, cadence=cadence).run(
            poll_interval=args.poll, exit_after=args.exit_after, on_published=show
        )
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "publish", help="write TF checkpoints (and TF's state file) of a store's commits into a folder as they land"
    )
    add_store_arguments(p)
    p.add_argument("out", metavar="FOLDER", help="folder for the TF checkpoints: a path or a store URL (created)")
    p.add_argument("--out-option", action="append", metavar="KEY=VALUE", help="storage option for FOLDER; repeatable")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--every", type=int, metavar="N", help="publish a commit N steps or more after the last one")
    g.add_argument(
        "--min-interval",
        type=float,
        metavar="SECONDS",
        help="publish a commit made SECONDS or more after the last one published (default: every commit)",
    )
    p.add_argument("--keep", type=int, default=5, metavar="K", help="checkpoints the state file lists (default 5)")
    p.add_argument("--poll", type=float, default=1.0, metavar="SECONDS", help="how often to list (default 1)")
    p.add_argument("--exit-after", type=int, metavar="N", help="exit after publishing N checkpoints")
    p.set_defaults(func=cmd_publish)
