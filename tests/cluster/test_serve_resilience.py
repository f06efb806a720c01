"""Serving under stress, on real Ray Serve over real HTTP: health and stats while the engine is
saturated, the one context limit as clients see it, and a replica that dies mid-request."""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import openai
import pytest
import ray

from tests.cluster.conftest import (
    API_KEY,
    SERVER_ACTOR_OPTIONS,
    App,
    Cluster,
    deployed,
    wait_until_routed,
)
from tests.cluster.test_serve import async_client, auth
from tests.conftest import DEFAULT_SERVING_MODE
from tokenflow.config import ServingMode

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
TWO_REPLICAS_APP = "two"


@pytest.fixture(scope="module")
def small_app(cluster: Cluster) -> Iterator[App]:
    """40 blocks of 16 tokens: the cache, not the configured 2048, limits the context to 640."""
    engine = {"model": {"model": MODEL}, "cache": {"block_size": 16, "num_blocks": 40},
              "scheduler": {"max_model_len": 2048, "max_num_batched_tokens": 1024}}
    yield from deployed(cluster, SMALL_APP, "/small", {
        "engine": engine, "api_key": API_KEY,
        "deployment": {"num_replicas": 1, "ray_actor_options": SERVER_ACTOR_OPTIONS}})


@pytest.fixture(scope="module")
def two_replicas(cluster: Cluster) -> Iterator[App]:
    """Two replicas with room for requests long enough (a few seconds) to be killed under."""
    engine = {"model": {"model": MODEL}, "cache": {"block_size": 16, "num_blocks": 128},
              "scheduler": {"max_model_len": 2048, "max_num_batched_tokens": 1024}}
    apps = deployed(cluster, TWO_REPLICAS_APP, "/two", {
        "engine": engine, "api_key": API_KEY,
        "deployment": {"num_replicas": 2, "ray_actor_options": SERVER_ACTOR_OPTIONS}})
    app = next(apps)
    _wait_until_whole(app, replicas=2)
    yield app
    next(apps, None)


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


def _replicas(app: App) -> list[tuple[Any, dict[str, Any]]]:
    """Each live replica actor of `app` with its `LLMServer.stats()`, asked of that very
    replica (Serve's replica actor answers `record_routing_stats` with them): a handle would
    ask the replica its router picks, which is the idle one while the other is busy."""
    found = []
    for entry in ray.util.list_named_actors(all_namespaces=True):
        if f"{app.name}#LLMServer#" in entry["name"]:
            actor = ray.get_actor(entry["name"], namespace=entry["namespace"])
            with contextlib.suppress(ray.exceptions.RayError):  # dead, or not started yet
                found.append((actor, ray.get(actor.record_routing_stats.remote(), timeout=30)))
    return found


def _busy_replica(app: App) -> tuple[Any, dict[str, Any]]:
    """The replica actor of `app` that holds a request, and its stats."""
    deadline = time.monotonic() + 120
    while True:
        busy = [(actor, stats) for actor, stats in _replicas(app) if stats["requests"]]
        if busy:
            return busy[0]
        assert time.monotonic() < deadline, "no request started"
        time.sleep(0.01)


def test_a_dead_replica_loses_no_request_that_has_no_answer_yet(two_replicas: App) -> None:
    """In the default mode (haproxy) nothing stands between the client and the replica
    process. When it dies under a request that has no response byte yet, HAProxy sends the
    request again to another replica (`serving_mode.TUNING`: retry-on empty-response,
    redispatch): the client sees one slow, whole answer. A stream whose replica dies after its
    first byte cannot be taken back: it ends without its end."""
    url = two_replicas.base_url + "/v1/completions"
    body = {"model": MODEL, "prompt": "once", "max_tokens": 2000, "ignore_eos": True}
    result: dict[str, Any] = {}

    def send() -> None:
        try:
            result["r"] = httpx.post(url, json=body, headers=auth(two_replicas), timeout=300)
        except httpx.HTTPError as exc:
            result["r"] = exc

    request = threading.Thread(target=send)
    request.start()
    ray.kill(_busy_replica(two_replicas)[0], no_restart=True)
    request.join(timeout=300)
    outcome = result["r"]
    assert isinstance(outcome, httpx.Response) and outcome.status_code == 200, outcome
    assert outcome.json()["usage"]["completion_tokens"] == 2000
    _wait_until_whole(two_replicas, replicas=2)

    # The same with the body a while after the headers, as a client on a busy machine sends
    # it (httpx writes the two apart): HAProxy may send again only a request it holds whole.
    status, answer = _post_in_two_writes(two_replicas, "/v1/completions", body,
                                         kill=lambda: ray.kill(_busy_replica(two_replicas)[0],
                                                               no_restart=True))
    assert status == 200, answer
    assert json.loads(answer)["usage"]["completion_tokens"] == 2000
    _wait_until_whole(two_replicas, replicas=2)

    # A stream past its first byte: what it got is all it gets, and it never ends as if whole
    # (HAProxy closes the connection mid-body).
    received: list[str] = []
    with httpx.stream("POST", url, json={**body, "stream": True}, headers=auth(two_replicas),
                      timeout=300) as stream:
        lines = stream.iter_lines()
        received.append(next(line for line in lines if line.startswith("data: {")))
        ray.kill(_busy_replica(two_replicas)[0], no_restart=True)
        with contextlib.suppress(httpx.RemoteProtocolError):
            received.extend(lines)
    assert "data: [DONE]" not in received
    assert 0 < sum(line.startswith("data: {") for line in received) < 2000
    _wait_until_whole(two_replicas, replicas=2)  # for the tests after this one


def _post_in_two_writes(app: App, path: str, body: dict[str, Any],
                        kill: Callable[[], None]) -> tuple[int, str]:
    """POST `body`: the headers, half a second later the body, then `kill()` once the request
    runs; the status and body of the answer (status 0: the connection closed without one)."""
    host, port = urlsplit(app.base_url).hostname, urlsplit(app.base_url).port
    connection = http.client.HTTPConnection(host, port, timeout=300)
    payload = json.dumps(body).encode()
    try:
        connection.putrequest("POST", urlsplit(app.base_url).path + path)
        for name, value in {"Content-Type": "application/json",
                            "Content-Length": str(len(payload)), **auth(app)}.items():
            connection.putheader(name, value)
        connection.endheaders()
        time.sleep(0.5)
        connection.send(payload)
        kill()
        try:
            response = connection.getresponse()
        except (http.client.RemoteDisconnected, ConnectionError) as exc:
            return 0, repr(exc)
        return response.status, response.read().decode(errors="replace")
    finally:
        connection.close()


def _wait_until_whole(app: App, replicas: int) -> None:
    """Wait until Serve runs `replicas` replicas of `app` again and a request gets through."""
    from ray import serve

    deadline = time.monotonic() + 300
    while (serve.status().applications[app.name].deployments["LLMServer"]
           .replica_states.get("RUNNING", 0) < replicas):
        assert time.monotonic() < deadline, "Serve did not replace the dead replicas"
        time.sleep(0.5)
    wait_until_routed(app)
    _wait_until_haproxy_routes_to(app, replicas, deadline)


def _wait_until_haproxy_routes_to(app: App, replicas: int, deadline: float) -> None:
    """In haproxy mode, wait until HAProxy's latest config has `replicas` replicas of `app`,
    and its process has had time to take it. Serve reloads HAProxy (a new process) as replicas
    come and go; a request already in an older process routes by that process's list of
    replicas, with no health checks, so one that loses its replica there can be retried only
    on the replicas that list has (README, "What a death costs a client, by mode")."""
    base = os.environ.get("RAY_SERVE_HAPROXY_SERVER_STATE_BASE")
    if DEFAULT_SERVING_MODE is not ServingMode.HAPROXY or not base:
        return
    server = f"server SERVE_REPLICA_{app.name}-LLMServer-"
    while True:
        configs = sorted(Path(base).glob("**/*.cfg"), key=lambda f: f.stat().st_mtime)
        text = configs[-1].read_text() if configs else ""
        if len({line.split()[1] for line in text.splitlines()
                if line.strip().startswith(server)}) >= replicas:
            break
        assert time.monotonic() < deadline, f"HAProxy has not got {replicas} replicas of {app.name}"
        time.sleep(0.5)
    time.sleep(2)  # Serve starts the new HAProxy process after writing its config


def test_a_replica_that_cannot_serve_hands_its_unanswered_requests_to_another(
        two_replicas: App) -> None:
    """The engine process dies again within RESTART_WINDOW_S of its restart: the replica can
    serve no more and ends its process. A request it holds that has had no byte of its answer
    (not streamed) waits for that instead of failing, and HAProxy sends it to the other
    replica: the client sees one slow, whole answer (greedy: the uninterrupted run's text)."""
    if DEFAULT_SERVING_MODE is not ServingMode.HAPROXY:
        pytest.skip("behind HAProxy only; the proxy_ingress modes resume (test_resume)")
    client = openai.OpenAI(base_url=two_replicas.base_url + "/v1", api_key=API_KEY,
                           max_retries=0, timeout=300)
    args = {"model": MODEL, "prompt": "a long story", "max_tokens": 2000, "temperature": 0.0,
            "extra_body": {"ignore_eos": True}}
    # A replica whose engine restarted in the last RESTART_WINDOW_S would give up at the
    # first death, not the second: replace any whose engine an earlier test restarted.
    restarted = [actor for actor, stats in _replicas(two_replicas) if stats["engine_restarts"]]
    for actor in restarted:
        ray.kill(actor, no_restart=True)
    if restarted:
        _wait_until_whole(two_replicas, replicas=2)
    uninterrupted = client.completions.create(**args).choices[0].text
    result: dict[str, Any] = {}

    def send() -> None:
        try:
            result["r"] = client.completions.create(**args)
        except openai.OpenAIError as exc:
            result["r"] = exc

    request = threading.Thread(target=send)
    request.start()
    actor, before = _busy_replica(two_replicas)
    assert before["engine_restarts"] == 0, before
    os.kill(before["engine_pid"], signal.SIGKILL)  # restarted, and the request goes on
    deadline = time.monotonic() + 120
    while True:
        stats = ray.get(actor.record_routing_stats.remote(), timeout=30)
        if stats["engine_restarts"] > before["engine_restarts"] and stats["engine_pid"]:
            break
        assert time.monotonic() < deadline, "the engine process was not restarted"
        time.sleep(0.05)
    assert stats["requests"] == 1 and request.is_alive()  # still at it, on the same replica
    os.kill(stats["engine_pid"], signal.SIGKILL)  # again, at once: the replica gives up
    request.join(timeout=300)
    outcome = result["r"]
    assert not isinstance(outcome, openai.OpenAIError), outcome
    assert outcome.usage.completion_tokens == 2000
    assert outcome.choices[0].text == uninterrupted
    with pytest.raises(ray.exceptions.RayActorError):  # the replica ended its process
        ray.get(actor.record_routing_stats.remote(), timeout=30)
    _wait_until_whole(two_replicas, replicas=2)


def test_a_dead_engine_process_is_restarted_and_its_streams_go_on(two_replicas: App) -> None:
    """The engine process dies, the replica lives: it starts a new engine process and continues
    each open request from the tokens it has streamed. The client sees one whole stream,
    token-exactly the uninterrupted run's (greedy), and the same replica serves on."""
    client = openai.OpenAI(base_url=two_replicas.base_url + "/v1", api_key=API_KEY, max_retries=0)
    args = {"model": MODEL, "prompt": "a long story", "max_tokens": 2000, "temperature": 0.0,
            "extra_body": {"ignore_eos": True}}
    uninterrupted = client.completions.create(**args).choices[0].text
    text, actor, before = "", None, None
    for i, chunk in enumerate(client.completions.create(**args, stream=True)):
        text += chunk.choices[0].text if chunk.choices else ""
        if i == 5:
            actor, before = _busy_replica(two_replicas)
            os.kill(before["engine_pid"], signal.SIGKILL)  # this machine's: the test's app
    assert text == uninterrupted
    after = ray.get(actor.record_routing_stats.remote(), timeout=30)  # the same replica
    assert after["engine_restarts"] == before["engine_restarts"] + 1
    assert after["engine_pid"] != before["engine_pid"]
