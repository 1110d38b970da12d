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
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, TypeVar
from urllib.parse import urlsplit

from psguard.errors import ConfigError, ObjectNotFoundError
from psguard.storage.base import Buffer
from psguard.storage.fsspec_backend import FsspecBackend
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


def _hadoop_user() -> str:
    return os.environ.get("HADOOP_USER_NAME") or getpass.getuser()


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

    def _run(self, fn: Callable[..., T], *args: Any) -> T:
        fut = self._calls.submit(fn, *args)
        try:
            return fut.result(timeout=self.op_timeout)
        except FutureTimeout:
            raise TransientStorageError(
                f"HDFS call did not answer within {self.op_timeout:.0f}s on {self.url}"
            ) from None

    def get(self, key: str) -> bytes:
        try:
            return bytes(self._run(self.fs.cat_file, self._p(key)))
        except FileNotFoundError:
            raise ObjectNotFoundError(f"{key} not found in {self.url}") from None

    def exists(self, key: str) -> bool:
        return bool(self._run(self.fs.exists, self._p(key)))

    def _file_infos(self, base: str) -> dict[str, dict[str, Any]]:
        return self._run(super()._file_infos, base)

    def mtime(self, key: str) -> float:
        return self._run(super().mtime, key)

    def size(self, key: str) -> int:
        return self._run(super().size, key)

    def delete(self, key: str) -> None:
        self._run(super().delete, key)

    def _write(self, key: str, data: Buffer, *, overwrite: bool) -> None:
        final = self._p(key)
        tmp = self._tmp_name(key)
        blob = bytes(data)

        def write() -> None:
            self.fs.makedirs(final.rsplit("/", 1)[0], exist_ok=True)
            self.fs.pipe_file(tmp, blob)
            try:
                self.fs.client.rename(tmp, final, overwrite)
            except BaseException:
                with contextlib.suppress(Exception):
                    self.fs.rm_file(tmp)
                raise

        self._run(write)

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
        opts.setdefault("user", _hadoop_user())
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
        tmp = self._tmp_name(key)
        self.fs.pipe_file(tmp, bytes(data))
        try:
            self._rename(tmp, self._p(key), overwrite=overwrite)
        except BaseException:
            with contextlib.suppress(Exception):
                self.fs.rm_file(tmp)
            raise

    def _exists_error(self, e: BaseException) -> bool:
        return isinstance(e, FileExistsError) or "already exists" in str(e)
