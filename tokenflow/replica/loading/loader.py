"""Weight loading: a `ModelSource` (config and checkpoint tensors) -> `CausalLM`.

Sources yield Hugging Face tensor names (a GGUF source maps its own names to them). The loader
maps each parameter of the model it built back to the checkpoint tensors it comes from (q/k/v
rows of the fused `qkv_proj`, gate/up rows of `gate_up_proj`), so a pipeline stage reads only
the tensors of its own layers, and a tensor the model needs but the checkpoint lacks is an
error that names it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

import torch

from tokenflow.replica.attention.backends import select_backend
from tokenflow.replica.loading.model_source import ModelSource, TensorSource
from tokenflow.replica.loading.resolve import resolve_model
from tokenflow.replica.models import CausalLM
from tokenflow.replica.models.config import ModelArchConfig
from tokenflow.replica.models.quantized import Quantization, prepack_lm_head, quantize_linears
from tokenflow.replica.models.registry import get_model_class

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
# Fused parameter -> the checkpoint tensors stacked along dim 0, in order.
_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def _parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    key = name.removeprefix("torch.")
    if key not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}; valid: {', '.join(_DTYPES)}")
    return _DTYPES[key]


def resolve_dtype(
    model_config_dtype: str, checkpoint_dtype: str | torch.dtype | None, device: torch.device | str,
    keep_half: bool = False
) -> torch.dtype:
    """`auto` = the checkpoint's dtype, except float32 on CPU for half-precision checkpoints
    (unless `keep_half`: the KV cache's `auto` is the model's dtype as it is)."""
    if model_config_dtype != "auto":
        return _parse_dtype(model_config_dtype)
    dtype = torch.float32 if checkpoint_dtype is None else _parse_dtype(checkpoint_dtype)
    # Half-precision matmuls on CPU are slow and lossy; compute in float32 there.
    if not keep_half and torch.device(device).type == "cpu" \
            and dtype in (torch.float16, torch.bfloat16):
        return torch.float32
    return dtype


def resolve_quantization(requested: str, source: ModelSource, device: torch.device | str,
                         load_format: str = "auto") -> Quantization:
    """`auto`: the checkpoint's own (`ModelSource.stored_quantization`) on CPU, none on a GPU
    (the packed kernels are CPU ones) or with dummy weights. A quantization the device cannot
    run is refused."""
    on_cpu = torch.device(device).type == "cpu"
    if requested == "auto":
        if not on_cpu or load_format == "dummy" or source.auto_load_format == "dummy":
            return "none"
        requested = source.stored_quantization()
    if requested != "none" and not on_cpu:
        raise ValueError(f"quantization {requested!r} runs on the CPU only (its kernels are "
                         "torch's packed CPU ones); use quantization: none on a GPU")
    if requested not in ("none", "int8", "int4"):
        raise ValueError(f"unknown quantization {requested!r}; valid: auto, none, int8, int4")
    return requested  # type: ignore[return-value]


def load_model(
    model: ModelSource | str | Path,
    *,
    dtype: torch.dtype,
    device: torch.device,
    load_format: str = "auto",
    layer_range: tuple[int, int] | None = None,
    seed: int = 0,
    quantization: Quantization = "none",
    batch_invariant: bool = False,
) -> CausalLM:
    """Build the model, or its pipeline stage `layer_range` = [start, end), with its weights,
    its linear layers quantized as asked (`quantize_linears`) and, on the CPU, its LM head
    prepacked for oneDNN (`prepack_lm_head`). `batch_invariant` (`ModelConfig`): quantized
    layers keep no dense copy (one kernel for every row count), a quantized head is not
    prepacked, and attention computes decodes as it computes prompts."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"unknown load_format {load_format!r}; valid: {', '.join(LOAD_FORMATS)}")
    source = model if isinstance(model, ModelSource) else resolve_model(str(model))
    if load_format == "auto":
        load_format = source.auto_load_format
    if load_format not in ("dummy", source.weight_format):
        raise ValueError(f"model {source.name!r} has {source.weight_format} weights; "
                         f"load_format={load_format!r} cannot read them (use auto or dummy)")
    arch = source.arch_config()
    model_cls = get_model_class(arch.architecture)
    device = torch.device(device)
    # Build on the meta device so no memory is touched before the real weights arrive.
    with torch.device("meta"):
        model = model_cls(arch, layer_range, select_backend(device, batch_invariant)).to(dtype)
    model.to_empty(device=device)
    needed = _needed_tensors(model)
    if load_format == "dummy":
        _fill(needed, _dummy_tensors(needed, seed))
    else:
        _fill(needed, source.tensors(set(needed)))
    quantize_linears(model, quantization, keep_dense=not batch_invariant)
    if not (batch_invariant and quantization != "none"):
        prepack_lm_head(model)
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
