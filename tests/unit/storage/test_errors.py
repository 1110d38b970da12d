"""Storage client failures as users meet them setting up (no credentials, an endpoint that does not answer, a bad
bucket), each as one line that says what to do; retries say that they are retrying. No server needed."""

from __future__ import annotations

import logging
import os
import threading
import time

import pytest
from botocore.exceptions import ClientError

from psguard import cli
from psguard.errors import ConfigError, ObjectNotFoundError, StorageError, StorageUnavailableError
from psguard.storage import RetryConfig, open_backend
from psguard.storage.base import Backend
from psguard.storage.retry import RetryingBackend
from psguard.storage.s3 import explain_s3_error

CLOSED = "http://127.0.0.1:9"  # the discard port: nothing listens there


@pytest.fixture
def no_aws(monkeypatch: pytest.MonkeyPatch) -> None:
    """No credentials anywhere the AWS chain looks (environment, files, instance metadata)."""
    for key in list(os.environ):
        if key.startswith("AWS_"):
            monkeypatch.delenv(key)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


def test_no_credentials_is_one_line_naming_the_fix(no_aws: None, capsys: pytest.CaptureFixture[str]) -> None:
    backend = open_backend("s3://bucket/job", {"endpoint_url": CLOSED}, retry=RetryConfig(deadline=1))
    with pytest.raises(StorageError) as info:
        backend.put("k", b"x")
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("put 'k' on s3://bucket/job failed: no usable S3 credentials (NoCredentialsError)")
    assert "AWS_ACCESS_KEY_ID" in message
    # the same through the CLI: exit 1, one line
    assert cli.main(["ls", "s3://bucket/job", "-o", f"endpoint_url={CLOSED}"]) == cli.EXIT_ERROR
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("psguard: error: ") and "no usable S3 credentials" in err[0]


@pytest.mark.serial  # it judges how long the retries take
def test_an_unreachable_endpoint_retries_saying_so_then_fails_in_one_line(
    no_aws: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAEXAMPLEKEYID0000")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-a-real-secret-but-never-logged")
    backend = open_backend("s3://bucket/job", {"endpoint_url": CLOSED}, retry=RetryConfig(deadline=4))
    with (
        caplog.at_level(logging.WARNING, logger="psguard.storage.retry"),
        pytest.raises(StorageUnavailableError) as info,
    ):
        backend.get("manifests/1")
    message = str(info.value)
    assert "\n" not in message and f"cannot connect to the S3 endpoint {CLOSED}" in message
    assert "check endpoint_url / AWS_ENDPOINT_URL" in message
    retries = [r.getMessage() for r in caplog.records if "event=storage_retry" in r.getMessage()]
    assert retries and all("\n" not in r for r in retries)
    assert "op=get key=manifests/1 url=s3://bucket/job attempt=1 " in retries[0] and "deadline_left=" in retries[0]
    assert "not-a-real-secret" not in caplog.text and "AKIAEXAMPLEKEYID0000" not in caplog.text + message


def test_a_bad_bucket_name_is_refused_when_the_store_is_opened(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ConfigError, match=r"'Bad_Bucket!' is not a bucket name"):
        open_backend("s3://Bad_Bucket!/job")
    assert cli.main(["ls", "s3://ab/job"]) == cli.EXIT_USAGE
    assert "'ab' is not a bucket name" in capsys.readouterr().err


def client_error(code: str, status: int) -> ClientError:
    return ClientError(
        {
            "Error": {"Code": code, "Message": "echoes AKIAEXAMPLEKEYID0000"},
            "ResponseMetadata": {"HTTPStatusCode": status},
        },
        "PutObject",
    )


@pytest.mark.parametrize(
    ("code", "status", "says"),
    [
        ("NoSuchBucket", 404, "bucket 'bucket' does not exist on the S3 endpoint http://s3.local: create it"),
        ("AccessDenied", 403, "access denied to s3://bucket (AccessDenied): the credentials in use lack permission"),
        ("InvalidAccessKeyId", 403, "rejected the credentials (InvalidAccessKeyId): set AWS_ACCESS_KEY_ID"),
        ("SignatureDoesNotMatch", 403, "rejected the credentials (SignatureDoesNotMatch)"),
    ],
)
def test_server_answers_are_explained_from_their_codes_never_their_text(code: str, status: int, says: str) -> None:
    try:
        raise PermissionError("s3fs's translation") from client_error(code, status)
    except PermissionError as e:
        text = explain_s3_error(e, "s3://bucket/job", "http://s3.local")
    assert text is not None and says in text and "AKIA" not in text


class Failing(Backend):
    """A backend whose every call raises ``error``."""

    url = "memory://failing"

    def __init__(self, error: Exception) -> None:
        self.error = error

    def get(self, key: str) -> bytes:
        raise self.error

    def put(self, key: str, data: object) -> None:  # type: ignore[override]
        raise self.error

    def put_new(self, key: str, data: object) -> None:  # type: ignore[override]
        raise self.error

    def exists(self, key: str) -> bool:
        raise self.error

    def keys(self, prefix: str) -> list[str]:
        raise self.error

    def delete(self, key: str) -> None:
        raise self.error


def test_client_failures_become_storage_errors_and_bugs_stay_themselves() -> None:
    missing = RetryingBackend(Failing(FileNotFoundError(2, "No such bucket")), RetryConfig(deadline=0))
    with pytest.raises(ObjectNotFoundError, match=r"^get 'k' on memory://failing failed: FileNotFoundError"):
        missing.get("k")
    denied = RetryingBackend(Failing(PermissionError(13, "denied")), RetryConfig(deadline=0))
    with pytest.raises(StorageError, match="PermissionError"):
        denied.put("k", b"x")
    bug = RetryingBackend(Failing(TypeError("a bug")), RetryConfig(deadline=0))
    with pytest.raises(TypeError, match="a bug"):
        bug.keys("")


class DownUntil(Failing):
    """A store that is down (connection refused) until ``up`` is set; ``failed`` is set at its second failure."""

    def __init__(self) -> None:
        super().__init__(ConnectionRefusedError(111, "Connection refused"))
        self.up = threading.Event()
        self.failures = 0
        self.failed = threading.Event()

    def get(self, key: str) -> bytes:
        if self.up.is_set():
            return b"value"
        self.failures += 1
        if self.failures >= 2:
            self.failed.set()
        raise self.error


def test_a_call_being_retried_is_shown_from_its_first_failure_until_it_ends() -> None:
    """The trainer's durable hold ends when the store is down: it must learn so at the first failure, not after
    the retry deadline (an S3 outage held training for the whole deadline)."""
    inner = DownUntil()
    backend = RetryingBackend(inner, RetryConfig(deadline=60, initial_backoff=0.01, max_backoff=0.05))
    assert backend.retrying() is None
    result: list[bytes] = []
    caller = threading.Thread(target=lambda: result.append(backend.get("k")))
    before = time.monotonic()
    caller.start()
    assert inner.failed.wait(10)
    retrying = backend.retrying()
    assert retrying is not None and "Connection refused" in retrying.error
    assert before <= retrying.since <= time.monotonic() and retrying.seconds >= 0
    inner.up.set()
    caller.join(10)
    assert result == [b"value"] and backend.retrying() is None


def test_a_call_that_gives_up_is_no_longer_shown_as_retrying() -> None:
    backend = RetryingBackend(DownUntil(), RetryConfig(deadline=0.05, initial_backoff=0.01, max_backoff=0.01))
    with pytest.raises(StorageUnavailableError):
        backend.get("k")
    assert backend.retrying() is None
