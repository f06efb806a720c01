"""Async scheduling through the OpenAI API, in process (the real routes on an `LLMServer`, its
engine in an engine process), with the official `openai` client: completions, streams with
usage, stop strings, n > 1 with a seed and chat give what the synchronous scheduler gives."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import openai

from tokenflow.cluster.openai_serving import LocalBackend, OpenAIServing, build_openai_app
from tokenflow.cluster.server import LLMServer

MODEL = "tokenflow-tiny"
ENGINE = {"model": {"model": MODEL, "num_threads": 1},
          "cache": {"block_size": 16, "num_blocks": 256},
          "scheduler": {"max_num_batched_tokens": 64}}  # chunked prefills beside decodes


async def _answers(async_scheduling: bool) -> list[Any]:
    engine = {**ENGINE, "scheduler": {**ENGINE["scheduler"],
                                      "async_scheduling": async_scheduling}}
    server = LLMServer(engine)
    app = build_openai_app(OpenAIServing(LocalBackend(server), MODEL))
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://test")
    api = openai.AsyncOpenAI(base_url="http://test/v1", api_key="x", http_client=http)
    try:
        async def stream(prompt: str) -> tuple[str, int]:
            text, used = "", 0
            async for chunk in await api.completions.create(
                    model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stream=True,
                    stream_options={"include_usage": True}, extra_body={"ignore_eos": True}):
                text += "".join(c.text for c in chunk.choices)
                used = chunk.usage.completion_tokens if chunk.usage else used
            return text, used

        async def plain(prompt: str, **kw: Any) -> list[tuple[str, str | None]]:
            r = await api.completions.create(model=MODEL, prompt=prompt, **kw)
            return [(c.text, c.finish_reason) for c in r.choices]

        async def chat() -> str | None:
            r = await api.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "Say something."}],
                max_tokens=12, temperature=0)
            return r.choices[0].message.content

        return list(await asyncio.gather(
            *(stream(f"Stream {i} tells a long story about") for i in range(4)),
            plain("A stop string ends this", max_tokens=40, temperature=0, stop=["e"],
                  extra_body={"ignore_eos": True}),
            plain("Two seeded choices", max_tokens=10, n=2, seed=7, temperature=1.0,
                  extra_body={"ignore_eos": True}),
            chat()))
    finally:
        await http.aclose()
        await asyncio.to_thread(server.engine.shutdown)
        if server._poller is not None:
            server._poller.cancel()


async def test_the_api_gives_the_same_answers_with_async_scheduling() -> None:
    sync, overlapped = await _answers(False), await _answers(True)
    assert overlapped == sync
    assert all(used == 24 for _, used in sync[:4])
    assert len(sync[5]) == 2
