"""Worker: one device and one pipeline stage (layers [start, end)), its KV cache and runner."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import asdict, dataclass

import torch

from tokenflow.config import EngineConfig
from tokenflow.kv.connector import (
    KVConnectorOutput,
    combine_workers,
    create_offload_worker,
    create_worker_connector,
)
from tokenflow.net import free_port
from tokenflow.replica.loading.loader import load_model, resolve_dtype, resolve_quantization
from tokenflow.replica.loading.resolve import resolve_model
from tokenflow.replica.worker import huge_pages
from tokenflow.replica.worker.compile import compile_step
from tokenflow.replica.worker.drafter import NgramDrafter
from tokenflow.replica.worker.lora import StageLoRA
from tokenflow.replica.worker.model_runner import ModelRunner
from tokenflow.replica.worker.pipeline import StagePipe, stage_layer_ranges
from tokenflow.scheduler import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


@dataclass
class StageTimings:
    """Where one stage's time went, summed over steps since the last `take_timings()`:
    waiting for the previous stage's activations, running its layers, handing them on."""

    steps: int = 0
    recv_s: float = 0.0
    compute_s: float = 0.0
    send_s: float = 0.0


class Worker:
    """Owns one stage's model, KV cache tensors, ModelRunner and pipeline hand-off.

    The same class runs in-process (InProcExecutor) and as a Ray actor (RayExecutor). Built in
    steps: the weights of stage `stage`'s layers; then, with several stages, the process
    group (`init_pipe`); then, once the engine chose the block count and context limit for
    every stage, the cache (`init_cache`). A stage after the first receives its input from the
    one before, a stage before the last sends its output on: the worker owns that, so the
    runner and the executor never pass activations around.
    """

    def __init__(self, config: EngineConfig, stage: int = 0,
                 device: torch.device | None = None) -> None:
        self.config = config
        self.device = device or resolve_device(config.model.device)
        if self.device.type == "cpu":
            torch.set_num_threads(config.model.num_threads or len(os.sched_getaffinity(0)))
        source = resolve_model(config.model.model)
        self.arch = source.arch_config()
        parallel = config.parallel
        self.stage = stage
        self.layer_range = stage_layer_ranges(self.arch.num_layers,
                                              parallel.pipeline_parallel_size,
                                              parallel.stage_layers)[stage]
        self.dtype = resolve_dtype(config.model.dtype, self.arch.dtype, self.device)
        self.cache_dtype = resolve_dtype(config.cache.kv_cache_dtype, self.dtype, self.device,
                                         keep_half=True)
        self.quantization = resolve_quantization(config.model.quantization, source,
                                                 self.device, config.model.load_format)
        self.model = load_model(source, dtype=self.dtype, device=self.device,
                                load_format=config.model.load_format,
                                layer_range=self.layer_range, seed=config.model.seed,
                                quantization=self.quantization,
                                batch_invariant=config.model.batch_invariant)
        # LoRA slots around the (maybe quantized) projections, when adapters are served.
        self.lora = (StageLoRA(self.model, config.lora, self.device, self.dtype)
                     if config.lora.enabled else None)
        self.runner: ModelRunner | None = None
        self.pipe: StagePipe | None = None
        self.timings = StageTimings()
        # This stage's half of the KV-transfer connector and of the offload tier, when
        # configured (both: side by side, `CompositeWorker`).
        self.connector = combine_workers(
            create_worker_connector(config.kv_transfer,
                                    "nccl" if self.device.type == "cuda" else "gloo"),
            create_offload_worker(config.kv_offload)
            if config.cache.enable_prefix_caching else None)

    @property
    def num_layers(self) -> int:
        return self.layer_range[1] - self.layer_range[0]

    # ------------------------------------------------------------------ pipeline group
    def rendezvous_address(self, node_ip: str) -> tuple[str, int]:
        """Where stage 0 hosts its group's rendezvous: its node IP and a free port."""
        return node_ip, free_port(node_ip)

    def init_pipe(self, master: tuple[str, int], node_ip: str) -> None:
        """Join the replica's process group (blocks until every stage joined)."""
        parallel = self.config.parallel
        backend = parallel.distributed_backend
        if backend == "auto":
            backend = "nccl" if self.device.type == "cuda" else "gloo"
        self.pipe = StagePipe(self.stage, parallel.pipeline_parallel_size, backend, master,
                              node_ip, parallel.step_timeout_s)

    # ------------------------------------------------------------------------- cache
    def bytes_per_block(self) -> int:
        arch, cache = self.arch, self.config.cache
        elem = torch.empty((), dtype=self.cache_dtype).element_size()
        return 2 * cache.block_size * arch.num_kv_heads * arch.head_dim * elem * self.num_layers

    def num_blocks_available(self) -> int:
        """Blocks this stage can hold: the configured count, or what the memory budget fits
        for this stage's own layers."""
        cache = self.config.cache
        if cache.num_blocks is not None:
            return cache.num_blocks
        return max(1, cache.kv_cache_memory_bytes // self.bytes_per_block())

    def num_offload_blocks(self) -> int:
        """Blocks of this stage's layers the offload tier holds in `size_gb` (0: no tier)."""
        offload = self.config.kv_offload
        if not offload.enabled or not self.config.cache.enable_prefix_caching:
            return 0
        return max(1, int(offload.size_gb * 2**30) // self.bytes_per_block())

    def init_cache(self, num_blocks: int, max_model_len: int) -> None:
        arch, bs = self.arch, self.config.cache.block_size
        shape = (2, num_blocks, bs, arch.num_kv_heads, arch.head_dim)
        kv_caches = [huge_pages.zeros(shape, self.cache_dtype, self.device)
                     for _ in range(self.num_layers)]
        spec = self.config.speculative
        drafter = None
        if spec.method == "ngram" and self.model.is_last_stage:  # it samples, so it drafts
            drafter = NgramDrafter(spec.num_speculative_tokens, spec.prompt_lookup_min,
                                   spec.prompt_lookup_max)
        self.runner = ModelRunner(self.model, kv_caches, block_size=bs,
                                  max_model_len=max_model_len, device=self.device,
                                  seed=self.config.model.seed, drafter=drafter,
                                  keep_sampled=self.config.scheduler.async_scheduling,
                                  lora=self.lora)
        if self.config.model.compile:
            compile_step(self.model, kv_caches, self.config.scheduler.max_num_batched_tokens)
        if self.connector is not None:
            self.connector.register_kv_caches(kv_caches, self.layer_range)

    # -------------------------------------------------------------------------- step
    def execute_model(self, sched_out: SchedulerOutput
                      ) -> ModelRunnerOutput | KVConnectorOutput | None:
        """Run this stage's part of one step. The last stage returns the sampled tokens (with
        every transfer report of its connector); a stage before it returns its connector's
        report, if any."""
        assert self.runner is not None, "init_cache() first"
        meta = sched_out.kv_connector_metadata
        if self.connector is not None and meta is not None:
            self.connector.start_load_kv(meta)
        out = self._forward(sched_out)
        if self.connector is None:
            return out
        report = self._connector_report(sched_out)
        if isinstance(out, ModelRunnerOutput):
            out.kv_connector_outputs = [report]
            return out
        return report

    def _connector_report(self, sched_out: SchedulerOutput) -> KVConnectorOutput:
        connector, meta = self.connector, sched_out.kv_connector_metadata
        assert connector is not None
        if meta is not None:
            for layer in range(*self.layer_range):
                connector.save_kv_layer(layer, meta)
            connector.wait_for_save()
        # A step with nothing to compute only polls transfers: wait a little for one to end
        # rather than have the engine loop spin.
        return connector.get_finished(0.0 if sched_out.total_num_scheduled_tokens else 0.01)

    def _forward(self, sched_out: SchedulerOutput) -> ModelRunnerOutput | None:
        assert self.runner is not None
        pipe, timings = self.pipe, self.timings
        t0 = time.perf_counter()
        intermediate = None
        if pipe is not None and not pipe.is_first and sched_out.total_num_scheduled_tokens:
            intermediate = pipe.recv(sched_out.total_num_scheduled_tokens,
                                     self.arch.hidden_size, self.dtype, self.device)
        t1 = time.perf_counter()
        out = self.runner.execute_model(sched_out, intermediate)
        t2 = time.perf_counter()
        if pipe is not None and not pipe.is_last:
            if out is not None:
                pipe.send(out)  # type: ignore[arg-type]
            out = None
        timings.steps += 1
        timings.recv_s += t1 - t0
        timings.compute_s += t2 - t1
        timings.send_s += time.perf_counter() - t2
        return out  # type: ignore[return-value]

    def take_timings(self) -> dict[str, float]:
        """This stage's `StageTimings` since the last call."""
        taken, self.timings = self.timings, StageTimings()
        return asdict(taken)

    def ping(self) -> int:
        return self.stage

    def shutdown(self) -> None:
        if self.connector is not None:
            self.connector.shutdown()
        if self.pipe is not None:
            self.pipe.wait_sends()
            self.pipe.close()
            self.pipe = None
        self.runner = None
