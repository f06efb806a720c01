"""`LLMServer`: one Ray Serve replica = one `AsyncEngine`.

The ingress tokenizes (DESIGN §1); the replica receives token ids, validates them against the
model (length, vocabulary) and detokenizes the output through its engine. `generate` is an
async generator meant for a streaming handle (`handle.options(stream=True)`); their events are
described in `cluster.messages`. Cancelling a stream (a client that went away) cancels the
per-prompt tasks, which close their engine streams, which aborts the requests and frees their
KV blocks.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from tokenflow.cluster.messages import (
    Accepted,
    Finished,
    Rejected,
    SeqDelta,
    StreamEvent,
    TokenLogprob,
)
from tokenflow.cluster.metrics import RequestTiming, SchedulerSnapshot, ServerMetrics
from tokenflow.config import EngineConfig
from tokenflow.replica.async_engine import AsyncEngine, EngineDeadError
from tokenflow.replica.llm_engine import ProcessedRequest
from tokenflow.replica.output_processor import CompletionOutput, RequestOutput
from tokenflow.scheduler import SamplingParams, TokenLogprobs

logger = logging.getLogger(__name__)
# Serve replaces a replica whose engine died (its check_health fails) within seconds.
ENGINE_DEAD_RETRY_S = 5



@dataclass
class _Tally:
    """One prompt's request as the stream sees it: token counts and which choices are done."""

    num_prompt_tokens: int
    n: int
    num_cached_tokens: int = 0
    tokens_per_seq: dict[int, int] = field(default_factory=dict)
    finished: set[int] = field(default_factory=set)

    @property
    def num_generated(self) -> int:
        return sum(self.tokens_per_seq.values())

    def add(self, out: RequestOutput) -> None:
        self.num_cached_tokens = max(self.num_cached_tokens, out.num_cached_tokens)
        for c in out.outputs:
            self.tokens_per_seq[c.index] = self.tokens_per_seq.get(c.index, 0) + len(c.token_ids)
            if c.finish_reason is not None:
                self.finished.add(c.index)


class LLMServer:
    """Owns one AsyncEngine and its metrics; streams OpenAI-level requests through it and
    reports health and load (running, waiting, KV usage) for Serve's autoscaler and router."""

    def __init__(self, engine_config: dict[str, Any] | EngineConfig,
                 metrics_interval_s: float = 0.5, stream_interval_s: float = 0.0) -> None:
        config = EngineConfig.model_validate(engine_config)
        # After the first token, a stream sends at most one batch of deltas per interval:
        # every item costs a Ray message and an HTTP chunk, which on a small machine take the
        # CPU the engine needs. 0 sends each step's tokens as soon as they exist.
        self._stream_interval_s = stream_interval_s
        self.engine = AsyncEngine(config)
        self.metrics = ServerMetrics(self.engine.model_name)
        # Serve builds replicas on their event loop; outside one (a plain unit test) there is
        # simply no poller.
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        self._poller = loop.create_task(self._poll_stats(metrics_interval_s)) if loop else None

    # ------------------------------------------------------------------------ generation
    async def generate(self, prompts: list[list[int]], params: SamplingParams,
                       request_id: str, priority: int = 0, received_time: float | None = None
                       ) -> AsyncIterator[StreamEvent]:
        """Stream one request: a batch of tokenized prompts, n choices each. The first event
        is `Accepted`, or `Rejected` when the engine refuses the input (too long, ...)."""
        try:
            self.engine.check_health()
        except EngineDeadError as exc:
            yield Rejected(f"this replica cannot serve: {exc}; retry", None, 503,
                           ENGINE_DEAD_RETRY_S)
            return
        try:
            processed = [self.engine.process_inputs(p, params, f"{request_id}-{i}", priority)
                         for i, p in enumerate(prompts)]
        except ValueError as exc:
            yield Rejected(str(exc))
            return
        async for event in self._stream(request_id, processed, received_time):
            yield event

    async def _stream(self, request_id: str, processed: list[ProcessedRequest],
                      received_time: float | None) -> AsyncIterator[StreamEvent]:
        """Run every prompt's engine stream as a task and merge their deltas, yielding each
        time whatever arrived since the previous yield (one Ray item per batch, not per token)."""
        yield Accepted(request_id, [len(p.prompt_token_ids) for p in processed])
        queue: asyncio.Queue[list[SeqDelta] | None] = asyncio.Queue()
        n = processed[0].params.n
        tallies = [_Tally(len(p.prompt_token_ids), n) for p in processed]
        tasks = [asyncio.create_task(self._pump(p, i * n, tally, queue, received_time))
                 for i, (p, tally) in enumerate(zip(processed, tallies, strict=True))]
        try:
            pending = len(tasks)
            next_send = 0.0
            while pending:
                batch = [await queue.get()]
                wait = next_send - time.monotonic()
                if wait > 0 and pending > sum(item is None for item in batch):
                    await asyncio.sleep(wait)  # coalesce: more deltas arrive meanwhile
                while not queue.empty():
                    batch.append(queue.get_nowait())
                deltas = [d for item in batch if item is not None for d in item]
                pending -= sum(item is None for item in batch)
                if deltas:
                    yield deltas
                    next_send = time.monotonic() + self._stream_interval_s
            yield Finished(sum(t.num_prompt_tokens for t in tallies),
                           sum(t.num_generated for t in tallies),
                           sum(t.num_cached_tokens for t in tallies))
        finally:
            # Normal end: the tasks are done. Cancelled (the caller went away): each task's
            # engine stream closes, which aborts its request and frees its blocks.
            for task in tasks:
                task.cancel()

    async def _pump(self, processed: ProcessedRequest, base_index: int, tally: _Tally,
                    queue: asyncio.Queue[list[SeqDelta] | None],
                    received_time: float | None) -> None:
        """Move one engine stream's deltas onto the merged queue; None marks its end."""
        try:
            async for out in self.engine.generate(processed):
                tally.add(out)
                queue.put_nowait([self._delta(base_index, c, out.error) for c in out.outputs])
                if out.finished:
                    self._record(out, tally, received_time)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the engine died under us: end every open choice with it
            logger.warning("request %s failed: %r", processed.request_id, exc)
            retry = ENGINE_DEAD_RETRY_S if isinstance(exc, EngineDeadError) else None
            queue.put_nowait([SeqDelta(base_index + j, "", [], None, "error", str(exc), retry)
                              for j in range(tally.n) if j not in tally.finished])
        finally:
            queue.put_nowait(None)

    @staticmethod
    def _delta(base_index: int, c: CompletionOutput, error: str | None) -> SeqDelta:
        logprobs = None if c.logprobs is None else [_logprob(lp) for lp in c.logprobs]
        return SeqDelta(base_index + c.index, c.text, list(c.token_ids), logprobs,
                        c.finish_reason, error if c.finish_reason == "error" else None)

    def _record(self, out: RequestOutput, tally: _Tally, received_time: float | None) -> None:
        m = out.metrics
        if m is None:
            return
        self.metrics.observe_request(RequestTiming(
            received_time, m.arrival_time, m.first_token_time, m.last_token_time,
            m.finished_time, tally.num_prompt_tokens, tally.num_generated,
            max(tally.tokens_per_seq.values(), default=0)))

    # ------------------------------------------------------------------------- model
    def model_info(self) -> dict[str, Any]:
        return {"id": self.engine.model_name, "max_model_len": self.engine.max_model_len,
                "load_time_s": self.engine.load_time_s}

    # ------------------------------------------------------------------- health and load
    def check_health(self) -> None:
        """Serve calls this periodically; raising makes it replace the replica."""
        self.engine.check_health()

    def stats(self) -> dict[str, Any]:
        """Queue length and KV usage now."""
        stats = self.engine.stats
        num_free, num_blocks = self.engine.kv_cache
        return {"running": stats.num_running_reqs, "waiting": stats.num_waiting_reqs,
                "kv_usage": 1 - num_free / num_blocks, "num_free_blocks": num_free,
                "num_blocks": num_blocks}

    def record_routing_stats(self) -> dict[str, Any]:
        """Serve's hook for request routers: the same load figures as `stats`."""
        return self.stats()

    async def _poll_stats(self, interval_s: float) -> None:
        while True:
            try:
                self.metrics.observe_scheduler(self._snapshot())
            except Exception:  # metrics must never take the replica down
                logger.exception("updating scheduler metrics failed")
            await asyncio.sleep(interval_s)

    def _snapshot(self) -> SchedulerSnapshot:
        stats, totals = self.engine.stats, self.engine.totals
        num_free, num_blocks = self.engine.kv_cache
        return SchedulerSnapshot(stats.num_running_reqs, stats.num_waiting_reqs,
                                 1 - num_free / num_blocks, totals.prefix_cache_queries,
                                 totals.prefix_cache_hits, totals.num_preemptions)

    def __del__(self) -> None:
        # Serve calls __del__ when it stops a replica: stop the engine thread cleanly.
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
        if getattr(self, "_poller", None) is not None:
            self._poller.cancel()


def _logprob(lp: TokenLogprobs) -> TokenLogprob:
    """The engine's decoded logprobs at one position, in the stream's shape."""
    assert lp.decoded is not None, "the output processor spells out logprob tokens"
    return TokenLogprob(lp.decoded[0], lp.logprobs[0],
                        list(zip(lp.decoded[1:], lp.logprobs[1:], strict=True)))
