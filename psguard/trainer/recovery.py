"""Trainer-side recovery from a lost parameter server.

TF survives a lost worker but not a lost PS: every variable handle the chief holds dies with it. Two ways back:
:func:`run_with_recovery` rebuilds in this process (``build`` again, after every PS is restarted and the eager
context's cluster reset), or :func:`exit_for_restart` exits with ``EXIT_RESTART`` (75) for ``psguard agent`` to
restart the trainer. Every PS is restarted, not only the dead one: a survivor keeps the previous generation's
variables, so its memory would grow with every recovery.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, NoReturn, TypeVar

from psguard.errors import PsguardError
from psguard.handoff.client import report_failure
from psguard.handoff.contract import EXIT_RESTART
from psguard.handoff.plan import failure_moment
from psguard.trainer.deferred_init import MIN_BYTES, deferred_initial_values
from psguard.trainer.registry import process_managers

log = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")

#: How long a new generation waits for every worker to reach every PS again (past gRPC's reconnect backoff).
REACH_SECONDS = 20.0

#: How long an in-process rejoin waits for TF to reset the cluster context before the process leaves for a restart.
RESET_SECONDS = 120.0

#: How long the failed generation's collection waits for the PS restart's request to leave (see run_with_recovery).
_SEND_FIRST_SECONDS = 0.05

_FAILURE_TEXT = (
    "context_id",
    "remote_handle",
    "device incarnation",
    "was probably restarted",
    "Socket closed",
    "Connection reset",
    "failed to connect",
    "UNAVAILABLE",
)


def is_cluster_failure(exc: BaseException) -> bool:
    """True when ``exc`` means a task of the cluster died or restarted (as opposed to a bug in the model)."""
    try:
        import tensorflow as tf
    except ImportError:  # pragma: no cover - psguard's trainer side always has TF
        return False
    seen = 0
    cur: BaseException | None = exc
    while cur is not None and seen < 8:
        if isinstance(cur, (tf.errors.UnavailableError, tf.errors.AbortedError)):
            return True
        if isinstance(cur, (tf.errors.InvalidArgumentError, tf.errors.CancelledError, tf.errors.NotFoundError)) and any(
            t in str(cur) for t in _FAILURE_TEXT
        ):
            return True
        cur = cur.__cause__ or cur.__context__
        seen += 1
    return False


def _failure_time(seen_at: float | None = None) -> float:
    """The ``failed_at`` for the chief's agent (:func:`psguard.handoff.plan.failure_moment`)."""
    return failure_moment(time.time() if seen_at is None else seen_at, process_managers.generation_ran_at())


def exit_for_restart(exc: BaseException | None = None, *, failed_at: float | None = None) -> NoReturn:
    """Tell the agent when the failure was seen, then leave with the exit code that asks ``psguard agent`` for an
    immediate restart, by ``os._exit`` (tearing TensorFlow down took 8-17 s). Without a sidecar, call
    ``manager.wait()`` first so pending durable writes finish."""
    log.error("cluster failure (%s): exiting with %d so the agent restarts the trainer", exc, EXIT_RESTART)
    report_failure(_failure_time(failed_at), step=process_managers.last_seen_step())
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(EXIT_RESTART)


@dataclass(frozen=True)
class RecoveryEvent:
    attempt: int
    error: str
    seconds: float  # from the failure being seen to ``build`` having returned (restored, ready to train)


@dataclass
class RecoveryReport:
    recoveries: list[RecoveryEvent] = field(default_factory=list)


def reset_cluster_context(timeout: float = RESET_SECONDS) -> None:
    """Give the eager context a fresh view of the cluster (old remote handles dropped). TF's
    ``update_server_def`` can hang for ever, so after ``timeout`` the process leaves by :func:`exit_for_restart`."""
    from tensorflow.python.eager import context

    done = threading.Event()

    def give_up() -> None:
        if not done.wait(timeout):
            exit_for_restart(PsguardError(f"resetting the cluster context (update_server_def) took over {timeout:g}s"))

    threading.Thread(target=give_up, name="psguard-reset-deadline", daemon=True).start()
    try:
        context.context().update_server_def(context.get_server_def())
    finally:
        done.set()


_TOUCH: dict[tuple[str, ...], Any] = {}  # reach_every_ps's function, per list of PS devices


def reach_every_ps(*, workers: bool, deadline: float = REACH_SECONDS) -> int:
    """Return once this process (or with ``workers``, every worker) reached every PS; the calls that failed first.

    A process that called the dead PS keeps its gRPC subchannel in reconnect backoff and fails every call to it
    until the backoff ends, although the PS serves again: a rebuild quicker than that would fail for nothing. A
    worker that is down is skipped (TF's coordinator handles it). Raises the last failure after ``deadline``.
    """
    import tensorflow as tf
    from tensorflow.python.eager import context

    server_def = context.get_server_def()
    if server_def is None:  # no cluster: nothing to reach
        return 0
    jobs = {job.name: sorted(job.tasks) for job in server_def.cluster.job}
    ps_devices = [f"/job:ps/replica:0/task:{p}" for p in jobs.get("ps", [])]
    end = time.monotonic() + deadline

    def until_reached(call: Callable[[], object]) -> int:
        failed = 0
        while True:
            try:
                call()
                return failed
            except tf.errors.OpError as e:
                if not is_cluster_failure(e) or time.monotonic() >= end:
                    raise
                failed += 1
                time.sleep(0.05)  # nothing to wait on: gRPC connects again when its backoff ends

    def stamps() -> list[Any]:
        out = []
        for device in ps_devices:  # one output per PS: the worker talks to each PS, no PS to another
            with tf.device(device):
                out.append(tf.timestamp())
        return out

    if not workers:
        return until_reached(lambda: [stamp.numpy() for stamp in stamps()])
    touch = _TOUCH.setdefault(tuple(ps_devices), tf.function(stamps, autograph=False))  # traced once per process

    def from_worker(device: str) -> None:
        try:
            with tf.device(device):
                for stamp in touch():
                    stamp.numpy()
        except tf.errors.OpError as e:
            if "/job:ps/" in str(e) or not is_cluster_failure(e):
                raise  # the worker is up and cannot reach a PS (its backoff): retried
            log.info("%s is not reachable; the coordinator handles a lost worker: %s", device, str(e).splitlines()[0])

    worker_devices = [f"/job:worker/replica:0/task:{w}" for w in jobs.get("worker", [])] if ps_devices else []
    return sum(until_reached(functools.partial(from_worker, device)) for device in worker_devices)


def restore_failure_tolerance() -> None:
    """Give each open manager's coordinator back TF's tolerance of transient PS errors (3 per PS, for its life),
    which the failed generation used up."""
    for coordinator in process_managers.coordinators():
        cluster = getattr(coordinator, "_cluster", None)
        counts = getattr(cluster, "_potential_ps_failures_count", None)
        lock = getattr(cluster, "_potential_ps_failures_lock", None)
        if isinstance(counts, list) and lock is not None:
            with lock:
                counts[:] = [0] * len(counts)


class StablePlacement:
    """Every generation rebuilt in this process puts its variables on the PS its first generation put them on:
    ``ParameterServerStrategy`` places them round robin by a count kept in the strategy, which a rebuild would
    go on counting, while the PS agents keep each shard where it was captured."""

    def __init__(self) -> None:
        self._starts: dict[int, tuple[Any, int]] = {}  # id(strategy.extended) -> (it, its count then)

    @contextlib.contextmanager
    def building(self) -> Iterator[None]:
        import tensorflow as tf

        for extended, count in self._starts.values():
            extended._variable_count = count
        with tf.variable_creator_scope(self._creator):
            yield

    def _creator(self, next_creator: Callable[..., Any], **kwargs: Any) -> Any:
        # Called inside the strategy's own creator, once it chose this variable's PS by the count.
        import tensorflow as tf

        extended = getattr(tf.distribute.get_strategy(), "extended", None)
        count = getattr(extended, "_variable_count", None)
        if type(count) is int and id(extended) not in self._starts:
            self._starts[id(extended)] = (extended, count)
        return next_creator(**kwargs)


def _rebuild(
    build: Callable[[], T], close: Callable[[T], None] | None, placement: StablePlacement, min_bytes: int = MIN_BYTES
) -> T:
    """``build()`` with big variables created without values (:mod:`psguard.trainer.deferred_init`); built again
    the ordinary way if its restore did not assign them all."""
    t0 = time.monotonic()
    with deferred_initial_values(min_bytes) as deferred, placement.building():
        job = build()
    if deferred.complete:
        if deferred.deferred:
            what = f"{deferred.deferred} variable(s), {deferred.deferred_bytes >> 20} MB"
            log.info(
                "rebuilt in %.1fs; %s were not initialised: the restore assigned them", time.monotonic() - t0, what
            )
        return job
    log.warning(
        "the rebuild's restore did not assign every variable created without its initial value (no checkpoint "
        "yet, or variables outside the checkpoint): building again with initial values"
    )
    deferred.forget()  # its references would keep this build's variables alive beside the next one's
    if close is not None:
        close(job)
    del job
    gc.collect()
    with placement.building():
        return build()


def _reach(*, workers: bool) -> None:
    """:func:`reach_every_ps`, logged; a check that cannot run at all (not a cluster failure) is skipped."""
    try:
        failed = reach_every_ps(workers=workers)
    except Exception as e:
        if is_cluster_failure(e):
            raise
        log.warning("could not check that %s every PS: %s", "the workers reach" if workers else "the chief reaches", e)
        return
    if failed:
        log.info("%s reached every PS after %d failed call(s)", "the workers" if workers else "the chief", failed)


def run_with_recovery(
    build: Callable[[], T],
    train: Callable[[T], R],
    *,
    restart_ps: Callable[[float], None],
    max_recoveries: int = 10,
    on_recovery: Callable[[RecoveryEvent], None] | None = None,
    close: Callable[[T], None] | None = None,
) -> tuple[R, RecoveryReport]:
    """Run ``train(build())``; on a cluster failure rejoin in this process and go on.

    ``build`` creates everything that holds variables (the CheckpointManager too) and restores; ``train`` trains
    to the end. ``restart_ps(failed_at)`` restarts every PS task started before ``failed_at`` and returns once
    they serve (under ``psguard agent``: ``lambda t: psguard.restart_ps_servers(failed_at=t)``). The open
    managers are closed first without waiting for saves an agent finishes; ``close`` releases the rest of a
    job. A failure during ``build`` is recovered from the same way, within ``max_recoveries``.
    """
    report = RecoveryReport()
    attempt = 0
    placement = StablePlacement()
    # What lives before the first build lives as long as the process: frozen, a recovery's full collection
    # (while the PS restart) does not traverse it (0.31 s -> 0.12 s in the 1 GB bench).
    gc.collect()
    gc.freeze()
    with placement.building():
        job: T | None = build()
    failure: tuple[str, float] | None = None  # what the failure said (first line), and when it was first seen
    warm = True
    while True:
        try:
            if warm:  # reach_every_ps traced and instantiated now: 0.1 s of the first recovery otherwise
                warm = False
                _reach(workers=False)
                _reach(workers=True)
            if job is None:  # a failure during the rebuild is recovered from like one in training
                reset_cluster_context()
                # This process reaches every PS, then every worker: a worker's failed call also failed the chief's.
                _reach(workers=False)
                job = _rebuild(build, close, placement)
                _reach(workers=True)
                restore_failure_tolerance()
                assert failure is not None
                event = RecoveryEvent(attempt, failure[0], time.monotonic() - failure[1])
                failure = None
                report.recoveries.append(event)
                if on_recovery is not None:
                    on_recovery(event)
            return train(job), report
        except Exception as e:  # classified below; anything else propagates unchanged
            if not is_cluster_failure(e):
                raise
            attempt += 1
            if attempt > max_recoveries:
                raise PsguardError(f"giving up after {max_recoveries} recoveries; last failure: {e}") from e
            said = str(e).splitlines()[0][:500] if str(e) else type(e).__name__
        # Out here, the exception gone: its traceback held the failed generation's frames.
        failure = (said, time.monotonic() if failure is None else failure[1])
        failed_at = _failure_time()
        log.warning("cluster failure (%s): recovery %d in process", said[:200], attempt)
        dropping, job = [job], None  # handed over in a list the callee empties: no frame here holds it then
        _restart_dropping(restart_ps, failed_at, dropping, close)


def _restart_dropping(
    restart_ps: Callable[[float], None], failed_at: float, dropping: list[T | None], close: Callable[[T], None] | None
) -> None:
    """Restart the PS tasks while the failed generation (the one job in ``dropping``, taken out) is dropped."""
    with ThreadPoolExecutor(1, thread_name_prefix="psguard-restart-ps") as pool:
        restarting = pool.submit(restart_ps, failed_at)
        process_managers.release_after_failure()
        job = dropping.pop()
        if close is not None and job is not None:
            try:
                close(job)
            except Exception as close_error:  # the old generation's saves may fail now: expected
                log.info("closing the failed generation: %s", close_error)
        job = None
        # The collection holds the interpreter: let the restart's request leave first (0.28 s later otherwise).
        wait([restarting], timeout=_SEND_FIRST_SECONDS)
        gc.collect()
        restarting.result()  # its failure, raised here
