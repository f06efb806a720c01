"""Dense weights prepacked for oneDNN on the CPU, for the matmuls that run eagerly.

`F.linear` on the CPU hands its weight to the BLAS as it lies ([N, K], row-major) on every call,
and the BLAS re-blocks it as it goes; oneDNN can instead hold the weight once in its own blocked
layout (`mkldnn._reorder_linear_weight`) and multiply by that (`mkldnn._linear_pointwise`).
Measured alone on a 2-core AMD VM (bench/README, "Offline throughput" and "What each part ...
contributes", 2026-12-06): the LM head of a batch-64 decode step of the benchmark model
(float32, [64, 512] x [512, 32000]) 21.6 -> 10.0 ms; SmolLM2's bfloat16 head at 16 rows
5.1 -> 2.8 ms (and faster than the int8
kernel from 2 rows on). The bfloat16 products are bit-identical to `F.linear`'s; float32 ones
differ in the last bits (another summation order), as two BLAS calls of different shapes do.

The compiled layers get the same from inductor (its freezing pass prepacks their weights:
`worker/compile.py`); this module is for what stays eager: the LM head, which is not compiled.
"""

from __future__ import annotations

import torch
from torch import nn

# The batch size oneDNN is told to expect when it picks the blocked layout: a decode step's.
# Any batch size multiplies correctly by the packed weight; this one only tunes the layout.
_EXPECTED_ROWS = 16


def can_prepack(weight: torch.Tensor) -> bool:
    """Whether `weight` can be held prepacked: a float32 or bfloat16 matrix on the CPU, with
    torch built with oneDNN."""
    return (weight.device.type == "cpu" and weight.dim() == 2
            and weight.dtype in (torch.float32, torch.bfloat16)
            and torch.backends.mkldnn.is_available())


def prepack(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [N, K] in oneDNN's blocked layout (an opaque mkldnn tensor: no views, no
    `.to()`, not for `torch.compile`), for `prepacked_mm`."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), _EXPECTED_ROWS)


def prepacked_mm(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """x [M, K] times the prepacked weight [N, K] transposed -> [M, N], in x's dtype (which
    must be the weight's)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


class PrepackedLinear(nn.Module):
    """Owns one bias-free linear layer's weight, prepacked for oneDNN (`prepack`); `forward` is
    `F.linear` with it. Eager only: the packed weight is an attribute, not a buffer, so
    `state_dict`, `.to()` and `torch.compile` never see it."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        if not can_prepack(weight):
            raise ValueError(f"cannot prepack a {weight.dtype} weight on {weight.device}")
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.dtype = weight.dtype
        self.packed = prepack(weight)

    @property
    def weight(self) -> torch.Tensor:
        """The weight [N, K] it multiplies by, unpacked (a copy: for inspection, not the hot
        path)."""
        return self.packed.to_dense()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(self.dtype)
        return prepacked_mm(flat, self.packed).view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.dtype}"
