"""`build_app(args)`: one `AppConfig` -> one Serve application (OpenAIIngress -> LLMServer).

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

from tokenflow.cluster.ingress import OpenAIIngress
from tokenflow.cluster.server import LLMServer
from tokenflow.config import AppConfig, ConfigError, load_app_config

# Flat overrides accepted next to a config: name -> path in the AppConfig.
FLAT_OVERRIDES: dict[str, tuple[str, ...]] = {
    "model": ("engine", "model", "model"),
    "api_key": ("api_key",),
}
# The ingress only forwards bytes: no CPU reservation, and room for every request the
# LLMServer replicas could hold at once.
INGRESS_OPTIONS: dict[str, Any] = {"num_replicas": 1, "max_ongoing_requests": 4096,
                                   "ray_actor_options": {"num_cpus": 0}}


def app_config_from_args(args: dict[str, Any] | None) -> AppConfig:
    """Validate Serve-style `args` into an AppConfig; errors name the bad field's path."""
    args = dict(args or {})
    overrides = {k: args.pop(k) for k in list(args) if k in FLAT_OVERRIDES}
    path = args.pop("config", None)
    if path is not None and args:
        raise ConfigError(f"give either 'config' or an inline config, not both "
                          f"(also got: {', '.join(sorted(args))})")
    config = load_app_config(path if path is not None else args)
    if not overrides:
        return config
    data = config.model_dump(exclude_unset=True)
    for key, value in overrides.items():
        if value is not None:
            _set_path(data, FLAT_OVERRIDES[key], value)
    return load_app_config(data)


def server_options(config: AppConfig) -> dict[str, Any]:
    """The LLMServer deployment's Serve options (num_replicas xor autoscaling_config; with
    pipeline stages, the placement group each replica reserves for them)."""
    deployment = config.deployment
    options: dict[str, Any] = {"max_ongoing_requests": deployment.max_ongoing_requests,
                               "ray_actor_options": dict(deployment.ray_actor_options)}
    parallel = config.engine.parallel
    if parallel.uses_ray:
        # One bundle per stage, the replica's own resources merged into the first, where Serve
        # places the replica itself; the replica's stage actors then go into this group.
        from tokenflow.replica.stage_bundles import replica_bundles

        options["placement_group_bundles"] = replica_bundles(config.engine,
                                                             deployment.ray_actor_options)
        options["placement_group_strategy"] = parallel.placement_strategy
    if deployment.autoscaling_config is not None:
        options["autoscaling_config"] = deployment.autoscaling_config.model_dump(
            exclude_none=True)
    else:
        options["num_replicas"] = deployment.num_replicas
    return options


def bind_app(config: AppConfig) -> serve.Application:
    """Bind the ingress to the LLMServer deployment with the configured options."""
    server = serve.deployment(LLMServer, name="LLMServer", **server_options(config))
    ingress = serve.deployment(OpenAIIngress, name="OpenAIIngress", **INGRESS_OPTIONS)
    engine_args = config.engine.model_dump(mode="json")
    model = config.engine.model
    return ingress.bind(server.bind(engine_args, stream_interval_s=config.stream_interval_s),
                        model.name, config.api_key, model.tokenizer or model.model)


def build_app(args: dict[str, Any] | None = None) -> serve.Application:
    """Serve's application builder: `import_path: tokenflow.cluster.app:build_app`."""
    return bind_app(app_config_from_args(args))


def _set_path(data: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    for key in path[:-1]:
        data = data.setdefault(key, {})
    data[path[-1]] = value
