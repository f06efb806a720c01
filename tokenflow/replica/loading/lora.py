"""PEFT LoRA adapters from a local directory: `adapter_config.json` + `adapter_model.safetensors`.

An adapter names Hugging Face modules (`model.layers.3.self_attn.q_proj`); every model source
speaks those names (a GGUF source maps its own to them and undoes llama.cpp's q/k row
permutation), so one adapter applies to a safetensors checkpoint and to a GGUF file of the same
model alike. `read_adapter` validates without reading the weights (the safetensors header
gives the shapes); `adapter_weights` reads one pipeline stage's layers.

Imports no torch at module level: the serving process validates adapters too.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tokenflow.replica.models.config import ModelArchConfig

if TYPE_CHECKING:
    import torch

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# PEFT's target module -> (our fused projection, which part of it).
TARGETS: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "o_proj": ("o_proj", 0), "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", 0),
}
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.\w+)?\.weight$")
# Options that change the math in ways this engine does not implement.
_REFUSED = {"use_dora": "DoRA", "modules_to_save": "modules_to_save",
            "layers_to_transform": "layers_to_transform", "rank_pattern": "rank_pattern",
            "alpha_pattern": "alpha_pattern", "fan_in_fan_out": "fan_in_fan_out"}

# (layer, PEFT target) -> (A [r, in], B [out, r]), scaled by `LoRASpec.scaling` on use.
AdapterWeights = dict[tuple[int, str], tuple["torch.Tensor", "torch.Tensor"]]


@dataclass(frozen=True)
class LoRASpec:
    """What `read_adapter` found valid: rank, scaling (alpha / r, or / sqrt(r) with rsLoRA)
    and the PEFT targets it adapts."""

    path: Path
    rank: int
    scaling: float
    targets: frozenset[str]


def target_shape(arch: ModelArchConfig, target: str) -> tuple[int, int]:
    """(in, out) features of a PEFT target module of `arch`."""
    q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    hidden, inter = arch.hidden_size, arch.intermediate_size
    return {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv),
            "o_proj": (q, hidden), "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
            "down_proj": (inter, hidden)}[target]


def read_adapter(path: str | Path, arch: ModelArchConfig, max_rank: int) -> LoRASpec:
    """Validate the adapter at `path` against the base model; raises ValueError saying why
    it does not fit (a missing file, a rank above `max_rank`, an unknown target, a shape
    that is not the base's)."""
    path = Path(path)
    config_file, weights_file = path / CONFIG_FILE, path / WEIGHTS_FILE
    if not config_file.is_file() or not weights_file.is_file():
        raise ValueError(f"LoRA adapter {str(path)!r}: needs {CONFIG_FILE} and {WEIGHTS_FILE}")
    config = json.loads(config_file.read_text())
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"LoRA adapter {str(path)!r}: peft_type {config['peft_type']!r} is "
                         "not LORA")
    for key, what in _REFUSED.items():
        if config.get(key):
            raise ValueError(f"LoRA adapter {str(path)!r}: {what} is not supported")
    if config.get("bias", "none") != "none":
        raise ValueError(f"LoRA adapter {str(path)!r}: bias={config['bias']!r} is not "
                         "supported (only none)")
    rank, alpha = int(config["r"]), float(config.get("lora_alpha", config["r"]))
    if not 0 < rank <= max_rank:
        raise ValueError(f"LoRA adapter {str(path)!r}: rank {rank} exceeds "
                         f"lora.max_lora_rank={max_rank}")
    targets = _check_shapes(path, arch, rank)
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return LoRASpec(path, rank, scaling, frozenset(targets))


def _check_shapes(path: Path, arch: ModelArchConfig, rank: int) -> set[str]:
    """The adapter's PEFT targets, once every tensor is a known target's A or B of the base's
    shapes, in pairs."""
    from safetensors import safe_open

    weights_file = path / WEIGHTS_FILE
    shapes: dict[tuple[int, str, str], tuple[int, ...]] = {}
    with safe_open(str(weights_file), framework="pt", device="cpu") as handle:
        for key in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
            match = _KEY.search(key)
            if match is None:
                raise ValueError(f"LoRA adapter {str(path)!r}: tensor {key!r} is not a LoRA "
                                 f"weight of a supported target ({', '.join(TARGETS)})")
            layer, target, ab = int(match[1]), match[2], match[3]
            shapes[(layer, target, ab)] = tuple(handle.get_slice(key).get_shape())
    targets = {t for _, t, _ in shapes}
    unknown = sorted(targets - set(TARGETS))
    if unknown:
        raise ValueError(f"LoRA adapter {str(path)!r}: unknown target modules {unknown}; "
                         f"supported: {', '.join(TARGETS)}")
    for (layer, target, ab), shape in shapes.items():
        d_in, d_out = target_shape(arch, target)
        want = (rank, d_in) if ab == "A" else (d_out, rank)
        if layer >= arch.num_layers or shape != want:
            raise ValueError(f"LoRA adapter {str(path)!r}: layer {layer} {target} lora_{ab} has "
                             f"shape {shape}; the base model needs {want} in layers "
                             f"0-{arch.num_layers - 1}")
        if (layer, target, "B" if ab == "A" else "A") not in shapes:
            raise ValueError(f"LoRA adapter {str(path)!r}: layer {layer} {target} lacks "
                             f"lora_{'B' if ab == 'A' else 'A'}")
    return targets


def adapter_weights(spec: LoRASpec, layer_range: tuple[int, int]) -> AdapterWeights:
    """The A and B matrices of the layers [start, end), keyed by the stage's layer index."""
    from safetensors import safe_open

    start, end = layer_range
    found: dict[tuple[int, str, str], torch.Tensor] = {}
    with safe_open(str(spec.path / WEIGHTS_FILE), framework="pt", device="cpu") as handle:
        for key in handle.keys():  # noqa: SIM118
            match = _KEY.search(key)
            assert match is not None, "read_adapter checked every key"
            layer = int(match[1])
            if start <= layer < end:
                found[(layer - start, match[2], match[3])] = handle.get_tensor(key).float()
    return {(layer, target): (a, found[(layer, target, "B")])
            for (layer, target, ab), a in found.items() if ab == "A"}
