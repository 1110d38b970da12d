"""Local-disk backend: the embedded default store, and what an HDFS/S3 outage cannot take away."""

from __future__ import annotations

import errno
import os
import secrets
from pathlib import Path
from typing import Any, NoReturn

from psguard.errors import ObjectExistsError, ObjectNotFoundError, StorageError
from psguard.local_files import open_regular
from psguard.storage.base import Backend, Buffer, validate_key

TMP_MARK = ".tmp."


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)  # whatever else is at the path is refused, never waited on
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _make_dirs(path: Path, durable: bool) -> None:
    """Create the folder ``path`` and whatever parents it lacks; with ``durable``, fsync each new folder's parent.

    A new folder's entry lives in its parent: without that fsync a power cut may take ``chunks/ab/`` while the
    manifest naming its chunks stays (a torn checkpoint)."""
    if path.is_dir():
        return
    missing = [path]
    while not missing[-1].parent.is_dir():
        missing.append(missing[-1].parent)
    for folder in reversed(missing):
        try:
            os.mkdir(folder)
        except FileExistsError:  # another writer made it: its parent is fsynced all the same
            if not folder.is_dir():
                raise
        if durable:
            _fsync_dir(folder.parent)


def _raise_storage_error(e: OSError, what: str) -> NoReturn:
    """Turn the OS errors retrying cannot fix into a clear :class:`StorageError`; re-raise others."""
    if e.errno == errno.ENOSPC:
        raise StorageError(f"disk full while writing {what}; free space or point psguard at another store") from e
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        raise StorageError(f"cannot write {what}: {e.strerror}") from e
    raise e


class LocalBackend(Backend):
    """Files under a folder; writes go to a temporary name, are fsynced, then renamed or linked into place.

    Every object is read as a regular file opened without blocking (:func:`psguard.local_files.open_regular`): a
    FIFO, device, socket or symbolic link in its place is a :class:`CorruptCheckpointError` naming it, which
    readers treat as damage."""

    def __init__(self, url: str, options: dict[str, Any] | None = None) -> None:
        path = url[len("file://") :] if url.startswith("file://") else url
        self.root = Path(path).expanduser().absolute()
        self.url = str(self.root)
        self.fsync = bool((options or {}).get("fsync", True))
        self.io_parallelism = max(2, min(4, os.cpu_count() or 2))
        self.mtime_resolution = 0.01

    def _path(self, key: str) -> Path:
        return self.root / validate_key(key)

    def _open(self, key: str) -> int:
        try:
            return open_regular(self._path(key), f"object {key} in {self.url}")
        except FileNotFoundError:
            raise ObjectNotFoundError(f"{key} not found in {self.url}") from None

    def get(self, key: str) -> bytes:
        with os.fdopen(self._open(key), "rb") as f:
            return f.read()

    def get_into(self, key: str, out: memoryview) -> int:
        with os.fdopen(self._open(key), "rb", buffering=0) as f:
            size = os.fstat(f.fileno()).st_size
            view = out[: min(size, len(out))]
            got = 0
            while got < len(view):
                n = f.readinto(view[got:])
                if not n:
                    break
                got += n
            return size

    def _write_tmp(self, path: Path, data: Buffer) -> Path:
        _make_dirs(path.parent, self.fsync)
        tmp = path.with_name(f"{path.name}{TMP_MARK}{secrets.token_hex(6)}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            view = memoryview(data).cast("B")
            while view:
                n = os.write(fd, view)
                view = view[n:]
            if self.fsync:
                os.fsync(fd)
        except BaseException:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            raise
        os.close(fd)
        return tmp

    def put(self, key: str, data: Buffer) -> None:
        path = self._path(key)
        try:
            tmp = self._write_tmp(path, data)
            os.replace(tmp, path)
            if self.fsync:
                _fsync_dir(path.parent)
        except OSError as e:
            _raise_storage_error(e, f"{key} in {self.url}")

    def put_new(self, key: str, data: Buffer) -> None:
        path = self._path(key)
        try:
            tmp = self._write_tmp(path, data)
        except OSError as e:
            _raise_storage_error(e, f"{key} in {self.url}")
        try:
            os.link(tmp, path)  # fails if path exists: the create-only commit
        except FileExistsError:
            raise ObjectExistsError(f"{key} already exists in {self.url}; psguard never overwrites it") from None
        finally:
            tmp.unlink(missing_ok=True)
        if self.fsync:
            _fsync_dir(path.parent)

    def exists(self, key: str) -> bool:
        return self._path(key).exists()

    def keys(self, prefix: str) -> list[str]:
        base = self.root / prefix if prefix else self.root
        if prefix:
            validate_key(prefix.rstrip("/"))
        walk = os.walk(base)
        return sorted(
            str((Path(d) / n).relative_to(self.root)) for d, _, names in walk for n in names if TMP_MARK not in n
        )

    def delete(self, key: str) -> None:
        path = self._path(key)
        try:
            path.unlink()
        except FileNotFoundError:
            return
        if self.fsync:  # durable when it returns, as a write is: gc deletes a manifest before the chunks it names
            _fsync_dir(path.parent)

    def _stat(self, key: str) -> os.stat_result:
        try:
            return self._path(key).stat()
        except FileNotFoundError:
            raise ObjectNotFoundError(f"{key} not found in {self.url}") from None

    def size(self, key: str) -> int:
        return self._stat(key).st_size

    def mtime(self, key: str) -> float:
        return self._stat(key).st_mtime

    def leftovers(self) -> list[str]:
        if not self.root.is_dir():
            return []
        return sorted(str(p.relative_to(self.root)) for p in self.root.rglob(f"*{TMP_MARK}*") if p.is_file())
