"""OpenAI protocol schemas and error handling, through a tiny in-process FastAPI app.

No network: `TestClient` drives the app in-process, and the official `openai` client is pointed
at the same app by using the `TestClient` as its `http_client`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from fastapi.testclient import TestClient
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from tokenflow.cluster.errors import (
    OpenAIError,
    install_error_handlers,
    not_found,
    unauthorized,
)
from tokenflow.cluster.protocol import (
    SSE_DONE,
    ChatChoiceLogprobs,
    ChatCompletionChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatLogprob,
    ChatResponseMessage,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
    DeltaMessage,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    TopLogprob,
    UsageInfo,
    parse_request,
    sse_event,
)
from tokenflow.scheduler.sampling_params import SamplingParams

MODEL = "tokenflow-tiny"
PIECES = ["Hello", ",", " world"]


# ---------------------------------------------------------------- the tiny app


def _completion_events(req: CompletionRequest) -> Iterator[str]:
    resp_id, n_choices = "cmpl-test", len(req.prompts) * req.n
    for piece in PIECES:
        choices = [CompletionChoice(index=i, text=piece) for i in range(n_choices)]
        yield sse_event(CompletionStreamResponse(id=resp_id, model=MODEL, choices=choices))
    last = [CompletionChoice(index=i, text="", finish_reason="length") for i in range(n_choices)]
    yield sse_event(CompletionStreamResponse(id=resp_id, model=MODEL, choices=last))
    if req.include_usage:
        usage = UsageInfo.of(2 * n_choices, len(PIECES) * n_choices)
        yield sse_event(CompletionStreamResponse(id=resp_id, model=MODEL, choices=[], usage=usage))
    yield SSE_DONE


def _chat_events(req: ChatCompletionRequest) -> Iterator[str]:
    def chunk(delta: DeltaMessage, finish: Any = None) -> str:
        choice = ChatCompletionStreamChoice(index=0, delta=delta, finish_reason=finish)
        return sse_event(ChatCompletionStreamResponse(id="chatcmpl-test", model=MODEL,
                                                      choices=[choice]))

    yield chunk(DeltaMessage(role="assistant", content=""))
    for piece in PIECES:
        yield chunk(DeltaMessage(content=piece))
    yield chunk(DeltaMessage(), "stop")
    if req.include_usage:
        usage = UsageInfo.of(5, len(PIECES))
        yield sse_event(ChatCompletionStreamResponse(id="chatcmpl-test", model=MODEL, choices=[],
                                                     usage=usage))
    yield SSE_DONE


def make_app() -> FastAPI:
    app = FastAPI()
    install_error_handlers(app)

    @app.post("/v1/completions", response_model=None)
    async def completions(req: CompletionRequest) -> Any:
        if req.model not in (None, MODEL):
            raise not_found(f"The model `{req.model}` does not exist.", "model",
                            "model_not_found")
        req.to_sampling_params(default_max_tokens=32)
        if req.stream:
            return StreamingResponse(_completion_events(req), media_type="text/event-stream")
        n_choices = len(req.prompts) * req.n
        choices = [CompletionChoice(index=i, text="".join(PIECES), finish_reason="length")
                   for i in range(n_choices)]
        return CompletionResponse(model=MODEL, choices=choices,
                                  usage=UsageInfo.of(2, len(PIECES) * n_choices))

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(req: ChatCompletionRequest) -> Any:
        req.to_sampling_params(default_max_tokens=32)
        if req.stream:
            return StreamingResponse(_chat_events(req), media_type="text/event-stream")
        message = ChatResponseMessage(content="".join(PIECES))
        choice = ChatCompletionChoice(index=0, message=message, finish_reason="stop")
        return ChatCompletionResponse(model=MODEL, choices=[choice],
                                      usage=UsageInfo.of(5, len(PIECES)))

    @app.post("/v1/by-hand")
    async def by_hand(request: Request) -> dict[str, int]:
        req = parse_request(CompletionRequest, await request.body())
        return {"n": req.n}

    @app.get("/bad-response")
    async def bad_response() -> None:
        # A pydantic error from building our own model is a server bug: 500, not 400.
        UsageInfo(prompt_tokens="many")  # type: ignore[arg-type]

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=MODEL, max_model_len=2048)])

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> TokenizeResponse:
        return TokenizeResponse(tokens=[1, 2], count=2, max_model_len=2048)

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> DetokenizeResponse:
        return DetokenizeResponse(prompt="ab")

    @app.get("/secret")
    async def secret() -> None:
        raise unauthorized()

    @app.get("/boom")
    async def boom() -> None:
        raise RuntimeError("a bug in the server")

    return app


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    # raise_server_exceptions=False: see the 500 response a real client would get, since
    # Starlette re-raises unhandled errors after answering (so that the server logs them).
    with TestClient(make_app(), raise_server_exceptions=False) as test_client:
        yield test_client


# ---------------------------------------------------------------- malformed requests

CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
OK_MSGS = [{"role": "user", "content": "hi"}]

# (route, body, expected status, expected param)
MALFORMED: list[tuple[str, dict[str, Any] | list[Any], int, str | None]] = [
    (CMPL, {}, 400, "prompt"),
    (CMPL, {"prompt": ""}, 400, "prompt"),
    (CMPL, {"prompt": []}, 400, "prompt"),
    (CMPL, {"prompt": [1, "a"]}, 400, "prompt"),
    (CMPL, {"prompt": [-1, 2]}, 400, "prompt"),
    (CMPL, {"prompt": [[1], []]}, 400, "prompt"),
    (CMPL, {"prompt": 42}, 400, "prompt"),
    (CMPL, {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    (CMPL, {"prompt": "hi", "max_tokens": "16"}, 400, "max_tokens"),
    (CMPL, {"prompt": "hi", "temperature": -0.1}, 400, "temperature"),
    (CMPL, {"prompt": "hi", "temperature": 2.5}, 400, "temperature"),
    (CMPL, {"prompt": "hi", "temperature": True}, 400, "temperature"),
    (CMPL, {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    (CMPL, {"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    (CMPL, {"prompt": "hi", "n": 0}, 400, "n"),
    (CMPL, {"prompt": "hi", "n": 17}, 400, "n"),
    (CMPL, {"prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    (CMPL, {"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    (CMPL, {"prompt": "hi", "stop": ""}, 400, "stop"),
    (CMPL, {"prompt": "hi", "stop": 5}, 400, "stop"),
    (CMPL, {"prompt": "hi", "echo": True}, 400, "echo"),
    (CMPL, {"prompt": "hi", "best_of": 3}, 400, "best_of"),
    (CMPL, {"prompt": "hi", "logit_bias": {"50256": -100}}, 400, "logit_bias"),
    (CMPL, {"prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    (CMPL, {"prompt": "hi", "max_tokens": 4, "min_tokens": 5}, 400, "min_tokens"),
    (CMPL, {"prompt": "hi", "presence_penalty": 3}, 400, "presence_penalty"),
    (CMPL, {"prompt": "hi", "frequency_penalty": -2.5}, 400, "frequency_penalty"),
    (CMPL, {"prompt": "hi", "repetition_penalty": 0}, 400, "repetition_penalty"),
    (CMPL, {"prompt": "hi", "top_k": -2}, 400, "top_k"),
    (CMPL, {"prompt": "hi", "min_p": 1.5}, 400, "min_p"),
    (CMPL, {"prompt": "hi", "stop_token_ids": [3, -1]}, 400, "stop_token_ids[1]"),
    (CMPL, {"prompt": "hi", "seed": "abc"}, 400, "seed"),
    (CMPL, {"prompt": "hi", "model": "no-such-model"}, 404, "model"),
    (CMPL, ["not", "an", "object"], 400, None),
    (CHAT, {}, 400, "messages"),
    (CHAT, {"messages": []}, 400, "messages"),
    (CHAT, {"messages": "hi"}, 400, "messages"),
    (CHAT, {"messages": [{"role": "robot", "content": "hi"}]}, 400, "messages[0].role"),
    (CHAT, {"messages": [{"role": "user"}]}, 400, "messages[0].content"),
    (CHAT, {"messages": [{"content": "hi"}]}, 400, "messages[0].role"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     400, "messages[0].content[0].type"),
    (CHAT, {"messages": OK_MSGS, "top_logprobs": 3}, 400, "top_logprobs"),
    (CHAT, {"messages": OK_MSGS, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    (CHAT, {"messages": OK_MSGS, "logprobs": "yes"}, 400, "logprobs"),
    (CHAT, {"messages": OK_MSGS, "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    (CHAT, {"messages": OK_MSGS, "max_completion_tokens": 3, "min_tokens": 4}, 400, "min_tokens"),
    (CHAT, {"messages": OK_MSGS, "tools": [{"type": "function"}]}, 400, "tools"),
    (CHAT, {"messages": OK_MSGS, "response_format": {"type": "json_object"}}, 400,
     "response_format"),
    # Python's json parser accepts `Infinity`; the schema must still refuse it.
    (CHAT, {"messages": OK_MSGS, "temperature": float("inf")}, 400, "temperature"),
    ("/tokenize", {}, 400, "messages"),
    ("/tokenize", {"prompt": "a", "messages": OK_MSGS}, 400, "messages"),
    ("/detokenize", {"tokens": ["a"]}, 400, "tokens[0]"),
    ("/detokenize", {"tokens": [1, -5]}, 400, "tokens[1]"),
]


def _check_error_shape(body: dict[str, Any], status: int) -> dict[str, Any]:
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    expected_type = {400: "invalid_request_error", 401: "authentication_error",
                     404: "not_found_error", 405: "invalid_request_error",
                     500: "internal_error"}[status]
    assert error["type"] == expected_type
    return error


@pytest.mark.parametrize(("route", "body", "status", "param"), MALFORMED)
def test_malformed_request_gives_openai_error(client: TestClient, route: str, body: Any,
                                              status: int, param: str | None) -> None:
    # Serialize by hand so that inf goes out as a sloppy client would send it (`Infinity`).
    raw = json.dumps(body)
    resp = client.post(route, content=raw, headers={"content-type": "application/json"})
    assert resp.status_code == status, resp.text
    error = _check_error_shape(resp.json(), status)
    assert error["param"] == param, error


def test_at_least_twenty_malformed_cases() -> None:
    assert len(MALFORMED) >= 20


@pytest.mark.parametrize("raw", ["{not json", '{"prompt": "hi",}', "", "null"])
def test_malformed_json_is_400(client: TestClient, raw: str) -> None:
    resp = client.post(CMPL, content=raw, headers={"content-type": "application/json"})
    assert resp.status_code == 400, resp.text
    _check_error_shape(resp.json(), 400)


def test_error_messages_are_readable(client: TestClient) -> None:
    error = client.post(CMPL, json={"prompt": "hi", "max_tokens": 0}).json()["error"]
    assert error["message"].startswith("Invalid 'max_tokens'")
    assert "greater than or equal to 1" in error["message"]
    assert error["code"] == "invalid_value"
    error = client.post(CHAT, json={}).json()["error"]
    assert error["message"] == "Missing required parameter: 'messages'."
    assert error["code"] == "missing_required_parameter"
    error = client.post(CMPL, json={"prompt": "hi", "n": "2"}).json()["error"]
    assert error["code"] == "invalid_type"
    error = client.post(CMPL, json={"prompt": "hi", "echo": True}).json()["error"]
    assert "echo is not supported" in error["message"]
    assert "Value error" not in error["message"]


def test_hand_validated_body_errors_are_400(client: TestClient) -> None:
    resp = client.post("/v1/by-hand", content='{"prompt": "hi", "n": 99}')
    assert resp.status_code == 400
    assert _check_error_shape(resp.json(), 400)["param"] == "n"
    resp = client.post("/v1/by-hand", content="{oops")
    assert resp.status_code == 400
    assert _check_error_shape(resp.json(), 400)["code"] == "invalid_json"


def test_status_errors_and_server_survives_500(client: TestClient) -> None:
    resp = client.get("/secret")
    assert resp.status_code == 401
    assert _check_error_shape(resp.json(), 401)["code"] == "invalid_api_key"
    resp = client.get("/no/such/route")
    assert resp.status_code == 404
    _check_error_shape(resp.json(), 404)
    resp = client.get(CMPL)
    assert resp.status_code == 405
    _check_error_shape(resp.json(), 405)
    resp = client.get("/boom")
    assert resp.status_code == 500
    error = _check_error_shape(resp.json(), 500)
    assert "a bug in the server" not in error["message"]  # no internals leak to the client
    assert client.get("/bad-response").status_code == 500
    assert client.post(CMPL, json={"prompt": "still alive"}).status_code == 200


def test_unknown_fields_are_ignored(client: TestClient) -> None:
    body = {"prompt": "hi", "user": "u-1", "some_future_field": {"x": 1}, "metadata": None}
    assert client.post(CMPL, json=body).status_code == 200
    body = {"messages": OK_MSGS, "parallel_tool_calls": False, "store": False}
    assert client.post(CHAT, json=body).status_code == 200


def test_openai_error_defaults_type_from_status() -> None:
    assert OpenAIError("x", 404).type == "not_found_error"
    assert OpenAIError("x", 429).type == "rate_limit_error"
    assert OpenAIError("x", 418).type == "internal_error"


# ---------------------------------------------------------------- conversion to SamplingParams


def test_completion_defaults_to_sampling_params() -> None:
    params = CompletionRequest(prompt="hi").to_sampling_params(default_max_tokens=100)
    assert params == SamplingParams(max_tokens=16)  # OpenAI's completions default


def test_completion_full_to_sampling_params() -> None:
    req = CompletionRequest.model_validate({
        "prompt": [[1, 2], [3]], "max_tokens": 7, "temperature": 0, "top_p": 0.9, "n": 2,
        "stop": "\n", "seed": 42, "presence_penalty": 0.5, "frequency_penalty": -0.5,
        "logprobs": 3, "top_k": -1, "min_p": 0.05, "min_tokens": 2, "ignore_eos": True,
        "repetition_penalty": 1.1, "priority": -3, "stop_token_ids": [7],
        "include_stop_str_in_output": True, "skip_special_tokens": False,
        "kv_transfer_params": {"do_remote_decode": True}, "best_of": 2,
    })
    assert req.prompts == [[1, 2], [3]]
    assert req.priority == -3 and req.kv_transfer_params == {"do_remote_decode": True}
    assert req.to_sampling_params(default_max_tokens=100) == SamplingParams(
        n=2, temperature=0.0, top_p=0.9, top_k=0, min_p=0.05, seed=42, max_tokens=7,
        min_tokens=2, stop=["\n"], stop_token_ids=[7], include_stop_str_in_output=True,
        ignore_eos=True, presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.1,
        logprobs=3, skip_special_tokens=False,
    )


def test_completion_null_max_tokens_takes_default() -> None:
    req = CompletionRequest(prompt="hi", max_tokens=None)
    assert req.to_sampling_params(default_max_tokens=100).max_tokens == 100


@pytest.mark.parametrize(("prompt", "batch"), [
    ("hi", ["hi"]), (["a", "b"], ["a", "b"]), ([5, 6], [[5, 6]]), ([[5], [6, 7]], [[5], [6, 7]]),
])
def test_prompt_forms(prompt: Any, batch: list[Any]) -> None:
    assert CompletionRequest(prompt=prompt).prompts == batch


def test_min_tokens_above_default_max_is_bad_request() -> None:
    req = CompletionRequest(prompt="hi", max_tokens=None, min_tokens=50)
    with pytest.raises(OpenAIError) as info:
        req.to_sampling_params(default_max_tokens=10)
    assert info.value.status_code == 400


def test_chat_to_sampling_params() -> None:
    req = ChatCompletionRequest.model_validate({
        "messages": [{"role": "developer", "content": "be brief"},
                     {"role": "user", "content": [{"type": "text", "text": "a"},
                                                  {"type": "text", "text": "b"}]},
                     {"role": "assistant", "content": None},
                     {"role": "tool", "content": "42", "tool_call_id": "t1"}],
        "max_tokens": 9, "max_completion_tokens": 5, "logprobs": True, "top_logprobs": 4,
        "stop": ["x", "y"], "seed": 1, "temperature": 1.5,
        "stream": True, "stream_options": {"include_usage": True},
    })
    assert req.include_usage
    assert req.conversation() == [
        {"role": "developer", "content": "be brief"}, {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": ""}, {"role": "tool", "content": "42"},
    ]
    params = req.to_sampling_params(default_max_tokens=100)
    assert params == SamplingParams(max_tokens=5, logprobs=4, stop=["x", "y"], seed=1,
                                    temperature=1.5)


def test_chat_max_tokens_fallbacks() -> None:
    base = {"messages": OK_MSGS}
    req = ChatCompletionRequest.model_validate(base)
    assert req.to_sampling_params(default_max_tokens=77).max_tokens == 77
    req = ChatCompletionRequest.model_validate({**base, "max_tokens": 8})
    assert req.to_sampling_params(default_max_tokens=77).max_tokens == 8
    req = ChatCompletionRequest.model_validate({**base, "logprobs": True})
    assert req.to_sampling_params(default_max_tokens=77).logprobs == 0
    assert ChatCompletionRequest.model_validate(base).to_sampling_params(7).logprobs is None


def test_parse_request_from_dict_and_bytes() -> None:
    assert parse_request(ChatCompletionRequest, {"messages": OK_MSGS}).n == 1
    assert parse_request(CompletionRequest, b'{"prompt": [1, 2]}').prompts == [[1, 2]]
    with pytest.raises(OpenAIError) as info:
        parse_request(ChatCompletionRequest, {"messages": [{"role": "x", "content": "y"}]})
    assert (info.value.status_code, info.value.param) == (400, "messages[0].role")


def test_tokenize_requests() -> None:
    assert TokenizeRequest(prompt="hi").messages is None
    assert TokenizeRequest.model_validate({"messages": OK_MSGS}).prompt is None


# ---------------------------------------------------------------- responses vs the openai client


def _openai_client(client: TestClient) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{client.base_url}/v1", api_key="test", http_client=client,
                         max_retries=0)


def test_completion_response_matches_openai_types() -> None:
    logprobs = CompletionLogprobs(tokens=["a", "b"], token_logprobs=[-0.1, -0.2],
                                  top_logprobs=[{"a": -0.1}, {"b": -0.2, "c": -3.0}],
                                  text_offset=[0, 1])
    resp = CompletionResponse(model=MODEL, usage=UsageInfo.of(3, 2, cached_tokens=1), choices=[
        CompletionChoice(index=0, text="ab", logprobs=logprobs, finish_reason="length")])
    parsed = Completion.model_validate(resp.model_dump())
    assert parsed.id.startswith("cmpl-") and parsed.object == "text_completion"
    assert parsed.usage is not None and parsed.usage.total_tokens == 5
    assert parsed.usage.prompt_tokens_details is not None
    assert parsed.usage.prompt_tokens_details.cached_tokens == 1
    assert parsed.choices[0].logprobs is not None
    assert parsed.choices[0].logprobs.top_logprobs == [{"a": -0.1}, {"b": -0.2, "c": -3.0}]
    final_chunk = CompletionStreamResponse(model=MODEL, choices=[
        CompletionChoice(index=0, text="", finish_reason="stop")])
    Completion.model_validate(final_chunk.model_dump())


def test_chat_responses_match_openai_types() -> None:
    logprobs = ChatChoiceLogprobs(content=[ChatLogprob(
        token="hi", logprob=-0.5, bytes=[104, 105],
        top_logprobs=[TopLogprob(token="hi", logprob=-0.5), TopLogprob(token="yo", logprob=-1.0)],
    )])
    resp = ChatCompletionResponse(model=MODEL, usage=UsageInfo.of(3, 1), choices=[
        ChatCompletionChoice(index=0, message=ChatResponseMessage(content="hi"),
                             logprobs=logprobs, finish_reason="stop")])
    parsed = ChatCompletion.model_validate(resp.model_dump())
    assert parsed.id.startswith("chatcmpl-") and parsed.object == "chat.completion"
    assert parsed.choices[0].message.role == "assistant"
    assert parsed.choices[0].logprobs is not None and parsed.choices[0].logprobs.content
    assert parsed.choices[0].logprobs.content[0].top_logprobs[1].token == "yo"
    for choice in (ChatCompletionStreamChoice(index=0, delta=DeltaMessage(role="assistant")),
                   ChatCompletionStreamChoice(index=0, delta=DeltaMessage(content="x"),
                                              logprobs=logprobs),
                   ChatCompletionStreamChoice(index=0, delta=DeltaMessage(),
                                              finish_reason="length")):
        chunk = ChatCompletionStreamResponse(model=MODEL, choices=[choice])
        parsed_chunk = ChatCompletionChunk.model_validate(chunk.model_dump())
        assert parsed_chunk.object == "chat.completion.chunk"
    usage_chunk = ChatCompletionStreamResponse(model=MODEL, choices=[], usage=UsageInfo.of(1, 1))
    assert ChatCompletionChunk.model_validate(usage_chunk.model_dump()).usage is not None


def test_openai_client_round_trip(client: TestClient) -> None:
    oai = _openai_client(client)
    cmpl = oai.completions.create(model=MODEL, prompt=["a", "b"], n=2, max_tokens=3)
    assert [c.index for c in cmpl.choices] == [0, 1, 2, 3]
    assert cmpl.choices[0].text == "Hello, world"
    chat = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    assert chat.choices[0].message.content == "Hello, world"
    assert chat.choices[0].finish_reason == "stop"
    assert [m.id for m in oai.models.list()] == [MODEL]


def test_openai_client_streams(client: TestClient) -> None:
    oai = _openai_client(client)
    chunks = list(oai.completions.create(model=MODEL, prompt="a", stream=True,
                                         stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "Hello, world"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == len(PIECES)
    chat_chunks = list(oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=True,
        stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chat_chunks if c.choices)
    assert text == "Hello, world"
    assert chat_chunks[0].choices[0].delta.role == "assistant"
    assert chat_chunks[-2].choices[0].finish_reason == "stop"
    assert chat_chunks[-1].usage is not None and chat_chunks[-1].usage.total_tokens == 8


def test_openai_client_raises_typed_errors(client: TestClient) -> None:
    oai = _openai_client(client)
    with pytest.raises(openai.BadRequestError) as bad:
        oai.completions.create(model=MODEL, prompt="hi", temperature=3)
    assert bad.value.param == "temperature"
    assert bad.value.type == "invalid_request_error"
    with pytest.raises(openai.NotFoundError) as missing:
        oai.completions.create(model="gpt-nope", prompt="hi")
    assert missing.value.code == "model_not_found"
