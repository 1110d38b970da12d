"""Where checkpoint bytes live: a small key/value interface over local disk, memory, S3, GCS and HDFS.

Backends are chosen by URL scheme through a lazy registry: a backend's module and client library are imported only
when a URL with its scheme is opened, and a missing library fails with the command that installs it. Every backend
is wrapped in :class:`~psguard.storage.retry.RetryingBackend` (transient failures retried until a deadline).
"""

from __future__ import annotations

from psguard.storage.base import Backend, validate_key
from psguard.storage.registry import canonical_url, open_backend, redact, register_backend, split_url
from psguard.storage.retry import RetryConfig, RetryingBackend

__all__ = [
    "Backend",
    "RetryConfig",
    "RetryingBackend",
    "open_backend",
    "redact",
    "register_backend",
    "canonical_url",
    "split_url",
    "validate_key",
]
