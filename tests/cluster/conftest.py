"""Serve applications on the session's cluster (`tests/conftest.py`).

The main application (`main_app`) is deployed once, with an API key, so every request of the
suite also goes through the key check. Every application is deleted once the tests that use it
are done (`deployed`), and the cluster itself stops after its last user (tests/conftest.py): the
tests after them (those that start clusters of their own, and the multinode ones) share the
machine's two cores with whatever stays up.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from tests.conftest import Cluster, free_port

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


@dataclass(frozen=True)
class App:
    """One deployed application: its base URL, API key and a handle to its LLMServer."""

    name: str
    base_url: str
    api_key: str | None
    server: Any  # DeploymentHandle to LLMServer


def deploy(cluster: Cluster, name: str, route_prefix: str, args: dict[str, Any]) -> App:
    """Build with `build_app(args)` and run it as a named app; returns when it is RUNNING."""
    from ray import serve

    from tokenflow.cluster.app import build_app

    serve.run(build_app(args), name=name, route_prefix=route_prefix)
    app = App(name, cluster.http_url + route_prefix.rstrip("/"), args.get("api_key"),
              serve.get_deployment_handle("LLMServer", app_name=name))
    wait_until_routed(app)
    return app


def wait_until_routed(app: App, timeout_s: float = 120) -> None:
    """Wait until the app's own routes answer through the HTTP ingress: `serve.run` returns
    when the app is RUNNING, but HAProxy (the default serving mode) reloads its routes after
    that, and until it has, a request under the app's prefix is HAProxy's plain-text 404
    ("Path ... not found"), or the answer of another app on "/"."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            r = httpx.get(f"{app.base_url}/health", timeout=10)
            if r.status_code == 200:
                return
            last = f"{r.status_code} {r.text[:200]!r}"
        except httpx.HTTPError as exc:
            last = f"{type(exc).__name__}: {exc}"
        assert time.monotonic() < deadline, f"{app.base_url} not routed after {timeout_s}s: {last}"
        time.sleep(0.2)


def deployed(cluster: Cluster, name: str, route_prefix: str, args: dict[str, Any]
             ) -> Iterator[App]:
    """`deploy`, for a fixture to `yield from`: the app is deleted at the fixture's teardown."""
    from ray import serve

    app = deploy(cluster, name, route_prefix, args)
    try:
        yield app
    finally:
        serve.delete(name)


def main_app_args() -> dict[str, Any]:
    # One LoRA slot: test_prometheus loads an adapter at run time for its panels.
    return {"engine": {**ENGINE_ARGS, "lora": {"max_loras": 1}}, "api_key": API_KEY,
            "deployment": {"num_replicas": 1,
                           "ray_actor_options": SERVER_ACTOR_OPTIONS}}


PD_APP = "pd"


def pd_app_args(connector: str = "torch_p2p") -> dict[str, Any]:
    """A prefill and a decode deployment of the embedded model, one replica each; the decode
    side speculates with n-gram drafts."""
    def engine(role: str) -> dict[str, Any]:
        return {**ENGINE_ARGS, "model": {"model": "tokenflow-tiny", "num_threads": 1},
                "kv_transfer": {"connector": connector, "role": role, "lease_s": 10}}

    deployment = {"num_replicas": 1, "ray_actor_options": SERVER_ACTOR_OPTIONS}
    # The decode side also drafts (n-gram speculative decoding): tokens are the same.
    decode = {**engine("consumer"), "speculative": {"method": "ngram", "prompt_lookup_min": 1}}
    return {"engine": decode, "deployment": deployment, "api_key": API_KEY,
            "prefill": {"engine": engine("producer"), "deployment": deployment}}


@pytest.fixture(scope="package")
def pd_app(cluster: Cluster) -> Iterator[App]:
    """The disaggregated app (configs/pd.yaml, smaller): its handle is the decode LLMServer."""
    yield from deployed(cluster, PD_APP, "/pd", pd_app_args())


@pytest.fixture(scope="package")
def main_app(cluster: Cluster) -> Iterator[App]:
    started = time.monotonic()
    apps = deployed(cluster, MAIN_APP, "/", main_app_args())
    app = next(apps)
    print(f"main app deployed in {time.monotonic() - started:.1f}s")
    yield app
    apps.close()


__all__ = ["Cluster", "free_port"]  # for the test modules that import them from here
