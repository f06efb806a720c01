"""`build_app(args)`: one `AppConfig` -> one Serve application (see `serving_mode` for its
shape: OpenAIIngress -> LLMServer, or the LLMServer as its own ingress).

The same entry point serves `tokenflow serve`, Ray's own `serve run` / `serve deploy` (an
`applications:` entry with `import_path: tokenflow.cluster.app:build_app` and `args`), and
KubeRay's `serveConfigV2`. `args` is either the AppConfig itself (`{"engine": ..., "deployment":
...}`) or `{"config": "path/to/preset.yaml"}`; either may add flat overrides (`model`,
`api_key`). With `serve run`/`serve deploy` the app is built in a Ray task whose working
directory is not yours: give `config` as an absolute path, or put the config inline.

`host`, `port` and `route_prefix` of the AppConfig are not part of an application (Serve's HTTP
options are per cluster, the route prefix is per `serve.run` call or `applications:` entry); the
launcher applies them.
"""

from __future__ import annotations

from typing import Any

from ray import serve

from tokenflow.cluster.chat_output import ChatOptions
from tokenflow.cluster.ingress import OpenAIIngress
from tokenflow.cluster.server import LLMServer
from tokenflow.cluster.serving_mode import check_cluster_env
from tokenflow.config import (
    AppConfig,
    DeploymentConfig,
    EngineConfig,
    ServingMode,
    app_config_from_args,
)

# The ingress only forwards bytes: no CPU reservation, and room for every request the
# LLMServer replicas could hold at once.
INGRESS_OPTIONS: dict[str, Any] = {"num_replicas": 1, "max_ongoing_requests": 4096,
                                   "ray_actor_options": {"num_cpus": 0}}
# The ingress request router answers one small call per request (HAProxy's), never a token.
ROUTER_OPTIONS: dict[str, Any] = {"max_ongoing_requests": 4096,
                                  "ray_actor_options": {"num_cpus": 0}}


# Serve replaces a replica after three failed health checks in a row. Every 10 s (Serve's
# default), a replica that cannot serve (a pipeline stage died, its engine died twice) answers
# 503s for half a minute, and looks idle to the request router meanwhile, which sends it more.
# The check itself costs nothing (`LLMServer.check_health`), and an engine restarting passes it.
HEALTH_CHECK_PERIOD_S = 2.0


def server_options(config: AppConfig) -> dict[str, Any]:
    """The (decode side's) LLMServer deployment's Serve options."""
    return deployment_options(config.engine, config.deployment)


def engine_for(engine: EngineConfig, deployment: DeploymentConfig) -> EngineConfig:
    """The engine config a deployment's replicas run: with the kv_aware router, KV-cache
    events on, with a replay socket (a router that starts later learns what they hold)."""
    events = engine.kv_events
    if deployment.request_router != "kv_aware" or (events.enabled and events.replay_endpoint):
        return engine
    events = events.model_copy(update={"enabled": True,
                                       "replay_endpoint": events.replay_endpoint or "tcp://*:0"})
    return engine.model_copy(update={"kv_events": events})


def prompt_router_config(engine: EngineConfig, deployment: DeploymentConfig) -> dict[str, Any]:
    """Serve's `request_router_config` for a router that routes on the prompt's block hashes
    (prefix_aware, kv_aware): its class, the block size and tokenizer it hashes with, its own
    knob, and how often the replicas report their load (kv_aware: also where they publish)."""
    model = engine.model
    if deployment.request_router == "prefix_aware":
        cls, knob = "tokenflow.cluster.prefix_router:PrefixAwareRouter", {
            "imbalanced_threshold": deployment.router_imbalanced_threshold}
        period_s = 2.0  # for when Serve has no queue length at hand
    else:
        cls, knob = "tokenflow.cluster.kv_router:KVAwareRouter", {
            "overlap_weight": deployment.router_overlap_weight}
        period_s = 1.0  # its load term (held KV blocks) comes from these reports
    return {"request_router_class": cls,
            "request_router_kwargs": {"block_size": engine.cache.block_size,
                                      "tokenizer": model.tokenizer or model.model,
                                      "model_name": model.name,
                                      "chat_template": engine.chat_template, **knob},
            "request_routing_stats_period_s": period_s}


def deployment_options(engine: EngineConfig, deployment: DeploymentConfig) -> dict[str, Any]:
    """An LLMServer deployment's Serve options (num_replicas xor autoscaling_config; with
    pipeline stages, the placement group each replica reserves for them)."""
    options: dict[str, Any] = {"max_ongoing_requests": deployment.max_ongoing_requests,
                               "ray_actor_options": dict(deployment.ray_actor_options),
                               "health_check_period_s": HEALTH_CHECK_PERIOD_S}
    parallel = engine.parallel
    if parallel.uses_ray:
        # One bundle per stage, the replica's own resources merged into the first, where Serve
        # places the replica itself; the replica's stage actors then go into this group.
        from tokenflow.replica.worker.stage_bundles import replica_bundles

        options["placement_group_bundles"] = replica_bundles(engine,
                                                             deployment.ray_actor_options)
        options["placement_group_strategy"] = parallel.placement_strategy
    if deployment.router_reads_prompt:
        options["request_router_config"] = prompt_router_config(engine, deployment)
    if deployment.autoscaling_config is not None:
        options["autoscaling_config"] = deployment.autoscaling_config.serve_options()
    else:
        options["num_replicas"] = deployment.num_replicas
    return options


def bind_app(config: AppConfig) -> serve.Application:
    """The application of `config.serving_mode`: the OpenAIIngress deployment bound to the
    LLMServer deployment, or the LLMServer as its own ingress (with HAProxy, plus the ingress
    request router that picks its replica); when disaggregated, the decode LLMServer is bound
    to its prefill deployment."""
    mode = config.serving_mode
    check_cluster_env(mode)
    engine_args = engine_for(config.engine, config.deployment).model_dump(mode="json")
    prefill = None
    if config.prefill is not None:
        prefill = serve.deployment(
            LLMServer, name="PrefillServer",
            **deployment_options(config.prefill.engine, config.prefill.deployment),
        ).bind(engine_for(config.prefill.engine, config.prefill.deployment
                          ).model_dump(mode="json"),
               max_queued_requests=config.prefill.deployment.max_queued_requests)
    model = config.engine.model
    http_args = (model.name, config.api_key, model.tokenizer or model.model)
    max_queued = config.deployment.max_queued_requests
    if not mode.replica_is_ingress:
        server = serve.deployment(LLMServer, name="LLMServer", **server_options(config))
        ingress = serve.deployment(OpenAIIngress, name="OpenAIIngress", **INGRESS_OPTIONS)
        return ingress.bind(server.bind(engine_args, stream_interval_s=config.stream_interval_s,
                                        prefill=prefill, max_queued_requests=max_queued),
                            *http_args, chat=ChatOptions.from_engine(config.engine))
    from tokenflow.cluster.replica_ingress import IngressLLMServer, ReplicaRouter

    server = serve.deployment(IngressLLMServer, name="LLMServer", **server_options(config))
    app = server.bind(engine_args, *http_args, stream_interval_s=config.stream_interval_s,
                      prefill=prefill, max_queued_requests=max_queued,
                      behind_haproxy=mode is ServingMode.HAPROXY)
    if mode is ServingMode.HAPROXY and config.deployment.request_router != "least_connections":
        router = serve.deployment(ReplicaRouter, name="ReplicaRouter", **ROUTER_OPTIONS)
        # Serve's direct-streaming hook (Ray 2.60, internal): HAProxy asks the router for
        # each request's replica and sends the request straight to that replica's port.
        app = app._with_ingress_request_router(
            router.bind(app, model.name, reads_body=config.router_reads_body))
    return app


def build_app(args: dict[str, Any] | None = None) -> serve.Application:
    """Serve's application builder: `import_path: tokenflow.cluster.app:build_app`."""
    return bind_app(app_config_from_args(args))
