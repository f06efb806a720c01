"""Multi-LoRA: a batch mixing three PEFT adapters and the base model gives each request the
greedy tokens of transformers + peft with its adapter (and of the base with the adapter merged
in), through chunked prefill, prefix-cache hits, preemption and slot evictions; on safetensors
checkpoints and GGUF files; adapters key the prefix cache; bad adapters and names are clear
errors; the engine counts each adapter's requests, tokens, loads and evictions."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tests.checkpoints import write_checkpoint
from tests.gguf_checkpoints import GGUF_NAME, source_model, write_gguf
from tests.lora_adapters import load_with_adapter, write_adapter
from tests.needs import need
from tests.replica.test_engine import _load_hf, hf_greedy, make_prompts, with_tokenizer
from tokenflow.replica.engine.llm import LLM
from tokenflow.scheduler import SamplingParams

pytest.importorskip("peft")
NUM_NEW = 8
# Three adapters unlike each other: attention only, everything at the largest rank, the MLP
# and o_proj with rsLoRA scaling; None is the base model.
ADAPTERS = {
    "attn": dict(seed=1, rank=8, targets=("q_proj", "v_proj")),
    "all": dict(seed=2, rank=16),
    "mlp": dict(seed=3, rank=4, targets=("o_proj", "gate_proj", "up_proj", "down_proj"),
                use_rslora=True),
}
NAMES = [None, *ADAPTERS]
SCENARIOS = {
    "plain": dict(max_num_batched_tokens=4096, num_blocks=512, block_size=16),
    "chunked_prefill": dict(max_num_batched_tokens=32, num_blocks=512, block_size=16),
    "preemption": dict(max_num_batched_tokens=64, num_blocks=40, block_size=4),
}


def greedy(num_new: int = NUM_NEW, lora: str | None = None) -> SamplingParams:
    return SamplingParams(max_tokens=num_new, temperature=0.0, ignore_eos=True, lora=lora)


def mixed(prompts: list[list[int]]) -> tuple[list[list[int]], list[SamplingParams], list]:
    """Every prompt under every adapter and the base, interleaved: (prompts, params, keys)."""
    ps, params, keys = [], [], []
    for i, p in enumerate(prompts):
        for name in NAMES:
            ps.append(p)
            params.append(greedy(lora=name))
            keys.append((name, i))
    return ps, params, keys


def references(hf, adapters: dict, prompts: list[list[int]]) -> dict:
    """(adapter, prompt index) -> transformers + peft greedy tokens."""
    refs = {(None, i): hf_greedy(hf, p, NUM_NEW)[0] for i, p in enumerate(prompts)}
    for name, path in adapters.items():
        model = load_with_adapter(hf, path)
        model.generation_config.eos_token_id = None
        refs.update({(name, i): hf_greedy(model, p, NUM_NEW)[0] for i, p in enumerate(prompts)})
    return refs


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora")
    path = with_tokenizer(write_checkpoint(tmp, "llama"))
    hf = _load_hf(path)
    adapters = {n: write_adapter(hf, tmp / n, **kw) for n, kw in ADAPTERS.items()}
    prompts = make_prompts()
    return path, hf, adapters, prompts, references(hf, adapters, prompts)


def make_llm(path, adapters, max_loras: int = 4, **kwargs) -> LLM:
    lora = {"max_loras": max_loras, "max_lora_rank": 16,
            "lora_modules": {n: str(p) for n, p in adapters.items()}}
    return LLM(str(path), lora=lora, **kwargs)


def test_adapters_change_the_output(setup):
    _, _, _, prompts, refs = setup
    for name in ADAPTERS:  # else a token-exact test below could not fail
        assert sum(refs[(name, i)] != refs[(None, i)] for i in range(len(prompts))) >= 4


@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("max_loras", [4, 2])
def test_mixed_batch_is_token_exact(setup, scenario, max_loras):
    """Three adapters and the base in every batch; with 2 slots the scheduler holds back the
    third adapter's requests and slots are evicted and reloaded."""
    path, _, adapters, prompts, refs = setup
    llm = make_llm(path, adapters, max_loras, **SCENARIOS[scenario])
    ps, params, keys = mixed(prompts)
    outs = llm.generate(ps, params, use_tqdm=False)
    for out, key in zip(outs, keys, strict=True):
        assert out.outputs[0].token_ids == refs[key], (scenario, key)
    totals = llm.totals
    assert totals.lora_requests == {n: len(prompts) for n in ADAPTERS}
    assert totals.lora_generated_tokens == {n: len(prompts) * NUM_NEW for n in ADAPTERS}
    assert totals.lora_loads >= 3
    assert (totals.lora_evictions > 0) == (max_loras < 3)
    if scenario == "preemption":
        assert totals.num_preemptions > 0
    llm.engine.check_idle()
    llm.shutdown()


def test_compiled_step_serves_adapters_token_exactly_without_recompiling(setup):
    """`compile: true` with adapters: each projection's delta is an opaque op in the graph,
    so a batch of three adapters and the base in 2 slots (chunked prefill, evictions and
    reloads) gives transformers + peft's tokens, and no step's mix or slot load compiles a
    graph after startup (a delta traced into the graph would retrace at every new mix)."""
    from torch._dynamo.utils import counters

    path, _, adapters, prompts, refs = setup
    llm = make_llm(path, adapters, 2, compile=True, **SCENARIOS["chunked_prefill"])
    compiled_at_start = counters["stats"]["unique_graphs"]
    ps, params, keys = mixed(prompts)
    try:
        outs = llm.generate(ps, params, use_tqdm=False)
        evictions = llm.totals.lora_evictions
    finally:
        llm.shutdown()
    for out, key in zip(outs, keys, strict=True):
        assert out.outputs[0].token_ids == refs[key], key
    assert evictions > 0
    assert counters["stats"]["unique_graphs"] == compiled_at_start


def test_merged_weights_give_the_same_tokens(setup, tmp_path):
    """The adapter served by the engine == the base model with the adapter merged in."""
    path, hf, adapters, prompts, _ = setup
    merged = load_with_adapter(hf, adapters["all"], merge=True)
    merged.save_pretrained(tmp_path / "merged")
    plain = LLM(str(with_tokenizer(tmp_path / "merged")), num_blocks=512)
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, greedy(), use_tqdm=False)]
    llm = make_llm(path, adapters)
    got = llm.generate(prompts, greedy(lora="all"), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == expected


def test_prefix_cache_is_keyed_by_adapter(setup):
    path, _, adapters, prompts, refs = setup
    llm = make_llm(path, adapters, num_blocks=512, block_size=4)
    prompt = prompts[3]  # 60 tokens
    first = llm.generate([prompt], greedy(lora="attn"), use_tqdm=False)[0]
    other = llm.generate([prompt], greedy(lora="all"), use_tqdm=False)[0]
    base = llm.generate([prompt], greedy(), use_tqdm=False)[0]
    again = llm.generate([prompt], greedy(lora="attn"), use_tqdm=False)[0]
    assert first.num_cached_tokens == other.num_cached_tokens == base.num_cached_tokens == 0
    assert again.num_cached_tokens == 56
    assert again.outputs[0].token_ids == first.outputs[0].token_ids == refs[("attn", 3)]
    assert other.outputs[0].token_ids == refs[("all", 3)]


def test_gguf_base(tmp_path):
    """An adapter trained on the HF model applies to its GGUF file (names mapped, q/k rows
    unpermuted), token-exactly on the float path; over the quantized weights it runs too."""
    from transformers import AutoModelForCausalLM

    model_dir = write_gguf(tmp_path, "llama")
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), gguf_file=GGUF_NAME,
                                              dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    adapter = write_adapter(source_model("llama"), tmp_path / "a", seed=5, rank=8)
    prompts = make_prompts()[:4]
    refs = references(hf, {"a": adapter}, prompts)
    assert any(refs[("a", i)] != refs[(None, i)] for i in range(len(prompts)))
    llm = make_llm(model_dir / GGUF_NAME, {"a": adapter}, quantization="none", num_blocks=256,
                   max_model_len=256)
    ps, params, keys = [], [], []
    for i, p in enumerate(prompts):
        for name in (None, "a"):
            ps.append(p)
            params.append(greedy(lora=name))
            keys.append((name, i))
    outs = llm.generate(ps, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [refs[k] for k in keys]
    quantized = make_llm(model_dir / GGUF_NAME, {"a": adapter}, quantization="int8",
                         num_blocks=256, max_model_len=256)
    outs = quantized.generate(ps, params, use_tqdm=False)
    with_adapter = [o.outputs[0].token_ids for o, k in zip(outs, keys, strict=True) if k[0]]
    without = [o.outputs[0].token_ids for o, k in zip(outs, keys, strict=True) if not k[0]]
    assert with_adapter != without


def test_add_remove_list_and_dynamic_path(setup, tmp_path):
    path, hf, adapters, prompts, refs = setup
    llm = LLM(str(path), num_blocks=256,
              lora={"max_loras": 2, "dynamic_lora_path": str(tmp_path)})
    assert llm.list_loras() == []
    with pytest.raises(ValueError, match="unknown LoRA adapter 'attn'; registered: none"):
        llm.engine.process_inputs("x", prompts[0], greedy(lora="attn"))
    llm.add_lora("attn", str(adapters["attn"]))
    write_adapter(hf, tmp_path / "dyn", **ADAPTERS["mlp"])  # found on first use
    outs = llm.generate(prompts[:2] * 2, [greedy(lora="attn")] * 2 + [greedy(lora="dyn")] * 2,
                        use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [
        refs[("attn", 0)], refs[("attn", 1)], refs[("mlp", 0)], refs[("mlp", 1)]]
    assert llm.list_loras() == ["attn", "dyn"]
    assert llm.remove_lora("attn") and not llm.remove_lora("attn")
    assert llm.list_loras() == ["dyn"]
    with pytest.raises(ValueError, match="unknown LoRA adapter"):
        llm.generate(prompts[0], greedy(lora="attn"), use_tqdm=False)


def test_bad_adapters_are_clear_errors(setup, tmp_path):
    path, hf, adapters, _, _ = setup
    llm = LLM(str(path), num_blocks=64, lora={"max_loras": 1, "max_lora_rank": 8})
    with pytest.raises(ValueError, match="rank 16 exceeds lora.max_lora_rank=8"):
        llm.add_lora("big", str(adapters["all"]))
    with pytest.raises(ValueError, match="needs adapter_config.json"):
        llm.add_lora("none", str(tmp_path))
    other = _load_hf(write_checkpoint(tmp_path, "llama", intermediate_size=96))
    with pytest.raises(ValueError, match=r"_proj lora_[AB] has shape .*; the base model needs"):
        llm.add_lora("shape", str(write_adapter(other, tmp_path / "s", seed=0)))
    dora = write_adapter(hf, tmp_path / "d", seed=0, rank=4)
    config = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(ValueError, match="DoRA is not supported"):
        llm.add_lora("dora", str(dora))
    base_only = LLM(str(path), num_blocks=64)
    with pytest.raises(ValueError, match="serves no adapters"):
        base_only.engine.process_inputs("x", [5, 6], greedy(lora="attn"))
    with pytest.raises(ValueError, match="lora must be an adapter name"):
        SamplingParams(lora="")


async def test_async_engine_in_its_own_process(setup):
    """add/remove/list through `AsyncEngine` reach the engine process (commands), which
    counts each adapter in the `EngineState` it sends up."""
    from tests.replica.test_async_engine import collect
    from tokenflow.config import CacheConfig, EngineConfig, LoRAConfig, ModelConfig
    from tokenflow.replica.engine.async_engine import AsyncEngine

    path, _, adapters, prompts, refs = setup
    config = EngineConfig(model=ModelConfig(model=str(path)),
                          cache=CacheConfig(num_blocks=128), engine_loop="process",
                          lora=LoRAConfig(max_loras=2))
    engine = AsyncEngine(config)
    try:
        assert engine.engine is None  # the engine runs in a process of its own
        with pytest.raises(ValueError, match="unknown LoRA adapter"):
            engine.process_inputs(prompts[0], greedy(lora="all"))
        engine.add_lora("all", str(adapters["all"]))
        assert engine.list_loras() == ["all"]
        got = await collect(engine, prompts[0], greedy(lora="all"))
        assert got[1] == refs[("all", 0)]
        assert engine.state.totals.lora_requests == {"all": 1}
        assert engine.remove_lora("all") and engine.list_loras() == []
    finally:
        engine.shutdown()


@pytest.mark.parametrize("order", ["grouped", "interleaved"])
@pytest.mark.parametrize("form", ["kernel", "segments", "groups"])
def test_each_form_of_the_delta_gives_each_token_its_own_adapter(order, form):
    """The three forms of a step's delta (`models/lora.py`): the C++ kernel, per-slot token
    runs and padded per-slot groups each give every token its own adapter's delta and no
    other (a plain loop over tokens), at ranks under the slot's and with a part an adapter
    leaves alone, whether the requests come grouped by adapter (as the runner orders them)
    or interleaved (a run per request)."""
    from tokenflow.replica.models import lora_kernel
    from tokenflow.replica.models.lora import LoRALinear, LoRAStep

    if form == "kernel":
        need(lora_kernel.available(), "a C++ compiler that builds the LoRA kernel")
    torch.manual_seed(0)
    step = LoRAStep(max_rank=4, dtype=torch.float32)
    base = torch.nn.Linear(16, 12, bias=False)
    lora = LoRALinear(base, (8, 4), 16, num_slots=3, step=step, device=torch.device("cpu"))
    weights = [[(torch.randn(4, 16), torch.randn(8, 4)),
                (torch.randn(2, 16), torch.randn(4, 2)) if slot else None] for slot in range(3)]
    for slot in range(3):
        lora.set_slot(slot, weights[slot], 0.5)
    slots = [-1, 0, 0, 2, 1, 1, -1, 2] if order == "grouped" else [0, 2, -1, 1, 0, 2, 1, -1]
    request_slots = np.array(sorted(slots) if order == "grouped" else slots)
    query_lens = np.array([1, 3, 2, 1, 4, 1, 2, 3])
    x = torch.randn(int(query_lens.sum()), 16)
    step.set(request_slots, query_lens, torch.device("cpu"), form=form)
    assert (step.token_slots is not None, bool(step.segments), step.rows is not None) == (
        form == "kernel", form == "segments", form == "groups")
    got = lora(x)
    expected = base(x)
    for token, slot in enumerate(np.repeat(request_slots, query_lens)):
        parts = weights[slot] if slot >= 0 else [None, None]
        for part, (first, end) in zip(parts, ((0, 8), (8, 12)), strict=True):
            if part is not None:
                a, b = part
                expected[token, first:end] += 0.5 * (x[token] @ a.T) @ b.T
    torch.testing.assert_close(got, expected)
    assert not torch.equal(got, base(x))
