"""Engine contracts found by acceptance testing: min_tokens, sliding windows, one context limit,
all-or-nothing batches, prompt logprobs under prefix caching, refused config fields."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from tests.checkpoints import write_checkpoint
from tests.replica.test_engine import SCENARIOS, make_prompts, with_tokenizer
from tokenflow.replica.engine.llm import LLM
from tokenflow.replica.models.config import ModelArchConfig
from tokenflow.scheduler import SamplingParams


def _hf(path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.inference_mode()
def _hf_generate(model, prompt: list[int], **kwargs) -> list[int]:
    out = model.generate(torch.tensor([prompt]), do_sample=False, pad_token_id=0, **kwargs)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return with_tokenizer(write_checkpoint(tmp_path_factory.mktemp("llama"), "llama"))


# ----------------------------------------------------------------------------- min_tokens
def test_min_tokens_masks_stop_tokens_as_transformers_does(llama):
    hf = _hf(llama)
    hf.generation_config.eos_token_id = None
    prompts = make_prompts()[:4]
    llm = LLM(str(llama), max_model_len=256, num_blocks=256)
    for prompt in prompts:
        # The token greedy decoding picks first, made a stop token: without the mask it would
        # be sampled at position 0 and end (or be kept and run on) the request.
        stop = _hf_generate(hf, prompt, max_new_tokens=1)[0]
        expected = _hf_generate(hf, prompt, max_new_tokens=12, min_new_tokens=4,
                                eos_token_id=[stop])
        params = SamplingParams(max_tokens=12, min_tokens=4, temperature=0.0,
                                stop_token_ids=[stop], ignore_eos=True)
        (out,) = llm.generate([prompt], params, use_tqdm=False)
        got = out.outputs[0].token_ids
        assert stop not in got[:4]
        assert got == expected, prompt
        if stop in got:
            assert got[-1] == stop and out.outputs[0].finish_reason == "stop"


def test_min_tokens_also_holds_back_eos(llama):
    hf = _hf(llama)
    prompt = make_prompts()[1]
    eos = _hf_generate(hf, prompt, max_new_tokens=1, eos_token_id=None)[0]
    expected = _hf_generate(hf, prompt, max_new_tokens=8, min_new_tokens=3, eos_token_id=eos)
    llm = LLM(str(llama), max_model_len=256, num_blocks=256)
    # Treat that token as the model's EOS for this engine's request.
    processed = llm.engine.process_inputs("x", prompt, SamplingParams(
        max_tokens=8, min_tokens=3, temperature=0.0))
    for request in processed.sequences:
        request.eos_token_id = eos
    llm.engine.add_processed(processed)
    got = []
    while llm.engine.has_unfinished_requests():
        for delta in llm.engine.step():
            got += delta.outputs[0].token_ids
    assert got == expected and eos not in got[:3]


# -------------------------------------------------------------------------- sliding window
@pytest.fixture(scope="module", params=["mistral", "qwen2"])
def windowed(request, tmp_path_factory):
    overrides = {"sliding_window": 8}
    if request.param == "qwen2":  # layer 0 full, layer 1 windowed
        overrides.update(use_sliding_window=True, max_window_layers=1)
    path = write_checkpoint(tmp_path_factory.mktemp(request.param), request.param, **overrides)
    return with_tokenizer(path)


@pytest.mark.parametrize("scenario", ["plain", "chunked_prefill", "preemption"])
def test_sliding_window_is_token_exact_past_the_window(windowed, scenario):
    arch = ModelArchConfig.from_model_dir(windowed)
    assert 8 in arch.sliding_windows
    hf = _hf(windowed)
    hf.generation_config.eos_token_id = None
    prompts = make_prompts()  # 5 to 60 tokens: most are longer than the window
    expected = [_hf_generate(hf, p, max_new_tokens=12) for p in prompts]
    llm = LLM(str(windowed), max_model_len=256, **SCENARIOS[scenario])
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected


def test_a_math_changing_config_field_we_do_not_implement_is_refused(tmp_path, llama):
    for field, value in [("hidden_act", "gelu"), ("attn_logit_softcapping", 30.0),
                         ("mlp_bias", True)]:
        cfg = json.loads((llama / "config.json").read_text())
        cfg[field] = value
        with pytest.raises(ValueError, match=field):
            ModelArchConfig.from_hf_config(cfg)


# ------------------------------------------------------------------------ all or nothing
@pytest.mark.parametrize("ids", [[1.5], [True], ["3"], 3, [1, 2.0]])
def test_first_token_ids_are_token_ids_or_the_request_is_refused(llama, ids):
    """A client's `kv_transfer_params.first_token_ids` that are not integers are refused
    before the engine sees them (a float passed the range check and took the engine loop down
    in block hashing), and the engine serves on."""
    llm = LLM(str(llama), max_model_len=64, num_blocks=64)
    with pytest.raises(ValueError, match="first_token_ids"):
        llm.engine.process_inputs("bad", [1, 2, 3], SamplingParams(max_tokens=4),
                                  kv_transfer_params={"first_token_ids": ids})
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_generate_is_all_or_nothing(llama):
    llm = LLM(str(llama), max_model_len=64, num_blocks=64)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([[5, 6, 7], [5] * 100], SamplingParams(max_tokens=2), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    (out,) = llm.generate([[8, 9]], SamplingParams(max_tokens=2), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 2  # and only this request ran


# --------------------------------------------------------------------- one max_model_len
def test_one_max_model_len_everywhere(llama, caplog):
    with caplog.at_level(logging.WARNING):
        llm = LLM(str(llama), num_blocks=4, block_size=16, max_model_len=256)
    assert "lowered from 256 to 64" in caplog.text
    engine = llm.engine
    assert engine.max_model_len == engine.scheduler.max_model_len == 64
    with pytest.raises(ValueError, match="max_model_len=64"):
        llm.generate([[5] * 100], use_tqdm=False)
    (out,) = llm.generate([[5] * 40], SamplingParams(max_tokens=None, ignore_eos=True),
                          use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 24  # max_tokens defaults to the room left


# -------------------------------------------------------------- prompt logprobs and cache
def test_prompt_logprobs_skip_the_prefix_cache(llama):
    llm = LLM(str(llama), max_model_len=256, num_blocks=256)
    prompt = make_prompts()[3]
    llm.generate([prompt[:40] + [1, 2]], SamplingParams(max_tokens=1), use_tqdm=False)
    params = SamplingParams(max_tokens=1, prompt_logprobs=1, temperature=0.0)
    (cached,) = llm.generate([prompt], params, use_tqdm=False)
    fresh = LLM(str(llama), max_model_len=256, num_blocks=256, enable_prefix_caching=False)
    (plain,) = fresh.generate([prompt], params, use_tqdm=False)
    assert cached.num_cached_tokens == 0
    assert cached.prompt_logprobs[0] is None and all(cached.prompt_logprobs[1:])
    assert len(cached.prompt_logprobs) == len(prompt)
    for a, b in zip(cached.prompt_logprobs[1:], plain.prompt_logprobs[1:], strict=True):
        assert a.token_ids == b.token_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)


def test_prompt_logprobs_are_sent_once_across_a_preemption(llama):
    llm = LLM(str(llama), max_model_len=256, **SCENARIOS["preemption"])
    params = SamplingParams(max_tokens=10, prompt_logprobs=0, temperature=0.0, ignore_eos=True)
    prompts = make_prompts()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.totals.num_preemptions > 0
    for prompt, out in zip(prompts, outputs, strict=True):
        assert len(out.prompt_logprobs) == len(prompt)
        assert [e.token_ids[0] for e in out.prompt_logprobs[1:]] == prompt[1:]
