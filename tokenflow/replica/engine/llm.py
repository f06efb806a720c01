"""The offline API: `LLM(model=...).generate(prompts, sampling_params)`."""

from __future__ import annotations

from typing import Any

from tqdm import tqdm

from tokenflow.config import (
    CacheConfig,
    EngineConfig,
    KVOffloadConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from tokenflow.replica.engine.engine import Engine
from tokenflow.replica.engine.output_processor import CompletionOutput, RequestOutput
from tokenflow.scheduler import SamplingParams, SchedulerStats

_SECTIONS = {"model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig,
             "parallel": ParallelConfig}


def engine_config_from_kwargs(model: str, kv_offload: KVOffloadConfig | dict | None = None,
                              lora: LoRAConfig | dict | None = None,
                              **kwargs: Any) -> EngineConfig:
    """Flat keyword arguments (as vLLM's `LLM(...)` takes them) -> one EngineConfig;
    `kv_offload` and `lora` (their configs or dicts) are the nested sections."""
    sections: dict[str, dict[str, Any]] = {name: {} for name in _SECTIONS}
    sections["model"]["model"] = model
    offload = KVOffloadConfig.model_validate(kv_offload or {})
    for key, value in kwargs.items():
        owner = next((name for name, cls in _SECTIONS.items() if key in cls.model_fields), None)
        if owner is None:
            raise TypeError(f"unknown engine argument {key!r}")
        sections[owner][key] = value
    return EngineConfig(**{name: cls(**sections[name]) for name, cls in _SECTIONS.items()},
                        kv_offload=offload, lora=LoRAConfig.model_validate(lora or {}))


class LLM:
    """Owns one Engine and runs batches of prompts through it to completion."""

    def __init__(self, model: str = "tokenflow-tiny", config: EngineConfig | None = None,
                 **kwargs: Any) -> None:
        self.config = config or engine_config_from_kwargs(model, **kwargs)
        self.engine = Engine(self.config)
        self._counter = 0

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def totals(self) -> SchedulerStats:
        """The engine's counters (preemptions, prefix-cache hits, drafts, KV transfers) since
        start."""
        return self.engine.totals

    def add_lora(self, name: str, path: str) -> None:
        """Serve the PEFT adapter at `path` as `name` (`SamplingParams(lora=name)`)."""
        self.engine.add_lora(name, path)

    def remove_lora(self, name: str) -> bool:
        return self.engine.remove_lora(name)

    def list_loras(self) -> list[str]:
        return self.engine.list_loras()

    def shutdown(self) -> None:
        """Stop the engine's workers (with pipeline stages: their actors and placement group)."""
        self.engine.shutdown()

    def generate(self, prompts: str | list[str] | list[list[int]],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True,
                 kv_transfer_params: dict | list[dict | None] | None = None
                 ) -> list[RequestOutput]:
        """Complete every prompt; outputs come back in prompt order, whole (not deltas).

        `kv_transfer_params` (one for all prompts, or one each), with a KV connector
        configured: `{"do_remote_decode": True}` publishes each prompt's KV for another engine
        (the output's `kv_transfer_params` says where); a producer's returned params (with
        `first_token_ids`) load it here instead of computing the prompt."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        params = sampling_params or SamplingParams()
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError("one SamplingParams per prompt, or a single one for all")
        transfers = (kv_transfer_params if isinstance(kv_transfer_params, list)
                     else [kv_transfer_params] * len(prompts))
        # All or nothing: every prompt is validated before any reaches the engine, so a bad
        # one leaves nothing queued behind for the next call.
        processed = [self.engine.process_inputs(str(self._counter + i), prompt, p,
                                                kv_transfer_params=transfer)
                     for i, (prompt, p, transfer) in enumerate(
                         zip(prompts, params_list, transfers, strict=True))]
        self._counter += len(processed)
        for request in processed:
            self.engine.add_processed(request)
        return self._run([r.request_id for r in processed], use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        merged: dict[str, RequestOutput] = {}
        pending = set(ids)
        # Until these requests finished: KV transfers they started (blocks a producer holds for
        # its consumer) go on in the background and are seen to by later steps.
        with tqdm(total=len(ids), desc="generate", unit="req", disable=not use_tqdm) as bar:
            while pending and self.engine.has_unfinished_requests():
                for delta in self.engine.step():
                    _merge(merged, delta)
                    if delta.finished:
                        pending.discard(delta.request_id)
                        bar.update(1)
        return [merged[i] for i in ids]


def _merge(merged: dict[str, RequestOutput], delta: RequestOutput) -> None:
    total = merged.get(delta.request_id)
    if total is None:
        total = merged[delta.request_id] = RequestOutput(
            delta.request_id, delta.prompt, delta.prompt_token_ids, [], False,
            prompt_logprobs=[])
    for c in delta.outputs:
        while len(total.outputs) <= c.index:
            total.outputs.append(CompletionOutput(len(total.outputs), "", []))
        seq = total.outputs[c.index]
        seq.text += c.text
        seq.token_ids = [*seq.token_ids, *c.token_ids]
        if c.logprobs:
            seq.logprobs = (seq.logprobs or []) + c.logprobs
        seq.finish_reason, seq.stop_reason = c.finish_reason, c.stop_reason
    if delta.prompt_logprobs:
        total.prompt_logprobs.extend(delta.prompt_logprobs)
    total.finished = delta.finished
    total.num_cached_tokens = delta.num_cached_tokens
    total.error = total.error or delta.error
    total.metrics = delta.metrics
    total.kv_transfer_params = delta.kv_transfer_params or total.kv_transfer_params
