"""A stream that survives its replica: when the `LLMServer` replica serving a request dies
mid-stream, the ingress sends the request again, to another replica, with the tokens already
sent as outputs it arrives with (as a P/D decode request arrives with its prefill's first token:
`kv_transfer_params.first_token_ids`, marked sent). The new replica computes the KV of prompt
and outputs, its detokenizer and stop strings pick up where the old one was, `max_tokens` and
`min_tokens` count the outputs already there, and it streams only what comes next. The client
sees one stream: the resumed request's `Accepted` is swallowed, its deltas follow the ones
already sent, and the final usage counts the prompt and every generated token.

What resumes, and how exactly (the README says it for users):
- One prompt and one choice (`n == 1`), without structured output (its grammar state is not
  carried over), prompt logprobs or KV-transfer parameters of its own (a P/D leg). Anything
  else fails as before: a 503 with `Retry-After` (for a stream, an error event).
- Greedy sampling continues token-exactly: the tokens and text of an uninterrupted run.
- Sampling with a seed or without: it continues, but does not reproduce the uninterrupted run
  (the resumed request's generator starts afresh at the seam).
A request whose replica dies before it was accepted (nothing has reached the client) starts over
on another replica, whatever it is. A resumed request that loses its replica too is resumed
again, up to `MAX_RESUMES` times in all, each waiting for Serve to route it to a live replica
until `RESUME_DEADLINE_S`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from tokenflow.cluster.messages import Accepted, Finished, Rejected, StreamEvent
from tokenflow.scheduler.continuation import continuable, continuation_params
from tokenflow.scheduler.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

MAX_RESUMES = 3
RESUME_DEADLINE_S = 60.0
_RETRY_S = 0.5

# (prompts, params, request_id, kv_transfer_params) -> the replica's event stream
OpenStream = Callable[[list[list[int]], SamplingParams, str, dict[str, Any] | None], Any]


def resumable(prompts: list[list[int]], params: SamplingParams) -> bool:
    """Whether a request can go on on another replica (see the module docstring)."""
    return len(prompts) == 1 and continuable(params)


class ResumingStream:
    """Owns one request's stream across replicas: the tokens sent so far and the replica
    stream they come from now. `gone` is the exception types that mean "the replica died"."""

    def __init__(self, open_stream: OpenStream, prompts: list[list[int]],
                 params: SamplingParams, request_id: str, gone: tuple[type[BaseException], ...],
                 on_gone: Callable[[BaseException], BaseException], enabled: bool = True
                 ) -> None:
        self._open, self._gone, self._on_gone = open_stream, gone, on_gone
        self._prompt, self._params, self._request_id = prompts, params, request_id
        self._resumable = enabled and resumable(prompts, params)
        self._stream = open_stream(prompts, params, request_id, None)
        self._sent: list[int] = []  # token ids of choice 0 the caller has been given
        self._accepted = self._done = False
        self._continued = False  # a resume has continued it (after Accepted)
        self._resumes = 0
        self._num_prompt_tokens = len(prompts[0]) if prompts else 0

    def __aiter__(self) -> AsyncIterator[StreamEvent]:
        return self

    async def __anext__(self) -> StreamEvent:
        while True:
            try:
                event = await self._stream.__anext__()
            except self._gone as exc:
                if self._accepted and self._done:  # it died between the last token and usage
                    return Finished(self._num_prompt_tokens, len(self._sent), 0, None)
                if not self._can_resume():
                    raise self._on_gone(exc) from exc
                await self._resume(exc)
                continue
            if isinstance(event, Accepted) and self._accepted:
                continue  # the caller has its Accepted already
            return self._note(event)

    def cancel(self) -> None:
        self._stream.cancel()

    def _note(self, event: StreamEvent) -> StreamEvent:
        if isinstance(event, Accepted):
            self._accepted = True
        elif isinstance(event, list) and self._resumable:
            for delta in event:
                self._sent.extend(delta.token_ids)
                self._done = self._done or delta.finish_reason is not None
        elif isinstance(event, Finished) and self._continued:
            # Usage as if nothing happened: the original prompt, every generated token.
            return Finished(self._num_prompt_tokens, len(self._sent),
                            min(event.cached_tokens, self._num_prompt_tokens),
                            event.kv_transfer_params)
        elif isinstance(event, Rejected) and self._continued:
            # The continuation was refused (its replica's engine died, ...): the request fails
            # as it would have without the resume.
            raise self._on_gone(RuntimeError(event.message))
        return event

    def _can_resume(self) -> bool:
        if self._resumes >= MAX_RESUMES:
            return False
        # Nothing reached the caller: any request may start over elsewhere.
        return not self._accepted or (self._resumable and not self._done)

    def _continuation(self) -> dict[str, Any]:
        """The resumed request's `kv_transfer_params`: the outputs it arrives with, already
        streamed (no KV to load: the new replica computes it)."""
        return continuation_params(self._sent)

    async def _resume(self, cause: BaseException) -> None:
        """Open the continuation on a live replica: Serve's router drops a dead replica once
        a call to it fails, so retry until one accepts or the deadline passes."""
        self._resumes += 1
        # Before Accepted the request starts over (with its own KV-transfer parameters, if
        # any); after, it continues from what was sent.
        self._continued = self._accepted
        continuation = self._continuation() if self._accepted else None
        logger.warning("request %s lost its replica (%s) after %d tokens; %s (%d/%d)",
                       self._request_id, type(cause).__name__, len(self._sent),
                       "resuming" if self._accepted else "sending it again", self._resumes,
                       MAX_RESUMES)
        deadline = time.monotonic() + RESUME_DEADLINE_S
        while True:
            stream = self._open(self._prompt, self._params, f"{self._request_id}-r{self._resumes}",
                                continuation)
            try:
                first = await stream.__anext__()
            except self._gone as exc:
                stream.cancel()
                if time.monotonic() > deadline:
                    raise self._on_gone(exc) from exc
                await asyncio.sleep(_RETRY_S)
                continue
            if isinstance(first, Rejected) and self._continued:
                raise self._on_gone(RuntimeError(first.message))
            self._stream = _Prepend(first, stream)
            return


class _Prepend:
    """A stream with one event already read put back in front."""

    def __init__(self, first: StreamEvent, rest: Any) -> None:
        self._first: StreamEvent | None = first
        self._rest = rest

    async def __anext__(self) -> StreamEvent:
        if self._first is not None:
            first, self._first = self._first, None
            return first
        return await self._rest.__anext__()

    def cancel(self) -> None:
        self._rest.cancel()
