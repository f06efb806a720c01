"""Tiny GGUF files for tests, written the way llama.cpp's `convert_hf_to_gguf.py` writes them.

`write_gguf(tmp_dir, family)` takes a tiny random transformers model (tests/checkpoints.py),
renames its tensors with the `gguf` package's own HF -> GGUF name map, permutes the q/k rows of
`llama` files as the converter does, quantizes 2-D weights (1-D norms and biases stay F32), and
stores tokenflow-tiny's byte-level BPE vocabulary, merges, token types, special ids and a chat
template as metadata. transformers loads the result with `from_pretrained(dir, gguf_file=...)`,
so tests compare tokenflow with it on the very same file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np

from tests.checkpoints import build_hf_model
from tokenflow.replica.loading.model_source import tiny_model_dir
from tokenflow.replica.loading.tiny_model import CHAT_TEMPLATE as LLAMA3_TEMPLATE

Q = gguf.GGMLQuantizationType
GGUF_NAME = "model.gguf"
# A ChatML template with a default system turn, as Qwen and SmolLM ship.
CHATML_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _spec(arch: Any, pre: str, template: str, add_bos: bool, qtypes: dict[str, Q],
          **hf: Any) -> dict[str, Any]:
    return {"arch": arch, "pre": pre, "template": template, "add_bos": add_bos,
            "qtypes": qtypes, "hf": hf}


# family -> how its file is written. `qtypes`: GGUF tensor-name prefix -> type ("" = default).
FAMILIES: dict[str, dict[str, Any]] = {
    # Llama 3 style: permuted q/k, untied head, BOS added by the tokenizer, 4-bit weights.
    "llama": _spec(gguf.MODEL_ARCH.LLAMA, "llama-bpe", LLAMA3_TEMPLATE, True,
                   {"": Q.Q4_0, "token_embd": Q.Q8_0, "output": Q.Q8_0, "blk.1.attn_v": Q.Q8_0}),
    # Qwen2: q/k/v biases, half-precision weights, tied embeddings.
    "qwen2": _spec(gguf.MODEL_ARCH.QWEN2, "qwen2", CHATML_TEMPLATE, False,
                   {"": Q.F16, "blk.0.ffn": Q.Q4_1, "blk.1.attn": Q.BF16},
                   tie_word_embeddings=True),
    # Qwen3: q/k norms, a head size that is not hidden / heads (transformers' GGUF loader
    # takes Qwen3's head_dim from its config default, 128, so that is the size used).
    "qwen3": _spec(gguf.MODEL_ARCH.QWEN3, "qwen2", CHATML_TEMPLATE, False,
                   {"": Q.Q8_0, "blk.1": Q.Q4_1, "blk.0.ffn_down": Q.Q5_0,
                    "blk.0.attn_output": Q.Q5_1, "output": Q.F32}, head_dim=128),
}
# Extra tokens appended to the vocabulary (and so to the model): (text, llama.cpp token type).
EXTRA_TOKENS = [("<|im_start|>", gguf.TokenType.CONTROL), ("<|im_end|>", gguf.TokenType.CONTROL),
                ("<think>", gguf.TokenType.USER_DEFINED),
                # Spelled outside the byte alphabet: transformers respells it, adds it not.
                ("<｜fim▁hole｜>", gguf.TokenType.CONTROL)]


def tiny_vocabulary() -> tuple[list[str], list[int], list[str]]:
    """tokenflow-tiny's tokens (by id, then EXTRA_TOKENS), their types, and its merges."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tiny_model_dir() / "tokenizer.json"))
    by_id = {i: t for t, i in tok.get_vocab(with_added_tokens=True).items()}
    tokens = [by_id[i] for i in range(len(by_id))]
    special = {i for i, t in tok.get_added_tokens_decoder().items() if t.special}
    types = [gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL
             for i in range(len(tokens))]
    tokens += [t for t, _ in EXTRA_TOKENS]
    types += [kind for _, kind in EXTRA_TOKENS]
    import json

    merges = json.loads(tok.to_str())["model"]["merges"]
    return tokens, [int(t) for t in types], [" ".join(m) for m in merges]


def permute_qk(weights: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's `LlamaModel.permute`: rotate-half row pairs -> interleaved pairs."""
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def source_model(family: str, *, seed: int = 0, **overrides: Any) -> Any:
    """The transformers model `write_gguf(..., family, seed=seed)` converts."""
    vocab_size = len(tiny_vocabulary()[0])
    return build_hf_model(family, seed=seed, vocab_size=vocab_size,
                          **{**FAMILIES[family]["hf"], **overrides})


def write_gguf(tmp_dir: str | Path, family: str, *, seed: int = 0,
               qtypes: dict[str, Q] | None = None, **overrides: Any) -> Path:
    """Write `<tmp_dir>/<family>-gguf-s<seed>/model.gguf`; returns that directory.
    `qtypes` replaces the family's quantization plan (e.g. `{"": Q.F32}`)."""
    spec = FAMILIES[family]
    tokens, types, merges = tiny_vocabulary()
    hf_model = source_model(family, seed=seed, **overrides)
    cfg = hf_model.config
    out = Path(tmp_dir) / f"{family}-gguf-s{seed}"
    out.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(out / GGUF_NAME, gguf.MODEL_ARCH_NAMES[spec["arch"]])
    _write_hparams(writer, cfg, spec["arch"])
    _write_vocab(writer, tokens, types, merges, spec)
    names = gguf.get_tensor_name_map(spec["arch"], cfg.num_hidden_layers)
    for hf_name, tensor in hf_model.state_dict().items():
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # the converter writes no output.weight for a tied head
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        data = tensor.float().numpy()
        if spec["arch"] == gguf.MODEL_ARCH.LLAMA and ".q_proj." in hf_name:
            data = permute_qk(data, cfg.num_attention_heads)
        elif spec["arch"] == gguf.MODEL_ARCH.LLAMA and ".k_proj." in hf_name:
            data = permute_qk(data, cfg.num_key_value_heads)
        _add_tensor(writer, name, data, _qtype(name, qtypes or spec["qtypes"]))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _qtype(name: str, qtypes: dict[str, Q]) -> Q:
    prefix = max((p for p in qtypes if name.startswith(p)), key=len)
    return qtypes[prefix]


def _add_tensor(writer: gguf.GGUFWriter, name: str, data: np.ndarray, qtype: Q) -> None:
    if data.ndim == 1 or qtype == Q.F32:  # norms and biases always stay F32
        writer.add_tensor(name, data.astype(np.float32))
    elif qtype == Q.F16:
        writer.add_tensor(name, data.astype(np.float16))
    else:
        packed = gguf.quantize(data, qtype)
        writer.add_tensor(name, packed, raw_shape=packed.shape, raw_dtype=qtype)


def _write_hparams(writer: gguf.GGUFWriter, cfg: Any, arch: Any) -> None:
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    if arch == gguf.MODEL_ARCH.LLAMA:
        writer.add_vocab_size(cfg.vocab_size)
        writer.add_rope_dimension_count(head_dim)


def _write_vocab(writer: gguf.GGUFWriter, tokens: list[str], types: list[int],
                 merges: list[str], spec: dict[str, Any]) -> None:
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(spec["pre"])
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    ids = {t: i for i, t in enumerate(tokens)}
    if spec["pre"] == "llama-bpe":
        writer.add_bos_token_id(ids["<|begin_of_text|>"])
        writer.add_eos_token_id(ids["<|eot_id|>"])
    else:
        writer.add_bos_token_id(ids["<|im_start|>"])
        writer.add_eos_token_id(ids["<|im_end|>"])
        writer.add_pad_token_id(ids["<|end_of_text|>"])
    writer.add_add_bos_token(spec["add_bos"])
    writer.add_chat_template(spec["template"])
