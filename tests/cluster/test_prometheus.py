"""Every Grafana panel's PromQL returns data from a real Prometheus scraping tokenflow.

A real Prometheus (Debian's package; `make prometheus` installs it) scrapes the session
cluster's Ray metrics export on 127.0.0.1 every second while the `main` application serves a
load made to touch every metric: a repeated prompt (prefix-cache hits), a refused request (an
HTTP error), and more concurrent long requests than the replica's KV cache holds (preemptions);
and the disaggregated `pd` application serves requests whose KV moves between replicas, one of
them with transfer params that point nowhere (a failed load).
Then each query of each panel, with the dashboard variables at "All", is evaluated through
Prometheus' HTTP API until it returns a non-NaN value. That proves the dashboards show
something, which a JSON lint cannot. Outside CI the test skips without a prometheus binary.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.cluster.conftest import App, Cluster
from tests.cluster.prometheus import Prometheus, available
from tests.lora_adapters import write_tiny_adapter
from tests.needs import need
from tokenflow.ops.dashboards import PANELS, expand

pytestmark = pytest.mark.slow

MODEL = "tokenflow-tiny"
# The main app has 512 KV blocks of 16 tokens; these requests need ~29 blocks each at the end.
NUM_LONG, PROMPT_LEN, MAX_TOKENS = 32, 200, 250
WINDOW = "5m"  # $__rate_interval: the whole test fits in it


@pytest.fixture(scope="module")
def prometheus(cluster: Cluster) -> Iterator[Prometheus]:
    need(available(), "Debian's prometheus binary (`make prometheus`)")
    prom = Prometheus([f"127.0.0.1:{cluster.metrics_port}"])
    try:
        yield prom
    finally:
        prom.stop()


def _complete(app: App, prompt: str | list[int], max_tokens: int, key: str | None) -> int:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    r = httpx.post(app.base_url + "/v1/completions", headers=headers, timeout=300,
                   json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens,
                         "temperature": 0, "ignore_eos": True})
    return r.status_code


def _load(app: App, adapters: list[Path]) -> None:
    # Two adapters taking turns in the app's one slot: loads, and an eviction.
    auth = {"Authorization": f"Bearer {app.api_key}"}
    for i, adapter in enumerate(adapters):
        loaded = httpx.post(app.base_url + "/v1/load_lora_adapter", headers=auth, timeout=120,
                            json={"lora_name": f"panel-{i}", "lora_path": str(adapter)})
        assert loaded.status_code == 200, loaded.text
    try:
        for i in (0, 1, 0):
            tuned = httpx.post(app.base_url + "/v1/completions", headers=auth, timeout=120,
                               json={"model": f"panel-{i}", "prompt": "hello", "max_tokens": 4})
            assert tuned.status_code == 200, tuned.text
    finally:  # the app is shared with other modules' tests
        for i, _ in enumerate(adapters):
            httpx.post(app.base_url + "/v1/unload_lora_adapter", headers=auth, timeout=120,
                       json={"lora_name": f"panel-{i}"})
    shared = "a shared prefix that spans several KV blocks " * 6
    assert [_complete(app, shared, 4, app.api_key) for _ in range(3)] == [200] * 3
    assert _complete(app, "no key", 4, "wrong-key") == 401
    # Distinct token-id prompts, so that nothing is shared and the KV cache runs out.
    prompts = [[10 + (7 * i + j) % 400 for j in range(PROMPT_LEN)] for i in range(NUM_LONG)]
    with ThreadPoolExecutor(NUM_LONG) as pool:
        codes = list(pool.map(lambda p: _complete(app, p, MAX_TOKENS, app.api_key), prompts))
    assert codes == [200] * NUM_LONG


def _has_data(prom: Prometheus, expr: str) -> bool:
    return any(not math.isnan(float(s["value"][1])) for s in prom.query(expr))


def _load_disaggregated(app: App) -> None:
    """Requests through prefill and decode replicas (KV transfers), and one whose transfer
    params point nowhere (a failed load, recomputed)."""
    # Repetitive text, so the decode side's n-gram drafts get accepted.
    prompts = [f"disaggregated {i} " + "again and again " * 6 for i in range(3)]
    assert [_complete(app, p, 24, app.api_key) for p in prompts] == [200] * 3
    bogus = {"do_remote_prefill": True, "num_tokens": 3, "block_size": 16,
             "first_token_ids": [5], "stages": [{
                 "transport": "torch_p2p", "host": "127.0.0.1", "control_port": 9,
                 "store_port": 9, "req_id": "gone", "layers": [0, 4], "num_blocks": 1,
                 "checksums": [0], "block_shape": [4, 2, 16, 2, 64], "dtype": "float32"}]}
    r = httpx.post(app.base_url + "/v1/completions", timeout=300,
                   headers={"Authorization": f"Bearer {app.api_key}"},
                   json={"model": MODEL, "prompt": [11, 12, 13], "max_tokens": 4,
                         "kv_transfer_params": bogus})
    assert r.status_code == 200, r.text


def test_every_panel_query_returns_data(cluster: Cluster, main_app: App, pd_app: App,
                                        prometheus: Prometheus, tmp_path: Path) -> None:
    deadline = time.monotonic() + 60
    while not prometheus.targets_up():
        assert time.monotonic() < deadline, f"Ray's metrics never scraped: {prometheus.log()}"
        time.sleep(1)
    _load(main_app, [write_tiny_adapter(tmp_path / f"adapter-{i}", seed=i) for i in (1, 2)])
    _load_disaggregated(pd_app)
    pending = {(p.title, q.expr): expand(q.expr, WINDOW) for p in PANELS for q in p.queries}
    # Metrics reach Prometheus within an export interval plus a scrape interval; a bounded
    # poll covers a slow, shared machine.
    deadline = time.monotonic() + 90
    while pending and time.monotonic() < deadline:
        pending = {k: e for k, e in pending.items() if not _has_data(prometheus, e)}
        if pending:
            time.sleep(2)
    assert not pending, "panels without data:\n" + "\n".join(
        f"  {title}: {expr}" for title, expr in pending)


def test_dashboard_variables_find_the_app_and_its_replica(main_app: App,
                                                          prometheus: Prometheus) -> None:
    # Grafana's label_values(metric, label) is this query's set of label values.
    running = 'ray_tokenflow_num_requests_running{application=~".*"}'
    deadline = time.monotonic() + 60
    while not prometheus.query(f"group by (application, replica) ({running})"):
        assert time.monotonic() < deadline, "no ray_tokenflow_* series in Prometheus"
        time.sleep(1)
    series = prometheus.query(f"group by (application, replica) ({running})")
    assert main_app.name in {s["metric"]["application"] for s in series}
    assert all(s["metric"].get("replica") for s in series)
