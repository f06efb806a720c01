"""Serving under stress, on real Ray Serve over real HTTP: health and stats while the engine is
saturated, the one context limit as clients see it, and a replica that dies mid-request."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import ray

from tests.cluster.conftest import API_KEY, SERVER_ACTOR_OPTIONS, App, Cluster, deployed
from tests.cluster.test_serve import async_client, auth

pytestmark = pytest.mark.slow

MODEL = "tokenflow-tiny"


def test_health_and_stats_answer_while_the_engine_is_saturated(main_app: App) -> None:
    """More streams than the engine runs at once (max_num_seqs=128): requests wait in the
    engine, and neither /health nor stats() waits behind them."""

    async def run() -> tuple[int, dict[str, Any], int]:
        client = async_client(main_app)

        async def one() -> None:
            stream = await client.completions.create(
                model=MODEL, prompt="tell me a story", max_tokens=150, stream=True,
                temperature=0.0, extra_body={"ignore_eos": True})
            async for _ in stream:
                pass

        tasks = [asyncio.create_task(one()) for _ in range(160)]
        while (await main_app.server.stats.remote())["waiting"] == 0:
            if all(t.done() for t in tasks):  # they failed (or ran) without ever queueing
                await asyncio.gather(*tasks)
                raise AssertionError("no request ever waited in the engine")
            await asyncio.sleep(0.05)
        async with httpx.AsyncClient(timeout=30) as http:
            health = await http.get(main_app.base_url + "/health")
        stats = await main_app.server.stats.remote()
        unfinished = sum(not t.done() for t in tasks)
        await asyncio.gather(*tasks)
        return health.status_code, stats, unfinished

    status, stats, unfinished = asyncio.run(run())
    assert status == 200
    assert stats["running"] > 0 and unfinished > 0  # answered while the streams still ran


# ------------------------------------------------------------ a small cache, a dead replica

SMALL_APP = "small"


@pytest.fixture(scope="module")
def small_app(cluster: Cluster) -> Iterator[App]:
    """40 blocks of 16 tokens: the cache, not the configured 2048, limits the context to 640."""
    engine = {"model": {"model": MODEL}, "cache": {"block_size": 16, "num_blocks": 40},
              "scheduler": {"max_model_len": 2048, "max_num_batched_tokens": 1024}}
    yield from deployed(cluster, SMALL_APP, "/small", {
        "engine": engine, "api_key": API_KEY,
        "deployment": {"num_replicas": 1, "ray_actor_options": SERVER_ACTOR_OPTIONS}})


def test_the_context_limit_is_the_one_the_cache_allows(small_app: App) -> None:
    client = openai.OpenAI(base_url=small_app.base_url + "/v1", api_key=API_KEY, max_retries=0)
    [card] = client.models.list()
    assert card.model_extra["max_model_len"] == 640
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=[5] * 700, max_tokens=1)
    assert "max_model_len=640" in info.value.message
    out = client.completions.create(model=MODEL, prompt=[5] * 600, max_tokens=8,
                                    extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 8


def _replica_actor(app_name: str) -> Any:
    [entry] = [a for a in ray.util.list_named_actors(all_namespaces=True)
               if f"{app_name}#LLMServer" in a["name"]]
    return ray.get_actor(entry["name"], namespace=entry["namespace"])


def test_a_dead_replica_fails_its_request_and_serve_replaces_it(small_app: App) -> None:
    """In the default mode (haproxy) nothing stands between the client and the replica
    process, so when it dies the request in flight fails with what HAProxy makes of the lost
    backend (as the README says): its connection closed without a response, or HAProxy's own
    500 (Serve's config turns HAProxy's 502 into a 500). Serve then brings up a new replica and
    the same request succeeds.
    (The separate-ingress modes answer with an OpenAI 503 instead: test_serving_modes.py.)"""
    url = small_app.base_url + "/v1/completions"
    body = {"model": MODEL, "prompt": "once", "max_tokens": 600, "ignore_eos": True}
    result: dict[str, httpx.Response | httpx.HTTPError] = {}

    def send() -> None:
        try:
            result["r"] = httpx.post(url, json=body, headers=auth(small_app), timeout=120)
        except httpx.HTTPError as exc:
            result["r"] = exc

    request = threading.Thread(target=send)
    request.start()
    deadline = time.monotonic() + 60
    while small_app.server.stats.remote().result()["running"] == 0:
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.02)
    ray.kill(_replica_actor(SMALL_APP), no_restart=True)
    request.join(timeout=120)
    outcome = result["r"]
    assert (isinstance(outcome, httpx.RemoteProtocolError)
            or (isinstance(outcome, httpx.Response) and outcome.status_code == 500)), outcome
    # Serve brings a new replica up; the same request then succeeds. Meanwhile HAProxy
    # answers by itself (its router has no replica to name, or the old one's port is gone).
    deadline = time.monotonic() + 180
    while True:
        retry = httpx.post(url, json={**body, "max_tokens": 4}, headers=auth(small_app),
                           timeout=60)
        if retry.status_code == 200:
            break
        assert retry.status_code in (500, 503) and time.monotonic() < deadline, retry.text
        time.sleep(1)
    assert retry.json()["usage"]["completion_tokens"] == 4
