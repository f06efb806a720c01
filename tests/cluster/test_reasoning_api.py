"""Reasoning output through the real chat route, in process (no Ray): a random tiny Qwen3 with
a Qwen3-style tokenizer and template (tests/reasoning_checkpoint.py), served with the `qwen3`
reasoning parser and driven by the official `openai` client.

A random model never thinks by itself, so the tests make it: vLLM's `structured_outputs`
regex (xgrammar) forces the shape `<think>...</think>...` and leaves the words to the model.
A second app on the same server, without a reasoning parser, returns the raw text of the same
greedy generation, which is what the parsed fields are checked against.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from fastapi.testclient import TestClient

from tests.reasoning_checkpoint import EMPTY_THINK, write_qwen3_thinking_checkpoint
from tokenflow.cluster.chat_output import ChatOptions
from tokenflow.cluster.openai_serving import LocalBackend, OpenAIServing, build_openai_app
from tokenflow.cluster.server import LLMServer

MODEL = "qwen3-thinking"
MESSAGES = [{"role": "user", "content": "what is the answer?"}]
# The forced shape: a thought, then an answer; the lengths leave the model choices to make.
THINKING = r"<think>[a-z ]{1,12}</think>\n\n[a-z ]{1,12}"
FORCED = {"temperature": 0.0, "max_tokens": 64,
          "extra_body": {"structured_outputs": {"regex": THINKING}}}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_qwen3_thinking_checkpoint(tmp_path_factory.mktemp("qwen3-thinking"))


@pytest.fixture(scope="module")
def server(checkpoint: Path) -> Iterator[LLMServer]:
    llm_server = LLMServer({"model": {"model": str(checkpoint)}, "cache": {"num_blocks": 64},
                            "scheduler": {"max_model_len": 256}})
    yield llm_server
    llm_server.engine.shutdown()


def _client(server: LLMServer, checkpoint: Path, chat: ChatOptions) -> Iterator[openai.OpenAI]:
    serving = OpenAIServing(LocalBackend(server), MODEL, tokenizer=str(checkpoint), chat=chat)
    with TestClient(build_openai_app(serving)) as http:
        yield openai.OpenAI(base_url=f"{http.base_url}/v1", api_key="test", http_client=http,
                            max_retries=0)


@pytest.fixture(scope="module")
def thinking(server: LLMServer, checkpoint: Path) -> Iterator[openai.OpenAI]:
    """The app with the qwen3 reasoning parser."""
    yield from _client(server, checkpoint, ChatOptions(reasoning_parser="qwen3"))


@pytest.fixture(scope="module")
def raw(server: LLMServer, checkpoint: Path) -> Iterator[openai.OpenAI]:
    """The same server without a reasoning parser: the generated text as it is."""
    yield from _client(server, checkpoint, ChatOptions())


def chat(client: openai.OpenAI, **kwargs: Any) -> Any:
    return client.chat.completions.create(model=MODEL, messages=MESSAGES, **kwargs)


def stream_fields(client: openai.OpenAI, **kwargs: Any) -> tuple[list[str], list[str]]:
    """The non-empty deltas of a streamed chat completion in order of arrival: their kinds
    ("reasoning_content" or "content") and their texts."""
    kinds: list[str] = []
    texts: list[str] = []
    for chunk in chat(client, stream=True, **kwargs):
        for choice in chunk.choices:
            delta = choice.delta
            for kind in ("reasoning_content", "content"):
                text = getattr(delta, kind, None) or (delta.model_extra or {}).get(kind)
                if text:
                    kinds.append(kind)
                    texts.append(text)
    return kinds, texts


def test_checkpoint_is_qwen3_shaped(checkpoint: Path) -> None:
    from transformers import AutoTokenizer

    from tokenflow.replica.loading.tokenizer import Tokenizer

    ours, theirs = Tokenizer.from_dir(checkpoint), AutoTokenizer.from_pretrained(checkpoint)
    for tag in ("<think>", "</think>"):
        tag_id = ours.token_to_id(tag)
        # One added token, not special: decoding keeps it, so the parser sees the tags.
        assert ours.encode(tag, add_special_tokens=False) == [tag_id]
        assert tag_id not in ours.all_special_ids
    ids = ours.encode("<think>a b</think>\n\nc<|im_end|>", add_special_tokens=False)
    assert ours.decode(ids) == "<think>a b</think>\n\nc"
    assert ours.eos_token_ids == {ours.token_to_id("<|im_end|>")}
    for kwargs in ({}, {"enable_thinking": True}, {"enable_thinking": False}):
        prompt = ours.apply_chat_template(MESSAGES, **kwargs)
        assert prompt == theirs.apply_chat_template(MESSAGES, tokenize=False,
                                                    add_generation_prompt=True, **kwargs)
        tail = EMPTY_THINK if kwargs.get("enable_thinking") is False else ""
        assert prompt.endswith("<|im_start|>assistant\n" + tail)
    # As Qwen3's template does, earlier turns are shown without their thinking.
    history = [*MESSAGES, {"role": "assistant", "content": "<think>\nhm\n</think>\n\n42"},
               {"role": "user", "content": "why?"}]
    assert "<|im_start|>assistant\n42<|im_end|>" in ours.apply_chat_template(history)


@pytest.fixture(scope="module")
def raw_text(raw: openai.OpenAI) -> str:
    text = chat(raw, **FORCED).choices[0].message.content
    # The regex held: the model thought and then answered.
    assert re.fullmatch(THINKING, text), text
    return text


def test_message_splits_reasoning_from_content(thinking: openai.OpenAI, raw_text: str) -> None:
    thought, answer = re.fullmatch(r"<think>(.*)</think>(.*)", raw_text, re.S).groups()
    response = chat(thinking, **FORCED)
    message = response.choices[0].message
    assert message.model_extra["reasoning_content"] == thought
    assert message.content == answer  # "\n\n..." : the newlines after </think> stay
    assert response.choices[0].finish_reason == "stop"


def test_stream_sends_reasoning_deltas_then_content_deltas(thinking: openai.OpenAI,
                                                           raw_text: str) -> None:
    message = chat(thinking, **FORCED).choices[0].message
    kinds, texts = stream_fields(thinking, **FORCED)
    # All reasoning first, then all content, and more than one delta of each (the tiny
    # tokenizer spells words in pieces): the thought streams as it is generated.
    assert kinds == sorted(kinds, key=lambda k: k != "reasoning_content")
    assert kinds.count("reasoning_content") > 1 and kinds.count("content") > 1
    reasoning = "".join(t for k, t in zip(kinds, texts, strict=True) if k == "reasoning_content")
    content = "".join(t for k, t in zip(kinds, texts, strict=True) if k == "content")
    assert (reasoning, content) == (message.model_extra["reasoning_content"], message.content)
    assert f"<think>{reasoning}</think>{content}" == raw_text


def test_enable_thinking_false_reaches_the_template(thinking: openai.OpenAI,
                                                    checkpoint: Path) -> None:
    from tokenflow.replica.loading.tokenizer import Tokenizer

    empty_think = len(Tokenizer.from_dir(checkpoint).encode(EMPTY_THINK,
                                                            add_special_tokens=False))
    default = chat(thinking, max_tokens=1).usage.prompt_tokens
    off = chat(thinking, max_tokens=1,
               extra_body={"chat_template_kwargs": {"enable_thinking": False}}).usage
    on = chat(thinking, max_tokens=1,
              extra_body={"chat_template_kwargs": {"enable_thinking": True}}).usage
    assert off.prompt_tokens == default + empty_think
    assert on.prompt_tokens == default


def test_without_thinking_the_output_is_content(thinking: openai.OpenAI) -> None:
    # With enable_thinking false the template closed the think block in the prompt: whatever
    # the model writes, tags included, is the answer (vLLM's qwen3 rule).
    off = {**FORCED, "extra_body": {**FORCED["extra_body"],
                                    "chat_template_kwargs": {"enable_thinking": False}}}
    message = chat(thinking, **off).choices[0].message
    assert re.fullmatch(THINKING, message.content), message.content
    assert not message.model_extra.get("reasoning_content")
    kinds, texts = stream_fields(thinking, **off)
    assert set(kinds) == {"content"} and "".join(texts) == message.content
