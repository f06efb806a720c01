"""Render the chart with Helm's own Go SDK and check manifests the way a cluster would.

- `render(preset)`: `helm template` through helm-python-sdk (Helm 4's Go SDK as a library, from
  PyPI): values merged and checked against values.schema.json exactly as `helm install` does.
- `crd_validator(kind)`: a jsonschema validator for a KubeRay kind from the CRD's
  `openAPIV3Schema` in ../shared/crds/, made strict the way the API server's strict field
  validation is (an unknown field is an error, not silently pruned).
- `kuberay_errors(rayservice)`: the operator's own checks that no schema expresses (name
  length, upgrade strategy, replica bounds), from ray-operator/controllers/ray/utils/validation.go.
"""

from __future__ import annotations

import copy
import re
from functools import cache
from pathlib import Path
from typing import Any

import helm_python as helm
import yaml
from jsonschema import Draft7Validator

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "tokenflow"
CRDS = ROOT.parent / "shared" / "crds"
PRESETS = ("default", "gpu", "pp2", "pd", "autoscale", "kv-routed")
RELEASE, NAMESPACE = "tf", "llm"


def preset_values(preset: str) -> dict[str, Any]:
    """The values a user passes with `-f values-<preset>.yaml` (the default preset: none)."""
    if preset == "default":
        return {}
    return yaml.safe_load((CHART / f"values-{preset}.yaml").read_text())


def render(values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Every manifest the chart renders with `values`, parsed (NOTES.txt left out)."""
    with helm.Chart.load(str(CHART)) as chart:
        files = chart.render(values or {}, name=RELEASE, namespace=NAMESPACE, is_install=True)
    docs = []
    for path, text in sorted(files.items()):
        if path.endswith(".yaml"):
            docs.extend(d for d in yaml.safe_load_all(text) if d)
    return docs


def merged_values(values: dict[str, Any] | None = None) -> dict[str, Any]:
    with helm.Chart.load(str(CHART)) as chart:
        return chart.merge_values(values or {})


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def _strict(schema: Any) -> Any:
    """Forbid unknown fields wherever the schema lists an object's fields and does not say
    `x-kubernetes-preserve-unknown-fields` (what the API server's Strict validation does)."""
    if isinstance(schema, dict):
        out = {k: _strict(v) for k, v in schema.items()}
        if ("properties" in out and "additionalProperties" not in out
                and not out.get("x-kubernetes-preserve-unknown-fields")):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


@cache
def crd_validator(plural: str, version: str = "v1") -> Draft7Validator:
    """Validator of `ray.io/<version>` objects from ../shared/crds/ray.io_<plural>.yaml."""
    crd = yaml.safe_load((CRDS / f"ray.io_{plural}.yaml").read_text())
    (served,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    return Draft7Validator(_strict(copy.deepcopy(served["schema"]["openAPIV3Schema"])))


def crd_errors(plural: str, doc: dict[str, Any]) -> list[str]:
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
            for e in crd_validator(plural).iter_errors(doc)]


_DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_UPGRADE_TYPES = {"NewCluster", "None", "NewClusterWithIncrementalUpgrade"}
_RESOURCE_PARAMS = ("num-cpus", "num-gpus", "memory", "resources")


def kuberay_errors(service: dict[str, Any]) -> list[str]:
    """What KubeRay's ValidateRayServiceMetadata / ValidateRayServiceSpec would refuse."""
    errors = []
    name = service["metadata"]["name"]
    if len(name) > 47 or not _DNS1035.match(name):
        errors.append(f"RayService name {name!r}: at most 47 characters, a DNS-1035 label")
    spec = service["spec"]
    upgrade = spec.get("upgradeStrategy", {}).get("type")
    if upgrade is not None and upgrade not in _UPGRADE_TYPES:
        errors.append(f"upgradeStrategy.type {upgrade!r} not in {sorted(_UPGRADE_TYPES)}")
    cluster = spec["rayClusterConfig"]
    groups = [("head", cluster["headGroupSpec"])] + [
        (g["groupName"], g) for g in cluster.get("workerGroupSpecs", [])]
    for group_name, group in groups:
        if not group["template"]["spec"].get("containers"):
            errors.append(f"{group_name}: no container")
        params = group.get("rayStartParams", {})
        if group.get("resources") and any(params.get(k) for k in _RESOURCE_PARAMS):
            errors.append(f"{group_name}: resources in both rayStartParams and resources")
        if "labels" in params:
            errors.append(f"{group_name}: rayStartParams['labels'] is not supported")
    for _, group in groups[1:]:
        lo, hi, n = group["minReplicas"], group["maxReplicas"], group.get("replicas", 0)
        if not 0 <= lo <= hi or not lo <= n <= hi:
            errors.append(f"{group['groupName']}: need 0 <= minReplicas <= replicas <= "
                          f"maxReplicas, got {lo}, {n}, {hi}")
    return errors
