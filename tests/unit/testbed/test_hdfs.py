"""The HDFS testbed against a real NameNode + DataNode, through both clients psguard may use.

These tests also pin down the HDFS semantics the storage layer builds on (create-then-rename-no-overwrite,
what each client raises), so a client upgrade that changes them fails here first.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from psguard.testbed import hdfs
from psguard.testbed.hadoop_runtime import HdfsError
from psguard.testbed.hdfs import HdfsCluster
from tests.support.processes import allow_new_children, pids_mentioning

pytest.importorskip("hdfs_native")
requests = pytest.importorskip("requests")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _no_daemons_left(cluster: HdfsCluster, pids: dict[str, int]) -> None:
    assert pids and not cluster.pids
    assert not [p for p in pids.values() if _alive(p)]
    assert pids_mentioning(str(cluster.work_dir)) == []


@pytest.fixture(scope="module")
def cluster() -> Iterator[HdfsCluster]:
    with allow_new_children():
        c = HdfsCluster()
        c.start()
    try:
        yield c
    finally:
        c.close()


@pytest.fixture
def base() -> str:
    """A fresh folder per test, so tests sharing the module's cluster cannot see each other's files."""
    return f"/t/{uuid.uuid4().hex[:12]}"


# ---- no cluster needed ---------------------------------------------------------------------------------------


def test_every_listener_is_on_loopback(tmp_path: Path) -> None:
    ports = {"rpc": 1, "http": 2, "dn": 3, "dn_http": 4, "dn_ipc": 5}
    conf = hdfs._hadoop_config(tmp_path, ports)["hdfs-site.xml"]
    addresses = {k: v for k, v in conf.items() if k.endswith(("address", "-address", ".address"))}
    assert len(addresses) >= 9
    assert all(v.startswith("127.0.0.1:") for v in addresses.values()), addresses
    assert conf["dfs.datanode.hostname"] == "127.0.0.1"


# ---- real cluster --------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_addresses(cluster: HdfsCluster) -> None:
    assert cluster.running
    assert cluster.url("/a/b") == f"hdfs://127.0.0.1:{cluster.rpc_port}/a/b"
    assert cluster.webhdfs_url("a/b") == f"webhdfs://127.0.0.1:{cluster.http_port}/a/b"
    state = cluster.jmx("Hadoop:service=NameNode,name=FSNamesystemState")
    assert state["NumLiveDataNodes"] == 1 and state["FSState"] == "Operational"


@pytest.mark.slow
@pytest.mark.parametrize("client", ["hdfs", "webhdfs"])
def test_write_read_list_delete(cluster: HdfsCluster, base: str, client: str) -> None:
    fs = cluster.fsspec_hdfs() if client == "hdfs" else cluster.fsspec_webhdfs()
    payload = os.urandom(3 << 20)
    fs.pipe_file(f"{base}/a.bin", payload)
    fs.pipe_file(f"{base}/b.bin", b"0123456789")
    assert fs.cat_file(f"{base}/a.bin") == payload
    assert fs.cat_file(f"{base}/a.bin", start=1 << 20, end=(1 << 20) + 100) == payload[1 << 20 : (1 << 20) + 100]
    assert fs.cat_file(f"{base}/b.bin", start=2, end=5) == b"234"
    assert sorted(p.rsplit("/", 1)[1] for p in fs.ls(base, detail=False)) == ["a.bin", "b.bin"]
    assert fs.info(f"{base}/a.bin")["size"] == len(payload)
    fs.rm(f"{base}/a.bin")
    assert not fs.exists(f"{base}/a.bin")
    with pytest.raises(FileNotFoundError):
        fs.cat_file(f"{base}/a.bin")


@pytest.mark.slow
def test_clients_see_each_others_files(cluster: HdfsCluster, base: str) -> None:
    native, web = cluster.fsspec_hdfs(), cluster.fsspec_webhdfs()
    native.pipe_file(f"{base}/from-native", b"n")
    web.pipe_file(f"{base}/from-web", b"w")
    assert web.cat_file(f"{base}/from-native") == b"n"
    assert native.cat_file(f"{base}/from-web") == b"w"
    assert web.info(f"{base}/from-native")["owner"] == native.info(f"{base}/from-web")["owner"] == cluster.user


@pytest.mark.slow
def test_hdfs_native_atomic_create(cluster: HdfsCluster, base: str) -> None:
    """Write under a temporary name, then rename without overwrite: the final name appears complete or not at all."""
    fs = cluster.fsspec_hdfs()
    fs.pipe_file(f"{base}/final", b"first")

    # A file is visible while it is being written: that is why a direct create is not enough.
    writer = fs.open(f"{base}/in-progress", "wb")
    writer.write(b"partial")
    assert fs.exists(f"{base}/in-progress")
    writer.close()

    fs.pipe_file(f"{base}/tmp", b"second")
    with pytest.raises(FileExistsError, match="already exists"):
        fs.mv(f"{base}/tmp", f"{base}/final")  # hdfs-native's mv is rename2 with overwrite=False
    with pytest.raises(FileExistsError, match="already exists"):
        fs.client.rename(f"{base}/tmp", f"{base}/final", False)
    assert fs.cat_file(f"{base}/final") == b"first"
    assert fs.cat_file(f"{base}/tmp") == b"second"

    fs.mv(f"{base}/tmp", f"{base}/new")
    assert fs.cat_file(f"{base}/new") == b"second" and not fs.exists(f"{base}/tmp")

    # Unlike POSIX rename(2), an existing *directory* is not a place to move into either.
    fs.mkdir(f"{base}/dir")
    fs.pipe_file(f"{base}/tmp2", b"x")
    with pytest.raises(RuntimeError, match="must both be directories"):
        fs.mv(f"{base}/tmp2", f"{base}/dir")
    with pytest.raises(FileNotFoundError):
        fs.mv(f"{base}/tmp2", f"{base}/missing-parent/x")
    # create(overwrite=False) is also exclusive, but the half-written file would be visible under its name.
    with pytest.raises(FileExistsError):
        fs.open(f"{base}/final", "wb", overwrite=False)


@pytest.mark.slow
def test_webhdfs_rename_no_overwrite(cluster: HdfsCluster, base: str) -> None:
    """fsspec's WebHDFS ``mv`` ignores RENAME's ``{"boolean": false}``; ``renameoptions=NONE`` makes it fail."""
    fs = cluster.fsspec_webhdfs()
    fs.pipe_file(f"{base}/final", b"first")
    fs.pipe_file(f"{base}/tmp", b"second")

    fs.mv(f"{base}/tmp", f"{base}/final")  # silently did nothing
    assert fs.cat_file(f"{base}/final") == b"first" and fs.exists(f"{base}/tmp")
    plain = fs._call("RENAME", method="put", path=f"{base}/tmp", destination=f"{base}/final")
    assert plain.json() == {"boolean": False}

    def rename2(src: str, dst: str) -> Any:
        return fs._call("RENAME", method="put", path=src, destination=dst, renameoptions="NONE")

    with pytest.raises(RuntimeError, match="already exists"):
        rename2(f"{base}/tmp", f"{base}/final")
    raw = fs.session.put(
        f"http://{cluster.host}:{cluster.http_port}/webhdfs/v1{base}/tmp",
        params={"op": "RENAME", "destination": f"{base}/final", "renameoptions": "NONE", "user.name": cluster.user},
    )
    assert raw.status_code == 403
    assert raw.json()["RemoteException"]["exception"] == "FileAlreadyExistsException"

    rename2(f"{base}/tmp", f"{base}/new")
    assert fs.cat_file(f"{base}/new") == b"second" and not fs.exists(f"{base}/tmp")


@pytest.mark.slow
def test_webhdfs_redirects_to_loopback_datanode(cluster: HdfsCluster, base: str) -> None:
    fs = cluster.fsspec_webhdfs()
    fs.pipe_file(f"{base}/f", b"x")
    for op, method in (("OPEN", "get"), ("CREATE", "put")):
        resp = fs._call(op, method=method, path=f"{base}/f", redirect=False)
        assert resp.headers["Location"].startswith(f"http://127.0.0.1:{cluster.datanode_http_port}/"), op


@pytest.mark.slow
def test_restart_keeps_data_and_ports(cluster: HdfsCluster, base: str) -> None:
    native, web = cluster.fsspec_hdfs(), cluster.fsspec_webhdfs()
    native.pipe_file(f"{base}/kept", b"survives")
    ports = (cluster.rpc_port, cluster.http_port)
    old_pids = cluster.pids
    with allow_new_children():  # the module's cluster lives on in new processes
        cluster.restart()
    assert (cluster.rpc_port, cluster.http_port) == ports
    assert set(cluster.pids.values()).isdisjoint(old_pids.values())
    assert not [p for p in old_pids.values() if _alive(p)]
    # Clients made before the outage reconnect by themselves.
    assert native.cat_file(f"{base}/kept") == b"survives"
    assert web.cat_file(f"{base}/kept") == b"survives"
    native.pipe_file(f"{base}/after", b"ok")


@pytest.mark.slow
def test_stop_leaves_no_process_and_clients_fail_fast(cluster: HdfsCluster, base: str) -> None:
    native, web = cluster.fsspec_hdfs(), cluster.fsspec_webhdfs(timeout=5)
    native.pipe_file(f"{base}/x", b"x")
    pids = cluster.pids
    cluster.stop()
    try:
        _no_daemons_left(cluster, pids)
        assert not cluster.running
        t0 = time.monotonic()
        # hdfs-native raises a bare OSError (no errno); requests' ConnectionError is an OSError too.
        with pytest.raises(OSError, match="Connection refused"):
            native.ls(base)
        with pytest.raises(requests.ConnectionError):
            web.ls(base)
        assert time.monotonic() - t0 < 5
    finally:
        with allow_new_children():
            cluster.start()
    assert native.cat_file(f"{base}/x") == b"x"


@pytest.mark.slow
def test_context_manager_cleans_up() -> None:
    with HdfsCluster() as c:
        pids = c.pids
        work_dir = c.work_dir
        assert set(pids) == {"namenode", "datanode"} and all(_alive(p) for p in pids.values())
    _no_daemons_left(c, pids)
    assert not work_dir.exists()


@pytest.mark.slow
def test_failed_start_reports_logs_and_leaves_nothing(tmp_path: Path) -> None:
    c = HdfsCluster(tmp_path / "w", extra_config={"dfs.namenode.handler.count": "many"}, start_timeout=60)
    with pytest.raises(HdfsError, match=r"(?s)namenode exited.*tail of .*namenode\.log"):
        c.start()
    assert not c.pids
    assert pids_mentioning(str(c.work_dir)) == []
    c.close()
