"""LLMEngine: text in, text deltas out, around one EngineCore (synchronous)."""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass

from tokenflow.config import EngineConfig
from tokenflow.replica.engine import EngineCore
from tokenflow.replica.model_source import resolve_model
from tokenflow.replica.output_processor import OutputProcessor, RequestOutput
from tokenflow.replica.structured_output import grammar_of
from tokenflow.scheduler import PauseState, Request, RequestStatus, SamplingParams, SchedulerStats

logger = logging.getLogger(__name__)


@dataclass
class ProcessedRequest:
    """A validated client request: its engine-side sequences (n of them) and its prompt."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    sequences: list[Request]


class LLMEngine:
    """Owns the tokenizer, the EngineCore and the OutputProcessor of one replica.

    `process_inputs` is pure (safe from any thread); everything else runs on the engine's
    own thread.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        started = time.perf_counter()
        self.core = EngineCore(config)
        self.tokenizer = resolve_model(config.model.tokenizer or config.model.model).tokenizer()
        self.model_name = config.model.name
        # Weights, KV cache and tokenizer: what a server waits for before its first request.
        self.load_time_s = time.perf_counter() - started
        logger.info("loaded %s in %.1f s", self.model_name, self.load_time_s)
        self.max_model_len = self.core.max_model_len
        self.vocab_size = self.core.vocab_size
        self.output_processor = OutputProcessor(self.tokenizer)
        self.last_stats = SchedulerStats()
        # Counters summed over every step since start (gauges are last_stats's).
        self.totals = SchedulerStats()

    # --------------------------------------------------------------------------- inputs
    def process_inputs(self, request_id: str, prompt: str | list[int],
                       params: SamplingParams | None = None, priority: int = 0,
                       kv_transfer_params: dict | None = None) -> ProcessedRequest:
        """Tokenize and validate; raises ValueError with a message a client can read.

        The one place a prompt's length is checked against `max_model_len` and `max_tokens`
        is resolved (None: whatever room the context leaves)."""
        params = params or SamplingParams()
        if isinstance(prompt, str):
            text, token_ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, token_ids = None, list(prompt)
        self._validate(token_ids, params)
        max_tokens = params.max_tokens or self.max_model_len - len(token_ids)
        eos = self.tokenizer.eos_token_id
        # A model may end turns with several tokens; all but the primary EOS act as stop ids.
        extra_stops = [] if params.ignore_eos else sorted(
            self.tokenizer.eos_token_ids - {eos} - set(params.stop_token_ids))
        params = dataclasses.replace(params, max_tokens=max_tokens,
                                     stop_token_ids=[*params.stop_token_ids, *extra_stops])
        # A request continued from another engine (prefill/decode disaggregation) arrives with
        # the token(s) that engine already generated: they are its first outputs here too.
        first_ids = list((kv_transfer_params or {}).get("first_token_ids") or [])
        if first_ids and (params.n != 1 or max(first_ids) >= self.vocab_size
                          or min(first_ids) < 0 or len(first_ids) >= max_tokens):
            raise ValueError("kv_transfer_params.first_token_ids needs n=1, ids in the "
                             "vocabulary and room for more tokens")
        arrival = time.monotonic()
        sequences = []
        for i in range(params.n):
            child_params = params
            if params.n > 1 and params.seed is not None:
                child_params = dataclasses.replace(params, seed=params.seed + i)
            child_id = request_id if params.n == 1 else f"{request_id}#{i}"
            sequences.append(Request(child_id, token_ids, child_params, arrival_time=arrival,
                                     priority=priority, eos_token_id=eos,
                                     kv_transfer_params=kv_transfer_params,
                                     output_token_ids=list(first_ids)))
        return ProcessedRequest(request_id, text, token_ids, params, sequences)

    def _validate(self, token_ids: list[int], params: SamplingParams) -> None:
        if not token_ids:
            raise ValueError("the prompt is empty")
        if min(token_ids) < 0 or max(token_ids) >= self.vocab_size:
            raise ValueError(f"prompt token ids must be in [0, {self.vocab_size})")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(token_ids)} tokens, but this server's context "
                             f"limit is max_model_len={self.max_model_len} tokens, and at least "
                             "one must be left to generate")
        if params.max_tokens is not None and len(token_ids) + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"max_tokens={params.max_tokens} plus the prompt's {len(token_ids)} tokens exceed "
                f"this server's context limit max_model_len={self.max_model_len}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > self.vocab_size:
                raise ValueError(f"{name} must be <= the vocabulary size {self.vocab_size}")
        if any(not 0 <= t < self.vocab_size for t in params.stop_token_ids):
            raise ValueError(f"stop_token_ids must be in [0, {self.vocab_size})")
        if params.structured_outputs is not None:
            # Parse the schema, regex or grammar now (cheap; compiling it against the
            # vocabulary is not, and happens off the engine thread): a bad one is the
            # client's 400, not a failed request later.
            grammar_of(params.structured_outputs, self.config.structured_outputs)

    # ------------------------------------------------------------------------- requests
    def add_processed(self, processed: ProcessedRequest) -> None:
        first = processed.sequences[0]
        params = first.kv_transfer_params or {}
        self.output_processor.add_request(
            processed.request_id, [r.request_id for r in processed.sequences],
            processed.prompt, processed.prompt_token_ids, processed.params,
            initial_output_ids=first.output_token_ids,
            # The orchestrator that ran the prefill streamed its token already.
            emit_initial=not params.get("first_token_sent", False),
            continues_elsewhere=bool(params.get("do_remote_decode")))
        for request in processed.sequences:
            self.core.add_request(request)

    def add_request(self, request_id: str, prompt: str | list[int],
                    params: SamplingParams | None = None, priority: int = 0) -> None:
        self.add_processed(self.process_inputs(request_id, prompt, params, priority))

    def abort_request(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.core.abort_requests(self.output_processor.abort(request_id))

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests() or self.output_processor.has_unfinished()

    def has_work(self) -> bool:
        """Whether `step()` can make progress now: unfinished requests, except those a pause
        holds back or that wait for a slot idle sessions hold (see `Scheduler.has_work`)."""
        return self.core.has_work()

    def request_counts(self) -> tuple[int, int]:
        """(running, waiting) requests now."""
        return self.core.request_counts()

    # --------------------------------------------------------------------------- pausing
    def pause(self, mode: PauseState = PauseState.PAUSED_NEW) -> None:
        """See `PauseState`; takes effect from the next step."""
        self.core.pause(mode)

    def resume(self) -> None:
        self.core.resume()

    def is_paused(self) -> bool:
        return self.core.is_paused()

    @property
    def pause_state(self) -> PauseState:
        return self.core.pause_state

    # ----------------------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        core_out = self.core.step()
        if core_out.scheduler_stats is not None:
            self.last_stats = core_out.scheduler_stats
            self._add_to_totals(core_out.scheduler_stats)
        outputs, to_finish = self.output_processor.process(core_out.outputs)
        if to_finish:  # stop strings: free those sequences now, not after max_tokens
            self.core.finish_requests(to_finish, RequestStatus.FINISHED_STOPPED)
        return outputs

    def check_health(self) -> None:
        self.core.check_health()

    def kv_cache_blocks(self) -> tuple[int, int]:
        """(free blocks, total blocks) of the KV cache now."""
        return self.core.kv_cache_blocks()

    def _add_to_totals(self, stats: SchedulerStats) -> None:
        totals = self.totals
        for name in _COUNTERS:
            setattr(totals, name, getattr(totals, name) + getattr(stats, name))
        per_position = totals.num_accepted_tokens_per_pos
        for pos, count in enumerate(stats.num_accepted_tokens_per_pos):
            if pos == len(per_position):
                per_position.append(0)
            per_position[pos] += count

    def shutdown(self) -> None:
        self.core.shutdown()


_COUNTERS = ("prefix_cache_queries", "prefix_cache_hits", "num_preemptions", "num_drafts",
             "num_draft_tokens", "num_accepted_tokens", "kv_transfer_bytes",
             "kv_transfer_seconds", "kv_transfer_failures")
