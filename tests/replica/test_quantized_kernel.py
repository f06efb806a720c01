"""tokenflow's quantized CPU kernels (replica/models/quantized_mv.cpp): the same products as
torch's packed kernels on the same codes, at every row count a decode step has, with rows
that do not fill a tile; each row's result bit-identical whatever the row count (batch
invariance); a layer of each layout; and the fallback where nothing builds."""

from __future__ import annotations

import pytest
import torch

from tests.needs import need
from tokenflow.replica.models import quantized_kernel
from tokenflow.replica.models.quantized import QuantizedLinear


@pytest.fixture(autouse=True)
def _built() -> None:
    need(quantized_kernel.available(), "a C++ compiler that builds the quantized kernels")


def _torch_layout(monkeypatch: pytest.MonkeyPatch, make, *args) -> QuantizedLinear:
    with monkeypatch.context() as m:
        m.setattr(quantized_kernel, "available", lambda: False)
        layer = make(*args)
    assert not layer.tiled
    return layer


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9])
@pytest.mark.parametrize("method", ["int4", "int8"])
def test_the_tiled_kernels_multiply_as_torch_s_do(method: str, rows: int,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(200, 192, generator=gen) * 0.05  # 200 rows: the last tile half full
    make = getattr(QuantizedLinear, method)
    tiled, reference = make(w), _torch_layout(monkeypatch, make, w)
    assert tiled.tiled
    x = torch.randn(rows, 192, generator=gen)
    out, expected = tiled(x), reference(x)
    assert out.shape == expected.shape == (rows, 200)
    # The same codes, scales and bfloat16 inputs; sums in another order, torch's outputs
    # rounded to bfloat16 (one ulp: 2^-8 relative), ours kept float32.
    torch.testing.assert_close(out, expected, rtol=8e-3, atol=2e-3)
    torch.testing.assert_close(tiled.dequantized(), reference.dequantized(), rtol=8e-3,
                               atol=1e-4)


@pytest.mark.parametrize("method", ["int4", "int8"])
def test_a_row_s_result_never_depends_on_how_many_rows_the_call_has(method: str) -> None:
    """Batch invariance: each row of a call of 2 to 70 rows (one pass of rows or several, the
    tile decoded in the loop or once into a buffer) is bit-identical to that row alone."""
    gen = torch.Generator().manual_seed(3)
    layer = getattr(QuantizedLinear, method)(torch.randn(200, 320, generator=gen) * 0.05)
    x = torch.randn(70, 320, generator=gen)
    alone = torch.cat([layer(x[i:i + 1]) for i in range(70)])
    assert alone.dtype == torch.float32
    for rows in (2, 3, 4, 5, 7, 8, 9, 16, 33, 70):
        assert torch.equal(layer(x[:rows]), alone[:rows]), rows
    assert torch.equal(layer(x[13:50]), alone[13:50])


def test_a_tiled_kernel_sees_every_weight_and_input() -> None:
    """One code, one input column at a time: each output is the one product it should be."""
    codes = torch.full((32, 64), 8, dtype=torch.int32)  # (8 - 8) * scale + zero = 0
    codes[17, 40] = 11  # row 17 (the second tile), column 40 (the second group): 3 * scale
    scale = torch.full((32, 2), 0.5)
    layer = QuantizedLinear.int4_codes(codes, scale, -8 * scale)
    x = torch.zeros(3, 64)
    x[1, 40] = 2.0
    out = layer(x)
    expected = torch.zeros(3, 32)
    expected[1, 17] = 3.0
    assert torch.equal(out, expected)


def test_no_compiler_gets_torch_s_kernels(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENFLOW_CACHE_DIR", str(tmp_path))  # nothing built there yet
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with pytest.raises(FileNotFoundError):
        quantized_kernel.build()
    assert not (tmp_path / "kernels").exists() or not any((tmp_path / "kernels").iterdir())
