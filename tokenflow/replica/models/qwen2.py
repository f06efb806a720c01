"""Qwen2 / Qwen2.5: the Llama stack with a bias on the q/k/v projections (none on o_proj).

The bias comes from the architecture config (`ModelArchConfig.attention_bias`), so the model
itself is the shared decoder stack.
"""

from __future__ import annotations

from tokenflow.replica.models.llama import CausalLM


class Qwen2ForCausalLM(CausalLM):
    """Qwen2: owns what every `CausalLM` owns; its q/k/v projections carry a bias."""
