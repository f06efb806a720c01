"""A real Prometheus (Debian's `prometheus` binary) for tests, on 127.0.0.1 only.

`Prometheus(targets)` writes a config that scrapes the given `host:port` targets every second,
starts the server in its own process group with a throw-away TSDB, and waits until it is ready;
`query(expr)` evaluates PromQL through the HTTP API (`/api/v1/query`); `stop()` ends exactly
the process group it started.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from tokenflow.net import free_port

BINARY = "prometheus"


def available() -> bool:
    return shutil.which(BINARY) is not None


class Prometheus:
    """Owns one Prometheus server process, its config and its data directory."""

    def __init__(self, targets: list[str], scrape_interval: str = "1s",
                 ready_timeout_s: float = 60.0) -> None:
        self._dir = Path(tempfile.mkdtemp(prefix="tokenflow-prometheus-"))
        config = {"global": {"scrape_interval": scrape_interval,
                             "evaluation_interval": scrape_interval},
                  "scrape_configs": [{"job_name": "ray",
                                      "static_configs": [{"targets": targets}]}]}
        (self._dir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.url = f"http://127.0.0.1:{free_port()}"
        self._log = open(self._dir / "prometheus.log", "wb")  # noqa: SIM115 (closed in stop)
        self._proc = subprocess.Popen(
            [BINARY, f"--config.file={self._dir / 'prometheus.yml'}",
             f"--storage.tsdb.path={self._dir / 'data'}",
             f"--web.listen-address={self.url.removeprefix('http://')}", "--log.level=warn"],
            stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        self._wait_ready(ready_timeout_s)

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"prometheus exited: {self.log()}")
            try:
                if httpx.get(self.url + "/-/ready", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"prometheus not ready after {timeout_s}s: {self.log()}")

    def query(self, expr: str) -> list[dict[str, Any]]:
        """The instant vector (or scalar as a one-element list) of `expr` now."""
        r = httpx.get(self.url + "/api/v1/query", params={"query": expr}, timeout=10)
        body = r.json()
        if body.get("status") != "success":
            raise ValueError(f"{expr}: {body.get('errorType')}: {body.get('error')}")
        data = body["data"]
        if data["resultType"] == "scalar":
            return [{"metric": {}, "value": data["result"]}]
        return data["result"]

    def targets_up(self) -> bool:
        return any(s["value"][1] == "1" for s in self.query("up"))

    def log(self) -> str:
        self._log.flush()
        return (self._dir / "prometheus.log").read_text(errors="replace")[-2000:]

    def stop(self) -> None:
        if self._proc.poll() is None:
            os.killpg(self._proc.pid, signal.SIGTERM)
            try:
                self._proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self._proc.pid, signal.SIGKILL)
                self._proc.wait()
        self._log.close()
        shutil.rmtree(self._dir, ignore_errors=True)
