"""Multi-LoRA across pipeline stages (Ray actors, gloo): each stage holds its own layers'
slots, loaded as the scheduler places adapters; a batch of three adapters and the base gives
transformers + peft's greedy tokens, with chunked prefill, preemption and slot evictions."""

from __future__ import annotations

import pytest

from tests.checkpoints import write_checkpoint
from tests.conftest import Cluster
from tests.lora_adapters import write_adapter
from tests.replica.test_engine import _load_hf, make_prompts, with_tokenizer
from tests.replica.test_lora import ADAPTERS, NUM_NEW, SCENARIOS, make_llm, mixed, references
from tests.replica.test_pipeline import PP2

pytestmark = pytest.mark.slow
pytest.importorskip("peft")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora-pp")
    path = with_tokenizer(write_checkpoint(tmp, "llama", num_hidden_layers=4))
    hf = _load_hf(path)
    adapters = {n: write_adapter(hf, tmp / n, **kw) for n, kw in ADAPTERS.items()}
    prompts = make_prompts()
    return path, adapters, prompts, references(hf, adapters, prompts)


@pytest.mark.parametrize("scenario", ["chunked_prefill", "preemption"])
def test_pp2_mixed_batch_is_token_exact(cluster: Cluster, setup, scenario) -> None:
    path, adapters, prompts, refs = setup
    llm = make_llm(path, adapters, max_loras=2, **{**SCENARIOS[scenario], **PP2})
    try:
        ps, params, keys = mixed(prompts)
        outs = llm.generate(ps, params, use_tqdm=False)
        for out, key in zip(outs, keys, strict=True):
            assert out.outputs[0].token_ids == refs[key], (scenario, key)
        totals = llm.totals
        assert totals.lora_generated_tokens == {n: len(prompts) * NUM_NEW for n in ADAPTERS}
        assert totals.lora_evictions > 0
        llm.engine.check_idle()
    finally:
        llm.shutdown()
