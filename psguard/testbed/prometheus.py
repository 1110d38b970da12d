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
from collections.abc import Callable, Sequence
from pathlib import Path

from psguard.testbed.hdfs import cache_root

__all__ = ["PrometheusError", "prepare", "promtool"]

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
