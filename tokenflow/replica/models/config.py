"""The shape of a decoder-only model, parsed once from a Hugging Face `config.json` dict.

Every field of a checkpoint config that changes the model's math is either implemented here
(and by the model) or refused at load time with an error naming it: a silently dropped field
would give output that diverges from the checkpoint's own implementation.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Older configs carry only model_type, not architectures.
_MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
# Config fields that change the math, with the value under which they change nothing. A
# checkpoint that sets one to anything else is refused rather than run wrong.
_NEUTRAL_VALUES: dict[str, tuple[Any, ...]] = {
    "hidden_act": ("silu", None),
    "mlp_bias": (False, None),
    "attn_logit_softcapping": (None,),
    "final_logit_softcapping": (None,),
    "logits_scaling": (1, 1.0, None),
    "embedding_multiplier": (1, 1.0, None),
    "residual_multiplier": (1, 1.0, None),
    "attention_multiplier": (None,),
    "partial_rotary_factor": (1, 1.0, None),
    "use_qk_norm": (False, None),
    "no_rope_layers": (None,),
}
_SLIDING_LAYER = "sliding_attention"


@dataclass(frozen=True)
class RopeScaling:
    """Rotary frequency scaling: `linear` (divide by factor) or Llama 3's `llama3` bands."""

    rope_type: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelArchConfig:
    """The shape of a decoder-only model: sizes, rope, norms, biases, attention windows."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # bias on the q/k/v projections
    o_proj_bias: bool
    qk_norm: bool  # per-head RMSNorm of q and k before rope (Qwen3)
    dtype: str | None  # the checkpoint's dtype as config.json states it
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    # Per layer: how many most recent positions a query sees (itself included); None = all.
    sliding_windows: tuple[int | None, ...] = ()

    def sliding_window(self, layer: int) -> int | None:
        return self.sliding_windows[layer] if self.sliding_windows else None

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ModelArchConfig:
        arch = (cfg.get("architectures") or [_MODEL_TYPES.get(cfg.get("model_type", ""), "")])[0]
        if not arch:
            raise ValueError("config.json names no architecture (no 'architectures' key)")
        _refuse_unimplemented(cfg)
        heads = int(cfg["num_attention_heads"])
        theta, scaling = _parse_rope(cfg)
        eos = cfg.get("eos_token_id")
        bias = bool(cfg.get("attention_bias", False))
        is_qwen2 = arch == "Qwen2ForCausalLM"  # Qwen2 always has q/k/v bias and no o_proj bias
        num_layers = int(cfg["num_hidden_layers"])
        return cls(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=is_qwen2 or bias,
            o_proj_bias=bias and not is_qwen2,
            qk_norm=arch == "Qwen3ForCausalLM",
            dtype=cfg.get("dtype") or cfg.get("torch_dtype"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,)),
            sliding_windows=_sliding_windows(arch, cfg, num_layers),
        )

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> ModelArchConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no config.json in model directory {model_dir}")
        return cls.from_hf_config(json.loads(path.read_text()))


def _refuse_unimplemented(cfg: dict[str, Any]) -> None:
    for name, neutral in _NEUTRAL_VALUES.items():
        if name in cfg and cfg[name] not in neutral:
            raise ValueError(
                f"config field {name}={cfg[name]!r} changes the model's math and is not "
                "implemented by tokenflow; refusing to load a model that would run wrong")


def _sliding_windows(arch: str, cfg: dict[str, Any], num_layers: int) -> tuple[int | None, ...]:
    """Each layer's attention window, as transformers applies it for the architecture."""
    window = cfg.get("sliding_window")
    if arch == "MistralForCausalLM":  # every layer, whenever a window is set
        return (int(window),) * num_layers if window else ()
    if arch not in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        return ()  # Llama has no window; transformers ignores the field there
    if not cfg.get("use_sliding_window", False) or not window:
        return ()
    types = cfg.get("layer_types") or [
        _SLIDING_LAYER if i >= cfg.get("max_window_layers", 28) else "full_attention"
        for i in range(num_layers)]
    return tuple(int(window) if t == _SLIDING_LAYER else None for t in types)


def _parse_rope(cfg: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    # transformers 5 writes `rope_parameters` (theta inside); 4.x `rope_theta` + `rope_scaling`.
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"config field partial_rotary_factor={params['partial_rotary_factor']} "
                         "changes the model's math and is not implemented by tokenflow")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type not in ("linear", "llama3"):
        raise ValueError(f"unsupported rope_type {rope_type!r}; supported: default, linear, llama3")
    fields = ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    extra = {k: params[k] for k in fields if k in params}
    return theta, RopeScaling(rope_type=rope_type, factor=float(params["factor"]), **extra)
