"""The session's single-node Ray cluster (and Serve instance), on 127.0.0.1 only.

It starts when the first test that needs it runs (most tests never do) and stops at the end of
the session; every test that needs Ray in this process shares it (Ray allows one per process).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

# Before anything imports ray: a single-node cluster on loopback addresses only, set up for
# the default serving mode (Serve reads its switches when first imported, in this process
# and in every process of the cluster), so the serving tests run in the mode users get.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
from tokenflow.cluster.serving_mode import switches  # noqa: E402
from tokenflow.config import AppConfig  # noqa: E402
from tokenflow.net import free_port  # noqa: E402
from tokenflow.ops.cluster_env import apply_cluster_env, release_cluster_env  # noqa: E402

DEFAULT_SERVING_MODE = AppConfig().serving_mode
os.environ.update(switches(DEFAULT_SERVING_MODE))


@dataclass(frozen=True)
class Cluster:
    """The session's Ray cluster: Serve's HTTP address and the Prometheus export port."""

    http_url: str
    metrics_port: int
    gcs_address: str


@pytest.fixture(scope="session")
def cluster() -> Iterator[Cluster]:
    import ray
    from ray import serve

    # The rest of the mode's environment (HAProxy's files and ports) now, not at import: a port
    # picked long before HAProxy binds it has had all that time to be taken.
    env = apply_cluster_env(DEFAULT_SERVING_MODE)
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
        release_cluster_env(env)
