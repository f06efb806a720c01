"""OpenAI protocol schemas and error handling, through the real ingress routes in process.

No network and no Ray: `TestClient` drives `build_openai_app` (the very app the Serve ingress
runs) over an in-process `LLMServer` on the embedded model, and the official `openai` client is
pointed at it by using the `TestClient` as its `http_client`. The error handlers' own corner
cases (an unhandled bug, a route that builds a bad response) use a tiny separate app.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from ray.exceptions import TaskCancelledError

from tokenflow.cluster.errors import OpenAIError, install_error_handlers, unauthorized
from tokenflow.cluster.openai_serving import LocalBackend, OpenAIServing, build_openai_app
from tokenflow.cluster.protocol import (
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
    TokenizeRequest,
    TopLogprob,
    UsageInfo,
    parse_request,
)
from tokenflow.cluster.server import LLMServer
from tokenflow.scheduler.sampling_params import RepetitionDetectionParams, SamplingParams

MODEL = "tokenflow-tiny"
ENGINE_ARGS = {"model": {"model": MODEL}, "cache": {"num_blocks": 256},
               "scheduler": {"max_model_len": 512}}


@pytest.fixture(scope="module")
def server() -> Iterator[LLMServer]:
    llm_server = LLMServer(ENGINE_ARGS)
    yield llm_server
    llm_server.engine.shutdown()


@pytest.fixture(scope="module")
def client(server: LLMServer) -> Iterator[TestClient]:
    app = build_openai_app(OpenAIServing(LocalBackend(server), MODEL))
    # raise_server_exceptions=False: see the 500 response a real client would get, since
    # Starlette re-raises unhandled errors after answering (so that the server logs them).
    with TestClient(app, raise_server_exceptions=False) as test_client:
        yield test_client


def make_error_app() -> FastAPI:
    """Routes that exercise the error handlers' corner cases, which real routes never hit."""
    app = FastAPI()
    install_error_handlers(app)

    @app.post("/v1/by-hand")
    async def by_hand(request: Request) -> dict[str, int]:
        req = parse_request(CompletionRequest, await request.body())
        return {"n": req.n}

    @app.get("/bad-response")
    async def bad_response() -> None:
        # A pydantic error from building our own model is a server bug: 500, not 400.
        UsageInfo(prompt_tokens="many")  # type: ignore[arg-type]

    @app.get("/secret")
    async def secret() -> None:
        raise unauthorized()

    @app.get("/boom")
    async def boom() -> None:
        raise RuntimeError("a bug in the server")

    @app.get("/gone")
    async def gone() -> None:
        # What Serve raises in a handler whose client disconnected.
        raise TaskCancelledError()

    return app


@pytest.fixture(scope="module")
def error_client() -> Iterator[TestClient]:
    with TestClient(make_error_app(), raise_server_exceptions=False) as test_client:
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
    (CHAT, {"messages": OK_MSGS, "tools": [{"type": "function"}]}, 400, "tools[0].function"),
    (CHAT, {"messages": OK_MSGS, "tools": [{"type": "retrieval", "function": {"name": "f"}}]},
     400, "tools[0].type"),
    (CHAT, {"messages": OK_MSGS, "tools": [{"type": "function", "function": {"name": "a b"}}]},
     400, "tools[0].function.name"),
    (CHAT, {"messages": OK_MSGS, "tool_choice": "required"}, 400, "tool_choice"),
    (CHAT, {"messages": OK_MSGS, "tool_choice": "sometimes",
            "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tool_choice"),
    (CHAT, {"messages": [{"role": "tool", "content": "42"}]}, 400, "messages[0].tool_call_id"),
    (CHAT, {"messages": OK_MSGS, "response_format": {"type": "xml"}}, 400,
     "response_format.type"),
    (CHAT, {"messages": OK_MSGS, "response_format": {"type": "json_schema"}}, 400,
     "response_format"),
    (CHAT, {"messages": OK_MSGS, "response_format": {
        "type": "json_object", "json_schema": {"name": "x"}}}, 400, "response_format.json_schema"),
    (CMPL, {"prompt": "hi", "structured_outputs": {"regex": "a", "choice": ["a"]}}, 400,
     "structured_outputs"),
    (CMPL, {"prompt": "hi", "structured_outputs": {"choice": ["a"]}, "guided_regex": "a"}, 400,
     "structured_outputs"),
    (CMPL, {"prompt": "hi", "guided_choice": "yes"}, 400, "guided_choice"),
    # Parsed by the engine (xgrammar), not the schema: still the client's 400.
    (CHAT, {"messages": OK_MSGS, "structured_outputs": {"json": {"type": "strin"}}}, 400, None),
    (CMPL, {"prompt": "hi", "guided_grammar": "root ::= nothing"}, 400, None),
    (CMPL, {"prompt": "hi", "repetition_detection": {"max_pattern_size": 0, "min_count": 2}},
     400, "repetition_detection.max_pattern_size"),
    (CMPL, {"prompt": "hi", "repetition_detection": {"max_pattern_size": 257, "min_count": 2}},
     400, "repetition_detection.max_pattern_size"),
    (CMPL, {"prompt": "hi", "repetition_detection": {"max_pattern_size": 4, "min_count": 1}},
     400, "repetition_detection.min_count"),
    (CMPL, {"prompt": "hi", "repetition_detection": {"max_pattern_size": 4}},
     400, "repetition_detection.min_count"),
    (CMPL, {"prompt": "hi", "repetition_detection": {
        "max_pattern_size": 2, "min_pattern_size": 3, "min_count": 2}},
     400, "repetition_detection.min_pattern_size"),
    (CHAT, {"messages": OK_MSGS, "repetition_detection": {
        "max_pattern_size": 4, "min_pattern_size": 0, "min_count": 2}},
     400, "repetition_detection.min_pattern_size"),
    (CHAT, {"messages": OK_MSGS, "repetition_detection": {"max_pattern_size": "4",
                                                          "min_count": 2}},
     400, "repetition_detection.max_pattern_size"),
    (CHAT, {"messages": OK_MSGS, "repetition_detection": 3}, 400, "repetition_detection"),
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


def test_first_token_ids_that_are_not_token_ids_are_a_400_and_the_engine_serves_on(
        client: TestClient) -> None:
    for ids in ([1.5], [True], "7"):
        resp = client.post(CMPL, json={"prompt": "hi", "max_tokens": 4,
                                       "kv_transfer_params": {"first_token_ids": ids}})
        assert resp.status_code == 400, resp.text
        assert "first_token_ids" in _check_error_shape(resp.json(), 400)["message"]
    resp = client.post(CMPL, json={"prompt": "hi", "max_tokens": 4, "ignore_eos": True})
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 4


def test_hand_validated_body_errors_are_400(error_client: TestClient) -> None:
    resp = error_client.post("/v1/by-hand", content='{"prompt": "hi", "n": 99}')
    assert resp.status_code == 400
    assert _check_error_shape(resp.json(), 400)["param"] == "n"
    resp = error_client.post("/v1/by-hand", content="{oops")
    assert resp.status_code == 400
    assert _check_error_shape(resp.json(), 400)["code"] == "invalid_json"


def test_status_errors_and_server_survives_500(client: TestClient,
                                                error_client: TestClient) -> None:
    resp = error_client.get("/secret")
    assert resp.status_code == 401
    assert _check_error_shape(resp.json(), 401)["code"] == "invalid_api_key"
    resp = client.get("/no/such/route")
    assert resp.status_code == 404
    _check_error_shape(resp.json(), 404)
    resp = client.get(CMPL)
    assert resp.status_code == 405
    _check_error_shape(resp.json(), 405)
    resp = error_client.get("/boom")
    assert resp.status_code == 500
    error = _check_error_shape(resp.json(), 500)
    assert "a bug in the server" not in error["message"]  # no internals leak to the client
    assert error_client.get("/bad-response").status_code == 500
    assert client.post(CMPL, json={"prompt": "still alive"}).status_code == 200


def test_a_disconnect_is_not_logged_as_an_error(error_client: TestClient,
                                                caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG):
        resp = error_client.get("/gone")
        error_client.get("/boom")
    assert resp.status_code == 499
    errors = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(errors) == 1 and errors[0].exc_info is not None  # the bug, not the disconnect
    assert any("client disconnected" in r.getMessage() and r.levelno < logging.WARNING
               for r in caplog.records)


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


def test_repetition_detection_to_sampling_params() -> None:
    given = {"max_pattern_size": 8, "min_pattern_size": 2, "min_count": 3}
    req = CompletionRequest.model_validate({"prompt": "hi", "repetition_detection": given})
    assert req.to_sampling_params(None).repetition_detection == RepetitionDetectionParams(
        max_pattern_size=8, min_pattern_size=2, min_count=3)
    chat = ChatCompletionRequest.model_validate({
        "messages": OK_MSGS, "repetition_detection": {"max_pattern_size": 4, "min_count": 5}})
    assert chat.to_sampling_params(None).repetition_detection == RepetitionDetectionParams(
        max_pattern_size=4, min_pattern_size=1, min_count=5)
    assert CompletionRequest(prompt="hi").to_sampling_params(None).repetition_detection is None


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
        {"role": "assistant", "content": ""}, {"role": "tool", "content": "42", "tool_call_id": "t1"},
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
    cmpl = oai.completions.create(model=MODEL, prompt=["a", "b"], n=2, max_tokens=3,
                                  temperature=0, extra_body={"ignore_eos": True})
    assert [c.index for c in cmpl.choices] == [0, 1, 2, 3]
    assert cmpl.choices[0].text == cmpl.choices[1].text  # greedy: n copies agree
    assert all(c.finish_reason == "length" for c in cmpl.choices)
    assert cmpl.usage is not None and cmpl.usage.completion_tokens == 12
    chat = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=4, temperature=0)
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].finish_reason in ("stop", "length")
    [card] = oai.models.list()
    assert card.id == MODEL and card.model_extra["max_model_len"] == 512


def test_openai_client_streams_equal_whole_responses(client: TestClient) -> None:
    oai = _openai_client(client)
    kwargs = {"model": MODEL, "prompt": "a", "max_tokens": 6, "temperature": 0,
              "extra_body": {"ignore_eos": True}}
    whole = oai.completions.create(**kwargs)
    chunks = list(oai.completions.create(**kwargs, stream=True,
                                         stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6
    messages = [{"role": "user", "content": "hi"}]
    whole_chat = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=6,
                                             temperature=0)
    chat_chunks = list(oai.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=6, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chat_chunks if c.choices)
    assert text == whole_chat.choices[0].message.content
    assert chat_chunks[0].choices[0].delta.role == "assistant"
    assert chat_chunks[-2].choices[0].finish_reason == whole_chat.choices[0].finish_reason
    assert chat_chunks[-1].usage is not None
    assert chat_chunks[-1].usage.total_tokens == whole_chat.usage.total_tokens


# The embedded model loops quickly under greedy decoding: "hello hello hello" makes it say
# one token four times, then another five times, and so on.
LOOPING = {"temperature": 0, "max_tokens": 64,
           "extra_body": {"ignore_eos": True,
                          "repetition_detection": {"max_pattern_size": 3, "min_count": 4}}}


def test_repetition_stops_a_completion_with_stop_reason(client: TestClient) -> None:
    oai = _openai_client(client)
    unstopped = oai.completions.create(model=MODEL, prompt="hello hello hello", temperature=0,
                                       max_tokens=64, extra_body={"ignore_eos": True})
    assert unstopped.choices[0].finish_reason == "length"
    assert unstopped.choices[0].model_extra["stop_reason"] is None
    cmpl = oai.completions.create(model=MODEL, prompt="hello hello hello", **LOOPING)
    (choice,) = cmpl.choices
    assert choice.finish_reason == "stop"
    assert choice.model_extra["stop_reason"] == "repetition"
    assert cmpl.usage is not None and 4 <= cmpl.usage.completion_tokens < 64
    assert unstopped.choices[0].text.startswith(choice.text)
    chunks = list(oai.completions.create(model=MODEL, prompt="hello hello hello", stream=True,
                                         **LOOPING))
    assert "".join(c.choices[0].text for c in chunks) == choice.text
    last = chunks[-1].choices[0]
    assert (last.finish_reason, last.model_extra["stop_reason"]) == ("stop", "repetition")


def test_repetition_stops_a_chat_with_stop_reason(client: TestClient) -> None:
    oai = _openai_client(client)
    messages = [{"role": "user", "content": "hello hello hello"}]
    chat = oai.chat.completions.create(model=MODEL, messages=messages, **LOOPING)
    (choice,) = chat.choices
    assert (choice.finish_reason, choice.model_extra["stop_reason"]) == ("stop", "repetition")
    assert chat.usage is not None and chat.usage.completion_tokens < 64
    chunks = list(oai.chat.completions.create(model=MODEL, messages=messages, stream=True,
                                              **LOOPING))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    last = chunks[-1].choices[0]
    assert (last.finish_reason, last.model_extra["stop_reason"]) == ("stop", "repetition")


def test_stream_chunks_omit_unset_fields(client: TestClient) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
            "stream": True}
    with client.stream("POST", CHAT, json=body) as resp:
        events = [line[len("data: "):] for line in resp.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    for raw in events[:-1]:
        assert "null" not in raw, raw
    first, second = json.loads(events[0]), json.loads(events[1])
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "role" not in second["choices"][0]["delta"]


def test_a_prompt_too_long_by_its_bytes_is_refused_before_tokenizing(
        client: TestClient, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_tokenizing(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the prompt was tokenized")

    huge = "word " * 1_000_000  # 5 MB
    monkeypatch.setattr("tokenflow.replica.loading.tokenizer.Tokenizer.encode", no_tokenizing)
    for route, body in ((CMPL, {"prompt": huge}),
                        (CHAT, {"messages": [{"role": "user", "content": huge}]})):
        resp = client.post(route, json=body)
        assert resp.status_code == 400, resp.text
        error = _check_error_shape(resp.json(), 400)
        assert "max_model_len=512" in error["message"]


def test_openai_client_raises_typed_errors(client: TestClient) -> None:
    oai = _openai_client(client)
    with pytest.raises(openai.BadRequestError) as bad:
        oai.completions.create(model=MODEL, prompt="hi", temperature=3)
    assert bad.value.param == "temperature"
    assert bad.value.type == "invalid_request_error"
    with pytest.raises(openai.NotFoundError) as missing:
        oai.completions.create(model="gpt-nope", prompt="hi")
    assert missing.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as too_long:
        oai.completions.create(model=MODEL, prompt=[5] * 600)
    assert "max_model_len=512" in too_long.value.message


# ------------------------------------------------------------------- admin: pause/resume
ADMIN_KEY = "admin-test-key"
AUTH = {"Authorization": f"Bearer {ADMIN_KEY}"}
ADMIN_ROUTES = [("POST", "/pause"), ("POST", "/resume"), ("GET", "/is_paused")]


@pytest.fixture(scope="module")
def keyed_client(server: LLMServer) -> Iterator[TestClient]:
    """The same routes over the same server, behind an API key."""
    app = build_openai_app(OpenAIServing(LocalBackend(server), MODEL, api_key=ADMIN_KEY))
    with TestClient(app, raise_server_exceptions=False) as test_client:
        yield test_client


@pytest.mark.parametrize(("method", "route"), ADMIN_ROUTES)
def test_admin_routes_need_the_api_key(keyed_client: TestClient, server: LLMServer,
                                       method: str, route: str) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong-key"}):
        resp = keyed_client.request(method, route, headers=headers, params={"mode": "all"})
        assert resp.status_code == 401, resp.text
        _check_error_shape(resp.json(), 401)
    assert not server.engine.is_paused()


def test_pause_modes_status_and_resume(keyed_client: TestClient, server: LLMServer) -> None:
    try:
        resp = keyed_client.post("/pause", headers=AUTH)  # no body, no query: mode new
        assert resp.status_code == 200, resp.text
        body = resp.json()
        assert body["is_paused"] is True and len(body["replicas"]) == 1
        replica = body["replicas"][0]
        assert replica["state"] == "paused_new" and replica["replica"] is None  # not in Serve
        assert {"idle", "running", "waiting"} <= replica.keys()
        assert server.engine.is_paused()
        assert keyed_client.post("/pause?mode=all", headers=AUTH).json()[
            "replicas"][0]["state"] == "paused_all"
        assert keyed_client.post("/pause", json={"mode": "new"}, headers=AUTH).json()[
            "replicas"][0]["state"] == "paused_new"
        status = keyed_client.get("/is_paused", headers=AUTH)
        assert status.status_code == 200 and status.json()["is_paused"] is True
    finally:
        resumed = keyed_client.post("/resume", headers=AUTH)
    assert resumed.status_code == 200, resumed.text
    assert resumed.json()["is_paused"] is False
    assert resumed.json()["replicas"][0]["state"] == "unpaused"
    assert keyed_client.get("/is_paused", headers=AUTH).json()["is_paused"] is False
    resp = keyed_client.post(CMPL, json={"prompt": "hi", "max_tokens": 2}, headers=AUTH)
    assert resp.status_code == 200, resp.text


@pytest.mark.parametrize(("query", "body"), [
    ({"mode": "everything"}, None),
    ({"mode": ""}, None),
    (None, {"mode": "keep"}),
    (None, {"mode": 1}),
    (None, "{oops"),
])
def test_a_bad_pause_mode_is_400(keyed_client: TestClient, server: LLMServer,
                                 query: dict[str, str] | None, body: Any) -> None:
    content = body if isinstance(body, str) else json.dumps(body) if body else None
    resp = keyed_client.post("/pause", params=query, content=content, headers=AUTH)
    assert resp.status_code == 400, resp.text
    error = _check_error_shape(resp.json(), 400)
    assert error["param"] == (None if body == "{oops" else "mode")
    assert not server.engine.is_paused()
