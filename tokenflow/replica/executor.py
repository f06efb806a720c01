"""Executors run a step on the workers: in-process (one Worker) or over Ray actors."""

from __future__ import annotations

from tokenflow.config import EngineConfig, resolve_max_model_len
from tokenflow.replica.worker import Worker
from tokenflow.scheduler import ModelRunnerOutput, SchedulerOutput


class InProcExecutor:
    """Owns one Worker holding every layer, in this process."""

    def __init__(self, config: EngineConfig) -> None:
        if config.parallel.pipeline_parallel_size != 1:
            raise ValueError("InProcExecutor runs one stage; use the Ray executor for pp > 1")
        self.worker = Worker(config)
        self.num_blocks = self.worker.num_blocks_available()
        self.max_model_len = resolve_max_model_len(
            config, self.worker.arch.max_position_embeddings, self.num_blocks)
        self.vocab_size = self.worker.arch.vocab_size
        self.worker.init_cache(self.num_blocks, self.max_model_len)

    def execute_model(self, sched_out: SchedulerOutput) -> ModelRunnerOutput:
        out = self.worker.execute_model(sched_out)
        assert isinstance(out, ModelRunnerOutput)
        return out

    def shutdown(self) -> None:
        self.worker.runner = None


def build_executor(config: EngineConfig) -> InProcExecutor:
    kind = config.parallel.executor
    if kind == "ray" or (kind == "auto" and config.parallel.pipeline_parallel_size > 1):
        raise NotImplementedError("the Ray pipeline executor is not built yet")
    return InProcExecutor(config)
