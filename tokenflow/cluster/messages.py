"""The plain data an `LLMServer` streams to its callers through a Serve handle.

A generation stream is a sequence of events: first `Rejected` (bad input; nothing else follows)
or `Accepted`, then batches of `SeqDelta` (a `list`, one per yield: whatever the engine produced
since the previous yield), and last `Finished` with the usage totals. Validation results travel
as data, not exceptions: an exception raised in a replica reaches the caller wrapped in Ray's
error types, and a client's mistake must become a 400, not a 500.

Everything here is small and pickles cheaply; nothing imports torch, so the ingress stays light.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Union


class Resend(enum.Enum):
    """What sends a request again when its replica's process dies (the caller tells
    `LLMServer.generate`), and where it can go."""

    NEVER = "never"  # Serve's proxy: nothing sends it again
    ANYWHERE = "anywhere"  # the ingress (`cluster.resume`): it waits for a replica, a new one too
    TO_A_PEER = "to_a_peer"  # HAProxy: its retries do not wait, so only to a running replica


@dataclass(frozen=True)
class Rejected:
    """The request was refused: the input was invalid (too long, empty, ...: a 400), or the
    replica cannot serve (its engine died: a 503 the client may retry). The stream ends here."""

    message: str
    param: str | None = None
    status_code: int = 400
    retry_after_s: int | None = None


@dataclass(frozen=True)
class Accepted:
    """Every prompt passed validation and is queued in the engine."""

    request_id: str
    num_prompt_tokens: list[int]  # one entry per prompt


@dataclass
class TokenLogprob:
    """The sampled token at one position, detokenized, with its top alternatives."""

    token: str
    logprob: float
    top: list[tuple[str, float]] = field(default_factory=list)


@dataclass
class SeqDelta:
    """What one choice gained in one engine step.

    `index` is the OpenAI choice index: `prompt_index * n + sequence_index`. `finish_reason` is
    the engine's ('stop', 'length', 'abort', 'error'), set on the choice's last delta, with
    `stop_reason` saying which stop: a stop token id, a stop string, "repetition", or None.
    """

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    error: str | None = None
    # Set when the failure was the replica's, not the request's: retrying may succeed.
    retry_after_s: int | None = None
    stop_reason: int | str | None = None


@dataclass(frozen=True)
class Finished:
    """The last event of a stream: usage totals over every prompt and choice."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    # Where a producer published the prompt's KV (a request with do_remote_decode).
    kv_transfer_params: dict[str, Any] | None = None


StreamEvent = Union[Rejected, Accepted, list[SeqDelta], Finished]
