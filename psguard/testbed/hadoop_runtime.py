"""The Hadoop 2.7.3 runtime the testbed's HDFS runs from, assembled once into a cache (:func:`prepare`).

Why this shape: there is no Hadoop distribution on PyPI or in Debian, but the ``pyspark==2.4.8`` source package
carries the complete Hadoop 2.7.3 client *and server* jars, and Debian ships the jersey1 jars that the
NameNode's WebHDFS needs (pyspark only carries jersey2). So :func:`prepare` assembles a Hadoop runtime from
those two sources into a cache once; :class:`psguard.testbed.hdfs.HdfsCluster` runs the daemons from it.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Final

from psguard.run_folder import cache_root

__all__ = [
    "HADOOP_VERSION",
    "JERSEY1_APT_PACKAGES",
    "PYSPARK_VERSION",
    "HdfsError",
    "default_cache_dir",
    "prepare",
    "progress",
    "quiet",
]

PYSPARK_VERSION: Final = "2.4.8"
HADOOP_VERSION: Final = "2.7.3"
JERSEY1_APT_PACKAGES: Final = ("libjersey1-core-java", "libjersey1-server-java", "libjersey1-servlet-java")
# jsr311-api comes in as a dependency of libjersey1-core-java; jersey1 cannot start without it.
_JERSEY1_JARS: Final = ("jersey1-core.jar", "jersey1-server.jar", "jersey1-servlet.jar", "jsr311-api.jar")
_DEBIAN_JAVA_DIR: Final = Path("/usr/share/java")
_SDIST_JARS_DIR: Final = f"pyspark-{PYSPARK_VERSION}/deps/jars/"
# Of pyspark's 218 jars (244 MB), keep what a Hadoop 2.7.3 distribution puts on an HDFS daemon's classpath
# (share/hadoop/{common,hdfs} and their lib/): 56 jars, 39 MB, and any class that is then missing would
# be missing from a real Hadoop install too. Not jersey2 or javax.ws.rs-api-2 (Spark's UI): next to jersey1 they
# break the WebHDFS servlet.
_HADOOP_JAR_PREFIXES: Final = (
    "hadoop-common-",
    "hadoop-hdfs-",
    "hadoop-auth-",
    "hadoop-annotations-",
    "activation-",
    "apacheds-",
    "api-asn1-api-",
    "api-util-",
    "avro-1",
    "commons-beanutils-",
    "commons-cli-",
    "commons-codec-",
    "commons-collections-",
    "commons-compress-",
    "commons-configuration-",
    "commons-digester-",
    "commons-httpclient-",
    "commons-io-",
    "commons-lang-",
    "commons-logging-",
    "commons-math3-",
    "commons-net-",
    "curator-",
    "gson-",
    "guava-",
    "htrace-core-",
    "httpclient-",
    "httpcore-",
    "jackson-core-asl-",
    "jackson-jaxrs-",
    "jackson-mapper-asl-",
    "jackson-xc-",
    "javax.servlet-api-",
    "jaxb-api-",
    "jetty-",
    "jsp-api-",
    "jsr305-",
    "leveldbjni-all-",
    "log4j-",
    "netty-",
    "paranamer-",
    "protobuf-java-",
    "slf4j-api-",
    "slf4j-log4j12-",
    "snappy-java-",
    "stax-api-",
    "xercesImpl-",
    "xmlenc-",
    "xz-",
    "zookeeper-",
)
# Bump when the cache's content rules change, so existing caches are rebuilt rather than trusted.
_LAYOUT: Final = 2
_STAMP: Final = "READY.json"


class HdfsError(RuntimeError):
    """Preparing or running the local HDFS failed; the message says what to do or shows the daemon logs."""


def progress(msg: str) -> None:
    print(f"[psguard.testbed.hdfs] {msg}", file=sys.stderr, flush=True)


def quiet(msg: str) -> None:
    del msg


def default_cache_dir() -> Path:
    """``<cache_root>/hadoop``."""
    return cache_root() / "hadoop"


def _runtime_dir(cache_dir: Path | None) -> Path:
    return (cache_dir if cache_dir is not None else default_cache_dir()) / f"hadoop-{HADOOP_VERSION}"


def _is_ready(home: Path) -> bool:
    """Cheap check (one small read, about 60 stats) so repeated ``prepare()`` calls cost a millisecond."""
    try:
        manifest = json.loads((home / _STAMP).read_text())
    except (OSError, ValueError):
        return False
    if manifest.get("pyspark") != PYSPARK_VERSION or manifest.get("layout") != _LAYOUT:
        return False
    files = manifest.get("files")
    return isinstance(files, list) and bool(files) and all((home / str(f)).is_file() for f in files)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Serialise concurrent ``prepare()`` calls (pytest-xdist workers, parallel CI jobs on one runner)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def prepare(cache_dir: Path | None = None, *, log: Callable[[str], None] = quiet) -> Path:
    """Make the Hadoop runtime available and return its folder (the ``hadoop.home.dir`` of the daemons).

    Idempotent and fast once done. Cold, it downloads the 220 MB pyspark sdist into a temporary folder, keeps
    only the 56 jars an HDFS daemon loads from (39 MB) and deletes the sdist, so CI caches little. The
    Debian jersey1 jars are copied into the cache too, so a CI cache of this folder is enough on the next run
    even where the apt packages are not installed.
    """
    home = _runtime_dir(cache_dir)
    if _is_ready(home):
        return home
    with _locked(home.parent / f".hadoop-{HADOOP_VERSION}.lock"):
        if _is_ready(home):  # another process finished it while we waited for the lock
            return home
        t0 = time.monotonic()
        staging = Path(tempfile.mkdtemp(prefix=f".hadoop-{HADOOP_VERSION}-", dir=home.parent))
        try:
            jersey = _ensure_jersey1(log)
            (staging / "jersey1").mkdir()
            for jar in jersey:
                shutil.copy2(jar, staging / "jersey1" / jar.name)
            _fetch_hadoop_jars(staging / "jars", log)
            files = sorted(str(p.relative_to(staging)) for p in staging.rglob("*.jar"))
            manifest = {"layout": _LAYOUT, "pyspark": PYSPARK_VERSION, "hadoop": HADOOP_VERSION, "files": files}
            (staging / _STAMP).write_text(json.dumps(manifest, indent=1) + "\n")
            if home.exists():
                shutil.rmtree(home)
            staging.rename(home)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        log(f"Hadoop {HADOOP_VERSION} runtime ready in {home} ({time.monotonic() - t0:.1f}s)")
        return home


def _ensure_jersey1(log: Callable[[str], None]) -> list[Path]:
    """Find the Debian jersey1 jars, installing the packages with apt-get when we are root and they are missing."""
    jars = [_DEBIAN_JAVA_DIR / name for name in _JERSEY1_JARS]
    if all(j.is_file() for j in jars):
        return jars
    install = ["apt-get", "install", "-y", "--no-install-recommends", *JERSEY1_APT_PACKAGES]
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise HdfsError(
            "HDFS needs the Debian jersey1 jars "
            f"({', '.join(str(j) for j in jars if not j.is_file())} missing). Install them with:\n"
            f"    sudo apt-get update && sudo {' '.join(install)}"
        )
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    log(f"installing {' '.join(JERSEY1_APT_PACKAGES)} with apt-get")
    attempt = subprocess.run(install, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True)
    if attempt.returncode != 0:  # most often: a fresh container whose package lists were never fetched
        log("apt-get install failed; running apt-get update and retrying")
        for cmd in (["apt-get", "update"], install):
            attempt = subprocess.run(cmd, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True)
            if attempt.returncode != 0:
                raise HdfsError(f"`{' '.join(cmd)}` failed ({attempt.returncode}):\n{attempt.stderr[-2000:]}")
    missing = [str(j) for j in jars if not j.is_file()]
    if missing:
        raise HdfsError(f"installed {' '.join(JERSEY1_APT_PACKAGES)} but still missing: {', '.join(missing)}")
    return jars


def _fetch_hadoop_jars(dest: Path, log: Callable[[str], None]) -> None:
    """Download the pyspark sdist with pip (so pip's index/proxy settings apply) and keep only ``deps/jars``."""
    for module in ("pip", "setuptools", "wheel"):
        if importlib.util.find_spec(module) is None:
            # pip prepares the sdist's metadata even for `pip download`; without isolation it needs these here.
            raise HdfsError(f"{sys.executable} lacks {module!r}; run: {sys.executable} -m pip install {module}")
    dest.mkdir(parents=True)
    with tempfile.TemporaryDirectory(prefix="psguard-pyspark-") as tmp:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--no-build-isolation",
            "--no-input",
            "--no-cache-dir",  # else pip keeps its own 220 MB copy in ~/.cache/pip
            "--disable-pip-version-check",
            "--progress-bar",
            "off",
            "--dest",
            tmp,
            f"pyspark=={PYSPARK_VERSION}",
        ]
        log(f"downloading pyspark=={PYSPARK_VERSION} sdist (about 220 MB) with pip")
        t0 = time.monotonic()
        done = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True)
        if done.returncode != 0:
            raise HdfsError(f"pip download of pyspark=={PYSPARK_VERSION} failed:\n{done.stderr[-3000:]}")
        sdists = sorted(Path(tmp).glob(f"pyspark-{PYSPARK_VERSION}.tar.gz"))
        if not sdists:
            raise HdfsError(f"pip download succeeded but left no pyspark sdist in {tmp}: {os.listdir(tmp)}")
        log(f"downloaded in {time.monotonic() - t0:.1f}s; extracting {_SDIST_JARS_DIR}")
        count = _extract_jars(sdists[0], dest)
        log(f"extracted {count} jars")
    # The TemporaryDirectory exit removed the sdist, so nothing big is left behind.


def _extract_jars(sdist: Path, dest: Path) -> int:
    """Copy the wanted jars out by name (never by the archive's paths, so a crafted archive cannot escape)."""
    count = 0
    with tarfile.open(sdist, "r:gz") as tar:
        for member in tar:
            if not (member.isfile() and member.name.startswith(_SDIST_JARS_DIR)):
                continue
            name = member.name[len(_SDIST_JARS_DIR) :]
            if "/" in name or not name.endswith(".jar") or not name.startswith(_HADOOP_JAR_PREFIXES):
                continue
            src = tar.extractfile(member)
            if src is None:
                continue
            with src, (dest / name).open("wb") as out:
                shutil.copyfileobj(src, out, 1 << 20)
            count += 1
    if not (dest / f"hadoop-hdfs-{HADOOP_VERSION}.jar").is_file():
        raise HdfsError(f"{sdist.name} has no hadoop-hdfs-{HADOOP_VERSION}.jar under {_SDIST_JARS_DIR}")
    return count
