"""EngineCore: the step loop of one replica. schedule -> execute -> update."""

from __future__ import annotations

import logging

from tokenflow.config import EngineConfig
from tokenflow.replica.executor import InProcExecutor, build_executor
from tokenflow.scheduler import (
    EngineCoreOutput,
    EngineCoreOutputs,
    ModelRunnerOutput,
    Request,
    RequestStatus,
    SchedulerOutput,
    build_scheduler,
)

logger = logging.getLogger(__name__)


class EngineCore:
    """Owns the scheduler and the executor; one `step()` is one batch through the model.

    It is the one place the layers above ask about the model's limits (`max_model_len`,
    `vocab_size`) and the KV cache, so none of them reaches into the scheduler or executor.
    """

    def __init__(self, config: EngineConfig, executor: InProcExecutor | None = None) -> None:
        self.config = config
        self.executor = executor or build_executor(config)
        self.max_model_len = self.executor.max_model_len
        self.vocab_size = self.executor.vocab_size
        self.scheduler = build_scheduler(config.scheduler, config.cache,
                                         self.executor.num_blocks, self.max_model_len)

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
        return self.scheduler.has_unfinished_requests()

    def step(self) -> EngineCoreOutputs:
        sched_out = self.scheduler.schedule()
        try:
            runner_out = self._execute(sched_out)
        except Exception as exc:  # one failed batch must not kill the loop
            logger.exception("step failed; finishing its %d requests with an error",
                             len(sched_out.num_scheduled_tokens))
            return self._fail(sched_out, exc)
        return self.scheduler.update_from_output(sched_out, runner_out)

    def _execute(self, sched_out: SchedulerOutput) -> ModelRunnerOutput:
        # Workers must hear of finished and preempted requests even when nothing runs.
        if (sched_out.total_num_scheduled_tokens == 0 and not sched_out.finished_req_ids
                and not sched_out.preempted_req_ids):
            return ModelRunnerOutput([], [])
        return self.executor.execute_model(sched_out)

    def _fail(self, sched_out: SchedulerOutput, exc: Exception) -> EngineCoreOutputs:
        req_ids = list(sched_out.num_scheduled_tokens)
        self.scheduler.finish_requests(req_ids, RequestStatus.FINISHED_ERROR)
        message = f"{type(exc).__name__}: {exc}"
        outputs = [EngineCoreOutput(r, [], finish_reason="error", error=message) for r in req_ids]
        return EngineCoreOutputs(outputs, self.scheduler.make_stats())

    def shutdown(self) -> None:
        self.executor.shutdown()
