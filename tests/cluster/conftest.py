"""One Ray cluster and one Serve instance per test session, on 127.0.0.1 only.

The cluster starts when the first test that needs it runs (the protocol and config tests never
start it) and stops at the end of the session. The main application (`main_app`) is deployed
once, with an API key, so every request of the suite also goes through the key check.
"""

from __future__ import annotations

import os

# Before anything imports ray: a single-node cluster on loopback addresses only.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

API_KEY = "tokenflow-test-key"
MAIN_APP = "main"
# Small and fast: the embedded model with a small KV pool and context.
ENGINE_ARGS: dict[str, Any] = {
    "model": {"model": "tokenflow-tiny"},
    "cache": {"block_size": 16, "num_blocks": 512},
    "scheduler": {"max_model_len": 512, "max_num_seqs": 128, "max_num_batched_tokens": 2048},
}
# Fractional CPUs: the test machine has two cores for everything.
SERVER_ACTOR_OPTIONS = {"num_cpus": 0.5}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class Cluster:
    """The session's Ray cluster: Serve's HTTP address and the Prometheus export port."""

    http_url: str
    metrics_port: int
    gcs_address: str


@dataclass(frozen=True)
class App:
    """One deployed application: its base URL, API key and a handle to its LLMServer."""

    name: str
    base_url: str
    api_key: str | None
    server: Any  # DeploymentHandle to LLMServer


@pytest.fixture(scope="session")
def cluster() -> Iterator[Cluster]:
    import ray
    from ray import serve

    http_port, metrics_port = free_port(), free_port()
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             _metrics_export_port=metrics_port,
             # Export metrics every second instead of every 10, for the metrics test.
             _system_config={"metrics_report_interval_ms": 1000})
    gcs_address = ray.get_runtime_context().gcs_address
    assert gcs_address.startswith("127.0.0.1:"), (
        f"Ray listens on {gcs_address}: something imported ray before this conftest could set "
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0; set it in the environment or a root conftest")
    serve.start(http_options={"host": "127.0.0.1", "port": http_port})
    try:
        yield Cluster(f"http://127.0.0.1:{http_port}", metrics_port, gcs_address)
    finally:
        serve.shutdown()
        ray.shutdown()


def deploy(cluster: Cluster, name: str, route_prefix: str, args: dict[str, Any]) -> App:
    """Build with `build_app(args)` and run it as a named app; returns when it is RUNNING."""
    from ray import serve

    from tokenflow.cluster.app import build_app

    serve.run(build_app(args), name=name, route_prefix=route_prefix)
    return App(name, cluster.http_url + route_prefix.rstrip("/"), args.get("api_key"),
               serve.get_deployment_handle("LLMServer", app_name=name))


def main_app_args() -> dict[str, Any]:
    return {"engine": ENGINE_ARGS, "api_key": API_KEY,
            "deployment": {"num_replicas": 1,
                           "ray_actor_options": SERVER_ACTOR_OPTIONS}}


@pytest.fixture(scope="session")
def main_app(cluster: Cluster) -> App:
    started = time.monotonic()
    app = deploy(cluster, MAIN_APP, "/", main_app_args())
    print(f"main app deployed in {time.monotonic() - started:.1f}s")
    return app
