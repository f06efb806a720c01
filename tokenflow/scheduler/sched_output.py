"""What the scheduler sends the workers each step: which requests run and what changed.

Everything here pickles small: workers in other processes receive a SchedulerOutput every step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tokenflow.scheduler.lora import LoRAAdapter
from tokenflow.scheduler.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the workers have never seen: sent in full once."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    eos_token_id: int | None = None
    # Outputs it arrives with (a request continued elsewhere: prefill/decode disaggregation).
    output_token_ids: list[int] = field(default_factory=list)
    lora: LoRAAdapter | None = None


@dataclass
class CachedRequestData:
    """Deltas for requests the workers already hold: owns five parallel columns, one entry a
    request (columns pickle smaller than one object per request).

    `new_token_ids[i]` are the known output tokens from position
    `min(max(num_computed_tokens[i], num_prompt_tokens), tokens the worker knows)` to the end
    (one token for a plain decode step; after accepted drafts, those too), so a worker always
    knows whether this step's chunk reaches the last token and must sample;
    `new_block_ids[i]` are blocks appended to the request's table, or its whole table when
    `resumed_from_preemption[i]`.
    """

    req_ids: list[str] = field(default_factory=list)
    resumed_from_preemption: list[bool] = field(default_factory=list)
    new_token_ids: list[list[int]] = field(default_factory=list)
    new_block_ids: list[list[int]] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)

    def append(self, req_id: str, resumed: bool, new_token_ids: list[int],
               new_block_ids: list[int], num_computed_tokens: int) -> None:
        self.req_ids.append(req_id)
        self.resumed_from_preemption.append(resumed)
        self.new_token_ids.append(new_token_ids)
        self.new_block_ids.append(new_block_ids)
        self.num_computed_tokens.append(num_computed_tokens)

    def column_appenders(self) -> tuple[Callable[[Any], None], ...]:
        """The five columns' `append`s, in `append`'s argument order: the scheduler's hot
        loop calls them directly, since one Python call per running request a step costs
        ~5% of the step."""
        return (self.req_ids.append, self.resumed_from_preemption.append,
                self.new_token_ids.append, self.new_block_ids.append,
                self.num_computed_tokens.append)

    def remove(self, req_id: str) -> None:
        i = self.req_ids.index(req_id)
        for column in (self.req_ids, self.resumed_from_preemption, self.new_token_ids,
                       self.new_block_ids, self.num_computed_tokens):
            del column[i]

    def __len__(self) -> int:
        return len(self.req_ids)


@dataclass
class GrammarBitmask:
    """The tokens the structured-output requests that sample this step may take: `bitmask`
    (numpy int32, [rows, ceil(vocab / 32)]) has bit t % 32 of word t // 32 set where token t
    is allowed. A request's rows are consecutive from `first_row[req_id]`: one for its next
    token, then one after each draft it verifies."""

    first_row: dict[str, int]
    bitmask: Any


@dataclass
class SchedulerOutput:
    """What one step runs: which requests, how many tokens each, and what changed."""

    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    scheduled_spec_decode_tokens: dict[str, list[int]]
    preempted_req_ids: set[str]
    finished_req_ids: set[str]
    kv_connector_metadata: Any = None
    grammar_bitmask: GrammarBitmask | None = None
    # LoRA adapters the workers load into their slots before this step: {slot: adapter}.
    lora_loads: dict[int, LoRAAdapter] | None = None
