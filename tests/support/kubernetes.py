"""Offline Kubernetes schema checks the integration tests share: the API's own definitions per version, and a
CRD schema made strict as ``kubectl apply --validate=strict`` applies it."""

from __future__ import annotations

from typing import Any

import jsonschema
import kubernetes_validate
from kubernetes_validate.utils import schema_contents
from referencing import Registry, Resource

# The oldest version the manifests support (Jobs with podReplacementPolicy: in the API from 1.28) and the
# newest whose schemas kubernetes-validate bundles.
VERSIONS = ("1.28", kubernetes_validate.utils.major_minor(kubernetes_validate.latest_version()))


def k8s_definition(name: str, version: str) -> jsonschema.protocols.Validator:
    """A strict validator for one definition of the Kubernetes API (``io.k8s.api.core.v1.PodTemplateSpec``)."""
    full = kubernetes_validate.utils.all_versions()
    ver = [v for v in full if kubernetes_validate.utils.major_minor(v) == version][-1]
    defs = schema_contents(f"kubernetes-json-schema/v{ver}-local-strict/_definitions.json", version)
    registry: Registry[Any] = Resource.from_contents(defs) @ Registry()
    schema = {"$ref": f"{defs['$id']}#/$defs/{name}"}
    cls = jsonschema.validators.Draft202012Validator
    return cls(schema, registry=registry)  # type: ignore[no-any-return]


def strict(schema: Any) -> Any:
    """The CRD schema as the API server applies it with strict field validation: unknown fields are errors.

    A structural schema prunes fields it does not list; ``kubectl apply`` (``--validate=strict``, the default
    since 1.27) rejects them instead. Objects that keep unknown fields on purpose stay open.
    """
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) for k, v in schema.items()}
    if (
        "properties" in out
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out
