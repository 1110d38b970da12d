"""HDFS backends: ``hdfs://`` through hdfs-native (native RPC, fast) and ``webhdfs://`` (plain HTTP).

HDFS shows a file while it is being written, so every write goes to a temporary name and is renamed into
place: rename is atomic at the NameNode, and rename without overwrite fails when the target exists, which
is the create-only commit. The Hadoop user comes from ``HADOOP_USER_NAME`` (as Hadoop clients do), else the
login name; Kerberos is out of scope for now.
"""

from __future__ import annotations

import contextlib
import getpass
import os
from typing import Any
from urllib.parse import urlsplit

from psguard.errors import ConfigError, ObjectExistsError
from psguard.storage.base import Buffer
from psguard.storage.fsspec_backend import FsspecBackend


def _host_port_path(url: str, default_port: int) -> tuple[str, int, str]:
    parts = urlsplit(url)
    if not parts.hostname:
        raise ConfigError(f"HDFS URL {url!r} names no NameNode; use {parts.scheme}://host:port/path")
    return parts.hostname, parts.port or default_port, "/" + parts.path.strip("/")


def _hadoop_user() -> str:
    return os.environ.get("HADOOP_USER_NAME") or getpass.getuser()


class HdfsBackend(FsspecBackend):
    def __init__(self, url: str, options: dict[str, Any] | None = None) -> None:
        from hdfs_native.fsspec import HdfsFileSystem

        host, port, path = _host_port_path(url, 8020)
        self.url = f"hdfs://{host}:{port}{path}"
        self.root = path.rstrip("/") or ""
        self.fs = HdfsFileSystem(host=host, port=port, skip_instance_cache=True, **dict(options or {}))

    def _write_then_rename(self, key: str, data: Buffer, *, overwrite: bool) -> None:
        tmp = self._tmp_name(key)
        self.fs.pipe_file(tmp, bytes(data))
        try:
            self.fs.client.rename(tmp, self._p(key), overwrite)
        except BaseException:
            with contextlib.suppress(Exception):
                self.fs.rm_file(tmp)
            raise

    def put(self, key: str, data: Buffer) -> None:
        self.fs.makedirs(self._p(key).rsplit("/", 1)[0], exist_ok=True)
        self._write_then_rename(key, data, overwrite=True)

    def put_new(self, key: str, data: Buffer) -> None:
        self.fs.makedirs(self._p(key).rsplit("/", 1)[0], exist_ok=True)
        try:
            self._write_then_rename(key, data, overwrite=False)
        except Exception as e:
            if isinstance(e, FileExistsError) or "exist" in str(e).lower():
                raise ObjectExistsError(f"{key} already exists in {self.url}; psguard never overwrites it") from e
            raise


class WebHdfsBackend(FsspecBackend):
    def __init__(self, url: str, options: dict[str, Any] | None = None) -> None:
        from fsspec.implementations.webhdfs import WebHDFS

        host, port, path = _host_port_path(url, 9870)
        self.url = f"webhdfs://{host}:{port}{path}"
        self.root = path.rstrip("/") or ""
        opts = dict(options or {})
        opts.setdefault("user", _hadoop_user())
        self.fs = WebHDFS(host=host, port=port, skip_instance_cache=True, **opts)

    def _rename(self, src: str, dst: str) -> bool:
        # fsspec's mv ignores WebHDFS's answer; RENAME answers {"boolean": false} when dst exists.
        out = self.fs._call("RENAME", method="put", path=src, destination=dst)
        return bool(out.json().get("boolean"))

    def _write_tmp(self, key: str, data: Buffer) -> str:
        tmp = self._tmp_name(key)
        self.fs.pipe_file(tmp, bytes(data))
        return tmp

    def put(self, key: str, data: Buffer) -> None:
        tmp = self._write_tmp(key, data)
        if not self._rename(tmp, self._p(key)):
            # WebHDFS cannot rename over a file: replace it (a reader may miss it for a moment).
            self.fs.rm_file(self._p(key))
            if not self._rename(tmp, self._p(key)):
                self.fs.rm_file(tmp)
                raise OSError(f"WebHDFS refused to rename a temporary file onto {key} in {self.url}")

    def put_new(self, key: str, data: Buffer) -> None:
        tmp = self._write_tmp(key, data)
        if not self._rename(tmp, self._p(key)):
            with contextlib.suppress(Exception):
                self.fs.rm_file(tmp)
            if self.fs.exists(self._p(key)):
                raise ObjectExistsError(f"{key} already exists in {self.url}; psguard never overwrites it")
            raise OSError(f"WebHDFS refused to rename a temporary file onto {key} in {self.url}")
