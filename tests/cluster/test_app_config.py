"""App configs and the three entry points that read them.

The first half is pure (no Ray): the presets validate, a bad file names the field path, Serve
args map onto deployment options. The second half deploys onto the session's cluster the way
users do: Ray's own `serve run` with the `applications:` YAML, and `tokenflow serve`.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.cluster.conftest import ENGINE_ARGS, Cluster
from tokenflow.cli import main as cli_main
from tokenflow.config import AppConfig, ConfigError, load_app_config

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs"
BIN = Path(sys.executable).parent

# How long an app may take to start: a fresh-clone run beside two busy processes saw 205 s.
STARTUP_TIMEOUT_S = 400


# ------------------------------------------------------------------------------- presets


@pytest.mark.parametrize("name,model", [("local.yaml", "smollm2-135m-instruct"),
                                        ("autoscale.yaml", "tokenflow-tiny")])
def test_presets_validate(name: str, model: str) -> None:
    config = load_app_config(CONFIGS / name)
    assert config.engine.model.model == model
    assert config.host == "127.0.0.1"


def test_the_kv_routed_preset_routes_by_kv_events_over_an_offload_tier() -> None:
    from tokenflow.cluster.app import app_config_from_args, engine_for

    config = app_config_from_args({"config": str(CONFIGS / "kv-routed.yaml")})
    assert config.deployment.request_router == "kv_aware" and config.deployment.num_replicas == 2
    assert config.engine.kv_offload is not None and config.engine.kv_offload.backend == "cpu"
    engine = engine_for(config.engine, config.deployment)
    assert engine.kv_events is not None and engine.kv_events.enabled  # what the router reads


@pytest.mark.parametrize("data, reads", [
    ({}, False),
    ({"deployment": {"request_router": "prefix_aware"}}, True),
    ({"deployment": {"request_router": "kv_aware"}}, True),
    ({"engine": {"lora": {"max_loras": 2}}}, True),  # the adapter the body names
    ({"deployment": {"request_router": "least_connections"}}, False),
])
def test_the_router_reads_the_body_to_route_on_the_prompt_or_the_adapter(
        data: dict[str, Any], reads: bool) -> None:
    """HAProxy forwards every request's body to the ingress request router
    (`serving_mode.body_forwarding`); the router parses it exactly when it routes on what it
    says (`ReplicaRouter(reads_body=...)`)."""
    config = AppConfig.model_validate(data)
    assert config.router_reads_body is reads
    assert config.deployment.router_reads_prompt is (reads and "lora" not in data.get(
        "engine", {}))


def test_local_preset_is_one_replica_and_autoscale_is_a_range() -> None:
    from tokenflow.cluster.app import app_config_from_args, server_options

    local = server_options(app_config_from_args({"config": str(CONFIGS / "local.yaml")}))
    assert local["num_replicas"] == 1 and "autoscaling_config" not in local
    auto = server_options(app_config_from_args({"config": str(CONFIGS / "autoscale.yaml")}))
    assert "num_replicas" not in auto
    scaling = auto["autoscaling_config"]
    assert scaling["min_replicas"] == 1 and scaling["max_replicas"] > 1
    assert {"target_ongoing_requests", "upscale_delay_s", "downscale_delay_s"} <= set(scaling)
    # Serve itself accepts the options.
    from ray.serve.config import AutoscalingConfig
    AutoscalingConfig(**scaling)


def test_serve_yaml_is_a_valid_serve_config_with_our_args() -> None:
    from ray.serve.schema import ServeDeploySchema

    from tokenflow.cluster.app import app_config_from_args

    schema = ServeDeploySchema.model_validate(yaml.safe_load(
        (CONFIGS / "serve_local.yaml").read_text()))
    [app] = schema.applications
    assert app.import_path == "tokenflow.cluster.app:build_app"
    assert app_config_from_args(app.args).engine.model.model == "smollm2-135m-instruct"
    assert schema.http_options.host == "127.0.0.1"


# ------------------------------------------------------------------------ bad configs


BAD_CONFIGS = [
    ({"engine": {"cache": {"num_blocks": -1}}}, "engine.cache.num_blocks"),
    ({"engine": {"scheduler": {"policy": "lifo"}}}, "engine.scheduler.policy"),
    ({"deployment": {"autoscaling_config": {"min_replicas": 3, "max_replicas": 2},
                     "num_replicas": None}}, "deployment.autoscaling_config"),
    ({"deployment": {"max_ongoing_requests": "many"}}, "deployment.max_ongoing_requests"),
    ({"engine": {"model": {"dtype": "float8"}}}, "engine.model.dtype"),
    ({"engine": {"modle": {}}}, "engine.modle"),
    ({"port": 70000}, "port"),
]


@pytest.mark.parametrize("data,path", BAD_CONFIGS, ids=[p for _, p in BAD_CONFIGS])
def test_bad_config_file_names_the_field_path(tmp_path: Path, data: dict[str, Any],
                                              path: str) -> None:
    file = tmp_path / "bad.yaml"
    file.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError) as info:
        load_app_config(file)
    message = str(info.value)
    assert str(file) in message
    assert f"  {path}:" in message or f"  {path}." in message, message


def test_least_connections_needs_haproxy_and_a_decode_deployment(tmp_path: Path) -> None:
    router = {"deployment": {"request_router": "least_connections"}}
    assert load_app_config(router).deployment.request_router == "least_connections"
    with pytest.raises(ConfigError, match="needs serving_mode haproxy"):
        load_app_config({**router, "serving_mode": "proxy"})
    connector = {"kv_transfer": {"connector": "tcp", "role": "both"}}
    with pytest.raises(ConfigError, match="Serve request router"):
        load_app_config({"engine": connector, "prefill": {
            "engine": connector, "deployment": {"request_router": "least_connections"}}})


def test_build_app_args_errors_name_the_field_path(tmp_path: Path) -> None:
    from tokenflow.cluster.app import app_config_from_args

    with pytest.raises(ConfigError, match=r"engine\.cache\.block_size"):
        app_config_from_args({"engine": {"cache": {"block_size": 0}}})
    with pytest.raises(ConfigError, match="not found"):
        app_config_from_args({"config": str(tmp_path / "missing.yaml")})
    with pytest.raises(ConfigError, match="either 'config' or an inline config"):
        app_config_from_args({"config": str(CONFIGS / "local.yaml"), "engine": {}})


def test_flat_overrides_apply_over_a_config_file() -> None:
    from tokenflow.cluster.app import app_config_from_args

    config = app_config_from_args({"config": str(CONFIGS / "local.yaml"), "api_key": "k",
                                   "model": "tokenflow-tiny"})
    assert config.api_key == "k"
    assert config.engine.cache.num_blocks == 512  # the file's other fields stay
    assert app_config_from_args({}) == AppConfig()


def test_cli_reports_a_bad_config_and_exits_2(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    file = tmp_path / "bad.yaml"
    file.write_text("engine:\n  cache:\n    num_blocks: 0\n")
    assert cli_main(["serve", "--config", str(file)]) == 2
    err = capsys.readouterr().err
    assert "engine.cache.num_blocks" in err and str(file) in err


# -------------------------------------------------------------------- real entry points


def _small_args() -> dict[str, Any]:
    return {"engine": ENGINE_ARGS,
            "deployment": {"num_replicas": 1, "ray_actor_options": {"num_cpus": 0.5}}}


def _wait_running(app_name: str, timeout_s: float) -> None:
    from ray import serve

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        app = serve.status().applications.get(app_name)
        if app is not None and app.status == "RUNNING":
            return
        assert app is None or app.status != "DEPLOY_FAILED", app
        time.sleep(0.5)
    raise TimeoutError(f"{app_name} not RUNNING after {timeout_s}s")


def _complete(url: str) -> dict[str, Any]:
    r = httpx.post(url + "/v1/completions", timeout=STARTUP_TIMEOUT_S,
                   json={"model": "tokenflow-tiny", "prompt": "hello", "max_tokens": 3})
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.slow
def test_serve_run_with_the_applications_yaml(cluster: Cluster, tmp_path: Path) -> None:
    """Ray's own CLI, `serve run <config>`, deploys configs/serve_local.yaml onto the cluster.

    Only what must differ on a shared test cluster is changed: the app's name and route prefix,
    the HTTP port of the running Serve, and a smaller replica.
    """
    from ray import serve

    config = yaml.safe_load((CONFIGS / "serve_local.yaml").read_text())
    config["http_options"]["port"] = int(cluster.http_url.rsplit(":", 1)[1])
    [app] = config["applications"]
    app.update(name="from_yaml", route_prefix="/yaml")
    app["args"].update(_small_args())
    file = tmp_path / "serve.yaml"
    file.write_text(yaml.safe_dump(config))
    started = time.monotonic()
    env = {**os.environ, "RAY_ADDRESS": cluster.gcs_address}
    done = subprocess.run([str(BIN / "serve"), "run", str(file), "--non-blocking"], env=env,
                          capture_output=True, text=True, timeout=STARTUP_TIMEOUT_S)
    assert done.returncode == 0, done.stdout + done.stderr
    try:
        # A deadline, not a duration: under two busy processes a replica took 205 s to start.
        _wait_running("from_yaml", timeout_s=STARTUP_TIMEOUT_S)
        print(f"serve run: RUNNING after {time.monotonic() - started:.1f}s")
        out = _complete(cluster.http_url + "/yaml")
        assert out["usage"]["completion_tokens"] == 3
    finally:
        serve.delete("from_yaml")


@pytest.mark.slow
def test_tokenflow_serve_joins_the_cluster_and_stops_on_sigterm(cluster: Cluster,
                                                                tmp_path: Path) -> None:
    """`tokenflow serve` with RAY_ADDRESS set: deploys, prints the URL, SIGTERM removes it."""
    from ray import serve

    file = tmp_path / "cli.yaml"
    file.write_text(yaml.safe_dump({**_small_args(), "route_prefix": "/cli"}))
    env = {**os.environ, "RAY_ADDRESS": cluster.gcs_address}
    proc = subprocess.Popen([str(BIN / "tokenflow"), "serve", "--config", str(file),
                             "--api-key", "cli-key"], env=env, stderr=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, text=True)
    lines: list[str] = []
    try:
        assert proc.stderr is not None
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            line = proc.stderr.readline()
            if not line and proc.poll() is not None:
                break
            lines.append(line)
            if "serving the OpenAI API at" in line:
                break
        assert any("serving the OpenAI API at" in line for line in lines), "".join(lines)
        assert any("application" in line for line in lines)  # progress was shown
        assert any(re.search(r"loaded tokenflow-tiny in \d+\.\d s", line) for line in lines)
        url = cluster.http_url + "/cli"
        r = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2},
                       timeout=STARTUP_TIMEOUT_S)
        assert r.status_code == 401  # --api-key applied
        r = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2},
                       headers={"Authorization": "Bearer cli-key"}, timeout=STARTUP_TIMEOUT_S)
        assert r.status_code == 200, r.text
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=STARTUP_TIMEOUT_S) == 0, proc.stderr.read()
        assert "tokenflow" not in serve.status().applications
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("name", ["pp2.yaml", "pp2-gpu.yaml"])
def test_pipeline_presets_reserve_one_bundle_per_stage(name: str) -> None:
    from ray import serve

    from tokenflow.cluster.app import server_options
    from tokenflow.cluster.server import LLMServer
    from tokenflow.replica.worker.stage_bundles import cluster_gpus, stages_use_gpu

    config = load_app_config(CONFIGS / name)
    options = server_options(config)
    bundles = options["placement_group_bundles"]
    parallel = config.engine.parallel
    assert len(bundles) == parallel.pipeline_parallel_size == 2
    replica_cpus = config.deployment.ray_actor_options.get("num_cpus", 0)
    assert bundles[0]["CPU"] == parallel.stage_num_cpus + replica_cpus
    assert bundles[1]["CPU"] == parallel.stage_num_cpus
    assert ("GPU" in bundles[0]) == stages_use_gpu(config.engine.model.device, cluster_gpus())
    assert options["placement_group_strategy"] == parallel.placement_strategy
    serve.deployment(LLMServer, name="LLMServer", **options)  # Serve accepts the options


def test_stage_layers_must_match_the_stage_count() -> None:
    with pytest.raises(ConfigError, match="stage_layers"):
        load_app_config({"engine": {"parallel": {"pipeline_parallel_size": 2,
                                                 "stage_layers": [1, 2, 1]}}})
