"""Shared code for backends that talk to a remote filesystem through fsspec."""

from __future__ import annotations

import contextlib
import datetime as dt
import re
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from psguard.errors import ConfigError, ObjectExistsError, ObjectNotFoundError, StorageError
from psguard.storage.base import Backend, Buffer, validate_key
from psguard.storage.registry import redact

TMP_MARK = ".tmp."
T = TypeVar("T")


def info_mtime(info: Mapping[str, Any]) -> float | None:
    """The modification time in an fsspec ``info`` dict, as the server recorded it (seconds since the epoch).

    s3fs: ``LastModified`` (a datetime); gcsfs: ``mtime`` (a datetime) and GCS's ``updated`` (RFC 3339); hdfs-native:
    ``modification_time``; WebHDFS: ``modificationTime`` (both milliseconds); local: ``mtime`` (seconds).
    """
    for name in ("LastModified", "last_modified", "updated", "mtime"):
        if (when := _timestamp(info.get(name))) is not None:
            return when
    for name, per_second in (("modification_time", 1000.0), ("modificationTime", 1000.0), ("mtime", 1.0)):
        value = info.get(name)
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value) / per_second
    return None


def _timestamp(value: object) -> float | None:
    """A datetime (naive means UTC) or an ISO 8601 text as seconds since the epoch; None for anything else."""
    if isinstance(value, str) and value:
        try:
            value = dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError:
            return None
    if isinstance(value, dt.datetime):
        if value.tzinfo is None:
            value = value.replace(tzinfo=dt.UTC)
        return value.timestamp()
    return None


def bucket_root(url: str, rest: str, service: str, bucket: re.Pattern[str], rule: str) -> str:
    """``bucket/prefix`` from ``rest``, the part of an object store's ``url`` after ``scheme://`` (user info
    removed); :class:`ConfigError` when it names no bucket, or one ``bucket`` does not match (``rule`` says the
    service's rule)."""
    root = rest.strip("/")
    scheme = url.split("://", 1)[0]
    if not root:
        raise ConfigError(f"{service} URL {redact(url)!r} names no bucket; use {scheme}://bucket/prefix")
    name = root.split("/", 1)[0]
    if not bucket.fullmatch(name):
        raise ConfigError(f"{service} URL {redact(url)!r}: {name!r} is not a bucket name ({rule})")
    return root


class FsspecBackend(Backend):
    """Objects are files under ``root`` of an fsspec filesystem ``fs``.

    Subclasses decide how to make ``put``/``put_new`` atomic on their system.
    """

    fs: Any
    root: str

    def _call(self, fn: Callable[[], T]) -> T:
        """Every call to ``fs`` goes through here (HDFS bounds it with a timeout)."""
        return fn()

    def _p(self, key: str) -> str:
        return f"{self.root}/{validate_key(key)}"

    def put(self, key: str, data: Buffer) -> None:
        self._write(key, data, overwrite=True)

    def put_new(self, key: str, data: Buffer) -> None:
        try:
            self._write(key, data, overwrite=False)
        except Exception as e:
            if self._exists_error(e):
                raise ObjectExistsError(f"{key} already exists in {self.url}; psguard never overwrites it") from e
            raise

    def _write(self, key: str, data: Buffer, *, overwrite: bool) -> None:
        """Write ``key`` whole, failing (:meth:`_exists_error`) unless ``overwrite`` when it exists."""
        self.fs.pipe_file(self._p(key), bytes(data), **({} if overwrite else {"mode": "create"}))

    def _exists_error(self, e: BaseException) -> bool:
        """Whether a create-only write failed because the object exists."""
        return isinstance(e, FileExistsError)

    def _info(self, key: str) -> dict[str, Any]:
        try:
            return dict(self._call(lambda: self.fs.info(self._p(key))))
        except FileNotFoundError:
            raise ObjectNotFoundError(f"{key} not found in {self.url}") from None

    def get(self, key: str) -> bytes:
        try:
            data = self._call(lambda: self.fs.cat_file(self._p(key)))
        except FileNotFoundError:
            raise ObjectNotFoundError(f"{key} not found in {self.url}") from None
        return bytes(data)

    def exists(self, key: str) -> bool:
        return bool(self._call(lambda: self.fs.exists(self._p(key))))

    def _file_infos(self, base: str) -> dict[str, dict[str, Any]]:
        try:
            found = self._call(lambda: self.fs.find(base, detail=True))
        except FileNotFoundError:
            return {}
        # Some servers list an emptied "folder" as an entry of its own: only files are objects.
        return {name: info for name, info in found.items() if info.get("type") == "file"}

    def _rel(self, path: str) -> str | None:
        """The key of a listed path, or None for a temporary object."""
        strip = self.root.strip("/") + "/"
        rel = path.strip("/")
        if rel.startswith(strip):
            rel = rel[len(strip) :]
        return None if TMP_MARK in rel.rsplit("/", 1)[-1] else rel

    def keys(self, prefix: str) -> list[str]:
        found = self._file_infos(f"{self.root}/{prefix}".rstrip("/"))
        return sorted(k for k in map(self._rel, found) if k is not None)

    def mtime(self, key: str) -> float:
        when = info_mtime(self._info(key))
        if when is None:
            raise StorageError(f"{self.url} reports no modification time for {key}")
        return when

    def size(self, key: str) -> int:
        info = self._info(key)
        if info.get("type", "file") != "file" or not isinstance(info.get("size"), int):
            raise ObjectNotFoundError(f"{key} is not an object in {self.url}")
        return int(info["size"])

    def mtimes(self, prefix: str) -> dict[str, float]:
        out: dict[str, float] = {}
        for path, info in self._file_infos(f"{self.root}/{prefix}".rstrip("/")).items():
            key = self._rel(path)
            if key is None:
                continue
            when = info_mtime(info)
            out[key] = when if when is not None else self.mtime(key)
        return dict(sorted(out.items()))

    def leftovers(self) -> list[str]:
        found = self._file_infos(self.root)
        strip = self.root.strip("/") + "/"
        return sorted(
            p.strip("/")[len(strip) :]
            for p in found
            if TMP_MARK in p.rsplit("/", 1)[-1] and p.strip("/").startswith(strip)
        )

    def delete(self, key: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._call(lambda: self.fs.rm_file(self._p(key)))
