"""The default model answers in words: SmolLM2-135M-Instruct, served through the real HTTP API,
answers a handful of unambiguous questions (greedy). No model with random weights can pass.

One small app (a replica with a small KV pool), five short questions sent at once, few tokens
each: about the cost of loading the model twice (replica and ingress tokenizer).
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator

import openai
import pytest

from tests.cluster.conftest import SERVER_ACTOR_OPTIONS, App, Cluster, deploy
from tests.questions import QUESTIONS
from tokenflow.replica.loading.model_source import SMOLLM2_MODEL_NAME

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2_app(cluster: Cluster) -> Iterator[App]:
    from ray import serve

    args = {"engine": {"model": {"model": SMOLLM2_MODEL_NAME},
                       # bfloat16 K/V, as configs/local.yaml ships them
                       "cache": {"block_size": 16, "num_blocks": 64,
                                 "kv_cache_dtype": "bfloat16"},
                       "scheduler": {"max_model_len": 512, "max_num_seqs": 8,
                                     "max_num_batched_tokens": 512}},
            "deployment": {"num_replicas": 1, "ray_actor_options": SERVER_ACTOR_OPTIONS}}
    app = deploy(cluster, "smollm2", "/smollm2", args)
    try:
        yield app
    finally:
        serve.delete("smollm2")


async def test_default_model_answers_factual_and_instruction_questions(smollm2_app: App) -> None:
    client = openai.AsyncOpenAI(base_url=smollm2_app.base_url + "/v1", api_key="unused",
                                max_retries=0, timeout=120)

    async def ask(question: str) -> str:
        chat = await client.chat.completions.create(
            model=SMOLLM2_MODEL_NAME, messages=[{"role": "user", "content": question}],
            max_tokens=16, temperature=0.0)
        return chat.choices[0].message.content or ""

    answers = await asyncio.gather(*(ask(q) for q, _ in QUESTIONS))
    for (question, word), answer in zip(QUESTIONS, answers, strict=True):
        assert re.search(rf"\b{word}\b", answer, re.IGNORECASE), f"{question!r} -> {answer!r}"
    info = await smollm2_app.server.model_info.remote()
    assert info["id"] == SMOLLM2_MODEL_NAME and info["load_time_s"] > 0
