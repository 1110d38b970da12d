"""psguard's optional dependencies: which extra brings each, the error that names it, and installed versions.

TensorFlow is not a hard dependency (a GPU image has ``tensorflow``; a second, CPU-only TensorFlow beside it would
break it), so whatever needs it says which extra to install when it is missing. Versions are read from the
installed distributions' metadata, without importing TensorFlow (which takes seconds).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import platform
from types import ModuleType

from psguard.errors import MissingDependencyError

EXTRAS: dict[str, str] = {
    "tensorflow": "TensorFlow is not installed: pip install 'psguard[cpu]' in a CPU image, 'psguard[gpu]' "
    "(or 'psguard[tf]') in a GPU image, or keep the image's own tensorflow>=2.16",
    "tf_keras": "tf-keras is not installed: pip install --no-deps 'tf-keras>=2.16' (its tensorflow requirement "
    "would pull in a second TensorFlow beside tensorflow-cpu), or 'psguard[keras]' in a full-tensorflow image",
    "matplotlib": "matplotlib is not installed: pip install 'psguard[plot]'",
    "hdfs_native": "hdfs-native is not installed: pip install 'psguard[hdfs]'",
    "gcsfs": "gcsfs is not installed: pip install 'psguard[gcs]'",
    "watchdog": "watchdog is not installed: pip install 'psguard[watch]'",
}
"""For each optional top-level module: what is missing and the pip line that fixes it."""

TENSORFLOW_DISTRIBUTIONS = ("tensorflow", "tensorflow-cpu", "tensorflow-gpu", "tensorflow-intel", "tf-nightly")
"""Distributions that provide the ``tensorflow`` module, in the order they are looked for."""


def install_hint(error: ImportError) -> str | None:
    """The fix for an import that failed on one of the optional dependencies; ``None`` for anything else."""
    return EXTRAS.get((error.name or "").split(".", 1)[0])


def import_optional(module: str) -> ModuleType:
    """Import ``module``; if an optional dependency is missing, :class:`MissingDependencyError` names the extra."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        hint = install_hint(e)
        if hint is None:
            raise
        raise MissingDependencyError(hint) from e


def tensorflow_version() -> tuple[str, str] | None:
    """(version, distribution) of the installed TensorFlow, read without importing it; ``None`` if absent."""
    for dist in TENSORFLOW_DISTRIBUTIONS:
        try:
            return importlib.metadata.version(dist), dist
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def versions() -> dict[str, str | None]:
    """psguard, TensorFlow (``None`` when not installed) and Python versions, for ``psguard --version``."""
    from psguard import __version__  # lazy: psguard/__init__ is the version's one home and imports this module

    tf = tensorflow_version()
    return {
        "psguard": __version__,
        "tensorflow": None if tf is None else f"{tf[0]} ({tf[1]})",
        "python": f"{platform.python_version()} ({platform.python_implementation()})",
    }
