"""Executors run a step on the workers: in-process (one Worker) or over Ray actors (one per
pipeline stage, `ray_executor.RayExecutor`). The engine depends on the `Executor` protocol."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

import torch

from tokenflow.config import EngineConfig, resolve_max_model_len
from tokenflow.replica.worker.worker import Worker
from tokenflow.scheduler import ModelRunnerOutput, SchedulerOutput


class StepResult(Protocol):
    """A step in flight; `result()` waits for its sampled tokens or raises its failure."""

    def result(self, timeout: float | None = None) -> ModelRunnerOutput: ...


class Executor(Protocol):
    """Runs steps on the model. `num_blocks` is the KV block count every stage holds (the
    smallest any stage can), `max_model_len` the engine's one context limit derived from it.
    `execute_model` returns at once, so the engine can keep several batches in flight."""

    num_blocks: int
    max_model_len: int
    vocab_size: int
    # Where the KV cache lives, as KV-cache events name the tier ("GPU" or "CPU").
    kv_medium: str
    # Blocks the offload tier of every stage holds (0: no tier).
    num_offload_blocks: int

    def execute_model(self, sched_out: SchedulerOutput) -> StepResult: ...

    def check_health(self) -> None:
        """Raise if a step can no longer run (a stage died and cannot be rebuilt)."""

    def recover(self) -> bool:
        """After a failed step: replace what failed, if it can. True: steps run again, and
        every request and all KV the workers held are gone (the engine starts its requests
        over); False: it cannot (the failure stands)."""

    def shutdown(self) -> None: ...


class InProcExecutor:
    """Owns one Worker holding every layer, in this process. Its steps are done on return,
    or, with async scheduling, run one at a time in order on a thread of their own, so the
    engine thread schedules the next step while this one computes (torch ops release the
    GIL)."""

    def __init__(self, config: EngineConfig) -> None:
        if config.parallel.pipeline_parallel_size != 1:
            raise ValueError("InProcExecutor runs one stage; use the Ray executor for pp > 1")
        self.worker = Worker(config)
        self.num_blocks = self.worker.num_blocks_available()
        self.max_model_len = resolve_max_model_len(
            config, self.worker.arch.max_position_embeddings, self.num_blocks)
        self.vocab_size = self.worker.arch.vocab_size
        self.kv_medium = "GPU" if self.worker.device.type == "cuda" else "CPU"
        self.num_offload_blocks = self.worker.num_offload_blocks()
        self.worker.init_cache(self.num_blocks, self.max_model_len)
        self._thread = (ThreadPoolExecutor(1, thread_name_prefix="tokenflow-model")
                        if config.scheduler.async_scheduling else None)

    @property
    def model(self) -> torch.nn.Module:
        """The model this executor runs (benchmarks time its forward)."""
        return self.worker.model

    def execute_model(self, sched_out: SchedulerOutput) -> StepResult:
        if self._thread is not None:
            return self._thread.submit(self._run, sched_out)
        future: Future[ModelRunnerOutput] = Future()
        try:
            future.set_result(self._run(sched_out))
        except Exception as exc:  # delivered where the engine waits for the step
            future.set_exception(exc)
        return future

    def _run(self, sched_out: SchedulerOutput) -> ModelRunnerOutput:
        out = self.worker.execute_model(sched_out)
        assert isinstance(out, ModelRunnerOutput)  # the only stage is the last
        return out

    def check_health(self) -> None:
        pass

    def recover(self) -> bool:
        return False  # its failures are errors of a step, not a lost worker

    def shutdown(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=True)
        self.worker.shutdown()


def build_executor(config: EngineConfig) -> Executor:
    if config.parallel.uses_ray:
        from tokenflow.replica.worker.ray_executor import RayExecutor

        return RayExecutor(config)
    return InProcExecutor(config)
