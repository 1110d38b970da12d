"""Trainer-side recovery from a lost parameter server.

TensorFlow tolerates a lost worker (the coordinator re-queues its closures) but not a lost PS: the
coordinator raises, and the variables of the restarted PS are gone, so every variable handle the chief holds
is dead (``AbortedError`` "Unable to find a context_id", ``InvalidArgumentError`` "Unable to find the relevant
tensor remote_handle", "RecvTensor expects a different device incarnation"). Two ways back, both supported:

1. **In-process rejoin** (:func:`run_with_recovery`): the user hands psguard a ``build`` function that
   creates model, optimizer, step function and :class:`~psguard.CheckpointManager` (and restores); on a
   PS failure psguard drops the dead objects, has every PS restarted, resets the eager context's cluster
   (``update_server_def``) and calls ``build`` again: no process start and no re-import.
2. **Restart the trainer** (:func:`exit_for_restart`): without a ``build`` function the trainer exits with
   :data:`~psguard.handoff.contract.EXIT_RESTART` (75) and the chief's ``psguard agent`` restarts it; the new
   process restores (from the sidecar's memory tier first).

Why every PS is restarted, not only the dead one: a surviving PS keeps the previous generation's variables
(they belong to a remote context nobody closes), so its memory grows with every recovery. Restarted PS
processes start empty and are filled by the restore, so the memory of the PS fleet stays flat whatever the
number of recoveries (docs/design.md, "New trainer generation", has the measurements).
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

#: How long a new generation waits for every worker to reach every PS again (gRPC's reconnect backoff, which TF
#: caps at 1 s plus jitter, is what it waits out; a PS that does not answer by then is a new failure).
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
    """Leave with the exit code that asks ``psguard agent`` for an immediate restart of this trainer.

    Tells the agent when the failure was seen first (so it does not restart the PS that already came back),
    then leaves with ``os._exit``: a normal interpreter exit spent 8-17 s tearing TensorFlow down under load,
    all of it added to the recovery time. Captures the agent acknowledged are safe in its memory tier; without
    a sidecar, call ``manager.wait()`` before this so pending durable writes finish.
    """
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
    """Give the eager context a fresh view of the cluster: old remote handles are dropped.

    TF's ``update_server_def`` has no deadline, and it did not return in some runs where a second failure came
    while a rebuild was in flight (a PS restarted under a worker's call). A hung reset never recovers, so after
    ``timeout`` the process leaves with :func:`exit_for_restart`: under ``psguard agent`` a new trainer process
    restores (the same checkpoints); without one, the exit code and the log say what happened.
    """
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
    """Return once this process (``workers=False``: an op on every PS) or every worker (a function on each worker
    with an op on every PS) reached every PS; the number of calls that failed first.

    Why: a process that called the dead PS while it was down keeps its gRPC subchannel to that address in
    reconnect backoff (up to 1.2 s in TF; gRPC shares subchannels between channels, so the new context's channels
    inherit it) and fails every call to it at once until the backoff ends ("failed to connect to all addresses ...
    Connection refused"), although the PS serves again. A rebuild (the chief's variables) or a first step (the
    workers') quicker than that backoff failed: a second recovery for nothing, whose ``update_server_def`` hung in
    TF in some runs. TF's coordinator would not retry it either: it tolerates 3 such errors per PS over its life,
    and the failed generation used them up (:func:`restore_failure_tolerance`). A worker that is down itself is
    skipped (TF's coordinator handles a lost worker). Raises the last cluster failure once ``deadline`` is over.
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

    def from_here() -> None:
        for device in ps_devices:
            with tf.device(device):
                tf.timestamp().numpy()

    if not workers:
        return until_reached(from_here)

    def stamps() -> list[Any]:
        out = []
        for device in ps_devices:  # one output per PS: the worker talks to each PS, no PS to another
            with tf.device(device):
                out.append(tf.timestamp())
        return out

    touch = _TOUCH.setdefault(tuple(ps_devices), tf.function(stamps, autograph=False))  # traced once per process

    def from_worker(device: str) -> None:
        try:
            with tf.device(device):
                for stamp in touch():
                    stamp.numpy()
        except tf.errors.OpError as e:
            if "/job:ps/" in str(e) or not is_cluster_failure(e):
                raise  # the worker is up and cannot reach a PS (its backoff): retried
            # The worker itself is down (preempted, its node lost): TF's coordinator waits for a worker on its own
            # and re-runs its closures; a PS recovery must not wait for it, let alone fail on it.
            log.info("%s is not reachable; the coordinator handles a lost worker: %s", device, str(e).splitlines()[0])

    worker_devices = [f"/job:worker/replica:0/task:{w}" for w in jobs.get("worker", [])] if ps_devices else []
    return sum(until_reached(functools.partial(from_worker, device)) for device in worker_devices)


def restore_failure_tolerance() -> None:
    """Give each open manager's coordinator back TF's tolerance of transient PS errors (3 per PS, counted over
    the coordinator's life): the failed generation used it up, and a new generation starts with it whole."""
    for coordinator in process_managers.coordinators():
        cluster = getattr(coordinator, "_cluster", None)
        counts = getattr(cluster, "_potential_ps_failures_count", None)
        lock = getattr(cluster, "_potential_ps_failures_lock", None)
        if isinstance(counts, list) and lock is not None:
            with lock:
                counts[:] = [0] * len(counts)


class StablePlacement:
    """Every generation rebuilt in this process puts its variables on the PS its first generation put them on.

    Why: ``ParameterServerStrategy`` puts each new variable (each shard of a partitioned one) on the next PS,
    round robin, counting in the strategy object (``extended._variable_count``). A generation rebuilt in the same
    process went on counting, so unless the first one created a multiple of ``num_ps`` variables, shard i of a
    table landed on another PS than before (3 PS and the bench's model: every shard moved by one). psguard's PS
    agents keep each shard where it was captured: the restore then read another node's files, and the next
    capture's parts matched no tier (the trainer crash-looped). A new process starts the count at 0 anyway.
    Each :meth:`building` starts the count where the first one found it.
    """

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
    """``build()`` with big variables created without values, since its restore overwrites them at once
    (:mod:`psguard.trainer.deferred_init`); built again the ordinary way if the restore did not assign them all."""
    t0 = time.monotonic()
    with deferred_initial_values(min_bytes) as deferred, placement.building():
        job = build()
    if deferred.complete:
        if deferred.deferred:
            log.info(
                "rebuilt in %.1fs; %d variable(s), %d MB, were not initialised: the restore assigned them",
                time.monotonic() - t0,
                deferred.deferred,
                deferred.deferred_bytes >> 20,
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


def _freeze_what_lives_on() -> None:
    """Move every object the process holds before its first build into the collector's permanent generation
    (``gc.freeze``, after a collection): the imported modules, TensorFlow's and Keras's state, the strategy.

    Why: a recovery collects the failed generation (below, ``gc.collect``) while the PS restarts, and a full
    collection traverses every object of the process: 380,000 in the 1 GB bench's trainer, 0.31 s on the
    recovery's path, 0.12-0.15 s once the 320,000 that were there before the first build are frozen. Those live
    as long as the process anyway; the garbage among them was just collected. Python's own full collections
    during training get as much cheaper. ``gc.unfreeze()`` undoes it.
    """
    gc.collect()
    gc.freeze()


def _reach(*, workers: bool) -> None:
    """:func:`reach_every_ps`, said in the log; a check that cannot run at all (an error that is not a cluster
    failure, as in a cluster psguard's probe does not fit) is logged and skipped, never the end of the job."""
    try:
        failed = reach_every_ps(workers=workers)
    except Exception as e:
        if is_cluster_failure(e):
            raise
        log.warning("could not check that %s every PS: %s", "the workers reach" if workers else "the chief reaches", e)
        return
    if failed:
        log.info("%s reached every PS after %d failed call(s)", "the workers" if workers else "the chief", failed)


def _rebuild_reaching(build: Callable[[], T], close: Callable[[T], None] | None, placement: StablePlacement) -> T:
    """:func:`_rebuild` once this process reaches every PS, then wait until every worker does too
    (:func:`reach_every_ps`); the new generation trains with TF's tolerance of transient PS errors whole again.

    One after the other, not side by side: a worker's failed call (its backoff) also failed the chief's calls in
    flight at the time, so a rebuild beside the workers' reach failed again and again until the backoff ended.
    """
    _reach(workers=False)
    job = _rebuild(build, close, placement)
    _reach(workers=True)
    restore_failure_tolerance()
    return job


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

    ``build`` must create everything that holds variables (model, optimizer, step function, the
    CheckpointManager) and restore (``manager.restore_or_initialize()``); ``train`` trains from the
    restored step to the end and returns. ``restart_ps`` restarts every PS task and returns once they all
    serve (see the module docstring for why every one); it gets a moment the failed generation still ran (its
    last step a manager saw, else when the failure was seen: ``time.time()``), so a PS started since (the dead
    one, already restarted by its agent) need not be restarted again: under ``psguard agent`` pass
    :func:`psguard.restart_ps_servers` as
    ``lambda failed_at: psguard.restart_ps_servers(failed_at=failed_at)``. Every :class:`~psguard.CheckpointManager`
    open in this process is closed by psguard first (they belong to the failed generation: create them in
    ``build``), without waiting for saves a sidecar agent finishes on its own
    (:meth:`~psguard.trainer.registry.ManagerRegistry.release_after_failure`); ``close`` releases the rest of a
    job before it is dropped (closing its manager again does nothing). A cluster failure during ``build`` (a PS
    lost while the rebuild restores) is recovered from the same way, within ``max_recoveries``.
    """
    report = RecoveryReport()
    attempt = 0
    placement = StablePlacement()
    _freeze_what_lives_on()
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
            if job is None:
                # A rebuild is a restore on a cluster that may fail again (a second PS killed mid-restore): that
                # failure is recovered from like one in training, never by a restore of an older checkpoint.
                reset_cluster_context()
                job = _rebuild_reaching(build, close, placement)
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
        # Recovered from out here, the exception gone: its traceback holds the frames of ``train(job)``, so while
        # it lived the failed generation could not be collected (its functions stayed registered in the eager
        # context too, and every one of them costs the reset of its cluster ~2.5 ms).
        failure = (said, time.monotonic() if failure is None else failure[1])
        failed_at = _failure_time()
        log.warning("cluster failure (%s): recovery %d in process", said[:200], attempt)
        dropping, job = [job], None  # handed over in a list the callee empties: no frame here holds it then
        _restart_dropping(restart_ps, failed_at, dropping, close)


def _restart_dropping(
    restart_ps: Callable[[float], None],
    failed_at: float,
    dropping: list[T | None],
    close: Callable[[T], None] | None,
) -> None:
    """Restart the PS tasks while the failed generation (the one job in ``dropping``, taken out) is dropped.

    The PS restart (waiting on the agents) overlaps with dropping the failed generation (CPU here, the collection
    alone 0.3-0.4 s with a model built). Both are over before the cluster context is reset.
    """
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
        # The collection holds the interpreter until it is done (its traversal runs no Python code): a request not
        # yet on the wire waits for it. Let the restart's thread send first: 0.28 s later at the agent without
        # this, 4 ms with it (a model and 300k cyclic objects, one process).
        wait([restarting], timeout=_SEND_FIRST_SECONDS)
        gc.collect()
        restarting.result()  # its failure, raised here
