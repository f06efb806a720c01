"""Weights prepacked for oneDNN (replica/models/prepacked.py) and the LM heads that hold them
(`prepack_lm_head`): the products they give against `F.linear`'s, which rows go through which
kernel, and which models get one."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tokenflow.replica.loading.loader import load_model
from tokenflow.replica.models.prepacked import PrepackedLinear, can_prepack
from tokenflow.replica.models.quantized import QuantizedLinear, prepack_lm_head

CPU = torch.device("cpu")


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("rows", [1, 7, 16, 64, 300])
def test_a_prepacked_bfloat16_weight_gives_f_linears_products_exactly(rows: int) -> None:
    w, x = _randn(200, 96, seed=0).bfloat16(), _randn(rows, 96, seed=1).bfloat16()
    layer = PrepackedLinear(w)
    assert torch.equal(layer(x), F.linear(x, w))
    assert torch.equal(layer.weight, w)  # unpacked, exactly
    assert layer(x.view(1, rows, 96)).shape == (1, rows, 200)  # leading dims kept


@pytest.mark.parametrize("rows", [1, 64])
def test_a_prepacked_float32_weight_differs_only_in_rounding(rows: int) -> None:
    w, x = _randn(300, 128, seed=2), _randn(rows, 128, seed=3)
    out = PrepackedLinear(w)(x)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_only_cpu_float_matrices_are_prepacked() -> None:
    assert can_prepack(torch.zeros(4, 4)) and can_prepack(torch.zeros(4, 4, dtype=torch.bfloat16))
    assert not can_prepack(torch.zeros(4, 4, dtype=torch.int8))
    assert not can_prepack(torch.zeros(4, 4, 4))
    with pytest.raises(ValueError, match="cannot prepack"):
        PrepackedLinear(torch.zeros(4, 4, dtype=torch.float16))


def test_a_quantized_head_multiplies_one_row_by_int8_and_more_by_its_prepacked_copy() -> None:
    w = _randn(160, 96, seed=4) * 0.05
    plain = QuantizedLinear.int8(w, dense_above_rows=1)
    head = QuantizedLinear.int8(w, dense_above_rows=1).prepack_dense(above_rows=1)
    assert head.dense is None and head.prepacked is not None  # one dense copy, not two
    x = _randn(9, 96, seed=5)
    assert torch.equal(head(x), plain(x))  # 9 rows: the same bfloat16 values, oneDNN either way
    one = x[:1]
    assert torch.equal(head(one), plain(one))  # 1 row: the int8 kernel in both
    dense_one = F.linear(one.bfloat16(), plain.dense).float()
    assert not torch.equal(head(one), dense_one)  # (which is not the dense product)
    with pytest.raises(ValueError, match="dense"):
        QuantizedLinear.int8(w).prepack_dense(above_rows=1)  # no dense copy to pack


@pytest.mark.parametrize("quantization", ["none", "int8"])
def test_a_loaded_models_head_is_prepacked_and_gives_the_same_logits(
        quantization: str, monkeypatch: pytest.MonkeyPatch) -> None:
    model = load_model("tokenflow-tiny", dtype=torch.float32, device=CPU,
                       quantization=quantization)
    monkeypatch.setattr("tokenflow.replica.loading.loader.prepack_lm_head", lambda m: m)
    unpacked = load_model("tokenflow-tiny", dtype=torch.float32, device=CPU,
                          quantization=quantization)
    head = model.lm_head
    if quantization == "none":  # tokenflow-tiny's head is its own
        assert isinstance(head, PrepackedLinear) and isinstance(unpacked.lm_head, nn.Linear)
    else:
        assert isinstance(head, QuantizedLinear) and head.prepacked is not None
        # The int8 kernel up to 4 rows (tokenflow's; torch's: 1), the prepacked copy above.
        assert head.dense_above_rows == (4 if head.tiled else 1)
    for rows in (1, 5):
        hidden = _randn(rows, model.arch.hidden_size, seed=6)
        # int8, 5 rows: the prepacked dense copy where the unpacked head (its dense copy above
        # 16 rows) still ran the int8 kernel (the same weights; the sums' bfloat16 rounding
        # differs).
        tol = (1e-2, 8e-3) if quantization == "int8" and rows > 1 else (1e-5, 1e-5)
        torch.testing.assert_close(model.compute_logits(hidden),
                                   unpacked.compute_logits(hidden), rtol=tol[0], atol=tol[1])


def test_a_head_tied_to_the_embedding_gets_a_prepacked_copy() -> None:
    model = load_model("tokenflow-tiny", dtype=torch.float32, device=CPU)
    model.lm_head = None  # as a tied model's only stage has it: compute_logits uses the table
    hidden = _randn(4, model.arch.hidden_size, seed=9)
    expected = model.compute_logits(hidden)
    prepack_lm_head(model)
    assert isinstance(model.lm_head, PrepackedLinear)
    assert isinstance(model.embed_tokens, nn.Embedding)  # the lookup keeps its table
    torch.testing.assert_close(model.compute_logits(hidden), expected, rtol=1e-5, atol=1e-5)


def test_a_stage_without_the_head_and_an_untied_float_head() -> None:
    first = load_model("tokenflow-tiny", dtype=torch.float32, device=CPU, layer_range=(0, 1))
    assert first.lm_head is None  # not the last stage: nothing to prepack
    assert prepack_lm_head(first).lm_head is None
    model = load_model("tokenflow-tiny", dtype=torch.float32, device=CPU)
    weight = _randn(model.arch.vocab_size, model.arch.hidden_size, seed=7)
    model.lm_head = nn.Linear(model.arch.hidden_size, model.arch.vocab_size, bias=False)
    model.lm_head.weight.data.copy_(weight)
    prepack_lm_head(model)
    assert isinstance(model.lm_head, PrepackedLinear)
    hidden = _randn(3, model.arch.hidden_size, seed=8)
    torch.testing.assert_close(model.compute_logits(hidden), F.linear(hidden, weight),
                               rtol=1e-5, atol=1e-5)
