"""Issue 12 end to end: every task under an agent, each PS's agent keeps its PS's shards.

The trainer captures the embedding's changed rows on the PS nodes (files in each PS agent's part folder), the
chief's agent forwards the parts and keeps only the small tensors, each PS agent writes its part of every
durable checkpoint (format 2, one commit by the chief's agent). A PS is killed with SIGKILL; the trainer comes
back in a new process and every PS loads its shards from its own agent's memory tier. At the end the durable
log's newest checkpoint, written part by part, must be bit-identical to the trainer's variables.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import sys
import textwrap
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from psguard.handoff.client import http_json
from psguard.handoff.mapped import ENV_MAP_OP, map_op
from psguard.handoff.tls import client_context
from psguard.run_folder import drop_memory_folders, memory_folder
from psguard.store import Store
from tests.support.agents import AgentProc, write_cluster
from tests.support.pki import issue, make_ca
from tests.support.processes import wait_until
from tests.support.tamper import CopyTamperProxy

TRAINER = textwrap.dedent(
    """
    import hashlib, json, logging, os, sys, time
    import tensorflow as tf
    from psguard.handoff.contract import Tier

    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("psguard.trainer.ps_load").setLevel(logging.INFO)  # its restores' event=ps_load
    from psguard.trainer.manager import CheckpointManager
    from psguard.policy.engine import EverySteps, Schedule
    from psguard.trainer.recovery import exit_for_restart, is_cluster_failure
    from psguard.trainer.variables import read_tensors
    from psguard.testbed.model import ModelConfig, RecModel, Trainer, make_optimizer

    out, store_url, target = sys.argv[1], sys.argv[2], int(sys.argv[3])
    os.makedirs(out, exist_ok=True)
    gen = len([n for n in os.listdir(out) if n.startswith("gen-")])

    def put(name, doc):
        with open(os.path.join(out, name + ".tmp"), "w") as f:
            json.dump(doc, f)
        os.rename(os.path.join(out, name + ".tmp"), os.path.join(out, name))

    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    num_ps = len(resolver.cluster_spec().as_dict()["ps"])
    strategy = tf.distribute.experimental.ParameterServerStrategy(
        resolver, variable_partitioner=tf.distribute.experimental.partitioners.FixedShardsPartitioner(num_ps)
    )
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    with strategy.scope():
        model = RecModel(ModelConfig(vocab_size=20_000, embedding_dim=8, batch_size=64))
        optimizer = make_optimizer("adagrad")
    trainer = Trainer(strategy, coordinator, model, optimizer)
    root = tf.train.Checkpoint(model=model, optimizer=optimizer)
    manager = CheckpointManager(
        root, store_url, coordinator=coordinator, step_counter=model.step,
        policy=Schedule(memory=EverySteps(5), durable=EverySteps(20)),
    )
    manager.restore_or_initialize()
    r = manager.restored
    trainer.next_index = int(model.step.numpy())
    put(f"gen-{gen}", {
        "restored": None if r is None else {"source": r.source, "step": r.step},
        "spilled": sorted(manager.capturer.spilled), "at": time.time(),
        "digests": {n: hashlib.sha256(v.tobytes()).hexdigest() for n, v in read_tensors(root).items()},
    })
    seen = 0
    try:
        while (seen := int(model.step.numpy())) < target:
            handle = manager.maybe_save(seen)
            if handle is not None and seen >= 20 and not os.path.exists(os.path.join(out, "kill")):
                handle.result(timeout=120)  # a durable checkpoint exists before the fault
                copies = handle.restorable(timeout=120).copies  # which peer copies hold this save
                put("kill", {"step": seen, "stats": manager.capturer.last_stats.bytes_read, "copies": copies})
            trainer.train(5)
        handle = manager.save(tiers=frozenset({Tier.MEMORY, Tier.DURABLE}))
        info = handle.result(timeout=120)
        digests = {n: hashlib.sha256(v.tobytes()).hexdigest() for n, v in read_tensors(root).items()}
        put("final", {"step": int(model.step.numpy()), "checkpoint": info.id, "digests": digests})
        manager.close()
    except Exception as e:
        if not is_cluster_failure(e):
            raise
        put(f"failure-{gen}", {"seen": seen})
        exit_for_restart(e, failed_at=time.time())
    """
)


@pytest.fixture
def shm(tmp_path: Path) -> Iterator[Path]:
    """A folder on tmpfs, where a PS agent's part folder lives in production (its tier then lives in files
    there, and a restore links them: no copy). Pytest's tmp_path is on disk here, where the tier stays in
    anonymous memory and the export writes the data out."""
    path = memory_folder(tmp_path, "parts", "psguard-test-")
    if path.parent != Path("/dev/shm"):
        pytest.fail("no writable /dev/shm on this machine: the production layout cannot be tested")
    yield path
    drop_memory_folders([path])


@pytest.mark.slow
@pytest.mark.parametrize("ps_op", ["mapped", "ps-without-op"])
def test_ps_agents_keep_the_shards_restore_them_after_a_kill_and_write_the_log(
    tmp_path: Path, shm: Path, agents: Callable[..., AgentProc], ps_op: str
) -> None:
    """``ps-without-op``: the PS started without the zero-copy op (PSGUARD_MAP_OP=0 there, as a PS psguard did not
    start), the chief with it: its mapped load fails before anything is assigned, and it loads by reading."""
    cluster, _ = write_cluster(tmp_path, ps=2, workers=1)
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER)
    out, store = tmp_path / "out", tmp_path / "store"
    ps_args = [["--role", "ps", "--index", str(i), "--cluster", str(cluster), "--store", str(store)] for i in range(2)]
    ps_env = {ENV_MAP_OP: "0"} if ps_op == "ps-without-op" else {}
    ps = [agents(f"ps{i}", [*a, "--spool", str(shm / f"ps{i}-shards")], env=ps_env) for i, a in enumerate(ps_args)]
    worker = agents("worker0", ["--role", "worker", "--index", "0", "--cluster", str(cluster)])
    peers = [arg for a in (*ps, worker) for arg in ("--peer", a.url)]
    args = ["--role", "chief", "--index", "0", "--cluster", str(cluster), "--store", str(store)]
    args += ["--spool", str(tmp_path / "spool"), *peers]
    chief = agents("chief", args, [sys.executable, str(script), str(out), str(store), "120"])

    def kill_file() -> dict[str, Any] | None:
        if chief.proc.poll() is not None:
            raise AssertionError(f"chief agent exited {chief.proc.returncode}:\n{chief.log()}")
        return json.loads((out / "kill").read_text()) if (out / "kill").exists() else None

    kill = wait_until(kill_file, 300, "a durable checkpoint before the fault")
    assert kill["copies"] == {}, kill  # peer copies off: no copy holds any save
    first = json.loads((out / "gen-0").read_text())
    table = "model/embedding/.ATTRIBUTES/VARIABLE_VALUE"
    assert table in first["spilled"], (first, chief.log())
    assert "event=ps_side_shards" in chief.log()
    # The chief's agent holds the small tensors only; each PS agent holds its half of the table and its slot.
    chief_status = chief.status()
    table_bytes = 20_000 * 8 * 4
    assert chief_status["memory_bytes"] < table_bytes / 4, chief_status["memory_bytes"]
    for p in ps:
        shards = p.status()["shards"]
        assert shards["bytes"] >= table_bytes, shards  # half table + half slot: the captures were applied
    killed_at = time.time()
    os.kill(ps[0].status()["pid"], signal.SIGKILL)
    assert chief.wait_exit(400) == 0, chief.log()
    failure = json.loads((out / "failure-0").read_text())
    second = json.loads((out / "gen-1").read_text())
    final = json.loads((out / "final").read_text())
    print(
        f"kill at {kill['step']}, seen {failure['seen']}, restored {second['restored']} "
        f"{second['at'] - killed_at:.1f}s after the kill, final {final['step']}"
    )
    assert second["restored"]["source"] == "memory", chief.log()
    assert kill["step"] <= second["restored"]["step"] <= failure["seen"]
    exports = [p.status()["shards"] for p in ps]
    # One export per recovery: the chief's agent had each PS agent export when the new generation started, and the
    # restore took that answer instead of asking again.
    assert [e["exports"] for e in exports] == [1, 1], (exports, chief.log())
    # On tmpfs the tier is its files: every export linked them and wrote no shard's data (zero-copy).
    for e in exports:
        assert e["tier_files"]["enabled"] and e["tier_files"]["bytes_linked"] >= table_bytes, e
        assert e["export_bytes_written"] == 0 and e["tier_files"]["failures"] == 0, e
    # And each PS mapped its shards' files rather than reading them (the op `make test` builds), table and slot
    # on both PS. The log's bit-exactness below covers what training did on those mappings.
    if map_op() is not None:
        loads = re.findall(r"event=ps_load shards=(\d+) mapped=(\d+)", chief.log())
        assert loads and all(int(n) >= 4 for n, _ in loads), (loads, chief.log())
        if ps_op == "mapped":
            assert all(n == m for n, m in loads), (loads, chief.log())
        else:
            assert all(m == "0" for _, m in loads) and "map_op_missing_on_ps" in chief.log(), (loads, chief.log())
    # The log: format 2, the table in two parts written by the PS agents; the newest equals the trainer's state.
    with Store.open(str(store)) as s:
        newest = s.manifest(final["checkpoint"])
        assert newest.tensors[table].encoding == "sharded"
        assert len(newest.tensors[table].parts) == 2
        tensors = s.load(final["checkpoint"])
        digests = {n: hashlib.sha256(v.tobytes()).hexdigest() for n, v in tensors.items() if not n.startswith("_")}
        assert {n: d for n, d in digests.items() if n in final["digests"]} == final["digests"]
        for report in s.verify_all(s.checkpoint_ids()):
            assert report.ok, report

    # The job comes back with one PS more: every PS agent of the new job reads the logical rows its PS now
    # hosts from the durable log the two PS agents wrote (format 2, one part per old shard).
    for a in (*ps, worker):
        a.close()  # the next job reuses nothing of this one but the store
    if ps_op == "mapped":  # (the rest has nothing to do with how the PS loads)
        _restores_bit_exact_onto_three(tmp_path, agents, store, final)


def _restores_bit_exact_onto_three(
    tmp_path: Path, agents: Callable[..., AgentProc], store: Path, saved: dict[str, Any]
) -> None:
    """A job of three PS agents restores ``saved`` (the final document of a job of two PS agents that wrote
    ``store``), bit-exact, and writes its own checkpoint in three parts."""
    three = _job(tmp_path, agents, "three", 3, store, saved["step"] + 5)
    restored = json.loads((three / "gen-0").read_text())
    assert restored["restored"] == {"source": restored["restored"]["source"], "step": saved["step"]}, restored
    table = "model/embedding/.ATTRIBUTES/VARIABLE_VALUE"
    assert table in restored["spilled"]  # captured on the three PS from here on
    assert {n: d for n, d in restored["digests"].items() if n in saved["digests"]} == saved["digests"]
    final = json.loads((three / "final").read_text())
    with Store.open(str(store)) as s:
        newest = s.manifest(final["checkpoint"])
        assert len(newest.tensors[table].parts) == 3  # written by the three PS agents
        tensors = s.load(final["checkpoint"])
        digests = {n: hashlib.sha256(v.tobytes()).hexdigest() for n, v in tensors.items()}
        assert {n: d for n, d in digests.items() if n in final["digests"]} == final["digests"]


@pytest.mark.slow
def test_a_ps_lost_with_its_agent_reads_its_rows_from_the_log(tmp_path: Path, agents: Callable[..., AgentProc]) -> None:
    """SIGKILL of a PS together with its agent (its node lost): no memory tier holds its shards any more. The
    new trainer asks every PS agent to read the rows its PS hosts from the newest durable checkpoint (format 2,
    row-range reads), and trains on from there; the log stays bit-exact with the trainer's state."""
    chief, ps, ps_args, out, store = _node_loss_job(tmp_path, agents)

    def kill_file() -> dict[str, Any] | None:
        if chief.proc.poll() is not None:
            raise AssertionError(f"chief agent exited {chief.proc.returncode}:\n{chief.log()}")
        return json.loads((out / "kill").read_text()) if (out / "kill").exists() else None

    wait_until(kill_file, 300, "a durable checkpoint before the fault")
    with Store.open(str(store)) as s:
        durable_before = max(c.step for c in s.checkpoints())
    server = ps[0].status()["pid"]
    ps[0].proc.kill()  # the agent and its memory tier
    os.kill(server, signal.SIGKILL)  # and the PS it ran: the node is gone
    ps[0].proc.wait()
    again = agents("ps0-again", ps_args[0])  # a new node takes its place, on the same addresses
    assert chief.wait_exit(400) == 0, chief.log()
    second = json.loads((out / "gen-1").read_text())
    final = json.loads((out / "final").read_text())
    assert second["restored"]["source"] == "durable", chief.log()
    assert second["restored"]["step"] >= durable_before
    assert "every tier loaded" in chief.log()
    # Its store's open was held for a peer copy this job has none of: the chief's export ahead (or the log's
    # read) released it, not the end of the hold.
    opened = [line for line in again.log().splitlines() if "event=store_opened" in line]
    assert len(opened) == 1 and "(released)" in opened[0], again.log()
    assert _holds(store, final["checkpoint"], final["digests"])


@pytest.mark.slow
def test_a_ps_lost_with_its_agent_restores_from_the_peer_copy_over_mutual_tls(
    tmp_path: Path, agents: Callable[..., AgentProc]
) -> None:
    """Peer copies on (``peers.copies: full``), each PS agent on its own node, every agent serving HTTPS with
    mutual TLS (certificates of the job's CA; JWTs accepted too): SIGKILL of ps:0 with its agent. The new agent,
    with an empty tier, takes ps:0's shards from ps:1's copy over mTLS (verified against ps:0's digests), so the
    trainer restores the memory tier's newest state, newer than the durable log, and the log written after stays
    bit-exact with the trainer. The copy endpoints refuse a caller without the shared token (even with a good
    certificate) and a certificate of another CA at the handshake: copy data is never open."""
    pki = tmp_path / "pki"
    pki.mkdir()
    ca, rogue_ca = make_ca(pki, "ca"), make_ca(pki, "rogue-ca")
    leaf, rogue = issue(pki, ca, "agent"), issue(pki, rogue_ca, "rogue")
    secret = tmp_path / "jwt-secret"
    secret.write_text(os.urandom(32).hex())
    secret.chmod(0o600)
    security = ["--tls-cert", str(leaf.cert), "--tls-key", str(leaf.key), "--tls-ca", str(ca.cert)]
    security += ["--jwt-secret-file", str(secret), "--jwt-audience", "psguard-test"]
    chief, ps, ps_args, out, store = _node_loss_job(tmp_path, agents, copies="full", security=security)
    assert all(a.url.startswith("https://") for a in (chief, *ps)), [a.url for a in (chief, *ps)]
    kill = _kill_file(chief, out)
    # The save's acknowledgement says which copy holds each PS's rows (wait_for_copy: the copy had it first).
    assert kill["copies"] == {"ps:0": "ps:1", "ps:1": "ps:0"}, kill  # made over HTTPS between the PS agents
    parts = chief.status()["copies"]["parts"]
    assert {t: p["holder"] for t, p in parts.items()} == {"ps:0": "ps:1", "ps:1": "ps:0"}, parts
    holder = ps[1]
    read = {"owner": "ps:0", "token": chief.status()["memory_token"]}
    code, _ = http_json("POST", f"{holder.url}/peer-copy/read", body=read, tls=holder.tls)  # no token
    assert code in (401, 403), code
    with pytest.raises(OSError):  # a certificate of another CA: refused at the handshake
        http_json("POST", f"{holder.url}/peer-copy/read", body=read, token=holder.token,
                  tls=client_context(str(ca.cert), str(rogue.cert), str(rogue.key)))  # fmt: skip

    trainer = _stop_at_a_capture_newer_than_the_log(chief, store, _ps1_copy_current(chief, ps), "ps:1's copy of ps:0")
    assert re.search(r'psguard_peer_copy_held_bytes\{owner="ps:0"\} [1-9]', ps[1].metrics()), ps[1].metrics()
    _lose_ps0_and_restore(chief, ps, ps_args[0], agents, out, store, trainer, fingerprints="kept")
    log_text = chief.log()
    assert "event=peer_copy_used task=ps:0 holder=ps:1" in log_text
    # Fetched as soon as the new agent answered, while its PS server started: before the generation was ready.
    assert log_text.index("event=peer_copy_used task=ps:0") < log_text.rindex("event=generation_ready"), log_text


@pytest.mark.slow
def test_a_ps_node_lost_with_the_node_holding_its_copy_restores_from_the_log(
    tmp_path: Path, agents: Callable[..., AgentProc]
) -> None:
    """Peer copies on, and both nodes lost at once: ps:0 with its agent and ps:1 (the holder of ps:0's copy, and
    ps:0 of its) with its agent. No copy survives: the new agents read their rows from the durable log, the
    chief says why the copies were not used, and the restore is that checkpoint, bit for bit."""
    chief, ps, ps_args, out, store = _node_loss_job(tmp_path, agents, copies="full")
    kill = _kill_file(chief, out)
    assert kill["copies"] == {"ps:0": "ps:1", "ps:1": "ps:0"}, kill
    with Store.open(str(store)) as s:
        durable_before = max(c.step for c in s.checkpoints())
    servers = [p.status()["pid"] for p in ps]
    for agent, server in zip(ps, servers, strict=True):
        agent.proc.kill()  # the agent, its tier and the copy it held
        os.kill(server, signal.SIGKILL)  # and its PS: the node is gone
        agent.proc.wait()
    agents("ps0-again", ps_args[0])
    agents("ps1-again", ps_args[1])
    assert chief.wait_exit(400) == 0, chief.log()
    second = json.loads((out / "gen-1").read_text())
    assert second["restored"]["source"] == "durable" and second["restored"]["step"] >= durable_before, chief.log()
    assert re.search(r"event=peer_copy_not_used task=ps:0 holder=ps:1 status=unavailable", chief.log()), chief.log()
    with Store.open(str(store)) as s:
        restored = next(c.id for c in s.checkpoints() if c.step == second["restored"]["step"])
    assert _holds(store, restored, second["digests"])


@pytest.mark.slow
def test_a_peer_copy_that_does_not_verify_is_refused_and_the_log_serves(
    tmp_path: Path, agents: Callable[..., AgentProc]
) -> None:
    """ps:1 holds ps:0's copy, and the rows it serves come back damaged (a proxy changes one value in every frame
    of rows and re-frames it: well formed, wrong). When ps:0's node is lost, its new agent checks the rows
    against ps:0's digests, refuses them and says so; the trainer restores the durable log's checkpoint,
    bit-exact, rather than anything from the damaged copy."""
    proxies: list[CopyTamperProxy] = []

    def behind_a_proxy(i: int, url: str) -> str:
        if i != 1:
            return url
        proxies.append(CopyTamperProxy(url))
        return proxies[-1].url

    try:
        chief, ps, ps_args, out, store = _node_loss_job(tmp_path, agents, copies="full", front=behind_a_proxy)
        kill = _kill_file(chief, out)
        assert kill["copies"] == {"ps:0": "ps:1", "ps:1": "ps:0"}, kill

        trainer = _stop_at_a_capture_newer_than_the_log(
            chief, store, _ps1_copy_current(chief, ps), "ps:1's copy of ps:0"
        )
        proxies[0].arm()
        restored = _lose_ps0_and_restore(chief, ps, ps_args[0], agents, out, store, trainer, source="durable")
    finally:
        for proxy in proxies:
            proxy.close()
    assert proxies[0].damaged >= 1
    assert "event=peer_copy_used" not in chief.log()
    assert re.search(r"event=peer_copy_not_used task=ps:0 holder=ps:1 status=refused", chief.log()), chief.log()
    again = (tmp_path / "ps0-again" / "agent.log").read_text(errors="replace")
    assert "event=peer_copy_refused task=ps:0" in again and "does not match its owner's digests" in again, again
    assert restored["source"] == "durable"


def _holds(store: Path, checkpoint: str, expected: dict[str, str]) -> bool:
    """Whether ``checkpoint`` of the store holds exactly the tensors the trainer digested (sha256 by name)."""
    with Store.open(str(store)) as s:
        tensors = s.load(checkpoint)
    digests = {n: hashlib.sha256(v.tobytes()).hexdigest() for n, v in tensors.items()}
    return {n: d for n, d in digests.items() if n in expected} == expected


def _ps1_copy_current(chief: AgentProc, ps: list[AgentProc]) -> Callable[[], bool]:
    """Whether ps:1's copy of ps:0 is at the chief's newest capture."""

    def current() -> bool:
        held = ps[1].status()["shards"]["copies_held"].get("ps:0") or {}
        return held.get("token") is not None and held.get("token") == chief.status()["memory_token"]

    return current


def _kill_file(chief: AgentProc, out: Path) -> dict[str, Any]:
    """What TRAINER wrote once a durable checkpoint exists (the step, the save's copies)."""

    def kill_file() -> dict[str, Any] | None:
        if chief.proc.poll() is not None:
            raise AssertionError(f"chief agent exited {chief.proc.returncode}:\n{chief.log()}")
        return json.loads((out / "kill").read_text()) if (out / "kill").exists() else None

    found: dict[str, Any] = wait_until(kill_file, 300, "a durable checkpoint before the fault")
    return found


def _stop_at_a_capture_newer_than_the_log(chief: AgentProc, store: Path, current: Callable[[], bool], what: str) -> int:
    """SIGSTOP the trainer (no capture while the fault is set up: the copy is made current, not hoped to be) at a
    memory capture newer than the durable log, so that the restore shows where it came from; its pid."""
    trainer: int = chief.status()["pid"]

    def durable_step() -> int:
        with Store.open(str(store)) as s:
            return max(c.step for c in s.checkpoints())

    for _ in range(10):
        os.kill(trainer, signal.SIGSTOP)
        wait_until(current, 60, f"{what} at the chief's newest capture")
        memory_step = chief.status()["memory_step"]
        if memory_step > durable_step():
            return trainer
        os.kill(trainer, signal.SIGCONT)
        wait_until(lambda seen=memory_step: chief.status()["memory_step"] != seen, 60, "a newer capture")
    raise AssertionError(f"no memory capture newer than the durable log:\n{chief.log()}")


def _lose_ps0_and_restore(
    chief: AgentProc,
    ps: list[AgentProc],
    ps0_args: list[str],
    agents: Callable[..., AgentProc],
    out: Path,
    store: Path,
    trainer: int,
    *,
    source: str = "memory",
    fingerprints: str | None = None,
) -> dict[str, Any]:
    """SIGKILL ps:0 with its agent (the trainer stopped), start a new agent in its place, let the trainer go on:
    it must restore the memory tier's newest capture (``source="durable"``: an older step, the log's), and the
    log at the end must match the trainer bit for bit (rows a capture after the restore missed would show there:
    a fingerprint restored wrong hides a changed row). ``fingerprints``: what the new agent's fetch of the copy
    must have said of the rows' fingerprints (``kept``: its PS loaded them, no rehash; ``none``). Returns what the
    trainer restored."""
    # 0 once a capture applied since the check above (written before the trainer stopped) reached the copy too
    wait_until(lambda: re.search(r'psguard_peer_copy_lag_steps\{task="ps:0"\} 0', ps[0].metrics()), 30, "lag 0")
    try:
        server = ps[0].status()["pid"]
        ps[0].proc.kill()  # the agent and its memory tier
        os.kill(server, signal.SIGKILL)  # and the PS it ran: the node is gone
        ps[0].proc.wait()
        # A capture the trainer wrote just before it stopped may have been applied since memory_step was read;
        # with ps:0 gone no later one can be: this is the state the restore must find.
        memory_step = chief.status()["memory_step"]
    finally:
        os.kill(trainer, signal.SIGCONT)
    fresh = agents("ps0-again", ps0_args)  # a new node takes its place, on the same addresses, with an empty tier
    assert chief.wait_exit(400) == 0, chief.log()
    if fingerprints is not None:
        assert re.search(rf"event=peer_copy_restored task=ps:0 .* fingerprints={fingerprints} ", fresh.log())
    second = json.loads((out / "gen-1").read_text())
    final = json.loads((out / "final").read_text())
    if source == "memory":
        assert second["restored"] == {"source": "memory", "step": memory_step}, chief.log()
    else:
        assert second["restored"]["source"] == source and second["restored"]["step"] < memory_step, chief.log()

    assert _holds(store, final["checkpoint"], final["digests"])
    if source == "durable":  # the restored variables are that checkpoint's, bit for bit
        with Store.open(str(store)) as s:
            restored = next(c.id for c in s.checkpoints() if c.step == second["restored"]["step"])
        assert _holds(store, restored, second["digests"])
    return dict(second["restored"])


def _node_loss_job(
    tmp_path: Path,
    agents: Callable[..., AgentProc],
    *,
    copies: str = "none",
    num_ps: int = 2,
    security: Sequence[str] = (),
    front: Callable[[int, str], str] | None = None,
) -> tuple[AgentProc, list[AgentProc], list[list[str]], Path, Path]:
    """``num_ps`` PS agents on fixed HTTP ports (a replacement agent takes the same address), a worker and the
    chief running TRAINER to step 100. ``copies`` (``full``, ``parity``: groups of 2): each PS agent on a node of
    its own (``ps0-again`` on ps0's) and the chief's ``peers.copies``. ``security``: arguments every agent gets
    (its TLS certificate, JWT settings); ``front(i, url)``: the URL the chief knows PS agent ``i`` by (a proxy
    in front of it). Returns the chief, the PS agents, their arguments, the output folder and
    the store."""
    from psguard.ports import free_ports
    from tests.support.agents import FAST, FAST_CHIEF

    cluster, _ = write_cluster(tmp_path, ps=num_ps, workers=1)
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER)
    out, store = tmp_path / "out", tmp_path / "store"
    ports = free_ports(num_ps)
    common = ["--role", "ps", "--cluster", str(cluster), "--store", str(store), *security]
    ps_args = [
        [*common, "--index", str(i), "--spool", str(tmp_path / f"ps{i}-shards"), "--http-port", str(ports[i])]
        for i in range(num_ps)
    ]
    if copies != "none":
        for name, node in [*((f"ps{i}", i) for i in range(num_ps)), ("ps0-again", 0), ("ps1-again", 1)]:
            (tmp_path / name).mkdir()
            (tmp_path / name / "agent.yaml").write_text(FAST + f"node: node-{node}\n")
        (tmp_path / "chief").mkdir()
        mode = "copies: parity, parity_group: 2" if copies == "parity" else f"copies: {copies}"
        (tmp_path / "chief" / "agent.yaml").write_text(FAST_CHIEF.replace("peers: {", f"peers: {{{mode}, "))
    ps = [agents(f"ps{i}", a) for i, a in enumerate(ps_args)]
    worker = agents("worker0", ["--role", "worker", "--index", "0", "--cluster", str(cluster), *security])
    urls = [front(i, a.url) if front is not None else a.url for i, a in enumerate(ps)]
    peers = [arg for url in (*urls, worker.url) for arg in ("--peer", url)]
    args = ["--role", "chief", "--index", "0", "--cluster", str(cluster), "--store", str(store), *security]
    args += ["--spool", str(tmp_path / "spool"), *peers]
    chief = agents("chief", args, [sys.executable, str(script), str(out), str(store), "100"])
    return chief, ps, ps_args, out, store


@pytest.mark.slow
def test_a_ps_lost_with_its_agent_is_rebuilt_from_its_groups_parity(
    tmp_path: Path, agents: Callable[..., AgentProc]
) -> None:
    """``peers: {copies: parity, parity_group: 2}``, three PS agents each on its own node: ps:0 and ps:1 form a
    group whose XOR parity ps:2 holds (ps:2's group of one is held by ps:0). SIGKILL of ps:0 with its agent: the
    new agent's shards are rebuilt by ps:2 from the parity and ps:1's stripe (each checked against its owner's
    digests), so the trainer restores the memory tier's newest state, and the log after stays bit-exact."""
    chief, ps, ps_args, out, store = _node_loss_job(tmp_path, agents, copies="parity", num_ps=3)
    kill = _kill_file(chief, out)
    # The save's acknowledgement names the parity holder of each member whose whole group's parity has it.
    assert kill["copies"] == {"ps:0": "ps:2", "ps:1": "ps:2", "ps:2": "ps:0"}, kill
    status = chief.status()["copies"]
    assert status["mode"] == "parity" and status["parity_groups"] == ["ps:0,ps:1", "ps:2"], status
    assert {t: p["holder"] for t, p in status["parts"].items()} == {"ps:0": "ps:2", "ps:1": "ps:2", "ps:2": "ps:0"}

    def parity_current() -> bool:
        group = ps[2].status()["shards"]["parity_held"].get("ps:0,ps:1") or {}
        return group.get("token") is not None and group.get("token") == chief.status()["memory_token"]

    trainer = _stop_at_a_capture_newer_than_the_log(chief, store, parity_current, "ps:2's parity of ps:0, ps:1")
    group = ps[2].status()["shards"]["parity_held"]["ps:0,ps:1"]
    sizes = [p.status()["shards"]["bytes"] for p in ps[:2]]
    assert group["bytes"] == max(sizes) < sum(sizes), (group, sizes)  # the longest stripe, not both
    _lose_ps0_and_restore(chief, ps, ps_args[0], agents, out, store, trainer, fingerprints="none")  # a stripe has none
    assert "event=peer_copy_used task=ps:0 holder=ps:2" in chief.log()
    assert "event=parity_reconstructed owner=ps:0 holder=ps:2" in ps[2].log()


def _job(
    tmp_path: Path,
    agents: Callable[..., AgentProc],
    name: str,
    num_ps: int,
    store: Path,
    target: int,
    trainer: str = TRAINER,
) -> Path:
    """A job of ``num_ps`` PS agents (each keeping its shards), a worker and the chief running ``trainer`` to
    ``target``, on its own ports and folders, writing to ``store``; returns its output folder once it is done."""
    base = tmp_path / name
    base.mkdir()
    cluster, _ = write_cluster(base, ps=num_ps, workers=1)
    script = base / "trainer.py"
    script.write_text(trainer)
    out = base / "out"
    common = ["--role", "ps", "--cluster", str(cluster), "--store", str(store)]
    ps = [
        agents(f"{name}-ps{i}", [*common, "--index", str(i), "--spool", str(base / f"ps{i}-shards")])
        for i in range(num_ps)
    ]
    worker = agents(f"{name}-worker0", ["--role", "worker", "--index", "0", "--cluster", str(cluster)])
    peers = [arg for a in (*ps, worker) for arg in ("--peer", a.url)]
    args = ["--role", "chief", "--index", "0", "--cluster", str(cluster), "--store", str(store)]
    args += ["--spool", str(base / "spool"), *peers]
    chief = agents(f"{name}-chief", args, [sys.executable, str(script), str(out), str(store), str(target)])
    assert chief.wait_exit(400) == 0, chief.log()
    for a in (*ps, worker):
        a.close()  # the next job reuses nothing of this one but the store
    return out


KEEPS_NEWER = textwrap.dedent(
    """
    import json, os, sys
    import tensorflow as tf
    from psguard.handoff.spool import NewerInMemoryError
    from psguard.handoff.contract import Tier
    from psguard.trainer.manager import CheckpointManager
    from psguard.testbed.model import ModelConfig, RecModel, Trainer, make_optimizer

    out, store_url = sys.argv[1], sys.argv[2]
    os.makedirs(out, exist_ok=True)
    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    strategy = tf.distribute.experimental.ParameterServerStrategy(
        resolver, variable_partitioner=tf.distribute.experimental.partitioners.FixedShardsPartitioner(2)
    )
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    with strategy.scope():
        model = RecModel(ModelConfig(vocab_size=20_000, embedding_dim=8, batch_size=64))
        optimizer = make_optimizer("adagrad")
    trainer = Trainer(strategy, coordinator, model, optimizer)
    manager = CheckpointManager(
        tf.train.Checkpoint(model=model, optimizer=optimizer), store_url, coordinator=coordinator,
        step_counter=model.step,
    )
    manager.restore_or_initialize()
    trainer.train(5)
    durable = manager.save(tiers=frozenset({Tier.MEMORY, Tier.DURABLE})).result(timeout=120)
    trainer.train(10)
    memory = manager.save(tiers=frozenset({Tier.MEMORY}))
    memory.restorable(timeout=120)
    doc = {"durable": durable.step, "memory": int(model.step.numpy())}
    # The trainer's memory restore failed (not the tiers' fault) and it asked the log: the agents refuse.
    try:
        manager._durable_on_the_ps()
        doc["refused"] = None
    except NewerInMemoryError as e:
        doc["refused"] = str(e)
    doc["tiers_after_refusal"] = manager._sink.memory_snapshot(60).step
    # The whole restore with the first memory answer lost: the memory tier all the same.
    real, calls = manager._sink.memory_snapshot, []
    manager._sink.memory_snapshot = lambda timeout: real(timeout) if calls.append(1) or len(calls) > 1 else None
    info, _ = manager._restore_newest()
    manager._sink.memory_snapshot = real
    doc["restored"] = {"source": info.source, "step": info.step, "memory_asks": len(calls)}
    # Forced (the memory state did not load on the PS, or the user named the checkpoint): the log goes in.
    info, snap = manager._durable_on_the_ps(force=True)
    doc["forced"] = {"source": info.source, "step": snap.step, "tiers": manager._sink.memory_snapshot(60).step}
    with open(os.path.join(out, "final"), "w") as f:
        json.dump(doc, f)
    manager.close()
    """
)


@pytest.mark.slow
def test_a_failed_memory_restore_does_not_let_the_log_overwrite_a_newer_state_the_tiers_hold(
    tmp_path: Path, agents: Callable[..., AgentProc]
) -> None:
    """A CI soak: the chief killed, then ps:0 while the new trainer started; its memory restore failed, it asked
    the log, and the log's older step went into every tier, so the next trainer restored it "from memory" and
    the acknowledged newer save was lost. The agents now refuse the log while every PS agent still gives the
    newer state, the trainer asks the memory tier again, and only a forced load (the state did not load, or the
    user named the checkpoint) replaces it."""
    out = _job(tmp_path, agents, "job", 2, tmp_path / "store", 0, trainer=KEEPS_NEWER)
    doc = json.loads((out / "final").read_text())
    assert doc["memory"] > doc["durable"], doc
    assert doc["refused"] and f"step {doc['memory']}" in doc["refused"], doc
    assert doc["tiers_after_refusal"] == doc["memory"]
    assert doc["restored"] == {"source": "memory", "step": doc["memory"], "memory_asks": 2}, doc
    assert doc["forced"] == {"source": "durable", "step": doc["durable"], "tiers": doc["durable"]}, doc
