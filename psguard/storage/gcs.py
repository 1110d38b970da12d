"""Google Cloud Storage backend (gcsfs): ``gs://bucket/prefix``.

Credentials come from Google's standard chain (Application Default Credentials) or the ``token`` storage option;
psguard never logs them. An emulator is reached through ``STORAGE_EMULATOR_HOST`` (then without credentials unless
a ``token`` is given) or the ``endpoint_url`` storage option.

Uploads are atomic, and the create-only commit is ``ifGenerationMatch=0`` sent in a single request, so the
precondition is checked before any byte is stored. psguard's retry layer has the deadline, so this backend makes
one try per call, bounded by ``connect_timeout`` (5 s) and ``read_timeout`` (60 s). The client is gcsfs's plain
JSON-API filesystem: the default one first asks the Storage Control gRPC API about each bucket, which emulators do
not answer. Zonal (Rapid) buckets are not supported.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
from typing import Any

import aiohttp
import fsspec.asyn
from gcsfs.core import GCSFileSystem

from psguard.errors import ConfigError
from psguard.storage.base import Buffer, causes
from psguard.storage.fsspec_backend import FsspecBackend, bucket_root
from psguard.storage.registry import redact
from psguard.storage.retry import http_status

BUCKET_NAME = re.compile(r"[a-z0-9][a-z0-9._-]{1,220}[a-z0-9]")
EMULATOR_ENV = "STORAGE_EMULATOR_HOST"
_CREDENTIALS_HINT = (
    "set GOOGLE_APPLICATION_CREDENTIALS to a service account key file, run `gcloud auth application-default "
    "login`, use a GKE workload identity or the VM's service account, or pass the token storage option"
)
_ONE_TRY = GCSFileSystem._request.__wrapped__  # gcsfs's request without its retry decorator


class _Client(GCSFileSystem):  # type: ignore[misc]
    """gcsfs's filesystem making one try per request, with its refusals in the forms psguard's retry layer reads:
    gcsfs raises a 403 as a bare ``OSError`` and a 400 as ``ValueError``, which would read as "retry" and as a
    bug."""

    async def _request(self, method: str, path: str, *args: Any, **kwargs: Any) -> Any:
        try:
            return await _ONE_TRY(self, method, path, *args, **kwargs)
        except ValueError as e:  # "Bad Request: <path>\n<the server's message>"
            raise OSError(errno.EINVAL, " ".join(str(e).split())) from e
        except OSError as e:
            if e.errno is None and str(e).startswith("Forbidden"):
                raise PermissionError(errno.EACCES, " ".join(str(e).split())) from e
            raise


def emulator_endpoint(options: dict[str, Any]) -> str | None:
    """The emulator or private endpoint the options or ``STORAGE_EMULATOR_HOST`` name; None for Google's own."""
    endpoint = options.get("endpoint_url") or os.environ.get(EMULATOR_ENV, "")
    return None if endpoint in ("", "default") else str(endpoint)


def default_token(options: dict[str, Any]) -> str | None:
    """The credentials to use when the options name none: anonymous for an emulator named by
    ``STORAGE_EMULATOR_HOST`` (Google's client does the same), else Application Default Credentials. ``None`` when
    the options have a ``token``."""
    if "token" in options:
        return None
    if not options.get("endpoint_url") and os.environ.get(EMULATOR_ENV, "") not in ("", "default"):
        return "anon"
    return "google_default"


def explain_gcs_error(error: BaseException, url: str, endpoint: str | None) -> str | None:
    """One line for the GCS client failures users meet when setting up (credentials, endpoint, permissions), with
    the fix; ``None`` for anything else."""
    bucket = url.split("://", 1)[1].split("/", 1)[0]
    where = f"the GCS endpoint {endpoint}" if endpoint else f"GCS (no endpoint_url or {EMULATOR_ENV} set)"
    for e in causes(error):
        name = type(e).__name__
        if name == "TransportError" and type(e).__module__.startswith("google.auth"):
            return (
                f"could not get an access token for the credentials in use ({name}): the token endpoint or the "
                "metadata server did not answer"
            )
        if name in ("DefaultCredentialsError", "RefreshError") or http_status(e) == 401:
            return f"{where} did not accept the credentials ({name}): {_CREDENTIALS_HINT}"
        if isinstance(e, PermissionError) or http_status(e) == 403:
            return (
                f"access denied to gs://{bucket} (403): the credentials in use lack permission for this bucket and "
                "prefix (storage.objects.get, create, list and delete)"
            )
        if name in ("ClientConnectorError", "ServerTimeoutError", "ConnectionTimeoutError", "SocketTimeoutError"):
            return f"cannot connect to {where} ({name}): check endpoint_url / {EMULATOR_ENV}"
    return None


class GcsBackend(FsspecBackend):
    def __init__(self, url: str, options: dict[str, Any] | None = None) -> None:
        rest = url.split("://", 1)[1]
        if "@" in rest.split("/", 1)[0]:
            raise ConfigError(f"GCS URL {redact(url)!r} carries credentials; gs:// takes none: {_CREDENTIALS_HINT}")
        rule = "3-63 lower-case letters, digits, dots, hyphens and underscores"
        self.root = bucket_root(url, rest, "GCS", BUCKET_NAME, rule)
        self.url = f"gs://{self.root}"
        opts = dict(options or {})
        opts.setdefault("token", default_token(opts))  # None only when the options name one
        self._endpoint = emulator_endpoint(opts)
        timeout = aiohttp.ClientTimeout(
            sock_connect=float(opts.pop("connect_timeout", 5)), sock_read=float(opts.pop("read_timeout", 60))
        )
        opts.setdefault("requests_timeout", timeout)
        try:
            self.fs = _Client(skip_instance_cache=True, use_listings_cache=False, **opts)
        except Exception as e:
            why = explain_gcs_error(e, self.url, self._endpoint)
            if why is None:
                raise
            raise ConfigError(f"cannot open {self.url}: {why}") from e

    def _write(self, key: str, data: Buffer, *, overwrite: bool) -> None:
        blob = bytes(data)  # create-only in one request: gcsfs's resumable upload learns of the 412 at its end
        self.fs.pipe_file(self._p(key), blob, **({} if overwrite else {"mode": "create", "chunksize": len(blob) + 1}))

    def explain(self, error: BaseException) -> str | None:
        return explain_gcs_error(error, self.url, self._endpoint)

    def close(self) -> None:
        session = self.fs._session
        if session is not None and not session.closed:
            with contextlib.suppress(Exception):
                fsspec.asyn.sync(self.fs.loop, session.close, timeout=5)
