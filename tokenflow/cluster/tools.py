"""Tool calling at the edge: the request's `tools` and `tool_choice`, checked; and what they
make of a chat request (`ToolPlan`): the tool definitions the chat template renders, the
output constraint, and the parser that turns the output into tool calls.

- `none` (or no tools): plain text; tools are still shown to the template unless `none`.
- `auto`: the model chooses; the configured parser (tokenflow/cluster/tool_parsers.py) finds
  calls in its text (`engine.tool_call_parser`).
- `required`: the output is constrained (xgrammar, through the structured-output path) to a
  JSON array of `{"name", "arguments"}` objects, one per call, whose arguments follow the
  named function's schema; `parallel_tool_calls: false` allows one call.
- a named function: the output is constrained to that function's arguments object.
Constrained output is JSON of OpenAI's own shape, not a model's tool-call format, so it works
with any template (vLLM does the same).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from jsonschema import exceptions as schema_errors
from jsonschema import validators
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr

from tokenflow.cluster.chat_output import ToolParser
from tokenflow.cluster.errors import bad_request
from tokenflow.cluster.tool_parsers import CallArrayParser, NamedCallParser, tool_parser
from tokenflow.scheduler.sampling_params import StructuredOutputsParams

# OpenAI's rule for function names.
FUNCTION_NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"
_ANY_OBJECT: dict[str, Any] = {"type": "object"}


class StrictRequest(BaseModel):
    # The same rule as the other request models (cluster/protocol.py): unknown fields ignored.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class FunctionDefinition(StrictRequest):
    """A function the model may call: its name, what it does, its arguments' JSON schema."""

    name: StrictStr = Field(pattern=FUNCTION_NAME_PATTERN)
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None

    @property
    def schema(self) -> dict[str, Any]:
        return self.parameters if self.parameters is not None else _ANY_OBJECT


class ChatTool(StrictRequest):
    """One entry of `tools`; only functions exist in chat completions."""

    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(StrictRequest):
    name: StrictStr


class NamedToolChoice(StrictRequest):
    """`tool_choice` naming the one function the model must call."""

    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class CalledFunction(StrictRequest):
    name: StrictStr
    arguments: StrictStr  # the arguments as JSON text, as OpenAI sends them back


class AssistantToolCall(StrictRequest):
    """A call the assistant made earlier in the conversation."""

    id: StrictStr
    type: Literal["function"] = "function"
    function: CalledFunction

    def for_template(self) -> dict[str, Any]:
        """The call as chat templates read it: arguments as an object (Hermes- and
        Llama-style templates print them with `tojson`), as transformers documents."""
        try:
            arguments: Any = json.loads(self.function.arguments)
        except json.JSONDecodeError:
            arguments = self.function.arguments
        return {"id": self.id, "type": "function",
                "function": {"name": self.function.name, "arguments": arguments}}


@dataclass(frozen=True)
class ToolPlan:
    """What one chat request's tools do: the definitions for the template (None: the template
    sees no tools), the output constraint (None: free text) and the parser of the output."""

    template_tools: list[dict[str, Any]] | None
    constraint: StructuredOutputsParams | None
    mode: Literal["none", "auto", "required", "named"]
    parser_name: str
    named_function: str | None = None

    def output_parser(self) -> ToolParser | None:
        """A new parser for one choice's output (None: the output is plain content)."""
        if self.mode == "none":
            return None
        if self.mode == "named":
            assert self.named_function is not None
            return NamedCallParser(self.named_function)
        if self.mode == "required":
            return CallArrayParser()
        return tool_parser(self.parser_name)


NO_TOOLS = ToolPlan(None, None, "none", "hermes")


def plan_tools(tools: list[ChatTool] | None, choice: ToolChoice | None,
               parallel_tool_calls: bool, parser_name: str) -> ToolPlan:
    """Check `tools` and `tool_choice` together (a 400 names the field at fault) and decide
    how the request runs. OpenAI's default choice is `auto` with tools, `none` without."""
    if not tools:
        if choice not in (None, "none"):
            raise bad_request("tool_choice needs tools", "tool_choice")
        return NO_TOOLS
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise bad_request("tools must have distinct function names", "tools")
    for tool in tools:
        _check_schema(tool.function)
    definitions = [t.model_dump(exclude_none=True) for t in tools]
    choice = choice or "auto"
    if choice == "none":
        # vLLM's rule: the tools are not shown to the model at all, so it cannot call them.
        return ToolPlan(None, None, "none", parser_name)
    if choice == "auto":
        return ToolPlan(definitions, None, "auto", parser_name)
    if choice == "required":
        schema = _call_array_schema(tools, parallel_tool_calls)
        return ToolPlan(definitions, StructuredOutputsParams(json=schema), "required",
                        parser_name)
    assert isinstance(choice, NamedToolChoice)
    wanted = choice.function.name
    tool = next((t for t in tools if t.function.name == wanted), None)
    if tool is None:
        raise bad_request(f"tool_choice names the function `{wanted}`, which is not in tools "
                          f"({', '.join(names)})", "tool_choice")
    return ToolPlan(definitions, StructuredOutputsParams(json=tool.function.schema), "named",
                    parser_name, named_function=wanted)


def _check_schema(function: FunctionDefinition) -> None:
    """A function's parameters must be a JSON schema of an object (a 400 if not)."""
    schema = function.schema
    try:
        validators.validator_for(schema).check_schema(schema)
    except schema_errors.SchemaError as exc:
        raise bad_request(f"the parameters of function `{function.name}` are not a valid JSON "
                          f"schema: {exc.message}", "tools") from exc
    if schema.get("type", "object") != "object":
        raise bad_request(f"the parameters of function `{function.name}` must describe an "
                          "object (type: object)", "tools")


def _call_array_schema(tools: list[ChatTool], parallel: bool) -> dict[str, Any]:
    """One or more calls, each `{"name": <a tool>, "arguments": <its schema>}`."""
    calls = [{"type": "object",
              "properties": {"name": {"type": "string", "enum": [t.function.name]},
                             "arguments": t.function.schema},
              "required": ["name", "arguments"], "additionalProperties": False}
             for t in tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return schema
