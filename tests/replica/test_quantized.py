"""Weight-only int8 / int4 linear layers (replica/models/quantized.py) and how a model gets
them: the codes and scales they keep, what they multiply by, which layers are replaced, and
what `quantization: auto` resolves to."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.questions import QUESTIONS
from tokenflow.replica.attention.backends import AttentionMetadata
from tokenflow.replica.engine.llm import LLM
from tokenflow.replica.loading.loader import load_model, resolve_quantization
from tokenflow.replica.loading.model_source import SMOLLM2_MODEL_NAME
from tokenflow.replica.loading.resolve import resolve_model
from tokenflow.replica.models.quantized import INT4_GROUP, QuantizedLinear, quantize_linears
from tokenflow.scheduler import SamplingParams

CORPUS = Path(__file__).resolve().parents[2] / "bench" / "data" / "quality_corpus.txt"


def _weight(rows: int = 96, cols: int = 128, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) * 0.05


def test_int4_keeps_each_group_within_half_a_step_of_the_float_weight() -> None:
    w = _weight()
    layer = QuantizedLinear.int4(w)
    groups = w.view(w.shape[0], -1, INT4_GROUP)
    step = (groups.amax(-1) - groups.amin(-1)) / 15  # [N, K / group]
    err = (layer.dequantized() - w).abs().view_as(groups).amax(-1)
    # Half a step, plus bfloat16's rounding of the scale, the zero and the output.
    assert torch.all(err <= step / 2 + 0.01 * groups.abs().amax(-1))
    # 4 bits a weight, and a bfloat16 scale and zero a group: Q4_1's 5 bits a weight.
    stored = layer.weight.nbytes + (0 if layer.scales is None else layer.scales.nbytes)
    assert layer.weight.dtype == torch.uint8 and stored == w.numel() // 2 + w.numel() // 32 * 4


def test_int4_gets_back_the_codes_of_a_weight_already_on_a_q4_1_grid() -> None:
    """A GGUF Q4_1 block is low + code * scale with codes 0..15 spanning the block: quantizing
    its dequantized weights finds the same codes, so only bfloat16 rounding is lost."""
    gen = torch.Generator().manual_seed(1)
    rows, cols = 64, 96
    codes = torch.randint(0, 16, (rows, cols), generator=gen)
    codes.view(rows, -1, INT4_GROUP)[..., 0] = 0  # each block spans 0..15, as Q4_1's do
    codes.view(rows, -1, INT4_GROUP)[..., 1] = 15
    scale = torch.rand(rows, cols // INT4_GROUP, generator=gen) * 0.01 + 0.001
    low = -8 * scale + torch.randn(rows, cols // INT4_GROUP, generator=gen) * 0.001
    w = (low[..., None] + codes.view(rows, -1, INT4_GROUP) * scale[..., None]).view(rows, cols)
    x = torch.randn(5, cols, generator=gen)
    # Rows are stored in 16s: 50 are padded, and the padding is sliced off.
    torch.testing.assert_close(QuantizedLinear.int4(w[:50])(x), QuantizedLinear.int4(w)(x)[:, :50])
    from_float = QuantizedLinear.int4(w)
    from_codes = QuantizedLinear.int4_codes(codes, scale, low)
    assert torch.equal(from_float.weight, from_codes.weight)
    assert torch.equal(from_float(x), from_codes(x))
    torch.testing.assert_close(from_float(x), x @ w.T, rtol=0.02, atol=2e-3)


def test_int8_is_a_symmetric_scale_per_row() -> None:
    w, x = _weight(), torch.randn(3, 128)
    layer = QuantizedLinear.int8(w, bias=torch.ones(96))
    assert layer.weight.dtype == torch.int8
    out = layer(x)
    assert out.dtype == torch.float32  # back in the caller's dtype
    # Exactly the dequantized weight times the bfloat16 input, up to the output's rounding;
    # half a step (max |w| / 254) per weight away from the float layer.
    deq = layer.dequantized()
    # Each row's largest weight is code +-127 times its scale (up to two bfloat16 roundings:
    # the scale's and the read-back's).
    torch.testing.assert_close(deq.abs().amax(dim=1), w.abs().amax(dim=1), rtol=8e-3, atol=0)
    assert torch.all((deq - w).abs() <= w.abs().max() / 254 * 1.01 + w.abs() / 256)
    torch.testing.assert_close(out, x.bfloat16().float() @ deq.T + 1, rtol=8e-3, atol=8e-3)
    torch.testing.assert_close(out, x @ w.T + 1, rtol=0.05, atol=0.03)


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_a_quantized_model_replaces_every_linear_and_its_tied_head(method: str) -> None:
    float_model = load_model("tokenflow-tiny", dtype=torch.float32, device=torch.device("cpu"))
    model = load_model("tokenflow-tiny", dtype=torch.float32, device=torch.device("cpu"),
                       quantization=method)
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    quantized = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    assert len(quantized) == 4 * len(model.layers) + 1  # qkv, o, gate_up, down; the head
    assert isinstance(model.embed_tokens, nn.Embedding)  # the lookup keeps its float table
    hidden = torch.randn(4, model.arch.hidden_size, generator=torch.Generator().manual_seed(2))
    logits, expected = model.compute_logits(hidden), float_model.compute_logits(hidden)
    assert logits.dtype == torch.float32 and logits.shape == expected.shape
    # The head's error, relative to the logits' spread: 4 bits of Gaussian weights lose a
    # few percent, 8 bits a few tenths of one.
    error = (logits - expected).pow(2).mean().sqrt() / expected.pow(2).mean().sqrt()
    assert error < {"int8": 0.01, "int4": 0.1}[method], error


def test_none_leaves_the_model_alone() -> None:
    model = load_model("tokenflow-tiny", dtype=torch.float32, device=torch.device("cpu"))
    assert quantize_linears(model, "none") is model
    assert not any(isinstance(m, QuantizedLinear) for m in model.modules())
    with pytest.raises(ValueError, match="int2"):
        quantize_linears(model, "int2")  # type: ignore[arg-type]


def test_auto_is_what_the_weights_are_stored_as_on_the_cpu() -> None:
    smollm2 = resolve_model("smollm2-135m-instruct")  # a Q4_1 GGUF file
    tiny = resolve_model("tokenflow-tiny")  # no weights: dummy
    assert resolve_quantization("auto", smollm2, "cpu") == "int4"
    assert resolve_quantization("auto", smollm2, "cpu", load_format="dummy") == "none"
    assert resolve_quantization("auto", smollm2, "cuda") == "none"
    assert resolve_quantization("auto", tiny, "cpu") == "none"
    assert resolve_quantization("int8", tiny, "cpu") == "int8"
    with pytest.raises(ValueError, match="CPU only"):
        resolve_quantization("int4", smollm2, "cuda")


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_large_batches_multiply_the_dense_copy_of_the_same_weights(method: str) -> None:
    w = _weight(rows=64, cols=96)
    layer = getattr(QuantizedLinear, method)(w, dense_above_rows=8)
    assert layer.dense is not None and layer.dense.dtype == torch.bfloat16
    # What the kernel multiplies by (read back through it), up to bfloat16's rounding.
    torch.testing.assert_close(layer.dense.float(), layer.dequantized(), rtol=8e-3, atol=1e-4)
    read_back = getattr(QuantizedLinear, method)(w).keep_dense(above_rows=8)
    torch.testing.assert_close(read_back.dense.float(), layer.dense.float(), rtol=8e-3,
                               atol=1e-4)
    x = torch.randn(12, 96, generator=torch.Generator().manual_seed(3))
    packed = torch.cat([layer(x[i:i + 4]) for i in range(0, 12, 4)])  # 4 rows: packed kernel
    dense = layer(x)  # 12 rows: the bfloat16 matmul
    # The same weights; the outputs differ by bfloat16 rounding of the sums (1 ulp near 0.5).
    torch.testing.assert_close(dense, packed, rtol=1e-2, atol=8e-3)


def _next_token_logprobs(model: nn.Module, ids: list[int]) -> torch.Tensor:
    n = len(ids)
    meta = AttentionMetadata.build(slot_mapping=list(range(n)), block_table=[[0]],
                                   query_start_loc=[0, n], seq_lens=[n], block_size=n)
    cache = [torch.zeros(2, 1, n, model.arch.num_kv_heads, model.arch.head_dim)
             for _ in model.layers]
    with torch.inference_mode():
        hidden, _ = model(torch.tensor(ids), torch.arange(n), cache, meta)
        return torch.log_softmax(model.compute_logits(hidden), dim=-1)


def test_the_default_model_in_int4_predicts_as_its_float32_path() -> None:
    """SmolLM2's Q4_1 file kept at 4 bits (what `auto` picks) against the same file
    dequantized to float32, teacher-forced over 500 tokens of the quality corpus: the same
    top token almost everywhere (bench/quantization.py measured 96.9% over 2,000 tokens),
    and the README's questions answered right (tests/cluster/test_quality.py asks them
    through the API)."""
    source = resolve_model(SMOLLM2_MODEL_NAME)
    tok = source.tokenizer()
    ids = tok.encode(CORPUS.read_text(), add_special_tokens=False)[:500]
    lps = {method: _next_token_logprobs(
        load_model(source, dtype=torch.float32, device=torch.device("cpu"),
                   quantization=method), ids) for method in ("none", "int4")}
    top = lps["none"].argmax(-1)
    assert (lps["int4"].argmax(-1) == top).float().mean() > 0.93
    moved = (lps["int4"].gather(1, top[:, None]) - lps["none"].gather(1, top[:, None])).abs()
    assert moved.mean() < 0.1

    llm = LLM(SMOLLM2_MODEL_NAME, max_model_len=256)  # quantization: auto
    chats = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]),
                        add_special_tokens=False) for q, _ in QUESTIONS]
    outputs = llm.generate(chats, SamplingParams(max_tokens=16, temperature=0.0),
                           use_tqdm=False)
    for (question, word), out in zip(QUESTIONS, outputs, strict=True):
        assert re.search(rf"\b{word}\b", out.outputs[0].text, re.IGNORECASE), (
            question, out.outputs[0].text)
