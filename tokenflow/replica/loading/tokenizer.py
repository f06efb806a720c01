"""The tokenizer of a local model directory: `tokenizer.json` through the `tokenizers` library,
special tokens and the chat template from `tokenizer_config.json`, end ids from the model config.

Behaves like transformers' `PreTrainedTokenizerFast` on the same files (tests compare the two),
without importing transformers.
"""

from __future__ import annotations

import functools
import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2 import meta, nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")
# Texts longer than this are encoded through the batch API, which lets other threads run.
_LONG_TEXT_CHARS = 4096


class Tokenizer:
    """Owns one model's token <-> text mapping, its special tokens and its chat template."""

    def __init__(
        self,
        backend: HFTokenizer,
        tokenizer_config: dict[str, Any] | None = None,
        model_eos_token_ids: list[int] | None = None,
    ) -> None:
        self._tok = backend
        cfg = tokenizer_config or {}
        self._special_tokens: dict[str, str] = {
            key: token for key in _SPECIAL_TOKEN_KEYS if (token := _token_content(cfg.get(key)))
        }
        self.chat_template: str | None = _pick_chat_template(cfg.get("chat_template"))
        self._compiled_template: jinja2.Template | None = None

        self.bos_token_id: int | None = self._id_of("bos_token")
        # tokenizer.json's post-processor decides what encode() adds; transformers 5 ignores
        # tokenizer_config's add_bos_token/add_eos_token when tokenizer.json exists, and so do we.
        # This flag reports the outcome, so callers can tell whether a prompt already has a BOS.
        self.add_bos_token: bool = (
            self.bos_token_id is not None
            and self.bos_token_id in self._tok.encode("", add_special_tokens=True).ids
        )
        eos = self._id_of("eos_token")
        model_eos = list(model_eos_token_ids or [])
        self.eos_token_id: int | None = eos if eos is not None else next(iter(model_eos), None)
        # Every id that ends generation: the tokenizer's EOS plus the model's (Llama 3 has two).
        self.eos_token_ids: set[int] = {i for i in [self.eos_token_id, *model_eos] if i is not None}
        added = self._tok.get_added_tokens_decoder()
        named = {self._id_of(key) for key in self._special_tokens}
        self.all_special_ids: set[int] = {i for i, t in added.items() if t.special} | {
            i for i in named if i is not None
        }

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load `tokenizer.json`, and `tokenizer_config.json`, `generation_config.json`,
        `config.json` and `chat_template.jinja` when present."""
        model_dir = Path(path)
        tokenizer_file = model_dir / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(
                f"no tokenizer.json in {model_dir}: tokenflow needs a fast-tokenizer file "
                "(convert a slow tokenizer with transformers and save it first)"
            )
        cfg = _read_json(model_dir / "tokenizer_config.json")
        template_file = model_dir / "chat_template.jinja"
        if template_file.is_file():  # as in transformers, the file wins over the config entry
            cfg["chat_template"] = template_file.read_text(encoding="utf-8")
        # generation_config.json is what HF generate() obeys, so it wins over config.json.
        eos_ids = _as_id_list(_read_json(model_dir / "generation_config.json").get("eos_token_id"))
        eos_ids = eos_ids or _as_id_list(_read_json(model_dir / "config.json").get("eos_token_id"))
        return cls(HFTokenizer.from_file(str(tokenizer_file)), cfg, eos_ids)

    # -- encoding -------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included (transformers' `len(tokenizer)`)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) > _LONG_TEXT_CHARS:
            # encode_batch releases the GIL while it works; encode holds it throughout.
            return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    @functools.cached_property
    def max_bytes_per_token(self) -> int:
        """An upper bound on the UTF-8 bytes of text one token stands for (special tokens
        included): a vocabulary entry is never shorter than the text it covers."""
        return max(len(token.encode()) for token in self._tok.get_vocab(with_added_tokens=True))

    def vocab(self) -> dict[str, int]:
        """Every token's vocabulary string (byte-level or sentencepiece form) and its id."""
        return self._tok.get_vocab(with_added_tokens=True)

    @functools.cached_property
    def token_encoding(self) -> str:
        """How vocabulary strings stand for bytes: "byte_level" (GPT-2's printable bytes),
        "byte_fallback" (sentencepiece pieces with <0xNN> tokens) or "raw" (the text itself),
        read from tokenizer.json's decoder."""
        decoder = json.loads(self._tok.to_str()).get("decoder") or {}
        kinds = {d.get("type") for d in decoder.get("decoders", [decoder])}
        if "ByteLevel" in kinds:
            return "byte_level"
        return "byte_fallback" if "ByteFallback" in kinds else "raw"

    @functools.cached_property
    def adds_prefix_space(self) -> bool:
        """Whether encoding prepends a space to the text (sentencepiece's "▁" on "a")."""
        ids = self._tok.encode("a", add_special_tokens=False).ids
        return bool(ids) and (self._tok.id_to_token(ids[0]) or "").startswith("▁")

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        # No clean_up_tokenization_spaces: transformers 5 and vLLM skip it for BPE too.
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: list[int], skip_special_tokens: bool = False) -> list[str]:
        tokens = []
        for i in ids:
            if skip_special_tokens and i in self.all_special_ids:
                continue
            token = self._tok.id_to_token(i)
            if token is None:
                raise ValueError(f"token id {i} is out of the vocabulary (size {self.vocab_size})")
            tokens.append(token)
        return tokens

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    @property
    def bos_token(self) -> str | None:
        return self._special_tokens.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self._special_tokens.get("eos_token")

    # -- chat -----------------------------------------------------------------------------
    def use_chat_template(self, template: str) -> None:
        """Render chats with `template` (jinja text) instead of the model's own."""
        self.chat_template = template
        self._compiled_template = None

    @property
    def template_takes_tools(self) -> bool:
        """Whether the chat template reads `tools` (one that does not would silently drop
        the tool definitions)."""
        if self.chat_template is None:
            return False
        return "tools" in meta.find_undeclared_variables(
            _chat_environment().parse(self.chat_template))

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render a conversation to text, as transformers' `apply_chat_template(tokenize=False)`.

        Templates usually emit the BOS themselves: encode the result with
        `add_special_tokens=False`, or the prompt starts with two BOS tokens.
        """
        if self.chat_template is None:
            raise ValueError(
                "this model has no chat template (no chat_template in tokenizer_config.json and "
                "no chat_template.jinja): use a completion prompt instead"
            )
        if self._compiled_template is None:
            self._compiled_template = _chat_environment().from_string(self.chat_template)
        variables: dict[str, Any] = {"tools": None, "documents": None, **self._special_tokens}
        variables.update(kwargs)
        return self._compiled_template.render(
            messages=messages, add_generation_prompt=add_generation_prompt, **variables
        )

    # -- internals ------------------------------------------------------------------------
    def _id_of(self, key: str) -> int | None:
        token = self._special_tokens.get(key)
        return None if token is None else self._tok.token_to_id(token)


class _GenerationBlock(Extension):
    """`{% generation %}...{% endgeneration %}` (transformers' assistant-mask tag): body as is."""

    tags = {"generation"}

    def parse(self, parser: Any) -> list[nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None,
    separators: tuple[str, str] | None = None, sort_keys: bool = False,
) -> str:
    # jinja's own tojson escapes HTML characters; chat templates expect plain json.dumps.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _chat_environment() -> ImmutableSandboxedEnvironment:
    """The environment transformers renders chat templates in: sandboxed (templates from the
    Hub are untrusted code), trim_blocks and lstrip_blocks, and the same helpers."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with path.open(encoding="utf-8") as f:
        return json.load(f)


def _token_content(value: Any) -> str | None:
    # Special tokens are saved either as plain strings or as serialized AddedToken dicts.
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _pick_chat_template(value: Any) -> str | None:
    # A list of named templates is allowed; the one named "default" serves chat requests.
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        value = named.get("default")
    return value if isinstance(value, str) else None


def _as_id_list(value: Any) -> list[int]:
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int)]
    return []
