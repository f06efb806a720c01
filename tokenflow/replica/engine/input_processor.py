"""Client input to engine requests: tokenize, validate, resolve defaults. Pure, so the
process that serves HTTP can run it whichever process steps the engine."""

from __future__ import annotations

import dataclasses
import numbers
import time
from dataclasses import dataclass

from tokenflow.config import StructuredOutputsConfig
from tokenflow.replica.engine.lora_registry import LoRARegistry
from tokenflow.replica.engine.structured_output import grammar_of
from tokenflow.replica.loading.tokenizer import Tokenizer
from tokenflow.scheduler import Request, SamplingParams
from tokenflow.scheduler.lora import LoRAAdapter


@dataclass
class ProcessedRequest:
    """A validated client request: its engine-side sequences (n of them) and its prompt."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    sequences: list[Request]


class InputProcessor:
    """Owns what validating a request needs: the tokenizer, the engine's limits
    (`max_model_len`, `vocab_size`) and its LoRA adapters (`loras`: a request naming another
    is refused). Safe to call from any thread."""

    def __init__(self, tokenizer: Tokenizer, max_model_len: int, vocab_size: int,
                 structured_outputs: StructuredOutputsConfig,
                 loras: LoRARegistry | None = None) -> None:
        self.tokenizer = tokenizer
        self.loras = loras
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.structured_outputs = structured_outputs

    def process(self, request_id: str, prompt: str | list[int],
                       params: SamplingParams | None = None, priority: int = 0,
                       kv_transfer_params: dict | None = None) -> ProcessedRequest:
        """Tokenize and validate; raises ValueError with a message a client can read.

        The one place a prompt's length is checked against `max_model_len` and `max_tokens`
        is resolved (None: whatever room the context leaves)."""
        params = params or SamplingParams()
        if isinstance(prompt, str):
            text, token_ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, token_ids = None, list(prompt)
        self._validate(token_ids, params)
        lora = self._lora(params.lora)
        max_tokens = params.max_tokens or self.max_model_len - len(token_ids)
        eos = self.tokenizer.eos_token_id
        # A model may end turns with several tokens; all but the primary EOS act as stop ids.
        extra_stops = [] if params.ignore_eos else sorted(
            self.tokenizer.eos_token_ids - {eos} - set(params.stop_token_ids))
        params = dataclasses.replace(params, max_tokens=max_tokens,
                                     stop_token_ids=[*params.stop_token_ids, *extra_stops])
        return self._build(request_id, text, token_ids, params, priority, kv_transfer_params,
                           lora)

    def _lora(self, name: str | None) -> LoRAAdapter | None:
        if name is None:
            return None
        if self.loras is None:
            raise ValueError(f"unknown LoRA adapter {name!r}: this engine serves no adapters "
                             "(lora.max_loras is 0)")
        return self.loras.resolve(name)

    def with_kv_transfer(self, processed: ProcessedRequest,
                         kv_transfer_params: dict) -> ProcessedRequest:
        """`processed` (validated already) continued from another engine's prefill: the same
        prompt and parameters, with the producer's `kv_transfer_params` (and the token(s) it
        generated) instead of its own. Raises ValueError for bad `first_token_ids`."""
        return self._build(processed.request_id, processed.prompt, processed.prompt_token_ids,
                           processed.params, processed.sequences[0].priority,
                           kv_transfer_params, processed.sequences[0].lora)

    def _build(self, request_id: str, text: str | None, token_ids: list[int],
               params: SamplingParams, priority: int,
               kv_transfer_params: dict | None, lora: LoRAAdapter | None) -> ProcessedRequest:
        """The engine-side sequences (n of them) of a validated request."""
        eos = self.tokenizer.eos_token_id
        max_tokens = params.max_tokens
        assert max_tokens is not None, "resolved by process()"
        # A request continued from another engine (prefill/decode disaggregation) arrives with
        # the token(s) that engine already generated: they are its first outputs here too.
        first_ids = (kv_transfer_params or {}).get("first_token_ids") or []
        # Strictly integers (not floats, not bools): they reach block hashing inside the engine
        # loop, where a float raised and took the engine down.
        if not isinstance(first_ids, list | tuple) or not all(
                isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in first_ids):
            raise ValueError("kv_transfer_params.first_token_ids must be a list of token ids "
                             "(integers)")
        if first_ids and (params.n != 1 or max(first_ids) >= self.vocab_size
                          or min(first_ids) < 0 or len(first_ids) >= max_tokens):
            raise ValueError("kv_transfer_params.first_token_ids needs n=1, ids in the "
                             "vocabulary and room for more tokens")
        arrival = time.monotonic()
        sequences = []
        for i in range(params.n):
            child_params = params
            if params.n > 1 and params.seed is not None:
                child_params = dataclasses.replace(params, seed=params.seed + i)
            child_id = request_id if params.n == 1 else f"{request_id}#{i}"
            sequences.append(Request(child_id, token_ids, child_params, arrival_time=arrival,
                                     priority=priority, eos_token_id=eos,
                                     kv_transfer_params=kv_transfer_params,
                                     output_token_ids=list(first_ids), lora=lora))
        return ProcessedRequest(request_id, text, token_ids, params, sequences)

    def _validate(self, token_ids: list[int], params: SamplingParams) -> None:
        if not token_ids:
            raise ValueError("the prompt is empty")
        if min(token_ids) < 0 or max(token_ids) >= self.vocab_size:
            raise ValueError(f"prompt token ids must be in [0, {self.vocab_size})")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(token_ids)} tokens, but this server's context "
                             f"limit is max_model_len={self.max_model_len} tokens, and at least "
                             "one must be left to generate")
        if params.max_tokens is not None and len(token_ids) + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"max_tokens={params.max_tokens} plus the prompt's {len(token_ids)} tokens exceed "
                f"this server's context limit max_model_len={self.max_model_len}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > self.vocab_size:
                raise ValueError(f"{name} must be <= the vocabulary size {self.vocab_size}")
        if any(not 0 <= t < self.vocab_size for t in params.stop_token_ids):
            raise ValueError(f"stop_token_ids must be in [0, {self.vocab_size})")
        if params.structured_outputs is not None:
            # Parse the schema, regex or grammar now (cheap; compiling it against the
            # vocabulary is not, and happens off the engine thread): a bad one is the
            # client's 400, not a failed request later.
            grammar_of(params.structured_outputs, self.structured_outputs)
