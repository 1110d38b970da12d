"""psguard's compiled helpers: building them once per machine into the cache, refusing a library someone else could
have written, and the row digest in C (``rows_digest.c`` beside this module).

The C digest (:func:`psguard.agent.tiers.copy_frames.rows_digest`) is one call per piece that releases the
interpreter's lock, where numpy's took it about ten times; same arithmetic bit for bit, since owners, holders and
new agents must agree whichever version each runs. Built by ``psguard build-op`` with ``cc`` (plain C, no
TensorFlow). Not built, or ``PSGUARD_NATIVE_DIGEST=0``: numpy's version serves.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path

from psguard.errors import ConfigError
from psguard.handoff.credentials import ensure_private_dir
from psguard.run_folder import cache_root

log = logging.getLogger(__name__)

DIGEST_SOURCE = Path(__file__).with_name("rows_digest.c")
#: ``0`` (or ``off``): hash rows with numpy even when the C digest is built (to rule it out when debugging).
ENV_NATIVE_DIGEST = "PSGUARD_NATIVE_DIGEST"

#: ``digest(words, rows, width, ids or None, first id, weights) -> digest``, pointers as integers.
DigestFunction = Callable[[int, int, int, int | None, int, int], int]


def trusted(path: Path) -> bool:
    """A library only this user could have written (loading it runs its code in this process)."""
    for p, want_dir in ((path.parent, True), (path, False)):
        try:
            st = os.lstat(p)
        except OSError:
            return False
        kind_ok = stat.S_ISDIR(st.st_mode) if want_dir else stat.S_ISREG(st.st_mode)
        if not kind_ok or st.st_uid != os.geteuid() or st.st_mode & 0o022:
            if p.exists():
                log.warning("event=native_library_refused path=%s: not only this user's to write; not loaded", p)
            return False
    return True


def compile_library(path: Path, command: Callable[[str], list[str]], what: str) -> Path:
    """Run ``command(output)`` (a compiler's command line writing ``output``) and move its result to ``path``,
    owner-only. Atomic: a half-written library is never where a loader looks."""
    ensure_private_dir(path.parent, "psguard's library cache")
    fd, tmp = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=path.parent)
    os.close(fd)
    cmd = command(tmp)
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
        if done.returncode != 0:
            raise ConfigError(f"building {what} failed ({cmd[0]}):\n{done.stderr[-4000:]}")
        os.chmod(tmp, 0o700)
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)
    return path


def digest_library() -> Path:
    """Where the C digest for this source and machine is (or would be) built."""
    key = hashlib.sha256(DIGEST_SOURCE.read_bytes() + platform.machine().encode()).hexdigest()[:16]
    return cache_root() / "ops" / f"rows_digest-{key}.so"


def build_digest(*, compiler: str | None = None, force: bool = False) -> Path:
    """Compile the C digest into the cache (a fraction of a second); a trusted build there is kept."""
    path = digest_library()
    if path.exists() and not force and trusted(path):
        return path
    cc = compiler or os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise ConfigError("no C compiler (cc, gcc or $CC) to build psguard's row digest with")
    return compile_library(
        path, lambda out: [cc, "-std=c99", "-O3", "-shared", "-fPIC", str(DIGEST_SOURCE), "-o", out], "the row digest"
    )


def switched_on(name: str, environ: Mapping[str, str] = os.environ) -> bool:
    """Whether the environment leaves ``name`` on: anything but ``0``, ``off``, ``false`` or ``no``."""
    return environ.get(name, "").strip().lower() not in ("0", "off", "false", "no")


@functools.cache
def digest_function() -> DigestFunction | None:
    """The C digest, loaded once per process; None when it is not built, not trusted, turned off or not
    loadable (then numpy's version serves: said once, at info level, as it costs only speed)."""
    path = digest_library()
    if not switched_on(ENV_NATIVE_DIGEST):
        return None
    if not path.exists():
        log.info("event=native_digest_not_built path=%s: rows are hashed with numpy (psguard build-op)", path)
        return None
    if not trusted(path):  # said by trusted() (native_library_refused)
        return None
    try:
        fn = ctypes.CDLL(str(path)).psguard_rows_digest
    except (OSError, AttributeError) as e:
        log.warning("event=native_digest_not_loaded path=%s error=%r: rows are hashed with numpy", path, str(e))
        return None
    fn.restype = ctypes.c_uint64
    fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
    return fn  # type: ignore[no-any-return]
