"""What `tokenflow serve` turns on for observing a cluster it starts: the Ray dashboard, the
Prometheus export of Ray's metrics, and the links from the dashboard to Prometheus and Grafana.

The Ray dashboard (cluster, actors, logs, and the Serve view of applications, deployments and
replicas) listens on 8265, or the next free port when another cluster's dashboard holds it (so
that several servers can run on one machine), or exactly on `--dashboard-port`; not at all with
`--no-dashboard`. Its metrics views read
Prometheus and embed Grafana: Ray takes their addresses from the RAY_PROMETHEUS_HOST,
RAY_PROMETHEUS_NAME, RAY_GRAFANA_HOST and RAY_GRAFANA_IFRAME_HOST variables, which must be in
the environment of the dashboard process that `ray.init` starts, so they are set here, before
Ray starts, when the user gives them. `--metrics-port` fixes the port Prometheus scrapes (Ray
otherwise picks a free one, printed at start).
"""

from __future__ import annotations

import argparse
import os
import socket
from dataclasses import dataclass
from typing import Any

DEFAULT_DASHBOARD_PORT = 8265
# flag -> Ray's environment variable, read by the dashboard's metrics views.
ENV_FLAGS: dict[str, str] = {
    "prometheus_host": "RAY_PROMETHEUS_HOST",
    "prometheus_name": "RAY_PROMETHEUS_NAME",
    "grafana_host": "RAY_GRAFANA_HOST",
    "grafana_iframe_host": "RAY_GRAFANA_IFRAME_HOST",
}


@dataclass(frozen=True)
class ObserveOptions:
    """The dashboard and metrics settings of a Ray cluster that `tokenflow serve` starts."""

    dashboard: bool = True
    dashboard_host: str = "127.0.0.1"
    dashboard_port: int | None = None  # None: 8265 or the next free port (Ray's own search)
    metrics_port: int | None = None
    env: tuple[tuple[str, str], ...] = ()  # (RAY_* variable, value) the user gave

    def check_ports_free(self) -> None:
        """Raise ValueError naming the flag to change if a port we would bind is taken."""
        ports = []
        if self.dashboard and self.dashboard_port:
            ports.append((self.dashboard_port, "--dashboard-port (or --no-dashboard)"))
        if self.metrics_port:
            ports.append((self.metrics_port, "--metrics-port"))
        for port, flag in ports:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                try:
                    sock.bind((self.dashboard_host, port))
                except OSError as exc:
                    raise ValueError(f"cannot listen on {self.dashboard_host}:{port}: "
                                     f"{exc.strerror}; choose a free one with {flag}") from None

    def export_env(self) -> None:
        """Put the Prometheus / Grafana addresses where Ray's dashboard reads them."""
        for name, value in self.env:
            os.environ[name] = value

    def ray_init_kwargs(self) -> dict[str, Any]:
        """The `ray.init` arguments for a new local cluster."""
        kwargs: dict[str, Any] = {"include_dashboard": self.dashboard}
        if self.dashboard:
            kwargs["dashboard_host"] = self.dashboard_host
            if self.dashboard_port:
                kwargs["dashboard_port"] = self.dashboard_port
        if self.metrics_port:
            kwargs["_metrics_export_port"] = self.metrics_port
        return kwargs


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The observability flags of `tokenflow serve`."""
    group = parser.add_argument_group("observe (a cluster that tokenflow serve starts)")
    group.add_argument("--dashboard-port", type=int, default=None,
                       help=f"Ray dashboard port (default: {DEFAULT_DASHBOARD_PORT}, or the next "
                            "free one)")
    # Loopback by default: the dashboard also accepts Ray job submissions (code execution).
    group.add_argument("--dashboard-host", default="127.0.0.1",
                       help="Ray dashboard address (default %(default)s; 0.0.0.0 exposes it, "
                            "and its job API, to the network)")
    group.add_argument("--no-dashboard", action="store_true", help="do not start the Ray dashboard")
    group.add_argument("--metrics-port", type=int, default=None,
                       help="port of Ray's Prometheus metrics export (default: a free one)")
    group.add_argument("--prometheus-host", default=None,
                       help="Prometheus URL for the dashboard's metrics views (RAY_PROMETHEUS_HOST)")
    group.add_argument("--prometheus-name", default=None,
                       help="the Grafana datasource name of that Prometheus (RAY_PROMETHEUS_NAME)")
    group.add_argument("--grafana-host", default=None,
                       help="Grafana URL the dashboard talks to (RAY_GRAFANA_HOST)")
    group.add_argument("--grafana-iframe-host", default=None,
                       help="Grafana URL your browser reaches, if different (RAY_GRAFANA_IFRAME_HOST)")


def options_from_args(args: argparse.Namespace) -> ObserveOptions:
    """ObserveOptions from the parsed flags of `tokenflow serve`."""
    env = tuple((var, getattr(args, flag)) for flag, var in ENV_FLAGS.items()
                if getattr(args, flag, None))
    return ObserveOptions(dashboard=not args.no_dashboard, dashboard_host=args.dashboard_host,
                          dashboard_port=args.dashboard_port, metrics_port=args.metrics_port,
                          env=env)


def metrics_address() -> str | None:
    """`host:port` of the Prometheus export of this driver's Ray node (after ray.init)."""
    import ray

    node_id = ray.get_runtime_context().get_node_id()
    for node in ray.nodes():
        if node.get("NodeID") == node_id and node.get("MetricsExportPort"):
            return f"{node['NodeManagerAddress']}:{node['MetricsExportPort']}"
    return None


def describe(options: ObserveOptions, dashboard_url: str | None) -> list[str]:
    """The lines `tokenflow serve` prints about the dashboard and metrics once Ray runs."""
    lines = []
    if options.dashboard and dashboard_url:
        url = dashboard_url if "://" in dashboard_url else f"http://{dashboard_url}"
        lines.append(f"Ray dashboard at {url} (Serve view: {url}/#/serve)")
        # Ray >= 2.52 turns token authentication on for a new local cluster (and says so in
        # the environment it leaves); the dashboard then asks for the token.
        if os.environ.get("RAY_AUTH_MODE", "").lower() == "token":
            lines.append("  it asks for Ray's token: `ray get-auth-token` prints it "
                         "(or $RAY_AUTH_TOKEN, if you set one)")
    address = metrics_address()
    if address:
        lines.append(f"Prometheus metrics at http://{address}/metrics")
    return lines
