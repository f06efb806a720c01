"""What the workers send back to the scheduler after a step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class TokenLogprobs:
    """Logprobs at one position: the chosen token first, then the top-N in rank order.
    `decoded` (each token's text) is filled in by the engine's output processor."""

    token_ids: list[int]
    logprobs: list[float]
    sampled_rank: int
    decoded: list[str] | None = None


@dataclass
class ModelRunnerOutput:
    """What a step produced, per scheduled request (empty list for a partial prefill chunk)."""

    req_ids: list[str]
    sampled_token_ids: list[list[int]]
    logprobs: dict[str, list[TokenLogprobs]] | None = None
    prompt_logprobs: dict[str, list[TokenLogprobs | None]] | None = None
    # One `KVConnectorOutput` per pipeline stage, when a KV connector is configured.
    kv_connector_outputs: list[Any] | None = None
    # Draft tokens proposed for each decoding request's next step (speculative decoding).
    draft_token_ids: dict[str, list[int]] | None = None
