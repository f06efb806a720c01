"""Backpressure: a replica holds at most max_num_seqs + `deployment.max_queued_requests`
requests; one more is a 503 with Retry-After in OpenAI's shape at once, and the others go on.

Served over real HTTP in the default serving mode (the session cluster's), and in process.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import httpx
import psutil
import pytest

from tests.cluster.conftest import (
    API_KEY,
    ENGINE_ARGS,
    SERVER_ACTOR_OPTIONS,
    App,
    Cluster,
    deployed,
)
from tokenflow.scheduler import SamplingParams

MODEL = "tokenflow-tiny"
APP = "busy"
MAX_NUM_SEQS, MAX_QUEUED = 4, 8


def test_the_bound_refuses_at_once_and_frees_as_requests_end(cluster: Cluster) -> None:
    from tokenflow.cluster.messages import Accepted, Rejected
    from tokenflow.cluster.server import OVERLOADED_RETRY_S, LLMServer

    engine = {**ENGINE_ARGS, "scheduler": {**ENGINE_ARGS["scheduler"], "max_num_seqs": 2}}
    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)

    async def run() -> tuple[list[Any], Any, Any]:
        server = LLMServer(engine, max_queued_requests=1)
        try:
            held = [server.generate([[5, 6, 7]], params, f"r{i}") for i in range(3)]
            firsts = [await stream.__anext__() for stream in held]  # 2 running, 1 queued
            refused = [e async for e in server.generate([[5]], params, "r-over")]
            await held[0].aclose()  # one ends: its slot is free again
            again = await server.generate([[5]], params, "r-again").__anext__()
            for stream in held[1:]:
                await stream.aclose()
            return firsts, refused, again
        finally:
            server.engine.shutdown()

    firsts, refused, again = asyncio.run(run())
    assert all(isinstance(e, Accepted) for e in firsts)
    [event] = refused
    assert isinstance(event, Rejected) and event.status_code == 503
    assert event.retry_after_s == OVERLOADED_RETRY_S and "limit of 3" in event.message
    assert isinstance(again, Accepted)


@pytest.fixture(scope="module")
def busy_app(cluster: Cluster) -> Iterator[App]:
    engine = {**ENGINE_ARGS, "scheduler": {**ENGINE_ARGS["scheduler"],
                                           "max_num_seqs": MAX_NUM_SEQS}}
    yield from deployed(cluster, APP, "/busy", {
        "engine": engine, "api_key": API_KEY,
        "deployment": {"num_replicas": 1, "max_queued_requests": MAX_QUEUED,
                       "ray_actor_options": SERVER_ACTOR_OPTIONS}})


def _replica_rss(app: App) -> int:
    """The app's one LLMServer replica process (of the session's own cluster), by its title."""
    title = f"ServeReplica:{app.name}:LLMServer"
    [proc] = [p for p in psutil.process_iter(["cmdline"])
              if title in " ".join(p.info["cmdline"] or [])]
    return proc.memory_info().rss


async def _burst(app: App, n: int) -> list[tuple[int, dict[str, Any], str | None]]:
    """n simultaneous completions; each a (status, body, Retry-After). An answer that is not
    JSON (HAProxy's own plain-text 404/500, say) fails the test with its status and body."""
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
    # Generous: an answer is a 503 at once or 8 tokens after at most 12 requests ahead of it,
    # seconds even on a busy machine; a timeout here is a hang.
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        async def one(i: int) -> tuple[int, dict[str, Any], str | None]:
            r = await client.post(f"{app.base_url}/v1/completions",
                                  headers={"Authorization": f"Bearer {API_KEY}"},
                                  json={"model": MODEL, "prompt": f"request {i}",
                                        "max_tokens": 8, "ignore_eos": True})
            if r.status_code == 503 and r.text.startswith(ROUTER_FAILED):
                # HAProxy's own refusal when its route call fails under the burst: a quick
                # 503 too, but plain text and without Retry-After (issue 22's ground).
                return r.status_code, {"router_failed": r.text}, r.headers.get("retry-after")
            return r.status_code, _json_body(r), r.headers.get("retry-after")

        return await asyncio.gather(*(one(i) for i in range(n)))


def _json_body(r: httpx.Response) -> dict[str, Any]:
    """The response's JSON object; anything else fails the test, naming what came back."""
    what = f"{r.status_code} {r.headers.get('content-type')!r}: {r.text[:500]!r}"
    assert r.headers.get("content-type", "").startswith("application/json"), (
        f"not a JSON answer: {what}")
    try:
        body = r.json()
    except ValueError as exc:
        raise AssertionError(f"JSON that does not parse ({exc}): {what}") from None
    assert isinstance(body, dict), f"not a JSON object: {what}"
    return body


def _replica_stats(app: App, until: Any, timeout_s: float = 60) -> dict[str, Any]:
    """The replica's stats once `until(stats)` holds: the replica ends a request's
    bookkeeping just after its answer is sent, a little later on a busy machine."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = app.server.stats.remote().result(timeout_s=60)
        if until(stats) or time.monotonic() > deadline:
            return stats
        time.sleep(0.2)


# How HAProxy's 503 begins when its call to the ingress request router fails.
ROUTER_FAILED = "Ingress request router failed"


@pytest.mark.slow
def test_512_simultaneous_requests_get_an_answer_or_a_quick_503(busy_app: App) -> None:
    asyncio.run(_burst(busy_app, 64))  # allocations that any load makes, made first
    before = _replica_rss(busy_app)
    results = asyncio.run(_burst(busy_app, 512))
    after = _replica_rss(busy_app)
    ok = [body for status, body, _ in results if status == 200]
    refused = [(body, retry) for status, body, retry in results
               if status == 503 and "router_failed" not in body]
    router_failed = [body for _, body, _ in results if "router_failed" in body]
    # Nothing else, and no hang.
    assert len(ok) + len(refused) + len(router_failed) == 512, [
        (s, b) for s, b, _ in results if s not in (200, 503)][:5]
    # The replica's own refusals are the rule; HAProxy's failed route calls the exception.
    assert len(router_failed) < len(refused), (len(router_failed), len(refused))
    assert ok and refused
    assert all(body["usage"]["completion_tokens"] == 8 for body in ok)
    for body, retry in refused:
        assert body["error"]["type"] == "service_unavailable_error", body
        assert retry is not None and int(retry) > 0
    assert len(ok) >= MAX_NUM_SEQS + MAX_QUEUED  # the bound's worth got in, at least
    # Everything ended: nothing is left held or queued on the replica.
    stats = _replica_stats(busy_app, lambda s: s["requests"] == 0 and s["waiting"] == 0)
    assert stats["requests"] == 0 and stats["waiting"] == 0, stats
    # 512 requests mostly refused leave the replica's memory where it was (a few MB of slack
    # for the allocator), not grown by one engine request per client.
    assert after - before < 64 * 2**20, (before, after)
