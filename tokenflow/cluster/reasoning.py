"""Reasoning parsers: split a choice's text at `</think>` into reasoning and content as it
streams (the `ReasoningParser` protocol of tokenflow/cluster/chat_output.py), by vLLM's names.

The rules, taken from vLLM's `qwen3` and `deepseek_r1` parsers:
- Text before `</think>` is reasoning, text after it is content. A `<think>` at the very start
  of the output is dropped: Qwen3's original templates let the model open the block itself,
  later ones (Qwen3-2507 thinking, Qwen3.5) and DeepSeek-R1 put it in the prompt, so the
  output may start inside the reasoning.
- Output with no `</think>` at all is reasoning: the block was never closed, which means the
  output was cut off mid-thought (vLLM's rule since it learnt the prompt-side `<think>`).
- `qwen3` only: with `chat_template_kwargs={"enable_thinking": False}` the template closes an
  empty block in the prompt, so the whole output is content, tags included. (vLLM streams it as
  content the same way; its whole-response path would still split at a `</think>`, which a
  stream cannot do without holding everything back.) `deepseek_r1` has no such switch.
- Content starts right after `</think>`: the newlines a model writes there ("</think>\\n\\n")
  stay in the content, as vLLM's two parsers leave them.

A stream agrees with the whole: feeding a text in any split and then `finish()` gives the same
concatenated reasoning and content as feeding it at once. The only text held back between
deltas is a possible prefix of a tag (`<thi` at the start, `</thi` at the end of a delta).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tokenflow.cluster.chat_output import ReasoningParser, tag_prefix_len

THINK_START = "<think>"
THINK_END = "</think>"


class ThinkReasoningParser:
    """Owns one choice's position in a `<think>...</think>` output (start, reasoning or
    content) and the few characters held back because they may begin a tag."""

    _START, _REASONING, _CONTENT = "start", "reasoning", "content"

    def __init__(self, chat_template_kwargs: Mapping[str, Any] | None = None) -> None:
        del chat_template_kwargs  # no switch: the output always opens with reasoning
        self._state = self._START
        self._held = ""

    def feed(self, text: str) -> tuple[str, str]:
        text = self._held + text
        self._held = ""
        if self._state == self._START:
            if THINK_START.startswith(text) and len(text) < len(THINK_START):
                self._held = text  # may still become "<think>": decide on the next delta
                return "", ""
            self._state = self._REASONING
            text = text.removeprefix(THINK_START)
        if self._state == self._CONTENT:
            return "", text
        reasoning, tag, content = text.partition(THINK_END)
        if tag:
            self._state = self._CONTENT
            return reasoning, content
        keep = tag_prefix_len(text, THINK_END)
        self._held = text[len(text) - keep:]
        return text[:len(text) - keep], ""

    def finish(self) -> tuple[str, str]:
        # What is held is a tag's prefix that never completed: plain reasoning text (a
        # content state holds nothing).
        held, self._held = self._held, ""
        return held, ""


class DeepSeekR1ReasoningParser(ThinkReasoningParser):
    """DeepSeek-R1 (and QwQ): reasoning until `</think>`, whether or not the output opens with
    `<think>`; the model always reasons, so no chat_template_kwargs switch applies."""


class Qwen3ReasoningParser(ThinkReasoningParser):
    """Qwen3: as DeepSeek-R1, except that `enable_thinking: false` (the template then closes an
    empty think block in the prompt) makes the whole output content."""

    def __init__(self, chat_template_kwargs: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        if (chat_template_kwargs or {}).get("enable_thinking", True) is False:
            self._state = self._CONTENT


REASONING_PARSERS: dict[str, type[ThinkReasoningParser]] = {
    "qwen3": Qwen3ReasoningParser,
    "deepseek_r1": DeepSeekR1ReasoningParser,
}


def reasoning_parser(name: str,
                     chat_template_kwargs: Mapping[str, Any] | None = None) -> ReasoningParser:
    """A new parser for one choice, by vLLM's name; `chat_template_kwargs` are the request's
    (Qwen3 reads `enable_thinking` from them)."""
    cls = REASONING_PARSERS.get(name)
    if cls is None:
        raise ValueError(f"unknown reasoning parser {name!r}; valid: "
                         f"{', '.join(sorted(REASONING_PARSERS))}")
    return cls(chat_template_kwargs)
