"""Weight-only quantized linear layers for the CPU: the weights stay int8 or int4 in memory and
torch's packed CPU kernels multiply them directly, so a decode step reads a quarter (int8) or
an eighth (int4) of the bytes the float32 weights take.

- `int8`: one symmetric scale per output row.
- `int4`: asymmetric groups of `INT4_GROUP` input columns, each with its scale and zero (a GGUF
  Q4_1 block is exactly such a group, so its codes survive unchanged; see `quantize_linears`).

The kernels are tokenflow's own (models/quantized_mv.cpp: the weights in tiles of 16 output
rows, 1.4-1.6x torch's packed int4 kernel and ~2x its int8 one at one row, where those are
bound by their arithmetic), or, where that cannot be built, torch's
(`aten._weight_int4pack_mm_for_cpu`, `aten._weight_int8pack_mm`), each layer in the layout of
the kernel it was made for (`tiled`). Both take bfloat16 activations (torch's are ~20x slower
for float32 ones), so a quantized layer rounds its input to bfloat16, and hands back the
model's dtype (tokenflow's kernels sum and return float32): the residual stream, the norms and
attention stay float32.

Batch invariance (`ModelConfig.batch_invariant`, the default): tokenflow's kernels give each
row the same bits whatever the row count, so a layer multiplies every batch through them and
keeps nothing else (0.5 bytes a weight for int4). Without it, each layer also keeps its
dequantized weight as bfloat16 and multiplies batches above its row threshold by that (the
dense oneDNN matmul is ~1.5-2x the kernels at hundreds of rows: faster prompts), 2.5 bytes a
weight in all; a row's result then depends on its batch's size. The LM head, never compiled,
holds that dense copy prepacked for oneDNN (`prepack_lm_head`, models/prepacked.py); the
compiled layers get theirs prepacked by inductor's freezing (worker/compile.py).
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from tokenflow.replica.models import quantized_kernel
from tokenflow.replica.models.prepacked import PrepackedLinear, can_prepack, prepack, prepacked_mm

Quantization = Literal["none", "int8", "int4"]
# Input columns per int4 group: GGUF's 4-bit blocks (Q4_0, Q4_1) are 32 weights of one row.
INT4_GROUP = 32
# The packed int4 layout's K tiling (torch's CPU kernel accepts 1, 2, 4 or 8; it only changes
# the packed order).
_INNER_K_TILES = 2
_COMPUTE = torch.bfloat16
_ROW_MULTIPLE = 16  # output rows of a packed int4 weight
# Rows above which the dense bfloat16 copy multiplies instead of the packed kernel (measured
# crossovers on this project's machine: 8 for the layers, 16 for a 49k-row LM head).
DENSE_ABOVE_ROWS = 8
HEAD_DENSE_ABOVE_ROWS = 16
# The same for a head whose dense copy is prepacked (`prepack_lm_head`): the int8 kernel up to
# 4 rows (tokenflow's, SmolLM2's [576 -> 49152] head, 2026-12-07: 1 row 0.49 against 1.04 ms,
# 4 rows 1.03 against 1.40 ms, 8 rows 2.75 against 1.97 ms). With torch's int8 kernel (where
# ours does not build) only one row pays: 1.27 against 1.34 ms, 2 rows 1.70 against 1.49 ms.
PREPACKED_HEAD_ABOVE_ROWS = 4
TORCH_PREPACKED_HEAD_ABOVE_ROWS = 1


class QuantizedLinear(nn.Module):
    """Owns one linear layer's quantized weight (int8 rows or int4 groups, in the layout of the
    kernel that multiplies it: `tiled`), its scales, its optional float bias and, once
    `keep_dense` asked, the dense bfloat16 copy that larger batches multiply by; `forward` is
    `F.linear` with the dequantized weight."""

    def __init__(self, method: Quantization, in_features: int, out_features: int,
                 weight: torch.Tensor, scales: torch.Tensor | None, bias: torch.Tensor | None,
                 tiled: bool = False) -> None:
        super().__init__()
        self.method, self.in_features, self.out_features = method, in_features, out_features
        self.tiled = tiled  # tokenflow's kernels' tiles (quantized_kernel.py), else torch's
        # tiled: int8 [N / 16, K, 16], int4 uint8 [N / 16, K / group, 320] (codes, scales and
        # zeros); torch's: int8 [N, K], int4 packed uint8 [N, K / 2]
        self.register_buffer("weight", weight)
        # tiled: int8 float32 [N]; int4 None (in the tiles). torch's: int8 [N]; int4
        # [K / group, N, 2] (scale, zero); bfloat16
        self.register_buffer("scales", scales)
        self.register_buffer("bias", bias)
        self.register_buffer("dense", None)  # bfloat16 [N, K], see `keep_dense`
        self.prepacked: torch.Tensor | None = None  # the dense copy for oneDNN, `prepack_dense`
        self.dense_above_rows = 1 << 62

    def keep_dense(self, above_rows: int, values: torch.Tensor | None = None
                   ) -> QuantizedLinear:
        """Also keep the dequantized weight as bfloat16, and multiply batches of more than
        `above_rows` rows by it (see the module docstring). `values`: that weight, when the
        caller has it (else it is read back through the kernel, which is slower)."""
        self.dense = (self.dequantized() if values is None else values).to(_COMPUTE)
        self.dense_above_rows = above_rows
        return self

    def prepack_dense(self, above_rows: int) -> QuantizedLinear:
        """Hold the dense copy prepacked for oneDNN instead (models/prepacked.py), multiplying
        batches of more than `above_rows` rows by it. Eager only: for a layer `torch.compile`
        never traces (the LM head)."""
        if self.dense is None or not can_prepack(self.dense):
            raise ValueError("prepack_dense needs the dense bfloat16 copy on the CPU")
        self.prepacked, self.dense = prepack(self.dense), None
        self.dense_above_rows = above_rows
        return self

    @classmethod
    def int8(cls, weight: torch.Tensor, bias: torch.Tensor | None = None,
             dense_above_rows: int | None = None) -> QuantizedLinear:
        """Symmetric per-row int8 of a float weight [N, K]: row scale = max |w| / 127.
        `dense_above_rows`: `keep_dense` at once."""
        w = weight.float()
        scale = (w.abs().amax(dim=1).clamp(min=1e-12) / 127).to(_COMPUTE)
        codes = torch.round(w / scale.float()[:, None]).clamp(-127, 127).to(torch.int8)
        if _tiled(w):
            layer = cls("int8", w.shape[1], w.shape[0], quantized_kernel.int8_tiles(codes),
                        quantized_kernel.int8_scales(scale), _float_bias(bias), tiled=True)
        else:
            layer = cls("int8", w.shape[1], w.shape[0], codes.contiguous(), scale,
                        _float_bias(bias))
        if dense_above_rows is not None:
            layer.keep_dense(dense_above_rows, codes.float() * scale.float()[:, None])
        return layer

    @classmethod
    def int4(cls, weight: torch.Tensor, bias: torch.Tensor | None = None,
             dense_above_rows: int | None = None) -> QuantizedLinear:
        """Asymmetric int4 groups of `INT4_GROUP` columns of a float weight [N, K]: each
        group's 16 levels span its min to its max (GGUF's Q4_1 rule, so a weight dequantized
        from Q4_1 gets its own codes back). `dense_above_rows`: `keep_dense` at once."""
        w = weight.float()
        rows, cols = w.shape
        if cols % INT4_GROUP:
            raise ValueError(f"int4 needs in_features divisible by {INT4_GROUP}, not {cols}")
        groups = w.view(rows, cols // INT4_GROUP, INT4_GROUP)
        low, high = groups.amin(dim=-1), groups.amax(dim=-1)
        scale = ((high - low) / 15).clamp(min=1e-12)
        codes = torch.round((groups - low[..., None]) / scale[..., None]).clamp(0, 15)
        return cls.int4_codes(codes.view(rows, cols).to(torch.int32), scale, low, bias,
                              dense_above_rows)

    @classmethod
    def int4_codes(cls, codes: torch.Tensor, scale: torch.Tensor, low: torch.Tensor,
                   bias: torch.Tensor | None = None, dense_above_rows: int | None = None
                   ) -> QuantizedLinear:
        """From codes [N, K] in 0..15 and each group's scale and lowest level [N, K / group]:
        w = low + code * scale. (The kernel's form is (code - 8) * scale + zero, both
        bfloat16.)"""
        rows, cols = codes.shape
        zero = low + 8 * scale
        if _tiled(codes):
            scale, zero = scale.to(_COMPUTE), zero.to(_COMPUTE)
            tiles = quantized_kernel.int4_tiles(codes, scale, zero)
            layer = cls("int4", cols, rows, tiles, None, _float_bias(bias), tiled=True)
        else:
            # torch's layout takes rows in 16s: pad with zero rows, sliced off the output.
            pad = -rows % _ROW_MULTIPLE
            padded, scale, zero = (F.pad(t, (0, 0, 0, pad)) for t in (codes, scale, zero))
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
                padded.to(torch.int32).contiguous(), _INNER_K_TILES)
            scale, zero = scale.to(_COMPUTE), zero.to(_COMPUTE)
            scales = torch.stack((scale, zero), dim=-1).transpose(0, 1).contiguous()
            layer = cls("int4", cols, rows, packed, scales, _float_bias(bias))  # [K/g, N, 2]
        if dense_above_rows is not None:
            groups = (codes.float().view(rows, -1, INT4_GROUP) - 8) * scale[:rows, :, None] \
                + zero[:rows, :, None]
            layer.keep_dense(dense_above_rows, groups.view(rows, cols))
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(_COMPUTE)
        dense_rows = flat.shape[0] > self.dense_above_rows
        if dense_rows and self.prepacked is not None:
            out = prepacked_mm(flat, self.prepacked)
        elif dense_rows and self.dense is not None:
            out = F.linear(flat, self.dense)
        else:
            out = self._packed(flat)
        out = out.to(x.dtype).view(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias

    def _packed(self, flat: torch.Tensor) -> torch.Tensor:
        """bfloat16 [M, K] -> [M, N] through the quantized kernel."""
        if self.tiled:
            if self.method == "int4":
                return quantized_kernel.int4_mv(flat, self.weight, self.out_features)
            return quantized_kernel.int8_mv(flat, self.weight, self.scales, self.out_features)
        out = packed_mm(flat, self.weight, self.scales, self.method == "int4")
        return out if out.shape[1] == self.out_features else out[:, :self.out_features]

    def dequantized(self) -> torch.Tensor:
        """The weight [N, K] this layer multiplies by, as float32 (torch's kernels round each
        value to bfloat16 on the way: their output dtype)."""
        return self._packed(torch.eye(self.in_features, dtype=_COMPUTE)).float().T.contiguous()

    def extra_repr(self) -> str:
        return f"{self.method}, in_features={self.in_features}, out={self.out_features}"


def _tiled(weight: torch.Tensor) -> bool:
    """Whether a layer of this weight gets tokenflow's kernels' tiles (on the CPU, where they
    build)."""
    return weight.device.type == "cpu" and quantized_kernel.available()


def packed_mm(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, int4: bool
              ) -> torch.Tensor:
    """bfloat16 x [M, K] times torch's packed int8 or int4 weight -> [M, N (padded for
    int4)]."""
    if int4:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, weight, INT4_GROUP, scales)
    return torch.ops.aten._weight_int8pack_mm(x, weight, scales)


def _float_bias(bias: torch.Tensor | None) -> torch.Tensor | None:
    return None if bias is None else bias.detach().float().clone()


# The model's linear layers by attribute name: attention, MLP and the LM head.
_LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head")


def quantize_linears(model: nn.Module, method: Quantization, keep_dense: bool = True
                     ) -> nn.Module:
    """Replace the model's linear layers by `QuantizedLinear`s, in place; each keeps a dense
    bfloat16 copy for large batches unless `keep_dense` is False. `none` leaves the model as
    it is.

    The LM head is int8 under either method: it picks the token, a 4-bit head costs the most
    quality (the default model: 83% top-1 agreement with float32 against 97% with an 8-bit
    one, and 2 of the README's 5 answers wrong), and GGUF files store it at 8 bits or more.
    A head tied to the embedding gets a quantized copy of its own: the lookup keeps the
    float table."""
    if method == "none":
        return model
    if method not in ("int8", "int4"):
        raise ValueError(f"unknown quantization {method!r}; valid: none, int8, int4")
    make = QuantizedLinear.int8 if method == "int8" else QuantizedLinear.int4

    def quantized(name: str, weight: torch.Tensor, bias: torch.Tensor | None = None
                  ) -> QuantizedLinear:
        head = name == "lm_head"
        above = (HEAD_DENSE_ABOVE_ROWS if head else DENSE_ABOVE_ROWS) if keep_dense else None
        return (QuantizedLinear.int8 if head else make)(weight, bias, above)

    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if name in _LINEARS and isinstance(child, nn.Linear):
                setattr(parent, name, quantized(name, child.weight.data, child.bias))
    embed = getattr(model, "embed_tokens", None)
    if getattr(model, "lm_head", None) is None and getattr(model, "is_last_stage", False) \
            and embed is not None:
        model.lm_head = quantized("lm_head", embed.weight.data)
    return model


def prepack_lm_head(model: nn.Module) -> nn.Module:
    """On the CPU, hold the last stage's LM head prepacked for oneDNN (models/prepacked.py), in
    place: a `QuantizedLinear` head's dense copy (multiplying from 2 rows on, the int8 kernel
    keeping one row), a float head's weight, or, for a head tied to the embedding, a prepacked
    copy of it (the lookup keeps the table). Elsewhere, or without oneDNN, nothing changes."""
    if not getattr(model, "is_last_stage", False):
        return model
    head = getattr(model, "lm_head", None)
    if isinstance(head, QuantizedLinear):
        if head.dense is not None and can_prepack(head.dense):
            head.prepack_dense(PREPACKED_HEAD_ABOVE_ROWS if head.tiled
                               else TORCH_PREPACKED_HEAD_ABOVE_ROWS)
    elif isinstance(head, nn.Linear):
        if head.bias is None and can_prepack(head.weight):
            model.lm_head = PrepackedLinear(head.weight.detach())
    elif head is None:
        embed = getattr(model, "embed_tokens", None)
        if embed is not None and can_prepack(embed.weight):
            model.lm_head = PrepackedLinear(embed.weight.detach())
    return model
