"""One `POST /v1/responses` generation as the Responses API's output items: a whole response
object, or the typed SSE events that build it (the schemas are in responses_api.py).

The generated text goes through a `ChatOutputParser` (chat_output.py), which splits it into
reasoning, content and tool calls. Each becomes an output item, opened when its first text
arrives and closed when another item opens or the output ends: reasoning is a `reasoning`
item (one `reasoning_text` part), content a `message` item (one `output_text` part), each tool
call a `function_call` item. An item opens with its first text that is not only whitespace
(the line breaks around a tool call make no message). A stream is

    response.created, response.in_progress,
    per item: response.output_item.added,
              content_part.added, output_text.delta | reasoning_text.delta ...,
                  output_text.done | reasoning_text.done, content_part.done
              (a function call: function_call_arguments.delta ..., .done instead),
              response.output_item.done,
    response.completed, or response.incomplete when the length limit cut the output
    (`max_output_tokens`, or the context),

each event with a `sequence_number` counting from 0, and no `data: [DONE]` (OpenAI sends
none). An engine failure ends a stream with `response.failed`, after an `error` event when the
backend itself broke; the `[DONE]` that `openai_serving._sse` writes after a failure is one
that clients ignore. A whole response is built from the same batches through the same parser,
so it equals the stream's final response.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel

from tokenflow.cluster.chat_output import ChatOutputParser, OutputDelta, ToolCallDelta
from tokenflow.cluster.errors import OpenAIError, error_body
from tokenflow.cluster.messages import Finished, SeqDelta
from tokenflow.cluster.protocol import SSE_DONE, UsageInfo
from tokenflow.cluster.responses import Formatter
from tokenflow.cluster.responses_api import (
    IncompleteDetails,
    ItemStatus,
    OutputFunctionCall,
    OutputItem,
    OutputMessage,
    OutputReasoning,
    OutputText,
    ReasoningText,
    ResponseError,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
    response_id,
)

ItemKind = Literal["reasoning", "message", "function_call"]
_ID_PREFIX = {"reasoning": "rs", "message": "msg", "function_call": "fc"}


@dataclass
class _Item:
    """One output item while it is built; `text` is a function call's arguments."""

    kind: ItemKind
    index: int  # its output_index
    id: str
    text: str = ""
    status: ItemStatus = "in_progress"
    call_id: str = ""
    name: str = ""

    def part(self) -> OutputText | ReasoningText:
        return OutputText(text=self.text) if self.kind == "message" else ReasoningText(
            text=self.text)

    def model(self, with_part: bool = True) -> OutputItem:
        """The item as the API shows it; `with_part=False`: as `output_item.added` shows it,
        before its content part is added."""
        if self.kind == "function_call":
            return OutputFunctionCall(id=self.id, status=self.status, call_id=self.call_id,
                                      name=self.name, arguments=self.text)
        if self.kind == "message":
            return OutputMessage(id=self.id, status=self.status,
                                 content=[OutputText(text=self.text)] if with_part else [])
        return OutputReasoning(id=self.id, status=self.status,
                               content=[ReasoningText(text=self.text)] if with_part else [])


def _sse(event_type: str, sequence_number: int, fields: dict[str, Any]) -> str:
    payload = {"type": event_type, "sequence_number": sequence_number}
    for name, value in fields.items():
        payload[name] = value.model_dump(mode="json") if isinstance(value, BaseModel) else value
    return f"event: {event_type}\ndata: {json.dumps(payload)}\n\n"


class ResponsesFormatter(Formatter):
    """Owns one Responses request's output: its parser, its items in the order they opened
    (the open one, if any, is the last), and the stream's next sequence number. One choice:
    the Responses API has no `n`."""

    def __init__(self, request: ResponsesRequest, model: str, parser: ChatOutputParser) -> None:
        super().__init__(model, 1, include_usage=False)
        self.id = response_id("resp")
        self._request = request
        self._parser = parser
        self._streaming = request.stream
        self._created_at = int(time.time())
        self._items: list[_Item] = []
        self._open: _Item | None = None
        self._calls: dict[int, _Item] = {}  # a tool call's index -> its item
        self._held = ("", "")  # (kind, whitespace) that may yet start an item
        self._events: list[str] = []
        self._sequence_number = 0
        self._num_tokens = 0
        self._reasoning_tokens = 0
        self._answered = False

    # ------------------------------------------------------------------------ streaming
    def start_events(self) -> list[str]:
        snapshot = self._snapshot("in_progress")
        self._emit("response.created", response=snapshot)
        self._emit("response.in_progress", response=snapshot)
        return self._take()

    def stream_events(self, deltas: list[SeqDelta]) -> list[str]:
        failure = self._add_batch(deltas)
        if failure is not None:
            self._fail(failure.message)
            return [*self._take(), SSE_DONE]  # SSE_DONE: `_sse` ends the stream here
        return self._take()

    def done_events(self, finished: Finished) -> list[str]:
        final = self._finish(finished)
        self._emit(f"response.{final.status}", response=final)
        return self._take()

    def error_event(self, exc: BaseException) -> str:  # type: ignore[override]
        """The backend broke mid-stream: an `error` event, then `response.failed`."""
        error = error_body(exc)["error"]
        self._emit("error", code=error["code"] or error["type"], message=error["message"],
                   param=error["param"])
        self._fail(error["message"])
        return "".join(self._take())

    def _usage_chunk(self, usage: UsageInfo) -> str:
        raise AssertionError("the usage rides on the final response event (done_events)")

    # ---------------------------------------------------------------------------- whole
    def add(self, deltas: list[SeqDelta]) -> None:
        self._add_batch(deltas)

    def response(self, finished: Finished) -> ResponseObject:  # type: ignore[override]
        self._check_whole()
        return self._finish(finished)

    # ---------------------------------------------------------------------------- items
    def _add_batch(self, deltas: list[SeqDelta]) -> OpenAIError | None:
        merged = self._merge(deltas)
        failure = self._failure(merged)
        if failure is None:
            for delta in merged.values():
                self._feed(delta)
        return failure

    def _feed(self, delta: SeqDelta) -> None:
        out = self._parser.feed(delta.text)
        # The parser sees text, not tokens: the reasoning tokens are those of the batches up
        # to the last one that added reasoning before any answer (an estimate when one batch
        # holds the end of the reasoning and the start of the answer).
        self._num_tokens += len(delta.token_ids)
        if out.reasoning and not self._answered:
            self._reasoning_tokens = self._num_tokens
        self._answered = self._answered or bool(out.content or out.tool_calls)
        self._apply(out)

    def _apply(self, out: OutputDelta) -> None:
        if out.reasoning:
            self._add_text("reasoning", out.reasoning)
        if out.content:
            self._add_text("message", out.content)
        for call in out.tool_calls:
            self._add_call(call)

    def _add_text(self, kind: ItemKind, text: str) -> None:
        item = self._open
        if item is None or item.kind != kind:
            held_kind, held = self._held
            text = (held if held_kind == kind else "") + text
            if not text.strip():
                self._held = (kind, text)
                return
            self._held = ("", "")
            item = self._start(kind)
        item.text += text
        ids = {"item_id": item.id, "output_index": item.index, "content_index": 0}
        if kind == "message":
            self._emit("response.output_text.delta", **ids, delta=text, logprobs=[])
        else:
            self._emit("response.reasoning_text.delta", **ids, delta=text)

    def _add_call(self, call: ToolCallDelta) -> None:
        item = self._calls.get(call.index)
        if item is None:
            item = self._start("function_call", call_id=call.id or response_id("call"),
                               name=call.name or "")
            self._calls[call.index] = item
        if call.arguments:
            item.text += call.arguments
            self._emit("response.function_call_arguments.delta", item_id=item.id,
                       output_index=item.index, delta=call.arguments)

    def _start(self, kind: ItemKind, **fields: str) -> _Item:
        self._close("completed")
        item = _Item(kind, len(self._items), response_id(_ID_PREFIX[kind]), **fields)
        self._items.append(item)
        self._open = item
        self._emit("response.output_item.added", output_index=item.index,
                   item=item.model(with_part=False))
        if kind != "function_call":
            self._emit("response.content_part.added", item_id=item.id,
                       output_index=item.index, content_index=0, part=item.part())
        return item

    def _close(self, status: ItemStatus) -> None:
        item, self._open = self._open, None
        if item is None:
            return
        item.status = status
        ids = {"item_id": item.id, "output_index": item.index}
        if item.kind == "function_call":
            self._emit("response.function_call_arguments.done", **ids, arguments=item.text)
        else:
            if item.kind == "message":
                self._emit("response.output_text.done", **ids, content_index=0,
                           text=item.text, logprobs=[])
            else:
                self._emit("response.reasoning_text.done", **ids, content_index=0,
                           text=item.text)
            self._emit("response.content_part.done", **ids, content_index=0, part=item.part())
        self._emit("response.output_item.done", output_index=item.index, item=item.model())

    # -------------------------------------------------------------------------- the end
    def _finish(self, finished: Finished) -> ResponseObject:
        self._apply(self._parser.finish())
        cut = self.choices[0].finish_reason == "length"
        self._close("incomplete" if cut else "completed")
        usage = ResponseUsage.of(finished.prompt_tokens, finished.completion_tokens,
                                 finished.cached_tokens, self._reasoning_tokens)
        if cut:
            return self._snapshot("incomplete", usage=usage,
                                  incomplete_details=IncompleteDetails())
        return self._snapshot("completed", usage=usage, completed_at=int(time.time()))

    def _fail(self, message: str) -> None:
        if self._open is not None:
            self._open.status = "incomplete"
            self._open = None
        self._emit("response.failed",
                   response=self._snapshot("failed", error=ResponseError(message=message)))

    def _snapshot(self, status: str, **fields: Any) -> ResponseObject:
        return ResponseObject(id=self.id, created_at=self._created_at, status=status,
                              model=self.model, output=[item.model() for item in self._items],
                              **self._request.echo(), **fields)

    def _emit(self, event_type: str, **fields: Any) -> None:
        if self._streaming:
            self._events.append(_sse(event_type, self._sequence_number, fields))
            self._sequence_number += 1

    def _take(self) -> list[str]:
        events, self._events = self._events, []
        return events
