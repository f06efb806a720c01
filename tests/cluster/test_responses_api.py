"""OpenAI's Responses API (`POST /v1/responses`): the formatter on scripted parser output, and
the real route in process (no Ray) on the embedded model, driven by the official `openai`
client (`client.responses.create`, its raw event stream, and its `responses.stream` helper,
which rebuilds the response from the events and so checks their order and shape).

The formatter tests plug fake reasoning and tool-call parsers into the real `ChatOutputParser`,
so reasoning, messages and function calls are all covered whatever parsers a model uses. Every
event and response is also validated against the client's own pydantic types.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Literal

import jsonschema
import openai
import pydantic
import pytest
from fastapi.testclient import TestClient
from openai.lib.streaming.responses import ResponseStreamState
from openai.types.responses import Response, ResponseStreamEvent

from tokenflow.cluster.chat_output import ChatOptions, ChatOutputParser, OutputDelta, ToolCallDelta
from tokenflow.cluster.errors import OpenAIError
from tokenflow.cluster.messages import Finished, SeqDelta
from tokenflow.cluster.openai_serving import LocalBackend, OpenAIServing, build_openai_app
from tokenflow.cluster.protocol import SSE_DONE, parse_request
from tokenflow.cluster.responses_api import ResponsesRequest
from tokenflow.cluster.responses_formatter import ResponsesFormatter
from tokenflow.cluster.server import LLMServer

MODEL = "tokenflow-tiny"
# JSON on one line: the random model would otherwise spend its budget on allowed whitespace.
ENGINE_ARGS = {"model": {"model": MODEL}, "cache": {"num_blocks": 256},
               "scheduler": {"max_model_len": 1024},
               "structured_outputs": {"disable_any_whitespace": True}}
EVENTS = pydantic.TypeAdapter(ResponseStreamEvent)


# ------------------------------------------------------------------ scripted parsers
class FakeReasoning:
    """A delta that starts with `think:` is reasoning; anything else is content."""

    def feed(self, text: str) -> tuple[str, str]:
        return (text.removeprefix("think:"), "") if text.startswith("think:") else ("", text)

    def finish(self) -> tuple[str, str]:
        return "", ""


class FakeTools:
    """`call:<name>:<args>` starts a call, `args:<more>` continues the last one; a lone `<`
    is held back (it could start a tag) until `finish`; anything else is content."""

    def __init__(self) -> None:
        self.num_calls = 0
        self._held = ""

    def feed(self, text: str) -> OutputDelta:
        if text == "<":
            self._held = text
            return OutputDelta()
        if text.startswith("call:"):
            _, name, args = text.split(":", 2)
            self.num_calls += 1
            return OutputDelta(tool_calls=[ToolCallDelta(self.num_calls - 1,
                                                         f"call_{self.num_calls}", name, args)])
        if text.startswith("args:"):
            return OutputDelta(tool_calls=[ToolCallDelta(self.num_calls - 1,
                                                         arguments=text.removeprefix("args:"))])
        return OutputDelta(content=text)

    def finish(self) -> OutputDelta:
        held, self._held = self._held, ""
        return OutputDelta(content=held)


SCRIPT = ["think:Let me ", "think:add.", "The answer", " is 3.", "\n",
          'call:add:{"a": 1', 'args:, "b": 2}', "\n", "call:mul:{}", "<"]


def formatter(stream: bool, **fields: Any) -> ResponsesFormatter:
    request = parse_request(ResponsesRequest, {"input": "hi", "stream": stream, **fields})
    return ResponsesFormatter(request, MODEL, ChatOutputParser(FakeReasoning(), FakeTools()))


def deltas(texts: list[str], finish: str = "stop") -> list[list[SeqDelta]]:
    """One batch per text, one token each; the last batch finishes the choice."""
    batches = [[SeqDelta(0, text, [i])] for i, text in enumerate(texts)]
    batches[-1][0].finish_reason = finish
    return batches


def run_stream(fmt: ResponsesFormatter, batches: list[list[SeqDelta]],
               finished: Finished) -> list[dict[str, Any]]:
    chunks = [*fmt.start_events()]
    for batch in batches:
        chunks += fmt.stream_events(batch)
    chunks += fmt.done_events(finished)
    return [parse_sse(chunk) for chunk in chunks]


def parse_sse(chunk: str) -> dict[str, Any]:
    event_line, data_line, blank = chunk.split("\n", 2)
    data = json.loads(data_line.removeprefix("data: "))
    assert event_line == f"event: {data['type']}" and blank == "\n"
    return data


RANDOM = ("id", "call_id", "item_id", "created_at", "completed_at")


def without(value: Any, keys: tuple[str, ...]) -> Any:
    """A JSON value with the fields `keys` left out, at any depth."""
    if isinstance(value, dict):
        return {k: without(v, keys) for k, v in value.items() if k not in keys}
    if isinstance(value, list):
        return [without(v, keys) for v in value]
    return value


FINISHED = Finished(prompt_tokens=7, completion_tokens=len(SCRIPT), cached_tokens=0)


def test_items_open_in_order_of_their_first_text() -> None:
    events = run_stream(formatter(True), deltas(SCRIPT), FINISHED)
    assert [e["type"].removeprefix("response.") for e in events] == [
        "created", "in_progress",
        "output_item.added", "content_part.added",                       # reasoning
        "reasoning_text.delta", "reasoning_text.delta",
        "reasoning_text.done", "content_part.done", "output_item.done",
        "output_item.added", "content_part.added",                       # message
        "output_text.delta", "output_text.delta", "output_text.delta",
        "output_text.done", "content_part.done", "output_item.done",
        "output_item.added",                                             # call add
        "function_call_arguments.delta", "function_call_arguments.delta",
        "function_call_arguments.done", "output_item.done",
        "output_item.added", "function_call_arguments.delta",            # call mul
        "function_call_arguments.done", "output_item.done",
        "output_item.added", "content_part.added", "output_text.delta",  # held back "<"
        "output_text.done", "content_part.done", "output_item.done",
        "completed"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    for event in events:
        EVENTS.validate_python(event)  # the client's own types take every event
    final = Response.model_validate(events[-1]["response"])
    assert final.status == "completed" and final.usage is not None
    assert [item.type for item in final.output] == [
        "reasoning", "message", "function_call", "function_call", "message"]
    reasoning, message, add, mul, tail = final.output
    assert reasoning.content is not None and reasoning.content[0].text == "Let me add."
    assert message.content[0].text == "The answer is 3.\n"
    assert (add.name, add.call_id, json.loads(add.arguments)) == ("add", "call_1",
                                                                   {"a": 1, "b": 2})
    assert (mul.name, mul.arguments) == ("mul", "{}")
    # The line break after the first call opened no message of its own: it leads the next.
    assert tail.content[0].text == "\n<"
    assert final.output_text == "The answer is 3.\n\n<"
    assert all(item.status == "completed" for item in final.output)
    # Each item's events point at it, and its deltas add up to its final text.
    for index, item in enumerate(final.output):
        mine = [e for e in events if e.get("output_index") == index]
        assert {e.get("item_id", e.get("item", {}).get("id")) for e in mine} == {item.id}
        text = "".join(e["delta"] for e in mine if e["type"].endswith(".delta"))
        assert text == (item.arguments if item.type == "function_call"
                        else item.content[0].text)


def test_the_stream_helper_rebuilds_the_final_response() -> None:
    """The client's `responses.stream` state machine accepts the events (it checks that items
    are added before their content and done before the response completes)."""
    events = run_stream(formatter(True), deltas(SCRIPT), FINISHED)
    state = ResponseStreamState(input_tools=openai.omit, text_format=openai.omit)
    for event in events:
        state.handle_event(EVENTS.validate_python(event))
    rebuilt = state._completed_response
    assert rebuilt is not None
    # The helper's parsed response adds `parsed` fields (None here: no text_format).
    assert without(rebuilt.model_dump(), ("parsed", "parsed_arguments")) == \
        Response.model_validate(events[-1]["response"]).model_dump()


def test_a_whole_response_equals_the_streamed_one() -> None:
    whole = formatter(False)
    for batch in deltas(SCRIPT):
        whole.add(batch)
        assert whole.stream_events([]) == []  # a whole response emits no events
    body = json.loads(whole.response(FINISHED).model_dump_json())
    streamed = run_stream(formatter(True), deltas(SCRIPT), FINISHED)[-1]["response"]
    assert without(body, RANDOM) == without(streamed, RANDOM)
    Response.model_validate(body)


def test_reasoning_tokens_are_those_before_the_answer() -> None:
    fmt = formatter(False)
    batches = [[SeqDelta(0, "think:a", [1, 2])], [SeqDelta(0, "think:b", [3])],
               [SeqDelta(0, "answer", [4, 5], finish_reason="stop")]]
    for batch in batches:
        fmt.add(batch)
    usage = fmt.response(Finished(prompt_tokens=3, completion_tokens=5, cached_tokens=2)).usage
    assert usage is not None
    assert (usage.input_tokens, usage.output_tokens, usage.total_tokens) == (3, 5, 8)
    assert usage.input_tokens_details.cached_tokens == 2
    assert usage.output_tokens_details.reasoning_tokens == 3


def test_a_cut_output_is_incomplete() -> None:
    events = run_stream(formatter(True, max_output_tokens=3),
                        deltas(["think:hm", "The", " answer"], finish="length"), FINISHED)
    final = Response.model_validate(events[-1]["response"])
    assert events[-1]["type"] == "response.incomplete"
    assert final.status == "incomplete" and final.incomplete_details is not None
    assert final.incomplete_details.reason == "max_output_tokens"
    assert final.max_output_tokens == 3
    # The item that was cut is incomplete; the one before it had finished.
    assert [item.status for item in final.output] == ["completed", "incomplete"]


def test_an_engine_failure_fails_the_response() -> None:
    fmt = formatter(True)
    chunks = [*fmt.start_events(), *fmt.stream_events([SeqDelta(0, "The", [1])])]
    failed = fmt.stream_events([SeqDelta(0, "", [], finish_reason="error", error="boom")])
    assert failed[-1] == SSE_DONE  # `_sse` ends the stream at the marker
    event = parse_sse(failed[0])
    assert event["type"] == "response.failed"
    assert event["sequence_number"] == len(chunks)
    final = Response.model_validate(event["response"])
    assert final.status == "failed" and final.error is not None
    assert "boom" in final.error.message and final.error.code == "server_error"
    assert final.output[0].status == "incomplete"
    whole = formatter(False)
    whole.add([SeqDelta(0, "x", [1], finish_reason="error", error="boom")])
    with pytest.raises(OpenAIError) as exc:
        whole.response(FINISHED)
    assert exc.value.status_code == 500


def test_a_broken_backend_sends_an_error_then_failed() -> None:
    fmt = formatter(True)
    fmt.start_events()
    chunk = fmt.error_event(RuntimeError("lost"))
    error, failed = (parse_sse(part + "\n\n") for part in chunk.strip().split("\n\n"))
    assert (error["type"], failed["type"]) == ("error", "response.failed")
    assert (error["sequence_number"], failed["sequence_number"]) == (2, 3)
    EVENTS.validate_python(error)
    assert Response.model_validate(failed["response"]).status == "failed"


def test_input_items_become_chat_messages() -> None:
    request = parse_request(ResponsesRequest, {"instructions": "Be brief.", "input": [
        {"role": "user", "content": "What is 1 + 2?"},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Let me add.", "annotations": []}]},
        {"type": "function_call", "call_id": "call_1", "name": "add",
         "arguments": '{"a": 1, "b": 2}'},
        {"type": "function_call", "call_id": "call_2", "name": "log", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "3"},
        {"type": "function_call_output", "call_id": "call_2",
         "output": [{"type": "input_text", "text": "ok"}]},
        {"role": "developer", "content": [{"type": "input_text", "text": "a"},
                                          {"type": "input_text", "text": "b"}]},
        {"type": "function_call", "call_id": "call_3", "name": "log", "arguments": "{}"}]})
    call = {"type": "function", "function": {"name": "log", "arguments": {}}}
    assert request.chat_messages() == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 1 + 2?"},
        {"role": "assistant", "content": "Let me add.", "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "add", "arguments": {"a": 1, "b": 2}}},
            {"id": "call_2", **call}]},
        {"role": "tool", "content": "3", "tool_call_id": "call_1"},
        {"role": "tool", "content": "ok", "tool_call_id": "call_2"},
        {"role": "developer", "content": "a\nb"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "call_3", **call}]}]


# ------------------------------------------------------------------- the real route
@pytest.fixture(scope="module")
def server() -> Iterator[LLMServer]:
    llm_server = LLMServer(ENGINE_ARGS)
    yield llm_server
    llm_server.engine.shutdown()


@contextmanager
def serving_app(server: LLMServer, chat: ChatOptions | None = None) -> Iterator[TestClient]:
    """The OpenAI app over `server`, with these chat options."""
    serving = OpenAIServing(LocalBackend(server), MODEL, chat=chat)
    with TestClient(build_openai_app(serving), raise_server_exceptions=False) as http:
        yield http


def openai_client(http: TestClient) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{http.base_url}/v1", api_key="test", http_client=http,
                         max_retries=0)


@pytest.fixture(scope="module")
def http(server: LLMServer) -> Iterator[TestClient]:
    with serving_app(server) as test_client:
        yield test_client


@pytest.fixture(scope="module")
def client(http: TestClient) -> openai.OpenAI:
    return openai_client(http)


MESSAGES = [{"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "what now?"}]
INSTRUCTIONS = "Be brief."
GREEDY = {"model": MODEL, "temperature": 0, "max_output_tokens": 8}


def prompt_length(http: TestClient, messages: list[dict[str, str]]) -> int:
    resp = http.post("/tokenize", json={"model": MODEL, "messages": messages})
    assert resp.status_code == 200, resp.text
    return resp.json()["count"]


def test_a_string_input(client: openai.OpenAI, http: TestClient) -> None:
    response = client.responses.create(input="hi", **GREEDY)
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.output_text
    assert [item.type for item in response.output] == ["message"]
    assert response.usage is not None
    assert response.usage.input_tokens == prompt_length(http, [{"role": "user",
                                                                "content": "hi"}])
    # Random weights never stop by themselves this soon: max_output_tokens cuts the output.
    assert response.usage.output_tokens == 8
    assert response.status == "incomplete" and response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.output[0].status == "incomplete"
    assert response.model_extra["store"] is False  # accepted, and nothing was kept


def test_messages_and_instructions_give_the_chat_completion(client: openai.OpenAI,
                                                            http: TestClient) -> None:
    input_items = [MESSAGES[0],
                   {"type": "message", "role": "assistant",
                    "content": [{"type": "output_text", "text": "hello"}]},
                   {"role": "user", "content": [{"type": "input_text", "text": "what now?"}]}]
    response = client.responses.create(input=input_items, instructions=INSTRUCTIONS, **GREEDY)
    conversation = [{"role": "system", "content": INSTRUCTIONS}, *MESSAGES]
    chat = client.chat.completions.create(model=MODEL, messages=conversation, temperature=0,
                                          max_tokens=8)
    assert response.output_text and response.output_text == chat.choices[0].message.content
    assert response.instructions == INSTRUCTIONS
    assert response.usage is not None and chat.usage is not None
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.input_tokens == prompt_length(http, conversation)


def test_the_raw_event_stream(client: openai.OpenAI) -> None:
    whole = client.responses.create(input=MESSAGES, **GREEDY)
    events = list(client.responses.create(input=MESSAGES, stream=True, **GREEDY))
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.incomplete"]
    assert set(types[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert text == final.output_text == whole.output_text
    assert final.usage is not None and final.usage.output_tokens == 8
    assert events[0].response.id == final.id and final.status == "incomplete"


def test_the_wire_format(http: TestClient) -> None:
    """Each event names its type on an `event:` line, as OpenAI's do; no `[DONE]` at the end."""
    body = {"model": MODEL, "input": "hi", "stream": True, "max_output_tokens": 3}
    with http.stream("POST", "/v1/responses", json=body) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in resp.iter_lines() if line]
    for event_line, data_line in zip(lines[::2], lines[1::2], strict=True):
        data = json.loads(data_line.removeprefix("data: "))
        assert event_line == f"event: {data['type']}"
    assert json.loads(lines[-1].removeprefix("data: "))["type"] == "response.incomplete"


class Answer(pydantic.BaseModel):
    answer: Literal["yes", "no"]
    sure: bool


def test_json_schema_through_the_stream_helper(client: openai.OpenAI) -> None:
    """`text_format=Answer`: the helper sends Answer's strict JSON schema as `text.format`,
    rebuilds the response from the events, and parses the text back into an Answer."""
    with client.responses.stream(input="Is it? Answer in JSON.", text_format=Answer,
                                 model=MODEL, temperature=0, max_output_tokens=60) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.status == "completed"  # the grammar ended the output
    assert isinstance(final.output_parsed, Answer)
    assert "".join(deltas) == final.output_text
    assert final.text is not None and final.text.format is not None
    assert final.text.format.type == "json_schema"


def test_text_format_json_schema(client: openai.OpenAI) -> None:
    schema = {"type": "object", "additionalProperties": False, "required": ["city", "rank"],
              "properties": {"city": {"type": "string", "maxLength": 8},
                             "rank": {"type": "integer", "minimum": 1, "maximum": 9}}}
    response = client.responses.create(
        input="A city as JSON.", model=MODEL, temperature=0, max_output_tokens=60,
        text={"format": {"type": "json_schema", "name": "city", "schema": schema,
                         "strict": True}})
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), schema)
    plain = client.responses.create(input="A city as JSON.", model=MODEL, temperature=0,
                                    max_output_tokens=60)
    assert plain.output_text != response.output_text  # the constraint made the difference


WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "additionalProperties": False,
                          "required": ["city"],
                          "properties": {"city": {"enum": ["Paris", "Tokyo"]}}}}


@pytest.fixture(scope="module")
def tools_client(server: LLMServer) -> Iterator[openai.OpenAI]:
    """The same server with a chat template that shows tools to the model."""
    with serving_app(server, ChatOptions(chat_template="smollm2-tools")) as http:
        yield openai_client(http)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "get_weather"}])
def test_function_calls_and_their_outputs(tools_client: openai.OpenAI,
                                          choice: str | dict[str, str]) -> None:
    asked = [{"role": "user", "content": "Weather in Paris?"}]
    response = tools_client.responses.create(
        input=asked, tools=[WEATHER], tool_choice=choice, parallel_tool_calls=False,
        model=MODEL, temperature=0, max_output_tokens=60)
    assert response.status == "completed"
    [call] = response.output
    assert call.type == "function_call" and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    assert response.tools[0].type == "function" and response.tools[0].name == "get_weather"
    with tools_client.responses.stream(
            input=asked, tools=[WEATHER], tool_choice=choice, parallel_tool_calls=False,
            model=MODEL, temperature=0, max_output_tokens=60) as stream:
        streamed = stream.get_final_response()
    [streamed_call] = streamed.output
    assert streamed_call.type == "function_call"
    assert (streamed_call.name, streamed_call.arguments) == (call.name, call.arguments)
    # The client runs the function and sends the call and its output back.
    follow_up = [*asked, call.model_dump(exclude_none=True),
                 {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}]
    answer = tools_client.responses.create(input=follow_up, tools=[WEATHER], model=MODEL,
                                           temperature=0, max_output_tokens=4)
    assert answer.usage is not None and response.usage is not None
    assert answer.usage.input_tokens > response.usage.input_tokens
    assert [item.type for item in answer.output] == ["message"]


def test_reasoning_comes_back_as_a_reasoning_item(server: LLMServer,
                                                  client: openai.OpenAI) -> None:
    """`deepseek_r1` takes output without a `</think>` for reasoning cut off mid-thought,
    which is all the random model ever writes."""
    plain = client.responses.create(input="hi", **GREEDY)
    with serving_app(server, ChatOptions(reasoning_parser="deepseek_r1")) as http:
        response = openai_client(http).responses.create(input="hi", **GREEDY)
    [reasoning] = response.output
    assert reasoning.type == "reasoning" and reasoning.content is not None
    assert reasoning.content[0].text == plain.output_text
    assert response.output_text == ""
    assert response.usage is not None
    assert 0 < response.usage.output_tokens_details.reasoning_tokens <= 8


# (body, param) pairs that must be a 400 naming the param
BAD_REQUESTS: list[tuple[dict[str, Any], str | None]] = [
    ({"input": "hi", "previous_response_id": "resp_123"}, "previous_response_id"),
    ({"input": "hi", "conversation": "conv_123"}, "conversation"),
    ({"input": 42}, "input"),
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "input[0]"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ({"input": [{"type": "function_call", "call_id": "c", "arguments": "{}"}]},
     "input[0].name"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "hi", "tools": [{**WEATHER, "name": "get weather"}]}, "tools[0].name"),
    ({"input": "hi", "tools": [WEATHER], "tool_choice": {"type": "web_search_preview"}},
     "tool_choice"),
    ({"input": "hi", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "x"}},
     "tool_choice"),
    ({"input": "hi", "background": True}, "background"),
    ({"input": "hi", "truncation": "auto"}, "truncation"),
    ({"input": "hi", "include": ["message.output_text.logprobs"]}, "include"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "hi", "temperature": 3}, "temperature"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
    ({"input": "hi", "tools": [WEATHER], "tool_choice": "required",
      "text": {"format": {"type": "json_object"}}}, "text.format"),
]


@pytest.mark.parametrize(("body", "param"), BAD_REQUESTS)
def test_bad_requests_are_400s_that_name_the_param(http: TestClient, body: dict[str, Any],
                                                   param: str | None) -> None:
    resp = http.post("/v1/responses", json={"model": MODEL, **body})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error


def test_the_client_sees_typed_errors(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model=MODEL, input="hi", previous_response_id="resp_123")
    assert refused.value.param == "previous_response_id"
    assert "not stored" in refused.value.message
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="gpt-nope", input="hi")
