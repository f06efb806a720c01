"""Tool-call parsers: one choice's output text → content and tool calls, as it streams.

Each parser implements `chat_output.ToolParser` (`feed`, `finish`, `num_calls`), one instance
per choice. Parsers for `tool_choice: auto`, chosen by `engine.tool_call_parser`:
- `hermes`: calls inside `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (SmolLM2
  with tokenflow's tool template, Qwen 2.5/3, Hermes); text around them is content.
- `llama3_json`: an output that is one or more bare `{"name": ..., "parameters": {...}}`
  objects (separated by `;`, optionally after `<|python_tag|>`) is calls (Llama 3.x).
Parsers of constrained output (tokenflow/cluster/tools.py): `NamedCallParser` (the output is
the named function's arguments) and `CallArrayParser` (a JSON array of calls).

A call streams as OpenAI's `delta.tool_calls` do: its id and name first (as soon as the name's
string closes), then fragments of the arguments' JSON text as they arrive. A block that turns
out not to be a call (not JSON, no name) is given back as content, so no text is lost.
"""

from __future__ import annotations

import json
import secrets
from abc import ABC, abstractmethod

from tokenflow.cluster.chat_output import OutputDelta, ToolCallDelta, tag_prefix_len

_NAME_KEYS = ("name",)
_ARGUMENT_KEYS = ("arguments", "parameters")


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


class _CallObject:
    """Scans one JSON object `{"name": ..., "arguments": ...}` character by character: knows
    the name once its string closes, and which characters are the arguments' value."""

    def __init__(self) -> None:
        self.raw = ""
        self.name: str | None = None
        self.arguments = ""
        self.has_arguments = False
        self.closed = False
        self.invalid = False  # the text is not an object
        self._depth = 0
        self._in_string = False
        self._escape = False
        self._expect_key = True
        self._key: str | None = None
        self._string = ""  # the top-level string being read (key or value)
        self._value: str | None = None  # "container", "string" or "literal": arguments' kind

    def push(self, ch: str) -> str:
        """Scan one character; returns it when it belongs to the arguments' value."""
        self.raw += ch
        if self._depth == 0:
            if ch == "{":
                self._depth = 1
            elif not ch.isspace():
                self.invalid = True
            return ""
        taken = self._take_argument(ch)
        self._lex(ch)
        return taken

    def _take_argument(self, ch: str) -> str:
        """Whether `ch` (not yet lexed) is part of the arguments' value."""
        if self._value is None:
            is_start = (self._key in _ARGUMENT_KEYS and not self._expect_key
                        and self._depth == 1 and not self._in_string
                        and not ch.isspace() and ch not in ":,}")
            if not is_start or self.has_arguments:
                return ""
            self._value = ("container" if ch in "{[" else "string" if ch == '"'
                           else "literal")
            self.has_arguments = True
        elif self._value == "literal" and self._depth == 1 and ch in ",}":
            self._value = "done"
            return ""
        if self._value == "done":
            return ""
        self.arguments += ch
        return ch

    def _lex(self, ch: str) -> None:
        if self._in_string:
            self._lex_string(ch)
        elif ch == '"':
            self._in_string = True
            self._string = ""
        elif ch in "{[":
            self._depth += 1
        elif ch in "}]":
            self._depth -= 1
            if self._depth == 1 and self._value == "container":
                self._value = "done"
            self.closed = self._depth == 0
        elif self._depth == 1 and ch in ":,":
            self._expect_key = ch == ","

    def _lex_string(self, ch: str) -> None:
        if self._escape:
            self._escape = False
        elif ch == "\\":
            self._escape = True
        elif ch == '"':
            self._in_string = False
            self._string_closed()
            return
        if self._depth == 1:
            self._string += ch

    def _string_closed(self) -> None:
        if self._depth != 1:
            return
        try:
            text = json.loads(f'"{self._string}"')
        except json.JSONDecodeError:
            self.invalid = True
            return
        if self._expect_key:
            self._key = text
        elif self._key in _NAME_KEYS and self.name is None:
            self.name = text
        if self._value == "string":
            self._value = "done"


class _CallStream:
    """Turns scanned call objects into `ToolCallDelta`s: a call's first delta waits for its
    name (arguments seen before it are sent with it)."""

    def __init__(self) -> None:
        self.num_calls = 0
        self._object: _CallObject | None = None
        self._started = False

    @property
    def open(self) -> bool:
        return self._object is not None

    def start(self) -> None:
        self._object = _CallObject()
        self._started = False

    def push(self, ch: str) -> list[ToolCallDelta]:
        obj = self._object
        assert obj is not None
        fragment = obj.push(ch)
        out: list[ToolCallDelta] = []
        if not self._started and obj.name is not None:
            self._started = True
            self.num_calls += 1
            out.append(ToolCallDelta(self.num_calls - 1, new_call_id(), obj.name,
                                     obj.arguments))
        elif self._started and fragment:
            out.append(ToolCallDelta(self.num_calls - 1, arguments=fragment))
        if obj.closed and self._started and not obj.has_arguments:
            out.append(ToolCallDelta(self.num_calls - 1, arguments="{}"))
        return out

    @property
    def closed(self) -> bool:
        return self._object is not None and self._object.closed

    @property
    def invalid(self) -> bool:
        """The object is not a call: not JSON, or it closed without a name."""
        obj = self._object
        return obj is not None and (obj.invalid or (obj.closed and obj.name is None))

    @property
    def started(self) -> bool:
        return self._started

    def end(self) -> str:
        """Forget the current object; returns its raw text."""
        assert self._object is not None
        raw, self._object = self._object.raw, None
        return raw


class BaseToolParser(ABC):
    """Shared state of a parser: the call stream and the text not yet decided."""

    def __init__(self) -> None:
        self._calls = _CallStream()
        self._buffer = ""

    @property
    def num_calls(self) -> int:
        return self._calls.num_calls

    def feed(self, text: str) -> OutputDelta:
        self._buffer += text
        out = OutputDelta()
        self._parse(out)
        return out

    @abstractmethod
    def _parse(self, out: OutputDelta) -> None:
        """Move what can be decided from the buffer into `out`."""

    def _scan_char(self, out: OutputDelta) -> None:
        """Move the buffer's first character into the open call object."""
        ch, self._buffer = self._buffer[0], self._buffer[1:]
        for piece in self._calls.push(ch):
            out.add_call(piece)

    def finish(self) -> OutputDelta:
        out = OutputDelta()
        if self._calls.open and not self._calls.started:
            out.content += self._unparsed_call()
        out.content += self._buffer
        self._buffer = ""
        return out

    def _unparsed_call(self) -> str:
        return self._calls.end()


class HermesToolParser(BaseToolParser):
    """`<tool_call>{"name": ..., "arguments": ...}</tool_call>` blocks; the rest is content."""

    START, END = "<tool_call>", "</tool_call>"

    def _parse(self, out: OutputDelta) -> None:
        while self._buffer:
            if not self._calls.open:
                i = self._buffer.find(self.START)
                if i < 0:
                    keep = tag_prefix_len(self._buffer, self.START)
                    self._content(out, self._buffer[:len(self._buffer) - keep])
                    self._buffer = self._buffer[len(self._buffer) - keep:]
                    return
                self._content(out, self._buffer[:i])
                self._buffer = self._buffer[i + len(self.START):]
                self._calls.start()
            elif not self._close_call(out):
                return

    def _close_call(self, out: OutputDelta) -> bool:
        """Scan the open call; True once its block ended (the buffer holds what follows)."""
        while self._buffer and not (self._calls.closed or self._calls.invalid):
            self._scan_char(out)
        if self._calls.invalid and not self._calls.started:
            # Not a call: wait for the block's end, then give it all back as content.
            i = self._buffer.find(self.END)
            if i < 0:
                return False
            out.content += self.START + self._calls.end() + self._buffer[:i + len(self.END)]
            self._buffer = self._buffer[i + len(self.END):]
            return True
        if not self._calls.closed:
            return False
        rest = self._buffer.lstrip()
        if len(rest) < len(self.END) and self.END.startswith(rest):
            return False  # the start of the end tag is all there is: wait
        self._calls.end()
        self._buffer = rest.removeprefix(self.END)
        return True

    def _content(self, out: OutputDelta, text: str) -> None:
        # Between and after calls, whitespace alone is layout, not an answer.
        if self.num_calls and not text.strip():
            return
        out.content += text

    def _unparsed_call(self) -> str:
        return self.START + self._calls.end()


class Llama3JsonToolParser(BaseToolParser):
    """An output that starts with `{` (after `<|python_tag|>` if any) is calls:
    `{"name": ..., "parameters": ...}` objects separated by `;`. Anything else is content."""

    PYTHON_TAG = "<|python_tag|>"

    def __init__(self) -> None:
        super().__init__()
        self._mode: str | None = None  # None: undecided, "calls" or "content"
        self._lead = ""  # what came before the first object (given back if it is no call)

    def _parse(self, out: OutputDelta) -> None:
        if self._mode is None and not self._decide():
            return
        if self._mode == "content":
            out.content += self._buffer
            self._buffer = ""
            return
        while self._buffer:
            if not self._calls.open:
                rest = self._buffer.lstrip(" \t\r\n;")
                if not rest:
                    self._buffer = ""
                    return
                if not rest.startswith("{"):  # text after the calls
                    self._mode = "content"
                    out.content += rest
                    self._buffer = ""
                    return
                self._buffer = rest
                self._calls.start()
            self._scan_char(out)
            if self._calls.invalid and not self._calls.started:
                self._mode = "content"
                lead = "" if self.num_calls else self._lead
                out.content += lead + self._calls.end() + self._buffer
                self._buffer = ""
                return
            if self._calls.closed:
                self._calls.end()

    def _decide(self) -> bool:
        text = self._buffer.lstrip()
        if not text or (self.PYTHON_TAG.startswith(text) and text != self.PYTHON_TAG):
            return False
        text = text.removeprefix(self.PYTHON_TAG).lstrip()
        if not text:
            return False
        self._mode = "calls" if text.startswith("{") else "content"
        if self._mode == "calls":
            self._lead = self._buffer[:len(self._buffer) - len(text)]
            self._buffer = text
        return True


class NamedCallParser:
    """Output constrained to one named function's arguments: all of it is that call's
    arguments (`tool_choice` naming a function)."""

    def __init__(self, name: str) -> None:
        self._name = name
        self.num_calls = 0

    def feed(self, text: str) -> OutputDelta:
        if not text:
            return OutputDelta()
        if self.num_calls == 0:
            self.num_calls = 1
            return OutputDelta(tool_calls=[ToolCallDelta(0, new_call_id(), self._name, text)])
        return OutputDelta(tool_calls=[ToolCallDelta(0, arguments=text)])

    def finish(self) -> OutputDelta:
        if self.num_calls == 0:  # no output at all (max_tokens ended it): still the call
            return self.feed("{}")
        return OutputDelta()


class CallArrayParser(BaseToolParser):
    """Output constrained to a JSON array of `{"name", "arguments"}` objects
    (`tool_choice: required`)."""

    def _parse(self, out: OutputDelta) -> None:
        while self._buffer:
            if not self._calls.open:
                rest = self._buffer.lstrip(" \t\r\n[,")
                if not rest.startswith("{"):
                    self._buffer = ""  # the separators and the closing bracket
                    return
                self._buffer = rest
                self._calls.start()
            self._scan_char(out)
            if self._calls.closed or self._calls.invalid:
                self._calls.end()


TOOL_PARSERS: dict[str, type[BaseToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
}


def tool_parser(name: str) -> BaseToolParser:
    """A new parser of `tool_choice: auto` output, by its `engine.tool_call_parser` name."""
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool_call_parser {name!r}; valid: "
                         f"{', '.join(TOOL_PARSERS)}") from None
