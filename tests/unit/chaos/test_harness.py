"""The chaos harness's parts without a cluster: history file, scenario files, checkers fed hand-made histories
(each checker must be able to fail: a lost commit, a torn checkpoint, a stale restore, ...), chunk damage on a
real local store, and ``psguard chaos check``."""

from __future__ import annotations

import contextlib
import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from psguard.chaos.checkers import check_all, overall
from psguard.chaos.history import HistoryError, HistoryWriter, Record, operations, read_history
from psguard.chaos.nemesis import damage_chunk
from psguard.chaos.outcomes import fault_outcomes
from psguard.chaos.report import durable_lag, goodput
from psguard.chaos.scenario import Scenario, load_scenario
from psguard.config import from_data
from psguard.errors import ConfigError
from psguard.store import Store
from tests.support.chaos import H, T
from tests.support.paths import ROOT


# ------------------------------------------------------------------------------------------------ history
def test_history_is_appended_in_order_and_read_back(tmp_path: Path) -> None:
    path = tmp_path / "history.jsonl"
    with HistoryWriter(path) as h:
        h.append("nemesis", "invoke", "kill", {"target": "ps:0"})
        h.append("nemesis", "ok", "kill", {"target": "ps:0"})
    records = read_history(path)
    assert [(r.index, r.type, r.f) for r in records] == [(0, "invoke", "kill"), (1, "ok", "kill")]
    assert records[0].time <= records[1].time
    with pytest.raises(HistoryError, match="cannot create"):  # never appended to a history of another run
        HistoryWriter(path)


def test_the_writer_keeps_in_memory_only_the_processes_asked_for_and_writes_every_record(tmp_path: Path) -> None:
    path = tmp_path / "history.jsonl"
    with HistoryWriter(path, keep=frozenset({"nemesis"})) as h:
        h.append("harness", "info", "resources", {"rss": 1})
        h.append("nemesis", "ok", "kill", {"target": "ps:0"})
        h.append("trainer-1", "ok", "train", {"step": 5})
    assert [(r.process, r.f) for r in h.records] == [("nemesis", "kill")]
    assert [r.process for r in read_history(path)] == ["harness", "nemesis", "trainer-1"]


def test_a_history_that_cannot_be_written_stops_the_run(tmp_path: Path) -> None:
    h = HistoryWriter(tmp_path / "history.jsonl")
    os.close(h._fd)  # the file is gone from under the writer (disk error, closed descriptor)
    with pytest.raises(HistoryError, match="stopping the run"):
        h.append("nemesis", "invoke", "kill", {})
    h._fd = -1


def test_a_torn_last_line_is_dropped_a_torn_middle_line_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "history.jsonl"
    good = json.dumps({"index": 0, "time": 1.0, "process": "p", "type": "invoke", "f": "x", "value": {}})
    path.write_text(good + "\n" + '{"index": 1, "ti')
    assert len(read_history(path)) == 1
    path.write_text(good + "\n" + '{"index": 1, "ti' + "\n" + good + "\n")
    with pytest.raises(HistoryError, match=":2: not JSON"):
        read_history(path)


def test_operations_pair_invokes_with_completions_and_unfinished_ones_are_info() -> None:
    recs = [
        Record(0, 1.0, T, "invoke", "train", {"step": 0}),
        Record(1, 2.0, T, "ok", "train", {"step": 5}),
        Record(2, 3.0, T, "invoke", "train", {"step": 5}),
    ]
    ops = operations(recs)
    assert [(o.type, o.value["step"]) for o in ops] == [("ok", 5), ("info", 5)]
    with pytest.raises(HistoryError, match="has no invoke"):
        operations([Record(0, 1.0, T, "ok", "train", {})])


def test_operations_of_one_kind_open_at_once_pair_by_their_op_id() -> None:
    records = [
        Record(0, 1.0, "nemesis", "invoke", "start-agent", {"target": "ps:0", "op_id": 1}),
        Record(1, 1.1, "nemesis", "invoke", "start-agent", {"target": "ps:1", "op_id": 2}),
        Record(2, 2.0, "nemesis", "ok", "start-agent", {"target": "ps:1", "op_id": 2}),
        Record(3, 9.0, "nemesis", "ok", "start-agent", {"target": "ps:0", "op_id": 1}),
    ]
    ops = operations(records)
    assert [(o.value["target"], o.type, o.end) for o in ops] == [("ps:0", "ok", 9.0), ("ps:1", "ok", 2.0)]


# ------------------------------------------------------------------------------------------------ scenarios
@pytest.mark.parametrize("path", sorted((ROOT / "chaos").glob("*.yaml")), ids=lambda p: p.stem)
def test_every_shipped_scenario_validates_and_says_what_it_proves(path: Path) -> None:
    scenario = load_scenario(path)
    assert scenario.name == path.stem
    assert len(scenario.proves.split()) >= 15
    if scenario.soak is not None:  # psguard chaos soak: faults drawn for the duration given on the command line
        assert path.stem.startswith("soak-") and not scenario.faults and scenario.random is None
        assert len(scenario.soak.draw(0, 3600, scenario.cluster)) >= 10, "an hour of it must fault many times"
        return
    assert scenario.schedule(0), "a scenario without faults proves nothing"
    assert scenario.time_limit <= 600


def _scenario(**extra: Any) -> Scenario:
    doc: dict[str, Any] = {"name": "t", "proves": "x", "faults": [{"action": "kill", "target": "ps:0", "at_step": 50}]}
    doc.update(extra)
    return from_data(Scenario, doc, source="t.yaml")


def test_scenario_errors_name_the_file_and_the_key() -> None:
    with pytest.raises(ConfigError, match=r"t\.yaml: faults\[0\]\.targt: unknown key.*did you mean 'target'"):
        _scenario(faults=[{"action": "kill", "targt": "ps:0", "at_step": 5}])
    with pytest.raises(ConfigError, match=r"faults\[0\]\.target: expected an index below 2"):
        _scenario(faults=[{"action": "kill", "target": "ps:2", "at_step": 5}])
    with pytest.raises(ConfigError, match="exactly one of at_step and at_time"):
        _scenario(faults=[{"action": "kill", "target": "ps:0", "at_step": 5, "at_time": 3}])
    with pytest.raises(ConfigError, match="action"):
        _scenario(faults=[{"action": "explode", "target": "ps:0", "at_step": 5}])
    with pytest.raises(ConfigError, match="'store' for corrupt-chunk"):
        _scenario(faults=[{"action": "corrupt-chunk", "target": "ps:0", "at_step": 5}])
    with pytest.raises(ConfigError, match=r"at_step: expected a step below training\.steps"):
        _scenario(faults=[{"action": "kill", "target": "ps:0", "at_step": 400}], training={"steps": 300})
    with pytest.raises(ConfigError, match=r"faults\[0\]\.during: expected gc with training\.max_to_keep set"):
        _scenario(faults=[{"action": "kill", "target": "ps:0", "at_step": 5, "during": "gc"}])
    with pytest.raises(ConfigError, match=r"faults\[0\]\.action: expected store-errors of the store only with"):
        _scenario(faults=[{"action": "store-errors", "target": "store", "at_step": 5}], storage={"kind": "hdfs"})
    with pytest.raises(ConfigError, match="'store' for store-errors"):
        _scenario(faults=[{"action": "store-errors", "target": "ps:0", "at_step": 5}], storage={"kind": "s3"})
    with pytest.raises(ConfigError, match="http_status: expected a 5xx status"):
        _scenario(faults=[{"action": "store-errors", "target": "store", "at_step": 5, "http_status": 404}])
    with pytest.raises(ConfigError, match=r"training\.durable_cron: expected a cron expression that matches a time"):
        _scenario(training={"durable_cron": "0 0 31 2 *"})  # February 31st: durable saves would never come
    assert _scenario(training={"durable_cron": "* * * * * */20"}).training.durable_cron == "* * * * * */20"


def test_agent_faults_aim_at_tasks_and_describe_themselves() -> None:
    s = _scenario(faults=[{"action": "pause-agent", "target": "chief", "at_step": 5, "duration": "3s"},
                          {"action": "terminate-agent", "target": "ps:1", "at_step": 9}])  # fmt: skip
    assert [f.describe() for f in s.schedule(0)] == ["pause-agent chief at step 5", "terminate-agent ps:1 at step 9"]
    with pytest.raises(ConfigError, match="a task"):
        _scenario(faults=[{"action": "kill-agent", "target": "store", "at_step": 5}])


def test_the_same_seed_gives_the_same_random_schedule() -> None:
    s = _scenario(faults=[], random={"count": 10, "actions": ["kill", "pause"], "targets": ["ps:0", "worker:0"]})
    assert s.schedule(7) == s.schedule(7)
    assert s.schedule(7) != s.schedule(8)
    steps = [f.at_step for f in s.schedule(7)]
    assert len(steps) == 10 and steps == sorted(steps)


# ------------------------------------------------------------------------------------------------ checkers
def verdicts(h: H, reference: list[Record] | None = None) -> dict[str, str]:
    return {k: v.status for k, v in check_all(h.records, reference).items()}


def test_a_good_history_is_valid_for_every_checker() -> None:
    h = H().good()
    h.finish()
    ref = H().good()
    ref.finish()
    result = check_all(h.records, ref.records)
    assert {k: v.status for k, v in result.items()} == dict.fromkeys(result, "valid"), result
    assert overall(result) == "valid"


def test_a_lost_durable_commit_is_invalid() -> None:
    h = H().good()
    h.finish(store=[c for c in h.store() if not c["id"].startswith("000000000010")])
    v = check_all(h.records)["durable-commits-kept"]
    assert v.status == "invalid" and v.evidence["missing"] == ["000000000010-aaaaaaaa"]


def test_a_torn_or_phantom_checkpoint_is_invalid_but_nemesis_damage_is_expected() -> None:
    h = H().good()
    torn = h.store()
    torn[0] = {**torn[0], "ok": False, "problems": ["chunk missing"]}
    h.finish(store=[*torn, {"id": "000000000099-bbbbbbbb", "step": 99, "ok": True, "problems": []}])
    v = check_all(h.records)["no-torn-checkpoint"]
    assert v.status == "invalid"
    assert v.evidence["torn"][0]["id"] == torn[0]["id"] and v.evidence["phantoms"] == ["000000000099-bbbbbbbb"]

    damaged = H()
    damaged.restore(0, source=None)
    damaged.commit(0, durable=True)
    damaged.fault("corrupt-chunk", "store", affected=["000000000000-aaaaaaaa"])
    damaged.train(0, 20)
    damaged.finish(store=[{"id": "000000000000-aaaaaaaa", "step": 0, "ok": False, "problems": ["crc"]}])
    assert check_all(damaged.records)["no-torn-checkpoint"].status == "valid"
    # A damaged chunk written whole again by a later checkpoint with the same content is no miss...
    rewritten = H()
    rewritten.commit(0, durable=True)
    rewritten.fault("corrupt-chunk", "store", affected=["000000000000-aaaaaaaa"], chunk="c" * 64)
    rewritten.train(0, 20)
    rewritten.op("harness", "final-store", {}, {"checkpoints": rewritten.store(), "damaged_chunks": {"c" * 64: True}})
    assert check_all(rewritten.records)["no-torn-checkpoint"].status == "valid"
    # ...but damage that no verification notices is a defect of the verification.
    missed = H()
    missed.commit(0, durable=True)
    missed.fault("corrupt-chunk", "store", affected=["000000000000-aaaaaaaa"])
    missed.train(0, 20)
    missed.finish()
    assert check_all(missed.records)["no-torn-checkpoint"].status == "invalid"


def test_restoring_an_older_commit_is_invalid_unless_the_newer_ones_outcome_is_unknown() -> None:
    h = H()
    h.commit(0, durable=True)
    h.train(0, 5)
    h.commit(5, durable=False)
    h.fault()
    h.restore(0, source="durable")  # the memory commit of step 5 was acknowledged: 5 must come back
    h.train(0, 20)
    h.finish()
    v = check_all(h.records)["restore-newest"]
    assert v.status == "invalid" and v.evidence["problems"][0]["newest_ok"] == 5

    unknown = H()
    unknown.commit(0, durable=True)
    unknown.train(0, 5)
    unknown.commit(5, durable=False, type="info")  # the trainer died waiting for the ack: maybe, maybe not
    unknown.fault()
    unknown.restore(0, source="durable")
    unknown.train(0, 20)
    unknown.finish()
    assert check_all(unknown.records)["restore-newest"].status == "valid"


def test_restoring_a_step_nobody_committed_is_invalid() -> None:
    h = H()
    h.commit(0, durable=True)
    h.train(0, 10)
    h.fault()
    h.restore(7)
    h.train(7, 20)
    h.finish()
    assert check_all(h.records)["restore-newest"].status == "invalid"


def test_a_restore_cut_short_by_a_fault_is_judged_by_the_next_one() -> None:
    """The 1-hour soak (seed 1230020514): the chief's trainer restored, then its PS was frozen while the trainer
    took its digest; the trainer exited, its successor restored the same step. The first restore has no completion
    and the fault explains it; one with no fault to explain it stays a problem."""
    h = H()
    h.commit(0, durable=True)
    h.train(0, 5)
    h.commit(5, durable=False)
    h.fault("kill", "chief")
    h.op("trainer-200", "restore", {}, None)  # invoked, never completed
    h.fault("pause", "ps:1")
    h.restore(5, p="trainer-300")
    h.train(5, 20, p="trainer-300")
    h.finish()
    v = check_all(h.records)["restore-newest"]
    assert v.status == "valid", v.evidence
    assert v.evidence["interrupted"][0]["faults"] == ["pause ps:1"] and "1 more cut short" in v.summary

    unexplained = H()
    unexplained.commit(0, durable=True)
    unexplained.fault("kill", "chief")
    unexplained.op("trainer-200", "restore", {}, None)
    unexplained.restore(0, source="durable", p="trainer-300")
    unexplained.train(0, 20, p="trainer-300")
    unexplained.finish()
    v = check_all(unexplained.records)["restore-newest"]
    assert v.status == "invalid" and v.evidence["problems"][0]["why"].startswith("the restore failed")


def test_a_restore_failed_by_a_ps_killed_while_its_trainer_started_is_explained() -> None:
    """The CI soak (stop 40): the chief's trainer killed, then ps:0 killed while the new trainer was building its
    job (before its restore began); that restore failed on the dead incarnation's devices, the next trainer
    restored. The kill came before the failed restore's invoke, after the killed trainer's last record."""
    h = H()
    h.commit(0, durable=True)
    h.train(0, 5)
    h.commit(5, durable=False)
    h.fault("kill", "chief")
    h.fault("kill", "ps:0")
    h.op("trainer-200", "restore", {}, {"error": "device incarnation"}, type="fail")
    h.restore(5, p="trainer-300")
    h.train(5, 20, p="trainer-300")
    h.finish()
    v = check_all(h.records)["restore-newest"]
    assert v.status == "valid", v.evidence
    assert v.evidence["interrupted"][0]["faults"] == ["kill ps:0"]

    # A PS killed before the killed trainer's last record was already behind it: no excuse for the new one.
    early = H()
    early.commit(0, durable=True)
    early.fault("kill", "ps:0")
    early.train(0, 5)
    early.fault("kill", "chief")
    early.op("trainer-200", "restore", {}, {"error": "device incarnation"}, type="fail")
    early.restore(0, source="durable", p="trainer-300")
    early.train(0, 20, p="trainer-300")
    early.finish()
    v = check_all(early.records)["restore-newest"]
    assert v.status == "invalid" and v.evidence["problems"][0]["why"].startswith("the restore failed")


def test_a_dead_chief_agent_takes_the_memory_tier_with_it() -> None:
    h = H()
    h.commit(0, durable=True)
    h.train(0, 5)
    h.commit(5, durable=False)
    h.fault("kill-agent", "chief")
    h.restore(0, source="durable", p="trainer-200")
    h.train(0, 20, p="trainer-200")
    h.finish()
    assert check_all(h.records)["restore-newest"].status == "valid"


def test_a_restore_that_differs_from_its_capture_is_invalid() -> None:
    h = H()
    h.commit(0, durable=True)
    h.train(0, 10)
    h.commit(10, durable=True)
    h.fault()
    h.op(T, "restore", {}, {"step": 10, "source": "memory", "digest": {"*": "other", "embedding": "x"}})
    h.train(10, 20)
    h.finish()
    v = check_all(h.records)["restore-exact"]
    assert v.status == "invalid" and v.evidence["mismatched"][0]["variables_differing"] == ["embedding"]


def test_a_capture_cut_short_by_the_trainers_death_is_still_checked_against_its_digest() -> None:
    """The trainer killed inside a save: the agent already held the capture and the next generation restores it.
    The capture's invoke carries the digest, so the restore is still checked bit for bit (it was once unknown)."""
    h = H()
    h.commit(0, durable=True)
    h.train(0, 5)
    h.op(T, "capture", {"step": 5, "digest": {"*": "d5"}}, None)  # no completion: the trainer died in the save
    h.fault("kill", "chief")
    h.restore(5, source="memory", p="trainer-200")
    h.train(5, 20, p="trainer-200")
    h.finish()
    verdicts = check_all(h.records)
    assert verdicts["restore-exact"].status == "valid", verdicts["restore-exact"]
    assert verdicts["restore-exact"].evidence["matched"] == [{"step": 5, "source": "memory", "digest": "d5"}]
    assert verdicts["restore-newest"].status == "valid", verdicts["restore-newest"]
    h2 = H()
    h2.commit(0, durable=True)
    h2.train(0, 5)
    h2.op(T, "capture", {"step": 5, "digest": {"*": "d5"}}, None)
    h2.fault("kill", "chief")
    h2.restore(5, source="memory", digest="torn", p="trainer-200")
    h2.train(5, 20, p="trainer-200")
    h2.finish()
    assert check_all(h2.records)["restore-exact"].status == "invalid"


def test_lost_work_over_the_bound_is_invalid() -> None:
    h = H()
    h.commit(0, durable=True)
    h.train(0, 5)
    h.train(5, 10)
    h.train(10, 15)  # no commit since step 0: 15 steps lost, bound 5 + 5
    h.fault()
    h.restore(0, source="durable")
    h.train(0, 20)
    h.finish()
    v = check_all(h.records)["lost-work-bounded"]
    assert v.status == "invalid" and v.evidence["faults"][0]["lost_steps"] == 15


def test_recovery_lasts_until_normal_speed_and_counts_the_first_capture_after_the_restore() -> None:
    h = H(target=35)
    h.restore(0, source=None)
    for step in range(0, 20, 5):
        h.train(step, step + 5)  # 0.2 s per 5 steps
    h.commit(20, durable=True)
    h.fault()
    fault_at = h.t
    h.restore(20)
    h.train(20, 25)
    first_steps_at = h.t
    h.t += 3.0  # the first capture after the restore is slow (it traced its functions again)
    h.commit(25, durable=False)
    h.train(25, 30)  # slowed by that capture: not yet normal speed
    h.train(30, 35)
    normal_at = h.t
    h.finish()
    f = fault_outcomes(h.records)[0]
    assert f["resumed_seconds"] == pytest.approx(first_steps_at - fault_at)
    assert f["recovery_seconds"] == pytest.approx(normal_at - fault_at)


def test_a_job_that_never_reaches_its_target_is_not_live() -> None:
    h = H(target=100).good()
    h.finish()
    assert check_all(h.records)["liveness"].status == "invalid"


def test_final_loss_far_from_the_fault_free_run_is_invalid_and_unknown_without_one() -> None:
    h = H().good()
    h.finish()
    ref = H().good()
    ref.op(T, "eval", {}, {"loss": 0.9})
    ref.finish()
    ref.records = [r for r in ref.records if not (r.f == "eval" and r.value.get("loss") == 0.5)]
    assert verdicts(h, ref.records)["final-loss"] == "invalid"
    assert verdicts(h)["final-loss"] == "unknown"


def test_leaked_processes_or_files_are_invalid() -> None:
    h = H().good()
    h.finish(leaks={"alive_pids": [4242], "temp_files": ["/x/spool/incoming/a"]})
    v = check_all(h.records)["no-leaks"]
    assert v.status == "invalid" and "4242" in v.summary


def test_a_fault_that_was_not_injected_makes_the_run_worthless() -> None:
    h = H()
    h.commit(0, durable=True)
    h.op("nemesis", "kill", {"target": "ps:0", "fault": "kill ps:0"}, {"error": "agent down"}, type="fail")
    h.train(0, 20)
    h.finish()
    assert check_all(h.records)["faults-injected"].status == "invalid"


def test_a_fault_that_missed_the_persisters_moment_it_waited_for_is_not_the_fault_asked_for() -> None:
    for found, status in ((True, "valid"), (False, "invalid")):
        h = H().good()
        h.records = [r for r in h.records if r.process != "nemesis"]
        h.fault("kill", "worker:0", moment="compaction", moment_found=found)
        h.finish()
        verdict = check_all(h.records)["faults-injected"]
        assert verdict.status == status, verdict
    missed = {"f": "kill", "target": "worker:0", "why": "no compaction came in time"}
    assert verdict.evidence["not_injected"] == [missed]
    # ... and every moment a scenario can name is one the nemesis knows how to wait for
    moments = _scenario(
        faults=[
            {"action": "kill", "target": "ps:0", "at_step": 5, "during": m}
            for m in ("first-base", "persist", "compaction", "gc")
        ],
        training={"max_to_keep": 2},
    )
    assert [f.describe() for f in moments.faults][-1] == "kill ps:0 at step 5 during a gc"


# ------------------------------------------------------------------------------------------------ nemesis
@pytest.mark.parametrize("mode", ["corrupt", "truncate"])
def test_damaging_a_chunk_on_disk_is_caught_by_verification(tmp_path: Path, mode: str) -> None:
    rng = np.random.default_rng(0)
    table = rng.standard_normal((1000, 8)).astype(np.float32)
    with Store.open(str(tmp_path)) as store:
        base = store.save(0, {"emb": table})
        table[:10] += 1
        from psguard.tensors import Rows

        delta = store.save(10, {"emb": Rows(np.arange(10), table[:10], table.shape)}, parent=base.id)
        done = damage_chunk(tmp_path, mode, random.Random(1))
        assert done["checkpoint"] == delta.id and done["affected"] == [delta.id]
        assert not store.verify(delta.id).ok and store.verify(base.id).ok
        assert store.load_latest().info.id == base.id  # the damaged one is skipped, never restored


# ------------------------------------------------------------------------------------------------ CLI
def _write(records: list[Record], path: Path) -> Path:
    path.write_text("".join(json.dumps(r.to_json()) + "\n" for r in records))
    return path


def test_chaos_check_re_runs_the_checkers_and_says_so_in_its_exit_code(tmp_path: Path) -> None:
    good = H().good()
    good.finish()
    bad = H().good()
    bad.finish(store=[])
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    argv = [sys.executable, "-m", "psguard.cli", "chaos", "check"]
    out = subprocess.run([*argv, str(_write(bad.records, tmp_path / "bad.jsonl"))], capture_output=True, text=True,
                         env=env, timeout=60)  # fmt: skip
    assert out.returncode == 1 and "invalid  durable-commits-kept" in out.stdout, out.stdout + out.stderr
    out = subprocess.run([*argv, str(_write(good.records, tmp_path / "good.jsonl")), "--json"], capture_output=True,
                         text=True, env=env, timeout=60)  # fmt: skip
    assert out.returncode == 5, out.stdout + out.stderr  # no reference run: the loss is unknown
    assert json.loads(out.stdout)["verdicts"]["final-loss"]["status"] == "unknown"
    out = subprocess.run([*argv, str(tmp_path / "nope.jsonl")], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 2 and "no such history file" in out.stderr


# ------------------------------------------------------------------------------------------------ proxy
def _echo_server() -> tuple[Any, int, Any]:
    import socket
    import threading

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    stop = threading.Event()

    def echo(c: Any) -> None:
        try:
            while data := c.recv(4096):
                c.sendall(data)
        except OSError:
            pass  # the proxy reset the connection (drop)
        finally:
            c.close()

    def serve() -> None:
        srv.settimeout(0.2)
        conns = []
        while not stop.is_set():
            try:
                c, _ = srv.accept()
            except OSError:
                continue
            conns.append(c)
            threading.Thread(target=echo, args=(c,), name="echo", daemon=True).start()
        for c in conns:
            c.close()
        srv.close()

    t = threading.Thread(target=serve, name="echo-accept")
    t.start()
    return stop, srv.getsockname()[1], t


def test_the_proxy_forwards_holds_bytes_during_a_partition_and_resets_on_drop() -> None:
    import socket

    from psguard.chaos.proxy import TcpProxy
    from psguard.ports import free_ports

    stop, port, thread = _echo_server()
    proxy = TcpProxy(free_ports(1)[0], port)
    try:
        c = socket.create_connection(("127.0.0.1", proxy.listen_port), timeout=5)
        c.sendall(b"ping")
        assert c.recv(4) == b"ping"
        proxy.set_mode("partition")
        c.sendall(b"held")
        c.settimeout(0.5)
        with pytest.raises(TimeoutError):  # nothing comes back while the path is cut
            c.recv(4)
        proxy.set_mode("pass")  # the heal: what was held flows
        c.settimeout(5)
        assert c.recv(4) == b"held"
        proxy.set_mode("drop")  # open connections are reset, new ones refused
        with contextlib.suppress(ConnectionResetError):
            assert c.recv(1) == b""
        c.close()
        # Reset at connect or at the first read: both refuse.
        with (
            contextlib.suppress(ConnectionResetError),
            socket.create_connection(("127.0.0.1", proxy.listen_port), timeout=5) as fresh,
        ):
            assert fresh.recv(1) == b""
    finally:
        proxy.close()
        stop.set()
        thread.join(5)


def test_the_proxy_closes_what_it_is_done_with_over_many_connections() -> None:
    """A soak's store path opens a connection per request for an hour: the proxy kept every socket, a
    descriptor passed 1024, ``select()`` refused it and the path stayed down for the rest of the run."""
    import os
    import socket
    import time

    from psguard.chaos.proxy import TcpProxy
    from psguard.ports import free_ports

    stop, port, thread = _echo_server()
    proxy = TcpProxy(free_ports(1)[0], port)

    def fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    try:
        before = fds()
        for _ in range(700):  # 1,400 sockets through the proxy, more than select() takes
            with socket.create_connection(("127.0.0.1", proxy.listen_port), timeout=5) as c:
                c.sendall(b"x")
                assert c.recv(1) == b"x"
        deadline = time.monotonic() + 15
        while fds() - before >= 50 and time.monotonic() < deadline:
            time.sleep(0.1)  # the pumps close each connection's sockets on their own threads: nothing to await
        assert fds() - before < 50, fds() - before
        with socket.create_connection(("127.0.0.1", proxy.listen_port), timeout=5) as c:
            c.sendall(b"still")
            assert c.recv(5) == b"still"
    finally:
        proxy.close()
        stop.set()
        thread.join(5)


def test_network_faults_need_a_ps_target_and_turn_the_proxy_on() -> None:
    s = _scenario(faults=[{"action": "partition", "target": "ps:0", "at_step": 5, "duration": 3}])
    assert s.needs_proxy and not _scenario().needs_proxy
    with pytest.raises(ConfigError, match="a PS"):
        _scenario(faults=[{"action": "delay", "target": "worker:0", "at_step": 5}])


def _hung(restore_after: float, hang_after: float | None = 10.0) -> H:
    """Train 0..10, the trainer hangs at 10, a new trainer restores 10 ``restore_after`` seconds later."""
    h = H()
    h.records[0].value["training"]["hang_after"] = hang_after
    h.records[1].value["training"]["hang_after"] = hang_after
    h.restore(0, source=None)
    h.commit(0, durable=True)
    h.train(0, 5)
    h.commit(5, durable=False)
    h.train(5, 10)
    h.commit(10, durable=True)
    h.fault("hang", "chief")
    h.t += restore_after
    h.restore(10)
    h.train(10, 15)
    h.train(15, 20)
    h.finish()
    return h


def test_a_hang_replaced_within_its_bound_is_valid_and_one_never_replaced_is_invalid() -> None:
    assert verdicts(_hung(restore_after=25.0))["hang-detected"] == "valid"
    assert verdicts(_hung(restore_after=500.0))["hang-detected"] == "invalid"
    assert verdicts(_hung(restore_after=25.0, hang_after=None))["hang-detected"] == "unknown"
    h = H().good()
    h.finish()
    assert check_all(h.records)["hang-detected"].status == "valid"  # no hang injected: nothing to detect


def test_a_hang_fault_targets_the_chief_only() -> None:
    from psguard.chaos.scenario import Fault

    assert Fault(action="hang", target="chief", at_step=10).action == "hang"
    with pytest.raises(ConfigError, match="chief for hang"):
        Fault(action="hang", target="ps:0", at_step=10)


def test_goodput_leaves_the_harness_digests_out() -> None:
    """The trainers' restore-exact digests are the harness's time, not training's: 10 steps in 3 s of which 1 s
    digesting is 5 steps/s, and a record without harness_seconds (a user's job) counts as none."""
    records = [
        Record(0, 0.0, T, "invoke", "train", {"step": 0, "steps": 5}),
        Record(1, 1.0, T, "ok", "train", {"step": 5}),
        Record(2, 1.0, T, "invoke", "capture", {"step": 5}),
        Record(3, 2.0, T, "ok", "capture", {"step": 5, "harness_seconds": 1.0}),
        Record(4, 2.0, T, "invoke", "train", {"step": 5, "steps": 5}),
        Record(5, 3.0, T, "ok", "train", {"step": 10}),
    ]
    g = goodput(operations(records), 10)
    assert g["harness_seconds"] == 1.0 and g["seconds"] == 2.0 and g["steps_per_second"] == 5.0
    plain = [
        r if r.f != "capture" or r.type != "ok" else Record(3, 2.0, T, "ok", "capture", {"step": 5}) for r in records
    ]
    assert goodput(operations(plain), 10)["steps_per_second"] == pytest.approx(10 / 3)


def test_recovery_does_not_count_the_harness_digests_as_the_jobs_time() -> None:
    """A capture slowed by 3 s of the harness's digest (harness_seconds) is not a slow job: back at normal speed
    with the first chunk after it, where the same 3 s spent by psguard would delay it (test above)."""
    h = H(target=35)
    h.restore(0, source=None)
    for step in range(0, 20, 5):
        h.t += 1.0  # each chunk trains for about a second
        h.train(step, step + 5)
    h.commit(20, durable=True)
    h.fault()
    fault_at = h.t
    h.restore(20)
    h.t += 1.0
    h.train(20, 25)
    h.rec(T, "invoke", "capture", {"step": 25})
    h.t += 3.0
    h.rec(T, "ok", "capture", {"step": 25, "digest": {"*": "d25"}, "harness_seconds": 3.0})
    h.op(T, "memory-commit", {"step": 25}, {"step": 25})
    h.t += 1.0
    h.train(25, 30)
    normal_at = h.t
    h.t += 1.0
    h.train(30, 35)
    h.finish()
    assert fault_outcomes(h.records)[0]["recovery_seconds"] == pytest.approx(normal_at - fault_at)
    # Without harness_seconds the same history is a slow job: not yet back at normal speed there.
    plain = [
        r if not (r.f == "capture" and r.type == "ok") else Record(r.index, r.time, r.process, r.type, r.f, {})
        for r in h.records
    ]
    assert fault_outcomes(plain)[0]["recovery_seconds"] > normal_at - fault_at + 0.5


def test_the_pace_before_the_first_fault_counts_captures_but_not_the_harness() -> None:
    """Chunks of 5 steps every 1 s with a capture between (psguard's cost: counted) taking 0.5 s of which 0.3 s
    was the harness's digest (not counted); two warm-up chunks skipped; nothing after the fault."""
    records: list[Record] = []
    t = 0.0

    def rec(process: str, type: str, f: str, value: dict[str, Any]) -> None:
        records.append(Record(len(records), t, process, type, f, value))

    for i in range(6):
        rec(T, "invoke", "train", {"step": 5 * i, "steps": 5})
        t += 1.0
        rec(T, "ok", "train", {"step": 5 * i + 5})
        rec(T, "invoke", "capture", {"step": 5 * i + 5})
        t += 0.5
        rec(T, "ok", "capture", {"step": 5 * i + 5, "harness_seconds": 0.3})
    rec("nemesis", "invoke", "kill", {"target": "ps:0"})
    rec("nemesis", "ok", "kill", {"target": "ps:0"})
    rec(T, "invoke", "train", {"step": 30, "steps": 5})
    t += 30.0  # the recovery: not part of the fault-free pace
    rec(T, "ok", "train", {"step": 35})
    pace = goodput(operations(records), 35)["fault_free_steps_per_second"]
    assert pace == pytest.approx(5 / 1.2)  # chunks 3-6: 1.0 s training + 0.5 s capture - 0.3 s harness per 5 steps


def test_the_durable_lag_runs_from_a_saves_capture_to_its_commit() -> None:
    """Step 5's durable save: captured at 1.0 s, committed at 4.0 s, training finished step 15 meanwhile (report
    mode); step 20's held its capture 0.5 s until committed (hold mode): lag 0 steps, 0.7 s."""
    d1, d2 = f"{T}/durable-1", f"{T}/durable-2"
    records = [
        Record(0, 1.0, T, "invoke", "capture", {"step": 5, "tiers": ["durable", "memory"]}),
        Record(1, 1.1, T, "ok", "capture", {"step": 5, "hold": 0.0}),
        Record(2, 1.1, d1, "invoke", "durable-commit", {"step": 5}),
        Record(3, 1.2, T, "invoke", "train", {"step": 5, "steps": 10}),
        Record(4, 3.0, T, "ok", "train", {"step": 15}),
        Record(5, 4.0, d1, "ok", "durable-commit", {"step": 5, "asked": 5, "id": "a"}),
        Record(6, 5.0, T, "invoke", "capture", {"step": 20, "tiers": ["memory"]}),
        Record(7, 5.1, T, "ok", "capture", {"step": 20}),
        Record(8, 6.0, T, "invoke", "capture", {"step": 20, "tiers": ["durable", "memory"]}),
        Record(9, 6.7, T, "ok", "capture", {"step": 20, "hold": 0.5}),
        Record(10, 6.7, d2, "invoke", "durable-commit", {"step": 20}),
        Record(11, 6.7, d2, "ok", "durable-commit", {"step": 20, "asked": 20, "id": "b"}),
    ]
    lag = durable_lag(operations(records))
    assert lag == {"commits": 2, "committed_steps": [5, 20], "max_seconds": 3.0, "mean_seconds": 1.85, "max_steps": 10,
                   "hold_seconds": 0.5}  # fmt: skip
    assert durable_lag(operations(records[:5]))["commits"] == 0  # no commit yet: nothing measured
