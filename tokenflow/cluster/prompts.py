"""The ingress side of text: tokenize prompts, render chat templates, (de)tokenize endpoints.

DESIGN §1: the ingress validates, tokenizes and builds SamplingParams; replicas receive token
ids. Detokenization of the output stays with the engine (it owns stop strings).
"""

from __future__ import annotations

from typing import Any

from tokenflow.cluster.errors import bad_request
from tokenflow.replica.model_source import resolve_model


class PromptRenderer:
    """Owns the ingress's tokenizer; every user mistake it finds is a 400 (`OpenAIError`)."""

    def __init__(self, tokenizer_path: str) -> None:
        self.tokenizer = resolve_model(tokenizer_path).tokenizer()

    def encode(self, prompt: str | list[int]) -> list[int]:
        """A completion prompt: text is encoded (with BOS); token ids pass through."""
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    chat_template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """The conversation's prompt token ids through the model's chat template."""
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt,
                                                      **(chat_template_kwargs or {}))
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
