"""One choice's generated text split into what the OpenAI APIs return: reasoning, content and
tool calls, as the text streams.

A `ChatOutputParser` per choice chains an optional reasoning parser (`<think>...</think>`,
tokenflow/cluster/reasoning.py) and an optional tool-call parser (tokenflow/cluster/tool_calls.py):
the reasoning parser takes the raw text first; what it calls content goes on to the tool parser.
A whole (non-streamed) response is the same parser fed everything, so a streamed and a
non-streamed response of one generation always agree.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol


def tag_prefix_len(text: str, tag: str) -> int:
    """How many characters at the end of `text` could be the start of `tag` (held back by a
    parser until the next delta says whether the tag is there)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


@dataclass
class ToolCallDelta:
    """A piece of one tool call: its first delta has `id` and `name` (and maybe arguments),
    later ones only fragments of the arguments' JSON text (OpenAI's `delta.tool_calls`)."""

    index: int  # which call of the choice: 0, 1, ...
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class OutputDelta:
    """What one batch of text added to a choice, by kind."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)

    def extend(self, other: OutputDelta) -> None:
        self.reasoning += other.reasoning
        self.content += other.content
        for call in other.tool_calls:
            self.add_call(call)

    def add_call(self, piece: ToolCallDelta) -> None:
        """Append a call piece; argument fragments of the same call are joined into one."""
        last = self.tool_calls[-1] if self.tool_calls else None
        if last is not None and piece.id is None and last.index == piece.index:
            last.arguments += piece.arguments
        else:
            self.tool_calls.append(piece)


@dataclass(frozen=True)
class ChatOptions:
    """The chat side of the API, from the engine config: which chat template renders prompts
    (None: the model's own; a .jinja path or a shipped template's name), which parser finds
    tool calls in `tool_choice: auto` output, and which splits off reasoning (None: none)."""

    chat_template: str | None = None
    tool_call_parser: str = "hermes"
    reasoning_parser: str | None = None

    @classmethod
    def from_engine(cls, engine: Any) -> ChatOptions:
        """From an `EngineConfig` (or its dict form)."""
        get = engine.get if isinstance(engine, dict) else lambda k, d: getattr(engine, k, d)
        return cls(get("chat_template", None), get("tool_call_parser", "hermes"),
                   get("reasoning_parser", None))


class ReasoningParser(Protocol):
    """Splits a choice's text into reasoning and content as it streams (one per choice)."""

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, content) added by `text`; may hold back text that could be the start
        of a tag until more arrives."""

    def finish(self) -> tuple[str, str]:
        """What is still held back, at the end of the output."""


class ToolParser(Protocol):
    """Turns a choice's content into text and tool calls as it streams (one per choice)."""

    def feed(self, text: str) -> OutputDelta:
        """Content and tool-call pieces added by `text` (never reasoning)."""

    def finish(self) -> OutputDelta:
        """What is still held back, at the end of the output."""

    @property
    def num_calls(self) -> int:
        """How many tool calls the output held so far."""


class ChatOutputParser:
    """Owns one choice's parsers: reasoning first, then tool calls on what is content."""

    def __init__(self, reasoning: ReasoningParser | None = None,
                 tools: ToolParser | None = None) -> None:
        self._reasoning = reasoning
        self._tools = tools

    @property
    def num_tool_calls(self) -> int:
        return 0 if self._tools is None else self._tools.num_calls

    def feed(self, text: str) -> OutputDelta:
        if self._reasoning is None:
            return self._content(text)
        reasoning, content = self._reasoning.feed(text)
        out = self._content(content)
        out.reasoning = reasoning + out.reasoning
        return out

    def finish(self) -> OutputDelta:
        out = OutputDelta()
        if self._reasoning is not None:
            reasoning, content = self._reasoning.finish()
            out.reasoning = reasoning
            out.extend(self._content(content))
        if self._tools is not None:
            out.extend(self._tools.finish())
        return out

    def _content(self, text: str) -> OutputDelta:
        if self._tools is None:
            return OutputDelta(content=text)
        return self._tools.feed(text) if text else OutputDelta()
