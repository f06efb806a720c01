"""The default model served as configs/local.yaml serves it (SmolLM2's 4-bit file, a bfloat16
KV cache, batch invariance on): 16 greedy streams at once, the engine process killed under
them, every stream resumed by the new engine process, and every text exactly the one the same
requests got uninterrupted (sent at once, not streamed: other batches, other timing)."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator

import openai
import pytest
import ray

from tests.cluster.conftest import API_KEY, SERVER_ACTOR_OPTIONS, App, Cluster, deployed
from tests.cluster.test_serve_resilience import _busy_replica
from tokenflow.replica.loading.model_source import SMOLLM2_MODEL_NAME

pytestmark = pytest.mark.slow

PROMPTS = [f"Write a short story about a {animal} who {verb}."
           for animal in ("fox", "whale", "sparrow", "tortoise")
           for verb in ("learns to sing", "finds a map", "loses a key", "builds a boat")]


@pytest.fixture(scope="module")
def default_model(cluster: Cluster) -> Iterator[App]:
    engine = {"model": {"model": SMOLLM2_MODEL_NAME},
              "cache": {"block_size": 16, "num_blocks": 512, "kv_cache_dtype": "bfloat16"},
              "scheduler": {"max_model_len": 512, "max_num_batched_tokens": 512,
                            "max_num_seqs": 64}}
    yield from deployed(cluster, "restart-invariance", "/restart-invariance", {
        "engine": engine, "api_key": API_KEY,
        "deployment": {"num_replicas": 1, "ray_actor_options": SERVER_ACTOR_OPTIONS}})


async def test_greedy_streams_resumed_after_an_engine_restart_keep_their_text(
        default_model: App) -> None:
    client = openai.AsyncOpenAI(base_url=default_model.base_url + "/v1", api_key=API_KEY,
                                max_retries=0, timeout=300)
    args = {"model": SMOLLM2_MODEL_NAME, "max_tokens": 80, "temperature": 0.0,
            "extra_body": {"ignore_eos": True}}
    uninterrupted = [c.choices[0].text for c in await asyncio.gather(
        *(client.completions.create(prompt=p, **args) for p in PROMPTS))]
    started, killed = asyncio.Event(), {}

    async def stream(prompt: str) -> str:
        text, chunks = "", 0
        async for chunk in await client.completions.create(prompt=prompt, stream=True, **args):
            text += chunk.choices[0].text if chunk.choices else ""
            chunks += 1
            if chunks == 10:
                started.set()
        return text

    async def kill() -> None:
        await started.wait()
        actor, before = await asyncio.to_thread(_busy_replica, default_model)
        killed.update(actor=actor, before=before)
        os.kill(before["engine_pid"], signal.SIGKILL)  # this machine's: the test's app

    texts, _ = await asyncio.gather(asyncio.gather(*(stream(p) for p in PROMPTS)), kill())
    after = ray.get(killed["actor"].record_routing_stats.remote(), timeout=30)
    assert after["engine_restarts"] == killed["before"]["engine_restarts"] + 1
    same = sum(a == b for a, b in zip(texts, uninterrupted, strict=True))
    assert same == len(PROMPTS), [(a, b) for a, b in zip(texts, uninterrupted, strict=True)
                                  if a != b][:2]
