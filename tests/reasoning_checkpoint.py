"""A tiny Qwen3 checkpoint that can think: `write_qwen3_thinking_checkpoint(tmp_dir)`.

The model is tests/checkpoints.py's random `qwen3` (written by transformers' `save_pretrained`);
the tokenizer is a small byte-level BPE trained here and saved through transformers'
`PreTrainedTokenizerFast`, laid out like Qwen3's: ChatML's `<|im_start|>` / `<|im_end|>` and
`<|endoftext|>` as special tokens, `<think>` and `</think>` as single added tokens that are not
special (so decoding keeps them in the text, as Qwen3's does), `<|im_end|>` the EOS.

The chat template is written here in the shape of Qwen3's: ChatML, earlier assistant turns
stripped of their thinking, and with `enable_thinking=False` the generation prompt closes an
empty think block (`<think>\\n\\n</think>\\n\\n`) so that the model answers directly.
"""

from __future__ import annotations

from pathlib import Path

from tests.checkpoints import write_checkpoint

THINK_START, THINK_END = "<think>", "</think>"
EOS = "<|im_end|>"
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", EOS)
# What enable_thinking=False appends to the generation prompt, as Qwen3's template does.
EMPTY_THINK = f"{THINK_START}\n\n{THINK_END}\n\n"

CHAT_TEMPLATE = """\
{%- for message in messages %}
    {%- set content = message['content'] %}
    {%- if message['role'] == 'assistant' and '</think>' in content %}
        {#- Earlier turns' thinking is not shown to the model again. #}
        {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
    {%- endif %}
    {{- '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""

# Enough text for a few hundred merges, "\n\n" among them; the trainer is deterministic.
_CORPUS = [
    "the quick brown fox jumps over the lazy dog.\n\n",
    "hello world, how are you today? i am fine, thank you.\n\n",
    "let me think about this step by step: first the question, then the answer.\n",
    "the answer is forty two, and the question is what six times seven makes.\n\n",
    "system user assistant tool reasoning content message\n",
]
_BPE_VOCAB = 320  # 256 bytes + merges; the added tokens come after


def build_tokenizer():  # noqa: ANN201 - a transformers PreTrainedTokenizerFast
    """The Qwen3-style tokenizer described above, as a transformers fast tokenizer."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=_BPE_VOCAB, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_CORPUS * 4, trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t in (THINK_START, THINK_END)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS,
                                   pad_token="<|endoftext|>", chat_template=CHAT_TEMPLATE)


def write_qwen3_thinking_checkpoint(tmp_dir: str | Path, seed: int = 0) -> Path:
    """A random tiny Qwen3 model with the tokenizer and template above, under tmp_dir; returns
    the model directory. The model's vocabulary is exactly the tokenizer's, and its EOS (in
    config.json and generation_config.json) is `<|im_end|>`."""
    tokenizer = build_tokenizer()
    ids = tokenizer.convert_tokens_to_ids
    path = write_checkpoint(tmp_dir, "qwen3", seed=seed, vocab_size=len(tokenizer),
                            bos_token_id=ids("<|endoftext|>"), eos_token_id=ids(EOS),
                            pad_token_id=ids("<|endoftext|>"))
    tokenizer.save_pretrained(path)
    return path
