"""Working folders that psguard's own commands (``psguard demo --dir``, ``psguard chaos run --report``) recreate.

Such a command starts from an empty folder, so it deletes what a previous run left. It must never delete a folder
it did not make: a mistyped ``--dir ~/project`` would take the project with it. A folder a psguard run made
carries :data:`MARKER`; only such a folder, an empty one, or none at all is used.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path

from psguard.errors import ConfigError

MARKER = ".psguard-run"
"""The file a psguard run leaves in the folder it made: a reused folder is recognised by it."""


def claim_folder(directory: str | os.PathLike[str], owner: str) -> Path:
    """Make ``directory`` an empty folder marked as ``owner``'s (e.g. ``psguard demo``) and return it, resolved:
    a missing or empty folder is taken, one carrying :data:`MARKER` emptied, anything else refused and left alone."""
    path = Path(directory).expanduser()
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{path} is a file, not a folder: give {owner} a folder to work in")
    if path.is_dir() and any(path.iterdir()):
        if not (path / MARKER).is_file():
            raise ConfigError(
                f"{path} is not empty and was not made by a psguard run (no {MARKER} in it): {owner} will not "
                "delete it. Give a new or empty folder, or delete this one yourself"
            )
        shutil.rmtree(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / MARKER).write_text(json.dumps({"by": owner, "pid": os.getpid()}) + "\n")
    return path.resolve()


def cache_root() -> Path:
    """``$PSGUARD_CACHE`` when set (CI points it at a cached folder), else ``~/.cache/psguard``: what psguard
    builds or downloads once per machine (its compiled op, :mod:`psguard.handoff.mapped`; the testbed's Hadoop
    and Prometheus)."""
    root = os.environ.get("PSGUARD_CACHE")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "psguard"


_SHM = Path("/dev/shm")


def memory_folder(work: Path, name: str, prefix: str) -> Path:
    """A fresh folder on tmpfs for one run (``/dev/shm/<prefix><name>-XXXX``), or ``work/<name>`` without a
    writable /dev/shm: a chief's spool or a PS agent's part folder (mapped restores need a file system in memory).
    Never an agent's default folder, which two runs on one host would share; :func:`drop_memory_folders` at the end."""
    if _SHM.is_dir() and os.access(_SHM, os.W_OK):
        return Path(tempfile.mkdtemp(prefix=f"{prefix}{name}-", dir=_SHM))
    path = work / name
    path.mkdir(parents=True, exist_ok=True)
    return path


def drop_memory_folders(folders: Iterable[Path]) -> None:
    """Remove the folders :func:`memory_folder` made on tmpfs (memory, gone with the run); ``work/<name>`` ones stay
    with the run's folder."""
    for folder in folders:
        if folder.parent == _SHM:
            shutil.rmtree(folder, ignore_errors=True)
