"""The tokenizer a GGUF file describes, rebuilt as a `tokenizers.Tokenizer`.

A GGUF carries no `tokenizer.json`: llama.cpp's converter stores the vocabulary, the merges, each
token's type (normal, control, user-defined), the special token ids, the name of the
pre-tokenizer and the chat template as metadata. This module rebuilds from them exactly the
tokenizer transformers builds when it loads the same file (`AutoTokenizer.from_pretrained(dir,
gguf_file=...)`; tests compare the two), without importing transformers.

Only byte-level BPE vocabularies (`tokenizer.ggml.model == "gpt2"`: Llama 3, Qwen2/3, SmolLM,
Mistral's Tekken) are read; a SentencePiece one is a clear error.
"""

from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from tokenflow.replica.loading.tokenizer import Tokenizer

_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp's token types

# How each pre-tokenizer name llama.cpp writes splits text before the merges apply (the
# regexes transformers uses for them). A name not listed keeps GPT-2's own split, as in
# transformers.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZER_SPLITS: dict[str, str] = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral",
                     "midm-2.0", "lfm2", "jina-v5-nano", "dbrx", "smaug-bpe"), _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"), _QWEN2_SPLIT),
    "tekken": _TEKKEN_SPLIT,
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _GPT4O_SPLIT),
}
_SPECIAL_IDS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id",
                "unk_token": "unknown_token_id", "pad_token": "padding_token_id"}


def gguf_tokenizer(metadata: dict[str, Any]) -> Tokenizer:
    """Our `Tokenizer` for a GGUF file's metadata: backend, special tokens, chat template."""
    kind = metadata.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"the GGUF file's tokenizer is {kind!r}; tokenflow reads only byte-level "
                         "BPE vocabularies ('gpt2': Llama 3, Qwen, SmolLM)")
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    special = {name: tokens[metadata[f"tokenizer.ggml.{key}"]]
               for name, key in _SPECIAL_IDS.items() if f"tokenizer.ggml.{key}" in metadata}
    backend = _byte_level_bpe(tokens, metadata.get("tokenizer.ggml.merges") or [])
    _set_split(backend, metadata.get("tokenizer.ggml.pre"))
    _add_typed_tokens(backend, tokens, metadata.get("tokenizer.ggml.token_type") or [])
    add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", False))
    add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", False))
    backend.post_processor = _post_processor(backend, special, add_bos, add_eos)
    eos_id = metadata.get("tokenizer.ggml.eos_token_id")
    config = {**special, "chat_template": metadata.get("tokenizer.chat_template")}
    return Tokenizer(backend, config, [] if eos_id is None else [eos_id])


def _byte_level_spelling() -> dict[int, str]:
    """GPT-2's byte -> printable character map (printable ASCII and Latin-1 map to themselves)."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    extra = (b for b in range(256) if b not in kept)
    return {b: chr(b) for b in kept} | {b: chr(256 + i) for i, b in enumerate(extra)}


def _byte_level_bpe(tokens: list[str], merges: list[str]) -> HFTokenizer:
    spelling = _byte_level_spelling()
    alphabet = set(spelling.values())
    # A token written with characters outside the byte alphabet (llama.cpp stores some added
    # tokens as plain text) is looked up by its bytes' spelling, as transformers does.
    vocab = {token if set(token) <= alphabet
             else "".join(spelling[b] for b in token.encode("utf-8")): index
             for index, token in enumerate(tokens)}
    bpe = models.BPE(vocab=vocab, merges=[tuple(m.split(" ")) for m in merges], dropout=None,
                     continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False)
    backend = HFTokenizer(bpe)
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return backend


def _set_split(backend: HFTokenizer, pre: str | None) -> None:
    split = PRE_TOKENIZER_SPLITS.get(pre or "")
    if split is not None:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])


def _add_typed_tokens(backend: HFTokenizer, tokens: list[str], types: list[int]) -> None:
    """Control tokens become special added tokens, user-defined ones plain added tokens, so
    the text never cuts them into pieces (llama.cpp matches both whole)."""
    alphabet = set(_byte_level_spelling().values())
    # A "control" token spelled outside the byte alphabet is a llama.cpp mislabel; adding it
    # would grow the vocabulary past the model's, so it is skipped (as transformers does).
    control = [AddedToken(t, normalized=False, special=True)
               for t, kind in zip(tokens, types, strict=False)
               if kind == _CONTROL and set(t) <= alphabet]
    if control:
        backend.add_special_tokens(control)
    vocab = backend.get_vocab()
    user = [AddedToken(t, normalized=False, special=False)
            for t, kind in zip(tokens, types, strict=False) if kind == _USER_DEFINED and t in vocab]
    if user:
        backend.add_tokens(user)


def _post_processor(backend: HFTokenizer, special: dict[str, str], add_bos: bool,
                    add_eos: bool) -> processors.TemplateProcessing:
    """What `encode(add_special_tokens=True)` adds: BOS and/or EOS as the file's flags say."""
    bos, eos = special.get("bos_token"), special.get("eos_token")
    add_bos, add_eos = add_bos and bos is not None, add_eos and eos is not None
    single = f"{bos + ':0 ' if add_bos else ''}$A:0{' ' + eos + ':0' if add_eos else ''}"
    pair = f"{single}{' ' + bos + ':1' if add_bos else ''} $B:1{' ' + eos + ':1' if add_eos else ''}"
    used = [(t, backend.token_to_id(t)) for t, on in ((bos, add_bos), (eos, add_eos)) if on]
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=used)
