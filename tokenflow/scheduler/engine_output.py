"""What the scheduler hands its engine after a step: per-request deltas and step stats."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tokenflow.scheduler.runner_output import TokenLogprobs


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
    # Drafts accepted at each position (position 0: the first draft token of a step).
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    num_waiting_for_remote_kvs: int = 0
    kv_transfer_bytes: int = 0
    kv_transfer_seconds: float = 0.0
    kv_transfer_failures: int = 0
    # The offload tier: prompt tokens loaded from it instead of computed, blocks stored in
    # it, loads that failed a checksum or found a block missing (recomputed).
    kv_offload_hit_tokens: int = 0
    kv_offload_stored_blocks: int = 0
    kv_offload_failures: int = 0
    # LoRA: adapters loaded into a worker slot and evicted from one; per adapter name, the
    # requests that finished with it and the tokens they generated.
    lora_loads: int = 0
    lora_evictions: int = 0
    lora_requests: dict[str, int] = field(default_factory=dict)
    lora_generated_tokens: dict[str, int] = field(default_factory=dict)

    def add(self, step: SchedulerStats) -> None:
        """Add a step's counters to these (totals since start); gauges are not summed."""
        for name in _COUNTERS:
            setattr(self, name, getattr(self, name) + getattr(step, name))
        per_position = self.num_accepted_tokens_per_pos
        for pos, count in enumerate(step.num_accepted_tokens_per_pos):
            if pos == len(per_position):
                per_position.append(0)
            per_position[pos] += count
        for mine, theirs in ((self.lora_requests, step.lora_requests),
                             (self.lora_generated_tokens, step.lora_generated_tokens)):
            for name, count in theirs.items():
                mine[name] = mine.get(name, 0) + count


# The counters of `SchedulerStats` (increments per step; the other fields are gauges).
_COUNTERS = ("prefix_cache_queries", "prefix_cache_hits", "num_preemptions", "num_drafts",
             "num_draft_tokens", "num_accepted_tokens", "kv_transfer_bytes",
             "kv_transfer_seconds", "kv_transfer_failures", "kv_offload_hit_tokens",
             "kv_offload_stored_blocks", "kv_offload_failures", "lora_loads",
             "lora_evictions")


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
    """Every request's delta of one step, with that step's stats."""

    outputs: list[EngineCoreOutput] = field(default_factory=list)
    scheduler_stats: SchedulerStats | None = None
