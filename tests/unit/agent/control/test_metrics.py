"""The agent's metric names follow Prometheus' naming conventions (https://prometheus.io/docs/practices/naming/).

``promtool check metrics`` (tests/system/integrations/test_prometheus.py, on a real agent) checks the exposition
format, ``_total`` on counters and abbreviated units; it does not check that the unit is the name's last word
(``psguard_bytes_persisted_total`` passes it), nor that a build information metric exists. These do, over every
metric :class:`AgentMetrics` registers.
"""

from __future__ import annotations

import pytest

import psguard
from psguard.agent.control.metrics import AgentMetrics

#: Base units (Prometheus' seconds and bytes) and psguard's own count of training steps: the name's last word
#: (before ``_total``) when the value is measured in one.
UNITS = ("seconds", "bytes", "steps")
#: Words that name a unit which is not the base one (or an abbreviation of one).
NOT_BASE_UNITS = {"ms", "us", "ns", "sec", "secs", "milliseconds", "microseconds", "minutes", "hours", "days"}
NOT_BASE_UNITS |= {"kb", "mb", "gb", "kib", "mib", "gib", "kilobytes", "megabytes", "bits", "percent", "ratio_percent"}


def naming_problems(name: str, kind: str) -> list[str]:
    """What in ``name`` (a metric of type ``kind``) breaks Prometheus' naming conventions."""
    problems = []
    if not name.startswith("psguard_"):
        problems.append("no psguard_ prefix")
    if (kind == "counter") != name.endswith("_total"):
        problems.append("_total is for counters, and every counter ends with it")
    if name.endswith("_info") and kind != "gauge":
        problems.append("an _info metric is a gauge of 1")
    words = name.removesuffix("_total").split("_")
    if not_base := sorted(NOT_BASE_UNITS & set(words)):
        problems.append(f"not a base unit: {not_base}")
    units = [w for w in words if w in UNITS]
    if units and words[-1] not in UNITS:
        problems.append(f"the unit ({units[-1]}) is the name's last word before _total")
    if kind == "histogram" and words[-1] not in UNITS:
        problems.append("a histogram's name ends with the unit it observes")
    return problems


def _registered() -> list[tuple[str, str]]:
    registry = AgentMetrics().registry
    return [(name, registry.get(name).kind) for name in registry.names()]


@pytest.mark.parametrize(("name", "kind"), _registered())
def test_every_metric_name_follows_the_conventions(name: str, kind: str) -> None:
    assert naming_problems(name, kind) == []


@pytest.mark.parametrize(
    ("name", "kind", "fragment"),
    [
        ("psguard_bytes_persisted_total", "counter", "the unit (bytes) is the name's last word"),
        ("psguard_restarts", "counter", "every counter ends with it"),
        ("psguard_queue_total", "gauge", "every counter ends with it"),
        ("psguard_stall_ms", "histogram", "not a base unit: ['ms']"),
        ("psguard_stall", "histogram", "ends with the unit it observes"),
        ("psguard_build_info", "counter", "an _info metric is a gauge"),
        ("tf_lag_steps", "gauge", "no psguard_ prefix"),
    ],
)
def test_the_convention_check_catches_mistakes(name: str, kind: str, fragment: str) -> None:
    assert any(fragment in problem for problem in naming_problems(name, kind)), naming_problems(name, kind)


def test_build_information_is_one_info_gauge_of_1_labelled_with_the_version() -> None:
    metrics = AgentMetrics()
    infos = [name for name in metrics.registry.names() if name.endswith("_info")]
    assert infos == ["psguard_build_info"]
    assert f'psguard_build_info{{version="{psguard.__version__}"}} 1\n' in metrics.registry.render()
