"""ModelRunner: one step of one pipeline stage, from SchedulerOutput to sampled tokens."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tokenflow.replica.attention.backends import AttentionMetadata
from tokenflow.replica.models.llama import CausalLM
from tokenflow.replica.worker.drafter import NgramDrafter
from tokenflow.replica.worker.input_batch import CachedRequestState, InputBatch, StepInputs
from tokenflow.replica.worker.lora import StageLoRA
from tokenflow.replica.worker.sampler import Sampler, SamplingMetadata, apply_token_bitmask
from tokenflow.scheduler import ModelRunnerOutput, SchedulerOutput, TokenLogprobs
from tokenflow.scheduler.sched_output import GrammarBitmask


@dataclass
class IntermediateTensors:
    """What a non-last pipeline stage hands to the next one."""

    hidden: torch.Tensor
    residual: torch.Tensor | None


class ModelRunner:
    """Owns a stage's model, its KV cache tensors and the persistent batch.

    The last stage computes logits only for the last token of each request whose prefill is
    complete this step (plus every token of a request that asked for prompt logprobs). With
    `keep_sampled` (async scheduling) it appends what it samples to its own batch, since the
    next step may come before the scheduler sends those tokens back.
    """

    def __init__(self, model: CausalLM, kv_caches: list[torch.Tensor], *, block_size: int,
                 max_model_len: int, device: torch.device, seed: int = 0,
                 drafter: NgramDrafter | None = None, keep_sampled: bool = False,
                 lora: StageLoRA | None = None) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.device = device
        self.dtype = next(model.parameters()).dtype
        self.block_size = block_size
        self.batch = InputBatch(max_model_len, block_size)
        self.sampler = Sampler(seed=seed, device=device)
        self.drafter = drafter
        self.keep_sampled = keep_sampled
        self.lora = lora

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
        inputs = self.batch.prepare(sched_out, group_by_lora=self.lora is not None)
        if self.lora is not None:
            self._begin_lora(sched_out, inputs)
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
        return self._sample(inputs, hidden, sched_out.grammar_bitmask)

    def _begin_lora(self, sched_out: SchedulerOutput, inputs: StepInputs) -> None:
        """Load the adapters the scheduler placed in slots, then the step's per-token masks."""
        assert self.lora is not None
        if sched_out.lora_loads:
            self.lora.load(sched_out.lora_loads)
        states = self.batch.states
        self.lora.begin_step([states[r].lora for r in inputs.req_ids],
                             np.diff(inputs.query_start_loc), self.device)

    def _sample(self, inputs: StepInputs, hidden: torch.Tensor,
                grammar: GrammarBitmask | None = None) -> ModelRunnerOutput:
        """Sample every request whose chunk reaches its last known token. A request verifying
        d drafts gets d + 1 rows, one per position, each seeing the drafts before it as
        outputs; sampling row j and accepting draft j when the token equals it is exactly
        rejection sampling for a deterministic draft, and greedy-exact. The first rejected
        position's token (or the bonus token after the last draft) ends the request's run.
        Rows of structured-output requests first lose the tokens their grammar forbids."""
        states = [self.batch.states[r] for r in inputs.req_ids]
        sampled: list[list[int]] = [[] for _ in states]
        logprobs: dict[str, list[TokenLogprobs]] = {}
        rows = _SampleRows(inputs, states)
        if rows.positions:
            logits = self.model.compute_logits(
                hidden[self._tensor(np.asarray(rows.positions, dtype=np.int64))])
            if grammar is not None:
                masked, mask_rows = rows.grammar_rows(inputs.req_ids, grammar)
                apply_token_bitmask(logits, masked, grammar.bitmask[mask_rows])
            meta = SamplingMetadata.build(rows.params, rows.outputs, rows.prompts,
                                          self.device, rows.eos)
            result = self.sampler(logits, meta)
            token_ids = result.sampled_token_ids.tolist()
            for i, first, drafts in rows.requests:
                kept = _accept(token_ids, first, drafts)
                sampled[i] = kept
                if result.logprobs and result.logprobs[first] is not None:
                    logprobs[inputs.req_ids[i]] = result.logprobs[first:first + len(kept)]
        prompt_logprobs = self._prompt_logprobs(inputs, hidden, states)
        drafts = self._propose(inputs, sampled) if self.drafter is not None else None
        if self.keep_sampled:
            self.batch.append_sampled(inputs.req_ids, sampled)
        return ModelRunnerOutput(inputs.req_ids, sampled, logprobs or None, prompt_logprobs,
                                 draft_token_ids=drafts)

    def _propose(self, inputs: StepInputs, sampled: list[list[int]]) -> dict[str, list[int]]:
        """Drafts for the next step of every request that just sampled (it is decoding)."""
        assert self.drafter is not None
        proposals: dict[str, list[int]] = {}
        for req_id, new in zip(inputs.req_ids, sampled, strict=True):
            if not new:
                continue
            state = self.batch.states[req_id]
            room = (state.sampling_params.max_tokens or 1 << 30) - len(
                state.output_token_ids) - len(new) - 1
            tokens = np.concatenate((self.batch.known_tokens(req_id), np.asarray(new)))
            drafts = self.drafter.propose(tokens, room)
            if drafts:
                proposals[req_id] = drafts
        return proposals

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


class _SampleRows:
    """The rows one step samples: per request that samples, one row per position it
    verifies (the last known token and each draft), in request order."""

    __slots__ = ("eos", "outputs", "params", "positions", "prompts", "requests")

    def __init__(self, inputs: StepInputs, states: list[CachedRequestState]) -> None:
        self.positions: list[int] = []
        self.params: list = []
        self.outputs: list[list[int]] = []
        self.prompts: list[list[int]] = []
        self.eos: list[int | None] = []
        self.requests: list[tuple[int, int, list[int]]] = []  # (index, first row, drafts)
        ends = inputs.query_start_loc[1:]
        for i in np.flatnonzero(inputs.sample_mask).tolist():
            state = states[i]
            drafts = inputs.drafts.get(state.req_id, []) if inputs.drafts else []
            self.requests.append((i, len(self.positions), drafts))
            end = int(ends[i])
            for j in range(len(drafts) + 1):
                self.positions.append(end - 1 - len(drafts) + j)
                self.params.append(state.sampling_params)
                self.outputs.append(state.output_token_ids + drafts[:j] if j
                                    else state.output_token_ids)
                self.prompts.append(state.prompt_token_ids)
                self.eos.append(state.eos_token_id)


    def grammar_rows(self, req_ids: list[str], grammar: GrammarBitmask
                     ) -> tuple[list[int], list[int]]:
        """(logit rows, bitmask rows) of the requests `grammar` constrains, pairwise."""
        logit_rows: list[int] = []
        mask_rows: list[int] = []
        for i, first, drafts in self.requests:
            start = grammar.first_row.get(req_ids[i])
            if start is not None:
                logit_rows.extend(range(first, first + len(drafts) + 1))
                mask_rows.extend(range(start, start + len(drafts) + 1))
        return logit_rows, mask_rows


def _accept(token_ids: list[int], first: int, drafts: list[int]) -> list[int]:
    """The tokens a request keeps: its sampled tokens up to and including the first that
    differs from its draft (all of them, the bonus token included, if none does)."""
    kept = []
    for j in range(len(drafts) + 1):
        token = token_ids[first + j]
        kept.append(token)
        if j == len(drafts) or token != drafts[j]:
            break
    return kept
