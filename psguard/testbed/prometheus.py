"""Debian's Prometheus (``prometheus`` and ``promtool``) in a cache, for checking and testing the shipped alerts.

Why this shape: Prometheus is not on PyPI, and installing Debian's package starts a service and creates a user;
its two binaries are static Go programs. So :func:`prepare` downloads the package with ``apt-get download`` and
unpacks it with ``dpkg-deb -x`` into a cache once (no root needed unless the package lists are missing, then
``apt-get update`` runs when we are root). ``make test`` runs ``python -m psguard.testbed.prometheus prepare``
in a visible step, as it does for HDFS.

Command line::

    python -m psguard.testbed.prometheus prepare    # idempotent; prints where the binaries are
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from psguard.run_folder import cache_root

__all__ = ["PrometheusError", "PrometheusServer", "prepare", "promtool"]

PACKAGE = "prometheus"


class PrometheusError(RuntimeError):
    """The Prometheus binaries could not be fetched or unpacked (the message says how to get them by hand)."""


def _quiet(msg: str) -> None:
    del msg


def _home(cache_dir: Path | None) -> Path:
    return (cache_dir or cache_root()) / "prometheus"


def _binaries(home: Path) -> dict[str, Path]:
    return {name: home / "usr" / "bin" / name for name in ("prometheus", "promtool")}


def prepare(cache_dir: Path | None = None, *, log: Callable[[str], None] = _quiet) -> Path:
    """The folder holding ``usr/bin/prometheus`` and ``usr/bin/promtool``, fetched on first use."""
    home = _home(cache_dir)
    if all(p.is_file() and os.access(p, os.X_OK) for p in _binaries(home).values()):
        return home
    for tool in ("apt-get", "dpkg-deb"):
        if shutil.which(tool) is None:
            raise PrometheusError(f"no `{tool}` here: install Prometheus 2.x and put promtool on PATH")
    home.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    with tempfile.TemporaryDirectory(prefix="psguard-prometheus-", dir=home.parent) as tmp:
        log(f"downloading Debian's {PACKAGE} package")
        if not _download(Path(tmp), log):
            raise PrometheusError(
                f"`apt-get download {PACKAGE}` failed; as root run `apt-get update` first, or install Prometheus"
            )
        (deb,) = Path(tmp).glob(f"{PACKAGE}_*.deb")
        unpacked = Path(tmp) / "x"
        done = subprocess.run(["dpkg-deb", "-x", str(deb), str(unpacked)], capture_output=True, text=True)
        if done.returncode != 0:
            raise PrometheusError(f"dpkg-deb -x {deb.name} failed: {done.stderr.strip()[-500:]}")
        if home.exists():
            shutil.rmtree(home)
        unpacked.rename(home)  # within one file system: whole or absent, never half-unpacked
    log(f"ready: {home}")
    return home


def _download(into: Path, log: Callable[[str], None]) -> bool:
    cmd = ["apt-get", "download", PACKAGE]
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    if subprocess.run(cmd, cwd=into, env=env, capture_output=True).returncode == 0:
        return True
    if os.geteuid() != 0:
        return False
    log("apt-get download failed; running apt-get update and retrying")
    subprocess.run(["apt-get", "update"], env=env, capture_output=True, stdin=subprocess.DEVNULL)
    return subprocess.run(cmd, cwd=into, env=env, capture_output=True).returncode == 0


def promtool(cache_dir: Path | None = None) -> Path:
    """``promtool``: from PATH when installed, else from the cache (fetched on first use)."""
    found = shutil.which("promtool")
    return Path(found) if found else _binaries(prepare(cache_dir))["promtool"]


class PrometheusServer:
    """A real Prometheus server on loopback, on a configuration given as a dict, with its data in ``directory``.

    For the soak (:mod:`psguard.chaos.soak`): it scrapes the run's agents and evaluates the shipped alerts while
    the faults happen, and :meth:`query` / :meth:`query_range` read what it saw through its HTTP API. Dies with
    the Python process that started it (parent-death signal), like the S3 servers.
    """

    def __init__(self, directory: Path, config: dict[str, Any], *, startup_timeout: float = 60.0) -> None:
        self.directory = directory
        self.config = config
        self.startup_timeout = startup_timeout
        self.port = 0
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> PrometheusServer:
        import json

        from psguard.ports import free_port, wait_port
        from psguard.testbed.s3_server import pdeathsig_prefix

        binary = _binaries(prepare())["prometheus"]
        self.directory.mkdir(parents=True, exist_ok=True)
        config = self.directory / "prometheus.yml"
        config.write_text(json.dumps(self.config, indent=1))  # YAML is a superset of JSON
        self.port = free_port()
        cmd = [
            *pdeathsig_prefix(True),
            str(binary),
            f"--config.file={config}",
            f"--web.listen-address=127.0.0.1:{self.port}",
        ]
        cmd += [f"--storage.tsdb.path={self.directory / 'tsdb'}", "--log.level=warn"]
        log = open(self.directory / "prometheus.log", "ab")  # noqa: SIM115 - the server's for its lifetime
        self._proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        deadline = time.monotonic() + self.startup_timeout
        try:
            wait_port("127.0.0.1", self.port, self.startup_timeout, what="prometheus")
            # The port opens before the TSDB and the rules are loaded: /-/ready answers 503 until then.
            while not self._ready():
                if time.monotonic() > deadline or self._proc.poll() is not None:
                    raise TimeoutError
                time.sleep(0.1)
        except TimeoutError:
            self.stop()
            raise PrometheusError(
                f"prometheus did not become ready within {self.startup_timeout:.0f}s: {self.directory}"
            ) from None
        return self

    def _ready(self) -> bool:
        import urllib.error
        import urllib.request

        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=5) as r:
                return bool(r.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def _get(self, path: str, **params: str) -> Any:
        import json
        import urllib.parse
        import urllib.request

        url = f"{self.url}{path}?{urllib.parse.urlencode(params)}"
        with urllib.request.urlopen(url, timeout=30) as r:  # our own loopback server
            doc = json.loads(r.read())
        if doc.get("status") != "success":
            raise PrometheusError(f"{path} {params}: {doc.get('error')}")
        return doc["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        """An instant query, now or as of Unix time ``at``: the result's series (``metric`` labels and ``value``).

        ``at`` matters once targets are gone: Prometheus marks a stopped target's series stale at its next
        failed scrape, so a plain selector asked after the job ended finds nothing.
        """
        params = {"query": expr} if at is None else {"query": expr, "time": f"{at:.3f}"}
        return list(self._get("/api/v1/query", **params)["result"])

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[dict[str, Any]]:
        """A range query (Unix times): each series' ``metric`` labels and ``values`` ([time, value] pairs)."""
        data = self._get("/api/v1/query_range", query=expr, start=f"{start:.3f}", end=f"{end:.3f}", step=f"{step:g}")
        return list(data["result"])

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m psguard.testbed.prometheus", description=__doc__)
    parser.add_argument("command", choices=["prepare"])
    parser.parse_args(argv)
    try:
        home = prepare(log=lambda m: print(f"[psguard.testbed.prometheus] {m}", file=sys.stderr, flush=True))
    except PrometheusError as e:
        print(f"psguard.testbed.prometheus: {e}", file=sys.stderr)
        return 1
    print(home)
    return 0


if __name__ == "__main__":
    sys.exit(main())
