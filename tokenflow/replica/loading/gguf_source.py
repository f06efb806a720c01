"""A model in one GGUF file: config from its metadata, weights dequantized, tokenizer rebuilt.

llama.cpp's converter renames every tensor (`blk.0.attn_q.weight`), describes the model under
its own metadata keys (`llama.attention.head_count`), and, for the `llama` architecture only,
permutes the rows of the q and k projections so that its rotary embedding can rotate adjacent
pairs. This module maps all three back to the Hugging Face form the rest of tokenflow speaks:
a `config.json`-like dict (fed to `ModelArchConfig.from_hf_config`, which refuses what would
change the math), HF tensor names, and the original row order.

Imports no torch at module level: the HTTP ingress resolves models only for their tokenizer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from tokenflow.replica.loading.gguf_file import GGUFFile, read_gguf
from tokenflow.replica.loading.gguf_tokenizer import gguf_tokenizer
from tokenflow.replica.loading.model_source import ModelSource
from tokenflow.replica.loading.tokenizer import Tokenizer
from tokenflow.replica.models.config import ModelArchConfig

if TYPE_CHECKING:
    import torch

# GGUF architecture -> ours. Mistral files say "llama" (no sliding window is stored).
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                  "qwen3": "Qwen3ForCausalLM"}
# Architecture-scoped keys that change the math -> the config.json field that says the same,
# so that `from_hf_config` refuses them unless they are neutral.
_MATH_KEYS = {"logit_scale": "logits_scaling", "embedding_scale": "embedding_multiplier",
              "residual_scale": "residual_multiplier", "attention.scale": "attention_multiplier",
              "attn_logit_softcapping": "attn_logit_softcapping",
              "final_logit_softcapping": "final_logit_softcapping"}
_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                   "output": "lm_head"}
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


@dataclass(frozen=True)
class GGUFSource(ModelSource):
    """Owns the location of one `.gguf` file (`path`) and reads the architecture, the weights
    (dequantized, under HF names) and the tokenizer from it."""

    auto_load_format: str = "gguf"
    weight_format: ClassVar[str] = "gguf"

    def arch_config(self) -> ModelArchConfig:
        return ModelArchConfig.from_hf_config(hf_config(read_gguf(self.path)))

    def tokenizer(self) -> Tokenizer:
        return gguf_tokenizer(read_gguf(self.path).metadata)

    def stored_quantization(self) -> str:
        """int4 when most of the layers' weights are 4-bit blocks (Q4_0, Q4_1, Q4_K, ...),
        int8 when they are 8-bit (Q8_0), none for float files (F32, F16, BF16) and the rest."""
        kinds = [t.tensor_type.name for name, t in read_gguf(self.path).tensors.items()
                 if name.startswith("blk.") and name.endswith(".weight") and len(t.shape) == 2]
        if not kinds:
            return "none"
        top = max(set(kinds), key=kinds.count)
        return "int4" if top.startswith(("Q4", "IQ4")) else "int8" if top.startswith("Q8") \
            else "none"

    def tensors(self, wanted: set[str]) -> Iterator[tuple[str, torch.Tensor]]:
        """The tensors named in `wanted` (HF names), float32, in the file's order."""
        import torch

        file = read_gguf(self.path)
        unpermute = _qk_unpermute(file)
        for gguf_name in file.tensors:
            name = hf_tensor_name(gguf_name)
            if name is None or name not in wanted:
                continue
            array = file.dequantized(gguf_name)
            yield name, torch.from_numpy(unpermute(name, array))


def hf_config(file: GGUFFile) -> dict[str, Any]:
    """The `config.json` dict equivalent to the file's metadata (llama.cpp's key names)."""
    arch, get = file.architecture, file.arch_value
    if arch not in _ARCHITECTURES:
        raise ValueError(f"{file.path.name}: GGUF architecture {arch!r} is not supported; "
                         f"supported: {', '.join(_ARCHITECTURES)}")
    _refuse_unsupported(file)
    heads, hidden = int(get("attention.head_count")), int(get("embedding_length"))
    config: dict[str, Any] = {
        "architectures": [_ARCHITECTURES[arch]],
        "model_type": arch,
        # Older files state no vocab_size: the embedding's rows are the vocabulary.
        "vocab_size": int(get("vocab_size") or file.tensors["token_embd.weight"].shape[-1]),
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv") or heads),
        "head_dim": _head_dim(file),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "rope_scaling": _rope_scaling(file),
        "max_position_embeddings": int(get("context_length")),
        # llama.cpp writes output.weight only when the head is not the embedding matrix.
        "tie_word_embeddings": "output.weight" not in file.tensors,
        "attention_bias": "blk.0.attn_q.bias" in file.tensors,
        "mlp_bias": "blk.0.ffn_up.bias" in file.tensors,
        "bos_token_id": file.metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": file.metadata.get("tokenizer.ggml.eos_token_id"),
    }
    config.update({field: get(key) for key, field in _MATH_KEYS.items() if get(key) is not None})
    return config


def _refuse_unsupported(file: GGUFFile) -> None:
    """Metadata that changes the math and that the HF config has no neutral form for."""
    get, name, head_dim = file.arch_value, file.path.name, _head_dim(file)
    if int(get("attention.value_length", head_dim)) != head_dim:
        raise ValueError(f"{name}: key and value head sizes differ; not implemented")
    rotary = get("rope.dimension_count")
    if rotary is not None and int(rotary) != head_dim:
        raise ValueError(f"{name}: rope.dimension_count={rotary} rotates part of each head "
                         f"(head size {head_dim}); partial rotary embeddings are not implemented")
    if get("attention.sliding_window"):
        raise ValueError(f"{name}: sliding-window attention in a GGUF file is not implemented")
    if get("expert_count"):
        raise ValueError(f"{name}: mixture-of-experts models are not implemented")
    if "rope_freqs.weight" in file.tensors:
        raise ValueError(f"{name}: per-frequency rope factors (rope_freqs.weight, Llama 3.1 "
                         "style scaling) are not implemented for GGUF files")


def _head_dim(file: GGUFFile) -> int:
    # key_length is optional: without it a head is embedding_length / head_count, as in llama.cpp.
    stated = file.arch_value("attention.key_length")
    if stated:
        return int(stated)
    return int(file.arch_value("embedding_length")) // int(file.arch_value("attention.head_count"))


def _rope_scaling(file: GGUFFile) -> dict[str, Any] | None:
    kind = file.arch_value("rope.scaling.type", "none")
    factor = file.arch_value("rope.scaling.factor") or file.arch_value("rope.scale_linear")
    if kind == "none" and factor in (None, 1.0):
        return None
    if kind not in ("linear", "none"):  # an old file states only a linear factor
        raise ValueError(f"{file.path.name}: rope scaling {kind!r} is not implemented for GGUF "
                         "files; supported: linear")
    return {"rope_type": "linear", "factor": float(factor)}


def hf_tensor_name(gguf_name: str) -> str | None:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; None if not ours."""
    stem, _, suffix = gguf_name.rpartition(".")
    if stem in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[stem]}.{suffix}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}.{suffix}"
    return None


def _qk_unpermute(file: GGUFFile) -> Callable[[str, np.ndarray], np.ndarray]:
    """Undo llama.cpp's row permutation of q/k (weights and biases) for `llama` files.

    The converter turns each head's rows from [first half | second half] (HF's rotate_half
    pairs) into interleaved pairs: `w.reshape(heads, 2, d/2, ...).swapaxes(1, 2)`. Rows are
    permuted before quantization and quantization blocks run along rows, so this is exact.
    """
    if file.architecture != "llama":
        return lambda name, array: array
    heads = int(file.arch_value("attention.head_count"))
    kv_heads = int(file.arch_value("attention.head_count_kv") or heads)

    def unpermute(name: str, array: np.ndarray) -> np.ndarray:
        n = heads if ".q_proj." in name else kv_heads if ".k_proj." in name else 0
        if not n:
            return array
        # [heads, pairs, 2, ...] -> [heads, 2, pairs, ...]: the converter's reshape, reversed.
        split = array.reshape(n, array.shape[0] // n // 2, 2, *array.shape[1:])
        return np.ascontiguousarray(split.swapaxes(1, 2)).reshape(array.shape)

    return unpermute
