"""EngineCore: the step loop of one replica. schedule -> execute -> update, with up to one
batch in flight per pipeline stage."""

from __future__ import annotations

import logging
from collections import deque

from tokenflow.config import EngineConfig
from tokenflow.replica.engine.structured_output import StructuredOutputManager
from tokenflow.replica.loading.resolve import resolve_model
from tokenflow.replica.worker.executor import Executor, StepResult, build_executor
from tokenflow.scheduler import (
    EngineCoreOutput,
    EngineCoreOutputs,
    ModelRunnerOutput,
    PauseState,
    Request,
    RequestStatus,
    SchedulerOutput,
    build_scheduler,
)

logger = logging.getLogger(__name__)


class EngineCore:
    """Owns the scheduler, the executor and the batches in flight.

    With P pipeline stages, up to P batches are in flight (a batch queue), so every stage has
    work: `step()` schedules and sends off a batch, returns at once while the queue has room
    and the scheduler found work, and otherwise waits for the oldest batch and applies its
    results. A request in an unfinished batch has nothing left to compute (its
    `num_computed_tokens` already counts the batch), so the scheduler skips it until its
    sampled token arrives. With one stage this is schedule -> execute -> update; with async
    scheduling (one stage, `AsyncScheduler`) two batches are in flight: step N+1 is scheduled
    while N runs, its requests' unsampled tokens counted as output placeholders, and N's
    results are applied while N+1 runs.

    It is the one place the layers above ask about the model's limits (`max_model_len`,
    `vocab_size`) and the KV cache, so none of them reaches into the scheduler or executor.
    """

    def __init__(self, config: EngineConfig, executor: Executor | None = None) -> None:
        self.config = config
        self.executor = executor or build_executor(config)
        self.max_model_len = self.executor.max_model_len
        self.vocab_size = self.executor.vocab_size
        model = config.model
        # Its compiler reads the tokenizer on first use, in a compile thread.
        self.structured_outputs = StructuredOutputManager(
            config.structured_outputs,
            lambda: resolve_model(model.tokenizer or model.model).tokenizer(), self.vocab_size)
        self.scheduler = build_scheduler(
            config.scheduler, config.cache, self.executor.num_blocks, self.max_model_len,
            config.kv_transfer, config.parallel.pipeline_parallel_size, self.structured_outputs)
        self._max_in_flight = (config.parallel.pipeline_parallel_size
                               + config.scheduler.async_scheduling)
        self._in_flight: deque[tuple[SchedulerOutput, StepResult]] = deque()

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> None:
        """Finish requests the layers above decided to end (a stop string was seen)."""
        self.scheduler.finish_requests(request_ids, status)

    def kv_cache_blocks(self) -> tuple[int, int]:
        """(free blocks, total blocks) of the KV cache now."""
        return self.scheduler.kv_cache_blocks()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._in_flight)

    def has_work(self) -> bool:
        """Whether `step()` can make progress now (what a pause holds back does not count)."""
        return bool(self._in_flight) or self.scheduler.has_work()

    def request_counts(self) -> tuple[int, int]:
        """(running, waiting) requests now."""
        return self.scheduler.request_counts()

    # --------------------------------------------------------------------------- pausing
    def pause(self, mode: PauseState = PauseState.PAUSED_NEW) -> None:
        """Admit nothing new (PAUSED_NEW) or schedule nothing (PAUSED_ALL) from the next step
        on; batches already in flight complete either way."""
        self.scheduler.pause(mode)

    def resume(self) -> None:
        self.scheduler.resume()

    def is_paused(self) -> bool:
        return self.scheduler.pause_state is not PauseState.UNPAUSED

    @property
    def pause_state(self) -> PauseState:
        return self.scheduler.pause_state

    def check_health(self) -> None:
        """Raise if the executor can no longer run steps (a pipeline stage died)."""
        self.executor.check_health()

    def step(self) -> EngineCoreOutputs:
        if len(self._in_flight) < self._max_in_flight:
            sched_out = self.scheduler.schedule()
            # Workers must hear of finished and preempted requests even when nothing runs, and
            # report KV transfers (which end in the background) while any is under way.
            if (sched_out.total_num_scheduled_tokens or sched_out.finished_req_ids
                    or sched_out.preempted_req_ids or self.scheduler.has_pending_transfers()):
                try:
                    self._in_flight.append((sched_out, self.executor.execute_model(sched_out)))
                except Exception as exc:  # the executor cannot take it (a stage died)
                    return self._fail(sched_out, exc)
                if (sched_out.total_num_scheduled_tokens
                        and len(self._in_flight) < self._max_in_flight):
                    return EngineCoreOutputs()  # fill the pipeline first
            elif not self._in_flight:
                return self.scheduler.update_from_output(sched_out, ModelRunnerOutput([], []))
        sched_out, result = self._in_flight.popleft()
        try:
            runner_out = result.result()
        except Exception as exc:  # one failed batch must not kill the loop
            return self._fail(sched_out, exc)
        outputs = self.scheduler.update_from_output(sched_out, runner_out)
        if runner_out.draft_token_ids:  # verified in the request's next step
            self.scheduler.update_draft_token_ids(runner_out.draft_token_ids)
        return outputs

    def _fail(self, sched_out: SchedulerOutput, exc: Exception) -> EngineCoreOutputs:
        logger.error("step failed; finishing its %d requests with an error: %s",
                     len(sched_out.num_scheduled_tokens), exc, exc_info=exc)
        req_ids = list(sched_out.num_scheduled_tokens)
        self.scheduler.finish_requests(req_ids, RequestStatus.FINISHED_ERROR)
        message = f"{type(exc).__name__}: {exc}"
        outputs = [EngineCoreOutput(r, [], finish_reason="error", error=message) for r in req_ids]
        return EngineCoreOutputs(outputs, self.scheduler.make_stats())

    def shutdown(self) -> None:
        self.structured_outputs.shutdown()
        self.executor.shutdown()
