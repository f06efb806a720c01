"""`tokenflow serve`: start (or join) Ray, start Serve's HTTP proxy, deploy, serve until stopped.

A local Ray cluster is started unless `RAY_ADDRESS` names one to join. While the application
deploys, one status line is printed each time its state changes; then the URL; then the
process waits for Ctrl-C or SIGTERM and shuts down what it started: on a local cluster Serve and
Ray, on a joined cluster only its own application.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from typing import Any

from tokenflow.config import AppConfig

APP_NAME = "tokenflow"
POLL_S = 1.0


def _say(message: str) -> None:
    print(f"[tokenflow] {message}", file=sys.stderr, flush=True)


def config_from_cli(args: argparse.Namespace) -> AppConfig:
    """The AppConfig of `tokenflow serve`: the --config file plus the flag overrides."""
    from tokenflow.cluster.app import app_config_from_args

    serve_args: dict[str, Any] = {"model": args.model, "api_key": args.api_key}
    if args.config is not None:
        serve_args["config"] = args.config
    config = app_config_from_args(serve_args)
    updates = {k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None}
    return AppConfig.model_validate({**config.model_dump(), **updates}) if updates else config


def loopback_only() -> None:
    """Make a local single-node Ray cluster use 127.0.0.1 for all its addresses.

    Ray reads this when `ray` is first imported (and its workers inherit it), so call it before
    anything imports ray. A driver joining a remote cluster must not set it: its address would
    then be unreachable from the other nodes.
    """
    if not os.environ.get("RAY_ADDRESS"):
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")


def _start_ray() -> bool:
    """Join RAY_ADDRESS if set, else start a local cluster; True if we started it."""
    import ray

    if os.environ.get("RAY_ADDRESS"):
        ray.init(log_to_driver=False)
        return False
    ray.init(include_dashboard=False, log_to_driver=False)
    return True


def _deploy(config: AppConfig) -> None:
    """serve.run waits until the app is RUNNING; meanwhile report each change of state."""
    from ray import serve

    from tokenflow.cluster.app import bind_app

    outcome: dict[str, BaseException | None] = {}

    def run() -> None:
        try:
            serve.run(bind_app(config), name=APP_NAME, route_prefix=config.route_prefix)
            outcome["error"] = None
        except BaseException as exc:  # handed to the main thread
            outcome["error"] = exc

    thread = threading.Thread(target=run, name="tokenflow-deploy", daemon=True)
    thread.start()
    started, last = time.monotonic(), ""
    while thread.is_alive():
        line = _status_line()
        if line and line != last:
            _say(f"[{time.monotonic() - started:5.1f}s] {line}")
            last = line
        thread.join(POLL_S)
    if outcome.get("error") is not None:
        raise outcome["error"]  # type: ignore[misc]


def _status_line() -> str:
    from ray import serve

    try:
        app = serve.status().applications.get(APP_NAME)
    except Exception:  # the controller is still starting
        return "starting Serve"
    if app is None:
        return "submitting the application"
    parts = [f"{name}: {d.status.value}" + (f" ({d.message})" if d.message else "")
             for name, d in app.deployments.items()]
    return f"application {app.status.value}; " + "; ".join(parts)


def _report_load_time(model: str) -> None:
    """One replica's model load time (weights, KV cache, tokenizer), as it measured it."""
    from ray import serve

    try:
        handle = serve.get_deployment_handle("LLMServer", app_name=APP_NAME)
        info = handle.model_info.remote().result(timeout_s=30)
    except Exception as exc:  # informational only: never fail a running server over it
        _say(f"(could not ask the replica for its load time: {exc})")
        return
    _say(f"loaded {model} in {info['load_time_s']:.1f} s")


def _wait_for_signal() -> None:
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(POLL_S):
        pass


def serve_main(args: argparse.Namespace) -> int:
    """Run `tokenflow serve` to the end; returns the process exit code."""
    loopback_only()
    config = config_from_cli(args)  # a bad config fails here, before anything starts
    started_ray = _start_ray()
    import ray
    from ray import serve

    try:
        if not started_ray:
            _say(f"joined the Ray cluster at {os.environ['RAY_ADDRESS']}; if Serve already runs "
                 "there, its own HTTP host and port apply")
        serve.start(http_options={"host": config.host, "port": config.port})
        _say(f"deploying {config.engine.model.name} ...")
        try:
            _deploy(config)
        except Exception as exc:
            _say(f"deployment failed: {exc}")
            return 1
        _report_load_time(config.engine.model.name)
        prefix = config.route_prefix.rstrip("/")
        _say(f"serving the OpenAI API at http://{config.host}:{config.port}{prefix}/v1 "
             "(Ctrl-C to stop)")
        _wait_for_signal()
        _say("shutting down ...")
        return 0
    finally:
        try:
            if started_ray:
                serve.shutdown()
            else:
                serve.delete(APP_NAME)
        finally:
            ray.shutdown()
