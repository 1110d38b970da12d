"""A real single-node HDFS 2.7.3 (NameNode + DataNode) on loopback, for tests, chaos runs and benchmarks.

:func:`psguard.testbed.hadoop_runtime.prepare` assembles the Hadoop runtime into a cache once (from pyspark's
source package and Debian's jersey1 jars: it says why), and :class:`HdfsCluster` runs the daemons straight from the
jars with ``java`` (no Hadoop shell scripts), which keeps every address on 127.0.0.1 and every port free-chosen, so
parallel runs do not collide.

Command line (for CI, so the download happens in a visible step and is cached)::

    python -m psguard.testbed.hdfs prepare     # idempotent; prints progress
    python -m psguard.testbed.hdfs run         # start a cluster and print its URLs until Ctrl-C
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import getpass
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Final
from xml.sax.saxutils import escape

from psguard.ports import free_ports, port_open
from psguard.testbed.hadoop_runtime import HdfsError, prepare, progress, quiet

__all__ = ["HDFS_NATIVE_FAIL_FAST", "HdfsCluster", "main"]

# Hadoop 2.7 reflects into JDK internals (buffer cleaners, Kerberos names, ...). On Java 9+ those packages are
# closed unless opened explicitly; -XX:+IgnoreUnrecognizedVMOptions lets the same command line run on Java 8.
_ADD_OPENS: Final = (
    *(
        f"--add-opens=java.base/{pkg}=ALL-UNNAMED"
        for pkg in ("java.lang", "java.lang.reflect", "java.nio", "java.util", "java.io", "java.net", "sun.nio.ch")
    ),
    "--add-opens=java.security.jgss/sun.security.krb5=ALL-UNNAMED",
)
_NAMENODE_CLASS: Final = "org.apache.hadoop.hdfs.server.namenode.NameNode"
_DATANODE_CLASS: Final = "org.apache.hadoop.hdfs.server.datanode.DataNode"
_HOST: Final = "127.0.0.1"

# hdfs-native (0.14) retries a refused NameNode connection with exponential backoff for about 3 minutes by default
# (dfs.client.failover.max.attempts=15, up to 15 s apart). In a testbed a dead NameNode is the point of the test,
# so clients from `HdfsCluster.fsspec_hdfs()` give up at once unless told otherwise. These keys do *not* bound a
# NameNode that accepts connections but never answers (hung/stopped JVM): nothing in hdfs-native does, so
# callers that must not hang need their own deadline.
HDFS_NATIVE_FAIL_FAST: Final[dict[str, str]] = {
    "dfs.client.failover.max.attempts": "0",
    # DataNode reads/writes: the Hadoop default is 60 s.
    "dfs.client.socket-timeout": "10000",
}


# --------------------------------------------------------------------------------------------------------------
# configuration
# --------------------------------------------------------------------------------------------------------------


def _site_xml(props: dict[str, str]) -> str:
    body = "".join(
        f"  <property><name>{escape(k)}</name><value>{escape(v)}</value></property>\n" for k, v in props.items()
    )
    return f'<?xml version="1.0"?>\n<configuration>\n{body}</configuration>\n'


_LOG4J: Final = """\
log4j.rootLogger=INFO, console
log4j.appender.console=org.apache.log4j.ConsoleAppender
log4j.appender.console.target=System.err
log4j.appender.console.layout=org.apache.log4j.PatternLayout
log4j.appender.console.layout.ConversionPattern=%d{ISO8601} %p %c{2}: %m%n
# One line per block or per RPC would drown the lines that explain a failure.
log4j.logger.org.apache.hadoop.hdfs.server.datanode.DataNode.clienttrace=WARN
log4j.logger.org.apache.hadoop.hdfs.server.namenode.FSNamesystem.audit=WARN
log4j.logger.BlockStateChange=WARN
log4j.logger.org.apache.hadoop.util.NativeCodeLoader=ERROR
log4j.logger.org.mortbay.log=WARN
"""


def _hadoop_config(work: Path, ports: dict[str, int]) -> dict[str, dict[str, str]]:
    """Core and HDFS settings; every listener is pinned to 127.0.0.1 so nothing is reachable off the host."""
    core = {
        "fs.defaultFS": f"hdfs://{_HOST}:{ports['rpc']}",
        "hadoop.tmp.dir": str(work / "tmp"),
        "hadoop.security.authentication": "simple",
    }
    hdfs = {
        "dfs.namenode.name.dir": f"file://{work / 'name'}",
        "dfs.datanode.data.dir": f"file://{work / 'data'}",
        "dfs.namenode.rpc-address": f"{_HOST}:{ports['rpc']}",
        "dfs.namenode.http-address": f"{_HOST}:{ports['http']}",
        "dfs.namenode.https-address": f"{_HOST}:0",
        "dfs.namenode.secondary.http-address": f"{_HOST}:0",
        "dfs.namenode.secondary.https-address": f"{_HOST}:0",
        "dfs.namenode.backup.address": f"{_HOST}:0",
        "dfs.namenode.backup.http-address": f"{_HOST}:0",
        "dfs.datanode.address": f"{_HOST}:{ports['dn']}",
        "dfs.datanode.http.address": f"{_HOST}:{ports['dn_http']}",
        "dfs.datanode.https.address": f"{_HOST}:0",
        "dfs.datanode.ipc.address": f"{_HOST}:{ports['dn_ipc']}",
        # WebHDFS redirects reads/writes to the DataNode by this name; the default would be the machine's
        # hostname, which may not resolve (containers) or may resolve off-loopback.
        "dfs.datanode.hostname": _HOST,
        "dfs.namenode.datanode.registration.ip-hostname-check": "false",
        "dfs.replication": "1",
        "dfs.permissions.enabled": "false",
        "dfs.webhdfs.enabled": "true",
        # Leave safe mode as soon as the blocks are reported, instead of 30 s later.
        "dfs.namenode.safemode.extension": "0",
        # Faster registration, so start/restart are quick, and a stopped DataNode is declared dead after
        # 2 * recheck + 10 * heartbeat = 30 s instead of 10.5 min, which chaos runs can wait for.
        "dfs.heartbeat.interval": "1",
        "dfs.namenode.heartbeat.recheck-interval": "10000",
        # The block scanner re-reads every block in the background: pure CPU cost on a 2-core CI box.
        "dfs.block.scanner.volume.bytes.per.second": "0",
        # A small disk must not push the NameNode into safe mode (default: 100 MB reserved).
        "dfs.namenode.resource.du.reserved": str(16 << 20),
    }
    return {"core-site.xml": core, "hdfs-site.xml": hdfs}


def _find_java() -> str:
    java_home = os.environ.get("JAVA_HOME")
    if java_home and (Path(java_home) / "bin" / "java").is_file():
        return str(Path(java_home) / "bin" / "java")
    found = shutil.which("java")
    if found is None:
        raise HdfsError("no `java` on PATH and no JAVA_HOME; install a JRE (e.g. apt-get install default-jre-headless)")
    return found


# --------------------------------------------------------------------------------------------------------------
# cluster
# --------------------------------------------------------------------------------------------------------------

# Loopback never goes through an HTTP proxy, whatever the environment says.
_LOOPBACK_OPENER: Final = urllib.request.build_opener(urllib.request.ProxyHandler({}))
_LIVE: set[HdfsCluster] = set()
_LIVE_LOCK = threading.Lock()
# How a daemon (or our own pre-check) reports that another process took one of its ports.
_BIND_ERRORS: Final = ("Address already in use", "Port in use")


@atexit.register
def _stop_all_at_exit() -> None:
    """JVMs run in their own sessions, so nothing else would stop them when the interpreter exits."""
    with _LIVE_LOCK:
        clusters = list(_LIVE)
    for cluster in clusters:
        with contextlib.suppress(Exception):
            cluster.close()


def _tail(path: Path, lines: int = 40) -> str:
    try:
        with path.open("rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - 64 * 1024))
            text = fh.read().decode("utf-8", "replace")
    except OSError as exc:
        return f"(no log: {exc})"
    return "\n".join(text.splitlines()[-lines:])


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _exited(proc: subprocess.Popen[bytes]) -> bool:
    """True once ``proc`` has exited, *without* reaping it: the zombie keeps its pid (= the group id) reserved,
    so a following ``killpg`` cannot hit an unrelated process that got the recycled number."""
    if proc.returncode is not None:
        return True
    try:
        return os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


class HdfsCluster:
    """One NameNode and one DataNode, each a ``java`` process in its own session, on free loopback ports.

    ``start()`` formats the NameNode only the first time, so ``stop()`` then ``start()`` (or ``restart()``)
    brings back the same namespace and blocks on the same ports: an outage, not a new cluster. The daemons are
    stopped by ``stop()``/``close()``, by the context manager, when ``start()`` fails and at interpreter exit.
    """

    def __init__(
        self,
        work_dir: Path | str | None = None,
        *,
        cache_dir: Path | None = None,
        heap_mb: int = 256,
        start_timeout: float = 90.0,
        extra_config: dict[str, str] | None = None,
        jvm_args: Sequence[str] = (),
        log: Callable[[str], None] = quiet,
    ) -> None:
        self._owns_work_dir = work_dir is None
        self.work_dir = Path(tempfile.mkdtemp(prefix="psguard-hdfs-") if work_dir is None else work_dir)
        self._cache_dir = cache_dir
        self.heap_mb = heap_mb
        self.start_timeout = start_timeout
        self._extra_config = dict(extra_config or {})
        self._jvm_args = tuple(jvm_args)
        self._log = log
        self._ports: dict[str, int] | None = None
        self._procs: dict[str, subprocess.Popen[bytes]] = {}
        self.host: Final = _HOST
        self.user: str = os.environ.get("HADOOP_USER_NAME") or getpass.getuser()

    # ---- addresses ----------------------------------------------------------------------------------------

    def _port(self, name: str) -> int:
        if self._ports is None:
            raise HdfsError("the cluster has not been started yet, so it has no ports")
        return self._ports[name]

    @property
    def rpc_port(self) -> int:
        """NameNode RPC port, for ``hdfs://`` clients such as hdfs-native."""
        return self._port("rpc")

    @property
    def http_port(self) -> int:
        """NameNode HTTP port: WebHDFS and ``/jmx``."""
        return self._port("http")

    @property
    def datanode_http_port(self) -> int:
        """Where WebHDFS redirects data transfers to."""
        return self._port("dn_http")

    @property
    def pids(self) -> dict[str, int]:
        """Daemon pids (also their process-group ids), for chaos tests that signal one daemon directly."""
        return {name: proc.pid for name, proc in self._procs.items()}

    @property
    def running(self) -> bool:
        return bool(self._procs) and all(proc.poll() is None for proc in self._procs.values())

    @property
    def log_dir(self) -> Path:
        return self.work_dir / "logs"

    def url(self, path: str = "/") -> str:
        return f"hdfs://{self.host}:{self.rpc_port}/{path.lstrip('/')}"

    def webhdfs_url(self, path: str = "/") -> str:
        return f"webhdfs://{self.host}:{self.http_port}/{path.lstrip('/')}"

    # ---- clients ------------------------------------------------------------------------------------------

    def fsspec_hdfs(self, **options: str) -> Any:
        """A fresh hdfs-native filesystem; fresh because fsspec's instance cache would hand out one client for
        every cluster that happened to reuse a port.

        ``options`` are Hadoop client settings layered over :data:`HDFS_NATIVE_FAIL_FAST`; pass
        ``**{"dfs.client.failover.max.attempts": "15"}`` to get hdfs-native's own patient retries back (e.g. to
        ride out a ``restart()``).
        """
        from hdfs_native.fsspec import HdfsFileSystem

        config = {**HDFS_NATIVE_FAIL_FAST, **options}
        return HdfsFileSystem(host=self.host, port=self.rpc_port, skip_instance_cache=True, **config)

    def fsspec_webhdfs(self, *, timeout: float | None = 30.0, **kwargs: Any) -> Any:
        """A fresh fsspec WebHDFS filesystem acting as the user hdfs-native also uses, so owners match.

        fsspec sends its requests without a timeout, so a NameNode that hangs would hang the caller forever;
        ``timeout`` (seconds, per connect and per read) is put on the session as a default. Proxy variables are
        ignored: this is loopback, and a CI proxy would only break it.
        """
        from fsspec.implementations.webhdfs import WebHDFS

        kwargs.setdefault("user", self.user)
        fs = WebHDFS(host=self.host, port=self.http_port, skip_instance_cache=True, **kwargs)
        session = fs.session
        session.trust_env = False
        if timeout is not None:
            session.request = functools.partial(session.request, timeout=timeout)
        return fs

    # ---- lifecycle ----------------------------------------------------------------------------------------

    def __enter__(self) -> HdfsCluster:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        where = f"{self.host}:{self._ports['rpc']}" if self._ports else "not started"
        return f"HdfsCluster({where}, work_dir={str(self.work_dir)!r}, running={self.running})"

    def start(self) -> HdfsCluster:
        """Format (first time only), start both daemons and wait until HDFS accepts writes.

        Free ports are chosen on the first start; a collision with another process grabbing one of them in the
        meantime is retried with new ports. Later starts reuse the ports, as clients still hold the URLs.
        """
        if self._procs:
            raise HdfsError("cluster already started")
        home = prepare(self._cache_dir, log=self._log)
        first = self._ports is None
        for attempt in range(3 if first else 1):
            if first:
                self._ports = dict(zip(("rpc", "http", "dn", "dn_http", "dn_ipc"), free_ports(5), strict=True))
            try:
                self._start_once(home)
                return self
            except BaseException as exc:  # also Ctrl-C mid-start: never leave half a cluster running
                self.stop()
                collided = isinstance(exc, HdfsError) and any(m in str(exc) for m in _BIND_ERRORS)
                if not (first and collided and attempt < 2):
                    raise
                self._log(f"port collision, retrying with new ports: {str(exc).splitlines()[0]}")
        raise AssertionError("unreachable")

    def _start_once(self, home: Path) -> None:
        assert self._ports is not None
        busy = [p for p in self._ports.values() if port_open(self.host, p, timeout=0.2)]
        if busy:
            raise HdfsError(f"Address already in use: ports {busy} on {self.host} are taken")
        conf = self._write_config()
        t0 = time.monotonic()
        with _LIVE_LOCK:
            _LIVE.add(self)
        if not (self.work_dir / "name" / "current" / "VERSION").is_file():
            self._format(home, conf)
        self._procs["namenode"] = self._spawn("namenode", home, conf, [_NAMENODE_CLASS])
        self._procs["datanode"] = self._spawn("datanode", home, conf, [_DATANODE_CLASS])
        self._wait_ready(time.monotonic() + self.start_timeout)
        self._log(f"HDFS up at {self.url()} (web {self.http_port}) in {time.monotonic() - t0:.1f}s")

    def _write_config(self) -> Path:
        assert self._ports is not None
        conf = self.work_dir / "conf"
        for sub in ("hdfs", "datanode", "secondary", "static"):
            # The daemons' HTTP servers look up these folders as classpath resources and refuse to start
            # without them; the web UIs themselves are not needed.
            (conf / "webapps" / sub).mkdir(parents=True, exist_ok=True)
        for sub in ("logs", "tmp"):
            (self.work_dir / sub).mkdir(parents=True, exist_ok=True)
        files = _hadoop_config(self.work_dir, self._ports)
        files["hdfs-site.xml"].update(self._extra_config)
        for name, props in files.items():
            (conf / name).write_text(_site_xml(props))
        (conf / "log4j.properties").write_text(_LOG4J)
        # Present but empty: silences the daemons' warning about a missing metrics configuration.
        (conf / "hadoop-metrics2.properties").write_text("")
        return conf

    def _java_cmd(self, home: Path, conf: Path, args: Sequence[str]) -> list[str]:
        classpath = os.pathsep.join([str(conf), str(home / "jars" / "*"), str(home / "jersey1" / "*")])
        return [
            _find_java(),
            f"-Xmx{self.heap_mb}m",
            f"-Xms{min(self.heap_mb, 64)}m",
            # Serial GC: fewest threads and least memory overhead, and pauses do not matter here.
            "-XX:+UseSerialGC",
            # The quick JIT only: a test's daemons live seconds to minutes, and the optimising compiler's threads
            # cost more CPU than they save (a start and stop: 11.5 s of CPU with it, 7-8 s without, on 2 cores).
            "-XX:TieredStopAtLevel=1",
            "-XX:+IgnoreUnrecognizedVMOptions",
            *_ADD_OPENS,
            "-Djava.net.preferIPv4Stack=true",
            f"-Dhadoop.home.dir={home}",
            f"-Dhadoop.log.dir={self.log_dir}",
            f"-Djava.io.tmpdir={self.work_dir / 'tmp'}",
            *self._jvm_args,
            "-cp",
            classpath,
            *args,
        ]

    def _format(self, home: Path, conf: Path) -> None:
        log_path = self.log_dir / "format.log"
        cmd = self._java_cmd(home, conf, [_NAMENODE_CLASS, "-format", "-force", "-nonInteractive"])
        with log_path.open("ab") as log:
            try:
                done = subprocess.run(
                    cmd,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    cwd=self.work_dir,
                    timeout=self.start_timeout,
                    start_new_session=True,
                )
            except subprocess.TimeoutExpired as exc:
                raise HdfsError(f"NameNode format timed out; {log_path}:\n{_tail(log_path)}") from exc
        if done.returncode != 0:
            raise HdfsError(f"NameNode format failed ({done.returncode}); {log_path}:\n{_tail(log_path)}")

    def _spawn(self, name: str, home: Path, conf: Path, args: Sequence[str]) -> subprocess.Popen[bytes]:
        log_path = self.log_dir / f"{name}.log"
        with log_path.open("ab") as log:
            log.write(f"\n===== {time.strftime('%Y-%m-%d %H:%M:%S')} starting {name} =====\n".encode())
            log.flush()
            return subprocess.Popen(
                self._java_cmd(home, conf, args),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.work_dir,
                start_new_session=True,
            )

    def jmx(self, query: str) -> dict[str, Any]:
        """First bean matching ``query`` from the NameNode's ``/jmx`` (its health and capacity counters)."""
        url = f"http://{self.host}:{self.http_port}/jmx?qry={query}"
        with _LOOPBACK_OPENER.open(url, timeout=2.0) as resp:
            beans = json.load(resp).get("beans", [])
        if not beans:
            raise HdfsError(f"no JMX bean {query}")
        return dict(beans[0])

    def _wait_ready(self, deadline: float) -> None:
        """Ready means writable: the DataNode is live *and* has reported storage, and safe mode is off."""
        state: dict[str, Any] = {}
        while True:
            for name, proc in self._procs.items():
                if proc.poll() is not None:
                    raise HdfsError(f"{name} exited with {proc.returncode} during start-up\n{self._logs_tail(name)}")
            try:
                state = self.jmx("Hadoop:service=NameNode,name=FSNamesystemState")
            except (OSError, ValueError, HdfsError):
                state = {}
            if (
                state.get("NumLiveDataNodes") == 1
                and state.get("FSState") == "Operational"
                and int(state.get("CapacityRemaining", 0)) > 0
            ):
                return
            if time.monotonic() > deadline:
                seen = {k: state.get(k) for k in ("NumLiveDataNodes", "FSState", "CapacityRemaining")}
                raise HdfsError(
                    f"HDFS not ready within {self.start_timeout:.0f}s (last /jmx: {seen})\n{self._logs_tail()}"
                )
            time.sleep(0.2)

    def _logs_tail(self, first: str = "namenode") -> str:
        """Both daemons' log tails, the one that failed first, since that is where the cause is."""
        parts = []
        for name in sorted(("namenode", "datanode"), key=lambda n: n != first):
            path = self.log_dir / f"{name}.log"
            if path.exists():
                parts.append(f"--- tail of {path} ---\n{_tail(path)}")
        return "\n".join(parts)

    def stop(self, *, timeout: float = 15.0, kill: bool = False) -> None:
        """Stop both daemons and reap them; data stays, so ``start()`` resumes the same cluster.

        SIGTERM lets the NameNode close its edit log cleanly; ``kill=True`` sends SIGKILL straight away to
        simulate a crash. Whatever is left after ``timeout`` is killed, whole process group included.
        """
        procs = list(self._procs.values())
        first = signal.SIGKILL if kill else signal.SIGTERM
        for proc in procs:
            if not _exited(proc):
                _signal_group(proc.pid, first)
        deadline = time.monotonic() + timeout
        while any(not _exited(p) for p in procs) and time.monotonic() < deadline:
            time.sleep(0.05)
        for proc in procs:
            # Leaders are at most zombies here, so their group ids cannot have been recycled yet.
            _signal_group(proc.pid, signal.SIGKILL)
            proc.wait()
        self._procs.clear()

    def restart(self, *, downtime: float = 0.0, kill: bool = False) -> None:
        """An outage: stop both daemons, stay down ``downtime`` seconds, come back on the same ports and data."""
        self.stop(kill=kill)
        if downtime > 0:
            time.sleep(downtime)
        self.start()

    def close(self) -> None:
        """Stop, and delete the work folder if we created it (its logs go with it)."""
        self.stop()
        with _LIVE_LOCK:
            _LIVE.discard(self)
        if self._owns_work_dir:
            shutil.rmtree(self.work_dir, ignore_errors=True)


# --------------------------------------------------------------------------------------------------------------
# command line
# --------------------------------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    """``prepare`` fetches the runtime; ``run`` starts a cluster and prints its URLs until interrupted."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m psguard.testbed.hdfs", description=__doc__)
    parser.add_argument("--cache-dir", type=Path, default=None, help="default: $PSGUARD_CACHE/hadoop")
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("prepare", help="download and cache the Hadoop jars (idempotent)")
    run = sub.add_parser("run", help="start a NameNode + DataNode and wait for Ctrl-C")
    run.add_argument("--work-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    try:
        if args.cmd == "prepare":
            t0 = time.monotonic()
            home = prepare(args.cache_dir, log=progress)
            progress(f"ready: {home} ({time.monotonic() - t0:.2f}s)")
            print(home)
            return 0
        with HdfsCluster(args.work_dir, cache_dir=args.cache_dir, log=progress) as cluster:
            print(f"{cluster.url()}\n{cluster.webhdfs_url()}\nlogs: {cluster.log_dir}", flush=True)
            signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
            with contextlib.suppress(KeyboardInterrupt):
                while cluster.running:
                    time.sleep(1)
        return 0
    except HdfsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
