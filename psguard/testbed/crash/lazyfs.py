"""What a power cut leaves of a folder: the page cache's unsynced writes dropped, as LazyFS (VLDB'24) does.

A file keeps the contents its last ``fsync`` (or ``fdatasync``) gave it, and a file never synced is empty; a
folder keeps the entries its last ``fsync`` saw (a file created, renamed, linked or removed since is as it was
then), and a folder whose own creation no ``fsync`` of its parent recorded is gone with everything in it. That is
what POSIX promises and no more (ext4 and XFS often keep more: their journals order metadata), the model
CrashMonkey (OSDI'18) checks against, and what a program must assume to be durable on every file system.

:class:`PageCache` follows a run in its own process (told of every sync and every unlink by
:class:`~psguard.testbed.crash.recorder.FsRecorder`) and, at the crash, its :meth:`PageCache.image` is written out;
:func:`restore_image` then puts that image in place of the folder, once the run is dead. Files are known by inode
and a generation that changes when an inode's last link goes, so a reused inode number never passes a removed
file's contents to a new one.
"""

from __future__ import annotations

import base64
import os
import shutil
import stat
import threading
from pathlib import Path
from typing import Any

__all__ = ["PageCache", "restore_image"]

Entry = tuple[str, str | None]  # ("d", None) for a folder, ("f", file id) for a file


class PageCache:
    """The durable state of the tree under ``root``, as far as the syncs this process made go."""

    def __init__(self, root: Path) -> None:
        self.root = os.path.abspath(root)
        self._lock = threading.Lock()
        self._dirs: dict[str, dict[str, Entry]] = {}  # folder (relative to root) -> its durable entries
        self._files: dict[str, bytes] = {}  # file id -> durable contents
        self._generation: dict[tuple[int, int], int] = {}
        self._mode = 0o755

    def begin(self) -> None:
        """Everything under the root now counts as durable (what the run found when it began)."""
        with self._lock:
            self._dirs.clear()
            self._files.clear()
            self._mode = stat.S_IMODE(os.stat(self.root).st_mode)
            for folder, _subdirs, files in os.walk(self.root):
                self._dirs[self._rel(folder)] = self._listing(folder)
                for name in files:
                    path = os.path.join(folder, name)
                    st = os.lstat(path)
                    if stat.S_ISREG(st.st_mode):
                        with open(path, "rb") as f:
                            self._files[self._id(st)] = f.read()

    def synced(self, fd: int, path: str) -> None:
        """``fd`` (open on ``path``) was just synced: its contents, or a folder's entries, are durable now."""
        if not self._inside(path):
            return
        st = os.fstat(fd)
        with self._lock:
            if stat.S_ISDIR(st.st_mode):
                self._dirs[self._rel(path)] = self._listing(path)
            elif stat.S_ISREG(st.st_mode):
                with open(f"/proc/self/fd/{fd}", "rb") as f:
                    self._files[self._id(st)] = f.read()

    def unlinking(self, path: str) -> None:
        """``path`` may lose a link now: if it is a file's last, a later file on its inode is another file."""
        try:
            st = os.lstat(path)
        except OSError:
            return
        if stat.S_ISREG(st.st_mode) and st.st_nlink == 1:
            with self._lock:
                key = (st.st_dev, st.st_ino)
                self._generation[key] = self._generation.get(key, 0) + 1

    def image(self) -> dict[str, Any]:
        """The durable tree as JSON: folders' entries and the files' contents (base64)."""
        with self._lock:
            reachable: set[str] = set()
            dirs: dict[str, dict[str, list[str | None]]] = {}
            pending = ["."]
            while pending:
                folder = pending.pop()
                entries = self._dirs.get(folder, {})
                dirs[folder] = {name: list(entry) for name, entry in entries.items()}
                for name, (kind, file_id) in entries.items():
                    if kind == "d":
                        pending.append(os.path.normpath(os.path.join(folder, name)))
                    elif file_id is not None:
                        reachable.add(file_id)
            files = {i: base64.b64encode(self._files[i]).decode() for i in reachable if i in self._files}
            return {"mode": self._mode, "dirs": dirs, "files": files}

    # ------------------------------------------------------------------------------------------- helpers
    def _inside(self, path: str) -> bool:
        return path == self.root or path.startswith(self.root + os.sep)

    def _rel(self, path: str) -> str:
        return os.path.relpath(path, self.root)

    def _id(self, st: os.stat_result) -> str:
        return f"{st.st_dev}:{st.st_ino}:{self._generation.get((st.st_dev, st.st_ino), 0)}"

    def _listing(self, folder: str) -> dict[str, Entry]:
        entries: dict[str, Entry] = {}
        with os.scandir(folder) as it:
            for entry in it:
                st = entry.stat(follow_symlinks=False)
                if stat.S_ISDIR(st.st_mode):
                    entries[entry.name] = ("d", None)
                elif stat.S_ISREG(st.st_mode):
                    entries[entry.name] = ("f", self._id(st))
        return entries


def restore_image(image: dict[str, Any], root: Path) -> None:
    """Replace the tree at ``root`` with ``image`` (a file whose contents never reached the disk is empty)."""
    shutil.rmtree(root, ignore_errors=True)
    os.mkdir(root, int(image["mode"]))
    files: dict[str, str] = image["files"]

    def fill(rel: str) -> None:
        for name, (kind, file_id) in image["dirs"].get(rel, {}).items():
            target = root / rel / name
            if kind == "d":
                os.mkdir(target)
                fill(os.path.normpath(os.path.join(rel, name)))
            else:
                target.write_bytes(base64.b64decode(files.get(str(file_id), "")))

    fill(".")
