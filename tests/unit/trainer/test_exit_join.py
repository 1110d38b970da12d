"""The capture function's warm-up thread is waited for at the trainer's exit, within a bound.

A daemon thread still inside TensorFlow's C++ code when the interpreter finalizes aborts the process (see
``capture_graph.join_warming``); these run a real interpreter to its real exit.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from psguard.handoff.contract import QUIET_TENSORFLOW

SCRIPT = textwrap.dedent(
    """
    import sys, threading, time
    from pathlib import Path
    from types import SimpleNamespace
    import psguard.trainer.manager as manager  # registers the exit hook, as a job using psguard has
    from psguard.trainer import capture_graph

    manager.WARM_EXIT_WAIT_SECONDS = float(sys.argv[3])
    started = threading.Event()

    class Capture:  # the capture function's instantiation, standing in for TensorFlow's work
        def get_concrete_function(self, *args):
            started.set()
            time.sleep(float(sys.argv[2]))
            Path(sys.argv[1]).write_text("done")
            raise RuntimeError("nothing to call")  # a failed warm-up is left to the real call

    capture_graph.warm_functions(SimpleNamespace(plan=SimpleNamespace(tensors=()), capture=Capture()), ())
    started.wait()
    # The script ends here, the thread still running.
    """
)


def _run(tmp_path: Path, work_s: float, bound_s: float) -> tuple[subprocess.CompletedProcess[str], float, Path]:
    done = tmp_path / "done"
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(done), str(work_s), str(bound_s)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **QUIET_TENSORFLOW},
    )
    return proc, time.monotonic() - t0, done


def test_a_warm_up_running_at_exit_is_finished_before_the_interpreter_goes(tmp_path: Path) -> None:
    proc, _, done = _run(tmp_path, 1.0, 30.0)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert done.read_text() == "done"  # a daemon thread not waited for would have been cut off at exit


def test_a_warm_up_that_hangs_holds_the_exit_up_no_longer_than_the_bound(tmp_path: Path) -> None:
    proc, elapsed, done = _run(tmp_path, 60.0, 0.5)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert not done.exists()
    assert elapsed < 30.0  # the thread sleeps 60 s: an unbounded join would wait for it (the subprocess timeout)
    assert "still running at exit" in proc.stderr
