"""A real parameter-server cluster on loopback: one OS process per PS and worker task.

psguard's promises are about processes dying (a PS killed mid-save, a frozen worker, a chief restarted), so
the testbed cannot be an in-process cluster: every task here is ``python -m psguard.agent.process.tf_server`` in its
own session and process group, killable and restartable alone on the same address. The calling process is
the chief: it connects with the spec or resolver this class hands out.

A chief's connection to the cluster lives in its process-wide TF eager context. One process can build several
``ParameterServerStrategy`` objects against the same cluster (the context is updated, variables created
before stay usable), but a chief that must start from nothing, as after a chief crash, has to be a new
process: run it with :meth:`LocalCluster.tf_config` in its ``TF_CONFIG``.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

from psguard.agent.process.standby import Standby
from psguard.errors import PsguardError
from psguard.ports import free_port, free_ports, port_open

if TYPE_CHECKING:
    from typing import Self

JOBS = ("ps", "worker")
_POLL_S = 0.05


class ClusterError(PsguardError, RuntimeError):
    """A server task did not come up (exited, or its port stayed closed until the deadline)."""


@dataclass
class _Task:
    job: str
    index: int
    port: int
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    standby: Standby | None = field(default=None, repr=False)

    @property
    def name(self) -> str:
        return f"{self.job}:{self.index}"

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


_live: weakref.WeakSet[LocalCluster] = weakref.WeakSet()


@atexit.register
def _stop_all_at_exit() -> None:
    for cluster in list(_live):
        cluster.stop()


def _log_tail(path: Path, limit: int = 4000) -> str:
    try:
        data = path.read_bytes()
    except OSError:
        return "(no log)"
    return data[-limit:].decode("utf-8", "replace").strip() or "(empty log)"


class LocalCluster:
    """``num_ps`` PS and ``num_workers`` worker processes running ``tf.distribute.Server`` on 127.0.0.1.

    Use as a context manager or call :meth:`start` / :meth:`stop`. Every process is also killed when the
    interpreter exits, and (``die_with_parent``, Linux) by the kernel if this process is SIGKILLed. The
    kernel ties that to the *thread* that started the server: with ``die_with_parent`` on, start and restart
    tasks from a thread that outlives the cluster (normally the main thread).
    """

    def __init__(
        self,
        num_ps: int = 2,
        num_workers: int = 2,
        *,
        host: str = "127.0.0.1",
        start_timeout: float = 120.0,
        log_dir: str | os.PathLike[str] | None = None,
        env: dict[str, str] | None = None,
        die_with_parent: bool = True,
        python: str = sys.executable,
        standby: bool = False,
    ) -> None:
        if num_ps < 1 or num_workers < 1:
            raise ValueError("a parameter-server cluster needs at least one PS and one worker")
        self.host = host
        self.start_timeout = start_timeout
        self.die_with_parent = die_with_parent
        self._python = python
        self._extra_env = dict(env or {})
        self._own_log_dir = log_dir is None
        self.log_dir = Path(log_dir) if log_dir is not None else Path(tempfile.mkdtemp(prefix="psguard-cluster-"))
        self._lock = threading.RLock()
        ports = free_ports(num_ps + num_workers, host)
        self._tasks: dict[tuple[str, int], _Task] = {}
        for job, count in (("ps", num_ps), ("worker", num_workers)):
            for i in range(count):
                task = _Task(job, i, ports.pop(0), self.log_dir / f"{job}-{i}.log")
                if standby:
                    task.standby = Standby(task.name, functools.partial(self._popen, task))
                self._tasks[(job, i)] = task

    # ----------------------------------------------------------------------------------------- addressing

    @property
    def num_ps(self) -> int:
        return sum(1 for job, _ in self._tasks if job == "ps")

    @property
    def num_workers(self) -> int:
        return sum(1 for job, _ in self._tasks if job == "worker")

    def address(self, job: str, index: int) -> str:
        return f"{self.host}:{self._task(job, index).port}"

    def cluster_spec(self, *, chief_port: int | None = None) -> dict[str, list[str]]:
        """The PS and worker addresses, plus a ``chief`` entry when ``chief_port`` is given.

        A plain dict so that callers that never import TensorFlow (agents, the CLI) can use it too.
        """
        spec: dict[str, list[str]] = {job: [self.address(job, i) for i in range(self._count(job))] for job in JOBS}
        if chief_port is not None:
            spec["chief"] = [f"{self.host}:{chief_port}"]
        return spec

    def cluster_resolver(self, *, chief_port: int | None = None) -> Any:
        """A ``SimpleClusterResolver`` for a chief in this process (task ``chief:0``, gRPC).

        The chief gets a fresh free port unless one is given: its address only matters while this process
        is connected, and a fixed one would collide with a previous chief that has not released it yet.
        """
        import tensorflow as tf

        spec = self.cluster_spec(chief_port=chief_port if chief_port is not None else free_port(self.host))
        return tf.distribute.cluster_resolver.SimpleClusterResolver(
            tf.train.ClusterSpec(spec), task_type="chief", task_id=0, rpc_layer="grpc"
        )

    def tf_config(self, *, chief_port: int | None = None) -> str:
        """``TF_CONFIG`` for a chief in another process (``TFConfigClusterResolver`` reads it)."""
        spec = self.cluster_spec(chief_port=chief_port if chief_port is not None else free_port(self.host))
        return json.dumps({"cluster": spec, "task": {"type": "chief", "index": 0}, "rpc_layer": "grpc"})

    @property
    def pids(self) -> dict[tuple[str, int], int | None]:
        """PID of each task's live process, ``None`` for a task that is down."""
        with self._lock:
            return {key: (t.proc.pid if t.proc is not None and t.alive() else None) for key, t in self._tasks.items()}

    @property
    def standby_pids(self) -> dict[tuple[str, int], int | None]:
        """The waiting standby process of each task (``None``: none waiting, or ``standby=False``)."""
        with self._lock:
            return {k: t.standby.pid if t.standby is not None else None for k, t in self._tasks.items()}

    def wait_standby(self, timeout: float = 120.0) -> None:
        """Wait until every task's standby is warm (see :meth:`fill_standby`); raise if one is missing."""
        deadline = time.monotonic() + timeout
        for task in self._tasks.values():
            if task.standby is None:
                continue
            while not task.standby.ready:
                if task.standby.pid is None:
                    raise ClusterError(f"{task.name} has no standby waiting; see {task.log_path}")
                if time.monotonic() > deadline:
                    raise ClusterError(f"the standby of {task.name} was not ready within {timeout:.0f}s")
                time.sleep(_POLL_S)

    def alive(self, job: str, index: int) -> bool:
        with self._lock:
            return self._task(job, index).alive()

    def log(self, job: str, index: int) -> str:
        """The end of a task's combined stdout/stderr, for failure messages."""
        return _log_tail(self._task(job, index).log_path)

    # ----------------------------------------------------------------------------------------- lifecycle

    def start(self) -> Self:
        """Start every task at once and return when all accept connections; on any failure stop them all."""
        with self._lock:
            _live.add(self)
            try:
                for task in self._tasks.values():
                    if not task.alive():
                        self._spawn(task)
                self._wait_ready(list(self._tasks.values()), self.start_timeout)
                self.fill_standby()
            except BaseException:
                self.stop()
                raise
        return self

    def fill_standby(self) -> None:
        """Start a warm standby (:mod:`psguard.agent.process.standby`) for every task that has none waiting.

        With ``standby=True``, :meth:`restart` swaps the waiting process in (~0.1 s instead of a TensorFlow
        start) and does not start the next one itself: that costs a TensorFlow import, so call this when the
        CPU is not needed elsewhere (after a recovery has been measured), from the thread that started us.
        """
        with self._lock:
            for task in self._tasks.values():
                if task.standby is not None:
                    task.standby.fill()

    def stop(self) -> None:
        """Kill and reap every task; safe to call twice, and from ``atexit``."""
        with self._lock:
            for task in self._tasks.values():
                self._signal(task, signal.SIGKILL)
            for task in self._tasks.values():
                self._reap(task, timeout=30.0)
                if task.standby is not None:
                    task.standby.discard()
            _live.discard(self)
            if self._own_log_dir:
                shutil.rmtree(self.log_dir, ignore_errors=True)

    def kill(self, job: str, index: int, sig: int = signal.SIGKILL, *, timeout: float = 30.0) -> None:
        """Send ``sig`` to one task's process group.

        For SIGKILL, SIGTERM and SIGINT this returns once the process is gone and reaped, and for SIGSTOP
        once it is stopped, so the caller can act on the new state at once; other signals (SIGCONT) return
        immediately.
        """
        with self._lock:
            task = self._task(job, index)
            self._signal(task, sig)
            if sig in (signal.SIGKILL, signal.SIGTERM, signal.SIGINT):
                self._reap(task, timeout=timeout)
            elif sig == signal.SIGSTOP and task.alive():
                assert task.proc is not None
                # Signals are delivered asynchronously; the kernel reports the stop to the parent. WNOWAIT
                # leaves every report (an exit too) for Popen to collect as usual.
                with contextlib.suppress(ChildProcessError):
                    os.waitid(os.P_PID, task.proc.pid, os.WSTOPPED | os.WEXITED | os.WNOWAIT)

    def restart(self, job: str, index: int, *, timeout: float | None = None) -> None:
        """Start the task again on the same address (killing it first if it still runs) and wait for it."""
        self.restart_many([(job, index)], timeout=timeout)

    def restart_many(self, names: Sequence[tuple[str, int]], *, timeout: float | None = None) -> None:
        """Restart several tasks at once (kill all, start all, then wait): a recovery pays one start, not N."""
        with self._lock:
            tasks = [self._task(job, index) for job, index in names]
            for task in tasks:
                self._signal(task, signal.SIGKILL)
            for task in tasks:
                self._reap(task, timeout=30.0)
            try:
                for task in tasks:
                    self._spawn(task)
                self._wait_ready(tasks, self.start_timeout if timeout is None else timeout)
            except BaseException:
                for task in tasks:
                    self._signal(task, signal.SIGKILL)
                    self._reap(task, timeout=30.0)
                raise

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    # ----------------------------------------------------------------------------------------- internals

    def _count(self, job: str) -> int:
        return sum(1 for j, _ in self._tasks if j == job)

    def _task(self, job: str, index: int) -> _Task:
        try:
            return self._tasks[(job, index)]
        except KeyError:
            raise ValueError(f"no task {job}:{index} in this cluster ({sorted(self._tasks)})") from None

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
        env.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
        # The server process only needs psguard importable; an editable install gives that, a checkout may not.
        root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
        # A chief's TF_CONFIG would make the server think it is that task.
        env.pop("TF_CONFIG", None)
        env.update(self._extra_env)
        return env

    def _popen(
        self, task: _Task, extra_env: dict[str, str], *, stdin: int = subprocess.PIPE
    ) -> subprocess.Popen[bytes]:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        cmd = [
            self._python,
            "-m",
            "psguard.agent.process.tf_server",
            "--cluster-spec",
            json.dumps(self.cluster_spec()),
            "--job",
            task.job,
            "--index",
            str(task.index),
        ]
        if self.die_with_parent:
            cmd += ["--parent-pid", str(os.getpid())]
        with open(task.log_path, "ab") as log_file:  # the child keeps its own copy of the fd
            return subprocess.Popen(
                cmd,
                stdin=stdin,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env={**self._env(), **extra_env},
                start_new_session=True,
            )

    def _spawn(self, task: _Task) -> None:
        proc = task.standby.take() if task.standby is not None else None
        task.proc = proc if proc is not None else self._popen(task, {}, stdin=subprocess.DEVNULL)

    def _wait_ready(self, tasks: list[_Task], timeout: float) -> None:
        """Wait until each task accepts TCP connections, failing fast if one exits first.

        A listening port is the only signal a ``tf.distribute.Server`` gives; it binds only once the whole
        server is built, so an open port means the chief can connect.
        """
        deadline = time.monotonic() + timeout
        pending = list(tasks)
        while pending:
            for task in list(pending):
                assert task.proc is not None
                code = task.proc.poll()
                if code is not None:
                    raise ClusterError(
                        f"{task.name} exited with code {code} before serving on {self.host}:{task.port}; "
                        f"log:\n{_log_tail(task.log_path)}"
                    )
                if port_open(self.host, task.port, timeout=0.5):
                    pending.remove(task)
            if not pending:
                return
            if time.monotonic() > deadline:
                names = ", ".join(f"{t.name} ({self.host}:{t.port})" for t in pending)
                raise ClusterError(f"{names} did not accept connections within {timeout:.0f}s")
            time.sleep(_POLL_S)

    def _signal(self, task: _Task, sig: int) -> None:
        proc = task.proc
        if proc is None or proc.poll() is not None:
            return  # reaped or never started: its pid (and process group id) may belong to someone else now
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)

    def _reap(self, task: _Task, timeout: float) -> None:
        proc = task.proc
        if proc is not None:
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                # A stopped (SIGSTOP) process still dies from SIGKILL; anything else is worth an error.
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=timeout)
