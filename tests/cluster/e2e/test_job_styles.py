"""Real job styles under ``psguard wrap``, a PS killed mid-training: tests/jobs/ holds training scripts written
the way users copy them from public docs (TF's parameter-server tutorial, its ``Model.fit`` section, Model
Garden's ``orbit.Controller``, a TensorFlow Recommenders DCN ranking model, a tf_keras Adam custom loop).

Each style runs twice, under ``psguard wrap --ps 2 --workers 2 --store STORE -- python SCRIPT ...``:

- ``tf``: the script as written, checkpointing with TF's own ``tf.train.CheckpointManager`` (or Keras'
  ``BackupAndRestore`` / ``ModelCheckpoint``): zero-code supervision, the agents restart what died;
- ``psguard``: the same script after the one-line change applied here mechanically
  (``tf.train.CheckpointManager(`` -> ``psguard.CheckpointManager(`` plus ``import psguard``; for ``model.fit``
  ``tf.keras.callbacks.BackupAndRestore(`` -> ``psguard.keras.CheckpointCallback(`` plus ``import psguard.keras``),
  its checkpoints going to the store.

Once the job reported progress (a line after which a checkpoint exists and training is left), the test SIGKILLs
PS 0's ``tf.distribute.Server`` (its pid from the PS agent's ``/status``). The coordinator raises, the trainer
dies, its agent restarts the PS servers and the trainer, which must resume from a checkpoint (not from
scratch), finish at its last step, and end in a state bit-identical to a fresh read of its newest checkpoint:
the script's last line is its final step and a digest of every variable its checkpoint holds
(tests/jobs/final_state.py); the test digests the newest checkpoint (TF's with ``tf.train.load_checkpoint``,
psguard's with ``Store.load_latest()``) and compares.
"""

from __future__ import annotations

import ast
import difflib
import importlib.util
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest

from psguard.agent.wrap import CHIEF_CONFIG
from psguard.handoff.client import http_json
from psguard.handoff.credentials import create_token_file
from psguard.store import Store
from tests.support.paths import ROOT

JOBS = ROOT / "tests" / "jobs"
# PYTHONUNBUFFERED: the scripts print without flush (as the docs do) and the test waits for their lines.
ENV = dict(
    os.environ,
    PYTHONPATH=os.pathsep.join([str(ROOT), str(JOBS)]),
    PYTHONUNBUFFERED="1",
    TF_CPP_MIN_LOG_LEVEL="3",
    TF_ENABLE_ONEDNN_OPTS="0",
)
VARIABLE_SUFFIX = "/.ATTRIBUTES/VARIABLE_VALUE"
START_TIMEOUT = 300.0  # cluster up, TF imported, first checkpoint written: 20-40 s alone on 2 cores
RUN_TIMEOUT = 480.0  # the rest: a crash, PS and trainer restarts, the remaining steps


@dataclass(frozen=True)
class Style:
    script: str  # under tests/jobs, or a path from the repository's root
    fit: bool  # model.fit (the change is to the callback) or a custom loop (to the manager)
    last_step: int
    #: A line printed once a checkpoint exists, with training left to do: the PS is killed when it shows.
    kill_after: str
    #: A line with one integer: where a run starts (``per_run``: printed once per run) or the epoch it enters.
    start: str
    per_run: bool
    #: The restarted run must start at least here: it resumed from the checkpoint written before the kill.
    resumed_at_least: int
    #: The arguments: ``ckpt`` is where the script's checkpointing writes (the store URL for ``psguard``).
    args: Callable[[Path, str], list[str]]
    #: (``tf`` variant) the newest checkpoint's prefix in the run folder.
    newest: Callable[[Path], str | None]
    #: Appended to a script that is also a user-facing example (it cannot call the test's hook itself).
    report: str = ""

    def source(self) -> str:
        """The script's text as the test runs it (the ``tf`` variant)."""
        path = JOBS / self.script if (JOBS / self.script).is_file() else ROOT / self.script
        return path.read_text() + self.report


def _latest(folder: str) -> Callable[[Path], str | None]:
    def newest(run: Path) -> str | None:
        import tensorflow as tf

        return tf.train.latest_checkpoint(str(run / folder))  # type: ignore[no-any-return]

    return newest


STYLES = {
    # TF tutorial, custom loop: StringLookup in dataset_fn, MinSizePartitioner Embedding, legacy RMSprop never built
    # before the restore, Accuracy on the PS, 4 epochs of 5 steps, a save after each epoch's join.
    # It is the example users copy (integrations/examples/tutorial_custom_loop), with the test's report appended.
    "tutorial_ctl": Style(
        script="integrations/examples/tutorial_custom_loop/train.py",
        fit=False,
        last_step=20,
        kill_after=r"^Finished epoch 0,",
        start=r"^Starting at epoch (\d+)",
        per_run=True,
        resumed_at_least=1,
        args=lambda run, ckpt: [ckpt],
        newest=_latest("ckpt"),
        report=(
            "\nfrom final_state import report\n\n"
            "report(checkpoint_manager.checkpoint, step=optimizer.iterations.numpy())\n"
        ),
    ),
    # TF tutorial, Model.fit: DatasetCreator, steps_per_execution=10, TensorBoard + ModelCheckpoint (a SavedModel
    # per epoch) + BackupAndRestore(backup_dir=...); 5 epochs of 20 steps.
    "tutorial_fit": Style(
        script="tutorial_fit.py",
        fit=True,
        last_step=100,
        kill_after=r"^Epoch 2/",
        start=r"^Epoch (\d+)/",
        per_run=False,
        resumed_at_least=2,
        args=lambda run, ckpt: [str(run / "work"), ckpt],
        newest=lambda run: str(run / "work" / "ckpt" / "variables" / "variables"),
    ),
    # orbit.Controller: saves every 10 steps (steps_per_loop 5, step_counter), restores in its constructor.
    "orbit": Style(
        script="orbit_controller.py",
        fit=False,
        last_step=40,
        kill_after=r"^saved checkpoint to ",
        start=r"^train \| step:\s+(\d+) \| training until step",
        per_run=True,
        resumed_at_least=5,
        args=lambda run, ckpt: [ckpt],
        newest=_latest("ckpt"),
    ),
    # TFRS DCN ranking model (Cross layer, lookups + partitioned embeddings in the model), model.fit on a dataset,
    # ModelCheckpoint(weights) + BackupAndRestore(backup_dir); 4 epochs of 10 steps.
    "tfrs_dcn": Style(
        script="tfrs_dcn.py",
        fit=True,
        last_step=40,
        kill_after=r"^Epoch 2/",
        start=r"^Epoch (\d+)/",
        per_run=False,
        resumed_at_least=2,
        args=lambda run, ckpt: [str(run / "work"), ckpt],
        newest=_latest("work"),
    ),
    # Custom loop, tf_keras Adam (non-legacy) never built before `ckpt.restore(manager.latest_checkpoint)`;
    # a save every 10 of 40 steps, numbered by save_counter.
    "keras_adam_ctl": Style(
        script="keras_adam_ctl.py",
        fit=False,
        last_step=40,
        kill_after=r"^Saved checkpoint for step 10:",
        start=r"^Starting at step (\d+)",
        per_run=True,
        resumed_at_least=10,
        args=lambda run, ckpt: [ckpt],
        newest=_latest("ckpt"),
    ),
}


def _final_state() -> ModuleType:
    """tests/jobs/final_state.py, whose ``digest`` the test applies to checkpoints (TF is imported lazily there)."""
    spec = importlib.util.spec_from_file_location("final_state", JOBS / "final_state.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ----------------------------------------------------------------------------------------- the one-line change
def with_psguard(source: str, *, fit: bool) -> str:
    """The script after the one-line change, made mechanically (the script must hold the call exactly once)."""
    old, new, line = (
        ("tf.keras.callbacks.BackupAndRestore(", "psguard.keras.CheckpointCallback(", "import psguard.keras")
        if fit
        else ("tf.train.CheckpointManager(", "psguard.CheckpointManager(", "import psguard")
    )
    anchor = "import tensorflow as tf\n"
    assert source.count(old) == 1, f"the script must call {old} exactly once"
    assert source.count(anchor) == 1
    return source.replace(old, new).replace(anchor, f"{anchor}{line}\n")


@pytest.mark.parametrize("name", sorted(STYLES))
def test_the_psguard_variant_differs_by_one_line_and_its_import(name: str) -> None:
    style = STYLES[name]
    before = style.source()
    after = with_psguard(before, fit=style.fit)
    changed = [
        line
        for line in difflib.unified_diff(before.splitlines(), after.splitlines(), lineterm="", n=0)
        if line[:1] in "+-" and not line.startswith(("+++", "---"))
    ]
    assert len(changed) == 3, changed
    assert changed[0] == ("+import psguard.keras" if style.fit else "+import psguard")
    removed, added = changed[1:]
    assert removed.startswith("-") and added.startswith("+")
    # The script as written knows nothing about psguard (its docstring says how to run it under psguard wrap).
    imported = {
        alias.name for node in ast.walk(ast.parse(before)) if isinstance(node, ast.Import) for alias in node.names
    }
    imported |= {node.module or "" for node in ast.walk(ast.parse(before)) if isinstance(node, ast.ImportFrom)}
    assert not any(module.split(".")[0] == "psguard" for module in imported), imported


def test_final_state_digests_dtype_shape_and_bytes() -> None:
    digest = _final_state().digest
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    assert digest(a) == digest(a.copy()) == digest(np.asfortranarray(a))
    assert digest(a) != digest(a.reshape(3, 2)) and digest(a) != digest(a.astype(np.float64))
    assert digest(np.int64(5)) == digest(np.array(5, dtype=np.int64))


def test_the_final_state_is_looked_up_by_key_then_by_value() -> None:
    digest = _final_state().digest
    kernel, slot = np.arange(4, dtype=np.float32), np.ones(4, dtype=np.float32)
    state = {"model/kernel": digest(kernel), "optimizer/slot": digest(slot)}
    assert _differences(state, {"model/kernel": kernel, "elsewhere/slot": slot}) == []
    assert _differences(state, {"model/kernel": kernel + 1, "elsewhere/slot": slot}) == [
        "model/kernel: differs from the checkpoint's"
    ]
    assert _differences(state, {"model/kernel": kernel, "elsewhere/slot": slot * 2}) == [
        "optimizer/slot: no tensor of the checkpoint has its value"
    ]


# ----------------------------------------------------------------------------------------- running a job
@dataclass
class Run:
    code: int
    lines: list[str]  # the job's stdout (the trainer's output, every run of it)
    killed_at: int  # how many of those lines were out when the PS was killed
    err: str  # wrap's stderr: the trainers' tracebacks and the chief agent's events (-v)

    def tail(self) -> str:
        return f"stdout:\n{''.join(self.lines)[-4000:]}\nstderr:\n{self.err[-6000:]}"


_CHIEF_EXIT = re.compile(r"event=exited task=chief:0 pid=\d+ exit_code=(\S+)")


def _chief_exits(err_path: Path) -> list[str]:
    """Exit codes of the trainer's runs so far, from the chief agent's events on wrap's stderr."""
    return _CHIEF_EXIT.findall(err_path.read_text(errors="replace"))


def _kill_ps0(work: Path, token: str) -> int:
    url = (work / "agents" / "ps0" / "url").read_text().strip()
    code, status = http_json("GET", f"{url}/status", token=token)
    assert code == 200 and status["state"] == "running" and status["pid"], status
    os.kill(int(status["pid"]), signal.SIGKILL)
    return int(status["pid"])


def run_job(
    style: Style,
    script: Path,
    run: Path,
    ckpt: str,
    store: Path,
    *,
    kill: Callable[[Path, str], int] = _kill_ps0,
    wrap_args: Sequence[str] = (),
) -> Run:
    """``psguard -v wrap`` the script, SIGKILL PS 0 (or its node: ``kill``) once ``style.kill_after`` shows, wait
    for the end.

    Fails fast (stopping wrap, which stops everything it started) when the trainer exits before the kill, or
    when it exits with an error a second time after it: the chief's agent would otherwise retry until its
    crash-loop limit.
    """
    token = create_token_file("psguard-test-token-")
    work, err_path = run / "wrap", run / "wrap.err"
    argv = [sys.executable, "-m", "psguard.cli", "-v", "wrap", "--ps", "2", "--workers", "2", "--dir", str(work)]
    argv += ["--store", str(store), "--token-file", str(token.path), *wrap_args, "--"]
    argv += [sys.executable, str(script), *style.args(run, ckpt)]
    lines: list[str] = []
    arrived: queue.Queue[str | None] = queue.Queue()
    with open(err_path, "w") as err:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, text=True, env=ENV, cwd=run)

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            arrived.put(line)
        arrived.put(None)

    reader = threading.Thread(target=read, name="job-stdout", daemon=True)
    reader.start()
    killed_at = -1
    try:
        deadline = time.monotonic() + START_TIMEOUT
        pattern = re.compile(style.kill_after)
        while killed_at < 0 and time.monotonic() < deadline:
            try:
                line = arrived.get(timeout=0.5)
            except queue.Empty:
                if _chief_exits(err_path):
                    break  # the trainer ended before it reported progress: no point in waiting
                continue
            if line is None:
                break  # wrap exited: reported below
            lines.append(line)
            if pattern.search(line):
                kill(work, token.token)
                killed_at = len(lines)
        deadline = time.monotonic() + RUN_TIMEOUT
        while killed_at >= 0 and time.monotonic() < deadline:
            try:
                line = arrived.get(timeout=0.5)
            except queue.Empty:
                if len([c for c in _chief_exits(err_path) if c != "0"]) > 1:
                    break  # the restarted trainer failed too
                continue
            if line is None:
                break  # wrap exited
            lines.append(line)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # wrap stops the chief's agent, then every other one
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        reader.join(timeout=30)
        token.remove()
    while (line := arrived.get_nowait() if not arrived.empty() else None) is not None:
        lines.append(line)
    (run / "job.out").write_text("".join(lines))  # beside wrap.err, for a post-mortem
    result = Run(proc.returncode, lines, killed_at, err_path.read_text(errors="replace"))
    if killed_at < 0:
        exits = _CHIEF_EXIT.findall(result.err)
        why = f"the trainer exited {', '.join(exits)} first" if exits else f"wrap exited {result.code}"
        pytest.fail(f"the job did not report progress ({style.kill_after!r}): {why}\n{result.tail()}")
    return result


# ----------------------------------------------------------------------------------------- checkpoints
def _tf_checkpoint(prefix: str) -> dict[str, np.ndarray]:
    import tensorflow as tf

    reader = tf.train.load_checkpoint(prefix)
    return {
        key.removesuffix(VARIABLE_SUFFIX): np.asarray(reader.get_tensor(key))
        for key in reader.get_variable_to_shape_map()
        if key.endswith(VARIABLE_SUFFIX)
    }


def _psguard_checkpoint(store: Path) -> dict[str, np.ndarray]:
    with Store.open(str(store)) as s:
        loaded = s.load_latest()
    return {name.removesuffix(VARIABLE_SUFFIX): np.asarray(value) for name, value in loaded.tensors.items()}


def _differences(state: dict[str, str], tensors: dict[str, np.ndarray]) -> list[str]:
    """Variables of the final state that the checkpoint does not hold bit for bit.

    By checkpoint key where the checkpoint has the variable's key; otherwise by value (a model.fit job's
    ModelCheckpoint, or psguard's callback, roots the object graph elsewhere than ``report`` did).
    """
    digest = _final_state().digest
    digests = {name: digest(value) for name, value in tensors.items()}
    values = set(digests.values())
    out = []
    for path, want in sorted(state.items()):
        if path in digests:
            if digests[path] != want:
                out.append(f"{path}: differs from the checkpoint's")
        elif want not in values:
            out.append(f"{path}: no tensor of the checkpoint has its value")
    return out


# ----------------------------------------------------------------------------------------- the suite
@pytest.mark.slow
@pytest.mark.parametrize("variant", ["tf", "psguard"])
@pytest.mark.parametrize("name", list(STYLES))
def test_job_style_survives_a_killed_ps(name: str, variant: str, tmp_path: Path) -> None:
    style = STYLES[name]
    store = tmp_path / "store"
    script = tmp_path / "jobs" / Path(style.script).name  # not the style's name: `orbit.py` would shadow orbit
    script.parent.mkdir()
    if variant == "tf":
        script.write_text(style.source())
        ckpt = str(tmp_path / "ckpt")
    else:
        script.write_text(with_psguard(style.source(), fit=style.fit))
        ckpt = str(store)  # the manager's directory is the store wrap's agents write (the same URL)
    run = run_job(style, script, tmp_path, ckpt, store)
    check_resumed_and_finished(style, run, tmp_path, variant, store)


def check_resumed_and_finished(style: Style, run: Run, tmp_path: Path, variant: str, store: Path) -> None:
    """The kill crashed the trainer, the restarted one resumed from a checkpoint and finished in its state."""
    assert run.code == 0, f"wrap exited {run.code}\n{run.tail()}"

    # The kill crashed the trainer once, and the restarted one finished.
    exits = _CHIEF_EXIT.findall(run.err)
    assert len(exits) >= 2 and exits[-1] == "0", f"trainer exits {exits}: not restarted after the kill\n{run.tail()}"
    # It resumed from the checkpoint written before the kill, not from scratch.
    start = re.compile(style.start)
    before = [int(m.group(1)) for line in run.lines[: run.killed_at] if (m := start.search(line))]
    after = [int(m.group(1)) for line in run.lines[run.killed_at :] if (m := start.search(line))]
    assert before and before[0] in (0, 1), f"the first run did not start fresh: {before}\n{run.tail()}"
    assert after, f"no run started after the kill\n{run.tail()}"
    if not style.per_run:  # an epoch line: the restarted fit goes back to the epoch the kill interrupted
        assert after[0] <= before[-1], f"epochs {before} then {after}: no restart seen\n{run.tail()}"
    assert after[0] >= style.resumed_at_least, f"restarted at {after[0]}, not from the checkpoint\n{run.tail()}"

    # It finished at its last step, in the state its newest checkpoint holds.
    finals = [doc for line in run.lines if line.startswith("{") and (doc := _json(line)).get("event") == "final"]
    assert finals, f"no final state reported\n{run.tail()}"
    final = finals[-1]
    assert final["step"] == style.last_step, run.tail()
    if variant == "tf":
        prefix = style.newest(tmp_path)
        assert prefix is not None, f"no TF checkpoint\n{run.tail()}"
        tensors = _tf_checkpoint(prefix)
    else:
        tensors = _psguard_checkpoint(store)
    assert final["state"], "the job reported no variables"
    assert _differences(final["state"], tensors) == []


def _json(line: str) -> dict[str, Any]:
    try:
        doc = json.loads(line)
    except ValueError:
        return {}
    return doc if isinstance(doc, dict) else {}


# ----------------------------------------------------------------------------------------- in-process recovery
#: The tutorial's custom loop in the form the user guide teaches for an in-process recovery (``build`` / ``train``
#: under ``psguard.run_with_recovery``): the trainer never exits, its process rebuilds and restores. An example
#: users copy, with the test's report appended.
IN_PROCESS = Style(
    script="integrations/examples/tutorial_custom_loop/train_in_process.py",
    fit=False,
    last_step=20,
    kill_after=r"^Finished epoch 0,",
    start=r"^Starting at epoch (\d+)",
    per_run=True,
    resumed_at_least=1,
    args=lambda run, ckpt: [ckpt],
    newest=_latest("ckpt"),
    report=(
        "\nfrom final_state import report\n\n"
        'report(job["manager"].checkpoint, step=job["optimizer"].iterations.numpy())\n'
    ),
)
_GENERATION = re.compile(r"event=generation_ready task=chief:0 generation=\d+ seconds=\S+ outcome=(\{.*\})")


@pytest.mark.slow
@pytest.mark.parametrize("keep_survivors", [False, True])
def test_the_tutorial_in_process_form_recovers_without_a_new_trainer_process(
    keep_survivors: bool, tmp_path: Path
) -> None:
    """PS 0 killed under the tutorial written with ``run_with_recovery``: one trainer process throughout (it exits
    once, 0), one recovery, resumed from the epoch saved before the kill, ended in its newest checkpoint's state
    bit for bit. wrap's default settings restart PS 1 (which survived) for the new generation; with
    ``peers: {keep_survivors: true}`` it is left running. PS 0 is restarted once either way."""
    store = tmp_path / "store"
    script = tmp_path / "jobs" / Path(IN_PROCESS.script).name
    script.parent.mkdir()
    script.write_text(IN_PROCESS.source())
    wrap_args: list[str] = []
    if keep_survivors:
        config = tmp_path / "chief.yaml"
        config.write_text(CHIEF_CONFIG.replace("peers: {", "peers: {keep_survivors: true, "))
        wrap_args = ["--config", str(config)]
    run = run_job(IN_PROCESS, script, tmp_path, str(store), store, wrap_args=wrap_args)
    assert run.code == 0, f"wrap exited {run.code}\n{run.tail()}"
    assert _CHIEF_EXIT.findall(run.err) == ["0"], f"the trainer process was restarted\n{run.tail()}"
    assert "Recovered 1 time(s) in process.\n" in run.lines, run.tail()
    starts = [int(m.group(1)) for line in run.lines if (m := re.search(IN_PROCESS.start, line))]
    assert starts[0] == 0 and len(starts) == 2 and starts[1] >= IN_PROCESS.resumed_at_least, (starts, run.tail())
    finals = [doc for line in run.lines if line.startswith("{") and (doc := _json(line)).get("event") == "final"]
    assert finals and finals[-1]["step"] == IN_PROCESS.last_step, run.tail()
    assert finals[-1]["state"], "the job reported no variables"
    assert _differences(finals[-1]["state"], _psguard_checkpoint(store)) == []
    outcomes = [json.loads(m.group(1)) for m in _GENERATION.finditer(run.err)]
    assert len(outcomes) == 1, f"one generation, the in-process rejoin's: {outcomes}\n{run.tail()}"
    # PS 0 restarted once: by its agent before the rejoin asked ("fresh"), or at its request when the trainer saw
    # the failure first ("restarted"); PS 1 restarted, or kept.
    ps = sorted(v.split(" ")[0] for v in outcomes[0].values() if not v.startswith("skipped"))
    survivor = "kept" if keep_survivors else "restarted"
    assert ps in (sorted(["fresh", survivor]), sorted(["restarted", survivor])), outcomes
