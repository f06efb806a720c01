"""ModelRunner: one step of one pipeline stage, from SchedulerOutput to sampled tokens."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tokenflow.replica.attention import AttentionMetadata
from tokenflow.replica.input_batch import CachedRequestState, InputBatch, StepInputs
from tokenflow.replica.models.llama import CausalLM
from tokenflow.replica.sampler import Sampler, SamplingMetadata
from tokenflow.scheduler import ModelRunnerOutput, SchedulerOutput, TokenLogprobs


@dataclass
class IntermediateTensors:
    """What a non-last pipeline stage hands to the next one."""

    hidden: torch.Tensor
    residual: torch.Tensor | None


class ModelRunner:
    """Owns a stage's model, its KV cache tensors and the persistent batch.

    The last stage computes logits only for the last token of each request whose prefill is
    complete this step (plus every token of a request that asked for prompt logprobs).
    """

    def __init__(self, model: CausalLM, kv_caches: list[torch.Tensor], *, block_size: int,
                 max_model_len: int, device: torch.device, seed: int = 0) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.device = device
        self.dtype = next(model.parameters()).dtype
        self.block_size = block_size
        self.batch = InputBatch(max_model_len, block_size)
        self.sampler = Sampler(seed=seed, device=device)

    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array).to(self.device, non_blocking=True)

    @torch.inference_mode()
    def execute_model(
        self, sched_out: SchedulerOutput, intermediate: IntermediateTensors | None = None
    ) -> ModelRunnerOutput | IntermediateTensors | None:
        """Apply the deltas and run the step. Returns None when nothing was scheduled."""
        self.batch.apply(sched_out)
        if sched_out.total_num_scheduled_tokens == 0:
            return None if not self.model.is_last_stage else ModelRunnerOutput([], [])
        inputs = self.batch.prepare(sched_out)
        meta = AttentionMetadata.build(
            slot_mapping=inputs.slot_mapping, block_table=inputs.block_table,
            query_start_loc=inputs.query_start_loc, seq_lens=inputs.seq_lens,
            block_size=self.block_size, device=self.device, dtype=self.dtype)
        hidden, residual = self.model(
            self._tensor(inputs.input_ids) if self.model.is_first_stage else None,
            self._tensor(inputs.positions), self.kv_caches, meta,
            intermediate.hidden if intermediate else None,
            intermediate.residual if intermediate else None)
        if not self.model.is_last_stage:
            return IntermediateTensors(hidden, residual)
        return self._sample(inputs, hidden)

    def _sample(self, inputs: StepInputs, hidden: torch.Tensor) -> ModelRunnerOutput:
        states = [self.batch.states[r] for r in inputs.req_ids]
        sample_idx = np.flatnonzero(inputs.sample_mask)
        sampled: list[list[int]] = [[] for _ in states]
        logprobs: dict[str, list[TokenLogprobs]] = {}
        if len(sample_idx):
            rows = [states[i] for i in sample_idx]
            last_token = inputs.query_start_loc[1:][sample_idx] - 1
            logits = self.model.compute_logits(hidden[self._tensor(last_token.astype(np.int64))])
            meta = SamplingMetadata.build(
                [s.sampling_params for s in rows], [s.output_token_ids for s in rows],
                [s.prompt_token_ids for s in rows], self.device,
                [s.eos_token_id for s in rows])
            result = self.sampler(logits, meta)
            token_ids = result.sampled_token_ids.tolist()
            for j, i in enumerate(sample_idx):
                sampled[i] = [token_ids[j]]
                if result.logprobs and result.logprobs[j] is not None:
                    logprobs[inputs.req_ids[i]] = [result.logprobs[j]]
        prompt_logprobs = self._prompt_logprobs(inputs, hidden, states)
        return ModelRunnerOutput(inputs.req_ids, sampled, logprobs or None, prompt_logprobs)

    def _prompt_logprobs(self, inputs: StepInputs, hidden: torch.Tensor,
                         states: list[CachedRequestState]) -> dict[str, list[TokenLogprobs | None]] | None:
        """Logprob of each prompt token given the ones before it, for this step's chunk.

        Entry j is prompt token j's (token 0 has none: None). Such a request skips the prefix
        cache, so every position is computed here; a chunk recomputed after a preemption
        sends only entries not sent before."""
        result: dict[str, list[TokenLogprobs | None]] = {}
        for i, state in enumerate(states):
            num_top = state.sampling_params.prompt_logprobs
            num_prompt = len(state.prompt_token_ids)
            start = int(inputs.num_computed[i])
            if num_top is None or start >= num_prompt:
                continue
            end = min(int(inputs.seq_lens[i]) + 1, num_prompt)
            done = state.num_prompt_logprobs
            entries: list[TokenLogprobs | None] = [None] * max(0, start + 1 - done)
            first = max(start + 1, done)  # first prompt token this chunk reports
            # Position p predicts prompt token p + 1: token `first` is row first - 1 - start.
            row = int(inputs.query_start_loc[i]) + first - 1 - start
            targets = state.prompt_token_ids[first:end]
            if targets:
                logits = self.model.compute_logits(hidden[row:row + len(targets)])
                lps = torch.log_softmax(logits, dim=-1)
                entries.extend(_token_logprobs(lps, targets, num_top))
            state.num_prompt_logprobs = max(done, end)
            if entries:
                result[state.req_id] = entries
        return result or None


def _token_logprobs(lps: torch.Tensor, targets: list[int], num_top: int) -> list[TokenLogprobs]:
    target = torch.tensor(targets, dtype=torch.long, device=lps.device)
    chosen = lps.gather(1, target[:, None]).squeeze(1)
    ranks = (lps > chosen[:, None]).sum(dim=1) + 1
    top_vals, top_ids = (lps.topk(num_top, dim=-1) if num_top > 0
                         else (lps[:, :0], lps[:, :0].long()))
    out = []
    for j, tok in enumerate(targets):
        out.append(TokenLogprobs([tok, *top_ids[j].tolist()],
                                 [float(chosen[j]), *top_vals[j].tolist()], int(ranks[j])))
    return out
