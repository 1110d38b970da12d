"""A supervised task's life as its owner sees it: the restart policy (:class:`SupervisorConfig`) and what it
reports (:class:`SupervisorEvent`, :class:`SupervisorStatus`), apart from the machinery that spawns and kills
processes, which their readers need not load."""

from __future__ import annotations

import enum
import signal
from dataclasses import dataclass
from typing import Annotated

from psguard.config import Check, Duration, validate
from psguard.errors import PsguardError
from psguard.handoff.contract import EXIT_RESTART


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


#: A setting that must be above zero (the agent's ``supervisor:`` and ``probe:`` sections).
POSITIVE = Check(lambda x: x > 0, "> 0")


@dataclass(frozen=True)
class SupervisorConfig:
    """The restart policy, as the agent's YAML section ``supervisor:`` (see :mod:`psguard.config`)."""

    backoff_initial: Annotated[Duration, POSITIVE] = 0.5
    backoff_max: Annotated[Duration, POSITIVE] = 30.0
    backoff_reset_after: Duration = 60.0  # a run at least this long resets the backoff to backoff_initial
    crash_loop_limit: Annotated[int, Check(lambda n: n >= 1, ">= 1")] = 5
    crash_loop_window: Annotated[Duration, POSITIVE] = 300.0
    stop_timeout: Duration = 10.0  # SIGTERM, then SIGKILL after this long
    restart_codes: tuple[int, ...] = (EXIT_RESTART,)
    # Keep a warm standby process for commands that honour psguard.agent.process.standby: a restart then costs
    # ~0.1 s instead of a Python + TensorFlow start. Started standby_delay after the run is declared healthy
    # (Supervisor.mark_healthy), so that it does not compete with the task for CPU while that starts; a run
    # nobody declares healthy gets it STANDBY_UNDECLARED_AFTER seconds after its start.
    standby: bool = True
    standby_delay: Duration = 5.0
    # ... and this long after a *restart*: a recovery rebuilds and restores the model on this node meanwhile.
    standby_delay_after_restart: Duration = 30.0
    # A PS's malloc asks for transparent huge pages (GLIBC_TUNABLES glibc.malloc.hugetlb=1; the user's own setting
    # is kept): a killed PS frees its memory, and so its port, in ms instead of 0.2 s (docs/design.md).
    huge_pages: bool = True
    # A PS's malloc maps every block of this size or more on its own and unmaps it when freed (glibc's
    # mmap_threshold; 0: glibc's own rule, which keeps freed variables in its heaps: docs/design.md).
    ps_mmap_threshold_mb: Annotated[float, Check(lambda n: n >= 0, ">= 0")] = 4.0
    # The first wait of TensorFlow's gRPC channels before they reconnect to a task that refused them
    # (TF_GRPC_DEFAULT_OPTIONS grpc.initial_reconnect_backoff_ms; the user's own is kept; 0: TensorFlow's 1 s).
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
    try:
        return f"{code} ({signal.Signals(-code).name})" if code < 0 else str(code)
    except ValueError:
        return str(code)
