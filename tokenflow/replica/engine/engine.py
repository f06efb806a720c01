"""`Engine`: one replica's engine, text in and text deltas out. `step()` is the whole step:
schedule -> execute -> update -> detokenize. The step loop around it is `run_steps`
(`engine_loop`)."""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

from tokenflow.config import EngineConfig
from tokenflow.net import node_ip
from tokenflow.replica.engine.input_processor import InputProcessor, ProcessedRequest
from tokenflow.replica.engine.kv_event_publisher import KVEventPublisher
from tokenflow.replica.engine.lora_registry import LoRARegistry
from tokenflow.replica.engine.output_processor import OutputProcessor, RequestOutput
from tokenflow.replica.engine.structured_output import StructuredOutputManager
from tokenflow.replica.loading.resolve import load_tokenizer
from tokenflow.replica.worker.executor import Executor, StepResult, build_executor
from tokenflow.scheduler import (
    EngineCoreOutput,
    EngineCoreOutputs,
    ModelRunnerOutput,
    PauseState,
    RequestStatus,
    SamplingParams,
    SchedulerOutput,
    SchedulerStats,
    build_scheduler,
)

logger = logging.getLogger(__name__)


@dataclass
class EngineState:
    """The engine as of its latest step or command, for the layers above: counters summed
    since start, requests running and waiting now (and waiting for remote KV), the KV cache's
    free and total blocks, the pause state, whether a step could make progress, and how many
    commands the step loop has applied."""

    totals: SchedulerStats = field(default_factory=SchedulerStats)
    num_running: int = 0
    num_waiting: int = 0
    num_waiting_for_remote_kvs: int = 0
    num_free_blocks: int = 0
    num_blocks: int = 0
    pause_state: PauseState = PauseState.UNPAUSED
    has_work: bool = False
    applied: int = 0

    @property
    def kv_usage(self) -> float:
        """Fraction of KV blocks in use (0-1)."""
        return 1 - self.num_free_blocks / self.num_blocks if self.num_blocks else 0.0


class Engine:
    """Owns one replica's scheduler, executor, tokenizer, input and output processors, and
    the batches in flight.

    With P pipeline stages, up to P batches are in flight (a batch queue), so every stage has
    work: `step()` schedules and sends off a batch, returns at once while the queue has room
    and the scheduler found work, and otherwise waits for the oldest batch and applies its
    results. A request in an unfinished batch has nothing left to compute (its
    `num_computed_tokens` already counts the batch), so the scheduler skips it until its
    sampled token arrives. With one stage this is schedule -> execute -> update; with async
    scheduling (one stage, `AsyncScheduler`) two batches are in flight: step N+1 is scheduled
    while N runs, its requests' unsampled tokens counted as output placeholders, and N's
    results are applied while N+1 runs.

    `process_inputs` is pure (safe from any thread); everything else runs on the thread of
    the step loop.
    """

    def __init__(self, config: EngineConfig, executor: Executor | None = None) -> None:
        started = time.perf_counter()
        self.config = config
        self.model_name = config.model.name
        self.executor = executor or build_executor(config)
        self.max_model_len = self.executor.max_model_len
        self.vocab_size = self.executor.vocab_size
        tokenizer_name = config.model.tokenizer or config.model.model
        self.tokenizer = load_tokenizer(tokenizer_name)
        # Its compiler reads the tokenizer on first use, in a compile thread.
        self.structured_outputs = StructuredOutputManager(
            config.structured_outputs, lambda: load_tokenizer(tokenizer_name), self.vocab_size)
        events = config.kv_events
        self.scheduler = build_scheduler(
            config.scheduler, config.cache, self.executor.num_blocks, self.max_model_len,
            config.kv_transfer, config.parallel.pipeline_parallel_size, self.structured_outputs,
            kv_events_medium=self.executor.kv_medium if events.enabled else None,
            kv_offload=config.kv_offload,
            num_offload_blocks=getattr(self.executor, "num_offload_blocks", 0))
        if config.lora.enabled:
            self.scheduler.enable_lora(config.lora.max_loras)
        # Drained once a step (`_finish_step`); published from a thread of its own.
        self.kv_events = KVEventPublisher(events, node_ip()) if events.enabled else None
        self.loras = LoRARegistry(config.lora, config.model.model)
        self.input_processor = InputProcessor(self.tokenizer, self.max_model_len,
                                              self.vocab_size, config.structured_outputs,
                                              self.loras)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._max_in_flight = (config.parallel.pipeline_parallel_size
                               + config.scheduler.async_scheduling)
        self._in_flight: deque[tuple[SchedulerOutput, StepResult]] = deque()
        self._last_stats = SchedulerStats()  # gauges of the latest step
        self.totals = SchedulerStats()  # counters summed over every step since start
        self.num_worker_restarts = 0  # workers replaced after they died (`_fail`)
        # Weights, KV cache and tokenizer: what a server waits for before its first request.
        self.load_time_s = time.perf_counter() - started
        logger.info("loaded %s in %.1f s", self.model_name, self.load_time_s)

    # ------------------------------------------------------------------------ requests
    def process_inputs(self, request_id: str, prompt: str | list[int],
                       params: SamplingParams | None = None, priority: int = 0,
                       kv_transfer_params: dict | None = None) -> ProcessedRequest:
        """See `InputProcessor.process`."""
        return self.input_processor.process(request_id, prompt, params, priority,
                                            kv_transfer_params)

    def add_processed(self, processed: ProcessedRequest) -> None:
        first = processed.sequences[0]
        params = first.kv_transfer_params or {}
        self.output_processor.add_request(
            processed.request_id, [r.request_id for r in processed.sequences],
            processed.prompt, processed.prompt_token_ids, processed.params,
            initial_output_ids=first.output_token_ids,
            # The orchestrator that ran the prefill streamed its token already.
            emit_initial=not params.get("first_token_sent", False),
            continues_elsewhere=bool(params.get("do_remote_decode")))
        for request in processed.sequences:
            self.scheduler.add_request(request)

    def add_request(self, request_id: str, prompt: str | list[int],
                    params: SamplingParams | None = None, priority: int = 0) -> None:
        self.add_processed(self.process_inputs(request_id, prompt, params, priority))

    def abort_request(self, request_id: str) -> None:
        """End a request (all its sequences) and free its blocks."""
        self.scheduler.finish_requests(self.output_processor.abort(request_id),
                                       RequestStatus.FINISHED_ABORTED)

    # --------------------------------------------------------------------------- LoRA
    def add_lora(self, name: str, path: str) -> None:
        """Serve the PEFT adapter at `path` as `name` (replacing one of that name); raises
        ValueError if it does not fit the base model or `lora.max_lora_rank`."""
        self.loras.add(name, path)

    def remove_lora(self, name: str) -> bool:
        """Stop serving `name` (requests already in use of it finish); False if unknown."""
        removed = self.loras.remove(name)
        if removed and self.scheduler.lora is not None:
            self.scheduler.lora.forget(name)
        return removed

    def list_loras(self) -> list[str]:
        return self.loras.names()

    def has_unfinished_requests(self) -> bool:
        return (self.scheduler.has_unfinished_requests() or bool(self._in_flight)
                or self.output_processor.has_unfinished())

    def has_work(self) -> bool:
        """Whether `step()` can make progress now: unfinished requests, except those a pause
        holds back or that wait for a slot idle sessions hold (see `Scheduler.has_work`)."""
        return bool(self._in_flight) or self.scheduler.has_work()

    # ------------------------------------------------------------------------- pausing
    def pause(self, mode: PauseState = PauseState.PAUSED_NEW) -> None:
        """Admit nothing new (PAUSED_NEW) or schedule nothing (PAUSED_ALL) from the next step
        on; batches already in flight complete either way. The scheduler holds the state."""
        self.scheduler.pause(mode)

    def resume(self) -> None:
        self.scheduler.resume()

    # ---------------------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        """Schedule a batch and send it off; once the pipeline is full (or nothing more can
        be scheduled), apply the oldest batch's results and return its client deltas."""
        if len(self._in_flight) < self._max_in_flight:
            sched_out = self.scheduler.schedule()
            if self._worth_executing(sched_out):
                try:
                    self._in_flight.append((sched_out, self.executor.execute_model(sched_out)))
                except Exception as exc:  # the executor cannot take it (a stage died)
                    return self._fail(sched_out, exc)
                if (sched_out.total_num_scheduled_tokens
                        and len(self._in_flight) < self._max_in_flight):
                    return []  # fill the pipeline first
            elif not self._in_flight:
                empty = ModelRunnerOutput([], [])
                return self._finish_step(self.scheduler.update_from_output(sched_out, empty))
        sched_out, result = self._in_flight.popleft()
        try:
            runner_out = result.result()
        except Exception as exc:  # one failed batch must not kill the loop
            return self._fail(sched_out, exc)
        core_out = self.scheduler.update_from_output(sched_out, runner_out)
        if runner_out.draft_token_ids:  # verified in the request's next step
            self.scheduler.update_draft_token_ids(runner_out.draft_token_ids)
        return self._finish_step(core_out)

    def _worth_executing(self, sched_out: SchedulerOutput) -> bool:
        """Workers must hear of finished and preempted requests even when nothing runs, carry
        out connector orders (the offload tier's copies of evicted blocks), and report KV
        transfers (which end in the background) while any is under way."""
        return bool(sched_out.total_num_scheduled_tokens or sched_out.finished_req_ids
                    or sched_out.preempted_req_ids or sched_out.kv_connector_metadata
                    or self.scheduler.has_pending_transfers())

    def _finish_step(self, core_out: EngineCoreOutputs) -> list[RequestOutput]:
        """Record the step's stats and turn its token deltas into client deltas."""
        if core_out.scheduler_stats is not None:
            self._last_stats = core_out.scheduler_stats
            self.totals.add(core_out.scheduler_stats)
        if self.kv_events is not None:
            events = self.scheduler.take_kv_events()
            if events:
                self.kv_events.publish(events)
        outputs, to_finish = self.output_processor.process(core_out.outputs)
        if to_finish:  # stop strings: free those sequences now, not after max_tokens
            self.scheduler.finish_requests(to_finish, RequestStatus.FINISHED_STOPPED)
        return outputs

    def _fail(self, sched_out: SchedulerOutput, exc: Exception) -> list[RequestOutput]:
        if self._restart_on_new_workers(exc):
            return self._finish_step(EngineCoreOutputs([], self.scheduler.make_stats()))
        logger.error("step failed; finishing its %d requests with an error: %s",
                     len(sched_out.num_scheduled_tokens), exc, exc_info=exc)
        req_ids = list(sched_out.num_scheduled_tokens)
        self.scheduler.finish_requests(req_ids, RequestStatus.FINISHED_ERROR)
        message = f"{type(exc).__name__}: {exc}"
        outputs = [EngineCoreOutput(r, [], finish_reason="error", error=message) for r in req_ids]
        return self._finish_step(EngineCoreOutputs(outputs, self.scheduler.make_stats()))

    def _restart_on_new_workers(self, exc: Exception) -> bool:
        """A step failed: if the executor can replace its workers (a pipeline stage died and
        was rebuilt), every batch in flight is lost and every request starts over from the
        tokens it has. Not with a KV connector, whose transfers lived in the old workers."""
        if not self.scheduler.can_restart_all() or not self.executor.recover():
            return False
        logger.warning("the workers were replaced after %s; %d batches in flight are lost and "
                       "every request starts over from its tokens", exc, len(self._in_flight))
        self._in_flight.clear()
        self.scheduler.restart_all(f"{type(exc).__name__}: {exc}")
        self.num_worker_restarts += 1
        return True

    # --------------------------------------------------------------------------- state
    def state(self, applied: int = 0, has_work: bool = False) -> EngineState:
        """The engine now, as the layers above see it (`applied`, `has_work`: the step
        loop's)."""
        num_free, num_blocks = self.scheduler.kv_cache_blocks()
        running, waiting = self.scheduler.request_counts()
        remote_kv = (self._last_stats.num_waiting_for_remote_kvs
                     if self.has_unfinished_requests() else 0)
        return EngineState(self.totals, running, waiting, remote_kv, num_free, num_blocks,
                           self.scheduler.pause_state, has_work, applied)

    def has_request(self, request_id: str) -> bool:
        """Whether the scheduler holds the request (running, waiting or parked)."""
        return request_id in self.scheduler.requests

    def check_idle(self) -> None:
        """Raise AssertionError unless nothing is left: no request, every KV block free, and
        the cache's accounting intact (tests call it after a run)."""
        self.check_kv_integrity()
        num_free, num_blocks = self.scheduler.kv_cache_blocks()
        assert not self.scheduler.requests, "requests are left in the scheduler"
        assert num_free == num_blocks, f"{num_blocks - num_free} KV blocks are still held"

    def check_kv_integrity(self) -> None:
        """Raise if the KV cache's block accounting is broken (tests call it when idle)."""
        self.scheduler.check_kv_integrity()

    def check_health(self) -> None:
        """Raise if the executor can no longer run steps (a pipeline stage died)."""
        self.executor.check_health()

    def shutdown(self) -> None:
        self.structured_outputs.shutdown()
        self.executor.shutdown()
        if self.kv_events is not None:
            self.kv_events.shutdown()
