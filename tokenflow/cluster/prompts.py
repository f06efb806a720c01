"""The ingress side of text: tokenize prompts, render chat templates, (de)tokenize endpoints.

docs/ARCHITECTURE.md §2: the HTTP side validates, tokenizes and builds SamplingParams;
engines get token ids. Detokenization of the output stays with the engine (it owns stop strings).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from tokenflow.cluster.errors import bad_request
from tokenflow.replica.loading.resolve import load_tokenizer

# Chat templates shipped with tokenflow, by name (`engine.chat_template: smollm2-tools`).
TEMPLATES_DIR = Path(__file__).resolve().parent.parent / "assets" / "chat_templates"


def read_chat_template(value: str) -> str:
    """The jinja text `engine.chat_template` names: a file, or a shipped template's name."""
    path = Path(value).expanduser()
    if path.is_file():
        return path.read_text(encoding="utf-8")
    shipped = TEMPLATES_DIR / f"{value}.jinja"
    if shipped.is_file():
        return shipped.read_text(encoding="utf-8")
    names = sorted(p.stem for p in TEMPLATES_DIR.glob("*.jinja"))
    raise ValueError(f"chat_template {value!r} is neither a file nor a shipped template "
                     f"({', '.join(names)})")

# Normalizers (NFKC, ...) can shrink text a few-fold before it is split into tokens; the
# byte bound below allows for that, so it only refuses prompts that certainly do not fit.
_NORMALIZER_SLACK = 4


class PromptRenderer:
    """Owns the ingress's tokenizer; every user mistake it finds is a 400 (`OpenAIError`).

    Its methods are blocking (tokenizing a long prompt takes a while): call them off the event
    loop."""

    def __init__(self, tokenizer_path: str, chat_template: str | None = None) -> None:
        self.tokenizer = load_tokenizer(tokenizer_path)
        if chat_template is not None:
            # load_tokenizer's object is shared in the process: change a copy of it.
            self.tokenizer = copy.copy(self.tokenizer)
            self.tokenizer.use_chat_template(read_chat_template(chat_template))

    def check_size(self, num_bytes: int, max_model_len: int, param: str) -> None:
        """Refuse, before tokenizing it, text whose byte length alone proves that it has more
        tokens than `max_model_len`: no token covers more than `max_bytes_per_token` bytes."""
        limit = max_model_len * self.tokenizer.max_bytes_per_token * _NORMALIZER_SLACK
        if num_bytes > limit:
            raise bad_request(
                f"the prompt is too long: {num_bytes} bytes of text cannot fit in this "
                f"server's context limit of max_model_len={max_model_len} tokens", param)

    def encode_all(self, prompts: list[str] | list[list[int]],
                   max_model_len: int) -> list[list[int]]:
        """Completion prompts: text is encoded (with BOS); token ids pass through."""
        texts = [p for p in prompts if isinstance(p, str)]
        self.check_size(sum(len(t.encode()) for t in texts), max_model_len, "prompt")
        return [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    chat_template_kwargs: dict[str, Any] | None = None,
                    max_model_len: int | None = None,
                    tools: list[dict[str, Any]] | None = None) -> list[int]:
        """The conversation's prompt token ids through the model's chat template, with the
        tool definitions when given (a 400 if the template cannot show them)."""
        if max_model_len is not None:
            size = sum(len(str(m.get("content") or "").encode()) for m in messages)
            self.check_size(size, max_model_len, "messages")
        kwargs = dict(chat_template_kwargs or {})
        if tools:
            if not self.tokenizer.template_takes_tools:
                raise bad_request(
                    "this model's chat template does not take tools: configure one that "
                    "does (engine.chat_template, e.g. `smollm2-tools` for SmolLM2)", "tools")
            kwargs["tools"] = tools
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt,
                                                      **kwargs)
        except ValueError as exc:
            raise bad_request(str(exc), "messages") from exc
        except Exception as exc:  # a template that raises (jinja's raise_exception) on input
            raise bad_request(f"the chat template failed on these messages: {exc}",
                              "messages") from exc
        # Templates emit their own BOS: encoding with special tokens would double it.
        return self.tokenizer.encode(text, add_special_tokens=False)

    def tokenize(self, prompt: str | None, messages: list[dict[str, Any]] | None,
                 add_special_tokens: bool = True, add_generation_prompt: bool = True
                 ) -> list[int]:
        if messages is not None:
            return self.render_chat(messages, add_generation_prompt)
        return self.tokenizer.encode(prompt or "", add_special_tokens)

    def detokenize(self, tokens: list[int]) -> str:
        vocab = self.tokenizer.vocab_size
        if any(t >= vocab for t in tokens):
            raise bad_request(f"token ids must be in [0, {vocab})", "tokens")
        return self.tokenizer.decode(tokens)
