"""The worker's persistent batch: every request it holds, updated from SchedulerOutput deltas,
and the flattened varlen inputs of one step, built in numpy in one pass."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from tokenflow.scheduler import SchedulerOutput
from tokenflow.scheduler.lora import LoRAAdapter
from tokenflow.scheduler.sampling_params import SamplingParams


@dataclass
class CachedRequestState:
    """What a worker remembers of one request between steps (it survives preemption)."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    row: int
    eos_token_id: int | None = None
    output_token_ids: list[int] = field(default_factory=list)
    num_blocks: int = 0
    num_computed_tokens: int = 0
    # Prompt positions whose logprob entry was already sent (recomputing after a preemption
    # must not send them twice).
    num_prompt_logprobs: int = 0
    lora: LoRAAdapter | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)


@dataclass
class StepInputs:
    """One step's flattened batch, request order = `req_ids`."""

    req_ids: list[str]
    input_ids: np.ndarray  # [num_tokens] int64
    positions: np.ndarray  # [num_tokens] int64
    slot_mapping: np.ndarray  # [num_tokens] int64
    query_start_loc: np.ndarray  # [num_reqs + 1] int32
    seq_lens: np.ndarray  # [num_reqs] int32
    block_table: np.ndarray  # [num_reqs, max_blocks] int32
    num_computed: np.ndarray  # [num_reqs] int64, before this step
    sample_mask: np.ndarray  # [num_reqs] bool: the chunk reaches the last known token
    drafts: dict[str, list[int]]  # the draft tokens each request verifies this step


class InputBatch:
    """Owns per-request state and the token / block-table buffers, one row per request.

    Rows are recycled when a request finishes; a preempted request keeps its row (and its
    tokens) and only loses its blocks.
    """

    def __init__(self, max_model_len: int, block_size: int, initial_rows: int = 64) -> None:
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.max_blocks = -(-max_model_len // block_size)
        self.states: dict[str, CachedRequestState] = {}
        self.token_ids = np.zeros((initial_rows, max_model_len), dtype=np.int64)
        self.block_table = np.zeros((initial_rows, self.max_blocks), dtype=np.int32)
        self._free_rows = list(range(initial_rows - 1, -1, -1))

    # -------------------------------------------------------------------------- deltas
    def apply(self, out: SchedulerOutput) -> None:
        for req_id in out.finished_req_ids:
            state = self.states.pop(req_id, None)
            if state is not None:
                self._free_rows.append(state.row)
        for req_id in out.preempted_req_ids:
            if req_id in self.states:
                self.states[req_id].num_blocks = 0
        for new in out.scheduled_new_reqs:
            state = CachedRequestState(new.req_id, list(new.prompt_token_ids),
                                       new.sampling_params, self._take_row(), new.eos_token_id,
                                       list(new.output_token_ids), lora=new.lora)
            self.states[new.req_id] = state
            known = new.prompt_token_ids + new.output_token_ids
            self.token_ids[state.row, :len(known)] = known
            self._append_blocks(state, new.block_ids)
            state.num_computed_tokens = new.num_computed_tokens
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self.states[req_id]
            num_prompt = len(state.prompt_token_ids)
            # From the computed frontier, but never past what this worker knows: accepted
            # drafts are computed before it learns them as outputs.
            start = min(max(cached.num_computed_tokens[i], num_prompt), state.num_tokens)
            new_tokens = cached.new_token_ids[i]
            # A resumed request drops tokens the scheduler never took (sampled by a step that
            # was in flight when it was preempted): it recomputes them.
            if new_tokens or cached.resumed_from_preemption[i]:
                del state.output_token_ids[start - num_prompt:]
                state.output_token_ids.extend(new_tokens)
                self.token_ids[state.row, start:start + len(new_tokens)] = new_tokens
            if cached.resumed_from_preemption[i]:
                state.num_blocks = 0
            self._append_blocks(state, cached.new_block_ids[i])
            state.num_computed_tokens = cached.num_computed_tokens[i]

    def append_sampled(self, req_ids: list[str], sampled: list[list[int]]) -> None:
        """Remember the tokens this worker just sampled (async scheduling): the next step may
        be scheduled before the scheduler knows them, and then feeds them from here."""
        for req_id, tokens in zip(req_ids, sampled, strict=True):
            if tokens:
                state = self.states[req_id]
                n = state.num_tokens
                self.token_ids[state.row, n:n + len(tokens)] = tokens
                state.output_token_ids.extend(tokens)

    def _append_blocks(self, state: CachedRequestState, block_ids: list[int]) -> None:
        if block_ids:
            n = state.num_blocks
            self.block_table[state.row, n:n + len(block_ids)] = block_ids
            state.num_blocks = n + len(block_ids)

    def known_tokens(self, req_id: str) -> np.ndarray:
        """A request's prompt and outputs so far (a view of its row)."""
        state = self.states[req_id]
        return self.token_ids[state.row, :state.num_tokens]

    def _take_row(self) -> int:
        if not self._free_rows:
            old = self.token_ids.shape[0]
            self.token_ids = np.concatenate([self.token_ids, np.zeros_like(self.token_ids)])
            self.block_table = np.concatenate([self.block_table, np.zeros_like(self.block_table)])
            self._free_rows = list(range(2 * old - 1, old - 1, -1))
        return self._free_rows.pop()

    # ---------------------------------------------------------------------------- inputs
    def prepare(self, out: SchedulerOutput, group_by_lora: bool = False) -> StepInputs:
        """Flatten the scheduled requests into one varlen batch (numpy, no per-token loop).
        With `group_by_lora`, the requests of one adapter come together (a stable order by
        adapter name, the base model first), so each adapter's tokens are one contiguous run
        (`models/lora.py`); every stage of a pipeline orders them the same way."""
        req_ids = list(out.num_scheduled_tokens)
        if group_by_lora:
            req_ids.sort(key=lambda r: _lora_name(self.states[r]))
        states = [self.states[r] for r in req_ids]
        for req_id, drafts in out.scheduled_spec_decode_tokens.items():
            state = self.states[req_id]
            self.token_ids[state.row, state.num_tokens:state.num_tokens + len(drafts)] = drafts
        rows = np.fromiter((s.row for s in states), np.int64, len(states))
        num_computed = np.fromiter((s.num_computed_tokens for s in states), np.int64, len(states))
        num_known = np.fromiter((s.num_tokens for s in states), np.int64, len(states))
        scheduled = out.num_scheduled_tokens
        query_lens = np.fromiter((scheduled[r] for r in req_ids), np.int64, len(states))
        spec = out.scheduled_spec_decode_tokens
        num_drafts = (np.fromiter((len(spec.get(r, ())) for r in req_ids), np.int64, len(states))
                      if spec else np.zeros(len(states), dtype=np.int64))
        query_start_loc = np.zeros(len(states) + 1, dtype=np.int64)
        np.cumsum(query_lens, out=query_start_loc[1:])
        token_rows = np.repeat(rows, query_lens)
        positions = np.arange(query_start_loc[-1]) - np.repeat(
            query_start_loc[:-1] - num_computed, query_lens)
        seq_lens = num_computed + query_lens
        bs = self.block_size
        slot_mapping = (self.block_table[token_rows, positions // bs].astype(np.int64) * bs
                        + positions % bs)
        max_blocks = int(-(-seq_lens.max() // bs)) if len(states) else 0
        return StepInputs(
            req_ids=req_ids,
            input_ids=self.token_ids[token_rows, positions],
            positions=positions,
            slot_mapping=slot_mapping,
            query_start_loc=query_start_loc.astype(np.int32),
            seq_lens=seq_lens.astype(np.int32),
            block_table=self.block_table[rows, :max_blocks],
            num_computed=num_computed,
            sample_mask=seq_lens - num_drafts >= num_known,
            drafts=spec,
        )


def _lora_name(state: CachedRequestState) -> str:
    return "" if state.lora is None else "\0" + state.lora.name  # the base model first
