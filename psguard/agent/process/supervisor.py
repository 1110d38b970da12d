"""Keep one task process running: start it, restart it when it dies, give up on a crash loop, stop it cleanly.

The task runs in its own process group, with a parent-death signal, and its whole process tree marked
(:mod:`psguard.agent.process.tree`), so that it dies with the agent even when the agent is SIGKILLed. Exit codes:

==============  =====================================================================================
``0``           the task finished its job: nothing is restarted and the supervisor is done
``75``          :data:`EXIT_RESTART` (``EX_TEMPFAIL``): "restart me now"; restarted at once, not a crash
other           a crash: restarted after an exponential backoff; ``crash_loop_limit`` crashes within
                ``crash_loop_window`` seconds end supervision with :class:`~psguard.errors.CrashLoopError`
==============  =====================================================================================

A run killed by :meth:`Supervisor.restart` (a hung task) counts as a crash but is started again at once; one
restarted with ``crash=False``, or one the owner declared healthy (:meth:`Supervisor.mark_healthy`), is no crash:
a crash loop is a task that cannot get going. All spawning happens on the supervisor's own thread, because Linux
delivers the parent-death signal when the *thread* that forked the child exits.
"""

from __future__ import annotations

import collections
import contextlib
import enum
import functools
import logging
import math
import os
import select
import shlex
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from psguard.agent.process import reaper
from psguard.agent.process.lifecycle import (
    FINAL_STATES,
    EventKind,
    SpawnError,
    SupervisorConfig,
    SupervisorEvent,
    SupervisorState,
    SupervisorStatus,
    describe_exit,
)
from psguard.agent.process.standby import Standby
from psguard.agent.process.task_log import TaskLog
from psguard.agent.process.tree import TaskTree, pdeathsig_prefix
from psguard.errors import CrashLoopError
from psguard.handoff.contract import EXIT_OK

if TYPE_CHECKING:
    from typing import Self

log = logging.getLogger(__name__)


# How often a subreaping supervisor looks for its task's exited orphans while the task runs.
_REAP_EVERY = 5.0
#: A run that nobody declares healthy (a user's script that never delivers a checkpoint to the agent) gets its
#: warm standby this long after it started, ``standby_delay`` later.
STANDBY_UNDECLARED_AFTER = 60.0

# Exit code recorded for a run that could not even be started (the shell's "command not found").
_EXIT_SPAWN_FAILED = 127


def _check_executable(program: str, env: Mapping[str, str] | None, cwd: str | os.PathLike[str] | None) -> None:
    """Raise ``FileNotFoundError`` / ``PermissionError`` as ``exec`` would, before the wrapper hides it.

    With the parent-death wrapper a missing program is only noticed by the shell (exit 127), which would look
    like a crash loop instead of the plain error it is.
    """
    if os.sep in program:
        path = Path(cwd or ".") / program
        if not path.is_file():
            raise FileNotFoundError(2, "No such file", str(path))
        if not os.access(path, os.X_OK):
            raise PermissionError(13, "Not executable", str(path))
        return
    search = (env if env is not None else os.environ).get("PATH", os.defpath)
    if shutil.which(program, path=search) is None:
        raise FileNotFoundError(2, "No such program on PATH", program)


class _Request(enum.Enum):
    STOP = "stop"
    RESTART = "restart"
    EXITED = "exited"
    TIMEOUT = "timeout"


class Supervisor:
    """Run ``cmd`` and keep it running until it completes, is stopped, or crash-loops: :meth:`start` returns once
    the first process runs, :meth:`result` waits for the end (the last exit code, or raises what ended it),
    :meth:`stop` may be called at any time. ``env``: the task's whole environment (``None``: this process's);
    ``on_event`` gets every :class:`SupervisorEvent` on the supervisor's thread (its exceptions are logged). The
    restart policy is ``config`` (default: no standby) with the fields given as keywords replaced; its standby only
    for a ``standby_capable`` command (one that honours :mod:`psguard.agent.process.standby`) or a ``standby_cmd``.
    """

    def __init__(
        self,
        cmd: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
        name: str | None = None,
        config: SupervisorConfig | None = None,
        on_event: Callable[[SupervisorEvent], None] | None = None,
        log_path: str | os.PathLike[str] | None = None,
        log_max_bytes: int = 100 * 2**20,
        log_keep: int = 3,
        standby_cmd: Sequence[str] | None = None,
        standby_capable: bool = False,
        record: str | os.PathLike[str] | None = None,
        subreaper: bool = False,
        **policy: Any,
    ) -> None:
        if not cmd:
            raise ValueError("Supervisor needs a command to run")
        # Validated with the same messages a config file would get.
        config = replace(config or SupervisorConfig(standby=False), **policy)
        self.config = replace(config, standby=config.standby and (standby_capable or standby_cmd is not None))
        self.cmd = tuple(cmd)
        self.name = name or Path(self.cmd[0]).name
        self._env = dict(env) if env is not None else None
        self._cwd = cwd
        self._on_event = on_event
        # Bounded for a job that runs for weeks: copied and truncated past log_max_bytes (task_log.py).
        self._log = TaskLog(log_path, max_bytes=log_max_bytes, keep=log_keep) if log_path is not None else None
        # The mark of this supervisor's process tree (psguard.agent.process.reaper), the file that records it for the
        # next agent, and the guard that kills the tree when this process dies.
        self._tree = TaskTree(self.name, record)
        self._subreaper = subreaper
        self._sessions: set[int] = set()  # every run's session id (its leader's pid): whose orphans we reap
        # ``standby_cmd``: the standby runs another command that becomes this one on ``go`` (the warm trainer,
        # psguard.trainer.warm), and it is told the task's environment then.
        warm = tuple(standby_cmd or ())
        spawn = functools.partial(self._popen, cmd=warm) if warm else self._popen
        standby = Standby(self.name, spawn, env_at_go=self._run_env if warm else None)
        self._standby = standby if self.config.standby else None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._first_spawn = threading.Event()
        self._done = threading.Event()
        self._restart_reason: str | None = None
        self._restart_is_crash = True
        self._run_healthy = False  # the current run was declared healthy by the owner (mark_healthy)
        self._wake_r = self._wake_w = -1  # a pipe that interrupts the thread's select(); made by start()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._spawn_error: SpawnError | None = None
        self._state = SupervisorState.IDLE
        self._proc: subprocess.Popen[bytes] | None = None
        self._last_pid: int | None = None  # of the latest run, kept after it is reaped for the exit event
        self._run_started: float | None = None
        self._restarts = 0
        self._last_exit: int | None = None
        self._last_reason = ""
        self._crashes: collections.deque[tuple[float, int]] = collections.deque()
        self._backoff = self.config.backoff_initial

    # ------------------------------------------------------------------------------------------ control

    def start(self) -> Self:
        """Start the task and return once its first process runs; raise :class:`SpawnError` if it cannot."""
        with self._lock:
            if self._thread is not None or self._state is not SupervisorState.IDLE:
                raise RuntimeError(f"supervisor {self.name} was already started or stopped; make a new one")
            self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
            self._thread = threading.Thread(target=self._run, name=f"psguard-supervisor-{self.name}", daemon=True)
        try:
            self._tree.settle_predecessor()
            if self._subreaper and not reaper.set_child_subreaper():
                log.warning("event=no_subreaper task=%s reason='prctl(PR_SET_CHILD_SUBREAPER) unavailable'", self.name)
            self._tree.start_guard()
            self._tree.write_record()
        except BaseException as e:
            self._error = e
            with self._lock:
                self._thread = None
                self._state = SupervisorState.FAILED
                self._close_wake_pipe()
            self._tree.stop_guard()
            self._done.set()
            raise
        self._thread.start()
        if self._log is not None:
            self._log.start()
        self._first_spawn.wait()
        if self._spawn_error is not None:
            self._thread.join()
            raise self._spawn_error
        return self

    def stop(self) -> SupervisorStatus:
        """SIGTERM the task's process group, SIGKILL it after ``stop_timeout``, reap, end supervision.

        Safe to call more than once, before :meth:`start`, after supervision ended by itself, and from an
        ``on_event`` callback (then it only asks, and returns at once). It does not raise the crash-loop error;
        :meth:`result` does.
        """
        self._stop.set()
        self._wake()
        thread = self._thread
        if thread is threading.current_thread():
            return self.status()  # from an on_event callback: the loop sees the flag once the callback returns
        if thread is None:
            with self._lock:
                if self._state is SupervisorState.IDLE:
                    self._state = SupervisorState.STOPPED
                    self._done.set()
                    self._close_wake_pipe()
        else:
            thread.join(self.config.stop_timeout + 30.0)  # and 30 s for reaping
            if thread.is_alive():
                raise TimeoutError(f"supervisor {self.name} did not stop within its timeout")
        return self.status()

    def set_env(self, name: str, value: str) -> None:
        """Add to the task's environment from its next start on (what the agent learns after building it)."""
        if self._env is None:
            self._env = dict(os.environ)
        self._env[name] = value

    def restart(self, reason: str, *, crash: bool = True) -> bool:
        """Kill the task's process group with SIGKILL and start the command again, on the supervisor's thread.

        For a task that is alive but useless (a probe's deadline passed: ``crash=True``, it counts towards
        the crash-loop limit), or that must be replaced although it works (``crash=False``). Returns at once:
        ``False`` when there is nothing to restart (not started, or supervision is over). During a backoff it
        starts the task now.
        """
        with self._lock:
            if self._thread is None or self._state in FINAL_STATES or self._stop.is_set():
                return False
            self._restart_reason = reason or "restart requested"
            self._restart_is_crash = crash
        self._wake()
        return True

    def result(self, timeout: float | None = None) -> int | None:
        """Wait for supervision to end; the last exit code, or raise what ended it (:class:`CrashLoopError`)."""
        if self._thread is None and not self._done.is_set():
            raise RuntimeError(f"supervisor {self.name} was never started")
        if not self._done.wait(timeout):
            raise TimeoutError(f"supervisor {self.name} still running after {timeout}s")
        if self._error is not None:
            raise self._error
        with self._lock:
            return self._last_exit

    def done(self) -> bool:
        return self._done.is_set()

    def mark_healthy(self) -> None:
        """The current run did its job for a while (probes passed, work delivered): its end is not a crash loop.

        Also resets the backoff for the next start, as a long run does.
        """
        with self._lock:
            if self._proc is None or self._run_healthy:
                return
            self._run_healthy = True
        self._wake()  # the standby's delay counts from now

    def status(self) -> SupervisorStatus:
        with self._lock:
            now = time.monotonic()
            self._prune_crashes(now)
            started = self._run_started if self._proc is not None else None
            return SupervisorStatus(
                task=self.name,
                state=self._state,
                pid=self._proc.pid if self._proc is not None else None,
                restarts=self._restarts,
                last_exit_code=self._last_exit,
                uptime_seconds=None if started is None else now - started,
                crashes_in_window=len(self._crashes),
                last_reason=self._last_reason,
                standby_pid=self._standby.pid if self._standby is not None else None,
                standby_ready=self._standby.ready if self._standby is not None else False,
            )

    @property
    def pid(self) -> int | None:
        """PID of the running task process (also its process group id), ``None`` between runs."""
        with self._lock:
            return self._proc.pid if self._proc is not None else None

    # ------------------------------------------------------------------------------------------ the thread

    def _run(self) -> None:
        try:
            self._supervise()
        except CrashLoopError as e:
            self._error = e
        except BaseException as e:  # a bug or an OS failure: keep it for result(), never lose it
            log.exception("event=supervisor_failed task=%s", self.name)
            self._error = e
            with self._lock:
                self._state = SupervisorState.FAILED
        finally:
            try:
                self._kill_group_and_reap(signal.SIGKILL)
                if self._standby is not None:
                    self._standby.discard()
                self._kill_tree(spare_standby=False)
                self._tree.stop_guard()
                self._tree.remove_record()
                if self._log is not None:
                    self._log.stop()
            finally:
                self._first_spawn.set()
                with self._lock:
                    self._close_wake_pipe()
                self._done.set()

    def _supervise(self) -> None:
        reason = ""
        while not self._stop.is_set():  # a stop asked while we were busy (a restart, a callback): no new start
            if self._spawn(reason):
                request = self._wait_run(restarted=bool(reason))
                if request is _Request.STOP:
                    break
                with self._lock:
                    counts = self._restart_is_crash and not self._run_healthy
                why = self._take_restart_reason() if request is _Request.RESTART else ""
                code = self._kill_group_and_reap(signal.SIGKILL)  # killed to restart, or gone: clear what it left
                run: float | None = self._end_run()
                if request is _Request.RESTART:
                    self._crashed(code, f"killed to restart: {why}", run, delay=0.0, counts=counts)
                    reason = why
                    continue
                why = f"exited {describe_exit(code)}"
            elif self._spawn_error is not None:  # the very first start failed: start() raises it
                self._error = self._spawn_error
                with self._lock:
                    self._state = SupervisorState.FAILED
                return
            else:
                code, run, why = _EXIT_SPAWN_FAILED, None, self._last_reason
            if code == EXIT_OK:
                self._emit_exit(code, "finished", run, backoff=None)
                with self._lock:
                    self._state = SupervisorState.COMPLETED
                self._emit(EventKind.COMPLETED, exit_code=code, reason="the task finished (exit 0)")
                return
            if code in self.config.restart_codes:
                self._emit_exit(code, f"exit {code} asks for a restart", run, backoff=0.0)
                reason = f"exit {code} asked for a restart"
                continue
            with self._lock:
                healthy = self._run_healthy
            if healthy or (run is not None and run >= self.config.backoff_reset_after):
                self._backoff = self.config.backoff_initial  # it ran well: not the same crash again
            delay = self._backoff
            self._backoff = min(self._backoff * 2, self.config.backoff_max)
            self._crashed(code, why, run, delay=delay, counts=not healthy)
            reason = f"after a crash ({why})"
            with self._lock:
                self._state = SupervisorState.BACKOFF
            request = self._wait(delay, watch_process=False)
            if request is _Request.STOP:
                break
            if request is _Request.RESTART:
                reason = self._take_restart_reason()
        self._finish_stop()

    # ------------------------------------------------------------------------------------------ the tree

    def _kill_tree(self, *, spare_standby: bool) -> None:
        """Kill every process of the task's tree that outlived its run (left the group, or was orphaned)."""
        standby = self._standby.pid if spare_standby and self._standby is not None else None
        spare = frozenset() if standby is None else frozenset({standby, *reaper.descendants(standby)})
        self._tree.kill(exclude=spare)
        self._reap_adopted()

    def _reap_adopted(self) -> None:
        """Reap the task's orphans this subreaper adopted and that have exited (else they stay zombies)."""
        if not self._subreaper:
            return
        with self._lock:
            ours = (self._proc.pid if self._proc is not None else None, self._tree.guard_pid)
            sessions = frozenset(self._sessions)
        standby = self._standby.pid if self._standby is not None else None
        spare = frozenset(pid for pid in (*ours, standby) if pid is not None)  # reaped by their owners
        reaper.reap(reaper.adopted_zombies(sessions, spare=spare))

    def _run_env(self) -> dict[str, str]:
        """The environment of a run started now, with the tree's mark, which everything the task starts inherits."""
        return {**(self._env if self._env is not None else os.environ), self._tree.env_var: "1"}

    def _popen(
        self, extra_env: dict[str, str], *, stdin: int = subprocess.PIPE, cmd: Sequence[str] | None = None
    ) -> subprocess.Popen[bytes]:
        """Start the command (or ``cmd``) once (a run, or a standby with ``extra_env``); raises ``OSError``."""
        program = list(cmd if cmd is not None else self.cmd)
        argv = pdeathsig_prefix() + program
        _check_executable(program[0], self._env, self._cwd)
        if self._cwd is not None and not Path(self._cwd).is_dir():
            raise NotADirectoryError(20, "No such working directory", os.fspath(self._cwd))
        log_fd = self._log.open() if self._log is not None else None  # the child keeps its own copy
        try:
            return subprocess.Popen(
                argv,
                stdin=stdin,
                stdout=log_fd,
                stderr=subprocess.STDOUT if log_fd is not None else None,
                env={**self._run_env(), **extra_env},
                cwd=self._cwd,
                start_new_session=True,
            )
        finally:
            if log_fd is not None:
                os.close(log_fd)

    def _spawn(self, reason: str) -> bool:
        """Start one run. False when it failed; the first failure is kept for :meth:`start` to raise."""
        first = not self._first_spawn.is_set()
        try:
            warm = self._standby.take() if self._standby is not None else None
            proc = warm or self._popen({}, stdin=subprocess.DEVNULL)
        except OSError as e:
            message = f"cannot start task {self.name}: {shlex.join(self.cmd)}: {e}"
            with self._lock:
                self._last_reason = message
            log.error("event=spawn_failed task=%s error=%r", self.name, str(e))
            if first:
                self._spawn_error = SpawnError(message)
                self._spawn_error.__cause__ = e
                self._first_spawn.set()
            return False
        with self._lock:
            self._proc = proc
            self._run_healthy = False
            self._last_pid = proc.pid
            self._sessions.add(proc.pid)
            self._run_started = time.monotonic()
            self._state = SupervisorState.RUNNING
            if not first:
                self._restarts += 1
            restarts = self._restarts
        if first:
            log.info("event=started task=%s pid=%d cmd=%r", self.name, proc.pid, shlex.join(self.cmd))
            self._first_spawn.set()
            self._emit(EventKind.STARTED, pid=proc.pid, restarts=restarts)
        else:
            log.info("event=restarted task=%s pid=%d restarts=%d reason=%r", self.name, proc.pid, restarts, reason)
            self._emit(EventKind.RESTARTED, pid=proc.pid, reason=reason, restarts=restarts)
        return True

    def _wait_run(self, *, restarted: bool) -> _Request:
        """:meth:`_wait` for the run to end; meanwhile, ``standby_delay`` (or ``standby_delay_after_restart``)
        after the run was declared healthy, start its standby."""
        if self._standby is not None:
            delay = self.config.standby_delay_after_restart if restarted else self.config.standby_delay
            for timeout, until in ((STANDBY_UNDECLARED_AFTER, lambda: self._run_healthy), (delay, None)):
                if (request := self._wait(timeout, until=until)) is not _Request.TIMEOUT:
                    return request
            self._standby.fill()
        return self._wait(None)

    def _wait(
        self, timeout: float | None, *, watch_process: bool = True, until: Callable[[], bool] | None = None
    ) -> _Request:
        """Block until the run exits, stop or restart is asked for, or ``timeout`` passes (or ``until()`` holds:
        :meth:`_wake` makes it look).

        The process is watched through a pidfd, which turns readable when it exits but leaves it unreaped:
        until we reap it its pid, and so its process group id, cannot be reused, which makes the group kill
        that follows safe.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        proc = self._proc if watch_process else None
        pidfd: int | None = None
        if proc is not None:
            try:
                pidfd = os.pidfd_open(proc.pid)
            except (AttributeError, OSError):  # old kernel: fall back to polling below
                pidfd = None
        try:
            while True:
                if self._stop.is_set():
                    return _Request.STOP
                with self._lock:
                    if self._restart_reason is not None:
                        return _Request.RESTART
                if proc is not None and self._exited(proc.pid):
                    return _Request.EXITED
                remaining = None if deadline is None else deadline - time.monotonic()
                if (remaining is not None and remaining <= 0) or (until is not None and until()):
                    return _Request.TIMEOUT
                fds = [self._wake_r] + ([pidfd] if pidfd is not None else [])
                poll = 0.05 if proc is not None and pidfd is None else None
                if self._subreaper:  # adopted orphans that exited: nothing signals us, look now and then
                    self._reap_adopted()
                    poll = _REAP_EVERY if poll is None else poll
                wait = remaining if poll is None else poll if remaining is None else min(poll, remaining)
                if self._wake_r in _readable(fds, wait):
                    with contextlib.suppress(BlockingIOError):
                        while os.read(self._wake_r, 4096):  # drained: the wake-ups so far are seen
                            pass
        finally:
            if pidfd is not None:
                os.close(pidfd)

    @staticmethod
    def _exited(pid: int) -> bool:
        """True once ``pid`` (our child) has exited; it stays unreaped (``WNOWAIT``)."""
        try:
            info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return True
        return info is not None

    def _finish_stop(self) -> None:
        with self._lock:
            self._state = SupervisorState.STOPPING
        code: int | None = None
        if self._proc is not None:
            pid = self._proc.pid
            self._signal_group(signal.SIGTERM)
            self._signal_group(signal.SIGCONT)  # a frozen task cannot act on SIGTERM until it runs again
            if self._wait_exit(pid, self.config.stop_timeout):
                log.info("event=stop_graceful task=%s pid=%d", self.name, pid)
            else:
                log.warning(
                    "event=stop_escalated task=%s pid=%d reason='no exit %.1fs after SIGTERM, sending SIGKILL'",
                    self.name,
                    pid,
                    self.config.stop_timeout,
                )
            code = self._kill_group_and_reap(signal.SIGKILL)
            self._emit_exit(code, "stopped", self._end_run(), backoff=None)
        with self._lock:
            self._state = SupervisorState.STOPPED
        self._emit(EventKind.STOPPED, exit_code=code, reason="stop requested")

    def _wait_exit(self, pid: int, timeout: float) -> bool:
        """Wait up to ``timeout`` for our child ``pid`` to exit, without reaping it."""
        try:
            pidfd = os.pidfd_open(pid)
        except (AttributeError, OSError):
            deadline = time.monotonic() + timeout
            while not self._exited(pid):
                if time.monotonic() >= deadline:
                    return False
                time.sleep(0.05)  # polling the real condition: no pidfd on this kernel
            return True
        try:
            return bool(_readable([pidfd], timeout))
        finally:
            os.close(pidfd)

    def _signal_group(self, sig: int) -> None:
        proc = self._proc
        if proc is None or proc.returncode is not None:
            return  # already reaped: its pid may belong to someone else now
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)

    def _kill_group_and_reap(self, sig: int) -> int | None:
        """Signal the whole group (the leader unreaped, so the group id is still ours), then reap the leader."""
        proc = self._proc
        if proc is None:
            return None
        self._signal_group(sig)
        code = proc.wait()
        with self._lock:
            self._proc = None
            self._last_exit = code
        self._kill_tree(spare_standby=True)
        return code

    def _end_run(self) -> float | None:
        """How long the run that just ended lasted (``None`` if it never started)."""
        with self._lock:
            started, self._run_started = self._run_started, None
        return None if started is None else time.monotonic() - started

    def _crashed(self, code: int | None, why: str, run: float | None, *, delay: float, counts: bool = True) -> None:
        """Record a crash and report the exit; raise :class:`CrashLoopError` when that was one too many.

        ``counts=False``: an exit that is no sign of a crash loop (see the module doc) is only reported.
        """
        now = time.monotonic()
        with self._lock:
            if counts:
                self._crashes.append((now, _EXIT_SPAWN_FAILED if code is None else code))
                self._prune_crashes(now)
            self._last_reason = why
            crashes = list(self._crashes)
        if not counts or len(crashes) < self.config.crash_loop_limit:
            self._emit_exit(code, why, run, backoff=delay)
            return
        self._emit_exit(code, why, run, backoff=None)
        codes = ", ".join(describe_exit(c) for _, c in crashes)
        message = (
            f"task {self.name} crashed {len(crashes)} times within {self.config.crash_loop_window:g}s "
            f"(exit codes: {codes}; last: {why}); giving up. Command: {shlex.join(self.cmd)}. "
            f"Fix the task (see its log) or raise crash_loop_limit / crash_loop_window."
        )
        log.error("event=gave_up task=%s exit_codes=%r", self.name, codes)
        with self._lock:
            self._state = SupervisorState.GAVE_UP
            self._last_reason = message
        self._emit(EventKind.GAVE_UP, exit_code=code, reason=message)
        raise CrashLoopError(message)

    def _prune_crashes(self, now: float) -> None:
        while self._crashes and now - self._crashes[0][0] > self.config.crash_loop_window:
            self._crashes.popleft()

    def _take_restart_reason(self) -> str:
        with self._lock:
            reason, self._restart_reason = self._restart_reason or "restart requested", None
            self._restart_is_crash = True
        return reason

    def _emit_exit(self, code: int | None, reason: str, run: float | None, *, backoff: float | None) -> None:
        with self._lock:
            pid = self._last_pid
        log.info(
            "event=exited task=%s pid=%s exit_code=%s reason=%r run_seconds=%s next_start_in=%s",
            self.name,
            pid,
            describe_exit(code),
            reason,
            "-" if run is None else f"{run:.2f}",
            "never" if backoff is None else f"{backoff:.2f}s",
        )
        self._emit(EventKind.EXITED, pid=pid, exit_code=code, reason=reason, run_seconds=run, backoff_seconds=backoff)

    def _emit(self, kind: EventKind, **fields: object) -> None:
        with self._lock:
            restarts = self._restarts
        fields.setdefault("restarts", restarts)
        event = SupervisorEvent(kind=kind, task=self.name, time=time.time(), **fields)  # type: ignore[arg-type]
        if self._on_event is None:
            return
        try:
            self._on_event(event)
        except Exception:
            log.exception("event=callback_failed task=%s kind=%s", self.name, kind.value)

    def _wake(self) -> None:
        with self._lock:
            if self._wake_w < 0:
                return
            with contextlib.suppress(BlockingIOError):  # a full pipe already wakes the thread
                os.write(self._wake_w, b"x")

    def _close_wake_pipe(self) -> None:
        """Close both ends; the caller holds the lock."""
        for fd in (self._wake_r, self._wake_w):
            if fd >= 0:
                os.close(fd)
        self._wake_r = self._wake_w = -1


def _readable(fds: list[int], timeout: float | None) -> set[int]:
    """The descriptors of ``fds`` ready to read within ``timeout`` seconds (None: no limit). ``poll``, not
    ``select``: an agent holding many connections (a flood on its control port) has descriptors past 1024, which
    ``select`` refuses, and the supervisor died of it."""
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN | select.POLLERR | select.POLLHUP)
    ms = None if timeout is None else max(0, math.ceil(timeout * 1000))
    return {fd for fd, _ in poller.poll(ms)}
