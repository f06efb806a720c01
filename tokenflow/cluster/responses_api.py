"""OpenAI's Responses API (`POST /v1/responses`) at the edge: the request (`ResponsesRequest`)
and the response objects, checked against the `openai` client's own types by the tests.

A Responses request is one chat turn in another spelling: `instructions` becomes a leading
system message, `input` (a string, or a list of messages, earlier function calls and their
outputs) becomes the chat messages, function `tools` become chat tools, and `text.format`
becomes the same output constraint as chat's `response_format`. The route
(`OpenAIServing.responses`) then runs it as a chat completion; `responses_formatter.py` turns
the output into this API's items and stream events.

Nothing is stored. `store` (true by default in OpenAI's API, so every plain call sends or
implies it) is accepted, and the response says `"store": false`; `previous_response_id` and
`conversation`, which would need an earlier response, are a 400. Fields whose meaning tokenflow
cannot honour (built-in tools, images and files, `background`, `truncation: auto`, logprobs)
are a 400 that names the field; unknown fields are ignored, as on the other routes.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal, Union

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Strict,
    StrictBool,
    StrictInt,
    StrictStr,
    Tag,
    ValidationInfo,
    field_validator,
    model_validator,
)

from tokenflow.cluster.errors import bad_request
from tokenflow.cluster.tools import (
    FUNCTION_NAME_PATTERN,
    AssistantToolCall,
    CalledFunction,
    ChatTool,
    FunctionDefinition,
    FunctionName,
    NamedToolChoice,
    ToolChoice,
    ToolPlan,
    plan_tools,
)
from tokenflow.scheduler.sampling_params import SamplingParams, StructuredOutputsParams

StrictFloat = Annotated[float, Strict()]
# Kept nowhere: see the module docstring.
NOT_STORED = ("responses are not stored on this server, so there is no earlier response or "
              "conversation to continue: send the whole conversation as `input`")
# Fields refused when set, and why.
_REFUSED = {
    "previous_response_id": NOT_STORED,
    "conversation": NOT_STORED,
    "background": "background responses need stored responses: stream instead",
    "max_tool_calls": "max_tool_calls is not supported",
    "top_logprobs": "logprobs are not served on /v1/responses (use /v1/chat/completions)",
}
# `include` asks for extra output; encrypted reasoning is only for a stateless client to send
# back, and tokenflow's reasoning comes back in plain text anyway.
_INCLUDABLE = {"reasoning.encrypted_content"}


def response_id(prefix: str) -> str:
    """An id as this API spells them: `resp_<hex>`, `msg_<hex>`, `rs_<hex>`, `fc_<hex>`."""
    return f"{prefix}_{uuid.uuid4().hex}"


class _Request(BaseModel):
    # As the other request models (cluster/protocol.py): unknown fields ignored, no NaN.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


# ------------------------------------------------------------------------------- input
class TextPart(_Request):
    """One part of a message's content: `input_text`, or `output_text` (an earlier response's
    message sent back). Images, files and audio are refused: the models here read text."""

    type: StrictStr
    text: StrictStr

    @field_validator("type")
    @classmethod
    def _text_only(cls, value: str) -> str:
        if value not in ("input_text", "output_text"):
            raise ValueError(f"only text content (input_text, output_text) is supported, "
                             f"not {value!r}")
        return value


def _text(content: str | list[TextPart]) -> str:
    # Parts joined with newlines, as chat's `ChatMessage.text` joins its parts.
    return content if isinstance(content, str) else "\n".join(p.text for p in content)


class MessageItem(_Request):
    """A message of the conversation (`type` may be left out, as the client's shorthand
    `{"role", "content"}` does)."""

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: StrictStr | list[TextPart]


class FunctionCallItem(_Request):
    """A function call an earlier response made (its `function_call` output item)."""

    type: Literal["function_call"]
    call_id: StrictStr = Field(min_length=1)
    name: StrictStr = Field(min_length=1)
    arguments: StrictStr


class FunctionCallOutputItem(_Request):
    """What the client's function returned for the call `call_id`."""

    type: Literal["function_call_output"]
    call_id: StrictStr = Field(min_length=1)
    output: StrictStr | list[TextPart]


class ReasoningItem(_Request):
    """An earlier response's reasoning, sent back with the rest of its output: accepted and
    left out of the prompt (chat templates show no earlier turn's reasoning)."""

    type: Literal["reasoning"]


def _item_kind(value: Any) -> str | None:
    if isinstance(value, dict):
        kind = value.get("type", "message")
    else:
        kind = getattr(value, "type", None)
    # Tags spelled with a dash: an error's path then reads `input[0].content`, without the tag
    # (cluster/errors.py leaves such union tags out of `param`).
    return f"{kind}-item" if isinstance(kind, str) else None


InputItem = Annotated[
    Union[Annotated[MessageItem, Tag("message-item")],
          Annotated[FunctionCallItem, Tag("function_call-item")],
          Annotated[FunctionCallOutputItem, Tag("function_call_output-item")],
          Annotated[ReasoningItem, Tag("reasoning-item")]],
    Discriminator(_item_kind, custom_error_type="invalid_item",
                  custom_error_message="an input item must be a message, function_call, "
                                       "function_call_output or reasoning item")]


class FunctionTool(_Request):
    """One entry of `tools`: a function the model may call. Built-in tools (web search, file
    search, computer use, ...) run on OpenAI's side and are refused."""

    type: StrictStr
    name: StrictStr = Field(pattern=FUNCTION_NAME_PATTERN)
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None

    @field_validator("type")
    @classmethod
    def _functions_only(cls, value: str) -> str:
        if value != "function":
            raise ValueError(f"only function tools are supported, not {value!r}")
        return value

    def chat_tool(self) -> ChatTool:
        return ChatTool(type="function", function=FunctionDefinition(
            name=self.name, description=self.description, parameters=self.parameters,
            strict=self.strict))


class TextFormat(_Request):
    """`text.format`: free text, any JSON object, or JSON following a named schema."""

    type: Literal["text", "json_object", "json_schema"] = "text"
    name: StrictStr | None = Field(default=None, min_length=1, max_length=64)
    description: StrictStr | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None

    @model_validator(mode="after")
    def _schema_for_json_schema(self) -> TextFormat:
        if self.type == "json_schema" and (self.schema_ is None or self.name is None):
            raise ValueError("format type 'json_schema' needs a name and a schema")
        if self.type != "json_schema" and self.schema_ is not None:
            raise ValueError("schema is only allowed with format type 'json_schema'")
        return self

    def to_params(self) -> StructuredOutputsParams | None:
        if self.type == "json_schema":
            return StructuredOutputsParams(json=self.schema_)
        return StructuredOutputsParams(json_object=True) if self.type == "json_object" else None


class TextConfig(_Request):
    """`text`: the output's format (`verbosity` is ignored: it is a hint to OpenAI's models)."""

    format: TextFormat = Field(default_factory=TextFormat)


class ResponsesRequest(_Request):
    """`POST /v1/responses`. Owns the translation to chat: `chat_messages()`, `tool_plan()`
    and `to_sampling_params()`; the fields a response repeats (`echo()`)."""

    model: StrictStr | None = None
    input: StrictStr | list[InputItem]
    instructions: StrictStr | None = None
    max_output_tokens: StrictInt | None = Field(default=None, ge=1)
    temperature: StrictFloat | None = Field(default=None, ge=0, le=2)
    top_p: StrictFloat | None = Field(default=None, gt=0, le=1)
    stream: StrictBool = False
    text: TextConfig = Field(default_factory=TextConfig)
    tools: list[FunctionTool] | None = None
    tool_choice: StrictStr | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool = True
    store: StrictBool | None = None  # accepted; nothing is stored (the module docstring)
    metadata: dict[str, StrictStr] | None = None
    user: StrictStr | None = None
    reasoning: dict[str, Any] | None = None  # echoed; the model reasons as it was trained to
    # Refused when set (_REFUSED and the validators say why).
    previous_response_id: StrictStr | None = None
    conversation: Any = None
    background: StrictBool | None = None
    truncation: Literal["auto", "disabled"] | None = None
    max_tool_calls: StrictInt | None = None
    top_logprobs: StrictInt | None = None
    include: list[StrictStr] | None = None

    @field_validator("input")
    @classmethod
    def _not_empty(cls, value: str | list[Any]) -> str | list[Any]:
        if not value:
            raise ValueError("input must not be empty")
        return value

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice_shape(cls, value: str | dict[str, Any] | None) -> Any:
        if value is None or value in ("none", "auto", "required"):
            return value
        if (isinstance(value, dict) and value.get("type") == "function"
                and isinstance(value.get("name"), str)):
            return value
        raise ValueError("tool_choice must be 'none', 'auto', 'required' or "
                         "{'type': 'function', 'name': ...}")

    @field_validator(*_REFUSED)
    @classmethod
    def _refused(cls, value: Any, info: ValidationInfo) -> Any:
        if value:  # None, false and 0 ask for nothing
            raise ValueError(_REFUSED[info.field_name or ""])
        return value

    @field_validator("truncation")
    @classmethod
    def _no_truncation(cls, value: str | None) -> str | None:
        if value == "auto":
            raise ValueError("truncation 'auto' is not supported: an input longer than the "
                             "context is a 400")
        return value

    @field_validator("include")
    @classmethod
    def _includable(cls, value: list[str] | None) -> list[str] | None:
        unknown = sorted(set(value or ()) - _INCLUDABLE)
        if unknown:
            raise ValueError(f"cannot include {', '.join(unknown)}")
        return value

    def chat_messages(self) -> list[dict[str, Any]]:
        """The chat messages, as chat templates read them (`ChatMessage.for_template`'s
        shape): instructions first, function calls as the assistant's `tool_calls` (calls in
        a row, and calls right after an assistant message, join that message), outputs as
        `tool` messages."""
        messages: list[dict[str, Any]] = []
        if self.instructions is not None:
            messages.append({"role": "system", "content": self.instructions})
        if isinstance(self.input, str):
            return [*messages, {"role": "user", "content": self.input}]
        for item in self.input:
            if isinstance(item, MessageItem):
                messages.append({"role": item.role, "content": _text(item.content)})
            elif isinstance(item, FunctionCallItem):
                _add_call(messages, item)
            elif isinstance(item, FunctionCallOutputItem):
                messages.append({"role": "tool", "content": _text(item.output),
                                 "tool_call_id": item.call_id})
        return messages

    def tool_plan(self, parser_name: str) -> ToolPlan:
        """What `tools` and `tool_choice` make of this request, as chat's
        (tokenflow/cluster/tools.py): the function tools in chat's shape."""
        tools = None if self.tools is None else [t.chat_tool() for t in self.tools]
        return plan_tools(tools, self._chat_tool_choice(), self.parallel_tool_calls,
                          parser_name)

    def _chat_tool_choice(self) -> ToolChoice | None:
        if isinstance(self.tool_choice, dict):
            return NamedToolChoice(type="function",
                                   function=FunctionName(name=self.tool_choice["name"]))
        return self.tool_choice  # type: ignore[return-value]  # checked by its validator

    def to_sampling_params(self, tools: ToolPlan | None = None) -> SamplingParams:
        """Engine params: one sequence, `max_output_tokens` (None: the room left in the
        context), and the text format's output constraint or the tool choice's (a
        `required` or named one; not both: a 400)."""
        try:
            constraint = self.text.format.to_params()
        except ValueError as exc:
            raise bad_request(str(exc), "text.format") from exc
        tool_constraint = None if tools is None else tools.constraint
        if constraint is not None and tool_constraint is not None:
            raise bad_request("text.format and a 'required' or named tool_choice both "
                              "constrain the output: give one", "text.format")
        given = {"temperature": self.temperature, "top_p": self.top_p}
        try:
            return SamplingParams(max_tokens=self.max_output_tokens,
                                  structured_outputs=constraint or tool_constraint,
                                  **{k: v for k, v in given.items() if v is not None})
        except ValueError as exc:  # a limit across fields: still the client's mistake
            raise bad_request(str(exc)) from exc

    def echo(self) -> dict[str, Any]:
        """The request fields a response object repeats, as OpenAI returns them."""
        return {
            "instructions": self.instructions, "max_output_tokens": self.max_output_tokens,
            "metadata": self.metadata or {}, "parallel_tool_calls": self.parallel_tool_calls,
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "top_p": 1.0 if self.top_p is None else self.top_p,
            "tool_choice": self.tool_choice or "auto",
            "tools": [t.model_dump(exclude_none=True) for t in self.tools or ()],
            "text": {"format": self.text.format.model_dump(by_alias=True, exclude_none=True)},
            "reasoning": self.reasoning, "user": self.user,
            "truncation": self.truncation or "disabled",
        }


def _add_call(messages: list[dict[str, Any]], item: FunctionCallItem) -> None:
    call = AssistantToolCall(id=item.call_id, function=CalledFunction(
        name=item.name, arguments=item.arguments)).for_template()
    last = messages[-1] if messages else None
    if last is not None and last["role"] == "assistant":
        last.setdefault("tool_calls", []).append(call)
    else:
        messages.append({"role": "assistant", "content": "", "tool_calls": [call]})


# ------------------------------------------------------------------------------ output
ItemStatus = Literal["in_progress", "completed", "incomplete"]


class OutputText(BaseModel):
    """A message's text (`output_text` content part)."""

    type: Literal["output_text"] = "output_text"
    text: str = ""
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class ReasoningText(BaseModel):
    """A reasoning item's text (`reasoning_text` content part)."""

    type: Literal["reasoning_text"] = "reasoning_text"
    text: str = ""


class OutputMessage(BaseModel):
    """The assistant's answer: one `output_text` part (none while it is just opened)."""

    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: ItemStatus
    content: list[OutputText]


class OutputReasoning(BaseModel):
    """What the model reasoned before answering, as text (no summary is written)."""

    id: str
    type: Literal["reasoning"] = "reasoning"
    status: ItemStatus
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText]


class OutputFunctionCall(BaseModel):
    """A call of one of the request's functions; `arguments` is JSON text."""

    id: str
    type: Literal["function_call"] = "function_call"
    status: ItemStatus
    call_id: str
    name: str
    arguments: str


OutputItem = OutputMessage | OutputReasoning | OutputFunctionCall


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0  # served from the prefix cache
    cache_write_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    """Token counts of one response."""

    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int

    @classmethod
    def of(cls, input_tokens: int, output_tokens: int, cached_tokens: int,
           reasoning_tokens: int) -> ResponseUsage:
        return cls(input_tokens=input_tokens,
                   input_tokens_details=InputTokensDetails(cached_tokens=cached_tokens),
                   output_tokens=output_tokens,
                   output_tokens_details=OutputTokensDetails(reasoning_tokens=reasoning_tokens),
                   total_tokens=input_tokens + output_tokens)


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"] = "max_output_tokens"


class ResponseError(BaseModel):
    """Why a response failed (the engine's reason; never the client's: that is a 400)."""

    code: Literal["server_error"] = "server_error"
    message: str


class ResponseObject(BaseModel):
    """The `response` object: a whole response, and the snapshot lifecycle events carry."""

    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    completed_at: int | None = None
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    usage: ResponseUsage | None = None
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
    parallel_tool_calls: bool = True
    temperature: float = 1.0
    top_p: float = 1.0
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    reasoning: dict[str, Any] | None = None
    user: str | None = None
    truncation: Literal["disabled"] = "disabled"
    background: bool = False
    previous_response_id: None = None
    store: Literal[False] = False  # nothing is kept (the module docstring)

    @property
    def output_text(self) -> str:
        return "".join(part.text for item in self.output if isinstance(item, OutputMessage)
                       for part in item.content)
