"""Plain data that crosses the scheduler's edges: to the workers, back from them, to clients.

Everything here pickles small: workers in other processes receive a SchedulerOutput every step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tokenflow.scheduler.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the workers have never seen: sent in full once."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int


@dataclass
class CachedRequestData:
    """Deltas for requests the workers already hold, as parallel lists (one entry a request).

    `new_token_ids[i]` are all known output tokens from position
    `max(num_computed_tokens[i], num_prompt_tokens)` to the end (one token for a decode step),
    so a worker always knows whether this step's chunk reaches the last token and must sample;
    `new_block_ids[i]` are blocks appended to the request's table, or its whole table when
    `resumed_from_preemption[i]`.
    """

    req_ids: list[str] = field(default_factory=list)
    resumed_from_preemption: list[bool] = field(default_factory=list)
    new_token_ids: list[list[int]] = field(default_factory=list)
    new_block_ids: list[list[int]] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)


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


@dataclass
class TokenLogprobs:
    """Logprobs at one position: the chosen token first, then the top-N in rank order."""

    token_ids: list[int]
    logprobs: list[float]
    sampled_rank: int


@dataclass
class ModelRunnerOutput:
    """What a step produced, per scheduled request (empty list for a partial prefill chunk)."""

    req_ids: list[str]
    sampled_token_ids: list[list[int]]
    logprobs: dict[str, list[TokenLogprobs]] | None = None
    prompt_logprobs: dict[str, list[TokenLogprobs | None]] | None = None
    finished_sending: set[str] | None = None
    finished_recving: set[str] | None = None


@dataclass
class SchedulerStats:
    """One step's view of the scheduler: gauges, and counters as increments since last step."""

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


@dataclass(slots=True)
class EngineCoreOutput:
    """A delta for one request: the tokens it gained this step and, at the end, why it ended."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    kv_transfer_params: dict[str, Any] | None = None
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class EngineCoreOutputs:
    """Every delta for one client in one step, with that step's stats."""

    outputs: list[EngineCoreOutput] = field(default_factory=list)
    scheduler_stats: SchedulerStats | None = None
    finished_requests: set[str] = field(default_factory=set)
