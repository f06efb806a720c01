"""A request continued from tokens it generated elsewhere: on another replica (the ingress's
stream resume), or in this replica's previous engine process (an engine restart). It arrives
with them as its first outputs, as a P/D decode request arrives with its prefill's token."""

from __future__ import annotations

from tokenflow.scheduler.sampling_params import SamplingParams


def continuable(params: SamplingParams) -> bool:
    """Whether a request can go on from its tokens alone, in an engine that has none of its
    state: one choice, no grammar state, no prompt logprobs (sent with the first delta)."""
    return params.n == 1 and params.structured_outputs is None and params.prompt_logprobs is None


def continuation_params(generated: list[int]) -> dict:
    """The `kv_transfer_params` that continue a request after the tokens it `generated` (and
    sent to its client): no KV to load, the new engine computes it."""
    return {"first_token_ids": list(generated), "first_token_sent": True}
