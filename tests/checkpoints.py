"""Tiny random Hugging Face checkpoints for tests: `write_checkpoint(tmp_dir, family)`.

Each is a real `transformers` model (hidden 64, 2 layers, 4 heads, 2 KV heads, vocab 512)
saved with `save_pretrained` as safetensors, so tests can compare against HF itself. Norm
weights and biases are randomised too (HF initialises them to 1 and 0), so a loader that mixes
them up fails.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

FAMILIES = ("llama", "llama3", "mistral", "qwen2", "qwen3")

_BASE: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    # Wider than HF's 0.02 so that greedy tokens are not near-ties between implementations.
    "initializer_range": 0.1,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # Small, so that the tiny head_dim has frequencies in all three bands.
    "original_max_position_embeddings": 64,
}


def hf_config(family: str, *, tie_word_embeddings: bool = False, **overrides: Any) -> Any:
    """The transformers config of a tiny model of `family` (see FAMILIES)."""
    import transformers

    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; valid: {', '.join(FAMILIES)}")
    kwargs = {**_BASE, "tie_word_embeddings": tie_word_embeddings}
    if family == "llama3":
        kwargs["rope_parameters"] = dict(_LLAMA3_ROPE)
    if family == "qwen3":
        kwargs["head_dim"] = 32  # explicit and != hidden / heads, as in real Qwen3 models
    kwargs.update(overrides)
    cls = {
        "llama": transformers.LlamaConfig,
        "llama3": transformers.LlamaConfig,
        "mistral": transformers.MistralConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
    }[family]
    return cls(**kwargs)


def build_hf_model(
    family: str, *, tie_word_embeddings: bool = False, seed: int = 0, **overrides: Any
) -> torch.nn.Module:
    """A deterministic random float32 HF model of `family`, in eval mode."""
    import transformers

    config = hf_config(family, tie_word_embeddings=tie_word_embeddings, **overrides)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * torch.randn(param.shape))
            elif name.endswith(".bias"):
                param.copy_(0.2 * torch.randn(param.shape))
    return model.eval()


def write_checkpoint(
    tmp_dir: str | Path,
    family: str,
    *,
    tie_word_embeddings: bool = False,
    sharded: bool = False,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    **overrides: Any,
) -> Path:
    """Save a tiny random `family` model under tmp_dir; returns the model directory.

    `sharded` splits the weights over several files with a `model.safetensors.index.json`;
    `overrides` are passed to the transformers config (e.g. num_hidden_layers=4).
    """
    model = build_hf_model(family, tie_word_embeddings=tie_word_embeddings, seed=seed, **overrides)
    out = Path(tmp_dir) / f"{family}{'-tied' if tie_word_embeddings else ''}-s{seed}"
    model.to(dtype).save_pretrained(out, max_shard_size="100KB" if sharded else "5GB")
    return out
