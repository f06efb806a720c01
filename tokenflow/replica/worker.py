"""Worker: one device and one pipeline stage (layers [start, end)), its KV cache and runner."""

from __future__ import annotations

import os

import torch

from tokenflow.config import EngineConfig
from tokenflow.replica.loader import load_model, resolve_dtype
from tokenflow.replica.model_runner import IntermediateTensors, ModelRunner
from tokenflow.replica.model_source import resolve_model
from tokenflow.scheduler import ModelRunnerOutput, SchedulerOutput


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


class Worker:
    """Owns one stage's model, KV cache tensors and ModelRunner.

    The same class runs in-process (InProcExecutor) and inside a Ray actor (RayExecutor).
    Built in two steps: the weights first, then, once the engine has chosen the block count
    and the context limit for every stage, the cache (`init_cache`).
    """

    def __init__(self, config: EngineConfig, layer_range: tuple[int, int] | None = None,
                 device: torch.device | None = None) -> None:
        self.config = config
        self.device = device or resolve_device(config.model.device)
        if self.device.type == "cpu":
            torch.set_num_threads(config.model.num_threads or len(os.sched_getaffinity(0)))
        source = resolve_model(config.model.model)
        self.arch = source.arch_config()
        self.dtype = resolve_dtype(config.model.dtype, self.arch.dtype, self.device)
        self.model = load_model(source, dtype=self.dtype, device=self.device,
                                load_format=config.model.load_format, layer_range=layer_range,
                                seed=config.model.seed)
        self.runner: ModelRunner | None = None

    @property
    def num_layers(self) -> int:
        return self.model.layer_end - self.model.layer_start

    def bytes_per_block(self) -> int:
        arch, cache = self.arch, self.config.cache
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * cache.block_size * arch.num_kv_heads * arch.head_dim * elem * self.num_layers

    def num_blocks_available(self) -> int:
        """Blocks this stage can hold: the configured count, or what the memory budget fits."""
        cache = self.config.cache
        if cache.num_blocks is not None:
            return cache.num_blocks
        return max(1, cache.kv_cache_memory_bytes // self.bytes_per_block())

    def init_cache(self, num_blocks: int, max_model_len: int) -> None:
        arch, bs = self.arch, self.config.cache.block_size
        shape = (2, num_blocks, bs, arch.num_kv_heads, arch.head_dim)
        kv_caches = [torch.zeros(shape, dtype=self.dtype, device=self.device)
                     for _ in range(self.num_layers)]
        self.runner = ModelRunner(self.model, kv_caches, block_size=bs,
                                  max_model_len=max_model_len, device=self.device,
                                  seed=self.config.model.seed)

    def execute_model(self, sched_out: SchedulerOutput,
                      intermediate: IntermediateTensors | None = None
                      ) -> ModelRunnerOutput | IntermediateTensors | None:
        assert self.runner is not None, "init_cache() first"
        return self.runner.execute_model(sched_out, intermediate)
