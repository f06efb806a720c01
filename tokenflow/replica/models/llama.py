"""Llama (and Mistral): the pre-norm decoder stack every supported family is built from.

Parameter names follow the HF checkpoint without its `model.` prefix (`layers.{i}` counts from
this stage's first layer), except the fused `qkv_proj` and `gate_up_proj`, which the loader
assembles from q/k/v and gate/up.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tokenflow.replica.attention.backends import (
    AttentionBackend,
    AttentionMetadata,
    TorchAttentionBackend,
    attention_step,
)
from tokenflow.replica.models.config import ModelArchConfig
from tokenflow.replica.models.layers import Attention, GatedMLP, RMSNorm, Rope, RotaryEmbedding


class DecoderLayer(nn.Module):
    """One transformer block: owns its attention, its MLP and the two norms before them."""

    def __init__(self, arch: ModelArchConfig, layer: int, index: int) -> None:
        """`layer`: its number in the model; `index`: in this stage (its KV cache's)."""
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.self_attn = Attention(arch, index, arch.sliding_window(layer))
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.mlp = GatedMLP(arch.hidden_size, arch.intermediate_size)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        rope: Rope,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden, residual) -> (hidden, residual); the residual add is fused into the norms."""
        hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, rope)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class CausalLM(nn.Module):
    """One pipeline stage of a decoder-only LM: layers [layer_start, layer_end) and their weights.

    The first stage owns the token embedding; the last owns the final norm and the LM head
    (with tied embeddings on a single stage the head is the embedding itself). Between stages
    travel (hidden, residual), both un-normed. `kv_caches[i]` is the cache of this stage's
    i-th layer, [2, num_blocks, block_size, num_kv_heads, head_dim].
    """

    def __init__(
        self,
        arch: ModelArchConfig,
        layer_range: tuple[int, int] | None = None,
        backend: AttentionBackend | None = None,
    ) -> None:
        super().__init__()
        start, end = layer_range or (0, arch.num_layers)
        if not 0 <= start < end <= arch.num_layers:
            raise ValueError(f"layer_range {layer_range} is not within [0, {arch.num_layers}]")
        self.arch, self.layer_start, self.layer_end = arch, start, end
        self.is_first_stage, self.is_last_stage = start == 0, end == arch.num_layers
        self.backend = backend or TorchAttentionBackend()
        self.embed_tokens = (
            nn.Embedding(arch.vocab_size, arch.hidden_size) if self.is_first_stage else None
        )
        self.layers = nn.ModuleList(
            DecoderLayer(arch, layer, layer - start) for layer in range(start, end))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps) if self.is_last_stage else None
        own_head = self.is_last_stage and not (arch.tie_word_embeddings and self.is_first_stage)
        self.lm_head = (
            nn.Linear(arch.hidden_size, arch.vocab_size, bias=False) if own_head else None
        )
        self.rotary = RotaryEmbedding(
            arch.head_dim, arch.max_position_embeddings, arch.rope_theta, arch.rope_scaling
        )
        self._run_layers = self.run_layers  # or its compiled form (`use_compiled`)

    def use_compiled(self, run_layers: Callable[..., tuple[torch.Tensor, torch.Tensor | None]]
                     ) -> None:
        """Run the layers through `run_layers`, the compiled form of `self.run_layers`."""
        self._run_layers = run_layers

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_meta: AttentionMetadata,
        hidden: torch.Tensor | None = None,
        residual: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Non-last stages return (hidden, residual); the last returns (normed hidden, None)."""
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"{len(kv_caches)} KV caches for {len(self.layers)} layers")
        with attention_step(attn_meta, kv_caches, self.backend):
            return self._run_layers(input_ids, positions, hidden, residual)

    def run_layers(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        hidden: torch.Tensor | None,
        residual: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The stage's layers over one step (inside `attention_step`): what `compile` compiles."""
        if self.embed_tokens is not None:
            hidden, residual = self.embed_tokens(input_ids), None
        elif hidden is None:
            raise ValueError("a stage after the first needs the previous stage's hidden states")
        rope = self.rotary(positions, hidden.dtype)
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, rope)
        if self.norm is None:
            return hidden, residual
        return self.norm(hidden, residual)[0], None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final-normed hidden [n, hidden] -> float32 logits [n, vocab] (last stage only)."""
        if not self.is_last_stage:
            raise RuntimeError("compute_logits runs on the last pipeline stage only")
        if self.lm_head is not None:  # its own, or a quantized copy of the tied embedding
            return self.lm_head(hidden).float()
        assert self.embed_tokens is not None
        return F.linear(hidden, self.embed_tokens.weight).float()


class LlamaForCausalLM(CausalLM):
    """Llama 2 / 3 / 3.x (rope scaling `llama3` included)."""


class MistralForCausalLM(CausalLM):
    """Mistral: the Llama architecture, with a sliding attention window on every layer."""
