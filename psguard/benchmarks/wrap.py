"""``psguard bench wrap``: kill -> next checkpoint of an unmodified script under ``psguard wrap``, warm vs cold.

A script without a model factory recovers by a new trainer process: its agent restarts it (after restarting the
PS, for a PS fault), and it restores its own TF checkpoint. This measures that path as a user sees it, with the
unmodified custom-loop example (``integrations/examples/custom_loop/train.py``, ``tf.train.CheckpointManager``
every ``--save-every`` steps): from the kill -9 (of the trainer, or of ``ps:0``) to the first checkpoint the
restarted script writes. Both sides run the same wrap; they differ in one setting of the chief's agent: with the
warm trainer (default) its restart runs the script in a process that has TensorFlow imported already
(:mod:`psguard.trainer.warm`); ``cold`` sets ``supervisor: {standby: false}`` for the chief, as before the warm
trainer existed. Sides alternate, so drift in machine load hits both alike.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from psguard.agent.wrap import CHIEF_CONFIG
from psguard.benchmarks.common import median, print_results, progress
from psguard.errors import ConfigError
from psguard.handoff.contract import QUIET_TENSORFLOW

EXAMPLE = Path(__file__).resolve().parents[2] / "integrations" / "examples" / "custom_loop" / "train.py"
_CKPT = re.compile(r"ckpt-(\d+)\.index")


def _latest(ckpt: Path) -> int:
    found = [int(m.group(1)) for p in ckpt.glob("ckpt-*.index") if (m := _CKPT.fullmatch(p.name))]
    return max(found, default=-1)


def _wait(condition: Any, timeout: float, what: str, proc: subprocess.Popen[bytes]) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if proc.poll() is not None:
            raise RuntimeError(f"psguard wrap exited {proc.returncode} while waiting for {what}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} within {timeout:.0f}s")
        time.sleep(0.02)


def one_run(script: Path, fault: str, warm: bool, *, save_every: int, settle: float, workdir: Path | None) -> float:
    """Seconds from the kill to the restarted script's first checkpoint."""
    from psguard.handoff.client import http_json
    from psguard.handoff.credentials import create_token_file

    tmp = Path(tempfile.mkdtemp(prefix="psguard-bench-wrap-", dir=workdir))
    try:
        work, ckpt = tmp / "run", tmp / "ckpt"
        token_file = create_token_file("psguard-bench-wrap-")
        token = token_file.token
        argv = [sys.executable, "-m", "psguard.cli", "wrap", "--ps", "1", "--workers", "1", "--dir", str(work)]
        argv += ["--token-file", str(token_file.path)]
        if not warm:
            # wrap's own chief settings, but no standby: the trainer restarts cold, as before the warm trainer.
            config = tmp / "chief.yaml"
            cold = CHIEF_CONFIG.replace("supervisor: {", "supervisor: {standby: false, ")
            config.write_text(cold + f"state_dir: {json.dumps(str(work / 'agents' / '.state'))}\n")
            argv += ["--config", str(config)]
        argv += ["--", sys.executable, str(script), "--checkpoint-dir", str(ckpt), "--steps", "100000000"]
        argv += ["--save-every", str(save_every)]
        log = open(tmp / "wrap.log", "wb")  # noqa: SIM115 - closed in finally
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **QUIET_TENSORFLOW})
        try:
            _wait(lambda: _latest(ckpt) >= 0, 300, "first checkpoint", proc)

            def status(task: str) -> dict[str, Any]:
                url = (work / "agents" / task / "url").read_text().strip()
                code, doc = http_json("GET", f"{url}/status", token=token)
                if code != 200:
                    raise RuntimeError(f"{task} agent /status: {code} {doc}")
                return dict(doc)

            # The same wait on both sides: long enough for the warm side's standby to have imported TensorFlow.
            t_ready = time.monotonic()
            if warm:
                _wait(lambda: status("chief")["supervisor"].get("standby_ready"), 300, "a ready warm trainer", proc)
            time.sleep(max(0.0, settle - (time.monotonic() - t_ready)))
            victim = int(status("chief" if fault == "trainer" else "ps0")["pid"])
            before = _latest(ckpt)
            t0 = time.monotonic()
            os.kill(victim, signal.SIGKILL)
            _wait(lambda: _latest(ckpt) > before, 600, "a checkpoint after the kill", proc)
            return time.monotonic() - t0
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            log.close()
            token_file.remove()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def run(
    *, runs: int = 3, fault: str = "trainer", script: Path = EXAMPLE, save_every: int = 10, settle: float = 12.0
) -> dict[str, Any]:
    if fault not in ("trainer", "ps"):
        raise ConfigError(f"--fault {fault!r}: expected trainer or ps")
    if runs < 1:
        raise ConfigError(f"--runs {runs}: expected at least 1")
    if not script.is_file():
        raise ConfigError(f"--script {script}: no such file (the default example is in the source tree)")
    warm: list[float] = []
    cold: list[float] = []
    for i in range(runs):
        for side in (True, False) if i % 2 == 0 else (False, True):
            progress(f"run {i + 1}/{runs}: kill -9 of the {fault}, {'warm' if side else 'cold'} trainer")
            seconds = one_run(script, fault, side, save_every=save_every, settle=settle, workdir=None)
            progress(f"  {seconds:.2f}s from the kill to the next checkpoint")
            (warm if side else cold).append(seconds)
    return {
        "fault": fault,
        "warm_seconds": warm,
        "cold_seconds": cold,
        "warm_median_s": median(warm),
        "cold_median_s": median(cold),
        "warm_vs_cold_ratio": median(warm) / median(cold),
    }


def cmd(args: argparse.Namespace) -> int:
    results = run(runs=args.runs, fault=args.fault, script=Path(args.script), save_every=args.save_every)
    print_results(results, as_json=args.json)
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("wrap", help="kill -> next checkpoint of an unmodified script under psguard wrap, warm vs cold")
    p.add_argument("--fault", choices=("trainer", "ps"), default="trainer", help="what is killed (default trainer)")
    p.add_argument("--runs", type=int, default=3, help="kills per side (default 3)")
    p.add_argument("--script", default=str(EXAMPLE), help="a tf.train.CheckpointManager script (default: the example)")
    p.add_argument("--save-every", type=int, default=10, help="steps between the script's saves (default 10)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd)
