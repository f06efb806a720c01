"""`LLMServer`: one Ray Serve replica = one `AsyncEngine`.

The replica's HTTP side tokenizes (docs/ARCHITECTURE.md); `LLMServer` receives token ids,
validates them against the model (length, vocabulary) and detokenizes the output through its engine. `generate` is an
async generator meant for a streaming handle (`handle.options(stream=True)`); their events are
described in `cluster.messages`. Cancelling a stream (a client that went away) cancels the
per-prompt tasks, which close their engine streams, which aborts the requests and frees their
KV blocks.

`pause`, `resume` and `pause_status` are the replica's side of the admin endpoints (`/pause`,
`/resume`, `/is_paused`): the ingress broadcasts them to every replica of the deployment.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from tokenflow.cluster.adapter_routing import HeldAdapters
from tokenflow.cluster.autoscaling import RecentTTFT, replica_stats
from tokenflow.cluster.messages import (
    Accepted,
    Finished,
    Rejected,
    Resend,
    SeqDelta,
    StreamEvent,
    TokenLogprob,
)
from tokenflow.cluster.metrics import RequestTiming, ServerMetrics
from tokenflow.cluster.pd import PrefillClient
from tokenflow.config import EngineConfig
from tokenflow.replica.engine.async_engine import AsyncEngine, EngineDeadError
from tokenflow.replica.engine.input_processor import ProcessedRequest
from tokenflow.replica.engine.output_processor import CompletionOutput, RequestOutput
from tokenflow.scheduler import PauseState, SamplingParams, TokenLogprobs

logger = logging.getLogger(__name__)
# Serve replaces a replica whose engine died (its check_health fails) within seconds.
ENGINE_DEAD_RETRY_S = 5
# A replica at its request bound frees a slot as soon as any request ends.
OVERLOADED_RETRY_S = 1
# A Serve replica whose engine cannot serve any more (a pipeline stage died; its engine process
# died again right after a restart) ends its process this long after it finds out: time for the
# error events of the requests it held to reach their clients. Answering 503s until Serve's
# health checks replace it would take seconds, and a replica that fails fast looks idle to the
# request router, which sends it more; a request that reaches a dead process instead goes to
# another replica (HAProxy's retry, the ingress's resend), as for any replica that died.
LEAVE_AFTER_S = 0.5



@dataclass
class _Tally:
    """One prompt's request as the stream sees it: token counts and which choices are done."""

    num_prompt_tokens: int
    n: int
    num_cached_tokens: int = 0
    tokens_per_seq: dict[int, int] = field(default_factory=dict)
    finished: set[int] = field(default_factory=set)
    num_pregenerated: int = 0  # tokens another replica generated (a disaggregated prefill)
    kv_transfer_params: dict[str, Any] | None = None

    @property
    def num_generated(self) -> int:
        return sum(self.tokens_per_seq.values()) + self.num_pregenerated

    def add(self, out: RequestOutput) -> None:
        self.kv_transfer_params = out.kv_transfer_params or self.kv_transfer_params
        self.num_cached_tokens = max(self.num_cached_tokens, out.num_cached_tokens)
        for c in out.outputs:
            self.tokens_per_seq[c.index] = self.tokens_per_seq.get(c.index, 0) + len(c.token_ids)
            if c.finish_reason is not None:
                self.finished.add(c.index)


class LLMServer:
    """Owns one AsyncEngine and its metrics; streams OpenAI-level requests through it and
    reports health and load (running, waiting, KV usage) for Serve's autoscaler and router."""

    def __init__(self, engine_config: dict[str, Any] | EngineConfig,
                 metrics_interval_s: float = 0.5, stream_interval_s: float = 0.0,
                 prefill: Any = None, max_queued_requests: int | None = None) -> None:
        """`prefill`: a handle to a prefill deployment; with it, this replica decodes and runs
        each request's prefill there (`cluster.pd`). `max_queued_requests`: the backpressure
        bound (`DeploymentConfig`): beyond max_num_seqs + this many requests, refuse."""
        config = EngineConfig.model_validate(engine_config)
        self._max_requests = (None if max_queued_requests is None
                              else config.scheduler.max_num_seqs + max_queued_requests)
        self._num_requests = 0  # requests this replica holds now (accepted, not yet ended)
        self._dynamic_lora_path = config.lora.dynamic_lora_path
        # The adapters this replica keeps warm, advertised to the request routers.
        self._held_adapters = HeldAdapters(config.lora.max_cpu_loras or config.lora.max_loras)
        self._prefill = PrefillClient(prefill) if prefill is not None else None
        # After the first token, a stream sends at most one batch of deltas per interval:
        # every item costs a Ray message and an HTTP chunk, which on a small machine take the
        # CPU the engine needs. 0 sends each step's tokens as soon as they exist.
        self._stream_interval_s = stream_interval_s
        self.engine = AsyncEngine(config)
        self.metrics = ServerMetrics(self.engine.model_name)
        self._recent_ttft = RecentTTFT()  # for the autoscaling policy's SLO signal
        # Serve builds replicas on their event loop; outside one (a plain unit test) there is
        # simply no poller.
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        self._poller = loop.create_task(self._poll_stats(metrics_interval_s)) if loop else None
        self._leaving = False
        self._peer_running: asyncio.Future[bool] | None = None
        self._num_reports = 0  # record_routing_stats calls: a report's identity for routers

    # ------------------------------------------------------------------------ generation
    async def generate(self, prompts: list[list[int]], params: SamplingParams,
                       request_id: str, priority: int = 0, received_time: float | None = None,
                       kv_transfer_params: dict[str, Any] | None = None,
                       resend: Resend = Resend.NEVER) -> AsyncIterator[StreamEvent]:
        """Stream one request: a batch of tokenized prompts, n choices each. The first event
        is `Accepted`, or `Rejected` when the engine refuses the input (too long, ...).
        `kv_transfer_params` (as vLLM's API takes them) publish the prompt's KV for another
        engine, or load it from one. `resend`: whether the caller sends the request again, or
        continues it, on another replica when this replica's process dies; when this replica
        can serve no more and ends its process, such a request waits for that instead of
        failing with a 503."""
        try:
            self.engine.check_health()
        except EngineDeadError as exc:
            if self._leave(exc):
                await asyncio.Event().wait()  # the process ends under this request
            yield _engine_dead(exc)
            return
        try:
            processed = [self.engine.process_inputs(p, params, f"{request_id}-{i}", priority,
                                                     kv_transfer_params)
                         for i, p in enumerate(prompts)]
        except ValueError as exc:
            yield Rejected(str(exc))
            return
        if self._max_requests is not None and self._num_requests >= self._max_requests:
            yield Rejected(f"this replica is at its limit of {self._max_requests} requests "
                           "(running and queued); retry later", None, 503, OVERLOADED_RETRY_S)
            return
        await self._held_adapters.note(params.lora)
        disaggregated = self._prefill is not None and PrefillClient.wants(
            prompts, params, kv_transfer_params)
        if disaggregated:
            events = self._disaggregated(prompts[0], params, processed[0], request_id,
                                         priority, received_time)
        elif len(processed) == 1:
            events = self._stream_one(request_id, processed[0], received_time)
        else:
            events = self._stream(request_id, processed, received_time)
        self._num_requests += 1
        try:
            if disaggregated:  # a paused decode replica sends no new prefills
                await self.engine.wait_unpaused()
            async for event in events:
                if resend is not Resend.NEVER and _replica_failure(event):
                    await self._outlive_unless_serving(resend)
                yield event
        finally:
            await events.aclose()  # at once: closing it aborts the engine requests
            self._num_requests -= 1

    async def _disaggregated(self, prompt: list[int], params: SamplingParams,
                             processed: ProcessedRequest, request_id: str, priority: int,
                             received_time: float | None) -> AsyncIterator[StreamEvent]:
        """Prefill on a prefill replica, stream its first token at once, then load the prompt's
        KV from it and decode here (or compute everything here, if the prefill failed)."""
        assert self._prefill is not None
        prefilled = await self._prefill.prefill(prompt, params, request_id, priority)
        if prefilled is not None and prefilled.finished:
            yield Accepted(request_id, [len(prompt)])
            yield [prefilled.delta]
            yield Finished(len(prompt), len(prefilled.delta.token_ids), 0)
            return
        leading = None
        if prefilled is not None:
            leading = prefilled.delta
            processed = self.engine.with_kv_transfer(processed, {
                **(prefilled.kv_transfer_params or {}), "first_token_sent": True,
                "first_token_ids": leading.token_ids})
        events = self._stream_one(request_id, processed, received_time, leading)
        try:
            async for event in events:
                yield event
        finally:
            await events.aclose()

    async def _stream_one(self, request_id: str, processed: ProcessedRequest,
                          received_time: float | None, leading: SeqDelta | None = None
                          ) -> AsyncIterator[StreamEvent]:
        """Stream one prompt: the engine's batches go straight out, without a task and a queue
        per request in between (each a wake-up per step per stream, which on a busy replica
        takes the engine's CPU). With a stream interval, deltas are held back until it has
        passed since the last send (the first and the last go at once). `leading`: a delta
        generated elsewhere (a prefill replica's first token), sent first."""
        try:
            # Before Accepted: the engine starts while the caller starts its response.
            batches = self.engine.submit(processed)
        except EngineDeadError as exc:
            yield _engine_dead(exc)
            return
        tally = _Tally(len(processed.prompt_token_ids), processed.params.n)
        held: list[SeqDelta] = []
        next_send = 0.0
        try:
            yield Accepted(request_id, [len(processed.prompt_token_ids)])
            if leading is not None:
                yield [leading]
                tally.num_pregenerated = len(leading.token_ids)
            async for outs in batches:
                for out in outs:
                    held.extend(self._take(out, tally, 0, received_time))
                now = time.monotonic()
                if held and (outs[-1].finished or now >= next_send):
                    yield held
                    held, next_send = [], now + self._stream_interval_s
        except Exception as exc:  # the engine died under us: end every open choice with it
            yield [*held, *_failed(processed, tally, 0, exc)]
        finally:
            await batches.aclose()  # a client that left: abort the request now
        yield _finished([tally])

    async def _stream(self, request_id: str, processed: list[ProcessedRequest],
                      received_time: float | None) -> AsyncIterator[StreamEvent]:
        """Stream several prompts: run each prompt's engine stream as a task and merge their
        deltas, yielding each time whatever arrived since the previous yield (one Ray item per
        batch, not per token)."""
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
            yield _finished(tallies)
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
                queue.put_nowait(self._take(out, tally, base_index, received_time))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the engine died under us: end every open choice with it
            queue.put_nowait(_failed(processed, tally, base_index, exc))
        finally:
            queue.put_nowait(None)

    def _take(self, out: RequestOutput, tally: _Tally, base_index: int,
              received_time: float | None) -> list[SeqDelta]:
        """Count one engine delta (its first token's time, its tokens, the finished request's
        metrics) and turn it into the stream's deltas; every stream path goes through here."""
        if not tally.tokens_per_seq:
            self._first_token(out, received_time)
        tally.add(out)
        if out.finished:
            self._record(out, tally, received_time)
        # A step that failed because the executor broke (a pipeline stage died): the client
        # gets a 503 to retry, as for a dead engine, not a 500.
        retry = ENGINE_DEAD_RETRY_S if out.error is not None and not self._can_serve() else None
        return [self._delta(base_index, c, out.error, retry) for c in out.outputs]

    def _can_serve(self) -> bool:
        try:
            self.engine.check_health()
        except EngineDeadError:
            return False
        return True

    @staticmethod
    def _delta(base_index: int, c: CompletionOutput, error: str | None,
               retry_after_s: int | None = None) -> SeqDelta:
        logprobs = None if c.logprobs is None else [_logprob(lp) for lp in c.logprobs]
        failed = c.finish_reason == "error"
        return SeqDelta(base_index + c.index, c.text, list(c.token_ids), logprobs,
                        c.finish_reason, error if failed else None,
                        retry_after_s if failed else None, stop_reason=c.stop_reason)

    def _first_token(self, out: RequestOutput, received_time: float | None) -> None:
        m = out.metrics
        if m is not None and m.first_token_time is not None:
            self._recent_ttft.observe(m.first_token_time - (received_time or m.arrival_time))

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
                "load_time_s": self.engine.load_time_s,
                "dynamic_lora_path": self._dynamic_lora_path}

    # -------------------------------------------------------------------------------- LoRA
    async def lora_adapters(self) -> list[str]:
        """The LoRA adapters this replica serves (`model` may name each)."""
        return self.engine.list_loras()

    async def load_lora(self, name: str, path: str) -> dict[str, Any]:
        """Serve the PEFT adapter in `path` as `name`: {"replica", "error"}, the error None
        when it was added (an answer, not an exception: the ingress gathers every replica's)."""
        error = None
        if name in self.engine.list_loras():
            error = f"The lora adapter '{name}' has already been loaded."
        else:
            try:
                await asyncio.to_thread(self.engine.add_lora, name, path)
            except (ValueError, OSError) as exc:
                error = str(exc)
        return {"replica": _replica_id(), "error": error}

    async def unload_lora(self, name: str) -> dict[str, Any]:
        """Stop serving `name` (requests under way finish): {"replica", "removed"}."""
        return {"replica": _replica_id(), "removed": self.engine.remove_lora(name)}

    # ----------------------------------------------------------------------------- pausing
    async def pause(self, mode: PauseState = PauseState.PAUSED_NEW) -> dict[str, Any]:
        """Pause this replica's engine (see `PauseState`); returns `pause_status()`. With a
        prefill deployment, new requests do not go to it either until `resume`: their prefill
        would be admitted there, and its KV would wait for a decode engine that admits nothing.
        The prefill replicas get nothing new from a paused decode replica and need no pause."""
        await self.engine.pause(mode)
        return self.pause_status()

    async def resume(self) -> dict[str, Any]:
        """Schedule normally again; requests that arrived meanwhile are admitted."""
        await self.engine.resume()
        return self.pause_status()

    def pause_status(self) -> dict[str, Any]:
        """This replica's pause state, whether it is idle (nothing it may run is left: drained,
        when paused with PAUSED_NEW), its running and waiting requests, and its process."""
        state = self.engine.state
        return {"replica": _replica_id(), "state": state.pause_state.value,
                "idle": self.engine.is_idle(), "running": state.num_running,
                "waiting": state.num_waiting, "pid": os.getpid()}

    # ------------------------------------------------------------------- health and load
    def check_health(self) -> None:
        """Serve calls this periodically; raising makes it replace the replica."""
        try:
            self.engine.check_health()
        except EngineDeadError as exc:
            self._leave(exc)
            raise

    async def _outlive_unless_serving(self, resend: Resend) -> None:
        """Return if the engine can serve, or if the request would have nowhere to go; else,
        in Serve, wait for this process to end (`_leave`), so that the request's caller
        sends it elsewhere."""
        try:
            self.engine.check_health()
        except EngineDeadError as exc:
            if not self._leave(exc):  # the process's end is on its way from here
                return
            if resend is Resend.TO_A_PEER and not await self._peer_is_running():
                return
            await asyncio.Event().wait()

    async def _peer_is_running(self) -> bool:
        """Whether another replica of this deployment runs (asked of Serve's controller once:
        this replica is leaving)."""
        if self._peer_running is None:
            self._peer_running = asyncio.ensure_future(asyncio.to_thread(_peer_running))
        return await asyncio.shield(self._peer_running)

    def _leave(self, exc: EngineDeadError) -> bool:
        """End this Serve replica's process `LEAVE_AFTER_S` from now (once); False outside
        Serve (a test's LLMServer), which answers 503s instead."""
        if _replica_id() is None:
            return False
        if not self._leaving:
            self._leaving = True
            logger.error("this replica cannot serve (%s): ending its process in %.1f s so "
                         "that its requests go to another replica", exc, LEAVE_AFTER_S)
            # A timer thread: Serve may call check_health off the event loop.
            threading.Timer(LEAVE_AFTER_S, os._exit, args=(1,)).start()
        return True

    def stats(self) -> dict[str, Any]:
        """Queue length and KV usage now, the KV-transfer totals since start, and the engine
        process's pid (None when the engine runs in this process) and restarts."""
        state = self.engine.state
        totals = state.totals
        return {"replica": _replica_id(), "engine_pid": self.engine.engine_pid,
                "engine_restarts": self.engine.num_restarts, "running": state.num_running, "waiting": state.num_waiting,
                "requests": self._num_requests, "kv_usage": state.kv_usage,
                "num_free_blocks": state.num_free_blocks, "num_blocks": state.num_blocks,
                "waiting_for_remote_kv": state.num_waiting_for_remote_kvs,
                "kv_transfer_bytes": totals.kv_transfer_bytes,
                "kv_transfer_failures": totals.kv_transfer_failures,
                "prefill_fallbacks": self._prefill.num_fallbacks if self._prefill else 0}

    def kv_events_endpoints(self) -> dict[str, str | None]:
        """Where this replica's KV-cache events are published, reachable from other nodes
        (`engine.kv_events`): {"endpoint", "replay_endpoint"}, None where off."""
        endpoint, replay = self.engine.kv_events_endpoints
        return {"endpoint": endpoint, "replay_endpoint": replay}

    def node_ip(self) -> str:
        """The IP of the node this replica runs on (where its KV transfers come from)."""
        import ray

        return ray.util.get_node_ip_address()

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's hook for autoscaling policies (`cluster.autoscaling`): requests running and
        waiting in the engine, KV-cache usage, and the recent TTFT."""
        state = self.engine.state
        return replica_stats(state.num_running, state.num_waiting, state.kv_usage,
                             self._recent_ttft)

    def record_routing_stats(self) -> dict[str, Any]:
        """Serve's hook for request routers: the same load figures as `stats`, where the
        replica publishes its KV-cache events (the kv_aware router subscribes there), and a
        number that tells one report from the next (a router adds what it sent since)."""
        self._num_reports += 1
        return {**self.stats(), "kv_events": self.kv_events_endpoints(),
                "report": self._num_reports}

    async def _poll_stats(self, interval_s: float) -> None:
        while True:
            try:
                self.metrics.observe_engine(self.engine.state)
            except Exception:  # metrics must never take the replica down
                logger.exception("updating scheduler metrics failed")
            await asyncio.sleep(interval_s)

    def __del__(self) -> None:
        # Serve calls __del__ when it stops a replica: stop the engine thread cleanly.
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
        if getattr(self, "_poller", None) is not None:
            self._poller.cancel()


def _replica_failure(event: StreamEvent) -> bool:
    """Whether `event` fails its request for the replica's sake (its engine cannot serve: a
    503, or error deltas with a retry hint), not the request's."""
    if isinstance(event, Rejected):
        return event.status_code == 503 and event.retry_after_s == ENGINE_DEAD_RETRY_S
    return isinstance(event, list) and any(
        d.finish_reason == "error" and d.retry_after_s is not None for d in event)


def _engine_dead(exc: EngineDeadError) -> Rejected:
    return Rejected(f"this replica cannot serve: {exc}; retry", None, 503, ENGINE_DEAD_RETRY_S)


def _failed(processed: ProcessedRequest, tally: _Tally, base_index: int,
            exc: Exception) -> list[SeqDelta]:
    """The engine failed under a stream: an error delta for each of its open choices (with a
    retry hint when the engine died, which Serve replaces within seconds)."""
    logger.warning("request %s failed: %r", processed.request_id, exc)
    retry = ENGINE_DEAD_RETRY_S if isinstance(exc, EngineDeadError) else None
    return [SeqDelta(base_index + j, "", [], None, "error", str(exc), retry)
            for j in range(tally.n) if j not in tally.finished]


def _finished(tallies: list[_Tally]) -> Finished:
    """The stream's last event: token counts over every prompt (and a single prompt's KV
    transfer params)."""
    return Finished(sum(t.num_prompt_tokens for t in tallies),
                    sum(t.num_generated for t in tallies),
                    sum(t.num_cached_tokens for t in tallies),
                    tallies[0].kv_transfer_params if len(tallies) == 1 else None)


def _peer_running() -> bool:
    """Whether Serve's controller counts another RUNNING replica of this one's deployment."""
    from ray import serve

    try:
        context = serve.get_replica_context()
        status = serve.status().applications[context.app_name]
        states = status.deployments[context.deployment].replica_states
    except Exception:  # not in Serve, or the controller did not answer: assume none
        logger.warning("could not tell whether another replica runs", exc_info=True)
        return False
    return states.get("RUNNING", 0) >= 2  # this one still counts as running


def _replica_id() -> str | None:
    """This Serve replica's id, for status reports; None outside Serve (a test, in process)."""
    try:
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # not running in a Serve replica
        return None


def _logprob(lp: TokenLogprobs) -> TokenLogprob:
    """The engine's decoded logprobs at one position, in the stream's shape."""
    assert lp.decoded is not None, "the output processor spells out logprob tokens"
    return TokenLogprob(lp.decoded[0], lp.logprobs[0],
                        list(zip(lp.decoded[1:], lp.logprobs[1:], strict=True)))
