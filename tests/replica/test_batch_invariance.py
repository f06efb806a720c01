"""Batch invariance on the default model as it ships (SmolLM2's Q4_1 file kept at 4 bits, a
bfloat16 KV cache, `batch_invariant` on): a request's greedy tokens are the same alone, in a
batch of others, after a prefix-cache hit, in chunks, preempted and recomputed, and continued
from its own tokens as an engine restart continues it (the prompt plus the tokens it was given,
computed as one prompt). The compiled engine (configs/local.yaml's) is checked in the slow
tier."""

from __future__ import annotations

import pytest

from tokenflow.replica.engine.llm import LLM
from tokenflow.replica.loading.model_source import SMOLLM2_MODEL_NAME
from tokenflow.replica.loading.resolve import load_tokenizer
from tokenflow.scheduler import SamplingParams

QUESTIONS = [
    "What is the capital of France?",
    "What is the capital of Italy?",
    "Write a haiku about the sea.",
    "Why is the sky blue?",
]
OTHERS = [
    "Name three colours.",
    "Translate 'good morning' into Spanish.",
    "List the days of the week, one per line, and say which one you like best and why.",
    "What is 2 + 3?",
    "Tell me a story about a dragon who learns to read, in five sentences.",
    "What does a bee make?",
]
NEW_TOKENS = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


def _chat(question: str) -> list[int]:
    tok = load_tokenizer(SMOLLM2_MODEL_NAME)
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": question}]),
                      add_special_tokens=False)


def _llm(**overrides) -> LLM:
    settings = {"kv_cache_dtype": "bfloat16", "max_model_len": 512, "num_blocks": 256,
                "max_num_batched_tokens": 512, **overrides}
    return LLM(SMOLLM2_MODEL_NAME, **settings)


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def assert_batch_invariant(make_llm) -> None:
    """Every way of running QUESTIONS gives each the tokens it gets alone on a fresh engine."""
    prompts = [_chat(q) for q in QUESTIONS]
    others = [_chat(q) for q in OTHERS]
    alone = []
    for p in prompts:
        llm = make_llm()
        alone.append(_greedy(llm, [p])[0])
        llm.shutdown()

    llm = make_llm()
    # In a batch: beside each other and six more, some of them sampled (they still share
    # every step's matmuls), the questions' order reversed.
    sampled = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=40)
    batch = [*others[:3], *reversed(prompts), *others[3:]]
    params = [sampled] * 3 + [GREEDY] * len(prompts) + [sampled] * 3
    outs = llm.generate(batch, params, use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outs[3:3 + len(prompts)]][::-1]
    assert got == alone, "in a batch"
    # Prefix-cache hits: now every question's prompt is cached (and the default system
    # prompt's blocks for any chat).
    hits_before = llm.totals.prefix_cache_hits
    assert _greedy(llm, prompts) == alone, "after a prefix hit"
    assert llm.totals.prefix_cache_hits > hits_before
    # Continued from its own tokens, as a restarted engine continues a request: the prompt and
    # the first k tokens computed as one prompt give the rest. A fresh engine: no prefix hit.
    llm.shutdown()
    llm = make_llm()
    for p, tokens in zip(prompts, alone, strict=True):
        for k in (1, 9):
            rest = llm.generate([p + tokens[:k]],
                                SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS - k,
                                               ignore_eos=True), use_tqdm=False)
            assert rest[0].outputs[0].token_ids == tokens[k:], f"continued after {k}"
    llm.shutdown()
    # In chunks of 16 tokens a step, with a pool so small that requests are preempted and
    # computed again.
    llm = make_llm(max_num_batched_tokens=16, num_blocks=12, enable_prefix_caching=False)
    outs = llm.generate([*prompts, *others[:2]], GREEDY, use_tqdm=False)
    assert llm.totals.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs[:len(prompts)]] == alone, "chunked, preempted"
    llm.shutdown()


def test_a_greedy_request_gets_the_same_tokens_whatever_runs_beside_it() -> None:
    assert_batch_invariant(_llm)


@pytest.mark.slow
def test_the_compiled_default_is_batch_invariant_too() -> None:
    """configs/local.yaml's engine: the layers compiled (a graph for one token, and dynamic
    ones for more)."""
    assert_batch_invariant(lambda **kw: _llm(compile=True, **kw))
