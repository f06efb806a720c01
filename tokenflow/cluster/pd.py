"""Prefill/decode disaggregation, orchestrated by the decode replica (as Ray Serve LLM 2.60 does):
the request reaches a decode `LLMServer`, which runs its prefill on a prefill replica (one
handle call), streams the first token as soon as that returns, then loads the prompt's KV from
the prefill replica and decodes the rest itself. One hop more than colocated serving, and no
extra process on the token path.

`PrefillClient` owns the decode side's handle to the prefill deployment. A prefill that fails
(the replica died, refused, or timed out) returns None: the decode replica then computes the
whole request itself, which gives the same tokens. After a failure the decode replica computes
the prefills of the next few seconds itself without asking, so that a dead prefill replica
does not hold every request until Serve has replaced it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tokenflow.cluster.messages import Finished, Rejected, SeqDelta
from tokenflow.scheduler import SamplingParams

logger = logging.getLogger(__name__)
PREFILL_TIMEOUT_S = 300.0
# After a prefill failed (its replica died: Serve then holds new calls until it has started
# another, for as long as that takes), the prefills of the next this-many seconds are computed
# here without asking, and the first to ask again gives up after PROBE_TIMEOUT_S.
FALLBACK_S = 10.0
PROBE_TIMEOUT_S = 5.0


@dataclass
class Prefilled:
    """What the prefill replica returned for one prompt: its first token, and where the
    prompt's KV is (None if it was not published; the decode side then recomputes)."""

    delta: SeqDelta
    kv_transfer_params: dict[str, Any] | None

    @property
    def finished(self) -> bool:
        """The request ended at its first token (EOS, a stop, or max_tokens=1)."""
        return self.delta.finish_reason is not None and self.kv_transfer_params is None


class PrefillClient:
    """Owns the decode replica's handle to the prefill deployment."""

    def __init__(self, handle: Any, clock: Callable[[], float] = time.monotonic) -> None:
        self._streaming = handle.options(stream=True)
        self._clock = clock
        # Prefills that failed or were refused, so this replica computed the whole request.
        self.num_fallbacks = 0
        self._failed_at: float | None = None  # the last failure, until a prefill succeeds

    @staticmethod
    def wants(prompts: list[list[int]], params: SamplingParams,
              kv_transfer_params: dict[str, Any] | None) -> bool:
        """Disaggregate this request? One prompt, one choice, more than one token, and no
        transfer the client drives itself (then the client's router orchestrates)."""
        return (len(prompts) == 1 and params.n == 1 and kv_transfer_params is None
                and (params.max_tokens is None or params.max_tokens > 1))

    async def prefill(self, prompt: list[int], params: SamplingParams, request_id: str,
                      priority: int) -> Prefilled | None:
        first_only = dataclasses.replace(params, max_tokens=1,
                                         min_tokens=min(params.min_tokens, 1))
        failed_at = self._failed_at
        if failed_at is not None and self._clock() - failed_at < FALLBACK_S:
            self.num_fallbacks += 1
            return None
        try:
            prefilled = await asyncio.wait_for(
                self._run(prompt, first_only, request_id, priority),
                PREFILL_TIMEOUT_S if failed_at is None else PROBE_TIMEOUT_S)
            self._failed_at = None
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the decode replica computes everything instead
            logger.warning("prefill of %s failed (%r); computing it here, and the prefills "
                           "of the next %.0f s", request_id, exc, FALLBACK_S)
            self._failed_at = self._clock()
            prefilled = None
        if prefilled is None:
            self.num_fallbacks += 1
        return prefilled

    async def _run(self, prompt: list[int], params: SamplingParams, request_id: str,
                   priority: int) -> Prefilled | None:
        stream = self._streaming.generate.remote(
            [prompt], params, f"{request_id}-prefill", priority, None,
            {"do_remote_decode": True})
        delta: SeqDelta | None = None
        try:
            async for event in stream:
                if isinstance(event, Rejected):
                    logger.warning("prefill of %s refused (%s); computing it here",
                                   request_id, event.message)
                    return None
                if isinstance(event, list):
                    delta = _fold(delta, event)
                elif isinstance(event, Finished):
                    if delta is None or delta.finish_reason == "error":
                        logger.warning("prefill of %s ended in an error (%s); computing it "
                                       "here", request_id, delta and delta.error)
                        return None
                    params_out = event.kv_transfer_params
                    if delta.finish_reason == "length":
                        delta.finish_reason = None  # max_tokens=1 is ours: decoding goes on
                    elif params_out is not None:
                        params_out = None  # it really stopped: nothing left to decode
                    return Prefilled(delta, params_out)
        finally:
            stream.cancel()
        return None


def _fold(delta: SeqDelta | None, deltas: list[SeqDelta]) -> SeqDelta:
    for d in deltas:
        if delta is None:
            delta = SeqDelta(0, d.text, list(d.token_ids), d.logprobs, d.finish_reason, d.error,
                             stop_reason=d.stop_reason)
            continue
        delta.text += d.text
        delta.token_ids += d.token_ids
        if d.logprobs:
            delta.logprobs = (delta.logprobs or []) + d.logprobs
        delta.finish_reason = d.finish_reason or delta.finish_reason
        delta.stop_reason = d.stop_reason if d.stop_reason is not None else delta.stop_reason
        delta.error = d.error or delta.error
    assert delta is not None
    return delta
