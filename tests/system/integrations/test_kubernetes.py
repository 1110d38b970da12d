"""integrations/kubernetes: the manifests validate offline against the Kubernetes API schema, and they agree with
psguard itself (the agent's flags and config keys, cluster.json, probe ports, mounts, Secrets).

Built-in kinds are checked with ``kubernetes-validate`` (the official OpenAPI schemas of each Kubernetes version,
in strict mode: an unknown field fails, as ``kubectl apply --validate=strict`` does). The TFJob is checked against
the TFJob CRD's own schema (vendored from kubeflow/training-operator v1.9.0, made strict the same way), and each of
its pod templates against the Kubernetes PodTemplateSpec schema, which the CRD only copies. The negative tests
prove that a typo or a wrong type fails, so a broken manifest fails CI.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from psguard.agent.cli import resolve_task
from psguard.agent.config import AgentConfig, validate_cluster
from psguard.cli import build_parser
from psguard.config import load_yaml, loads_yaml
from tests.support.kubernetes import VERSIONS, k8s_definition, strict
from tests.support.paths import ROOT

K8S = ROOT / "integrations" / "kubernetes"
JOB = K8S / "psguard-ps-job.yaml"
SECRETS = K8S / "secrets.example.yaml"
TFJOB = K8S / "kubeflow" / "tfjob.yaml"
TFJOB_SCHEMA = K8S / "kubeflow" / "tfjob-v1.schema.json"


def _docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def _all_builtin() -> Iterator[tuple[str, dict[str, Any]]]:
    for path in sorted(K8S.rglob("*.yaml")):
        for doc in _docs(path):
            if doc["apiVersion"] != "kubeflow.org/v1":
                yield f"{path.relative_to(K8S)}:{doc['kind']}/{doc['metadata']['name']}", doc


def _by_kind(path: Path, kind: str, name: str) -> dict[str, Any]:
    return next(d for d in _docs(path) if d["kind"] == kind and d["metadata"]["name"] == name)


# ------------------------------------------------------------------------------------------ schema validation
def validate_tfjob(doc: dict[str, Any], version: str) -> None:
    """Raise ``jsonschema.ValidationError`` unless ``doc`` is a valid TFJob with valid pod templates."""
    schema = strict(json.loads(TFJOB_SCHEMA.read_text())["schema"])
    jsonschema.validators.Draft7Validator(schema).validate(doc)
    k8s_definition("io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta", version).validate(doc["metadata"])
    template = k8s_definition("io.k8s.api.core.v1.PodTemplateSpec", version)
    for spec in doc["spec"]["tfReplicaSpecs"].values():
        template.validate(spec["template"])


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize(("name", "doc"), list(_all_builtin()), ids=lambda v: v if isinstance(v, str) else "")
def test_builtin_manifests_validate_strictly(name: str, doc: dict[str, Any], version: str) -> None:
    assert kubernetes_validate.validate(doc, version, strict=True) == version


@pytest.mark.parametrize("version", VERSIONS)
def test_tfjob_validates_against_its_crd_and_the_pod_schema(version: str) -> None:
    validate_tfjob(_by_kind(TFJOB, "TFJob", "ctr-42"), version)


def _ps_job() -> dict[str, Any]:
    return copy.deepcopy(_by_kind(JOB, "Job", "psguard-ps"))


def _rename(mapping: dict[str, Any], old: str, new: str) -> None:
    mapping[new] = mapping.pop(old)


@pytest.mark.parametrize(
    ("mutate", "fragment"),
    [
        (lambda d: _rename(d["spec"]["template"]["spec"]["containers"][0], "livenessProbe", "livenesProbe"), "livenes"),
        (lambda d: d["spec"].update(completions="two"), "'two' is not of type"),
        (lambda d: _rename(d["spec"]["template"]["spec"]["volumes"][0], "configMap", "configmap"), "configmap"),
        (lambda d: d["spec"]["template"]["spec"]["containers"][0]["ports"][0].update(containerPort="2222"), "2222"),
    ],
    ids=["typo-in-container", "completions-string", "typo-in-volume", "port-as-string"],
)
def test_a_typo_or_a_wrong_type_in_a_manifest_fails(mutate: Any, fragment: str) -> None:
    doc = _ps_job()
    kubernetes_validate.validate(doc, VERSIONS[-1], strict=True)  # the unmodified copy passes
    mutate(doc)
    with pytest.raises(kubernetes_validate.ValidationError) as e:
        kubernetes_validate.validate(doc, VERSIONS[-1], strict=True)
    assert fragment in e.value.message


def _tfjob() -> dict[str, Any]:
    return copy.deepcopy(_by_kind(TFJOB, "TFJob", "ctr-42"))


@pytest.mark.parametrize(
    ("mutate", "fragment"),
    [
        (lambda d: _rename(d["spec"], "tfReplicaSpecs", "tfReplicaSpec"), "tfReplicaSpec"),
        (lambda d: d["spec"]["tfReplicaSpecs"]["PS"].update(replicas="2"), "'2' is not of type"),
        (lambda d: d["spec"]["runPolicy"].update(backoffLimit="3"), "'3' is not of type"),
        (lambda d: _rename(d["spec"]["runPolicy"], "cleanPodPolicy", "cleanupPodPolicy"), "cleanupPodPolicy"),
        (
            lambda d: _rename(
                d["spec"]["tfReplicaSpecs"]["Chief"]["template"]["spec"]["containers"][0],
                "readinessProbe",
                "readyProbe",
            ),
            "readyProbe",
        ),
        (
            lambda d: d["spec"]["tfReplicaSpecs"]["Worker"]["template"]["spec"]["volumes"][0]["configMap"].update(
                name=["ctr-42-psguard"]
            ),
            "is not of type",
        ),
    ],
    ids=[
        "typo-top",
        "replicas-string",
        "backoff-limit-string",
        "typo-run-policy",
        "typo-in-pod-template",
        "wrong-type-deep",
    ],
)
def test_a_typo_or_a_wrong_type_in_the_tfjob_fails(mutate: Any, fragment: str) -> None:
    doc = _tfjob()
    validate_tfjob(doc, VERSIONS[-1])
    mutate(doc)
    with pytest.raises(jsonschema.ValidationError) as e:
        validate_tfjob(doc, VERSIONS[-1])
    assert fragment in e.value.message


# ------------------------------------------------------------------------------------------ agreement with psguard
def _expand(args: list[str], env: dict[str, str]) -> list[str]:
    """Kubernetes' $(VAR) expansion in command and args."""
    out = []
    for arg in args:
        for key, value in env.items():
            arg = arg.replace(f"$({key})", value)
        out.append(arg)
    return out


def _containers(doc: dict[str, Any]) -> list[dict[str, Any]]:
    return list(doc["spec"]["template"]["spec"]["containers"])


def _check_secret_mounts(
    config: AgentConfig, mounts: dict[str, str], volumes: dict[str, Any], secrets: dict[str, Any]
) -> None:
    """The token and the TLS files come from Secrets the example creates, mounted 0400: the agent refuses a secret
    file that group or others can read, and a Secret volume's default mode is 0644."""
    http = config.http
    assert http.token_file and http.tls_cert and http.tls_key and http.tls_ca  # token and mutual TLS
    for path in (http.token_file, http.tls_cert, http.tls_key, http.tls_ca):
        folder, key = str(Path(path).parent), Path(path).name
        secret = volumes[mounts[folder]]["secret"]
        assert secret["defaultMode"] == 0o400, f"{path}: the agent refuses a file others can read"
        assert key in secrets[secret["secretName"]]["stringData"], path


def test_plain_job_agrees_with_the_agent(tmp_path: Path) -> None:
    config_map = _by_kind(JOB, "ConfigMap", "psguard-config")
    cluster = validate_cluster(json.loads(config_map["data"]["cluster.json"]))
    agent_yaml = tmp_path / "agent.yaml"
    agent_yaml.write_text(config_map["data"]["agent.yaml"])
    config = load_yaml(AgentConfig, agent_yaml)  # unknown keys or bad values raise
    assert config.http.bind == "0.0.0.0" and config.http.token_file  # reachable by peers, so a token is required

    secrets = {d["metadata"]["name"]: d for d in _docs(SECRETS)}
    parser = build_parser()
    seen_roles = set()
    assert config.peers.finish_on_success  # the chief's agent ends the PS and worker Jobs when training is done
    assert config.stop_exit_code == 143  # an evicted pod is a failed one (replaced), not a completed index
    for name in ("psguard-ps", "psguard-worker", "psguard-chief"):
        kind = "Job"
        doc = _by_kind(JOB, kind, name)
        pod = doc["spec"]["template"]["spec"]
        (container,) = _containers(doc)
        env = {e["name"]: e.get("value", "0") for e in container.get("env", [])}
        args = parser.parse_args(_expand(container["command"][1:] + container["args"], env))
        assert container["command"] == ["psguard"]
        role = args.role
        seen_roles.add(role)
        assert args.cluster == "/etc/psguard/cluster.json" and args.config == "/etc/psguard/agent.yaml"
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes[mounts["/etc/psguard"]]["configMap"]["name"] == "psguard-config"
        _check_secret_mounts(config, mounts, volumes, secrets)
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports["psguard"] == config.http.port
        assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "psguard", "scheme": "HTTPS"}
        assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "psguard", "scheme": "HTTPS"}
        service = _by_kind(JOB, "Service", f"psguard-{role}")
        assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
        assert service["spec"]["selector"].items() <= doc["spec"]["template"]["metadata"]["labels"].items()
        # Every Job completes when its pods exit 0 (the agent exits 1 only on a crash loop: restarted in place)
        # and is deleted with its pods a while after it finished.
        assert pod["restartPolicy"] == "OnFailure" and doc["spec"]["ttlSecondsAfterFinished"] > 0
        if role != "chief":
            spec = doc["spec"]
            assert spec["completionMode"] == "Indexed" and spec["podReplacementPolicy"] == "Failed"
            assert spec["completions"] == spec["parallelism"] == len(cluster[role])
            assert pod["subdomain"] == service["metadata"]["name"]
            # An Indexed Job's pods are named <job>-<index>: with the Service, exactly the addresses in cluster.json.
            expected = [f"{name}-{i}.{service['metadata']['name']}:{ports['tf']}" for i in range(len(cluster[role]))]
            assert cluster[role] == expected
            assert container["env"][0]["valueFrom"]["fieldRef"]["fieldPath"] == (
                "metadata.annotations['batch.kubernetes.io/job-completion-index']"
            )
        else:
            spec = doc["spec"]["template"]["spec"]
            assert cluster["chief"] == [f"{spec['hostname']}.{spec['subdomain']}:{ports['tf']}"]
            assert args.store == "s3://my-bucket/jobs/ctr-42"
            assert volumes[mounts["/psguard-spool"]]["emptyDir"]["medium"] == "Memory"
            assert args.spool.startswith("/psguard-spool/")
            expected_peers = [
                f"https://{a.rsplit(':', 1)[0]}:{config.http.port}" for r in ("ps", "worker") for a in cluster[r]
            ]
            assert args.peer == expected_peers
            assert args.command[1:4] == ["python", "/app/examples/custom_loop/train_psguard.py", "--checkpoint-dir"]
            for item in container["env"]:
                ref = item.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert ref["key"] in secrets[ref["name"]]["stringData"]
    assert seen_roles == {"ps", "worker", "chief"}


def test_plain_job_typo_in_agent_flags_would_fail() -> None:
    """The flag check above is real: argparse rejects a misspelt agent flag (exit 2)."""
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["agent", "--role", "ps", "--index", "0", "--cluster", "c.json", "--conifg", "a"])
    assert e.value.code == 2


def _operator_tf_config(doc: dict[str, Any], role: str, index: int) -> str:
    """``TF_CONFIG`` as the training operator writes it into the pod of ``role:index`` (Service names)."""
    name = doc["metadata"]["name"]
    cluster = {
        rtype.lower(): [f"{name}-{rtype.lower()}-{i}.default.svc:2222" for i in range(spec["replicas"])]
        for rtype, spec in doc["spec"]["tfReplicaSpecs"].items()
    }
    return json.dumps({"cluster": cluster, "task": {"type": role, "index": index}, "environment": "cloud"})


@pytest.mark.parametrize("rtype", ["Chief", "PS", "Worker"])
def test_tfjob_agents_take_their_task_from_the_operators_tf_config(rtype: str) -> None:
    """No bootstrap: each container runs ``psguard agent`` without --role/--index/--cluster, and the agent's own
    resolution (the code ``psguard agent`` runs) gives every replica its task from the operator's TF_CONFIG."""
    doc = _tfjob()
    config = load_yaml_text(_by_kind(TFJOB, "ConfigMap", "ctr-42-psguard")["data"]["agent.yaml"])
    spec = doc["spec"]["tfReplicaSpecs"][rtype]
    (container,) = spec["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value", "") for e in container.get("env", [])}
    assert container["command"] == ["psguard"]
    args = build_parser().parse_args(_expand(container["command"][1:] + container["args"], env))
    assert (args.role, args.index, args.cluster) == (None, None, None)
    assert args.config == "/etc/psguard/agent.yaml"
    for index in range(spec["replicas"]):
        role, got, cluster = resolve_task(args, {"TF_CONFIG": _operator_tf_config(doc, rtype.lower(), index)})
        assert (role, got) == (rtype.lower(), index)
    if rtype == "Chief":
        # One peer per PS and worker task, by the operator's Service name, on the agents' port.
        expected = [f"https://{a.split('.')[0]}:{config.http.port}" for r in ("ps", "worker") for a in cluster[r]]
        assert args.peer == expected
        assert args.store == "s3://my-bucket/jobs/ctr-42" and args.spool == "/psguard-spool/ctr-42"
        assert args.command[1:4] == ["python", "/app/examples/custom_loop/train_psguard.py", "--checkpoint-dir"]
    elif rtype == "PS":  # the PS agents keep their shards and write their part of the log: the chief's store
        assert args.peer == [] and args.store == "s3://my-bucket/jobs/ctr-42" and args.command == []
        assert args.spool == "/psguard-shards/ps"
    else:
        assert args.peer == [] and args.store is None and args.command == []


def load_yaml_text(text: str) -> AgentConfig:
    """The agent's config from a manifest's ConfigMap, as the agent loads it (unknown keys raise)."""
    return loads_yaml(AgentConfig, text)


def test_tfjob_pods_mount_what_the_agent_reads() -> None:
    doc = _tfjob()
    config_map = _by_kind(TFJOB, "ConfigMap", "ctr-42-psguard")
    assert set(config_map["data"]) == {"agent.yaml"}  # no bootstrap script: the agent reads TF_CONFIG
    config = load_yaml_text(config_map["data"]["agent.yaml"])
    assert config.peers.finish_on_success and config.stop_exit_code == 143
    for role, spec in doc["spec"]["tfReplicaSpecs"].items():
        pod = spec["template"]["spec"]
        (container,) = pod["containers"]
        assert container["name"] == "tensorflow"  # the operator finds the TF container by this name
        assert {"name": "tfjob-port", "containerPort": 2222} in container["ports"]
        assert container["command"] == ["psguard"]
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes[mounts["/etc/psguard"]]["configMap"]["name"] == config_map["metadata"]["name"]
        agent_config = load_yaml_text(config_map["data"]["agent.yaml"])
        secrets = {d["metadata"]["name"]: d for d in _docs(SECRETS)}
        _check_secret_mounts(agent_config, mounts, volumes, secrets)
        assert container["livenessProbe"]["httpGet"]["scheme"] == "HTTPS"
        assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
        assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
        if role == "Chief":
            assert volumes[mounts["/psguard-spool"]]["emptyDir"]["medium"] == "Memory"
