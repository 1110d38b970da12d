"""HDFS backends: ``hdfs://`` through hdfs-native (native RPC, fast) and ``webhdfs://`` (plain HTTP).

HDFS shows a file while it is being written, so every write goes to a temporary name and is renamed into place:
rename is atomic at the NameNode, and rename without overwrite is the create-only commit. The Hadoop user comes
from ``HADOOP_USER_NAME``, else the login name; Kerberos is out of scope.

Neither client bounds a call to a NameNode that hangs, so psguard turns hdfs-native's own retries off (psguard's
retry layer has the deadline) and runs every call with a timeout: storage option ``op_timeout`` (seconds, default
60); every other option goes to the Hadoop client (hdfs://) or fsspec's WebHDFS (webhdfs://).
"""

from __future__ import annotations

import contextlib
import functools
import getpass
import os
import secrets
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, TypeVar
from urllib.parse import urlsplit

from psguard.errors import ConfigError
from psguard.storage.base import Buffer
from psguard.storage.fsspec_backend import TMP_MARK, FsspecBackend
from psguard.storage.registry import redact
from psguard.storage.retry import TransientStorageError

T = TypeVar("T")

#: hdfs-native's defaults retry a dead NameNode for about three minutes per call; psguard retries itself.
HDFS_CLIENT_DEFAULTS = {"dfs.client.failover.max.attempts": "0", "dfs.client.socket-timeout": "10000"}
DEFAULT_OP_TIMEOUT = 60.0


def _host_port_path(url: str, default_port: int) -> tuple[str, int, str]:
    parts = urlsplit(url)
    if not parts.hostname:
        raise ConfigError(f"HDFS URL {redact(url)!r} names no NameNode; use {parts.scheme}://host:port/path")
    return parts.hostname, parts.port or default_port, "/" + parts.path.strip("/")


def _write_renamed(backend: FsspecBackend, key: str, data: Buffer, rename: Callable[[str, str], None]) -> None:
    """Write ``key`` under a temporary name, then ``rename(temporary, final)``; the temporary goes on any failure."""
    tmp = f"{backend._p(key)}{TMP_MARK}{secrets.token_hex(6)}"
    backend.fs.pipe_file(tmp, bytes(data))
    try:
        rename(tmp, backend._p(key))
    except BaseException:
        with contextlib.suppress(Exception):
            backend.fs.rm_file(tmp)
        raise


class HdfsBackend(FsspecBackend):
    def __init__(self, url: str, options: dict[str, Any] | None = None) -> None:
        from hdfs_native.fsspec import HdfsFileSystem

        host, port, path = _host_port_path(url, 8020)
        self.url = f"hdfs://{host}:{port}{path}"
        self.root = path.rstrip("/") or ""
        opts = dict(options or {})
        self.op_timeout = float(opts.pop("op_timeout", DEFAULT_OP_TIMEOUT))
        config = {**HDFS_CLIENT_DEFAULTS, **{k: str(v) for k, v in opts.items()}}
        self.fs = HdfsFileSystem(host=host, port=port, skip_instance_cache=True, **config)
        # Calls that hang stay parked in this pool until the NameNode answers; callers get a timeout.
        self._calls = ThreadPoolExecutor(max_workers=16, thread_name_prefix="psguard-hdfs")

    def _call(self, fn: Callable[[], T]) -> T:
        fut = self._calls.submit(fn)
        try:
            return fut.result(timeout=self.op_timeout)
        except FutureTimeout:
            raise TransientStorageError(
                f"HDFS call did not answer within {self.op_timeout:.0f}s on {self.url}"
            ) from None

    def _write(self, key: str, data: Buffer, *, overwrite: bool) -> None:
        def write() -> None:
            self.fs.makedirs(self._p(key).rsplit("/", 1)[0], exist_ok=True)
            _write_renamed(self, key, data, lambda tmp, final: self.fs.client.rename(tmp, final, overwrite))

        self._call(write)

    def close(self) -> None:
        self._calls.shutdown(wait=False, cancel_futures=True)


class WebHdfsBackend(FsspecBackend):
    def __init__(self, url: str, options: dict[str, Any] | None = None) -> None:
        from fsspec.implementations.webhdfs import WebHDFS

        host, port, path = _host_port_path(url, 9870)
        self.url = f"webhdfs://{host}:{port}{path}"
        self.root = path.rstrip("/") or ""
        opts = dict(options or {})
        timeout = float(opts.pop("op_timeout", DEFAULT_OP_TIMEOUT))
        opts.setdefault("user", os.environ.get("HADOOP_USER_NAME") or getpass.getuser())
        self.fs = WebHDFS(host=host, port=port, skip_instance_cache=True, **opts)
        session = self.fs.session
        session.request = functools.partial(session.request, timeout=timeout)

    def _rename(self, src: str, dst: str, *, overwrite: bool) -> None:
        # fsspec's mv ignores WebHDFS's answer, and a plain RENAME onto a folder moves the file into it;
        # with renameoptions, an existing target is refused (403 FileAlreadyExistsException) or replaced.
        self.fs._call(
            "RENAME", method="put", path=src, destination=dst, renameoptions="OVERWRITE" if overwrite else "NONE"
        )

    def _write(self, key: str, data: Buffer, *, overwrite: bool) -> None:
        _write_renamed(self, key, data, functools.partial(self._rename, overwrite=overwrite))

    def _exists_error(self, e: BaseException) -> bool:
        return isinstance(e, FileExistsError) or "already exists" in str(e)
