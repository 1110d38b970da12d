"""integrations/prometheus: the alert rules and the Grafana dashboard use exactly the metrics the agent exports.

Every expression is parsed with a real PromQL parser (``promql-parser``, a syntax error fails). Every
``psguard_*`` series it references must be a metric of :class:`psguard.agent.control.metrics.AgentMetrics`
(``_bucket`` / ``_sum`` / ``_count`` only on histograms, ``rate`` / ``increase`` only on counters and histogram
parts), with only the labels it has; and a real agent, started as a user would, must expose all of them on ``/metrics``.
Each alert links to its section of the runbook, which must exist.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import promql_parser
import pytest
import yaml

from psguard.agent.control.metrics import AgentMetrics
from tests.support.paths import ROOT

PROM = ROOT / "integrations" / "prometheus"
ALERTS = PROM / "alerts.yaml"
DASHBOARD = PROM / "grafana-dashboard.json"
SCRAPE = PROM / "scrape-config.yaml"
RUNBOOK = ROOT / "docs" / "runbook.md"

TARGET_LABELS = {"instance", "job", "namespace", "pod"}  # added by Prometheus and the scrape config
KNOWN_FUNCTIONS = {"time", "rate", "increase", "histogram_quantile"}
DURATION = re.compile(r"^\d+[smhd]$")


def _metrics() -> dict[str, Any]:
    registry = AgentMetrics().registry
    return {name: registry.get(name) for name in registry.names()}


def _alert_rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(ALERTS.read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def _dashboard_exprs() -> list[str]:
    doc = json.loads(DASHBOARD.read_text())
    return [t["expr"] for panel in doc["panels"] for t in panel["targets"]]


def _exprs() -> list[str]:
    return [r["expr"] for r in _alert_rules()] + _dashboard_exprs()


def _family(series: str, metrics: dict[str, Any]) -> tuple[str, str]:
    """``psguard_x_bucket`` -> (``psguard_x``, ``_bucket``): the metric family a series belongs to."""
    if series in metrics:
        return series, ""
    for suffix in ("_bucket", "_sum", "_count"):
        base = series.removesuffix(suffix)
        if series.endswith(suffix) and base in metrics:
            return base, suffix
    raise AssertionError(f"{series} is not a metric the agent exports (psguard/metrics.py): {sorted(metrics)}")


def _walk(node: Any, found: list[tuple[Any, str | None]], grouping: list[str]) -> None:
    """Collect ``(vector selector, function applied to its range)`` pairs and grouping labels from a PromQL AST."""
    kind = type(node).__name__
    if kind == "VectorSelector":
        found.append((node, None))
    elif kind == "MatrixSelector":
        found.append((node.vector_selector, None))
    elif kind == "Call":
        name = node.func.name
        assert name in KNOWN_FUNCTIONS, f"function {name}() not vetted here"
        for arg in node.args:
            if type(arg).__name__ == "MatrixSelector":
                found.append((arg.vector_selector, name))
            else:
                _walk(arg, found, grouping)
    elif kind == "AggregateExpr":
        if node.modifier is not None:
            grouping += list(node.modifier.labels)
        _walk(node.expr, found, grouping)
        if node.param is not None:
            _walk(node.param, found, grouping)
    elif kind == "BinaryExpr":
        if node.modifier is not None and node.modifier.matching is not None:
            grouping += list(node.modifier.matching.labels)
        _walk(node.lhs, found, grouping)
        _walk(node.rhs, found, grouping)
    elif kind in ("ParenExpr", "UnaryExpr", "SubqueryExpr"):
        _walk(node.expr, found, grouping)
    else:
        assert kind in ("NumberLiteral", "StringLiteral"), f"PromQL node {kind} not handled here"


def check_expr(expr: str, metrics: dict[str, Any]) -> set[str]:
    """Parse ``expr`` with a real PromQL parser and assert it uses psguard's metrics correctly; return the
    metric families it references."""
    try:
        tree = promql_parser.parse(expr)
    except ValueError as e:
        raise AssertionError(f"{expr}: not valid PromQL: {e}") from None
    found: list[tuple[Any, str | None]] = []
    grouping: list[str] = []
    _walk(tree, found, grouping)
    families: set[str] = set()
    labels_in_scope: set[str] = set(TARGET_LABELS)
    for selector, function in found:
        series = selector.name or ""
        matchers = [m.name for m in selector.matchers.matchers]
        if not series.startswith("psguard_"):
            continue  # Prometheus' own series (up)
        name, suffix = _family(series, metrics)
        metric = metrics[name]
        families.add(name)
        if suffix:
            assert metric.kind == "histogram", f"{expr}: {series} but {name} is a {metric.kind}"
        labels = set(metric.label_names) | TARGET_LABELS | ({"le"} if suffix == "_bucket" else set())
        labels_in_scope |= labels
        for matcher in matchers:
            assert matcher in labels, f"{expr}: {name} has no label {matcher!r} (labels: {metric.label_names})"
        if function in ("rate", "increase"):
            assert metric.kind == "counter" or suffix, f"{expr}: {function}() of the {metric.kind} {name}"
    for label in grouping:
        assert label in labels_in_scope, f"{expr}: groups by {label!r}, which no series in it has"
    return families


def test_every_alert_and_panel_uses_existing_metrics_correctly() -> None:
    metrics = _metrics()
    referenced = set().union(*(check_expr(e, metrics) for e in _exprs()))
    # The checkpoint tiers, persist lag, restarts and crash loop are what the alerts are for.
    alerted = set().union(*(check_expr(r["expr"], metrics) for r in _alert_rules()))
    assert {
        "psguard_last_checkpoint_timestamp_seconds",
        "psguard_persist_lag_steps",
        "psguard_task_restarts_total",
        "psguard_crash_loop",
    } <= alerted
    assert referenced == set(metrics), f"metrics on no panel or alert: {set(metrics) - referenced}"


@pytest.mark.parametrize(
    ("expr", "fragment"),
    [
        ("time() - psguard_last_checkpoint_timestamp_second", "not a metric the agent exports"),
        ('psguard_last_checkpoint_step{tear="memory"}', "has no label 'tear'"),
        ("rate(psguard_persist_lag_steps[5m])", "rate() of the gauge"),
        ("psguard_task_up_bucket", "but psguard_task_up is a gauge"),
        ("psguard_crash_loop_sum", "but psguard_crash_loop is a gauge"),
        ("psguard_crash_loop_total", "not a metric the agent exports"),
        ("sum by (shard) (psguard_task_up)", "groups by 'shard'"),
        ("rate(psguard_task_restarts_total[5m]", "not valid PromQL"),
        ("psguard_task_up{task=chief}", "not valid PromQL"),
        ("irate(psguard_task_restarts_total[5m])", "irate() not vetted here"),
    ],
)
def test_the_metric_check_catches_mistakes(expr: str, fragment: str) -> None:
    with pytest.raises(AssertionError, match=re.escape(fragment)):
        check_expr(expr, _metrics())


def test_alert_rules_are_well_formed_and_each_has_a_runbook_section() -> None:
    doc = yaml.safe_load(ALERTS.read_text())
    assert set(doc) == {"groups"}
    rules = _alert_rules()
    names = [r["alert"] for r in rules]
    assert len(names) == len(set(names)), "duplicate alert names"
    runbook = RUNBOOK.read_text()
    anchors = {re.sub(r"[^a-z0-9 -]", "", h.lower()).replace(" ", "-") for h in re.findall(r"^#+ (.+)$", runbook, re.M)}
    for rule in rules:
        assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}, rule["alert"]
        assert "for" not in rule or DURATION.match(rule["for"]), rule["alert"]
        assert rule["labels"]["severity"] in ("warning", "critical"), rule["alert"]
        assert {"summary", "description"} <= set(rule["annotations"]), rule["alert"]
        anchor = rule["alert"].lower()
        assert f"docs/runbook.md#{anchor}" in rule["annotations"]["description"], rule["alert"]
        assert anchor in anchors, f"docs/runbook.md has no section for {rule['alert']}"


def test_dashboard_is_importable_grafana_json() -> None:
    doc = json.loads(DASHBOARD.read_text())
    assert doc["uid"] and doc["title"] and isinstance(doc["schemaVersion"], int)
    ids = [p["id"] for p in doc["panels"]]
    assert len(ids) == len(set(ids))
    variables = {v["name"] for v in doc["templating"]["list"]}
    cells: set[tuple[int, int]] = set()
    for panel in doc["panels"]:
        assert panel["datasource"]["uid"].strip("${}") in variables
        g = panel["gridPos"]
        assert g["x"] + g["w"] <= 24, panel["title"]
        area = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not area & cells, f"panel {panel['title']!r} overlaps another"
        cells |= area
        refs = [t["refId"] for t in panel["targets"]]
        assert refs and len(refs) == len(set(refs))


def test_scrape_config_matches_the_alerts_and_the_manifests() -> None:
    (job,) = yaml.safe_load(SCRAPE.read_text())["scrape_configs"]
    up = [r["expr"] for r in _alert_rules() if re.search(r"(?<![a-z_])up\{", r["expr"])]
    assert up and all('job="psguard"' in e for e in up)
    assert job["job_name"] == "psguard" and job["metrics_path"] == "/metrics"
    assert job["authorization"]["type"] == "Bearer"
    assert job["authorization"]["credentials_file"]  # /metrics needs the agents' token (or a read-scope JWT)
    # The agents serve HTTPS with mutual TLS: Prometheus verifies them and presents a client certificate.
    assert job["scheme"] == "https" and {"ca_file", "cert_file", "key_file"} <= job["tls_config"].keys()
    keep = next(r for r in job["relabel_configs"] if r["action"] == "keep")
    manifests = (ROOT / "integrations" / "kubernetes" / "psguard-ps-job.yaml").read_text()
    assert f"name: {keep['regex']}, containerPort: 8470" in manifests


@dataclass(frozen=True)
class Scrape:
    """What a real agent's ``/metrics`` answered: without the token, and the body with it."""

    status_without_token: int
    body: str


@pytest.fixture(scope="module")
def scrape(tmp_path_factory: pytest.TempPathFactory) -> Scrape:
    """One real chief agent, started as a user would, scraped with the scrape config's credentials, then stopped."""
    tmp_path = tmp_path_factory.mktemp("agent")
    cluster = tmp_path / "cluster.json"
    cluster.write_text(json.dumps({"chief": ["127.0.0.1:1"], "ps": ["127.0.0.1:2"], "worker": ["127.0.0.1:3"]}))
    ready = tmp_path / "url"
    argv = [sys.executable, "-m", "psguard.cli", "agent", "--role", "chief", "--index", "0", "--cluster", str(cluster)]
    argv += ["--store", str(tmp_path / "store"), "--spool", str(tmp_path / "spool"), "--ready-file", str(ready)]
    config = tmp_path / "agent.yaml"  # its task records here, not in the default job's folder in /dev/shm
    config.write_text(f"state_dir: {json.dumps(str(tmp_path / 'state'))}\n")
    argv += ["--config", str(config)]
    token = tmp_path / "token"  # what the scrape config's credentials_file names; 0600 like the Secret
    token.write_text("scrape-token-0123456789abcdef\n")
    token.chmod(0o600)
    argv += ["--token-file", str(token), "--", sys.executable, "-c", "import time; time.sleep(600)"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():  # the agent renames it into place once it serves
            assert proc.poll() is None, proc.communicate()[0]
            assert time.monotonic() < deadline, "the agent did not serve within 60s"
            time.sleep(0.05)
        url = f"{ready.read_text().strip()}/metrics"
        try:
            urllib.request.urlopen(url, timeout=10).close()
            status = 200
        except urllib.error.HTTPError as e:
            status = e.code
        scrape = urllib.request.Request(url, headers={"Authorization": "Bearer scrape-token-0123456789abcdef"})
        with urllib.request.urlopen(scrape, timeout=10) as response:
            body = response.read().decode()
    finally:
        proc.terminate()
        proc.communicate(timeout=60)
    return Scrape(status, body)


@pytest.mark.slow
def test_a_real_agent_exports_every_metric_the_alerts_and_dashboard_use(scrape: Scrape) -> None:
    assert scrape.status_without_token == 401  # /metrics needs the token, on loopback too
    exported = set(re.findall(r"^# TYPE (\S+) ", scrape.body, re.M))
    metrics = _metrics()
    referenced = set().union(*(check_expr(e, metrics) for e in _exprs()))
    assert referenced <= exported, f"not on a real agent's /metrics: {referenced - exported}"


def test_checkpoint_age_thresholds_follow_the_default_policy() -> None:
    """The stale-checkpoint alerts fire at 2-4x the `default` policy's interval of their tier: not on every
    late save, and not so late that a stalled job goes unnoticed for hours."""
    from psguard.policy.files import load_policy

    policy = load_policy("default")
    intervals = {"memory": policy.memory.every, "durable": policy.durable.every}
    seen = set()
    for rule in _alert_rules():
        match = re.fullmatch(
            r'time\(\) - psguard_last_checkpoint_timestamp_seconds\{tier="(\w+)"\} > (\d+)', rule["expr"]
        )
        if match:
            tier, threshold = match.group(1), float(match.group(2))
            interval = intervals[tier]
            assert interval is not None and 2 * interval <= threshold <= 4 * interval, rule["alert"]
            seen.add(tier)
    assert seen == {"memory", "durable"}


# ------------------------------------------------------------------------------------------------ promtool
@pytest.fixture(scope="module")
def promtool() -> Path:
    from psguard.testbed.prometheus import promtool as find

    return find()


def test_promtool_accepts_the_alert_rules_and_their_templates(promtool: Path) -> None:
    done = subprocess.run([str(promtool), "check", "rules", str(ALERTS)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(_alert_rules())} rules found" in done.stdout


@pytest.mark.slow
def test_promtool_accepts_a_real_agents_metrics(promtool: Path, scrape: Scrape) -> None:
    """The exposition format and Prometheus' naming lint (counters end in _total, base units, HELP on every
    metric), as ``promtool check metrics`` applies them to what an agent serves."""
    done = subprocess.run([str(promtool), "check", "metrics"], input=scrape.body, capture_output=True, text=True)
    assert done.returncode == 0 and not done.stdout.strip() and not done.stderr.strip(), done.stdout + done.stderr
    assert "psguard_build_info{" in scrape.body


def test_each_alert_fires_on_its_fault_and_not_on_a_healthy_agent(promtool: Path, tmp_path: Path) -> None:
    """promtool's unit tests (alerts_test.yaml beside this file), against the shipped rules without their
    annotations (exp_alerts would otherwise repeat every description). They caught PsguardRecoverySlow comparing
    a series with ``le`` to one without: it could never fire."""
    rules = yaml.safe_load(ALERTS.read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            rule.pop("annotations", None)
    (tmp_path / "alerts.yaml").write_text(yaml.safe_dump(rules))
    tests = Path(__file__).with_name("alerts_test.yaml")
    (tmp_path / tests.name).write_text(tests.read_text())
    done = subprocess.run([str(promtool), "test", "rules", tests.name], capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    tested = {t["alertname"] for case in yaml.safe_load(tests.read_text())["tests"] for t in case["alert_rule_test"]}
    assert tested == {r["alert"] for r in _alert_rules()}  # every alert has its test
