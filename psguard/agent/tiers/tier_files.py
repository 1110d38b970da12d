"""A PS agent's memory tier kept in files laid out as TensorFlow bundle data files: a restore copies nothing first.

A bundle's data file is the tensor's bytes, C order, little-endian: what a numpy array is. So each array of the
tier is a shared mapping of its own file (``<folder>/tier/<n>.data-00000-of-00001``, on tmpfs), and a restore's
export hard-links that file and writes only the index beside it (with the data's CRC32C): the PS reads each byte
once, instead of the agent writing every shard out first.

The file must not change while its PS reads it: :meth:`psguard.agent.tiers.shards.ShardKeeper.export` keeps an
export lease on the arrays until the restore files are dropped, so the tier copies a leased array before writing
it. Were the data changed anyway, ``RestoreV2`` fails on the CRC32C before assigning anything.

Files are ``0600`` in a private folder, unlinked when the tier drops their array, their pages allocated at creation
(a full tmpfs fails there, not with a ``SIGBUS`` later). Off a memory file system the tier stays in anonymous memory.
"""

from __future__ import annotations

import itertools
import logging
import math
import mmap
import os
import shutil
import sys
import threading
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from psguard.codec.dtypes import dtype_name
from psguard.codec.tensor_bytes import byte_view, crc32c
from psguard.handoff.credentials import ensure_private_dir
from psguard.handoff.tensor_bundle import bundle_files, write_index
from psguard.handoff.tensor_file import TF_DTYPES
from psguard.local_files import open_regular

log = logging.getLogger(__name__)

#: The data file's name after its stem: a one-shard bundle's (what ``RestoreV2`` opens for ``<prefix>``).
DATA_SUFFIX = bundle_files("x")[1].name[1:]
_MEMORY_FS = frozenset({"tmpfs", "ramfs"})
_BUNDLE_DTYPES = frozenset(TF_DTYPES.values())


def on_memory_fs(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is on a file system held in memory (tmpfs, ramfs), by the longest mount point above it."""
    real = os.path.realpath(path)
    best, fstype = "", ""
    try:
        with open("/proc/self/mountinfo", encoding="utf-8") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                fields = left.split()
                if len(fields) < 5 or not right:
                    continue
                point = fields[4].encode().decode("unicode_escape")  # spaces etc. are octal escapes
                inside = real == point or real.startswith(point.rstrip("/") + "/")
                if inside and len(point) >= len(best):
                    best, fstype = point, right.split()[0]
    except OSError:
        return False
    return fstype in _MEMORY_FS


class TierFiles:
    """Where a memory tier's arrays live: one file each, shared-mapped (a :class:`MemoryTier`'s ``home``).
    ``enabled``: None (files when the folder is in memory), True (always), False."""

    def __init__(self, folder: str | os.PathLike[str], *, enabled: bool | None = None) -> None:
        self.folder = Path(folder)
        self._want = enabled
        self.enabled = False  # until open()
        self._lock = threading.Lock()
        self._seq = itertools.count()
        self._live: dict[int, tuple[weakref.ref[np.ndarray], Path, int]] = {}  # data address -> array, file, bytes
        self.bytes_linked = 0  # exported without a copy
        self.failures = 0  # arrays that could not get a file (a full tmpfs): kept in anonymous memory

    def open(self) -> TierFiles:
        """Own the folder (refused unless only this user can write it) and clear what a previous agent left."""
        ensure_private_dir(self.folder, "the PS agent's tier folder")
        for old in self.folder.iterdir():
            if old.is_dir() and not old.is_symlink():
                shutil.rmtree(old, ignore_errors=True)
            else:
                old.unlink(missing_ok=True)
        self.enabled = self._want if self._want is not None else on_memory_fs(self.folder)
        log.info("event=tier_files folder=%s enabled=%s", self.folder, self.enabled)
        return self

    def close(self) -> None:
        """Stop making files and remove the folder (arrays still mapped stay valid until dropped)."""
        self.enabled = False
        shutil.rmtree(self.folder, ignore_errors=True)

    def status(self) -> dict[str, Any]:
        with self._lock:
            files = len(self._live)
        return {"enabled": self.enabled, "files": files, "bytes_linked": self.bytes_linked, "failures": self.failures}

    # ------------------------------------------------------------------------------------------- arrays
    def new(self, shape: tuple[int, ...], dtype: np.dtype[Any], *, reserve: bool = True) -> np.ndarray | None:
        """A writable C-order array of ``shape`` backed by a new file, or None (no files here, an empty or
        non-numeric tensor, a big-endian host, or no room). ``reserve=False``: no pages allocated yet, so the
        caller fills it with :meth:`write_rows`, never through the array (a full tmpfs would be a ``SIGBUS``)."""
        dtype = np.dtype(dtype)
        if (
            not self.enabled
            or math.prod(shape) * dtype.itemsize == 0
            or sys.byteorder != "little"
            or dtype.byteorder == ">"
            or dtype_name(dtype) not in _BUNDLE_DTYPES
        ):
            return None
        return self._made(shape, dtype, lambda fd, n: os.posix_fallocate(fd, 0, n) if reserve else os.ftruncate(fd, n))

    def _made(
        self, shape: tuple[int, ...], dtype: np.dtype[Any], fill: Callable[[int, int], None]
    ) -> np.ndarray | None:
        """A new file of ``shape`` and ``dtype`` whose bytes ``fill(fd, nbytes)`` gives it, as an array of this tier."""
        count = math.prod(int(d) for d in shape)
        nbytes = count * dtype.itemsize
        path = self.folder / f"{next(self._seq)}{DATA_SUFFIX}"
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as e:
            self._failed(path, e)
            return None
        try:
            fill(fd, nbytes)
            mapped = mmap.mmap(fd, nbytes)  # MAP_SHARED, read and write; it keeps its own handle on the file
        except OSError as e:
            path.unlink(missing_ok=True)
            self._failed(path, e)
            return None
        finally:
            os.close(fd)
        arr = np.frombuffer(mapped, dtype=dtype, count=count).reshape(shape)
        addr = _address(arr)
        with self._lock:
            self._live[addr] = (weakref.ref(arr), path, nbytes)
        weakref.finalize(arr, self._forget, addr, path)
        return arr

    def write_rows(self, arr: np.ndarray, row: int, values: np.ndarray) -> None:
        """Put ``values`` at row ``row`` of ``arr``: into a tier file with ``pwrite``, not through the mapping, so a
        full tmpfs raises ``ENOSPC`` here instead of a ``SIGBUS`` (how a fetch fills a ``reserve=False`` array);
        into any other array by assignment."""
        n = int(values.shape[0]) if values.ndim else 1
        path = self.data_file(arr)
        if path is None:
            arr[row : row + n] = values
            return
        size = arr.nbytes // max(1, arr.shape[0]) if arr.ndim else arr.nbytes
        data = byte_view(np.ascontiguousarray(values, dtype=arr.dtype))
        fd = open_regular(path, "the PS agent's tier file", write=True)
        try:
            done = 0
            while done < data.nbytes:
                done += os.pwrite(fd, data[done:], row * size + done)
        finally:
            os.close(fd)

    def adopt(self, value: np.ndarray, *, copy: bool = False) -> np.ndarray:
        """``value`` as an array of this tier's files: itself when it is one already (and not ``copy``), else a
        new file holding a copy of it; without a file, ``value`` (a C-order copy of it when ``copy``). A copy of
        a tier file is made by the kernel (``copy_file_range``), not through this process's memory."""
        source = self.data_file(value) if copy else None
        if source is not None:
            out = self._made(tuple(value.shape), value.dtype, lambda fd, n: _copy_file(source, fd, n))
            if out is not None:
                return out
        elif not copy and self.owns(value):
            return value
        out = self.new(tuple(value.shape), value.dtype)
        if out is None:
            return np.array(value, copy=True, order="C") if copy else value
        out[...] = value
        return out

    def owns(self, arr: np.ndarray) -> bool:
        return self.data_file(arr) is not None

    def data_file(self, arr: np.ndarray) -> Path | None:
        """The file holding exactly ``arr``'s bytes (``arr`` one of this tier's arrays, or a view of all of it)."""
        if not arr.flags.c_contiguous:
            return None
        with self._lock:
            entry = self._live.get(_address(arr))
        return None if entry is None or entry[0]() is None or entry[2] != arr.nbytes else entry[1]

    def _forget(self, addr: int, path: Path) -> None:
        with self._lock:
            entry = self._live.get(addr)
            if entry is not None and entry[1] == path:
                del self._live[addr]
        path.unlink(missing_ok=True)  # a restore's link keeps the bytes until it is dropped too

    def _failed(self, path: Path, error: OSError) -> None:
        self.failures += 1
        log.log(
            logging.WARNING if self.failures == 1 else logging.DEBUG,
            "event=tier_file_failed path=%s error=%r: the array stays in anonymous memory",
            path,
            str(error),
        )

    # ------------------------------------------------------------------------------------------- export
    def export(self, arr: np.ndarray, prefix: str | Path) -> bool:
        """Make the bundle at ``prefix`` from ``arr``'s own file (a hard link) and a new index; False when
        ``arr`` has no file of this tier (the caller writes the bundle). The caller keeps ``arr`` unchanged
        (an export lease) until the bundle is removed."""
        path = self.data_file(arr)
        if path is None:
            return False
        _, data = bundle_files(prefix)
        try:
            os.link(path, data)
        except OSError as e:  # another file system (a folder mounted inside), links not allowed: write it
            log.warning("event=tier_file_not_linked path=%s error=%r: the restore file is written", data, str(e))
            return False
        write_index(prefix, arr.dtype, tuple(arr.shape), arr.nbytes, crc32c(byte_view(arr)))
        self.bytes_linked += arr.nbytes
        return True


def _copy_file(source: Path, fd: int, nbytes: int) -> None:
    with os.fdopen(open_regular(source, "the PS agent's tier file"), "rb") as src:
        done = 0
        while done < nbytes:
            n = os.copy_file_range(src.fileno(), fd, nbytes - done)
            if n <= 0:
                raise OSError(f"{source}: {done} of {nbytes} bytes copied")
            done += n


def _address(arr: np.ndarray) -> int:
    return int(arr.__array_interface__["data"][0])
