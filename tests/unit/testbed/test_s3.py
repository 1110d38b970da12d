"""The local S3 servers of the test bed behave like S3 where psguard depends on it, and leave nothing behind.

These start real ``weed mini`` and ``moto_server`` processes (about 1 s each), hence ``slow``.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from psguard.ports import port_open
from psguard.testbed.s3 import GRPC_PORT_OFFSET, MotoS3, SeaweedS3, free_port_pairs
from psguard.testbed.s3_server import S3Server, S3ServerError
from tests.support.paths import ROOT
from tests.support.processes import group_members

s3fs = pytest.importorskip("s3fs")
botocore_exceptions = pytest.importorskip("botocore.exceptions")

SERVERS = [SeaweedS3, MotoS3]


def _fs(server: S3Server) -> Any:
    return s3fs.S3FileSystem(**server.storage_options, skip_instance_cache=True, use_listings_cache=False)


def _precondition_failed(e: BaseException) -> bool:
    """True when the exception (or one it was raised from) is S3's 412 PreconditionFailed.

    s3fs only turns a 412 into FileExistsError when the server names the failed condition (moto does,
    SeaweedFS does not: there it is an OSError(EINVAL)), so the cause chain is what to look at.
    """
    seen: BaseException | None = e
    while seen is not None:
        if isinstance(seen, botocore_exceptions.ClientError):
            status = seen.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            return bool(seen.response.get("Error", {}).get("Code") == "PreconditionFailed" or status == 412)
        seen = seen.__cause__ or seen.__context__
    return False


def _assert_gone(pid: int) -> None:
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert not Path(f"/proc/{pid}").exists()
    assert group_members(pid) == []


@pytest.fixture(scope="module", params=SERVERS, ids=lambda c: c.kind)
def server(request: pytest.FixtureRequest) -> Iterator[S3Server]:
    with request.param() as s:
        yield s


# -- cheap checks ----------------------------------------------------------------------------------------------


def test_free_port_pairs_leave_room_for_grpc() -> None:
    ports = free_port_pairs(5)
    assert len(set(ports)) == 5
    everything = set(ports) | {p + GRPC_PORT_OFFSET for p in ports}
    assert len(everything) == 10
    assert all(p + GRPC_PORT_OFFSET <= 65535 for p in ports)


# -- behaviour of both servers ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_interface_and_no_secret_leaks(server: S3Server) -> None:
    assert server.running
    assert server.endpoint_url == f"http://127.0.0.1:{server.port}"
    assert server.url("a/b") == f"s3://{server.bucket}/a/b"
    assert server.url() == f"s3://{server.bucket}"
    opts = server.storage_options
    assert opts["key"] == server.access_key and opts["secret"] == server.secret_key
    assert opts["endpoint_url"] == server.endpoint_url
    assert set(server.env) >= {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL", "AWS_DEFAULT_REGION"}
    assert server.secret_key not in repr(server)
    assert server.secret_key not in server.log_path.read_text(errors="replace")


@pytest.mark.slow
def test_put_get_list_delete_through_s3fs(server: S3Server) -> None:
    fs = _fs(server)
    base = server.url("rw")
    fs.pipe_file(f"{base}/a", b"alpha")
    fs.pipe({f"{base}/b": b"beta", f"{base}/c": b""})
    assert fs.cat_file(f"{base}/a") == b"alpha"
    assert fs.cat_file(f"{base}/b", start=1, end=3) == b"et"
    assert fs.cat_file(f"{base}/c") == b""
    assert sorted(p.rsplit("/", 1)[1] for p in fs.ls(base, detail=False)) == ["a", "b", "c"]
    fs.rm_file(f"{base}/a")
    assert not fs.exists(f"{base}/a")
    with pytest.raises(FileNotFoundError):
        fs.cat_file(f"{base}/a")


@pytest.mark.slow
def test_signatures_are_checked(server: S3Server) -> None:
    opts = dict(server.storage_options, secret="not-the-secret")
    fs = s3fs.S3FileSystem(**opts, skip_instance_cache=True, use_listings_cache=False)
    with pytest.raises(PermissionError):
        fs.pipe_file(server.url("forged"), b"x")
    import boto3

    forged = boto3.client(
        "s3",
        endpoint_url=server.endpoint_url,
        aws_access_key_id=server.access_key,
        aws_secret_access_key="wrong",
        region_name="us-east-1",
    )
    with pytest.raises(botocore_exceptions.ClientError) as info:
        forged.list_objects_v2(Bucket=server.bucket)
    assert info.value.response["Error"]["Code"] == "SignatureDoesNotMatch"


@pytest.mark.slow
def test_conditional_create(server: S3Server) -> None:
    fs = _fs(server)
    key = server.url("cond/manifest")
    fs.pipe_file(key, b"first", mode="create")
    with pytest.raises(OSError) as info:  # FileExistsError on moto, OSError(EINVAL) on SeaweedFS
        fs.pipe_file(key, b"second", mode="create")
    assert _precondition_failed(info.value)
    assert fs.cat_file(key) == b"first"

    c = server.client()
    c.put_object(Bucket=server.bucket, Key="cond/boto", Body=b"1", IfNoneMatch="*")
    with pytest.raises(botocore_exceptions.ClientError) as cinfo:
        c.put_object(Bucket=server.bucket, Key="cond/boto", Body=b"2", IfNoneMatch="*")
    assert cinfo.value.response["ResponseMetadata"]["HTTPStatusCode"] == 412
    assert cinfo.value.response["Error"]["Code"] == "PreconditionFailed"


@pytest.mark.slow
def test_multipart_through_pipe_file(server: S3Server) -> None:
    fs = _fs(server)
    data = os.urandom(1 << 20) * 12  # 12 MiB, 5 MiB parts: multipart starts at 2 * chunksize
    fs.pipe_file(server.url("mp/big"), data, chunksize=5 << 20)
    info = fs.info(server.url("mp/big"))
    assert info["size"] == len(data)
    assert info["ETag"].strip('"').endswith("-3")  # a multipart ETag names its part count
    assert fs.cat_file(server.url("mp/big")) == data
    with pytest.raises(OSError) as err:
        fs.pipe_file(server.url("mp/big"), data, chunksize=5 << 20, mode="create")
    assert _precondition_failed(err.value)


@pytest.mark.slow
def test_env_serves_the_standard_aws_chain(server: S3Server, monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in server.env.items():
        monkeypatch.setenv(k, v)
    import boto3

    # Nothing passed: endpoint, keys and region all from the environment. A new Session, because boto3's
    # default session keeps the credentials it found first (another server's, in this module).
    c = boto3.session.Session().client("s3")
    c.put_object(Bucket=server.bucket, Key="env/x", Body=b"via-env")
    fs = s3fs.S3FileSystem(skip_instance_cache=True, use_listings_cache=False)
    assert fs.cat_file(server.url("env/x")) == b"via-env"


# -- life cycle ------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_seaweed_restart_keeps_data_and_endpoint(tmp_path: Path) -> None:
    with SeaweedS3(tmp_path / "weed") as s:
        fs = _fs(s)
        fs.pipe_file(s.url("keep/a"), b"survives")
        endpoint, key, old_pid = s.endpoint_url, s.access_key, s.pid
        s.restart()
        assert (s.endpoint_url, s.access_key) == (endpoint, key)
        assert s.pid != old_pid
        assert fs.cat_file(s.url("keep/a")) == b"survives"  # the old client reconnects by itself
        s.kill()  # a crash, not a clean shutdown
        assert not port_open("127.0.0.1", s.port)
        s.start()
        assert _fs(s).cat_file(s.url("keep/a")) == b"survives"
        pid = s.pid
        assert pid is not None
        os.killpg(pid, signal.SIGKILL)  # dies behind our back (chaos); start() must reap and restart it
        deadline = time.monotonic() + 5
        while s.running and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not s.running
        s.start()
        assert s.running and _fs(s).cat_file(s.url("keep/a")) == b"survives"
        _assert_gone(pid)
    assert (tmp_path / "weed" / "data").is_dir()  # a given data dir is kept


@pytest.mark.slow
def test_moto_restart_keeps_keys_but_not_objects() -> None:
    with MotoS3() as s:
        fs = _fs(s)
        fs.pipe_file(s.url("gone/a"), b"x")
        endpoint, key, secret = s.endpoint_url, s.access_key, s.secret_key
        s.restart()
        assert (s.endpoint_url, s.access_key, s.secret_key) == (endpoint, key, secret)
        assert not fs.exists(s.url("gone/a"))
        fs.pipe_file(s.url("gone/b"), b"y")  # bucket re-created, same credentials still work


@pytest.mark.slow
@pytest.mark.parametrize("cls", SERVERS, ids=lambda c: c.kind)
def test_stop_leaves_no_process_port_or_socket(cls: type[S3Server]) -> None:
    s = cls()
    s.start()
    pid = s.pid
    assert pid is not None and group_members(pid)
    ports = list(s.ports.values()) if isinstance(s, SeaweedS3) else [s.port]
    workdir = s.workdir
    s.close()
    _assert_gone(pid)
    for p in ports:
        assert not port_open("127.0.0.1", p)
        if isinstance(s, SeaweedS3):
            assert not port_open("127.0.0.1", p + GRPC_PORT_OFFSET)
            assert not list(Path("/tmp").glob(f"seaweedfs-*-{p + GRPC_PORT_OFFSET}.sock"))
    assert not workdir.exists()  # a temporary working directory is removed by close()
    s.stop()  # idempotent


@pytest.mark.slow
def test_frozen_server_times_out_then_recovers() -> None:
    with MotoS3() as s:
        fs = s3fs.S3FileSystem(
            **s.storage_options,
            skip_instance_cache=True,
            use_listings_cache=False,
            config_kwargs={"connect_timeout": 1, "read_timeout": 1, "retries": {"max_attempts": 1, "mode": "standard"}},
        )
        fs.retries = 1  # s3fs retries read timeouts itself on top of botocore (5 times by default)
        fs.pipe_file(s.url("f/a"), b"x")
        s.freeze()
        t0 = time.monotonic()
        with pytest.raises(Exception, match=r"(?i)timeout|timed out"):
            fs.cat_file(s.url("f/a"))
        assert time.monotonic() - t0 < 30
        s.thaw()
        assert fs.cat_file(s.url("f/a")) == b"x"
        s.freeze()  # stop() must also end a frozen server
        pid = s.pid
        assert pid is not None
    _assert_gone(pid)


def _strip_expect(request: Any, **_: Any) -> None:
    request.headers.pop("Expect", None)


@pytest.mark.slow
def test_put_to_frozen_server_times_out_once_expect_is_stripped() -> None:
    """botocore sends ``Expect: 100-continue`` on every PUT and aiohttp waits for the interim response with
    no timeout at all, so a PUT to a frozen server hangs for ever whatever ``read_timeout`` says. Without
    the header the read timeout applies. (Pinned here because psguard's persister depends on it.)
    """
    with SeaweedS3() as s:
        fs = s3fs.S3FileSystem(
            **s.storage_options,
            skip_instance_cache=True,
            use_listings_cache=False,
            config_kwargs={"connect_timeout": 1, "read_timeout": 1, "retries": {"max_attempts": 1, "mode": "standard"}},
        )
        fs.retries = 1
        fs.connect()
        fs.s3.meta.events.register("before-send.s3", _strip_expect)
        fs.pipe_file(s.url("f/a"), b"x")
        s.freeze()
        t0 = time.monotonic()
        with pytest.raises(botocore_exceptions.ReadTimeoutError):
            fs.pipe_file(s.url("f/b"), b"y", mode="create")
        assert time.monotonic() - t0 < 20
        s.thaw()
        # The timed-out PUT was already in the server's socket: it may land after all. A retry of a
        # create-only write must therefore treat 412 as "maybe mine" and compare contents.
        try:
            fs.pipe_file(s.url("f/b"), b"y", mode="create")
        except OSError as e:
            assert _precondition_failed(e)
        assert fs.cat_file(s.url("f/b")) == b"y"


@pytest.mark.slow
def test_failed_start_reports_log_and_cleans_up() -> None:
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", 0))
        port = blocker.getsockname()[1]
        s = MotoS3(port=port, startup_timeout=20)
        with pytest.raises(S3ServerError, match="last lines of") as info:
            s.start()
        assert s.pid is None and not s.running
        assert "in use" in str(info.value).lower()
        assert s.secret_key == "" or s.secret_key not in str(info.value)
        s.close()


_ORPHAN_SCRIPT = textwrap.dedent(
    """
    import os, sys
    from psguard.testbed.s3 import MotoS3
    s = MotoS3().start()
    print(s.pid, s.workdir, flush=True)
    if sys.argv[1] == "crash":
        os._exit(0)  # no atexit: only the parent-death signal can stop the server
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["atexit", "crash"])
def test_servers_die_with_their_python_process(how: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A temporary folder of this test's own: any server started by a parallel test sweeps stale folders in
    # the shared /tmp, which would remove the crashed one before this test looks for it.
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    out = subprocess.run(
        [sys.executable, "-c", _ORPHAN_SCRIPT, how],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        cwd=ROOT,
        env={**os.environ, "TMPDIR": str(tmp_path)},
    )
    pid_text, workdir_text = out.stdout.split()
    pid, workdir = int(pid_text), Path(workdir_text)
    assert workdir.parent == tmp_path
    deadline = time.monotonic() + 10
    while group_members(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert group_members(pid) == []
    if how == "atexit":
        assert not workdir.exists()
    else:  # nothing ran in the crashed process; the next instance sweeps its directory away
        assert workdir.exists()
        MotoS3().close()
        assert not workdir.exists()
