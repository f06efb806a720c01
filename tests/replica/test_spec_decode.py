"""Speculative decoding with n-gram (prompt lookup) drafts: greedy output is identical with and
without it (and to transformers) on every scheduling path, seeded sampling too; drafts really
get accepted on repetitive text; the acceptance rule samples the model's distribution."""

from __future__ import annotations

import collections
import random

import pytest
import torch

from tests.checkpoints import write_checkpoint
from tests.replica.engine_state import kv_blocks
from tests.replica.test_engine import SCENARIOS, _load_hf, hf_greedy, with_tokenizer
from tokenflow.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from tokenflow.replica.engine.llm import LLM
from tokenflow.replica.worker.drafter import NgramDrafter
from tokenflow.replica.worker.model_runner import _accept
from tokenflow.replica.worker.sampler import Sampler, SamplingMetadata
from tokenflow.scheduler import SamplingParams

NUM_NEW = 24


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return with_tokenizer(write_checkpoint(tmp_path_factory.mktemp("spec"), "llama"))


def repetitive_prompts() -> list[list[int]]:
    """Prompts whose continuations tend to copy earlier text (so drafts get accepted), and one
    random one."""
    rng = random.Random(0)
    phrase = [rng.randrange(3, 512) for _ in range(12)]
    return [phrase * 4, [5, 6, 7, 8] * 10, phrase[:6] * 5 + phrase,
            [rng.randrange(3, 512) for _ in range(30)]]


def engine(path, speculative: bool, **scenario) -> LLM:
    return LLM(config=EngineConfig(
        model=ModelConfig(model=str(path)),
        cache=CacheConfig(block_size=scenario.get("block_size", 16),
                          num_blocks=scenario.get("num_blocks", 256)),
        scheduler=SchedulerConfig(max_model_len=256, max_num_batched_tokens=scenario.get(
            "max_num_batched_tokens", 4096)),
        speculative=SpeculativeConfig(method="ngram" if speculative else None,
                                      num_speculative_tokens=4, prompt_lookup_min=1)))


@pytest.mark.parametrize("scenario", ["plain", "chunked_prefill", "preemption"])
def test_greedy_is_identical_with_speculation(checkpoint, scenario) -> None:
    prompts = repetitive_prompts()
    hf = _load_hf(checkpoint)
    expected = [hf_greedy(hf, p, NUM_NEW)[0] for p in prompts]
    llm = engine(checkpoint, True, **SCENARIOS[scenario])
    params = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    totals = llm.totals
    assert totals.num_accepted_tokens > 0  # the drafts were used, not just proposed
    assert totals.num_accepted_tokens_per_pos[0] >= totals.num_accepted_tokens_per_pos[-1]
    free, total = kv_blocks(llm.engine)
    assert free == total


def test_seeded_sampling_is_identical_with_speculation(checkpoint) -> None:
    prompts = repetitive_prompts()
    params = [SamplingParams(max_tokens=NUM_NEW, temperature=0.7, seed=100 + i,
                             ignore_eos=True) for i in range(len(prompts))]
    plain = engine(checkpoint, False).generate(prompts, params, use_tqdm=False)
    spec = engine(checkpoint, True)
    fast = spec.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in fast] == [o.outputs[0].token_ids for o in plain]
    assert spec.totals.num_draft_tokens > 0


def test_drafter_proposes_what_followed_the_last_match() -> None:
    import numpy as np

    drafter = NgramDrafter(k=3, min_n=1, max_n=3)
    # The longest suffix that occurred before wins: "1 2 3", seen at the start.
    assert drafter.propose(np.array([1, 2, 3, 4, 5, 9, 2, 3, 4, 7, 1, 2, 3])) == [4, 5, 9]
    # "8 2 3" never occurred; "2 3" did, most recently before "4 7 8".
    tokens = np.array([1, 2, 3, 4, 5, 9, 2, 3, 4, 7, 8, 2, 3])
    assert drafter.propose(tokens) == [4, 7, 8]
    assert drafter.propose(tokens, max_tokens=1) == [4]
    assert drafter.propose(np.array([1, 2, 3, 4])) == []  # nothing repeats


def test_accepting_drafts_samples_the_models_distribution() -> None:
    """Sample-then-compare against a deterministic draft: the emitted token at the first
    position follows the model's distribution exactly, and the draft is accepted with its
    probability (what rejection sampling does for a one-hot proposal)."""
    torch.manual_seed(0)
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0], [0.0, 0.0, 0.0, 0.0]])
    probs = logits[0].softmax(-1)
    draft = 1
    sampler = Sampler(seed=123)
    params = [SamplingParams(temperature=1.0)] * 2
    counts: collections.Counter[int] = collections.Counter()
    accepted = 0
    trials = 4000
    for _ in range(trials):
        meta = SamplingMetadata.build(params, [[], [draft]], [[1], [1]], "cpu")
        tokens = sampler(logits, meta).sampled_token_ids.tolist()
        kept = _accept(tokens, 0, [draft])
        counts[kept[0]] += 1
        accepted += kept[0] == draft
    for token, p in enumerate(probs.tolist()):
        assert abs(counts[token] / trials - p) < 0.03, (token, counts[token] / trials, p)
    assert abs(accepted / trials - probs[draft].item()) < 0.03
