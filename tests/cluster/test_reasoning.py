"""Reasoning parsers (tokenflow/cluster/reasoning.py): the split rules of `qwen3` and
`deepseek_r1`, and that a stream cut anywhere gives what the whole text gives."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from tokenflow.cluster.chat_output import ChatOutputParser
from tokenflow.cluster.reasoning import REASONING_PARSERS, reasoning_parser

NAMES = sorted(REASONING_PARSERS)
NO_THINKING = {"enable_thinking": False}

# (text, reasoning, content) under both parsers with thinking on.
CASES = [
    ("<think>\nwhy not\n</think>\n\nthe answer", "\nwhy not\n", "\n\nthe answer"),
    ("why not</think>the answer", "why not", "the answer"),  # <think> was in the prompt
    ("<think>why</think>", "why", ""),
    ("</think>only content", "", "only content"),
    ("<think></think>", "", ""),
    ("", "", ""),
    # No </think>: a block never closed, cut off mid-thought.
    ("<think>still thinking", "still thinking", ""),
    ("still thinking", "still thinking", ""),
    ("ends in a partial </thi", "ends in a partial </thi", ""),
    ("<thi", "<thi", ""),
    ("<", "<", ""),
    # Only a leading <think> is a tag; later ones, and a second </think>, are text.
    ("a <think>b</think>c", "a <think>b", "c"),
    ("<think><think>x</think>y</think>z", "<think>x", "y</think>z"),
    (" <think>x</think>y", " <think>x", "y"),
    # Near misses of the tags stay text, whichever side they are on.
    ("<thinking>x</thinker></think><think>y", "<thinking>x</thinker>", "<think>y"),
    ("<</think>>", "<", ">"),
    ("<think></</think></think>", "</", "</think>"),
    ("répondre → 答え</think>😀 ok", "répondre → 答え", "😀 ok"),
]
# What `enable_thinking: false` makes of the same texts under qwen3: all content.
TEXTS = [text for text, _, _ in CASES]


def run_whole(name: str, text: str, kwargs: dict[str, Any] | None = None) -> tuple[str, str]:
    parser = reasoning_parser(name, kwargs)
    r1, c1 = parser.feed(text)
    r2, c2 = parser.finish()
    return r1 + r2, c1 + c2


def run_split(name: str, pieces: list[str], kwargs: dict[str, Any] | None = None
              ) -> tuple[str, str]:
    parser = reasoning_parser(name, kwargs)
    reasoning = content = ""
    for piece in [*pieces, None]:
        r, c = parser.feed(piece) if piece is not None else parser.finish()
        reasoning += r
        content += c
    return reasoning, content


def splits(text: str, max_cuts: int = 2) -> list[list[str]]:
    """`text` cut at every choice of up to `max_cuts` points (empty pieces included)."""
    out = []
    for k in range(max_cuts + 1):
        for cuts in itertools.combinations_with_replacement(range(len(text) + 1), k):
            bounds = [0, *cuts, len(text)]
            out.append([text[a:b] for a, b in itertools.pairwise(bounds)])
    return out


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize(("text", "reasoning", "content"), CASES)
def test_whole_text_split(name: str, text: str, reasoning: str, content: str) -> None:
    assert run_whole(name, text) == (reasoning, content)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize(("text", "reasoning", "content"), CASES)
def test_every_split_gives_the_whole_result(name: str, text: str, reasoning: str,
                                            content: str) -> None:
    for pieces in splits(text):
        assert run_split(name, pieces) == (reasoning, content), pieces
    # One character at a time, the way a tokenizer with no merges would stream it.
    assert run_split(name, list(text)) == (reasoning, content)


@pytest.mark.parametrize("text", TEXTS)
def test_qwen3_without_thinking_is_all_content(text: str) -> None:
    assert run_whole("qwen3", text, NO_THINKING) == ("", text)
    for pieces in splits(text, max_cuts=1):
        assert run_split("qwen3", pieces, NO_THINKING) == ("", text)


def test_only_the_qwen3_parser_reads_enable_thinking() -> None:
    text = "<think>x</think>y"
    assert run_whole("deepseek_r1", text, NO_THINKING) == ("x", "y")
    assert run_whole("qwen3", text, {"enable_thinking": True}) == ("x", "y")
    assert run_whole("qwen3", text, {"other": 1}) == ("x", "y")


def test_holds_back_only_a_possible_tag_prefix() -> None:
    parser = reasoning_parser("qwen3")
    assert parser.feed("<th") == ("", "")  # may be <think>
    assert parser.feed("ink>a b</th") == ("a b", "")  # may be </think>
    assert parser.feed("is") == ("</this", "")  # was not
    assert parser.feed(" x <") == (" x ", "")
    assert parser.feed("/think>\n\nhi <") == ("", "\n\nhi <")  # content holds nothing back
    assert parser.feed("/think>") == ("", "/think>")
    assert parser.finish() == ("", "")


def test_a_stream_of_reasoning_is_not_delayed() -> None:
    # Reasoning streams out as it comes: only the last characters that may start </think>
    # wait, so a client sees the thought while it is being written.
    parser = reasoning_parser("deepseek_r1")
    assert parser.feed("Let me see") == ("Let me see", "")
    assert parser.feed(", 2 < 3") == (", 2 < 3", "")
    assert parser.feed(" so </") == (" so ", "")
    assert parser.finish() == ("</", "")


def test_parsers_are_separate_instances() -> None:
    a, b = reasoning_parser("qwen3"), reasoning_parser("qwen3")
    assert a is not b
    assert a.feed("x</think>") == ("x", "")
    assert b.feed("y") == ("y", "")


def test_unknown_name_lists_the_valid_ones() -> None:
    with pytest.raises(ValueError, match="'granite'.*deepseek_r1, qwen3"):
        reasoning_parser("granite")


def test_chained_before_content_in_chat_output_parser() -> None:
    # The chat output parser passes reasoning through and what is content on; fed in deltas.
    parser = ChatOutputParser(reasoning=reasoning_parser("qwen3"))
    reasoning = content = ""
    for delta in ["<thi", "nk>ab", "c</th", "ink>\n\nde", "f"]:
        out = parser.feed(delta)
        reasoning += out.reasoning
        content += out.content
    out = parser.finish()
    assert (reasoning + out.reasoning, content + out.content) == ("abc", "\n\ndef")
