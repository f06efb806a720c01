"""Tool calling through the chat API, in process (no Ray), on the default model (SmolLM2) with
the shipped `smollm2-tools` template, driven by the official `openai` client.

`required` and a named function are constrained: whatever the model, every call is valid
JSON whose arguments validate against the function's schema. `auto` lets the model write;
to check the parser on real engine output (tokens split the text wherever they fall), the
`auto` tests force the model's text into the Hermes (or Llama 3 JSON) shape with a regex.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest
from fastapi.testclient import TestClient

from tokenflow.cluster.chat_output import ChatOptions
from tokenflow.cluster.openai_serving import LocalBackend, OpenAIServing, build_openai_app
from tokenflow.cluster.server import LLMServer

MODEL = "smollm2-135m-instruct"
ENGINE_ARGS = {"model": {"model": MODEL}, "cache": {"num_blocks": 256},
               "scheduler": {"max_model_len": 2048}}
WEATHER_SCHEMA = {"type": "object",
                  "properties": {"city": {"type": "string"},
                                 "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                  "required": ["city"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_SCHEMA,
                                      "description": "The current weather in a city"}},
    {"type": "function", "function": {"name": "get_time",
                                      "description": "The current time in a time zone",
                                      "parameters": {"type": "object",
                                                     "properties": {"tz": {"type": "string"}},
                                                     "required": ["tz"]}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]


@pytest.fixture(scope="module")
def server() -> Iterator[LLMServer]:
    llm_server = LLMServer(ENGINE_ARGS)
    yield llm_server
    llm_server.engine.shutdown()


def client_for(server: LLMServer, chat: ChatOptions | None) -> Iterator[openai.OpenAI]:
    app = build_openai_app(OpenAIServing(LocalBackend(server), MODEL, chat=chat))
    with TestClient(app, raise_server_exceptions=False) as http:
        yield openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http,
                            max_retries=0)


@pytest.fixture(scope="module")
def client(server: LLMServer) -> Iterator[openai.OpenAI]:
    yield from client_for(server, ChatOptions(chat_template="smollm2-tools"))


@pytest.fixture(scope="module")
def plain_template_client(server: LLMServer) -> Iterator[openai.OpenAI]:
    yield from client_for(server, None)  # SmolLM2's own template, which takes no tools


@pytest.fixture(scope="module")
def llama3_json_client(server: LLMServer) -> Iterator[openai.OpenAI]:
    yield from client_for(server, ChatOptions(chat_template="smollm2-tools",
                                              tool_call_parser="llama3_json"))


def create(client: openai.OpenAI, **kwargs: Any) -> Any:
    args = {"model": MODEL, "messages": ASK, "tools": TOOLS, "temperature": 0,
            "max_tokens": 96, **kwargs}
    return client.chat.completions.create(**args)


def streamed(client: openai.OpenAI, **kwargs: Any) -> tuple[str, list[dict[str, Any]], str]:
    """A streamed completion joined up: its content, its calls (checking that each call's
    first chunk has the id and name and the later ones only argument fragments), and the
    finish reason."""
    content, calls, finish = "", [], None
    for chunk in create(client, stream=True, **kwargs):
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for piece in choice.delta.tool_calls or []:
            if piece.index == len(calls):
                assert piece.id and piece.type == "function" and piece.function.name
                calls.append({"id": piece.id, "name": piece.function.name,
                              "arguments": piece.function.arguments or ""})
            else:
                assert piece.index == len(calls) - 1, "calls stream one after another"
                assert piece.id is None and piece.function.name is None
                calls[-1]["arguments"] += piece.function.arguments
        finish = choice.finish_reason or finish
    return content, calls, finish


def valid_calls(calls: list[Any]) -> list[tuple[str, dict[str, Any]]]:
    """Each call's name and parsed arguments, after checking them against its schema."""
    out = []
    for call in calls:
        name = call["name"] if isinstance(call, dict) else call.function.name
        text = call["arguments"] if isinstance(call, dict) else call.function.arguments
        arguments = json.loads(text)
        jsonschema.validate(arguments, SCHEMAS[name])
        out.append((name, arguments))
    return out


@pytest.mark.parametrize("parallel", [True, False])
def test_required_always_gives_valid_calls_streamed_or_not(client: openai.OpenAI,
                                                           parallel: bool) -> None:
    whole = create(client, tool_choice="required", parallel_tool_calls=parallel)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = valid_calls(choice.message.tool_calls)
    assert calls and (parallel or len(calls) == 1)
    assert len({c.id for c in choice.message.tool_calls}) == len(calls)
    content, pieces, finish = streamed(client, tool_choice="required",
                                       parallel_tool_calls=parallel)
    assert finish == "tool_calls" and content == ""
    assert valid_calls(pieces) == calls  # greedy: the same calls, in pieces


def test_a_named_function_is_the_one_called(client: openai.OpenAI) -> None:
    # A question the named function fits: forced to call get_time about the weather, the
    # model rambles in the string (the grammar allows any string) past max_tokens.
    ask = [{"role": "user", "content": "What time is it in Paris right now?"}]
    choice = {"type": "function", "function": {"name": "get_time"}}
    whole = create(client, messages=ask, tool_choice=choice).choices[0]
    assert whole.finish_reason == "tool_calls"
    assert [name for name, _ in valid_calls(whole.message.tool_calls)] == ["get_time"]
    _, pieces, finish = streamed(client, messages=ask, tool_choice=choice)
    assert finish == "tool_calls"
    assert valid_calls(pieces) == valid_calls(whole.message.tool_calls)


def test_call_then_tool_result_then_answer(client: openai.OpenAI) -> None:
    """The agent loop: the model calls, the caller runs the tool and sends the result back
    with the call's id, and the model answers in text (`tool_choice: none`)."""
    first = create(client, tool_choice={"type": "function",
                                        "function": {"name": "get_weather"}}).choices[0].message
    call = first.tool_calls[0]
    conversation = [*ASK, first.model_dump(exclude_none=True),
                    {"role": "tool", "tool_call_id": call.id,
                     "content": json.dumps({"temperature_c": 21, "sky": "sunny"})}]
    answer = create(client, messages=conversation, tool_choice="none", max_tokens=48)
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls
    assert answer.choices[0].finish_reason in ("stop", "length")
    # The result reached the prompt: the same turn without it is shorter.
    without = create(client, messages=conversation[:-1] + [
        {"role": "tool", "tool_call_id": call.id, "content": ""}], tool_choice="none",
        max_tokens=1)
    assert answer.usage.prompt_tokens > without.usage.prompt_tokens
    # With auto, the tools are in the prompt too, and whatever the model writes is a valid
    # answer: text, or calls that parse.
    again = create(client, messages=conversation, tool_choice="auto", max_tokens=48).choices[0]
    assert again.message.content or valid_calls(again.message.tool_calls)


HERMES_CALL = (r'Let me check\.\n<tool_call>\n\{"name": "get_weather", "arguments": '
               r'\{"city": "(Paris|Lyon)"\}\}\n</tool_call>')


def test_auto_parses_hermes_calls_out_of_the_model_text(client: openai.OpenAI) -> None:
    forced = {"tool_choice": "auto",
              "extra_body": {"structured_outputs": {"regex": HERMES_CALL}}}
    whole = create(client, **forced).choices[0]
    assert whole.finish_reason == "tool_calls"
    assert whole.message.content == "Let me check."
    [(name, arguments)] = valid_calls(whole.message.tool_calls)
    assert name == "get_weather" and arguments["city"] in ("Paris", "Lyon")
    content, pieces, finish = streamed(client, **forced)
    assert content == "Let me check.\n" and finish == "tool_calls"
    assert valid_calls(pieces) == [(name, arguments)]
    # The same output without tools is just text: the parser made the difference.
    raw = create(client, tools=None, extra_body=forced["extra_body"]).choices[0]
    assert re.fullmatch(HERMES_CALL, raw.message.content) and not raw.message.tool_calls


def test_auto_without_a_call_is_plain_text(client: openai.OpenAI) -> None:
    whole = create(client, tool_choice="auto", max_tokens=24,
                   extra_body={"structured_outputs": {"regex": "Paris is [a-z ]{3,30}"}})
    message = whole.choices[0].message
    assert message.content.startswith("Paris is") and not message.tool_calls
    assert whole.choices[0].finish_reason != "tool_calls"


def test_a_second_parser_plugs_in_by_name(llama3_json_client: openai.OpenAI) -> None:
    forced = {"tool_choice": "auto", "extra_body": {"structured_outputs": {
        "regex": r'\{"name": "get_time", "parameters": \{"tz": "Europe/(Paris|Rome)"\}\}'}}}
    whole = create(llama3_json_client, **forced).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content is None
    [(name, arguments)] = valid_calls(whole.message.tool_calls)
    assert name == "get_time" and arguments["tz"].startswith("Europe/")
    _, pieces, _ = streamed(llama3_json_client, **forced)
    assert valid_calls(pieces) == [(name, arguments)]


@pytest.mark.parametrize(("kwargs", "param", "message"), [
    ({"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"x": {"type": 7}}}}}]},
     "tools", "not a valid JSON schema"),
    ({"tool_choice": {"type": "function", "function": {"name": "book_flight"}}},
     "tool_choice", "book_flight"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "one output constraint"),
])
def test_bad_tools_are_a_400(client: openai.OpenAI, kwargs: dict[str, Any], param: str,
                             message: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        create(client, **kwargs)
    assert info.value.body["param"] == param and message in info.value.body["message"]


def test_a_template_without_tools_is_a_400(plain_template_client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        create(plain_template_client)
    assert info.value.body["param"] == "tools"
    assert "engine.chat_template" in info.value.body["message"]
    # tool_choice none hides the tools from the template: that works with any template.
    assert create(plain_template_client, tool_choice="none", max_tokens=4).choices[0]
