"""The Helm chart, rendered by Helm itself for every preset, checked as a cluster would.

Real parts: Helm's Go SDK (helm-python-sdk) renders and lints and applies values.schema.json;
KubeRay's CRD schema (../shared/crds/) checks the RayService; kubernetes-validate checks the
core kinds (ConfigMaps, the Ray pod templates); Ray's own `ServeDeploySchema` and tokenflow's
`AppConfig` check serveConfigV2. Only the API server itself is absent.
"""

from __future__ import annotations

import json
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest
import yaml
from jsonschema import Draft202012Validator
from ray.serve.schema import ServeDeploySchema

from tests.deploy.manifests import (
    CHART,
    CRDS,
    NAMESPACE,
    PRESETS,
    by_kind,
    crd_errors,
    kuberay_errors,
    merged_values,
    preset_values,
    render,
)
from tests.needs import need
from tokenflow.cluster.app import app_config_from_args, server_options
from tokenflow.cluster.serving_mode import (
    FORWARD_BODY,
    TUNING,
    body_forwarding,
    switches,
)
from tokenflow.config import AppConfig, ServingMode
from tokenflow.ops.chart_schema import to_json, values_schema
from tokenflow.ops.dashboards import dashboards
from tokenflow.ops.dashboards import to_json as dashboard_json

K8S_VERSION = kubernetes_validate.latest_version()


@pytest.fixture(scope="module", params=PRESETS)
def preset(request: pytest.FixtureRequest) -> tuple[str, list[dict[str, Any]]]:
    return request.param, render(preset_values(request.param))


def _service(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (service,) = by_kind(docs, "RayService")
    return service


def _pod_templates(service: dict[str, Any]) -> list[dict[str, Any]]:
    cluster = service["spec"]["rayClusterConfig"]
    return [cluster["headGroupSpec"]["template"]] + [
        g["template"] for g in cluster["workerGroupSpecs"]]


# ----------------------------------------------------------------------------- lint, schema


@pytest.mark.parametrize("name", PRESETS)
def test_helm_lint_is_clean(name: str) -> None:
    report = helm.lint(str(CHART), preset_values(name), strict=True, namespace=NAMESPACE)
    assert report["errors"] == [] and report["messages"] == [], report


def test_values_schema_is_generated_from_app_config() -> None:
    assert (CHART / "values.schema.json").read_text() == to_json(values_schema(CHART)), (
        "values.schema.json is stale: run `make chart-schema`")
    Draft202012Validator.check_schema(values_schema(CHART))
    assert values_schema(CHART)["properties"]["tokenflow"]["properties"].keys() == (
        AppConfig.model_fields.keys())


def test_chart_dashboards_are_the_generated_ones() -> None:
    committed = {p.name: p.read_text() for p in (CHART / "dashboards").glob("*.json")}
    assert committed == {name: dashboard_json(model) for name, model in dashboards().items()}, (
        "helm/tokenflow/dashboards is stale: run `make chart-schema`")


# --------------------------------------------------------------------------- every manifest


def test_rayservice_matches_kuberay_crd(preset: tuple[str, list[dict[str, Any]]]) -> None:
    need(CRDS.is_dir(), f"KubeRay's CRDs in {CRDS}")
    service = _service(preset[1])
    assert service["apiVersion"] == "ray.io/v1"
    assert crd_errors("rayservices", service) == []
    assert kuberay_errors(service) == []


def test_serve_config_is_valid_for_ray_and_tokenflow(
        preset: tuple[str, list[dict[str, Any]]]) -> None:
    name, docs = preset
    serve_config = yaml.safe_load(_service(docs)["spec"]["serveConfigV2"])
    ServeDeploySchema.model_validate(serve_config)
    (app,) = serve_config["applications"]
    assert app["import_path"] == "tokenflow.cluster.app:build_app"
    # The args are the values' tokenflow block, and build_app reads them as that AppConfig.
    expected = AppConfig.model_validate(merged_values(preset_values(name))["tokenflow"])
    assert app_config_from_args(app["args"]) == expected
    assert serve_config["http_options"] == {"host": expected.host, "port": expected.port}
    assert app["route_prefix"] == expected.route_prefix


def test_core_kinds_and_pod_templates_validate(preset: tuple[str, list[dict[str, Any]]]) -> None:
    docs = preset[1]
    core = [d for d in docs if d["kind"] in ("ConfigMap", "Service", "Secret")]
    assert core, "the chart renders the dashboards' ConfigMaps"
    pod_templates = [{"apiVersion": "v1", "kind": "PodTemplate",
                      "metadata": {"name": "ray-pod"}, "template": t}
                     for t in _pod_templates(_service(docs))]
    for doc in core + pod_templates:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_pod_monitor_scrapes_every_ray_pod(preset: tuple[str, list[dict[str, Any]]]) -> None:
    docs = preset[1]
    (monitor,) = by_kind(docs, "PodMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    selector = monitor["spec"]["selector"]["matchLabels"]
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    for template in _pod_templates(_service(docs)):
        assert selector.items() <= template["metadata"]["labels"].items()
        ports = {p["name"]: p["containerPort"] for p in template["spec"]["containers"][0]["ports"]}
        assert ports[endpoint["port"]] == merged_values()["ports"]["metrics"]


def test_dashboards_are_configmaps_for_grafanas_sidecar() -> None:
    maps = by_kind(render(), "ConfigMap")
    assert {m["metadata"]["labels"]["grafana_dashboard"] for m in maps} == {"1"}
    shipped = {k: json.loads(v) for m in maps for k, v in m["data"].items()}
    assert shipped == dashboards()


def test_model_volume_is_mounted_read_only_in_every_pod() -> None:
    docs = render({"models": {"enabled": True, "mountPath": "/ckpt",
                              "volume": {"hostPath": {"path": "/data/models"}}}})
    for template in _pod_templates(_service(docs)):
        (volume,) = template["spec"]["volumes"]
        assert volume == {"name": "models", "hostPath": {"path": "/data/models"}}
        (mount,) = template["spec"]["containers"][0]["volumeMounts"]
        assert mount == {"name": "models", "mountPath": "/ckpt", "readOnly": True}


def _env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", [])}


def _serving_env(mode: ServingMode) -> dict[str, str]:
    """What every pod must have for `mode`: Serve's tuning defaults and the mode's switches,
    HAProxy's body forwarding among them."""
    return {**TUNING, **switches(mode), **body_forwarding(mode)}


def test_dashboard_env_is_set_only_when_given() -> None:
    head = _pod_templates(_service(render()))[0]["spec"]["containers"][0]
    assert not {"RAY_PROMETHEUS_HOST", "RAY_GRAFANA_HOST"} & set(_env(head))
    docs = render({"rayDashboard": {"prometheusHost": "http://prometheus:9090",
                                    "grafanaHost": "http://grafana:80"}})
    head = _pod_templates(_service(docs))[0]["spec"]["containers"][0]
    assert _env(head) == {**_serving_env(AppConfig().serving_mode),
                          "RAY_PROMETHEUS_HOST": "http://prometheus:9090",
                          "RAY_GRAFANA_HOST": "http://grafana:80"}


@pytest.mark.parametrize("mode", [None, *ServingMode])
def test_every_pod_gets_the_serving_modes_switches(mode: ServingMode | None) -> None:
    """Unset, the chart's mode is AppConfig's default; each mode's pods get what
    `tokenflow serve` sets for it."""
    values = {} if mode is None else {"tokenflow": {"serving_mode": mode.value}}
    expected = _serving_env(mode or AppConfig().serving_mode)
    for template in _pod_templates(_service(render(values))):
        assert _env(template["spec"]["containers"][0]) == expected


def test_ingress_routers_per_node_reach_every_pod() -> None:
    expected = {**_serving_env(AppConfig().serving_mode),
                "RAY_SERVE_INGRESS_ROUTER_REPLICAS_PER_NODE": "2"}
    for template in _pod_templates(_service(render({"ingressRoutersPerNode": 2}))):
        assert _env(template["spec"]["containers"][0]) == expected
    assert "ingressRoutersPerNode" in _install_error({"ingressRoutersPerNode": 0})


@pytest.mark.parametrize("app", [
    {},
    {"deployment": {"request_router": "prefix_aware"}},
    {"deployment": {"request_router": "kv_aware"}},
    # power of two, but requests for LoRA adapters go where the adapter is held
    {"engine": {"lora": {"max_loras": 2}}},
], ids=["power_of_two", "prefix_aware", "kv_aware", "lora"])
@pytest.mark.parametrize("mode", list(ServingMode))
def test_haproxy_holds_every_request_whole_and_gives_the_router_its_body(
        mode: ServingMode, app: dict[str, Any]) -> None:
    """In the `haproxy` mode HAProxy waits for each request's body, whatever the router (it
    may send again only a request it holds whole), and the router gets it."""
    values = {"tokenflow": {"serving_mode": mode.value, **app}}
    expected = _serving_env(mode)
    assert (expected.get(FORWARD_BODY) == "1") == (mode is ServingMode.HAPROXY)
    for template in _pod_templates(_service(render(values))):
        assert _env(template["spec"]["containers"][0]) == expected


# ------------------------------------------------------------------- mistakes, as users see


def _install_error(values: dict[str, Any]) -> str:
    with pytest.raises(helm.HelmValuesError) as err:
        render(values)
    return str(err.value)


def test_unknown_engine_field_names_its_path() -> None:
    message = _install_error({"tokenflow": {"engine": {"schduler": {"max_num_seqs": 8}}}})
    assert "/tokenflow/engine" in message and "'schduler' not allowed" in message


def test_negative_replica_counts_are_refused() -> None:
    message = _install_error({"tokenflow": {"deployment": {"num_replicas": -1}}})
    assert "/tokenflow/deployment/num_replicas" in message and "minimum" in message
    group = {**merged_values()["workerGroups"][0], "replicas": -2}
    message = _install_error({"workerGroups": [group]})
    assert "/workerGroups/0/replicas" in message and "minimum" in message


def test_wrong_type_in_app_config_is_refused() -> None:
    message = _install_error({"tokenflow": {"engine": {"cache": {"block_size": "sixteen"}}}})
    assert "/tokenflow/engine/cache/block_size" in message


def test_enabled_model_volume_needs_one_source() -> None:
    message = _install_error({"models": {"enabled": True}})
    assert "/models/volume" in message
    message = _install_error({"models": {"enabled": True, "volume": {
        "hostPath": {"path": "/a"}, "nfs": {"server": "nfs", "path": "/b"}}}})
    assert "/models/volume" in message and "maxProperties" in message


def test_crd_check_catches_unknown_and_mistyped_fields() -> None:
    """The CRD check is strict: what the API server would refuse, it refuses too."""
    need(CRDS.is_dir(), f"KubeRay's CRDs in {CRDS}")
    service = _service(render())
    service["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParam"] = {}
    service["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["replicas"] = "one"
    errors = crd_errors("rayservices", service)
    assert any("rayStartParam" in e for e in errors), errors
    assert any("workerGroupSpecs/0/replicas" in e for e in errors), errors


def test_presets_follow_the_config_files() -> None:
    """The chart's default and autoscale presets are configs/local.yaml and
    configs/autoscale.yaml, but for what a pod needs (listen on 0.0.0.0, CPU explicitly)."""
    configs = CHART.parents[1] / "configs"
    for preset, file, section in (("default", "local.yaml", None),
                                  ("autoscale", "autoscale.yaml", "deployment")):
        chart = AppConfig.model_validate(merged_values(preset_values(preset))["tokenflow"])
        local = AppConfig.model_validate(yaml.safe_load((configs / file).read_text()))
        if section:
            # Helm drops a null value, so the chart's num_replicas is the default (1), which
            # Serve ignores next to an autoscaling_config: compare what Serve gets (of the
            # deployment section: the chart's model is its own).
            same_engine = chart.model_copy(update={"engine": local.engine})
            assert server_options(same_engine) == server_options(local)
            continue
        pod = local.model_copy(update={"host": "0.0.0.0"})
        pod = pod.model_copy(update={"engine": local.engine.model_copy(update={
            "model": local.engine.model.model_copy(update={"device": "cpu"})})})
        assert chart == pod, preset
