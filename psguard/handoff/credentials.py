"""Secret files: read one only when no other user can read or replace it; make a private one for a run.

A token, signing secret or TLS key in a file group or others can read is every local user's, and a file another
user owns is a secret that user chooses: both are refused with the fix in the message, as ``ssh`` refuses a loose
private key (a file owned by root is accepted). When the operator gives no token, the agent makes a random one in
a ``0600`` file in a fresh ``0700`` folder and hands its task the file's path, never the token.
"""

from __future__ import annotations

import os
import secrets
import shutil
import stat
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from psguard.errors import ConfigError

if TYPE_CHECKING:
    from typing import Self


def check_private_file(path: str | os.PathLike[str], what: str) -> os.stat_result:
    """Refuse ``path`` unless only its owner (this user or root) can read it; its ``stat`` (links followed).

    ``what`` names the setting in the message (``--token-file``). Links are followed: a Kubernetes Secret
    volume's files are symlinks into a ``..data`` folder, and the mode that matters is the target's.
    """
    name = os.fspath(path)
    try:
        st = os.stat(name)
    except OSError as e:
        raise ConfigError(f"{what} {name}: cannot read: {e.strerror or e}") from None
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(f"{what} {name}: not a regular file")
    if st.st_uid not in (os.geteuid(), 0):
        raise ConfigError(
            f"{what} {name}: owned by uid {st.st_uid}, not by this user (uid {os.geteuid()}) or root: another user "
            f"could replace the secret. Make it yours: chown {os.geteuid()} {name}; chmod 600 {name}"
        )
    if st.st_mode & 0o077:
        raise ConfigError(
            f"{what} {name}: mode {stat.S_IMODE(st.st_mode):04o} lets group or others read or change a secret. "
            f"Fix: chmod 600 {name} (on Kubernetes: defaultMode: 0400 on the Secret volume)"
        )
    return st


def ensure_private_dir(path: str | os.PathLike[str], what: str) -> Path:
    """``path`` as a folder only this user can write: created ``0700`` when absent, refused when it is a link,
    not a folder, owned by another user, or writable by group or others (another user could hand the agent forged
    captures). Its parents are not checked: they are the system's or the user's own."""
    folder = Path(path)
    try:
        os.mkdir(folder, 0o700)
    except FileExistsError:
        pass
    except FileNotFoundError:
        folder.parent.mkdir(parents=True, exist_ok=True)
        return ensure_private_dir(folder, what)
    except OSError as e:
        raise ConfigError(f"{what} {folder}: cannot create the folder: {e.strerror or e}") from None
    st = os.lstat(folder)
    fix = f"remove it (rm -r {folder}) if it is not yours, or choose another folder"
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"{what} {folder}: not a folder (a link or a file is in its place); {fix}")
    if st.st_uid != os.geteuid():
        raise ConfigError(
            f"{what} {folder}: owned by uid {st.st_uid}, not by this user (uid {os.geteuid()}): whoever owns it could "
            f"hand this process forged checkpoints; {fix}"
        )
    if st.st_mode & 0o022:
        raise ConfigError(
            f"{what} {folder}: mode {stat.S_IMODE(st.st_mode):04o} lets group or others write in it (forged "
            f"checkpoints); chmod 700 {folder}, or {fix}"
        )
    return folder


def read_secret_file(path: str | os.PathLike[str], what: str) -> str:
    """The stripped text of a private secret file (:func:`check_private_file`); never echoed in an error."""
    name = os.fspath(path)
    check_private_file(name, what)
    try:
        text = Path(name).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{what} {name}: cannot read: {type(e).__name__}") from None
    if not text:
        raise ConfigError(f"{what} {name}: the file is empty")
    return text


def _private_base() -> str | None:
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        try:
            st = os.stat(runtime)
        except OSError:
            return None
        if stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o077:
            return runtime
    return None  # tempfile's default folder; mkdtemp makes our folder 0700 inside it


@dataclass
class TokenFile:
    """A random bearer token in a ``0600`` file in a fresh ``0700`` folder; :meth:`remove` deletes both."""

    path: Path
    token: str = field(repr=False)  # never shown

    def remove(self) -> None:
        """Delete the file and its folder (idempotent)."""
        shutil.rmtree(self.path.parent, ignore_errors=True)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def create_token_file(prefix: str = "psguard-token-") -> TokenFile:
    """Make a fresh random token (256 bits, URL-safe) in a private file; the caller removes it at exit."""
    folder = Path(tempfile.mkdtemp(prefix=prefix, dir=_private_base()))  # mode 0700
    path = folder / "token"
    token = secrets.token_urlsafe(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(token + "\n")
    return TokenFile(path, token)
