"""Streaming-input sessions through the OpenAI API, in process (the real routes on an
`LLMServer`), with the official `openai` client: each turn of a session reports the held
prefix as cached tokens; a bad session field is a 400 in OpenAI's error shape."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import httpx
import openai
import pytest

from tokenflow.cluster.openai_serving import LocalBackend, OpenAIServing, build_openai_app
from tokenflow.cluster.server import LLMServer

MODEL = "tokenflow-tiny"
ENGINE = {"model": {"model": MODEL}, "cache": {"block_size": 16, "num_blocks": 256},
          "scheduler": {"max_num_batched_tokens": 512}}


@pytest.fixture(scope="module")
def server() -> Iterator[LLMServer]:
    # One server (with its engine process) for the module: a session of one test is held in
    # it while the next runs, so each test counts the blocks it holds from where it began.
    llm_server = LLMServer(ENGINE)
    yield llm_server
    llm_server.engine.shutdown()


@pytest.fixture
async def client(server: LLMServer) -> AsyncIterator[tuple[openai.AsyncOpenAI, LLMServer]]:
    app = build_openai_app(OpenAIServing(LocalBackend(server), MODEL))
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://test")
    try:
        yield openai.AsyncOpenAI(base_url="http://test/v1", api_key="x", http_client=http), server
    finally:
        await http.aclose()


def held_blocks(server: LLMServer) -> int:
    state = server.engine.state
    return state.num_blocks - state.num_free_blocks


async def test_completion_turns_report_the_held_prefix_as_cached(client):
    api, server = client
    before = held_blocks(server)
    prompt, cached, prompt_tokens = "You are a helpful assistant. The user says hi.", [], []
    for k in range(5):
        r = await api.completions.create(
            model=MODEL, prompt=prompt, max_tokens=6, temperature=0.0,
            extra_body={"ignore_eos": True, "session_id": "conv-1"})
        cached.append(r.usage.prompt_tokens_details.cached_tokens)
        prompt_tokens.append(r.usage.prompt_tokens)
        prompt += r.choices[0].text + f" Turn {k}: tell me more, please."
    assert cached[0] == 0
    # Each follow-up reuses the previous turn's KV: its prompt and all outputs but the last
    # (sampled, never computed). Here the text re-tokenizes as generated; where it does not,
    # the common prefix is reused instead.
    for k in range(1, 5):
        assert cached[k] == prompt_tokens[k - 1] + 6 - 1, (k, cached, prompt_tokens)
    assert held_blocks(server) > before
    await api.completions.create(model=MODEL, prompt=prompt, max_tokens=2,
                                 extra_body={"session_id": "conv-1", "session_close": True})
    assert held_blocks(server) == before


async def test_chat_turns_report_the_held_prefix_as_cached(client):
    api, server = client
    before = held_blocks(server)
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "What is a paged KV cache?"}]
    cached, prompt_tokens = [], []
    for k in range(4):
        r = await api.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=6, temperature=0.0,
            extra_body={"ignore_eos": True, "session_id": "chat-1"})
        cached.append(r.usage.prompt_tokens_details.cached_tokens)
        prompt_tokens.append(r.usage.prompt_tokens)
        messages += [{"role": "assistant", "content": r.choices[0].message.content},
                     {"role": "user", "content": f"And then {k}?"}]
    assert cached[0] == 0
    # The template re-renders the assistant's reply from its text, ending the turn its own way
    # (and the dummy model's tokens need not survive decode and encode): the common prefix,
    # at least the previous prompt, is reused.
    for k in range(1, 4):
        assert cached[k] >= prompt_tokens[k - 1], (k, cached, prompt_tokens)
    assert held_blocks(server) > before  # expires after session_idle_timeout_s


@pytest.mark.parametrize("body, param", [
    ({"session_id": ""}, "session_id"),
    ({"session_id": 7}, "session_id"),
    ({"session_id": "s", "n": 2}, "session_id"),
    ({"session_close": True}, "session_close"),
    ({"session_id": "s", "prompt": ["a", "b"]}, "prompt"),
])
async def test_bad_session_fields_are_400s(client, body, param):
    api, _ = client
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 2, **body}
    http = api._client
    r = await http.post("http://test/v1/completions", json=body)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert error["message"]
