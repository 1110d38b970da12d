"""Zero-copy restore from the node's own memory tier: a small TensorFlow op that maps a tier file instead of
reading it (``map_bundle.cc`` beside this module, compiled once per machine by ``psguard build-op``).

The tier's shards already are bundle data files on the node's tmpfs (:mod:`psguard.agent.tiers.tier_files`), which
an export hard-links into the restore folder; ``PsguardMapBundle`` hands TensorFlow a private mapping of such a file
as the tensor's buffer, so nothing is copied until training first writes a page (measurements: docs/bench).
The op does not check a linked tier file's CRC32C: the PS maps the very pages the agent's tier holds, in files only
this user can write and the agent never writes again once exported. Every other file is loaded by ``RestoreV2``
with its CRC32C.

Used when the PS was started by psguard's server with the library built and the chief can load it too; otherwise,
or with ``PSGUARD_MAP_OP=0``, restores read as before. The library is keyed by this source and the TensorFlow
library it links against, so an upgraded TensorFlow is never handed a stale build.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import hashlib
import importlib.util
import logging
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from psguard.errors import ConfigError
from psguard.handoff.native import build_digest, compile_library, switched_on, trusted
from psguard.run_folder import cache_root

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("map_bundle.cc")
#: ``0`` (or ``off``): never map (the PS loads no library, the chief reads every shard with ``RestoreV2``).
ENV_MAP_OP = "PSGUARD_MAP_OP"
_FRAMEWORK = "libtensorflow_framework.so.2"


def _framework_library() -> Path | None:
    """TensorFlow's framework library, which the op links against. Found without importing TensorFlow (the PS's
    lean start does not), in the package's folder (``__path__`` of an imported TensorFlow lists Keras's first)."""
    loaded = sys.modules.get("tensorflow")
    if loaded is not None:  # imported, or the lean server's stand-in package (it has no spec)
        locations = list(getattr(loaded, "__path__", None) or [])
    else:
        spec = importlib.util.find_spec("tensorflow")
        locations = list(spec.submodule_search_locations or []) if spec is not None else []
    return next((Path(p) / _FRAMEWORK for p in locations if (Path(p) / _FRAMEWORK).exists()), None)


def library_path() -> Path | None:
    """Where the library for this TensorFlow is (or would be) built; None without TensorFlow."""
    framework = _framework_library()
    if framework is None:
        return None
    st = framework.stat()
    key = hashlib.sha256(SOURCE.read_bytes() + f"{framework.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode())
    return cache_root() / "ops" / f"map_bundle-{key.hexdigest()[:16]}.so"


def built() -> Path | None:
    """The library, when built for this TensorFlow, usable (:func:`enabled`) and trusted."""
    path = library_path()
    return path if switched_on(ENV_MAP_OP) and path is not None and path.exists() and trusted(path) else None


def build(*, compiler: str | None = None, force: bool = False) -> Path:
    """Compile the library for this TensorFlow (imports it, for its headers and flags) into the cache; a few
    seconds. Atomic: a half-written library is never where :func:`library_path` looks."""
    import tensorflow as tf

    path = library_path()
    if path is None:
        raise ConfigError("TensorFlow is not installed here: there is nothing to build the op against")
    if path.exists() and not force and trusted(path):
        return path
    cxx = compiler or os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not cxx:
        raise ConfigError("no C++ compiler (c++, g++ or $CXX) to build psguard's op with")
    flags = list(tf.sysconfig.get_compile_flags()) + list(tf.sysconfig.get_link_flags())
    return compile_library(
        path,
        lambda out: [cxx, "-std=c++17", "-shared", "-fPIC", "-O2", "-w", str(SOURCE), "-o", out, *flags],
        "psguard's op",
    )


def load_into_server() -> bool:
    """Register the op's kernel in this process (a PS started by psguard's server, TensorFlow's runtime loaded
    already); False when it is not built, turned off, or does not load (then restores read as before)."""
    path = built()
    if path is None:
        return False
    try:
        ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
    except OSError as e:
        print(f"psguard server: the zero-copy restore op did not load ({e}); restores read", file=sys.stderr)
        return False
    return True


@functools.cache
def map_op() -> Any | None:
    """The op's Python function in this (the chief's) process, or None: not built, turned off, or not loadable.

    Not built (and not turned off) is said once, as a warning: ``pip install`` does not compile it, and without
    it every restore from the PS agents' tiers reads each shard instead of mapping it (3-4x slower), silently."""
    path = built()
    if path is None:
        if switched_on(ENV_MAP_OP) and (where := library_path()) is not None and not where.exists():
            log.warning(
                "event=map_op_not_built path=%s: restores from the PS agents' tiers read every shard instead of "
                "mapping it; build the op once per machine or image: psguard build-op",
                where,
            )
        return None
    import tensorflow as tf

    try:
        return tf.load_op_library(str(path)).psguard_map_bundle
    except (tf.errors.OpError, OSError, AttributeError) as e:
        log.warning("event=map_op_not_loaded path=%s error=%r: restores read every shard", path, str(e))
        return None


# ------------------------------------------------------------------------------------------------- the CLI
def register(sub: Any) -> None:
    p = sub.add_parser(
        "build-op",
        help=(
            "compile psguard's zero-copy restore op for this TensorFlow and its row digest in C (once per machine "
            "or image)"
        ),
        description=(__doc__ or "").split("\n\n")[0],
    )
    p.add_argument("--force", action="store_true", help="build again even when a build for this TensorFlow exists")
    p.set_defaults(func=_build_command)


def build_all(*, force: bool = False, say: Callable[[Path], None] = print) -> list[Path]:
    """Both libraries, each ``say``-ed when built: the row digest (a C compiler is all it needs), then the op
    (TensorFlow and a C++ compiler). Each is tried whatever the other did, so an image without TensorFlow still
    gets its digest; a :class:`ConfigError` naming every failure at the end."""
    paths: list[Path] = []
    errors: list[str] = []
    for step in (build_digest, build):
        try:
            paths.append(step(force=force))
        except ConfigError as e:
            errors.append(str(e))
            continue
        say(paths[-1])
    if errors:
        raise ConfigError("\n".join(errors))
    return paths


def _build_command(args: argparse.Namespace) -> int:
    build_all(force=args.force)
    return 0


if __name__ == "__main__":  # python -m psguard.handoff.mapped: what `make` runs
    build_all()
