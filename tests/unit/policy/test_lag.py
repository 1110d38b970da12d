"""The durable lag bound: when training must wait for the durable log, and how a policy file says so."""

from __future__ import annotations

import pytest

from psguard.config import from_data
from psguard.errors import ConfigError
from psguard.policy.files import PolicySpec
from psguard.policy.lag import LagBound


def test_the_default_waits_at_the_save_itself_as_tfs_saver_does() -> None:
    bound = LagBound()
    assert bound.holds
    assert bound.exceeded(1, 0.0)  # the first step after the save would pass a capture not yet durable
    assert not bound.exceeded(0, 0.0)
    assert "as TF's saver" in bound.describe()


def test_a_step_bound_lets_training_run_that_many_steps_ahead() -> None:
    bound = LagBound(max_steps=50)
    assert not bound.exceeded(50, 1e6)  # no time bound: any wait is fine within the steps
    assert bound.exceeded(51, 0.0)
    assert "50 step(s)" in bound.describe()


def test_a_time_bound_alone_counts_seconds_not_steps() -> None:
    bound = from_data(LagBound, {"max_steps": None, "max_seconds": "2m"})
    assert not bound.exceeded(10_000, 119.0)
    assert bound.exceeded(1, 121.0)
    assert "2m" in bound.describe()


def test_report_never_holds_but_still_knows_the_bound() -> None:
    bound = LagBound(max_steps=100, on_exceed="report")
    assert not bound.holds
    assert bound.exceeded(101, 0.0)
    assert "never wait" in bound.describe()


@pytest.mark.parametrize(
    ("data", "key"),
    [
        ({"max_steps": -1}, "max_steps"),
        ({"max_steps": None}, "max_steps"),  # no bound at all: say report instead
        ({"max_seconds": float("nan")}, "max_seconds"),
        ({"max_seconds": float("inf")}, "max_seconds"),
        ({"on_exceed": "ignore"}, "on_exceed"),
        ({"max_step": 3}, "max_step"),
    ],
)
def test_a_bad_bound_is_refused_naming_its_key(data: dict[str, object], key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        from_data(LagBound, data, source="policy.yaml")


def test_a_policy_file_sets_it_and_check_prints_it() -> None:
    spec = from_data(
        PolicySpec, {"durable": {"every_steps": 100}, "durable_lag": {"max_steps": 200, "on_exceed": "report"}}
    )
    assert spec.schedule.durable_lag == LagBound(max_steps=200, on_exceed="report")
    assert "200 step(s)" in spec.summary()["durable_lag"]
    assert from_data(PolicySpec, {"durable": {"every_steps": 100}}).schedule.durable_lag == LagBound()
