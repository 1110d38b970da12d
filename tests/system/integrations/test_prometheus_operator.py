"""integrations/prometheus: the ServiceMonitor and the PodMonitor validate offline against the prometheus-operator
CRD schemas, and scrape what the Kubernetes manifests serve.

The schemas are the CRDs' ``openAPIV3Schema`` (prometheus-operator v0.93.0, vendored under
``integrations/prometheus/crds/``), made strict as the TFJob's is (an unknown field fails, as with ``kubectl apply
--validate=strict``); ``metadata`` is checked against the Kubernetes ObjectMeta schema, which the CRDs leave open.
The negative tests prove that a typo or a wrong type fails. The agreement tests check the monitors against the
manifests: selectors that match the Services or pods, a port they name, the Secrets and keys they read, and the
``job`` label the alert rules expect.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from typing import Any

import jsonschema
import pytest
import yaml

from tests.support.kubernetes import VERSIONS, k8s_definition, strict
from tests.support.paths import ROOT

PROM = ROOT / "integrations" / "prometheus"
K8S = ROOT / "integrations" / "kubernetes"
MONITORS = {
    "ServiceMonitor": (PROM / "servicemonitor.yaml", PROM / "crds" / "servicemonitor-v1.schema.json"),
    "PodMonitor": (PROM / "podmonitor.yaml", PROM / "crds" / "podmonitor-v1.schema.json"),
}
ENDPOINTS = {"ServiceMonitor": "endpoints", "PodMonitor": "podMetricsEndpoints"}


def _doc(kind: str) -> dict[str, Any]:
    (doc,) = [d for d in yaml.safe_load_all(MONITORS[kind][0].read_text()) if d]
    assert doc["kind"] == kind and doc["apiVersion"] == "monitoring.coreos.com/v1"
    return dict(doc)


def validate(doc: dict[str, Any], version: str = VERSIONS[-1]) -> None:
    """Raise ``jsonschema.ValidationError`` unless ``doc`` is a valid monitor of its kind."""
    schema = strict(json.loads(MONITORS[doc["kind"]][1].read_text())["schema"])
    jsonschema.validators.Draft7Validator(schema).validate(doc)
    k8s_definition("io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta", version).validate(doc["metadata"])


def _manifests() -> list[dict[str, Any]]:
    return [d for path in sorted(K8S.rglob("*.yaml")) for d in yaml.safe_load_all(path.read_text()) if d]


def _secrets() -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in _manifests() if d["kind"] == "Secret"}


def _matches(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A Kubernetes label selector (matchLabels and the Exists / In expressions used here)."""
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    for expr in selector.get("matchExpressions", []):
        if expr["operator"] == "Exists" and expr["key"] not in labels:
            return False
        if expr["operator"] == "In" and labels.get(expr["key"]) not in expr["values"]:
            return False
        assert expr["operator"] in ("Exists", "In"), expr
    return True


def _pod_templates() -> list[tuple[str, dict[str, Any]]]:
    """(name, pod template) of every workload in the manifests: Jobs, Deployments and the TFJob's replicas."""
    out = []
    for doc in _manifests():
        if doc["kind"] in ("Job", "Deployment", "StatefulSet"):
            out.append((doc["metadata"]["name"], doc["spec"]["template"]))
        elif doc["kind"] == "TFJob":
            for rtype, spec in doc["spec"]["tfReplicaSpecs"].items():
                out.append((f"{doc['metadata']['name']}/{rtype}", spec["template"]))
    return out


# ------------------------------------------------------------------------------------------ schema validation
@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("kind", sorted(MONITORS))
def test_monitors_validate_against_the_operator_crds(kind: str, version: str) -> None:
    validate(_doc(kind), version)


def _endpoint(doc: dict[str, Any]) -> dict[str, Any]:
    return dict(doc["spec"][ENDPOINTS[doc["kind"]]][0])


def _rename(mapping: dict[str, Any], old: str, new: str) -> None:
    mapping[new] = mapping.pop(old)


MUTATIONS: list[tuple[str, Callable[[dict[str, Any]], None], str]] = [
    ("typo-in-endpoint", lambda d: _rename(d["spec"][ENDPOINTS[d["kind"]]][0], "tlsConfig", "tlsconfig"), "tlsconfig"),
    ("typo-in-spec", lambda d: d["spec"].update(sampleLimt=1000), "sampleLimt"),
    ("port-as-number", lambda d: d["spec"][ENDPOINTS[d["kind"]]][0].update(port=8470), "8470 is not of type"),
    ("bad-scheme", lambda d: d["spec"][ENDPOINTS[d["kind"]]][0].update(scheme="tls"), "'tls' is not one of"),
    (
        "secret-without-key",
        lambda d: d["spec"][ENDPOINTS[d["kind"]]][0]["authorization"]["credentials"].pop("key"),
        "'key' is a required property",
    ),
    ("typo-in-metadata", lambda d: _rename(d["metadata"], "labels", "label"), "label"),
]


@pytest.mark.parametrize("kind", sorted(MONITORS))
@pytest.mark.parametrize(("mutate", "fragment"), [m[1:] for m in MUTATIONS], ids=[m[0] for m in MUTATIONS])
def test_a_typo_or_a_wrong_type_in_a_monitor_fails(kind: str, mutate: Any, fragment: str) -> None:
    doc = copy.deepcopy(_doc(kind))
    validate(doc)  # the unmodified copy passes
    mutate(doc)
    with pytest.raises(jsonschema.ValidationError) as e:
        validate(doc)
    assert fragment in e.value.message


def test_the_vendored_schemas_name_their_source() -> None:
    for kind, (_, schema) in MONITORS.items():
        doc = json.loads(schema.read_text())
        assert f"the {kind} v1 CRD" in doc["$comment"] and "prometheus-operator v0.93.0" in doc["$comment"]
        assert doc["schema"]["required"] == ["spec"]


# ------------------------------------------------------------------------------------------ agreement
def _check_scrape(doc: dict[str, Any]) -> None:
    """The endpoint scrapes /metrics as scrape-config.yaml does: HTTPS, mutual TLS, the token, job="psguard"."""
    endpoint = _endpoint(doc)
    secrets = _secrets()
    assert endpoint["port"] == "psguard" and endpoint["path"] == "/metrics" and endpoint["scheme"] == "https"
    refs = [endpoint["authorization"]["credentials"], endpoint["tlsConfig"]["keySecret"]]
    refs += [endpoint["tlsConfig"][k]["secret"] for k in ("ca", "cert")]
    for ref in refs:  # every Secret and key the operator reads exists in the example Secrets
        assert ref["key"] in secrets[ref["name"]]["stringData"], ref
    assert endpoint["authorization"]["type"] == "Bearer"
    scrape = yaml.safe_load((PROM / "scrape-config.yaml").read_text())["scrape_configs"][0]
    assert endpoint["tlsConfig"]["serverName"] == scrape["tls_config"]["server_name"]
    assert {"action": "replace", "targetLabel": "job", "replacement": scrape["job_name"]} in endpoint["relabelings"]


def test_the_servicemonitor_scrapes_every_agent_of_the_plain_job() -> None:
    doc = _doc("ServiceMonitor")
    _check_scrape(doc)
    services = [d for d in _manifests() if d["kind"] == "Service"]
    selected = {s["metadata"]["name"] for s in services if _matches(doc["spec"]["selector"], s["metadata"]["labels"])}
    assert selected == {"psguard-chief", "psguard-ps", "psguard-worker"}
    for service in services:
        if service["metadata"]["name"] in selected:
            ports = {p["name"]: p for p in service["spec"]["ports"]}
            assert ports[_endpoint(doc)["port"]]["port"] == 8470


def test_the_podmonitor_scrapes_every_agent_pod_of_both_manifests() -> None:
    doc = _doc("PodMonitor")
    _check_scrape(doc)
    selected = []
    for name, template in _pod_templates():
        if _matches(doc["spec"]["selector"], template["metadata"].get("labels", {})):
            selected.append(name)
            ports = [p for c in template["spec"]["containers"] for p in c.get("ports", [])]
            assert {"name": "psguard", "containerPort": 8470} in ports, name
    assert set(selected) == {
        "psguard-ps",
        "psguard-worker",
        "psguard-chief",
        "ctr-42/Chief",
        "ctr-42/PS",
        "ctr-42/Worker",
    }
    assert "ctr-evaluator" not in selected  # no agent there
