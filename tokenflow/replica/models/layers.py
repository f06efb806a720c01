"""Blocks shared by every model family: RMSNorm, rotary embedding, gated MLP, attention.

All operate on one flattened varlen batch: hidden states are [num_tokens, hidden].
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from tokenflow.replica.attention.backends import attend, attention_op
from tokenflow.replica.models.config import ModelArchConfig, RopeScaling

Rope = tuple[torch.Tensor, torch.Tensor]  # (cos, sin), each [T, 1, head_dim / 2]


class RMSNorm(nn.Module):
    """Root-mean-square norm owning its scale; optionally adds the residual first (pre-norm)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (norm(x + residual), x + residual): the new residual stream and its norm."""
        if residual is not None:
            x = x + residual
        return self.normalize(x), x

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


def _inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float32, device="cpu") / head_dim
    inv_freq = 1.0 / theta**exponents
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    # Llama 3: long wavelengths slowed by `factor`, short ones kept, a smooth blend between.
    old_len = scaling.original_max_position_embeddings
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    scaled = torch.where(
        wavelen > old_len / scaling.low_freq_factor, inv_freq / scaling.factor, blended
    )
    return torch.where(wavelen < old_len / scaling.high_freq_factor, inv_freq, scaled)


class RotaryEmbedding:
    """Owns the cos/sin table of every position (float32), looked up once per step."""

    def __init__(
        self, head_dim: int, max_position: int, theta: float, scaling: RopeScaling | None
    ) -> None:
        # Explicit CPU devices: models are built under a meta-device context.
        inv_freq = _inv_freq(head_dim, theta, scaling)
        freqs = torch.arange(max_position, dtype=torch.float32, device="cpu")[:, None] * inv_freq
        self._table = torch.cat((freqs.cos(), freqs.sin()), dim=-1)  # [max_position, head_dim]

    def __call__(self, positions: torch.Tensor, dtype: torch.dtype) -> Rope:
        if self._table.device != positions.device:
            self._table = self._table.to(positions.device)
        cos, sin = self._table[positions].to(dtype).unsqueeze(1).chunk(2, dim=-1)
        return cos, sin


def apply_rope(x: torch.Tensor, rope: Rope) -> torch.Tensor:
    """Neox-style rotate-half rope (as HF Llama) on x [T, N, D]."""
    cos, sin = rope
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class GatedMLP(nn.Module):
    """SiLU-gated feed-forward owning the fused gate/up projection and the down projection."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # [T, I] each
        return self.down_proj(F.silu(gate) * up)


class Attention(nn.Module):
    """Self-attention of one layer: owns the fused qkv and o projections and Qwen3's q/k norms.

    The KV cache, the step's metadata and the kernel are the step's (`attention_step`): the
    layer names its index in the stage.
    """

    def __init__(self, arch: ModelArchConfig, layer: int, sliding_window: int | None = None
                 ) -> None:
        super().__init__()
        self.layer, self.window = layer, sliding_window or 0
        self.num_heads, self.num_kv_heads = arch.num_heads, arch.num_kv_heads
        self.head_dim, self.scale = arch.head_dim, arch.head_dim**-0.5
        q_size, kv_size = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
        self.qkv_proj = nn.Linear(arch.hidden_size, q_size + 2 * kv_size, bias=arch.attention_bias)
        self.o_proj = nn.Linear(q_size, arch.hidden_size, bias=arch.o_proj_bias)
        self.q_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps) if arch.qk_norm else None
        self.k_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps) if arch.qk_norm else None

    def forward(self, x: torch.Tensor, rope: Rope) -> torch.Tensor:
        tokens, heads, kv_heads = x.shape[0], self.num_heads, self.num_kv_heads
        # [T, (H + 2 KVH) * D] -> [T, H + 2 KVH, D]: q heads, then k heads, then v heads
        qkv = self.qkv_proj(x).view(tokens, heads + 2 * kv_heads, self.head_dim)
        v = qkv[:, heads + kv_heads :]
        if self.q_norm is None:
            # q and k heads side by side: one rope call for both.
            q, k = apply_rope(qkv[:, : heads + kv_heads], rope).split((heads, kv_heads), dim=1)
        else:
            q = apply_rope(self.q_norm.normalize(qkv[:, :heads]), rope)
            k = apply_rope(self.k_norm.normalize(qkv[:, heads : heads + kv_heads]), rope)
        # Compiled, attention is one opaque op; eager, a plain call (the op's dispatch costs).
        attn = attention_op if torch.compiler.is_compiling() else attend
        out = attn(q, k, v, self.layer, self.window, self.scale)  # [T, H, D]
        return self.o_proj(out.reshape(tokens, heads * self.head_dim))  # [T, H * D] in
