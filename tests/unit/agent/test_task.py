"""What an agent gives its task (psguard.agent.task): the environment is the contract with the trainer, the probes
decide when a task is dead or hung."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from psguard.agent.config import AgentConfig, HttpConfig
from psguard.agent.process.lifecycle import SupervisorConfig
from psguard.agent.process.prober import GrpcStatusProbe, ProcessProbe, TcpProbe
from psguard.agent.task import (
    HUGE_PAGES_TUNABLE,
    MMAP_THRESHOLD_TUNABLE,
    RECONNECT_BACKOFF_ARG,
    TF_GRPC_OPTIONS,
    server_command,
    task_env,
    task_probes,
    task_record,
)
from psguard.config import from_data
from psguard.errors import ConfigError
from psguard.handoff.contract import (
    ENV_AGENT_CA,
    ENV_AGENT_CLIENT_CERT,
    ENV_AGENT_CLIENT_KEY,
    ENV_AGENT_TOKEN_FILE,
    ENV_AGENT_URL,
    ENV_SPOOL,
    ENV_STORE,
    ENV_TASK,
)

CLUSTER = {"chief": ["127.0.0.1:2000"], "ps": ["127.0.0.1:2001", "127.0.0.1:2002"], "worker": ["127.0.0.1:2003"]}


def test_the_environment_names_the_task_and_its_agent_and_passes_the_token_files_path_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV_AGENT_CA, "/parent/ca.pem")  # a parent agent's TLS settings must not leak through
    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "1")  # the user's own choice wins over the quiet default
    token = tmp_path / "token"
    env = task_env(
        CLUSTER, "ps", 1, url="http://127.0.0.1:9", token_file=str(token), config=AgentConfig(), spool_dir=None
    )
    assert json.loads(env["TF_CONFIG"]) == {"cluster": CLUSTER, "task": {"type": "ps", "index": 1}, "rpc_layer": "grpc"}
    assert env[ENV_TASK] == "ps:1" and env[ENV_AGENT_URL] == "http://127.0.0.1:9"
    assert env[ENV_AGENT_TOKEN_FILE] == str(token)
    assert ENV_AGENT_CA not in env and ENV_AGENT_CLIENT_CERT not in env and ENV_AGENT_CLIENT_KEY not in env
    assert ENV_SPOOL not in env and ENV_STORE not in env  # only a chief's agent with a spool sets them
    assert env["TF_CPP_MIN_LOG_LEVEL"] == "1" and env["TF_ENABLE_ONEDNN_OPTS"] == "0"


def test_a_chiefs_environment_carries_its_spool_its_store_and_mutual_tls_files(tmp_path: Path) -> None:
    http = HttpConfig(tls_cert="cert.pem", tls_key="key.pem", tls_ca="ca.pem")
    config = AgentConfig(http=http)
    env = task_env(CLUSTER, "chief", 0, url="https://a:1", token_file=None, config=config, spool_dir=tmp_path / "spool")
    assert env[ENV_SPOOL] == str(tmp_path / "spool")
    assert env[ENV_STORE] == ""  # an agent without --store: the manager warns and writes its own directory
    assert env[ENV_AGENT_CA] == str(Path("ca.pem").resolve())
    assert env[ENV_AGENT_CLIENT_CERT] == str(Path("cert.pem").resolve())
    assert env[ENV_AGENT_CLIENT_KEY] == str(Path("key.pem").resolve())


def _tunables(role: str, *, huge_pages: bool = False, mmap_threshold_mb: float = 0.0) -> str | None:
    """The ``GLIBC_TUNABLES`` a task of ``role`` gets."""
    malloc = SupervisorConfig(huge_pages=huge_pages, ps_mmap_threshold_mb=mmap_threshold_mb)
    env = task_env(
        CLUSTER, role, 0, url="http://a:1", token_file=None, config=AgentConfig(supervisor=malloc), spool_dir=None
    )
    return env.get("GLIBC_TUNABLES")


def test_a_ps_mallocs_with_huge_pages_and_a_users_own_tunables_stay(monkeypatch: pytest.MonkeyPatch) -> None:
    def tunables(role: str, huge_pages: bool = True) -> str | None:
        return _tunables(role, huge_pages=huge_pages)

    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    assert tunables("ps") == HUGE_PAGES_TUNABLE
    assert tunables("chief") is None and tunables("worker") is None and tunables("ps", huge_pages=False) is None
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.arena_max=2")
    assert tunables("ps") == f"glibc.malloc.arena_max=2:{HUGE_PAGES_TUNABLE}"
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.hugetlb=0")
    assert tunables("ps") == "glibc.malloc.hugetlb=0"  # the user turned it off


def test_a_ps_maps_its_large_blocks_itself_and_a_users_own_threshold_stays(monkeypatch: pytest.MonkeyPatch) -> None:
    def tunables(role: str, mb: float = 4.0) -> str | None:
        return _tunables(role, mmap_threshold_mb=mb)

    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    assert tunables("ps") == f"{MMAP_THRESHOLD_TUNABLE}=4194304"
    assert tunables("ps", 0.5) == f"{MMAP_THRESHOLD_TUNABLE}=524288"
    assert tunables("worker") is None and tunables("chief") is None and tunables("ps", 0) is None
    monkeypatch.setenv("GLIBC_TUNABLES", f"{MMAP_THRESHOLD_TUNABLE}=65536")
    assert tunables("ps") == f"{MMAP_THRESHOLD_TUNABLE}=65536"  # the user's own
    both = _tunables("ps", huge_pages=True, mmap_threshold_mb=4)
    assert both == f"{MMAP_THRESHOLD_TUNABLE}=65536:{HUGE_PAGES_TUNABLE}"
    assert from_data(AgentConfig, {"supervisor": {"ps_mmap_threshold_mb": 0}}).supervisor.ps_mmap_threshold_mb == 0
    with pytest.raises(ConfigError, match="ps_mmap_threshold_mb"):
        from_data(AgentConfig, {"supervisor": {"ps_mmap_threshold_mb": -1}})


#: Frees 128 MB of 16 MB blocks below a block still in use, as a PS frees one generation's shards while it keeps
#: others: under glibc's own rule (a 30 MB mapped block freed first raises its threshold) the blocks come from the
#: heap, which cannot shrink below the block in use; prints the RSS kept after the frees, in MB.
_RETAINED = """
import ctypes
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
def rss():
    return int(next(l.split()[1] for l in open('/proc/self/status') if l.startswith('VmRSS'))) >> 10
libc.free(libc.malloc(30 << 20))
blocks = [libc.malloc(16 << 20) for _ in range(8)]
for b in blocks:
    ctypes.memset(b, 1, 16 << 20)
kept = libc.malloc(1 << 20)
ctypes.memset(kept, 1, 1 << 20)
before = rss()
for b in blocks:
    libc.free(b)
print(rss() - (before - 128))
"""


def test_the_mmap_threshold_tunable_gives_freed_large_blocks_back_to_the_kernel() -> None:
    """What ``supervisor.ps_mmap_threshold_mb`` is for, with this machine's glibc: 128 MB of 16 MB blocks freed
    below a block in use stay in the process under glibc's own rule, and go back to the kernel with the tunable."""

    def retained_mb(tunables: str | None) -> int:
        env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
        if tunables is not None:
            env["GLIBC_TUNABLES"] = tunables
        done = subprocess.run([sys.executable, "-c", _RETAINED], env=env, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        return int(done.stdout)

    assert retained_mb(None) >= 100, "glibc's own rule gave the blocks back: the premise of the setting is gone"
    assert retained_mb(f"{MMAP_THRESHOLD_TUNABLE}={4 << 20}") <= 16


def test_the_huge_pages_tunable_gives_a_process_huge_pages_for_its_large_blocks() -> None:
    """The setting does what it is for with this machine's glibc and kernel: 64 MB from malloc, touched, sits
    (partly) in transparent huge pages."""
    mode = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not mode.exists() or "[never]" in mode.read_text():
        pytest.skip("the kernel has transparent huge pages off")
    program = (
        "import ctypes\n"
        "libc = ctypes.CDLL(None)\n"
        "libc.malloc.restype = ctypes.c_void_p\n"
        "n = 64 << 20\n"
        "p = libc.malloc(n)\n"
        "ctypes.memset(p, 1, n)\n"
        "rollup = open('/proc/self/smaps_rollup').read()\n"
        "print(int(rollup.split('AnonHugePages:')[1].split()[0]))\n"
    )

    def huge_kb(tunables: str) -> int:
        env = {**os.environ, "GLIBC_TUNABLES": tunables}
        done = subprocess.run([sys.executable, "-c", program], env=env, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        return int(done.stdout)

    assert huge_kb(HUGE_PAGES_TUNABLE) >= 32 << 10, "64 MB malloc'd with the tunable: under 32 MB in huge pages"


def test_the_builtin_server_dies_with_its_agent_and_gets_the_cluster_as_json() -> None:
    argv = server_command(CLUSTER, "worker", 0)
    assert argv[:3] == [sys.executable, "-m", "psguard.agent.process.tf_server"]
    assert json.loads(argv[argv.index("--cluster-spec") + 1]) == CLUSTER
    assert argv[argv.index("--job") + 1] == "worker" and argv[argv.index("--index") + 1] == "0"
    assert argv[argv.index("--parent-pid") + 1] == str(os.getpid())


def test_a_servers_probes_include_its_port_and_an_rpc_a_chief_only_its_process() -> None:
    chief = task_probes("chief", "127.0.0.1:2000", lambda: 1, builtin_server=False)
    assert [type(p) for p in chief] == [ProcessProbe]
    builtin = task_probes("ps", "ps-0.example:2001", lambda: 1, builtin_server=True)
    assert [type(p) for p in builtin] == [ProcessProbe, TcpProbe, GrpcStatusProbe]
    tcp, rpc = builtin[1], builtin[2]
    assert isinstance(tcp, TcpProbe) and (tcp.host, tcp.port) == ("127.0.0.1", 2001)  # on loopback, no DNS
    assert isinstance(rpc, GrpcStatusProbe) and rpc.target == "127.0.0.1:2001"
    user = task_probes("worker", "worker-0.example:2003", lambda: 1, builtin_server=False)
    assert isinstance(user[1], TcpProbe) and user[1].host == "worker-0.example"
    assert isinstance(user[2], GrpcStatusProbe) and user[2].target == "worker-0.example:2003"


def test_the_task_record_lives_in_the_state_folder_under_a_safe_name(tmp_path: Path) -> None:
    path = task_record(AgentConfig(state_dir=str(tmp_path)), "ps:0/../x")
    assert path.parent == tmp_path and "/" not in path.name and path.name.endswith(".task.json")


def test_the_backoff_is_set_for_every_task_and_a_users_own_stands(monkeypatch: pytest.MonkeyPatch) -> None:
    def options(role: str, backoff: float = 0.1) -> str | None:
        config = AgentConfig(supervisor=SupervisorConfig(reconnect_backoff=backoff))
        env = task_env(CLUSTER, role, 0, url="http://a:1", token_file=None, config=config, spool_dir=None)
        return env.get(TF_GRPC_OPTIONS)

    monkeypatch.delenv(TF_GRPC_OPTIONS, raising=False)
    for role in ("chief", "worker", "ps"):
        assert options(role) == f"{RECONNECT_BACKOFF_ARG}=100"
    assert options("ps", 0.0) is None  # off: TensorFlow's own
    monkeypatch.setenv(TF_GRPC_OPTIONS, "grpc.keepalive_time_ms=5000")
    assert options("worker") == f"grpc.keepalive_time_ms=5000,{RECONNECT_BACKOFF_ARG}=100"
    monkeypatch.setenv(TF_GRPC_OPTIONS, f"{RECONNECT_BACKOFF_ARG}=2000")
    assert options("worker") == f"{RECONNECT_BACKOFF_ARG}=2000"  # the user's choice
