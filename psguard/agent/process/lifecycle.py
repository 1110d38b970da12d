"""A supervised task's life as its owner sees it: the restart policy it is given and what it reports back.

The :class:`~psguard.agent.process.supervisor.Supervisor` takes a :class:`SupervisorConfig` (the agent's
``supervisor:`` section) and reports through :class:`SupervisorEvent` (to its ``on_event`` callback: the agent's
recovery rules, metrics) and :class:`SupervisorStatus` (``/status``). They live apart from the supervisor so
that those readers (:mod:`psguard.agent.config`, :mod:`psguard.agent.control.metrics`,
:mod:`psguard.agent.recovery`) need only the vocabulary, not the machinery that spawns and kills processes.
"""

from __future__ import annotations

import enum
import signal
from dataclasses import dataclass
from typing import Annotated

from psguard.config import Check, Duration, validate
from psguard.errors import PsguardError
from psguard.handoff.contract import EXIT_RESTART

__all__ = [
    "FINAL_STATES",
    "EventKind",
    "SpawnError",
    "SupervisorConfig",
    "SupervisorEvent",
    "SupervisorState",
    "SupervisorStatus",
    "describe_exit",
]


class SpawnError(PsguardError):
    """The task's command could not be started at all (no such file, not executable, bad working directory)."""


class SupervisorState(enum.StrEnum):
    IDLE = "idle"  # not started yet
    RUNNING = "running"
    BACKOFF = "backoff"  # waiting before the next start after a crash
    STOPPING = "stopping"
    STOPPED = "stopped"  # stop() was called; final
    COMPLETED = "completed"  # the task exited 0; final
    GAVE_UP = "gave_up"  # crash loop; final
    FAILED = "failed"  # the supervisor itself hit an unexpected error; final


FINAL_STATES = frozenset(
    {SupervisorState.STOPPED, SupervisorState.COMPLETED, SupervisorState.GAVE_UP, SupervisorState.FAILED}
)


class EventKind(enum.StrEnum):
    STARTED = "started"  # first start
    RESTARTED = "restarted"  # every later start; ``reason`` says why
    EXITED = "exited"  # a run ended; ``exit_code`` (negative: killed by that signal) and ``reason``
    COMPLETED = "completed"  # exit 0, supervision over
    STOPPED = "stopped"  # stop() finished, supervision over
    GAVE_UP = "gave_up"  # crash loop, supervision over; ``reason`` is the CrashLoopError message


@dataclass(frozen=True)
class SupervisorEvent:
    """One line of a task's history, for metrics and the agent's ``/status``."""

    kind: EventKind
    task: str
    time: float  # wall clock, seconds since the epoch
    pid: int | None = None
    exit_code: int | None = None
    reason: str = ""
    restarts: int = 0
    run_seconds: float | None = None  # for EXITED: how long that run lasted
    backoff_seconds: float | None = None  # for EXITED: the wait before the next start (0: at once)

    def to_dict(self) -> dict[str, object]:
        return {
            "kind": self.kind.value,
            "task": self.task,
            "time": self.time,
            "pid": self.pid,
            "exit_code": self.exit_code,
            "reason": self.reason,
            "restarts": self.restarts,
            "run_seconds": self.run_seconds,
            "backoff_seconds": self.backoff_seconds,
        }


@dataclass(frozen=True)
class SupervisorStatus:
    """A consistent snapshot of a supervisor, taken under its lock."""

    task: str
    state: SupervisorState
    pid: int | None
    restarts: int
    last_exit_code: int | None
    uptime_seconds: float | None  # of the current run; None when no process runs
    crashes_in_window: int
    last_reason: str
    standby_pid: int | None = None  # the warm standby waiting to replace the task (psguard.agent.process.standby)
    standby_ready: bool = False  # ... and it has imported what it needs: swapping it in is quick

    def to_dict(self) -> dict[str, object]:
        return {
            "task": self.task,
            "state": self.state.value,
            "pid": self.pid,
            "restarts": self.restarts,
            "last_exit_code": self.last_exit_code,
            "uptime_seconds": self.uptime_seconds,
            "crashes_in_window": self.crashes_in_window,
            "last_reason": self.last_reason,
            "standby_pid": self.standby_pid,
            "standby_ready": self.standby_ready,
        }


def _positive(x: float) -> bool:
    return x > 0


@dataclass(frozen=True)
class SupervisorConfig:
    """The restart policy, as the agent's YAML section ``supervisor:`` (see :mod:`psguard.config`)."""

    backoff_initial: Annotated[Duration, Check(_positive, "> 0")] = 0.5
    backoff_max: Annotated[Duration, Check(_positive, "> 0")] = 30.0
    backoff_reset_after: Duration = 60.0  # a run at least this long resets the backoff to backoff_initial
    crash_loop_limit: Annotated[int, Check(lambda n: n >= 1, ">= 1")] = 5
    crash_loop_window: Annotated[Duration, Check(_positive, "> 0")] = 300.0
    stop_timeout: Duration = 10.0  # SIGTERM, then SIGKILL after this long
    restart_codes: tuple[int, ...] = (EXIT_RESTART,)
    # Keep a warm standby process for commands that honour psguard.agent.process.standby (the agent's built-in server
    # mode): a restart then costs ~0.1 s instead of a Python + TensorFlow start. It is started this long after
    # the run is declared healthy (:meth:`Supervisor.mark_healthy`: the PS answers its probe, the trainer
    # delivered a checkpoint), so that it does not compete with the task (or a recovery) for CPU while that
    # starts: counted from the spawn, a standby importing TensorFlow beside the server it backs made a 2-PS
    # job's start 10-15 s slower on 2 cores. A run nobody declares healthy gets its standby
    # ``STANDBY_UNDECLARED_AFTER`` seconds after it started.
    standby: bool = True
    standby_delay: Duration = 5.0
    # ... and this long after a *restart*: the run was restarted because the job is recovering, and a recovery
    # rebuilds and restores the model on this node for seconds to minutes. A standby importing TensorFlow then
    # took half of a 2-core node for 13 s, in the middle of a 1 GB restore (docs/bench/history.md). A second failure
    # within this window restarts cold.
    standby_delay_after_restart: Duration = 30.0
    # Start a PS with glibc's malloc asking for transparent huge pages for its large blocks
    # (``GLIBC_TUNABLES=glibc.malloc.hugetlb=1``; glibc 2.35+, THP ``madvise`` or ``always``; a setting of the
    # user's own is kept): the kernel then maps and frees the tensors' memory 2 MB at a time. A killed PS holding
    # 512 MB closes its sockets (its peers see the failure, its port is free for the next run) only once that
    # memory is freed: 0.2-0.25 s with 4 KB pages, a few ms with huge pages; and a restore of 512 MB took 0.45
    # instead of 0.65 s. A 1 GB job's recovery went from 2.4 to 1.8 s (BENCHMARKS.md, "1 GB").
    huge_pages: bool = True
    # A PS's malloc maps every block of this size or more on its own, and unmaps it when freed
    # (``GLIBC_TUNABLES=glibc.malloc.mmap_threshold=...``; a setting of the user's own is kept; 0: glibc's own
    # rule). glibc's rule raises its threshold to the size of each mapped block freed, up to 32 MB, and from
    # then on serves blocks below it from its heaps, which give freed memory back to the kernel only from their
    # top: a PS whose variables, slots and whole-shard copies are such blocks keeps what it freed. Measured: the
    # chaos soak's job (2,000,000 x 8 Adagrad over 2 PS) had its PS at ~780 MB under glibc's rule and ~530 MB at
    # 4 MB; a 2-PS cluster creating and freeing eight 32 MB variables a generation, PS kept, grew 633 -> 914 MB
    # over eight generations under glibc's rule and stayed at 531-572 MB at 4 MB (2026-12-06). Blocks this large
    # are a PS's variables and whole-shard copies, not its per-step work.
    ps_mmap_threshold_mb: Annotated[float, Check(lambda n: n >= 0, ">= 0")] = 4.0
    # The first wait of TensorFlow's gRPC channels before they connect again to a task that refused them (a PS
    # being restarted), for every task this agent starts (``TF_GRPC_DEFAULT_OPTIONS``; a
    # ``grpc.initial_reconnect_backoff_ms`` of the user's own is kept; 0: TensorFlow's 1 s). The waits grow
    # 1.6x per refusal up to TensorFlow's 1 s cap. A worker that called the killed PS waited out 1 s (0.8-1.2)
    # before its first step after a 1 GB job's recovery, which was the rest of the recovery's length: 1.2 s
    # from the failure to the workers' reach, against 0.96 s with 0.1 (one run each, `bench recovery`).
    reconnect_backoff: Annotated[Duration, Check(lambda s: 0 <= s <= 1, "between 0 and 1 s")] = 0.1

    def __post_init__(self) -> None:
        validate(self)
        if self.backoff_max < self.backoff_initial:
            raise ValueError(
                f"backoff_max: expected >= backoff_initial ({self.backoff_initial}), got {self.backoff_max}"
            )
        if 0 in self.restart_codes:
            raise ValueError("restart_codes: 0 means the task finished and cannot also mean 'restart me'")


def describe_exit(code: int | None) -> str:
    """``1``, ``-9 (SIGKILL)``: exit codes as people read them in an error message."""
    if code is None:
        return "none"
    if code < 0:
        try:
            return f"{code} ({signal.Signals(-code).name})"
        except ValueError:
            return str(code)
    return str(code)
