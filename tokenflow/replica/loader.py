"""Model architecture config and weight loading: `config.json` + `*.safetensors` -> `CausalLM`.

Checkpoints use Hugging Face tensor names. The loader maps each parameter of the model it built
back to the checkpoint tensors it comes from (q/k/v rows of the fused `qkv_proj`, gate/up rows
of `gate_up_proj`), so a pipeline stage reads only the tensors of its own layers, and a tensor
the model needs but the checkpoint lacks is an error that names it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open

from tokenflow.replica.attention import select_backend
from tokenflow.replica.models.registry import get_model_class

if TYPE_CHECKING:  # the models import this module's config type, so no runtime import back
    from tokenflow.replica.models import CausalLM

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}
# Older configs carry only model_type, not architectures.
_MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
# Fused parameter -> the checkpoint tensors stacked along dim 0, in order.
_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


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
    """The shape of a decoder-only model, parsed once from an HF `config.json`."""

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

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ModelArchConfig:
        arch = (cfg.get("architectures") or [_MODEL_TYPES.get(cfg.get("model_type", ""), "")])[0]
        if not arch:
            raise ValueError("config.json names no architecture (no 'architectures' key)")
        if cfg.get("mlp_bias"):
            raise ValueError("mlp_bias=true is not supported")
        heads = int(cfg["num_attention_heads"])
        theta, scaling = _parse_rope(cfg)
        eos = cfg.get("eos_token_id")
        bias = bool(cfg.get("attention_bias", False))
        is_qwen2 = arch == "Qwen2ForCausalLM"  # Qwen2 always has q/k/v bias and no o_proj bias
        return cls(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
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
        )

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> ModelArchConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no config.json in model directory {model_dir}")
        return cls.from_hf_config(json.loads(path.read_text()))


def _parse_rope(cfg: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    # transformers 5 writes `rope_parameters` (theta inside); 4.x `rope_theta` + `rope_scaling`.
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type not in ("linear", "llama3"):
        raise ValueError(f"unsupported rope_type {rope_type!r}; supported: default, linear, llama3")
    fields = ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    extra = {k: params[k] for k in fields if k in params}
    return theta, RopeScaling(rope_type=rope_type, factor=float(params["factor"]), **extra)


def _parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    key = name.removeprefix("torch.")
    if key not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}; valid: {', '.join(_DTYPES)}")
    return _DTYPES[key]


def resolve_dtype(
    model_config_dtype: str, checkpoint_dtype: str | torch.dtype | None, device: torch.device | str
) -> torch.dtype:
    """`auto` = the checkpoint's dtype, except float32 on CPU for half-precision checkpoints."""
    if model_config_dtype != "auto":
        return _parse_dtype(model_config_dtype)
    dtype = torch.float32 if checkpoint_dtype is None else _parse_dtype(checkpoint_dtype)
    # Half-precision matmuls on CPU are slow and lossy; compute in float32 there.
    if torch.device(device).type == "cpu" and dtype in (torch.float16, torch.bfloat16):
        return torch.float32
    return dtype


def load_model(
    model_dir: str | Path,
    *,
    dtype: torch.dtype,
    device: torch.device,
    load_format: str = "auto",
    layer_range: tuple[int, int] | None = None,
    seed: int = 0,
) -> CausalLM:
    """Build the model, or its pipeline stage `layer_range` = [start, end), with its weights."""
    if load_format not in ("auto", "safetensors", "dummy"):
        raise ValueError(f"unknown load_format {load_format!r}; valid: auto, safetensors, dummy")
    arch = ModelArchConfig.from_model_dir(model_dir)
    model_cls = get_model_class(arch.architecture)
    device = torch.device(device)
    # Build on the meta device so no memory is touched before the real weights arrive.
    with torch.device("meta"):
        model = model_cls(arch, layer_range, select_backend(device)).to(dtype)
    model.to_empty(device=device)
    needed = _needed_tensors(model)
    if load_format == "dummy":
        _fill(needed, _dummy_tensors(needed, seed))
    else:
        _fill(needed, _safetensors(Path(model_dir), set(needed)))
    # Inference only: no autograd bookkeeping even if a caller forgets inference_mode.
    return model.eval().requires_grad_(False)


Target = tuple[torch.Tensor, int, int]  # (parameter, first row, row count)


def _needed_tensors(model: CausalLM) -> dict[str, list[Target]]:
    """Checkpoint tensor name -> the parameter rows it fills, for this stage only."""
    arch, needed = model.arch, {}
    for name, param in model.named_parameters():
        for source, start, rows in _sources(name, param, arch, model.layer_start):
            needed.setdefault(source, []).append((param.data, start, rows))
    return needed


def _sources(
    name: str, param: torch.Tensor, arch: ModelArchConfig, layer_start: int
) -> Iterator[tuple[str, int, int]]:
    if name == "lm_head.weight":
        # A tied last stage that lacks the embedding reads the embedding tensor for its head.
        yield ("model.embed_tokens.weight" if arch.tie_word_embeddings else name), 0, param.shape[0]
        return
    if not name.startswith("layers."):
        yield f"model.{name}", 0, param.shape[0]
        return
    _, local, rest = name.split(".", 2)
    prefix = f"model.layers.{int(local) + layer_start}."
    fused = next((f for f in _FUSED if f in rest), None)
    if fused is None:
        yield prefix + rest, 0, param.shape[0]
        return
    q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    sizes = (q, kv, kv) if fused == "qkv_proj" else (arch.intermediate_size,) * 2
    start = 0
    for part, rows in zip(_FUSED[fused], sizes, strict=True):
        yield prefix + rest.replace(fused, part), start, rows
        start += rows


TensorSource = Iterator[tuple[str, torch.Tensor]]  # (checkpoint name, tensor), one at a time


def _fill(needed: dict[str, list[Target]], source: TensorSource) -> None:
    seen: set[str] = set()
    for key, tensor in source:
        for param, start, rows in needed[key]:
            dst = param.narrow(0, start, rows)
            if tuple(tensor.shape) != tuple(dst.shape):
                raise ValueError(
                    f"tensor {key}: checkpoint shape {tuple(tensor.shape)} does not match "
                    f"the model's {tuple(dst.shape)}"
                )
            dst.copy_(tensor)
        seen.add(key)
    missing = sorted(set(needed) - seen)
    if missing:
        shown = ", ".join(missing[:5]) + (
            f" (+{len(missing) - 5} more)" if len(missing) > 5 else ""
        )
        raise ValueError(f"checkpoint is missing {len(missing)} tensor(s): {shown}")


def _safetensors(model_dir: Path, wanted: set[str]) -> TensorSource:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        files = sorted({model_dir / weight_map[k] for k in wanted if k in weight_map})
    else:
        files = sorted(model_dir.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    for file in files:
        if not file.is_file():
            raise FileNotFoundError(
                f"checkpoint shard {file.name} listed in {index.name} is missing"
            )
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            for key in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                if key in wanted:
                    yield key, handle.get_tensor(key)


def _dummy_tensors(needed: dict[str, list[Target]], seed: int) -> TensorSource:
    """Random weights keyed by (seed, tensor name): any process, any stage split, same values."""
    for key, targets in sorted(needed.items()):
        param, _, rows = targets[0]
        shape = (rows, *param.shape[1:])
        yield key, _dummy_tensor(key, shape, seed)


def _dummy_tensor(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    if name.endswith("norm.weight"):
        return torch.ones(shape)
    if name.endswith(".bias"):
        return torch.zeros(shape)
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1)
    # Generated on the CPU in float32 so the values do not depend on the device or dtype.
    return torch.randn(shape, generator=gen) * 0.02
