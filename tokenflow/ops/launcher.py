"""`tokenflow serve`: start (or join) Ray, start Serve's HTTP proxy, deploy, serve until stopped.

A new local Ray cluster is started unless `RAY_ADDRESS` names one to join (never whatever
cluster Ray's temp dir happens to name). While the application deploys, one status line is
printed each time its state changes; then the URL; then the process waits for Ctrl-C or
SIGTERM, watching that its port still answers (if Ray dies under it, it exits non-zero), drains
(every replica admits nothing new and finishes what it admitted, for at most `--drain-timeout`
seconds; a second Ctrl-C or SIGTERM cuts it short) and shuts down only what it started: on its
own cluster Ray and every process under it (HAProxy and its files included), on a joined
cluster only its own application. A cluster started here has the Ray dashboard on; its URL and
the metrics port are printed (`ops.observe`).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import sys
import threading
import time
from typing import Any

from tokenflow.config import AppConfig, ServingMode, app_config_from_args
from tokenflow.ops.cluster_env import apply_cluster_env, release_cluster_env
from tokenflow.ops.observe import ObserveOptions, describe, options_from_args

APP_NAME = "tokenflow"
POLL_S = 1.0
DRAIN_POLL_S = 0.5
DEFAULT_DRAIN_TIMEOUT_S = 30.0
# One broadcast to the replicas (they answer from their event loop, whatever their load).
CONTROL_TIMEOUT_S = 30.0
# Consecutive refused connections on our port before concluding the server is gone.
MAX_REFUSALS = 3


class ServeError(RuntimeError):
    """`tokenflow serve` cannot go on; the message says why and what to do."""


def _say(message: str) -> None:
    print(f"[tokenflow] {message}", file=sys.stderr, flush=True)


def config_from_cli(args: argparse.Namespace) -> AppConfig:
    """The AppConfig of `tokenflow serve`: the --config file plus the flag overrides."""
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


def _check_port_free(host: str, port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise ServeError(f"cannot serve on {host}:{port}: {exc.strerror} (another server, "
                             "or another tokenflow serve, holds it); choose a free one with "
                             "--port") from None


def _port_answers(host: str, port: int) -> bool:
    target = "127.0.0.1" if host in ("0.0.0.0", "") else host
    try:
        with socket.create_connection((target, port), timeout=2):
            return True
    except OSError:
        return False


def _start_ray(observe: ObserveOptions, mode: ServingMode) -> dict[str, str] | None:
    """Join RAY_ADDRESS if set (None), else start a new local cluster set up for `mode`: the
    environment it was set up with (`apply_cluster_env`), to release when it is gone."""
    import ray

    address = os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=False)
        return None
    observe.export_env()  # read by the dashboard process that ray.init starts
    # Serve's switches, read by every process of the new cluster.
    cluster = apply_cluster_env(mode)
    # "local": a new cluster of our own, even if Ray's temp dir names a running one.
    context = ray.init(address="local", log_to_driver=False, **observe.ray_init_kwargs())
    for line in describe(observe, context.dashboard_url):
        _say(line)
    return cluster


def _refuse_to_replace(started_ray: bool) -> None:
    """On a joined cluster, an application of our name belongs to someone else: keep it."""
    from ray import serve

    if started_ray:
        return
    try:
        apps = serve.status().applications
    except Exception:  # no Serve instance there yet
        return
    if APP_NAME in apps:
        raise ServeError(f"the Ray cluster at {os.environ['RAY_ADDRESS']} already runs a "
                         f"Serve application named {APP_NAME!r}; refusing to replace it")


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


class ClusterWatch:
    """Owns the checks that say this server can still serve: the head processes of a cluster
    it started (Ray runs them as this process's children) are alive, and its port answers.

    On a joined cluster neither is ours to watch: Serve's proxy listens where the cluster's
    owner started it (not at our config's port), and its owner keeps it alive."""

    def __init__(self, config: AppConfig, started_ray: bool) -> None:
        import psutil

        self._config = config
        self._started_ray = started_ray
        self._refusals = 0
        self._head = [p for p in psutil.Process().children(recursive=True)
                      if started_ray and p.name() in ("gcs_server", "raylet")]

    def problem(self) -> str | None:
        """Why serving cannot go on, or None."""
        import psutil

        for process in self._head:
            if not process.is_running() or process.status() == psutil.STATUS_ZOMBIE:
                return f"Ray's {process.name()} (pid {process.pid}) died"
        if not self._started_ray:
            return None
        host, port = self._config.host, self._config.port
        self._refusals = 0 if _port_answers(host, port) else self._refusals + 1
        if self._refusals >= MAX_REFUSALS:
            return f"{host}:{port} stopped answering (the Ray cluster or its Serve proxy died)"
        return None


def _on_stop_signals(stop: threading.Event) -> None:
    """Ctrl-C or SIGTERM from now on sets `stop`."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())


def _serve_until_stopped(watch: ClusterWatch) -> str | None:
    """Wait for Ctrl-C or SIGTERM (None), or until the watch finds a problem (returned)."""
    stop = threading.Event()
    _on_stop_signals(stop)
    while not stop.wait(POLL_S):
        problem = watch.problem()
        if problem is not None:
            return problem
    return None


def _drain(config: AppConfig, timeout_s: float) -> None:
    """Pause every LLMServer replica with PAUSED_NEW (nothing new is admitted; what was admitted
    runs to its end), then wait until they (and the prefill replicas) are idle, at most
    `timeout_s`; a second Ctrl-C or SIGTERM cuts the wait short. Requests still waiting for
    admission are cut off by the shutdown."""
    from ray import serve

    from tokenflow.scheduler import PauseState

    if timeout_s <= 0:
        return
    hurry = threading.Event()
    _on_stop_signals(hurry)
    deadline = time.monotonic() + timeout_s
    try:
        decode = serve.get_deployment_handle("LLMServer", app_name=APP_NAME)
        decode.broadcast("pause", PauseState.PAUSED_NEW).results(timeout_s=CONTROL_TIMEOUT_S)
        handles = [decode]
        if config.prefill is not None:  # paused decode replicas send it nothing new
            handles.append(serve.get_deployment_handle("PrefillServer", app_name=APP_NAME))
        _say(f"draining: admitting nothing new, waiting up to {timeout_s:g} s for the requests "
             "in progress (Ctrl-C again to stop at once) ...")
        while not _all_idle(handles):
            if hurry.wait(DRAIN_POLL_S) or time.monotonic() > deadline:
                _say("drain cut short: stopping with requests in progress")
                return
    except Exception as exc:  # a replica that cannot answer must not keep us from stopping
        _say(f"(could not drain: {type(exc).__name__}: {exc}); stopping now")
        return
    _say("drained")


def _all_idle(handles: list[Any]) -> bool:
    """Whether every replica of these deployments has nothing left that it may run."""
    return all(status["idle"] for handle in handles
               for status in handle.broadcast("pause_status").results(
                   timeout_s=CONTROL_TIMEOUT_S))


def serve_main(args: argparse.Namespace) -> int:
    """Run `tokenflow serve` to the end; returns the process exit code."""
    loopback_only()
    config = config_from_cli(args)  # a bad config fails here, before anything starts
    joining = bool(os.environ.get("RAY_ADDRESS"))
    observe = options_from_args(args)
    try:
        if not joining:
            _check_port_free(config.host, config.port)
            observe.check_ports_free()  # ValueError naming the flag to change
        cluster = _start_ray(observe, config.serving_mode)
        _refuse_to_replace(cluster is not None)
    except (ServeError, ValueError) as exc:
        _say(f"error: {exc}")
        return 2
    return _run(config, cluster, args.drain_timeout)


def _run(config: AppConfig, cluster: dict[str, str] | None,
         drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S) -> int:
    """Deploy, serve until stopped, drain, stop. `cluster`: the environment of the cluster we
    started (`_start_ray`), None on a joined one."""
    from ray import serve

    started_ray, deployed, cluster_alive = cluster is not None, False, True
    try:
        if not started_ray:
            _say(f"joined the Ray cluster at {os.environ['RAY_ADDRESS']}; if Serve already runs "
                 "there, its own HTTP host and port apply")
        serve.start(http_options={"host": config.host, "port": config.port})
        mode = config.serving_mode
        _say(f"serving mode {mode.value}: {mode.describe()}")
        _say("engine loop: " + ("an engine process beside each replica's HTTP"
                                if config.engine.uses_engine_process
                                else "a thread of each replica's process"))
        _say(f"deploying {config.engine.model.name} ...")
        try:
            deployed = True
            _deploy(config)
        except Exception as exc:
            _say(f"deployment failed: {exc}")
            return 1
        _report_load_time(config.engine.model.name)
        prefix = config.route_prefix.rstrip("/")
        _say(f"serving the OpenAI API at http://{config.host}:{config.port}{prefix}/v1 "
             "(Ctrl-C to stop)")
        problem = _serve_until_stopped(ClusterWatch(config, started_ray))
        if problem is not None:
            cluster_alive = False  # nothing left to stop politely
            _say(f"error: {problem}; exiting")
            return 1
        _drain(config, drain_timeout_s)
        _say("shutting down ...")
        return 0
    finally:
        if not cluster_alive:
            _abandon_dead_cluster(cluster or {})
        _shut_down(cluster, deployed)


def _abandon_dead_cluster(cluster: dict[str, str]) -> None:
    """Exit now, with status 1, when Ray died under us: any Ray call from here on (ours, or
    one of Serve's background threads at interpreter exit) would start a new local instance or
    wait a minute for the dead GCS. What is left of the processes we started goes too."""
    import psutil

    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            child.kill()
    release_cluster_env(cluster)  # our HAProxy, no longer under us
    sys.stderr.flush()
    sys.stdout.flush()
    os._exit(1)


def _shut_down(cluster: dict[str, str] | None, deployed: bool) -> None:
    """Stop only what this process started; a dead cluster is not an error here.

    A cluster this process started goes whole, without Serve's own shutdown first: that stops
    each replica gracefully and holds its port through the draining period (about 5 s in
    all), which only waits for requests the drain has already seen end. Every process under
    this one that outlives Ray's shutdown is killed, and our HAProxy's files go."""
    import psutil
    import ray
    from ray import serve

    if cluster is not None:
        ours = psutil.Process().children(recursive=True)
        ray.shutdown()
        for process in ours:
            with contextlib.suppress(psutil.Error):
                process.kill()
        release_cluster_env(cluster)
        return
    try:
        if deployed:
            serve.delete(APP_NAME)
    except Exception as exc:
        _say(f"(could not stop Serve cleanly: {type(exc).__name__})")
    ray.shutdown()
