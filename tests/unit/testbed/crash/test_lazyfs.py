"""The power-cut model (psguard.testbed.crash.lazyfs): what it keeps is what fsync made durable, and no more.

Each test follows real files with a :class:`PageCache` (told of each sync as the recorder would tell it), then
puts the cache's image in place of the folder, as the enumeration does after a crash, and reads what is left.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from psguard.storage.local import LocalBackend
from psguard.testbed.crash.lazyfs import PageCache, restore_image
from psguard.testbed.crash.recorder import fd_path


def tree(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` (relative path -> contents) and every folder (relative path/ -> b"")."""
    out: dict[str, bytes] = {}
    for path in sorted(root.rglob("*")):
        rel = str(path.relative_to(root))
        out[rel + "/" if path.is_dir() else rel] = b"" if path.is_dir() else path.read_bytes()
    return out


def power_cut(cache: PageCache, root: Path) -> dict[str, bytes]:
    """The folder as the power cut left it; the machine then comes back with that as its durable state."""
    restore_image(cache.image(), root)
    cache.begin()
    return tree(root)


def write(path: Path, data: bytes, *, sync: Callable[[int], None] | None = None) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, data)
        if sync is not None:
            sync(fd)
    finally:
        os.close(fd)


@pytest.fixture
def cache(tmp_path: Path) -> Iterator[PageCache]:
    root = tmp_path / "root"
    root.mkdir()
    yield PageCache(root)


def synced(cache: PageCache) -> Callable[[int], None]:
    def sync(fd: int) -> None:
        os.fsync(fd)
        path = fd_path(fd)
        assert path is not None
        cache.synced(fd, path)

    return sync


def sync_dir(cache: PageCache, path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        synced(cache)(fd)
    finally:
        os.close(fd)


def test_a_file_keeps_what_its_last_fsync_gave_it_and_a_new_name_needs_its_folders(cache: PageCache) -> None:
    root = Path(cache.root)
    write(root / "old", b"before")
    cache.begin()  # what is there now survives
    write(root / "old", b"after, never synced")
    write(root / "new", b"synced, its name not", sync=synced(cache))
    assert power_cut(cache, root) == {"old": b"before"}

    write(root / "old", b"after, synced", sync=synced(cache))
    write(root / "new", b"synced", sync=synced(cache))
    sync_dir(cache, root)
    write(root / "new", b"synced, then more not synced")
    assert power_cut(cache, root) == {"new": b"synced", "old": b"after, synced"}


def test_a_file_never_synced_is_empty_and_a_folder_never_synced_into_its_parent_is_gone(cache: PageCache) -> None:
    root = Path(cache.root)
    cache.begin()
    (root / "d").mkdir()
    write(root / "d" / "f", b"synced", sync=synced(cache))
    write(root / "d" / "g", b"never synced")
    sync_dir(cache, root / "d")
    assert power_cut(cache, root) == {}, "d's own entry was never synced into the root"

    (root / "d").mkdir()
    write(root / "d" / "f", b"synced", sync=synced(cache))
    write(root / "d" / "g", b"never synced")
    sync_dir(cache, root / "d")
    sync_dir(cache, root)
    assert power_cut(cache, root) == {"d/": b"", "d/f": b"synced", "d/g": b""}


def test_a_removal_lasts_once_its_folder_is_synced_and_a_new_file_never_takes_a_removed_ones_contents(
    cache: PageCache,
) -> None:
    root = Path(cache.root)
    write(root / "x", b"x's contents")
    cache.begin()
    cache.unlinking(str(root / "x"))
    os.unlink(root / "x")
    write(root / "y", b"y's contents", sync=synced(cache))  # may well get x's inode number
    assert power_cut(cache, root) == {"x": b"x's contents"}

    cache.unlinking(str(root / "x"))
    os.unlink(root / "x")
    write(root / "y", b"y's contents", sync=synced(cache))
    sync_dir(cache, root)
    assert power_cut(cache, root) == {"y": b"y's contents"}


def test_a_rename_over_a_file_is_durable_with_its_folder(cache: PageCache) -> None:
    root = Path(cache.root)
    write(root / "obj", b"first")
    cache.begin()
    write(root / "obj.tmp", b"second", sync=synced(cache))
    cache.unlinking(str(root / "obj"))
    os.replace(root / "obj.tmp", root / "obj")
    assert power_cut(cache, root) == {"obj": b"first"}

    write(root / "obj.tmp", b"second", sync=synced(cache))
    cache.unlinking(str(root / "obj"))
    os.replace(root / "obj.tmp", root / "obj")
    sync_dir(cache, root)
    assert power_cut(cache, root) == {"obj": b"second"}


def followed(cache: PageCache, monkeypatch: pytest.MonkeyPatch) -> LocalBackend:
    """A local store in the cache's folder, every fsync and unlink it makes told to the cache."""
    real_fsync, real_unlink = os.fsync, os.unlink

    def fsync(fd: int) -> None:
        real_fsync(fd)
        path = fd_path(fd)
        assert path is not None
        cache.synced(fd, path)

    def unlink(path: str | os.PathLike[str], *, dir_fd: int | None = None) -> None:
        cache.unlinking(os.fspath(path))
        real_unlink(path, dir_fd=dir_fd)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "unlink", unlink)
    return LocalBackend(cache.root)


def test_an_object_a_local_store_wrote_survives_a_power_cut_in_folders_it_created(
    cache: PageCache, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by the crash-point enumeration (every store path, local+lazyfs, e.g. save-full's last point): the
    local backend made ``chunks/ab/`` and ``manifests/`` without syncing their parents, so a power cut after a
    commit could take every chunk of it while its manifest stayed (a torn checkpoint), or the manifest itself."""
    root = Path(cache.root)
    backend = followed(cache, monkeypatch)
    cache.begin()
    backend.put("chunks/ab/abcd", b"a chunk")
    backend.put_new("manifests/000000000001-0123abcd.json", b"its manifest")
    assert power_cut(cache, root) == {
        "chunks/": b"",
        "chunks/ab/": b"",
        "chunks/ab/abcd": b"a chunk",
        "manifests/": b"",
        "manifests/000000000001-0123abcd.json": b"its manifest",
    }


def test_an_object_a_local_store_deleted_stays_deleted_whatever_it_syncs_next(
    cache: PageCache, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by the crash-point enumeration (path gc, local+lazyfs, seed 13, the point after the next save's
    "fsync store/chunks/f1"): gc deleted a manifest, then a chunk only it used; the next save's chunk in the same
    folder synced that folder, so the chunk's removal was durable and the manifest's was not. After a power cut
    the deleted checkpoint was back, torn."""
    root = Path(cache.root)
    backend = followed(cache, monkeypatch)
    backend.put("chunks/ab/ab01", b"the old checkpoint's own chunk")
    backend.put_new("manifests/000000000001-0123abcd.json", b"the old checkpoint")
    cache.begin()
    backend.delete("manifests/000000000001-0123abcd.json")  # gc: manifests first,
    backend.delete("chunks/ab/ab01")  # then the chunks nothing references
    backend.put("chunks/ab/ab02", b"the next save's chunk")
    assert power_cut(cache, root) == {
        "chunks/": b"",
        "chunks/ab/": b"",
        "chunks/ab/ab02": b"the next save's chunk",
        "manifests/": b"",
    }
