"""LLMEngine: text in, text deltas out, around one EngineCore (synchronous)."""

from __future__ import annotations

import logging
import time

from tokenflow.config import EngineConfig
from tokenflow.replica.engine.engine import EngineCore
from tokenflow.replica.engine.input_processor import InputProcessor, ProcessedRequest
from tokenflow.replica.engine.output_processor import OutputProcessor, RequestOutput
from tokenflow.replica.loading.resolve import resolve_model
from tokenflow.scheduler import PauseState, RequestStatus, SamplingParams, SchedulerStats

logger = logging.getLogger(__name__)


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
        self.input_processor = InputProcessor(self.tokenizer, self.max_model_len,
                                              self.vocab_size, config.structured_outputs)
        self.last_stats = SchedulerStats()
        # Counters summed over every step since start (gauges are last_stats's).
        self.totals = SchedulerStats()

    # --------------------------------------------------------------------------- inputs
    def process_inputs(self, request_id: str, prompt: str | list[int],
                       params: SamplingParams | None = None, priority: int = 0,
                       kv_transfer_params: dict | None = None) -> ProcessedRequest:
        """See `InputProcessor.process`."""
        return self.input_processor.process(request_id, prompt, params, priority,
                                            kv_transfer_params)

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
