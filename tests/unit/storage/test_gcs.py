"""The GCS backend: ``gs://`` URLs, credentials from Google's standard chain (never shown), one try per request
with psguard's retry layer deciding, refusals explained. The store's contract on GCS is tests/unit/store/test_suite.py
(backend ``gcs-fake-gcs-server``); outages, a frozen server and error answers are tests/unit/store/test_faults.py.

No test here lets google-auth look for a metadata server: the ones without an emulator name their credentials."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from psguard.chaos.http_faults import HttpErrorProxy
from psguard.errors import ConfigError, ObjectNotFoundError, StorageError, StorageUnavailableError
from psguard.storage import RetryConfig, open_backend
from psguard.storage.gcs import EMULATOR_ENV, GcsBackend, default_token
from psguard.storage.retry import RetryingBackend
from tests.support.paths import ROOT

CLOSED = "http://127.0.0.1:9"  # the discard port: nothing listens there


@pytest.fixture
def no_emulator(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(EMULATOR_ENV, raising=False)


def test_gs_urls_open_a_gcs_store(no_emulator: None) -> None:
    """``gs://`` was refused as a typo; it is a store now (and ``gs:/x``, a URL missing a slash, still refused)."""
    backend = open_backend("gs://my-bucket/jobs/a/", {"endpoint_url": CLOSED, "token": "anon"})
    try:
        assert isinstance(backend, RetryingBackend) and isinstance(backend.inner, GcsBackend)
        assert backend.url == "gs://my-bucket/jobs/a"
    finally:
        backend.close()
    with pytest.raises(ConfigError, match=r"missing a slash: write gs://bucket/job"):
        open_backend("gs:/bucket/job")


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("gs://", "names no bucket"),
        ("gs://Bad_Bucket/job", "'Bad_Bucket' is not a bucket name"),
        ("gs://ab/job", "'ab' is not a bucket name"),
        ("gs://key:secret@bucket/job", "carries credentials; gs:// takes none"),
    ],
)
def test_bad_gs_urls_are_refused_when_opened(url: str, says: str) -> None:
    with pytest.raises(ConfigError, match=says) as info:
        open_backend(url, {"endpoint_url": CLOSED, "token": "anon"})
    assert "secret" not in str(info.value)


def test_credentials_default_to_googles_chain_and_an_emulator_to_none(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(EMULATOR_ENV, raising=False)
    assert default_token({}) == "google_default"
    assert default_token({"endpoint_url": "https://storage.private.example"}) == "google_default"
    assert default_token({"token": "/keys/sa.json"}) is None  # the options' own
    monkeypatch.setenv(EMULATOR_ENV, "http://127.0.0.1:4443")
    assert default_token({}) == "anon"  # as google-cloud-storage's Client does for STORAGE_EMULATOR_HOST
    assert default_token({"token": "google_default"}) is None


def service_account_file(folder: Path) -> tuple[Path, str]:
    """A service account key file as Google issues them, with a fresh RSA key; its private key text."""
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    ).decode()
    info = {
        "type": "service_account",
        "project_id": "psguard-test",
        "private_key_id": "0123456789abcdef",
        "private_key": pem,
        "client_email": "trainer@psguard-test.iam.gserviceaccount.com",
        "client_id": "1234567890",
        "token_uri": "http://127.0.0.1:9/token",
    }
    path = folder / "sa.json"
    path.write_text(json.dumps(info))
    return path, pem


def test_application_default_credentials_are_used_and_never_shown(
    no_emulator: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, pem = service_account_file(tmp_path)
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(path))
    backend = open_backend("gs://bucket/job", {"endpoint_url": CLOSED}, retry=RetryConfig(deadline=0))
    try:
        inner = backend.inner  # type: ignore[attr-defined]
        credentials: Any = inner.fs.credentials.credentials
        assert credentials.service_account_email == "trainer@psguard-test.iam.gserviceaccount.com"
        secret = pem.splitlines()[5]
        assert secret not in repr(backend) + backend.url + repr(inner)
        with pytest.raises(StorageUnavailableError) as info:  # its token endpoint is closed: to try again later
            backend.get("k")
        message = str(info.value)
        assert "could not get an access token for the credentials in use (TransportError)" in message
        assert secret not in message
    finally:
        backend.close()


def test_no_usable_credentials_fail_the_open_naming_the_fix(
    no_emulator: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(tmp_path / "missing.json"))
    with pytest.raises(ConfigError) as info:
        open_backend("gs://bucket/job")
    message = str(info.value)
    assert "\n" not in message and message.startswith("cannot open gs://bucket/job: GCS (no endpoint_url or")
    assert "set GOOGLE_APPLICATION_CREDENTIALS to a service account key file" in message


@pytest.mark.serial  # it judges how long a failing call takes
def test_one_try_per_request_psguards_deadline_decides(no_emulator: None) -> None:
    """gcsfs retries a refused connection for about 30 s by itself; the backend leaves the retrying to psguard's
    layer, whose deadline (here none) decides, and says what failed."""
    backend = open_backend("gs://bucket/job", {"endpoint_url": CLOSED, "token": "anon"}, retry=RetryConfig(deadline=0))
    started = time.monotonic()
    try:
        with pytest.raises(StorageUnavailableError) as info:
            backend.get("manifests/1")
    finally:
        backend.close()
    assert time.monotonic() - started < 5
    assert f"cannot connect to the GCS endpoint {CLOSED}" in str(info.value)
    assert "check endpoint_url / STORAGE_EMULATOR_HOST" in str(info.value)


@pytest.mark.slow
def test_the_emulator_is_found_through_its_environment_variable(
    gcs: Any, unique: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``STORAGE_EMULATOR_HOST`` alone (no storage options) reaches the emulator, anonymously: how the chaos
    harness's agents and trainer find it."""
    monkeypatch.setenv(EMULATOR_ENV, gcs.endpoint_url)
    backend = open_backend(gcs.url(unique))
    try:
        backend.put("a/b", b"value")
        assert backend.get("a/b") == b"value" and backend.keys("a/") == ["a/b"]
        with pytest.raises(ObjectNotFoundError):
            backend.get("a/missing")
    finally:
        backend.close()


@pytest.mark.slow
def test_access_denied_fails_at_once_saying_so(gcs: Any, unique: str) -> None:
    """gcsfs raises a 403 as a bare OSError, which the retry layer would retry to its deadline."""
    with HttpErrorProxy(gcs.endpoint_url, dialect="gcs") as proxy:
        options = {**gcs.storage_options, "endpoint_url": proxy.endpoint_url}
        backend = open_backend(gcs.url(unique), options, retry=RetryConfig(deadline=30, initial_backoff=0.01))
        try:
            proxy.fail_next(1, status=403, code="forbidden")
            with pytest.raises(StorageError) as info:
                backend.put("a/b", b"value")
        finally:
            backend.close()
    assert not isinstance(info.value, StorageUnavailableError) and proxy.failed == 1
    assert f"access denied to gs://{gcs.bucket} (403)" in str(info.value)


@pytest.mark.slow
def test_the_cli_keeps_the_gcs_clients_request_dumps_out_of_debug_output(gcs: Any, unique: str) -> None:
    """gcsfs and google-auth log requests at DEBUG (with their headers): ``-vv`` shows psguard's DEBUG, not theirs."""
    options = ["-o", f"endpoint_url={gcs.endpoint_url}", "-o", "token=anon"]
    done = subprocess.run(
        [sys.executable, "-m", "psguard.cli", "-vv", "ls", gcs.url(unique), *options],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    debug = [line for line in done.stderr.splitlines() if " DEBUG " in line]
    assert not [line for line in debug if " gcsfs" in line or " google" in line], debug
