"""Real local S3 servers (SeaweedFS and moto) for tests, benchmarks and chaos runs.

psguard's durable log relies on S3 behaviour that a mock in the client cannot vouch for: signature checks,
conditional PUTs (``If-None-Match: *``) as the commit, multipart uploads, and what a client sees while the
server is down. So these helpers start the real servers as child processes on free loopback ports:

- :class:`SeaweedS3` runs ``weed mini`` on a data directory, so objects survive :meth:`S3Server.restart`
  (an S3 outage, then recovery) and a ``kill -9``.
- :class:`MotoS3` runs ``moto_server`` in memory: AWS-exact error codes, but a restart loses every object.

Both are :class:`~psguard.testbed.s3_server.S3Server`: they check request signatures against credentials
generated here, create a bucket with boto3, and are torn down with everything they started (that module says
how). Secrets never reach a log, an exception message or a ``repr``.

Typical use::

    with SeaweedS3() as s3:
        fs = s3fs.S3FileSystem(**s3.storage_options, skip_instance_cache=True, use_listings_cache=False)
        fs.pipe_file(s3.url("ckpt/manifest"), b"...", mode="create")
        s3.restart()  # an outage; the object is still there afterwards
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import socket
import sys
import time
import urllib.request
from collections.abc import Mapping
from pathlib import Path

from psguard.ports import free_port, wait_port
from psguard.testbed.s3_server import (
    HOST,
    INSTALL,
    REGION,
    S3Server,
    S3ServerError,
    find_executable,
    log_tail,
    random_key,
)

__all__ = ["GRPC_PORT_OFFSET", "MotoS3", "SeaweedS3", "free_port_pairs"]

GRPC_PORT_OFFSET = 10000
"""SeaweedFS derives each gRPC port as HTTP port + 10000 unless told otherwise; we set both explicitly and
keep that convention so the ports of one instance are easy to recognise in ``ss -ltnp``."""


def _try_bind(host: str, port: int) -> socket.socket | None:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.bind((host, port))
    except OSError:
        s.close()
        return None
    return s


def free_port_pairs(n: int, host: str = HOST, offset: int = GRPC_PORT_OFFSET, tries: int = 500) -> list[int]:
    """Return ``n`` distinct ports ``p`` such that ``p`` and ``p + offset`` were both free a moment ago.

    :func:`psguard.ports.free_port` checks ``p`` only, not the derived gRPC port, which may be taken or above
    65535; both are held bound until all pairs are chosen so they cannot repeat.
    """
    chosen: list[int] = []
    taken: set[int] = set()
    held: list[socket.socket] = []
    try:
        for _ in range(tries):
            if len(chosen) == n:
                break
            p = free_port(host)
            q = p + offset
            if q > 65535 or p in taken or q in taken:
                continue
            a = _try_bind(host, p)
            b = _try_bind(host, q) if a is not None else None
            if a is None or b is None:
                if a is not None:
                    a.close()
                continue
            held += [a, b]
            chosen.append(p)
            taken.update((p, q))
        if len(chosen) < n:
            raise S3ServerError(f"could not find {n} free port pairs (p, p+{offset}) on {host}")
        return chosen
    finally:
        for s in held:
            s.close()


# --------------------------------------------------------------------------------------------------------------
# SeaweedFS
# --------------------------------------------------------------------------------------------------------------


class SeaweedS3(S3Server):
    """SeaweedFS (``weed mini``: master, volume, filer and S3 gateway in one process) on a data directory.

    Objects live under ``data_dir`` and survive :meth:`restart` and :meth:`kill`, which is what chaos runs of
    the durable log need. Every port is set explicitly (the defaults collide between parallel instances and
    with other software), extras we do not need (WebDAV, Iceberg, Lance, admin UI, telemetry) are off, and
    Unix sockets and glog files go to ``data_dir`` instead of ``/tmp`` where possible.

    ``data_dir`` given: used and kept (a second instance on it later sees the same objects, with fresh ports
    unless ``ports`` is passed). Not given: a temporary directory, deleted by :meth:`close`.
    """

    kind = "seaweedfs"
    COMPONENTS = ("master", "volume", "filer", "s3", "admin")
    """Servers inside ``weed mini``, each with an HTTP port and a gRPC port (HTTP + 10000). The admin server
    listens even with ``-admin.ui=false``, so it needs a port of its own too."""

    def __init__(
        self,
        data_dir: str | os.PathLike[str] | None = None,
        *,
        bucket: str = "psguard-test",
        ports: Mapping[str, int] | None = None,
        startup_timeout: float = 30.0,
        stop_timeout: float = 10.0,
        die_with_parent: bool = True,
        extra_args: list[str] | None = None,
    ) -> None:
        super().__init__(
            bucket=bucket,
            startup_timeout=startup_timeout,
            stop_timeout=stop_timeout,
            die_with_parent=die_with_parent,
            workdir=data_dir,
        )
        self._weed = find_executable("weed", INSTALL)
        self._extra_args = list(extra_args or [])
        self._ports: dict[str, int] = {}
        if ports is not None:
            missing = set(self.COMPONENTS) - set(ports)
            if missing:
                raise ValueError(f"ports must name every component {self.COMPONENTS}; missing {sorted(missing)}")
            self._ports = {c: int(ports[c]) for c in self.COMPONENTS}
            self._port = self._ports["s3"]
        self._access_key = random_key("PSGW")
        self._secret_key = secrets.token_hex(20)
        self._write_identities()

    @property
    def data_dir(self) -> Path:
        return self._workdir

    @property
    def ports(self) -> dict[str, int]:
        """HTTP port of each component; its gRPC port is this + :data:`GRPC_PORT_OFFSET`."""
        return dict(self._ports)

    def _write_identities(self) -> None:
        """The S3 gateway checks signatures only against identities in this file; with none it would let
        anonymous requests through, and a test bed must fail on a badly signed request like AWS does."""
        config = {
            "identities": [
                {
                    "name": "psguard",
                    "credentials": [{"accessKey": self._access_key, "secretKey": self._secret_key}],
                    "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                }
            ]
        }
        path = self._identities_path
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(config, f)

    @property
    def _identities_path(self) -> Path:
        return self._workdir / "s3-identities.json"

    def _choose_ports(self) -> None:
        self._ports = dict(zip(self.COMPONENTS, free_port_pairs(len(self.COMPONENTS), self.host), strict=True))
        self._port = self._ports["s3"]

    def _socket_path(self, name: str) -> str | None:
        path = str(self._workdir / name)
        return path if len(path.encode()) < 100 else None  # sun_path is 108 bytes

    def _command(self) -> list[str]:
        glog = self._workdir / "glog"
        glog.mkdir(exist_ok=True)
        data = self._workdir / "data"
        data.mkdir(exist_ok=True)
        p = self._ports
        args = [
            self._weed,
            f"-logdir={glog}",
            "mini",
            f"-dir={data}",
            f"-ip={self.host}",
            f"-ip.bind={self.host}",
            *(f"-{c}.port={p[c]}" for c in self.COMPONENTS),
            *(f"-{c}.port.grpc={p[c] + GRPC_PORT_OFFSET}" for c in self.COMPONENTS),
            f"-s3.config={self._identities_path}",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            "-webdav=false",
            "-admin.ui=false",
            "-master.telemetry=false",
            "-volume.preStopSeconds=0",
        ]
        for flag, name in (("-s3.localSocket", "s3.sock"), ("-filer.localSocket", "filer.sock")):
            path = self._socket_path(name)
            if path is not None:
                args.append(f"{flag}={path}")
        return args + self._extra_args

    def _extra_env(self) -> dict[str, str]:
        # weed also reads security.toml & co. from ~/.seaweedfs: a developer's own settings must not leak in.
        return {"HOME": str(self._workdir)}

    def _await_ready(self, deadline: float) -> None:
        self._poll_list_buckets(deadline, key=self._access_key, secret=self._secret_key)
        self._await_volumes(deadline)
        self._ensure_bucket()
        self._await_reads(deadline)

    def _await_reads(self, deadline: float) -> None:
        """After a restart, wait until an object stored before it reads back.

        The master listing the volumes is not the end of it: under load (CI, 2 cores) a GetObject of an object
        stored before the restart answered InternalError for a while after it. A fresh server has nothing to wait
        for."""
        c = self.client(connect_timeout=1, read_timeout=3, retries={"max_attempts": 1, "mode": "standard"})
        last: Exception | None = None
        while True:
            self._check_alive()
            try:
                listed = c.list_objects_v2(Bucket=self.bucket, MaxKeys=1).get("Contents") or []
                if not listed:
                    return
                c.get_object(Bucket=self.bucket, Key=listed[0]["Key"])["Body"].read()
                return
            except Exception as e:  # InternalError, a reset connection: not serving reads yet
                last = e
            if time.monotonic() > deadline:
                raise self._failure(f"did not read back a stored object within {self.startup_timeout:.0f}s ({last})")
            time.sleep(0.1)

    def _await_volumes(self, deadline: float) -> None:
        """Wait until the master lists the volume server with every volume found on disk.

        ListBuckets only needs the filer's metadata; reading an object that survived a restart also needs
        the master to know where its volume lives, which it learns from the volume server's heartbeat.
        """
        expected = len(list((self._workdir / "data").glob("*.dat")))
        url = f"http://{self.host}:{self._ports['master']}/dir/status"
        while True:
            self._check_alive()
            try:
                with urllib.request.urlopen(url, timeout=2) as resp:
                    topology = json.load(resp)["Topology"]
                nodes = [n for dc in topology["DataCenters"] for rack in dc["Racks"] for n in rack["DataNodes"]]
                if nodes and sum(int(n.get("Volumes", 0)) for n in nodes) >= expected:
                    return
            except (KeyError, TypeError, ValueError):
                return  # another weed version, another format: the check is a refinement, not a must
            except OSError:
                pass  # not answering yet
            if time.monotonic() > deadline:
                raise self._failure(f"master did not list {expected} volume(s) within {self.startup_timeout:.0f}s")
            time.sleep(0.1)

    def _after_stop(self) -> None:
        """``weed`` puts a Unix socket per gRPC server in /tmp (hard-coded) and leaves them behind when
        killed; they are named after our ports, so removing them cannot touch another instance's."""
        stale = [f"/tmp/seaweedfs-{c}-grpc-{self._ports[c] + GRPC_PORT_OFFSET}.sock" for c in self._ports]
        stale += [f"/tmp/seaweedfs-{c}-{self._ports[c]}.sock" for c in ("s3", "filer") if c in self._ports]
        stale += [str(self._workdir / "s3.sock"), str(self._workdir / "filer.sock")]
        for path in stale:
            with contextlib.suppress(FileNotFoundError):
                if Path(path).is_socket():
                    os.unlink(path)

    def _failure(self, what: str) -> S3ServerError:
        err = super()._failure(what)
        glog_error = self._workdir / "glog" / "weed.ERROR"
        if glog_error.exists():
            err = S3ServerError(f"{err}\nlast lines of {glog_error}:\n{log_tail(glog_error, 15)}")
        return err


# --------------------------------------------------------------------------------------------------------------
# moto
# --------------------------------------------------------------------------------------------------------------


class MotoS3(S3Server):
    """moto's standalone server, in memory: AWS-exact error codes and responses, no persistence.

    moto checks signatures only once IAM authentication is on, and then only for access keys of IAM users
    that it created itself (ids are random: we cannot pick them). So the start-up, still unauthenticated,
    seeds moto's random generator with a per-instance secret seed, creates a user with an ``s3:*`` policy and
    an access key, creates the bucket, and only then switches authentication on. The same seed on
    :meth:`restart` yields the same key pair, so clients keep working; the objects are gone.
    """

    kind = "moto"

    def __init__(
        self,
        *,
        bucket: str = "psguard-test",
        port: int | None = None,
        startup_timeout: float = 30.0,
        stop_timeout: float = 10.0,
        die_with_parent: bool = True,
        workdir: str | os.PathLike[str] | None = None,
    ) -> None:
        super().__init__(
            bucket=bucket,
            startup_timeout=startup_timeout,
            stop_timeout=stop_timeout,
            die_with_parent=die_with_parent,
            workdir=workdir,
        )
        self._moto = find_executable("moto_server", INSTALL)
        self._seed = secrets.randbits(31)
        if port is not None:
            self._port = port

    def _choose_ports(self) -> None:
        self._port = free_port(self.host)

    def _command(self) -> list[str]:
        return [self._moto, "-H", self.host, "-p", str(self._port)]

    def _extra_env(self) -> dict[str, str]:
        # Authentication off until _await_ready has created the user, whatever the caller's environment says.
        return {"INITIAL_NO_AUTH_ACTION_COUNT": "inf"}

    def _moto_api(self, path: str, body: bytes = b"") -> bytes:
        """POST to moto's control API; text/plain so Flask leaves the body in ``request.data``."""
        req = urllib.request.Request(
            f"{self.endpoint_url}/moto-api/{path}", data=body, method="POST", headers={"Content-Type": "text/plain"}
        )
        with urllib.request.urlopen(req, timeout=10) as resp:
            data: bytes = resp.read()
            return data

    def _await_ready(self, deadline: float) -> None:
        import boto3

        while True:
            self._check_alive()
            try:
                wait_port(self.host, self._port, timeout=0.5, what=self.kind)
                break
            except TimeoutError:
                if time.monotonic() > deadline:
                    raise self._failure(f"did not listen within {self.startup_timeout:.0f}s") from None
        # Authentication is still off (moto's default): any key is accepted while we set up the real one.
        self._poll_list_buckets(deadline, key="setup", secret="setup")
        self._moto_api(f"seed?a={self._seed}")
        iam = boto3.client(
            "iam",
            endpoint_url=self.endpoint_url,
            aws_access_key_id="setup",
            aws_secret_access_key="setup",
            region_name=REGION,
        )
        iam.create_user(UserName="psguard")
        key = iam.create_access_key(UserName="psguard")["AccessKey"]
        policy = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}
        iam.put_user_policy(UserName="psguard", PolicyName="s3-all", PolicyDocument=json.dumps(policy))
        if self._access_key and key["AccessKeyId"] != self._access_key:
            # Seeded ids should repeat; if a moto upgrade changes that, keep going with the new pair.
            sys.stderr.write(f"psguard testbed: {self!r} got a new access key on restart\n")
        self._access_key = str(key["AccessKeyId"])
        self._secret_key = str(key["SecretAccessKey"])
        self._ensure_bucket()
        self._moto_api("reset-auth", b"0")
        self._poll_list_buckets(deadline, key=self._access_key, secret=self._secret_key)
