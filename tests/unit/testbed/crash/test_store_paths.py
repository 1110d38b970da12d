"""The durable log's workloads (psguard.testbed.crash.store_paths): the model's states, and each path run whole.

Run to their end on a memory store (its requests the points, no file-system recorder: in pytest's process), each
path leaves what its check accepts; crashed at every point they are enumerated by tests/unit/testbed/
test_crashpoints.py.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from psguard.storage.memory import drop
from psguard.tensors import Full, Rows, Same
from psguard.testbed.crash.recorder import CrashPlan
from psguard.testbed.crash.session import Run, Session, read_ops
from psguard.testbed.crash.store_check import check_store, same_arrays
from psguard.testbed.crash.store_paths import STORE_PATHS, delta, state


@pytest.mark.parametrize("seed", [0, 13])
def test_each_steps_delta_takes_the_previous_state_to_its_own(seed: int) -> None:
    for step in range(2, 6):
        value = {n: v.copy() for n, v in state(seed, step - 1).items()}
        for name, update in delta(seed, step).items():
            if isinstance(update, Rows):
                value[name][update.ids] = update.values
            elif isinstance(update, Full):
                value[name] = update.value
            else:
                assert isinstance(update, Same)
        assert same_arrays(value, state(seed, step)) is None
        assert not np.array_equal(state(seed, step)["emb"], state(seed, step - 1)["emb"])


@pytest.mark.parametrize("name", sorted(STORE_PATHS))
def test_each_path_run_to_its_end_leaves_what_its_check_accepts(name: str, tmp_path: Path, unique: str) -> None:
    run = Run(tmp_path, f"memory://{unique}", "s3")
    plan = CrashPlan(None, run.crash_record)
    session = Session(run, plan, roots=[])
    try:
        STORE_PATHS[name](session)
        plan.finish()
        session.history.close()
        assert plan.calls, "the path made no call once it began"
        ops = read_ops(run.history)
        assert ops and all(op.done for op in ops)
        assert check_store(run) == []
    finally:
        drop(unique)
