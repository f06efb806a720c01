"""Hypothesis: random interleavings of add / abort / step against a small KV cache, for the
synchronous scheduler and for the AsyncScheduler with two steps in flight (aborts then land
while a step runs); either must give every request the tokens the synchronous scheduler gives
it alone."""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tests.scheduler.utils import StepDriver, create_scheduler, fake_token, run_until_done
from tokenflow.scheduler import Request, RequestStatus, SamplingParams

PREFIXES = [[7] * 5, [1, 2, 3, 4, 5, 6, 7, 8, 9], []]


class SchedulerMachine(RuleBasedStateMachine):
    """Drives one scheduler and checks the step invariants after every rule."""

    async_scheduling = False

    @initialize(
        budget=st.integers(4, 96),
        max_num_seqs=st.integers(1, 6),
        num_blocks=st.integers(6, 40),
        block_size=st.sampled_from([2, 4, 8]),
        chunked=st.booleans(),
        caching=st.booleans(),
        policy=st.sampled_from(["fcfs", "priority"]),
        threshold=st.sampled_from([0, 0, 5]),
    )
    def setup(self, budget, max_num_seqs, num_blocks, block_size, chunked, caching, policy,
              threshold):
        self.kwargs = dict(
            max_num_batched_tokens=budget, max_num_seqs=max_num_seqs, num_blocks=num_blocks,
            block_size=block_size, enable_chunked_prefill=chunked,
            enable_prefix_caching=caching, policy=policy,
            long_prefill_token_threshold=threshold, max_model_len=256)
        self.scheduler = create_scheduler(**self.kwargs, async_scheduling=self.async_scheduling)
        self.driver = StepDriver(self.scheduler)
        self.specs: dict[str, tuple] = {}
        self.tokens: dict[str, list[int]] = {}
        self.finish: dict[str, str] = {}
        self.aborted: set[str] = set()
        self.counter = 0

    @rule(prefix=st.sampled_from(PREFIXES), suffix=st.lists(st.integers(0, 20), max_size=40),
          max_tokens=st.integers(1, 24), priority=st.integers(0, 3),
          stop_at=st.sampled_from([None, None, 0, 3, 7]))
    def add(self, prefix, suffix, max_tokens, priority, stop_at):
        prompt = prefix + suffix or [0]
        req_id = f"r{self.counter}"
        # A stop token: the one its output `stop_at` will be (if it gets that far).
        stops = [] if stop_at is None else [fake_token(req_id, len(prompt) + stop_at)]
        self.specs[req_id] = (prompt, max_tokens, priority, float(self.counter), stops)
        self.counter += 1
        self.scheduler.add_request(self._make(req_id))

    def _make(self, req_id: str) -> Request:
        prompt, max_tokens, priority, arrival, stops = self.specs[req_id]
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                                stop_token_ids=stops)
        return Request(req_id, prompt, params, arrival_time=arrival, priority=priority)

    @precondition(lambda self: self.scheduler.requests)
    @rule(data=st.data())
    def abort(self, data):
        req_id = data.draw(st.sampled_from(sorted(self.scheduler.requests)))
        self.scheduler.finish_requests([req_id], RequestStatus.FINISHED_ABORTED)
        self.aborted.add(req_id)

    @rule()
    def step(self):
        scheduler = self.scheduler
        _, outputs = self.driver.step()
        for out, _ in self.driver.in_flight:
            assert out.total_num_scheduled_tokens <= self.kwargs["max_num_batched_tokens"]
            assert out.total_num_scheduled_tokens == sum(out.num_scheduled_tokens.values())
        assert len(scheduler.running) <= self.kwargs["max_num_seqs"]
        for o in outputs.outputs:
            self.tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finish_reason is not None:
                self.finish[o.request_id] = o.finish_reason

    @invariant()
    def cache_is_consistent(self):
        if not hasattr(self, "scheduler"):
            return
        kv = self.scheduler.kv
        kv.check_integrity()
        for request in self.scheduler.running:
            needed = kv.blocks_needed(request.num_computed_tokens)
            assert kv.num_blocks_held(request.request_id) >= needed
        # A placeholder is a token a step in flight samples; only running requests have any.
        for request in self.scheduler.requests.values():
            limit = (len(self.driver.in_flight)
                     if request.status == RequestStatus.RUNNING else 0)
            assert 0 <= request.num_output_placeholders <= limit

    def teardown(self):
        if not hasattr(self, "scheduler"):
            return
        results = run_until_done(self.scheduler, self.driver, max_steps=5000,
                                 on_step=lambda s, out: s.kv.check_integrity())
        for req_id, res in results.items():
            self.tokens.setdefault(req_id, []).extend(res["tokens"])
            self.finish[req_id] = res["finish_reason"]
        assert self.scheduler.kv.num_free_blocks == self.scheduler.kv.num_blocks
        for req_id in self.specs:
            if req_id in self.aborted:
                continue
            assert req_id in self.finish, f"{req_id} never finished"
            alone = create_scheduler(**self.kwargs, async_scheduling=False)
            alone.add_request(self._make(req_id))
            expected = run_until_done(alone)[req_id]
            assert self.tokens.get(req_id, []) == expected["tokens"], req_id
            assert self.finish[req_id] == expected["finish_reason"]


SchedulerMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
TestSchedulerMachine = SchedulerMachine.TestCase


class AsyncSchedulerMachine(SchedulerMachine):
    async_scheduling = True


AsyncSchedulerMachine.TestCase.settings = SchedulerMachine.TestCase.settings
TestAsyncSchedulerMachine = AsyncSchedulerMachine.TestCase
