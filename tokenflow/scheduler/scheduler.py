"""The token-budget scheduler: one rule, no prefill or decode phase."""

from __future__ import annotations

import enum
from collections.abc import Iterable

from tokenflow.config import CacheConfig, KVOffloadConfig, KVTransferConfig, SchedulerConfig
from tokenflow.kv import KVCacheBlock, KVCacheManager, extend_block_hashes
from tokenflow.kv.connector import (
    combine_schedulers,
    create_offload_scheduler,
    create_scheduler_connector,
)
from tokenflow.kv.events import KVCacheEvent
from tokenflow.kv.manager import hash_keys
from tokenflow.scheduler.engine_output import EngineCoreOutput, EngineCoreOutputs, SchedulerStats
from tokenflow.scheduler.grammar import GrammarBackend
from tokenflow.scheduler.lora import LoRAAdapter, LoRASlots
from tokenflow.scheduler.pause import PauseState
from tokenflow.scheduler.queue import create_request_queue
from tokenflow.scheduler.remote_kv import RemoteKV
from tokenflow.scheduler.request import WAITING_FOR_SOMETHING, Request, RequestStatus
from tokenflow.scheduler.runner_output import ModelRunnerOutput
from tokenflow.scheduler.sched_output import (
    CachedRequestData,
    GrammarBitmask,
    NewRequestData,
    SchedulerOutput,
)
from tokenflow.scheduler.sessions import Sessions
from tokenflow.scheduler.stop import check_stop, first_full_check


class _Admission(enum.Enum):
    ADMITTED = enum.auto()
    FAILED = enum.auto()  # no budget or no blocks now
    PARKED = enum.auto()  # waits for its prompt KV from another engine


class _StepPlan:
    """What one `schedule()` call has decided so far (scratch state of a single step)."""

    __slots__ = ("budget", "cached", "new_reqs", "num_scheduled", "preempted", "spec")

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.num_scheduled: dict[str, int] = {}
        self.new_reqs: list[NewRequestData] = []
        self.cached = CachedRequestData()
        self.spec: dict[str, list[int]] = {}
        self.preempted: set[str] = set()


class Scheduler:
    """Owns the waiting queue, the running list and the KV cache manager of one engine.

    Workers never see `Request` objects: each step they get a `SchedulerOutput` of deltas.
    `max_model_len` is the engine's one context limit (resolved by the executor, never
    recomputed here); the engine validates prompts against it before they arrive.
    `structured_outputs` (the engine's grammar manager) is needed for requests with a
    constraint on their output; they wait for their grammar in
    WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR without holding up the queue.
    `pause` holds back admission (PAUSED_NEW) or all scheduling (PAUSED_ALL): `PauseState`.
    Finished turns of streaming-input sessions keep their blocks in `sessions` (`Sessions`).
    With LoRA (`enable_lora(max_loras)`), the running requests use at most `max_loras`
    adapters, and `lora` (`LoRASlots`) places each step's adapters in the workers' slots.
    """

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        num_blocks: int,
        max_model_len: int,
        kv_transfer: KVTransferConfig | None = None,
        num_stages: int = 1,
        structured_outputs: GrammarBackend | None = None,
        kv_events_medium: str | None = None,
        kv_offload: KVOffloadConfig | None = None,
        num_offload_blocks: int = 0,
    ) -> None:
        self.config = scheduler_config
        self.block_size = cache_config.block_size
        self.kv = KVCacheManager(num_blocks, cache_config.block_size,
                                 cache_config.enable_prefix_caching, kv_events_medium)
        self.max_model_len = max_model_len
        # KV transfer (disaggregated prefill/decode), when a connector is configured; every
        # pipeline stage moves its own layers, so a transfer ends when all of them reported.
        transfer = None if kv_transfer is None else create_scheduler_connector(
            kv_transfer, block_size=self.block_size, num_stages=num_stages,
            get_block_ids=self.kv.get_block_ids)
        # The offload tier: blocks evicted from the pool are kept in CPU memory or on disk,
        # and a prefix hit that runs out in the pool goes on there (loaded like a transfer).
        self.offload = None
        if kv_offload is not None and cache_config.enable_prefix_caching:
            self.offload = create_offload_scheduler(
                kv_offload, block_size=self.block_size, num_stages=num_stages,
                num_slots=num_offload_blocks, take_evicted=self.kv.pool.take_evicted,
                record_events=kv_events_medium is not None)
            if self.offload is not None:
                self.kv.pool.record_evictions()
        connector = combine_schedulers(transfer, self.offload)
        self.remote = RemoteKV(connector, self.kv) if connector is not None else None
        self.structured = structured_outputs
        self._grammar_req_ids: set[str] = set()  # live requests with a grammar
        self.policy = scheduler_config.policy
        self.waiting = create_request_queue(self.policy)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.finished_req_ids: set[str] = set()
        self._pending_outputs: list[EngineCoreOutput] = []
        self._stats = SchedulerStats()
        self._pause_state = PauseState.UNPAUSED
        self.sessions = Sessions(self.kv, scheduler_config.session_idle_timeout_s)
        self.lora: LoRASlots | None = None  # `enable_lora`

    def enable_lora(self, max_loras: int) -> None:
        """Serve LoRA adapters in `max_loras` worker slots (before any request arrives)."""
        self.lora = LoRASlots(max_loras)

    # ----------------------------------------------------------------- requests in and out
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        if request.num_tokens >= self.max_model_len:
            self._ignore(request, f"prompt of {request.num_tokens} tokens leaves no room to "
                         f"generate within max_model_len={self.max_model_len}")
            return
        params = request.sampling_params
        length_limit = min(params.max_tokens or self.max_model_len,
                           self.max_model_len - request.num_prompt_tokens)
        request.full_check_from = first_full_check(params, length_limit)
        stops = set(params.stop_token_ids)
        if request.eos_token_id is not None and not params.ignore_eos:
            stops.add(request.eos_token_id)
        request.stop_token_set = frozenset(stops)
        if request.lora is not None and self.lora is None:
            raise ValueError("this engine serves no LoRA adapters (lora.max_loras is 0)")
        if params.structured_outputs is not None:
            if self.structured is None:
                raise ValueError("this engine has no structured output support")
            request.status = RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR
            self.structured.submit(request)  # compiles in the background
            self._grammar_req_ids.add(request.request_id)
        if self.kv.enable_caching:
            # Hash the prompt's full blocks once, on arrival, not inside a scheduling step.
            extend_block_hashes(request.block_hashes, request.all_token_ids, self.block_size,
                                hash_keys(request))
        self.requests[request.request_id] = request
        if params.session_id is not None and self.sessions.resume(request):
            self.waiting.prepend(request)  # its session held a slot: it goes first, as resumed
        else:
            self.waiting.add(request)

    def _fail_waiting(self, request: Request, reason: str) -> None:
        """End a waiting request that can never run (its grammar did not compile)."""
        request.status = RequestStatus.FINISHED_ERROR
        request.error = reason
        self._pending_outputs.append(EngineCoreOutput(
            request.request_id, [], finish_reason="error", error=reason))
        self._free(request)

    def _ignore(self, request: Request, reason: str) -> None:
        # Unreachable through the engine, which rejects such prompts first: a guard for
        # direct users of the scheduler.
        request.status = RequestStatus.FINISHED_IGNORED
        request.error = reason
        self._pending_outputs.append(EngineCoreOutput(
            request.request_id, [], finish_reason="length", error=reason))

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> None:
        """Finish requests from any state (abort, or a stop string seen by the detokenizer),
        freeing everything they hold. Unknown or already finished ids are ignored."""
        assert RequestStatus.is_finished(status)
        found = [self.requests[r] for r in request_ids if r in self.requests]
        if not found:
            return
        running = {id(r) for r in found if r.status == RequestStatus.RUNNING}
        if running:
            self.running = [r for r in self.running if id(r) not in running]
        waiting = [r for r in found if r.status != RequestStatus.RUNNING]
        if waiting:
            self.waiting.remove_many(waiting)
        for request in found:
            request.status = status
            if self.remote is not None and self.remote.on_abort(request):
                # A worker may still write into its blocks: they are freed when the load ends.
                del self.requests[request.request_id]
                continue
            self._free(request)

    def _free(self, request: Request, out: EngineCoreOutput | None = None) -> None:
        """Forget a finished request and free its blocks (or hold them for a consumer, or for
        its session's next turn)."""
        if Sessions.keeps(request):
            self.sessions.park(request)
        elif self.remote is None or not self.remote.on_finished(request, out):
            self.kv.free(request)
        self.finished_req_ids.add(request.request_id)
        del self.requests[request.request_id]
        if request.lora is not None:
            self._count_lora(request)
        if request.grammar is not None:
            self._grammar_req_ids.discard(request.request_id)

    def _count_lora(self, request: Request) -> None:
        name, stats = request.lora.name, self._stats
        stats.lora_requests[name] = stats.lora_requests.get(name, 0) + 1
        stats.lora_generated_tokens[name] = (stats.lora_generated_tokens.get(name, 0)
                                             + request.num_output_tokens)

    def update_draft_token_ids(self, draft_token_ids: dict[str, list[int]]) -> None:
        """Attach drafted tokens to decoding requests; they are verified next step."""
        for req_id, drafts in draft_token_ids.items():
            request = self.requests.get(req_id)
            # Only a decoding request (all but its newest token computed) can verify drafts.
            if (request is not None and request.status == RequestStatus.RUNNING
                    and request.num_computed_tokens == request.num_tokens - 1):
                if request.grammar is not None:  # only drafts its grammar allows
                    drafts = self.structured.valid_drafts(request, drafts)
                request.spec_token_ids = list(drafts)

    def has_unfinished_requests(self) -> bool:
        """Requests to run, outputs to deliver, KV transfers to see through, or an idle
        session to expire (the next `schedule()` frees it; idle sessions are no work)."""
        return (bool(self.requests) or bool(self._pending_outputs)
                or (self.remote is not None and self.remote.has_pending())
                or self.sessions.next_expiry_due())

    def has_work(self) -> bool:
        """Whether a step can make progress now. Unlike `has_unfinished_requests`, requests that
        a pause holds back, or that wait for a slot idle sessions hold, do not count, so an
        engine loop sleeps instead of spinning on them."""
        state = self._pause_state
        if self._pending_outputs or self.has_pending_transfers() or self.sessions.next_expiry_due():
            return True
        # Idle sessions holding every slot: nothing runs and nothing may be admitted.
        if state is PauseState.PAUSED_ALL or len(self.sessions) >= self.config.active_seqs_limit:
            return False
        if state is PauseState.UNPAUSED:
            return self.has_unfinished_requests()
        return bool(self.running) or any(not self._is_new(r) for r in self.waiting)

    def request_counts(self) -> tuple[int, int]:
        """(running, waiting) requests now."""
        return len(self.running), len(self.waiting)

    def has_pending_transfers(self) -> bool:
        """KV loads or held blocks the workers must keep reporting on."""
        return self.remote is not None and self.remote.has_pending()

    def kv_cache_blocks(self) -> tuple[int, int]:
        """(free blocks, total blocks) of the KV cache now."""
        return self.kv.num_free_blocks, self.kv.num_blocks

    def check_kv_integrity(self) -> None:
        """Raise if the KV cache's block accounting is broken (see `KVCacheManager`)."""
        self.kv.check_integrity()

    # --------------------------------------------------------------------------- pausing
    @property
    def pause_state(self) -> PauseState:
        return self._pause_state

    def pause(self, state: PauseState = PauseState.PAUSED_NEW) -> None:
        """Hold back admission (PAUSED_NEW) or all scheduling (PAUSED_ALL) from the next
        `schedule()` on; another pause replaces the state, `resume` ends it."""
        if state is PauseState.UNPAUSED:
            raise ValueError("pause needs PAUSED_NEW or PAUSED_ALL; resume() unpauses")
        self._pause_state = state

    def resume(self) -> None:
        """Schedule by the normal rule again; requests that arrived meanwhile are admitted."""
        self._pause_state = PauseState.UNPAUSED

    def _is_new(self, request: Request) -> bool:
        """Never admitted: what PAUSED_NEW holds back. A preempted (or restarted) request ran
        before; one that holds blocks (its prompt KV loaded, or loading, from another engine)
        was admitted."""
        return (request.num_cached_tokens < 0
                and not self.kv.num_blocks_held(request.request_id))

    def can_restart_all(self) -> bool:
        """Whether `restart_all` can run: no KV connector (whose transfers live in workers),
        or only the offload tier with no load in flight (it starts over empty)."""
        return self.remote is None or (self.remote.connector is self.offload
                                       and not self.remote.has_pending())

    def restart_all(self, reason: str) -> None:
        """The workers lost every request and all KV (a pipeline rebuilt after a stage died):
        each unfinished request starts over, ahead of those that were waiting, sent to the
        workers as new with the tokens it has (so greedy ones go on token-exactly), and the
        prefix cache and parked sessions, whose KV is gone, are forgotten. A request whose
        prompt logprobs were sent already cannot start over (they would be sent twice): it
        fails with `reason`. Not with a KV connector, whose transfers lived in the workers."""
        if not self.can_restart_all():
            raise RuntimeError("requests cannot restart with a KV connector")
        self.sessions.drop_all()
        requests = list(self.running) + list(self.waiting)
        self.running = []
        self.waiting.remove_many(requests)
        restart: list[Request] = []
        for request in requests:
            if (request.sampling_params.prompt_logprobs is not None
                    and request.num_output_tokens > 0):
                self._fail_waiting(request, reason)
                continue
            self.kv.free(request)
            if request.status in (RequestStatus.RUNNING, RequestStatus.PREEMPTED):
                request.status = RequestStatus.WAITING  # sent as new: the workers know nothing
            request.num_computed_tokens = 0
            request.num_output_placeholders = 0
            request.num_unsent_tokens = 0
            request.spec_token_ids = []
            restart.append(request)
        for request in reversed(restart):
            self.waiting.prepend(request)
        self.finished_req_ids.clear()  # nothing to tell workers that never knew them
        if self.offload is not None:
            self.offload.reset()  # the new workers' tiers are empty
        if self.lora is not None:
            self.lora.reset()  # and their LoRA slots
        if not self.kv.reset_prefix_cache():
            raise RuntimeError("KV blocks are still held after every request let go of them")

    # ------------------------------------------------------------------------ scheduling
    def schedule(self) -> SchedulerOutput:
        """One step of the rule: every request's `num_computed_tokens` catches up with its
        `num_tokens_with_spec` (plus output placeholders), inside one budget of
        `max_num_batched_tokens` tokens.

        Running requests go first, in queue order; each takes what it still lacks, capped by
        the long-prefill threshold, the budget left and the model length. A request with
        nothing to compute is skipped, not a reason to stop. When the KV cache has no block
        for a running request, the policy's victim is preempted (recompute from scratch) until
        one fits. Only if nothing was preempted are waiting requests then admitted, in policy
        order, with their prefix-cache hits counted as computed, while the budget and
        `max_num_active_seqs` allow. Decode, prefill chunks and speculative tokens are all the
        same thing here: tokens not yet computed.

        Idle streaming-input sessions hold a slot of `max_num_active_seqs` each, and their
        blocks until a request that needs blocks evicts them or they expire.

        Paused, the step has no budget at all (PAUSED_ALL: it still tells the workers of
        finished requests), or admits only requests that were admitted before (PAUSED_NEW).
        """
        if self.remote is not None:
            for request in self.remote.before_schedule():
                self.kv.free(request)  # held for a consumer, or aborted mid-load: now free
        self.sessions.expire()
        budget = (0 if self._pause_state is PauseState.PAUSED_ALL
                  else self.config.max_num_batched_tokens)
        plan = _StepPlan(budget)
        self._schedule_running(plan)
        if not plan.preempted:
            self._schedule_waiting(plan)
        out = SchedulerOutput(
            scheduled_new_reqs=plan.new_reqs,
            scheduled_cached_reqs=plan.cached,
            num_scheduled_tokens=plan.num_scheduled,
            total_num_scheduled_tokens=budget - plan.budget,
            scheduled_spec_decode_tokens=plan.spec,
            preempted_req_ids=plan.preempted,
            finished_req_ids=self.finished_req_ids,
        )
        self.finished_req_ids = set()
        if self.remote is not None:
            out.kv_connector_metadata = self.remote.build_meta(out)
        if self._grammar_req_ids:
            out.grammar_bitmask = self._grammar_bitmask(out)
        if self.lora is not None:
            out.lora_loads = self._lora_loads(out)
        return out

    def _lora_loads(self, out: SchedulerOutput) -> dict[int, LoRAAdapter] | None:
        """Slots for the adapters this step runs: what the workers must load first."""
        requests = self.requests
        adapters = [a for a in (requests[r].lora for r in out.num_scheduled_tokens) if a]
        if not adapters:
            return None
        slots = self.lora
        loads, evictions = slots.num_loads, slots.num_evictions
        assigned = slots.assign(adapters)
        self._stats.lora_loads += slots.num_loads - loads
        self._stats.lora_evictions += slots.num_evictions - evictions
        return assigned or None

    def _grammar_bitmask(self, out: SchedulerOutput) -> GrammarBitmask | None:
        """Allowed tokens for every structured request that samples this step (its chunk
        reaches its last token), with the drafts it verifies."""
        rows = []
        for req_id in self._grammar_req_ids:
            if req_id in out.num_scheduled_tokens:
                request = self.requests[req_id]
                if request.num_computed_tokens >= request.num_tokens:
                    rows.append((request, out.scheduled_spec_decode_tokens.get(req_id, [])))
        return self.structured.bitmask(rows) if rows else None

    def _schedule_running(self, plan: _StepPlan) -> None:
        # The hot loop of the engine: locals and inlined arithmetic on purpose.
        allocate = self.kv.allocate_slots
        add_id, add_resumed, add_tokens, add_blocks, add_computed = plan.cached.column_appenders()
        num_scheduled = plan.num_scheduled
        threshold = self.config.long_prefill_token_threshold
        max_position = self.max_model_len - 1
        running_status = RequestStatus.RUNNING
        budget = plan.budget
        # Iterate a copy: preemption removes victims from self.running as we go.
        for request in self.running[:]:
            if budget <= 0:
                break
            if request.status != running_status:
                continue  # preempted earlier in this step
            num_computed = request.num_computed_tokens
            all_tokens = request.all_token_ids
            num_tokens = len(all_tokens)
            num_new = (num_tokens + len(request.spec_token_ids)
                       + request.num_output_placeholders - num_computed)
            if 0 < threshold < num_new:
                num_new = threshold
            if num_new > budget:
                num_new = budget
            if num_new > max_position - num_computed:
                num_new = max_position - num_computed
            if num_new <= 0:
                continue
            new_blocks = allocate(request, num_new)
            if new_blocks is None:
                plan.budget = budget
                new_blocks = self._make_room(request, num_new, plan)
                budget = plan.budget
                if new_blocks is None:
                    continue  # `request` itself was preempted
            req_id = request.request_id
            num_scheduled[req_id] = num_new
            budget -= num_new
            num_prompt = request.num_prompt_tokens
            start = num_computed
            if request.num_unsent_tokens:  # accepted drafts the workers never saw as outputs
                start -= request.num_unsent_tokens
                request.num_unsent_tokens = 0
            add_id(req_id)
            add_resumed(False)
            add_tokens(all_tokens[start if start > num_prompt else num_prompt:])
            add_blocks([b.block_id for b in new_blocks] if new_blocks else [])
            add_computed(num_computed)
            request.num_computed_tokens = num_computed + num_new
            if request.spec_token_ids and num_computed + num_new > num_tokens:
                plan.spec[req_id] = request.spec_token_ids[:num_computed + num_new - num_tokens]
        plan.budget = budget

    def _make_room(self, request: Request, num_new: int, plan: _StepPlan
                   ) -> list[KVCacheBlock] | None:
        """Evict idle sessions, then free the blocks of waiting session turns, then preempt
        victims, until `request` gets its slots (returns the new blocks) or is itself the
        victim (returns None)."""
        while self.sessions.evict_oldest() or self._release_waiting_turn():
            new_blocks = self.kv.allocate_slots(request, num_new)
            if new_blocks is not None:
                return new_blocks
        while True:
            victim = self.running[self._victim_index()]
            self._preempt(victim, plan)
            if victim is request:
                return None
            new_blocks = self.kv.allocate_slots(request, num_new)
            if new_blocks is not None:
                return new_blocks

    def _release_waiting_turn(self, keep: Request | None = None) -> bool:
        """Free the blocks a waiting session turn (not `keep`) took over from its session (it
        computes them again when it runs), the last in line first; False if no waiting turn
        holds any. Such blocks are a cache, as a parked session's are: a request that needed
        them (running, or first in line) would otherwise wait for them forever."""
        for request in reversed(list(self.waiting)):
            if (request is not keep and request.status == RequestStatus.WAITING
                    and request.sampling_params.session_id is not None
                    and not request.kv_transfer_params
                    and self.kv.num_blocks_held(request.request_id)):
                self.kv.free(request)
                request.num_computed_tokens = 0
                return True
        return False

    def _victim_index(self) -> int:
        if self.policy == "priority":
            running = self.running
            return max(range(len(running)),
                       key=lambda i: (running[i].priority, running[i].arrival_time))
        return len(self.running) - 1

    def _preempt(self, victim: Request, plan: _StepPlan) -> None:
        self.running.remove(victim)
        req_id = victim.request_id
        if req_id in plan.num_scheduled:  # scheduled earlier in this step: give it all back
            plan.budget += plan.num_scheduled.pop(req_id)
            plan.spec.pop(req_id, None)
            plan.cached.remove(req_id)
        self.kv.free(victim)
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        victim.num_unsent_tokens = 0  # a resumed request is sent all its tokens again
        victim.spec_token_ids = []
        victim.num_preemptions += 1
        self._stats.num_preemptions += 1
        plan.preempted.add(req_id)
        self.waiting.prepend(victim)

    def _schedule_waiting(self, plan: _StepPlan) -> None:
        skipped: list[Request] = []
        max_running = self.config.active_seqs_limit - len(self.sessions)
        paused_new = self._pause_state is PauseState.PAUSED_NEW
        # After a failed admission only requests that already hold their blocks may pass (a
        # loaded request must not wait behind one that cannot get blocks: that deadlocks).
        blocked = False
        # LoRA: adapters the running requests use; a request whose adapter would make one too
        # many waits, keeping its place (vLLM's rule).
        loras = ({r.lora for r in self.running if r.lora is not None}
                 if self.lora is not None else None)
        while self.waiting and plan.budget > 0 and len(self.running) < max_running:
            request = self.waiting.peek()
            if request.status == RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR:
                try:
                    if self.structured.ready(request):
                        request.status = RequestStatus.WAITING
                except Exception as exc:  # noqa: BLE001 - whatever compilation raised
                    self._fail_waiting(self.waiting.pop(), str(exc))
                    continue
            if request.status in WAITING_FOR_SOMETHING or (
                    blocked and not self.kv.num_blocks_held(request.request_id)) or (
                    paused_new and self._is_new(request)) or (
                    loras is not None and request.lora is not None
                    and request.lora not in loras and len(loras) >= self.lora.max_loras):
                skipped.append(self.waiting.pop())  # keeps its place: put back below
                continue
            outcome = self._admit(request, plan)
            if outcome is _Admission.FAILED:
                if self.remote is None:
                    break
                blocked = True
            if outcome is not _Admission.ADMITTED:
                skipped.append(self.waiting.pop())
                continue
            self.waiting.pop()
            if loras is not None and request.lora is not None:
                loras.add(request.lora)
        for request in reversed(skipped):
            self.waiting.prepend(request)

    def _admit(self, request: Request, plan: _StepPlan) -> _Admission:
        holds_blocks = self.kv.num_blocks_held(request.request_id) > 0
        hit_blocks, num_hit = self._computed_so_far(request, holds_blocks)
        if self.remote is not None and not holds_blocks and (
                request.kv_transfer_params or self._may_hit_tier(request)):
            parked = self.remote.try_park(request, hit_blocks, num_hit)
            if parked is not False:
                return _Admission.PARKED if parked else _Admission.FAILED
        num_new = request.num_tokens - num_hit
        threshold = self.config.long_prefill_token_threshold
        if 0 < threshold < num_new:
            num_new = threshold
        if num_new > plan.budget:
            if not self.config.enable_chunked_prefill:
                return _Admission.FAILED
            num_new = plan.budget
        while (self.kv.allocate_slots(request, num_new) if holds_blocks else
               self.kv.allocate_slots(request, num_new, num_hit, hit_blocks)) is None:
            # Idle sessions, then other waiting turns' session KV, give way to live requests.
            if not (self.sessions.evict_oldest() or self._release_waiting_turn(request)):
                return _Admission.FAILED
        if not holds_blocks:
            self.kv.record_prefix_lookup(request.num_tokens, num_hit)
        self._start_running(request, plan, num_hit, num_new)
        return _Admission.ADMITTED

    def _may_hit_tier(self, request: Request) -> bool:
        # Prompt logprobs need every prompt position computed (see `_computed_so_far`).
        return self.offload is not None and request.sampling_params.prompt_logprobs is None

    def _computed_so_far(self, request: Request, holds_blocks: bool
                         ) -> tuple[list[KVCacheBlock], int]:
        """Prefix-cache hits (blocks, tokens) a request starts from."""
        if holds_blocks:
            # Its prompt KV was loaded from another engine (or is to be recomputed, if that
            # failed) into blocks it already holds: no lookup.
            return [], request.num_computed_tokens
        if request.sampling_params.prompt_logprobs is None:
            return self.kv.get_computed_blocks(request)
        # Prompt logprobs need logits at every prompt position, so such a request computes its
        # whole prompt (as vLLM does); its blocks still join the cache for others.
        return [], 0

    def _start_running(self, request: Request, plan: _StepPlan, num_hit: int,
                       num_new: int) -> None:
        resumed = request.status == RequestStatus.PREEMPTED
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_hit + num_new
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_hit
        self.running.append(request)
        req_id = request.request_id
        plan.num_scheduled[req_id] = num_new
        plan.budget -= num_new
        block_ids = self.kv.get_block_ids(req_id)
        if resumed:
            start = max(num_hit, request.num_prompt_tokens)
            plan.cached.append(req_id, True, request.all_token_ids[start:], block_ids, num_hit)
        else:
            plan.new_reqs.append(NewRequestData(
                req_id, request.prompt_token_ids, request.sampling_params, block_ids, num_hit,
                request.eos_token_id, request.output_token_ids[:], request.lora))
            if self.remote is not None:
                self.remote.note_admitted(request)

    # ------------------------------------------------------------------------- results
    def update_from_output(
        self, sched_out: SchedulerOutput, runner_out: ModelRunnerOutput
    ) -> EngineCoreOutputs:
        """Append sampled tokens, roll back rejected drafts, run stop checks, free finished
        requests and return every request's delta."""
        outputs: list[EngineCoreOutput] = []
        if self.remote is not None:
            self.remote.after_step(runner_out.kv_connector_outputs)
        requests = self.requests
        spec = sched_out.scheduled_spec_decode_tokens
        logprobs = runner_out.logprobs
        prompt_logprobs = runner_out.prompt_logprobs
        running_status = RequestStatus.RUNNING
        max_model_len = self.max_model_len
        any_stopped = False
        for req_id, sampled in zip(runner_out.req_ids, runner_out.sampled_token_ids, strict=True):
            request = requests.get(req_id)
            if request is None or request.status != running_status:
                continue  # finished or preempted while this step ran
            if spec and req_id in spec:
                self._account_spec(request, len(spec[req_id]), len(sampled))
            plp = prompt_logprobs.get(req_id) if prompt_logprobs else None
            if not sampled and plp is None:
                continue
            request.output_token_ids.extend(sampled)
            request.all_token_ids.extend(sampled)
            out = EngineCoreOutput(req_id, sampled,
                                   logprobs.get(req_id) if logprobs else None, plp,
                                   None, None, request.num_cached_tokens)
            grammar_done = (request.grammar is not None and bool(sampled)
                            and self.structured.accept(request, sampled))
            # Cheap pre-check; the full check (min_tokens, repetition, trimming) only when it
            # may stop. Repetition detection costs nothing here: it lowers full_check_from.
            if sampled and (len(sampled) > 1 or sampled[0] in request.stop_token_set
                            or len(request.output_token_ids) >= request.full_check_from):
                num_keep = check_stop(request, len(sampled), max_model_len)
                if num_keep is not None:
                    self._finish_stopped(request, out, len(sampled) - num_keep)
                    any_stopped = True
            if grammar_done and request.status == running_status:
                # Complete under its grammar, with nothing that may follow (ignore_eos, or
                # a grammar that ends without a stop token): a normal stop.
                request.status = RequestStatus.FINISHED_STOPPED
                self._finish_stopped(request, out, 0)
                any_stopped = True
            outputs.append(out)
        if any_stopped:
            self.running = [r for r in self.running if r.status == running_status]
        if self._pending_outputs:
            outputs.extend(self._pending_outputs)
            self._pending_outputs = []
        return EngineCoreOutputs(outputs, self.make_stats())

    def _account_spec(self, request: Request, num_drafts: int, num_sampled: int) -> None:
        num_accepted = max(num_sampled - 1, 0)
        request.num_computed_tokens -= num_drafts - num_accepted
        request.num_unsent_tokens = num_accepted
        request.spec_token_ids = []
        stats = self._stats
        stats.num_drafts += 1
        stats.num_draft_tokens += num_drafts
        stats.num_accepted_tokens += num_accepted
        per_position = stats.num_accepted_tokens_per_pos
        if len(per_position) < num_drafts:
            per_position.extend([0] * (num_drafts - len(per_position)))
        for pos in range(num_accepted):
            per_position[pos] += 1

    def _finish_stopped(self, request: Request, out: EngineCoreOutput, num_trim: int) -> None:
        """Drop the `num_trim` tokens sampled after the stop, report why, and free."""
        if num_trim:
            request.trim_output(request.num_output_tokens - num_trim)
            out.new_token_ids = out.new_token_ids[:-num_trim]
            if out.new_logprobs:
                out.new_logprobs = out.new_logprobs[:-num_trim]
        out.finish_reason = RequestStatus.finish_reason(request.status)
        out.stop_reason = request.stop_reason
        self._free(request, out)

    # --------------------------------------------------------------------------- stats
    def make_stats(self) -> SchedulerStats:
        """Gauges now, and counters since the previous call."""
        stats, self._stats = self._stats, SchedulerStats()
        stats.num_running_reqs = len(self.running)
        stats.num_waiting_reqs = len(self.waiting)
        stats.kv_cache_usage = self.kv.usage
        stats.prefix_cache_queries, stats.prefix_cache_hits = self.kv.take_prefix_cache_stats()
        if self.remote is not None:
            stats.num_waiting_for_remote_kvs = self.remote.num_waiting
            (stats.kv_transfer_bytes, stats.kv_transfer_seconds,
             stats.kv_transfer_failures) = self.remote.take_stats()
        if self.offload is not None:
            tier = self.offload.take_tier_stats()
            stats.kv_offload_hit_tokens = tier.hit_tokens
            stats.kv_offload_stored_blocks = tier.stored_blocks
            stats.kv_offload_failures = tier.failures
        return stats

    def reset_prefix_cache(self) -> bool:
        return self.kv.reset_prefix_cache()

    def take_kv_events(self) -> list[KVCacheEvent]:
        """The KV-cache events since the last call (the engine drains them once a step): the
        pool's, then the offload tier's."""
        events = self.kv.take_events()
        if self.offload is not None:
            events += self.offload.take_events()
        return events
