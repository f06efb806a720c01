"""A request's life inside one engine: its tokens, its progress, its status."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from tokenflow.scheduler.lora import LoRAAdapter
from tokenflow.scheduler.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    """Status of a request. Everything after PREEMPTED is finished (see `is_finished`).

    How a request moves (the scheduler owns every transition):

    - WAITING -> RUNNING when admitted (prefix hits, budget, `max_num_active_seqs` and the
      pause state allow); RUNNING -> PREEMPTED when the pool runs out of blocks (its KV is
      freed; it goes back to the head of the queue and is readmitted as RUNNING).
    - WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR: on arrival, while its grammar compiles off the
      engine thread; then WAITING (a failed compile finishes it with FINISHED_ERROR).
    - WAITING_FOR_REMOTE_KVS: admitted with its blocks allocated while a KV connector loads its
      prompt from another engine; then WAITING again, and admitted with those tokens computed.
    - WAITING_FOR_STREAMING_REQ: a session's finished turn, parked with its KV blocks and its
      slot (`sessions.Sessions`) until the next turn takes them over, the session closes, it
      expires, or a live request needs the blocks.
    - A WAITING_FOR_* request is skipped by admission and keeps its place in the queue.
    - RUNNING -> FINISHED_STOPPED (EOS, stop token or string), FINISHED_LENGTH_CAPPED
      (`max_tokens`, `max_model_len`), FINISHED_REPETITION (the output repeats a pattern,
      `SamplingParams.repetition_detection`; "stop" in the API), FINISHED_ABORTED (client gone),
      FINISHED_ERROR; FINISHED_IGNORED is a prompt that leaves no room to generate.
    """

    WAITING = enum.auto()
    WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR = enum.auto()
    WAITING_FOR_REMOTE_KVS = enum.auto()
    WAITING_FOR_STREAMING_REQ = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_IGNORED = enum.auto()
    FINISHED_ERROR = enum.auto()
    FINISHED_REPETITION = enum.auto()

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def finish_reason(status: RequestStatus) -> str | None:
        """The OpenAI finish reason of a finished status (None while unfinished)."""
        return _FINISH_REASONS.get(status)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_IGNORED: "length",
    RequestStatus.FINISHED_ERROR: "error",
    RequestStatus.FINISHED_REPETITION: "stop",
}

WAITING_FOR_SOMETHING = (
    RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR,
    RequestStatus.WAITING_FOR_REMOTE_KVS,
    RequestStatus.WAITING_FOR_STREAMING_REQ,
)


@dataclass(eq=False, slots=True)
class Request:
    """One sequence being generated: owns its token ids, progress counters and status.

    Invariants: `num_computed_tokens <= num_tokens_with_spec`; `all_token_ids` is always
    `prompt_token_ids + output_token_ids`; `block_hashes` (filled by the KV cache manager)
    covers only full blocks of `all_token_ids`.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0
    eos_token_id: int | None = None
    kv_transfer_params: dict[str, Any] | None = None
    # Its LoRA adapter (resolved from `sampling_params.lora` by the engine); None: base model.
    lora: LoRAAdapter | None = None

    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    spec_token_ids: list[int] = field(default_factory=list)
    num_output_placeholders: int = 0
    num_preemptions: int = 0
    # Accepted draft tokens the workers have not been sent yet: they lie before
    # num_computed_tokens, where the next step's token delta would otherwise start.
    num_unsent_tokens: int = 0
    # Prefix-cache hit of the first admission, reported to the client; -1 until admitted.
    num_cached_tokens: int = -1
    stop_reason: int | str | None = None
    error: str | None = None
    block_hashes: list[int] = field(default_factory=list)
    # Its structured-output grammar (the `GrammarBackend`'s per-request state); None: free text.
    grammar: Any = None
    all_token_ids: list[int] = field(init=False)
    num_prompt_tokens: int = field(init=False)
    # Set by the scheduler at admission, so the per-token stop pre-check is two comparisons:
    # from this many outputs on, every token gets the full stop check (the length limit, or
    # earlier for repetition detection; see stop.first_full_check).
    full_check_from: int = field(init=False, default=0)
    stop_token_set: frozenset[int] = field(init=False, default=frozenset())

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError("prompt_token_ids must not be empty")
        self.prompt_token_ids = list(self.prompt_token_ids)
        self.all_token_ids = self.prompt_token_ids + list(self.output_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)

    @property
    def lora_name(self) -> str | None:
        """The adapter's name: part of every block hash (KV differs per adapter)."""
        return None if self.lora is None else self.lora.name

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return len(self.all_token_ids) + len(self.spec_token_ids)

    def trim_output(self, num_tokens: int) -> None:
        """Keep only the first `num_tokens` outputs (tokens sampled after a stop)."""
        drop = len(self.output_token_ids) - num_tokens
        if drop > 0:
            del self.output_token_ids[num_tokens:]
            del self.all_token_ids[len(self.all_token_ids) - drop:]
