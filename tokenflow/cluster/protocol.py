"""OpenAI-compatible request and response schemas (pydantic v2), validated at the edge only.

Requests are checked here once, so that everything past the ingress can trust them: wrong types,
out-of-range values and empty inputs fail validation (turned into a 400 by `cluster.errors`),
and `to_sampling_params()` builds the engine-side `SamplingParams`. Unknown fields are ignored,
since OpenAI clients send fields we have no use for; known OpenAI fields whose meaning we cannot
honour (`echo`, `suffix`, `logit_bias`, ...) are rejected instead of silently dropped.
Scalars are strict (`"16"` is not an integer, `true` is not a number), as the OpenAI API is.

Responses carry the `id`, `object` and `created` fields the OpenAI API returns, so the official
`openai` client parses them.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    Strict,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationError,
    ValidationInfo,
    field_validator,
)

from tokenflow.cluster.errors import bad_request, from_validation_errors
from tokenflow.cluster.tools import AssistantToolCall, ChatTool, ToolChoice, ToolPlan, plan_tools
from tokenflow.scheduler.sampling_params import (
    MAX_SESSION_ID_LEN,
    RepetitionDetectionParams,
    SamplingParams,
    StructuredOutputsParams,
)

MAX_N = 16
MAX_LOGPROBS = 20
MAX_STOP_SEQUENCES = 4
# Checking for repetition costs up to one comparison per pattern size per token, in the
# scheduler's loop that every request shares: bound it.
MAX_REPETITION_PATTERN_SIZE = 256

StrictFloat = Annotated[float, Strict()]  # accepts ints (JSON has one number type), not bools
TokenId = Annotated[StrictInt, Field(ge=0)]
FinishReason = Literal["stop", "length", "tool_calls"]
# Which stop ended a choice (vLLM's `stop_reason`): a stop token id, a stop string, or
# "repetition"; None for EOS and length. Repetition is a "stop" for OpenAI clients, whose
# finish reasons are a closed set.
StopReason = int | str | None
Role = Literal["system", "user", "assistant", "developer", "tool"]


def _now() -> int:
    return int(time.time())


RequestT = TypeVar("RequestT", bound=BaseModel)


def parse_request(model_cls: type[RequestT], body: bytes | str | dict[str, Any]) -> RequestT:
    """Validate a raw body (JSON bytes/text or an already parsed dict) for routes that do not
    let FastAPI do it; a bad body raises a 400 `OpenAIError`, never a 500."""
    try:
        if isinstance(body, dict):
            return model_cls.model_validate(body)
        return model_cls.model_validate_json(body)
    except ValidationError as exc:
        raise from_validation_errors(exc.errors()) from exc


def random_id(prefix: str) -> str:
    """An OpenAI-style id: `cmpl-<hex>`, `chatcmpl-<hex>`."""
    return f"{prefix}-{uuid.uuid4().hex}"


class _Request(BaseModel):
    # allow_inf_nan=False: NaN/inf in a sampling knob is always a client bug.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class StreamOptions(_Request):
    """`stream_options`: whether the last SSE event carries the usage totals."""

    include_usage: StrictBool = False


class JsonSchemaFormat(_Request):
    """`response_format.json_schema`: a named schema the output must follow. Without
    `schema` the output is any JSON object."""

    name: StrictStr = Field(min_length=1, max_length=64)
    description: StrictStr | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(_Request):
    """OpenAI's `response_format`: free text, any JSON object, or JSON following a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @field_validator("json_schema")
    @classmethod
    def _schema_for_json_schema(cls, value: JsonSchemaFormat | None,
                                info: ValidationInfo) -> JsonSchemaFormat | None:
        if value is not None and info.data.get("type") != "json_schema":
            raise ValueError("json_schema is only allowed with type 'json_schema'")
        return value

    def to_params(self) -> StructuredOutputsParams | None:
        if self.type == "text":
            return None
        if self.type == "json_schema":
            if self.json_schema is None:
                raise bad_request("response_format type 'json_schema' needs a json_schema",
                                  "response_format")
            if self.json_schema.schema_ is not None:
                return StructuredOutputsParams(json=self.json_schema.schema_)
        return StructuredOutputsParams(json_object=True)


class StructuredOutputsRequest(_Request):
    """vLLM's `structured_outputs` extra: exactly one constraint (checked when built)."""

    json_: dict[str, Any] | StrictStr | None = Field(default=None, alias="json")
    regex: StrictStr | None = None
    choice: list[StrictStr] | None = None
    grammar: StrictStr | None = None
    json_object: StrictBool = False

    def to_params(self) -> StructuredOutputsParams:
        return StructuredOutputsParams(json=self.json_, regex=self.regex, choice=self.choice,
                                       grammar=self.grammar, json_object=self.json_object)


class RepetitionDetectionRequest(_Request):
    """vLLM's `repetition_detection` extra: stop (finish reason "stop", stop reason
    "repetition") once the output ends in one pattern of `min_pattern_size` to
    `max_pattern_size` tokens repeated `min_count` times in a row."""

    max_pattern_size: StrictInt = Field(ge=1, le=MAX_REPETITION_PATTERN_SIZE)
    min_pattern_size: StrictInt = Field(default=1, ge=1)
    min_count: StrictInt = Field(ge=2)

    @field_validator("min_pattern_size")
    @classmethod
    def _min_below_max(cls, value: int, info: ValidationInfo) -> int:
        largest = info.data.get("max_pattern_size")
        if largest is not None and value > largest:
            raise ValueError(f"min_pattern_size ({value}) must be <= max_pattern_size ({largest})")
        return value

    def to_params(self) -> RepetitionDetectionParams:
        return RepetitionDetectionParams(max_pattern_size=self.max_pattern_size,
                                         min_pattern_size=self.min_pattern_size,
                                         min_count=self.min_count)


class _SamplingRequest(_Request):
    """Fields shared by completions and chat: OpenAI's sampling knobs plus vLLM-style extras.

    `None` means "not given": the engine default applies. Field order matters for the
    validators that read earlier fields (`info.data`); that is why `max_tokens` and
    `min_tokens` live in the subclasses (a redeclared field keeps its base-class position).
    """

    model: StrictStr | None = None  # None: the ingress picks the served model
    n: StrictInt = Field(default=1, ge=1, le=MAX_N)
    temperature: StrictFloat | None = Field(default=None, ge=0, le=2)
    top_p: StrictFloat | None = Field(default=None, gt=0, le=1)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    stop: StrictStr | list[StrictStr] | None = None
    seed: StrictInt | None = None
    presence_penalty: StrictFloat | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: StrictFloat | None = Field(default=None, ge=-2, le=2)
    logit_bias: dict[str, Any] | None = None
    user: StrictStr | None = None
    # Extras (vLLM's names): top_k <= 0 means off (-1 is vLLM's spelling of off).
    top_k: StrictInt | None = Field(default=None, ge=-1)
    min_p: StrictFloat | None = Field(default=None, ge=0, le=1)
    ignore_eos: StrictBool = False
    repetition_penalty: StrictFloat | None = Field(default=None, gt=0, le=10)
    priority: StrictInt = 0
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: StrictBool = False
    skip_special_tokens: StrictBool = True
    kv_transfer_params: dict[str, Any] | None = None
    # A streaming-input session: the replica keeps this request's KV after it ends for the
    # next request with the same id (whose prompt extends this one's prompt and output);
    # session_close ends the session with this request.
    session_id: StrictStr | None = Field(default=None, min_length=1,
                                         max_length=MAX_SESSION_ID_LEN)
    session_close: StrictBool = False
    # Constrained output: OpenAI's response_format, vLLM's structured_outputs, or the
    # guided_* fields of older vLLM versions (one of them at most).
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: dict[str, Any] | StrictStr | None = None
    guided_regex: StrictStr | None = None
    guided_choice: list[StrictStr] | None = None
    guided_grammar: StrictStr | None = None
    repetition_detection: RepetitionDetectionRequest | None = None

    @field_validator("stream_options")
    @classmethod
    def _options_need_stream(cls, value: StreamOptions | None, info: ValidationInfo) -> Any:
        if value is not None and not info.data.get("stream", False):
            raise ValueError("stream_options is only allowed when stream is true")
        return value

    @field_validator("stop")
    @classmethod
    def _stop_sequences(cls, value: str | list[str] | None) -> list[str] | None:
        stops = [value] if isinstance(value, str) else value
        if stops is None:
            return None
        if len(stops) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences are allowed")
        if any(s == "" for s in stops):
            raise ValueError("stop sequences must not be empty")
        return stops

    @field_validator("session_id")
    @classmethod
    def _session_is_one_sequence(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is not None and info.data.get("n", 1) != 1:
            raise ValueError("a session continues one sequence: n must be 1")
        return value

    @field_validator("session_close")
    @classmethod
    def _close_needs_session(cls, value: bool, info: ValidationInfo) -> bool:
        if value and info.data.get("session_id") is None:
            raise ValueError("session_close needs a session_id")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _no_logit_bias(cls, value: dict[str, Any] | None) -> None:
        if value:
            raise ValueError("logit_bias is not supported")
        return None

    @property
    def include_usage(self) -> bool:
        """Whether a streamed response ends with a usage event."""
        return self.stream and self.stream_options is not None and self.stream_options.include_usage

    def _structured_outputs(self, tool_constraint: StructuredOutputsParams | None = None
                            ) -> StructuredOutputsParams | None:
        """The one output constraint the request gives, in whichever API's spelling (a
        `required` or named tool choice is one too)."""
        guided = {"json": self.guided_json, "regex": self.guided_regex,
                  "choice": self.guided_choice, "grammar": self.guided_grammar}
        given = {name: value for name, value in (
            ("tool_choice", tool_constraint),
            ("response_format", self.response_format
             if self.response_format and self.response_format.type != "text" else None),
            ("structured_outputs", self.structured_outputs),
            *((f"guided_{k}", v) for k, v in guided.items())) if value is not None}
        if len(given) > 1:
            raise bad_request(f"give one output constraint, not {' and '.join(given)}",
                              next(iter(given)))
        if not given:
            return None
        name, value = next(iter(given.items()))
        try:
            if name.startswith("guided_"):
                return StructuredOutputsParams(**{name.removeprefix("guided_"): value})
            if isinstance(value, StructuredOutputsParams):
                return value
            return value.to_params()
        except ValueError as exc:
            raise bad_request(str(exc), name) from exc

    def _build_sampling_params(self, max_tokens: int | None, default_max_tokens: int | None,
                               min_tokens: int, logprobs: int | None,
                               tool_constraint: StructuredOutputsParams | None = None
                               ) -> SamplingParams:
        given = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "min_p": self.min_p,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
            "top_k": None if self.top_k is None else max(self.top_k, 0),
        }
        try:
            return SamplingParams(
                n=self.n,
                seed=self.seed,
                max_tokens=max_tokens if max_tokens is not None else default_max_tokens,
                min_tokens=min_tokens,
                stop=list(self.stop or []),
                stop_token_ids=list(self.stop_token_ids or []),
                include_stop_str_in_output=self.include_stop_str_in_output,
                ignore_eos=self.ignore_eos,
                logprobs=logprobs,
                skip_special_tokens=self.skip_special_tokens,
                structured_outputs=self._structured_outputs(tool_constraint),
                repetition_detection=(self.repetition_detection.to_params()
                                      if self.repetition_detection is not None else None),
                session_id=self.session_id,
                session_close=self.session_close,
                **{k: v for k, v in given.items() if v is not None},
            )
        except ValueError as exc:
            # Only cross-field limits reach here (e.g. min_tokens above the default max_tokens):
            # still the client's mistake, so a 400 rather than a 500.
            raise bad_request(str(exc)) from exc


def _check_min_tokens(min_tokens: int, info: ValidationInfo, *limits: str) -> int:
    for name in limits:
        limit = info.data.get(name)
        if limit is not None and min_tokens > limit:
            raise ValueError(f"min_tokens ({min_tokens}) must be <= {name} ({limit})")
    return min_tokens


class CompletionRequest(_SamplingRequest):
    """`POST /v1/completions`. `prompt` is a string, a batch of strings, a list of token ids,
    or a batch of token-id lists; each prompt gets `n` choices."""

    prompt: Any
    max_tokens: StrictInt | None = Field(default=16, ge=1)
    logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: StrictBool = False
    suffix: StrictStr | None = None
    best_of: StrictInt | None = Field(default=None, ge=1, le=MAX_N)
    min_tokens: StrictInt = Field(default=0, ge=0)

    @field_validator("prompt")
    @classmethod
    def _prompt_shape(cls, value: Any) -> str | list[str] | list[int] | list[list[int]]:
        # One hand-written check instead of a 4-way union: pydantic's union errors name every
        # member tried, which makes a poor message for the client.
        shape = "a non-empty string, list of strings, list of token ids, or list of token-id lists"
        if isinstance(value, str):
            if not value:
                raise ValueError("prompt must not be empty")
            return value
        if not isinstance(value, list) or not value:
            raise ValueError(f"prompt must be {shape}")
        if all(isinstance(p, str) and p for p in value):
            return value
        if all(_is_token_ids(p) for p in value):
            return value
        if all(isinstance(p, list) and p and all(_is_token_ids(t) for t in p) for p in value):
            return value
        raise ValueError(f"prompt must be {shape}")

    @field_validator("prompt")
    @classmethod
    def _one_prompt_per_session(cls, value: Any, info: ValidationInfo) -> Any:
        batch = isinstance(value, list) and not isinstance(value[0], int)
        if info.data.get("session_id") is not None and batch and len(value) > 1:
            raise ValueError("a session continues one sequence: give one prompt")
        return value

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, value: bool) -> bool:
        if value:
            raise ValueError("echo is not supported")
        return value

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> None:
        if value:
            raise ValueError("suffix is not supported")
        return None

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and value != info.data.get("n", 1):
            raise ValueError("best_of different from n is not supported")
        return value

    @field_validator("min_tokens")
    @classmethod
    def _min_below_max(cls, value: int, info: ValidationInfo) -> int:
        return _check_min_tokens(value, info, "max_tokens")

    @property
    def prompts(self) -> list[str] | list[list[int]]:
        """The prompt as a batch: each element is one text or one list of token ids."""
        if isinstance(self.prompt, str):
            return [self.prompt]
        if isinstance(self.prompt[0], int):
            return [self.prompt]
        return self.prompt

    def to_sampling_params(self, default_max_tokens: int | None) -> SamplingParams:
        """Engine params; `default_max_tokens` applies when the client sent `max_tokens: null`
        (None: the engine's default, the room left in the context after the prompt)."""
        return self._build_sampling_params(self.max_tokens, default_max_tokens, self.min_tokens,
                                           self.logprobs)


def _is_token_ids(value: Any) -> bool:
    # bool is an int subclass in Python; `true` is not a token id.
    return (isinstance(value, int) and not isinstance(value, bool) and value >= 0)


class TextContentPart(_Request):
    """One part of a message's content; only text is supported."""

    type: Literal["text"]
    text: StrictStr


class ChatMessage(_Request):
    """One chat message. `content` is a string or a list of text parts; an assistant message
    may have no content (OpenAI allows it when it only carried tool calls). A `tool` message
    answers the call `tool_call_id` names."""

    role: Role
    content: StrictStr | list[TextContentPart] | None = Field(default=None, validate_default=True)
    name: StrictStr | None = None
    tool_calls: list[AssistantToolCall] | None = None
    tool_call_id: StrictStr | None = Field(default=None, validate_default=True)

    @field_validator("content")
    @classmethod
    def _content_required(cls, value: Any, info: ValidationInfo) -> Any:
        if value is None and info.data.get("role") != "assistant":
            raise ValueError("content is required for this role")
        return value

    @field_validator("tool_call_id")
    @classmethod
    def _tool_answers_a_call(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is None and info.data.get("role") == "tool":
            raise ValueError("a tool message needs the tool_call_id of the call it answers")
        return value

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates read it: text content, calls with their arguments
        as objects, a tool result's call id."""
        message: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            message["tool_calls"] = [call.for_template() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            message["name"] = self.name
        return message

    def text(self) -> str:
        """The content as one string (text parts joined with newlines)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingRequest):
    """`POST /v1/chat/completions`. `max_completion_tokens` wins over the older `max_tokens`;
    with neither, the ingress's default (room left in the context) applies."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
    min_tokens: StrictInt = Field(default=0, ge=0)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[ChatTool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: StrictBool = True
    add_generation_prompt: StrictBool = True
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("min_tokens")
    @classmethod
    def _min_below_max(cls, value: int, info: ValidationInfo) -> int:
        return _check_min_tokens(value, info, "max_tokens", "max_completion_tokens")

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value and not info.data.get("logprobs", False):
            raise ValueError("top_logprobs requires logprobs to be true")
        return value

    @property
    def effective_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens

    def conversation(self) -> list[dict[str, Any]]:
        """Messages as dicts ready for a chat template (`ChatMessage.for_template`)."""
        return [m.for_template() for m in self.messages]

    def tool_plan(self, parser_name: str) -> ToolPlan:
        """What `tools` and `tool_choice` make of this request (tokenflow/cluster/tools.py)."""
        return plan_tools(self.tools, self.tool_choice, self.parallel_tool_calls, parser_name)

    def to_sampling_params(self, default_max_tokens: int | None,
                           tools: ToolPlan | None = None) -> SamplingParams:
        """Engine params; `default_max_tokens` applies when neither max field was given
        (None: the engine's default, the room left in the context after the prompt). A
        `required` or named tool choice constrains the output (`tools.constraint`)."""
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        constraint = None if tools is None else tools.constraint
        return self._build_sampling_params(self.effective_max_tokens, default_max_tokens,
                                           self.min_tokens, logprobs, constraint)


# ---------------------------------------------------------------- responses


class PromptTokensDetails(BaseModel):
    """How many prompt tokens were served from the prefix cache."""

    cached_tokens: int = 0


class UsageInfo(BaseModel):
    """Token counts of one response (all choices together)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int,
           cached_tokens: int | None = None) -> UsageInfo:
        details = (None if cached_tokens is None
                   else PromptTokensDetails(cached_tokens=cached_tokens))
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens, prompt_tokens_details=details)


class CompletionLogprobs(BaseModel):
    """Legacy completions logprobs: parallel lists, one entry per generated token."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float] = Field(default_factory=list)
    top_logprobs: list[dict[str, float]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    """One choice of a completion; `finish_reason` is None only in stream chunks."""

    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: StopReason = None


class CompletionResponse(BaseModel):
    """A whole `text_completion`."""

    id: str = Field(default_factory=lambda: random_id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    # Where a producer published the prompt's KV (a request with do_remote_decode), as vLLM
    # returns it, so that a router can send the decode to another server.
    kv_transfer_params: dict[str, Any] | None = None


class CompletionStreamResponse(CompletionResponse):
    """One SSE event of a streamed completion (OpenAI uses the same object for both); the
    usage event at the end has no choices."""


class TopLogprob(BaseModel):
    """One alternative token at a position, with its log-probability."""

    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprob(TopLogprob):
    """The sampled token at one position and its top alternatives."""

    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    """Logprobs of a chat choice: one entry per generated token."""

    content: list[ChatLogprob] | None = None


class FunctionCall(BaseModel):
    """A called function: its name and its arguments as JSON text."""

    name: str
    arguments: str


class ToolCall(BaseModel):
    """One tool call of a whole chat completion's message."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatResponseMessage(BaseModel):
    """The assistant's message in a whole chat completion: its text, the text it reasoned in
    (`reasoning_content`, vLLM's field, with a reasoning parser) and its tool calls."""

    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatCompletionChoice(BaseModel):
    """One choice of a whole chat completion."""

    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: FinishReason
    stop_reason: StopReason = None


class ChatCompletionResponse(BaseModel):
    """A whole `chat.completion`."""

    id: str = Field(default_factory=lambda: random_id("chatcmpl"))
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo | None = None
    # Where a producer published the prompt's KV (a request with do_remote_decode), as vLLM
    # returns it, so that a router can send the decode to another server.
    kv_transfer_params: dict[str, Any] | None = None


class DeltaFunctionCall(BaseModel):
    """A piece of a streamed call: the name in its first chunk, then argument fragments."""

    name: str | None = None
    arguments: str = ""


class DeltaToolCall(BaseModel):
    """A piece of the `index`-th tool call of a choice; `id` and `type` in its first chunk."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class DeltaMessage(BaseModel):
    """What a stream chunk adds to a choice: the role in the first chunk, then text,
    reasoning text or tool-call pieces."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatCompletionStreamChoice(BaseModel):
    """One choice's delta in a stream chunk; `finish_reason` is set in its last chunk."""

    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: StopReason = None


class ChatCompletionStreamResponse(BaseModel):
    """One SSE event of a streamed chat completion (`chat.completion.chunk`); all events of a
    response share its `id` and `created`."""

    id: str = Field(default_factory=lambda: random_id("chatcmpl"))
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    """One served model, as `GET /v1/models` lists it."""

    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "tokenflow"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model (vLLM's convention)
    max_model_len: int | None = None


class ModelList(BaseModel):
    """`GET /v1/models`."""

    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


class TokenizeRequest(_Request):
    """`POST /tokenize`: exactly one of `prompt` (raw text) or `messages` (chat template)."""

    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1, validate_default=True)
    add_special_tokens: StrictBool = True
    add_generation_prompt: StrictBool = True

    @field_validator("messages")
    @classmethod
    def _one_input(cls, value: list[ChatMessage] | None, info: ValidationInfo) -> Any:
        if (value is None) == (info.data.get("prompt") is None):
            raise ValueError("give exactly one of prompt or messages")
        return value


class TokenizeResponse(BaseModel):
    """The token ids of a prompt and how much room the model's context has."""

    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeRequest(_Request):
    """`POST /detokenize`."""

    model: StrictStr | None = None
    tokens: list[TokenId]


class DetokenizeResponse(BaseModel):
    """The text of a list of token ids."""

    prompt: str


class LoadLoRAAdapterRequest(_Request):
    """`POST /v1/load_lora_adapter` (vLLM's): register the PEFT adapter in `lora_path` (a
    directory on the replicas' nodes) under `lora_name` on every replica."""

    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1)


class UnloadLoRAAdapterRequest(_Request):
    """`POST /v1/unload_lora_adapter` (vLLM's): forget the adapter `lora_name` everywhere."""

    lora_name: str = Field(min_length=1, max_length=256)


class PauseRequest(_Request):
    """`POST /pause`: `new` admits nothing new and lets admitted requests finish (a drain);
    `all` schedules nothing until `POST /resume` (`scheduler.PauseState`)."""

    mode: Literal["new", "all"] = "new"


class ReplicaPauseStatus(BaseModel):
    """One LLMServer replica: its pause state, whether it is idle (nothing it may run is left),
    its running and waiting requests, and its process id (on its node)."""

    replica: str | None = None
    state: Literal["unpaused", "paused_new", "paused_all"]
    idle: bool
    running: int
    waiting: int
    pid: int | None = None


class PauseStatusResponse(BaseModel):
    """`/pause`, `/resume` and `/is_paused`: every replica's status. `is_paused`: every replica
    is paused (a replica Serve started since the pause is not); `idle`: none has work it may
    do, so once paused with `new`, the deployment is drained."""

    is_paused: bool
    idle: bool
    replicas: list[ReplicaPauseStatus]

    @classmethod
    def of(cls, replicas: list[dict[str, Any]]) -> PauseStatusResponse:
        statuses = [ReplicaPauseStatus.model_validate(r) for r in replicas]
        return cls(is_paused=bool(statuses) and all(r.state != "unpaused" for r in statuses),
                   idle=all(r.idle for r in statuses), replicas=statuses)


def sse_event(payload: BaseModel | dict[str, Any]) -> str:
    """One server-sent event: `data: <json>` and a blank line. Unset (None) fields are left
    out, as OpenAI and vLLM stream them (`"role": null` would confuse clients)."""
    if isinstance(payload, BaseModel):
        return f"data: {payload.model_dump_json(exclude_none=True)}\n\n"
    return f"data: {json.dumps(payload)}\n\n"


SSE_DONE = "data: [DONE]\n\n"
