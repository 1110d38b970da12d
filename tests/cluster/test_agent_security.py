"""Who can get in: authentication by default, scopes, secret files, TLS and mTLS, JWTs, slow clients, and
credentials kept out of logs, errors, ``/status`` and command lines.

Everything runs over real sockets; the process tests start real ``psguard agent`` processes (slow).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import ssl
import stat
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from psguard.agent.control.auth import JwtAuth, TokenAuth
from psguard.agent.control.httpd import AgentHTTPServer
from psguard.agent.daemon import Agent
from psguard.errors import ConfigError
from psguard.handoff.client import http_json, read_token
from psguard.handoff.credentials import check_private_file, create_token_file
from psguard.handoff.tls import client_context, client_context_from_env, server_context
from psguard.storage import open_backend, redact
from psguard.storage.retry import RetryConfig
from tests.support.agents import FAST, AgentProc, write_cluster
from tests.support.paths import QUIET, ROOT
from tests.support.pki import issue, make_ca

TOKEN = "a-shared-token-0123456789abcdef"
SECRET = b"jwt-hs256-secret-with-at-least-32-bytes!!"
AUDIENCE = "psguard-agents"


def mint(
    scope: str, *, expires_in: float = 300, audience: str = AUDIENCE, key: Any = SECRET, alg: str = "HS256"
) -> str:
    claims = {"sub": "tester", "aud": audience, "exp": int(time.time() + expires_in), "scope": scope}
    return jwt.encode(claims, key, algorithm=alg)


# ------------------------------------------------------------------------------------------- secret files
def test_token_files_others_can_read_are_refused_with_the_fix(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    for mode in (0o644, 0o640, 0o604, 0o602):
        path.chmod(mode)
        with pytest.raises(ConfigError, match="chmod 600") as info:
            read_token(str(path))
        assert "defaultMode: 0400" in str(info.value) and TOKEN not in str(info.value)
    for mode in (0o600, 0o400):
        path.chmod(mode)
        assert read_token(str(path)) == TOKEN
    # A Kubernetes Secret volume: the file is a symlink into ..data; the target's mode counts.
    data = tmp_path / "..data"
    data.mkdir()
    (data / "token").write_text(TOKEN)
    (data / "token").chmod(0o644)
    link = tmp_path / "mounted"
    link.symlink_to(data / "token")
    with pytest.raises(ConfigError, match="mode 0644"):
        read_token(str(link))
    (data / "token").chmod(0o400)
    assert read_token(str(link)) == TOKEN


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")
def test_a_token_file_another_user_owns_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text(TOKEN)
    path.chmod(0o600)
    os.chown(path, 4242, 4242)
    with pytest.raises(ConfigError, match="owned by uid 4242") as info:
        read_token(str(path))
    assert "chown" in str(info.value)


def test_private_key_files_are_checked_too(tmp_path: Path) -> None:
    ca = make_ca(tmp_path, "ca")
    leaf = issue(tmp_path, ca, "agent")
    leaf.key.chmod(0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        server_context(str(leaf.cert), str(leaf.key))
    secret = tmp_path / "jwt"
    secret.write_bytes(SECRET)
    secret.chmod(0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        JwtAuth.from_secret_file(str(secret), AUDIENCE)
    secret.chmod(0o600)
    assert JwtAuth.from_secret_file(str(secret), AUDIENCE).algorithms == ["HS256"]
    secret.write_bytes(b"short")
    with pytest.raises(ConfigError, match="at least 32 bytes"):
        JwtAuth.from_secret_file(str(secret), AUDIENCE)


def test_a_made_token_file_is_private_and_removed() -> None:
    made = create_token_file()
    try:
        assert stat.S_IMODE(made.path.stat().st_mode) == 0o600
        assert stat.S_IMODE(made.path.parent.stat().st_mode) == 0o700
        assert read_token(str(made.path)) == made.token and len(made.token) >= 32
        assert made.token not in repr(made)
        check_private_file(made.path, "--token-file")
    finally:
        made.remove()
    assert not made.path.parent.exists()


# ------------------------------------------------------------------------------------------- auth by default
def request(
    url: str, method: str, path: str, *, token: str | None = None, tls: ssl.SSLContext | None = None
) -> tuple[int, Any]:
    return http_json(method, f"{url}{path}", body={} if method == "POST" else None, token=token, tls=tls)


def test_no_credential_means_no_server_even_on_loopback() -> None:
    with pytest.raises(ConfigError, match="even on loopback"):
        AgentHTTPServer(host="127.0.0.1")


def test_an_agent_without_a_token_makes_one_and_hands_its_path_to_the_task() -> None:
    cluster = {"chief": ["127.0.0.1:1"], "ps": ["127.0.0.1:2"]}
    agent = Agent("ps", 0, cluster, command=[sys.executable, "-c", "pass"])
    try:
        agent._start_http()  # binds; start() serves once every route is there
        assert agent.http is not None and agent._token_file is not None
        agent.http.start()
        env = agent._task_env(agent.http.url)
        path = Path(env["PSGUARD_AGENT_TOKEN_FILE"])
        assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
        token = read_token(str(path))
        url = agent.http.url
        assert request(url, "POST", "/restart")[0] == 401  # any local user: refused
        assert request(url, "GET", "/status")[0] == 401
        assert request(url, "GET", "/metrics")[0] == 401
        assert request(url, "GET", "/healthz")[0] == 200  # kubelet probes stay open
        assert request(url, "GET", "/readyz")[0] in (200, 503)
        assert request(url, "GET", "/status", token=token)[0] == 200
    finally:
        agent.stop()
    assert not path.exists() and not path.parent.exists()


def test_a_chief_with_peers_needs_the_shared_token() -> None:
    cluster = {"chief": ["127.0.0.1:1"], "ps": ["127.0.0.1:2"]}
    with pytest.raises(ConfigError, match="same --token-file"):
        Agent("chief", 0, cluster, command=["true"], peers=["http://127.0.0.1:5"])
    Agent("chief", 0, cluster, command=["true"], peers=["http://127.0.0.1:5"], token=TOKEN)


def test_open_read_serves_metrics_and_status_without_a_credential_but_not_control() -> None:
    server = AgentHTTPServer(token=TOKEN, open_read=True, status=lambda: {"ok": 1})
    server.add_post("/restart", lambda req: None)
    with server:
        assert request(server.url, "GET", "/metrics")[0] == 200
        assert request(server.url, "GET", "/status")[0] == 200
        assert request(server.url, "POST", "/restart")[0] == 401
        assert request(server.url, "POST", "/restart", token=TOKEN)[0] == 200


# ------------------------------------------------------------------------------------------- JWT
@pytest.fixture
def jwt_server() -> Iterator[AgentHTTPServer]:
    server = AgentHTTPServer(auth=[JwtAuth(SECRET, ["HS256"], AUDIENCE)], status=lambda: {"ok": 1})
    server.add_post("/restart", lambda req: {"restarted": True})
    with server:
        yield server


def test_jwt_scopes_expiry_and_audience(jwt_server: AgentHTTPServer, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    url = jwt_server.url
    read, control = mint("read"), mint("read control")
    assert request(url, "GET", "/status", token=read)[0] == 200
    assert request(url, "GET", "/metrics", token=read)[0] == 200
    code, doc = request(url, "POST", "/restart", token=read)
    assert code == 403 and "'control' scope" in doc["error"]  # a read token cannot restart anything
    assert request(url, "POST", "/restart", token=control) == (200, {"restarted": True})
    assert request(url, "GET", "/status", token=mint("read", expires_in=-60))[0] == 401  # expired
    assert request(url, "GET", "/status", token=mint("read", audience="another-service"))[0] == 401
    assert request(url, "GET", "/status", token=mint("read", key=b"x" * 40))[0] == 401  # wrong key
    no_exp = jwt.encode({"aud": AUDIENCE, "scope": "read control"}, SECRET, algorithm="HS256")
    assert request(url, "POST", "/restart", token=no_exp)[0] == 401  # exp is required
    none_alg = jwt.encode({"aud": AUDIENCE, "exp": int(time.time()) + 60, "scope": "control"}, None, algorithm="none")
    assert request(url, "POST", "/restart", token=none_alg)[0] == 401
    assert "event=jwt_refused reason=ExpiredSignatureError" in caplog.text
    assert read not in caplog.text and control not in caplog.text


def test_jwt_signed_with_an_ec_key_checked_against_its_public_key(tmp_path: Path) -> None:
    key = ec.generate_private_key(ec.SECP256R1())
    public = tmp_path / "jwt.pub"
    public.write_bytes(
        key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    auth = JwtAuth.from_public_key_file(str(public), AUDIENCE)
    assert auth.algorithms == ["ES256"]
    other = ec.generate_private_key(ec.SECP256R1())
    with AgentHTTPServer(auth=[auth, TokenAuth(TOKEN)]) as server:
        assert request(server.url, "GET", "/metrics", token=mint("read", key=key, alg="ES256"))[0] == 200
        assert request(server.url, "GET", "/metrics", token=mint("read", key=other, alg="ES256"))[0] == 401
        assert request(server.url, "GET", "/metrics", token=mint("read", alg="HS256"))[0] == 401  # alg confusion
        assert request(server.url, "GET", "/metrics", token=TOKEN)[0] == 200  # the shared token still works


# ------------------------------------------------------------------------------------------- TLS / mTLS
@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    d = tmp_path_factory.mktemp("pki")
    ca, rogue = make_ca(d, "ca"), make_ca(d, "rogue-ca")
    return {
        "ca": ca,
        "rogue": rogue,
        "server": issue(d, ca, "agent"),
        "client": issue(d, ca, "client"),
        "rogue_client": issue(d, rogue, "rogue-client"),
        "expired_client": issue(d, ca, "expired-client", expired=True),
        "dir": d,
    }


def test_https_with_mutual_tls(pki: dict[str, Any]) -> None:
    ca, srv = pki["ca"], pki["server"]
    tls = server_context(str(srv.cert), str(srv.key), str(ca.cert))
    with AgentHTTPServer(token=TOKEN, tls=tls, status=lambda: {"ok": 1}) as server:
        assert server.url.startswith("https://127.0.0.1:")

        def ctx(name: str | None, trust: str = "ca") -> ssl.SSLContext:
            leaf = pki[name] if name else None
            return client_context(
                str(pki[trust].cert), str(leaf.cert) if leaf else None, str(leaf.key) if leaf else None
            )

        assert request(server.url, "GET", "/status", token=TOKEN, tls=ctx("client")) == (200, {"ok": 1})
        # Refused at the handshake: a certificate from another CA, an expired one.
        for name in ("rogue_client", "expired_client"):
            with pytest.raises(OSError):
                request(server.url, "GET", "/status", token=TOKEN, tls=ctx(name))
        # No certificate: only the kubelet's probes are answered.
        assert request(server.url, "GET", "/healthz", tls=ctx(None))[0] == 200
        for method, path in (("GET", "/status"), ("GET", "/metrics"), ("POST", "/restart")):
            code, doc = request(server.url, method, path, token=TOKEN, tls=ctx(None))
            assert code == 403 and "client certificate" in doc["error"], path
        # The client refuses a server its CA did not sign.
        with pytest.raises(ssl.SSLCertVerificationError):
            request(server.url, "GET", "/healthz", tls=ctx("client", trust="rogue"))
        # mTLS does not replace the bearer credential.
        assert request(server.url, "GET", "/status", tls=ctx("client"))[0] == 401
        # The trainer's context comes from the environment its agent sets.
        env = {
            "PSGUARD_AGENT_CA": str(ca.cert),
            "PSGUARD_AGENT_CLIENT_CERT": str(pki["client"].cert),
            "PSGUARD_AGENT_CLIENT_KEY": str(pki["client"].key),
        }
        assert request(server.url, "GET", "/status", token=TOKEN, tls=client_context_from_env(env))[0] == 200
        assert client_context_from_env({}) is None


def test_a_client_that_stalls_the_tls_handshake_is_cut_at_the_deadline(pki: dict[str, Any]) -> None:
    srv = pki["server"]
    tls = server_context(str(srv.cert), str(srv.key))
    with AgentHTTPServer(token=TOKEN, tls=tls, request_timeout=1.0) as server:
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as stalled:
            started = time.monotonic()
            assert stalled.recv(1) == b""  # no ClientHello: the server hangs up at the deadline
            assert time.monotonic() - started < 5
        assert request(server.url, "GET", "/healthz", tls=client_context(str(pki["ca"].cert)))[0] == 200


# ------------------------------------------------------------------------------------------- slow clients
def dribble(sock: socket.socket, stop: threading.Event, every: float) -> None:
    """Send a request one byte at a time, ``every`` seconds apart (a slow-loris client)."""
    for byte in b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Padding: " + b"a" * 10_000:
        if stop.wait(every):
            return
        try:
            sock.sendall(bytes([byte]))
        except OSError:
            return


def test_a_request_has_one_deadline_not_one_per_read() -> None:
    with AgentHTTPServer(token=TOKEN, request_timeout=1.5) as server:
        sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
        stop = threading.Event()
        sender = threading.Thread(target=dribble, args=(sock, stop, 0.2), name="slow-client")
        sender.start()
        try:
            started = time.monotonic()
            assert sock.recv(1) == b""  # a byte every 0.2 s would beat any per-read timeout; the deadline cuts it
            assert 1.0 < time.monotonic() - started < 5
        finally:
            stop.set()
            sender.join()
            sock.close()


def test_stop_cuts_open_connections_at_once() -> None:
    server = AgentHTTPServer(token=TOKEN, request_timeout=60).start()
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    stop = threading.Event()
    sender = threading.Thread(target=dribble, args=(sock, stop, 0.2), name="slow-client")
    sender.start()
    try:
        assert request(server.url, "GET", "/healthz")[0] == 200  # the server is serving, the client connected
        started = time.monotonic()
        server.stop()
        assert time.monotonic() - started < 3  # not the 60 s request deadline
    finally:
        stop.set()
        sender.join()
        sock.close()


# ------------------------------------------------------------------------------------------- redaction
def test_redact_hides_user_info_in_urls_and_text() -> None:
    assert redact("s3://AKIA:se/cr+et@bucket/job") == "s3://***@bucket/job"
    assert redact("failed: 's3://AKIA:se/cr+et@bucket/job' unreachable") == "failed: 's3://***@bucket/job' unreachable"
    assert redact("s3://bucket/job") == "s3://bucket/job" and redact("/data/ckpt") == "/data/ckpt"


def test_s3_credentials_in_the_url_never_reach_errors_or_logs(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    with socket.socket() as closed:  # a port nothing listens on: every call fails at once
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    url = "s3://AKIAEXAMPLEKEY:wJalr/XUtnFEMI+K7MDENGbPxRfiCYSECRET@bucket/job"
    backend = open_backend(url, {"endpoint_url": f"http://127.0.0.1:{port}"}, retry=RetryConfig(deadline=0.5))
    assert backend.url == "s3://bucket/job"
    with pytest.raises(Exception) as info:
        backend.get("manifest.json")
    text = "".join(str(e) for e in (info.value, info.value.__cause__, info.value.__context__) if e is not None)
    ours = "\n".join(r.getMessage() for r in caplog.records if r.name.startswith("psguard"))
    assert "wJalr/XUtnFEMI+K7MDENGbPxRfiCYSECRET" not in text + caplog.text  # not even botocore's debug lines
    assert "AKIAEXAMPLEKEY" not in text + ours  # botocore's debug log shows the key id (the CLI keeps it quiet)
    with pytest.raises(ConfigError) as bad:
        open_backend("nosuch://user:hunter2-password@host/x")
    assert "hunter2" not in str(bad.value)


def test_bench_store_passes_storage_options_through_stdin_not_argv() -> None:
    from psguard.benchmarks.store import rss_child_command

    argv = rss_child_command("s3://bucket/rss", 4)
    assert argv[-2:] == ["s3://bucket/rss", "4"] and not any("secret" in a.lower() for a in argv)
    assert "***@" in rss_child_command("s3://KEY:SECRET@bucket/rss", 4)[-2]


# ------------------------------------------------------------------------------------------- real agents
@pytest.mark.slow
def test_sigterm_ends_an_agent_held_by_a_slow_client(tmp_path: Path, agents: Callable[..., AgentProc]) -> None:
    cluster, _ = write_cluster(tmp_path)
    args = ["--role", "chief", "--index", "0", "--cluster", str(cluster), "--spool", str(tmp_path / "spool")]
    chief = agents("chief", args, [sys.executable, "-c", "import time; time.sleep(600)"])
    host, port = chief.url.removeprefix("http://").rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=10)
    stop = threading.Event()
    # A byte a second: under the 10 s per-request deadline and far under any per-read timeout.
    sender = threading.Thread(target=dribble, args=(sock, stop, 1.0), name="slow-client")
    sender.start()
    try:
        chief.wait_status(lambda s: s["state"] == "running", 60, "trainer running")
        started = time.monotonic()
        chief.proc.send_signal(signal.SIGTERM)
        assert chief.wait_exit(20) == 0
        assert time.monotonic() - started < 15
    finally:
        stop.set()
        sender.join()
        sock.close()


TRAINER_OVER_MTLS = textwrap.dedent(
    """
    import json, os, sys
    from psguard.handoff.client import report_recovery
    ok = report_recovery(5, seen_step=9, source="memory")
    with open(sys.argv[1], "w") as f:
        json.dump({"ok": ok, "url": os.environ["PSGUARD_AGENT_URL"], "ca": os.environ.get("PSGUARD_AGENT_CA")}, f)
    import time; time.sleep(600)
    """
)


@pytest.mark.slow
def test_agent_serves_mtls_and_jwt_and_its_trainer_calls_it_over_mtls(
    tmp_path: Path, agents: Callable[..., AgentProc], pki: dict[str, Any]
) -> None:
    ca, srv, client, rogue = pki["ca"], pki["server"], pki["client"], pki["rogue_client"]
    secret = tmp_path / "jwt-secret"
    secret.write_bytes(SECRET)
    secret.chmod(0o600)
    (tmp_path / "trainer.py").write_text(TRAINER_OVER_MTLS)
    out = tmp_path / "trainer.json"
    cluster, _ = write_cluster(tmp_path)
    args = ["--role", "chief", "--index", "0", "--cluster", str(cluster), "--spool", str(tmp_path / "spool")]
    args += ["--tls-cert", str(srv.cert), "--tls-key", str(srv.key), "--tls-ca", str(ca.cert)]
    args += ["--jwt-secret-file", str(secret), "--jwt-audience", AUDIENCE]
    chief = agents("chief", args, [sys.executable, str(tmp_path / "trainer.py"), str(out)])
    url = chief.url
    assert url.startswith("https://")
    tls = client_context(str(ca.cert), str(client.cert), str(client.key))

    def trainer_done() -> dict[str, Any] | None:
        assert chief.proc.poll() is None, chief.log()
        return json.loads(out.read_text()) if out.exists() else None

    deadline = time.monotonic() + 60
    while (doc := trainer_done()) is None:
        assert time.monotonic() < deadline, chief.log()
        time.sleep(0.1)
    assert doc["ok"] is True and doc["url"] == url and doc["ca"] == str(ca.cert)
    code, status = http_json("GET", f"{url}/status", token=mint("read"), tls=tls)
    assert code == 200 and status["last_lost_steps"] == 4  # the trainer's report arrived over mTLS
    assert http_json("POST", f"{url}/restart", body={}, token=mint("read"), tls=tls)[0] == 403
    no_cert = client_context(str(ca.cert))
    assert http_json("GET", f"{url}/healthz", tls=no_cert)[0] == 200  # kubelet probes present no certificate
    assert http_json("GET", f"{url}/status", token=mint("read"), tls=no_cert)[0] == 403
    with pytest.raises(OSError):  # a certificate from another CA fails the handshake
        http_json("GET", f"{url}/healthz", tls=client_context(str(ca.cert), str(rogue.cert), str(rogue.key)))
    assert SECRET.decode() not in chief.log()


@pytest.mark.slow
def test_store_credentials_stay_out_of_the_agent_log_and_status(
    tmp_path: Path, agents: Callable[..., AgentProc], moto: Any
) -> None:
    key, secret = moto.access_key or "AKIATESTKEY", moto.secret_key or "test/secret+key"
    config = tmp_path / "chief" / "agent.yaml"
    config.parent.mkdir(parents=True)
    config.write_text(FAST + f"storage_options: {{endpoint_url: '{moto.endpoint_url}'}}\n")
    store = f"s3://{key}:{secret}@{moto.bucket}/job-{time.monotonic_ns()}"
    cluster, _ = write_cluster(tmp_path)
    args = ["--role", "chief", "--index", "0", "--cluster", str(cluster), "--spool", str(tmp_path / "spool")]
    args += ["--store", store]
    chief = agents("chief", args, [sys.executable, "-c", "import time; time.sleep(600)"])
    status = chief.wait_status(lambda s: s["state"] == "running", 60, "trainer running")
    assert status["store"] == redact(store) and status["store"].startswith("s3://***@")
    chief.proc.send_signal(signal.SIGTERM)
    assert chief.wait_exit(30) == 0
    log = chief.log_path.read_text()
    assert "event=spool_serving" in log
    assert secret not in log and secret not in json.dumps(status)


TRAINER_WITH_MADE_TOKEN = textwrap.dedent(
    """
    import json, os, stat, sys
    from psguard.handoff.client import report_failure, report_recovery
    path = os.environ["PSGUARD_AGENT_TOKEN_FILE"]
    doc = {"path": path, "mode": stat.S_IMODE(os.stat(path).st_mode),
           "dir_mode": stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode),
           "failure": report_failure(step=12), "recovery": report_recovery(10, source="memory")}
    with open(sys.argv[1] + ".tmp", "w") as f:
        json.dump(doc, f)
    os.rename(sys.argv[1] + ".tmp", sys.argv[1])
    import time; time.sleep(600)
    """
)


@pytest.mark.slow
def test_an_agent_without_a_token_file_guards_loopback_and_its_trainer_still_gets_in(tmp_path: Path) -> None:
    (tmp_path / "trainer.py").write_text(TRAINER_WITH_MADE_TOKEN)
    out, ready = tmp_path / "trainer.json", tmp_path / "url"
    cluster, _ = write_cluster(tmp_path)
    argv = [sys.executable, "-m", "psguard.cli", "-v", "agent", "--role", "chief", "--index", "0"]
    argv += ["--cluster", str(cluster), "--spool", str(tmp_path / "spool"), "--ready-file", str(ready)]
    config = tmp_path / "agent.yaml"  # its task records here, not in the default job's folder in /dev/shm
    config.write_text(f"state_dir: {json.dumps(str(tmp_path / 'state'))}\n")
    argv += ["--config", str(config), "--", sys.executable, str(tmp_path / "trainer.py"), str(out)]
    env = dict(os.environ, PYTHONPATH=str(ROOT), **QUIET)
    log = tmp_path / "agent.log"
    with open(log, "wb") as sink:
        proc = subprocess.Popen(argv, stdout=sink, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 90
        while not out.exists():
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        doc = json.loads(out.read_text())
        assert doc["mode"] == 0o600 and doc["dir_mode"] == 0o700
        assert doc["failure"] is True and doc["recovery"] is True  # the trainer's calls work with the made token
        url = ready.read_text().strip()
        assert http_json("POST", f"{url}/restart", body={"reason": "a local user"})[0] == 401
        assert http_json("GET", f"{url}/status")[0] == 401
        code, status = http_json("GET", f"{url}/status", token=read_token(doc["path"]))
        assert code == 200 and status["last_lost_steps"] == 2 and status["restarts"] == 0
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        assert not Path(doc["path"]).exists() and not Path(doc["path"]).parent.exists()  # removed at exit
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_the_cli_redacts_urls_in_log_lines_and_tracebacks() -> None:
    from psguard.cli import RedactingFormatter

    try:
        raise OSError("cannot reach s3://AKIAKEY:top/secret@bucket/job")
    except OSError:
        record = logging.LogRecord(
            "psguard.x", logging.ERROR, __file__, 1, "store=%s", ("s3://K:top/secret@b/j",), None
        )
        record.exc_info = sys.exc_info()
    text = RedactingFormatter("%(message)s").format(record)
    assert "top/secret" not in text and "AKIAKEY" not in text
    assert "store=s3://***@b/j" in text and "s3://***@bucket/job" in text
