"""Qwen3 (dense): the Llama stack with a per-head RMSNorm of q and k before rope.

`head_dim` is explicit in its config (not hidden / heads); the q/k norms come from the
architecture config (`ModelArchConfig.qk_norm`), so the model is the shared decoder stack.
"""

from __future__ import annotations

from tokenflow.replica.models.llama import CausalLM


class Qwen3ForCausalLM(CausalLM):
    """Qwen3: owns what every `CausalLM` owns, plus each layer's q_norm and k_norm weights."""
