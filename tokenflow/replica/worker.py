"""Worker: one device and one pipeline stage (layers [start, end)), its KV cache and runner."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from tokenflow.config import EngineConfig
from tokenflow.replica.loader import ModelArchConfig, load_model, resolve_dtype
from tokenflow.replica.model_runner import IntermediateTensors, ModelRunner
from tokenflow.replica.tiny_model import TINY_MODEL_NAME, resolve_model_dir
from tokenflow.scheduler.output import ModelRunnerOutput, SchedulerOutput


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_load_format(model: str, model_dir: Path, load_format: str) -> str:
    """`auto` means the checkpoint's safetensors, or dummy weights for the embedded model."""
    if load_format != "auto":
        return load_format
    if model == TINY_MODEL_NAME and not any(model_dir.glob("*.safetensors")):
        return "dummy"
    return "safetensors"


def resolve_max_model_len(config: EngineConfig, arch: ModelArchConfig) -> int:
    wanted = config.scheduler.max_model_len
    if wanted is None:
        return arch.max_position_embeddings
    if wanted > arch.max_position_embeddings:
        raise ValueError(f"max_model_len={wanted} exceeds the model's "
                         f"max_position_embeddings={arch.max_position_embeddings}")
    return wanted


class Worker:
    """Owns one stage's model, KV cache tensors and ModelRunner.

    The same class runs in-process (InProcExecutor) and inside a Ray actor (RayExecutor).
    """

    def __init__(self, config: EngineConfig, layer_range: tuple[int, int] | None = None,
                 device: torch.device | None = None) -> None:
        self.config = config
        self.device = device or resolve_device(config.model.device)
        if self.device.type == "cpu":
            torch.set_num_threads(config.model.num_threads or len(os.sched_getaffinity(0)))
        self.model_dir = resolve_model_dir(config.model.model)
        self.arch = ModelArchConfig.from_model_dir(self.model_dir)
        self.dtype = resolve_dtype(config.model.dtype, self.arch.dtype, self.device)
        load_format = resolve_load_format(config.model.model, self.model_dir,
                                          config.model.load_format)
        self.model = load_model(self.model_dir, dtype=self.dtype, device=self.device,
                                load_format=load_format, layer_range=layer_range,
                                seed=config.model.seed)
        self.max_model_len = resolve_max_model_len(config, self.arch)
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

    def init_cache(self, num_blocks: int) -> None:
        arch, bs = self.arch, self.config.cache.block_size
        shape = (2, num_blocks, bs, arch.num_kv_heads, arch.head_dim)
        kv_caches = [torch.zeros(shape, dtype=self.dtype, device=self.device)
                     for _ in range(self.num_layers)]
        self.runner = ModelRunner(self.model, kv_caches, block_size=bs,
                                  max_model_len=self.max_model_len, device=self.device,
                                  seed=self.config.model.seed)

    def execute_model(self, sched_out: SchedulerOutput,
                      intermediate: IntermediateTensors | None = None
                      ) -> ModelRunnerOutput | IntermediateTensors | None:
        assert self.runner is not None, "init_cache() first"
        return self.runner.execute_model(sched_out, intermediate)
