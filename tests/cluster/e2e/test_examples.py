"""The examples in integrations/examples: existing-style PS scripts, unmodified and after the one-line change.

Each runs under ``psguard wrap`` exactly as its docstring tells a user (1 PS, 1 worker, a real TF cluster on
loopback). The unmodified scripts prove that wrap needs no code change; the changed ones that the change
alone gives psguard checkpoints in the store, and that a second run resumes from them.
"""

from __future__ import annotations

import ast
import difflib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from psguard.store import Store
from tests.support.paths import ROOT

EXAMPLES = ROOT / "integrations" / "examples"
ENV = dict(os.environ, PYTHONPATH=str(ROOT), TF_CPP_MIN_LOG_LEVEL="3", TF_ENABLE_ONEDNN_OPTS="0")


def _code_lines(path: Path) -> list[str]:
    """The script without its module docstring (which says what the file is), blank lines dropped."""
    source = path.read_text()
    tree = ast.parse(source)
    first = tree.body[0]
    assert isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant), f"{path}: no module docstring"
    lines = source.splitlines()[first.end_lineno or 0 :]
    return [line.strip() for line in lines if line.strip()]


@pytest.mark.parametrize(
    ("folder", "changed"),
    [
        (
            "custom_loop",
            {
                "+import psguard",
                "-manager = tf.train.CheckpointManager(checkpoint, args.checkpoint_dir, max_to_keep=3)",
                "+manager = psguard.CheckpointManager(checkpoint, args.checkpoint_dir, max_to_keep=3)",
            },
        ),
        (
            "tutorial_custom_loop",
            {
                "+import psguard",
                "-checkpoint_manager = tf.train.CheckpointManager(",
                "+checkpoint_manager = psguard.CheckpointManager(",
            },
        ),
        (
            "keras_fit",
            {
                "+import psguard.keras",
                "-callbacks=[tf.keras.callbacks.BackupAndRestore(args.backup_dir)],",
                "+callbacks=[psguard.keras.CheckpointCallback(args.backup_dir, save_freq=5)],",
            },
        ),
    ],
)
def test_the_psguard_version_differs_by_one_line_and_its_import(folder: str, changed: set[str]) -> None:
    before = _code_lines(EXAMPLES / folder / "train.py")
    after = _code_lines(EXAMPLES / folder / "train_psguard.py")
    diff = {
        line
        for line in difflib.unified_diff(before, after, lineterm="", n=0)
        if line[:1] in "+-" and not line.startswith(("+++", "---"))
    }
    assert diff == changed


def _wrap(tmp_path: Path, script: Path, *args: str, store: Path | None = None) -> list[dict[str, Any]]:
    """Run ``psguard wrap [--store] -- python script args`` (1 PS, 1 worker); the JSON lines it printed."""
    argv = [sys.executable, "-m", "psguard.cli", "wrap", "--ps", "1", "--workers", "1", "--dir", str(tmp_path / "w")]
    if store is not None:
        argv += ["--store", str(store)]
    argv += ["--", sys.executable, str(script), *args]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=ENV, cwd=tmp_path)
    assert out.returncode == 0, f"{out.stdout}\n{out.stderr}"
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


@pytest.mark.slow
def test_unmodified_custom_loop_runs_under_wrap_and_writes_tf_checkpoints(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    events = _wrap(tmp_path, EXAMPLES / "custom_loop" / "train.py", "--checkpoint-dir", str(ckpt), "--steps", "30")
    assert events == [{"event": "start", "restored": False, "step": 0}, {"event": "done", "step": 30}]
    # tf.train.CheckpointManager's own bookkeeping: the last save is the newest checkpoint.
    assert 'model_checkpoint_path: "ckpt-30"' in (ckpt / "checkpoint").read_text()
    assert (ckpt / "ckpt-30.index").exists()


@pytest.mark.slow
def test_custom_loop_with_the_change_checkpoints_to_the_store_and_resumes(tmp_path: Path) -> None:
    store = tmp_path / "store"
    script = EXAMPLES / "custom_loop" / "train_psguard.py"
    first = _wrap(tmp_path, script, "--checkpoint-dir", str(store), "--steps", "30", store=store)
    assert first == [{"event": "start", "restored": False, "step": 0}, {"event": "done", "step": 30}]
    with Store.open(str(store)) as s:
        # A durable save asked for while the previous one is still being written is folded into the next write
        # (the agent's persister coalesces them, PersistEvent.coalesced): loaded, step 20 can commit as part of 30.
        steps = [c.step for c in s.checkpoints()]
        assert steps[-1] == 30 and set(steps) <= {10, 20, 30} and steps == sorted(steps), steps
        assert all(s.verify(c.id).ok for c in s.checkpoints())
        names = set(s.load_latest().tensors)
    assert any("embedding" in n for n in names) and any("optimizer" in n for n in names)

    second = _wrap(tmp_path, script, "--checkpoint-dir", str(store), "--steps", "50", store=store)
    assert second == [{"event": "start", "restored": True, "step": 30}, {"event": "done", "step": 50}]
    with Store.open(str(store)) as s:
        latest = s.latest()
        assert latest is not None and latest.step == 50


@pytest.mark.slow
def test_unmodified_keras_fit_runs_under_wrap(tmp_path: Path) -> None:
    events = _wrap(tmp_path, EXAMPLES / "keras_fit" / "train.py", "--backup-dir", str(tmp_path / "b"), "--epochs", "2")
    assert events == [{"event": "done", "iterations": 20, "epochs_run": [0, 1]}]


@pytest.mark.slow
def test_keras_fit_with_the_change_checkpoints_to_the_store_and_resumes(tmp_path: Path) -> None:
    store = tmp_path / "store"
    script = EXAMPLES / "keras_fit" / "train_psguard.py"
    first = _wrap(tmp_path, script, "--backup-dir", str(store), "--epochs", "2", store=store)
    assert first == [{"event": "done", "iterations": 20, "epochs_run": [0, 1]}]
    with Store.open(str(store)) as s:
        latest = s.latest()
        assert latest is not None and latest.step == 20  # save_at_end: the final state is durable
        assert latest.metadata["data_position"]["keras_fit"]["epoch"] == 1

    # Three epochs now: fit resumes after the two already done (BackupAndRestore would have deleted its backup).
    second = _wrap(tmp_path, script, "--backup-dir", str(store), "--epochs", "3", store=store)
    assert second == [{"event": "done", "iterations": 30, "epochs_run": [2]}]


# Runs an example unchanged, except that its first save (of its first run only) waits until the test has
# killed a PS: the kill then lands mid-training whatever the machine's speed.
GATE = """
import os, runpy, sys, time
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
import tensorflow as tf
example, gate = sys.argv[1], os.environ["GATE"]
original = tf.train.CheckpointManager.save

def save(self, *args, **kwargs):
    path = original(self, *args, **kwargs)
    if not os.path.exists(gate + ".passed"):
        open(gate + ".passed", "w").close()
        with open(gate + ".saved.tmp", "w") as f:  # the run's agent token (wrap shares one), for the test
            f.write(os.environ.get("PSGUARD_AGENT_TOKEN_FILE", ""))
        os.rename(gate + ".saved.tmp", gate + ".saved")
        while not os.path.exists(gate + ".killed"):
            time.sleep(0.05)
    return path

tf.train.CheckpointManager.save = save
sys.argv = sys.argv[1:]
runpy.run_path(example, run_name="__main__")
"""


@pytest.mark.slow
def test_unmodified_custom_loop_survives_a_killed_ps_under_wrap(tmp_path: Path) -> None:
    """No psguard in the script: a PS dies, the coordinator raises, the script crashes; its agent restarts every
    PS and the script, which restores its own TF checkpoint and finishes."""
    from psguard.handoff.client import http_json, read_token

    gate, ckpt, work = tmp_path / "gate", tmp_path / "ckpt", tmp_path / "w"
    (tmp_path / "gate.py").write_text(GATE)
    script = EXAMPLES / "custom_loop" / "train.py"
    argv = [sys.executable, "-m", "psguard.cli", "wrap", "--ps", "1", "--workers", "1", "--dir", str(work), "--"]
    argv += [sys.executable, str(tmp_path / "gate.py"), str(script), "--checkpoint-dir", str(ckpt)]
    argv += ["--steps", "40", "--save-every", "10"]
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(ENV, GATE=str(gate))
    )
    try:
        deadline = time.monotonic() + 300
        while not Path(f"{gate}.saved").exists():  # the trainer writes it after its first save: then it waits
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "no first save within 300s"
            time.sleep(0.1)
        url = (work / "agents" / "ps0" / "url").read_text().strip()
        token = read_token(Path(f"{gate}.saved").read_text())
        code, status = http_json("GET", f"{url}/status", token=token)
        assert code == 200 and status["state"] == "running"
        os.kill(int(status["pid"]), signal.SIGKILL)
        Path(f"{gate}.killed").touch()
        out, err = proc.communicate(timeout=400)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, f"{out}\n{err}"
    events = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert events == [
        {"event": "start", "restored": False, "step": 0},
        {"event": "start", "restored": True, "step": 10},  # the checkpoint saved before the kill
        {"event": "done", "step": 40},
    ]
    assert 'model_checkpoint_path: "ckpt-40"' in (ckpt / "checkpoint").read_text()
    ps_log = (work / "agents" / "ps0" / "agent.log").read_text()
    assert "event=restart_requested" in ps_log  # the new trainer generation restarted the PS again


EVALUATOR_TRAINER = """
import sys
sys.path.insert(0, sys.argv[2])
import tensorflow as tf
import psguard
from train_psguard import Model

model = Model()
accum = tf.Variable(tf.zeros_like(model.embedding))  # stands for the optimizer's slots the evaluator ignores
ckpt = tf.train.Checkpoint(model=model, optimizer=tf.train.Checkpoint(accum=accum))
with psguard.CheckpointManager(ckpt, sys.argv[1], step_counter=model.step) as manager:
    for _ in range(3):
        ids = tf.constant([[1, 2], [3, 4], [5, 6]], dtype=tf.int64)
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(ids) - 1.0))
        grads = tape.gradient(loss, [model.embedding, model.kernel, model.out])
        for var, grad in zip([model.embedding, model.kernel, model.out], grads):
            var.assign_sub(0.1 * tf.convert_to_tensor(grad))
        accum.assign_add(tf.ones_like(accum))
        model.step.assign_add(1)
        manager.save()
"""


@pytest.mark.slow
def test_the_evaluator_example_follows_a_store_and_writes_tensorboard_scalars(tmp_path: Path) -> None:
    store = str(tmp_path / "store")
    script = tmp_path / "trainer.py"
    script.write_text(EVALUATOR_TRAINER)
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    subprocess.run(
        [sys.executable, str(script), store, str(EXAMPLES / "custom_loop")], check=True, timeout=300, env=env
    )
    logdir = tmp_path / "eval"
    argv = [sys.executable, str(EXAMPLES / "evaluator" / "evaluate.py"), "--checkpoint-dir", store]
    argv += ["--logdir", str(logdir), "--metrics-port", "0", "--poll-interval", "0.1", "--until-step", "3"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert lines and lines[-1]["step"] == 3 and lines[-1]["loss"] > 0, done.stdout
    import tensorflow as tf

    tags = {
        (value.tag, event.step)
        for path in logdir.glob("events.out.tfevents.*")
        for event in tf.compat.v1.train.summary_iterator(str(path))
        for value in event.summary.value
    }
    assert ("eval/loss", 3) in tags and ("eval/lag_seconds", 3) in tags, tags
