"""URL scheme -> backend class, imported lazily so ``psguard ls /local/path`` never imports s3fs."""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

from psguard.dependencies import install_hint
from psguard.errors import ConfigError
from psguard.storage.base import Backend
from psguard.storage.retry import RetryConfig, RetryingBackend

# scheme -> (module, class, pip requirement that provides the client library or None)
_REGISTRY: dict[str, tuple[str, str, str | None]] = {
    "file": ("psguard.storage.local", "LocalBackend", None),
    "memory": ("psguard.storage.memory", "MemoryBackend", None),
    "s3": ("psguard.storage.s3", "S3Backend", "s3fs"),
    "gs": ("psguard.storage.gcs", "GcsBackend", "gcsfs"),
    "hdfs": ("psguard.storage.hdfs", "HdfsBackend", "hdfs-native"),
    "webhdfs": ("psguard.storage.hdfs", "WebHdfsBackend", None),
}


def register_backend(scheme: str, module: str, cls: str, requirement: str | None = None) -> None:
    """Add or replace a backend (for plugins and tests that inject faults by subclassing one)."""
    _REGISTRY[scheme] = (module, cls, requirement)


_USERINFO = re.compile(r"""(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<userinfo>[^\s@'"]*)@""")


def redact(url: str) -> str:
    """``url``, or any text quoting URLs, with every ``scheme://userinfo@`` shown as ``scheme://***@``: the one
    form of a URL that is logged, put in an error or in ``/status``. The user info may hold a raw ``/`` (AWS secret
    keys do), so everything up to an ``@`` before the next space or quote counts: erring towards hiding."""
    return _USERINFO.sub(lambda m: f"{m['scheme']}***@", url)


# Schemes that, written with one slash (``s3:/bucket/x``), are a typo for a URL rather than a local folder name.
_URL_LOOKALIKES = ("gcs", "az", "abfs", "abfss", "http", "https", "viewfs")


def split_url(url: str) -> tuple[str, str]:
    """Return (scheme, rest); a plain path is ``file``.

    ``s3:/bucket/x`` or ``s3:bucket/x`` (a URL missing a slash) is refused with :class:`ConfigError`: taken as a
    path it would create a local folder named ``s3:`` and every checkpoint would land on the local disk.
    """
    if "://" not in url:
        head = url.split("/", 1)[0]
        scheme = head[:-1].lower() if head.endswith(":") else head.split(":", 1)[0].lower() if ":" in head else ""
        if scheme and (scheme in _REGISTRY or scheme in _URL_LOOKALIKES):
            rest = url.split(":", 1)[1].lstrip("/")
            rest = "/" + rest if scheme == "file" else rest
            raise ConfigError(
                f"storage URL {url!r} is missing a slash: write {scheme}://{rest} (for a local folder whose name "
                f"starts with '{scheme}:', write ./{url} or file://...)"
            )
        return "file", url
    parts = urlsplit(url)
    return parts.scheme.lower(), url.split("://", 1)[1]


def canonical_url(url: str) -> str:
    """``url`` in one spelling per store, to tell whether two URLs name the same one: local paths absolute and
    resolved (``file://`` dropped), others with the scheme in lower case and no trailing slash."""
    scheme, rest = split_url(url)
    return os.path.realpath(os.path.expanduser(rest)) if scheme == "file" else f"{scheme}://{rest.rstrip('/')}"


def _entry(url: str) -> tuple[str, str, str, str | None]:
    """``url``'s scheme with its backend's module, class and client requirement; refused when unknown."""
    if not url:
        raise ConfigError("empty storage URL; give a path, file://, memory://, s3://, gs://, hdfs:// or webhdfs:// URL")
    scheme, _ = split_url(url)
    if scheme not in _REGISTRY:
        known = ", ".join(sorted(_REGISTRY))
        raise ConfigError(f"unknown storage scheme {scheme!r} in {redact(url)!r}; psguard knows: {known}")
    return (scheme, *_REGISTRY[scheme])


def check_url(url: str) -> None:
    """Refuse what :func:`open_backend` would refuse before it imports anything: an unknown scheme, a URL missing
    a slash, a client package not installed. For an open put off until later (a PS agent's, which makes way for
    the restore on a replaced node: store/opening.py), so that such a mistake still fails the start."""
    scheme, _, _, requirement = _entry(url)
    if requirement is not None and importlib.util.find_spec(requirement.replace("-", "_")) is None:
        raise ConfigError(f"storage scheme {scheme!r} needs a package that is not installed: pip install {requirement}")


def open_backend(
    url: str, storage_options: Mapping[str, Any] | None = None, *, retry: RetryConfig | None = None
) -> Backend:
    """Open the backend for ``url``, wrapped with retries (``retry=RetryConfig(deadline=0)`` disables them)."""
    scheme, module_name, cls_name, requirement = _entry(url)
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        hint = install_hint(e) or (f"pip install {requirement}" if requirement else "reinstall psguard")
        raise ConfigError(f"storage scheme {scheme!r} needs a package that is not installed ({e.name}): {hint}") from e
    return RetryingBackend(getattr(module, cls_name)(url, dict(storage_options or {})), retry or RetryConfig())
