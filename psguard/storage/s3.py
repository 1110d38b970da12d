"""S3 backend (s3fs). Credentials and endpoint come from storage options, the URL's ``KEY:SECRET@`` part
(moved into the options at once), or the standard AWS chain (environment, ``~/.aws``, instance metadata):
psguard never logs them.

S3 has no atomic rename, so the create-only commit is a conditional PUT (``If-None-Match: *``): the server
refuses to overwrite, and a PUT is atomic, so a reader never sees a torn manifest.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import unquote

import s3fs

from psguard.errors import ConfigError, ObjectExistsError
from psguard.storage.base import Buffer
from psguard.storage.fsspec_backend import FsspecBackend
from psguard.storage.registry import redact

# Bounded client timeouts: psguard's own retry layer (with a deadline) decides how long to keep trying.
_DEFAULT_CONFIG = {
    "connect_timeout": 5,
    "read_timeout": 60,
    "retries": {"max_attempts": 2, "mode": "standard"},
}


def _is_precondition_failure(e: BaseException | None) -> bool:
    """s3fs turns the server's 412 into a bare ``OSError(EINVAL)``; look through the chain for the cause."""
    seen = 0
    while e is not None and seen < 10:
        if isinstance(e, FileExistsError):
            return True
        response = getattr(e, "response", None)
        if isinstance(response, dict):
            err = response.get("Error", {})
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if err.get("Code") in ("PreconditionFailed", "ConditionalRequestConflict") or status == 412:
                return True
        text = str(e).lower()
        if "precondition" in text or "pre-condition" in text:
            return True
        e = e.__cause__ or e.__context__
        seen += 1
    return False


def _drop_expect(request: Any, **_: Any) -> None:
    request.headers.pop("Expect", None)


def _session_without_expect() -> Any:
    """An aiobotocore session whose PUTs send no ``Expect: 100-continue``.

    botocore adds that header to every PUT and aiohttp then waits for the server's interim answer with no
    timeout: against a frozen server a PUT hung for over 17 minutes whatever ``read_timeout`` said. Without
    the header the body goes at once and ``read_timeout`` bounds the wait.
    """
    from aiobotocore.session import AioSession

    session = AioSession()
    session.register("before-send.s3", _drop_expect)
    return session


class S3Backend(FsspecBackend):
    def __init__(self, url: str, options: dict[str, Any] | None = None) -> None:
        rest = url.split("://", 1)[1]
        opts = dict(options or {})
        userinfo, at, location = rest.partition("@")
        if at and ":" in userinfo:
            # s3://KEY:SECRET@bucket/prefix (the secret may hold a raw '/'): the credentials become options and
            # leave the URL, so no path, log line or error message built from it can carry them.
            key, _, secret = userinfo.partition(":")
            opts.setdefault("key", unquote(key))
            opts.setdefault("secret", unquote(secret))
            rest = location
        rest = rest.strip("/")
        if not rest:
            raise ConfigError(f"S3 URL {redact(url)!r} names no bucket; use s3://bucket/prefix")
        self.root = rest
        self.url = f"s3://{rest}"
        config = dict(_DEFAULT_CONFIG)
        config.update(opts.pop("config_kwargs", {}) or {})
        if "session" not in opts:
            opts["session"] = _session_without_expect()
        self.fs = s3fs.S3FileSystem(skip_instance_cache=True, use_listings_cache=False, config_kwargs=config, **opts)

    def put(self, key: str, data: Buffer) -> None:
        self.fs.pipe_file(self._p(key), bytes(data))

    def put_new(self, key: str, data: Buffer) -> None:
        try:
            self.fs.pipe_file(self._p(key), bytes(data), mode="create")
        except Exception as e:
            if _is_precondition_failure(e):
                raise ObjectExistsError(f"{key} already exists in {self.url}; psguard never overwrites it") from e
            raise

    def close(self) -> None:
        self.fs.clear_instance_cache()
