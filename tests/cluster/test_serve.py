"""The OpenAI API end to end: real Ray Serve, real HTTP on 127.0.0.1, the official `openai`
client (and httpx for what a well-behaved client would never send).

Everything runs against the session's `main` application (tokenflow-tiny with dummy weights,
so the text is random but deterministic for greedy decoding), which requires an API key.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
import openai
import pytest

from tests.cluster.conftest import API_KEY, ENGINE_ARGS, App
from tokenflow.cluster.errors import OpenAIError
from tokenflow.config import EngineConfig
from tokenflow.replica.engine.llm import LLM
from tokenflow.scheduler import SamplingParams

pytestmark = pytest.mark.slow

MODEL = "tokenflow-tiny"
PROMPTS = ["Hello, my name is", "The capital of France is", "def fibonacci(n):",
           "Once upon a time"]
GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}


def sync_client(app: App) -> openai.OpenAI:
    return openai.OpenAI(base_url=app.base_url + "/v1", api_key=app.api_key, max_retries=0,
                         timeout=60)


def async_client(app: App) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=app.base_url + "/v1", api_key=app.api_key,
                              max_retries=0, timeout=120)


def auth(app: App) -> dict[str, str]:
    return {"Authorization": f"Bearer {app.api_key}"} if app.api_key else {}


@pytest.fixture(scope="module")
def offline() -> LLM:
    """The offline engine with the replica's exact config: same dummy weights, same tokenizer."""
    return LLM(config=EngineConfig.model_validate(ENGINE_ARGS))


def offline_greedy(llm: LLM, prompts: list[Any], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


# ------------------------------------------------------------------ parity with offline LLM


def test_greedy_completion_equals_offline_llm(main_app: App, offline: LLM) -> None:
    client = sync_client(main_app)
    expected = offline_greedy(offline, PROMPTS, 12)
    tok = offline.tokenizer
    for prompt, ids in zip(PROMPTS, expected, strict=True):
        out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, logprobs=0,
                                        **GREEDY)
        choice = out.choices[0]
        # Token-exact: the per-token strings are the offline ids, one by one.
        assert choice.logprobs.tokens == [tok.decode([i], skip_special_tokens=False) for i in ids]
        assert choice.text == tok.decode(ids)
        assert choice.finish_reason == "length"
        assert out.usage.prompt_tokens == len(tok.encode(prompt))
        assert out.usage.completion_tokens == 12
        assert out.usage.total_tokens == out.usage.prompt_tokens + 12


def test_greedy_chat_equals_offline_llm(main_app: App, offline: LLM) -> None:
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Name a colour."}]
    tok = offline.tokenizer
    prompt_ids = tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)
    [expected] = offline_greedy(offline, [prompt_ids], 10)
    out = sync_client(main_app).chat.completions.create(
        model=MODEL, messages=messages, max_tokens=10, **GREEDY)
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == tok.decode(expected)
    assert out.usage.prompt_tokens == len(prompt_ids)
    assert out.usage.completion_tokens == 10


def test_token_id_prompt_equals_text_prompt(main_app: App, offline: LLM) -> None:
    ids = offline.tokenizer.encode(PROMPTS[0])
    client = sync_client(main_app)
    by_text = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=6, **GREEDY)
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, **GREEDY)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids)


# ----------------------------------------------------------------------------- streaming


def test_streamed_completion_equals_whole_with_usage(main_app: App) -> None:
    client = sync_client(main_app)
    whole = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=16, **GREEDY)
    stream = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=16, stream=True,
                                       stream_options={"include_usage": True}, **GREEDY)
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 16
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    assert all(c.id == chunks[0].id for c in chunks)


def test_streamed_chat_equals_whole_with_usage(main_app: App) -> None:
    client = sync_client(main_app)
    messages = [{"role": "user", "content": "Tell me a story."}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12,
                                           **GREEDY)
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=12, stream=True,
        stream_options={"include_usage": True}, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_raw_sse_framing_ends_with_done(main_app: App) -> None:
    body = {"model": MODEL, "prompt": "abc", "max_tokens": 4, "stream": True}
    with httpx.stream("POST", main_app.base_url + "/v1/completions", json=body,
                      headers=auth(main_app), timeout=30) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    assert all("choices" in json.loads(line[6:]) for line in lines[:-1])


# ----------------------------------------------------------------- n, logprobs, knobs


def test_n2_seeded_streamed_equals_whole(main_app: App) -> None:
    client = sync_client(main_app)
    kwargs = dict(model=MODEL, prompt=PROMPTS[2], max_tokens=10, n=2, temperature=1.0, seed=7,
                  extra_body={"ignore_eos": True})
    whole = client.completions.create(**kwargs)
    assert sorted(c.index for c in whole.choices) == [0, 1]
    assert whole.usage.completion_tokens == 20  # summed over the two choices
    texts = {0: "", 1: ""}
    for chunk in client.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == {c.index: c.text for c in whole.choices}
    again = client.completions.create(**kwargs)  # the same seed gives the same text
    assert [c.text for c in again.choices] == [c.text for c in whole.choices]


def test_batch_of_prompts_gets_n_choices_each(main_app: App) -> None:
    client = sync_client(main_app)
    out = client.completions.create(model=MODEL, prompt=PROMPTS[:2], max_tokens=5, n=2,
                                    **GREEDY)
    assert [c.index for c in sorted(out.choices, key=lambda c: c.index)] == [0, 1, 2, 3]
    by_index = {c.index: c.text for c in out.choices}
    single = [client.completions.create(model=MODEL, prompt=p, max_tokens=5, **GREEDY)
              .choices[0].text for p in PROMPTS[:2]]
    assert by_index == {0: single[0], 1: single[0], 2: single[1], 3: single[1]}
    assert out.usage.completion_tokens == 20


def test_completion_logprobs(main_app: App) -> None:
    out = sync_client(main_app).completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=6,
                                                   logprobs=3, **GREEDY)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert all(v <= 0 for v in lp.token_logprobs)
    for chosen, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert 1 <= len(top) <= 3
        # Greedy: the chosen token is the most likely one.
        assert max(top.values()) == pytest.approx(logprob, abs=1e-5)
        assert top.get(chosen, logprob) == pytest.approx(logprob, abs=1e-5)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0


def test_chat_logprobs(main_app: App) -> None:
    out = sync_client(main_app).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5, logprobs=True,
        top_logprobs=2, **GREEDY)
    content = out.choices[0].logprobs.content
    assert len(content) == 5
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-5)
        assert entry.bytes == list(entry.token.encode())


def test_stop_string_truncates(main_app: App) -> None:
    client = sync_client(main_app)
    full = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=16, **GREEDY)
    text = full.choices[0].text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    out = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=16, stop=[stop],
                                    **GREEDY)
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].text == text[:text.index(stop)]


def test_sampling_extras_are_accepted(main_app: App) -> None:
    out = sync_client(main_app).completions.create(
        model=MODEL, prompt="x", max_tokens=4, temperature=0.7, top_p=0.9, seed=1,
        extra_body={"top_k": 20, "min_p": 0.05, "ignore_eos": True, "priority": 3})
    assert out.usage.completion_tokens == 4


# ------------------------------------------------------------------------- other routes


def test_models_health_tokenize_detokenize(main_app: App, offline: LLM) -> None:
    client = sync_client(main_app)
    models = client.models.list()
    # Adapters another test loaded into the shared app may follow, each with its parent.
    assert [m.id for m in models.data if m.parent is None] == [MODEL]
    assert httpx.get(main_app.base_url + "/health", timeout=30).status_code == 200
    url, headers = main_app.base_url, auth(main_app)
    tok = httpx.post(url + "/tokenize", json={"prompt": "hello world"}, headers=headers).json()
    assert tok["tokens"] == offline.tokenizer.encode("hello world")
    assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == 512
    chat = httpx.post(url + "/tokenize", headers=headers,
                      json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["tokens"][0] == offline.tokenizer.bos_token_id
    assert chat["tokens"].count(offline.tokenizer.bos_token_id) == 1  # no double BOS
    text = httpx.post(url + "/detokenize", json={"tokens": tok["tokens"]},
                      headers=headers).json()
    assert text["prompt"] == offline.tokenizer.decode(tok["tokens"])


# -------------------------------------------------------------------------- concurrency


def test_64_concurrent_streams_lose_and_duplicate_nothing(main_app: App) -> None:
    prompts = [f"request number {i}: the quick brown fox" for i in range(64)]

    async def run() -> tuple[list[str], list[str], list[int]]:
        client = async_client(main_app)

        async def whole(p: str) -> str:
            out = await client.completions.create(model=MODEL, prompt=p, max_tokens=16,
                                                  **GREEDY)
            return out.choices[0].text

        async def streamed(p: str) -> tuple[str, int]:
            stream = await client.completions.create(
                model=MODEL, prompt=p, max_tokens=16, stream=True,
                stream_options={"include_usage": True}, **GREEDY)
            text, usage = "", -1
            async for chunk in stream:
                if chunk.choices:
                    text += chunk.choices[0].text
                if chunk.usage is not None:
                    usage = chunk.usage.completion_tokens
            return text, usage

        streams = await asyncio.gather(*(streamed(p) for p in prompts))
        wholes = await asyncio.gather(*(whole(p) for p in prompts))
        await client.close()
        return [s[0] for s in streams], wholes, [s[1] for s in streams]

    started = time.monotonic()
    texts, wholes, counts = asyncio.run(run())
    print(f"64 streams + 64 whole requests in {time.monotonic() - started:.1f}s")
    assert counts == [16] * 64
    assert texts == wholes


# ------------------------------------------------------------------------- disconnects


def _wait_for_free_blocks(app: App, timeout_s: float) -> tuple[dict[str, Any], float]:
    started = time.monotonic()
    while True:
        stats = app.server.stats.remote().result()
        elapsed = time.monotonic() - started
        if stats["num_free_blocks"] == stats["num_blocks"] or elapsed > timeout_s:
            return stats, elapsed
        time.sleep(0.05)


def test_disconnect_mid_stream_frees_blocks(main_app: App) -> None:
    body = {"model": MODEL, "prompt": "a long story about " * 8, "max_tokens": 400,
            "ignore_eos": True, "temperature": 0.0}
    client = httpx.Client(timeout=60, headers=auth(main_app))
    # How long the whole generation takes, to show the disconnect did cut it short.
    started = time.monotonic()
    full = client.post(main_app.base_url + "/v1/completions", json=body)
    full_s = time.monotonic() - started
    assert full.json()["usage"]["completion_tokens"] == 400
    with client.stream("POST", main_app.base_url + "/v1/completions",
                       json={**body, "stream": True}) as r:
        events = (line for line in r.iter_lines() if line)  # blank lines end SSE events
        for _ in range(3):
            assert next(events).startswith("data: ")
        busy = main_app.server.stats.remote().result()
        assert busy["num_free_blocks"] < busy["num_blocks"]  # the request holds blocks
    # Leaving the block closed the connection mid-stream.
    stats, freed_s = _wait_for_free_blocks(main_app, timeout_s=max(10.0, 2 * full_s))
    client.close()
    assert stats["num_free_blocks"] == stats["num_blocks"], stats
    assert stats["running"] == 0 and stats["waiting"] == 0
    print(f"whole request {full_s:.2f}s; blocks freed {freed_s:.2f}s after the disconnect")
    assert freed_s < full_s


# ---------------------------------------------------------------------------- bad input

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
OK_CHAT = [{"role": "user", "content": "hi"}]
LONG_PROMPT = "word " * 600  # over the 512-token context

MALFORMED: list[tuple[str, str, Any, int]] = [
    ("malformed json", COMPLETIONS, b'{"model": "tokenflow-tiny", "prompt": ', 400),
    ("body not an object", COMPLETIONS, [1, 2, 3], 400),
    ("empty body", COMPLETIONS, b"", 400),
    ("missing prompt", COMPLETIONS, {"model": MODEL}, 400),
    ("prompt wrong type", COMPLETIONS, {"prompt": 5}, 400),
    ("empty prompt", COMPLETIONS, {"prompt": ""}, 400),
    ("empty prompt list", COMPLETIONS, {"prompt": []}, 400),
    ("token id beyond vocab", COMPLETIONS, {"prompt": [1, 2, 10**7]}, 400),
    ("max_tokens zero", COMPLETIONS, {"prompt": "a", "max_tokens": 0}, 400),
    ("max_tokens as string", COMPLETIONS, {"prompt": "a", "max_tokens": "16"}, 400),
    ("max_tokens beyond context", COMPLETIONS, {"prompt": "a", "max_tokens": 100000}, 400),
    ("prompt too long", COMPLETIONS, {"prompt": LONG_PROMPT, "max_tokens": 1}, 400),
    ("n zero", COMPLETIONS, {"prompt": "a", "n": 0}, 400),
    ("n too large", COMPLETIONS, {"prompt": "a", "n": 1000}, 400),
    ("logprobs too large", COMPLETIONS, {"prompt": "a", "logprobs": 50}, 400),
    ("logprobs negative", COMPLETIONS, {"prompt": "a", "logprobs": -1}, 400),
    ("negative temperature", COMPLETIONS, {"prompt": "a", "temperature": -0.5}, 400),
    ("top_p zero", COMPLETIONS, {"prompt": "a", "top_p": 0}, 400),
    ("seed not an int", COMPLETIONS, {"prompt": "a", "seed": 1.5}, 400),
    ("too many stop strings", COMPLETIONS, {"prompt": "a", "stop": ["a", "b", "c", "d", "e"]},
     400),
    ("stream_options without stream", COMPLETIONS,
     {"prompt": "a", "stream_options": {"include_usage": True}}, 400),
    ("unknown model", COMPLETIONS, {"model": "gpt-17", "prompt": "a"}, 404),
    ("chat unknown role", CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, 400),
    ("chat empty messages", CHAT, {"messages": []}, 400),
    ("chat missing messages", CHAT, {"model": MODEL}, 400),
    ("chat content wrong type", CHAT, {"messages": [{"role": "user", "content": 3}]}, 400),
    ("chat logprobs not a bool", CHAT, {"messages": OK_CHAT, "logprobs": "yes"}, 400),
    ("chat top_logprobs without logprobs", CHAT, {"messages": OK_CHAT, "top_logprobs": 2}, 400),
    ("chat max_tokens beyond context", CHAT, {"messages": OK_CHAT, "max_tokens": 5000}, 400),
    ("chat prompt too long", CHAT, {"messages": [{"role": "user", "content": LONG_PROMPT}]},
     400),
    ("chat unknown model", CHAT, {"model": "nope", "messages": OK_CHAT}, 404),
    ("tokenize prompt and messages", "/tokenize", {"prompt": "a", "messages": OK_CHAT}, 400),
    ("detokenize id beyond vocab", "/detokenize", {"tokens": [10**7]}, 400),
    ("unknown route", "/v1/nothing-here", {}, 404),
]


@pytest.mark.parametrize("name,path,body,status", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_bad_request_gets_openai_error(main_app: App, name: str, path: str, body: Any,
                                       status: int) -> None:
    headers = {**auth(main_app), "Content-Type": "application/json"}
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(main_app.base_url + path, content=content, headers=headers, timeout=30)
    assert r.status_code == status, (name, r.text)
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and error["type"].endswith("_error")


def test_wrong_method_is_405(main_app: App) -> None:
    r = httpx.get(main_app.base_url + COMPLETIONS, headers=auth(main_app), timeout=30)
    assert r.status_code == 405 and "error" in r.json()


def test_openai_client_raises_typed_errors(main_app: App) -> None:
    client = sync_client(main_app)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=1)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=OK_CHAT)


def test_server_keeps_serving_after_bad_requests(main_app: App) -> None:
    for _, path, body, _ in MALFORMED[:10]:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        httpx.post(main_app.base_url + path, content=content, headers=auth(main_app),
                   timeout=30)
    out = sync_client(main_app).completions.create(model=MODEL, prompt="still there?",
                                                   max_tokens=3)
    assert out.usage.completion_tokens >= 1
    assert main_app.server.check_health.remote().result() is None


# ------------------------------------------------------------------------------ API key


def test_api_key_is_enforced(main_app: App) -> None:
    url = main_app.base_url
    body = {"model": MODEL, "prompt": "a", "max_tokens": 1}
    cases = {
        "none": {},
        "wrong": {"Authorization": "Bearer not-the-key"},
        "not bearer": {"Authorization": f"Basic {API_KEY}"},
    }
    for name, headers in cases.items():
        for method, path in (("POST", COMPLETIONS), ("GET", "/v1/models"),
                             ("POST", "/tokenize")):
            r = httpx.request(method, url + path, json=body, headers=headers, timeout=30)
            assert r.status_code == 401, (name, path, r.text)
            assert r.json()["error"]["type"] == "authentication_error"
    # A malformed body without a key is still a 401: the key is checked first.
    r = httpx.post(url + COMPLETIONS, content=b"{", timeout=30)
    assert r.status_code == 401
    assert httpx.get(url + "/health", timeout=30).status_code == 200  # open
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
    assert httpx.post(url + COMPLETIONS, json=body, headers=auth(main_app),
                      timeout=30).status_code == 200


# ------------------------------------------------------------------ LLMServer in-process


@pytest.fixture(scope="module")
def server(cluster: Any) -> Any:
    """An LLMServer built in the test process (metrics need the session's Ray)."""
    from tokenflow.cluster.server import LLMServer

    srv = LLMServer(ENGINE_ARGS)
    yield srv
    srv.engine.shutdown()


def _events(stream: Any) -> list[Any]:
    async def drain() -> list[Any]:
        return [event async for event in stream]

    return asyncio.run(drain())


@pytest.mark.parametrize("prompts", [[[5, 6, 7]], [[5, 6, 7], [8, 9]]], ids=["one", "two"])
def test_a_stream_interval_coalesces_chunks_and_keeps_every_token(
        server: Any, prompts: list[list[int]]) -> None:
    """stream_interval_s: the first delta goes at once, then at most one item per interval;
    the tokens are those of the uncoalesced stream."""
    from tokenflow.cluster.messages import Accepted, Finished
    from tokenflow.cluster.server import LLMServer

    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    coalescing = LLMServer(ENGINE_ARGS, stream_interval_s=0.25)
    try:
        def tokens_and_items(srv: Any, rid: str) -> tuple[dict[int, list[int]], int]:
            events = _events(srv.generate(prompts, params, rid))
            assert isinstance(events[0], Accepted) and isinstance(events[-1], Finished)
            out: dict[int, list[int]] = {}
            for batch in events[1:-1]:
                for d in batch:
                    out.setdefault(d.index, []).extend(d.token_ids)
            return out, len(events) - 2

        plain, plain_items = tokens_and_items(server, "r-plain")
        coalesced, items = tokens_and_items(coalescing, "r-coalesced")
    finally:
        coalescing.engine.shutdown()
    assert coalesced == plain and all(len(t) == 40 for t in plain.values())
    # Without an interval each step's delta goes as soon as the stream reads it (deltas of the
    # engine process that arrive while the stream is busy go together: not one per step).
    assert plain_items >= 10
    assert items < plain_items / 2  # 40 steps of a few ms, one item per 250 ms


def test_server_rejects_bad_input_as_data(server: Any) -> None:
    from tokenflow.cluster.messages import Rejected

    params = SamplingParams(max_tokens=4)
    [event] = _events(server.generate([[]], params, "r-empty"))
    assert isinstance(event, Rejected) and "empty" in event.message
    [event] = _events(server.generate([[5]], SamplingParams(max_tokens=10**6), "r-long"))
    assert isinstance(event, Rejected) and "context" in event.message


def test_dead_engine_fails_health_and_requests(server: Any) -> None:
    from tokenflow.cluster.messages import Finished, Rejected, SeqDelta
    from tokenflow.cluster.responses import CompletionFormatter
    from tokenflow.cluster.server import ENGINE_DEAD_RETRY_S
    from tokenflow.replica.engine.async_engine import EngineDeadError

    server.check_health()
    server.engine.error = RuntimeError("simulated crash")  # what the loop records as it dies
    try:
        with pytest.raises(EngineDeadError):
            server.check_health()  # Serve replaces a replica whose check_health raises
        [event] = _events(server.generate([[5, 6]], SamplingParams(max_tokens=4), "r-x"))
        # Not the client's fault, and another replica can serve it: a 503 to retry.
        assert isinstance(event, Rejected) and "simulated crash" in event.message
        assert (event.status_code, event.retry_after_s) == (503, ENGINE_DEAD_RETRY_S)
    finally:
        server.engine.error = None
    # An engine that dies mid-request fails the request as retryable too.
    fmt = CompletionFormatter(MODEL, 1, False, False)
    fmt.add([SeqDelta(0, "", [], None, "error", "engine loop died", ENGINE_DEAD_RETRY_S)])
    with pytest.raises(OpenAIError) as info:
        fmt.response(Finished(2, 0, 0))
    assert (info.value.status_code, info.value.retry_after_s) == (503, ENGINE_DEAD_RETRY_S)
