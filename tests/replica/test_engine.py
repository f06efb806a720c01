"""End to end on real checkpoints: every scheduling path is token-exact against transformers."""

from __future__ import annotations

import random
import shutil

import pytest
import torch

from tests.checkpoints import write_checkpoint
from tokenflow.replica.engine.llm import LLM
from tokenflow.replica.loading.model_source import tiny_model_dir
from tokenflow.scheduler import SamplingParams

NUM_NEW = 10


def with_tokenizer(path):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model_dir() / name, path / name)
    return path


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def checkpoint(request, tmp_path_factory):
    path = write_checkpoint(tmp_path_factory.mktemp(request.param), request.param)
    return with_tokenizer(path), request.param


def make_prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, 512) for _ in range(40)]
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (5, 17, 33, 60, 9, 48)]
    prompts += [shared + [7, 8, 9], shared + [10, 11, 12, 13, 14]]
    return prompts


@torch.inference_mode()
def hf_greedy(hf_model, prompt: list[int], num_new: int) -> tuple[list[int], torch.Tensor]:
    """Reference: transformers' own greedy `generate`, plus the first step's log-probs."""
    out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=num_new, do_sample=False,
                            pad_token_id=0, return_dict_in_generate=True, output_logits=True)
    first_logprobs = torch.log_softmax(out.logits[0][0].float(), dim=-1)
    return out.sequences[0, len(prompt):].tolist(), first_logprobs


@pytest.fixture(scope="module")
def reference(checkpoint):
    path, _ = checkpoint
    hf_model = _load_hf(path)
    return {i: hf_greedy(hf_model, p, NUM_NEW) for i, p in enumerate(make_prompts())}


def _load_hf(path):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # compare full lengths, as ignore_eos does
    return model


SCENARIOS = {
    "plain": dict(max_num_batched_tokens=4096, num_blocks=512, block_size=16),
    "chunked_prefill": dict(max_num_batched_tokens=32, num_blocks=512, block_size=16),
    "preemption": dict(max_num_batched_tokens=64, num_blocks=24, block_size=4),
    "no_prefix_cache": dict(max_num_batched_tokens=4096, num_blocks=512, block_size=8,
                            enable_prefix_caching=False),
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_greedy_is_token_exact_on_every_path(checkpoint, reference, scenario):
    path, _ = checkpoint
    llm = LLM(str(path), max_model_len=256, **SCENARIOS[scenario])
    params = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True, logprobs=3)
    prompts = make_prompts()
    # Warm the prefix cache with the shared prefix, so the last two prompts hit it.
    llm.generate([prompts[-1][:40] + [99]], SamplingParams(max_tokens=1), use_tqdm=False)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for i, out in enumerate(outputs):
        expected, first_logprobs = reference[i]
        assert out.outputs[0].token_ids == expected, f"prompt {i} ({scenario})"
        chosen = out.outputs[0].logprobs[0]
        assert chosen.token_ids[0] == expected[0]
        assert chosen.logprobs[0] == pytest.approx(first_logprobs[expected[0]].item(), abs=1e-4)
    llm.engine.check_idle()
    if scenario != "no_prefix_cache":
        assert outputs[-1].num_cached_tokens >= 32  # the shared prefix was a cache hit


def test_preemption_really_happens(checkpoint, reference):
    path, _ = checkpoint
    llm = LLM(str(path), max_model_len=256, **SCENARIOS["preemption"])
    params = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)
    outputs = llm.generate(make_prompts(), params, use_tqdm=False)
    assert llm.totals.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outputs] == [reference[i][0] for i in range(8)]


def test_identical_prompts_in_one_step_share_blocks_exactly(checkpoint, reference):
    path, _ = checkpoint
    llm = LLM(str(path), max_model_len=256, num_blocks=512, max_num_batched_tokens=4096)
    params = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)
    prompt = make_prompts()[3]  # 60 tokens: 3 full blocks computed by its twin this step
    outputs = llm.generate([prompt, prompt], params, use_tqdm=False)
    assert outputs[1].num_cached_tokens == 48
    assert [o.outputs[0].token_ids for o in outputs] == [reference[3][0]] * 2


def test_seeded_request_same_alone_and_in_busy_batch(checkpoint):
    path, _ = checkpoint
    llm = LLM(str(path), max_model_len=256, max_num_batched_tokens=48, num_blocks=512)
    seeded = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=1234,
                            ignore_eos=True)
    prompt = make_prompts()[2]
    alone = llm.generate([prompt], seeded, use_tqdm=False)[0].outputs[0].token_ids
    noisy = SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True)
    batch = [make_prompts(1)[i] for i in range(5)]
    outputs = llm.generate(batch[:3] + [prompt] + batch[3:],
                           [noisy] * 3 + [seeded] + [noisy] * 2, use_tqdm=False)
    assert outputs[3].outputs[0].token_ids == alone


def test_n_children_share_prompt_blocks(checkpoint):
    path, _ = checkpoint
    llm = LLM(str(path), max_model_len=256, num_blocks=512)
    params = SamplingParams(n=3, max_tokens=5, temperature=1.0, seed=5, ignore_eos=True)
    (out,) = llm.generate([make_prompts()[3]], params, use_tqdm=False)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 5 for c in out.outputs)
    assert out.num_cached_tokens >= 48  # a child hit the blocks its sibling computed


def test_prompt_logprobs_match_transformers(checkpoint):
    path, _ = checkpoint
    llm = LLM(str(path), max_model_len=256, max_num_batched_tokens=16,
              enable_prefix_caching=False, num_blocks=256)
    prompt = make_prompts()[2]
    params = SamplingParams(max_tokens=1, prompt_logprobs=2, temperature=0.0)
    (out,) = llm.generate([prompt], params, use_tqdm=False)
    plp = out.prompt_logprobs
    assert len(plp) == len(prompt) and plp[0] is None
    with torch.inference_mode():
        logits = _load_hf(path)(torch.tensor([prompt])).logits[0].float()
    expected = torch.log_softmax(logits, dim=-1)
    for j in range(1, len(prompt)):
        assert plp[j].token_ids[0] == prompt[j]
        assert plp[j].logprobs[0] == pytest.approx(expected[j - 1, prompt[j]].item(), abs=1e-4)
        assert len(plp[j].token_ids) == 3


def test_cli_generate_on_a_checkpoint_directory(checkpoint):
    import subprocess
    import sys

    path, _ = checkpoint
    result = subprocess.run(
        [sys.executable, "-m", "tokenflow.cli", "generate", "--model", str(path), "Hello",
         "--max-tokens", "4", "--num-blocks", "32"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "'Hello' -> " in result.stdout


def test_bad_input_is_a_clear_error(checkpoint):
    path, _ = checkpoint
    llm = LLM(str(path), max_model_len=64, num_blocks=64)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], use_tqdm=False)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([[5] * 64], use_tqdm=False)
    with pytest.raises(ValueError, match=r"\[0, 512\)"):
        llm.generate([[5, 9999]], use_tqdm=False)
    with pytest.raises(ValueError, match="exceed"):
        llm.generate([[5] * 10], SamplingParams(max_tokens=60), use_tqdm=False)
    # The engine keeps working.
    assert llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False)


def test_a_bfloat16_cache_gives_every_path_the_same_tokens(checkpoint):
    """`cache.kv_cache_dtype: bfloat16` under the float32 model: the K/V are rounded as they
    are stored, and every path attends over the stored values (a whole prompt over its own
    rounded K/V too), so chunked prefill, prefix hits and preemption give the plain path's
    tokens (not transformers' float32 ones, which a near tie may part from)."""
    path, _ = checkpoint
    params = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)
    prompts = make_prompts()
    tokens = {}
    for scenario, geometry in SCENARIOS.items():
        llm = LLM(str(path), max_model_len=256, kv_cache_dtype="bfloat16", **geometry)
        llm.generate([prompts[-1][:40] + [99]], SamplingParams(max_tokens=1), use_tqdm=False)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        tokens[scenario] = [o.outputs[0].token_ids for o in outputs]
        if scenario == "preemption":
            assert llm.totals.num_preemptions > 0
        if scenario == "plain":
            assert outputs[-1].num_cached_tokens >= 32
        llm.shutdown()
    assert all(t == tokens["plain"] for t in tokens.values()), tokens
