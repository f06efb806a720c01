"""Turn an LLMServer's stream events into OpenAI responses: whole bodies or SSE events.

One formatter per request. It keeps each choice's running state (text, logprobs, finish reason,
text offset) so that a streamed and a non-streamed response of the same generation agree.
Engine finish reasons 'stop' and 'length' pass through; 'error' (and 'abort', which a live
request never sees) becomes an error: a 500 for a whole response, an SSE error event in a stream.
A choice's `stop_reason` (vLLM's field) says which stop ended it: a stop token id, a stop
string, "repetition" (repetition detection), or null for EOS and length.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field

from tokenflow.cluster.chat_output import ChatOutputParser, OutputDelta, ToolCallDelta
from tokenflow.cluster.errors import OpenAIError, error_body, service_unavailable
from tokenflow.cluster.messages import Finished, SeqDelta, TokenLogprob
from tokenflow.cluster.protocol import (
    SSE_DONE,
    ChatChoiceLogprobs,
    ChatCompletionChoice,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatLogprob,
    ChatResponseMessage,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    CompletionStreamResponse,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
    TopLogprob,
    UsageInfo,
    random_id,
    sse_event,
)

_OPENAI_FINISH_REASONS = ("stop", "length")


def generation_failed(message: str | None, retry_after_s: int | None = None) -> OpenAIError:
    """The engine failed a request (not the client's fault): a 500 with the engine's reason,
    or a 503 with `Retry-After` when the replica failed and a retry may well succeed."""
    text = f"generation failed: {message or 'aborted'}"
    if retry_after_s is not None:
        return service_unavailable(text, retry_after_s)
    return OpenAIError(text, 500, "internal_error")


@dataclass
class _Choice:
    """One choice's running state across stream events."""

    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    retry_after_s: int | None = None
    text_offset: int = 0  # characters of token text so far (legacy completions logprobs)


class Formatter(ABC):
    """Shared bookkeeping of one request's choices: merges deltas by choice index, turns
    engine failures into errors. Streaming: `start_events`, `stream_events` per batch,
    `done_events`. Whole: `add` per batch, then `response`."""

    def __init__(self, model: str, num_choices: int, include_usage: bool) -> None:
        self.model = model
        self.choices = [_Choice() for _ in range(num_choices)]
        self.include_usage = include_usage

    def _merge(self, deltas: list[SeqDelta]) -> dict[int, SeqDelta]:
        """Fold this batch's deltas into the choices; returns one merged delta per index."""
        merged: dict[int, SeqDelta] = {}
        for d in deltas:
            choice = self.choices[d.index]
            choice.text += d.text
            choice.logprobs.extend(d.logprobs or [])
            choice.finish_reason = d.finish_reason or choice.finish_reason
            if d.stop_reason is not None:  # a token id may be 0
                choice.stop_reason = d.stop_reason
            choice.error = d.error or choice.error
            choice.retry_after_s = d.retry_after_s or choice.retry_after_s
            prev = merged.get(d.index)
            if prev is None:
                merged[d.index] = SeqDelta(d.index, d.text, list(d.token_ids),
                                           list(d.logprobs) if d.logprobs is not None else None,
                                           d.finish_reason, d.error, d.retry_after_s,
                                           d.stop_reason)
            else:
                prev.text += d.text
                prev.token_ids.extend(d.token_ids)
                if d.logprobs is not None:
                    prev.logprobs = (prev.logprobs or []) + d.logprobs
                prev.finish_reason = d.finish_reason or prev.finish_reason
                if d.stop_reason is not None:
                    prev.stop_reason = d.stop_reason
                prev.error = d.error or prev.error
                prev.retry_after_s = d.retry_after_s or prev.retry_after_s
        return merged

    def _failure(self, merged: dict[int, SeqDelta]) -> OpenAIError | None:
        for d in merged.values():
            if d.finish_reason is not None and d.finish_reason not in _OPENAI_FINISH_REASONS:
                return generation_failed(d.error, d.retry_after_s)
        return None

    def _check_whole(self) -> None:
        for c in self.choices:
            if c.finish_reason not in _OPENAI_FINISH_REASONS:
                raise generation_failed(c.error, c.retry_after_s)

    @staticmethod
    def usage(finished: Finished) -> UsageInfo:
        return UsageInfo.of(finished.prompt_tokens, finished.completion_tokens,
                            finished.cached_tokens)

    @staticmethod
    def error_event(exc: BaseException) -> str:
        return sse_event(error_body(exc))

    def start_events(self) -> list[str]:
        return []

    @abstractmethod
    def stream_events(self, deltas: list[SeqDelta]) -> list[str]:
        """SSE events for one batch of deltas (an error event and [DONE] if a choice failed)."""

    @abstractmethod
    def _usage_chunk(self, usage: UsageInfo) -> str:
        """The final SSE event that carries only the usage totals."""

    @abstractmethod
    def response(self, finished: Finished) -> CompletionResponse | ChatCompletionResponse:
        """The whole response, after every batch went through `add`."""

    def done_events(self, finished: Finished) -> list[str]:
        usage = [self._usage_chunk(self.usage(finished))] if self.include_usage else []
        return [*usage, SSE_DONE]

    def add(self, deltas: list[SeqDelta]) -> None:
        self._merge(deltas)

    def _sse_tail(self, failure: OpenAIError | None) -> list[str]:
        # A failed choice ends the whole stream: an error event, then [DONE].
        return [] if failure is None else [self.error_event(failure), SSE_DONE]


class CompletionFormatter(Formatter):
    """`text_completion` bodies and stream events for one completions request."""

    def __init__(self, model: str, num_choices: int, include_usage: bool,
                 want_logprobs: bool) -> None:
        super().__init__(model, num_choices, include_usage)
        self.id = random_id("cmpl")
        self.want_logprobs = want_logprobs

    def _legacy_logprobs(self, choice: _Choice, entries: list[TokenLogprob] | None
                         ) -> CompletionLogprobs | None:
        if not self.want_logprobs:
            return None
        out = CompletionLogprobs()
        for e in entries or []:
            out.tokens.append(e.token)
            out.token_logprobs.append(e.logprob)
            out.top_logprobs.append(dict(e.top))
            out.text_offset.append(choice.text_offset)
            choice.text_offset += len(e.token)
        return out

    def stream_events(self, deltas: list[SeqDelta]) -> list[str]:
        merged = self._merge(deltas)
        failure = self._failure(merged)
        if failure is not None:
            return self._sse_tail(failure)
        choices = [CompletionChoice(index=i, text=d.text, finish_reason=d.finish_reason,
                                    stop_reason=d.stop_reason,
                                    logprobs=self._legacy_logprobs(self.choices[i], d.logprobs))
                   for i, d in sorted(merged.items())]
        return [sse_event(CompletionStreamResponse(id=self.id, model=self.model,
                                                   choices=choices))]

    def _usage_chunk(self, usage: UsageInfo) -> str:
        return sse_event(CompletionStreamResponse(id=self.id, model=self.model, choices=[],
                                                  usage=usage))

    def response(self, finished: Finished) -> CompletionResponse:
        self._check_whole()
        choices = []
        for i, c in enumerate(self.choices):
            c.text_offset = 0
            choices.append(CompletionChoice(index=i, text=c.text, finish_reason=c.finish_reason,
                                            stop_reason=c.stop_reason,
                                            logprobs=self._legacy_logprobs(c, c.logprobs)))
        return CompletionResponse(id=self.id, model=self.model, choices=choices,
                                  usage=self.usage(finished),
                                  kv_transfer_params=finished.kv_transfer_params)


class ChatFormatter(Formatter):
    """`chat.completion` bodies and `chat.completion.chunk` events for one chat request.

    Each choice's text goes through a `ChatOutputParser` (`new_parser`, one per choice: the
    configured reasoning parser and the request's tool parser) that splits it into
    `reasoning_content`, `content` and `tool_calls`; a choice that called tools and stopped
    finishes with "tool_calls". A whole response parses each choice's whole text with a new
    parser, so it matches the stream of the same generation."""

    def __init__(self, model: str, num_choices: int, include_usage: bool,
                 want_logprobs: bool,
                 new_parser: Callable[[], ChatOutputParser] = ChatOutputParser) -> None:
        super().__init__(model, num_choices, include_usage)
        self.id = random_id("chatcmpl")
        self.want_logprobs = want_logprobs
        self._new_parser = new_parser
        self._parsers = [new_parser() for _ in range(num_choices)]

    def _chat_logprobs(self, entries: list[TokenLogprob] | None) -> ChatChoiceLogprobs | None:
        if not self.want_logprobs:
            return None
        return ChatChoiceLogprobs(content=[
            ChatLogprob(token=e.token, logprob=e.logprob, bytes=list(e.token.encode()),
                        top_logprobs=[TopLogprob(token=t, logprob=v, bytes=list(t.encode()))
                                      for t, v in e.top])
            for e in entries or []])

    def _chunk(self, choices: list[ChatCompletionStreamChoice]) -> str:
        return sse_event(ChatCompletionStreamResponse(id=self.id, model=self.model,
                                                      choices=choices))

    def start_events(self) -> list[str]:
        """The first chunk of every choice carries the role, as OpenAI sends it."""
        return [self._chunk([ChatCompletionStreamChoice(
            index=i, delta=DeltaMessage(role="assistant", content=""))
            for i in range(len(self.choices))])]

    def stream_events(self, deltas: list[SeqDelta]) -> list[str]:
        merged = self._merge(deltas)
        failure = self._failure(merged)
        if failure is not None:
            return self._sse_tail(failure)
        choices = []
        for i, d in sorted(merged.items()):
            parser = self._parsers[i]
            out = parser.feed(d.text)
            if d.finish_reason is not None:
                out.extend(parser.finish())
            elif not out and d.text and not self.want_logprobs:
                continue  # the parser holds this text back (a tag may be starting)
            choices.append(ChatCompletionStreamChoice(
                index=i, delta=_delta_message(out),
                finish_reason=_finish_reason(d.finish_reason, parser),
                stop_reason=d.stop_reason, logprobs=self._chat_logprobs(d.logprobs)))
        return [self._chunk(choices)] if choices else []

    def _usage_chunk(self, usage: UsageInfo) -> str:
        return sse_event(ChatCompletionStreamResponse(id=self.id, model=self.model, choices=[],
                                                      usage=usage))

    def response(self, finished: Finished) -> ChatCompletionResponse:
        self._check_whole()
        choices = []
        for i, c in enumerate(self.choices):
            parser = self._new_parser()
            out = parser.feed(c.text)
            out.extend(parser.finish())
            choices.append(ChatCompletionChoice(
                index=i, message=_whole_message(out),
                finish_reason=_finish_reason(c.finish_reason, parser),
                stop_reason=c.stop_reason, logprobs=self._chat_logprobs(c.logprobs)))
        return ChatCompletionResponse(id=self.id, model=self.model, choices=choices,
                                      usage=self.usage(finished),
                                      kv_transfer_params=finished.kv_transfer_params)


def _finish_reason(reason: str | None, parser: ChatOutputParser) -> str | None:
    return "tool_calls" if reason == "stop" and parser.num_tool_calls else reason


def _delta_message(out: OutputDelta) -> DeltaMessage:
    """A chunk's delta: text as `content` ("" when nothing else came either), reasoning and
    tool-call pieces in their own fields."""
    other = bool(out.reasoning or out.tool_calls)
    return DeltaMessage(
        content=out.content if out.content or not other else None,
        reasoning_content=out.reasoning or None,
        tool_calls=[DeltaToolCall(index=t.index, id=t.id, type="function" if t.id else None,
                                  function=DeltaFunctionCall(name=t.name, arguments=t.arguments))
                    for t in out.tool_calls] or None)


def _whole_message(out: OutputDelta) -> ChatResponseMessage:
    """A choice's message: with tool calls, content is only what is more than layout."""
    calls = _join_calls(out.tool_calls)
    content: str | None = out.content
    if calls:
        content = out.content.strip() or None
    return ChatResponseMessage(content=content, reasoning_content=out.reasoning or None,
                               tool_calls=calls)


def _join_calls(pieces: list[ToolCallDelta]) -> list[ToolCall]:
    calls: dict[int, ToolCall] = {}
    for piece in pieces:
        call = calls.get(piece.index)
        if call is None:
            assert piece.id is not None and piece.name is not None, "a call starts with its id"
            calls[piece.index] = ToolCall(id=piece.id, function=FunctionCall(
                name=piece.name, arguments=piece.arguments))
        else:
            call.function.arguments += piece.arguments
    return [calls[i] for i in sorted(calls)]
