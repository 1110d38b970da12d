"""Local files psguard reads: anything but a regular file is refused without being waited on, private files are
re-checked on their descriptor, and a held folder stays reachable whatever becomes of its path."""

from __future__ import annotations

import functools
import os
import socket
import stat
from pathlib import Path

import pytest

from psguard.errors import ConfigError, CorruptCheckpointError
from psguard.local_files import HeldDir, open_regular, read_regular
from tests.support.fifos import Fifos


def test_only_a_regular_file_is_opened_and_never_waited_on(tmp_path: Path, fifos: Fifos) -> None:
    (tmp_path / "file").write_bytes(b"data")
    assert read_regular(tmp_path / "file", "test") == b"data"
    fd = open_regular(tmp_path / "file", "test")
    try:
        assert os.get_blocking(fd) and os.read(fd, 10) == b"data"  # O_NONBLOCK cleared again
    finally:
        os.close(fd)
    fifos.put(tmp_path / "fifo")
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(tmp_path / "socket"))
        (tmp_path / "folder").mkdir()
        (tmp_path / "link").symlink_to(tmp_path / "file")
        (tmp_path / "null").symlink_to("/dev/null")
        for name, kind in [
            ("fifo", "a FIFO"),
            ("socket", "a socket"),
            ("folder", "a folder"),
            ("link", "a symbolic link"),
            ("null", "a symbolic link"),
        ]:
            for write in (False, True):
                with pytest.raises(CorruptCheckpointError, match=f"^test: {name} is {kind}.*, not a regular file"):
                    fifos.within(functools.partial(open_regular, tmp_path / name, "test", write=write))
    assert read_regular(tmp_path / "link", "test", follow=True) == b"data"  # a link where one is expected
    with pytest.raises(CorruptCheckpointError, match="null is a character device"):
        read_regular(tmp_path / "null", "test", follow=True)
    with pytest.raises(FileNotFoundError):
        open_regular(tmp_path / "missing", "test")


def test_create_makes_a_private_file_and_refuses_what_is_there_otherwise(tmp_path: Path, fifos: Fifos) -> None:
    os.close(open_regular(tmp_path / "lock", "lock file", create=True, private=True))
    assert stat.S_IMODE((tmp_path / "lock").stat().st_mode) == 0o600
    os.close(open_regular(tmp_path / "lock", "lock file", create=True, private=True))  # and opens it again
    fifos.put(tmp_path / "fifo")
    with pytest.raises(CorruptCheckpointError, match="fifo is a FIFO"):
        fifos.within(lambda: open_regular(tmp_path / "fifo", "lock file", create=True))


def test_a_private_file_is_this_users_and_no_one_elses_to_write(tmp_path: Path) -> None:
    path = tmp_path / "capture.json"
    path.write_bytes(b"{}")
    path.chmod(0o644)
    assert read_regular(path, "spool", private=True) == b"{}"
    path.chmod(0o664)
    with pytest.raises(CorruptCheckpointError, match=r"capture\.json has mode 0664: group or others could"):
        read_regular(path, "spool", private=True)
    assert read_regular(path, "store") == b"{}"  # not private: a store's files are shared
    if os.geteuid() != 0:
        pytest.skip("the other-owner case needs root to give a file away (the mode case ran)")
    path.chmod(0o600)
    os.chown(path, 65534, 65534)
    with pytest.raises(CorruptCheckpointError, match=r"capture\.json is owned by uid 65534, not by this user"):
        read_regular(path, "spool", private=True)


def test_a_file_larger_than_allowed_is_refused_unread(tmp_path: Path) -> None:
    (tmp_path / "big").write_bytes(b"x" * 100)
    assert read_regular(tmp_path / "big", "test", max_bytes=100) == b"x" * 100
    with pytest.raises(CorruptCheckpointError, match="big holds over 99 bytes"):
        read_regular(tmp_path / "big", "test", max_bytes=99)


def test_a_held_folder_is_reached_through_its_descriptor_whatever_becomes_of_its_path(tmp_path: Path) -> None:
    where = tmp_path / "spool"
    where.mkdir(mode=0o700)
    held = HeldDir(where, "spool")
    try:
        (held.path / "mine").write_text("1")
        assert not held.moved() and (where / "mine").read_text() == "1"
        where.rename(tmp_path / "away")
        where.mkdir(mode=0o777)
        (where / "theirs").write_text("2")
        assert held.moved()
        assert sorted(p.name for p in held.path.iterdir()) == ["mine"]  # the folder held, not the one at the path
        (held.path / "next").write_text("3")
        assert not (where / "next").exists() and (tmp_path / "away" / "next").read_text() == "3"
    finally:
        held.close()
    assert held.path == where


def test_a_folder_that_is_a_link_or_others_can_write_is_not_held(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(real)
    with pytest.raises(ConfigError, match="cannot hold the folder open"):
        HeldDir(tmp_path / "link", "spool")
    real.chmod(0o770)
    with pytest.raises(ConfigError, match="mode 0770; it must be this user's"):
        HeldDir(real, "spool")
    if os.geteuid() != 0:
        pytest.skip("the other-owner case needs root to give a folder away (the mode case ran)")
    real.chmod(0o700)
    os.chown(real, 65534, 65534)
    with pytest.raises(ConfigError, match="owned by uid 65534"):
        HeldDir(real, "spool")
