"""A Ray cluster's environment for a serving mode, outside the cluster: Serve's switches and
tuning, and (for HAProxy) the cluster's own HAProxy files, admin ports and replica port block.
`tokenflow serve` and the tests set it before they start a cluster and release it after.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile

from tokenflow.cluster.serving_mode import TUNING, body_forwarding, switches
from tokenflow.config import ServingMode
from tokenflow.net import claim_port_block, free_port

# The directory of a cluster's own HAProxy files (`cluster_env`, `release_cluster_env`).
_FILES = "RAY_SERVE_HAPROXY_SERVER_STATE_BASE"


def cluster_env(mode: ServingMode) -> dict[str, str]:
    """The environment a new Ray cluster needs for `mode` (`serving_mode`'s switches, tuning
    and, in the `haproxy` mode, body forwarding).

    For HAProxy this also gives the cluster its own HAProxy files and admin ports: Ray's
    defaults (/tmp/haproxy-serve, ports 8404 and 9101) are machine-wide, so two clusters on
    one machine would overwrite each other's HAProxy. One thread per core it may use, at most 2:
    the proxy only shuffles bytes, and more threads would take CPU from the engine. And the
    replica ports of this process's block (`net.claim_port_block`), so that the clusters of
    two processes on one machine never route to each other's replicas.
    """
    env = {**{k: os.environ.get(k, v) for k, v in TUNING.items()}, **switches(mode)}
    if mode is ServingMode.HAPROXY:
        # Short: Ray nests a 56-character directory in it, and a socket path has at most 97.
        base = tempfile.mkdtemp(prefix="tfh-", dir="/tmp")
        env.update({
            "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": os.path.join(base, "haproxy.cfg"),
            "RAY_SERVE_HAPROXY_SOCKET_PATH": os.path.join(base, "admin.sock"),
            _FILES: base,
            "RAY_SERVE_HAPROXY_SERVER_STATE_FILE": os.path.join(base, "server-state"),
            "RAY_SERVE_HAPROXY_STATS_PORT": str(free_port()),
            "RAY_SERVE_HAPROXY_METRICS_PORT": str(free_port()),
            "RAY_SERVE_HAPROXY_NBTHREAD": str(min(2, os.cpu_count() or 1)),
            # The Serve proxy HAProxy falls back to (a replica held DOWN, or one it does not
            # know yet): Ray's defaults, 8500 and 9500, are shared by every cluster on the
            # machine, and a request could land in another cluster's proxy (its 404).
            "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT": str(free_port()),
            "RAY_SERVE_FALLBACK_PROXY_GRPC_PORT": str(free_port()),
        })
        ports = claim_port_block()
        env.update({"RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(ports.start),
                    # Serve allocates from range(min, max): max is not handed out.
                    "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(ports.stop)})
    return {**env, **body_forwarding(mode)}


def release_cluster_env(env: dict[str, str]) -> None:
    """Undo what `cluster_env` left outside the cluster, once the cluster is gone: the HAProxy
    that ran from its files, if it outlived Ray (it is a child of a Ray actor's worker, and
    when Ray dies under it nothing else stops it: it would hold the serving port), and the
    files themselves."""
    import psutil

    base = env.get(_FILES)
    if not base:
        return
    for process in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            if any(arg.startswith(base + os.sep) for arg in process.info["cmdline"] or ()):
                process.kill()
    shutil.rmtree(base, ignore_errors=True)


def apply_cluster_env(mode: ServingMode) -> dict[str, str]:
    """Put `cluster_env(mode)` into this process's environment (before `ray.init` starts a
    cluster, whose processes inherit it); returns what was set."""
    env = cluster_env(mode)
    os.environ.update(env)
    return env
