"""Local files psguard reads: regular files only, opened without ever blocking; private folders held by descriptor.

A FIFO waits for a writer that may never come, a device such as ``/dev/zero`` never ends, and a symbolic link
points wherever its maker chose. Wherever one can stand in place of a file psguard reads (the spool, tier and part
files, a local store), :func:`open_regular` opens it:

1. looks first (``lstat``, or ``stat`` where a link is expected), so a device or a FIFO is not even opened;
2. opens with ``O_NONBLOCK`` (a FIFO swapped in after the look is not waited on) and ``O_NOFOLLOW``;
3. checks the descriptor (``fstat``): anything but a regular file is refused with the error the caller chose;
   with ``private``, so is a file another user owns or that group or others can write;
4. clears ``O_NONBLOCK`` again.

A folder whose parent another user can write can be renamed away after psguard checked it. :class:`HeldDir` opens
such a folder once, checks the descriptor, and reaches everything in it through ``/proc/self/fd/<fd>``: a rename or
replacement of the path changes nothing, and the standard library's own walks keep working unchanged.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
from pathlib import Path

from psguard.errors import ConfigError, CorruptCheckpointError, PsguardError

_KINDS = {
    stat.S_IFIFO: "a FIFO (named pipe)",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
    stat.S_IFDIR: "a folder",
    stat.S_IFLNK: "a symbolic link",
}


def describe(mode: int) -> str:
    """What a file of ``mode`` is, in words (``a FIFO (named pipe)``)."""
    return _KINDS.get(stat.S_IFMT(mode), "not a regular file")


def _check(st: os.stat_result, name: str, what: str, private: bool, error: type[PsguardError]) -> None:
    base = os.path.basename(name)
    if not stat.S_ISREG(st.st_mode):
        raise error(
            f"{what}: {base} is {describe(st.st_mode)}, not a regular file: refused unread (psguard only ever "
            "writes regular files there; remove it)"
        )
    if not private:
        return
    if st.st_uid != os.geteuid():
        raise error(
            f"{what}: {base} is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()}): refused unread "
            "(only this user writes in this folder; someone else put it there)"
        )
    if st.st_mode & 0o022:
        raise error(
            f"{what}: {base} has mode {stat.S_IMODE(st.st_mode):04o}: group or others could have changed it, so it "
            "is refused unread (psguard writes these files 0600)"
        )


def open_regular(
    path: str | os.PathLike[str],
    what: str,
    *,
    write: bool = False,
    create: bool = False,
    follow: bool = False,
    private: bool = False,
    error: type[PsguardError] = CorruptCheckpointError,
) -> int:
    """A blocking descriptor of the regular file ``path`` (read-only, or write-only with ``write``; ``create``
    makes a missing one ``0600``). A FIFO, device, socket, folder or (unless ``follow``) symbolic link is refused
    with ``error`` (``what`` says whose file it is), never waited on; with ``private``, so is a file another user
    owns or that group or others can write. ``OSError`` is left to the caller."""
    name = os.fspath(path)
    try:
        _check(os.stat(name) if follow else os.lstat(name), name, what, private, error)
    except FileNotFoundError:
        if not create:
            raise
    flags = os.O_WRONLY if write or create else os.O_RDONLY
    flags |= os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW) | (os.O_CREAT if create else 0)
    try:
        fd = os.open(name, flags, 0o600)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENXIO):  # a link, or a FIFO without a reader (for writing), swapped in
            st = os.lstat(name)
            _check(st, name, what, private, error)
        raise
    try:
        _check(os.fstat(fd), name, what, private, error)
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_regular(
    path: str | os.PathLike[str],
    what: str,
    *,
    max_bytes: int | None = None,
    follow: bool = False,
    private: bool = False,
    error: type[PsguardError] = CorruptCheckpointError,
) -> bytes:
    """The bytes of the regular file ``path``, opened as :func:`open_regular` opens it; a file of more than
    ``max_bytes`` is refused with ``error`` before it is read."""
    fd = open_regular(path, what, follow=follow, private=private, error=error)
    with os.fdopen(fd, "rb") as f:
        if max_bytes is None:
            return f.read()
        size = os.fstat(fd).st_size
        data = f.read(max_bytes + 1) if size <= max_bytes else b""
        if size > max_bytes or len(data) > max_bytes:
            raise error(f"{what}: {os.path.basename(os.fspath(path))} holds over {max_bytes} bytes: refused")
        return data


class HeldDir:
    """A private folder held open: :attr:`path` reaches its contents through the descriptor, whatever becomes of
    the folder's path (:attr:`where`). Refused (:class:`ConfigError`) when ``where`` is a link or not a folder, or
    the folder opened is another user's or writable by group or others (checked on the descriptor)."""

    def __init__(self, where: str | os.PathLike[str], what: str) -> None:
        self.where = Path(where)
        self.what = what
        try:
            fd = os.open(self.where, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as e:
            raise ConfigError(
                f"{what} {self.where}: cannot hold the folder open ({e.strerror or e}; a link or a file in its "
                "place?): remove what is there if it is not yours, or choose another folder"
            ) from None
        try:
            st = os.fstat(fd)
            if st.st_uid != os.geteuid() or st.st_mode & 0o022:
                raise ConfigError(
                    f"{what} {self.where}: the folder opened is owned by uid {st.st_uid} with mode "
                    f"{stat.S_IMODE(st.st_mode):04o}; it must be this user's (uid {os.geteuid()}) and writable by "
                    "no one else (it was replaced while psguard checked it?): remove it and start again"
                )
            held = Path(f"/proc/self/fd/{fd}")
            try:
                through = os.stat(held)
            except OSError:
                through = None
            if through is None or (through.st_dev, through.st_ino) != (st.st_dev, st.st_ino):
                raise ConfigError(
                    f"{what} {self.where}: /proc/self/fd does not lead to the folder held open; psguard needs /proc "
                    "mounted (Linux) to keep its folders by descriptor"
                )
        except BaseException:
            os.close(fd)
            raise
        self._fd: int | None = fd
        self._id = (st.st_dev, st.st_ino)
        self.path = held

    def moved(self) -> bool:
        """Whether :attr:`where` no longer names the folder held (renamed away, replaced or removed)."""
        try:
            st = os.stat(self.where, follow_symlinks=False)
        except OSError:
            return True
        return (st.st_dev, st.st_ino) != self._id

    def close(self) -> None:
        """Let the folder go (idempotent); :attr:`path` is its path again."""
        fd, self._fd = self._fd, None
        self.path = self.where
        if fd is not None:
            os.close(fd)
