"""GGUF end to end: greedy output token-exact against transformers' `generate` on the same
file, 8 prompts through chunked prefill, prefix-cache hits and preemption (as
tests/replica/test_engine.py does for safetensors checkpoints), on a tiny file of each family."""

from __future__ import annotations

import pytest
import torch

from tests.gguf_checkpoints import FAMILIES, GGUF_NAME, write_gguf
from tests.replica.test_engine import NUM_NEW, SCENARIOS, hf_greedy, make_prompts
from tokenflow.replica.engine.llm import LLM
from tokenflow.scheduler import SamplingParams

transformers = pytest.importorskip("transformers")


def load_hf(model_dir, name: str = GGUF_NAME):
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(model_dir), gguf_file=name, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # compare full lengths, as ignore_eos does
    return model


def run(llm: LLM, prompts: list[list[int]], num_new: int) -> list:
    params = SamplingParams(max_tokens=num_new, temperature=0.0, ignore_eos=True)
    return llm.generate(prompts, params, use_tqdm=False)


@pytest.fixture(scope="module", params=list(FAMILIES))
def tiny(request, tmp_path_factory):
    path = write_gguf(tmp_path_factory.mktemp(request.param), request.param)
    hf = load_hf(path)
    reference = [hf_greedy(hf, p, NUM_NEW)[0] for p in make_prompts()]
    return path, reference


@pytest.mark.parametrize("scenario", ["chunked_prefill", "preemption"])
def test_tiny_gguf_greedy_is_token_exact(tiny, scenario) -> None:
    path, reference = tiny
    # The float path: transformers dequantizes the file to float32 too (quantization: auto
    # would keep the 4-bit weights: tests/replica/test_quantized.py).
    llm = LLM(str(path), max_model_len=256, quantization="none", **SCENARIOS[scenario])
    prompts = make_prompts()
    run(llm, [prompts[-1][:40] + [99]], 1)  # warm the shared prefix: the last two prompts hit it
    outputs = run(llm, prompts, NUM_NEW)
    assert [o.outputs[0].token_ids for o in outputs] == reference
    assert outputs[-1].num_cached_tokens >= 32  # the shared prefix was a cache hit
    if scenario == "preemption":
        assert llm.totals.num_preemptions > 0
    llm.engine.check_kv_integrity()
