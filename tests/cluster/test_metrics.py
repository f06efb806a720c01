"""`tokenflow_*` metrics reach Ray's Prometheus export.

The session's cluster exports metrics on a known port and flushes them every second; the test
sends traffic (with a repeated prompt, so the prefix cache hits), then scrapes the export until
every metric that traffic must have touched is there, tagged with the model name. Preemptions
only appear once one happens, so that counter is checked on the metric objects instead.
"""

from __future__ import annotations

import re
import time

import httpx
import pytest

from tests.cluster.conftest import App, Cluster
from tokenflow.cluster.metrics import ServerMetrics

pytestmark = pytest.mark.slow

MODEL = "tokenflow-tiny"
# Ray prefixes custom metrics with `ray_`; counters get `_total`, histograms `_bucket` etc.
EXPECTED = [
    "ray_tokenflow_num_requests_running",
    "ray_tokenflow_num_requests_waiting",
    "ray_tokenflow_kv_cache_usage",
    "ray_tokenflow_prefix_cache_queries_total",
    "ray_tokenflow_prefix_cache_hits_total",
    "ray_tokenflow_prompt_tokens_total",
    "ray_tokenflow_generation_tokens_total",
    "ray_tokenflow_time_to_first_token_seconds_bucket",
    "ray_tokenflow_inter_token_latency_seconds_bucket",
    "ray_tokenflow_e2e_request_latency_seconds_bucket",
    "ray_tokenflow_request_queue_time_seconds_bucket",
]


def test_every_required_metric_is_defined() -> None:
    names = set(ServerMetrics(MODEL).names)
    required = {"tokenflow_num_requests_running", "tokenflow_num_requests_waiting",
                "tokenflow_kv_cache_usage", "tokenflow_prefix_cache_queries",
                "tokenflow_prefix_cache_hits", "tokenflow_num_preemptions",
                "tokenflow_prompt_tokens", "tokenflow_generation_tokens",
                "tokenflow_time_to_first_token_seconds", "tokenflow_inter_token_latency_seconds",
                "tokenflow_e2e_request_latency_seconds", "tokenflow_request_queue_time_seconds"}
    assert required <= names
    assert all(n.startswith("tokenflow_") for n in names)


def _scrape(port: int) -> str:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    except httpx.HTTPError:
        return ""


def test_metrics_reach_the_prometheus_export(cluster: Cluster, main_app: App) -> None:
    headers = {"Authorization": f"Bearer {main_app.api_key}"}
    prompt = "a shared prefix that spans several KV blocks " * 6
    for _ in range(3):  # the second and third requests hit the first one's blocks
        r = httpx.post(main_app.base_url + "/v1/completions", headers=headers, timeout=30,
                       json={"model": MODEL, "prompt": prompt, "max_tokens": 8,
                             "ignore_eos": True})  # exactly 8 tokens each
        assert r.status_code == 200, r.text
    deadline, missing, body = time.monotonic() + 40, EXPECTED, ""
    while time.monotonic() < deadline:
        body = _scrape(cluster.metrics_port)
        missing = [name for name in EXPECTED if not re.search(rf"^{name}{{", body, re.M)]
        # Each counter reaches the export on its own schedule: wait for the last request's.
        if (not missing and _value(body, "ray_tokenflow_prefix_cache_hits_total") > 0
                and _value(body, "ray_tokenflow_generation_tokens_total") >= 24):
            break
        time.sleep(1)
    assert not missing, missing
    assert _value(body, "ray_tokenflow_prompt_tokens_total") > 0
    assert _value(body, "ray_tokenflow_generation_tokens_total") >= 24
    assert _value(body, "ray_tokenflow_prefix_cache_hits_total") > 0
    assert re.search(rf'^ray_tokenflow_kv_cache_usage{{[^}}]*model="{MODEL}"', body, re.M)


def _value(body: str, name: str) -> float:
    """Sum of a metric's samples over all label sets."""
    return sum(float(m.group(1)) for m in re.finditer(rf"^{name}{{[^}}]*}} (\S+)$", body, re.M))
