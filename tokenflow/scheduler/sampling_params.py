"""Engine-side sampling parameters: a plain dataclass, validated once when built."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

_CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object")
MAX_SESSION_ID_LEN = 256
MAX_LORA_NAME_LEN = 256


@dataclass
class StructuredOutputsParams:
    """One constraint on a request's output (vLLM's `StructuredOutputsParams`): exactly one of
    a JSON schema (`json`, a dict or its JSON text), a regular expression, a list of choices,
    an EBNF grammar (xgrammar's dialect, GBNF-like), or any JSON object (`json_object`).

    Checked for shape here; whether a schema or grammar compiles is checked by the engine
    (a ValueError the API turns into a 400)."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        given = [name for name in _CONSTRAINTS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError("structured outputs take exactly one of "
                             f"{', '.join(_CONSTRAINTS)}; got {', '.join(given) or 'none'}")
        if isinstance(self.json, dict):
            self.json = json.dumps(self.json)  # one picklable, cacheable form
        if self.choice is not None:
            if not self.choice or not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError("choice must be a non-empty list of non-empty strings")
            self.choice = list(self.choice)

    @property
    def kind(self) -> str:
        """Which constraint this is: one of json, regex, choice, grammar, json_object."""
        return next(name for name in _CONSTRAINTS if getattr(self, name) not in (None, False))


@dataclass(kw_only=True)
class RepetitionDetectionParams:
    """Stop a request whose output ends in a loop (vLLM's `RepetitionDetectionParams`): some
    pattern of `min_pattern_size` to `max_pattern_size` tokens repeated `min_count` times in a
    row at the end of the output. The request then finishes with `FINISHED_REPETITION`.

    Only output tokens count, never the prompt. Keyword-only, so that the fields keep vLLM's
    order although only `min_pattern_size` has a default."""

    max_pattern_size: int
    min_pattern_size: int = 1
    min_count: int

    def __post_init__(self) -> None:
        checks = [
            (self.min_pattern_size >= 1,
             f"repetition_detection.min_pattern_size must be >= 1, got {self.min_pattern_size}"),
            (self.max_pattern_size >= 1,
             f"repetition_detection.max_pattern_size must be >= 1, got {self.max_pattern_size}"),
            (self.min_pattern_size <= self.max_pattern_size,
             f"repetition_detection.min_pattern_size ({self.min_pattern_size}) must be <= "
             f"max_pattern_size ({self.max_pattern_size})"),
            # One occurrence of a pattern is no repetition.
            (self.min_count >= 2,
             f"repetition_detection.min_count must be >= 2, got {self.min_count}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)


@dataclass
class SamplingParams:
    """How one request samples and when it stops. `top_k <= 0` and `top_p == 1` mean off."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    repetition_detection: RepetitionDetectionParams | None = None
    # A streaming-input session (scheduler/sessions.py): after this turn the request keeps its
    # KV for the next request with the same id; `session_close` ends the session with it.
    session_id: str | None = None
    session_close: bool = False
    # The LoRA adapter to generate with, by its registered name; None: the base model.
    lora: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self._validate()

    def _validate(self) -> None:
        checks = [
            (self.n >= 1, f"n must be >= 1, got {self.n}"),
            (self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}"),
            (self.max_tokens is None or self.max_tokens >= 1,
             f"max_tokens must be >= 1, got {self.max_tokens}"),
            (self.min_tokens >= 0, f"min_tokens must be >= 0, got {self.min_tokens}"),
            (self.max_tokens is None or self.min_tokens <= self.max_tokens,
             "min_tokens must be <= max_tokens"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty must be in [-2, 2]"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty must be in [-2, 2]"),
            (self.repetition_penalty > 0, "repetition_penalty must be > 0"),
            (self.logprobs is None or self.logprobs >= 0, "logprobs must be >= 0"),
            (self.prompt_logprobs is None or self.prompt_logprobs >= 0,
             "prompt_logprobs must be >= 0"),
            (self.session_id is None or 0 < len(self.session_id) <= MAX_SESSION_ID_LEN,
             f"session_id must be 1 to {MAX_SESSION_ID_LEN} characters"),
            (self.session_id is None or self.n == 1, "a session continues one sequence: n=1"),
            (self.session_id is not None or not self.session_close,
             "session_close needs a session_id"),
            (self.lora is None or (isinstance(self.lora, str)
                                   and 0 < len(self.lora) <= MAX_LORA_NAME_LEN),
             f"lora must be an adapter name of 1 to {MAX_LORA_NAME_LEN} characters"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5
