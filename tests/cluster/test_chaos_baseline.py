"""The plain-TF baseline (psguard.chaos.baseline) on a real cluster, for what its fakes cannot show: a network
fault on a PS reaches plain TF through the same proxies as psguard's side (issue 46: explore seed 5's partition
cases compared psguard behind the harness's proxy, cut off, with a TF that had no proxy and no partition)."""

from __future__ import annotations

from pathlib import Path

import pytest

from psguard.chaos.baseline import BaselineRun
from psguard.chaos.history import operations, read_history
from psguard.chaos.runner import run_scenario
from psguard.chaos.scenario import Scenario
from psguard.config import from_data

pytestmark = pytest.mark.slow


def test_a_partition_of_a_ps_reaches_plain_tf_behind_the_same_proxy_and_is_healed(tmp_path: Path) -> None:
    doc = {
        "name": "baseline-partition",
        "proves": "plain TF faces the partition psguard faces",
        "time_limit": 240,
        "cluster": {"ps": 1, "workers": 1},
        "training": {"steps": 40, "chunk": 5, "memory_every": 5, "durable_every": 10, "vocab": 2000},
        "faults": [{"action": "partition", "target": "ps:0", "at_step": 15, "duration": 2}],
        "checks": {"reference": False},
    }
    scenario = from_data(Scenario, doc, source="t.yaml")
    result = run_scenario(scenario, tmp_path / "baseline", seed=0, say=print, run_class=BaselineRun)
    records = read_history(tmp_path / "baseline" / "history.jsonl")
    faults = [o for o in operations(records) if o.process == "nemesis"]
    assert [(o.f, o.type, o.value["target"]) for o in faults] == [("partition", "ok", "ps:0"), ("heal", "ok", "ps:0")]
    (partition,) = [o for o in faults if o.f == "partition"]
    assert partition.value["listen_port"] != partition.value["target_port"]  # the proxy, in front of the PS
    assert result.verdicts["faults-injected"].status == "valid", result.verdicts["faults-injected"]
    assert result.verdicts["liveness"].status == "valid", result.verdicts["liveness"]  # TF trained through it
    assert result.verdicts["no-leaks"].status == "valid", result.verdicts["no-leaks"]  # the proxies closed
