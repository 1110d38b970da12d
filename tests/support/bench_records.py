"""Progress records of a known ``psguard bench recovery`` run, for the tests of how it is measured."""

from __future__ import annotations

from typing import Any


def job_records(*, first_after: float = 1.0) -> list[dict[str, Any]]:
    """Steps 1..19 at 0.1 s (a capture every 5th, 0.3 s), the kill at t=2.0 after step 19, step 15 restored
    from t=4.0 to t=5.0, then steps 16.. at 0.1 s (the first ``first_after`` s, a capture at step 20)."""
    docs: list[dict[str, Any]] = []
    t = 0.0
    for step in range(1, 20):
        cap = step % 5 == 0
        t += 0.3 if cap else 0.1
        docs.append({"event": "step", "gen": 0, "step": step, "t": t, "cap": cap})
        if cap:
            docs.append({"event": "capture", "gen": 0, "step": step, "stall": 0.2, "t": t})
    docs.append({"event": "kill", "step": 19, "t": 2.5})
    docs.append({"event": "restore", "gen": 1, "step": 15, "t": 5.0, "t0": 4.0, "t1": 5.0, "build_s": 1.5})
    t = 5.0
    for step in range(16, 31):
        cap = step == 20
        t += first_after if step == 16 else (0.3 if cap else 0.1)
        docs.append({"event": "step", "gen": 1, "step": step, "t": t, "cap": cap})
        if cap:
            docs.append({"event": "capture", "gen": 1, "step": step, "stall": 0.25, "t": t})
    return docs
