"""Prefill/decode disaggregation served by Ray Serve: the decode replica runs each request's
prefill on the prefill replica, loads the prompt's KV from it and decodes. Clients (the
`openai` client, over real HTTP) get the tokens of a colocated engine; a router can drive the
two sides itself with `kv_transfer_params`; killing the prefill replica loses no request."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import openai
import pytest
import ray

from tests.cluster.conftest import (
    API_KEY,
    ENGINE_ARGS,
    PD_APP,
    App,
    Cluster,
    deploy,
    deployed,
    pd_app_args,
)
from tests.cluster.test_serve import async_client, sync_client
from tokenflow.config import EngineConfig
from tokenflow.replica.engine.llm import LLM
from tokenflow.scheduler import SamplingParams

pytestmark = pytest.mark.slow

MODEL = "tokenflow-tiny"
PROMPTS = ["Hello, my name is", "The capital of France is", "def fibonacci(n):",
           "Once upon a time", "A shared system prompt: be brief and kind. Question: why?",
           "A shared system prompt: be brief and kind. Question: how?", "1 2 3 4 5 6 7",
           "The weather today is"]
NUM_NEW = 12


@pytest.fixture(scope="module")
def colocated() -> LLM:
    return LLM(config=EngineConfig.model_validate(ENGINE_ARGS))


def _expected(llm: LLM, prompts: list[str], **sampling: Any) -> list[str]:
    params = SamplingParams(max_tokens=NUM_NEW, ignore_eos=True, **sampling)
    return [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]


def _complete(client: openai.OpenAI, prompt: str, **sampling: Any) -> str:
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=NUM_NEW,
                                    extra_body={"ignore_eos": True}, **sampling)
    return out.choices[0].text


def test_disaggregated_tokens_equal_colocated(pd_app: App, colocated: LLM) -> None:
    client = sync_client(pd_app)
    before = pd_app.server.stats.remote().result()
    assert [_complete(client, p, temperature=0) for p in PROMPTS] == _expected(
        colocated, PROMPTS, temperature=0.0)
    seeded = {"temperature": 0.8, "seed": 1234}
    assert [_complete(client, p, **seeded) for p in PROMPTS[:4]] == _expected(
        colocated, PROMPTS[:4], **seeded)
    after = pd_app.server.stats.remote().result()
    assert after["kv_transfer_bytes"] > before["kv_transfer_bytes"]  # the KV really moved
    assert after["kv_transfer_failures"] == before["kv_transfer_failures"]


def test_32_concurrent_streams_complete(pd_app: App, colocated: LLM) -> None:
    prompts = [f"Stream number {i} says" for i in range(32)]
    expected = _expected(colocated, prompts, temperature=0.0)

    async def run() -> list[str]:
        client = async_client(pd_app)

        async def one(prompt: str) -> str:
            stream = await client.completions.create(
                model=MODEL, prompt=prompt, max_tokens=NUM_NEW, temperature=0, stream=True,
                extra_body={"ignore_eos": True})
            return "".join([c.choices[0].text async for c in stream if c.choices])

        return await asyncio.gather(*(one(p) for p in prompts))

    assert asyncio.run(run()) == expected


@pytest.fixture(scope="module")
def producer_app(cluster: Cluster) -> Iterator[App]:
    """A colocated app whose engine publishes prompts' KV when asked (role producer)."""
    args = pd_app_args()
    yield from deployed(cluster, "producer", "/producer", {
        "engine": args["prefill"]["engine"], "deployment": args["deployment"],
        "api_key": API_KEY})


def test_a_router_can_drive_prefill_and_decode_itself(producer_app: App, pd_app: App,
                                                      colocated: LLM) -> None:
    """vLLM's API over HTTP: the prefill server's response carries `kv_transfer_params`; the
    decode server, given them, loads the prompt's KV instead of computing it."""
    prompt = PROMPTS[1]
    before = pd_app.server.stats.remote().result()
    pre = sync_client(producer_app).completions.create(
        model=MODEL, prompt=prompt, max_tokens=1, temperature=0,
        extra_body={"kv_transfer_params": {"do_remote_decode": True}, "ignore_eos": True})
    params = pre.model_extra["kv_transfer_params"]
    assert params["do_remote_prefill"] and params["stages"]
    out = sync_client(pd_app).completions.create(
        model=MODEL, prompt=prompt, max_tokens=NUM_NEW, temperature=0,
        extra_body={"kv_transfer_params": params, "ignore_eos": True})
    assert out.choices[0].text == _expected(colocated, [prompt], temperature=0.0)[0]
    after = pd_app.server.stats.remote().result()
    assert after["kv_transfer_bytes"] > before["kv_transfer_bytes"]


def test_killing_the_prefill_replica_loses_no_request(cluster: Cluster, colocated: LLM) -> None:
    app = deploy(cluster, "pd-kill", "/pd-kill", pd_app_args())
    try:
        prompts = [f"Request {i} of a burst, please continue" for i in range(16)]
        expected = _expected(colocated, prompts, temperature=0.0)

        async def run() -> list[str]:
            client = async_client(app)

            async def one(prompt: str) -> str:
                out = await client.completions.create(
                    model=MODEL, prompt=prompt, max_tokens=NUM_NEW, temperature=0,
                    extra_body={"ignore_eos": True})
                return out.choices[0].text

            tasks = [asyncio.create_task(one(p)) for p in prompts]
            await asyncio.sleep(0.3)
            [entry] = [a for a in ray.util.list_named_actors(all_namespaces=True)
                       if "pd-kill#PrefillServer" in a["name"]]
            ray.kill(ray.get_actor(entry["name"], namespace=entry["namespace"]),
                     no_restart=True)
            return await asyncio.gather(*tasks)

        assert asyncio.run(run()) == expected
        # Nothing leaked on the decode side.
        deadline = time.monotonic() + 60
        while True:
            stats = app.server.stats.remote().result()
            if stats["num_free_blocks"] == stats["num_blocks"]:
                break
            assert time.monotonic() < deadline, stats
            time.sleep(0.2)
    finally:
        from ray import serve

        serve.delete("pd-kill")


def test_both_sides_free_every_block(pd_app: App) -> None:
    from ray import serve

    prefill = serve.get_deployment_handle("PrefillServer", app_name=PD_APP)
    deadline = time.monotonic() + 60
    while True:
        sides = [pd_app.server.stats.remote().result(), prefill.stats.remote().result()]
        if all(s["num_free_blocks"] == s["num_blocks"] for s in sides):
            break
        assert time.monotonic() < deadline, sides  # the producer's lease is 10 s
        time.sleep(0.5)
    assert API_KEY  # the app requires the key on every request above
