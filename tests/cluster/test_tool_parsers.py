"""Tool calling without a model: the parsers (whole text and every way of streaming it agree),
the request checks of `plan_tools`, and the shipped `smollm2-tools` template."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tokenflow.cluster.chat_output import ChatOutputParser, OutputDelta
from tokenflow.cluster.errors import OpenAIError
from tokenflow.cluster.prompts import read_chat_template
from tokenflow.cluster.reasoning import reasoning_parser
from tokenflow.cluster.tool_parsers import (
    CallArrayParser,
    NamedCallParser,
    tool_parser,
)
from tokenflow.cluster.tools import ChatTool, NamedToolChoice, plan_tools
from tokenflow.replica.loading.resolve import load_tokenizer


def parse(make: Any, pieces: list[str]) -> tuple[str, list[dict[str, str]], list[OutputDelta]]:
    """Feed `pieces` to a new parser; returns the content, the joined calls and the deltas."""
    parser = make()
    deltas = [parser.feed(p) for p in pieces] + [parser.finish()]
    content = "".join(d.content for d in deltas)
    calls: dict[int, dict[str, str]] = {}
    for d in deltas:
        for piece in d.tool_calls:
            if piece.index not in calls:
                assert piece.id is not None and piece.id.startswith("call_")
                assert piece.name is not None, "a call's first piece has its name"
                calls[piece.index] = {"name": piece.name, "arguments": ""}
            else:
                assert piece.id is None and piece.name is None
            calls[piece.index]["arguments"] += piece.arguments
    assert list(calls) == list(range(len(calls)))
    assert parser.num_calls == len(calls)
    return content, [calls[i] for i in sorted(calls)], deltas


def splits(text: str) -> list[list[str]]:
    """The text whole, cut at every point in two, and one character at a time."""
    return [[text], *([text[:i], text[i:]] for i in range(1, len(text))), list(text)]


def assert_split_invariant(make: Any, text: str) -> tuple[str, list[dict[str, str]]]:
    whole = parse(make, [text])[:2]
    for pieces in splits(text):
        assert parse(make, pieces)[:2] == whole, pieces
    return whole


HERMES_TWO_CALLS = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": '
                    '{"city": "Paris \\"centre\\" {"}}\n</tool_call>\n<tool_call>\n'
                    '{"arguments": {"tz": ["a", 1]}, "name": "get_time"}\n</tool_call>\n')


def test_hermes_finds_calls_and_keeps_the_text_around_them() -> None:
    content, calls = assert_split_invariant(lambda: tool_parser("hermes"), HERMES_TWO_CALLS)
    assert content == "Let me look.\n"  # the layout between and after calls is dropped
    assert calls == [{"name": "get_weather", "arguments": '{"city": "Paris \\"centre\\" {"}'},
                     {"name": "get_time", "arguments": '{"tz": ["a", 1]}'}]
    assert json.loads(calls[0]["arguments"]) == {"city": 'Paris "centre" {'}


def test_hermes_streams_the_name_first_then_argument_fragments() -> None:
    _, _, deltas = parse(lambda: tool_parser("hermes"), list(HERMES_TWO_CALLS))
    pieces = [p for d in deltas for p in d.tool_calls]
    assert pieces[0].name == "get_weather" and pieces[0].arguments == ""
    # The arguments arrive in pieces as the text does, not all at the end.
    assert sum(1 for p in pieces if p.index == 0 and p.arguments) > 5
    # A call whose arguments come before its name sends them with the name.
    second = [p for p in pieces if p.index == 1]
    assert second[0].name == "get_time" and second[0].arguments == '{"tz": ["a", 1]}'


@pytest.mark.parametrize("text", [
    "no call at all < tool_call >",
    "<tool_call>not json</tool_call> after",
    '<tool_call>{"arguments": {}}</tool_call>',  # no name: not a call
    "ends inside a tag <tool_ca",
])
def test_hermes_gives_back_what_is_not_a_call_as_content(text: str) -> None:
    content, calls = assert_split_invariant(lambda: tool_parser("hermes"), text)
    assert calls == [] and content == text


def test_hermes_keeps_a_call_cut_off_by_max_tokens() -> None:
    content, calls = assert_split_invariant(
        lambda: tool_parser("hermes"), 'Sure <tool_call>{"name": "f", "arguments": {"x": 1')
    assert content == "Sure " and calls == [{"name": "f", "arguments": '{"x": 1'}]


def test_hermes_call_without_arguments_gets_an_empty_object() -> None:
    assert assert_split_invariant(lambda: tool_parser("hermes"),
                                  '<tool_call>{"name": "now"}</tool_call>') == (
        "", [{"name": "now", "arguments": "{}"}])


def test_llama3_json_parser() -> None:
    text = '<|python_tag|>{"name": "f", "parameters": {"q": "a;b"}}; {"name": "g", "parameters": {}}'
    assert assert_split_invariant(lambda: tool_parser("llama3_json"), text) == (
        "", [{"name": "f", "arguments": '{"q": "a;b"}'}, {"name": "g", "arguments": "{}"}])
    for plain in ("Hello {there}", ' {"name": 1} is not a call'):
        assert assert_split_invariant(lambda: tool_parser("llama3_json"), plain) == (plain, [])


def test_constrained_output_parsers() -> None:
    array = '[{"name": "f", "arguments": {"a": "]"}}, {"name": "g", "arguments": {}}]'
    assert assert_split_invariant(CallArrayParser, array)[1] == [
        {"name": "f", "arguments": '{"a": "]"}'}, {"name": "g", "arguments": "{}"}]
    assert assert_split_invariant(lambda: NamedCallParser("f"), '{"x": 1}') == (
        "", [{"name": "f", "arguments": '{"x": 1}'}])
    assert parse(lambda: NamedCallParser("f"), [])[1] == [{"name": "f", "arguments": "{}"}]


def test_reasoning_comes_off_before_the_tool_parser_sees_the_text() -> None:
    text = '<think>call it</think>\n<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    for pieces in splits(text):
        parser = ChatOutputParser(reasoning_parser("qwen3"), tool_parser("hermes"))
        out = OutputDelta()
        for p in pieces:
            out.extend(parser.feed(p))
        out.extend(parser.finish())
        assert out.reasoning == "call it" and out.content == "\n"
        assert [(c.name, c.arguments) for c in out.tool_calls] == [("f", "{}")]


def test_unknown_parser_name() -> None:
    with pytest.raises(ValueError, match="hermes, llama3_json"):
        tool_parser("mistral")


# ------------------------------------------------------------------------- the request
def tool(name: str, parameters: dict[str, Any] | None = None) -> ChatTool:
    function: dict[str, Any] = {"name": name}
    if parameters is not None:
        function["parameters"] = parameters
    return ChatTool.model_validate({"type": "function", "function": function})


CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def test_plan_tools_modes() -> None:
    tools = [tool("get_weather", CITY), tool("now")]
    auto = plan_tools(tools, None, True, "hermes")  # OpenAI's default with tools
    assert auto.mode == "auto" and auto.constraint is None
    assert [t["function"]["name"] for t in auto.template_tools or []] == ["get_weather", "now"]
    none = plan_tools(tools, "none", True, "hermes")
    assert none.template_tools is None and none.output_parser() is None
    required = plan_tools(tools, "required", False, "hermes")
    schema = json.loads(required.constraint.json)  # type: ignore[union-attr]
    assert schema["maxItems"] == 1 and schema["minItems"] == 1
    assert [c["properties"]["arguments"] for c in schema["items"]["anyOf"]] == [
        CITY, {"type": "object"}]
    named = plan_tools(tools, NamedToolChoice.model_validate(
        {"type": "function", "function": {"name": "get_weather"}}), True, "hermes")
    assert json.loads(named.constraint.json) == CITY  # type: ignore[union-attr]
    assert isinstance(named.output_parser(), NamedCallParser)


@pytest.mark.parametrize(("tools", "choice", "param", "message"), [
    ([tool("f", {"type": "object", "properties": 3})], "auto", "tools", "not a valid JSON"),
    ([tool("f", {"type": "string"})], "auto", "tools", "must describe an object"),
    ([tool("f"), tool("f")], "auto", "tools", "distinct"),
    ([tool("f")], {"type": "function", "function": {"name": "g"}}, "tool_choice",
     "not in tools"),
    (None, "required", "tool_choice", "needs tools"),
])
def test_plan_tools_refuses(tools: list[ChatTool] | None, choice: Any, param: str,
                            message: str) -> None:
    if isinstance(choice, dict):
        choice = NamedToolChoice.model_validate(choice)
    with pytest.raises(OpenAIError, match=message) as info:
        plan_tools(tools, choice, True, "hermes")
    assert info.value.status_code == 400 and info.value.param == param


# ----------------------------------------------------------------------- the template
def test_smollm2_tools_template_renders_plain_chats_as_the_models_own() -> None:
    own = load_tokenizer("smollm2-135m-instruct")
    assert not own.template_takes_tools
    ours = type(own).__new__(type(own))
    ours.__dict__.update(own.__dict__)
    ours.use_chat_template(read_chat_template("smollm2-tools"))
    assert ours.template_takes_tools
    for chat in ([{"role": "user", "content": "hi"}],
                 [{"role": "system", "content": "S"}, {"role": "user", "content": "a"},
                  {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]):
        for prompt in (True, False):
            assert ours.apply_chat_template(chat, prompt) == own.apply_chat_template(chat, prompt)
    chat = [{"role": "user", "content": "Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "c1", "type": "function",
                 "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    text = ours.apply_chat_template(chat, True, tools=[tool("get_weather", CITY).model_dump()])
    assert '"name": "get_weather"' in text.split("<tools>\n")[1].split("</tools>")[0]
    assert ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            '</tool_call><|im_end|>') in text
    assert text.endswith("<tool_response>\nsunny\n</tool_response><|im_end|>\n"
                         "<|im_start|>assistant\n")


def test_unknown_chat_template_names_the_shipped_ones() -> None:
    with pytest.raises(ValueError, match="smollm2-tools"):
        read_chat_template("no-such-template")
