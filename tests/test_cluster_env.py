"""A cluster's serving-mode environment keeps it apart from other clusters on the machine."""

from __future__ import annotations

from tokenflow.config import ServingMode
from tokenflow.ops.cluster_env import cluster_env, release_cluster_env


def test_haproxy_clusters_get_their_own_fallback_proxy_ports():
    """HAProxy falls back to Serve's proxy for a replica it holds DOWN or does not know yet;
    on Ray's default ports (8500, 9500) that proxy may be another cluster's, which answers
    404 for routes it does not have."""
    env = cluster_env(ServingMode.HAPROXY)
    try:
        http = int(env["RAY_SERVE_FALLBACK_PROXY_HTTP_PORT"])
        grpc = int(env["RAY_SERVE_FALLBACK_PROXY_GRPC_PORT"])
        assert http not in (8500, 9500) and grpc not in (8500, 9500) and http != grpc
    finally:
        release_cluster_env(env)
