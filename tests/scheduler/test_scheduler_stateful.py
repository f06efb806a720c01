"""Hypothesis: random interleavings of add / abort / step against a small KV cache."""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tests.scheduler.utils import FakeRunner, create_scheduler, run_until_done
from tokenflow.scheduler import Request, RequestStatus, SamplingParams

PREFIXES = [[7] * 5, [1, 2, 3, 4, 5, 6, 7, 8, 9], []]


class SchedulerMachine(RuleBasedStateMachine):
    """Drives one scheduler and checks the step invariants after every rule."""

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
        self.scheduler = create_scheduler(**self.kwargs)
        self.runner = FakeRunner()
        self.specs: dict[str, tuple] = {}
        self.tokens: dict[str, list[int]] = {}
        self.finish: dict[str, str] = {}
        self.aborted: set[str] = set()
        self.counter = 0

    @rule(prefix=st.sampled_from(PREFIXES), suffix=st.lists(st.integers(0, 20), max_size=40),
          max_tokens=st.integers(1, 24), priority=st.integers(0, 3))
    def add(self, prefix, suffix, max_tokens, priority):
        prompt = prefix + suffix or [0]
        req_id = f"r{self.counter}"
        self.specs[req_id] = (prompt, max_tokens, priority, float(self.counter))
        self.counter += 1
        self.scheduler.add_request(self._make(req_id))

    def _make(self, req_id: str) -> Request:
        prompt, max_tokens, priority, arrival = self.specs[req_id]
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
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
        out = scheduler.schedule()
        assert out.total_num_scheduled_tokens <= self.kwargs["max_num_batched_tokens"]
        assert out.total_num_scheduled_tokens == sum(out.num_scheduled_tokens.values())
        assert len(scheduler.running) <= self.kwargs["max_num_seqs"]
        for o in scheduler.update_from_output(out, self.runner.execute_model(out)).outputs:
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

    def teardown(self):
        if not hasattr(self, "scheduler"):
            return
        results = run_until_done(self.scheduler, self.runner, max_steps=5000,
                                 on_step=lambda s, out: s.kv.check_integrity())
        for req_id, res in results.items():
            self.tokens.setdefault(req_id, []).extend(res["tokens"])
            self.finish[req_id] = res["finish_reason"]
        assert self.scheduler.kv.num_free_blocks == self.scheduler.kv.num_blocks
        for req_id in self.specs:
            if req_id in self.aborted:
                continue
            assert req_id in self.finish, f"{req_id} never finished"
            alone = create_scheduler(**self.kwargs)
            alone.add_request(self._make(req_id))
            expected = run_until_done(alone)[req_id]
            assert self.tokens.get(req_id, []) == expected["tokens"], req_id
            assert self.finish[req_id] == expected["finish_reason"]


SchedulerMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
TestSchedulerMachine = SchedulerMachine.TestCase
