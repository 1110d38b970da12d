"""Is the task alive and useful? Probes with deadlines, and a monitor that acts on consecutive failures.

Three layers, because each catches what the one below cannot:

============================  ====================================================================
:class:`ProcessProbe`         the process exists and runs (not gone, not a zombie, not stopped)
:class:`TcpProbe`             its port accepts connections
:class:`GrpcStatusProbe`      the TF server answers an RPC before the deadline
============================  ====================================================================

The last one is the point: a frozen PS keeps its listening socket (the kernel completes TCP handshakes into the
backlog), so only a call that needs the server's own threads fails, with ``DEADLINE_EXCEEDED``. It is sent as raw
bytes through grpcio's generic API: no TensorFlow import in the agent. :class:`HttpProbe` checks another agent's
``/readyz``. :class:`HealthMonitor` runs the probes on its own thread; failing rounds are repeated every
``min(interval, deadline)``, so a dead task is found within about ``interval + failure_threshold * deadline``, and a
frozen one (stopped, or silent past the deadline) once it has been frozen for ``hung_after`` too.
"""

from __future__ import annotations

import contextlib
import enum
import http.client
import logging
import os
import socket
import ssl
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import TracebackType
from typing import TYPE_CHECKING, Annotated, Any

from psguard.agent.process.lifecycle import POSITIVE
from psguard.agent.process.reaper import stat_fields
from psguard.config import Check, Duration, validate
from psguard.ports import self_connected

if TYPE_CHECKING:
    from typing import Self

log = logging.getLogger(__name__)

GET_STATUS_METHOD = "/tensorflow.WorkerService/GetStatus"
"""Every ``tf.distribute.Server`` (PS, worker, chief) serves it; an empty request is a valid one."""


@dataclass(frozen=True)
class ProbeResult:
    """One probe, once. ``code`` is a short machine-readable cause (``DEADLINE_EXCEEDED``, ``stopped``)."""

    probe: str
    ok: bool
    latency_seconds: float
    code: str = "ok"
    error: str = ""


#: Probe failures of a task that exists but does not run or answer: it may go on by itself, unlike one that is gone
#: or refuses connections.
FROZEN = frozenset({"stopped", "timeout", "DEADLINE_EXCEEDED"})


class _Failed(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code

    @classmethod
    def connecting(cls, e: Exception, what: str, timeout: float) -> _Failed:
        """A connection that failed: timed out, refused, or another error."""
        if isinstance(e, TimeoutError):
            return cls("timeout", f"{what}: no answer within {timeout:.3g}s")
        if isinstance(e, ConnectionRefusedError):
            return cls("refused", f"{what}: connection refused")
        return cls("error", f"{what}: {type(e).__name__}: {e}")


class Probe:
    """What the monitor runs: ``check`` never raises (it times ``_check`` and turns every exception into a failed
    result: a probe must not kill its monitor) and never takes much longer than ``timeout``."""

    def __init__(self, name: str) -> None:
        self.name = name

    def check(self, timeout: float) -> ProbeResult:
        start = time.perf_counter()
        try:
            self._check(max(timeout, 0.001))
        except _Failed as e:
            return ProbeResult(self.name, False, time.perf_counter() - start, e.code, str(e))
        except Exception as e:
            return ProbeResult(self.name, False, time.perf_counter() - start, type(e).__name__, str(e) or repr(e))
        return ProbeResult(self.name, True, time.perf_counter() - start)

    def _check(self, timeout: float) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Release connections; the probe can still be used afterwards (it reconnects)."""


class ProcessProbe(Probe):
    """The task's process exists and is runnable. ``pid`` is a callable so it follows restarts."""

    def __init__(self, pid: Callable[[], int | None], *, name: str = "process") -> None:
        super().__init__(name)
        self._pid = pid

    def _check(self, timeout: float) -> None:
        pid = self._pid()
        if pid is None:
            raise _Failed("no_process", "no task process is running")
        if not sys.platform.startswith("linux"):
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                raise _Failed("no_process", f"process {pid} does not exist") from None
            return
        fields = stat_fields(pid)
        if not fields:
            raise _Failed("no_process", f"process {pid} does not exist")
        state = fields[0]
        if state in ("Z", "X"):
            raise _Failed("exited", f"process {pid} has exited (state {state})")
        if state in ("T", "t"):
            raise _Failed("stopped", f"process {pid} is stopped (SIGSTOP or a debugger)")


class TcpProbe(Probe):
    """The port accepts TCP connections. Passes for a frozen process: see the module docstring."""

    def __init__(self, host: str, port: int, *, name: str = "tcp") -> None:
        super().__init__(name)
        self.host, self.port = host, port

    def _check(self, timeout: float) -> None:
        try:
            with socket.create_connection((self.host, self.port), timeout=timeout) as s:
                if self_connected(s):  # nothing listens, and the port was ours until closed: see psguard.ports
                    raise _Failed("refused", f"nothing listens on {self.host}:{self.port} (self-connection)")
        except OSError as e:
            raise _Failed.connecting(e, f"TCP to {self.host}:{self.port}", timeout) from None


class GrpcStatusProbe(Probe):
    """A ``GetStatus`` RPC to a ``tf.distribute.Server`` at ``target`` (``host:port``), with a deadline.

    The channel is kept between checks (a warm call costs ~0.3 ms) and dropped after any failure, so a
    server restarted on the same address is reached at once instead of after gRPC's reconnect backoff.
    """

    def __init__(self, target: str, *, name: str = "rpc", method: str = GET_STATUS_METHOD) -> None:
        super().__init__(name)
        import grpc  # here, not at module level: modules that only import the monitor should not pay for it

        self._grpc = grpc
        self.target = target.removeprefix("grpc://")
        self.method = method
        self._lock = threading.Lock()
        self._channel: Any = None
        self._call: Any = None

    def _check(self, timeout: float) -> None:
        grpc = self._grpc
        with self._lock:
            if self._channel is None:
                self._channel = grpc.insecure_channel(
                    self.target,
                    options=[
                        ("grpc.enable_retries", 0),
                        # Our own connection: a subchannel shared with an earlier, failed channel would
                        # answer UNAVAILABLE from its backoff state instead of trying the server again.
                        ("grpc.use_local_subchannel_pool", 1),
                        ("grpc.initial_reconnect_backoff_ms", 100),
                        ("grpc.max_reconnect_backoff_ms", 1000),
                        # Not min_reconnect_backoff_ms: gRPC also uses it as the connect timeout, and a short
                        # one turns a frozen server's DEADLINE_EXCEEDED into a vague UNAVAILABLE.
                    ],
                )
                # No (de)serializers: bytes in, bytes out. An empty message is a valid GetStatusRequest.
                self._call = self._channel.unary_unary(self.method)
            call = self._call
        try:
            call(b"", timeout=timeout)
        except BaseException as e:
            self.close()  # a new channel for the next check (see the class doc)
            if not isinstance(e, grpc.RpcError):
                raise
            code = e.code() if hasattr(e, "code") else None
            name = code.name if code is not None else "UNKNOWN"
            details = e.details() if hasattr(e, "details") else str(e)
            if name == "DEADLINE_EXCEEDED":
                details = f"no answer within {timeout:.3g}s (frozen or overloaded server)"
            elif name == "UNIMPLEMENTED":
                details = f"{self.method} is not served here: is {self.target} a tf.distribute.Server?"
            raise _Failed(name, f"{self.method} on {self.target}: {name}: {details}") from None

    def close(self) -> None:
        with self._lock:
            channel, self._channel, self._call = self._channel, None, None
        if channel is not None:
            channel.close()


class HttpProbe(Probe):
    """``GET url`` answers 2xx within the deadline (another agent's ``/readyz``).

    ``headers`` may carry a bearer token; it is sent, never logged or put into an error message.
    """

    def __init__(
        self,
        url: str,
        *,
        name: str = "http",
        headers: Mapping[str, str] | None = None,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        super().__init__(name)
        self._tls = tls  # for https://: the CA to verify against and the client certificate to present
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"HttpProbe needs an http:// or https:// URL, got {url!r}")
        self.url = url
        self._parts = parts
        self._headers = dict(headers or {})

    def _check(self, timeout: float) -> None:
        parts = self._parts
        conn: http.client.HTTPConnection
        if parts.scheme == "https":
            conn = http.client.HTTPSConnection(parts.hostname or "", parts.port, timeout=timeout, context=self._tls)
        else:
            conn = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=timeout)
        deadline = time.monotonic() + timeout
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        try:
            conn.request("GET", path, headers=self._headers)
            response = conn.getresponse()
            response.read(64 * 1024)
            status = response.status
        except (OSError, http.client.HTTPException) as e:
            raise _Failed.connecting(e, f"GET {self.url}", timeout) from None
        finally:
            conn.close()
        if time.monotonic() > deadline:
            raise _Failed("timeout", f"GET {self.url}: answered after the {timeout:.3g}s deadline")
        if not 200 <= status < 300:
            raise _Failed(f"http_{status}", f"GET {self.url}: HTTP {status}")


# ----------------------------------------------------------------------------------------------- monitor


class Health(enum.StrEnum):
    STARTING = "starting"  # since start() or reset(): failures are expected until the first success
    HEALTHY = "healthy"
    UNHEALTHY = "unhealthy"
    STOPPED = "stopped"
    FAILED = "failed"  # the monitor itself broke; see stop()


@dataclass(frozen=True)
class HealthReport:
    """Why a task was declared unhealthy; handed to ``on_unhealthy``."""

    task: str
    reason: str
    consecutive_failures: int
    last: ProbeResult  # the round's failed probe


@dataclass(frozen=True)
class MonitorStatus:
    task: str
    health: Health
    consecutive_failures: int
    rounds: int
    unhealthy_count: int  # how many times on_unhealthy fired
    probes: tuple[ProbeResult, ...] = field(default_factory=tuple)  # the last round's results


@dataclass(frozen=True)
class MonitorConfig:
    """Probe timing, as the agent's YAML section ``probe:``."""

    interval: Annotated[Duration, POSITIVE] = 1.0
    deadline: Annotated[Duration, POSITIVE] = 1.0
    failure_threshold: Annotated[int, Check(lambda n: n >= 1, ">= 1")] = 3
    startup_timeout: Annotated[Duration, POSITIVE] = 120.0
    #: How long a frozen task (stopped, or not answering within the deadline) is waited for before it is restarted.
    #: A restart costs a recovery (seconds, and the steps since the last capture) where plain TF waits a freeze out:
    #: waiting about as long as a restart costs before restarting loses at most twice what the better choice would
    #: (the ski-rental bound), and nothing for a freeze shorter than that. 0: restart as soon as the rounds fail.
    hung_after: Annotated[Duration, Check(lambda s: s >= 0, ">= 0")] = 10.0

    def __post_init__(self) -> None:
        validate(self)


class HealthMonitor:
    """Run ``probes`` in order every ``interval``; ``failure_threshold`` failed rounds in a row → unhealthy.

    A round stops at its first failing probe and all its probes share one ``deadline``. ``on_unhealthy`` fires
    at the threshold and again after each further ``failure_threshold`` failed rounds. After a restart call
    :meth:`reset`: failures then count only once the task has answered, or ``startup_timeout`` has passed.
    ``on_result`` sees every probe result, ``on_health`` every change of :class:`Health`; callbacks' exceptions
    are logged. The timing is ``config`` with the fields given as keywords replaced.
    """

    def __init__(
        self,
        task: str,
        probes: Sequence[Probe],
        *,
        config: MonitorConfig | None = None,
        on_unhealthy: Callable[[HealthReport], None] | None = None,
        on_result: Callable[[str, ProbeResult], None] | None = None,
        on_health: Callable[[str, Health], None] | None = None,
        **timing: Any,
    ) -> None:
        if not probes:
            raise ValueError("HealthMonitor needs at least one probe")
        self.config = replace(config or MonitorConfig(), **timing)
        self.task = task
        self._probes = tuple(probes)
        self._on_unhealthy = on_unhealthy
        self._on_result = on_result
        self._on_health = on_health
        self._lock = threading.Lock()
        self._stop = threading.Event()
        # Set by reset() and stop(): the thread probes at once instead of at its next round (a new generation
        # waits for the last restarted PS to be seen serving).
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._health = Health.STARTING
        self._since = time.monotonic()
        self._failures = 0
        self._failing_since = 0.0  # when the rounds in a row that failed began
        self._rounds = 0
        self._unhealthy_count = 0
        self._last: tuple[ProbeResult, ...] = ()

    def start(self) -> Self:
        with self._lock:
            if self._thread is not None:
                raise RuntimeError(f"health monitor for {self.task} was already started")
            self._since = time.monotonic()
            self._thread = threading.Thread(target=self._run, name=f"psguard-monitor-{self.task}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop probing and close the probes; re-raise whatever broke the monitor's thread.

        Returns within about one ``deadline`` (a probe in flight is not interrupted).
        """
        self._stop.set()
        self._wake.set()
        thread = self._thread
        if thread is threading.current_thread():
            return  # from a callback: the loop ends after it; the probes are closed by a later stop()
        if thread is not None:
            thread.join(self.config.deadline + 10.0)
            if thread.is_alive():
                raise TimeoutError(f"health monitor for {self.task} did not stop")
        for probe in self._probes:
            with contextlib.suppress(Exception):
                probe.close()
        with self._lock:
            if self._health is not Health.FAILED:
                self._health = Health.STOPPED
        if self._error is not None:
            raise self._error

    def reset(self) -> None:
        """The task was (re)started: back to STARTING, forget counted failures."""
        with self._lock:
            if self._health in (Health.STOPPED, Health.FAILED):
                return
            before, self._health = self._health, Health.STARTING
            self._since = time.monotonic()
            self._failures = 0
        self._wake.set()
        if before is not Health.STARTING:
            self._call(self._on_health, "on_health", self.task, Health.STARTING)

    @property
    def healthy(self) -> bool:
        with self._lock:
            return self._health is Health.HEALTHY

    @property
    def health(self) -> Health:
        with self._lock:
            return self._health

    def status(self) -> MonitorStatus:
        with self._lock:
            return MonitorStatus(
                self.task, self._health, self._failures, self._rounds, self._unhealthy_count, self._last
            )

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    # ------------------------------------------------------------------------------------------ the thread

    #: Between failed rounds while the task is starting: a recovery waits for a new PS to be seen healthy, and
    #: a round of a task not listening yet is a refused connect, cheap at this pace.
    STARTING_POLL = 0.05

    def _run(self) -> None:
        try:
            next_start = time.monotonic()
            while True:
                if self._wake.wait(max(0.0, next_start - time.monotonic())):
                    self._wake.clear()  # a reset (probe the new run now) or a stop
                if self._stop.is_set():
                    break
                round_start = time.monotonic()
                ok = self._round()
                step = self.config.interval if ok else min(self.config.interval, self.config.deadline)
                if not ok and self.health is Health.STARTING:
                    step = min(step, self.STARTING_POLL)
                next_start = round_start + step
        except BaseException as e:
            log.exception("event=monitor_failed task=%s", self.task)
            self._error = e
            with self._lock:
                self._health = Health.FAILED

    def _round(self) -> bool:
        deadline = time.monotonic() + self.config.deadline
        results: list[ProbeResult] = []
        for probe in self._probes:
            result = probe.check(deadline - time.monotonic())
            results.append(result)
            self._call(self._on_result, "on_result", self.task, result)
            if not result.ok:
                break
        ok = results[-1].ok  # a round stops at its first failure
        before = self.health
        report = self._update(ok, tuple(results))
        after = self.health
        if after is not before:
            self._call(self._on_health, "on_health", self.task, after)
        if report is not None:
            log.warning(
                "event=unhealthy task=%s failures=%d probe=%s code=%s reason=%r",
                self.task,
                report.consecutive_failures,
                report.last.probe,
                report.last.code,
                report.reason,
            )
            self._call(self._on_unhealthy, "on_unhealthy", report)
        return ok

    def _update(self, ok: bool, results: tuple[ProbeResult, ...]) -> HealthReport | None:
        """Advance the state machine under the lock; the report to fire, if any."""
        now = time.monotonic()
        with self._lock:
            self._rounds += 1
            self._last = results
            previous = self._health
            if ok:
                self._failures = 0
                self._health = Health.HEALTHY
                if previous is not Health.HEALTHY:
                    log.info("event=healthy task=%s was=%s", self.task, previous.value)
                return None
            last = results[-1]  # a round has a probe at least
            if previous is Health.STARTING:
                if now - self._since < self.config.startup_timeout:
                    return None
                reason = f"not healthy within the startup timeout of {self.config.startup_timeout:g}s"
                failures = 1
            else:
                self._failures += 1
                if self._failures == 1:
                    self._failing_since = now
                if self._failures < self.config.failure_threshold:
                    return None
                frozen = now - self._failing_since
                if last.code in FROZEN and frozen < self.config.hung_after:
                    return None  # a freeze may end: waited out while shorter than a restart costs
                failures = self._failures
                reason = f"{failures} probe rounds failed in a row"
                if last.code in FROZEN:
                    reason += f" (frozen {frozen:.1f}s, hung_after {self.config.hung_after:g}s)"
            reason += f"; last: {last.probe}: {last.error}"
            self._health = Health.UNHEALTHY
            self._failures = 0
            self._since = now
            self._unhealthy_count += 1
            return HealthReport(self.task, reason, failures, last)

    def _call(self, callback: Callable[..., None] | None, what: str, *args: Any) -> None:
        if callback is None:
            return
        try:
            callback(*args)
        except Exception:
            log.exception("event=callback_failed task=%s callback=%s", self.task, what)
