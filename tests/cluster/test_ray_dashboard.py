"""`tokenflow serve` with the Ray dashboard: its Serve API shows the app, its Prometheus link
works, and its metrics port is the one asked for.

One real `tokenflow serve` subprocess (its own new Ray cluster, on 127.0.0.1) serves a small
tokenflow-tiny config with `--dashboard-port`, `--metrics-port` and, when Debian's prometheus is
there, `--prometheus-host` pointing at a real Prometheus scraping that metrics port. The tests
read the dashboard's HTTP API as its web page does: `/api/serve/applications/` (the Serve view)
and `/api/prometheus_health` (what the metrics views check first).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml

from tests.cluster.conftest import free_port
from tests.cluster.prometheus import Prometheus, available
from tests.needs import need

pytestmark = [pytest.mark.slow, pytest.mark.own_cluster]  # starts its own Ray clusters

ROOT = Path(__file__).resolve().parents[2]
CONFIG = {
    "engine": {"model": {"model": "tokenflow-tiny"},
               "cache": {"block_size": 16, "num_blocks": 64},
               "scheduler": {"max_model_len": 256, "max_num_seqs": 8}},
    "deployment": {"num_replicas": 1, "ray_actor_options": {"num_cpus": 0.5}},
}
READY_LINE = "serving the OpenAI API"
# Ray turns token authentication on for a new local cluster; with the token in the environment
# the cluster uses this one (instead of ~/.ray/auth_token) and so can the test.
TOKEN = "tokenflow-dashboard-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@dataclass
class Served:
    """The running `tokenflow serve`: its URLs and the lines it printed."""

    proc: subprocess.Popen[str]
    dashboard_url: str
    api_url: str
    metrics_port: int
    prometheus: Prometheus | None
    output: list[str]


def _env() -> dict[str, str]:
    # The subprocess imports this checkout's tokenflow, whatever the venv's install points at.
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1",
            "RAY_metrics_report_interval_ms": "1000", "RAY_AUTH_TOKEN": TOKEN}


def _tokenflow(*args: str) -> list[str]:
    return [sys.executable, "-m", "tokenflow.cli", *args]


def _wait_ready(proc: subprocess.Popen[str], output: list[str], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    assert proc.stdout is not None
    os.set_blocking(proc.stdout.fileno(), False)
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line:
            output.append(line.rstrip())
            if READY_LINE in line:
                return
            continue
        if proc.poll() is not None:
            raise AssertionError("tokenflow serve exited:\n" + "\n".join(output[-40:]))
        time.sleep(0.2)
    raise AssertionError("tokenflow serve not ready:\n" + "\n".join(output[-40:]))


def _stop(proc: subprocess.Popen[str]) -> int:
    """SIGTERM, as a user's Ctrl-C or Kubernetes would; SIGKILL the group if it hangs."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    config = tmp_path_factory.mktemp("serve") / "config.yaml"
    config.write_text(yaml.safe_dump(CONFIG))
    http_port, dashboard_port, metrics_port = free_port(), free_port(), free_port()
    prometheus = Prometheus([f"127.0.0.1:{metrics_port}"]) if available() else None
    args = ["serve", "--config", str(config), "--port", str(http_port),
            "--dashboard-port", str(dashboard_port), "--metrics-port", str(metrics_port)]
    if prometheus is not None:
        args += ["--prometheus-host", prometheus.url]
    proc = subprocess.Popen(_tokenflow(*args), cwd=ROOT, env=_env(), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    output: list[str] = []
    try:
        _wait_ready(proc, output, timeout_s=300)
        yield Served(proc, f"http://127.0.0.1:{dashboard_port}", f"http://127.0.0.1:{http_port}",
                     metrics_port, prometheus, output)
    finally:
        _stop(proc)
        if prometheus is not None:
            prometheus.stop()


def test_serve_prints_the_dashboard_and_metrics_urls(served: Served) -> None:
    text = "\n".join(served.output)
    assert f"Ray dashboard at {served.dashboard_url}" in text
    assert f":{served.metrics_port}/metrics" in text


def test_dashboard_serve_api_shows_the_app_running(served: Served) -> None:
    anonymous = httpx.get(served.dashboard_url + "/api/serve/applications/", timeout=30)
    assert anonymous.status_code == 401  # token authentication is on
    r = httpx.get(served.dashboard_url + "/api/serve/applications/", headers=AUTH, timeout=30)
    assert r.status_code == 200, r.text
    app = r.json()["applications"]["tokenflow"]
    assert app["status"] == "RUNNING"
    deployments = app["deployments"]
    # The default serving mode (haproxy): the LLMServer is its own ingress, and the ingress
    # request router picks its replica for HAProxy.
    assert set(deployments) == {"LLMServer", "ReplicaRouter"}
    for name, deployment in deployments.items():
        assert deployment["status"] == "HEALTHY", (name, deployment)
        assert [r["state"] for r in deployment["replicas"]] == ["RUNNING"], name
    # And the app it shows answers.
    models = httpx.get(served.api_url + "/v1/models", timeout=30)
    assert models.status_code == 200 and models.json()["data"][0]["id"] == "tokenflow-tiny"


def test_dashboard_reaches_the_prometheus_it_was_given(served: Served) -> None:
    need(served.prometheus is not None, "Debian's prometheus binary (`make prometheus`)")
    assert served.prometheus is not None
    r = httpx.get(served.dashboard_url + "/api/prometheus_health", headers=AUTH, timeout=30)
    assert r.status_code == 200, r.text
    # ... and that Prometheus scrapes the metrics port the server was told to use.
    deadline = time.monotonic() + 60
    while not served.prometheus.targets_up():
        assert time.monotonic() < deadline, served.prometheus.log()
        time.sleep(1)


def test_a_taken_dashboard_port_is_refused_before_anything_starts() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = subprocess.run(_tokenflow("serve", "--port", str(free_port()),
                                         "--dashboard-port", str(port)),
                              cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert f"127.0.0.1:{port}" in done.stderr and "--dashboard-port" in done.stderr
