"""A stage's LoRA adapters: the slots in its layers, a CPU cache behind them, and each step's
per-token slot indices."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch

from tokenflow.config import LoRAConfig
from tokenflow.replica.loading.lora import AdapterWeights, LoRASpec, adapter_weights, read_adapter
from tokenflow.replica.models.config import ModelArchConfig
from tokenflow.replica.models.llama import CausalLM
from tokenflow.replica.models.lora import FUSED_PARTS, LoRAStep, wrap_lora
from tokenflow.scheduler.lora import LoRAAdapter


class StageLoRA:
    """Owns one stage's LoRA slots (`LoRALinear`s wrapped around its projections), which
    adapter each slot holds, and an LRU cache of `max_cpu_loras` adapters' weights in CPU
    memory (an adapter evicted from it is read from disk again when next loaded).

    The scheduler decides the slots (`SchedulerOutput.lora_loads`); this stage writes them
    (`load`) and, each step, turns its requests' adapters into token groups (`begin_step`).
    """

    def __init__(self, model: CausalLM, config: LoRAConfig, device: torch.device,
                 dtype: torch.dtype) -> None:
        self.arch: ModelArchConfig = model.arch
        self.layer_range = (model.layer_start, model.layer_end)
        self.config = config
        self.step = LoRAStep(config.max_lora_rank, dtype)
        self.layers = wrap_lora(model, config.max_loras, self.step, device)
        self.slot_of: dict[LoRAAdapter, int] = {}
        self._cpu: OrderedDict[LoRAAdapter, tuple[LoRASpec, AdapterWeights]] = OrderedDict()

    def load(self, loads: dict[int, LoRAAdapter]) -> None:
        """Write each adapter into its slot (before the step that first runs it)."""
        for slot, adapter in loads.items():
            spec, weights = self._weights(adapter)
            for (layer, name), lora in self.layers.items():
                parts = [weights.get((layer, part)) for part in FUSED_PARTS[name]]
                lora.set_slot(slot, parts, spec.scaling)
            self.slot_of = {a: s for a, s in self.slot_of.items() if s != slot}
            self.slot_of[adapter] = slot

    def _weights(self, adapter: LoRAAdapter) -> tuple[LoRASpec, AdapterWeights]:
        cached = self._cpu.get(adapter)
        if cached is not None:
            self._cpu.move_to_end(adapter)
            return cached
        spec = read_adapter(adapter.path, self.arch, self.config.max_lora_rank)
        cached = self._cpu[adapter] = (spec, adapter_weights(spec, self.layer_range))
        while len(self._cpu) > self.config.cpu_loras:
            self._cpu.popitem(last=False)
        return cached

    def begin_step(self, adapters: list[LoRAAdapter | None], query_lens: np.ndarray,
                   device: torch.device) -> None:
        """The step's token groups or segments from each request's adapter and token count,
        in the step's request order."""
        slot_of = self.slot_of
        slots = np.fromiter((-1 if a is None else slot_of[a] for a in adapters), np.int64,
                            len(adapters))
        self.step.set(slots, query_lens, device)
