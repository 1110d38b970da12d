"""S3 backend (s3fs). Credentials and endpoint come from storage options, the URL's ``KEY:SECRET@`` part
(moved into the options at once), or the standard AWS chain (environment, ``~/.aws``, instance metadata):
psguard never logs them.

S3 has no atomic rename, so the create-only commit is a conditional PUT (``If-None-Match: *``): the server
refuses to overwrite, and a PUT is atomic, so a reader never sees a torn manifest.
"""

from __future__ import annotations

import os
import re
from typing import Any
from urllib.parse import unquote

import s3fs

from psguard.storage.base import causes
from psguard.storage.fsspec_backend import FsspecBackend, bucket_root

# Bounded client timeouts: psguard's own retry layer (with a deadline) decides how long to keep trying.
_DEFAULT_CONFIG = {"connect_timeout": 5, "read_timeout": 60, "retries": {"max_attempts": 2, "mode": "standard"}}


_BUCKET = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{1,61}[A-Za-z0-9]")
_CREDENTIALS_HINT = (
    "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, AWS_PROFILE with ~/.aws, an instance or pod role, or pass "
    "key/secret storage options"
)


def explain_s3_error(error: BaseException, url: str, endpoint: str | None) -> str | None:
    """One line for the S3 client failures users meet when setting up (credentials, endpoint, bucket), with the
    fix; ``None`` for anything else. Built from error codes and class names, never from what the server echoed
    (which may quote an access key id)."""
    bucket = url.split("://", 1)[1].split("/", 1)[0]
    where = f"the S3 endpoint {endpoint}" if endpoint else "AWS S3 (no endpoint_url or AWS_ENDPOINT_URL set)"
    for e in causes(error):
        name = type(e).__name__
        if name in ("NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError"):
            return f"no usable S3 credentials ({name}): {_CREDENTIALS_HINT}"
        if name in ("EndpointConnectionError", "ConnectTimeoutError", "ClientConnectorError", "ProxyConnectionError"):
            return f"cannot connect to {where} ({name}): check endpoint_url / AWS_ENDPOINT_URL"
        if name == "ParamValidationError" and "bucket" in str(e).lower():
            return f"invalid S3 bucket name {bucket!r}: use 3-63 lower-case letters, digits, dots and hyphens"
        response = getattr(e, "response", None)
        if isinstance(response, dict):
            code = str(response.get("Error", {}).get("Code", ""))
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if code == "NoSuchBucket":
                return f"bucket {bucket!r} does not exist on {where}: create it, or fix the bucket in the URL"
            if code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken"):
                return f"{where} rejected the credentials ({code}): {_CREDENTIALS_HINT}"
            if code in ("AccessDenied", "AllAccessDisabled") or status == 403:
                return (
                    f"access denied to s3://{bucket} ({code or 403}): the credentials in use lack permission "
                    "for this bucket and prefix (s3:GetObject, PutObject, ListBucket, DeleteObject)"
                )
            if code == "InvalidBucketName":
                return f"invalid S3 bucket name {bucket!r}: use 3-63 lower-case letters, digits, dots and hyphens"
    return None


def _drop_expect(request: Any, **_: Any) -> None:
    request.headers.pop("Expect", None)


def _session_without_expect() -> Any:
    """An aiobotocore session whose PUTs send no ``Expect: 100-continue``: aiohttp waits for the interim answer
    with no timeout, so a frozen server hung a PUT whatever ``read_timeout`` said."""
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
        self.root = bucket_root(url, rest, "S3", _BUCKET, "3-63 letters, digits, dots and hyphens")
        self.url = f"s3://{self.root}"
        client = opts.get("client_kwargs") or {}
        self._endpoint = opts.get("endpoint_url") or client.get("endpoint_url") or os.environ.get("AWS_ENDPOINT_URL")
        config = {**_DEFAULT_CONFIG, **(opts.pop("config_kwargs", {}) or {})}
        if "session" not in opts:
            opts["session"] = _session_without_expect()
        self.fs = s3fs.S3FileSystem(skip_instance_cache=True, use_listings_cache=False, config_kwargs=config, **opts)

    def _exists_error(self, e: BaseException) -> bool:
        """s3fs turns the server's 412 into a bare ``OSError(EINVAL)``; look through the chain for the cause."""
        for cause in causes(e):
            if isinstance(cause, FileExistsError):
                return True
            response = getattr(cause, "response", None)
            if isinstance(response, dict):
                err = response.get("Error", {})
                status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
                if err.get("Code") in ("PreconditionFailed", "ConditionalRequestConflict") or status == 412:
                    return True
            text = str(cause).lower()
            if "precondition" in text or "pre-condition" in text:
                return True
        return False

    def explain(self, error: BaseException) -> str | None:
        return explain_s3_error(error, self.url, self._endpoint)

    def close(self) -> None:
        self.fs.clear_instance_cache()
